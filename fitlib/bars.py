"""What the progress bars share: whether to draw bars, fastprogress imported
when a fit starts, and stand-ins that draw nothing (a log gets the table
only)."""

from __future__ import annotations

import sys
from typing import Any

from fitlib.checks import check_number


def check_refresh(refresh: Any, owner: str) -> float:
    return check_number(
        refresh, "refresh", minimum=0, what="a number of seconds", owner=owner,
        example=0.25,
    )  # fmt: skip


def loss_comment(smooth: Any) -> str:
    return f"smooth loss {float(smooth):.4f}"  # of a tensor: a host-device sync


def draws_bars(bars: bool | None) -> bool:
    """``bars``, or when None: whether stdout is a notebook or a terminal."""
    if bars is None:
        fp = fastprogress_module()
        return bool(fp.IN_NOTEBOOK or sys.stdout.isatty())
    return bool(bars)


def master_bar(n_epochs: int, bars: bool | None) -> Any:
    if draws_bars(bars):
        return fastprogress_module().master_bar(range(n_epochs))
    return TableOnly()


class NoBar:
    """A bar that draws nothing; it keeps what ProgressBar reads and sets."""

    def __init__(self, total: Any = None) -> None:
        self.total = None if total == "noinfer" else total
        self.comment, self.update_every, self.start_t = "", 0, 0.0

    def update(self, val: int | None = None) -> None:
        pass

    on_iter_end = on_interrupt = update


class TableOnly:
    """Stands in for the master bar when stdout is no terminal (a log, CI).

    fastprogress 1.1 draws bars there anyway (its tty test is always true);
    a log needs only the table, aligned as fastprogress aligns it.
    """

    def __init__(self) -> None:
        self.main_bar, self.widths = NoBar(), None

    def update(self, val: int | None = None) -> None:
        pass

    def progress(self, gen: Any, total: Any = None) -> NoBar:
        return NoBar(total)

    def write(self, row: list[str], table: bool = True) -> None:
        if self.widths is None:
            self.widths = [max(len(name), 8) for name in row]
        print("  ".join(v.ljust(w) for v, w in zip(row, self.widths)).rstrip())


def fastprogress_module() -> Any:
    # Imported when a fit starts: fastprogress pulls in fasthtml (~0.5 s), a
    # cost `import fitlib` should not pay.
    from fastprogress import fastprogress

    return fastprogress
