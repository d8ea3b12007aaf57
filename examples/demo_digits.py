"""Train a small CNN on scikit-learn's 8x8 handwritten digits with fitlib.

Run it with ``make demo`` (or ``python examples/demo_digits.py``). It needs no
download: the 1,797 digits ship with scikit-learn. It prints a results table
per epoch and the final validation accuracy, and saves two plots,
``demo_losses.png`` and ``demo_lr.png``, in the current directory.
"""

import sys
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

from fitlib import DataBunch, Learner
from fitlib.metrics import accuracy

matplotlib.use("Agg")  # write PNG files; no window needed
SEED = 42


def digits_data(batch_size: int = 64) -> DataBunch:
    """The digits as (N, 1, 8, 8) floats in [0, 1], split 80/20 by class."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16
    y = torch.tensor(digits.target)
    x_train, x_valid, y_train, y_valid = train_test_split(
        x, y, test_size=0.2, stratify=y, random_state=SEED
    )
    train_dl = DataLoader(TensorDataset(x_train, y_train), batch_size, shuffle=True)
    valid_dl = DataLoader(TensorDataset(x_valid, y_valid), 2 * batch_size)
    return DataBunch(train_dl, valid_dl)


def small_cnn(n_classes: int = 10) -> nn.Module:
    """Three convolutions, 8x8 -> 4x4 -> 2x2, then average pooling and a head."""

    def conv(c_in: int, c_out: int, stride: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, stride, padding=1, bias=False),
            nn.BatchNorm2d(c_out),
            nn.ReLU(),
        )

    return nn.Sequential(
        conv(1, 16, 1),
        conv(16, 32, 2),
        conv(32, 64, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, n_classes),
    )


def main() -> int:
    torch.manual_seed(SEED)  # same weights and batch order on every run
    learn = Learner(
        digits_data(), small_cnn(), loss_func=F.cross_entropy, metrics=[accuracy]
    )
    learn.fit(6, lr=1e-2)
    learn.fit(2, lr=1e-3)  # a second, gentler fit; the recorder keeps both

    # Each plot returns the Axes it drew into, on a pyplot figure of its own.
    plots = {"losses": learn.recorder.plot_losses(), "lr": learn.recorder.plot_lr()}
    for name, ax in plots.items():
        path = Path(f"demo_{name}.png").resolve()
        ax.figure.savefig(path)
        plt.close(ax.figure)
        print(f"saved {path}")

    acc = learn.validate()["accuracy"]
    print(f"final validation accuracy: {acc:.2%}")
    if acc < 0.95:
        print(f"error: accuracy {acc:.2%} is below the expected 95%", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
