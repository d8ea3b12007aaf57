"""How the handler calls a hook: with the state keys the hook names.

A hook with ``**kwargs`` receives the whole state as keyword arguments. One
without receives only the keys its parameters name, positionally where it can:
Python matches every keyword passed against the parameter names, which costs
about a microsecond per call for the whole state, and the per-batch hooks run
several times per batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from operator import itemgetter
from typing import Any

from fitlib.errors import did_you_mean


def hook_caller(
    hook: Callable, where: str, valid: tuple[str, ...]
) -> Callable[[dict], Any]:
    """A function ``call(state)`` that calls ``hook`` with the keys it names.

    ``where`` names the hook in errors (``"Recorder.on_batch_end"``); ``valid``
    are the keys the state holds. Raises a TypeError for a parameter that can
    never be passed: ``*args``, positional-only, or a name no key matches
    (unless it has a default, which it then keeps).

    Examples:
        >>> from fitlib.dispatch import hook_caller
        >>> call = hook_caller(lambda epoch: epoch + 1, "f", ("epoch", "train"))
        >>> call({"epoch": 2, "train": True})
        3
    """
    try:
        params = list(inspect.signature(hook).parameters.values())
    except (TypeError, ValueError):  # no signature to read: pass everything
        return lambda state: hook(**state)
    _check_params(params, where, valid)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return lambda state: hook(**state)
    names = [p.name for p in params if p.name in valid]
    if len(names) < len(params) or any(p.kind is p.KEYWORD_ONLY for p in params):
        return lambda state: hook(**{k: state[k] for k in names})
    # Positional arguments: Python binds them without comparing names.
    if not names:
        return lambda state: hook()
    if len(names) == 1:
        name = names[0]
        return lambda state: hook(state[name])
    get = itemgetter(*names)
    return lambda state: hook(*get(state))


def receives(hook: Callable, key: str) -> bool:
    """Whether ``hook`` gets the state key ``key``: it names it or takes all."""
    try:
        params = inspect.signature(hook).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == key or p.kind is p.VAR_KEYWORD for p in params)


def _check_params(
    params: list[inspect.Parameter], where: str, valid: tuple[str, ...]
) -> None:
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
    for p in params:
        # With **kwargs, *args stays empty (a decorator's wrapper, say).
        if p.kind is p.POSITIONAL_ONLY or (
            p.kind is p.VAR_POSITIONAL and not takes_all
        ):
            star = "*" if p.kind is p.VAR_POSITIONAL else ""
            raise TypeError(
                f"{where} takes {star}{p.name} positionally; hooks receive the "
                "state by name, so *args and positional-only parameters get "
                "nothing. Fix: name the keys you read, e.g. (self, last_loss, "
                "**kwargs)."
            )
    unknown = [
        f"{p.name!r}{did_you_mean(p.name, valid)}"
        for p in params
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        and p.name not in valid
        and p.default is p.empty
    ]
    if unknown:
        raise TypeError(
            f"{where} requires parameter(s) {', '.join(unknown)}, which "
            "no state key matches, so nothing would ever be passed to them. "
            f"Parameters take the state keys' names: {', '.join(valid)}. "
            "Fix: rename them; add **kwargs to receive every key."
        )
