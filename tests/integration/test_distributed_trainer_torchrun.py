"""Distributed training under torchrun: 2 CPU processes with gloo, as in CI."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import child_env, make_dataset
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

from fitlib import validate
from fitlib.metrics import F1Score, accuracy
from fitlib.serialization import safe_load

HERE = Path(__file__).parent
pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is unavailable"
)


def torchrun(mode, out, n=2):
    env = child_env(OMP_NUM_THREADS="1")
    child = str(HERE / "dist_child.py")
    # --log-dir beside out: without it each launch leaves a /tmp/torchelastic_*
    logs = out.parent / f"{out.name}-torchrun-logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--log-dir={logs}", f"--nproc_per_node={n}", child, mode,
           str(out)]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def results(out, n=2):
    return [safe_load(out / f"rank{r}.pth") for r in range(n)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``trained(mode)``: the output folder and process of a run that
    succeeded, launched once per mode for the whole module."""
    done = {}

    def get(mode):
        if mode not in done:
            out = tmp_path_factory.mktemp(mode)
            run = torchrun(mode, out)
            assert run.returncode == 0, run.stderr[-3000:]
            done[mode] = out, run
        return done[mode]

    return get


def test_ranks_end_with_identical_weights(trained):
    r0, r1 = results(trained("plain")[0])
    assert r0["world"] == r1["world"] == 2
    assert all(torch.equal(v, r1["weights"][k]) for k, v in r0["weights"].items())


def test_fsdp_trains_as_ddp_does(trained):
    ddp, fsdp = results(trained("plain")[0])[0], results(trained("fsdp")[0])[0]
    assert fsdp["weights"].keys() == ddp["weights"].keys()
    for k, v in ddp["weights"].items():
        assert torch.allclose(fsdp["weights"][k], v, atol=1e-6), k
    # TrainStats's norms, each over the slices of every rank.
    assert fsdp["grad_norms"] == pytest.approx(ddp["grad_norms"], rel=1e-5)
    assert len(ddp["grad_norms"]) == 4  # 9 steps (3 epochs of 3), every 2nd
    assert results(trained("fsdp")[0])[1]["weights"] == {}  # gathered on rank 0


@pytest.mark.parametrize("mode", ["plain", "fsdp"])
def test_reduced_validation_equals_one_process_over_the_whole_set(trained, mode):
    from dist_child import model

    # 5 validation batches: 3 on rank 0, 2 on rank 1 (under FSDP, in lockstep)
    r0, r1 = results(trained(mode)[0])
    net = model()
    net.load_state_dict(r0["weights"])
    valid = DataLoader(make_dataset(37, seed=1), 8)
    loss, acc, f1 = validate(net, valid, F.cross_entropy, metrics=[accuracy, F1Score()])
    for r in (r0, r1):
        assert r["valid_loss"] == pytest.approx(loss.item(), rel=1e-12)
        assert r["metrics"] == pytest.approx([acc.item(), f1.item()], rel=1e-12)


def test_validations_inside_epochs_give_every_rank_the_same_records(trained):
    # 96 samples by 16, halved per rank: 3 steps an epoch; a validation every 2.
    r0, r1 = results(trained("schedule")[0])
    steps = [(r["epoch"], r["step"]) for r in r0["records"]]
    assert steps == [(0, 2), (0, 3), (1, 4), (1, 6), (2, 8), (2, 9)]
    assert r0["records"] == r1["records"]  # losses and metrics over both ranks
    assert all(r["valid_loss"] is not None for r in r0["records"])


def test_ddp_trains_compiled_as_it_trains_plain(trained):
    plain, compiled = results(trained("plain")[0]), results(trained("compile")[0])
    assert compiled[0]["graphs"] > 0 and compiled[1]["graphs"] > 0
    for k, v in plain[0]["weights"].items():
        assert torch.allclose(compiled[0]["weights"][k].float(), v.float(),
                              rtol=1e-5, atol=1e-6), k  # fmt: skip
    assert compiled[0]["valid_loss"] == pytest.approx(plain[0]["valid_loss"], rel=1e-5)


