import io
import math

import pytest
import torch
from helpers import clone_params, make_data, make_model, scripted_record
from torch.nn import functional as F  # noqa: N812

from fitlib import DataBunch, HPOptimizer, fit
from fitlib.callbacks import Checkpoint, EarlyStopping, ReduceLROnPlateau
from fitlib.metrics import (
    F1Score,
    FBeta,
    Metrics,
    R2Score,
    accuracy,
    error_rate,
    mse,
)
from fitlib.monitor import Monitor, direction


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


def test_a_typo_in_a_monitor_gets_the_close_name_not_a_mode_fix():
    # mode="auto" cannot classify a typo: the fix is the name, not mode=.
    with pytest.raises(ValueError, match=r"did you mean 'valid_loss'\?") as info:
        Monitor("valid_los", owner="EarlyStopping")
    assert str(info.value).startswith("EarlyStopping: monitor='valid_los'")
    with pytest.raises(ValueError, match=r"did you mean 'top_k_accuracy'\?"):
        Monitor("top_k_acuracy")
    with pytest.raises(ValueError, match=r"'score'.*mode='min' or mode='max'") as info:
        Monitor("score")  # no close name: a value of the user's
    assert "did you mean" not in str(info.value)


@pytest.mark.parametrize(
    "name",
    ["valid_los", "acuracy", "train_acuracy", "valid_accuracz", "train_acucracy"],
)
def test_a_typo_is_refused_at_start_with_the_close_name_also_for_prefixed_names(name):
    # valid_/train_ names could be loss parts (known at the first batch), but
    # one shorter than a close known name, or as long (a letter changed or
    # two swapped), is a typo: refused before training.
    m = Monitor(name, mode="min", owner="EarlyStopping")
    with pytest.raises(ValueError, match=r"not computed in this fit \(did you mean"):
        m.start(Metrics([accuracy]), train_metrics=Metrics([accuracy]))


@pytest.mark.parametrize("name", ["valid_loss2", "train_loss1", "valid_rmse"])
def test_a_name_extending_a_known_one_may_be_a_part_checked_at_the_first_record(
    name,
):
    # A loss returning a dict without part_names: "loss2" or "rmse" extends
    # "loss" or "mse" and is a legit part name, known at the first batch.
    m = started(name, [mse], mode="min")
    record = {"epoch": 0, "train_loss": 1.0, "valid_loss": 0.5, name: 0.25}
    assert m.read(record) == 0.25
    del record[name]
    with pytest.raises(ValueError, match=rf"{name}.*not in the epoch's record"):
        m.read(record)


def test_a_loss_part_is_checked_at_start_when_the_loss_declares_its_parts():
    def loss(out, y):
        return {"loss": out.sum(), "ce": out.sum()}

    loss.part_names = ("ce", "box")
    Monitor("valid_box", mode="min").start(Metrics([]), loss_func=loss)
    with pytest.raises(ValueError, match=r"'valid_bx' is not computed .*valid_box"):
        Monitor("valid_bx", mode="min").start(Metrics([]), loss_func=loss)
    with pytest.raises(ValueError, match=r"'valid_size' is not computed"):
        Monitor("valid_size", mode="min").start(Metrics([]), loss_func=loss)


def test_a_monitor_missing_from_the_record_gets_the_close_name():
    m = started("valid_cee", mode="min")  # a loss part, known at the first batch
    record = {"epoch": 0, "valid_loss": 0.5, "valid_ce": 0.25, "time": 1.0}
    with pytest.raises(ValueError, match=r"\(did you mean 'valid_ce'\?\)"):
        m.read(record)


def test_a_validation_value_without_a_valid_dl_raises_at_start():
    no_valid = DataBunch(make_data().train_dl, None)
    with pytest.raises(ValueError, match="valid_dl is None"):
        Monitor("valid_loss").start(Metrics([]), no_valid)
    started("train_loss", data=no_valid)  # the train loss needs no validation


# -- reading ---------------------------------------------------------------------
def test_reads_valid_loss_and_metrics_from_the_record():
    last = [torch.tensor(0.5), torch.tensor(0.75), torch.tensor(0.25)]
    record = scripted_record([2.0], [4], last, names=["accuracy", "error_rate"])
    assert started("valid_loss", [accuracy, error_rate]).read(record) == 0.5
    assert started("accuracy", [accuracy, error_rate]).read(record) == 0.75
    assert started("error_rate", [accuracy, error_rate]).read(record) == 0.25
    assert started("train_loss").read(record) == 2.0
    assert type(started("accuracy", [accuracy]).read(record)) is float


def test_a_skipped_validation_gives_no_value():
    record = scripted_record([1.0], [2], None, names=["accuracy"])
    assert started("valid_loss").read(record) is None
    assert started("accuracy", [accuracy]).read(record) is None
    assert started("train_loss").read(record) == 1.0  # still computed


