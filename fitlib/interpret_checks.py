"""The checks behind ``ClassificationInterpretation``: its scores, targets,
losses, class names and arguments, each refused with the fix; the per-item
losses of a Learner's loss function; and whether a loader's dataset lines up
with its predictions (for the grid of inputs)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fitlib.checks import len_or_none
from fitlib.errors import ArgTypeError, is_int, is_number, name_of
from fitlib.loss_checks import loss_check

FIX_LOSS = (
    "Fix: use a classification loss, such as loss_func=F.cross_entropy "
    "(torch.nn.functional), which takes (N, C) scores and (N,) class indices"
)


def check_classes(classes: Any, dataset: Any, n_classes: int) -> list:
    """The class names: ``classes``, or the dataset's (through ``Subset``s),
    or ``0 .. C-1``; checked."""
    where = "ClassificationInterpretation: classes"
    if classes is None:
        inner = dataset
        while inner is not None and getattr(inner, "classes", None) is None:
            inner = getattr(inner, "dataset", None)  # a Subset's dataset
        classes = getattr(inner, "classes", None) or list(range(n_classes))
    if isinstance(classes, dict):
        raise TypeError(
            f"{where} must be a list of names in the order of the model's "
            f"outputs; got a dict {describe_arg(classes)}. Fix: for an "
            "ImageFolder's class_to_idx {name: index}, classes=sorted(d, "
            "key=d.get); for {index: name}, classes=[d[i] for i in "
            f"range({n_classes})]."
        )
    if isinstance(classes, str | bytes) or not isinstance(classes, Sequence):
        raise TypeError(
            f"{where} must be a list of {n_classes} names; got "
            f"{describe_arg(classes)}. Fix: e.g. classes=['cat', 'dog', ...], in "
            "the order of the model's outputs."
        )
    names = list(classes)
    if len(names) != n_classes:
        raise ValueError(
            f"{where}: {len(names)} names ({names[:12]}) for "
            f"{n_classes} scores per item. Fix: pass {n_classes} names, in the "
            "order of the model's outputs."
        )
    twice = [c for i, c in enumerate(names) if c in names[:i]]
    if twice:
        raise ValueError(
            f"{where}: the names {twice} appear twice in {names[:12]}, so "
            "two classes could not be told apart. Fix: one distinct name per "
            "class, in the order of the model's outputs."
        )
    return names


def check_preds_targets(
    preds: Any, targets: Any, where: str = "__init__"
) -> tuple[torch.Tensor, torch.Tensor]:
    name = f"ClassificationInterpretation.{where}"
    if not isinstance(preds, torch.Tensor):
        pick_y = "targets[0]" if isinstance(targets, tuple | list) else "targets"
        raise TypeError(
            f"{name}: preds must be a tensor of scores (N, C); got "
            f"{describe_arg(preds)}. Fix: for a model with several outputs, "
            "interpret the classification one, with the dataset for the grid: "
            f"ClassificationInterpretation(preds[0], {pick_y}, "
            "dataset=learn.data.valid_dl.dataset)."
        )
    if preds.ndim == 1 or (preds.ndim == 2 and preds.shape[1] == 1):
        raise ValueError(
            f"{name}: preds has one score per item (shape {tuple(preds.shape)}): "
            "a binary classifier's logit (or a regression model, which this "
            "does not interpret). Fix: give both classes' scores and class "
            "indices: s = preds.view(-1, 1); ClassificationInterpretation("
            "torch.cat([torch.zeros_like(s), s], dim=1), targets.view(-1)."
            "long(), dataset=learn.data.valid_dl.dataset) (the softmax of "
            "(0, s) is (1 - sigmoid(s), sigmoid(s)))."
        )
    if preds.ndim != 2 or not preds.is_floating_point():
        raise ValueError(
            f"{name}: preds must be float scores of shape (N, C), one row per "
            f"item; got {describe_arg(preds)}. Fix: for a sequence model's "
            "(B, T, C) scores, interpret the tokens: keep = targets.reshape(-1) "
            "!= -100; ClassificationInterpretation(preds.reshape(-1, C)[keep], "
            "targets.reshape(-1)[keep]) (transpose (B, C, T) scores to (B, T, C) "
            "first)."
        )
    n = len(preds)
    if not (isinstance(targets, torch.Tensor) and targets.shape == preds.shape[:1]):
        if isinstance(targets, torch.Tensor) and targets.shape == (n, 1):
            fix = "targets.view(-1).long()"
        elif isinstance(targets, torch.Tensor) and targets.shape == preds.shape:
            fix = "for one-hot rows or class probabilities, targets.argmax(dim=1)"
        elif not isinstance(targets, torch.Tensor):
            fix = "torch.as_tensor(targets).long()"
        else:
            fix = "the class index of each item"
        error = ValueError if isinstance(targets, torch.Tensor) else ArgTypeError
        raise error(
            f"{name}: targets must be a tensor of shape ({n},), one class "
            f"index per item; got {describe_arg(targets)}. Fix: {fix}."
        )
    if targets.is_floating_point() or targets.dtype == torch.bool:
        whole = targets.is_floating_point() and bool((targets == targets.round()).all())
        raise ValueError(
            f"{name}: targets must be integer class indices; got dtype "
            f"{targets.dtype}"
            + (
                ". Fix: targets.long()."
                if whole or targets.dtype == torch.bool
                else " with fractions (a regression's targets? this interprets "
                "classifiers only). Fix: class indices as integers."
            )
        )
    bad = (targets < 0) | (targets >= preds.shape[1])
    if bad.any():
        raise ValueError(
            f"{name}: targets must lie in [0, {preds.shape[1]}) for "
            f"{preds.shape[1]} scores per item; item {bad.nonzero()[0].item()} "
            f"has {targets[bad][0].item()}. Fix: drop ignored items (e.g. -100) "
            "before interpreting, or check the model's number of outputs."
        )
    preds = check_finite(preds.detach().cpu(), "preds", name)
    return preds, targets.detach().cpu().long()


def check_finite(values: torch.Tensor, name: str, where: str) -> torch.Tensor:
    """``values`` (``preds``, ``(N, C)``, or ``losses``, ``(N,)``), if every
    item's are numbers; else an error with the count of items that are not."""
    bad = ~values.isfinite()
    bad = bad.any(dim=1) if bad.ndim > 1 else bad
    if not bad.any():
        return values
    items = bad.nonzero().view(-1).tolist()
    rows = ".all(dim=1)" if values.ndim > 1 else ""
    raise ValueError(
        f"{where}: {name} has NaN or inf values for {len(items)} of {len(bad)} "
        f"items (e.g. item {items[0]}): no prediction or loss can be read from "
        "them. Fix: check the model (a training that diverged: train again "
        "with a lower lr, or load an earlier save, e.g. learn.load('best')); or "
        f"interpret the other items: keep = {name}.isfinite(){rows}, then "
        "preds[keep], targets[keep]."
    )


