"""``TimeLimit``: suspends training when a wall-clock budget is spent, so
that a job under a cluster's time limit, rerun with the same script and a
``Checkpoint``, resumes exactly where it stopped.

The budget is per run (per job), not per experiment: each fit starts its
clock afresh, also a resumed one, since each job gets its own allocation of
the cluster's time (Lightning's ``Timer`` instead carries the elapsed time
over in its state, a budget for the whole experiment; fitlib's ``n_epochs``
and ``max_steps`` already bound that). Everything between the fit's start
and its end counts, validation and checkpoints included: the cluster counts
it too. The clock (``fitlib.time_budget``) is the host's, read once per
training batch; under torch.distributed rank 0's clock decides, agreed
about once a second (one small broadcast) and at each epoch's end.
"""

from __future__ import annotations

from typing import Any

from fitlib.callback import Callback
from fitlib.time_budget import TimeBudget


class TimeLimit(Callback):
    """Suspends the fit once ``max_time`` of wall-clock time has passed
    since it began (Lightning's ``Timer``, Ignite's ``TimeLimit``).

    After each training batch it reads the clock; once the budget is spent
    it returns ``suspend`` with a ``stop_reason`` (``"max_time=0:01:00
    reached after 0:01:00.3"``, which ``History.stop_reason`` keeps). The fit
    then ends right after that batch, or after the gradient-accumulation
    group it is in, with no record for the partial epoch; a budget spent
    during an epoch's validation ends the fit before the next epoch. With a
    ``Checkpoint`` the final checkpoint is one to resume from: rerunning the
    script goes on as if the fit had never stopped (see
    docs/how-to/train-within-a-time-limit.md). A stop that finishes the run
    (``EarlyStopping``, the last epoch) comes first.

    The budget is per fit: a resumed fit has the whole ``max_time`` again.
    It counts from the fit's start (``on_train_begin``), validation and
    checkpoints included; leave a margin below the cluster's limit for what
    runs before the fit and for the final save.
    ``fit(..., max_time=...)`` adds one (``Learner.fit`` too).

    Args:
        max_time: the budget: seconds (a number), a ``datetime.timedelta``,
            a string ``"DD:HH:MM:SS"`` or ``"HH:MM:SS"``, or a dict of
            ``timedelta``'s arguments (``{"hours": 11, "minutes": 30}``).

    Examples:
        >>> limit = TimeLimit("00:00:00:30")  # 30 seconds: ample here
        >>> history = fit(2, model, F.cross_entropy, opt, data, callbacks=[limit])
        >>> print(history.stop_reason)  # the fit ran its epochs
        None
        >>> limit.max_time, limit.elapsed() < 30
        (30.0, True)
    """

    order = 48  # after the stopping rules: a stop that finishes the run wins
    in_lr_find = False  # a sweep is not part of the run

    def __init__(self, max_time: Any) -> None:
        self.budget = TimeBudget(max_time, owner=self.name)  # (fit's check reads it)
        self.max_time = self.budget.seconds

    def elapsed(self) -> float:
        """Seconds since the fit began (the last fit's, once it ended)."""
        return self.budget.elapsed()

    def on_train_begin(self, iteration: int) -> None:
        """Runs as the fit begins: starts the clock."""
        self.budget.start(iteration)

    def on_batch_end(
        self, train: bool, iteration: int, stop_training: bool
    ) -> dict | None:
        """Runs after each batch: suspends once the budget is spent."""
        if not train or stop_training:
            return None
        return _suspend(self.budget.spent(iteration))

    def on_epoch_end(
        self, iteration: int, mid_epoch: bool, stop_training: bool
    ) -> dict | None:
        """Runs after validation: a budget spent then ends the fit before
        the next epoch."""
        if mid_epoch or stop_training:
            return None
        return _suspend(self.budget.spent(iteration, epoch_end=True))

    def on_train_end(self) -> None:
        """Runs as the fit ends: stops the clock."""
        self.budget.stop()

    def __repr__(self) -> str:
        return f"{self.name}(max_time={self.max_time:g})"


def _suspend(reason: str | None) -> dict | None:
    return None if reason is None else {"suspend": True, "stop_reason": reason}