def test_logs_and_files_are_written_once(trained):
    out, run = trained("plain")
    lines = (out / "log.csv").read_text().splitlines()
    assert len(lines) == 4  # header and 3 epochs, not one set per rank
    table = [line for line in run.stdout.splitlines() if line.startswith("epoch")]
    assert len(table) == 1


@pytest.mark.parametrize("mode", ["parts", "fsdp_parts"])
def test_one_optimizer_per_layer_trains_as_one_optimizer(trained, mode):
    one = results(trained(mode.removesuffix("parts").strip("_") or "plain")[0])
    for per_layer, single in zip(results(trained(mode)[0]), one):
        for k, v in single["weights"].items():
            assert torch.equal(per_layer["weights"][k], v), k
        assert per_layer["grad_norms"] == single["grad_norms"]


@pytest.mark.parametrize(
    # FSDP with parts: each part goes through the one-optimizer path too.
    ("prefix", "suffix"),
    [("", ""), ("fsdp_", "_parts")],
)
def test_a_checkpoint_written_by_two_ranks_resumes_exactly(tmp_path, prefix, suffix):
    ref = tmp_path / "ref"
    assert torchrun(f"{prefix}checkpoint{suffix}", ref).returncode == 0
    crashed = torchrun(f"{prefix}crash{suffix}", tmp_path / "run")
    assert crashed.returncode != 0 and "simulated crash" in crashed.stderr
    resumed = torchrun(f"{prefix}checkpoint{suffix}", tmp_path / "run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.count("resuming from") == 1
    for a, b in zip(results(ref), results(tmp_path / "run")):
        assert all(torch.equal(v, b["weights"][k]) for k, v in a["weights"].items())
        assert a["grad_norms"] == b["grad_norms"]  # TrainStats resumed with the run
        # The resumed epoch's train_loss: the mean over both ranks' losses.
        assert len(b["train_losses"]) == 2  # epochs 1 (resumed inside) and 2
        assert b["train_losses"] == pytest.approx(a["train_losses"][1:], rel=1e-9)


@pytest.mark.parametrize("mode", ["accumulate", "fsdp_accumulate"])
def test_accumulation_skips_gradient_sync_but_equals_a_larger_batch(trained, mode):
    acc, big = results(trained(mode)[0])[0], results(trained("big")[0])[0]
    for k, v in big["weights"].items():
        if v.is_floating_point():
            assert torch.allclose(acc["weights"][k], v, atol=1e-5), k


def test_a_nan_loss_on_one_rank_stops_every_rank_at_the_same_batch(tmp_path):
    run = torchrun("nan", tmp_path)  # rank 1's loss is NaN at iteration 4
    assert run.returncode == 0, run.stderr[-3000:]  # no rank left waiting
    r0, r1 = results(tmp_path)
    assert r0["nan"][:2] == r1["nan"][:2] == [4, 4]
    assert r0["nan"][2] == r1["nan"][2]  # the same iterations ran
    assert run.stderr.count("TerminateOnNaN: training loss was nan") == 1


def test_a_world_larger_than_the_data_is_a_clear_error(tmp_path):
    run = torchrun("tiny", tmp_path)
    assert run.returncode != 0
    assert "valid_dl has 1 batches for 2 processes" in run.stderr


def test_a_rank_that_fails_brings_the_group_down_with_its_error(tmp_path):
    run = torchrun("rank1_fails", tmp_path)  # rank 0 would wait on rank 1
    assert run.returncode != 0
    assert "simulated crash on rank 1" in run.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for NCCL")
@pytest.mark.parametrize("mode", ["plain", "fsdp"])
def test_nccl_with_one_process_on_the_gpu(tmp_path, mode):
    run = torchrun(mode, tmp_path, n=1)
    assert run.returncode == 0, run.stderr[-3000:]
    assert results(tmp_path, n=1)[0]["world"] == 1
