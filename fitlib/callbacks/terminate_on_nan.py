"""``TerminateOnNaN``: stops training at the first non-finite training loss.

Reading a loss per batch would force a host-device sync per batch, so the
losses are kept as device tensors and checked together, with one host
transfer, every ``check_every`` seconds of wall-clock time and at each epoch
end (which syncs anyway). The callback finds the exact first bad batch, but
stops training at the check, which may come a few batches later.

Under torch.distributed the ranks must stop at the same batch, or the others
would wait on the one that stopped: they check at the same iterations (paced
by rank 0's clock, agreed at each check) and stop together when any rank's
loss was bad.
"""

from __future__ import annotations

import math
import sys
import time

import torch

import fitlib.ranks as ranks
from fitlib.callback import Callback
from fitlib.checks import check_number


class TerminateOnNaN(Callback):
    """Stops training when a training loss is NaN or infinite, and says where.

    Each training batch only appends its loss (a detached device tensor) to a
    list and reads the clock. The pending losses are checked on the device
    when ``check_every`` seconds have passed since the last check, and at
    every epoch end. So it acts late by at most ``check_every`` seconds of
    training after the bad batch (finishing the batch in progress then), or
    at the end of that epoch, whichever comes first; the batches in between
    still train (on NaN weights, by then). A
    check during training also skips that epoch's validation; one at the
    epoch end comes after it.

    ``check_every=0`` checks after every batch: it stops right after the bad
    batch, at the cost of a host-device sync per batch. ``math.inf`` checks
    only at epoch ends.

    On a bad loss it prints one line to stderr and sets ``nan_loss`` (the
    value), ``nan_iteration``, ``nan_epoch`` and ``nan_batch`` (where it
    happened: iteration since fit began, epoch, batch within the epoch) and
    ``stop_iteration`` (the last training iteration that ran). They are None
    while all losses were finite; each fit starts afresh. The stop it returns
    carries ``stop_reason`` (kept in ``stop_reason`` too, and in the fit's
    ``History.stop_reason``): ``"TerminateOnNaN: training loss was nan at
    iteration 4 (epoch 1, batch 0)"``.

    Args:
        check_every: seconds of wall-clock time between two checks (>= 0).

    Examples:
        >>> nan = TerminateOnNaN(check_every=0)
        >>> history = fit(10, model, F.cross_entropy, opt, data, callbacks=[nan])
        >>> print(nan.nan_iteration)  # None when every loss was finite
        None
        >>> opt.lr = 1e6  # far too high: the loss overflows
        >>> fit(10, model, F.cross_entropy, opt, data, callbacks=[nan])
        History(2 epochs: train_loss ... -> nan, valid_loss nan)
        >>> nan.nan_iteration, nan.nan_epoch, nan.nan_batch
        (4, 1, 0)
        >>> nan.stop_reason
        'TerminateOnNaN: training loss was nan at iteration 4 (epoch 1, batch 0)'
    """

    order = 40  # before Recorder (50) and ProgressBar (60) see the stop
    in_lr_find = False  # a sweep is not part of the run it records

    def __init__(self, check_every: float = 1.0) -> None:
        self.check_every = check_number(
            check_every, "check_every", minimum=0, what="a number of seconds",
            owner=self.name, example=1.0,
        )  # fmt: skip
        self._reset()

    def _reset(self) -> None:
        # (loss, iteration, epoch, num_batch) of the training batches not yet
        # checked; the losses stay on the device.
        self._pending: list[tuple[torch.Tensor, int, int, int]] = []
        self._last_check = time.perf_counter()
        # Under several processes: the iteration of the next check, agreed.
        self._next_check: float | None = None
        self.nan_loss: float | None = None
        self.nan_iteration: int | None = None
        self.nan_epoch: int | None = None
        self.nan_batch: int | None = None
        self.stop_iteration: int | None = None
        self.stop_reason: str | None = None

    # -- hooks -----------------------------------------------------------------
    def on_train_begin(self, iteration: int) -> None:
        """Runs before training: forgets the previous fit, starts the clock."""
        self._reset()
        if ranks.world_size() > 1:  # a first check after one batch sets the pace
            self._next_check = iteration

    def on_batch_end(
        self,
        train: bool,
        last_loss: torch.Tensor,
        iteration: int,
        epoch: int,
        num_batch: int,
    ) -> dict | None:
        """Runs after each batch: keeps a training loss; checks when time is up."""
        if not train:
            return None
        self._pending.append((last_loss, iteration, epoch, num_batch))
        if self._next_check is not None:
            if iteration < self._next_check:
                return None
        elif time.perf_counter() - self._last_check < self.check_every:
            return None
        if self._check(stop_iteration=iteration):
            return {
                "stop_training": True,
                "skip_validate": True,
                "stop_reason": self.stop_reason,
            }
        return None

    def on_epoch_end(self, iteration: int) -> dict | None:
        """Runs after validation: checks the epoch's remaining losses."""
        # `iteration` already counts the epoch's last batch: it ran as iteration-1.
        if self._check(stop_iteration=iteration - 1):
            return {"stop_training": True, "stop_reason": self.stop_reason}
        return None

    # -- checking --------------------------------------------------------------
    def _check(self, stop_iteration: int) -> bool:
        """Checks the pending losses (one host transfer); True if one is bad."""
        pending, self._pending = self._pending, []
        now = time.perf_counter()
        seconds, self._last_check = now - self._last_check, now
        if self.nan_iteration is not None:
            return False  # already reported: stop only once
        bad = None
        if pending:
            all_finite, index, value = _first_non_finite([p[0] for p in pending])
            bad = None if all_finite else (value, *pending[index][1:])
        if self._next_check is not None:
            bad = self._agree(bad, stop_iteration, len(pending), seconds)
        if bad is None:
            return False
        self.nan_loss, self.nan_iteration, self.nan_epoch, self.nan_batch = bad
        self.stop_iteration = stop_iteration
        self.stop_reason = (
            f"{self.name}: training loss was {self.nan_loss} at iteration "
            f"{self.nan_iteration} (epoch {self.nan_epoch}, batch {self.nan_batch})"
        )
        if ranks.is_main():
            print(self._message(), file=sys.stderr)
        return True

    def _agree(
        self, bad: tuple | None, iteration: int, batches: int, seconds: float
    ) -> tuple | None:
        """The first bad loss of any rank, and the next check's iteration at
        rank 0's pace: every rank calls this at the same iteration."""
        pace = self.check_every * batches / seconds if seconds > 0 else 1.0
        seen = ranks.gather_to_all((bad, pace))
        pace = seen[0][1]
        step = 1 if not math.isfinite(pace) else max(1, int(pace))
        self._next_check = iteration + step if math.isfinite(pace) else math.inf
        return next((b for b, _ in seen if b is not None), None)

    def _message(self) -> str:
        where = (
            f"fitlib: {self.stop_reason}; training stopped after iteration "
            f"{self.stop_iteration}."
        )
        if self.check_every == 0:
            return where + " (The losses are checked after every batch.)"
        pace = "at each epoch end"
        if not math.isinf(self.check_every):
            pace = f"every {self.check_every:g} s and {pace}"
        return (
            f"{where} The losses are checked {pace}, not after every batch, "
            "which would sync the device, so a few batches may have trained "
            "after the bad one."
        )


def _first_non_finite(losses: list[torch.Tensor]) -> tuple[bool, int, float]:
    """(all finite?, index of the first bad loss, its value), in one transfer."""
    values = torch.stack(losses)
    bad = ~torch.isfinite(values)
    first = bad.to(torch.uint8).argmax()  # the first True; 0 when there is none
    # At least float32: half precision would round large indices.
    dtype = torch.promote_types(values.dtype, torch.float32)
    summary = torch.stack([t.to(dtype) for t in (bad.any(), first, values[first])])
    any_bad, index, value = summary.tolist()
    return not any_bad, int(index), value
