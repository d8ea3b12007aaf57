"""What a rerun does with the files it finds in a checkpoint directory: a
damaged newest checkpoint, odd entries, a damaged ``best.pth``, and the
checkpoint named by ``resume_from``."""

import functools
import os

import pytest
import torch
from helpers import Crash
from test_checkpoint import learner, same_run
from test_serialization import flip_bit, member_holding

from fitlib.callbacks import Checkpoint
from fitlib.serialization import atomic_save, safe_load

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: faster


def crashed_run(tmp_path, at=9, **ckpt):
    """A one-cycle run stopped at iteration ``at``: checkpoints every 2 steps."""
    with pytest.raises(RuntimeError):
        run = learner([Checkpoint(tmp_path, every_n_steps=2, **ckpt), Crash(at)])
        run.fit_one_cycle(2, 0.1)
    return Checkpoint(tmp_path).checkpoints()


def rerun(tmp_path, **ckpt):
    learn = learner([Checkpoint(tmp_path, every_n_steps=2, **ckpt)])
    learn.fit_one_cycle(2, 0.1)
    return learn


@functools.cache  # the same uninterrupted run for every test (not changed)
def reference():
    ref = learner()
    ref.fit_one_cycle(2, 0.1)
    return ref


def truncate(path):
    path.write_bytes(path.read_bytes()[:200])


def garbage(path):
    path.write_bytes(os.urandom(3000))


def without_rng(path):  # a valid torch file that lacks a key fitlib needs
    atomic_save({k: v for k, v in safe_load(path).items() if k != "rng"}, path)


# -- a damaged newest checkpoint ---------------------------------------------------
@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (truncate, "truncated, corrupt"),
        (garbage, "truncated, corrupt"),
        (without_rng, "lacks the entries \\['rng'\\]"),
    ],
)
def test_a_damaged_newest_checkpoint_is_skipped_for_the_newest_intact(
    tmp_path, capsys, damage, why
):
    files = crashed_run(tmp_path)
    assert len(files) == 3
    damage(files[-1])
    with pytest.warns(RuntimeWarning, match=rf"skipped {files[-1].name}.*{why}"):
        learn = rerun(tmp_path)
    assert f"resuming from {files[-2].name}" in capsys.readouterr().out
    assert same_run(learn, reference())  # an older checkpoint resumes exactly
    # The next saves are numbered after the damaged file, which keep_last removes.
    assert files[-1] not in Checkpoint(tmp_path).checkpoints()


def test_when_no_checkpoint_is_intact_the_error_names_each(tmp_path):
    files = crashed_run(tmp_path, keep_last=2)
    garbage(files[0])
    truncate(files[1])
    with pytest.raises(ValueError, match="no checkpoint in") as info:
        rerun(tmp_path)
    message = str(info.value)
    assert all(f.name in message for f in files)
    assert "truncated, corrupt" in message and "resume=False" in message


def flip_a_weight(path):
    """One flipped bit in a stored weight: a file whose CRC-32 no longer matches."""
    weight = safe_load(path)["model"]["3.weight"]
    flip_bit(path, member_holding(path, weight)[1] + 4, bit=1)


def test_the_skip_warning_says_what_was_done_and_gives_no_fix(tmp_path):
    files = crashed_run(tmp_path)
    flip_a_weight(files[-1])
    with pytest.warns(RuntimeWarning, match=rf"skipped {files[-1].name}") as warned:
        rerun(tmp_path)
    (message,) = [str(w.message) for w in warned if "skipped" in str(w.message)]
    assert "CRC-32" in message and f"resumes from {files[-2].name}" in message
    assert "Fix" not in message


def test_when_every_checkpoint_is_damaged_the_error_has_one_fix(tmp_path):
    files = crashed_run(tmp_path)
    for path in files:
        flip_a_weight(path)
    with pytest.raises(ValueError, match="no checkpoint in") as info:
        rerun(tmp_path)
    message = str(info.value)
    assert message.count("Fix:") == 1 and message.count("CRC-32") == len(files)
    assert all(message.count(f.name) == 1 for f in files)
    assert "resume_from" not in message  # no intact checkpoint to name


@pytest.mark.parametrize("best", ["intact", "damaged"])
def test_resume_from_best_is_offered_only_when_best_pth_is_intact(tmp_path, best):
    files = crashed_run(tmp_path, monitor="valid_loss")
    for path in files:
        truncate(path)
    if best == "damaged":
        flip_a_weight(tmp_path / "best.pth")
    with pytest.raises(ValueError, match="no checkpoint in") as info:
        rerun(tmp_path, monitor="valid_loss")
    assert ("resume_from='best'" in str(info.value)) == (best == "intact")


def test_a_damaged_best_pth_does_not_block_a_fresh_run(tmp_path):
    learner([Checkpoint(tmp_path, monitor="valid_loss")]).fit(1, lr=0.05)
    garbage(tmp_path / "best.pth")
    fresh = learner([Checkpoint(tmp_path, monitor="valid_loss", resume=False)])
    with pytest.warns(RuntimeWarning, match=r"best\.pth.*damaged.*starts the best"):
        fresh.fit(2, lr=0.05)
    best = safe_load(tmp_path / "best.pth")  # this run's best, written anew
    assert best["monitor"]["best"] == min(fresh.recorder.valid_losses)


# -- odd entries -------------------------------------------------------------------
def a_directory(path):
    path.unlink()
    path.mkdir()


def a_dangling_link(path):
    path.unlink()
    path.symlink_to(path.with_name("gone.pth"))


