"""``ValidationSchedule``: when a fit validates."""

from __future__ import annotations

import warnings
from typing import Any

from fitlib.callback import Callback, inner_callback
from fitlib.checks import check_int


class ValidationSchedule(Callback):
    """Validates every n epochs, every n optimizer steps, from epoch k on.

    Without it a fit validates after every epoch. With it, a fit validates:

    - at the end of epoch ``e`` (0-based, as the table counts) when
      ``e >= start_epoch`` and ``e + 1`` is a multiple of ``every_n_epochs``
      (None: at no epoch's end);
    - inside the epochs from ``start_epoch`` on, after every
      ``every_n_steps``-th optimizer step of the fit (steps, not batches:
      with gradient accumulation, a batch that does not step does not count);
    - always at the end of the fit's last epoch (its ``epochs``, or where
      ``max_steps`` runs out), so the history ends with validation values.

    Each validation ends a record. Inside an epoch, ``on_epoch_end`` runs with
    ``mid_epoch`` True, on the record of the training since the previous
    record (``train_loss``, training metrics, ``time``) and of this
    validation; then the epoch's training goes on, in train mode. With
    ``every_n_steps`` every record carries ``step`` (after ``epoch``), which
    tells an epoch's records apart. The table writes a row per record; the
    Recorder, the loggers and ``Checkpoint(monitor=...)`` take each record as
    it comes; ``EarlyStopping`` and ``ReduceLROnPlateau`` count their
    patience in validations, and pass over a record without one (its
    validation values are None). A checkpoint saved after a validation inside
    an epoch resumes exactly after it. A validation that falls on the
    epoch's last step is the epoch's validation (one record, not two).

    Args:
        every_n_epochs: validate at the end of every n-th epoch (an int >= 1),
            or None.
        every_n_steps: validate after every n-th optimizer step (an int >= 1),
            or None.
        start_epoch: the first epoch (0-based) that validates, at a step or
            at its end; the fit's last epoch validates whatever it is.

    Examples:
        >>> learn.fit(1, lr=1e-3, callbacks=[ValidationSchedule(every_n_steps=2)])
        History(2 records in 1 epoch: train_loss ... -> ..., valid_loss ... -> ...,
                accuracy ... -> ...)
        >>> history = learn.fit(6, lr=1e-3, callbacks=[
        ...     ValidationSchedule(every_n_epochs=2, start_epoch=3)])
        >>> [record["valid_loss"] is not None for record in history]
        [False, False, False, True, False, True]
    """

    # Any order: the loop reads skip_validate and validate_now after the events
    # (and skip_validate set in a batch event, as TerminateOnNaN does, cancels
    # a validation asked for).
    order = 0
    in_lr_find = False  # a sweep does not validate

    def __init__(
        self,
        every_n_epochs: int | None = 1,
        every_n_steps: int | None = None,
        start_epoch: int = 0,
    ) -> None:
        owner = self.name
        self.every_n_epochs = check_int(
            every_n_epochs, "every_n_epochs", minimum=1, owner=owner, example=5,
            allow_none=True,
        )  # fmt: skip
        self.every_n_steps = check_int(
            every_n_steps, "every_n_steps", minimum=1, owner=owner, example=500,
            allow_none=True,
        )  # fmt: skip
        self.start_epoch = check_int(
            start_epoch, "start_epoch", minimum=0, owner=owner, example=10
        )
        if every_n_epochs is None and every_n_steps is None:
            raise ValueError(
                f"{owner}(every_n_epochs=None, every_n_steps=None) would validate "
                "only after the fit's last epoch. Fix: give every_n_epochs (e.g. "
                "5) or every_n_steps (e.g. 500)."
            )
        self.validates_mid_epoch = every_n_steps is not None

    def on_train_begin(self, data: Any, callbacks: list, n_epochs: int | None) -> None:
        """Runs before training: checks there is something to validate on,
        one schedule, and (else a warning) epochs from ``start_epoch`` on in
        the fit."""
        if getattr(data, "valid_dl", None) is None:
            raise ValueError(
                f"{self.name}: data.valid_dl is None, so there is nothing to "
                "validate on. Fix: give the data a valid_dl (DataBunch(train_dl, "
                f"valid_dl)), or leave {self.name} out."
            )
        schedules = [c for c in map(inner_callback, callbacks)
                     if isinstance(c, ValidationSchedule)]  # fmt: skip
        if len(schedules) > 1:
            raise ValueError(
                f"{' and '.join(map(repr, schedules))}: two schedules in one "
                "fit, where each skips the validations the other does not ask "
                "for, so one silently cancels the other's. Fix: merge them into "
                "one ValidationSchedule (it takes every_n_epochs, every_n_steps "
                "and start_epoch together)."
            )
        if n_epochs is not None and self.start_epoch >= n_epochs:
            # A warning: a schedule kept for a longer fit still validates
            # after this fit's last epoch.
            warnings.warn(
                f"{self!r}: start_epoch={self.start_epoch} is past a fit of "
                f"{n_epochs} epoch(s) (epochs count from 0), so it validates "
                "only after the last epoch. Fix: a start_epoch below "
                f"{n_epochs}, or more epochs, if you want more validations.",
                UserWarning,
                stacklevel=2,
            )

    def on_epoch_begin(self, epoch: int, n_epochs: int | None) -> dict | None:
        """Runs at each epoch's start: skips its end's validation unless due."""
        last = n_epochs is not None and epoch == n_epochs - 1
        n = self.every_n_epochs
        due = n is not None and epoch >= self.start_epoch and (epoch + 1) % n == 0
        return None if due or last else {"skip_validate": True}

    def on_step_end(
        self, skip_step: bool, step: int, epoch: int, max_steps: int | None
    ) -> dict | None:
        """Runs after each batch's step: asks for a validation when one is due."""
        if skip_step:
            return None
        done = step + 1  # the handler counts this step after the hooks
        if max_steps is not None and done >= max_steps:
            return {"validate_now": True}  # the fit's last step
        n = self.every_n_steps
        if n is not None and done % n == 0 and epoch >= self.start_epoch:
            return {"validate_now": True}
        return None

    def __repr__(self) -> str:
        return (
            f"{self.name}(every_n_epochs={self.every_n_epochs}, every_n_steps="
            f"{self.every_n_steps}, start_epoch={self.start_epoch})"
        )
