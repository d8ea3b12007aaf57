"""The memory a few training steps take at their peak, on the CPU or CUDA;
sizes of memory read and shown (``parse_bytes``, ``format_bytes``); and
whether an error is the device running out of memory.

On CUDA the caching allocator keeps the count: ``torch.cuda.max_memory_allocated``
after ``reset_peak_memory_stats``. The CPU allocator keeps none that Python
can read, and the process's resident size (RSS) is no measure: malloc keeps
freed pages and the page cache, the data set and the interpreter share it,
so it moves by megabytes between two identical steps. ``TensorBytes``
counts instead what the steps hold in tensors: it starts from the tensors it
is given (the model's parameters, buffers and gradients, the optimizer's
state), adds the storage of every tensor an operation creates (batches,
activations saved for backward, gradients, optimizer state, temporaries;
not a view of a storage it did not create, such as a ``TensorDataset``'s
items, views of the data set) and takes it off when the storage is freed;
the peak of that sum is the memory the steps need. It is exact for what it
counts and the same on every run; it leaves out what no tensor holds: the
allocator's rounding, kernels' scratch space, Python objects, the data set
and DataLoader workers. Against the CPU allocator's own peak (read with
``torch.profiler``'s memory events) a step of an MLP counted the same to
within 12 bytes (3.287 MB); a step of a small convnet (two 3x3 convolutions,
batch of 64 32x32 images) counted 41.9 MB of the allocator's 50.4 MB, 17%
less: convolutions' scratch space. Leave that margin in a budget.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fitlib.errors import ArgTypeError, is_int, is_number

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(value: Any, name: str = "max_memory", owner: str = "") -> int:
    """``value`` as a number of bytes: an int, or a string such as ``"2GB"``,
    ``"1.5 GiB"`` or ``"800MB"`` (GB = 10**9 bytes, GiB = 2**30).

    Examples:
        >>> from fitlib.peak_memory import parse_bytes
        >>> parse_bytes("2GB"), parse_bytes("1.5 GiB"), parse_bytes(4096)
        (2000000000, 1610612736, 4096)
    """
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value) if (
        isinstance(value, str)) else None  # fmt: skip
    if found and found[2].lower() in _UNITS:
        n = int(float(found[1]) * _UNITS[found[2].lower()])
    elif is_int(value) or (is_number(value) and float(value).is_integer()):
        n = int(value)
    else:
        n = None
    if n is None or n < 1:
        a_size = isinstance(value, (str, int, float)) and not isinstance(value, bool)
        raise (ValueError if a_size else ArgTypeError)(
            f"{owner + ': ' if owner else ''}{name} must be a size of memory: a "
            f"number of bytes >= 1 or a string such as '2GB', '512MB' or '1.5GiB'; "
            f"got {value!r} ({type(value).__name__}). Fix: e.g. {name}='2GB'."
        )
    return n


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest decimal unit below it, 4 significant digits.

    Examples:
        >>> from fitlib.peak_memory import format_bytes
        >>> format_bytes(1_234_567_890), format_bytes(2_000), format_bytes(12)
        ('1.235 GB', '2 kB', '12 B')
    """
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{int(n)} B"


# What a RuntimeError says when memory ran out where torch raises no
# OutOfMemoryError: other backends, cuBLAS's workspace, cuDNN refusing a batch
# too large (pytorch#4107), the CPU allocator.
_OUT_OF_MEMORY = ("out of memory", "cublas_status_alloc_failed",
                  "cudnn_status_not_supported", "can't allocate memory")  # fmt: skip


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says the device ran out of memory: torch's
    ``OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``), or a
    ``RuntimeError`` that says so (``out of memory``,
    ``CUBLAS_STATUS_ALLOC_FAILED``, cuDNN's ``CUDNN_STATUS_NOT_SUPPORTED``,
    the CPU allocator's ``can't allocate memory``)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in _OUT_OF_MEMORY)


