"""``Recorder``: the history of training runs, for plots and tables.

Per training step it keeps the learning rate and momentum (python numbers
already), the loss and the batch size, within a fixed budget of points
(``max_points``): past it, neighbouring points merge in pairs, so memory and
checkpoints stay bounded for any length of run. The losses stay detached
device tensors until they are read, an epoch ends or ``FLUSH_EVERY`` steps
wait, and are smoothed then: recording a step never forces a host-device
sync. Per epoch it keeps the epoch's record (``state["record"]``: the train
loss, the validation loss, the metrics, every value added to the record and
the time), complete, across fits.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from operator import attrgetter
from typing import Any

import torch

import fitlib.plots as plots
from fitlib.callback import Callback
from fitlib.checks import check_int
from fitlib.host_copy import to_floats
from fitlib.optim import lr_and_momentum
from fitlib.record import LOOP_KEYS, Record
from fitlib.running_loss import LossSmoother, batch_size

# Steps whose losses may wait on the device: one host transfer per this many.
FLUSH_EVERY = 1024

# Per-step keys of the state and the _Point field behind each.
_FIELDS = {
    "lrs": "lr",
    "moms": "mom",
    "losses": "loss",
    "smooth_losses": "smooth_loss",
    "iterations": "iteration",
    "batch_sizes": "batch_size",
}
_EPOCH_KEYS = (
    "epochs",
    "epoch_iterations",
    "train_losses",
    "valid_losses",
    "metrics",
    "epoch_metric_names",
    "times",
)
# The record's values that are not listed as the epoch's "metrics".
_NOT_METRICS = frozenset(LOOP_KEYS)
_NOT_FIT = "nothing to plot yet: call fit first, with this Recorder in the callbacks"


@dataclass(slots=True)
class _Point:
    """Consecutive steps: how many, their samples and sample-weighted mean
    loss, and the last step's lr, momentum, smoothed loss and iteration."""

    steps: int
    batch_size: int
    loss: float
    lr: float
    mom: float | None
    smooth_loss: float
    iteration: int

    def add(
        self,
        size: int,
        loss: float,
        lr: float,
        mom: float | None,
        smooth_loss: float,
        iteration: int,
    ) -> None:
        """Appends one step, in place."""
        self.loss = _mean(self.loss, self.batch_size, loss, size)
        self.steps += 1
        self.batch_size += size
        self.lr, self.mom, self.smooth_loss = lr, mom, smooth_loss
        self.iteration = iteration

    def merged(self, later: _Point) -> _Point:
        """These steps followed by ``later``'s, as one point."""
        return _Point(
            self.steps + later.steps,
            self.batch_size + later.batch_size,
            _mean(self.loss, self.batch_size, later.loss, later.batch_size),
            later.lr,
            later.mom,
            later.smooth_loss,
            later.iteration,
        )


def _mean(a: float, n_a: int, b: float, n_b: int) -> float:
    """The mean of ``a`` over ``n_a`` samples and ``b`` over ``n_b``."""
    if n_a + n_b:
        return (a * n_a + b * n_b) / (n_a + n_b)
    return (a + b) / 2  # batches without samples: no weights to use


