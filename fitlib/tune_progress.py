"""What ``fitlib.tune.search`` shows as trials end: a line per trial in a
terminal or a log, a table of the study's trials in a notebook."""

from __future__ import annotations

import math
from typing import Any

from fitlib.bars import fastprogress_module
from fitlib.tune_retries import NOTE, REQUEUE, best_trial, lineage


class TrialProgress:
    """A line per trial this worker ran (a terminal, a log), or in a notebook
    a table of the study's trials, redrawn after each."""

    def __init__(self, progress: bool | None, monitor: str) -> None:
        self.on, self.monitor = progress is not False, monitor
        self.handle: Any = None
        self.notebook = self.on and in_notebook()

    def nothing_to_run(self, study: Any, n_trials: int) -> None:
        """One line when the study already holds its trials (a rerun of a
        finished search): silence would read as a hang or a failure."""
        if not self.on:
            return
        best = best_trial(study)
        said = "" if best is None else f"; best: trial {best.number}, "
        said += "" if best is None else f"{self.monitor}={best.value:.6g}"
        print(f"search: the study already holds its {n_trials} trials: nothing to "
              f"run{said}", flush=True)  # fmt: skip

    def trial_done(self, study: Any, frozen: Any) -> None:
        if not self.on or frozen is None:
            return
        trial = study.get_trials(deepcopy=False)[frozen.number]
        if not self.notebook:
            print(trial_line(trial, best_trial(study), self.monitor), flush=True)
            return
        from IPython.display import HTML, display

        trials = study.get_trials(deepcopy=False)
        html = HTML(trials_html(trials, best_trial(study), self.monitor))
        if self.handle is None:
            self.handle = display(html, display_id=True)
        else:
            self.handle.update(html)


def trial_line(trial: Any, best: Any, monitor: str) -> str:
    """One trial as a line: ``trial 3 pruned at step 42: valid_loss 0.91 |
    lr=0.01, width=16 | best 0.42 (trial 1)``."""
    state = trial.state.name.lower()
    if trial.state.name == "PRUNED" and trial.intermediate_values:
        state += f" at step {max(trial.intermediate_values)}"
    why = trial.system_attrs.get(REQUEUE)
    if trial.state.name == "FAIL" and why is not None:  # queued again
        state = f"{why}: its retry resumes it from its checkpoint"
        if not why.startswith("suspended"):
            state = f"failed ({why}): its retry resumes it from its checkpoint"
        else:
            state += " on the next run"
    if lineage(trial) != trial.number:
        state = f"(retry of trial {lineage(trial)}) {state}"
    value = "" if trial.value is None else f": {monitor} {_num(trial.value)}"
    params = ", ".join(f"{k}={_num(v)}" for k, v in trial.params.items())
    tail = "" if best is None else f" | best {_num(best.value)} (trial {best.number})"
    note = trial.system_attrs.get(NOTE)
    tail += "" if note is None else f" ({note})"
    return f"trial {trial.number} {state}{value} | {params}{tail}"


def trials_html(trials: list, best: Any, monitor: str = "value") -> str:
    """The notebook's table: number, state, value, each parameter, under a
    caption naming the best trial; the best trial's row in bold."""
    names = list(dict.fromkeys(k for t in trials for k in t.params))
    head = "".join(f"<th>{h}</th>" for h in ["trial", "state", monitor, *names])
    rows = []
    for t in trials:
        cells = [t.number, t.state.name.lower(), _num(t.value)]
        cells += [_num(t.params.get(k)) for k in names]
        style = ' style="font-weight:bold"' if best and t.number == best.number else ""
        rows.append(f"<tr{style}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    caption = "best: none yet"
    if best is not None:
        caption = f"best: trial {best.number}, {monitor} {_num(best.value)}"
    return f"<table><caption>{caption}</caption><tr>{head}</tr>{''.join(rows)}</table>"


def _num(v: Any) -> str:
    if v is None:
        return ""
    return f"{v:.4g}" if isinstance(v, float) and math.isfinite(v) else str(v)


def in_notebook() -> bool:
    return bool(fastprogress_module().IN_NOTEBOOK)
