"""MLflowLogger against a real ``mlflow server`` (SQLite behind it) and a local
SQLite store, read back with MlflowClient."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from helpers import child_env, make_data, make_model
from torch.nn import functional as F  # noqa: N812

pytest.importorskip("mlflow", reason="mlflow is not installed (the dev extra has it)")
from mlflow.tracking import MlflowClient

from fitlib import Callback, Learner
from fitlib.callbacks import Checkpoint, MLflowLogger
from fitlib.metrics import accuracy

HERE = Path(__file__).parent
pytestmark = pytest.mark.usefixtures("one_thread")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """An ``mlflow server`` on a free port of 127.0.0.1, stopped at the end
    whatever happens."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    mlflow = Path(sys.executable).with_name("mlflow")
    store = f"sqlite:///{root / 'db.sqlite'}"
    cmd = [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(port),
           "--backend-store-uri", store, "--workers", "1",
           "--artifacts-destination", str(root / "artifacts")]  # fmt: skip
    log = open(root / "server.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(uri + "/health", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("mlflow server did not start: " + (root / "server.log")
                                .read_text()[-2000:])  # fmt: skip
                time.sleep(0.3)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def learner(callbacks, **kwargs):
    torch.manual_seed(0)
    return Learner(make_data(), make_model(), F.cross_entropy, metrics=[accuracy],
                   opt_func=torch.optim.SGD, progress=False, callbacks=callbacks,
                   **kwargs)  # fmt: skip


def runs_of(client, experiment):
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id])


def history(client, run_id, key):
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


class Sizes(Callback):
    """Keeps every training batch's size (the loss is in the Recorder)."""

    def __init__(self):
        self.sizes = []

    def on_batch_end(self, train, last_target):
        if train:
            self.sizes.append(len(last_target))


