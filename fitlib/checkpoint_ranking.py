"""The files ``Checkpoint`` keeps for their value: ``BestFiles`` (``best.pth``
and the k best by a monitored value), its ranking ``TopK``, and their
record in ``dirpath``, ``.fitlib-best.json``.

The record holds what each file kept for its value is worth: the value of
``best.pth`` and by what it was judged, and every ranking's files and values
(one per monitor and mode). It is rewritten atomically right after the files
it describes change (the file first, then the record, then the files pushed
out are deleted), so it is never older than the newest checkpoint, as the
ranking saved in the regular checkpoints may be (``every_n_epochs=2``,
``every_n_seconds``). A run that starts afresh reads it; a resumed run
continues the ranking of the checkpoint it resumes from (and replays what
came after it, rewriting the same files under the same names). A record
that is damaged is warned about and the ranking starts over; a file it does
not list is never overwritten or deleted: a fresh run treats every file
already in ``dirpath`` as taken (a name it would reuse gets ``-v1``,
``-v2``...), and a file ranked by another monitor is left alone (with one
warning).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import fitlib.ranks as ranks
from fitlib.checkpoint_files import CHECKPOINT_NAME, why_unloadable
from fitlib.checkpoint_names import FileTemplate
from fitlib.checks import check_int, check_number
from fitlib.monitor import Monitor
from fitlib.serialization import atomic_write, safe_load

RECORD = ".fitlib-best.json"  # what the files kept for their value are worth
BEST = "best.pth"


class TopK:
    """The ``k`` best values seen and their files, best first.

    A value enters when it beats ``threshold`` (if any) and, once ``k`` files
    are kept, the worst of them; a tie keeps the earlier file (as
    ``Monitor``: only a better value counts), and NaN never enters. ``k=None``
    keeps every value that beats the threshold.

    Examples:
        >>> from fitlib.checkpoint_ranking import TopK
        >>> top = TopK(2, "valid_loss", "min")
        >>> top.admit(0.5, "a.pth"), top.admit(0.4, "b.pth")
        (('a.pth', []), ('b.pth', []))
        >>> top.admit(0.45, "c.pth")  # enters; a.pth, now third, goes
        ('c.pth', ['a.pth'])
        >>> top.admit(0.45, "d.pth"), top.admit(float("nan"), "e.pth")
        ((None, []), (None, []))
        >>> top.names()
        ['b.pth', 'c.pth']
    """

    def __init__(
        self, k: int | None, monitor: str, mode: str, threshold: float | None = None
    ) -> None:
        self.k, self.monitor, self.mode, self.threshold = k, monitor, mode, threshold
        self.entries: list[tuple[float, str]] = []  # (value, file name), best first
        self.taken: set[str] = set()  # others' files: never written over, kept
        self.dropped: list[str] = []  # pushed out as a longer ranking was loaded

    def better(self, a: float, b: float) -> bool:
        """Whether ``a`` beats ``b`` (False when either is NaN)."""
        return a < b if self.mode == "min" else a > b

    def admit(self, value: float | None, name: str) -> tuple[str | None, list[str]]:
        """Ranks ``value``: the name to write it under (``name``, made unique
        among the kept files with ``-v1``...), or None when it does not enter;
        and the names of the files it pushed out."""
        if value is None or math.isnan(value):
            return None, []
        if self.threshold is not None and not self.better(value, self.threshold):
            return None, []
        full = self.k is not None and len(self.entries) >= self.k
        if full and not self.better(value, self.entries[-1][0]):
            return None, []
        at = next(
            (i for i, (v, _) in enumerate(self.entries) if self.better(value, v)),
            len(self.entries),
        )
        if self.k is not None and at >= self.k:
            return None, []
        name = self._unique(name)
        self.entries.insert(at, (float(value), name))
        out = self.entries[self.k :] if self.k is not None else []
        del self.entries[len(self.entries) - len(out) :]
        return name, [n for _, n in out]

    def _unique(self, name: str) -> str:
        taken = set(self.names()) | self.taken
        stem, n, unique = name.removesuffix(".pth"), 0, name
        while unique in taken:
            n += 1
            unique = f"{stem}-v{n}.pth"
        return unique

    def names(self) -> list[str]:
        """The kept files' names, best first."""
        return [n for _, n in self.entries]

    def keep_existing(self, dirpath: Path) -> None:
        """Drops the entries whose file is gone from ``dirpath``."""
        self.entries = [(v, n) for v, n in self.entries if (dirpath / n).is_file()]

    def state_dict(self) -> dict:
        """What is ranked, and by what: plain values."""
        files = [[v, n] for v, n in self.entries]
        taken = sorted(self.taken)
        return {"monitor": self.monitor, "mode": self.mode, "files": files,
                "taken": taken}  # fmt: skip

    def load_state_dict(self, state: Any) -> None:
        """Restores ``state_dict`` (of the same monitor and mode), cut to the
        ``k`` best: the names cut are in ``dropped``."""
        if not self.same_monitor(state):
            raise ValueError(
                f"Checkpoint: the saved ranking is {state!r}, not of "
                f"{self.monitor!r} ({self.mode}). Fix: resume with the monitor "
                "and mode of the run that saved, or Checkpoint(resume=False)."
            )
        self.entries = [(float(v), str(n)) for v, n in state["files"]]
        self.taken = {str(n) for n in state.get("taken", ())}
        cut = self.entries[self.k :] if self.k is not None else []
        self.entries = self.entries[: len(self.entries) - len(cut)]
        self.dropped = [n for _, n in cut]

    def same_monitor(self, state: Any) -> bool:
        """Whether a saved ranking ranks by this monitor and mode."""
        keys = isinstance(state, dict) and {"monitor", "mode", "files"} <= set(state)
        return keys and (state["monitor"], state["mode"]) == (self.monitor, self.mode)

    def __repr__(self) -> str:
        return f"TopK({self.k}, {self.monitor!r}, {self.mode!r}, {self.entries})"


