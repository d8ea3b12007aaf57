"""``SweepBar``: one bar over an LR finder's sweep, paced like ``ProgressBar``'s
(the smoothed loss read at a redraw, at most every ``refresh`` seconds)."""

from __future__ import annotations

import math
import time
from typing import Any

from fitlib.bars import (
    NoBar,
    check_refresh,
    draws_bars,
    fastprogress_module,
    loss_comment,
)
from fitlib.callback import Callback
from fitlib.checks import check_int


class SweepBar(Callback):
    """One bar over an LR finder's sweep: its optimizer steps, with the
    smoothed loss as comment, and no table. ``Learner.lr_find`` shows it.

    A sweep that stops early (at the divergence) closes its bar there.

    Args:
        total: the optimizer steps of the sweep (the finder's ``num_it``).
        refresh: the least number of seconds between two redraws of the bar.
        bars: draw the bar (True), nothing (False), or decide (None): the bar
            in a notebook or a terminal, nothing in a log.

    Examples:
        >>> finder = LRFinder(num_it=40)
        >>> history = fit(10, model, F.cross_entropy, opt, data,
        ...               callbacks=[finder, SweepBar(40)])
        >>> len(finder.lrs)
        40

        In a notebook or a terminal the bar reads, part way, e.g.
        ``|██████████████--------| 63.00% [63/100 00:02<00:01 smooth loss
        2.2841]``; in a log (as here) it draws nothing.
    """

    order = 60  # after the finder (10): sees the stop_training of its last step
    main_only = True  # under torch.distributed, rank 0 alone
    in_lr_find = True

    def __init__(
        self, total: int, refresh: float = 0.25, bars: bool | None = None
    ) -> None:
        self.total = check_int(total, "total", minimum=1, owner=self.name, example=100)
        self.bars = bars
        self.refresh = check_refresh(refresh, "SweepBar")
        self.pb: Any = None  # the bar of the sweep in progress

    def on_train_begin(self) -> None:
        """Runs before training: opens the bar."""
        if draws_bars(self.bars):
            self.pb = fastprogress_module().progress_bar(range(self.total))
        else:
            self.pb = NoBar(self.total)
        self.pb.update_every = 0  # paced by `refresh` (see ProgressBar)
        self._step, self._smooth, self._last_draw = 0, None, -math.inf
        self.pb.update(0)

    def on_batch_end(
        self, train: bool, step: int, smooth_loss: Any, stop_training: bool
    ) -> None:
        """Runs after each batch: moves the bar when time is up; closes it
        after the sweep's last step."""
        if not train or self.pb is None:
            return
        self._step, self._smooth = step, smooth_loss
        now = time.perf_counter()
        if stop_training or step >= self.total:
            self._close(now)
        elif now - self._last_draw >= self.refresh:
            self._draw(now)

    def on_train_end(self, exception: BaseException | None) -> None:
        """Runs at the end, also after an error: closes the bar if open."""
        if self.pb is None:
            return
        if exception is None:
            self._close(time.perf_counter())
        else:  # no tensor read here: the device may be broken
            self.pb.on_interrupt()
            self._end(self.pb)

    def _draw(self, now: float) -> None:
        self._last_draw = now
        if self._smooth is not None:
            self.pb.comment = loss_comment(self._smooth)
        self.pb.update(self._step)

    def _close(self, now: float) -> None:
        self._draw(now)  # the last state, read once
        if self._step < self.total:  # stopped early: fastprogress would wait
            self.pb.on_iter_end()
        self._end(self.pb)

    def _end(self, pb: Any) -> None:
        self.pb = None
        if isinstance(pb, fastprogress_module().ConsoleProgressBar):
            print(flush=True)  # the bar stays; what follows starts a new line
