"""fitlib's overhead against a hand-written PyTorch loop, as a ratio.

Workload: an MLP 32->64->10, batch 64, 16,384 training samples, 3 epochs,
validation (loss and accuracy) after each epoch, one thread. Both sides use
the same optimizer (AdamW) and the same cheap batch iterator, so the ratio
shows the loop's and the callbacks' cost, not a DataLoader's.

The runs are interleaved (hand, fitlib, fitlib+bar, hand again, ...) so
drifts in machine speed hit every variant alike; the ratio is the median of
per-round ratios. The second hand-written run is a control: its distance from
1.000x is the noise of the measurement on this machine.

Run: ``make bench`` or ``.venv/bin/python benchmarks/overhead.py --rounds 15``
"""

from __future__ import annotations

import argparse
import statistics
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
    start = time.perf_counter()
    for _ in range(EPOCHS):
        model.train()
        train_loss, n = 0.0, 0
        for x, y in train:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
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
    return time.perf_counter() - start


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
    start = time.perf_counter()
    learn.fit(EPOCHS, lr=LR)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    train, valid = make_data()
    variants = {
        "hand-written": lambda: hand_written(train, valid),
        "fitlib (no bar)": lambda: with_fitlib(train, valid, progress=False),
        "fitlib (bar)": lambda: with_fitlib(train, valid, progress=True),
        # The same loop again: its ratio shows how far noise alone moves one.
        "hand (control)": lambda: hand_written(train, valid),
    }
    for run in variants.values():  # warm-up: allocators, lazy imports
        run()
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            times[name].append(run())
    base = times["hand-written"]
    print(
        f"\n{args.rounds} interleaved rounds, {EPOCHS} epochs of {len(train)} batches"
    )
    for name, ts in times.items():
        ratio = statistics.median(t / b for t, b in zip(ts, base))
        print(f"{name:>16}: median {statistics.median(ts):.3f}s  ratio {ratio:.3f}x")


if __name__ == "__main__":
    main()
