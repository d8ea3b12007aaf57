"""How metrics accumulate on the device over a whole validation set.

``update`` never forces a host-device sync (the loop keeps queueing batches);
only the final values reach Python, once per epoch, through the caller.
"""

import re
from collections.abc import Callable
from typing import NoReturn

import torch
from torch import Tensor

from fitlib.errors import describe, name_of, reraise


def accumulation_dtype(device: torch.device) -> torch.dtype:
    """The dtype sums over a data set are kept in on ``device``."""
    # float64 keeps long sums exact enough to match scikit-learn; MPS has none.
    return torch.float32 if device.type == "mps" else torch.float64


def weighted_sum(values: list[Tensor], weights: list[int]) -> Tensor:
    """``sum(w * v)`` of 0-dim device tensors, in the accumulation dtype.

    Called once per data set, not per batch: a batch only appends its value,
    which costs less than a device op. Values are grouped by weight (full
    batches, then a ragged last one), so the weights never need a
    host-to-device copy, which could wait for the device.
    """
    groups: dict[int, list[Tensor]] = {}
    for v, w in zip(values, weights, strict=True):
        groups.setdefault(w, []).append(v)
    dtype = accumulation_dtype(values[0].device)
    return sum(torch.stack(vs).to(dtype).sum() * w for w, vs in groups.items())


def _snake_case(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


class Metric:
    """Base for metrics accumulated on the device over a whole validation set.

    Subclasses set `name` and implement `reset`, `update` (once per batch,
    device-side only, never a host sync) and `compute` (a 0-dim device tensor).

    Example:
        >>> isinstance(as_metric(accuracy), Metric)
        True
    """

    name: str = "metric"

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        raise NotImplementedError

    def update(self, output: Tensor, *targets: Tensor) -> None:
        raise NotImplementedError

    def compute(self) -> Tensor:
        raise NotImplementedError

    def _no_data(self) -> RuntimeError:
        return RuntimeError(
            f"{self.name} has no data. Fix: call update() with a non-empty batch "
            "before compute()."
        )


class AvgMetric(Metric):
    """Exact per-sample average of a function that returns a batch mean.

    Example:
        >>> m = AvgMetric(accuracy)
        >>> m.update(torch.tensor([[0.0, 1.0]]), torch.tensor([1]))
        >>> m.compute()
        tensor(1., dtype=torch.float64)
    """

    def __init__(self, func: Callable[..., Tensor]) -> None:
        self.func = func
        self.name = name_of(func)
        super().__init__()

    def reset(self) -> None:
        self.values: list[Tensor] = []  # batch means, summed in compute()
        self.sizes: list[int] = []

    def update(self, output: Tensor, *targets: Tensor) -> None:
        ref = targets[0] if targets and targets[0].ndim > 0 else output
        n = ref.shape[0]
        if n == 0:  # an empty batch's mean is nan and would poison the total
            return
        val = self.func(output, *targets)
        if not isinstance(val, Tensor):
            val = torch.as_tensor(val, device=output.device)
        if val.ndim != 0:
            raise ValueError(
                f"{self.name} returned shape {tuple(val.shape)}, not a batch mean. "
                "Fix: return a 0-dim tensor, e.g. per_sample.mean()."
            )
        if val.requires_grad:  # only outside no_grad; validation never pays it
            val = val.detach()
        self.values.append(val)
        self.sizes.append(n)

    def compute(self) -> Tensor:
        if not self.values:
            raise self._no_data()
        return weighted_sum(self.values, self.sizes) / sum(self.sizes)


class _TorchMetricAdapter(Metric):
    """Wraps a torchmetrics.Metric, moved to the output's device on update.

    torchmetrics checks its inputs with a host sync unless built with
    `validate_args=False`.
    """

    def __init__(self, metric: object) -> None:
        self.metric = metric
        self.name = _snake_case(type(metric).__name__)
        self.device: torch.device | None = None

    def reset(self) -> None:
        self.metric.reset()

    def update(self, output: Tensor, *targets: Tensor) -> None:
        if output.device != self.device:
            self.metric.to(output.device)
            self.device = output.device
        self.metric.update(output, *targets)

    def compute(self) -> Tensor:
        return self.metric.compute()


def _bad_metric(m: object, why: str) -> TypeError:
    return TypeError(
        f"metrics: cannot use {m!r} (type {type(m).__name__}) as a metric: {why}. "
        "Fix: pass a function f(output, *targets) -> batch mean, a fitlib Metric "
        "(instance or class) or a torchmetrics.Metric instance."
    )


def _is_torchmetric(m: object) -> bool:
    return all(callable(getattr(m, a, None)) for a in ("update", "compute", "reset"))


def as_metric(m: object) -> Metric:
    """Turn anything accepted in `metrics=[...]` into a `Metric`.

    Example:
        >>> as_metric(accuracy).name, as_metric(RMSE).name
        ('accuracy', 'rmse')
    """
    if isinstance(m, Metric):
        return m
    if isinstance(m, type):
        if not issubclass(m, Metric):
            raise _bad_metric(m, "it is a class; pass an instance")
        try:
            return m()
        except TypeError as e:
            raise _bad_metric(m, f"it needs arguments ({e}); pass an instance") from e
    if _is_torchmetric(m):
        return _TorchMetricAdapter(m)
    if callable(m):
        return AvgMetric(m)
    raise _bad_metric(m, "it is not callable")


def _unique(names: list[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        i, new = 1, name
        while new in out:
            i, new = i + 1, f"{name}_{i + 1}"
        out.append(new)
    return out


class Metrics:
    """The list of metrics of one run; what `core.validate` uses.

    Example:
        >>> ms = Metrics([accuracy, accuracy])
        >>> ms.names
        ['accuracy', 'accuracy_2']
        >>> ms.update(torch.tensor([[0.0, 1.0]]), (torch.tensor([1]),))
        >>> ms.compute()
        [tensor(1., dtype=torch.float64), tensor(1., dtype=torch.float64)]
    """

    def __init__(self, metrics: list | None) -> None:
        if metrics is None:
            metrics = []
        if not isinstance(metrics, (list, tuple)):
            got = f"{describe(metrics)} ({type(metrics).__name__})"
            raise TypeError(
                f"metrics must be a list, got {got}. Fix: metrics=[accuracy, ...]."
            )
        self.metrics = [as_metric(m) for m in metrics]
        self.names: list[str] = _unique([m.name for m in self.metrics])

    def reset(self) -> None:
        for m in self.metrics:
            m.reset()

    def update(self, output: Tensor, targets: tuple) -> None:
        if not isinstance(targets, (tuple, list)):
            raise TypeError(f"targets must be a tuple, got {describe(targets)}.")
        for name, m in zip(self.names, self.metrics, strict=True):
            try:
                m.update(output, *targets)
            except Exception as e:
                where = f"on output {describe(output)} and targets {describe(targets)}"
                _reraise(name, where, e)

    def compute(self) -> list[Tensor]:
        values = []
        for name, m in zip(self.names, self.metrics, strict=True):
            try:
                values.append(m.compute())
            except Exception as e:
                _reraise(name, "in compute()", e)
        return values

    def __len__(self) -> int:
        return len(self.metrics)

    def __bool__(self) -> bool:
        return bool(self.metrics)


def _reraise(name: str, where: str, e: Exception) -> NoReturn:
    fix = (
        ""
        if "Fix:" in str(e)
        else (
            " Fix: check the output and target shapes and dtypes this metric "
            "expects, or remove it from `metrics`."
        )
    )
    reraise(e, f"metric '{name}' failed {where}.{fix}")
