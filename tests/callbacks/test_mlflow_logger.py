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


@pytest.fixture(scope="module")
def local_store(tmp_path_factory):
    """A SQLite store, its tables made once (that takes seconds): each test
    uses an experiment of its own in it."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow-local') / 'runs.db'}"
    MlflowClient(uri).search_experiments()
    return uri


@pytest.fixture
def exp(request):
    """An experiment name of the test's own."""
    return request.node.name


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
def test_a_local_sqlite_store_needs_no_server(local_store, exp):
    uri = local_store
    logger = MLflowLogger(uri, experiment=exp)
    learn = learner([logger])
    learn.fit(1, lr=0.1)
    learn.fit(1, lr=0.05)  # the same logger: the same run goes on
    client = MlflowClient(uri)
    (run,) = runs_of(client, exp)
    assert run.info.status == "FINISHED"
    epochs = history(client, run.info.run_id, "epoch/epoch")
    assert epochs == [(7, 0), (14, 1)]  # steps and epochs count on across fits
    assert run.data.params["lr"] == "0.1" and run.data.params["fit2.lr"] == "0.05"


@pytest.mark.parametrize(
    ("error", "status"), [(RuntimeError, "FAILED"), (KeyboardInterrupt, "KILLED")]
)
def test_a_fit_that_fails_ends_its_run_failed_or_killed(
    local_store, exp, error, status
):
    class Fail(Callback):
        def on_batch_end(self, iteration):
            if iteration == 3:
                raise error("stop here")

    uri = local_store
    with pytest.raises(error):
        learner([MLflowLogger(uri, experiment=exp), Fail()]).fit(1, lr=0.1)
    (run,) = runs_of(MlflowClient(uri), exp)
    assert run.info.status == status


def test_a_fit_that_fails_before_the_logger_starts_leaves_its_run_alone(
    local_store, exp
):
    class FailsFirst(Callback):
        order = -300  # before every built-in

        def on_train_begin(self):
            raise RuntimeError("before anything")

    uri = local_store
    logger = MLflowLogger(uri, experiment=exp)
    learn = learner([logger])
    learn.fit(1, lr=0.1)
    with pytest.raises(RuntimeError, match="before anything"):
        learn.fit(1, lr=0.1, callbacks=[FailsFirst()])
    learn.fit(1, lr=0.1)
    client = MlflowClient(uri)
    (run,) = runs_of(client, exp)
    assert run.info.status == "FINISHED"
    assert [s for s, _ in history(client, run.info.run_id, "epoch/epoch")] == [7, 14]


def test_a_deleted_experiment_is_refused_with_the_fix(local_store):
    uri = local_store
    client = MlflowClient(uri)
    client.delete_experiment(client.create_experiment("gone"))
    with pytest.raises(ValueError, match=r"'gone'.*is deleted.*mlflow experiments"):
        learner([MLflowLogger(uri, experiment="gone")]).fit(1, lr=0.1)


def test_a_parameter_too_long_for_mlflow_is_shortened_with_a_note(
    local_store, exp, capsys
):
    uri = local_store
    learner([MLflowLogger(uri, experiment=exp, params={"notes": "x" * 7000})]).fit(
        1, lr=0.1
    )
    (run,) = runs_of(MlflowClient(uri), exp)
    assert len(run.data.params["notes"]) == 6000
    assert run.data.params["notes"].endswith("...")
    assert "['notes'] longer than MLflow's 6000 characters" in capsys.readouterr().err


# -- a run left RUNNING by a process killed before its first checkpoint -------------
class Dies(Callback):
    """Ends the process's fit at a batch; the test keeps MLflow from hearing of
    it, so the store holds what a SIGKILL leaves: a RUNNING run."""

    def on_batch_end(self, iteration):
        if iteration == 2:
            raise RuntimeError("killed")


def ended_pid():
    """The pid of a process that has ended (and was waited for)."""
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def killed_run(uri, exp, ckpt, monkeypatch):
    """The run of a fit in ``ckpt`` killed before its first checkpoint: left
    RUNNING, naming a process that has ended (as after a SIGKILL)."""
    with monkeypatch.context() as m, pytest.raises(RuntimeError, match="killed"):
        m.setattr(MlflowClient, "set_terminated", lambda *args, **kwargs: None)
        learner([MLflowLogger(uri, experiment=exp), Checkpoint(ckpt, every_n_steps=5),
                 Dies()]).fit(2, lr=0.1)  # fmt: skip
    client = MlflowClient(uri)
    (left,) = runs_of(client, exp)
    assert left.info.status == "RUNNING" and not list(ckpt.glob("checkpoint-*"))
    assert left.data.tags["fitlib.host"] == socket.gethostname()
    assert left.data.tags["fitlib.pid"] == str(os.getpid())
    client.set_tag(left.info.run_id, "fitlib.pid", str(ended_pid()))
    return client.get_run(left.info.run_id)


