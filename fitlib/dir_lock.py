"""The lock on a checkpoint directory: ``DirLock``, an exclusive ``flock``
held by one run, and what it says about the run that holds it."""

from __future__ import annotations

import datetime
import errno
import os
import shlex
import socket
import stat
import sys
import warnings
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

LOCK_NAME = ".fitlib.lock"
_warned_unlocked = False


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
