import functools

import pytest
import torch
from helpers import Crash, clone_params, make_dataset
from mixing_child import BackwardLoss, Penalty, killed_and_resumed, reference_lams
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

from fitlib import Callback, DataBunch, HPOptimizer, Learner, fit, validate
from fitlib.callbacks import Checkpoint, GradientAccumulation, MixedPrecision
from fitlib.callbacks.mixup import MixUp
from fitlib.label_smoothing import label_smoothed
from fitlib.metrics import accuracy
from fitlib.sequences import masked_cross_entropy


class Spy(Callback):
    """Keeps each batch's inputs and targets as the model gets them."""

    order = 0  # after MixUp (-36)

    def __init__(self):
        self.seen = []

    def on_loss_begin(self, last_input, last_target, train, epoch):
        self.seen.append((train, epoch, last_input.clone(), last_target.clone()))


def linear_fit(callbacks, n=23, bs=8, epochs=1, loss_func=F.cross_entropy, seed=0):
    """A plain linear model (no dropout, no batch norm) on unshuffled batches,
    so a hand-written loop can replay it."""
    torch.manual_seed(seed)
    model = nn.Linear(8, 3)
    data = DataBunch(
        DataLoader(make_dataset(n), bs), DataLoader(make_dataset(9, seed=1), 4)
    )
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.5)
    history = fit(epochs, model, loss_func, opt, data, callbacks=list(callbacks))
    return model, history, data


