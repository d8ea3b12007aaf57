"""TimeLimit: a wall-clock budget that suspends the fit, resumable by a
Checkpoint. The clock is fake (no test sleeps): ``clock`` replaces the
``time`` that fitlib.time_budget reads, and ``Tick`` moves it on per batch."""

import datetime
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    FakeClock,
    child_env,
    make_data,
    make_model,
    resume_learner,
    same_weights,
)
from torch.nn import functional as F  # noqa: N812

import fitlib.time_budget
from fitlib import Callback, HPOptimizer, fit
from fitlib.callbacks import Checkpoint, EarlyStopping, Recorder, TimeLimit
from fitlib.serialization import safe_load

HERE = Path(__file__).parent


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock(1000.0)
    monkeypatch.setattr(fitlib.time_budget, "time", fake)
    return fake


class Tick(Callback):
    """Moves the fake clock on by ``train`` seconds per training batch and
    ``valid`` per validation batch (the clock is no attribute: a Checkpoint
    would warn that it changes)."""

    def __init__(self, clock, train=1.0, valid=0.0):
        self.train, self.valid = train, valid

    def on_batch_end(self, train):
        fitlib.time_budget.time.now += self.train if train else self.valid


class Watch(Callback):
    """Notes where the fit ended: (epoch, iteration)."""

    order = 100

    def on_train_end(self, epoch, iteration):
        self.end = (epoch, iteration)


# -- when it stops ---------------------------------------------------------------
def test_suspends_right_after_the_batch_that_spends_the_budget(clock):
    watch = Watch()
    history = resume_learner([Tick(clock), TimeLimit(10), watch]).fit(3, lr=0.1)
    assert watch.end == (1, 10)  # 10 batches of a second: epoch 1, batch 3
    assert history.stop_reason == "max_time=0:00:10 reached after 0:00:10"
    assert [r["epoch"] for r in history] == [0]  # none for the partial epoch


def test_a_budget_not_spent_lets_the_fit_run_all_its_epochs(clock):
    limit = TimeLimit(22)  # the fit's 21 batches take 21 s
    history = resume_learner([Tick(clock), limit]).fit(3, lr=0.1)
    assert len(history) == 3 and history.stop_reason is None
    clock.now += 100  # after the fit: its time stays the fit's
    assert limit.elapsed() == 21


def test_validation_time_counts_and_ends_the_fit_before_the_next_epoch(clock):
    watch = Watch()  # a validation batch takes 10 s; training takes none
    callbacks = [Tick(clock, train=0, valid=10), TimeLimit("00:00:25"), watch]
    history = resume_learner(callbacks).fit(3, lr=0.1)
    assert watch.end == (1, 7) and len(history) == 1
    assert history.stop_reason == "max_time=0:00:25 reached after 0:00:30"


def test_a_stop_that_finishes_the_run_wins_over_the_time_limit(clock, tmp_path):
    class StopAt(Callback):
        def on_batch_end(self, iteration):
            if iteration == 4:  # the batch that also spends the budget
                return {"stop_training": True, "stop_reason": "enough"}

    learn = resume_learner([Checkpoint(tmp_path), Tick(clock), TimeLimit(5), StopAt()])
    assert learn.fit(3, lr=0.1).stop_reason == "enough"
    assert len(resume_learner([Checkpoint(tmp_path)]).fit(3, lr=0.1)) == 0  # finished


def test_fit_max_time_suspends_as_the_callback_does(clock):
    watch, model = Watch(), make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    history = fit(3, model, F.cross_entropy, opt, make_data(), [Tick(clock), watch],
                  max_time=datetime.timedelta(seconds=9.5))  # fmt: skip
    assert watch.end == (1, 10)
    assert history.stop_reason == "max_time=0:00:09.5 reached after 0:00:10"


# -- resuming ----------------------------------------------------------------------
def test_each_rerun_gets_the_whole_budget_and_the_run_ends_as_an_unbroken_one(
    clock, tmp_path
):
    """A cluster job rerun until done: each job trains 8 batches (8 s of a
    budget of 7.5 s), suspends, and the next resumes exactly."""
    stops = []
    for _ in range(5):
        learn = resume_learner([Checkpoint(tmp_path), Tick(clock), TimeLimit(7.5)])
        history = learn.fit_one_cycle(3, 0.1)
        stops.append(history.stop_reason)
        if history.stop_reason is None:
            break
    assert stops == ["max_time=0:00:07.5 reached after 0:00:08"] * 2 + [None]
    unbroken = resume_learner()
    unbroken.fit_one_cycle(3, 0.1)
    assert same_weights(learn, unbroken)
    assert learn.recorder.losses == unbroken.recorder.losses
    assert learn.recorder.valid_losses == unbroken.recorder.valid_losses


