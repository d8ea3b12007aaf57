"""``MixUp``: trains on convex combinations of pairs of samples.

Each training batch is mixed with itself rolled by one sample
(``x.roll(1, 0)``: every sample gets a partner, an odd last batch too) with
one weight per batch, ``lam`` drawn from Beta(alpha, alpha) and folded to
``lam >= 0.5``, so the unrolled sample weighs most. The loss is mixed on the
loss side, ``lam * loss(out, y) + (1 - lam) * loss(out, y.roll(1, 0))``,
which works for any loss; ``targets="soft"`` mixes the targets instead (class
indices as one-hot probabilities) for a loss that takes probabilities. The
draws come from a generator of the callback's own, on the model's device,
read on the host never; its state is in ``state_dict``, so a resumed fit
draws what an unbroken one drew. Validation batches are never mixed.

What the record says under mixing: ``train_loss`` and the training metrics
are those of the mixed inputs against the batch's own targets (the unrolled
samples', the larger part of each mix), as the loop computes them; the loss
that trains the model is the mixed one. So ``train_accuracy`` is how often
the model names the class that weighs most in each mixed input.
``valid_loss`` and the metrics are the plain ones.
"""

from __future__ import annotations

from typing import Any

import torch

from fitlib.callback import Callback
from fitlib.checks import check_int, check_number
from fitlib.data import model_device
from fitlib.errors import did_you_mean
from fitlib.mixing import (
    MixGenerator,
    call_loss,
    check_soft_loss,
    check_soft_targets,
    draw_lambda,
    mix_inputs,
    mixed_loss,
    mixed_tensors,
    soft_targets,
)
from fitlib.structure import tensors

_TARGETS = ("loss", "soft")


