"""``GradientClipping``: clips the gradients right before the optimizer step.

Clipping by total norm rescales all gradients together so that their norm is
at most ``max_norm``; clipping by value clamps each gradient element to
``[-max_value, max_value]``. Both run on the device without reading a value
back, so clipping forces no host-device sync.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fitlib.callback import Callback
from fitlib.errors import is_number


class GradientClipping(Callback):
    """Clips the model's gradients by total norm or by value before each step.

    Exactly one of ``max_norm`` and ``max_value`` is given. Gradients are
    clipped once, right before the step that uses them: a batch whose step is
    skipped (``skip_step`` already True, e.g. gradient accumulation, order -30,
    still accumulating) is left alone. Mixed precision (order -20) unscales
    the gradients before this callback runs, so the bounds apply to the true
    gradients.

    Args:
        max_norm: the largest total norm of all gradients (viewed as one
            vector); larger gradients are scaled down together.
        max_value: the largest absolute value of any gradient element; larger
            elements are clamped.
        norm_type: the order of the norm for ``max_norm`` (``2.0`` is the
            Euclidean norm, ``math.inf`` the largest absolute element).

    Attributes:
        last_norm: with ``max_norm``, the total norm of the gradients before
            the latest clipping, as a detached device tensor (None before the
            first step, and with ``max_value``). Reading it is a host-device
            sync: read it between epochs, not per batch.

    Examples:
        >>> fit(3, model, F.cross_entropy, opt, data,
        ...     callbacks=[GradientClipping(max_norm=1.0)])
        History(3 epochs: train_loss ... -> ..., valid_loss ... -> ...)
    """

    order = -10  # after mixed precision (-20) unscales, before anything reads
    compiled_step_safe = True  # its step hooks read nothing on the host
    cuda_graph_safe = True  # device work only: CudaGraph may capture it

    def __init__(
        self,
        max_norm: float | None = None,
        max_value: float | None = None,
        norm_type: float = 2.0,
    ) -> None:
        if (max_norm is None) == (max_value is None):
            got = "neither" if max_norm is None else f"both ({max_norm=}, {max_value=})"
            raise ValueError(
                "GradientClipping needs exactly one of max_norm (clip the total "
                "norm of the gradients) and max_value (clip each gradient "
                f"element); got {got}. Fix: pass one, e.g. "
                "GradientClipping(max_norm=1.0); for both, add two callbacks."
            )
        self.max_norm = _positive("max_norm", max_norm)
        self.max_value = _positive("max_value", max_value)
        self.norm_type = _norm_type(norm_type, max_norm is not None)
        self.last_norm: torch.Tensor | None = None

    def on_backward_end(self, model: nn.Module, skip_step: bool) -> None:
        """Runs after ``backward()``: clips, unless this batch has no step."""
        if skip_step:
            return
        if self.max_norm is not None:
            # foreach=None picks the fused kernels where the device has them
            # (foreach=True raises on CPU); no error_if_nonfinite: it syncs.
            norm = nn.utils.clip_grad_norm_(
                model.parameters(), self.max_norm, self.norm_type, foreach=None
            )
            self.last_norm = norm.detach()
        else:
            nn.utils.clip_grad_value_(model.parameters(), self.max_value, foreach=None)

    def graph_replay(self) -> Any:
        """For ``CudaGraph``, right after it captured the step with this hook
        inside: what to run after each replay, which rewrites the captured
        norm tensor but runs no Python: ``last_norm`` put back to that tensor
        (an eager step in between, a ragged batch, set it to its own)."""
        captured = self.last_norm
        if captured is None:  # (max_value: no norm)
            return None

        def replayed() -> None:
            self.last_norm = captured

        return replayed

    def __repr__(self) -> str:
        if self.max_norm is not None:
            bound = f"max_norm={self.max_norm}, norm_type={self.norm_type}"
        else:
            bound = f"max_value={self.max_value}"
        return f"{self.name}({bound})"


def _positive(name: str, value: Any) -> float | None:
    if value is None:
        return None
    # `not 0 < value` also catches NaN; an infinite bound would clip nothing.
    if not is_number(value) or not 0 < value < math.inf:
        raise ValueError(
            f"{name} must be a positive finite number; got {value!r} "
            f"({type(value).__name__}). Fix: e.g. GradientClipping({name}=1.0)."
        )
    return float(value)


def _norm_type(value: Any, by_norm: bool) -> float:
    if not is_number(value) or not value > 0:
        raise ValueError(
            f"norm_type must be a positive number (math.inf for the largest "
            f"element); got {value!r} ({type(value).__name__}). Fix: e.g. "
            "norm_type=2.0."
        )
    if not by_norm and value != 2.0:
        raise ValueError(
            f"norm_type={value!r} applies only to max_norm; clipping by "
            "max_value uses no norm. Fix: drop norm_type, or clip by max_norm."
        )
    return float(value)
