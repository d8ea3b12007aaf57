"""A model's summary: its layers with the output shapes of one forward pass on
a batch of the data, the parameter counts (total, trainable, frozen, per layer
group), the optimizer's hyper-parameters per group, the callbacks in the order
they run and the precision. ``str(summary)`` is a table for a terminal (at
most 100 columns), ``summary._repr_html_()`` one for a notebook: both drawn by
``fitlib.summary_text``.

The forward pass changes nothing: it runs on the first batch of the training
loader in eval mode without gradients (``core.evaluating``: no BatchNorm
statistics move, no dropout draws), then puts back the random generators
(the loader's too, so the next fit draws the same order), every buffer (the
same tensor objects, their values copied back: a module that updates one even
in eval mode leaves no trace), the ``requires_grad`` flags, each module's
train/eval mode and the grad mode; its hooks are removed, also after an
error. A model with lazy layers not yet initialized runs on a copy, so the
first fit initializes them as it would have. A one-shot iterator is not drawn
from (its batch would be lost): shapes are then ``?``, as without data.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.nn.utils.rnn import PackedSequence

from fitlib.callback import inner_callback
from fitlib.checks import check_int
from fitlib.core import call_model, evaluating
from fitlib.data import batches, model_device
from fitlib.multi_optimizer import MultiOptimizer
from fitlib.optim import NAMES, HPOptimizer
from fitlib.rng import get_rng_state, set_rng_state
from fitlib.sharding import unwrap
from fitlib.summary_text import as_html, as_text, shape_text

_HIDDEN_KEYS = {"params", "initial_lr", "lr", "momentum", "betas", "alpha",
                "weight_decay"}  # fmt: skip


@dataclass
class LayerInfo:
    """One row of the layer table.

    ``name`` is the module's dotted path in the model (``""``: the model
    itself); ``shape`` the output's shape at its first call: a
    ``torch.Size``, or a tuple or dict of them for a structured output (a
    string for a value that is no tensor), None when it did not run;
    ``calls`` how often the forward pass called it; ``params`` and
    ``trainable`` count its parameters (its own only, for a module shown
    above rows of its children).
    """

    name: str
    type: str
    shape: Any
    params: int
    trainable: int
    calls: int


@dataclass
class GroupInfo:
    """One parameter group: its index (as ``freeze_to`` counts them), part
    (``""`` without several optimizers), parameter counts, optimizer class
    and hyper-parameters (empty before the optimizer exists)."""

    index: int
    part: str
    params: int
    trainable: int
    optimizer: str | None = None
    hypers: dict[str, Any] = field(default_factory=dict)


@dataclass
class Summary:
    """What ``summarize`` found; ``str()`` is the text table, and a notebook
    shows the HTML one (``_repr_html_``).

    Examples:
        >>> from fitlib.summary import summarize
        >>> s = summarize(model, data)
        >>> s.total, s.trainable, s.frozen, [layer.shape for layer in s.layers]
        (195, 195, 0, [torch.Size([16, 16]), torch.Size([16, 16]), torch.Size([16, 3])])
    """

    model: str
    layers: list[LayerInfo]
    input_shape: Any
    output_shape: Any
    total: int
    trainable: int
    size_bytes: int
    groups: list[GroupInfo] = field(default_factory=list)
    optimizer: str | None = None
    scheduled: dict[str, str] = field(default_factory=dict)
    callbacks: list[tuple[int, str]] = field(default_factory=list)
    precision: str = "fp32"
    notes: list[str] = field(default_factory=list)

    @property
    def frozen(self) -> int:
        return self.total - self.trainable

    def __str__(self) -> str:
        return as_text(self)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return as_html(self)

    def show(self) -> None:
        """Prints the text, or in a notebook displays the HTML table (as the
        progress bar decides: fastprogress's notebook test)."""
        from fitlib.bars import fastprogress_module

        if fastprogress_module().IN_NOTEBOOK:
            from IPython.display import display

            display(self)
        else:
            print(self)


# -- building one ----------------------------------------------------------------
def summarize(
    model: nn.Module,
    data: Any = None,
    opt: Any = None,
    callbacks: Iterable[Any] = (),
    groups: dict[str, list[list]] | None = None,
    depth: int | None = None,
) -> Summary:
    """The summary of ``model``, shapes from one forward pass on a batch.

    Args:
        model: the model (a DDP or ``torch.compile`` wrapper is unwrapped).
        data: a ``DataBunch`` (its ``train_dl``, else ``valid_dl``, with its
            ``batch_fn``), or a loader; None: no forward, shapes ``?``.
        opt: the optimizer (``HPOptimizer``, ``MultiOptimizer`` or a torch
            optimizer): its groups and hyper-parameters; or an optimizer
            class (``opt_func``) not yet created, or a dict of them by part.
        callbacks: the fit's callbacks: listed in the order they run; the
            precision, memory format and compilation are read from them.
        groups: the layer groups by part (``Learner.part_groups``); None: the
            optimizer's parameter groups.
        depth: None shows every leaf module; ``k`` the modules ``k`` levels
            down (each with its children's parameters), and shallower leaves.

    Examples:
        >>> from fitlib.summary import summarize
        >>> print(summarize(model, data, opt=opt, depth=1))
        Sequential: input [16, 8] (the first training batch), output [16, 3]
        layer  type    output shape  params  trainable
        -----  ------  ------------  ------  ---------
        0      Linear  [16, 16]         144  yes
        1      ReLU    [16, 16]           0  -
        2      Linear  [16, 3]           51  yes
        Parameters: 195 total, 195 trainable, 0 frozen (780 B)
        <BLANKLINE>
        Optimizer: SGD
        group  params  trainable  lr   mom  wd
        -----  ------  ---------  ---  ---  --
        0         195        195  0.1  0    0
        <BLANKLINE>
        Precision: fp32 (weights float32)
    """
    depth = check_int(depth, "depth", minimum=0, owner="summarize",
                      example=1, allow_none=True)  # fmt: skip
    model = unwrap(model)
    notes: list[str] = []
    run_on = _initialized(model, notes)
    rows = _rows(run_on, depth)
    x, where = _first_batch(data, model_device(model), notes)
    out = _forward(run_on, x, rows) if x is not None else None
    _fill_counts(rows)
    params = _unique_params(run_on)
    summary = Summary(
        model=type(model).__name__,
        layers=[info for info, _, _ in rows],
        input_shape=None if x is None else shape_of(x),
        output_shape=None if out is None else shape_of(out),
        total=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in params if p.requires_grad),
        size_bytes=sum(p.numel() * p.element_size() for p in params),
        notes=[*([where] if where else []), *notes],
    )
    _add_training(summary, model, opt, list(callbacks), groups)
    _note_shared(summary, rows, params)
    return summary


