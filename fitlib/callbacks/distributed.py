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

Not launched that way (no ``RANK``/``WORLD_SIZE`` in the environment), it does
nothing, so the script also runs as a single process.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler

from fitlib import distributed as fd
from fitlib.callback import Callback

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

    Example:
        >>> # torchrun --nproc_per_node=2 train.py
        >>> learn.fit(3, lr=1e-3, callbacks=[DistributedTrainer()])
    """

    order = -200  # first: the model, device and data others see are set here
    in_lr_find = False  # a sweep runs on each process alone

    def __init__(
        self,
        backend: str | None = None,
        find_unused_parameters: bool = False,
        timeout: datetime.timedelta = datetime.timedelta(minutes=5),
    ) -> None:
        if backend not in (None, "nccl", "gloo"):
            raise ValueError(
                f"backend must be 'nccl' (CUDA), 'gloo' (CPU) or None (pick by "
                f"device); got {backend!r}."
            )
        self.find_unused_parameters, self.timeout = find_unused_parameters, timeout
        self.enabled = fd.launched()
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if self.enabled:
            _check_backend(self.backend)
            self.device = _device(self.backend)
            if not fd.active():
                dist.init_process_group(self.backend, timeout=timeout)
        self.ddp: DistributedDataParallel | None = None

    # -- hooks -----------------------------------------------------------------
    def on_train_begin(self, model: nn.Module, data: Any, metrics: Any) -> dict | None:
        """Runs first: device, DDP wrapper, sharded loaders, metric reduction."""
        if not self.enabled:
            return None
        model.to(self.device)
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(
            model, device_ids=ids, find_unused_parameters=self.find_unused_parameters
        )
        metrics.reducer = fd.all_reduce_sum  # validation sums over every rank
        seed = fd.broadcast_int(int(torch.randint(2**31, ()).item()))
        sharded = _Sharded(data, seed)
        return {"model": self.ddp, "data": sharded}

    def on_epoch_begin(self, epoch: int, data: Any) -> None:
        """Runs at each epoch: a new shuffle, the same on every rank."""
        if self.enabled:
            data.train_dl.sampler.set_epoch(epoch)

    def on_batch_begin(self, train: bool, num_batch: int) -> None:
        """Runs before each batch: validation starts from rank 0's buffers."""
        if self.enabled and not train and num_batch == 0:
            _broadcast_buffers(self.ddp.module)  # batch norm's running stats

    def on_train_end(self, model: Any, metrics: Any) -> dict | None:
        """Runs at the end: the plain model comes back, equal on every rank."""
        if not self.enabled:
            return None
        if self.ddp is not None:
            _broadcast_buffers(self.ddp.module)
        metrics.reducer = None
        return {"model": getattr(model, "module", model)}

    def __repr__(self) -> str:
        where = f"rank {fd.rank()} of {fd.world_size()}" if self.enabled else "off"
        return f"{self.name}({self.backend}, {where})"


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

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _reload(dl: Any, name: str, seed: int) -> DataLoader:
    """``dl`` again, with this rank's sampler."""
    world, rank = fd.world_size(), fd.rank()
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


def _check_backend(backend: str) -> None:
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "DistributedTrainer(backend='nccl'): NCCL needs CUDA GPUs, and none "
            "is visible. Fix: backend='gloo' (or None) on CPUs."
        )


def _device(backend: str) -> torch.device:
    if backend == "nccl":
        device = torch.device("cuda", fd.local_rank())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")
