"""``LRFinder``: trains briefly at growing learning rates to pick a good one.

The learning rate sweeps from ``start_lr`` to ``end_lr`` over ``num_it``
optimizer steps (across epochs if the loader is short, without validation),
recording the smoothed loss of each step. Afterwards the model, the optimizer
and the random number generators are as they were before, bit for bit.

The sweep stops once the smoothed loss exceeds 4 times its best value or is
not finite. That test runs on the device: the losses are read at most every
``check_every`` seconds (and at the end), so the sweep can run up to that long
past the divergence; the steps after it are dropped from the record.

The suggestions are read off the smoothed loss before the divergence (see
``suggest_lrs``). ``sweep_problems`` says when they deserve no trust (the loss
never fell) or the sweep's range cut them off; the finder keeps these in
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

from fitlib import ranks
from fitlib.callback import Callback
from fitlib.checks import check_int, check_number
from fitlib.core import to_floats
from fitlib.errors import is_number
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


class SuggestedLRs(NamedTuple):
    """Learning rates read off an LR finder's curve (see ``suggest_lrs``).

    ``valley`` (the one to use): half-way, in log lr, along the valley, the
    stretch from where the smoothed loss leaves its flat start to its minimum.
    ``steepest``: where it falls fastest (per log lr) in that valley.
    ``min_div10``: the lr of its minimum, divided by 10.
    """

    valley: float
    steepest: float
    min_div10: float


class LRFinder(Callback):
    """Sweeps the learning rate over ``num_it`` steps and records the loss.

    After the fit, ``lrs`` and ``losses`` (smoothed) hold the sweep up to the
    divergence, ``suggestions`` the suggested learning rates, and ``result``
    all three as a dict for ``Recorder.plot_lr_find``. ``problems`` maps what
    makes the suggestions doubtful (``"no_fall"``, ``"start_edge"``,
    ``"end_edge"``: see ``sweep_problems``) to its message; each is also
    warned about (a ``UserWarning``, by the main process) when the sweep ends
    without an error.

    Args:
        start_lr: the learning rate of the first step (> 0).
        end_lr: the learning rate of step ``num_it`` (> ``start_lr``).
        num_it: the number of optimizer steps of the sweep.
        stop_div: stop when the smoothed loss diverges (> 4x its best, or not
            finite).
        mode: ``"exp"`` (geometric steps, the usual) or ``"linear"``.
        check_every: seconds of training between two reads of the losses
            (each read is one host-device sync); 0 reads after every step.

    Example:
        >>> finder = LRFinder(num_it=100)
        >>> fit(10, model, F.cross_entropy, opt, data, callbacks=[finder])
        >>> finder.suggestions
        SuggestedLRs(valley=0.0011, steepest=0.0025, min_div10=0.0036)
        >>> finder.problems
        {}
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
        self._step, self._stepped = 0, False
        self._last_check = time.perf_counter()
        self.lrs, self.losses, self.suggestions = [], [], None
        self.problems = {}
        opt.lr = self.lr_at(0)

    def on_epoch_begin(self) -> dict:
        """Runs at the start of each epoch: the sweep never validates."""
        return {"skip_validate": True}

    def on_step_end(self, skip_step: bool) -> None:
        """Runs after each optimizer step: notes that one happened."""
        self._stepped = self._stepped or not skip_step

    def on_batch_end(self, train: bool, opt: Any, smooth_loss: Any) -> dict | None:
        """Runs after each batch: records a step, sets the next lr, may stop."""
        if not (train and self._stepped):  # validation, or still accumulating
            return None
        self._stepped = False
        self._losses.append(smooth_loss)
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
            losses = self._read()
        finally:  # whatever happens, the model and optimizer go back
            _restore(self._saved, model, opt)
            self._saved = None
        end = _divergence(losses) if self.stop_div else len(losses)
        self.losses = losses[:end]
        self.lrs = [self.lr_at(i) for i in range(end)]
        self._losses, self._floats = [], []
        if self.losses and math.isfinite(self.losses[0]):  # else none: lr_find says
            self._suggest(losses, warn=exception is None and ranks.is_main())

    def _suggest(self, losses: list[float], warn: bool) -> None:
        """Suggestions off the record; problems off the whole sweep read, past
        the divergence (whether it diverged decides an "end_edge")."""
        self.suggestions = suggest_lrs(self.lrs, self.losses)
        lrs = [self.lr_at(i) for i in range(len(losses))]
        self.problems = sweep_problems(lrs, losses)
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

    def _read(self) -> list[float]:
        """All losses as floats: one transfer for those not read before."""
        self._floats += to_floats(self._losses[len(self._floats) :])
        return list(self._floats)


