"""``ProgressBar``: fastprogress bars over epochs and batches, and a results table.

Per batch it appends the loss to a list and compares the clock: the smoothed
loss is read (a host-device sync) only when the bar is redrawn, at most every
``refresh`` seconds of wall-clock time, and once at the end of each training
loader. The table's values reach Python in one transfer per epoch.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import torch

from fitlib.callback import Callback
from fitlib.callbacks.tracking import RunningLoss
from fitlib.core import batch_size, len_or_none, to_floats

_NA = "#na#"


class ProgressBar(Callback):
    """A master bar over epochs, a child bar per loader, a table per epoch.

    Works in notebooks and consoles (fastprogress picks which). The child
    bar's comment is the smoothed training loss. ``rows`` holds the table the
    last fit wrote, header first, as strings; each fit writes its own table.

    Args:
        refresh: the least number of seconds between two redraws of a bar.
        bars: draw bars (True), only the table (False), or decide (None):
            bars in a notebook or a terminal, the table alone in a log.

    Example:
        >>> fit(2, model, F.cross_entropy, opt, data, callbacks=[ProgressBar()])
        epoch     train_loss  valid_loss  time
        0         0.912345    0.723456    00:01
        1         0.701234    0.654321    00:01
    """

    order = 60
    main_only = True  # under torch.distributed, rank 0 alone

    def __init__(self, refresh: float = 0.25, bars: bool | None = None) -> None:
        if (
            isinstance(refresh, bool)
            or not isinstance(refresh, (int, float))
            or not refresh >= 0
        ):
            raise ValueError(
                f"refresh must be a number of seconds >= 0; got {refresh!r}. "
                "Fix: e.g. ProgressBar(refresh=0.25)."
            )
        self.refresh, self.bars = float(refresh), bars
        self.rows: list[list[str]] = []
        self.mb: Any = None  # the master bar of the current (or last) fit
        self.pb: Any = None  # the child bar of the loader in progress
        self._mb_open = False

    # -- hooks -----------------------------------------------------------------
    def on_train_begin(
        self,
        n_epochs: int | None,
        n_steps: int | None,
        data: Any,
        epoch: int,
        metrics: Any,
    ) -> None:
        """Runs before training: opens the master bar, writes the header."""
        self.rows, self.pb, self._phase = [], None, None
        self._names = list(getattr(metrics, "names", []))
        # Bounded by steps (n_epochs None): the epochs those steps take at least.
        batches = len_or_none(getattr(data, "train_dl", None))
        if n_epochs is None:
            n_epochs = math.ceil(n_steps / batches) if n_steps and batches else 1
        self._n_epochs = n_epochs
        self.mb = _master_bar(n_epochs, self.bars)
        # Redraws are paced here (per epoch, or by `refresh`): fastprogress's
        # own pacing by item count would drop some of them.
        self.mb.main_bar.update_every = 0
        self.mb.update(0)  # starts fastprogress's clock and shows the bar
        if epoch:  # a resumed run starts part way
            self.mb.update(epoch)
        self._mb_open = epoch < n_epochs
        self._last_draw, self._comment = -math.inf, ""
        self._write(["epoch", "train_loss", "valid_loss", *self._names, "time"])

    def on_epoch_begin(self) -> None:
        """Runs at the start of each epoch: starts its clock and loss sums."""
        self._t0 = time.perf_counter()
        self._loss = RunningLoss()  # summed on the device: no sync per batch
        self._smooth: torch.Tensor | None = None

    def on_batch_end(
        self,
        train: bool,
        data: Any,
        last_loss: torch.Tensor,
        smooth_loss: torch.Tensor | None,
        last_target: Any,
        last_input: Any,
    ) -> None:
        """Runs after each batch: keeps the loss, redraws when time is up."""
        if train is not self._phase:
            # Opened here rather than in on_batch_begin: each hook a callback
            # overrides costs a call per batch.
            self._open_bar(train, data)
        self._n += 1
        if train:
            self._loss.add(last_loss, batch_size(last_target, last_input))
            self._smooth = smooth_loss
        now = time.perf_counter()
        if now - self._last_draw >= self.refresh:
            self._draw(now)

    def on_epoch_end(self, epoch: int, last_metrics: list | None) -> None:
        """Runs after validation: closes the child bar, writes the epoch's row."""
        self._close_bar()
        self._write(self._row(epoch, last_metrics))
        self.mb.update(min(epoch + 1, self._n_epochs))
        self._mb_open = epoch + 1 < self._n_epochs

    def on_train_end(self, exception: BaseException | None) -> None:
        """Runs at the end, also after an error: closes whatever bar is open."""
        if exception is None:
            self._close_bar()
        elif self.pb is not None:
            self.pb.on_interrupt()  # no tensor read here: the device may be broken
            self.pb = None
        if self._mb_open:
            if exception is not None:
                self.mb.main_bar.on_interrupt()
            else:  # stopped early (e.g. stop_training): fastprogress would wait
                self.mb.main_bar.on_iter_end()
            self._mb_open = False

    # -- bars and rows ---------------------------------------------------------
    def _open_bar(self, train: bool, data: Any) -> None:
        self._close_bar()
        total = len_or_none(getattr(data, "train_dl" if train else "valid_dl", None))
        self.pb = self.mb.progress(None, total="noinfer" if total is None else total)
        self.pb.update_every = 0  # paced by `refresh` instead (see on_train_begin)
        self.pb.comment = self._comment if train else ""
        self._phase, self._n, self._drawn = train, 0, 0
        self.pb.update(0)

    def _draw(self, now: float) -> None:
        self._last_draw = now
        if self._phase and self._smooth is not None:
            self._comment = f"smooth loss {float(self._smooth):.4f}"
            self.pb.comment = self._comment
        self.pb.update(self._n)
        self._drawn = self._n

    def _close_bar(self) -> None:
        """Draws the child bar's last state; a full bar closes itself."""
        if self.pb is None:
            return
        if self.pb.total is None or self._drawn != self._n:
            self.pb.total = self._n if self.pb.total is None else self.pb.total
            self._draw(time.perf_counter())
        if self._n < self.pb.total:  # stopped early: fastprogress would wait
            self.pb.on_iter_end()
        self.pb, self._phase = None, None

    def _row(self, epoch: int, last_metrics: list | None) -> list[str]:
        sums = self._loss.pending()
        values = to_floats(sums, last_metrics or [])
        n = len(sums)
        train = _fmt(self._loss.mean(values[:n])) if n else _NA
        rest = [_fmt(v) for v in values[n:]]
        if last_metrics is None:
            rest = [_NA] * (1 + len(self._names))
        elapsed = _fastprogress().format_time(time.perf_counter() - self._t0)
        return [str(epoch), train, *rest, elapsed]

    def _write(self, row: list[str]) -> None:
        self.rows.append(row)
        self.mb.write(row, table=True)


