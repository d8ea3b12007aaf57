"""``Learner``: the convenience layer over ``fit`` for everyday training.

Its training shortcuts (``fit_one_cycle``, ``fit_flat_cos``,
``fit_warmup_cos``, ``lr_find``, ``fit_snapshots``, ``to_fp16``, ``to_bf16``,
``to_fp32``, ``to_distributed``) each add a callback to one ``fit``.
"""

from __future__ import annotations

import inspect
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

import fitlib.evaluation as evaluation
import fitlib.ranks as ranks
from fitlib.batch_size_finder import BatchSizeResult, find_batch_size
from fitlib.callback import Callback, inner_callback
from fitlib.callback_handler import callback_list
from fitlib.callbacks.accumulation import GradientAccumulation
from fitlib.callbacks.backbone_finetuning import BackboneFinetuning, set_trainable
from fitlib.callbacks.channels_last import ChannelsLast, check_convolutional
from fitlib.callbacks.compile import Compile
from fitlib.callbacks.cuda_graph import CudaGraph
from fitlib.callbacks.distributed_trainer import DistributedTrainer
from fitlib.callbacks.lr_finder import LRFinder, lr_sweep
from fitlib.callbacks.mixed_precision import MixedPrecision
from fitlib.callbacks.one_cycle import OneCycleScheduler, peak_lr
from fitlib.callbacks.progress import ProgressBar
from fitlib.callbacks.recorder import Recorder
from fitlib.callbacks.schedule import ParamScheduler, constant, cosine, linear
from fitlib.callbacks.sweep_bar import SweepBar
from fitlib.checkpoint_files import not_a_file
from fitlib.checks import (
    check_data,
    check_flag,
    check_int,
    check_model,
    check_number,
    check_path,
    len_or_none,
)
from fitlib.core import as_metrics, fit_states
from fitlib.data import model_device
from fitlib.errors import name_of
from fitlib.history import History
from fitlib.host_copy import to_floats
from fitlib.hyper_checks import LR, check_hyper, check_opt_func
from fitlib.losses import as_loss
from fitlib.lr_suggestions import SuggestedLRs
from fitlib.metrics.collection import Metrics
from fitlib.metrics.functions import accuracy
from fitlib.multi_optimizer import MultiOptimizer, check_part_names, spread_over_parts
from fitlib.optim import HPOptimizer
from fitlib.parts import by_part, part_groups
from fitlib.resume import give_states
from fitlib.serialization import (
    atomic_save,
    check_model_state,
    load_model_state,
    optimizer_differences,
    optimizer_identity,
    safe_load,
)
from fitlib.sharding import (
    is_sharded,
    load_optimizer_state,
    model_state,
    optimizer_state,
)
from fitlib.summary import Summary, learner_summary

_CLASSIFICATION_LOSSES = (F.cross_entropy, F.nll_loss)
_said: set[str] = set()


@dataclass(frozen=True)
class Snapshot:
    """Where training stands, as ``Learner.fit_snapshots`` yields it.

    ``loss`` is the training loss of the latest batch; ``metrics`` holds the
    values of the last finished epoch's record but its epoch, train loss, lr
    and time (``valid_loss``, each metric, training metrics, loss parts,
    values callbacks added; empty before the first epoch ends); ``elapsed``
    counts seconds since training began.
    """

    step: int
    epoch: int
    loss: float
    metrics: dict[str, float]
    elapsed: float


