"""What MixUp and CutMix do against overfitting on a small image set, and
what they cost per step.

**Quality** (the default): scikit-learn's digits as 1x8x8 images (pixels
/ 16), a small training set (``--n-train`` images, 200 by default, drawn
per seed) and the other 1,597 images for validation; a CNN (conv 1->16,
ReLU, conv 16->32, ReLU, max-pool 2, flatten, linear 512->10), Adam at
a constant ``--lr`` (3e-3) without weight decay, batches of 32,
``--epochs`` epochs (100: long enough for the plain fit to overfit), one
thread. Per seed (the split, the initial weights and the batch order) three
fits from the same start: plain, with ``MixUp(alpha=0.4)`` and with
``CutMix(alpha=1.0)``. Reported: the validation loss and accuracy at the
end (``learn.validate()``), and the lowest validation loss of the fit and
its epoch (how far the end is from the best: the overfitting).

**Cost** (``--cost``): the time of a fit of the same CNN on 1,597
images (4 epochs of 50 steps, one validation batch an epoch) with each
callback, against the same fit without, fits interleaved (``--repeats`` of
each, the median): wall-clock and the process's CPU time (one thread: what
the work costs, less moved by other processes than the wall-clock), their
ratios, and the extra CPU time per step. A busy machine still moves these
numbers; compare them on one machine.

Run: ``.venv/bin/python benchmarks/mixing.py [--seeds 0 1 2 3 4]`` and
``.venv/bin/python benchmarks/mixing.py --cost``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

from fitlib import DataBunch, Learner
from fitlib.callbacks import CutMix, MixUp

RECIPES = {
    "plain": lambda: [],
    "MixUp(0.4)": lambda: [MixUp(alpha=0.4)],
    "CutMix(1.0)": lambda: [CutMix(alpha=1.0)],
}


def data(seed: int, n_train: int) -> DataBunch:
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16
    y = torch.tensor(digits.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    train, valid = order[:n_train], order[n_train:]
    g = torch.Generator().manual_seed(seed)
    return DataBunch(
        DataLoader(TensorDataset(x[train], y[train]), 32, shuffle=True, generator=g),
        DataLoader(TensorDataset(x[valid], y[valid]), 512),
    )


def cnn(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 16, 10),
    )


def one_fit(recipe: str, seed: int, n_train: int, epochs: int, lr: float) -> dict:
    torch.manual_seed(seed)  # the recipes' generators: derived from initial_seed()
    learn = Learner(data(seed, n_train), cnn(seed), F.cross_entropy,
                    opt_func=torch.optim.Adam, wd=0, metrics=[], progress=False,
                    callbacks=RECIPES[recipe]())  # fmt: skip
    history = learn.fit(epochs, lr=lr)
    losses = [r["valid_loss"] for r in history]
    best = min(range(len(losses)), key=losses.__getitem__)
    return {"end": losses[-1], "best": losses[best], "best_epoch": best,
            "acc": accuracy(learn)}  # fmt: skip


def accuracy(learn: Learner) -> float:
    preds, targets = learn.get_preds()
    return (preds.argmax(1) == targets).float().mean().item()


def quality(seeds: list[int], n_train: int, epochs: int, lr: float) -> None:
    print(f"digits 8x8, {n_train} training images, {epochs} epochs at lr {lr:g}, "
          f"seeds {seeds}")  # fmt: skip
    print("| seed | recipe | valid loss at the end | valid accuracy at the end "
          "| lowest valid loss (epoch) |")  # fmt: skip
    print("|---|---|---|---|---|")
    results: dict[str, list[dict]] = {name: [] for name in RECIPES}
    for seed in seeds:
        for name in RECIPES:
            r = one_fit(name, seed, n_train, epochs, lr)
            results[name].append(r)
            print(f"| {seed} | {name} | {r['end']:.4f} | {r['acc']:.4f} | "
                  f"{r['best']:.4f} ({r['best_epoch']}) |", flush=True)  # fmt: skip
    print("\n| recipe | mean valid loss at the end | mean valid accuracy | "
          "mean lowest valid loss | fits ending below plain |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name, rs in results.items():
        below = sum(
            r["end"] < p["end"] for r, p in zip(rs, results["plain"], strict=True)
        )
        print(f"| {name} | {statistics.mean(r['end'] for r in rs):.4f} | "
              f"{statistics.mean(r['acc'] for r in rs):.4f} | "
              f"{statistics.mean(r['best'] for r in rs):.4f} | "
              f"{below}/{len(rs)} |")  # fmt: skip


def cost(repeats: int, epochs: int = 4) -> None:
    # Training steps (one validation batch an epoch): 1,597 images, 50 steps
    # an epoch.
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in RECIPES}
    steps = epochs * len(data(0, 1597).train_dl)
    for _ in range(repeats):
        for name in RECIPES:  # interleaved: a slower moment hits all alike
            learn = Learner(data(0, 1597), cnn(0), F.cross_entropy,
                            opt_func=torch.optim.Adam, wd=0, metrics=[],
                            progress=False, callbacks=RECIPES[name]())  # fmt: skip
            wall, cpu = time.perf_counter(), time.process_time()
            learn.fit(epochs, lr=3e-3, valid_batches=1)
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    medians = {name: [statistics.median(t[i] for t in ts) for i in (0, 1)]
               for name, ts in times.items()}  # fmt: skip
    (plain_wall, plain_cpu) = medians["plain"]
    print(f"{epochs} epochs, {steps} training steps, median of {repeats} fits each")
    print("| recipe | fit, wall (s) | ratio | fit, CPU (s) | ratio | "
          "extra CPU per step (ms) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, (wall, cpu) in medians.items():
        extra = (cpu - plain_cpu) / steps * 1e3
        print(f"| {name} | {wall:.3f} | {wall / plain_wall:.3f} | {cpu:.3f} | "
              f"{cpu / plain_cpu:.3f} | {extra:.3f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--n-train", type=int, default=200)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--cost", action="store_true")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.cost:
        cost(args.repeats)
    else:
        quality(args.seeds, args.n_train, args.epochs, args.lr)


if __name__ == "__main__":
    main()
