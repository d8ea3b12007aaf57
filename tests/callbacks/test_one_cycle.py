import pytest
import torch
from helpers import make_data, make_model
from torch import nn
from torch.nn import functional as F  # noqa: N812

from fitlib import HPOptimizer, Learner, fit
from fitlib.callback import Callback, call_hook
from fitlib.callbacks import OneCycleScheduler, Recorder


def groups(n):
    return [{"params": [nn.Parameter(torch.zeros(1))]} for _ in range(n)]


def mom_of(group):
    return group["betas"][0] if "betas" in group else group["momentum"]


@pytest.mark.parametrize("opt_func", [torch.optim.SGD, torch.optim.AdamW])
@pytest.mark.parametrize("total", [1, 7, 100])
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"div_factor": 10.0, "pct_start": 0.25, "final_div": 1e3}],
    ids=["defaults", "custom"],
)
def test_each_step_agrees_with_torchs_one_cycle_lr(opt_func, total, kwargs):
    extra = {"momentum": 0.9} if opt_func is torch.optim.SGD else {}
    ref = opt_func(groups(2), lr=0.1, **extra)
    div = kwargs.get("div_factor", 25.0)
    final = kwargs.get("final_div", div * 1e4)
    torch_sched = torch.optim.lr_scheduler.OneCycleLR(
        ref,
        max_lr=[0.01, 0.1],
        total_steps=total,
        pct_start=kwargs.get("pct_start", 0.3),
        div_factor=div,
        final_div_factor=final / div,
        base_momentum=0.85,
        max_momentum=0.95,
    )
    opt = HPOptimizer(groups(2), opt_func, lr=0.1, mom=0.9)
    ours = OneCycleScheduler([0.01, 0.1], **kwargs)
    call_hook(ours, "on_train_begin", opt=opt, n_steps=total, epoch=0)
    for step in range(total):
        for mine, theirs in zip(opt.param_groups, ref.param_groups, strict=True):
            assert mine["lr"] == pytest.approx(theirs["lr"], rel=1e-12), step
            assert mom_of(mine) == pytest.approx(mom_of(theirs), rel=1e-12), step
        ref.step()
        if step < total - 1:  # torch refuses to step past total_steps
            torch_sched.step()
        call_hook(ours, "on_step_end", opt=opt, skip_step=False)


def test_lr_warms_up_then_anneals_while_momentum_moves_the_other_way():
    opt = HPOptimizer(groups(1), torch.optim.SGD, lr=0.1, mom=0.9)
    sched = OneCycleScheduler(1.0, div_factor=10.0, pct_start=0.5, final_div=100.0)
    call_hook(sched, "on_train_begin", opt=opt, n_steps=10, epoch=0)
    lrs, moms = [], []
    for _ in range(10):
        lrs.append(opt.lr)
        moms.append(opt.mom)
        call_hook(sched, "on_step_end", opt=opt, skip_step=False)
    peak = lrs.index(max(lrs))
    assert lrs[0] == pytest.approx(0.1) and max(lrs) == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(0.01)
    assert lrs[: peak + 1] == sorted(lrs[: peak + 1])
    assert lrs[peak:] == sorted(lrs[peak:], reverse=True)
    assert moms[0] == pytest.approx(0.95) and moms[peak] == pytest.approx(0.85)
    assert moms[-1] == pytest.approx(0.95)


def test_a_slice_spreads_max_lr_over_the_parameter_groups():
    opt = HPOptimizer(groups(3), torch.optim.SGD, lr=0.1, mom=0.9)
    sched = OneCycleScheduler(slice(1e-4, 1e-2), div_factor=1.0 + 1e-9)
    call_hook(sched, "on_train_begin", opt=opt, n_steps=10, epoch=0)
    assert opt.lr == pytest.approx([1e-4, 1e-3, 1e-2])


def test_through_fit_the_recorder_sees_the_one_cycle_schedule():
    data, rec, model = make_data(n_train=96, bs=16), Recorder(), make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    fit(3, model, F.cross_entropy, opt, data, [OneCycleScheduler(1e-2), rec])
    assert len(rec.lrs) == 18
    assert max(rec.lrs) == pytest.approx(1e-2, rel=1e-2)
    assert rec.lrs[0] == pytest.approx(1e-2 / 25)
    assert rec.lrs[-1] == pytest.approx(1e-2 / 25e4)
    assert rec.moms[0] == pytest.approx(0.95)
    assert min(rec.moms) == pytest.approx(0.85, abs=1e-3)


def test_fit_one_cycle_trains_and_discriminative_lrs_reach_each_group(tmp_path):
    model = make_model()
    learn = Learner(
        make_data(), model, F.cross_entropy, path=tmp_path, progress=False,
        layer_groups=[model[:2], model[2:]],
    )  # fmt: skip
    learn.fit_one_cycle(2, max_lr=slice(1e-3, 1e-2))
    assert learn.opt.lr == pytest.approx([1e-3 / 25e4, 1e-2 / 25e4])
    rec = learn.recorder
    assert rec.train_losses[-1] < rec.train_losses[0]
    assert max(rec.lrs) == pytest.approx(1e-2, rel=1e-2)  # the last group's


