"""``TextLogger``: training progress as lines of Python ``logging``.

One line per epoch (its record: losses, metrics, added values, time) and, every
``every_n_steps`` optimizer steps, one line with the samples per second, the
learning rate and the mean loss since the previous line. Where the lines go
(console, file) is up to the handlers you configure on the logger.

Per batch the losses are only appended to lists (device tensors, no sync);
each line reads what it needs in one host transfer.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from fitlib.callback import Callback
from fitlib.errors import ArgTypeError
from fitlib.host_copy import to_floats
from fitlib.record import Record, step_lr
from fitlib.running_loss import RunningLoss, batch_size
from fitlib.tracking import TrainClock, check_every_n_steps, check_state_keys

_STATE_KEYS = ("line_step", "interval", "seconds")
# What a TextLogger saved before the epoch record kept the epoch's sums.
_OLD_STATE_KEYS = (*_STATE_KEYS, "epoch", "epoch_loss", "epoch_seconds")


class TextLogger(Callback):
    """Logs a line per epoch, and a line every ``every_n_steps`` optimizer steps.

    The epoch line: the epoch's record, i.e. epoch, train_loss (the
    sample-weighted mean of the epoch's training losses), valid_loss, each
    metric and each value added to the record (``n/a`` when not computed,
    e.g. validation skipped), and the epoch's seconds. The step line (at steps that are
    multiples of ``every_n_steps``, state key ``step``): the step, the epoch,
    the mean training loss per sample since the previous step line, the lr of
    the last parameter group used by the latest step, and samples per second
    of training since the previous line (validation time left out; every
    training batch counts, also those of an accumulation that did not step).

    Nothing is read per batch; each line costs one host transfer, and none at
    all when the logger is not enabled for ``level``. The counters restart at
    each fit; after a resume (``iteration > 0``) they continue from
    ``load_state_dict``, so the lines equal those of a run that never stopped
    (times aside); lines logged between the checkpoint and a crash are logged
    again, since a log cannot be taken back.

    Args:
        logger: a ``logging.Logger`` or the name of one. Configure its
            handlers (e.g. ``logging.basicConfig(level=logging.INFO)``).
        every_n_steps: optimizer steps between step lines (None: epoch lines
            only).
        level: the logging level of the lines (an int, or a name like "INFO").

    Examples:
        >>> import logging, sys
        >>> log = logging.getLogger("train")
        >>> handler = logging.StreamHandler(sys.stdout)
        >>> log.addHandler(handler); log.setLevel(logging.INFO)
        >>> history = fit(2, model, F.cross_entropy, opt, data,
        ...               callbacks=[TextLogger(log, every_n_steps=2)])
        step 2 (epoch 0): loss 1.1..., lr 1.000e-01, ... samples/s
        step 4 (epoch 0): loss 1.0..., lr 1.000e-01, ... samples/s
        epoch 0: train_loss 1.12... valid_loss 1.09... time ...s
        step 6 (epoch 1): loss 0.99..., lr 1.000e-01, ... samples/s
        step 8 (epoch 1): loss 1.07..., lr 1.000e-01, ... samples/s
        epoch 1: train_loss 1.03... valid_loss 1.05... time ...s
        >>> log.removeHandler(handler)
    """

    order = 55  # after the callbacks that change training, and the Recorder
    in_lr_find = False  # a sweep is not part of the run it records
    main_only = True  # under torch.distributed, rank 0 alone

    def __init__(
        self,
        logger: str | logging.Logger = "fitlib",
        every_n_steps: int | None = 100,
        level: int | str = logging.INFO,
    ) -> None:
        self.logger = _as_logger(logger)
        self.every_n_steps = check_every_n_steps(every_n_steps, "TextLogger", True)
        self.level = _as_level(level)
        self._reset()

    def _reset(self) -> None:
        self._interval = RunningLoss()
        self._clock = TrainClock()
        self._line_step = 0  # the step of the latest step line

    # -- hooks -----------------------------------------------------------------
    def on_train_begin(self, iteration: int) -> None:
        """Runs before training: starts afresh, unless the fit is resumed."""
        if iteration == 0:
            self._reset()

    def on_epoch_begin(self) -> None:
        """Runs at each epoch's start: the training clock runs."""
        self._clock.resume()

    def on_batch_end(
        self,
        train: bool,
        step: int,
        epoch: int,
        opt: Any,
        last_loss: torch.Tensor,
        last_target: Any,
        last_input: Any,
    ) -> None:
        """Runs after each batch: keeps the loss; logs at every n-th step."""
        if not train:
            self._clock.pause()  # validation is not training time
            return
        if self.every_n_steps is None:
            return  # epoch lines only: they read the record
        self._interval.add(last_loss, batch_size(last_target, last_input))
        n = self.every_n_steps
        if n and step % n == 0 and step > self._line_step:
            self._log_steps(step, epoch, opt)

    def on_epoch_end(self, record: Record, mid_epoch: bool) -> None:
        """Runs after validation: logs the record as a line; after a
        validation inside the epoch, training time counts again."""
        self._clock.pause()
        if self.logger.isEnabledFor(self.level):
            self.logger.log(self.level, _epoch_line(record))
        if mid_epoch:
            self._clock.resume()

    # -- lines -----------------------------------------------------------------
    def _log_steps(self, step: int, epoch: int, opt: Any) -> None:
        interval, self._interval = self._interval, RunningLoss()
        self._line_step = step
        if not self.logger.isEnabledFor(self.level):
            self._clock.lap()
            return
        loss = interval.mean(to_floats(interval.pending()))
        seconds = self._clock.lap()  # after the transfer: the device is done
        speed = interval.samples / seconds if seconds > 0 else math.nan
        self.logger.log(
            self.level,
            f"step {step} (epoch {epoch}): loss {loss:.6g}, lr {step_lr(opt):.3e}, "
            f"{speed:.1f} samples/s",
        )

    # -- saving ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """The step counter and the sums since the last step line (one sync)."""
        return {
            "line_step": self._line_step,
            "interval": self._interval.state_dict(),
            "seconds": self._clock.elapsed(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict``: the next lines continue those sums."""
        if not (isinstance(state, dict) and set(state) == set(_OLD_STATE_KEYS)):
            check_state_keys(state, _STATE_KEYS, "TextLogger")
        self._reset()
        self._line_step = int(state["line_step"])
        self._interval.load_state_dict(state["interval"])
        self._clock.reset(state["seconds"])
        self._clock.pause()  # until the resumed epoch begins

    def __repr__(self) -> str:
        return (
            f"{self.name}(logger={self.logger.name!r}, "
            f"every_n_steps={self.every_n_steps}, "
            f"level={logging.getLevelName(self.level)})"
        )


def _epoch_line(record: Record) -> str:
    """``epoch 0: train_loss 0.871234 valid_loss 0.734512 ... time 0.41s``."""
    cells = [
        f"{name} {'n/a' if v is None else format(v, '.6g')}"
        for name, v in record.items()
        if name not in ("epoch", "step", "lr", "time")
    ]
    where = f"epoch {record['epoch']}"
    if "step" in record:  # records inside epochs (ValidationSchedule)
        where += f" step {record['step']}"
    return f"{where}: {' '.join(cells)} time {record['time']:.2f}s"


def _as_logger(logger: Any) -> logging.Logger:
    if isinstance(logger, logging.Logger):
        return logger
    if not isinstance(logger, str):
        raise ArgTypeError(
            f"TextLogger: logger must be a logging.Logger or a logger's name (a "
            f"str); got {logger!r} ({type(logger).__name__}). Fix: e.g. "
            "TextLogger('fitlib') or TextLogger(logging.getLogger(__name__))."
        )
    if not logger.strip():  # '' would quietly be the root logger
        raise ValueError(
            f"TextLogger: logger must be a logger's name, not empty or blank; got "
            f"{logger!r} (str). Fix: e.g. TextLogger('fitlib'), or "
            "TextLogger('root') for the root logger."
        )
    return logging.getLogger(logger)


def _as_level(level: Any) -> int:
    if isinstance(level, str):
        number = logging.getLevelName(level.upper())  # an int for known names
        if isinstance(number, int):
            return number
    elif isinstance(level, int) and not isinstance(level, bool) and level >= 0:
        return level
    raise ValueError(
        f"TextLogger: level must be a logging level (an int >= 0 or a name "
        f"like 'INFO'); got {level!r}. Fix: e.g. level=logging.INFO."
    )
