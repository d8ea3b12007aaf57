"""``Compile``: trains through ``torch.compile``, the module kept as it is."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fitlib.ranks as ranks
from fitlib.callback import Callback
from fitlib.checks import check_int
from fitlib.errors import ArgTypeError


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

    Args:
        **kwargs: ``torch.compile``'s own (``mode``, ``backend``, ``dynamic``,
            ``fullgraph``, ``options``).

    Examples:
        >>> learn.compile(mode="max-autotune")  # adds Compile to every fit
        Learner(Sequential, loss_func=cross_entropy, opt_func=AdamW, ...)
        >>> learn.callbacks
        [Compile(mode='max-autotune')]

        With ``fit``: ``fit(3, model, F.cross_entropy, opt, data,
        callbacks=[Compile()])``. The first batches of a fit wait for the
        compiler (seconds on a CPU, minutes for a large model with
        ``mode="max-autotune"``); this example does not train for that reason.
    """

    order = -190  # after DistributedTrainer (-200), which may wrap the model
    in_lr_find = False  # a short sweep: compiling would take longer than it
    in_evaluation = True  # validate, get_preds, predict: compiled too

    def __init__(self, **kwargs: Any) -> None:
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

    def on_train_begin(self, model: nn.Module, opt: Any) -> None:
        """Runs before training (and before a Learner's evaluation, without
        ``opt``): compiles the model in place (inside DDP), remembering how it
        was compiled before (a user's own ``model.compile``, or the fit's)."""
        if isinstance(model, DistributedDataParallel):
            model = model.module  # DDP's forward calls it: compiled from there
        before = getattr(model, "_compiled_call_impl", None)
        self._before.append((model, before))
        if before is not None and before is self._made:
            return  # an evaluation inside this fit: already compiled by it
        # Once per fit (the first batches wait for the compiler, silently
        # otherwise); at an evaluation only if nothing was compiled before.
        if (opt is not None or not self._said) and ranks.is_main():
            print("fitlib: compiling the model (the first batches are slow).")
        self._said = True
        model.compile(**self.kwargs)
        self._made = model._compiled_call_impl

    def on_train_end(self) -> None:
        """Runs at the end, also after an error: the module is compiled as it
        was before (plain, unless its user or an enclosing fit compiled it)."""
        if self._before:
            model, before = self._before.pop()
            # What nn.Module.compile set, put back: None runs forward again.
            model._compiled_call_impl = before

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.name}({args})"


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