class Learner:
    """Bundles data, model, loss, optimizer and callbacks, and trains them.

    The optimizer is created at the first ``fit`` and kept, with its state,
    for the next ones. ``Recorder`` and ``ProgressBar`` are on by default.
    Training shortcuts (``fit_one_cycle``, ``fit_flat_cos``,
    ``fit_warmup_cos``, ``lr_find``, ``fit_snapshots``, ``to_fp16``,
    ``to_bf16``, ``to_distributed``) each add a callback to one ``fit``.

    Args:
        data: a ``DataBunch`` (anything with ``train_dl``/``valid_dl``); the
            model moves to ``data.device`` when it has one.
        model: the model to train.
        loss_func: called as ``loss_func(output, *targets)``; None (and no
            ``data.loss_func``) for a model that computes its own loss
            (``output.loss`` or ``output["loss"]``, as ``transformers``'
            models do when the batch holds ``labels``); a dict output name ->
            loss (a list for a tuple output) for a model of several outputs:
            a ``LossDict``, each output's loss a part of the record.
        opt_func: the torch optimizer class; for several optimizers, a dict
            part name -> class, each part a submodule
            (``{"encoder": Adam, "decoder": partial(SGD, momentum=0.9)}``),
            trained by a ``MultiOptimizer``: ``lr`` and ``wd`` may then be
            dicts by part, and every part's parameters are one part's only.
        metrics: computed on the validation set each epoch; None picks a
            default from the loss (accuracy for cross-entropy), [] none.
        train_metrics: computed on the training batches each epoch (as the
            model trains: dropout on), reported as ``train_<name>``.
        callbacks: extra callbacks for every ``fit``.
        wd: weight decay (a dict by part, with several optimizers).
        true_wd: decouple weight decay from the gradient (AdamW style).
        path: directory for ``save``/``load`` (files go to ``path/models``).
        layer_groups: modules (or parameter lists) that get their own learning
            rate, from the body to the head; None is one group. With parts,
            a dict part name -> its layer groups (a part left out is one).
        train_bn: keep normalization layers trainable in frozen groups.
        progress: show progress bars and the results table.
        compile: train through ``torch.compile`` (True, or a dict of its
            arguments): the same as ``learn.compile(...)``.
        loss_weights: with a dict (or list) of losses, a number >= 0 per
            output (default 1), Keras's ``loss_weights``: see ``LossDict``.

    Examples:
        >>> learn = Learner(data, model, loss_func=F.cross_entropy,
        ...                 metrics=[accuracy], progress=False)
        >>> learn.fit(3, lr=1e-2)
        History(3 epochs: train_loss ... -> ..., valid_loss ... -> ...,
                accuracy 0.4062 -> 0.5)
        >>> learn.recorder.plot_losses()
        <Axes: xlabel='iteration', ylabel='loss'>
    """

    def __init__(
        self,
        data: Any,
        model: nn.Module,
        loss_func: Callable[..., torch.Tensor] | None = None,
        opt_func: Callable[..., torch.optim.Optimizer] | dict | None = None,
        metrics: list | None = None,
        callbacks: Iterable[Callback] | Callback | None = None,
        wd: float | dict | None = None,
        true_wd: bool = True,
        path: str | Path = ".",
        layer_groups: Sequence[Any] | dict | None = None,
        train_bn: bool = True,
        progress: bool = True,
        train_metrics: list | None = None,
        compile: bool | dict = False,
        loss_weights: dict | list | None = None,
    ) -> None:
        evaluation_only = getattr(data, "train_dl", 0) is None and (
            getattr(data, "valid_dl", None) is not None
        )
        if not evaluation_only:  # (fit checks train_dl when it starts)
            check_data(data)
        loss_func = as_loss(loss_func or getattr(data, "loss_func", None), loss_weights)
        check_model(model, loss_func)
        self.data, self.model, self.loss_func = data, model, loss_func
        if getattr(data, "device", None) is not None:
            self.model.to(data.device)
        self.metrics = _default_metrics(self.loss_func) if metrics is None else metrics
        self.train_metrics = [] if train_metrics is None else train_metrics
        for name in ("metrics", "train_metrics"):  # refused now, not at a fit
            as_metrics(getattr(self, name), name, owner="Learner")
        self.opt_func = (
            _default("opt_func", torch.optim.AdamW) if opt_func is None else opt_func
        )
        for func in by_part(self.opt_func).values():
            check_opt_func(func)
        self.wd = _default("wd", 1e-2) if wd is None else wd
        wds = by_part(self.wd)
        check_hyper("wd", list(wds.values()), wd, fix="Learner(..., wd=1e-2)")
        self.true_wd = true_wd
        # 'no' would be truthy (bars anyway): flags are bools
        train_bn = check_flag(
            train_bn, "train_bn", "Learner", "Learner(..., train_bn=False)"
        )
        progress = check_flag(
            progress, "progress", "Learner", "Learner(..., progress=False)"
        )
        self.path, self.train_bn, self.progress = path, train_bn, progress
        self.part_groups = part_groups(model, self.opt_func, layer_groups)
        self._wd(wd)  # a dict by part names every part
        # Every part's layer groups, in part order: freeze_to counts them.
        self.layer_groups = [g for gs in self.part_groups.values() for g in gs]
        self.callbacks = callback_list(callbacks)
        self.recorder = Recorder()
        self.opt: HPOptimizer | MultiOptimizer | None = None
        if compile is True or isinstance(compile, dict):
            self.compile(**(compile if isinstance(compile, dict) else {}))
        elif compile is not False:
            raise TypeError(
                f"Learner: compile must be True, False or a dict of torch.compile's "
                f"arguments; got {compile!r}. Fix: e.g. compile=True, or "
                "compile={'mode': 'max-autotune'}."
            )

    def __repr__(self) -> str:
        loss = name_of(self.loss_func)
        names = Metrics(self.metrics).names
        return (
            f"Learner({type(self.model).__name__}, loss_func={loss}, "
            f"opt_func={_func_names(self.opt_func)}, metrics={names}, "
            f"{len(self.layer_groups)} layer group(s), data={self.data!r})"
        )

    # -- training --------------------------------------------------------------
    def fit(
        self,
        epochs: int | None,
        lr: LR | None = None,
        wd: float | None = None,
        callbacks: Iterable[Callback] | Callback | None = None,
        max_steps: int | None = None,
        *,
        max_time: Any = None,
        train_batches: int | None = None,
        valid_batches: int | None = None,
    ) -> History:
        """Trains for ``epochs`` epochs (or ``max_steps`` optimizer steps, the
        first reached; ``epochs=None`` trains until ``max_steps``) at ``lr``.

        ``lr`` may be a float, one value per layer group, or a ``slice``:
        ``slice(lo, hi)`` spreads rates geometrically from the first group to
        the last, ``slice(hi)`` gives the last group ``hi`` and the others
        ``hi / 10``. None trains at 1e-3 and says so (``lr_find`` suggests one).

        Returns this fit's ``History``, the list of its records, one per
        epoch (as ``fitlib.fit``); ``learn.recorder.epoch_table()`` keeps
        those of every fit.

        ``max_time`` (seconds, a ``timedelta``, ``"DD:HH:MM:SS"`` or a dict
        of ``timedelta``'s arguments) is a wall-clock budget: once spent, the
        fit is suspended between two steps, and a ``Checkpoint`` resumes it
        exactly when the script runs again (``TimeLimit``).
        ``train_batches`` and ``valid_batches`` train and validate on at most
        that many batches per epoch (the first of each epoch's order). The
        other ``fit_*`` methods take these three arguments too.
        """
        history = History()
        limits = _limits(max_time, train_batches, valid_batches)
        steps = self._fit_states(
            epochs, lr, wd, callbacks, max_steps, history=history, limits=limits
        )
        for _ in steps:
            pass
        return history

    def _fit_states(
        self,
        epochs: int | None,
        lr: LR | None,
        wd: float | None,
        callbacks: Iterable[Callback] | Callback | None,
        max_steps: int | None,
        scheduled: bool = False,
        history: list | None = None,
        limits: dict | None = None,
    ) -> Iterator[dict]:
        """The loop (``fit_states``) over this Learner's model, data and
        callbacks. ``scheduled``: a scheduler among the callbacks sets the lr
        (``lr`` is then unused), so the optimizer's is left to it."""
        metrics = self._metrics("metrics")  # (set as attributes after __init__)
        train_metrics = self._metrics("train_metrics")
        if scheduled:
            self._opt_for_schedule(wd)
        else:
            self.create_opt(lr, wd)
        return fit_states(
            epochs,
            self.model,
            self.loss_func,
            self.opt,
            self.data,
            callbacks=self._callbacks(callbacks),
            metrics=metrics,
            max_steps=max_steps,
            train_metrics=train_metrics,
            history=history,
            **(limits or {}),
        )

    def _metrics(self, name: str) -> Metrics:
        """``learn.metrics`` or ``learn.train_metrics``, checked again: they
        may have been set after ``__init__`` (the fix says how)."""
        return as_metrics(getattr(self, name), name, owner="Learner", attribute=True)

    def create_opt(
        self, lr: LR | None, wd: float | dict | None = None
    ) -> HPOptimizer | MultiOptimizer:
        """Creates the optimizer on first use; afterwards only sets lr and wd.

        ``lr`` (None: 1e-3, said once) goes as given to the optimizer, which
        checks it and spreads it over the layer groups (``HPOptimizer.set_lr``;
        with parts, ``MultiOptimizer.set_lr``, a dict by part too).
        """
        lr = self._default_lr() if lr is None else lr
        wd = self._wd(wd)
        if self.opt is None and not isinstance(self.opt_func, dict):
            groups = [{"params": params} for params in self.layer_groups]
            self.opt = HPOptimizer(
                groups, self._opt_func(), lr=lr, wd=wd, true_wd=self.true_wd
            )
        else:
            if self.opt is None:  # one optimizer per part, then their lr and wd
                self.opt = MultiOptimizer(self._parts())
            self.opt.set_lr(lr)
            self.opt.wd = wd
        return self.opt

    def _parts(self) -> dict[str, HPOptimizer]:
        """One ``HPOptimizer`` per part, over its layer groups."""
        funcs = self._opt_func()
        return {
            name: HPOptimizer(
                [{"params": params} for params in groups],
                funcs[name],
                lr=1e-3,  # create_opt sets the real ones, checked and spread
                true_wd=self.true_wd,
            )
            for name, groups in self.part_groups.items()
        }

    def _opt_for_schedule(
        self, wd: float | dict | None
    ) -> HPOptimizer | MultiOptimizer:
        """The optimizer of a fit whose scheduler sets the lr. The scheduler
        spreads its lr over the groups and sets the first step's values in
        ``on_train_begin``, before any step, so an optimizer created now
        starts at 1e-3 and an existing one keeps its lr until then."""
        if self.opt is None:
            return self.create_opt(1e-3, wd)
        self.opt.wd = self._wd(wd)
        return self.opt

    def _wd(self, wd: float | dict | None) -> float | dict:
        """``wd``, or the Learner's; a dict by part must name every part."""
        wd = self.wd if wd is None else wd
        if isinstance(wd, dict) and "" in self.part_groups:
            raise TypeError(
                f"wd={wd!r} gives a value per part, but the Learner has one "
                "optimizer (no parts). Fix: one number (e.g. wd=1e-2), or "
                "opt_func={part: class, ...} for one optimizer per part."
            )
        if isinstance(wd, dict):
            check_part_names(wd, list(self.part_groups), "wd", every=True)
        return wd

    def _default_lr(self) -> float:
        """The lr used when none is given: 1e-3, said once per process."""
        return _default("lr", 1e-3)

    def _callbacks(self, extra: Iterable[Callback] | Callback | None) -> list:
        cbs = [self.recorder, *self.callbacks, *callback_list(extra)]
        return [*cbs, ProgressBar()] if self.progress else cbs

    def lr_range(self, lr: LR | None, name: str = "lr") -> list[float]:
        """One learning rate per layer group from a float, slice or sequence
        (None: the default, 1e-3, said once), checked and spread once."""
        lr = self._default_lr() if lr is None else lr
        counts = {part: len(groups) for part, groups in self.part_groups.items()}
        return spread_over_parts(lr, counts, name)

    # -- freezing --------------------------------------------------------------
    def freeze_to(self, n: int) -> None:
        """Freezes the layer groups before ``n`` and unfreezes the rest.

        Normalization layers stay trainable when ``train_bn`` is True; a
        frozen parameter's gradient is dropped, so no optimizer moves it
        (``set_trainable``).
        """
        n_frozen = len(self.layer_groups[:n])
        for i, group in enumerate(self.layer_groups):
            set_trainable(group, i >= n_frozen, self.model, self.train_bn)

    def freeze(self) -> None:
        """Freezes every layer group but the last (the head)."""
        if len(self.layer_groups) < 2:
            raise ValueError(
                "freeze() keeps only the last layer group trainable, but this "
                "Learner has 1 layer group, so it would freeze nothing. Fix: "
                "Learner(..., layer_groups=[body, head])."
            )
        self.freeze_to(-1)

    def unfreeze(self) -> None:
        """Makes every layer group trainable."""
        self.freeze_to(0)

    # -- evaluation ------------------------------------------------------------
    def summary(self, depth: int | None = None) -> Summary:
        """The model's layers with output shapes (one forward pass on a
        training batch, in eval mode, that changes nothing), parameter counts
        (total, trainable, frozen, per layer group), the optimizer's
        hyper-parameters per group (``opt_func`` before the first fit), a
        fit's callbacks in the order they run, and the precision. Prints as
        a text table; a notebook shows an HTML table. ``depth``: None for
        every leaf module, ``k`` for the modules ``k`` levels down.

        Examples:
            >>> learn.summary().total
            195
            >>> print(learn.summary(depth=1))
            Sequential: input [16, 8] (the first training batch), output [16, 3]
            ...
            Precision: fp32 (weights float32)
        """
        return learner_summary(self, depth, callbacks=self._callbacks(None))

    def validate(self, dl: Iterable | None = None) -> dict[str, float]:
        """Loss, metrics and loss parts (``valid_<part>``, for a loss that
        returns a dict) over ``dl`` (the validation set by default), read in
        one host transfer. Like ``get_preds`` and ``predict`` it runs as a
        fit's validation does, in the Learner's precision, memory format and
        compilation (see ``Callback.in_evaluation``): on the same weights,
        the values of the fit's last record, exactly."""
        return evaluation.validation_values(self, dl)

    def get_preds(
        self, dl: Iterable | None = None, activation: Callable | None = None
    ) -> tuple[Any, Any]:
        """Model outputs and targets over ``dl`` (validation set by default).

        Outputs keep their structure (a tensor, or a tuple, dict or dataclass
        of tensors), each tensor joined over the batches along dim 0; they
        stay on the device until the end, then move to the CPU at once.
        Tensors whose other dims vary between batches (padded sequences) are
        padded to the largest: float with nan, int with -100 (what torch's
        losses ignore), bool with False; a 0-dim tensor (one value per batch)
        gives one value per batch. ``activation`` (e.g.
        ``partial(torch.softmax, dim=-1)``) is applied to the joined outputs
        (the whole structure: pick a part first, e.g. ``lambda o: o[0]``).
        Targets are joined the same way: a tensor, or a tuple for several
        (``(x, (y1, y2))`` batches); None for batches of inputs only (a test
        set without labels: no loss is computed). The outputs are computed
        in the Learner's precision (under autocast after ``to_bf16()``) and
        returned in float32: float16 and bfloat16 tensors are cast (so
        ``preds.numpy()`` works), before ``activation``.
        """
        return evaluation.predictions(self, dl, activation)

    def predict(self, x: Any, activation: Callable | None = None) -> Any:
        """The model's output for one item or a batch of items, on the CPU.

        One item (``x`` without the batch dim, judged from the dataset's first
        item, or the first batch of a loader that is a list) gets it added,
        and every tensor of the output with a batch dim loses it again: a
        tuple, dict or dataclass output keeps its structure. It runs as
        ``get_preds`` does, in the Learner's precision, memory format and
        compilation; float16 and bfloat16 outputs come back in float32.
        """
        return evaluation.prediction(self, x, activation)

    # -- saving ----------------------------------------------------------------
    def save(self, name: str | Path, with_opt: bool = True) -> Path:
        """Saves the model (and optimizer) to ``path/models/name.pth`` atomically.

        With the optimizer go the states of the Learner's stateful callbacks
        (such as ``MixedPrecision``'s loss scale), keyed by class name. Under
        torch.distributed rank 0 writes; a model sharded with FSDP is gathered
        from every rank, so there call ``save`` on every rank. The file holds
        the plain model's keys, whatever wraps it (DDP, ``torch.compile``).
        """
        fix = f"learn.save({str(name)!r}, with_opt=False)"
        with_opt = check_flag(with_opt, "with_opt", "Learner.save", fix)
        state: dict[str, Any] = {"model": model_state(self.model)}
        if with_opt and self.opt is not None:
            state["opt"] = optimizer_state(self.opt, self.model)
            state["opt_identity"] = optimizer_identity(self.opt)  # checked by load
            state["callbacks"] = [
                [cb.name, cb_state]
                for cb in self.callbacks
                if (cb_state := cb.state_dict())
            ]
        path = self._file(name)
        if ranks.is_main():
            atomic_save(state, path)
        if is_sharded(self.model):
            ranks.barrier()  # every rank is here: none loads before the file exists
        return path

    def load(self, name: str | Path, with_opt: bool = True) -> Learner:
        """Loads what ``save`` wrote: weights, optimizer and callback states.

        A saved callback state goes to this Learner's callback of the same
        class; one it has no callback for (``MixedPrecision`` when loading for
        inference in float32, say) is left unused. A sharded model loads on
        every rank at once. A file of another model, or (``with_opt``) of
        another optimizer class or number of layer groups, is refused before
        anything is loaded. The model may be plain, compiled or wrapped, and
        so may the one that saved.
        """
        fix = f"learn.load({str(name)!r}, with_opt=False)"
        with_opt = check_flag(with_opt, "with_opt", "Learner.load", fix)
        path = self._file(name)
        # (a missing file: safe_load says "save() first")
        if not path.is_file() and (path.is_symlink() or path.exists()):
            raise ValueError(
                f"Learner.load: {str(path)!r} {not_a_file(path)}, not a file that "
                "save() wrote. Fix: name the file, or move that entry out of the way."
            )
        state = safe_load(path, map_location=model_device(self.model))
        if not isinstance(state, dict) or "model" not in state:
            raise ValueError(
                f"{str(path)!r} is not a Learner.save file: it holds no 'model' "
                "entry (a weights-only file, such as Checkpoint(save_weights_only"
                "=True)'s best.pth, holds the model's state_dict alone). Fix: "
                "learn.model.load_state_dict(torch.load(path, weights_only=True))."
            )
        check_model_state(self.model, state["model"], repr(str(path)))
        with_opt = with_opt and "opt" in state
        if with_opt:
            opt = self.opt if self.opt is not None else self.create_opt(1e-3)
            _check_optimizer(opt, state, path, name)
        load_model_state(self.model, state["model"], repr(str(path)))
        if with_opt:
            load_optimizer_state(opt, self.model, state["opt"])
            # A state whose callback this Learner lacks is not needed here.
            give_states(self.callbacks, state.get("callbacks", []))
        return self

    @property
    def path(self) -> Path:
        """The directory of ``save``/``load`` (files go to ``path/models``);
        assign any path-like (a ``str`` becomes a ``Path``)."""
        return self._path

    @path.setter
    def path(self, value: str | os.PathLike) -> None:
        self._path = _check_path(value)

    def _file(self, name: str | Path) -> Path:
        name = Path(name)
        if name.suffix == ".pth" or name.parent != Path():
            return name
        return self.path / "models" / f"{name}.pth"

    # -- training shortcuts: one callback added to one fit ----------------------
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
        max_time: Any = None,
        train_batches: int | None = None,
        valid_batches: int | None = None,
    ) -> History:
        """Trains with the 1cycle policy (see ``OneCycleScheduler``).

        ``lr``, the peak learning rate, is taken as by ``fit``: a float, one
        value per layer group, or a slice (the scheduler spreads it over the
        groups when training begins); None is 1e-3, said once. ``max_lr`` is
        another name for it (``OneCycleScheduler``'s): pass one of the two.
        ``total_steps`` is needed only for a loader without a length.

        Examples:
            >>> learn.fit_one_cycle(5, lr=1e-2)
            History(5 epochs: train_loss ... -> ..., valid_loss ... -> ...,
                    accuracy ... -> ...)
        """
        if lr is None and max_lr is None:
            lr = self._default_lr()
        name, peak = peak_lr(lr, max_lr, owner="Learner.fit_one_cycle")
        sched = OneCycleScheduler(
            div_factor=div_factor, pct_start=pct_start, final_div=final_div,
            moms=moms, total_steps=total_steps, **{name: peak},
        )  # fmt: skip
        limits = _limits(max_time, train_batches, valid_batches)
        return self._fit_scheduled(epochs, wd, sched, callbacks, limits)

    def fit_flat_cos(
        self,
        epochs: int,
        lr: LR | None = None,
        pct_start: float = 0.75,
        wd: float | None = None,
        callbacks: Iterable[Callback] | None = None,
        total_steps: int | None = None,
        *,
        max_time: Any = None,
        train_batches: int | None = None,
        valid_batches: int | None = None,
    ) -> History:
        """Trains at ``lr`` for ``pct_start`` of the steps, then anneals to 0.

        Examples:
            >>> learn.fit_flat_cos(5, lr=1e-3)
            History(5 epochs: train_loss ... -> ..., valid_loss ... -> ...,
                    accuracy ... -> ...)
        """
        lrs = self.lr_range(lr)  # spread over the layer groups, once
        _check_fraction("pct_start", pct_start, "Learner.fit_flat_cos")
        phases = [(pct_start, constant(lrs)), (1 - pct_start, cosine(lrs, 0.0))]
        sched = ParamScheduler({"lr": phases}, total_steps)
        limits = _limits(max_time, train_batches, valid_batches)
        return self._fit_scheduled(epochs, wd, sched, callbacks, limits)

    def fit_warmup_cos(
        self,
        epochs: int,
        lr: LR | None = None,
        pct_warmup: float = 0.1,
        wd: float | None = None,
        callbacks: Iterable[Callback] | None = None,
        total_steps: int | None = None,
        *,
        max_time: Any = None,
        train_batches: int | None = None,
        valid_batches: int | None = None,
    ) -> History:
        """Warms up linearly from 0 to ``lr``, then anneals along a cosine to 0.

        Examples:
            >>> learn.fit_warmup_cos(5, lr=1e-3, pct_warmup=0.05)
            History(5 epochs: train_loss ... -> ..., valid_loss ... -> ...,
                    accuracy ... -> ...)
        """
        lrs = self.lr_range(lr)  # spread over the layer groups, once
        _check_fraction("pct_warmup", pct_warmup, "Learner.fit_warmup_cos")
        phases = [(pct_warmup, linear(0.0, lrs)), (1 - pct_warmup, cosine(lrs, 0.0))]
        sched = ParamScheduler({"lr": phases}, total_steps)
        limits = _limits(max_time, train_batches, valid_batches)
        return self._fit_scheduled(epochs, wd, sched, callbacks, limits)

    def fine_tune(
        self,
        epochs: int,
        base_lr: float = 2e-3,
        freeze_epochs: int = 1,
        lr_mult: float = 100,
        pct_start: float = 0.3,
        div: float = 5.0,
        moms: tuple[float, float] | None = (0.95, 0.85),
        wd: float | None = None,
        callbacks: Iterable[Callback] | None = None,
        *,
        max_time: Any = None,
        train_batches: int | None = None,
        valid_batches: int | None = None,
    ) -> History:
        """Fine-tunes a pretrained body: ``freeze_epochs`` epochs training the
        head only, then ``epochs`` epochs training everything, as fastai's.

        The frozen phase is a 1cycle (``pct_start=0.99``, ``div_factor=25``)
        at ``slice(base_lr)``: every layer group but the last is frozen (as
        ``freeze()``; with ``train_bn`` their normalization layers train at
        ``base_lr / 10``). Then every group is unfrozen and a second 1cycle
        (``pct_start``, ``div_factor=div``) runs at ``slice(base_lr / 2 /
        lr_mult, base_lr / 2)``, discriminative rates from the first group to
        the last: fastai halves ``base_lr`` after the frozen phase, and so does
        this. Both cycles end at their peak divided by ``div_factor * 1e4``.

        It is one fit of ``freeze_epochs + epochs`` epochs (a
        ``BackboneFinetuning`` unfreezes at epoch ``freeze_epochs``;
        ``OneCycleScheduler.in_phases`` runs the two cycles, the second from
        that epoch's first step, however long the epochs are), so it returns
        one ``History`` with both phases' records, epochs numbered on, and a
        ``Checkpoint`` among the callbacks resumes a killed ``fine_tune`` in
        the phase it was in. Every group trains in the second phase, also
        after an earlier ``freeze()`` and with ``freeze_epochs=0``. A
        Learner with one layer group is refused before training (there is no
        head apart from the body: give ``layer_groups``), unless
        ``freeze_epochs=0``.

        Examples:
            >>> body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
            >>> head = nn.Linear(16, 3)
            >>> learn = Learner(data, nn.Sequential(body, head), F.cross_entropy,
            ...                 layer_groups=[body, head], progress=False)
            >>> learn.fine_tune(2, base_lr=1e-2)  # 1 epoch frozen, then 2
            History(3 epochs: train_loss ... -> ..., valid_loss ... -> ...,
                    accuracy ... -> ...)
            >>> all(p.requires_grad for p in learn.model.parameters())
            True
        """
        owner = "Learner.fine_tune"
        check_int(epochs, "epochs", minimum=1, owner=owner, example=3)
        check_int(freeze_epochs, "freeze_epochs", minimum=0, owner=owner, example=1)
        for name, value, example in (
            ("base_lr", base_lr, 2e-3),
            ("lr_mult", lr_mult, 100),
            ("div", div, 5.0),
        ):
            check_number(value, name, above=0, owner=owner, example=example)
        _check_fraction("pct_start", pct_start, owner)
        OneCycleScheduler(lr=base_lr, moms=moms)  # checks moms, in its wording
        if freeze_epochs and len(self.layer_groups) < 2:
            raise ValueError(
                f"{owner} trains the head alone for freeze_epochs={freeze_epochs} "
                "(every layer group but the last frozen), but this Learner has 1 "
                "layer group, so it would freeze nothing. Fix: Learner(..., "
                "layer_groups=[body, head]), or freeze_epochs=0."
            )
        # (a slice needs two groups: one group trains at the head's rate)
        top = slice(base_lr / 2 / lr_mult, base_lr / 2)
        cycles = OneCycleScheduler.in_phases(
            [(freeze_epochs, slice(base_lr), 25.0, 0.99),
             (epochs, top if len(self.layer_groups) > 1 else top.stop, div,
              pct_start)],
            moms,
        )  # fmt: skip
        self.unfreeze()  # as fastai's: whatever an earlier freeze() left
        cbs = callback_list(callbacks)
        if freeze_epochs:
            cbs.insert(0, BackboneFinetuning(freeze_epochs, 1.0, 1.0,
                                             train_bn=self.train_bn))  # fmt: skip
        limits = _limits(max_time, train_batches, valid_batches)
        return self._fit_scheduled(freeze_epochs + epochs, wd, cycles, cbs, limits)

    def _fit_scheduled(
        self,
        epochs: int,
        wd: float | None,
        sched: Callback,
        callbacks: Iterable[Callback] | None,
        limits: dict | None = None,
    ) -> History:
        """``fit`` with ``sched`` setting the lr: the optimizer's lr is left
        to it (it holds the lr, spread over the groups). Returns the history."""
        cbs, history = [sched, *callback_list(callbacks)], History()
        steps = self._fit_states(epochs, None, wd, cbs, None, True, history, limits)
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
        (see ``sweep_problems``): the loss never fell (valley is a guess), or
        the valley begins at ``start_lr`` or still goes on at ``end_lr``.

        The sweep runs at the optimizer's momentum as it is. ``fit_one_cycle``
        moves momentum to 0.95-0.85, so for plain SGD (momentum 0) a rate
        swept without momentum is several times too high there: create the
        optimizer with the momentum you will train with (e.g. ``opt_func=
        partial(torch.optim.SGD, momentum=0.9)``), or pass ``moms=None``.

        Examples:
            >>> learn.lr_find(num_it=40)  # 64 samples: a short sweep
            SuggestedLRs(valley=..., steepest=..., min_div10=...)
            >>> learn.recorder.plot_lr_find()
            <Axes: xlabel='learning rate', ylabel='loss (smoothed)'>
        """
        finder = LRFinder(start_lr, end_lr, num_it, stop_div, mode)
        had_opt = self.opt is not None
        if not had_opt:
            self.create_opt(start_lr)
        try:
            return lr_sweep(
                finder,
                self._sweep_epochs(num_it),
                self.model,
                self.loss_func,
                self.opt,
                self.data,
                callbacks=[cb for cb in self.callbacks if _in_lr_find(cb)],
                bar=[SweepBar(num_it)] if self.progress else [],
                metrics=self._metrics("metrics"),  # not computed, but named
                recorder=self.recorder,
            )
        finally:
            if not had_opt:
                self.opt = None

    def find_batch_size(
        self,
        mode: str = "power",
        init_val: int = 2,
        max_trials: int = 25,
        steps_per_trial: int = 3,
        max_batch_size: int | None = None,
        max_memory: int | str | None = None,
        apply: bool = False,
        verbose: bool = True,
        extra_memory: int | str | None = None,
    ) -> BatchSizeResult:
        """The largest training batch size that fits (see ``find_batch_size``
        for the arguments): ``steps_per_trial`` steps at each size tried,
        with the callbacks that shape a step (``MixedPrecision`` from
        ``to_bf16()``, accumulation, yours: ``Callback.in_lr_find``); every
        state is put back after. ``apply=True`` rebuilds ``data.train_dl``
        with the size found. Prints what it found in one line (unless
        ``verbose=False``); on the CPU, give ``max_memory``.

        The callbacks left out of the trials (``in_lr_find = False``: ``EMA``,
        ``SWA``, ``Compile``, ``DistributedTrainer``, the loggers, ...) do not
        run, but what ``EMA`` and ``SWA`` will hold, a float32 copy of the
        weights they average, is counted as held through every trial (with
        ``extra_memory``, yours added: see ``memory_left_out``). ``Compile``
        (compiled kernels usually hold less), DDP's gradient buckets
        (about one more copy of the gradients) and ``CudaGraph``'s memory
        pool (its static inputs and the captured step's activations, held
        for the whole fit) are not counted: leave room for them.

        Examples:
            >>> learn.find_batch_size(max_memory="15kB")
            find_batch_size: batch size 32 (verified: peak ... kB of 15 kB); tried
            2, 4, 8, 16, 32, 64 ✗; first failure: 64 (over the 15 kB budget:
            stopped at ... kB); stopped by the first failure (power mode)
            BatchSizeResult(batch_size=32, 6 trials, stopped by the first failure
            (power mode))
        """
        had_opt = self.opt is not None
        if not had_opt:
            self.create_opt(1e-3)  # any rate: the trials' steps are undone
        try:
            return find_batch_size(
                self.model, self.loss_func, self.opt, self.data,
                callbacks=[cb for cb in self.callbacks if _in_lr_find(cb)],
                left_out=[cb for cb in self.callbacks if not _in_lr_find(cb)],
                mode=mode, init_val=init_val, max_trials=max_trials,
                steps_per_trial=steps_per_trial, max_batch_size=max_batch_size,
                max_memory=max_memory, extra_memory=extra_memory, apply=apply,
                verbose=verbose,
            )  # fmt: skip
        finally:
            if not had_opt:
                self.opt = None

    def fit_snapshots(
        self,
        n_steps: int,
        every: int = 25,
        lr: LR | None = None,
        wd: float | None = None,
        callbacks: Iterable[Callback] | None = None,
        *,
        max_time: Any = None,
        train_batches: int | None = None,
        valid_batches: int | None = None,
    ) -> Iterator[Snapshot]:
        """Trains for ``n_steps`` optimizer steps, yielding a ``Snapshot`` every
        ``every`` steps (and after the last); the same loop as ``fit``.

        Breaking out of the ``for`` ends training cleanly (every callback's
        ``on_train_end`` runs). Each snapshot reads the loss from the device:
        one sync per ``every`` steps.

        Examples:
            >>> for snap in learn.fit_snapshots(n_steps=500, every=25, lr=1e-2):
            ...     print(snap.step, f"{snap.loss:.2f}")
            ...     if snap.loss < 0.5:
            ...         break
            25 0.85
            50 0.71
            75 0.28
        """
        owner = "Learner.fit_snapshots"
        check_int(n_steps, "n_steps", minimum=1, owner=owner, example=500)
        check_int(every, "every", minimum=1, owner=owner, example=25)
        limits = _limits(max_time, train_batches, valid_batches)
        steps = self._fit_states(None, lr, wd, callbacks, n_steps, limits=limits)
        t0, loop_values = (
            time.perf_counter(),
            ("epoch", "step", "train_loss", "lr", "time"),
        )
        with closing(steps):
            for state in steps:
                step = state["step"]
                due = step % every == 0 or step >= n_steps
                if state["skip_step"] or not due:  # no step this batch, or not due
                    continue
                record = state["record"] or {}  # read already: no transfer
                metrics = {k: v for k, v in record.items() if k not in loop_values}
                (loss,) = to_floats([state["last_loss"]])
                yield Snapshot(
                    step, state["epoch"], loss, metrics, time.perf_counter() - t0
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
            cb.batches_at(0)
            for cb in self.callbacks
            if isinstance(cb, GradientAccumulation)
        )
        return math.ceil(num_it / math.ceil(n_batches / per_step))

    def to_fp16(self) -> Any:
        """Trains in mixed precision with float16 and loss scaling (CUDA).

        Creates the optimizer fused (SGD, Adam, AdamW), so skipping a step with
        non-finite gradients costs no host-device sync. Returns the Learner.

        Examples:
            >>> learn = Learner(data, model, F.cross_entropy).to_fp16()
            >>> learn.callbacks  # float16 needs a GPU; on a CPU, to_bf16()
            [MixedPrecision(dtype=torch.float16)]
        """
        return self._set_precision(MixedPrecision(torch.float16))

    def to_bf16(self) -> Any:
        """Trains in mixed precision with bfloat16 (CPUs, Ampere GPUs and up)."""
        return self._set_precision(MixedPrecision(torch.bfloat16))

    def to_fp32(self) -> Any:
        """Trains in full precision again (removes ``MixedPrecision``)."""
        self.callbacks = [cb for cb in self.callbacks if not _is_mp(cb)]
        return self

    def compile(self, **kwargs: Any) -> Any:
        """Trains every later fit through ``torch.compile`` (``kwargs`` are its
        arguments), the module compiled in place: saved files, checkpoints and
        the best weights keep the plain module's keys. ``validate``,
        ``get_preds`` and ``predict`` run compiled too, ``lr_find`` the plain
        module. See ``Compile``. Returns the Learner. An evaluation compiles
        graphs of its own for ``predict``'s batch of one and each new
        ``get_preds`` batch shape (counted against torch's recompile limit).

        Examples:
            >>> learn = Learner(data, model, F.cross_entropy)
            >>> learn = learn.compile(mode="max-autotune")
            >>> learn.callbacks
            [Compile(mode='max-autotune')]
        """
        compiler = Compile(**kwargs)  # checked before anything changes
        self.callbacks = [cb for cb in self.callbacks if not isinstance(cb, Compile)]
        self.callbacks.append(compiler)
        return self

    def cuda_graph(self, warmup: int = 3) -> Any:
        """Replays every later fit's training steps as a CUDA graph after
        ``warmup`` eager steps (see ``CudaGraph``: a GPU, static shapes; only
        the lr may follow a schedule: ``fit_one_cycle(..., moms=None)``; a
        distributed fit and ``fine_tune`` are refused). Replaces an earlier
        ``CudaGraph``; a bad ``warmup`` changes nothing. Returns the Learner.

        Examples:
            >>> learn = Learner(data, model, F.cross_entropy)
            >>> learn.cuda_graph(warmup=5).callbacks
            [CudaGraph(warmup=5)]
        """
        graph = CudaGraph(warmup)  # checked before anything changes
        self.callbacks = [cb for cb in self.callbacks if not isinstance(cb, CudaGraph)]
        self.callbacks.append(graph)
        return self

    def to_channels_last(self) -> Any:
        """Trains every later fit in the channels-last memory format: the
        model's 4-D weights and each batch's 4-D inputs (see ``ChannelsLast``).
        Returns the Learner.

        Examples:
            >>> from torch.utils.data import DataLoader, TensorDataset
            >>> convnet = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(),
            ...                         nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            ...                         nn.Linear(8, 3))
            >>> images = TensorDataset(torch.randn(32, 3, 8, 8),
            ...                        torch.randint(0, 3, (32,)))
            >>> learn = Learner(DataBunch(DataLoader(images, 16)), convnet,
            ...                 F.cross_entropy, progress=False)
            >>> learn = learn.to_channels_last().to_bf16()
            >>> learn.callbacks
            [ChannelsLast(order=-210), MixedPrecision(dtype=torch.bfloat16)]
            >>> learn.fit(1, lr=1e-3)
            History(1 epoch: train_loss ...)
        """
        check_convolutional(self.model)  # refused now, not at the next fit
        self.callbacks = [c for c in self.callbacks if not isinstance(c, ChannelsLast)]
        self.callbacks.append(ChannelsLast())
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
        ``python`` run. ``backend=None`` is gloo when the data's device is the
        CPU, even where a GPU is visible, else NCCL where CUDA is.

        Examples:
            In a script that ``torchrun`` starts (``torchrun --nproc_per_node=2
            train.py``); started as a plain process it trains as without it:

            >>> learn = Learner(data, model, F.cross_entropy).to_distributed()
            >>> learn = learn.to_distributed(strategy="fsdp", fsdp_units=(nn.Linear,))
            >>> learn.callbacks
            [DistributedTrainer(fsdp, gloo, off)]
        """
        self.callbacks = [cb for cb in self.callbacks if not _is_dist(cb)]
        device = getattr(self.data, "device", None)
        if backend is None and device is not None and device.type == "cpu":
            backend = "gloo"  # not NCCL, even where a GPU is visible
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
        funcs = {
            part: partial(func, fused=True)
            if fp16 and "fused" in inspect.signature(func).parameters
            else func
            for part, func in by_part(self.opt_func).items()
        }
        return funcs if isinstance(self.opt_func, dict) else funcs[""]


