"""``OneCycleScheduler``: the 1cycle policy for the learning rate and momentum.

The learning rate warms up from ``max_lr / div_factor`` to ``max_lr`` along a
cosine over ``pct_start`` of the optimizer steps, then anneals along a cosine
to ``max_lr / final_div``; momentum (Adam's beta1) moves the opposite way,
from ``moms[0]`` to ``moms[1]`` and back. Step by step the values equal those
of ``torch.optim.lr_scheduler.OneCycleLR`` given ``div_factor``,
``final_div_factor=final_div / div_factor`` and ``max_momentum, base_momentum
= moms``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from fitlib.callback import inner_callback
from fitlib.callbacks.schedule import ParamScheduler, cosine, value_at
from fitlib.checks import check_int, check_number
from fitlib.errors import is_number
from fitlib.hyper_checks import LR, check_lr


class OneCycleScheduler(ParamScheduler):
    """Trains with one cycle of learning rate and momentum (Smith, 2018).

    The schedules are built in ``on_train_begin``, where the optimizer's
    parameter groups are known: that is where ``max_lr`` is spread over them
    (it is checked here, when the scheduler is made).

    Args:
        max_lr: the peak learning rate: a float, one per parameter group, or a
            slice spread over the groups (``slice(lo, hi)`` geometrically,
            ``slice(hi)``: ``hi / 10`` for all groups but the last). ``lr``
            is another name for it, as in ``Learner.fit_one_cycle``: pass one.
            With several optimizers (``MultiOptimizer``), a dict gives each
            part its own peak: ``{"encoder": 1e-3, "decoder": 1e-2}``.
        div_factor: the learning rate starts at ``max_lr / div_factor``.
        pct_start: the fraction of steps spent warming up, in (0, 1).
        final_div: the learning rate ends at ``max_lr / final_div``; None is
            ``div_factor * 1e4``.
        moms: the momentum (or beta1) at the start (and end) and at the peak
            of the learning rate; None leaves momentum alone.
        total_steps: as for ``ParamScheduler``; None uses the fit's length.
        part: schedule only this part of a ``MultiOptimizer`` (None: all).

    Examples:
        >>> fit(5, model, F.cross_entropy, opt, data,
        ...     callbacks=[OneCycleScheduler(max_lr=1e-2)])
        History(5 epochs: train_loss ... -> ..., valid_loss ... -> ...)
    """

    def __init__(
        self,
        max_lr: LR | None = None,
        div_factor: float = 25.0,
        pct_start: float = 0.3,
        final_div: float | None = None,
        moms: tuple[float, float] | None = (0.95, 0.85),
        total_steps: int | None = None,
        *,
        lr: LR | None = None,
        part: str | None = None,
    ) -> None:
        self.lr_name, self.max_lr = peak_lr(lr, max_lr, owner=self.name)
        check_lr(self.max_lr, self.lr_name)
        owner = self.name
        check_number(div_factor, "div_factor", above=0, owner=owner, example=25.0)
        check_number(
            pct_start, "pct_start", above=0, below=1, what="a fraction of training",
            owner=owner, example=0.3,
        )  # fmt: skip
        final_div = div_factor * 1e4 if final_div is None else final_div
        check_number(final_div, "final_div", above=0, owner=owner, example=1e4)
        if moms is not None and not (
            len(moms) == 2 and all(is_number(m) and 0 <= m < 1 for m in moms)
        ):
            raise ValueError(
                f"moms must be two momentums in [0, 1), or None; got {moms!r}. "
                "Fix: e.g. moms=(0.95, 0.85)."
            )
        self.div_factor, self.pct_start = div_factor, pct_start
        self.final_div, self.moms = final_div, moms
        self.schedules = {}  # built in on_train_begin, for the optimizer's groups
        self._plan(total_steps, part)
        if part is not None and isinstance(self.max_lr, Mapping):
            raise ValueError(
                f"{self.name}(part={part!r}) got {self.lr_name}={self.max_lr!r}, a "
                "dict by part: with part=..., the rate is that part's own (a "
                f"number, one per group of the part, or a slice). Fix: e.g. "
                f"{self.lr_name}=1e-3, or part=None to schedule every part."
            )

    @property
    def sets_hypers(self) -> tuple[str, ...]:
        """``lr``, and ``mom`` unless ``moms`` is None: known before training
        (``part.lr``, ``part.mom`` for one part's)."""
        prefix = "" if self.part is None else f"{self.part}."
        names = ("lr",) if self.moms is None else ("lr", "mom")
        return tuple(prefix + name for name in names)

    def on_train_begin(self, opt: Any, n_steps: int | None, iteration: int) -> None:
        """Runs before training: builds the schedules for this optimizer's
        parameter groups (spreading ``max_lr`` over them), sets the first
        values."""
        self.schedules = self._cycle(opt)
        super().on_train_begin(opt, n_steps, iteration)

    def _cycle(self, opt: Any) -> dict:
        """The lr's and momentum's phases for ``opt``'s parameter groups."""
        # Per part for a dict; over the part's groups with part=...
        top = self._target(opt).spread_lr(self.max_lr, self.lr_name)
        low = [lr / self.div_factor for lr in top]
        end = [lr / self.final_div for lr in top]
        warm, cool = self.pct_start, 1 - self.pct_start
        cycle = {"lr": [(warm, cosine(low, top)), (cool, cosine(top, end))]}
        if self.moms is not None:
            first, peak = self.moms
            cycle["mom"] = [(warm, cosine(first, peak)), (cool, cosine(peak, first))]
        return cycle

    @classmethod
    def in_phases(
        cls,
        phases: Sequence[tuple[int, LR, float, float]],
        moms: tuple[float, float] | None = (0.95, 0.85),
    ) -> ParamScheduler:
        """One 1cycle per phase of whole epochs, as ``Learner.fine_tune``'s
        frozen and unfrozen phases: a phase is ``(epochs, max_lr, div_factor,
        pct_start)``, checked as ``OneCycleScheduler``'s arguments; a phase of
        0 epochs is skipped. The fit must have the phases' epochs.

        A phase begins with the epoch that begins it, whatever the epochs'
        lengths, and spans its epochs' optimizer steps: an epoch's batches
        (after ``train_batches``) over the batches per step of a callback that
        accumulates gradients (its ``batches_at(epoch)``, as
        ``GradientAccumulation``'s), rounded up; the last phase spans the
        fit's remaining steps. Each cycle ends at its ``max_lr`` divided by
        ``div_factor * 1e4``. Its state (the position, the phase and the step
        that began it) resumes a fit exactly.

        Examples:
            >>> sched = OneCycleScheduler.in_phases([(1, 1e-2, 25.0, 0.9),
            ...                                      (2, 5e-3, 5.0, 0.3)])
            >>> fit(3, model, F.cross_entropy, opt, data, callbacks=[sched])
            History(3 epochs: train_loss ... -> ..., valid_loss ... -> ...)
            >>> sched.state_dict()["phase"], opt.lr  # the second cycle's end
            (1, 1e-07)
        """
        return _Phases(phases, moms)

    def __repr__(self) -> str:
        return (
            f"{self.name}(max_lr={self.max_lr!r}, div_factor={self.div_factor}, "
            f"pct_start={self.pct_start}, final_div={self.final_div}, "
            f"moms={self.moms}, total_steps={self.total_steps})"
        )


def peak_lr(lr: Any, max_lr: Any, owner: str) -> tuple[str, Any]:
    """The peak learning rate and the name it was given by: ``lr`` and
    ``max_lr`` are two names for it, and exactly one must be given (a
    ValueError for both, a TypeError for neither, from ``owner``).

    Examples:
        >>> from fitlib.callbacks.one_cycle import peak_lr
        >>> peak_lr(None, 1e-2, "OneCycleScheduler")
        ('max_lr', 0.01)
    """
    if lr is not None and max_lr is not None:
        raise ValueError(
            f"{owner}: got lr={lr!r} and max_lr={max_lr!r}, two names for the "
            f"peak learning rate. Fix: pass one of them, e.g. {owner}(..., "
            f"lr={lr!r})."
        )
    if lr is None and max_lr is None:
        raise TypeError(
            f"{owner} needs the peak learning rate: got neither lr nor max_lr. "
            f"Fix: e.g. {owner}(..., lr=1e-2) (learn.lr_find() suggests one)."
        )
    return ("lr", lr) if max_lr is None else ("max_lr", max_lr)


class _Phases(ParamScheduler):
    """``OneCycleScheduler.in_phases``: a cycle per phase of whole epochs."""

    @property
    def name(self) -> str:
        """How messages and the callbacks' tables name it."""
        return "OneCycleScheduler.in_phases"

    def __init__(self, phases: Sequence[Any], moms: Any) -> None:
        owner = "OneCycleScheduler.in_phases"
        self.phases, self.moms, self.cycles = list(phases), moms, []
        for i, phase in enumerate(self.phases):
            if not isinstance(phase, tuple | list) or len(phase) != 4:
                raise TypeError(
                    f"{owner}: phases[{i}] must be (epochs, max_lr, div_factor, "
                    f"pct_start); got {phase!r}. Fix: e.g. (1, 1e-2, 25.0, 0.3)."
                )
            epochs, max_lr, div, pct = phase
            check_int(epochs, f"phases[{i}][0] (epochs)", minimum=0, owner=owner,
                      example=1)  # fmt: skip
            self.cycles.append(OneCycleScheduler(max_lr, div, pct, moms=moms))
        self.epochs = [phase[0] for phase in self.phases]
        if sum(self.epochs) == 0:
            raise ValueError(
                f"{owner}: the phases have 0 epochs in all ({self.phases!r}). "
                "Fix: give a phase 1 epoch at least, e.g. (1, 1e-2, 25.0, 0.3)."
            )
        self.schedules = dict.fromkeys(("lr",) if moms is None else ("lr", "mom"))
        self._plan(None)
        self.phase, self.start = self._phase_of(0), 0
        self.spans: list[int] = []  # steps per phase, built in on_train_begin
        self._cycles: list[dict] = []

    def _phase_of(self, epoch: int) -> int:
        done = 0
        for i, n in enumerate(self.epochs):
            done += n
            if epoch < done:
                return i
        return len(self.epochs) - 1

    def on_train_begin(
        self,
        opt: Any,
        n_steps: int | None,
        iteration: int,
        n_epochs: int | None = None,
        epoch: int = 0,
        data: Any = None,
        callbacks: Sequence = (),
    ) -> None:
        """Runs before training: checks the fit's epochs, builds each phase's
        cycle for the optimizer's groups and plans the phases' steps."""
        if n_epochs != sum(self.epochs):
            raise ValueError(
                f"OneCycleScheduler.in_phases: the phases have {sum(self.epochs)} "
                f"epochs ({self.epochs}), but the fit has n_epochs={n_epochs}. "
                f"Fix: fit for {sum(self.epochs)} epochs, or change the phases."
            )
        if n_steps is None:
            raise ValueError(
                "OneCycleScheduler.in_phases: train_dl has no length, so the "
                "optimizer steps of each phase are unknown. Fix: give the loader "
                "a __len__."
            )
        self._cycles = [c._cycle(opt) if n else {}
                        for n, c in zip(self.epochs, self.cycles)]  # fmt: skip
        self.spans = self._spans(len(data.train_dl), callbacks)
        if iteration == 0:  # a resumed fit keeps its loaded phase
            self.phase, self.start = self._phase_of(epoch), 0
        super().on_train_begin(opt, n_steps, iteration)

    def _spans(self, n_batches: int, callbacks: Sequence) -> list[int]:
        """Each phase's optimizer steps, from its epochs' batches per step."""
        steppers = [getattr(inner_callback(cb), "batches_at", None) for cb in callbacks]
        steppers = [f for f in steppers if f is not None]
        spans, epoch = [], 0
        for n in self.epochs:
            per = [math.prod(f(e) for f in steppers) for e in range(epoch, epoch + n)]
            spans.append(sum(math.ceil(n_batches / k) for k in per))
            epoch += n
        return spans

    def on_epoch_begin(self, opt: Any, epoch: int) -> None:
        """Runs at each epoch's start: the epoch that begins a phase starts its
        cycle, at the step it begins on."""
        phase = self._phase_of(epoch)
        if phase != self.phase:
            self.phase, self.start = phase, self.step
            self._set(self._target(opt))

    def _set(self, opt: Any, *_: Any) -> None:  # (ParamScheduler's hook)
        last = self.phase == max(i for i, n in enumerate(self.epochs) if n)
        span = max(self.total - self.start if last else self.spans[self.phase], 1)
        step = min(self.step - self.start, span - 1)
        for name, phases in self._cycles[self.phase].items():
            opt.set_scheduled(name, value_at(phases, step, span))

    def state_dict(self) -> dict:
        """The position, the phase and the step that began it."""
        return {**super().state_dict(), "phase": self.phase, "start": self.start}

    def load_state_dict(self, state: dict) -> None:
        """Restores what ``state_dict`` returned."""
        super().load_state_dict(state)
        self.phase, self.start = int(state["phase"]), int(state["start"])

    def __repr__(self) -> str:
        return f"OneCycleScheduler.in_phases({self.phases!r}, moms={self.moms!r})"
