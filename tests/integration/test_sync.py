"""No host-device sync per batch: the count of syncing calls must not grow with
the number of batches (it may grow with epochs and with time-paced refreshes).

On a CPU there is no device to wait for, so the test counts the Python calls
that would force a sync on a GPU.
"""

import time

import pytest
import torch
from helpers import make_model
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

from fitlib import DataBunch, Learner
from fitlib.callbacks import (
    GradientAccumulation,
    GradientClipping,
    MixedPrecision,
    OneCycleScheduler,
    ReduceLROnPlateau,
    TerminateOnNaN,
)
from fitlib.metrics import F1Score, accuracy, top_k_accuracy


def fit_twice(learn):
    learn.fit(2, lr=0.1)


def train_and_count(n_train, counter, monkeypatch, train=fit_twice, opt_func=None):
    from helpers import make_dataset

    # A frozen clock: the progress bar refreshes once, then never (time-paced).
    monkeypatch.setattr(time, "perf_counter", lambda: 1000.0)
    data = DataBunch(
        DataLoader(make_dataset(n_train), 16, shuffle=True),
        DataLoader(make_dataset(n_train // 2, seed=1), 16),
        device="cpu",
    )
    metrics = [accuracy, F1Score(), lambda o, y: top_k_accuracy(o, y, k=2)]
    learn = Learner(
        data,
        make_model(),
        F.cross_entropy,
        opt_func=opt_func or torch.optim.SGD,
        metrics=metrics,
        progress=True,
    )
    before = counter["n"]
    train(learn)
    return counter["n"] - before, learn


def test_sync_count_does_not_grow_with_batches(sync_counter, monkeypatch):
    few, learn = train_and_count(64, sync_counter, monkeypatch)
    many, learn_many = train_and_count(256, sync_counter, monkeypatch)
    assert len(learn.recorder.losses) == 8 and len(learn_many.recorder.losses) == 32
    assert few == many
    assert few > 0  # the counter works: epoch ends do read values


def test_counter_sees_a_per_batch_sync(sync_counter, monkeypatch):
    """The instrument itself: a callback that syncs each batch is caught."""
    from fitlib import Callback

    class Leaky(Callback):
        def on_batch_end(self, last_loss, **kwargs):
            last_loss.item()

    monkeypatch.setattr(Learner, "_callbacks", lambda self, extra: [Leaky()])
    leaky_few, _ = train_and_count(64, sync_counter, monkeypatch)
    leaky_many, _ = train_and_count(256, sync_counter, monkeypatch)
    assert leaky_many - leaky_few == 24 + 12  # one per extra train and valid batch


def with_callbacks(*cbs):
    def train(learn):
        learn.fit(2, lr=0.1, callbacks=list(cbs))

    return train


# Issue 3: each training-control callback keeps the loop sync-free. Fresh
# callback objects per run: a factory for each case.
CONTROL = {
    "one_cycle": lambda: lambda learn: learn.fit_one_cycle(2, max_lr=0.1),
    "warmup_cos": lambda: lambda learn: learn.fit_warmup_cos(2, lr=0.1),
    "plateau_valid": lambda: with_callbacks(ReduceLROnPlateau(patience=0)),
    "plateau_train": lambda: with_callbacks(ReduceLROnPlateau("train_loss")),
    "bf16": lambda: lambda learn: fit_twice(learn.to_bf16()),
    "fp16_fused": lambda: lambda learn: fit_twice(learn.to_fp16()),
    "clip_norm": lambda: with_callbacks(GradientClipping(max_norm=0.5)),
    "clip_value": lambda: with_callbacks(GradientClipping(max_value=0.01)),
    "accumulation": lambda: with_callbacks(GradientAccumulation(3)),
    "terminate_on_nan": lambda: with_callbacks(TerminateOnNaN()),
    "all_at_once": lambda: with_callbacks(
        GradientAccumulation(2),
        MixedPrecision(torch.bfloat16),
        GradientClipping(max_norm=1.0),
        OneCycleScheduler(0.1),
        TerminateOnNaN(),
    ),
}


@pytest.mark.filterwarnings("ignore:MixedPrecision.float16. on the CPU")
@pytest.mark.parametrize("case", CONTROL)
def test_training_control_callbacks_add_no_sync_per_batch(
    case, sync_counter, monkeypatch
):
    few, learn = train_and_count(64, sync_counter, monkeypatch, CONTROL[case]())
    many, learn_many = train_and_count(256, sync_counter, monkeypatch, CONTROL[case]())
    assert len(learn_many.recorder.losses) == 4 * len(learn.recorder.losses)
    assert few == many


@pytest.mark.filterwarnings("ignore:lr_find:UserWarning")  # a short toy sweep
def test_lr_find_adds_no_sync_per_step(sync_counter, monkeypatch):
    def sweep(n_steps):
        def train(learn):
            learn.lr_find(num_it=n_steps, stop_div=True)

        return train

    few, learn = train_and_count(64, sync_counter, monkeypatch, sweep(8))
    many, learn_many = train_and_count(256, sync_counter, monkeypatch, sweep(32))
    assert len(learn.recorder.lr_find_result["lrs"]) == 8
    assert len(learn_many.recorder.lr_find_result["lrs"]) == 32
    assert few == many
