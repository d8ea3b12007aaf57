"""Filters: run a callback's hooks every n steps or epochs, once, the first
time, or when a condition on the state holds.

``every(cb, 100)`` is a callback that forwards ``cb``'s hooks only on every
100th optimizer step, so ``cb`` need not count for itself. What a filter
lets through:

- ``unit="steps"``: the training-batch hooks (``on_batch_begin`` to
  ``on_batch_end``) run on the batches of a matching optimizer step (the
  ``step`` state key, counted from 1). Without gradient accumulation that is
  one batch per step; with ``GradientAccumulation(k)`` it is the k batches
  whose gradients that step uses (``skip_step`` is False in ``on_batch_end``
  on the one that stepped). Epoch hooks and validation batches always run.
- ``unit="epochs"``: the hooks of a matching epoch (counted from 1: epoch 1
  is the state's ``epoch == 0``) run: ``on_epoch_begin``, its training and
  validation batches, ``on_epoch_end``; other epochs run none.
- ``first(cb)``: each hook runs the first time its event fires in a fit.

With validations inside epochs (``ValidationSchedule(every_n_steps=...)``)
``on_epoch_end`` fires at each record: a matching epoch's filter lets each of
its records through, and ``first`` the first record, which may end at a
validation inside the first epoch.
- ``every(cb, when=predicate)``: each hook runs when ``predicate`` returns
  True. The predicate names the state keys it reads, as a hook does
  (``when=lambda epoch: epoch >= 5``, ``when=lambda train, step: ...``;
  ``**kwargs`` for all), and is called at every hook call of ``cb`` (all
  but ``on_train_begin`` and ``on_train_end``), with the state of that
  event: what it reads must say the same for each hook of a batch or an
  epoch if they are to run together (``step`` counts a batch's own step
  from ``on_batch_end`` on; ``epoch`` is the same for an epoch's hooks).
  It runs per event, so it must be cheap and read no device value (a
  tensor in a condition waits for the device at every step): it returns
  a Python bool, and a tensor is refused. It keeps no state of its own;
  a predicate that reads only what every rank shares (the counters, the
  record) decides alike on every rank.
- ``on_train_begin`` and ``on_train_end`` always run, so the wrapped callback
  can set up and clean up.

The counts come from the state, so a resumed fit continues them exactly.

Speed: the handler calls only the hooks a callback's class overrides, so a
filter's class is made for the callback it wraps and defines just the hooks
that callback overrides (plus ``on_train_begin``). A hook that does not run
costs a few hundred nanoseconds: a call, a count and a comparison.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from fitlib.callback import EVENTS, Callback, hook_keys, overrides
from fitlib.checks import check_flag, check_int
from fitlib.dispatch import hook_caller
from fitlib.errors import name_of

UNITS = ("steps", "epochs")
# What a filter's hooks receive first: what it counts with, and what resets it.
_GATE_KEYS = ("train", "step", "skip_step", "epoch", "iteration")
_EPOCH_EVENTS = frozenset({"on_epoch_begin", "on_epoch_end"})
_ALWAYS = frozenset({"on_train_begin", "on_train_end"})


class Filter(Callback):
    """Base class of the filters: forwards the wrapped callback's hooks.

    Build one with ``every``, ``once`` or ``first``: they make a subclass per
    wrapped callback with only the hooks it overrides. The filter has the
    wrapped callback's ``order``; its ``state_dict`` holds its own counter
    and the wrapped callback's state. A fit that starts at ``iteration == 0``
    resets the counter; a resumed one keeps what ``load_state_dict`` restored.

    Attributes:
        callback: the wrapped callback.
        calls: the calls of filtered hooks that it let through in this fit
            (the hooks that always run are not counted).

    Examples:
        >>> log = every(Recorder(), n=100, unit="steps")
        >>> log.name
        'every(100 steps, Recorder)'
        >>> log.order, log.callback
        (50, Recorder(order=50))
    """

    def __init__(self, callback: Callback, unit: str | None = None) -> None:
        self.callback, self.unit = callback, unit
        self.calls = 0

    @property
    def order(self) -> int:
        """The wrapped callback's order: the filter runs where it would."""
        return self.callback.order

    def _selects(self, count: int, event: str) -> bool:
        """Whether a hook call of step or epoch ``count`` (from 1) runs."""
        raise NotImplementedError

    def _reset(self) -> None:
        self.calls = 0

    def _own_state(self) -> dict:
        return {"calls": self.calls}

    def _load_own_state(self, state: dict) -> None:
        self.calls = int(state["calls"])

    def state_dict(self) -> dict:
        """The filter's counter and the wrapped callback's state."""
        return {"filter": self._own_state(), "callback": self.callback.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restores what ``state_dict`` returned."""
        expected = set(self._own_state())
        ok = isinstance(state, dict) and set(state) == {"filter", "callback"}
        if not ok or not isinstance(state["filter"], dict):
            ok = False
        if not ok or set(state["filter"]) != expected:
            raise ValueError(
                f"{self.name}.load_state_dict: expected {{'filter': {{keys "
                f"{sorted(expected)}}}, 'callback': ...}}; got {state!r}. Fix: "
                f"pass what {self.name}.state_dict() returned."
            )
        self._load_own_state(state["filter"])
        self.callback.load_state_dict(state["callback"])


class _Every(Filter):
    def __init__(self, callback: Callback, unit: str, n: int) -> None:
        super().__init__(callback, unit)
        self.n = n

    @property
    def name(self) -> str:
        return f"every({self.n} {self.unit}, {self.callback.name})"

    def _selects(self, count: int, event: str) -> bool:
        return count % self.n == 0

    def __repr__(self) -> str:
        return f"every({self.callback!r}, n={self.n}, unit={self.unit!r})"


class _Once(Filter):
    def __init__(self, callback: Callback, unit: str, at: int) -> None:
        super().__init__(callback, unit)
        self.at = at

    @property
    def name(self) -> str:
        return f"once({self.unit[:-1]} {self.at}, {self.callback.name})"

    def _selects(self, count: int, event: str) -> bool:
        return count == self.at

    def __repr__(self) -> str:
        return f"once({self.callback!r}, at={self.at}, unit={self.unit!r})"


class _First(Filter):
    def __init__(self, callback: Callback, unit: None = None) -> None:
        super().__init__(callback, unit)
        self.done: set[str] = set()

    @property
    def name(self) -> str:
        return f"first({self.callback.name})"

    def _selects(self, count: int, event: str) -> bool:
        if event in self.done:
            return False
        self.done.add(event)
        return True

    def _reset(self) -> None:
        super()._reset()
        self.done = set()

    def _own_state(self) -> dict:
        return {"calls": self.calls, "done": sorted(self.done)}

    def _load_own_state(self, state: dict) -> None:
        super()._load_own_state(state)
        self.done = {str(e) for e in state["done"]}

    def __repr__(self) -> str:
        return f"first({self.callback!r})"


class _When(Filter):
    def __init__(self, callback: Callback, unit: None, when: Callable) -> None:
        super().__init__(callback, unit)
        self.when = when

    @property
    def name(self) -> str:
        return f"every(when {name_of(self.when)}, {self.callback.name})"

    def _admit(self, verdict: Any) -> bool:
        """The predicate's verdict, checked: a bool (a tensor would sync)."""
        if verdict is True or verdict is False:
            return verdict
        if isinstance(verdict, torch.Tensor):
            raise TypeError(
                f"{self.name}: when returned a Tensor ({verdict!r}); reading it "
                "in a condition copies it to the host and waits for the device "
                "at every event. Fix: decide from the counters (step, epoch, "
                "iteration) or the record (on_epoch_end), which are Python "
                "values; leave device values to the wrapped callback."
            )
        fix = "when=lambda step: step % 100 == 0"
        return check_flag(verdict, "the value when returns", self.name, fix)

    def __repr__(self) -> str:
        return f"every({self.callback!r}, when={name_of(self.when)})"


# -- the public builders ---------------------------------------------------------
def every(
    callback: Callback,
    n: int | None = None,
    unit: str | None = None,
    *,
    when: Callable[..., bool] | None = None,
) -> Filter:
    """``callback``'s hooks run on every ``n``-th step or epoch (n, 2n, ...),
    or where ``when`` says.

    Args:
        callback: the callback to filter.
        n: the interval (>= 1), counted from the start of the fit.
        unit: ``"steps"`` (optimizer steps, the default) or ``"epochs"``;
            with ``n`` only.
        when: instead of ``n``, a predicate of the state keys it names
            (``lambda epoch: epoch >= 5``), asked at each hook call of
            ``callback`` but ``on_train_begin``/``on_train_end``; it returns
            a Python bool and reads no device value (see the module
            docstring).

    Examples:
        >>> class PrintStep(Callback):
        ...     def on_step_end(self, step, **kwargs):
        ...         print("steps done:", step + 1)  # the state's step counts from 0
        >>> history = fit(3, model, F.cross_entropy, opt, data,
        ...               callbacks=[every(PrintStep(), 5)])
        steps done: 5
        steps done: 10
        >>> class PrintRecord(Callback):
        ...     def on_epoch_end(self, epoch, record):
        ...         print("epoch", epoch, "valid_loss", record["valid_loss"])
        >>> late = every(PrintRecord(), when=lambda epoch: epoch >= 2)
        >>> history = fit(3, model, F.cross_entropy, opt, data, callbacks=[late])
        epoch 2 valid_loss ...
    """
    if when is not None or n is None:
        return _build_when(callback, n, unit, when)
    unit = "steps" if unit is None else unit
    _check("every", callback, unit, "n", n)
    return _build(_Every, callback, unit, n)


def once(callback: Callback, at: int, unit: str = "steps") -> Filter:
    """``callback``'s hooks run only on step (or epoch) ``at`` of each fit.

    Args:
        callback: the callback to filter.
        at: the step or epoch, counted from 1 (``at=1``: the first).
        unit: ``"steps"`` (optimizer steps) or ``"epochs"``.

    Examples:
        >>> class SaveModel(Callback):
        ...     def __init__(self, path):
        ...         self.path = path
        ...     def on_step_end(self, model, step, **kwargs):
        ...         torch.save(model.state_dict(), self.path)
        ...         print("saved", self.path, "after step", step + 1)
        >>> snapshot = once(SaveModel("warm.pth"), at=6, unit="steps")
        >>> history = fit(3, model, F.cross_entropy, opt, data, callbacks=[snapshot])
        saved warm.pth after step 6
    """
    _check("once", callback, unit, "at", at)
    return _build(_Once, callback, unit, at)


def first(callback: Callback) -> Filter:
    """Each of ``callback``'s hooks runs only the first time its event fires.

    Per fit: ``on_batch_end`` on the first training batch, ``on_epoch_end``
    at the first record (the first epoch's end, or a validation inside it),
    and so on (``on_train_begin`` and ``on_train_end``
    always run).

    Examples:
        >>> class ShowBatch(Callback):
        ...     def on_batch_begin(self, last_input, last_target, **kwargs):
        ...         print(tuple(last_input.shape), tuple(last_target.shape))
        >>> show = first(ShowBatch())  # prints the first batch, then nothing
        >>> history = fit(2, model, F.cross_entropy, opt, data, callbacks=[show])
        (16, 8) (16,)
    """
    _check("first", callback)
    return _build(_First, callback, None)


# -- the filter's class, made per wrapped callback -------------------------------
def _build(
    kind: type[Filter], callback: Callback, unit: str | None, *args: Any
) -> Filter:
    """An instance of a subclass of ``kind`` with the hooks ``callback`` has."""
    hooks = {
        event: _hook(
            event, getattr(callback, event), _counter(unit, event), callback.name
        )
        for event in EVENTS
        if overrides(callback, event)
    }
    if "on_train_begin" not in hooks:  # the filter resets there
        always = _counter(None, "on_train_begin")
        hooks["on_train_begin"] = _hook("on_train_begin", None, always, "")
    name = f"{kind.__name__[1:]}[{type(callback).__name__}]"
    return type(name, (kind,), hooks)(callback, unit, *args)


def _counter(unit: str | None, event: str) -> Callable:
    """The 1-based step or epoch of a hook call; None: the call is not filtered."""
    if event in _ALWAYS:
        return lambda train, step, skip_step, epoch: None
    if unit is None:  # first(): by event, not by count
        return lambda train, step, skip_step, epoch: 0
    if unit == "epochs":  # the handler counts an epoch after its on_epoch_end
        return lambda train, step, skip_step, epoch: epoch + 1
    if event in _EPOCH_EVENTS:
        return lambda train, step, skip_step, epoch: None
    if event == "on_batch_end":
        # `step` already counts the batch's own step here, if it ran.
        return lambda train, step, skip_step, epoch: (
            (step + 1 if skip_step else step) if train else None
        )
    return lambda train, step, skip_step, epoch: step + 1 if train else None


def _hook(event: str, hook: Callable | None, counter: Callable, owner: str) -> Callable:
    """A filter's hook: counts, selects, then forwards to ``hook``.

    It receives the keys the count needs, then those ``hook`` needs (every
    key, for ``**kwargs``), by position: this is the hot path.
    """
    call = None if hook is None else _call(f"{owner}.{event}", hook, event)
    keys = _GATE_KEYS + (() if hook is None else _keys(hook, event, _GATE_KEYS))
    begin = event == "on_train_begin"

    def forward(self, train, step, skip_step, epoch, iteration, *rest):
        if begin and iteration == 0:  # a new fit; a resumed one keeps its state
            self._reset()
        count = counter(train, step, skip_step, epoch)
        if count is not None:
            if not self._selects(count, event):
                return None
            self.calls += 1
        if call is None:
            return None
        return call(dict(zip(keys, (train, step, skip_step, epoch, iteration, *rest))))

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter(k, kind) for k in ("self", *keys)]
    forward.__signature__ = inspect.Signature(params)
    return forward


