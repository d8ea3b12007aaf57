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

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn import functional as F  # noqa: N812

from fitlib.checks import check_flag, check_int
from fitlib.errors import ArgTypeError
from fitlib.evaluation import valid_loader
from fitlib.interpret_checks import (
    check_axes,
    check_classes,
    check_dataset,
    check_finite,
    check_indices,
    check_learner_args,
    check_preds_targets,
    describe_arg,
    ordered_dataset,
    per_item_losses,
)
from fitlib.plots import load_pyplot


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
        self.preds, self.targets = check_preds_targets(preds, targets)
        n, n_classes = self.preds.shape
        if losses is None:
            losses = F.cross_entropy(self.preds.float(), self.targets, reduction="none")
        elif not (isinstance(losses, torch.Tensor) and losses.shape == (n,)):
            tensor = isinstance(losses, torch.Tensor)
            raise (ValueError if tensor else ArgTypeError)(
                f"ClassificationInterpretation: losses must be a tensor of shape "
                f"({n},), one loss per item; got {describe_arg(losses)}. Fix: pass "
                "per-item losses (reduction='none'), or losses=None for "
                "cross-entropy."
            )
        where = "ClassificationInterpretation"
        self.losses = check_finite(losses.detach().float().cpu(), "losses", where)
        self._no_grid = None
        check_dataset(dataset, n)
        self.dataset = dataset
        self.classes = check_classes(classes, dataset, n_classes)

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
        where = "from_learner"
        check_learner_args(learn, dl, loss_func)
        loader = valid_loader(learn, dl)
        preds, targets = learn.get_preds(loader)
        if targets is None:
            raise ValueError(
                f"ClassificationInterpretation.{where}: the loader yields no "
                "targets (batches of inputs only), so there is nothing to "
                "compare the predictions with. Fix: pass a loader of (x, y) "
                "batches."
            )
        preds, targets = check_preds_targets(preds, targets, where)
        loss_func = learn.loss_func if loss_func is None else loss_func
        losses = per_item_losses(loss_func, preds, targets)
        dataset, reason = ordered_dataset(loader, len(targets))
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
        min_count = check_int(
            min_count, "min_count", minimum=0, owner="most_confused", example=2
        )
        min_count = max(min_count, 1)  # a mistake made 0 times is none
        cm = self.confusion_matrix()
        found = [
            (self.classes[i], self.classes[j], int(cm[i, j]))
            for i in range(len(self.classes))
            for j in range(len(self.classes))
            if i != j and cm[i, j] >= min_count
        ]
        return sorted(found, key=lambda t: -t[2])  # stable: ties in class order

    def top_losses(self, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` largest losses (all by default, or all there are when
        fewer), largest first, and the indices of their items (ties in item
        order)."""
        k = check_int(k, "k", owner="top_losses", example=9, allow_none=True)
        order = torch.sort(self.losses, descending=True, stable=True).indices
        order = order if k is None else order[:k]
        return self.losses[order], order

    # -- plots -----------------------------------------------------------------
    def plot_confusion_matrix(
        self,
        normalize: bool = False,
        ax: Any = None,
        cmap: Any = "Blues",
        figsize: tuple[float, float] | None = None,
    ) -> Any:
        """The confusion matrix as an image with its numbers in each cell;
        ``normalize=True`` shows each row as shares of its class. Returns the
        Axes (a new figure's, of ``figsize`` inches, when ``ax`` is None);
        ``cmap`` is a matplotlib colormap or its name."""
        where = "plot_confusion_matrix"
        check_flag(normalize, "normalize", where)
        check_axes(ax, figsize, where)
        if not isinstance(cmap, str) and not callable(cmap):
            raise ArgTypeError(
                f"{where}: cmap must be a matplotlib colormap or its name; got "
                f"{cmap!r} ({type(cmap).__name__}). Fix: e.g. cmap='Blues'."
            )
        plt = load_pyplot()
        cm = self.confusion_matrix().float()
        if normalize:
            cm = cm / cm.sum(dim=1, keepdim=True).clamp(min=1)
        new = ax is None
        if new:
            size = 2.5 + 0.45 * len(self.classes)
            ax = plt.figure(figsize=figsize or (size, size)).add_subplot()
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
        self,
        k: int = 9,
        ncols: int = 3,
        show: Callable | None = None,
        figsize: tuple[float, float] | None = None,
    ) -> Any:
        """The ``k`` items with the largest losses, each titled with its
        prediction, its true class, its loss and the probability of the
        prediction (red: a mistake). ``show(x, ax)`` draws one input; the
        default draws an image (see ``show_image``). Returns the array of
        Axes (of a figure of ``figsize`` inches; default 2.4 by 2.6 a
        cell)."""
        k = check_int(k, "k", minimum=1, owner="plot_top_losses", example=9)
        self._require_dataset("plot_top_losses")
        _, indices = self.top_losses(k)
        return self._grid(indices.tolist(), ncols, show, figsize, "plot_top_losses")

    def plot_items(
        self,
        indices: Sequence[int],
        ncols: int = 3,
        show: Callable | None = None,
        figsize: tuple[float, float] | None = None,
    ) -> Any:
        """A grid of the dataset's items at ``indices``, titled as in
        ``plot_top_losses``."""
        self._require_dataset("plot_items")
        indices = check_indices(indices, len(self.targets))
        return self._grid(indices, ncols, show, figsize, "plot_items")

    def _grid(
        self, indices: list, ncols: Any, show: Any, figsize: Any, where: str
    ) -> Any:
        ncols = check_int(ncols, "ncols", minimum=1, owner=where, example=3)
        check_axes(None, figsize, where)
        if show is not None and not callable(show):
            raise ArgTypeError(
                f"{where}: show must be a function show(x, ax) that draws one "
                f"input, or None for images; got {show!r} ({type(show).__name__})."
                " Fix: e.g. show=lambda x, ax: ax.text(0, 0.5, str(x))."
            )
        plt, show = load_pyplot(), show_image if show is None else show
        ncols = min(ncols, len(indices))
        nrows = -(-len(indices) // ncols)
        size = figsize or (2.4 * ncols, 2.6 * nrows)
        fig, axes = plt.subplots(nrows, ncols, figsize=size, squeeze=False)
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
        shape = f"of shape {tuple(t.shape)}" if t is not None else describe_arg(x)
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
