import inspect
import itertools
import sys

import pytest
import torch
from fastprogress import fastprogress
from helpers import make_data, make_model
from torch.nn import functional as F  # noqa: N812

import fitlib.hyper_checks
from fitlib import Callback, Learner
from fitlib.callbacks import SuggestedLRs


def learner(tmp_path, progress=False, **kwargs):
    return Learner(
        make_data(n_train=160, bs=16),  # 10 batches an epoch
        make_model(),
        F.cross_entropy,
        path=tmp_path,
        progress=progress,
        **kwargs,
    )


def test_fit_one_cycle_accepts_lr_like_fit(tmp_path):
    def run(*args, **kwargs):
        torch.manual_seed(0)
        learn = learner(tmp_path)
        learn.fit_one_cycle(2, *args, **kwargs)
        weights = [p.detach().clone() for p in learn.model.parameters()]
        return learn.recorder.lrs, learn.recorder.moms, weights

    lrs, moms, weights = run(lr=1e-2)
    assert max(lrs) == pytest.approx(1e-2, rel=1e-2)
    assert lrs[0] == pytest.approx(1e-2 / 25)
    for same in (run(max_lr=1e-2), run(1e-2)):  # the former name, positional
        assert same[:2] == (lrs, moms)
        assert all(map(torch.equal, same[2], weights))


def test_fit_one_cycle_with_both_lr_and_max_lr_says_to_pass_one(tmp_path):
    learn = learner(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"Learner.fit_one_cycle: got lr=0.01 and max_lr=0.02.*pass one",
    ):
        learn.fit_one_cycle(1, lr=1e-2, max_lr=2e-2)
    assert learn.recorder.lrs == []


def test_fit_one_cycle_without_an_lr_peaks_at_the_default_and_says_so(tmp_path, capsys):
    import fitlib.learner

    fitlib.learner._said.discard("lr")
    learn = learner(tmp_path)
    learn.fit_one_cycle(1)
    assert max(learn.recorder.lrs) == pytest.approx(1e-3, rel=1e-2)
    assert "no lr given; training at lr=1e-3" in capsys.readouterr().out


def test_every_fit_shortcut_takes_the_lr_as_lr():
    for method in ("fit", "fit_one_cycle", "fit_flat_cos", "fit_warmup_cos",
                   "fit_snapshots"):  # fmt: skip
        param = inspect.signature(getattr(Learner, method)).parameters["lr"]
        assert param.default is None, method


def test_fit_flat_cos_is_flat_then_anneals_to_zero(tmp_path):
    learn = learner(tmp_path)
    learn.fit_flat_cos(2, lr=1e-2, pct_start=0.5)
    lrs = learn.recorder.lrs
    assert lrs[:10] == [1e-2] * 10  # flat until step 0.5 * 20 - 1 = 9
    assert lrs[10:] == sorted(lrs[10:], reverse=True) and lrs[10] < 1e-2
    assert lrs[-1] == 0.0


def test_fit_warmup_cos_warms_up_linearly_then_anneals(tmp_path):
    learn = learner(tmp_path)
    learn.fit_warmup_cos(2, lr=1e-2, pct_warmup=0.25)
    lrs = learn.recorder.lrs
    peak = lrs.index(max(lrs))
    assert lrs[0] == 0.0 and peak == 4 and lrs[peak] == pytest.approx(1e-2)
    steps = [b - a for a, b in itertools.pairwise(lrs[: peak + 1])]
    assert steps == pytest.approx([2.5e-3] * 4)
    assert lrs[peak:] == sorted(lrs[peak:], reverse=True) and lrs[-1] == 0.0
    assert learn.recorder.train_losses[-1] < learn.recorder.train_losses[0]


class FirstLrs(Callback):
    order = 20  # after the scheduler (10) set the first step's values

    def on_train_begin(self, opt):
        self.lrs = opt.lr


def test_schedules_spread_a_slice_over_layer_groups(tmp_path):
    model, first = make_model(), FirstLrs()
    learn = Learner(
        make_data(), model, F.cross_entropy, path=tmp_path, progress=False,
        layer_groups=[model[:2], model[2:]], callbacks=[first],
    )  # fmt: skip
    learn.fit_flat_cos(1, lr=slice(1e-2), pct_start=0.5)
    assert first.lrs == pytest.approx([1e-3, 1e-2])
    assert learn.opt.lr == 0.0
    learn.fit_warmup_cos(2, lr=slice(1e-4, 1e-2), pct_warmup=0.5)
    assert max(learn.recorder.lrs) == pytest.approx(1e-2)  # the last group's
    assert learn.opt.lr == 0.0


