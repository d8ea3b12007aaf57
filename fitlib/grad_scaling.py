"""A ``GradScaler``'s overflow, read without a sync: ``found_inf`` (did this
step's unscale find a gradient that is not finite?) and ``unscale_all``
(several optimizers skip a step together). What ``MixedPrecision`` and
``HPOptimizer``'s scaled step share."""

from __future__ import annotations

from typing import Any

import torch


def found_inf(scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer) -> Any:
    """1 (a device tensor) when the scaler's ``unscale_(opt)`` found a gradient
    that is not finite in this step, else 0 (also when nothing was checked)."""
    # GradScaler keeps this per optimizer and device until update(); no public
    # accessor exists, and reading it here costs no sync.
    found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values()
    if not found:
        return 0
    first = next(iter(found))
    return (sum(f.to(first.device) for f in found) > 0).int()


def unscale_all(scaler: torch.amp.GradScaler, opts: list[torch.optim.Optimizer]) -> Any:
    """``scaler.unscale_`` of every optimizer, then a non-finite gradient in any
    of them marks them all, so ``scaler.step`` skips every one (an encoder
    stepped without its decoder would drift). Returns the 0/1 device tensor
    of ``found_inf`` (no sync)."""
    for o in opts:
        scaler.unscale_(o)
    if len(opts) == 1:
        return found_inf(scaler, opts[0])
    any_inf = sum(found_inf(scaler, o) for o in opts)
    for o in opts:  # (the per-optimizer flags the scaler's step() reads)
        for flag in scaler._per_optimizer_states[id(o)][
            "found_inf_per_device"
        ].values():
            flag.copy_((any_inf > 0).to(flag.dtype))
    return (any_inf > 0).int()
