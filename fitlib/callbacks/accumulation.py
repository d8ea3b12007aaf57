"""``GradientAccumulation``: one optimizer step per ``n_batches`` batches.

The gradients of ``n_batches`` batches add up before each step, so the step
equals one on an ``n_batches`` times larger batch: each batch's loss is scaled
by its share of the group's samples. A group shorter than ``n_batches`` at the
end of an epoch (the ragged last group) steps too, with its gradients
rescaled to its own sample count, as is a group whose last batch is smaller.

``n_batches`` may change by epoch, as Lightning's
``GradientAccumulationScheduler``: ``{0: 8, 4: 4, 8: 1}`` accumulates 8
batches per step in epochs 0-3, 4 in epochs 4-7, then 1; epochs before the
first key accumulate 1. A group takes the factor of the epoch it starts in.

Schedulers and the LR finder count optimizer steps: this callback sets
``skip_step`` on the batches that do not step, and sets the fit's ``n_steps``
in ``on_train_begin`` to the steps the epochs will take, each at its own
factor. A loader without a length hides where an epoch ends, so there a group
may span two epochs, and a group still partial when training ends is not
stepped.
"""

from __future__ import annotations

import bisect
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fitlib.callback import Callback, inner_callback
from fitlib.checks import check_int, len_or_none
from fitlib.errors import ArgTypeError, is_int
from fitlib.running_loss import batch_size


