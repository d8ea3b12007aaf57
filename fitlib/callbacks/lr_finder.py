"""``LRFinder``: trains briefly at growing learning rates to pick a good one.

The learning rate sweeps from ``start_lr`` to ``end_lr`` over ``num_it``
optimizer steps (across epochs if the loader is short, without validation),
recording the smoothed loss of each step. Afterwards the model, the optimizer
and the random number generators are as they were before, bit for bit.

The sweep stops once the smoothed loss exceeds 4 times its best value or is
not finite. That test runs on the device: the losses are read at most every
``check_every`` seconds (and at the end), so the sweep can run up to that long
past the divergence; the steps after it are dropped from the record.

The suggestions are read off the smoothed loss before the divergence, and
``valley`` off each step's own loss when the smoothed one never fell (see
``suggest_lrs``). ``sweep_problems`` says when they deserve no trust (the loss
never fell, or fell no deeper than its noise just before a cliff) or the
sweep's range cut them off; the finder keeps these in
``problems`` and warns about each.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from typing import Any, NamedTuple

import numpy as np
import torch

import fitlib.ranks as ranks
from fitlib.callback import Callback
from fitlib.checks import check_int, check_number
from fitlib.core import fit
from fitlib.errors import is_number
from fitlib.host_copy import to_floats
from fitlib.rng import get_rng_state, set_rng_state
from fitlib.serialization import host_copy

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


class LRFinder(Callback):
    """Sweeps the learning rate over ``num_it`` steps and records the loss.

    After the fit, ``lrs``, ``losses`` (smoothed) and ``step_losses`` (each
    step's own) hold the sweep up to the divergence, ``suggestions`` the
    suggested learning rates, and ``result`` all three as a dict for
    ``Recorder.plot_lr_find``. ``problems`` maps what makes the suggestions
    doubtful (``"no_fall"``, ``"cliff"``, ``"start_edge"``, ``"end_edge"``:
    see ``sweep_problems``) to its message; each is also warned about (a
    ``UserWarning``, by the main process) when the sweep ends without an
    error.

    Args:
        start_lr: the learning rate of the first step (> 0).
        end_lr: the learning rate of step ``num_it`` (> ``start_lr``).
        num_it: the number of optimizer steps of the sweep.
        stop_div: stop when the smoothed loss diverges (> 4x its best, or not
            finite).
        mode: ``"exp"`` (geometric steps, the usual) or ``"linear"``.
        check_every: seconds of training between two reads of the losses
            (each read is one host-device sync); 0 reads after every step.

    Examples:
        >>> finder = LRFinder(num_it=40)  # 10 epochs of 4 batches: 40 steps
        >>> history = fit(10, model, F.cross_entropy, opt, data, callbacks=[finder])
        >>> finder.suggestions
        SuggestedLRs(valley=0.5..., steepest=0.5..., min_div10=0.6...)

        64 samples make a short, noisy sweep; ``problems`` says why these
        suggestions are doubtful (and a ``UserWarning`` said it too):

        >>> print(finder.problems["cliff"])
        lr_find: the loss fell only 4...% before the sweep ended (...), less
        than 15 times the noise of a step's loss (...): the edge of a cliff, not
        a valley (the model breaks as it starts to learn). ...
    """

    order = 10
    sets_hypers = ("lr",)  # no schedule of lr may run beside the sweep

    _saved: dict | None = None  # what on_train_begin saved, until restored

    def __init__(
        self,
        start_lr: float = 1e-7,
        end_lr: float = 10.0,
        num_it: int = 100,
        stop_div: bool = True,
        mode: str = "exp",
        check_every: float = 0.25,
    ) -> None:
        _check_args(start_lr, end_lr, num_it, mode, check_every)
        self.start_lr, self.end_lr, self.num_it = start_lr, end_lr, num_it
        self.stop_div, self.mode, self.check_every = stop_div, mode, check_every
        self.lrs: list[float] = []
        self.losses: list[float] = []
        self.step_losses: list[float] = []
        self.suggestions: SuggestedLRs | None = None
        self.problems: dict[str, str] = {}

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based)."""
        pct = step / max(self.num_it - 1, 1)
        if self.mode == "exp":
            return self.start_lr * (self.end_lr / self.start_lr) ** pct
        return self.start_lr + (self.end_lr - self.start_lr) * pct

    @property
    def result(self) -> dict:
        """``lrs``, ``losses`` and ``suggestions`` (a dict) of the last sweep."""
        suggestions = self.suggestions._asdict() if self.suggestions else {}
        return {"lrs": self.lrs, "losses": self.losses, "suggestions": suggestions}

    # -- hooks -----------------------------------------------------------------
    def on_train_begin(self, model: torch.nn.Module, opt: Any, data: Any) -> None:
        """Runs before training: saves what the sweep changes, sets start_lr."""
        self._saved = _snapshot(model, opt, data)
        self._losses: list[torch.Tensor] = []  # device tensors, one per step
        self._floats: list[float] = []  # the first of them, already read
        self._raw: list[torch.Tensor] = []  # each step's own loss, read at the end
        self._step, self._stepped = 0, False
        self._last_check = time.perf_counter()
        self.lrs, self.losses, self.suggestions = [], [], None
        self.step_losses = []
        self.problems = {}
        self._mom = _momentum(opt)
        opt.lr = self.lr_at(0)

    def on_epoch_begin(self) -> dict:
        """Runs at the start of each epoch: the sweep never validates."""
        return {"skip_validate": True}

    def on_step_end(self, skip_step: bool) -> None:
        """Runs after each optimizer step: notes that one happened."""
        self._stepped = self._stepped or not skip_step

    def on_batch_end(
        self, train: bool, opt: Any, smooth_loss: Any, last_loss: Any
    ) -> dict | None:
        """Runs after each batch: records a step, sets the next lr, may stop."""
        if not (train and self._stepped):  # validation, or still accumulating
            return None
        self._stepped = False
        self._losses.append(smooth_loss)
        self._raw.append(last_loss)
        self._step += 1
        if self._step >= self.num_it or self._diverged():
            return {"stop_training": True}
        opt.lr = self.lr_at(self._step)
        return None

    def on_train_end(
        self, model: torch.nn.Module, opt: Any, exception: BaseException | None
    ) -> None:
        """Runs at the end (also after an error): restores, keeps the sweep,
        suggests learning rates and warns about doubtful ones."""
        if self._saved is None:
            return  # never started: an earlier callback's on_train_begin failed
        try:
            losses, raw = self._read(with_steps=True)
        finally:  # whatever happens, the model and optimizer go back
            _restore(self._saved, model, opt)
            self._saved = None
        end = _divergence(losses) if self.stop_div else len(losses)
        self.losses, self.step_losses = losses[:end], raw[:end]
        self.lrs = [self.lr_at(i) for i in range(end)]
        self._losses, self._floats, self._raw = [], [], []
        if self.losses and math.isfinite(self.losses[0]):  # else none: lr_find says
            self._suggest(losses, raw, warn=exception is None and ranks.is_main())

    def _suggest(self, losses: list[float], raw: list[float], warn: bool) -> None:
        """Suggestions off the record; problems off the whole sweep read, past
        the divergence (whether it diverged decides an "end_edge")."""
        self.suggestions = suggest_lrs(self.lrs, self.losses, self.step_losses)
        lrs = [self.lr_at(i) for i in range(len(losses))]
        self.problems = sweep_problems(lrs, losses, raw, self.num_it, self._mom)
        for message in self.problems.values() if warn else ():
            _warn(message)

    # -- divergence --------------------------------------------------------------
    def _diverged(self) -> bool:
        """Whether the losses read so far diverged; reads them when it is time."""
        now = time.perf_counter()
        if not self.stop_div or now - self._last_check < self.check_every:
            return False
        self._last_check = now
        losses = self._read()
        return _divergence(losses) < len(losses)

    def _read(self, with_steps: bool = False) -> Any:
        """All smoothed losses as floats: one transfer for those not read
        before; ``with_steps``: and the steps' own losses, in the same one."""
        new = self._losses[len(self._floats) :]
        floats = to_floats(new, self._raw if with_steps else ())
        self._floats += floats[: len(new)]
        if with_steps:
            return list(self._floats), floats[len(new) :]
        return list(self._floats)


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
        >>> from fitlib.callbacks.lr_finder import suggest_lrs
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
        >>> from fitlib.callbacks.lr_finder import sweep_problems
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
    end = _divergence(losses)
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


def _divergence(losses: list[float]) -> int:
    """The index of the first diverged loss (``len(losses)`` if none): not
    finite, or above ``DIVERGED`` times the best before it (the best plus
    ``DIVERGED - 1`` times its size: a loss may be negative, as an NLL is)."""
    best = math.inf
    for i, loss in enumerate(losses):
        if not math.isfinite(loss) or loss - best > (DIVERGED - 1) * abs(best):
            return i
        best = min(best, loss)
    return len(losses)


def _momentum(opt: Any) -> float | None:
    """The optimizer's largest momentum (Adam's beta1), None if it has none."""
    has = getattr(opt, "has", None)
    return max(opt.get("mom")) if has is not None and has("mom") else None


def _warn(message: str) -> None:
    """Warns at the first caller outside fitlib (``learn.lr_find()``, ``fit``):
    Python shows a warning once per place, and a notebook cell is a new one."""
    frame, level = sys._getframe(), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith(
        "fitlib."
    ):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)


