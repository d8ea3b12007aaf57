"""``DistributedTrainer``: the same script on N processes, under ``torchrun``.

``torchrun --nproc_per_node=N train.py`` (and ``--nnodes=M`` across machines)
starts N copies of the script; this callback, created in each, joins them in
one process group (NCCL on CUDA, gloo on the CPU, with a timeout so a failed
rank ends the run instead of hanging it), puts each on its own GPU, wraps the
model in ``DistributedDataParallel``, and gives each rank its shard of the
data: a ``DistributedSampler`` for training (reshuffled every epoch, the same
order on every rank) and, for validation, a shard without padding, so the
loss and metrics, summed over the ranks, equal those of one process over the
whole set (validation shards are whole batches of the one-process order, so
even float32 per-batch rounding matches). Callbacks with ``main_only = True``
(progress bar, loggers) run on rank 0 only; checkpoints are written by rank 0
and loaded by every rank. ``GradientAccumulation`` skips the gradient
all-reduce (``no_sync``) on the batches that do not step.

``strategy="fsdp"`` shards the model instead (FSDP2, ``fully_shard``): each
rank keeps a slice of every parameter, gradient and optimizer state, and
gathers a unit's parameters only while that unit runs, for models whose
training state does not fit one GPU. The optimizer is pointed at the sharded
parameters; checkpoints and ``Learner.save`` gather the whole state on rank 0
(in the format of a single process, so either loads into the other). As
every forward then needs every rank, validation runs in lockstep: a rank
with one batch fewer in its shard runs one more forward, uncounted.

Not launched that way (no ``RANK``/``WORLD_SIZE`` in the environment), it does
nothing, so the script also runs as a single process.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler

import fitlib.ranks as ranks
from fitlib.callback import Callback
from fitlib.core import call_model
from fitlib.data import FirstBatches
from fitlib.sharding import is_sharded, shard_model

_LOADER_ARGS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "drop_last",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "persistent_workers",
)


class DistributedTrainer(Callback):
    """Trains on every process of a ``torchrun`` launch; nothing otherwise.

    The process group starts when the callback is created (so that callbacks
    marked ``main_only`` are left out on the other ranks).

    Args:
        backend: ``"nccl"`` (CUDA) or ``"gloo"`` (CPU); None picks by device.
        find_unused_parameters: passed to ``DistributedDataParallel`` (needed
            when some parameters get no gradient in a step; slower).
        timeout: how long a collective waits for the other ranks before the
            run fails with an error (a crashed or stuck rank).
        strategy: ``"ddp"`` (a copy of the model per rank) or ``"fsdp"``
            (the model sharded over the ranks with FSDP2).
        fsdp_units: with ``"fsdp"``, the submodules that become units of
            their own (gathered one at a time, so the peak memory is about
            one unit's whole parameters): module classes, such as your
            transformer block, or a function ``module -> bool``. None: the
            whole model is one unit (parameters gathered for each forward;
            gradients and optimizer state stay sharded).
        fsdp_kwargs: with ``"fsdp"``, more arguments for ``fully_shard``
            (``mp_policy``, ``reshard_after_forward``, ``offload_policy``).

    Examples:
        In a script that ``torchrun --nproc_per_node=2 train.py`` starts, each
        process trains its shard of the data; started as a plain process (as
        here), it trains as without the callback:

        >>> learn.fit(3, lr=1e-3, callbacks=[DistributedTrainer()])
        History(3 epochs: train_loss ... -> ..., valid_loss ... -> ...,
                accuracy ... -> ...)
        >>> DistributedTrainer(strategy="fsdp", fsdp_units=(nn.Linear,))
        DistributedTrainer(fsdp, gloo, off)
    """

    order = -200  # first: the model, device and data others see are set here
    in_lr_find = False  # a sweep runs on each process alone

    def __init__(
        self,
        backend: str | None = None,
        find_unused_parameters: bool = False,
        timeout: datetime.timedelta = datetime.timedelta(minutes=5),
        strategy: str = "ddp",
        fsdp_units: tuple[type, ...] | Callable[[nn.Module], bool] | None = None,
        fsdp_kwargs: dict | None = None,
    ) -> None:
        if backend not in (None, "nccl", "gloo"):
            raise ValueError(
                f"backend must be 'nccl' (CUDA), 'gloo' (CPU) or None (pick by "
                f"device); got {backend!r}."
            )
        self.strategy = _check_strategy(strategy, fsdp_units, fsdp_kwargs)
        self.fsdp_units, self.fsdp_kwargs = _unit_test(fsdp_units), fsdp_kwargs or {}
        self.find_unused_parameters, self.timeout = find_unused_parameters, timeout
        self.enabled = ranks.launched()
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if self.enabled:
            _check_backend(self.backend)
            self.device = _device(self.backend)
            if not ranks.active():
                dist.init_process_group(self.backend, timeout=timeout)
        self.module: nn.Module | None = None  # the model, unwrapped

    # -- hooks -----------------------------------------------------------------
    def on_train_begin(
        self, model: nn.Module, opt: Any, data: Any, metrics: Any
    ) -> dict | None:
        """Runs first: device, DDP or FSDP, sharded loaders, metric reduction."""
        if not self.enabled:
            return None
        self.module = model
        fsdp = self.strategy == "fsdp"
        wrapped = self._shard(model, opt) if fsdp else self._ddp(model)
        metrics.reducer = ranks.all_reduce_sum  # validation sums over every rank
        seed = ranks.broadcast_int(int(torch.randint(2**31, ()).item()))
        sharded = _Sharded(data, seed)
        # Under FSDP every forward needs every rank: the longest shard sets the pace.
        valid = sharded.valid_dl
        self._valid = (0, 0)  # (this rank's validation batches, the most of any)
        if valid is not None:
            capped = valid.n if isinstance(valid, FirstBatches) else None
            inner = valid.loader if capped is not None else valid
            longest = inner.batch_sampler.longest
            self._valid = (
                len(valid),
                longest if capped is None else min(capped, longest),
            )
        return {"model": wrapped, "data": sharded}

    def _ddp(self, model: nn.Module) -> DistributedDataParallel:
        model.to(self.device)
        ids = [self.device.index] if self.device.type == "cuda" else None
        unused = self.find_unused_parameters
        return DistributedDataParallel(
            model, device_ids=ids, find_unused_parameters=unused
        )

    def _shard(self, model: nn.Module, opt: Any) -> nn.Module:
        if not is_sharded(model):  # (a later fit: sharded already)
            shard_model(model, opt, self.device, self.fsdp_units, **self.fsdp_kwargs)
        return model

    def on_epoch_begin(self, epoch: int, data: Any) -> None:
        """Runs at each epoch: a new shuffle, the same on every rank."""
        if self.enabled:
            data.train_dl.sampler.set_epoch(epoch)

    def on_batch_begin(self, train: bool, num_batch: int) -> None:
        """Runs before each batch: validation starts from rank 0's buffers."""
        if self.enabled and not train and num_batch == 0:
            _broadcast_buffers(self.module)  # batch norm's running stats

    def on_batch_end(self, train: bool, num_batch: int, last_input: Any) -> None:
        """Runs after each batch: under FSDP, a short validation shard runs one
        more (uncounted) forward, so that every rank gathers as often."""
        if train or self.strategy != "fsdp" or not self.enabled:
            return
        if num_batch + 1 == self._valid[0] < self._valid[1]:
            with torch.no_grad():
                call_model(self.module, last_input)

    def on_train_end(self, metrics: Any) -> None:
        """Runs at the end: the model (never wrapped outside the fit) ends
        equal on every rank."""
        if not self.enabled:
            return
        if self.module is not None:
            _broadcast_buffers(self.module)
        metrics.reducer = None

    def __repr__(self) -> str:
        where = (
            f"rank {ranks.rank()} of {ranks.world_size()}" if self.enabled else "off"
        )
        return f"{self.name}({self.strategy}, {self.backend}, {where})"


class _Sharded:
    """The data of one rank: its shard of the training and validation sets."""

    def __init__(self, data: Any, seed: int) -> None:
        self.original = data
        self.train_dl = _reload(data.train_dl, "train_dl", seed)
        valid = getattr(data, "valid_dl", None)
        self.valid_dl = None if valid is None else _reload(valid, "valid_dl", seed)
        self.device = getattr(data, "device", None)


class BatchShard(Sampler):
    """Batches ``rank``, ``rank + world``, ... of a sequential loader: each
    rank's batches are the single process's, so sums over ranks match it."""

    def __init__(self, batches: list[list[int]], rank: int, world: int) -> None:
        self.batches = batches[rank::world]
        self.longest = -(-len(batches) // world)  # the first ranks' length

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _reload(dl: Any, name: str, seed: int) -> DataLoader:
    """``dl`` again, with this rank's sampler (a fit's cap, ``FirstBatches``:
    the first batches of this rank's shard)."""
    if isinstance(dl, FirstBatches):
        return FirstBatches(_reload(dl.loader, name, seed), dl.n)
    world, rank = ranks.world_size(), ranks.rank()
    if not isinstance(dl, DataLoader) or not _replaceable(dl):
        raise ValueError(
            f"DistributedTrainer: cannot give each rank its shard of {name} "
            f"({type(dl).__name__}): fitlib replaces a DataLoader's sampler, "
            "which needs a map-style dataset and the default batch sampler. "
            "Fix: build it as DataLoader(dataset, batch_size, shuffle=...), or "
            "shard the data yourself and skip DistributedTrainer's loaders."
        )
    n = len(dl) if name == "valid_dl" else len(dl.dataset)
    if n < world:
        what = "batches" if name == "valid_dl" else "samples"
        raise ValueError(
            f"DistributedTrainer: {name} has {n} {what} for {world} processes, "
            "so some rank would get no batch. Fix: fewer processes "
            "(--nproc_per_node), or more data."
        )
    kwargs = {k: getattr(dl, k) for k in _LOADER_ARGS}
    if dl.num_workers:
        kwargs["prefetch_factor"] = dl.prefetch_factor
    if name == "valid_dl":  # whole batches of the one-process order: no padding
        kwargs.pop("drop_last")
        shard = BatchShard(list(dl.batch_sampler), rank, world)
        return DataLoader(dl.dataset, batch_sampler=shard, **kwargs)
    shuffle = isinstance(dl.sampler, RandomSampler)
    sampler = DistributedSampler(dl.dataset, world, rank, shuffle=shuffle, seed=seed)
    # (it pads with a few repeated samples so that every rank has as many)
    return DataLoader(dl.dataset, dl.batch_size, sampler=sampler, **kwargs)


def _replaceable(dl: DataLoader) -> bool:
    from torch.utils.data import BatchSampler, IterableDataset, SequentialSampler

    return (
        not isinstance(dl.dataset, IterableDataset)
        and type(dl.batch_sampler) is BatchSampler
        and isinstance(dl.sampler, (RandomSampler, SequentialSampler))
    )


def _broadcast_buffers(module: nn.Module) -> None:
    """Rank 0's buffers on every rank: each training forward updated its own."""
    for buffer in module.buffers():
        dist.broadcast(buffer, src=0)


def _check_strategy(strategy: str, units: Any, kwargs: Any) -> str:
    if strategy not in ("ddp", "fsdp"):
        raise ValueError(
            f"strategy must be 'ddp' (a model copy per process) or 'fsdp' (the "
            f"model sharded over the processes); got {strategy!r}."
        )
    if strategy != "fsdp" and (units is not None or kwargs):
        raise ValueError(
            "fsdp_units and fsdp_kwargs configure sharding, but strategy is "
            f"{strategy!r}. Fix: strategy='fsdp', or leave them out."
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(
            f"fsdp_kwargs must be a dict of fully_shard arguments; got "
            f"{type(kwargs).__name__}. Fix: e.g. fsdp_kwargs={{'mp_policy': ...}}."
        )
    if isinstance(kwargs, dict) and {"mesh", "module"} & kwargs.keys():
        raise ValueError(
            "fsdp_kwargs may not set mesh or module: DistributedTrainer shards "
            "the model over all ranks itself. Fix: leave them out."
        )
    return strategy


def _unit_test(units: Any) -> Callable[[nn.Module], bool] | None:
    """``fsdp_units`` as a function ``module -> bool`` (or None)."""
    if units is None or (callable(units) and not isinstance(units, type)):
        return units
    classes = (units,) if isinstance(units, type) else tuple(units)
    if not classes or not all(
        isinstance(c, type) and issubclass(c, nn.Module) for c in classes
    ):
        raise TypeError(
            f"fsdp_units must be nn.Module classes or a function module -> bool; "
            f"got {units!r}. Fix: e.g. fsdp_units=(TransformerBlock,)."
        )
    return lambda module: isinstance(module, classes)


def _check_backend(backend: str) -> None:
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "DistributedTrainer(backend='nccl'): NCCL needs CUDA GPUs, and none "
            "is visible. Fix: backend='gloo' (or None) on CPUs."
        )


def _device(backend: str) -> torch.device:
    if backend == "nccl":
        device = torch.device("cuda", ranks.local_rank())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")
