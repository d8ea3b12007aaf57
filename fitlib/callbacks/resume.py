"""What ``Checkpoint`` needs besides saving: the loop's position, the batches
of a resumed epoch, loading callback states, and argument checks."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from fitlib.callback import Callback


class Position(NamedTuple):
    """Where the loop stands: the next epoch and batch to train, and counts."""

    epoch: int
    num_batch: int
    iteration: int
    step: int
    finished: bool = False


class Resumed:
    """The data of a resumed epoch: its remaining batches, drawn already."""

    def __init__(self, data: Any, batches: Iterator, left: int) -> None:
        self.resumed_from, self.valid_dl = data, getattr(data, "valid_dl", None)
        self.train_dl = Remaining(batches, left)


class Remaining:
    def __init__(self, batches: Iterator, left: int) -> None:
        self.batches, self.left = batches, left

    def __len__(self) -> int:
        return self.left

    def __iter__(self) -> Iterator:
        return self.batches


def give_states(callbacks: list[Callback], states: list) -> list[Callback]:
    """Gives each saved ``[name, state]`` to the callback of that class, in
    order; returns the callbacks that got none."""
    waiting = list(callbacks)
    for name, state in states:
        cb = next((cb for cb in waiting if cb.name == name), None)
        if cb is not None:
            cb.load_state_dict(state)
            waiting.remove(cb)
    return waiting


def load_callbacks(callbacks: list[Callback], states: list, path: Path) -> None:
    """``give_states``, refusing a fit with a stateful callback the run lacked."""
    stateful = [cb.name for cb in give_states(callbacks, states) if cb.state_dict()]
    if stateful:
        raise ValueError(
            f"{str(path)!r} holds no state for callback(s) {stateful}, which this "
            "fit has: resuming would not continue the same run. Fix: run with "
            "the callbacks of the run that saved, or Checkpoint(resume=False)."
        )


def check_interval(every_n_epochs: Any, every_n_steps: Any) -> None:
    if (every_n_epochs is None) == (every_n_steps is None):
        got = "neither" if every_n_epochs is None else "both"
        raise ValueError(
            f"Checkpoint needs exactly one of every_n_epochs and every_n_steps; "
            f"got {got}. Fix: e.g. Checkpoint(dir, every_n_epochs=1) or "
            "Checkpoint(dir, every_n_steps=500)."
        )
    for name, n in (
        ("every_n_epochs", every_n_epochs),
        ("every_n_steps", every_n_steps),
    ):
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(
                f"{name} must be an int >= 1; got {n!r}. Fix: e.g. {name}=1."
            )


def check_writable(dirpath: Path) -> None:
    """Raises before training when ``dirpath`` cannot hold checkpoints."""
    try:
        dirpath.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=dirpath):
            pass
    except OSError as e:
        raise ValueError(
            f"Checkpoint: cannot write in {str(dirpath)!r} ({e.strerror or e}). "
            "Fix: pass a directory you can write to."
        ) from e


def remove_temporaries(dirpath: Path) -> None:
    """Half-written files of a killed run (never a checkpoint: see atomic_save)."""
    for tmp in dirpath.glob(".*.pth.*.tmp"):
        tmp.unlink(missing_ok=True)


def final_position(state: dict) -> Position | None:
    """Where a fit ended, as a checkpoint position: finished, resumable, or
    None (an error, or a stop inside validation or a gradient group)."""
    if state["exception"] is not None:  # even Ctrl-C: it may cut a step in two
        return None
    counts = state["epoch"], 0, state["iteration"], state["step"]
    n_epochs, max_steps = state["n_epochs"], state["max_steps"]
    reached = (n_epochs is not None and state["epoch"] >= n_epochs) or (
        max_steps is not None and state["step"] >= max_steps
    )
    if reached or state["stop_training"]:
        return Position(*counts, finished=True)
    if state["train"] and not state["skip_step"]:  # between two steps
        return Position(state["epoch"], state["num_batch"], *counts[2:])
    return None
