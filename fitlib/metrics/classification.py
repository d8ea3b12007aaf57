"""Class metrics counted over the whole set: accuracy (per sample, pixel or
token), F-scores, mean IoU and Dice from a confusion matrix, and perplexity.

Each takes ``class_dim`` (where the class scores sit; found from the shapes by
default, see ``find_class_dim``) and ``ignore_index`` (targets not counted:
padding tokens, unlabelled pixels); those that read one score per target
(binary) take ``from_logits`` and ``threshold``.
"""

import math

import torch
from torch import Tensor
from torch.nn import functional as F  # noqa: N812

from fitlib.checks import check_int, check_number
from fitlib.metrics.accumulate import Metric, accumulation_dtype
from fitlib.metrics.functions import (
    binary_cut,
    check_binary_scores,
    check_class_targets,
    check_index,
    class_predictions,
    class_rows,
    match_shape,
)


class ClassMetric(Metric):
    """A metric of class targets: checks them on a first batch, knowing its
    ``class_dim`` and ``ignore_index``, and, for one score per target,
    whether it is a logit (``from_logits``) and the ``threshold`` of class 1."""

    reads_binary = True  # one score per target is a binary prediction

    def __init__(
        self,
        class_dim: int | None,
        ignore_index: int | None,
        from_logits: bool | None = None,
        threshold: float = 0.5,
    ) -> None:
        owner = type(self).__name__
        self.class_dim = check_index(class_dim, "class_dim", owner, "1")
        self.ignore_index = check_index(ignore_index, "ignore_index", owner, "-100")
        self.cut = binary_cut(from_logits, threshold, owner)
        self.from_logits, self.threshold = from_logits, threshold
        super().__init__()

    def check_inputs(
        self, output: Tensor, *targets: Tensor, loss_func: object = None
    ) -> None:
        """Refuses targets that are no class labels and, with ``loss_func``
        (the fit's loss), probabilities read as logits (``from_logits``)."""
        check_class_targets(
            self.name, output, *targets, class_dim=self.class_dim,
            ignore_index=self.ignore_index, owner=type(self).__name__,
        )  # fmt: skip
        if targets:
            self.check_scores(output, targets[0], loss_func)

    def check_scores(self, output: Tensor, y: Tensor, loss_func: object) -> None:
        """Only the check of one score per target read the wrong way
        (``check_binary_scores``); run on a fit's first training batch too."""
        if self.reads_binary:
            check_binary_scores(
                type(self).__name__, self.name, output, y,
                self.from_logits, loss_func, self.class_dim,
            )  # fmt: skip


class Accuracy(ClassMetric):
    """Fraction of correct class predictions, counted over the whole set.

    ``metrics=[accuracy]`` uses it; give it to say where the classes are or
    what to leave out.

    Args:
        class_dim: the output's dim of class scores; None finds it from the
            shapes (last dim, or dim 1 for channels first; a later batch
            whose shape fits both keeps the fit's first decision).
        ignore_index: targets equal to it are not counted (padding tokens,
            unlabelled pixels); None counts all.
        from_logits: for one score per target (binary): True, a logit;
            False, a probability (a sigmoid's output); None, a logit, and
            the first batch refuses it under a loss that takes probabilities
            (``binary_cross_entropy``, ``nn.BCELoss``).
        threshold: the probability above which one score per target
            predicts class 1 (a logit is compared with its logit, 0 for 0.5).

    Examples:
        >>> m = Accuracy(ignore_index=-100)
        >>> m.update(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), torch.tensor([1, -100]))
        >>> m.compute()
        tensor(1., dtype=torch.float64)
    """

    name = "accuracy"
    default_ignore: int | None = None  # when ignore_index is None

    def __init__(
        self,
        class_dim: int | None = None,
        ignore_index: int | None = None,
        from_logits: bool | None = None,
        threshold: float = 0.5,
    ) -> None:
        if ignore_index is None:
            ignore_index = self.default_ignore
        super().__init__(class_dim, ignore_index, from_logits, threshold)

    def reset(self) -> None:
        self.hits: Tensor | None = None  # a device count
        self.count: int | Tensor = 0  # a device count when targets are ignored

    def update(self, output: Tensor, *targets: Tensor) -> None:
        y = targets[0]
        if not y.numel():
            return
        pred = class_predictions(
            output, y, self.name, self.class_dim, self.cut, type(self).__name__
        )[0]
        right = pred == y
        if self.ignore_index is None:
            hits, count = right.sum(), y.numel()
        else:
            keep = y != self.ignore_index
            hits, count = (right & keep).sum(), keep.sum()
        self.hits = hits if self.hits is None else self.hits + hits
        self.count = self.count + count

    def compute(self) -> Tensor:
        """The fraction counted (nan when every target was ignored)."""
        if self.hits is None:
            raise self._no_data()
        return self.hits.to(accumulation_dtype(self.hits.device)) / self.count

    def sums(self) -> list[Tensor]:
        if self.hits is None:  # the shape is known: take part with zeros
            return [torch.zeros(2, dtype=torch.float64)]
        hits = self.hits.to(accumulation_dtype(self.hits.device))
        count = self.count
        # A fill, not a host-to-device copy of an int count (which would wait).
        count = hits.new_full((), count) if isinstance(count, int) else count.to(hits)
        return [torch.stack([hits, count])]

    def load_sums(self, sums: list[Tensor]) -> None:
        self.hits, self.count = sums[0].unbind()


