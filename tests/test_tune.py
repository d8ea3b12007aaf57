import re
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import torch
from helpers import FakeClock, child_env, make_data
from torch import nn
from torch.nn import functional as F  # noqa: N812

from fitlib import Callback, Learner
from fitlib.callbacks import EMA
from fitlib.metrics import accuracy
from fitlib.serialization import safe_load
from fitlib.tune import Search, load_best, search
from fitlib.tune_retries import CLAIMED_IN, FINISHED_NOTE, NOTE, directory_id, mark

HERE = Path(__file__).parent
STATES = optuna.trial.TrialState


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass


def make_learner(trial, seen=None):
    """A seeded MLP whose width is searched; ``seen`` gets what the trial saw."""
    width = trial.suggest_categorical("width", [8, 16])
    if seen is not None:
        seen.append((trial.number, torch.initial_seed()))
    model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 3))
    return Learner(make_data(), model, F.cross_entropy, metrics=[accuracy], wd=0.01,
                   progress=False, opt_func=torch.optim.SGD)  # fmt: skip


def fit_lr(learn, trial, epochs=2):
    learn.fit(epochs, lr=trial.suggest_float("lr", 1e-3, 0.5, log=True))


def run(tmp_path, n_trials=3, **kwargs):
    kwargs = {"progress": False, "directory": tmp_path / "runs", **kwargs}
    return search(kwargs.pop("make", make_learner), kwargs.pop("fit", fit_lr),
                  n_trials, **kwargs)  # fmt: skip


# -- trials, directories, seeds ------------------------------------------------------
def test_each_trial_trains_in_its_own_directory_seeded_by_its_number(tmp_path):
    seen = []
    found = run(tmp_path, make=lambda t: make_learner(t, seen), seed=100)
    assert [t.state for t in found.study.trials] == [STATES.COMPLETE] * 3
    assert seen == [(0, 100), (1, 101), (2, 102)]
    for trial in found.study.trials:
        run_dir = tmp_path / "runs" / f"trial-{trial.number}"
        assert found.run_dir(trial) == run_dir
        assert trial.user_attrs["run_dir"] == str(run_dir)
        assert list(run_dir.glob("checkpoint-*.pth"))
        assert sorted(trial.intermediate_values) == [7, 14]  # steps, each epoch


def test_the_trial_value_is_the_last_records_monitored_value(tmp_path):
    values = []

    def fit(learn, trial):
        fit_lr(learn, trial)
        values.append(learn.recorder.epoch_table()[-1]["accuracy"])

    found = run(tmp_path, 2, fit=fit, monitor="accuracy")
    assert found.study.direction == optuna.study.StudyDirection.MAXIMIZE
    assert [t.value for t in found.study.trials] == values


def test_a_number_fit_returns_is_the_trial_value(tmp_path):
    found = run(tmp_path, 2, fit=lambda learn, trial: fit_lr(learn, trial) or 0.25)
    assert [t.value for t in found.study.trials] == [0.25, 0.25]


def test_the_same_seed_draws_the_same_parameters(tmp_path):
    a = run(tmp_path / "a", 6, seed=3)
    b = run(tmp_path / "b", 6, seed=3)
    c = run(tmp_path / "c", 6, seed=4)
    params = [[t.params for t in s.study.trials] for s in (a, b, c)]
    assert params[0] == params[1] != params[2]


def test_pruned_trials_end_with_their_checkpoint_and_count_as_trials(tmp_path):
    always = optuna.pruners.ThresholdPruner(upper=0.0)  # every loss is > 0
    found = run(tmp_path, 3, pruner=always)
    trials = found.study.trials
    assert [t.state for t in trials] == [STATES.PRUNED] * 3
    assert [sorted(t.intermediate_values) for t in trials] == [[7]] * 3
    for trial in trials:
        files = sorted(found.run_dir(trial).glob("checkpoint-*.pth"))
        assert safe_load(files[-1])["position"]["iteration"] == 7  # final, at stop


def test_n_trials_counts_the_studys_trials_across_runs(tmp_path):
    run(tmp_path, 2)
    again = run(tmp_path, 2)  # the same study: nothing left to run
    assert len(again.study.trials) == 2
    more = run(tmp_path, 3)
    assert len(more.study.trials) == 3


def test_a_study_passed_in_keeps_its_sampler_and_storage(tmp_path):
    sampler = optuna.samplers.RandomSampler(seed=0)
    study = optuna.create_study(sampler=sampler)
    found = run(tmp_path, 2, study=study)
    assert found.study is study and study.sampler is sampler
    assert len(study.trials) == 2
    assert not (tmp_path / "runs" / "study.log").exists()


