"""Files that cannot be trusted, and saves that cannot be written, said clearly.

``torch.save`` stores a CRC-32 with every member of its zip archive, but
``torch.load`` does not check them: ``verify_file`` does, and raises
``DamagedFileError`` (a ``ValueError``) naming the file and the member. A
file written while ``torch.serialization.set_crc32_options(False)`` was in
effect holds CRC 0 for every member: it cannot be verified, and loads with a
warning that says so (``atomic_save`` always writes the checksums). A write
that fails inside an atomic save (a full disk: torch says only "unexpected
pos") becomes a ``SaveError`` (an ``OSError`` with the system's errno, and a
``RuntimeError`` as torch's error was) naming the file, what the save needed
and what the device has.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import IO, Any

import torch

_DAMAGED_FIX = "load an earlier save, or copy the file again from where it came from"
_DAMAGED_NOTE = (
    "Loading it would give values that were never saved (a flipped bit on the "
    "disk or in a copy, or a file changed after it was written). "
)


class DamagedFileError(ValueError):
    """A saved file whose bytes are not those that were written (a flipped
    bit, a truncated or overwritten file): loading it would give values that
    were never saved.

    Its parts let a caller say it in its own words: ``path``; ``reason``, what
    is wrong, said of the file (``"is damaged: the bytes of member ... do not
    match their CRC-32"``, no fix); ``fix``, what to do (no ``"Fix:"``).
    ``str()`` is the whole message: path, reason, ``note`` (what loading it
    would do, when said) and fix.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        reason: str,
        fix: str = _DAMAGED_FIX,
        note: str = _DAMAGED_NOTE,
    ) -> None:
        self.path, self.reason, self.fix = Path(path), reason, fix
        self._note = note
        super().__init__(f"{str(self.path)!r} {reason}. {note}Fix: {fix}.")

    def __reduce__(self) -> tuple:  # pickled with its parts (multiprocessing)
        return type(self), (self.path, self.reason, self.fix, self._note)


class SaveError(OSError, RuntimeError):
    """A save that could not be written (a full disk, an I/O error); ``errno``
    is the system's, and the file it would have replaced is unchanged. An
    ``OSError``, and a ``RuntimeError`` as torch's own error for a full disk
    was: code that caught that around ``save()`` still catches it."""


def verify_file(path: str | os.PathLike, file: IO[bytes] | None = None) -> None:
    """Raises ``DamagedFileError`` unless every member of the zip archive at
    ``path`` (the format of ``torch.save``) matches the CRC-32 stored with it.

    ``torch.load`` does not check these checksums: without this, one flipped
    bit in a stored weight loads as a value that was never saved. Reading the
    whole file costs 35 to 50 ms per 100 MB from the page cache. A file in
    torch's legacy format (not a zip) holds no checksums and is not checked;
    nor is one whose members all hold CRC 0 (written while
    ``torch.serialization.set_crc32_options(False)`` was in effect): it
    loads with a warning naming the file. ``file``, when given, is ``path``
    opened for reading: it is read instead (from its start), so that the
    bytes checked are those the caller then loads from it.

    Examples:
        >>> from fitlib.file_errors import verify_file
        >>> path = learn.save("stage1")
        >>> verify_file(path)  # raises if a byte changed
        >>> raw = bytearray(path.read_bytes())
        >>> raw[len(raw) // 2] ^= 1  # one flipped bit
        >>> _ = path.write_bytes(raw)
        >>> verify_file(path)
        Traceback (most recent call last):
        ...
        fitlib.file_errors.DamagedFileError: 'models/stage1.pth' is damaged: the
        bytes of member 'archive/data/0' (a stored tensor's values) do not match
        their CRC-32. ...
    """
    path = Path(path)
    source = path if file is None else file
    if not zipfile.is_zipfile(source):
        return  # legacy format, or no zip at all: torch.load says which
    try:
        with zipfile.ZipFile(source) as archive:
            members = archive.infolist()
            if _without_checksums(members):
                _warn_unverified(path)
                return
            for info in members:
                _verify_member(archive, info, path)
    except zipfile.BadZipFile as e:  # its directory of members is damaged
        reason = f"is damaged: its zip directory cannot be read ({e})"
        raise DamagedFileError(path, reason) from None