class ErrorRate(Accuracy):
    """One minus ``Accuracy`` (``metrics=[error_rate]`` uses it).

    Examples:
        >>> ErrorRate(class_dim=1).name
        'error_rate'
    """

    name = "error_rate"

    def compute(self) -> Tensor:
        return 1 - super().compute()


class TokenAccuracy(Accuracy):
    """``Accuracy`` over a sequence's tokens, padding (``ignore_index``,
    -100 by default, as ``cross_entropy``) left out.

    Examples:
        >>> TokenAccuracy().ignore_index
        -100
    """

    name = "token_accuracy"
    default_ignore = -100


class _ConfusionMetric(ClassMetric):
    """Scores from a confusion matrix accumulated on the device (rows are
    targets, columns predictions). Targets outside ``[0, num_classes)``
    cannot be checked without a sync, so they are counted aside and make
    ``compute()`` return nan; targets equal to ``ignore_index`` are left out."""

    def __init__(
        self,
        num_classes: int | None = None,
        class_dim: int | None = None,
        ignore_index: int | None = None,
        from_logits: bool | None = None,
        threshold: float = 0.5,
    ) -> None:
        owner = type(self).__name__
        check_int(
            num_classes, "num_classes", minimum=2, owner=owner, example="None",
            allow_none=True,
        )  # fmt: skip
        self.num_classes = num_classes
        super().__init__(class_dim, ignore_index, from_logits, threshold)

    def reset(self) -> None:
        # Flat C*C counts plus one trailing slot for out-of-range targets.
        self.cm: Tensor | None = None
        self.n_cls = 0

    def update(self, output: Tensor, *targets: Tensor) -> None:
        y = targets[0]
        pred, c = class_predictions(
            output, y, self.name, self.class_dim, self.cut, type(self).__name__
        )
        if self.cm is None:
            self._start(c, output.device)
        if c != self.n_cls:
            raise ValueError(
                f"{self.name}: output has {c} classes, but num_classes or earlier "
                f"batches gave {self.n_cls}. Fix: num_classes = the model's outputs."
            )
        pred = match_shape(pred, y, self.name).reshape(-1)
        t = y.reshape(-1).long()
        valid = (t >= 0) & (t < self.n_cls)
        if y.is_floating_point():  # 0.5 must not silently truncate to class 0
            valid &= t == y.reshape(-1)
        idx = torch.where(valid, t * self.n_cls + pred, self.n_cls**2)
        if self.ignore_index is None:
            counts = torch.ones_like(idx)
        else:  # an ignored target adds 0 wherever it points (no sync)
            counts = (y.reshape(-1) != self.ignore_index).to(idx.dtype)
        self.cm.index_add_(0, idx, counts)

    def _start(self, c: int, device: torch.device) -> None:
        self.n_cls = self.num_classes or c
        self.cm = torch.zeros(self.n_cls**2 + 1, dtype=torch.long, device=device)

    def _counts(self) -> tuple[Tensor, Tensor, Tensor]:
        """Per class: true positives, false positives, false negatives."""
        if self.cm is None:
            raise self._no_data()
        c = self.n_cls
        cm = self.cm[:-1].view(c, c).to(accumulation_dtype(self.cm.device))
        tp = cm.diagonal()
        return tp, cm.sum(0) - tp, cm.sum(1) - tp

    def _nan_if_outside(self, value: Tensor) -> Tensor:
        return torch.where(self.cm[-1] > 0, torch.full_like(value, math.nan), value)

    def sums(self) -> list[Tensor]:
        # The count vector's length comes from the first batch: a process
        # without one cannot take part (distributed training gives each
        # process at least one batch).
        if self.cm is None:
            raise self._no_local_data()
        return [self.cm]

    def load_sums(self, sums: list[Tensor]) -> None:
        self.cm = sums[0].to(torch.long)  # whole counts: exact in float


