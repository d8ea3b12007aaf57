"""Detect synthetic squares with a tiny SSD-style single-shot detector.

The example shows a model with a structured output and several targets in
fitlib: the model returns a tuple ``(class_scores, box_offsets)``, the batches
are ``(x, (anchor_classes, anchor_offsets))``, the loss returns its parts
(``{"loss": cls + box, "cls": ..., "box": ...}``, reported as ``train_cls``,
``valid_box``, ...), and ``metrics.Part`` points the class metrics at the
class head and the class targets. ``learn.predict`` on one image gives the
tuple back without the batch dim, decoded here into boxes.

The data is made by the script, no download: 32x32 single-channel noisy
images, each with one or two non-overlapping squares of side 6 to 14 at
random places, of 2 classes: filled squares (class 1) and hollow ones, a
frame 2 pixels wide (class 2). Class 0 is the background.

The detector: a 4x4 grid of anchor cells (stride 8) with two anchor sizes per
cell, 32 anchors in all. Each object is matched to the anchors it overlaps
with an IoU of 0.5 or more, and always to its best anchor; the other anchors
are background. A strided conv backbone (32 -> 16 -> 8 -> 4) feeds two 3x3
conv heads: per anchor, 3 class scores and 4 box offsets (centre shift and
log size ratio, in anchor sizes, as in SSD). The box loss (smooth L1) counts
the positive anchors only.

Run it (well under a minute on a 2-core CPU)::

    python examples/ssd_detection.py [--epochs N] [--batch-size B] [--n N] [--seed S]
"""

import cli  # the shared command line (examples/cli.py)
import torch
from torch import Tensor, nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, Dataset

from fitlib import DataBunch, Learner
from fitlib.metrics import F1Score, Part, accuracy

SIZE = 32  # image side, in pixels
GRID = 4  # anchor cells per side
ANCHOR_SIZES = (8.0, 14.0)
CLASSES = ("background", "filled", "hollow")


def make_anchors() -> Tensor:
    """``(GRID * GRID * len(ANCHOR_SIZES), 4)`` anchors as (cx, cy, w, h), in
    the order the heads' outputs are flattened: row, column, size."""
    stride = SIZE / GRID
    centres = (torch.arange(GRID) + 0.5) * stride
    cy, cx = torch.meshgrid(centres, centres, indexing="ij")
    anchors = [
        torch.stack([cx, cy, torch.full_like(cx, s), torch.full_like(cx, s)], -1)
        for s in ANCHOR_SIZES
    ]
    return torch.stack(anchors, 2).reshape(-1, 4)  # (row, col, size) order


ANCHORS = make_anchors()


def corners(boxes: Tensor) -> Tensor:
    """(cx, cy, w, h) -> (x0, y0, x1, y1)."""
    c, half = boxes[..., :2], boxes[..., 2:] / 2
    return torch.cat([c - half, c + half], -1)


def iou(a: Tensor, b: Tensor) -> Tensor:
    """IoU of every box of ``a`` ``(N, 4)`` with every box of ``b`` ``(M, 4)``."""
    a, b = corners(a), corners(b)
    low = torch.maximum(a[:, None, :2], b[None, :, :2])
    high = torch.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = (high - low).clamp(min=0).prod(-1)
    area_a = (a[:, 2:] - a[:, :2]).prod(-1)
    area_b = (b[:, 2:] - b[:, :2]).prod(-1)
    return inter / (area_a[:, None] + area_b[None, :] - inter)


def encode(boxes: Tensor, anchors: Tensor) -> Tensor:
    """Box offsets from anchors: centre shift and log size ratio, in anchor sizes."""
    shift = (boxes[..., :2] - anchors[..., :2]) / anchors[..., 2:]
    scale = torch.log(boxes[..., 2:] / anchors[..., 2:])
    return torch.cat([shift, scale], -1)


def decode(offsets: Tensor, anchors: Tensor) -> Tensor:
    """The inverse of ``encode``: (cx, cy, w, h) boxes."""
    centre = anchors[..., :2] + offsets[..., :2] * anchors[..., 2:]
    size = anchors[..., 2:] * torch.exp(offsets[..., 2:])
    return torch.cat([centre, size], -1)


