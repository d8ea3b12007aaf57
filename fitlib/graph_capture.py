"""What ``CudaGraph`` checks before training and changes for the fit, and
what its replays compare: the refusals (callbacks inside the step, the loss
scaler, the optimizer, the device, a distributed fit, unfreezing, schedules
of values a graph bakes in); the optimizer made capturable (``capturable``
and the lr as a tensor, put back after the fit) while its ``state_dict``,
what checkpoints save, stays the eager optimizer's (``eager_state``); and
what differs from what a graph captured (``changed``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fitlib.callback import Callback, inner_callback
from fitlib.data import model_device
from fitlib.hyper_tensors import held
from fitlib.multi_optimizer import MultiOptimizer
from fitlib.optim import HPOptimizer
from fitlib.schedule_targets import attribute_owner, target_kind
from fitlib.sharding import torch_optimizers

# The hooks that run inside the captured step, between the forward and the
# optimizer's step: a replay runs their kernels, not their Python.
GRAPH_HOOKS = ("on_loss_begin", "on_backward_begin", "on_backward_end")
# Callbacks refused by class name (no import of their modules): a distributed
# fit's, whose CUDA graphs never ran on GPUs here, and one that unfreezes.
DDP_CALLBACKS = ("DistributedTrainer",)
UNFREEZES = ("BackboneFinetuning",)
# Whose forward under a capture never ran on a GPU here: checkpointing sets
# the CUDA generator's state and recomputes inside the captured backward.
UNTESTED = ("ActivationCheckpointing",)


def check_callbacks(callbacks: list) -> None:
    """Refuses a callback with hooks inside the step that does not declare
    ``cuda_graph_safe = True``."""
    for cb in callbacks:
        hooks = [h for h in GRAPH_HOOKS
                 if getattr(type(cb), h) is not getattr(Callback, h)]  # fmt: skip
        if hooks and getattr(cb, "cuda_graph_safe", None) is not True:
            raise ValueError(
                f"CudaGraph: {cb.name} runs inside the step ({', '.join(hooks)}) "
                "and does not declare cuda_graph_safe = True; a replay runs the "
                "step's kernels but none of its Python, so its hooks would not "
                "run again (one that decides per batch whether to step, as "
                "GradientAccumulation does, cannot be replayed). Fix: set "
                f"cuda_graph_safe = True on {cb.name} if its hooks only launch "
                "device work and read nothing on the host, or leave out "
                f"{cb.name} or CudaGraph."
            )


def check_loss_scaler(opt: Any) -> None:
    """Refuses float16 loss scaling with an optimizer that is not fused: the
    scaler would read on the host whether the gradients were finite."""
    if getattr(opt, "grad_scaler", None) is None:
        return
    for o in torch_optimizers(opt):
        if not getattr(o, "_step_supports_amp_scaling", False):
            kind = type(o).__name__
            raise ValueError(
                f"CudaGraph: MixedPrecision(float16) with {kind} not fused: its "
                "loss scaler reads on the host, at each step, whether the "
                "gradients were finite, which a graph cannot replay. Fix: "
                f"create it fused (partial(torch.optim.{kind}, fused=True); "
                "Learner.to_fp16() does), or train in bfloat16 (to_bf16())."
            )


def check_optimizers(opt: Any) -> None:
    """Refuses an optimizer whose step cannot be captured: one without
    torch's ``capturable`` option, other than SGD (whose step reads nothing
    on the host)."""
    for o in torch_optimizers(opt):
        groups = o.param_groups
        if all("capturable" in g for g in groups) or isinstance(o, torch.optim.SGD):
            continue
        kind = type(o).__name__
        raise ValueError(
            f"CudaGraph: {kind} has no capturable option, so its step may read "
            "the device on the host (its step count, a closure), which a graph "
            "cannot replay. Fix: an optimizer torch can capture (AdamW, Adam, "
            "SGD, RMSprop...), or train without CudaGraph."
        )


def check_device(model: nn.Module) -> None:
    device = model_device(model)
    if device.type != "cuda":
        raise ValueError(
            f"CudaGraph: the model is on {device.type!r}; a CUDA graph replays "
            "GPU work only. Fix: train on a CUDA device (DataBunch(..., "
            "device='cuda')), or leave out CudaGraph."
        )


def check_not_distributed(model: nn.Module, callbacks: list) -> None:
    """Refuses a distributed fit: CUDA graphs under DDP never ran on GPUs here."""
    names = {type(inner_callback(cb)).__name__ for cb in callbacks}
    if names & set(DDP_CALLBACKS) or isinstance(model, DistributedDataParallel):
        raise ValueError(
            "CudaGraph: the fit is distributed (DistributedTrainer or a "
            "DistributedDataParallel model); a CUDA graph of a DDP step (its "
            "warm-up, its gradient buckets) is not yet tested on GPUs, so it is "
            "refused. Fix: train without CudaGraph under DDP."
        )


def check_no_unfreezing(callbacks: list) -> None:
    """Refuses a callback that changes which parameters train during the fit
    (a graph replays the backward it captured)."""
    for cb in callbacks:
        name = type(inner_callback(cb)).__name__
        if name in UNTESTED:
            raise ValueError(
                f"CudaGraph: {name} recomputes its blocks inside the backward "
                "and sets the CUDA generator's state there; captured in a "
                "graph, this is not yet tested on a GPU. Fix: train with one "
                f"of them: without CudaGraph, or without {name}."
            )
        if name in UNFREEZES:
            raise ValueError(
                f"CudaGraph: {name} unfreezes the backbone during the fit "
                "(Learner.fine_tune adds it), but a replay runs the backward "
                "and the step that were captured: the unfrozen parameters would "
                "never train. Fix: train without CudaGraph while unfreezing, "
                "then add it for the fit after (learn.unfreeze(), "
                "learn.cuda_graph(), learn.fit(...))."
            )


def trains(model: nn.Module) -> tuple[bool, ...]:
    """Which of ``model``'s parameters train (``requires_grad``), in order."""
    return tuple(p.requires_grad for p in model.parameters())


