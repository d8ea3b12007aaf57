"""Callbacks and the handler that runs them between the lines of the loop.

The handler keeps one state dict and passes it to every hook as keyword
arguments: a hook with ``**kwargs`` receives every key, a hook without receives
only the keys it names. A hook changes training by returning a dict of updates;
later callbacks of the same event see them.

State keys (the only keys a hook may return):

==================  ==========================================================
key                 meaning
==================  ==========================================================
model               the ``nn.Module`` being trained
opt                 the optimizer (an ``HPOptimizer``, or a ``MultiOptimizer``
                    for several; a callback may swap it, as the model,
                    the loss function and the metrics: see below)
data                the data object (``train_dl``, ``valid_dl``)
loss_func           the loss function, called as ``loss_func(out, *targets)``
metrics             the ``fitlib.metrics.Metrics`` of the run (``.names``)
train_metrics       the ``Metrics`` computed over the training batches, each
                    reported in the record as ``train_<name>``
callbacks           the fit's callbacks, sorted by ``order`` (read only: a
                    checkpoint saves and restores their ``state_dict``)
n_epochs            the number of epochs ``fit`` was asked for (None: as
                    many as ``max_steps`` takes)
max_steps           the step budget of the fit (``fit(max_steps=...)``), or
                    None; training stops after that many optimizer steps
n_steps             the number of optimizer steps the fit will take, when
                    known: ``n_epochs * len(train_dl)``, at most
                    ``max_steps``, or None for a loader without a length and
                    no budget; callbacks that change it (gradient
                    accumulation) update it in ``on_train_begin``, so
                    schedulers (higher ``order``) read the true count
step                optimizer steps done since ``fit`` began: the handler adds
                    1 after ``on_step_end`` when the step ran (``skip_step``
                    False), so ``on_batch_end`` counts this batch's step
epoch               the current epoch, 0-based
iteration           training batches finished since ``fit`` began (so, inside a
                    batch's hooks, the 0-based index of that batch); a fit
                    that begins with ``iteration > 0`` is a resumed one
num_batch           the 0-based index of the batch within the current loader
train               True for training batches, False for validation batches
last_input          the current batch's inputs, on the model's device
last_target         the current batch's targets, on the model's device
last_output         the model's output for the current batch (detached in
                    ``on_batch_end``)
last_loss           the current batch's loss: the graph-carrying tensor from
                    ``on_backward_begin`` to ``on_step_end`` (an update made in
                    ``on_backward_begin`` is what ``backward()`` uses), then
                    in ``on_batch_end`` the detached loss of ``loss_func``
smooth_loss         debiased exponential moving average of the training loss
                    (beta 0.98) since ``fit`` began, a detached device tensor;
                    kept only when a callback's hook receives it (names it or
                    takes ``**kwargs``), else None: it costs a device op per
                    batch (``LossSmoother`` averages floats the same way)
last_loss_parts     the named parts of the current batch's loss, detached,
                    when ``loss_func`` returns a dict (``{"loss": total,
                    "ce": ..., "box": ...}``; ``last_loss`` is its ``"loss"``),
                    else None
last_metrics        ``[valid_loss, *metric values]`` as device tensors after
                    validation, ``None`` when validation was skipped
record              at ``on_epoch_end``, the epoch's record: a dict of python
                    numbers, ``epoch`` (and ``step``, the steps done, when a
                    callback ``validates_mid_epoch``), ``train_loss``,
                    ``valid_loss``, each metric by name, ``train_<metric>``,
                    the loss parts
                    (``train_<part>``, ``valid_<part>``), the values callbacks
                    added, ``lr`` (of the last parameter group, as the epoch's
                    last step used it) and ``time`` (the epoch's seconds, or since
                    the previous record), in
                    that order; None where a value was not computed (e.g.
                    validation skipped). Read in one host transfer. A callback
                    adds values by returning ``{"record": {"name": value}}``
                    from ``on_epoch_end`` (a number or one-element tensor; the
                    name declared in its ``record_names``, and new): later
                    callbacks (higher ``order``: monitors, the Recorder,
                    loggers, the bar) see them. It stays the last epoch's
                    record until the next epoch ends
tally               the ``fitlib.record.EpochTally`` behind the record: the
                    epoch's running sums (read only; ``Checkpoint`` saves it)
stop_epoch          set True to end the current loader after this batch: the
                    epoch's training, or its validation
stop_training       set True to end training: after this training batch (the
                    epoch's validation still runs unless ``skip_validate``),
                    after this epoch, or, set in ``on_train_begin`` or
                    ``on_epoch_begin``, before the next epoch starts
skip_bwd            set True in ``on_backward_begin`` to skip ``backward()``
skip_step           set True by ``on_backward_end`` to skip ``opt.step()``
skip_zero           set True by ``on_step_end`` to keep the gradients
skip_validate       set True before ``on_epoch_end`` to skip the validation
                    at the epoch's end (set in a batch event, it also cancels
                    a ``validate_now`` asked for before)
validate_now        set True in a training batch's events to validate before
                    the next batch: the validation ends a record (``on_epoch_end``
                    with ``mid_epoch`` True) and training goes on, in train
                    mode, in the same epoch; after the epoch's last batch, it
                    is the epoch's validation (even with ``skip_validate``)
mid_epoch           at ``on_epoch_end``: True when the record ends at a
                    validation inside the epoch (``validate_now``; the epoch
                    goes on, ``epoch`` stays, ``num_batch`` counts its
                    training batches so far), False at the epoch's end
==================  ==========================================================

``on_train_end`` also receives ``exception``: the exception that ended
training, or ``None``.

A hook may return a key only in the events after which something reads it
(``WRITABLE``); anything else is refused with a ValueError, since the update
would do nothing:

==================  ==========================================================
key                 may be returned in
==================  ==========================================================
model, opt,         ``on_train_begin``, ``on_epoch_begin``, ``on_batch_begin``,
loss_func, metrics  ``on_batch_end``, ``on_epoch_end``: the loop reads the
                    model, optimizer and loss as each training batch starts
                    (after ``on_batch_begin``), the metrics at each
                    validation; validation runs the model returned (a
                    wrapper of the fit's model, DDP, validates the model
                    itself); an optimizer gets the loss scaler of the one it
                    replaces; metrics keep their names
data                any event but ``on_train_end``: ``train_dl`` is read at
                    each epoch's start, ``valid_dl`` before its validation
n_steps, epoch,     ``on_train_begin`` (the plan, or a resumed position)
iteration, step
num_batch           ``on_epoch_begin`` (an epoch resumed part way)
last_input,         ``on_batch_begin`` (transform the batch)
last_target
last_output         ``on_loss_begin`` (what the loss and metrics get) and
                    ``on_batch_end`` (what later callbacks see)
last_loss           ``on_backward_begin`` (what ``backward()`` uses) and
                    ``on_batch_end`` (what later callbacks record)
record              ``on_epoch_end``: values to add (merged, never replaced)
stop_epoch          the batch events
stop_training,      any event but ``on_train_end``
max_steps
skip_bwd            ``on_batch_begin`` to ``on_backward_begin``
skip_step           ``on_batch_begin`` to ``on_backward_end``
skip_zero           ``on_batch_begin`` to ``on_step_end``
skip_validate       ``on_epoch_begin`` and the batch events
validate_now        the batch events
==================  ==========================================================

``train_metrics``, ``callbacks``, ``n_epochs``, ``train``, ``smooth_loss``,
``last_loss_parts``, ``last_metrics``, ``tally`` and ``mid_epoch`` are read
only; ``on_train_end`` returns nothing. (``last_metrics`` is read only since
the record is built before ``on_epoch_end``: a changed list would reach only
the later callbacks, not the record, history, monitors and loggers. A value
of your own goes in the record: ``{"record": {"name": value}}``, the name
declared in ``record_names``.)
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fitlib import ranks
from fitlib.checks import check_trainable
from fitlib.dispatch import hook_caller, receives
from fitlib.errors import add_note, did_you_mean, unknown_name
from fitlib.metrics import Metrics
from fitlib.metrics.functions import class_dims_of, swap_class_dims
from fitlib.multi_optimizer import as_optimizer
from fitlib.record import (
    EpochTally,
    Record,
    batch_size,
    check_added,
    check_record_names,
    loss_count,
    step_lr,
)
from fitlib.sharding import unwrap
from fitlib.structure import map_tensors

EVENTS = (
    "on_train_begin",
    "on_epoch_begin",
    "on_batch_begin",
    "on_loss_begin",
    "on_backward_begin",
    "on_backward_end",
    "on_step_end",
    "on_batch_end",
    "on_epoch_end",
    "on_train_end",
)

STATE_KEYS = (
    "model",
    "opt",
    "data",
    "loss_func",
    "metrics",
    "train_metrics",
    "callbacks",
    "n_epochs",
    "max_steps",
    "n_steps",
    "epoch",
    "iteration",
    "step",
    "num_batch",
    "train",
    "last_input",
    "last_target",
    "last_output",
    "last_loss",
    "smooth_loss",
    "last_loss_parts",
    "last_metrics",
    "record",
    "tally",
    "stop_epoch",
    "stop_training",
    "skip_bwd",
    "skip_step",
    "skip_zero",
    "skip_validate",
    "validate_now",
    "mid_epoch",
)
_VALID_KEYS = frozenset(STATE_KEYS)
SMOOTH_BETA = 0.98

_BATCH_EVENTS = EVENTS[2:8]  # on_batch_begin ... on_batch_end
_FIT_EVENTS = EVENTS[:-1]  # all but on_train_end, after which nothing reads
# The events after which the loop (or a later callback) reads each key a hook
# may return; the other keys are read only: the loop keeps its own reference
# (opt, loss_func, metrics...) or owns the value (train, smooth_loss).
# The loop reads model, opt and loss_func as each training batch starts (after
# on_batch_begin), metrics at each validation: a swap takes effect from there.
_SWAP_EVENTS = ("on_train_begin", "on_epoch_begin", "on_batch_begin",
                "on_batch_end", "on_epoch_end")  # fmt: skip
_SWAPPABLE = frozenset(("model", "opt", "loss_func", "metrics"))
# Read only because the record is built from them before on_epoch_end.
_BUILT_INTO_RECORD = frozenset(("last_metrics",))

WRITABLE: dict[str, tuple[str, ...]] = {
    "model": _SWAP_EVENTS,  # wrapped (DDP) before training, or another model
    "opt": _SWAP_EVENTS,
    "loss_func": _SWAP_EVENTS,
    "metrics": _SWAP_EVENTS,  # with the same names (the record's columns)
    "data": _FIT_EVENTS,  # train_dl is read at each epoch, valid_dl after it
    "n_steps": ("on_train_begin",),
    "max_steps": _FIT_EVENTS,
    "epoch": ("on_train_begin",),  # a resumed fit's position
    "iteration": ("on_train_begin",),
    "step": ("on_train_begin",),
    "num_batch": ("on_epoch_begin",),  # an epoch resumed part way
    "last_input": ("on_batch_begin",),
    "last_target": ("on_batch_begin",),
    "last_output": ("on_loss_begin", "on_batch_end"),
    "last_loss": ("on_backward_begin", "on_batch_end"),
    "record": ("on_epoch_end",),  # values added to the epoch's record
    "stop_epoch": _BATCH_EVENTS,
    "stop_training": _FIT_EVENTS,
    "skip_bwd": EVENTS[2:5],  # up to on_backward_begin
    "skip_step": EVENTS[2:6],  # up to on_backward_end
    "skip_zero": EVENTS[2:7],  # up to on_step_end
    "skip_validate": ("on_epoch_begin", *_BATCH_EVENTS),
    "validate_now": _BATCH_EVENTS,  # read before the next batch
}


class Callback:
    """Base class: override the hooks you need; the others cost nothing.

    A hook names the state keys it reads as parameters and may return a dict
    of updates to the state (see the module docstring for the keys). With
    ``**kwargs`` it receives every key; without, only those it names, which is
    faster: Python matches each keyword passed against the parameter names.

    Example:
        >>> class StopAfter(Callback):
        ...     def __init__(self, n):
        ...         self.n = n
        ...     def on_batch_end(self, iteration):
        ...         if iteration + 1 >= self.n:
        ...             return {"stop_training": True}
    """

    order: int = 0
    # Whether Learner.lr_find runs this callback of learn.callbacks in its
    # sweep: yes for what shapes a step (mixed precision, accumulation,
    # clipping, yours); no for checkpoints, loggers, schedulers and stoppers.
    in_lr_find: bool = True
    # Whether the Learner's evaluation (validate, get_preds, predict) runs this
    # callback of learn.callbacks, as a fit's validation does: yes for what
    # shapes the forward pass (precision, memory format, compilation). Its
    # on_train_begin then gets opt=None (no step), then validation batches.
    in_evaluation: bool = False
    # The hyper-parameters this callback sets outright at every step (a
    # schedule): two such callbacks of one fit may not share one, since the
    # later would silently overwrite the earlier. A callback that adjusts a
    # value instead (ReduceLROnPlateau) calls opt.scale and lists nothing.
    sets_hypers: tuple[str, ...] = ()
    # The names of the values this callback adds to the epoch record (by
    # returning {"record": {...}} from on_epoch_end): declared, so that
    # monitors can check a name before training, and a typo cannot add a
    # column silently.
    record_names: tuple[str, ...] = ()
    # Side effects only (bars, logs, files): under torch.distributed only the
    # process of rank 0 runs it; the others leave it out.
    main_only: bool = False
    # Asks for validations inside epochs (returns validate_now): every record
    # of the fit then has its ``step``, which tells an epoch's records apart.
    validates_mid_epoch: bool = False

    @property
    def name(self) -> str:
        """The class name, used in messages and tables."""
        return type(self).__name__

    def on_train_begin(self, **kwargs: Any) -> dict | None:
        """Runs once, before the first epoch."""

    def on_epoch_begin(self, **kwargs: Any) -> dict | None:
        """Runs at the start of every epoch."""

    def on_batch_begin(self, **kwargs: Any) -> dict | None:
        """Runs for every batch (training and validation) before the forward."""

    def on_loss_begin(self, **kwargs: Any) -> dict | None:
        """Runs after the forward pass, before the loss is computed."""

    def on_backward_begin(self, **kwargs: Any) -> dict | None:
        """Runs after the loss is computed, before ``backward()`` (training)."""

    def on_backward_end(self, **kwargs: Any) -> dict | None:
        """Runs after ``backward()``, before ``opt.step()`` (training)."""

    def on_step_end(self, **kwargs: Any) -> dict | None:
        """Runs after ``opt.step()``, before ``opt.zero_grad()`` (training)."""

    def on_batch_end(self, **kwargs: Any) -> dict | None:
        """Runs at the end of every batch (training and validation)."""

    def on_epoch_end(self, **kwargs: Any) -> dict | None:
        """Runs after validation at the end of every epoch."""

    def on_train_end(self, **kwargs: Any) -> dict | None:
        """Runs once at the end, also after an error (``exception`` is set)."""

    def state_dict(self) -> dict:
        """What must be saved to resume this callback: plain values only."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restores what ``state_dict`` returned."""

    def __repr__(self) -> str:
        return f"{self.name}(order={self.order})"


