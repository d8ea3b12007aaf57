import math

import pytest
import torch
from helpers import Crash, make_data, make_model
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import TensorDataset

from fitlib import Callback, DataBunch, HPOptimizer, Learner, fit
from fitlib.callback import call_hook
from fitlib.callbacks import (
    Checkpoint,
    OneCycleScheduler,
    Recorder,
    ReduceLROnPlateau,
)
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
    with pytest.raises(ValueError, match=r"'eps\.x' is neither a hyper-parameter"):
        ParamScheduler({"eps.x": constant(0.9)})
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


# -- any key of the parameter groups -----------------------------------------------
def adam(n_groups=1):
    groups = [{"params": [nn.Parameter(torch.zeros(1))]} for _ in range(n_groups)]
    return HPOptimizer(groups, torch.optim.Adam, lr=1e-3)


def drive(sched, opt, total, read, **state):
    """Drives the hooks over ``total`` steps; what ``read()`` gives before each."""
    call_hook(sched, "on_train_begin", opt=opt, n_steps=total, iteration=0, **state)
    seen = []
    for _ in range(total):
        seen.append(read())
        call_hook(sched, "on_step_end", opt=opt, skip_step=False, **state)
    return seen


@pytest.mark.parametrize(
    ("name", "schedule", "read"),
    [
        ("eps", linear(1e-6, 1e-8), lambda g: g["eps"]),
        ("betas[1]", linear(0.99, 0.9), lambda g: g["betas"][1]),
        ("weight_decay", linear(0.1, 0.0), lambda g: g["weight_decay"]),
    ],
)
def test_any_number_in_the_parameter_groups_follows_its_schedule(name, schedule, read):
    opt = adam()
    seen = drive(
        ParamScheduler({name: schedule}), opt, 5, lambda: read(opt.param_groups[0])
    )
    assert seen == pytest.approx([schedule(i / 4) for i in range(5)])


def test_sgds_momentum_by_its_torch_name_is_scheduled_as_mom():
    """As a cyclical schedule of the 'momentum' key of SGD's groups does."""
    opt = sgd(mom=0.9)
    sched = ParamScheduler(
        {"momentum": [(0.5, linear(0.9, 0.5)), (0.5, linear(0.5, 0.9))]}
    )
    seen = drive(sched, opt, 6, lambda: opt.param_groups[0]["momentum"])
    assert seen[0] == seen[-1] == pytest.approx(0.9) and min(seen) == pytest.approx(0.5)
    assert sched.sets_hypers == ("mom",)


def test_a_value_per_group_of_another_key_must_count_the_groups():
    opt = adam(n_groups=2)
    drive(ParamScheduler({"eps": linear([1e-6, 1e-7], 1e-8)}), opt, 3, lambda: None)
    assert opt.get("eps") == pytest.approx([1e-8, 1e-8])
    with pytest.raises(ValueError, match=r"eps: got 3 values .* for 2 parameter"):
        drive(ParamScheduler({"eps": constant([1e-6] * 3)}), adam(2), 3, lambda: None)


def test_two_names_of_one_hyper_parameter_in_one_scheduler_are_refused():
    with pytest.raises(ValueError, match="'wd' and 'weight_decay' are two names of"):
        ParamScheduler({"wd": constant(0.1), "weight_decay": constant(0.1)})


@pytest.mark.parametrize(
    ("first", "second", "clash"),
    [
        (
            ParamScheduler({"weight_decay": constant(0.1)}),
            ParamScheduler({"wd": constant(0.0)}),
            "wd",
        ),
        (OneCycleScheduler(1e-2), ParamScheduler({"betas[0]": constant(0.9)}), "mom"),
        (
            ParamScheduler({"model.3.p": constant(0.1)}),
            ParamScheduler({"model.3.p": constant(0.2)}),
            "model.3.p",
        ),
    ],
)
def test_two_schedules_of_one_target_in_one_fit_are_refused(first, second, clash):
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    with pytest.raises(ValueError, match=f"both set '{clash}' at every step"):
        fit(1, model, F.cross_entropy, opt, make_data(), [first, second])


def test_a_name_the_optimizer_lacks_is_refused_before_training_with_the_closest():
    model, rec = make_model(), Recorder()
    opt = HPOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    with pytest.raises(ValueError, match=r"\['epz'\].*\(did you mean 'eps'\?\)") as e:
        fit(
            1,
            model,
            F.cross_entropy,
            opt,
            make_data(),
            [ParamScheduler({"epz": constant(1e-6)}), rec],
        )
    assert "betas[0], betas[1], eps, weight_decay" in str(e.value)
    assert rec.iterations == []