class MixUp(Callback):
    """MixUp (Zhang et al., 2018) on the training batches, exact on resume.

    Args:
        alpha: the Beta distribution's parameter (> 0): small values give
            weights near 1 (little mixing), 1 uniform weights.
        targets: ``"loss"`` (default) mixes the losses of the two targets,
            any loss; ``"soft"`` mixes the targets (class indices as one-hot
            probabilities over the output's dim 1, float targets as they are)
            and calls the loss once on them: for a loss that takes
            probabilities (``F.cross_entropy`` and ``nn.CrossEntropyLoss``
            do). Both give the same loss for those, label smoothing included
            (it is linear in the target): the smoothing is applied once, by
            the loss. Refused before training, with the fix
            ``targets="loss"``: a class-weighted one (``weight=``: another
            loss on probabilities), one with an ``ignore_index`` other than
            -100, and ``masked_cross_entropy`` (smoothed or not), which take
            class indices.
        stop_at_epoch: mixes in the epochs before this one (0-based), plain
            batches from it on; None (default) mixes in every epoch.
        seed: the seed of the callback's generator; None (default) derives
            it from ``torch.initial_seed()`` (what ``torch.manual_seed``
            set): the same draws at every run of a seeded script.

    Examples:
        >>> mixup = MixUp(alpha=0.4, stop_at_epoch=2)  # plain batches from epoch 2
        >>> fit(3, model, F.cross_entropy, opt, data, callbacks=[mixup])
        History(3 epochs: train_loss ... -> ..., valid_loss ... -> ...)
        >>> sorted(mixup.state_dict())  # the generator's: what a checkpoint keeps
        ['device', 'state']
    """

    # After Checkpoint (its save at a batch's start holds the draws to come),
    # before a loss term at -35 (added to the mixed loss, unweighted) and
    # before GradientAccumulation and MixedPrecision scale the loss.
    order = -36
    compiled_step_safe = True  # on_backward_begin reads nothing on the host
    _min_dims = 1  # the inputs it mixes: any floating-point tensor
    _default_alpha = 0.4  # (the example of alpha's error)

    def __init__(
        self,
        alpha: float = 0.4,
        *,
        targets: str = "loss",
        stop_at_epoch: int | None = None,
        seed: int | None = None,
    ) -> None:
        self.alpha = check_number(
            alpha, "alpha", above=0, owner=self.name, example=self._default_alpha
        )
        if targets not in _TARGETS:
            raise ValueError(
                f"{self.name}: targets must be 'loss' or 'soft'; got {targets!r}"
                f"{did_you_mean(targets, _TARGETS) if isinstance(targets, str) else ''}"
                f". Fix: e.g. {self.name}(targets='loss') (any loss) or "
                "targets='soft' (a loss that takes probabilities)."
            )
        self.targets = targets
        self.stop_at_epoch = check_int(
            stop_at_epoch, "stop_at_epoch", minimum=1, owner=self.name, example=5,
            allow_none=True,
        )  # fmt: skip
        self.seed = check_int(seed, "seed", owner=self.name, example=0, allow_none=True)
        self.generator = MixGenerator(self.seed)
        self.lam: torch.Tensor | None = None  # the last mixed batch's weight
        self._mixing = self._checked = False

    def __repr__(self) -> str:
        stop = (
            ""
            if self.stop_at_epoch is None
            else f", stop_at_epoch={self.stop_at_epoch}"
        )
        return f"{self.name}(alpha={self.alpha}, targets={self.targets!r}{stop})"

    def on_train_begin(
        self, model: Any, loss_func: Any, opt: Any, callbacks: list
    ) -> None:
        """Starts the generator on the model's device (a resumed fit: where
        the checkpoint left it); refuses a fit without a loss function, or
        with a second mixing callback, or (``targets="soft"``) with a loss
        the soft targets would change (``check_soft_loss``)."""
        if opt is None:  # an evaluation: nothing is mixed
            return
        others = [
            cb.name for cb in callbacks if isinstance(cb, MixUp) and cb is not self
        ]
        if others:
            raise ValueError(
                f"{self.name}: this fit has another mixing callback ({others[0]}); "
                "each would mix the batch and the loss the other mixed. Fix: "
                "keep one of them."
            )
        if loss_func is None:
            raise ValueError(
                f"{self.name} mixes the loss, and this fit has none: "
                "loss_func=None trains on the loss the model computes. Fix: "
                "pass the loss function, e.g. loss_func=F.cross_entropy."
            )
        if self.targets == "soft":
            check_soft_loss(loss_func, self.name)
        self.generator.start(model_device(model))
        self._mixing, self._checked = False, False

    def on_batch_begin(
        self, last_input: Any, last_target: Any, train: bool, epoch: int
    ) -> dict | None:
        """Mixes a training batch's inputs (before the forward pass)."""
        stopped = self.stop_at_epoch is not None and epoch >= self.stop_at_epoch
        self._mixing = train and not stopped
        if not self._mixing:
            return None
        if not self._checked:
            self._check_batch(last_input, last_target)
        self.lam, mixed = self.mix(last_input)
        return {"last_input": mixed}

    def _check_batch(self, x: Any, targets: Any) -> None:
        """Refuses a first batch it cannot mix (before the forward pass)."""
        mixed_tensors(x, self.name, self._min_dims)

    def mix(self, x: Any) -> tuple[torch.Tensor, Any]:
        """The batch's weight and its mixed inputs."""
        lam = draw_lambda(
            self.generator.concentration(self.alpha), self.generator.generator
        )
        return lam, mix_inputs(x, lam)

    def on_backward_begin(
        self,
        last_loss: torch.Tensor,
        last_output: Any,
        last_target: Any,
        loss_func: Any,
    ) -> dict | None:
        """The mixed loss, for ``backward()`` (the record keeps the loop's)."""
        if not self._mixing:
            return None
        if not self._checked:
            self._check_targets(last_output, last_target)
        if self.targets == "soft":
            soft = soft_targets(last_output, last_target, self.lam)
            return {"last_loss": call_loss(loss_func, last_output, soft)}
        loss = mixed_loss(loss_func, last_output, last_target, last_loss, self.lam)
        return {"last_loss": loss}

    def _check_targets(self, out: Any, targets: Any) -> None:
        self._checked = True
        if not any(True for _ in tensors(targets)):
            raise ValueError(
                f"{self.name} mixes the targets of two samples, and the batches "
                "have none (inputs only: loss_func(output)). Fix: batches of "
                f"(inputs, targets), or leave {self.name} out."
            )
        if self.targets == "soft":
            check_soft_targets(out, targets, self.name)

    def state_dict(self) -> dict:
        """The generator's state (plain values): the draws to come."""
        return self.generator.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restores the generator's state; applied as the fit begins."""
        self.generator.load_state_dict(state)
