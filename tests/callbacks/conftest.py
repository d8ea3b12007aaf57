"""Fixtures of the progress bars' tests (ProgressBar, SweepBar): a frozen
clock and a record of fastprogress's bar calls."""

import time
from types import SimpleNamespace

import pytest
from fastprogress import fastprogress

CONSOLE_BAR = fastprogress.ConsoleProgressBar


@pytest.fixture
def clock(monkeypatch):
    """A frozen time.perf_counter; advance it with clock.now += seconds."""
    fake = SimpleNamespace(now=1000.0)
    monkeypatch.setattr(time, "perf_counter", lambda: fake.now)
    return fake


@pytest.fixture
def bar_calls(monkeypatch):
    """Records fastprogress's update/on_iter_end/on_interrupt calls on bars."""
    calls = BarCalls()
    for name in ("update", "on_iter_end", "on_interrupt"):
        owner = fastprogress.ProgressBar if name == "update" else CONSOLE_BAR
        original = getattr(owner, name)

        def spy(self, *args, _name=name, _original=original):
            calls.append((_name, self, *args))
            return _original(self, *args)

        monkeypatch.setattr(owner, name, spy)
    return calls


class BarCalls(list):
    """The calls ``bar_calls`` records: ``(name, bar, *args)``."""

    def closed(self, bar) -> bool:
        """Whether ``bar`` was ended (at its last iteration, or interrupted)."""
        ends = ("on_iter_end", "on_interrupt")
        return any(c[0] in ends and c[1] is bar for c in self)