class BestFiles:
    """What ``Checkpoint`` keeps for its value: ``best.pth`` (with
    ``save_best``) and the ``save_top_k`` best files named by ``template``,
    judged by ``monitor`` from ``threshold`` on (``initial_value_threshold``).

    It decides which files a record earns (``judge``); ``Checkpoint`` writes
    them; then ``settle`` deletes the files pushed out and updates the
    record ``.fitlib-best.json``. ``start`` begins a fit: a resumed one from
    the ranking of its checkpoint, a fresh one from the record (see the
    module's notes).

    Examples:
        >>> from fitlib.checkpoint_ranking import BestFiles
        >>> from fitlib.checkpoint_names import FileTemplate
        >>> from fitlib.monitor import Monitor
        >>> files = BestFiles("runs/best-files", Monitor("valid_loss", "min"),
        ...                   top_k=2, template=FileTemplate("e{epoch}"))
        >>> files.start(None)  # a fresh run; nothing there yet
        >>> files.judge({"epoch": 0, "valid_loss": 0.5}, step=7, iteration=7)
        ['best.pth', 'e0.pth']
    """

    def __init__(
        self,
        dirpath: str | os.PathLike,
        monitor: Monitor,
        save_best: bool = True,
        top_k: int | None = None,
        template: FileTemplate | None = None,
        threshold: float | None = None,
    ) -> None:
        self.dirpath, self.monitor = Path(dirpath), monitor
        self.save_best, self.threshold, self.template = save_best, threshold, template
        self.top_k = None  # the k best files' ranking (top_k; -1: every one)
        if top_k is not None:
            k = None if top_k == -1 else top_k
            self.top_k = TopK(k, monitor.name, monitor.mode, threshold)
        self._out: list[str] = []  # pushed out, deleted once the new file is in
        self._best: float | None = None  # best.pth's new value, to record
        self.reset()

    @property
    def judging(self) -> bool:
        """Whether records are judged: for best.pth, or for the top-k files."""
        return self.save_best or self.top_k is not None

    def reset(self) -> None:
        """The monitor's best starts at the threshold, if any."""
        self.monitor.reset()
        if self.threshold is not None:
            self.monitor.best = float(self.threshold)

    # -- the start of a fit ----------------------------------------------------
    def start(self, saved: dict | None) -> None:
        """Begins a fit: ``saved`` is the checkpoint a resumed fit loaded (its
        ``"monitor"`` and ``"top_k"``), None for a fresh one."""
        self._out, self._best = [], None
        self.reset()
        if saved is not None:
            if saved.get("monitor") is not None:
                self.monitor.load_state_dict(saved["monitor"])
            if self.top_k is not None and saved.get("top_k") is not None:
                self.top_k.load_state_dict(saved["top_k"])
                self._drop_cut()
            return
        record = self._read_record()
        if self.top_k is not None:
            self._start_ranking(record)
        if self.save_best:
            self._start_best(record)

    def _start_ranking(self, record: dict) -> None:
        """A fresh run's ranking: the record's of the same monitor and mode,
        its files still there; every other file in dirpath is taken."""
        top, ours = self.top_k, (self.top_k.monitor, self.top_k.mode)
        top.entries, top.taken = [], set()
        others = []
        for ranking in record.get("rankings", ()):
            if (ranking["monitor"], ranking["mode"]) == ours:
                top.load_state_dict({**ranking, "taken": ()})
                top.keep_existing(self.dirpath)
                self._drop_cut()
            else:
                others += [n for _, n in ranking["files"] if self._on_disk(n)]
        top.taken = set(self._on_disk_names()) - set(top.names())
        if others and ranks.is_main():
            warnings.warn(
                f"Checkpoint: {', '.join(others)} in {str(self.dirpath)!r} are "
                f"ranked by {_rankers(record, ours)} (of an earlier run); they "
                "are left alone: this run "
                f"ranks by {watched(self.monitor)} and names its files apart.",
                UserWarning,
                stacklevel=4,
            )
        if top.entries:
            _say(
                f"fitlib: Checkpoint: {', '.join(top.names())} in "
                f"{str(self.dirpath)!r} rank by {watched(self.monitor)} (of an "
                "earlier run); this run keeps the best of theirs and its own."
            )

    def _start_best(self, record: dict) -> None:
        """A fresh run's best starts from ``best.pth`` of the same quantity:
        the value inside a whole checkpoint, else the record's."""
        path = self.dirpath / BEST
        if not path.is_file():
            return
        try:
            saved = safe_load(path, map_location="cpu", mmap=True)  # weights unread
        except ValueError as e:  # damaged: its best value is lost
            warnings.warn(
                f"Checkpoint: {str(path)!r} {why_unloadable(e, path)}; this run "
                "starts the best over: the first value it judges replaces that "
                "file.",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        whole = isinstance(saved, dict) and "fitlib_checkpoint" in saved
        kept = saved.get("monitor") if whole else record.get("best")
        ours = watched(self.monitor)
        if watched(kept) != ours:
            _say(
                f"fitlib: Checkpoint: {str(path)!r} kept the best "
                f"{watched(kept) or 'of no known monitor'}; this run watches "
                f"{ours} and replaces it with its best."
            )
            return
        value = float(kept["best"])
        then = "a better value"
        if self.monitor.is_improvement(value) or self.threshold is None:
            self.monitor.best = value
        else:  # the threshold is stricter
            then = f"a value better than initial_value_threshold ({self.threshold:g})"
        _say(
            f"fitlib: Checkpoint: {str(path)!r} holds the best {ours} so far "
            f"({value:.6g}, of an earlier run); this run replaces it only with "
            f"{then}."
        )

    # -- judging ---------------------------------------------------------------
    def judge(self, record: dict, step: int, iteration: int) -> list[str]:
        """The files (names in dirpath) that ``record`` earns, best.pth first;
        what they push out goes at ``settle``."""
        value = self.monitor.read(record)
        if value is None:
            return []
        names = []
        if self.monitor.update(value) and self.save_best:
            names.append(BEST)
            self._best = float(value)
        if self.top_k is not None:
            name = self.template.fill(record, step, iteration)
            name, out = self.top_k.admit(value, name)
            if name is not None:
                names.append(name)
            self._out += [n for n in out if n != name]
        return names

    def settle(self, wrote: bool) -> None:
        """After the files ``judge`` named are written (``wrote``): updates
        the record, then deletes the files pushed out (rank 0)."""
        if not ranks.is_main():
            self._out, self._best = [], None
            return
        if wrote or self._out:
            self._write_record()
        for name in self._out:
            (self.dirpath / name).unlink(missing_ok=True)
        self._out, self._best = [], None

    def _drop_cut(self) -> None:
        """Deletes the files a ranking cut to k pushed out (rank 0)."""
        self._out += self.top_k.dropped
        self.top_k.dropped = []
        if self._out:
            self.settle(False)

    # -- the record ------------------------------------------------------------
    def _read_record(self) -> dict:
        """The record, checked; ``{}`` when missing or damaged (warned)."""
        path = self.dirpath / RECORD
        try:
            record = json.loads(path.read_text())
            _check_record(record)
            return record
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, KeyError) as e:
            if ranks.is_main():
                warnings.warn(
                    f"Checkpoint: {str(path)!r}, the record of the files kept for "
                    f"their value, cannot be read ({type(e).__name__}: {e}); this "
                    "run starts the ranking over and leaves the files in "
                    f"{str(self.dirpath)!r} alone (it names its own apart).",
                    RuntimeWarning,
                    stacklevel=5,
                )
            return {}

    def _write_record(self) -> None:
        path = self.dirpath / RECORD
        try:
            record = json.loads(path.read_text())
            _check_record(record)
        except (OSError, ValueError, TypeError, KeyError):
            record = {}
        record = {"fitlib_best_files": 1, **record}
        if self._best is not None:
            record["best"] = {**self.monitor.state_dict(), "best": self._best}
        if self.top_k is not None:
            ours = self.top_k.state_dict()
            del ours["taken"]  # (the checkpoints' state: this run's own)
            same = (ours["monitor"], ours["mode"])
            rankings = [r for r in record.get("rankings", ())
                        if (r["monitor"], r["mode"]) != same]  # fmt: skip
            record["rankings"] = [*rankings, ours]
        with atomic_write(path, "w") as f:
            json.dump(record, f, indent=1)

    def _on_disk(self, name: str) -> bool:
        return (self.dirpath / name).is_file()

    def _on_disk_names(self) -> list[str]:
        """The files a template could name over: ``*.pth`` but the regular
        checkpoints and best.pth."""
        names = [p.name for p in self.dirpath.glob("*.pth")]
        return [n for n in names if n != BEST and not CHECKPOINT_NAME.fullmatch(n)]

    def __repr__(self) -> str:
        return f"BestFiles({str(self.dirpath)!r}, {self.monitor!r}, {self.top_k!r})"