def test_a_schedule_of_the_wrong_type_is_refused_before_the_first_step():
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = HPOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    sched = ParamScheduler({"eps": lambda pct: "small"})
    with pytest.raises(TypeError, match=r"eps must be a number .* got 'small'"):
        fit(1, model, F.cross_entropy, opt, make_data(), [sched])
    assert all(map(torch.equal, before, model.parameters()))


@pytest.mark.parametrize(
    ("key", "error", "message"),
    [
        (
            "decoder.eps",
            ValueError,
            r"ParamScheduler\(\{'eps': ...\}, part='decoder'\)",
        ),
        (
            "modle.3.p",
            ValueError,
            r"'modle' \(did you mean 'model'\?\)\). Fix: e.g. 'model.modle.3.p'",
        ),
        ("model.3.", ValueError, "neither a hyper-parameter's name"),
        ("eps[x]", ValueError, "is no hyper-parameter name"),
        (3, TypeError, "a key must be a hyper-parameter's name"),
    ],
)
def test_keys_that_name_nothing_are_refused_when_the_scheduler_is_made(
    key, error, message
):
    with pytest.raises(error, match=message):
        ParamScheduler({key: constant(0.1)})


# -- attributes of the model and the loss, and setters -----------------------------
class Seen(Callback):
    """What ``read(state)`` gives as each training batch begins."""

    def __init__(self, read):
        self.read, self.seen = read, []

    def on_batch_begin(self, train, model, opt, loss_func):
        if train:
            self.seen.append(self.read(model=model, opt=opt, loss_func=loss_func))


def test_a_dropout_probability_follows_its_schedule_at_every_step():
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    seen = Seen(lambda model, **_: model[3].p)
    sched = ParamScheduler({"model.3.p": linear(0.5, 0.0)})
    assert sched.sets_hypers == ("model.3.p",)
    fit(2, model, F.cross_entropy, opt, make_data(n_train=64), [sched, seen])
    assert seen.seen == pytest.approx([0.5 - 0.5 * i / 7 for i in range(8)])
    assert model[3].p == 0.0  # the last value stays


def test_a_scheduled_dropout_is_the_one_the_forward_pass_uses():
    def run(p_from_schedule):
        model = make_model()
        if not p_from_schedule:
            model[3].p = 0.0
        opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        cbs = [ParamScheduler({"model.3.p": constant(0.0)})] if p_from_schedule else []
        torch.manual_seed(5)
        fit(1, model, F.cross_entropy, opt, make_data(), cbs)
        return model

    a, b = run(True), run(False)
    assert all(map(torch.equal, a.parameters(), b.parameters()))


class WeightedLoss(nn.Module):
    """Cross-entropy plus ``weight`` times an L2 term, ``scale`` a buffer."""

    def __init__(self):
        super().__init__()
        self.weight = 1.0
        self.register_buffer("scale", torch.ones(2))

    def forward(self, out, y):
        return F.cross_entropy(out, y) * self.scale[0] + self.weight * out.pow(2).mean()


def test_a_loss_weight_and_a_loss_buffer_follow_their_schedules():
    model, loss = make_model(), WeightedLoss()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    seen = Seen(lambda loss_func, **_: (loss_func.weight, loss_func.scale.tolist()))
    sched = ParamScheduler({"loss_func.weight": linear(1.0, 0.0),
                            "loss_func.scale": linear(2.0, 1.0)})  # fmt: skip
    fit(1, model, loss, opt, make_data(n_train=64), [sched, seen])
    weights, scales = zip(*seen.seen)
    assert weights == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0])
    assert [s[0] for s in scales] == pytest.approx([2.0, 5 / 3, 4 / 3, 1.0])
    assert all(s[0] == s[1] for s in scales)  # a tensor: every element filled


def test_a_setter_function_gets_each_value():
    got = []
    sched = ParamScheduler({got.append: linear(1.0, 0.0)})
    assert sched.sets_hypers == ()  # the user's own function: not compared
    drive(sched, sgd(), 3, lambda: None)
    assert got == [1.0, 0.5, 0.0, 0.0]  # the first value before training
    with pytest.raises(TypeError, match=r"setter append'.*gave \[1.0, 2.0\]"):
        drive(
            ParamScheduler({got.append: constant([1.0, 2.0])}), sgd(), 2, lambda: None
        )


@pytest.mark.parametrize(
    ("path", "error", "message"),
    [
        (
            "model.3.pp",
            ValueError,
            r"model.3 \(Dropout\) has no 'pp' \(did you mean 'p'\?\)",
        ),
        ("model.9.p", ValueError, r"model \(Sequential\) has no '9'. It has: 0, 1"),
        (
            "model.3",
            TypeError,
            r"'model.3' holds a module, Dropout \(its numbers: \['p'\]\)",
        ),
        ("model.0.weight", TypeError, "holds a parameter the optimizer trains"),
        ("model.3.inplace", TypeError, r"holds False \(bool\)"),
        ("loss_func.weight", ValueError, r"loss_func \(function\) has no 'weight'"),
    ],
)
def test_an_attribute_that_cannot_be_scheduled_is_refused_before_training(
    path, error, message
):
    model, rec = make_model(), Recorder()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(error, match=message):
        fit(
            1,
            model,
            F.cross_entropy,
            opt,
            make_data(),
            [ParamScheduler({path: constant(0.1)}), rec],
        )
    assert rec.iterations == []


