"""``fitlib.running_loss``: what each batch's loss weighs, the running sum on
the device and the smoothed loss. Token counts (``loss_count``):
``tests/test_running_loss_tokens.py``."""

import pytest
import torch

from fitlib.host_copy import to_floats
from fitlib.running_loss import (
    FOLD,
    LossSmoother,
    RunningLoss,
    batch_size,
    first_tensor,
)


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


def test_a_running_loss_is_the_size_weighted_mean_not_the_mean_of_means():
    loss = RunningLoss()
    assert loss.empty
    for value, size in [(1.0, 4), (2.0, 4), (6.0, 2)]:
        loss.add(torch.tensor(value), size)
    assert not loss.empty
    # (4*1 + 4*2 + 2*6) / 10 = 2.4; the mean of the batch means would be 3.0
    assert loss.mean(to_floats(loss.pending())) == pytest.approx(2.4)


def test_batch_size_reads_the_targets_then_the_inputs():
    assert batch_size((torch.zeros(3),), torch.zeros(5, 2)) == 3
    assert batch_size((), torch.zeros(5, 2)) == 5  # no targets: the inputs
    assert batch_size({"ids": [torch.zeros(4, 7)]}) == 4  # nested
    assert batch_size(torch.tensor(1.0)) == 1  # a 0-dim value: one sample
    assert first_tensor({"a": [], "b": 1}) is None


def test_the_loss_smoother_is_debiased_and_goes_on_where_it_stopped():
    smoother = LossSmoother()
    assert smoother([2.0]) == [2.0]  # debiased: the first value is itself
    assert smoother([1.0]) == LossSmoother()([2.0, 1.0])[1:]
    assert smoother.n == 2
