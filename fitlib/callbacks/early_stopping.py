"""``EarlyStopping``: end training when a monitored value stops improving,
reaches a target, diverges or is not finite.

The value is read through ``Monitor``, once per epoch in one host transfer.
With ``restore_best`` the best epoch's weights are copied to the host (one
copy per improving epoch, not per batch) and loaded back when training ends.
Every rule reads only the record (the same on every rank under
torch.distributed) and the loop's counters, so every rank stops at the same
record; keep it so (no rank-local value in a rule).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fitlib.callback import Callback
from fitlib.checks import check_flag, check_int, check_number
from fitlib.errors import is_number
from fitlib.monitor import Monitor
from fitlib.serialization import host_copy
from fitlib.sharding import load_model, model_state

_STATE_KEYS = ("monitor", "wait", "best_epoch", "stopped_epoch")
# Since validations inside epochs: the steps of those records (None without).
_STEP_KEYS = ("best_step", "stopped_step")
# Since the stopping rules: which one stopped training, and the sentence.
_STOP_KEYS = ("stop_rule", "stop_reason")
# The names ``stop_rule`` takes, one per rule.
RULES = ("check_finite", "stopping_threshold", "divergence_threshold", "baseline",
         "patience")  # fmt: skip


class EarlyStopping(Callback):
    """Stops training when ``monitor`` has not improved for too many epochs.

    The rule of Keras 3, Lightning, Ignite and fastai 2. After each epoch
    that has a value (from ``start_from_epoch`` on), the epoch is *bad* when
    the value does not beat the best so far by more than ``min_delta``, or,
    with a ``baseline``, does not beat the baseline by more than
    ``min_delta`` either; an epoch that beats both resets the count.
    Training stops after a bad epoch that does not improve on the best once
    the count *reaches* ``patience``: with ``patience=0`` or ``1`` at the
    first epoch that does not improve, with ``patience=2`` at the second in
    a row. With a baseline the count runs from the first counted epoch
    until a value beats the baseline, so once ``patience`` epochs have gone
    by without one, training stops at the first epoch that does not improve
    on the best: an epoch that still improves never stops it (as in Keras),
    so a value that improves slowly, far from the baseline, trains on.
    (Earlier fitlib versions waited for the count to *exceed* ``patience``,
    fastai v1's rule: one epoch more. ``ReduceLROnPlateau`` keeps torch's
    rule.)
    NaN is never an improvement; an epoch in which the value was not
    computed (None in the record: validation skipped) is not counted. A
    NaN at the first epoch counts too: with ``patience=0`` or ``1`` training
    stops after epoch 0, where Keras (which never stops at epoch 0) goes
    on; use ``start_from_epoch=1`` to leave the first epoch out.

    The best value (``monitor.best``) and its epoch track the best value seen,
    also below the baseline. A fit that starts at ``iteration == 0`` resets
    the state; a resumed one keeps what ``load_state_dict`` restored. Epochs
    are 0-based, as in the state and the progress table. When it stops, one
    line is printed at the end of training.

    With validations inside epochs (``ValidationSchedule(every_n_steps=...)``)
    each record with a value counts, so ``patience`` is in validations, and
    training stops right after the validation that reaches it; ``best_step``
    and ``stopped_step`` say where in the epoch.

    Besides patience, three rules stop at once, judged on each counted
    record in this order (the first that holds is the one reported):
    ``check_finite`` (the value is NaN or infinite), ``stopping_threshold``
    (the value reached it: at or beyond it, ``<=`` in "min" mode, ``>=`` in
    "max"; good enough) and ``divergence_threshold`` (the value is strictly
    worse than it: hopeless). Then patience (or the baseline) as above. The
    best value and its weights are taken before the rules, so a record that
    reaches ``stopping_threshold`` with a new best is the one
    ``restore_best`` loads. ``min_delta_mode="rel"`` makes ``min_delta`` a
    fraction of the best value's size (see ``Monitor``).

    ``min_epochs`` and ``min_steps`` hold back every stop of this callback
    until that many epochs have completed and that many optimizer steps
    (``step``: with gradient accumulation, fewer than batches) have run. A
    validation inside an epoch counts the epochs completed before it: one
    in epoch 2 (0-based) counts two. Records before the minimum still count
    (the best value, the bad epochs), and each later record is judged
    afresh: a patience that ran out during the minimum stops at the first
    record after it that does not improve; a threshold reached during it
    stops at the first record after it that still reaches it. (Lightning's
    Trainer keeps a stop asked for earlier and ends at the first step past
    the minimum; here stops happen at records.) ``start_from_epoch``
    differs: epochs before it are not looked at at all.

    Each stop returns ``stop_reason`` (the fit's ``History.stop_reason``)
    naming the rule, the value and the threshold, e.g. ``"EarlyStopping:
    valid_loss=0.041 reached stopping_threshold=0.05"``; ``stop_rule`` is the
    rule's name (one of ``RULES``).

    Args:
        monitor: ``"valid_loss"``, ``"train_loss"`` or a metric's name.
        min_delta: the least change that counts as an improvement (>= 0).
        patience: the bad epochs in a row that stop training (>= 0; 0 and 1
            both stop at the first epoch that does not improve).
        mode: ``"min"``, ``"max"`` or ``"auto"`` (losses and error rates go
            down; accuracy, f-scores and r2 go up).
        baseline: a value to beat, or None.
        restore_best: load the best epoch's weights when training ends,
            whatever ended it (also an error or Ctrl-C), if an epoch was
            evaluated; the copy is kept on the host.
        start_from_epoch: epochs before this one (0-based) are not counted
            (a warm-up during which no improvement is expected).
        check_finite: stop at a NaN or infinite value (else such a value is
            a bad epoch, as any that does not improve).
        stopping_threshold: stop once the value reaches this (or None).
        divergence_threshold: stop once the value is worse than this (or
            None); it must be worse than ``stopping_threshold``.
        min_delta_mode: ``"abs"`` (``min_delta`` is an amount of the value)
            or ``"rel"`` (a fraction of the best value's size).
        min_epochs: epochs that must complete before any stop (>= 0).
        min_steps: optimizer steps that must run before any stop (>= 0).

    Attributes:
        wait: the bad epochs in a row so far (with a baseline: the counted
            epochs since a value last beat both the best and the baseline).
        best_epoch: the epoch of the best value, or None.
        stopped_epoch: the epoch after which it stopped training, or None.
        best_step: the step of the best record, when records carry their
            step (validations inside epochs), else None.
        stopped_step: the step of the record after which it stopped, likewise.
        stop_rule: the rule that stopped training (``"patience"``,
            ``"baseline"``, ``"check_finite"``, ``"stopping_threshold"``,
            ``"divergence_threshold"``), or None.
        stop_reason: the sentence it returned as ``stop_reason``, or None.

    Examples:
        >>> stop = EarlyStopping("accuracy", patience=2, restore_best=True)
        >>> fit(50, model, F.cross_entropy, opt, data, metrics=[accuracy],
        ...     callbacks=[stop])
        EarlyStopping: stopped after epoch 3: accuracy did not improve for 2
        epoch(s) (patience=2); best accuracy=0.5 at epoch 1; restored its weights
        History(4 epochs: train_loss ... -> ..., valid_loss ... -> ...,
                accuracy 0.4688 -> 0.5)
        >>> stop.best_epoch, stop.stopped_epoch
        (1, 3)
        >>> target = EarlyStopping("accuracy", stopping_threshold=0.5)
        >>> history = fit(50, model, F.cross_entropy, opt, data,
        ...               metrics=[accuracy], callbacks=[target])
        EarlyStopping: stopped after epoch 0: accuracy=0.5 reached
        stopping_threshold=0.5; best accuracy=0.5 at epoch 0
        >>> history.stop_reason
        'EarlyStopping: accuracy=0.5 reached stopping_threshold=0.5'
    """

    # After ReduceLROnPlateau (40): on a shared plateau the lr is lowered
    # first. Before the Recorder (50) and ProgressBar (60), which still record
    # and show the epoch it stops after, and after whose table it prints.
    order = 45
    in_lr_find = False  # a sweep is not part of the run it records

    def __init__(
        self,
        monitor: str = "valid_loss",
        min_delta: float = 0.0,
        patience: int = 0,
        mode: str = "auto",
        baseline: float | None = None,
        restore_best: bool = False,
        start_from_epoch: int = 0,
        check_finite: bool = False,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        min_delta_mode: str = "abs",
        min_epochs: int = 0,
        min_steps: int = 0,
    ) -> None:
        self.monitor = Monitor(
            monitor, mode, min_delta, owner=self.name, min_delta_mode=min_delta_mode
        )
        self.patience = check_int(patience, "patience", owner=self.name, example=3)
        self.start_from_epoch = check_int(
            start_from_epoch, "start_from_epoch", owner=self.name, example=0
        )
        self.min_epochs = check_int(
            min_epochs, "min_epochs", owner=self.name, example=5
        )
        self.min_steps = check_int(min_steps, "min_steps", owner=self.name, example=100)
        self.baseline = _check_baseline(baseline)
        self.check_finite = check_flag(
            check_finite, "check_finite", self.name,
            "EarlyStopping(..., check_finite=True)",
        )  # fmt: skip
        self.stopping_threshold = self._threshold(stopping_threshold, "stopping")
        self.divergence_threshold = self._threshold(divergence_threshold, "divergence")
        self._check_thresholds()
        self.restore_best = check_flag(
            restore_best,
            "restore_best",
            self.name,
            "EarlyStopping(..., restore_best=True)",
        )
        self._fitting = False  # between this fit's on_train_begin and end
        self._stopped_now = False  # stopped in this fit: print at its end
        self._at_step: int | None = None  # the step of the record being counted
        # (epochs completed, optimizer steps) at that record, for the minimum
        self._progress: tuple[int, int] | None = None
        self.reset()

    def reset(self) -> None:
        """Forgets the best value and weights, the count and the stop."""
        self.monitor.reset()
        self.wait = 0
        self.best_epoch: int | None = None
        self.stopped_epoch: int | None = None
        self.best_step: int | None = None
        self.stopped_step: int | None = None
        self.stop_rule: str | None = None
        self.stop_reason: str | None = None
        self.best_weights: dict[str, torch.Tensor] | None = None

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
        """Runs before training: checks the monitor; a new fit resets."""
        self.monitor.start(metrics, data, train_metrics, callbacks, loss_func)
        if iteration == 0:
            self.reset()
        self._stopped_now = False
        self._progress = None
        self._fitting = True

    def on_epoch_end(
        self,
        epoch: int,
        record: dict,
        model: torch.nn.Module,
        step: int,
        mid_epoch: bool,
    ) -> dict | None:
        """Runs after validation: judges the value, stops when a rule says so."""
        value = self.monitor.read(record)
        if value is None or epoch < self.start_from_epoch:
            return None
        # Where this record is, for step() (whose signature subclasses keep).
        self._at_step = record.get("step")
        self._progress = (epoch if mid_epoch else epoch + 1, step)
        if self.step(value, epoch, model):
            return {"stop_training": True, "stop_reason": self.stop_reason}
        return None

    def on_train_end(self, model: torch.nn.Module) -> None:
        """Runs at the end, also after an error: restores the best weights."""
        if not self._fitting:  # this fit failed before our on_train_begin
            return
        self._fitting = False
        restored = self.restore_best and self.best_weights is not None
        if restored:
            load_model(model, self.best_weights)
        if self._stopped_now:
            print(self._message(restored))

    # -- the rule --------------------------------------------------------------
    def step(self, value: float, epoch: int, model: torch.nn.Module | None) -> bool:
        """Takes one counted record's ``value`` into account; True to stop."""
        at_step = getattr(self, "_at_step", None)  # the record's, inside epochs
        rule = self._judge(value, epoch, at_step, model)
        if rule is None or not self._past_minimum():
            return False
        self.stopped_epoch, self.stopped_step = epoch, at_step
        self.stop_rule = rule
        self.stop_reason = f"{self.name}: {self._why(rule, value, at_step)}"
        self._stopped_now = True
        return True

    def _judge(
        self, value: float, epoch: int, at_step: int | None, model: Any
    ) -> str | None:
        """Counts the record; the name of the rule that says stop, or None."""
        self.wait += 1
        if self.check_finite and not math.isfinite(value):
            return "check_finite"  # (never a best, not even -inf in "min")
        improved = self.monitor.update(value)
        if improved:
            self.best_epoch, self.best_step = epoch, at_step
            if self.restore_best and model is not None:
                # (a sharded model: gathered on rank 0, all ranks take part)
                self.best_weights = host_copy(model_state(model))
            if self._beats_baseline(value):
                self.wait = 0
        target, hopeless = self.stopping_threshold, self.divergence_threshold
        if target is not None and (
            value == target or self.monitor.beats(value, target)
        ):
            return "stopping_threshold"
        if hopeless is not None and self.monitor.beats(hopeless, value):
            return "divergence_threshold"
        if improved or self.wait < self.patience:
            return None  # still improving: no stop, even below the baseline
        below = self.baseline is not None and not self._beats_baseline(
            self.monitor.best
        )
        return "baseline" if below else "patience"

    def _past_minimum(self) -> bool:
        """Whether ``min_epochs`` and ``min_steps`` have passed at this record
        (True for a record fed to ``step`` by hand)."""
        progress = getattr(self, "_progress", None)
        if progress is None:
            return True
        epochs, steps = progress
        return epochs >= self.min_epochs and steps >= self.min_steps

    def _why(self, rule: str, value: float, at_step: int | None) -> str:
        """The rule, the value and the threshold, in words."""
        name = self.monitor.name
        if rule == "check_finite":
            return f"{name}={value:.6g} is not finite (check_finite=True)"
        if rule == "stopping_threshold":
            return (
                f"{name}={value:.6g} reached "
                f"stopping_threshold={self.stopping_threshold:.6g}"
            )
        if rule == "divergence_threshold":
            return (
                f"{name}={value:.6g} is worse than "
                f"divergence_threshold={self.divergence_threshold:.6g}"
            )
        unit = "epoch(s)" if at_step is None else "validation(s)"
        if rule == "baseline":  # (it trained on while it improved on the best)
            why = (
                f"did not beat baseline={self.baseline:.6g} in {self.wait} {unit} "
                "and stopped improving"
            )
        else:
            why = f"did not improve for {self.wait} {unit}"
        return f"{name} {why} (patience={self.patience})"

    def _beats_baseline(self, value: float) -> bool:
        if self.baseline is None:
            return True
        delta = self.monitor.min_delta
        if self.monitor.min_delta_mode == "rel":
            delta *= abs(self.baseline)
        if self.monitor.mode == "min":
            return value < self.baseline - delta
        return value > self.baseline + delta

    def _message(self, restored: bool) -> str:
        name, best = self.monitor.name, self.monitor.best
        why = (self.stop_reason or "").removeprefix(f"{self.name}: ")
        if self.best_epoch is None:
            best_text = "no best value (every value was NaN or infinite)"
        else:
            where = _where(self.best_epoch, self.best_step)
            best_text = f"best {name}={best:.6g} at {where}"
        where = _where(self.stopped_epoch, self.stopped_step)
        text = f"{self.name}: stopped after {where}: {why}; {best_text}"
        return text + ("; restored its weights" if restored else "")

    # -- saved state -----------------------------------------------------------
    def state_dict(self) -> dict:
        """Best value, bad-epoch count, best and stopped epochs (and weights)."""
        state = {
            "monitor": self.monitor.state_dict(),
            "wait": self.wait,
            "best_epoch": self.best_epoch,
            "stopped_epoch": self.stopped_epoch,
            "best_step": self.best_step,
            "stopped_step": self.stopped_step,
            "stop_rule": self.stop_rule,
            "stop_reason": self.stop_reason,
        }
        if self.restore_best:
            state["best_weights"] = self.best_weights
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restores what ``state_dict`` returned."""
        expected = set(_STATE_KEYS) | ({"best_weights"} if self.restore_best else set())
        # (a state saved before the steps, or the rules, were kept: without them)
        for keys in (_STEP_KEYS, _STOP_KEYS):
            if isinstance(state, dict) and set(keys) <= set(state):
                expected |= set(keys)
        if not isinstance(state, dict) or set(state) != expected:
            got = sorted(state) if isinstance(state, dict) else state
            raise ValueError(
                f"EarlyStopping.load_state_dict: expected the keys "
                f"{sorted(expected)}; got {got!r}. Fix: pass what "
                "EarlyStopping.state_dict() returned, from an EarlyStopping "
                f"with restore_best={self.restore_best}."
            )
        self.monitor.load_state_dict(state["monitor"])
        self.wait = int(state["wait"])
        self.best_epoch = _int_or_none(state["best_epoch"])
        self.stopped_epoch = _int_or_none(state["stopped_epoch"])
        self.best_step = _int_or_none(state.get("best_step"))
        self.stopped_step = _int_or_none(state.get("stopped_step"))
        self.stop_rule = _str_or_none(state.get("stop_rule"))
        self.stop_reason = _str_or_none(state.get("stop_reason"))
        if self.restore_best:
            weights = state["best_weights"]
            self.best_weights = None if weights is None else dict(weights)

    def __repr__(self) -> str:
        return (
            f"{self.name}(monitor={self.monitor.name!r}, mode={self.monitor.mode!r}, "
            f"min_delta={self.monitor.min_delta}, patience={self.patience}, "
            f"baseline={self.baseline}, restore_best={self.restore_best}, "
            f"start_from_epoch={self.start_from_epoch}, "
            f"check_finite={self.check_finite}, "
            f"stopping_threshold={self.stopping_threshold}, "
            f"divergence_threshold={self.divergence_threshold}, "
            f"min_delta_mode={self.monitor.min_delta_mode!r}, "
            f"min_epochs={self.min_epochs}, min_steps={self.min_steps})"
        )

    # -- argument checks -------------------------------------------------------
    def _threshold(self, value: Any, kind: str) -> float | None:
        return check_number(
            value, f"{kind}_threshold", owner=self.name, allow_none=True,
            example=0.05 if kind == "stopping" else 10.0,
        )  # fmt: skip

    def _check_thresholds(self) -> None:
        target, hopeless = self.stopping_threshold, self.divergence_threshold
        if target is None or hopeless is None or self.monitor.beats(target, hopeless):
            return
        way = "below" if self.monitor.mode == "min" else "above"
        raise ValueError(
            f"{self.name}: stopping_threshold={target:g} must be better than "
            f"divergence_threshold={hopeless:g} (mode={self.monitor.mode!r}: "
            f"{way} it); the value would reach one before it could reach the "
            "other. Fix: e.g. EarlyStopping(stopping_threshold=0.05, "
            "divergence_threshold=10.0) for a loss."
        )


def _int_or_none(x: Any) -> int | None:
    return None if x is None else int(x)


def _str_or_none(x: Any) -> str | None:
    return None if x is None else str(x)


def _where(epoch: int | None, step: int | None) -> str:
    """``epoch 3``, or ``epoch 3 (step 1200)`` for a record inside an epoch."""
    return f"epoch {epoch}" if step is None else f"epoch {epoch} (step {step})"


def _check_baseline(baseline: Any) -> float | None:
    if baseline is None:
        return None
    number = is_number(baseline)
    if not number or math.isnan(baseline):
        error = ValueError if number else TypeError
        raise error(
            f"EarlyStopping: baseline must be a number (not NaN) or None; got "
            f"{baseline!r}. Fix: e.g. baseline=0.5 (the value to beat), or None."
        )
    return float(baseline)
