"""EMA: against torch's AveragedModel, when it updates, what validation and
the model after the fit hold, its errors, and exact resume (also after SIGKILL)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import Crash, child_env, kill_until_done, make_data, make_model, train
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from fitlib import Callback, HPOptimizer, fit, validate
from fitlib.callbacks import (
    EMA,
    Checkpoint,
    EarlyStopping,
    GradientAccumulation,
)
from fitlib.metrics import accuracy
from fitlib.serialization import safe_load
from fitlib.weight_averaging import WeightAverage

HERE = Path(__file__).parent


class TorchEMA(Callback):
    """The reference: torch's AveragedModel updated after every step."""

    order = 100

    def __init__(self, decay, use_buffers=True):
        self.decay, self.use_buffers = decay, use_buffers

    def on_train_begin(self, model):
        self.ref = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(self.decay),
                                 use_buffers=self.use_buffers)  # fmt: skip

    def on_step_end(self, model, skip_step):
        if not skip_step:
            self.ref.update_parameters(model)


def floats(module):
    """Parameters, then floating-point buffers: the order EMA follows them."""
    buffers = [b for b in module.buffers() if b.is_floating_point()]
    return [p.detach() for p in module.parameters()] + buffers


@pytest.mark.parametrize("buffers", ["average", "copy"])
def test_average_equals_torch_averaged_model(buffers):
    ema, ref = (
        EMA(decay=0.9, final="live", buffers=buffers),
        TorchEMA(0.9, buffers == "average"),
    )
    model = train([ema, ref], epochs=3)
    ours = [a for a in ema.average.averages if a.is_floating_point()]
    theirs = floats(ref.ref.module)
    if buffers == "copy":
        theirs = [p.detach() for p in ref.ref.module.parameters()]
    assert ema.updates == 21 and int(ref.ref.n_averaged) == 21
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # and the live weights moved on: the average is not the model
    assert not torch.allclose(model[0].weight, ours[0])


def test_updates_only_after_optimizer_steps():
    ema, ref = EMA(decay=0.8, final="live"), TorchEMA(0.8)
    train([GradientAccumulation(n_batches=3), ema, ref], epochs=2)
    # 7 batches an epoch in groups of 3: steps after batches 3, 6, 7
    assert ema.updates == 6 == int(ref.ref.n_averaged)
    for a, b in zip(ema.average.averages[:4], floats(ref.ref.module)[:4], strict=True):
        torch.testing.assert_close(a, b)


def test_every_n_steps_and_start_step_choose_the_updates():
    ema = EMA(decay=0.5, every_n_steps=3, start_step=4)
    train([ema], epochs=2)  # 14 steps: updates after steps 7, 10, 13
    assert ema.updates == 3


def test_half_life_sets_the_decay_per_update():
    assert EMA(half_life=10).decay == pytest.approx(0.5**0.1)
    assert EMA(half_life=10, every_n_steps=5).decay == pytest.approx(0.5**0.5)
    assert EMA().decay == 0.999


def test_warmup_ramps_the_decay_as_tensorflow():
    w = nn.Parameter(torch.zeros(1))
    model = nn.Sequential()
    model.register_parameter("w", w)
    ema = EMA(decay=0.99, warmup=True)
    ema.on_train_begin(model=model, iteration=0, metrics=None)
    expected = 0.0
    for t in range(30):
        with torch.no_grad():
            w.fill_(float(t + 1))
        ema.on_step_end(skip_step=False, step=t)
        d = min(0.99, (1 + t) / (10 + t))
        expected = float(t + 1) if t == 0 else d * expected + (1 - d) * (t + 1)
    assert ema.average.averages[0].item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"decay": 0.9, "half_life": 5},
            ValueError,
            "give decay or half_life, not both",
        ),
        (
            {"decay": 1.0},
            ValueError,
            "EMA: decay must be a number in \\(0, 1\\); got 1.0",
        ),
        ({"half_life": 0}, ValueError, "EMA: half_life must be"),
        ({"every_n_steps": 0}, ValueError, "EMA: every_n_steps must be an int >= 1"),
        ({"validate_on": "avg"}, ValueError, "unknown validate_on value 'avg'"),
        ({"final": "lve"}, ValueError, "did you mean 'live'"),
        ({"buffers": "mean"}, ValueError, "unknown buffers value 'mean'"),
        ({"warmup": "yes"}, TypeError, "EMA: warmup must be True or False"),
    ],
)
def test_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        EMA(**kwargs)


