"""Helpers that make errors say what was received and where it came from.

The bottom layer: every module may import it; it imports only torch.
"""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Iterable
from typing import Any, NoReturn

import torch

# Built-in exception types whose constructor takes just a message: these are
# re-raised as the same type with a fuller message.
_PLAIN = (TypeError, ValueError, RuntimeError, IndexError)


def describe(x: Any) -> str:
    """Types and shapes of a value, for messages: ``(Tensor(shape=(64,), int64),)``.

    Examples:
        >>> from fitlib.errors import describe
        >>> describe((torch.zeros(2, 3), [1]))
        '(Tensor(shape=(2, 3), float32), [int])'
    """
    if isinstance(x, torch.Tensor):
        return f"Tensor(shape={tuple(x.shape)}, {str(x.dtype).removeprefix('torch.')})"
    if isinstance(x, (tuple, list)):
        inner = ", ".join(describe(v) for v in x[:4])
        inner += f", ... {len(x)} items" if len(x) > 4 else ""
        if isinstance(x, list):
            return f"[{inner}]"
        return f"({inner},)" if len(x) == 1 else f"({inner})"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in x.items()) + "}"
    return type(x).__name__


def name_of(f: Any) -> str:
    """A function's name for messages (``partial`` and callable objects too)."""
    f = getattr(f, "func", f)  # functools.partial
    return getattr(f, "__name__", type(f).__name__)


def add_note(exc: BaseException, note: str) -> None:
    """Adds ``note`` to ``exc``'s traceback (its message on Python 3.10)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
        return
    # Python 3.10: keep the notes as 3.11 does, and show them in the message,
    # since its tracebacks do not print __notes__.
    exc.__notes__ = [*getattr(exc, "__notes__", []), note]
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{note}", *exc.args[1:])


def reraise(exc: Exception, message: str, as_type: type | None = None) -> NoReturn:
    """Raises ``exc`` again with ``message`` first, keeping its type.

    Call it in an ``except`` block. A plain TypeError, ValueError, RuntimeError
    or IndexError is raised as a new exception of the same type (or of
    ``as_type`` when given, e.g. ValueError for torch's RuntimeError about
    shapes; a TypeError stays one), chained to the original; any other type
    (an out-of-memory error, a user's own exception) is raised as it is, with
    ``message`` as a note.
    """
    if type(exc) in _PLAIN:
        new = type(exc) if as_type is None or type(exc) is TypeError else as_type
        raise new(f"{message}\nIt said: {exc}") from exc
    add_note(exc, message)
    raise exc


class ArgTypeError(TypeError, ValueError):
    """An argument of the wrong type (``fitlib.checks.check_int`` and
    ``check_number`` raise it). A TypeError, and a ValueError too: several of
    those checks raised ValueError for every bad value before they shared one
    helper, and ``except ValueError`` around them must keep working."""


def is_number(x: Any) -> bool:
    """A real number (int, float, numpy's), not a bool: what numeric arguments
    are checked with."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_int(x: Any) -> bool:
    """An int (Python's or numpy's), not a bool: what counts are checked with."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def did_you_mean(name: Any, choices: Iterable[str], cutoff: float = 0.6) -> str:
    """`` (did you mean 'x'?)`` for the choice closest to ``name``, or ``""``.

    The one wording of every check of a name (monitors, state keys, hooks,
    record names): put it right after the name that was not found.

    Examples:
        >>> from fitlib.errors import did_you_mean
        >>> did_you_mean("valid_los", ["valid_loss", "accuracy"])
        " (did you mean 'valid_loss'?)"
    """
    close = closest(name, choices, cutoff)
    return "" if close is None else f" (did you mean {close!r}?)"


def closest(name: Any, choices: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The choice closest to ``name`` (``difflib``'s ratio >= ``cutoff``), or
    None: what ``did_you_mean`` names."""
    if not isinstance(name, str):
        return None
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=cutoff)
    return close[0] if close else None


def unknown_name(
    owner: str, what: str, name: Any, choices: Iterable[str], fix: str
) -> str:
    """The message for a ``name`` that is not among ``choices``: the owner,
    the name, the close one (``did_you_mean``), the choices and the fix.

    Examples:
        >>> from fitlib.errors import unknown_name
        >>> unknown_name("f", "event", "on_epochend", ["on_epoch_end"], "rename it.")
        "f: unknown event 'on_epochend' (did you mean 'on_epoch_end'?); the events
        are 'on_epoch_end'. Fix: rename it."
    """
    choices = list(choices)
    plural = what + ("es" if what.endswith(("s", "x", "ch", "sh")) else "s")
    return (
        f"{owner}: unknown {what} {name!r}{did_you_mean(name, choices)}; the "
        f"{plural} are {', '.join(map(repr, choices))}. Fix: {fix}"
    )


def and_others(unknown: list[str]) -> str:
    """`` (and 'b', 'c')``: the unknown names after the first, which the
    message names (``unknown_name``); "" when there is one."""
    return f" (and {', '.join(map(repr, unknown[1:]))})" if unknown[1:] else ""