def test_a_rerun_closes_the_run_a_kill_before_the_first_checkpoint_left(
    tmp_path, local_store, exp, monkeypatch, capsys
):
    uri, ckpt = local_store, tmp_path / "ckpt"
    left = killed_run(uri, exp, ckpt, monkeypatch)
    key = left.data.tags["fitlib.checkpoint_dir_id"]
    assert key == (ckpt / ".fitlib.run_id").read_text().strip() and len(key) == 32
    client = MlflowClient(uri)
    other = client.create_run(  # another machine, the same path: its own directory
        left.info.experiment_id,
        tags={"fitlib.checkpoint_dir": str(ckpt.resolve()), "fitlib.pid": "1",
              "fitlib.checkpoint_dir_id": "0" * 32,
              "fitlib.host": socket.gethostname()},
    )  # fmt: skip
    rerun = MLflowLogger(uri, experiment=exp)
    learner([rerun, Checkpoint(ckpt, every_n_steps=5)]).fit(2, lr=0.1)
    runs = {r.info.run_id: r for r in runs_of(client, exp)}
    assert len(runs) == 3 and rerun.run_id not in (left.info.run_id, other.info.run_id)
    old, new = runs[left.info.run_id], runs[rerun.run_id]
    assert old.info.status == "KILLED" and new.info.status == "FINISHED"
    assert runs[other.info.run_id].info.status == "RUNNING"  # not ours: left alone
    assert old.data.tags["fitlib.restarted_as"] == rerun.run_id
    assert new.data.tags["fitlib.restarts"] == left.info.run_id
    assert new.data.tags["fitlib.checkpoint_dir_id"] == key  # the same directory
    assert new.data.tags["fitlib.checkpoint_dir"] == str(ckpt.resolve())
    assert [s for s, _ in history(client, rerun.run_id, "epoch/epoch")] == [7, 14]
    err = capsys.readouterr().err
    assert f"run {left.info.run_id} of {str(ckpt.resolve())!r}" in err
    assert "marked KILLED" in err and other.info.run_id not in err


@pytest.mark.parametrize(
    "where",
    ["another host", "a live process here", "a process this one cannot signal"],
)
def test_a_rerun_leaves_a_run_whose_process_may_be_alive_running_with_a_warning(
    tmp_path, local_store, exp, monkeypatch, capsys, where
):
    """The directory's lock does not reach another machine (a shared folder
    on NFS), nor anything on Windows: a run that no dead pid here proves
    ended is live for all the rerun knows."""
    uri, ckpt = local_store, tmp_path / "ckpt"
    left = killed_run(uri, exp, ckpt, monkeypatch)
    client = MlflowClient(uri)
    if where == "another host":
        client.set_tag(left.info.run_id, "fitlib.host", "node-2")
    elif where == "a live process here":
        client.set_tag(left.info.run_id, "fitlib.pid", str(os.getppid()))
    else:
        real_kill = os.kill

        def kill(pid, sig):
            if sig == 0:
                raise PermissionError(1, "Operation not permitted")
            return real_kill(pid, sig)

        monkeypatch.setattr(os, "kill", kill)
    capsys.readouterr()
    rerun = MLflowLogger(uri, experiment=exp)
    learner([rerun, Checkpoint(ckpt, every_n_steps=5)]).fit(2, lr=0.1)
    runs = {r.info.run_id: r for r in runs_of(client, exp)}
    old = runs[left.info.run_id]
    assert old.info.status == "RUNNING" and "fitlib.restarted_as" not in old.data.tags
    assert "fitlib.restarts" not in runs[rerun.run_id].data.tags
    err = capsys.readouterr().err
    assert err.count(left.info.run_id) == 1 and "marked KILLED" not in err
    assert "may be alive: left RUNNING" in err
    assert "set_terminated" in err  # the fix, if the user knows it is dead


def test_a_rerun_in_a_new_directory_at_the_same_path_leaves_the_old_run_alone(
    tmp_path, local_store, exp, monkeypatch, capsys
):
    uri, ckpt = local_store, tmp_path / "ckpt"
    left = killed_run(uri, exp, ckpt, monkeypatch)
    ckpt.rename(tmp_path / "ckpt-aside")  # moved aside; a new one made in its place
    capsys.readouterr()
    rerun = MLflowLogger(uri, experiment=exp)
    learner([rerun, Checkpoint(ckpt, every_n_steps=5)]).fit(2, lr=0.1)
    client = MlflowClient(uri)
    old, new = client.get_run(left.info.run_id), client.get_run(rerun.run_id)
    assert old.info.status == "RUNNING" and new.info.status == "FINISHED"
    assert (
        new.data.tags["fitlib.checkpoint_dir"] == old.data.tags["fitlib.checkpoint_dir"]
    )
    key = new.data.tags["fitlib.checkpoint_dir_id"]
    assert key != old.data.tags["fitlib.checkpoint_dir_id"]
    assert key == (ckpt / ".fitlib.run_id").read_text().strip()
    assert left.info.run_id not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("make", "words"),
    [(lambda p: p.mkdir(), "is a directory"),
     (lambda p: p.write_text("notes\n"), "holds 'notes\\\\n'")],
)  # fmt: skip
def test_a_damaged_directory_id_file_is_refused_before_training(
    tmp_path, local_store, exp, make, words
):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    make(ckpt / ".fitlib.run_id")
    learn = learner([MLflowLogger(local_store, experiment=exp), Checkpoint(ckpt)])
    before = [p.detach().clone() for p in learn.model.parameters()]
    with pytest.raises(ValueError, match=words) as info:
        learn.fit(1, lr=0.1)
    assert ".fitlib.run_id" in str(info.value) and "Fix: delete it" in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(before, learn.model.parameters()))