def _check_record(record: Any) -> None:
    """Raises ValueError unless ``record`` has the shape ``_write_record`` gives."""
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    best = record.get("best")
    if best is not None and not {"monitor", "mode", "best"} <= set(best):
        raise ValueError("its 'best' lacks an entry")
    rankings = record.get("rankings", [])
    if not isinstance(rankings, list):
        raise ValueError("its 'rankings' is not a list")
    for r in rankings:
        if not isinstance(r, dict) or not {"monitor", "mode", "files"} <= set(r):
            raise ValueError("a ranking lacks an entry")
        files = r["files"]
        if not all(isinstance(n, str) and float(v) == float(v) for v, n in files):
            raise ValueError("a ranking holds an odd entry")
        if any(os.sep in n or "/" in n for _, n in files):
            raise ValueError("a ranking names a file outside the directory")


def watched(monitor: Any) -> str | None:
    """``"valid_loss (min)"``: what a Monitor or its saved state watches (None:
    no monitor)."""
    if isinstance(monitor, Monitor):
        return f"{monitor.name} ({monitor.mode})"
    if not isinstance(monitor, dict) or "monitor" not in monitor:
        return None
    return f"{monitor['monitor']} ({monitor.get('mode')})"


def _rankers(record: dict, ours: tuple) -> str:
    """The other monitors of the record's rankings: ``"score (min)"``."""
    found = [f"{r['monitor']} ({r['mode']})" for r in record.get("rankings", ())
             if (r["monitor"], r["mode"]) != ours]  # fmt: skip
    return ", ".join(found)


