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
from fitlib.metrics.classification import (
    Accuracy,
    Dice,
    ErrorRate,
    F1Score,
    FBeta,
    MeanIoU,
    Perplexity,
    TokenAccuracy,
)
from fitlib.metrics.collection import Metrics, Part, as_metric
from fitlib.metrics.functions import (
    accuracy,
    error_rate,
    find_class_dim,
    mae,
    mse,
    top_k_accuracy,
)
from fitlib.metrics.regression import RMSE, R2Score

__all__ = [
    "RMSE",
    "Accuracy",
    "AvgMetric",
    "Dice",
    "ErrorRate",
    "F1Score",
    "FBeta",
    "MeanIoU",
    "Metric",
    "Metrics",
    "Part",
    "Perplexity",
    "R2Score",
    "TokenAccuracy",
    "accumulation_dtype",
    "accuracy",
    "as_metric",
    "error_rate",
    "find_class_dim",
    "mae",
    "mse",
    "top_k_accuracy",
    "weighted_sum",
]
