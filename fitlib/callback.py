"""What a callback author reads: ``Callback``, the events, the state keys
(``STATE_KEYS``, what each holds) and when a hook may return each
(``WRITABLE``), and ``call_hook`` to test a hook alone.

The handler (``fitlib.callback_handler.CallbackHandler``) keeps one state dict
and passes it to every hook as keyword arguments: a hook with ``**kwargs``
receives every key, a hook without receives only the keys it names. A hook
changes training by returning a dict of updates; later callbacks of the same
event see them. A key returned in an event after which nothing reads it is
refused with a ValueError, since the update would do nothing. The reference
shows ``STATE_KEYS`` and ``WRITABLE`` as tables (docs/reference/state.md),
generated from these two dicts.

``train_metrics``, ``callbacks``, ``n_epochs``, ``train``, ``smooth_loss``,
``last_loss_parts``, ``last_metrics``, ``tally`` and ``mid_epoch`` are read
only; ``on_train_end`` also receives ``exception`` (what ended training, or
``None``) and returns nothing. (``last_metrics``: the record is built before
``on_epoch_end``, so a changed list would reach only later callbacks; a value
of your own goes in the record, ``{"record": {"name": value}}``, declared in
``record_names``.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fitlib.checks import check_int
from fitlib.dispatch import hook_caller
from fitlib.errors import and_others, name_of, unknown_name
from fitlib.record import EpochTally

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

# The state a hook receives, key by key: the reference's state-key table is
# generated from this dict (the one place that defines the keys).
STATE_KEYS: dict[str, str] = {
    "model": "the ``nn.Module`` being trained",
    "opt": (
        "the optimizer (an ``HPOptimizer``, or a ``MultiOptimizer`` for several; "
        "a callback may swap it, as the model, the loss function and the metrics: "
        "see below)"
    ),
    "data": "the data object (``train_dl``, ``valid_dl``)",
    "loss_func": "the loss function, called as ``loss_func(out, *targets)``",
    "metrics": "the ``fitlib.metrics.Metrics`` of the run (``.names``)",
    "train_metrics": (
        "the ``Metrics`` computed over the training batches, each reported in the "
        "record as ``train_<name>``"
    ),
    "callbacks": (
        "the fit's callbacks, sorted by ``order`` (read only: a checkpoint saves "
        "and restores their ``state_dict``)"
    ),
    "n_epochs": (
        "the number of epochs ``fit`` was asked for (None: as many as "
        "``max_steps`` takes)"
    ),
    "max_steps": (
        "the step budget of the fit (``fit(max_steps=...)``), or None; training "
        "stops after that many optimizer steps"
    ),
    "n_steps": (
        "the number of optimizer steps the fit will take, when known: ``n_epochs "
        "* len(train_dl)``, at most ``max_steps``, or None for a loader without a "
        "length and no budget; callbacks that change it (gradient accumulation) "
        "update it in ``on_train_begin``, so schedulers (higher ``order``) read "
        "the true count"
    ),
    "epoch": "the current epoch, 0-based",
    "iteration": (
        "training batches finished since ``fit`` began (so, inside a batch's "
        "hooks, the 0-based index of that batch); a fit that begins with "
        "``iteration > 0`` is a resumed one"
    ),
    "step": (
        "optimizer steps done since ``fit`` began: the handler adds 1 after "
        "``on_step_end`` when the step ran (``skip_step`` False), so "
        "``on_batch_end`` counts this batch's step"
    ),
    "num_batch": "the 0-based index of the batch within the current loader",
    "train": "True for training batches, False for validation batches",
    "last_input": "the current batch's inputs, on the model's device",
    "last_target": "the current batch's targets, on the model's device",
    "last_output": (
        "the model's output for the current batch (detached in ``on_batch_end``)"
    ),
    "last_loss": (
        "the current batch's loss: the graph-carrying tensor from "
        "``on_backward_begin`` to ``on_step_end`` (an update made in "
        "``on_backward_begin`` is what ``backward()`` uses), then in "
        "``on_batch_end`` the detached loss of ``loss_func``"
    ),
    "smooth_loss": (
        "debiased exponential moving average of the training loss (beta 0.98) "
        "since ``fit`` began, a detached device tensor; kept only when a "
        "callback's hook receives it (names it or takes ``**kwargs``), else None: "
        "it costs a device op per batch (``LossSmoother`` averages floats the "
        "same way)"
    ),
    "last_loss_parts": (
        "the named parts of the current batch's loss, detached, when "
        "``loss_func`` returns a dict (``{'loss': total, 'ce': ..., 'box': "
        "...}``; ``last_loss`` is its ``'loss'``), else None"
    ),
    "last_metrics": (
        "``[valid_loss, *metric values]`` as device tensors after validation, "
        "``None`` when validation was skipped"
    ),
    "record": (
        "at ``on_epoch_end``, the epoch's record: a dict of python numbers, "
        "``epoch`` (and ``step``, the steps done, when a callback "
        "``validates_mid_epoch``), ``train_loss``, ``valid_loss``, each metric by "
        "name, ``train_<metric>``, the loss parts (``train_<part>``, "
        "``valid_<part>``), the values callbacks added, ``lr`` (of the last "
        "parameter group, as the epoch's last step used it) and ``time`` (the "
        "epoch's seconds, or since the previous record), in that order; None "
        "where a value was not computed (e.g. validation skipped). Read in one "
        "host transfer. A callback adds values by returning ``{'record': {'name': "
        "value}}`` from ``on_epoch_end`` (a number or one-element tensor; the "
        "name declared in its ``record_names``, and new): later callbacks (higher "
        "``order``: monitors, the Recorder, loggers, the bar) see them. It stays "
        "the last epoch's record until the next epoch ends"
    ),
    "tally": (
        "the ``fitlib.record.EpochTally`` behind the record: the epoch's running "
        "sums (read only; ``Checkpoint`` saves it)"
    ),
    "stop_epoch": (
        "set True to end the current loader after this batch: the epoch's "
        "training, or its validation"
    ),
    "stop_training": (
        "set True to end training: after this training batch (the epoch's "
        "validation still runs unless ``skip_validate``), after this epoch, or, "
        "set in ``on_train_begin`` or ``on_epoch_begin``, before the next epoch "
        "starts"
    ),
    "stop_reason": (
        "why training stops, a str, set with ``stop_training`` (e.g. "
        "``{'stop_training': True, 'stop_reason': 'valid_loss reached 0.1'}``); "
        "a callback that sets ``stop_training`` without one gets "
        "``'<callback> stopped training'``, ``max_steps`` gives "
        "``'max_steps=<n> reached'``. None while training goes on; the fit's "
        "``History.stop_reason`` holds the last one"
    ),
    "suspend": (
        "set True (with a ``stop_reason``) to end the fit before its end, to be "
        "resumed later (a time limit): after this training batch, or, if it is "
        "inside a gradient group (``skip_step``) or asked for a validation "
        "(``validate_now``), after the first batch that is neither (a stop "
        "in the same batch, ``stop_training`` or ``max_steps``, comes first and "
        "finishes the run, with its reason); no "
        "validation and no record for the partial epoch. Set at "
        "``on_epoch_end`` (or in validation), before the next epoch. A "
        "``Checkpoint`` then writes a checkpoint to resume from, not one marked "
        "finished, so the next run goes on from there exactly"
    ),
    "step_fn": (
        "None, or what runs a training batch's step in place of ``fitlib.core."
        "train_step`` (same arguments; ``CudaGraph``'s replays a CUDA graph)"
    ),
    "skip_bwd": "set True in ``on_backward_begin`` to skip ``backward()``",
    "skip_step": "set True by ``on_backward_end`` to skip ``opt.step()``",
    "skip_zero": "set True by ``on_step_end`` to keep the gradients",
    "skip_validate": (
        "set True before ``on_epoch_end`` to skip the validation at the epoch's "
        "end (set in a batch event, it also cancels a ``validate_now`` asked for "
        "before)"
    ),
    "validate_now": (
        "set True in a training batch's events to validate before the next batch: "
        "the validation ends a record (``on_epoch_end`` with ``mid_epoch`` True) "
        "and training goes on, in train mode, in the same epoch; after the "
        "epoch's last batch, it is the epoch's validation (even with "
        "``skip_validate``)"
    ),
    "mid_epoch": (
        "at ``on_epoch_end``: True when the record ends at a validation inside "
        "the epoch (``validate_now``; the epoch goes on, ``epoch`` stays, "
        "``num_batch`` counts its training batches so far), False at the epoch's "
        "end"
    ),
}

BATCH_EVENTS = EVENTS[2:8]  # on_batch_begin ... on_batch_end
_FIT_EVENTS = EVENTS[:-1]  # all but on_train_end, after which nothing reads
# The events after which the loop (or a later callback) reads each key a hook
# may return; the other keys are read only (the loop owns them). The loop
# reads model, opt and loss_func as each training batch starts (after
# on_batch_begin), metrics at each validation: a swap takes effect from there.
_SWAP_EVENTS = ("on_train_begin", "on_epoch_begin", "on_batch_begin",
                "on_batch_end", "on_epoch_end")  # fmt: skip
WRITABLE: dict[str, tuple[str, ...]] = {
    "model": _SWAP_EVENTS,  # wrapped (DDP) before training, or another model
    "opt": _SWAP_EVENTS,
    "loss_func": _SWAP_EVENTS,
    "metrics": _SWAP_EVENTS,  # with the same names (the record's columns)
    "data": _FIT_EVENTS,  # train_dl is read at each epoch, valid_dl after it
    "n_steps": ("on_train_begin",),
    "step_fn": ("on_train_begin",),  # (read at each training batch)
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
    "stop_epoch": BATCH_EVENTS,
    "stop_training": _FIT_EVENTS,
    "stop_reason": _FIT_EVENTS,
    "suspend": ("on_epoch_begin", *BATCH_EVENTS, "on_epoch_end"),
    "skip_bwd": EVENTS[2:5],  # up to on_backward_begin
    "skip_step": EVENTS[2:6],  # up to on_backward_end
    "skip_zero": EVENTS[2:7],  # up to on_step_end
    "skip_validate": ("on_epoch_begin", *BATCH_EVENTS),
    "validate_now": BATCH_EVENTS,  # read before the next batch
}


class Callback:
    """Base class: override the hooks you need; the others cost nothing.

    A hook names the state keys it reads as parameters and may return a dict
    of updates to the state (see the module docstring for the keys). With
    ``**kwargs`` it receives every key; without, only those it names, which is
    faster: Python matches each keyword passed against the parameter names.

    Examples:
        >>> class StopAfter(Callback):
        ...     def __init__(self, n):
        ...         self.n = n
        ...     def on_batch_end(self, iteration):
        ...         if iteration + 1 >= self.n:
        ...             return {"stop_training": True}
        >>> fit(5, model, F.cross_entropy, opt, data, callbacks=[StopAfter(3)])
        History(1 epoch: train_loss ..., valid_loss ...)
    """

    order: int = 0
    # Whether Learner.lr_find's sweep runs it: yes for what shapes a step
    # (precision, accumulation, clipping); no for checkpoints, loggers, stoppers.
    in_lr_find: bool = True
    # Whether the Learner's evaluation (validate, get_preds, predict) runs it
    # too: yes for what shapes the forward pass (precision, memory format,
    # compilation); its on_train_begin then gets opt=None (no step).
    in_evaluation: bool = False
    # Whether Compile(step=True) may compile the step with this callback's
    # on_backward_begin/end around it (True: they read nothing on the host).
    compiled_step_safe: bool | None = None
    # Whether CudaGraph may capture its on_loss_begin/on_backward_begin/end.
    cuda_graph_safe: bool | None = None
    # The hyper-parameters it sets outright at every step (a schedule): two
    # callbacks of one fit may not share one (the later would overwrite the
    # earlier); one that adjusts a value (ReduceLROnPlateau) lists nothing.
    sets_hypers: tuple[str, ...] = ()
    # The names of the values this callback adds to the record ({"record":
    # {...}} from on_epoch_end): declared, so monitors check names before
    # training and a typo cannot add a column silently.
    record_names: tuple[str, ...] = ()
    # Side effects only (bars, logs, files): under torch.distributed rank 0 only.
    main_only: bool = False
    # Asks for validations inside epochs (validate_now): every record then has
    # its ``step``, which tells an epoch's records apart.
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
        """Runs at each training batch after ``backward()``, before the step."""

    def on_step_end(self, **kwargs: Any) -> dict | None:
        """Runs at every training batch, after the step or its skip (``skip_step``)."""

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

    @classmethod
    def from_hooks(
        cls,
        *positional: Any,
        order: int = 0,
        name: str | None = None,
        record_names: tuple[str, ...] = (),
        **hooks: Callable[..., Any],
    ) -> Callback:
        """A callback whose hooks are the functions given, by event name.

        Each function is a hook without ``self``: it names the state keys it
        reads (``lambda epoch, record: ...``; ``**kwargs`` for all) and may
        return a dict of updates, as a class's hook does. The same checks
        apply, when it is made: an unknown event name (with "did you mean"),
        a value that is not callable, a parameter that no state key matches.
        Each call makes its own class, which defines only the hooks given, so
        the events it leaves out cost nothing.

        It keeps no state: ``state_dict()`` is ``{}``. What a function keeps
        elsewhere (a closure's counter, a global list) is not saved by a
        checkpoint and starts over on a resume; a callback that counts or
        remembers is a class with ``state_dict``/``load_state_dict``.

        Args:
            order: where it runs among the fit's callbacks (default 0, with
                the user callbacks: before the monitors, the Recorder, the
                loggers and the bar read the record).
            name: its name in messages and in the callbacks' listing; default
                ``from_hooks(<events>)``.
            record_names: the names of the values ``on_epoch_end`` adds to the
                record (``{"record": {"name": value}}``), as a class declares.
            **hooks: ``on_train_begin`` ... ``on_train_end``: a function each.
            *positional: refused (a ``TypeError`` with the fix): a function
                is given by its event's name, ``on_epoch_end=...``.

        Examples:
            >>> show = Callback.from_hooks(
            ...     on_epoch_end=lambda epoch, record: print(epoch, "lr", record["lr"]))
            >>> show
            Callback.from_hooks(on_epoch_end=<lambda>, order=0)
            >>> history = fit(2, model, F.cross_entropy, opt, data, callbacks=[show])
            0 lr 0.1
            1 lr 0.1
            >>> stop = Callback.from_hooks(  # a dict to stop, None to go on
            ...     on_batch_end=lambda step: {"stop_training": True} if step >= 3
            ...     else None, name="stop_at_3")
            >>> fit(5, model, F.cross_entropy, opt, data, callbacks=[stop]).stop_reason
            'stop_at_3 stopped training'
        """
        if positional:
            raise TypeError(
                f"{cls.__name__}.from_hooks: hooks are passed by event name, so "
                f"the callback knows when to run each; got {len(positional)} "
                f"function{'s' * (len(positional) > 1)} passed positionally. Fix: e.g. "
                f"{cls.__name__}.from_hooks(on_epoch_end=lambda record: ...)."
            )
        return _from_hooks(cls, order, name, record_names, hooks)


Hook = Callable[[dict], Any]


def overrides(cb: Callback, event: str) -> bool:
    """Whether ``cb``'s class overrides the hook of ``event``."""
    return getattr(type(cb), event) is not getattr(Callback, event)


