"""``fitlib.dir_lock``: the lock a checkpoint directory takes (``DirLock``)
refuses a lock path that is a link, a directory, a fifo or a hard link, and
takes a plain file (issue 29, item 14); without ``fcntl`` it warns, once,
that the directory is not locked."""

import os
import warnings

import pytest
import torch
from helpers import make_data
from torch import nn
from torch.nn import functional as F  # noqa: N812

import fitlib.dir_lock as dir_lock
from fitlib import Learner
from fitlib.callbacks import Checkpoint
from fitlib.dir_lock import LOCK_NAME, DirLock


def learner(tmp_path, callbacks=()):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    return Learner(make_data(), model, F.cross_entropy, path=tmp_path,
                   progress=False, callbacks=list(callbacks))  # fmt: skip


# -- the lock (item 14) ------------------------------------------------------------
def test_a_lock_linked_to_a_file_is_refused_and_the_file_kept(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("a week of notes")
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / LOCK_NAME).symlink_to(notes)
    with pytest.raises(ValueError, match="symbolic link") as e:
        learner(tmp_path, [Checkpoint(runs)]).fit(1, lr=0.05)
    assert str(runs / LOCK_NAME) in str(e.value) and "Fix: remove" in str(e.value)
    assert notes.read_text() == "a week of notes"
    assert list(runs.glob("*.pth")) == []  # nothing trained


def test_a_dangling_lock_link_is_refused_and_creates_nothing(tmp_path):
    target = tmp_path / "elsewhere.txt"
    (tmp_path / LOCK_NAME).symlink_to(target)
    with pytest.raises(ValueError, match="symbolic link"):
        DirLock(tmp_path).acquire()
    assert not target.exists()


@pytest.mark.parametrize("kind", ["directory", "fifo", "hard link"])
def test_a_lock_path_that_is_not_a_plain_file_is_refused(tmp_path, kind):
    path = tmp_path / LOCK_NAME
    other = tmp_path / "notes.txt"
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        other.write_text("notes")
        os.link(other, path)
    with pytest.raises(ValueError, match=f"{kind}.*Fix: remove") as e:
        DirLock(tmp_path).acquire()
    assert str(path) in str(e.value)
    if kind == "hard link":
        assert other.read_text() == "notes"


def test_a_plain_lock_file_is_still_taken_and_written(tmp_path):
    lock = DirLock(tmp_path)
    lock.acquire()
    assert f"pid: {os.getpid()}" in (tmp_path / LOCK_NAME).read_text()
    lock.release()


def test_without_fcntl_a_warning_says_the_directory_is_not_locked(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(dir_lock, "fcntl", None)
    monkeypatch.setattr(dir_lock, "_warned_unlocked", False)
    with pytest.warns(RuntimeWarning, match="cannot lock"):
        learner(tmp_path, [Checkpoint(tmp_path)]).fit(1, lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        learner(tmp_path, [Checkpoint(tmp_path, resume=False)]).fit(1, lr=0.05)
