"""A compiled fit against an eager one on a CPU, in µs per training step.

Workload: ``overhead.py``'s (an MLP 32->64->10, batch 64, 16,384 training
samples, AdamW with weight decay, validation with accuracy after each of 3
epochs, one thread). Variants: the hand-written eager loop, the same loop with its
optimizer's step compiled (``torch.compile(opt.step)``), fitlib eager,
fitlib with ``Compile()`` (the model's forward and backward compiled by
inductor) and with ``Compile(step=True)`` (the optimizer's step too). Each
fitlib variant is one ``Learner`` per process, warmed up by a first fit of
one epoch (the compilation, tens of seconds, is not timed); then the rounds
time whole fits of the same Learner, interleaved in a new random order each
round. A time is the process's CPU seconds of a fit divided by its training
steps (validation included, a share of about a tenth), the ratio is the
median of per-round ratios to the hand-written loop, and the result is the
median over fresh processes (a process's memory layout moves every variant
in it by several percent).

Run: ``.venv/bin/python benchmarks/compiled_fit.py --processes 3``
(needs a C++ compiler for inductor; ``--rounds`` per process, default 5)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time

import torch
from overhead import EPOCHS, LR, WD, hand_loop, make_data, make_model
from torch.nn import functional as F  # noqa: N812

from fitlib import DataBunch, Learner
from fitlib.metrics import accuracy

VARIANTS = ("hand-written", "hand, step compiled", "fitlib eager",
            "fitlib Compile()", "fitlib step=True")  # fmt: skip


def hand_made(compile_step: bool = False) -> tuple:
    """The hand-written loop's model, optimizer and step, made once per
    process (a new optimizer would compile its step again); ``compile_step``:
    the step compiled (PyTorch's "compiled optimizer" recipe), nothing else."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    return model, opt, torch.compile(opt.step) if compile_step else opt.step


def learner(train, valid, compile_kwargs: dict | None) -> Learner:
    learn = Learner(DataBunch(train, valid, device="cpu"), make_model(),
                    F.cross_entropy, metrics=[accuracy], wd=WD,
                    progress=False)  # fmt: skip
    if compile_kwargs is not None:
        learn.compile(**compile_kwargs)
    learn.fit(1, lr=LR)  # the compilation, untimed
    return learn


def timed_fit(learn: Learner) -> float:
    start = time.process_time()
    learn.fit(EPOCHS, lr=LR)
    return time.process_time() - start


def one_process(rounds: int) -> dict[str, tuple[float, float]]:
    """{variant: (median µs per step, median ratio to hand-written)}."""
    torch.set_num_threads(1)
    train, valid = make_data()
    steps = EPOCHS * len(train)
    hand, hand_compiled = hand_made(), hand_made(compile_step=True)
    hand_loop(train, valid, *hand_compiled)  # the compilation, untimed
    learners = {
        "fitlib eager": learner(train, valid, None),
        "fitlib Compile()": learner(train, valid, {}),
        "fitlib step=True": learner(train, valid, {"step": True}),
    }
    runs = {
        "hand-written": lambda: hand_loop(train, valid, *hand),
        "hand, step compiled": lambda: hand_loop(train, valid, *hand_compiled),
        **{name: (lambda learn=learn: timed_fit(learn))
           for name, learn in learners.items()},
    }  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        order = list(VARIANTS)
        random.shuffle(order)
        for name in order:
            times[name].append(runs[name]() / steps * 1e6)
    hand = times["hand-written"]
    return {
        name: (statistics.median(ts),
               statistics.median(t / h for t, h in zip(ts, hand, strict=True)))
        for name, ts in times.items()
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_process(args.rounds)))
        return
    results = []
    for i in range(args.processes):
        out = subprocess.run(
            [sys.executable, __file__, "--child", "--rounds", str(args.rounds)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"process {i + 1}/{args.processes} done", file=sys.stderr)
    print(f"torch {torch.__version__}, {args.processes} processes x "
          f"{args.rounds} rounds, one thread")  # fmt: skip
    print(f"{'variant':<20}{'µs/step':>10}{'vs hand-written':>17}")
    for name in VARIANTS:
        us = statistics.median(r[name][0] for r in results)
        ratio = statistics.median(r[name][1] for r in results)
        print(f"{name:<20}{us:>10.1f}{ratio:>16.3f}x")


if __name__ == "__main__":
    main()
