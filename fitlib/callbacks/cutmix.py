"""``CutMix``: pastes a box of each sample's partner into it.

As ``MixUp`` (whose pairing, generator, loss mixing, ``targets``,
``stop_at_epoch`` and resume it shares), but each training batch's images
``(N, C, H, W)`` (or ``(N, H, W)``: the box is on the last two dims) get a
box of their partner's pixels (``x.roll(1, 0)``) instead of a blend: one box
per batch, of area ``(1 - lam)`` of the image for ``lam`` drawn from
Beta(alpha, alpha) and folded to ``lam >= 0.5``, centred anywhere on the
image and clipped at its edges; the weight of the loss is then corrected to
the area the box really covers (``1 - box area / image area``). The box is
drawn and cut on the device: no host read. Inputs of fewer than three dims
in the batch (a vector beside the image) are left as they are. Refused at
the first batch: images with a side under 3 pixels (no box fits; signals
``(N, C, L)`` too) and per-pixel targets (a mask ``(N, H, W)``, which the
box would have to cut as well: use ``MixUp`` there).
"""

from __future__ import annotations

from typing import Any

import torch

from fitlib.callbacks.mixup import MixUp
from fitlib.mixing import check_cut, cut_inputs, draw_box, draw_lambda, mixed_tensors


class CutMix(MixUp):
    """CutMix (Yun et al., 2019) on the training batches, exact on resume.

    Args:
        alpha: the Beta distribution's parameter (> 0); 1 (default) gives a
            box of uniformly drawn area (at most half the image: the image
            keeps the larger part).
        targets: as ``MixUp``'s.
        stop_at_epoch: as ``MixUp``'s.
        seed: as ``MixUp``'s.

    Examples:
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> images = TensorDataset(torch.randn(20, 1, 8, 8), torch.randint(0, 3, (20,)))
        >>> cnn = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(144, 3))
        >>> image_data = DataBunch(DataLoader(images, 8), DataLoader(images, 8))
        >>> cutmix = CutMix(alpha=1.0)
        >>> fit(2, cnn, F.cross_entropy, torch.optim.SGD(cnn.parameters(), 0.1),
        ...     image_data, callbacks=[cutmix])
        History(2 epochs: train_loss ... -> ..., valid_loss ... -> ...)
        >>> bool(cutmix.lam >= 0.5)  # the last batch's weight: the area kept
        True
    """

    _min_dims = 3  # images: the box is on the last two dims
    _default_alpha = 1.0

    def __init__(
        self,
        alpha: float = 1.0,
        *,
        targets: str = "loss",
        stop_at_epoch: int | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__(alpha, targets=targets, stop_at_epoch=stop_at_epoch, seed=seed)

    def _check_batch(self, x: Any, targets: Any) -> None:
        """Refuses, at the first batch, images too small for any box and
        per-pixel targets (``check_cut``)."""
        check_cut(x, targets, self.name)

    def mix(self, x: Any) -> tuple[torch.Tensor, Any]:
        """The batch's weight (the area kept) and its inputs with the box cut in."""
        gen = self.generator
        lam = draw_lambda(gen.concentration(self.alpha), gen.generator)
        height, width = mixed_tensors(x, self.name, 3)[0].shape[-2:]
        mask, lam = draw_box(lam, height, width, gen.generator)
        return lam, cut_inputs(x, mask)
