import functools
import math

import pytest
import torch
from sklearn import metrics as skm

from fitlib.metrics import (
    RMSE,
    F1Score,
    FBeta,
    Metric,
    Metrics,
    R2Score,
    accuracy,
    as_metric,
    error_rate,
    mae,
    mse,
    top_k_accuracy,
)

SIZES = [7, 7, 3]  # ragged last batch on purpose


def run(metrics, out, y, sizes=SIZES):
    """Feed `out`, `y` through a Metrics in batches; return the values as floats."""
    ms = metrics if isinstance(metrics, Metrics) else Metrics(metrics)
    ms.reset()
    for o, t in zip(out.split(sizes), y.split(sizes), strict=True):
        ms.update(o, (t,))
    return [v.item() for v in ms.compute()]


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def multiclass(gen, n=17, c=4):
    return torch.randn(n, c, generator=gen), torch.randint(0, c, (n,), generator=gen)


def regression(gen, n=17, d=None):
    shape = (n,) if d is None else (n, d)
    y = torch.randn(shape, generator=gen)
    return y + 0.5 * torch.randn(shape, generator=gen), y


def test_accuracy_and_error_rate_match_sklearn_over_ragged_batches(gen):
    out, y = multiclass(gen)
    acc = skm.accuracy_score(y, out.argmax(-1))
    assert run([accuracy, error_rate], out, y) == pytest.approx([acc, 1 - acc])


def test_accuracy_treats_single_logit_column_as_binary(gen):
    out = torch.randn(17, 1, generator=gen)
    y = torch.randint(0, 2, (17,), generator=gen).float()
    expected = skm.accuracy_score(y, (out[:, 0] > 0).long())
    assert run([accuracy], out, y) == pytest.approx([expected])


def test_top_k_accuracy_matches_sklearn(gen):
    out, y = multiclass(gen, c=6)
    expected = skm.top_k_accuracy_score(y, out, k=3, labels=range(6))
    ms = Metrics([functools.partial(top_k_accuracy, k=3)])
    assert ms.names == ["top_k_accuracy"]
    assert run(ms, out, y) == pytest.approx([expected])


def test_top_k_accuracy_rejects_k_not_below_class_count(gen):
    out, y = multiclass(gen, c=3)
    with pytest.raises(ValueError, match="k=5"):
        top_k_accuracy(out, y)


def test_mse_and_mae_compare_column_output_with_flat_targets(gen):
    out, y = regression(gen)
    got = run([mse, mae], out.unsqueeze(1), y)
    expected = [skm.mean_squared_error(y, out), skm.mean_absolute_error(y, out)]
    assert got == pytest.approx(expected)


def test_regression_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"\(4, 2\).*\(4,\)"):
        mse(torch.zeros(4, 2), torch.zeros(4))


@pytest.mark.parametrize("d", [None, 3])
def test_rmse_and_r2_match_sklearn_over_whole_set(gen, d):
    out, y = regression(gen, d=d)
    expected = [skm.root_mean_squared_error(y, out), skm.r2_score(y, out)]
    assert run([RMSE(), R2Score()], out, y) == pytest.approx(expected)


def test_r2_is_not_an_average_of_per_batch_scores(gen):
    # Shifted batch means make per-batch R2 very different from whole-set R2.
    out, y = regression(gen)
    y[7:] += 10.0
    out[7:] += 10.0
    assert run([R2Score()], out, y) == pytest.approx([skm.r2_score(y, out)])


def test_r2_of_constant_target_follows_sklearn():
    y = torch.full((5,), 2.0)
    assert run([R2Score()], y.clone(), y, (3, 2)) == [1.0]
    assert run([R2Score()], y + 1, y, (3, 2)) == [0.0]


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


def test_average_is_per_sample_not_per_batch():
    out = torch.tensor([[0.0, 1.0]] * 4 + [[1.0, 0.0]])
    y = torch.ones(5, dtype=torch.long)
    # Batches of 4 (all right) and 1 (wrong): per-sample 0.8, per-batch 0.5.
    assert run([accuracy], out, y, (4, 1)) == pytest.approx([0.8])


def binary_and_regression_metrics():
    return Metrics([accuracy, F1Score(), RMSE(), R2Score()])


