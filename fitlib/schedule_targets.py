"""What a schedule sets besides an optimizer's hyper-parameters: an attribute
of the model or of the loss function, reached by its dotted path from the
fit's state (``"model.head.dropout.p"``, ``"loss_func.weight"``), or a setter
function. ``ParamScheduler`` sorts its keys with ``target_kind``, checks an
attribute before training (``check_attribute``) and writes it at every step
(``set_attribute``: a tensor is filled in place, on its device, without a host
sync)."""

from __future__ import annotations

from typing import Any

import torch

from fitlib.errors import closest, did_you_mean, is_number
from fitlib.hyper_checks import hyper_key
from fitlib.sharding import unwrap

# What a path to an attribute starts from: a state key of the fit.
ROOTS = ("model", "loss_func")


def target_kind(key: Any) -> str:
    """What a key of a schedule's dict names: ``"hyper"`` (the optimizer's),
    ``"attribute"`` (a path from the model or the loss) or ``"setter"`` (a
    function); refuses a key that names none of them.

    Examples:
        >>> from fitlib.schedule_targets import target_kind
        >>> target_kind("betas[1]"), target_kind("model.head.p"), target_kind(print)
        ('hyper', 'attribute', 'setter')
    """
    if callable(key) and not isinstance(key, str):
        return "setter"
    if not isinstance(key, str):
        raise TypeError(
            f"schedules: a key must be a hyper-parameter's name, an attribute's "
            f"path or a setter function; got {key!r} ({type(key).__name__}). "
            "Fix: e.g. {'eps': ...}, {'model.head.dropout.p': ...} or "
            "{set_weight: ...}."
        )
    root, dot, path = key.partition(".")
    if not dot:
        hyper_key(key)  # its syntax: 'eps', 'betas[1]'
        return "hyper"
    parts = path.split(".")
    if root in ROOTS and all(p.isidentifier() or p.isdigit() for p in parts):
        return "attribute"
    close = did_you_mean(root, ROOTS)
    raise ValueError(
        f"schedules: {key!r} is neither a hyper-parameter's name ('eps', "
        f"'betas[1]') nor an attribute's path: a path starts from "
        f"{' or '.join(ROOTS)} and names attributes ('model.head.dropout.p'; "
        f"it starts from {root!r}{close}). Fix: e.g. 'model.{key}'; for one "
        f"part's hyper-parameter, ParamScheduler({{'{parts[-1]}': ...}}, "
        f"part={root!r})."
    )


def attribute_owner(owner: str, path: str, model: Any, loss_func: Any) -> Any:
    """The object that holds the last attribute of ``path``, reached from the
    fit's (unwrapped) model or its loss function."""
    root, *names = path.split(".")
    obj = loss_func if root == "loss_func" else model
    if isinstance(obj, torch.nn.Module):
        obj = unwrap(obj)  # DDP, DataParallel, torch.compile's wrapper
    reached = root
    for name in names[:-1]:
        obj = _attribute(owner, path, obj, name, reached)
        reached += f".{name}"
    if not hasattr(obj, names[-1]):
        _attribute(owner, path, obj, names[-1], reached)  # its message
    return obj


def _attribute(owner: str, path: str, obj: Any, name: str, reached: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        pass
    choices = _names(obj)
    numbers = [c for c in choices if is_number(getattr(obj, c, None))]
    best = closest(name, choices) or next(iter(numbers + choices), "p")
    example = f"{reached}.{best}"
    raise ValueError(
        f"{owner}: {path!r} names no attribute: {reached} ({type(obj).__name__}) "
        f"has no {name!r}{did_you_mean(name, choices)}. It has: "
        f"{', '.join(choices[:12]) or 'no attributes'}. Fix: a path of "
        f"attributes that exist when training begins, e.g. {example!r}."
    )


def _names(obj: Any) -> list[str]:
    """The attributes a path may name on ``obj``: a module's submodules,
    parameters, buffers and plain attributes; another object's own."""
    own = [
        k
        for k in getattr(obj, "__dict__", {})
        if not k.startswith("_")
        and not (k == "training" and isinstance(obj, torch.nn.Module))
    ]
    if isinstance(obj, torch.nn.Module):
        own = [*obj._modules, *obj._parameters, *obj._buffers, *own]
    return own


def check_attribute(owner: str, path: str, obj: Any) -> None:
    """Refuses an attribute that a schedule cannot set: not a number."""
    name = path.rpartition(".")[2]
    value = getattr(obj, name)
    if isinstance(value, torch.nn.Parameter):
        what = "a parameter the optimizer trains"
    elif isinstance(value, torch.Tensor):
        if value.is_floating_point():
            return
        what = f"a {value.dtype} tensor"
    elif is_number(value):
        return
    elif isinstance(value, torch.nn.Module):
        numbers = [n for n in _names(value) if is_number(getattr(value, n, None))]
        what = f"a module, {type(value).__name__} (its numbers: {numbers or 'none'})"
    else:
        what = f"{value!r} ({type(value).__name__})"
    raise TypeError(
        f"{owner}: {path!r} holds {what}; a schedule sets a number (a float or "
        "int attribute, or a floating-point tensor, filled in place). Fix: "
        "schedule an attribute that holds a number, or pass a setter function "
        "as the key: {set_it: schedule}."
    )


def set_attribute(obj: Any, name: str, value: float) -> None:
    """Sets ``obj.name`` to ``value``: a tensor filled in place, any other
    attribute replaced."""
    current = getattr(obj, name)
    if isinstance(current, torch.Tensor):
        with torch.no_grad():
            current.fill_(value)  # on its device, without waiting for it
    else:
        setattr(obj, name, value)
