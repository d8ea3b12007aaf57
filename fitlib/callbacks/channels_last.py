"""``ChannelsLast``: trains in the channels-last memory format."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fitlib.callback import Callback
from fitlib.errors import describe
from fitlib.structure import map_tensors, tensors


class ChannelsLast(Callback):
    """Puts the model's 4-D weights and every 4-D input in channels-last order.

    Convolutions on GPUs (tensor cores, with mixed precision) and on many
    CPUs run faster on NHWC data than on the default NCHW; the values are
    the same up to floating-point rounding (tested). The model is converted
    as training begins (``model.to(memory_format=torch.channels_last)``), and
    each batch's 4-D input tensors (images ``(B, C, H, W)``, in a tuple or
    dict too) before any other hook sees them; other inputs pass unchanged.
    A Learner's ``validate``, ``get_preds`` and ``predict`` run it too
    (``in_evaluation``), so their inputs are converted as the fit's are;
    the model's weights stay channels-last after them (a layout, not a value:
    the one change an evaluation leaves, see ARCHITECTURE.md).

    A model without 4-D weights (no convolution) or a first batch without a
    4-D input is refused, with the shapes it found: there, channels-last
    would change nothing.

    Examples:
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> convnet = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(),
        ...                         nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        ...                         nn.Linear(8, 3))
        >>> images = TensorDataset(torch.randn(32, 3, 8, 8), torch.randint(0, 3, (32,)))
        >>> learn = Learner(DataBunch(DataLoader(images, 16)), convnet,
        ...                 F.cross_entropy, progress=False)
        >>> learn = learn.to_channels_last()  # adds ChannelsLast to every fit
        >>> learn.fit(1, lr=1e-3)
        History(1 epoch: train_loss ...)
        >>> convnet[0].weight.is_contiguous(memory_format=torch.channels_last)
        True

        A model without convolutions gains nothing, and is refused:

        >>> fit(1, model, F.cross_entropy, opt, data, callbacks=[ChannelsLast()])
        Traceback (most recent call last):
        ...
        ValueError: ChannelsLast: the model has no 4-D weights (convolutions), only
        shapes [(3,), (16,), (16, 8), (3, 16)]: channels-last would change
        nothing. Fix: leave ChannelsLast (to_channels_last) out for this model.
        fitlib: raised in callback ChannelsLast.on_train_begin
    """

    # Before DistributedTrainer (-200): DDP's gradient buckets are laid out
    # for the weights' strides as it wraps the model. First to touch the batch,
    # too: every later hook sees it converted.
    order = -210
    in_evaluation = True  # validate, get_preds, predict: so are their inputs

    def __init__(self) -> None:
        self._checked = False

    def on_train_begin(self, model: nn.Module) -> None:
        """Runs before training: converts the model's 4-D weights."""
        check_convolutional(model)
        model.to(memory_format=torch.channels_last)
        self._checked = False

    def on_batch_begin(self, last_input: Any) -> dict:
        """Runs before each batch: 4-D inputs to channels-last."""
        if not self._checked:
            self._check(last_input)
        return {"last_input": map_tensors(_channels_last, last_input)}

    def _check(self, xb: Any) -> None:
        if not any(t.dim() == 4 for _, t in tensors(xb)):
            raise ValueError(
                f"ChannelsLast: the batch's inputs are {describe(xb)}; none is 4-D "
                "(B, C, H, W), so none can be put in channels-last order (3-D "
                "sequences and 2-D features have no such layout). Fix: leave "
                "ChannelsLast (to_channels_last) out for this data."
            )
        self._checked = True


def check_convolutional(model: nn.Module) -> None:
    """A ValueError unless ``model`` has 4-D weights (2-D convolutions)."""
    if not any(p.dim() == 4 for p in model.parameters()):
        shapes = sorted({tuple(p.shape) for p in model.parameters()}, key=len)
        raise ValueError(
            f"ChannelsLast: the model has no 4-D weights (convolutions), only "
            f"shapes {shapes[:5]}: channels-last would change nothing. Fix: "
            "leave ChannelsLast (to_channels_last) out for this model."
        )


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t
