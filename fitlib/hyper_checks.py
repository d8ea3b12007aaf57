"""The checks of an optimizer's arguments: a learning rate to train at checked
once (``check_lr``) and spread over the parameter groups once
(``lr_per_group``); the other hyper-parameters' values (``check_hyper``); the
optimizer class (``check_opt_func``) and the parameters it is given
(``check_params``). What ``HPOptimizer``, ``MultiOptimizer``, the schedulers
and the ``Learner`` share."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from fitlib.errors import ArgTypeError, is_number

# A learning rate to train at: one number, one per parameter group, or a slice
# spread over the groups (see lr_per_group).
LR = float | slice | Sequence[float]
EXAMPLE_VALUES = {"lr": "1e-3", "mom": "0.9", "wd": "1e-2", "beta": "0.99"}


def check_no_parts(lr: Any, name: str) -> None:
    """Refuses a value per part (a dict) for ``name`` where the optimizer is
    one ``HPOptimizer``, without parts."""
    if isinstance(lr, Mapping):
        raise ValueError(
            f"{name}={lr!r} gives a value per part, but this optimizer has no "
            "parts (it is one HPOptimizer). Fix: pass one number, or train "
            "with a MultiOptimizer (Learner(..., opt_func={part: class, ...}))."
        )


def check_lr(lr: Any, name: str = "lr") -> None:
    """The one check of a learning rate to train at, before it is spread.

    Refuses (naming ``name``, the argument as the caller called it) what is
    not a number > 0 and finite, a non-empty sequence of them (one per
    parameter group), a slice of them with a stop, or a dict of those by part
    (a ``MultiOptimizer``'s parts); and a named tuple, such
    as the ``SuggestedLRs`` of ``lr_find``, which would pass for one value
    per group. A wrong type is an ``ArgTypeError`` (a TypeError that is also
    a ValueError), a value out of range a ValueError.

    Examples:
        >>> from fitlib.hyper_checks import check_lr
        >>> check_lr(slice(1e-4, 1e-2))  # fine; lr_per_group spreads it
        >>> check_lr(-1.0)
        Traceback (most recent call last):
        ...
        ValueError: lr must be > 0: a number, one per parameter group, or a slice
        (slice(lo, hi) spreads lo..hi over the groups); got -1.0 (float). Fix:
        e.g. lr=1e-3 (learn.lr_find() suggests one).
    """
    if isinstance(lr, tuple) and hasattr(lr, "_fields"):
        raise ArgTypeError(_named_tuple_message(lr, name))
    if isinstance(lr, Mapping) and lr:  # one per part (MultiOptimizer)
        for part, value in lr.items():
            check_lr(value, f"{name}[{part!r}]")
        return
    if isinstance(lr, slice):
        values = [v for v in (lr.start, lr.stop) if v is not None]
        form = lr.stop is not None
    elif is_hyper_number(lr):
        values, form = [lr], True
    elif isinstance(lr, Iterable) and not isinstance(lr, (str, bytes, Iterator)):
        values = list(lr)  # a list, tuple, numpy array (not a one-pass iterator)
        form = bool(values)
    else:
        values, form = [], False
    message = (
        f"{name} must be > 0: a number, one per parameter group, or a slice "
        f"(slice(lo, hi) spreads lo..hi over the groups); got {lr!r} "
        f"({type(lr).__name__}). Fix: e.g. {name}=1e-3 (learn.lr_find() "
        "suggests one)."
    )
    if not form or not all(is_hyper_number(v) for v in values):
        raise ArgTypeError(message)
    if not all(0 < float(v) < math.inf for v in values):
        raise ValueError(message)


def lr_per_group(lr: LR, n: int, name: str = "lr") -> list[float]:
    """One learning rate per parameter group from what ``check_lr`` accepts:
    the one place a learning rate is spread over the groups.

    A number goes to every group; a sequence must have ``n`` values;
    ``slice(lo, hi)`` spreads rates geometrically from the first group to the
    last; ``slice(hi)`` gives the last group ``hi`` and the others ``hi / 10``.
    A slice needs two groups at least.

    Examples:
        >>> from fitlib.hyper_checks import lr_per_group
        >>> lr_per_group(slice(1e-4, 1e-2), 3)
        [0.0001, 0.001, 0.01]
    """
    if isinstance(lr, slice):
        return _spread(lr, n, name)
    if is_hyper_number(lr):
        return [float(lr)] * n
    values = [float(v) for v in lr]
    if len(values) != n:
        raise ValueError(count_mismatch(name, values, n))
    return values


def _groups_example(name: str) -> str:
    """``layer_groups=...`` as the message for ``name`` should show it: by part
    for a part's rate (``lr['encoder']``)."""
    if "[" in name:
        part = name[name.index("[") + 1 : name.rindex("]")]
        return f"layer_groups={{{part}: [body, head]}}"
    return "layer_groups=[body, head]"


def _spread(lr: slice, n: int, name: str) -> list[float]:
    if n == 1:
        raise ValueError(
            f"{name}={lr!r} spreads learning rates over layer groups, but there "
            "is only 1 parameter group, so the slice would mean nothing. Fix: "
            f"pass one number (e.g. {name}=1e-3), or split the model into "
            f"groups, e.g. Learner(..., {_groups_example(name)})."
        )
    stop = float(lr.stop)
    if lr.start is None:
        return [stop / 10] * (n - 1) + [stop]
    start = float(lr.start)
    ratio = (stop / start) ** (1 / (n - 1))
    return [start * ratio**i for i in range(n)]


def count_mismatch(name: str, values: Sequence[Any], n: int) -> str:
    """Says that ``values`` (one per parameter group) are not ``n``."""
    count = f"{len(values)} value{'' if len(values) == 1 else 's'}"
    groups = f"{n} parameter group{'' if n == 1 else 's'}"
    fix = "pass one number" if n == 1 else f"pass one number, or exactly {n} values"
    return f"{name}: got {count} {list(values)} for {groups}. Fix: {fix}."


def _named_tuple_message(lr: Any, name: str) -> str:
    what = type(lr).__name__
    if "valley" in lr._fields:  # lr_find's SuggestedLRs
        return (
            f"{name} got lr_find's suggestions {lr!r}, a {what}: three candidate "
            "rates, which would be taken as one learning rate per parameter "
            f"group. Fix: pass the one to use, e.g. {name}=s.valley (with s = "
            "learn.lr_find())."
        )
    return (
        f"{name} got a named tuple {lr!r}: its values have names, so they are "
        f"no list of one learning rate per parameter group. Fix: pass one "
        f"number, or a list (e.g. {name}=list(...))."
    )


def check_hyper(
    name: str, values: Sequence[Any], given: Any = None, fix: str | None = None
) -> None:
    """Refuses values torch would refuse (or misread) for hyper-parameter ``name``:
    not a number (TypeError); ``lr``, ``wd`` below 0 or infinite, ``mom``,
    ``beta`` outside [0, 1) (ValueError). A factor must be a finite number >= 0.
    ``fix`` is the example the message gives (default: the optimizer's setter)."""
    given = values if given is None else given
    base = name.split()[0]
    example = fix or f"opt.{base} = {EXAMPLE_VALUES.get(base, '0.5')}"
    if " " in name:  # a factor of scale()
        example = f"opt.scale({base!r}, 0.5)"
    if not all(is_hyper_number(v) for v in values):
        raise TypeError(
            f"{name} must be a number (or one per parameter group); got {given!r}"
            f" ({type(given).__name__}). Fix: e.g. {example}."
        )
    if base in ("mom", "beta") and " " not in name:
        ok, what = all(0 <= v < 1 for v in values), "in [0, 1)"
    else:
        ok, what = all(0 <= v < math.inf for v in values), "a finite number >= 0"
    if not ok:
        raise ValueError(
            f"{name} must be {what} (torch refuses other values); got {given!r}. "
            f"Fix: e.g. {example}."
        )


def is_hyper_number(x: Any) -> bool:
    """A real number, or a 0-dim tensor holding one (read once, as torch does)."""
    if isinstance(x, torch.Tensor):
        return x.ndim == 0 and not x.is_complex() and x.dtype != torch.bool
    return is_number(x)


def check_opt_func(opt_func: Any) -> None:
    """A TypeError unless ``opt_func`` can make an optimizer (a class, a partial)."""
    if isinstance(opt_func, torch.optim.Optimizer):
        raise TypeError(
            f"opt_func must be the optimizer's class; got an instance of "
            f"{type(opt_func).__name__}: fitlib makes the optimizer itself, over "
            f"the model's layer groups. Fix: opt_func=torch.optim."
            f"{type(opt_func).__name__} (with settings: functools.partial("
            f"torch.optim.{type(opt_func).__name__}, ...))."
        )
    if isinstance(opt_func, str) or not callable(opt_func):
        raise TypeError(
            f"opt_func must be a torch optimizer class (or a function that makes "
            f"one from params and lr); got {opt_func!r} ({type(opt_func).__name__})."
            " Fix: e.g. opt_func=torch.optim.AdamW (or torch.optim.SGD, Adam...)."
        )


def check_params(params: Any) -> list:
    """``params`` (parameters or group dicts) as a list, refused when it
    holds no parameter: the optimizer would have nothing to update."""
    params = list(params)
    if not params or all(
        isinstance(g, dict) and not list(g.get("params", [])) for g in params
    ):
        raise ValueError(
            "params is empty: the optimizer would have nothing to update. Fix: "
            "pass the parameters of a model that has some (model.parameters()), "
            "and check that layer_groups or a filter on requires_grad keeps any."
        )
    return params
