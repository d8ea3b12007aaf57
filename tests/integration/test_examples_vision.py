"""The vision examples train: examples/lenet.py and examples/resnet18_augment.py."""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
import lenet
import resnet18_augment

EXAMPLES = [lenet, resnet18_augment]


def initial_weights(example, seed: int = 0) -> list[torch.Tensor]:
    """The weights ``example.main(seed=seed)`` starts from (it seeds first)."""
    example.seed_everything(seed)
    model = example.lenet() if example is lenet else example.resnet18_small()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda m: m.__name__)
def test_trains_at_batch_size_one(example):
    learn = example.main(epochs=1, batch_size=1, n=20, progress=False)
    (record,) = learn.recorder.epoch_table()
    assert math.isfinite(record["train_loss"]) and math.isfinite(record["valid_loss"])
    assert 0.0 <= record["accuracy"] <= 1.0
    assert learn.recorder.batch_sizes == [1] * 16  # 16 of the 20 samples train
    start = initial_weights(example)
    after = list(learn.model.parameters())
    assert len(start) == len(after)
    assert any(not torch.equal(a, b) for a, b in zip(start, after))
    assert all(torch.isfinite(p).all() for p in after)


@pytest.mark.parametrize(
    ("example", "kwargs"),
    [
        (lenet, {"epochs": 4, "batch_size": 32, "n": 400}),
        (resnet18_augment, {"epochs": 3, "batch_size": 16, "n": 120}),
    ],
    ids=["lenet", "resnet18_augment"],
)
def test_training_loss_goes_down(example, kwargs):
    learn = example.main(progress=False, **kwargs)
    losses = learn.recorder.train_losses
    assert len(losses) == kwargs["epochs"]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]


def test_lenet_reaches_95_percent_by_default():
    learn = lenet.main(progress=False)
    assert learn.recorder.epoch_table()[-1]["accuracy"] >= 0.95
    assert learn.validate()["accuracy"] >= 0.95


def test_runs_repeat_with_the_same_seed():
    a = lenet.main(epochs=1, batch_size=32, n=200, progress=False)
    b = lenet.main(epochs=1, batch_size=32, n=200, progress=False)
    assert a.recorder.train_losses == b.recorder.train_losses


def test_resnet_augments_the_training_images_only():
    data = resnet18_augment.digits_data(batch_size=8, n=40)
    train, valid = data.train_dl.dataset, data.valid_dl.dataset
    torch.manual_seed(0)
    assert not torch.equal(train[0][0], train[0][0])  # a new crop each read
    assert torch.equal(valid[0][0], valid[0][0])
    assert train[0][0].shape == valid[0][0].shape == (3, 32, 32)
