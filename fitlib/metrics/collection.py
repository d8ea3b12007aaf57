"""The metrics of one run, and how they are summed across processes.

In distributed validation each process holds a shard of the set. `validate`
then packs the loss sum, the sample count and every metric's `sums()` into one
flat tensor and sums it over the processes with one call to
`Metrics.reducer` (one collective, not one per metric), so the results cover
the whole set.
"""

import functools
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch import Tensor

from fitlib.errors import ArgTypeError, describe, reraise
from fitlib.metrics.accumulate import (
    AvgMetric,
    Metric,
    TorchMetricAdapter,
    accumulation_dtype,
)
from fitlib.metrics.classification import Accuracy, ClassMetric, ErrorRate
from fitlib.metrics.functions import accuracy, error_rate
from fitlib.structure import parts, pick

Reducer = Callable[[Tensor], Tensor]


def _bad_metric(m: object, why: str, owner: str = "metrics") -> TypeError:
    return TypeError(
        f"{owner}: cannot use {m!r} (type {type(m).__name__}) as a metric: {why}. "
        "Fix: pass a function f(output, *targets) -> batch mean, a fitlib Metric "
        "(instance or class) or a torchmetrics.Metric instance."
    )


def _is_torchmetric(m: object) -> bool:
    return all(callable(getattr(m, a, None)) for a in ("update", "compute", "reset"))


def as_metric(m: object, owner: str = "metrics") -> Metric:
    """Turn anything accepted in `metrics=[...]` into a `Metric` (``owner``
    names the argument in errors).

    Examples:
        >>> as_metric(accuracy).name, as_metric(RMSE).name
        ('accuracy', 'rmse')
    """
    if isinstance(m, Metric):
        return m
    if isinstance(m, type):
        if not issubclass(m, Metric):
            raise _bad_metric(m, "it is a class; pass an instance", owner)
        try:
            return m()
        except TypeError as e:
            why = f"it needs arguments ({e}); pass an instance"
            raise _bad_metric(m, why, owner) from e
    if _is_torchmetric(m):
        return TorchMetricAdapter(m)
    counted = _counted(m)
    if counted is not None:
        return counted
    if callable(m):
        return AvgMetric(m)
    raise _bad_metric(m, "it is not callable", owner)


_COUNTED_KEYWORDS = {"class_dim", "ignore_index", "from_logits", "threshold"}


def _counted(m: object) -> Metric | None:
    """``accuracy`` and ``error_rate`` (or a ``functools.partial`` of them with
    ``class_dim``, ``ignore_index``, ``from_logits``, ``threshold``) as the
    metric that counts them over the whole set: exact when batches count
    different numbers of targets."""
    func, kwargs = m, {}
    if isinstance(m, functools.partial) and not m.args:
        func, kwargs = m.func, m.keywords
    cls = {accuracy: Accuracy, error_rate: ErrorRate}.get(func)  # type: ignore[call-overload]
    if cls is None or not kwargs.keys() <= _COUNTED_KEYWORDS:
        return None
    return cls(**kwargs)


