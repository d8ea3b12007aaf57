"""The LR finder's ``valley`` per model and seed, by three rules.

Workload (as ``tests/callbacks/test_lr_finder_digits.py``): scikit-learn's
digits, a stratified 80% training split, batches of 64, weight decay 1e-2,
one thread; four models: LeNet-5 on the digits upsampled to 28x28 with plain
SGD (no momentum), with SGD and momentum 0.9, and with Adam, and an MLP on
the 8x8 digits with Adam. Each seed sets the initial weights and the batch
order, then ``learn.lr_find(num_it=...)`` sweeps from 1e-7 to 10.

Per model and seed it prints the valley by the old rule (the middle of the
stretch from the flat start's end to the smoothed curve's global minimum,
whether or not the loss fell: ``old_valley``), by the previous one (that
valley once the loss fell 1%, else a tenth of the lr where a step's own loss
first moved: ``previous_valley``), by fitlib's ``suggest_lrs`` (the same),
the problems the sweep warned about, and how much ``fit_one_cycle(3,
valley)`` lowers the loss on the training set (1 - after / before) at the
previous valley and at fitlib's. A fall of 1% that is less than 15 times a
step's noise deep now warns ``cliff``; for those rows, ``cliff low`` and
``drop low`` show the lower guess tried there and not kept (a tenth of the
lr where a step's loss first moved): it trained fewer seeds.
``--old-drop`` also trains at the old valley; ``--lrs 0.05,0.1,0.2`` adds
the drop at fixed rates, for the window where 1cycle trains. 1cycle sets
momentum 0.95-0.85 itself: the two LeNet + SGD models differ only in their
sweeps.

Run: ``.venv/bin/python benchmarks/lr_find_suggestions.py [--num-it 300]``
(a few minutes on one CPU thread; ``--models lenet_sgd --seeds 0 1``)
"""

from __future__ import annotations

import argparse
import functools
import warnings

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

import fitlib.learner
from fitlib import DataBunch, Learner
from fitlib.callbacks.lr_finder import LRFinder

KEPT: list[LRFinder] = []  # the sweeps' finders, for their steps' own losses


