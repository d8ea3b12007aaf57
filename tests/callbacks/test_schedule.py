import math

import pytest
import torch
from helpers import make_data, make_model
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import TensorDataset

from fitlib import Callback, DataBunch, HPOptimizer, fit
from fitlib.callback import call_hook
from fitlib.callbacks import Recorder
from fitlib.callbacks.schedule import (
    ParamScheduler,
    constant,
    cosine,
    exponential,
    linear,
    value_at,
)


def sgd(n_groups=1, mom=0.9):
    groups = [{"params": [nn.Parameter(torch.zeros(1))]} for _ in range(n_groups)]
    return HPOptimizer(groups, torch.optim.SGD, lr=0.1, mom=mom)


def run(sched, opt, total, skipped=()):
    """Drives the scheduler's hooks over ``total`` batches; the lr of each.

    The batches in ``skipped`` do not step the optimizer.
    """
    n_steps = total - len(skipped)
    call_hook(sched, "on_train_begin", opt=opt, n_steps=n_steps, epoch=0)
    lrs = []
    for i in range(total):
        lrs.append(opt.lr)
        call_hook(sched, "on_step_end", opt=opt, skip_step=i in skipped)
    return lrs


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        (cosine(1.0, 0.0), [1.0, 0.5, 0.0]),
        (linear(0.0, 2.0), [0.0, 1.0, 2.0]),
        (exponential(1e-4, 1.0), [1e-4, 1e-2, 1.0]),
        (constant(0.3), [0.3, 0.3, 0.3]),
    ],
)
def test_annealers_go_from_start_to_end(schedule, expected):
    assert [schedule(p) for p in (0.0, 0.5, 1.0)] == pytest.approx(expected)


def test_annealers_take_one_value_per_parameter_group():
    assert cosine([1.0, 2.0], 0.0)(0.5) == pytest.approx([0.5, 1.0])
    assert linear(0.0, [1.0, 3.0])(1.0) == [1.0, 3.0]
    with pytest.raises(ValueError, match="start has 2 values and end 3"):
        linear([1.0, 2.0], [1.0, 2.0, 3.0])


def test_first_step_takes_the_start_and_last_step_the_end():
    lrs = run(ParamScheduler({"lr": linear(1.0, 0.0)}), sgd(), total=5)
    assert lrs == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])


def test_phases_follow_each_other_at_their_fraction_of_training():
    phases = [(0.5, linear(0.0, 1.0)), (0.5, linear(1.0, 0.0))]
    lrs = run(ParamScheduler({"lr": phases}), sgd(), total=10)
    # Phase one ends at step 0.5 * 10 - 1 = 4, phase two at step 9.
    assert lrs[4] == pytest.approx(1.0) and lrs[0] == 0.0 and lrs[9] == 0.0
    assert lrs[:5] == sorted(lrs[:5]) and lrs[4:] == sorted(lrs[4:], reverse=True)
    assert value_at(phases, 2, 10) == pytest.approx(0.5)


def test_a_user_function_schedules_any_hyper_parameter():
    opt = sgd()
    sched = ParamScheduler({"mom": lambda pct: 0.9 - 0.1 * pct, "wd": constant(0.01)})
    call_hook(sched, "on_train_begin", opt=opt, n_steps=3, epoch=0)
    assert opt.mom == pytest.approx(0.9) and opt.wd == 0.01
    for _ in range(2):
        call_hook(sched, "on_step_end", opt=opt, skip_step=False)
    assert opt.mom == pytest.approx(0.8)


def test_counts_optimizer_steps_not_batches():
    lrs = run(ParamScheduler({"lr": linear(1.0, 0.0)}), sgd(), 6, skipped={0, 2, 4})
    assert lrs == pytest.approx([1.0, 1.0, 0.5, 0.5, 0.0, 0.0])


def test_values_stay_at_the_end_after_the_last_step():
    opt = sgd()
    lrs = run(ParamScheduler({"lr": linear(1.0, 0.5)}, total_steps=3), opt, total=6)
    assert lrs[2:] == [0.5] * 4


def test_discriminative_values_are_set_per_group():
    opt = sgd(n_groups=2)
    run(ParamScheduler({"lr": cosine([1e-3, 1e-2], [1e-5, 1e-4])}), opt, total=4)
    assert opt.lr == pytest.approx([1e-5, 1e-4])


