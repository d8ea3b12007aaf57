"""The helpers the loggers share: sums that stay bounded for any epoch length."""

import math

import pytest
import torch

from fitlib.callback import call_hook
from fitlib.callbacks import ProgressBar
from fitlib.callbacks.monitor import Monitor
from fitlib.callbacks.tracking import FOLD, RunningLoss
from fitlib.core import to_floats


def losses(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return list(torch.rand(n, generator=g).unbind()), [1 + i % 7 for i in range(n)]


def test_a_running_loss_keeps_a_bounded_number_of_tensors_and_stays_exact():
    values, sizes = losses(3 * FOLD + 5)
    loss = RunningLoss()
    for v, n in zip(values, sizes):
        loss.add(v, n)
        assert len(loss._losses) < FOLD  # folded into one device sum
    exact = sum(float(v) * n for v, n in zip(values, sizes)) / sum(sizes)
    assert loss.mean(to_floats(loss.pending())) == pytest.approx(exact, rel=1e-12)
    assert loss.samples == sum(sizes)
    state = loss.state_dict()
    restored = RunningLoss()
    restored.load_state_dict(state)
    restored.add(torch.tensor(2.0), 3)
    total = exact * sum(sizes) + 6.0
    assert restored.mean(to_floats(restored.pending())) == pytest.approx(
        total / (sum(sizes) + 3), rel=1e-12
    )


def test_the_progress_bar_and_a_monitor_keep_little_in_a_long_epoch(frozen_clock):
    values, sizes = losses(2 * FOLD + 3)
    bar, monitor = ProgressBar(bars=False), Monitor("train_loss")
    call_hook(bar, "on_train_begin", n_epochs=1, n_steps=len(values))
    call_hook(bar, "on_epoch_begin")
    for v, n in zip(values, sizes):
        target = torch.zeros(n)
        call_hook(bar, "on_batch_end", train=True, last_loss=v, last_target=target)
        monitor.add_batch(v, n)
    assert len(bar._loss._losses) < FOLD and len(monitor._loss._losses) < FOLD
    exact = sum(float(v) * n for v, n in zip(values, sizes)) / sum(sizes)
    assert monitor.read(None) == pytest.approx(exact, rel=1e-12)
    call_hook(bar, "on_epoch_end", epoch=0, last_metrics=None)
    assert math.isclose(float(bar.rows[-1][1]), exact, abs_tol=1e-6)
