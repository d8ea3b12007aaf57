import subprocess
import sys
import warnings

import optuna
import pytest
import torch
from helpers import Crash, child_env, make_data, make_model, resume_learner
from torch.nn import functional as F  # noqa: N812

from fitlib import Callback, HPOptimizer, fit, fit_states
from fitlib.callbacks import Checkpoint, CSVLogger, ValidationSchedule
from fitlib.callbacks.optuna_pruning import OptunaPruning
from fitlib.callbacks.tensorboard import TensorBoardLogger
from fitlib.history import History
from fitlib.metrics import accuracy

optuna.logging.set_verbosity(optuna.logging.WARNING)


class PruneFrom(optuna.pruners.BasePruner):
    """Prunes every trial once its last reported step is ``step`` or later."""

    def __init__(self, step):
        self.step = step

    def prune(self, study, trial):
        return (trial.last_step or 0) >= self.step


def new_trial(pruner=None, direction="minimize"):
    study = optuna.create_study(pruner=pruner or PruneFrom(10**9), direction=direction)
    return study, study.ask()


def fit_trial(trial, epochs=2, callbacks=(), lr=0.1, monitor="valid_loss", **kw):
    """Fits the tiny problem with ``OptunaPruning(trial)``; ``history=`` (a
    ``History``) receives the records also when the fit raises."""
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=lr)
    prune = OptunaPruning(trial, monitor=monitor)
    history = kw.pop("history", History())
    for _ in fit_states(epochs, model, F.cross_entropy, opt, make_data(),
                        [prune, *callbacks], history=history, **kw):  # fmt: skip
        pass
    return prune, history


# -- reporting -----------------------------------------------------------------------
def test_reports_every_validation_at_its_optimizer_step():
    study, trial = new_trial()
    schedule = ValidationSchedule(every_n_steps=3)  # 7 steps an epoch
    prune, history = fit_trial(trial, callbacks=[schedule])
    values = study.trials[0].intermediate_values
    assert sorted(values) == [3, 6, 7, 9, 12, 14] == [r["step"] for r in history]
    assert [values[r["step"]] for r in history] == [r["valid_loss"] for r in history]
    assert prune.reported == values and not prune.pruned


def test_a_second_record_at_a_step_of_this_fit_warns_once_naming_it():
    study, trial = new_trial()
    frozen = Callback.from_hooks(  # epochs 1 and 2 take no optimizer step
        on_backward_end=lambda epoch: {"skip_step": True} if epoch > 0 else None
    )
    with pytest.warns(UserWarning, match=r"second record at step 7 in this fit") as w:
        _, history = fit_trial(trial, epochs=3, callbacks=[frozen])
    assert len([x for x in w if "OptunaPruning" in str(x.message)]) == 1
    assert study.trials[0].intermediate_values == {7: history[0]["valid_loss"]}


def test_one_broadcast_per_validation_and_none_per_step(monkeypatch):
    import fitlib.callbacks.optuna_pruning as module

    sent = []

    class TwoRanks:  # rank 0 of 2, its broadcasts counted
        rank = staticmethod(lambda: 0)
        is_main = staticmethod(lambda: True)
        world_size = staticmethod(lambda: 2)
        broadcast_int = staticmethod(lambda value: sent.append(value) or value)

    monkeypatch.setattr(module, "ranks", TwoRanks)
    _, trial = new_trial(PruneFrom(12))
    schedule = ValidationSchedule(every_n_steps=3)  # 14 steps, 5 validations
    with pytest.raises(optuna.TrialPruned):
        fit_trial(trial, callbacks=[schedule], history=(history := History()))
    assert [r["step"] for r in history] == [3, 6, 7, 9, 12]
    assert sent == [-1, -1, -1, -1, trial.number]  # rank 0's verdicts


def test_records_without_validation_are_not_reported():
    study, trial = new_trial()
    fit_trial(trial, epochs=4, callbacks=[ValidationSchedule(every_n_epochs=2)])
    assert sorted(study.trials[0].intermediate_values) == [14, 28]


def test_reports_a_metric_of_a_maximizing_study():
    study, trial = new_trial(direction="maximize")
    _, history = fit_trial(trial, monitor="accuracy", metrics=[accuracy])
    values = study.trials[0].intermediate_values
    assert [values[s] for s in (7, 14)] == [r["accuracy"] for r in history]


def test_a_second_fit_goes_on_after_the_steps_the_first_reported():
    study, trial = new_trial()
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    prune = OptunaPruning(trial)
    for _ in range(2):
        fit(1, model, F.cross_entropy, opt, make_data(), callbacks=[prune])
    assert sorted(study.trials[0].intermediate_values) == [7, 14]