# -- against a hand-written reference ---------------------------------------------
def test_a_fit_equals_the_hand_written_mix_of_inputs_and_losses():
    model, _, data = linear_fit([MixUp(alpha=0.4, seed=7)])  # 8 + 8 + 7 samples
    torch.manual_seed(0)
    ref = nn.Linear(8, 3)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for (x, y), lam in zip(data.train_dl, reference_lams(seed=7, n=3), strict=True):
        out = ref(lam * x + (1 - lam) * x.roll(1, 0))
        loss = lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(
            out, y.roll(1, 0)
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_soft_targets_train_as_the_mixed_loss_for_cross_entropy():
    loss_side, _, _ = linear_fit([MixUp(seed=3)])
    soft, _, _ = linear_fit([MixUp(seed=3, targets="soft")])
    for p, q in zip(loss_side.parameters(), soft.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_soft_targets_with_label_smoothing_smooth_the_mixed_target_once():
    eps, seen = 0.2, []

    def loss_func(out, y):  # torch's smoothing, on what MixUp passes
        seen.append(y)
        return F.cross_entropy(out, y, label_smoothing=eps)

    linear_fit([MixUp(seed=3, targets="soft")], n=8, loss_func=loss_func)
    _, y = next(iter(DataLoader(make_dataset(8), 8)))
    soft = seen[1]  # [0]: the loop's loss on the batch's own targets
    lam = reference_lams(seed=3, n=1)[0]  # MixUp passes it unsmoothed:
    one_hot = F.one_hot(y, 3).float()
    torch.testing.assert_close(soft, lam * one_hot + (1 - lam) * one_hot.roll(1, 0))
    smooth = label_smoothed(F.cross_entropy, eps)
    smoothed, _, _ = linear_fit([MixUp(seed=3, targets="soft")], n=8, loss_func=smooth)
    by_loss, _, _ = linear_fit([MixUp(seed=3)], n=8, loss_func=smooth)
    for p, q in zip(smoothed.parameters(), by_loss.parameters(), strict=True):
        torch.testing.assert_close(p, q)  # once either way: the same step


@pytest.mark.parametrize("precision", [None, torch.bfloat16])
def test_the_mixed_loss_is_what_gradient_accumulation_scales(precision):
    # MixUp mixes the loss before GradientAccumulation divides it (and before
    # MixedPrecision scales it): the same steps as a hand-written accumulated loop
    callbacks = [MixUp(seed=7), GradientAccumulation(2)]
    if precision is not None:
        callbacks.append(MixedPrecision(dtype=precision))
    model, _, data = linear_fit(callbacks, n=32)  # 4 batches: 2 steps
    torch.manual_seed(0)
    ref = nn.Linear(8, 3)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    batches = zip(data.train_dl, reference_lams(seed=7, n=4), strict=True)
    for i, ((x, y), lam) in enumerate(batches):
        lam = torch.tensor(lam)
        with torch.autocast("cpu", dtype=precision, enabled=precision is not None):
            out = ref(torch.lerp(x.roll(1, 0), x, lam))
            own, partner = F.cross_entropy(out, y), F.cross_entropy(out, y.roll(1, 0))
        (torch.lerp(partner, own, lam) / 2).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q)


@pytest.mark.parametrize("targets", ["loss", "soft"])
def test_a_loss_term_at_order_minus_35_is_added_after_the_mix_whatever_the_list_order(
    targets,
):
    # a constant term: the same gradients, so both fits see the same batches
    alone, with_term = BackwardLoss(), BackwardLoss()
    linear_fit([MixUp(seed=7, targets=targets), alone])
    linear_fit([Penalty(), MixUp(seed=7, targets=targets), with_term])
    assert len(with_term.seen) == 3
    for mixed, total in zip(alone.seen, with_term.seen, strict=True):
        torch.testing.assert_close(total, mixed + 100.0)  # not dropped, not weighted


# -- what is mixed, and when ----------------------------------------------------------
def test_training_inputs_are_mixed_targets_and_validation_are_not():
    spy = Spy()
    linear_fit([MixUp(alpha=1.0, seed=1), spy], epochs=2)
    train_x = torch.cat([x for t, _, x, _ in spy.seen if t])
    train_y = torch.cat([y for t, _, _, y in spy.seen if t])
    raw = make_dataset(23)
    assert not torch.allclose(train_x, torch.cat([raw.tensors[0]] * 2))
    assert torch.equal(train_y, torch.cat([raw.tensors[1]] * 2))  # unmixed targets
    valid_x = torch.cat([x for t, _, x, _ in spy.seen if not t])
    assert torch.equal(valid_x, torch.cat([make_dataset(9, seed=1).tensors[0]] * 2))


def test_an_odd_last_batch_and_a_batch_of_one_are_mixed_within_themselves():
    spy = Spy()
    linear_fit([MixUp(alpha=1.0, seed=2), spy], n=9, bs=4)  # 4, 4, 1
    batches = [x for t, _, x, _ in spy.seen if t]
    assert [len(x) for x in batches] == [4, 4, 1]
    raw = make_dataset(9).tensors[0]
    assert torch.equal(batches[2], raw[8:])  # mixed with itself: unchanged
    second = batches[1]  # each row between its own and the row before it in the batch
    own, partner = raw[4:8], raw[4:8].roll(1, 0)
    lam = ((second - partner) / (own - partner))[0, 0]
    torch.testing.assert_close(second, lam * own + (1 - lam) * partner)


def test_mixing_stops_at_the_epoch_given():
    spy = Spy()
    linear_fit([MixUp(alpha=1.0, seed=0, stop_at_epoch=1), spy], epochs=3)
    raw = make_dataset(23).tensors[0]
    by_epoch = {e: torch.cat([x for t, ep, x, _ in spy.seen if t and ep == e])
                for e in range(3)}  # fmt: skip
    assert not torch.allclose(by_epoch[0], raw)
    assert torch.equal(by_epoch[1], raw) and torch.equal(by_epoch[2], raw)


def test_the_record_reads_the_loss_and_metrics_on_the_unmixed_targets():
    outs = []
    keep = Callback.from_hooks(on_batch_end=lambda train, last_output: outs.append(
        last_output) if train else None)  # fmt: skip
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    data = DataBunch(
        DataLoader(make_dataset(23), 8), DataLoader(make_dataset(9, seed=1), 4)
    )
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.5)
    history = fit(1, model, F.cross_entropy, opt, data, callbacks=[MixUp(seed=0), keep],
                  metrics=[accuracy], train_metrics=[accuracy])  # fmt: skip
    out, y = torch.cat(outs), make_dataset(23).tensors[1]
    record = history[-1]
    assert record["train_accuracy"] == pytest.approx(
        (out.argmax(1) == y).float().mean().item()
    )
    assert record["train_loss"] == pytest.approx(F.cross_entropy(out, y).item())
    plain = validate(model, data.valid_dl, F.cross_entropy, metrics=[accuracy])
    assert record["valid_loss"] == pytest.approx(plain[0].item())  # never mixed
    assert record["accuracy"] == pytest.approx(plain[1].item())


def test_each_fit_goes_on_drawing_where_the_last_one_stopped():
    mixup = MixUp(seed=4)
    linear_fit([mixup])
    after_one = mixup.state_dict()["state"].clone()
    linear_fit([mixup])
    assert not torch.equal(mixup.state_dict()["state"], after_one)
    fresh = MixUp(seed=4)
    linear_fit([fresh])
    assert torch.equal(fresh.state_dict()["state"], after_one)


