import functools

import pytest
import torch
from metric_data import multiclass, regression, run

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


@pytest.mark.cuda
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


def test_batches_added_after_load_sums_count_with_the_loaded_sums():
    from fitlib.metrics import accuracy
    from fitlib.metrics.accumulate import AvgMetric

    m = AvgMetric(accuracy)
    m.load_sums([torch.tensor([3.0, 4.0], dtype=torch.float64)])  # 3 of 4 right
    m.update(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), torch.tensor([1, 1]))  # 1 of 2
    assert m.compute().item() == 4 / 6
    assert m.sums()[0].tolist() == [4.0, 6.0]
