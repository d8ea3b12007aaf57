"""``fitlib.file_errors``: files on disk that must not make a resume lie: a
flipped bit in a saved weight or RNG state is refused with the member's
CRC-32, a full disk during a checkpoint is named and keeps the last file
(issue 29, items 15, 18); and the parts (``verify_file``, ``DamagedFileError``,
``failed_write``, ``save_error``, ``tensor_bytes``) alone."""

import errno
import pickle
import warnings

import pytest
import torch
from helpers import Crash, make_data
from test_serialization import fill_disk, flip_bit, member_holding
from torch import nn
from torch.nn import functional as F  # noqa: N812

from fitlib import Learner
from fitlib.callbacks import Checkpoint
from fitlib.dir_lock import LOCK_NAME
from fitlib.file_errors import (
    DamagedFileError,
    failed_write,
    save_error,
    tensor_bytes,
    verify_file,
)
from fitlib.serialization import safe_load


def learner(tmp_path, callbacks=()):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    return Learner(make_data(), model, F.cross_entropy, path=tmp_path,
                   progress=False, callbacks=list(callbacks))  # fmt: skip


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


# -- the parts alone ---------------------------------------------------------------
def test_verify_file_passes_a_whole_file_and_names_a_damaged_member(tmp_path):
    weight = torch.randn(4, 5)
    path = tmp_path / "w.pth"
    torch.save({"w": weight}, path)
    verify_file(path)  # nothing changed: no error
    member, offset = member_holding(path, weight)
    flip_bit(path, offset + 8)
    with pytest.raises(DamagedFileError) as e:
        verify_file(path)
    assert e.value.path == path and member in e.value.reason
    assert "do not match their CRC-32" in e.value.reason
    assert str(e.value).endswith(f"Fix: {e.value.fix}.")
    copy = pickle.loads(pickle.dumps(e.value))  # as multiprocessing sends it
    assert (copy.path, copy.reason, str(copy)) == (path, e.value.reason, str(e.value))


def test_verify_file_leaves_a_file_that_is_no_zip_and_refuses_a_broken_one(tmp_path):
    legacy = tmp_path / "legacy.pth"
    torch.save({"w": torch.ones(3)}, legacy, _use_new_zipfile_serialization=False)
    verify_file(legacy)  # no checksums to check: torch.load says the rest
    broken = tmp_path / "broken.pth"
    torch.save({"w": torch.ones(1000)}, broken)
    raw = broken.read_bytes()
    at = raw.rindex(b"PK\x01\x02")  # the zip directory's last entry
    broken.write_bytes(raw[:at] + b"XX" + raw[at + 2 :])
    with pytest.raises(DamagedFileError, match="zip directory cannot be read"):
        verify_file(broken)


def test_failed_write_finds_the_os_error_behind_torchs_short_write():
    full = OSError(errno.ENOSPC, "No space left on device")
    assert failed_write(full) is full
    assert failed_write(FileNotFoundError(errno.ENOENT, "gone")) is None
    short = RuntimeError("[enforce fail at inline_container.cc] unexpected pos 64")
    assert failed_write(short) is short  # no errno behind it: the error itself
    short.__cause__ = full
    assert failed_write(short) is full
    assert failed_write(RuntimeError("cannot pickle 'generator'")) is None


def test_save_error_says_why_and_the_fix_by_errno(tmp_path):
    path = tmp_path / "model.pth"
    error = save_error(path, OSError(errno.EROFS, "Read-only file system"), None)
    assert isinstance(error, OSError) and isinstance(error, RuntimeError)
    assert error.errno == errno.EROFS
    text = str(error)
    assert repr(str(path)) in text and "the device is read-only" in text
    assert "no file was left under that name" in text
    assert "Fix: save to a directory on a writable device." in text
    path.write_bytes(b"old")
    full = save_error(path, RuntimeError("unexpected pos 8"), lambda: 1234, False)
    assert full.errno == errno.ENOSPC  # a short write with no errno: a full disk
    assert "the save needs about 1,234 bytes" in str(full)
    assert "No temporary file could be created; the file keeps what it held" in (
        str(full)
    )


def test_tensor_bytes_counts_each_storage_once():
    w = torch.zeros(10)  # 40 bytes
    assert (
        tensor_bytes({"a": w, "b": [w[:5], (torch.zeros(2, dtype=torch.int64),)]}) == 56
    )
    assert tensor_bytes({"n": 3, "s": "text"}) == 0
