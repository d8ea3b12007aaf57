"""``EarlyStopping``: end training when a monitored value stops improving.

The value is read through ``Monitor``, once per epoch in one host transfer.
With ``restore_best`` the best epoch's weights are copied to the host (one
copy per improving epoch, not per batch) and loaded back when training ends.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fitlib.callback import Callback
from fitlib.checks import check_flag, check_int
from fitlib.errors import is_number
from fitlib.monitor import Monitor
from fitlib.serialization import host_copy
from fitlib.sharding import load_model, model_state

_STATE_KEYS = ("monitor", "wait", "best_epoch", "stopped_epoch")
# Since validations inside epochs: the steps of those records (None without).
_STEP_KEYS = ("best_step", "stopped_step")


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
    a row. With a baseline the count runs from the first counted epoch, so
    training stops unless the value beats the baseline within ``patience``
    epochs; an epoch that still improves on the best never stops it (as in
    Keras). (Earlier fitlib versions waited for the count to *exceed*
    ``patience``, fastai v1's rule: one epoch more. ``ReduceLROnPlateau``
    keeps torch's rule.)
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

    Attributes:
        wait: the bad epochs in a row so far (with a baseline: the counted
            epochs since a value last beat both the best and the baseline).
        best_epoch: the epoch of the best value, or None.
        stopped_epoch: the epoch after which it stopped training, or None.
        best_step: the step of the best record, when records carry their
            step (validations inside epochs), else None.
        stopped_step: the step of the record after which it stopped, likewise.

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
    ) -> None:
        self.monitor = Monitor(monitor, mode, min_delta, owner=self.name)
        self.patience = check_int(patience, "patience", owner=self.name, example=3)
        self.start_from_epoch = check_int(
            start_from_epoch, "start_from_epoch", owner=self.name, example=0
        )
        self.baseline = _check_baseline(baseline)
        self.restore_best = check_flag(
            restore_best,
            "restore_best",
            self.name,
            "EarlyStopping(..., restore_best=True)",
        )
        self._fitting = False  # between this fit's on_train_begin and end
        self._stopped_now = False  # stopped in this fit: print at its end
        self._at_step: int | None = None  # the step of the record being counted
        self.reset()

    def reset(self) -> None:
        """Forgets the best value and weights, the count and the stop."""
        self.monitor.reset()
        self.wait = 0
        self.best_epoch: int | None = None
        self.stopped_epoch: int | None = None
        self.best_step: int | None = None
        self.stopped_step: int | None = None
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
        self._fitting = True

    def on_epoch_end(
        self, epoch: int, record: dict, model: torch.nn.Module
    ) -> dict | None:
        """Runs after validation: counts a bad epoch, stops after too many."""
        value = self.monitor.read(record)
        if value is None or epoch < self.start_from_epoch:
            return None
        # Where this record is, for step() (whose signature subclasses keep).
        self._at_step = record.get("step")
        if self.step(value, epoch, model):
            return {"stop_training": True}
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
        self.wait += 1
        if self.monitor.update(value):
            self.best_epoch, self.best_step = epoch, at_step
            if self.restore_best and model is not None:
                # (a sharded model: gathered on rank 0, all ranks take part)
                self.best_weights = host_copy(model_state(model))
            if self._beats_baseline(value):
                self.wait = 0
            return False  # still improving: no stop, even below the baseline
        if self.wait < self.patience:
            return False
        self.stopped_epoch, self.stopped_step = epoch, at_step
        self._stopped_now = True
        return True

    def _beats_baseline(self, value: float) -> bool:
        if self.baseline is None:
            return True
        delta = self.monitor.min_delta
        if self.monitor.mode == "min":
            return value < self.baseline - delta
        return value > self.baseline + delta

    def _message(self, restored: bool) -> str:
        name, best = self.monitor.name, self.monitor.best
        if self.baseline is not None and not self._beats_baseline(best):
            why = f"did not beat baseline={self.baseline:.6g}"
        else:
            unit = "epoch(s)" if self.stopped_step is None else "validation(s)"
            why = f"did not improve for {self.wait} {unit}"
        if self.best_epoch is None:
            best_text = "no best value (every value was NaN or infinite)"
        else:
            where = _where(self.best_epoch, self.best_step)
            best_text = f"best {name}={best:.6g} at {where}"
        where = _where(self.stopped_epoch, self.stopped_step)
        text = (
            f"{self.name}: stopped after {where}: {name} {why} "
            f"(patience={self.patience}); {best_text}"
        )
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
        }
        if self.restore_best:
            state["best_weights"] = self.best_weights
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restores what ``state_dict`` returned."""
        expected = set(_STATE_KEYS) | ({"best_weights"} if self.restore_best else set())
        # (a state saved before the steps were kept: without them)
        if isinstance(state, dict) and set(_STEP_KEYS) <= set(state):
            expected |= set(_STEP_KEYS)
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
        if self.restore_best:
            weights = state["best_weights"]
            self.best_weights = None if weights is None else dict(weights)

    def __repr__(self) -> str:
        return (
            f"{self.name}(monitor={self.monitor.name!r}, mode={self.monitor.mode!r}, "
            f"min_delta={self.monitor.min_delta}, patience={self.patience}, "
            f"baseline={self.baseline}, restore_best={self.restore_best}, "
            f"start_from_epoch={self.start_from_epoch})"
        )


def _int_or_none(x: Any) -> int | None:
    return None if x is None else int(x)


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