_DEFAULTS = {
    "opt_func": "no opt_func given; using torch.optim.AdamW (pass opt_func=... "
    "to choose, e.g. torch.optim.SGD).",
    "wd": "no wd given; using weight decay 0.01, decoupled from the gradient "
    "(true_wd=True, AdamW style; pass wd=0 for none).",
    "lr": "no lr given; training at lr=1e-3 (learn.lr_find() suggests one; pass "
    "lr=... to choose).",
}


def _default(name: str, value: Any) -> Any:
    """``value``, the default of ``name``: said once per process, as the Gluon
    Fit API asks (users are told when a default is used for them)."""
    if name not in _said and ranks.is_main():
        _said.add(name)
        print(f"fitlib: {_DEFAULTS[name]}")
    return value


def _check_path(path: Any) -> Path:
    path = check_path(
        path, "path", owner="Learner", what="a directory path", example="'runs/exp1'"
    )
    if path.exists() and not path.is_dir():
        raise ValueError(
            f"path {str(path)!r} is a file; it must be a directory (save and load "
            f"use {str(path / 'models')!r}). Fix: pass its directory, e.g. "
            f"path={str(path.parent)!r}."
        )
    return path


def _default_metrics(loss_func: Callable) -> list:
    is_clf = loss_func in _CLASSIFICATION_LOSSES or isinstance(
        loss_func, (nn.CrossEntropyLoss, nn.NLLLoss)
    )
    if not is_clf:
        return []
    if "accuracy" not in _said and ranks.is_main():  # once, not once per process
        _said.add("accuracy")
        print(
            "fitlib: no metrics given; reporting accuracy since the loss is "
            "cross-entropy (pass metrics=[] for none)."
        )
    return [accuracy]


