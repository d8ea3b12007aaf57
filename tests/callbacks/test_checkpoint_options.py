"""Checkpoint's options for the files kept for their value (save_top_k,
filename, initial_value_threshold, save_weights_only) and for saving every
n seconds (every_n_seconds). Cases ported from the peers' suites: Lightning's
ModelCheckpoint (save_top_k, filename, train_time_interval,
save_weights_only), Keras's ModelCheckpoint (initial_value_threshold,
filepath formatting, save_weights_only) and Ignite's Checkpoint (n_saved with
a score function)."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import Crash, child_env, kill_until_done, make_data, make_model
from torch.nn import functional as F  # noqa: N812

import fitlib.checkpoint_clock
from fitlib import Callback, DataBunch, HPOptimizer, Learner, fit
from fitlib.callbacks import Checkpoint
from fitlib.metrics import accuracy
from fitlib.serialization import safe_load

HERE = Path(__file__).parent


class Scores(Callback):
    """Adds a scripted value ``score`` to each epoch's record."""

    record_names = ("score",)

    def __init__(self, values):
        self.values = values

    def on_epoch_end(self, epoch):
        return {"record": {"score": self.values[epoch]}}


def learner(callbacks=(), seed=0):
    return Learner(make_data(), make_model(seed=seed), F.cross_entropy,
                   opt_func=torch.optim.SGD, wd=0, metrics=[accuracy],
                   progress=False, callbacks=list(callbacks))  # fmt: skip


def run(tmp_path, scores, **ckpt):
    ckpt = Checkpoint(tmp_path, monitor="score", **{"mode": "min", **ckpt})
    learner([ckpt, Scores(scores)]).fit(len(scores), lr=0.05)
    return ckpt


def kept(tmp_path):
    """The files besides the regular checkpoints and best.pth."""
    names = {p.name for p in tmp_path.glob("*.pth")}
    return sorted(n for n in names if n != "best.pth" and "checkpoint-" not in n)


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- save_top_k --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("mode", "expected"), [("min", ["4-0.2.pth", "1-0.3.pth"]),
                           ("max", ["3-0.6.pth", "0-0.5.pth"])],
)  # fmt: skip
def test_keeps_the_k_best_files_by_the_monitor_and_removes_the_others(
    tmp_path, mode, expected
):
    ckpt = run(tmp_path, [0.5, 0.3, 0.4, 0.6, 0.2], mode=mode, save_top_k=2,
               filename="{epoch}-{score:.1f}")  # fmt: skip
    assert [p.name for p, _ in ckpt.best_files] == expected
    assert kept(tmp_path) == sorted(expected)
    best = safe_load(tmp_path / "best.pth")  # the single best, as before
    assert best["position"]["epoch"] == int(expected[0][0]) + 1
    top = safe_load(tmp_path / expected[1])  # a whole checkpoint of its epoch
    assert top["position"]["epoch"] == int(expected[1][0]) + 1


def test_a_tie_with_the_worst_kept_file_keeps_the_earlier_one(tmp_path):
    ckpt = run(tmp_path, [0.3, 0.3, 0.3, 0.2], save_top_k=2, filename="e{epoch}")
    assert [p.name for p, _ in ckpt.best_files] == ["e3.pth", "e0.pth"]
    assert kept(tmp_path) == ["e0.pth", "e3.pth"]


def test_nan_is_never_among_the_best(tmp_path):
    ckpt = run(tmp_path, [math.nan, 0.5, math.nan], save_top_k=2, filename="e{epoch}")
    assert kept(tmp_path) == ["e1.pth"]
    assert [v for _, v in ckpt.best_files] == [0.5]
    assert safe_load(tmp_path / "best.pth")["position"]["epoch"] == 2


def test_save_top_k_minus_one_keeps_every_judged_file(tmp_path):
    run(tmp_path, [0.5, 0.6, 0.4], save_top_k=-1, filename="e{epoch}", keep_last=1)
    assert kept(tmp_path) == ["e0.pth", "e1.pth", "e2.pth"]
    assert len(list(tmp_path.glob("checkpoint-*.pth"))) == 1  # keep_last's own