def _detached(x: Any) -> Any:
    return map_tensors(torch.Tensor.detach, x)


Hook = Callable[[dict], Any]


def _overrides(cb: Callback, event: str) -> bool:
    return getattr(type(cb), event) is not getattr(Callback, event)


def call_hook(cb: Callback, event: str, **state: Any) -> dict | None:
    """Calls ``cb``'s hook for ``event`` as the handler would; for tests.

    The hook gets the state a new handler starts with, updated with ``state``
    (plus ``exception`` for ``on_train_end``), and its return value comes back.

    Example:
        >>> call_hook(rec, "on_epoch_end", last_metrics=[torch.tensor(0.3)])
    """
    if event not in EVENTS:
        raise ValueError(
            unknown_name("call_hook", "event", event, EVENTS, "pass one of them.")
        )
    extra = {"exception": None} if event == "on_train_end" else {}
    unknown = sorted(state.keys() - _VALID_KEYS - extra.keys())
    if unknown == ["exception"]:
        raise ValueError(
            "call_hook: unknown state key 'exception' (only on_train_end gets "
            f"exception). Fix: pass state keys among {', '.join(STATE_KEYS)}."
        )
    if unknown:
        fix = f"pass state keys among them{_and_others(unknown)}."
        raise ValueError(
            unknown_name("call_hook", "state key", unknown[0], STATE_KEYS, fix)
        )
    base = CallbackHandler().state | {"train": False}  # as after on_train_begin
    return _caller(cb, event)(base | extra | state)


