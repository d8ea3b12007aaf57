import math

import pytest
import torch
from metric_data import multiclass, run
from sklearn import metrics as skm

from fitlib.metrics import (
    F1Score,
    FBeta,
    Metrics,
)


@pytest.mark.parametrize("average", ["macro", "micro"])
@pytest.mark.parametrize("beta", [1.0, 2.0])
def test_fbeta_multiclass_matches_sklearn(gen, average, beta):
    out, y = multiclass(gen, n=40)
    pred = out.argmax(-1)
    expected = skm.fbeta_score(y, pred, beta=beta, average=average, zero_division=0)
    got = run([FBeta(beta, average)], out, y, (16, 16, 8))
    assert got == pytest.approx([expected])


@pytest.mark.parametrize("beta", [0.5, 1.0, 2.0])
def test_fbeta_binary_matches_sklearn(gen, beta):
    out = torch.randn(17, generator=gen)
    y = torch.randint(0, 2, (17,), generator=gen)
    expected = skm.fbeta_score(y, (out > 0).long(), beta=beta, zero_division=0)
    assert run([FBeta(beta, "binary")], out, y) == pytest.approx([expected])


def test_f1_binary_accepts_two_class_columns(gen):
    out, y = multiclass(gen, c=2)
    expected = skm.f1_score(y, out.argmax(-1))
    assert run([F1Score("binary")], out, y) == pytest.approx([expected])


def test_macro_f1_skips_classes_absent_from_targets_and_predictions(gen):
    out, y = multiclass(gen, c=5)
    out[:, 4] = -100.0  # class 4 is never predicted and never a target
    y[y == 4] = 0
    expected = skm.f1_score(y, out.argmax(-1), average="macro", zero_division=0)
    assert run([F1Score()], out, y) == pytest.approx([expected])


def test_fbeta_out_of_range_target_makes_result_nan(gen):
    out, y = multiclass(gen, c=3)
    y[2] = 7
    assert math.isnan(run([F1Score()], out, y)[0])


def test_fbeta_names():
    assert F1Score().name == "f1_score"
    assert FBeta(2.0).name == "f2_score"
    assert FBeta(0.5).name == "f0.5_score"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"beta": 0.0}, "beta.*0.0"),
        ({"beta": True}, "beta.*True"),
        ({"average": "weighted"}, "average.*'binary', 'macro', 'micro'"),
        ({"num_classes": 1}, "num_classes.*1"),
    ],
)
def test_fbeta_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FBeta(**kwargs)


def test_binary_fbeta_rejects_multiclass_output(gen):
    out, y = multiclass(gen, c=3)
    with pytest.raises(ValueError, match=r"f1_score.*binary"):
        Metrics([F1Score("binary")]).update(out, (y,))
