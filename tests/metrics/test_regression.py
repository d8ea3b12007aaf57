import pytest
import torch
from metric_data import regression, run
from sklearn import metrics as skm

from fitlib.metrics import (
    RMSE,
    R2Score,
)


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
