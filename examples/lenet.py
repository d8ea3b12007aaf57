"""A LeNet-5 style CNN on scikit-learn's 8x8 handwritten digits, with fitlib.

What it shows: the classic conv-pool-conv-pool-fc-fc network (LeNet-5's
6 and 16 channels of 5x5 convolutions, average pooling, 120 and 84 hidden
units) trained with ``Learner.fit_one_cycle``, scored with ``accuracy``.

Data: the 1,797 digits that ship with scikit-learn (``load_digits``), no
download. LeNet was made for 32x32 inputs, so each 8x8 image is upsampled
once, bilinearly, to 32x32 (32 -> conv 28 -> pool 14 -> conv 10 -> pool 5).
A seeded 80/20 split, stratified by class, gives the training and
validation sets.

Run it:

    python examples/lenet.py [--epochs N] [--batch-size B] [--n N] [--seed S]

``--n`` keeps only the first N digits (for quick tests). The defaults
(10 epochs, batch size 64) reach about 97% validation accuracy (96.9% with
seed 0) in a few seconds on a 2-core CPU.
"""

import math
import random

import cli  # the shared command line (examples/cli.py)
import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

from fitlib import DataBunch, Learner
from fitlib.metrics import accuracy

SIZE = 32  # LeNet-5's input size


def seed_everything(seed: int) -> None:
    """Seeds Python's, NumPy's and torch's generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def can_stratify(y: torch.Tensor, test_size: float) -> bool:
    """Whether scikit-learn can split ``y`` keeping every class on both sides."""
    counts = torch.bincount(y)
    n_classes = int((counts > 0).sum())
    n_test = math.ceil(test_size * len(y))
    smallest_side = min(n_test, len(y) - n_test)
    return int(counts[counts > 0].min()) >= 2 and smallest_side >= n_classes


def digits_data(batch_size: int, n: int | None = None, seed: int = 0) -> DataBunch:
    """The digits as (N, 1, 32, 32) floats in [0, 1], split 80/20."""
    digits = load_digits()
    x = torch.tensor(digits.images[:n], dtype=torch.float32).unsqueeze(1) / 16
    y = torch.tensor(digits.target[:n])
    x = F.interpolate(x, size=(SIZE, SIZE), mode="bilinear", align_corners=False)
    stratify = y if can_stratify(y, test_size=0.2) else None  # tiny n: cannot
    x_train, x_valid, y_train, y_valid = train_test_split(
        x, y, test_size=0.2, stratify=stratify, random_state=seed
    )
    shuffle = torch.Generator().manual_seed(seed)
    train_dl = DataLoader(
        TensorDataset(x_train, y_train), batch_size, shuffle=True, generator=shuffle
    )
    valid_dl = DataLoader(TensorDataset(x_valid, y_valid), max(2 * batch_size, 64))
    return DataBunch(train_dl, valid_dl)


def lenet(n_classes: int = 10) -> nn.Module:
    """LeNet-5 for 1x32x32 inputs: conv-pool-conv-pool-fc-fc(-fc)."""
    return nn.Sequential(
        nn.Conv2d(1, 6, 5),  # 32 -> 28
        nn.ReLU(),
        nn.AvgPool2d(2),  # 28 -> 14
        nn.Conv2d(6, 16, 5),  # 14 -> 10
        nn.ReLU(),
        nn.AvgPool2d(2),  # 10 -> 5
        nn.Flatten(),
        nn.Linear(16 * 5 * 5, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, n_classes),
    )


def main(
    epochs: int = 10,
    batch_size: int = 64,
    n: int | None = None,
    progress: bool = True,
    seed: int = 0,
) -> Learner:
    """Trains LeNet on the digits and returns the Learner."""
    seed_everything(seed)
    data = digits_data(batch_size, n, seed)
    learn = Learner(
        data,
        lenet(),
        loss_func=F.cross_entropy,
        opt_func=torch.optim.AdamW,
        wd=1e-2,
        metrics=[accuracy],
        progress=progress,
    )
    learn.fit_one_cycle(epochs, lr=1e-2)
    return learn


if __name__ == "__main__":
    learn = main(**cli.args(main, __doc__))
    print(cli.result_line("lenet", learn, "accuracy"))
