"""What ``MixUp`` and ``CutMix`` share: a generator of their own, drawing on
the model's device (its state is plain values, so a checkpoint resumes the
draws exactly), the mixing weight and CutMix's box drawn without any host
read, the inputs mixed with the batch rolled by one (``x.roll(1, 0)``: every
sample gets a partner, an odd last batch too), and the mixed loss.

One weight per batch (as fastai's ``MixUp`` and timm's default ``batch``
mode), folded to ``lam >= 0.5``: the unrolled sample weighs most, so the
batch's own targets are the ones its metrics read.

Examples:
    >>> from fitlib.mixing import MixGenerator, draw_lambda, mix_inputs
    >>> gen = MixGenerator(seed=0)
    >>> gen.start(torch.device("cpu"))
    >>> lam = draw_lambda(gen.concentration(0.4), gen.generator)
    >>> bool(lam >= 0.5)
    True
    >>> x = torch.tensor([[0.0], [1.0], [2.0]])
    >>> mix_inputs(x, torch.tensor(0.75))  # each row with the row before it
    tensor([[0.5000],
            [0.7500],
            [1.7500]])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F  # noqa: N812

from fitlib.errors import name_of
from fitlib.label_smoothing import smoothed_masked_cross_entropy
from fitlib.sequences import masked_cross_entropy
from fitlib.structure import map_tensors, tensors

# what ``seed=None`` XORs with torch.initial_seed() ("mixup" in ASCII)
_SALT = 0x6D69787570


class MixGenerator:
    """A ``torch.Generator`` on the model's device, seeded once, whose state
    ``state_dict`` returns: a resumed fit draws what an unbroken one drew.

    ``seed=None`` seeds it from ``torch.initial_seed()`` (what
    ``torch.manual_seed`` set) XOR a constant of its own, so a seeded script
    draws the same weights at every run, and the draws take nothing from
    torch's global generator (the data order and dropout stay those of the
    same fit without mixing); not that seed itself, which on CUDA would
    replay the random stream of torch's own first kernels (dropout).
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self.generator: torch.Generator | None = None
        self._loaded: dict | None = None
        self._concentration: tuple[float, torch.Tensor] | None = None

    def start(self, device: torch.device) -> None:
        """Makes the generator on ``device`` (kept across fits on one device)
        and puts in the state ``load_state_dict`` gave, if any."""
        device = torch.device(device)
        if self.generator is None or self.generator.device != device:
            seed = torch.initial_seed() ^ _SALT if self.seed is None else self.seed
            self.generator = torch.Generator(device).manual_seed(seed)
            self._concentration = None
        if self._loaded is not None:
            state, self._loaded = self._loaded, None
            if state["device"] != device.type:
                raise ValueError(
                    f"the mixing generator's state was saved on {state['device']} "
                    f"and this fit runs on {device.type}; its draws cannot go on "
                    "there. Fix: resume on the device that saved the checkpoint."
                )
            self.generator.set_state(state["state"])

    def concentration(self, alpha: float) -> torch.Tensor:
        """``[alpha, alpha]`` on the generator's device (made once)."""
        if self._concentration is None or self._concentration[0] != alpha:
            c = torch.full((2,), float(alpha), device=self.generator.device)
            self._concentration = (alpha, c)
        return self._concentration[1]

    def state_dict(self) -> dict:
        if self.generator is None:
            return {} if self._loaded is None else dict(self._loaded)
        state = self.generator.get_state()
        return {"device": self.generator.device.type, "state": state}

    def load_state_dict(self, state: dict) -> None:
        """Keeps ``state`` for the next ``start``; an empty one (saved before
        any fit, as the LR sweep does) makes that start seed it afresh."""
        self._loaded = dict(state) if state else None
        if not state:
            self.generator = None


