"""Helpers the loggers share (CSVLogger, TextLogger, TrainStats).

``RunningLoss`` (a sample-weighted loss sum kept on the device),
``TrainClock`` (wall-clock seconds of training, validation left out), the lr
a step used, and argument and state checks. Not a callback.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from fitlib.checks import check_int
from fitlib.core import to_floats
from fitlib.metrics import weighted_sum

# Batches whose losses wait as separate tensors: then they are summed into
# one on the device (no sync), so an epoch of any length keeps little.
FOLD = 1024


class RunningLoss:
    """A sample-weighted sum of losses, kept as device tensors until read.

    ``add`` only appends (no sync; every ``FOLD`` batches one device op sums
    them, so memory stays bounded); ``pending`` gives the sum as a device
    tensor to read together with other values in one transfer; ``mean`` turns
    what was read into the mean. ``state_dict`` reads the sum (one sync: call
    it when saving), and a restored sum is added in.

    Example:
        >>> loss = RunningLoss()
        >>> loss.add(torch.tensor(1.0), 4); loss.add(torch.tensor(6.0), 1)
        >>> loss.mean(to_floats(loss.pending()))
        2.0
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self, total: float = 0.0, count: int = 0) -> None:
        """Forgets the losses; ``total`` and ``count`` start the sums (restored)."""
        self._losses: list[torch.Tensor] = []
        self._sizes: list[int] = []
        self._folded: torch.Tensor | None = None  # the sum of earlier batches
        self._folded_count = 0
        self._total, self._count = float(total), int(count)

    def add(self, loss: torch.Tensor, size: int) -> None:
        """Adds a batch's detached loss (a mean over ``size`` samples)."""
        self._losses.append(loss)
        self._sizes.append(size)
        if len(self._losses) >= FOLD:
            self._folded = self.pending()[0]
            self._folded_count += sum(self._sizes)
            self._losses, self._sizes = [], []

    @property
    def samples(self) -> int:
        """The number of samples added (restored ones included)."""
        return self._count + self._folded_count + sum(self._sizes)

    @property
    def restored(self) -> tuple[float, int]:
        """The sum and count that ``reset`` (or ``load_state_dict``) started from."""
        return self._total, self._count

    def pending(self) -> list[torch.Tensor]:
        """``[sum of size * loss]`` over the batches added, or ``[]`` if none."""
        parts = [self._folded] if self._folded is not None else []
        if self._losses:
            parts.append(weighted_sum(self._losses, self._sizes))
        return [parts[0] + parts[1]] if len(parts) == 2 else parts

    def mean(self, read: list[float]) -> float:
        """The mean loss per sample, given ``pending()`` read as floats."""
        n = self.samples
        return (self._total + sum(read)) / n if n else math.nan

    def state_dict(self) -> dict:
        """The sum and count as python numbers (reads the device: one sync)."""
        total = self._total + sum(to_floats(self.pending()))
        return {"total": total, "count": self.samples}

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict``: later batches add to the restored sum."""
        self.reset(state["total"], state["count"])


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


def step_lr(opt: Any) -> float:
    """The lr of the last parameter group, as the latest ``opt.step()`` used it.

    ``HPOptimizer.stepped`` notes it in ``step()``, before a scheduler sets the
    next one; otherwise (no step yet) the group's current lr. NaN without opt.
    """
    if opt is None:
        return math.nan
    stepped = getattr(opt, "stepped", None)
    return float(stepped[0] if stepped else opt.param_groups[-1]["lr"])


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
