"""``fitlib.schedule_targets``: what a schedule sets besides the optimizer's
hyper-parameters. Through ``ParamScheduler``: tests/callbacks/test_schedule.py."""

import pytest
import torch
from torch import nn

from fitlib.schedule_targets import (
    attribute_owner,
    check_attribute,
    set_attribute,
    target_kind,
)


def test_a_key_is_a_hyper_parameter_an_attribute_path_or_a_setter():
    assert target_kind("eps") == target_kind("betas[1]") == "hyper"
    assert target_kind("model.head.0.p") == target_kind("loss_func.w") == "attribute"
    assert target_kind(lambda value: None) == "setter"


def test_a_path_is_followed_from_the_model_or_the_loss():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.3))
    loss = nn.CrossEntropyLoss(label_smoothing=0.1)
    assert attribute_owner("S", "model.1.p", model, loss) is model[1]
    assert attribute_owner("S", "loss_func.label_smoothing", model, loss) is loss
    with pytest.raises(
        ValueError, match=r"has no 'q'. It has: p, inplace.*e.g. 'model.1.p'"
    ):
        attribute_owner("S", "model.1.q", model, loss)


def test_a_tensor_attribute_is_filled_in_place_and_a_number_replaced():
    loss = nn.BCEWithLogitsLoss(pos_weight=torch.ones(3))
    tensor = loss.pos_weight
    set_attribute(loss, "pos_weight", 2.5)
    assert loss.pos_weight is tensor and tensor.tolist() == [2.5] * 3
    drop = nn.Dropout(0.3)
    set_attribute(drop, "p", 0.1)
    assert drop.p == 0.1


def test_only_numbers_and_floating_tensors_may_be_scheduled():
    loss = nn.BCEWithLogitsLoss(pos_weight=torch.ones(3))
    check_attribute("S", "loss_func.pos_weight", loss)
    check_attribute("S", "model.p", nn.Dropout(0.3))
    holder = nn.Module()
    holder.count = torch.zeros(2, dtype=torch.long)
    with pytest.raises(TypeError, match=r"holds a torch.int64 tensor"):
        check_attribute("S", "model.count", holder)
    with pytest.raises(TypeError, match="a parameter the optimizer trains"):
        check_attribute("S", "model.weight", nn.Linear(2, 2))
