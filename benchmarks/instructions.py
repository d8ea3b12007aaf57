"""fitlib's overhead in executed instructions, which no busy neighbour moves.

Two measurements, both under valgrind's callgrind. Needs ``valgrind`` on the
PATH (e.g. ``apt install valgrind``). Instructions are not time: cache misses
and branch mispredictions are not counted. They are the deterministic check
that a change made the loop cheaper.

**Whole fit** (the default): the workload of ``overhead.py`` (in-memory
batches of 64, AdamW, the Learner with the Recorder and accuracy), each
variant in a process that fits once and in one that fits twice (both after a
warm-up fit), so the difference is one fit, free of imports and start-up.
Slow (about ten minutes for the full workload on two cores); ``--small`` uses
a quarter of the data. ``--cycles`` also simulates the caches and branch
predictor (about twice as slow) and prints callgrind's cycle estimate,
instructions + 10 x (L1 misses + mispredicted branches) + 100 x last-level
misses.

**Per step** (``--per-step``): the cost of one training step at the limit,
on the smallest workload: an MLP 32->64->10 with batch norm and dropout,
plain SGD, a ``DataLoader`` of batch 32 over a ``TensorDataset`` (4,096
training samples: 128 steps per epoch), validation with accuracy after every
epoch, one thread. Four variants:

- ``hand-written``: train mode, forward, loss, backward, step, zero_grad per
  batch; per epoch a validation pass (eval mode, no grad) whose loss and
  accuracy are summed on the device and read once, in one transfer;
- ``+ train loss``: the same, also keeping each step's detached loss and
  reading the epoch's training loss with the validation values (what ``fit``
  reports and the plain loop does not compute);
- ``fit + accuracy``: ``fitlib.fit`` with ``metrics=[accuracy]``, no
  callbacks;
- ``Learner (no bar)``: the default ``Learner`` (its ``Recorder``, ``wd=0``
  so that it does the same arithmetic, ``progress=False``).

Each runs in a process that fits for 6 epochs and in one that fits for 2;
the difference, divided by the 4 x 128 steps between them, is the cost per
step, free of imports and set-up. The validation set is kept small instead
of subtracted: one batch of 32 per epoch, so the 4 extra validations and
epoch ends add 1/128 of their cost to each step (for every variant). Runs set
``PYTHONHASHSEED=0`` and turn address randomisation off (``setarch -R``);
instrumentation starts after the imports (``--instr-atstart=no``, switched
on by the child with ``callgrind_control``), which only saves time. Repeat
runs of one loop still move by about +-1.5% (memory layout); ``--repeat N``
runs each process N times and takes the median. About 4 minutes per
repeat on two cores.

``--function module:qualname`` (with ``--per-step``) also counts, per step,
the instructions executed inside that fitlib function (inclusive), e.g.
``fitlib.core:loss_batch`` or ``fitlib.callback:CallbackHandler.on_batch_end``:
the function is wrapped in ``operator.call`` and callgrind collects only
inside it (``--toggle-collect=_operator_call``). The wrapper itself costs a
few hundred instructions per call; calls per step are printed too.
``--keep DIR`` keeps the callgrind files, for ``callgrind_annotate
--inclusive=yes``.

Run: ``.venv/bin/python benchmarks/instructions.py [--small] [--cycles]``
or ``.venv/bin/python benchmarks/instructions.py --per-step [--repeat 3]``
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import operator
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import overhead as ov
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

from fitlib import DataBunch, Learner, fit
from fitlib.metrics import accuracy

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


def whole_fit(args: argparse.Namespace) -> None:
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


# -- per step -------------------------------------------------------------------
BS, N_TRAIN, N_VALID, LR = 32, 4096, 32, 0.1
FEW, MANY = 2, 6  # epochs of the two fits whose difference is measured
STEPS = (MANY - FEW) * (N_TRAIN // BS)


def step_data() -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 10, generator=g)
    x = torch.randn(N_TRAIN + N_VALID, 32, generator=g)
    y = (x @ w + 0.5 * torch.randn(len(x), 10, generator=g)).argmax(1)
    train = TensorDataset(x[:N_TRAIN], y[:N_TRAIN])
    valid = TensorDataset(x[N_TRAIN:], y[N_TRAIN:])
    return DataLoader(train, BS, shuffle=True), DataLoader(valid, BS)


def step_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64),
        nn.BatchNorm1d(64),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(64, 10),
    )


def hand_validation(model: nn.Module, valid: DataLoader) -> list[torch.Tensor]:
    """fitlib's validation by hand: loss and accuracy summed on the device
    (eval mode, no grad), left there for the caller's one transfer."""
    model.eval()
    valid_loss, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for x, y in valid:
            out = model(x)
            valid_loss = valid_loss + F.cross_entropy(out, y) * len(y)
            correct, n = correct + (out.argmax(1) == y).sum(), n + len(y)
    return [valid_loss / n, correct / n]


def step_hand_written(epochs: int, train: DataLoader, valid: DataLoader) -> None:
    """The plain loop, with fitlib's validation: loss and accuracy on the
    device, read once per epoch."""
    model = step_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(epochs):
        model.train()
        for x, y in train:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        torch.stack(hand_validation(model, valid)).tolist()


def step_hand_written_loss(epochs: int, train: DataLoader, valid: DataLoader) -> None:
    """The plain loop, plus the one number per epoch that ``fit`` reports and
    it does not: the epoch's training loss (each step's loss detached and
    kept, weighted by its batch size, summed once with the validation)."""
    model = step_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(epochs):
        model.train()
        losses, sizes = [], []
        for x, y in train:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            sizes.append(len(y))
        train_loss = torch.stack(losses) @ torch.tensor(sizes, dtype=torch.float32)
        torch.stack([train_loss / sum(sizes), *hand_validation(model, valid)]).tolist()


