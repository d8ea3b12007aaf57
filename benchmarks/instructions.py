"""fitlib's overhead in executed instructions, which no busy neighbour moves.

Runs the workload of ``overhead.py`` under valgrind's callgrind: each variant
in a process that fits once and in one that fits twice (both after a warm-up
fit), so the difference is one fit, free of imports and start-up. Slow (about
ten minutes for the full workload on two cores); ``--small`` uses a quarter
of the data. Needs ``valgrind`` on the PATH (e.g. ``apt install valgrind``).

Instructions are not time: cache misses and branch mispredictions are not
counted. They are the deterministic check that a change made the loop cheaper.
``--cycles`` also simulates the caches and branch predictor (about twice as
slow) and prints callgrind's cycle estimate, instructions + 10 x (L1 misses +
mispredicted branches) + 100 x last-level misses.

Run: ``.venv/bin/python benchmarks/instructions.py [--small] [--cycles]``
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import overhead as ov
import torch

VARIANTS = {
    "hand-written": lambda train, valid: ov.hand_written(train, valid),
    "fitlib (no bar)": lambda train, valid: ov.with_fitlib(train, valid, False),
}


def child(variant: str, fits: int, small: bool) -> None:
    torch.set_num_threads(1)
    if small:
        ov.N_TRAIN, ov.N_VALID = ov.N_TRAIN // 4, ov.N_VALID // 4
    train, valid = ov.make_data()
    for _ in range(fits + 1):  # + the warm-up fit
        VARIANTS[variant](train, valid)


def count(variant: str, fits: int, small: bool, cycles: bool) -> int:
    """Instructions, or estimated cycles, of a process that fits ``fits`` times."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={Path(tmp) / 'out'}",
            *(["--cache-sim=yes", "--branch-sim=yes"] if cycles else []),
            sys.executable,
            __file__,
            "--child",
            variant,
            str(fits),
            *(["--small"] if small else []),
        ]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    n = int(re.search(r"Collected : (\d+)", log).group(1))
    if not cycles:
        return n

    def total(label: str) -> int:
        return int(re.search(rf"{label}:\s+([\d,]+)", log).group(1).replace(",", ""))

    l1 = total("I1  misses") + total("D1  misses")
    ll = total("LLi misses") + total("LLd misses")
    return n + 10 * (l1 + total("Mispredicts")) + 100 * ll


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="a quarter of the data")
    parser.add_argument(
        "--cycles", action="store_true", help="estimate cycles (cache simulation)"
    )
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.small)
        return
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed; e.g. apt install valgrind")
    jobs = [(v, fits) for v in VARIANTS for fits in (1, 2)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        counts = dict(
            zip(jobs, pool.map(lambda j: count(*j, args.small, args.cycles), jobs))
        )
    per_fit = {v: counts[v, 2] - counts[v, 1] for v in VARIANTS}
    base = per_fit["hand-written"]
    for v, n in per_fit.items():
        unit = "estimated cycles" if args.cycles else "instructions"
        print(f"{v:>16}: {n / 1e6:8.1f}M {unit} per fit  {n / base:.3f}x")


if __name__ == "__main__":
    main()
