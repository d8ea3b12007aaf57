"""``CSVLogger``: one row per record (per epoch, or per validation inside one)
in a CSV file, durable after each row.

Each row is flushed and fsynced as it is written, so a crash loses at most
the row being written. After a resume (a fit that begins with
``iteration > 0`` at epoch E, restored by a Checkpoint) the rows of epochs
>= E, written after that checkpoint, are removed first (the file is
rewritten atomically) so the resumed run appends without duplicates.
"""

from __future__ import annotations

import csv
import os
import tempfile
from pathlib import Path
from typing import Any

from fitlib.callback import Callback
from fitlib.checks import check_flag, check_path
from fitlib.record import Record
from fitlib.serialization import atomic_write
from fitlib.tracking import check_state_keys

_STATE_KEYS = ("first_row",)
# What a CSVLogger saved before the epoch record kept the epoch's sums.
_OLD_STATE_KEYS = ("first_row", "epoch", "epoch_loss", "epoch_seconds")


class CSVLogger(Callback):
    """Writes a row per record (per epoch, or per validation inside one, then
    with its step): the record (epoch, train_loss,
    valid_loss, the metrics, every value added to the record, lr, time).

    ``train_loss`` is the sample-weighted mean of the epoch's training
    losses; ``lr`` that of the last parameter group as the epoch's last
    optimizer step used it; ``time`` the epoch's seconds. A value not computed
    (a skipped validation) leaves its cell empty (pandas reads it as NaN), so
    "not computed" differs from a computed ``nan``. Values are written in
    full precision. The header, the record's names, is written with the
    first row, when the file is new or empty.

    ``append=True`` adds the rows of each fit to the file; ``append=False``
    starts a new file at each fit that starts afresh. Either way a resumed fit
    keeps the rows of the epochs before the one it resumes and removes the
    later ones. Appending to a file whose header differs (other metrics)
    raises. Rows torn by a crash during a write are removed.

    Args:
        path: the CSV file; its missing parent directories are created. A
            path that cannot be written is refused when the logger is made.
        append: keep the rows already in the file (True) or start anew.

    Examples:
        >>> history = fit(3, model, F.cross_entropy, opt, data, metrics=[accuracy],
        ...               callbacks=[CSVLogger("logs/run1.csv")])
        >>> print(open("logs/run1.csv").read())
        epoch,train_loss,valid_loss,accuracy,lr,time
        0,1.12...,1.09...,0.46875,0.1,...
        1,1.03...,1.05...,0.5,0.1,...
        2,0.98...,1.03...,0.5,0.1,...
    """

    order = 55  # after the callbacks that change training, and the Recorder
    in_lr_find = False  # a sweep is not part of the run it records
    main_only = True  # under torch.distributed, rank 0 alone

    def __init__(self, path: str | os.PathLike, append: bool = True) -> None:
        self.path = _check_path(path)
        _check_writable(self.path)
        # append=True keeps the rows already in the file, False starts anew.
        self.append = check_flag(
            append, "append", "CSVLogger", "CSVLogger(path, append=True)"
        )
        self.columns: list[str] = []
        self._first_row: int | None = None  # where this fit's rows start
        self._heading = False  # the fit's first row is still to come
        self._header: list[str] = []  # the file's, as read

    # -- hooks -----------------------------------------------------------------
    def on_train_begin(self, iteration: int, epoch: int, step: int) -> None:
        """Runs before training: prepares the file (and trims it on a resume)."""
        _check_path(self.path)
        _make_parent(self.path)
        _check_writable(self.path)
        if iteration == 0:
            rows, changed = self._read() if self.append else ([], True)
            self._first_row = len(rows)
        else:
            rows, torn = self._read()
            # Rows of records inside an epoch carry their step: those before
            # the resumed position stay (the resumed fit will not redo them).
            where = (epoch, step, _column(self._header, "step"))
            kept, self._first_row = _rows_before(rows, where, self._first_row)
            rows, changed = kept, torn or kept != rows
        if changed or not self.path.is_file():
            self._rewrite(rows)
        # The columns are the record's names: the first row checks them
        # against the file's header, or writes the header to an empty file.
        self._heading = True

    def on_epoch_end(self, record: Record) -> None:
        """Runs after validation: writes the epoch's record as a row."""
        lines = []
        if self._heading:
            self._heading = False
            lines = self._head(list(record))
        if list(record) != self.columns:
            raise ValueError(
                f"CSVLogger: epoch {record['epoch']}'s record has the names "
                f"{list(record)}, but the file's columns are {self.columns}. Fix: "
                "add the same values every epoch (a callback declares them in "
                "record_names; None where not computed)."
            )
        lines.append(["" if v is None else v for v in record.values()])
        self._append(lines)

    def _head(self, columns: list[str]) -> list[list[str]]:
        """Checks the file's header against ``columns``; returns the header
        to write with the first row when the file has none."""
        header = self._header
        if header and header != columns:
            raise ValueError(
                f"CSVLogger: {str(self.path)!r} has the columns {header}, but "
                f"this fit writes {columns}. Fix: CSVLogger(path, append=False) "
                "to start a new file, or log to another path."
            )
        self.columns = columns
        return [] if header else [columns]

    # -- the file --------------------------------------------------------------
    def _read(self) -> tuple[list[list[str]], bool]:
        """The file's rows (header excluded, kept in ``_header``), and whether
        some were torn."""
        self._header: list[str] = []
        if not self.path.is_file():
            return [], False
        with open(self.path, newline="") as f:
            text = f.read()
        lines = list(csv.reader(text.splitlines()))
        self._header = lines[0] if lines else []
        if not lines:
            return [], False
        # Every row ends with a line break: a last line without one was torn.
        whole = lines[1:] if text.endswith("\n") else lines[1:-1]
        rows = [r for r in whole if len(r) == len(lines[0]) and r[0].isdigit()]
        return rows, len(rows) != len(lines) - 1

    def _rewrite(self, rows: list[list[str]]) -> None:
        """The file's header and ``rows`` (none: an empty file), atomically: a
        crash leaves the old or new file (with the mode a plain ``open()``
        gives, or the old file's)."""
        if not rows:
            self._header = []  # the first row writes this fit's
        with atomic_write(self.path, "w", newline="") as f:
            csv.writer(f).writerows([self._header, *rows] if rows else [])

    def _append(self, rows: list[list[Any]]) -> None:
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerows(rows)
            f.flush()
            os.fsync(f.fileno())

    # -- saving ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where this fit's rows start (the epoch's sums are the loop's)."""
        return {"first_row": self._first_row}

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict``; the resumed fit trims the file from it."""
        if not (isinstance(state, dict) and set(state) == set(_OLD_STATE_KEYS)):
            check_state_keys(state, _STATE_KEYS, "CSVLogger")
        self._first_row = state["first_row"]

    def __repr__(self) -> str:
        return f"{self.name}({str(self.path)!r}, append={self.append})"


def _rows_before(
    rows: list[list[str]], where: tuple, first: int | None
) -> tuple[list[list[str]], int]:
    """The rows to keep when resuming at ``where`` (epoch, step, and the step
    column, or None), and where this fit's rows start.

    This fit's rows start at ``first`` (restored from the checkpoint); before
    that are earlier fits' rows, kept whatever their epochs. Without it, this
    fit's rows are taken to be the trailing rows of epochs >= ``epoch``. Of
    the resumed epoch, the rows of records at steps up to ``step`` stay.
    """
    epoch, step, column = where

    def before(row: list[str]) -> bool:
        if int(row[0]) != epoch or column is None:
            return int(row[0]) < epoch
        return int(row[column]) <= step

    if first is None:
        first = len(rows)
        while first and int(rows[first - 1][0]) >= epoch:
            first -= 1
    first = min(first, len(rows))
    return rows[:first] + [r for r in rows[first:] if before(r)], first


def _column(header: list[str], name: str) -> int | None:
    return header.index(name) if name in header else None


def _check_path(path: Any) -> Path:
    fix = "'logs/run.csv'"
    path = check_path(path, "path", owner="CSVLogger", what="a file path", example=fix)
    if path.is_dir():
        raise ValueError(
            f"CSVLogger: path {str(path)!r} is a directory; it must name a file. "
            f"Fix: e.g. CSVLogger({str(path / 'log.csv')!r})."
        )
    return path


def _check_writable(path: Path) -> None:
    """Raises before training unless the logger can rewrite and append to
    ``path`` (its first existing ancestor stands for missing directories)."""
    try:
        folder = next(p for p in (path.parent, *path.parent.parents) if p.exists())
        if folder.is_dir():
            with tempfile.TemporaryFile(dir=folder):  # as the rewrites' temporaries
                pass
        if path.is_file():
            with open(path, "a"):  # rows are appended (nothing is written here)
                pass
    except OSError as e:
        raise ValueError(
            f"CSVLogger: cannot write {str(path)!r} ({e.strerror or e}). Fix: "
            "pass a path in a directory you can write to (and a file you may "
            "change)."
        ) from e
    if not folder.is_dir():
        raise ValueError(
            f"CSVLogger: cannot create the directory of {str(path)!r}: a part of "
            f"it is a file ({str(folder)!r}). Fix: choose a path whose parents "
            "are directories (or do not exist yet)."
        )


def _make_parent(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        raise ValueError(
            f"CSVLogger: cannot create the directory of {str(path)!r}: a part of "
            f"it is a file ({e}). Fix: choose a path whose parents are "
            "directories (or do not exist yet)."
        ) from e
