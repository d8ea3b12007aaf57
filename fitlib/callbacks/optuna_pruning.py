"""``OptunaPruning``: prune an Optuna trial at any validation, and stop cleanly.

Optuna (the ``optuna`` extra) is imported when a callback is made with a
trial, never by ``import fitlib``. The callback reports the monitored value
of every record that has one (each epoch's, and each validation inside an
epoch) with the fit's optimizer step as Optuna's step, then asks the
pruner. A pruned trial stops through the loop's own stopping path
(``stop_training`` with a ``stop_reason``), so the validation's record is
kept, loggers close and a ``Checkpoint`` writes its final file; then
``on_train_end``, which the handler runs after every other callback's has
run, raises ``optuna.TrialPruned``, and ``fit`` raises it.

Under ``torch.distributed`` rank 0 alone talks to the trial (and its
storage); the other ranks pass ``trial=None``. Every rank has the same
record (it is reduced over the ranks), so all of them reach each decision
at the same validation; rank 0 sends its verdict in one integer broadcast
right after that validation's reductions, where the ranks already wait for
each other: one collective per validation, none per step, none in one
process, and no storage the other ranks must reach.
"""

from __future__ import annotations

import warnings
from typing import Any

import fitlib.ranks as ranks
from fitlib.callback import Callback
from fitlib.monitor import Monitor, direction

_FIX_INSTALL = "Fix: pip install fitlib[optuna] (or pip install optuna)."


def _optuna() -> Any:
    try:
        import optuna
    except ImportError as e:
        raise ImportError(
            f"OptunaPruning needs the optuna package. {_FIX_INSTALL}"
        ) from e
    return optuna


