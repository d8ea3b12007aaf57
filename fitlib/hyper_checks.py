"""The checks of an optimizer's arguments: a learning rate to train at checked
once (``check_lr``) and spread over the parameter groups once
(``lr_per_group``); the other hyper-parameters' values (``check_hyper``); the
optimizer class (``check_opt_func``) and the parameters it is given
(``check_params``); what a hyper-parameter's name spells (``hyper_key``:
``"betas[1]"``), its one name (``hyper_name``, ``ALIASES``) and why an
optimizer has none by that name (``no_such_hyper``). What ``HPOptimizer``,
``MultiOptimizer``, the schedulers and the ``Learner`` share."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from fitlib.errors import ArgTypeError, did_you_mean, is_number

# A learning rate to train at: one number, one per parameter group, or a slice
# spread over the groups (see lr_per_group).
LR = float | slice | Sequence[float]
EXAMPLE_VALUES = {"lr": "1e-3", "mom": "0.9", "wd": "1e-2", "beta": "0.99"}
# A torch key that one of fitlib's names maps onto (``HPOptimizer``'s table):
# one hyper-parameter under two names, as the optimizer has it.
ALIASES = {
    "weight_decay": "wd",
    "momentum": "mom",
    "betas[0]": "mom",
    "alpha": "beta",
    "betas[1]": "beta",
}
_NAME = re.compile(r"([A-Za-z_]\w*)(?:\[(\d+)\])?")
NAMES = ("lr", "mom", "wd", "beta")  # fitlib's names of hyper-parameters
TRUE_WD_KEY = "fitlib_true_wd"  # stored in each group, so state_dict keeps it


def hyper_key(name: Any) -> tuple[str, int | None]:
    """The group key and tuple index that a hyper-parameter's name spells:
    ``"eps"`` is ``("eps", None)``, ``"betas[1]"`` is ``("betas", 1)``.
    Refuses (ValueError) a name of another form, before any optimizer is
    known.

    Examples:
        >>> from fitlib.hyper_checks import hyper_key
        >>> hyper_key("betas[1]")
        ('betas', 1)
    """
    match = _NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        raise ValueError(
            f"{name!r} is no hyper-parameter name: a name is a key of the "
            "optimizer's parameter groups ('eps', 'weight_decay'), one element "
            "of a tuple there ('betas[1]'), or one of fitlib's 'lr', 'mom', "
            "'wd', 'beta'. Fix: e.g. 'eps' or 'betas[1]'."
        )
    key, index = match.groups()
    return key, None if index is None else int(index)


def hyper_name(name: str) -> str:
    """The one name of a hyper-parameter that has two (``ALIASES``):
    ``"weight_decay"`` is ``"wd"``; any other name is itself. What a
    schedule lists in ``sets_hypers``, so two names of one value clash.

    Examples:
        >>> from fitlib.hyper_checks import hyper_name
        >>> hyper_name("betas[1]"), hyper_name("eps")
        ('beta', 'eps')
    """
    return ALIASES.get(name, name)


def no_such_hyper(
    opt: torch.optim.Optimizer,
    name: str,
    key: str,
    index: int | None,
    names: list[str],
) -> str:
    """Why ``name`` (group key ``key``, tuple ``index``) names no number of
    ``opt``'s parameter groups, and what they hold (``names``)."""
    groups = opt.param_groups
    value = groups[0].get(key)
    fix = "name one of those"
    if index is None and isinstance(value, (tuple, list)):
        what = f"its {key!r} holds {len(value)} values {tuple(value)!r}"
        fix = f"name one, e.g. '{key}[0]'"
    elif any(key in g for g in groups) and not all(key in g for g in groups):
        what = f"only some parameter groups hold {key!r}"
        fix = f"give every group a {key!r}, or {fix}"
    elif index is not None and key in groups[0]:
        what = f"{key!r} holds {value!r}, which has no number at {name!r}"
    elif key in groups[0]:
        what = f"{key!r} holds {value!r}, not a number, so it cannot be set"
    else:
        what = f"its parameter groups hold no {name!r}{did_you_mean(name, names)}"
        fix = f"{fix}, or use an optimizer that has {name!r}"
    return (
        f"{type(opt).__name__} has no hyper-parameter {name!r}: {what}. Its "
        f"hyper-parameters: {', '.join(names)}. Fix: {fix}."
    )


