"""``MLflowLogger``: the run's parameters, records and per-step curves in an
MLflow tracking store (a server, a SQLite file or a folder)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from fitlib.callback import Callback
from fitlib.checks import check_flag, check_int
from fitlib.errors import name_of
from fitlib.record import Record
from fitlib.running_loss import batch_size
from fitlib.tracking import (
    check_mlflow_name,
    check_mlflow_names,
    check_mlflow_server,
    check_mlflow_store,
    check_mlflow_tags,
    directory_id,
    last_lr,
    mlflow_store_failure,
    mlflow_uri,
    optimizer_params,
    process_gone,
    process_place,
    read_into,
)
from fitlib.version import __version__

# What a resumed fit needs (run, step offset, the interval in progress).
_STATE_KEYS = ("run_id", "base", "epoch_base", "fits", "interval", "last_point")
_HYPERS = ("lr", "mom", "wd", "beta")
# The tags naming the experiment run: its Checkpoint directory's id (the key),
# and the directory's path (for people: another machine may have the same one).
_KEY_TAG, _DIR_TAG = "fitlib.checkpoint_dir_id", "fitlib.checkpoint_dir"
_OWN_TAGS = ("fitlib.version", "torch.version", "device", _KEY_TAG, _DIR_TAG,
             "fitlib.host", "fitlib.pid", "fitlib.pid_namespace",
             "fitlib.restarts", "fitlib.restarted_as")  # fmt: skip


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
    The run ends FINISHED, FAILED after an error, KILLED after Ctrl-C.

    A process killed outright (SIGKILL, out of memory) cannot end its run.
    With a ``Checkpoint`` among the callbacks the run is tagged
    ``fitlib.checkpoint_dir_id``, a random id made once in the directory
    (``.fitlib.run_id``, under the directory's lock): the experiment run's
    key, so a directory at the same path on another machine, or one made
    anew where an old one was moved aside, is another experiment run. It is
    also tagged ``fitlib.checkpoint_dir`` (the path, for people),
    ``fitlib.host`` and ``fitlib.pid`` (and, on Linux, the pid namespace).
    The rerun, resuming or not, marks KILLED each RUNNING run with its key
    whose process is surely dead: of this host (and pid namespace), and its
    pid exists no more (tagged ``fitlib.restarted_as`` with the new run's
    id; the new run ``fitlib.restarts``), and says so. A RUNNING run with
    its key that it cannot prove dead (another host: a shared directory on
    a network file system whose lock does not reach it; a live pid; Windows,
    where nothing is locked) is left RUNNING, with a warning naming it and
    how to end it. Killed after a checkpoint, the rerun goes on in the run
    of the checkpoint; killed before the first one, it trains again from
    step 0 in a new run rather than adopting the left one: MLflow can take
    back neither the points the dead process logged (its steps would hold
    two values each, different ones unless the fit is seeded) nor a
    parameter (the rerun may have new settings, and without a checkpoint
    nothing compares them), so the left run is closed as what it is, a
    killed attempt, as after Ctrl-C. Without a ``Checkpoint`` nothing tells
    a dead process's run from a live one: it stays RUNNING (end it with
    ``MlflowClient().set_terminated(run_id, "KILLED")``).
    With ``log_checkpoints`` the newest checkpoint and ``best.pth`` of a
    ``Checkpoint`` among the callbacks are logged as artifacts at the end.
    Under ``torch.distributed`` rank 0 alone logs.

    Arguments are checked as the logger is made, the store and what
    depends on the fit as training begins (before any batch): a store MLflow
    cannot open (an unknown scheme, a file that is not a database, a folder
    given as one, a path through a file) gets a ValueError naming the URI,
    what failed and the fix.

    Args:
        tracking_uri: ``http://host:port`` of an ``mlflow server``,
            ``sqlite:///path.db``, or None: MLflow's default
            (``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``), read now.
            A folder works with MLflow 2; MLflow 3 refuses it unless
            ``MLFLOW_ALLOW_FILE_STORE=true``.
        experiment: the experiment's name (created if missing).
        run_name: the run's name (None: MLflow picks one).
        params: more parameters (name -> value, shown as text); names MLflow
            takes, none that fitlib logs itself (``lr``, ``epochs``...).
        tags: more tags (name -> text, at most 8,000 characters); none of
            fitlib's own (``fitlib.*``, ``torch.version``, ``device``).
        every_n_steps: optimizer steps between two ``step/`` points.
        log_checkpoints: log the final and best checkpoints of the fit's
            ``Checkpoint`` (one must be among the callbacks) as artifacts.

    Examples:
        >>> mlf = MLflowLogger("http://127.0.0.1:5000", experiment="digits",
        ...                    params={"dropout": 0.3})
        >>> mlf
        MLflowLogger('http://127.0.0.1:5000', experiment='digits', every_n_steps=50)

        ``learn.fit_one_cycle(5, 1e-2, callbacks=[mlf])`` then logs the run to
        that server, whose page (or ``mlflow ui``) shows its params and
        curves. A store it cannot use fails as training begins, before any
        batch:

        >>> _ = open("notes.txt", "w").write("not a database")
        >>> learn.fit(1, lr=1e-3, callbacks=[MLflowLogger("sqlite:///notes.txt")])
        Traceback (most recent call last):
        ...
        ValueError: MLflowLogger: tracking_uri='sqlite:///notes.txt': 'notes.txt'
        is not an SQLite database (MLflow would fail on it). Fix: name a new
        database file or an MLflow one, e.g. tracking_uri='sqlite:///.../mlflow.db'.
        fitlib: raised in callback MLflowLogger.on_train_begin
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
        self.tracking_uri = mlflow_uri(uri)
        self.experiment = check_mlflow_name(experiment, "experiment", "'digits'")
        self.run_name = check_mlflow_name(run_name, "run_name", "'resnet-1'", none=True)
        self.params = check_mlflow_names(params, "params")
        self.tags = check_mlflow_tags(check_mlflow_names(tags, "tags"), _OWN_TAGS)
        self.every_n_steps = check_int(
            every_n_steps, "every_n_steps", minimum=1, owner=self.name, example=50
        )
        self.log_checkpoints = check_flag(
            log_checkpoints,
            "log_checkpoints",
            self.name,
            f"{self.name}(log_checkpoints=True)",
        )
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
        """Runs before training: checks the store, starts or reopens the run,
        closes the run a killed process of this experiment run left."""
        ckpt = next((cb for cb in state["callbacks"] if _is_checkpoint(cb)), None)
        self._check_fit(state, ckpt)
        # (Checkpoint, order -100, holds its directory's lock: the id is made once)
        tags = process_place() if ckpt is None else {**process_place(), **_key(ckpt)}
        self.client = self._connect()
        self._logged = (-1, -1)
        if iteration > 0 and self.run_id is not None:
            self._reopen(tags)  # Checkpoint restored our state: the run goes on
            self._logged = self._last_logged()
            self._close_left_runs(tags)
            self._fitting = True
            return
        if self.run_id is None:
            self._start_run(state["model"], tags)
            self._close_left_runs(tags)
        else:  # a later fit of this logger: its steps count on
            self._reopen(tags)
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
            check_mlflow_server(uri)
        check_mlflow_store(uri)  # MLflow would retry a bad file for minutes
        try:
            client = _mlflow().tracking.MlflowClient(tracking_uri=uri)
            found = client.get_experiment_by_name(self.experiment)
        except Exception as e:
            raise ValueError(mlflow_store_failure(uri, e)) from e
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

    def _reopen(self, tags: dict) -> None:
        """Sets the run RUNNING again, tagged with this process's place."""
        try:
            self.client.update_run(self.run_id, status="RUNNING")
            self._send(tags=[_mlflow().entities.RunTag(k, v) for k, v in tags.items()])
        except Exception as e:
            raise ValueError(
                f"MLflowLogger: the run {self.run_id} (of the checkpoint, or of "
                f"this logger's earlier fit) is not in {self.tracking_uri!r} "
                f"({e}). Fix: resume against the store that holds it, or start "
                "afresh (Checkpoint(resume=False), or a new MLflowLogger)."
            ) from e

    def _check_fit(self, state: dict, ckpt: Any) -> None:
        """Refuses, before any run starts, what this fit's settings contradict."""
        if self.log_checkpoints and ckpt is None:
            raise ValueError(
                "MLflowLogger: log_checkpoints=True logs a Checkpoint's files, but "
                "this fit has no Checkpoint among its callbacks. Fix: add one, "
                "e.g. callbacks=[Checkpoint('runs/exp1'), logger], or pass "
                "log_checkpoints=False."
            )
        auto = _auto_params(state)
        taken = sorted(set(self.params) & set(auto))
        if taken:
            raise ValueError(
                f"MLflowLogger: params {taken} are parameters fitlib logs itself "
                f"(from the fit: {auto[taken[0]]!r} for "
                f"{taken[0]!r}); yours would replace them. Fix: give yours other "
                f"names, e.g. params={{'my.{taken[0]}': ...}}."
            )

    def _start_run(self, model: Any, place: dict) -> None:
        tags = {
            "fitlib.version": __version__,
            "torch.version": torch.__version__,
            "device": _device(model),
            **place,
            **self.tags,
        }
        run = self.client.create_run(
            self._experiment_id, run_name=self.run_name, tags=tags
        )
        self.run_id = run.info.run_id
        self._base = self._last_point = 0

    def _close_left_runs(self, tags: dict) -> None:
        """Marks KILLED the runs of this experiment run (its Checkpoint
        directory's id) left RUNNING by a process of this machine that has
        ended (killed outright); warns of those whose process may be alive."""
        key = tags.get(_KEY_TAG)
        if key is None:
            return
        left = [r for r in self._running_runs(key) if r.info.run_id != self.run_id]
        dead = [r.info.run_id for r in left if _surely_ended(r.data.tags, tags)]
        for run_id in dead:
            self.client.set_tag(run_id, "fitlib.restarted_as", self.run_id)
            self.client.set_terminated(run_id, "KILLED")
        if dead:
            self.client.set_tag(self.run_id, "fitlib.restarts", ", ".join(dead))
            print(
                f"fitlib: MLflowLogger: run {', '.join(dead)} of {tags[_DIR_TAG]!r} "
                "was left RUNNING by a process of this machine killed before it "
                "could end it, and no checkpoint resumes it: marked KILLED. This "
                f"fit logs to run {self.run_id}.",
                file=sys.stderr,
            )
        alive = [r for r in left if r.info.run_id not in dead]
        if alive:
            self._warn_alive(alive, tags[_DIR_TAG])

    def _warn_alive(self, runs: list, where: str) -> None:
        named = ", ".join(
            f"{r.info.run_id} (host {r.data.tags.get('fitlib.host')!r}, pid "
            f"{r.data.tags.get('fitlib.pid')})"
            for r in runs
        )
        print(
            f"fitlib: MLflowLogger: warning: run {named} of this checkpoint "
            f"directory ({where!r}) is RUNNING and its process may be alive: left "
            "RUNNING (only a process of this machine whose pid is gone is known "
            "dead; two live fits in one directory overwrite each other's files). "
            f"This fit logs to run {self.run_id}. If that process has ended, end "
            f"its run: MlflowClient({self.tracking_uri!r}).set_terminated(run_id, "
            "'KILLED').",
            file=sys.stderr,
        )

    def _running_runs(self, key: str) -> list:
        """The experiment's RUNNING runs of the checkpoint directory ``key``."""
        query = f"attributes.status = 'RUNNING' and tags.`{_KEY_TAG}` = '{key}'"
        runs, token = [], None
        while True:
            page = self.client.search_runs(
                [self._experiment_id], query, max_results=1000, page_token=token
            )
            runs.extend(page)
            token = page.token
            if not token:
                return runs

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

    def _send(self, metrics: list = (), params: list = (), tags: list = ()) -> None:
        # MLflow takes at most 1,000 metrics, 100 params and 100 tags per call.
        metrics, params, tags = list(metrics), list(params), list(tags)
        while metrics or params or tags:
            self.client.log_batch(
                self.run_id, metrics=metrics[:1000], params=params[:100],
                tags=tags[:100],
            )  # fmt: skip
            metrics, params, tags = metrics[1000:], params[100:], tags[100:]

    def _log_checkpoints(self, callbacks: list) -> None:
        for cb in callbacks:
            if not _is_checkpoint(cb):
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


def _is_checkpoint(cb: Any) -> bool:
    return hasattr(cb, "checkpoints") and hasattr(cb, "dirpath")


def _key(ckpt: Any) -> dict:
    """The tags naming the experiment run: its Checkpoint directory's id (made
    once in it, so another directory at the same path has another) and path."""
    return {
        _KEY_TAG: directory_id(Path(ckpt.dirpath)),
        _DIR_TAG: str(Path(ckpt.dirpath).resolve()),
    }


def _surely_ended(tags: dict, here: dict) -> bool:
    """Whether the process a run's ``tags`` name has ended: one of this
    machine (host and pid namespace) whose pid no longer exists."""
    same = all(
        tags.get(k) == here.get(k) for k in ("fitlib.host", "fitlib.pid_namespace")
    )
    return same and process_gone(tags.get("fitlib.pid"))


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
