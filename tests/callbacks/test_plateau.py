import io
import math
import random

import pytest
import torch
from helpers import make_data, make_dataset, make_model, scripted_record
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

from fitlib import DataBunch, HPOptimizer, fit
from fitlib.callback import call_hook
from fitlib.callback_handler import CallbackHandler
from fitlib.callbacks.plateau import ReduceLROnPlateau
from fitlib.callbacks.recorder import Recorder
from fitlib.metrics import Metrics, accuracy


def make_opt(lrs=(0.1,)):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in lrs]
    return HPOptimizer(groups, torch.optim.SGD, lr=list(lrs))


def begin(cb, opt, metrics=(accuracy,), epoch=0, batches_per_epoch=7):
    """on_train_begin of a fit starting at ``epoch`` (> 0: a resumed one)."""
    call_hook(
        cb,
        "on_train_begin",
        epoch=epoch,
        iteration=epoch * batches_per_epoch,
        opt=opt,
        metrics=Metrics(list(metrics)),
    )


def feed(cb, opt, values, first_epoch=0):
    """One on_epoch_end per value, as validation losses; returns lr per epoch."""
    lrs = []
    for epoch, v in enumerate(values, first_epoch):
        last = None if v is None else [torch.tensor(v, dtype=torch.float64)]
        record = scripted_record(last_metrics=last, epoch=epoch)
        call_hook(cb, "on_epoch_end", epoch=epoch, record=record, opt=opt)
        lrs.append(opt.get("lr"))
    return lrs


# -- the same rule as torch's ReduceLROnPlateau ----------------------------------
def noisy_descent(n, seed):
    rng = random.Random(seed)
    return [1.0 / (1 + 0.1 * i) + rng.gauss(0, 0.02) for i in range(n)]


PLATEAUS = [1.0, 0.8, 0.8, 0.79, 0.8, 0.7, 0.7, 0.7, 0.7, 0.7, 0.6, 0.6, 0.6]
PLATEAUS += [0.6, 0.55, 0.55, math.nan, 0.5, math.inf, 0.5, 0.5, 0.49, 0.5, 0.5]
SCENARIOS = {
    # name: (mode, factor, patience, min_delta, cooldown, min_lr, values)
    "plateaus": ("min", 0.5, 0, 0.0, 0, 0.0, PLATEAUS),
    "patience_and_delta": ("min", 0.2, 2, 0.05, 0, 0.0, noisy_descent(40, 0)),
    "cooldown": ("min", 0.5, 1, 0.0, 3, 0.0, noisy_descent(40, 1)),
    "max_with_floor": ("max", 0.5, 1, 0.01, 2, 0.01, [-v for v in PLATEAUS] * 2),
    "floor_per_group": ("min", 0.1, 0, 0.0, 1, [1e-3, 1e-4], noisy_descent(40, 2)),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_lrs_equal_torchs_reduce_lr_on_plateau_epoch_by_epoch(scenario):
    mode, factor, patience, min_delta, cooldown, min_lr, values = SCENARIOS[scenario]
    ours = make_opt((0.1, 0.05))
    theirs = torch.optim.SGD(
        [
            {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr}
            for lr in (0.1, 0.05)
        ]
    )
    torch_plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
        theirs, mode, factor, patience, min_delta, "abs", cooldown, min_lr
    )
    cb = ReduceLROnPlateau("valid_loss", factor, patience, min_delta, mode, min_lr,
                           cooldown)  # fmt: skip
    begin(cb, ours, metrics=())
    for epoch, value in enumerate(values):
        feed(cb, ours, [value], epoch)
        torch_plateau.step(value)
        assert ours.get("lr") == [g["lr"] for g in theirs.param_groups], epoch
        assert cb.num_bad_epochs == torch_plateau.num_bad_epochs, epoch
        assert cb.cooldown_counter == torch_plateau.cooldown_counter, epoch
    assert len(cb.reductions) >= 2  # the scenario does exercise reductions


@pytest.mark.parametrize("mode", ["min", "max"])
def test_a_relative_min_delta_reduces_as_torchs_rel_threshold_mode(mode):
    values = noisy_descent(40, 3)  # positive values, where the rules agree
    values = values if mode == "min" else [2 - v for v in values]
    ours, theirs = (
        make_opt((0.1,)),
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1),
    )
    torch_plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
        theirs, mode, 0.5, 1, 0.03, "rel"
    )
    cb = ReduceLROnPlateau("valid_loss", 0.5, 1, 0.03, mode, min_delta_mode="rel")
    begin(cb, ours, metrics=())
    for epoch, value in enumerate(values):
        feed(cb, ours, [value], epoch)
        torch_plateau.step(value)
        assert ours.get("lr") == [g["lr"] for g in theirs.param_groups], epoch
    assert len(cb.reductions) >= 2
    with pytest.raises(ValueError, match="ReduceLROnPlateau: min_delta_mode must"):
        ReduceLROnPlateau(min_delta_mode="relative")


