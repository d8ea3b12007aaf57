import optuna
import pytest

import fitlib.tune_progress as tune_progress
from fitlib.tune_progress import TrialProgress, trial_line, trials_html
from fitlib.tune_retries import DEAD, FINISHED_NOTE, NOTE, REQUEUE

STATES = optuna.trial.TrialState


@pytest.fixture
def study():
    """An in-memory study of two trials of ``lr``: values 0.7 then 0.3."""
    study = optuna.create_study()
    for value in (0.7, 0.3):
        study.enqueue_trial({"lr": value})
        study.optimize(lambda t: t.suggest_float("lr", 0.0, 1.0), n_trials=1)
    return study


def test_trial_line_says_pruned_at_which_step_and_retries():
    study = optuna.create_study()
    lr = {"lr": optuna.distributions.FloatDistribution(1e-4, 1.0)}
    study.add_trial(optuna.create_trial(state=STATES.FAIL, params={"lr": 0.0123456},
                                        distributions=lr))  # fmt: skip
    study.add_trial(optuna.create_trial(
        state=STATES.PRUNED, params={"lr": 0.0123456}, distributions=lr,
        intermediate_values={7: 0.9, 14: 0.8}, value=0.8,
        system_attrs={"failed_trial": 0},
    ))  # fmt: skip
    best = optuna.trial.create_trial(value=0.5, state=STATES.COMPLETE)
    best.number = 4
    assert trial_line(study.trials[1], best, "valid_loss") == (
        "trial 1 (retry of trial 0) pruned at step 14: valid_loss 0.8 | "
        "lr=0.01235 | best 0.5 (trial 4)"
    )
    assert trial_line(study.trials[0], None, "accuracy") == "trial 0 fail | lr=0.01235"


def test_trial_line_says_a_trial_is_queued_again_and_a_retrys_note():
    study = optuna.create_study()
    lr = {"lr": optuna.distributions.FloatDistribution(1e-4, 1.0)}
    for state, attrs in [
        (STATES.FAIL, {REQUEUE: "suspended at step 11"}),
        (STATES.FAIL, {REQUEUE: DEAD}),
        (STATES.COMPLETE, {"failed_trial": 1, NOTE: FINISHED_NOTE}),
    ]:
        study.add_trial(optuna.create_trial(
            state=state, params={"lr": 0.5}, distributions=lr, system_attrs=attrs,
            value=0.25 if state == STATES.COMPLETE else None,
        ))  # fmt: skip
    lines = [trial_line(t, None, "valid_loss") for t in study.trials]
    assert lines == [
        "trial 0 suspended at step 11: its retry resumes it from its checkpoint "
        "on the next run | lr=0.5",
        "trial 1 failed (worker died): its retry resumes it from its checkpoint "
        "| lr=0.5",
        "trial 2 (retry of trial 1) complete: valid_loss 0.25 | lr=0.5 (its run "
        "had finished before its worker died: the Checkpoint's 'already finished' "
        "line is expected, and the value is its checkpoint's)",
    ]


def test_trials_html_lists_every_trial_with_the_best_in_bold(study):
    html = trials_html(study.trials, study.best_trial, "loss")
    assert "<caption>best: trial 1, loss 0.3</caption>" in html
    assert "<th>trial</th><th>state</th><th>loss</th><th>lr</th>" in html
    assert '<tr style="font-weight:bold"><td>1</td><td>complete</td><td>0.3' in html
    assert "<tr><td>0</td><td>complete</td><td>0.7</td>" in html


def test_a_terminal_gets_the_line_of_the_trial_that_ended(study, capsys):
    progress = TrialProgress(None, "loss")
    progress.trial_done(study, study.trials[0])
    progress.trial_done(study, study.trials[1])
    assert capsys.readouterr().out.splitlines() == [
        "trial 0 complete: loss 0.7 | lr=0.7 | best 0.3 (trial 1)",
        "trial 1 complete: loss 0.3 | lr=0.3 | best 0.3 (trial 1)",
    ]


def test_progress_false_shows_nothing(study, capsys):
    TrialProgress(False, "loss").trial_done(study, study.trials[0])
    assert capsys.readouterr().out == ""


def test_a_notebook_gets_one_table_redrawn_after_each_trial(study, monkeypatch):
    import IPython.display

    shown = []

    class Handle:
        def update(self, html):
            shown.append(("update", html.data))

    def display(html, display_id):
        shown.append(("display", html.data))
        return Handle()

    monkeypatch.setattr(tune_progress, "in_notebook", lambda: True)
    monkeypatch.setattr(IPython.display, "display", display)
    progress = TrialProgress(None, "loss")
    for trial in study.trials:
        progress.trial_done(study, trial)
    assert [kind for kind, _ in shown] == ["display", "update"]
    assert shown[-1][1] == trials_html(study.trials, study.best_trial, "loss")