def call_hook(cb: Callback, event: str, **state: Any) -> dict | None:
    """Calls ``cb``'s hook for ``event`` as the handler would; for tests.

    The hook gets the state a new handler starts with, updated with ``state``
    (plus ``exception`` for ``on_train_end``), and its return value comes back.

    Examples:
        >>> from fitlib.callback import call_hook
        >>> class Halve(Callback):
        ...     def on_backward_begin(self, last_loss, **kwargs):
        ...         return {"last_loss": last_loss / 2}
        >>> call_hook(Halve(), "on_backward_begin", last_loss=torch.tensor(3.0))
        {'last_loss': tensor(1.5000)}
    """
    if event not in EVENTS:
        raise ValueError(
            unknown_name("call_hook", "event", event, EVENTS, "pass one of them.")
        )
    extra = {"exception": None} if event == "on_train_end" else {}
    unknown = sorted(state.keys() - STATE_KEYS.keys() - extra.keys())
    if unknown == ["exception"]:
        raise ValueError(
            "call_hook: unknown state key 'exception' (only on_train_end gets "
            f"exception). Fix: pass state keys among {', '.join(STATE_KEYS)}."
        )
    if unknown:
        fix = f"pass state keys among them{and_others(unknown)}."
        raise ValueError(
            unknown_name("call_hook", "state key", unknown[0], STATE_KEYS, fix)
        )
    base = initial_state() | {"train": False}  # as after on_train_begin
    return bound_hook(cb, event)(base | extra | state)


