"""Reading a classifier's mistakes: confusion matrix, per-class accuracy, the
top losses, and a grid of the inputs it got most wrong.

``ClassificationInterpretation`` works on what any classifier gives: a
``(N, C)`` tensor of scores (logits or log-probabilities, what
``cross_entropy``/``nll_loss`` take) and ``(N,)`` integer targets. The inputs
for the grid come from the loader's dataset, so a plain ``TensorDataset``
works as well as an ``ImageFolder``: an item is shown from its tensor (or PIL
image) as it comes out of the dataset, with no decoding pipeline to know.

    interp = ClassificationInterpretation.from_learner(learn)
    interp.confusion_matrix()          # counts: rows true, columns predicted
    interp.per_class_accuracy()        # {class: share of its items right}
    interp.most_confused()             # [(true, predicted, count), ...]
    interp.plot_confusion_matrix()
    interp.plot_top_losses(9)          # the 9 worst, with prediction and truth
"""

from __future__ import annotations

import copy
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from fitlib.plots import _pyplot


class ClassificationInterpretation:
    """The predictions of a classifier over a data set, and ways to read them.

    Args:
        preds: ``(N, C)`` scores, one row per item: logits or
            log-probabilities (``probs`` applies softmax to them).
        targets: ``(N,)`` integer classes in ``[0, C)``.
        losses: ``(N,)`` loss of each item; None computes cross-entropy from
            ``preds`` (right for logits and log-probabilities).
        dataset: the items, in the order of ``preds`` (``dataset[i]`` gives
            ``(x, y)`` or ``x``), for the grid of inputs; None leaves the grid
            out (``plot_top_losses`` then says why).
        classes: the ``C`` class names; default the dataset's ``classes``
            (an ``ImageFolder``'s folder names), else ``0 .. C-1``.
    """

    def __init__(
        self,
        preds: torch.Tensor,
        targets: torch.Tensor,
        losses: torch.Tensor | None = None,
        dataset: Any = None,
        classes: Sequence | None = None,
    ) -> None:
        self.preds, self.targets = _check_preds_targets(preds, targets)
        n, n_classes = self.preds.shape
        if losses is None:
            losses = F.cross_entropy(self.preds.float(), self.targets, reduction="none")
        elif not (isinstance(losses, torch.Tensor) and losses.shape == (n,)):
            raise ValueError(
                f"ClassificationInterpretation: losses must be a tensor of shape "
                f"({n},), one loss per item; got {_describe(losses)}. Fix: pass "
                "per-item losses (reduction='none'), or losses=None for "
                "cross-entropy."
            )
        self.losses = losses.detach().float().cpu()
        self._no_grid = None
        if dataset is not None and _len(dataset) != n:
            if _len(dataset) is None:
                raise ValueError(
                    "ClassificationInterpretation: the dataset has no length "
                    "(an IterableDataset?), so its items can't be matched to "
                    "the predictions. Fix: dataset=None (no grid), or a "
                    "map-style dataset of the same items in order."
                )
            raise ValueError(
                f"ClassificationInterpretation: the dataset has {_len(dataset)} "
                f"items but there are {n} predictions; they must be the same "
                "items in the same order. Fix: pass the dataset the predictions "
                "were made on, or dataset=None (no grid of inputs)."
            )
        self.dataset = dataset
        self.classes = _check_classes(classes, dataset, n_classes)

    @classmethod
    def from_learner(
        cls,
        learn: Any,
        dl: Any = None,
        classes: Sequence | None = None,
        loss_func: Callable | None = None,
    ) -> ClassificationInterpretation:
        """Predictions of ``learn``'s model over ``dl`` (the validation set by
        default), with each item's loss under ``loss_func`` (default the
        Learner's). The inputs for the grid are ``dl.dataset``'s items when
        ``dl`` goes through it in order (no shuffling, no dropped batch)."""
        loader = learn._loader(dl)
        preds, targets = learn.get_preds(loader)
        where = "from_learner"
        if targets is None:
            raise ValueError(
                f"ClassificationInterpretation.{where}: the loader yields no "
                "targets (batches of inputs only), so there is nothing to "
                "compare the predictions with. Fix: pass a loader of (x, y) "
                "batches."
            )
        preds, targets = _check_preds_targets(preds, targets, where)
        loss_func = learn.loss_func if loss_func is None else loss_func
        losses = _per_item_losses(loss_func, preds, targets)
        dataset, reason = _ordered_dataset(loader, len(targets))
        interp = cls(preds, targets, losses, dataset, classes)
        interp._no_grid = reason
        return interp

    # -- numbers ---------------------------------------------------------------
    @property
    def predicted(self) -> torch.Tensor:
        """``(N,)`` the predicted class of each item (the highest score)."""
        return self.preds.argmax(dim=1)

    @property
    def probs(self) -> torch.Tensor:
        """``(N, C)`` softmax of the scores."""
        return self.preds.float().softmax(dim=1)

    @property
    def accuracy(self) -> float:
        return (self.predicted == self.targets).float().mean().item()

    def confusion_matrix(self) -> torch.Tensor:
        """``(C, C)`` counts: row ``i``, column ``j`` = items of class ``i``
        predicted as ``j``; the diagonal holds the right answers."""
        c = len(self.classes)
        pairs = self.targets * c + self.predicted
        return torch.bincount(pairs, minlength=c * c).view(c, c)

    def per_class_accuracy(self) -> dict:
        """``{class: share of its items predicted right}`` (its recall); nan
        for a class with no items."""
        cm = self.confusion_matrix().double()  # shares as Python floats
        totals = cm.sum(dim=1)
        right = cm.diagonal()
        return {
            name: (right[i] / totals[i]).item() if totals[i] else float("nan")
            for i, name in enumerate(self.classes)
        }

    def most_confused(self, min_count: int = 1) -> list[tuple]:
        """``(true, predicted, count)`` of every mistake made at least
        ``min_count`` times, the most frequent first."""
        if isinstance(min_count, bool) or not isinstance(min_count, numbers.Integral):
            raise TypeError(
                f"most_confused: min_count must be an int; got {min_count!r}. "
                "Fix: e.g. min_count=2."
            )
        min_count = max(int(min_count), 1)  # a mistake made 0 times is none
        cm = self.confusion_matrix()
        found = [
            (self.classes[i], self.classes[j], int(cm[i, j]))
            for i in range(len(self.classes))
            for j in range(len(self.classes))
            if i != j and cm[i, j] >= min_count
        ]
        return sorted(found, key=lambda t: -t[2])  # stable: ties in class order

    def top_losses(self, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` largest losses (all by default), largest first, and the
        indices of their items (ties in item order)."""
        order = torch.sort(self.losses, descending=True, stable=True).indices
        order = order if k is None else order[: _check_k(k, len(order))]
        return self.losses[order], order

    # -- plots -----------------------------------------------------------------
    def plot_confusion_matrix(
        self, normalize: bool = False, ax: Any = None, cmap: str = "Blues"
    ) -> Any:
        """The confusion matrix as an image with its numbers in each cell;
        ``normalize=True`` shows each row as shares of its class. Returns the
        Axes (a new figure's when ``ax`` is None)."""
        plt = _pyplot()
        cm = self.confusion_matrix().float()
        if normalize:
            cm = cm / cm.sum(dim=1, keepdim=True).clamp(min=1)
        new = ax is None
        if new:
            size = 2.5 + 0.45 * len(self.classes)
            ax = plt.figure(figsize=(size, size)).add_subplot()
        ax.imshow(cm.numpy(), cmap=cmap, vmin=0)
        ticks = range(len(self.classes))
        names = [str(c) for c in self.classes]
        ax.set_xticks(ticks, names, rotation=90 if max(map(len, names)) > 3 else 0)
        ax.set_yticks(ticks, names)
        title = "confusion matrix" + (" (shares of each row)" if normalize else "")
        ax.set(xlabel="predicted", ylabel="true", title=title)
        high = cm.max().item()
        for i in ticks:
            for j in ticks:
                value = cm[i, j].item()
                text = f"{value:.2f}" if normalize else f"{value:.0f}"
                color = "white" if value > high / 2 else "black"
                ax.text(j, i, text, ha="center", va="center", color=color, size=8)
        if new:
            ax.figure.tight_layout()  # room for long class names
        return ax

    def plot_top_losses(
        self, k: int = 9, ncols: int = 3, show: Callable | None = None
    ) -> Any:
        """The ``k`` items with the largest losses, each titled with its
        prediction, its true class, its loss and the probability of the
        prediction (red: a mistake). ``show(x, ax)`` draws one input; the
        default draws an image (see ``show_image``). Returns the array of
        Axes."""
        self._require_dataset("plot_top_losses")
        _, indices = self.top_losses(k)
        return self.plot_items(indices.tolist(), ncols=ncols, show=show)

    def plot_items(
        self, indices: Sequence[int], ncols: int = 3, show: Callable | None = None
    ) -> Any:
        """A grid of the dataset's items at ``indices``, titled as in
        ``plot_top_losses``."""
        self._require_dataset("plot_items")
        plt, show = _pyplot(), show_image if show is None else show
        ncols = max(1, min(ncols, len(indices)))
        nrows = max(1, -(-len(indices) // ncols))
        fig, axes = plt.subplots(
            nrows, ncols, figsize=(2.4 * ncols, 2.6 * nrows), squeeze=False
        )
        for ax in axes.flat:
            ax.axis("off")
        probs, predicted = self.probs, self.predicted
        for ax, i in zip(axes.flat, indices, strict=False):
            item = self.dataset[i]
            x = item[0] if isinstance(item, tuple | list) else item
            show(x, ax)
            p = predicted[i].item()
            ax.set_title(
                f"{self.classes[p]} / {self.classes[self.targets[i]]}\n"
                f"loss {self.losses[i]:.2f}, p {probs[i, p]:.2f}",
                size=9,
                color="black" if p == self.targets[i] else "firebrick",
            )
        fig.suptitle(
            "predicted / true; loss, p = the probability of the prediction", size=9
        )
        fig.tight_layout()
        return axes

    def _require_dataset(self, where: str) -> None:
        if self.dataset is None:
            reason = self._no_grid or "no dataset was given"
            raise ValueError(
                f"{where}: there are no inputs to show: {reason}. Fix: "
                "interpret a loader that goes through its dataset in order, "
                "e.g. from_learner(learn, dl=DataLoader(valid_ds, 64)), or "
                "pass dataset= with the items in the order of the predictions."
            )


def show_image(x: Any, ax: Any) -> None:
    """Draws one image: a PIL image, or a tensor/array ``(H, W)``, ``(C, H, W)``
    or ``(H, W, C)`` with 1, 3 or 4 channels. Float images outside [0, 1]
    (normalized ones) are rescaled to [0, 1] per image for display."""
    if hasattr(x, "convert") and hasattr(x, "mode"):  # a PIL image
        ax.imshow(x, cmap="gray" if x.mode in ("L", "1") else None)
        ax.axis("off")
        return
    if isinstance(x, dict):
        raise ValueError(
            f"show_image: the dataset's items are dicts (keys {list(x)}); "
            "which one is the image? Fix: show=lambda x, ax: "
            f"show_image(x[{next(iter(x), 'image')!r}], ax)."
        )
    try:
        t = torch.as_tensor(x).detach().cpu()
    except (TypeError, ValueError, RuntimeError):
        t = None
    if t is None or t.ndim not in (2, 3):
        shape = f"of shape {tuple(t.shape)}" if t is not None else _describe(x)
        raise ValueError(
            f"show_image: can't draw an input {shape} as an image. Fix: pass "
            "show=a function (x, ax) that draws one input, e.g. "
            "show=lambda x, ax: ax.text(0, 0.5, decode(x), wrap=True)."
        )
    shape = tuple(t.shape)
    # torch's images are (C, H, W); numpy's and PIL's arrays (H, W, C).
    channels_first = t.shape[0] in (1, 3, 4) if t.ndim == 3 else False
    if not isinstance(x, torch.Tensor) and t.ndim == 3:
        channels_first = t.shape[-1] not in (1, 3, 4) and t.shape[0] in (1, 3, 4)
    if channels_first:
        t = t.permute(1, 2, 0)  # CHW -> HWC
    if t.ndim == 3 and t.shape[-1] == 1:
        t = t[..., 0]
    if t.ndim == 3 and t.shape[-1] not in (3, 4):
        raise ValueError(
            f"show_image: can't draw an input of shape {shape} as an "
            "image (1, 3 or 4 channels, first or last). Fix: pass show=a "
            "function (x, ax) that draws one input."
        )
    if t.is_floating_point():
        t = t.float()
        low, high = t.min(), t.max()
        if low < 0 or high > 1:
            t = (t - low) / (high - low).clamp(min=1e-12)
    ax.imshow(t.numpy(), cmap="gray" if t.ndim == 2 else None)
    ax.axis("off")


def _check_classes(classes: Any, dataset: Any, n_classes: int) -> list:
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
            f"outputs; got a dict {_describe(classes)}. Fix: for an "
            "ImageFolder's class_to_idx {name: index}, classes=sorted(d, "
            "key=d.get); for {index: name}, classes=[d[i] for i in "
            f"range({n_classes})]."
        )
    if isinstance(classes, str | bytes) or not isinstance(classes, Sequence):
        raise TypeError(
            f"{where} must be a list of {n_classes} names; got "
            f"{_describe(classes)}. Fix: e.g. classes=['cat', 'dog', ...], in "
            "the order of the model's outputs."
        )
    if len(classes) != n_classes:
        raise ValueError(
            f"{where}: {len(classes)} names ({list(classes)[:12]}) for "
            f"{n_classes} scores per item. Fix: pass {n_classes} names, in the "
            "order of the model's outputs."
        )
    return list(classes)


def _check_preds_targets(
    preds: Any, targets: Any, where: str = "__init__"
) -> tuple[torch.Tensor, torch.Tensor]:
    name = f"ClassificationInterpretation.{where}"
    if not isinstance(preds, torch.Tensor):
        pick_y = "targets[0]" if isinstance(targets, tuple | list) else "targets"
        raise TypeError(
            f"{name}: preds must be a tensor of scores (N, C); got "
            f"{_describe(preds)}. Fix: for a model with several outputs, "
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
            f"item; got {_describe(preds)}. Fix: for a sequence model's "
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
        else:
            fix = "the class index of each item"
        raise ValueError(
            f"{name}: targets must be a tensor of shape ({n},), one class "
            f"index per item; got {_describe(targets)}. Fix: {fix}."
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
    return preds.detach().cpu(), targets.detach().cpu().long()


def _per_item_losses(
    loss_func: Callable | None, preds: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor | None:
    """Each item's loss, in float32 on the CPU: a loss module with a
    ``reduction`` (``nn.CrossEntropyLoss``, class weights included) is called
    once with ``reduction="none"``; any other loss on a batch of one item (a
    mean-reduced loss of one item is that item's loss). A dict loss gives its
    ``"loss"``."""
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
            losses = _loss_value(per_item(preds, targets))
            if isinstance(losses, torch.Tensor) and losses.shape == targets.shape:
                return losses.float()
        losses = [
            _loss_value(loss_func(preds[i : i + 1], targets[i : i + 1]))
            for i in range(len(preds))
        ]
    bad = next((v for v in losses if not _scalar(v)), None)
    if bad is not None:
        raise ValueError(
            f"{where}: loss_func returned {_describe(bad)} for one item; a "
            "per-item loss needs a single number. Fix: pass "
            "loss_func=torch.nn.functional.cross_entropy (or a loss that "
            "returns one number for a batch)."
        )
    return torch.stack([v.float().reshape(()) for v in losses]) if losses else None


def _loss_value(v: Any) -> Any:
    return v["loss"] if isinstance(v, dict) and "loss" in v else v


def _ordered_dataset(loader: Any, n: int) -> tuple[Any, str | None]:
    """``loader.dataset`` when the loader yields its items in order, with the
    reason for None otherwise."""
    from torch.utils.data import BatchSampler, SequentialSampler

    dataset = getattr(loader, "dataset", None)
    if dataset is None:
        return None, f"the loader ({type(loader).__name__}) has no dataset"
    # The batches' indices come from batch_sampler (a BatchSampler around
    # sampler, unless one was given) or, with batch_size=None, from sampler.
    if _len(dataset) is None:
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
    if _len(dataset) != n:
        return None, (
            f"the loader gave {n} predictions for {_len(dataset)} items "
            "(drop_last=True?)"
        )
    return dataset, None


def _check_k(k: Any, n: int) -> int:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
        raise ValueError(
            f"top_losses: k must be an int >= 0 (how many items); got {k!r}. "
            f"Fix: e.g. k=9 (there are {n} items)."
        )
    return int(k)


def _scalar(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.numel() == 1


def _len(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a {v.dtype} tensor of shape {tuple(v.shape)}"
    if isinstance(v, tuple | list) and all(isinstance(t, torch.Tensor) for t in v):
        return f"a {type(v).__name__} of {len(v)} tensors " + ", ".join(
            _describe(t) for t in v
        ).replace("a ", "")
    return f"{type(v).__name__} {v!r}"[:120]
