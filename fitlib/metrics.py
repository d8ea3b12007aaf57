"""Metrics accumulated on the device over a whole validation set.

`update` never forces a host-device sync (the loop keeps queueing batches);
only the final values reach Python, once per epoch, through the caller.
"""

import functools
import math
import re
from collections.abc import Callable

import torch
from torch import Tensor

_WRAP_KEEPS = (TypeError, ValueError, RuntimeError, IndexError)


def _describe(x: object) -> str:
    """Render `x` compactly for error messages, e.g. `Tensor(shape=(64,), int64)`."""
    if isinstance(x, Tensor):
        return f"Tensor(shape={tuple(x.shape)}, {str(x.dtype).removeprefix('torch.')})"
    if isinstance(x, tuple):
        inner = ", ".join(_describe(v) for v in x)
        return f"({inner},)" if len(x) == 1 else f"({inner})"
    if isinstance(x, list):
        return "[" + ", ".join(_describe(v) for v in x) + "]"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in x.items()) + "}"
    text = repr(x)
    return text if len(text) <= 60 else f"{type(x).__name__}(...)"


def _is_number(x: object, above: float, t: type | tuple = (int, float)) -> bool:
    return isinstance(x, t) and not isinstance(x, bool) and x > above


def accumulation_dtype(device: torch.device) -> torch.dtype:
    """The dtype sums over a data set are kept in on ``device``."""
    # float64 keeps long sums exact enough to match scikit-learn; MPS has none.
    return torch.float32 if device.type == "mps" else torch.float64


