"""``fitlib.loss_checks``: the first batch's loss inputs that torch would
accept but get wrong, and what fitlib reads from a loss function. The same
refusals as ``fit`` shows them are in ``tests/test_core.py``."""

import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from fitlib.loss_checks import (
    ignore_index_of,
    is_class_index_loss,
    loss_check,
    takes_logits,
    takes_probabilities,
)


def checked_loss(loss_func, out, y):
    with loss_check(loss_func, out, (y,)):
        return loss_func(out, y)


def test_an_elementwise_loss_of_shapes_that_broadcast_is_refused_before_it_runs():
    mse_sum = functools.partial(F.mse_loss, reduction="sum")
    for loss_func in (F.mse_loss, nn.MSELoss(), mse_sum):
        check = loss_check(loss_func, torch.randn(4, 1), (torch.randn(4),))
        with pytest.raises(ValueError) as info, check:
            raise AssertionError("the loss ran")  # refused before: never here
        assert "output of shape (4, 1) and targets of shape (4,)" in str(info.value)
        assert "which torch broadcasts to (4, 4)" in str(info.value)


def test_an_own_loss_that_broadcasts_output_against_targets_is_caught_inside():
    def own_mse(out, y):
        return ((out - y) ** 2).mean()

    with pytest.raises(ValueError) as info:
        checked_loss(own_mse, torch.randn(4, 1), torch.randn(4))
    assert "Inside it, 'sub' got a value of shape (4, 1) computed from the output" in (
        str(info.value)
    )


def test_a_loss_that_aligns_the_shapes_itself_passes():
    out, y = torch.randn(4, 1), torch.randn(4)
    loss = checked_loss(lambda o, t: ((o.squeeze(1) - t) ** 2).mean(), out, y)
    assert loss == ((out.squeeze(1) - y) ** 2).mean()


def test_class_indices_out_of_range_are_refused_except_the_ignored_one():
    out = torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"got the class index 3 for an output with 3"):
        checked_loss(F.cross_entropy, out, torch.tensor([0, 1, 2, 3]))
    checked_loss(F.cross_entropy, out, torch.tensor([0, 1, 2, -100]))
    ignore_255 = functools.partial(F.cross_entropy, ignore_index=255)
    checked_loss(ignore_255, out, torch.tensor([0, 1, 2, 255]))
    with pytest.raises(ValueError, match=r"got the class index 255"):
        checked_loss(nn.CrossEntropyLoss(ignore_index=7), out, torch.tensor([255] * 4))


def test_float_targets_for_cross_entropy_need_the_outputs_shape():
    out = torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"got float targets .* Fix: y.long\(\)"):
        checked_loss(F.cross_entropy, out, torch.rand(4))
    soft = torch.rand(4, 3).softmax(1)  # class probabilities: allowed
    assert checked_loss(F.cross_entropy, out, soft) == F.cross_entropy(out, soft)


def test_what_a_loss_takes_is_read_from_functions_partials_and_modules():
    assert is_class_index_loss(F.cross_entropy) and is_class_index_loss(nn.NLLLoss())
    assert is_class_index_loss(functools.partial(F.cross_entropy, weight=None))
    assert not is_class_index_loss(F.mse_loss)
    assert takes_logits(F.binary_cross_entropy_with_logits)
    assert takes_logits(nn.BCEWithLogitsLoss())
    assert not takes_logits(F.binary_cross_entropy) and not takes_logits(None)
    assert ignore_index_of(F.cross_entropy) == -100
    assert ignore_index_of(nn.CrossEntropyLoss(ignore_index=0)) == 0
    assert ignore_index_of(functools.partial(F.cross_entropy, ignore_index=255)) == 255


def test_takes_probabilities_knows_bce_as_function_partial_and_module():
    assert takes_probabilities(F.binary_cross_entropy)
    assert takes_probabilities(functools.partial(F.binary_cross_entropy, weight=None))
    assert takes_probabilities(nn.BCELoss())
    assert not takes_probabilities(F.binary_cross_entropy_with_logits)
    assert not takes_probabilities(nn.BCEWithLogitsLoss())
    assert not takes_probabilities(None)