@pytest.mark.filterwarnings("ignore:lr_find")  # a short toy sweep
def test_an_lr_sweep_before_the_fit_leaves_its_draws_as_they_were():
    def trained(sweep_first):
        learn = learner([MixUp(seed=6)])
        if sweep_first:
            learn.lr_find(num_it=10)
        learn.fit(1, lr=0.1)
        return learn.model.state_dict()

    plain, swept = trained(False), trained(True)
    assert all(torch.equal(plain[k], v) for k, v in swept.items())


def test_the_same_seed_trains_the_same_a_different_one_differently():
    a, _, _ = linear_fit([MixUp(seed=1)])
    b, _, _ = linear_fit([MixUp(seed=1)])
    c, _, _ = linear_fit([MixUp(seed=2)])
    assert torch.equal(a.weight, b.weight) and not torch.equal(a.weight, c.weight)


# -- no host read per step -------------------------------------------------------------
@pytest.mark.parametrize("targets", ["loss", "soft"])
def test_mixup_adds_no_host_read_per_step(sync_counter, targets):
    def count(n):
        before = sync_counter["n"]
        linear_fit([MixUp(seed=0, targets=targets)], n=n, epochs=2)
        return sync_counter["n"] - before

    assert count(32) == count(128)


# -- resume -----------------------------------------------------------------------
def learner(callbacks, model=None, opt_func=torch.optim.SGD):
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2),
                                   nn.Linear(16, 3))  # fmt: skip
    train_dl = DataLoader(make_dataset(100), 16, shuffle=True)
    data = DataBunch(train_dl, DataLoader(make_dataset(37, seed=1), 16), device="cpu")
    return Learner(data, model, F.cross_entropy, progress=False,
                   callbacks=list(callbacks), opt_func=opt_func)  # fmt: skip


# one optimizer, or an Adam and an SGD part (a MultiOptimizer)
PARTS = {
    "one": (torch.optim.SGD, 0.1),
    "parts": ({"0": torch.optim.Adam, "3": torch.optim.SGD}, {"0": 0.01, "3": 0.1}),
}


@pytest.mark.parametrize("optimizers", PARTS)
def test_a_run_resumed_after_crashes_ends_as_an_unbroken_one(tmp_path, optimizers):
    opt_func, lr = PARTS[optimizers]
    ref = learner([MixUp(seed=5, stop_at_epoch=2)], opt_func=opt_func)
    ref.fit(3, lr=lr)
    for at in [4, 11, None]:  # mid-epoch twice, then to the end
        cbs = [Checkpoint(tmp_path, every_n_steps=3), MixUp(seed=5, stop_at_epoch=2)]
        learn = learner(
            cbs + ([Crash(at)] if at is not None else []), opt_func=opt_func
        )
        try:
            learn.fit(3, lr=lr)
        except RuntimeError:
            assert at is not None
    assert learn.recorder.losses == ref.recorder.losses
    assert learn.recorder.valid_losses == ref.recorder.valid_losses
    for a, b in zip(learn.model.state_dict().values(), ref.model.state_dict().values(),
                    strict=True):  # fmt: skip
        assert torch.equal(a, b)


def test_a_run_killed_with_sigkill_ends_as_an_unbroken_one(tmp_path):
    ours, unbroken = killed_and_resumed(tmp_path, "mixup")
    assert ours["losses"] == unbroken["losses"] and len(ours["losses"]) == 21
    assert ours["valid_losses"] == unbroken["valid_losses"]
    assert all(
        torch.equal(ours["weights"][k], v) for k, v in unbroken["weights"].items()
    )


# -- arguments and errors ---------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, error, match",
    [({"alpha": 0}, ValueError, r"MixUp: alpha must be a number > 0; got 0"),
     ({"alpha": "big"}, TypeError, "MixUp: alpha"),
     ({"targets": "sotf"}, ValueError, r"targets must be 'loss' or 'soft'; got 'sotf' "
                                       r"\(did you mean 'soft'\?\)"),
     ({"stop_at_epoch": 0}, ValueError, r"stop_at_epoch must be an int >= 1 or None"),
     ({"seed": 1.5}, TypeError, "MixUp: seed must be an int")],
)  # fmt: skip
def test_bad_arguments_are_refused_naming_them(kwargs, error, match):
    with pytest.raises(error, match=match):
        MixUp(**kwargs)


