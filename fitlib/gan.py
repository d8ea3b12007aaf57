"""A GAN as one model: ``GANModule`` (a generator and a critic) and
``GANLoss`` (the usual GAN losses), trained in turns by ``GANTrainer``.

The loop stays the one loop: each training batch of real samples is one step
of one part. ``GANTrainer`` says whose turn it is (``GANModule.mode``) and
which optimizer steps; the module's forward computes what that turn needs
and ``GANLoss`` the loss of that turn, named ``critic`` or ``generator`` in
the epoch record. In evaluation (validation) both losses are computed on
the same fakes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

MODES = ("critic", "generator", "both")


@dataclass
class GANOutput:
    """What ``GANModule`` returns: the critic's scores of the fakes (and of
    the real samples, in the critic's turn and in evaluation), the fakes and
    the real samples, and the turn (``mode``) they were computed for."""

    mode: str
    fake_scores: torch.Tensor
    real_scores: torch.Tensor | None
    fake: torch.Tensor
    real: torch.Tensor


class GANModule(nn.Module):
    """A generator and a critic (discriminator) as one model.

    Args:
        generator: maps noise to samples.
        critic: maps samples to scores (one per sample; logits for the BCE
            loss).
        noise_size: the shape of one noise sample (an int, or a tuple).
        noise: draws a batch of noise, ``noise(n, device)``; None draws from
            a standard normal (``torch.randn``: seeded like the rest).

    ``mode``, set by ``GANTrainer`` before each training batch, is whose
    turn it is: ``"critic"`` (the fakes are made without gradients) or
    ``"generator"``. In eval mode both scores are computed.

    Example:
        >>> gan = GANModule(generator, critic, noise_size=8)
        >>> learn = Learner(data, gan, GANLoss("wgan"),
        ...                 opt_func={"generator": Adam, "critic": Adam},
        ...                 callbacks=[GANTrainer(n_critic=5)])
        >>> samples = gan.generate(1000)
    """

    def __init__(
        self,
        generator: nn.Module,
        critic: nn.Module,
        noise_size: int | tuple[int, ...],
        noise: Callable[[int, torch.device], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        for name, module in (("generator", generator), ("critic", critic)):
            if not isinstance(module, nn.Module):
                raise TypeError(
                    f"GANModule: {name} must be an nn.Module; got "
                    f"{type(module).__name__}. Fix: e.g. nn.Sequential(...)."
                )
        self.generator, self.critic = generator, critic
        self.noise_size = (
            (noise_size,) if isinstance(noise_size, int) else tuple(noise_size)
        )
        self._noise = noise
        self.mode: str | None = None

    def noise(self, n: int, device: torch.device) -> torch.Tensor:
        """A batch of ``n`` noise samples on ``device``."""
        if self._noise is not None:
            return self._noise(n, device)
        return torch.randn(n, *self.noise_size, device=device)

    def forward(self, real: torch.Tensor) -> GANOutput:
        mode = self.mode if self.training else "both"
        if mode not in MODES:
            raise RuntimeError(
                f"GANModule: mode is {mode!r}, so it does not know whose turn it "
                "is. Fix: train it with the GANTrainer callback (callbacks="
                "[GANTrainer()]), which sets the mode before each batch."
            )
        z = self.noise(real.shape[0], real.device)
        if mode == "critic":
            with torch.no_grad():  # the generator does not learn in this turn
                fake = self.generator(z)
            real_scores = self.critic(real)  # (real first, as loops usually do)
            return GANOutput(mode, self.critic(fake), real_scores, fake, real)
        fake = self.generator(z)
        real_scores = self.critic(real) if mode == "both" else None
        return GANOutput(mode, self.critic(fake), real_scores, fake, real)

    @torch.no_grad()
    def generate(
        self, n: int, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """``n`` samples from the generator (in eval mode, without gradients)."""
        if device is None:
            device = next(self.generator.parameters()).device
        training = self.generator.training
        self.generator.eval()
        try:
            return self.generator(self.noise(n, torch.device(device)))
        finally:
            self.generator.train(training)


def _bce(real: Any, fake: torch.Tensor) -> tuple[Any, torch.Tensor]:
    ones, zeros = torch.ones_like(fake), torch.zeros_like(fake)
    gen = F.binary_cross_entropy_with_logits(fake, ones)  # non-saturating
    if real is None:
        return None, gen
    critic = F.binary_cross_entropy_with_logits(
        real, torch.ones_like(real)
    ) + F.binary_cross_entropy_with_logits(fake, zeros)
    return critic, gen


def _wgan(real: Any, fake: torch.Tensor) -> tuple[Any, torch.Tensor]:
    critic = None if real is None else fake.mean() - real.mean()
    return critic, -fake.mean()


def _hinge(real: Any, fake: torch.Tensor) -> tuple[Any, torch.Tensor]:
    critic = None if real is None else F.relu(1 - real).mean() + F.relu(1 + fake).mean()
    return critic, -fake.mean()


def _lsgan(real: Any, fake: torch.Tensor) -> tuple[Any, torch.Tensor]:
    critic = (
        None if real is None else ((real - 1) ** 2).mean() / 2 + (fake**2).mean() / 2
    )
    return critic, ((fake - 1) ** 2).mean() / 2


_KINDS = {"bce": _bce, "wgan": _wgan, "hinge": _hinge, "lsgan": _lsgan}


class GANLoss:
    """The loss of a ``GANModule``'s turn, by ``kind``:

    - ``"bce"``: the standard GAN; the critic's scores are logits (binary
      cross-entropy, real 1 and fake 0), the generator's loss the
      non-saturating one (its fakes taken for real);
    - ``"wgan"``: Wasserstein (critic ``mean(fake) - mean(real)``, generator
      ``-mean(fake)``); add a gradient penalty (the README's WGAN-GP recipe)
      or clip the critic's weights;
    - ``"hinge"``: hinge loss for the critic, ``-mean(fake)`` for the generator;
    - ``"lsgan"``: least squares.

    Returns a dict: ``"loss"`` (what backward uses) and the turn's part,
    ``"critic"`` or ``"generator"`` (both in evaluation, where ``"loss"`` is
    the critic's), so the epoch record has ``train_critic``,
    ``train_generator``, ``valid_critic``, ``valid_generator``.

    Example:
        >>> learn = Learner(data, gan, GANLoss("bce"), opt_func=...,
        ...                 callbacks=[GANTrainer()])
    """

    part_names = ("critic", "generator")

    def __init__(self, kind: str = "bce") -> None:
        if kind not in _KINDS:
            raise ValueError(
                f"GANLoss: unknown kind {kind!r}. Fix: one of {list(_KINDS)}."
            )
        self.kind, self._fn = kind, _KINDS[kind]

    def __call__(self, out: GANOutput, *targets: Any) -> dict[str, torch.Tensor]:
        if not isinstance(out, GANOutput):
            raise TypeError(
                f"GANLoss takes a GANModule's output; got {type(out).__name__}. "
                "Fix: train a GANModule(generator, critic, noise_size)."
            )
        critic, gen = self._fn(out.real_scores, out.fake_scores)
        if out.mode == "critic":
            return {"loss": critic, "critic": critic}
        if out.mode == "generator":
            return {"loss": gen, "generator": gen}
        return {"loss": critic, "critic": critic, "generator": gen}

    def __repr__(self) -> str:
        return f"GANLoss({self.kind!r})"
