"""What ``EMA`` and ``SWA`` share: averaged copies of a model's weights,
updated in place on the device, swapped into the model and back without a
second model, and the BatchNorm statistics recomputed over the training data.

``WeightAverage`` holds a float32 copy of each chosen parameter (and, with
``buffers="average"``, of each floating-point buffer: BatchNorm's running
statistics; integer buffers such as ``num_batches_tracked`` are copied). An
update is one ``torch._foreach_lerp_`` per dtype group, with a Python float
as the weight: nothing is read on the host. Parameters stored in another
dtype (bf16) are cast to float32 for the update one tensor at a time (one
float32 temporary of one tensor at a time, not of the whole model), so the
average keeps the precision the low-precision weights lack.

A swap (validation on the average) copies the live values of the averaged
tensors aside for the time of the validation (one copy of those tensors,
freed when they are put back: a validation holds it, training does not;
on CUDA the caching allocator serves it again at the next validation).

Under FSDP each rank holds a slice of every parameter (a ``DTensor``): the
average is of this rank's slices (``sharding.local``), with no communication.
Under DDP the parameters are the same on every rank after each step, and so
is their average.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

import fitlib.ranks as ranks
from fitlib.data import batches, model_device
from fitlib.errors import unknown_name
from fitlib.rng import get_rng_state, set_rng_state
from fitlib.sharding import is_sharded, local, unwrap

BUFFER_POLICIES = ("average", "copy")


def check_choice(owner: str, name: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices`` (strings), else a ValueError
    naming ``owner``'s argument, the close choice and the choices."""
    if value in choices:
        return value
    fix = f"e.g. {owner}({name}={choices[0]!r})."
    raise ValueError(unknown_name(owner, f"{name} value", value, choices, fix))


def chosen_modules(model: nn.Module, parts: Any, owner: str) -> list[nn.Module]:
    """The submodules ``parts`` names (``None``: the whole model), checked:
    an unknown name is refused with the names there are."""
    model = unwrap(model)
    if parts is None:
        return [model]
    if isinstance(parts, str) or not isinstance(parts, (list, tuple)) or not parts:
        raise TypeError(
            f"{owner}: parts must be a non-empty list of submodule names or None "
            f"(all parameters); got {parts!r}. Fix: e.g. {owner}(parts=['generator'])."
        )
    names = [n for n, _ in model.named_modules() if n]
    found = []
    for name in parts:
        if name not in names:
            fix = f"name submodules of the model, e.g. {owner}(parts=[{names[0]!r}])."
            raise ValueError(unknown_name(owner, "part", name, names[:20], fix))
        found.append(model.get_submodule(name))
    return found


def tracked_tensors(modules: list[nn.Module], buffers: str) -> list[torch.Tensor]:
    """The tensors an average follows: the modules' parameters (each once),
    and their buffers with ``buffers="average"``."""
    seen: dict[int, torch.Tensor] = {}
    for module in modules:
        for p in module.parameters():
            seen.setdefault(id(p), p)
        if buffers == "average":
            for b in module.buffers():
                seen.setdefault(id(b), b)
    return list(seen.values())


def refuse_two_averages(me: Any, callbacks: list) -> None:
    """Refuses a second weight average (``EMA`` and ``SWA``) in one fit:
    the one that ends last would silently replace the other's in the model."""
    inner = [getattr(cb, "callback", cb) for cb in callbacks]  # every(cb)
    others = [cb for cb in inner
              if cb is not me and getattr(cb, "averages_weights", False)]  # fmt: skip
    if others:
        names = sorted({me.name, *(cb.name for cb in others)})
        raise ValueError(
            f"{' and '.join(names)} in one fit: each averages the weights and "
            "puts its average in the model when the fit ends, so one would "
            "silently replace the other's. Fix: keep one of them (e.g. "
            "callbacks=[EMA(...)] or callbacks=[SWA(...)]), or compare them in "
            "two fits."
        )