def initial_state() -> dict[str, Any]:
    """The state a new handler starts with: every key None but the counters
    (0), ``train`` (None until ``on_train_begin``), the flags (False), no
    callbacks and an empty ``EpochTally``."""
    state: dict[str, Any] = dict.fromkeys(STATE_KEYS)
    state.update(epoch=0, iteration=0, step=0, num_batch=0, train=None)
    state.update(validate_now=False, mid_epoch=False, callbacks=[])
    state["tally"] = EpochTally()
    return state


def bound_hook(cb: Callback, event: str) -> Hook:
    """``cb``'s hook for ``event`` as a function of the state dict: it passes
    the keys the hook names (all of them to ``**kwargs``)."""
    return hook_caller(getattr(cb, event), f"{cb.name}.{event}", hook_keys(event))


def hook_keys(event: str) -> tuple[str, ...]:
    """The keys a hook of ``event`` may receive: the state keys, and
    ``exception`` for ``on_train_end``."""
    return (*STATE_KEYS, *(("exception",) if event == "on_train_end" else ()))


def _from_hooks(
    base: type[Callback], order: Any, name: Any, record_names: Any, hooks: dict
) -> Callback:
    """``Callback.from_hooks``: checks, then a class per call with the hooks."""
    owner = f"{base.__name__}.from_hooks"
    if not hooks:
        raise TypeError(
            f"{owner}: no hook given, so the callback would do nothing. Fix: "
            "pass a function per event, e.g. "
            f"{owner}(on_epoch_end=lambda epoch, record: print(epoch, record))."
        )
    for event, fn in hooks.items():
        if event not in EVENTS:
            fix = "name each function after the event it runs at."
            raise TypeError(unknown_name(owner, "hook", event, EVENTS, fix))
        if not callable(fn):
            raise TypeError(
                f"{owner}: {event}={fn!r} is not callable; a hook is a function "
                f"of the state keys it names. Fix: e.g. {event}=lambda epoch: "
                "print(epoch)."
            )
    order = check_int(order, "order", minimum=-1000, owner=owner, example=0)
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise TypeError(
            f"{owner}: name must be a non-empty str or None; got {name!r}. "
            f"Fix: e.g. {owner}(..., name='log_epochs')."
        )
    label = name or f"from_hooks({', '.join(hooks)})"
    shown = [f"{ev}={name_of(fn)}" for ev, fn in hooks.items()]
    shown.append(f"name={name!r}" if name else f"order={order}")
    attrs: dict[str, Any] = {ev: staticmethod(fn) for ev, fn in hooks.items()}
    if isinstance(record_names, list):  # (check_record_names refuses a bad one)
        record_names = tuple(record_names)
    attrs.update(
        order=order,
        record_names=record_names,
        name=property(lambda self: label, doc="Its name, in messages and tables."),
        __repr__=lambda self: f"{owner}({', '.join(shown)})",
        __module__=base.__module__,
    )
    cb = type("FromHooks", (base,), attrs)()
    for event in hooks:  # a parameter no state key matches: refused now
        bound_hook(cb, event)
    return cb


def inner_callback(cb: Callback) -> Callback:
    """The callback a filter (``every``, ``once``) wraps, or ``cb`` itself:
    whose attributes (``sets_hypers``, ``in_lr_find``, ...) say what it does."""
    return getattr(cb, "callback", cb)
