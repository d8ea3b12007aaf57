import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import Crash, child_env, kill_until_done, make_dataset
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

from fitlib import Callback, DataBunch, Learner
from fitlib.callbacks import (
    Checkpoint,
    GradientAccumulation,
    MixedPrecision,
    ProgressBar,
)
from fitlib.metrics import accuracy
from fitlib.serialization import atomic_save, safe_load

HERE = Path(__file__).parent


def learner(callbacks=(), model=None, workers=0, seed=0, **kwargs):
    torch.manual_seed(seed)
    model = model or nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3)
    )
    data = DataBunch(
        DataLoader(make_dataset(100), 16, shuffle=True, num_workers=workers),
        DataLoader(make_dataset(37, seed=1), 16),
        device="cpu",
    )
    return Learner(
        data,
        model,
        F.cross_entropy,
        metrics=[accuracy],
        progress=False,
        callbacks=list(callbacks),
        **{"opt_func": torch.optim.SGD, **kwargs},
    )


def same_run(a, b):
    weights = all(map(torch.equal, a.model.state_dict().values(),
                      b.model.state_dict().values()))  # fmt: skip
    ra, rb = a.recorder, b.recorder
    history = (ra.losses, ra.lrs, ra.valid_losses) == (
        rb.losses,
        rb.lrs,
        rb.valid_losses,
    )
    return weights and history


def train_with_crashes(tmp_path, crashes, make=learner, train=None, **ckpt):
    train = train or (lambda learn: learn.fit_one_cycle(4, 0.1))
    for at in [*crashes, None]:
        extra = [Crash(at)] if at is not None else []
        learn = make([Checkpoint(tmp_path, **ckpt), *extra])
        try:
            train(learn)
        except RuntimeError:
            assert at is not None
    return learn


# -- exact resume ------------------------------------------------------------------
@pytest.mark.parametrize("crashes", [[5], [13, 22], [2, 3, 9, 26]])
def test_a_resumed_run_ends_bit_identical_to_an_uninterrupted_one(tmp_path, crashes):
    ref = learner()
    ref.fit_one_cycle(4, 0.1)
    resumed = train_with_crashes(tmp_path, crashes, every_n_steps=3)
    assert same_run(ref, resumed)
    assert len(resumed.recorder.losses) == 28 and resumed.recorder.epochs == [
        0,
        1,
        2,
        3,
    ]


def test_resume_at_epoch_boundaries_is_exact_too(tmp_path):
    ref = learner()
    ref.fit_one_cycle(4, 0.1)
    assert same_run(ref, train_with_crashes(tmp_path, [10, 20], every_n_epochs=1))


def test_resume_is_exact_with_workers_and_gradient_accumulation(tmp_path):
    def make(cbs):
        return learner([*cbs, GradientAccumulation(2)], workers=2)

    ref = make([])
    ref.fit(3, lr=0.05)
    resumed = train_with_crashes(
        tmp_path, [4, 11], make, lambda learn: learn.fit(3, lr=0.05), every_n_steps=2
    )
    assert same_run(ref, resumed)


@pytest.mark.filterwarnings("ignore:MixedPrecision.float16. on the CPU")
def test_resume_restores_the_loss_scale(tmp_path):
    def make(cbs):
        mp = MixedPrecision(torch.float16, init_scale=4.0, growth_interval=3)
        return learner([*cbs, mp])  # the scale doubles every 3 steps

    ref = make([])
    ref.fit(2, lr=0.05)
    resumed = train_with_crashes(
        tmp_path, [9], make, lambda learn: learn.fit(2, lr=0.05), every_n_steps=4
    )
    assert same_run(ref, resumed)
    scale = ref.callbacks[-1].scaler.get_scale()
    assert scale > 4.0 and resumed.callbacks[-1].scaler.get_scale() == scale