class WeightAverage:
    """Averaged copies of ``tensors`` (parameters, buffers), on their device.

    Floating-point tensors are averaged in float32; others (counters) are
    copied at each update. ``updates`` counts the updates; the first copies.

    Examples:
        >>> from fitlib.weight_averaging import WeightAverage
        >>> lin = nn.Linear(2, 1)
        >>> avg = WeightAverage(list(lin.parameters()))
        >>> avg.update(0.0)  # the first update copies
        >>> with torch.no_grad():
        ...     _ = lin.weight.add_(1.0)
        >>> avg.update(0.5)  # halfway to the new weights
        >>> torch.allclose(avg.averages[0], lin.weight - 0.5)
        True
    """

    def __init__(self, tensors: list[torch.Tensor], sharded: bool = False) -> None:
        self.tensors = tensors
        self.sharded = sharded  # FSDP: read each slice again at every update
        self.averages = [_average_of(t) for t in self._live()]
        self.updates = 0
        self._stash: list[torch.Tensor] | None = None
        self._cached_plan: list | None = None

    def _live(self) -> list[torch.Tensor]:
        return [local(t).detach() for t in self.tensors]

    def update(self, weight: float) -> None:
        """Moves each average ``weight`` of the way to the live value (1 or
        the first update: a copy); an EMA's weight is ``1 - decay``, an equal
        average's ``1 / (updates + 1)``. (No grad mode needed: every input is
        detached, and this runs at every step.)"""
        if self.updates == 0:
            weight = 1.0
        for avgs, lives, kind in self._plan():
            if kind == "same":
                torch._foreach_lerp_(avgs, lives, weight)
            elif kind == "cast":  # bf16/fp16: one float32 temporary at a time
                for avg, t in zip(avgs, lives, strict=True):
                    avg.lerp_(t.float(), weight)
            else:
                torch._foreach_copy_(avgs, lives)
        self.updates += 1

    def _plan(self) -> list[tuple[list, list, str]]:
        """The update's groups (averages, live tensors, kind), worked out once;
        under FSDP each step, as the slices are read again."""
        if self.sharded:
            return _groups(self.averages, self._live())
        if self._cached_plan is None:
            self._cached_plan = _groups(self.averages, self._live())
        return self._cached_plan

    @torch.no_grad()
    def swap_in(self) -> bool:
        """Puts the averages in the model's tensors, in place; the live values
        wait in a temporary copy (one per tensor, freed by ``swap_out``).
        True when it swapped (False: swapped already, or no update yet)."""
        if self._stash is not None or self.updates == 0:
            return False
        live = self._live()
        self._stash = [t.clone() for t in live]
        _copy_into(live, self.averages)
        return True

    @torch.no_grad()
    def swap_out(self) -> None:
        """Puts the live values back, bit for bit (no-op when not swapped)."""
        if self._stash is None:
            return
        torch._foreach_copy_(self._live(), self._stash)
        self._stash = None

    @property
    def swapped(self) -> bool:
        """Whether the model holds the averages now (between swap_in and out)."""
        return self._stash is not None

    @contextmanager
    def averaged(self) -> Iterator[None]:
        """The block runs with the averages in the model, then the live values
        are back, also after an error."""
        self.swap_in()
        try:
            yield
        finally:
            self.swap_out()

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Makes the averages the model's values for good (rounded to the
        model's dtype)."""
        if self.updates:
            self._stash = None
            _copy_into(self._live(), self.averages)

    def state_dict(self) -> dict:
        return {"updates": self.updates, "averages": list(self.averages)}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        saved = state["averages"]
        if len(saved) != len(self.averages) or any(
            s.shape != a.shape for s, a in zip(saved, self.averages, strict=False)
        ):
            raise ValueError(
                f"the saved average holds {len(saved)} tensors, this model's "
                f"{len(self.averages)} (or their shapes differ): it was saved "
                "for another model or other parts. Fix: resume with the model "
                "and the parts= of the run that saved it."
            )
        for avg, s in zip(self.averages, saved, strict=True):
            avg.copy_(s)
        self.updates = int(state["updates"])


