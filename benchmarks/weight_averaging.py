"""What EMA and SWA do for a noisy small model, and what they cost per step.

**Quality** (the default): scikit-learn's digits (8x8), a stratified 80/20
split; 40% of the training labels replaced by random classes (the
validation labels stay clean); an MLP 64 -> 128 -> BatchNorm -> ReLU ->
Dropout(0.2) -> 10, SGD with momentum 0.9 at a constant lr 0.1, batches of
32, 30 epochs, one thread. Per seed (initial weights and batch order) three
fits from the same start: plain, with ``EMA(half_life=50)`` (its defaults:
validated on the average, which the model holds at the end) and with
``SWA(swa_start=0.5, swa_lr=0.05, anneal_epochs=3)``, and a control: SWA's
lr schedule without the averaging (``LrOnly``), to tell what the average
brings from what the lower lr brings. The model after each
fit is evaluated with ``learn.validate()`` on the clean validation set:
loss and accuracy.

**Cost** (``--cost``): the per-step cost of ``EMA`` (default options, and
``validate_on="live"``) and of ``SWA`` against the same ``fit`` without,
on the workload of ``instructions.py --per-step`` (MLP 32 -> 64 -> 10 with
batch norm and dropout, SGD, batches of 32, 128 steps an epoch, one
validation batch per epoch, one thread), counted in instructions under
valgrind's callgrind: a process fits 2 epochs and one fits 6 (after a
warm-up fit, instrumentation switched on after it); the difference over
the 4 x 128 steps is the cost per step. ``--wall`` measures wall-clock
time instead (interleaved repeats, the median), which a busy machine moves.

Run: ``.venv/bin/python benchmarks/weight_averaging.py [--seeds 0 1 2 3 4]``
and ``.venv/bin/python benchmarks/weight_averaging.py --cost [--wall]``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

from fitlib import DataBunch, HPOptimizer, Learner, fit
from fitlib.callbacks import EMA, SWA
from fitlib.metrics import accuracy

NOISE, EPOCHS = 0.4, 30


def digits(seed: int) -> DataBunch:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    xt, xv, yt, yv = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)
    g = torch.Generator().manual_seed(1000 + seed)
    yt = torch.tensor(yt)
    flip = torch.rand(len(yt), generator=g) < NOISE
    yt[flip] = torch.randint(0, 10, (int(flip.sum()),), generator=g)
    as_x = lambda a: torch.tensor(a, dtype=torch.float32) / 16  # noqa: E731
    train = TensorDataset(as_x(xt), yt)
    valid = TensorDataset(as_x(xv), torch.tensor(yv))
    return DataBunch(DataLoader(train, 32, shuffle=True), DataLoader(valid, 256))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(),
                         nn.Dropout(0.2), nn.Linear(128, 10))  # fmt: skip


def one_fit(seed: int, callbacks: list) -> tuple[float, float]:
    torch.manual_seed(seed)
    learn = Learner(digits(seed), mlp(), F.cross_entropy, metrics=[accuracy],
                    opt_func=lambda p, lr: torch.optim.SGD(p, lr, momentum=0.9),
                    progress=False, callbacks=callbacks, wd=0)  # fmt: skip
    learn.fit(EPOCHS, lr=0.1)
    values = learn.validate()
    return values["valid_loss"], values["accuracy"]


class LrOnly(SWA):
    """The control: SWA's lr schedule, without averaging the weights."""

    def on_epoch_end(self, epoch: int, mid_epoch: bool) -> None:
        pass

    def on_train_end(self, exception: object, suspend: bool, data: object,
                     model: object) -> None:  # fmt: skip
        pass


VARIANTS = {
    "plain": lambda: [],
    "EMA(half_life=50)": lambda: [EMA(half_life=50)],
    "SWA(0.5, swa_lr=0.05)": lambda: [SWA(swa_start=0.5, swa_lr=0.05, anneal_epochs=3)],
    "SWA's lr, no average": lambda: [
        LrOnly(swa_start=0.5, swa_lr=0.05, anneal_epochs=3)
    ],
}


