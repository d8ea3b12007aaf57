"""The Recorder's memory and checkpoint size against the length of a run.

Workload: a ``Linear(8, 2)`` on one in-memory batch of 4 samples, yielded
again and again by a cheap loader with a length, one thread, SGD, no
validation, through ``fitlib.fit_states`` with a ``Recorder`` and a real
``Checkpoint`` that saves every 10,000 steps. All the steps are ONE epoch, so
the Recorder never gets an epoch end to move its pending losses at: what
stays bounded here is the per-step history *and* the pending device losses.

It measures the process's resident memory (``/proc/self/statm``, after a
garbage collection) after 10,000 steps and at the end, and the size of the
checkpoint files written after 10,000 and after all the steps, and prints the
growth in bytes per step between them. A short run (5,000 steps, a checkpoint
every 1,000) comes first, in the same process: the first checkpoint writes
allocate memory once for good (about 250 kB: buffers, lazy imports), which
is no growth per step. A bounded Recorder's growth is flat:
well under 1 byte per step (page-sized noise aside). ``--max-points`` sets the
Recorder's budget; a budget larger than the run (``--max-points 1000000``)
keeps one point per step, as the Recorder did before it had a budget.

Run: ``.venv/bin/python benchmarks/recorder_memory.py`` (about a minute;
``--steps 1000000`` for a longer run).
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from fitlib import DataBunch, fit_states
from fitlib.callbacks import Checkpoint, Recorder

FIRST = 10_000  # steps at the first measurement, and between checkpoints
WARM_UP = 5_000  # steps of the run before the measured one


class SameBatch:
    """``n`` times the same batch: a loader that costs nothing per step."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.x, self.y = torch.randn(4, 8), torch.randint(0, 2, (4,))

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for _ in range(self.n):
            yield self.x, self.y


def rss_bytes() -> int:
    """The resident memory of this process now (not its peak)."""
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run(steps: int, max_points: int | None, dirpath: Path, every: int = FIRST) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rec = Recorder() if max_points is None else Recorder(max_points=max_points)
    ckpt = Checkpoint(dirpath, every_n_steps=every, keep_last=steps // every + 1)
    data = DataBunch(SameBatch(steps), None, device="cpu")
    out = {"rss_start": rss_bytes(), "pending": 0}
    t0 = time.perf_counter()
    for state in fit_states(1, model, F.cross_entropy, opt, data, [rec, ckpt], []):
        out["pending"] = max(out["pending"], len(rec._pending))
        if state["step"] == FIRST:
            out["rss_first"] = rss_bytes()
    out["rss_end"], out["seconds"] = rss_bytes(), time.perf_counter() - t0
    files = ckpt.checkpoints()  # one per FIRST steps; the last one at the end
    out["ckpt_first"] = files[0].stat().st_size
    out["ckpt_end"] = files[-1].stat().st_size
    out["points"] = len(rec.losses)
    out["budget"] = getattr(rec, "max_points", steps)  # (none before it had one)
    out["max_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--max-points", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        # The first checkpoint writes allocate for good (buffers, lazy
        # imports): a short run first, so the measured growth is per step.
        run(WARM_UP, args.max_points, Path(tmp) / "warm-up", every=WARM_UP // 5)
        r = run(args.steps, args.max_points, Path(tmp) / "run")
    more = args.steps - FIRST
    budget = "default" if args.max_points is None else args.max_points
    print(
        f"Recorder(max_points={budget}), {args.steps:,} steps in one epoch, "
        f"{r['seconds']:.1f} s ({1e6 * r['seconds'] / args.steps:.0f} us/step)"
    )
    print(
        f"points kept: {r['points']:,} (budget {r['budget']:,}); most device "
        f"losses pending: {r['pending']:,}"
    )
    print(
        f"{'':24}{f'{FIRST:,} steps':>14}{f'{args.steps:,} steps':>16}"
        f"{'growth B/step':>15}"
    )
    for name, a, b in (
        ("RSS (MB)", r["rss_first"], r["rss_end"]),
        ("checkpoint file (kB)", r["ckpt_first"], r["ckpt_end"]),
    ):
        scale = 1e6 if name.startswith("RSS") else 1e3
        print(f"{name:24}{a / scale:>14.2f}{b / scale:>16.2f}{(b - a) / more:>15.3f}")
    print(
        f"RSS before training: {r['rss_start'] / 1e6:.2f} MB; "
        f"peak: {r['max_rss'] / 1e6:.2f} MB"
    )


if __name__ == "__main__":
    main()
