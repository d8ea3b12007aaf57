"""``fitlib.record``: the epoch's sums stay bounded for any epoch length, and
its record is exact and read in one host transfer."""

import pytest
import torch

from fitlib.record import EpochTally
from fitlib.running_loss import FOLD


def losses(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return list(torch.rand(n, generator=g).unbind()), [1 + i % 7 for i in range(n)]


def test_the_epoch_tally_keeps_little_in_a_long_epoch_and_its_record_is_exact():
    values, sizes = losses(2 * FOLD + 3)
    tally = EpochTally()
    for v, n in zip(values, sizes):
        tally.add_batch(v, n, True, {"part": v / 2})
    assert len(tally.loss._losses) < FOLD
    assert len(tally.parts["train_part"]._losses) < FOLD
    exact = sum(float(v) * n for v, n in zip(values, sizes)) / sum(sizes)
    record = tally.record(0, None, [], lr=0.1)
    assert record["train_loss"] == pytest.approx(exact, rel=1e-12)
    assert record["train_part"] == pytest.approx(exact / 2, rel=1e-6)
    assert record["valid_loss"] is None


def test_train_loss_is_the_sample_weighted_mean_of_the_epochs_batches():
    tally = EpochTally()
    for loss, size in [(1.0, 4), (2.0, 4), (6.0, 2)]:
        tally.add_batch(torch.tensor(loss), size, True, None)
        tally.add_batch(torch.tensor(99.0), 5, False, None)  # validation: not it
    # (4*1 + 4*2 + 2*6) / 10 = 2.4; the mean of the batch means would be 3.0
    assert tally.record(0, [torch.tensor(0.5)], [], 0.1)["train_loss"] == 2.4


def test_a_record_is_read_in_one_host_transfer(monkeypatch):
    from fitlib.metrics import Metrics, accuracy

    tally = EpochTally(Metrics([accuracy]))
    for i in range(20):
        out, y = torch.randn(8, 3), torch.randint(0, 3, (8,))
        tally.add_batch(
            torch.tensor(float(i)), 8, True, {"a": torch.tensor(1.0)}, out, y
        )
    calls = []
    for name in ("tolist", "item", "__float__", "cpu", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    record = tally.record(3, [torch.tensor(0.5), torch.tensor(0.25)], ["acc"], 0.1)
    assert calls == ["tolist"]
    assert record["train_loss"] == pytest.approx(9.5) and record["train_a"] == 1.0
    assert list(record) == [
        "epoch", "train_loss", "valid_loss", "acc", "train_accuracy", "train_a",
        "valid_a", "lr", "time",
    ]  # fmt: skip


def test_start_forgets_the_batches_of_an_interrupted_epoch():
    tally = EpochTally()
    tally.add_batch(torch.tensor(100.0), 4, True, {"a": torch.tensor(1.0)})
    tally.start()
    tally.add_batch(torch.tensor(1.0), 4, True, None)
    record = tally.record(0, None, [], 0.1)
    assert record["train_loss"] == 1.0  # the part's name stays in the fit's records
    assert record["train_a"] is None and record["valid_a"] is None


def test_no_training_batch_gives_no_train_loss():
    assert EpochTally().record(0, None, [], 0.1)["train_loss"] is None


def test_under_several_processes_train_values_are_over_all_ranks(monkeypatch):
    """Every rank must reach the same decision: the values are global."""
    from fitlib import ranks

    shards = {0: ([1.0, 3.0], [2, 2]), 1: ([5.0], [4])}  # losses, batch sizes
    monkeypatch.setattr(ranks, "world_size", lambda: 2)
    records = []
    for rank in (0, 1):
        tally = EpochTally()
        for loss, size in zip(*shards[rank], strict=True):
            tally.add_batch(torch.tensor(loss), size, True, None)
        losses, sizes = shards[1 - rank]
        pair = [sum(v * s for v, s in zip(losses, sizes)), float(sum(sizes))]
        other = torch.tensor(pair, dtype=torch.float64)

        def fake_all_reduce(t, o=other):
            return t + o

        monkeypatch.setattr(ranks, "all_reduce_sum", fake_all_reduce)
        records.append(tally.record(0, None, [], 0.1))
    assert [r["train_loss"] for r in records] == [pytest.approx((2 + 6 + 20) / 8)] * 2
