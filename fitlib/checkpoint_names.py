"""The names of the files ``Checkpoint`` keeps for their value (its k best):
a template such as ``"{epoch:02d}-{valid_loss:.3f}"`` filled with a record's
values and the loop's counters (``FileTemplate``), checked before training.

The regular checkpoints keep their numbered names (``checkpoint-<n>.pth``):
a resume finds the newest by its number, whatever the template.
"""

from __future__ import annotations

import math
import os
import re
import string
from typing import Any

from fitlib.monitor import Monitor

COUNTERS = ("epoch", "step", "iteration")
DEFAULT_TEMPLATE = "epoch={epoch}-step={step}"
_RESERVED = re.compile(r"(checkpoint-\d+|best)\.pth")  # the other files' names


class FileTemplate:
    """A file-name template of ``Checkpoint(filename=...)``, checked.

    Fields name a value of the epoch record (``valid_loss``, a metric's
    name, ``train_loss``, a value a callback adds) or a counter: ``epoch``
    (the record's epoch, from 0), ``step`` (optimizer steps done) and
    ``iteration`` (training batches done). A format spec applies as in
    ``format()``; a value the record lacks this time is written ``nan``.
    ``.pth`` is appended unless the template ends with it.

    Examples:
        >>> from fitlib.checkpoint_names import FileTemplate
        >>> names = FileTemplate("{epoch:02d}-{valid_loss:.3f}")
        >>> names.fill({"epoch": 3, "valid_loss": 0.41237}, step=28, iteration=28)
        '03-0.412.pth'
        >>> names.record_names
        ['valid_loss']
    """

    def __init__(self, template: Any, owner: str = "Checkpoint") -> None:
        self.owner, self.template = owner, _check_text(template, owner)
        self.fields = _fields(self.template, owner)
        self.record_names = list(
            dict.fromkeys(n for n, _, _ in self.fields if n not in COUNTERS)
        )
        sample = self._sample()
        first = _parse(self.template)[0][0]  # the text before the first field
        # A number fills a field ("-3" too), so "checkpoint" then a field, or
        # "checkpoint-...", may give a regular checkpoint's name.
        if _RESERVED.fullmatch(sample) or first.startswith("checkpoint"):
            raise ValueError(
                f"{owner}: filename={self.template!r} gives names such as "
                f"{sample!r}, which may be the regular checkpoints' "
                "(checkpoint-<n>.pth) or best.pth's: a resume and keep_last "
                "would take them for regular checkpoints. Fix: begin it "
                "otherwise, e.g. filename='{epoch:02d}-{valid_loss:.3f}'."
            )

    def check(self, *fit: Any) -> None:
        """Checks, before training, that the record will have every field:
        ``fit`` is what ``Monitor.start`` takes (metrics, data, train_metrics,
        callbacks, loss_func)."""
        for name in self.record_names:
            try:
                Monitor(name, "min", owner=self.owner).start(*fit)
            except ValueError as e:
                said = f"monitor={name!r}"
                raise ValueError(
                    str(e)
                    .replace(
                        said,
                        f"filename={self.template!r} uses {{{name}}}, which",
                        1,
                    )
                    .replace(
                        "Fix: pass one of them",
                        f"Fix: use one of them or a counter ({', '.join(COUNTERS)})",
                        1,
                    )
                ) from None

    def fill(self, record: dict, step: int, iteration: int) -> str:
        """The file name for a record judged after ``step`` steps."""
        values = {**record, "step": step, "iteration": iteration}
        values.setdefault("epoch", 0)
        name = self._render(values)
        if _RESERVED.fullmatch(name):  # (a value a callback gave as a str)
            raise ValueError(
                f"{self.owner}: filename={self.template!r} filled with this "
                f"record gives {name!r}, one of the regular checkpoints' or "
                "best.pth's names. Fix: a template whose fields are numbers, "
                "e.g. filename='{epoch:02d}-{valid_loss:.3f}'."
            )
        return name

    def _render(self, values: dict) -> str:
        parts = []
        for literal, name, spec, conversion in _parse(self.template):
            parts.append(literal)
            if name is None:
                continue
            value = values.get(name)
            value = math.nan if value is None else value
            if conversion:
                value = {"r": repr, "s": str, "a": ascii}[conversion](value)
            parts.append(format(value, spec))
        name = "".join(parts)
        return name if name.endswith(".pth") else f"{name}.pth"

    def _sample(self) -> str:
        """The template filled with sample values: refuses a bad format spec."""
        sample = {n: 0 for n in COUNTERS} | {n: 0.5 for n in self.record_names}
        try:
            return self._render(sample)
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"{self.owner}: filename={self.template!r} has a format spec that "
                f"does not fit its value ({e}); counters ({', '.join(COUNTERS)}) "
                "are ints, record values floats. Fix: e.g. filename="
                "'{epoch:02d}-{valid_loss:.3f}'."
            ) from None

    def __repr__(self) -> str:
        return f"FileTemplate({self.template!r})"


def _check_text(template: Any, owner: str) -> str:
    if not isinstance(template, str) or not template.strip():
        raise TypeError(
            f"{owner}: filename must be a non-empty str template; got "
            f"{template!r}. Fix: e.g. filename='{{epoch:02d}}-{{valid_loss:.3f}}'."
        )
    bad = [s for s in ("/", os.sep) if s in template]
    if bad:
        raise ValueError(
            f"{owner}: filename={template!r} holds {bad[0]!r}: the files go in "
            "dirpath itself. Fix: a name without a directory, or another dirpath."
        )
    return template


def _parse(template: str) -> list[tuple[str, str | None, str | None, str]]:
    return list(string.Formatter().parse(template))


def _fields(template: str, owner: str) -> list[tuple[str, str | None, str]]:
    """Each field's name, conversion and spec; names are whole record names
    (``f0.5_score`` is one name, not an attribute)."""
    try:
        parsed = _parse(template)
    except ValueError as e:
        raise ValueError(
            f"{owner}: filename={template!r} is not a format template ({e}). Fix: "
            "fields in braces, e.g. '{epoch:02d}-{valid_loss:.3f}' (double a "
            "brace to write it: '{{')."
        ) from None
    fields = [(n, c, s or "") for _, n, s, c in parsed if n is not None]
    for name, _, spec in fields:
        if not name or name.isdigit() or "{" in spec:
            raise ValueError(
                f"{owner}: filename={template!r} has a field {{{name}}} that names "
                f"no value{' (nested fields are not filled)' if '{' in spec else ''}. "
                "Fix: name a counter ("
                f"{', '.join(COUNTERS)}) or a record value, e.g. '{{valid_loss:.3f}}'."
            )
    if not fields:
        raise ValueError(
            f"{owner}: filename={template!r} has no field, so every file kept "
            "would get the same name. Fix: e.g. "
            "filename='{epoch:02d}-{valid_loss:.3f}'."
        )
    return fields
