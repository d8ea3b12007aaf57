"""F-scores from a confusion matrix accumulated over the whole set."""

import math

import torch
from torch import Tensor

from fitlib.checks import check_int, check_number
from fitlib.metrics.accumulate import Metric, accumulation_dtype
from fitlib.metrics.functions import _match, _pred_classes, check_class_targets


class FBeta(Metric):
    """F-beta score from a confusion matrix accumulated over the whole set.

    Args:
        beta: weight of recall against precision; > 0.
        average: "binary" (F of class 1; one logit per sample, positive when
            > 0, or two class columns), "macro" or "micro".
        num_classes: defaults to the output's last dim (2 for one logit).

    Like scikit-learn's defaults, macro averages the classes seen in targets
    or predictions, and an undefined precision or recall counts as 0.
    Targets outside [0, num_classes) cannot be checked without a sync, so
    they are counted aside and make `compute()` return nan.

    Example:
        >>> m = FBeta(beta=2.0, average="binary")
        >>> m.update(torch.tensor([2.0, -1.0, 3.0]), torch.tensor([1, 1, 0]))
        >>> m.name, m.compute()
        ('f2_score', tensor(0.5000, dtype=torch.float64))
    """

    AVERAGES = ("binary", "macro", "micro")

    def __init__(
        self, beta: float = 1.0, average: str = "macro", num_classes: int | None = None
    ) -> None:
        owner = type(self).__name__
        check_number(beta, "beta", above=0, owner=owner, example=1.0)
        if average not in self.AVERAGES:
            raise ValueError(
                f"average must be one of {self.AVERAGES}, got {average!r}. "
                'Fix: average="macro".'
            )
        check_int(
            num_classes, "num_classes", minimum=2, owner=owner, example="None",
            allow_none=True,
        )  # fmt: skip
        self.beta, self.average, self.num_classes = float(beta), average, num_classes
        self.name = f"f{beta:g}_score"
        super().__init__()

    def reset(self) -> None:
        # Flat C*C counts plus one trailing slot for out-of-range targets.
        self.cm: Tensor | None = None
        self.n_cls = 0

    def check_inputs(self, output: Tensor, *targets: Tensor) -> None:
        check_class_targets(self.name, output, *targets)

    def update(self, output: Tensor, *targets: Tensor) -> None:
        pred, c = _pred_classes(output)
        if self.cm is None:
            self._start(c, output.device)
        if c != self.n_cls:
            raise ValueError(
                f"{self.name}: output has {c} classes, but num_classes or earlier "
                f"batches gave {self.n_cls}. Fix: num_classes = the model's outputs."
            )
        y = targets[0]
        pred = _match(pred, y, self.name).reshape(-1)
        t = y.reshape(-1).long()
        valid = (t >= 0) & (t < self.n_cls)
        if y.is_floating_point():  # 0.5 must not silently truncate to class 0
            valid &= t == y.reshape(-1)
        idx = torch.where(valid, t * self.n_cls + pred, self.n_cls**2)
        self.cm.index_add_(0, idx, torch.ones_like(idx))

    def _start(self, c: int, device: torch.device) -> None:
        self.n_cls = self.num_classes or c
        if self.average == "binary" and self.n_cls != 2:
            raise ValueError(
                f'{self.name}: average="binary" needs 2 classes, got {self.n_cls}. '
                'Fix: average="macro" or "micro".'
            )
        self.cm = torch.zeros(self.n_cls**2 + 1, dtype=torch.long, device=device)

    def compute(self) -> Tensor:
        if self.cm is None:
            raise self._no_data()
        c = self.n_cls
        cm = self.cm[:-1].view(c, c).to(accumulation_dtype(self.cm.device))
        tp = cm.diagonal()
        fp, fn = cm.sum(0) - tp, cm.sum(1) - tp  # rows are targets, columns preds
        if self.average == "micro":
            tp, fp, fn = tp.sum(), fp.sum(), fn.sum()
        b2 = self.beta**2
        num = (1 + b2) * tp
        den = num + b2 * fn + fp
        f = torch.where(den > 0, num / den, torch.zeros_like(den))
        if self.average == "binary":
            f = f[1]
        elif self.average == "macro":
            present = den > 0
            f = (f * present).sum() / present.sum().clamp(min=1)
        return torch.where(self.cm[-1] > 0, torch.full_like(f, math.nan), f)

    def sums(self) -> list[Tensor]:
        # The count vector's length comes from the first batch: a process
        # without one cannot take part (distributed training gives each
        # process at least one batch).
        if self.cm is None:
            raise self._no_local_data()
        return [self.cm]

    def load_sums(self, sums: list[Tensor]) -> None:
        self.cm = sums[0].to(torch.long)  # whole counts: exact in float


class F1Score(FBeta):
    """F1 score: `FBeta` with beta=1.

    Example:
        >>> F1Score(average="micro").name
        'f1_score'
    """

    def __init__(self, average: str = "macro", num_classes: int | None = None) -> None:
        super().__init__(1.0, average, num_classes)
