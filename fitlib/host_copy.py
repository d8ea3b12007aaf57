"""Device values read on the host: all at once, or without waiting.

``to_floats`` reads 0-dim tensors as floats in one host transfer (the one
sync an epoch end needs). ``HostCopy`` copies them without waiting for the
device, for what reads a value only to show it (the progress bar). Not a
callback.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fitlib.metrics.accumulate import accumulation_dtype


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
        >>> from fitlib.host_copy import HostCopy
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