def _func_names(opt_func: Any) -> str:
    funcs = {k: name_of(getattr(f, "func", f)) for k, f in by_part(opt_func).items()}
    return funcs[""] if "" in funcs else repr(funcs)


def _check_optimizer(opt: HPOptimizer, state: dict, path: Path, name: Any) -> None:
    """Refuses a saved optimizer state that cannot continue in ``opt``."""
    whose = ("the file's", "this Learner's")
    found = optimizer_differences(opt, state["opt"], state.get("opt_identity"), whose)
    if found:
        raise ValueError(
            f"{str(path)!r} holds the state of another optimizer than this "
            f"Learner's: {'; '.join(found)}. Fix: learn.load({str(name)!r}, "
            "with_opt=False) to load the weights only, or build the Learner with "
            "the opt_func and layer_groups of the run that saved it."
        )


def _in_lr_find(cb: Callback) -> bool:
    """Whether ``cb`` (or the callback a filter wraps) takes part in a sweep."""
    return getattr(inner_callback(cb), "in_lr_find", True)


def _is_dist(cb: Callback) -> bool:
    return isinstance(cb, DistributedTrainer)


def _is_mp(cb: Callback) -> bool:
    return isinstance(cb, MixedPrecision)


def _check_fraction(name: str, value: Any, owner: str) -> None:
    check_number(
        value, name, above=0, below=1, what="a fraction of training", owner=owner,
        example=0.25,
    )  # fmt: skip


def _limits(max_time: Any, train_batches: Any, valid_batches: Any) -> dict:
    """The budget and caps every ``fit_*`` method passes on to ``fit_states``."""
    return dict(
        max_time=max_time, train_batches=train_batches, valid_batches=valid_batches
    )