def _groups(averages: list, live: list) -> list[tuple[list, list, str]]:
    """The averages and live tensors by what an update does: lerp in one
    dtype (``same``), lerp of a float32 cast (``cast``), or ``copy``."""
    groups: dict[str, tuple[list, list]] = {}
    for avg, t in zip(averages, live, strict=True):
        kind = (
            "copy"
            if not t.is_floating_point()
            else ("same" if t.dtype == avg.dtype else "cast")
        )
        avgs, lives = groups.setdefault(kind, ([], []))
        avgs.append(avg)
        lives.append(t)
    return [(a, b, kind) for kind, (a, b) in groups.items()]


def _average_of(t: torch.Tensor) -> torch.Tensor:
    """The average's storage for ``t``: float32 for floating point."""
    dtype = torch.float32 if t.is_floating_point() else t.dtype
    if t.dtype == torch.float64:
        dtype = torch.float64
    return t.detach().to(dtype=dtype, copy=True)


def _copy_into(live: list[torch.Tensor], averages: list[torch.Tensor]) -> None:
    same = [(t, a) for t, a in zip(live, averages, strict=True) if t.dtype == a.dtype]
    other = [(t, a) for t, a in zip(live, averages, strict=True) if t.dtype != a.dtype]
    if same:
        torch._foreach_copy_([t for t, _ in same], [a for _, a in same])
    for t, a in other:
        t.copy_(a)


def average_of(model: nn.Module, parts: Any, buffers: str, owner: str) -> WeightAverage:
    """A ``WeightAverage`` of ``model``'s parameters (of the submodules
    ``parts`` names, or all), with its buffers averaged or left live."""
    modules = chosen_modules(model, parts, owner)
    return WeightAverage(tracked_tensors(modules, buffers), sharded=is_sharded(model))


def batch_norms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The model's BatchNorm layers that keep running statistics."""
    return [
        m
        for m in unwrap(model).modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    ]


def recompute_batch_norm(model: nn.Module, loader: Any, batch_fn: Any = None) -> int:
    """Recomputes the BatchNorm running statistics of ``model`` over one pass
    of ``loader`` (as ``torch.optim.swa_utils.update_bn``: reset, then a
    cumulative average over the batches), without touching the random
    generators, the modes, nor the layers' momentum. Under torch.distributed
    the statistics are averaged over the processes (each saw its shard).
    Returns the number of batches seen (0: no BatchNorm, nothing done).

    Examples:
        >>> from fitlib.weight_averaging import recompute_batch_norm
        >>> bn_model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4))
        >>> recompute_batch_norm(bn_model, data.train_dl)
        4
    """
    norms = batch_norms(model)
    if not norms:
        return 0
    momenta = [m.momentum for m in norms]
    rng = get_rng_state(loader)
    modes = [(m, m.training) for m in model.modules()]
    seen = 0
    try:
        for m in norms:
            m.reset_running_stats()
            m.momentum = None  # a cumulative average over the batches
        model.train()
        with torch.no_grad():
            for xb, _ in batches(loader, model_device(model), "train_dl", batch_fn):
                _forward(model, xb)
                seen += 1
            _average_over_ranks(norms)
    finally:
        for m, momentum in zip(norms, momenta, strict=True):
            m.momentum = momentum
        for module, training in modes:
            module.training = training
        set_rng_state(rng, loader)
    return seen


def broadcast_buffers(model: nn.Module) -> None:
    """Rank 0's floating-point buffers (BatchNorm's running statistics) on
    every rank, as DDP gives them to a validation (no-op in one process)."""
    if not ranks.active() or ranks.world_size() == 1:
        return
    with torch.no_grad():
        for b in unwrap(model).buffers():
            if b.is_floating_point():
                torch.distributed.broadcast(b, src=0)


def _forward(model: nn.Module, xb: Any) -> None:
    if isinstance(xb, dict):
        model(**xb)
    elif isinstance(xb, (tuple, list)):
        model(*xb)
    else:
        model(xb)


def _average_over_ranks(norms: list[nn.Module]) -> None:
    if not ranks.active() or ranks.world_size() == 1:
        return
    for m in norms:
        for t in (m.running_mean, m.running_var):
            if t is not None:
                t.copy_(ranks.all_reduce_sum(t) / ranks.world_size())
