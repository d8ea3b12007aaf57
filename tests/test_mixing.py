import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from fitlib.label_smoothing import label_smoothed
from fitlib.mixing import (
    MixGenerator,
    check_soft_loss,
    check_soft_targets,
    cut_inputs,
    draw_box,
    draw_lambda,
    mix_inputs,
    mixed_loss,
    mixed_tensors,
    rolled,
    soft_targets,
)
from fitlib.sequences import masked_cross_entropy


def started(seed=0):
    gen = MixGenerator(seed)
    gen.start(torch.device("cpu"))
    return gen


def draws(gen, n, alpha=0.4):
    return torch.stack([draw_lambda(gen.concentration(alpha), gen.generator)
                        for _ in range(n)])  # fmt: skip


# -- the generator -------------------------------------------------------------
def test_weights_are_folded_to_at_least_a_half_and_follow_the_beta():
    lams = draws(started(), 4000, alpha=1.0)
    assert bool((lams >= 0.5).all() and (lams <= 1).all())
    # max(U, 1 - U) for U uniform (Beta(1, 1)) is uniform on [0.5, 1]
    assert lams.mean().item() == pytest.approx(0.75, abs=0.01)
    small = draws(started(), 4000, alpha=0.1)  # a small alpha: little mixing
    assert small.median().item() > 0.95


def test_the_same_seed_draws_the_same_weights_and_takes_nothing_from_torch():
    torch.manual_seed(5)
    before = torch.get_rng_state()
    a = draws(started(seed=None), 10)
    assert torch.equal(torch.get_rng_state(), before)  # the global generator untouched
    torch.manual_seed(5)
    assert torch.equal(draws(started(seed=None), 10), a)  # seeded by manual_seed
    assert not torch.equal(draws(started(seed=6), 10), a)


def test_without_a_seed_the_draws_are_not_torchs_own_stream():
    # seeded from torch.initial_seed(), but not with it: on CUDA a generator
    # seeded with it would share the Philox stream of torch's own first kernels
    torch.manual_seed(5)
    gen = started(seed=None)
    same_seed = torch.Generator().manual_seed(torch.initial_seed())
    assert not torch.equal(gen.generator.get_state(), same_seed.get_state())
    assert not torch.equal(draws(gen, 5), draws(started(seed=5), 5))


def test_a_loaded_state_resumes_the_draws_exactly():
    gen = started(3)
    draws(gen, 5)
    saved = gen.state_dict()
    assert saved["device"] == "cpu" and saved["state"].dtype == torch.uint8
    rest = draws(gen, 5)
    other = MixGenerator(99)
    other.load_state_dict(saved)
    other.start(torch.device("cpu"))  # the state is applied as a fit starts
    assert torch.equal(draws(other, 5), rest)


def test_a_state_saved_on_another_device_is_refused_with_the_fix():
    gen = MixGenerator(0)
    gen.load_state_dict({"device": "cuda", "state": torch.zeros(16, dtype=torch.uint8)})
    with pytest.raises(ValueError, match=r"saved on cuda .* runs on cpu.*Fix: resume"):
        gen.start(torch.device("cpu"))


def test_state_dict_before_any_fit_is_empty_or_what_was_loaded():
    assert MixGenerator(0).state_dict() == {}
    gen = MixGenerator(0)
    gen.load_state_dict(started(1).state_dict())
    assert gen.state_dict()["device"] == "cpu"  # a save before the fit begins


# -- the box -------------------------------------------------------------------
def reference_box(lam, height, width, seed):
    """CutMix's box by hand, with Python numbers, from the same draws."""
    g = torch.Generator().manual_seed(seed)
    cy = torch.randint(height, (), generator=g).item()
    cx = torch.randint(width, (), generator=g).item()
    cut = (1 - lam) ** 0.5
    hh, hw = int(height * cut) // 2, int(width * cut) // 2
    top, bottom = max(cy - hh, 0), min(cy + hh, height)
    left, right = max(cx - hw, 0), min(cx + hw, width)
    mask = torch.zeros(height, width, dtype=torch.bool)
    mask[top:bottom, left:right] = True
    return mask, 1 - (bottom - top) * (right - left) / (height * width)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("lam", [0.5, 0.7, 0.93])
def test_the_box_is_the_hand_written_one_and_its_weight_the_area_kept(seed, lam):
    g = torch.Generator().manual_seed(seed)
    mask, kept = draw_box(torch.tensor(lam), 12, 9, g)
    ref_mask, ref_kept = reference_box(lam, 12, 9, seed)
    assert torch.equal(mask, ref_mask)
    assert kept.item() == pytest.approx(ref_kept)
    assert kept.item() == pytest.approx(1 - mask.sum().item() / (12 * 9))
    assert kept.item() >= lam  # clipped at an edge: the weight grows with it


def test_a_weight_of_one_cuts_no_box():
    mask, kept = draw_box(torch.tensor(1.0), 8, 8, torch.Generator().manual_seed(0))
    assert not mask.any() and kept.item() == 1.0


