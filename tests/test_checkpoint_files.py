"""``fitlib.checkpoint_files``: which entries of a directory are checkpoints,
reading one (and why it cannot be resumed from), the file ``resume_from``
names, and the directory cleaned of a killed run's half-written files.
``Checkpoint``'s use of them: ``tests/callbacks/test_checkpoint_directory.py``."""

import pickle

import pytest
import torch

from fitlib.checkpoint_files import (
    CheckpointFileError,
    checkpoint_files,
    listing,
    numbered,
    read_checkpoint,
    remove_temporaries,
    resume_path,
)
from fitlib.serialization import atomic_save

ENTRIES = ("model", "opt", "callbacks", "monitor", "rng", "epoch_rng")
POSITION = {"epoch": 1, "num_batch": 0, "iteration": 7, "step": 7, "finished": False}


def save_checkpoint(path, **changes):
    saved = {"fitlib_checkpoint": 2, "run": {}, "position": POSITION,
             **{key: {} for key in ENTRIES}, **changes}  # fmt: skip
    atomic_save(saved, path)
    return path


def test_checkpoints_are_numbered_entries_oldest_first_and_files_only(tmp_path):
    for name in ["checkpoint-000010.pth", "checkpoint-000002.pth", "best.pth"]:
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "checkpoint-000011.pth").mkdir()
    (tmp_path / "checkpoint-x.pth").write_bytes(b"")
    assert [n for n, _ in numbered(tmp_path)] == [2, 10, 11]
    assert [p.name for p in checkpoint_files(tmp_path)] == [
        "checkpoint-000002.pth",
        "checkpoint-000010.pth",
    ]
    assert listing(tmp_path) == (
        "checkpoint-000002.pth, checkpoint-000010.pth, best.pth"
    )
    assert listing(tmp_path / "checkpoint-000011.pth") == "none"


def test_read_checkpoint_returns_an_intact_checkpoint(tmp_path):
    saved = read_checkpoint(save_checkpoint(tmp_path / "checkpoint-1.pth"), 2)
    assert saved["position"] == POSITION and saved["fitlib_checkpoint"] == 2


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda p: p.mkdir(), "is a directory"),
        (lambda p: None, "does not exist"),
        (lambda p: p.write_bytes(b"half a zip"), "damaged"),
        (lambda p: atomic_save({"weights": torch.ones(1)}, p), "not a fitlib"),
    ],
)
def test_read_checkpoint_says_why_a_file_cannot_be_resumed_from(tmp_path, make, reason):
    path = tmp_path / "checkpoint-000003.pth"
    make(path)
    with pytest.raises(CheckpointFileError, match=reason) as info:
        read_checkpoint(path, 2)
    assert info.value.path == path and str(path) in str(info.value)
    assert "Fix:" not in str(info.value)  # the caller's message gives the fix


def test_a_missing_entry_is_named_position_fields_too(tmp_path):
    path = tmp_path / "checkpoint-000003.pth"
    saved = {"fitlib_checkpoint": 2, "run": {}, "position": {"epoch": 1},
             **{key: {} for key in ENTRIES}}  # fmt: skip
    del saved["rng"]
    atomic_save(saved, path)
    with pytest.raises(CheckpointFileError) as info:
        read_checkpoint(path, 2)
    assert "lacks the entries ['rng', 'position.num_batch'" in info.value.reason


def test_a_checkpoint_of_a_newer_fitlib_asks_for_an_upgrade(tmp_path):
    path = save_checkpoint(tmp_path / "checkpoint-1.pth", fitlib_checkpoint=3)
    with pytest.raises(ValueError, match=r"newer fitlib.*Fix: upgrade") as info:
        read_checkpoint(path, 2)
    assert not isinstance(info.value, CheckpointFileError)


def test_a_checkpoint_file_error_survives_pickling(tmp_path):
    error = CheckpointFileError(tmp_path / "c.pth", "is a directory")
    again = pickle.loads(pickle.dumps(error))
    assert (again.path, again.reason, str(again)) == (
        error.path,
        error.reason,
        str(error),
    )


def test_resume_path_names_a_file_in_the_directory_or_none_for_the_newest(
    tmp_path,
):
    save_checkpoint(tmp_path / "best.pth")
    save_checkpoint(tmp_path / "checkpoint-000004.pth")
    assert resume_path(None, tmp_path, True) is None
    assert resume_path("last", tmp_path, True) is None
    assert resume_path("best", tmp_path, True) == tmp_path / "best.pth"
    named = resume_path("checkpoint-000004.pth", tmp_path, True)
    assert named == tmp_path / "checkpoint-000004.pth"
    (tmp_path / "sub").mkdir()
    elsewhere = save_checkpoint(tmp_path / "sub" / "x.pth")
    assert resume_path(elsewhere, tmp_path, True) == elsewhere


def test_resume_path_refuses_a_missing_file_listing_those_there(tmp_path):
    save_checkpoint(tmp_path / "checkpoint-000004.pth")
    with pytest.raises(ValueError, match="does not exist") as info:
        resume_path("checkpoint-000009.pth", tmp_path, True)
    assert "checkpoints in" in str(info.value)
    assert "resume_from='checkpoint-000004.pth'" in str(info.value)
    with pytest.raises(ValueError, match="resume=False"):
        resume_path("best", tmp_path, False)
    with pytest.raises(TypeError, match="resume_from must be"):
        resume_path(4, tmp_path, True)


def test_a_killed_saves_temporary_file_is_one_the_next_run_removes(
    tmp_path, monkeypatch
):
    seen = []

    def killed(obj, f):
        seen.extend(p.name for p in tmp_path.iterdir())
        raise KeyboardInterrupt  # stands for the kill: the file stays half written

    monkeypatch.setattr(torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        atomic_save({"v": torch.ones(1)}, tmp_path / "checkpoint-000001.pth")
    assert len(seen) == 1 and seen[0].startswith(".checkpoint-000001.pth.")
    (tmp_path / seen[0]).write_bytes(b"half")  # as a SIGKILL would leave it
    remove_temporaries(tmp_path)
    assert list(tmp_path.iterdir()) == []
