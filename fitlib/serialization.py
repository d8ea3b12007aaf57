"""Atomic saves and checked loads of training state.

A save never leaves a half-written file under the final name: it writes a
temporary file in the same directory (``.<name>.<random>.tmp``), flushes and
fsyncs it, renames it over the target (atomic on POSIX), then fsyncs the
directory so the rename itself survives a power cut. The file gets the mode a
plain ``open(path, "w")`` would give it: ``0o666`` less the umask when it is
new, the old file's mode when it replaces one. A save that cannot be written
(a full disk) raises ``file_errors.SaveError`` naming the file, and leaves
the old one.

Saves always store a CRC-32 per member, even while the user has turned
them off for ``torch.save`` (``torch.serialization.set_crc32_options``).
Loads first check every member of the file's zip archive against the CRC-32
``torch.save`` stored with it (``torch.load`` does not), and refuse a damaged
file with ``file_errors.DamagedFileError``; then they use
``torch.load(weights_only=True)`` on the same open file (the bytes checked
are the bytes loaded): fitlib never unpickles objects that could run code.
"""

from __future__ import annotations

import copy as copy_module
import os
import pickle
import re
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch

from fitlib.file_errors import (
    DamagedFileError,
    failed_write,
    save_error,
    tensor_bytes,
    verify_file,
)
from fitlib.sharding import is_dtensor, load_model, plain_keys, unwrap


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """Saves ``obj`` with ``torch.save`` so that ``path`` is never half written.

    Raises:
        SaveError: the file could not be written (e.g. no space left on the
            device); ``path`` keeps what it held.

    Examples:
        >>> from fitlib.serialization import atomic_save
        >>> print(atomic_save({"model": model.state_dict()}, "models/stage1.pth"))
        models/stage1.pth
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with (
        atomic_write(path, "wb", size=lambda: tensor_bytes(obj)) as f,
        _checksums_on(),
    ):
        torch.save(obj, f)
    return path


@contextmanager
def _checksums_on() -> Iterator[None]:
    """CRC-32s written by ``torch.save`` within, whatever the user set (a file
    without them cannot be verified as it loads); the setting is put back."""
    options = torch.serialization
    before = options.get_crc32_options()
    options.set_crc32_options(True)
    try:
        yield
    finally:
        options.set_crc32_options(before)


@contextmanager
def atomic_write(
    path: str | os.PathLike,
    mode: str = "wb",
    newline: str | None = None,
    *,
    size: Any = None,
) -> Iterator[IO]:
    """A file to write that replaces ``path`` only once it is complete (and
    on disk); an error inside the ``with`` leaves ``path`` as it was (a write
    that fails, e.g. on a full disk, raises ``SaveError`` naming ``path``).

    Args:
        path: the file to write.
        mode: ``open``'s mode ("wb", or "w" for text).
        newline: ``open``'s newline, for text.
        size: None, or a function returning how many bytes the save needs
            (named by the ``SaveError`` of a full disk).

    Examples:
        >>> import csv
        >>> from fitlib.serialization import atomic_write
        >>> with atomic_write("log.csv", "w", newline="") as f:
        ...     csv.writer(f).writerows([["epoch", "loss"], [0, 0.5]])
        >>> open("log.csv").read().splitlines()
        ['epoch,loss', '0,0.5']
    """
    path = Path(path)
    tmp = None
    try:
        tmp, fd = new_temporary(path)  # (tmp stays None if it fails)
        with os.fdopen(fd, mode, newline=newline) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        _keep_mode(path, tmp)
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        failed = failed_write(e) if isinstance(e, Exception) else None
        if failed is None:
            raise
        raise save_error(path, failed, size, created=tmp is not None) from e
    fsync_dir(path.parent)


def new_temporary(path: Path) -> tuple[Path, int]:
    """A new file next to ``path``, created as ``open()`` creates one: mode
    0o666 less the umask (``mkstemp`` would make it 0o600). ``O_EXCL`` (and
    ``O_NOFOLLOW``) never open a link planted under the name: it is skipped."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    flags |= getattr(os, "O_NOFOLLOW", 0)
    for _ in range(16):  # 48 random bits: a clash is all but impossible
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return tmp, os.open(tmp, flags, 0o666)
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temporary file next to {path}")