def _snapshot(model: torch.nn.Module, opt: Any, data: Any) -> dict:
    """Copies of what a sweep changes: weights, optimizer state, RNG states
    (global ones, and the generators of the training loader's order)."""
    loader = getattr(data, "train_dl", None)
    return {
        # On the host: a copy on the device could double a large model's memory.
        "model": host_copy(model.state_dict()),
        "opt": host_copy(opt.state_dict()),
        "rng": get_rng_state(loader),
        "loader": loader,
    }


def _restore(saved: dict, model: torch.nn.Module, opt: Any) -> None:
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])  # casts the state back to the params' devices
    opt.stepped = None  # the sweep's steps are undone
    set_rng_state(saved["rng"], saved["loader"])


def _check_args(
    start_lr: Any, end_lr: Any, num_it: Any, mode: Any, check_every: Any
) -> None:
    if not (is_number(start_lr) and is_number(end_lr) and 0 < start_lr < end_lr):
        raise ValueError(
            f"the sweep needs 0 < start_lr < end_lr; got start_lr={start_lr!r}, "
            f"end_lr={end_lr!r}. Fix: e.g. start_lr=1e-7, end_lr=10."
        )
    check_int(num_it, "num_it", minimum=2, owner="LRFinder", example=100)
    if mode not in ("exp", "linear"):
        raise ValueError(
            f"mode must be 'exp' (geometric lr steps) or 'linear'; got {mode!r}."
        )
    check_number(
        check_every, "check_every", minimum=0, what="a number of seconds",
        owner="LRFinder", example=0.25,
    )  # fmt: skip


