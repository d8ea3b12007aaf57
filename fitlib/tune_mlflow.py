"""The MLflow side of ``fitlib.tune.search``: one run for the study in each
tracking store its trials log to, and each trial's ``MLflowLogger`` nested in
it (``mlflow.parentRunId``), named after its run directory, with the trial's
parameters as ``trial.<name>``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fitlib.callback import Callback
from fitlib.callbacks.mlflow_logger import MLflowLogger
from fitlib.tune_retries import FileLock, best_trial


class StudyRuns:
    """The study's MLflow runs, by tracking URI, and the nesting of trials.

    The study's run is made once for all workers: its id is kept in the
    study's user attributes (``mlflow_run_id:<uri>``), read or written
    under the study's lock.
    """

    def __init__(self, study_lock: FileLock, uri: str | None) -> None:
        self.study_lock, self.uri = study_lock, uri
        self.runs: dict[str, tuple] = {}  # uri -> (client, run id)

    def nest(self, learn: Any, trial: Any, run_dir: Path) -> None:
        """Nests the trial's MLflow loggers (one added with ``uri``, if the
        Learner has none) in the study's run."""
        loggers = [cb for cb in learn.callbacks if isinstance(cb, MLflowLogger)]
        if self.uri is not None and not loggers:
            loggers = [MLflowLogger(self.uri, experiment=trial.study.study_name)]
            learn.callbacks = [*learn.callbacks, *loggers]
        for logger in loggers:
            parent = self._run(trial.study, logger.tracking_uri, logger.experiment)
            logger.tags = {**logger.tags, "mlflow.parentRunId": parent,
                           "optuna.trial": str(trial.number)}  # fmt: skip
            logger.run_name = logger.run_name or run_dir.name

        def log_params() -> None:  # as the fit begins: fit's values drawn too
            params = {f"trial.{k}": v for k, v in trial.params.items()}
            for logger in loggers:
                logger.params = {**params, **logger.params}

        if loggers:  # (before the loggers, order 55)
            hook = Callback.from_hooks(on_train_begin=log_params, order=54,
                                       name="trial params")  # fmt: skip
            learn.callbacks = [*learn.callbacks, hook]

    def end(self, study: Any, finished: bool) -> None:
        """Tags the best trial on the study's runs; FINISHED once the study
        holds all its trials."""
        best = best_trial(study)
        for client, run_id in self.runs.values():
            if best is not None:
                client.set_tag(run_id, "optuna.best_trial", str(best.number))
                client.log_metric(run_id, "best_value", best.value, step=best.number)
            if finished:
                client.set_terminated(run_id, "FINISHED")

    def _run(self, study: Any, uri: str, experiment: str) -> str:
        if uri not in self.runs:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=uri)
            with self.study_lock:  # one run for every worker
                run_id = study.user_attrs.get(f"mlflow_run_id:{uri}")
                if run_id is None:
                    run_id = _new_run(client, study, experiment)
                    study.set_user_attr(f"mlflow_run_id:{uri}", run_id)
            self.runs[uri] = (client, run_id)
        return self.runs[uri][1]


def _new_run(client: Any, study: Any, experiment: str) -> str:
    found = client.get_experiment_by_name(experiment)
    exp_id = found.experiment_id if found else client.create_experiment(experiment)
    tags = {"optuna.study_name": study.study_name}
    return client.create_run(exp_id, run_name=study.study_name, tags=tags).info.run_id