def _keep_mode(path: Path, tmp: Path) -> None:
    """Gives ``tmp`` the mode of the file it replaces, as an overwrite keeps it."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return
    os.chmod(tmp, mode)


def host_copy(x: Any) -> Any:
    """``x`` with every tensor copied to the host (dicts, lists, tuples kept).

    Copies from a GPU are queued without waiting, then awaited once per
    device: one sync for the whole structure, not one per tensor. The slices
    of a sharded model (``DTensor``) are copied where they are: a slice is
    small, and a ``DTensor`` belongs to its device.

    Examples:
        >>> from fitlib.serialization import host_copy
        >>> saved = host_copy(model.state_dict())
        >>> saved["0.weight"].device
        device(type='cpu')
    """
    devices: set[torch.device] = set()
    copy = _host_copy(x, devices)
    for device in devices:  # the host may read the copies only after this
        torch.cuda.synchronize(device)
    return copy


def _host_copy(x: Any, devices: set) -> Any:
    if is_dtensor(x):  # a shard of a sharded model: its mesh is on its device
        return x.detach().clone()
    if isinstance(x, torch.Tensor):
        cuda = x.device.type == "cuda"
        if cuda:
            devices.add(x.device)
        return x.detach().to("cpu", copy=True, non_blocking=cuda)
    if isinstance(x, dict):
        return {k: _host_copy(v, devices) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_host_copy(v, devices) for v in x)
    return copy_module.deepcopy(x)


def fsync_dir(directory: Path) -> None:
    """Makes a rename or creation in ``directory`` survive a power cut."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def safe_load(
    path: str | os.PathLike, map_location: Any = None, mmap: bool = False
) -> Any:
    """Loads a file written by ``atomic_save`` with ``weights_only=True``,
    once ``verify_file`` has found every byte as it was saved.

    The file is opened once: checked, then loaded from the same open file,
    so a file that replaces it in between is not loaded unchecked.
    ``mmap=True`` maps the tensors' storage instead of copying it; torch maps
    a file by its name, so there the file is checked, then opened again by
    name (a file swapped in between those two steps would load unchecked:
    only ``best.pth``'s best value is read that way in fitlib).

    Raises:
        FileNotFoundError: no file at ``path``.
        DamagedFileError: (a ValueError) the file is truncated, corrupt or not
            a torch save file, or its bytes do not match their checksums.
        ValueError: the file holds Python objects other than tensors and
            plain values.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no saved state at {str(path)!r}. Fix: check the name, or call "
            "save() first."
        )
    if mmap:
        verify_file(path)
        return _load(path, path, map_location, mmap=True)
    with open(path, "rb") as f:
        verify_file(path, f)
        f.seek(0)
        return _load(path, f, map_location, mmap=False)


def _load(path: Path, source: Any, map_location: Any, mmap: bool) -> Any:
    """``torch.load(weights_only=True)`` of ``source`` (``path`` or the file
    opened from it), its errors said as fitlib's."""
    try:
        return torch.load(
            source, map_location=map_location, weights_only=True, mmap=mmap
        )
    except Exception as e:
        objects = _unsafe_objects(path, e)
        if objects:
            raise ValueError(
                f"{str(path)!r} holds Python objects other than tensors, numbers, "
                f"strings, lists and dicts ({', '.join(objects[:5])}). fitlib "
                "refuses to unpickle objects that could run code. Fix: save the "
                "state with plain values only, e.g. torch.save("
                "model.state_dict(), path), or a callback's state_dict() that "
                "returns tensors, numbers, strings, lists and dicts."
            ) from None
        reason = (
            f"is damaged: truncated, corrupt or not a fitlib/torch save file "
            f"({path.stat().st_size} bytes){_loader_said(e)}"
        )
        fix = "load an earlier save"
        raise DamagedFileError(path, reason, fix=fix, note="") from (
            None if "weights_only" in str(e) else e  # never its advice
        )


def _unsafe_objects(path: Path, error: Exception) -> list[str]:
    """The classes and functions a file names that ``weights_only`` refuses
    (``[]``: the file is damaged instead)."""
    if not isinstance(error, pickle.UnpicklingError):
        return []
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # not a zip file (the legacy format): read torch's words
        return re.findall(r"GLOBAL ([\w.]+)", str(error))


def _loader_said(error: Exception) -> str:
    """torch's reason, unless it advises ``weights_only=False``; then only the
    unpickler's own words, if any."""
    message = str(error)
    if "weights_only" in message:
        found = re.search(r"WeightsUnpickler error:\s*(.+?)\n", message)
        return f"; the loader said: {found[1].strip()}" if found else ""
    return f"; the loader said: {type(error).__name__}: {message}"