def test_killed_at_random_moments_with_sigkill_the_run_still_ends_identical(tmp_path):
    """Processes killed mid-epoch and mid-write, then rerun, as a user would:
    a run with two optimizers (Adam and SGD parts, a MultiOptimizer, 1cycle
    by part), which goes through every path of a run with one (the in-process
    crash tests above cover one optimizer)."""
    parts = ["parts"]
    env = child_env()
    child = [sys.executable, str(HERE / "resume_child.py")]
    subprocess.run([*child, str(tmp_path / "ref"), str(tmp_path / "ref.pth"), *parts],
                   env=env, check=True, capture_output=True)  # fmt: skip
    cmd = [*child, str(tmp_path / "ckpt"), str(tmp_path / "run.pth"), *parts]
    kills = kill_until_done(cmd, env, seed=1234)
    assert kills >= 2, "the run was too fast to kill: slow resume_child.py down"
    ref, run = safe_load(tmp_path / "ref.pth"), safe_load(tmp_path / "run.pth")
    assert run["losses"] == ref["losses"] and run["lrs"] == ref["lrs"]
    assert run["valid_losses"] == ref["valid_losses"]
    assert all(torch.equal(run["weights"][k], v) for k, v in ref["weights"].items())


# -- files -------------------------------------------------------------------------
def test_keeps_the_newest_n_counting_files_of_earlier_runs(tmp_path, capsys):
    learner([Checkpoint(tmp_path, keep_last=2)]).fit(4, lr=0.05)  # saves 0-3
    assert [p.name for p in Checkpoint(tmp_path).checkpoints()] == [
        "checkpoint-000002.pth",
        "checkpoint-000003.pth",
    ]
    second = learner([Checkpoint(tmp_path, keep_last=2, resume=False)])
    second.fit(2, lr=0.05)  # a new run in the same directory: saves 4, 5
    assert [p.name for p in Checkpoint(tmp_path).checkpoints()] == [
        "checkpoint-000004.pth",
        "checkpoint-000005.pth",
    ]
    learner([Checkpoint(tmp_path)]).fit(2, lr=0.05)  # resumes the newest run
    assert "already finished (epoch 2" in capsys.readouterr().out


def test_a_finished_run_says_so_and_trains_nothing(tmp_path, capsys):
    learn = learner([Checkpoint(tmp_path)])
    learn.fit(2, lr=0.05)
    again = learner([Checkpoint(tmp_path)])
    again.fit(2, lr=0.05)
    assert "already finished (epoch 2" in capsys.readouterr().out
    assert same_run(learn, again)


def test_a_finished_run_prints_no_empty_table(tmp_path):
    learner([Checkpoint(tmp_path)]).fit(2, lr=0.05)
    bar = ProgressBar()
    learner([Checkpoint(tmp_path), bar]).fit(2, lr=0.05)
    assert bar.rows == []  # no header over no rows


def test_the_best_checkpoint_is_kept_apart(tmp_path):
    learn = learner([Checkpoint(tmp_path, monitor="valid_loss", keep_last=1)])
    learn.fit(4, lr=0.05)
    best = safe_load(tmp_path / "best.pth")
    epoch = min(range(4), key=lambda e: learn.recorder.valid_losses[e])
    assert best["position"]["epoch"] == epoch + 1
    assert best["monitor"]["best"] == pytest.approx(learn.recorder.valid_losses[epoch])
    assert len(list(tmp_path.glob("checkpoint-*.pth"))) == 1


def test_a_half_written_file_of_a_killed_run_is_removed_and_ignored(tmp_path):
    learn = learner([Checkpoint(tmp_path, every_n_epochs=1)])
    learn.fit(1, lr=0.05)
    tmp = tmp_path / ".checkpoint-000000099.pth.abc.tmp"
    tmp.write_bytes(b"half")
    learner([Checkpoint(tmp_path)]).fit(1, lr=0.05)
    assert not tmp.exists()


def test_a_failed_save_keeps_what_was_on_disk(tmp_path, monkeypatch):
    learner([Checkpoint(tmp_path)]).fit(1, lr=0.05)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space"):
        learner([Checkpoint(tmp_path, resume=False)]).fit(2, lr=0.05)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


# -- bad input ---------------------------------------------------------------------
def test_a_checkpoint_of_a_different_model_lists_the_keys(tmp_path):
    learner([Checkpoint(tmp_path)]).fit(1, lr=0.05)
    other = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    with pytest.raises(ValueError, match=r"different model.*0\.weight: saved"):
        learner([Checkpoint(tmp_path)], model=other).fit(2, lr=0.05)


