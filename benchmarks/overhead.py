"""fitlib's overhead against a hand-written PyTorch loop, as a ratio.

Workload: an MLP 32->64->10, batch 64, 16,384 training samples, 3 epochs,
validation (loss and accuracy) after each epoch, one thread. Both sides use
the same optimizer (AdamW) and the same cheap batch iterator, so the ratio
shows the loop's and the callbacks' cost, not a DataLoader's.

A second pair trains with the 1cycle schedule and bfloat16 autocast:
``Learner.fit_one_cycle`` with ``to_bf16()`` (``OneCycleScheduler`` and
``MixedPrecision(torch.bfloat16)``) against a hand-written loop with
``torch.optim.lr_scheduler.OneCycleLR`` stepped each batch and
``torch.autocast`` around the forward pass and the loss (validation too, as
``MixedPrecision`` does). Its fitlib row is a ratio to that loop, and that
loop's row a ratio to the plain hand-written one (what autocast and the
scheduler cost on this CPU). ``--amp`` adds this pair: it is off by default
because it adds over a minute to the run (bfloat16 autocast makes these small
matrix products about 1.6x slower on a CPU).

The runs are interleaved, in a new random order each round, so drifts in
machine speed and the cost of running right after another variant hit every
variant alike; the ratio is the median of per-round ratios. The second
hand-written run is a control: its distance from 1.000x is the noise of the
measurement. Each process repeats this, and the result is the median over
several fresh processes, because on a virtual machine the memory layout a
process happens to get moves every variant in it by several percent. Times
are the process's CPU seconds (one thread, no workers). A busy host still
slows them (shared caches and cores), and only ever adds time: the ratio of
the fastest runs is printed as a second estimate, steadier when the control
strays. ``benchmarks/instructions.py`` counts instructions instead, which no
neighbour moves.

Run: ``make bench`` or ``.venv/bin/python benchmarks/overhead.py --processes 5``
(add ``--amp`` for the 1cycle + bfloat16 pair)
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import subprocess
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from fitlib import DataBunch, Learner
from fitlib.callbacks import ProgressBar
from fitlib.metrics import accuracy

N_TRAIN, N_VALID, BS, EPOCHS, LR, WD = 16_384, 4_096, 64, 3, 1e-3, 1e-2


class Batches:
    """Slices of in-memory tensors, reshuffled each epoch: a near-free loader."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, shuffle: bool) -> None:
        self.x, self.y, self.shuffle = x, y, shuffle

    def __len__(self) -> int:
        return (len(self.x) + BS - 1) // BS

    def __iter__(self):
        idx = torch.randperm(len(self.x)) if self.shuffle else None
        x, y = (self.x[idx], self.y[idx]) if self.shuffle else (self.x, self.y)
        for i in range(0, len(x), BS):
            yield x[i : i + BS], y[i : i + BS]


def make_data() -> tuple[Batches, Batches]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 10, generator=g)
    x = torch.randn(N_TRAIN + N_VALID, 32, generator=g)
    y = (x @ w + 0.5 * torch.randn(len(x), 10, generator=g)).argmax(1)
    train = Batches(x[:N_TRAIN], y[:N_TRAIN], shuffle=True)
    return train, Batches(x[N_TRAIN:], y[N_TRAIN:], shuffle=False)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def hand_written(train: Batches, valid: Batches) -> float:
    """What a careful person writes: train loss, valid loss and accuracy."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    return hand_loop(train, valid, model, opt, opt.step)


def hand_loop(train: Batches, valid: Batches, model: nn.Module, opt, step) -> float:
    """``hand_written``'s loop on given objects (``step``: ``opt.step``, or it
    compiled, as ``compiled_fit.py`` times it); the seconds it took."""
    start = time.process_time()
    for _ in range(EPOCHS):
        model.train()
        train_loss, n = 0.0, 0
        for x, y in train:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            step()
            opt.zero_grad()
            train_loss, n = train_loss + loss.detach() * len(y), n + len(y)
        model.eval()
        valid_loss, correct, m = 0.0, 0, 0
        with torch.no_grad():
            for x, y in valid:
                out = model(x)
                valid_loss = valid_loss + F.cross_entropy(out, y) * len(y)
                correct, m = correct + (out.argmax(1) == y).sum(), m + len(y)
        _ = [float(train_loss / n), float(valid_loss / m), float(correct / m)]
    return time.process_time() - start


def hand_written_1cycle_bf16(train: Batches, valid: Batches) -> float:
    """The same loop with OneCycleLR stepped each batch and bfloat16 autocast."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    # fitlib's defaults: div_factor 25, pct_start 0.3, final lr max / 25e4,
    # momentum (AdamW's beta1) 0.95 -> 0.85 -> 0.95.
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=LR, total_steps=EPOCHS * len(train), final_div_factor=1e4
    )
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    start = time.process_time()
    for _ in range(EPOCHS):
        model.train()
        train_loss, n = 0.0, 0
        for x, y in train:
            with autocast:
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            train_loss, n = train_loss + loss.detach() * len(y), n + len(y)
        model.eval()
        valid_loss, correct, m = 0.0, 0, 0
        with torch.no_grad():
            for x, y in valid:
                with autocast:
                    out = model(x)
                    loss = F.cross_entropy(out, y)
                valid_loss = valid_loss + loss * len(y)
                correct, m = correct + (out.argmax(1) == y).sum(), m + len(y)
        _ = [float(train_loss / n), float(valid_loss / m), float(correct / m)]
    return time.process_time() - start


