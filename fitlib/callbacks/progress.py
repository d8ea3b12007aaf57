"""``ProgressBar``: fastprogress bars over epochs and batches, and a results table.

Per batch it compares the clock: the smoothed loss is read only when a bar is
redrawn, at most every ``refresh`` seconds of wall-clock time, and once at the
end of each training loader. On CUDA it reads it without a host-device sync:
each redraw starts a copy to the host (``HostCopy``) and shows the last one
that has arrived; only the end of a loader waits for one. The table's rows are
the epochs' records (``state["record"]``), already read.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from fitlib.bars import check_refresh, loss_comment, master_bar
from fitlib.callback import Callback
from fitlib.checks import len_or_none
from fitlib.history import cell
from fitlib.host_copy import HostCopy
from fitlib.record import Record


class ProgressBar(Callback):
    """A master bar over epochs, a child bar per loader, a table per epoch.

    Works in notebooks and consoles (fastprogress picks which). The child
    bar's comment is the smoothed training loss. The table has a column per
    value of the epoch record but ``lr``: its header is written with the
    first row. ``rows`` holds the table the last fit wrote, header first, as
    strings; each fit writes its own table.

    Args:
        refresh: the least number of seconds between two redraws of a bar.
        bars: draw bars (True), only the table (False), or decide (None):
            bars in a notebook or a terminal, the table alone in a log.

    Examples:
        Where output is not a notebook or a terminal (a log, as here), the
        table alone:

        >>> history = fit(2, model, F.cross_entropy, opt, data,
        ...               callbacks=[ProgressBar()])
        epoch     train_loss  valid_loss  time
        0         1.12...     1.09...     ...
        1         1.03...     1.05...     ...
    """

    order = 60
    main_only = True  # under torch.distributed, rank 0 alone

    def __init__(self, refresh: float = 0.25, bars: bool | None = None) -> None:
        self.refresh, self.bars = check_refresh(refresh, "ProgressBar"), bars
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
    ) -> None:
        """Runs before training: opens the master bar."""
        self.rows, self.pb, self._phase = [], None, None
        # Bounded by steps (n_epochs None): the epochs those steps take at least.
        batches = len_or_none(getattr(data, "train_dl", None))
        if n_epochs is None:
            n_epochs = math.ceil(n_steps / batches) if n_steps and batches else 1
        self._n_epochs = n_epochs
        self.mb = master_bar(n_epochs, self.bars)
        # Redraws are paced here (per epoch, or by `refresh`): fastprogress's
        # own pacing by item count would drop some of them.
        self.mb.main_bar.update_every = 0
        self.mb.update(0)  # starts fastprogress's clock and shows the bar
        if epoch:  # a resumed run starts part way
            self.mb.update(epoch)
        self._mb_open = epoch < n_epochs
        self._last_draw, self._comment, self._copy = -math.inf, "", None

    def on_epoch_begin(self) -> None:
        """Runs at the start of each epoch."""
        self._smooth: torch.Tensor | None = None
        self._copy: HostCopy | None = None  # the copy of a redraw, not yet shown
        self._trained = 0.0  # seconds the epoch's training bars ran

    def on_batch_end(
        self,
        train: bool,
        data: Any,
        smooth_loss: torch.Tensor | None,
        num_batch: int,
    ) -> None:
        """Runs after each batch: redraws when time is up."""
        if train is not self._phase:
            # Opened here rather than in on_batch_begin: each hook a callback
            # overrides costs a call per batch. A training bar opened after a
            # validation inside the epoch (or in a resumed epoch) starts where
            # the epoch's training is.
            self._open_bar(train, data, num_batch if train else 0)
        self._n += 1
        if train:
            self._smooth = smooth_loss
        now = time.perf_counter()
        if now - self._last_draw >= self.refresh:
            self._draw(now)

    def on_epoch_end(self, epoch: int, record: Record, mid_epoch: bool) -> None:
        """Runs after validation: closes the child bar, writes the record's row
        (the first with the header); the epoch bar moves at an epoch's end."""
        self._close_bar()
        columns = [k for k in record if k != "lr"]
        if not self.rows:
            self._write(columns)
        self._write([cell(k, record[k]) for k in columns])
        if mid_epoch:  # a validation inside the epoch: its training goes on
            return
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
    def _open_bar(self, train: bool, data: Any, done: int = 0) -> None:
        self._close_bar()
        total = len_or_none(getattr(data, "train_dl" if train else "valid_dl", None))
        self.pb = self.mb.progress(None, total="noinfer" if total is None else total)
        self.pb.update_every = 0  # paced by `refresh` instead (see on_train_begin)
        self.pb.comment = self._comment if train else ""
        self._phase, self._n, self._drawn = train, done, done
        self.pb.update(0)
        if done:  # the rate and the time left: over the epoch's training so far
            if hasattr(self.pb, "start_t"):  # (fastprogress's clock)
                self.pb.start_t -= self._trained
            self.pb.update(done)

    def _draw(self, now: float, last: bool = False) -> None:
        self._last_draw = now
        if self._phase and self._smooth is not None:
            copy = HostCopy([self._smooth])
            if last or copy.ready():  # the end of a loader; or not on CUDA
                self._copy, shown = None, copy
            else:  # shows the copy of an earlier redraw if it has arrived
                shown = self._copy if self._copy and self._copy.ready() else None
                self._copy = copy
            if shown is not None:
                self._comment = loss_comment(shown.get()[0])
            self.pb.comment = self._comment
        self.pb.update(self._n)
        self._drawn = self._n

    def _close_bar(self) -> None:
        """Draws the child bar's last state; a full bar closes itself."""
        if self.pb is None:
            return
        if self.pb.total is None or self._drawn != self._n or self._copy:
            self.pb.total = self._n if self.pb.total is None else self.pb.total
            self._draw(time.perf_counter(), last=True)
        if self._phase and hasattr(self.pb, "start_t"):  # fastprogress's clock
            self._trained = time.time() - self.pb.start_t
        if self._n < self.pb.total:  # stopped early: fastprogress would wait
            self.pb.on_iter_end()
        self.pb, self._phase = None, None

    def _write(self, row: list[str]) -> None:
        self.rows.append(row)
        self.mb.write(row, table=True)
