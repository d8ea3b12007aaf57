"""Checks of what the loop is given, and errors that say what went wrong.

Before training: the arguments of ``fit``, the model, the optimizer and the
loaders. At the first batch of a fit (and of each ``validate`` call): the
inputs of the loss, whose shapes and dtypes are known only then. After a
failure: what the model or the loss was given and, where torch names a layer,
which layer and what it expected. A helper, not a callback: the bottom layer
(it imports torch and ``errors`` only).
"""

from __future__ import annotations

import inspect
import math
import os
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.overrides import TorchFunctionMode
from torch.utils.data import Dataset, IterableDataset

from fitlib.errors import ArgTypeError, add_note, describe, is_int, is_number, name_of

# Losses that compare output and target element by element: shapes must match.
_ELEMENTWISE = (
    F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss,
    F.binary_cross_entropy, F.binary_cross_entropy_with_logits, F.soft_margin_loss,
)  # fmt: skip
_ELEMENTWISE_MODULES = (
    nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCELoss,
    nn.BCEWithLogitsLoss, nn.SoftMarginLoss,
)  # fmt: skip
# Losses whose targets are class indices (or class probabilities).
_CLASS_INDEX = (F.cross_entropy, F.nll_loss)
_CLASS_INDEX_MODULES = (nn.CrossEntropyLoss, nn.NLLLoss)


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


# -- the first batch ---------------------------------------------------------------
@contextmanager
def loss_check(loss_func: Any, out: Any, targets: tuple) -> Iterator[None]:
    """Refuses, around the first batch's loss, inputs that torch would accept
    but get wrong.

    Before the loss: float or out-of-range class indices for cross-entropy
    (one value read from the device), and shapes that differ for a loss that
    compares element by element (mse, l1, BCE...). During it, for any loss: an
    element-wise op between a value computed from the output and one computed
    from the targets, of different ranks, that broadcasting enlarges on both
    sides (an ``(N, 1)`` output minus ``(N,)`` targets compares every output
    with every target). A loss that aligns the shapes itself
    (``out.squeeze(1) - y``) passes, and so does a deliberate outer op of
    tensors of the same rank (pairwise distances, chamfer losses).
    """
    y = targets[0] if len(targets) == 1 else None
    if isinstance(out, torch.Tensor) and isinstance(y, torch.Tensor):
        if is_class_index_loss(loss_func):
            _check_class_targets(loss_func, out, y)
        elif out.shape != y.shape and _is(
            loss_func, _ELEMENTWISE, _ELEMENTWISE_MODULES
        ):
            raise ValueError(_broadcast_message(loss_func, out.shape, y.shape))
    watch = _Broadcasts(out, targets)
    with watch:
        yield
    if watch.found is not None:
        op, a, b = watch.found
        inside = (
            f" Inside it, {op!r} got a value of shape {tuple(a)} computed from the "
            f"output and one of shape {tuple(b)} from the targets{_into(a, b)}."
        )
        shapes = (out.shape, y.shape) if y is not None else (a, b)
        raise ValueError(_broadcast_message(loss_func, *shapes, inside))


class _Broadcasts(TorchFunctionMode):
    """Follows what is computed from the output and from the targets during
    one call of the loss, and notes the first element-wise op between the two
    that broadcasting enlarges on both sides: ``(op, shape, shape)``."""

    def __init__(self, out: Any, targets: tuple) -> None:
        super().__init__()
        self.found: tuple | None = None
        self._from: dict[int, tuple] = {}  # id -> (weakref, {"out", "y"})
        self._mark(out, frozenset({"out"}))
        self._mark(targets, frozenset({"y"}))

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        sources = [self._source(t) for t in tensors]
        if self.found is None and len(tensors) >= 2 and _elementwise(func):
            self._compare(func, tensors[:2], sources[:2])
        result = func(*args, **kwargs)
        merged = frozenset().union(*sources)
        if merged:
            self._mark(result, merged)
        return result

    def _compare(self, func: Any, pair: list, sources: list) -> None:
        a, b = pair
        # Of ranks that differ: implicit rank promotion, (N, 1) against (N,).
        promoted = a.ndim != b.ndim and _both_expand(a, b)
        if promoted and {*sources} == {frozenset({"out"}), frozenset({"y"})}:
            out, y = (a, b) if sources[0] == {"out"} else (b, a)
            self.found = (getattr(func, "__name__", "op"), out.shape, y.shape)

    def _mark(self, x: Any, source: frozenset) -> None:
        if isinstance(x, torch.Tensor):
            self._from[id(x)] = (weakref.ref(x), source | self._source(x))
        elif isinstance(x, (tuple, list)):
            for v in x:
                self._mark(v, source)

    def _source(self, t: torch.Tensor) -> frozenset:
        entry = self._from.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else frozenset()


_BINARY = {"add", "sub", "rsub", "mul", "div", "true_divide", "pow", "eq", "ne",
           "lt", "le", "gt", "ge", "maximum", "minimum", "where", "sub_", "mul_",
           "add_", "div_", "abs", "square"}  # fmt: skip


