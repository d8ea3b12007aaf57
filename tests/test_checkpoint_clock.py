import fitlib.checkpoint_clock as clock_module
import fitlib.ranks as ranks
from fitlib.checkpoint_clock import SaveClock


def fake_time(monkeypatch, step_seconds):
    now = [0.0]

    def read():
        return now[0]

    monkeypatch.setattr(clock_module, "monotonic", read)
    return now


def test_in_one_process_it_checks_the_clock_at_every_step(monkeypatch):
    now = fake_time(monkeypatch, 1.0)
    clock = SaveClock(10.0)
    due = []
    for _ in range(25):
        now[0] += 1.0
        due.append(clock.tick())
        if due[-1]:
            clock.reset()
    assert [i + 1 for i, d in enumerate(due) if d] == [10, 20]


def test_under_several_ranks_rank_0s_answer_is_taken_at_paced_checks(monkeypatch):
    """Rank 1's clock runs far ahead, yet it saves when rank 0 says so, and
    the ranks exchange a number about ten times per interval, not per step."""
    now = fake_time(monkeypatch, 0.01)
    sent = []

    def broadcast(value):  # what rank 1 receives: rank 0's value
        sent.append(value)
        return rank0.pop(0)

    monkeypatch.setattr(ranks, "world_size", lambda: 2)
    monkeypatch.setattr(ranks, "broadcast_int", broadcast)
    rank0 = [2 * 50 + 0] * 3 + [2 * 50 + 1] + [2 * 50 + 0] * 100
    clock = SaveClock(5.0)
    due = []
    for _ in range(400):
        now[0] += 100.0  # rank 1's own clock: due at every step
        due.append(clock.tick())
        if due[-1]:
            clock.reset()
    # Checks at step 1 (then 50 steps apart, as rank 0 said): the 4th says due.
    assert [i + 1 for i, d in enumerate(due) if d] == [151]
    assert len(sent) == 9  # at steps 1, 51, 101, 151, 152, 202, ... 352


def test_rank_0_paces_its_checks_from_the_steps_duration(monkeypatch):
    now = fake_time(monkeypatch, 0.01)
    gaps = []
    monkeypatch.setattr(ranks, "world_size", lambda: 2)
    monkeypatch.setattr(ranks, "broadcast_int", lambda v: gaps.append(v // 2) or v)
    clock = SaveClock(10.0)
    for _ in range(300):
        now[0] += 0.01  # 100 steps a second: a tenth of 10 s is 100 steps
        clock.tick()
    assert len(gaps) == 4 and all(99 <= g <= 100 for g in gaps)  # (rounding)
