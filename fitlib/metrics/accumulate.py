"""How metrics accumulate on the device over a whole validation set.

``update`` never forces a host-device sync (the loop keeps queueing batches);
only the final values reach Python, once per epoch, through the caller.

Across processes (distributed validation, each process holding a shard of the
set), every metric gives its state as ``sums()``: tensors that add up over the
processes. ``load_sums`` takes their element-wise total, and ``compute()``
then gives the value over the whole set. ``Metrics.reduce`` does the adding.
"""

import re
from collections.abc import Callable

import torch
from torch import Tensor

from fitlib.errors import name_of
from fitlib.structure import tensors


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
    To take part in distributed validation they also implement `sums` and
    `load_sums`, such that `compute()` after `load_sums(total)`, where `total`
    is the element-wise sum of every process's `sums()`, equals `compute()` of
    one metric updated with all the data.

    Examples:
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

    def check_inputs(self, output: Tensor, *targets: Tensor) -> None:
        """Raises a clear error for inputs this metric would score wrongly.

        Called on the first validation batch of a fit, unlike ``update`` it may
        read values from the device (one sync). Does nothing by default.
        """

    def sums(self) -> list[Tensor]:
        """This process's state as tensors that add up across processes."""
        raise NotImplementedError(self._no_sums())

    def load_sums(self, sums: list[Tensor]) -> None:
        """Replaces the state by `sums()` summed over every process.

        `sums` has the shapes `sums()` gave, in the accumulation dtype; the
        next call is `compute()` (or `reset()`).
        """
        raise NotImplementedError(self._no_sums())

    def check_sums(self) -> None:
        """Raises a TypeError, before any data, if `sums` cannot work."""
        own = type(self)
        if own.sums is Metric.sums or own.load_sums is Metric.load_sums:
            raise TypeError(self._no_sums())

    def _no_sums(self) -> str:
        return (
            f"{type(self).__name__} cannot be summed across processes: it does "
            "not implement sums() and load_sums(). Fix: implement them "
            "(sums() returns the state as tensors that add up over processes, "
            "e.g. [sum_of_values, count]; load_sums(totals) puts the totals "
            "back for compute()), or leave this metric out of distributed runs."
        )

    def _no_local_data(self) -> RuntimeError:
        return RuntimeError(
            f"{self.name} has no data in this process, so the size of its state "
            "is unknown and it cannot be summed across processes. Fix: give "
            "every process at least one validation batch (fewer processes, or "
            "more validation data)."
        )

    def _no_data(self) -> RuntimeError:
        return RuntimeError(
            f"{self.name} has no data. Fix: call update() with a non-empty batch "
            "before compute()."
        )


class AvgMetric(Metric):
    """Exact per-sample average of a function that returns a batch mean.

    Examples:
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
        self.total: list[Tensor] | None = None  # [sum, count] from load_sums

    def check_inputs(self, output: Tensor, *targets: Tensor) -> None:
        check = getattr(getattr(self.func, "func", self.func), "check_inputs", None)
        if check is not None:  # accuracy and the like refuse regression targets
            check(self.name, output, *targets)

    def update(self, output: Tensor, *targets: Tensor) -> None:
        ref = next((t for _, t in tensors((targets, output)) if t.ndim), None)
        n = 1 if ref is None else ref.shape[0]
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
        if self.total is not None:  # loaded sums, and batches added since
            total, count = self.sums()[0].unbind()
            return total / count
        if not self.values:
            raise self._no_data()
        return weighted_sum(self.values, self.sizes) / sum(self.sizes)

    def sums(self) -> list[Tensor]:
        loaded = None if self.total is None else torch.stack(self.total)
        if not self.values:  # the shape is known: take part with zeros
            return [torch.zeros(2, dtype=torch.float64) if loaded is None else loaded]
        total = weighted_sum(self.values, self.sizes)
        # A fill, not a host-to-device copy of the count (which would wait).
        pair = torch.stack([total, total.new_full((), sum(self.sizes))])
        return [pair if loaded is None else pair + loaded.to(pair)]

    def load_sums(self, sums: list[Tensor]) -> None:
        self.reset()
        self.total = list(sums[0].unbind())


class TorchMetricAdapter(Metric):
    """Wraps a torchmetrics.Metric, moved to the output's device on update.

    torchmetrics checks its inputs with a host sync unless built with
    `validate_args=False`. Its `sums()` are its states, which must all be
    tensors that torchmetrics itself reduces by summing (counts, sums of
    errors); list states ("cat": AUROC without thresholds...) cannot be summed.
    torchmetrics also syncs its states itself in `compute()` when a process
    group is initialized; after `load_sums` the states already cover every
    process, so that second sync is turned off for that `compute()`.
    """

    def __init__(self, metric: object) -> None:
        self.metric = metric
        self.name = _snake_case(type(metric).__name__)
        self.device: torch.device | None = None
        self.summed = False  # states hold every process's total (load_sums)

    def reset(self) -> None:
        self.metric.reset()
        self.summed = False

    def update(self, output: Tensor, *targets: Tensor) -> None:
        if output.device != self.device:
            self.metric.to(output.device)
            self.device = output.device
        self.metric.update(output, *targets)

    def compute(self) -> Tensor:
        if not self.summed:
            return self.metric.compute()
        # torchmetrics asks this function whether to gather its states over
        # the processes: they are gathered already, so it must say no.
        saved = self.metric.distributed_available_fn
        self.metric.distributed_available_fn = _no_process_group
        try:
            return self.metric.compute()
        finally:
            self.metric.distributed_available_fn = saved

    def sums(self) -> list[Tensor]:
        return [getattr(self.metric, k) for k in self._state_names()]

    def load_sums(self, sums: list[Tensor]) -> None:
        for k, total in zip(self._state_names(), sums, strict=True):
            # Integer counts are exact in the float accumulation dtype.
            setattr(self.metric, k, total.to(getattr(self.metric, k).dtype))
        self.summed = True

    def check_sums(self) -> None:
        self._state_names()

    def _state_names(self) -> list[str]:
        states = self.metric.metric_state
        reductions = getattr(self.metric, "_reductions", {})
        for k, v in states.items():
            how = getattr(reductions.get(k), "__name__", None)
            if not isinstance(v, Tensor) or how != "dim_zero_sum":
                raise TypeError(
                    f"{type(self.metric).__name__} cannot be summed across "
                    f"processes: its state {k!r} is a {type(v).__name__} reduced "
                    f"by {how}, not a tensor reduced by sum. Fix: use a variant "
                    "with count states (e.g. thresholds=... for AUROC), a fitlib "
                    "metric, or leave it out of distributed runs."
                )
        if not states:
            raise TypeError(
                f"{type(self.metric).__name__} has no states of its own (a "
                "composition or collection of metrics?), so fitlib cannot sum "
                "it across processes. Fix: pass each torchmetrics metric alone."
            )
        return list(states)


def _no_process_group() -> bool:
    return False