class KeptFinder(LRFinder):
    """An ``LRFinder`` that keeps itself in ``KEPT``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        KEPT.append(self)


fitlib.learner.LRFinder = KeptFinder  # learn.lr_find() makes these


MODELS = {  # the architecture, then the optimizer the sweep and 1cycle use
    "lenet_sgd": ("lenet", torch.optim.SGD),
    "lenet_sgdm": ("lenet", functools.partial(torch.optim.SGD, momentum=0.9)),
    "lenet_adam": ("lenet", torch.optim.Adam),
    "mlp_adam": ("mlp", torch.optim.Adam),
}


def digits() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The training split: 8x8 for the MLP, upsampled to 28x28 for LeNet."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16
    y = torch.tensor(data.target)
    train, _ = train_test_split(
        torch.arange(len(y)), test_size=0.2, stratify=y, random_state=0
    )
    big = F.interpolate(x, size=28, mode="bilinear")
    return {"mlp": (x[train], y[train]), "lenet": (big[train], y[train])}


def model_for(arch: str) -> nn.Module:
    if arch == "mlp":
        return nn.Sequential(
            nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
        )
    return nn.Sequential(
        nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
        nn.Linear(84, 10),
    )  # fmt: skip


def learner(data: dict, name: str, seed: int) -> Learner:
    arch, opt_func = MODELS[name]
    torch.manual_seed(seed)  # the weights, then the batch order
    model = model_for(arch)
    loader = DataLoader(TensorDataset(*data[arch]), 64, shuffle=True)
    return Learner(
        DataBunch(loader, None, device="cpu"), model, F.cross_entropy,
        opt_func=opt_func, metrics=[], wd=1e-2, path=".", progress=False,
    )  # fmt: skip


def old_valley(lrs: list[float], losses: list[float]) -> float:
    """The rule before issue 29, on the recorded (pre-divergence) sweep: the
    flat start ends at the last point before the global minimum within a
    tenth of the fall below the start level (the median of the first tenth);
    the valley is the middle of the stretch from there to the minimum."""
    y = np.asarray(losses, dtype=float)
    start, low = np.median(y[: max(1, len(y) // 10)]), int(np.argmin(y))
    flat = np.flatnonzero(y[: low + 1] >= start - 0.1 * (start - y[low]))
    first = int(flat[-1]) if flat.size else 0
    return float(lrs[(first + low) // 2])


def previous_valley(lrs: list[float], losses: list[float], steps: list[float]):
    """The rule before the depth test: the old valley (its minimum after the
    first tenth) once the loss fell 1% below its start level, else a tenth of
    the lr of the first step whose own loss lay 6 robust standard deviations
    from the median of the first half (the last step if none did)."""
    y = np.asarray(losses, dtype=float)
    tenth = max(1, len(y) // 10)
    start = np.median(y[:tenth])
    low = tenth + int(np.argmin(y[tenth:])) if len(y) > tenth else int(np.argmin(y))
    if start - y[low] >= 0.01 * abs(start):
        flat = np.flatnonzero(y[: low + 1] >= start - 0.1 * (start - y[low]))
        return float(lrs[(int(flat[-1]) + low) // 2])
    return moved_guess(lrs, steps)


def moved_guess(lrs: list[float], steps: list[float]) -> float:
    """A tenth of the lr of the first step whose own loss lay 6 robust
    standard deviations from the median of the first half (else the last)."""
    s = np.asarray(steps, dtype=float)
    ref = s[: max(1, len(s) // 2)]
    level = np.median(ref)
    spread = 1.4826 * np.median(np.abs(ref - level))
    away = np.flatnonzero(~(np.abs(s - level) <= 6 * spread))
    return float(lrs[int(away[0]) if away.size else len(s) - 1]) / 10


def drop(data: dict, name: str, seed: int, lr: float) -> float:
    """1 - the training-set loss after ``fit_one_cycle(3, lr)`` / before."""
    learn = learner(data, name, seed)
    before = learn.validate(learn.data.train_dl)["valid_loss"]
    learn.fit_one_cycle(3, lr)
    return 1 - learn.validate(learn.data.train_dl)["valid_loss"] / before


def run(data: dict, name: str, seed: int, args: argparse.Namespace) -> str:
    learn = learner(data, name, seed)
    with warnings.catch_warnings():  # the finder keeps them in problems
        warnings.simplefilter("ignore")
        new = learn.lr_find(num_it=args.num_it).valley
    finder = KEPT.pop()
    old = old_valley(finder.lrs, finder.losses)
    prev = previous_valley(finder.lrs, finder.losses, finder.step_losses)
    problem = ",".join(finder.problems) or "-"
    row = f"{name:<11} {seed:>4} {old:>10.2g} {prev:>10.2g} {new:>10.2g}"
    new_drop = drop(data, name, seed, new)
    prev_drop = new_drop if prev == new else drop(data, name, seed, prev)
    row += f" {problem:>8} {prev_drop:>9.0%} {new_drop:>9.0%}"
    if "cliff" in finder.problems:  # the lower guess tried for a cliff
        guess = moved_guess(finder.lrs, finder.step_losses)
        row += f" {guess:>10.2g} {drop(data, name, seed, guess):>9.0%}"
    else:
        row += f" {'-':>10} {'-':>9}"
    if args.old_drop:
        row += f" {drop(data, name, seed, old):>9.0%}"
    for lr in args.lrs:
        row += f" {drop(data, name, seed, lr):>8.0%}"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=None)
    parser.add_argument("--seeds", nargs="+", type=int, default=list(range(6)))
    parser.add_argument("--num-it", type=int, default=100, help="sweep steps")
    parser.add_argument("--old-drop", action="store_true", help="train at old too")
    parser.add_argument(
        "--lrs", type=lambda s: [float(v) for v in s.split(",")], default=[]
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = digits()
    header = f"{'model':<11} {'seed':>4} {'old valley':>10} {'prev':>10}"
    header += f" {'new valley':>10} {'problem':>8} {'drop prev':>9} {'drop new':>9}"
    header += f" {'cliff low':>10} {'drop low':>9}"
    header += f" {'drop old':>9}" if args.old_drop else ""
    header += "".join(f" {f'at {lr:g}':>8}" for lr in args.lrs)
    print(header)
    for name in args.models or list(MODELS):
        for seed in args.seeds:
            print(run(data, name, seed, args), flush=True)


if __name__ == "__main__":
    main()