def test_a_loss_part_is_checked_at_the_first_record_listing_the_names():
    m = started("valid_ce")  # could be a loss part: known at the first batch
    with pytest.raises(ValueError, match=r"valid_ce.*not in the epoch's record"):
        m.read(scripted_record([1.0], [2], [torch.tensor(0.5)]))
    record = {"epoch": 0, "valid_loss": 0.5, "valid_ce": 0.25, "time": 1.0}
    assert m.read(record) == 0.25


def test_names_declared_by_callbacks_and_training_metrics_are_known_at_start():
    from fitlib import Callback

    class Adds(Callback):
        record_names = ("grad_norm",)

    m = Monitor("grad_norm", mode="min")
    m.start(Metrics([]), None, Metrics([accuracy]), [Adds()])
    Monitor("train_accuracy").start(Metrics([]), None, Metrics([accuracy]), [])
    with pytest.raises(ValueError, match="record_names"):
        Monitor("grad_norm", mode="min").start(Metrics([]), None, None, [])


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


def test_a_relative_min_delta_asks_for_a_fraction_of_the_best_in_min_mode():
    m = Monitor("valid_loss", min_delta=0.1, min_delta_mode="rel")
    assert m.update(2.0)  # anything beats the start (inf), also in rel mode
    assert not m.update(1.8)  # 10% of 2.0 exactly: not more
    assert not m.update(1.85) and m.best == 2.0
    assert m.update(1.79) and m.best == 1.79
    assert not m.update(1.7)  # 1.79 * 0.9 = 1.611 is the bar now


def test_a_relative_min_delta_in_max_mode_and_for_negative_values():
    m = Monitor("accuracy", min_delta=0.5, min_delta_mode="rel")
    assert m.update(0.2) and not m.update(0.3) and m.update(0.31)
    # A negative best: the bar is 10% of its size better, never worse (torch's
    # best * (1 - d) would take -9.5 as an improvement on -10).
    neg = Monitor("valid_loss", min_delta=0.1, min_delta_mode="rel")
    assert neg.update(-10.0)
    assert not neg.update(-9.5) and not neg.update(-10.9)
    assert neg.update(-11.1) and neg.best == -11.1


def test_an_absolute_min_delta_is_the_default_and_a_bad_delta_mode_raises():
    assert Monitor("valid_loss").min_delta_mode == "abs"
    with pytest.raises(ValueError, match=r"EarlyStopping: min_delta_mode must be "
                       r"one of \('abs', 'rel'\); got 'relative'"):  # fmt: skip
        Monitor("valid_loss", min_delta_mode="relative", owner="EarlyStopping")


@pytest.mark.parametrize("mode", ["min", "max"])
def test_beats_compares_strictly_in_the_modes_direction(mode):
    m = Monitor("x", mode=mode)
    better, worse = (1.0, 2.0) if mode == "min" else (2.0, 1.0)
    assert m.beats(better, worse) and not m.beats(worse, better)
    assert not m.beats(1.0, 1.0) and not m.beats(math.nan, 5.0)


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


@pytest.mark.parametrize(
    "make",
    [
        lambda tmp: ReduceLROnPlateau("valid_size", mode="min"),
        lambda tmp: Checkpoint(tmp, monitor="valid_size", mode="min"),
        lambda tmp: EarlyStopping("valid_size", mode="min"),
    ],
    ids=["ReduceLROnPlateau", "Checkpoint", "EarlyStopping"],
)
def test_every_monitor_knows_the_losss_declared_parts_before_training(make, tmp_path):
    def loss(out, y):
        ce = F.cross_entropy(out, y)
        return {"loss": ce, "ce": ce}

    loss.part_names = ("ce",)
    model = make_model()
    before = clone_params(model)
    with pytest.raises(ValueError, match=r"'valid_size' is not computed"):
        fit(1, model, loss, HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1),
            make_data(), callbacks=[make(tmp_path)])  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_mode_auto_takes_a_part_of_the_loss_as_a_loss():
    from fitlib.losses import LossDict

    losses = LossDict({"a": F.cross_entropy, "b": F.mse_loss})
    part = Monitor("valid_b")  # "b" says no direction: the loss decides
    part.start(None, loss_func=losses)
    assert part.mode == "min" and part.best == math.inf
    with pytest.raises(ValueError, match="'valid_c' is not computed"):
        Monitor("valid_c").start(None, loss_func=losses)
    undeclared = Monitor("valid_c")  # a loss without part_names: not a part
    with pytest.raises(ValueError, match=r"mode='auto' cannot tell.*'valid_c'"):
        undeclared.start(None, loss_func=F.cross_entropy)
    with pytest.raises(ValueError, match=r"mode='auto' cannot tell.*'speed'"):
        Monitor("speed")  # no prefix: refused as it is made
