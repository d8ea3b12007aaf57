"""Linear regression with fitlib: recover the weights and bias of a line.

The script makes its own data (no download): ``n`` samples of a few standard
normal features ``X`` and targets ``y = X @ w + b + noise`` for a fixed ``w``
and ``b``. A single ``nn.Linear`` trained with ``F.mse_loss`` learns them;
the metrics are ``RMSE()`` and ``R2Score()`` over the validation set, and the
script prints the learned ``w`` and ``b`` beside the true ones.

Run it with::

    python examples/linear_regression.py [--epochs N] [--batch-size B] [--n N]
                                         [--seed S]
"""

from __future__ import annotations

import random

import cli  # the shared command line (examples/cli.py)
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

from fitlib import DataBunch, Learner
from fitlib.metrics import RMSE, R2Score

TRUE_W = torch.tensor([2.0, -3.0, 0.5, 1.5])
TRUE_B = 4.0
NOISE = 0.1  # standard deviation of the noise added to y
N_DEFAULT = 2000


def make_data(
    n: int, batch_size: int, generator: torch.Generator
) -> tuple[DataBunch, torch.Tensor, torch.Tensor]:
    """``n`` samples of ``y = X @ TRUE_W + TRUE_B + noise``, split 80/20.

    Returns the DataBunch and the whole ``(X, y)``; ``y`` is ``(n, 1)``, the
    shape of the model's output (an ``(n,)`` target would broadcast, and
    fitlib refuses that for ``mse_loss``).
    """
    x = torch.randn(n, len(TRUE_W), generator=generator)
    noise = NOISE * torch.randn(n, generator=generator)
    y = (x @ TRUE_W + TRUE_B + noise).unsqueeze(1)
    n_train = max(1, int(0.8 * n))
    train_ds = TensorDataset(x[:n_train], y[:n_train])
    valid_ds = TensorDataset(x[n_train:], y[n_train:])
    train_dl = DataLoader(train_ds, batch_size, shuffle=True, generator=generator)
    valid_dl = DataLoader(valid_ds, 2 * batch_size)
    return DataBunch(train_dl, valid_dl), x, y


def build(
    batch_size: int = 32, n: int | None = None, progress: bool = True, seed: int = 0
) -> Learner:
    """The data, the model and the Learner, untrained, all seeded from ``seed``."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    data, _, _ = make_data(N_DEFAULT if n is None else n, batch_size, generator)
    model = nn.Linear(len(TRUE_W), 1)
    return Learner(
        data,
        model,
        loss_func=F.mse_loss,
        metrics=[RMSE(), R2Score()],
        opt_func=torch.optim.AdamW,
        wd=0.0,  # no weight decay: it would pull w towards 0
        progress=progress,
    )


def main(
    epochs: int = 5,
    batch_size: int = 32,
    n: int | None = None,
    progress: bool = True,
    seed: int = 0,
) -> Learner:
    """Train ``nn.Linear`` on the synthetic data; return the Learner."""
    learn = build(batch_size, n, progress, seed)
    learn.fit_one_cycle(epochs, lr=0.1)
    return learn


if __name__ == "__main__":
    learn = main(**cli.args(main, __doc__))
    w = learn.model.weight.detach().squeeze(0)
    b = learn.model.bias.detach().item()
    print("learned w:", [round(v, 3) for v in w.tolist()])
    print("true w:   ", [round(v, 3) for v in TRUE_W.tolist()])
    print(f"learned b: {b:.3f}   true b: {TRUE_B:.3f}")
    print(cli.result_line("linear_regression", learn, "r2_score"))