# -- loading the best back -------------------------------------------------------
def test_best_learner_holds_the_best_trials_final_weights(tmp_path):
    weights = {}

    def fit(learn, trial):
        fit_lr(learn, trial)
        weights[trial.number] = {
            k: v.clone() for k, v in learn.model.state_dict().items()
        }

    found = run(tmp_path, 3, fit=fit)
    best = found.best_learner()
    state = best.model.state_dict()
    assert all(
        torch.equal(state[k], v) for k, v in weights[found.best_trial.number].items()
    )
    assert best.model[0].out_features == found.best_params["width"]
    assert best.recorder.valid_losses[-1] == found.best_value
    again = load_best(found.study, make_learner, tmp_path / "runs")
    assert all(
        torch.equal(a, b)
        for a, b in zip(state.values(), again.model.state_dict().values())
    )


@pytest.mark.parametrize(("validate_on", "monitor"), [
    ("ema", "valid_loss"), ("both", "ema_valid_loss"), ("both", "valid_loss"),
])  # fmt: skip
def test_best_learner_holds_the_weights_that_scored_with_an_ema(
    tmp_path, validate_on, monitor
):
    def make(trial):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        ema = EMA(decay=0.5, validate_on=validate_on)
        return Learner(make_data(), model, F.cross_entropy, wd=0.01, progress=False,
                       opt_func=torch.optim.SGD, callbacks=[ema])  # fmt: skip

    found = run(tmp_path, 2, make=make, monitor=monitor)
    best = found.best_learner()
    assert best.validate()[monitor.removeprefix("ema_")] == pytest.approx(
        found.best_value, rel=1e-6
    )


def test_load_best_without_checkpoints_names_the_directory(tmp_path):
    found = run(tmp_path, 1)
    with pytest.raises(ValueError, match=r"has no checkpoint in .*elsewhere.*Fix: "
                       r"pass the directory given to search\(\)"):  # fmt: skip
        load_best(found.study, make_learner, tmp_path / "elsewhere")


# -- progress ----------------------------------------------------------------------
def test_a_terminal_gets_one_line_per_trial(tmp_path, capsys):
    always = optuna.pruners.ThresholdPruner(upper=1.1)
    run(tmp_path, 3, progress=None, pruner=always, seed=2)
    lines = capsys.readouterr().out.splitlines()
    shape = (
        r"trial (\d) (complete|pruned at step 7): valid_loss [\d.]+ \| "
        r"width=(8|16), lr=[\d.e-]+( \| best [\d.]+ \(trial \d\))?"
    )
    assert [re.fullmatch(shape, line)[1] for line in lines] == ["0", "1", "2"]
    assert any("pruned" in line for line in lines)
    assert any("| best" in line for line in lines)


def test_progress_false_prints_nothing(tmp_path, capsys):
    run(tmp_path, 2, progress=False)
    assert capsys.readouterr().out == ""


def test_search_repr_counts_the_trials_by_state(tmp_path):
    found = run(tmp_path, 2)
    assert isinstance(found, Search)
    best = found.best_trial
    assert repr(found) == (
        f"Search('search', 2 trials (2 complete, 0 pruned), best: trial "
        f"{best.number} valid_loss={best.value:.4g})"
    )


# -- errors --------------------------------------------------------------------------
def test_make_learner_must_return_a_learner(tmp_path):
    with pytest.raises(TypeError, match="make_learner must return a Learner; got Seq"):
        run(tmp_path, make=lambda trial: nn.Sequential())


@pytest.mark.parametrize("own", ["checkpoint", "pruning"])
def test_a_learner_with_its_own_checkpoint_or_pruning_is_refused(tmp_path, own):
    from fitlib.callbacks import Checkpoint, OptunaPruning

    def make(trial):
        learn = make_learner(trial)
        extra = Checkpoint(tmp_path / "own") if own == "checkpoint" else None
        learn.callbacks.append(extra or OptunaPruning(trial))
        return learn

    with pytest.raises(ValueError, match=r"has a (Checkpoint|OptunaPruning) .*Fix"):
        run(tmp_path, 1, make=make)


def test_a_fit_that_trains_nothing_has_no_value(tmp_path):
    with pytest.raises(ValueError, match="last record has no 'valid_loss'"):
        run(tmp_path, 1, fit=lambda learn, trial: None)


def test_a_new_trial_refuses_a_directory_holding_another_studys_checkpoints(tmp_path):
    run(tmp_path, 1, study_name="first")
    with pytest.raises(ValueError, match=r"already holds checkpoints.*own directory"):
        run(tmp_path, 1, study_name="second")


