"""Hyper-parameter search: ``search`` runs an Optuna study whose trials are
Learners, each in a run directory of its own, retried exactly after a crash,
on one worker or many sharing one storage; ``load_best`` rebuilds the best.

A trial is ``make_learner(trial)`` (it asks the trial for its values, as
Hugging Face's ``model_init`` does) trained by ``fit(learn, trial)``. Before
``make_learner`` runs, every generator is seeded with ``seed + n`` (python,
numpy, torch), where ``n`` is the trial's number, or for a retry the number of
the trial it retries: a retry builds the same model. The trial gets its run
directory ``directory/trial-<n>/`` (the Learner's ``path``), a ``Checkpoint``
there and an ``OptunaPruning`` callback on ``monitor``; its value is the
monitored value of the fit's last record (or what ``fit`` returns, if a
number).

Storage. The default is Optuna's journal storage on a file,
``directory/study.log`` (``JournalFileBackend``): embedded (no server), an
append-only log that many processes share through a lock file, on a local
disk or NFS. SQLite, the other embedded choice, locks the whole database on
each write and fails with "database is locked" under many writers, and does
not work on NFS. Any Optuna storage is taken instead: a URL (``"postgresql:
//..."``, ``"mysql://..."``, ``"sqlite:///..."``), a storage object, or a
``study``.

Retries. A worker killed outright (SIGKILL, out of memory, a node lost)
leaves its trial RUNNING; the next worker to claim a trial finds it dead by
its free ``flock`` (``tune_retries``), marks it FAIL and queues it again;
the retry resumes from its directory's checkpoint, exactly. A worker judges
only the trials claimed in its own ``directory`` (tagged with the token in
``directory/.fitlib-id``), so workers on machines with directories of their
own leave each other's trials alone. A fit that ends suspended (``max_time``,
``TimeLimit``, or ``timeout``'s deadline) fails its trial, marked, and queues
it again in the same way: the next run resumes it exactly. ``search`` is
one process per worker: a search under ``torchrun`` is refused.

``n_trials`` counts the study's trials, whichever worker ran them, a trial
and its retries once: each worker runs the same script and stops when the
study holds ``n_trials`` (counted under the study's lock: never more).

Defaults for short trials: ``TPESampler(n_startup_trials=5)`` (TPE handles
log-scale, integer and categorical values together; 5 random trials rather
than 10 before it models, as a search of a few dozen trials cannot spend 10),
seeded from ``(seed, n)`` for trial ``n`` (made anew for each trial:
workers with one seed do not draw the same values, and one worker's search
is reproducible), and ``MedianPruner(n_startup_trials=5, n_min_trials=3)``:
a trial is pruned when its best value so far is worse than the median of
the earlier trials' at the same optimizer step, once 5 trials have finished
and 3 have reported at that step (the first validations, where trials
differ most by chance, are judged against several others, not one).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fitlib.callback import Callback
from fitlib.callbacks.checkpoint import Checkpoint
from fitlib.callbacks.optuna_pruning import OptunaPruning
from fitlib.callbacks.time_limit import TimeLimit
from fitlib.checkpoint_files import checkpoint_files
from fitlib.checks import check_path
from fitlib.errors import did_you_mean
from fitlib.learner import Learner
from fitlib.resume import give_states
from fitlib.serialization import safe_load
from fitlib.tune_mlflow import StudyRuns
from fitlib.tune_progress import TrialProgress
from fitlib.tune_retries import (
    CLAIMED_IN,
    FINISHED_NOTE,
    NOTE,
    REQUEUE,
    STUDY_LOCK,
    TRIAL_LOCK,
    FileLock,
    best_trial,
    directory_id,
    enough,
    lineage,
    mark,
    requeue_marked,
    retry_dead,
    run_name,
)
from fitlib.tune_study import (
    OWNER,
    Options,
    default_sampler,
    open_study,
    optuna_module,
    refuse_distributed,
)

_OWNER = OWNER


def search(
    make_learner: Callable[[Any], Learner],
    fit: Callable[[Learner, Any], Any],
    n_trials: int = 20,
    *,
    monitor: str = "valid_loss",
    direction: str | None = None,
    directory: str | os.PathLike = "runs",
    storage: Any = None,
    study_name: str = "search",
    study: Any = None,
    sampler: Any = None,
    pruner: Any = None,
    seed: int = 0,
    timeout: float | None = None,
    mlflow: str | None = None,
    progress: bool | None = None,
    checkpoint: dict | None = None,
    retry: bool = True,
    max_retries: int = 3,
) -> Search:
    """Runs an Optuna study of ``n_trials`` trials, each a Learner trained in
    ``directory/trial-<n>/`` with pruning and a checkpoint (the module's
    docstring says how trials are seeded, stored and retried).

    Run the same call in several processes (or machines, with a shared
    ``directory`` and a storage URL) to search with several workers.

    Args:
        make_learner: builds a ``Learner`` from an ``optuna.Trial``
            (``trial.suggest_float("wd", 1e-5, 1e-1, log=True)``...).
        fit: trains it: ``lambda learn, trial: learn.fit_one_cycle(3,
            trial.suggest_float("lr", 1e-4, 1e-1, log=True))``; a number it
            returns is the trial's value, else the monitored value of the
            last record.
        n_trials: the study's trials in all, over every worker.
        monitor: the record value reported at every validation and pruned on.
        direction: ``"minimize"`` or ``"maximize"``; None reads it off
            ``monitor`` (losses down, accuracy up).
        directory: the study's folder: run directories, default storage.
        storage: an Optuna storage or URL; None: ``directory/study.log``.
        study_name: the study's name in the storage (joined if it exists).
        study: an ``optuna.Study`` to run instead (storage, name, sampler,
            pruner and direction are then its own).
        sampler: an Optuna sampler; None: the default above.
        pruner: an Optuna pruner; None: the default above.
        seed: trial ``n``'s generators are seeded with ``seed + n``, the
            default sampler from ``(seed, n)``.
        timeout: seconds after which this worker starts no new trial; the
            trial running then is suspended at that time (a ``TimeLimit`` of
            the time left) and resumed exactly by the next run.
        mlflow: a tracking URI: each trial logged by an ``MLflowLogger`` as a
            nested run of the study's run (experiment ``study_name``). An
            ``MLflowLogger`` among the Learner's callbacks is nested too.
        progress: a live table in a notebook, a line per trial elsewhere;
            None: on, False: silent.
        checkpoint: more arguments of each trial's ``Checkpoint``
            (default ``keep_last=1``, a checkpoint every epoch).
        retry: retry the trials of dead workers (see the module docstring).
        max_retries: how many times one trial is retried.

    Returns:
        a ``Search``: the study, its best trial, ``best_learner()``.

    Examples:
        >>> from fitlib.tune import search
        >>> def make_learner(trial):
        ...     width = trial.suggest_categorical("width", [8, 16])
        ...     net = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 3))
        ...     return Learner(data, net, F.cross_entropy, progress=False)
        >>> found = search(make_learner, lambda learn, trial: learn.fit(
        ...     1, lr=trial.suggest_float("lr", 1e-3, 1e-1, log=True)),
        ...     n_trials=2, progress=False)
        >>> found
        Search('search', 2 trials (2 complete, 0 pruned),
               best: trial ... valid_loss=...)
        >>> sorted(found.best_params)
        ['lr', 'width']
    """
    opts = Options.checked(locals())
    refuse_distributed()
    opts.own_sampler = study is None and sampler is None
    optuna = optuna_module()
    opts.directory.mkdir(parents=True, exist_ok=True)
    objective = _Objective(opts, FileLock(opts.directory / STUDY_LOCK))
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # our lines say it
    try:
        study = study if study is not None else open_study(optuna, opts)
        opts.direction = study.direction.name.lower()
        _run_trials(optuna, study, objective, TrialProgress(opts.progress, monitor))
    finally:
        optuna.logging.set_verbosity(verbosity)
        if objective.mlflow.runs:
            objective.mlflow.end(study, enough(study, opts.n_trials))
    return Search(study, opts.directory, make_learner, opts.seed, monitor)


def _run_trials(
    optuna: Any, study: Any, objective: _Objective, show: TrialProgress
) -> None:
    """This worker's trials, one at a time, each claimed under the study's
    lock (released by the objective once the trial's lock is held)."""
    opts, start = objective.opts, time.monotonic()
    if opts.timeout is not None:  # each trial's fit suspends at the deadline
        objective.deadline = start + opts.timeout
    ran = False  # a trial in this call (else a rerun of a finished search)
    while opts.timeout is None or time.monotonic() - start < opts.timeout:
        with objective.study_lock:
            if opts.retry:
                retry_dead(study, opts.directory, opts.max_retries)
            if enough(study, opts.n_trials):
                if not ran:
                    show.nothing_to_run(study, opts.n_trials)
                return
            if opts.own_sampler:  # drawn for this trial's number
                study.sampler = default_sampler(optuna, opts.seed, len(study.trials))
            try:
                ran = True
                study.optimize(objective, n_trials=1, catch=(_SuspendedError,))
            finally:  # after Optuna's tell: the trial is no longer RUNNING
                objective.trial_lock.release()
        if objective.suspended:  # failed, marked: queued to resume next run
            with objective.study_lock:
                requeue_marked(study, objective.token, opts.max_retries)
        show.trial_done(study, objective.last)
        if objective.suspended:  # its time is spent: this worker stops
            return


def load_best(
    study: Any, make_learner: Callable, directory: str | os.PathLike = "runs",
    seed: int = 0, monitor: str = "valid_loss",
) -> Learner:  # fmt: skip
    """The best trial's Learner: ``make_learner`` with its parameters (an
    ``optuna.trial.FixedTrial``), seeded as the trial was, with the weights,
    optimizer and Recorder of its run directory's newest checkpoint: the
    weights that scored its value. When the trial validated a weight average
    (``EMA(validate_on="ema")``, or ``"both"`` with an ``ema_`` ``monitor``),
    the model gets the average, as the checkpoint holds the live weights as
    the model and the average in the callback's state.

    Examples:
        >>> from fitlib.tune import load_best, search
        >>> def make_learner(trial):
        ...     wd = trial.suggest_float("wd", 1e-4, 1e-1, log=True)
        ...     net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        ...     return Learner(data, net, F.cross_entropy, wd=wd, progress=False)
        >>> found = search(make_learner, lambda learn, trial: learn.fit(2, lr=0.01),
        ...                n_trials=2, progress=False)
        >>> best = load_best(found.study, make_learner)
        >>> best.recorder.valid_losses[-1] == found.best_value
        True
    """
    optuna = optuna_module()
    best = study.best_trial
    where = check_path(directory, "directory", owner="load_best",
                       what="a directory path", example="'runs'")  # fmt: skip
    run_dir = where / run_name(best)
    files = checkpoint_files(run_dir)
    if not files:
        raise ValueError(
            f"load_best: the best trial ({best.number}) has no checkpoint in "
            f"{str(run_dir)!r}. Fix: pass the directory given to search() "
            "(its run directories hold the checkpoints): load_best(study, "
            "make_learner, directory=<that directory>)."
        )
    seed_everything(seed + lineage(best))
    learn = make_learner(optuna.trial.FixedTrial(best.params, best.number))
    learn.load(files[-1])
    give_states([learn.recorder], safe_load(files[-1])["callbacks"])
    for cb in learn.callbacks:
        if _validated_the_average(cb, monitor):
            cb.copy_to(learn.model)
    return learn


def _validated_the_average(cb: Any, monitor: str) -> bool:
    """Whether ``cb`` keeps a weight average (``averages_weights``, with
    ``copy_to``) that scored ``monitor``: validated on the average alone, or
    beside the live weights with ``monitor`` one of the average's values."""
    if not getattr(cb, "averages_weights", False) or not hasattr(cb, "copy_to"):
        return False
    on = getattr(cb, "validate_on", None)
    scored = on == "ema" or (on == "both" and monitor.startswith("ema_"))
    return scored and bool(getattr(cb, "updates", 0))


@dataclass
class Search:
    """What ``search`` returns: the study and where its trials ran.

    ``best_trial``, ``best_params`` and ``best_value`` are the study's;
    ``best_learner()`` loads the best trial's Learner back (``load_best``);
    ``run_dir(trial)`` is a trial's run directory (a retry's is the one of
    the trial it retries).
    """

    study: Any
    directory: Path
    make_learner: Callable
    seed: int = 0
    monitor: str = "valid_loss"

    @property
    def best_trial(self) -> Any:
        return self.study.best_trial

    @property
    def best_params(self) -> dict:
        return self.study.best_params

    @property
    def best_value(self) -> float:
        return self.study.best_value

    def run_dir(self, trial: Any) -> Path:
        return self.directory / run_name(trial)

    def best_learner(self) -> Learner:
        return load_best(self.study, self.make_learner, self.directory, self.seed,
                         self.monitor)  # fmt: skip

    def __repr__(self) -> str:
        states = [t.state.name for t in self.study.trials]
        done = states.count("COMPLETE"), states.count("PRUNED")
        best = best_trial(self.study)
        tail = "none yet"
        if best is not None:
            tail = f"trial {best.number} {self.monitor}={best.value:.4g}"
        return (
            f"Search({self.study.study_name!r}, {len(states)} trials ({done[0]} "
            f"complete, {done[1]} pruned), best: {tail})"
        )


# -- one trial -----------------------------------------------------------------
def seed_everything(seed: int) -> None:
    """Seeds python's, numpy's and torch's global generators (CUDA's too)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class _Objective:
    """Optuna's objective: one trial, run in its directory under its lock."""

    def __init__(self, opts: Options, study_lock: FileLock) -> None:
        self.opts, self.study_lock = opts, study_lock
        self.last: Any = None  # the trial this worker ran last (a FrozenTrial)
        self.trial_lock = FileLock(Path(os.devnull))  # held while a trial runs
        self.mlflow = StudyRuns(study_lock, opts.mlflow)
        self.token = directory_id(opts.directory)  # tags the trials run here
        self.suspended = False  # whether the last trial's fit was suspended
        self.deadline: float | None = None  # search's timeout, on time.monotonic

    def __call__(self, trial: Any) -> float:
        mark(trial.study, trial, CLAIMED_IN, self.token)  # (under the study lock)
        frozen = _frozen(trial)
        run_dir = self.opts.directory / run_name(frozen)
        run_dir.mkdir(exist_ok=True)
        self.trial_lock = FileLock(run_dir / TRIAL_LOCK, wait=False).held()
        self.study_lock.release()  # claimed and held: other workers go on
        self.last = frozen
        return self._run(trial, frozen, run_dir)

    def _run(self, trial: Any, frozen: Any, run_dir: Path) -> float:
        if lineage(frozen) == trial.number and checkpoint_files(run_dir):
            raise ValueError(
                f"{_OWNER}: {str(run_dir)!r} already holds checkpoints, of a "
                f"trial of another study: trial {trial.number} of study "
                f"{trial.study.study_name!r} is new. Fix: give each study its "
                "own directory, e.g. directory='runs/search-2'."
            )
        trial.set_user_attr("run_dir", str(run_dir))
        seed_everything(self.opts.seed + lineage(frozen))
        learn = self.opts.make_learner(trial)
        if not isinstance(learn, Learner):
            raise TypeError(
                f"{_OWNER}: make_learner must return a Learner; got "
                f"{type(learn).__name__}. Fix: end it with return Learner(...)."
            )
        _refuse_own(learn)
        pruning = OptunaPruning(trial, monitor=self.opts.monitor)
        ckpt = Checkpoint(run_dir, **{"keep_last": 1, **self.opts.checkpoint})
        learn.callbacks = [*learn.callbacks, ckpt, pruning]
        learn.path = run_dir
        self.mlflow.nest(learn, trial, run_dir)
        ends: list = []

        def ended(**state: Any) -> None:  # also when fit raises TrialPruned
            ends.append(_suspended_at(state))
            if str(state.get("stop_reason")).startswith("Checkpoint: the run in"):
                mark(trial.study, trial, NOTE, FINISHED_NOTE)  # a retry's fit

        end = Callback.from_hooks(on_train_end=ended, order=99, name="trial end")
        learn.callbacks = [*learn.callbacks, end]
        if self.deadline is not None:  # (> 0 left: the loop checked)
            left = max(self.deadline - time.monotonic(), 1e-3)
            learn.callbacks = [*learn.callbacks, TimeLimit(left)]
        self.suspended = False
        out = self.opts.fit(learn, trial)
        pruning.check_pruned()
        if ends and ends[-1] is not None:  # to be resumed, not told COMPLETE
            self.suspended = True
            mark(trial.study, trial, REQUEUE, f"suspended at step {ends[-1]}")
            raise _SuspendedError(ends[-1])
        return _trial_value(out, learn, self.opts.monitor)


class _SuspendedError(Exception):
    """A trial's fit was suspended (``suspend``: ``max_time``, ``TimeLimit``):
    the trial fails, marked, and its retry resumes it from its checkpoint."""


def _suspended_at(state: dict) -> int | None:
    """The step a fit ended suspended at (before its end, to be resumed, as
    ``History.suspended`` says), else None."""
    n_epochs, max_steps = state.get("n_epochs"), state.get("max_steps")
    step = state.get("step", 0)
    reached = (n_epochs is not None and state.get("epoch", 0) >= n_epochs) or (
        max_steps is not None and step >= max_steps
    )
    if state.get("suspend") and not (reached or state.get("stop_training")):
        return step
    return None


def _refuse_own(learn: Learner) -> None:
    """A Checkpoint or OptunaPruning of the user's would be a second one."""
    for cb in learn.callbacks:
        if isinstance(cb, (Checkpoint, OptunaPruning)):
            fix = (
                "search(..., checkpoint={'every_n_steps': 50})"
                if isinstance(cb, Checkpoint)
                else "search(..., monitor='accuracy')"
            )
            raise ValueError(
                f"{_OWNER}: make_learner's Learner has a {cb.name} among its "
                f"callbacks; search adds one to each trial (in its run "
                f"directory). Fix: leave yours out, and set it through search: "
                f"e.g. {fix}."
            )


def _trial_value(out: Any, learn: Learner, monitor: str) -> float:
    if isinstance(out, (int, float)) and not isinstance(out, bool):
        return float(out)
    rows = learn.recorder.epoch_table()
    if not rows or rows[-1].get(monitor) is None:
        names = sorted(rows[-1]) if rows else []
        raise ValueError(
            f"{_OWNER}: the fit's last record has no {monitor!r}"
            f"{did_you_mean(monitor, names)} (records hold {names}). Fix: "
            "monitor one of those, or return the trial's value from fit."
        )
    return float(rows[-1][monitor])


def _frozen(trial: Any) -> Any:
    """The trial's record in the storage (its system attributes: Optuna's
    ``Trial`` no longer shows them)."""
    return trial.study.get_trials(deepcopy=False)[trial.number]
