import io
import math

import pytest
import torch
from helpers import make_data

from fitlib import DataBunch
from fitlib.callbacks.monitor import Monitor, direction
from fitlib.metrics import F1Score, FBeta, Metrics, R2Score, accuracy, error_rate


def started(monitor="valid_loss", metrics=(), data=None, **kwargs):
    m = Monitor(monitor, **kwargs)
    m.start(Metrics(list(metrics)), data)
    return m


# -- mode="auto" -----------------------------------------------------------------
GO_DOWN = ["valid_loss", "train_loss", "error_rate", "mse", "mae", "rmse", "msle"]
GO_DOWN += ["nll", "mean_squared_error", "MeanAbsoluteError", "perplexity", "val-err"]
GO_UP = ["accuracy", "top_k_accuracy", "acc1", "f1_score", "fbeta", "r2_score"]
GO_UP += ["recall", "precision", "multiclass_auroc", "roc_auc", "dice", "iou"]
GO_UP += ["valAccuracy", "jaccard_index", "pearson_corr_coef", "f0.5_score", "f2"]


@pytest.mark.parametrize("name", GO_DOWN)
def test_auto_mode_knows_losses_and_errors_go_down(name):
    assert direction(name) == "min"
    assert Monitor(name).mode == "min"


@pytest.mark.parametrize("name", GO_UP)
def test_auto_mode_knows_accuracy_and_scores_go_up(name):
    assert direction(name) == "max"
    assert Monitor(name).mode == "max"


def test_auto_mode_knows_the_names_of_fitlibs_own_metrics():
    names = Metrics([accuracy, error_rate, F1Score(), FBeta(0.5), R2Score()]).names
    modes = [Monitor(n).mode for n in names]
    assert modes == ["max", "min", "max", "max", "max"]


@pytest.mark.parametrize("name", ["<lambda>", "score", "accuracy_loss", "custom"])
def test_auto_mode_asks_for_min_or_max_for_a_name_it_cannot_classify(name):
    with pytest.raises(ValueError, match="mode='min' or mode='max'") as info:
        Monitor(name, owner="EarlyStopping")
    assert name in str(info.value) and "EarlyStopping" in str(info.value)


def test_an_explicit_mode_is_used_as_given():
    assert Monitor("custom", mode="max").mode == "max"
    assert Monitor("accuracy", mode="min").mode == "min"  # the user knows best


# -- bad input -------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["minimum", "MAX", None, 1])
def test_a_mode_other_than_auto_min_max_raises(mode):
    with pytest.raises(ValueError, match=r"mode must be one of .*got"):
        Monitor("valid_loss", mode=mode)


@pytest.mark.parametrize("min_delta", [-0.1, math.nan, math.inf, "0", True])
def test_a_negative_or_non_numeric_min_delta_raises(min_delta):
    with pytest.raises(ValueError, match="min_delta must be a finite number >= 0"):
        Monitor("valid_loss", min_delta=min_delta)


@pytest.mark.parametrize("monitor", [None, "", 3])
def test_a_monitor_that_is_not_a_name_raises(monitor):
    with pytest.raises(TypeError, match="monitor must be a name"):
        Monitor(monitor)


def test_an_unknown_monitor_raises_at_start_listing_the_names_that_exist():
    m = Monitor("f1_score", owner="ReduceLROnPlateau")
    with pytest.raises(ValueError, match="not computed") as info:
        m.start(Metrics([accuracy, error_rate]))
    text = str(info.value)
    assert "['valid_loss', 'train_loss', 'accuracy', 'error_rate']" in text
    assert text.startswith("ReduceLROnPlateau")


def test_a_validation_value_without_a_valid_dl_raises_at_start():
    no_valid = DataBunch(make_data().train_dl, None)
    with pytest.raises(ValueError, match="valid_dl is None"):
        Monitor("valid_loss").start(Metrics([]), no_valid)
    started("train_loss", data=no_valid)  # the train loss needs no validation


# -- reading ---------------------------------------------------------------------
def test_reads_valid_loss_and_metrics_from_last_metrics():
    last = [torch.tensor(0.5), torch.tensor(0.75), torch.tensor(0.25)]
    assert started("valid_loss", [accuracy, error_rate]).read(last) == 0.5
    assert started("accuracy", [accuracy, error_rate]).read(last) == 0.75
    assert started("error_rate", [accuracy, error_rate]).read(last) == 0.25
    assert type(started("accuracy", [accuracy]).read(last)) is float


def test_a_skipped_validation_gives_no_value():
    assert started("valid_loss").read(None) is None
    assert started("accuracy", [accuracy]).read(None) is None


