"""What ``Checkpoint`` needs besides saving and its files: the loop's
position, the batches of a resumed epoch, loading callback states, what
identifies a run, what a user's callback changes without saving it, and
argument checks."""

from __future__ import annotations

import math
import pickle
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from fitlib.callback import Callback, inner_callback
from fitlib.checks import check_int, check_number, len_or_none
from fitlib.serialization import optimizer_differences, optimizer_identity

HYPER = ("lr", "wd", "mom", "beta")


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
    pairs, waiting = _pair(callbacks, states)
    for cb, state in pairs:
        cb.load_state_dict(state)
    return waiting


def _pair(callbacks: list[Callback], states: list) -> tuple[list, list[Callback]]:
    """Each saved ``[name, state]`` with the first waiting callback of that
    class, and the callbacks left without one."""
    pairs, waiting = [], list(callbacks)
    for name, state in states:
        cb = next((cb for cb in waiting if cb.name == name), None)
        if cb is not None:
            pairs.append((cb, state))
            waiting.remove(cb)
    return pairs, waiting


def check_callbacks(callbacks: list[Callback], states: list, path: Path) -> None:
    """Refuses, before loading any, a fit with a stateful callback the run lacked."""
    stateful = [cb.name for cb in _pair(callbacks, states)[1] if cb.state_dict()]
    if stateful:
        raise ValueError(
            f"{str(path)!r} holds no state for callback(s) {stateful}, which this "
            "fit has: resuming would not continue the same run. Fix: run with "
            "the callbacks of the run that saved, or Checkpoint(resume=False)."
        )


# -- what identifies a run ---------------------------------------------------------
def _scheduled(name: str, schedules: dict) -> bool:
    """Whether a schedule sets ``name``: of every part (``lr``) or of one
    (``decoder.lr``; the hyper-parameter then differs between runs in that
    part, which the schedule's settings already compare)."""
    return any(key.rpartition(".")[2] == name for key in schedules)


def run_signature(
    opt: Any, n_epochs: Any, max_steps: Any, train_dl: Any, callbacks: list
) -> dict:
    """What a checkpoint's run must share with a fit that resumes it: the
    optimizer, its hyper-parameters as the fit begins, the schedules that set
    the others (a schedule's values at the fit's start are those an earlier,
    interrupted fit left: its settings say what the run is), the planned
    length."""
    schedules = {}
    for cb in callbacks:
        inner = inner_callback(cb)
        for name in getattr(inner, "sets_hypers", ()):
            schedules[name] = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(inner))
    return {
        **optimizer_identity(opt),
        "hyper": {
            name: opt.get(name)
            for name in HYPER
            if opt.has(name) and not _scheduled(name, schedules)
        },
        "schedules": schedules,
        "n_epochs": n_epochs,
        "max_steps": max_steps,
        "batches_per_epoch": len_or_none(train_dl),
    }


def run_differences(saved: dict, ours: dict, opt: Any, opt_state: dict) -> list[str]:
    """How the run of a checkpoint (``saved``, its ``run_signature``) differs
    from this fit's (``ours``), one line each."""
    whose = ("the checkpoint's run", "this run")
    found = optimizer_differences(opt, opt_state, saved, whose)
    for name in [n for n in HYPER if n in saved["hyper"] and n in ours["hyper"]]:
        theirs, own = saved["hyper"][name], ours["hyper"][name]
        if not _same_numbers(theirs, own):
            found.append(f"{name}: {whose[0]} {_show(theirs)}, {whose[1]} {_show(own)}")
    theirs, own = saved.get("schedules", {}), ours["schedules"]
    changed: dict[tuple, list[str]] = {}  # one line per pair of schedules
    others = sorted((theirs.keys() | own.keys()) - set(HYPER))  # eps, model.x.p
    for name in [*HYPER, *others]:
        pair = (theirs.get(name, "none"), own.get(name, "none"))
        if pair[0] != pair[1]:
            changed.setdefault(pair, []).append(name)
    for (then, now), names in changed.items():
        found.append(
            f"schedule of {', '.join(names)}: {whose[0]} {then}, {whose[1]} {now}"
        )
    for key, label in (
        ("n_epochs", "epochs"),
        ("max_steps", "max_steps"),
        ("batches_per_epoch", "batches per epoch (len(train_dl))"),
    ):
        if saved[key] != ours[key]:
            found.append(f"{label}: {whose[0]} {saved[key]}, {whose[1]} {ours[key]}")
    return found


def _same_numbers(a: list[float], b: list[float]) -> bool:
    """Equal but for rounding (a relative difference below 1e-9)."""
    return len(a) == len(b) and all(
        math.isclose(x, y, rel_tol=1e-9) for x, y in zip(a, b)
    )


