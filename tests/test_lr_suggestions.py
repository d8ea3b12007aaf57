"""``fitlib.lr_suggestions``: the learning rates read off a sweep's losses
(``suggest_lrs``) and what makes them doubtful (``sweep_problems``), on
scripted curves; where a sweep diverged (``divergence``). The finder that
records the sweep: ``tests/callbacks/test_lr_finder.py``."""

import math

import pytest

from fitlib.lr_suggestions import SuggestedLRs, divergence, suggest_lrs, sweep_problems

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


def test_a_negative_loss_diverges_only_when_it_rises_by_3_times_its_size():
    assert divergence([-1.0, -1.1, -1.5, -1.4, -2.0]) == 5  # falling: no divergence
    assert divergence([-1.0, -2.0, 3.0, 5.0]) == 3  # above -2 + 3 * 2 = 4
    assert divergence([2.0, 1.0, 3.9, 4.1]) == 3  # 4x the best, as before
