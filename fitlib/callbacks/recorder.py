"""``Recorder``: the history of training runs, for plots and tables.

Per training step it keeps the learning rate and momentum (python numbers
already), the loss and the batch size. The losses stay detached device tensors
until they are read, and are smoothed then: recording a step never forces a
host-device sync. Per epoch it keeps the train loss (the exact sample-weighted
mean of the epoch's raw losses), the validation loss, the metrics and the wall
time; the epoch's values reach Python in one transfer at the end of the epoch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

import torch

from fitlib.callback import Callback, LossSmoother
from fitlib.core import batch_size, to_floats, weighted_mean
from fitlib.optim import lr_and_momentum

_STEP_KEYS = ("lrs", "moms", "losses", "smooth_losses", "iterations", "batch_sizes")
_EPOCH_KEYS = (
    "epochs",
    "epoch_iterations",
    "train_losses",
    "valid_losses",
    "metrics",
    "epoch_metric_names",
    "times",
)
# The attributes behind the per-step properties.
_ATTRS = {
    "lrs": "_lrs",
    "moms": "_moms",
    "losses": "_losses",
    "smooth_losses": "_smooth",
    "batch_sizes": "_batch_sizes",
}
# Per-epoch keys whose items are lists: copied one level deeper.
_NESTED_KEYS = ("metrics", "epoch_metric_names")
_NOT_FIT = "nothing to plot yet: call fit first, with this Recorder in the callbacks"


class Recorder(Callback):
    """Records losses, hyper-parameters, metrics and times of every fit.

    The history accumulates across fits (iteration and epoch numbers keep
    increasing); ``reset()`` clears it. After a fit, these are plain python
    lists: ``lrs``, ``moms`` (None where the optimizer has no momentum),
    ``losses``, ``smooth_losses``, ``iterations`` and ``batch_sizes`` per
    training step; ``epochs``, ``epoch_iterations`` (the last iteration of each
    epoch), ``train_losses``, ``valid_losses`` (NaN when validation was
    skipped), ``metrics`` (one list per epoch), ``epoch_metric_names`` (their
    names, per epoch: fits may use different metrics) and ``times`` (seconds)
    per epoch. ``metric_names`` are the latest fit's metric names.

    ``lr`` and momentum are those of the last parameter group that the batch's
    ``opt.step()`` used (``HPOptimizer.stepped``), even when a scheduler sets
    the next ones later in the same batch; a batch without a step records the
    latest step's values.

    Example:
        >>> rec = Recorder()
        >>> fit(3, model, F.cross_entropy, opt, data, callbacks=[rec])
        >>> rec.epoch_table()[-1]["valid_loss"]
        0.3121
        >>> fig = rec.plot_losses()
    """

    order = 50

    def __init__(self) -> None:
        self.reset()
        # The latest LR finder sweep (lrs, losses, suggestions), for
        # plot_lr_find; Learner.lr_find sets it. Not part of the history.
        self.lr_find_result: dict | None = None

    def reset(self) -> None:
        """Forgets the whole history."""
        self._lrs: list[float] = []
        self._moms: list[float | None] = []
        self._batch_sizes: list[int] = []
        self._losses: list[float] = []
        self._smooth: list[float] = []
        # The steps not yet read: ((lr, mom), loss, batch size), the losses as
        # device tensors (see _flush).
        self._pending: list[tuple] = []
        self._smoother = LossSmoother()
        self.epochs: list[int] = []
        self.epoch_iterations: list[int] = []
        self.train_losses: list[float] = []
        self.valid_losses: list[float] = []
        self.metrics: list[list[float]] = []
        self.epoch_metric_names: list[list[str]] = []
        self.times: list[float] = []
        self.metric_names: list[str] = []
        self._epoch_first, self._t0 = 0, time.perf_counter()

    # Reading a per-step list moves the pending steps' losses to Python first:
    # one host-device sync, so read them between epochs, not per batch.
    @property
    def lrs(self) -> list[float]:
        """The learning rate of every step (of the last parameter group)."""
        self._flush()
        return self._lrs

    @property
    def moms(self) -> list[float | None]:
        """The momentum of every step; None where the optimizer has none."""
        self._flush()
        return self._moms

    @property
    def iterations(self) -> list[int]:
        """The iteration number of every step: 0, 1, 2... across fits."""
        return list(range(self._n_steps))

    @property
    def batch_sizes(self) -> list[int]:
        """The number of samples of every step."""
        self._flush()
        return self._batch_sizes

    @property
    def losses(self) -> list[float]:
        """The raw training loss of every step."""
        self._flush()
        return self._losses

    @property
    def smooth_losses(self) -> list[float]:
        """The smoothed training loss of every step.

        The same debiased moving average as ``state['smooth_loss']``, which
        restarts with each fit, computed in float64 from the raw losses when
        they are read: recording it costs no device op per step.
        """
        self._flush()
        return self._smooth

    @property
    def _n_steps(self) -> int:
        return len(self._lrs) + len(self._pending)

    # -- hooks -----------------------------------------------------------------
    def on_train_begin(self, metrics: Any, iteration: int) -> None:
        """Runs before training: takes the metric names of this fit."""
        self._flush()  # an interrupted fit's steps, before the device may change
        if iteration == 0:  # each fit smooths afresh, as the loop does
            self._smoother = LossSmoother()  # (a resumed one continues)
        self.metric_names = list(getattr(metrics, "names", []))

    def on_epoch_begin(self, num_batch: int) -> None:
        """Runs at the start of each epoch: starts its clock."""
        # num_batch > 0: an epoch resumed part way; its first steps are recorded.
        self._epoch_first = self._n_steps - num_batch
        self._t0 = time.perf_counter()

    def on_batch_end(
        self,
        train: bool,
        opt: Any,
        last_loss: torch.Tensor,
        last_target: Any,
        last_input: Any,
    ) -> None:
        """Runs after each batch: records a training step (no sync)."""
        if train:  # one append: this runs every batch
            size = batch_size(last_target, last_input)
            self._pending.append((_hypers(opt), last_loss, size))

    def on_epoch_end(self, last_metrics: list | None) -> None:
        """Runs after validation: records the epoch, with one host transfer."""
        # Not None, last_metrics starts with the valid loss: values is never empty.
        values = self._flush(last_metrics or [])
        if last_metrics is None:
            values = [math.nan] * (1 + len(self.metric_names))
        first = self._epoch_first
        self.epochs.append(len(self.epochs))
        self.epoch_iterations.append(self._n_steps - 1)
        self.train_losses.append(
            weighted_mean(self._losses[first:], self._batch_sizes[first:])
        )
        self.valid_losses.append(values[0])
        self.metrics.append(values[1:])
        self.epoch_metric_names.append(list(self.metric_names))
        # After the transfer, which waited for the device: the epoch's real time.
        self.times.append(time.perf_counter() - self._t0)

    def _flush(self, extra: Iterable = ()) -> list[float]:
        """Moves the pending steps to the lists, with ``extra`` (one sync).

        Returns ``extra`` as floats.
        """
        steps, self._pending = self._pending, []
        values = to_floats([loss for _, loss, _ in steps], extra)
        for (lr, mom), _, size in steps:
            self._lrs.append(lr)
            self._moms.append(mom)
            self._batch_sizes.append(size)
        losses, n = values[: len(steps)], len(steps)
        self._losses += losses
        self._smooth += self._smoother(losses)
        return values[n:]

    # -- saving ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """The whole history as plain python lists, numbers and strings."""
        state = {k: list(getattr(self, k)) for k in _STEP_KEYS + _EPOCH_KEYS}
        for key in _NESTED_KEYS:
            state[key] = [list(v) for v in getattr(self, key)]
        state["metric_names"] = list(self.metric_names)
        state["smoother"] = [self._smoother.avg, self._smoother.n]
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restores the history that ``state_dict`` returned."""
        missing = sorted({*_STEP_KEYS, *_EPOCH_KEYS, "metric_names"} - state.keys())
        if missing:
            raise ValueError(
                f"Recorder.load_state_dict: the state lacks {missing}. Fix: pass "
                "what Recorder.state_dict() returned."
            )
        for keys, what in ((_STEP_KEYS, "step"), (_EPOCH_KEYS, "epoch")):
            lengths = {k: len(state[k]) for k in keys}
            if len(set(lengths.values())) > 1:
                raise ValueError(
                    f"Recorder.load_state_dict: the per-{what} lists differ in "
                    f"length {lengths}; the state is truncated or corrupt."
                )
        self.reset()
        for key in _STEP_KEYS + _EPOCH_KEYS:  # copies: later fits append to them
            if key != "iterations":  # always 0, 1, 2...: derived from the count
                setattr(self, _ATTRS.get(key, key), list(state[key]))
        for key in _NESTED_KEYS:
            setattr(self, key, [list(v) for v in state[key]])
        self.metric_names = list(state["metric_names"])
        if "smoother" in state:  # the moving average of the fit in progress
            self._smoother.avg, self._smoother.n = state["smoother"]

    # -- reading ---------------------------------------------------------------
    def epoch_table(self) -> list[dict]:
        """One dict per epoch: epoch, train_loss, valid_loss, each metric, time.

        Each row has the metrics of its own epoch's fit, so rows of fits with
        different metrics have different keys.

        Example:
            >>> rec.epoch_table()[0]
            {'epoch': 0, 'train_loss': 0.91, 'valid_loss': 0.72,
             'accuracy': 0.66, 'time': 0.41}
        """
        rows = zip(
            self.epochs,
            self.train_losses,
            self.valid_losses,
            self.metrics,
            self.epoch_metric_names,
            self.times,
            strict=True,
        )
        return [
            {"epoch": e, "train_loss": t, "valid_loss": v}
            | dict(zip(names, m, strict=False))
            | {"time": s}
            for e, t, v, m, names, s in rows
        ]

    def plot_losses(self) -> Any:
        """Raw (faint) and smoothed train loss per step, valid loss per epoch.

        Returns the matplotlib Figure.
        """
        self._check_steps()
        ax = (fig := _figure()).subplots()
        ax.plot(self.iterations, self.losses, alpha=0.3, label="train (raw)")
        ax.plot(self.iterations, self.smooth_losses, label="train (smoothed)")
        if any(not math.isnan(v) for v in self.valid_losses):
            ax.plot(self.epoch_iterations, self.valid_losses, "o-", label="valid")
        ax.set(xlabel="iteration", ylabel="loss")
        ax.legend()
        return fig

    def plot_lr(self, show_moms: bool = False) -> Any:
        """The learning rate per step, and the momentum on a second panel.

        Returns the matplotlib Figure.
        """
        self._check_steps()
        if show_moms and all(m is None for m in self.moms):
            raise ValueError(
                "plot_lr(show_moms=True): no momentum was recorded (the "
                "optimizer has neither betas nor momentum). Fix: show_moms=False."
            )
        fig = _figure()
        axes = fig.subplots(1, 2 if show_moms else 1, squeeze=False)
        axes[0, 0].plot(self.iterations, self.lrs)
        axes[0, 0].set(xlabel="iteration", ylabel="learning rate")
        if show_moms:
            moms = [math.nan if m is None else m for m in self.moms]
            axes[0, 1].plot(self.iterations, moms)
            axes[0, 1].set(xlabel="iteration", ylabel="momentum")
        return fig

    def plot_metrics(self) -> Any:
        """One panel per metric, its value per epoch.

        A metric that only some fits computed is NaN (a gap) in the other
        epochs. Panels follow the order in which the metrics first appeared.

        Returns the matplotlib Figure.
        """
        if not self.epochs:
            raise ValueError(f"no epoch has finished yet; {_NOT_FIT}.")
        names = list(dict.fromkeys(n for ns in self.epoch_metric_names for n in ns))
        if not names:
            raise ValueError(
                "no metrics were recorded. Fix: pass metrics=[...] to fit (or to "
                "the Learner)."
            )
        per_epoch = [
            dict(zip(ns, m, strict=False))
            for ns, m in zip(self.epoch_metric_names, self.metrics, strict=True)
        ]
        fig = _figure()
        axes = fig.subplots(1, len(names), squeeze=False)
        for ax, name in zip(axes[0], names, strict=True):
            ys = [values.get(name, math.nan) for values in per_epoch]
            ax.plot(self.epochs, ys, "o-")
            ax.set(xlabel="epoch", ylabel=name)
        return fig

    def plot_lr_find(self) -> Any:
        """The smoothed loss against the learning rate of the last LR finder
        sweep (log scale), with the suggested learning rates marked.

        Returns the matplotlib Figure.
        """
        result = self.lr_find_result
        if not result or not result["lrs"]:
            raise ValueError(
                "no LR finder sweep to plot. Fix: run learn.lr_find() first (with "
                "fit and an LRFinder: recorder.lr_find_result = finder.result)."
            )
        ax = (fig := _figure()).subplots()
        ax.plot(result["lrs"], result["losses"])
        for (name, lr), marker in zip(
            result["suggestions"].items(), "ov", strict=False
        ):
            loss = result["losses"][_nearest(result["lrs"], lr)]
            ax.plot(lr, loss, marker, markersize=8, label=f"{name}: {lr:.2e}")
        ax.set(xscale="log", xlabel="learning rate", ylabel="loss (smoothed)")
        ax.legend()
        return fig

    def _check_steps(self) -> None:
        if not self.iterations:
            raise ValueError(f"no training step was recorded; {_NOT_FIT}.")


def _hypers(opt: Any) -> tuple[float, float | None]:
    """The (lr, momentum) of the last parameter group's latest step."""
    # An HPOptimizer notes them in step(): a scheduler may already have set
    # the next ones. Anything else is read as it is now.
    lr, mom = getattr(opt, "stepped", None) or lr_and_momentum(opt.param_groups[-1])
    return (
        lr if type(lr) is float else float(lr),
        mom if mom is None or type(mom) is float else float(mom),
    )


def _nearest(values: list[float], x: float) -> int:
    """The index of the value nearest to ``x`` on a log scale."""
    return min(range(len(values)), key=lambda i: abs(math.log(values[i] / x)))


def _figure() -> Any:
    """A new Figure, already closed in pyplot: a notebook shows the returned
    figure once (not twice) and scripts leak no open figures."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "Recorder plots need matplotlib. Fix: pip install matplotlib "
            "(or fitlib[plot])."
        ) from e
    fig = plt.figure(layout="tight")
    plt.close(fig)
    return fig