class OverBudget(Exception):  # noqa: N818 (a condition, not a failure)
    """Raised by ``TensorBytes`` as soon as the tensors held pass its limit,
    so a step that needs more than the budget stops before it takes it all."""

    def __init__(self, held: int, limit: int) -> None:
        super().__init__(
            f"the tensors held reached {format_bytes(held)}, over the budget of "
            f"{format_bytes(limit)}"
        )
        self.held, self.limit = held, limit


class TensorBytes(TorchDispatchMode):
    """Counts the bytes held in tensor storages while it is active (a
    ``with`` block), and their ``peak``: the tensors it is given to start
    with (``start``: a step's parameters, gradients, buffers, optimizer
    state), and every storage an operation creates (batches, activations
    saved for backward, gradients, temporaries) until it is freed. With
    ``limit``, raises ``OverBudget`` once the count passes it.

    What the CPU's memory is for a training step: its allocator keeps no
    peak that Python can read, and the process's resident size moves
    between two identical steps (malloc keeps freed pages). This count is
    exact for what it counts and the same on every run; it leaves out what
    no tensor holds: the allocator's rounding, kernels' scratch space,
    Python objects, the data set, DataLoader workers.

    Examples:
        >>> from fitlib.peak_memory import TensorBytes
        >>> x, y = torch.randn(64, 8), torch.zeros(64).long()
        >>> with TensorBytes(model.parameters()) as held:
        ...     F.cross_entropy(model(x), y).backward()
        >>> held.peak > held.start > 0
        True
    """

    def __init__(self, tensors: Iterable[Any] = (), limit: int | None = None) -> None:
        super().__init__()
        self.limit = limit
        self.held = self.peak = 0
        self._sizes: dict[int, int] = {}
        for t in tensors:
            self._add(t)
        self.start = self.held

    def _add(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return
        storage = t.untyped_storage()
        key = _storage_key(t)  # the storage's address: unique while it lives
        if key in self._sizes:
            return
        self._sizes[key] = n = storage.nbytes()
        self.held += n
        self.peak = max(self.peak, self.held)
        # torch keeps a storage's Python object as long as the storage lives,
        # so this runs when the memory is freed.
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.held -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # An output that shares an input's storage (a view, an in-place
        # result: a TensorDataset's item, a slice of the data set) holds no
        # new memory: counting its storage would count the whole data set.
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs))}
        for t in tree_leaves(out):
            if _storage_key(t) not in inputs:
                self._add(t)
        if self.limit is not None and self.held > self.limit:
            raise OverBudget(self.held, self.limit)
        return out


def _storage_key(t: Any) -> int | None:
    """The address of ``t``'s storage (None for what is not a strided tensor)."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        return None
    return t.untyped_storage()._cdata


def held_tensors(model: torch.nn.Module, opt: Any) -> list[torch.Tensor]:
    """What a training step holds from its start to its end: the model's
    parameters, their gradients, its buffers and the optimizer's state."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    state = opt.state_dict() if hasattr(opt, "state_dict") else {}
    return tensors + [t for t in tree_leaves(state) if isinstance(t, torch.Tensor)]


class PeakMemory:
    """The peak memory of the code in a ``with`` block on ``device``, in
    ``peak`` (bytes) after it: CUDA's allocator statistics on a CUDA
    device, else a ``TensorBytes`` count started from ``tensors`` (raising
    ``OverBudget`` past ``limit``; on CUDA the limit is for the caller to
    compare, after the block).

    Examples:
        >>> from fitlib.peak_memory import PeakMemory, format_bytes
        >>> with PeakMemory("cpu", model.parameters()) as meter:
        ...     model(torch.randn(256, 8)).sum().backward()
        >>> meter.peak > 256 * 8 * 4
        True
    """

    def __init__(
        self,
        device: torch.device | str,
        tensors: Iterable[Any] = (),
        limit: int | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.tensors, self.limit = tensors, limit
        self.peak: int | None = None
        self._mode: TensorBytes | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._mode = TensorBytes(self.tensors, self.limit).__enter__()
        self.tensors = ()  # not kept alive past the block
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self.peak, self._mode = self._mode.peak, None
        else:
            self.peak = torch.cuda.max_memory_allocated(self.device)