def test_a_top_k_file_is_a_checkpoint_to_resume_from(tmp_path, capsys):
    run(tmp_path, [0.5, 0.3, 0.4], save_top_k=1, filename="e{epoch}")
    again = Checkpoint(tmp_path, monitor="score", mode="min", resume_from="e1.pth",
                       save_top_k=1, filename="e{epoch}")  # fmt: skip
    learn = learner([again, Scores([0.5, 0.3, 0.4])])
    with pytest.warns(UserWarning, match="holds newer checkpoints"):
        learn.fit(3, lr=0.05)
    assert "resuming from e1.pth (epoch 2" in capsys.readouterr().out
    assert learn.recorder.epochs == [0, 1, 2]


def test_the_ranking_survives_a_crash_and_ends_as_an_unbroken_runs(tmp_path):
    scores = [0.5, 0.3, 0.4, 0.2]
    options = dict(monitor="score", mode="min", save_top_k=2,
                   filename="{epoch}-{score}", every_n_steps=3)  # fmt: skip
    ref_ckpt = Checkpoint(tmp_path / "ref", **options)
    ref = learner([ref_ckpt, Scores(scores)])
    ref.fit(4, lr=0.05)
    for at in [5, 13, 22, None]:
        ckpt = Checkpoint(tmp_path / "run", **options)
        extra = [Crash(at)] if at is not None else []
        learn = learner([ckpt, Scores(scores), *extra])
        try:
            learn.fit(4, lr=0.05)
        except RuntimeError:
            assert at is not None
    assert ckpt.best_files[0][1] == 0.2
    assert [p.name for p, _ in ckpt.best_files] == [
        p.name for p, _ in ref_ckpt.best_files
    ]
    assert kept(tmp_path / "run") == kept(tmp_path / "ref")
    for name in kept(tmp_path / "ref"):
        a, b = safe_load(tmp_path / "ref" / name), safe_load(tmp_path / "run" / name)
        assert same_weights(a["model"], b["model"])
    assert same_weights(ref.model.state_dict(), learn.model.state_dict())


def test_a_fresh_run_keeps_the_earlier_runs_best_files_unless_it_beats_them(
    tmp_path, capsys
):
    options = dict(save_top_k=2, filename="{epoch}-{score:.2f}")
    run(tmp_path, [0.3, 0.2], **options)
    best = (tmp_path / "best.pth").read_bytes()
    ckpt = run(tmp_path, [0.5, 0.25], resume=False, **options)  # no better best
    assert [v for _, v in ckpt.best_files] == [0.2, 0.25]
    assert kept(tmp_path) == ["1-0.20.pth", "1-0.25.pth"]  # 0.3 pushed out
    assert (tmp_path / "best.pth").read_bytes() == best
    assert safe_load(tmp_path / "best.pth")["monitor"]["best"] == 0.2
    assert "rank by score (min) (of an earlier run)" in capsys.readouterr().out


def test_rerunning_a_finished_run_leaves_its_best_files_alone(tmp_path):
    run(tmp_path, [0.3, 0.2], save_top_k=1, filename="e{epoch}")
    before = {p.name: p.read_bytes() for p in tmp_path.glob("*.pth")}
    ckpt = run(tmp_path, [0.3, 0.2], save_top_k=1, filename="e{epoch}")
    assert {p.name: p.read_bytes() for p in tmp_path.glob("*.pth")} == before
    assert [p.name for p, _ in ckpt.best_files] == ["e1.pth"]  # resumed state


# -- filename ----------------------------------------------------------------------
def test_the_template_takes_record_values_and_the_counters(tmp_path):
    template = "{epoch:02d}-{step}-{iteration}-{score:.3f}-{valid_loss:.0f}"
    run(tmp_path, [0.5, 0.4], save_top_k=-1, filename=template)
    assert kept(tmp_path) == ["00-7-7-0.500-1.pth", "01-14-14-0.400-1.pth"]


def test_a_name_the_record_lacks_is_refused_before_training(tmp_path):
    ckpt = Checkpoint(tmp_path, monitor="valid_loss", save_top_k=2,
                      filename="{epoch:02d}-{val_loss:.3f}")  # fmt: skip
    learn = learner([ckpt])
    with pytest.raises(ValueError, match=r"uses \{val_loss\}") as info:
        learn.fit(1, lr=0.05)
    message = str(info.value)
    assert "did you mean 'valid_loss'" in message and "'accuracy'" in message
    assert "a counter (epoch, step, iteration)" in message
    assert learn.recorder.losses == []


