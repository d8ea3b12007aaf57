"""Several outputs, one loss each: ``LossDict`` weighs and sums them, and
returns each as a part of the loss, so the record shows every output's loss
(``train_<name>``, ``valid_<name>``) without a combining function of yours.
``as_loss`` is what ``fit(loss_func={...})`` and ``Learner(loss_func={...},
loss_weights={...})`` make of their arguments.

Examples:
    >>> from fitlib.losses import LossDict
    >>> loss = LossDict({"a": F.mse_loss, "b": F.l1_loss}, weights={"b": 0.5})
    >>> out = {"a": torch.zeros(4, 1), "b": torch.ones(4, 1)}
    >>> loss(out, {"a": torch.ones(4, 1), "b": torch.ones(4, 1)})
    {'loss': tensor(1.), 'a': tensor(1.), 'b': tensor(0.)}
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fitlib.errors import (
    ArgTypeError,
    describe,
    did_you_mean,
    is_number,
    name_of,
    unknown_name,
)
from fitlib.loss_checks import loss_check

Loss = Callable[..., torch.Tensor]


class _PartError(ValueError):
    """A named output or target that is not there. Its own type, so that the
    loop keeps this message first and adds what it called the loss with."""


class LossDict:
    """One loss per output of a model, weighted and summed: Keras's
    ``loss={"a": ..., "b": ...}, loss_weights={...}``.

    Called as ``loss(output, *targets)``, as ``fit`` calls every loss, it
    returns ``{"loss": weighted sum, name: part, ...}``: ``fit`` trains on
    the sum and averages each part over the epoch, so the record has
    ``train_<name>`` and ``valid_<name>`` for every output (``part_names``
    declares them, so a monitor may name one before training). The parts
    are the losses as computed, unweighted; the weights scale only the sum.

    The outputs are read by name from a dict, a dataclass or a named tuple
    (the model's ``forward`` returns it), or by position, in the losses'
    order, from a plain tuple or list (one loss may take a bare tensor).
    The targets: one dict, dataclass or named tuple with the same names
    (batches ``(x, {"a": y_a, "b": y_b})``), or one target per loss in that
    order (batches ``(x, (y_a, y_b))``). A name that is not there is a
    ValueError at the first batch, naming the names that are. The first
    call also runs each part through the checks a single loss gets on the
    first batch (float class indices for cross-entropy, shapes that
    broadcast). Each batch weighs by its samples in the epoch's means (a
    token count, as ``masked_cross_entropy``'s, is not read through it).

    Args:
        losses: a dict name -> loss function (``loss(output_part,
            target_part)``), or a list of losses for a tuple output (their
            parts are named ``output_0``, ``output_1``, ...).
        weights: a dict name -> number >= 0 (names left out weigh 1), or a
            list with one number per loss of a list; None: all 1.

    Examples:
        >>> loss = LossDict({"value": F.mse_loss, "label": F.cross_entropy},
        ...                 weights={"value": 0.5})
        >>> loss
        LossDict({'value': mse_loss, 'label': cross_entropy}, weights={'value': 0.5})
        >>> loss.part_names
        ('value', 'label')
    """

    def __init__(
        self, losses: Mapping[str, Loss] | Sequence[Loss], weights: Any = None
    ) -> None:
        self.losses: dict[str, Loss] = _checked_losses(losses)
        self.by_name = isinstance(losses, Mapping)
        self.weights: dict[str, float] = _checked_weights(
            weights, list(self.losses), self.by_name
        )
        self.part_names: tuple[str, ...] = tuple(self.losses)
        self._checked = False  # the first call checks each part's inputs

    def __call__(self, output: Any, *targets: Any) -> dict[str, torch.Tensor]:
        """``{"loss": weighted sum, name: part, ...}`` for one batch."""
        outs = self._outputs(output)
        ys = self._targets(targets)
        parts = {}
        for (name, func), out, y in zip(self.losses.items(), outs, ys, strict=True):
            if self._checked:
                parts[name] = func(out, y)
            else:
                with loss_check(func, out, (y,)):
                    parts[name] = func(out, y)
        self._checked = True
        total = None
        for name, part in parts.items():
            weight = self.weights.get(name, 1.0)
            term = part if weight == 1.0 else part * weight
            total = term if total is None else total + term
        return {"loss": total, **parts}

    def _outputs(self, output: Any) -> list[Any]:
        named = _named(output)
        if named is not None and self.by_name:
            what = "the model's output"
            return [self._find(named, name, what) for name in self.losses]
        if named is not None:  # losses in a list: the parts in their order
            return self._count(list(named.values()), "outputs", "the model returned")
        if isinstance(output, (tuple, list)):
            return self._count(list(output), "outputs", "the model returned")
        if len(self.losses) == 1:
            return [output]
        raise _PartError(
            f"LossDict: the model returned one output, {describe(output)}, for "
            f"{len(self.losses)} losses ({', '.join(self.losses)}). Fix: return "
            "one output per loss from forward, a dict with their names or a "
            "tuple in their order."
        )

    def _targets(self, targets: tuple) -> list[Any]:
        named = _named(targets[0]) if len(targets) == 1 else None
        if named is not None and self.by_name:
            return [self._find(named, name, "the targets") for name in self.losses]
        return self._count(list(targets), "targets", "the batch holds")

    def _find(self, named: dict, name: str, what: str) -> Any:
        if name in named:
            return named[name]
        has, theirs = (
            ("has", "its") if what == "the model's output" else ("have", "their")
        )
        raise _PartError(
            f"LossDict: {what} {has} no part {name!r}"
            f"{did_you_mean(name, [str(k) for k in named])}; {theirs} parts are "
            f"{list(named)}. Fix: name the losses as the model's output and the "
            "targets name their parts (or return them in the losses' order)."
        )

    def _count(self, values: list, what: str, where: str) -> list:
        if len(values) != len(self.losses):
            one = what[:-1] if len(values) == 1 else what
            raise _PartError(
                f"LossDict: {len(self.losses)} losses ({', '.join(self.losses)}) "
                f"but {where} {len(values)} {one}: {describe(tuple(values))}. "
                f"Fix: one {what[:-1]} per loss, in the losses' order, or a dict "
                "by name."
            )
        return values

    def __repr__(self) -> str:
        inner = ", ".join(f"{k!r}: {name_of(f)}" for k, f in self.losses.items())
        shown = f"{{{inner}}}" if self.by_name else f"[{inner}]"
        weights = f", weights={self.weights}" if self.weights else ""
        return f"LossDict({shown}{weights})"


def as_loss(loss_func: Any, loss_weights: Any = None) -> Any:
    """What ``fit`` and ``Learner`` train on, given ``loss_func`` and
    ``loss_weights``: a dict or list of losses becomes a ``LossDict`` (with
    the weights); anything else is returned as it is, and weights with it are
    refused (one loss has nothing to weigh).

    Examples:
        >>> from fitlib.losses import as_loss
        >>> as_loss({"a": F.mse_loss, "b": F.l1_loss}, {"b": 2})
        LossDict({'a': mse_loss, 'b': l1_loss}, weights={'b': 2.0})
        >>> as_loss(F.cross_entropy) is F.cross_entropy
        True
    """
    if isinstance(loss_func, (Mapping, list, tuple)):
        return LossDict(loss_func, loss_weights)
    if loss_weights is None:
        return loss_func
    if isinstance(loss_func, LossDict):
        fix = "give the weights to it: LossDict(..., weights=...)"
    else:
        fix = (
            'pass the losses by name, loss_func={"a": loss_a, "b": loss_b}, '
            'with loss_weights={"a": 1.0, "b": 0.5}'
        )
    raise TypeError(
        f"loss_weights={loss_weights!r} needs several losses to weigh, but "
        f"loss_func is {name_of(loss_func)}. Fix: {fix}."
    )


def _named(x: Any) -> dict | None:
    """The parts of a dict, dataclass or named tuple by name; None otherwise."""
    if isinstance(x, Mapping):
        return dict(x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return dict(zip(x._fields, x, strict=True))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
    return None


def _checked_losses(losses: Any) -> dict[str, Loss]:
    if isinstance(losses, Mapping):
        items = list(losses.items())
    elif isinstance(losses, (list, tuple)):
        items = [(f"output_{i}", f) for i, f in enumerate(losses)]
    else:
        raise TypeError(
            f"LossDict: losses must be a dict name -> loss (or a list of losses "
            f"for a tuple output); got {losses!r}. Fix: e.g. LossDict({{'value': "
            "F.mse_loss, 'label': F.cross_entropy}})."
        )
    if not items:
        raise ValueError(
            "LossDict: got no losses; it needs at least one loss. Fix: e.g. "
            "LossDict({'value': F.mse_loss})."
        )
    for name, func in items:
        if not isinstance(name, str) or not name:
            raise TypeError(
                f"LossDict: names must be non-empty str (they name the record's "
                f"train_<name> and valid_<name>); got {name!r}. Fix: e.g. 'value'."
            )
        if name == "loss":
            raise ValueError(
                "LossDict: a loss named 'loss': 'loss' is the total, what fit "
                "trains on. Fix: name the part after its output, e.g. 'value'."
            )
        if not callable(func):
            raise TypeError(
                f"LossDict: the loss of {name!r} is {func!r}, not callable. Fix: "
                "a function loss(output_part, target_part), e.g. F.mse_loss."
            )
    return dict(items)


def _checked_weights(weights: Any, names: list[str], by_name: bool) -> dict:
    if weights is None:
        return {}
    if by_name and not isinstance(weights, Mapping):
        raise TypeError(
            f"LossDict: weights must be a dict name -> number for losses by "
            f"name; got {weights!r}. Fix: e.g. weights={{{names[0]!r}: 0.5}}."
        )
    if not by_name:
        if isinstance(weights, Mapping) or not isinstance(weights, (list, tuple)):
            raise TypeError(
                f"LossDict: weights must be a list, one number per loss of the "
                f"list; got {weights!r}. Fix: e.g. weights={[1.0] * len(names)}."
            )
        if len(weights) != len(names):
            raise ValueError(
                f"LossDict: {len(weights)} weights for {len(names)} losses; "
                f"got weights={list(weights)}. Fix: one number per loss."
            )
        weights = dict(zip(names, weights, strict=True))
    checked = {}
    for name, w in weights.items():
        if name not in names:
            fix = "weigh the losses by their names; a loss left out weighs 1."
            raise ValueError(
                unknown_name("LossDict: weights", "loss", name, names, fix)
            )
        if not is_number(w) or math.isnan(w) or w < 0:
            kind = ValueError if is_number(w) else ArgTypeError
            raise kind(
                f"LossDict: weights[{name!r}] must be a number >= 0; got {w!r} "
                f"({type(w).__name__}). Fix: e.g. weights={{{name!r}: 0.5}}."
            )
        checked[name] = float(w)
    return checked