# -- stores that cannot be opened ----------------------------------------------------
@pytest.mark.parametrize(
    ("store", "words"),
    [
        ("sqlite:///{tmp}/notes.txt", "is not an SQLite database"),
        ("sqlite:///{tmp}/folder", "is a folder, not a database file"),
        ("sqlite:///{tmp}/notes.txt/runs.db", "is a file, not a folder"),
        ("ftp://127.0.0.1/mlruns", "MLflow cannot open it"),
        ("{tmp}/notes.txt", "is a file, not a folder"),
    ],
)
def test_a_store_that_cannot_be_opened_is_refused_before_training(
    tmp_path, store, words
):
    (tmp_path / "notes.txt").write_text("my notes, not a database\n")
    (tmp_path / "folder").mkdir()
    uri = store.format(tmp=tmp_path)
    learn = learner([MLflowLogger(uri)])
    with pytest.raises(ValueError, match=words) as info:
        learn.fit(1, lr=0.1)
    message = str(info.value)
    assert message.startswith("MLflowLogger: ") and "Fix: " in message
    assert repr(uri) in message or repr(Path(uri).as_uri()) in message
    assert learn.recorder.losses == []  # before any batch
    assert (tmp_path / "notes.txt").read_text() == "my notes, not a database\n"


# -- bad arguments -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"tracking_uri": ""}, ValueError, "tracking_uri must be .*not empty"),
        ({"tracking_uri": "  "}, ValueError, "tracking_uri must be .*not empty"),
        ({"tracking_uri": 3}, TypeError, "tracking_uri must be"),
        ({"tracking_uri": "127.0.0.1:5000"}, ValueError,
         r"has no scheme.*'http://127.0.0.1:5000'"),
        ({"experiment": ""}, ValueError, "experiment must be a name, not empty"),
        ({"experiment": 3}, TypeError, "experiment must be a str"),
        ({"run_name": ""}, ValueError, "run_name must be a name, not empty"),
        ({"run_name": 3}, TypeError, "run_name must be a str or None"),
        ({"params": [("a", 1)]}, TypeError, "params must be a dict of str names"),
        ({"params": {"": 1}}, ValueError, r"params: the name '' .*Fix"),
        ({"params": {"a\nb": 1}}, ValueError, r"params: the name 'a\\nb' .*Fix"),
        ({"params": {"../x": 1}}, ValueError, r"params: the name '\.\./x'"),
        ({"tags": {"x": 1, "a*": "b"}}, ValueError, r"tags: the name 'a\*'"),
        ({"tags": {"fitlib.version": "0"}}, ValueError,
         r"tags \['fitlib.version'\] are tags fitlib sets"),
        ({"tags": {"x": "y" * 9000}}, ValueError, "tags: the value of 'x' is 9000"),
        ({"every_n_steps": 0}, ValueError, "every_n_steps must be an int >= 1"),
        ({"every_n_steps": 2.0}, TypeError, "every_n_steps must be an int >= 1"),
        ({"log_checkpoints": "yes"}, TypeError, "log_checkpoints must be True or"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused_with_the_fix(kwargs, error, words):
    kwargs = {"tracking_uri": "sqlite:///x.db", **kwargs}
    with pytest.raises(error, match=words) as info:
        MLflowLogger(**kwargs)
    assert str(info.value).startswith("MLflowLogger: ") and "Fix: " in str(info.value)


def test_params_named_as_what_fitlib_logs_are_refused_before_training(tmp_path):
    uri = f"sqlite:///{tmp_path / 'runs.db'}"
    learn = learner([MLflowLogger(uri, params={"lr": 0.5, "dropout": 0.3})])
    with pytest.raises(ValueError, match=r"params \['lr'\] are parameters fitlib"):
        learn.fit(1, lr=0.1)
    assert learn.recorder.losses == [] and not (tmp_path / "runs.db").exists()


def test_log_checkpoints_without_a_checkpoint_is_refused_before_training(tmp_path):
    uri = f"sqlite:///{tmp_path / 'runs.db'}"
    learn = learner([MLflowLogger(uri, log_checkpoints=True)])
    with pytest.raises(ValueError, match=r"log_checkpoints=True.*no Checkpoint"):
        learn.fit(1, lr=0.1)
    assert learn.recorder.losses == [] and not (tmp_path / "runs.db").exists()