def test_momentum_on_an_optimizer_without_one_is_an_error_with_the_fix():
    opt = HPOptimizer(groups(1), torch.optim.Rprop, lr=0.1)
    with pytest.raises(ValueError, match=r"moms=None"):
        call_hook(OneCycleScheduler(0.1), "on_train_begin", opt=opt, n_steps=5, epoch=0)
    sched = OneCycleScheduler(0.1, moms=None)
    call_hook(sched, "on_train_begin", opt=opt, n_steps=5, epoch=0)
    assert opt.lr == pytest.approx(0.1 / 25)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_lr": 0.0}, "max_lr must be > 0"),
        ({"max_lr": -1e-3}, "max_lr must be > 0"),
        ({"max_lr": [1e-3, 0.0]}, "max_lr must be > 0"),
        ({"max_lr": slice(0.0, 1e-2)}, "max_lr must be > 0"),
        ({"max_lr": "1e-3"}, "max_lr must be > 0"),
        ({"max_lr": 1e-3, "pct_start": 0.0}, r"pct_start must be .* \(0, 1\)"),
        ({"max_lr": 1e-3, "pct_start": 1.0}, r"pct_start must be .* \(0, 1\)"),
        ({"max_lr": 1e-3, "div_factor": 0}, "div_factor must be a number > 0"),
        ({"max_lr": 1e-3, "final_div": -1.0}, "final_div must be a number > 0"),
        ({"max_lr": 1e-3, "moms": (0.95,)}, "moms must be two momentums"),
    ],
)
def test_bad_arguments_are_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OneCycleScheduler(**kwargs)


def test_the_schedules_are_built_at_train_begin_with_no_placeholder():
    sched = OneCycleScheduler(slice(1e-3, 1e-2), moms=None)
    assert sched.schedules == {} and sched.sets_hypers == ("lr",)
    assert OneCycleScheduler(0.1).sets_hypers == ("lr", "mom")
    opt = HPOptimizer(groups(2), torch.optim.SGD, lr=0.1)
    call_hook(sched, "on_train_begin", opt=opt, n_steps=4, epoch=0)
    assert list(sched.schedules) == ["lr"]
    assert opt.lr == pytest.approx([1e-3 / 25, 1e-2 / 25])


def test_max_lr_with_more_values_than_groups_is_refused_at_train_begin():
    sched = OneCycleScheduler([0.01, 0.02, 0.03])  # the groups are unknown here
    opt = HPOptimizer(groups(2), torch.optim.SGD, lr=0.1, mom=0.9)
    with pytest.raises(
        ValueError,
        match=r"max_lr: got 3 values \[0\.01, 0\.02, 0\.03\] for 2 parameter "
        r"groups\. Fix: pass one number, or exactly 2 values",
    ):
        call_hook(sched, "on_train_begin", opt=opt, n_steps=5, epoch=0)
    assert opt.lr == 0.1  # nothing was set


def test_lr_is_another_name_for_max_lr_and_one_of_them_is_needed():
    opt = HPOptimizer(groups(2), torch.optim.SGD, lr=0.1, mom=0.9)
    sched = OneCycleScheduler(lr=[0.01, 0.1])
    assert sched.max_lr == [0.01, 0.1] and sched.lr_name == "lr"
    call_hook(sched, "on_train_begin", opt=opt, n_steps=5, epoch=0)
    assert opt.lr == pytest.approx([0.01 / 25, 0.1 / 25])
    with pytest.raises(ValueError, match=r"lr must be > 0: .*got -1"):
        OneCycleScheduler(lr=-1)
    with pytest.raises(ValueError, match=r"got lr=0.1 and max_lr=0.1.*pass one"):
        OneCycleScheduler(0.1, lr=0.1)
    with pytest.raises(TypeError, match=r"neither lr nor max_lr"):
        OneCycleScheduler()


def test_learner_rejects_bad_max_lr_before_training(tmp_path):
    learn = Learner(make_data(), make_model(), F.cross_entropy, progress=False)
    with pytest.raises(ValueError, match="max_lr must be > 0"):
        learn.fit_one_cycle(1, max_lr=0.0)
    assert learn.recorder.lrs == []


def test_in_phases_runs_a_cycle_per_phase_from_the_epoch_that_begins_it():
    lrs = []

    class Probe(Callback):
        def on_batch_begin(self, opt, train):
            if train:
                lrs.append(opt.lr)

    sched = OneCycleScheduler.in_phases([(1, 1e-2, 25.0, 0.5), (0, 1.0, 2.0, 0.5),
                                         (1, 4e-3, 4.0, 0.5)], moms=None)  # fmt: skip
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    fit(2, model, F.cross_entropy, opt, make_data(), callbacks=[sched, Probe()])
    assert len(lrs) == 14  # 7 steps an epoch
    assert lrs[0] == pytest.approx(1e-2 / 25) and lrs[6] == pytest.approx(1e-2 / 25e4)
    assert lrs[7] == pytest.approx(4e-3 / 4) and lrs[13] == pytest.approx(4e-3 / 4e4)
    assert sched.state_dict() == {"step": 14, "total": 14, "phase": 2, "start": 7}


def test_in_phases_refuses_bad_phases_and_a_fit_of_other_epochs():
    with pytest.raises(TypeError, match=r"phases\[0\] must be \(epochs, max_lr"):
        OneCycleScheduler.in_phases([(1, 1e-2)])
    with pytest.raises(ValueError, match=r"phases\[1\]\[0\] \(epochs\) must be"):
        OneCycleScheduler.in_phases([(1, 1e-2, 25.0, 0.3), (-1, 1e-2, 25.0, 0.3)])
    with pytest.raises(ValueError, match="pct_start"):
        OneCycleScheduler.in_phases([(1, 1e-2, 25.0, 1.5)])
    with pytest.raises(ValueError, match="0 epochs in all"):
        OneCycleScheduler.in_phases([(0, 1e-2, 25.0, 0.3)])
    sched = OneCycleScheduler.in_phases([(1, 1e-2, 25.0, 0.3)])
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, mom=0.9)
    with pytest.raises(ValueError, match=r"the phases have 1 epochs.*n_epochs=2"):
        fit(2, model, F.cross_entropy, opt, make_data(), callbacks=[sched])
