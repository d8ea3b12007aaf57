"""``MixedPrecision``: the forward pass and the loss in float16 or bfloat16.

Autocast is on from ``on_batch_begin`` to the loss (``on_backward_begin``),
for validation batches too (to ``on_batch_end``); ``Learner.validate``,
``get_preds`` and ``predict`` run it as well (``in_evaluation``), so they
give a fit's validation values exactly, and outputs in ``dtype``.
With float16 a ``torch.amp.GradScaler`` scales the loss so small gradients
do not underflow, and changes the scale as training goes (halved after a
step with non-finite gradients, doubled after ``growth_interval`` good ones).
The gradients are unscaled in ``on_backward_end`` before any later callback
sees them (so clipping works), and a step whose gradients are not finite is
skipped and counted.

Speed: with an optimizer created with ``fused=True`` (SGD, Adam, AdamW) the
skip happens inside the optimizer's kernel, on the device. Any other
optimizer makes the scaler read on the host, each step, whether the
gradients were finite: one host-device sync per step. ``Learner.to_fp16()``
creates its optimizer fused. bfloat16 needs no scaler and never syncs.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from fitlib.callback import Callback
from fitlib.checks import check_int, check_number
from fitlib.data import model_device
from fitlib.grad_scaling import unscale_all
from fitlib.sharding import is_sharded, torch_optimizers

_DTYPES = {
    torch.float16: torch.float16,
    "float16": torch.float16,
    "fp16": torch.float16,
    torch.bfloat16: torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


class MixedPrecision(Callback):
    """Trains with autocast in ``dtype`` and, for float16, dynamic loss scaling.

    ``skipped_steps`` counts the steps skipped for non-finite gradients (reading
    it syncs with the device). ``state_dict`` holds the scaler's state.

    Args:
        dtype: ``torch.float16`` (CUDA; a loss scaler is used) or
            ``torch.bfloat16`` (CUDA from Ampere on, and CPUs; no scaler).
        init_scale: the first loss scale (float16).
        growth_interval: good steps before the scale doubles (float16).

    Examples:
        >>> fit(3, model, F.cross_entropy, opt, data,
        ...     callbacks=[MixedPrecision(torch.bfloat16)])  # also on a CPU
        History(3 epochs: train_loss ... -> ..., valid_loss ... -> ...)
        >>> MixedPrecision()  # float16 with a loss scaler, on a GPU
        MixedPrecision(dtype=torch.float16)
    """

    order = -20  # after GradientAccumulation, before clipping and user callbacks
    compiled_step_safe = True  # its step hooks read nothing on the host
    cuda_graph_safe = True  # device work only (float16: CudaGraph wants it fused)
    in_evaluation = True  # validate, get_preds, predict: in this precision too

    def __init__(
        self,
        dtype: torch.dtype | str = torch.float16,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
    ) -> None:
        # The type check first: an unhashable value fails the lookup itself.
        if not isinstance(dtype, (torch.dtype, str)) or dtype not in _DTYPES:
            raise ValueError(
                f"MixedPrecision: unknown dtype {dtype!r}. Fix: torch.float16 "
                "(with loss scaling, for CUDA) or torch.bfloat16 (CUDA from "
                "Ampere on, and CPUs)."
            )
        _check_scaler_args(init_scale, growth_interval)
        self.dtype = _DTYPES[dtype]
        self.init_scale, self.growth_interval = init_scale, growth_interval
        self.scaler: torch.amp.GradScaler | None = None
        self._pending_state: dict | None = None  # loaded before the scaler exists
        self._skipped: Any = 0  # a device tensor once a step was checked
        self._autocast: Any = None
        self._device_type = "cpu"  # of the model, set at train begin
        self._in_autocast = self._unscaled = False
        self._found: Any = 0  # this step's non-finite flag (a device tensor)

    @property
    def skipped_steps(self) -> int:
        """The number of steps skipped because the gradients were not finite."""
        return int(self._skipped)

    # -- hooks -----------------------------------------------------------------
    def on_train_begin(self, model: torch.nn.Module, opt: Any) -> None:
        """Runs before training: checks the device, sets up autocast and scaler
        (none without ``opt``: an evaluation, which takes no step)."""
        device = model_device(model)
        _check_device(self.dtype, device)
        self._device_type = device.type
        self._autocast = torch.autocast(device.type, dtype=self.dtype)
        if self.dtype is torch.float16 and opt is not None:
            if is_sharded(model):
                raise ValueError(
                    "MixedPrecision(float16) with a model sharded by FSDP: each "
                    "rank would find overflows in its own slice of the gradients "
                    "and skip steps on its own, so the ranks would drift apart. "
                    "Fix: bfloat16 (learn.to_bf16()), which needs no loss scaling."
                )
            self._attach_scaler(device, opt)

    def on_batch_begin(self) -> None:
        """Runs before each forward pass: turns autocast on."""
        self._autocast.__enter__()
        self._in_autocast = True

    def on_backward_begin(self, last_loss: torch.Tensor) -> dict | None:
        """Runs after the loss: autocast off; scales the loss for backward."""
        self._leave_autocast()
        if self.scaler is not None:
            return {"last_loss": self.scaler.scale(last_loss)}
        if self.dtype is torch.float16:  # a step, but no opt at train begin
            raise ValueError(
                "MixedPrecision(float16) has no loss scaler: on_train_begin got "
                "no optimizer. Fix: handler.on_train_begin(n_epochs, model=model, "
                "opt=opt) before the first batch."
            )
        return None

    def on_backward_end(self, opt: Any, skip_step: bool) -> None:
        """Runs after backward: unscales the gradients of a step to come."""
        if self.scaler is not None and not skip_step:
            # Also finds non-finite gradients: in any part, all parts skip.
            self._found = unscale_all(self.scaler, torch_optimizers(opt))
            self._unscaled = True

    def on_step_end(self, opt: Any) -> None:
        """Runs after the step: counts a skipped step, updates the scale."""
        if self._unscaled:
            self._skipped = self._skipped + self._found
            self.scaler.update()
            self._unscaled = False

    def on_batch_end(self) -> None:
        """Runs after each batch: autocast off (validation has no backward)."""
        self._leave_autocast()

    def on_train_end(self, opt: Any) -> None:
        """Runs at the end, also after an error: autocast off, scaler detached."""
        self._leave_autocast()
        if opt is not None and getattr(opt, "grad_scaler", None) is self.scaler:
            opt.grad_scaler = None  # a later fit without this callback steps plainly
        if self._unscaled:  # an error between unscale_ and update()
            self._drop_unfinished_step()

    def graph_replay(self) -> Any:
        """For ``CudaGraph``, right after it captured the step with these hooks
        inside: what to run after each replay, which runs their kernels but
        not their Python: autocast off, and the captured unscale's state (its
        found-inf tensors, which each replay rewrites) for ``on_step_end``."""
        if self.scaler is None:
            return self._leave_autocast
        found, unscaled = self._found, self._unscaled
        states = {k: dict(v) for k, v in self.scaler._per_optimizer_states.items()}

        def replayed() -> None:
            self._leave_autocast()
            self._found, self._unscaled = found, unscaled
            for key, value in states.items():
                self.scaler._per_optimizer_states[key] = dict(value)

        return replayed

    def _leave_autocast(self) -> None:
        if self._in_autocast:
            self._in_autocast = False
            self._autocast.__exit__(None, None, None)

    def _drop_unfinished_step(self) -> None:
        # The scaler would refuse the next unscale_ of this optimizer until an
        # update(); a fresh scaler with the same state forgets the half-done
        # step, and update() would count it as a step, which it never was.
        state = self.scaler.state_dict()
        self.scaler = self._new_scaler(self._device_type)
        self.scaler.load_state_dict(state)
        self._unscaled = False

    def _new_scaler(self, device_type: str) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(
            device_type,
            init_scale=self.init_scale,
            growth_interval=self.growth_interval,
        )

    def _attach_scaler(self, device: torch.device, opt: Any) -> None:
        if self.scaler is None:
            self.scaler = self._new_scaler(device.type)
        if self._pending_state is not None:
            self.scaler.load_state_dict(self._pending_state)
            self._pending_state = None
        opt.grad_scaler = self.scaler
        slow = [o for o in torch_optimizers(opt)
                if not getattr(o, "_step_supports_amp_scaling", False)]  # fmt: skip
        if device.type == "cuda" and slow:
            warnings.warn(
                f"MixedPrecision(float16) with {type(slow[0]).__name__} not "
                "fused: the GradScaler reads on the host, each step, whether "
                "the gradients were finite (one device sync per step). Fix: "
                "create the optimizer with fused=True (SGD, Adam, AdamW); "
                "Learner.to_fp16() does, when called before the first fit.",
                RuntimeWarning,
                stacklevel=2,
            )

    # -- saving ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """The scaler's state (scale, growth tracker) and the skipped steps."""
        state: dict = {"skipped_steps": self.skipped_steps}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        elif self._pending_state is not None:
            state["scaler"] = dict(self._pending_state)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restores what ``state_dict`` returned."""
        self._skipped = int(state.get("skipped_steps", 0))
        scaler_state = state.get("scaler")
        if scaler_state is None:  # saved before any scaler existed: none now
            self.scaler, self._pending_state = None, None
        elif self.scaler is not None:
            self.scaler.load_state_dict(scaler_state)
        else:
            self._pending_state = scaler_state

    def __repr__(self) -> str:
        return f"{self.name}(dtype={self.dtype})"


def _check_scaler_args(init_scale: Any, growth_interval: Any) -> None:
    check_number(
        init_scale, "init_scale", above=0, below=math.inf, what="a finite number",
        owner="MixedPrecision", example="2.0**16",
    )  # fmt: skip
    check_int(
        growth_interval, "growth_interval", minimum=1, owner="MixedPrecision",
        example=2000,
    )  # fmt: skip


def _check_device(dtype: torch.dtype, device: torch.device) -> None:
    """Raises for a device that cannot run ``dtype``; warns where it is slow."""
    name = "float16" if dtype is torch.float16 else "bfloat16"
    if not torch.amp.is_autocast_available(device.type):
        raise ValueError(
            f"MixedPrecision({name}): autocast does not run on {device.type!r} "
            "devices. Fix: train on CUDA (or the CPU with bfloat16), or drop "
            "MixedPrecision."
        )
    bf16_ok = device.type != "cuda" or torch.cuda.is_bf16_supported(
        including_emulation=False
    )
    if dtype is torch.bfloat16 and not bf16_ok:
        raise ValueError(
            f"MixedPrecision(bfloat16): {torch.cuda.get_device_name(device)} has "
            "no bfloat16 support (it needs an Ampere GPU or newer). Fix: "
            "MixedPrecision(torch.float16) / learn.to_fp16()."
        )
    if device.type == "cpu" and dtype is torch.float16:
        warnings.warn(
            "MixedPrecision(float16) on the CPU: autocast and loss scaling run as "
            "on a GPU, but few CPU kernels are fast in float16, so this is "
            "usually slower than float32. Fix: bfloat16 is the CPU's half type: "
            "MixedPrecision(torch.bfloat16) / learn.to_bf16().",
            RuntimeWarning,
            stacklevel=3,
        )