def three_groups(tmp_path):
    model = make_model()
    return Learner(
        make_data(), model, F.cross_entropy, path=tmp_path, progress=False,
        layer_groups=[model[:1], model[1:4], model[4:]],
    )  # fmt: skip


SUGGESTED = SuggestedLRs(valley=1e-3, steepest=2e-3, min_div10=5e-4)


def test_lr_finds_suggestions_are_refused_as_an_lr_saying_to_pass_the_valley(tmp_path):
    learn = three_groups(tmp_path)  # 3 values for 3 groups: once taken silently
    with pytest.raises(TypeError, match=r"max_lr got lr_find's suggestions.*s\.valley"):
        learn.fit_one_cycle(1, max_lr=SUGGESTED)
    for shortcut in (learn.fit, learn.fit_flat_cos, learn.fit_warmup_cos):
        with pytest.raises(TypeError, match=r"lr=s\.valley"):
            shortcut(1, lr=SUGGESTED)
    assert learn.recorder.lrs == []


def test_with_one_group_the_refusal_names_the_argument_given(tmp_path):
    learn = learner(tmp_path)
    with pytest.raises(TypeError) as info:
        learn.fit_one_cycle(1, max_lr=SUGGESTED)
    assert str(info.value).startswith("max_lr got lr_find's suggestions")
    assert "max_lr=s.valley" in str(info.value)
    with pytest.raises(ValueError) as info:
        learn.fit_one_cycle(1, max_lr=[1e-3, 1e-2, 1e-1])
    assert "max_lr: got 3 values [0.001, 0.01, 0.1] for 1 parameter group." in str(
        info.value
    )
    assert "1 values" not in str(info.value)


def spread_spy(monkeypatch):
    """Counts, in every fitlib module that calls it, ``lr_per_group``'s calls:
    the learning rates it spread."""
    original, spread = fitlib.hyper_checks.lr_per_group, []

    def spy(lr, n, name="lr"):
        spread.append(lr)
        return original(lr, n, name)

    for module in list(sys.modules.values()):
        if module.__name__.startswith("fitlib") and (
            getattr(module, "lr_per_group", None) is original
        ):
            monkeypatch.setattr(module, "lr_per_group", spy)
    return spread


@pytest.mark.parametrize(
    "shortcut", ["fit_one_cycle", "fit_flat_cos", "fit_warmup_cos"]
)
def test_a_scheduled_fit_spreads_its_lr_over_the_groups_once(
    tmp_path, monkeypatch, shortcut
):
    # (fit and fit_snapshots spread once already: HPOptimizer or set_lr.)
    learn, lr = three_groups(tmp_path), slice(1e-3, 1e-2)
    run = getattr(learn, shortcut)
    spread = spread_spy(monkeypatch)
    run(1, lr)  # the optimizer is created
    run(1, lr)  # and set
    assert [x for x in spread if x is lr] == [lr, lr]


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.5, "half"])
def test_fractions_outside_zero_one_are_errors(tmp_path, bad):
    learn = learner(tmp_path)
    with pytest.raises(ValueError, match=r"pct_start must be a fraction .* \(0, 1\)"):
        learn.fit_flat_cos(1, lr=1e-3, pct_start=bad)
    with pytest.raises(ValueError, match=r"pct_warmup must be a fraction"):
        learn.fit_warmup_cos(1, lr=1e-3, pct_warmup=bad)
    assert learn.recorder.lrs == []


def test_fit_snapshots_yields_snapshots_every_n_steps_and_after_the_last(tmp_path):
    learn = learner(tmp_path)  # 10 batches an epoch
    snaps = list(learn.fit_snapshots(n_steps=23, every=10))
    assert [s.step for s in snaps] == [10, 20, 23]
    assert [s.epoch for s in snaps] == [0, 1, 2]
    assert snaps[0].metrics == {}  # no epoch has ended before step 10's batch
    assert set(snaps[1].metrics) == {"valid_loss", "accuracy"}
    assert snaps[1].metrics["valid_loss"] == learn.recorder.valid_losses[0]
    assert snaps[-1].loss == learn.recorder.losses[22]
    assert snaps[0].elapsed <= snaps[1].elapsed <= snaps[2].elapsed
    assert len(learn.recorder.losses) == 23


