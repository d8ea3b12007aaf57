"""The drawing behind ``Recorder``'s plots, on plain lists of numbers.

matplotlib's convention: a plot draws into the Axes it is given, or into a new
figure made through pyplot and left open, which a notebook shows once at the
end of the cell and a script on ``plt.show()``; it returns the Axes it drew
into (a list for several panels). matplotlib is imported when a plot is made,
so ``import fitlib`` does not need it. A helper: imports nothing of fitlib's.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Iterable
from typing import Any

MARKERS = "ov^sDP*X"  # one per LR finder suggestion


def losses(
    ax: Any,
    steps: list[int],
    per_step: dict[str, list[float]],
    ends: list[int],
    per_epoch: dict[str, list[float]],
) -> Any:
    """Per-step curves (the first faint, the others over it in its colour), and
    per-epoch values at each epoch's last step: the first in that colour as
    squares, the next as a line with dots. All-NaN series are left out."""
    (ax,) = _panels(ax, ["loss"], "plot_losses")
    (raw_name, raw), *smoothed = per_step.items()
    color = {"color": ax.plot(steps, raw, alpha=0.3, label=raw_name)[0].get_color()}
    for name, values in smoothed:
        ax.plot(steps, values, **color, label=name)
    styles = [("s", color), ("o-", {})]
    for (name, values), (fmt, kw) in zip(per_epoch.items(), styles, strict=False):
        if any(not math.isnan(v) for v in values):
            ax.plot(ends, values, fmt, **kw, label=name)
    ax.set(xlabel="iteration", ylabel="loss")
    ax.legend()
    return ax


def per_step(ax: Any, steps: list[int], panels: dict[str, list], where: str) -> Any:
    """One panel per entry of ``panels``: its values against the iteration."""
    axes = _panels(ax, list(panels), where)
    for panel, (name, values) in zip(axes, panels.items(), strict=True):
        panel.plot(steps, values)
        panel.set(xlabel="iteration", ylabel=name)
    return axes if len(axes) > 1 else axes[0]


def per_epoch(
    ax: Any,
    epochs: list[int],
    panels: dict[str, dict[str, list]],
    where: str,
    xlabel: str = "epoch",
) -> Any:
    """One panel per entry of ``panels``, each a line per ``{label: values}``
    (values per epoch, or at ``epochs`` in the unit ``xlabel`` names: dots
    joined; a legend when a panel has several)."""
    axes = _panels(ax, list(panels), where)
    from matplotlib.ticker import MaxNLocator  # (_panels checked it is there)

    for panel, (name, lines) in zip(axes, panels.items(), strict=True):
        for label, values in lines.items():
            panel.plot(epochs, values, "o-", label=label)
        panel.set(xlabel=xlabel, ylabel=name)
        panel.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs, steps
        if len(lines) > 1:
            panel.legend()
    return axes if len(axes) > 1 else axes[0]


def metric_panels(names: list[str], rows: list[dict]) -> dict[str, dict[str, list]]:
    """``{panel: {name: values}}`` for ``per_epoch``: each name's values over
    ``rows`` (NaN, a gap, where a row lacks it or holds None), ``train_x`` and
    ``valid_x`` in the panel of ``x`` (or of each other), in the order of
    ``names``."""
    panels: dict[str, dict[str, list]] = {}
    for name in names:
        values = [_number(row.get(name)) for row in rows]
        panels.setdefault(_panel_of(name), {})[name] = values
    return panels


def lr_find(ax: Any, result: dict, skip_start: int, skip_end: int) -> Any:
    """An LR finder sweep (``{"lrs", "losses", "suggestions"}``): the loss
    against the lr on a log axis, ends left out, the spike clipped, every
    suggestion marked."""
    (ax,) = _panels(ax, ["loss"], "plot_lr_find")
    lrs, values = result["lrs"], result["losses"]
    first, stop = _plotted(len(lrs), skip_start, skip_end)
    ax.plot(lrs[first:stop], values[first:stop])
    markers = itertools.cycle(MARKERS)
    for (name, lr), marker in zip(result["suggestions"].items(), markers):
        _mark(ax, name, lr, marker, lrs, values, first, stop)
    ax.set(xscale="log", xlabel="learning rate", ylabel="loss (smoothed)")
    _clip_y(ax, values[first:stop])
    if result["suggestions"]:
        ax.legend()
    return ax


def _panel_of(name: str) -> str:
    """The panel of a value: ``train_x`` and ``valid_x`` go with ``x`` (or
    with each other), anything else is its own."""
    for prefix in ("train_", "valid_"):
        if name.startswith(prefix) and len(name) > len(prefix):
            return name[len(prefix) :]
    return name


def _number(value: Any) -> Any:
    return math.nan if value is None else value


def load_pyplot() -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "Plots (Recorder, History) need matplotlib. Fix: pip install matplotlib "
            "(or fitlib's plot extra)."
        ) from e
    return plt


def _panels(ax: Any, names: list[str], where: str) -> list:
    """One Axes per panel in ``names``: ``ax`` checked, else a new pyplot
    figure's (left open: pyplot shows it)."""
    plt, n = load_pyplot(), len(names)
    if ax is None:
        size = (6.4, 4.8) if n == 1 else (4.4 * n, 4.0)
        _, axes = plt.subplots(1, n, squeeze=False, figsize=size, layout="constrained")
        return list(axes[0])
    from matplotlib.axes import Axes

    if isinstance(ax, Axes):
        given = [ax]
    else:  # a list, or the array of plt.subplots
        given = list(getattr(ax, "flat", ax)) if isinstance(ax, Iterable) else [ax]
    if not all(isinstance(a, Axes) for a in given):
        raise TypeError(
            f"{where}: ax must be a matplotlib Axes, or a sequence of Axes (one "
            f"per panel); got {ax!r}. Fix: e.g. fig, ax = plt.subplots(1, {n})."
        )
    if len(given) != n:
        panels = ", ".join(names)
        raise ValueError(
            f"{where} draws {n} panel(s) ({panels}) and needs {n} Axes in ax, "
            f"one per panel; got {len(given)}. Fix: e.g. fig, ax = "
            f"plt.subplots(1, {n}), or ax=None for a new figure."
        )
    return given


