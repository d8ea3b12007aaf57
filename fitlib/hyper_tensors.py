"""Hyper-parameters held as 0-d tensors, for a compiled optimizer step that
never recompiles (``HPOptimizer.hypers_as_tensors``).

``torch.compile`` treats a Python float in the parameter groups as a
constant: a schedule that changes ``lr`` at every step recompiles the
compiled step (pytorch issue 133898). A 0-d tensor written in place
(``fill_``) is an input of the graph instead, so one graph serves a whole
fit. Which hyper-parameters torch takes as tensors (torch 2.14, checked by
running them):

- ``lr``: every optimizer whose ``lr`` torch declares ``float | Tensor``;
  with ``foreach`` on (torch's default on a GPU) only if it is also
  ``capturable`` (or ``fused``), as torch requires; ``SGD`` needs neither.
- ``betas`` (``mom`` and ``beta``): where torch declares them tensors
  (``Adam``, ``AdamW``); the two are converted together.
- never ``momentum`` (``SGD``, ``RMSprop``: declared ``float``; ``SGD``'s
  step tests ``momentum != 0`` in Python) nor ``weight_decay`` (``SGD`` and
  ``Adam`` test ``weight_decay != 0`` in Python): as tensors, a compiled
  step breaks its graph there and a GPU step reads the device.

The wrapper keeps a Python float beside each tensor (the mirror), so that
reading a hyper-parameter never reads the device; files hold the floats, and
``HPOptimizer.hypers_as_floats`` puts them back in the groups (``Compile``
does when its fit ends).

The tensors are float64 on the CPU and float32 on other devices. On the CPU a
float64 ``lr`` steps exactly as the Python float (a double) does: torch's
step computes ``lr / bias_correction`` and ``lr * weight_decay`` in the
tensor's dtype, so a float32 lr rounds them (AdamW, a small MLP, 28 steps:
weights up to 7e-8 apart with a float32 lr, equal with a float64 one).
``betas`` stay a little apart in any dtype (1e-7 after those steps): torch
casts a tensor ``beta1`` to the parameters' dtype for ``lerp_``. Off the CPU,
torch's capturable and fused steps take the tensors on the parameters'
device, where float64 is slow or missing (MPS): float32 stays there.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

# fitlib's name -> the group key and tuple index it is converted under,
# per the kind of optimizer (betas: Adam family; else SGD-like).
_BETAS = {"mom": ("betas", 0), "beta": ("betas", 1)}
NAMED_KEYS = {"lr": ("lr", None), **_BETAS}
Key = tuple[str, int | None]
Live = list[dict[Key, torch.Tensor]]  # per group: (key, index) -> its tensor
Mirror = list[dict[Key, float]]  # per group: (key, index) -> its value


def tensor_keys(
    opt: torch.optim.Optimizer, names: Any, has: Any, true_wd: bool
) -> dict[str, Key]:
    """fitlib's names -> the (group key, index) to hold as tensors on ``opt``.

    ``names`` None: every one of ``lr``, ``mom``, ``beta`` that ``opt`` takes
    as a tensor (``has(name)``: whether the wrapper has it); else exactly
    those names, each refused (ValueError) where ``opt`` cannot take it."""
    kind = type(opt).__name__
    wanted = ("lr", "mom", "beta", "wd") if names is None else _names(names)
    out: dict[str, Key] = {}
    for name in wanted:
        if names is None and not has(name):
            continue
        why = _why_not(opt, name, true_wd, has)
        if why is None:
            out[name] = ("lr", None) if name == "lr" else _BETAS[name]
        elif names is not None or name == "lr":
            raise ValueError(f"hypers_as_tensors: {kind} {why}")
    if "mom" in out or "beta" in out:  # torch takes both betas or neither
        out.update(_BETAS)
    if out:
        _check_flags(opt, kind)
    return out


def _names(names: Any, owner: str = "hypers_as_tensors") -> tuple[str, ...]:
    names = (names,) if isinstance(names, str) else tuple(names)
    unknown = [n for n in names if n not in ("lr", "mom", "beta", "wd")]
    if unknown or not names:
        raise ValueError(
            f"{owner}: names must be some of 'lr', 'mom', 'beta', 'wd'; "
            f"got {names!r}. Fix: e.g. opt.{owner}(('lr', 'mom')), or no names "
            "for every one the optimizer takes (or holds) as a tensor."
        )
    return names


def _declares_tensor(opt: torch.optim.Optimizer, arg: str) -> bool:
    """Whether ``type(opt)``'s constructor declares ``arg`` a Tensor too."""
    try:
        param = inspect.signature(type(opt).__init__).parameters.get(arg)
    except (TypeError, ValueError):
        return False
    return param is not None and "Tensor" in str(param.annotation)


