"""The files of a checkpoint directory: which are checkpoints
(``checkpoint-<number>.pth``), reading one and saying why it cannot be
resumed from (``CheckpointFileError``), the file ``resume_from`` names, and
the directory checked and cleaned before a fit writes it, and a file kept
for its value written once under two names (``link_or_copy``)."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

from fitlib.file_errors import DamagedFileError
from fitlib.resume import Position
from fitlib.serialization import atomic_write, fsync_dir, safe_load

CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)\.pth")
# What a checkpoint holds besides its format's own entries ("run", "opt_class").
_ENTRIES = ("model", "opt", "callbacks", "monitor", "position", "rng", "epoch_rng")


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
    found = [*dirpath.glob(".*.pth.*.tmp"), *dirpath.glob(".fitlib-best.json.*.tmp")]
    for tmp in found:
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


def link_or_copy(source: Path, path: Path) -> None:
    """Makes ``path`` hold what ``source`` holds, atomically: a hard link
    (one write for two files; replacing either later leaves the other), or a
    copy where the file system has no links."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        os.link(source, tmp)
    except OSError:  # no hard links here (or another device): copy
        with atomic_write(path) as f, open(source, "rb") as src:
            shutil.copyfileobj(src, f)
        return
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