def test_train_loss_is_the_sample_weighted_mean_of_the_epochs_batches():
    m = started("train_loss")
    assert m.needs_train_loss and not Monitor("valid_loss").needs_train_loss
    for loss, size in [(1.0, 4), (2.0, 4), (6.0, 2)]:
        m.add_batch(torch.tensor(loss), size)
    # (4*1 + 4*2 + 2*6) / 10 = 2.4; the mean of the batch means would be 3.0
    assert m.read([torch.tensor(99.0)]) == pytest.approx(2.4)
    assert m.read(None) is None  # the batches were consumed by the read
    m.add_batch(torch.tensor(5.0), 3)
    assert m.read(None) == 5.0  # validation skipped: the train loss still exists


def test_reading_train_loss_is_one_host_transfer(monkeypatch):
    m = started("train_loss")
    for i in range(20):
        m.add_batch(torch.tensor(float(i)), 8)
    calls = []
    for name in ("tolist", "item", "__float__", "cpu"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    assert m.read(None) == pytest.approx(9.5)
    assert calls == ["tolist"]


def test_start_forgets_batches_of_an_interrupted_epoch():
    m = started("train_loss")
    m.add_batch(torch.tensor(100.0), 4)
    m.start(Metrics([]))
    m.add_batch(torch.tensor(1.0), 4)
    assert m.read(None) == 1.0


# -- improvement -----------------------------------------------------------------
def test_improvement_must_beat_best_by_more_than_min_delta_in_mins_direction():
    m = Monitor("valid_loss", min_delta=0.1)
    assert m.update(1.0) and m.best == 1.0  # anything beats the start (inf)
    assert not m.update(0.9)  # by exactly min_delta: not more
    assert not m.update(0.95) and m.best == 1.0
    assert m.update(0.85) and m.best == 0.85
    assert not m.update(2.0)


def test_improvement_in_max_mode_goes_up():
    m = Monitor("accuracy", min_delta=0.01)
    assert m.best == -math.inf
    assert m.update(0.5)
    assert not m.update(0.505) and not m.update(0.4)
    assert m.update(0.6) and m.best == 0.6


@pytest.mark.parametrize("mode", ["min", "max"])
def test_nan_is_never_an_improvement(mode):
    m = Monitor("valid_loss", mode=mode)
    assert not m.is_improvement(math.nan)  # not even over the starting best
    m.update(1.0)
    assert not m.update(math.nan) and m.best == 1.0


def test_an_infinite_value_does_not_improve_on_the_start_as_in_torch():
    assert not Monitor("valid_loss").is_improvement(math.inf)
    assert not Monitor("accuracy").is_improvement(-math.inf)


def test_reset_forgets_the_best():
    m = Monitor("valid_loss")
    m.update(0.3)
    m.reset()
    assert m.best == math.inf and m.update(5.0)


# -- saved state -----------------------------------------------------------------
def test_state_dict_round_trip_through_torch_save_restores_best():
    m = Monitor("accuracy")
    m.update(0.7)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    restored = Monitor("accuracy")
    restored.load_state_dict(torch.load(buf, weights_only=True))
    assert restored.best == 0.7
    assert not restored.update(0.65) and restored.update(0.8)
    fresh = Monitor("valid_loss").state_dict()  # inf is a plain float too
    assert fresh == {"monitor": "valid_loss", "mode": "min", "best": math.inf}


def test_load_state_dict_refuses_the_state_of_another_quantity_or_a_bad_dict():
    state = Monitor("accuracy").state_dict()
    with pytest.raises(ValueError, match="state is for monitor='accuracy'"):
        Monitor("valid_loss").load_state_dict(state)
    with pytest.raises(ValueError, match="same monitor and mode"):
        Monitor("accuracy", mode="min").load_state_dict(state)
    with pytest.raises(ValueError, match="keys 'best', 'mode', 'monitor'"):
        Monitor("accuracy").load_state_dict({"best": 0.5})


def test_under_several_processes_train_loss_is_the_mean_over_all_ranks(monkeypatch):
    """Every rank must reach the same decision: the value is the global mean."""
    import fitlib.distributed as ranks

    shards = {0: ([1.0, 3.0], [2, 2]), 1: ([5.0], [4])}  # losses, batch sizes
    pairs = {}
    monkeypatch.setattr(ranks, "world_size", lambda: 2)
    for rank in (0, 1):
        m = Monitor("train_loss")
        m.start(Metrics([]))
        for loss, size in zip(*shards[rank], strict=True):
            m.add_batch(torch.tensor(loss), size)
        pairs[rank] = m
    values = []
    for rank in (0, 1):
        other = 1 - rank
        monkeypatch.setattr(ranks, "rank", lambda rank=rank: rank)
        losses, sizes = shards[other]
        other_pair = torch.tensor(
            [sum(v * s for v, s in zip(losses, sizes)), float(sum(sizes))],
            dtype=torch.float64,
        )
        monkeypatch.setattr(ranks, "all_reduce_sum", lambda t, o=other_pair: t + o)
        values.append(pairs[rank].read(None))
    assert values == [pytest.approx((2 + 6 + 20) / 8)] * 2
