import fcntl

import optuna
import pytest

from fitlib.tune_retries import (
    CLAIMED_IN,
    DEAD,
    REQUEUE,
    TRIAL_LOCK,
    FileLock,
    directory_id,
    enough,
    lineage,
    mark,
    retry_dead,
    run_name,
)

STATES = optuna.trial.TrialState


@pytest.fixture
def study(tmp_path):
    """A study with trial 0 RUNNING, claimed in ``tmp_path`` (no worker:
    nothing holds its lock), its width drawn and a value reported at step 7."""
    study = optuna.create_study()
    left = study.ask()
    mark(study, left, CLAIMED_IN, directory_id(tmp_path))
    left.suggest_categorical("width", [8, 16])
    left.report(0.9, 7)
    return study


def test_a_running_trial_whose_lock_is_free_is_failed_and_queued_again(study, tmp_path):
    retry_dead(study, tmp_path, max_retries=3)
    dead, retry = study.trials
    assert (dead.state, retry.state) == (STATES.FAIL, STATES.WAITING)
    assert retry.params == dead.params and retry.intermediate_values == {7: 0.9}
    assert (lineage(retry), run_name(retry), lineage(dead)) == (0, "trial-0", 0)
    assert (tmp_path / "trial-0" / TRIAL_LOCK).exists()
    retry_dead(study, tmp_path, max_retries=3)  # nothing is RUNNING now
    assert len(study.trials) == 2


def test_a_running_trial_whose_lock_is_held_is_left_running(study, tmp_path):
    (tmp_path / "trial-0").mkdir()
    with open(tmp_path / "trial-0" / TRIAL_LOCK, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # its worker lives
        retry_dead(study, tmp_path, max_retries=3)
    assert [t.state for t in study.trials] == [STATES.RUNNING]


def test_a_running_trial_claimed_in_another_directory_is_left_running(tmp_path):
    study = optuna.create_study()  # another machine's trial: its lock is there
    (tmp_path / "elsewhere").mkdir()
    mark(study, study.ask(), CLAIMED_IN, directory_id(tmp_path / "elsewhere"))
    (tmp_path / "here").mkdir()
    retry_dead(study, tmp_path / "here", max_retries=3)
    assert [t.state for t in study.trials] == [STATES.RUNNING]


def test_the_directory_id_is_made_once_and_kept(tmp_path):
    token = directory_id(tmp_path)
    assert len(token) == 16 and directory_id(tmp_path) == token
    assert directory_id(tmp_path / ".." / tmp_path.name) == token
    (tmp_path / "other").mkdir()
    assert directory_id(tmp_path / "other") != token


def test_a_trial_failed_by_a_worker_killed_before_queuing_it_is_queued(study, tmp_path):
    (dead,) = study.trials  # killed between the mark and tell and the queue:
    mark(study, dead, REQUEUE, DEAD)
    study.tell(dead.number, state=STATES.FAIL)
    retry_dead(study, tmp_path, max_retries=3)
    failed, retry = study.trials
    assert (failed.state, retry.state) == (STATES.FAIL, STATES.WAITING)
    assert lineage(retry) == 0 and retry.params == failed.params
    assert REQUEUE not in retry.system_attrs  # (its own failure is its own)
    retry_dead(study, tmp_path, max_retries=3)  # queued once
    assert len(study.trials) == 2


def test_a_failure_not_marked_for_a_retry_is_not_queued(study, tmp_path):
    study.tell(0, state=STATES.FAIL)  # the fit raised: an error, not a death
    retry_dead(study, tmp_path, max_retries=3)
    assert [t.state for t in study.trials] == [STATES.FAIL]


def test_a_suspension_is_queued_and_not_counted_as_a_retry(study, tmp_path):
    for _ in range(3):  # suspended 3 times with max_retries=0
        (trial,) = study.get_trials(states=(STATES.RUNNING,))
        mark(study, trial, REQUEUE, "suspended at step 7")
        study.tell(trial.number, state=STATES.FAIL)
        retry_dead(study, tmp_path, max_retries=0)
        mark(study, study.ask(), CLAIMED_IN, directory_id(tmp_path))  # the retry
    assert [t.state for t in study.trials] == [STATES.FAIL] * 3 + [STATES.RUNNING]
    assert lineage(study.trials[-1]) == 0


def test_retries_stop_after_max_retries(study, tmp_path):
    retry_dead(study, tmp_path, max_retries=0)
    assert [t.state for t in study.trials] == [STATES.FAIL]


def test_enough_counts_a_trial_and_its_retries_once_and_waits_for_queued_ones(
    study, tmp_path
):
    assert not enough(study, 2) and enough(study, 1)
    retry_dead(study, tmp_path, max_retries=3)  # trial 1, WAITING, retries 0
    assert not enough(study, 1)  # the retry has yet to run
    study.tell(study.ask(), 0.5)  # runs the retry (Optuna takes WAITING first)
    assert enough(study, 1) and not enough(study, 2)


def test_a_lock_held_by_another_run_is_refused(tmp_path):
    path = tmp_path / TRIAL_LOCK
    with FileLock(path):
        assert not FileLock(path, wait=False).try_acquire()
        with pytest.raises(ValueError, match="locked by another live process"):
            FileLock(path, wait=False).held()
    assert FileLock(path, wait=False).try_acquire()
