import re

import pytest
import torch
from helpers import Crash, clone_params, make_dataset
from mixing_child import BackwardLoss, Penalty, killed_and_resumed, reference_lams
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

from fitlib import Callback, DataBunch, HPOptimizer, Learner, fit
from fitlib.callbacks import Checkpoint
from fitlib.callbacks.cutmix import CutMix
from fitlib.callbacks.mixup import MixUp


def images(n, seed=0, size=(1, 4, 6)):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, *size, generator=g),
                         torch.randint(0, 3, (n,), generator=g))  # fmt: skip


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(16, 3))


def image_fit(callbacks, n=13, bs=5, epochs=1):
    model = cnn()
    data = DataBunch(DataLoader(images(n), bs), DataLoader(images(6, seed=1), 3))
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.3)
    fit(epochs, model, F.cross_entropy, opt, data, callbacks=list(callbacks))
    return model, data


class Spy(Callback):
    order = 0  # after CutMix (-36)

    def __init__(self):
        self.seen = []

    def on_loss_begin(self, last_input, train):
        if train:
            self.seen.append(last_input.clone())


@pytest.mark.parametrize("targets", ["loss", "soft"])
def test_a_loss_term_at_order_minus_35_is_added_after_the_cutmix(targets):
    alone, with_term = BackwardLoss(), BackwardLoss()  # constant term: same steps
    image_fit([CutMix(alpha=1.0, seed=11, targets=targets), alone])
    image_fit([Penalty(), CutMix(alpha=1.0, seed=11, targets=targets), with_term])
    assert len(with_term.seen) == 3
    for mixed, total in zip(alone.seen, with_term.seen, strict=True):
        torch.testing.assert_close(total, mixed + 100.0)  # not dropped, not weighted


def reference_step(x, lam, g):
    """CutMix of one batch by hand: the box from the generator's draws, with
    Python numbers, the partner's pixels pasted in, the weight corrected."""
    _, _, h, w = x.shape
    cy, cx = (
        torch.randint(h, (), generator=g).item(),
        torch.randint(w, (), generator=g).item(),
    )
    hh, hw = int(h * (1 - lam) ** 0.5) // 2, int(w * (1 - lam) ** 0.5) // 2
    top, bottom, left, right = (
        max(cy - hh, 0),
        min(cy + hh, h),
        max(cx - hw, 0),
        min(cx + hw, w),
    )
    mixed = x.clone()
    mixed[:, :, top:bottom, left:right] = x.roll(1, 0)[:, :, top:bottom, left:right]
    return mixed, 1 - (bottom - top) * (right - left) / (h * w)