def _snake_case(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def _match(pred: Tensor, y: Tensor, fname: str) -> Tensor:
    """Reshape `pred` like `y`; refuse shapes that would silently broadcast."""
    if pred.shape == y.shape:
        return pred
    lead_ok = pred.ndim == 0 or y.ndim == 0 or pred.shape[0] == y.shape[0]
    if pred.numel() != y.numel() or not lead_ok:
        raise ValueError(
            f"{fname}: output gives values of shape {tuple(pred.shape)} that do not "
            f"match target shape {tuple(y.shape)}. Fix: make the model return one "
            "value (regression) or one row of class scores per target."
        )
    return pred.reshape(y.shape)


def _pred_classes(out: Tensor) -> tuple[Tensor, int]:
    """Class predictions and class count; one logit column means binary (> 0)."""
    if out.ndim == 0:
        raise ValueError("output is a 0-dim tensor. Fix: return one row per sample.")
    if out.ndim == 1 or out.shape[-1] == 1:
        return (out > 0).long(), 2
    return out.argmax(-1), out.shape[-1]


def _regression_pair(out: Tensor, y: Tensor, fname: str) -> tuple[Tensor, Tensor]:
    dtype = torch.promote_types(out.dtype, torch.float32)
    return _match(out, y, fname).to(dtype), y.to(dtype)


def accuracy(out: Tensor, y: Tensor) -> Tensor:
    """Fraction of correct predictions in a batch.

    Multiclass outputs use argmax over the last dim; a 1-d output or one column
    is a binary logit, predicted positive when > 0.

    Example:
        >>> accuracy(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1]))
        tensor(0.5000)
    """
    pred = _match(_pred_classes(out)[0], y, "accuracy")
    return (pred == y).float().mean()


def top_k_accuracy(out: Tensor, y: Tensor, k: int = 5) -> Tensor:
    """Fraction of targets among the `k` highest scores.

    Example:
        >>> top_k_accuracy(torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([1]), k=2)
        tensor(1.)
    """
    if out.ndim < 2 or out.shape[-1] <= k:
        raise ValueError(
            f"top_k_accuracy: k={k} needs class scores with more than {k} columns, "
            f"got output shape {tuple(out.shape)}. Fix: "
            "functools.partial(top_k_accuracy, k=...) with a smaller k."
        )
    top = out.topk(k, dim=-1).indices
    _match(top[..., 0], y, "top_k_accuracy")  # only to refuse mismatched shapes
    hit = top == y.reshape(top.shape[:-1]).unsqueeze(-1)
    return hit.any(-1).float().mean()


def error_rate(out: Tensor, y: Tensor) -> Tensor:
    """One minus `accuracy`.

    Example:
        >>> error_rate(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1]))
        tensor(0.5000)
    """
    return 1 - accuracy(out, y)


def mse(out: Tensor, y: Tensor) -> Tensor:
    """Mean squared error; an (N, 1) output is compared with (N,) targets.

    Example:
        >>> mse(torch.tensor([[1.0], [3.0]]), torch.tensor([1.0, 1.0]))
        tensor(2.)
    """
    o, t = _regression_pair(out, y, "mse")
    return (o - t).pow(2).mean()


def mae(out: Tensor, y: Tensor) -> Tensor:
    """Mean absolute error; an (N, 1) output is compared with (N,) targets.

    Example:
        >>> mae(torch.tensor([[1.0], [3.0]]), torch.tensor([1.0, 1.0]))
        tensor(1.)
    """
    o, t = _regression_pair(out, y, "mae")
    return (o - t).abs().mean()


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
        inner = func.func if isinstance(func, functools.partial) else func
        self.name = getattr(inner, "__name__", _snake_case(type(inner).__name__))
        super().__init__()

    def reset(self) -> None:
        self.total: Tensor | None = None
        self.count = 0

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
        if self.total is None:
            dtype = accumulation_dtype(output.device)
            self.total = torch.zeros((), dtype=dtype, device=output.device)
        self.total.add_(val.detach(), alpha=n)  # one device op per batch
        self.count += n

    def compute(self) -> Tensor:
        if self.total is None:
            raise self._no_data()
        return self.total / self.count


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


class FBeta(Metric):
    """F-beta score from a confusion matrix accumulated over the whole set.

    Args:
        beta: weight of recall against precision; > 0.
        average: "binary" (F of class 1; one logit per sample, positive when
            > 0, or two class columns), "macro" or "micro".
        num_classes: defaults to the output's last dim (2 for one logit).

    Like scikit-learn's defaults, macro averages the classes seen in targets
    or predictions, and an undefined precision or recall counts as 0.
    Targets outside [0, num_classes) cannot be checked without a sync, so
    they are counted aside and make `compute()` return nan.

    Example:
        >>> m = FBeta(beta=2.0, average="binary")
        >>> m.update(torch.tensor([2.0, -1.0, 3.0]), torch.tensor([1, 1, 0]))
        >>> m.name, m.compute()
        ('f2_score', tensor(0.5000, dtype=torch.float64))
    """

    AVERAGES = ("binary", "macro", "micro")

    def __init__(
        self, beta: float = 1.0, average: str = "macro", num_classes: int | None = None
    ) -> None:
        if not _is_number(beta, above=0):
            raise ValueError(f"beta must be a number > 0, got {beta!r}. Fix: beta=1.0")
        if average not in self.AVERAGES:
            raise ValueError(
                f"average must be one of {self.AVERAGES}, got {average!r}. "
                'Fix: average="macro".'
            )
        if num_classes is not None and not _is_number(num_classes, above=1, t=int):
            raise ValueError(
                f"num_classes must be an int >= 2 or None, got {num_classes!r}. "
                "Fix: num_classes=None takes it from the output."
            )
        self.beta, self.average, self.num_classes = float(beta), average, num_classes
        self.name = f"f{beta:g}_score"
        super().__init__()

    def reset(self) -> None:
        # Flat C*C counts plus one trailing slot for out-of-range targets.
        self.cm: Tensor | None = None
        self.n_cls = 0

    def update(self, output: Tensor, *targets: Tensor) -> None:
        pred, c = _pred_classes(output)
        if self.cm is None:
            self._start(c, output.device)
        if c != self.n_cls:
            raise ValueError(
                f"{self.name}: output has {c} classes, but num_classes or earlier "
                f"batches gave {self.n_cls}. Fix: num_classes = the model's outputs."
            )
        y = targets[0]
        pred = _match(pred, y, self.name).reshape(-1)
        t = y.reshape(-1).long()
        valid = (t >= 0) & (t < self.n_cls)
        if y.is_floating_point():  # 0.5 must not silently truncate to class 0
            valid &= t == y.reshape(-1)
        idx = torch.where(valid, t * self.n_cls + pred, self.n_cls**2)
        self.cm.index_add_(0, idx, torch.ones_like(idx))

    def _start(self, c: int, device: torch.device) -> None:
        self.n_cls = self.num_classes or c
        if self.average == "binary" and self.n_cls != 2:
            raise ValueError(
                f'{self.name}: average="binary" needs 2 classes, got {self.n_cls}. '
                'Fix: average="macro" or "micro".'
            )
        self.cm = torch.zeros(self.n_cls**2 + 1, dtype=torch.long, device=device)

    def compute(self) -> Tensor:
        if self.cm is None:
            raise self._no_data()
        c = self.n_cls
        cm = self.cm[:-1].view(c, c).to(accumulation_dtype(self.cm.device))
        tp = cm.diagonal()
        fp, fn = cm.sum(0) - tp, cm.sum(1) - tp  # rows are targets, columns preds
        if self.average == "micro":
            tp, fp, fn = tp.sum(), fp.sum(), fn.sum()
        b2 = self.beta**2
        num = (1 + b2) * tp
        den = num + b2 * fn + fp
        f = torch.where(den > 0, num / den, torch.zeros_like(den))
        if self.average == "binary":
            f = f[1]
        elif self.average == "macro":
            present = den > 0
            f = (f * present).sum() / present.sum().clamp(min=1)
        return torch.where(self.cm[-1] > 0, torch.full_like(f, math.nan), f)


class F1Score(FBeta):
    """F1 score: `FBeta` with beta=1.

    Example:
        >>> F1Score(average="micro").name
        'f1_score'
    """

    def __init__(self, average: str = "macro", num_classes: int | None = None) -> None:
        super().__init__(1.0, average, num_classes)


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
            got = f"{_describe(metrics)} ({type(metrics).__name__})"
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
            raise TypeError(f"targets must be a tuple, got {_describe(targets)}.")
        for name, m in zip(self.names, self.metrics, strict=True):
            try:
                m.update(output, *targets)
            except Exception as e:
                where = f"on output {_describe(output)} and targets "
                raise _wrap(name, where + _describe(targets), e) from e

    def compute(self) -> list[Tensor]:
        values = []
        for name, m in zip(self.names, self.metrics, strict=True):
            try:
                values.append(m.compute())
            except Exception as e:
                raise _wrap(name, "in compute()", e) from e
        return values

    def __len__(self) -> int:
        return len(self.metrics)

    def __bool__(self) -> bool:
        return bool(self.metrics)


def _wrap(name: str, where: str, e: Exception) -> Exception:
    msg = f"metric '{name}' failed {where}: {e}"
    if "Fix:" not in msg:
        msg += (
            ". Fix: check the output and target shapes and dtypes this metric "
            "expects, or remove it from `metrics`."
        )
    return (type(e) if type(e) in _WRAP_KEEPS else ValueError)(msg)
