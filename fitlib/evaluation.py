"""A Learner's evaluation: ``validate``, ``get_preds`` and ``predict``.

The ``Learner`` methods of those names call these functions with the Learner;
each runs as a fit's validation does, through the one inference loop
(``core.validate``) and the Learner's callbacks that shape the forward pass
(``Callback.in_evaluation``), and puts back every state it found.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from fitlib.callback import Callback, inner_callback
from fitlib.callback_handler import CallbackHandler
from fitlib.core import as_tuple, validate
from fitlib.data import to_device
from fitlib.metrics.collection import Metrics
from fitlib.rng import get_rng_state, set_rng_state
from fitlib.running_loss import first_tensor
from fitlib.structure import join, map_tensors


def validation_values(learn: Any, dl: Iterable | None = None) -> dict[str, float]:
    """``Learner.validate``: loss, metrics and loss parts over ``dl``.

    Examples:
        >>> from fitlib.evaluation import validation_values
        >>> sorted(validation_values(learn))
        ['accuracy', 'valid_loss']
    """
    metrics = learn._metrics("metrics")
    values, handler = evaluate(
        learn, valid_loader(learn, dl), learn.loss_func, metrics,
        batch_fn=getattr(learn.data, "batch_fn", None),
    )  # fmt: skip
    record = handler.tally.record(0, values, metrics.names, math.nan)
    names = ["valid_loss", *metrics.names]
    names += [f"valid_{p}" for p in handler.tally.part_names]
    return {k: record[k] for k in names}


def predictions(
    learn: Any, dl: Iterable | None = None, activation: Callable | None = None
) -> tuple[Any, Any]:
    """``Learner.get_preds``: outputs and targets over ``dl``, on the CPU."""
    collect = _Collect()  # validate is the one inference loop
    evaluate(learn, valid_loader(learn, dl), _no_loss, collect=collect,
             batch_fn=getattr(learn.data, "batch_fn", None))  # fmt: skip
    preds = _float32(join(collect.outputs))
    preds = activation(preds) if activation is not None else preds
    targets = join(collect.targets) if collect.targets else None
    cpu = torch.device("cpu")
    return to_device(preds, cpu), to_device(targets, cpu)


def prediction(learn: Any, x: Any, activation: Callable | None = None) -> Any:
    """``Learner.predict``: the output for one item or a batch, on the CPU."""
    single = _is_single_item(x, learn.data)
    xb = map_tensors(lambda t: t.unsqueeze(0), x) if single else x
    collect = _Collect()
    # One batch of inputs only, (xb,): batch_fn is for the loaders' batches.
    evaluate(learn, [(xb,)], _no_loss, collect=collect)
    out = _float32(collect.outputs[0])
    out = activation(out) if activation is not None else out
    if single:
        out = map_tensors(lambda t: t[0] if t.ndim else t, out)
    return to_device(out, torch.device("cpu"))


def evaluate(
    learn: Any,
    dl: Iterable,
    loss_func: Any,
    metrics: Metrics | None = None,
    collect: Callback | None = None,
    batch_fn: Callable[[Any], Any] | None = None,
) -> tuple[list[torch.Tensor], CallbackHandler]:
    """``core.validate`` over ``dl`` as a fit's validation runs it: the
    Learner's callbacks that shape the forward pass (``in_evaluation``:
    ``MixedPrecision``, ``ChannelsLast``, ``Compile``) set up as a fit
    starts (``opt=None``), run on each batch, and clean up after, also
    after an error. The random generators are put back after it (a
    loader draws a seed), as after a validation inside an epoch: an
    evaluation inside a fit changes neither its order nor its weights."""
    rng = get_rng_state(dl)
    try:
        return _evaluate_once(learn, dl, loss_func, metrics, collect, batch_fn)
    finally:
        set_rng_state(rng, dl)


def _evaluate_once(
    learn: Any,
    dl: Iterable,
    loss_func: Any,
    metrics: Metrics | None,
    collect: Callback | None,
    batch_fn: Callable[[Any], Any] | None,
) -> tuple[list[torch.Tensor], CallbackHandler]:
    settings = [cb for cb in learn.callbacks if _in_evaluation(cb)]
    handler = CallbackHandler([*settings, *([collect] if collect else [])])
    handler.on_train_begin(None, model=learn.model, opt=None, data=learn.data,
                           loss_func=loss_func, metrics=metrics)  # fmt: skip
    exception = None
    try:
        prefetch = getattr(learn.data, "prefetch", None)  # DataBunch(prefetch=)
        values = validate(learn.model, dl, loss_func, handler, metrics, batch_fn,
                          prefetch)  # fmt: skip
    except BaseException as e:
        exception = e
        raise
    finally:
        handler.on_train_end(exception)
    return values, handler


def valid_loader(learn: Any, dl: Iterable | None) -> Iterable:
    """``dl``, or the Learner's validation set when None (an error if it has
    none)."""
    dl = learn.data.valid_dl if dl is None else dl
    if dl is None:
        raise ValueError(
            "there is no validation set (data.valid_dl is None). Fix: pass "
            "a loader, e.g. learn.validate(dl=some_loader)."
        )
    return dl


def _in_evaluation(cb: Callback) -> bool:
    """Whether ``cb`` (or the callback a filter wraps) shapes evaluation."""
    return getattr(inner_callback(cb), "in_evaluation", False)


def _is_single_item(x: Any, data: Any) -> bool:
    """Whether ``x`` lacks the batch dimension, judged from a dataset item."""
    dl = data.valid_dl if getattr(data, "valid_dl", None) is not None else data.train_dl
    first = first_tensor(x)
    try:
        item, batched = dl.dataset[0], 0
    except (AttributeError, TypeError, IndexError, KeyError, NotImplementedError):
        if not isinstance(dl, (list, tuple)) or not dl:
            return False  # nothing to compare with without drawing: a batch
        item, batched = dl[0], 1  # a list of batches: one has a batch dim
    # An (x, y) pair's inputs, or inputs only: a tensor, (x,), a dict of inputs.
    if isinstance(item, (tuple, list)) and len(item) in (1, 2):
        item = item[0]
    item = first_tensor(item)
    return first is not None and item is not None and first.ndim == item.ndim - batched


class _Collect(Callback):
    """Keeps each batch's output and targets, on the device."""

    def __init__(self) -> None:
        self.outputs: list[Any] = []
        self.targets: list[torch.Tensor] = []

    def on_batch_end(self, last_output: Any, last_target: Any) -> None:
        self.outputs.append(last_output)
        targets = as_tuple(last_target)
        if targets:  # batches of inputs only have none
            self.targets.append(targets[0] if len(targets) == 1 else targets)


def _float32(out: Any) -> Any:
    """``out`` with its half-precision tensors (autocast's) in float32."""
    half = (torch.float16, torch.bfloat16)
    return map_tensors(lambda t: t.float() if t.dtype in half else t, out)


def _no_loss(out: Any, *targets: Any) -> torch.Tensor:
    """``get_preds`` needs no loss (and a test set may have no targets)."""
    t = first_tensor(out)
    return torch.zeros((), device=None if t is None else t.device)
