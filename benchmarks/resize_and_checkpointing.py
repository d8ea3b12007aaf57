"""What ProgressiveResizing and ActivationCheckpointing cost and save, on a CPU.

Activation checkpointing: an MLP of 4 blocks (8 -> 1024 -> GELU -> dropout
-> 32 each), batch 512, one training step (forward, loss, backward). The peak
memory of the step is read from torch's CPU allocator, whose every
allocation and free the profiler records with ``profile_memory=True``: the
running sum of those, at its highest, above what was allocated before the
step. The step's cost is CPU seconds (one thread), the median of per-round
ratios, plain and checkpointed interleaved in a new random order each round;
a second plain run is the control (its distance from 1.00x is the noise).

Progressive resizing: a small convnet (3 convolutions of stride 2 with batch
norm) on synthetic 64x64 images of uniform noise whose class is the quadrant
that holds an 8x8 patch brighter by 0.12, 512 training and 256 validation
images, batch 32, 6 epochs of SGD (weight decay 0.01) with the 1cycle
schedule: the whole fit at 64x64, and with
``ProgressiveResizing(start=32, buckets=3)`` (32, 48, then 64 from epoch 4
on). Both report the CPU seconds of the fit and the last epoch's validation
loss and accuracy (validation at 64x64 in both). Repeated over seeds.

Run: ``.venv/bin/python benchmarks/resize_and_checkpointing.py`` (about two
minutes on the 2-core VM; ``--rounds`` and ``--seeds`` to change).
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, TensorDataset

from fitlib import Learner
from fitlib.callback import call_hook
from fitlib.callbacks import ActivationCheckpointing, ProgressiveResizing
from fitlib.data import DataBunch
from fitlib.metrics import accuracy


def blocks(width: int = 1024, depth: int = 4) -> nn.Module:
    torch.manual_seed(0)
    sizes = [8] + [32] * (depth - 1) + [3]
    return nn.Sequential(*[
        nn.Sequential(nn.Linear(a, width), nn.GELU(), nn.Dropout(0.1),
                      nn.Linear(width, b))
        for a, b in itertools.pairwise(sizes)
    ])  # fmt: skip


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()


def peak_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """The step's peak above its start, from the CPU allocator's reports."""
    step(model, x, y)  # gradients allocated once, as in training
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        F.cross_entropy(model(x), y).backward()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]"]  # fmt: skip
    now = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        now += e.nbytes()
        peak = max(peak, now)
    return peak


def checkpointing(rounds: int) -> None:
    x, y = torch.randn(512, 8), torch.randint(0, 3, (512,))
    models = {"plain": blocks(), "control": blocks(), "checkpointed": blocks()}
    call_hook(ActivationCheckpointing(["0", "1", "2", "3"]), "on_train_begin",
              model=models["checkpointed"])  # fmt: skip
    peaks = {k: peak_bytes(m, x, y) for k, m in models.items() if k != "control"}
    ratios = {"control": [], "checkpointed": []}
    for _ in range(rounds):
        secs = {}
        for name in random.sample(list(models), len(models)):
            start = time.process_time()
            for _ in range(5):
                step(models[name], x, y)
            secs[name] = time.process_time() - start
        for name in ratios:
            ratios[name].append(secs[name] / secs["plain"])
    print("| variant | peak memory of a step | CPU time per step |")
    print("|---|---|---|")
    print(f"| plain | {peaks['plain'] / 2**20:.1f} MiB | 1.00x |")
    print(f"| plain again (control) | | {statistics.median(ratios['control']):.2f}x |")
    print(f"| checkpointed, 4 of 4 blocks | {peaks['checkpointed'] / 2**20:.1f} MiB "
          f"| {statistics.median(ratios['checkpointed']):.2f}x |")  # fmt: skip


def quadrant_images(n: int, seed: int) -> TensorDataset:
    """64x64 noise with a brighter 8x8 patch in one quadrant: the class."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, 64, 64, generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    for i, q in enumerate(y.tolist()):
        r, c = 8 + 32 * (q // 2), 8 + 32 * (q % 2)
        dr, dc = torch.randint(0, 8, (2,), generator=g).tolist()
        x[i, :, r + dr : r + dr + 8, c + dc : c + dc + 8] += 0.12
    return TensorDataset(x, y)


def convnet() -> nn.Module:
    def conv(a: int, b: int) -> list[nn.Module]:
        return [nn.Conv2d(a, b, 3, stride=2, padding=1), nn.BatchNorm2d(b), nn.ReLU()]

    return nn.Sequential(
        *conv(3, 16),
        *conv(16, 32),
        *conv(32, 32),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(128, 4),
    )


def resizing_fit(seed: int, resize: bool) -> tuple[float, float, float]:
    torch.manual_seed(seed)
    data = DataBunch(DataLoader(quadrant_images(512, seed), 32, shuffle=True),
                     DataLoader(quadrant_images(256, 1000 + seed), 64),
                     device="cpu")  # fmt: skip
    callbacks = [ProgressiveResizing(start=32, buckets=3)] if resize else []
    learn = Learner(data, convnet(), F.cross_entropy, opt_func=torch.optim.SGD,
                    wd=0.01, metrics=[accuracy], progress=False,
                    callbacks=callbacks)  # fmt: skip
    start = time.process_time()
    history = learn.fit_one_cycle(6, 0.1)
    seconds = time.process_time() - start
    return seconds, history[-1]["valid_loss"], history[-1]["accuracy"]


def resizing(seeds: int) -> None:
    print(
        "| seed | fit at 64x64: CPU s, valid loss, accuracy | growing 32 -> 48 -> 64 |"
    )
    print("|---|---|---|")
    ratios = []
    for seed in range(seeds):
        full = resizing_fit(seed, False)
        grow = resizing_fit(seed, True)
        ratios.append(grow[0] / full[0])
        cells = [f"{s:.1f} s, {loss:.3f}, {acc:.3f}" for s, loss, acc in (full, grow)]
        print(f"| {seed} | {cells[0]} | {cells[1]} |")
    print(f"\nCPU time of the growing fit / the full-size fit: median "
          f"{statistics.median(ratios):.2f}x")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, one thread\n")
    checkpointing(args.rounds)
    print()
    resizing(args.seeds)


if __name__ == "__main__":
    main()