def suggest_lrs(lrs: list[float], losses: list[float]) -> SuggestedLRs:
    """Learning rates read off a sweep's smoothed losses, before it diverged.

    The divergence is the first loss that is not finite or above 4 times the
    best before it: nothing from there on counts. The flat start ends at the
    last point before the minimum whose loss is still within a tenth of the
    total fall below the start level (the median of the sweep's first tenth),
    so its noise decides nothing. The valley runs from there to the minimum:
    ``valley`` is its middle point (half-way in log lr in a geometric sweep),
    ``steepest`` its steepest descent, ``min_div10`` the minimum's lr / 10.
    ``sweep_problems`` says when to distrust them.

    Example:
        >>> lrs = [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0]
        >>> suggest_lrs(lrs, [2.3, 2.31, 2.3, 2.2, 1.8, 1.0, 0.9, 9.0])
        SuggestedLRs(valley=0.01, steepest=0.01, min_div10=0.1)
    """
    c = _landmarks(lrs, losses)
    steepest = c.low
    if c.low > c.first:  # the slope per log lr, over the valley before its end
        x = np.log(np.asarray(lrs[: len(c.losses)], dtype=float))
        steepest = c.first + int(np.argmin(np.gradient(c.losses, x)[c.first : c.low]))
    picks = ((c.first + c.low) // 2, steepest)
    return SuggestedLRs(*(float(lrs[i]) for i in picks), float(lrs[c.low]) / 10)


def sweep_problems(lrs: list[float], losses: list[float]) -> dict[str, str]:
    """What makes a sweep's suggestions doubtful, each with what to do.

    ``"no_fall"``: the loss never fell (its minimum before the divergence is
    less than 1% below its start level), so the suggestions are noise; else
    ``"start_edge"``: the valley begins in the first fifth of the sweep (a
    fall from the very first point leaves the start level's band about a
    tenth in), and ``"end_edge"``: the loss never diverged and is lowest in
    the last 5% of the sweep, not climbing back by a tenth of its fall after.
    Pass the whole sweep, past its divergence.

    Example:
        >>> sweep_problems([1e-3, 1e-2, 1e-1, 1.0], [2.3, 2.3, 2.3, 2.29])
        {'no_fall': 'lr_find: the loss never fell: ...'}
    """
    c, n = _landmarks(lrs, losses), len(losses)
    low, lr0, last = c.losses[c.low], lrs[0], lrs[n - 1]
    if c.start - low < FELL * abs(c.start):
        where = "diverging" if c.diverged else "the sweep ended"
        return {
            "no_fall": f"lr_find: the loss never fell: its lowest value before "
            f"{where} ({low:.4g}, at lr {lrs[c.low]:.2g}) is less than {FELL:.0%} "
            f"below its start ({c.start:.4g}), so the suggestions are noise. Check "
            "that the inputs match the labels and the model's output fits the "
            "loss; then sweep longer (e.g. num_it=300) or from a higher "
            "start_lr, so that more steps train where the loss can move, with "
            "the momentum you will train with."
        }
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


class _Landmarks(NamedTuple):
    losses: np.ndarray  # the sweep before its divergence
    diverged: bool
    tenth: int  # the points of its first tenth, whose median is the start level
    start: float
    first: int  # the last point of the flat start: the valley begins
    low: int  # the minimum: the valley ends


def _landmarks(lrs: list[float], losses: list[float]) -> _Landmarks:
    end = _divergence(losses)
    if end == 0 or len(lrs) < len(losses):
        raise ValueError(
            f"a sweep needs an lr per loss and a finite first loss; got "
            f"{len(lrs)} lrs for {len(losses)} losses, the first "
            f"{losses[0] if losses else None!r}."
        )
    y = np.asarray(losses[:end], dtype=float)
    tenth = max(1, end // 10)
    start, low = float(np.median(y[:tenth])), int(np.argmin(y))
    flat = np.flatnonzero(y[: low + 1] >= start - FLAT * (start - y[low]))
    first = int(flat[-1]) if flat.size else 0
    return _Landmarks(y, end < len(losses), tenth, start, first, low)


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