def lr_sweep(
    finder: LRFinder,
    epochs: int,
    model: torch.nn.Module,
    loss_func: Any,
    opt: Any,
    data: Any,
    callbacks: list[Callback] = (),
    bar: list[Callback] = (),
    metrics: Any = None,
) -> SuggestedLRs:
    """Runs ``finder``'s sweep as one ``fit`` with ``callbacks`` (those that
    shape a step: mixed precision, accumulation, clipping, a user's), then
    puts back their states; the finder puts back the model, the optimizer and
    the random generators. ``bar`` is a ``SweepBar`` (or nothing). What
    ``Learner.lr_find`` runs.

    Raises:
        RuntimeError: the loss was not finite from the first step, so there
            is nothing to suggest.

    Examples:
        >>> from fitlib.callbacks.lr_finder import lr_sweep
        >>> finder = LRFinder(num_it=12)  # 3 epochs of 4 batches
        >>> before = model[0].weight.clone()
        >>> lr_sweep(finder, 3, model, F.cross_entropy, opt, data)
        SuggestedLRs(valley=..., steepest=..., min_div10=...)
        >>> torch.equal(model[0].weight, before)  # the model is put back
        True
    """
    callbacks, saved = list(callbacks), [cb.state_dict() for cb in callbacks]
    try:
        fit(epochs, model, loss_func, opt, data, callbacks=[*callbacks, finder, *bar],
            metrics=metrics)  # fmt: skip
    finally:
        for cb, state in zip(callbacks, saved, strict=True):
            cb.load_state_dict(state)
    if finder.suggestions is None:
        raise RuntimeError(
            f"lr_find: the loss was not finite from the first step (lr "
            f"{finder.start_lr:g}), so there is nothing to suggest. Fix: check "
            "the data and the model's output for NaN or inf, or lower start_lr."
        )
    return finder.suggestions
