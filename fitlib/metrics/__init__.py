"""Metrics: per-batch functions averaged over samples, and scores computed
over the whole validation set; all accumulate on the device.

Any ``f(output, *targets) -> tensor`` (a batch mean) works as a metric, and so
do ``Metric`` subclasses (class or instance) and torchmetrics ``Metric`` objects.
"""

from fitlib.metrics.accumulate import (
    AvgMetric,
    Metric,
    accumulation_dtype,
    weighted_sum,
)
from fitlib.metrics.classification import F1Score, FBeta
from fitlib.metrics.collection import Metrics, as_metric
from fitlib.metrics.functions import accuracy, error_rate, mae, mse, top_k_accuracy
from fitlib.metrics.regression import RMSE, R2Score

__all__ = [
    "RMSE",
    "AvgMetric",
    "F1Score",
    "FBeta",
    "Metric",
    "Metrics",
    "R2Score",
    "accumulation_dtype",
    "accuracy",
    "as_metric",
    "error_rate",
    "mae",
    "mse",
    "top_k_accuracy",
    "weighted_sum",
]
