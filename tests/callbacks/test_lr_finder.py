import copy
import math
import time
import warnings

import pytest
import torch
from helpers import clone_params, make_data, make_model
from torch import nn
from torch.nn import functional as F  # noqa: N812

from fitlib import Callback, HPOptimizer, Learner
from fitlib.callback import call_hook
from fitlib.callbacks import GradientAccumulation, LRFinder
from fitlib.metrics import accuracy

# Most sweeps here are toys, too short to trust: their lr_find warnings are
# expected. The tests of those warnings record them (pytest.warns sees them).
pytestmark = pytest.mark.filterwarnings("ignore:lr_find:UserWarning")


def learner(tmp_path, n_train=100, **kwargs):
    return Learner(
        make_data(n_train=n_train),
        make_model(),
        F.cross_entropy,
        metrics=[],
        path=tmp_path,
        progress=False,
        **kwargs,
    )


def step_loss(loss):
    """A step's losses as the handler passes them: a scripted curve is both
    the smoothed loss and the step's own."""
    return {"smooth_loss": torch.tensor(loss), "last_loss": torch.tensor(loss)}


def sweep(finder, losses, skipped=(), momentum=0.0):
    """Drives ``finder`` with scripted smoothed losses (on SGD with
    ``momentum``); returns the batch that stopped training (or None)."""
    model = nn.Linear(2, 1)
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, mom=momentum)
    call_hook(finder, "on_train_begin", model=model, opt=opt)
    stopped = None
    for i, loss in enumerate(losses):
        call_hook(finder, "on_step_end", skip_step=i in skipped)
        update = call_hook(
            finder, "on_batch_end", train=True, opt=opt, **step_loss(loss)
        )
        if update and update.get("stop_training"):
            stopped = i
            break
    call_hook(finder, "on_train_end", model=model, opt=opt)
    return stopped


def test_exponential_and_linear_sweeps_go_from_start_to_end():
    exp = LRFinder(1e-6, 1.0, num_it=7)
    assert [exp.lr_at(i) for i in range(7)] == pytest.approx(
        [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0]
    )
    lin = LRFinder(0.1, 0.5, num_it=5, mode="linear")
    assert [lin.lr_at(i) for i in range(5)] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])


def test_records_num_it_steps_then_stops_training():
    finder = LRFinder(1e-3, 1.0, num_it=4)
    assert sweep(finder, [2.0, 1.9, 1.8, 1.7, 1.6, 1.5]) == 3
    assert finder.losses == pytest.approx([2.0, 1.9, 1.8, 1.7])
    assert finder.lrs == pytest.approx([1e-3, 1e-2, 1e-1, 1.0])


def test_counts_optimizer_steps_not_batches():
    finder = LRFinder(1e-3, 1.0, num_it=4)
    losses = [2.0, 9.0, 1.9, 9.0, 1.8, 9.0, 1.7]
    assert sweep(finder, losses, skipped={1, 3, 5}) == 6
    assert finder.losses == pytest.approx([2.0, 1.9, 1.8, 1.7])


def test_never_validates():
    assert call_hook(LRFinder(), "on_epoch_begin") == {"skip_validate": True}


@pytest.mark.parametrize("bad", [9.0, math.nan, math.inf])
def test_stops_when_the_loss_diverges_and_drops_the_steps_after(bad):
    finder = LRFinder(1e-3, 1.0, num_it=10, check_every=0.0)  # read every step
    assert sweep(finder, [2.0, 1.5, 1.0, 2.0, bad, 1.0, 1.0]) == 4
    assert finder.losses == pytest.approx([2.0, 1.5, 1.0, 2.0])
    assert len(finder.lrs) == 4


