"""fitlib.time_budget: max_time read, the clock, and the ranks' agreement
(rank 0 decides; the others follow at agreed iterations)."""

import pytest
from helpers import FakeClock

import fitlib.time_budget as time_budget
from fitlib.time_budget import TimeBudget, as_seconds, clock


@pytest.fixture
def fake(monkeypatch):
    fake = FakeClock(50.0)
    monkeypatch.setattr(time_budget, "time", fake)
    return fake


def test_the_clock_reads_hours_minutes_and_seconds():
    assert [clock(s) for s in (60.3, 41400, 0.05, 59.999, 108001.25)] == [
        "0:01:00.3", "11:30:00", "0:00:00.05", "0:01:00", "30:00:01.25"
    ]  # fmt: skip


def test_one_process_decides_by_its_own_clock_at_every_batch(fake):
    budget = TimeBudget(3, owner="fit")
    assert budget.spent(0) is None  # not started: nothing spent
    budget.start(iteration=0)
    fake.now += 2.9
    assert budget.spent(1) is None
    fake.now += 0.1
    assert budget.spent(2) == "max_time=0:00:03 reached after 0:00:03"
    fake.now += 5
    assert budget.spent(3) == "max_time=0:00:03 reached after 0:00:03"  # kept


def test_a_second_start_gives_the_whole_budget_again(fake):
    budget = TimeBudget(3, owner="fit")
    budget.start(0)
    fake.now += 4
    assert budget.spent(1) is not None
    budget.stop()
    fake.now += 100
    assert budget.elapsed() == 4  # the fit's time, not since
    budget.start(7)  # the next fit (a resumed one)
    assert budget.spent(8) is None and budget.elapsed() == 0


class Ranks:
    """Two ranks, seen from ``rank``: a broadcast returns rank 0's word (the
    next of ``rank0_words`` on rank 1); ``calls`` counts the broadcasts."""

    def __init__(self, rank, rank0_words=()):
        self.rank, self.words, self.calls = rank, list(rank0_words), []

    def broadcast_int(self, value):
        self.calls.append(value)
        return value if self.rank == 0 else self.words.pop(0)


def several(monkeypatch, ranks):
    monkeypatch.setattr(time_budget.ranks, "world_size", lambda: 2)
    monkeypatch.setattr(time_budget.ranks, "is_main", lambda: ranks.rank == 0)
    monkeypatch.setattr(time_budget.ranks, "broadcast_int", ranks.broadcast_int)


def test_rank_0_paces_the_checks_about_a_second_apart(fake, monkeypatch):
    ranks = Ranks(rank=0)
    several(monkeypatch, ranks)
    budget = TimeBudget(60, owner="fit")
    budget.start(iteration=100)  # a resumed fit
    assert budget.spent(100) is None and ranks.calls == [101]  # first: 1 batch on
    for iteration in range(101, 200):
        fake.now += 0.01  # 100 batches a second
        assert budget.spent(iteration) is None
    # Checks at 101 (then 100 batches a second: next at 201): one broadcast.
    assert ranks.calls == [101, 201]


def test_other_ranks_suspend_when_rank_0_says_whatever_their_clock(fake, monkeypatch):
    ranks = Ranks(rank=1, rank0_words=[5, 9, -1])
    several(monkeypatch, ranks)
    budget = TimeBudget(1, owner="fit")
    budget.start(iteration=0)
    fake.now += 30  # far past the budget on this rank's clock
    assert [budget.spent(i) for i in range(9)] == [None] * 9  # checks at 0, 5
    assert budget.spent(9) == "max_time=0:00:01 reached after 0:00:30"
    assert len(ranks.calls) == 3


def test_at_an_epoch_end_every_rank_agrees_whatever_the_pace(fake, monkeypatch):
    ranks = Ranks(rank=1, rank0_words=[1000, -1])
    several(monkeypatch, ranks)
    budget = TimeBudget(1, owner="fit")
    budget.start(iteration=0)
    assert budget.spent(0) is None  # the next check: at 1000
    assert budget.spent(7, epoch_end=True) is not None  # agreed at the epoch's end


@pytest.mark.parametrize("bad", [0, -1.5, "soon", [60]], ids=str)
def test_as_seconds_refuses_what_is_no_positive_time(bad):
    with pytest.raises(ValueError, match=r"^fit: max_time"):
        as_seconds(bad, "fit")
