"""A ``Summary`` drawn: ``as_text``, a table for a terminal or a log whose
lines are at most ``WIDTH`` (100) columns (the widest columns cut with ``…``
until it fits), and ``as_html``, the same tables for a notebook, escaped and
uncut; ``shape_text`` writes a shape of ``summary.shape_of`` the way both
show it. ``Summary`` builds nothing here: ``str(summary)`` and
``summary._repr_html_()`` call these.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fitlib.summary import Summary

LAYER_COLUMNS = ["layer", "type", "output shape", "params", "trainable"]
WIDTH = 100  # the text's widest line: a terminal, a log, a notebook cell


def shape_text(shape: Any) -> str:
    """``shape_of``'s result as text: ``[16, 3]``, ``([16, 5, 32], [1, 16,
    32])``, ``{logits: [16, 3], box: [16, 4]}``; ``?`` for None.

    Examples:
        >>> from fitlib.summary_text import shape_text
        >>> shape_text((torch.Size([16, 5, 32]), {"h": torch.Size([1, 16])}))
        '([16, 5, 32], {h: [1, 16]})'
    """
    if shape is None:
        return "?"
    if isinstance(shape, torch.Size):
        return "[" + ", ".join(str(n) for n in shape) + "]"
    if isinstance(shape, tuple):
        return "(" + ", ".join(shape_text(s) for s in shape) + ")"
    if isinstance(shape, dict):
        return "{" + ", ".join(f"{k}: {shape_text(s)}" for k, s in shape.items()) + "}"
    return str(shape)


# -- text ------------------------------------------------------------------------
def as_text(s: Summary) -> str:
    """The summary as text (``str(summary)``): the model's input and output,
    the layer table, the parameter counts and notes, then the optimizer's
    groups, the callbacks and the precision; no line wider than ``WIDTH``.

    Examples:
        >>> from fitlib.summary import summarize
        >>> from fitlib.summary_text import as_text
        >>> print(as_text(summarize(nn.Linear(3, 2))))
        Linear: input ?, output ?
        layer    type    output shape  params  trainable
        -------  ------  ------------  ------  ---------
        (model)  Linear  ?                  8  yes
        Parameters: 8 total, 8 trainable, 0 frozen (32 B)
        Note: no data: output shapes unknown (?)
        <BLANKLINE>
        Precision: fp32 (weights float32)
    """
    lines = _sections(s)
    return "\n".join(
        line if len(line) <= WIDTH else line[: WIDTH - 1] + "…" for line in lines
    )


def _sections(s: Summary) -> list[str]:
    where = "" if s.input_shape is None else " (the first training batch)"
    lines = [
        f"{s.model}: input {shape_text(s.input_shape)}{where}, "
        f"output {shape_text(s.output_shape)}"
    ]
    lines += _table(
        LAYER_COLUMNS,
        _layer_cells(s),
        right={3},
        cut_left={0},
    )
    lines.append(_totals(s))
    lines += [f"Note: {n}" for n in s.notes]
    if s.groups or s.optimizer:
        lines += ["", f"Optimizer: {s.optimizer or 'none given'}"]
        header, cells, right = _group_cells(s)
        lines += _table(header, cells, right=right)
        lines += [f"{h}: set at every step by {cb} (shown: before its first step)"
                  for h, cb in s.scheduled.items()]  # fmt: skip
    if s.callbacks:
        cells = [[str(order), name] for order, name in s.callbacks]
        lines += ["", "Callbacks, in the order they run:"]
        lines += _table(["order", "callback"], cells, right={0})
    return [*lines, "", f"Precision: {s.precision}"]


def _layer_cells(s: Summary) -> list[list[str]]:
    cells = []
    for info in s.layers:
        shape = shape_text(info.shape)
        if info.calls > 1:
            shape += f" x{info.calls}"
        trainable = _trainable_word(info.params, info.trainable)
        name = info.name or "(model)"
        cells.append([name, info.type, shape, f"{info.params:,}", trainable])
    return cells


def _trainable_word(params: int, trainable: int) -> str:
    if not params:
        return "-"
    return "yes" if trainable == params else "no" if not trainable else "partly"


def _totals(s: Summary) -> str:
    return (
        f"Parameters: {s.total:,} total, {s.trainable:,} trainable, "
        f"{s.frozen:,} frozen ({_size(s.size_bytes)})"
    )


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _group_cells(s: Summary) -> tuple[list[str], list[list[str]], set[int]]:
    hypers = list(dict.fromkeys(k for g in s.groups for k in g.hypers))
    parts = any(g.part for g in s.groups)
    several = len({g.optimizer for g in s.groups}) > 1
    header = ["group", *(["part"] if parts else []), "params", "trainable"]
    header += [*(["optimizer"] if several else []), *hypers]
    cells = []
    for g in s.groups:
        row = [str(g.index), *([g.part] if parts else [])]
        row += [f"{g.params:,}", f"{g.trainable:,}"]
        row += [*([g.optimizer or ""] if several else [])]
        row += [_hyper_text(g.hypers.get(k, "")) for k in hypers]
        cells.append(row)
    texts = {"group", "part", "optimizer"}
    return header, cells, {i for i, h in enumerate(header) if h not in texts}


def _hyper_text(value: Any) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(_hyper_text(v) for v in value) + ")"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _table(
    header: list[str],
    cells: list[list[str]],
    right: set[int] = frozenset(),
    cut_left: set[int] = frozenset(),
) -> list[str]:
    """Aligned columns two spaces apart, at most ``WIDTH`` wide: the widest
    columns are cut (with ``…``: at the start in ``cut_left``, else at the
    end) until the table fits."""
    rows = [header, *cells]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    while sum(widths) + 2 * (len(widths) - 1) > WIDTH and max(widths) > 12:
        widths[widths.index(max(widths))] -= 1
    lines = []
    for n, row in enumerate([header, ["-" * w for w in widths], *cells]):
        texts = []
        for i, (text, w) in enumerate(zip(row, widths, strict=True)):
            if len(text) > w:
                text = "…" + text[-w + 1 :] if i in cut_left else text[: w - 1] + "…"
            texts.append(text.rjust(w) if i in right and n > 1 else text.ljust(w))
        lines.append("  ".join(texts).rstrip())
    return lines


# -- HTML ------------------------------------------------------------------------
def as_html(s: Summary) -> str:
    """The summary as HTML (``summary._repr_html_()``, what a notebook
    shows): the text's sections as paragraphs and tables, every value
    escaped, no name cut.

    Examples:
        >>> from fitlib.summary import summarize
        >>> from fitlib.summary_text import as_html
        >>> as_html(summarize(nn.Linear(3, 2))).count("<table>")
        1
    """
    esc = html.escape
    parts = [
        f"<div><p><b>{esc(s.model)}</b>: input <code>{esc(shape_text(s.input_shape))}"
        f"</code>, output <code>{esc(shape_text(s.output_shape))}</code></p>",
        _html_table(LAYER_COLUMNS, _layer_cells(s), right={3}),
        f"<p>{esc(_totals(s))}</p>",
        *(f"<p>Note: {esc(n)}</p>" for n in s.notes),
    ]
    if s.groups or s.optimizer:
        parts.append(f"<p><b>Optimizer</b>: {esc(s.optimizer or 'none given')}</p>")
        header, cells, right = _group_cells(s)
        parts.append(_html_table(header, cells, right=right))
        parts += [f"<p>{esc(h)}: set at every step by {esc(cb)}</p>"
                  for h, cb in s.scheduled.items()]  # fmt: skip
    if s.callbacks:
        cells = [[str(order), name] for order, name in s.callbacks]
        parts.append("<p><b>Callbacks</b>, in the order they run:</p>")
        parts.append(_html_table(["order", "callback"], cells, right={0}))
    parts.append(f"<p><b>Precision</b>: {esc(s.precision)}</p></div>")
    return "\n".join(parts)


def _html_table(header: list[str], cells: list[list[str]], right: set[int]) -> str:
    def row(tag: str, values: list[str]) -> str:
        tds = "".join(
            f'<{tag} style="text-align:{"right" if i in right else "left"}">'
            f"{html.escape(v)}</{tag}>"
            for i, v in enumerate(values)
        )
        return f"<tr>{tds}</tr>"

    body = "".join(row("td", r) for r in cells)
    return f"<table><thead>{row('th', header)}</thead><tbody>{body}</tbody></table>"