def quality(seeds: list[int]) -> None:
    torch.set_num_threads(1)
    results: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    print("| seed | " + " | ".join(VARIANTS) + " |")
    print("|---" * (len(VARIANTS) + 1) + "|")
    for seed in seeds:
        row = []
        for name, make in VARIANTS.items():
            loss, acc = one_fit(seed, make())
            results[name].append((loss, acc))
            row.append(f"{loss:.4f} / {acc:.4f}")
        print(f"| {seed} | " + " | ".join(row) + " |", flush=True)
    print("\nmean valid loss / accuracy (and seeds where lower loss than plain):")
    plain = [r[0] for r in results["plain"]]
    for name, rows in results.items():
        losses, accs = [r[0] for r in rows], [r[1] for r in rows]
        wins = sum(a < b for a, b in zip(losses, plain, strict=True))
        spread = statistics.stdev(losses) if len(losses) > 1 else 0.0
        mean, acc = statistics.mean(losses), statistics.mean(accs)
        print(f"  {name:24s} {mean:.4f} +- {spread:.4f}  acc {acc:.4f}  "
              f"lower in {wins}/{len(losses)}")  # fmt: skip


# -- cost -----------------------------------------------------------------------
def step_data() -> DataBunch:
    g = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(4096, 32, generator=g),
        torch.randint(0, 10, (4096,), generator=g),
    )
    xv, yv = torch.randn(32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)
    return DataBunch(DataLoader(TensorDataset(x, y), 32, shuffle=True),
                     DataLoader(TensorDataset(xv, yv), 32))  # fmt: skip


COST = {
    "fit": lambda: [],
    "fit + EMA()": lambda: [EMA()],
    "fit + EMA(validate_on='live')": lambda: [EMA(validate_on="live")],
    "fit + SWA(swa_start=0)": lambda: [SWA(swa_start=0)],
}


def cost_fit(variant: str, epochs: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(),
                          nn.Dropout(0.1), nn.Linear(64, 10))  # fmt: skip
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.01)
    fit(epochs, model, F.cross_entropy, opt, step_data(), COST[variant](), [accuracy])


def child(variant: str, epochs: int) -> None:
    torch.set_num_threads(1)
    cost_fit(variant, 1)  # warm-up
    if os.environ.get("WA_CALLGRIND"):
        subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())],
                       check=True, capture_output=True)  # fmt: skip
    cost_fit(variant, epochs)


def instructions(variant: str, epochs: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["setarch", "-R", "valgrind", "--tool=callgrind", "--instr-atstart=no",
               f"--callgrind-out-file={Path(tmp) / 'out'}", sys.executable, __file__,
               "--child", variant, str(epochs)]  # fmt: skip
        env = {**os.environ, "PYTHONHASHSEED": "0", "WA_CALLGRIND": "1"}
        log = subprocess.run(cmd, capture_output=True, text=True, env=env,
                             check=True).stderr  # fmt: skip
    return int(re.search(r"Collected : (\d+)", log).group(1))


def cost(wall: bool, repeat: int) -> None:
    steps = 4 * 128
    per_step = {}
    for variant in COST:
        if wall:
            torch.set_num_threads(1)
            per_step[variant] = None
        else:
            n2, n6 = instructions(variant, 2), instructions(variant, 6)
            per_step[variant] = (n6 - n2) / steps
            print(f"{variant:32s} {per_step[variant]:12,.0f} instructions/step",
                  flush=True)  # fmt: skip
    if wall:
        times: dict[str, list[float]] = {v: [] for v in COST}
        for _ in range(repeat):
            for variant in COST:  # interleaved: a busy spell hits all alike
                start = time.perf_counter()
                cost_fit(variant, 4)
                times[variant].append(time.perf_counter() - start)
        base = statistics.median(times["fit"])
        for variant, ts in times.items():
            print(f"{variant:32s} {statistics.median(ts):.3f} s  "
                  f"ratio {statistics.median(ts) / base:.3f}")  # fmt: skip
        return
    base = per_step["fit"]
    for variant, n in per_step.items():
        print(f"{variant:32s} ratio {n / base:.3f}  (+{n - base:,.0f}/step)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--cost", action="store_true")
    parser.add_argument("--wall", action="store_true")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--child", nargs=2)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
    elif args.cost:
        cost(args.wall, args.repeat)
    else:
        quality(args.seeds)


if __name__ == "__main__":
    main()
