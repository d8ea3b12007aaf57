import copy
import io
import math
from functools import partial

import pytest
import torch
from helpers import make_data, make_dataset, make_model
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

from fitlib import Callback, DataBunch, HPOptimizer, Learner, fit
from fitlib.callback import call_hook
from fitlib.callbacks.mixed_precision import MixedPrecision
from fitlib.metrics import accuracy

# The CPU runs float16 here on purpose (the logic is the same as on a GPU).
pytestmark = pytest.mark.filterwarnings(
    r"ignore:MixedPrecision\(float16\) on the CPU:RuntimeWarning"
)
INIT_SCALE = 2.0**16


@pytest.fixture(autouse=True)
def autocast_off_afterwards():
    """A failing scripted test must not leave autocast on for the next ones."""
    yield
    torch.set_autocast_enabled("cpu", False)


def mlp() -> nn.Module:
    """No batch norm, no dropout: runs compare exactly."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def learner(precision=None, model=None, loss_func=F.cross_entropy, **kwargs):
    """A Learner on the tiny data (7 training batches), fused SGD under fp16."""
    learn = Learner(
        make_data(shuffle=False),
        model or make_model(),
        loss_func,
        opt_func=torch.optim.SGD,
        metrics=[],
        wd=0.0,
        progress=False,
        **kwargs,
    )
    return learn if precision is None else getattr(learn, f"to_{precision}")()


def sgd(model, fused=None):
    return HPOptimizer(model.parameters(), partial(torch.optim.SGD, fused=fused), 0.1)


class InfOnBatch:
    """Cross-entropy, times inf on the ``bad``-th training batch (1-based)."""

    def __init__(self, bad):
        self.bad, self.n = bad, 0

    def __call__(self, out, y):
        loss = F.cross_entropy(out, y)
        if torch.is_grad_enabled():  # training, not validation
            self.n += 1
            if self.n == self.bad:
                return loss * math.inf
        return loss


class Spy(Callback):
    """What a callback after MixedPrecision sees (syncs per batch: a test)."""

    def __init__(self, mp=None):
        self.mp, self.out_dtypes, self.autocast_in_loss = mp, [], []
        self.autocast_after, self.bwd_losses, self.losses, self.scales = [], [], [], []
        self.scalers, self.changed = [], []

    def on_batch_begin(self, model, train):
        self.before = [p.detach().clone() for p in model.parameters()]

    def on_loss_begin(self, last_output):
        self.out_dtypes.append(last_output.dtype)
        self.autocast_in_loss.append(torch.is_autocast_enabled("cpu"))

    def on_backward_begin(self, last_loss, opt):
        self.bwd_losses.append(float(last_loss.detach()))
        self.scalers.append(opt.grad_scaler)

    def on_batch_end(self, model, last_loss, train):
        self.autocast_after.append(torch.is_autocast_enabled("cpu"))
        if train:
            self.losses.append(float(last_loss))
            after = list(model.parameters())
            self.changed.append(any(map(differ, self.before, after)))
            if self.mp is not None and self.mp.scaler is not None:
                self.scales.append(self.mp.scaler.get_scale())


def differ(a, b):
    return not torch.equal(a, b)


class GradSpy(Callback):
    """Copies the gradients in ``on_backward_end`` at its ``order``."""

    def __init__(self, order):
        self.order, self.grads = order, []

    def on_backward_end(self, model):
        self.grads.append([p.grad.detach().clone() for p in model.parameters()])


def grad_norm(grads):
    return torch.cat([g.flatten() for g in grads]).norm().item()


# -- scripted hooks --------------------------------------------------------------
def test_autocast_is_on_from_batch_begin_to_the_loss():
    mp, model = MixedPrecision(torch.bfloat16), nn.Linear(2, 1)
    opt = sgd(model)
    assert call_hook(mp, "on_train_begin", model=model, opt=opt) is None
    call_hook(mp, "on_batch_begin")
    assert torch.is_autocast_enabled("cpu")
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert model(torch.ones(3, 2)).dtype == torch.bfloat16
    assert call_hook(mp, "on_backward_begin", last_loss=torch.tensor(2.0)) is None
    assert not torch.is_autocast_enabled("cpu")
    assert mp.scaler is None and opt.grad_scaler is None  # bfloat16: no scaling


def test_validation_batches_leave_autocast_at_batch_end():
    mp, model = MixedPrecision("bf16"), nn.Linear(2, 1)
    call_hook(mp, "on_train_begin", model=model, opt=sgd(model))
    call_hook(mp, "on_batch_begin", train=False)
    assert torch.is_autocast_enabled("cpu")
    call_hook(mp, "on_batch_end", train=False)
    assert not torch.is_autocast_enabled("cpu")


def test_fp16_scales_the_loss_then_unscales_the_gradients_before_the_step():
    model = nn.Linear(2, 1)
    mp, opt = MixedPrecision(torch.float16, init_scale=1024.0), sgd(model)
    call_hook(mp, "on_train_begin", model=model, opt=opt)
    assert opt.grad_scaler is mp.scaler
    call_hook(mp, "on_batch_begin")
    update = call_hook(mp, "on_backward_begin", last_loss=torch.tensor(0.5))
    assert update["last_loss"].item() == 0.5 * 1024
    model.weight.grad = torch.tensor([[1024.0, -2048.0]])
    model.bias.grad = torch.tensor([512.0])
    call_hook(mp, "on_backward_end", opt=opt, skip_step=False)
    assert model.weight.grad.tolist() == [[1.0, -2.0]]
    assert model.bias.grad.tolist() == [0.5]
    call_hook(mp, "on_step_end", opt=opt)
    assert mp.skipped_steps == 0 and mp.scaler.get_scale() == 1024.0


def test_a_non_finite_gradient_is_counted_and_halves_the_scale():
    model = nn.Linear(2, 1)
    mp, opt = MixedPrecision(torch.float16, init_scale=1024.0), sgd(model)
    call_hook(mp, "on_train_begin", model=model, opt=opt)
    call_hook(mp, "on_batch_begin")
    call_hook(mp, "on_backward_begin", last_loss=torch.tensor(0.5))
    model.weight.grad = torch.tensor([[math.inf, 1.0]])
    model.bias.grad = torch.tensor([1.0])
    call_hook(mp, "on_backward_end", opt=opt, skip_step=False)
    call_hook(mp, "on_step_end", opt=opt)
    assert mp.skipped_steps == 1 and mp.scaler.get_scale() == 512.0


def test_a_batch_without_a_step_keeps_its_gradients_scaled():
    model = nn.Linear(2, 1)
    mp, opt = MixedPrecision(torch.float16, init_scale=1024.0), sgd(model)
    call_hook(mp, "on_train_begin", model=model, opt=opt)
    model.weight.grad = torch.tensor([[1024.0, 0.0]])
    call_hook(mp, "on_backward_end", opt=opt, skip_step=True)  # accumulating
    call_hook(mp, "on_step_end", opt=opt)
    assert model.weight.grad.tolist() == [[1024.0, 0.0]]
    assert mp.scaler.state_dict()["_growth_tracker"] == 0  # no update either


def test_train_end_turns_autocast_off_and_detaches_the_scaler():
    model = nn.Linear(2, 1)
    mp, opt = MixedPrecision(torch.float16), sgd(model)
    call_hook(mp, "on_train_begin", model=model, opt=opt)
    call_hook(mp, "on_batch_begin")
    call_hook(mp, "on_train_end", opt=opt, exception=RuntimeError("in forward"))
    assert not torch.is_autocast_enabled("cpu")
    assert opt.grad_scaler is None


# -- bad input -------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, "float8", "half", None, ["fp16"]]
)
def test_an_unknown_dtype_is_a_clear_error(dtype):
    with pytest.raises(ValueError, match=r"unknown dtype.*Fix: torch\.float16"):
        MixedPrecision(dtype)


@pytest.mark.parametrize("init_scale", [0, -1.0, math.inf, math.nan, True, "65536"])
def test_init_scale_must_be_a_positive_finite_number(init_scale):
    with pytest.raises(ValueError, match=r"init_scale must be .*got"):
        MixedPrecision(torch.float16, init_scale=init_scale)


@pytest.mark.parametrize("interval", [0, -5, 2.5, True, None])
def test_growth_interval_must_be_a_positive_int(interval):
    with pytest.raises(ValueError, match=r"growth_interval must be an int >= 1"):
        MixedPrecision(torch.float16, growth_interval=interval)


def test_fp16_on_the_cpu_warns_and_suggests_bf16_but_trains():
    learn = learner("fp16")
    with pytest.warns(RuntimeWarning, match=r"float16\) on the CPU.*slower.*bfloat16"):
        learn.fit(3, lr=0.1)
    losses = learn.recorder.train_losses
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0]


# -- through fit -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("precision", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)]
)
def test_later_callbacks_see_the_half_output_and_autocast_off_after(precision, dtype):
    spy = Spy()
    learner(precision, callbacks=[spy]).fit(1, lr=0.1)
    n = 7 + 3  # training and validation batches
    assert spy.out_dtypes == [dtype] * n
    assert spy.autocast_in_loss == [True] * n
    assert spy.autocast_after == [False] * n
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_is_off_after_an_exception_in_the_forward(dtype):
    inner, seen = mlp(), []

    def forward_that_fails(x):
        seen.append(torch.is_autocast_enabled("cpu"))
        if len(seen) == 2:
            raise RuntimeError("bad batch")
        return inner(x)

    model = nn.Module()
    model.inner, model.forward = inner, forward_that_fails
    data = make_data(shuffle=False)
    opt = sgd(model)
    with pytest.raises(RuntimeError, match="bad batch"):
        fit(1, model, F.cross_entropy, opt, data, [MixedPrecision(dtype)])
    assert seen == [True, True]
    assert not torch.is_autocast_enabled("cpu")
    assert opt.grad_scaler is None


def test_bf16_trains_on_the_cpu_without_a_scaler():
    spy = Spy()
    learn = learner("bf16", callbacks=[spy])
    learn.fit(4, lr=0.1)
    losses = learn.recorder.train_losses
    assert losses[-1] < losses[0]
    assert set(spy.out_dtypes) == {torch.bfloat16}
    assert set(spy.scalers) == {None} and learn.callbacks[-1].scaler is None
    assert spy.bwd_losses == spy.losses  # no loss scaling
    assert not learn.opt.opt.defaults.get("fused")  # no scaler: no need to fuse


def test_backward_uses_the_scaled_loss_and_the_recorder_the_true_one():
    spy = Spy()
    learn = learner("fp16", model=mlp(), callbacks=[spy])
    learn.fit(1, lr=0.1)
    reference = learner(model=mlp())
    reference.fit(1, lr=0.1)
    # An exact power of two: the float32 product is exact.
    assert spy.bwd_losses == [loss * INIT_SCALE for loss in spy.losses]
    assert learn.recorder.losses == spy.losses
    assert learn.recorder.losses == pytest.approx(reference.recorder.losses, rel=1e-2)


def test_later_callbacks_see_unscaled_gradients():
    before, after = GradSpy(order=-25), GradSpy(order=-10)
    learner("fp16", model=mlp(), callbacks=[before, after]).fit(1, lr=0.1)
    ref = GradSpy(order=-10)
    learner(model=mlp(), callbacks=[ref]).fit(1, lr=0.1)
    assert len(after.grads) == 7
    for scaled, unscaled in zip(before.grads, after.grads, strict=True):
        for s, u in zip(scaled, unscaled, strict=True):
            assert torch.equal(u, s / INIT_SCALE)
    assert grad_norm(after.grads[0]) == pytest.approx(grad_norm(ref.grads[0]), rel=1e-2)
    assert grad_norm(before.grads[0]) > 1000 * grad_norm(after.grads[0])


@pytest.mark.parametrize("fused", [True, False])
def test_a_step_with_non_finite_gradients_is_skipped_and_halves_the_scale(fused):
    model = mlp()
    mp = MixedPrecision(torch.float16)
    spy = Spy(mp)
    data = make_data(shuffle=False)
    fit(1, model, InfOnBatch(3), sgd(model, fused), data, [mp, spy])
    assert spy.changed == [True, True, False, True, True, True, True]
    assert mp.skipped_steps == 1
    half = INIT_SCALE / 2
    assert spy.scales == [INIT_SCALE] * 2 + [half] * 5
    assert spy.bwd_losses[3] == spy.losses[3] * half  # backward uses the new scale


def test_to_fp16_with_the_default_adamw_skips_weight_decay_too():
    spy = Spy()
    learn = Learner(make_data(shuffle=False), mlp(), InfOnBatch(3), metrics=[],
                    progress=False, callbacks=[spy]).to_fp16()  # fmt: skip
    assert learn.wd > 0 and learn.true_wd  # decoupled, inside the fused kernel
    learn.fit(1, lr=1e-2)
    assert spy.changed == [True, True, False, True, True, True, True]
    assert learn.callbacks[-1].skipped_steps == 1


@pytest.mark.parametrize("fused", [True, False])
def test_decoupled_decay_done_by_the_wrapper_is_skipped_with_the_step(fused):
    """SGD has no native decoupled decay: HPOptimizer decays, masked on the device."""
    model, spy = mlp(), Spy()
    opt = HPOptimizer(
        model.parameters(),
        partial(torch.optim.SGD, fused=fused),
        lr=0.1,
        wd=0.5,
        true_wd=True,
    )
    mp = MixedPrecision(torch.float16)
    fit(1, model, InfOnBatch(3), opt, make_data(shuffle=False), [mp, spy])
    assert spy.changed == [True, True, False, True, True, True, True]


def test_the_scale_doubles_after_growth_interval_good_steps():
    mp = MixedPrecision(torch.float16, init_scale=256.0, growth_interval=3)
    spy = Spy(mp)
    learner(callbacks=[mp, spy]).fit(1, lr=0.1)
    assert spy.scales == [256.0 * 2 ** (step // 3) for step in range(1, 8)]


def test_state_round_trip_continues_with_the_same_scale_and_tracker():
    mp = MixedPrecision(torch.float16, init_scale=256.0, growth_interval=6)
    model = mlp()
    fit(1, model, InfOnBatch(2), sgd(model, True), make_data(shuffle=False), [mp])
    state = mp.state_dict()
    # One skip halved the scale, then five good steps of the six to grow.
    assert state["skipped_steps"] == 1
    assert state["scaler"]["scale"] == 128.0
    assert state["scaler"]["_growth_tracker"] == 5
    buf = io.BytesIO()
    torch.save(state, buf)  # plain values: a checkpoint loads them safely
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)

    resumed = MixedPrecision(torch.float16)  # its init_scale, growth_interval:
    resumed.load_state_dict(loaded)  # replaced, before its first fit
    assert resumed.state_dict() == state
    spy = Spy(resumed)
    data = make_data(shuffle=False)
    fit(1, model, F.cross_entropy, sgd(model, True), data, [resumed, spy])
    assert spy.bwd_losses[0] == spy.losses[0] * 128.0
    # The first good step completes the six, and six more double it again.
    assert spy.scales == [256.0] * 6 + [512.0]
    assert resumed.skipped_steps == 1


def test_loading_state_after_a_fit_sets_the_live_scaler():
    mp = MixedPrecision(torch.float16)
    learner(callbacks=[mp]).fit(1, lr=0.1)
    state = copy.deepcopy(mp.state_dict())
    state["scaler"]["scale"], state["skipped_steps"] = 8.0, 3
    mp.load_state_dict(state)
    assert mp.scaler.get_scale() == 8.0 and mp.skipped_steps == 3
    assert mp.state_dict() == state


def test_an_error_between_unscale_and_update_leaves_the_scaler_usable():
    class FailOnce(Callback):
        order = -10  # after MixedPrecision unscaled the gradients

        def __init__(self):
            self.n = 0

        def on_backward_end(self):
            self.n += 1
            if self.n == 2:
                raise RuntimeError("clipping failed")

    mp = MixedPrecision(torch.float16)
    learn = learner(callbacks=[mp])
    with pytest.raises(RuntimeError, match="clipping failed"):
        learn.fit(1, lr=0.1, callbacks=[FailOnce()])
    learn.fit(1, lr=0.1)  # would raise: unscale_() has already been called
    # One step before the error; the interrupted one is not counted.
    assert mp.state_dict()["scaler"]["_growth_tracker"] == 1 + 7
    assert learn.opt.grad_scaler is None


# -- Learner shortcuts -----------------------------------------------------------
def test_to_fp16_creates_a_fused_optimizer_and_attaches_the_scaler_during_fit():
    spy = Spy()
    learn = learner("fp16", callbacks=[spy])
    learn.fit(1, lr=0.1)
    mp = learn.callbacks[-1]
    assert isinstance(mp, MixedPrecision) and mp.dtype is torch.float16
    assert learn.opt.opt.defaults["fused"] is True
    assert set(spy.scalers) == {mp.scaler} and mp.scaler is not None
    assert learn.opt.grad_scaler is None  # detached after the fit


def test_to_fp32_removes_mixed_precision_so_the_optimizer_is_not_fused():
    learn = learner("fp16").to_bf16().to_fp16().to_fp32()
    assert not any(isinstance(cb, MixedPrecision) for cb in learn.callbacks)
    learn.fit(1, lr=0.1)
    assert not learn.opt.opt.defaults.get("fused")
    assert learn.opt.grad_scaler is None


def test_to_fp16_and_to_bf16_replace_each_other():
    learn = learner("fp16").to_bf16()
    mps = [cb for cb in learn.callbacks if isinstance(cb, MixedPrecision)]
    assert [mp.dtype for mp in mps] == [torch.bfloat16]


# -- no host-device sync per batch -------------------------------------------------
@pytest.fixture
def host_syncs(sync_counter, frozen_clock):
    """The suite's sync counter (conftest.py), with the clock frozen."""
    return sync_counter