def changed(
    captured: tuple, flags: tuple[bool, ...], model: Any, loss_func: Any, opt: Any
) -> list[str]:
    """What differs from what the graph captured: the model, the loss
    function or the optimizer (another object), or which parameters train."""
    changes = [
        what
        for what, now, then in zip(
            ("the model", "the loss function", "the optimizer"),
            (model, loss_func, opt),
            captured,
            strict=True,
        )
        if now is not then
    ]
    if not changes and trains(model) != flags:
        changes.append("which parameters train (requires_grad: a freeze or unfreeze)")
    return changes


def refuse_changes(changes: list[str]) -> None:
    if changes:
        raise ValueError(
            f"CudaGraph: {' and '.join(changes)} changed after the step was "
            "captured; a replay runs the captured step, with the objects and "
            "the trainable parameters it had then. Fix: make the change "
            "before the fit, or train without CudaGraph (a new fit captures "
            "again)."
        )


def check_scheduled_floats(
    opt: Any, callbacks: list, model: Any = None, loss_func: Any = None
) -> None:
    """Refuses a schedule of a hyper-parameter that stays a float, or of an
    attribute that is not a tensor (baked into the graph), before training."""
    parts = dict(opt.parts) if isinstance(opt, MultiOptimizer) else {None: opt}
    for cb in callbacks:
        inner = inner_callback(cb)
        # SWA(swa_lr=...) sets the lr without listing it (ARCHITECTURE: its
        # named exception): a schedule of the lr all the same.
        swa_lr = ("lr",) if getattr(inner, "swa_lr", None) is not None else ()
        for name in (*getattr(inner, "sets_hypers", ()), *swa_lr):
            root, dot, rest = name.partition(".")
            if dot and root in parts and root is not None:  # one part's: 'head.lr'
                _check_hyper(inner, name, rest, [parts[root]])
            elif target_kind(name) == "attribute":
                _check_attribute(inner, name, model, loss_func)
            else:
                _check_hyper(inner, name, name, list(parts.values()))


def _check_hyper(inner: Callback, name: str, key: str, parts: list) -> None:
    for part in parts:
        canonical = part.canonical(key) if isinstance(part, HPOptimizer) else key
        if part.has(canonical) and canonical not in held(part):
            raise ValueError(
                f"CudaGraph: {inner.name} schedules {name!r}, which "
                f"{type(part.opt).__name__} holds as a float, baked "
                "into the graph: the replays would never see it change. "
                "Fix: schedule only the lr, held as a tensor (with SGD, "
                "SGD(fused=True); for 1cycle, fit_one_cycle(..., "
                "moms=None)), or train without CudaGraph."
            )