def test_refuses_an_unknown_part_before_training():
    with pytest.raises(ValueError, match=r"EMA: unknown part 'head'.*Fix"):
        train([EMA(parts=["head"])])


def test_parts_average_only_the_named_submodule_with_several_optimizers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = {
        "0": HPOptimizer(model[0].parameters(), torch.optim.SGD, lr=0.1),
        "2": HPOptimizer(model[2].parameters(), torch.optim.Adam, lr=0.01),
    }
    ema = EMA(decay=0.5, parts=["2"], final="ema")
    before = model[0].weight.detach().clone()
    fit(2, model, F.cross_entropy, opt, make_data(), [ema])
    assert len(ema.average.averages) == 2  # the head's weight and bias
    assert torch.equal(model[2].weight, ema.average.averages[0])
    assert not torch.equal(model[0].weight, before)  # the other part trained, live


def run(validate_on, final="live", epochs=2):
    ema = EMA(decay=0.8, validate_on=validate_on, final=final)
    model, data = make_model(), make_data(shuffle=True)
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    history = fit(epochs, model, F.cross_entropy, opt, data, [ema], [accuracy])
    return model, ema, history, data


def test_validating_on_the_average_changes_no_training_step():
    live, _, h_live, _ = run("live")
    on_ema, ema, h_ema, data = run("ema")
    both, _, h_both, _ = run("both")
    for a, b, c in zip(
        *(m.state_dict().values() for m in (live, on_ema, both)), strict=True
    ):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert [r["train_loss"] for r in h_ema] == [r["train_loss"] for r in h_live]
    # "ema": the record's validation is the average's; "both": beside the live one
    assert [r["valid_loss"] for r in h_ema] == [r["ema_valid_loss"] for r in h_both]
    assert [r["accuracy"] for r in h_ema] == [r["ema_accuracy"] for r in h_both]
    assert [r["valid_loss"] for r in h_live] == [r["valid_loss"] for r in h_both]
    assert h_both[-1]["ema_valid_loss"] != h_both[-1]["valid_loss"]
    with ema.averaged():  # final="live": the average on demand
        again = validate(on_ema, data.valid_dl, F.cross_entropy)[0].item()
    assert again == pytest.approx(h_ema[-1]["valid_loss"], rel=1e-6)


def test_final_chooses_what_the_model_holds_after_the_fit():
    live, ema_live, _, _ = run("live", final="live")
    kept, ema, _, _ = run("live", final="ema")
    assert torch.equal(live[0].weight, ema_live.average._live()[0])
    assert torch.equal(kept[0].weight, ema.average.averages[0])
    assert torch.equal(kept[1].running_mean, ema.average.averages[6])  # after 6 params
    assert not torch.equal(kept[0].weight, live[0].weight)


class Suspend(Callback):
    def on_batch_end(self, iteration):
        if iteration == 9:
            return {"suspend": True, "stop_reason": "time is up"}


@pytest.mark.parametrize("end", [Crash(at=9), Suspend()], ids=["error", "suspend"])
def test_an_error_or_a_suspend_leaves_the_live_weights(end):
    model = make_model()
    ema = EMA(decay=0.5)
    try:
        train([ema, end], model=model)
    except RuntimeError as e:
        assert str(e) == "crash"
    assert ema.updates == 10
    assert not torch.equal(model[0].weight, ema.average.averages[0])


def test_early_stopping_watches_the_average_values():
    stop = EarlyStopping("ema_valid_loss", patience=0, min_delta=10.0)
    train([EMA(decay=0.5, validate_on="both"), stop], epochs=5)
    assert stop.stopped_epoch == 1


def test_monitors_check_the_names_it_adds():
    h = []
    cb = Callback.from_hooks(
        on_epoch_end=lambda record: h.append(record["ema_accuracy"])
    )
    train([EMA(decay=0.5, validate_on="both"), cb], epochs=1, metrics=[accuracy])
    assert isinstance(h[0], float)
    with pytest.raises(ValueError, match="ema_accuracy"):
        train([EMA(decay=0.5), EarlyStopping("ema_accuracy")], metrics=[accuracy])