class OptunaPruning(Callback):
    """Reports a monitored value to an Optuna trial at every validation, and
    stops the fit when the study's pruner prunes the trial.

    Each record with a value of ``monitor`` (each epoch's, and each
    validation inside an epoch with ``ValidationSchedule(every_n_steps=)``)
    is reported with ``trial.report(value, step)``, where ``step`` is the
    fit's optimizer step (a pruner's ``n_warmup_steps`` counts optimizer
    steps), and ``trial.should_prune()`` is asked. A step is never reported
    twice (Optuna would ignore the second value): a fit resumed from a
    ``Checkpoint`` skips the steps already reported, and a trial retried as a
    new one gets the values reported before the checkpoint first, so its
    pruner sees the whole curve. A later fit with the same callback (a fresh
    one, not resumed) continues the steps after the last one reported. A
    second record at a step this fit already reported (an epoch that took no
    optimizer step) is not reported, with one warning naming the step.

    A pruned trial returns ``stop_training`` with the ``stop_reason``
    ``"OptunaPruning: trial 3 pruned at step 120 (valid_loss=0.84)"``: the
    fit ends as any stop ends it (the record is kept, loggers close, a
    ``Checkpoint`` writes its final checkpoint, ``on_train_end`` runs), and
    then raises ``optuna.TrialPruned`` with that sentence, after every other
    callback's ``on_train_end`` has run. Inside ``study.optimize`` Optuna
    marks the trial pruned. ``check_pruned()`` raises the same error, for
    code that caught it.

    Distributed (``torchrun`` with ``DistributedTrainer``): pass the trial on
    rank 0 and ``trial=None`` on the other ranks; rank 0 reports and asks,
    and its verdict reaches every rank in one broadcast per validation, so
    every rank stops at the same record and every rank's ``fit`` raises
    ``TrialPruned`` (the reference page has the script).

    Args:
        trial: the ``optuna.trial.Trial`` the objective function was given
            (any ``optuna.trial.BaseTrial`` but a ``FrozenTrial``, a record
            that cannot report), or None on ranks > 0 of a distributed run.
        monitor: the record's value to report: ``"valid_loss"``, a metric's
            name, ``"train_loss"``, a loss part or a value a callback adds.
        mode: ``"min"``, ``"max"``, or ``"auto"`` (from the name; a name of
            your own follows the study's direction). It must agree with the
            study's direction: a study that minimizes pruning on accuracy
            would keep the worst trials, so that is refused.

    Attributes:
        pruned: whether the trial was pruned in this fit.
        pruned_at: the optimizer step (Optuna's step) it was pruned at, or None.
        stop_reason: the sentence it stopped with, or None.
        reported: ``{step: value}``, every value reported to the trial.

    Examples:
        >>> import optuna
        >>> study = optuna.create_study(pruner=optuna.pruners.MedianPruner())
        >>> def objective(trial):
        ...     prune = OptunaPruning(trial, monitor="valid_loss")
        ...     history = fit(3, model, F.cross_entropy, opt, data, callbacks=[prune])
        ...     return history[-1]["valid_loss"]
        >>> optuna.logging.set_verbosity(optuna.logging.WARNING)
        >>> study.optimize(objective, n_trials=2)
        >>> sorted(study.trials[0].intermediate_values)  # the optimizer steps
        [4, 8, 12]
    """

    order = 45  # as EarlyStopping: after yours (0), which add values
    in_lr_find = False  # a sweep is not the trial's training

    def __init__(
        self, trial: Any, monitor: str = "valid_loss", mode: str = "auto"
    ) -> None:
        self.trial = _check_trial(trial)
        study = getattr(trial, "study", None)
        self.direction = _study_direction(study)
        if mode == "auto" and isinstance(monitor, str) and direction(monitor) is None:
            mode = {"maximize": "max"}.get(self.direction, "min")  # follow the study
        self.monitor = Monitor(monitor, mode=mode, owner="OptunaPruning")
        self._check_direction()
        self.reported: dict[int, float] = {}
        self._offset = 0  # the steps of earlier fits with this callback
        self._held: set[int] = set()  # steps the trial held when the fit began
        self._this_fit: set[int] = set()  # steps reported in this fit
        self._warned = False
        self.reset()

    def reset(self) -> None:
        """Forgets the pruning (a new fit of the trial starts)."""
        self.pruned = False
        self.pruned_at: int | None = None
        self.stop_reason: str | None = None

    # -- hooks -----------------------------------------------------------------
    def on_train_begin(
        self,
        iteration: int,
        metrics: Any,
        data: Any,
        train_metrics: Any,
        callbacks: list,
        loss_func: Any,
    ) -> None:
        """Runs before training: checks the monitor; a resumed fit brings the
        trial the values it lacks."""
        self.monitor.start(metrics, data, train_metrics, callbacks, loss_func)
        if iteration == 0:  # a fresh fit: its steps follow the earlier fits'
            self.reset()
            self._offset = max(self.reported, default=0)
        self._held = set()
        self._this_fit, self._warned = set(), False
        if self.trial is not None and ranks.is_main():
            self._held = set(_intermediate_values(self.trial))
            for step, value in sorted(self.reported.items()):
                if step not in self._held:  # a retried trial: the curve so far
                    self.trial.report(value, step)
                    self._held.add(step)

    def on_epoch_end(self, record: dict, step: int) -> dict | None:
        """Runs after each validation: reports the value, asks the pruner."""
        value = self.monitor.read(record)
        if value is None:  # no validation in this record: nothing to report
            return None
        at = self._offset + step
        verdict = False
        if self.trial is not None and ranks.is_main():
            if at not in self._held and at not in self.reported:
                self.trial.report(value, at)
            verdict = bool(self.trial.should_prune())
        if at in self._this_fit and not self._warned:
            self._warned = True
            warnings.warn(
                f"OptunaPruning: a second record at step {at} in this fit (an "
                "epoch or validation with no optimizer step in between): Optuna "
                f"keeps one value per step, so {self.monitor.name}={value:.6g} "
                "is not reported (the pruner still judges the first). Fix: "
                "validate after optimizer steps, e.g. ValidationSchedule("
                "every_n_steps=...) rather than an epoch that skips its steps.",
                stacklevel=2,
            )
        self._this_fit.add(at)
        self.reported.setdefault(at, value)
        number = getattr(self.trial, "number", None)
        if ranks.world_size() > 1:  # rank 0's verdict (and trial) on every rank
            sent = ranks.broadcast_int(-1 if not verdict else (number or 0))
            verdict, number = sent >= 0, (sent if sent >= 0 else None)
        if not verdict:
            return None
        self.pruned, self.pruned_at = True, at
        trial = "trial" if number is None else f"trial {number}"
        self.stop_reason = (
            f"{self.name}: {trial} pruned at step {at} "
            f"({self.monitor.name}={value:.6g})"
        )
        return {"stop_training": True, "stop_reason": self.stop_reason}

    def on_train_end(self, exception: BaseException | None) -> None:
        """Runs at the end, after the others' ``on_train_end`` ran too: raises
        ``optuna.TrialPruned`` when the trial was pruned (unless the fit
        failed: then that error stands)."""
        if exception is None:
            self.check_pruned()

    def check_pruned(self) -> None:
        """Raises ``optuna.TrialPruned`` (with the ``stop_reason``) if the
        trial was pruned; does nothing otherwise."""
        if self.pruned:
            raise _optuna().TrialPruned(self.stop_reason)

    # -- saved state -----------------------------------------------------------
    def state_dict(self) -> dict:
        """What was reported (steps and values), the steps' offset and the
        pruning, as plain values."""
        return {
            "monitor": self.monitor.name,
            "reported": [[s, v] for s, v in sorted(self.reported.items())],
            "offset": self._offset,
            "pruned_at": self.pruned_at,
            "stop_reason": self.stop_reason,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores what ``state_dict`` returned (of the same monitor)."""
        keys = {"monitor", "reported", "offset", "pruned_at", "stop_reason"}
        if not isinstance(state, dict) or set(state) != keys:
            raise ValueError(
                f"OptunaPruning.load_state_dict: expected the keys {sorted(keys)}; "
                f"got {sorted(state) if isinstance(state, dict) else state!r}. "
                "Fix: pass what OptunaPruning.state_dict() returned."
            )
        if state["monitor"] != self.monitor.name:
            raise ValueError(
                f"OptunaPruning.load_state_dict: the state reported "
                f"{state['monitor']!r}, this callback reports "
                f"{self.monitor.name!r}. Fix: resume with the same monitor."
            )
        self.reported = {int(s): float(v) for s, v in state["reported"]}
        self._offset = int(state["offset"])
        self.pruned_at = state["pruned_at"]
        self.pruned = self.pruned_at is not None
        self.stop_reason = state["stop_reason"]

    def __repr__(self) -> str:
        number = getattr(self.trial, "number", None)
        trial = "None" if self.trial is None else f"trial {number}"
        return f"{self.name}({trial}, monitor={self.monitor.name!r})"

    def _check_direction(self) -> None:
        """Refuses a monitor that improves the other way than the study."""
        wanted = {"min": "minimize", "max": "maximize"}[self.monitor.mode]
        if self.direction is not None and self.direction != wanted:
            raise ValueError(
                f"OptunaPruning: monitor={self.monitor.name!r} improves as it "
                f"goes {'down' if wanted == 'minimize' else 'up'} "
                f"(mode={self.monitor.mode!r}), but the study is to "
                f"{self.direction}: the pruner would keep the worst trials. Fix: "
                f"optuna.create_study(direction={wanted!r}), or monitor a value "
                "that improves the study's way."
            )


def _check_trial(trial: Any) -> Any:
    """The trial, if it is an Optuna trial; None only off rank 0."""
    if trial is None:
        if ranks.rank() == 0:
            raise TypeError(
                "OptunaPruning: trial is None on rank 0 (or in one process), "
                "which reports to the study. Fix: pass the trial the objective "
                "function gets, OptunaPruning(trial); None is for ranks > 0 of "
                "a distributed run."
            )
        return None
    optuna = _optuna()
    if isinstance(trial, optuna.trial.FrozenTrial):
        raise TypeError(
            f"OptunaPruning: trial must be a live trial, the argument of the "
            f"objective function; got FrozenTrial {trial.number} (a record of "
            "the study, which cannot report or prune). Fix: def objective("
            "trial): ... OptunaPruning(trial, monitor='valid_loss')."
        )
    if not isinstance(trial, optuna.trial.BaseTrial):
        raise TypeError(
            f"OptunaPruning: trial must be an optuna.trial.Trial (the argument "
            f"of the objective function); got {trial!r} "
            f"({type(trial).__name__}). Fix: def objective(trial): ... "
            "OptunaPruning(trial, monitor='valid_loss')."
        )
    return trial


def _study_direction(study: Any) -> str | None:
    """``"minimize"`` or ``"maximize"``; None without a study (a FixedTrial)."""
    directions = getattr(study, "directions", None)
    if not directions:
        return None
    if len(directions) > 1:
        raise ValueError(
            f"OptunaPruning: the study has {len(directions)} objectives, and "
            "Optuna prunes only single-objective studies (Trial.report does "
            "not take several). Fix: optuna.create_study(direction=...) with "
            "one direction."
        )
    return directions[0].name.lower()


def _intermediate_values(trial: Any) -> dict:
    """The values the trial already holds in its storage, by step (none for a
    trial without a study, such as a ``FixedTrial``)."""
    study, number = getattr(trial, "study", None), getattr(trial, "number", None)
    if study is None or number is None:
        return {}
    for frozen in study.get_trials(deepcopy=False):
        if frozen.number == number:
            return frozen.intermediate_values
    return {}
