"""The first batch's loss inputs, checked: what torch would accept but get wrong.

``loss_check`` runs around the loss of a fit's first training batch (and of
each ``validate`` call), when the shapes and dtypes are known: float or
out-of-range class indices for cross-entropy, shapes that differ for a loss
that compares element by element, and, inside any loss, an element-wise op
that broadcasting enlarges on both sides. And what fitlib reads from a loss
function itself: whether it takes class indices (``is_class_index_loss``),
probabilities (``takes_probabilities``) or logits (``takes_logits``), and the
class index it leaves out (``ignore_index_of``). A helper: it imports torch
and ``errors`` only.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.overrides import TorchFunctionMode

from fitlib.errors import describe, name_of

# Losses that compare output and target element by element: shapes must match.
_ELEMENTWISE = (
    F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss,
    F.binary_cross_entropy, F.binary_cross_entropy_with_logits, F.soft_margin_loss,
)  # fmt: skip
_ELEMENTWISE_MODULES = (
    nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCELoss,
    nn.BCEWithLogitsLoss, nn.SoftMarginLoss,
)  # fmt: skip
# Losses whose targets are class indices (or class probabilities).
_CLASS_INDEX = (F.cross_entropy, F.nll_loss)
_CLASS_INDEX_MODULES = (nn.CrossEntropyLoss, nn.NLLLoss)


@contextmanager
def loss_check(loss_func: Any, out: Any, targets: tuple) -> Iterator[None]:
    """Refuses, around the first batch's loss, inputs that torch would accept
    but get wrong.

    Before the loss: float or out-of-range class indices for cross-entropy
    (one value read from the device), and shapes that differ for a loss that
    compares element by element (mse, l1, BCE...). During it, for any loss: an
    element-wise op between a value computed from the output and one computed
    from the targets, of different ranks, that broadcasting enlarges on both
    sides (an ``(N, 1)`` output minus ``(N,)`` targets compares every output
    with every target). A loss that aligns the shapes itself
    (``out.squeeze(1) - y``) passes, and so does a deliberate outer op of
    tensors of the same rank (pairwise distances, chamfer losses).
    """
    y = targets[0] if len(targets) == 1 else None
    if isinstance(out, torch.Tensor) and isinstance(y, torch.Tensor):
        if is_class_index_loss(loss_func):
            _check_class_targets(loss_func, out, y)
        elif out.shape != y.shape and _is(
            loss_func, _ELEMENTWISE, _ELEMENTWISE_MODULES
        ):
            raise ValueError(_broadcast_message(loss_func, out.shape, y.shape))
    watch = _Broadcasts(out, targets)
    with watch:
        yield
    if watch.found is not None:
        op, a, b = watch.found
        inside = (
            f" Inside it, {op!r} got a value of shape {tuple(a)} computed from the "
            f"output and one of shape {tuple(b)} from the targets{_into(a, b)}."
        )
        shapes = (out.shape, y.shape) if y is not None else (a, b)
        raise ValueError(_broadcast_message(loss_func, *shapes, inside))


class _Broadcasts(TorchFunctionMode):
    """Follows what is computed from the output and from the targets during
    one call of the loss, and notes the first element-wise op between the two
    that broadcasting enlarges on both sides: ``(op, shape, shape)``."""

    def __init__(self, out: Any, targets: tuple) -> None:
        super().__init__()
        self.found: tuple | None = None
        self._from: dict[int, tuple] = {}  # id -> (weakref, {"out", "y"})
        self._mark(out, frozenset({"out"}))
        self._mark(targets, frozenset({"y"}))

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        sources = [self._source(t) for t in tensors]
        if self.found is None and len(tensors) >= 2 and _elementwise(func):
            self._compare(func, tensors[:2], sources[:2])
        result = func(*args, **kwargs)
        merged = frozenset().union(*sources)
        if merged:
            self._mark(result, merged)
        return result

    def _compare(self, func: Any, pair: list, sources: list) -> None:
        a, b = pair
        # Of ranks that differ: implicit rank promotion, (N, 1) against (N,).
        promoted = a.ndim != b.ndim and _both_expand(a, b)
        if promoted and {*sources} == {frozenset({"out"}), frozenset({"y"})}:
            out, y = (a, b) if sources[0] == {"out"} else (b, a)
            self.found = (getattr(func, "__name__", "op"), out.shape, y.shape)

    def _mark(self, x: Any, source: frozenset) -> None:
        if isinstance(x, torch.Tensor):
            self._from[id(x)] = (weakref.ref(x), source | self._source(x))
        elif isinstance(x, (tuple, list)):
            for v in x:
                self._mark(v, source)

    def _source(self, t: torch.Tensor) -> frozenset:
        entry = self._from.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else frozenset()


_BINARY = {"add", "sub", "rsub", "mul", "div", "true_divide", "pow", "eq", "ne",
           "lt", "le", "gt", "ge", "maximum", "minimum", "where", "sub_", "mul_",
           "add_", "div_", "abs", "square"}  # fmt: skip


def _elementwise(func: Any) -> bool:
    name = getattr(func, "__name__", "").strip("_")
    name = name[1:] if name.startswith("r") and name[1:] in _BINARY else name
    return name in _BINARY or name.endswith("_loss") or name == "cross_entropy"


def _broadcast_message(loss_func: Any, out: Any, y: Any, inside: str = "") -> str:
    what = "." if inside else f"{_into(out, y)}."
    return (
        f"loss_func {name_of(loss_func)} got an output of shape {tuple(out)} and "
        f"targets of shape {tuple(y)}{what}{inside} Fix: give output and targets "
        "the same shape, e.g. y.reshape(-1, 1) for the targets (in the dataset) "
        "or out.squeeze(-1) in the model's forward; or align them in the loss."
    )


def _is(loss_func: Any, functions: tuple, modules: tuple) -> bool:
    return (
        isinstance(loss_func, modules)
        or getattr(loss_func, "func", loss_func) in functions
    )


def _both_expand(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether broadcasting enlarges both tensors: (N, 1) against (N,)."""
    try:
        shape = torch.broadcast_shapes(a.shape, b.shape)
    except RuntimeError:
        return False
    return shape.numel() > max(a.numel(), b.numel())