def test_a_floor_stops_the_reductions_and_is_not_recorded_as_one():
    opt = make_opt((0.1,))
    cb = ReduceLROnPlateau(factor=0.5, min_lr=0.03)
    begin(cb, opt)
    lrs = feed(cb, opt, [1.0] * 6)
    assert lrs == [[0.1], [0.05], [0.03], [0.03], [0.03], [0.03]]
    assert cb.reductions == [1, 2]


def test_a_change_below_eps_is_rounding_noise_and_is_skipped_as_in_torch():
    opt = make_opt((0.1,))
    cb = ReduceLROnPlateau(factor=0.1, min_lr=1e-3)
    begin(cb, opt)
    lrs = feed(cb, opt, [1.0] * 5)
    # 0.1 * 0.1 * 0.1 is 2e-19 above the floor: not worth a "reduction"
    assert lrs[2] == [0.1 * 0.1 * 0.1] != [1e-3] and lrs[-1] == lrs[2]
    assert cb.reductions == [1, 2]


def test_cooldown_epochs_count_no_bad_epochs():
    opt = make_opt()
    cb = ReduceLROnPlateau(factor=0.5, cooldown=2)
    begin(cb, opt)
    feed(cb, opt, [1.0] * 9)
    assert cb.reductions == [1, 4, 7]
    assert opt.lr == pytest.approx(0.1 / 8)


def test_waits_for_more_than_patience_bad_epochs():
    opt = make_opt()
    cb = ReduceLROnPlateau(factor=0.5, patience=2)
    begin(cb, opt)
    lrs = feed(cb, opt, [1.0, 1.0, 1.0, 0.9, 1.0, 1.0, 1.0])
    assert [lr[0] for lr in lrs] == [0.1] * 6 + [0.05]
    assert cb.reductions == [6]


def test_a_metric_in_max_mode_reduces_when_it_stops_rising():
    opt = make_opt()
    cb = ReduceLROnPlateau("accuracy", factor=0.5)
    begin(cb, opt, metrics=(accuracy,))
    for epoch, acc in enumerate([0.5, 0.6, 0.7, 0.7]):
        last = [torch.tensor(9.0), torch.tensor(acc)]  # valid_loss is ignored
        record = scripted_record(last_metrics=last, names=["accuracy"], epoch=epoch)
        call_hook(cb, "on_epoch_end", epoch=epoch, record=record, opt=opt)
    assert cb.reductions == [3] and opt.lr == 0.05


def test_an_epoch_without_validation_changes_nothing():
    opt = make_opt()
    cb = ReduceLROnPlateau(patience=0)
    begin(cb, opt)
    feed(cb, opt, [1.0, 1.0])
    state = cb.state_dict()
    lrs = feed(cb, opt, [None, None, None], first_epoch=2)
    assert lrs == [[pytest.approx(0.02)]] * 3
    assert cb.state_dict() == state


def test_monitoring_train_loss_uses_training_batches_even_without_validation():
    opt = make_opt()
    cb = ReduceLROnPlateau("train_loss", factor=0.5)
    handler = CallbackHandler([cb])
    handler.on_train_begin(3, opt=opt, metrics=Metrics([accuracy]))

    def epoch(losses, sizes):
        handler.on_epoch_begin()
        for loss, bs in zip(losses, sizes):
            handler.on_batch_begin(torch.zeros(bs, 2), torch.zeros(bs))
            handler.on_batch_end(torch.tensor(loss))
        # validation batches are not training losses
        handler.on_batch_begin(torch.zeros(5, 2), torch.zeros(5), train=False)
        handler.on_batch_end(torch.tensor(0.0))
        handler.on_epoch_end(None)  # validation skipped: no valid_loss

    epoch([2.0, 1.0], [3, 2])  # mean 1.6
    epoch([1.0, 2.0], [3, 2])  # mean 1.4
    assert cb.monitor.best == pytest.approx(1.4) and cb.reductions == []
    epoch([1.5], [4])
    assert cb.reductions == [2] and opt.lr == 0.05


