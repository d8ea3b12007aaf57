"""``MultiOptimizer``: one optimizer per part of a model, as one optimizer.

An encoder on Adam and a decoder on SGD with momentum, or a GAN's generator
and critic, each keep their own torch optimizer (wrapped in an
``HPOptimizer``), and the loop, the schedulers, the LR finder, mixed precision
and checkpoints see one object with ``HPOptimizer``'s interface:

- ``step()`` steps the parts that are ``active`` (all, unless a callback such
  as ``GANTrainer`` names some for this batch); ``zero_grad()`` clears all.
- ``lr``, ``mom``, ``wd``, ``beta`` read and set every part's groups, in part
  order (``param_groups`` lists them all); ``opt["decoder"].lr`` reads or sets
  one part; ``opt.lr = {"encoder": 1e-3, "decoder": 0.1}`` sets each part.
  Any other hyper-parameter goes through ``get``/``set`` by its torch name
  (``opt.set("eps", 1e-6)``, ``opt["decoder"].get("betas[1]")``), as on
  ``HPOptimizer``.
- ``state_dict()`` holds every part's state, by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from fitlib.checks import check_flag
from fitlib.errors import ArgTypeError
from fitlib.hyper_checks import (
    NAMES,
    check_lr,
    count_mismatch,
    example_setting,
    is_hyper_number,
    lr_per_group,
)
from fitlib.optim import (
    HPOptimizer,
    HyperParam,
    HyperParams,
)

Parts = Mapping[str, Any]


class MultiOptimizer(HyperParams):
    """Several optimizers, one per part of a model, behind one interface.

    Args:
        parts: part name -> optimizer (an ``HPOptimizer`` or a torch
            optimizer, wrapped). No parameter may be in two parts.

    Examples:
        >>> body, head = nn.Linear(8, 16), nn.Linear(16, 3)
        >>> net = nn.Sequential(body, nn.ReLU(), head)
        >>> opt = MultiOptimizer({
        ...     "body": HPOptimizer(body.parameters(), torch.optim.Adam, lr=1e-3),
        ...     "head": HPOptimizer(head.parameters(), torch.optim.SGD, lr=0.1,
        ...                         mom=0.9),
        ... })
        >>> fit(3, net, F.cross_entropy, opt, data)
        History(3 epochs: train_loss ... -> ..., valid_loss ... -> ...)
        >>> opt["head"].lr = 0.05; opt.wd = 1e-4  # one part; every part
        >>> opt.lr, opt.wd
        ([0.001, 0.05], 0.0001)
    """

    def __init__(self, parts: Parts) -> None:
        self.parts: dict[str, HPOptimizer] = _check_parts(parts)
        self._last = list(self.parts.values())[-1]
        self._active: tuple[str, ...] | None = None
        self.stepped: tuple[Any, Any] | None = None

    @property
    def active(self) -> tuple[str, ...] | None:
        """The parts ``step()`` steps: a tuple of part names, or None for all
        (``GANTrainer`` names one part per batch)."""
        return self._active

    @active.setter
    def active(self, names: Any) -> None:
        if names == self._active and type(names) is type(self._active):
            return  # (set before every batch of a GAN: most keep the turn)
        if names is not None:
            names = _check_active(names, list(self.parts))
        self._active = names

    # -- the parts -------------------------------------------------------------
    def __getitem__(self, name: str) -> HPOptimizer:
        if name not in self.parts:
            raise KeyError(
                f"MultiOptimizer has no part {name!r}; its parts are "
                f"{list(self.parts)}. Fix: use one of those names."
            )
        return self.parts[name]

    def __contains__(self, name: object) -> bool:
        return name in self.parts

    @property
    def names(self) -> list[str]:
        return list(self.parts)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers, in part order."""
        return [part.opt for part in self.parts.values()]

    @property
    def param_groups(self) -> list[dict]:
        return [g for part in self.parts.values() for g in part.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for part in self.parts.values() for p, s in part.state.items()}

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        return next(iter(self.parts.values())).grad_scaler

    @grad_scaler.setter
    def grad_scaler(self, scaler: torch.amp.GradScaler | None) -> None:
        for part in self.parts.values():  # one scaler steps (or skips) them all
            part.grad_scaler = scaler

    @property
    def true_wd(self) -> bool | dict[str, bool]:
        flags = {name: part.true_wd for name, part in self.parts.items()}
        return _collapse_dict(flags)

    # -- stepping --------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """Steps every active part. ``stepped`` notes the ``(lr, mom)`` of the
        last part's last group, stepped or not, so the Recorder's rates and
        the record's ``lr`` are always the same part's (also in a GAN's
        turns)."""
        if closure is not None:
            raise ValueError(
                "MultiOptimizer.step: a closure would run once per part, each "
                "time recomputing the loss. Fix: step without a closure."
            )
        self.stepped = self._last.lr_and_momentum()  # (floats: no device read)
        for name in self.parts if self.active is None else self.active:
            self.parts[name].step()

    def hypers_as_tensors(self, names: Any = None) -> dict[str, tuple[str, ...]]:
        """``HPOptimizer.hypers_as_tensors`` on every part: the names each
        part holds as tensors, by part name. A part that cannot (its
        optimizer, its ``foreach``) fails as that part would, naming it; the
        parts before it stay converted (calling it again is harmless).

        Examples:
            >>> body, head = nn.Linear(8, 16), nn.Linear(16, 3)
            >>> multi = MultiOptimizer({
            ...     "body": torch.optim.AdamW(body.parameters(), lr=1e-3),
            ...     "head": torch.optim.SGD(head.parameters(), lr=0.1)})
            >>> multi.hypers_as_tensors()
            {'body': ('lr', 'mom', 'beta'), 'head': ('lr',)}
        """
        done = {}
        for name, part in self.parts.items():
            try:
                done[name] = part.hypers_as_tensors(names)
            except ValueError as e:
                raise ValueError(f"MultiOptimizer part {name!r}: {e}") from None
        return done

    def hypers_as_floats(self, names: Any = None) -> dict[str, tuple[str, ...]]:
        """``HPOptimizer.hypers_as_floats`` on every part (floats again, read
        from each part's mirror): the names each part still holds as tensors.

        Examples:
            >>> body, head = nn.Linear(8, 16), nn.Linear(16, 3)
            >>> multi = MultiOptimizer({
            ...     "body": torch.optim.AdamW(body.parameters(), lr=1e-3),
            ...     "head": torch.optim.SGD(head.parameters(), lr=0.1)})
            >>> _ = multi.hypers_as_tensors()
            >>> multi.hypers_as_floats(), multi.param_groups[1]["lr"]
            ({'body': (), 'head': ()}, 0.1)
        """
        return {name: p.hypers_as_floats(names) for name, p in self.parts.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        if set_to_none is not True:  # (per batch: the default goes unchecked)
            set_to_none = check_flag(  # 'no' would be taken as True
                set_to_none, "set_to_none", "MultiOptimizer.zero_grad",
                "zero_grad(set_to_none=False)",
            )  # fmt: skip
        for part in self.parts.values():
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """Every part's ``HPOptimizer.state_dict()``, by part name."""
        return {"parts": {name: p.state_dict() for name, p in self.parts.items()}}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("parts") if isinstance(state, dict) else None
        if not isinstance(saved, dict) or list(saved) != list(self.parts):
            found = (
                list(saved)
                if isinstance(saved, dict)
                else "none (not a MultiOptimizer's)"
            )
            raise ValueError(
                f"MultiOptimizer.load_state_dict: the state holds parts {found}, "
                f"this optimizer has {list(self.parts)}. Fix: load the state of "
                "a MultiOptimizer with the same parts, in the same order."
            )
        for name, part in self.parts.items():
            part.load_state_dict(saved[name])

    def __repr__(self) -> str:
        inner = ", ".join(f"{n!r}: {p!r}" for n, p in self.parts.items())
        return f"MultiOptimizer({{{inner}}})"

    # -- hyper-parameters ------------------------------------------------------
    def has(self, name: str) -> bool:
        """Whether every part has hyper-parameter ``name``."""
        return all(part.has(name) for part in self.parts.values())

    def missing(self, name: str) -> list[str]:
        """The parts whose optimizer lacks hyper-parameter ``name``."""
        return [n for n, part in self.parts.items() if not part.has(name)]

    def get(self, name: str) -> list[float]:
        """The value of ``name`` for every group of every part, in part order."""
        self._check_has(name)
        return [v for part in self.parts.values() for v in part.get(name)]

    def set(self, name: str, value: HyperParam | Mapping[str, Any]) -> None:
        """Sets ``name``: one number for all, one value per group (all parts'
        groups, in order), or a dict part name -> value for those parts."""
        for part, v in self._split(name, value):
            _per_part(part.set, name, v, self._name_of(part, value))

    def set_lr(self, lr: Any, name: str = "lr") -> None:
        """Sets the learning rate as ``HPOptimizer.set_lr`` does, over all the
        parts' groups; a dict gives each part its own (a number, one per
        group of the part, or a slice spread over the part's groups)."""
        values = self.spread_lr(lr, name)
        for part, v in self._split("lr", values):
            part.set("lr", v)  # (checked and spread by spread_lr)

    def spread_lr(self, lr: Any, name: str = "lr") -> list[float]:
        """One learning rate per group of every part (``lr_per_group``, per
        part for a dict)."""
        counts = {n: len(part.param_groups) for n, part in self.parts.items()}
        return spread_over_parts(lr, counts, name)

    def set_scheduled(self, name: str, value: HyperParam) -> None:
        for part, v in self._split(name, value):  # (each step: kept lean)
            part.set_scheduled(name, v)

    def scale(self, name: str, factors: HyperParam) -> None:
        for part, f in self._split(name, factors):
            _per_part(part.scale, name, f, self._name_of(part, factors))

    def reset_scales(self) -> None:
        for part in self.parts.values():
            part.reset_scales()

    # -- internals -------------------------------------------------------------
    def _name_of(self, part: HPOptimizer, value: Any) -> str | None:
        """The name of ``part`` when ``value`` is a dict by part (so a message
        names ``lr['encoder']``), else None."""
        if not isinstance(value, Mapping):
            return None
        return next(n for n, p in self.parts.items() if p is part)

    def hyper_names(self) -> list[str]:
        """What every part's optimizer has (``HPOptimizer.hyper_names``): what
        ``get``, ``set`` and a schedule of every part can name."""
        parts = list(self.parts.values())
        return [n for n in parts[0].hyper_names() if all(p.has(n) for p in parts)]

    def _check_has(self, name: str) -> None:
        missing = self.missing(name)
        if len(missing) == len(self.parts) and name not in NAMES:
            self.parts[missing[0]].get(name)  # its message: what it has instead
        if missing:
            kinds = {n: type(self.parts[n].opt).__name__ for n in missing}
            raise ValueError(
                f"the part(s) {kinds} have no hyper-parameter {name!r}, so it "
                f"cannot be read or set for every part. Fix: set it per part "
                f"({example_setting(name).replace('opt', 'opt[part]', 1)}) on "
                f"the parts that have it: "
                f"{[n for n in self.parts if n not in missing]}."
            )

    def _split(self, name: str, value: Any) -> list[tuple[HPOptimizer, Any]]:
        """(part, its value) pairs: a dict by part name, a number to each, a
        sequence over all groups cut into the parts' groups."""
        if isinstance(value, Mapping):
            _check_not_empty(value, list(self.parts), name)
            check_part_names(value, list(self.parts), name, every=False)
            return [(self.parts[k], v) for k, v in value.items()]
        if name != "wd" or _nonzero(value):  # (wd=0 without weight decay: fine)
            self._check_has(name)
        many = isinstance(value, Iterable) and not isinstance(value, (str, bytes))
        if many and not is_hyper_number(value):  # (not a 0-dim tensor either)
            values = list(value)
            if len(values) != len(self.param_groups):
                raise ValueError(count_mismatch(name, values, len(self.param_groups)))
            out, start = [], 0
            for part in self.parts.values():
                n = len(part.param_groups)
                out.append((part, values[start : start + n]))
                start += n
            return out
        return [(part, value) for part in self.parts.values()]


def spread_over_parts(
    lr: Any, counts: Mapping[str, int], name: str = "lr"
) -> list[float]:
    """One learning rate per group of every part (``counts``: part name ->
    its number of groups), from what ``check_lr`` accepts: a dict gives each
    part its own (a number, one per group of the part, or a slice spread over
    the part's groups); anything else is spread over all the groups."""
    if isinstance(lr, Mapping):
        _check_not_empty(lr, list(counts), name)
    check_lr(lr, name)
    if not isinstance(lr, Mapping):
        return lr_per_group(lr, sum(counts.values()), name)
    check_part_names(lr, list(counts), name, every=True)
    return [
        v
        for part, n in counts.items()
        for v in lr_per_group(lr[part], n, f"{name}[{part!r}]")
    ]


def check_part_names(
    values: Mapping, parts: list[str], name: str, every: bool, example: str = "1e-3"
) -> None:
    """Refuses a dict by part whose keys name no part (or, ``every``, leave
    one out), naming ``name``, the argument; ``example`` is a part's value
    the fix shows. The part names themselves must be non-empty strings."""
    for part in parts:
        _check_part_name(part)
    unknown = [k for k in values if k not in parts]
    absent = [k for k in parts if k not in values] if every else []
    if unknown or absent:
        what = f"names no part {unknown}" if unknown else f"leaves out {absent}"
        shown = parts if every else parts[:1]
        pairs = ", ".join(f"{k!r}: {example}" for k in shown)
        which = "one value per part" if every else "keys that name parts"
        raise ValueError(
            f"{name}: the dict {what}; the parts are {parts}. Fix: {which}, "
            f"e.g. {name}={{{pairs}}}."
        )


def as_optimizer(opt: Any) -> HPOptimizer | MultiOptimizer:
    """What ``fit`` trains with: an ``HPOptimizer`` or a ``MultiOptimizer`` as
    it is, a torch optimizer wrapped, a dict (or list) of them made into a
    ``MultiOptimizer`` (a list's parts are named ``"0"``, ``"1"``...)."""
    if isinstance(opt, MultiOptimizer):
        return opt
    if isinstance(opt, Mapping):
        return MultiOptimizer(opt)
    if isinstance(opt, (list, tuple)):
        return MultiOptimizer({str(i): o for i, o in enumerate(opt)})
    return HPOptimizer.wrap(opt)


def _check_parts(parts: Any) -> dict[str, HPOptimizer]:
    if not isinstance(parts, Mapping) or not parts:
        raise (ValueError if isinstance(parts, Mapping) else ArgTypeError)(
            f"MultiOptimizer: parts must be a non-empty dict of part name -> "
            f"optimizer; got {_short(parts)}. Fix: e.g. MultiOptimizer("
            "{'encoder': opt_enc, 'decoder': opt_dec})."
        )
    out: dict[str, HPOptimizer] = {}
    owner: dict[int, str] = {}
    for name, opt in parts.items():
        _check_part_name(name)
        if isinstance(opt, MultiOptimizer):
            raise TypeError(
                f"MultiOptimizer: part {name!r} is itself a MultiOptimizer. Fix: "
                "give its parts here, one level deep."
            )
        if not isinstance(opt, HPOptimizer | torch.optim.Optimizer):
            what = f"the class {opt.__name__}" if isinstance(opt, type) else None
            raise ArgTypeError(
                f"MultiOptimizer: part {name!r} must be a torch optimizer (or an "
                f"HPOptimizer) over that part's parameters; got "
                f"{what or _short(opt)}. Fix: e.g. {{{name!r}: torch.optim.SGD("
                f"model.{name}.parameters(), lr=0.1)}} (in a Learner: opt_func="
                f"{{{name!r}: torch.optim.SGD, ...}})."
            )
        out[name] = HPOptimizer.wrap(opt)
        for group in out[name].param_groups:
            for p in group["params"]:
                if id(p) in owner and owner[id(p)] != name:
                    raise ValueError(
                        f"MultiOptimizer: parts {owner[id(p)]!r} and {name!r} "
                        f"share a parameter of shape {tuple(p.shape)}: both would "
                        "step it. Fix: give each parameter to one part only."
                    )
                owner[id(p)] = name
    return out


def _check_part_name(name: Any) -> None:
    if not isinstance(name, str) or not name:
        raise ArgTypeError(
            f"part names (the keys of opt_func, or of MultiOptimizer's parts) "
            f"must be non-empty strings, submodule names; got {name!r} "
            f"({type(name).__name__}). Fix: name each part, "
            "e.g. 'encoder'; for one optimizer over the whole model, no dict: "
            "opt_func=torch.optim.Adam."
        )


def _check_not_empty(values: Mapping, parts: list[str], name: str) -> None:
    if not values:
        raise ValueError(
            f"{name}: the dict by part is empty; the parts are {parts}. Fix: "
            f"one number for every part, or a value per part, e.g. "
            f"{name}={{{parts[0]!r}: 1e-3}}."
        )


def _check_active(names: Any, parts: list[str]) -> tuple[str, ...]:
    """``active`` as a tuple of part names, at least one."""
    if isinstance(names, str) or not isinstance(names, tuple | list):
        fix = f"({names!r},)" if isinstance(names, str) else f"({parts[0]!r},)"
        raise ArgTypeError(
            f"MultiOptimizer: active must be a tuple of part names, or None for "
            f"every part; got {names!r} ({type(names).__name__}). Fix: e.g. "
            f"active={fix}."
        )
    unknown = [n for n in names if n not in parts]
    if unknown or not names:
        what = f"no part {unknown[0]!r}" if unknown else "is empty"
        raise ValueError(
            f"MultiOptimizer: active names {what}; the parts are {parts}. Fix: "
            f"e.g. active=({parts[0]!r},), or None to step every part."
        )
    return tuple(names)


def _per_part(method: Any, name: str, value: Any, part: str | None) -> None:
    """``method(name, value)`` on one part; a refusal of a dict's value names
    the part (``lr['encoder']``)."""
    if part is None:
        method(name, value)
        return
    fix = f"Fix: e.g. {example_setting(name, f'{{{part!r}: ...}}')}."
    if value is None:
        raise ArgTypeError(
            f"{name}[{part!r}] must be a number (or one per parameter group of "
            f"part {part!r}); got None. {fix}"
        )
    try:
        method(name, value)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}[{part!r}]: {e}") from None


def _short(value: Any) -> str:
    text = repr(value)
    return (
        text if len(text) < 80 else text[:77] + "..."
    ) + f" ({type(value).__name__})"


def _nonzero(value: Any) -> bool:
    values = [value] if is_hyper_number(value) else value
    return any(v != 0 for v in values)


def _collapse_dict(values: dict[str, Any]) -> Any:
    first = next(iter(values.values()))
    return first if all(v == first for v in values.values()) else values