# -- retries -------------------------------------------------------------------------
def journal(directory):
    directory.mkdir(parents=True, exist_ok=True)
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(directory / "study.log"))
    )
    return optuna.create_study(study_name="search", storage=storage,
                               load_if_exists=True)  # fmt: skip


def test_a_running_trial_whose_lock_is_free_is_retried_in_its_directory(tmp_path):
    study = journal(tmp_path / "runs")
    left = study.ask()  # its worker died here before locking
    mark(study, left, CLAIMED_IN, directory_id(tmp_path / "runs"))
    left.suggest_categorical("width", [8, 16])
    found = run(tmp_path, 1)
    trials = found.study.trials
    assert [t.state for t in trials] == [STATES.FAIL, STATES.COMPLETE]
    assert trials[1].params["width"] == trials[0].params["width"]
    assert trials[1].user_attrs["run_dir"] == str(tmp_path / "runs" / "trial-0")
    assert found.run_dir(trials[1]) == tmp_path / "runs" / "trial-0"


def test_a_live_trial_of_another_machines_directory_is_left_to_it(tmp_path):
    study = journal(tmp_path / "runs")  # one storage, as a URL would be
    (tmp_path / "a").mkdir()
    live = study.ask()  # machine A's trial: its lock is in A's directory
    mark(study, live, CLAIMED_IN, directory_id(tmp_path / "a"))
    found = run(tmp_path, 2)  # machine B, its own directory
    states = [t.state for t in found.study.trials]
    assert states == [STATES.RUNNING, STATES.COMPLETE]  # B ran one of its own
    study.tell(live, 0.5)  # and A finishes its trial
    assert study.trials[0].state == STATES.COMPLETE


def suspend_at(at, done):
    """Suspends the fit after step ``at`` (as ``max_time`` does), once."""

    def on_step_end(step):
        if step == at and not done:
            done.append(step)
            return {"suspend": True}
        return None

    return Callback.from_hooks(on_step_end=on_step_end)


def test_a_suspended_trial_is_resumed_by_the_next_run_exactly(tmp_path, capsys):
    done = []

    def make(trial):
        learn = make_learner(trial)
        learn.callbacks = [*learn.callbacks, suspend_at(10, done)]
        return learn

    unbroken = run(tmp_path / "unbroken", 1).study.trials[0]
    first = run(tmp_path, 1, make=make, progress=None)
    assert [t.state for t in first.study.trials] == [STATES.FAIL, STATES.WAITING]
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith(
        "trial 0 suspended at step 11: its retry resumes it from its checkpoint "
        "on the next run | width="
    )
    again = run(tmp_path, 1, make=make)
    trials = again.study.trials
    assert [t.state for t in trials] == [STATES.FAIL, STATES.COMPLETE]
    assert trials[1].params == unbroken.params and done == [10]
    assert trials[1].value == unbroken.value
    assert trials[1].intermediate_values == unbroken.intermediate_values
    assert again.run_dir(trials[1]) == tmp_path / "runs" / "trial-0"


def test_a_trial_running_at_the_timeout_suspends_and_resumes_exactly(
    tmp_path, monkeypatch
):
    import fitlib.time_budget
    import fitlib.tune

    clock = FakeClock()  # a second a step, for search's timeout and TimeLimit
    monkeypatch.setattr(fitlib.tune, "time", clock)
    monkeypatch.setattr(fitlib.time_budget, "time", clock)

    def make(trial):
        learn = make_learner(trial)
        tick = Callback.from_hooks(
            on_step_end=lambda: setattr(clock, "now", clock.now + 1)
        )
        learn.callbacks = [*learn.callbacks, tick]
        return learn

    unbroken = run(tmp_path / "unbroken", 2, make=make).study.trials
    clock.now = 0.0
    first = run(tmp_path, 2, make=make, timeout=20)  # trial 1 runs at 14 s
    states = [t.state for t in first.study.trials]
    assert states == [STATES.COMPLETE, STATES.FAIL, STATES.WAITING]
    assert (
        first.study.trials[1]
        .system_attrs["fitlib:requeue"]
        .startswith("suspended at step")
    )
    trials = run(tmp_path, 2, make=make).study.trials  # no timeout: it ends
    assert [t.state for t in trials][2:] == [STATES.COMPLETE]
    assert trials[2].params == unbroken[1].params
    assert trials[2].value == unbroken[1].value
    assert trials[2].intermediate_values == unbroken[1].intermediate_values


