"""Checks of what the loop is given, before training, and errors that say
what went wrong.

The arguments every public function and class checks (``check_int``,
``check_number``, ``check_flag``, ``check_path``, in one wording), and those
of ``fit``: the model, the optimizer and the loaders. The first batch's loss
inputs are checked in ``fitlib.loss_checks``; a model's failure is explained
in ``fitlib.model_errors``. A helper, not a callback: the bottom layer (it
imports torch and ``errors`` only).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from fitlib.errors import ArgTypeError, is_int, is_number


def len_or_none(dl: Any) -> int | None:
    """``len(dl)``, or None for an iterable without a length."""
    try:
        return len(dl)
    except TypeError:
        return None


# -- arguments -------------------------------------------------------------------
def check_int(
    value: Any,
    name: str,
    *,
    minimum: int = 0,
    owner: str | None = None,
    example: Any = None,
    allow_none: bool = False,
) -> int | None:
    """``value`` as an int if it is one ``>= minimum`` (None when
    ``allow_none``), else an error worded the one way every count is checked:
    ``"<owner>: <name> must be an int >= <minimum>; got <value> (<type>). Fix:
    e.g. <owner>(<name>=<example>)."``

    A bool, a float (even ``2.0``), a str or None (unless allowed) raise an
    ``ArgTypeError`` (a TypeError that is also a ValueError); a smaller int a
    ValueError. NumPy integers count as ints. ``example`` defaults to
    ``minimum``.

    Examples:
        >>> from fitlib.checks import check_int
        >>> check_int(4, "n_batches", minimum=1, owner="GradientAccumulation")
        4
        >>> check_int(0, "n_batches", minimum=1, owner="GradientAccumulation")
        Traceback (most recent call last):
        ...
        ValueError: GradientAccumulation: n_batches must be an int >= 1; got 0
        (int). Fix: e.g. GradientAccumulation(n_batches=1).
    """
    if value is None and allow_none:
        return None
    rule, example = f"an int >= {minimum}", minimum if example is None else example
    if not is_int(value):
        raise ArgTypeError(_refusal(name, rule, value, owner, example, allow_none))
    if value < minimum:
        raise ValueError(_refusal(name, rule, value, owner, example, allow_none))
    return int(value)


def check_number(
    value: Any,
    name: str,
    *,
    above: float | None = None,
    minimum: float | None = None,
    below: float | None = None,
    what: str = "a number",
    owner: str | None = None,
    example: Any,
    allow_none: bool = False,
) -> float | None:
    """``value`` as a float if it is a real number (not a bool, not NaN) in
    the range the bounds give: ``> above``, ``>= minimum``, ``< below``; else
    an error in the wording of ``check_int``, with ``what`` naming the kind of
    number (``"a fraction of training"``) and ``example`` the value the fix
    suggests. ``below=math.inf`` refuses infinity.

    Examples:
        >>> from fitlib.checks import check_number
        >>> check_number(0.3, "pct_start", above=0, below=1, example=0.3)
        0.3
    """
    if value is None and allow_none:
        return None
    rule = _range(what, above, minimum, below)
    if not is_number(value):
        raise ArgTypeError(_refusal(name, rule, value, owner, example, allow_none))
    inside = (
        not math.isnan(value)
        and (above is None or value > above)
        and (minimum is None or value >= minimum)
        and (below is None or value < below)
    )
    if not inside:
        raise ValueError(_refusal(name, rule, value, owner, example, allow_none))
    return float(value)


def check_flag(
    value: Any, name: str, owner: str | None = None, example: str | None = None
) -> bool:
    """``value`` as a bool if it is one (Python's or NumPy's), else an
    ``ArgTypeError`` in the wording of ``check_int``: ``"<owner>: <name> must
    be True or False; got <value> (<type>). Fix: e.g. <example>."``. A truthy
    string such as ``"no"``, or ``1``, would act as True: refused.
    ``example`` is the fix as code (default ``<owner>(<name>=True)``).

    Examples:
        >>> from fitlib.checks import check_flag
        >>> check_flag(False, "resume", "Checkpoint", "Checkpoint(dir, resume=False)")
        False
        >>> check_flag("no", "resume", "Checkpoint", "Checkpoint(dir, resume=False)")
        Traceback (most recent call last):
        ...
        fitlib.errors.ArgTypeError: Checkpoint: resume must be True or False; got
        'no' (str). Fix: e.g. Checkpoint(dir, resume=False).
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if example is None:
        example = f"{owner}({name}=True)" if owner else f"{name}=True"
    who = f"{owner}: " if owner else ""
    raise ArgTypeError(
        f"{who}{name} must be True or False; got {value!r} "
        f"({type(value).__name__}). Fix: e.g. {example}."
    )


def _range(what: str, above: Any, minimum: Any, below: Any) -> str:
    low = f"({above:g}" if above is not None else None
    low = f"[{minimum:g}" if minimum is not None else low
    if below is None or below == math.inf:  # infinity is said by ``what``
        bound = f"> {above:g}" if above is not None else None
        bound = f">= {minimum:g}" if minimum is not None else bound
        return f"{what} {bound}" if bound else what
    return f"{what} in {low}, {below:g})" if low else f"{what} < {below:g}"