class Part(Metric):
    """A metric of one part of a structured output (a tuple, dict or
    dataclass: detection heads, ``transformers``' ``logits``) and of the
    targets.

    Args:
        metric: anything ``metrics=[...]`` takes (a function, a ``Metric``,
            a torchmetrics object).
        output: the part of the output it scores: an index, a key (or a
            dataclass field), or a tuple of them for a nested part; None for
            the whole output (fitlib's metrics, which score a tensor, then
            take its ``logits`` part, as in ``metrics=[...]``).
        target: the same for the targets: an index among several targets
            (``loss_func(out, y_cls, y_box)``), or a key or index into one
            structured target (a dict); None for all of them.
        name: its name in the record; by default the metric's own.

    Examples:
        >>> metrics = [Part(accuracy, output=0, target=0),
        ...            Part(mse, output=1, target=1, name="box_mse")]
    """

    def __init__(
        self,
        metric: object,
        output: Any = None,
        target: Any = None,
        name: str | None = None,
    ) -> None:
        self.metric = as_metric(metric, "Part: metric")
        self.output = _check_path(output, "output")
        self.target = _check_path(target, "target")
        if name is not None and not (isinstance(name, str) and name):
            error = ValueError if isinstance(name, str) else ArgTypeError
            raise error(
                f"Part: name must be a non-empty str or None; got {name!r} "
                f"({type(name).__name__}). Fix: e.g. Part(accuracy, output=0, "
                'name="class_accuracy").'
            )
        self.name = name or self.metric.name
        self._wants_tensor = _scores_tensors(self.metric)

    def select(self, output: Any, targets: tuple) -> tuple[Any, tuple]:
        """The output part and the targets this metric scores."""
        if self.output is not None:
            output = pick(output, self.output, f"{self.name}: the output")
        elif self._wants_tensor and not isinstance(output, Tensor):
            output = tensor_of(output, self.name, targets)
        if self.target is not None:
            whole = targets[0] if len(targets) == 1 else targets
            targets = (pick(whole, self.target, f"{self.name}: the targets"),)
        return output, targets

    def reset(self) -> None:
        self.metric.reset()

    def update(self, output: Any, *targets: Any) -> None:
        output, targets = self.select(output, targets)
        self.metric.update(output, *targets)

    def check_inputs(self, output: Any, *targets: Any, loss_func: Any = None) -> None:
        """The metric's check on its part (``loss_func``: the fit's loss)."""
        try:
            output, picked = self.select(output, targets)
        except KeyError as e:
            raise ValueError(e.args[0]) from None
        if self.target is None and len(targets) > 1 and _scores_tensors(self.metric):
            raise ValueError(
                f"{self.name}: the batches have {len(targets)} targets, and "
                f"{self.metric.name} scores one. Fix: say which, e.g. "
                f"Part(..., output={self.output!r}, target=0)."
            )
        one = picked[0] if len(picked) == 1 else None
        if (
            self.target is None
            and self._wants_tensor
            and one is not None
            and (not isinstance(one, Tensor) and parts(one))
        ):  # one target per output, in a dict: which one is this metric's?
            example = self.output if self.output is not None else parts(one)[0]
            raise ValueError(
                f"{self.name}: the batches' target is {describe(one)}, and "
                f"{self.metric.name} scores one tensor. Fix: say which, e.g. "
                f"Part(..., output={self.output!r}, target={example!r}) (the "
                f"target's parts are {parts(one)})."
            )
        check_metric(self.metric, output, picked, loss_func)

    def compute(self) -> Tensor:
        return self.metric.compute()

    def sums(self) -> list[Tensor]:
        return self.metric.sums()

    def load_sums(self, sums: list[Tensor]) -> None:
        self.metric.load_sums(sums)

    def check_sums(self) -> None:
        self.metric.check_sums()


_PATH_RULE = (
    "an index (int), a key (str), a non-empty tuple of them for a nested part, or None"
)


def _check_path(path: Any, name: str) -> Any:
    """``path`` if ``pick`` can take it; else an error worded as ``check_int``."""
    steps = path if isinstance(path, tuple) else (path,)
    if path is None or (steps and all(_is_step(k) for k in steps)):
        return path
    error = ValueError if path == () else ArgTypeError
    raise error(
        f"Part: {name} must be {_PATH_RULE}; got {path!r} "
        f"({type(path).__name__}). Fix: e.g. Part(accuracy, {name}=0) or "
        f"Part(accuracy, {name}={'logits' if name == 'output' else 'labels'!r})."
    )


def _is_step(key: Any) -> bool:
    return isinstance(key, str) or (isinstance(key, int) and not isinstance(key, bool))


