"""What ``fitlib.tune.search`` needs to retry the trials of dead workers: a
trial's lineage (the trial a retry stands for) and run directory, the
``flock`` a live worker holds, and the study's count of trials.

A worker killed outright (SIGKILL, out of memory, a node lost) leaves its
trial RUNNING in the storage. Each worker holds, for the whole trial (until
after Optuna's ``tell``), an exclusive ``flock`` on
``trial-<n>/.fitlib-trial.lock``; the operating system releases it when the
process dies. A worker claims a trial (Optuna's ``ask``, and that lock)
under the study's lock (``directory/.fitlib-study.lock``), so no RUNNING
trial is ever without a live holder but a dead one's: no heartbeat, no grace
period. Each trial is tagged, as it is claimed, with its directory's
``directory_id`` (a random token in ``directory/.fitlib-id``): a worker
judges only its own directory's trials, as the locks of another machine's
directory are not here. Before each claim, every RUNNING trial of this
directory whose lock is free is marked (``fitlib:requeue``, before its
``tell``: a worker killed between the two leaves the mark), marked FAIL
and queued again as Optuna's ``RetryHeartbeatStaleTrialCallback`` does
(same parameters, its intermediate values kept, ``failed_trial`` and
``retry_history``, at most ``max_retries`` times); a marked FAIL trial
without a retry is queued too. A suspended trial is marked and queued the
same way, and does not count as a retry. The retry finds its predecessor's
directory (``failed_trial``) and checkpoint, and resumes exactly.

This needs the directory shared by the workers (as the checkpoints need it)
on a file system with working locks; elsewhere ``search(retry=False)`` and a
storage with Optuna's heartbeat (``RDBStorage(heartbeat_interval=...,
heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback())``), whose
retries find their directories the same way.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: nothing is locked, and nothing is retried
    fcntl = None

TRIAL_LOCK, STUDY_LOCK = ".fitlib-trial.lock", ".fitlib-study.lock"
DIRECTORY_ID = ".fitlib-id"
CLAIMED_IN = "fitlib:directory"  # the directory_id of the worker that claimed it
REQUEUE = "fitlib:requeue"  # why it is to be retried, set before its FAIL
DEAD = "worker died"
NOTE = "fitlib:note"  # said after the trial's line
FINISHED_NOTE = (
    "its run had finished before its worker died: the Checkpoint's 'already "
    "finished' line is expected, and the value is its checkpoint's"
)


def lineage(trial: Any) -> int:
    """The number of the trial that ``trial`` retries (itself if none)."""
    retried = trial.system_attrs.get("failed_trial")  # RetryHeartbeatStale...'s key
    return trial.number if retried is None else int(retried)


def run_name(trial: Any) -> str:
    return f"trial-{lineage(trial)}"


def directory_id(directory: Path) -> str:
    """This run directory's identity: a random token kept in
    ``directory/.fitlib-id`` (made by the first worker to ask)."""
    path = directory / DIRECTORY_ID
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        for _ in range(100):  # (another worker may be writing it)
            token = path.read_text().strip()
            if token:
                return token
            time.sleep(0.01)
        raise
    token = secrets.token_hex(8)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def mark(study: Any, trial: Any, key: str, value: str) -> None:
    """Sets a system attribute of ``trial`` (a ``Trial`` or ``FrozenTrial``)."""
    study._storage.set_trial_system_attr(trial._trial_id, key, value)


def retry_dead(study: Any, directory: Path, max_retries: int) -> None:
    """Fails each RUNNING trial claimed in this directory (tagged with its
    ``directory_id``) whose worker is dead (its trial lock is free), and
    queues it again, as ``requeue_marked`` does; called under the study's
    lock. A trial claimed elsewhere (another machine's directory) is left
    to the workers there."""
    import optuna

    token = directory_id(directory)
    running = study.get_trials(states=(optuna.trial.TrialState.RUNNING,))
    for trial in running:
        if trial.system_attrs.get(CLAIMED_IN) != token:
            continue  # claimed elsewhere: its lock is not here
        run_dir = directory / run_name(trial)
        run_dir.mkdir(exist_ok=True)  # (a worker may die before making it)
        lock = FileLock(run_dir / TRIAL_LOCK, wait=False)
        if not lock.try_acquire():
            continue  # its worker lives
        try:
            failed = study.get_trials(deepcopy=True)[trial.number]
            if failed.state != optuna.trial.TrialState.RUNNING:
                continue  # it ended as we looked: its worker lived
            mark(study, trial, REQUEUE, DEAD)  # before tell: a kill between
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
        finally:
            lock.release()
    requeue_marked(study, token, max_retries)


def requeue_marked(study: Any, token: str, max_retries: int) -> None:
    """Queues again each FAIL trial of this directory marked for a retry
    (its worker died, or its fit was suspended) that has no retry yet: a
    WAITING copy (same parameters, its intermediate values kept, Optuna's
    ``failed_trial`` and ``retry_history``) that resumes in its directory. A
    trial retried after ``max_retries`` dead workers is left failed; a
    suspension does not count."""
    import optuna

    trials = study.get_trials(deepcopy=False)
    retried = {t.system_attrs["retry_history"][-1] for t in trials
               if t.system_attrs.get("retry_history")}  # fmt: skip
    for failed in trials:
        attrs = failed.system_attrs
        if (
            failed.state != optuna.trial.TrialState.FAIL
            or REQUEUE not in attrs
            or attrs.get(CLAIMED_IN) != token
            or failed.number in retried
        ):
            continue
        history = [*attrs.get("retry_history", []), failed.number]
        deaths = sum(trials[n].system_attrs.get(REQUEUE) == DEAD for n in history)
        if deaths > max_retries:
            continue
        kept = {k: v for k, v in attrs.items() if not k.startswith("fitlib:")}
        kept.update(failed_trial=lineage(failed), retry_history=history)
        study.add_trial(
            optuna.create_trial(
                state=optuna.trial.TrialState.WAITING,
                params=failed.params,
                distributions=failed.distributions,
                user_attrs=failed.user_attrs,
                system_attrs=kept,
                intermediate_values=failed.intermediate_values,
            )
        )


def enough(study: Any, n_trials: int) -> bool:
    """Whether the study holds ``n_trials`` (a trial and its retries count
    once) and no trial waits to run."""
    trials = study.get_trials(deepcopy=False)
    waiting = any(t.state.name == "WAITING" for t in trials)
    originals = sum(lineage(t) == t.number for t in trials)
    return originals >= n_trials and not waiting


def best_trial(study: Any) -> Any:
    try:
        return study.best_trial
    except ValueError:  # no trial complete yet
        return None


class FileLock:
    """An exclusive ``flock`` on ``path`` (made if missing), held while the
    file is open: a process that dies, even by SIGKILL, releases it."""

    def __init__(self, path: Path, wait: bool = True) -> None:
        self.path, self.wait, self._fd = path, wait, None

    def try_acquire(self) -> bool:
        if fcntl is None:
            return False
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        flags = fcntl.LOCK_EX | (0 if self.wait else fcntl.LOCK_NB)
        try:
            fcntl.flock(fd, flags)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def held(self) -> FileLock:
        """Takes the lock (waiting for it, or refusing a lock held elsewhere)."""
        if not self.try_acquire() and fcntl is not None:
            raise ValueError(
                f"fitlib.tune.search: {str(self.path)!r} is locked by another live "
                "process: its trial is running there. Fix: give this search "
                "another directory, or wait for that process."
            )
        return self

    def __enter__(self) -> FileLock:
        return self.held()

    def __exit__(self, *exc: Any) -> None:
        self.release()
