import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from fitlib.label_smoothing import label_smoothed
from fitlib.loss_checks import is_class_index_loss
from fitlib.mixing import mixed_loss, soft_targets
from fitlib.running_loss import loss_count
from fitlib.sequences import masked_cross_entropy


def batch(seed=0, n=6, c=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, c, generator=g), torch.randint(0, c, (n,), generator=g)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.35])
def test_cross_entropy_equals_torchs_label_smoothing(eps):
    out, y = batch()
    expected = F.cross_entropy(out, y, label_smoothing=eps)
    torch.testing.assert_close(label_smoothed(F.cross_entropy, eps)(out, y), expected)
    module = label_smoothed(nn.CrossEntropyLoss(), eps)
    assert isinstance(module, nn.CrossEntropyLoss)
    torch.testing.assert_close(module(out, y), expected)


def test_the_targets_become_one_minus_eps_plus_eps_over_the_classes():
    out, y = batch(c=5)
    smoothed = 0.8 * F.one_hot(y, 5).float() + 0.2 / 5
    by_hand = -(smoothed * out.log_softmax(1)).sum(1).mean()
    torch.testing.assert_close(label_smoothed(F.cross_entropy, 0.2)(out, y), by_hand)


def test_a_partials_and_a_modules_other_arguments_are_kept():
    out, y = batch()
    y[1] = -1
    weight = torch.tensor([1.0, 2.0, 0.5, 1.0])
    given = functools.partial(F.cross_entropy, weight=weight, ignore_index=-1)
    expected = F.cross_entropy(
        out, y, weight=weight, ignore_index=-1, label_smoothing=0.1
    )
    torch.testing.assert_close(label_smoothed(given, 0.1)(out, y), expected)
    module = nn.CrossEntropyLoss(weight=weight, ignore_index=-1, reduction="sum")
    smoothed = label_smoothed(module, 0.1)
    assert smoothed.reduction == "sum" and smoothed.ignore_index == -1
    assert is_class_index_loss(label_smoothed(given, 0.1))  # fitlib still reads it


def test_the_masked_sequence_loss_is_smoothed_over_the_kept_tokens_only():
    g = torch.Generator().manual_seed(0)
    out = torch.randn(2, 5, 4, generator=g)  # (B, T, C)
    y = torch.randint(0, 4, (2, 5), generator=g)
    y[0, 3:] = -100  # padding
    loss = label_smoothed(masked_cross_entropy, 0.1)
    kept = y != -100
    expected = F.cross_entropy(out[kept], y[kept], label_smoothing=0.1)
    torch.testing.assert_close(loss(out, y), expected)
    assert loss_count(loss)(out, y) == kept.sum()  # the epoch weighs by tokens
    unsmoothed = label_smoothed(masked_cross_entropy, 0.0)(out, y)
    torch.testing.assert_close(unsmoothed, masked_cross_entropy(out, y))


def test_a_partial_of_the_masked_loss_keeps_its_arguments():
    out = torch.randn(2, 4, 5)  # (B, C, T): classes first
    y = torch.randint(0, 4, (2, 5))
    y[1, 0] = 0
    given = functools.partial(masked_cross_entropy, ignore_index=0, class_dim=1)
    loss = label_smoothed(given, 0.2)
    logits, t = out.movedim(1, -1)[y != 0], y[y != 0]
    torch.testing.assert_close(
        loss(out, y), F.cross_entropy(logits, t, label_smoothing=0.2)
    )
    assert loss_count(loss)(out, y) == (y != 0).sum()


@pytest.mark.parametrize(
    "loss_func",
    [functools.partial(F.cross_entropy, label_smoothing=0.1),
     nn.CrossEntropyLoss(label_smoothing=0.1),
     label_smoothed(masked_cross_entropy, 0.1)],
    ids=["partial", "module", "masked"],
)  # fmt: skip
def test_a_loss_smoothed_already_is_refused(loss_func):
    with pytest.raises(ValueError, match=r"smooths the labels already .*Fix"):
        label_smoothed(loss_func, 0.1)


def test_other_losses_and_bad_eps_are_refused_with_the_fix():
    with pytest.raises(
        TypeError, match=r"label_smoothed: loss_func must be .* mse_loss"
    ):
        label_smoothed(F.mse_loss, 0.1)
    with pytest.raises(ValueError, match=r"label_smoothed: eps must be a fraction"):
        label_smoothed(F.cross_entropy, 1.0)


def test_mixing_two_smoothed_losses_smooths_the_mixed_target_once():
    out, y = batch(c=3)
    lam = torch.tensor(0.7)
    loss = label_smoothed(F.cross_entropy, 0.1)
    by_loss = mixed_loss(loss, out, (y,), loss(out, y), lam)
    soft = soft_targets(out, (y,), lam)
    once = 0.9 * soft + 0.1 / 3  # the mixed target, smoothed once
    torch.testing.assert_close(by_loss, -(once * out.log_softmax(1)).sum(1).mean())
    torch.testing.assert_close(loss(out, soft), by_loss)  # soft targets: the same
