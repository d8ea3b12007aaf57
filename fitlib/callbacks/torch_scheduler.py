"""``TorchScheduler``: a ``torch.optim.lr_scheduler`` scheduler as a schedule.

The scheduler is made in ``on_train_begin``, where the fit's optimizer
exists, by a function of the torch optimizer that you give
(``lambda opt: CosineAnnealingLR(opt, T_max=100)``): one per part of a
``MultiOptimizer`` (or for one part, ``part=``). It steps after every
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

Factory = Callable[[torch.optim.Optimizer], LRScheduler]
INTERVALS = ("step", "epoch")


class TorchScheduler(Callback):
    """Steps a torch lr scheduler, made for the fit's optimizer, every step
    or epoch.

    Args:
        factory: a function of a torch optimizer that returns a
            ``torch.optim.lr_scheduler.LRScheduler`` made on it, e.g.
            ``lambda opt: StepLR(opt, step_size=2)``; called as each fit
            begins (once per part of a ``MultiOptimizer``). A scheduler
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
        self.schedulers = [self._make(p.opt, resumed) for p in self._parts]
        if resumed:
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
            # The scheduler's own (unscaled) rates: chained formulas read them
            # (through the wrapper: a tensor lr is filled in place).
            part.set("lr", list(sched.get_last_lr()))
            sched.step()
            self._apply(part, sched)

    def _apply(self, part: Any, sched: LRScheduler) -> None:
        """The scheduler's values, times ``scale``'s factors, into ``part``."""
        part.set_scheduled("lr", sched.get_last_lr())
        if self.mom:  # the scheduler wrote it as it is: now times its factors
            part.set_scheduled("mom", part.get("mom"))

    def _make(self, torch_opt: torch.optim.Optimizer, resumed: bool) -> LRScheduler:
        groups = torch_opt.param_groups
        held = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        if not resumed:  # (torch keeps an earlier scheduler's initial_lr)
            for group in groups:
                group.pop("initial_lr", None)
        sched = self.factory(torch_opt)
        self._check(sched, torch_opt)
        # Making it sets the rates of its step 0 ("_opt_called": fitlib steps
        # the optimizer first; a step a GradScaler skipped would warn).
        torch_opt._opt_called = True
        if resumed:  # the checkpoint's rates, not step 0's
            for group, values in zip(groups, held):
                group.update(values)
        return sched

    def _check(self, sched: Any, torch_opt: torch.optim.Optimizer) -> None:
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
        if sched.optimizer is not torch_opt:
            raise ValueError(
                f"{self.name}: the factory made its scheduler on another "
                "optimizer than the one it was given (the fit's). Fix: make it "
                "on the argument: lambda opt: StepLR(opt, ...)."
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