def _refusal(
    name: str, rule: str, value: Any, owner: str | None, example: Any, none: bool
) -> str:
    who = f"{owner}: " if owner else ""
    call = f"{name}={example}"
    call = f"{owner}({call})" if owner else call
    return (
        f"{who}{name} must be {rule}{' or None' if none else ''}; got {value!r} "
        f"({type(value).__name__}). Fix: e.g. {call}."
    )


def check_path(
    value: Any,
    name: str,
    *,
    owner: str | None = None,
    what: str = "a path",
    example: str,
) -> Path:
    """``value`` as a ``Path`` if it is a str or ``os.PathLike`` naming
    something, else an error in the wording of ``check_int``: an
    ``ArgTypeError`` for another type (None, bytes, a number), a ValueError
    for an empty or blank string (``Path("")`` would silently mean the
    current directory) or one with a NUL character. ``what`` names the kind
    of path (``"a directory path"``), ``example`` the fix's value as code.

    Examples:
        >>> from fitlib.checks import check_path
        >>> path = check_path("runs/exp1", "dirpath", owner="Checkpoint",
        ...                   what="a directory path", example="'runs/exp1'")
        >>> type(path).__name__, str(path)
        ('PosixPath', 'runs/exp1')
    """
    if not isinstance(value, (str, os.PathLike)):
        rule = f"{what} (str or os.PathLike)"
        raise ArgTypeError(_refusal(name, rule, value, owner, example, False))
    text = os.fspath(value)
    if not isinstance(text, str):  # a PathLike of bytes
        rule = f"{what} (str or os.PathLike of str)"
        raise ArgTypeError(_refusal(name, rule, value, owner, example, False))
    if not text.strip():
        rule = f"{what}, not empty or blank"
        raise ValueError(_refusal(name, rule, value, owner, example, False))
    if "\0" in text:
        rule = f"{what} without a NUL character"
        raise ValueError(_refusal(name, rule, value, owner, example, False))
    return Path(text)


# -- before training -------------------------------------------------------------
def check_fit_args(epochs: Any, max_steps: Any) -> None:
    """Raises a ValueError unless the fit has a length."""
    check_int(epochs, "epochs", minimum=1, owner="fit", example=3, allow_none=True)
    check_int(
        max_steps, "max_steps", minimum=1, owner="fit", example=1000, allow_none=True
    )
    if epochs is None and max_steps is None:
        raise ValueError(
            "fit needs a length: got epochs=None and max_steps=None. Fix: pass "
            "epochs (e.g. 3), max_steps (e.g. 1000), or both (the first reached "
            "ends training)."
        )


