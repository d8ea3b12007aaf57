"""What ``Checkpoint`` needs besides saving: the loop's position, the batches
of a resumed epoch, loading callback states, what identifies a run, the lock
on the directory, and argument checks."""

from __future__ import annotations

import datetime
import errno
import math
import os
import pickle
import re
import shlex
import socket
import stat
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from fitlib.callback import Callback, inner_callback
from fitlib.checks import check_int, len_or_none
from fitlib.file_errors import DamagedFileError
from fitlib.serialization import optimizer_differences, optimizer_identity, safe_load

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

LOCK_NAME = ".fitlib.lock"
CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)\.pth")
# What a checkpoint holds besides its format's own entries ("run", "opt_class").
_ENTRIES = ("model", "opt", "callbacks", "monitor", "position", "rng", "epoch_rng")
HYPER = ("lr", "wd", "mom", "beta")
_warned_unlocked = False


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
    for name in HYPER:
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


# -- the lock on a checkpoint directory --------------------------------------------
class DirLock:
    """An exclusive ``flock`` on ``dirpath/.fitlib.lock``, held by one run.

    The holder writes its pid, host, start time and command line in the file.
    The lock belongs to the open file: closing it (also when the process
    dies, even by SIGKILL) releases it, so a dead run's lock is simply taken.
    The file itself stays (removing it would let two runs lock two files).
    A lock path that is not a plain file of its own (a symbolic or hard link,
    a directory, a fifo) is refused, never followed: writing the holder there
    would empty or create the file it leads to.
    """

    def __init__(self, dirpath: Path) -> None:
        self.path = Path(dirpath) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Takes the lock, or raises a ValueError naming the run that holds it."""
        if fcntl is None:
            _warn_unlocked(self.path.parent, "this platform has no fcntl")
            return
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                _warn_unlocked(self.path.parent, e.strerror or str(e))
                return
            raise ValueError(_held_message(self.path.parent, holder)) from None
        os.ftruncate(fd, 0)
        os.write(fd, _holder_text().encode())
        self._fd = fd

    def _open(self) -> int:
        """The lock file, opened without following a link, and a plain file."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(self.path, flags, 0o666)
        except OSError as e:  # a link or a directory; another user's lock file
            odd = _odd_lock_path(self.path)
            if odd:
                raise ValueError(odd) from None
            raise ValueError(
                f"Checkpoint: cannot open the lock file {str(self.path)!r} "
                f"({e.strerror or e}). Fix: give this run a directory of its own "
                "(another dirpath)."
            ) from e
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            os.close(fd)
            raise ValueError(_odd_lock_path(self.path) or _changed(self.path))
        return fd

    def release(self) -> None:
        """Lets the next run take the directory (does nothing when not held)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.ftruncate(fd, 0)  # no holder: the file names nobody
            finally:
                os.close(fd)  # closing the file releases the lock


def _odd_lock_path(path: Path) -> str | None:
    """Why ``path`` cannot be the lock file (None: it is a plain file)."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    mode = info.st_mode
    why = "writing this run's name there would empty or create the file it leads to"
    if stat.S_ISLNK(mode):
        kind = f"a symbolic link (to {os.readlink(path)!r})"
    elif stat.S_ISREG(mode) and info.st_nlink == 1:
        return None
    elif stat.S_ISREG(mode):
        kind = f"a hard link (one of {info.st_nlink} names of a file)"
    else:
        kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a fifo (named pipe)",
                 stat.S_ISSOCK: "a socket"}  # fmt: skip
        kind = next((k for test, k in kinds.items() if test(mode)), "a device")
        why = "it cannot hold a lock"
    return (
        f"Checkpoint: the lock file {str(path)!r} is {kind}, not a plain file; "
        f"fitlib does not use it ({why}). Fix: remove it (rm "
        f"{shlex.quote(str(path))}) and run again, or use another dirpath."
    )


def _changed(path: Path) -> str:
    return (
        f"Checkpoint: the lock file {str(path)!r} was replaced while this run "
        "opened it. Fix: make sure one run at a time uses this dirpath, and run "
        "again."
    )


