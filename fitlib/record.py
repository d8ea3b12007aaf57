"""The epoch record: one named dict of an epoch's values, and the sums behind it.

``EpochTally`` keeps, on the device, what an epoch's record needs from its
batches: the weighted sum of the training losses (``RunningLoss``, by
samples or by what a token loss averages over: ``fitlib.running_loss``), the
parts of a loss
that returns a dict (training and validation), the training metrics, and the
epoch's clock. At the epoch's end ``EpochTally.record`` reads all of it and the
validation values in one host transfer, and returns the record:

    {"epoch": 0, "train_loss": 0.91, "valid_loss": 0.72, "accuracy": 0.66,
     "train_accuracy": 0.70, "train_ce": ..., "valid_ce": ..., "lr": 0.1,
     "time": 0.41}

A value that was not computed in the epoch (validation skipped, no training
batch) is None. The handler (``fitlib.callback_handler``) owns the tally,
puts the record in ``state["record"]`` before ``on_epoch_end`` and merges the
values callbacks add, checked here (``check_record_names``, ``check_added``).
Not a callback.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterable
from typing import Any

import torch

import fitlib.ranks as ranks
from fitlib.errors import describe, did_you_mean
from fitlib.host_copy import to_floats
from fitlib.metrics.collection import Metrics
from fitlib.running_loss import RunningLoss

Record = dict[str, Any]
# Values the loop owns: a callback may not add a value of these names.
LOOP_KEYS = ("epoch", "step", "train_loss", "valid_loss", "lr", "time")
# The order of the first callback that reads the record (ReduceLROnPlateau):
# a callback adds values before it.
ADD_BEFORE = 40


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
