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
from fitlib.callbacks.lr_finder import SuggestedLRs, suggest_lrs, sweep_problems
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


# -- suggestions on scripted curves ------------------------------------------------
LRS = [10 ** (i / 5 - 6) for i in range(40)]  # 1e-6 to 10**1.8, 5 a decade
NOISY_FLAT = [2.30, 2.34, 2.27, 2.31, 2.29, 2.33, 2.28, 2.30, 2.32, 2.29]
NOISY_FLAT += [2.31, 2.28, 2.30, 2.33, 2.29, 2.31, 2.30, 2.29, 2.31, 2.30]  # 0-19
VALLEY = [2.25, 2.15, 2.0, 1.8, 1.6, 1.45, 1.3, 1.2, 1.15, 1.12]  # 20-29
# Diverges at 34 (5.0 > 4 * 1.12); the lower losses after it must not count.
SPIKE = [1.13, 1.25, 1.6, 2.5, 5.0, 3.0, 1.0, 0.8, 0.7, 0.6]


def test_the_valley_skips_the_noisy_start_and_ends_at_the_minimum_before_divergence():
    suggestions = suggest_lrs(LRS, NOISY_FLAT + VALLEY + SPIKE)
    # Start level 2.30 (median of the first tenth: 2.30, 2.34, 2.27), minimum
    # 1.12 at 29: the flat start ends at 20, the last loss above 2.30 - 0.118.
    # The valley 20..29: its middle is 24; it falls fastest around 23
    # (central differences: 1.6 - 2.0 over two steps).
    assert suggestions == SuggestedLRs(LRS[24], LRS[23], LRS[29] / 10)
    assert sweep_problems(LRS, NOISY_FLAT + VALLEY + SPIKE) == {}


def test_a_nan_tail_is_a_divergence_like_a_spike():
    losses = NOISY_FLAT + VALLEY + SPIKE[:4] + [math.nan] * 6
    assert suggest_lrs(LRS, losses) == SuggestedLRs(LRS[24], LRS[23], LRS[29] / 10)
    assert sweep_problems(LRS, losses) == {}  # it diverged: no end_edge


def test_a_loss_that_never_falls_by_one_percent_is_a_no_fall():
    flat = [2.300, 2.304, 2.297, 2.301, 2.299, 2.303, 2.298, 2.300, 2.302, 2.299]
    losses = [*flat, *flat, 2.30, 2.29, 2.31, 2.30, 2.285, 2.29, 2.30, 2.31, 2.32]
    # Start level 2.302 (the first tenth: 2 points); lowest 2.285, 0.74% below.
    problems = sweep_problems(LRS[:29], losses)
    assert list(problems) == ["no_fall"]
    assert problems["no_fall"].startswith("lr_find: the loss never fell")
    assert "(2.285, at lr 0.063)" in problems["no_fall"]
    assert "num_it" in problems["no_fall"] and "labels" in problems["no_fall"]
    assert all(isinstance(lr, float) for lr in suggest_lrs(LRS[:29], losses))
    # 1.4% below its start: a fall, 15 times a step's noise (0.0021) deep.
    assert sweep_problems(LRS[:29], [*losses[:24], 2.27, *losses[25:]]) == {}


def test_a_loss_still_falling_at_the_end_is_an_end_edge():
    losses = [2.3] * 15 + [2.3 - 0.01 * (i - 14) ** 2 for i in range(15, 30)]
    # Minimum at the last point (29); the flat start ends at 18, the last loss
    # above 2.3 - 0.1 * 2.25; the fall is steepest at 28.
    assert suggest_lrs(LRS[:30], losses) == SuggestedLRs(LRS[23], LRS[28], LRS[29] / 10)
    problems = sweep_problems(LRS[:30], losses)
    assert list(problems) == ["end_edge"]
    assert "raise end_lr, e.g. end_lr=6e+01" in problems["end_edge"]  # 0.63 * 100


def test_a_loss_falling_from_the_first_point_is_a_start_edge():
    losses = [2.3 - 0.05 * i for i in range(20)] + [1.05, 1.3, 2.0, 3.0, 5.0]
    losses += [math.nan] * 5  # diverges at 24: its first tenth is 2 points
    # Start level 2.275; the loss leaves its band (2.1525) after 2, in the
    # first fifth; minimum 1.05 at 20, steepest drop into it at 19.
    assert suggest_lrs(LRS[:30], losses) == SuggestedLRs(LRS[11], LRS[19], LRS[20] / 10)
    problems = sweep_problems(LRS[:30], losses)
    assert list(problems) == ["start_edge"]
    assert "lower start_lr, e.g. start_lr=1e-08" in problems["start_edge"]