def _check_attribute(inner: Callback, path: str, model: Any, loss_func: Any) -> None:
    owner = attribute_owner(f"CudaGraph ({inner.name})", path, model, loss_func)
    value = getattr(owner, path.rpartition(".")[2])
    if not isinstance(value, torch.Tensor):
        raise ValueError(
            f"CudaGraph: {inner.name} schedules {path!r}, which holds "
            f"{value!r} ({type(value).__name__}), not a tensor: a graph bakes "
            "the value it captured, so the replays would never see it change. "
            "Fix: hold it as a tensor that the schedule fills in place (a "
            "buffer the forward reads), leave it unscheduled, or train without "
            "CudaGraph."
        )


def make_capturable(opt: Any) -> list[Callable[[], None]]:
    """``capturable=True`` where the optimizer has it (its step counters on
    the parameters' device) and the hyper-parameters as tensors; returns what
    puts each back: ``capturable`` as the optimizer's default (False unless
    made capturable: also after a resume from a checkpoint that holds True).
    Meanwhile, its ``state_dict`` (what checkpoints save) is the eager
    optimizer's (``eager_state``)."""
    undo: list[Callable[[], None]] = []
    for o in torch_optimizers(opt):
        original = o.defaults.get("capturable", False)
        changed = []
        for i, group in enumerate(o.param_groups):
            if "capturable" in group and not original:
                changed.append(i)
                group["capturable"] = True
                undo.append(_capturable_undo(o, group))
                _steps_to(o, group, None)
        if changed:
            hook = functools.partial(eager_state, groups=tuple(changed))
            undo.append(o.register_state_dict_post_hook(hook).remove)
    parts = list(opt.parts.values()) if isinstance(opt, MultiOptimizer) else [opt]
    for part in parts:
        before = held(part)
        if _takes_tensor_lr(part.opt):
            with suppress(ValueError):  # (an lr torch does not declare a tensor)
                part.hypers_as_tensors(("lr",))  # (tensor betas: see the module)
        made = tuple(n for n in held(part) if n not in before)
        if made:
            undo.append(lambda part=part, made=made: part.hypers_as_floats(made))
    return undo


def eager_state(optimizer: Any, state_dict: dict, groups: tuple = ()) -> dict:
    """A torch optimizer's ``state_dict`` post-hook: the ``groups`` (indices)
    made capturable for the fit are saved as the eager optimizer has them:
    ``capturable=False`` and, unless fused, their ``step`` counters on the
    CPU. The live state is not changed (new dicts replace those it shares)."""
    state = state_dict["state"]
    for i in groups:
        group = state_dict["param_groups"][i]
        group["capturable"] = False
        if group.get("fused"):
            continue
        for index in group["params"]:
            entry = state.get(index)
            step = None if entry is None else entry.get("step")
            if isinstance(step, torch.Tensor):  # (on the CPU: the same tensor)
                state[index] = {**entry, "step": step.to("cpu", torch.float32)}
    return state_dict


def _takes_tensor_lr(o: torch.optim.Optimizer) -> bool:
    """Whether ``o``'s captured step takes a tensor lr without reading it on
    the host: capturable or fused groups (SGD's foreach step reads it)."""
    return all(g.get("capturable") or g.get("fused") for g in o.param_groups)


def _capturable_undo(o: torch.optim.Optimizer, group: dict) -> Callable[[], None]:
    def undo() -> None:
        group["capturable"] = False  # (the default: only then made capturable)
        if not group.get("fused"):  # torch keeps a plain step's counter on the CPU
            _steps_to(o, group, "cpu")

    return undo


def _steps_to(o: torch.optim.Optimizer, group: dict, device: Any) -> None:
    """Moves the group's ``step`` counters to ``device`` (None: each
    parameter's)."""
    for p in group["params"]:
        step = o.state.get(p, {}).get("step")
        if isinstance(step, torch.Tensor):
            where = p.device if device is None else torch.device(device)
            o.state[p]["step"] = step.to(where, torch.float32)
