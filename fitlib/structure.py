"""Structured values (a model's outputs, a batch's targets): tensors in
tuples, lists, named tuples, dicts (``transformers``' ``ModelOutput`` too) and
dataclasses, nested. One walk order serves mapping, listing and joining.

Examples:
    >>> from fitlib.structure import map_tensors
    >>> out = {"logits": torch.zeros(2, 3), "boxes": (torch.zeros(2, 4),)}
    >>> map_tensors(lambda t: t[0], out)["boxes"][0].shape
    torch.Size([4])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

Path = tuple  # keys and indices from the top, e.g. ("boxes", 0)


def _children(x: Any) -> list[tuple[Any, Any]] | None:
    """``[(key, value)]`` of a container, None for a leaf."""
    if isinstance(x, (tuple, list)):
        return list(enumerate(x))
    if isinstance(x, dict):
        return list(x.items())
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [(f.name, getattr(x, f.name)) for f in dataclasses.fields(x)]
    return None


def _rebuild(x: Any, values: list[Any]) -> Any:
    """A container like ``x`` holding ``values`` (in ``_children`` order)."""
    if isinstance(x, (tuple, list)):
        return type(x)(*values) if hasattr(x, "_fields") else type(x)(values)
    if isinstance(x, dict):
        items = dict(zip(x.keys(), values, strict=True))
        if type(x) is dict:
            return items
        try:  # a dataclass-like dict (ModelOutput) takes keywords
            return type(x)(**items)
        except TypeError:
            return type(x)(items)
    names = [f.name for f in dataclasses.fields(x)]
    return dataclasses.replace(x, **dict(zip(names, values, strict=True)))


def map_tensors(fn: Callable[[torch.Tensor], Any], x: Any) -> Any:
    """``x`` with ``fn`` applied to each tensor; other leaves kept."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    children = _children(x)
    if children is None:
        return x
    return _rebuild(x, [map_tensors(fn, v) for _, v in children])


def tensors(x: Any, path: Path = ()) -> Iterator[tuple[Path, torch.Tensor]]:
    """Each tensor in ``x`` with its path, in ``map_tensors``' order."""
    if isinstance(x, torch.Tensor):
        yield path, x
        return
    for key, value in _children(x) or ():
        yield from tensors(value, (*path, key))


def parts(x: Any) -> list[Any]:
    """The keys (or indices) one level down in ``x``: what ``pick`` takes."""
    return [k for k, _ in _children(x) or ()]


def pick(x: Any, path: Any, what: str) -> Any:
    """The part of ``x`` at ``path`` (a key, an index, or a tuple of them for
    nested parts); an error naming the parts that exist otherwise."""
    for key in path if isinstance(path, tuple) else (path,):
        children = _children(x)
        found = dict(children or ())
        if isinstance(key, bool) or key not in found:
            have = (
                f"its parts are {list(found)}"
                if children
                else f"it is {type(x).__name__}, with no parts"
            )
            raise KeyError(f"there is no part {key!r} in {what}: {have}.")
        x = found[key]
    return x


def join(batches: list[Any]) -> Any:
    """Batches of a structure joined along dim 0, tensor by tensor.

    Tensors of one position whose other dims differ between batches (padded
    sequences of different lengths) are padded to the largest first: float
    with nan, int with -100 (the ignore index of torch's losses), bool with
    False. 0-dim tensors (a value per batch) are stacked.
    """
    first = batches[0]
    columns = zip(*([t for _, t in tensors(b)] for b in batches), strict=True)
    joined = iter([_cat_padded(list(ts)) for ts in columns])
    return map_tensors(lambda _: next(joined), first)


def pad_value(t: torch.Tensor) -> Any:
    """What ``join`` pads ``t``'s dtype with."""
    if t.dtype == torch.bool:
        return False
    return float("nan") if t.is_floating_point() or t.is_complex() else -100


def _cat_padded(ts: list[torch.Tensor]) -> torch.Tensor:
    if all(t.ndim == 0 for t in ts):
        return torch.stack(ts)
    shapes = {tuple(t.shape[1:]) for t in ts}
    if len(shapes) == 1:
        return torch.cat(ts)
    if len({t.ndim for t in ts}) != 1:
        raise ValueError(
            "cannot join outputs whose number of dims changes between batches: "
            f"shapes {sorted({tuple(t.shape) for t in ts})}. Fix: return "
            "tensors of the same rank from every batch."
        )
    size = [max(s) for s in zip(*shapes, strict=True)]
    padded = []
    for t in ts:
        out = t.new_full((t.shape[0], *size), pad_value(t))
        out[(slice(None), *(slice(0, n) for n in t.shape[1:]))] = t
        padded.append(out)
    return torch.cat(padded)