def _into(out: Any, y: Any) -> str:
    try:
        shape = tuple(torch.broadcast_shapes(tuple(out), tuple(y)))
    except RuntimeError:
        return ", which do not match"
    return (
        f", which torch broadcasts to {shape}, comparing every output with "
        "every target: the model would train on the wrong objective"
    )


def _check_class_targets(loss_func: Any, out: torch.Tensor, y: torch.Tensor) -> None:
    name = name_of(loss_func)
    if y.is_floating_point():
        if y.shape == out.shape:  # class probabilities: allowed
            return
        raise ValueError(
            f"loss_func {name} got float targets {describe(y)} for an output "
            f"{describe(out)}: it needs class indices (integers) or, for soft "
            "labels, probabilities of the output's shape. Fix: y.long() (e.g. "
            "torch.tensor(labels, dtype=torch.long) in the dataset)."
        )
    n_classes = out.shape[1] if out.ndim > 1 else out.shape[0]
    ignore = ignore_index_of(loss_func)
    bad = ((y < 0) | (y >= n_classes)) & (y != ignore)
    if bad.any():  # one sync, at the first batch only
        found = y[bad][0].item()
        raise ValueError(
            f"loss_func {name} got the class index {found} for an output with "
            f"{n_classes} classes (indices 0 to {n_classes - 1}). Fix: make the "
            f"model's last layer output as many classes as the labels have "
            f"(max label + 1), or map the labels to 0..{n_classes - 1}."
        )


def is_class_index_loss(loss_func: Any) -> bool:
    """Whether ``loss_func`` is cross-entropy or NLL (a function, a module or
    a ``functools.partial`` of one): it takes class indices."""
    return _is(loss_func, _CLASS_INDEX, _CLASS_INDEX_MODULES)


def takes_probabilities(loss_func: Any) -> bool:
    """Whether ``loss_func`` is ``binary_cross_entropy`` (a function, a
    ``partial`` or ``nn.BCELoss``): its input is a probability, not a logit."""
    return _is(loss_func, (F.binary_cross_entropy,), (nn.BCELoss,))


def takes_logits(loss_func: Any) -> bool:
    """Whether ``loss_func`` is ``binary_cross_entropy_with_logits`` (a
    function, a ``partial`` or ``nn.BCEWithLogitsLoss``): its input is a
    logit of one score per target."""
    return _is(
        loss_func, (F.binary_cross_entropy_with_logits,), (nn.BCEWithLogitsLoss,)
    )


def ignore_index_of(loss_func: Any) -> int:
    """The class index ``loss_func`` leaves out (a module's ``ignore_index``,
    a ``partial``'s keyword), -100 by default as in torch."""
    if isinstance(loss_func, nn.Module):
        return getattr(loss_func, "ignore_index", -100)
    keywords = getattr(loss_func, "keywords", None) or {}
    return keywords.get("ignore_index", -100)