def _mean_present(per_class: Tensor, den: Tensor) -> Tensor:
    """The mean over the classes seen in targets or predictions (den > 0)."""
    present = den > 0
    return (per_class * present).sum() / present.sum().clamp(min=1)


class FBeta(_ConfusionMetric):
    """F-beta score from a confusion matrix accumulated over the whole set.

    Args:
        beta: weight of recall against precision; > 0.
        average: "binary" (F of class 1; one logit per sample, positive
            when > 0, or two class columns), "macro" or "micro".
        num_classes: defaults to the output's class dim (2 for one logit).
        class_dim: as for ``Accuracy`` (per pixel, per token).
        ignore_index: as for ``Accuracy``.
        from_logits: as for ``Accuracy`` (a probability per sample).
        threshold: as for ``Accuracy``.

    Like scikit-learn's defaults, macro averages the classes seen in targets
    or predictions, and an undefined precision or recall counts as 0.
    Targets outside [0, num_classes) cannot be checked without a sync, so
    they are counted aside and make `compute()` return nan.

    Examples:
        >>> m = FBeta(beta=2.0, average="binary")
        >>> m.update(torch.tensor([2.0, -1.0, 3.0]), torch.tensor([1, 1, 0]))
        >>> m.name, m.compute()
        ('f2_score', tensor(0.5000, dtype=torch.float64))
    """

    AVERAGES = ("binary", "macro", "micro")

    def __init__(
        self,
        beta: float = 1.0,
        average: str = "macro",
        num_classes: int | None = None,
        class_dim: int | None = None,
        ignore_index: int | None = None,
        from_logits: bool | None = None,
        threshold: float = 0.5,
    ) -> None:
        owner = type(self).__name__
        check_number(beta, "beta", above=0, owner=owner, example=1.0)
        if average not in self.AVERAGES:
            raise ValueError(
                f"average must be one of {self.AVERAGES}, got {average!r}. "
                'Fix: average="macro".'
            )
        self.beta, self.average = float(beta), average
        if type(self).name == Metric.name:  # Dice keeps its own
            self.name = f"f{beta:g}_score"
        super().__init__(num_classes, class_dim, ignore_index, from_logits, threshold)

    def _start(self, c: int, device: torch.device) -> None:
        super()._start(c, device)
        if self.average == "binary" and self.n_cls != 2:
            raise ValueError(
                f'{self.name}: average="binary" needs 2 classes, got {self.n_cls}. '
                'Fix: average="macro" or "micro".'
            )

    def compute(self) -> Tensor:
        tp, fp, fn = self._counts()
        if self.average == "micro":
            tp, fp, fn = tp.sum(), fp.sum(), fn.sum()
        b2 = self.beta**2
        num = (1 + b2) * tp
        den = num + b2 * fn + fp
        f = torch.where(den > 0, num / den, torch.zeros_like(den))
        if self.average == "binary":
            f = f[1]
        elif self.average == "macro":
            f = _mean_present(f, den)
        return self._nan_if_outside(f)