def test_state_dict_restores_the_position():
    sched = ParamScheduler({"lr": linear(1.0, 0.0)})
    run(sched, sgd(), total=3)
    resumed, opt = ParamScheduler({"lr": linear(1.0, 0.0)}), sgd()
    resumed.load_state_dict(sched.state_dict())
    call_hook(resumed, "on_train_begin", opt=opt, n_steps=5, iteration=3)
    assert resumed.step == 3 and opt.lr == pytest.approx(0.25)


def test_through_fit_lrs_follow_the_schedule_per_step():
    data, rec = make_data(n_train=64, bs=16), Recorder()
    phases = [(0.25, linear(1e-3, 1e-2)), (0.75, cosine(1e-2, 1e-4))]
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    fit(2, model, F.cross_entropy, opt, data, [ParamScheduler({"lr": phases}), rec])
    assert rec.lrs == pytest.approx([value_at(phases, i, 8) for i in range(8)])
    assert rec.lrs[1] == pytest.approx(1e-2) and rec.lrs[-1] == pytest.approx(1e-4)


class StopAfter(Callback):
    def __init__(self, n):
        self.n = n

    def on_batch_end(self, iteration):
        if iteration + 1 >= self.n:
            return {"stop_training": True}


def test_works_when_training_is_bounded_by_steps():
    """A loader without a length: the schedule spans total_steps."""
    ds = TensorDataset(torch.randn(40, 8), torch.randint(0, 3, (40,)))

    class Stream:  # no __len__
        def __iter__(self):
            for i in range(0, 40, 8):
                yield ds[i : i + 8]

    model, rec = make_model(), Recorder()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    sched = ParamScheduler({"lr": linear(1.0, 0.1)}, total_steps=10)
    fit(
        5, model, F.cross_entropy, opt, DataBunch(Stream()), [sched, StopAfter(10), rec]
    )
    assert sched.step == 10
    assert rec.lrs == pytest.approx([1.0 - 0.1 * i for i in range(10)])


def test_an_unknown_length_without_total_steps_is_an_error():
    with pytest.raises(ValueError, match="pass total_steps"):
        call_hook(
            ParamScheduler({"lr": linear(1.0, 0.1)}),
            "on_train_begin",
            opt=sgd(),
            n_steps=None,
            epoch=0,
        )


def test_a_hyper_parameter_the_optimizer_lacks_is_an_error_before_training():
    opt = HPOptimizer([nn.Parameter(torch.zeros(1))], torch.optim.Rprop, lr=0.1)
    with pytest.raises(ValueError, match=r"schedules \['mom'\].*Rprop"):
        call_hook(
            ParamScheduler({"mom": constant(0.9)}),
            "on_train_begin",
            opt=opt,
            n_steps=4,
            epoch=0,
        )


@pytest.mark.parametrize(
    ("phases", "message"),
    [
        ([(0.5, linear(1, 0)), (0.3, constant(0))], "cover 0.8 of training"),
        ([(1.2, linear(1, 0)), (-0.2, constant(0))], "negative length -0.2"),
        ([(0.0, linear(1, 0)), (1.0, constant(0))], "zero length"),
        ([(1.0, "cos")], "a phase is"),
        (3.0, "must be a schedule"),
    ],
)
def test_bad_phases_are_errors(phases, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ParamScheduler({"lr": phases})


def test_bad_names_and_totals_are_errors():
    with pytest.raises(ValueError, match="unknown hyper-parameter 'momentum'"):
        ParamScheduler({"momentum": constant(0.9)})
    with pytest.raises(TypeError, match="non-empty dict"):
        ParamScheduler({})
    with pytest.raises(
        ValueError, match="total_steps must be an int >= 1 or None; got 0"
    ):
        ParamScheduler({"lr": constant(0.1)}, total_steps=0)
    with pytest.raises(ValueError, match="must be > 0"):
        exponential(0.0, 1.0)


def test_a_schedule_may_anneal_the_lr_to_zero():
    lrs = run(ParamScheduler({"lr": cosine(0.1, 0.0)}), sgd(), total=3)
    assert lrs[-1] == 0.0 and not math.isnan(lrs[1])