def test_resume_after_a_crash_equals_an_unbroken_run(tmp_path):
    from helpers import resume_learner, same_weights

    ref_ema = EMA(decay=0.7, warmup=True, validate_on="both")
    ref = resume_learner([ref_ema])
    h_ref = ref.fit(3, lr=0.1)
    ema = EMA(decay=0.7, warmup=True, validate_on="both")
    crashed = resume_learner([Checkpoint(tmp_path, every_n_steps=1), ema, Crash(at=10)])
    with pytest.raises(RuntimeError, match="crash"):
        crashed.fit(3, lr=0.1)
    ema2 = EMA(decay=0.7, warmup=True, validate_on="both")
    resumed = resume_learner([Checkpoint(tmp_path), ema2])
    resumed.fit(3, lr=0.1)
    assert same_weights(ref, resumed)
    assert ema2.updates == ref_ema.updates == 21
    for a, b in zip(ema2.average.averages, ref_ema.average.averages, strict=True):
        assert torch.equal(a, b)
    rows = resumed.recorder.epoch_table()
    assert [r["ema_valid_loss"] for r in rows] == [r["ema_valid_loss"] for r in h_ref]


def test_checkpoint_best_file_keeps_live_weights_and_the_average(tmp_path):
    ema = EMA(decay=0.5, validate_on="both")
    model, opt = make_model(), None
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    ckpt = Checkpoint(tmp_path, monitor="ema_valid_loss")
    history = fit(3, model, F.cross_entropy, opt, make_data(), [ckpt, ema])
    values = [r["ema_valid_loss"] for r in history]
    best_epoch = values.index(min(values))
    best = safe_load(tmp_path / "best.pth")
    [(name, state)] = best["callbacks"]
    assert name == "EMA" and state["updates"] == 7 * (best_epoch + 1)
    live = best["model"]["0.weight"]  # the live weights, to resume from
    assert not torch.equal(live, state["averages"][0])