# Keys of the groups that torch refuses below 0 (checked as they are set).
NON_NEGATIVE = ("lr", "wd", "eps")


def example_setting(name: str, value: str | None = None) -> str:
    """How a fix sets hyper-parameter ``name``: ``opt.lr = 1e-3`` for
    fitlib's names (properties), ``opt.set('eps', 0.5)`` for the others.

    Examples:
        >>> from fitlib.hyper_checks import example_setting
        >>> example_setting("mom"), example_setting("eps", "1e-6")
        ('opt.mom = 0.9', "opt.set('eps', 1e-6)")
    """
    value = value or EXAMPLE_VALUES.get(name, "0.5")
    return (
        f"opt.{name} = {value}"
        if name in EXAMPLE_VALUES
        else (f"opt.set({name!r}, {value})")
    )


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
    ``beta`` outside [0, 1), ``eps`` below 0, any other key of the groups not
    finite (ValueError). A factor must be a finite number >= 0.
    ``fix`` is the example the message gives (default: the optimizer's setter)."""
    given = values if given is None else given
    base = name.split()[0]
    example = fix or example_setting(base)
    if " " in name:  # a factor of scale()
        example = f"opt.scale({base!r}, 0.5)"
    if not all(is_hyper_number(v) for v in values):
        raise TypeError(
            f"{name} must be a number (or one per parameter group); got {given!r}"
            f" ({type(given).__name__}). Fix: e.g. {example}."
        )
    why = "torch refuses other values"
    if base in ("mom", "beta") and " " not in name:
        ok, what = all(0 <= v < 1 for v in values), "in [0, 1)"
    elif base in NON_NEGATIVE or " " in name:
        ok, what = all(0 <= v < math.inf for v in values), "a finite number >= 0"
    else:  # another key of the groups (a custom optimizer's): any finite number
        ok, what = all(math.isfinite(v) for v in values), "a finite number"
        why = "a NaN or an infinity would reach the weights"
    if not ok:
        raise ValueError(
            f"{name} must be {what} ({why}); got {given!r}. Fix: e.g. {example}."
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
    # A group's params may be a generator (module.parameters()): listed once
    # here, in a copy of the group, so the optimizer still gets them all.
    params = [
        {**g, "params": list(g.get("params", []))} if isinstance(g, dict) else g
        for g in params
    ]
    if not params or all(isinstance(g, dict) and not g["params"] for g in params):
        raise ValueError(
            "params is empty: the optimizer would have nothing to update. Fix: "
            "pass the parameters of a model that has some (model.parameters()), "
            "and check that layer_groups or a filter on requires_grad keeps any."
        )
    return params


def group_key(opt: Any, name: str, raise_missing: bool = True) -> tuple | None:
    """The (group key, tuple index) where ``opt`` (an ``HPOptimizer``) holds
    ``name`` (canonical: fitlib's name where it has one), or None / a
    ValueError when its groups lack it."""
    if name not in NAMES:
        key, index = hyper_key(name)
        if groups_hold(opt.param_groups, key, index):
            return key, index
        if not raise_missing:
            return None
        raise ValueError(no_such_hyper(opt.opt, name, key, index, opt.hyper_names()))
    group = opt.param_groups[0]
    adam_like = "betas" in group
    keys = {
        "lr": ("lr", None),
        "mom": ("betas", 0) if adam_like else ("momentum", None),
        "beta": ("betas", 1) if adam_like else ("alpha", None),
        "wd": (TRUE_WD_KEY, None) if opt.true_wd else ("weight_decay", None),
    }
    key, index = keys[name]
    if key in group or (key == TRUE_WD_KEY and name == "wd"):
        return key, index
    if not raise_missing:
        return None
    has = [n for n in ("lr", "mom", "wd", "beta") if n != name and opt.has(n)]
    raise ValueError(
        f"{type(opt.opt).__name__} has no hyper-parameter {name!r} (it would "
        f"map to param_group[{key!r}]). It has: {', '.join(has)}. Fix: do not "
        f"set {name!r} (e.g. drop a momentum schedule), or use an optimizer "
        "that has it."
    )


def groups_hold(groups: list[dict], key: str, index: int | None) -> bool:
    """Whether every group holds a number under ``key`` (at ``index``)."""
    for group in groups:
        value = group.get(key)
        if index is not None:
            ok = isinstance(value, (tuple, list)) and index < len(value)
            value = value[index] if ok else None
        if not is_hyper_number(value):
            return False
    return True