def _say(message: str) -> None:
    if ranks.is_main():  # one line, not one per process
        print(message)


def check_best_options(
    monitor: Any,
    save_top_k: Any,
    filename: Any,
    threshold: Any,
    weights_only: bool,
    save_best: bool = True,
) -> None:
    """Refuses, as ``Checkpoint`` is made, the options of the best files that
    lack what they need: each needs ``monitor``, ``filename`` the
    ``save_top_k`` files it names, and a threshold or ``save_weights_only``
    a file to apply to (``best.pth`` or the top-k)."""
    if save_top_k is not None and save_top_k != -1:
        try:
            check_int(save_top_k, "save_top_k", minimum=1, owner="Checkpoint",
                      example=3)  # fmt: skip
        except ValueError as e:
            said = str(e).replace(">= 1;", ">= 1, or -1 (keep every one);", 1)
            raise type(e)(said) from None
    check_number(threshold, "initial_value_threshold", below=math.inf,
                  above=-math.inf, what="a finite number", owner="Checkpoint",
                  example=0.5, allow_none=True)  # fmt: skip
    given = {"save_top_k": save_top_k, "initial_value_threshold": threshold}
    given["save_weights_only"] = weights_only or None
    needs = [f"{k}={v!r}" for k, v in given.items() if v is not None]
    if monitor is None and needs:
        raise ValueError(
            f"Checkpoint: {', '.join(needs)} needs monitor=, the value that "
            "ranks the files kept for their value (best.pth and the top-k). Fix: "
            f"Checkpoint(dir, monitor='valid_loss', {needs[0]})."
        )
    if filename is not None and save_top_k is None:
        raise ValueError(
            f"Checkpoint: filename={filename!r} names the files of the k best "
            "(save_top_k), which is not given; the regular checkpoints keep "
            "their numbered names (checkpoint-<n>.pth), by which a resume finds "
            "the newest. Fix: Checkpoint(dir, monitor='valid_loss', save_top_k=3, "
            f"filename={filename!r})."
        )
    idle = [k for k in ("initial_value_threshold", "save_weights_only")
            if given[k] is not None]  # fmt: skip
    if monitor is not None and not save_best and save_top_k is None and idle:
        raise ValueError(
            f"Checkpoint: {idle[0]}={given[idle[0]]!r} applies to the files kept "
            "for their value, and there are none: save_best=False and no "
            "save_top_k. Fix: leave save_best=True (best.pth), or add "
            f"save_top_k=3, or drop {idle[0]}."
        )
