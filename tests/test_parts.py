"""``fitlib.parts``: a model split into layer groups (each parameter in the
first group that holds it, every parameter in one) and into parts, one per
optimizer of ``opt_func``, each split into its own layer groups."""

import pytest
import torch
from helpers import make_data
from torch import nn
from torch.nn import functional as F  # noqa: N812

from fitlib import Learner
from fitlib.parts import by_part, part_groups, split_groups


def body_head_model():
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
    return nn.Sequential(body, nn.Linear(16, 3))


class EncDec(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.decoder = nn.Linear(16, 3)


def ids(groups):
    return [[id(p) for p in g] for g in groups]


def test_layer_groups_must_cover_the_model(tmp_path):
    model = body_head_model()
    with pytest.raises(ValueError, match="layer_groups leave 2 model parameter"):
        Learner(make_data(), model, F.cross_entropy, path=tmp_path, progress=False,
                layer_groups=[model[0]])  # fmt: skip


def test_split_groups_puts_each_parameter_in_the_first_group_that_holds_it():
    model = body_head_model()
    body, head = model
    assert ids(split_groups(model, None)) == ids([model.parameters()])
    groups = split_groups(model, [body, model])  # the whole model again: the head
    assert ids(groups) == ids([body.parameters(), head.parameters()])
    loose = split_groups(model, [list(body.parameters()), head])  # lists work too
    assert ids(loose) == ids(groups)


def test_part_groups_splits_each_named_part_into_its_own_groups():
    model = EncDec()
    enc = model.encoder
    opt_func = {"encoder": torch.optim.Adam, "decoder": torch.optim.SGD}
    parts = part_groups(model, opt_func, {"encoder": [enc[0], enc[2]]})
    assert list(parts) == ["encoder", "decoder"]
    assert ids(parts["encoder"]) == ids([enc[0].parameters(), enc[2].parameters()])
    assert ids(parts["decoder"]) == ids([model.decoder.parameters()])
    one = part_groups(model, torch.optim.SGD, [enc, model.decoder])
    assert list(one) == [""] and len(one[""]) == 2


def test_part_groups_refuses_what_does_not_fit_one_optimizer_or_parts():
    model = EncDec()
    with pytest.raises(TypeError, match="layer_groups is a dict by part, but "):
        part_groups(model, torch.optim.SGD, {"encoder": [model.encoder]})
    with pytest.raises(ValueError, match="opt_func is an empty dict"):
        part_groups(model, {}, None)
    with pytest.raises(TypeError, match="layer_groups must be a dict part name"):
        part_groups(model, {"encoder": torch.optim.SGD, "decoder": torch.optim.SGD},
                    [model.encoder])  # fmt: skip


def test_by_part_gives_one_setting_for_all_under_the_empty_name():
    assert by_part(0.1) == {"": 0.1}
    per_part = {"encoder": 0.1, "decoder": 0.0}
    assert by_part(per_part) == per_part and by_part(per_part) is not per_part
