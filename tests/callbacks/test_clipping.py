import math

import pytest
import torch
from helpers import train
from torch import nn
from torch.nn import functional as F  # noqa: N812

from fitlib import Callback, DataBunch, HPOptimizer, fit
from fitlib.callback import call_hook
from fitlib.callbacks.clipping import GradientClipping


def model_with_grads(*grads):
    """A model whose parameters hold the given gradients (weight, then bias)."""
    model = nn.Linear(2, 1)
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = torch.tensor(g, dtype=torch.float32).reshape(p.shape)
    return model


def grad_norm(model):
    grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
    return torch.cat(grads).norm().item()


# -- scripted hooks --------------------------------------------------------------
def test_norm_clipping_scales_the_total_norm_down_to_max_norm():
    model = model_with_grads([3.0, 0.0], [4.0])  # total norm 5
    clip = GradientClipping(max_norm=1.0)
    call_hook(clip, "on_backward_end", model=model, skip_step=False)
    assert grad_norm(model) == pytest.approx(1.0, rel=1e-5)
    # All gradients scaled by the same factor: the direction is kept.
    assert model.weight.grad.tolist()[0] == pytest.approx([0.6, 0.0], rel=1e-5)
    assert model.bias.grad.tolist() == pytest.approx([0.8], rel=1e-5)
    assert isinstance(clip.last_norm, torch.Tensor)
    assert not clip.last_norm.requires_grad
    assert clip.last_norm.item() == pytest.approx(5.0)  # the norm before clipping


def test_norm_clipping_leaves_small_gradients_untouched():
    model = model_with_grads([0.3, 0.0], [0.4])  # total norm 0.5
    call_hook(GradientClipping(max_norm=1.0), "on_backward_end", model=model)
    assert model.weight.grad.tolist() == [[pytest.approx(0.3), 0.0]]
    assert model.bias.grad.tolist() == [pytest.approx(0.4)]


def test_norm_type_inf_bounds_the_largest_element():
    model = model_with_grads([3.0, -1.0], [0.5])
    clip = GradientClipping(max_norm=1.5, norm_type=math.inf)
    call_hook(clip, "on_backward_end", model=model)
    assert clip.last_norm.item() == pytest.approx(3.0)
    assert model.weight.grad.tolist()[0] == pytest.approx([1.5, -0.5], rel=1e-5)
    assert model.bias.grad.tolist() == pytest.approx([0.25], rel=1e-5)


def test_value_clipping_clamps_each_element():
    model = model_with_grads([3.0, -0.2], [-4.0])
    clip = GradientClipping(max_value=0.5)
    call_hook(clip, "on_backward_end", model=model)
    assert model.weight.grad.tolist() == [[0.5, pytest.approx(-0.2)]]
    assert model.bias.grad.tolist() == [-0.5]
    assert clip.last_norm is None


@pytest.mark.parametrize("bound", [{"max_norm": 1.0}, {"max_value": 0.5}])
def test_a_batch_whose_step_is_skipped_keeps_its_gradients(bound):
    model = model_with_grads([3.0, 0.0], [4.0])
    clip = GradientClipping(**bound)
    call_hook(clip, "on_backward_end", model=model, skip_step=True)
    assert model.weight.grad.tolist() == [[3.0, 0.0]]
    assert model.bias.grad.tolist() == [4.0]
    assert clip.last_norm is None


def test_parameters_without_gradients_are_skipped():
    model = model_with_grads([3.0, 4.0], [0.0])
    model.bias.grad = None  # a frozen parameter
    call_hook(GradientClipping(max_norm=1.0), "on_backward_end", model=model)
    assert model.weight.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
    assert model.bias.grad is None


# -- through fit -----------------------------------------------------------------
class GradSpy(Callback):
    """Runs after GradientClipping: notes the norm the optimizer will see."""

    def __init__(self):
        self.seen = []  # (skip_step, norm)

    def on_backward_end(self, model, skip_step):
        self.seen.append((skip_step, grad_norm(model)))


