"""``TensorBoardLogger``: scalars and hyper-parameters of a run, for TensorBoard.

Per training batch it appends the detached loss to a list (no device op, no
sync); the losses reach Python in one transfer every ``every_n_steps`` steps.
At epoch end it writes the epoch's record (``state["record"]``, already read)
under ``epoch/``. Every point is written at a global step, the optimizer steps
since the logger's first fit: epoch and step charts share one x-axis, and a
resumed run writes each step once (see ``TensorBoardLogger``).
"""

from __future__ import annotations

import copy
import os
import re
import time
from typing import Any

import torch

from fitlib.callback import Callback
from fitlib.checks import check_int, check_path
from fitlib.record import Record
from fitlib.running_loss import batch_size
from fitlib.tracking import last_lr as _last_lr
from fitlib.tracking import optimizer_params, read_into

_HPARAM_TYPES = (bool, int, float, str)
_NOT_METRICS = ("epoch", "step", "lr", "time")
# What a resumed fit needs; each is the attribute "_" + key.
_STATE_KEYS = (
    "base", "epoch_base", "last_point", "interval", "peak_lr", "batch_size",
    "auto_hparams", "tags",
)  # fmt: skip


class TensorBoardLogger(Callback):
    """Writes per-epoch and per-step scalars and the run's hyper-parameters.

    Tags, at the global step: ``epoch/epoch``, ``epoch/train_loss`` (sample-
    weighted), ``epoch/valid_loss`` and ``epoch/<metric>`` (none when
    validation is skipped), ``epoch/lr``, ``epoch/time`` (seconds; a resumed
    epoch counts from the resume) where an epoch ends; ``step/loss`` (mean of
    the batches since the last point) and ``step/lr`` every ``every_n_steps``
    steps and at a clean end. The lr is the last parameter group's.

    After a fit without error, the HParams tab gets ``lr`` (the largest any
    step used: a schedule's peak), ``mom`` and ``wd`` (as the fit began),
    ``batch_size``, ``epochs``, ``max_steps``, ``optimizer``, ``model`` and
    ``hparams``, with the losses and metrics as its metrics (their last
    values). TensorBoard keeps the first hyper-parameters of a ``log_dir``.

    A resumed fit (``iteration > 0`` at ``on_train_begin``) opens its writer
    with ``purge_step`` one past the step it resumes from: TensorBoard hides
    what the interrupted process wrote after its checkpoint (the files stay)
    and shows the resumed run's points instead, one per step as in an
    uninterrupted run. A new run in a used ``log_dir`` hides the old one's
    points the same way: use one ``log_dir`` per run. Further fits with the
    same logger continue its step and epoch count.

    Args:
        log_dir: the run's directory (created if missing).
        every_n_steps: optimizer steps between two ``step/`` points (>= 1).
        hparams: more hyper-parameters (bool, int, float or str values); they
            override the automatic ones of the same name.

    Examples:
        >>> import os
        >>> tb = TensorBoardLogger("runs/exp1", hparams={"dropout": 0.3})
        >>> fit(5, model, F.cross_entropy, opt, data, callbacks=[tb])
        History(5 epochs: train_loss ... -> ..., valid_loss ... -> ...)
        >>> os.listdir("runs/exp1")
        ['events.out.tfevents...']

        Then ``tensorboard --logdir runs`` shows them.
    """

    order = 55
    in_lr_find = False  # a sweep is not part of the run it records
    main_only = True  # under torch.distributed, rank 0 alone

    def __init__(
        self,
        log_dir: str | os.PathLike,
        every_n_steps: int = 50,
        hparams: dict | None = None,
    ) -> None:
        self.log_dir = _check_log_dir(log_dir)
        self.every_n_steps = check_int(
            every_n_steps, "every_n_steps", minimum=1, owner=self.name, example=50
        )
        self.hparams = _check_hparams(hparams)
        # Imported now: a missing package fails before training starts.
        self._writer_cls, self._hparams_summaries = _tensorboard()
        self.writer: Any = None
        self._done = (0, 0)  # global (step, epoch) reached by the previous fits
        self._reset(0, 0)

    def _reset(self, base: int, epoch_base: int) -> None:
        """Starts a fit at global step ``base`` and epoch ``epoch_base``."""
        self._base, self._epoch_base = base, epoch_base
        self._last_point = base  # global step of the latest step/ point
        # Losses not yet read: (device tensor, batch size) per training batch.
        self._unread: list[tuple[torch.Tensor, int]] = []
        self._interval = [0.0, 0]  # weighted loss sum and samples since the point
        self._peak_lr: float | None = None
        self._batch_size: int | None = None
        self._auto_hparams: dict = {}
        self._tags: list[str] = []  # epoch/ tags written: the HParams metrics
        self._trained = False  # an epoch ended in this fit

    # -- hooks -----------------------------------------------------------------
    def on_train_begin(
        self,
        iteration: int,
        step: int,
        epoch: int,
        n_epochs: int | None,
        max_steps: int | None,
        model: Any,
        opt: Any,
        metrics: Any,
    ) -> None:
        """Runs before training: opens the writer (a resumed fit purges)."""
        if self.writer is not None:  # hooks driven by hand, without on_train_end
            self.writer.close()
        if iteration == 0:
            self._reset(*self._done)
        else:  # resumed: keep what load_state_dict restored, if it belongs here
            self._drop_finished(self._base + step)
        if not self._auto_hparams:
            self._auto_hparams = _auto_hparams(model, opt, n_epochs, max_steps)
        lr = _last_lr(opt)
        if self._peak_lr is None and type(lr) is float:
            self._peak_lr = lr
        self._trained = False
        self.writer = self._open_writer(purge_step=self._base + step + 1)

    def on_batch_end(
        self,
        train: bool,
        step: int,
        opt: Any,
        last_loss: torch.Tensor,
        last_target: Any,
        last_input: Any,
    ) -> None:
        """Runs after each batch: keeps a training loss, writes at the interval."""
        if not train:
            return
        size = batch_size(last_target, last_input)
        self._unread.append((last_loss, size))  # detached by the loop
        if self._batch_size is None:
            self._batch_size = size
        lr = _last_lr(opt)
        if type(lr) is float and (self._peak_lr is None or lr > self._peak_lr):
            self._peak_lr = lr
        now = self._base + step
        if now % self.every_n_steps == 0 and now > self._last_point:
            self._write_point(now, lr)

    def on_epoch_end(self, epoch: int, step: int, record: Record) -> None:
        """Runs after validation: writes the epoch's record as scalars (the
        values not computed, None, are left out)."""
        scalars = {"epoch": self._epoch_base + epoch}
        # (a record's step, inside epochs, is the x axis: not a scalar)
        skip = ("epoch", "step")
        scalars |= {k: v for k, v in record.items() if k not in skip and v is not None}
        for name, value in scalars.items():
            self.writer.add_scalar(f"epoch/{name}", value, self._base + step)
        # The HParams tab's metrics: the losses and metrics, not epoch/lr/time.
        self._tags += [f"epoch/{k}" for k in scalars if k not in _NOT_METRICS]
        self._tags = list(dict.fromkeys(self._tags))
        self._trained = True
        self.writer.flush()

    def on_train_end(
        self,
        exception: BaseException | None,
        step: int,
        epoch: int,
        opt: Any,
        mid_epoch: bool,
    ) -> None:
        """Runs at the end, also after an error: writes the hparams, closes."""
        if self.writer is None:  # on_train_begin did not get to open it
            return
        now = self._base + step
        try:
            # After an error the device may be broken: read nothing from it.
            if exception is None and self._trained:
                if now > self._last_point and (self._unread or self._interval[1]):
                    self._write_point(now, _last_lr(opt))
                self._write_hparams(now)
        finally:
            self.writer.close()
            self.writer = None
            # Stopped after a validation inside an epoch: that epoch is done
            # with, for the numbers of the next fit's epochs.
            self._done = (now, self._epoch_base + epoch + mid_epoch)

    # -- writing ---------------------------------------------------------------
    def _open_writer(self, purge_step: int) -> Any:
        try:
            os.makedirs(self.log_dir, exist_ok=True)
            if not os.access(self.log_dir, os.W_OK):
                raise PermissionError("no write permission")
        except OSError as e:
            raise ValueError(
                f"log_dir {self.log_dir!r} cannot be written to ({e}). Fix: pass "
                "a directory you can write to, or create it first."
            ) from e
        _after_the_newest_event_file(self.log_dir)
        return self._writer_cls(self.log_dir, purge_step=purge_step)

    def _read(self) -> None:
        """Moves the unread losses into the interval's sums (one transfer)."""
        read_into(self._interval, self._unread)

    def _write_point(self, now: int, lr: Any) -> None:
        self._read()
        total, n = self._interval
        if n:
            self.writer.add_scalar("step/loss", total / n, now)
        lr = float(lr)  # a python float already, unless a tensor lr
        self.writer.add_scalar("step/lr", lr, now)
        self._peak_lr = lr if self._peak_lr is None else max(self._peak_lr, lr)
        self._interval, self._last_point = [0.0, 0], now

    def _write_hparams(self, now: int) -> None:
        values = {"lr": self._peak_lr, "batch_size": self._batch_size}
        values = {**self._auto_hparams, **values, **self.hparams}
        values = {k: v for k, v in values.items() if v is not None}
        # The metrics' values are the run's latest epoch/ scalars of those tags.
        summaries = self._hparams_summaries(values, dict.fromkeys(self._tags, 0.0))
        for summary in summaries:
            self.writer.file_writer.add_summary(summary, now)

    def _drop_finished(self, now: int) -> None:
        """Keeps, of a restored state, only the sums of the interval in
        progress: a checkpoint may be taken before this logger's hooks of its
        batch ran, and the interrupted run then wrote them."""
        if now % self.every_n_steps == 0:
            self._interval = [0.0, 0]
        self._last_point = max(self._last_point, now - now % self.every_n_steps)

    # -- saving ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a resumed fit needs, as plain python values (reads the device)."""
        self._read()  # the unread losses become part of the sums: one transfer
        return {k: copy.copy(getattr(self, f"_{k}")) for k in _STATE_KEYS}

    def load_state_dict(self, state: dict) -> None:
        """Restores what ``state_dict`` returned."""
        missing = sorted(set(_STATE_KEYS) - state.keys())
        if missing:
            raise ValueError(
                f"TensorBoardLogger.load_state_dict: the state lacks {missing}. "
                "Fix: pass what TensorBoardLogger.state_dict() returned."
            )
        self._reset(state["base"], state["epoch_base"])
        # Copies: the fit goes on changing them (an older state's epoch sums are
        # left out: the loop keeps those now).
        for key in _STATE_KEYS:
            setattr(self, f"_{key}", copy.copy(state[key]))

    def __repr__(self) -> str:
        return (
            f"{self.name}(log_dir={self.log_dir!r}, every_n_steps={self.every_n_steps})"
        )


