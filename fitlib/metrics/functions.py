"""Metrics computed per batch as a mean; ``AvgMetric`` averages them over samples."""

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
    """Class predictions and class count; one logit column means binary (> 0)."""
    if out.ndim == 0:
        raise ValueError("output is a 0-dim tensor. Fix: return one row per sample.")
    if out.ndim == 1 or out.shape[-1] == 1:
        return (out > 0).long(), 2
    return out.argmax(-1), out.shape[-1]


def _regression_pair(out: Tensor, y: Tensor, fname: str) -> tuple[Tensor, Tensor]:
    dtype = torch.promote_types(out.dtype, torch.float32)
    return _match(out, y, fname).to(dtype), y.to(dtype)


def accuracy(out: Tensor, y: Tensor) -> Tensor:
    """Fraction of correct predictions in a batch.

    Multiclass outputs use argmax over the last dim; a 1-d output or one column
    is a binary logit, predicted positive when > 0.

    Example:
        >>> accuracy(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1]))
        tensor(0.5000)
    """
    pred = _match(_pred_classes(out)[0], y, "accuracy")
    return (pred == y).mean(dtype=torch.float32)


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


def error_rate(out: Tensor, y: Tensor) -> Tensor:
    """One minus `accuracy`.

    Example:
        >>> error_rate(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1]))
        tensor(0.5000)
    """
    return 1 - accuracy(out, y)


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


def check_class_targets(name: str, output: Tensor, *targets: Tensor) -> None:
    """Refuses targets that are no class labels of the output: floats with a
    fractional part (a regression's) or labels outside the classes it scores
    would score 0 or NaN. Reads one value from the device."""
    y = targets[0] if targets else None
    if not isinstance(y, Tensor) or not isinstance(output, Tensor) or not y.numel():
        return
    fix = (
        f"Fix: take {name} out of the metrics and use mse, mae, RMSE() or "
        "R2Score() for a regression; for classification, give class indices "
        "(or 0/1 labels for one logit column)."
    )
    if y.is_floating_point():
        fractional = y != y.round()
        if fractional.any():
            example = y[fractional][0].item()
            raise ValueError(
                f"{name} scores class predictions, but the targets are not class "
                f"labels: floats such as {example:g} (a regression?). {fix}"
            )
    n = 2 if output.ndim < 2 or output.shape[-1] == 1 else output.shape[-1]
    outside = (y < 0) | (y >= n)
    if outside.any():
        example = y[outside][0].item()
        what = "one logit column: classes 0 and 1" if n == 2 else f"{n} classes"
        raise ValueError(
            f"{name} scores class predictions over the output's last dimension "
            f"({what}), but the targets hold {example:g}, outside it (a "
            f"regression? classes in another dimension? padding such as -100, "
            f"which {name} does not mask?). {fix}"
        )


# The metrics that need class labels check them on a first batch (Metrics.check).
for _metric in (accuracy, top_k_accuracy, error_rate):
    _metric.check_inputs = check_class_targets