def per_item_losses(
    loss_func: Callable | None, preds: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor | None:
    """Each item's loss, in float32 on the CPU: a loss module with a
    ``reduction`` (``nn.CrossEntropyLoss``, class weights included) is called
    once with ``reduction="none"``, and so is a loss that gives one value per
    item; any other loss on a batch of one item (a mean-reduced loss of one
    item is that item's loss). A dict loss gives its ``"loss"``. A loss that
    does not take ``(N, C)`` scores and ``(N,)`` class indices as a
    classification loss does (it compares them element by element, or
    broadcasts one against the other) is refused."""
    where = "ClassificationInterpretation.from_learner"
    if loss_func is None:
        raise ValueError(
            f"{where}: the Learner has no loss_func (the model computes its "
            "own loss), so there is no loss per item. Fix: pass one, e.g. "
            "loss_func=torch.nn.functional.cross_entropy."
        )
    preds = preds.float()
    with torch.no_grad():
        if isinstance(loss_func, nn.Module) and hasattr(loss_func, "reduction"):
            per_item = copy.deepcopy(loss_func).cpu()
            per_item.reduction = "none"
            losses = _checked_call(per_item, preds, targets, loss_func)
            if losses.ndim == 1:
                return losses.float()
        # A batch of k items, k neither 1 nor C, so that (k, C) scores do not
        # broadcast against (k,) indices without torch saying so.
        k = min(len(preds), 3 if preds.shape[1] == 2 else 2)
        if _checked_call(loss_func, preds[:k], targets[:k]).ndim == 1:
            return _checked_call(loss_func, preds, targets).float()
        losses = [
            _loss_value(loss_func(preds[i : i + 1], targets[i : i + 1]))
            for i in range(len(preds))
        ]
    return torch.stack([v.float().reshape(()) for v in losses]) if losses else None


def _checked_call(
    loss_func: Callable, preds: torch.Tensor, targets: torch.Tensor, named: Any = None
) -> torch.Tensor:
    """``loss_func(preds, targets)``: one number, or one per item; refused
    (naming ``named``, the loss the user gave) when it compares the scores
    with the targets as a regression loss does, or gives another shape."""
    name = name_of(named or loss_func)
    name = f"ClassificationInterpretation.from_learner: loss_func {name}"
    shapes = f"{tuple(preds.shape)} scores and {tuple(targets.shape)} class indices"
    try:
        with loss_check(loss_func, preds, (targets,)):
            value = _loss_value(loss_func(preds, targets))
    except (ValueError, RuntimeError) as e:  # a broadcast, or torch's shape error
        # (fitlib's own refusal is chained, not quoted: its fix is training's)
        said = f"\nIt said: {e}" if isinstance(e, RuntimeError) else ""
        raise ValueError(
            f"{name} is not a classification loss: it can't compare (N, C) "
            f"scores with (N,) class indices (given {shapes}). {FIX_LOSS}.{said}"
        ) from e
    if not isinstance(value, torch.Tensor) or value.shape not in ((), targets.shape):
        raise ValueError(
            f"{name} returned {describe_arg(value)} for {shapes}; a per-item loss "
            f"needs one number per item (shape {tuple(targets.shape)}), or one "
            f"number for the batch (its mean). {FIX_LOSS}."
        )
    return value


def _loss_value(v: Any) -> Any:
    return v["loss"] if isinstance(v, dict) and "loss" in v else v


def ordered_dataset(loader: Any, n: int) -> tuple[Any, str | None]:
    """``loader.dataset`` when the loader yields its items in order, with the
    reason for None otherwise."""
    from torch.utils.data import BatchSampler, SequentialSampler

    dataset = getattr(loader, "dataset", None)
    if dataset is None:
        return None, f"the loader ({type(loader).__name__}) has no dataset"
    # The batches' indices come from batch_sampler (a BatchSampler around
    # sampler, unless one was given) or, with batch_size=None, from sampler.
    if len_or_none(dataset) is None:
        return None, "the loader's dataset has no length (an IterableDataset)"
    batches = getattr(loader, "batch_sampler", None)
    sampler = getattr(loader, "sampler", None)
    if batches is not None:  # exactly torch's BatchSampler: a subclass may reorder
        sampler = batches.sampler if type(batches) is BatchSampler else batches
    if type(sampler) is not SequentialSampler:
        return None, (
            f"the loader draws items with {type(sampler).__name__}, not in "
            "order (shuffle=True?), so predictions can't be matched to items"
        )
    if len_or_none(dataset) != n:
        return None, (
            f"the loader gave {n} predictions for {len_or_none(dataset)} items "
            "(drop_last=True?)"
        )
    return dataset, None


def describe_arg(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a {v.dtype} tensor of shape {tuple(v.shape)}"
    if isinstance(v, tuple | list) and not v:
        return f"an empty {type(v).__name__}"
    if isinstance(v, type):
        return f"the class {v.__name__}"
    if isinstance(v, tuple | list) and all(isinstance(t, torch.Tensor) for t in v):
        return f"a {type(v).__name__} of {len(v)} tensors " + ", ".join(
            describe_arg(t) for t in v
        ).replace("a ", "")
    return f"{type(v).__name__} {v!r}"[:120]


def check_dataset(dataset: Any, n: int) -> None:
    """Refuses a dataset that is not the ``n`` items of the predictions, in
    order and readable by index (the grid's inputs)."""
    if dataset is None:
        return
    where = "ClassificationInterpretation"
    if isinstance(dataset, str | bytes) or not hasattr(dataset, "__getitem__"):
        raise ArgTypeError(
            f"{where}: dataset must be the items, readable by index (dataset[i] "
            f"gives (x, y) or x), or None; got {describe_arg(dataset)}. Fix: "
            "e.g. dataset=learn.data.valid_dl.dataset, or dataset=None (no grid "
            "of inputs)."
        )
    if len_or_none(dataset) is None:
        raise ValueError(
            f"{where}: the dataset has no length (an IterableDataset?), so its "
            "items can't be matched to the predictions. Fix: dataset=None (no "
            "grid), or a map-style dataset of the same items in order."
        )
    if len(dataset) != n:
        raise ValueError(
            f"{where}: the dataset has {len(dataset)} items but there are {n} "
            "predictions; they must be the same items in the same order. Fix: "
            "pass the dataset the predictions were made on, or dataset=None (no "
            "grid of inputs)."
        )


def check_learner_args(learn: Any, dl: Any, loss_func: Any) -> None:
    """``from_learner``'s arguments: a Learner, a loader, a loss function."""
    where = "ClassificationInterpretation.from_learner"
    if not (hasattr(learn, "get_preds") and hasattr(learn, "data")):
        raise ArgTypeError(
            f"{where}: learn must be a fitlib Learner; got "
            f"{type(learn).__name__}. Fix: from_learner(Learner(data, model, "
            "loss_func)), or ClassificationInterpretation(preds, targets) for "
            "predictions made another way."
        )
    if dl is not None and (isinstance(dl, str | bytes | dict) or not _iterable(dl)):
        raise ArgTypeError(
            f"{where}: dl must be a loader of (x, y) batches, or None for the "
            f"validation set; got {describe_arg(dl)}. Fix: e.g. dl=DataLoader("
            "valid_ds, 64) (in order, for the grid of inputs)."
        )
    if loss_func is None:
        return
    if isinstance(loss_func, type) or not callable(loss_func):
        what = "" if isinstance(loss_func, type) else "not callable: "
        raise ArgTypeError(
            f"{where}: loss_func must be a loss function loss_func(scores, "
            f"targets), or None for the Learner's; got {what}"
            f"{describe_arg(loss_func)}. {FIX_LOSS}, or an instance such as "
            "nn.CrossEntropyLoss()."
        )


def _iterable(x: Any) -> bool:
    try:
        iter(x)
    except TypeError:
        return False
    return True


def check_axes(ax: Any, figsize: Any, where: str) -> None:
    """``ax`` (None, or matplotlib Axes) and ``figsize`` (None, or a pair of
    sizes in inches > 0, for a new figure only)."""
    if ax is not None and not hasattr(ax, "imshow"):
        raise ArgTypeError(
            f"{where}: ax must be a matplotlib Axes to draw into, or None for "
            f"a new figure; got {describe_arg(ax)}. Fix: e.g. "
            "ax=plt.figure().add_subplot(), or leave ax out."
        )
    if figsize is None:
        return
    pair = isinstance(figsize, tuple | list) and len(figsize) == 2
    if not (pair and all(is_number(v) and 0 < v < float("inf") for v in figsize)):
        error = ValueError if pair else ArgTypeError
        raise error(
            f"{where}: figsize must be (width, height) in inches, both > 0, or "
            f"None; got {figsize!r} ({type(figsize).__name__}). Fix: e.g. "
            "figsize=(8, 8)."
        )
    if ax is not None:
        raise ValueError(
            f"{where}: figsize sizes a new figure, but ax= draws into an "
            "existing one. Fix: pass one of them (size the figure of ax with "
            "ax.figure.set_size_inches(w, h))."
        )


def check_indices(indices: Any, n: int) -> list[int]:
    """Item indices as a list of ints in ``[-n, n)``, at least one."""
    if isinstance(indices, torch.Tensor) and indices.ndim == 1:
        indices = indices.tolist()  # (a bool or float tensor is refused below)
    if isinstance(indices, str | bytes) or not isinstance(indices, Sequence):
        indices = getattr(indices, "tolist", lambda: indices)()  # numpy arrays
    ints = isinstance(indices, list | tuple) and all(check_int_like(i) for i in indices)
    if not ints or not indices or not all(-n <= i < n for i in indices):
        error = ValueError if ints else ArgTypeError
        raise error(
            f"plot_items: indices must be a non-empty list of item indices, "
            f"ints in [0, {n}); got {describe_arg(indices)}. Fix: e.g. "
            "plot_items([0, 5, 7]), or interp.top_losses(9)[1]."
        )
    return [int(i) for i in indices]


def check_int_like(i: Any) -> bool:
    """An int (numpy's too), not a bool, >= -2**63."""
    return is_int(i) and i >= -(2**63)
