"""Helpers the loggers share (TextLogger, TrainStats).

``TrainClock`` (wall-clock seconds of training, validation left out), and
argument and state checks. Not a callback.
"""

from __future__ import annotations

import time
from typing import Any

from fitlib.checks import check_int

# RunningLoss and step_lr live with the epoch record; imported from here too.
from fitlib.record import RunningLoss, step_lr, to_floats  # noqa: F401
from fitlib.serialization import optimizer_identity


class TrainClock:
    """Wall-clock seconds spent training, validation and epoch ends left out.

    It runs from ``resume`` (an epoch's start) to ``pause`` (its first
    validation batch, or its end). On a GPU the host runs ahead of the device:
    read it right after a host-device sync, so the device's work is counted.

    Example:
        >>> clock = TrainClock()
        >>> clock.pause(); seconds = clock.lap()
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self, seconds: float = 0.0) -> None:
        """Starts again from ``seconds`` (restored), running."""
        self._seconds, self._since = float(seconds), time.perf_counter()

    def pause(self) -> None:
        """Stops counting (validation begins); a paused clock stays paused."""
        if self._since is not None:
            self._seconds += time.perf_counter() - self._since
            self._since = None

    def resume(self) -> None:
        """Counts again (an epoch begins); a running clock keeps running."""
        if self._since is None:
            self._since = time.perf_counter()

    def elapsed(self) -> float:
        """Training seconds since the last ``lap`` (or ``reset``)."""
        running = 0.0 if self._since is None else time.perf_counter() - self._since
        return self._seconds + running

    def lap(self) -> float:
        """``elapsed()``, and starts counting the next lap from zero."""
        seconds = self.elapsed()
        self._seconds = 0.0
        if self._since is not None:
            self._since = time.perf_counter()
        return seconds


def last_lr(opt: Any) -> Any:
    """The lr of the last group's latest step (as it is now, before any step)."""
    stepped = getattr(opt, "stepped", None)  # HPOptimizer notes it in step()
    return stepped[0] if stepped else opt.param_groups[-1]["lr"]


def read_into(interval: list, unread: list) -> None:
    """Adds ``unread`` (a list of (device loss, batch size), emptied) to
    ``interval`` ([weighted loss sum, samples]), read in one host transfer:
    the loggers' per-step points."""
    batches = unread[:]
    unread.clear()
    values = to_floats([loss for loss, _ in batches])
    for value, (_, size) in zip(values, batches, strict=True):
        interval[0] += value * size
        interval[1] += size


def check_every_n_steps(value: Any, owner: str, allow_none: bool = False) -> Any:
    """``value`` if it is an int >= 1 (or None when allowed), else a ValueError."""
    return check_int(
        value, "every_n_steps", minimum=1, owner=owner, example=100,
        allow_none=allow_none,
    )  # fmt: skip


def check_state_keys(state: Any, expected: tuple[str, ...], owner: str) -> None:
    """A ValueError unless ``state`` is a dict with exactly the keys ``expected``."""
    if not isinstance(state, dict) or set(state) != set(expected):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"{owner}.load_state_dict: expected the dict {owner}.state_dict() "
            f"returns (keys {sorted(expected)}); got {got}. Fix: pass what "
            f"{owner}.state_dict() returned."
        )


def optimizer_params(opt: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """The optimizer's class and its hyper-parameters ``names`` (the last
    group's), for a tracker's parameters; a ``MultiOptimizer``'s per part
    (``decoder.mom``), with every part's class in ``optimizer``."""
    values: dict[str, Any] = {"optimizer": optimizer_identity(opt)["opt_class"]}
    parts = getattr(opt, "parts", None) or {"": opt}
    for part, one in parts.items():
        for name in names:
            if hasattr(one, "has") and one.has(name):
                values[f"{part}.{name}" if part else name] = one.get(name)[-1]
    return values
