"""Segment synthetic shapes, pixel by pixel, with a small fully convolutional net.

The example shows semantic segmentation with fitlib: a model whose output is a
``(B, C, H, W)`` map of class scores, trained with per-pixel cross-entropy
against ``(B, H, W)`` masks, and scored per pixel with ``accuracy``,
``MeanIoU`` and ``Dice`` (fitlib finds the class dim, 1, from the shapes).

The data is made by the script, no download: 32x32 single-channel noisy
images, each with one to three random shapes, filled rectangles and discs of
random size, place and brightness. Each pixel is one of 3 classes:
background (0), rectangle (1) or disc (2). The net must tell the two shapes
apart by their outline, not their brightness.

The model: an encoder of strided convolutions (32x32 -> 16x16 -> 8x8), then
transposed convolutions back to 32x32, with skip connections from the encoder
(as in FCN and U-Net), and a 1x1 convolution to 3 class scores per pixel.

Run it (about half a minute on a 2-core CPU)::

    python examples/fcn_segmentation.py [--epochs N] [--batch-size B] [--n N] [--seed S]
"""

import cli  # the shared command line (examples/cli.py)
import torch
from torch import Tensor, nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

from fitlib import DataBunch, Learner
from fitlib.metrics import Dice, MeanIoU, accuracy

SIZE = 32  # image side, in pixels
CLASSES = ("background", "rectangle", "disc")


def make_shapes(n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``n`` noisy images ``(n, 1, SIZE, SIZE)`` and their masks ``(n, SIZE, SIZE)``.

    Each image gets 1 to 3 shapes, drawn in turn (a later one covers an
    earlier one): a rectangle of sides 5 to 13 or a disc of radius 3 to 6, of
    brightness 0.6 to 1, on a background of brightness 0, plus Gaussian noise
    of std 0.25.
    """

    def rand(low: float, high: float) -> float:
        return low + (high - low) * torch.rand((), generator=generator).item()

    def randint(low: int, high: int) -> int:  # in [low, high]
        return int(torch.randint(low, high + 1, (), generator=generator))

    rows = torch.arange(SIZE).view(SIZE, 1)
    cols = torch.arange(SIZE).view(1, SIZE)
    images = torch.zeros(n, 1, SIZE, SIZE)
    masks = torch.zeros(n, SIZE, SIZE, dtype=torch.long)
    for i in range(n):
        for _ in range(randint(1, 3)):
            if randint(0, 1) == 0:  # a rectangle
                h, w = randint(5, 13), randint(5, 13)
                top, left = randint(0, SIZE - h), randint(0, SIZE - w)
                inside = (
                    (rows >= top)
                    & (rows < top + h)
                    & (cols >= left)
                    & (cols < left + w)
                )
                label = 1
            else:  # a disc
                r = randint(3, 6)
                cy, cx = randint(r, SIZE - 1 - r), randint(r, SIZE - 1 - r)
                inside = (rows - cy) ** 2 + (cols - cx) ** 2 <= r * r
                label = 2
            images[i, 0][inside] = rand(0.6, 1.0)
            masks[i][inside] = label
    images += 0.25 * torch.randn(images.shape, generator=generator)
    return images, masks


def shapes_data(n: int, batch_size: int, seed: int = 0) -> DataBunch:
    """``n`` training images and ``n // 4`` (at least 1) validation images."""
    generator = torch.Generator().manual_seed(seed)
    x, y = make_shapes(n + max(n // 4, 1), generator)
    train_ds = TensorDataset(x[:n], y[:n])
    valid_ds = TensorDataset(x[n:], y[n:])
    train_dl = DataLoader(train_ds, batch_size, shuffle=True, drop_last=False)
    valid_dl = DataLoader(valid_ds, 2 * batch_size)
    return DataBunch(train_dl, valid_dl)


def conv(c_in: int, c_out: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, stride, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
    )


def up(c_in: int, c_out: int) -> nn.Sequential:
    """Doubles the resolution: a 2x2 transposed convolution of stride 2."""
    return nn.Sequential(
        nn.ConvTranspose2d(c_in, c_out, 2, stride=2, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
    )


class FCN(nn.Module):
    """32x32 -> 16x16 -> 8x8 and back, with skips; ``(B, C, H, W)`` scores."""

    def __init__(self, n_classes: int = len(CLASSES), width: int = 8) -> None:
        super().__init__()
        w = width
        self.enc1 = conv(1, w)  # 32x32
        self.enc2 = nn.Sequential(conv(w, 2 * w, stride=2), conv(2 * w, 2 * w))  # 16
        self.enc3 = nn.Sequential(conv(2 * w, 4 * w, stride=2), conv(4 * w, 4 * w))  # 8
        self.up2 = up(4 * w, 2 * w)  # 8 -> 16
        self.dec2 = conv(2 * w, 2 * w)
        self.up1 = up(2 * w, w)  # 16 -> 32
        self.dec1 = conv(w, w)
        self.head = nn.Conv2d(w, n_classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(e1)
        e3 = self.enc3(e2)
        d2 = self.dec2(self.up2(e3) + e2)  # skip connections add the encoder's maps
        d1 = self.dec1(self.up1(d2) + e1)
        return self.head(d1)


def main(
    epochs: int = 10,
    batch_size: int = 16,
    n: int | None = None,
    progress: bool = True,
    seed: int = 0,
) -> Learner:
    """Makes ``n`` images (1,000 by default), trains the FCN, returns the Learner."""
    torch.manual_seed(seed)  # the same weights and batch order on every run
    data = shapes_data(1000 if n is None else n, batch_size, seed)
    learn = Learner(
        data,
        FCN(),
        loss_func=F.cross_entropy,  # per pixel: (B, C, H, W) scores, (B, H, W) masks
        metrics=[accuracy, MeanIoU(), Dice()],
        progress=progress,
    )
    learn.fit_one_cycle(epochs, lr=1e-2)
    return learn


if __name__ == "__main__":
    learn = main(**cli.args(main, __doc__))
    print(cli.result_line("fcn_segmentation", learn, "mean_iou"))