def _why_not(opt: torch.optim.Optimizer, name: str, true_wd: bool, has: Any) -> Any:
    """Why ``opt`` cannot hold ``name`` as a tensor (the message's tail), or None."""
    if name == "lr":
        if _declares_tensor(opt, "lr"):
            return None
        return (
            "does not declare a Tensor lr (its constructor's lr is not "
            "'float | Tensor'), so a tensor lr may not work. Fix: use a torch "
            "optimizer (SGD, Adam, AdamW...), or compile without tensor "
            "hyper-parameters."
        )
    if name in ("mom", "beta") and "betas" in opt.param_groups[0]:
        if _declares_tensor(opt, "betas") and has(name):
            return None
        return (
            "does not declare its betas as Tensors, so mom/beta stay floats. "
            "Fix: convert only lr (opt.hypers_as_tensors(('lr',))), or use "
            "Adam/AdamW."
        )
    what = {"mom": "momentum", "beta": "alpha", "wd": "weight_decay"}[name]
    return (
        f"cannot hold {name!r} ({what!r}) as a tensor: torch's step tests it in "
        "Python (e.g. 'momentum != 0', 'weight_decay != 0'), which breaks a "
        "compiled step's graph and reads the device at every step on a GPU. "
        f"Fix: leave {name!r} a float (opt.hypers_as_tensors() without names "
        "does), and do not schedule it in a compiled step."
    )


