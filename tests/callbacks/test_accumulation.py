import contextlib
import math
from types import SimpleNamespace

import helpers
import pytest
import torch
from helpers import make_dataset, make_model
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

from fitlib import Callback, DataBunch, HPOptimizer, Learner, fit
from fitlib.callback import call_hook
from fitlib.callbacks.accumulation import GradientAccumulation
from fitlib.callbacks.mixed_precision import MixedPrecision
from fitlib.callbacks.one_cycle import OneCycleScheduler
from fitlib.callbacks.recorder import Recorder
from fitlib.metrics import accuracy

OPTIMIZERS = {  # helpers.train's optimizer arguments
    "sgd_momentum": {"opt_func": torch.optim.SGD, "lr": 0.1, "mom": 0.9},
    "adamw": {"opt_func": torch.optim.AdamW, "lr": 1e-2},
}


def mlp() -> nn.Module:
    """No batch norm, no dropout: a larger batch is exactly the sum of parts."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def loader(n, bs):
    return DataLoader(make_dataset(n), bs)  # no shuffle: the same order


class NoLen:
    """A loader without a length (a stream)."""

    def __init__(self, dl):
        self.dl = dl

    def __iter__(self):
        return iter(self.dl)


class Steps(Callback):
    """Notes where the optimizer stepped, and what a scheduler set then."""

    order = 20  # after the schedulers (10)

    def __init__(self):
        self.at, self.lrs, self.n_steps = [], [], None

    def on_train_begin(self, n_steps):
        self.n_steps = n_steps

    def on_step_end(self, skip_step, epoch, num_batch, opt):
        if not skip_step:
            self.at.append((epoch, num_batch))
            self.lrs.append(opt.stepped[0])


def train(train_dl, n_batches=None, epochs=2, opt="sgd_momentum", callbacks=()):
    """The weights after training ``mlp()`` on ``train_dl`` alone (no
    validation), accumulating ``n_batches`` batches per step if given."""
    accumulate = [] if n_batches is None else [GradientAccumulation(n_batches)]
    data = DataBunch(train_dl, None, device="cpu")
    model = helpers.train(
        [*accumulate, *callbacks], epochs, data=data, model=mlp(), **OPTIMIZERS[opt]
    )
    return [p.detach() for p in model.parameters()]


def same_weights(a, b):
    return all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a, b, strict=True))


def backward_weights(acc, sizes, start=0):
    """Drives a group's batches of ``sizes`` from batch ``start`` of the epoch:
    the factor on each loss and what ``on_backward_end`` returned."""
    weights, updates = [], []
    for i, size in enumerate(sizes, start):
        update = scaled(acc, i, size)
        weights.append(update["last_loss"].item())
        updates.append(call_hook(acc, "on_backward_end", model=nn.Linear(1, 1)))
    return weights, updates


def scaled(acc, i, size, model=None):
    """on_batch_begin then on_backward_begin of batch ``i`` of ``size`` samples."""
    call_hook(acc, "on_batch_begin", train=True, model=model or nn.Linear(1, 1),
              last_target=torch.zeros(size), num_batch=i)  # fmt: skip
    return call_hook(acc, "on_backward_begin", last_loss=torch.tensor(1.0))


def start(acc, n_batches, model=None):
    data = SimpleNamespace(train_dl=[None] * n_batches)
    model = model or nn.Linear(1, 1)
    return call_hook(acc, "on_train_begin", model=model, data=data, n_epochs=1)


# -- scripted hooks --------------------------------------------------------------
def test_train_begin_divides_the_fits_steps_and_clears_old_gradients():
    model = nn.Linear(2, 1)
    model.weight.grad = torch.ones(1, 2)  # left by an interrupted group
    data = SimpleNamespace(train_dl=[None] * 7)
    update = call_hook(GradientAccumulation(3), "on_train_begin", model=model,
                       data=data, n_epochs=4)  # fmt: skip
    assert update == {"n_steps": 4 * math.ceil(7 / 3)}
    assert model.weight.grad is None
    stream = SimpleNamespace(train_dl=NoLen([]))
    update = call_hook(GradientAccumulation(3), "on_train_begin", model=model,
                       data=stream, n_epochs=4)  # fmt: skip
    assert update == {"n_steps": None}


def test_each_loss_is_scaled_by_its_share_of_the_group():
    acc = GradientAccumulation(4)
    start(acc, 4)
    weights, updates = backward_weights(acc, [8, 8, 8, 8])
    assert weights == [0.25] * 4
    assert updates == [{"skip_step": True}] * 3 + [None]


def test_a_ragged_last_group_is_scaled_to_its_own_length():
    acc = GradientAccumulation(4)
    start(acc, 6)  # groups of 4 and 2 batches
    assert backward_weights(acc, [8] * 4)[0] == [0.25] * 4
    weights, updates = backward_weights(acc, [8, 8], start=4)
    assert weights == [0.5, 0.5]
    assert updates == [{"skip_step": True}, None]


def test_a_smaller_last_batch_rescales_the_gradients_to_the_sample_mean():
    acc = GradientAccumulation(2)
    start(acc, 2)
    model = nn.Linear(1, 1, bias=False)

    def batch(i, size):
        return scaled(acc, i, size)["last_loss"].item()

    assert batch(0, 8) == 0.5  # planned: a group of 2 batches of 8
    assert call_hook(acc, "on_backward_end", model=model) == {"skip_step": True}
    assert batch(1, 2) == 2 / 16
    # The gradient the scaled losses left: (8 * g1 + 2 * g2) / 16 = 16, say.
    model.weight.grad = torch.tensor([[16.0]])
    assert call_hook(acc, "on_backward_end", model=model) is None
    # Rescaled to the mean over the 10 samples there were: 16 * 16 / 10.
    assert model.weight.grad.item() == pytest.approx(25.6)


def test_gradients_are_kept_only_inside_a_group():
    acc = GradientAccumulation(2)
    acc._count = 1  # one batch of the group done
    assert call_hook(acc, "on_step_end", skip_step=True) == {"skip_zero": True}
    acc._count = 0  # the group stepped
    assert call_hook(acc, "on_step_end", skip_step=False) is None


@pytest.mark.parametrize("n_batches", [0, -1, 2.0, 1.5, True, False, "2", None])
def test_bad_n_batches_is_a_clear_error(n_batches):
    with pytest.raises(ValueError, match=r"n_batches must be an int >= 1.*Fix"):
        GradientAccumulation(n_batches)


def test_one_step_per_batch_is_allowed():
    assert GradientAccumulation(1).n_batches == 1


def test_the_argument_and_attribute_are_named_n_batches():
    acc = GradientAccumulation(n_batches=4)
    assert acc.n_batches == 4 and repr(acc) == "GradientAccumulation(n_batches=4)"


def test_the_former_keyword_n_steps_still_works_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match=r"GradientAccumulation\(n_batches=4\)"):
        acc = GradientAccumulation(n_steps=4)
    assert acc.n_batches == 4
    with pytest.warns(DeprecationWarning, match=r"GradientAccumulation\.n_batches"):
        assert acc.n_steps == 4
    with pytest.raises(ValueError, match=r"n_batches=2 and n_steps=4.*pass one"):
        GradientAccumulation(2, n_steps=4)


# -- through fit -----------------------------------------------------------------
@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize(
    ("n_train", "n"),
    [
        (96, 2),  # 6 batches of 16: groups divide the epoch
        (100, 2),  # last group: one batch of 4
        (100, 4),  # last group: 16, 16 and 4 samples
        (80, 3),  # last group: two full batches of three
    ],
)
def test_accumulating_n_batches_equals_one_batch_n_times_larger(opt, n_train, n):
    accumulated = train(loader(n_train, 16), n, opt=opt)
    large = train(loader(n_train, 16 * n), opt=opt)
    assert same_weights(accumulated, large)
    assert not same_weights(train(loader(n_train, 16), opt=opt), large)


def test_n_batches_one_changes_nothing():
    assert same_weights(train(loader(100, 16), 1), train(loader(100, 16)))


@pytest.mark.parametrize(("n_train", "n"), [(100, 2), (100, 3), (96, 2), (96, 6)])
def test_steps_once_per_group_and_sets_the_fits_n_steps(n_train, n):
    steps = Steps()
    train(loader(n_train, 16), n, epochs=3, callbacks=[steps])
    per_epoch = math.ceil(math.ceil(n_train / 16) / n)
    assert steps.n_steps == 3 * per_epoch
    assert len(steps.at) == 3 * per_epoch
    assert steps.at[per_epoch - 1] == (0, math.ceil(n_train / 16) - 1)  # epoch end


def test_schedulers_count_optimizer_steps_not_batches():
    steps, rec = Steps(), Recorder()
    sched = OneCycleScheduler(max_lr=0.1)
    train(loader(100, 16), 3, epochs=3, callbacks=[sched, steps, rec])
    n_opt_steps = math.ceil(7 / 3) * 3
    assert len(steps.lrs) == n_opt_steps and sched.step == n_opt_steps
    assert len(set(steps.lrs)) == n_opt_steps  # each step had its own lr
    assert len(set(rec.lrs)) == n_opt_steps and len(rec.lrs) == 7 * 3
    assert steps.lrs[-1] == pytest.approx(0.1 / sched.final_div)
    assert steps.lrs[0] == pytest.approx(0.1 / sched.div_factor)
    assert max(steps.lrs) == pytest.approx(0.1, rel=0.05)


def test_a_loader_without_length_carries_groups_across_epochs():
    steps = Steps()
    train(NoLen(loader(100, 16)), 2, epochs=2, callbacks=[steps])
    assert steps.n_steps is None
    # 7 batches per epoch: the fourth group is epoch 0's last batch and
    # epoch 1's first.
    assert steps.at == [(0, 1), (0, 3), (0, 5), (1, 0), (1, 2), (1, 4), (1, 6)]


def test_a_loader_without_length_equals_larger_batches():
    accumulated = train(NoLen(loader(96, 16)), 3, opt="adamw")
    assert same_weights(accumulated, train(loader(96, 48), opt="adamw"))


def test_works_with_fp16_loss_scaling_and_steps_the_scaler_per_group():
    mp = MixedPrecision(torch.float16)
    steps = Steps()
    with pytest.warns(RuntimeWarning, match="on the CPU"):
        weights = train(loader(100, 16), 2, callbacks=[mp, steps])
    # The scaler unscales and updates once per optimizer step, not per batch.
    assert mp.state_dict()["scaler"]["_growth_tracker"] == len(steps.at) == 8
    assert mp.skipped_steps == 0
    # As one batch twice as large in float32, up to float16's precision.
    large = train(loader(100, 32))
    assert all(torch.allclose(w, x, atol=2e-2) for w, x in zip(weights, large))


# -- no host-device sync per batch -------------------------------------------------
@pytest.fixture
def host_syncs(sync_counter, frozen_clock):
    """The suite's sync counter (conftest.py), with the clock frozen."""
    return sync_counter