class Recorder(Callback):
    """Records losses, hyper-parameters, metrics and times of every fit.

    The history accumulates across fits (iteration and epoch numbers keep
    increasing); ``reset()`` clears it. After a fit, these are plain python
    lists: per point of the training curve ``lrs``, ``moms`` (None where the
    optimizer has no momentum), ``losses``, ``smooth_losses``, ``iterations``
    and ``batch_sizes``; per epoch (per record: see below) ``epochs``,
    ``epoch_iterations`` (the last iteration of each), ``train_losses``,
    ``valid_losses`` (NaN when validation was skipped), ``metrics`` (one list
    per epoch: the record's values other than epoch, losses, lr and time,
    i.e. the metrics, training metrics, loss parts and values callbacks
    added), ``epoch_metric_names``
    (their names, per epoch: fits may differ) and ``times`` (seconds).
    ``metric_names`` are the latest fit's metrics. ``epoch_table()`` gives
    the records themselves; values not computed (None in the record) are NaN.
    An epoch that validates inside (``ValidationSchedule(every_n_steps=...)``)
    has a row per record: per validation, each with its ``step``; its
    ``train_losses`` are then the means since the previous row, and the plots
    place rows at their iterations.

    Per-step points have a fixed budget, ``max_points``. Up to that many
    steps there is one point per step, the step's own values. One step more
    and neighbouring points merge in pairs, so each point covers 2 steps,
    then 4, 8... (``steps_per_point``): a merged point's ``losses`` is the
    sample-weighted mean loss of its steps and ``batch_sizes`` their samples,
    while ``lrs``, ``moms``, ``smooth_losses`` and ``iterations`` are those
    of its last step (exact samples of the schedule, not averages). The
    newest steps, not yet a whole point, are read as one last point. The
    per-epoch lists stay complete and exact: ``train_losses`` comes from
    running sums of the raw losses, never from merged points. Memory and
    ``state_dict()`` stay bounded for any length of run, and a run resumed
    from a checkpoint ends with the same history as one that never stopped.
    Loading a state into a Recorder with a smaller budget merges it to fit.

    ``lr`` and momentum are those of the last parameter group that the batch's
    ``opt.step()`` used (``HPOptimizer.stepped``), even when a scheduler sets
    the next ones later in the same batch; a batch without a step records the
    latest step's values.

    Args:
        max_points: the most per-step points kept (an int >= 2).

    Examples:
        >>> rec = Recorder()
        >>> history = fit(3, model, F.cross_entropy, opt, data, callbacks=[rec])
        >>> rec.epoch_table()[-1]["valid_loss"]
        1.03...
        >>> len(rec.losses), rec.lrs[:2]
        (12, [0.1, 0.1])
        >>> rec.plot_losses()
        <Axes: xlabel='iteration', ylabel='loss'>
    """

    order = 50

    def __init__(self, max_points: int = 4096) -> None:
        self._max_points = check_int(
            max_points, "max_points", minimum=2, owner=self.name, example=4096
        )
        self.reset()
        # The latest LR finder sweep (lrs, losses, suggestions), for
        # plot_lr_find; Learner.lr_find sets it. Not part of the history.
        self.lr_find_result: dict | None = None

    def reset(self) -> None:
        """Forgets the whole history."""
        self._points: list[_Point] = []  # whole points of _stride steps each
        self._part: _Point | None = None  # the newest steps, fewer than _stride
        self._stride = 1
        self._count = 0  # steps recorded, pending ones included
        # The steps not yet read: ((lr, mom), loss, batch size), the losses as
        # device tensors (see _flush).
        self._pending: list[tuple] = []
        self._smoother = LossSmoother()
        # One row per record (per epoch, or per validation inside one): the
        # record, its epoch numbered across fits, lr left out.
        self._rows: list[Record] = []
        # Epochs ended so far, across fits: the number of the next row's epoch.
        self._epochs_done = 0
        self.epoch_iterations: list[int] = []
        self.metric_names: list[str] = []
        # With several optimizers, the part whose rates lrs and moms hold (the
        # last part's last group, as the record's lr): plot_lr says so.
        self.lr_part: str | None = None

    # The per-epoch lists, read from the rows.
    @property
    def epochs(self) -> list[int]:
        """The epoch of each row, counted across fits: 0, 1, 2... (an epoch
        that validated inside, ``ValidationSchedule(every_n_steps=...)``, has
        a row per validation: 0, 0, 0, 1, ...)."""
        return [row["epoch"] for row in self._rows]

    @property
    def train_losses(self) -> list[float]:
        """The mean training loss of each epoch (sample-weighted, exact)."""
        return [row["train_loss"] for row in self._rows]

    @property
    def valid_losses(self) -> list[float]:
        """The validation loss of each epoch (NaN: validation skipped)."""
        return [row["valid_loss"] for row in self._rows]

    @property
    def times(self) -> list[float]:
        """The seconds of each epoch."""
        return [row["time"] for row in self._rows]

    @property
    def epoch_metric_names(self) -> list[list[str]]:
        """The names of each epoch's ``metrics`` values."""
        return [[k for k in row if k not in _NOT_METRICS] for row in self._rows]

    @property
    def metrics(self) -> list[list[float]]:
        """Each epoch's values other than the losses, lr and time."""
        return [[v for k, v in row.items() if k not in _NOT_METRICS]
                for row in self._rows]  # fmt: skip

    # Reading a per-step list moves the pending steps' losses to Python first:
    # one host-device sync, so read them between epochs, not per batch.
    @property
    def lrs(self) -> list[float]:
        """The learning rate of every point (of the last parameter group)."""
        return self._column("lrs")

    @property
    def moms(self) -> list[float | None]:
        """The momentum of every point; None where the optimizer has none."""
        return self._column("moms")

    @property
    def iterations(self) -> list[int]:
        """The iteration of every point (its last step): 0, 1, 2... across
        fits, then every ``steps_per_point``-th once points merge."""
        return self._column("iterations")

    @property
    def batch_sizes(self) -> list[int]:
        """The number of samples of every point."""
        return self._column("batch_sizes")

    @property
    def losses(self) -> list[float]:
        """The raw training loss of every step; of merged points, the
        sample-weighted mean of their steps' losses."""
        return self._column("losses")

    @property
    def smooth_losses(self) -> list[float]:
        """The smoothed training loss of every point (its last step).

        The same debiased moving average as ``state['smooth_loss']``, which
        restarts with each fit, computed in float64 from the raw losses when
        they are read: recording it costs no device op per step.
        """
        return self._column("smooth_losses")

    @property
    def max_points(self) -> int:
        """The most per-step points kept (read only: set it when creating)."""
        return self._max_points

    @property
    def steps_per_point(self) -> int:
        """How many steps each whole point covers: 1 until ``max_points``
        steps were recorded, then 2, 4, 8..."""
        return self._stride

    def _column(self, key: str) -> list:
        self._flush()
        points = self._points if self._part is None else [*self._points, self._part]
        return list(map(attrgetter(_FIELDS[key]), points))

    # -- hooks -----------------------------------------------------------------
    def on_train_begin(self, metrics: Any, iteration: int, opt: Any) -> None:
        """Runs before training: takes the metric names of this fit."""
        names = getattr(opt, "names", None)  # a MultiOptimizer's parts
        self.lr_part = names[-1] if names else None
        self._flush()  # an interrupted fit's steps, before the device may change
        if iteration == 0:  # each fit smooths afresh, as the loop does
            self._smoother = LossSmoother()  # (a resumed one continues)
            if self._rows and self._rows[-1]["epoch"] == self._epochs_done:
                # The last fit stopped inside an epoch, after a validation
                # there: this fit's epochs are new ones.
                self._epochs_done += 1
        self.metric_names = list(getattr(metrics, "names", []))

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
            # The common cases inline: a batch of targets; an HPOptimizer's
            # (lr, mom) as floats, noted by its step (a scheduler may already
            # have set the next ones).
            yb = last_target
            if type(yb) is torch.Tensor and yb.ndim:
                size = yb.shape[0]
            else:
                size = batch_size(yb, last_input)
            hypers = getattr(opt, "stepped", None)
            if (
                hypers is None
                or type(hypers[0]) is not float
                or (hypers[1] is not None and type(hypers[1]) is not float)
            ):
                hypers = _hypers(opt)
            self._pending.append((hypers, last_loss, size))
            self._count += 1
            if len(self._pending) >= FLUSH_EVERY:  # bounded, also in endless epochs
                self._flush()

    def on_epoch_end(self, record: Record, mid_epoch: bool) -> None:
        """Runs after validation: keeps the epoch's record (no host transfer:
        the steps' losses wait until they are read, or ``FLUSH_EVERY``)."""
        row = {k: math.nan if v is None else v for k, v in record.items()}
        del row["lr"]  # per step in lrs
        row["epoch"] = self._epochs_done  # (counted across fits)
        if not mid_epoch:  # after a validation inside it, the epoch goes on
            self._epochs_done += 1
        self._rows.append(row)
        self.epoch_iterations.append(self._count - 1)

    def _flush(self, extra: Iterable = ()) -> list[float]:
        """Moves the pending steps into the points, with ``extra`` (one sync).

        Returns ``extra`` as floats.
        """
        steps, self._pending = self._pending, []
        values = to_floats([loss for _, loss, _ in steps], extra)
        losses, n = values[: len(steps)], len(steps)
        iteration = self._count - n
        smoothed = self._smoother(losses)
        if (
            self._stride == 1
            and self._part is None
            and len(self._points) + n <= self._max_points
        ):  # the common case: each step a whole point of its own
            self._points += [
                _Point(1, size, loss, lr, mom, smooth, i)
                for ((lr, mom), _, size), loss, smooth, i in zip(
                    steps, losses, smoothed, range(iteration, iteration + n)
                )
            ]
            return values[n:]
        for ((lr, mom), _, size), loss, smooth in zip(
            steps, losses, smoothed, strict=True
        ):
            part = self._part
            if part is None and len(self._points) >= self._max_points:
                self._merge_pairs()  # which may leave a partial point
                part = self._part
            if part is None:
                part = self._part = _Point(1, size, loss, lr, mom, smooth, iteration)
            else:  # added in place: no new object per step
                part.add(size, loss, lr, mom, smooth, iteration)
            if part.steps == self._stride:  # a whole point
                self._points.append(part)
                self._part = None
            iteration += 1
        return values[n:]

    def _merge_pairs(self) -> None:
        """Halves the points: each pair becomes one point of twice the steps."""
        points = self._points
        merged = [a.merged(b) for a, b in zip(points[::2], points[1::2], strict=False)]
        if len(points) % 2:  # the odd one out starts the new partial point
            last = points[-1]
            self._part = last if self._part is None else last.merged(self._part)
        self._points, self._stride = merged, self._stride * 2

    # -- saving ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """The history as plain python lists, numbers and strings: at most
        ``max_points`` per-step points, so its size is bounded."""
        self._flush()
        state = {
            key: list(map(attrgetter(field), self._points))
            for key, field in _FIELDS.items()
        }
        state |= {k: getattr(self, k) for k in _EPOCH_KEYS}  # new lists
        state["rows"] = [dict(row) for row in self._rows]
        state["metric_names"] = list(self.metric_names)
        state["epochs_done"] = self._epochs_done
        state["smoother"] = [self._smoother.avg, self._smoother.n]
        state["steps_per_point"] = self._stride
        state["partial"] = None if self._part is None else asdict(self._part)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restores the history that ``state_dict`` returned (also one saved
        before the budget existed: one point per step)."""
        _check_state(state)
        self.reset()
        stride = state.get("steps_per_point", 1)
        columns = [state[key] for key in _FIELDS]
        self._points = [
            _Point(stride, size, loss, lr, mom, smooth, it)
            for lr, mom, loss, smooth, it, size in zip(*columns, strict=True)
        ]
        if "steps_per_point" not in state:  # the older format: no budget yet
            for it, point in enumerate(self._points):
                point.iteration = it  # were always 0, 1, 2...
        else:
            partial = state["partial"]
            self._part = None if partial is None else _Point(**partial)
        self._stride = stride
        last = self._part or (self._points[-1] if self._points else None)
        self._count = 0 if last is None else last.iteration + 1
        # Copies: later fits append to them.
        self._rows = [dict(r) for r in state.get("rows") or _rows_of(state)]
        self.epoch_iterations = list(state["epoch_iterations"])
        self.metric_names = list(state["metric_names"])
        # (saved before validations inside epochs: each row ended its epoch)
        self._epochs_done = state.get("epochs_done", len(self._rows))
        if "smoother" in state:  # the moving average of the fit in progress
            self._smoother.avg, self._smoother.n = state["smoother"]
        while len(self._points) + (self._part is not None) > self.max_points:
            self._merge_pairs()  # saved with a larger budget than this one's

    # -- reading ---------------------------------------------------------------
    def epoch_table(self) -> list[dict]:
        """One dict per record (per epoch, or per validation inside one):
        epoch, train_loss, valid_loss, each metric, time.

        Each row has the metrics of its own epoch's fit, so rows of fits with
        different metrics have different keys.

        Examples:
            >>> history = learn.fit(1, lr=1e-3)
            >>> learn.recorder.epoch_table()[0]
            {'epoch': 0, 'train_loss': 1.15..., 'valid_loss': 1.16...,
             'accuracy': 0.3125, 'time': ...}
        """
        return [dict(row) for row in self._rows]

    # Plots follow matplotlib's convention (fitlib.plots): drawn into ``ax``
    # when given, else into a new pyplot figure, which a notebook shows once at
    # the end of the cell and a script on plt.show(). They return the Axes.
    def plot_losses(self, ax: Any = None) -> Any:
        """The training loss per step, raw (faint) and smoothed, and per epoch
        the mean training loss and the validation loss, at the epoch's end.

        The smoothed curve lags the raw one (a moving average over about 50
        steps); the epoch means are the train losses of ``epoch_table()``.

        Args:
            ax: the matplotlib Axes to draw into; None: a new pyplot figure.

        Returns:
            The Axes.
        """
        self._check_steps()
        steps = "raw" if self._stride == 1 else f"mean of {self._stride} steps"
        mean = "train (row mean)" if self._inside_epochs() else "train (epoch mean)"
        return plots.losses(
            ax,
            self.iterations,
            {f"train ({steps})": self.losses, "train (smoothed)": self.smooth_losses},
            self.epoch_iterations,
            {mean: self.train_losses, "valid": self.valid_losses},
        )

    def _inside_epochs(self) -> bool:
        """Whether an epoch has several rows (validations inside epochs)."""
        return len(set(self.epochs)) < len(self._rows)

    def plot_lr(self, show_moms: bool = False, ax: Any = None) -> Any:
        """The learning rate per step, and the momentum on a second panel.

        Args:
            show_moms: add the momentum panel.
            ax: the Axes to draw into (with ``show_moms``, a sequence of two);
                None: a new pyplot figure.

        Returns:
            The Axes, or a list of two with ``show_moms``.
        """
        self._check_steps()
        if show_moms and all(m is None for m in self.moms):
            raise ValueError(
                "plot_lr(show_moms=True): no momentum was recorded (the "
                "optimizer has neither betas nor momentum). Fix: show_moms=False."
            )
        part = "" if self.lr_part is None else f" (part {self.lr_part!r})"
        panels = {f"learning rate{part}": self.lrs}
        if show_moms:
            moms = [math.nan if m is None else m for m in self.moms]
            panels[f"momentum{part}"] = moms
        where = f"plot_lr(show_moms={show_moms})"
        return plots.per_step(ax, self.iterations, panels, where)

    def plot_metrics(self, ax: Any = None) -> Any:
        """One panel per metric, its value per epoch; a value of the training
        set or a loss part shares the panel of its name: ``train_accuracy``
        with ``accuracy``, ``train_ce`` with ``valid_ce``.

        A value that only some fits computed is NaN (a gap) in the other
        epochs. Panels follow the order in which the values first appeared.

        Args:
            ax: the Axes to draw into, a sequence of one per panel when there
                are several; None: a new pyplot figure.

        Returns:
            The Axes, or a list of them when there are several panels.
        """
        if not self.epochs:
            raise ValueError(f"no epoch has finished yet; {_NOT_FIT}.")
        names = list(dict.fromkeys(n for ns in self.epoch_metric_names for n in ns))
        if not names:
            raise ValueError(
                "no metrics were recorded. Fix: pass metrics=[...] to fit (or to "
                "the Learner)."
            )
        panels = plots.metric_panels(names, self._rows)
        if self._inside_epochs():  # several rows per epoch: at their steps
            x, label = self.epoch_iterations, "iteration"
        else:
            x, label = self.epochs, "epoch"
        return plots.per_epoch(ax, x, panels, "plot_metrics", xlabel=label)

    def plot_lr_find(
        self, skip_start: int = 5, skip_end: int = 5, ax: Any = None
    ) -> Any:
        """The smoothed loss against the learning rate of the last LR finder
        sweep (log scale), with every suggested learning rate marked.

        The first ``skip_start`` and last ``skip_end`` points are left out (a
        short sweep keeps at least half its points: both shrink in
        proportion), and the y-axis stops a little above the loss where the
        plotted curve starts, so the divergence at the end does not flatten
        the part that matters. A suggestion in a left-out part is marked,
        hollow, at the nearest plotted point.

        Args:
            skip_start: points to leave out at the start (an int >= 0).
            skip_end: points to leave out at the end (an int >= 0).
            ax: the Axes to draw into; None: a new pyplot figure.

        Returns:
            The Axes.
        """
        for name, value in (("skip_start", skip_start), ("skip_end", skip_end)):
            check_int(value, name, owner="Recorder.plot_lr_find", example=5)
        result = self.lr_find_result
        if not result or not result["lrs"]:
            raise ValueError(
                "no LR finder sweep to plot. Fix: run learn.lr_find() first (with "
                "fit and an LRFinder: recorder.lr_find_result = finder.result)."
            )
        return plots.lr_find(ax, result, skip_start, skip_end)

    def _check_steps(self) -> None:
        if not self._count:
            raise ValueError(f"no training step was recorded; {_NOT_FIT}.")


