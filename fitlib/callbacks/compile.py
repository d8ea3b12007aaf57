"""``Compile``: trains through ``torch.compile``, the module kept as it is."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fitlib.ranks as ranks
from fitlib.callback import Callback
from fitlib.checks import check_flag, check_int
from fitlib.errors import ArgTypeError
from fitlib.hyper_tensors import held
from fitlib.multi_optimizer import MultiOptimizer
from fitlib.optim import HPOptimizer
from fitlib.sharding import torch_optimizers

# The hooks that run inside a training step, between the loss and the
# optimizer's step: a callback that overrides one declares whether a compiled
# step may run with it (``compiled_step_safe``).
STEP_HOOKS = ("on_backward_begin", "on_backward_end")


class Compile(Callback):
    """Compiles the model's forward with ``torch.compile`` for training.

    The module is compiled in place (``nn.Module.compile``): it stays the same
    object, with the same ``state_dict`` keys (no ``_orig_mod.`` prefix), so
    ``Learner.save``/``load``, ``Checkpoint``, ``EarlyStopping``'s best
    weights, and files of compiled and plain training all load into each
    other. Under ``DistributedTrainer`` the module inside the DDP wrapper is
    compiled: DDP's own wrapper, compiled as torch suggests, compiled no
    graph at all in our test (gloo, CPUs), silently; with the inner module
    compiled, DDP's gradient all-reduce starts once the compiled backward is
    done instead of overlapping it. Under ``MixedPrecision`` the autocast
    region runs inside the compiled forward.
    When the fit ends the module is as it was before: plain, or compiled
    as its user compiled it (``model.compile``). The fit's own validation
    runs compiled (a second graph, for eval mode), and so do a Learner's
    ``validate``, ``get_preds`` and ``predict`` (``in_evaluation``: compiled
    for the call, as before after it, so one inside a fit leaves the fit
    compiled; graphs Dynamo has already made are reused), so they compute
    what the fit's validation computes. The LR finder's sweep leaves
    ``Compile`` out and runs eagerly. A fit says once,
    as it starts, that it compiles (rank 0): the first batches wait for
    the compiler.

    A new input shape compiles again. With torch's default (``dynamic=None``)
    the second shape of a dimension marks it dynamic: a ragged last batch
    costs one more compilation in the first epoch and none after (tested).
    ``dynamic=False`` compiles once per shape instead; ``drop_last=True`` on
    the training loader avoids the ragged batch altogether.

    A backend that fails (inductor on a CPU without a C++ compiler) fails the
    first batch, before any step, with the fix: ``backend="aot_eager"``, or
    no ``Compile``.

    ``step=True`` compiles the optimizer's step too (torch's "compiled
    optimizer": its per-parameter loops become a few fused kernels), for the
    fit's training only. The loop is unchanged: ``opt.step()`` calls the
    compiled step, installed on each torch optimizer inside the
    ``HPOptimizer`` (``MultiOptimizer``: each part's) and taken off when the
    fit ends, so nothing saved knows of it; a ``GradScaler``'s step stays
    outside it, and the hooks between backward and step run eagerly around
    it. The hyper-parameters a schedule changes at every step do not
    recompile it: they are 0-d tensors (``HPOptimizer.hypers_as_tensors``),
    or, where one cannot be (SGD's momentum), floats that Dynamo traces as
    inputs after their first change (one more graph as training starts,
    none after). The loss stays
    eager, the loop calls it apart from the model (a model that computes its
    own loss, ``loss_func=None``, compiles it with the forward). Where the
    step cannot be compiled the fit says why, once, and steps eagerly: a
    callback that overrides ``on_backward_begin`` or ``on_backward_end``
    (inside the step) without declaring ``compiled_step_safe = True``
    (mixed precision, clipping and accumulation do; one that reads the host
    or replaces the optimizer's values per step must not), a fused optimizer
    (``fused=True``: torch.compile does not trace it; ``Learner.to_fp16()``
    makes one), or one that cannot hold its hyper-parameters as tensors.

    Args:
        step: also compile the optimizer's step (see above).
        **kwargs: ``torch.compile``'s own (``mode``, ``backend``, ``dynamic``,
            ``fullgraph``, ``options``); the step takes ``backend``, ``mode``
            and ``options``.

    Examples:
        >>> learn.compile(mode="max-autotune")  # adds Compile to every fit
        Learner(Sequential, loss_func=cross_entropy, opt_func=AdamW, ...)
        >>> learn.callbacks
        [Compile(mode='max-autotune')]
        >>> learn.compile(step=True).callbacks  # the optimizer's step too
        [Compile(step=True)]

        With ``fit``: ``fit(3, model, F.cross_entropy, opt, data,
        callbacks=[Compile()])``. The first batches of a fit wait for the
        compiler (seconds on a CPU, minutes for a large model with
        ``mode="max-autotune"``); this example does not train for that reason.
    """

    order = -190  # after DistributedTrainer (-200), which may wrap the model
    in_lr_find = False  # a short sweep: compiling would take longer than it
    in_evaluation = True  # validate, get_preds, predict: compiled too

    def __init__(self, step: bool = False, **kwargs: Any) -> None:
        self.step = check_flag(step, "step", owner="Compile")
        allowed = [
            p for p in inspect.signature(torch.compile).parameters if p != "model"
        ]
        unknown = sorted(set(kwargs) - set(allowed))
        if unknown:
            raise TypeError(
                f"Compile: {unknown} are not arguments of torch.compile; it takes "
                f"{', '.join(allowed)}. Fix: e.g. Compile(mode='max-autotune')."
            )
        _check_types(kwargs)
        backend = kwargs.get("backend", "inductor")
        known = torch.compiler.list_backends(exclude_tags=())
        if isinstance(backend, str) and backend not in known:
            raise ValueError(
                f"Compile: backend={backend!r} is not a torch.compile backend; "
                f"this torch has {', '.join(sorted(known))}. Fix: e.g. "
                "backend='inductor' (the default) or 'aot_eager'."
            )
        _check_mode_and_options(kwargs)
        self.kwargs = kwargs
        # (module, its compiled state before) per begun fit or evaluation: an
        # evaluation inside a fit (validate at a snapshot) nests in it.
        self._before: list[tuple[nn.Module, Any]] = []
        self._made: Any = None  # the compiled call this callback made last
        self._said = False  # that it compiles (see on_train_begin)
        self._steps: list[_CompiledStep] = []  # installed by this fit
        # (HPOptimizer, the names this fit made tensors): floats again after it
        self._tensors: list[tuple[HPOptimizer, tuple[str, ...]]] = []

    def on_train_begin(
        self, model: nn.Module, opt: Any, callbacks: list | None = None
    ) -> None:
        """Runs before training (and before a Learner's evaluation, without
        ``opt``): compiles the model in place (inside DDP), remembering how it
        was compiled before (a user's own ``model.compile``, or the fit's);
        with ``step=True`` the optimizer's step of a fit too."""
        if isinstance(model, DistributedDataParallel):
            model = model.module  # DDP's forward calls it: compiled from there
        before = getattr(model, "_compiled_call_impl", None)
        self._before.append((model, before))
        if before is not None and before is self._made:
            return  # an evaluation inside this fit: already compiled by it
        said = "the model (the first batches are slow)."
        if self.step and opt is not None:
            eager = self._compile_step(opt, callbacks or [])
            said = (f"the model (the first batches are slow); the optimizer step "
                    f"stays eager: {eager}." if eager else "the model and the "
                    "optimizer step (the first batches are slow).")  # fmt: skip
        # Once per fit (the first batches wait for the compiler, silently
        # otherwise); at an evaluation only if nothing was compiled before.
        if (opt is not None or not self._said) and ranks.is_main():
            print(f"fitlib: compiling {said}")
        self._said = True
        model.compile(**self.kwargs)
        self._made = model._compiled_call_impl

    def on_train_end(self) -> None:
        """Runs at the end, also after an error: the module is compiled as it
        was before (plain, unless its user or an enclosing fit compiled it),
        and the optimizer steps eagerly again."""
        if self._before:
            model, before = self._before.pop()
            # What nn.Module.compile set, put back: None runs forward again.
            model._compiled_call_impl = before
        if not self._before:  # (an evaluation inside the fit leaves the step)
            while self._steps:
                self._steps.pop().remove()
            while self._tensors:  # a later eager fit steps as before this one
                part, names = self._tensors.pop()
                if names:
                    part.hypers_as_floats(names)

    def _compile_step(self, opt: Any, callbacks: list) -> str | None:
        """Installs the compiled step on ``opt``'s torch optimizers, or says
        why the step stays eager (None: compiled)."""
        parts = list(opt.parts.values()) if isinstance(opt, MultiOptimizer) else [opt]
        parts = [p for p in parts if isinstance(p, HPOptimizer)]
        before = [held(p) for p in parts]
        reason = _unsafe_callback(callbacks) or _fused(opt) or _tensor_hypers(opt)
        # (also where a part refused: the parts before it were converted)
        self._tensors = [(p, tuple(n for n in held(p) if n not in was))
                         for p, was in zip(parts, before)]  # fmt: skip
        if reason is None:
            kwargs = {k: v for k, v in self.kwargs.items()
                      if k in ("backend", "mode", "options")}  # fmt: skip
            self._steps = [_CompiledStep(o, kwargs) for o in torch_optimizers(opt)]
        return reason

    def __repr__(self) -> str:
        given = {"step": True, **self.kwargs} if self.step else self.kwargs
        args = ", ".join(f"{k}={v!r}" for k, v in given.items())
        return f"{self.name}({args})"


class _CompiledStep:
    """A torch optimizer's ``step``, compiled, set on the optimizer object
    (an attribute of the instance over its class's method) until ``remove``.
    The loop's ``opt.step()`` and a ``GradScaler``'s ``scaler.step(opt)``
    (with a fused optimizer's ``grad_scale``/``found_inf``) call it; a step
    with a closure runs eagerly (the closure runs the model)."""

    # A torch LRScheduler made on this optimizer (TorchScheduler's) wraps
    # ``opt.step`` to note that it was called, unless it says it already
    # does: this one does, for a bound method's ``__func__`` it lacks.
    _wrapped_by_lr_sched = True

    def __init__(self, opt: torch.optim.Optimizer, kwargs: dict) -> None:
        self.opt = opt
        self.before = opt.__dict__.get("step")  # e.g. an LRScheduler's wrapper
        self.eager = opt.step
        self.compiled = torch.compile(self.eager, **kwargs)
        self.on = True
        opt.step = self

    def __call__(self, closure: Any = None, **kwargs: Any) -> Any:
        self.opt._opt_called = True  # what torch's LRScheduler checks
        if closure is not None or not self.on:
            return self.eager(closure, **kwargs)
        return self.compiled(**kwargs)

    def remove(self) -> None:
        """The optimizer's own step again (where something wrapped this one
        since, this one runs eagerly inside it)."""
        self.on = False
        if self.opt.__dict__.get("step") is self:
            if self.before is None:
                del self.opt.step
            else:
                self.opt.step = self.before


def _overrides(cb: Callback, hook: str) -> bool:
    return getattr(type(cb), hook, None) is not getattr(Callback, hook)


def _unsafe_callback(callbacks: list) -> str | None:
    """Why a callback keeps the step eager: the first one that overrides a
    hook inside the step without declaring ``compiled_step_safe = True``."""
    for cb in callbacks:
        hooks = [h for h in STEP_HOOKS if _overrides(cb, h)]
        if hooks and getattr(cb, "compiled_step_safe", None) is not True:
            return (
                f"{cb.name} runs inside the step ({', '.join(hooks)}) and does not "
                f"declare compiled_step_safe = True. Fix: set it on {cb.name} if its "
                "hooks read nothing on the host and replace none of the optimizer's "
                "values, or leave it out"
            )
    return None


def _fused(opt: Any) -> str | None:
    """Why a fused optimizer keeps its step: torch.compile does not trace it."""
    for o in torch_optimizers(opt):
        if any(group.get("fused") for group in o.param_groups):
            return (
                f"{type(o).__name__}(fused=True) steps in fused kernels already, "
                "which torch.compile leaves as they are (Learner.to_fp16() makes "
                "the optimizer fused: its loss scaler then reads nothing on the "
                "host). Fix: an optimizer made without fused=True, or no step=True"
            )
    return None


def _tensor_hypers(opt: Any) -> str | None:
    """Why ``opt``'s hyper-parameters would recompile the step (None: they
    will not): turned into 0-d tensors where the optimizer can take them."""
    as_tensors = getattr(opt, "hypers_as_tensors", None)
    if as_tensors is not None:
        try:
            as_tensors()
        except ValueError as e:
            return str(e).rstrip(".")
        return None
    if torch._dynamo.config.specialize_float:
        return (
            f"{type(opt).__name__} holds its hyper-parameters as floats, and this "
            f"torch ({torch.__version__}) compiles the step again at each change "
            "of one (a schedule's, every step). Fix: a newer torch, or no step=True"
        )
    return None


# torch.compile's arguments that take a bool, or None too.
_FLAGS = {"fullgraph": False, "disable": False, "isolate_recompiles": False,
          "dynamic": True}  # fmt: skip
# Others: (the types taken, their words, an example).
_TYPED = {
    "backend": ((str,), "a backend's name (str) or a backend function", "'aot_eager'"),
    "mode": ((str, type(None)), "a str or None", "'max-autotune'"),
    "options": ((dict, type(None)), "a dict or None", "{'max_autotune': True}"),
    "name": ((str, type(None)), "a str or None", "'encoder'"),
}


def _check_types(kwargs: dict) -> None:
    """Refuses an argument of torch.compile of the wrong type (before it is
    used: a truthy 'no' would be taken as True)."""
    for name, value in kwargs.items():
        if name in _FLAGS:
            none = _FLAGS[name]
            if not (isinstance(value, bool) or (none and value is None)):
                _refuse(name, "True, False or None" if none else "True or False",
                        value, "True")  # fmt: skip
        elif name in _TYPED:
            types, words, example = _TYPED[name]
            ok = isinstance(value, types) or (name == "backend" and callable(value))
            if not ok:
                _refuse(name, words, value, example)
        elif name == "recompile_limit":
            check_int(value, name, minimum=1, owner="Compile", example=16,
                      allow_none=True)  # fmt: skip


def _refuse(name: str, words: str, value: Any, example: str) -> None:
    raise ArgTypeError(
        f"Compile: {name} must be {words}; got {value!r} ({type(value).__name__})."
        f" Fix: e.g. Compile({name}={example}) (torch.compile's argument)."
    )


def _check_mode_and_options(kwargs: dict) -> None:
    """Lets torch.compile judge ``mode`` and ``options`` now (it knows its
    modes and inductor's options) rather than when the fit starts."""
    if kwargs.get("mode") is None and kwargs.get("options") is None:
        return  # (nothing to judge; inductor is not imported for nothing)
    if kwargs.get("mode") is not None and kwargs.get("options") is not None:
        raise ValueError(
            f"Compile: pass mode or options, not both (torch.compile takes one); "
            f"got mode={kwargs['mode']!r} and options={kwargs['options']!r}. Fix: "
            "e.g. Compile(mode='max-autotune'), or the options alone."
        )
    try:
        torch.compile(_identity, **kwargs)  # compiles nothing until called
    except (RuntimeError, ValueError) as e:
        given = ", ".join(f"{k}={kwargs[k]!r}" for k in ("mode", "options")
                          if kwargs.get(k) is not None)  # fmt: skip
        said = str(e) if len(str(e)) < 240 else f"{str(e)[:200]}..."
        raise ValueError(
            f"Compile: torch.compile refused {given}: {said.rstrip('.')}. Fix: a "
            "mode or options this torch knows (torch._inductor.list_mode_options()"
            ", list_options()), e.g. Compile(mode='max-autotune')."
        ) from None


def _identity(x: Any) -> Any:
    return x