def with_fitlib(train: Batches, valid: Batches, progress: bool) -> float:
    model = make_model()
    # bars=True draws the bars even when stdout is a pipe, so "bar" is measured
    # with fastprogress drawing, as in a terminal.
    bar = [ProgressBar(bars=True)] if progress else []
    learn = Learner(
        DataBunch(train, valid, device="cpu"),
        model,
        F.cross_entropy,
        metrics=[accuracy],
        wd=WD,
        progress=False,
        callbacks=bar,
    )
    start = time.process_time()
    learn.fit(EPOCHS, lr=LR)
    return time.process_time() - start


def with_fitlib_1cycle_bf16(train: Batches, valid: Batches) -> float:
    """``fit_one_cycle`` under ``to_bf16()``: OneCycleScheduler, MixedPrecision."""
    learn = Learner(
        DataBunch(train, valid, device="cpu"),
        make_model(),
        F.cross_entropy,
        metrics=[accuracy],
        wd=WD,
        progress=False,
    ).to_bf16()
    start = time.process_time()
    learn.fit_one_cycle(EPOCHS, lr=LR)
    return time.process_time() - start


# The variant each one's ratio is taken to, where it is not "hand-written"
# (or is, but the table should say so).
BASELINE = {
    "hand 1cycle+bf16": "hand-written",
    "fitlib 1cycle+bf16": "hand 1cycle+bf16",
}


def baseline(name: str) -> str:
    """The variant that ``name``'s ratios are taken to."""
    return BASELINE.get(name, "hand-written")


def one_process(rounds: int, amp: bool) -> dict[str, tuple[float, float, float]]:
    """Interleaved rounds: {variant: (median s, median ratio, fastest s)}."""
    torch.set_num_threads(1)
    train, valid = make_data()
    variants = {
        "hand-written": lambda: hand_written(train, valid),
        "fitlib (no bar)": lambda: with_fitlib(train, valid, progress=False),
        "fitlib (bar)": lambda: with_fitlib(train, valid, progress=True),
        # The same loop again: its ratio shows how far noise alone moves one.
        "hand (control)": lambda: hand_written(train, valid),
    }
    if amp:
        variants["hand 1cycle+bf16"] = lambda: hand_written_1cycle_bf16(train, valid)
        variants["fitlib 1cycle+bf16"] = lambda: with_fitlib_1cycle_bf16(train, valid)
    for run in variants.values():  # warm-up: allocators, lazy imports
        run()
    times = {name: [] for name in variants}
    order, rng = list(variants), random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)  # each variant visits every position in the round
        for name in order:
            gc.collect()
            times[name].append(variants[name]())
    return {
        name: (
            statistics.median(ts),
            statistics.median(t / b for t, b in zip(ts, times[baseline(name)])),
            min(ts),
        )
        for name, ts in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="rounds per process")
    parser.add_argument("--processes", type=int, default=5)
    parser.add_argument(
        "--amp",
        action="store_true",
        help="add the 1cycle + bfloat16 pair (about a minute more)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_process(args.rounds, args.amp)))
        return
    runs = []
    for i in range(args.processes):
        cmd = [sys.executable, __file__, "--child", "--rounds", str(args.rounds)]
        cmd += ["--amp"] if args.amp else []
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
        print(f"process {i + 1}: " + "  ".join(
            f"{name} {ratio:.3f}x" for name, (_, ratio, _) in runs[-1].items()
        ))  # fmt: skip
    print(
        f"\n{args.processes} processes x {args.rounds} interleaved rounds, "
        f"{EPOCHS} epochs of {N_TRAIN // BS} batches; CPU seconds of one thread"
    )
    # A busy host only ever adds time: the fastest runs' ratio is a second
    # estimate, steadier than the medians when the control strays from 1.000x.
    for name in runs[0]:
        ratios = [run[name][1] for run in runs]
        secs = statistics.median(run[name][0] for run in runs)
        fastest = min(run[name][2] for run in runs)
        fastest_base = min(run[baseline(name)][2] for run in runs)
        versus = f"  vs {baseline(name)}" if name in BASELINE else ""
        print(
            f"{name:>18}: median {secs:.3f}s  ratio {statistics.median(ratios):.3f}x"
            f"  (per process {min(ratios):.3f}-{max(ratios):.3f})"
            f"  fastest {fastest:.3f}s ({fastest / fastest_base:.3f}x){versus}"
        )


if __name__ == "__main__":
    main()
