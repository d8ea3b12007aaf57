import math

import pytest

from fitlib.checkpoint_ranking import TopK


def test_a_value_enters_when_it_beats_the_worst_kept_one():
    top = TopK(2, "valid_loss", "min")
    assert top.admit(0.5, "a.pth") == ("a.pth", [])
    assert top.admit(0.7, "b.pth") == ("b.pth", [])
    assert top.admit(0.6, "c.pth") == ("c.pth", ["b.pth"])
    assert top.admit(0.6, "d.pth") == (None, [])  # a tie with the worst: earlier stays
    assert top.names() == ["a.pth", "c.pth"]


def test_max_mode_ranks_the_other_way_and_nan_never_enters():
    top = TopK(1, "accuracy", "max")
    assert top.admit(math.nan, "n.pth") == (None, [])
    top.admit(0.5, "a.pth")
    assert top.admit(0.9, "b.pth") == ("b.pth", ["a.pth"])
    assert top.admit(None, "c.pth") == (None, [])


def test_the_threshold_must_be_beaten():
    top = TopK(None, "valid_loss", "min", threshold=0.4)
    assert top.admit(0.4, "a.pth") == (None, [])
    assert top.admit(0.39, "b.pth") == ("b.pth", [])


def test_a_name_already_kept_gets_a_version():
    top = TopK(3, "valid_loss", "min")
    top.admit(0.5, "e0.pth")
    assert top.admit(0.4, "e0.pth") == ("e0-v1.pth", [])
    assert top.admit(0.3, "e0.pth") == ("e0-v2.pth", [])


def test_the_state_round_trips_and_refuses_another_monitor(tmp_path):
    top = TopK(2, "valid_loss", "min")
    top.admit(0.5, "a.pth")
    top.admit(0.4, "b.pth")
    again = TopK(2, "valid_loss", "min")
    again.load_state_dict(top.state_dict())
    assert again.entries == top.entries
    (tmp_path / "b.pth").write_bytes(b"")
    again.keep_existing(tmp_path)
    assert again.names() == ["b.pth"]
    with pytest.raises(ValueError, match="not of 'accuracy'"):
        TopK(2, "accuracy", "max").load_state_dict(top.state_dict())


def test_a_ranking_loaded_with_more_than_k_is_cut_and_says_which_went():
    top = TopK(2, "valid_loss", "min")
    files = [[0.1, "a.pth"], [0.2, "b.pth"], [0.3, "c.pth"], [0.5, "e.pth"]]
    top.load_state_dict({"monitor": "valid_loss", "mode": "min", "files": files})
    assert top.names() == ["a.pth", "b.pth"]
    assert top.dropped == ["c.pth", "e.pth"]
    assert top.admit(0.45, "new.pth") == (None, [])


def test_a_taken_name_gets_a_version_and_survives_the_state():
    top = TopK(2, "valid_loss", "min")
    top.taken = {"e0.pth"}
    assert top.admit(0.5, "e0.pth") == ("e0-v1.pth", [])
    again = TopK(2, "valid_loss", "min")
    again.load_state_dict(top.state_dict())
    assert again.taken == {"e0.pth"}