def test_prints_one_line_per_reduction_only_when_verbose(capsys):
    for verbose in (False, True):
        opt = make_opt()
        cb = ReduceLROnPlateau(verbose=verbose)
        begin(cb, opt)
        feed(cb, opt, [1.0, 1.0, 1.0])
        out = capsys.readouterr().out
        assert cb.reductions == [1, 2]
        lines = out.splitlines()
        assert lines == [] if not verbose else len(lines) == 2
    assert "epoch 1" in lines[0] and "lr 0.1 -> 0.02" in lines[0]


# -- bad input -------------------------------------------------------------------
@pytest.mark.parametrize("factor", [0, 1, 1.5, -0.5, math.nan, "0.5", True])
def test_a_factor_outside_0_1_raises(factor):
    with pytest.raises(ValueError, match=r"factor must be a number in \(0, 1\)"):
        ReduceLROnPlateau(factor=factor)


@pytest.mark.parametrize("name", ["patience", "cooldown"])
def test_a_negative_or_non_int_patience_or_cooldown_raises(name):
    with pytest.raises(ValueError, match=f"{name} must be an int >= 0; got -1"):
        ReduceLROnPlateau(**{name: -1})
    for bad in (1.5, True, "2"):
        with pytest.raises(TypeError, match=f"{name} must be an int"):
            ReduceLROnPlateau(**{name: bad})


@pytest.mark.parametrize("min_lr", [-1e-3, [0.1, -1.0], math.nan])
def test_a_negative_min_lr_raises(min_lr):
    with pytest.raises(ValueError, match="min_lr must be >= 0"):
        ReduceLROnPlateau(min_lr=min_lr)


@pytest.mark.parametrize("min_lr", ["1e-3", [], None])
def test_a_min_lr_that_is_no_number_or_list_raises(min_lr):
    with pytest.raises(TypeError, match="min_lr must be a number or a list"):
        ReduceLROnPlateau(min_lr=min_lr)


def test_a_min_lr_count_unlike_the_param_groups_raises_at_train_begin():
    cb = ReduceLROnPlateau(min_lr=[0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match=r"min_lr has 3 values .* 2 parameter group"):
        begin(cb, make_opt((0.1, 0.01)))
    begin(ReduceLROnPlateau(min_lr=[0.0, 1e-4]), make_opt((0.1, 0.01)))  # fine


def test_an_unknown_monitor_raises_at_train_begin_listing_the_names():
    cb = ReduceLROnPlateau("f1_score")
    with pytest.raises(ValueError, match=r"'valid_loss', 'train_loss', 'accuracy'\]"):
        begin(cb, make_opt(), metrics=(accuracy,))


def test_a_bad_or_unknowable_mode_raises():
    with pytest.raises(ValueError, match="mode must be one of"):
        ReduceLROnPlateau(mode="lower")
    with pytest.raises(ValueError, match="ReduceLROnPlateau: mode='auto' cannot"):
        ReduceLROnPlateau("my_metric")
    with pytest.raises(ValueError, match="min_delta must be"):
        ReduceLROnPlateau(min_delta=-1)


# -- saved state -----------------------------------------------------------------
def test_state_dict_round_trip_restores_best_counts_and_reductions():
    opt = make_opt()
    cb = ReduceLROnPlateau(factor=0.5, patience=1, cooldown=3)
    begin(cb, opt)
    feed(cb, opt, [1.0, 0.9, 0.9, 0.9, 0.9])
    buf = io.BytesIO()
    torch.save(cb.state_dict(), buf)
    buf.seek(0)
    restored = ReduceLROnPlateau(factor=0.5, patience=1, cooldown=3)
    restored.load_state_dict(torch.load(buf, weights_only=True))
    assert restored.state_dict() == cb.state_dict()
    assert restored.reductions == [3] and restored.cooldown_counter == 2
    assert restored.monitor.best == 0.9
    with pytest.raises(ValueError, match="expected the keys"):
        restored.load_state_dict({"reductions": []})


def test_a_resumed_fit_keeps_the_loaded_state_and_a_new_fit_resets_it():
    opt = make_opt()
    cb = ReduceLROnPlateau(factor=0.5, patience=1)
    begin(cb, opt)
    feed(cb, opt, [1.0, 1.0, 1.0])  # reduced after epoch 2
    state = cb.state_dict()
    resumed = ReduceLROnPlateau(factor=0.5, patience=1)
    resumed.load_state_dict(state)
    begin(resumed, opt, epoch=3)
    assert resumed.state_dict() == state
    feed(resumed, opt, [1.0, 1.0], first_epoch=3)  # best is still 1.0: no gain
    assert resumed.reductions == [2, 4]
    begin(resumed, opt, epoch=0)
    assert resumed.reductions == [] and resumed.monitor.best == math.inf
    assert resumed.num_bad_epochs == resumed.cooldown_counter == 0


# -- through fit -----------------------------------------------------------------
def constant(out, y):
    """A metric that never improves."""
    return out.new_tensor(0.5)


def test_through_fit_the_lr_drops_after_a_plateau():
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    plateau = ReduceLROnPlateau("constant", factor=0.5, patience=1, mode="max")
    rec = Recorder()
    fit(5, model, F.cross_entropy, opt, make_data(), [plateau, rec], [constant])
    assert plateau.reductions == [2, 4]
    # 7 steps per epoch: epochs 0-2 at 0.1, 3-4 at 0.05; the last drop is after.
    assert rec.lrs == [0.1] * 21 + [0.05] * 14
    assert opt.lr == 0.025


def test_through_fit_an_unknown_monitor_fails_before_any_step():
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"names that exist are \['valid_loss'"):
        fit(1, model, F.cross_entropy, opt, make_data(), [ReduceLROnPlateau("acc")])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# -- no sync per batch -----------------------------------------------------------


