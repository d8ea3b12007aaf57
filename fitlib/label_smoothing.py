"""Label smoothing for cross-entropy and the masked sequence loss, applied
once: ``label_smoothed(loss_func, eps)``.

The target of each sample becomes ``(1 - eps) * one_hot + eps / C`` (torch's
``label_smoothing``), done by the loss itself, so it composes with ``MixUp``
and ``CutMix``: mixing two smoothed losses is smoothing the mixed target
once (cross-entropy is linear in the target), and with
``targets="soft"`` ``F.cross_entropy`` or ``nn.CrossEntropyLoss`` smooths
the mixed probabilities once (the smoothed masked loss takes class indices:
``targets="soft"`` refuses it). The fit's loss is the smoothed one, its
``valid_loss`` too.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import Tensor, nn
from torch.nn import functional as F  # noqa: N812

from fitlib.checks import check_number
from fitlib.errors import name_of
from fitlib.metrics.functions import class_rows
from fitlib.sequences import masked_cross_entropy


def label_smoothed(loss_func: Any, eps: float = 0.1) -> Any:
    """``loss_func`` with label smoothing ``eps``: each target becomes
    ``(1 - eps)`` on its class and ``eps / C`` spread over all ``C`` classes.

    Takes ``F.cross_entropy`` (or a ``functools.partial`` of it), an
    ``nn.CrossEntropyLoss``, or ``fitlib.sequences.masked_cross_entropy``
    (or a partial of it), and returns the same loss smoothed: a partial of
    ``F.cross_entropy`` with ``label_smoothing=eps`` (so fitlib reads it as
    cross-entropy: class-index checks, per-token counts), a new
    ``nn.CrossEntropyLoss``, or a partial of ``smoothed_masked_cross_entropy``
    (tokens whose target is ``ignore_index`` still left out, and counted
    out). A loss smoothed already is refused: smoothing applies once.

    Examples:
        >>> from fitlib.label_smoothing import label_smoothed
        >>> loss = label_smoothed(F.cross_entropy, 0.1)
        >>> out, y = torch.tensor([[2.0, 0.0, 0.0]]), torch.tensor([0])
        >>> loss(out, y), F.cross_entropy(out, y, label_smoothing=0.1)
        (tensor(0.3729), tensor(0.3729))
        >>> fit(1, model, loss, opt, data)
        History(1 epoch: train_loss ..., valid_loss ...)
    """
    eps = check_number(
        eps, "eps", minimum=0, below=1, owner="label_smoothed", example=0.1,
        what="a fraction",
    )  # fmt: skip
    func = getattr(loss_func, "func", loss_func)
    keywords = dict(getattr(loss_func, "keywords", None) or {})
    if isinstance(loss_func, nn.CrossEntropyLoss):
        _not_twice(loss_func, loss_func.label_smoothing)
        return nn.CrossEntropyLoss(
            weight=loss_func.weight,
            ignore_index=loss_func.ignore_index,
            reduction=loss_func.reduction,
            label_smoothing=eps,
        )
    if func is F.cross_entropy or func is smoothed_masked_cross_entropy:
        _not_twice(loss_func, keywords.get("label_smoothing", 0.0))
        return functools.partial(func, **{**keywords, "label_smoothing": eps})
    if func is masked_cross_entropy:
        return functools.partial(
            smoothed_masked_cross_entropy, **{**keywords, "label_smoothing": eps}
        )
    raise TypeError(
        f"label_smoothed: loss_func must be F.cross_entropy, nn.CrossEntropyLoss "
        f"or masked_cross_entropy (or a functools.partial of one); got "
        f"{name_of(loss_func)} ({type(loss_func).__name__}). Fix: e.g. "
        "label_smoothed(F.cross_entropy, 0.1), or smooth the targets in your "
        "own loss."
    )


def _not_twice(loss_func: Any, already: float) -> None:
    if already:
        raise ValueError(
            f"label_smoothed: {name_of(loss_func)} smooths the labels already "
            f"(label_smoothing={already}); smoothing twice would give "
            "another eps than either. Fix: pass the loss without "
            "label_smoothing, or use it as it is."
        )


def smoothed_masked_cross_entropy(
    out: Tensor,
    y: Tensor,
    *,
    label_smoothing: float = 0.1,
    ignore_index: int = -100,
    class_dim: int | None = None,
) -> Tensor:
    """``masked_cross_entropy`` with label smoothing: what
    ``label_smoothed(masked_cross_entropy, eps)`` calls. Averaged over the
    tokens whose target is not ``ignore_index`` (which get no smoothing)."""
    logits, t = class_rows(out, y, "masked_cross_entropy", class_dim)
    return F.cross_entropy(
        logits, t, ignore_index=ignore_index, label_smoothing=label_smoothing
    )


def _count_kept(
    out: Tensor, y: Tensor, *, ignore_index: int = -100, **_: Any
) -> Tensor:
    """The tokens the loss averages over (read by ``running_loss.loss_count``)."""
    return (y != ignore_index).sum()


smoothed_masked_cross_entropy.count = _count_kept
