"""The states of every random number generator that shapes training.

Python's ``random``, NumPy's global generator, torch's CPU generator, every
initialized CUDA device's generator, and the ``torch.Generator`` objects a
DataLoader draws its order from. The state is plain lists and tensors, so it
goes into a checkpoint loaded with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def get_rng_state(loader: Any = None) -> dict:
    """The states of the global generators and of ``loader``'s generators.

    Examples:
        >>> from fitlib.rng import get_rng_state, set_rng_state
        >>> state = get_rng_state(data.train_dl)
        >>> first = next(iter(data.train_dl))[1]  # a shuffled batch's targets
        >>> set_rng_state(state, data.train_dl)  # later: the same draws again
        >>> torch.equal(next(iter(data.train_dl))[1], first)
        True
    """
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    cuda = torch.cuda.is_initialized()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [
            name,
            torch.from_numpy(keys.astype(np.int64)),
            pos,
            has_gauss,
            cached,
        ],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if cuda else [],
        "loader": [g.get_state() for g in loader_generators(loader)],
    }


def set_rng_state(state: dict, loader: Any = None) -> None:
    """Sets the generators to what ``get_rng_state`` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    generators = loader_generators(loader)
    if len(generators) != len(state["loader"]):
        raise ValueError(
            f"the saved state has {len(state['loader'])} loader generator(s), "
            f"the loader has {len(generators)}. Fix: build the DataLoader as "
            "the run that saved it did (the same generator= argument)."
        )
    for generator, saved in zip(generators, state["loader"], strict=True):
        generator.set_state(saved)


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a DataLoader's order is drawn from."""
    found: dict[int, torch.Generator] = {}
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    for owner in (loader, sampler, batch_sampler):
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator):
            found[id(g)] = g
    return list(found.values())