# -- pruning -------------------------------------------------------------------------
def hand_written(trial, lr):
    """The search's training as a plain loop: report after each epoch at the
    optimizer step, ask the pruner, raise as Optuna's examples do."""
    model, data = make_model(), make_data()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    step = 0
    for _ in range(3):
        model.train()
        for xb, yb in data.train_dl:
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
            opt.zero_grad()
            step += 1
        model.eval()
        with torch.no_grad():
            total = sum(F.cross_entropy(model(x), y, reduction="sum").double()
                        for x, y in data.valid_dl)  # fmt: skip
        trial.report(float(total) / len(data.valid_dl.dataset), step)
        if trial.should_prune():
            raise optuna.TrialPruned()
    return float(total) / len(data.valid_dl.dataset)


def with_callback(trial, lr):
    _, history = fit_trial(trial, epochs=3, lr=lr)
    return history[-1]["valid_loss"]


def search(objective, seed):
    sampler = optuna.samplers.TPESampler(seed=seed)
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2)
    study = optuna.create_study(sampler=sampler, pruner=pruner)

    def run(trial):
        return objective(trial, trial.suggest_float("lr", 1e-3, 1.0, log=True))

    study.optimize(run, n_trials=8)
    return study


@pytest.mark.parametrize("seed", [0, 1])
def test_prunes_the_trials_a_hand_written_loop_prunes(seed):
    ours, theirs = search(with_callback, seed), search(hand_written, seed)
    states = [t.state for t in theirs.trials]
    assert [t.state for t in ours.trials] == states
    assert optuna.trial.TrialState.PRUNED in states  # the comparison means something
    for a, b in zip(ours.trials, theirs.trials, strict=True):
        assert a.params == b.params
        assert a.intermediate_values == pytest.approx(b.intermediate_values, rel=1e-6)


def test_prunes_at_a_validation_inside_an_epoch():
    study, trial = new_trial(PruneFrom(3))
    done = History()
    with pytest.raises(optuna.TrialPruned, match=r"^OptunaPruning: trial 0 pruned at "
                       r"step 3 \(valid_loss=1\.\d+\)") as caught:  # fmt: skip
        fit_trial(trial, callbacks=[ValidationSchedule(every_n_steps=3)],
                  history=done)  # fmt: skip
    assert [(r["epoch"], r["step"]) for r in done] == [(0, 3)]  # stopped there
    assert caught.value.args[0] == done.stop_reason
    assert sorted(study.trials[0].intermediate_values) == [3]


class Ends(Callback):
    order = 100  # after OptunaPruning's on_train_end

    def __init__(self):
        self.ended = []

    def on_train_end(self, exception):
        self.ended.append(exception)


def test_a_pruned_trial_closes_its_loggers_and_checkpoint(tmp_path):
    _, trial = new_trial(PruneFrom(7))
    tb, ends = TensorBoardLogger(tmp_path / "tb"), Ends()
    csv = CSVLogger(tmp_path / "log.csv")
    callbacks = [Checkpoint(tmp_path / "ckpt"), csv, tb, ends]
    with pytest.raises(optuna.TrialPruned, match="pruned at step 7"):
        fit_trial(trial, epochs=3, callbacks=callbacks)
    assert ends.ended == [None]  # after ours: on_train_end saw a clean stop
    assert tb.writer is None  # closed
    assert len((tmp_path / "log.csv").read_text().splitlines()) == 2  # header, epoch 0
    # The final checkpoint says the run finished: a rerun trains nothing and
    # says again that the trial was pruned.
    rerun = new_trial(PruneFrom(7))[1]
    with pytest.raises(optuna.TrialPruned, match="trial 0 pruned at step 7"):
        fit_trial(rerun, epochs=3, callbacks=[Checkpoint(tmp_path / "ckpt")])


class FailsAtEpochEnd(Callback):
    order = 50  # after OptunaPruning pruned the trial

    def on_epoch_end(self):
        raise RuntimeError("crash")


def test_an_error_of_the_fit_is_not_hidden_by_the_pruning():
    _, trial = new_trial(PruneFrom(7))
    with pytest.raises(RuntimeError, match="crash"):
        fit_trial(trial, epochs=3, callbacks=[FailsAtEpochEnd()])


def test_check_pruned_raises_after_a_pruning_only():
    _, trial = new_trial(PruneFrom(7))
    prune = OptunaPruning(trial)
    prune.check_pruned()  # nothing yet
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(optuna.TrialPruned):
        fit(3, model, F.cross_entropy, opt, make_data(), callbacks=[prune])
    assert (prune.pruned, prune.pruned_at) == (True, 7)
    with pytest.raises(optuna.TrialPruned, match="pruned at step 7"):
        prune.check_pruned()


