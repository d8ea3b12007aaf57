"""``ModelSummary``: the model's summary, shown as a fit begins."""

from __future__ import annotations

from typing import Any

from torch import nn

from fitlib.callback import Callback
from fitlib.checks import check_int
from fitlib.summary import Summary, summarize


class ModelSummary(Callback):
    """Shows the summary of the fit's model as the first fit it is part of
    begins: layers with output shapes, parameter counts, the optimizer's
    hyper-parameters per group, the callbacks in order, the precision (see
    ``fitlib.summary.summarize``). Text in a terminal or a log, a table in a
    notebook; on rank 0 alone under torch.distributed.

    It changes nothing in training: its one forward pass runs on the first
    training batch in eval mode, without gradients, and puts back every
    state it touched (random generators, buffers, modes), so a fit with it
    equals one without, bit for bit. It runs first of all (order -250), on the
    model as given, before ``DistributedTrainer`` wraps or shards it. Later
    fits with the same callback show nothing; a resumed run (a new process,
    a new callback) shows it again. ``summary`` keeps the last one built.

    Args:
        depth: None shows every leaf module; ``k`` the modules ``k`` levels
            down (``depth=1``: the model's children).

    Examples:
        >>> history = fit(1, model, F.cross_entropy, opt, data,
        ...               callbacks=[ModelSummary()])
        Sequential: input [16, 8] (the first training batch), output [16, 3]
        layer  type    output shape  params  trainable
        ...
        Parameters: 195 total, 195 trainable, 0 frozen (780 B)
        ...
        Callbacks, in the order they run:
        order  callback
        -----  ------------
         -250  ModelSummary
        <BLANKLINE>
        Precision: fp32 (weights float32)
    """

    order = -250  # before DistributedTrainer (-200): the model as given
    main_only = True  # printing: rank 0 alone
    in_lr_find = False  # a sweep is no fit to describe

    def __init__(self, depth: int | None = None) -> None:
        self.depth = check_int(depth, "depth", minimum=0, owner="ModelSummary",
                               example=1, allow_none=True)  # fmt: skip
        self.summary: Summary | None = None

    def on_train_begin(
        self, model: nn.Module, data: Any, opt: Any, callbacks: list
    ) -> None:
        """Runs before training: builds and shows the summary, at the first fit."""
        if self.summary is not None:
            return
        self.summary = summarize(model, data, opt, callbacks, depth=self.depth)
        self.summary.show()

    def __repr__(self) -> str:
        return self.name if self.depth is None else f"{self.name}(depth={self.depth})"
