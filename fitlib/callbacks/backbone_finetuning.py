"""``BackboneFinetuning``: a backbone frozen for the first epochs, then
unfrozen with its learning rate ramped up to the rest's.

Lightning's ``BackboneFinetuning`` in fitlib's terms. The backbone is the
optimizer's first parameter groups (a ``Learner``'s first layer groups; with
several optimizers, counted over every part's groups in order). Its
parameters stay in the optimizer all along: freezing sets ``requires_grad``
to False (and drops their gradients), so torch's optimizers, fitlib's
decoupled weight decay and momentum all skip them, and a frozen parameter
keeps its value bit for bit. The ramp is a factor on the backbone groups'
learning rate (``HPOptimizer.scale``), so it multiplies what a schedule
(``fit_one_cycle``) or ``ReduceLROnPlateau`` sets, as their factors compose,
and a checkpoint keeps it in the parameter groups.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fitlib.callback import Callback, inner_callback
from fitlib.checks import check_flag, check_int, check_number

# The layers whose parameters stay trainable in a frozen group with
# ``train_bn=True`` (``Learner.freeze_to`` and this callback).
NORM_TYPES = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.GroupNorm,
    nn.LayerNorm,
    nn.LocalResponseNorm,
)


def set_trainable(
    params: Iterable[torch.Tensor], trainable: bool, model: nn.Module, train_bn: bool
) -> None:
    """Sets ``requires_grad`` of ``params`` to ``trainable``; when freezing,
    the parameters of ``model``'s normalization layers stay trainable if
    ``train_bn``, and a frozen parameter's gradient is dropped (an optimizer
    then skips it: no step, no weight decay, no momentum).

    Examples:
        >>> from fitlib.callbacks.backbone_finetuning import set_trainable
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        >>> set_trainable(net.parameters(), False, net, train_bn=True)
        >>> [p.requires_grad for p in net.parameters()]
        [False, False, True, True]
    """
    norm = {id(p) for m in model.modules() if isinstance(m, NORM_TYPES)
            for p in m.parameters(recurse=False)} if train_bn else set()  # fmt: skip
    for p in params:
        keep = trainable or id(p) in norm
        p.requires_grad_(keep)
        if not keep:
            p.grad = None


class BackboneFinetuning(Callback):
    """Freezes the backbone until epoch ``unfreeze_at_epoch``, then trains it
    at a learning rate that starts at ``initial_ratio`` of its own and grows
    by ``multiplier`` each epoch.

    At epoch ``unfreeze_at_epoch`` (0-based, counted in each fit) the
    backbone's rate is ``initial_ratio`` times the rate the fit gives it (the
    head's, when one lr trains every group), then ``multiplier`` times more
    each epoch: ``initial_ratio * multiplier ** (epoch - unfreeze_at_epoch)``,
    no more than 1 with ``align`` (the backbone then trains at the rate the
    fit gives it). Before that epoch the backbone is frozen: its parameters
    do not move at all, except those of normalization layers with
    ``train_bn`` (which train at the backbone's rate, as after
    ``Learner.freeze``; their running statistics update in either case). The
    factor multiplies what a schedule sets, so it composes with
    ``fit_one_cycle`` and ``ReduceLROnPlateau``; the Recorder's ``lr`` is the
    head's. When the fit ends the backbone stays as its last epoch left it.

    Refused before training: a fit whose optimizer has no group left for the
    head, a fit too short to reach ``unfreeze_at_epoch``, and a second
    ``BackboneFinetuning`` in one fit (``Learner.fine_tune`` holds one).

    Args:
        unfreeze_at_epoch: the epoch whose start unfreezes the backbone (0:
            trainable from the start, only ramped).
        initial_ratio: the backbone's rate at that epoch, as a fraction of the
            rate the fit gives it (Lightning's ``backbone_initial_ratio_lr``).
        multiplier: the factor of each later epoch (Lightning's
            ``lambda_func``, as a constant).
        align: cap the ratio at 1 (Lightning's ``should_align``).
        backbone_groups: how many of the optimizer's first parameter groups
            are the backbone; None: every group but the last.
        train_bn: keep normalization layers trainable while frozen.

    Examples:
        >>> body, head = nn.Sequential(nn.Linear(8, 16), nn.ReLU()), nn.Linear(16, 3)
        >>> learn = Learner(data, nn.Sequential(body, head), F.cross_entropy,
        ...                 layer_groups=[body, head], progress=False)
        >>> ramp = BackboneFinetuning(unfreeze_at_epoch=1, initial_ratio=0.1,
        ...                           multiplier=2.0)
        >>> learn.fit(3, lr=1e-2, callbacks=[ramp])
        History(3 epochs: train_loss ... -> ..., valid_loss ... -> ...,
                accuracy ... -> ...)
        >>> learn.opt.lr  # epoch 2: the backbone at 0.1 * 2 of the head's rate
        [0.002, 0.01]
    """

    order = 5  # after Checkpoint restored the position; before the schedulers
    in_lr_find = False  # a sweep trains every layer it is given

    def __init__(
        self,
        unfreeze_at_epoch: int = 10,
        initial_ratio: float = 0.1,
        multiplier: float = 1.5,
        align: bool = True,
        backbone_groups: int | None = None,
        train_bn: bool = True,
    ) -> None:
        owner = self.name
        self.unfreeze_at_epoch = check_int(
            unfreeze_at_epoch, "unfreeze_at_epoch", minimum=0, owner=owner, example=1
        )
        self.initial_ratio = check_number(
            initial_ratio, "initial_ratio", above=0, owner=owner, example=0.1
        )
        self.multiplier = check_number(
            multiplier, "multiplier", above=0, owner=owner, example=1.5
        )
        self.align = check_flag(align, "align", owner)
        self.backbone_groups = check_int(
            backbone_groups, "backbone_groups", minimum=1, owner=owner, example=2,
            allow_none=True,
        )  # fmt: skip
        self.train_bn = check_flag(train_bn, "train_bn", owner)
        self.factor = 1.0  # the factor applied to the backbone's lr (scale)
        self._groups: list[int] = []

    def ratio(self, epoch: int) -> float:
        """The backbone's lr factor in ``epoch`` (1 while frozen).

        Examples:
            >>> ramp = BackboneFinetuning(2, initial_ratio=0.1, multiplier=4.0)
            >>> [ramp.ratio(e) for e in range(5)]
            [1.0, 1.0, 0.1, 0.4, 1.0]
        """
        if epoch < self.unfreeze_at_epoch:
            return 1.0
        ratio = self.initial_ratio * self.multiplier ** (epoch - self.unfreeze_at_epoch)
        return min(ratio, 1.0) if self.align else ratio

    def on_train_begin(
        self,
        opt: Any,
        model: nn.Module,
        n_epochs: int | None,
        epoch: int,
        iteration: int,
        callbacks: list,
    ) -> None:
        """Runs before training: checks the fit, finds the backbone's groups
        and freezes them (a resumed fit: as its epoch has them)."""
        self._check_alone(callbacks)
        self._groups = self._backbone(opt)
        if n_epochs is not None and n_epochs <= self.unfreeze_at_epoch:
            raise ValueError(
                f"{self.name}: unfreeze_at_epoch={self.unfreeze_at_epoch}, but the "
                f"fit has {n_epochs} epoch(s) (0 to {n_epochs - 1}): the backbone "
                f"would stay frozen throughout. Fix: train for more epochs, or "
                f"e.g. {self.name}(unfreeze_at_epoch={max(n_epochs - 1, 0)})."
            )
        if iteration == 0:  # fit reset the lr factors; a resumed fit keeps its own
            self.factor = 1.0
        self._freeze(opt, model, frozen=epoch < self.unfreeze_at_epoch)

    def on_epoch_begin(self, opt: Any, model: nn.Module, epoch: int) -> None:
        """Runs at each epoch's start: unfreezes at ``unfreeze_at_epoch`` and
        sets the backbone's lr factor for the epoch."""
        if epoch == self.unfreeze_at_epoch:
            self._freeze(opt, model, frozen=False)
        target = self.ratio(epoch)
        if target != self.factor:
            n = len(opt.param_groups)
            step = target / self.factor
            opt.scale("lr", [step if i in self._groups else 1.0 for i in range(n)])
            self.factor = target

    def _freeze(self, opt: Any, model: nn.Module, frozen: bool) -> None:
        params = [p for i in self._groups for p in opt.param_groups[i]["params"]]
        set_trainable(params, not frozen, model, self.train_bn)

    def _backbone(self, opt: Any) -> list[int]:
        n = len(opt.param_groups)
        count = n - 1 if self.backbone_groups is None else self.backbone_groups
        if not 1 <= count < n:
            got = (
                "backbone_groups=None (all but the last)"
                if (self.backbone_groups is None)
                else f"backbone_groups={self.backbone_groups}"
            )
            raise ValueError(
                f"{self.name}: {got}, but the optimizer has {n} parameter "
                f"group(s): the backbone is its first groups and at least the "
                "last one (the head) must stay. Fix: give the model layer groups, "
                "e.g. Learner(..., layer_groups=[body, head]), or a "
                f"backbone_groups below {n}."
            )
        return list(range(count))

    def _check_alone(self, callbacks: list) -> None:
        others = [cb for cb in callbacks if cb is not self
                  and isinstance(inner_callback(cb), BackboneFinetuning)]  # fmt: skip
        if others:
            raise ValueError(
                f"{self.name}: the fit has another BackboneFinetuning "
                f"({others[0]!r}); both would freeze the backbone and scale its "
                "lr. Fix: keep one (Learner.fine_tune adds its own: pass no "
                "BackboneFinetuning to it)."
            )

    def state_dict(self) -> dict:
        """The lr factor applied to the backbone (the optimizer's groups keep
        it too)."""
        return {"factor": self.factor}

    def load_state_dict(self, state: dict) -> None:
        """Restores what ``state_dict`` returned."""
        self.factor = float(state["factor"])

    def __repr__(self) -> str:
        return (
            f"{self.name}(unfreeze_at_epoch={self.unfreeze_at_epoch}, "
            f"initial_ratio={self.initial_ratio}, multiplier={self.multiplier}, "
            f"align={self.align}, backbone_groups={self.backbone_groups}, "
            f"train_bn={self.train_bn})"
        )
