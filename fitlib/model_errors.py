"""A model's failure, explained: what it was given and, where torch names a
layer, which layer and what it expected.

``explain_model_error`` raises the error of a model's forward again, as a
TypeError (a dtype the layer does not take) or a ValueError (a size it does
not take) naming the layer, or with the input's shapes as a note. A helper:
it imports torch, ``errors`` and ``checks`` only.
"""

from __future__ import annotations

import inspect
from typing import Any, NoReturn

import torch
from torch import nn

from fitlib.checks import regroup_fix
from fitlib.errors import add_note, describe


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