def _check_flags(opt: torch.optim.Optimizer, kind: str) -> None:
    """Refuses a tensor hyper-parameter where torch's step would: ``foreach``
    without ``capturable`` (``fused`` is fine) on an optimizer that has
    ``capturable``."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    for group in opt.param_groups:
        if "capturable" not in group or group["capturable"] or group.get("fused"):
            continue
        foreach = group.get("foreach")
        if foreach is None:
            differentiable = bool(group.get("differentiable"))
            foreach = _default_to_fused_or_foreach(group["params"], differentiable)[1]
        if foreach:
            raise ValueError(
                f"hypers_as_tensors: {kind}(foreach=True, capturable=False) "
                "refuses a Tensor lr or betas (torch: 'not supported for "
                "capturable=False and foreach=True'; foreach is torch's default "
                f"on a GPU). Fix: make it with capturable=True (opt_func="
                f"functools.partial(torch.optim.{kind}, capturable=True)), or "
                "foreach=False."
            )


def make_live(groups: list[dict], keys: dict[str, Key]) -> tuple[Live, Mirror]:
    """Puts a 0-d tensor on each group's parameters' device (float64 on the
    CPU, float32 elsewhere: see the module's docstring) in place of each value
    under ``keys`` (a tuple's elements all at once); returns the tensors and
    the floats they hold, per group."""
    live: Live = []
    mirror: Mirror = []
    for group in groups:
        device = group["params"][0].device
        dtype = torch.float64 if device.type == "cpu" else torch.float32
        tensors, floats = {}, {}
        for key, index in keys.values():
            floats[(key, index)] = float(_get(group, key, index))
            tensors[(key, index)] = torch.tensor(
                floats[(key, index)], dtype=dtype, device=device
            )
        live.append(tensors)
        mirror.append(floats)
        install(group, tensors)
    return live, mirror


def install(group: dict, tensors: dict[Key, torch.Tensor]) -> None:
    """Puts ``tensors`` into ``group`` under their keys: a tuple's (``betas``)
    are rebuilt from the group's tuple with the tensors in their places."""
    for (key, index), tensor in tensors.items():
        put(group, key, index, tensor)


def put(group: dict, key: str, index: int | None, value: Any) -> None:
    """Writes ``value`` into a parameter group at ``key``, or at element
    ``index`` of the tuple under ``key`` (``betas``), rebuilt with ``value``
    in its place (torch's groups hold tuples, which cannot be written).

    Examples:
        >>> from fitlib.hyper_tensors import put
        >>> group = {"lr": 0.1, "betas": (0.9, 0.999)}
        >>> put(group, "betas", 1, 0.99); put(group, "lr", None, 0.2); group
        {'lr': 0.2, 'betas': (0.9, 0.99)}
    """
    if index is None:
        group[key] = value
    else:
        pair = list(group[key])
        pair[index] = value
        group[key] = tuple(pair)


def reinstall(groups: list[dict], live: Live, mirror: Mirror) -> None:
    """After ``load_state_dict`` put the loaded values (floats in the groups)
    into the same tensors, and those back into the groups (a compiled step
    holds the tensors: they stay the same objects)."""
    for group, tensors, floats in zip(groups, live, mirror):
        for (key, index), tensor in tensors.items():
            value = float(_get(group, key, index))  # (a load: read once)
            tensor.fill_(value)
            floats[(key, index)] = value
        install(group, tensors)


def floats_in(state: dict, mirror: Mirror) -> dict:
    """A torch ``state_dict()`` (whose parameter groups hold the live tensors)
    with the mirror's floats in their places; ``state`` itself, changed."""
    for group, floats in zip(state["param_groups"], mirror):
        for (key, index), value in floats.items():
            put(group, key, index, value)
    return state


def _get(group: dict, key: str, index: int | None) -> Any:
    value = group[key]
    return value if index is None else value[index]


def as_tensors(opt: Any, names: Any = None) -> tuple[str, ...]:
    """``HPOptimizer.hypers_as_tensors``: converts in place, once per
    hyper-parameter; the names held as tensors."""
    keys = tensor_keys(opt.opt, names, opt.has, opt.true_wd)
    have = opt._mirror[0] if opt._mirror else {}
    new = {n: k for n, k in keys.items() if k not in have}
    if new:
        live, mirror = make_live(opt.param_groups, new)
        if not opt._live:
            opt._live, opt._mirror = [{} for _ in live], [{} for _ in mirror]
        for old, add in zip(opt._live + opt._mirror, live + mirror):
            old.update(add)
    return held(opt)


def held(opt: Any) -> tuple[str, ...]:
    """The names an ``HPOptimizer`` holds as tensors now (from its mirror)."""
    keys = opt._mirror[0] if opt._mirror else {}
    return tuple(n for n, k in NAMED_KEYS.items() if k in keys)


def as_floats(opt: Any, names: Any = None) -> tuple[str, ...]:
    """``HPOptimizer.hypers_as_floats``: the mirror's floats put back in the
    groups in place of the tensors (of ``names``, or all; both betas or
    neither); the names still held as tensors."""
    names = held(opt) if names is None else _names(names, "hypers_as_floats")
    keys = {NAMED_KEYS[n] for n in names if n in NAMED_KEYS}  # ('wd': never held)
    if keys & set(_BETAS.values()):
        keys |= set(_BETAS.values())
    for group, tensors, floats in zip(opt.param_groups, opt._live, opt._mirror):
        for key in keys & set(floats):
            put(group, *key, floats.pop(key))
            del tensors[key]
    if opt._mirror and not opt._mirror[0]:
        opt._live, opt._mirror = [], []
    return held(opt)


def write_live(live: Live, mirror: Mirror, key: Key, values: list[float]) -> None:
    """Writes ``values`` (one per group) into the tensors under ``key`` (a
    group key and tuple index) in place, and their floats."""
    for tensors, floats, v in zip(live, mirror, values):
        tensors[key].fill_(v)
        floats[key] = v
