"""A GAN with fitlib: learn 8 Gaussians on a ring, and count the modes it covers.

The script makes its data (no download): ``n`` points around 8 centres on a
circle of radius 2 (standard deviation 0.05). A generator (noise -> 2-D
point) and a critic (2-D point -> score), small MLPs, train in turns with
``GANTrainer`` and one optimizer each (a ``MultiOptimizer``). A callback adds
two values to each epoch's record, from 2,000 generated points:

- ``modes``: how many of the 8 centres have at least 1% of the points within
  0.2 of them (4 standard deviations). A collapsed generator, which puts
  everything on one or two centres, scores 1 or 2;
- ``quality``: the share of the points within 0.2 of some centre.

``--wgan-gp`` trains a Wasserstein GAN with the gradient penalty of the
docs' recipe (``GradientPenalty``, docs/how-to/change-a-training-step.md)
instead of the standard (binary cross-entropy) GAN: penalty weight 1 and 2
critic steps per generator step (the usual 10 and 5 did not learn this ring
within 3,000 steps; 1 and 2 covered all 8 modes for 20 seeds of 20 by step
832), 15 epochs by default instead of 12.

Run it with::

    python examples/gan.py [--epochs N] [--batch-size B] [--n N] [--seed S]
                           [--wgan-gp]
"""

from __future__ import annotations

import math
import random
from functools import partial

import cli  # the shared command line (examples/cli.py)
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitlib import Callback, DataBunch, GANLoss, GANModule, Learner
from fitlib.callbacks import GANTrainer

N_MODES, RADIUS, STD = 8, 2.0, 0.05
NEAR = 0.2  # a point this close to a centre counts for it (4 STD)
N_DEFAULT = 8192
NOISE_SIZE = 4


def centres() -> torch.Tensor:
    angle = torch.arange(N_MODES) * (2 * math.pi / N_MODES)
    return RADIUS * torch.stack([angle.cos(), angle.sin()], 1)


def ring(n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` points around the 8 centres."""
    which = torch.randint(0, N_MODES, (n,), generator=generator)
    return centres()[which] + STD * torch.randn(n, 2, generator=generator)


def coverage(samples: torch.Tensor) -> tuple[int, float]:
    """The modes covered (centres with >= 1% of the samples near them) and the
    share of the samples near some centre."""
    distance, nearest = torch.cdist(samples, centres()).min(1)
    near = distance < NEAR
    counts = torch.bincount(nearest[near], minlength=N_MODES)
    return int((counts >= 0.01 * len(samples)).sum()), float(near.float().mean())


class ModeCoverage(Callback):
    """Adds ``modes`` and ``quality`` (see the module's docstring) to each
    epoch's record, from ``n`` generated samples."""

    record_names = ("modes", "quality")

    def __init__(self, n: int = 2000) -> None:
        self.n = n

    def on_epoch_end(self, model: nn.Module) -> dict:
        modes, quality = coverage(model.generate(self.n).cpu())
        return {"record": {"modes": modes, "quality": quality}}


class GradientPenalty(Callback):
    """WGAN-GP: adds weight * (|grad C(x_hat)| - 1)^2 to the critic's loss
    (the docs' recipe, docs/how-to/change-a-training-step.md)."""

    order = -35  # before accumulation divides and float16 scales the loss

    def __init__(self, weight: float = 10.0) -> None:
        self.weight = weight

    def on_backward_begin(
        self, model: nn.Module, last_output, last_loss
    ) -> dict | None:
        if last_output.mode != "critic":
            return None
        real, fake = last_output.real, last_output.fake
        eps = torch.rand(len(real), *[1] * (real.ndim - 1), device=real.device)
        x_hat = (eps * real + (1 - eps) * fake).requires_grad_(True)
        critic = getattr(model, "module", model).critic  # (DDP wraps the model)
        (grad,) = torch.autograd.grad(critic(x_hat).sum(), x_hat, create_graph=True)
        penalty = ((grad.flatten(1).norm(dim=1) - 1) ** 2).mean()
        return {"last_loss": last_loss + self.weight * penalty}


def mlp(n_in: int, n_out: int, act: type[nn.Module], hidden: int = 128) -> nn.Module:
    return nn.Sequential(
        nn.Linear(n_in, hidden), act(),
        nn.Linear(hidden, hidden), act(),
        nn.Linear(hidden, n_out),
    )  # fmt: skip


def build(
    batch_size: int = 128,
    n: int | None = None,
    progress: bool = True,
    seed: int = 0,
    wgan_gp: bool = False,
) -> Learner:
    """The data, the GAN and the Learner, untrained, all seeded from ``seed``."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    train = ring(N_DEFAULT if n is None else n, generator)
    valid = ring(1024, generator)
    data = DataBunch(
        DataLoader(TensorDataset(train), batch_size, shuffle=True, generator=generator),
        DataLoader(TensorDataset(valid), 512),
    )
    # (tanh in the generator, ReLU in the critic: the pair that covered all 8
    # modes for every seed tried, at the fewest steps)
    gan = GANModule(mlp(NOISE_SIZE, 2, nn.Tanh), mlp(2, 1, nn.ReLU), NOISE_SIZE)
    betas = (0.5, 0.9) if wgan_gp else (0.5, 0.999)
    adam = partial(torch.optim.Adam, betas=betas)
    callbacks = [GANTrainer(n_critic=2 if wgan_gp else 1), ModeCoverage()]
    if wgan_gp:
        callbacks.append(GradientPenalty(1.0))
    return Learner(
        data,
        gan,
        GANLoss("wgan" if wgan_gp else "bce"),
        opt_func={"generator": adam, "critic": adam},
        wd=0.0,
        callbacks=callbacks,
        progress=progress,
    )


def main(
    epochs: int | None = None,
    batch_size: int = 128,
    n: int | None = None,
    progress: bool = True,
    seed: int = 0,
    wgan_gp: bool = False,
) -> Learner:
    """Train the GAN (``epochs`` None: 12, or 15 with ``wgan_gp``); return
    the Learner."""
    learn = build(batch_size, n, progress, seed, wgan_gp)
    learn.fit(epochs or (15 if wgan_gp else 12), lr={"generator": 2e-3, "critic": 2e-3})
    return learn


if __name__ == "__main__":
    args = cli.args(main, __doc__)
    learn = main(**args)
    first, last = learn.recorder.epoch_table()[0], learn.recorder.epoch_table()[-1]
    name = "wgan_gp" if args["wgan_gp"] else "gan"
    print(
        f"{name}: modes {first['modes']} -> {last['modes']} of {N_MODES}, quality "
        f"{first['quality']:.2f} -> {last['quality']:.2f}, critic loss "
        f"{last['train_critic']:.3f}, generator loss {last['train_generator']:.3f}, "
        f"{sum(learn.recorder.times):.1f} seconds on {torch.get_num_threads()} "
        f"thread{'s' if torch.get_num_threads() > 1 else ''}"
    )