def _and_others(unknown: list[str]) -> str:
    """`` (and 'b', 'c')``: the unknown names after the first, which the
    message names (``unknown_name``); "" when there is one."""
    return f" (and {', '.join(map(repr, unknown[1:]))})" if unknown[1:] else ""


def _caller(cb: Callback, event: str) -> Hook:
    extra = ("exception",) if event == "on_train_end" else ()
    return hook_caller(getattr(cb, event), f"{cb.name}.{event}", STATE_KEYS + extra)


def callback_list(callbacks: Iterable[Any] | Callback | None) -> list[Callback]:
    """``callbacks`` as a checked list: None is none, one callback is a list of it.

    Example:
        >>> callback_list(Recorder())
        [Recorder(order=50)]
    """
    return _check_callbacks([] if callbacks is None else callbacks)


def inner_callback(cb: Callback) -> Callback:
    """The callback a filter (``every``, ``once``) wraps, or ``cb`` itself:
    whose attributes (``sets_hypers``, ``in_lr_find``, ...) say what it does."""
    return getattr(cb, "callback", cb)


def _check_callbacks(callbacks: Iterable[Any] | Callback) -> list[Callback]:
    callbacks = [callbacks] if isinstance(callbacks, Callback) else callbacks
    if not isinstance(callbacks, Iterable) or isinstance(callbacks, (str, dict)):
        raise TypeError(
            f"callbacks must be a list of fitlib.Callback instances; got "
            f"{callbacks!r}. Fix: e.g. callbacks=[Recorder()]."
        )
    callbacks = list(callbacks)
    for cb in callbacks:
        _check_hook_names(cb)
        if isinstance(cb, type) and issubclass(cb, Callback):
            raise TypeError(
                f"callbacks: got the class {cb.__name__}, not an instance. "
                f"Fix: pass {cb.__name__}() instead."
            )
        if not isinstance(cb, Callback):
            raise TypeError(
                f"callbacks: {cb!r} (type {type(cb).__name__}) is not a "
                "fitlib.Callback. Fix: subclass fitlib.Callback and override "
                "the hooks you need."
            )
    return callbacks