def _show(values: list[float] | None) -> str:
    """One value per group, or a single one when all groups share it."""
    if values is None:
        return "none"
    same = all(v == values[0] for v in values)
    return repr(values[0]) if same and values else repr(values)


def check_interval(
    every_n_epochs: Any, every_n_steps: Any, seconds: Any = None
) -> None:
    """Checks ``Checkpoint``'s intervals: one of every n epochs and every n
    steps, which ``every_n_seconds`` may replace or come beside."""
    if (every_n_epochs is None) == (every_n_steps is None) and (
        seconds is None or every_n_epochs is not None
    ):
        got = "neither" if every_n_epochs is None else "both"
        raise ValueError(
            f"Checkpoint needs exactly one of every_n_epochs and every_n_steps "
            f"(every_n_seconds may come beside either, or alone); got {got}. "
            "Fix: e.g. Checkpoint(dir, every_n_epochs=1) or "
            "Checkpoint(dir, every_n_steps=500)."
        )
    for name, n in (
        ("every_n_epochs", every_n_epochs),
        ("every_n_steps", every_n_steps),
    ):
        check_int(n, name, minimum=1, owner="Checkpoint", example=1, allow_none=True)
    check_number(seconds, "every_n_seconds", above=0, below=math.inf,
                 owner="Checkpoint", example=1800, allow_none=True)  # fmt: skip


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
    # Between two steps, and no validation asked for and not yet run (a
    # checkpoint does not hold that request): resumable from here.
    if state["train"] and not state["skip_step"] and not state["validate_now"]:
        return Position(state["epoch"], state["num_batch"], *counts[2:])
    return None


class StateWatch:
    """Notices callbacks that keep state without saving it.

    A callback of yours without ``state_dict`` whose attributes change during
    training keeps state that a checkpoint does not save: after a resume it
    starts over, silently (a history it appends to loses the epochs before
    the crash; an epoch's sums lose the batches before it). ``StateWatch``
    notes those callbacks' attributes as training begins. A checkpoint at an
    epoch boundary warns about attributes the callback had then and that
    changed; one inside an epoch also about attributes its hooks created (an
    epoch's sums, set up in ``on_epoch_begin``), which that resume loses.
    Each callback is warned about once.

    Examples:
        >>> import warnings
        >>> from fitlib.resume import StateWatch
        >>> class Count(Callback):
        ...     def __init__(self):
        ...         self.n = 0
        ...     def on_batch_end(self, **kwargs):
        ...         self.n += 1
        >>> count = Count()
        >>> watch = StateWatch([count])  # as the fit begins
        >>> count.n = 4  # the fit goes on
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     watch.warn_changed()  # at each checkpoint
        >>> print(caught[0].message)
        Checkpoint: callback Count changed its attributes ['n'] during training
        but has no state_dict(), so a checkpoint at an epoch's end does not save
        them: ...
    """

    def __init__(self, callbacks: list[Callback]) -> None:
        # fitlib's own callbacks save what a resume needs (a bar's rows are
        # not such state); the user's are the ones to watch.
        self._seen = {
            id(cb): (cb, _fingerprints(cb))
            for cb in callbacks
            if type(cb).state_dict is Callback.state_dict
            and not type(cb).__module__.startswith("fitlib.")
        }

    def warn_changed(self, inside_epoch: bool = False) -> None:
        """Warns about each watched callback whose attributes changed."""
        for key, (cb, before) in list(self._seen.items()):
            now = _fingerprints(cb)
            names = now.keys() | before.keys() if inside_epoch else before.keys()
            changed = sorted(k for k in names if now.get(k) != before.get(k))
            if not changed:
                continue
            del self._seen[key]
            where = "inside an epoch" if inside_epoch else "at an epoch's end"
            warnings.warn(
                f"Checkpoint: callback {cb.name} changed its attributes "
                f"{changed} during training but has no state_dict(), so a "
                f"checkpoint {where} does not save them: a run resumed from it "
                "starts them over. Fix: give the callback state_dict() and "
                "load_state_dict() that save and restore them.",
                stacklevel=3,
            )


def _fingerprints(cb: Callback) -> dict[str, bytes | None]:
    """Each attribute's pickled bytes (None: tensors, modules, optimizers (a
    model or optimizer a callback keeps to swap in: its state is the fit's
    once it trains) and what cannot be pickled are not compared)."""
    out: dict[str, bytes | None] = {}
    for key, value in vars(cb).items():
        optimizer = hasattr(value, "param_groups") and hasattr(value, "state_dict")
        if optimizer or isinstance(value, (torch.Tensor, torch.nn.Module)):
            out[key] = None
            continue
        try:
            out[key] = pickle.dumps(value)
        except Exception:  # a file, a lock, a function...: not compared
            out[key] = None
    return out
