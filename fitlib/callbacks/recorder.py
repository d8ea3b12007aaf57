"""``Recorder``: the history of training runs, for plots and tables.

Per training step it keeps the learning rate and momentum (python numbers
already), the raw and smoothed loss and the batch size. The losses stay
detached device tensors until they are read: recording a step never forces a
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

from fitlib.callback import Callback
from fitlib.core import batch_size, to_floats, weighted_mean
from fitlib.optim import momentum

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

    def reset(self) -> None:
        """Forgets the whole history."""
        self.lrs: list[float] = []
        self.moms: list[float | None] = []
        self.iterations: list[int] = []
        self.batch_sizes: list[int] = []
        self._losses: list[float] = []
        self._smooth: list[float] = []
        # Device tensors of the steps not yet read (see _flush).
        self._pending: list[torch.Tensor] = []
        self._pending_smooth: list[torch.Tensor] = []
        self.epochs: list[int] = []
        self.epoch_iterations: list[int] = []
        self.train_losses: list[float] = []
        self.valid_losses: list[float] = []
        self.metrics: list[list[float]] = []
        self.epoch_metric_names: list[list[str]] = []
        self.times: list[float] = []
        self.metric_names: list[str] = []
        self._epoch_first, self._t0 = 0, time.perf_counter()

    @property
    def losses(self) -> list[float]:
        """The raw training loss of every step."""
        self._flush()
        return self._losses

    @property
    def smooth_losses(self) -> list[float]:
        """The smoothed training loss (``state['smooth_loss']``) of every step."""
        self._flush()
        return self._smooth

    # -- hooks -----------------------------------------------------------------
    def on_train_begin(self, metrics: Any = None, **kwargs: Any) -> None:
        """Runs before training: takes the metric names of this fit."""
        self._flush()  # an interrupted fit's steps, before the device may change
        self.metric_names = list(getattr(metrics, "names", []))

    def on_epoch_begin(self, **kwargs: Any) -> None:
        """Runs at the start of each epoch: starts its clock."""
        self._epoch_first, self._t0 = len(self.iterations), time.perf_counter()

    # The per-batch hook takes the state as one dict: each named parameter
    # would make Python compare its name with every other state key, per call.
    def on_batch_end(self, **state: Any) -> None:
        """Runs after each batch: records a training step (no sync)."""
        if not state["train"]:
            return
        lr, mom = _hypers(state["opt"])
        self.lrs.append(lr)
        self.moms.append(mom)
        self.iterations.append(len(self.iterations))
        self.batch_sizes.append(batch_size(state["last_target"], state["last_input"]))
        loss, smooth = state["last_loss"], state["smooth_loss"]
        self._pending.append(loss)  # detached by the loop
        self._pending_smooth.append(loss if smooth is None else smooth)

    def on_epoch_end(self, last_metrics: list | None, **kwargs: Any) -> None:
        """Runs after validation: records the epoch, with one host transfer."""
        # Not None, last_metrics starts with the valid loss: values is never empty.
        values = self._flush(last_metrics or [])
        if last_metrics is None:
            values = [math.nan] * (1 + len(self.metric_names))
        first = self._epoch_first
        self.epochs.append(len(self.epochs))
        self.epoch_iterations.append(len(self.iterations) - 1)
        self.train_losses.append(
            weighted_mean(self._losses[first:], self.batch_sizes[first:])
        )
        self.valid_losses.append(values[0])
        self.metrics.append(values[1:])
        self.epoch_metric_names.append(list(self.metric_names))
        # After the transfer, which waited for the device: the epoch's real time.
        self.times.append(time.perf_counter() - self._t0)

    def _flush(self, extra: Iterable = ()) -> list[float]:
        """Moves the pending step losses to Python with ``extra`` (one sync).

        Returns ``extra`` as floats.
        """
        n = len(self._pending)
        values = to_floats([*self._pending, *self._pending_smooth], extra)
        self._losses += values[:n]
        self._smooth += values[n : 2 * n]
        self._pending, self._pending_smooth = [], []
        return values[2 * n :]

    # -- saving ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """The whole history as plain python lists, numbers and strings."""
        state = {k: list(getattr(self, k)) for k in _STEP_KEYS + _EPOCH_KEYS}
        for key in _NESTED_KEYS:
            state[key] = [list(v) for v in getattr(self, key)]
        state["metric_names"] = list(self.metric_names)
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
            attr = {"losses": "_losses", "smooth_losses": "_smooth"}.get(key, key)
            setattr(self, attr, list(state[key]))
        for key in _NESTED_KEYS:
            setattr(self, key, [list(v) for v in state[key]])
        self.metric_names = list(state["metric_names"])

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

    def _check_steps(self) -> None:
        if not self.iterations:
            raise ValueError(f"no training step was recorded; {_NOT_FIT}.")


def _hypers(opt: Any) -> tuple[float, float | None]:
    """The (lr, momentum) of the last parameter group's latest step."""
    # An HPOptimizer notes them in step(): a scheduler may already have set
    # the next ones. Anything else is read as it is now.
    lr, mom = getattr(opt, "stepped", None) or _current(opt.param_groups[-1])
    return (
        lr if type(lr) is float else float(lr),
        mom if mom is None or type(mom) is float else float(mom),
    )


def _current(group: dict) -> tuple[Any, Any]:
    return group["lr"], momentum(group)


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
