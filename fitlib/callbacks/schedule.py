"""``ParamScheduler``: any hyper-parameter along a schedule, step by step.

What it sets, by the key of its dict:

- an optimizer's hyper-parameter: fitlib's ``lr``, ``mom``, ``wd``, ``beta``,
  or any number in the parameter groups by its torch name (``"eps"``,
  ``"weight_decay"``, one element of a tuple ``"betas[1]"``, a custom
  optimizer's own key), through ``HPOptimizer.set_scheduled``;
- an attribute of the model or of the loss function, by its dotted path from
  the fit's ``model`` (unwrapped from DDP or ``torch.compile``) or
  ``loss_func``: ``"model.head.dropout.p"``, ``"loss_func.label_smoothing"``.
  It must hold a number (or a floating-point tensor, which is filled in place
  on its device: no host sync);
- a setter: a function of the value, called with it (``set_weight(value)``),
  for what no path reaches.

The position (optimizer steps done) is the state, so a resumed fit sets every
target to the value an unbroken run had: an attribute needs no saving.

A schedule maps the fraction of a phase done (0 to 1) to a value. A
hyper-parameter follows one schedule, or several phases one after another,
each a fraction of the optimizer steps of training. The scheduler sets the
value for the next step after every optimizer step, through ``HPOptimizer``,
so it counts optimizer steps, not batches (gradient accumulation steps less
often), and it reads the length of training from the state key ``n_steps``
(or ``total_steps``).

Phase ``k`` ends at step ``c_k * total - 1``, where ``c_k`` is the fraction of
training done at its end: the first step takes a schedule's start value and
the last step its end value, as ``torch.optim.lr_scheduler.OneCycleLR`` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fitlib.callback import Callback
from fitlib.checks import check_int
from fitlib.errors import did_you_mean, is_number, name_of
from fitlib.hyper_checks import hyper_name
from fitlib.schedule_targets import (
    attribute_owner,
    check_attribute,
    set_attribute,
    target_kind,
)

Value = float | list[float]  # one value, or one per parameter group
Schedule = Callable[[float], Value]
Phases = Schedule | Sequence[tuple[float, Schedule]]


class Anneal:
    """A schedule from ``start`` to ``end`` along an annealing function.

    ``start`` and ``end`` may be sequences (one value per parameter group);
    the schedule then returns a list. Made by ``cosine``, ``linear``,
    ``exponential`` and ``constant``.

    Examples:
        >>> cosine(1e-3, 1e-5)(0.5)
        0.000505
    """

    def __init__(
        self, kind: str, fn: Callable, start: Value, end: Value | None = None
    ) -> None:
        self.kind, self.fn = kind, fn
        self.start, self.end = start, start if end is None else end
        self._many = not (is_number(self.start) and is_number(self.end))
        if self._many:
            self._pairs = _pairs(kind, self.start, self.end)

    def __call__(self, pct: float) -> Value:
        if self._many:
            return [self.fn(s, e, pct) for s, e in self._pairs]
        return self.fn(self.start, self.end, pct)

    def __repr__(self) -> str:
        if self.kind == "constant":
            return f"constant({self.start!r})"
        return f"{self.kind}({self.start!r}, {self.end!r})"


def _cos(start: float, end: float, pct: float) -> float:
    return end + (start - end) / 2 * (math.cos(math.pi * pct) + 1)


def _lin(start: float, end: float, pct: float) -> float:
    return start + (end - start) * pct


def _exp(start: float, end: float, pct: float) -> float:
    return start * (end / start) ** pct


def _const(start: float, end: float, pct: float) -> float:
    return start


def cosine(start: Value, end: Value) -> Anneal:
    """Half a cosine from ``start`` to ``end``: slow, fast, then slow."""
    return Anneal("cosine", _cos, start, end)


def linear(start: Value, end: Value) -> Anneal:
    """A straight line from ``start`` to ``end``."""
    return Anneal("linear", _lin, start, end)


def exponential(start: Value, end: Value) -> Anneal:
    """A geometric progression from ``start`` to ``end`` (both > 0)."""
    values = [v for x in (start, end) for v in ([x] if is_number(x) else x)]
    if any(not v > 0 for v in values):
        raise ValueError(
            f"exponential({start!r}, {end!r}): the values must be > 0, since it "
            "multiplies by a constant factor each step. Fix: use linear or "
            "cosine to reach 0, or end at a small positive value."
        )
    return Anneal("exponential", _exp, start, end)


def constant(value: Value) -> Anneal:
    """The same value throughout."""
    return Anneal("constant", _const, value)


class ParamScheduler(Callback):
    """Sets hyper-parameters, and attributes of the model or the loss, every
    step.

    Args:
        schedules: for each target, a schedule (a function of the
            fraction of training done, from 0 to 1, such as ``cosine(a, b)``
            or your own ``lambda pct: ...``), or a list of phases
            ``(fraction of training, schedule)`` whose fractions sum to 1.
            A target is an optimizer's hyper-parameter (``"lr"``, ``"mom"``,
            ``"wd"``, ``"beta"``, or a torch name of the parameter groups:
            ``"eps"``, ``"weight_decay"``, ``"betas[1]"``); an attribute by
            its path (``"model.head.dropout.p"``, ``"loss_func.weight"``);
            or a setter function, called with each value. A hyper-parameter's
            value may be a float or one value per parameter group; an
            attribute's or a setter's is one number. Names and attributes
            are checked when training begins, before the first step.
        total_steps: the number of optimizer steps the schedules span; None
            uses the fit's ``n_steps`` (epochs times batches per epoch, divided
            by gradient accumulation). Give it when training is bounded by
            steps (a loader without a length, or a run stopped after a number
            of steps); after the last step the final values stay.
        part: with several optimizers (``MultiOptimizer``), the part whose
            hyper-parameters this schedules; None schedules every part.
            Attributes and setters are not the optimizer's: ``part`` leaves
            them alone.

    A reduction of ``ReduceLROnPlateau`` multiplies the ``lr`` a schedule sets
    (``HPOptimizer.scale``); other targets follow their schedule exactly.
    After the fit every target keeps its last value. Two schedules of one
    target in one fit are refused (``sets_hypers``; ``"weight_decay"`` and
    ``"wd"``, ``"betas[0]"`` and ``"mom"`` are one target); setters are your
    own functions, not compared.

    Examples:
        >>> warmup_cos = [(0.1, linear(0.0, 1e-3)), (0.9, cosine(1e-3, 0.0))]
        >>> sched = ParamScheduler({"lr": warmup_cos, "mom": constant(0.9)})
        >>> fit(5, model, F.cross_entropy, opt, data, callbacks=[sched])
        History(5 epochs: train_loss ... -> ..., valid_loss ... -> ...)
        >>> opt.lr, opt.mom  # at the end of the schedule
        (0.0, 0.9)
        >>> net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 3))
        >>> adam = HPOptimizer(net.parameters(), torch.optim.Adam, lr=1e-3)
        >>> sched = ParamScheduler({"eps": cosine(1e-6, 1e-8),
        ...                         "model.1.p": linear(0.5, 0.0)})
        >>> fit(2, net, F.cross_entropy, adam, data, callbacks=[sched])
        History(2 epochs: train_loss ... -> ..., valid_loss ... -> ...)
        >>> adam.get("eps"), net[1].p
        ([1e-08], 0.0)
    """

    order = 10
    in_lr_find = False  # a sweep is not part of the run it records

    def __init__(
        self,
        schedules: Mapping[str, Phases],
        total_steps: int | None = None,
        part: str | None = None,
    ) -> None:
        self.schedules = _check_schedules(schedules)
        self._kinds = {key: target_kind(key) for key in self.schedules}
        self._plan(total_steps, part)

    def _plan(self, total_steps: int | None, part: str | None = None) -> None:
        """Sets the length (``total_steps``, None: the fit's) and the position;
        also for a subclass that builds its schedules at train begin."""
        self.total_steps = check_int(
            total_steps, "total_steps", minimum=1, owner=self.name, example=1000,
            allow_none=True,
        )  # fmt: skip
        self.step, self.total = 0, 0
        if part is not None and not isinstance(part, str):
            raise TypeError(
                f"{self.name}: part must be a part's name (str) or None; got "
                f"{part!r}. Fix: e.g. part='decoder'."
            )
        self.part = part

    def _target(self, opt: Any) -> Any:
        """The optimizer this schedules: ``opt``, or its part ``part``."""
        if self.part is None:
            return opt
        if self.part not in getattr(opt, "parts", {}):
            if not hasattr(opt, "parts"):
                raise ValueError(
                    f"{self.name}(part={self.part!r}): the fit has one optimizer, "
                    "without parts. Fix: part=None (the default), or train one "
                    "optimizer per part (Learner(..., opt_func={part: class}))."
                )
            raise ValueError(
                f"{self.name}(part={self.part!r}): the optimizer's parts are "
                f"{list(opt.parts)}. Fix: name one of them, or part=None to "
                "schedule every part."
            )
        return opt[self.part]

    def on_train_begin(
        self,
        opt: Any,
        n_steps: int | None,
        iteration: int,
        model: Any = None,
        loss_func: Any = None,
    ) -> None:
        """Runs before training: checks the optimizer and the attributes,
        sets the first values."""
        self._kinds = {key: target_kind(key) for key in self.schedules}
        opt = self._target(opt)
        if iteration == 0:  # a resumed fit keeps its loaded position
            self.step = 0
        self.total = self.total_steps or n_steps
        if self.total is None:
            raise ValueError(
                f"{self.name}: the length of training is unknown: train_dl has "
                "no length, so the number of optimizer steps is unknown. Fix: "
                "give the loader a __len__, or pass total_steps (the optimizer "
                "steps the schedule spans), e.g. learn.fit_one_cycle(..., "
                f"total_steps=1000) or {self.name}(..., total_steps=1000)."
            )
        self._check_hypers(opt)
        for key, kind in self._kinds.items():
            if kind == "attribute":
                check_attribute(self.name, key, attribute_owner(self.name, key, model,
                                                        loss_func))  # fmt: skip
        self._set(opt, model, loss_func)

    def _check_hypers(self, opt: Any) -> None:
        hypers = [k for k, kind in self._kinds.items() if kind == "hyper"]
        missing = [name for name in hypers if not opt.has(name)]
        if not missing:
            return
        lacking = getattr(opt, "missing", None)  # the parts that lack one
        what = (
            f"the parts {lacking(missing[0])} do"
            if lacking
            else f"{type(getattr(opt, 'opt', opt)).__name__} does"
        )
        names = opt.hyper_names()
        raise ValueError(
            f"{self.name} schedules {missing}, which {what} not have"
            f"{did_you_mean(missing[0], names)}. What it can schedule there: "
            f"{', '.join(names)}. Fix: drop those schedules (e.g. moms=None), "
            "name one of those, schedule one part (part='name'), or use an "
            "optimizer that has them."
        )

    def on_step_end(
        self, opt: Any, skip_step: bool, model: Any = None, loss_func: Any = None
    ) -> None:
        """Runs after each optimizer step: sets the values for the next one."""
        if not skip_step:  # no step (accumulating gradients): same position
            self.step += 1
            self._set(self._target(opt), model, loss_func)

    def _set(self, opt: Any, model: Any = None, loss_func: Any = None) -> None:
        step = min(self.step, self.total - 1)
        for key, phases in self.schedules.items():
            value = value_at(phases, step, self.total)
            kind = self._kinds[key]
            if kind == "hyper":
                # Times the factors of reductions (ReduceLROnPlateau) in this fit.
                opt.set_scheduled(key, value)
            elif kind == "attribute":
                owner = attribute_owner(self.name, key, model, loss_func)
                set_attribute(owner, key.rpartition(".")[2], self._number(key, value))
            else:
                key(self._number(key, value))

    def _number(self, key: Any, value: Any) -> float:
        """An attribute's or a setter's value: one finite number."""
        if not is_number(value) or not math.isfinite(value):
            what = key if isinstance(key, str) else f"setter {name_of(key)}"
            raise (ValueError if is_number(value) else TypeError)(
                f"{self.name}: the schedule of {what!r} gave {value!r} "
                f"({type(value).__name__}) at step {self.step}; an attribute or "
                "a setter takes one finite number. Fix: a schedule of one "
                "number, e.g. linear(0.5, 0.1)."
            )
        return float(value)

    @property
    def sets_hypers(self) -> tuple[str, ...]:
        """The hyper-parameters this scheduler sets at every step, each by one
        name (``wd`` for ``weight_decay``, ``beta`` for ``betas[1]``;
        ``part.lr`` for one part's), and the attributes by their paths.
        Setters are not listed: they are your functions."""
        prefix = "" if self.part is None else f"{self.part}."
        kinds = getattr(self, "_kinds", {})
        return tuple(
            prefix + hyper_name(key) if kinds.get(key, "hyper") == "hyper" else key
            for key in self.schedules
            if kinds.get(key) != "setter"
        )

    def state_dict(self) -> dict:
        """The position in the schedule: optimizer steps done, of how many."""
        return {"step": self.step, "total": self.total}

    def load_state_dict(self, state: dict) -> None:
        """Restores the position that ``state_dict`` returned."""
        self.step, self.total = int(state["step"]), int(state["total"])

    def __repr__(self) -> str:
        part = "" if self.part is None else f", part={self.part!r}"
        return f"{self.name}({self.schedules!r}, total_steps={self.total_steps}{part})"


def value_at(phases: list[tuple[float, Schedule]], step: int, total: int) -> Value:
    """The value of a list of phases at optimizer step ``step`` of ``total``.

    Phase ``k`` runs from the end of phase ``k - 1`` (step 0 for the first) to
    step ``c_k * total - 1``, ``c_k`` being the fraction done at its end.

    Examples:
        >>> from fitlib.callbacks.schedule import value_at
        >>> value_at([(0.5, linear(0.0, 1.0)), (0.5, linear(1.0, 0.0))], 4, 10)
        1.0
    """
    start, done = 0.0, 0.0
    for i, (fraction, schedule) in enumerate(phases):
        done += fraction
        end = done * total - 1
        if step <= end or i == len(phases) - 1:
            span = end - start
            pct = (step - start) / span if span > 0 else 1.0
            return schedule(min(max(pct, 0.0), 1.0))
        start = end
    raise AssertionError("unreachable: the last phase always answers")


def _check_schedules(
    schedules: Mapping[str, Phases],
) -> dict[str, list[tuple[float, Schedule]]]:
    if not isinstance(schedules, Mapping) or not schedules:
        raise TypeError(
            f"schedules must be a non-empty dict of hyper-parameter -> schedule; "
            f"got {schedules!r}. Fix: e.g. {{'lr': cosine(1e-3, 1e-5)}}."
        )
    out, seen = {}, {}
    for name, phases in schedules.items():
        if target_kind(name) == "hyper":
            one = hyper_name(name)
            if one in seen:
                raise ValueError(
                    f"schedules: {seen[one]!r} and {name!r} are two names of one "
                    f"hyper-parameter ({one!r}); each step would set it twice. "
                    "Fix: keep one of them."
                )
            seen[one] = name
        label = name if isinstance(name, str) else name_of(name)
        out[name] = _check_phases(
            label, [(1.0, phases)] if callable(phases) else phases
        )
    return out


def _check_phases(name: str, phases: Any) -> list[tuple[float, Schedule]]:
    fix = (
        f"Fix: e.g. {{'{name}': [(0.25, linear(1e-4, 1e-3)), "
        f"(0.75, cosine(1e-3, 1e-5))]}}."
    )
    try:
        phases = [(fraction, fn) for fraction, fn in phases]
    except (TypeError, ValueError):
        raise TypeError(
            f"schedules[{name!r}] must be a schedule (a function of the fraction "
            f"done) or a list of (fraction, schedule) phases; got {phases!r}. {fix}"
        ) from None
    for fraction, fn in phases:
        if not is_number(fraction) or not callable(fn):
            raise TypeError(
                f"schedules[{name!r}]: a phase is (fraction of training, schedule); "
                f"got ({fraction!r}, {fn!r}). {fix}"
            )
        if fraction <= 0:
            what = "negative" if fraction < 0 else "zero"
            raise ValueError(
                f"schedules[{name!r}]: a phase has {what} length {fraction!r}; "
                f"each phase must cover a positive fraction of training. {fix}"
            )
    total = sum(f for f, _ in phases)
    if not phases or not math.isclose(total, 1.0, abs_tol=1e-6):
        raise ValueError(
            f"schedules[{name!r}]: the phases cover {total:g} of training; they "
            f"must cover all of it (fractions summing to 1). {fix}"
        )
    return phases


def _pairs(kind: str, start: Any, end: Any) -> list[tuple[float, float]]:
    starts = [start] if is_number(start) else list(start)
    ends = [end] if is_number(end) else list(end)
    if len(starts) == 1:
        starts = starts * len(ends)
    if len(ends) == 1:
        ends = ends * len(starts)
    if len(starts) != len(ends):
        raise ValueError(
            f"{kind}: start has {len(starts)} values and end {len(ends)}; give "
            "one value per parameter group to both, or a float."
        )
    return list(zip(starts, ends))
