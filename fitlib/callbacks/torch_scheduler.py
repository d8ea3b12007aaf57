"""``TorchScheduler``: a ``torch.optim.lr_scheduler`` scheduler as a schedule.

The scheduler is made in ``on_train_begin``, where the fit's optimizer
exists, by a function of a torch optimizer that you give
(``lambda opt: CosineAnnealingLR(opt, T_max=100)``): one per part of a
``MultiOptimizer`` (or for one part, ``part=``). The optimizer it gets is a
stand-in: an optimizer of the fit's class, with the same parameter groups
and hyper-parameters as Python floats, over one empty tensor per group. The
torch scheduler runs on it and never touches the fit's optimizer; after each
of its steps the callback writes the stand-in's lr (and momentum, with
``mom=True``) into the fit's. So a schedule costs no device read at any
step, even where the optimizer holds its lr as a tensor
(``HPOptimizer.hypers_as_tensors``, ``Compile(step=True)``), and its values
are the float schedule's, bit for bit. It steps after every
optimizer step (``interval="step"``; a batch that does not step, under
gradient accumulation, does not count) or at every epoch's end
(``interval="epoch"``), every ``frequency`` of them.

It composes as fitlib's schedules do: it lists ``lr`` in ``sets_hypers`` (so
a second lr schedule is refused before training), and the torch scheduler
computes the base value, which ``HPOptimizer.set_scheduled`` multiplies by
the factors of ``HPOptimizer.scale`` (``ReduceLROnPlateau``'s reductions):
the scheduler itself never sees a reduction, so its chained formulas do not
compound it. Torch's ``ReduceLROnPlateau`` needs a metric each step and is
refused: fitlib's ``ReduceLROnPlateau`` reads the record and composes with
this callback. The torch scheduler's ``state_dict`` is this callback's state,
so a resumed fit goes on where the interrupted one stopped.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from fitlib.callback import Callback
from fitlib.checks import check_flag, check_int
from fitlib.optim import HPOptimizer

Factory = Callable[[torch.optim.Optimizer], LRScheduler]
INTERVALS = ("step", "epoch")


class TorchScheduler(Callback):
    """Steps a torch lr scheduler, made for the fit's optimizer, every step
    or epoch.

    Args:
        factory: a function of a torch optimizer that returns a
            ``torch.optim.lr_scheduler.LRScheduler`` made on it, e.g.
            ``lambda opt: StepLR(opt, step_size=2)``; called as each fit
            begins (once per part of a ``MultiOptimizer``) with a stand-in
            of the fit's optimizer: the same class and parameter groups, its
            hyper-parameters as Python floats (``opt.param_groups[0]["lr"]``
            is a float), one empty tensor per group as the parameters. A scheduler
            class that needs more than the optimizer (``StepLR``) is refused
            with the fix; one that takes the optimizer alone is a factory.
        interval: ``"step"`` (after each optimizer step) or ``"epoch"``
            (after each epoch's validation).
        frequency: step the scheduler once every ``frequency`` intervals.
        mom: let the scheduler set the momentum (Adam's beta1) too: for
            ``OneCycleLR`` and ``CyclicLR`` with ``cycle_momentum=True``.
        part: with several optimizers, the part to schedule (None: each
            part gets its own scheduler).

    Examples:
        >>> from torch.optim.lr_scheduler import StepLR
        >>> sched = TorchScheduler(lambda o: StepLR(o, step_size=1, gamma=0.5),
        ...                        interval="epoch")
        >>> opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        >>> fit(3, model, F.cross_entropy, opt, data, callbacks=[sched])
        History(3 epochs: train_loss ... -> ..., valid_loss ... -> ...)
        >>> opt.lr  # halved after each of the 3 epochs
        0.0125
    """

    order = 10  # as the other schedulers: after each optimizer step
    in_lr_find = False  # a sweep is not part of the run it records

    def __init__(
        self,
        factory: Factory,
        interval: str = "step",
        frequency: int = 1,
        mom: bool = False,
        part: str | None = None,
    ) -> None:
        if isinstance(factory, type) and issubclass(factory, LRScheduler):
            needed = _needed_args(factory)
            if needed:  # (a class that takes the optimizer alone is a factory)
                raise TypeError(_class_given(factory, needed, self.name))
        if isinstance(factory, LRScheduler) or not callable(factory):
            raise TypeError(
                f"{self.name}: factory must be a function of the optimizer that "
                f"returns a torch scheduler; got {factory!r}. The fit's optimizer "
                "exists only once the fit begins. Fix: e.g. TorchScheduler("
                "lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2))."
            )
        if interval not in INTERVALS:
            raise ValueError(
                f"{self.name}: interval must be 'step' or 'epoch'; got "
                f"{interval!r}. Fix: e.g. TorchScheduler(..., interval='epoch')."
            )
        self.factory, self.interval = factory, interval
        self.frequency = check_int(
            frequency, "frequency", minimum=1, owner=self.name, example=1
        )
        self.mom = check_flag(mom, "mom", self.name, "TorchScheduler(..., mom=True)")
        if part is not None and not isinstance(part, str):
            raise TypeError(
                f"{self.name}: part must be a part's name (str) or None; got "
                f"{part!r}. Fix: e.g. part='decoder'."
            )
        self.part = part
        self.schedulers: list[LRScheduler] = []
        self._parts: list[Any] = []
        self._wrapped: dict[int, HPOptimizer] = {}  # stand-ins, by scheduler id
        self.intervals = 0  # intervals (steps or epochs) done in this fit
        self._loaded: dict | None = None

    @property
    def sets_hypers(self) -> tuple[str, ...]:
        """``lr`` (and ``mom`` with ``mom=True``); ``part.lr`` for one part's."""
        prefix = "" if self.part is None else f"{self.part}."
        return tuple(prefix + n for n in (("lr", "mom") if self.mom else ("lr",)))

    # -- hooks -----------------------------------------------------------------
    def on_train_begin(self, opt: Any, iteration: int) -> None:
        """Runs before training: makes a scheduler for each optimizer (part);
        a resumed fit restores the saved ones and the rates the checkpoint
        holds."""
        target = _target(opt, self.part, self.name)
        self._parts = list(getattr(target, "parts", {"": target}).values())
        resumed = iteration > 0 and self._loaded is not None
        self.schedulers = [self._make(p, resumed) for p in self._parts]
        self._wrapped = {id(s): HPOptimizer.wrap(s.optimizer) for s in self.schedulers}
        if resumed:  # the checkpoint's rates are in the optimizer already
            self._restore(self._loaded)
        else:
            self.intervals = 0
            for part, sched in zip(self._parts, self.schedulers):
                self._apply(part, sched)
        self._loaded = None

    def on_step_end(self, skip_step: bool) -> None:
        """Runs after each (skipped) optimizer step: steps with interval 'step'."""
        if self.interval == "step" and not skip_step:
            self._tick()

    def on_epoch_end(self, mid_epoch: bool = False) -> None:
        """Runs after each epoch's validation: steps with interval 'epoch'."""
        if self.interval == "epoch" and not mid_epoch:
            self._tick()

    # -- the schedulers --------------------------------------------------------
    def _tick(self) -> None:
        self.intervals += 1
        if self.intervals % self.frequency:
            return
        for part, sched in zip(self._parts, self.schedulers):
            sched.step()  # on the stand-in: Python floats, no device read
            self._apply(part, sched)

    def _apply(self, part: Any, sched: LRScheduler) -> None:
        """The stand-in's values, times ``scale``'s factors, into ``part``."""
        groups = sched.optimizer.param_groups
        part.set_scheduled("lr", [group["lr"] for group in groups])
        if self.mom:  # (the wrapper reads the stand-in's key for momentum)
            part.set_scheduled("mom", self._wrapped[id(sched)].get("mom"))

    def _make(self, part: Any, resumed: bool) -> LRScheduler:
        stand_in = _stand_in(part)
        held = [dict(group) for group in stand_in.param_groups]
        sched = self.factory(stand_in)
        self._check(sched, stand_in)
        if resumed:  # the checkpoint's values (not step 0's), as the fit's
            for group, values in zip(stand_in.param_groups, held):
                group.update(values)
        # Making it sets the rates of its step 0 in the stand-in, and fitlib
        # steps the optimizer before the scheduler: no torch warning.
        stand_in._opt_called = True
        return sched

    def _check(self, sched: Any, stand_in: torch.optim.Optimizer) -> None:
        fix = "Fix: e.g. TorchScheduler(lambda opt: StepLR(opt, step_size=2))."
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ValueError(
                f"{self.name}: torch's ReduceLROnPlateau needs a metric at each "
                "step. Fix: use fitlib's ReduceLROnPlateau('valid_loss', ...) "
                "(fitlib.callbacks), which reads the epoch's record and "
                "composes with a TorchScheduler."
            )
        if not isinstance(sched, LRScheduler):
            raise TypeError(
                f"{self.name}: the factory returned {type(sched).__name__}, not "
                f"a torch.optim.lr_scheduler.LRScheduler. {fix}"
            )
        if sched.optimizer is not stand_in:
            raise ValueError(
                f"{self.name}: the factory made its scheduler on another "
                "optimizer than the one it was given (a stand-in of the fit's). "
                "Fix: make it on the argument: lambda opt: StepLR(opt, ...)."
            )
        cycles = bool(getattr(sched, "cycle_momentum", False))
        if cycles != self.mom:
            what = "cycles" if cycles else "does not cycle"
            raise ValueError(
                f"{self.name}: {type(sched).__name__} {what} the momentum, and "
                f"mom={self.mom}. Fix: TorchScheduler(..., mom={cycles}), or "
                f"cycle_momentum={not cycles} on the scheduler."
            )

    # -- saved state -----------------------------------------------------------
    def state_dict(self) -> dict:
        """Each torch scheduler's ``state_dict``, and the intervals done."""
        return {
            "intervals": self.intervals,
            "schedulers": [sched.state_dict() for sched in self.schedulers],
        }

    def load_state_dict(self, state: dict) -> None:
        """Keeps ``state`` for the schedulers the next fit makes (a resumed
        one, which begins with ``iteration > 0``)."""
        if not isinstance(state, dict) or set(state) != {"intervals", "schedulers"}:
            raise ValueError(
                f"{self.name}.load_state_dict: expected the dict that "
                f"state_dict() returns (keys 'intervals', 'schedulers'); got "
                f"{state!r:.100}. Fix: pass what {self.name}.state_dict() returned."
            )
        self._loaded = state

    def _restore(self, state: dict) -> None:
        saved = state["schedulers"]
        if len(saved) != len(self.schedulers):
            raise ValueError(
                f"{self.name}: the saved state holds {len(saved)} scheduler(s), "
                f"this fit has {len(self.schedulers)} (one per optimizer part). "
                "Fix: resume with the same optimizer parts and part=."
            )
        for sched, sd in zip(self.schedulers, saved):
            sched.load_state_dict(sd)
            # the scheduler's own (unscaled) rates, which chained formulas read
            for group, lr in zip(sched.optimizer.param_groups, sched.get_last_lr()):
                group["lr"] = lr
        self.intervals = int(state["intervals"])

    def __repr__(self) -> str:
        part = "" if self.part is None else f", part={self.part!r}"
        mom = ", mom=True" if self.mom else ""
        return (
            f"{self.name}({self.factory!r}, interval={self.interval!r}, "
            f"frequency={self.frequency}{mom}{part})"
        )


def _needed_args(cls: type) -> list[str]:
    """The arguments a scheduler class needs besides the optimizer."""
    try:
        params = list(inspect.signature(cls).parameters.values())[1:]
    except (TypeError, ValueError):  # no signature: say it needs some
        return ["..."]
    return [p.name for p in params if p.default is p.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]  # fmt: skip


def _class_given(cls: type, needed: list[str], owner: str) -> str:
    """The error for a scheduler class that needs arguments of its own."""
    args = "".join(", ..." if n == "..." else f", {n}=..." for n in needed)
    return (
        f"{owner}: factory is the class {cls.__name__}, which needs "
        f"{', '.join(needed)} besides the optimizer; the fit's optimizer exists "
        "only once the fit begins. Fix: "
        f"{owner}(lambda opt: {cls.__name__}(opt{args}))."
    )


def _target(opt: Any, part: str | None, owner: str) -> Any:
    """The optimizer scheduled: ``opt``, or its part ``part``."""
    if part is None:
        return opt
    parts = getattr(opt, "parts", None)
    if parts is None or part not in parts:
        found = "one optimizer, without parts" if parts is None else list(parts)
        raise ValueError(
            f"{owner}(part={part!r}): the fit's optimizer has {found}. Fix: "
            "name one of its parts, or part=None to schedule every part."
        )
    return parts[part]


def _stand_in(part: Any) -> torch.optim.Optimizer:
    """An optimizer of ``part``'s torch class, over one empty tensor per
    parameter group, whose groups hold ``part``'s hyper-parameters as Python
    floats (read from its getters: a tensor lr is read from its mirror, not
    from the device). The torch scheduler runs on it, never on the fit's
    optimizer; its ``defaults`` keep the keys schedulers check (``momentum``,
    ``betas``)."""
    torch_opt = part.opt
    groups = [_floats(part, i, g) for i, g in enumerate(torch_opt.param_groups)]
    defaults = {k: groups[0].get(k, v) for k, v in torch_opt.defaults.items()}
    stand_in = type(torch_opt).__new__(type(torch_opt))
    # (Optimizer's own constructor: a subclass's may need more arguments)
    torch.optim.Optimizer.__init__(stand_in, groups, defaults)
    return stand_in


def _floats(part: Any, i: int, group: dict) -> dict:
    """Group ``i`` of ``part`` for the stand-in: its numbers as floats, an
    empty tensor as its parameters, without fitlib's keys or an earlier
    scheduler's ``initial_lr``."""
    out: dict[str, Any] = {"params": [torch.zeros(0)]}
    for key, value in group.items():
        if key in ("params", "initial_lr") or key.startswith("fitlib_"):
            continue
        if isinstance(value, torch.Tensor):
            value = part.get(key)[i]
        elif isinstance(value, tuple) and any(
            isinstance(v, torch.Tensor) for v in value
        ):
            value = tuple(part.get(f"{key}[{j}]")[i] for j in range(len(value)))
        out[key] = value
    return out