# -- mixing the inputs -----------------------------------------------------------
def test_each_sample_is_mixed_with_the_one_before_it_an_odd_batch_too():
    x = torch.arange(5.0)[:, None] * torch.ones(5, 2)
    mixed = mix_inputs(x, torch.tensor(0.75))
    expected = 0.75 * x + 0.25 * torch.cat([x[-1:], x[:-1]])
    torch.testing.assert_close(mixed, expected)
    one = torch.tensor([[3.0, 4.0]])  # a batch of one: mixed with itself
    torch.testing.assert_close(mix_inputs(one, torch.tensor(0.6)), one)


def test_only_floating_point_tensors_of_the_inputs_are_mixed():
    x = {"pixels": torch.randn(4, 3), "ids": torch.arange(4)}
    mixed = mix_inputs(x, torch.tensor(0.5))
    assert torch.equal(mixed["ids"], x["ids"])
    torch.testing.assert_close(mixed["pixels"], (x["pixels"] + rolled(x["pixels"])) / 2)


def test_the_cut_takes_the_partners_pixels_on_the_last_two_dims_only():
    x = torch.randn(3, 2, 4, 5)
    mask = torch.zeros(4, 5, dtype=torch.bool)
    mask[1:3, 2:4] = True
    vector = torch.randn(3, 6)
    cut, kept = cut_inputs((x, vector), mask)
    assert torch.equal(kept, vector)  # fewer than three dims: left as it is
    assert torch.equal(cut[:, :, 1:3, 2:4], x.roll(1, 0)[:, :, 1:3, 2:4])
    outside = ~mask
    assert torch.equal(cut[:, :, outside], x[:, :, outside])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_mixed_and_cut_inputs_keep_their_dtype_and_blend_ones_and_zeros(dtype):
    x = torch.stack([torch.ones(1, 2, 3), torch.zeros(1, 2, 3)]).to(dtype)
    mixed = mix_inputs(x, torch.tensor(0.75))
    assert mixed.dtype == dtype
    assert torch.equal(mixed[:, 0, 0, 0], torch.tensor([0.75, 0.25], dtype=dtype))
    mask = torch.zeros(2, 3, dtype=torch.bool)
    mask[0, 0] = True
    cut = cut_inputs(x, mask)
    assert cut.dtype == dtype and cut.sum().item() == 6  # one pixel swapped each way
    assert (cut[0, 0, 0, 0].item(), cut[1, 0, 0, 0].item()) == (0, 1)


def test_inputs_with_nothing_to_mix_are_refused_naming_the_owner():
    with pytest.raises(ValueError, match=r"MixUp mixes floating-point inputs.*int64"):
        mixed_tensors(torch.arange(6).view(3, 2), "MixUp")
    with pytest.raises(ValueError, match=r"CutMix .* \(N, \.\.\., H, W\).*Fix"):
        mixed_tensors(torch.randn(3, 2), "CutMix", 3)


# -- the loss --------------------------------------------------------------------
def test_the_mixed_loss_is_the_hand_written_mix_of_two_losses():
    out, y = torch.randn(5, 4), torch.tensor([0, 3, 1, 1, 2])
    lam = torch.tensor(0.8)
    loss = F.cross_entropy(out, y)
    expected = 0.8 * loss + 0.2 * F.cross_entropy(out, y.roll(1, 0))
    torch.testing.assert_close(
        mixed_loss(F.cross_entropy, out, (y,), loss, lam), expected
    )


def test_a_dict_loss_mixes_its_total():
    def loss_func(out, y):
        return {"loss": F.mse_loss(out, y), "l1": F.l1_loss(out, y)}

    out, y = torch.randn(3, 2), torch.randn(3, 2)
    lam = torch.tensor(0.6)
    got = mixed_loss(loss_func, out, y, F.mse_loss(out, y), lam)
    expected = 0.6 * F.mse_loss(out, y) + 0.4 * F.mse_loss(out, y.roll(1, 0))
    torch.testing.assert_close(got, expected)


def test_soft_targets_mix_one_hot_classes_or_float_targets():
    out, y = torch.randn(3, 4), torch.tensor([0, 2, 3])
    soft = soft_targets(out, (y,), torch.tensor(0.7))
    expected = torch.tensor([[0.7, 0, 0, 0.3], [0.3, 0, 0.7, 0], [0, 0, 0.3, 0.7]])
    torch.testing.assert_close(soft, expected)
    probs = torch.softmax(torch.randn(3, 4), 1)
    torch.testing.assert_close(soft_targets(out, probs, torch.tensor(0.5)),
                               (probs + probs.roll(1, 0)) / 2)  # fmt: skip
    dense = soft_targets(torch.randn(2, 3, 4, 4), torch.randint(0, 3, (2, 4, 4)),
                         torch.tensor(1.0))  # fmt: skip
    assert dense.shape == (2, 3, 4, 4) and torch.equal(
        dense.sum(1), torch.ones(2, 4, 4)
    )


