"""OptunaPruning under torchrun: 1 and 2 CPU processes (gloo) prune the same
trials on the same seeds, and every rank stops where rank 0 was told to."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import child_env

from fitlib.serialization import safe_load

HERE = Path(__file__).parent
pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is unavailable"
)


def search(tmp_path, seed, n):
    out = tmp_path / f"seed{seed}-n{n}"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--log-dir={out}-logs", f"--nproc_per_node={n}",
           str(HERE / "optuna_dist_child.py"), str(seed), str(out)]  # fmt: skip
    run = subprocess.run(cmd, env=child_env(OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return [safe_load(out / f"rank{r}.pth") for r in range(n)]


@pytest.mark.parametrize("seed", [0, 1])
def test_one_and_two_processes_prune_the_same_trials(tmp_path, seed):
    (one,) = search(tmp_path, seed, 1)
    r0, r1 = search(tmp_path, seed, 2)
    assert (one["world"], r0["world"], r1["world"]) == (1, 2, 2)
    states = [state for state, _ in one["trials"]]
    assert [state for state, _ in r0["trials"]] == states
    assert "PRUNED" in states and "COMPLETE" in states
    for (_, a), (_, b) in zip(one["trials"], r0["trials"], strict=True):
        assert sorted(a) == sorted(b)  # the same optimizer steps: 2, 3, 4, ...
        assert list(a.values()) == pytest.approx(list(b.values()), rel=1e-5)
    # Rank 1 had no trial: it stopped at the step rank 0 pruned at, its fit
    # raised TrialPruned too, and it saw the same values.
    assert r1["raised"] == [state == "PRUNED" for state in states]
    for mine, main in zip(r1["seen"], r0["seen"], strict=True):
        assert mine["lr"] == main["lr"] and mine["pruned_at"] == main["pruned_at"]
        assert mine["reported"] == main["reported"]
