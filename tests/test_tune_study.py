import optuna
import pytest
from helpers import make_data
from torch import nn
from torch.nn import functional as F  # noqa: N812

from fitlib import Learner
from fitlib.tune import search
from fitlib.tune_study import default_pruner, default_sampler


def make_learner(trial):
    width = trial.suggest_categorical("width", [8, 16])
    model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 3))
    return Learner(make_data(), model, F.cross_entropy, metrics=[], progress=False)


def run(tmp_path, n_trials=3, **kwargs):
    kwargs = {"progress": False, "directory": tmp_path / "runs", **kwargs}
    fit = kwargs.pop("fit", lambda learn, trial: learn.fit(1, lr=0.1))
    return search(make_learner, fit, n_trials, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"n_trials": 0}, ValueError, "n_trials must be an int >= 1; got 0"),
        ({"direction": "down"}, ValueError, "direction must be 'minimize'.*'down'"),
        ({"monitor": "wobble"}, ValueError, "whether monitor='wobble' should.*direc"),
        ({"monitor": "valid_los"}, ValueError, "did you mean 'valid_loss'"),
        ({"timeout": -1}, ValueError, "timeout must be"),
        ({"progress": "no"}, TypeError, "progress must be True or False"),
        ({"directory": ""}, ValueError, "directory"),
        ({"fit": "fit"}, TypeError, "fit must be a function; got 'fit'"),
        ({"checkpoint": {"keep_last": 0}}, ValueError, "keep_last must be an int >= 1"),
        (
            {"checkpoint": ["every_n_steps", 2]},
            TypeError,
            r"checkpoint must be a dict .*got \['every_n_steps', 2\]\. Fix: e\.g\.",
        ),
    ],
)
def test_bad_arguments_are_refused_before_any_trial(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        run(tmp_path, **kwargs)
    assert not (tmp_path / "runs").exists()


def test_a_search_launched_on_several_ranks_is_refused(tmp_path, monkeypatch):
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)  # as torchrun sets them
    with pytest.raises(ValueError, match=r"launched on 2 ranks.*OptunaPruning"):
        run(tmp_path, 1)
    assert not (tmp_path / "runs" / "study.log").exists()


def test_the_default_sampler_is_seeded_from_the_seed_and_the_trial_number():
    def drawn(seed, number):
        study = optuna.create_study(sampler=default_sampler(optuna, seed, number))
        return study.ask().suggest_float("x", 0, 1)

    assert drawn(0, 1) == drawn(0, 1)
    assert len({drawn(0, 1), drawn(1, 0), drawn(0, 2)}) == 3  # not seed + number
    pruner = default_pruner(optuna)
    assert (pruner._n_startup_trials, pruner._n_min_trials) == (5, 3)