def step_fit(epochs: int, train: DataLoader, valid: DataLoader) -> None:
    model = step_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = DataBunch(train, valid, device="cpu")
    fit(epochs, model, F.cross_entropy, opt, data, metrics=[accuracy])


def step_learner(epochs: int, train: DataLoader, valid: DataLoader) -> None:
    data = DataBunch(train, valid, device="cpu")
    learn = Learner(
        data,
        step_model(),
        F.cross_entropy,
        opt_func=torch.optim.SGD,
        metrics=[accuracy],
        wd=0.0,
        progress=False,
    )
    learn.fit(epochs, lr=LR)


STEP_VARIANTS = {
    "hand-written": step_hand_written,
    "+ train loss": step_hand_written_loss,
    "fit + accuracy": step_fit,
    "Learner (no bar)": step_learner,
}


def step_child(variant: str, epochs: int, function: str | None) -> None:
    calls = [0]
    if function:
        calls = wrap(function)
    # Everything before this line cancels between the two fits; counting it
    # only makes the run slower.
    subprocess.run(
        ["callgrind_control", "-i", "on", str(os.getpid())],
        check=True,
        capture_output=True,
    )
    torch.set_num_threads(1)
    train, valid = step_data()
    STEP_VARIANTS[variant](epochs, train, valid)
    print(json.dumps({"calls": calls[0]}))


def wrap(function: str) -> list[int]:
    """Replaces ``module:qualname`` by a wrapper that calls it through
    ``operator.call`` (a C function callgrind can toggle on); returns the call
    counter."""
    module_name, _, qualname = function.partition(":")
    owner = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = owner.__dict__[name]
    calls = [0]

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        calls[0] += 1
        return operator.call(original, *args, **kwargs)

    setattr(owner, name, wrapper)
    # A function that other fitlib modules imported by name: patch them too.
    for mod in list(sys.modules.values()):
        fitlib_module = getattr(mod, "__name__", "").startswith("fitlib")
        if fitlib_module and getattr(mod, name, None) is original:
            setattr(mod, name, wrapper)
    return calls


def step_count(
    variant: str, epochs: int, function: str | None, keep: Path | None
) -> tuple[int, int]:
    """Instructions of a process that fits ``epochs`` epochs (those inside
    ``function`` only, when given), and the calls of ``function``."""
    with tempfile.TemporaryDirectory() as tmp:
        name = f"{variant.split()[0]}-{epochs}ep.out"
        out = (keep or Path(tmp)) / name
        cmd = [
            "setarch",
            platform.machine(),
            "-R",
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={out}",
            *(
                ["--collect-atstart=no", "--toggle-collect=_operator_call"]
                if function
                else []
            ),
            sys.executable,
            __file__,
            "--step-child",
            variant,
            str(epochs),
            *(["--function", function] if function else []),
        ]
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        run = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if run.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{run.stderr[-3000:]}")
    n = int(re.search(r"Collected : (\d+)", run.stderr).group(1))
    return n, json.loads(run.stdout.strip().splitlines()[-1])["calls"]


def per_step(args: argparse.Namespace) -> None:
    variants = args.only or list(STEP_VARIANTS)
    jobs = [
        (v, epochs, r)
        for r in range(args.repeat)
        for v in variants
        for epochs in (FEW, MANY)
    ]
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)

    def job(j: tuple) -> tuple[int, int]:
        keep = args.keep / f"r{j[2]}" if args.keep else None
        if keep:
            keep.mkdir(exist_ok=True)
        return step_count(j[0], j[1], args.function, keep)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        counts = dict(zip(jobs, pool.map(job, jobs)))
    print(
        f"instructions per training step: ({MANY} epochs - {FEW} epochs) / "
        f"{STEPS} steps, batch {BS}, {N_TRAIN // BS} steps and 1 validation "
        f"batch per epoch; median of {args.repeat} run(s)"
    )
    base = None  # the hand-written loop's, when it was measured
    for v in variants:
        diffs = [
            (counts[v, MANY, r][0] - counts[v, FEW, r][0]) / STEPS
            for r in range(args.repeat)
        ]
        n = statistics.median(diffs)
        spread = (
            f"  (runs {min(diffs):,.0f}-{max(diffs):,.0f})" if len(diffs) > 1 else ""
        )
        if args.function:
            calls = (counts[v, MANY, 0][1] - counts[v, FEW, 0][1]) / STEPS
            print(f"{v:>18}: {n:>10,.0f} in {args.function}, {calls:.2f} calls{spread}")
            continue
        if v == "hand-written":
            base = n
        ratio = f"  {n / base:.3f}x  (+{n - base:,.0f})" if base else ""
        print(f"{v:>18}: {n:>10,.0f}{ratio}{spread}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="a quarter of the data")
    parser.add_argument(
        "--cycles", action="store_true", help="estimate cycles (cache simulation)"
    )
    parser.add_argument(
        "--per-step", action="store_true", help="instructions per training step"
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs (--per-step)")
    parser.add_argument("--jobs", type=int, default=2, help="processes at once")
    parser.add_argument(
        "--function", help="count inside module:qualname only (--per-step)"
    )
    parser.add_argument(
        "--only", action="append", choices=list(STEP_VARIANTS), help="a variant"
    )
    parser.add_argument("--keep", type=Path, help="keep the callgrind files here")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--step-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.small)
        return
    if args.step_child:
        step_child(args.step_child[0], int(args.step_child[1]), args.function)
        return
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed; e.g. apt install valgrind")
    (per_step if args.per_step else whole_fit)(args)


if __name__ == "__main__":
    main()
