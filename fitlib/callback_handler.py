"""``CallbackHandler``: keeps the training state and calls the callbacks'
hooks between the lines of the loop, checking what each hook returns
(``fitlib.callback`` holds what a callback author reads)."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

import fitlib.ranks as ranks
from fitlib.callback import (
    BATCH_EVENTS,
    EVENTS,
    STATE_KEYS,
    WRITABLE,
    Callback,
    Hook,
    bound_hook,
    initial_state,
    inner_callback,
    overrides,
)
from fitlib.checks import check_trainable
from fitlib.dispatch import receives
from fitlib.errors import add_note, and_others, did_you_mean, unknown_name
from fitlib.history import History
from fitlib.metrics.collection import Metrics
from fitlib.metrics.functions import class_dims_of, swap_class_dims
from fitlib.multi_optimizer import as_optimizer
from fitlib.record import EpochTally, Record, check_added, check_record_names, step_lr
from fitlib.running_loss import SMOOTH_BETA, batch_size, loss_count
from fitlib.sharding import unwrap
from fitlib.structure import map_tensors
from fitlib.time_budget import TimeBudget

_SWAPPABLE = frozenset(("model", "opt", "loss_func", "metrics"))
# Read only because the record is built from them before on_epoch_end.
_BUILT_INTO_RECORD = frozenset(("last_metrics",))


def _detached(x: Any) -> Any:
    return map_tensors(torch.Tensor.detach, x)


def callback_list(callbacks: Iterable[Any] | Callback | None) -> list[Callback]:
    """``callbacks`` as a checked list: None is none, one callback is a list of it.

    Examples:
        >>> from fitlib.callback_handler import callback_list
        >>> callback_list(Recorder())
        [Recorder(order=50)]
    """
    return _check_callbacks([] if callbacks is None else callbacks)


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


def _check_one_time_limit(callbacks: list[Callback]) -> None:
    """Refuses ``fit(max_time=...)`` beside a ``TimeLimit`` callback: two
    budgets, one of them silently the one that counts."""
    for cb in callbacks:
        if isinstance(getattr(inner_callback(cb), "budget", None), TimeBudget):
            raise ValueError(
                f"fit got max_time and the callback {cb!r}, two time limits. "
                "Fix: keep one: drop max_time, or the callback (max_time adds "
                "a TimeLimit's check)."
            )


def _same_hyper(a: str, b: str) -> bool:
    """Whether two ``sets_hypers`` names set one value: ``lr`` (every
    part's) and ``decoder.lr`` (one part's) do, two parts' ``lr`` do not."""
    attributes = ("model.", "loss_func.")  # a path: "loss_func.eps" is not "eps"
    if a.startswith(attributes) or b.startswith(attributes):
        return a == b
    part_a, _, hyper_a = a.rpartition(".")
    part_b, _, hyper_b = b.rpartition(".")
    return hyper_a == hyper_b and (part_a == part_b or not part_a or not part_b)