def test_reads_the_losses_only_when_check_every_has_passed(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    finder = LRFinder(1e-3, 1.0, num_it=10, check_every=1.0)
    model = nn.Linear(2, 1)
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    call_hook(finder, "on_train_begin", model=model, opt=opt)
    stops = []
    for i, loss in enumerate([2.0, 1.0, 50.0, 60.0, 70.0]):
        clock[0] = 0.4 * i  # a read is due at the batch of t=1.2
        call_hook(finder, "on_step_end", skip_step=False)
        update = call_hook(
            finder, "on_batch_end", train=True, opt=opt, **step_loss(loss)
        )
        stops.append(bool(update))
        if update:
            break
    assert stops == [False, False, False, True]
    call_hook(finder, "on_train_end", model=model, opt=opt)
    assert finder.losses == [2.0, 1.0]  # the divergence at step 2, found late


def test_without_stop_div_the_whole_sweep_is_kept():
    finder = LRFinder(1e-3, 1.0, num_it=4, stop_div=False, check_every=0.0)
    assert sweep(finder, [2.0, 1.0, 50.0, math.nan]) == 3
    assert len(finder.losses) == 4 and math.isnan(finder.losses[-1])


# -- the finder's problems and warnings --------------------------------------------
@pytest.mark.parametrize(("num_it", "momentum"), [(100, 0.0), (300, 0.9)])
def test_the_finder_passes_its_num_it_and_momentum_to_the_no_fall_fixes(
    num_it, momentum
):
    finder = LRFinder(num_it=num_it)
    with pytest.warns(UserWarning, match="never fell"):
        sweep(finder, [2.3] * 40, momentum=momentum)
    message = finder.problems["no_fall"]
    assert ("sweep longer (e.g. num_it=300)" in message) == (num_it < 300)
    assert ("the momentum you will train with" in message) == (momentum == 0)


def test_the_finder_keeps_and_warns_about_a_loss_that_never_fell():
    finder = LRFinder(1e-3, 1.0, num_it=10)
    with pytest.warns(UserWarning, match=r"^lr_find: the loss never fell") as record:
        sweep(finder, [2.3, 2.31, 2.29, 2.3, 2.3, 2.31, 2.3, 2.29, 2.3, 2.3])
    assert len(record) == 1 and list(finder.problems) == ["no_fall"]
    assert finder.suggestions is not None


def test_the_finder_warns_when_the_loss_still_falls_at_end_lr():
    finder = LRFinder(1e-3, 1.0, num_it=10, check_every=0.0)
    with pytest.warns(UserWarning, match=r"^lr_find: the loss still falls"):
        sweep(finder, [2.3, 2.3, 2.3, 2.3, 2.25, 2.0, 1.7, 1.4, 1.1, 0.8])
    assert list(finder.problems) == ["end_edge"]


def test_a_sweep_that_diverged_is_no_end_edge_though_its_record_ends_low():
    finder = LRFinder(1e-3, 1.0, num_it=10, check_every=0.0)
    losses = [2.3, 2.3, 2.3, 2.3, 2.25, 2.0, 1.7, 1.4, 9.0, 9.0]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert sweep(finder, losses) == 8  # stopped at the divergence
    assert finder.losses[-1] == min(finder.losses)  # the record ends at its low
    assert finder.problems == {} and record == []  # but the sweep diverged


def test_the_finder_does_not_warn_after_an_error_but_keeps_the_problems():
    finder = LRFinder(1e-3, 1.0, num_it=10)
    model = nn.Linear(2, 1)
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    call_hook(finder, "on_train_begin", model=model, opt=opt)
    for loss in [2.3, 2.3, 2.31]:
        call_hook(finder, "on_step_end", skip_step=False)
        call_hook(finder, "on_batch_end", train=True, opt=opt, **step_loss(loss))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        call_hook(
            finder, "on_train_end", model=model, opt=opt, exception=KeyboardInterrupt()
        )
    assert record == [] and list(finder.problems) == ["no_fall"]


def test_lr_find_warns_but_still_suggests_when_nothing_can_train(tmp_path):
    learn = Learner(
        make_data(),
        make_model(),
        lambda out, y: F.cross_entropy(out * 0, y),  # no gradient: a flat loss
        metrics=[],
        path=tmp_path,
        progress=False,
    )
    with pytest.warns(UserWarning, match=r"^lr_find: the loss never fell"):
        suggestions = learn.lr_find(num_it=20)
    assert all(isinstance(lr, float) and lr > 0 for lr in suggestions)
    assert set(learn.recorder.lr_find_result["suggestions"]) == {
        "valley",
        "steepest",
        "min_div10",
    }


def test_lr_find_leaves_model_optimizer_callbacks_and_rng_as_before(tmp_path):
    class Counter(Callback):
        def __init__(self):
            self.n = 0

        def on_batch_end(self, **kwargs):
            self.n += 1

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, state):
            self.n = state["n"]

    counter = Counter()
    learn = learner(tmp_path, callbacks=[counter])
    learn.fit(1, lr=1e-2)
    weights, opt_state = (
        clone_params(learn.model),
        copy.deepcopy(learn.opt.state_dict()),
    )
    buffers = [b.clone() for b in learn.model.buffers()]
    history, n_seen = learn.recorder.state_dict(), counter.n
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    suggestions = learn.lr_find(num_it=20)
    assert all(map(torch.equal, weights, learn.model.parameters()))
    assert all(map(torch.equal, buffers, learn.model.buffers()))
    assert learn.opt.lr == pytest.approx(1e-2)
    state = learn.opt.state_dict()["opt"]
    for key, moments in state["state"].items():
        for name, t in moments.items():
            assert torch.equal(t, opt_state["opt"]["state"][key][name])
    assert counter.n == n_seen and learn.recorder.state_dict() == history
    assert torch.equal(torch.rand(3), expected_draw)
    assert all(isinstance(v, float) and v > 0 for v in suggestions)


