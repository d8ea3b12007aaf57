"""The GAN example learns: ``examples/gan.py`` covers the 8 modes of its ring."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))

import gan

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_collapsed_generator_covers_one_mode_and_the_data_all_eight():
    one_centre = gan.centres()[3] + 0.05 * torch.randn(2000, 2)
    assert gan.coverage(one_centre)[0] == 1
    two = torch.cat([one_centre[:1000], gan.centres()[5] + 0.05 * torch.randn(1000, 2)])
    assert gan.coverage(two)[0] == 2
    modes, quality = gan.coverage(gan.ring(2000, torch.Generator().manual_seed(0)))
    assert modes == 8 and quality > 0.99


def test_the_gan_learns_every_mode_of_the_ring():
    learn = gan.main(progress=False, seed=1)
    table = learn.recorder.epoch_table()
    assert table[0]["modes"] <= 3  # after one epoch: not there yet
    assert table[-1]["modes"] == 8  # all of them: no collapse
    assert table[-1]["quality"] > 0.6  # most samples near a centre
    assert all(r["train_critic"] is not None for r in table)
    assert table[-1]["valid_generator"] is not None


def test_the_wgan_gp_recipe_learns_the_ring_too():
    learn = gan.main(progress=False, seed=2, wgan_gp=True)
    table = learn.recorder.epoch_table()
    assert table[0]["modes"] <= 3
    assert table[-1]["modes"] >= 7 and table[-1]["quality"] > 0.4
    assert table[-1]["train_critic"] < 0  # (a Wasserstein estimate, minus)