def test_exact_resume_after_sigkill(tmp_path):
    env = child_env()
    child = [sys.executable, str(HERE / "weight_averaging_child.py")]
    subprocess.run([*child, str(tmp_path / "ref"), str(tmp_path / "ref.pth"), "ema"],
                   env=env, check=True, capture_output=True)  # fmt: skip
    cmd = [*child, str(tmp_path / "ckpt"), str(tmp_path / "run.pth"), "ema"]
    kills = kill_until_done(cmd, env, seed=31)
    assert kills >= 2, "the run was too fast to kill: slow the child down"
    ref, run = safe_load(tmp_path / "ref.pth"), safe_load(tmp_path / "run.pth")
    assert run["state"]["updates"] == ref["state"]["updates"] == 56
    pairs = zip(run["state"]["averages"], ref["state"]["averages"], strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    untimed = [[{k: v for k, v in r.items() if k != "time"} for r in x["table"]]
               for x in (run, ref)]  # fmt: skip
    assert run["losses"] == ref["losses"] and untimed[0] == untimed[1]
    assert all(torch.equal(run["weights"][k], v) for k, v in ref["weights"].items())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_update_and_swap_make_no_host_sync_on_cuda():
    model = make_model().cuda()
    ema = EMA(decay=0.9, validate_on="both")
    ema.on_train_begin(model=model, iteration=0, metrics=None)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(5):
            ema.on_step_end(skip_step=False, step=step)
        ema.average.swap_in()
        ema.average.swap_out()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ema.updates == 5, f"expected 5 updates on the GPU, got {ema.updates}"
    assert all(a.device.type == "cuda" for a in ema.average.averages), (
        "the averages left the GPU: " + str({a.device for a in ema.average.averages})
    )


def torchrun(tmp_path, strategy):
    env = child_env(OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--log-dir={tmp_path / f'{strategy}-logs'}", "--nproc_per_node=2",
           str(HERE / "weight_averaging_child.py"), str(tmp_path),
           str(tmp_path / strategy), strategy]  # fmt: skip
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return [safe_load(tmp_path / f"{strategy}-rank{r}.pth") for r in range(2)]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
def test_ddp_keeps_one_average_on_every_rank_and_fsdp_each_rank_its_slices(tmp_path):
    d0, d1 = torchrun(tmp_path, "ddp")
    assert d0["world"] == 2 and d0["state"]["updates"] == d1["state"]["updates"] == 6
    for a, b in zip(d0["state"]["averages"], d1["state"]["averages"], strict=True):
        assert torch.equal(a, b)
    assert d0["table"] == d1["table"]  # one ema_valid_loss over the whole set
    f0, f1 = torchrun(tmp_path, "fsdp")
    assert f0["state"]["updates"] == f1["state"]["updates"] == 6
    for whole, s0, s1 in zip(d0["state"]["averages"], f0["state"]["averages"],
                             f1["state"]["averages"], strict=True):  # fmt: skip
        assert s0.numel() < whole.numel()  # a slice: no rank holds the whole
        torch.testing.assert_close(torch.cat([s0, s1]), whole, rtol=1e-5, atol=1e-6)
    ema_losses = [[r["ema_valid_loss"] for r in x["table"]] for x in (d0, f0)]
    assert ema_losses[1] == pytest.approx(ema_losses[0], rel=1e-5)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
def test_ddp_with_batch_norm_ends_with_one_model_on_every_rank(tmp_path):
    r0, r1 = torchrun(tmp_path, "ddp_bn")  # final="ema", BatchNorm buffers averaged
    assert r0["state"]["updates"] == r1["state"]["updates"] == 6
    for name, value in r0["model"].items():
        assert torch.equal(value, r1["model"][name]), f"{name} differs across ranks"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_average_stays_on_the_gpu_and_bf16_averages_in_float32():
    model = make_model().cuda()
    ema = EMA(decay=0.9, validate_on="both")
    train([ema], model=model, metrics=[accuracy])  # batches go to the model's device
    assert ema.updates == 14, (
        f"expected 14 updates (2 epochs x 7 steps), got {ema.updates}"
    )
    devices = {a.device.type for a in ema.average.averages}
    assert devices == {"cuda"}, f"the averages are on {devices}, not only cuda"
    assert torch.equal(model[0].weight, ema.average.averages[0]), (
        "final='ema': the model does not hold the average after the fit"
    )
    w = torch.zeros(1000, device="cuda", dtype=torch.bfloat16)
    avg = WeightAverage([w])
    avg.update(1.0)
    w.fill_(1.0)
    for _ in range(10):
        avg.update(0.001)
    got, want = avg.averages[0][0].item(), 1 - 0.999**10
    assert avg.averages[0].dtype == torch.float32, avg.averages[0].dtype
    assert abs(got - want) < 1e-6, f"bf16 weights averaged on cuda: {got} != {want}"


def test_learner_save_keeps_the_average_beside_the_live_weights(tmp_path):
    from helpers import resume_learner

    ema = EMA(decay=0.5)
    learn = resume_learner([ema])
    learn.path = tmp_path
    learn.fit(1, lr=0.1)
    path = learn.save("run")
    again = EMA(decay=0.5)
    other = resume_learner([again])
    other.path = tmp_path
    other.load("run")
    assert again.updates == ema.updates == 7
    saved = again.state_dict()["averages"]
    assert all(
        torch.equal(a, b) for a, b in zip(saved, ema.average.averages, strict=True)
    )
    assert path.exists()


def test_learner_save_after_a_default_fit_saves_the_average_as_the_model(tmp_path):
    from helpers import resume_learner

    ema = EMA(decay=0.5)  # final="ema": the live weights are gone after the fit
    learn = resume_learner([ema])
    learn.path = tmp_path
    learn.fit(1, lr=0.1)
    saved = safe_load(learn.save("run"))
    assert torch.equal(saved["model"]["0.weight"], ema.average.averages[0])


@pytest.mark.parametrize(
    ("validate_on", "final", "monitor"),
    [("ema", "ema", "valid_loss"), ("live", "ema", "valid_loss"),
     ("ema", "live", "valid_loss"), ("both", "live", "ema_valid_loss")],
)  # fmt: skip
def test_refuses_restore_best_when_the_average_is_ranked_or_kept(
    validate_on, final, monitor
):
    stop = EarlyStopping(monitor, restore_best=True)
    ema = EMA(decay=0.9, validate_on=validate_on, final=final)
    match = (r"EMA\(validate_on=.*EarlyStopping\(restore_best=True\).*"
             r"Fix: EarlyStopping\(restore_best=False\)")  # fmt: skip
    with pytest.raises(ValueError, match=match):
        train([ema, stop], epochs=1)
    assert ema.updates == 0  # refused before training


def test_restore_best_of_live_weights_validated_live_is_accepted():
    for validate_on in ("live", "both"):
        stop = EarlyStopping("valid_loss", restore_best=True)
        ema = EMA(decay=0.9, validate_on=validate_on, final="live")
        train([ema, stop], epochs=2)
        assert stop.best_weights is not None


@pytest.mark.parametrize(
    ("validate_on", "monitor"), [("ema", "valid_loss"), ("both", "ema_valid_loss")]
)
def test_refuses_a_weights_only_checkpoint_ranking_the_average(
    tmp_path, validate_on, monitor
):
    ckpt = Checkpoint(tmp_path, monitor=monitor, save_weights_only=True)
    match = (r"save_weights_only=True\): best.pth.*live weights.*"
             r"Fix: Checkpoint\(save_weights_only=False\)")  # fmt: skip
    with pytest.raises(ValueError, match=match):
        train([ckpt, EMA(decay=0.9, validate_on=validate_on)], epochs=1)
    ok = Checkpoint(tmp_path / "live", monitor="valid_loss", save_weights_only=True)
    train([ok, EMA(decay=0.9, validate_on="both")], epochs=1)  # ranks live weights


def test_the_average_of_a_loaded_best_checkpoint_is_the_ranked_one(tmp_path):
    from helpers import resume_learner

    learn = resume_learner([Checkpoint(tmp_path, monitor="valid_loss"), EMA(decay=0.9)])
    history = learn.fit(4, lr=0.3)
    best = min(r["valid_loss"] for r in history)
    ema = EMA(decay=0.9)  # a new process: load best.pth, use its average
    other = resume_learner([ema])
    other.load(tmp_path / "best.pth")
    live = other.validate()["valid_loss"]
    with ema.averaged(other.model):
        assert other.validate()["valid_loss"] == pytest.approx(best, rel=1e-6)
    assert other.validate()["valid_loss"] == live  # the live weights back
    ema.copy_to(other.model)
    assert other.validate()["valid_loss"] == pytest.approx(best, rel=1e-6)


def test_averaged_before_any_average_names_the_fix():
    match = r"no average yet.*ema.averaged\(learn"
    with pytest.raises(RuntimeError, match=match), EMA().averaged():
        pass


class _Boom(Callback):
    order = 100

    def __init__(self, exc):
        self.exc = exc

    def on_batch_end(self, train, num_batch, epoch):
        if not train and epoch == 1 and num_batch == 1:
            raise self.exc


class _LiveSnapshot(Callback):
    order = 200

    def on_batch_end(self, train, model):
        if train:
            self.live = {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()],
                         ids=["error", "interrupt"])  # fmt: skip