# -- against the server ------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:Checkpoint. callback Sizes")  # the test's spy
def test_logs_params_every_record_and_step_points_to_the_server(server, tmp_path):
    logger = MLflowLogger(server, experiment="digits-like", run_name="first",
                          params={"dropout": 0.3}, every_n_steps=3,
                          log_checkpoints=True)  # fmt: skip
    sizes = Sizes()
    ckpt = Checkpoint(tmp_path / "ckpt", monitor="accuracy")
    learn = learner([logger, ckpt, sizes])
    learn.fit(2, lr=0.1)
    client = MlflowClient(server)
    (run,) = runs_of(client, "digits-like")
    assert run.info.status == "FINISHED" and run.info.run_name == "first"
    params = run.data.params
    assert params["optimizer"] == "SGD" and params["lr"] == "0.1"
    assert params["epochs"] == "2" and params["batch_size"] == "16"
    assert params["loss_func"] == "cross_entropy" and params["metrics"] == "accuracy"
    assert params["dropout"] == "0.3" and params["model"] == "Sequential"
    settings = params["callback.Checkpoint"]  # the settings, not only the name
    assert (
        settings.startswith("Checkpoint(dirpath=") and "monitor='accuracy'" in settings
    )
    assert "keep_last=3" in settings and "every_n_epochs=1" in settings
    assert run.data.tags["torch.version"] == torch.__version__
    rec = learn.recorder
    # Every record value, at the record's step (7 steps an epoch).
    train_losses = history(client, run.info.run_id, "epoch/train_loss")
    assert [s for s, _ in train_losses] == [7, 14]
    assert [v for _, v in train_losses] == pytest.approx(rec.train_losses)
    assert [v for _, v in history(client, run.info.run_id, "epoch/accuracy")] == (
        pytest.approx([row["accuracy"] for row in rec.epoch_table()])
    )
    assert [s for s, _ in history(client, run.info.run_id, "epoch/time")] == [7, 14]
    # step/loss: the sample-weighted mean of the steps since the last point.
    points = history(client, run.info.run_id, "step/loss")
    assert [s for s, _ in points] == [3, 6, 9, 12]
    for k, (step, value) in enumerate(points):
        losses = rec.losses[3 * k : step]
        ns = sizes.sizes[3 * k : step]
        mean = sum(v * n for v, n in zip(losses, ns, strict=True)) / sum(ns)
        assert value == pytest.approx(mean, rel=1e-6)
    assert [v for _, v in history(client, run.info.run_id, "step/lr")] == [0.1] * 4
    files = {a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")}
    assert "checkpoints/best.pth" in files and len(files) == 2


def test_a_run_killed_with_sigkill_and_resumed_has_every_point_once(server, tmp_path):
    def child(experiment, ckpt="-", kill_at="-"):
        cmd = [sys.executable, str(HERE / "mlflow_child.py"), server, experiment,
               str(ckpt), str(kill_at)]  # fmt: skip
        return subprocess.run(cmd, env=child_env(OMP_NUM_THREADS="1"),
                              capture_output=True, text=True, timeout=240)  # fmt: skip

    ref = child("uninterrupted")
    assert ref.returncode == 0, ref.stderr[-2000:]
    killed = child("killed", tmp_path, kill_at=9)
    assert killed.returncode == -signal.SIGKILL
    client = MlflowClient(server)
    (run,) = runs_of(client, "killed")
    assert run.info.status == "RUNNING"  # nobody could end it
    resumed = child("killed", tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    (run,) = runs_of(client, "killed")  # the same run, finished
    (ref_run,) = runs_of(client, "uninterrupted")
    assert run.info.status == "FINISHED"
    keys = set(ref_run.data.metrics)
    assert set(run.data.metrics) == keys and "step/loss" in keys
    for key in keys - {"epoch/time"}:  # seconds differ; the rest is exact
        assert history(client, run.info.run_id, key) == history(
            client, ref_run.info.run_id, key
        ), key
    steps = [s for s, _ in history(client, run.info.run_id, "epoch/time")]
    assert steps == [7, 14]  # once each

    def own(params):  # the callbacks differ (a Checkpoint, the kill)
        return {k: v for k, v in params.items() if not k.startswith("callback.")}

    assert own(run.data.params) == own(ref_run.data.params)
    assert not any(k.startswith("fit2.") for k in run.data.params)  # one fit


def test_an_unreachable_server_fails_before_training():
    uri = f"http://127.0.0.1:{free_port()}"
    learn = learner([MLflowLogger(uri)])
    with pytest.raises(ValueError, match=f"no MLflow server answers at '{uri}'"):
        learn.fit(1, lr=0.1)
    assert learn.recorder.losses == []


# -- a local store -----------------------------------------------------------------
def test_a_local_sqlite_store_needs_no_server(tmp_path):
    uri = f"sqlite:///{tmp_path / 'runs.db'}"
    logger = MLflowLogger(uri, experiment="local")
    learn = learner([logger])
    learn.fit(1, lr=0.1)
    learn.fit(1, lr=0.05)  # the same logger: the same run goes on
    client = MlflowClient(uri)
    (run,) = runs_of(client, "local")
    assert run.info.status == "FINISHED"
    epochs = history(client, run.info.run_id, "epoch/epoch")
    assert epochs == [(7, 0), (14, 1)]  # steps and epochs count on across fits
    assert run.data.params["lr"] == "0.1" and run.data.params["fit2.lr"] == "0.05"


@pytest.mark.parametrize(
    ("error", "status"), [(RuntimeError, "FAILED"), (KeyboardInterrupt, "KILLED")]
)
def test_a_fit_that_fails_ends_its_run_failed_or_killed(tmp_path, error, status):
    class Fail(Callback):
        def on_batch_end(self, iteration):
            if iteration == 3:
                raise error("stop here")

    uri = f"sqlite:///{tmp_path / 'runs.db'}"
    with pytest.raises(error):
        learner([MLflowLogger(uri, experiment="e"), Fail()]).fit(1, lr=0.1)
    (run,) = runs_of(MlflowClient(uri), "e")
    assert run.info.status == status


def test_a_fit_that_fails_before_the_logger_starts_leaves_its_run_alone(tmp_path):
    class FailsFirst(Callback):
        order = -300  # before every built-in

        def on_train_begin(self):
            raise RuntimeError("before anything")

    uri = f"sqlite:///{tmp_path / 'runs.db'}"
    logger = MLflowLogger(uri, experiment="e")
    learn = learner([logger])
    learn.fit(1, lr=0.1)
    with pytest.raises(RuntimeError, match="before anything"):
        learn.fit(1, lr=0.1, callbacks=[FailsFirst()])
    learn.fit(1, lr=0.1)
    client = MlflowClient(uri)
    (run,) = runs_of(client, "e")
    assert run.info.status == "FINISHED"
    assert [s for s, _ in history(client, run.info.run_id, "epoch/epoch")] == [7, 14]


def test_a_deleted_experiment_is_refused_with_the_fix(tmp_path):
    uri = f"sqlite:///{tmp_path / 'runs.db'}"
    client = MlflowClient(uri)
    client.delete_experiment(client.create_experiment("gone"))
    with pytest.raises(ValueError, match=r"'gone'.*is deleted.*mlflow experiments"):
        learner([MLflowLogger(uri, experiment="gone")]).fit(1, lr=0.1)


def test_a_parameter_too_long_for_mlflow_is_shortened_with_a_note(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'runs.db'}"
    learner([MLflowLogger(uri, experiment="e", params={"notes": "x" * 7000})]).fit(
        1, lr=0.1
    )
    (run,) = runs_of(MlflowClient(uri), "e")
    assert len(run.data.params["notes"]) == 6000
    assert run.data.params["notes"].endswith("...")
    assert "['notes'] longer than MLflow's 6000 characters" in capsys.readouterr().err


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="experiment must be a non-empty str"):
        MLflowLogger("sqlite:///x.db", experiment="")
    with pytest.raises(TypeError, match="params must be a dict of str names"):
        MLflowLogger("sqlite:///x.db", params=[("a", 1)])
    with pytest.raises(ValueError, match="every_n_steps must be an int >= 1"):
        MLflowLogger("sqlite:///x.db", every_n_steps=0)
    with pytest.raises(ValueError, match=r"has no scheme.*'http://127.0.0.1:5000'"):
        MLflowLogger("127.0.0.1:5000")