def _plotted(n: int, skip_start: int, skip_end: int) -> tuple[int, int]:
    """The slice of a sweep of ``n`` points that ``lr_find`` draws."""
    keep = max(n - skip_start - skip_end, min(n, max(2, n // 2)))
    drop = n - keep
    if drop < skip_start + skip_end:  # a short sweep: both skips shrink
        skip_start = drop * skip_start // (skip_start + skip_end)
    return skip_start, skip_start + keep


def _mark(
    ax: Any,
    name: str,
    lr: Any,
    marker: str,
    lrs: list,
    values: list,
    first: int,
    stop: int,
) -> None:
    """Marks suggestion ``name`` on the curve (hollow at the nearest plotted
    point when it lies in a left-out part), or only in the legend without a
    learning rate."""
    if not isinstance(lr, numbers.Real) or not 0 < lr < math.inf:
        ax.plot([], [], marker, label=f"{name}: none")
        return
    i = _nearest(lrs, lr)
    if first <= i < stop:
        ax.plot(lr, values[i], marker, markersize=8, label=f"{name}: {lr:.2e}")
        return
    j = min(max(i, first), stop - 1)
    label = f"{name}: {lr:.2e} (left out; at nearest)"
    ax.plot(lrs[j], values[j], marker, markersize=8, fillstyle="none", label=label)


def _clip_y(ax: Any, values: list[float]) -> None:
    """Tops the y-axis a little above the first loss when the curve later
    rises past it (the divergence), so that spike does not squash the rest."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite or not math.isfinite(values[0]):
        return
    low, start, high = min(finite), values[0], max(finite)
    span = start - low
    if span > 0 and high > start + 0.1 * span:
        ax.set_ylim(low - 0.05 * span, start + 0.1 * span)


def _nearest(values: list[float], x: float) -> int:
    """The index of the value nearest to ``x`` on a log scale."""
    return min(range(len(values)), key=lambda i: abs(math.log(values[i] / x)))