def _elementwise(func: Any) -> bool:
    name = getattr(func, "__name__", "").strip("_")
    name = name[1:] if name.startswith("r") and name[1:] in _BINARY else name
    return name in _BINARY or name.endswith("_loss") or name == "cross_entropy"


def _broadcast_message(loss_func: Any, out: Any, y: Any, inside: str = "") -> str:
    what = "." if inside else f"{_into(out, y)}."
    return (
        f"loss_func {name_of(loss_func)} got an output of shape {tuple(out)} and "
        f"targets of shape {tuple(y)}{what}{inside} Fix: give output and targets "
        "the same shape, e.g. y.reshape(-1, 1) for the targets (in the dataset) "
        "or out.squeeze(-1) in the model's forward; or align them in the loss."
    )


def _is(loss_func: Any, functions: tuple, modules: tuple) -> bool:
    return (
        isinstance(loss_func, modules)
        or getattr(loss_func, "func", loss_func) in functions
    )


def _both_expand(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether broadcasting enlarges both tensors: (N, 1) against (N,)."""
    try:
        shape = torch.broadcast_shapes(a.shape, b.shape)
    except RuntimeError:
        return False
    return shape.numel() > max(a.numel(), b.numel())


def _into(out: Any, y: Any) -> str:
    try:
        shape = tuple(torch.broadcast_shapes(tuple(out), tuple(y)))
    except RuntimeError:
        return ", which do not match"
    return (
        f", which torch broadcasts to {shape}, comparing every output with "
        "every target: the model would train on the wrong objective"
    )


def _check_class_targets(loss_func: Any, out: torch.Tensor, y: torch.Tensor) -> None:
    name = name_of(loss_func)
    if y.is_floating_point():
        if y.shape == out.shape:  # class probabilities: allowed
            return
        raise ValueError(
            f"loss_func {name} got float targets {describe(y)} for an output "
            f"{describe(out)}: it needs class indices (integers) or, for soft "
            "labels, probabilities of the output's shape. Fix: y.long() (e.g. "
            "torch.tensor(labels, dtype=torch.long) in the dataset)."
        )
    n_classes = out.shape[1] if out.ndim > 1 else out.shape[0]
    ignore = ignore_index_of(loss_func)
    bad = ((y < 0) | (y >= n_classes)) & (y != ignore)
    if bad.any():  # one sync, at the first batch only
        found = y[bad][0].item()
        raise ValueError(
            f"loss_func {name} got the class index {found} for an output with "
            f"{n_classes} classes (indices 0 to {n_classes - 1}). Fix: make the "
            f"model's last layer output as many classes as the labels have "
            f"(max label + 1), or map the labels to 0..{n_classes - 1}."
        )


def is_class_index_loss(loss_func: Any) -> bool:
    """Whether ``loss_func`` is cross-entropy or NLL (a function, a module or
    a ``functools.partial`` of one): it takes class indices."""
    return _is(loss_func, _CLASS_INDEX, _CLASS_INDEX_MODULES)


def takes_probabilities(loss_func: Any) -> bool:
    """Whether ``loss_func`` is ``binary_cross_entropy`` (a function, a
    ``partial`` or ``nn.BCELoss``): its input is a probability, not a logit."""
    return _is(loss_func, (F.binary_cross_entropy,), (nn.BCELoss,))


def takes_logits(loss_func: Any) -> bool:
    """Whether ``loss_func`` is ``binary_cross_entropy_with_logits`` (a
    function, a ``partial`` or ``nn.BCEWithLogitsLoss``): its input is a
    logit of one score per target."""
    return _is(
        loss_func, (F.binary_cross_entropy_with_logits,), (nn.BCEWithLogitsLoss,)
    )


def ignore_index_of(loss_func: Any) -> int:
    """The class index ``loss_func`` leaves out (a module's ``ignore_index``,
    a ``partial``'s keyword), -100 by default as in torch."""
    if isinstance(loss_func, nn.Module):
        return getattr(loss_func, "ignore_index", -100)
    keywords = getattr(loss_func, "keywords", None) or {}
    return keywords.get("ignore_index", -100)


# -- after a failure ---------------------------------------------------------------
def explain_model_error(e: Exception, model: nn.Module, xb: Any) -> NoReturn:
    """Raises ``e`` again with what the model was given and, where it can, why.

    When a torch layer fails: an input whose dtype differs from the layer's
    parameters (float64 into float32, integers into a Linear) becomes a
    TypeError, one whose size differs from what the layer expects a
    ValueError, each naming the layer. Otherwise float64 inputs to a float32
    model become a TypeError, and other errors keep their type, with the
    input's shapes as a note.
    """
    if any(k.__name__ == "BackendCompilerFailed" for k in type(e).__mro__):
        said = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise RuntimeError(
            f"torch.compile's backend could not compile the model ({said}). Fix: "
            "compile with backend='aot_eager', which needs no C++ compiler "
            "(learn.compile(backend='aot_eager'), Compile(backend='aot_eager')), "
            "or train without Compile; on a CPU the default backend, inductor, "
            "needs a working C++ compiler (g++)."
        ) from e
    given = f"fitlib: the model was called with input {describe(xb)}"
    layer = _failing_layer(e, model) if type(e) in _PLAIN else None
    if layer is not None:
        name, module, arg = layer
        where = f"layer {name!r} of the model" if name else "the model"
        called = f"; the model was called with {describe(xb)}" if name else ""
        expects = _expects(module, arg, e)  # the size first: autocast mixes dtypes
        if expects:
            raise ValueError(
                f"{where} ({module!r}) got input {describe(arg)}: {expects}"
                f"{called}. Fix: make the inputs match what the model expects "
                f"(the dataset's shapes), or change the layer.\nIt said: {e}"
            ) from e
        wrong_dtype = _dtype_mismatch(module, arg)
        if wrong_dtype:
            raise TypeError(
                f"{where} ({module!r}) {wrong_dtype}, got input {describe(arg)}"
                f"{called}. Fix: give the inputs the layer's dtype (e.g. "
                "x.float() in the dataset), or convert the model "
                f"(model.to(dtype)).\nIt said: {e}"
            ) from e
    if type(e) is RuntimeError and _float64_into_float32(model, xb):
        dtype = str(_param_dtype(model)).removeprefix("torch.")
        raise TypeError(
            f"the model's parameters are {dtype} but the input is "
            f"float64 ({describe(xb)}). Fix: make the inputs float32 (x.float(), "
            "or torch.tensor(..., dtype=torch.float32) in the dataset), or the "
            f"model float64 (model.double()).\nIt said: {e}"
        ) from e
    if isinstance(xb, dict):  # a dict batch is taken as the model's inputs
        given += (
            f", as model(**batch) with the keys {list(xb)}. If the batch holds "
            f"inputs and targets, {regroup_fix(xb)}"
        )
    add_note(e, given)
    raise e


_PLAIN = (RuntimeError, IndexError, ValueError)  # torch's errors about inputs


def _float64_into_float32(model: nn.Module, xb: Any) -> bool:
    first = _first_float(xb)
    return (
        first is not None
        and first.dtype == torch.float64
        and _param_dtype(model) not in (None, torch.float64)
    )


def _param_dtype(model: nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _first_float(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x if x.is_floating_point() else None
    values = x.values() if isinstance(x, dict) else x
    if isinstance(x, (tuple, list, dict)):
        return next((t for v in values if (t := _first_float(v)) is not None), None)
    return None


def _failing_layer(e: Exception, model: nn.Module) -> tuple | None:
    """The deepest torch layer of ``model`` whose forward was running when
    ``e`` was raised: ``(qualified name, module, its first tensor argument)``;
    None when it was a module of the user's (it may fail for its own reasons)."""
    names = {id(m): n for n, m in model.named_modules()}
    found, tb = None, e.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        module = frame.f_locals.get("self")
        in_forward = frame.f_code.co_name == "forward"  # not torch's __call__
        if in_forward and isinstance(module, nn.Module) and id(module) in names:
            args = inspect.getargvalues(frame)
            values = [args.locals[a] for a in args.args[1:] if a in args.locals]
            arg = next((v for v in values if isinstance(v, torch.Tensor)), None)
            found = (names[id(module)], module, arg)
        tb = tb.tb_next
    torch_layer = found is not None and type(found[1]).__module__.startswith(
        "torch.nn."
    )
    return found if torch_layer and found[2] is not None else None


def _dtype_mismatch(module: nn.Module, arg: torch.Tensor) -> str:
    """Says how ``arg``'s dtype differs from the layer's parameters, or ''."""
    param = next(
        (p for p in module.parameters(recurse=False) if p.is_floating_point()), None
    )
    takes_indices = isinstance(module, (nn.Embedding, nn.EmbeddingBag))
    if param is None or takes_indices or arg.dtype == param.dtype:
        return ""
    return f"has {str(param.dtype).removeprefix('torch.')} parameters"


def _expects(module: nn.Module, arg: torch.Tensor, e: Exception) -> str:
    """What the layer expects that ``arg`` does not have, or ''."""
    shape = tuple(arg.shape)
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and type(e) is IndexError:
        return f"it expects indices below {module.num_embeddings} (num_embeddings)"
    size = getattr(module, "in_features", None) or getattr(module, "input_size", None)
    if isinstance(size, int) and (not shape or shape[-1] != size):
        return f"it expects {size} features in the last dimension"
    kernel = getattr(module, "kernel_size", None)
    channels = getattr(module, "in_channels", None)
    if isinstance(channels, int) and isinstance(kernel, tuple):
        dims = len(kernel)
        if len(shape) not in (dims + 1, dims + 2):
            return f"it expects {dims + 2} dimensions (N, C, ...) or {dims + 1}"
        if shape[-dims - 1] != channels:
            return f"it expects {channels} channels in dimension {-dims - 1}"
    features = getattr(module, "num_features", None)
    if isinstance(features, int) and (len(shape) < 2 or shape[1] != features):
        return f"it expects {features} features (channels) in dimension 1"
    normalized = getattr(module, "normalized_shape", None)
    if isinstance(normalized, tuple) and shape[-len(normalized) :] != normalized:
        return f"it expects the trailing dimensions {normalized}"
    return ""