class CallbackHandler:
    """Keeps the training state and calls the callbacks' hooks in ``order``.

    Callbacks are sorted once (stably, lower ``order`` first). For each event
    the handler lists, once, the callbacks that override that hook, so an
    event nobody overrides costs one empty loop.

    ``fit`` makes one per run; to drive hooks around your own loop, call
    each event where ``fit`` does (docs/how-to/drive-the-loop-yourself.md has the whole
    loop). An event before ``on_train_begin``, or ``loss_batch`` before
    ``on_batch_begin``, is refused with the call that is missing; a hook that
    fails on a key ``on_train_begin`` was not given gets a note naming it.

    Examples:
        >>> handler = CallbackHandler([Recorder()])
        >>> loss_func = F.cross_entropy
        >>> handler.on_train_begin(1, model=model, opt=opt, data=data,
        ...                        loss_func=loss_func)
        >>> handler.on_epoch_begin()  # True: nothing (more) to train
        False
        >>> xb, yb = next(iter(data.train_dl))
        >>> xb, yb = handler.on_batch_begin(xb, yb)
        >>> handler.on_batch_end(loss_batch(model, xb, yb, loss_func, opt, handler))
        False
        >>> handler.on_epoch_end(validate(model, data.valid_dl, loss_func))
        False
        >>> handler.on_train_end(None)
    """

    def __init__(
        self, callbacks: Iterable[Callback] | None = None, max_time: Any = None
    ) -> None:
        cbs = callback_list(callbacks)
        # fit(max_time=...): the handler's own clock, as max_steps is its own.
        self.time_budget = None
        if max_time is not None:
            self.time_budget = TimeBudget(max_time, owner="fit")
            _check_one_time_limit(cbs)
        if not ranks.is_main():  # another rank of a distributed run: no side effects
            cbs = [cb for cb in cbs if not cb.main_only]
        self.callbacks = sorted(cbs, key=lambda cb: cb.order)
        _check_hyper_owners(self.callbacks)
        check_record_names(self.callbacks)
        self._hooks = {
            ev: [(cb, bound_hook(cb, ev)) for cb in self.callbacks if overrides(cb, ev)]
            for ev in EVENTS
        }
        # train=None until on_train_begin: the first batch event then sees a
        # new loader, where it checks that training was begun (not per batch).
        self.state: dict[str, Any] = initial_state()
        self._begun = False  # on_train_begin has run
        self._not_given: list[str] = []  # what on_train_begin was not given
        self._record_step = False  # records carry their step (see on_train_begin)
        # The class dims in force before on_train_begin (put back at its end).
        self._outer_class_dims: dict | None = None
        self.state["callbacks"] = list(self.callbacks)
        self.tally = self.state["tally"]
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
        unknown = sorted(map(str, update.keys() - STATE_KEYS.keys()))
        if unknown:
            more = and_others(unknown)
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
        if "stop_training" in update or "stop_reason" in update:
            update = _with_reason(cb, event, update, self.state)
        self.state.update(update)
        # skip_validate set during the batches: no validation at all (a NaN
        # loss), not even one asked for before it.
        skip = update.get("skip_validate") and event in BATCH_EVENTS
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
        self.state.update(stop_training=False, stop_reason=None, suspend=False)
        self.state["n_steps"] = max_steps
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
        if self.time_budget is not None:  # (after a Checkpoint's resume)
            self.time_budget.start(self.state["iteration"])

    def on_epoch_begin(self) -> bool:
        """Returns True when no epoch must start (``stop_training`` is set)."""
        self._check_begun("on_epoch_begin")
        # train=True: the epoch's training batches keep a num_batch that a
        # hook sets here (a checkpoint resuming part way through the epoch).
        self.state.update(num_batch=0, stop_epoch=False, skip_validate=False)
        self.state.update(train=True, validate_now=False, mid_epoch=False)
        if not (self.state["stop_training"] or self.state["suspend"]):
            self("on_epoch_begin")
        if self.state["num_batch"] == 0:  # not an epoch resumed part way
            self.tally.start()
        return self.state["stop_training"] or self.state["suspend"]

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
                # A stop's reason stands (a suspend's does not: this finishes).
                first = state["stop_reason"] if state["stop_training"] else None
                state["stop_training"] = True
                state["stop_reason"] = first or f"max_steps={budget} reached"
            if self.time_budget is not None:
                self._check_time()
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
            if cb.record_names and not overrides(cb, "on_epoch_end"):
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
        if self.time_budget is not None and not mid_epoch:
            self._check_time(epoch_end=True)
        if mid_epoch:
            self.tally.start()  # the next record: the training from here on
        else:
            state["epoch"] += 1
        return state["stop_training"]

    def _check_time(self, epoch_end: bool = False) -> None:
        """``fit(max_time=...)``: suspends once the budget is spent (unless
        training stops anyway), as a ``TimeLimit`` does."""
        state = self.state
        if state["stop_training"]:
            return
        reason = self.time_budget.spent(state["iteration"], epoch_end)
        if reason is not None:
            state["suspend"] = True
            state["stop_reason"] = state["stop_reason"] or reason

    def on_train_end(self, exception: BaseException | None) -> None:
        """Runs every callback's hook even if one fails, so all can clean up.

        A failure is raised after the others ran, unless training already
        failed: then it becomes a note on that exception, which propagates.
        """
        self._graph = None  # the last step's (see on_batch_end)
        if self.time_budget is not None:
            self.time_budget.stop()
        swap_class_dims(self._outer_class_dims)
        if isinstance(self.history, History):
            self.history.stop_reason = self.state.get("stop_reason")
            self.history.suspended = self._suspended()
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

    def _suspended(self) -> bool:
        """Whether the fit ends suspended (``suspend``): before its end, to be
        resumed, not finished by a stop or by reaching its epochs or steps."""
        state = self.state
        n_epochs, max_steps = state.get("n_epochs"), state.get("max_steps")
        reached = (n_epochs is not None and state.get("epoch", 0) >= n_epochs) or (
            max_steps is not None and state.get("step", 0) >= max_steps
        )
        return bool(state.get("suspend")) and not (reached or state["stop_training"])

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


def _with_reason(cb: Callback, event: str, update: dict, state: dict) -> dict:
    """``update`` with its ``stop_reason`` checked, or the callback's name as
    the reason of a ``stop_training`` that gives none. The first stop's
    reason stands (a later stop of the same batch does not replace it; a
    suspend's reason does not stand: a stop finishes the run instead), until
    a ``stop_training`` set False lets training go on: then there is none,
    unless the fit is suspended (``suspend`` has its own)."""
    given, reason = update.get("stop_reason"), state["stop_reason"]
    if given is not None and not isinstance(given, str):
        raise TypeError(
            f"{cb.name}.{event} returned stop_reason={given!r} "
            f"({type(given).__name__}); it is a str saying why training stops. "
            "Fix: e.g. {'stop_training': True, 'stop_reason': 'loss below 0.1'}."
        )
    if update.get("stop_training"):
        first = reason if state["stop_training"] else None  # not a suspend's
        return {
            **update,
            "stop_reason": first or given or f"{cb.name} stopped training",
        }
    goes_on = "stop_training" in update and not (
        state["suspend"] or update.get("suspend")
    )
    return {**update, "stop_reason": given if goes_on else reason or given}