def test_a_time_limited_run_killed_with_sigkill_still_ends_as_an_unbroken_one(
    tmp_path,
):
    """Job 1 runs out of time (a resumable checkpoint), job 2 is killed by
    SIGKILL in the middle of an epoch, job 3 finishes: the weights and the
    losses are an unbroken run's."""
    env = child_env()
    run = [sys.executable, str(HERE / "time_limit_child.py"), str(tmp_path),
           str(tmp_path / "run.pth")]  # fmt: skip
    first = subprocess.run([*run, "limit"], env=env, capture_output=True)
    assert first.returncode == 0 and b"max_time=0:00:05 reached" in first.stdout
    killed = subprocess.run([*run, "kill"], env=env, capture_output=True)
    assert killed.returncode == -9 and not (tmp_path / "run.pth").exists()
    subprocess.run([*run, "none"], env=env, check=True, capture_output=True)
    ours, unbroken = safe_load(tmp_path / "run.pth"), resume_learner()  # (the child's)
    unbroken.fit_one_cycle(3, 0.1)
    assert ours["losses"] == unbroken.recorder.losses and len(ours["losses"]) == 21
    assert ours["valid_losses"] == unbroken.recorder.valid_losses
    weights = unbroken.model.state_dict()
    assert all(torch.equal(ours["weights"][k], v) for k, v in weights.items())


# -- arguments ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "max_time, seconds",
    [(22, 22.0), (0.5, 0.5), ("00:00:00:22", 22.0), ("01:30:00", 5400.0),
     ("12:34:56:65", 12 * 86400 + 34 * 3600 + 56 * 60 + 65.0),
     (datetime.timedelta(weeks=52, milliseconds=1), 52 * 7 * 86400 + 0.001),
     ({"weeks": 52, "days": 1}, 365 * 86400.0)],
    ids=str,
)  # fmt: skip
def test_max_time_is_read_from_seconds_timedelta_string_or_dict(max_time, seconds):
    assert TimeLimit(max_time).max_time == seconds


@pytest.mark.parametrize(
    "max_time, error, match",
    [(0, ValueError, r"max_time must be a time > 0 .*got 0 \(int\)"),
     (-5, ValueError, r"got -5 \(int\)"),
     (float("inf"), ValueError, "and finite"),
     (datetime.timedelta(0), ValueError, r"\(0 s\)"),
     ("1:00", ValueError, "no time of the form \"DD:HH:MM:SS\""),
     ("abc", ValueError, "HH:MM:SS"),
     ({"hour": 1}, ValueError, "did you mean 'hours'"),
     ({"hours": "1"}, TypeError, r"max_time\['hours'\] must be a number"),
     (True, TypeError, r"got True \(bool\)"),
     (None, TypeError, "a number of seconds, a timedelta")],
    ids=str,
)  # fmt: skip
def test_a_bad_max_time_is_refused_naming_the_forms_it_takes(max_time, error, match):
    with pytest.raises(error, match=match) as info:
        TimeLimit(max_time)
    assert "TimeLimit: max_time" in str(info.value) and "Fix: e.g." in str(info.value)


def test_fit_refuses_max_time_beside_a_time_limit_before_training():
    model, data = make_model(), make_data()
    before = [p.clone() for p in model.parameters()]
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"two time limits\. Fix: keep one"):
        fit(1, model, F.cross_entropy, opt, data, [TimeLimit(60)], max_time=60)
    assert all(map(torch.equal, before, model.parameters()))
    with pytest.raises(ValueError, match="fit: max_time must be a time > 0"):
        fit(1, model, F.cross_entropy, opt, data, max_time=0)


def test_repr_and_order():
    limit = TimeLimit({"minutes": 1})
    assert repr(limit) == "TimeLimit(max_time=60)"
    assert EarlyStopping.order < limit.order < Recorder.order  # sees stops first