def _auto_hparams(
    model: Any, opt: Any, n_epochs: int | None, max_steps: int | None
) -> dict:
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    values = {
        "epochs": n_epochs,
        "max_steps": max_steps,
        "model": type(model).__name__,
    }
    return {**values, **optimizer_params(opt, ("mom", "wd"))}


def _check_log_dir(log_dir: Any) -> str:
    owner, where, fix = "TensorBoardLogger", "a directory path", "'runs/exp1'"
    path = str(check_path(log_dir, "log_dir", owner=owner, what=where, example=fix))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(
            f"TensorBoardLogger: log_dir {path!r} exists and is not a directory. "
            "Fix: pass a directory path (one per run), e.g. 'runs/exp1'."
        )
    return path


def _check_hparams(hparams: Any) -> dict:
    if hparams is None:
        return {}
    if not isinstance(hparams, dict) or not all(
        isinstance(k, str) and isinstance(v, _HPARAM_TYPES) for k, v in hparams.items()
    ):
        raise TypeError(
            f"hparams must be a dict of str names to bool, int, float or str "
            f"values; got {hparams!r}. Fix: e.g. hparams={{'dropout': 0.3}}."
        )
    return dict(hparams)


def _tensorboard() -> tuple[Any, Any]:
    """torch's ``SummaryWriter`` and its ``hparams`` summaries builder."""
    # Imported when a logger is made: tensorboard is an optional extra, and
    # importing it costs time that `import fitlib` should not pay.
    try:
        from torch.utils.tensorboard import SummaryWriter, summary
    except ImportError as e:
        raise ImportError(
            "TensorBoardLogger needs the tensorboard package. Fix: pip install "
            "fitlib[tensorboard] (or pip install tensorboard)."
        ) from e
    return SummaryWriter, summary.hparams


_EVENT_FILE = re.compile(r"events\.out\.tfevents\.(\d+)\.")


def _after_the_newest_event_file(log_dir: str) -> None:
    """Waits, when needed, so that the next event file sorts after the others.

    TensorBoard reads a directory's event files in name order and skips one
    that sorts before the file it has read. A name is
    ``events.out.tfevents.<second>.<host>.<pid>.<counter>``, and two files
    of one second sort by their counter as text (".10" before ".9"): a
    second fit in the same second could go unread, silently. Starting the
    next file in a later second keeps the names in order (a wait under a
    second, only for fits that start within a second of the last).
    """
    stamps = [int(m.group(1)) for m in map(_EVENT_FILE.match, os.listdir(log_dir)) if m]
    if stamps and max(stamps) >= int(time.time()):
        time.sleep(max(0.0, max(stamps) + 1 - time.time()))
