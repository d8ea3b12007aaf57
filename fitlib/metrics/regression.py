"""Regression scores computed over the whole set: ``RMSE``, ``R2Score``."""

import math

import torch
from torch import Tensor

from fitlib.metrics.accumulate import Metric, accumulation_dtype
from fitlib.metrics.functions import _regression_pair


class _ColumnMetric(Metric):
    """Shared state for regression metrics computed per output column."""

    def reset(self) -> None:
        self.n = 0
        self.state: dict[str, Tensor] = {}

    def _columns(self, output: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        o, t = _regression_pair(output, y, self.name)
        dtype = accumulation_dtype(output.device)
        o, t = o.reshape(t.shape[0], -1).to(dtype), t.reshape(t.shape[0], -1).to(dtype)
        if not self.state:
            self.state = {k: t.new_zeros(t.shape[1]) for k in ("sse", "mean", "m2")}
        elif t.shape[1] != self.state["sse"].shape[0]:
            raise ValueError(
                f"{self.name}: {t.shape[1]} target columns, but earlier batches had "
                f"{self.state['sse'].shape[0]}. Fix: keep the target shape fixed, "
                "or reset() between data sets."
            )
        return o, t


class RMSE(_ColumnMetric):
    """Root mean squared error over the whole set.

    Multi-output targets average the per-column RMSE, like scikit-learn.

    Example:
        >>> m = RMSE()
        >>> m.update(torch.tensor([[1.0], [3.0]]), torch.tensor([1.0, 1.0]))
        >>> m.compute()
        tensor(1.4142, dtype=torch.float64)
    """

    name = "rmse"

    def update(self, output: Tensor, *targets: Tensor) -> None:
        o, t = self._columns(output, targets[0])
        self.state["sse"] += (o - t).pow(2).sum(0)
        self.n += t.shape[0]

    def compute(self) -> Tensor:
        if self.n == 0:
            raise self._no_data()
        return (self.state["sse"] / self.n).sqrt().mean()


class R2Score(_ColumnMetric):
    """Coefficient of determination 1 - SS_res / SS_tot over the whole set.

    As in scikit-learn: multi-output averages columns uniformly, a constant
    column scores 1 if predicted exactly else 0, fewer than 2 samples give nan.

    Example:
        >>> m = R2Score()
        >>> m.update(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 4.0]))
        >>> m.compute()
        tensor(0.7857, dtype=torch.float64)
    """

    name = "r2_score"

    def update(self, output: Tensor, *targets: Tensor) -> None:
        o, t = self._columns(output, targets[0])
        nb = t.shape[0]
        if nb == 0:
            return
        s, n = self.state, self.n + nb
        mean_b = t.mean(0)
        delta = mean_b - s["mean"]
        s["m2"] += (t - mean_b).pow(2).sum(0) + delta.pow(2) * (self.n * nb / n)
        s["mean"] += delta * (nb / n)
        s["sse"] += (o - t).pow(2).sum(0)
        self.n = n

    def compute(self) -> Tensor:
        if self.n == 0:
            raise self._no_data()
        sse, ss_tot = self.state["sse"], self.state["m2"]
        if self.n < 2:
            return sse.new_full((), math.nan)  # a fill, not a host-to-device copy
        r2 = torch.where(ss_tot > 0, 1 - sse / ss_tot, (sse == 0).to(sse.dtype))
        return r2.mean()
