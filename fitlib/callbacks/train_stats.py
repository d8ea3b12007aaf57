"""``TrainStats``: speed, gradient norm and weight norm at an interval of steps.

Per optimizer step it computes the global L2 norm of the gradients on the
device (one fused norm per parameter group of tensors, then the norm of those
norms) and appends it to a list: no host-device sync. Every
``every_n_steps`` steps the interval is summarized with one host transfer.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

import fitlib.ranks as ranks
from fitlib.callback import Callback
from fitlib.host_copy import to_floats
from fitlib.metrics.accumulate import accumulation_dtype
from fitlib.running_loss import batch_size
from fitlib.sharding import is_sharded, local
from fitlib.tracking import (
    TrainClock,
    check_every_n_steps,
    check_state_keys,
)

_STATE_KEYS = (
    "last_step",
    "samples",
    "seconds",
    "grad_sum",
    "grad_finite",
    "grad_steps",
    "history",
)


def global_norm(tensors: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """The L2 norm of all ``tensors`` seen as one vector, a 0-dim device tensor.

    ``torch._foreach_norm`` computes the norm of each tensor (fused on CUDA);
    the norm of those norms is the global one. None for no tensors.

    Examples:
        >>> from fitlib.callbacks.train_stats import global_norm
        >>> global_norm([torch.tensor([3.0]), torch.tensor([4.0])])
        tensor(5.)
    """
    tensors = list(tensors)
    if not tensors:
        return None
    norms = torch._foreach_norm(tensors)
    first = norms[0]
    if any(n.device != first.device for n in norms):  # a model across devices
        norms = [n.to(first.device) for n in norms]
    # In float32 at least: a float16 sum of squares overflows above 256.
    dtype = torch.promote_types(first.dtype, torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms).to(dtype))


class TrainStats(Callback):
    """Reports seconds per step, samples per second, gradient and weight norms.

    At every step that is a multiple of ``every_n_steps`` (state key ``step``)
    it appends to ``history`` a dict with ``step``, ``sec_per_step`` and
    ``samples_per_sec`` (wall-clock training time since the previous report,
    validation left out; every training batch's samples count, also those of
    an accumulation that did not step), ``grad_norm`` (the mean over the
    interval's steps of the global L2 norm of all gradients), ``weight_norm``
    (the global L2 norm of all parameters after the step) and
    ``nonfinite_steps`` (steps whose gradient norm was inf or NaN, e.g. float16
    steps the loss scaler skipped; they are left out of ``grad_norm``, which is
    NaN when no step was finite), and logs it on the ``"fitlib.stats"``
    logger at INFO level.

    The gradient norm is taken in ``on_backward_end`` of the batches that step
    (``skip_step`` False), at order -15: after ``MixedPrecision`` (-20)
    unscaled the gradients and before ``GradientClipping`` (-10), so it is the
    raw norm of the true gradients; after clipping it would only repeat
    ``min(norm, max_norm)`` and hide how large the gradients really are.

    Per step this costs the norm kernels and a list append, never a sync;
    each report costs one host transfer. The wall-clock time is read on the
    host right after that transfer, so it includes the device's work. History
    and counters restart at each fit; after a resume (``iteration > 0``) they
    continue from ``load_state_dict``.

    Args:
        every_n_steps: optimizer steps between two reports (an int >= 1).

    Examples:
        >>> stats = TrainStats(every_n_steps=4)
        >>> history = fit(3, model, F.cross_entropy, opt, data, callbacks=[stats])
        >>> stats.history[-1]
        {'step': 12, 'sec_per_step': ..., 'samples_per_sec': ...,
         'grad_norm': 0.47..., 'weight_norm': 2.66..., 'nonfinite_steps': 0}
    """

    order = -15  # after MixedPrecision unscales (-20), before clipping (-10)
    in_lr_find = False  # a sweep is not part of the run it records
    # Under torch.distributed rank 0 alone reports; with a sharded model
    # (FSDP) every rank takes part in the norms, each holding a slice.

    def __init__(self, every_n_steps: int = 100) -> None:
        self.every_n_steps = check_every_n_steps(every_n_steps, "TrainStats")
        self.logger = logging.getLogger("fitlib.stats")
        self._sharded, self._active = False, True
        self._reset()

    def _reset(self) -> None:
        self.history: list[dict] = []
        self._norms: list[torch.Tensor] = []  # this interval's, on the device
        # Restored from a checkpoint: the interval's part before the resume.
        self._grad_sum, self._grad_finite, self._grad_steps = 0.0, 0, 0
        self._last_step, self._samples = 0, 0
        self._clock = TrainClock()

    # -- hooks -----------------------------------------------------------------
    def on_train_begin(self, iteration: int, model: nn.Module) -> None:
        """Runs before training: starts afresh, unless the fit is resumed."""
        self._sharded = model is not None and is_sharded(model)
        self._active = ranks.is_main() or self._sharded
        if iteration == 0:
            self._reset()

    def on_epoch_begin(self) -> None:
        """Runs at each epoch's start: training time counts again."""
        self._clock.resume()

    def on_backward_end(self, model: nn.Module, skip_step: bool) -> None:
        """Runs after ``backward()``: the gradient norm of a batch that steps."""
        if skip_step or not self._active:
            return
        norm = self._norm(p.grad for p in model.parameters() if p.grad is not None)
        if norm is not None:
            self._norms.append(norm)

    def on_batch_end(
        self,
        train: bool,
        step: int,
        model: nn.Module,
        last_target: Any,
        last_input: Any,
    ) -> None:
        """Runs after each batch: counts samples; reports at every n-th step."""
        if not self._active:
            return
        if not train:
            self._clock.pause()  # validation is not training time
            return
        self._samples += batch_size(last_target, last_input)
        if step % self.every_n_steps == 0 and step > self._last_step:
            self._report(step, model)

    def on_epoch_end(self, mid_epoch: bool) -> None:
        """Runs after validation: stops the training clock (if validation did
        not); after a validation inside the epoch, training time counts again."""
        if mid_epoch:
            self._clock.resume()
        else:
            self._clock.pause()

    # -- reports ---------------------------------------------------------------
    def _report(self, step: int, model: nn.Module) -> None:
        with torch.no_grad():
            weight = self._norm(p.detach() for p in model.parameters())
        grad_sum, finite, n_norms, read = self._read_interval([weight])
        seconds = self._clock.lap()  # after the transfer: the device is done
        stats = {
            "step": step,
            "sec_per_step": seconds / (step - self._last_step),
            "samples_per_sec": self._samples / seconds if seconds > 0 else math.nan,
            "grad_norm": grad_sum / finite if finite else math.nan,
            "weight_norm": read[0],
            "nonfinite_steps": n_norms - finite,
        }
        self.history.append(stats)
        self._norms, self._last_step, self._samples = [], step, 0
        self._grad_sum, self._grad_finite, self._grad_steps = 0.0, 0, 0
        if ranks.is_main():
            self.logger.info(_line(stats))

    def _norm(self, tensors: Iterable[torch.Tensor]) -> torch.Tensor | None:
        """``global_norm``; of a sharded model's slices, summed over the ranks."""
        if not self._sharded:
            return global_norm(tensors)
        norm = global_norm(local(t) for t in tensors)
        # (an asynchronous all-reduce: no host sync)
        return None if norm is None else ranks.all_reduce_sum(norm.square()).sqrt()

    def _read_interval(
        self, extra: list[torch.Tensor]
    ) -> tuple[float, int, int, list[float]]:
        """The interval's sum and count of finite gradient norms, its number of
        norms, and ``extra`` (0-dim tensors), read in one host transfer."""
        n_norms = self._grad_steps + len(self._norms)
        if not self._norms:
            return self._grad_sum, self._grad_finite, n_norms, to_floats(extra)
        # In float64: the sum then splits exactly at a checkpoint (see state_dict).
        norms = torch.stack(self._norms)
        norms = norms.to(accumulation_dtype(norms.device))
        finite = torch.isfinite(norms)
        read = to_floats([torch.where(finite, norms, 0).sum(), finite.sum(), *extra])
        grad_sum, n_finite = self._grad_sum + read[0], self._grad_finite + int(read[1])
        return grad_sum, n_finite, n_norms, read[2:]

    # -- saving ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """History and the interval's sums as python values (one sync)."""
        grad_sum, finite, n_norms, _ = self._read_interval([])
        return {
            "last_step": self._last_step,
            "samples": self._samples,
            "seconds": self._clock.elapsed(),
            "grad_sum": grad_sum,
            "grad_finite": finite,
            "grad_steps": n_norms,
            "history": [dict(h) for h in self.history],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict``: the next report continues its interval."""
        check_state_keys(state, _STATE_KEYS, "TrainStats")
        self._reset()
        self.history = [dict(h) for h in state["history"]]
        self._last_step, self._samples = int(state["last_step"]), int(state["samples"])
        self._grad_sum = float(state["grad_sum"])
        self._grad_finite = int(state["grad_finite"])
        self._grad_steps = int(state["grad_steps"])
        self._clock.reset(state["seconds"])
        self._clock.pause()  # until the resumed epoch begins

    def __repr__(self) -> str:
        return f"{self.name}(every_n_steps={self.every_n_steps})"


def _line(stats: dict) -> str:
    line = (
        f"step {stats['step']}: {stats['sec_per_step']:.4g} s/step, "
        f"{stats['samples_per_sec']:.1f} samples/s, grad_norm "
        f"{stats['grad_norm']:.4g}, weight_norm {stats['weight_norm']:.4g}"
    )
    bad = stats["nonfinite_steps"]
    return f"{line}, {bad} steps with non-finite gradients" if bad else line
