"""The learning rates an LR finder's sweep suggests, and when to distrust them.

``suggest_lrs`` reads ``SuggestedLRs`` off a sweep's smoothed losses before
it diverged (``divergence``), and ``valley`` off each step's own loss when
the smoothed one never fell. ``sweep_problems`` says when the suggestions
deserve no trust (the loss never fell, or fell no deeper than its noise just
before a cliff) or the sweep's range cut them off. Pure functions of the
sweep's numbers: ``LRFinder`` (``fitlib.callbacks.lr_finder``) runs the
sweep and calls them.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

DIVERGED = 4.0  # the smoothed loss, as a multiple of its best, that ends a sweep
# The loss "fell" if its lowest value before the divergence is at least this
# fraction (of its start level's magnitude) below the start level: the median
# of the first tenth of the sweep, where the smoothed loss is mostly noise.
FELL = 0.01
# The flat start ends at the last point, before the minimum, whose loss is
# still within this fraction of the total fall below the start level.
FLAT = 0.1
# A step's own loss has moved when it lies this many robust standard
# deviations (1.4826 times the median absolute deviation) from the median of
# the first half of the sweep: in 100 steps of pure noise that happens by
# chance about once in 10,000 sweeps (more often with the heavier tails of
# real losses, still rarely).
MOVED = 6.0
# A fall is a valley, not a cliff's edge, if it is this many times a step's
# noise deep
# (the robust standard deviation of the first half's step-to-step changes,
# over the square root of 2: a trend does not count as noise). On digits the
# valleys that train (Adam: LeNet, an MLP) fall 25 to 73 of them, while a
# network that dies as it starts to learn (LeNet, SGD) dips 3 to 9.4 just
# before its cliff (``benchmarks/lr_find_suggestions.py``).
DEEP = 15.0
# Below this many steps, a no_fall warning suggests a longer sweep.
LONG_SWEEP = 300


class SuggestedLRs(NamedTuple):
    """Learning rates read off an LR finder's curve (see ``suggest_lrs``).

    ``valley`` (the one to use): half-way, in log lr, along the valley, the
    stretch from where the smoothed loss leaves its flat start to its minimum;
    when the loss never fell, a tenth of the lr at which the steps' own losses
    first moved (the ``no_fall`` warning says so).
    ``steepest``: where it falls fastest (per log lr) in that valley.
    ``min_div10``: the lr of its minimum, divided by 10.
    """

    valley: float
    steepest: float
    min_div10: float


def suggest_lrs(
    lrs: list[float], losses: list[float], step_losses: list[float] | None = None
) -> SuggestedLRs:
    """Learning rates read off a sweep's smoothed losses, before it diverged.

    The divergence is the first loss that is not finite or above 4 times the
    best before it: nothing from there on counts. The start level is the
    median of the sweep's first tenth; the minimum is looked for after it (a
    debiased moving average starts as single batches' losses: a low among them
    is noise). When the loss fell (its minimum is at least 1% below the start
    level), the flat start ends at the last point before the minimum whose
    loss is still within a tenth of the total fall below the start level, so
    its noise decides nothing, and the valley runs from there to the minimum:
    ``valley`` is its middle point (half-way in log lr in a geometric sweep),
    ``steepest`` its steepest descent, ``min_div10`` the minimum's lr / 10.

    When the loss never fell, its minimum is noise, and so is a valley
    anchored on it. What such a sweep does show is where the loss first
    moved: the first step whose own loss (``step_losses``, unsmoothed: the
    smoothed ones lag dozens of steps) lies 6 robust standard deviations from
    the median of the sweep's first half (the last step if none does). There
    training starts to act, or to break; ``valley`` is then a tenth of that
    lr, as ``min_div10`` is of a minimum (without ``step_losses``, the
    smoothed losses stand in). ``sweep_problems`` says when to distrust them.

    Examples:
        >>> from fitlib.lr_suggestions import suggest_lrs
        >>> lrs = [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0]
        >>> suggest_lrs(lrs, [2.3, 2.31, 2.3, 2.2, 1.8, 1.0, 0.9, 9.0])
        SuggestedLRs(valley=0.01, steepest=0.01, min_div10=0.1)
    """
    c = _landmarks(lrs, losses, step_losses)
    steepest = c.low
    if c.low > c.first:  # the slope per log lr, over the valley before its end
        x = np.log(np.asarray(lrs[: len(c.losses)], dtype=float))
        steepest = c.first + int(np.argmin(np.gradient(c.losses, x)[c.first : c.low]))
    valley = lrs[(c.first + c.low) // 2] if c.fell else lrs[c.moved] / 10
    return SuggestedLRs(float(valley), float(lrs[steepest]), float(lrs[c.low]) / 10)


def sweep_problems(
    lrs: list[float],
    losses: list[float],
    step_losses: list[float] | None = None,
    num_it: int | None = None,
    mom: float | None = None,
) -> dict[str, str]:
    """What makes a sweep's suggestions doubtful, each with what to do.

    ``"no_fall"``: the loss never fell (its minimum before the divergence is
    less than 1% below its start level), so the valley is a guess (a tenth of
    the lr where the loss first moved, see ``suggest_lrs``) and the others are
    noise; else ``"start_edge"``: the valley begins in the first fifth of the
    sweep (a fall from the very first point leaves the start level's band
    about a tenth in), and ``"end_edge"``: the loss never diverged and is
    lowest in the last 5% of the sweep, not climbing back by a tenth of its
    fall after. Pass the whole sweep, past its divergence.

    ``"cliff"``: the loss fell 1% or more, but less than 15 times the noise
    of a step's own loss (the robust standard deviation of its changes from
    step to step in the sweep's first half, over sqrt(2)): the shape of a network that
    sits on its plateau and breaks as it starts to learn, whose valley lies
    on the cliff's edge (then no other problem is looked for). ``num_it``
    (the sweep's planned steps; default ``len(lrs)``) and ``mom`` (the
    sweep's momentum, None if unknown) choose the fixes the message offers.

    Examples:
        >>> from fitlib.lr_suggestions import sweep_problems
        >>> problems = sweep_problems([1e-3, 1e-2, 1e-1, 1.0], [2.3, 2.3, 2.3, 2.29])
        >>> print(problems["no_fall"])
        lr_find: the loss never fell: its lowest value before the sweep ended
        (2.29, at lr 1) is less than 1% below its start (2.3), so the sweep shows
        no valley. ...
    """
    c, n = _landmarks(lrs, losses, step_losses), len(losses)
    low, lr0, last = c.losses[c.low], lrs[0], lrs[n - 1]
    if not c.fell:
        return {"no_fall": _no_fall(c, lrs, num_it or n, mom)}
    if not c.deep:
        return {"cliff": _cliff(c, lrs, num_it or n, mom)}
    problems = {}
    if c.first < 2 * c.tenth:
        problems["start_edge"] = (
            f"lr_find: the loss already falls near the start of the sweep (its "
            f"valley begins at lr {lrs[c.first]:.2g}, in the first fifth), so the "
            f"suggestions may be too high. Fix: lower start_lr, e.g. "
            f"start_lr={lr0 / 100:.0e}; on a model trained already, the curve "
            "is mostly noise: run lr_find before fitting."
        )
    rose = c.losses[-1] - low > FLAT * (c.start - low)  # it stopped falling
    if not (c.diverged or rose) and c.low >= n - max(2, n // 20):
        problems["end_edge"] = (
            f"lr_find: the loss still falls at the end of the sweep (lr "
            f"{last:.2g}) and never diverged: better rates may lie above it. "
            f"Fix: raise end_lr, e.g. end_lr={last * 100:.0e}."
        )
    return problems


def _no_fall(c: _Landmarks, lrs: list[float], num_it: int, mom: Any) -> str:
    low, moved = c.losses[c.low], lrs[c.moved]
    return (
        f"lr_find: the loss never fell: its lowest value before {_end(c)} "
        f"({low:.4g}, at lr {lrs[c.low]:.2g}) is less than {FELL:.0%} below its "
        f"start ({c.start:.4g}), so the sweep shows no valley. valley "
        f"({moved / 10:.2g}) is a guess, a tenth of the lr at which the loss "
        f"first moved (lr {moved:.2g}); steepest and min_div10 are noise. Check "
        "that the inputs match the labels and the model's output fits the "
        f"loss; then {'; or '.join(_no_fall_fixes(c, lrs, num_it, mom))}."
    )


def _cliff(c: _Landmarks, lrs: list[float], num_it: int, mom: Any) -> str:
    fixes = _no_fall_fixes(c, lrs, num_it, mom)
    return (
        f"lr_find: the loss fell only {c.fall / abs(c.start):.1%} before "
        f"{_end(c)} (from {c.start:.4g} to {c.losses[c.low]:.4g}, at lr "
        f"{lrs[c.low]:.2g}), less than {DEEP:g} times the noise of a step's "
        f"loss ({c.noise:.2g}): the edge of a cliff, not a valley (the model "
        "breaks as it starts to learn). valley "
        f"({lrs[(c.first + c.low) // 2]:.2g}) lies on that edge: a short fit "
        "there may train or stay at chance, and a lower rate (min_div10, "
        f"{lrs[c.low] / 10:.2g}) may need many more epochs to leave the "
        f"plateau. Check a short fit at both, or {'; or '.join(fixes)}."
    )


def _end(c: _Landmarks) -> str:
    """How the sweep's useful part ended, for a message."""
    return "diverging" if c.diverged else "the sweep ended"


def _no_fall_fixes(c: _Landmarks, lrs: list[float], num_it: int, mom: Any) -> list:
    """What may show a valley, for a sweep that showed none."""
    fixes = []
    if mom == 0:
        fixes.append(
            "sweep with the momentum you will train with (fit_one_cycle's is "
            "0.85-0.95), e.g. opt_func=partial(torch.optim.SGD, momentum=0.9)"
        )
    if num_it < LONG_SWEEP:
        fixes.append(f"sweep longer (e.g. num_it={LONG_SWEEP})")
    if c.moved == len(c.losses) - 1 and not c.diverged:  # nothing moved yet
        fixes.append(f"raise end_lr (e.g. end_lr={lrs[c.moved] * 100:.0e})")
    else:
        fixes.append(
            f"start nearer the lr where the loss moved (e.g. start_lr="
            f"{lrs[c.moved] / 1000:.0e}), so that more of the sweep's steps "
            "train there"
        )
    return fixes


class _Landmarks(NamedTuple):
    losses: np.ndarray  # the sweep before its divergence
    diverged: bool
    tenth: int  # the points of its first tenth, whose median is the start level
    start: float
    first: int  # the last point of the flat start: the valley begins
    low: int  # the minimum after the first tenth: the valley ends
    fell: bool  # the minimum is at least FELL below the start level
    deep: bool  # and DEEP times a step's noise
    moved: int  # the first step whose own loss left the flat level
    fall: float  # the start level less the minimum
    noise: float  # of a step's own loss (see _step_noise)


def _landmarks(
    lrs: list[float], losses: list[float], step_losses: list[float] | None
) -> _Landmarks:
    end = divergence(losses)
    steps = losses if step_losses is None else step_losses
    if end == 0 or len(lrs) < len(losses) or len(steps) < end:
        raise ValueError(
            f"a sweep needs an lr per loss, a step loss per loss before its "
            f"divergence and a finite first loss; got {len(lrs)} lrs and "
            f"{len(steps)} step losses for {len(losses)} losses, the first "
            f"{losses[0] if losses else None!r}."
        )
    y = np.asarray(losses[:end], dtype=float)
    tenth = max(1, end // 10)
    start = float(np.median(y[:tenth]))
    low = int(np.argmin(y)) if end <= tenth else tenth + int(np.argmin(y[tenth:]))
    flat = np.flatnonzero(y[: low + 1] >= start - FLAT * (start - y[low]))
    first = int(flat[-1]) if flat.size else 0
    fall, noise = start - y[low], _step_noise(steps[:end])
    fell, deep = fall >= FELL * abs(start), fall >= DEEP * noise
    moved = _first_move(steps[:end])
    return _Landmarks(
        y, end < len(losses), tenth, start, first, low, fell, deep, moved, fall, noise
    )


def _robust_std(x: np.ndarray) -> float:
    """1.4826 times the median absolute deviation: a standard deviation that
    outliers do not move."""
    return float(1.4826 * np.median(np.abs(x - np.median(x))))


def _step_noise(step_losses: list[float]) -> float:
    """The noise of a step's own loss: the robust standard deviation of the
    changes from step to step over the first half, divided by sqrt(2)."""
    ref = np.asarray(step_losses[: max(2, len(step_losses) // 2)], dtype=float)
    return _robust_std(np.diff(ref)) / math.sqrt(2) if len(ref) > 1 else 0.0


def _first_move(step_losses: list[float]) -> int:
    """The first step whose loss is not finite or lies ``MOVED`` robust
    standard deviations from the median of the first half; else the last."""
    y = np.asarray(step_losses, dtype=float)
    ref = y[: max(1, len(y) // 2)]
    level, spread = np.median(ref), _robust_std(ref)
    away = np.flatnonzero(~(np.abs(y - level) <= MOVED * spread))
    return int(away[0]) if away.size else len(y) - 1


def divergence(losses: list[float]) -> int:
    """The index of the first diverged loss (``len(losses)`` if none): not
    finite, or above ``DIVERGED`` times the best before it (the best plus
    ``DIVERGED - 1`` times its size: a loss may be negative, as an NLL is)."""
    best = math.inf
    for i, loss in enumerate(losses):
        if not math.isfinite(loss) or loss - best > (DIVERGED - 1) * abs(best):
            return i
        best = min(best, loss)
    return len(losses)