def learner_summary(
    learn: Any, depth: int | None = None, callbacks: Iterable[Any] | None = None
) -> Summary:
    """The summary of a ``Learner``: its model on a batch of its data, its
    layer groups, its optimizer (or ``opt_func`` before the first fit) and
    ``callbacks`` (None: ``learn.recorder`` and ``learn.callbacks``)."""
    cbs = [learn.recorder, *learn.callbacks] if callbacks is None else callbacks
    opt = learn.opt if learn.opt is not None else learn.opt_func
    return summarize(learn.model, learn.data, opt, cbs, learn.part_groups, depth)


def _initialized(model: nn.Module, notes: list[str]) -> nn.Module:
    """``model``, or a copy of it when it has lazy layers not yet initialized:
    the forward pass initializes them on the copy, so the first fit still
    does (drawing its random numbers) as it would have."""
    if not any(is_lazy(p) for p in model.parameters()):
        return model
    notes.append("lazy layers: counted on a copy that the forward initialized")
    return copy.deepcopy(model)


Row = tuple[LayerInfo, nn.Module, bool]  # bool: with its children's parameters


def _rows(model: nn.Module, depth: int | None) -> list[Row]:
    """The modules shown: leaves (to ``depth``), the modules at ``depth``,
    and, with their own parameters only, shallower ones holding some (their
    counts are filled in after the forward pass: lazy layers have none
    before)."""
    rows = []
    for name, module in model.named_modules():
        level = name.count(".") + 1 if name else 0
        if depth is not None and level > depth:
            continue
        has_children = next(module.children(), None) is not None
        whole = not has_children or (depth is not None and level == depth)
        if whole or next(module.parameters(recurse=False), None) is not None:
            info = LayerInfo(name, type(module).__name__, None, 0, 0, 0)
            rows.append((info, module, whole))
    return rows


def _fill_counts(rows: list[Row]) -> None:
    for info, module, whole in rows:
        own = list(module.parameters(recurse=whole))
        info.params = _count(own)
        info.trainable = _count(p for p in own if p.requires_grad)


