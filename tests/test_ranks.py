"""``fitlib.ranks``: where this process stands, with and without a process
group, and the collectives that do nothing alone."""

import torch
import torch.distributed as dist

from fitlib import ranks


def test_without_a_process_group_there_is_one_main_rank(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert not ranks.launched() and not ranks.active()
    assert (ranks.rank(), ranks.world_size(), ranks.local_rank()) == (0, 1, 0)
    assert ranks.is_main()
    t = torch.ones(3)
    assert ranks.all_reduce_sum(t) is t
    assert ranks.gather_to_all({"a": 1}) == [{"a": 1}]
    assert ranks.broadcast_int(7) == 7
    ranks.barrier()  # nothing to wait for


def test_torchruns_environment_says_launched_and_the_ranks_before_a_group(
    monkeypatch,
):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert ranks.launched() and not ranks.active()
    assert (ranks.rank(), ranks.local_rank()) == (3, 1)
    assert not ranks.is_main()  # rank 3 leaves bars, logs and files to rank 0


def test_in_a_group_of_one_the_group_answers(one_process_group):
    dist.init_process_group("gloo")
    assert ranks.active() and ranks.launched()
    assert (ranks.rank(), ranks.world_size()) == (0, 1) and ranks.is_main()
    assert torch.equal(ranks.all_reduce_sum(torch.ones(2)), torch.ones(2))
    assert ranks.broadcast_int(5) == 5
