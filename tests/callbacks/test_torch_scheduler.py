import collections
import functools
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import Crash, make_data, make_dataset, make_model
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.optim import lr_scheduler as torch_sched
from torch.utils.data import DataLoader

from fitlib import DataBunch, HPOptimizer, Learner, MultiOptimizer, fit
from fitlib.callbacks import (
    Checkpoint,
    GradientAccumulation,
    OneCycleScheduler,
    ParamScheduler,
    Recorder,
    ReduceLROnPlateau,
    TorchScheduler,
    ValidationSchedule,
    constant,
)

N_BATCHES = 7  # make_data(): 100 samples in batches of 16


def run(*callbacks, epochs=2, lr=0.1, opt_func=torch.optim.SGD, model=None):
    """Fits make_model() with the callbacks and a Recorder; returns (the
    Recorder, the optimizer, the history)."""
    model = model or make_model()
    opt = HPOptimizer(model.parameters(), opt_func, lr=lr)
    rec = Recorder()
    history = fit(epochs, model, F.cross_entropy, opt, make_data(),
                  callbacks=[*callbacks, rec])  # fmt: skip
    return rec, opt, history


def plain_lrs(make, n_steps, lr=0.1, step_every=1):
    """The lr of each of ``n_steps`` optimizer steps of a hand-written loop
    stepping the torch scheduler every ``step_every`` optimizer steps."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)
    sched, lrs = make(opt), []
    for i in range(1, n_steps + 1):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        if i % step_every == 0:
            sched.step()
    return lrs


SCHEDULERS = {
    "step": lambda o: torch_sched.StepLR(o, step_size=3, gamma=0.5),
    "exponential": lambda o: torch_sched.ExponentialLR(o, gamma=0.8),
    "multiplicative": lambda o: torch_sched.MultiplicativeLR(o, lambda e: 0.9),
    "cosine": lambda o: torch_sched.CosineAnnealingLR(o, T_max=5),
    "lambda": lambda o: torch_sched.LambdaLR(o, lambda e: 1 / (1 + e)),
    "multistep": lambda o: torch_sched.MultiStepLR(o, milestones=[2, 9], gamma=0.1),
}


# -- the schedule ------------------------------------------------------------------
@pytest.mark.parametrize("name", SCHEDULERS)
def test_each_step_uses_the_lr_a_hand_written_torch_loop_uses(name):
    rec, _, history = run(TorchScheduler(SCHEDULERS[name]))
    assert rec.lrs == plain_lrs(SCHEDULERS[name], 2 * N_BATCHES)
    # The record's lr is the one the epoch's last step used.
    assert [r["lr"] for r in history] == [rec.lrs[N_BATCHES - 1], rec.lrs[-1]]


def test_interval_epoch_steps_once_per_epoch_after_validation():
    halve = TorchScheduler(lambda o: torch_sched.StepLR(o, 1, 0.5), interval="epoch")
    rec, opt, history = run(halve, epochs=3)
    assert rec.lrs == [0.1] * N_BATCHES + [0.05] * N_BATCHES + [0.025] * N_BATCHES
    assert [r["lr"] for r in history] == [0.1, 0.05, 0.025]  # what steps used
    assert opt.lr == 0.0125  # after the last epoch


def test_interval_epoch_steps_also_in_epochs_without_validation():
    halve = TorchScheduler(lambda o: torch_sched.StepLR(o, 1, 0.5), interval="epoch")
    _, opt, history = run(halve, ValidationSchedule(every_n_epochs=2), epochs=4)
    assert [r["valid_loss"] is None for r in history] == [True, False, True, False]
    assert opt.lr == 0.1 * 0.5**4


def test_validations_inside_an_epoch_do_not_step_an_epoch_scheduler():
    halve = TorchScheduler(lambda o: torch_sched.StepLR(o, 1, 0.5), interval="epoch")
    _, opt, history = run(halve, ValidationSchedule(every_n_steps=3), epochs=2)
    assert len(history) > 2  # records inside the epochs
    assert opt.lr == 0.1 * 0.5**2


@pytest.mark.parametrize("frequency", [2, 3])
def test_frequency_steps_the_scheduler_every_n_intervals(frequency):
    make = SCHEDULERS["exponential"]
    rec, _, _ = run(TorchScheduler(make, frequency=frequency))
    assert rec.lrs == plain_lrs(make, 2 * N_BATCHES, step_every=frequency)
    halve = TorchScheduler(
        lambda o: torch_sched.StepLR(o, 1, 0.5), interval="epoch", frequency=frequency
    )
    _, opt, _ = run(halve, epochs=4)
    assert opt.lr == 0.1 * 0.5 ** (4 // frequency)


def test_batches_that_do_not_step_do_not_count():
    make = SCHEDULERS["exponential"]
    rec, _, _ = run(GradientAccumulation(2), TorchScheduler(make))
    # 7 batches: steps at batches 1, 3, 5, 6 of each epoch (4 per epoch).
    stepping = [1, 3, 5, 6, 8, 10, 12, 13]
    assert [rec.lrs[i] for i in stepping] == plain_lrs(make, 8)


def test_momentum_follows_one_cycle_lr_with_mom_true():
    def make(o):
        return torch_sched.OneCycleLR(o, max_lr=0.1, total_steps=2 * N_BATCHES)

    rec, _, _ = run(TorchScheduler(make, mom=True), opt_func=torch.optim.Adam)
    opt = torch.optim.Adam([nn.Parameter(torch.zeros(1))], lr=0.1)
    sched, lrs, moms = make(opt), [], []
    for _ in range(2 * N_BATCHES):
        lrs.append(opt.param_groups[0]["lr"])
        moms.append(opt.param_groups[0]["betas"][0])
        opt.step()
        sched.step()
    assert rec.lrs == lrs and rec.moms == moms


def test_a_second_fit_starts_the_schedule_again_from_the_optimizers_lr():
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    make = SCHEDULERS["step"]
    sched, first, second = TorchScheduler(make), Recorder(), Recorder()
    fit(2, model, F.cross_entropy, opt, make_data(), callbacks=[sched, first])
    opt.lr = 0.2  # a new rate for the second fit
    fit(2, model, F.cross_entropy, opt, make_data(), callbacks=[sched, second])
    assert first.lrs == plain_lrs(make, 2 * N_BATCHES)
    assert second.lrs == plain_lrs(make, 2 * N_BATCHES, lr=0.2)


# -- the stand-in optimizer, tensor hyper-parameters ----------------------------------
def test_the_factory_gets_a_stand_in_and_the_fits_optimizer_is_left_alone():
    seen = []

    def make(o):
        seen.append((type(o), [g["lr"] for g in o.param_groups], o.defaults["betas"]))
        return torch_sched.StepLR(o, 1, 0.5)

    body, head = nn.Linear(8, 16), nn.Linear(16, 3)
    groups = [{"params": list(body.parameters())}, {"params": list(head.parameters())}]
    adam = functools.partial(torch.optim.Adam, foreach=False)  # (tensor betas)
    opt = HPOptimizer(groups, adam, lr=[0.01, 0.1])
    opt.hypers_as_tensors()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(1, nn.Sequential(body, nn.ReLU(), head), F.cross_entropy, opt,
            make_data(), callbacks=[TorchScheduler(make)])  # fmt: skip
    # the same class and groups, its hyper-parameters as Python floats
    assert seen == [(torch.optim.Adam, [0.01, 0.1], (0.9, 0.999))]
    assert opt.lr == [0.01 * 0.5**N_BATCHES, 0.1 * 0.5**N_BATCHES]
    # torch's scheduler never touched the fit's optimizer, nor warned
    assert all("initial_lr" not in g for g in opt.param_groups)
    assert not hasattr(opt.opt.step, "_wrapped_by_lr_sched")
    assert not [w for w in caught if "lr_scheduler" in str(w.message)]


def host_reads(monkeypatch):
    """Counts ``Tensor.__float__`` and ``Tensor.item`` calls by the caller's
    file:line (a read of the device at each on a GPU)."""
    reads = collections.Counter()
    for name in ("__float__", "item"):
        original = getattr(torch.Tensor, name)

        def read(self, *args, _original=original):
            caller = sys._getframe(1)
            reads[f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}"] += 1
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, read)
    return reads


def plain_rates(make, n_steps, opt_func):
    """(lrs, moms) of each of ``n_steps`` steps of a hand-written loop on a
    float optimizer stepping the torch scheduler after each step."""
    opt = opt_func([nn.Parameter(torch.zeros(1))], lr=0.1)
    sched, lrs, moms = make(opt), [], []
    for _ in range(n_steps):
        group = opt.param_groups[0]
        lrs.append(group["lr"])
        moms.append(group["betas"][0] if "betas" in group else group["momentum"])
        opt.step()
        sched.step()
    return lrs, moms


TENSOR_HYPERS = {
    "sgd_exponential": (torch.optim.SGD, SCHEDULERS["exponential"], False),
    "adam_one_cycle": (
        functools.partial(torch.optim.Adam, foreach=False),  # (tensor betas)
        lambda o: torch_sched.OneCycleLR(o, 0.1, total_steps=2 * N_BATCHES),
        True,
    ),
}


@pytest.mark.parametrize("case", TENSOR_HYPERS)
def test_with_tensor_hypers_no_step_reads_the_device_and_rates_stay_exact(
    monkeypatch, case
):
    opt_func, make, mom = TENSOR_HYPERS[case]
    model = make_model()
    opt = HPOptimizer(model.parameters(), opt_func, lr=0.1)
    assert "lr" in opt.hypers_as_tensors()  # what Compile(step=True) calls
    rec, reads = Recorder(), host_reads(monkeypatch)
    history = fit(2, model, F.cross_entropy, opt, make_data(),
                  callbacks=[TorchScheduler(make, mom=mom), rec])  # fmt: skip
    monkeypatch.undo()
    ours = [k for k in reads if k.startswith(("torch_scheduler.py", "optim.py"))]
    assert ours == []
    # the float schedule, bit for bit (not rounded to the tensors' float32)
    lrs, moms = plain_rates(make, 2 * N_BATCHES, opt_func)
    assert rec.lrs == lrs and (rec.moms == moms or not mom)
    assert [r["lr"] for r in history] == [lrs[N_BATCHES - 1], lrs[-1]]
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)  # still the tensor


# -- composing with the other schedules ----------------------------------------------
def test_a_second_lr_schedule_is_refused_before_training():
    torch_lr = TorchScheduler(SCHEDULERS["step"])
    with pytest.raises(ValueError, match=r"OneCycleScheduler and TorchScheduler.*'lr'"):
        run(OneCycleScheduler(max_lr=0.1), torch_lr)
    with pytest.raises(ValueError, match=r"both set 'mom'"):
        one_cycle = lambda o: torch_sched.OneCycleLR(o, 0.1, total_steps=14)  # noqa: E731
        run(TorchScheduler(one_cycle, mom=True), ParamScheduler({"mom": constant(0.9)}))


def test_a_momentum_schedule_composes_with_a_torch_lr_schedule():
    moms = ParamScheduler({"mom": constant(0.8)})
    rec, opt, _ = run(TorchScheduler(SCHEDULERS["step"]), moms)
    assert rec.lrs == plain_lrs(SCHEDULERS["step"], 2 * N_BATCHES)
    assert opt.mom == 0.8


def test_a_plateau_reduction_scales_the_torch_schedule_after_it():
    make = SCHEDULERS["cosine"]  # a chained formula: it reads the group's lr
    # mode="max" on a falling loss: every epoch after the first is bad.
    plateau = ReduceLROnPlateau("train_loss", mode="max", factor=0.5)
    rec, _, _ = run(TorchScheduler(make), plateau, epochs=4)
    assert plateau.reductions == [1, 2, 3]  # after epochs 1 and 2, then 3
    expected = plain_lrs(make, 4 * N_BATCHES)
    factors = [1.0] * 2 * N_BATCHES + [0.5] * N_BATCHES + [0.25] * N_BATCHES
    assert rec.lrs[: 2 * N_BATCHES] == expected[: 2 * N_BATCHES]
    assert rec.lrs == pytest.approx([e * f for e, f in zip(expected, factors)])


# -- several optimizers --------------------------------------------------------------
def two_parts():
    torch.manual_seed(0)
    body, head = nn.Linear(8, 16), nn.Linear(16, 3)
    opt = MultiOptimizer({
        "body": HPOptimizer(body.parameters(), torch.optim.SGD, lr=0.1),
        "head": HPOptimizer(head.parameters(), torch.optim.Adam, lr=0.01),
    })  # fmt: skip
    return nn.Sequential(body, nn.ReLU(), head), opt


def test_each_part_of_several_optimizers_gets_its_own_scheduler():
    model, opt = two_parts()
    halve = TorchScheduler(lambda o: torch_sched.StepLR(o, 1, 0.5), interval="epoch")
    fit(2, model, F.cross_entropy, opt, make_data(), callbacks=[halve])
    assert len(halve.schedulers) == 2
    assert opt.lr == [0.1 * 0.25, 0.01 * 0.25]


def test_part_schedules_one_part_and_the_other_keeps_its_rate():
    model, opt = two_parts()
    halve = TorchScheduler(
        lambda o: torch_sched.StepLR(o, 1, 0.5), interval="epoch", part="head"
    )
    assert halve.sets_hypers == ("head.lr",)
    fit(2, model, F.cross_entropy, opt, make_data(), callbacks=[halve])
    assert opt.lr == [0.1, 0.01 * 0.25]
    model, opt = two_parts()
    tail = TorchScheduler(SCHEDULERS["step"], part="tail")
    with pytest.raises(ValueError, match=r"part='tail'.*\['body', 'head'\]"):
        fit(1, model, F.cross_entropy, opt, make_data(), callbacks=[tail])


# -- errors before training ----------------------------------------------------------
@pytest.mark.parametrize("factory", [None, 3, "StepLR"])
def test_a_factory_that_is_not_a_function_is_refused(factory):
    with pytest.raises(TypeError, match=r"factory must be a function of the optimizer"):
        TorchScheduler(factory)


def test_a_scheduler_instead_of_a_factory_is_refused_with_the_fix():
    made = torch_sched.StepLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))]), 2)
    with pytest.raises(TypeError, match=r"exists only once the fit begins.*lambda opt"):
        TorchScheduler(made)


@pytest.mark.parametrize(
    ("cls", "fix"),
    [
        (torch_sched.StepLR, r"StepLR\(opt, step_size=\.\.\.\)"),
        (torch_sched.CosineAnnealingLR, r"CosineAnnealingLR\(opt, T_max=\.\.\.\)"),
        (torch_sched.ExponentialLR, r"ExponentialLR\(opt, gamma=\.\.\.\)"),
    ],
)
def test_a_scheduler_class_instead_of_a_factory_is_refused_when_made(cls, fix):
    match = rf"factory is the class {cls.__name__}.*Fix: TorchScheduler\(lambda opt: "
    with pytest.raises(TypeError, match=rf"TorchScheduler: {match}{fix}\)"):
        TorchScheduler(cls)


def test_a_scheduler_class_that_takes_the_optimizer_alone_is_a_factory():
    rec, _, _ = run(TorchScheduler(torch_sched.ConstantLR), epochs=1)
    # ConstantLR: a third of the lr for 5 steps, then the lr
    assert rec.lrs[:6] == pytest.approx([0.1 / 3] * 5 + [0.1])


@pytest.mark.parametrize("interval", ["batch", "Step", None, 1])
def test_a_bad_interval_is_refused(interval):
    with pytest.raises(ValueError, match=r"interval must be 'step' or 'epoch'"):
        TorchScheduler(SCHEDULERS["step"], interval=interval)


@pytest.mark.parametrize("frequency", [0, -1, 1.5, True])
def test_a_bad_frequency_is_refused(frequency):
    with pytest.raises(ValueError, match=r"frequency must be an int >= 1"):
        TorchScheduler(SCHEDULERS["step"], frequency=frequency)


def refused_before_a_step(factory, error, match, **kwargs):
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(error, match=match):
        run(TorchScheduler(factory, **kwargs), model=model)
    assert all(map(torch.equal, before, model.parameters()))


def test_a_factory_that_returns_no_scheduler_is_refused_before_training():
    refused_before_a_step(lambda o: o, TypeError, r"returned SGD, not a torch")


def test_a_scheduler_made_on_another_optimizer_is_refused():
    other = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    refused_before_a_step(
        lambda o: torch_sched.StepLR(other, 2), ValueError, r"on another optimizer"
    )


def test_torch_reduce_on_plateau_points_to_fitlibs():
    refused_before_a_step(
        lambda o: torch_sched.ReduceLROnPlateau(o), ValueError,
        r"needs a metric.*fitlib's ReduceLROnPlateau",
    )  # fmt: skip


def test_a_momentum_cycle_must_be_asked_for_and_only_then():
    def one_cycle(o):
        return torch_sched.OneCycleLR(o, 0.1, total_steps=14)

    refused_before_a_step(one_cycle, ValueError, r"cycles the momentum.*mom=True")
    refused_before_a_step(
        SCHEDULERS["step"], ValueError, r"does not cycle.*mom=False", mom=True
    )


# -- saved state and exact resume ------------------------------------------------------
def test_the_state_holds_the_torch_schedulers_position():
    sched = TorchScheduler(lambda o: torch_sched.StepLR(o, 1, 10.0))
    run(sched, lr=1.0, epochs=1)
    state = sched.state_dict()
    assert state["intervals"] == N_BATCHES
    (saved,) = state["schedulers"]
    assert saved["last_epoch"] == N_BATCHES and saved["_last_lr"] == [10.0**7]


def test_a_state_of_another_shape_is_refused():
    with pytest.raises(ValueError, match=r"keys 'intervals', 'schedulers'"):
        TorchScheduler(SCHEDULERS["step"]).load_state_dict({"step": 3})


def learner(callbacks):
    torch.manual_seed(0)
    data = DataBunch(
        DataLoader(make_dataset(100), 16, shuffle=True),
        DataLoader(make_dataset(37, seed=1), 16),
        device="cpu",
    )
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3),
                          nn.Linear(32, 3))  # fmt: skip
    return Learner(data, model, F.cross_entropy, opt_func=torch.optim.Adam,
                   progress=False, callbacks=list(callbacks))  # fmt: skip


def same_run(a, b):
    """The same weights (every step's rates, bit for bit), losses, and the
    rates each record and the optimizer end with."""
    weights = all(map(torch.equal, a.model.state_dict().values(),
                      b.model.state_dict().values()))  # fmt: skip
    ra, rb = a.recorder, b.recorder
    ends = (a.opt.lr, a.opt.mom) == (b.opt.lr, b.opt.mom)
    rows = (ra.losses, ra.valid_losses, ra.metrics)
    return weights and ends and rows == (rb.losses, rb.valid_losses, rb.metrics)


RESUMED = {
    "cosine_by_step": lambda: [TorchScheduler(SCHEDULERS["cosine"])],
    "milestones_by_epoch": lambda: [
        TorchScheduler(lambda o: torch_sched.MultiStepLR(o, [1, 3]), interval="epoch")
    ],
    "one_cycle_with_plateau": lambda: [
        TorchScheduler(
            lambda o: torch_sched.OneCycleLR(o, 0.05, total_steps=28), mom=True
        ),
        ReduceLROnPlateau("train_loss", mode="max", factor=0.5),
    ],
    "every_3_steps_accumulating": lambda: [
        TorchScheduler(SCHEDULERS["cosine"], frequency=3),
        GradientAccumulation(2),
    ],
}


@pytest.mark.parametrize("case", RESUMED)
def test_a_fit_killed_mid_epoch_and_resumed_equals_an_unbroken_one(tmp_path, case):
    reference = learner(RESUMED[case]())
    reference.fit(4, lr=0.05)
    for crash in [9, 17, None]:  # inside epochs 1 and 2, then to the end
        extra = [] if crash is None else [Crash(crash)]
        resumed = learner([*RESUMED[case](), Checkpoint(tmp_path, every_n_steps=2),
                           *extra])  # fmt: skip
        try:
            resumed.fit(4, lr=0.05)
        except RuntimeError:
            assert crash is not None
    assert same_run(reference, resumed)
    assert len(resumed.recorder.lrs) == 4 * N_BATCHES
