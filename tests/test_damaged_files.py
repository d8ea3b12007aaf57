"""Files on disk that must not make a resume lie (issue 29, items 14, 15, 18)."""

import errno
import os
import warnings

import pytest
import torch
from helpers import Crash, make_data
from test_serialization import fill_disk, flip_bit, member_holding
from torch import nn
from torch.nn import functional as F  # noqa: N812

from fitlib import Learner
from fitlib.callbacks import Checkpoint
from fitlib.resume import LOCK_NAME, DirLock
from fitlib.serialization import safe_load


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


# -- a flipped bit (item 15) -------------------------------------------------------
def test_learner_load_refuses_a_flipped_bit_in_a_weight(tmp_path):
    learn = learner(tmp_path)
    path = learn.save("stage1")
    member, offset = member_holding(path, learn.model[0].weight.detach())
    flip_bit(path, offset + 40, bit=3)
    with pytest.raises(ValueError, match="CRC-32") as e:
        learn.load("stage1")
    assert str(path) in str(e.value) and repr(member) in str(e.value)


def rng_tensor(state):
    """torch's own generator state inside a checkpoint's ``rng`` entry."""
    if isinstance(state, dict):
        return rng_tensor(state["torch"])
    if isinstance(state, (list, tuple)):  # one per rank
        return rng_tensor(state[0])
    return state


def interrupted_run(tmp_path):
    """A fit stopped at its 10th batch, with a checkpoint every 3 steps."""
    runs = tmp_path / "runs"
    with pytest.raises(RuntimeError, match="crash"):
        learner(tmp_path, [Checkpoint(runs, every_n_steps=3), Crash(10)]).fit(2, 0.05)
    return runs, Checkpoint(runs).checkpoints()[-1]


def rerun_says(tmp_path, runs, capsys):
    """What a rerun said: its error or, when it went on from another file,
    what it printed and warned."""
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        try:
            learner(tmp_path, [Checkpoint(runs, every_n_steps=3)]).fit(2, 0.05)
        except ValueError as e:
            return str(e)
    return capsys.readouterr().out + " ".join(str(w.message) for w in warned)


def test_a_checkpoint_with_a_flipped_bit_in_its_rng_state_is_not_resumed(
    tmp_path, capsys
):
    runs, path = interrupted_run(tmp_path)
    _, offset = member_holding(path, rng_tensor(safe_load(path)["rng"]))
    flip_bit(path, offset + 100)
    said = rerun_says(tmp_path, runs, capsys)
    assert path.name in said and "CRC-32" in said


def test_a_checkpoint_with_a_flipped_bit_in_a_weight_is_not_resumed(tmp_path, capsys):
    runs, path = interrupted_run(tmp_path)
    weight = safe_load(path)["model"]["2.weight"]
    _, offset = member_holding(path, weight)
    flip_bit(path, offset + 4, bit=1)
    said = rerun_says(tmp_path, runs, capsys)
    assert path.name in said and "CRC-32" in said


# -- a full disk (item 18) ---------------------------------------------------------
def test_a_full_disk_during_a_checkpoint_names_it_and_keeps_the_last(
    tmp_path, monkeypatch
):
    runs, path = interrupted_run(tmp_path)
    before = {p.name: p.read_bytes() for p in runs.iterdir()}
    fill_disk(monkeypatch, room=500)
    with pytest.raises(OSError, match="no space left on the device") as e:
        learner(tmp_path, [Checkpoint(runs, every_n_steps=3)]).fit(2, 0.05)
    assert e.value.errno == errno.ENOSPC and "checkpoint-" in str(e.value)
    monkeypatch.undo()
    after = {p.name: p.read_bytes() for p in runs.iterdir()}
    assert {k: v for k, v in after.items() if k != LOCK_NAME} == {
        k: v for k, v in before.items() if k != LOCK_NAME
    }
    assert safe_load(path)["position"]["step"] == 9  # the last one, intact