def _holder_text() -> str:
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return (
        f"pid: {os.getpid()}\nhost: {socket.gethostname()}\n"
        f"started: {started}\ncommand: {shlex.join(sys.argv)}\n"
    )


def _read_holder(fd: int) -> dict[str, str]:
    try:
        text = os.pread(fd, 65536, 0).decode(errors="replace")
    except OSError:
        return {}
    pairs = (line.split(": ", 1) for line in text.splitlines() if ": " in line)
    return dict(pairs)


def _held_message(dirpath: Path, holder: dict[str, str]) -> str:
    pid, host = holder.get("pid", "?"), holder.get("host", "?")
    who = (
        f"pid {pid} on host {host}, started {holder.get('started', '?')}, "
        f"command: {holder.get('command', '?')}"
        if holder
        else "another process (it has not written its name yet)"
    )
    if pid == str(os.getpid()) and host == socket.gethostname():
        who += (
            "; that is this process: another Checkpoint on this directory is in a fit"
        )
    return (
        f"Checkpoint: {str(dirpath)!r} is in use by another run ({who}). Two runs "
        "in one directory would delete each other's files and resume each "
        "other's state. Fix: wait for that run to end (or stop it), or give "
        "this run another dirpath."
    )


def _warn_unlocked(dirpath: Path, why: str) -> None:
    global _warned_unlocked
    if not _warned_unlocked:
        _warned_unlocked = True
        warnings.warn(
            f"Checkpoint: cannot lock {str(dirpath)!r} ({why}): a second run in "
            "this directory would not be refused. Run one at a time per dirpath.",
            RuntimeWarning,
            stacklevel=3,
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
        check_int(n, name, minimum=1, owner="Checkpoint", example=1, allow_none=True)


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
    """Half-written files of a killed run (never a checkpoint: see atomic_save);
    a directory of that name is not fitlib's: it stays, with a warning."""
    for tmp in dirpath.glob(".*.pth.*.tmp"):
        if tmp.is_dir() and not tmp.is_symlink():
            warnings.warn(
                f"Checkpoint: {str(tmp)!r} is a directory named like fitlib's "
                "temporary files; it was left alone. Fix: rename it, or move it "
                f"out of {str(dirpath)!r}.",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        tmp.unlink(missing_ok=True)


# -- the files of a checkpoint directory -------------------------------------------
class CheckpointFileError(ValueError):
    """A checkpoint that cannot be resumed from: damaged, not a fitlib
    checkpoint, or no file at all (a directory, a dangling link). ``path``
    names the entry and ``reason`` says what is wrong with it, said of it
    (``"is a directory"``); ``str()`` is both, with no fix: the caller knows
    what to do."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path, self.reason = Path(path), reason
        super().__init__(f"{str(self.path)!r} {reason}")

    def __reduce__(self) -> tuple:
        return type(self), (self.path, self.reason)


def numbered(dirpath: Path) -> list[tuple[int, Path]]:
    """Every entry named ``checkpoint-<number>.pth`` (files or not), oldest first."""
    found = [(int(m[1]), p) for p in dirpath.glob("checkpoint-*.pth")
             if (m := CHECKPOINT_NAME.fullmatch(p.name))]  # fmt: skip
    return sorted(found)


def checkpoint_files(dirpath: Path) -> list[Path]:
    """The regular files named ``checkpoint-<number>.pth`` in ``dirpath``,
    oldest first (not a directory or dangling link bearing such a name)."""
    return [p for _, p in numbered(dirpath) if p.is_file()]


def not_a_file(path: Path) -> str | None:
    """Why ``path`` is no file to load (``"is a directory"``...), or None."""
    if path.is_file():
        return None
    if path.is_dir():  # (a link to one too)
        return "is a directory"
    if path.exists():
        return "is not a regular file"
    if path.is_symlink():
        return "is a symbolic link to a missing file"
    return "does not exist"


def read_checkpoint(path: Path, newest: int) -> dict:
    """Loads a checkpoint file (format up to ``newest``), checking that it
    holds every entry a resume reads.

    Raises:
        CheckpointFileError: ``path`` is no file, is damaged (any ValueError of
            ``safe_load``), is not a fitlib checkpoint or lacks entries.
        ValueError: a newer fitlib wrote it.
    """
    odd = not_a_file(path)
    if odd:
        raise CheckpointFileError(path, odd)
    try:
        saved = safe_load(path, map_location="cpu")
    except (ValueError, FileNotFoundError) as e:  # (its fix is the caller's)
        raise CheckpointFileError(path, why_unloadable(e, path)) from e
    version = saved.get("fitlib_checkpoint") if isinstance(saved, dict) else None
    if type(version) is int and version > newest:
        raise ValueError(
            f"{str(path)!r} is a checkpoint of a newer fitlib (format {version}; "
            f"this one reads up to {newest}). Fix: upgrade fitlib."
        )
    if version not in (1, newest) or type(version) is not int:
        raise CheckpointFileError(path, "is not a fitlib Checkpoint file")
    wanted = [*_ENTRIES, "run" if version > 1 else "opt_class"]
    missing = [k for k in wanted if k not in saved]
    position = saved.get("position")
    if isinstance(position, dict):
        missing += [f"position.{k}" for k in Position._fields if k not in position]
    elif "position" not in missing:
        missing.append("position")
    if missing:
        raise CheckpointFileError(
            path,
            f"lacks the entries {missing} that a fitlib checkpoint holds "
            "(damaged, or written by another program)",
        )
    return saved


def why_unloadable(error: Exception, path: Path) -> str:
    """What ``safe_load``'s error says is wrong with ``path``, said of it
    (``"is damaged: ..."``), without its name in front nor its fix: for a
    message of the caller's own."""
    if isinstance(error, DamagedFileError):
        return error.reason
    if isinstance(error, FileNotFoundError):
        return "does not exist"
    text = str(error).split(" Fix: ")[0].rstrip(". ")
    return text.removeprefix(f"{str(path)!r} ")


def listing(dirpath: Path) -> str:
    """The checkpoint files in ``dirpath``, for messages."""
    names = [p.name for p in checkpoint_files(dirpath)]
    names += ["best.pth"] if (dirpath / "best.pth").is_file() else []
    return ", ".join(names) if names else "none"


def _example(dirpath: Path) -> str:
    """A checkpoint's name to show in a message: the newest there, if any."""
    names = [p.name for p in checkpoint_files(dirpath)]
    return names[-1] if names else "checkpoint-000040.pth"


def resume_path(value: Any, dirpath: Path, resume: bool) -> Path | None:
    """The file ``Checkpoint(resume_from=value)`` names, checked: a file name
    in ``dirpath``, ``"best"`` (``best.pth``), ``"last"`` (None: the newest
    intact checkpoint) or a path with a directory."""
    if value is None or value == "last":
        return None
    if not isinstance(value, (str, os.PathLike)) or str(value) == "":
        raise TypeError(
            "Checkpoint: resume_from must be a file name in dirpath, a path, "
            f"'best', 'last' or None; got {value!r} ({type(value).__name__}). Fix: "
            "e.g. Checkpoint(dir, resume_from='checkpoint-000040.pth')."
        )
    if not resume:
        raise ValueError(
            f"Checkpoint: resume_from={str(value)!r} with resume=False: nothing "
            "would be resumed. Fix: leave resume at True, or resume_from out."
        )
    path = Path("best.pth" if value == "best" else value)
    path = dirpath / path if path.parent == Path() else path
    odd = not_a_file(path)
    if odd:
        raise ValueError(
            f"Checkpoint: resume_from={str(value)!r}: {str(path)!r} {odd}. The "
            f"checkpoints in {str(dirpath)!r}: {listing(dirpath)}. Fix: name one of "
            f"them (e.g. resume_from={_example(dirpath)!r}), or leave resume_from "
            "out to resume from the newest."
        )
    return path


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
