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

from fitlib.checks import check_int
from fitlib.errors import ArgTypeError, is_int

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
        critic: maps samples to scores, one per sample: ``(n,)`` or
            ``(n, 1)`` (logits for the BCE loss), or one map of scores per
            sample in one channel, ``(n, 1, ...)`` (a PatchGAN's
            ``(n, 1, h, w)``, averaged by the loss). More than one channel
            (a two-class head's ``(n, 2)``) is refused, and so are fakes of
            another shape than the real samples: checked at the first batch
            of each turn and batch shape only (no per-step cost).
        noise_size: the shape of one noise sample (an int, or a tuple).
        noise: draws a batch of noise, ``noise(n, device)``; None draws from
            a standard normal (``torch.randn``: seeded like the rest).

    ``mode``, set by ``GANTrainer`` before each training batch, is whose
    turn it is: ``"critic"`` (the fakes are made without gradients) or
    ``"generator"``. In eval mode both scores are computed.

    Examples:
        >>> from torch.optim import Adam
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> generator = nn.Linear(8, 2)  # noise -> a point
        >>> critic = nn.Linear(2, 1)  # a point -> its score
        >>> gan = GANModule(generator, critic, noise_size=8)
        >>> points = DataBunch(DataLoader(TensorDataset(torch.randn(64, 2) + 3), 16))
        >>> learn = Learner(points, gan, GANLoss("wgan"),
        ...                 opt_func={"generator": Adam, "critic": Adam},
        ...                 callbacks=[GANTrainer(n_critic=5)], progress=False)
        >>> learn.fit(2, lr=1e-3)
        History(2 epochs: train_loss ... -> ..., train_critic ... -> ...,
                train_generator ...)
        >>> samples = gan.generate(1000)
        >>> samples.shape
        torch.Size([1000, 2])
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
        if noise is not None and not callable(noise):
            raise TypeError(
                f"GANModule: noise must be a function noise(n, device) -> a batch "
                f"of noise, or None; got {noise!r} ({type(noise).__name__}). Fix: "
                "e.g. noise=lambda n, device: torch.rand(n, 8, device=device) "
                "(None draws torch.randn(n, *noise_size))."
            )
        self.generator, self.critic = generator, critic
        self.noise_size = _noise_size(noise_size)
        self._noise = noise
        self.mode: str | None = None
        # (mode, real samples' shape) already checked: each is checked once.
        self._checked: set[tuple[str, torch.Size]] = set()

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
        key = (mode, real.shape)
        check = key not in self._checked  # the first batch of a turn and shape
        if mode == "critic":
            with torch.no_grad():  # the generator does not learn in this turn
                fake = self.generator(z)
        else:
            fake = self.generator(z)
        if check:
            _same_shape(fake, real)  # before the critic scores it
        # Real first, as loops usually do.
        real_scores = None if mode == "generator" else self.critic(real)
        out = GANOutput(mode, self.critic(fake), real_scores, fake, real)
        if check:
            _check_scores(out)
            self._checked.add(key)
        return out

    @torch.no_grad()
    def generate(
        self, n: int, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """``n`` samples from the generator (in eval mode, without gradients),
        on ``device`` (default: the generator's)."""
        n = check_int(n, "n", minimum=0, owner="GANModule.generate", example=1000)
        if device is None:
            device = next(self.generator.parameters()).device
        device = _device(device)
        training = self.generator.training
        self.generator.eval()
        try:
            return self.generator(self.noise(n, device))
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


def _noise_size(size: Any) -> tuple[int, ...]:
    """``noise_size`` as a tuple of ints >= 1, or an error saying the fix."""
    if not isinstance(size, tuple | list):
        return (check_int(size, "noise_size", minimum=1, owner="GANModule", example=8),)
    ints = all(is_int(d) for d in size)
    if size and ints and min(size) >= 1:
        return tuple(int(d) for d in size)
    raise (ValueError if ints else ArgTypeError)(
        f"GANModule: noise_size must be an int >= 1 or a non-empty tuple of them "
        f"(the shape of one noise sample); got {size!r}. Fix: e.g. noise_size=8 "
        "or, for a convolutional generator, noise_size=(100, 1, 1)."
    )


def _check_scores(out: GANOutput) -> None:
    """Refuses critic scores that are not one per sample: ``(n,)`` or
    ``(n, 1)``, or one map per sample, ``(n, 1, ...)`` (a convolutional
    critic's ``(n, 1, 1, 1)``, a PatchGAN's ``(n, 1, h, w)``, whose scores
    the loss averages). More than one channel (a two-class head's ``(n, 2)``)
    is refused. Only shapes are read: no host sync."""
    n = out.real.shape[0]
    for scores in (out.real_scores, out.fake_scores):
        if scores is None:
            continue  # (the generator's turn scores the fakes only)
        tensor = isinstance(scores, torch.Tensor) and scores.ndim >= 1
        if not tensor or scores.shape[0] != n or scores.shape[1:2] not in ((), (1,)):
            raise ValueError(_scores_message(scores, n))


def _scores_message(scores: Any, n: int) -> str:
    """Says that the critic's ``scores`` of ``n`` samples are not one each."""
    tensor = isinstance(scores, torch.Tensor)
    got = f"shape {tuple(scores.shape)}" if tensor else type(scores).__name__
    fix = (
        "for maps of scores with several channels, one channel: end the critic "
        "with a convolution to 1 channel (a PatchGAN's (n, 1, h, w) is taken)"
        if tensor and scores.ndim > 2
        else "for a two-class head (fake, real), its logit of 'real' is "
        "scores[:, 1] - scores[:, 0]"
    )
    return (
        f"GANModule: the critic must return one score per sample, of shape "
        f"(n,) or (n, 1) (here ({n},) or ({n}, 1)), or one map of scores per "
        f"sample in one channel, (n, 1, ...) such as a PatchGAN's (n, 1, h, w); "
        f"it returned {got} for {n} samples. Fix: end the critic with one "
        f"output (e.g. nn.Linear(hidden, 1)); {fix}."
    )


def _same_shape(fake: torch.Tensor, real: torch.Tensor) -> None:
    """Refuses a ``fake`` without the real samples' shape (the critic scores
    both)."""
    if not isinstance(fake, torch.Tensor) or fake.shape != real.shape:
        got = (
            f"of shape {tuple(fake.shape)}"
            if isinstance(fake, torch.Tensor)
            else f"as a {type(fake).__name__}"
        )
        raise ValueError(
            f"GANModule: the generator made samples {got}, but the real samples "
            f"of the batch have shape {tuple(real.shape)}; the critic scores "
            "both. Fix: make the generator's output the shape of one real "
            "sample (and noise(n, device) give n samples)."
        )


def _device(device: Any) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ArgTypeError(
            f"GANModule.generate: device must be a torch.device or a name such "
            f"as 'cpu' or 'cuda'; got {device!r} ({type(device).__name__}). "
            "Fix: e.g. gan.generate(1000, device='cpu')."
        ) from e


class GANLoss:
    """The loss of a ``GANModule``'s turn, by ``kind``:

    - ``"bce"``: the standard GAN; the critic's scores are logits (binary
      cross-entropy, real 1 and fake 0), the generator's loss the
      non-saturating one (its fakes taken for real);
    - ``"wgan"``: Wasserstein (critic ``mean(fake) - mean(real)``, generator
      ``-mean(fake)``); add a gradient penalty (docs/how-to/change-a-training-step.md)
      or clip the critic's weights;
    - ``"hinge"``: hinge loss for the critic, ``-mean(fake)`` for the generator;
    - ``"lsgan"``: least squares.

    Returns a dict: ``"loss"`` (what backward uses) and the turn's part,
    ``"critic"`` or ``"generator"`` (both in evaluation, where ``"loss"`` is
    the critic's), so the epoch record has ``train_critic``,
    ``train_generator``, ``valid_critic``, ``valid_generator``.

    Examples:
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> gan = GANModule(nn.Linear(8, 2), nn.Linear(2, 1), noise_size=8)
        >>> points = DataBunch(DataLoader(TensorDataset(torch.randn(64, 2)), 16))
        >>> adam = torch.optim.Adam
        >>> learn = Learner(points, gan, GANLoss("bce"),
        ...                 opt_func={"generator": adam, "critic": adam},
        ...                 callbacks=[GANTrainer()], progress=False)
        >>> learn.fit(1, lr=1e-3)[-1]
        {'epoch': 0, 'train_loss': ..., 'valid_loss': None, 'train_critic': ...,
         'train_generator': ..., 'valid_critic': None, 'valid_generator': None,
         'lr': 0.001, 'time': ...}
    """

    part_names = ("critic", "generator")

    def __init__(self, kind: str = "bce") -> None:
        if not isinstance(kind, str) or kind not in _KINDS:
            error = ValueError if isinstance(kind, str) else ArgTypeError
            close = f" ({kind.lower()!r}?)" if str(kind).lower() in _KINDS else ""
            raise error(
                f"GANLoss: unknown kind {kind!r}{close}; kind must be one of "
                f"{list(_KINDS)}. Fix: e.g. GANLoss('wgan')."
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