class StepEveryOther(Callback):
    """Accumulates two batches per step, as gradient accumulation does."""

    order = -30

    def on_backward_end(self, iteration):
        return {"skip_step": iteration % 2 == 0}

    def on_step_end(self, iteration):
        return {"skip_zero": iteration % 2 == 0}


def test_gradients_seen_by_a_later_callback_have_at_most_max_norm():
    clip, spy = GradientClipping(max_norm=0.05), GradSpy()
    train([spy, clip], epochs=2)  # the spy is listed first but runs later
    norms = [norm for _, norm in spy.seen]
    assert len(norms) == 14
    assert max(norms) <= 0.05 * (1 + 1e-5)
    assert clip.last_norm.item() > 0.05  # so clipping really happened


def test_gradients_are_clipped_only_before_the_step_that_uses_them():
    spy = GradSpy()
    train([StepEveryOther(), GradientClipping(max_norm=0.05), spy], epochs=2)
    stepped = [norm for skip, norm in spy.seen if not skip]
    accumulating = [norm for skip, norm in spy.seen if skip]
    assert len(stepped) == len(accumulating) == 7
    assert max(stepped) <= 0.05 * (1 + 1e-5)
    assert max(accumulating) > 0.05  # left alone while accumulating


def one_batch_problem():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x, y = torch.randn(8, 4) * 10, torch.randint(0, 2, (8,))
    return model, x, y


def test_one_step_through_fit_equals_a_hand_written_clipped_step():
    model, x, y = one_batch_problem()
    start = [p.detach().clone() for p in model.parameters()]
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.5)
    clip = GradientClipping(max_norm=0.1)
    fit(1, model, F.cross_entropy, opt, DataBunch([(x, y)], None), [clip])

    expected, _, _ = one_batch_problem()
    F.cross_entropy(expected(x), y).backward()
    grads = [p.grad for p in expected.parameters()]
    norm = torch.cat([g.flatten() for g in grads]).norm()
    assert norm > 0.1  # the step is really clipped
    with torch.no_grad():
        for p, g in zip(expected.parameters(), grads, strict=True):
            p -= 0.5 * g * (0.1 / norm)
    for p, q, p0 in zip(model.parameters(), expected.parameters(), start, strict=True):
        assert torch.allclose(p, q, atol=1e-6)
        assert not torch.allclose(p, p0 - 0.5 * q.grad, atol=1e-3)  # unclipped
    assert clip.last_norm.item() == pytest.approx(norm.item(), rel=1e-5)


def test_clipping_reads_nothing_back_from_the_device(monkeypatch):
    calls = []
    for name in ("item", "__float__", "__bool__", "tolist", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            calls.append(1)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    for bound in ({"max_norm": 1.0}, {"max_value": 0.5}):
        model = model_with_grads([3.0, 0.0], [4.0])
        call_hook(GradientClipping(**bound), "on_backward_end", model=model)
    assert calls == []


# -- bad input -------------------------------------------------------------------
def test_neither_bound_says_to_pass_one():
    with pytest.raises(ValueError, match=r"exactly one.*got neither.*Fix"):
        GradientClipping()


def test_both_bounds_say_to_pass_only_one():
    with pytest.raises(ValueError, match=r"exactly one.*got both.*Fix"):
        GradientClipping(max_norm=1.0, max_value=0.5)


@pytest.mark.parametrize("name", ["max_norm", "max_value"])
@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "1.0", True])
def test_a_bound_that_is_not_a_positive_number_is_rejected(name, bad):
    with pytest.raises(ValueError, match=rf"{name} must be a positive.*got.*Fix"):
        GradientClipping(**{name: bad})


@pytest.mark.parametrize("bad", [0, -2.0, math.nan, "2", None])
def test_a_norm_type_that_is_not_a_positive_number_is_rejected(bad):
    with pytest.raises(ValueError, match=r"norm_type must be a positive.*Fix"):
        GradientClipping(max_norm=1.0, norm_type=bad)


def test_norm_type_with_max_value_is_rejected_not_ignored():
    with pytest.raises(ValueError, match=r"norm_type=1.0 applies only to max_norm"):
        GradientClipping(max_value=0.5, norm_type=1.0)