def test_a_truncated_checkpoint_is_a_clear_error(tmp_path):
    learner([Checkpoint(tmp_path)]).fit(1, lr=0.05)
    path = Checkpoint(tmp_path).checkpoints()[-1]
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match="truncated, corrupt"):
        learner([Checkpoint(tmp_path)]).fit(2, lr=0.05)


def test_a_directory_that_cannot_be_written_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="cannot write in"):
        Checkpoint(blocker / "ckpt")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_epochs": None}, "exactly one of every_n_epochs and every_n_steps"),
        ({"every_n_epochs": 1, "every_n_steps": 5}, "got both"),
        ({"every_n_epochs": 0}, "every_n_epochs must be an int >= 1"),
        ({"every_n_steps": -2}, "every_n_steps must be an int >= 1"),
        ({"keep_last": 0}, "keep_last must be an int >= 1"),
    ],
)
def test_bad_arguments_are_errors(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Checkpoint(tmp_path, **kwargs)


def test_a_monitor_that_never_appears_lists_the_names(tmp_path):
    learn = learner([Checkpoint(tmp_path, monitor="f1")])
    with pytest.raises(ValueError, match="valid_loss"):
        learn.fit(1, lr=0.05)
    assert learn.recorder.losses == []


# -- found by review ---------------------------------------------------------------
class Noisy(torch.utils.data.Dataset):
    """Augmentation in the main process: each item draws fresh noise."""

    def __init__(self):
        self.base = make_dataset(100)

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x + 0.1 * torch.randn(8), y


def test_resume_is_exact_with_augmentation_in_the_main_process(tmp_path):
    def make(cbs):
        learn = learner(cbs)
        learn.data.train_dl = DataLoader(Noisy(), 16, shuffle=True)
        return learn

    ref = make([])
    ref.fit(3, lr=0.05)
    resumed = train_with_crashes(
        tmp_path, [4, 12], make, lambda learn: learn.fit(3, lr=0.05), every_n_steps=3
    )
    assert same_run(ref, resumed)


def test_two_fits_with_one_checkpoint_object_both_train(tmp_path):
    ckpt = Checkpoint(tmp_path)
    learn = learner([ckpt])
    learn.fit(2, lr=0.05)
    learn.fit(3, lr=0.05)
    assert learn.recorder.epochs == [0, 1, 2, 3, 4]


def test_a_closed_fit_snapshots_leaves_a_checkpoint_to_resume_from(tmp_path):
    learn = learner([Checkpoint(tmp_path)])
    for snap in learn.fit_snapshots(n_steps=20, every=5):
        if snap.step == 10:
            break
    again = learner([Checkpoint(tmp_path)])
    steps = [snap.step for snap in again.fit_snapshots(n_steps=20, every=5)]
    assert steps == [15, 20]
    ref = learner()
    list(ref.fit_snapshots(n_steps=20, every=5))
    assert same_run(ref, again)


def test_rerunning_a_finished_run_leaves_its_logs_alone(tmp_path):
    from fitlib.callbacks import CSVLogger

    def run():
        csv = CSVLogger(tmp_path / "log.csv", append=False)
        learner([Checkpoint(tmp_path / "ckpt"), csv]).fit(3, lr=0.05)
        return (tmp_path / "log.csv").read_text()

    first = run()
    assert len(first.splitlines()) == 4 and run() == first


def test_resume_is_exact_with_a_plateau_on_the_train_loss(tmp_path):
    from fitlib.callbacks import ReduceLROnPlateau

    def make(cbs):
        return learner([*cbs, ReduceLROnPlateau("train_loss", min_delta=0.05)])

    ref = make([])
    ref.fit(4, lr=0.1)
    resumed = train_with_crashes(
        tmp_path, [10], make, lambda learn: learn.fit(4, lr=0.1), every_n_steps=3
    )
    assert same_run(ref, resumed)
    assert resumed.callbacks[-1].reductions == ref.callbacks[-1].reductions


def test_the_best_checkpoint_is_judged_by_validation(tmp_path):
    with pytest.raises(ValueError, match="monitor='valid_loss' or a metric"):
        Checkpoint(tmp_path, monitor="train_loss")


def test_a_checkpoint_of_another_optimizer_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError):
        learner([Checkpoint(tmp_path, every_n_steps=2), Crash(3)]).fit(2, lr=0.05)
    adam = learner([Checkpoint(tmp_path)], opt_func=torch.optim.Adam)
    with pytest.raises(
        ValueError, match="optimizer: the checkpoint's run SGD, this run Adam"
    ):
        adam.fit(2, lr=0.05)


