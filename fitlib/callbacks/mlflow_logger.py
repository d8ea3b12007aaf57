"""``MLflowLogger``: the run's parameters, records and per-step curves in an
MLflow tracking store (a server, a SQLite file or a folder)."""

from __future__ import annotations

import os
import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch

from fitlib.callback import Callback
from fitlib.checks import check_int
from fitlib.errors import name_of
from fitlib.record import Record, batch_size
from fitlib.tracking import last_lr, optimizer_params, read_into

# What a resumed fit needs (run, step offset, the interval in progress).
_STATE_KEYS = ("run_id", "base", "epoch_base", "fits", "interval", "last_point")
_HYPERS = ("lr", "mom", "wd", "beta")


class MLflowLogger(Callback):
    """Logs a fit to MLflow: parameters, every record, per-step loss and lr.

    One logger is one MLflow run. As training begins it checks the tracking
    store (an unreachable server fails here, not after an epoch), creates the
    experiment if needed and starts a run, tagged with the fitlib and torch
    versions and the device. It logs as parameters the model (class,
    parameter count), the optimizer (class, ``lr``, ``mom``, ``wd``,
    ``beta`` of the last parameter group), the epochs, ``max_steps``, the
    batch size, the loss, the metrics, every callback with its settings (its
    public attributes of plain values) and ``params``; a value longer than
    MLflow takes (6,000 characters) is shortened, with a note. Later fits of
    the same logger go on in the same run, their parameters prefixed
    ``fit2.``, ``fit3.``...

    Metrics: every value of each record under ``epoch/<name>`` (losses,
    metrics, training metrics, loss parts, ``lr``, ``time``, the epoch),
    at the record's step (optimizer steps since the run began); and every
    ``every_n_steps`` steps ``step/loss`` (the sample-weighted mean training
    loss since the previous point) and ``step/lr``. The losses stay on the
    device until a point is due: one host transfer per point, none per step.

    A fit resumed by ``Checkpoint`` goes on in the same run (its id is in
    the checkpoint): the points the interrupted process logged after the
    checkpoint, which the exact resume computes again, are not logged twice.
    The run ends FINISHED, FAILED after an error, KILLED after Ctrl-C (a
    process killed outright leaves it RUNNING until a resume finishes it).
    With ``log_checkpoints`` the newest checkpoint and ``best.pth`` of a
    ``Checkpoint`` among the callbacks are logged as artifacts at the end.
    Under ``torch.distributed`` rank 0 alone logs.

    Args:
        tracking_uri: ``http://host:port`` of an ``mlflow server``,
            ``sqlite:///path.db``, or None: MLflow's default
            (``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``), read now.
            A folder works with MLflow 2; MLflow 3 refuses it unless
            ``MLFLOW_ALLOW_FILE_STORE=true``.
        experiment: the experiment's name (created if missing).
        run_name: the run's name (None: MLflow picks one).
        params: more parameters (name -> value, shown as text).
        tags: more tags (name -> text).
        every_n_steps: optimizer steps between two ``step/`` points.
        log_checkpoints: log the final and best checkpoints as artifacts.

    Example:
        >>> mlf = MLflowLogger("http://127.0.0.1:5000", experiment="digits",
        ...                    params={"dropout": 0.3})
        >>> learn.fit_one_cycle(5, 1e-2, callbacks=[mlf])
        $ mlflow ui   # or the server's page: the run, its params and curves
    """

    order = 55  # with the other loggers: after the Recorder, values final
    in_lr_find = False  # a sweep is not part of the run it records
    main_only = True  # under torch.distributed, rank 0 alone

    def __init__(
        self,
        tracking_uri: str | os.PathLike | None = None,
        experiment: str = "fitlib",
        run_name: str | None = None,
        params: dict | None = None,
        tags: dict | None = None,
        every_n_steps: int = 50,
        log_checkpoints: bool = False,
    ) -> None:
        mlflow = _mlflow()
        uri = mlflow.get_tracking_uri() if tracking_uri is None else tracking_uri
        self.tracking_uri = _as_uri(uri)
        if not isinstance(experiment, str) or not experiment:
            raise TypeError(
                f"MLflowLogger: experiment must be a non-empty str; got "
                f"{experiment!r}. Fix: e.g. MLflowLogger(experiment='digits')."
            )
        self.experiment, self.run_name = experiment, run_name
        self.params = _check_mapping(params, "params")
        self.tags = _check_mapping(tags, "tags")
        self.every_n_steps = check_int(
            every_n_steps, "every_n_steps", minimum=1, owner=self.name, example=50
        )
        self.log_checkpoints = log_checkpoints
        self.client: Any = None
        self.run_id: str | None = None
        self._base = 0  # global step where this fit began (earlier fits' steps)
        self._fits = 0
        self._interval = [0.0, 0]  # weighted loss sum and samples since a point
        self._last_point = 0  # global step of the latest step/ point
        self._unread: list[tuple[torch.Tensor, int]] = []
        self._logged = (-1, -1)  # (step/, epoch/) steps already in the store
        self._done = (0, 0)  # global (step, epoch) where the previous fit ended
        self._epoch_base = 0  # epochs of earlier fits: epoch/epoch counts on
        self._fitting = False  # between this fit's on_train_begin and its end

    # -- hooks -----------------------------------------------------------------
    def on_train_begin(self, iteration: int, step: int, **state: Any) -> None:
        """Runs before training: checks the store, starts or reopens the run."""
        self.client = self._connect()
        self._logged = (-1, -1)
        if iteration > 0 and self.run_id is not None:
            self._reopen()  # Checkpoint restored our state: the run goes on
            self._logged = self._last_logged()
            self._fitting = True
            return
        if self.run_id is None:
            self._start_run(state["model"])
        else:  # a later fit of this logger: its steps count on
            self._reopen()
            self._base, self._epoch_base = self._done
            self._last_point = self._base
        self._fits += 1
        self._unread, self._interval = [], [0.0, 0]
        prefix = "" if self._fits == 1 else f"fit{self._fits}."
        self._log_params(state, prefix)
        self._fitting = True

    def on_batch_end(
        self, train: bool, step: int, last_loss: torch.Tensor, last_target: Any,
        last_input: Any, opt: Any,
    ) -> None:  # fmt: skip
        """Runs after each batch: keeps the loss; logs at every n-th step."""
        if not train:
            return
        self._unread.append((last_loss, batch_size(last_target, last_input)))
        now = self._base + step
        if now % self.every_n_steps == 0 and now > self._last_point:
            self._log_point(now, opt)

    def on_epoch_end(self, step: int, record: Record) -> None:
        """Runs after validation: logs the record's values at its step."""
        now = self._base + step
        if now <= self._logged[1]:
            return  # logged by the process that this fit resumes
        stamp = _now_ms()
        values = {**record, "epoch": self._epoch_base + record["epoch"]}
        metrics = [
            _metric(f"epoch/{k}", v, stamp, now)
            for k, v in values.items()
            if v is not None and k != "step"
        ]
        self._send(metrics=metrics)

    def on_train_end(
        self,
        exception: BaseException | None,
        callbacks: list,
        step: int,
        epoch: int,
        mid_epoch: bool,
    ) -> None:
        """Runs at the end, also after an error: the run's status, artifacts."""
        if not self._fitting:  # this fit failed before our on_train_begin ran
            return
        self._fitting = False
        # (stopped after a validation inside an epoch: that epoch is done with)
        self._done = (self._base + step, self._epoch_base + epoch + mid_epoch)
        try:
            if self.log_checkpoints:
                self._log_checkpoints(callbacks)
        finally:
            status = "FINISHED"
            if isinstance(exception, KeyboardInterrupt):
                status = "KILLED"
            elif exception is not None:
                status = "FAILED"
            self.client.set_terminated(self.run_id, status)

    # -- the store -------------------------------------------------------------
    def _connect(self) -> Any:
        """A client of the store, checked now: before any training."""
        uri = self.tracking_uri
        if uri.startswith(("http://", "https://")):
            _check_server(uri)
        client = _mlflow().tracking.MlflowClient(tracking_uri=uri)
        try:
            found = client.get_experiment_by_name(self.experiment)
        except Exception as e:
            raise ValueError(
                f"MLflowLogger: the tracking store {uri!r} cannot be read ({e}). "
                "Fix: pass a tracking_uri that works, e.g. 'sqlite:///mlflow.db', "
                "a folder, or the address of a running mlflow server."
            ) from e
        if found is not None and found.lifecycle_stage == "deleted":
            raise ValueError(
                f"MLflowLogger: the experiment {self.experiment!r} in {uri!r} is "
                f"deleted (id {found.experiment_id}), and its name stays taken. "
                f"Fix: restore it (mlflow experiments restore --experiment-id "
                f"{found.experiment_id}) or use another experiment name."
            )
        self._experiment_id = (
            found.experiment_id if found else client.create_experiment(self.experiment)
        )
        return client

    def _reopen(self) -> None:
        try:
            self.client.update_run(self.run_id, status="RUNNING")
        except Exception as e:
            raise ValueError(
                f"MLflowLogger: the run {self.run_id} (of the checkpoint, or of "
                f"this logger's earlier fit) is not in {self.tracking_uri!r} "
                f"({e}). Fix: resume against the store that holds it, or start "
                "afresh (Checkpoint(resume=False), or a new MLflowLogger)."
            ) from e

    def _start_run(self, model: Any) -> None:
        import fitlib

        tags = {
            "fitlib.version": fitlib.__version__,
            "torch.version": torch.__version__,
            "device": _device(model),
            **self.tags,
        }
        run = self.client.create_run(
            self._experiment_id, run_name=self.run_name, tags=tags
        )
        self.run_id = run.info.run_id
        self._base = self._last_point = 0

    def _last_logged(self) -> tuple[int, int]:
        """The last step of each kind of point the store holds for the run."""
        last = []
        for key in ("step/lr", "epoch/epoch"):
            history = self.client.get_metric_history(self.run_id, key)
            last.append(max((m.step for m in history), default=-1))
        return last[0], last[1]

    def _log_params(self, state: dict, prefix: str) -> None:
        values = {**_auto_params(state), **self.params}
        params, shortened = [], []
        for key, value in values.items():
            text = str(value)
            if len(text) > _MAX_PARAM:
                text = text[: _MAX_PARAM - 3] + "..."
                shortened.append(key)
            params.append(_mlflow().entities.Param(prefix + key, text))
        if shortened:
            print(
                f"fitlib: MLflowLogger: parameter(s) {shortened} longer than "
                f"MLflow's {_MAX_PARAM} characters, logged shortened.",
                file=sys.stderr,
            )
        self._send(params=params)

    def _log_point(self, now: int, opt: Any) -> None:
        self._read()  # one host transfer for the interval's losses
        total, n = self._interval
        self._interval, self._last_point = [0.0, 0], now
        if now <= self._logged[0]:
            return  # logged by the process that this fit resumes
        stamp = _now_ms()
        metrics = [_metric("step/lr", last_lr(opt), stamp, now)]
        if n:
            metrics.append(_metric("step/loss", total / n, stamp, now))
        self._send(metrics=metrics)

    def _read(self) -> None:
        read_into(self._interval, self._unread)

    def _send(self, metrics: list = (), params: list = ()) -> None:
        # MLflow takes at most 1,000 metrics and 100 params per call.
        metrics, params = list(metrics), list(params)
        while metrics or params:
            self.client.log_batch(
                self.run_id, metrics=metrics[:1000], params=params[:100]
            )
            metrics, params = metrics[1000:], params[100:]

    def _log_checkpoints(self, callbacks: list) -> None:
        for cb in callbacks:
            if not (hasattr(cb, "checkpoints") and hasattr(cb, "dirpath")):
                continue
            best = Path(cb.dirpath) / "best.pth"
            for path in [*cb.checkpoints()[-1:], *([best] if best.exists() else [])]:
                self.client.log_artifact(self.run_id, str(path), "checkpoints")

    # -- saving ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """The run's id and where its points are (reads the device once)."""
        self._read()
        return {
            "run_id": self.run_id,
            "base": self._base,
            "epoch_base": self._epoch_base,
            "fits": self._fits,
            "interval": list(self._interval),
            "last_point": self._last_point,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores what ``state_dict`` returned."""
        if not isinstance(state, dict) or set(state) != set(_STATE_KEYS):
            raise ValueError(
                f"MLflowLogger.load_state_dict: expected the keys "
                f"{sorted(_STATE_KEYS)}; got {state!r}. Fix: pass what "
                "MLflowLogger.state_dict() returned."
            )
        self.run_id, self._base = state["run_id"], int(state["base"])
        self._epoch_base = int(state["epoch_base"])
        self._fits, self._last_point = int(state["fits"]), int(state["last_point"])
        self._interval, self._unread = list(state["interval"]), []

    def __repr__(self) -> str:
        return (
            f"{self.name}({self.tracking_uri!r}, experiment={self.experiment!r}, "
            f"every_n_steps={self.every_n_steps})"
        )


_MAX_PARAM = 6000  # MLflow's longest parameter value


def _mlflow() -> Any:
    # Imported when a logger is made: mlflow is an optional extra, and a slow
    # import that `import fitlib` should not pay.
    try:
        import mlflow
        import mlflow.entities
        import mlflow.tracking
    except ImportError as e:
        raise ImportError(
            "MLflowLogger needs the mlflow package. Fix: pip install "
            "fitlib[mlflow] (or pip install mlflow)."
        ) from e
    return mlflow


def _as_uri(uri: Any) -> str:
    if isinstance(uri, str) and re.fullmatch(r"[\w.-]+:\d+/?", uri):
        raise ValueError(
            f"MLflowLogger: tracking_uri={uri!r} has no scheme. Fix: "
            f"'http://{uri}' for a server, or 'sqlite:///mlflow.db' for a file."
        )
    if isinstance(uri, os.PathLike) or (
        isinstance(uri, str) and uri and "://" not in uri and ":" not in uri[1:3]
    ):
        return Path(uri).resolve().as_uri()  # a folder: MLflow's file store
    if not isinstance(uri, str) or not uri:
        raise TypeError(
            f"MLflowLogger: tracking_uri must be a str or a path; got {uri!r}. "
            "Fix: e.g. 'http://127.0.0.1:5000' or 'sqlite:///mlflow.db'."
        )
    return uri


def _check_server(uri: str) -> None:
    """Asks the server's /health, briefly: MLflow's client would retry for
    minutes before failing."""
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5) as r:
            r.read()
    except urllib.error.HTTPError:
        return  # it answered (a proxy without /health, a login page...)
    except (urllib.error.URLError, OSError) as e:
        raise ValueError(
            f"MLflowLogger: no MLflow server answers at {uri!r} ({e}). Fix: start "
            "it (mlflow server --host 127.0.0.1 --port 5000) or pass another "
            "tracking_uri, e.g. 'sqlite:///mlflow.db' for a local file."
        ) from e


def _check_mapping(values: Any, name: str) -> dict:
    if values is None:
        return {}
    if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
        raise TypeError(
            f"MLflowLogger: {name} must be a dict of str names; got {values!r}. "
            f"Fix: e.g. {name}={{'dropout': 0.3}}."
        )
    return dict(values)


def _auto_params(state: dict) -> dict:
    model, opt, data = state["model"], state["opt"], state["data"]
    params: dict[str, Any] = {
        "model": type(getattr(model, "module", model)).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "epochs": state["n_epochs"],
        "max_steps": state["max_steps"],
        "batch_size": getattr(getattr(data, "train_dl", None), "batch_size", None),
        "loss_func": name_of(state["loss_func"]),
        "metrics": ", ".join(getattr(state["metrics"], "names", None) or []) or None,
    }
    params.update(optimizer_params(opt, _HYPERS))
    seen: dict[str, int] = {}
    for cb in state["callbacks"]:
        key = f"callback.{cb.name}"
        seen[key] = seen.get(key, 0) + 1
        params[key if seen[key] == 1 else f"{key}.{seen[key]}"] = _settings(cb)
    return {k: v for k, v in params.items() if v is not None}


_PLAIN = (bool, int, float, str, type(None))


def _settings(cb: Any) -> str:
    """``Name(setting=value, ...)``: a callback's public attributes that hold
    plain values (a path as text, a monitor by its name), yours too."""
    parts = []
    for key, value in vars(cb).items():
        if key.startswith("_") or key == "callback":
            continue
        if isinstance(value, Path):
            value = str(value)
        elif not isinstance(value, _PLAIN) and isinstance(
            getattr(value, "name", 0), str
        ):
            value = value.name  # a Monitor: the value it watches
        plain = isinstance(value, _PLAIN) or (  # (a list: what it keeps)
            isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value)
        )
        if plain:
            parts.append(f"{key}={value!r}")
    text = f"{cb.name}({', '.join(parts)})"
    inner = getattr(cb, "callback", None)  # a filter (every, once): what it runs
    return text if inner is None else f"{text}: {_settings(inner)}"


def _metric(key: str, value: Any, stamp: int, step: int) -> Any:
    return _mlflow().entities.Metric(key, float(value), stamp, step)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _device(model: Any) -> str:
    param = next(iter(model.parameters()), None)
    return "cpu" if param is None else str(param.device)
