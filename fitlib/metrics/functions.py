"""Metrics computed per batch as a mean; ``AvgMetric`` averages them over samples."""

import math
import threading
import warnings
import weakref
from typing import Any

import torch
from torch import Tensor

from fitlib.checks import check_number
from fitlib.errors import ArgTypeError, name_of
from fitlib.loss_checks import takes_logits, takes_probabilities


def match_shape(pred: Tensor, y: Tensor, fname: str) -> Tensor:
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


def check_index(
    value: Any, name: str, owner: str, example: str, allow_none: bool = True
) -> int | None:
    """``value`` if it is an int (of any sign; or None when ``allow_none``);
    else an ``ArgTypeError`` naming it."""
    if value is None and allow_none:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ArgTypeError(
        f"{owner}: {name} must be an int{' or None' if allow_none else ''}; got "
        f"{value!r} ({type(value).__name__}). Fix: e.g. {owner}({name}={example})."
    )


def binary_cut(from_logits: Any, threshold: Any, owner: str) -> float:
    """What one score per target is compared with (class 1 when above it):
    ``threshold``, a probability, itself when ``from_logits`` is False, else
    its logit (0 for 0.5). Checks both arguments."""
    if from_logits is not None and not isinstance(from_logits, bool):
        raise ArgTypeError(
            f"{owner}: from_logits must be True, False or None; got "
            f"{from_logits!r} ({type(from_logits).__name__}). Fix: e.g. "
            f"{owner}(from_logits=False) for a model that returns probabilities "
            "(a sigmoid's output)."
        )
    t = check_number(
        threshold, "threshold", above=0, below=1, what="a probability",
        owner=owner, example=0.5,
    )  # fmt: skip
    return t if from_logits is False else math.log(t / (1 - t))


# The class dims decided per output rank and class count: a later batch whose
# shape fits both layouts (a sequence as long as the class count) keeps the
# layout decided before. They belong to the model trained (``class_dims_of``):
# its fits, refits, evaluations and resumes share them, another model never
# sees them. ``_decided.dims`` is the thread's current one (None: nothing is
# remembered, as outside a fit or evaluation).
_decided = threading.local()
_per_model: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def class_dims_of(model: Any) -> dict:
    """The class dims decided for ``model`` so far (a dict kept as long as
    the model lives, created empty; pass the plain model, not a wrapper)."""
    try:
        return _per_model.setdefault(model, {})
    except TypeError:  # not weakly referable: decisions last this call only
        return {}


def swap_class_dims(dims: dict | None) -> dict | None:
    """Makes ``dims`` the class dims decided so far and returns the ones it
    replaces. ``CallbackHandler`` swaps in its model's dict
    (``class_dims_of``) as a fit (or an evaluation) starts and puts the old
    one back as it ends: a fit, a later ``learn.validate()`` and a resumed
    fit of the same model read alike, and another model's evaluation never
    inherits them."""
    previous = getattr(_decided, "dims", None)
    _decided.dims = dims
    return previous


def saved_class_dims(model: Any) -> list[list]:
    """``model``'s decided class dims as plain values, for a checkpoint:
    ``[ndim, n_classes, 'last' | 'first']`` each."""
    return [[n, c, side] for (n, c), side in sorted(class_dims_of(model).items())]


def load_class_dims(model: Any, saved: Any) -> None:
    """Gives ``model`` the class dims of ``saved_class_dims`` (a resume)."""
    dims = class_dims_of(model)
    for n, c, side in saved:
        dims[(int(n), int(c))] = "last" if side == "last" else "first"


def _known_side(out: Tensor) -> str | None:
    return (getattr(_decided, "dims", None) or {}).get((out.ndim, out.shape[-1]))


def _decide(out: Tensor, d: int) -> int:
    dims = getattr(_decided, "dims", None)
    if out.ndim >= 3 and dims is not None:
        dims[(out.ndim, out.shape[d])] = "last" if d == out.ndim - 1 else "first"
    return d


