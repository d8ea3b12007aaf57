"""``LRFinder``: trains briefly at growing learning rates to pick a good one.

The learning rate sweeps from ``start_lr`` to ``end_lr`` over ``num_it``
optimizer steps (across epochs if the loader is short, without validation),
recording the smoothed loss of each step. Afterwards the model, the optimizer
and the random number generators are as they were before, bit for bit.

The sweep stops once the smoothed loss exceeds 4 times its best value or is
not finite. That test runs on the device: the losses are read at most every
``check_every`` seconds (and at the end), so the sweep can run up to that long
past the divergence; the steps after it are dropped from the record.
"""

from __future__ import annotations

import math
import time
from typing import Any, NamedTuple

import numpy as np
import torch

from fitlib.callback import Callback
from fitlib.core import to_floats
from fitlib.errors import is_number
from fitlib.rng import get_rng_state, set_rng_state
from fitlib.serialization import host_copy

DIVERGED = 4.0  # the smoothed loss, as a multiple of its best, that ends a sweep


class SuggestedLRs(NamedTuple):
    """Learning rates read off an LR finder's curve.

    ``steepest``: where the smoothed loss falls fastest (per log lr), before
    its minimum. ``min_div10``: the lr of the minimum loss, divided by 10.
    """

    steepest: float
    min_div10: float


class LRFinder(Callback):
    """Sweeps the learning rate over ``num_it`` steps and records the loss.

    After the fit, ``lrs`` and ``losses`` (smoothed) hold the sweep up to the
    divergence, ``suggestions`` the suggested learning rates, and ``result``
    all three as a dict for ``Recorder.plot_lr_find``.

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
        SuggestedLRs(steepest=0.0012, min_div10=0.0036)
    """

    order = 10

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

    def on_train_end(self, model: torch.nn.Module, opt: Any) -> None:
        """Runs at the end (also after an error): restores, keeps the sweep."""
        if self._saved is None:
            return  # never started: an earlier callback's on_train_begin failed
        try:
            losses = self._read()
        finally:  # whatever happens, the model and optimizer go back
            _restore(self._saved, model, opt)
            self._saved = None
        end = self._divergence(losses) if self.stop_div else len(losses)
        self.losses = losses[:end]
        self.lrs = [self.lr_at(i) for i in range(end)]
        self._losses, self._floats = [], []
        if any(math.isfinite(loss) for loss in self.losses):
            self.suggestions = suggest_lrs(self.lrs, self.losses)

    # -- divergence --------------------------------------------------------------
    def _diverged(self) -> bool:
        """Whether the losses read so far diverged; reads them when it is time."""
        now = time.perf_counter()
        if not self.stop_div or now - self._last_check < self.check_every:
            return False
        self._last_check = now
        losses = self._read()
        return self._divergence(losses) < len(losses)

    def _read(self) -> list[float]:
        """All losses as floats: one transfer for those not read before."""
        self._floats += to_floats(self._losses[len(self._floats) :])
        return list(self._floats)

    @staticmethod
    def _divergence(losses: list[float]) -> int:
        """The index of the first diverged loss (``len(losses)`` if none)."""
        best = math.inf
        for i, loss in enumerate(losses):
            if not math.isfinite(loss) or loss > DIVERGED * best:
                return i
            best = min(best, loss)
        return len(losses)


def suggest_lrs(lrs: list[float], losses: list[float]) -> SuggestedLRs:
    """The steepest descent (before the minimum) and the minimum lr / 10.

    The slope is taken per log lr, skipping the first tenth of the sweep, where
    the smoothed loss is still mostly noise.

    Example:
        >>> suggest_lrs([1e-4, 1e-3, 1e-2, 1e-1], [2.0, 1.5, 0.5, 3.0])
        SuggestedLRs(steepest=0.01, min_div10=0.001)
    """
    lowest = int(np.nanargmin(losses))
    first = max(1, len(lrs) // 10)
    if lowest - first < 1:  # too few points before the minimum for a slope
        return SuggestedLRs(float(lrs[lowest]), float(lrs[lowest] / 10))
    x, y = np.log(lrs[: lowest + 1]), np.asarray(losses[: lowest + 1])
    slopes = np.gradient(y, x)[first:]
    if np.isnan(slopes).all():  # stop_div=False keeps NaN losses
        return SuggestedLRs(float(lrs[lowest]), float(lrs[lowest] / 10))
    steepest = first + int(np.nanargmin(slopes))
    return SuggestedLRs(float(lrs[steepest]), float(lrs[lowest] / 10))


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
    if isinstance(num_it, bool) or not isinstance(num_it, int) or num_it < 2:
        raise ValueError(
            f"num_it must be an int >= 2 (the optimizer steps of the sweep); got "
            f"{num_it!r}. Fix: e.g. num_it=100."
        )
    if mode not in ("exp", "linear"):
        raise ValueError(
            f"mode must be 'exp' (geometric lr steps) or 'linear'; got {mode!r}."
        )
    if not (is_number(check_every) and check_every >= 0):
        raise ValueError(
            f"check_every must be a number of seconds >= 0; got {check_every!r}."
        )