def test_lr_find_restores_the_loaders_own_generator_and_python_numpy_rng(tmp_path):
    import random

    import numpy as np
    from torch.utils.data import DataLoader

    from fitlib import DataBunch

    learn = learner(tmp_path)
    ds = learn.data.train_dl.dataset
    g = torch.Generator().manual_seed(0)
    learn.data = DataBunch(DataLoader(ds, 16, shuffle=True, generator=g), None, "cpu")
    state = g.get_state()
    random.seed(1)
    np.random.seed(1)
    first = learn.lr_find(num_it=12)
    assert torch.equal(g.get_state(), state)
    assert (random.random(), np.random.rand()) == (
        random.seed(1) or random.random(),
        np.random.seed(1) or np.random.rand(),
    )
    assert learn.lr_find(num_it=12) == first  # the same batches: the same sweep


def test_lr_find_before_any_fit_creates_no_optimizer(tmp_path):
    learn = learner(tmp_path)
    learn.lr_find(num_it=10)
    assert learn.opt is None


def test_lr_find_crosses_epochs_without_validation_and_plots(tmp_path):
    class Batches(Callback):
        def __init__(self):
            self.valid = self.train = 0

        def on_batch_end(self, train):
            self.train += train
            self.valid += not train

    seen = Batches()
    learn = learner(tmp_path, n_train=48, callbacks=[seen])  # 3 batches an epoch
    learn.lr_find(num_it=10, stop_div=False)
    result = learn.recorder.lr_find_result
    assert len(result["lrs"]) == 10 and seen.train == 10 and seen.valid == 0
    assert result["lrs"][0] == pytest.approx(1e-7)
    assert result["lrs"][-1] == pytest.approx(10.0)
    ax = learn.recorder.plot_lr_find()
    assert ax.get_xscale() == "log"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(s.startswith("steepest") for s in labels)
    assert any(s.startswith("min_div10") for s in labels)


def test_lr_find_counts_optimizer_steps_under_gradient_accumulation(tmp_path):
    steps = []

    class Steps(Callback):
        def on_step_end(self, skip_step):
            steps.append(not skip_step)

    learn = learner(tmp_path, n_train=64, callbacks=[GradientAccumulation(2), Steps()])
    learn.lr_find(num_it=6, stop_div=False)
    assert len(learn.recorder.lr_find_result["lrs"]) == 6
    assert sum(steps) == 6 and len(steps) == 12


def test_plot_lr_find_before_a_sweep_says_what_to_do(tmp_path):
    with pytest.raises(ValueError, match=r"learn.lr_find\(\) first"):
        learner(tmp_path).recorder.plot_lr_find()


def test_a_loss_that_is_never_finite_is_a_clear_error(tmp_path):
    learn = Learner(
        make_data(),
        make_model(),
        lambda out, y: F.cross_entropy(out, y) * math.nan,
        metrics=[],
        path=tmp_path,
        progress=False,
    )
    with pytest.raises(RuntimeError, match="not finite from the first step"):
        learn.lr_find(num_it=10)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"start_lr": 0.0}, "0 < start_lr < end_lr"),
        ({"start_lr": 1.0, "end_lr": 0.1}, "0 < start_lr < end_lr"),
        ({"num_it": 1}, "num_it must be an int >= 2"),
        ({"num_it": 10.0}, "num_it must be an int >= 2"),
        ({"mode": "log"}, "mode must be 'exp'"),
        ({"check_every": -1}, "check_every must be"),
    ],
)
def test_bad_arguments_are_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LRFinder(**kwargs)