def test_atomic_save_fsyncs_the_file_and_the_directory(tmp_path, monkeypatch):
    from fitlib.serialization import atomic_save

    synced = []
    real = os.fsync

    def spy(fd):
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    path = atomic_save({"w": torch.ones(1)}, tmp_path / "a.pth")
    assert len(synced) == 2
    assert synced[0].endswith(".tmp") and synced[1] == str(tmp_path)
    assert path.exists()


# -- one run per directory ---------------------------------------------------------
HOLDER = """
import sys, time
import torch
from helpers import make_data, make_model
from torch.nn import functional as F
from fitlib import Callback, Learner
from fitlib.callbacks import Checkpoint

class Hold(Callback):
    def on_train_begin(self):
        print("locked", flush=True)
        time.sleep(120)

learn = Learner(make_data(), make_model(), F.cross_entropy, opt_func=torch.optim.SGD,
                wd=0, metrics=[], progress=False)
learn.fit(1, lr=0.01, callbacks=[Checkpoint(sys.argv[1]), Hold()])
"""


def test_a_live_runs_directory_is_refused_and_a_killed_runs_lock_is_taken(tmp_path):
    env = child_env()
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == b"locked", proc.stderr.read()
        with pytest.raises(ValueError, match="in use by another run") as info:
            learner([Checkpoint(tmp_path)]).fit(1, lr=0.05)
        assert f"pid {proc.pid} on host" in str(info.value)
        assert str(tmp_path) in str(info.value)  # its command line
    finally:
        proc.send_signal(signal.SIGKILL)  # it dies holding the lock
        proc.wait(timeout=30)
    learn = learner([Checkpoint(tmp_path)])
    learn.fit(1, lr=0.05)  # the dead run's lock is free
    assert len(learn.recorder.losses) == 7


def test_a_second_run_in_the_same_process_is_refused_and_deletes_nothing(tmp_path):
    half = tmp_path / ".checkpoint-000001.pth.0123456789ab.tmp"  # a save under way
    errors = []

    class SecondRun(Callback):
        def on_epoch_begin(self, epoch):
            if epoch == 1:
                half.write_bytes(b"being written")
                try:
                    learner([Checkpoint(tmp_path)]).fit(2, lr=0.05)
                except ValueError as e:
                    errors.append(str(e))

    learner([Checkpoint(tmp_path), SecondRun()]).fit(2, lr=0.05)
    assert len(errors) == 1 and f"pid {os.getpid()}" in errors[0]
    assert "another dirpath" in errors[0]
    assert half.exists()
    learner([Checkpoint(tmp_path, resume=False)]).fit(1, lr=0.05)  # free again


# -- a checkpoint of another run ---------------------------------------------------
def test_resuming_another_runs_checkpoint_lists_every_difference(tmp_path):
    with pytest.raises(RuntimeError):
        learner([Checkpoint(tmp_path, every_n_steps=2), Crash(5)]).fit(2, lr=0.05)
    other = learner([Checkpoint(tmp_path)])
    before = [p.detach().clone() for p in other.model.parameters()]
    with pytest.raises(ValueError, match="another run") as info:
        other.fit(3, lr=0.1)
    message = str(info.value)
    assert "lr: the checkpoint's run 0.05, this run 0.1" in message
    assert "epochs: the checkpoint's run 2, this run 3" in message
    assert "resume=False" in message and "another dirpath" in message
    assert all(map(torch.equal, before, other.model.parameters()))  # nothing loaded
    fresh = learner([Checkpoint(tmp_path, resume=False)])
    fresh.fit(3, lr=0.1)  # the explicit way to start afresh
    assert len(fresh.recorder.losses) == 21