class LossSmoother:
    """The average of ``smooth_loss``, on the host, over python floats.

    A callback that needs the smoothed loss only at epoch end keeps the raw
    losses and smooths them here, in float64: the same numbers, without the
    device op per batch that ``state['smooth_loss']`` costs.

    Example:
        >>> LossSmoother()([2.0, 1.0])
        [2.0, 1.4949494949494933]
    """

    def __init__(self) -> None:
        self.avg, self.n = 0.0, 0

    def __call__(self, losses: Iterable[float]) -> list[float]:
        """Adds ``losses`` in order; returns the debiased average after each."""
        out = []
        for loss in losses:
            self.n += 1
            self.avg += (1 - SMOOTH_BETA) * (loss - self.avg)
            out.append(self.avg / (1 - SMOOTH_BETA**self.n))
        return out


def _check_hook_names(cb: Any) -> None:
    """Refuses a method named like a hook that no event calls (a typo such as
    ``on_epoch_ends`` would otherwise never run, silently)."""
    cls = cb if isinstance(cb, type) else type(cb)
    if not issubclass(cls, Callback):
        return
    stray = [n for n in dir(cls) if n.startswith("on_") and n not in EVENTS]
    for name in stray:
        raise TypeError(
            f"callback {cls.__name__} defines {name}{did_you_mean(name, EVENTS)}, "
            f"which no event calls, so it would never run. The events are "
            f"{', '.join(EVENTS)}. Fix: rename it (a helper method: a name "
            "without the on_ prefix)."
        )


_BEGIN_CALL = (
    "call handler.on_train_begin(n_epochs, model=model, opt=opt, data=data, "
    "loss_func=loss_func) before the first epoch (metrics=..., "
    "train_metrics=... too if you have them)"
)
_MISSING_BATCH_BEGIN = (
    "CallbackHandler: loss_batch ran a batch without on_batch_begin, so the "
    "callbacks did not see it start (gradient accumulation sizes its group "
    "there, mixed precision turns autocast on). Fix: for each batch, call "
    "xb, yb = handler.on_batch_begin(xb, yb) before loss_batch(model, xb, yb, "
    "loss_func, opt, handler), and handler.on_batch_end(loss) after it."
)


def _not_writable(cb: Callback, event: str, key: str | None) -> str:
    may = [k for k, events in WRITABLE.items() if event in events]
    if key is None:
        what = "a value, but nothing reads the state after on_train_end"
    elif key in WRITABLE:
        what = (
            f"{key!r}, which takes effect only when returned from "
            f"{', '.join(WRITABLE[key])}: here it would be ignored or misread"
        )
    elif key in _BUILT_INTO_RECORD:
        what = (
            f"{key!r}, which is read only: the epoch's record is built from it "
            "before on_epoch_end, so the record, history, monitors and loggers "
            "would keep the loop's values and only later callbacks would see "
            "yours. The record's existing values cannot be replaced; to add "
            "a value under a new name, return {'record': {'my_value': v}} "
            "from on_epoch_end, with the name declared in the class "
            "(record_names = ('my_value',))"
        )
    else:
        what = (
            f"{key!r}, which is read only: fit keeps its own reference (or owns "
            "the value), so the update would do nothing"
        )
    return (
        f"{cb.name}.{event} returned {what}. In {event} a hook may change: "
        f"{', '.join(may) or 'nothing (return None)'}. Fix: return only those; "
        "to change something else, do it before fit (or on the object itself, "
        "e.g. opt.lr = ...)."
    )