# -- across processes ----------------------------------------------------------------
def child(directory, mode, n_trials):
    cmd = [sys.executable, str(HERE / "tune_child.py"), str(directory), mode,
           str(n_trials)]  # fmt: skip
    return subprocess.Popen(cmd, env=child_env(OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def finished(proc):
    _, err = proc.communicate(timeout=240)
    return proc.returncode, err.decode()[-3000:]


def load(directory):
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(directory / "study.log"))
    )
    return optuna.load_study(study_name="search", storage=storage)


def final_weights(run_dir):
    newest = sorted(Path(run_dir).glob("checkpoint-*.pth"))[-1]
    return safe_load(newest)["model"]


def test_a_trial_killed_outright_is_retried_and_resumes_exactly(tmp_path):
    unbroken, killed = tmp_path / "unbroken", tmp_path / "killed"
    first = [child(unbroken, "run", 1), child(killed, "kill", 1)]
    (code, err), (killed_code, _) = map(finished, first)
    assert code == 0, err
    assert killed_code == -9  # SIGKILL, in trial 0's second epoch
    assert [t.state for t in load(killed).trials] == [STATES.RUNNING]
    assert finished(child(killed, "run", 1)) == (0, "")
    ref, trials = load(unbroken).trials[0], load(killed).trials
    assert [t.state for t in trials] == [STATES.FAIL, STATES.COMPLETE]
    retry = trials[1]
    assert retry.params == ref.params and retry.value == ref.value
    assert retry.intermediate_values == ref.intermediate_values
    assert retry.user_attrs["run_dir"] == str(killed / "trial-0")
    a, b = final_weights(unbroken / "trial-0"), final_weights(killed / "trial-0")
    assert all(torch.equal(a[k], b[k]) for k in a)
    ran = (killed / "ran.txt").read_text().split()
    assert ran[0::3] == ["0", "1"] and ran[1::3] == [str(killed / "trial-0")] * 2


@pytest.mark.parametrize(
    ("kill", "rerun", "ended"),
    [("kill_done", "run", STATES.COMPLETE), ("kill_pruned", "pruned", STATES.PRUNED)],
)
def test_a_worker_killed_after_the_fit_before_tell_is_retried_to_the_same_end(
    tmp_path, kill, rerun, ended
):
    unbroken, killed = tmp_path / "unbroken", tmp_path / "killed"
    first = [child(unbroken, rerun, 1), child(killed, kill, 1)]
    (code, err), (killed_code, _) = map(finished, first)
    assert code == 0, err
    assert killed_code == -9  # SIGKILL after the fit, before Optuna's tell
    assert [t.state for t in load(killed).trials] == [STATES.RUNNING]
    assert finished(child(killed, rerun, 1)) == (0, "")
    ref, trials = load(unbroken).trials[0], load(killed).trials
    assert [t.state for t in trials] == [STATES.FAIL, ended]
    retry = trials[1]
    assert retry.params == ref.params and retry.value == ref.value
    assert retry.intermediate_values == ref.intermediate_values
    assert retry.system_attrs[NOTE] == FINISHED_NOTE  # its trial line says so
    a, b = final_weights(unbroken / "trial-0"), final_weights(killed / "trial-0")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_three_workers_share_one_study_without_losing_or_repeating_a_trial(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    procs = [child(tmp_path, "worker", 9) for _ in range(3)]
    results = [finished(p) for p in procs]
    assert results == [(0, "")] * 3
    trials = load(tmp_path).trials
    assert [t.number for t in trials] == list(range(9))
    for t in trials:
        assert t.state in (STATES.COMPLETE, STATES.PRUNED), t
        assert set(t.params) == {"width", "lr"} and t.value is not None
        assert t.intermediate_values and t.datetime_complete is not None
        assert list((tmp_path / f"trial-{t.number}").glob("checkpoint-*.pth"))
    ran = [line.split() for line in (tmp_path / "ran.txt").read_text().splitlines()]
    assert sorted(int(number) for number, _, _ in ran) == list(range(9))
    assert len({pid for _, _, pid in ran}) >= 2  # several workers ran trials


def test_a_rerun_of_a_finished_search_says_there_is_nothing_to_run(tmp_path, capsys):
    found = run(tmp_path, 2)
    capsys.readouterr()
    run(tmp_path, 2, progress=None)  # a terminal's default: lines
    out = capsys.readouterr().out
    best = found.study.best_trial
    assert out == (
        f"search: the study already holds its 2 trials: nothing to run; best: "
        f"trial {best.number}, valid_loss={best.value:.6g}\n"
    )
    run(tmp_path, 2)  # progress=False: silent
    assert capsys.readouterr().out == ""