class GradientAccumulation(Callback):
    """Steps the optimizer every ``n_batches`` batches, as on one larger batch.

    Args:
        n_batches: the number of batches whose gradients each step uses; or
            a dict epoch -> number from that epoch on (the keys ints >= 0,
            the values ints >= 1; before the first key, 1).
        n_steps: the former name of ``n_batches`` (deprecated: the state key
            ``n_steps`` counts optimizer steps, this argument batches).

    Examples:
        Batches of 16, one optimizer step per 4 of them, as with batches of 64:

        >>> learn.fit(3, lr=1e-3, callbacks=[GradientAccumulation(4)])
        History(3 epochs: train_loss ... -> ..., valid_loss ... -> ...,
                accuracy ... -> ...)

        Larger steps early, smaller ones later (4 batches, then 2, then 1):

        >>> acc = GradientAccumulation({0: 4, 1: 2, 2: 1})
        >>> learn.fit(3, lr=1e-3, callbacks=[acc])
        History(3 epochs: train_loss ... -> ..., valid_loss ... -> ...,
                accuracy ... -> ...)
        >>> [acc.batches_at(epoch) for epoch in range(4)]
        [4, 2, 1, 1]
    """

    order = -30  # before MixedPrecision and clipping, which act only on steps
    compiled_step_safe = True  # its step hooks read nothing on the host

    def __init__(
        self, n_batches: int | Mapping[int, int] | None = None, *, n_steps: Any = None
    ) -> None:
        if n_steps is not None:
            if n_batches is not None:
                raise ValueError(
                    f"{self.name}: got n_batches={n_batches!r} and n_steps="
                    f"{n_steps!r}; n_steps is the former name of n_batches. Fix: "
                    f"pass one, e.g. {self.name}(n_batches={n_batches!r})."
                )
            warnings.warn(
                f"{self.name}(n_steps=...) is deprecated: the argument counts "
                f"batches. Use {self.name}(n_batches={n_steps!r}).",
                DeprecationWarning,
                stacklevel=2,
            )
            n_batches = n_steps
        if isinstance(n_batches, Mapping):
            self.n_batches: int | dict[int, int] = _check_schedule(n_batches)
        else:
            self.n_batches = check_int(
                n_batches, "n_batches", minimum=1, owner=self.name, example=4
            )
        given = self.n_batches
        schedule = {0: 1, **(given if isinstance(given, dict) else {0: given})}
        self._epochs, self._factors = list(schedule), list(schedule.values())
        self._count = self._samples = self._group = self._first = self._size = 0
        self._no_sync: Any = None

    # -- hooks -----------------------------------------------------------------
    def on_train_begin(
        self,
        model: torch.nn.Module,
        data: Any,
        n_epochs: int | None,
        max_steps: int | None,
        iteration: int,
        callbacks: Sequence = (),
    ) -> dict:
        """Runs before training: clears stale gradients, counts the steps."""
        self._refuse_another(callbacks)
        if iteration == 0:  # a resumed fit keeps its loaded position
            model.zero_grad(set_to_none=True)  # an interrupted group's gradients
            self._count = self._samples = 0
        self._len = len_or_none(data.train_dl)
        if self._len is None or n_epochs is None:
            return {"n_steps": max_steps}
        # Every epoch of the fit, also when resumed: schedules span the whole.
        per_epoch = (math.ceil(self._len / self.batches_at(e)) for e in range(n_epochs))
        steps = sum(per_epoch)
        return {"n_steps": min(steps, max_steps or steps)}

    def _refuse_another(self, callbacks: Sequence) -> None:
        others = [
            inner_callback(cb)
            for cb in callbacks
            if isinstance(inner_callback(cb), GradientAccumulation)
            and inner_callback(cb) is not self
        ]
        if others:
            raise ValueError(
                f"{self.name}: the fit has two, {self!r} and {others[0]!r}; each "
                "would skip steps of its own. Fix: keep one (a dict gives the "
                f"factor by epoch: {self.name}({{0: 8, 4: 4, 8: 1}}))."
            )

    def batches_at(self, epoch: int) -> int:
        """The number of batches a step takes in ``epoch`` (0-based)."""
        return self._factors[bisect.bisect_right(self._epochs, epoch) - 1]

    def on_batch_begin(
        self,
        train: bool,
        model: Any,
        last_target: Any,
        last_input: Any,
        num_batch: int,
        epoch: int,
    ) -> None:
        """Runs before the forward: places the batch in its group."""
        if not train:
            return
        self._size = batch_size(last_target, last_input)
        if self._count == 0:  # a group starts: how many batches, how large
            n = self.batches_at(epoch)
            left = n if self._len is None else self._len - num_batch
            self._group, self._first = max(min(n, left), 1), self._size
        if self._count + 1 < self._group:  # no gradient all-reduce before the step
            if hasattr(model, "no_sync"):  # DistributedDataParallel
                self._no_sync = model.no_sync()
                self._no_sync.__enter__()
            elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
                model.set_requires_gradient_sync(False)
                self._no_sync = model

    def on_backward_begin(self, last_loss: torch.Tensor) -> dict:
        """Runs before backward: scales the loss by its share of the group."""
        self._samples += self._size
        return {"last_loss": last_loss * (self._size / (self._group * self._first))}

    def on_backward_end(self, model: torch.nn.Module) -> dict | None:
        """Runs after backward: skips the step until the group is complete."""
        self._count += 1
        if self._count < self._group:
            return {"skip_step": True}
        planned, samples = self._group * self._first, self._samples
        self._count = self._samples = 0
        if samples != planned:  # a smaller last batch: rescale to its mean
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(planned / samples)
        return None

    def on_step_end(self, skip_step: bool) -> dict | None:
        """Runs after the (skipped) step: keeps the gradients of a group."""
        return {"skip_zero": True} if skip_step and self._count else None

    def on_batch_end(self) -> None:
        """Runs after each batch: ends a ``no_sync`` block."""
        self._leave_no_sync()

    def on_train_end(self) -> None:
        """Runs at the end, also after an error: ends a ``no_sync`` block."""
        self._leave_no_sync()

    def _leave_no_sync(self) -> None:
        if self._no_sync is None:
            return
        if hasattr(self._no_sync, "__exit__"):
            self._no_sync.__exit__(None, None, None)
        else:
            self._no_sync.set_requires_gradient_sync(True)
        self._no_sync = None

    def state_dict(self) -> dict:
        """The position in the current group (batches, samples)."""
        return {
            "count": self._count,
            "samples": self._samples,
            "group": self._group,
            "first": self._first,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores what ``state_dict`` returned."""
        self._count, self._samples = int(state["count"]), int(state["samples"])
        self._group, self._first = int(state["group"]), int(state["first"])

    def __repr__(self) -> str:
        return f"{self.name}(n_batches={self.n_batches!r})"

    @property
    def n_steps(self) -> int:
        """The former name of ``n_batches`` (deprecated)."""
        warnings.warn(
            f"{self.name}.n_steps is deprecated: it counts batches. Use "
            f"{self.name}.n_batches.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.n_batches


def _check_schedule(n_batches: Mapping) -> dict[int, int]:
    """A schedule epoch -> batches per step, checked; sorted by epoch."""
    fix = "Fix: e.g. GradientAccumulation({0: 8, 4: 4, 8: 1}) (epoch: batches)."
    if not n_batches:
        raise ValueError(f"GradientAccumulation: n_batches is an empty dict. {fix}")
    for epoch, n in n_batches.items():
        for value, what, least in ((epoch, "epoch (key)", 0), (n, "value", 1)):
            if not is_int(value) or value < least:
                error = ValueError if is_int(value) else ArgTypeError
                raise error(
                    f"GradientAccumulation: each {what} of n_batches must be an "
                    f"int >= {least}; got {value!r} ({type(value).__name__}) in "
                    f"{dict(n_batches)!r}. {fix}"
                )
    return {int(e): int(n_batches[e]) for e in sorted(n_batches)}
