"""When ``Checkpoint(every_n_seconds=...)`` saves: ``SaveClock``, wall-clock
time on the host since the last save, the same decision on every rank."""

from __future__ import annotations

from time import monotonic

import fitlib.ranks as ranks

_POLLS = 10  # ranks compare clocks about this often per interval


class SaveClock:
    """Says, after each optimizer step, whether ``seconds`` have passed since
    the fit began or the last save.

    It reads ``time.monotonic()`` (no device sync). In one process it checks
    at every step. Under torch.distributed rank 0's clock decides for every
    rank, at steps every rank knows in advance: each check broadcasts rank
    0's answer and the number of steps until the next check, paced to about
    ``seconds / 10`` from the steps' measured duration, so ranks exchange a
    number about ten times per interval, never at every step.

    Examples:
        >>> from fitlib.checkpoint_clock import SaveClock
        >>> clock = SaveClock(600.0)
        >>> clock.reset()  # as the fit begins, and at each save
        >>> clock.tick()  # after a step: 600 s have not passed
        False
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.reset()

    def reset(self) -> None:
        """Starts the interval anew (the fit begins, or a checkpoint was saved)."""
        self._since = self._checked = monotonic()
        self._steps, self._next = 0, 1  # steps since the last check; until the next

    def tick(self) -> bool:
        """After a step: whether a save is due (the same answer on every rank)."""
        self._steps += 1
        if self._steps < self._next:
            return False
        now = monotonic()
        due = now - self._since >= self.seconds
        if ranks.world_size() == 1:
            self._steps = 0
            return due
        pace = (now - self._checked) / self._steps  # seconds per step, rank 0's
        left = self.seconds - (now - self._since)
        gap = max(1, int(min(max(left, 0.0), self.seconds / _POLLS) / max(pace, 1e-9)))
        agreed = ranks.broadcast_int(gap * 2 + int(due))  # rank 0's, one collective
        self._checked, self._steps, self._next = now, 0, max(1, agreed // 2)
        return bool(agreed % 2)