def _count(params: Iterable[torch.Tensor]) -> int:
    unique = {id(p): p for p in params}.values()
    return sum(p.numel() for p in unique if not is_lazy(p))  # lazy: size unknown


def _unique_params(model: nn.Module) -> list[torch.Tensor]:
    return list(model.parameters())  # each shared parameter once


def _first_batch(data: Any, device: torch.device, notes: list[str]) -> tuple:
    """The inputs of the loader's first batch on ``device``, drawn with every
    random generator put back; ``(None, why)`` when there is none to draw."""
    dl = getattr(data, "train_dl", data) if data is not None else None
    if dl is None and data is not None:
        dl = getattr(data, "valid_dl", None)
    if dl is None:
        return None, "no data: output shapes unknown (?)"
    if isinstance(dl, Iterator):
        return None, (
            f"the data is a one-shot iterator ({type(dl).__name__}): not drawn "
            "from, shapes unknown (?)"
        )
    rng = get_rng_state(dl)
    try:
        gen = batches(dl, device, "train_dl", getattr(data, "batch_fn", None))
        x, _ = next(gen)
        gen.close()
    finally:
        set_rng_state(rng, dl)
    return x, None


def _forward(model: nn.Module, x: Any, rows: list[Row]) -> Any:
    handles = []
    for info, module, _ in rows:
        with suppress(RuntimeError):  # a scripted module takes no hooks: shape ?
            handles.append(module.register_forward_hook(_recorder(info)))
    rng = get_rng_state()
    try:
        with _restored(model), evaluating(model):
            return call_model(model, x)
    finally:
        set_rng_state(rng)
        for handle in handles:
            handle.remove()


def _recorder(info: LayerInfo) -> Any:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        info.calls += 1
        if info.calls == 1:
            info.shape = shape_of(output)

    return hook


@contextmanager
def _restored(model: nn.Module) -> Iterator[None]:
    """Puts back the buffers (objects and values) and ``requires_grad``
    flags of ``model`` after the block, also after an error."""
    buffers = [(m, n, b, b.clone()) for m in model.modules()
               for n, b in m._buffers.items() if b is not None]  # fmt: skip
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        yield
    finally:
        with torch.no_grad():
            for module, name, buffer, saved in buffers:
                module._buffers[name] = buffer
                buffer.copy_(saved)
        for p, flag in flags:
            p.requires_grad_(flag)


def shape_of(x: Any) -> Any:
    """The shape of each tensor in ``x``, in its structure: a ``torch.Size``;
    a tuple for a tuple or list, a dict for a dict or dataclass; a string
    for a packed sequence (``"packed [52, 32]"``) or a value of another type.

    Examples:
        >>> from fitlib.summary import shape_of
        >>> shape_of((torch.zeros(2, 3), {"h": torch.zeros(1, 2)}))
        (torch.Size([2, 3]), {'h': torch.Size([1, 2])})
    """
    if isinstance(x, torch.Tensor):
        return x.shape
    if isinstance(x, PackedSequence):
        return f"packed {shape_text(x.data.shape)}"
    if isinstance(x, (tuple, list)):
        return tuple(shape_of(v) for v in x)
    if isinstance(x, dict):
        return {k: shape_of(v) for k, v in x.items()}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: shape_of(getattr(x, f.name)) for f in dataclasses.fields(x)}
    return type(x).__name__


# -- the training set-up ---------------------------------------------------------
def _add_training(
    summary: Summary, model: nn.Module, opt: Any, callbacks: list, groups: Any
) -> None:
    parts = _optimizer_parts(opt)
    if groups is None and parts:
        groups = {part: [g["params"] for g in o.param_groups]
                  for part, o in parts.items()}  # fmt: skip
    summary.groups = _groups(groups or {}, parts)
    summary.optimizer = _optimizer_name(opt)
    in_groups = {id(p) for gs in (groups or {}).values() for g in gs for p in g}
    left = _count(p for p in model.parameters() if id(p) not in in_groups)
    if in_groups and left:
        summary.notes.append(f"{left:,} parameters are in no group (no optimizer)")
    cbs = sorted(callbacks, key=lambda cb: cb.order)
    summary.callbacks = [(cb.order, _callback_name(cb)) for cb in cbs]
    inner = [inner_callback(cb) for cb in cbs]
    summary.scheduled = {h: cb.name for cb in inner for h in cb.sets_hypers}
    summary.precision = _precision(model, inner)


