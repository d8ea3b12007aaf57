"""Data and devices: ``DataBunch`` (the loaders and the device), and
``batches``, which turns what a loader yields into ``(x, y)`` batches on the
model's device (``to_device``, ``unpaired`` for batches of inputs only or
dicts, ``batch_fn`` for other formats; towards CUDA, copied on a side stream
from pinned memory: ``prefetch``)."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from fitlib.checks import (
    check_flag,
    check_int,
    check_loader,
    len_or_none,
    one_shot_note,
    regroup_fix,
)
from fitlib.errors import describe, name_of, reraise
from fitlib.structure import map_tensors, tensors


class DataBunch:
    """The training and validation loaders, and the device to train on.

    Args:
        train_dl: an iterable of ``(x, y)`` batches (e.g. a ``DataLoader``);
            None for a model that is only evaluated (``valid_dl`` given).
        valid_dl: the same for validation, or None to skip validation.
        device: where the ``Learner`` puts the model; None picks CUDA when
            available, else the CPU. ``fit`` moves batches to the model's device.
        batch_fn: turns each batch the loaders yield into ``(x, y)`` (or
            inputs only); for loaders of another format (a DALI iterator's
            batch objects, a dict). Applied to every batch of every epoch,
            training and validation, before the batch moves to the device.
        prefetch: copy each batch's host tensors to a CUDA device on a side
            stream, from pinned memory (tensors the loader did not pin are
            pinned first), so the copy runs while the GPU still works on the
            steps before it; the step waits for its own batch's copy only.
            None (the default): on for the batches whose host tensors the
            loader pinned already (``DataLoader(pin_memory=True)``) where the
            fit's device is CUDA; other batches are copied as with False
            (pinning each batch on the host, synchronously, made the side
            stream slower than the plain copy: see the speed page); False:
            off (each tensor copied with ``non_blocking=True`` on the current
            stream); True: on for every batch, pinning the others first, and
            refused when ``device`` is not CUDA. The results are the same
            bit for bit: the loader is read at the same points (a batch is
            fetched when the loop asks for it, so augmentations draw their
            random numbers in the same order, and a resumed fit replays the
            same batches); reading ahead is the loader's own
            (``DataLoader(num_workers=..., pin_memory=True)``).

    Examples:
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> train_ds = TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
        >>> valid_ds = TensorDataset(torch.randn(32, 8), torch.randint(0, 3, (32,)))
        >>> DataBunch(DataLoader(train_ds, 64, shuffle=True),
        ...           DataLoader(valid_ds, 128))
        DataBunch(1 train batches, 1 valid batches, device=cpu)

        Side-stream copies asked for where there is no CUDA device:

        >>> DataBunch(DataLoader(train_ds, 64), device="cpu", prefetch=True)
        Traceback (most recent call last):
        ...
        ValueError: DataBunch: prefetch=True copies batches to a CUDA device on a
        side stream; the device is cpu. Fix: prefetch=None (the default) or
        device='cuda'.

        A loader of other batches (DALI's: a list of dicts) with ``batch_fn``:

        >>> xs, ys = torch.randn(4, 2, 8), torch.randint(0, 3, (4, 2))
        >>> dali_like = [[{"data": x, "label": y}] for x, y in zip(xs, ys)]
        >>> dali = DataBunch(dali_like,
        ...                  batch_fn=lambda b: (b[0]["data"], b[0]["label"]))
        >>> fit(1, model, F.cross_entropy, opt, dali)
        History(1 epoch: train_loss ...)
    """

    def __init__(
        self,
        train_dl: Iterable,
        valid_dl: Iterable | None = None,
        device: torch.device | str | None = None,
        batch_fn: Callable[[Any], Any] | None = None,
        prefetch: bool | None = None,
    ) -> None:
        if batch_fn is not None and not callable(batch_fn):
            raise TypeError(
                f"DataBunch: batch_fn must be a function or None; got "
                f"{batch_fn!r} ({type(batch_fn).__name__}). Fix: a function of one "
                "loader batch that returns (x, y), e.g. "
                "batch_fn=lambda b: (b.data[0], b.label[0])."
            )
        self.batch_fn = batch_fn
        # Either may be None (inference only needs valid_dl); fit checks
        # train_dl before training.
        for name, dl in (("train_dl", train_dl), ("valid_dl", valid_dl)):
            if dl is not None or (name == "train_dl" and valid_dl is None):
                check_loader(dl, name)
        self.train_dl, self.valid_dl = train_dl, valid_dl
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = check_device(device)
        if prefetch is not None:
            example = "DataBunch(train_dl, valid_dl, prefetch=False) (or left out)"
            prefetch = check_flag(prefetch, "prefetch", "DataBunch", example)
        check_prefetch(prefetch, self.device, "DataBunch")
        self.prefetch = prefetch

    def __repr__(self) -> str:
        train, valid = len_or_none(self.train_dl), len_or_none(self.valid_dl)
        prefetch = "" if self.prefetch is None else f", prefetch={self.prefetch}"
        return (
            f"DataBunch({train} train batches, {valid} valid batches, "
            f"device={self.device}{prefetch})"
        )


class FirstBatches:
    """The first ``n`` batches of each pass over ``loader``: the loader of a
    fit with ``train_batches=n`` (or ``valid_batches=n``).

    Each pass draws the loader's order as usual (a shuffled loader shuffles
    anew) and stops after ``n`` batches, without fetching another. Its length
    is ``n``, or the loader's when that is shorter (a loader without a length:
    ``n``), so the fit's ``n_steps``, the schedules, the progress bar and a
    ``Checkpoint`` (its run's batches per epoch, the batches a resumed epoch
    skips) all count the capped epoch. A one-shot iterator (a generator)
    gives each pass its next ``n`` batches, as Keras's ``steps_per_epoch``.
    The loader's ``dataset``, ``batch_size``, ``sampler``, ``batch_sampler``
    and ``generator`` (what fitlib's RNG states read) show through; the
    loader itself is ``.loader``.

    Examples:
        >>> from fitlib.data import FirstBatches
        >>> capped = FirstBatches(data.train_dl, 2)
        >>> capped, len(data.train_dl), len(capped), len(list(capped))
        (FirstBatches(DataLoader, 2 of 4 batches), 4, 2, 2)
    """

    def __init__(self, loader: Iterable, n: int) -> None:
        self.loader, self.n = loader, n

    def __iter__(self) -> Iterator:
        return itertools.islice(iter(self.loader), self.n)

    def __len__(self) -> int:
        full = len_or_none(self.loader)
        return self.n if full is None else min(self.n, full)

    @property
    def dataset(self) -> Any:
        return getattr(self.loader, "dataset", None)

    @property
    def batch_size(self) -> Any:
        return getattr(self.loader, "batch_size", None)

    @property
    def sampler(self) -> Any:
        return getattr(self.loader, "sampler", None)

    @property
    def batch_sampler(self) -> Any:
        return getattr(self.loader, "batch_sampler", None)

    @property
    def generator(self) -> Any:
        return getattr(self.loader, "generator", None)

    def __repr__(self) -> str:
        full = len_or_none(self.loader)
        return (
            f"{type(self).__name__}({type(self.loader).__name__}, {len(self)} of "
            f"{'?' if full is None else full} batches)"
        )


def limit_batches(
    data: Any, train_batches: int | None = None, valid_batches: int | None = None
) -> Any:
    """``data`` with at most ``train_batches`` training batches per epoch
    and ``valid_batches`` validation batches per validation (each a
    ``FirstBatches``; None: all), as ``fit(..., train_batches=...,
    valid_batches=...)`` trains on it: a shallow copy, ``data`` is unchanged.

    Examples:
        >>> from fitlib.data import limit_batches
        >>> data, limit_batches(data, train_batches=2, valid_batches=1)
        (DataBunch(4 train batches, 2 valid batches, device=cpu),
         DataBunch(2 train batches, 1 valid batches, device=cpu))
    """
    caps = {"train_dl": train_batches, "valid_dl": valid_batches}
    for arg, cap in (
        ("train_batches", train_batches),
        ("valid_batches", valid_batches),
    ):
        check_int(cap, arg, minimum=1, owner="fit", example=100, allow_none=True)
    if train_batches is None and valid_batches is None:
        return data
    limited = copy.copy(data)  # (the caller's data keeps its loaders)
    for name, cap in caps.items():
        loader = getattr(data, name, None)
        if cap is not None and loader is not None:
            check_loader(loader, f"data.{name}")
            setattr(limited, name, FirstBatches(loader, cap))
    return limited


def check_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device``, if torch knows it and it is available."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"device {device!r} is not a torch device ({e}). Fix: 'cpu', 'cuda', "
            "'cuda:1' or 'mps', or None to pick CUDA when available."
        ) from None
    available = {
        "cuda": torch.cuda.is_available,
        "mps": torch.backends.mps.is_available,
    }
    if device.type in available and not available[device.type]():
        raise ValueError(
            f"device {str(device)!r} is not available on this machine (torch "
            f"sees no {device.type.upper()} device). Fix: device='cpu', or None "
            "to use CUDA only where it exists."
        )
    return device


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a parameterless one)."""
    param = next(model.parameters(), None)
    return torch.device("cpu") if param is None else param.device


def to_device(x: Any, device: torch.device) -> Any:
    """Moves a tensor, or the tensors in a structure (tuple, list, dict,
    dataclass), to ``device``."""

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.device == device:
            return t
        # Asynchronous only towards CUDA: a copy to the host must be complete
        # before Python reads it.
        return t.to(device, non_blocking=device.type == "cuda")

    return map_tensors(move, x)


def batches(
    dl: Iterable,
    device: torch.device,
    name: str = "dl",
    batch_fn: Callable[[Any], Any] | None = None,
    prefetch: bool | None = None,
) -> Iterator[tuple]:
    """Yields the ``(x, y)`` batches of ``dl`` on ``device``, checking their
    form; a batch of inputs only (``(x,)`` or a tensor) comes as ``(x, ())``:
    no targets, so ``loss_func(output)``; a dict batch as ``(batch,
    batch["labels"])`` (or ``(batch, ())``), see ``unpaired``. ``batch_fn``
    first turns each batch of ``dl`` into one of those. ``prefetch``: as
    ``DataBunch(prefetch=...)`` (None: side-stream copies of pinned batches
    towards CUDA)."""
    side = side_stream_copy(device, prefetch, name)
    n = 0
    for batch in dl:
        if batch_fn is not None:
            batch = _adapted(batch_fn, batch, name, first=n == 0)
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            x, y = batch
        else:
            x, y = unpaired(batch, name)
        # to_device's common case inline (this runs per step): tensors there.
        if side is None:
            if type(x) is not torch.Tensor or x.device != device:
                x = to_device(x, device)
            if type(y) is not torch.Tensor or y.device != device:
                y = to_device(y, device)
        elif not _both_there(x, y, device):
            x, y = side((x, y))
        yield x, y
        n += 1
    # An empty sized loader was refused before training; one that says it has
    # batches and yields none is spent (a one-shot iterator). Length 0 is the
    # rest of an epoch a checkpoint resumed after its last batch.
    if n == 0 and len_or_none(dl) != 0:
        raise ValueError(
            f"{name} yielded no batches; fitlib needs at least one."
            + (one_shot_note(dl) or " Fix: check the dataset's length.")
        )


def _both_there(x: Any, y: Any, device: torch.device) -> bool:
    """Whether ``x`` and ``y`` are plain tensors on ``device`` already."""
    if type(x) is not torch.Tensor or type(y) is not torch.Tensor:
        return False
    return x.device == device and y.device == device


def side_stream_copy(
    device: torch.device, prefetch: bool | None, owner: str = "dl"
) -> _SideStreamCopy | None:
    """What copies batches to ``device`` for ``prefetch`` (see ``DataBunch``):
    a ``_SideStreamCopy`` towards CUDA unless ``prefetch`` is False (for None,
    one that takes the side stream for pinned batches only), else None (the
    plain copy); True with another device is refused, naming ``owner``."""
    check_prefetch(prefetch, device, owner)
    if device.type == "cuda" and prefetch is not False:
        return _SideStreamCopy(device, pinned_only=prefetch is None)
    return None


def check_prefetch(prefetch: bool | None, device: torch.device, owner: str) -> None:
    """Refuses ``prefetch=True`` (side-stream copies) towards a device that is
    not CUDA, naming ``owner``."""
    if prefetch and device.type != "cuda":
        raise ValueError(
            f"{owner}: prefetch=True copies batches to a CUDA device on a side "
            f"stream; the device is {device}. Fix: prefetch=None (the default) "
            "or device='cuda'."
        )


class _SideStreamCopy:
    """Copies a batch's tensors to a CUDA ``device`` on a stream of its own.

    Host tensors are pinned first (unless the loader pinned them), so the
    copy is asynchronous; the current stream then waits for the copies (on
    the GPU, not the host), and each copy is recorded as used by it, so the
    caching allocator does not hand its memory out again while a step reads
    it. ``cuda`` is ``torch.cuda`` (the tests give a stand-in). With
    ``pinned_only``, a batch with a host tensor that is not pinned is copied
    plainly instead (``to_device``: ``non_blocking`` on the current stream)."""

    def __init__(
        self, device: torch.device, cuda: Any = torch.cuda, pinned_only: bool = False
    ) -> None:
        if device.type == "cuda" and device.index is None:  # as tensors name it
            device = torch.device("cuda", cuda.current_device())
        self.device, self.cuda, self.pinned_only = device, cuda, pinned_only
        self.side = cuda.Stream(device=device)

    def __call__(self, batch: Any) -> Any:
        if self.pinned_only and not _pinned(batch):
            return to_device(batch, self.device)
        current = self.cuda.current_stream(self.device)
        copied = []

        def move(t: torch.Tensor) -> torch.Tensor:
            if t.device == self.device:
                return t
            if t.device.type == "cpu":
                new = self.upload(t)
            else:  # another GPU's: torch orders the copy with its streams
                new = t.to(self.device, non_blocking=True)
            copied.append(new)
            return new

        with self.cuda.stream(self.side):
            batch = map_tensors(move, batch)
        if copied:
            current.wait_stream(self.side)
            for t in copied:
                self.used_by(t, current)
        return batch

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor's copy on the device, started from pinned memory."""
        pinned = t if t.is_pinned() else t.pin_memory()
        return pinned.to(self.device, non_blocking=True)

    def used_by(self, t: torch.Tensor, stream: Any) -> None:
        """Keeps ``t``'s memory from reuse until ``stream``'s work so far is done."""
        t.record_stream(stream)


def _pinned(batch: Any) -> bool:
    """Whether every host tensor of ``batch`` is pinned (a pinning loader's)."""
    if type(batch) is tuple and len(batch) == 2:  # (x, y) of tensors: per step
        x, y = batch
        if type(x) is torch.Tensor and type(y) is torch.Tensor:
            return (x.device.type != "cpu" or x.is_pinned()) and (
                y.device.type != "cpu" or y.is_pinned()
            )
    return all(t.is_pinned() for _, t in tensors(batch) if t.device.type == "cpu")


def _adapted(
    batch_fn: Callable[[Any], Any], batch: Any, name: str, first: bool = False
) -> Any:
    """``batch_fn(batch)``, refused unless it is a batch fitlib takes (and, at
    the ``first`` batch of a loader, unless it holds arrays, not tensors)."""
    try:
        new = batch_fn(batch)
    except Exception as e:
        reraise(e, f"batch_fn {name_of(batch_fn)} failed on a batch of {name}: "
                f"{describe(batch)}.")  # fmt: skip
    pair = isinstance(new, (tuple, list)) and len(new) in (1, 2)
    if not (pair or isinstance(new, (torch.Tensor, dict))):
        raise TypeError(
            f"batch_fn {name_of(batch_fn)} returned {describe(new)} for a batch of "
            f"{name}; it must return (x, y), or inputs only: (x,), a tensor or a "
            "dict of inputs. "
            "Fix: e.g. return (batch.data[0], batch.label[0])."
        )
    array = _first_array(new) if first else None
    if array is not None:
        kind = type(array).__name__
        kind = "numpy arrays" if kind == "ndarray" else f"{kind} arrays"
        shape = tuple(getattr(array, "shape", ()))
        raise TypeError(
            f"batch_fn {name_of(batch_fn)} returned {describe(new)} for a batch of "
            f"{name}: {kind} (the first: shape {shape}, {getattr(array, 'dtype', '?')}"
            "), where fitlib needs tensors (it moves them to the device; the "
            "model and the loss take tensors). Fix: return tensors, e.g. "
            "torch.as_tensor(a) for each array a (torch.from_numpy(a) shares "
            "its memory)."
        )
    return new


def _first_array(x: Any) -> Any:
    """The first array that is not a tensor (numpy's, or any with
    ``__array__``) in a batch's tuples, lists and dicts; None if none."""
    if isinstance(x, torch.Tensor):
        return None
    if hasattr(x, "__array__") and not isinstance(x, (str, bytes)):
        return x
    values = x.values() if isinstance(x, dict) else x
    if isinstance(x, (tuple, list, dict)):
        for v in values:
            found = _first_array(v)
            if found is not None:
                return found
    return None


def unpaired(batch: Any, name: str = "dl") -> tuple[Any, Any]:
    """``(x, y)`` of a batch that is no pair: inputs only, ``(x,)`` or a
    tensor (an autoencoder's, a GAN's), with no targets (``()``); or a dict of
    inputs (``model(**batch)``, as ``transformers``' collators make them),
    whose ``"labels"``, if any, are also the targets. Anything else is
    refused."""
    if isinstance(batch, torch.Tensor):
        return batch, ()
    if isinstance(batch, (tuple, list)) and len(batch) == 1:
        return batch[0], ()
    if isinstance(batch, dict) and batch:
        labels = batch.get("labels")
        return batch, () if labels is None else labels
    raise TypeError(
        f"{name} yielded a batch of {describe(batch)}; fitlib needs each batch "
        "to be an (x, y) pair (x: inputs, y: targets; either may be a tuple of "
        "tensors), or inputs only: (x,), a tensor or a dict of inputs, the "
        f"loss then called as loss_func(output). Fix: {regroup_fix(batch)}"
    )
