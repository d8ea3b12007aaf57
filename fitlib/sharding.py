"""Models sharded with FSDP2 (``fully_shard``): sharding, and whole state dicts.

Under ``DistributedTrainer(strategy="fsdp")`` each rank holds a slice of every
parameter (a ``DTensor``), so ``model.state_dict()`` is one rank's slices.
The functions here give the whole state instead, in the same format as an
unsharded model and a plain optimizer: a file saved from a sharded run loads
into a single process (``Learner.load``) and the other way round.

They also see through the wrappers a model may train in: ``DistributedDataParallel``
(and ``DataParallel``) and ``torch.compile``'s ``OptimizedModule``, nested or
not. A state holds the plain model's keys (no ``module.`` or ``_orig_mod.``
prefix), and loads into a plain, a compiled or a wrapped model; a state of
an earlier fitlib whose every key has such a prefix loads too.

Gathering and scattering are collectives: under a sharded model every rank
calls these functions together. Without a sharded model they are the plain
``state_dict``/``load_state_dict`` and need no process group.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Set
from typing import Any

import torch
from torch import nn


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` (or a submodule) was sharded with ``fully_shard``."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    # (Not by the parameters' type: between two forwards of FSDP's outermost
    # unit they may be whole, plain tensors.)
    return any(isinstance(m, FSDPModule) for m in model.modules())


def is_dtensor(x: Any) -> bool:
    """Whether ``x`` is a ``DTensor`` (a tensor spread over processes)."""
    if not isinstance(x, torch.Tensor) or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a ``DTensor``; any other tensor as it is."""
    return t.to_local() if is_dtensor(t) else t


def shard_model(
    model: nn.Module,
    opt: Any,
    device: torch.device,
    units: Callable[[nn.Module], bool] | None = None,
    **fsdp_kwargs: Any,
) -> None:
    """Applies ``fully_shard`` to ``model`` in place, on one mesh of all ranks.

    Each submodule for which ``units(module)`` is true becomes its own unit
    (its parameters are gathered only while it runs), then the model itself.
    ``fully_shard`` replaces the parameters, so the optimizer ``opt`` (an
    ``HPOptimizer`` or torch optimizer) is pointed at the new ones, with any
    state it had moved along.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    inners = torch_optimizers(opt)
    states = [_full_optimizer_state(model, o) if o.state else None for o in inners]
    names = _names(model)
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    # Inner units first: a unit owns the parameters no inner unit claimed.
    for module in reversed(list(model.modules())):
        if module is not model and units is not None and units(module):
            fully_shard(module, mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    params = dict(model.named_parameters())
    for inner, state in zip(inners, states, strict=True):
        for group in inner.param_groups:
            group["params"] = [params[_name(names, p)] for p in group["params"]]
        if state is not None:
            inner.state.clear()
            _set_named(model, inner, state)


# The prefixes that DDP (``module.``) and torch.compile add to the keys.
_PREFIXES = ("module.", "_orig_mod.")


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DDP, ``DataParallel`` and ``torch.compile``'s
    wrapper (nested in any order); any other model as it is.

    Examples:
        >>> from torch.nn.parallel import DataParallel
        >>> from fitlib.sharding import unwrap
        >>> unwrap(DataParallel(model)) is model  # DDP and torch.compile too
        True
    """
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while True:
        if isinstance(model, (DistributedDataParallel, DataParallel)):
            model = model.module
        elif _is_compiled(model):
            model = model._orig_mod
        else:
            return model