def _call(where: str, hook: Callable, event: str) -> Callable[[dict], Any]:
    # Built now, so a hook with parameters no key matches fails at wrap time.
    return hook_caller(hook, where, hook_keys(event))


# -- every(cb, when=...): a predicate instead of a count ---------------------------
def _build_when(callback: Any, n: Any, unit: Any, when: Any) -> Filter:
    """An instance of a subclass of ``_When`` with the hooks ``callback`` has."""
    _check_when(callback, n, unit, when)
    events = [e for e in EVENTS if overrides(callback, e)]
    hooks = {
        e: _when_hook(e, getattr(callback, e), when, callback.name) for e in events
    }
    if "on_train_begin" not in hooks:  # the filter resets there
        hooks["on_train_begin"] = _when_hook("on_train_begin", None, when, "")
    name = f"When[{type(callback).__name__}]"
    return type(name, (_When,), hooks)(callback, None, when)


def _when_hook(event: str, hook: Callable | None, when: Callable, owner: str) -> Any:
    """A hook of ``every(cb, when=...)``: asks ``when``, then forwards to
    ``hook``; it receives the keys both name, by position."""
    call = None if hook is None else _call(f"{owner}.{event}", hook, event)
    gated, begin = event not in _ALWAYS, event == "on_train_begin"
    test = _when_caller(when, event) if gated else None
    gate = _keys(when, event, ()) if gated else ("iteration",) if begin else ()
    keys = gate + (() if hook is None else _keys(hook, event, gate))

    def forward(self, *values):
        state = dict(zip(keys, values))
        if begin and state["iteration"] == 0:  # a new fit; a resumed one keeps
            self._reset()
        if gated:
            if not self._admit(test(state)):
                return None
            self.calls += 1
        return None if call is None else call(state)

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter(k, kind) for k in ("self", *keys)]
    forward.__signature__ = inspect.Signature(params)
    return forward