@pytest.mark.parametrize("validate_on", ["ema", "both"])
def test_an_error_inside_validation_leaves_the_live_weights(exc, validate_on):
    model, snap = make_model(), _LiveSnapshot()
    ema = EMA(decay=0.9, validate_on=validate_on)
    with pytest.raises(type(exc)):
        train([ema, _Boom(exc), snap], epochs=3, model=model)
    now = model.state_dict()
    assert all(torch.equal(v, now[k]) for k, v in snap.live.items())
    assert not ema.average.swapped


def test_an_early_stop_leaves_the_average_in_the_model():
    ema, model = EMA(decay=0.9), make_model()
    stop = EarlyStopping("valid_loss", patience=0, min_delta=10.0)
    train([ema, stop], epochs=6, model=model)
    assert stop.stopped_epoch == 1
    assert torch.equal(model[0].weight, ema.average.averages[0])


def test_refuses_swa_in_the_same_fit():
    from fitlib.callbacks import SWA

    with pytest.raises(ValueError, match=r"EMA and SWA in one fit.*Fix: keep one"):
        train([EMA(decay=0.9), SWA(swa_start=1)], epochs=2)


def test_refuses_a_start_step_the_fit_never_reaches():
    with pytest.raises(ValueError, match=r"start_step=1000 .*this fit has 14 "
                       r"batches.*Fix: a smaller start_step"):  # fmt: skip
        train([EMA(start_step=1000)], epochs=2)
    ema = EMA(start_step=13)  # 14 steps: one update, accepted
    train([ema], epochs=2)
    assert ema.updates == 1


def test_a_fit_shorter_than_two_half_lives_says_so(capsys):
    train([EMA(half_life=10)], epochs=1)  # 7 updates, half-life 10
    out = capsys.readouterr().out
    assert "EMA: the fit ended after 7 updates, under 2 half-lives (10 updates" in out
    train([EMA(half_life=3)], epochs=1)
    assert "half-lives" not in capsys.readouterr().out