def find_class_dim(
    out: Tensor, y: Tensor, name: str, dim: int | None = None, owner: str = ""
) -> int:
    """The dimension of ``out`` that holds the class scores of targets ``y``.

    ``dim`` when given; else the last dim when the output without it has the
    targets' shape (``(N, C)`` with ``(N,)``, a sequence's ``(B, T, C)`` with
    ``(B, T)``), or dim 1 when that fits (channels first, as PyTorch's losses
    take them: a segmentation's ``(B, C, H, W)`` with ``(B, H, W)``). When
    both fit (``C == T``), the layout an earlier batch of the fit decided
    holds (``swap_class_dims``); at a fit's first batch, the caller must
    say which: ``owner``, the metric class calling (``"MeanIoU"``), or a
    function's ``name``, in the fix.
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
        side = _known_side(out)
        if side is not None:
            return out.ndim - 1 if side == "last" else 1
        raise ValueError(
            f"{name}: the output, of shape {tuple(out.shape)}, may hold the class "
            f"scores of targets of shape {tuple(y.shape)} in dim 1 or in the last "
            f"dim. Fix: say which with class_dim: 1 for channels first, -1 for a "
            f"sequence's (B, T, C); e.g. {_with_class_dim(name, owner)}."
        )
    if first:
        return _decide(out, 1)
    if last:
        return _decide(out, out.ndim - 1)
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
    return out.ndim - 1  # (N, C) with (N, 1) targets: match_shape reshapes


def _with_class_dim(name: str, owner: str) -> str:
    """How the caller takes ``class_dim``, for a message."""
    if owner:
        return f"{owner}(class_dim=1) or {owner}(class_dim=-1)"
    return f"partial({name}, class_dim=-1) (with from functools import partial)"


def class_rows(
    out: Tensor, y: Tensor, name: str, dim: int | None = None, owner: str = ""
) -> tuple[Tensor, Tensor]:
    """The class scores as ``(N, C)`` rows and the targets as ``(N,)`` (long),
    one row per target element, for a loss over tokens or pixels."""
    if out.ndim < 2:
        raise ValueError(
            f"{name}: needs class scores (logits), got an output of shape "
            f"{tuple(out.shape)}. Fix: return one score per class."
        )
    d = find_class_dim(out, y, name, dim, owner)
    return out.movedim(d, -1).reshape(-1, out.shape[d]), y.reshape(-1).long()


def class_predictions(
    out: Tensor,
    y: Tensor,
    name: str,
    dim: int | None = None,
    cut: float = 0.0,
    owner: str = "",
) -> tuple[Tensor, int]:
    """Each target's predicted class (the argmax over ``class_dim``), shaped
    like ``y``, and the class count. One score per target (a 1-d output, or a
    class dim of size 1) is binary: class 1 when > ``cut`` (``binary_cut``:
    0 for a logit)."""
    scores, d = _scores_or_class_dim(out, y, name, dim, owner)
    if scores is not None:
        return match_shape((scores > cut).long(), y, name), 2
    return match_shape(out.argmax(d), y, name), out.shape[d]


def one_score_per_target(
    out: Tensor, y: Tensor, name: str, dim: int | None = None
) -> Tensor | None:
    """The output without its class dim when it holds one score per target (a
    1-d output, or a class dim of size 1: binary); None for class scores."""
    return _scores_or_class_dim(out, y, name, dim)[0]


def _scores_or_class_dim(
    out: Tensor, y: Tensor, name: str, dim: int | None, owner: str = ""
) -> tuple[Tensor | None, int]:
    """``(scores, -1)`` for one score per target (``one_score_per_target``),
    else ``(None, class dim)``: the class dim found once."""
    if out.ndim == 0:
        raise ValueError(
            f"{name}: output is a 0-dim tensor. Fix: return one row per sample."
        )
    if out.ndim == 1:
        return out, -1
    d = find_class_dim(out, y, name, dim, owner)
    return (out.squeeze(d), -1) if out.shape[d] == 1 else (None, d)


def regression_pair(out: Tensor, y: Tensor, fname: str) -> tuple[Tensor, Tensor]:
    dtype = torch.promote_types(out.dtype, torch.float32)
    return match_shape(out, y, fname).to(dtype), y.to(dtype)


def accuracy(
    out: Tensor,
    y: Tensor,
    *,
    class_dim: int | None = None,
    ignore_index: int | None = None,
    from_logits: bool | None = None,
    threshold: float = 0.5,
) -> Tensor:
    """Fraction of correct predictions in a batch.

    The class scores sit in the last dim, or in dim 1 for a channels-first
    output (a segmentation's ``(B, C, H, W)`` with ``(B, H, W)`` targets: per
    pixel); ``class_dim`` says which when both fit. A 1-d output or one score
    column is binary: a logit (None or True), predicted positive when its
    probability is > ``threshold`` (the logit > 0 for 0.5), or with
    ``from_logits=False`` a probability (a sigmoid's output) > ``threshold``.
    Targets equal to ``ignore_index`` (padding, unlabelled pixels) are not
    counted.

    In ``metrics=[...]``, ``accuracy`` (or a ``functools.partial`` of it) is
    counted over the whole set by ``Accuracy``: exact however many targets each
    batch counts.

    Examples:
        >>> accuracy(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1]))
        tensor(0.5000)
    """
    cut = binary_cut(from_logits, threshold, "accuracy")
    pred = class_predictions(out, y, "accuracy", class_dim, cut)[0]
    if ignore_index is None:
        return (pred == y).mean(dtype=torch.float32)
    keep = y != ignore_index
    return ((pred == y) & keep).sum() / keep.sum().to(torch.float32)


def top_k_accuracy(out: Tensor, y: Tensor, k: int = 5) -> Tensor:
    """Fraction of targets among the `k` highest scores.

    Examples:
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
    match_shape(top[..., 0], y, "top_k_accuracy")  # only to refuse mismatched shapes
    hit = top == y.reshape(top.shape[:-1]).unsqueeze(-1)
    return hit.any(-1).float().mean()


