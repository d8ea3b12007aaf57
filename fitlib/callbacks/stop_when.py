"""``StopWhen``: stop training when a condition on the epoch's record holds.

A stopping rule without writing a class: ``StopWhen(lambda record:
record["valid_loss"] < 0.05)``. The condition gets a copy of the record
(python numbers, read once per epoch in one host transfer), so it adds no
sync. Under torch.distributed every rank has the same record, so a
condition of the record alone decides the same way on every rank; one that
reads something of its own rank (a clock, a random number) would let the
ranks part and hang: keep it to the record.
"""

from __future__ import annotations

import inspect
import linecache
import math
from collections.abc import Callable
from typing import Any

import numpy as np

import fitlib.ranks as ranks
from fitlib.callback import Callback
from fitlib.errors import did_you_mean
from fitlib.monitor import Monitor

_EXAMPLE = "StopWhen(lambda record: record['valid_loss'] < 0.05)"
# The stand-in records' values: every comparison False, then each way True,
# so the names after an ``and`` or an ``or`` are read too.
_PROBES = (math.nan, math.inf, -math.inf)


class StopWhen(Callback):
    """Stops training after the first record for which ``condition`` is true.

    ``condition`` takes one argument, the record ``on_epoch_end`` gets (a
    dict of python numbers: ``epoch``, ``train_loss``, ``valid_loss``, the
    metrics, the values callbacks add, ``lr``, ``time``; ``step`` with
    validations inside epochs, each of which is a record judged too), and
    returns True or False. It runs after your callbacks (order 45, as
    ``EarlyStopping``), so it sees the values they add.

    A value not computed for a record is None there (validation skipped):
    a condition that reads one with ``record[name]`` is not judged on that
    record, and training goes on (as ``EarlyStopping`` does not count it);
    ``record.get(name)`` gives the None to a condition that wants it.

    A name the records will not have is refused before training, as a
    monitor's typo is: ``on_train_begin`` calls the condition on stand-in
    records (the names known before training, as ``Monitor`` knows them:
    ``epoch``, ``step`` with validations inside epochs, the losses, the
    metrics, ``train_<metric>``, the loss's ``part_names``, the callbacks'
    ``record_names``, ``lr``, ``time``; every value NaN, then ``inf``, then
    ``-inf``, so both sides of an ``and`` are read), and a ``record[name]``
    outside them raises a ``RecordKeyError`` (a ``KeyError``) that says
    "did you mean" and lists them. A ``train_``/``valid_`` name that may be
    a part of a loss that declares no ``part_names`` is left to the first
    record. A condition that raises anything else on a stand-in record (or
    catches the ``KeyError`` itself) is left unchecked, and trains as
    before. Those calls are the condition's too: one that prints or counts
    sees them (keep it a function of the record). A name a record does not
    have is the same ``RecordKeyError`` there, listing the record's names. A
    condition that is not callable, does not take one argument, or returns
    anything but a bool is a ``TypeError``: the first two at construction,
    before training.

    The stop returns ``stop_reason`` (the fit's ``History.stop_reason``):
    ``"StopWhen: <reason> (<the values it read>)"``, where the reason
    defaults to the lambda's body (``record["valid_loss"] < 0.05``) or
    ``<name>(record) is true``. One line is printed when training ends.

    Args:
        condition: a function of the record, True to stop.
        reason: what the stop says, or None for the condition's own text.

    Attributes:
        stopped_epoch: the epoch of the record after which it stopped, or None.
        stopped_step: that record's step with validations inside epochs, else
            None.
        stop_reason: the sentence it returned, or None.

    Examples:
        >>> stop = StopWhen(lambda record: record["valid_loss"] < 1.0)
        >>> history = fit(20, model, F.cross_entropy, opt, data, callbacks=[stop])
        StopWhen: stopped after epoch ...: record["valid_loss"] < 1.0
        (valid_loss=...)
        >>> history.stop_reason
        'StopWhen: record["valid_loss"] < 1.0 (valid_loss=...)'
    """

    order = 45  # after yours (0), which add values; as EarlyStopping
    in_lr_find = False  # a sweep is not part of the run it records

    def __init__(
        self, condition: Callable[[dict], bool], reason: str | None = None
    ) -> None:
        self.condition = _check_condition(condition)
        if reason is not None and not isinstance(reason, str):
            raise TypeError(
                f"StopWhen: reason must be a str or None; got {reason!r} "
                f"({type(reason).__name__}). Fix: e.g. StopWhen(..., "
                "reason='valid_loss below 0.05')."
            )
        self.reason = _describe(condition) if reason is None else reason
        self._stopped_now = False  # stopped in this fit: print at its end
        self.reset()

    def reset(self) -> None:
        """Forgets the stop."""
        self.stopped_epoch: int | None = None
        self.stopped_step: int | None = None
        self.stop_reason: str | None = None

    # -- hooks -----------------------------------------------------------------
    def on_train_begin(
        self,
        iteration: int,
        metrics: Any,
        train_metrics: Any,
        callbacks: list,
        loss_func: Any,
    ) -> None:
        """Runs before training: checks the names the condition reads on
        stand-in records; a new fit forgets the previous stop."""
        names = _known_names(metrics, train_metrics, callbacks, loss_func)
        for value in _PROBES:
            stand_in = _StandIn(names, value, self._may_be_part(
                metrics, train_metrics, callbacks, loss_func))  # fmt: skip
            try:
                self.condition(stand_in)
            except RecordKeyError as error:
                if error is stand_in.refused:
                    raise
                break
            except Exception:  # the record's names are fine; it fails on NaN
                break  # or reads something else: judged on the real records
        if iteration == 0:
            self.reset()
        self._stopped_now = False

    def on_epoch_end(self, epoch: int, record: dict) -> dict | None:
        """Runs after validation: asks the condition; stops when it is true."""
        view = _Record(record)
        try:
            verdict = self.condition(view)
        except _NotComputedError:
            return None
        if not isinstance(verdict, (bool, np.bool_)):
            raise TypeError(
                f"StopWhen: condition returned {verdict!r} "
                f"({type(verdict).__name__}); it must return True or False. "
                f"Fix: return a comparison, e.g. {_EXAMPLE}."
            )
        if not verdict:
            return None
        values = ", ".join(f"{k}={v:.6g}" for k, v in view.seen.items())
        self.stop_reason = f"{self.name}: {self.reason}" + (
            f" ({values})" if values else ""
        )
        self.stopped_epoch, self.stopped_step = epoch, record.get("step")
        self._stopped_now = True
        return {"stop_training": True, "stop_reason": self.stop_reason}

    def on_train_end(self) -> None:
        """Runs at the end: says why it stopped, once."""
        if self._stopped_now and ranks.is_main():
            where = f"epoch {self.stopped_epoch}"
            if self.stopped_step is not None:
                where += f" (step {self.stopped_step})"
            why = (self.stop_reason or "").removeprefix(f"{self.name}: ")
            print(f"{self.name}: stopped after {where}: {why}")
        self._stopped_now = False

    # -- saved state -----------------------------------------------------------
    def state_dict(self) -> dict:
        """Where it stopped and why (None while it has not)."""
        return {
            "stopped_epoch": self.stopped_epoch,
            "stopped_step": self.stopped_step,
            "stop_reason": self.stop_reason,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores what ``state_dict`` returned."""
        keys = {"stopped_epoch", "stopped_step", "stop_reason"}
        if not isinstance(state, dict) or set(state) != keys:
            raise ValueError(
                f"StopWhen.load_state_dict: expected the keys {sorted(keys)}; got "
                f"{sorted(state) if isinstance(state, dict) else state!r}. Fix: "
                "pass what StopWhen.state_dict() returned."
            )
        self.stopped_epoch = state["stopped_epoch"]
        self.stopped_step = state["stopped_step"]
        self.stop_reason = state["stop_reason"]

    def __repr__(self) -> str:
        return f"{self.name}({self.reason!r})"

    @staticmethod
    def _may_be_part(
        metrics: Any, train_metrics: Any, callbacks: Any, loss_func: Any
    ) -> Callable[[str], bool]:
        """Whether a name outside the known ones may be a part of a loss that
        declares none: ``Monitor``'s rule (``valid_ce`` may, ``valid_los``
        is a typo)."""

        def may_be(name: str) -> bool:
            if not isinstance(name, str) or not name.startswith(("train_", "valid_")):
                return False
            try:
                Monitor(name, mode="min", owner="StopWhen").start(
                    metrics, None, train_metrics, callbacks, loss_func
                )
            except ValueError:
                return False
            return True

        return may_be


class _NotComputedError(Exception):
    """A value the condition read is None in this record."""


class RecordKeyError(KeyError):
    """A name the condition of a ``StopWhen`` read that the record does not
    have, or that the fit's records will not have (raised before training):
    a ``KeyError`` whose text is a sentence with the names there are.

    Examples:
        >>> from fitlib.callbacks.stop_when import RecordKeyError
        >>> try:
        ...     fit(1, model, F.cross_entropy, opt, data,
        ...         callbacks=[StopWhen(lambda record: record["val_loss"] < 0.1)])
        ... except RecordKeyError as error:  # (before training)
        ...     print(isinstance(error, KeyError), str(error).split(";")[0])
        True StopWhen: the condition read record['val_loss'], which this fit's
        records will not have (did you mean 'valid_loss'?)
    """

    def __str__(self) -> str:
        return str(self.args[0])


class _Record(dict):
    """A copy of the record that notes what the condition reads."""

    def __init__(self, record: dict) -> None:
        super().__init__(record)
        self.seen: dict[str, float] = {}

    def __getitem__(self, name: Any) -> Any:
        if name not in self:
            names = list(self)
            raise RecordKeyError(
                f"StopWhen: the condition read record[{name!r}], which the "
                f"record does not have{did_you_mean(str(name), names)}; its "
                f"names are {names}. Fix: read one of them (a value of your "
                "own callback must be in its record_names)."
            )
        value = super().__getitem__(name)
        if value is None:
            raise _NotComputedError(name)
        self.seen[name] = value
        return value


class _StandIn(dict):
    """A record of the names known before training, each ``value``, that
    refuses any other name the condition reads (``refused``: the error)."""

    def __init__(
        self, names: list[str], value: float, may_be_part: Callable[[str], bool]
    ) -> None:
        super().__init__(dict.fromkeys(names, value))
        self.value, self.may_be_part = value, may_be_part
        self.refused: RecordKeyError | None = None

    def __getitem__(self, name: Any) -> Any:
        if name in self:
            return super().__getitem__(name)
        if self.may_be_part(name):  # known at the first batch
            return self.value
        names = list(self)
        step = " ('step' is there with validations inside epochs)"
        self.refused = RecordKeyError(
            f"StopWhen: the condition read record[{name!r}], which this fit's "
            f"records will not have{did_you_mean(str(name), names)}; the names "
            f"known before training are {names}{step if name == 'step' else ''}. "
            "Fix: read one of them (a value of your own callback must be in its "
            "record_names, a loss part in the loss's part_names)."
        )
        raise self.refused


def _known_names(
    metrics: Any, train_metrics: Any, callbacks: Any, loss_func: Any
) -> list[str]:
    """The record's names known before training, in the record's order (as
    ``Monitor.start`` knows them, with ``epoch``, ``step``, ``lr``, ``time``)."""
    metric_names = list(getattr(metrics, "names", None) or [])
    train_names = getattr(train_metrics, "names", None) or []
    parts = getattr(loss_func, "part_names", None) or ()
    callbacks = list(callbacks or ())
    step = any(getattr(cb, "validates_mid_epoch", False) for cb in callbacks)
    return [
        "epoch", *(["step"] if step else []), "train_loss", "valid_loss", *metric_names,
        *(f"train_{n}" for n in train_names),
        *(f"{w}_{p}" for w in ("train", "valid") for p in parts),
        *(n for cb in callbacks for n in getattr(cb, "record_names", ())),
        "lr", "time",
    ]  # fmt: skip


def _check_condition(condition: Any) -> Callable[[dict], bool]:
    if not callable(condition):
        raise TypeError(
            f"StopWhen: condition must be a function of the record; got "
            f"{condition!r} ({type(condition).__name__}). Fix: e.g. {_EXAMPLE}."
        )
    try:
        signature = inspect.signature(condition)
    except (TypeError, ValueError):  # a builtin without one: trust it
        return condition
    try:
        signature.bind({})
    except TypeError:
        raise TypeError(
            f"StopWhen: condition must take one argument, the record (a dict of "
            f"numbers); {_name(condition)}{signature} does not. Fix: e.g. "
            f"{_EXAMPLE}."
        ) from None
    return condition


def _name(condition: Any) -> str:
    name = getattr(condition, "__name__", None)
    return name or type(condition).__name__


def _describe(condition: Any) -> str:
    """The lambda's body as written, else ``<name>(record) is true``."""
    if getattr(condition, "__name__", None) == "<lambda>":
        body = _lambda_body(condition)
        if body:
            return body
    return f"{_name(condition)}(record) is true"


def _lambda_body(condition: Callable) -> str | None:
    """The source text of a lambda's body, from its code's positions."""
    code = condition.__code__
    spans = [p for p in code.co_positions() if None not in p and p[:2] != (0, 0)]
    spans = [p for p in spans if (p[1], p[3]) > (p[0], p[2])]  # non-empty ones
    if not spans:
        return None
    first, col = min((p[0], p[2]) for p in spans)
    last, end = max((p[1], p[3]) for p in spans)
    lines = [
        linecache.getline(code.co_filename, n).encode() for n in range(first, last + 1)
    ]
    if not all(lines) or last - first > 5:
        return None
    lines[-1] = lines[-1][:end]
    lines[0] = lines[0][col:]
    return " ".join(b"".join(lines).decode(errors="replace").split()) or None
