"""A loss averaged over batches: what each batch's loss is a mean over, the
running sum on the device, and the smoothed loss on the host.

``batch_size`` (a batch's samples) and ``loss_count`` (what a token or pixel
loss averages over, counted on the device) give each batch's weight;
``RunningLoss`` keeps the weighted sum as device tensors until read (the
epoch's ``train_loss`` and loss parts, the loggers' running losses);
``LossSmoother`` computes ``smooth_loss``'s average from python floats. Not a
callback.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from fitlib.errors import add_note, describe
from fitlib.host_copy import to_floats
from fitlib.loss_checks import ignore_index_of, is_class_index_loss
from fitlib.metrics.accumulate import accumulation_dtype, weighted_sum

# Batches whose losses wait as separate tensors: then they are summed into
# one on the device (no sync), so an epoch of any length keeps little.
FOLD = 1024


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
        >>> from fitlib.running_loss import loss_count
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
        >>> from fitlib.host_copy import to_floats
        >>> from fitlib.running_loss import RunningLoss
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


SMOOTH_BETA = 0.98  # smooth_loss's, as fastai's


class LossSmoother:
    """The average of ``smooth_loss``, on the host, over python floats.

    A callback that needs the smoothed loss only at epoch end keeps the raw
    losses and smooths them here, in float64: the same numbers, without the
    device op per batch that ``state['smooth_loss']`` costs.

    Examples:
        >>> from fitlib.running_loss import LossSmoother
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
