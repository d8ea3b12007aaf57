import torch
from helpers import make_data
from torch import nn
from torch.nn import functional as F  # noqa: N812

from fitlib import Learner
from fitlib.callbacks import MLflowLogger
from fitlib.tune import search


def make_learner(trial):
    width = trial.suggest_categorical("width", [8, 16])
    model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 3))
    return Learner(make_data(), model, F.cross_entropy, metrics=[], wd=0.0,
                   opt_func=torch.optim.SGD, progress=False)  # fmt: skip


def fit(learn, trial):
    learn.fit(1, lr=trial.suggest_float("lr", 1e-3, 0.5, log=True))


def test_each_trial_is_a_nested_run_of_the_studys_run(tmp_path, one_thread):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    def with_logger(trial):
        learn = make_learner(trial)
        learn.callbacks.append(MLflowLogger(uri, experiment="own"))
        return learn

    search(make_learner, fit, 2, directory=tmp_path / "a", mlflow=uri,
           progress=False)  # fmt: skip
    search(with_logger, fit, 1, directory=tmp_path / "b", progress=False)
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("search").experiment_id])
    parent = next(r for r in runs if r.info.run_name == "search")
    children = sorted((r for r in runs if r is not parent),
                      key=lambda r: r.info.run_name)  # fmt: skip
    assert [r.info.run_name for r in children] == ["trial-0", "trial-1"]
    for r in children:
        assert r.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert {"trial.lr", "trial.width"} <= set(r.data.params)
        assert r.info.status == "FINISHED"
    assert parent.info.status == "FINISHED" and "best_value" in parent.data.metrics
    own = client.search_runs([client.get_experiment_by_name("own").experiment_id])
    own_parent = next(r for r in own if r.info.run_name == "search")
    nested = [r for r in own if r.data.tags.get("mlflow.parentRunId")]
    assert [r.info.run_name for r in nested] == ["trial-0"]
    assert nested[0].data.tags["mlflow.parentRunId"] == own_parent.info.run_id