def _when_caller(when: Callable, event: str) -> Callable[[dict], Any]:
    try:
        return hook_caller(when, "every.when", hook_keys(event))
    except TypeError as e:
        raise TypeError(
            f"{e} The predicate names the keys it reads, as a hook does "
            "(when=lambda epoch: epoch >= 5), rather than taking the state as "
            "one argument."
        ) from None


def _keys(hook: Callable, event: str, skip: tuple) -> tuple[str, ...]:
    """The state keys ``hook`` receives (all for ``**kwargs``), minus ``skip``."""
    try:
        params = inspect.signature(hook).parameters.values()
    except (TypeError, ValueError):  # no signature: hook_caller passes all
        params = [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        names = hook_keys(event)
    else:
        names = tuple(p.name for p in params if p.name in hook_keys(event))
    return tuple(k for k in names if k not in skip)


# -- checks ----------------------------------------------------------------------
def _check_when(callback: Any, n: Any, unit: Any, when: Any) -> None:
    _check("every", callback)
    if when is None:
        raise TypeError(
            "every: pass n (every n steps or epochs) or when (a predicate of "
            "the state); got neither. Fix: e.g. every(cb, 100), every(cb, 2, "
            "unit='epochs') or every(cb, when=lambda epoch: epoch >= 5)."
        )
    if n is not None:
        raise TypeError(
            f"every: pass n or when, not both; got n={n!r} and "
            f"when={name_of(when)}. Fix: every(cb, n) counts steps or epochs; "
            "every(cb, when=...) decides from the state alone (a count goes in "
            "the predicate: when=lambda step: step % 100 == 0)."
        )
    if unit is not None:
        raise TypeError(
            f"every: unit applies to n (every n steps or epochs); got "
            f"unit={unit!r} with when={name_of(when)}, which decides from the "
            "state alone. Fix: drop unit; read step or epoch in the predicate."
        )
    if not callable(when):
        raise TypeError(
            f"every: when must be callable; got {when!r} "
            f"({type(when).__name__}). Fix: e.g. when=lambda epoch: epoch >= 5."
        )


def _check(
    builder: str, callback: Any, unit: Any = "steps", name: str = "", count: Any = 1
) -> None:
    if isinstance(callback, type) and issubclass(callback, Callback):
        raise TypeError(
            f"{builder}: got the class {callback.__name__}, not an instance. "
            f"Fix: {builder}({callback.__name__}(), ...)."
        )
    if not isinstance(callback, Callback):
        raise TypeError(
            f"{builder}: callback must be a fitlib.Callback; got {callback!r} "
            f"(type {type(callback).__name__}). Fix: pass a Callback instance, "
            f"e.g. {builder}(Recorder(), ...)."
        )
    check_int(count, name, minimum=1, owner=builder, example=100)
    if unit not in UNITS:
        raise ValueError(
            f"{builder}: unit must be one of {UNITS}; got {unit!r}. Fix: "
            "unit='steps' (optimizer steps) or unit='epochs'."
        )
