"""Regression scores computed over the whole set: ``RMSE``, ``R2Score``."""

import math

import torch
from torch import Tensor

from fitlib.metrics.accumulate import Metric, accumulation_dtype
from fitlib.metrics.functions import regression_pair


class _ColumnMetric(Metric):
    """Shared state for regression metrics computed per output column."""

    def reset(self) -> None:
        self.n = 0
        self.state: dict[str, Tensor] = {}
        self.total: Tensor | None = None  # sample count of every process

    def _state_or_fail(self) -> dict[str, Tensor]:
        # The column count comes from the first batch: a process without one
        # cannot take part (distributed training gives each one a batch).
        if self.n == 0:
            raise self._no_local_data()
        return self.state

    def _columns(self, output: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        o, t = regression_pair(output, y, self.name)
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

    Examples:
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
        if self.total is not None:
            return (self.state["sse"] / self.total).sqrt().mean()
        if self.n == 0:
            raise self._no_data()
        return (self.state["sse"] / self.n).sqrt().mean()

    def sums(self) -> list[Tensor]:
        sse = self._state_or_fail()["sse"]
        return [sse, sse.new_full((), self.n)]

    def load_sums(self, sums: list[Tensor]) -> None:
        self.state["sse"], self.total = sums


class R2Score(_ColumnMetric):
    """Coefficient of determination 1 - SS_res / SS_tot over the whole set.

    As in scikit-learn: multi-output averages columns uniformly, a constant
    column scores 1 if predicted exactly else 0, fewer than 2 samples give nan.

    Examples:
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
        if self.total is None and self.n == 0:
            raise self._no_data()
        sse, ss_tot = self.state["sse"], self.state["m2"]
        nan = sse.new_full((), math.nan)  # a fill, not a host-to-device copy
        if self.total is None and self.n < 2:
            return nan
        r2 = torch.where(ss_tot > 0, 1 - sse / ss_tot, (sse == 0).to(sse.dtype))
        if self.total is not None:  # the count is on the device: no `if`
            return torch.where(self.total < 2, nan, r2.mean())
        return r2.mean()

    def sums(self) -> list[Tensor]:
        # Mean and m2 do not add up across processes; n * mean (the sum of
        # the targets) and m2 + n * mean**2 (the sum of their squares) do.
        s = self._state_or_fail()
        n_mean = s["mean"] * self.n
        count = s["sse"].new_full((), self.n)
        return [s["sse"], n_mean, s["m2"] + n_mean * s["mean"], count]

    def load_sums(self, sums: list[Tensor]) -> None:
        sse, n_mean, sq, self.total = sums
        mean = n_mean / self.total
        # The one cancellation of the reduction: float64 keeps it far below
        # the scores' precision unless |mean| >> std.
        m2 = (sq - n_mean * mean).clamp(min=0)
        self.state = {"sse": sse, "mean": mean, "m2": m2}