def test_a_fit_without_a_loss_function_is_refused_before_training():
    class Scored(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 3)

        def forward(self, x):
            return {"loss": self.lin(x).pow(2).mean()}

    model = Scored()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    data = DataBunch(DataLoader(make_dataset(8), 4), None)
    with pytest.raises(ValueError, match="MixUp mixes the loss, and this fit has none"):
        fit(1, model, None, opt, data, callbacks=[MixUp()])


def test_integer_inputs_and_batches_without_targets_are_refused_at_the_first_batch():
    ids = TensorDataset(torch.randint(0, 5, (8, 4)), torch.randint(0, 3, (8,)))
    model = nn.Sequential(nn.Embedding(5, 3), nn.Flatten(), nn.Linear(12, 3))
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"MixUp mixes floating-point inputs.*int64"):
        fit(1, model, F.cross_entropy, opt, DataBunch(DataLoader(ids, 4), None),
            callbacks=[MixUp()])  # fmt: skip
    inputs_only = DataLoader(torch.randn(8, 8), 4)
    lin = nn.Linear(8, 8)
    opt = HPOptimizer(lin.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"the batches have none.*Fix"):
        fit(1, lin, lambda out: out.pow(2).mean(), opt, DataBunch(inputs_only, None),
            callbacks=[MixUp()])  # fmt: skip


def sequence_data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(10, 6, 5, generator=g), torch.randint(0, 3, (10, 6), generator=g)
    return DataBunch(DataLoader(TensorDataset(x, y), 5), None)


@pytest.mark.parametrize(
    "loss_func, match",
    [(masked_cross_entropy, "masked_cross_entropy takes class indices"),
     (label_smoothed(masked_cross_entropy, 0.1), "masked_cross_entropy takes class"),
     (functools.partial(F.cross_entropy, weight=torch.tensor([1.0, 5.0, 1.0])),
      "weighs the classes"),
     (functools.partial(F.cross_entropy, ignore_index=0), "ignore_index=0")],
)  # fmt: skip
def test_soft_targets_with_a_loss_they_would_change_are_refused_before_training(
    loss_func, match
):
    model = nn.Sequential(nn.Linear(5, 3), Transposed())  # logits (B, C=3, T=6)
    before = clone_params(model)
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.3)
    with pytest.raises(ValueError, match=f"MixUp\\(targets='soft'\\).*{match}"
                                         ".*Fix: targets='loss'"):  # fmt: skip
        fit(1, model, loss_func, opt, sequence_data(),
            callbacks=[MixUp(seed=3, targets="soft")])  # fmt: skip
    assert all(map(torch.equal, before, model.parameters()))  # no step taken
    fit(1, model, loss_func, opt, sequence_data(), callbacks=[MixUp(seed=3)])


class Transposed(nn.Module):
    def forward(self, x):
        return x.transpose(1, 2)


def test_repr_and_state_are_plain_values():
    assert repr(MixUp(0.2, stop_at_epoch=3)) == (
        "MixUp(alpha=0.2, targets='loss', stop_at_epoch=3)"
    )
    mixup = MixUp(seed=0)
    linear_fit([mixup])
    state = mixup.state_dict()
    assert set(state) == {"device", "state"} and isinstance(state["device"], str)
    assert isinstance(state["state"], torch.Tensor)


# -- CUDA (make gpu-check) ---------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("targets", ["loss", "soft"])
def test_on_cuda_mixup_and_cutmix_add_no_sync_per_batch(targets):
    import warnings

    from fitlib.callbacks.cutmix import CutMix

    def syncs(n_train, recipe):
        g = torch.Generator().manual_seed(0)
        x, y = (
            torch.randn(n_train, 1, 4, 6, generator=g),
            torch.randint(0, 3, (n_train,)),
        )
        ds = TensorDataset(x, y)
        data = DataBunch(DataLoader(ds, 16, shuffle=True), DataLoader(ds, 32),
                         device="cuda")  # fmt: skip
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(16, 3))
        learn = Learner(data, model, F.cross_entropy, progress=False, metrics=[],
                        callbacks=[recipe(seed=0, targets=targets)],
                        opt_func=torch.optim.SGD)  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                learn.fit(2, lr=0.1)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert next(learn.model.parameters()).device.type == "cuda"
        return [str(w.message) for w in caught if "synchroniz" in str(w.message)]

    for recipe in (MixUp, CutMix):
        few, many = syncs(64, recipe), syncs(256, recipe)
        assert len(few) == len(many), (
            f"{recipe.__name__}(targets={targets!r}): {len(few)} syncs for 4 "
            f"batches an epoch, {len(many)} for 16; the extra ones: "
            f"{many[len(few) :][:3]}"
        )