def check_model(model: Any, loss_func: Any) -> None:
    """Raises a TypeError that says the fix for a bad model or loss function."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module; got {type(model).__name__}. Fix: "
            "wrap the function in an nn.Module whose forward calls it."
        )
    if loss_func is not None and not callable(loss_func):
        raise TypeError(
            f"loss_func must be callable as loss_func(output, *targets), or None "
            f"for a model that computes its own loss; got {loss_func!r}. Fix: "
            "pass e.g. torch.nn.functional.cross_entropy."
        )
    if isinstance(loss_func, type) and issubclass(loss_func, nn.Module):
        # Calling the class would build a module from (output, targets).
        name = loss_func.__name__
        raise TypeError(
            f"loss_func is the class {name}, not a loss: fitlib would call "
            f"{name}(output, targets), which makes a new module instead of a "
            f"loss. Fix: pass an instance, loss_func={name}()."
        )


def check_trainable(model: nn.Module, opt: Any) -> None:
    """Raises a ValueError when fitting ``model`` with ``opt`` would train nothing."""
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
            if t.is_meta]  # fmt: skip
    if meta:
        raise ValueError(
            f"model {type(model).__name__} has {len(meta)} parameter(s)/buffer(s) "
            f"on the 'meta' device, e.g. {meta[:3]}: they have a shape but no "
            "values, so there is nothing to train. Fix: model.to_empty(device="
            "'cpu') and initialize or load the weights before fitting."
        )
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    if not trainable:
        raise ValueError(
            f"model {type(model).__name__} has no trainable parameter (none, or "
            "all with requires_grad=False), so there is nothing to train. Fix: "
            "unfreeze it (learn.unfreeze() or p.requires_grad_(True))."
        )
    in_opt = {id(p) for group in opt.param_groups for p in group["params"]}
    if not trainable & in_opt:
        raise ValueError(
            f"opt holds {len(in_opt)} parameter(s), none of which is a trainable "
            f"parameter of model {type(model).__name__}: stepping it would "
            "change nothing the model computes (it was probably built for "
            "another instance of the model, e.g. one created before). Fix: "
            "build the optimizer from this model, e.g. HPOptimizer("
            "model.parameters(), torch.optim.SGD, lr=0.1)."
        )
    parts = getattr(opt, "parts", None)  # a MultiOptimizer: every one in a part
    if parts is not None:
        left = [n for n, p in model.named_parameters()
                if p.requires_grad and id(p) not in in_opt]  # fmt: skip
        if left:
            raise ValueError(
                f"{len(left)} trainable parameter(s) of model "
                f"{type(model).__name__} are in no part of the MultiOptimizer "
                f"(parts {list(parts)}), e.g. {left[:3]}: they would get gradients "
                "and never be updated. Fix: add them to a part (name their "
                "module in opt_func), or freeze them (requires_grad_(False))."
            )


def check_data(data: Any, epochs: int | None = None) -> None:
    """Raises a clear error for data without a usable ``train_dl``, a loader
    that is a dataset or empty, or a one-shot iterator asked for several epochs."""
    if not hasattr(data, "train_dl"):
        raise TypeError(
            f"data must have a train_dl attribute; got {type(data).__name__}. "
            "Fix: wrap your loaders: fitlib.DataBunch(train_dl, valid_dl)."
        )
    for name in ("train_dl", "valid_dl"):  # valid_dl may be None
        if name == "train_dl" or getattr(data, name, None) is not None:
            check_loader(getattr(data, name), f"data.{name}")
    for name in ("train_dl", "valid_dl"):
        dl = getattr(data, name, None)
        if _one_shot(dl) and epochs is not None and epochs > 1:
            raise ValueError(
                f"data.{name} is an iterator ({type(dl).__name__}), which can be "
                f"iterated only once, but fit runs {epochs} epochs: epoch 2 would "
                f"get no batches. Fix: {REITERABLE}"
            )


def check_loader(dl: Any, name: str) -> None:
    """Raises a clear error for something that is no loader of batches."""
    if dl is None:
        raise TypeError(
            f"{name} is None; fitlib needs an iterable of (x, y) batches. Fix: "
            "pass a DataLoader, e.g. DataLoader(train_ds, batch_size=64, "
            "shuffle=True)."
        )
    if isinstance(dl, Dataset) and not isinstance(dl, IterableDataset):
        raise TypeError(
            f"{name} is a Dataset ({type(dl).__name__}), not a loader: fitlib "
            "would take each single sample for a batch. Fix: wrap it, e.g. "
            "DataLoader(dataset, batch_size=64, shuffle=True) for training."
        )
    if not isinstance(dl, Iterable):
        raise TypeError(
            f"{name} must be an iterable of (x, y) batches (e.g. a DataLoader); "
            f"got {type(dl).__name__}. Fix: pass a DataLoader."
        )
    if len_or_none(dl) == 0:
        raise ValueError(
            f"{name} is empty (len 0); fitlib needs at least one batch. Fix: "
            "check the dataset, and drop_last=True with a dataset smaller than "
            "the batch size."
        )


REITERABLE = """pass an object that makes a new iterator each epoch:

    class Batches:
        def __iter__(self):
            return make_batches()  # your generator function, called anew
        def __len__(self):
            return n_batches  # (optional: a length gives bars and schedules)

    data = DataBunch(Batches(), valid_dl)"""


def regroup_fix(batch: Any) -> str:
    """How to turn batches like ``batch`` into ``(x, y)`` pairs: a
    ``DataBunch(batch_fn=...)`` to copy (it applies every epoch)."""
    if isinstance(batch, dict) and len(batch) >= 2:
        keys = [f"b[{k!r}]" for k in batch]
        ys = keys[1] if len(keys) == 2 else f"({', '.join(keys[1:])})"
        pair, note = f"({keys[0]}, {ys})", f"  # if {keys[0]} holds the inputs"
    elif isinstance(batch, (tuple, list)) and len(batch) > 2:
        pair, note = "(b[0], tuple(b[1:]))", "  # targets: loss_func(out, *y)"
    else:
        return (
            "make the dataset return (x, y) pairs (x: inputs, y: targets, "
            "either a tuple of tensors), or turn each batch into one with "
            "DataBunch(train_dl, valid_dl, batch_fn=lambda b: (x_of(b), y_of(b)))."
        )
    return f"""turn each batch into (x, y) with batch_fn (applied every epoch):

    data = DataBunch(train_dl, valid_dl, batch_fn=lambda b: {pair}){note}"""


def _one_shot(dl: Any) -> bool:
    """Whether ``dl`` is an iterator with no length (a generator, ``map``...):
    one pass only. A sized iterator may restart in ``__iter__`` (a prefetcher);
    an exhausted one is caught when an epoch gets no batch."""
    return isinstance(dl, Iterator) and len_or_none(dl) is None


def one_shot_note(dl: Any) -> str:
    """Says that an exhausted iterator was the cause, when ``dl`` is one."""
    if not isinstance(dl, Iterator):  # iter() would draw a loader's RNG
        return ""
    return (
        f" It is an iterator ({type(dl).__name__}): it can be iterated only "
        f"once, so a second pass gets nothing. Fix: {REITERABLE}"
    )