@pytest.mark.parametrize(
    "out, targets, match",
    [(torch.randn(3, 4), torch.tensor([0, -100, 1]), "negative one .*ignore_index"),
     (torch.randn(3, 4), torch.randn(3), r"class indices of shape \(N, \.\.\.\)"),
     (torch.randn(3, 4), (torch.tensor([0, 1, 2]), torch.zeros(3)), "one target"),
     ((torch.randn(3, 4),), torch.tensor([0, 1, 2]), "one output")],
)  # fmt: skip
def test_targets_soft_cannot_mix_are_refused_with_the_fix(out, targets, match):
    with pytest.raises(ValueError, match=f"{match}.*Fix: targets='loss'"):
        check_soft_targets(out, targets, "MixUp")


WEIGHTS = torch.tensor([1.0, 5.0, 1.0])


@pytest.mark.parametrize(
    "loss_func, match",
    [(nn.CrossEntropyLoss(weight=WEIGHTS), r"CrossEntropyLoss weighs the classes"),
     (functools.partial(F.cross_entropy, weight=WEIGHTS), "cross_entropy weighs the"),
     (label_smoothed(nn.CrossEntropyLoss(weight=WEIGHTS)), "weighs the classes"),
     (nn.CrossEntropyLoss(ignore_index=0), r"ignore_index=0"),
     (functools.partial(F.cross_entropy, ignore_index=2), r"ignore_index=2"),
     (masked_cross_entropy, r"masked_cross_entropy takes class indices"),
     (label_smoothed(masked_cross_entropy),
      r"smoothed_masked_cross_entropy takes class indices")],
)  # fmt: skip
def test_targets_soft_refuses_a_loss_that_would_give_another_loss(loss_func, match):
    with pytest.raises(ValueError, match=f"MixUp\\(targets='soft'\\).*{match}.*"
                                         "Fix: targets='loss'"):  # fmt: skip
        check_soft_loss(loss_func, "MixUp")


def test_a_class_weighted_loss_on_soft_targets_is_another_loss():
    # why weight= is refused: torch averages over the batch, not the weights
    out, y, lam = torch.randn(8, 3), torch.tensor([0, 0, 0, 0, 0, 1, 2, 2]), 0.7
    for loss_func in [nn.CrossEntropyLoss(), nn.CrossEntropyLoss(weight=WEIGHTS)]:
        by_loss = mixed_loss(loss_func, out, (y,), loss_func(out, y), torch.tensor(lam))
        by_soft = loss_func(out, soft_targets(out, (y,), torch.tensor(lam)))
        close = torch.allclose(by_loss, by_soft)
        assert close == (loss_func.weight is None)


@pytest.mark.parametrize(
    "loss_func",
    [F.cross_entropy, nn.CrossEntropyLoss(), label_smoothed(F.cross_entropy, 0.1),
     functools.partial(F.cross_entropy, ignore_index=-100, weight=None),
     lambda out, y: F.cross_entropy(out, y)],
)  # fmt: skip
def test_targets_soft_takes_a_plain_cross_entropy(loss_func):
    check_soft_loss(loss_func, "MixUp")


# -- CUDA (make gpu-check) ---------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_draws_resume_and_the_box_is_the_hand_written_one():
    gen = MixGenerator(seed=4)
    gen.start(torch.device("cuda"))
    saved = gen.state_dict()
    assert saved["device"] == "cuda", f"the generator's state says {saved['device']}"
    lam = draw_lambda(gen.concentration(1.0), gen.generator)
    g_state = gen.generator.get_state()
    mask, kept = draw_box(lam, 12, 9, gen.generator)
    assert lam.device.type == "cuda" and mask.device.type == "cuda"
    # the same draws by hand: the center from the generator's state before the box
    ref_gen = torch.Generator("cuda")
    ref_gen.set_state(g_state)
    cy = torch.randint(12, (), generator=ref_gen, device="cuda").item()
    cx = torch.randint(9, (), generator=ref_gen, device="cuda").item()
    cut = (1 - lam.item()) ** 0.5
    hh, hw = int(12 * cut) // 2, int(9 * cut) // 2
    ref = torch.zeros(12, 9, dtype=torch.bool)
    ref[max(cy - hh, 0) : min(cy + hh, 12), max(cx - hw, 0) : min(cx + hw, 9)] = True
    assert torch.equal(mask.cpu(), ref), f"box {mask.nonzero()} != {ref.nonzero()}"
    assert kept.item() == pytest.approx(1 - ref.sum().item() / 108)
    other = MixGenerator(seed=99)
    other.load_state_dict(saved)
    other.start(torch.device("cuda"))
    again = draw_lambda(other.concentration(1.0), other.generator)
    assert torch.equal(again, lam), f"resumed draw {again.item()} != {lam.item()}"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_without_a_seed_the_draws_are_not_torchs_own_stream():
    torch.manual_seed(5)
    gen = MixGenerator(seed=None)
    gen.start(torch.device("cuda"))
    ours = torch.rand(1000, device="cuda", generator=gen.generator)
    torch.manual_seed(5)
    torchs = torch.rand(1000, device="cuda")  # what dropout's first kernel draws
    assert not torch.equal(ours, torchs), (
        "MixGenerator(seed=None) on CUDA replays torch's own first random numbers"
    )