def test_rerunning_an_interrupted_one_cycle_fit_in_the_same_process_resumes(tmp_path):
    # The interrupted fit left momentum where its schedule was: the rerun's
    # fit begins there, which must not count as another run.
    learn = learner(opt_func=lambda p, lr: torch.optim.SGD(p, lr, momentum=0.9))
    crash = Crash(5)
    with pytest.raises(RuntimeError):
        learn.fit_one_cycle(
            2, 0.05, callbacks=[Checkpoint(tmp_path, every_n_steps=2), crash]
        )
    assert learn.opt.mom != 0.9  # mid-schedule
    crash.at = -1
    learn.fit_one_cycle(
        2, 0.05, callbacks=[Checkpoint(tmp_path, every_n_steps=2), crash]
    )
    assert len(learn.recorder.losses) == 14
    other = learner([Checkpoint(tmp_path)])
    with pytest.raises(
        ValueError, match=r"schedule of lr, mom: .*max_lr=0\.05.*max_lr=0\.1"
    ):
        other.fit_one_cycle(2, 0.1)


def test_a_checkpoint_of_the_previous_format_resumes_with_a_note(tmp_path, capsys):
    with pytest.raises(RuntimeError):
        learner([Checkpoint(tmp_path, every_n_steps=2), Crash(5)]).fit(2, lr=0.05)
    path = Checkpoint(tmp_path).checkpoints()[-1]
    saved = {k: v for k, v in safe_load(path).items() if k != "run"}
    atomic_save({**saved, "fitlib_checkpoint": 1, "opt_class": "SGD"}, path)  # as 1
    resumed = learner([Checkpoint(tmp_path)])
    resumed.fit(2, lr=0.05)
    out = capsys.readouterr().out
    assert "format 1" in out and "resuming from" in out
    assert len(resumed.recorder.losses) == 14  # restored history, then the rest


# -- best.pth of an earlier run ----------------------------------------------------
def test_a_fresh_run_replaces_best_pth_only_with_a_better_value(tmp_path, capsys):
    learner([Checkpoint(tmp_path, monitor="valid_loss")]).fit(3, lr=0.05)
    best = (tmp_path / "best.pth").read_bytes()
    kept = safe_load(tmp_path / "best.pth")["monitor"]["best"]
    worse = learner([Checkpoint(tmp_path, monitor="valid_loss", resume=False)], seed=1)
    worse.fit(1, lr=1e-5)
    assert worse.recorder.valid_losses[0] > kept  # the premise: a worse run
    assert (tmp_path / "best.pth").read_bytes() == best
    assert "holds the best valid_loss (min) so far" in capsys.readouterr().out


def test_a_best_pth_of_another_monitor_is_replaced_keeping_its_mode(tmp_path, capsys):
    learner([Checkpoint(tmp_path, monitor="valid_loss")]).fit(1, lr=0.05)
    (tmp_path / "best.pth").chmod(0o640)
    learner([Checkpoint(tmp_path, monitor="accuracy", resume=False)]).fit(1, lr=0.05)
    out = capsys.readouterr().out
    assert "kept the best valid_loss (min); this run watches accuracy (max)" in out
    assert safe_load(tmp_path / "best.pth")["monitor"]["monitor"] == "accuracy"
    assert stat.S_IMODE((tmp_path / "best.pth").stat().st_mode) == 0o640  # as open()


# -- file modes --------------------------------------------------------------------
@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600)])
def test_files_get_the_mode_open_gives_under_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        learner([Checkpoint(tmp_path, monitor="valid_loss")]).fit(1, lr=0.05)
    finally:
        os.umask(old)
    files = [*Checkpoint(tmp_path).checkpoints(), tmp_path / "best.pth"]
    assert [stat.S_IMODE(p.stat().st_mode) for p in files] == [mode] * 2


@pytest.mark.parametrize("dirpath", [None, 3])  # "": tests/test_checks.py
def test_a_dirpath_that_is_not_a_path_is_a_type_error(dirpath):
    with pytest.raises(TypeError, match="dirpath must be a directory path") as info:
        Checkpoint(dirpath)
    assert f"got {dirpath!r}" in str(info.value)
