"""The training loop: ``fit_states`` (the loop), ``fit``, ``loss_batch``,
``validate``, and the loss helpers they share. Data and devices
(``DataBunch``, ``batches``) are in ``fitlib.data``.

Skip the ``cb_handler`` lines and ``fit`` is the plain PyTorch loop. Every
other feature is a callback (see ``fitlib.callback``).
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from fitlib.callback import Callback
from fitlib.callback_handler import CallbackHandler
from fitlib.checks import (
    check_data,
    check_fit_args,
    check_loader,
    check_model,
    check_trainable,
)
from fitlib.data import batches, limit_batches, model_device
from fitlib.errors import ArgTypeError, describe, name_of, reraise
from fitlib.history import History
from fitlib.loss_checks import loss_check
from fitlib.losses import as_loss
from fitlib.metrics.collection import Metrics
from fitlib.model_errors import explain_model_error
from fitlib.multi_optimizer import MultiOptimizer, as_optimizer
from fitlib.optim import HPOptimizer
from fitlib.rng import get_rng_state, set_rng_state
from fitlib.running_loss import RunningLoss, batch_size, loss_count

LossFunc = Callable[..., torch.Tensor] | None  # None: the model computes it
# The first-batch checks of the loss, in training and in validation.
_LOSS_CHECKS = {False: ("loss", True), True: ("loss", False)}


def fit(
    epochs: int | None,
    model: nn.Module,
    loss_func: LossFunc,
    opt: Any,
    data: Any,
    callbacks: Iterable[Callback] | None = None,
    metrics: list | None = None,
    max_steps: int | None = None,
    train_metrics: list | None = None,
    *,
    max_time: Any = None,
    train_batches: int | None = None,
    valid_batches: int | None = None,
    loss_weights: dict | list | None = None,
) -> History:
    """Trains ``model`` for ``epochs`` epochs, validating after each (or when
    a ``ValidationSchedule`` says).

    Returns the run's history, a ``History``: the list of the records of
    each epoch, and of each validation inside one (a dict: ``epoch``,
    ``train_loss``, ``valid_loss``, each metric by name, ``train_<metric>``,
    loss parts, values callbacks added, ``lr``, ``time``), as
    ``state["record"]`` held it at the epoch's end; its repr is one line,
    ``table()`` and ``plot()`` show every value.

    Args:
        epochs: number of epochs (a positive int), or None to train until
            ``max_steps``.
        model: the model; batches are moved to the device of its parameters.
        loss_func: called as ``loss_func(output, *targets)``; returns a scalar,
            or a dict with the scalar ``"loss"`` (what ``backward`` uses) and
            named scalar parts, each averaged over the epoch in the record
            (``train_<part>``, ``valid_<part>``, over the batches that have
            it; a loss whose parts vary by batch lists them all in its
            ``part_names``). None for a model that computes its own loss:
            ``output.loss`` or ``output["loss"]``. A dict output name ->
            loss (a list for a tuple output) is a ``LossDict``: each output's
            loss is a part of the record, their weighted sum the loss.
        opt: an ``HPOptimizer``, or a torch optimizer (wrapped in one); for
            several optimizers, a ``MultiOptimizer`` or a dict part name ->
            optimizer (made into one).
        data: an object with ``train_dl`` and optionally ``valid_dl``.
        callbacks: ``Callback`` instances, run in ``order``.
        metrics: computed over the validation set each epoch.
        max_steps: stop after this many optimizer steps (across epochs; the
            epoch in progress still validates), or None.
        train_metrics: computed over the training batches each epoch (in
            train mode, as the model trains), reported as ``train_<name>``.
        max_time: a wall-clock budget for this fit (seconds, a
            ``timedelta``, ``"DD:HH:MM:SS"`` or a dict of ``timedelta``'s
            arguments), or None: once spent, the fit is suspended after the
            batch in progress, resumable by a ``Checkpoint``, as a
            ``TimeLimit`` callback does (pass one or the other).
        train_batches: train on at most this many batches per epoch (the
            first of each epoch's order), or None for all; the fit's
            ``n_steps``, schedules, bar and checkpoints count the capped epoch.
        valid_batches: validate on at most this many batches, or None for all.
        loss_weights: with a dict (or list) of losses, a number >= 0 per
            output (default 1), Keras's ``loss_weights``.

    Examples:
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> train_ds = TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
        >>> valid_ds = TensorDataset(torch.randn(32, 8), torch.randint(0, 3, (32,)))
        >>> opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        >>> data = DataBunch(DataLoader(train_ds, 16), DataLoader(valid_ds, 32))
        >>> history = fit(3, model, F.cross_entropy, opt, data, metrics=[accuracy])
        >>> history
        History(3 epochs: train_loss ... -> ..., valid_loss ... -> ...,
                accuracy 0.2812 -> 0.2812)
        >>> history[-1]["accuracy"]  # random labels: chance
        0.28125
    """
    history = History()
    for _ in fit_states(
        epochs,
        model,
        loss_func,
        opt,
        data,
        callbacks,
        metrics,
        max_steps,
        train_metrics,
        history=history,
        max_time=max_time,
        train_batches=train_batches,
        valid_batches=valid_batches,
        loss_weights=loss_weights,
    ):
        pass
    return history


def fit_states(
    epochs: int | None,
    model: nn.Module,
    loss_func: LossFunc,
    opt: Any,
    data: Any,
    callbacks: Iterable[Callback] | None = None,
    metrics: list | None = None,
    max_steps: int | None = None,
    train_metrics: list | None = None,
    *,
    history: list | None = None,
    max_time: Any = None,
    train_batches: int | None = None,
    valid_batches: int | None = None,
    loss_weights: dict | list | None = None,
) -> Iterator[dict]:
    """The training loop, one batch at a time: ``fit`` drains it.

    Yields the loop's state (the dict of state keys) after each training
    batch (read it, do not keep it). Closing the generator ends training
    cleanly: ``on_train_end(None)`` runs. A ``break`` out of a ``for`` closes
    it when nothing else refers to it; if you keep it in a variable, call its
    ``close()`` (until then the Ctrl-C handler of the loop stays installed).
    Arguments as for ``fit``; ``history``, a list, receives each record as
    it is made (at each epoch's end, and at each validation inside one). A
    fit suspended (``max_time``) ends the iteration after the batch it
    yielded last.

    Examples:
        >>> for state in fit_states(None, model, F.cross_entropy, opt, data,
        ...                         max_steps=50):
        ...     if state["step"] % 10 == 0:
        ...         print(state["step"], state["epoch"])
        10 2
        20 4
        30 7
        40 9
        50 12
    """
    data = limit_batches(data, train_batches, valid_batches)  # (caps: len() says)
    loss_func = as_loss(loss_func, loss_weights)  # a dict of losses: a LossDict
    opt = _start(epochs, max_steps, model, loss_func, opt, data)
    metrics = as_metrics(metrics, "metrics")
    train_metrics = as_metrics(train_metrics, "train_metrics")
    state = dict(model=model, opt=opt, data=data, loss_func=loss_func, metrics=metrics)
    state["train_metrics"] = train_metrics
    cb_handler = CallbackHandler(callbacks, max_time=max_time)
    if history is not None:
        cb_handler.history = history
    exception = None
    try:
        with cb_handler.deferred_interrupt():
            cb_handler.on_train_begin(epochs, max_steps, **state)
            # Callbacks may wrap or swap the model (DistributedDataParallel),
            # the data, the optimizer, the loss: the loop reads them from the
            # state (validation runs cb_handler.eval_model, not a wrapper).
            state = cb_handler.state
            batch_fn = getattr(data, "batch_fn", None)  # (a callback may wrap data)
            prefetch = getattr(data, "prefetch", None)
            for _ in range(state["epoch"], epochs or sys.maxsize):
                state["model"].train()
                if cb_handler.on_epoch_begin():  # nothing (more) to train
                    break
                train_dl, device = state["data"].train_dl, model_device(state["model"])
                ended = False  # by a record inside the epoch
                for xb, yb in batches(train_dl, device, "train_dl", batch_fn, prefetch):
                    # A validation asked for at the last batch's end: it ends a
                    # record here, as more batches follow (else the epoch's).
                    if state["validate_now"]:
                        ended = _end_record(
                            cb_handler, batch_fn, prefetch, mid_epoch=True
                        )
                        if ended:
                            break
                    xb, yb = cb_handler.on_batch_begin(xb, yb)
                    # Read at each batch: a callback may have swapped them.
                    model, loss_func = state["model"], state["loss_func"]
                    opt = state["opt"]
                    loss = loss_batch(model, xb, yb, loss_func, opt, cb_handler)
                    stop = cb_handler.on_batch_end(loss)
                    yield state
                    if state["suspend"] and not (
                        state["skip_step"] or state["validate_now"] or stop
                    ):
                        return  # between two steps: to be resumed (a time limit)
                    if stop:
                        break
                if ended or _end_record(
                    cb_handler, batch_fn, prefetch, mid_epoch=False
                ):
                    break
    except GeneratorExit:  # the consumer stopped iterating: a clean end
        raise
    except BaseException as e:
        exception = e
        raise
    finally:
        try:
            cb_handler.on_train_end(exception)
        finally:
            cb_handler.state["opt"].reset_scales()  # the next fit's lr: as given


def _end_record(
    cb_handler: CallbackHandler, batch_fn: Any, prefetch: Any, mid_epoch: bool
) -> bool:
    """Validates (unless skipped), builds the record and runs ``on_epoch_end``;
    True when training must stop. ``mid_epoch``: a validation inside the epoch
    (``validate_now``), after which the epoch's training goes on."""
    state = cb_handler.state
    num_batch = state["num_batch"] if mid_epoch else None  # validation resets it
    model, loss_func, metrics = (
        cb_handler.eval_model,
        state["loss_func"],
        state["metrics"],
    )
    valid_dl = getattr(state["data"], "valid_dl", None)
    results = None  # [valid_loss, *metrics] when validation runs
    if valid_dl is not None and (state["validate_now"] or not state["skip_validate"]):
        # A loader draws a seed from torch's generator as it starts. The
        # epoch's own validation does, as in a hand-written loop; one inside
        # the epoch puts the generators back, or it would change the shuffles.
        rng = get_rng_state(valid_dl) if mid_epoch else None
        results = validate(
            model, valid_dl, loss_func, cb_handler, metrics, batch_fn, prefetch
        )
        if rng is not None:  # (a generator valid_dl shares with train_dl too)
            set_rng_state(rng, valid_dl)
    return cb_handler.on_epoch_end(results, num_batch)


def as_metrics(
    metrics: Any, name: str, owner: str = "fit", attribute: bool = False
) -> Metrics:
    """``metrics`` (a list, or None) as a ``Metrics``; anything else is
    refused naming the argument ``name`` of ``owner`` (``attribute``: set as
    ``learn.<name>``, the fix says so)."""
    if isinstance(metrics, Metrics):
        return metrics
    if metrics is not None and not isinstance(metrics, (list, tuple)):
        one = name_of(metrics) if callable(metrics) else None
        got = f"{one or repr(metrics)} ({type(metrics).__name__})"
        listed = f"[{one or 'accuracy'}]"
        fix = (
            f"learn.{name} = {listed}"
            if attribute
            else f"{owner}(..., {name}={listed})"
        )
        raise ArgTypeError(
            f"{owner}: {name} must be a list of metrics or None; got {got}. Fix: "
            f"e.g. {fix} (a list, even of one metric)."
        )
    return Metrics(metrics)


def iter_fit(*args: Any, **kwargs: Any) -> Iterator[dict]:
    """Deprecated: the former name of ``fit_states`` (same arguments)."""
    warnings.warn(
        "fitlib.iter_fit is deprecated: it is called fit_states now (it yields "
        "the loop's state after each training batch).",
        DeprecationWarning,
        stacklevel=2,
    )
    return fit_states(*args, **kwargs)


def _start(
    epochs: Any, max_steps: Any, model: Any, loss_func: Any, opt: Any, data: Any
) -> HPOptimizer | MultiOptimizer:
    """Checks a fit's arguments before training; returns the wrapped optimizer,
    ready for a first step of this fit."""
    check_fit_args(epochs, max_steps)
    check_model(model, loss_func)
    opt = as_optimizer(opt)  # so callbacks can always set opt.lr, opt.mom...
    check_trainable(model, opt)
    check_data(data, epochs)
    opt.stepped = None  # no step of this fit yet (the Recorder reads it)
    opt.reset_scales()  # reductions (ReduceLROnPlateau) of an earlier fit
    # Gradients left by an earlier fit that failed between backward() and
    # zero_grad() must not add to this fit's first step.
    opt.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    return opt


def loss_batch(
    model: nn.Module,
    xb: Any,
    yb: Any,
    loss_func: LossFunc,
    opt: Any = None,
    cb_handler: CallbackHandler | None = None,
) -> torch.Tensor:
    """Forward, loss and, when ``opt`` is given, backward, step and zero_grad.

    Returns ``loss_func``'s loss, detached (a device tensor: reading it is up
    to you); changes callbacks make to it in ``on_backward_begin`` only affect
    the backward pass.

    Examples:
        >>> xb, yb = next(iter(data.train_dl))
        >>> loss = loss_batch(model, xb, yb, F.cross_entropy, opt)  # one step
        >>> loss
        tensor(1.17...)
    """
    # fit and validate check the first batch's loss inputs (known only now); a
    # loop of the user's passes no handler, which could tell the first batch.
    first = cb_handler is not None and cb_handler.first_batch(_LOSS_CHECKS[opt is None])
    cb_handler = cb_handler or CallbackHandler()
    if opt is None:
        loss = train_step(model, xb, yb, loss_func, None, cb_handler, first)
    else:  # a callback may replay the step another way (step_fn: CudaGraph)
        step_fn = cb_handler.state["step_fn"] or train_step
        loss = step_fn(model, xb, yb, loss_func, opt, cb_handler, first)
        if not cb_handler.on_step_end():
            opt.zero_grad()
    return loss.detach() if loss.requires_grad else loss


def train_step(
    model: nn.Module,
    xb: Any,
    yb: Any,
    loss_func: LossFunc,
    opt: Any,
    cb_handler: CallbackHandler,
    first: bool = False,
) -> torch.Tensor:
    """One batch up to the optimizer's step: forward, ``on_loss_begin``, loss
    and, when ``opt`` is given, ``on_backward_begin``, backward,
    ``on_backward_end`` and ``opt.step()``. ``loss_batch`` runs it, then
    ``on_step_end`` and ``zero_grad``; a callback that sets the state key
    ``step_fn`` (``CudaGraph``) runs it its own way, calling this function
    (no second copy of the step). Returns ``loss_func``'s loss, not detached;
    ``first``: the fit's first batch, whose loss inputs are checked.

    Examples:
        >>> from fitlib.core import train_step
        >>> handler = CallbackHandler()
        >>> xb, yb = next(iter(data.train_dl))
        >>> loss = train_step(model, xb, yb, F.cross_entropy, opt, handler)
        >>> loss.requires_grad  # the step was taken; zero_grad is up to you
        True
    """
    out = cb_handler.on_loss_begin(call_model(model, xb))
    if first:
        with loss_check(loss_func, out, as_tuple(yb)):
            loss = _compute_loss(loss_func, out, yb, cb_handler)
        if opt is not None:  # probabilities read as logits: before any step
            for key in ("metrics", "train_metrics"):
                metrics = cb_handler.state.get(key)
                if isinstance(metrics, Metrics) and metrics:
                    metrics.check_probabilities(out, as_tuple(yb), loss_func)
    else:
        loss = _compute_loss(loss_func, out, yb, cb_handler)
    if opt is not None:
        # A callback may change the loss for backward only (loss scaling,
        # accumulation): the loss returned and recorded stays loss_func's.
        bwd_loss, skip_bwd = cb_handler.on_backward_begin(loss)
        if not skip_bwd:
            bwd_loss.backward()
        if not cb_handler.on_backward_end():
            opt.step()
    return loss


def validate(
    model: nn.Module,
    dl: Iterable,
    loss_func: LossFunc,
    cb_handler: CallbackHandler | None = None,
    metrics: list | Metrics | None = None,
    batch_fn: Callable[[Any], Any] | None = None,
    prefetch: bool | None = None,
) -> list[torch.Tensor]:
    """Returns ``[valid_loss, *metrics]`` over ``dl`` as device tensors.

    ``batch_fn`` turns each batch of ``dl`` into ``(x, y)``, as
    ``DataBunch(batch_fn=...)`` does in ``fit``, and ``prefetch`` as
    ``DataBunch(prefetch=...)``.

    The loss is averaged over what it averages over (``running_loss.loss_count``):
    the tokens a masked token loss keeps, else the samples (weighted by batch
    size), so a ragged last batch counts exactly and the result is the whole
    set's mean; metrics are accumulated on the device. When
    ``metrics.reducer`` is set (distributed training, ``dl`` one process's
    shard), the loss sum, count and metric states are summed over the
    processes first, so every process gets the values of the whole set.

    Examples:
        >>> valid_loss, acc = validate(model, data.valid_dl, F.cross_entropy,
        ...                            metrics=[accuracy])
        >>> valid_loss, acc
        (tensor(1.17..., dtype=torch.float64), tensor(0.2188, dtype=torch.float64))
    """
    check_loader(dl, "dl")
    metrics = metrics if isinstance(metrics, Metrics) else Metrics(metrics)
    cb_handler = cb_handler or CallbackHandler()
    device = model_device(model)
    metrics.reset()
    if cb_handler.count is None:  # validate alone: the loss parts count alike
        cb_handler.count = loss_count(loss_func)
    count = cb_handler.count or None
    losses = RunningLoss()  # summed once at the end: cheaper than per batch
    with evaluating(model):
        for xb, yb in batches(dl, device, "valid_dl", batch_fn, prefetch):
            xb, yb = cb_handler.on_batch_begin(xb, yb, train=False)
            loss = loss_batch(model, xb, yb, loss_func, None, cb_handler)
            size = None if count is None else count(cb_handler.state["last_output"], yb)
            losses.add(loss, batch_size(yb, xb) if size is None else size)
            if metrics:
                out = cb_handler.state["last_output"]
                if cb_handler.first_batch("metrics"):
                    metrics.check(out, as_tuple(yb), loss_func)
                metrics.update(out, as_tuple(yb))
            if cb_handler.on_batch_end(loss):
                break
    pending = losses.pending()
    if not pending:
        raise ValueError(
            f"dl gave no batch to validate on: {describe(dl)}. Fix: a loader "
            "with at least one batch (drop_last=True drops a short last one)."
        )
    loss_sum, n = losses.sum_and_count(pending[0])
    if metrics.reducer is not None:  # one collective for loss, count, metrics
        loss_sum, n = metrics.reduce([loss_sum, n])
    return [loss_sum / n, *metrics.compute()]


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Runs the block in eval mode without gradients, then puts back every
    module's train/eval mode (and the grad mode), also after an error.

    Examples:
        >>> from fitlib.core import evaluating
        >>> with evaluating(model):
        ...     out = model(torch.randn(2, 8))
        >>> out.requires_grad, model.training
        (False, True)
    """
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training


def weighted_mean(values: list[float], weights: list[int]) -> float:
    """The mean of ``values`` weighted by ``weights`` (NaN when they sum to 0)."""
    total = sum(weights)
    if not total:
        return math.nan
    return sum(v * w for v, w in zip(values, weights, strict=True)) / total


# -- one batch -----------------------------------------------------------------
def as_tuple(x: Any) -> tuple:
    """``x`` as a tuple: a tuple or list as is, anything else wrapped."""
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def call_model(model: nn.Module, xb: Any) -> Any:
    """``model(**xb)`` for a dict, ``model(*xb)`` for a tuple, else ``model(xb)``."""
    try:
        if isinstance(xb, dict):
            return model(**xb)
        return model(*xb) if isinstance(xb, (tuple, list)) else model(xb)
    except Exception as e:
        explain_model_error(e, model, xb)


def _compute_loss(
    loss_func: LossFunc, out: Any, yb: Any, cb_handler: CallbackHandler
) -> torch.Tensor:
    if loss_func is None:  # the model computed its loss
        return model_loss(out)
    try:
        # as_tuple, inline for the common case (this runs per step)
        loss = (
            loss_func(out, yb)
            if type(yb) is torch.Tensor
            else loss_func(out, *as_tuple(yb))
        )
    except Exception as e:
        reraise(e, _loss_mismatch(loss_func, out, yb), as_type=ValueError)
    if isinstance(loss, dict):  # the total and its named parts
        loss, cb_handler.state["last_loss_parts"] = _loss_parts(loss_func, loss)
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        fix = (
            "return one total, e.g. the sum of the parts (loss_a + loss_b), or "
            'a dict {"loss": total, "a": loss_a, "b": loss_b} to see the parts'
            if isinstance(loss, (tuple, list))
            else "reduce the loss, e.g. reduction='mean', or return loss.mean()"
        )
        raise ValueError(
            f"loss_func {name_of(loss_func)} returned {describe(loss)}; fitlib "
            f"needs a scalar (0-dim) tensor to call backward(). Fix: {fix}."
        )
    return loss


def _loss_parts(loss_func: LossFunc, out: dict) -> tuple[Any, dict]:
    """A loss's ``"loss"`` and its other entries, the parts, detached."""
    if "loss" not in out:
        raise ValueError(
            f"loss_func {name_of(loss_func)} returned a dict with the keys "
            f"{list(out)} but no 'loss'; fitlib calls backward() on "
            "out['loss'] and reports the other entries as parts of it. Fix: "
            'return {"loss": total, **parts}, e.g. {"loss": ce + box, "ce": '
            'ce, "box": box}.'
        )
    parts = {}
    for name, value in out.items():
        if name == "loss":
            continue
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise ValueError(
                f"loss_func {name_of(loss_func)} returned the part {name!r} = "
                f"{describe(value)}; each part must be a tensor of one value "
                "(averaged over the epoch on the device). Fix: return the "
                "tensor, reduced, e.g. part.mean()."
            )
        parts[str(name)] = value.detach().reshape(())
    return out["loss"], parts


def model_loss(out: Any) -> torch.Tensor:
    """The loss a model computed itself: ``out.loss`` or ``out["loss"]`` (what
    ``loss_func=None`` trains on)."""
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if isinstance(loss, torch.Tensor) and loss.ndim == 0:
        return loss
    found = (
        f"its loss is {describe(loss)}"
        if loss is not None
        else f"it returned {describe(out)}, with no loss"
    )
    raise ValueError(
        f"loss_func=None trains on the loss the model computes (output.loss or "
        f'output["loss"], a scalar), but {found}. Fix: put the targets in the '
        "batch where the model computes its loss from them (a 'labels' key for "
        "transformers' models), or pass a loss_func."
    )


def _loss_mismatch(loss_func: LossFunc, out: Any, yb: Any) -> str:
    return (
        f"loss_func {name_of(loss_func)} failed. fitlib called loss_func(output, "
        f"*targets) with output {describe(out)} and targets "
        f"{describe(as_tuple(yb))}. If those do not fit what the loss expects, "
        "fix the model's output (e.g. one column per class for cross_entropy, "
        "the target's shape for mse_loss) or pass a matching loss_func."
        + (
            " The batch has no targets (inputs only: (x,), a tensor, or a dict "
            "without 'labels'): if it should, make the dataset (or batch_fn) "
            "return (x, y)."
            if as_tuple(yb) == ()
            else ""
        )
    )
