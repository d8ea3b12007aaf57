"""Where this process stands in a ``torch.distributed`` run, and small collectives.

Every function works without a process group: then there is one rank (0),
the main one, and collectives do nothing. ``torchrun`` sets the environment
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``)
that ``launched()`` reads.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def launched() -> bool:
    """Whether ``torchrun`` (or another launcher) started this process."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def active() -> bool:
    """Whether a process group is initialized."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank: the process group's, else torchrun's ``RANK``, else 0."""
    return dist.get_rank() if active() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    """The number of processes (1 without a process group)."""
    return dist.get_world_size() if active() else 1


def local_rank() -> int:
    """This process's rank on its machine (``LOCAL_RANK``; 0 when not launched)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def is_main() -> bool:
    """Whether this process does the side effects (bars, logs, files): rank 0."""
    return rank() == 0


def barrier() -> None:
    """Waits for every rank (nothing to wait for without a process group)."""
    if active():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed element-wise over the ranks (``t`` itself without a group)."""
    if active() and world_size() > 1:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def gather_to_all(obj: object) -> list:
    """Every rank's ``obj``, in rank order (``[obj]`` without a group)."""
    if not active() or world_size() == 1:
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_int(value: int) -> int:
    """Rank 0's ``value``, on every rank."""
    if not active() or world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_collective_device())
    dist.broadcast(t, src=0)
    return int(t.item())


def _collective_device() -> torch.device:
    """Where collectives' tensors live: the rank's GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