def _is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` is ``torch.compile``'s wrapper (none exists before
    torch._dynamo is imported: no import here)."""
    if "torch._dynamo" not in sys.modules:
        return False
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(model, OptimizedModule)


def plain_keys(state: dict, own: Set) -> dict:
    """``state`` with the wrappers' prefixes (``module.``, ``_orig_mod.``)
    taken off its keys, for a state saved from a wrapped model by an earlier
    fitlib: a prefix goes only while every key has it and the keys do not
    already match ``own``, the plain model's state keys (its own submodule
    may be named ``module``)."""
    while state and state.keys() != own:
        prefix = next(
            (p for p in _PREFIXES if all(str(k).startswith(p) for k in state)), None
        )
        if prefix is None:
            break
        state = {k[len(prefix) :]: v for k, v in state.items()}
    return state


def model_state(model: nn.Module) -> dict:
    """The plain model's ``state_dict()`` (see ``unwrap``); for a sharded
    model, gathered on rank 0's host (the other ranks get ``{}``)."""
    model = unwrap(model)
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(gather=True))


def load_model(model: nn.Module, state: dict) -> None:
    """``model.load_state_dict(state)`` for a whole state; a sharded model
    takes rank 0's ``state`` (the other ranks may pass ``{}``), each rank
    keeping its slice of every tensor. A wrapped model loads into its plain
    model, and the keys may carry the wrappers' prefixes (``plain_keys``)."""
    model = unwrap(model)
    state = plain_keys(state, model.state_dict().keys())
    if not is_sharded(model):
        model.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    _reshard(model)
    set_model_state_dict(model, state, options=_options(gather=False, broadcast=True))


def optimizer_state(opt: Any, model: nn.Module) -> dict:
    """``opt.state_dict()``; for a sharded model, gathered on rank 0 (``{}``
    elsewhere) and keyed like a plain optimizer's (parameter numbers)."""
    model = unwrap(model)
    if not is_sharded(model):
        return opt.state_dict()
    parts = getattr(opt, "parts", None)  # a MultiOptimizer: part by part
    if parts is not None:
        return {"parts": {n: optimizer_state(p, model) for n, p in parts.items()}}
    inner = getattr(opt, "opt", opt)
    state = _numbered(_full_optimizer_state(model, inner))
    # (HPOptimizer.state_dict's form, with the whole state in place of a slice)
    return {"opt": state, "true_wd": opt.true_wd} if inner is not opt else state


def load_optimizer_state(opt: Any, model: nn.Module, state: dict) -> None:
    """``opt.load_state_dict(state)`` for what ``optimizer_state`` returns."""
    model = unwrap(model)
    if not is_sharded(model):
        opt.load_state_dict(state)
        return
    parts = getattr(opt, "parts", None)
    if parts is not None:
        saved = state.get("parts", {})
        if list(saved) != list(parts):
            raise ValueError(
                f"the saved optimizer state holds parts {list(saved)}, this "
                f"MultiOptimizer has {list(parts)}. Fix: build the same parts."
            )
        for name, part in parts.items():
            load_optimizer_state(part, model, state["parts"][name])
        return
    inner = getattr(opt, "opt", opt)
    if inner is not opt:  # HPOptimizer: its own setting, then the torch optimizer's
        opt.true_wd, state = state["true_wd"], state["opt"]
    if not state["state"]:  # no tensors to shard (plain SGD): the settings only
        inner.load_state_dict(state)
    else:
        _set_named(model, inner, _named(state, model, inner))


def _set_named(model: nn.Module, inner: Any, named: dict) -> None:
    """Loads a whole by-name optimizer state into the optimizer of a sharded
    model: each rank keeps its slices."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, inner, named, options=_options(gather=False))


# -- formats -------------------------------------------------------------------
def torch_optimizers(opt: Any) -> list:
    """The torch optimizers of an ``HPOptimizer``, a ``MultiOptimizer`` (its
    parts') or a torch optimizer."""
    many = getattr(opt, "optimizers", None)
    return list(many) if many is not None else [getattr(opt, "opt", opt)]


def _full_optimizer_state(model: nn.Module, inner: Any) -> dict:
    """The optimizer's whole state keyed by parameter name (torch's format)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, inner, options=_options(gather=True))


def _numbered(named: dict) -> dict:
    """A by-name optimizer state keyed by numbers, as ``Optimizer.state_dict``."""
    if not named:  # a rank other than 0
        return named
    order = [n for group in named["param_groups"] for n in group["params"]]
    index = {n: i for i, n in enumerate(order)}
    return {
        "state": {index[n]: s for n, s in named["state"].items()},
        "param_groups": [
            {**g, "params": [index[n] for n in g["params"]]}
            for g in named["param_groups"]
        ],
    }


def _named(numbered: dict, model: nn.Module, inner: Any) -> dict:
    """The reverse of ``_numbered``, by this optimizer's order of parameters."""
    names = _names(model)
    order = [_name(names, p) for g in inner.param_groups for p in g["params"]]
    saved = [len(g["params"]) for g in numbered["param_groups"]]
    if saved != [len(g["params"]) for g in inner.param_groups]:
        raise ValueError(
            f"the saved optimizer state has parameter groups of sizes {saved}, "
            f"this optimizer {[len(g['params']) for g in inner.param_groups]}. "
            "Fix: build the same model and layer groups before loading."
        )
    return {
        "state": {order[int(i)]: s for i, s in numbered["state"].items()},
        "param_groups": [
            {**g, "params": [order[int(i)] for i in g["params"]]}
            for g in numbered["param_groups"]
        ],
    }


def _names(model: nn.Module) -> dict[int, str]:
    """Each parameter's name, by ``id``."""
    return {id(p): n for n, p in model.named_parameters()}


def _name(names: dict, param: torch.Tensor) -> str:
    try:
        return names[id(param)]
    except KeyError:
        raise ValueError(
            f"the optimizer holds a parameter of shape {tuple(param.shape)} that "
            "is not in the model, so sharding cannot move it. Fix: build the "
            "optimizer from model.parameters() only."
        ) from None


def _reshard(model: nn.Module) -> None:
    """Every unit back to its slices: after a forward without backward
    (validation), FSDP leaves the outermost unit's parameters whole."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _options(gather: bool, broadcast: bool = False) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Gathering: the whole tensors, on rank 0's host only (the file's writer).
    return StateDictOptions(
        full_state_dict=True, cpu_offload=gather, broadcast_from_rank0=broadcast
    )