def tensor_of(output: Any, name: str, targets: tuple = ()) -> Any:
    """The tensor a metric that scores one takes from a structured output:
    its ``logits`` part (``transformers``' outputs); else a TypeError saying
    which ``Part`` to write (``targets``: the batch's, for the fix)."""
    have = parts(output)
    if "logits" in have:
        return pick(output, "logits", f"{name}: the output")
    example = have[0] if have else "..."
    more = _target_fix(targets) or "."
    raise TypeError(
        f"{name} scores a tensor, but the model's output is {describe(output)}. "
        f"Fix: point it at one part, e.g. Part({name}, output={example!r}) (the "
        f"parts are {have}){more}"
    )


def _target_fix(targets: tuple) -> str | None:
    """The end of a fix that must name a target too: several targets, or one
    structured target (a dict of targets per output)."""
    if len(targets) > 1:
        return "; and at one target with target=..."
    keys = parts(targets[0]) if targets and not isinstance(targets[0], Tensor) else []
    if keys:
        return f"; and at its target with target=... (the targets' parts are {keys})"
    return None


def check_metric(m: Metric, output: Any, targets: tuple, loss_func: Any) -> None:
    """``m.check_inputs``; fitlib's class metrics and ``Part`` also get the
    fit's ``loss_func`` (a loss that takes probabilities)."""
    if type(m).check_inputs in (Part.check_inputs, ClassMetric.check_inputs):
        m.check_inputs(output, *targets, loss_func=loss_func)  # not overridden
    else:
        m.check_inputs(output, *targets)