# -- resuming ------------------------------------------------------------------------
def resumed_values(tmp_path, trials, crashes):
    """Fits 3 epochs of ``resume_learner`` with a validation every 2 steps,
    crashing at each of ``crashes``, each run with the next of ``trials``."""
    for trial, at in zip(trials, [*crashes, None], strict=True):
        extra = [Crash(at)] if at is not None else []
        prune = OptunaPruning(trial)
        schedule = ValidationSchedule(every_n_steps=2)
        ckpt = Checkpoint(tmp_path, every_n_steps=3)
        learn = resume_learner([ckpt, prune, schedule, *extra])
        try:
            learn.fit(3, lr=0.1)
        except RuntimeError:
            assert at is not None
    return prune


def unbroken_values():
    study, trial = new_trial()
    learn = resume_learner([OptunaPruning(trial), ValidationSchedule(every_n_steps=2)])
    learn.fit(3, lr=0.1)
    return study.trials[0].intermediate_values


def test_a_resumed_fit_reports_no_step_twice(tmp_path):
    study, trial = new_trial()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Optuna warns of a step reported twice
        prune = resumed_values(tmp_path, [trial] * 3, crashes=[5, 12])
    unbroken = unbroken_values()
    assert study.trials[0].intermediate_values == unbroken  # exact
    assert prune.reported == unbroken


def test_a_retried_trial_gets_the_values_reported_before_the_checkpoint(tmp_path):
    study = optuna.create_study(pruner=PruneFrom(10**9))
    trials = [study.ask() for _ in range(3)]  # a retry is a new trial
    resumed_values(tmp_path, trials, crashes=[5, 12])
    assert study.trials[2].intermediate_values == unbroken_values()


def test_state_dict_round_trips_and_refuses_another_monitor():
    _, trial = new_trial(PruneFrom(7))
    pruned = OptunaPruning(trial)
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(optuna.TrialPruned):
        fit(3, model, F.cross_entropy, opt, make_data(), callbacks=[pruned])
    state = pruned.state_dict()
    assert state["pruned_at"] == 7 and [s for s, _ in state["reported"]] == [7]
    copy = OptunaPruning(trial)
    copy.load_state_dict(state)
    assert (copy.pruned, copy.pruned_at, copy.reported) == (
        True, 7, pruned.reported)  # fmt: skip
    assert copy.state_dict() == state
    with pytest.raises(
        ValueError, match=r"reported 'valid_loss'.*reports 'train_loss'"
    ):
        OptunaPruning(trial, "train_loss").load_state_dict(state)
    with pytest.raises(ValueError, match="expected the keys"):
        copy.load_state_dict({"reported": []})


# -- errors --------------------------------------------------------------------------
def test_a_misspelt_monitor_is_refused_before_training():
    study, trial = new_trial()
    model = make_model()
    before = [p.clone() for p in model.parameters()]
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    prune = OptunaPruning(trial, monitor="valid_los")
    with pytest.raises(ValueError, match="did you mean 'valid_loss'"):
        fit(1, model, F.cross_entropy, opt, make_data(), callbacks=[prune])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert study.trials[0].intermediate_values == {}


def test_a_monitor_against_the_study_direction_is_refused():
    _, trial = new_trial()  # minimize
    with pytest.raises(ValueError, match=r"'accuracy' improves as it goes up.*"
                       r"direction='maximize'"):  # fmt: skip
        OptunaPruning(trial, monitor="accuracy")


@pytest.mark.parametrize("trial", ["trial", 3, optuna.create_study()])
def test_a_trial_that_is_not_an_optuna_trial_is_refused(trial):
    with pytest.raises(TypeError, match=r"trial must be an optuna.trial.Trial"):
        OptunaPruning(trial)


def test_a_frozen_trial_is_refused():
    study, trial = new_trial()
    study.tell(trial, 0.5)
    with pytest.raises(TypeError, match=r"got FrozenTrial 0 .*Fix: def objective"):
        OptunaPruning(study.trials[0])


def test_no_trial_is_refused_in_one_process():
    with pytest.raises(TypeError, match="trial is None on rank 0"):
        OptunaPruning(None)


def test_a_multi_objective_study_is_refused():
    study = optuna.create_study(directions=["minimize", "maximize"])
    with pytest.raises(ValueError, match="2 objectives"):
        OptunaPruning(study.ask())


def test_optuna_is_imported_only_when_a_trial_is_given(monkeypatch):
    code = "import sys, fitlib, fitlib.callbacks; print('optuna' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], env=child_env(),
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert run.stdout.strip() == "False"
    monkeypatch.setitem(sys.modules, "optuna", None)  # not installed
    with pytest.raises(ImportError, match=r"pip install fitlib\[optuna\]"):
        OptunaPruning(object())
