"""``ProgressiveResizing``: trains on smaller images first, growing by epoch."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch.nn import functional as F  # noqa: N812

from fitlib.callback import Callback, inner_callback
from fitlib.checks import check_flag, check_int, check_number
from fitlib.errors import ArgTypeError, describe, is_int, unknown_name
from fitlib.structure import map_tensors, tensors

MODES = ("bilinear", "bicubic", "nearest", "nearest-exact", "area")
Size = tuple[int, int]


class ProgressiveResizing(Callback):
    """Resizes each training batch's images to a size that grows over the fit.

    Early epochs run on small images, which are cheaper per step; later
    ones on larger images, the last at full size, so the model ends trained
    at the size it is used at. The size depends only on the epoch: a
    resumed fit (``Checkpoint``) resizes each batch as an unbroken run does,
    and the callback has no state to save.

    Give the schedule as ``sizes={epoch: size}`` (each size holds from its
    epoch to the next one given; epoch 0 must be given), or as ``start`` and
    ``end`` with ``buckets``: the fit's first ``until`` of epochs is split
    into ``buckets - 1`` equal stretches at sizes from ``start`` (exactly)
    growing towards ``end``, the sizes between rounded to a multiple of
    ``multiple_of``; the remaining epochs (and at least the last) are at
    ``end`` exactly (``end=None``: the images' own size).
    ``schedule(n_epochs)`` lists the size of each epoch. A size is an int
    (square) or ``(height, width)``. A ``start`` larger than ``end`` on
    either side, or equal to it, is refused (with ``end=None``: at the first
    batch, before any step); a fit in which every epoch trains at the
    images' size (one epoch, or an ``until`` too small for its epochs) warns.

    Few distinct sizes matter under ``Compile``: each new input shape
    compiles again (with ``dynamic=False``, once per size; with torch's
    default, the second size makes the shape dynamic). The buckets bound the
    compilations by their count (tested); a size per epoch would compile at
    every epoch. With ``dynamic=False`` a graph is made per size and per
    batch shape: a ragged last training batch doubles the training graphs,
    and validation has its own. Past torch's
    ``torch._dynamo.config.recompile_limit`` (8 in torch 2.14) each new
    shape runs eagerly, with only a logged warning (4 buckets from 8 to 32
    and a ragged last batch of 70 images in 16s reach it: 8 graphs);
    ``drop_last=True`` on the training loader, fewer buckets, or a larger
    ``recompile_limit`` keep it compiled.

    ``CudaGraph`` captures the first training batch's shape and runs every
    other shape eagerly: with a schedule of several sizes it is refused
    before training (one size, ``sizes={0: 64}``, composes).

    Only training batches are resized, on their device, before any other
    hook sees them (``F.interpolate``; ``mode="bilinear"`` with
    ``antialias=True`` by default, which averages the pixels a down-sizing
    drops instead of skipping them): every 4-D float tensor of the inputs
    (``(B, C, H, W)``, in a tuple or a dict too) whose size differs. The
    validation batches, and a Learner's ``validate``, ``get_preds`` and
    ``predict``, see the images as the loader gives them (at full size), so
    each epoch's ``valid_loss`` measures the model at the size it will be
    used at, and the epochs compare. Targets are not resized: a first batch
    whose targets have the images' height and width (segmentation masks) is
    refused, as is one without a 4-D float input. The LR finder's sweep
    leaves it out (``in_lr_find``: the sweep runs at the full size).

    Args:
        sizes: ``{epoch: size}``, the schedule by hand.
        start: the first size (with ``end``).
        end: the final size; None: the images' own.
        buckets: how many distinct sizes at most (``start`` to ``end``).
        until: the fraction of the epochs after which every epoch is at
            ``end``.
        multiple_of: what the sizes between ``start`` and ``end`` are
            rounded to (8; 32 suits a network that halves the size 5 times).
        mode: ``F.interpolate``'s mode.
        antialias: low-pass filter when down-sizing (``bilinear`` and
            ``bicubic`` only).

    Examples:
        >>> grow = ProgressiveResizing(start=16, end=32, buckets=3)
        >>> grow.schedule(8)
        [(16, 16), (16, 16), (16, 16), (24, 24), (24, 24), (24, 24), (32, 32), (32, 32)]
        >>> ProgressiveResizing(sizes={0: 16, 2: (24, 32)}).schedule(3)
        [(16, 16), (16, 16), (24, 32)]
        >>> ProgressiveResizing(sizes={1: 16})
        Traceback (most recent call last):
        ...
        ValueError: ProgressiveResizing: sizes must give the size of epoch 0; got
        epochs [1]. Fix: e.g. ProgressiveResizing(sizes={0: 64, 3: 96, 6: 128}).
    """

    # First to touch the batch: ChannelsLast (-210) converts the resized
    # images, and MixedPrecision's autocast (-20) is not on yet, so the
    # resizing runs in the images' own dtype.
    order = -220
    in_lr_find = False  # the sweep runs at the full size

    def __init__(
        self,
        sizes: dict[int, int | tuple[int, int]] | None = None,
        *,
        start: int | tuple[int, int] | None = None,
        end: int | tuple[int, int] | None = None,
        buckets: int = 3,
        until: float = 0.75,
        multiple_of: int = 8,
        mode: str = "bilinear",
        antialias: bool = True,
    ) -> None:
        if (sizes is None) == (start is None):
            raise TypeError(
                "ProgressiveResizing: give either sizes={epoch: size} or start= "
                f"(with end=, buckets=); got sizes={sizes!r}, start={start!r}. Fix: "
                "e.g. ProgressiveResizing(sizes={0: 64, 3: 96, 6: 128}) or "
                "ProgressiveResizing(start=64, end=128, buckets=3)."
            )
        self.sizes = None if sizes is None else _check_sizes(sizes)
        self.start = None if start is None else _size(start, "start")
        self.end = None if end is None else _size(end, "end")
        if self.start is not None and self.end is not None:
            _check_growth(self.start, self.end, f"end={self.end}")
        self.buckets = check_int(buckets, "buckets", minimum=1, owner=_OWNER, example=3)
        self.until = _check_until(until)
        self.multiple_of = check_int(multiple_of, "multiple_of", minimum=1,
                                     owner=_OWNER, example=8)  # fmt: skip
        if mode not in MODES:
            raise ValueError(unknown_name(_OWNER, "mode", mode, MODES,
                                          "e.g. mode='bilinear'."))  # fmt: skip
        self.mode = mode
        self.antialias = check_flag(antialias, "antialias", owner=_OWNER)
        self._n_epochs: int | None = None
        self._checked = False

    def schedule(self, n_epochs: int, full: Any = None) -> list[Size]:
        """The size of each of ``n_epochs`` epochs, ``(height, width)``;
        ``full`` is the images' own size, for ``end=None``."""
        n_epochs = check_int(n_epochs, "n_epochs", minimum=1, owner=f"{_OWNER}"
                             ".schedule", example=10)  # fmt: skip
        return [self._size_at(e, n_epochs, full) for e in range(n_epochs)]

    def _size_at(self, epoch: int, n_epochs: int | None, full: Any = None) -> Size:
        """The size of ``epoch``'s training images in a fit of ``n_epochs``."""
        if self.sizes is not None:
            return self.sizes[max(e for e in self.sizes if e <= epoch)]
        end = self.end or (None if full is None else _size(full, "full"))
        if end is None:
            raise ValueError(
                f"{_OWNER}: end=None stands for the images' own size, which "
                "schedule() cannot know. Fix: e.g. schedule(10, full=(224, 224))."
            )
        last = min(n_epochs - 1, math.floor(self.until * n_epochs + 1e-9))
        if epoch >= last or self.buckets == 1:
            return end
        step = epoch * (self.buckets - 1) // last  # 0 .. buckets - 2
        if step == 0:
            return self.start  # as given: only the sizes between are rounded
        return tuple(
            min(b, max(a, _rounded(a + (b - a) * step / (self.buckets - 1),
                                   self.multiple_of)))
            for a, b in zip(self.start, end)
        )  # fmt: skip

    def on_train_begin(
        self, n_epochs: int | None, callbacks: list | None = None
    ) -> None:
        """Runs before training: the schedule's length is the fit's epochs;
        refuses ``CudaGraph`` where the fit has several sizes."""
        if self.sizes is None and n_epochs is None:
            raise ValueError(
                f"{_OWNER}: start= and end= spread the sizes over the fit's epochs, "
                "and this fit gives none (max_steps alone). Fix: fit(n_epochs, ...), "
                "or ProgressiveResizing(sizes={0: 64, 3: 96, 6: 128})."
            )
        self._n_epochs, self._checked = n_epochs, False
        # (by name: a callback does not import another's module)
        graphs = [c for c in map(inner_callback, callbacks or [])
                  if type(c).__name__ == "CudaGraph"]  # fmt: skip
        sizes = self._fit_sizes(n_epochs)
        if graphs and len(sizes) > 1:
            shown = ", ".join(map(str, sizes))
            raise ValueError(
                f"{_OWNER}: CudaGraph captures one shape, at the first training "
                f"batch, and this fit trains at sizes {shown}: every batch at a "
                "later size would run eagerly, without the graph. Fix: leave out "
                "CudaGraph or ProgressiveResizing, or fit once per size (e.g. "
                "sizes={0: 64} in a fit, then sizes={0: 128} in the next one)."
            )

    def _fit_sizes(self, n_epochs: int | None) -> list[Any]:
        """The distinct sizes of the fit's epochs, in order (``"full"`` for
        the images' own size where ``end=None``)."""
        if self.sizes is not None:
            sizes = (self.sizes.values() if n_epochs is None
                     else self.schedule(n_epochs))  # fmt: skip
        else:  # (end=None: a stand-in, 2 x start, named where shown)
            full = self.end or tuple(2 * s for s in self.start)
            sizes = [s if self.end or s != full else "the images' own"
                     for s in self.schedule(n_epochs, full=full)]  # fmt: skip
        return list(dict.fromkeys(sizes))

    def on_batch_begin(
        self, last_input: Any, last_target: Any, train: bool, epoch: int
    ) -> dict | None:
        """Runs before each batch: a training batch's images resized."""
        if not train:
            return None
        if not self._checked:
            self._check(last_input, last_target)
        full = _image_size(last_input)
        size = self._size_at(epoch, self._n_epochs, full)
        if size == full:
            return None
        return {"last_input": map_tensors(lambda t: self._resize(t, size), last_input)}

    def _resize(self, t: torch.Tensor, size: Size) -> torch.Tensor:
        if t.dim() != 4 or not t.is_floating_point() or tuple(t.shape[-2:]) == size:
            return t
        smaller = size[0] <= t.shape[-2] and size[1] <= t.shape[-1]
        kwargs = {}
        if self.mode in ("bilinear", "bicubic"):  # the modes that filter
            kwargs = {"align_corners": False, "antialias": self.antialias and smaller}
        return F.interpolate(t, size=size, mode=self.mode, **kwargs)

    def _check(self, xb: Any, yb: Any) -> None:
        """The first training batch: images to resize, and no image targets;
        a start smaller than the images (``end=None``); a warning where every
        epoch of the fit trains at the images' size."""
        images = [t for _, t in tensors(xb) if t.dim() == 4 and t.is_floating_point()]
        if not images:
            raise ValueError(
                f"{_OWNER}: the batch's inputs are {describe(xb)}; none is a 4-D "
                "float tensor (B, C, H, W), so there is no image to resize. Fix: "
                "leave ProgressiveResizing out for this data, or give images as "
                "floats (e.g. a transform that divides uint8 pixels by 255)."
            )
        hw = tuple(images[0].shape[-2:])
        if any(t.dim() >= 3 and tuple(t.shape[-2:]) == hw for _, t in tensors(yb)):
            raise ValueError(
                f"{_OWNER}: the batch's targets {describe(yb)} have the images' "
                f"height and width {hw} (masks?); only the inputs are resized, so "
                "the loss would get mismatched shapes. Fix: leave "
                "ProgressiveResizing out for dense targets."
            )
        if self.start is not None and self.end is None:
            _check_growth(self.start, hw, f"the images' own size {hw} (end=None)")
        n_epochs = self._n_epochs
        sizes = (self.schedule(n_epochs, full=hw) if n_epochs is not None
                 else list(self.sizes.values()))  # fmt: skip
        if all(size == hw for size in sizes):
            warnings.warn(
                f"{_OWNER}: every epoch of this fit trains at the images' full "
                f"size {hw} ({self!r} over {n_epochs} epochs), so nothing is "
                "resized. Fix: a longer fit, a smaller until= or start=, or "
                "leave ProgressiveResizing out.",
                UserWarning,
                stacklevel=2,
            )
        self._checked = True

    def __repr__(self) -> str:
        if self.sizes is not None:
            return f"{self.name}(sizes={self.sizes})"
        return (f"{self.name}(start={self.start}, end={self.end}, "
                f"buckets={self.buckets}, until={self.until})")  # fmt: skip


_OWNER = "ProgressiveResizing"


def _size(value: Any, name: str) -> Size:
    """An int or a pair of ints >= 1 as ``(height, width)``."""
    pair = value if isinstance(value, (tuple, list)) else (value, value)
    if len(pair) != 2 or not all(is_int(v) and v >= 1 for v in pair):
        raise ArgTypeError(
            f"{_OWNER}: {name} must be an int >= 1 or a (height, width) pair of "
            f"them; got {value!r} ({type(value).__name__}). Fix: e.g. "
            f"{name}=64 or {name}=(64, 96)."
        )
    return (int(pair[0]), int(pair[1]))


def _check_sizes(sizes: Any) -> dict[int, Size]:
    """``sizes={epoch: size}`` checked: int epochs >= 0, from epoch 0 on."""
    if not isinstance(sizes, dict) or not sizes:
        raise ArgTypeError(
            f"{_OWNER}: sizes must be a non-empty dict {{epoch: size}}; got "
            f"{sizes!r}. Fix: e.g. ProgressiveResizing(sizes={{0: 64, 3: 96, 6: 128}})."
        )
    for epoch in sizes:
        check_int(epoch, "each epoch of sizes", minimum=0, owner=_OWNER,
                  example="{0: 64, 3: 96}")  # fmt: skip
    if 0 not in sizes:
        raise ValueError(
            f"{_OWNER}: sizes must give the size of epoch 0; got epochs "
            f"{sorted(sizes)}. Fix: e.g. ProgressiveResizing(sizes={{0: 64, 3: 96, "
            "6: 128})."
        )
    return {int(e): _size(s, f"sizes[{e}]") for e, s in sorted(sizes.items())}


def _check_until(until: Any) -> float:
    """``until`` as a float in (0, 1], in ``check_number``'s wording."""
    until = check_number(until, "until", above=0, what="a fraction of the epochs",
                         owner=_OWNER, example=0.75)  # fmt: skip
    if until > 1:
        raise ValueError(
            f"{_OWNER}: until must be a fraction of the epochs in (0, 1]; got "
            f"{until!r} (float). Fix: e.g. {_OWNER}(until=0.75)."
        )
    return until


def _check_growth(start: Size, end: Size, what: str) -> None:
    """A ValueError unless ``start`` is at most ``end`` and not equal."""
    if any(s > e for s, e in zip(start, end)):
        raise ValueError(
            f"{_OWNER}: start={start} is not smaller than {what}; the sizes grow "
            "from start to end (images shrinking over the fit are not supported)."
            f" Fix: a start below the end, e.g. start={tuple(e // 2 for e in end)}."
        )
    if start == end:
        raise ValueError(
            f"{_OWNER}: start={start} equals {what}: every epoch would train at "
            f"{end}, nothing resized. Fix: a start below the end, e.g. "
            f"start={tuple(e // 2 for e in end)}, or leave ProgressiveResizing out."
        )


def _rounded(value: float, multiple: int) -> int:
    """``value`` to the nearest multiple of ``multiple`` (one at least)."""
    return max(multiple, multiple * round(value / multiple))


def _image_size(xb: Any) -> Size | None:
    """The height and width of the first 4-D tensor of the inputs."""
    for _, t in tensors(xb):
        if t.dim() == 4 and t.is_floating_point():
            return (int(t.shape[-2]), int(t.shape[-1]))
    return None