def _scores_tensors(m: Metric) -> bool:
    """Whether ``m`` is one of fitlib's (or torchmetrics') metrics, which score
    a tensor output: a structured one needs ``Part``."""
    if isinstance(m, Part):
        return False
    if isinstance(m, AvgMetric):
        func = getattr(m.func, "func", m.func)
        return getattr(func, "__module__", "").startswith("fitlib.")
    return isinstance(m, TorchMetricAdapter) or type(m).__module__.startswith(
        "fitlib.metrics."
    )


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

    Examples:
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
        self._reducer: Reducer | None = None

    @property
    def reducer(self) -> Reducer | None:
        """Sums a 1-D tensor element-wise over the processes; None in one.

        Distributed training sets it (e.g. to an ``all_reduce``); ``validate``
        then reports the loss and metrics of the whole set, not of this
        process's shard. Setting it checks that every metric can be summed.
        """
        return self._reducer

    @reducer.setter
    def reducer(self, fn: Reducer | None) -> None:
        if fn is not None and not callable(fn):
            raise TypeError(
                f"Metrics.reducer must be a function or None, got {describe(fn)}. "
                "Fix: a function that returns its 1-D tensor summed over the "
                "processes."
            )
        if fn is not None:
            for name, m in zip(self.names, self.metrics, strict=True):
                try:
                    m.check_sums()
                except Exception as e:
                    _reraise(name, "the check for distributed validation", e)
        self._reducer = fn

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

    def check(self, output: Any, targets: tuple, loss_func: Any = None) -> None:
        """Each metric's ``check_inputs`` on a first batch (may read the device).

        fitlib's metrics given a structured output score its ``logits`` part
        when it has one (``transformers``' outputs), as ``Part`` without
        ``output`` does (``tensor_of``); any other structure needs a ``Part``.
        ``loss_func``, the fit's loss, tells a binary metric whether one
        score per sample is a probability (``from_logits``).
        """
        for i, (name, m) in enumerate(zip(self.names, self.metrics, strict=True)):
            if not isinstance(output, Tensor) and _scores_tensors(m):
                tensor_of(output, name, targets)  # or says which Part
                m = self.metrics[i] = Part(m, name=name)
            self._check_one(name, m, output, targets, loss_func)

    def check_probabilities(
        self, output: Any, targets: tuple, loss_func: Any = None
    ) -> None:
        """Only the check of one score per target read as a logit (a
        probability loss, see ``check_binary_scores``), on a fit's first
        training batch: such a fit stops before its first step. The other
        checks wait for ``check`` (a metric's own batches)."""
        for m in self.metrics:
            inner = m.metric if isinstance(m, Part) else m
            if not isinstance(inner, ClassMetric) or not inner.reads_binary:
                continue
            try:
                out, picked = m.select(output, targets) if m is not inner else (
                    output, targets)  # fmt: skip
                if not isinstance(out, Tensor):
                    out = tensor_of(out, inner.name, targets)
            except (KeyError, TypeError, ValueError):
                continue  # check says what is wrong, at the metric's batch
            one = out.ndim == 1 or (out.ndim > 1 and 1 in (out.shape[1], out.shape[-1]))
            if one and picked and isinstance(picked[0], Tensor):
                inner.check_scores(out, picked[0], loss_func)

    @staticmethod
    def _check_one(
        name: str, m: Metric, output: Any, targets: tuple, loss_func: Any
    ) -> None:
        try:
            check_metric(m, output, targets, loss_func)
        except (TypeError, ValueError):
            raise  # already says what to do
        except Exception as e:
            _reraise(name, f"on output {describe(output)}", e)

    def compute(self) -> list[Tensor]:
        values = []
        for name, m in zip(self.names, self.metrics, strict=True):
            try:
                values.append(m.compute())
            except Exception as e:
                _reraise(name, "in compute()", e)
        return values

    def reduce(self, extra: list[Tensor]) -> list[Tensor]:
        """Sums ``extra`` and every metric's state over the processes.

        One call to ``reducer`` on one flat tensor; each metric then computes
        over every process's data. Returns ``extra`` summed, same shapes, in
        the accumulation dtype (float64; float32 on MPS, where counts stay
        exact up to 2**24).

        Examples:
            >>> metrics = Metrics([accuracy])
            >>> metrics.update(torch.tensor([[0.0, 1.0]]), (torch.tensor([1]),))
            >>> metrics.reducer = lambda t: t * 2  # two processes, the same data
            >>> loss_sum, count = metrics.reduce([torch.tensor(1.5), torch.tensor(3.0)])
            >>> loss_sum, count, metrics.compute()
            (tensor(3., dtype=torch.float64), tensor(6., dtype=torch.float64),
             [tensor(1., dtype=torch.float64)])
        """
        if self.reducer is None:
            raise RuntimeError(
                "Metrics.reduce needs a reducer. Fix: set metrics.reducer (the "
                "distributed trainer does), or call compute() in one process."
            )
        parts = [list(extra)]
        for name, m in zip(self.names, self.metrics, strict=True):
            try:
                parts.append(list(m.sums()))
            except Exception as e:
                _reraise(name, "in sums()", e)
        flat = _pack(parts)
        total = self.reducer(flat)
        if not isinstance(total, Tensor) or total.shape != flat.shape:
            raise TypeError(
                f"Metrics.reducer returned {describe(total)} for "
                f"{describe(flat)}. Fix: return the tensor summed over the "
                "processes, e.g. def reducer(t): dist.all_reduce(t); return t."
            )
        summed = _unpack(total, parts)
        for name, m, sums in zip(self.names, self.metrics, summed[1:], strict=True):
            try:
                m.load_sums(sums)
            except Exception as e:
                _reraise(name, "in load_sums()", e)
        return summed[0]

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


def _pack(parts: list[list[Tensor]]) -> Tensor:
    """Every tensor of ``parts``, flattened into one 1-D tensor.

    On the device of the first tensor that is not on the CPU (the loss's), in
    its accumulation dtype.
    """
    tensors = [t for part in parts for t in part]
    device = next((t.device for t in tensors if t.device.type != "cpu"), None)
    device = device or torch.device("cpu")
    dtype = accumulation_dtype(device)
    flat = [t.detach().reshape(-1).to(device, dtype) for t in tensors]
    return torch.cat(flat) if flat else torch.zeros(0, dtype=dtype, device=device)


def _unpack(flat: Tensor, parts: list[list[Tensor]]) -> list[list[Tensor]]:
    """``flat`` cut back into tensors of the shapes of ``parts``."""
    sizes = [t.numel() for part in parts for t in part]
    pieces = iter(flat.split(sizes))
    return [[next(pieces).view(t.shape) for t in part] for part in parts]