def match(
    boxes: Tensor, labels: Tensor, threshold: float = 0.5
) -> tuple[Tensor, Tensor]:
    """Per anchor, the class (0: background) and the box offsets to learn.

    An anchor takes the object it overlaps most if their IoU is at least
    ``threshold``; each object also takes its best anchor, so none is missed.
    """
    overlaps = iou(ANCHORS, boxes)  # (anchors, objects)
    best_iou, best_obj = overlaps.max(1)
    best_anchor = overlaps.argmax(0)
    best_obj[best_anchor] = torch.arange(len(boxes))
    best_iou[best_anchor] = 1.0
    classes = torch.where(best_iou >= threshold, labels[best_obj], 0)
    offsets = encode(boxes[best_obj], ANCHORS)
    return classes, offsets * (classes > 0).unsqueeze(-1)  # zeros on background


def make_squares(n: int, generator: torch.Generator) -> tuple[Tensor, list, list]:
    """``n`` noisy images ``(n, 1, SIZE, SIZE)``, and per image its boxes
    ``(k, 4)`` as (cx, cy, w, h) and their classes ``(k,)``."""

    def randint(low: int, high: int) -> int:  # in [low, high]
        return int(torch.randint(low, high + 1, (), generator=generator))

    images = torch.zeros(n, 1, SIZE, SIZE)
    all_boxes, all_labels = [], []
    for i in range(n):
        boxes: list[list[float]] = []
        labels: list[int] = []
        placed: list[tuple[int, int, int]] = []
        for _ in range(randint(1, 2)):
            for _try in range(20):  # a place that overlaps no earlier square
                side = randint(6, 14)
                top, left = randint(0, SIZE - side), randint(0, SIZE - side)
                if all(
                    top >= t + s + 1 or t >= top + side + 1
                    or left >= x + s + 1 or x >= left + side + 1
                    for t, x, s in placed
                ):  # fmt: skip
                    break
            else:
                continue
            placed.append((top, left, side))
            label = randint(1, 2)
            square = images[i, 0, top : top + side, left : left + side]
            square.fill_(0.6 + 0.4 * torch.rand((), generator=generator).item())
            if label == 2:  # hollow: clear all but a frame 2 pixels wide
                square[2:-2, 2:-2] = 0.0
            boxes.append([left + side / 2, top + side / 2, side, side])
            labels.append(label)
        all_boxes.append(torch.tensor(boxes))
        all_labels.append(torch.tensor(labels))
    images += 0.2 * torch.randn(images.shape, generator=generator)
    return images, all_boxes, all_labels


class Squares(Dataset):
    """Items ``(image, (anchor_classes, anchor_offsets))``: two targets."""

    def __init__(self, images: Tensor, boxes: list, labels: list) -> None:
        self.images = images
        targets = [match(b, c) for b, c in zip(boxes, labels, strict=True)]
        self.classes = torch.stack([t[0] for t in targets])  # (n, anchors)
        self.offsets = torch.stack([t[1] for t in targets])  # (n, anchors, 4)
        self.boxes, self.labels = boxes, labels  # the ground truth, to compare

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        return self.images[i], (self.classes[i], self.offsets[i])


