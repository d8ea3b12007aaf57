"""A fit's wall-clock budget: ``max_time`` read (seconds, a ``timedelta``, a
``"DD:HH:MM:SS"`` string, a dict of ``timedelta``'s arguments) and the clock
that says when it is spent (``TimeBudget``), which the ``TimeLimit`` callback
and ``fit(max_time=...)`` share.

The clock is the host's ``time.monotonic``, read once per training batch: no
device sync. Under torch.distributed the ranks' clocks differ, so rank 0
decides and the others follow: at agreed iterations rank 0 broadcasts either
"spent" or the iteration of the next check, paced so that checks come about
``SYNC_SECONDS`` apart (one small collective each, and the host waits for
the device's queue there), plus one at each epoch's end.
"""

from __future__ import annotations

import datetime
import math
import re
import time
from typing import Any

import fitlib.ranks as ranks
from fitlib.errors import ArgTypeError, did_you_mean, is_number

SYNC_SECONDS = 1.0  # between two agreements of the ranks (several processes)
_UNITS = ("weeks", "days", "hours", "minutes", "seconds", "milliseconds")
_CLOCK = re.compile(r"^\s*(?:(\d+):)?(\d+):(\d+):(\d+(?:\.\d*)?)\s*$")
_FIX = (
    'e.g. max_time=3600 (seconds), "00:11:30:00" (DD:HH:MM:SS), '
    'timedelta(hours=11, minutes=30) or {"hours": 11, "minutes": 30}'
)


def as_seconds(max_time: Any, owner: str) -> float:
    """``max_time`` in seconds, a finite number > 0: a number of seconds, a
    ``datetime.timedelta``, a string ``"DD:HH:MM:SS"`` or ``"HH:MM:SS"`` (as
    Lightning's ``max_time``; a field may exceed its usual range), or a dict
    of ``timedelta``'s arguments (``{"hours": 11, "minutes": 30}``).

    Examples:
        >>> from fitlib.time_budget import as_seconds
        >>> as_seconds("00:11:30:00", "fit"), as_seconds({"minutes": 2}, "fit")
        (41400.0, 120.0)
    """
    seconds = _seconds(max_time, owner)
    if not (math.isfinite(seconds) and seconds > 0):
        got = f"{max_time!r} ({type(max_time).__name__})"
        got = got if is_number(max_time) else f"{max_time!r} ({seconds:g} s)"
        raise ValueError(
            f"{owner}: max_time must be a time > 0 (and finite); got {got}. "
            f"Fix: {_FIX}; leave max_time out (None) for no limit."
        )
    return seconds


def _seconds(max_time: Any, owner: str) -> float:
    if isinstance(max_time, datetime.timedelta):
        return max_time.total_seconds()
    if is_number(max_time):
        return float(max_time)
    if isinstance(max_time, str):
        found = _CLOCK.match(max_time)
        if found is None:
            raise ValueError(
                f"{owner}: max_time {max_time!r} is no time of the form "
                f'"DD:HH:MM:SS" or "HH:MM:SS". Fix: {_FIX}.'
            )
        days, hours, minutes, seconds = found.groups()
        return datetime.timedelta(
            days=int(days or 0), hours=int(hours), minutes=int(minutes),
            seconds=float(seconds),
        ).total_seconds()  # fmt: skip
    if isinstance(max_time, dict):
        for key, value in max_time.items():
            if key not in _UNITS:
                raise ValueError(
                    f"{owner}: max_time has the key {key!r}"
                    f"{did_you_mean(key, _UNITS)}; its keys are timedelta's "
                    f"arguments: {', '.join(_UNITS)}. Fix: {_FIX}."
                )
            if not is_number(value):
                raise ArgTypeError(
                    f"{owner}: max_time[{key!r}] must be a number; got {value!r} "
                    f"({type(value).__name__}). Fix: {_FIX}."
                )
        return datetime.timedelta(**max_time).total_seconds()
    raise ArgTypeError(
        f"{owner}: max_time must be a number of seconds, a timedelta, a "
        f'"DD:HH:MM:SS" string or a dict; got {max_time!r} '
        f"({type(max_time).__name__}). Fix: {_FIX}."
    )


def clock(seconds: float) -> str:
    """``seconds`` as ``H:MM:SS`` with up to two decimals (``0:01:00.3``).

    Examples:
        >>> from fitlib.time_budget import clock
        >>> clock(60.3), clock(41400), clock(0.05)
        ('0:01:00.3', '11:30:00', '0:00:00.05')
    """
    hours, rest = divmod(round(seconds, 2), 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{secs:05.2f}".rstrip("0").rstrip(".")
    return f"{int(hours)}:{int(minutes):02d}:{text.zfill(2)}"


class TimeBudget:
    """The clock of one fit against ``max_time``: ``start`` as the fit
    begins, then ``spent`` after each training batch and at each epoch's end
    returns None, or the reason to suspend (``"max_time=0:01:00 reached after
    0:01:00.3"``), the same on every rank.

    Examples:
        >>> from fitlib.time_budget import TimeBudget
        >>> budget = TimeBudget(3600, owner="fit")
        >>> budget.start(iteration=0)
        >>> print(budget.spent(iteration=0))  # an hour is far off
        None
    """

    def __init__(self, max_time: Any, owner: str) -> None:
        self.seconds = as_seconds(max_time, owner)
        self._start: float | None = None
        self._end: float | None = None
        self._reason: str | None = None
        # Several processes: the iteration of the next agreed check.
        self._next: int | None = None
        self._first = 0

    def start(self, iteration: int) -> None:
        """Starts the clock (each fit afresh: a budget per run)."""
        self._start, self._end, self._reason = time.monotonic(), None, None
        self._first = iteration
        self._next = iteration if ranks.world_size() > 1 else None

    def stop(self) -> None:
        """Stops the clock as the fit ends (``elapsed`` keeps the fit's time)."""
        if self._start is not None and self._end is None:
            self._end = time.monotonic()

    def elapsed(self) -> float:
        """Seconds since ``start``, until ``stop`` (0 before it)."""
        if self._start is None:
            return 0.0
        end = time.monotonic() if self._end is None else self._end
        return end - self._start

    def spent(self, iteration: int, epoch_end: bool = False) -> str | None:
        """The reason to suspend once the budget is spent, else None.
        ``epoch_end``: every rank is at an epoch's end (an agreement there)."""
        if self._reason is not None or self._start is None:
            return self._reason
        elapsed = self.elapsed()
        if self._next is None:  # one process: its own clock decides
            return self._decide(elapsed, elapsed >= self.seconds)
        if not epoch_end and iteration < self._next:
            return None
        # Rank 0's decision on every rank, in one broadcast: -1 for spent,
        # else the next check's iteration, about SYNC_SECONDS ahead at the
        # pace rank 0 has trained at so far.
        word = (
            -1
            if elapsed >= self.seconds
            else iteration + self._ahead(iteration, elapsed)
        )
        word = ranks.broadcast_int(word)
        self._next = word
        return self._decide(elapsed, word < 0)

    def _ahead(self, iteration: int, elapsed: float) -> int:
        batches = iteration - self._first
        if batches <= 0 or elapsed <= 0:
            return 1
        return max(1, min(int(SYNC_SECONDS * batches / elapsed), 1 << 20))

    def _decide(self, elapsed: float, spent: bool) -> str | None:
        if spent:
            self._reason = (
                f"max_time={clock(self.seconds)} reached after {clock(elapsed)}"
            )
        return self._reason