def syncs_during_fit(counter, n_train, precision, opt_func=torch.optim.SGD):
    data = DataBunch(
        DataLoader(make_dataset(n_train), 16, shuffle=True),
        DataLoader(make_dataset(n_train // 2, seed=1), 16),
        device="cpu",
    )
    learn = Learner(data, make_model(), F.cross_entropy, opt_func=opt_func,
                    metrics=[accuracy], progress=True)  # fmt: skip
    learn = getattr(learn, f"to_{precision}")()
    before = counter["n"]
    learn.fit(2, lr=0.1)
    return counter["n"] - before


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_sync_count_does_not_grow_with_batches(host_syncs, precision):
    few = syncs_during_fit(host_syncs, 64, precision)
    many = syncs_during_fit(host_syncs, 256, precision)
    assert few > 0  # epoch ends read values: the counter works
    assert few == many


def test_an_unfused_optimizer_syncs_each_step_and_the_counter_sees_it(host_syncs):
    def unfused(params, lr):
        return torch.optim.SGD(params, lr=lr)

    few = syncs_during_fit(host_syncs, 64, "fp16", unfused)
    many = syncs_during_fit(host_syncs, 256, "fp16", unfused)
    assert many - few == 2 * (256 - 64) // 16  # one per extra step


@pytest.mark.filterwarnings("ignore:MixedPrecision.float16. on the CPU")
def test_after_an_error_mid_step_a_plain_fit_steps_without_the_old_scaler():
    class Fails(Callback):
        order = 0  # after MixedPrecision unscaled

        def on_backward_end(self):
            raise RuntimeError("boom")

    model = mlp()
    opt = sgd(model, fused=True)
    data = make_data(shuffle=False)
    with pytest.raises(RuntimeError, match="boom"):
        fit(1, model, F.cross_entropy, opt, data, [MixedPrecision(), Fails()])
    assert opt.grad_scaler is None
    before = [p.detach().clone() for p in model.parameters()]
    fit(1, model, F.cross_entropy, opt, data)  # float32 now
    assert all(map(differ, before, model.parameters()))


# -- evaluation in the Learner's precision -------------------------------------------
def autocast_outputs(model, loader, dtype):
    """The validation set's outputs, batch by batch, under autocast in ``dtype``."""
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        return torch.cat([model(xb) for xb, _ in loader])


@pytest.mark.parametrize(
    ("precision", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)]
)
def test_validate_get_preds_and_predict_run_in_the_learners_precision(precision, dtype):
    learn = Learner(make_data(shuffle=False), make_model(), F.cross_entropy,
                    opt_func=torch.optim.SGD, metrics=[accuracy],
                    progress=False)  # fmt: skip
    getattr(learn, f"to_{precision}")()
    history = learn.fit(1, lr=0.1)
    valid = learn.validate()  # the same weights as the fit's last validation
    assert valid["valid_loss"] == history[-1]["valid_loss"]  # exactly
    assert valid["accuracy"] == history[-1]["accuracy"]
    # Computed under autocast, returned in float32 (so .numpy() works).
    preds, _ = learn.get_preds()
    expected = autocast_outputs(learn.model, learn.data.valid_dl, dtype).float()
    assert preds.dtype == torch.float32 and torch.equal(preds, expected)
    x = learn.data.valid_dl.dataset.tensors[0][:5]
    expected = autocast_outputs(learn.model, [(x, 0)], dtype).float()
    assert torch.equal(learn.predict(x), expected)
    assert learn.predict(x[0]).dtype == torch.float32
    assert learn.predict(x[0]).numpy().shape == (3,)
    assert not torch.is_autocast_enabled("cpu")  # off again afterwards
    learn.to_fp32()
    assert learn.get_preds()[0].dtype == torch.float32


def test_fp16_driven_without_an_optimizer_at_train_begin_says_so_at_the_step():
    from fitlib import CallbackHandler, loss_batch

    model = mlp()
    handler = CallbackHandler([MixedPrecision()])
    handler.on_train_begin(1, model=model, data=make_data(), loss_func=F.cross_entropy)
    handler.on_epoch_begin()
    xb, yb = handler.on_batch_begin(torch.randn(4, 8), torch.zeros(4).long())
    with pytest.raises(ValueError, match="no loss scaler: on_train_begin got no "
                       r"optimizer\. Fix: handler\.on_train_begin"):  # fmt: skip
        loss_batch(model, xb, yb, F.cross_entropy, sgd(model), handler)