@pytest.mark.filterwarnings("ignore:MixedPrecision.float16. on the CPU")
def test_lr_find_leaves_a_fresh_fp16_learner_with_a_fresh_loss_scale(tmp_path):
    learn = learner(tmp_path, opt_func=torch.optim.SGD).to_fp16()
    learn.lr_find(num_it=20, end_lr=1e4, stop_div=False)  # overflows: scale drops
    mp = learn.callbacks[0]
    assert mp.scaler is None and mp.state_dict() == {"skipped_steps": 0}
    learn.fit(1, lr=1e-3)
    assert mp.scaler.get_scale() == 2.0**16


def test_a_sweep_that_is_never_finite_restores_the_weights_and_says_so(tmp_path):
    model = make_model()
    weights = clone_params(model)

    def nan_loss(out, y):
        return F.cross_entropy(out, y) * math.nan

    learn = Learner(
        make_data(), model, nan_loss, metrics=[], path=tmp_path, progress=False
    )
    with pytest.raises(RuntimeError, match="not finite from the first step"):
        learn.lr_find(num_it=10, stop_div=False)
    assert all(map(torch.equal, weights, model.parameters()))


def test_lr_find_runs_with_callbacks_that_monitor_a_metric(tmp_path):
    from fitlib.callbacks import ReduceLROnPlateau

    plateau = ReduceLROnPlateau("accuracy")
    learn = learner(tmp_path, callbacks=[plateau])
    learn.metrics = [accuracy]
    assert learn.lr_find(num_it=10).min_div10 > 0
    assert plateau.reductions == []


def test_after_lr_find_the_recorder_logs_this_fits_lr_before_its_first_step(
    tmp_path,
):
    learn = learner(tmp_path, callbacks=[GradientAccumulation(3)])
    learn.fit(1, lr=1e-2)
    learn.lr_find(num_it=6, stop_div=False)
    learn.fit(1, lr=1e-3)
    assert learn.recorder.lrs[-7:] == [1e-3] * 7
    learn.fit_one_cycle(1, max_lr=1e-2)  # its last step: 1e-2 / 25e4
    learn.fit(1, lr=1e-3)
    assert learn.recorder.lrs[-7:] == [1e-3] * 7


def test_a_failure_before_the_sweep_started_is_not_hidden(tmp_path):
    class Broken(Callback):
        def on_train_begin(self):
            raise OSError("disk full")

    learn = learner(tmp_path, callbacks=[Broken()])
    with pytest.raises(OSError, match="disk full") as info:
        learn.lr_find(num_it=10)
    assert not any("LRFinder" in note for note in getattr(info.value, "__notes__", []))


def test_checkpoints_and_loggers_sit_out_the_sweep(tmp_path):
    from fitlib.callbacks import Checkpoint, CSVLogger, every

    ckpt, csv = Checkpoint(tmp_path / "ckpt"), CSVLogger(tmp_path / "log.csv")
    learn = learner(tmp_path, callbacks=[ckpt, every(CSVLogger(tmp_path / "b.csv"), 1)])
    learn.fit(1, lr=1e-2)  # writes a checkpoint and a CSV row
    learn.callbacks.append(csv)
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    weights = clone_params(learn.model)
    learn.lr_find(num_it=10)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == files
    assert not (tmp_path / "log.csv").exists()
    assert all(map(torch.equal, weights, learn.model.parameters()))


class Counter(Callback):
    """A callback whose state_dict hands back its live list, not a copy."""

    def __init__(self):
        self.seen = []

    def on_batch_end(self, train, **kwargs):
        if train:
            self.seen.append(1)

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


@pytest.mark.filterwarnings("ignore:lr_find:UserWarning")  # a toy sweep
def test_the_sweep_puts_back_a_callbacks_state_even_when_it_hands_out_its_own():
    counter = Counter()
    learn = Learner(make_data(), make_model(), F.cross_entropy, progress=False,
                    callbacks=[counter])  # fmt: skip
    learn.lr_find(num_it=8)
    assert counter.seen == []  # as before the sweep, not the sweep's 8 steps


class Interrupt(Callback):
    in_lr_find = True

    def on_batch_end(self, iteration, **kwargs):
        if iteration == 2:
            raise KeyboardInterrupt


@pytest.mark.filterwarnings("ignore:lr_find:UserWarning")
def test_an_interrupted_sweep_keeps_the_previous_sweeps_result():
    learn = Learner(make_data(), make_model(), F.cross_entropy, progress=False)
    learn.lr_find(num_it=8)
    first = learn.recorder.lr_find_result
    learn.callbacks.append(Interrupt())
    with pytest.raises(KeyboardInterrupt):
        learn.lr_find(num_it=8)
    assert learn.recorder.lr_find_result is first
    assert len(first["lrs"]) == 8
