"""Atomic saves and checked loads of training state.

A save never leaves a half-written file under the final name: it writes a
temporary file in the same directory, flushes and fsyncs it, renames it over
the target (atomic on POSIX), then fsyncs the directory so the rename itself
survives a power cut. Loads use ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import copy as copy_module
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from fitlib.sharding import is_dtensor, load_model


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """Saves ``obj`` with ``torch.save`` so that ``path`` is never half written.

    Example:
        >>> atomic_save({"model": model.state_dict()}, "models/stage1.pth")
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def host_copy(x: Any) -> Any:
    """``x`` with every tensor copied to the host (dicts, lists, tuples kept).

    Copies from a GPU are queued without waiting, then awaited once per
    device: one sync for the whole structure, not one per tensor. The slices
    of a sharded model (``DTensor``) are copied where they are: a slice is
    small, and a ``DTensor`` belongs to its device.

    Example:
        >>> saved = host_copy(model.state_dict())
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


def safe_load(path: str | os.PathLike, map_location: Any = None) -> Any:
    """Loads a file written by ``atomic_save`` with ``weights_only=True``.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is truncated, corrupt or not a torch save file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no saved state at {str(path)!r}. Fix: check the name, or call "
            "save() first."
        )
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise ValueError(
            f"could not read {str(path)!r} ({path.stat().st_size} bytes): the "
            "file is truncated, corrupt or not a fitlib/torch save file. Fix: "
            f"load an earlier save. Loader said: {type(e).__name__}: {e}"
        ) from e


def load_model_state(model: torch.nn.Module, state: dict, source: str) -> None:
    """``model.load_state_dict`` with an error that lists what does not match
    (a whole state: for a model sharded by FSDP, every rank calls it)."""
    own = model.state_dict()
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
    load_model(model, state)


def _short(items: list[str], n: int = 8) -> str:
    if not items:
        return "none"
    more = f" (and {len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more