def test_reset_clears_state_so_a_second_pass_matches_a_fresh_one(gen):
    # One logit column: a binary score for accuracy/F1, a value for RMSE/R2.
    first, second = regression(gen), regression(gen)
    ms = binary_and_regression_metrics()
    run(ms, first[0][:, None], (first[1] > 0).float())
    reused = run(ms, second[0][:, None], (second[1] > 0).float())
    fresh = run(
        binary_and_regression_metrics(), second[0][:, None], (second[1] > 0).float()
    )
    assert reused == fresh
    ms.reset()
    with pytest.raises(RuntimeError, match=r"accuracy.*no data"):
        ms.compute()


def workload(gen, n_batches, device="cpu"):
    """Classification and regression Metrics, each with its batches."""
    top2 = functools.partial(top_k_accuracy, k=2)
    cls = Metrics([accuracy, error_rate, top2, F1Score(), FBeta(2.0, "micro")])
    reg = Metrics([mse, mae, RMSE(), R2Score()])
    batches = []
    for _ in range(n_batches):
        out, y = multiclass(gen, n=32, c=4)
        val, target = regression(gen, n=32)
        batch = (out, y, val[:, None], target)
        batches.append([t.to(device) for t in batch])
    return cls, reg, batches


def feed(cls, reg, batches):
    for out, y, val, target in batches:
        cls.update(out, (y,))
        reg.update(val, (target,))
    return cls.compute() + reg.compute()


SYNC_CALLS = ["item", "__float__", "__int__", "__bool__", "tolist", "cpu", "nonzero"]


def test_update_and_compute_never_sync(gen, monkeypatch):
    cls, reg, batches = workload(gen, 50)
    calls = []

    def spy(owner, name):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    for name in SYNC_CALLS:
        spy(torch.Tensor, name)
    spy(torch, "bincount")
    values = feed(cls, reg, batches)
    monkeypatch.undo()
    assert calls == []
    assert len(values) == 9 and all(v.ndim == 0 for v in values)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_update_and_compute_never_sync_on_cuda(gen):
    cls, reg, batches = workload(gen, 5, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        values = feed(cls, reg, batches)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(v.device.type == "cuda" and v.ndim == 0 for v in values)


def test_failing_metric_error_names_metric_and_shapes():
    ms = Metrics([accuracy])
    with pytest.raises(ValueError, match=r"metric 'accuracy'.*\(8, 3\).*\(5,\)"):
        ms.update(torch.randn(8, 3), (torch.zeros(5, dtype=torch.long),))


def test_failing_metric_with_its_own_exception_type_keeps_it_and_gets_a_note():
    def lookup(out, y):
        raise KeyError("nope")

    with pytest.raises(KeyError, match="nope") as info:
        Metrics([lookup]).update(torch.zeros(2, 2), (torch.zeros(2),))
    assert any(
        "metric 'lookup' failed" in n and "Fix" in n for n in info.value.__notes__
    )


@pytest.mark.parametrize("bad", [42, "accuracy", int])
def test_as_metric_rejects_non_metrics(bad):
    with pytest.raises(TypeError, match=r"metrics.*Fix"):
        as_metric(bad)


def test_metrics_rejects_a_bare_function():
    with pytest.raises(TypeError, match=r"metrics must be a list.*metrics=\["):
        Metrics(accuracy)


def test_as_metric_accepts_instances_classes_and_functions():
    rmse = RMSE()
    assert as_metric(rmse) is rmse
    assert isinstance(as_metric(R2Score), R2Score)
    assert as_metric(mae).name == "mae"
    assert isinstance(as_metric(accuracy), Metric)


def test_torchmetrics_adapter_matches_accuracy(gen):
    classification = pytest.importorskip("torchmetrics.classification")
    out, y = multiclass(gen, c=3)
    ms = Metrics([classification.MulticlassAccuracy(num_classes=3, average="micro")])
    assert ms.names == ["multiclass_accuracy"]
    assert run(ms, out, y) == pytest.approx(run([accuracy], out, y))


def test_duplicate_names_get_suffixes():
    ms = Metrics([accuracy, F1Score(), accuracy, FBeta(1.0), accuracy])
    assert ms.names == [
        "accuracy",
        "f1_score",
        "accuracy_2",
        "f1_score_2",
        "accuracy_3",
    ]


def test_empty_metrics_is_falsy():
    assert not Metrics(None) and len(Metrics([])) == 0
    assert len(Metrics([accuracy, mse])) == 2
