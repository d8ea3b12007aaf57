"""``ActivationCheckpointing``: recomputes chosen submodules in the backward
pass instead of keeping their activations."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from fitlib.callback import Callback
from fitlib.checks import check_flag
from fitlib.errors import ArgTypeError, did_you_mean
from fitlib.sharding import unwrap

Selection = str | type | list | tuple | Callable[[str, nn.Module], bool]


class ActivationCheckpointing(Callback):
    """Trades compute for memory: the chosen submodules keep only their inputs
    for the backward pass, and run their forward again there.

    Each chosen submodule's forward runs inside
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` while
    gradients are on (training batches): the activations inside it are freed
    after the forward and recomputed during the backward, so the peak memory
    of a step falls by about what those activations took, for one more
    forward of those submodules (an MLP of 4 blocks, all checkpointed, on a
    CPU: a third of the peak, 1.6x the time of a step;
    ``benchmarks/resize_and_checkpointing.py``). The random generators'
    state is kept and put back for the recomputation
    (``preserve_rng_state``), so dropout draws the same masks: the
    gradients, and a whole fit, equal the plain model's (tested, bit for bit
    on a CPU). Validation, under ``no_grad``, runs the plain forward.

    A BatchNorm layer inside a chosen submodule updates its running
    statistics at each training forward, and the recomputation is one more:
    its buffers (``running_mean``, ``running_var``,
    ``num_batches_tracked``) are kept as the recomputation begins and put
    back after it, so they move once per step, as the plain model's (tested,
    the whole ``state_dict`` bit for bit on a CPU, and under ``Compile``,
    whose graph updates them once). One case is left: compiled, a chosen
    submodule whose forward breaks the graph (a BatchNorm with
    ``momentum=None`` does, reading ``num_batches_tracked``) runs its
    checkpoint outside the graph, where the statistics move twice; choose
    the submodules around it. Other buffers a forward updates in place move
    twice as well.

    The forwards are wrapped as training begins (before ``DistributedTrainer``
    wraps the model and ``Compile`` compiles it) and put back when it ends,
    also after an error. Nothing is added to the model: no wrapper module,
    so its ``state_dict`` keys, ``Checkpoint`` files and ``Learner.save``
    are unchanged, during the fit as after it. A submodule inside another
    chosen one is left to the outer one (checkpointing both would recompute
    the inner twice).

    Args:
        modules: which submodules: their names as ``model.named_modules()``
            gives them (``"layer1"``, ``"blocks.0"``; an unknown one is
            refused, with the names it is close to), one or several module
            types (``nn.TransformerEncoderLayer``: every submodule of the
            type), or a function ``(name, module) -> bool``.
        preserve_rng_state: put the random generators' state back for the
            recomputation (True); False is faster, where nothing inside
            draws (no dropout), and otherwise changes the gradients.

    Examples:
        >>> blocks = nn.Sequential(
        ...     nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 8)),
        ...     nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 3)))
        >>> sgd = HPOptimizer(blocks.parameters(), torch.optim.SGD, lr=0.1)
        >>> ac = ActivationCheckpointing(["0", "1"])  # by name
        >>> fit(1, blocks, F.cross_entropy, sgd, data, callbacks=[ac])
        History(1 epoch: train_loss ..., valid_loss ...)
        >>> ac.chosen(blocks)
        ['0', '1']
        >>> ActivationCheckpointing(nn.Linear).chosen(blocks)  # by type
        ['0.0', '0.2', '1.0', '1.2']
        >>> ac = ActivationCheckpointing(["0", "2"])
        >>> fit(1, blocks, F.cross_entropy, sgd, data, callbacks=[ac])
        Traceback (most recent call last):
        ...
        ValueError: ActivationCheckpointing: unknown submodule '2'; the model's
        top-level submodules are '0', '1'. Fix: name submodules as
        model.named_modules() gives them (e.g. 'layer1' or 'layer1.0').
        fitlib: raised in callback ActivationCheckpointing.on_train_begin
    """

    # Before DistributedTrainer (-200) and Compile (-190): the plain model's
    # names, and the wrapped forwards are what they wrap and compile.
    order = -205

    def __init__(self, modules: Selection, preserve_rng_state: bool = True) -> None:
        self.modules = _check_selection(modules)
        self.preserve_rng_state = check_flag(
            preserve_rng_state, "preserve_rng_state", owner=_OWNER
        )
        self._wrapped: list[tuple[nn.Module, Any]] = []  # (module, forward before)

    def chosen(self, model: nn.Module) -> list[str]:
        """The names of the submodules of ``model`` this callback wraps (a
        ValueError for a name ``model`` lacks, or a choice of none)."""
        named = {n: m for n, m in unwrap(model).named_modules() if n}  # not the root
        if not callable(self.modules):
            for name in self.modules:
                if isinstance(name, str) and name not in named:
                    _refuse_unknown(name, named)
        names = [n for n, m in named.items() if self._matches(n, m)]
        if not names:
            raise ValueError(
                f"{_OWNER}: modules={_shown(self.modules)} matched no submodule of "
                f"{type(unwrap(model)).__name__}, so nothing would be recomputed. "
                "Fix: name them as model.named_modules() gives them, e.g. "
                "ActivationCheckpointing(['layer1', 'layer2'])."
            )
        return [n for n in names if not any(_inside(n, o) for o in names)]

    def on_train_begin(self, model: nn.Module) -> None:
        """Runs before training: the chosen submodules' forwards wrapped."""
        self._unwrap()  # (a fit ended without on_train_end: never twice)
        named = dict(unwrap(model).named_modules())
        for name in self.chosen(model):
            module = named[name]
            before = module.__dict__.get("forward")
            module.forward = _Checkpointed(module, self.preserve_rng_state)
            self._wrapped.append((module, before))

    def on_train_end(self) -> None:
        """Runs at the end, also after an error: the forwards put back."""
        self._unwrap()

    def _unwrap(self) -> None:
        while self._wrapped:
            module, before = self._wrapped.pop()
            if before is None:
                del module.forward
            else:
                module.forward = before

    def _matches(self, name: str, module: nn.Module) -> bool:
        if callable(self.modules):
            return bool(self.modules(name, module))
        return any(name == m if isinstance(m, str) else isinstance(module, m)
                   for m in self.modules)  # fmt: skip

    def __repr__(self) -> str:
        rng = "" if self.preserve_rng_state else ", preserve_rng_state=False"
        return f"{self.name}(modules={_shown(self.modules)}{rng})"


_OWNER = "ActivationCheckpointing"


class _Checkpointed:
    """A module's forward, run under ``checkpoint`` while gradients are on;
    the recomputation leaves the BatchNorm layers' buffers as it found them."""

    def __init__(self, module: nn.Module, preserve_rng_state: bool) -> None:
        self.forward = module.forward
        self.preserve_rng_state = preserve_rng_state
        self.norms = [m for m in module.modules() if isinstance(m, _BatchNorm)]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # validation: nothing to keep anyway
            return self.forward(*args, **kwargs)
        if self.norms and not torch.compiler.is_compiling():
            # (compiled, the graph updates the buffers once, in the forward;
            # and torch.compile traces only checkpoint's default contexts)
            kwargs["context_fn"] = self._contexts
        return checkpoint(self.forward, *args, use_reentrant=False,
                          preserve_rng_state=self.preserve_rng_state,
                          **kwargs)  # fmt: skip

    def _contexts(self) -> tuple[Any, Any]:
        """The forward's context (none) and the recomputation's."""
        return contextlib.nullcontext(), _buffers_kept(self.norms)


@contextlib.contextmanager
def _buffers_kept(modules: list[nn.Module]) -> Iterator[None]:
    """Puts the buffers of ``modules`` back as they were on entry: a
    BatchNorm in training mode updates its running statistics and
    ``num_batches_tracked`` at each forward, and the recomputation must not
    update them a second time."""
    kept = [(b, b.clone()) for m in modules if m.training
            for b in m.buffers(recurse=False)]  # fmt: skip
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in kept:
                buffer.copy_(value)


def _inside(name: str, outer: str) -> bool:
    """Whether submodule ``name`` is inside submodule ``outer``."""
    return name.startswith(f"{outer}.")


def _refuse_unknown(name: str, named: dict) -> None:
    """A ValueError for a submodule name the model lacks: the close one, and
    the model's top-level submodules (all its names may be hundreds)."""
    top = [n for n in named if n and "." not in n]
    shown = ", ".join(map(repr, top[:12])) + (", ..." if len(top) > 12 else "")
    raise ValueError(
        f"{_OWNER}: unknown submodule {name!r}{did_you_mean(name, named)}; the "
        f"model's top-level submodules are {shown or 'none'}. Fix: name "
        "submodules as model.named_modules() gives them (e.g. 'layer1' or "
        "'layer1.0')."
    )


def _check_selection(modules: Any) -> Any:
    """``modules`` as a list of names and module types, or a function."""
    if isinstance(modules, (str, type)):
        modules = [modules]
    if isinstance(modules, (list, tuple)):
        modules = list(modules)
        bad = [m for m in modules if not isinstance(m, str)
               and not (isinstance(m, type) and issubclass(m, nn.Module))]  # fmt: skip
        if modules and not bad:
            return modules
    elif callable(modules):
        return modules
    raise ArgTypeError(
        f"{_OWNER}: modules must be submodule names, nn.Module types, or a "
        f"function (name, module) -> bool; got {modules!r}. Fix: e.g. "
        "ActivationCheckpointing(['layer1', 'layer2']) or "
        "ActivationCheckpointing(nn.TransformerEncoderLayer)."
    )


def _shown(modules: Any) -> str:
    """``modules`` for messages: names quoted, types by their names."""
    if callable(modules):
        return getattr(modules, "__name__", repr(modules))
    shown = [repr(m) if isinstance(m, str) else m.__name__ for m in modules]
    return (
        shown[0]
        if len(shown) == 1 and isinstance(modules[0], type)
        else ("[" + ", ".join(shown) + "]")
    )