@pytest.mark.parametrize(
    ("make", "what"),
    [
        (a_directory, "is a directory"),
        (a_dangling_link, "is a symbolic link to a missing file"),
    ],
)
def test_an_odd_entry_named_as_the_newest_checkpoint_is_skipped(
    tmp_path, capsys, make, what
):
    files = crashed_run(tmp_path, keep_last=4)
    make(files[-1])
    with pytest.warns(RuntimeWarning, match=rf"skipped {files[-1].name}.*{what}"):
        learn = rerun(tmp_path, keep_last=2)
    assert f"resuming from {files[-2].name}" in capsys.readouterr().out
    assert same_run(learn, reference())
    # Saved after it, never over it; a directory is not deleted as a checkpoint.
    number = int(Checkpoint(tmp_path).checkpoints()[0].stem[-6:])
    assert number > int(files[-1].stem[-6:])
    assert files[-1].is_dir() == (make is a_directory)


@pytest.mark.parametrize(
    ("make", "what"),
    [
        (a_directory, "is a directory"),
        (a_dangling_link, "is a symbolic link to a missing file"),
        (without_rng, "lacks the entries"),
    ],
)
def test_an_odd_entry_with_no_intact_checkpoint_is_named(tmp_path, make, what):
    learner([Checkpoint(tmp_path)]).fit(1, lr=0.05)
    (path,) = Checkpoint(tmp_path).checkpoints()
    make(path)
    with pytest.raises(ValueError, match=rf"{path.name}' {what}.*Fix: move"):
        learner([Checkpoint(tmp_path)]).fit(2, lr=0.05)


def test_a_directory_named_like_a_temporary_file_is_left_alone(tmp_path):
    learner([Checkpoint(tmp_path)]).fit(1, lr=0.05)
    odd = tmp_path / ".checkpoint-000007.pth.0123456789ab.tmp"
    odd.mkdir()
    with pytest.warns(RuntimeWarning, match=rf"{odd.name}' is a directory"):
        learner([Checkpoint(tmp_path)]).fit(1, lr=0.05)
    assert odd.is_dir()


def test_a_directory_named_best_pth_is_refused_before_training(tmp_path):
    (tmp_path / "best.pth").mkdir()
    learn = learner([Checkpoint(tmp_path, monitor="valid_loss")])
    with pytest.raises(ValueError, match=r"best\.pth' is a directory.*Fix: move"):
        learn.fit(1, lr=0.05)
    assert learn.recorder.losses == []  # before training
    learner([Checkpoint(tmp_path)]).fit(1, lr=0.05)  # without monitor: not used


# -- resume_from -------------------------------------------------------------------
@pytest.mark.parametrize("name", ["checkpoint-000001.pth", "abs", "best"])
def test_resume_from_a_named_checkpoint(tmp_path, capsys, name):
    files = crashed_run(tmp_path, monitor="valid_loss", keep_last=5)
    path = {"abs": files[1], "best": tmp_path / "best.pth"}.get(name, files[1])
    start = safe_load(path)["position"]["iteration"]
    assert 0 < start < safe_load(files[-1])["position"]["iteration"]  # not newest
    with pytest.warns(UserWarning, match=rf"newer checkpoints: .*{files[-1].name}"):
        learn = rerun(tmp_path, resume_from=path if name == "abs" else name)
    assert f"resuming from {path.name}" in capsys.readouterr().out
    assert len(learn.recorder.losses) == 14 and same_run(learn, reference())


def test_resume_from_keeps_its_file_for_the_next_run_of_the_script(tmp_path):
    files = crashed_run(tmp_path)  # keep_last=3: three files
    with (
        pytest.warns(UserWarning, match="newer checkpoints") as warned,
        pytest.raises(RuntimeError, match="crash"),
    ):
        run = learner([Checkpoint(tmp_path, every_n_steps=2,
                                  resume_from=files[0].name), Crash(13)])  # fmt: skip
        run.fit_one_cycle(2, 0.1)
    said = [str(w.message) for w in warned if "newer checkpoints" in str(w.message)]
    assert len(said) == 1 and files[1].name in said[0] and files[2].name in said[0]
    assert files[0].is_file()  # keep_last left the file resume_from names
    assert len(Checkpoint(tmp_path).checkpoints()) == 4  # and kept 3 others
    with pytest.warns(UserWarning, match="newer checkpoints"):
        learn = rerun(tmp_path, resume_from=files[0].name)  # the same script, again
    assert same_run(learn, reference())


def test_resume_from_a_damaged_file_is_an_error_not_a_skip(tmp_path):
    files = crashed_run(tmp_path)
    truncate(files[0])
    with pytest.raises(ValueError, match=rf"{files[0].name}.*truncated, corrupt"):
        rerun(tmp_path, resume_from=files[0].name)


def test_resume_from_a_missing_file_names_the_files_there(tmp_path):
    files = crashed_run(tmp_path)
    with pytest.raises(ValueError, match=r"resume_from='checkpoint-40\.pth'") as info:
        Checkpoint(tmp_path, resume_from="checkpoint-40.pth")
    assert all(f.name in str(info.value) for f in files)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"resume": "no"}, TypeError, r"resume must be True or False; got 'no' \(str"),
        ({"save_best": 1}, TypeError, r"save_best must be True or False; got 1 \(int"),
        ({"resume_from": 3}, TypeError, r"resume_from must be a file name.*got 3"),
        ({"resume_from": "best", "resume": False}, ValueError, "resume=False"),
    ],
)
def test_bad_resume_arguments_are_refused(tmp_path, kwargs, error, match):
    torch.save({}, tmp_path / "best.pth")
    with pytest.raises(error, match=match):
        Checkpoint(tmp_path, **kwargs)