def check_model_state(model: torch.nn.Module, state: dict, source: str) -> None:
    """Raises a ValueError listing what does not match when ``state`` cannot
    load into ``model`` (keys and shapes); changes nothing. A wrapped model
    (DDP, ``torch.compile``) is checked as its plain model, and the keys of
    ``state`` may carry the wrappers' prefixes (``sharding.plain_keys``)."""
    if not isinstance(state, dict):
        raise ValueError(
            f"{source} holds no model state: its 'model' entry is a "
            f"{type(state).__name__}, not a dict of tensors. Fix: load a file "
            "that fitlib saved (Learner.save or Checkpoint)."
        )
    own = unwrap(model).state_dict()
    state = plain_keys(state, own.keys())
    missing = sorted(own.keys() - state.keys())
    unexpected = sorted(state.keys() - own.keys())
    mismatched = [
        f"{k}: saved {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own.keys() & state.keys()
        if hasattr(state[k], "shape") and state[k].shape != own[k].shape
    ]
    if missing or unexpected or mismatched:
        raise ValueError(
            f"{source} was saved from a different model. Missing keys: "
            f"{_short(missing)}; unexpected keys: {_short(unexpected)}; shape "
            f"mismatches: {_short(sorted(mismatched))}. Fix: build the same "
            "model (architecture and sizes) before loading."
        )


def load_model_state(model: torch.nn.Module, state: dict, source: str) -> None:
    """``model.load_state_dict`` with an error that lists what does not match
    (a whole state: for a model sharded by FSDP, every rank calls it)."""
    check_model_state(model, state, source)
    load_model(model, state)


def optimizer_identity(opt: Any) -> dict:
    """What a saved optimizer state must match to load into ``opt`` (an
    ``HPOptimizer``, a torch optimizer, or a ``MultiOptimizer``: each part's
    class): its class and number of groups."""
    parts = getattr(opt, "parts", None)  # a MultiOptimizer: each part's class
    if parts is not None:
        kinds = ", ".join(f"{n}={type(p.opt).__name__}" for n, p in parts.items())
        return {"opt_class": f"MultiOptimizer({kinds})",
                "param_groups": len(opt.param_groups)}  # fmt: skip
    inner = getattr(opt, "opt", opt)
    return {"opt_class": type(inner).__name__, "param_groups": len(inner.param_groups)}


def optimizer_differences(
    opt: Any, state: dict, saved: dict | None, whose: tuple[str, str]
) -> list[str]:
    """How the optimizer state ``state`` (saved with ``optimizer_identity``'s
    ``saved``, or a part of it; None in files written before fitlib kept it)
    differs from ``opt``, one line each (``[]``: it loads). ``whose`` names
    the two sides in the lines, e.g. ``("the file's", "this Learner's")``."""
    own = optimizer_identity(opt)
    inner = opt if hasattr(opt, "parts") else getattr(opt, "opt", opt)
    groups = _saved_groups(state)
    saved = {"opt_class": None, "param_groups": len(groups), **(saved or {})}
    theirs, ours = whose
    found = []
    if saved["opt_class"] not in (None, own["opt_class"]):
        found.append(
            f"optimizer: {theirs} {saved['opt_class']}, {ours} {own['opt_class']}"
        )
    sizes = [len(g["params"]) for g in groups]
    own_sizes = [len(g["params"]) for g in inner.param_groups]
    if saved["param_groups"] != own["param_groups"]:
        found.append(
            f"parameter groups: {theirs} {saved['param_groups']}, "
            f"{ours} {own['param_groups']}"
        )
    elif sizes != own_sizes:
        found.append(f"parameters per group: {theirs} {sizes}, {ours} {own_sizes}")
    if saved["opt_class"] is None and groups and not hasattr(opt, "parts"):  # old file
        keys, own_keys = _hyper_keys(groups[0]), _hyper_keys(inner.defaults)
        if keys != own_keys:
            found.append(
                f"hyper-parameters: {theirs} groups have {sorted(keys)}, "
                f"{ours} {own['opt_class']} has {sorted(own_keys)}"
            )
    return found


def _saved_groups(state: dict) -> list[dict]:
    """The parameter groups of an ``HPOptimizer`` or torch optimizer state."""
    if isinstance(state.get("parts"), dict):  # a MultiOptimizer's, part by part
        return [g for part in state["parts"].values() for g in _saved_groups(part)]
    state = state.get("opt", state) if "param_groups" not in state else state
    return list(state.get("param_groups", []))


def _hyper_keys(group: dict) -> set[str]:
    """A group's numeric hyper-parameters (``lr``, ``betas``, ``momentum``...),
    not its flags nor what fitlib or torch's schedulers add."""

    def numeric(v: Any) -> bool:
        if isinstance(v, (tuple, list)):
            return bool(v) and all(numeric(x) for x in v)
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        return number or isinstance(v, torch.Tensor)

    return {
        k
        for k, v in group.items()
        if numeric(v)
        and k not in ("params", "initial_lr")
        and not k.startswith("fitlib_")
    }


def _short(items: list[str], n: int = 8) -> str:
    if not items:
        return "none"
    more = f" (and {len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more