def test_a_flat_sweep_suggests_a_tenth_of_where_the_steps_loss_first_moved():
    # LeNet with plain SGD: the smoothed loss is flat within a fraction of a
    # percent (its lowest point is noise, here the 2nd), while each step's
    # own loss stays in its band until it jumps as training starts to break.
    smooth = [2.300, 2.295, *NOISY_FLAT[2:], *[2.30, 2.301, 2.299] * 5, 2.302]
    steps = [*NOISY_FLAT, *NOISY_FLAT[:10], 2.25, 2.40, 2.1, 2.5, 2.3, 2.3]
    # The first half's median is 2.30 and its spread 0.015 (1.4826 times a
    # median deviation of 0.01): the first step 6 spreads (0.089) away is 31,
    # at lr 1.6 (2.25 at 30 is not).
    assert suggest_lrs(LRS[:36], smooth, steps).valley == pytest.approx(LRS[31] / 10)
    problems = sweep_problems(LRS[:36], smooth, steps)
    assert list(problems) == ["no_fall"]  # before: valley 1.1e-06, said noise
    assert "valley (0.16) is a guess" in problems["no_fall"]
    assert "first moved (lr 1.6)" in problems["no_fall"]


# A network that sits on its plateau and dies as it starts to learn (LeNet,
# SGD with momentum 0.9, 300 steps): the smoothed loss dips 2.8% just before
# its cliff, while a step's own loss varies by 0.015 (NOISY_FLAT's spread).
CLIFF_STEPS = [*NOISY_FLAT, *NOISY_FLAT[:10], 2.2, 2.15, 2.1, 2.2, 40.0]
FLAT_THEN = [2.300, 2.301, 2.299] * 10  # 0-29, start level 2.30


def test_a_small_fall_just_before_a_cliff_is_said_to_be_no_valley():
    smooth = [*FLAT_THEN, 2.29, 2.27, 2.25, 2.235, 9.5]  # diverges at 34
    # The fall, 0.065, is 1% of the start level but not 15 times a step's
    # noise (0.021, of its changes from step to step): a cliff.
    problems = sweep_problems(LRS[:35], smooth, CLIFF_STEPS, num_it=300, mom=0.9)
    assert list(problems) == ["cliff"]  # before: none
    message = problems["cliff"]
    assert message.startswith("lr_find: the loss fell only 2.8% before diverging")
    assert "the edge of a cliff, not a valley" in message
    # The valley stays where it was (a lower rate trained fewer seeds in
    # benchmarks/lr_find_suggestions.py); the message names both.
    valley = suggest_lrs(LRS[:35], smooth, CLIFF_STEPS).valley
    assert valley == LRS[31]  # the middle of 30..33
    assert f"valley ({valley:.2g}) lies on that edge" in message
    assert f"(min_div10, {LRS[33] / 10:.2g})" in message
    # The same cliff after a deep fall (17%, 19 times the noise): a valley.
    deep = [*FLAT_THEN, 2.2, 2.05, 1.95, 1.9, 9.5]
    assert sweep_problems(LRS[:35], deep, CLIFF_STEPS) == {}


def test_the_no_fall_fixes_fit_the_sweep_that_was_run():
    smooth = [*FLAT_THEN, 2.29, 2.27, 2.25, 2.235, 9.5]
    short = sweep_problems(LRS[:35], smooth, CLIFF_STEPS, num_it=100, mom=0.0)
    assert "sweep longer (e.g. num_it=300)" in short["cliff"]
    assert "the momentum you will train with" in short["cliff"]
    long = sweep_problems(LRS[:35], smooth, CLIFF_STEPS, num_it=300, mom=0.9)
    assert "num_it" not in long["cliff"] and "momentum" not in long["cliff"]
    assert (
        "start nearer the lr where the loss moved (e.g. start_lr=1e-03)"
        in (long["cliff"])
    )
    # A sweep in which nothing moved and nothing diverged: raise end_lr.
    flat = sweep_problems(LRS[:20], [2.3] * 20, num_it=300, mom=0.9)
    assert "raise end_lr (e.g. end_lr=6e-01)" in flat["no_fall"]
    assert "start nearer" not in flat["no_fall"]


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


def test_a_flat_sweep_whose_steps_never_moved_suggests_a_tenth_of_its_last_lr():
    losses = [2.302585] * 20  # a loss without gradient: ln(10), exactly
    assert suggest_lrs(LRS[:20], losses, losses).valley == pytest.approx(LRS[19] / 10)


def test_a_low_among_the_first_points_is_noise_not_a_fall():
    # A debiased moving average starts as single batches' losses: 2% below
    # the start level at the 2nd point, then flat. Before: a fall from the
    # start (a start_edge warning), its valley at the sweep's first lr.
    losses = [2.30, 2.24, *NOISY_FLAT[2:], *NOISY_FLAT]
    assert list(sweep_problems(LRS, losses)) == ["no_fall"]
    assert suggest_lrs(LRS, losses).min_div10 > LRS[3] / 10


def test_suggest_lrs_refuses_a_sweep_without_a_finite_first_loss():
    with pytest.raises(ValueError, match="finite first loss"):
        suggest_lrs([1e-3, 1e-2], [math.nan, 1.0])


# -- the finder's problems and warnings --------------------------------------------
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


def test_a_negative_loss_diverges_only_when_it_rises_by_3_times_its_size():
    from fitlib.callbacks.lr_finder import _divergence

    assert _divergence([-1.0, -1.1, -1.5, -1.4, -2.0]) == 5  # falling: no divergence
    assert _divergence([-1.0, -2.0, 3.0, 5.0]) == 3  # above -2 + 3 * 2 = 4
    assert _divergence([2.0, 1.0, 3.9, 4.1]) == 3  # 4x the best, as before