def test_an_attribute_takes_one_finite_number():
    model = make_model()
    state = {"model": model}
    with pytest.raises(TypeError, match=r"'model.3.p' gave \[0.1, 0.2\] \(list\)"):
        drive(
            ParamScheduler({"model.3.p": constant([0.1, 0.2])}),
            sgd(),
            2,
            lambda: None,
            **state,
        )
    with pytest.raises(ValueError, match="gave nan"):
        drive(
            ParamScheduler({"model.3.p": lambda pct: math.nan}),
            sgd(),
            2,
            lambda: None,
            **state,
        )


def test_a_path_from_the_model_reaches_through_a_wrapper():
    model = make_model()
    wrapped = nn.DataParallel(model)  # (DDP and torch.compile unwrap alike)
    drive(
        ParamScheduler({"model.3.p": linear(0.5, 0.1)}),
        sgd(),
        3,
        lambda: None,
        model=wrapped,
    )
    assert model[3].p == pytest.approx(0.1)


def test_a_resumed_scheduler_sets_the_attribute_where_the_run_was():
    sched, model = ParamScheduler({"model.3.p": linear(0.5, 0.0)}), make_model()
    drive(sched, sgd(), 3, lambda: None, model=model)
    resumed, fresh = ParamScheduler({"model.3.p": linear(0.5, 0.0)}), make_model()
    resumed.load_state_dict(sched.state_dict())
    call_hook(resumed, "on_train_begin", opt=sgd(), n_steps=5, iteration=3, model=fresh)
    assert fresh[3].p == pytest.approx(0.125)  # step 3 of 5, not the start


# -- with the 1cycle, a plateau and a checkpoint -----------------------------------
def test_one_cycle_an_eps_schedule_and_a_plateau_each_do_what_they_do_alone():
    def run(callbacks):
        model = make_model()
        opt = HPOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
        seen = Seen(lambda opt, **_: (opt.lr, opt.get("eps")[0]))
        fit(3, model, F.cross_entropy, opt, make_data(n_train=64), [*callbacks, seen])
        return seen.seen

    eps = linear(1e-6, 1e-8)
    plateau = ReduceLROnPlateau(
        "train_loss", factor=0.5, min_delta=10.0
    )  # every epoch after the first
    alone_lrs, _ = zip(*run([OneCycleScheduler(1e-2, final_div=10)]))
    _, alone_eps = zip(*run([ParamScheduler({"eps": eps})]))
    lrs, eps_seen = zip(
        *run(
            [
                OneCycleScheduler(1e-2, final_div=10),
                ParamScheduler({"eps": eps}),
                plateau,
            ]
        )
    )
    assert plateau.reductions == [1, 2]
    factors = [1.0] * 8 + [0.5] * 4  # 4 steps an epoch; the 2nd reduction: at the end
    assert lrs == pytest.approx([lr * f for lr, f in zip(alone_lrs, factors)])
    assert eps_seen == alone_eps == pytest.approx([eps(i / 11) for i in range(12)])


def resumable(callbacks):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3)
    )
    data = make_data(n_train=64)
    schedules = {"eps": cosine(1e-6, 1e-8), "model.2.p": linear(0.5, 0.0),
                 "betas[1]": linear(0.99, 0.9)}  # fmt: skip
    return Learner(data, model, F.cross_entropy, opt_func=torch.optim.Adam,
                   progress=False, metrics=[],
                   callbacks=[ParamScheduler(schedules), *callbacks])  # fmt: skip


def test_scheduled_keys_and_attributes_resume_exactly_through_a_checkpoint(tmp_path):
    ref = resumable([])
    ref.fit_one_cycle(2, 1e-2)
    for at in (2, 5, None):
        learn = resumable(
            [Checkpoint(tmp_path, every_n_steps=3), *([Crash(at)] if at else [])]
        )
        try:
            learn.fit_one_cycle(2, 1e-2)
        except RuntimeError:
            assert at is not None
    assert all(map(torch.equal, ref.model.state_dict().values(),
                   learn.model.state_dict().values()))  # fmt: skip
    assert learn.recorder.lrs == ref.recorder.lrs
    assert learn.model[2].p == ref.model[2].p == 0.0
    assert learn.opt.get("eps") == ref.opt.get("eps")
