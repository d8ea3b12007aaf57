"""``fitlib.structure``: tensors in nested tuples, named tuples, dicts and
dataclasses mapped, listed, picked and joined along dim 0 (padded where the
batches' lengths differ)."""

import dataclasses
from collections import namedtuple

import pytest
import torch

from fitlib.structure import join, map_tensors, parts, pick, tensors

Pair = namedtuple("Pair", "a b")


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extra: tuple


def test_map_tensors_keeps_every_container_type_and_other_leaves():
    x = {"p": Pair(torch.ones(2), [torch.zeros(1), "tag"]), "o": Out(torch.ones(3), ())}
    doubled = map_tensors(lambda t: t + 1, x)
    assert type(doubled["p"]) is Pair and type(doubled["o"]) is Out
    assert doubled["p"].b[1] == "tag"
    assert torch.equal(doubled["p"].a, torch.full((2,), 2.0))
    assert torch.equal(doubled["o"].logits, torch.full((3,), 2.0))
    assert [path for path, _ in tensors(x)] == [("p", 0), ("p", 1, 0), ("o", "logits")]


def test_pick_follows_a_path_and_names_the_parts_there_when_it_is_wrong():
    x = {"boxes": (torch.zeros(2, 4), torch.ones(2))}
    assert parts(x) == ["boxes"] and parts(torch.zeros(1)) == []
    assert torch.equal(pick(x, ("boxes", 1), "the output"), torch.ones(2))
    with pytest.raises(KeyError, match=r"no part 'box' in the output: its parts "):
        pick(x, "box", "the output")
    with pytest.raises(KeyError, match=r"it is Tensor, with no parts"):
        pick(x, ("boxes", 0, 0), "the output")


def test_join_concatenates_and_pads_each_dtype_with_its_own_value():
    a = (torch.ones(2, 3), torch.ones(2, 3, dtype=torch.long), torch.tensor(1.0))
    b = (torch.zeros(1, 5), torch.zeros(1, 5, dtype=torch.long), torch.tensor(2.0))
    floats, ints, scalars = join([a, b])
    assert floats.shape == (3, 5) and floats[:2, 3:].isnan().all()
    assert (ints[:2, 3:] == -100).all() and torch.equal(ints[2], torch.zeros(5).long())
    assert torch.equal(scalars, torch.tensor([1.0, 2.0]))  # 0-dim values: stacked
    with pytest.raises(ValueError, match="number of dims changes between batches"):
        join([torch.zeros(2, 3), torch.zeros(2, 3, 1)])
