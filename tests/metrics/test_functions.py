import functools

import pytest
import torch
from metric_data import multiclass, regression, run
from sklearn import metrics as skm

from fitlib.metrics import (
    Metrics,
    accuracy,
    error_rate,
    mae,
    mse,
    top_k_accuracy,
)


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


def test_average_is_per_sample_not_per_batch():
    out = torch.tensor([[0.0, 1.0]] * 4 + [[1.0, 0.0]])
    y = torch.ones(5, dtype=torch.long)
    # Batches of 4 (all right) and 1 (wrong): per-sample 0.8, per-batch 0.5.
    assert run([accuracy], out, y, (4, 1)) == pytest.approx([0.8])


# -- class metrics refuse regression targets -------------------------------------
def regression_loaders():
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, generator=g)
    y = (x.sum(1, keepdim=True) * 1.7).round(decimals=2)  # floats like 1.23
    return DataLoader(TensorDataset(x, y), 16)


@pytest.mark.parametrize("metric", ["accuracy", "error_rate", "f1"])
def test_class_metrics_on_regression_targets_are_refused(metric):
    from torch import nn
    from torch.nn import functional as F  # noqa: N812

    from fitlib import validate
    from fitlib.metrics import F1Score, accuracy, error_rate

    m = {"accuracy": accuracy, "error_rate": error_rate, "f1": F1Score()}[metric]
    name = "f1_score" if metric == "f1" else metric
    with pytest.raises(ValueError, match=rf"{name} scores class predictions.*R2Score"):
        validate(nn.Linear(3, 1), regression_loaders(), F.mse_loss, metrics=[m])


def test_class_metrics_take_float_labels_that_are_whole_numbers():
    from fitlib.metrics import Metrics, accuracy

    ms = Metrics([accuracy])
    out, y = torch.tensor([[2.0], [-1.0]]), torch.tensor([[1.0], [0.0]])
    ms.check(out, (y,))  # 0/1 labels as floats (BCE): fine
    ms.update(out, (y,))
    assert ms.compute()[0].item() == 1.0


@pytest.mark.parametrize(
    "out, y, shown",
    [
        (torch.randn(4, 1), torch.tensor([151.0, 75, 141, 206]), "151"),  # regression
        (torch.randn(4, 3), torch.tensor([0, 1, 2, 3]), "3"),  # a 4th class
        (torch.randn(4, 3), torch.tensor([0, -100, 2, 1]), "-100"),  # padding
    ],
)
def test_class_metrics_refuse_labels_the_output_cannot_score(out, y, shown):
    from fitlib.metrics import F1Score

    for metric in (accuracy, F1Score()):
        with pytest.raises(ValueError, match=rf"targets hold {shown}, outside it"):
            Metrics([metric]).check(out, (y,))


def test_the_class_dim_ambiguity_fix_names_the_class_or_the_function():
    from fitlib.metrics import MeanIoU
    from fitlib.metrics.functions import swap_class_dims

    out, y = torch.randn(2, 5, 5), torch.randint(0, 5, (2, 5))
    outer = swap_class_dims({})  # as in a fit: nothing decided yet
    try:
        with pytest.raises(ValueError, match=r"MeanIoU\(class_dim=1\)") as e:
            MeanIoU().check_inputs(out, y)
        assert "partial(" not in str(e.value)
        with pytest.raises(ValueError, match=r"partial\(accuracy, class_dim=-1\)"):
            accuracy(out, y)
    finally:
        swap_class_dims(outer)


def test_a_metric_class_predicting_classes_names_itself_in_the_ambiguity_fix():
    from fitlib.metrics import Accuracy, F1Score
    from fitlib.metrics.functions import swap_class_dims

    out, y = torch.randn(2, 5, 5), torch.randint(0, 5, (2, 5))
    outer = swap_class_dims({})
    try:
        for metric in (Accuracy(), F1Score()):
            owner = type(metric).__name__
            with pytest.raises(ValueError, match=rf"{owner}\(class_dim=1\)") as e:
                metric.update(out, y)
            assert "partial(" not in str(e.value)
    finally:
        swap_class_dims(outer)
