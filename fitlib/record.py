"""The epoch record: one named dict of an epoch's values, and the sums behind it.

``EpochTally`` keeps, on the device, what an epoch's record needs from its
batches: the weighted sum of the training losses (by samples, or by what a
token loss averages over: ``loss_count``), the parts of a loss
that returns a dict (training and validation), the training metrics, and the
epoch's clock. At the epoch's end ``EpochTally.record`` reads all of it and the
validation values in one host transfer, and returns the record:

    {"epoch": 0, "train_loss": 0.91, "valid_loss": 0.72, "accuracy": 0.66,
     "train_accuracy": 0.70, "train_ce": ..., "valid_ce": ..., "lr": 0.1,
     "time": 0.41}

A value that was not computed in the epoch (validation skipped, no training
batch) is None. The handler (``fitlib.callback``) owns the tally, puts the
record in ``state["record"]`` before ``on_epoch_end`` and merges the values
callbacks add (``add_values``). Not a callback.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

import fitlib.ranks as ranks
from fitlib.checks import ignore_index_of, is_class_index_loss
from fitlib.errors import add_note, describe, did_you_mean
from fitlib.metrics.accumulate import accumulation_dtype, weighted_sum
from fitlib.metrics.collection import Metrics

Record = dict[str, Any]
# Values the loop owns: a callback may not add a value of these names.
LOOP_KEYS = ("epoch", "step", "train_loss", "valid_loss", "lr", "time")
# The order of the first callback that reads the record (ReduceLROnPlateau):
# a callback adds values before it.
ADD_BEFORE = 40
# Batches whose losses wait as separate tensors: then they are summed into
# one on the device (no sync), so an epoch of any length keeps little.
FOLD = 1024


def to_floats(scalars: list[torch.Tensor], extra: Iterable = ()) -> list[float]:
    """0-dim tensors (one device), then ``extra``, as floats in one host transfer.

    This is the one sync an epoch end needs: stack on the device, then copy.
    """
    groups = [list(scalars), [torch.as_tensor(v).reshape(()) for v in extra]]
    groups = [g for g in groups if g]
    if not groups:
        return []
    device = groups[0][0].device
    dtype = accumulation_dtype(device)
    # Stacking each group apart: one stack of mixed dtypes is 4x slower.
    return torch.cat([torch.stack(g).to(device, dtype) for g in groups]).tolist()


class HostCopy:
    """0-dim tensors copied to the host without waiting for the device.

    On CUDA the copy goes to pinned memory on the current stream, followed by
    an event: ``ready()`` asks the event (no sync) and ``get()`` returns the
    floats, waiting only when the copy has not finished. Elsewhere the values
    are read at once (``ready()`` is True). What reads a value only to show it
    (the progress bar) shows the last copy that is ready: no step waits for it.

    Examples:
        >>> from fitlib.record import HostCopy
        >>> copy = HostCopy([torch.tensor(2.5)])
        >>> copy.ready(), copy.get()
        (True, [2.5])
    """

    def __init__(self, scalars: list[torch.Tensor]) -> None:
        values = torch.stack([t.detach().reshape(()).float() for t in scalars])
        self._event = None
        if values.device.type == "cuda":
            self._host = torch.empty(values.shape, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            self._values = None
        else:
            self._values = values.tolist()

    def ready(self) -> bool:
        """Whether ``get()`` returns without waiting for the device."""
        return self._event is None or self._event.query()

    def get(self) -> list[float]:
        """The values (waits for the copy if it has not finished)."""
        if self._values is None:
            self._event.synchronize()
            self._values = self._host.tolist()
        return self._values


def batch_size(yb: Any, xb: Any = None) -> int:
    """The number of samples in a batch, read from the targets (or inputs)."""
    for part in (yb, xb):
        t = first_tensor(part)
        if t is not None and t.ndim:
            return t.shape[0]
    return 1


def first_tensor(x: Any) -> torch.Tensor | None:
    """The first tensor in a tensor, tuple, list or dict (nested), or None."""
    while isinstance(x, (tuple, list, dict)) and x:
        x = next(iter(x.values())) if isinstance(x, dict) else x[0]
    return x if isinstance(x, torch.Tensor) else None


def loss_count(loss_func: Any) -> Callable[[Any, Any], torch.Tensor | None] | None:
    """What a batch's loss is a mean over, when that is not the batch's
    samples: a function ``(output, targets)`` giving a 0-dim device tensor
    (no sync), or None for that batch; None when every batch is weighted by
    its samples. The epoch's loss is then the mean over the whole set of what
    the loss averages over, as one pass over the set would compute it.

    - A loss with a ``count`` attribute (``fitlib.sequences.
      masked_cross_entropy`` has one; yours may): ``count(output, *targets)``,
      with a ``functools.partial``'s keywords passed on.
    - Cross-entropy and NLL (functions, modules, partials) on class indices
      with more than one dim (per token, per pixel): the targets that are not
      ``ignore_index``, each weighted by its class's ``weight`` when given.
      Class indices of shape ``(B,)`` count as ``B`` samples.

    Examples:
        >>> from fitlib.record import loss_count
        >>> count = loss_count(F.cross_entropy)
        >>> count(None, torch.tensor([[1, 2, -100]]))
        tensor(2)
    """
    func = getattr(loss_func, "func", loss_func)
    keywords = getattr(loss_func, "keywords", None) or {}
    counter = getattr(func, "count", None)
    if counter is not None:
        return _checked_count(counter, keywords)
    reduction = keywords.get("reduction", getattr(loss_func, "reduction", "mean"))
    if not is_class_index_loss(loss_func) or reduction != "mean":
        return None  # a summed loss is not a mean over anything: by samples
    ignore = ignore_index_of(loss_func)
    weight = getattr(loss_func, "weight", None)
    weight = keywords.get("weight") if weight is None else weight

    def count(out: Any, yb: Any) -> torch.Tensor | None:
        if type(yb) is not torch.Tensor or yb.ndim < 2 or yb.is_floating_point():
            return None
        kept = yb != ignore
        if weight is None:
            return kept.sum()
        return (weight.to(yb.device)[yb.where(kept, 0)] * kept).sum()

    # Decided by the targets' shape alone: a fit whose first batch is counted
    # by samples stops asking (no call per step).
    count.by_shape = True
    return count


def _shown(x: Any) -> str:
    return describe(x) if isinstance(x, torch.Tensor) else f"{x!r} ({type(x).__name__})"


def _checked_count(counter: Any, keywords: dict) -> Callable[[Any, Any], Any]:
    """``counter`` called as ``count(output, *targets, **keywords)``, its
    result checked: None, an int, or a 0-dim tensor."""
    if not callable(counter):
        raise TypeError(
            f"loss_func has a count attribute that is not a function: "
            f"{_shown(counter)}. fitlib calls count(output, *targets) for what "
            "each batch's loss is a mean over. Fix: a function, e.g. "
            "lambda out, y: (y != -100).sum(), or remove the attribute."
        )

    def count(out: Any, yb: Any) -> Any:
        targets = yb if isinstance(yb, (tuple, list)) else (yb,)
        try:
            n = counter(out, *targets, **keywords)
        except TypeError as e:
            add_note(e, "fitlib: raised in loss_func.count(output, *targets)")
            raise
        if n is None or (type(n) is torch.Tensor and n.ndim == 0):
            return n
        if isinstance(n, int) and not isinstance(n, bool):
            return n
        raise TypeError(
            f"loss_func.count returned {_shown(n)}; it must return what the "
            "batch's loss is a mean over, as one number: an int or a 0-dim "
            "tensor (e.g. (y != -100).sum()), or None to weigh the batch by "
            "its samples."
        )

    return count


class RunningLoss:
    """A weighted sum of losses, kept as device tensors until read.

    Each batch's loss is a mean over its ``size``: its samples (an int), or
    what the loss averages over when that is counted on the device (a 0-dim
    tensor: the tokens a masked token loss keeps; see ``loss_count``). ``add``
    only appends (no sync; every ``FOLD`` batches one device op sums them, so
    memory stays bounded); ``pending`` gives the sum (and the device count, if
    any) as device tensors to read together with other values in one
    transfer; ``mean`` turns what was read into the mean. ``state_dict``
    reads the sums (one sync: call it when saving), and restored sums are
    added in.

    Examples:
        >>> from fitlib.record import RunningLoss, to_floats
        >>> loss = RunningLoss()
        >>> loss.add(torch.tensor(1.0), 4); loss.add(torch.tensor(6.0), 1)
        >>> loss.mean(to_floats(loss.pending()))
        2.0
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self, total: float = 0.0, count: float = 0) -> None:
        """Forgets the losses; ``total`` and ``count`` start the sums (restored)."""
        self._losses: list[torch.Tensor] = []
        self._sizes: list[int | torch.Tensor] = []
        self._folded: torch.Tensor | None = None  # the sum of earlier batches
        self._folded_count = 0  # their sizes that were ints
        self._folded_counted: torch.Tensor | None = None  # and tensors
        self._total, self._count = float(total), count

    def add(self, loss: torch.Tensor, size: int | torch.Tensor) -> None:
        """Adds a batch's detached loss, a mean over ``size`` (samples, or a
        0-dim device tensor: what the loss averaged over)."""
        self._losses.append(loss)
        self._sizes.append(size)
        if len(self._losses) >= FOLD:
            self._folded_count = self.samples - self._count
            self._folded, self._folded_counted = self._sums()
            self._losses, self._sizes = [], []

    @property
    def samples(self) -> float:
        """The sizes added as ints (restored counts included); the device
        counts are in ``pending()``."""
        ints = sum(s for s in self._sizes if type(s) is not torch.Tensor)
        return self._count + self._folded_count + ints

    @property
    def empty(self) -> bool:
        """Whether nothing was added (nor restored)."""
        return not (self._losses or self._folded is not None or self._count)

    @property
    def restored(self) -> tuple[float, float]:
        """The sum and count that ``reset`` (or ``load_state_dict``) started from."""
        return self._total, self._count

    def _sums(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The device sum of ``size * loss`` over the batches added, and the
        sum of the sizes that are tensors (None where there are none)."""
        total, counted = self._folded, self._folded_counted
        by_int = [(v, s) for v, s in zip(self._losses, self._sizes, strict=True)
                  if type(s) is not torch.Tensor]  # fmt: skip
        if by_int:
            part = weighted_sum(*map(list, zip(*by_int, strict=True)))
            total = part if total is None else total + part
        if len(by_int) < len(self._losses):
            by_tensor = [(v, s) for v, s in zip(self._losses, self._sizes, strict=True)
                         if type(s) is torch.Tensor]  # fmt: skip
            values, sizes = (torch.stack(x) for x in zip(*by_tensor, strict=True))
            dtype = accumulation_dtype(values.device)
            sizes = sizes.to(dtype)
            # A batch with nothing to average (every target ignored) has a NaN
            # mean and weight 0: it adds nothing (NaN * 0 would be NaN).
            part = torch.where(sizes > 0, values.to(dtype) * sizes, 0).sum()
            total = part if total is None else total + part
            counted = sizes.sum() if counted is None else counted + sizes.sum()
        return total, counted

    def pending(self) -> list[torch.Tensor]:
        """``[sum of size * loss]``, and the sum of the device sizes when there
        are any, over the batches added; ``[]`` if none."""
        total, counted = self._sums()
        if total is None:
            return []
        return [total] if counted is None else [total, counted]

    def mean(self, read: list[float]) -> float:
        """The mean loss per sample (or per what was counted), given
        ``pending()`` read as floats."""
        total = self._total + (read[0] if read else 0.0)
        n = self.samples + (read[1] if len(read) > 1 else 0)
        return total / n if n else math.nan

    def sum_and_count(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sum and the count as device tensors (restored ones included),
        on the device and in the dtype of ``like``: for a collective."""
        total, counted = self._sums()
        total = like.new_full((), self._total) + (0 if total is None else total)
        count = like.new_full((), self.samples)  # a fill: no host-to-device copy
        return total, count if counted is None else count + counted

    def state_dict(self) -> dict:
        """The sum and count as python numbers (reads the device: one sync)."""
        read = to_floats(self.pending())
        total = self._total + (read[0] if read else 0.0)
        return {
            "total": total,
            "count": self.samples + (read[1] if len(read) > 1 else 0),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict``: later batches add to the restored sum."""
        self.reset(state["total"], state["count"])


class EpochTally:
    """The device-side sums of the epoch in progress, read once at its end.

    ``start`` begins an epoch (sums at zero, clock running); ``add_batch`` adds
    a batch's loss, loss parts and (training) metric inputs without a sync;
    ``record`` reads everything with the validation values in one host
    transfer. ``state_dict``/``load_state_dict`` save and restore an epoch in
    progress (``Checkpoint`` does), so a resumed epoch's record is exact.

    Under ``torch.distributed`` the training sums are added over the processes
    (one collective with the training metrics), so every process gets the
    same record.

    Args:
        train_metrics: the metrics computed over the training batches (each
            reported as ``train_<name>``).

    Examples:
        >>> from fitlib.record import EpochTally
        >>> tally = EpochTally(Metrics([accuracy]))
        >>> tally.start()
        >>> out, yb = torch.tensor([[0.0, 1.0], [1.0, 0.0]]), torch.tensor([1, 1])
        >>> tally.add_batch(F.cross_entropy(out, yb), len(yb), True, None, out, (yb,))
        >>> valid_loss, valid_accuracy = torch.tensor(0.5), torch.tensor(0.75)
        >>> tally.record(0, [valid_loss, valid_accuracy], ["accuracy"], lr=0.1)
        {'epoch': 0, 'train_loss': 0.8132616281509399, 'valid_loss': 0.5,
         'accuracy': 0.75, 'train_accuracy': 0.5, 'lr': 0.1, 'time': ...}
    """

    def __init__(
        self, train_metrics: Metrics | None = None, loss_func: Any = None
    ) -> None:
        self.train_metrics = train_metrics if train_metrics else Metrics(None)
        self.loss_func = loss_func  # the first batch's metric check reads it
        self.has_metrics = bool(self.train_metrics)  # read per step: once
        self._checked = False  # the metrics' inputs, at the first batch
        # The loss parts seen in this fit: each has a train_ and a valid_
        # value in every record from then on (None where not computed).
        self.part_names: list[str] = []
        self.start()

    def start(self) -> None:
        """Begins an epoch: every sum at zero, the clock from now."""
        self.loss = RunningLoss()
        self.parts: dict[str, RunningLoss] = {}  # "train_ce", "valid_ce", ...
        self.train_metrics.reset()
        self._metric_batches = 0  # training batches the metrics saw
        self._restored: list | None = None  # their sums before a resume
        self._seconds, self._t0 = 0.0, time.perf_counter()

    def add_batch(
        self,
        loss: torch.Tensor,
        size: int,
        train: bool,
        parts: dict[str, torch.Tensor] | None,
        output: Any = None,
        targets: Any = (),
    ) -> None:
        """Adds a batch (detached tensors; no sync). Validation batches bring
        only their loss parts: ``validate`` sums their loss itself."""
        if train:
            self.loss.add(loss, size)
            if self.has_metrics:
                self._update_metrics(output, targets)
        if parts:
            prefix = "train_" if train else "valid_"
            for name, value in parts.items():
                key = prefix + name
                if key not in self.parts:
                    self.parts[key] = RunningLoss()
                    if name not in self.part_names:
                        self._check_part(name)
                        self.part_names.append(name)
                self.parts[key].add(value, size)

    def declare_parts(self, names: Any) -> None:
        """Loss parts that the loss returns only in some batches (a GAN's
        ``critic`` and ``generator``), known before the first: every record
        has them (None in an epoch without them)."""
        for name in names:
            if name not in self.part_names:
                self._check_part(name)
                self.part_names.append(name)

    def _check_part(self, name: str) -> None:
        """Refuses a loss part whose record names another value has."""
        if name in self.train_metrics.names or name == "loss":
            raise ValueError(
                f"the loss part {name!r} would be reported as train_{name} and "
                f"valid_{name}, which the training metric {name!r} (train_{name}) "
                "or the loop's losses already are: one would overwrite the "
                f"other. Fix: rename the part, e.g. {{'{name}_part': ...}}."
            )

    def _update_metrics(self, output: Any, targets: Any) -> None:
        targets = tuple(targets) if isinstance(targets, (tuple, list)) else (targets,)
        with torch.no_grad():
            if not self._checked:  # the first training batch of the fit
                self.train_metrics.check(output, targets, self.loss_func)
                self._checked = True
            self.train_metrics.update(output, targets)
        self._metric_batches += 1

    def record(
        self,
        epoch: int,
        valid: list[torch.Tensor] | None,
        metric_names: list[str],
        lr: float,
        step: int | None = None,
    ) -> Record:
        """The epoch's record, every device value read in one host transfer.

        ``valid`` is ``[valid_loss, *metrics]`` (None: validation skipped);
        ``step``, when given, follows ``epoch`` (records inside an epoch).
        """
        train_names = [f"train_{n}" for n in self.train_metrics.names]
        if self._restored is not None:  # the sums from before a resume join in
            for m, sums in zip(self.train_metrics.metrics, self._metric_sums(),
                               strict=True):  # fmt: skip
                m.load_sums(sums)
            self._restored = None
        losses = [self.loss, *self.parts.values()]
        if ranks.world_size() > 1:  # every process: the same record
            device, finish, metrics = self._reduced(losses)
        else:
            device, finish = _local(losses)
            metrics = self._train_metrics()
        values = iter(to_floats(device, [*metrics, *(valid or [])]))
        means = finish(values)
        items = [("epoch", epoch), ("train_loss", means[0])]
        if step is not None:
            items.insert(1, ("step", step))
        trained = [next(values) for _ in metrics] or [None] * len(train_names)
        read_valid = [next(values) for _ in valid or []]
        names = ["valid_loss", *metric_names]
        items += zip(names, read_valid or [None] * len(names), strict=True)
        items += zip(train_names, trained, strict=True)
        means = dict(zip(self.parts, means[1:], strict=True))
        for prefix in ("train_", "valid_"):
            items += [(prefix + n, means.get(prefix + n)) for n in self.part_names]
        # After the transfer, which waited for the device: the epoch's real time.
        items += [("lr", lr), ("time", self.seconds())]
        _check_unique([name for name, _ in items])
        return dict(items)

    def seconds(self) -> float:
        """Wall-clock seconds of the epoch so far (before a resume included)."""
        return self._seconds + time.perf_counter() - self._t0

    def _train_metrics(self) -> list[torch.Tensor]:
        if not self.train_metrics or not self._metric_batches:
            return []  # reported as None: nothing to compute them on
        return self.train_metrics.compute()

    def _reduced(self, losses: list[RunningLoss]) -> tuple[list, Any, list]:
        """The loss sums and counts, and the training metrics, summed over the
        processes in one collective."""
        device = next(
            (p[0].device for p in map(RunningLoss.pending, losses) if p), None
        )
        like = torch.zeros((), dtype=torch.float64, device=device)
        sums = [loss.sum_and_count(like) for loss in losses]
        extra = [torch.stack([t for t, _ in sums]), torch.stack([c for _, c in sums])]
        metrics = self.train_metrics
        if metrics.reducer is None:
            metrics.reducer = ranks.all_reduce_sum
        # Every process trains as many batches (a DistributedSampler), so all
        # of them take part in this one collective, or none.
        summed = metrics.reduce(extra)
        trained = metrics.compute() if metrics and self._metric_batches else []
        n = len(losses)

        def finish(values: Iterable[float]) -> list[float | None]:
            read = [next(values) for _ in range(2 * n)]
            return [t / c if c else None for t, c in zip(read[:n], read[n:],
                                                        strict=True)]  # fmt: skip

        return [*summed[0], *summed[1]], finish, trained

    # -- saving ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """The epoch's sums so far as plain values (reads the device: a sync)."""
        metrics = None
        if self.train_metrics and self._metric_batches:
            metrics = self._metric_sums()
            if metrics is not None:
                metrics = [[s.cpu() for s in sums] for sums in metrics]
        return {
            "loss": self.loss.state_dict(),
            "parts": {k: p.state_dict() for k, p in self.parts.items()},
            "part_names": list(self.part_names),
            "train_metrics": metrics,
            "metric_batches": self._metric_batches,
            "seconds": self.seconds(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict``: the epoch continues from those sums."""
        self.start()
        self.loss.load_state_dict(state["loss"])
        for key, part in state["parts"].items():
            self.parts[key] = RunningLoss()
            self.parts[key].load_state_dict(part)
        self.part_names = list(state.get("part_names", []))
        if state["train_metrics"] is not None:
            self._restored = [[torch.as_tensor(s) for s in sums]
                              for sums in state["train_metrics"]]  # fmt: skip
            self._metric_batches = int(state["metric_batches"])
        self._seconds = float(state["seconds"])

    def _metric_sums(self) -> list | None:
        """Each training metric's sums, those restored by a resume added."""
        names, restored = self.train_metrics.names, self._restored
        try:
            sums = [m.sums() for m in self.train_metrics.metrics]
        except NotImplementedError:
            warnings.warn(
                f"fitlib: the training metrics {names} cannot be saved in the "
                "middle of an epoch (a metric has no sums()); after a resume "
                "their values of that epoch count only the batches trained "
                "after it. Fix: give the metric sums() and load_sums().",
                stacklevel=2,
            )
            return None
        if restored is not None:
            sums = [[s + r.to(s) for s, r in zip(now, old, strict=True)]
                    for now, old in zip(sums, restored, strict=True)]  # fmt: skip
        return sums


def _check_unique(names: list[str]) -> None:
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(
            f"the epoch record would hold {twice} twice (its names: {names}): "
            "one value would overwrite the other. Fix: rename the metric (e.g. "
            "functools.partial with another __name__, or a Metric's name)."
        )


def check_record_names(callbacks: list) -> None:
    """Refuses, before training, ``record_names`` that are not a tuple of
    names, that a callback ordered after the record's readers declares, or
    that the loop or another callback already has."""
    seen: dict[str, str] = {}
    for cb in callbacks:
        names = getattr(cb, "record_names", ())
        ok = isinstance(names, (tuple, list)) and all(
            isinstance(n, str) and n for n in names)  # fmt: skip
        if not ok:
            raise TypeError(
                f"{cb.name}.record_names must be a tuple of names; got "
                f"{names!r}. Fix: e.g. record_names = ('grad_norm',) (a tuple "
                "of one name needs its comma)."
            )
        if names and cb.order >= ADD_BEFORE:
            raise ValueError(
                f"{cb.name} adds {list(names)} to the epoch record at order "
                f"{cb.order}, after the monitors (40, 45), the Recorder (50), "
                "the loggers (55) and the bar (60) have read it: they would "
                f"miss them. Fix: give it an order below {ADD_BEFORE} (the "
                "default is 0)."
            )
        for name in names:
            if name in LOOP_KEYS or name in seen:
                whose = "the loop" if name in LOOP_KEYS else seen[name]
                raise ValueError(
                    f"{cb.name} declares {name!r} in record_names, which "
                    f"{whose} already adds to the epoch record. Fix: give the "
                    "value another name."
                )
            seen[name] = cb.name


def step_lr(opt: Any) -> float:
    """The lr of the last parameter group, as the latest ``opt.step()`` used it.

    ``HPOptimizer.stepped`` notes it in ``step()``, before a scheduler sets the
    next one; otherwise (no step yet) the group's current lr. NaN without opt.
    """
    if opt is None:
        return math.nan
    stepped = getattr(opt, "stepped", None)
    return float(stepped[0] if stepped else opt.param_groups[-1]["lr"])


def _local(losses: list[RunningLoss]) -> tuple[list[torch.Tensor], Any]:
    """The pending loss sums to read, and how to turn what was read into the
    means per sample (None where no sample was added)."""
    pending = [loss.pending() for loss in losses]

    def finish(values: Iterable[float]) -> list[float | None]:
        return [
            None if loss.empty else loss.mean([next(values) for _ in p])
            for loss, p in zip(losses, pending, strict=True)
        ]

    return [t for p in pending for t in p], finish


def check_added(owner: str, record: Record, values: Any, declared: tuple) -> Record:
    """The values a callback adds to ``record``, checked, as python numbers.

    Raises a TypeError/ValueError naming ``owner`` and the value's name for a
    name that is not a str, exists already, was not declared in the
    callback's ``record_names``, or a value that is not a number or a
    one-element tensor. Device tensors are read in one host transfer.
    """
    if not isinstance(values, dict):
        raise TypeError(
            f"{owner} returned record={describe(values)}; it must be a dict of "
            "names to numbers. Fix: return {'record': {'my_value': 0.5}}."
        )
    for name, value in values.items():
        if not isinstance(name, str) or not name:
            raise TypeError(
                f"{owner} added a value named {name!r} to the epoch record; "
                "names are non-empty str. Fix: e.g. {'record': {'grad_norm': g}}."
            )
        if name in record:
            raise ValueError(
                f"{owner} added {name!r} to the epoch record, which already has "
                f"it (the record holds {list(record)}). Fix: give the value "
                "another name."
            )
        if name not in declared:
            raise ValueError(
                f"{owner} added {name!r}{did_you_mean(name, declared)} to the "
                "epoch record without declaring it (its record_names are "
                f"{list(declared)}). Fix: list it in "
                f"the class, e.g. record_names = ({name!r},), so loggers and "
                "monitors know it before training."
            )
        _check_scalar(owner, name, value)
    tensors = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
    read = to_floats([], [values[k].detach().reshape(()) for k in tensors])
    numbers = {k: v if v is None or k in tensors else float(v)
               for k, v in values.items()}  # fmt: skip
    return numbers | dict(zip(tensors, read, strict=True))


def _check_scalar(owner: str, name: str, value: Any) -> None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return
    ok = value is None or (isinstance(value, (int, float)) and not isinstance(
        value, bool))  # fmt: skip
    if not ok:
        raise ValueError(
            f"{owner} added {name!r} = {describe(value)} to the epoch record; a "
            "record value is one number: an int, a float, a one-element tensor "
            "or None (not computed). Fix: reduce it first, e.g. t.mean()."
        )


SMOOTH_BETA = 0.98  # smooth_loss's, as fastai's


class LossSmoother:
    """The average of ``smooth_loss``, on the host, over python floats.

    A callback that needs the smoothed loss only at epoch end keeps the raw
    losses and smooths them here, in float64: the same numbers, without the
    device op per batch that ``state['smooth_loss']`` costs.

    Examples:
        >>> from fitlib.record import LossSmoother
        >>> LossSmoother()([2.0, 1.0])
        [2.0, 1.4949494949494933]
    """

    def __init__(self) -> None:
        self.avg, self.n = 0.0, 0

    def __call__(self, losses: Iterable[float]) -> list[float]:
        """Adds ``losses`` in order; returns the debiased average after each."""
        out = []
        for loss in losses:
            self.n += 1
            self.avg += (1 - SMOOTH_BETA) * (loss - self.avg)
            out.append(self.avg / (1 - SMOOTH_BETA**self.n))
        return out