def _check_hyper_owners(callbacks: list[Callback]) -> None:
    owners: dict[str, Callback] = {}
    for cb in callbacks:
        inner = inner_callback(cb)
        for name in getattr(inner, "sets_hypers", ()):
            clash = [n for n in owners if _same_hyper(n, name)]
            if clash:
                name = clash[0]
                raise ValueError(
                    f"{owners[name].name} and {inner.name} both set {name!r} at "
                    "every step: the later would silently overwrite the earlier. "
                    f"Fix: keep one schedule for {name!r} (one ParamScheduler can "
                    "hold several phases; fit_one_cycle already schedules lr and "
                    "mom); ReduceLROnPlateau composes with a schedule."
                )
            owners[name] = inner


def _check_model(owner: str, old: Any, new: Any, event: str) -> torch.nn.Module:
    if not isinstance(new, torch.nn.Module):
        raise TypeError(
            f"{owner} returned model={type(new).__name__}; a model is an "
            "nn.Module. Fix: return {'model': some_module}."
        )
    if event != "on_train_begin" and isinstance(old, torch.nn.Module):
        devices = [next(iter(m.parameters()), None) for m in (old, new)]
        devices = [None if p is None else p.device for p in devices]
        if devices[0] != devices[1]:
            raise ValueError(
                f"{owner} returned a model on {devices[1]}, but the fit's batches "
                f"go to {devices[0]}. Fix: move it there first (model.to(...))."
            )
        new.train(old.training)  # training goes on in the mode it was in
    return new


def _same_metrics(owner: str, old: Metrics, new: Any) -> Metrics:
    new = new if isinstance(new, Metrics) else Metrics(new)
    if new.names != old.names:
        raise ValueError(
            f"{owner} returned metrics named {new.names}, the fit's are "
            f"{old.names}: every record of a fit has the same names (the table, "
            "the CSV header). Fix: return metrics with the same names (e.g. a "
            "new threshold), or add a value with record_names."
        )
    new.reducer = old.reducer  # (set under torch.distributed)
    return new


def _same_hyper(a: str, b: str) -> bool:
    """Whether two ``sets_hypers`` names set one value: ``lr`` (every
    part's) and ``decoder.lr`` (one part's) do, two parts' ``lr`` do not."""
    part_a, _, hyper_a = a.rpartition(".")
    part_b, _, hyper_b = b.rpartition(".")
    return hyper_a == hyper_b and (part_a == part_b or not part_a or not part_b)