def test_a_fit_equals_the_hand_written_cutmix():
    model, data = image_fit([CutMix(alpha=1.0, seed=11)])  # 5 + 5 + 3 images
    ref = cnn()
    opt = torch.optim.SGD(ref.parameters(), lr=0.3)
    # the generator draws the weight, then the box's center, batch after batch
    g = torch.Generator().manual_seed(11)
    for x, y in data.train_dl:
        lam = torch._sample_dirichlet(torch.tensor([1.0, 1.0]), generator=g)[0].item()
        mixed, kept = reference_step(x, max(lam, 1 - lam), g)
        out = ref(mixed)
        loss = kept * F.cross_entropy(out, y) + (1 - kept) * F.cross_entropy(
            out, y.roll(1, 0)
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_the_box_holds_the_partners_pixels_and_the_weight_is_the_area_kept():
    spy, cutmix = Spy(), CutMix(alpha=1.0, seed=3)
    image_fit([cutmix, spy], n=4, bs=4)
    x = images(4).tensors[0]
    mixed = spy.seen[0]
    from_partner = (mixed != x).any(0).any(0)  # (H, W): where the box is
    assert from_partner.any()
    rows, cols = from_partner.nonzero().unbind(1)
    box = (slice(rows.min(), rows.max() + 1), slice(cols.min(), cols.max() + 1))
    assert torch.equal(mixed[:, :, box[0], box[1]], x.roll(1, 0)[:, :, box[0], box[1]])
    area = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
    assert cutmix.lam.item() == pytest.approx(1 - area.item() / (4 * 6))
    assert cutmix.lam.item() >= 0.5  # the image keeps its larger part


def test_cutmix_draws_the_same_weight_as_mixup_then_its_box():
    cutmix = CutMix(alpha=0.7, seed=9)
    image_fit([cutmix], n=4, bs=4)
    assert cutmix.lam.item() >= reference_lams(seed=9, n=1, alpha=0.7)[0] - 1e-6


def test_an_odd_last_batch_and_a_batch_of_one_are_cut_within_themselves():
    spy = Spy()
    image_fit([CutMix(seed=0), spy], n=11, bs=5)  # 5, 5, 1
    assert [len(x) for x in spy.seen] == [5, 5, 1]
    assert torch.equal(spy.seen[2], images(11).tensors[0][10:])  # its own partner


def test_images_without_channels_are_cut_on_their_last_two_dims():
    spy = Spy()
    model = nn.Sequential(nn.Flatten(), nn.Linear(24, 3))
    data = DataBunch(DataLoader(images(6, size=(4, 6)), 6), None)
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    fit(1, model, F.cross_entropy, opt, data, callbacks=[CutMix(seed=1), spy])
    x = images(6, size=(4, 6)).tensors[0]
    changed = spy.seen[0] != x
    assert changed.any() and torch.equal(changed, changed[:1].expand_as(changed))


def test_no_host_read_per_step(sync_counter):
    def count(n):
        before = sync_counter["n"]
        image_fit([CutMix(seed=0)], n=n, bs=4, epochs=2)
        return sync_counter["n"] - before

    assert count(8) == count(32)


def test_a_run_resumed_after_crashes_ends_as_an_unbroken_one(tmp_path):
    def learner(cbs):
        data = DataBunch(DataLoader(images(40), 6, shuffle=True),
                         DataLoader(images(9, seed=1), 4), device="cpu")  # fmt: skip
        return Learner(data, cnn(), F.cross_entropy, progress=False, callbacks=cbs,
                       opt_func=torch.optim.SGD)  # fmt: skip

    torch.manual_seed(1)
    ref = learner([CutMix(seed=2)])
    ref.fit(2, lr=0.1)
    for at in [3, 9, None]:
        torch.manual_seed(1)
        cbs = [Checkpoint(tmp_path, every_n_steps=2), CutMix(seed=2)]
        learn = learner(cbs + ([Crash(at)] if at is not None else []))
        try:
            learn.fit(2, lr=0.1)
        except RuntimeError:
            assert at is not None
    assert learn.recorder.losses == ref.recorder.losses
    assert all(map(torch.equal, learn.model.state_dict().values(),
                   ref.model.state_dict().values()))  # fmt: skip


def test_a_run_killed_with_sigkill_ends_as_an_unbroken_one(tmp_path):
    ours, unbroken = killed_and_resumed(tmp_path, "cutmix")
    assert ours["losses"] == unbroken["losses"] and len(ours["losses"]) == 21
    assert ours["valid_losses"] == unbroken["valid_losses"]
    assert all(
        torch.equal(ours["weights"][k], v) for k, v in unbroken["weights"].items()
    )


def test_inputs_that_are_not_images_are_refused_at_the_first_batch():
    model = nn.Linear(8, 3)
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    data = DataBunch(DataLoader(make_dataset(8), 4), None)
    with pytest.raises(
        ValueError, match=r"CutMix mixes floating-point inputs of shape"
    ):
        fit(1, model, F.cross_entropy, opt, data, callbacks=[CutMix()])


@pytest.mark.parametrize("targets", ["loss", "soft"])
def test_per_pixel_targets_are_refused_at_the_first_batch(targets):
    # a segmentation mask would need the same box cut: refused, not mixed wrong
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(8, 1, 8, 8, generator=g),
                       torch.randint(0, 3, (8, 8, 8), generator=g))  # fmt: skip
    model = nn.Conv2d(1, 3, 3, padding=1)
    before = clone_params(model)
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(
        ValueError,
        match=r"CutMix.*per-pixel targets \(8, 8, 8\).*"
        r"image's \(H, W\) = \(8, 8\).*Fix: MixUp",
    ):
        fit(1, model, F.cross_entropy, opt, DataBunch(DataLoader(ds, 8), None),
            callbacks=[CutMix(seed=1, targets=targets)])  # fmt: skip
    assert all(map(torch.equal, before, model.parameters()))  # no step taken


@pytest.mark.parametrize("size", [(1, 100), (2, 8), (8, 2), (3, 1)])
def test_images_too_small_for_any_box_are_refused_at_the_first_batch(size):
    ds = TensorDataset(torch.randn(8, 1, *size), torch.randint(0, 3, (8,)))
    model = nn.Sequential(nn.Flatten(), nn.Linear(size[0] * size[1], 3))
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    match = rf"CutMix.*H and W >= 3.*\(H, W\) = {re.escape(str(size))}.*Fix: MixUp"
    with pytest.raises(ValueError, match=match):
        fit(1, model, F.cross_entropy, opt, DataBunch(DataLoader(ds, 8), None),
            callbacks=[CutMix(seed=1)])  # fmt: skip


def test_the_smallest_images_cut_get_a_box():
    spy = Spy()
    ds = TensorDataset(torch.randn(8, 1, 3, 3), torch.randint(0, 3, (8,)))
    model = nn.Sequential(nn.Flatten(), nn.Linear(9, 3))
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    fit(40, model, F.cross_entropy, opt, DataBunch(DataLoader(ds, 8), None),
        callbacks=[CutMix(seed=1), spy])  # fmt: skip
    assert any(not torch.equal(x, ds.tensors[0]) for x in spy.seen)


def test_mixup_and_cutmix_in_one_fit_are_refused_before_training():
    with pytest.raises(
        ValueError, match=r"another mixing callback \(CutMix\).*keep one"
    ):
        image_fit([MixUp(), CutMix()])


def test_defaults_and_argument_checks():
    assert repr(CutMix()) == "CutMix(alpha=1.0, targets='loss')"
    with pytest.raises(
        ValueError, match=r"CutMix: alpha must be a number > 0.*CutMix\(alpha=1.0\)"
    ):
        CutMix(alpha=-1)
