"""The ``Learner``'s training shortcuts: schedules, the LR finder, precision.

Each shortcut adds a callback to one ``fit``; ``Learner`` inherits them from
``TrainingShortcuts``, kept apart so each module stays short.
"""

from __future__ import annotations

import copy
import inspect
import math
import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from fitlib.callback import Callback, callback_list
from fitlib.callbacks.accumulation import GradientAccumulation
from fitlib.callbacks.distributed import DistributedTrainer
from fitlib.callbacks.lr_finder import LRFinder, SuggestedLRs
from fitlib.callbacks.mixed_precision import MixedPrecision
from fitlib.callbacks.one_cycle import OneCycleScheduler, peak_lr
from fitlib.callbacks.progress import SweepBar
from fitlib.callbacks.schedule import ParamScheduler, constant, cosine, linear
from fitlib.checks import check_int, check_number
from fitlib.core import fit, len_or_none, to_floats
from fitlib.metrics import Metrics
from fitlib.optim import LR


@dataclass(frozen=True)
class Snapshot:
    """Where training stands, as ``Learner.fit_snapshots`` yields it.

    ``loss`` is the training loss of the latest batch; ``metrics`` maps
    ``valid_loss`` and each metric to its value after the latest epoch (empty
    before the first); ``elapsed`` counts seconds since training began.
    """

    step: int
    epoch: int
    loss: float
    metrics: dict[str, float]
    elapsed: float


