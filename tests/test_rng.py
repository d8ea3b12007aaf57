"""``fitlib.rng``: the state of every generator that shapes training, put
back so the same draws come again, the loader's order included."""

import random

import numpy as np
import pytest
import torch
from helpers import make_dataset
from torch.utils.data import DataLoader

from fitlib.rng import get_rng_state, loader_generators, set_rng_state


def draws():
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_set_rng_state_gives_the_same_draws_again_for_every_generator():
    g = torch.Generator().manual_seed(0)
    dl = DataLoader(make_dataset(32), 8, shuffle=True, generator=g)
    state = get_rng_state(dl)
    first, order = draws(), [y.tolist() for _, y in dl]
    assert draws() != first  # the generators moved on
    set_rng_state(state, dl)
    assert draws() == first
    assert [y.tolist() for _, y in dl] == order


def test_the_state_survives_a_weights_only_load(tmp_path):
    state = get_rng_state()
    torch.save(state, tmp_path / "rng.pth")
    first = draws()
    set_rng_state(torch.load(tmp_path / "rng.pth", weights_only=True))
    assert draws() == first


def test_a_loader_with_other_generators_is_refused_naming_the_fix():
    g = torch.Generator().manual_seed(0)
    shuffled = DataLoader(make_dataset(8), 4, shuffle=True, generator=g)
    assert loader_generators(shuffled) == [g]  # the loader's and its sampler's: one
    state = get_rng_state(shuffled)
    with pytest.raises(ValueError, match=r"1 loader generator\(s\), the loader has 0"):
        set_rng_state(state, DataLoader(make_dataset(8), 4))
