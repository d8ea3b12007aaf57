"""Metrics computed per batch as a mean; ``AvgMetric`` averages them over samples."""

from typing import Any

import torch
from torch import Tensor


def _match(pred: Tensor, y: Tensor, fname: str) -> Tensor:
    """Reshape `pred` like `y`; refuse shapes that would silently broadcast."""
    if pred.shape == y.shape:
        return pred
    lead_ok = pred.ndim == 0 or y.ndim == 0 or pred.shape[0] == y.shape[0]
    if pred.numel() != y.numel() or not lead_ok:
        raise ValueError(
            f"{fname}: output gives values of shape {tuple(pred.shape)} that do not "
            f"match target shape {tuple(y.shape)}. Fix: make the model return one "
            "value (regression) or one row of class scores per target."
        )
    return pred.reshape(y.shape)


def _pred_classes(out: Tensor) -> tuple[Tensor, int]:
    """Class predictions and class count over the last dim; one logit column
    means binary (> 0). (``top_k_accuracy``; the others use ``class_predictions``.)"""
    if out.ndim == 0:
        raise ValueError("output is a 0-dim tensor. Fix: return one row per sample.")
    if out.ndim == 1 or out.shape[-1] == 1:
        return (out > 0).long(), 2
    return out.argmax(-1), out.shape[-1]