class TrainingShortcuts:
    """``fit_one_cycle``, ``fit_flat_cos``, ``fit_warmup_cos``, ``lr_find``,
    ``fit_snapshots``, ``to_fp16``, ``to_bf16``, ``to_fp32`` and ``to_distributed``,
    for ``Learner``."""

    # Provided by Learner.
    callbacks: list[Callback]
    opt: Any
    progress: bool

    def fit_one_cycle(
        self,
        epochs: int,
        lr: LR | None = None,
        div_factor: float = 25.0,
        pct_start: float = 0.3,
        final_div: float | None = None,
        moms: tuple[float, float] | None = (0.95, 0.85),
        wd: float | None = None,
        callbacks: Iterable[Callback] | None = None,
        total_steps: int | None = None,
        *,
        max_lr: LR | None = None,
    ) -> list[dict]:
        """Trains with the 1cycle policy (see ``OneCycleScheduler``).

        ``lr``, the peak learning rate, is taken as by ``fit``: a float, one
        value per layer group, or a slice (the scheduler spreads it over the
        groups when training begins); None is 1e-3, said once. ``max_lr`` is
        another name for it (``OneCycleScheduler``'s): pass one of the two.
        ``total_steps`` is needed only for a loader without a length.

        Example:
            >>> learn.fit_one_cycle(5, lr=1e-2)
        """
        if lr is None and max_lr is None:
            lr = self._default_lr()
        name, peak = peak_lr(lr, max_lr, owner="Learner.fit_one_cycle")
        sched = OneCycleScheduler(
            div_factor=div_factor, pct_start=pct_start, final_div=final_div,
            moms=moms, total_steps=total_steps, **{name: peak},
        )  # fmt: skip
        return self._fit_scheduled(epochs, wd, sched, callbacks)

    def fit_flat_cos(
        self,
        epochs: int,
        lr: LR | None = None,
        pct_start: float = 0.75,
        wd: float | None = None,
        callbacks: Iterable[Callback] | None = None,
        total_steps: int | None = None,
    ) -> list[dict]:
        """Trains at ``lr`` for ``pct_start`` of the steps, then anneals to 0.

        Example:
            >>> learn.fit_flat_cos(5, lr=1e-3)
        """
        lrs = self.lr_range(lr)  # spread over the layer groups, once
        _check_fraction("pct_start", pct_start, "Learner.fit_flat_cos")
        phases = [(pct_start, constant(lrs)), (1 - pct_start, cosine(lrs, 0.0))]
        sched = ParamScheduler({"lr": phases}, total_steps)
        return self._fit_scheduled(epochs, wd, sched, callbacks)

    def fit_warmup_cos(
        self,
        epochs: int,
        lr: LR | None = None,
        pct_warmup: float = 0.1,
        wd: float | None = None,
        callbacks: Iterable[Callback] | None = None,
        total_steps: int | None = None,
    ) -> list[dict]:
        """Warms up linearly from 0 to ``lr``, then anneals along a cosine to 0.

        Example:
            >>> learn.fit_warmup_cos(5, lr=1e-3, pct_warmup=0.05)
        """
        lrs = self.lr_range(lr)  # spread over the layer groups, once
        _check_fraction("pct_warmup", pct_warmup, "Learner.fit_warmup_cos")
        phases = [(pct_warmup, linear(0.0, lrs)), (1 - pct_warmup, cosine(lrs, 0.0))]
        sched = ParamScheduler({"lr": phases}, total_steps)
        return self._fit_scheduled(epochs, wd, sched, callbacks)

    def _fit_scheduled(
        self,
        epochs: int,
        wd: float | None,
        sched: Callback,
        callbacks: Iterable[Callback] | None,
    ) -> list[dict]:
        """``fit`` with ``sched`` setting the lr: the optimizer's lr is left
        to it (it holds the lr, spread over the groups). Returns the history."""
        cbs, history = [sched, *callback_list(callbacks)], []
        steps = self._fit_states(epochs, None, wd, cbs, None, True, history)
        for _ in steps:
            pass
        return history

    def lr_find(
        self,
        start_lr: float = 1e-7,
        end_lr: float = 10.0,
        num_it: int = 100,
        stop_div: bool = True,
        mode: str = "exp",
    ) -> SuggestedLRs:
        """Sweeps the learning rate (see ``LRFinder``); returns suggestions.

        The Learner's callbacks take part where they shape a step (mixed
        precision, accumulation, clipping, your own: ``Callback.in_lr_find``);
        checkpoints, loggers, schedulers and early stopping sit it out.
        Afterwards the model, the optimizer, the callbacks' states and
        the random number generators are as before; ``recorder.plot_lr_find()``
        plots the sweep. With ``progress``, one bar follows the sweep's steps.

        Use ``valley``. A ``UserWarning`` says when the suggestions are doubtful
        (see ``sweep_problems``): the loss never fell (they are noise), or
        the valley begins at ``start_lr`` or still goes on at ``end_lr``.

        The sweep runs at the optimizer's momentum as it is. ``fit_one_cycle``
        moves momentum to 0.95-0.85, so for plain SGD (momentum 0) a rate
        swept without momentum is several times too high there: create the
        optimizer with the momentum you will train with (e.g. ``opt_func=
        partial(torch.optim.SGD, momentum=0.9)``), or pass ``moms=None``.

        Example:
            >>> learn.lr_find()
            SuggestedLRs(valley=0.0011, steepest=0.0025, min_div10=0.0036)
            >>> learn.recorder.plot_lr_find()
        """
        finder = LRFinder(start_lr, end_lr, num_it, stop_div, mode)
        sweepers = [cb for cb in self.callbacks if _in_lr_find(cb)]
        had_opt, saved = self.opt is not None, _states(sweepers)
        if not had_opt:
            self.create_opt(start_lr)
        extra = [SweepBar(num_it)] if self.progress else []
        try:
            fit(
                self._sweep_epochs(num_it),
                self.model,
                self.loss_func,
                self.opt,
                self.data,
                callbacks=[*sweepers, finder, *extra],
                metrics=self.metrics,  # not computed (no validation), but named
            )
        finally:
            for cb, state in zip(sweepers, saved, strict=True):
                cb.load_state_dict(state)
            if not had_opt:
                self.opt = None
        self.recorder.lr_find_result = finder.result
        if finder.suggestions is None:
            raise RuntimeError(
                f"lr_find: the loss was not finite from the first step (lr "
                f"{start_lr:g}), so there is nothing to suggest. Fix: check the "
                "data and the model's output for NaN or inf, or lower start_lr."
            )
        return finder.suggestions

    def fit_snapshots(
        self,
        n_steps: int,
        every: int = 25,
        lr: LR | None = None,
        wd: float | None = None,
        callbacks: Iterable[Callback] | None = None,
    ) -> Iterator[Snapshot]:
        """Trains for ``n_steps`` optimizer steps, yielding a ``Snapshot`` every
        ``every`` steps (and after the last); the same loop as ``fit``.

        Breaking out of the ``for`` ends training cleanly (every callback's
        ``on_train_end`` runs). Each snapshot reads the loss from the device:
        one sync per ``every`` steps.

        Example:
            >>> for snap in learn.fit_snapshots(n_steps=500, every=100):
            ...     print(snap.step, snap.loss)
            ...     if snap.loss < 0.1:
            ...         break
        """
        check_int(every, "every", minimum=1, owner="Learner.fit_snapshots", example=25)
        steps = self._fit_states(None, lr, wd, callbacks, n_steps)
        t0, names = time.perf_counter(), ["valid_loss", *Metrics(self.metrics).names]
        with closing(steps):
            for state in steps:
                step = state["step"]
                due = step % every == 0 or step >= n_steps
                if state["skip_step"] or not due:  # no step this batch, or not due
                    continue
                values = to_floats([state["last_loss"], *(state["last_metrics"] or [])])
                metrics = dict(zip(names, values[1:], strict=False))
                yield Snapshot(
                    step, state["epoch"], values[0], metrics, time.perf_counter() - t0
                )

    def fit_iter(self, *args: Any, **kwargs: Any) -> Iterator[Snapshot]:
        """Deprecated: the former name of ``fit_snapshots`` (same arguments)."""
        warnings.warn(
            "Learner.fit_iter is deprecated: it is called fit_snapshots now (it "
            "yields a Snapshot every `every` optimizer steps).",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.fit_snapshots(*args, **kwargs)

    def _sweep_epochs(self, num_it: int) -> int:
        """Epochs enough for ``num_it`` optimizer steps."""
        n_batches = len_or_none(self.data.train_dl)
        if n_batches is None:
            return num_it  # each epoch has a batch at least: the finder stops
        per_step = math.prod(
            cb.n_batches
            for cb in self.callbacks
            if isinstance(cb, GradientAccumulation)
        )
        return math.ceil(num_it / math.ceil(n_batches / per_step))

    def to_fp16(self) -> Any:
        """Trains in mixed precision with float16 and loss scaling (CUDA).

        Creates the optimizer fused (SGD, Adam, AdamW), so skipping a step with
        non-finite gradients costs no host-device sync. Returns the Learner.

        Example:
            >>> learn = Learner(data, model).to_fp16()
        """
        return self._set_precision(MixedPrecision(torch.float16))

    def to_bf16(self) -> Any:
        """Trains in mixed precision with bfloat16 (CPUs, Ampere GPUs and up)."""
        return self._set_precision(MixedPrecision(torch.bfloat16))

    def to_fp32(self) -> Any:
        """Trains in full precision again (removes ``MixedPrecision``)."""
        self.callbacks = [cb for cb in self.callbacks if not _is_mp(cb)]
        return self

    def to_distributed(
        self,
        backend: str | None = None,
        find_unused_parameters: bool = False,
        strategy: str = "ddp",
        fsdp_units: Any = None,
        fsdp_kwargs: dict | None = None,
    ) -> Any:
        """Trains on every process of a ``torchrun`` launch (see
        ``DistributedTrainer`` for the arguments); does nothing in a plain
        ``python`` run.

        Example:
            >>> learn = Learner(data, model).to_distributed()  # torchrun ... train.py
            >>> learn.to_distributed(strategy="fsdp", fsdp_units=(Block,))
        """
        self.callbacks = [cb for cb in self.callbacks if not _is_dist(cb)]
        trainer = DistributedTrainer(
            backend,
            find_unused_parameters,
            strategy=strategy,
            fsdp_units=fsdp_units,
            fsdp_kwargs=fsdp_kwargs,
        )
        if trainer.enabled and strategy == "ddp":
            self.model.to(trainer.device)  # before the optimizer is created
        self.callbacks.append(trainer)
        return self

    def _set_precision(self, mp: MixedPrecision) -> Any:
        self.to_fp32()
        self.callbacks.append(mp)
        return self

    def _opt_func(self) -> Any:
        """``opt_func``, fused under float16 where the optimizer can be."""
        fp16 = any(_is_mp(cb) and cb.dtype is torch.float16 for cb in self.callbacks)
        if fp16 and "fused" in inspect.signature(self.opt_func).parameters:
            return partial(self.opt_func, fused=True)
        return self.opt_func


def _in_lr_find(cb: Callback) -> bool:
    """Whether ``cb`` (or the callback a filter wraps) takes part in a sweep."""
    return getattr(getattr(cb, "callback", cb), "in_lr_find", True)


def _is_dist(cb: Callback) -> bool:
    return isinstance(cb, DistributedTrainer)


def _is_mp(cb: Callback) -> bool:
    return isinstance(cb, MixedPrecision)


def _states(callbacks: list[Callback]) -> list[dict]:
    return [copy.deepcopy(cb.state_dict()) for cb in callbacks]


def _check_fraction(name: str, value: Any, owner: str) -> None:
    check_number(
        value, name, above=0, below=1, what="a fraction of training", owner=owner,
        example=0.25,
    )  # fmt: skip
