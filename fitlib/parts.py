"""A model split into parts and layer groups: the parameters each optimizer
of a ``Learner`` steps (one part, ``""``, or one per submodule named in
``opt_func``), and within a part the layer groups that discriminative learning
rates and ``freeze_to`` address."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from fitlib.multi_optimizer import check_part_names


def by_part(value: Any) -> dict[str, Any]:
    """A per-part setting as a dict (one setting for all: under ``""``)."""
    return dict(value) if isinstance(value, dict) else {"": value}


def part_groups(
    model: nn.Module, opt_func: Any, layer_groups: Any
) -> dict[str, list[list]]:
    """Each part's layer groups (one part, ``""``, without several
    optimizers). A part is a submodule, named by ``opt_func``'s keys; its
    layer groups split it, as ``layer_groups`` splits a whole model."""
    if not isinstance(opt_func, dict):
        if isinstance(layer_groups, dict):
            raise TypeError(
                "Learner: layer_groups is a dict by part, but opt_func is one "
                "optimizer class (no parts). Fix: a list of groups, or opt_func="
                "{part: class, ...}."
            )
        return {"": split_groups(model, layer_groups)}
    if not opt_func:
        raise ValueError(
            "Learner: opt_func is an empty dict. Fix: one optimizer class per "
            "part, e.g. {'encoder': torch.optim.Adam, 'decoder': torch.optim.SGD}."
        )
    if layer_groups is not None and not isinstance(layer_groups, dict):
        raise TypeError(
            f"Learner: with one optimizer per part ({list(opt_func)}), "
            "layer_groups must be a dict part name -> its groups. Fix: e.g. "
            f"layer_groups={{{next(iter(opt_func))!r}: [body, head]}}."
        )
    check_part_names(layer_groups or {}, list(opt_func), "layer_groups", every=False,
                     example="[body, head]")  # fmt: skip
    parts = {name: _submodule(model, name) for name in opt_func}
    out = {n: split_groups(m, (layer_groups or {}).get(n)) for n, m in parts.items()}
    _check_part_cover(model, out)
    return out


def _submodule(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        children = [n for n, _ in model.named_children()]
        raise ValueError(
            f"Learner: opt_func names a part {name!r}, but model "
            f"{type(model).__name__} has no submodule {name!r}; its children "
            f"are {children}. Fix: name submodules (a dotted path works: "
            "'encoder.rnn')."
        ) from None


def _check_part_cover(model: nn.Module, parts: dict[str, list[list]]) -> None:
    owner: dict[int, str] = {}
    for part, groups in parts.items():
        for p in (p for g in groups for p in g):
            if id(p) in owner:
                raise ValueError(
                    f"Learner: parts {owner[id(p)]!r} and {part!r} overlap (one "
                    "is inside the other, or they share a layer): both "
                    "optimizers would step the same parameters. Fix: name "
                    "disjoint submodules."
                )
            owner[id(p)] = part
    left = [n for n, p in model.named_parameters()
            if id(p) not in owner and p.requires_grad]  # fmt: skip
    if left:
        raise ValueError(
            f"Learner: {len(left)} trainable parameter(s) of the model are in no part "
            f"({list(parts)}), e.g. {left[:3]}: no optimizer would train them. "
            "Fix: add their module as a part in opt_func, or make the parts "
            "cover the model."
        )


def split_groups(model: nn.Module, groups: Sequence[Any] | None) -> list[list]:
    groups = [model] if groups is None else list(groups)
    out, seen = [], set()
    for g in groups:
        params = list(g.parameters()) if isinstance(g, nn.Module) else list(g)
        out.append([p for p in params if id(p) not in seen])
        seen.update(id(p) for p in params)
    missing = [n for n, p in model.named_parameters() if id(p) not in seen]
    if missing:
        raise ValueError(
            f"layer_groups leave {len(missing)} model parameter(s) out, e.g. "
            f"{missing[:3]}. Fix: put every part of the model in some group."
        )
    return out
