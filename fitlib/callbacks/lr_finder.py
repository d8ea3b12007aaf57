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
``suggest_lrs``, in ``fitlib.lr_suggestions``). ``sweep_problems`` says when
they deserve no trust (the loss never fell, or fell no deeper than its noise
just before a cliff) or the sweep's range cut them off; the finder keeps
these in ``problems`` and warns about each.
"""

from __future__ import annotations

import copy
import math
import sys
import time
import warnings
from typing import Any

import torch

import fitlib.ranks as ranks
from fitlib.callback import Callback
from fitlib.checks import check_int, check_number
from fitlib.core import fit
from fitlib.errors import is_number
from fitlib.host_copy import to_floats
from fitlib.lr_suggestions import (
    SuggestedLRs,
    divergence,
    suggest_lrs,
    sweep_problems,
)
from fitlib.rng import get_rng_state, set_rng_state
from fitlib.serialization import host_copy


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
        end = divergence(losses) if self.stop_div else len(losses)
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
        return divergence(losses) < len(losses)

    def _read(self, with_steps: bool = False) -> Any:
        """All smoothed losses as floats: one transfer for those not read
        before; ``with_steps``: and the steps' own losses, in the same one."""
        new = self._losses[len(self._floats) :]
        floats = to_floats(new, self._raw if with_steps else ())
        self._floats += floats[: len(new)]
        if with_steps:
            return list(self._floats), floats[len(new) :]
        return list(self._floats)


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
    recorder: Any = None,
) -> SuggestedLRs:
    """Runs ``finder``'s sweep as one ``fit`` with ``callbacks`` (those that
    shape a step: mixed precision, accumulation, clipping, a user's), then
    puts back their states; the finder puts back the model, the optimizer and
    the random generators. ``bar`` is a ``SweepBar`` (or nothing); a
    ``recorder`` (a ``Recorder``) gets the sweep's result
    (``lr_find_result``, for ``plot_lr_find``) once the sweep has run to its
    end (an interrupted sweep leaves the previous result). What
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
    callbacks = list(callbacks)
    # Copies: a state_dict may hand out the callback's own lists and tensors,
    # which the sweep would change.
    saved = [copy.deepcopy(cb.state_dict()) for cb in callbacks]
    try:
        fit(epochs, model, loss_func, opt, data, callbacks=[*callbacks, finder, *bar],
            metrics=metrics)  # fmt: skip
    finally:
        for cb, state in zip(callbacks, saved, strict=True):
            cb.load_state_dict(state)
    if recorder is not None:
        recorder.lr_find_result = finder.result
    if finder.suggestions is None:
        raise RuntimeError(
            f"lr_find: the loss was not finite from the first step (lr "
            f"{finder.start_lr:g}), so there is nothing to suggest. Fix: check "
            "the data and the model's output for NaN or inf, or lower start_lr."
        )
    return finder.suggestions
