"""``ReduceLROnPlateau``: lower the learning rate when a monitored value stalls.

The same rule as ``torch.optim.lr_scheduler.ReduceLROnPlateau`` with
``threshold_mode="abs"`` (or ``"rel"``: ``min_delta_mode="rel"``), checked
against it epoch by epoch in the tests; it reads the value through
``Monitor`` (one host transfer per epoch) and sets the rates through
``HPOptimizer``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fitlib.callback import Callback
from fitlib.checks import check_int, check_number
from fitlib.errors import is_number
from fitlib.monitor import Monitor
from fitlib.multi_optimizer import MultiOptimizer, as_optimizer
from fitlib.optim import HPOptimizer

# As torch's eps: a smaller change is rounding noise (0.1**3 lands 2e-19 above a
# floor of 1e-3, and the next reduction would "reduce" it to the floor).
EPS = 1e-8
_STATE_KEYS = ("monitor", "num_bad_epochs", "cooldown_counter", "reductions")


class ReduceLROnPlateau(Callback):
    """Multiplies every group's lr by ``factor`` when ``monitor`` stops improving.

    After each epoch with a value: an improvement (by more than ``min_delta``)
    resets the count of bad epochs, anything else adds one. When the count
    exceeds ``patience``, each lr becomes ``max(lr * factor, min_lr)`` (kept
    as it was if that changes it by less than ``EPS`` = 1e-8, as torch does)
    and the next ``cooldown`` epochs count no bad epochs. An epoch in which
    the value was not computed (None in the record: validation skipped)
    changes nothing. With validations inside epochs
    (``ValidationSchedule(every_n_steps=...)``) each validation counts as one
    such epoch: ``patience`` and ``cooldown`` are then in validations, and the
    lr is reduced right after the validation, in the middle of the epoch.
    The state resets when a fit starts; a resumed fit (one that begins with
    ``iteration > 0``) keeps what ``load_state_dict`` restored.

    Under a schedule (``fit_one_cycle``, ``ParamScheduler``...) a reduction
    persists as a factor on the scheduled values for the rest of the fit
    (``HPOptimizer.scale``), as torch's chained schedulers multiply: after a
    reduction by 0.2, every later step's lr is 0.2 times the schedule's. The
    floor ``min_lr`` bounds the lr at the moment of a reduction; a schedule
    that anneals afterwards may go below it.

    Args:
        monitor: ``"valid_loss"``, ``"train_loss"`` or a metric's name.
        factor: the lr multiplier, in (0, 1).
        patience: bad epochs tolerated before a reduction (>= 0).
        min_delta: the least change that counts as an improvement (>= 0).
        mode: ``"min"``, ``"max"`` or ``"auto"`` (inferred from the name).
        min_lr: the floor: a float, or one per parameter group.
        cooldown: epochs after a reduction during which bad epochs are not
            counted (>= 0).
        verbose: print one line when the lr is reduced.
        min_delta_mode: ``"abs"`` (``min_delta`` is an amount of the value)
            or ``"rel"`` (a fraction of the best value's size: torch's
            ``threshold_mode="rel"`` for positive values; see ``Monitor``).

    Attributes:
        reductions: the epochs (0-based, of the current fit) after which (or
            in which, after a validation inside it) an lr was reduced.

    Examples:
        >>> plateau = ReduceLROnPlateau("accuracy", factor=0.5, patience=1)
        >>> history = fit(10, model, F.cross_entropy, opt, data,
        ...               metrics=[accuracy], callbacks=[plateau])
        >>> plateau.reductions, opt.lr
        ([3, 5, 7, 9], 0.00625)
    """

    order = 40  # before the Recorder (50), which records the lr each step used
    in_lr_find = False  # a sweep is not part of the run it records

    def __init__(
        self,
        monitor: str = "valid_loss",
        factor: float = 0.2,
        patience: int = 0,
        min_delta: float = 0.0,
        mode: str = "auto",
        min_lr: float | Sequence[float] = 0.0,
        cooldown: int = 0,
        verbose: bool = False,
        min_delta_mode: str = "abs",
    ) -> None:
        self.factor = check_number(
            factor, "factor", above=0, below=1, owner=self.name, example=0.2
        )
        self.monitor = Monitor(
            monitor, mode, min_delta, owner=self.name, min_delta_mode=min_delta_mode
        )
        self.patience = check_int(patience, "patience", owner=self.name, example=2)
        self.cooldown = check_int(cooldown, "cooldown", owner=self.name, example=0)
        self.min_lr = _check_min_lr(min_lr)
        self.verbose = verbose
        self._at_step: int | None = None  # the step of the record being counted
        self.reset()

    def reset(self) -> None:
        """Forgets the best value, the counts and the reductions."""
        self.monitor.reset()
        self.num_bad_epochs = 0
        self.cooldown_counter = 0
        self.reductions: list[int] = []

    # -- hooks -----------------------------------------------------------------
    def on_train_begin(
        self,
        iteration: int,
        opt: Any,
        metrics: Any,
        data: Any,
        train_metrics: Any,
        callbacks: list,
        loss_func: Any,
    ) -> None:
        """Runs before training: checks the monitor and min_lr; a new fit resets."""
        self.monitor.start(metrics, data, train_metrics, callbacks, loss_func)
        self._min_lrs(len(opt.param_groups))  # raises now, not at the 1st reduction
        if iteration == 0:  # a resumed fit keeps what load_state_dict restored
            self.reset()

    def on_epoch_end(self, epoch: int, record: dict, opt: Any) -> None:
        """Runs after validation: counts a bad epoch, reduces the lr after too many."""
        value = self.monitor.read(record)
        if value is not None:
            self._at_step = record.get("step")  # (step()'s signature stays)
            self.step(value, opt, epoch)

    # -- the rule --------------------------------------------------------------
    def step(self, value: float, opt: Any, epoch: int) -> None:
        """Takes one epoch's ``value`` into account (or one validation's inside
        an epoch); reduces the lr if due."""
        if self.monitor.update(value):
            self.num_bad_epochs = 0
        else:
            self.num_bad_epochs += 1
        if self.cooldown_counter > 0:  # right after a reduction: give it time
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0
        if self.num_bad_epochs > self.patience:
            self._reduce(as_optimizer(opt), epoch, value)
            self.cooldown_counter = self.cooldown
            self.num_bad_epochs = 0

    def _reduce(
        self, opt: HPOptimizer | MultiOptimizer, epoch: int, value: float
    ) -> None:
        old = opt.get("lr")
        floors = self._min_lrs(len(old))
        new = [max(lr * self.factor, lo) for lr, lo in zip(old, floors)]
        # Never raises an lr already below its floor; ignores rounding noise.
        new = [n if lr - n > EPS else lr for lr, n in zip(old, new)]
        if new == old:
            return  # every group is at its floor: nothing to record
        # A factor, not a value: a scheduler's later values keep the reduction.
        opt.scale("lr", [n / lr if lr else 1.0 for lr, n in zip(old, new)])
        opt.set("lr", new)  # exactly: lr * (n / lr) may round off n
        self.reductions.append(epoch)
        if self.verbose:
            where, unit = f"epoch {epoch}", "epoch(s)"
            at_step = getattr(self, "_at_step", None)
            if at_step is not None:  # validations inside epochs
                where, unit = f"{where} (step {at_step})", "validation(s)"
            print(
                f"{self.name}: {where}: {self.monitor.name}={value:.6g} has "
                f"not improved for {self.patience + 1} {unit}; lr {_fmt(old)} "
                f"-> {_fmt(new)} (a schedule's later values are scaled alike)"
            )

    def _min_lrs(self, n_groups: int) -> list[float]:
        if isinstance(self.min_lr, float):
            return [self.min_lr] * n_groups
        if len(self.min_lr) != n_groups:
            raise ValueError(
                f"ReduceLROnPlateau: min_lr has {len(self.min_lr)} values "
                f"{self.min_lr} but the optimizer has {n_groups} parameter "
                f"group(s). Fix: pass one float, or exactly {n_groups} values."
            )
        return list(self.min_lr)

    # -- saved state -----------------------------------------------------------
    def state_dict(self) -> dict:
        """Best value, bad-epoch count, cooldown counter and reductions."""
        return {
            "monitor": self.monitor.state_dict(),
            "num_bad_epochs": self.num_bad_epochs,
            "cooldown_counter": self.cooldown_counter,
            "reductions": list(self.reductions),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores what ``state_dict`` returned."""
        if not isinstance(state, dict) or set(state) != set(_STATE_KEYS):
            got = sorted(state) if isinstance(state, dict) else state
            raise ValueError(
                f"ReduceLROnPlateau.load_state_dict: expected the keys "
                f"{sorted(_STATE_KEYS)}; got {got!r}. Fix: pass what "
                "ReduceLROnPlateau.state_dict() returned."
            )
        self.monitor.load_state_dict(state["monitor"])
        self.num_bad_epochs = int(state["num_bad_epochs"])
        self.cooldown_counter = int(state["cooldown_counter"])
        self.reductions = [int(e) for e in state["reductions"]]

    def __repr__(self) -> str:
        return (
            f"{self.name}(monitor={self.monitor.name!r}, mode={self.monitor.mode!r}, "
            f"factor={self.factor}, patience={self.patience}, "
            f"cooldown={self.cooldown}, min_lr={self.min_lr})"
        )


def _check_min_lr(min_lr: Any) -> float | list[float]:
    values = [min_lr] if is_number(min_lr) else min_lr
    if not isinstance(values, (list, tuple)) or not values:
        raise TypeError(
            f"ReduceLROnPlateau: min_lr must be a number or a list with one per "
            f"parameter group; got {min_lr!r}. Fix: e.g. min_lr=1e-6."
        )
    if not all(is_number(v) and v >= 0 for v in values):
        raise ValueError(
            f"ReduceLROnPlateau: min_lr must be >= 0 (each of them); got "
            f"{min_lr!r}. Fix: e.g. min_lr=0.0 or min_lr=1e-6."
        )
    floats = [float(v) for v in values]
    return floats[0] if is_number(min_lr) else floats


def _fmt(lrs: list[float]) -> str:
    text = [f"{lr:.3g}" for lr in lrs]
    return text[0] if len(set(text)) == 1 else "[" + ", ".join(text) + "]"