def check_index(value: Any, name: str, owner: str, example: str) -> int | None:
    """``value`` if it is an int (or None); else a TypeError naming it."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise TypeError(
        f"{owner}: {name} must be an int or None; got {value!r} "
        f"({type(value).__name__}). Fix: e.g. {owner}({name}={example})."
    )


def find_class_dim(out: Tensor, y: Tensor, name: str, dim: int | None = None) -> int:
    """The dimension of ``out`` that holds the class scores of targets ``y``.

    ``dim`` when given; else the last dim when the output without it has the
    targets' shape (``(N, C)`` with ``(N,)``, a sequence's ``(B, T, C)`` with
    ``(B, T)``), or dim 1 when that fits (channels first, as PyTorch's losses
    take them: a segmentation's ``(B, C, H, W)`` with ``(B, H, W)``). When
    both fit (``C == T``), the caller must say which.
    """
    if dim is not None:
        if not -out.ndim <= dim < out.ndim:
            raise ValueError(
                f"{name}: class_dim={dim} is not a dimension of the output, of "
                f"shape {tuple(out.shape)}. Fix: the dim that holds the class "
                "scores (1 for channels first, -1 for channels last)."
            )
        return dim % out.ndim
    last = out.shape[:-1] == y.shape
    first = out.ndim >= 3 and out.shape[:1] + out.shape[2:] == y.shape
    if last and first:
        raise ValueError(
            f"{name}: the output, of shape {tuple(out.shape)}, may hold the class "
            f"scores of targets of shape {tuple(y.shape)} in dim 1 or in the last "
            f"dim. Fix: say which with class_dim: 1 for channels first, -1 for a "
            f"sequence's (B, T, C); e.g. partial({name}, class_dim=-1) for a "
            "function, Accuracy(class_dim=-1) or MeanIoU(class_dim=1) for a "
            "metric class."
        )
    if first:
        return 1
    if out.ndim >= 3 and out.shape == y.shape and out.shape[1] == 1:
        return 1  # one logit channel and masks alike (binary_cross_entropy)
    same_places = out.shape[:1] + out.shape[2:] == y.shape[:1] + y.shape[2:]
    if out.ndim >= 3 and y.ndim == out.ndim and y.shape[1] == 1 and same_places:
        raise ValueError(
            f"{name}: the targets, of shape {tuple(y.shape)}, keep a channel dim "
            f"of 1 that the output, of shape {tuple(out.shape)}, holds its class "
            "scores in (as cross_entropy wants them too). Fix: give masks of "
            f"shape {(y.shape[0], *y.shape[2:])}, e.g. y.squeeze(1) in the "
            "dataset or in DataBunch(batch_fn=...)."
        )
    if not last and out.ndim >= 3 and y.ndim == out.ndim - 1:
        spatial = (y.shape[0], *out.shape[2:])
        raise ValueError(
            f"{name}: the output, of shape {tuple(out.shape)}, has no class dim "
            f"whose removal gives the target shape {tuple(y.shape)}: channels "
            f"first it scores targets of shape {spatial}, channels last of shape "
            f"{tuple(out.shape[:-1])}. Fix: give targets of the output's spatial "
            "shape (resize the masks with the images, or upsample the output)."
        )
    return out.ndim - 1  # (N, C) with (N, 1) targets: _match reshapes


def class_rows(
    out: Tensor, y: Tensor, name: str, dim: int | None = None
) -> tuple[Tensor, Tensor]:
    """The class scores as ``(N, C)`` rows and the targets as ``(N,)`` (long),
    one row per target element, for a loss over tokens or pixels."""
    if out.ndim < 2:
        raise ValueError(
            f"{name}: needs class scores (logits), got an output of shape "
            f"{tuple(out.shape)}. Fix: return one score per class."
        )
    d = find_class_dim(out, y, name, dim)
    return out.movedim(d, -1).reshape(-1, out.shape[d]), y.reshape(-1).long()


def class_predictions(
    out: Tensor, y: Tensor, name: str, dim: int | None = None
) -> tuple[Tensor, int]:
    """Each target's predicted class (the argmax over ``class_dim``), shaped
    like ``y``, and the class count. One score per target (a 1-d output, or a
    class dim of size 1) is a binary logit: class 1 when > 0."""
    if out.ndim == 0:
        raise ValueError(
            f"{name}: output is a 0-dim tensor. Fix: return one row per sample."
        )
    if out.ndim == 1:
        pred, n = (out > 0).long(), 2
    else:
        d = find_class_dim(out, y, name, dim)
        if out.shape[d] == 1:
            pred, n = (out.squeeze(d) > 0).long(), 2
        else:
            pred, n = out.argmax(d), out.shape[d]
    return _match(pred, y, name), n


def _regression_pair(out: Tensor, y: Tensor, fname: str) -> tuple[Tensor, Tensor]:
    dtype = torch.promote_types(out.dtype, torch.float32)
    return _match(out, y, fname).to(dtype), y.to(dtype)


def accuracy(
    out: Tensor,
    y: Tensor,
    *,
    class_dim: int | None = None,
    ignore_index: int | None = None,
) -> Tensor:
    """Fraction of correct predictions in a batch.

    The class scores sit in the last dim, or in dim 1 for a channels-first
    output (a segmentation's ``(B, C, H, W)`` with ``(B, H, W)`` targets: per
    pixel); ``class_dim`` says which when both fit. A 1-d output or one score
    column is a binary logit, predicted positive when > 0. Targets equal to
    ``ignore_index`` (padding, unlabelled pixels) are not counted.

    In ``metrics=[...]``, ``accuracy`` (or a ``functools.partial`` of it) is
    counted over the whole set by ``Accuracy``: exact however many targets each
    batch counts.

    Example:
        >>> accuracy(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1]))
        tensor(0.5000)
    """
    pred = class_predictions(out, y, "accuracy", class_dim)[0]
    if ignore_index is None:
        return (pred == y).mean(dtype=torch.float32)
    keep = y != ignore_index
    return ((pred == y) & keep).sum() / keep.sum().to(torch.float32)


def top_k_accuracy(out: Tensor, y: Tensor, k: int = 5) -> Tensor:
    """Fraction of targets among the `k` highest scores.

    Example:
        >>> top_k_accuracy(torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([1]), k=2)
        tensor(1.)
    """
    if out.ndim < 2 or out.shape[-1] <= k:
        raise ValueError(
            f"top_k_accuracy: k={k} needs class scores with more than {k} columns, "
            f"got output shape {tuple(out.shape)}. Fix: "
            "functools.partial(top_k_accuracy, k=...) with a smaller k."
        )
    top = out.topk(k, dim=-1).indices
    _match(top[..., 0], y, "top_k_accuracy")  # only to refuse mismatched shapes
    hit = top == y.reshape(top.shape[:-1]).unsqueeze(-1)
    return hit.any(-1).float().mean()


def error_rate(
    out: Tensor,
    y: Tensor,
    *,
    class_dim: int | None = None,
    ignore_index: int | None = None,
) -> Tensor:
    """One minus `accuracy` (same arguments; ``ErrorRate`` in ``metrics=[...]``).

    Example:
        >>> error_rate(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1]))
        tensor(0.5000)
    """
    return 1 - accuracy(out, y, class_dim=class_dim, ignore_index=ignore_index)


def mse(out: Tensor, y: Tensor) -> Tensor:
    """Mean squared error; an (N, 1) output is compared with (N,) targets.

    Example:
        >>> mse(torch.tensor([[1.0], [3.0]]), torch.tensor([1.0, 1.0]))
        tensor(2.)
    """
    o, t = _regression_pair(out, y, "mse")
    return (o - t).pow(2).mean()


def mae(out: Tensor, y: Tensor) -> Tensor:
    """Mean absolute error; an (N, 1) output is compared with (N,) targets.

    Example:
        >>> mae(torch.tensor([[1.0], [3.0]]), torch.tensor([1.0, 1.0]))
        tensor(1.)
    """
    o, t = _regression_pair(out, y, "mae")
    return (o - t).abs().mean()


def check_class_targets(
    name: str,
    output: Tensor,
    *targets: Tensor,
    class_dim: int | None = None,
    ignore_index: int | None = None,
) -> None:
    """Refuses targets that are no class labels of the output: floats with a
    fractional part (a regression's) or labels outside the classes it scores
    would score 0 or NaN; ``ignore_index`` is not a label. Also refuses a
    target shape no class dim explains. Reads one value from the device."""
    y = targets[0] if targets else None
    if not isinstance(y, Tensor) or not isinstance(output, Tensor) or not y.numel():
        return
    fix = (
        f"Fix: take {name} out of the metrics and use mse, mae, RMSE() or "
        "R2Score() for a regression; for classification, give class indices "
        "(or 0/1 labels for one logit column)."
    )
    labels = y if ignore_index is None else y[y != ignore_index]
    if y.is_floating_point():
        fractional = labels != labels.round()
        if fractional.any():
            example = labels[fractional][0].item()
            raise ValueError(
                f"{name} scores class predictions, but the targets are not class "
                f"labels: floats such as {example:g} (a regression?). {fix}"
            )
    if output.ndim < 2:
        n, where = 2, "last dimension"
    else:
        d = find_class_dim(output, y, name, class_dim)
        n = 2 if output.shape[d] == 1 else output.shape[d]
        where = "last dimension" if d == output.ndim - 1 else f"dimension {d}"
    outside = (labels < 0) | (labels >= n)
    if outside.any():
        example = labels[outside][0].item()
        what = "one logit column: classes 0 and 1" if n == 2 else f"{n} classes"
        if ignore_index is None and example == int(example):
            leave_out = (
                f"if {example:g} marks padding or unlabelled targets, leave it "
                f"out with ignore_index={example:g}: partial(accuracy, "
                f"ignore_index={example:g}) for a function, MeanIoU(ignore_index="
                f"{example:g}) and the like for a metric class (TokenAccuracy() "
                "ignores -100)"
            )
        else:
            leave_out = f"{name} ignores only {ignore_index}"
        raise ValueError(
            f"{name} scores class predictions over the output's {where} "
            f"({what}), but the targets hold {example:g}, outside it. Fix: "
            f"{leave_out}; if the classes sit in another dimension, pass "
            f"class_dim; for a regression, take {name} out of the metrics and use "
            "mse, mae, RMSE() or R2Score()."
        )


# The metrics that need class labels check them on a first batch (Metrics.check).
for _metric in (accuracy, top_k_accuracy, error_rate):
    _metric.check_inputs = check_class_targets