@pytest.mark.parametrize(
    ("filename", "message"),
    [
        ("{epoch:02d}-{valid_loss:02d}", "format spec that does not fit"),
        ("{epoch:.3q}", "format spec that does not fit"),
        ("run-{}", "names no value"),
        ("run", "has no field"),
        ("runs/{epoch}", "holds '/'"),
        ("checkpoint-{step:06d}", "regular checkpoints'"),
        ("{epoch", "not a format template"),
        ("", "non-empty str"),
    ],
)
def test_a_bad_template_is_refused_when_the_checkpoint_is_made(
    tmp_path, filename, message
):
    with pytest.raises((ValueError, TypeError), match=message):
        Checkpoint(tmp_path, monitor="valid_loss", save_top_k=2, filename=filename)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"filename": "{epoch}"}, r"names the files of the k best \(save_top_k\)"),
        ({"save_top_k": 2}, "save_top_k=2 needs monitor="),
        ({"monitor": "valid_loss", "save_top_k": 0}, "save_top_k must be an int >= 1"),
        ({"initial_value_threshold": 0.5}, "needs monitor="),
        ({"monitor": "valid_loss", "initial_value_threshold": math.inf},
         "initial_value_threshold must be a finite number"),
        ({"save_weights_only": True}, "save_weights_only=True needs monitor="),
        ({"monitor": "valid_loss", "save_weights_only": "yes"},
         "save_weights_only must be True or False"),
        ({"every_n_seconds": 0}, "every_n_seconds must be"),
        ({"every_n_seconds": math.nan}, "every_n_seconds must be"),
        ({"every_n_epochs": 1, "every_n_steps": 2, "every_n_seconds": 5}, "got both"),
    ],
)  # fmt: skip
def test_options_without_what_they_need_are_refused(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Checkpoint(tmp_path, **kwargs)


# -- initial_value_threshold -------------------------------------------------------
def test_no_best_file_until_the_value_beats_the_threshold(tmp_path):
    ckpt = run(tmp_path, [0.5, 0.4, 0.3, 0.35], initial_value_threshold=0.35,
               save_top_k=2, filename="e{epoch}")  # fmt: skip
    assert kept(tmp_path) == ["e2.pth"]  # 0.35 only ties: it does not beat it
    assert safe_load(tmp_path / "best.pth")["position"]["epoch"] == 3
    assert [v for _, v in ckpt.best_files] == [0.3]


def test_a_threshold_never_beaten_writes_no_best_file(tmp_path):
    run(tmp_path, [0.5, 0.4], mode="min", initial_value_threshold=0.1,
        save_top_k=2)  # fmt: skip
    assert kept(tmp_path) == [] and not (tmp_path / "best.pth").exists()


def test_an_earlier_best_better_than_the_threshold_still_stands(tmp_path):
    run(tmp_path, [0.2], save_top_k=1, filename="a{epoch}")
    run(tmp_path, [0.3], resume=False, initial_value_threshold=0.5,
        save_top_k=1, filename="b{epoch}")  # fmt: skip
    assert kept(tmp_path) == ["a0.pth"]
    assert safe_load(tmp_path / "best.pth")["monitor"]["best"] == 0.2


# -- save_weights_only -------------------------------------------------------------
def test_weights_only_files_load_into_a_plain_model(tmp_path):
    ckpt = run(tmp_path, [0.5, 0.3], save_top_k=2, filename="e{epoch}",
               save_weights_only=True)  # fmt: skip
    for path in [tmp_path / "best.pth", *(p for p, _ in ckpt.best_files)]:
        weights = torch.load(path, weights_only=True)
        plain = make_model()
        plain.load_state_dict(weights)  # the plain model's keys, nothing else
        assert set(weights) == set(plain.state_dict())
    assert same_weights(torch.load(tmp_path / "best.pth"),
                        torch.load(tmp_path / "e1.pth"))  # fmt: skip
    regular = safe_load(Checkpoint(tmp_path).checkpoints()[-1])
    assert {"model", "opt", "position"} <= set(regular)  # still resumable


def test_weights_only_files_are_the_weights_of_their_epoch(tmp_path):
    class Keep(Callback):
        def on_epoch_end(self, model):
            self.weights = {k: v.clone() for k, v in model.state_dict().items()}

    keep = Keep()
    ckpt = Checkpoint(tmp_path, monitor="valid_loss", save_weights_only=True)
    learner([ckpt, keep]).fit(1, lr=0.05)
    assert same_weights(torch.load(tmp_path / "best.pth"), keep.weights)


def test_resume_from_best_with_weights_only_is_refused(tmp_path):
    (tmp_path / "best.pth").write_bytes(b"")
    with pytest.raises(ValueError, match=r"best\.pth holds the weights alone"):
        Checkpoint(tmp_path, monitor="valid_loss", save_weights_only=True,
                   resume_from="best")  # fmt: skip


def test_a_weights_only_best_of_an_earlier_run_is_replaced_only_by_a_better(
    tmp_path, capsys
):
    run(tmp_path, [0.2], save_weights_only=True)
    best = (tmp_path / "best.pth").read_bytes()
    run(tmp_path, [0.5, 0.3], save_weights_only=True, resume=False)  # worse
    assert (tmp_path / "best.pth").read_bytes() == best
    assert "holds the best score (min) so far (0.2" in capsys.readouterr().out
    run(tmp_path, [0.5, 0.1], save_weights_only=True, resume=False)  # better
    assert (tmp_path / "best.pth").read_bytes() != best


# -- every_n_seconds ---------------------------------------------------------------
@pytest.fixture
def fake_clock(monkeypatch):
    """A clock that moves one second each time it is read."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(fitlib.checkpoint_clock, "monotonic", lambda: next(ticks))


def saved_steps(tmp_path):
    return [
        safe_load(p)["position"]["step"] for p in Checkpoint(tmp_path).checkpoints()
    ]


def test_saves_when_n_seconds_passed_since_the_last_save(tmp_path, fake_clock):
    # Read as the fit begins, after each step and at each save: 3 s pass
    # every 3 steps (the save's own read starts the next interval).
    learner([Checkpoint(tmp_path, every_n_seconds=3, keep_last=100)]).fit(2, lr=0.05)
    assert saved_steps(tmp_path) == [3, 6, 9, 12, 14]  # and the final one


def test_seconds_come_beside_every_n_epochs(tmp_path, fake_clock):
    ckpt = Checkpoint(tmp_path, every_n_epochs=1, every_n_seconds=5, keep_last=100)
    learner([ckpt]).fit(2, lr=0.05)
    assert saved_steps(tmp_path) == [5, 7, 12, 14]  # the epoch's save resets it


def test_a_run_saved_by_the_clock_resumes_exactly(tmp_path, fake_clock):
    ref = learner()
    ref.fit(3, lr=0.05)
    for at in [4, 12, None]:
        extra = [Crash(at)] if at is not None else []
        learn = learner([Checkpoint(tmp_path, every_n_seconds=2), *extra])
        try:
            learn.fit(3, lr=0.05)
        except RuntimeError:
            assert at is not None
    assert same_weights(ref.model.state_dict(), learn.model.state_dict())
    assert learn.recorder.losses == ref.recorder.losses


def test_every_n_seconds_needs_a_loader_with_a_length(tmp_path):
    class Stream:  # no __len__
        def __iter__(self):
            yield from make_data().train_dl

    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    ckpt = Checkpoint(tmp_path, every_n_seconds=60)
    with pytest.raises(ValueError, match=r"Checkpoint\(every_n_seconds=...\) needs"):
        fit(1, model, F.cross_entropy, opt, DataBunch(Stream()), [ckpt])


# -- after SIGKILL, every option on --------------------------------------------------
def test_killed_with_every_option_on_the_run_and_its_best_files_end_identical(
    tmp_path,
):
    """The child (resume_child.py, "options"): two optimizers, top-2 files by
    valid_loss under a template, a threshold, weights-only best files, saves
    every 0.15 s of wall clock."""
    env, child = child_env(), [sys.executable, str(HERE / "resume_child.py")]
    ref_args = [str(tmp_path / "ref"), str(tmp_path / "ref.pth"), "parts", "options"]
    subprocess.run([*child, *ref_args], env=env, check=True, capture_output=True)
    run_args = [str(tmp_path / "run"), str(tmp_path / "run.pth"), "parts", "options"]
    kills = kill_until_done([*child, *run_args], env, seed=4321)
    assert kills >= 2, "the run was too fast to kill: slow resume_child.py down"
    ref, run_ = safe_load(tmp_path / "ref.pth"), safe_load(tmp_path / "run.pth")
    assert run_["losses"] == ref["losses"]
    assert run_["valid_losses"] == ref["valid_losses"]
    assert same_weights(run_["weights"], ref["weights"])
    assert len(ref["best"]) == 2 and run_["best"] == ref["best"]  # the ranking
    names = kept(tmp_path / "ref")
    assert names and kept(tmp_path / "run") == names
    for name in [*names, "best.pth"]:
        a = torch.load(tmp_path / "ref" / name, weights_only=True)
        assert same_weights(a, torch.load(tmp_path / "run" / name, weights_only=True))


# -- the files of other runs, and the record of the ranking (.fitlib-best.json) ----
def test_a_fresh_run_of_another_monitor_leaves_the_earlier_runs_files_alone(
    tmp_path,
):
    first = run(tmp_path, [0.9, 0.1, 0.8, 0.2], save_top_k=2)
    before = {p.name: p.read_bytes() for p, _ in first.best_files}
    ckpt = Checkpoint(tmp_path, monitor="valid_loss", save_top_k=1, save_best=False,
                      resume=False)  # fmt: skip
    with pytest.warns(UserWarning, match=r"ranked by score \(min\).*left alone"):
        learner([ckpt, Scores([0.5] * 4)]).fit(4, lr=0.05)
    assert {n: (tmp_path / n).read_bytes() for n in before} == before
    assert [p.name for p, _ in ckpt.best_files] == ["epoch=3-step=28-v1.pth"]
    # The earlier ranking is still on record: a fresh run of its monitor competes.
    again = run(tmp_path, [0.5], resume=False, save_top_k=2)
    assert [v for _, v in again.best_files] == [0.1, 0.2]


def test_an_unranked_file_of_the_same_name_is_not_overwritten_by_a_fresh_run(
    tmp_path,
):
    (tmp_path / "e0.pth").write_bytes(b"mine")
    ckpt = run(tmp_path, [0.5], save_top_k=1, filename="e{epoch}")
    assert (tmp_path / "e0.pth").read_bytes() == b"mine"
    assert [p.name for p, _ in ckpt.best_files] == ["e0-v1.pth"]


@pytest.mark.parametrize("weights_only", [False, True])
def test_best_files_written_after_the_newest_checkpoint_still_rank(
    tmp_path, weights_only
):
    options = dict(
        save_top_k=1, filename="s{score:.1f}", save_weights_only=weights_only
    )
    try:  # 7 batches an epoch; checkpoints every 2 epochs; killed in epoch 3
        ckpt = Checkpoint(tmp_path, monitor="score", mode="min", every_n_epochs=2,
                          **options)  # fmt: skip
        learner([ckpt, Scores([0.9, 0.5, 0.1, 0.8]), Crash(at=23)]).fit(4, lr=0.05)
    except RuntimeError:
        pass
    best = (tmp_path / "best.pth").read_bytes()
    ckpt = run(tmp_path, [0.4, 0.4], resume=False, **options)
    assert (tmp_path / "best.pth").read_bytes() == best
    assert [(p.name, v) for p, v in ckpt.best_files] == [("s0.1.pth", 0.1)]
    assert kept(tmp_path) == ["s0.1.pth"]


@pytest.mark.parametrize("damage", ["missing", "not json", "odd"])
def test_a_damaged_ranking_record_starts_the_ranking_over_and_deletes_nothing(
    tmp_path, damage
):
    run(tmp_path, [0.3, 0.2], save_top_k=2, filename="e{epoch}")
    record = tmp_path / ".fitlib-best.json"
    if damage == "missing":
        record.unlink()
    else:
        record.write_text("{oops" if damage == "not json" else '{"rankings": 3}')
    ckpt = Checkpoint(tmp_path, monitor="score", mode="min", save_top_k=2,
                      filename="e{epoch}", resume=False)  # fmt: skip
    learn = learner([ckpt, Scores([0.9, 0.8, 0.7])])
    if damage == "missing":
        learn.fit(3, lr=0.05)
    else:
        with pytest.warns(RuntimeWarning, match="starts the ranking over"):
            learn.fit(3, lr=0.05)
    # Its files are unknown to the new run: taken, neither replaced nor deleted.
    assert kept(tmp_path) == ["e0.pth", "e1-v1.pth", "e1.pth", "e2.pth"]
    assert [p.name for p, _ in ckpt.best_files] == ["e2.pth", "e1-v1.pth"]


def test_a_ranked_file_removed_by_hand_no_longer_ranks(tmp_path):
    run(tmp_path, [0.3, 0.2], save_top_k=2, filename="e{epoch}")
    (tmp_path / "e1.pth").unlink()
    ckpt = run(tmp_path, [0.5, 0.4], resume=False, save_top_k=2, filename="f{epoch}")
    assert [p.name for p, _ in ckpt.best_files] == ["e0.pth", "f1.pth"]
    assert kept(tmp_path) == ["e0.pth", "f1.pth"]


def test_a_smaller_save_top_k_cuts_the_earlier_ranking(tmp_path):
    run(tmp_path, [0.3, 0.2, 0.1], save_top_k=3, filename="e{epoch}")
    ckpt = run(tmp_path, [0.5], resume=False, save_top_k=1, filename="f{epoch}")
    assert [p.name for p, _ in ckpt.best_files] == ["e2.pth"]
    assert kept(tmp_path) == ["e2.pth"]


def test_a_file_both_best_and_top_k_is_saved_once(tmp_path, monkeypatch):
    import fitlib.callbacks.checkpoint as module

    saved = []
    real = module.atomic_save

    def counted(obj, path):
        saved.append(Path(path).name)
        return real(obj, path)

    monkeypatch.setattr(module, "atomic_save", counted)
    run(tmp_path, [0.5], save_top_k=1, filename="e{epoch}", every_n_epochs=5)
    assert sorted(saved) == ["best.pth", "checkpoint-000000.pth"]  # the final one
    assert (tmp_path / "e0.pth").read_bytes() == (tmp_path / "best.pth").read_bytes()


def test_the_earlier_best_is_reported_with_its_own_value_under_a_threshold(
    tmp_path, capsys
):
    run(tmp_path, [0.9, 0.8])
    capsys.readouterr()
    run(tmp_path, [0.7, 0.6], resume=False, initial_value_threshold=0.5)
    out = capsys.readouterr().out
    assert "(0.8, of an earlier run)" in out and "initial_value_threshold (0.5)" in out


def test_threshold_or_weights_only_with_nothing_to_keep_is_refused(tmp_path):
    for option in ({"initial_value_threshold": 0.5}, {"save_weights_only": True}):
        with pytest.raises(ValueError, match="save_best=False and no save_top_k"):
            Checkpoint(tmp_path, monitor="valid_loss", save_best=False, **option)


def test_save_top_k_below_minus_one_names_minus_one_as_valid(tmp_path):
    with pytest.raises(ValueError, match=r"-1 \(keep every one\)"):
        Checkpoint(tmp_path, monitor="valid_loss", save_top_k=-2)


@pytest.mark.parametrize("template", ["checkpoint-{score:g}", "checkpoint{score}"])
def test_a_template_that_could_name_a_regular_checkpoint_is_refused(tmp_path, template):
    with pytest.raises(ValueError, match="regular checkpoints'"):
        Checkpoint(tmp_path, monitor="score", save_top_k=2, filename=template)


def test_learn_load_of_a_weights_only_file_says_how_to_load_it(tmp_path):
    run(tmp_path, [0.5], save_weights_only=True)
    with pytest.raises(ValueError, match=r"load_state_dict\(torch\.load\("):
        learner().load(tmp_path / "best.pth")