class CallbackHandler:
    """Keeps the training state and calls the callbacks' hooks in ``order``.

    Callbacks are sorted once (stably, lower ``order`` first). For each event
    the handler lists, once, the callbacks that override that hook, so an
    event nobody overrides costs one empty loop.

    ``fit`` makes one per run; to drive hooks around your own loop, call
    each event where ``fit`` does (the README's "Event timeline" has the whole
    loop). An event before ``on_train_begin``, or ``loss_batch`` before
    ``on_batch_begin``, is refused with the call that is missing; a hook that
    fails on a key ``on_train_begin`` was not given gets a note naming it.

    Example:
        >>> handler = CallbackHandler([Recorder()])
        >>> handler.on_train_begin(1, model=model, opt=opt, data=data,
        ...                        loss_func=loss_func)
        >>> handler.on_epoch_begin()
        >>> xb, yb = handler.on_batch_begin(xb, yb)
        >>> handler.on_batch_end(loss_batch(model, xb, yb, loss_func, opt, handler))
        >>> handler.on_epoch_end(validate(model, data.valid_dl, loss_func))
        >>> handler.on_train_end(None)
    """

    def __init__(self, callbacks: Iterable[Callback] | None = None) -> None:
        cbs = callback_list(callbacks)
        if not ranks.is_main():  # another rank of a distributed run: no side effects
            cbs = [cb for cb in cbs if not cb.main_only]
        self.callbacks = sorted(cbs, key=lambda cb: cb.order)
        _check_hyper_owners(self.callbacks)
        check_record_names(self.callbacks)
        self._hooks = {
            ev: [(cb, _caller(cb, ev)) for cb in self.callbacks if _overrides(cb, ev)]
            for ev in EVENTS
        }
        self.state: dict[str, Any] = dict.fromkeys(STATE_KEYS)
        # train=None until on_train_begin: the first batch event then sees a
        # new loader, where it checks that training was begun (not per batch).
        self.state.update(epoch=0, iteration=0, step=0, num_batch=0, train=None)
        self.state.update(validate_now=False, mid_epoch=False)
        self._begun = False  # on_train_begin has run
        self._not_given: list[str] = []  # what on_train_begin was not given
        self._record_step = False  # records carry their step (see on_train_begin)
        # The class dims in force before on_train_begin (put back at its end).
        self._outer_class_dims: dict | None = None
        self.state["callbacks"] = list(self.callbacks)
        self.tally = self.state["tally"] = EpochTally()
        # The records of the epochs ended so far (``fit`` returns them).
        self.history: list[Record] = []
        self.interrupted = False
        # The last training step's graph, kept until the next step's forward
        # (see on_batch_end).
        self._graph: torch.Tensor | None = None
        self._checked: set = set()  # the checks done (at a first batch)
        # What a batch's loss is a mean over, when not its samples (tokens of
        # a masked token loss): set per fit (and by validate), see loss_count;
        # False once the first batch showed that samples it is.
        self.count: Any = None
        self._smooth_read = any(
            receives(getattr(cb, ev), "smooth_loss")
            for ev, hooks in self._hooks.items()
            for cb, _ in hooks
        )

    def first_batch(self, check: Any) -> bool:
        """True the first time it is asked about ``check`` (a name): the loop
        checks the inputs of the loss and metrics once per fit (or per
        ``validate`` call), at the first batch, when their shapes are known."""
        if check in self._checked:
            return False
        self._checked.add(check)
        if self.callbacks:  # (a batch of loss_batch or validate: driven right?)
            self._check_begun("loss_batch")
            if self.state["last_input"] is None:
                raise RuntimeError(_MISSING_BATCH_BEGIN)
        return True

    def _check_begun(self, event: str) -> None:
        """Refuses an event before ``on_train_begin``: the callbacks set up
        there (autocast, the number of steps, the model's parameters)."""
        if not self._begun and self.callbacks:
            raise RuntimeError(
                f"CallbackHandler: {event} before on_train_begin, so the "
                f"callbacks ({', '.join(cb.name for cb in self.callbacks)}) were "
                f"not set up. Fix: {_BEGIN_CALL}."
            )

    def _note_not_given(self, e: Exception) -> None:
        """Adds to a hook's error the keys ``on_train_begin`` was not given:
        on an error about None (``'NoneType' object has no attribute ...``),
        or on any error without a model or data (``fit`` always gives them;
        an evaluation has no ``opt``, a model's own loss no ``loss_func``)."""
        on_none = isinstance(e, AttributeError) and getattr(e, "obj", 0) is None
        on_none = on_none or "'NoneType'" in str(e)
        missing = self._not_given
        if missing and (on_none or {"model", "data"} & set(missing)):
            add_note(
                e,
                f"fitlib: on_train_begin got no {', '.join(missing)} (None), "
                f"which a callback may need. Fix: {_BEGIN_CALL}.",
            )

    def __call__(self, event: str, **extra: Any) -> None:
        """Calls ``event`` on every callback that overrides it (with ``extra``
        keys added to the state they receive)."""
        self._run(event, {**self.state, **extra} if extra else None)

    def _run(self, event: str, kwargs: dict | None = None) -> None:
        """Calls the hooks of ``event`` with ``kwargs`` (default: the state);
        the per-batch events come here directly, without ``**extra``."""
        kwargs = self.state if kwargs is None else kwargs
        for cb, hook in self._hooks[event]:  # (_call, inlined: the hot path)
            try:
                update = hook(kwargs)
            except Exception as e:
                add_note(e, f"fitlib: raised in callback {cb.name}.{event}")
                self._note_not_given(e)
                raise
            if update is not None:
                self._apply(cb, event, update)

    def _call(self, cb: Callback, event: str, hook: Hook, kwargs: dict) -> None:
        try:
            update = hook(kwargs)
        except Exception as e:
            add_note(e, f"fitlib: raised in callback {cb.name}.{event}")
            self._note_not_given(e)
            raise
        if update is not None:
            self._apply(cb, event, update)

    def _apply(self, cb: Callback, event: str, update: Any) -> None:
        if not isinstance(update, dict):
            raise TypeError(
                f"{cb.name}.{event} returned {type(update).__name__} "
                f"({update!r}); a hook returns None or a dict of state updates."
            )
        unknown = sorted(map(str, update.keys() - _VALID_KEYS))
        if unknown:
            more = _and_others(unknown)
            fix = f"return only state keys{more} (WRITABLE: when each is read)."
            owner = f"{cb.name}.{event}"
            raise ValueError(
                unknown_name(owner, "state key", unknown[0], STATE_KEYS, fix)
            )
        for key in update:
            if event not in WRITABLE.get(key, ()):
                raise ValueError(_not_writable(cb, event, key))
        if update.keys() & _SWAPPABLE:
            update = self._swap(cb, event, dict(update))
        if "record" in update:  # added to the record, not replacing it
            update = dict(update)
            self._add_to_record(cb, update.pop("record"))
        self.state.update(update)
        # skip_validate set during the batches: no validation at all (a NaN
        # loss), not even one asked for before it.
        skip = update.get("skip_validate") and event in _BATCH_EVENTS
        if skip and "validate_now" not in update:
            self.state["validate_now"] = False

    def _swap(self, cb: Callback, event: str, update: dict) -> dict:
        """Checks a model, optimizer, loss or metrics a hook returned, and
        carries over what the loop and other callbacks set on the old one."""
        state, owner = self.state, f"{cb.name}.{event}"
        if "model" in update:
            new = _check_model(owner, state["model"], update["model"], event)
            inner = getattr(new, "module", None)  # a wrapper (DDP) of the model
            self.eval_model = inner if inner is self.eval_model else new
        if "model" in update and "opt" not in update:  # the optimizer steps it?
            check_trainable(self.eval_model, state["opt"])
        if "opt" in update:
            new, old = as_optimizer(update["opt"]), state["opt"]
            check_trainable(self.eval_model, new)
            # MixedPrecision's loss scaler moves to the new one: the old one
            # (learn.opt, say) steps plainly again, as after the fit.
            if new is not old:
                new.grad_scaler = getattr(old, "grad_scaler", None)
                old.grad_scaler = None
            update["opt"] = new
        if "loss_func" in update:
            new = update["loss_func"]
            if new is not None and not callable(new):
                raise TypeError(
                    f"{owner} returned loss_func={new!r}, which is not callable. "
                    "Fix: return a function loss_func(output, *targets)."
                )
            self.count = loss_count(new)
            self.tally.declare_parts(getattr(new, "part_names", ()))
            self._checked -= {("loss", True), ("loss", False)}  # check it anew
        if "metrics" in update:
            update["metrics"] = _same_metrics(
                owner, state["metrics"], update["metrics"]
            )
        return update

    def _add_to_record(self, cb: Callback, values: Any) -> None:
        """Merges a callback's values into the record, before ``lr`` and
        ``time`` (which stay last), in place: a callback that keeps the
        record (a ``Checkpoint`` deciding on it later) sees them too."""
        record = self.state["record"]
        owner = f"{cb.name}.on_epoch_end"
        added = check_added(owner, record, values, getattr(cb, "record_names", ()))
        tail = {k: record.pop(k) for k in ("lr", "time") if k in record}
        record.update(added)
        record.update(tail)

    # The per-batch methods below assign keys one by one and skip events that no
    # callback overrides: this is the hot path, run six times per batch.
    def on_train_begin(
        self, n_epochs: int | None, max_steps: int | None = None, **state: Any
    ) -> None:
        self.state.update(state, n_epochs=n_epochs, max_steps=max_steps)
        self._begun, self.state["train"] = True, False
        given = ("model", "opt", "data", "loss_func")
        self._not_given = [k for k in given if self.state[k] is None]
        # What validation runs: the model as given, not a wrapper of it (DDP).
        self.eval_model = self.state["model"]
        self.state.update(stop_training=False, n_steps=max_steps)
        self.state.update(validate_now=False, mid_epoch=False)
        self._record_step = any(
            getattr(cb, "validates_mid_epoch", False) for cb in self.callbacks
        )
        # The model's class dims (its first batch decides them; a resume or
        # a later evaluation reads them); on_train_end puts back the outer
        # ones (an evaluation inside a fit_snapshots loop).
        model = self.state["model"]
        dims = {} if model is None else class_dims_of(unwrap(model))
        self._outer_class_dims = swap_class_dims(dims)
        self.tally = self.state["tally"] = EpochTally(
            self.state["train_metrics"], self.state.get("loss_func")
        )
        self.tally.declare_parts(getattr(self.state.get("loss_func"), "part_names", ()))
        self.count = loss_count(self.state.get("loss_func"))
        try:
            n_steps = n_epochs * len(self.state["data"].train_dl)
        except (AttributeError, TypeError):  # no data, no epochs, or no len
            n_steps = None
        if n_steps is not None:
            self.state["n_steps"] = min(n_steps, max_steps or n_steps)
        self("on_train_begin")

    def on_epoch_begin(self) -> bool:
        """Returns True when no epoch must start (``stop_training`` is set)."""
        self._check_begun("on_epoch_begin")
        # train=True: the epoch's training batches keep a num_batch that a
        # hook sets here (a checkpoint resuming part way through the epoch).
        self.state.update(num_batch=0, stop_epoch=False, skip_validate=False)
        self.state.update(train=True, validate_now=False, mid_epoch=False)
        if not self.state["stop_training"]:
            self("on_epoch_begin")
        if self.state["num_batch"] == 0:  # not an epoch resumed part way
            self.tally.start()
        return self.state["stop_training"]

    def on_batch_begin(self, xb: Any, yb: Any, train: bool = True) -> tuple:
        state = self.state
        if train is not state["train"]:  # a new loader: validation after training
            self._check_begun("on_batch_begin")
            state["num_batch"], state["stop_epoch"] = 0, False
        state["last_input"], state["last_target"], state["train"] = xb, yb, train
        if train:
            state["skip_bwd"] = state["skip_step"] = state["skip_zero"] = False
        if self._hooks["on_batch_begin"]:
            self._run("on_batch_begin")
        return state["last_input"], state["last_target"]

    def on_loss_begin(self, out: Any) -> Any:
        self.state["last_output"] = out
        if self._hooks["on_loss_begin"]:
            self._run("on_loss_begin")
        return self.state["last_output"]

    def on_backward_begin(self, loss: torch.Tensor) -> tuple[torch.Tensor, bool]:
        self.state["last_loss"] = loss
        if self._hooks["on_backward_begin"]:
            self._run("on_backward_begin")
        return self.state["last_loss"], self.state["skip_bwd"]

    def on_backward_end(self) -> bool:
        if self._hooks["on_backward_end"]:
            self._run("on_backward_end")
        return self.state["skip_step"]

    def on_step_end(self) -> bool:
        if self._hooks["on_step_end"]:
            self._run("on_step_end")
        if not self.state["skip_step"]:
            self.state["step"] += 1
        return self.state["skip_zero"]

    def on_batch_end(self, loss: torch.Tensor) -> bool:
        """Returns True when the epoch must end after this batch."""
        state = self.state
        train = state["train"]
        if train:
            # backward() freed the graph's saved tensors; keeping its nodes
            # until the next forward (as a hand-written loop's ``loss``
            # variable does) lets torch reuse the parameters' gradient
            # accumulators instead of building them again at every step. A
            # graph that backward() skipped still holds its activations: not
            # kept.
            self._graph = None if state["skip_bwd"] else state["last_loss"]
        state["last_loss"] = loss
        parts = state["last_loss_parts"]
        if train:
            if self._smooth_read:
                n = state["iteration"] + 1  # smoothed losses: also after a resume
                state["smooth_loss"] = self._smooth(state["smooth_loss"], loss, n)
            # The output's graph would live until the next forward otherwise.
            out = state["last_output"]
            out = out.detach() if type(out) is torch.Tensor else _detached(out)
            state["last_output"] = out
        if train or parts:
            yb = state["last_target"]
            count = self.count  # tokens, for a masked token loss (no sync)
            size = count(state["last_output"], yb) if count else None
            if size is None and count and getattr(count, "by_shape", False):
                self.count = False  # class indices (B,): by samples, this fit
            # The common case inline: one batch of targets (this runs per step).
            if size is None and type(yb) is torch.Tensor and yb.ndim:
                size = yb.shape[0]
            elif size is None:
                size = batch_size(yb, state["last_input"])
            tally = self.tally
            if train and not parts and not tally.has_metrics:  # inline: per step
                tally.loss.add(loss, size)
            else:
                tally.add_batch(loss, size, train, parts, state["last_output"], yb)
        if self._hooks["on_batch_end"]:
            self._run("on_batch_end")
        if train:
            state["iteration"] += 1
            budget = state["max_steps"]
            if budget is not None and state["step"] >= budget:
                state["stop_training"] = True
        state["num_batch"] += 1
        if self.interrupted:
            raise KeyboardInterrupt("training stopped after the batch in progress")
        # stop_training ends the training loader; validation still runs once.
        return state["stop_epoch"] or (train and state["stop_training"])

    @staticmethod
    def _smooth(
        smooth: torch.Tensor | None, loss: torch.Tensor, n: int
    ) -> torch.Tensor:
        # A debiased moving average, avg_n / (1 - beta**n), in one device op:
        # it is a lerp towards the new loss with weight (1-beta) / (1-beta**n).
        loss = loss if loss.dtype == torch.float32 else loss.float()
        if smooth is None:
            return loss
        weight = (1 - SMOOTH_BETA) / (1 - SMOOTH_BETA**n)
        return torch.lerp(smooth, loss, weight)

    def on_epoch_end(
        self, val_metrics: list[torch.Tensor] | None, num_batch: int | None = None
    ) -> bool:
        """Builds the record (one host transfer), runs the hooks; returns True
        when training must stop.

        ``num_batch``: the training batches done in the epoch, for a record
        that ends at a validation inside it (``validate_now``); None at the
        epoch's end.
        """
        self._check_begun("on_epoch_end")
        state = self.state
        mid_epoch = state["mid_epoch"] = num_batch is not None
        if mid_epoch:  # the epoch's training goes on (validation counted its own)
            state.update(num_batch=num_batch, train=True, stop_epoch=False)
        state["last_metrics"] = val_metrics
        names = getattr(state["metrics"], "names", None) or []
        lr = step_lr(state["opt"])
        step = state["step"] if self._record_step else None
        record = self.tally.record(state["epoch"], val_metrics, names, lr, step)
        state["record"] = record
        for cb in self.callbacks:  # declared, and no hook that could add them
            if cb.record_names and not _overrides(cb, "on_epoch_end"):
                self._add_to_record(cb, dict.fromkeys(cb.record_names))
        for cb, hook in self._hooks["on_epoch_end"]:
            self._call(cb, "on_epoch_end", hook, state)
            # A declared value not added this epoch is None (not computed):
            # every record of a fit has the same names, in the same order.
            missing = {n: None for n in cb.record_names if n not in record}
            if missing:
                self._add_to_record(cb, missing)
        self.history.append(state["record"])
        state["validate_now"] = False
        if mid_epoch:
            self.tally.start()  # the next record: the training from here on
        else:
            state["epoch"] += 1
        return state["stop_training"]

    def on_train_end(self, exception: BaseException | None) -> None:
        """Runs every callback's hook even if one fails, so all can clean up.

        A failure is raised after the others ran, unless training already
        failed: then it becomes a note on that exception, which propagates.
        """
        self._graph = None  # the last step's (see on_batch_end)
        swap_class_dims(self._outer_class_dims)
        failures, state = [], {**self.state, "exception": exception}
        for cb, hook in self._hooks["on_train_end"]:
            try:
                if hook(state):  # None or {}: nothing to apply
                    raise ValueError(_not_writable(cb, "on_train_end", None))
            except Exception as e:
                add_note(e, f"fitlib: raised in callback {cb.name}.on_train_end")
                failures.append(e)
        if failures and exception is None:
            raise failures[0]
        for e in failures:
            add_note(exception, f"fitlib: while ending, also: {e!r}")

    @contextmanager
    def deferred_interrupt(self) -> Iterator[None]:
        """Makes a first Ctrl-C stop training after the batch in progress.

        Stopping between batches means an optimizer step is never cut in half,
        so the model and optimizer stay usable; a second Ctrl-C interrupts at
        once. Only the main thread can own signals, elsewhere this does nothing.
        """
        previous = signal.getsignal(signal.SIGINT)
        own = (
            threading.current_thread() is threading.main_thread()
            and previous is signal.default_int_handler
        )

        def request_stop(signum: int, frame: Any) -> None:
            self.interrupted = True
            signal.signal(signal.SIGINT, signal.default_int_handler)
            print(
                "fitlib: stopping after this batch (Ctrl-C again to force).",
                file=sys.stderr,
            )

        if own:
            signal.signal(signal.SIGINT, request_stop)
        try:
            yield
            if self.interrupted:  # pressed after the last batch: still stop
                raise KeyboardInterrupt("training interrupted")
        finally:
            if own:
                signal.signal(signal.SIGINT, previous)