def syncs_during_fit(counter, n_train, fp16):
    data = DataBunch(
        DataLoader(make_dataset(n_train), 16, shuffle=True),
        DataLoader(make_dataset(n_train // 2, seed=1), 16),
        device="cpu",
    )
    learn = Learner(
        data,
        make_model(),
        F.cross_entropy,
        opt_func=torch.optim.SGD,
        metrics=[accuracy],
        callbacks=[GradientAccumulation(2)],
    )
    if fp16:
        learn.to_fp16()
    before = counter["n"]
    learn.fit(2, lr=0.1)
    return counter["n"] - before


@pytest.mark.filterwarnings(r"ignore:MixedPrecision\(float16\) on the CPU")
@pytest.mark.parametrize("fp16", [False, True])
def test_sync_count_does_not_grow_with_batches(host_syncs, fp16):
    few = syncs_during_fit(host_syncs, 64, fp16)
    many = syncs_during_fit(host_syncs, 256, fp16)
    assert few > 0  # epoch ends read values: the counter works
    assert few == many


class FakeDDP(nn.Module):
    """A model with no_sync(), as DistributedDataParallel has: records use."""

    def __init__(self):
        super().__init__()
        self.inside = []

    @contextlib.contextmanager
    def no_sync(self):
        self.inside.append(True)
        yield
        self.inside.append(False)


def test_batches_that_do_not_step_skip_the_gradient_all_reduce():
    acc, model = GradientAccumulation(3), FakeDDP()
    start(acc, 6)
    for i in range(6):
        scaled(acc, i, 4, model)
        call_hook(acc, "on_backward_end", model=model)
        call_hook(acc, "on_batch_end")
    # batches 0, 1 and 3, 4 ran inside no_sync; 2 and 5 (the steps) did not.
    assert model.inside == [True, False] * 4


# -- the factor by epoch (Lightning's GradientAccumulationScheduler) ----------------
@pytest.mark.parametrize(
    ("schedule", "steps"),
    [
        ({1: 2, 3: 4}, 10 + 5 + 5 + 3),  # epoch 0 before the first key: 1
        ({0: 2, 2: 1}, 5 + 5 + 10 + 10),
        ({0: 3}, 4 * 4),
    ],
)
def test_a_factor_by_epoch_steps_as_scheduled_and_sets_n_steps(schedule, steps):
    counted = Steps()
    train(loader(160, 16), schedule, epochs=4, callbacks=[counted])  # 10 batches
    assert counted.n_steps == len(counted.at) == steps


def test_a_group_takes_the_factor_of_its_epoch_and_ends_with_it():
    counted = Steps()
    train(loader(100, 16), {0: 3, 1: 2}, epochs=2, callbacks=[counted])
    assert counted.at == [(0, 2), (0, 5), (0, 6), (1, 1), (1, 3), (1, 5), (1, 6)]


def test_a_factor_by_epoch_equals_fits_with_each_factor_in_turn():
    def weights(*factors):
        """One fit with ``factors[0]`` as the schedule, or a fit of one
        epoch per factor, on the same optimizer."""
        model = mlp()
        opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, mom=0.9)
        data = DataBunch(loader(100, 16), None, device="cpu")
        if isinstance(factors[0], dict):
            acc = GradientAccumulation(factors[0])
            fit(len(factors[0]), model, F.cross_entropy, opt, data, callbacks=[acc])
        for factor in factors[1:]:
            acc = GradientAccumulation(factor)
            fit(1, model, F.cross_entropy, opt, data, callbacks=[acc])
        return [p.detach() for p in model.parameters()]

    scheduled = weights({0: 3, 1: 1, 2: 2})
    assert same_weights(scheduled, weights(None, 3, 1, 2))
    assert not same_weights(scheduled, weights(None, 3, 3, 3))


def test_a_one_cycle_schedule_spans_the_steps_each_factor_takes():
    counted, sched = Steps(), OneCycleScheduler(max_lr=0.1)
    train(loader(100, 16), {0: 4, 2: 2, 3: 1}, epochs=4,
          callbacks=[sched, counted])  # fmt: skip
    assert len(counted.at) == 2 + 2 + 4 + 7 == sched.total == sched.step
    assert counted.lrs[-1] == pytest.approx(0.1 / sched.final_div)  # the end
    assert counted.lrs[0] == pytest.approx(0.1 / sched.div_factor)


def test_batches_at_reads_the_schedule():
    acc = GradientAccumulation({2: 4, 5: 2})
    assert [acc.batches_at(e) for e in range(7)] == [1, 1, 4, 4, 4, 2, 2]
    assert repr(acc) == "GradientAccumulation(n_batches={2: 4, 5: 2})"
    assert GradientAccumulation(3).batches_at(10) == 3


@pytest.mark.parametrize(
    "schedule", [{1: 2, -3: 4}, {0: 2, "2": 1}, {1.0: 2}, {True: 2}]
)
def test_an_epoch_that_is_not_an_int_from_0_is_refused(schedule):
    with pytest.raises(
        ValueError, match=r"each epoch \(key\) of n_batches must be an int >= 0"
    ):
        GradientAccumulation(schedule)


@pytest.mark.parametrize(
    "schedule", [{1: 0, 3: 4}, {0: 2, 2: "2"}, {0: 1.5}, {0: None}]
)
def test_a_factor_that_is_not_an_int_from_1_is_refused(schedule):
    with pytest.raises(
        ValueError, match=r"each value of n_batches must be an int >= 1.*Fix"
    ):
        GradientAccumulation(schedule)


def test_an_empty_schedule_is_refused():
    with pytest.raises(ValueError, match=r"n_batches is an empty dict.*Fix"):
        GradientAccumulation({})


def test_two_accumulations_in_one_fit_are_refused_before_training():
    with pytest.raises(ValueError, match=r"the fit has two.*Fix: keep one"):
        train(loader(100, 16), 2, callbacks=[GradientAccumulation({0: 4})])


def test_a_fit_killed_mid_epoch_resumes_exactly_with_a_factor_by_epoch(tmp_path):
    from fitlib.callbacks import Checkpoint

    def learner(extra=()):
        torch.manual_seed(0)
        train_dl = DataLoader(make_dataset(100), 16, shuffle=True)
        data = DataBunch(train_dl, loader(37, 16), device="cpu")
        cbs = [GradientAccumulation({0: 3, 1: 2, 3: 1}), *extra]
        return Learner(data, mlp(), F.cross_entropy, opt_func=torch.optim.SGD,
                       progress=False, callbacks=cbs)  # fmt: skip

    reference = learner()
    reference.fit_one_cycle(4, 0.1)
    for crash in [4, 11, 19, None]:  # inside groups of epochs 0, 1 and 2
        extra = [] if crash is None else [helpers.Crash(crash)]
        resumed = learner([Checkpoint(tmp_path, every_n_steps=1), *extra])
        try:
            resumed.fit_one_cycle(4, 0.1)
        except RuntimeError:
            assert crash is not None
    assert all(map(torch.equal, reference.model.state_dict().values(),
                   resumed.model.state_dict().values()))  # fmt: skip
    assert reference.recorder.losses == resumed.recorder.losses