class F1Score(FBeta):
    """F1 score: `FBeta` with beta=1.

    Examples:
        >>> F1Score(average="micro").name
        'f1_score'
    """

    def __init__(
        self,
        average: str = "macro",
        num_classes: int | None = None,
        class_dim: int | None = None,
        ignore_index: int | None = None,
        from_logits: bool | None = None,
        threshold: float = 0.5,
    ) -> None:
        super().__init__(
            1.0, average, num_classes, class_dim, ignore_index, from_logits, threshold
        )


class Dice(F1Score):
    """The Dice coefficient of a segmentation, 2·TP / (2·TP + FP + FN) per
    class over the whole set: the F1 score of its pixels (same arguments),
    averaged over the classes seen in targets or predictions.

    Examples:
        >>> Dice(class_dim=1, ignore_index=255).name
        'dice'
    """

    name = "dice"


class MeanIoU(_ConfusionMetric):
    """Mean intersection over union, TP / (TP + FP + FN) per class over the
    whole set, averaged over the classes seen in targets or predictions, as
    torchmetrics' ``MulticlassJaccardIndex`` (macro) does.

    Args:
        num_classes: defaults to the output's class dim.
        class_dim: as for ``Accuracy`` (a segmentation's ``(B, C, H, W)``
            output is found channels first).
        ignore_index: as for ``Accuracy``. Targets equal to ``ignore_index``
            are not counted, and when it is a class (0, the background), that
            class is left out of the mean even where the model predicts it;
            its predictions elsewhere still count against the true class.
        from_logits: as for ``Accuracy`` (one score per pixel).
        threshold: as for ``Accuracy`` (one score per pixel).

    Examples:
        >>> m = MeanIoU()
        >>> m.update(torch.tensor([[0.0, 1.0], [0.0, 1.0]]), torch.tensor([1, 0]))
        >>> m.compute()  # class 0: 0/1, class 1: 1/2
        tensor(0.2500, dtype=torch.float64)
    """

    name = "mean_iou"

    def compute(self) -> Tensor:
        tp, fp, fn = self._counts()
        den = tp + fp + fn
        iou = torch.where(den > 0, tp / den, torch.zeros_like(den))
        if self.ignore_index is not None and 0 <= self.ignore_index < self.n_cls:
            den = den.clone()
            den[self.ignore_index] = 0  # not a class the mean counts
        return self._nan_if_outside(_mean_present(iou, den))


class Perplexity(ClassMetric):
    """exp(mean cross-entropy per token) over the whole set, padding
    (``ignore_index``, -100 by default) left out. The output holds the
    logits (class dim found as for ``Accuracy``, or ``class_dim``).

    Examples:
        >>> m = Perplexity()
        >>> m.update(torch.zeros(1, 3, 4), torch.tensor([[0, 1, -100]]))
        >>> m.compute()  # uniform over 4 tokens
        tensor(4., dtype=torch.float64)
    """

    name = "perplexity"
    reads_binary = False

    def __init__(self, class_dim: int | None = None, ignore_index: int = -100) -> None:
        if ignore_index is None:
            raise TypeError(
                "Perplexity: ignore_index must be an int; got None. Fix: e.g. "
                "Perplexity(ignore_index=-100) (a value no target has)."
            )
        super().__init__(class_dim, ignore_index)

    def reset(self) -> None:
        self.total: Tensor | None = None  # summed cross-entropy, on the device
        self.count: Tensor | None = None  # tokens counted

    def update(self, output: Tensor, *targets: Tensor) -> None:
        logits, t = class_rows(
            output, targets[0], self.name, self.class_dim, type(self).__name__
        )
        dtype = accumulation_dtype(output.device)
        nll = F.cross_entropy(
            logits.to(dtype), t, ignore_index=self.ignore_index, reduction="sum"
        )
        count = (t != self.ignore_index).sum().to(dtype)
        self.total = nll if self.total is None else self.total + nll
        self.count = count if self.count is None else self.count + count

    def compute(self) -> Tensor:
        if self.total is None:
            raise self._no_data()
        return torch.exp(self.total / self.count)

    def sums(self) -> list[Tensor]:
        if self.total is None:
            return [torch.zeros(2, dtype=torch.float64)]
        return [torch.stack([self.total, self.count])]

    def load_sums(self, sums: list[Tensor]) -> None:
        self.total, self.count = sums[0].unbind()