def _without_checksums(members: list[zipfile.ZipInfo]) -> bool:
    """Whether every member that holds bytes has CRC 0: torch wrote none (a
    real CRC-32 is 0 once in 4 billion members)."""
    sizes = [info.CRC for info in members if info.file_size]
    return len(sizes) > 1 and not any(sizes)


def _warn_unverified(path: Path) -> None:
    warnings.warn(
        f"{str(path)!r} was saved without checksums (every member's CRC-32 is "
        "0: it was written while torch.serialization.set_crc32_options(False) "
        "was in effect), so it cannot be verified: it loads unchecked. "
        "fitlib's own saves always write them; save this file again with "
        "torch.serialization.set_crc32_options(True) to have it checked.",
        UserWarning,
        stacklevel=4,
    )


def _verify_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, path: Path) -> None:
    """Reads one member to its end, where zipfile compares its CRC-32."""
    try:
        with archive.open(info) as member:
            while member.read(1 << 22):
                pass
    except (zipfile.BadZipFile, EOFError, zlib.error) as e:
        pickled = info.filename.endswith(".pkl")
        what = "the keys and plain values" if pickled else "a stored tensor's values"
        wrong = (
            "do not match their CRC-32" if "CRC" in str(e) else f"cannot be read ({e})"
        )
        reason = f"is damaged: the bytes of member {info.filename!r} ({what}) {wrong}"
        raise DamagedFileError(path, reason) from None


_TORCH_WRITE_FAILED = re.compile(r"unexpected pos|file write failed|failed writing")
_NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
_WRITE_FAILED = (*_NO_SPACE, errno.EIO, errno.EFBIG, errno.EROFS)


def failed_write(error: BaseException) -> BaseException | None:
    """The failed write behind ``error`` (an OSError; torch's "unexpected
    pos", a short write, when no OSError is behind it), or None when
    ``error`` is not one (a value that cannot be pickled, say)."""
    if isinstance(error, OSError):
        return error if error.errno in _WRITE_FAILED else None
    if not (isinstance(error, RuntimeError) and _TORCH_WRITE_FAILED.search(str(error))):
        return None
    behind = error.__cause__ or error.__context__
    while behind is not None and not isinstance(behind, OSError):
        behind = behind.__cause__ or behind.__context__
    return behind or error


def save_error(
    path: Path, error: BaseException, size: Any, created: bool = True
) -> SaveError:
    """The error that says which save failed, why, and what to do. A short
    write with no errno is taken for a full disk (what makes writes short).
    ``created``: the temporary file was made (and is now removed)."""
    number = getattr(error, "errno", None) or errno.ENOSPC
    said = f"{type(error).__name__}: {error}"
    if number in _NO_SPACE:
        why = f"no space left on the device ({said}){_room(path, size)}"
        fix = "free space on that device, or save to another directory"
    elif number == errno.EFBIG:
        why = f"the file would pass the size limit for files ({said})"
        fix = (
            "raise the process's file size limit (ulimit -f), or save to a file "
            "system that allows files this large"
        )
    elif number == errno.EROFS:
        why = f"the device is read-only ({said})"
        fix = "save to a directory on a writable device"
    else:
        why = f"the write failed ({said})"
        fix = "check the device (its system log says more), then save again"
    kept = (
        "the file keeps what it held"
        if path.exists()
        else "no file was left under that name"
    )
    done = (
        f"The partial temporary file was removed; {kept}"
        if created
        else f"No temporary file could be created; {kept}"
    )
    return SaveError(
        number, f"could not save {str(path)!r}: {why}. {done}. Fix: {fix}."
    )


def _room(path: Path, size: Any) -> str:
    """What the save needs and what the device has, as far as known."""
    parts = []
    needed = size() if size is not None else None
    if needed:
        parts.append(f"the save needs about {needed:,} bytes (its tensors)")
    try:
        free = shutil.disk_usage(path.parent).free
        parts.append(f"the device has {free:,} bytes free")
    except OSError:
        pass
    return f"; {', '.join(parts)}" if parts else ""


def tensor_bytes(obj: Any) -> int:
    """The bytes of the distinct tensor storages in ``obj`` (dicts, lists)."""
    seen: dict[tuple, int] = {}

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            seen[(x.device, storage.data_ptr())] = storage.nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    try:
        walk(obj)
    except Exception:  # a DTensor, a tensor subclass...: the size stays unknown
        return 0
    return sum(seen.values())
