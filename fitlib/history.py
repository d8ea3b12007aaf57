"""``History``: what ``fit`` returns, the records of one fit.

A list of the records (dicts), so code that indexes it, takes its length or
compares it with a list works as with a plain list; its repr is one line,
so a notebook cell that ends in ``learn.fit(...)`` shows a summary under the
results table rather than every record again. ``table()`` and ``plot()``
show it all (matplotlib imported when a plot is made).
"""

from __future__ import annotations

from typing import Any

import torch

import fitlib.plots as plots

# Not values of the model: where a record is, and the run's settings.
_PLACE = ("epoch", "step", "lr", "time")
_SHOWN = 3  # values in the repr; table() has them all
NA = "#na#"  # a value not computed (validation skipped), here and in the bar's table


class History(list):
    """The records of one fit, one per epoch (or per validation inside one),
    in order: ``fit``, ``Learner.fit`` and the ``fit_*`` shortcuts return it.

    It is a list of the record dicts (``epoch``, ``train_loss``,
    ``valid_loss``, each metric, ..., ``lr``, ``time``; see ``fitlib.fit``);
    ``learn.recorder.epoch_table()`` keeps the records of every fit.

    Attributes:
        stop_reason: why the fit stopped before its end (``EarlyStopping``'s
            rule, a time limit, ``max_steps``, a callback's
            ``stop_training``), or None when every epoch ran.
        suspended: True when a time limit suspended the fit (``suspend``):
            rerun it with a ``Checkpoint`` and it goes on; False when it
            finished. A job script requeues while this is True.

    Examples:
        >>> history = learn.fit(3, lr=1e-2)
        >>> history
        History(3 epochs: train_loss 1.1... -> 0.91..., valid_loss 1.0... -> 1.0...,
                accuracy 0.40... -> 0.5)
        >>> history[-1]["accuracy"]
        0.5
        >>> print(history.table())
        epoch     train_loss  valid_loss  accuracy  lr        time
        0         1.12...     1.07...     0.406250  1.00e-02  ...
        1         0.99...     1.03...     0.500000  1.00e-02  ...
        2         0.91...     1.00...     0.500000  1.00e-02  ...
        >>> history.plot()
        [<Axes: xlabel='epoch', ylabel='loss'>,
         <Axes: xlabel='epoch', ylabel='accuracy'>]
    """

    # Why the fit stopped before its epochs ran out (``EarlyStopping``'s
    # rule, a time limit, ``max_steps``), the state's last ``stop_reason``;
    # None when every epoch ran.
    stop_reason: str | None = None
    # True when the fit was suspended (a time limit: ``suspend``) and a rerun
    # with a ``Checkpoint`` goes on; False when it finished (its epochs or
    # steps, a stopping rule, or a rerun of a finished run).
    suspended: bool = False

    def __getitem__(self, index: Any) -> Any:
        """One record, or a ``History`` of a slice of them."""
        got = super().__getitem__(index)
        return History(got) if isinstance(index, slice) else got

    def __repr__(self) -> str:
        where = _count(len(self), "epoch")
        if self and "step" in self[0]:  # validations inside epochs
            epochs = len({record["epoch"] for record in self})
            where = f"{_count(len(self), 'record')} in {_count(epochs, 'epoch')}"
        names = _value_names(self)
        changes = [s for s in (_change(self, n) for n in names) if s]
        shown, more = changes[:_SHOWN], len(changes) - _SHOWN
        tail = f"; {more} more value{'s' * (more > 1)} in .table()" if more > 0 else ""
        return f"History({where}{': ' if shown else ''}{', '.join(shown)}{tail})"

    def table(self) -> str:
        """Every value of every record as a text table, one row per record
        (``#na#``: not computed), its columns aligned; "" when empty.

        Examples:
            >>> print(learn.fit(2, lr=1e-3).table())
            epoch     train_loss  valid_loss  accuracy  lr        time
            0         1.15...     1.16...     0.312500  1.00e-03  ...
            1         1.14...     1.15...     0.343750  1.00e-03  ...
        """
        if not self:
            return ""
        names = list(dict.fromkeys(name for record in self for name in record))
        rows = [names] + [[cell(n, record.get(n)) for n in names] for record in self]
        widths = [max(8, *(len(row[i]) for row in rows)) for i in range(len(names))]
        lines = ("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)
        return "\n".join(line.rstrip() for line in lines)

    def plot(self, ax: Any = None) -> Any:
        """The losses on one panel, and each metric on its own (a training
        metric, ``train_<name>``, or a loss part, ``valid_<part>``, with its
        name), per epoch, or per step when the fit validated inside epochs. A
        value not computed is a gap.

        Args:
            ax: the matplotlib Axes to draw into, a sequence of one per panel
                when there are several; None: a new pyplot figure.

        Returns:
            The Axes, or a list of them when there are several panels.
        """
        if not self:
            raise ValueError(
                "History.plot: the history has no record (no epoch finished). "
                "Fix: plot the history of a fit that ran at least one epoch."
            )
        inside = "step" in self[0]
        x = [record["step" if inside else "epoch"] for record in self]
        panels = plots.metric_panels(_value_names(self), self)
        unit = "step" if inside else "epoch"
        return plots.per_epoch(ax, x, panels, "History.plot", xlabel=unit)


def _value_names(history: list[dict]) -> list[str]:
    """The model's values of the records (losses, metrics, parts, added)."""
    names = dict.fromkeys(name for record in history for name in record)
    return [name for name in names if name not in _PLACE]


def _change(history: list[dict], name: str) -> str:
    """``name first -> last`` over the records with a value, or ``name v``."""
    values = [r[name] for r in history if isinstance(r.get(name), (int, float))]
    if not values:
        return ""
    if len(values) == 1:
        return f"{name} {values[0]:.4g}"
    return f"{name} {values[0]:.4g} -> {values[-1]:.4g}"


def cell(name: str, value: Any) -> str:
    """A record value as a table shows it (``History.table`` and
    ``ProgressBar``'s): ``#na#`` when not computed, ``epoch`` and ``step`` as
    ints, ``time`` as a clock, ``lr`` in exponent form, a number to 6 decimals.

    Examples:
        >>> from fitlib.history import cell
        >>> cell("time", 75.2), cell("accuracy", 0.5), cell("valid_loss", None)
        ('01:15', '0.500000', '#na#')
    """
    if value is None:
        return NA
    if name in ("epoch", "step"):
        return str(value)
    if name == "time":
        return clock(value)
    if name == "lr":  # from 1e-7 on: in exponent form
        return f"{value:.2e}"
    return f"{value:.6f}" if isinstance(value, (int, float)) else str(value)


def clock(seconds: float) -> str:
    """``mm:ss``, or ``h:mm:ss`` past an hour (``75.2`` -> ``'01:15'``)."""
    s = int(seconds)
    h, m = s // 3600, s // 60 % 60
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m:02d}:{s % 60:02d}"


def _count(n: int, unit: str) -> str:
    return f"{n} {unit}{'s' * (n != 1)}"


# A History inside a file that torch.save wrote (a checkpoint's extra entry)
# loads with torch.load's default weights_only=True: a list of dicts of
# numbers, nothing to run. (It cannot pickle as a plain list instead: that
# unpickler builds lists from the list opcode only, never by calling list.)
torch.serialization.add_safe_globals([History])