def _master_bar(n_epochs: int, bars: bool | None) -> Any:
    fp = _fastprogress()
    if bars is None:
        bars = fp.IN_NOTEBOOK or sys.stdout.isatty()
    if bars:
        return fp.master_bar(range(n_epochs))
    return _TableOnly()


class _NoBar:
    """A bar that draws nothing; it keeps what ProgressBar reads and sets."""

    def __init__(self, total: Any = None) -> None:
        self.total = None if total == "noinfer" else total
        self.comment, self.update_every = "", 0

    def update(self, val: int | None = None) -> None:
        pass

    on_iter_end = on_interrupt = update


class _TableOnly:
    """Stands in for the master bar when stdout is no terminal (a log, CI).

    fastprogress 1.1 draws bars there anyway (its tty test is always true);
    a log needs only the table, aligned as fastprogress aligns it.
    """

    def __init__(self) -> None:
        self.main_bar, self.widths = _NoBar(), None

    def update(self, val: int | None = None) -> None:
        pass

    def progress(self, gen: Any, total: Any = None) -> _NoBar:
        return _NoBar(total)

    def write(self, row: list[str], table: bool = True) -> None:
        if self.widths is None:
            self.widths = [max(len(name), 8) for name in row]
        print("  ".join(v.ljust(w) for v, w in zip(row, self.widths)).rstrip())


def _fastprogress() -> Any:
    # Imported when a fit starts: fastprogress pulls in fasthtml (~0.5 s), a
    # cost `import fitlib` should not pay.
    from fastprogress import fastprogress

    return fastprogress


def _fmt(value: float) -> str:
    return f"{value:.6f}"