def _check_state(state: dict) -> None:
    """Refuses a state that ``Recorder.state_dict`` cannot have returned."""
    missing = sorted({*_FIELDS, *_EPOCH_KEYS, "metric_names"} - state.keys())
    if missing:
        raise ValueError(
            f"Recorder.load_state_dict: the state lacks {missing}. Fix: pass "
            "what Recorder.state_dict() returned."
        )
    for keys, what in ((_FIELDS, "step"), (_EPOCH_KEYS, "epoch")):
        lengths = {k: len(state[k]) for k in keys}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"Recorder.load_state_dict: the per-{what} lists differ in "
                f"length {lengths}; the state is truncated or corrupt."
            )
    stride, partial = state.get("steps_per_point", 1), state.get("partial")
    bad_partial = partial is not None and (
        not isinstance(partial, dict)
        or partial.keys() != set(_Point.__dataclass_fields__)
        or not 0 < partial["steps"] < stride
    )
    if (
        isinstance(stride, bool)
        or not isinstance(stride, int)
        or stride < 1
        or stride & (stride - 1)
        or bad_partial
    ):
        raise ValueError(
            f"Recorder.load_state_dict: steps_per_point={stride!r} with partial "
            f"point {partial!r} is not a state Recorder.state_dict() returns "
            "(a power of 2, and a partial point of fewer steps); the state is "
            "corrupt. Fix: pass what Recorder.state_dict() returned."
        )


def _rows_of(state: dict) -> list[Record]:
    """The rows of a state saved before the Recorder kept records."""
    rows = zip(
        state["epochs"],
        state["train_losses"],
        state["valid_losses"],
        state["metrics"],
        state["epoch_metric_names"],
        state["times"],
        strict=True,
    )
    return [
        {"epoch": e, "train_loss": t, "valid_loss": v}
        | dict(zip(names, m, strict=False))
        | {"time": s}
        for e, t, v, m, names, s in rows
    ]


def _hypers(opt: Any) -> tuple[float, float | None]:
    """The (lr, momentum) of the last parameter group's latest step."""
    # An HPOptimizer notes them in step(): a scheduler may already have set
    # the next ones. Anything else is read as it is now.
    lr, mom = getattr(opt, "stepped", None) or lr_and_momentum(opt.param_groups[-1])
    return (
        lr if type(lr) is float else float(lr),
        mom if mom is None or type(mom) is float else float(mom),
    )