def squares_data(n: int, batch_size: int, seed: int = 0) -> DataBunch:
    """``n`` training images and ``n // 4`` (at least 1) validation images."""
    generator = torch.Generator().manual_seed(seed)
    n_valid = max(n // 4, 1)
    x, boxes, labels = make_squares(n + n_valid, generator)
    train_ds = Squares(x[:n], boxes[:n], labels[:n])
    valid_ds = Squares(x[n:], boxes[n:], labels[n:])
    train_dl = DataLoader(train_ds, batch_size, shuffle=True)
    valid_dl = DataLoader(valid_ds, 2 * batch_size)
    return DataBunch(train_dl, valid_dl)


def conv(c_in: int, c_out: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, stride, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
    )


class TinySSD(nn.Module):
    """A conv backbone to a GRID x GRID map, and two heads over its anchors.

    Returns ``(class_scores, box_offsets)``: ``(B, anchors, classes)`` and
    ``(B, anchors, 4)``.
    """

    def __init__(self, n_classes: int = len(CLASSES), width: int = 16) -> None:
        super().__init__()
        w, k = width, len(ANCHOR_SIZES)
        self.n_classes = n_classes
        self.backbone = nn.Sequential(
            conv(1, w, stride=2),  # 16x16
            conv(w, 2 * w, stride=2),  # 8x8
            conv(2 * w, 4 * w, stride=2),  # 4x4
            conv(4 * w, 4 * w),
        )
        self.cls_head = nn.Conv2d(4 * w, k * n_classes, 3, padding=1)
        self.box_head = nn.Conv2d(4 * w, k * 4, 3, padding=1)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        features = self.backbone(x)
        b = x.shape[0]

        def per_anchor(t: Tensor, n: int) -> Tensor:  # (B, k*n, H, W) -> (B, A, n)
            return t.permute(0, 2, 3, 1).reshape(b, -1, n)

        scores = per_anchor(self.cls_head(features), self.n_classes)
        offsets = per_anchor(self.box_head(features), 4)
        return scores, offsets


def ssd_loss(
    out: tuple[Tensor, Tensor], classes: Tensor, offsets: Tensor
) -> dict[str, Tensor]:
    """Cross-entropy over every anchor, plus smooth L1 of the box offsets of
    the positive anchors (averaged over them); both reported as parts."""
    scores, pred_offsets = out
    cls = F.cross_entropy(scores.flatten(0, 1), classes.flatten())
    positive = classes > 0
    box = F.smooth_l1_loss(
        pred_offsets[positive], offsets[positive], reduction="sum"
    ) / positive.sum().clamp(min=1)
    return {"loss": cls + box, "cls": cls, "box": box}


def detect(
    out: tuple[Tensor, Tensor], min_score: float = 0.5
) -> list[tuple[str, float, list[float]]]:
    """One image's ``(scores, offsets)`` as detections: (class, score, box as
    (x0, y0, x1, y1)), best first, each anchor that is not background with
    ``min_score``, after a greedy non-maximum suppression at IoU 0.3."""
    probs = out[0].softmax(-1)
    score, label = probs[:, 1:].max(-1)
    boxes = decode(out[1], ANCHORS)
    keep = [i for i in score.argsort(descending=True).tolist() if score[i] >= min_score]
    found: list[int] = []
    for i in keep:
        if all(iou(boxes[i : i + 1], boxes[j : j + 1]).item() < 0.3 for j in found):
            found.append(i)
    return [
        (CLASSES[label[i] + 1], round(score[i].item(), 3),
         [round(v, 1) for v in corners(boxes[i]).tolist()])
        for i in found
    ]  # fmt: skip


def main(
    epochs: int = 8,
    batch_size: int = 32,
    n: int | None = None,
    progress: bool = True,
    seed: int = 0,
) -> Learner:
    """Makes ``n`` images (2,000 by default), trains the detector, returns the
    Learner."""
    torch.manual_seed(seed)  # the same weights and batch order on every run
    data = squares_data(2000 if n is None else n, batch_size, seed)
    metrics = [  # the class head (output 0) against the anchor classes (target 0)
        Part(accuracy, output=0, target=0, name="anchor_accuracy"),
        Part(F1Score(), output=0, target=0, name="anchor_f1"),
    ]
    learn = Learner(
        data, TinySSD(), loss_func=ssd_loss, metrics=metrics, progress=progress
    )
    learn.fit_one_cycle(epochs, lr=1e-2)
    return learn


if __name__ == "__main__":
    learn = main(**cli.args(main, __doc__))
    valid = learn.data.valid_dl.dataset
    scores, offsets = learn.predict(valid.images[0])  # one image: no batch dim
    print(
        f"predict: class scores {tuple(scores.shape)}, offsets {tuple(offsets.shape)}"
    )
    truth = [
        (CLASSES[c], [round(v, 1) for v in corners(b).tolist()])
        for b, c in zip(valid.boxes[0], valid.labels[0].tolist(), strict=True)
    ]
    print(f"  objects:    {truth}")
    print(f"  detections: {detect((scores, offsets))}")
    print(cli.result_line("ssd_detection", learn, "anchor_f1"))
