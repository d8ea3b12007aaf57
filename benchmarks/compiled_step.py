"""A compiled optimizer step with tensor hyper-parameters against eager, on a CPU.

Workload: the MLP 32->64->10 of ``benchmarks/overhead.py``, batch 64, one
thread; each step is zero_grad, forward, cross-entropy, backward, the
optimizer step, then a 1cycle schedule's next lr and momentum (Adam's beta1)
written through ``HPOptimizer.set_scheduled``, as ``OneCycleScheduler``
does. Variants, for SGD (momentum 0.9, lr scheduled: SGD's momentum stays a
float) and AdamW (lr and beta1 scheduled):

- ``eager``: float hyper-parameters, the torch optimizer's own step;
- ``compiled``: ``hypers_as_tensors()``, the torch optimizer's step through
  ``torch.compile`` (inductor), the rest eager;
- ``compiled_floats``: the same step compiled, float hyper-parameters.

The compiled steps are warmed up first (compilation is not timed); the
graphs Dynamo compiled after warm-up are counted, for both compiled variants
together (0 expected). The runs are
interleaved, rounds in a fresh random order; the table gives the median µs
per step and the median of per-round ratios (compiled / eager: below 1 is
faster). The eager run is repeated as a control (its ratio shows the noise).

Run: ``.venv/bin/python benchmarks/compiled_step.py`` (``--rounds``,
``--steps``).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

import torch
import torch._dynamo
from torch import nn
from torch.nn import functional as F  # noqa: N812

from fitlib import HPOptimizer


def make(opt_name: str, variant: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    if opt_name == "SGD":
        opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, mom=0.9)
    else:
        opt = HPOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    if variant == "compiled":
        opt.hypers_as_tensors()
    if variant.startswith("compiled"):
        opt.opt.step = torch.compile(opt.opt.step)
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    return model, opt, x, y


def run(model, opt, x, y, steps: int, start: int, total: int) -> float:
    t0 = time.perf_counter()
    for i in range(start, start + steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        pos = (i % total) / total  # a 1cycle-like cosine pair, every step
        opt.set_scheduled("lr", 1e-3 * (1.5 - math.cos(2 * math.pi * pos) / 2))
        opt.set_scheduled("mom", 0.9 - 0.05 * math.sin(math.pi * pos))
    return (time.perf_counter() - t0) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread; {args.rounds} rounds x "
          f"{args.steps} steps")  # fmt: skip
    print(f"{'optimizer':10}{'variant':16}{'us/step':>10}{'ratio':>8}"
          f"{'recompiles':>12}")  # fmt: skip
    for opt_name in ("SGD", "AdamW"):
        torch._dynamo.reset()
        variants = {v: make(opt_name, v.rstrip("2")) for v in
                    ("eager", "eager2", "compiled", "compiled_floats")}  # fmt: skip
        for v in variants.values():  # warm-up: compiles, makes the state
            run(*v, steps=20, start=0, total=1000)
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        times: dict[str, list[float]] = {v: [] for v in variants}
        position = 20
        for _ in range(args.rounds):
            order = list(variants)
            random.shuffle(order)
            for v in order:
                times[v].append(run(*variants[v], args.steps, position, 1000))
            position += args.steps
        recompiles = torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames
        for v in variants:
            ratios = [a / b for a, b in zip(times[v], times["eager"])]
            shown = str(recompiles) if v.startswith("compiled") else ""
            print(f"{opt_name:10}{v:16}{statistics.median(times[v]):10.1f}"
                  f"{statistics.median(ratios):8.3f}{shown:>12}")  # fmt: skip


if __name__ == "__main__":
    main()