def draw_lambda(
    concentration: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """A weight from Beta(alpha, alpha), folded to ``max(lam, 1 - lam)``: a
    0-dim tensor on the generator's device, never read on the host."""
    # Beta(a, a) is the first coordinate of a Dirichlet(a, a); torch's public
    # Beta takes no generator, the sampler it calls does.
    lam = torch._sample_dirichlet(concentration, generator=generator)[0]
    return torch.maximum(lam, 1 - lam)


def draw_box(
    lam: torch.Tensor, height: int, width: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """CutMix's box for a weight ``lam``: a ``(height, width)`` bool mask of
    the area taken from the partner, and the weight corrected to the area it
    leaves (``1 - box area / image area``, the box clipped at the edges).

    The box has sides ``side * sqrt(1 - lam)`` (rounded down, then halved on
    each side of its center) around a center drawn uniformly on the image;
    all on the device."""
    cut = (1 - lam).sqrt()
    rows, n_rows = _span(height, cut, generator)
    cols, n_cols = _span(width, cut, generator)
    return rows[:, None] & cols, 1 - (n_rows * n_cols).to(lam.dtype) / (height * width)


def _span(size: int, cut: torch.Tensor, generator: torch.Generator) -> tuple:
    """One side of the box: the positions it covers of ``size`` (a bool
    vector) and how many, around a center drawn from ``generator``."""
    device = cut.device
    center = torch.randint(size, (), generator=generator, device=device)
    half = (size * cut).floor().long() // 2
    start, end = (center - half).clamp(0, size), (center + half).clamp(0, size)
    at = torch.arange(size, device=device)
    return (at >= start) & (at < end), end - start


def rolled(x: Any) -> Any:
    """Each tensor of ``x`` (a batch's inputs or targets) rolled by one sample:
    sample ``i`` gets sample ``i - 1``'s (the first gets the last)."""
    return map_tensors(lambda t: t.roll(1, 0), x)


def mixed_tensors(x: Any, owner: str, min_dims: int = 1) -> list[torch.Tensor]:
    """The floating-point tensors of ``x`` that are mixed; a ValueError
    naming ``owner`` when there is none (checked at a fit's first batch)."""
    found = [t for _, t in tensors(x) if t.is_floating_point() and t.ndim >= min_dims]
    if not found:
        shapes = [f"{tuple(t.shape)} {t.dtype}" for _, t in tensors(x)] or ["none"]
        what = "floating-point inputs" + (
            " of shape (N, ..., H, W)" if min_dims > 1 else ""
        )
        fix = (
            f"images (N, C, H, W) or (N, H, W) for {owner}, MixUp for other inputs"
            if min_dims > 1
            else "convert the inputs to float in the dataset (e.g. x.float() / "
            f"255), or leave {owner} out for inputs it cannot mix (token ids)"
        )
        raise ValueError(
            f"{owner} mixes {what}; the batch's inputs hold {', '.join(shapes)}. "
            f"Fix: {fix}."
        )
    return found


def mix_inputs(x: Any, lam: torch.Tensor) -> Any:
    """MixUp's inputs: each floating-point tensor of ``x`` as
    ``lam * t + (1 - lam) * t.roll(1, 0)`` (other tensors kept)."""

    def mix(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        return torch.lerp(t.roll(1, 0), t, lam.to(t.dtype))

    return map_tensors(mix, x)


def cut_inputs(x: Any, mask: torch.Tensor) -> Any:
    """CutMix's inputs: in each floating-point tensor of ``x`` with at least
    three dims, the area ``mask`` covers (on the last two dims) taken from
    ``t.roll(1, 0)``."""

    def cut(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.ndim < 3:
            return t
        return torch.where(mask, t.roll(1, 0), t)

    return map_tensors(cut, x)


def mixed_loss(
    loss_func: Callable[..., Any],
    out: Any,
    targets: Any,
    loss: torch.Tensor,
    lam: torch.Tensor,
) -> torch.Tensor:
    """``lam * loss + (1 - lam) * loss_func(out, *rolled targets)``, where
    ``loss`` is ``loss_func(out, *targets)`` (the loop computed it): any
    loss, mixed on the loss side (a dict loss's ``"loss"``)."""
    partner = call_loss(loss_func, out, rolled(targets))
    return torch.lerp(partner, loss, lam.to(loss.dtype))


def soft_targets(out: Any, targets: Any, lam: torch.Tensor) -> torch.Tensor:
    """The mixed target as probabilities, ``lam * t + (1 - lam) *
    t.roll(1, 0)``: class indices as one-hot over the output's class dim
    (dim 1, as torch's losses take it), float targets as they are
    (``check_soft_targets`` says which, at a fit's first batch)."""
    y = _one_target(targets)
    if not y.is_floating_point():
        y = F.one_hot(y.long(), out.shape[1]).movedim(-1, 1).to(out.dtype)
    return torch.lerp(y.roll(1, 0), y, lam.to(y.dtype))


def check_soft_targets(out: Any, targets: Any, owner: str) -> None:
    """Refuses targets ``soft_targets`` cannot mix, naming ``owner``: it
    needs one output tensor and one target tensor, class indices ``(N, ...)``
    (none negative) for an output ``(N, C, ...)``, or float targets of the
    output's shape. Reads the targets on the host: the first batch only."""
    y = _one_target(targets)
    fix = "Fix: targets='loss' (mixes the loss, any loss)."
    if not isinstance(y, torch.Tensor) or not isinstance(out, torch.Tensor):
        raise ValueError(
            f"{owner}(targets='soft') mixes one target tensor for one output "
            f"tensor; got targets {_shape_of(targets)} for an output "
            f"{_shape_of(out)}. {fix}"
        )
    if y.is_floating_point() and y.shape == out.shape:
        return
    if y.is_floating_point() or out.ndim != y.ndim + 1:
        raise ValueError(
            f"{owner}(targets='soft') needs class indices of shape (N, ...) for "
            f"an output (N, C, ...), or float targets of the output's shape; got "
            f"targets {_shape_of(y)} for an output {_shape_of(out)}. {fix}"
        )
    if bool((y < 0).any()):
        raise ValueError(
            f"{owner}(targets='soft') makes one-hot targets from class indices, "
            f"and got a negative one (an ignore_index?) in targets "
            f"{_shape_of(y)}. {fix}"
        )


def check_soft_loss(loss_func: Any, owner: str) -> None:
    """Refuses, before training, a loss with which ``targets="soft"`` would
    not train as the mixed loss (``targets="loss"``) does, naming ``owner``:
    the masked sequence losses (they take class indices), a class-weighted
    cross-entropy (``weight=``: on probabilities torch averages over the
    samples, not over their weights: another loss), and one with an
    ``ignore_index`` other than -100 (torch refuses it on probabilities).
    Reads the loss's attributes (``nn.CrossEntropyLoss``) or its partial's
    keywords; a loss written by hand is the caller's to check."""
    func = getattr(loss_func, "func", loss_func)
    keywords = dict(getattr(loss_func, "keywords", None) or {})
    if isinstance(loss_func, torch.nn.CrossEntropyLoss):
        keywords = {"weight": loss_func.weight, "ignore_index": loss_func.ignore_index}
    name = name_of(loss_func)
    head = f"{owner}(targets='soft') calls the loss once on mixed probabilities"
    fix = "Fix: targets='loss' (mixes the two losses, any loss)."
    if func is masked_cross_entropy or func is smoothed_masked_cross_entropy:
        raise ValueError(
            f"{head}, and {name} takes class indices (it leaves out the padded "
            f"tokens by their index), not probabilities. {fix}"
        )
    if keywords.get("weight") is not None:
        raise ValueError(
            f"{head}, and {name} weighs the classes (weight=...): on "
            "probabilities torch averages the weighted loss over the samples, "
            "on class indices over the samples' weights, so the soft targets "
            f"would train another loss than the mixed one. {fix}"
        )
    ignore_index = keywords.get("ignore_index", -100)
    if ignore_index != -100:
        raise ValueError(
            f"{head}, and {name} has ignore_index={ignore_index}, which torch "
            f"refuses for probabilities. {fix}"
        )


def check_cut(x: Any, targets: Any, owner: str) -> tuple[int, int]:
    """The ``(H, W)`` of the images ``CutMix`` cuts (the last two dims of
    the first tensor ``mixed_tensors`` finds); refuses, naming ``owner``,
    images too small for any box (a side under 3: the box's half-sides are
    ``side * sqrt(1 - lam)`` rounded down, halved, and ``lam >= 0.5``) and
    per-pixel targets (a tensor of 3 dims or more ending in ``(H, W)``: a
    segmentation mask would need the same box cut)."""
    height, width = mixed_tensors(x, owner, 3)[0].shape[-2:]
    if min(int(height * 0.5**0.5) // 2, int(width * 0.5**0.5) // 2) == 0:
        raise ValueError(
            f"{owner} cuts a box of at most half the image with sides of at "
            f"least 2 pixels, so it needs images with H and W >= 3; the batch's "
            f"images have (H, W) = ({height}, {width}). Fix: MixUp for small "
            "images and signals (N, C, L)."
        )
    for _, t in tensors(targets):
        if t.ndim >= 3 and tuple(t.shape[-2:]) == (height, width):
            raise ValueError(
                f"{owner} mixes the targets of whole images, and got per-pixel "
                f"targets {tuple(t.shape)} (their last two dims are the image's "
                f"(H, W) = ({height}, {width})): they would need the same box "
                f"cut, which {owner} does not do. Fix: MixUp (blends the masks' "
                f"losses as the images), or leave {owner} out for segmentation."
            )
    return height, width


def _one_target(targets: Any) -> Any:
    one = isinstance(targets, (tuple, list)) and len(targets) == 1
    return targets[0] if one else targets


def call_loss(loss_func: Callable[..., Any], out: Any, targets: Any) -> torch.Tensor:
    """``loss_func(out, *targets)`` as the loop calls it; a dict's ``"loss"``."""
    if isinstance(targets, (tuple, list)):
        loss = loss_func(out, *targets)
    else:  # one target: a tensor, a dict of them (the loop's as_tuple)
        loss = loss_func(out, targets)
    return loss["loss"] if isinstance(loss, dict) else loss


def _shape_of(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{tuple(x.shape)} {x.dtype}"
    return type(x).__name__