def test_breaking_out_of_fit_snapshots_ends_training_cleanly(tmp_path):
    ends = []

    class End(Callback):
        def on_train_end(self, exception):
            ends.append(exception)

    learn = learner(tmp_path, callbacks=[End()])
    for snap in learn.fit_snapshots(n_steps=100, every=5):
        if snap.step == 15:
            break
    assert ends == [None] and len(learn.recorder.losses) == 15
    learn.fit(1)  # the learner trains on normally afterwards
    assert len(learn.recorder.losses) == 25


def test_fit_iter_is_a_deprecated_alias_of_fit_snapshots_yielding_the_same(tmp_path):
    def run(method):
        torch.manual_seed(0)
        learn = learner(tmp_path)
        snaps = getattr(learn, method)(n_steps=12, every=5, lr=1e-2)
        return [(s.step, s.epoch, s.loss, s.metrics) for s in snaps]

    with pytest.warns(DeprecationWarning, match="called fit_snapshots now"):
        old = run("fit_iter")
    assert old == run("fit_snapshots") and [s[0] for s in old] == [5, 10, 12]


@pytest.mark.parametrize("every", [0, -5, 2.5, True])
def test_fit_snapshots_every_must_be_a_positive_int(tmp_path, every):
    with pytest.raises(ValueError, match="every must be an int >= 1; got"):
        next(learner(tmp_path).fit_snapshots(n_steps=10, every=every))


# -- lr_find's progress ------------------------------------------------------------
def fake_terminal(monkeypatch):
    """stdout (pytest's capture) answers as a terminal, so bars are drawn."""
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr(fastprogress, "printing", lambda: True)


@pytest.mark.filterwarnings("ignore:lr_find:UserWarning")  # a toy sweep
def test_lr_find_shows_one_bar_over_its_steps_and_no_results_table(
    tmp_path, monkeypatch, capsys
):
    learn = learner(tmp_path, progress=True)  # 10 batches an epoch: 3 epochs
    fake_terminal(monkeypatch)
    learn.lr_find(num_it=25, stop_div=False)
    out = capsys.readouterr().out
    assert "[25/25" in out and "smooth loss" in out
    assert "[10/10" not in out and "Epoch" not in out  # no bar per epoch
    assert "#na#" not in out and "train_loss" not in out  # no table
    lines = out.split("\n")  # the bar redraws its line after a "\r"
    assert sum("|" in line for line in lines) == 1  # one bar,
    assert lines[-2].endswith("]") and lines[-1] == ""  # ended by a new line
    learn.progress = False
    learn.lr_find(num_it=25)
    assert capsys.readouterr().out == ""  # without progress, nothing


@pytest.mark.filterwarnings("ignore:lr_find:UserWarning")
def test_lr_find_writes_no_table_of_fake_epochs_in_a_log(tmp_path, capsys):
    learner(tmp_path, progress=True).lr_find(num_it=25)  # stdout: no terminal
    out = capsys.readouterr().out
    assert "#na#" not in out and "epoch" not in out and "|" not in out


@pytest.mark.parametrize(
    "shortcut", ["fit", "fit_one_cycle", "fit_flat_cos", "fit_warmup_cos"]
)
def test_every_fit_returns_a_history_of_its_records(tmp_path, shortcut):
    from fitlib import History

    learn = learner(tmp_path)
    history = getattr(learn, shortcut)(2, lr=1e-2)
    assert type(history) is History
    assert history == list(history) and len(history) == 2
    assert [r["train_loss"] for r in history] == learn.recorder.train_losses
    assert repr(history).startswith("History(2 epochs: train_loss ")


@pytest.mark.parametrize("n_steps", [0, None, 2.5])
def test_fit_snapshots_n_steps_is_named_when_refused(tmp_path, n_steps):
    learn = learner(tmp_path)
    with pytest.raises(ValueError, match=(
        rf"Learner.fit_snapshots: n_steps must be an int >= 1; got {n_steps}"
    )):  # fmt: skip
        next(learn.fit_snapshots(n_steps=n_steps))
    assert learn.recorder.losses == []
