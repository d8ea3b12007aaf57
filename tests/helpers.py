"""Tiny synthetic problems shared by the tests: each trains in well under a second."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

from fitlib import Callback, DataBunch, HPOptimizer, Learner, fit

TESTS = Path(__file__).parent


def child_env(**extra: str) -> dict:
    """The environment for a child Python process: this one's, with the tests'
    helpers and the checkout's fitlib importable in front of what the parent
    already had (where fitlib is not installed, e.g. on a GPU machine)."""
    paths = [str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths)), **extra}


class FakeClock:
    """A stand-in for the ``time`` module a clock reads (``monotonic``): its
    time moves only when a test adds to ``now``."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now


def kill_until_done(cmd: list[str], env: dict, seed: int, kills: int = 4) -> int:
    """Runs ``cmd`` (a child that prints ``started`` once training starts)
    again and again: the first ``kills`` times it is killed with SIGKILL at a
    random moment, then it is let finish (12 runs at most). Returns how many
    runs were killed before they ended on their own."""
    rng, killed = random.Random(seed), 0
    for attempt in range(12):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)  # fmt: skip
        while (line := proc.stdout.readline()) and line.strip() != b"started":
            pass  # imports done, training starts: the kill can come now
        if attempt < kills:  # then let it finish
            time.sleep(rng.uniform(0.05, 0.9))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                killed += 1
        proc.wait(timeout=120)
        if proc.returncode == 0:
            break
    return killed


def make_dataset(n: int = 100, d: int = 8, n_classes: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return TensorDataset(x, y.clamp(max=n_classes - 1))


def make_model(d: int = 8, n_classes: int = 3, seed: int = 0) -> nn.Module:
    """A model with batch norm and dropout, so parity tests cover both."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(d, 16),
        nn.BatchNorm1d(16),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Linear(16, n_classes),
    )


def make_data(
    n_train: int = 100, n_valid: int = 37, bs: int = 16, shuffle: bool = True
) -> DataBunch:
    train = make_dataset(n_train, seed=0)
    valid = make_dataset(n_valid, seed=1)
    return DataBunch(
        DataLoader(train, bs, shuffle=shuffle),
        DataLoader(valid, bs),
        device="cpu",
    )


def train(
    callbacks=(),
    epochs: int = 2,
    *,
    data: DataBunch | None = None,
    model: nn.Module | None = None,
    loss_func=F.cross_entropy,
    metrics=(),
    lr: float = 0.1,
    mom: float | None = None,
    opt_func=torch.optim.SGD,
    **fit_kwargs,
) -> nn.Module:
    """The tests' one training run: ``fit`` on the tiny problem (``make_data``,
    ``make_model``) with SGD at ``lr`` (and momentum ``mom``, if given), the
    given callbacks and metrics; returns the trained model. Pass ``data``,
    ``model`` or ``fit``'s other arguments (``max_steps``, ``train_metrics``)
    to change one thing."""
    model = make_model() if model is None else model
    hypers = {"lr": lr} if mom is None else {"lr": lr, "mom": mom}
    opt = HPOptimizer(model.parameters(), opt_func, **hypers)
    data = make_data() if data is None else data
    fit(epochs, model, loss_func, opt, data, list(callbacks), list(metrics),
        **fit_kwargs)  # fmt: skip
    return model


def clone_params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def scripted_record(
    losses=(), sizes=(), last_metrics=None, names=(), epoch=0, lr=0.1, seconds=None
) -> dict:
    """The epoch record the loop would build from these training losses (of
    batches of ``sizes`` samples) and ``[valid_loss, *metrics]``: to drive an
    ``on_epoch_end`` hook by hand."""
    from fitlib.record import EpochTally

    tally = EpochTally()
    for loss, size in zip(losses, sizes, strict=True):
        tally.add_batch(torch.tensor(float(loss)), size, True, None)
    record = tally.record(epoch, last_metrics, list(names), lr)
    return record if seconds is None else record | {"time": seconds}


class Crash(Callback):
    """Raises ``RuntimeError("crash")`` after training batch ``at`` (an
    iteration number): a run killed part way, to resume."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_batch_end(self, train: bool, iteration: int) -> None:
        if train and iteration == self.at:
            raise RuntimeError("crash")


def resume_learner(callbacks=(), model: nn.Module | None = None) -> Learner:
    """The resume tests' run: a Learner (SGD, no bar) on ``make_dataset(100)``
    in shuffled batches of 16 (7 an epoch; validation: 37 samples, 3 batches)
    with an MLP that has dropout, seeded, so two of them train alike."""
    torch.manual_seed(0)
    model = model or nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3)
    )
    data = DataBunch(
        DataLoader(make_dataset(100), 16, shuffle=True),
        DataLoader(make_dataset(37, seed=1), 16),
        device="cpu",
    )
    return Learner(data, model, F.cross_entropy, progress=False,
                   callbacks=list(callbacks), opt_func=torch.optim.SGD)  # fmt: skip


def same_weights(a: Learner, b: Learner) -> bool:
    """Whether two Learners' models hold the same tensors, bit for bit."""
    pairs = zip(a.model.state_dict().values(), b.model.state_dict().values())
    return all(torch.equal(x, y) for x, y in pairs)