def error_rate(
    out: Tensor,
    y: Tensor,
    *,
    class_dim: int | None = None,
    ignore_index: int | None = None,
    from_logits: bool | None = None,
    threshold: float = 0.5,
) -> Tensor:
    """One minus `accuracy` (same arguments; ``ErrorRate`` in ``metrics=[...]``).

    Examples:
        >>> error_rate(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1]))
        tensor(0.5000)
    """
    return 1 - accuracy(
        out, y, class_dim=class_dim, ignore_index=ignore_index,
        from_logits=from_logits, threshold=threshold,
    )  # fmt: skip


def mse(out: Tensor, y: Tensor) -> Tensor:
    """Mean squared error, as a metric; an (N, 1) output is compared with (N,) targets
    (as a loss, ``F.mse_loss`` would broadcast that pair to (N, N), which
    fitlib refuses: give a regression (N, 1) targets, ``y.reshape(-1, 1)``).

    Examples:
        >>> mse(torch.tensor([[1.0], [3.0]]), torch.tensor([1.0, 1.0]))
        tensor(2.)
    """
    o, t = regression_pair(out, y, "mse")
    return (o - t).pow(2).mean()


def mae(out: Tensor, y: Tensor) -> Tensor:
    """Mean absolute error, as a metric; an (N, 1) output is compared with (N,) targets
    (as a loss, ``F.mse_loss`` would broadcast that pair to (N, N), which
    fitlib refuses: give a regression (N, 1) targets, ``y.reshape(-1, 1)``).

    Examples:
        >>> mae(torch.tensor([[1.0], [3.0]]), torch.tensor([1.0, 1.0]))
        tensor(1.)
    """
    o, t = regression_pair(out, y, "mae")
    return (o - t).abs().mean()


def check_class_targets(
    name: str,
    output: Tensor,
    *targets: Tensor,
    class_dim: int | None = None,
    ignore_index: int | None = None,
    owner: str = "",
) -> None:
    """Refuses targets that are no class labels of the output: floats with a
    fractional part (a regression's) or labels outside the classes it scores
    would score 0 or NaN; ``ignore_index`` is not a label. Also refuses a
    target shape no class dim explains. Reads one value from the device.
    ``owner``: the metric class calling, named in a fix (``find_class_dim``)."""
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
        d = find_class_dim(output, y, name, class_dim, owner)
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


def check_binary_scores(
    owner: str,
    name: str,
    output: Tensor,
    y: Tensor,
    from_logits: bool | None,
    loss_func: Any = None,
    class_dim: int | None = None,
) -> None:
    """Refuses one score per target read the wrong way: probabilities read
    as logits (``from_logits`` None under a loss that takes probabilities,
    ``binary_cross_entropy``: every sample would be positive), or values
    outside [0, 1] given as probabilities; warns when every score lies in
    [0, 1] under a loss not known to take logits (``from_logits`` None).
    Reads the device once at most."""
    if not isinstance(output, Tensor) or not isinstance(y, Tensor):
        return
    scores = one_score_per_target(output, y, name, class_dim)
    if scores is None or from_logits is True:
        return
    fixes = f"{owner}(..., from_logits=False) (threshold=0.5 by default)"
    where = (
        f" (from fitlib.metrics import {owner}; partial(accuracy, "
        "from_logits=False) for the function)."
    )
    if from_logits is None and takes_probabilities(loss_func):
        raise ValueError(
            f"{name} reads one score per sample as a logit (class 1 when > 0), "
            f"but loss_func {name_of(loss_func)} takes probabilities, so the "
            "model returns probabilities (a sigmoid's output): every sample "
            f"would count as class 1. Fix: {fixes}, or return logits (drop "
            "the final sigmoid) and train with binary_cross_entropy_with_logits "
            f"(nn.BCEWithLogitsLoss), which is also more stable{where}"
        )
    if from_logits is None:
        known = not scores.numel() or takes_logits(loss_func)
        if not known and ((scores >= 0) & (scores <= 1)).all():
            warnings.warn(
                f"{name} reads one score per sample as a logit (class 1 when "
                "> 0), but every score of the first batch lies in [0, 1], as "
                "probabilities (a sigmoid's output) do, and the loss is not "
                "known to take logits: if they are probabilities, every sample "
                f"counts as class 1. Fix: {fixes} for probabilities, or return "
                "logits (drop the final sigmoid) with a logit loss "
                "(binary_cross_entropy_with_logits); if they are logits, "
                f"{owner}(..., from_logits=True) says so{where}",
                UserWarning,
                stacklevel=1,  # one place: warned once per process
            )
        return
    outside = (scores < 0) | (scores > 1)
    if scores.numel() and outside.any():
        example = scores[outside][0].item()
        raise ValueError(
            f"{name} was given from_logits=False, but the output holds "
            f"{example:g}, not a probability. Fix: from_logits=True (or None) "
            "for a model that returns logits, or end the model with a sigmoid."
        )


# The metrics that need class labels check them on a first batch (Metrics.check).
for _metric in (accuracy, top_k_accuracy, error_rate):
    _metric.check_inputs = check_class_targets