def count_syncs(n_train, counter):
    data = DataBunch(
        DataLoader(make_dataset(n_train), 16, shuffle=True),
        DataLoader(make_dataset(32, seed=1), 16),
        device="cpu",
    )
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    plateau = ReduceLROnPlateau("train_loss", patience=0)
    before = counter["n"]
    fit(3, model, F.cross_entropy, opt, data, [plateau])
    return counter["n"] - before, plateau


def test_monitoring_train_loss_adds_no_sync_per_batch(sync_counter):
    few, plateau_few = count_syncs(64, sync_counter)
    many, plateau_many = count_syncs(512, sync_counter)
    assert few == many  # 4 vs 32 batches per epoch: syncs only per epoch
    assert few >= 3  # the counter works: each epoch end reads the train loss
    assert math.isfinite(plateau_few.monitor.best)
    assert math.isfinite(plateau_many.monitor.best)


# -- under a schedule ------------------------------------------------------------
def cos_lr(step, total, start=0.1, end=0.001):
    return end + (start - end) / 2 * (math.cos(math.pi * step / (total - 1)) + 1)


def test_under_a_schedule_a_reduction_persists_as_a_factor():
    from fitlib.callbacks import ParamScheduler, cosine

    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    plateau = ReduceLROnPlateau("constant", factor=0.5, patience=1, mode="max")
    sched, rec = ParamScheduler({"lr": cosine(0.1, 0.001)}), Recorder()
    fit(5, model, F.cross_entropy, opt, make_data(), [sched, plateau, rec], [constant])
    assert plateau.reductions == [2, 4]
    # By hand: the cosine's value at each step, halved once after epoch 2 (7
    # steps an epoch: from step 21 on); the second halving comes after the end.
    expected = [cos_lr(s, 35) * (0.5 if s >= 21 else 1.0) for s in range(35)]
    assert rec.lrs == pytest.approx(expected, rel=1e-12)


def test_a_reduction_composes_with_one_cycle_and_the_next_fit_starts_clean(tmp_path):
    from fitlib import Learner

    def run(callbacks):
        torch.manual_seed(0)
        learn = Learner(make_data(), make_model(), F.cross_entropy, metrics=[constant],
                        path=tmp_path, progress=False)  # fmt: skip
        learn.fit_one_cycle(5, 0.1, callbacks=callbacks)
        return learn

    plain = run([])
    plateau = ReduceLROnPlateau("constant", factor=0.2, patience=0, mode="max")
    reduced = run([plateau])
    # After epochs 1, 2 and 3; after epoch 4 the lr (1cycle's end, ~4e-7, times
    # 0.2**3) would change by less than EPS, which torch's rule skips too.
    assert plateau.reductions == [1, 2, 3]
    factors = [0.2 ** min(max(s // 7 - 1, 0), 3) for s in range(35)]
    assert reduced.recorder.lrs == pytest.approx(
        [lr * f for lr, f in zip(plain.recorder.lrs, factors)], rel=1e-12
    )
    reduced.fit_one_cycle(5, 0.1)  # a new fit: the schedule's own values again
    assert reduced.recorder.lrs[35:] == pytest.approx(plain.recorder.lrs, rel=1e-12)
