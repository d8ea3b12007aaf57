"""``Compile``: trains through ``torch.compile``, the module kept as it is."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fitlib.callback import Callback


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
    When the fit ends the module is plain again: ``get_preds``, ``predict``
    and ``validate`` outside ``fit``, and the LR finder's sweep (which leaves
    ``Compile`` out), run eagerly, so odd batch sizes there compile nothing.
    The fit's own validation runs compiled (a second graph, for eval mode).

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

    Example:
        >>> learn.compile(mode="max-autotune")   # adds Compile to every fit
        >>> fit(3, model, F.cross_entropy, opt, data, callbacks=[Compile()])
    """

    order = -190  # after DistributedTrainer (-200), which may wrap the model
    in_lr_find = False  # a short sweep: compiling would take longer than it

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
        backend = kwargs.get("backend", "inductor")
        known = torch.compiler.list_backends(exclude_tags=())
        if isinstance(backend, str) and backend not in known:
            raise ValueError(
                f"Compile: backend={backend!r} is not a torch.compile backend; "
                f"this torch has {', '.join(sorted(known))}. Fix: e.g. "
                "backend='inductor' (the default) or 'aot_eager'."
            )
        self.kwargs = kwargs
        self._compiled: nn.Module | None = None

    def on_train_begin(self, model: nn.Module) -> None:
        """Runs before training: compiles the model in place (inside DDP)."""
        if isinstance(model, DistributedDataParallel):
            model = model.module  # DDP's forward calls it: compiled from there
        model.compile(**self.kwargs)
        self._compiled = model

    def on_train_end(self) -> None:
        """Runs at the end, also after an error: the module is plain again."""
        if self._compiled is not None:
            # What nn.Module.compile set, undone: __call__ runs forward again.
            self._compiled._compiled_call_impl = None
            self._compiled = None

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.name}({args})"