def _optimizer_parts(opt: Any) -> dict[str, Any]:
    """The created optimizer by part (``""`` for one); {} before it exists."""
    if isinstance(opt, MultiOptimizer):
        return dict(opt.parts)
    if isinstance(opt, (HPOptimizer, torch.optim.Optimizer)):
        return {"": opt}
    return {}


def _groups(groups: dict[str, list[list]], parts: dict[str, Any]) -> list[GroupInfo]:
    out: list[GroupInfo] = []
    for part, part_groups in groups.items():
        opt = parts.get(part)
        hypers = _hypers(opt) if opt is not None else []
        for i, params in enumerate(part_groups):
            info = GroupInfo(len(out), part, _count(params),
                             _count(p for p in params if p.requires_grad))  # fmt: skip
            if i < len(hypers):
                info.optimizer = type(_torch_opt(opt)).__name__
                info.hypers = hypers[i]
            out.append(info)
    return out


def _torch_opt(opt: Any) -> torch.optim.Optimizer:
    return opt.opt if isinstance(opt, HPOptimizer) else opt


def _hypers(opt: Any) -> list[dict[str, Any]]:
    """Each group's hyper-parameters: fitlib's names (``lr``, ``mom``,
    ``wd``, ``beta``) for an ``HPOptimizer``, then ``eps`` and the other
    numbers its torch optimizer holds that differ from the class's default."""
    torch_opt = _torch_opt(opt)
    named = {n: opt.get(n) for n in NAMES if opt.has(n)} if torch_opt is not opt else {}
    defaults = _defaults(type(torch_opt))
    rows = []
    for i, group in enumerate(torch_opt.param_groups):
        row = {n: values[i] for n, values in named.items()}
        hidden = _HIDDEN_KEYS if named else {"params", "initial_lr"}
        for key, value in group.items():
            if key in hidden or key.startswith("fitlib_") or not _is_hyper(value):
                continue
            if key in ("lr", "eps") or key not in defaults or defaults[key] != value:
                row[key] = value
        rows.append(row)
    return rows


def _defaults(cls: type) -> dict[str, Any]:
    try:
        params = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in params if p.default is not p.empty}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_hyper(value: Any) -> bool:
    """A number, or a tuple of numbers (Adam's ``betas``)."""
    if isinstance(value, tuple):
        return bool(value) and all(map(_is_number, value))
    return _is_number(value)


def _optimizer_name(opt: Any) -> str | None:
    if opt is None:
        return None
    parts = _optimizer_parts(opt)
    if parts:
        names = {type(_torch_opt(o)).__name__ for o in parts.values()}
        wd = [o.true_wd for o in parts.values() if isinstance(o, HPOptimizer)]
        name = " and ".join(sorted(names))
        return name + (", weight decay decoupled (true_wd)" if any(wd) else "")
    funcs = opt if isinstance(opt, dict) else {"": opt}
    names = {_func_name(f) for f in funcs.values()}
    return f"{' and '.join(sorted(names))} (created at the first fit)"


def _func_name(func: Any) -> str:
    func = getattr(func, "func", func)  # a functools.partial
    return getattr(func, "__name__", type(func).__name__)


def _callback_name(cb: Any) -> str:
    text = repr(cb)
    return cb.name if text == f"{cb.name}(order={cb.order})" else text


def _precision(model: nn.Module, callbacks: list) -> str:
    names = {c.__name__: cb for cb in callbacks for c in type(cb).__mro__}
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    weights = f"weights {', '.join(dtypes)}" if dtypes else "no weights"
    mp = names.get("MixedPrecision")
    if mp is None:
        text = f"fp32 ({weights})" if dtypes in (["float32"], []) else weights
    else:
        short = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(mp.dtype, "")
        scaling = ", loss scaling" if mp.dtype is torch.float16 else ""
        text = f"{short} mixed (autocast to {str(mp.dtype)[6:]}{scaling}; {weights})"
    if "ChannelsLast" in names:
        text += "; channels_last"
    if "Compile" in names:
        text += f"; compiled ({_callback_name(names['Compile'])})"
    return text


def _note_shared(summary: Summary, rows: list, params: list) -> None:
    shown = sum(info.params for info, _, _ in rows)
    total = summary.total
    if rows and shown > total:
        summary.notes.append(
            f"{shown - total:,} parameters are shared by several layers: "
            "counted once in the totals"
        )
    if any(info.calls > 1 for info, _, _ in rows):
        summary.notes.append("xN: a layer the forward pass called N times")
