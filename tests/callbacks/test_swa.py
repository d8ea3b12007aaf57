"""SWA: against torch's AveragedModel, SWALR and update_bn, its lr beside a
schedule, its errors, and exact resume (also after SIGKILL)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import Crash, child_env, kill_until_done, make_data, make_model
from torch.nn import functional as F  # noqa: N812
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn

from fitlib import Callback, HPOptimizer, fit
from fitlib.callbacks import SWA, Checkpoint, ParamScheduler, linear
from fitlib.serialization import safe_load

HERE = Path(__file__).parent


class TorchSWA(Callback):
    """The reference: AveragedModel updated at each epoch end from swa_start."""

    order = 100

    def __init__(self, swa_start):
        self.swa_start = swa_start

    def on_train_begin(self, model):
        self.ref = AveragedModel(model)

    def on_epoch_end(self, model, epoch):
        if epoch >= self.swa_start:
            self.ref.update_parameters(model)


def fitted(callbacks, epochs=5, model=None, data=None, lr=0.1):
    model = model or make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=lr)
    data = data or make_data()
    history = fit(epochs, model, F.cross_entropy, opt, data, list(callbacks))
    return model, history, data


def test_average_and_batch_norm_equal_averaged_model_and_update_bn():
    swa, ref = SWA(swa_start=2), TorchSWA(2)
    model, _, data = fitted([swa, ref])
    assert swa.updates == 3 == int(ref.ref.n_averaged)
    update_bn(data.train_dl, ref.ref)
    ours = dict(model.state_dict())
    theirs = {k.removeprefix("module."): v for k, v in ref.ref.state_dict().items()}
    for name, value in ours.items():
        torch.testing.assert_close(value, theirs[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip


def test_lr_follows_swalr_per_epoch():
    swa = SWA(swa_start=1, swa_lr=0.01, anneal_epochs=3, anneal_strategy="cos")
    _, history, _ = fitted([swa], epochs=6)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    sched, expected = None, [0.1]  # epoch 0: before SWA
    for _ in range(1, 6):
        if sched is None:
            sched = SWALR(opt, swa_lr=0.01, anneal_epochs=3, anneal_strategy="cos")
        expected.append(opt.param_groups[0]["lr"])
        opt.step()  # (torch warns of a scheduler stepped before its optimizer)
        sched.step()
    assert [r["lr"] for r in history] == pytest.approx(expected, rel=1e-12)


def test_anneal_epochs_zero_jumps_to_swa_lr_and_linear_anneals_linearly():
    swa = SWA(swa_start=0.5, swa_lr=0.02, anneal_epochs=0)
    _, history, _ = fitted([swa], epochs=4)
    assert [r["lr"] for r in history] == pytest.approx([0.1, 0.1, 0.02, 0.02])
    swa = SWA(swa_start=1, swa_lr=0.02, anneal_epochs=2, anneal_strategy="linear")
    _, history, _ = fitted([swa], epochs=4)
    assert [r["lr"] for r in history] == pytest.approx([0.1, 0.1, 0.06, 0.02])


def test_its_lr_wins_over_a_schedule_from_swa_start_on():
    sched = ParamScheduler({"lr": linear(0.1, 0.0)})
    swa = SWA(swa_start=2, swa_lr=0.05, anneal_epochs=0)
    _, history, _ = fitted([sched, swa], epochs=4)
    lrs = [r["lr"] for r in history]
    assert lrs[0] > lrs[1] > 0.05  # the schedule's, decreasing
    assert lrs[2:] == pytest.approx([0.05, 0.05])


def test_without_swa_lr_the_lr_is_left_alone():
    _, history, _ = fitted([SWA(swa_start=1)], epochs=3)
    assert [r["lr"] for r in history] == [0.1, 0.1, 0.1]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"swa_start": 1.5}, ValueError, "SWA: swa_start must be an epoch"),
        ({"swa_start": -1}, ValueError, "SWA: swa_start must be an int >= 0"),
        ({"swa_lr": 0}, ValueError, "SWA: swa_lr must be"),
        ({"anneal_epochs": 1.0}, TypeError, "SWA: anneal_epochs must be an int"),
        ({"anneal_strategy": "cosine"}, ValueError, "did you mean 'cos'"),
    ],
)
def test_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        SWA(**kwargs)


def test_a_fraction_needs_epochs():
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"SWA: swa_start=0\.5 is a fraction"):
        fit(None, model, F.cross_entropy, opt, make_data(), [SWA(0.5)], max_steps=5)


class Suspend(Callback):
    def on_batch_end(self, iteration):
        if iteration == 16:
            return {"suspend": True, "stop_reason": "time is up"}


@pytest.mark.parametrize("end", [Crash(at=16), Suspend()], ids=["error", "suspend"])
def test_an_error_or_a_suspend_leaves_the_live_weights(end):
    model = make_model()
    swa = SWA(swa_start=0)
    try:
        fitted([swa, end], model=model)  # after 2 epochs averaged
    except RuntimeError as e:
        assert str(e) == "crash"
    assert swa.updates == 2
    assert not torch.equal(model[0].weight, swa.average.averages[0])


def test_a_finished_fit_leaves_the_average():
    model, _, _ = fitted([swa := SWA(swa_start=0)], epochs=2, model=make_model())
    assert torch.equal(model[0].weight, swa.average.averages[0])


def test_resume_after_a_crash_equals_an_unbroken_run(tmp_path):
    from helpers import resume_learner, same_weights

    def swa():
        return SWA(swa_start=1, swa_lr=0.05, anneal_epochs=2)

    ref = resume_learner([ref_swa := swa()])
    ref.fit(4, lr=0.1)
    crashed = resume_learner(
        [Checkpoint(tmp_path, every_n_steps=1), swa(), Crash(at=17)]
    )
    with pytest.raises(RuntimeError, match="crash"):
        crashed.fit(4, lr=0.1)
    resumed = resume_learner([Checkpoint(tmp_path), again := swa()])
    resumed.fit(4, lr=0.1)
    assert same_weights(ref, resumed)
    assert again.updates == ref_swa.updates == 3
    assert again.lr0 == ref_swa.lr0 == [0.1]
    assert resumed.recorder.lrs == ref.recorder.lrs


def test_exact_resume_after_sigkill(tmp_path):
    env = child_env()
    child = [sys.executable, str(HERE / "weight_averaging_child.py")]
    subprocess.run([*child, str(tmp_path / "ref"), str(tmp_path / "ref.pth"), "swa"],
                   env=env, check=True, capture_output=True)  # fmt: skip
    cmd = [*child, str(tmp_path / "ckpt"), str(tmp_path / "run.pth"), "swa"]
    kills = kill_until_done(cmd, env, seed=32)
    assert kills >= 2, "the run was too fast to kill: slow the child down"
    ref, run = safe_load(tmp_path / "ref.pth"), safe_load(tmp_path / "run.pth")
    assert run["state"]["updates"] == ref["state"]["updates"] == 5
    assert run["losses"] == ref["losses"] and run["lrs"] == ref["lrs"]
    assert all(torch.equal(run["weights"][k], v) for k, v in ref["weights"].items())


def test_refuses_a_swa_start_at_or_after_the_fits_last_epoch():
    with pytest.raises(ValueError, match=r"swa_start=10, but this fit has 3 epoch\(s\)"
                       r".*Fix: a swa_start below 3"):  # fmt: skip
        fitted([SWA(swa_start=10, swa_lr=0.01)], epochs=3)
    with pytest.raises(ValueError, match="swa_start=3, but this fit has 3"):
        fitted([SWA(swa_start=3)], epochs=3)
    swa = SWA(swa_start=2)
    fitted([swa], epochs=3)
    assert swa.updates == 1


def test_says_once_which_schedulers_its_lr_overrides(capsys):
    from fitlib.callbacks import OneCycleScheduler

    fitted([OneCycleScheduler(0.1), SWA(swa_start=3, swa_lr=0.01)], epochs=5)
    out = capsys.readouterr().out
    line = (
        "SWA: from epoch 3 on, the lr is SWA's (swa_lr=0.01), over OneCycleScheduler's"
    )
    assert out.count(line) == 1
    fitted([OneCycleScheduler(0.1), SWA(swa_start=3)], epochs=5)  # lr left alone
    assert "SWA: from epoch" not in capsys.readouterr().out


def test_refuses_reduce_lr_on_plateau_with_its_own_lr():
    from fitlib.callbacks import ReduceLROnPlateau

    plateau = ReduceLROnPlateau("valid_loss", patience=0)
    with pytest.raises(ValueError, match=r"SWA\(swa_lr=0.05\) and ReduceLROnPlateau:"
                       r".*dropped.*Fix: SWA\(swa_lr=None\)"):  # fmt: skip
        fitted([SWA(swa_start=2, swa_lr=0.05), plateau], epochs=4)
    swa = SWA(swa_start=2)  # without swa_lr the plateau keeps the lr: accepted
    fitted([swa, ReduceLROnPlateau("valid_loss", patience=0)], epochs=4)
    assert swa.updates == 2


def test_an_early_stop_leaves_the_average_in_the_model():
    from fitlib.callbacks import EarlyStopping

    swa = SWA(swa_start=0)
    stop = EarlyStopping("valid_loss", patience=0, min_delta=10.0)
    model, history, _ = fitted([swa, stop], epochs=6)
    assert len(history) == 2 and swa.updates == 2
    assert torch.equal(model[0].weight, swa.average.averages[0])
