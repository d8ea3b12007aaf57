import csv
import os

import pytest
import torch
from helpers import make_data, scripted_record, train

from fitlib import Callback
from fitlib.callback import call_hook
from fitlib.callbacks.csv_logger import CSVLogger
from fitlib.callbacks.one_cycle import OneCycleScheduler
from fitlib.callbacks.recorder import Recorder
from fitlib.metrics import Metrics, accuracy
from fitlib.record import step_lr

HEADER = ["epoch", "train_loss", "valid_loss", "accuracy", "lr", "time"]


class FakeOpt:
    """The param_groups (and the stepped lr) that the logger reads."""

    def __init__(self, *lrs, stepped=None):
        self.param_groups = [{"lr": lr} for lr in lrs]
        self.stepped = stepped


def read(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def epochs_of(path):
    return [int(r[0]) for r in read(path)[1:]]


def begin(cb, iteration=0, epoch=0, metrics=(accuracy,)):
    call_hook(
        cb,
        "on_train_begin",
        iteration=iteration,
        epoch=epoch,
        metrics=Metrics(list(metrics)),
    )


def drive_epoch(
    cb, epoch, losses=(1.0,), sizes=(2,), metrics=(0.5, 0.75), opt=None, names=None
):
    """The hooks of one epoch as the handler calls them (metrics None: skipped)."""
    call_hook(cb, "on_epoch_begin", epoch=epoch)
    for loss, bs in zip(losses, sizes, strict=True):
        call_hook(
            cb,
            "on_batch_end",
            train=True,
            last_loss=torch.tensor(loss),
            last_target=torch.zeros(bs),
        )
    call_hook(cb, "on_batch_end", train=False, last_loss=torch.tensor(99.0))
    last = None if metrics is None else [torch.tensor(m) for m in metrics]
    names = ["accuracy"] if names is None else names
    lr = step_lr(opt or FakeOpt(0.1))
    record = scripted_record(losses, sizes, last, names, epoch, lr)
    call_hook(cb, "on_epoch_end", epoch=epoch, last_metrics=last, record=record)


class FakeResume(Callback):
    """Moves the fit to (epoch, iteration) as a restoring Checkpoint would."""

    order = -100

    def __init__(self, epoch, iteration):
        self.epoch, self.iteration = epoch, iteration

    def on_train_begin(self):
        return {"epoch": self.epoch, "iteration": self.iteration}


# -- scripted hooks --------------------------------------------------------------
def test_writes_the_header_once_and_a_row_per_epoch(tmp_path):
    path = tmp_path / "log.csv"
    cb = CSVLogger(path)
    begin(cb)
    drive_epoch(cb, 0, [1.0, 2.0, 6.0], [4, 4, 2], metrics=(0.5, 0.75))
    drive_epoch(cb, 1, [3.0], [5], metrics=(0.25, 1.0))
    rows = read(path)
    assert rows[0] == HEADER
    assert len(rows) == 3
    # (4*1 + 4*2 + 2*6) / 10 = 2.4: weighted by samples, not the batch mean 3.0.
    assert rows[1][:5] == ["0", "2.4", "0.5", "0.75", "0.1"]
    assert rows[2][:5] == ["1", "3.0", "0.25", "1.0", "0.1"]
    assert float(rows[1][5]) >= 0


def test_lr_is_the_last_groups_as_the_last_step_used_it(tmp_path):
    path = tmp_path / "log.csv"
    cb = CSVLogger(path)
    begin(cb)
    # A scheduler already set 0.02 for the next step; the epoch's step used 0.05.
    drive_epoch(cb, 0, opt=FakeOpt(0.001, 0.02, stepped=(0.05, 0.9)))
    drive_epoch(cb, 1, opt=FakeOpt(0.001, 0.02))  # no step yet: the current lr
    assert [r[4] for r in read(path)[1:]] == ["0.05", "0.02"]


def test_a_skipped_validation_leaves_its_cells_empty(tmp_path):
    path = tmp_path / "log.csv"
    cb = CSVLogger(path)
    begin(cb)
    drive_epoch(cb, 0, [2.0], [3], metrics=None)
    row = read(path)[1]
    assert row[:5] == ["0", "2.0", "", "", "0.1"]
    assert row[5] != ""


def test_each_row_is_flushed_and_fsynced(tmp_path, monkeypatch):
    path = tmp_path / "log.csv"
    cb = CSVLogger(path)
    begin(cb)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    drive_epoch(cb, 0)
    assert len(synced) == 1
    assert len(read(path)) == 2  # already on disk, before the fit ends
    drive_epoch(cb, 1)
    assert len(synced) == 2


def test_append_keeps_the_rows_of_earlier_fits(tmp_path):
    path = tmp_path / "log.csv"
    cb = CSVLogger(path)
    for _ in range(2):
        begin(cb)
        drive_epoch(cb, 0)
        drive_epoch(cb, 1)
    rows = read(path)
    assert rows.count(HEADER) == 1
    assert epochs_of(path) == [0, 1, 0, 1]


def test_append_false_starts_a_new_file_at_each_fit(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("old,file\n1,2\n")
    cb = CSVLogger(path, append=False)
    for _ in range(2):
        begin(cb)
        drive_epoch(cb, 0)
    assert read(path)[0] == HEADER
    assert epochs_of(path) == [0]


def test_a_resumed_fit_removes_the_rows_from_the_resumed_epoch_on(tmp_path):
    path = tmp_path / "log.csv"
    cb = CSVLogger(path)
    begin(cb)
    for epoch in range(4):
        drive_epoch(cb, epoch, [float(epoch)], [2])
    begin(cb, iteration=14, epoch=2)  # the checkpoint was at epoch 2
    assert epochs_of(path) == [0, 1]
    for epoch in (2, 3):
        drive_epoch(cb, epoch, [10.0 + epoch], [2])
    rows = read(path)
    assert epochs_of(path) == [0, 1, 2, 3]
    assert [r[1] for r in rows[1:]] == ["0.0", "1.0", "12.0", "13.0"]
    assert sorted(os.listdir(tmp_path)) == ["log.csv"]  # no temporary file left


def test_a_restored_resume_keeps_the_rows_of_earlier_fits(tmp_path):
    path = tmp_path / "log.csv"
    first = CSVLogger(path)
    begin(first)
    drive_epoch(first, 0)
    drive_epoch(first, 1)
    second = CSVLogger(path)  # a second fit appends to the same file
    begin(second)
    drive_epoch(second, 0)
    saved = second.state_dict()  # the checkpoint, between epochs 0 and 1
    drive_epoch(second, 1)
    drive_epoch(second, 2)  # then the process dies
    resumed = CSVLogger(path)
    resumed.load_state_dict(saved)
    begin(resumed, iteration=7, epoch=1)
    # The earlier fit's epoch 1 stays: only this fit's rows >= 1 go.
    assert epochs_of(path) == [0, 1, 0]


def test_a_torn_last_row_from_a_crash_is_removed(tmp_path):
    path = tmp_path / "log.csv"
    cb = CSVLogger(path)
    begin(cb)
    drive_epoch(cb, 0)
    with open(path, "a") as f:
        f.write("1,0.52,0.4")  # the process died in the middle of a row
    begin(cb)
    drive_epoch(cb, 0)
    assert epochs_of(path) == [0, 0]
    assert all(len(r) == len(HEADER) for r in read(path))


def test_state_dict_holds_plain_values_and_round_trips(tmp_path):
    cb = CSVLogger(tmp_path / "log.csv")
    begin(cb)
    drive_epoch(cb, 0)
    state = cb.state_dict()
    assert state == {"first_row": 0}  # the epoch's sums are the loop's
    other = CSVLogger(tmp_path / "log.csv")
    other.load_state_dict(state)
    assert other.state_dict() == state


# -- through fit -----------------------------------------------------------------
def test_rows_through_fit_match_the_recorders_epochs(tmp_path):
    path = tmp_path / "log.csv"
    rec = Recorder()
    train(
        [rec, CSVLogger(path), OneCycleScheduler(0.1)],
        epochs=3,
        metrics=[accuracy],
        mom=0.9,
    )
    rows = read(path)
    assert rows[0] == HEADER
    for row, expected in zip(rows[1:], rec.epoch_table(), strict=True):
        assert int(row[0]) == expected["epoch"]
        values = [float(v) for v in row[1:4]]
        wanted = [expected[k] for k in ("train_loss", "valid_loss", "accuracy")]
        assert values == pytest.approx(wanted, rel=1e-6)
    # The lr of each epoch's last step, as the Recorder saw it (one-cycle moves it).
    lrs = [float(r[4]) for r in rows[1:]]
    assert lrs == pytest.approx([rec.lrs[i] for i in rec.epoch_iterations])
    assert len(set(lrs)) == 3


def test_a_resumed_fit_appends_without_duplicate_rows(tmp_path):
    path = tmp_path / "log.csv"
    train([CSVLogger(path)], epochs=4, metrics=[accuracy], mom=0.9)
    before = read(path)
    # The same script run again, restored at the start of epoch 2.
    train(
        [FakeResume(epoch=2, iteration=14), CSVLogger(path)],
        epochs=4,
        metrics=[accuracy],
        mom=0.9,
    )
    after = read(path)
    assert epochs_of(path) == [0, 1, 2, 3]
    assert after[:3] == before[:3]  # the rows before the resume are untouched


def test_the_logger_adds_no_sync_per_batch(tmp_path, sync_counter, frozen_clock):
    def count(n_train):
        before = sync_counter["n"]
        train(
            [CSVLogger(tmp_path / f"{n_train}.csv")],
            data=make_data(n_train=n_train),
            metrics=[accuracy],
            mom=0.9,
        )
        return sync_counter["n"] - before

    assert count(64) == count(256)


# -- bad input -------------------------------------------------------------------
def test_a_missing_directory_is_created(tmp_path):
    path = tmp_path / "new" / "deeper" / "log.csv"
    cb = CSVLogger(path)
    begin(cb)
    drive_epoch(cb, 0)
    assert epochs_of(path) == [0]


def test_a_path_that_is_a_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"is a directory.*Fix: .*log\.csv"):
        CSVLogger(tmp_path)


def test_a_path_under_a_file_is_refused_before_training(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="a part of it is a file"):
        CSVLogger(tmp_path / "file" / "log.csv")
    cb = CSVLogger(tmp_path / "later" / "log.csv")
    (tmp_path / "later").write_text("x")  # a file there once the logger exists
    with pytest.raises(ValueError, match="a part of it is a file"):
        begin(cb)


@pytest.mark.parametrize("path", [None, 3])  # "": tests/test_checks.py
def test_a_path_that_is_not_a_path_is_refused(path):
    with pytest.raises(TypeError, match="path must be a file path"):
        CSVLogger(path)


def test_append_must_be_a_bool(tmp_path):
    with pytest.raises(TypeError, match="append must be True or False"):
        CSVLogger(tmp_path / "log.csv", append="yes")


def test_appending_under_another_header_is_refused(tmp_path):
    path = tmp_path / "log.csv"
    cb = CSVLogger(path)
    begin(cb)
    drive_epoch(cb, 0)
    begin(cb, metrics=())  # no accuracy column this time: refused at its row
    with pytest.raises(ValueError, match=r"has the columns.*append=False"):
        drive_epoch(cb, 0, metrics=(0.5,), names=[])
    assert read(path)[1:] == [read(path)[1]]  # nothing was written
    other = CSVLogger(path, append=False)  # a new file is fine
    begin(other, metrics=())
    drive_epoch(other, 0, metrics=(0.5,), names=[])
    assert read(path)[0] == ["epoch", "train_loss", "valid_loss", "lr", "time"]


def test_load_state_dict_refuses_another_dict(tmp_path):
    with pytest.raises(ValueError, match=r"CSVLogger.load_state_dict.*first_row"):
        CSVLogger(tmp_path / "log.csv").load_state_dict({"best": 1.0})


def _deny_writes_under(folder, monkeypatch):
    """Refuses writes below ``folder`` as the system refuses them to a user
    without the permission (root is allowed everything)."""
    import builtins
    import tempfile

    from fitlib.callbacks import csv_logger

    def denied(path):
        return str(path).startswith(str(folder))

    temporary_file = tempfile.TemporaryFile

    def no_temporary(*args, dir=None, **kwargs):
        if denied(dir):
            raise PermissionError(13, "Permission denied", str(dir))
        return temporary_file(*args, dir=dir, **kwargs)

    def no_append(file, mode="r", *args, **kwargs):
        if denied(file) and mode != "r":
            raise PermissionError(13, "Permission denied", str(file))
        return builtins.open(file, mode, *args, **kwargs)

    monkeypatch.setattr(csv_logger.tempfile, "TemporaryFile", no_temporary)
    monkeypatch.setattr(csv_logger, "open", no_append, raising=False)


def _can_write_read_only(tmp_path):
    """Whether this process writes through a read-only mode (root can)."""
    probe = tmp_path / "probe"
    probe.write_text("")
    probe.chmod(0o444)
    try:
        with open(probe, "a"):
            return True
    except PermissionError:
        return False
    finally:
        probe.unlink()


def test_a_read_only_directory_or_file_is_refused_when_the_logger_is_made(
    tmp_path, monkeypatch
):
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "old.csv").write_text("epoch\n")
    (locked / "old.csv").chmod(0o444)
    locked.chmod(0o555)
    if _can_write_read_only(tmp_path):  # root: the system would let it write
        _deny_writes_under(locked, monkeypatch)
    try:
        for path in (locked / "log.csv", locked / "new" / "log.csv"):
            with pytest.raises(ValueError, match=r"cannot write.*Permission denied"):
                CSVLogger(path)
        with pytest.raises(ValueError, match="cannot write"):
            CSVLogger(locked / "old.csv")  # rows could not be appended
    finally:
        locked.chmod(0o755)


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600)])
def test_the_log_gets_the_mode_open_gives_under_the_umask(tmp_path, umask, mode):
    path = tmp_path / "log.csv"
    old = os.umask(umask)
    try:
        begin(CSVLogger(path))
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == mode
    path.chmod(0o640)
    begin(CSVLogger(path, append=False))  # rewritten: keeps the file's mode
    assert os.stat(path).st_mode & 0o777 == 0o640
