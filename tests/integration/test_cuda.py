"""CUDA paths; skipped cleanly on machines without a GPU (CI has none).

The CPU suite covers the logic; these check what only a GPU can show: that
batches and the model land on the device and that a whole ``Learner.fit``
adds no CUDA synchronization per batch (PyTorch's sync debug mode counts them).
"""

import math
import time
import warnings

import pytest
import torch
from helpers import make_dataset, make_model
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

from fitlib import Callback, DataBunch, HPOptimizer, Learner, fit
from fitlib.callbacks.accumulation import GradientAccumulation
from fitlib.callbacks.mixed_precision import MixedPrecision
from fitlib.metrics import F1Score, accuracy

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def cuda_syncs_during_fit(
    n_train: int, fp16: bool = False, callbacks: tuple = ()
) -> tuple[int, Learner]:
    loaders = [
        DataLoader(make_dataset(n, seed=s), 16, shuffle=s == 0, pin_memory=True)
        for n, s in ((n_train, 0), (n_train // 2, 1))
    ]
    learn = Learner(DataBunch(*loaders, device="cuda"), make_model(), F.cross_entropy,
                    metrics=[accuracy, F1Score()], callbacks=callbacks)  # fmt: skip
    if fp16:
        learn.to_fp16()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            learn.fit(2, lr=1e-2)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return syncs, learn


def test_fit_on_cuda_adds_no_sync_per_batch_even_when_the_bar_redraws_each(
    monkeypatch,
):
    clock = iter(range(10**9))  # a second passes per read: every batch redraws
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(clock)))
    few, learn = cuda_syncs_during_fit(64)
    many, _ = cuda_syncs_during_fit(256)
    assert next(learn.model.parameters()).device.type == "cuda"
    assert few > 0  # the instrument works: epoch ends do read values
    assert few == many


def test_predictions_come_back_to_the_cpu(tmp_path):
    _, learn = cuda_syncs_during_fit(32)
    preds, targets = learn.get_preds()
    assert preds.device.type == "cpu" and targets.device.type == "cpu"
    learn.path = tmp_path
    learn.save("gpu")
    reloaded = learn.load("gpu").get_preds()[0]
    assert torch.equal(reloaded, preds)


# -- mixed precision -------------------------------------------------------------
class Spy(Callback):
    """The forward's output dtype, and whether each step changed the weights:
    kept on the device (no sync inside the counted fit), read after it."""

    def __init__(self):
        self.dtypes, self._changed = set(), []

    def on_batch_begin(self, model, train):
        if train:
            self.before = [p.detach().clone() for p in model.parameters()]

    def on_loss_begin(self, last_output):
        self.dtypes.add(last_output.dtype)

    def on_batch_end(self, model, train):
        if train:
            pairs = zip(self.before, model.parameters())
            self._changed.append(torch.stack([(a != b).any() for a, b in pairs]).any())

    @property
    def changed(self):
        return torch.stack(self._changed).tolist()


@pytest.mark.parametrize("accumulate", [False, True])
def test_fp16_fit_on_cuda_trains_without_a_sync_per_step(monkeypatch, accumulate):
    monkeypatch.setattr(time, "perf_counter", lambda: 1000.0)  # no paced refresh
    spy = Spy()

    def callbacks():
        return (GradientAccumulation(2),) if accumulate else ()

    few, _ = cuda_syncs_during_fit(64, fp16=True, callbacks=callbacks())
    many, learn = cuda_syncs_during_fit(256, fp16=True, callbacks=(*callbacks(), spy))
    assert few > 0  # the instrument works: epoch ends do read values
    assert few == many
    mp = next(cb for cb in learn.callbacks if isinstance(cb, MixedPrecision))
    assert learn.opt.opt.defaults["fused"] is True  # skipping a step: no sync
    assert spy.dtypes == {torch.float16}
    assert mp.skipped_steps == 0
    # 16 batches per epoch: with accumulation every second one steps.
    assert spy.changed == ([False, True] * 16 if accumulate else [True] * 32)
    losses = learn.recorder.train_losses
    assert losses[-1] < losses[0]
    assert learn.opt.grad_scaler is None


def test_fp16_on_cuda_skips_a_step_with_non_finite_gradients():
    bad = {"n": 0}

    def loss_func(out, y):
        loss = F.cross_entropy(out, y)
        if torch.is_grad_enabled():
            bad["n"] += 1
            if bad["n"] == 3:
                return loss * math.inf
        return loss

    spy = Spy()
    data = DataBunch(DataLoader(make_dataset(100), 16), None, device="cuda")
    learn = Learner(data, make_model(), loss_func, metrics=[], progress=False,
                    callbacks=[spy]).to_fp16()  # fmt: skip
    learn.fit(1, lr=1e-2)
    mp = learn.callbacks[-1]
    assert spy.changed == [True, True, False, True, True, True, True]
    assert mp.skipped_steps == 1
    assert mp.scaler.get_scale() == 2.0**15


def test_fp16_with_an_unfused_optimizer_on_cuda_warns_about_the_sync():
    model = make_model().cuda()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    data = DataBunch(DataLoader(make_dataset(32), 16), None, device="cuda")
    with pytest.warns(RuntimeWarning, match=r"not fused.*sync.*fused=True"):
        fit(1, model, F.cross_entropy, opt, data, [MixedPrecision(torch.float16)])


@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
    reason="needs a GPU with bfloat16",
)
def test_bf16_on_cuda_runs_the_forward_in_bfloat16():
    spy = Spy()
    data = DataBunch(DataLoader(make_dataset(64), 16), None, device="cuda")
    learn = Learner(data, make_model(), F.cross_entropy, metrics=[], progress=False,
                    callbacks=[spy]).to_bf16()  # fmt: skip
    learn.fit(2, lr=1e-2)
    assert spy.dtypes == {torch.bfloat16}
    assert learn.recorder.train_losses[-1] < learn.recorder.train_losses[0]
    assert learn.callbacks[-1].scaler is None


def test_a_host_copy_starts_without_a_sync_and_reads_the_value():
    from fitlib.host_copy import HostCopy

    x = torch.randn(256, 256, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = (x @ x).square().mean()
        copy = HostCopy([loss, loss * 2])
        copy.ready()  # asks the event: no wait
    finally:
        torch.cuda.set_sync_debug_mode("default")
    a, b = copy.get()
    assert copy.ready() and a == pytest.approx(loss.item()) and b == 2 * a


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_evaluation_on_cuda_runs_in_the_learners_precision(precision):
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("needs a GPU with bfloat16")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    loaders = [DataLoader(make_dataset(n, seed=s), 16) for n, s in ((64, 0), (48, 1))]
    learn = Learner(DataBunch(*loaders, device="cuda"), make_model(), F.cross_entropy,
                    metrics=[accuracy], progress=False)  # fmt: skip
    getattr(learn, f"to_{precision}")()
    history = learn.fit(1, lr=1e-2)
    valid = learn.validate()  # the weights of the fit's last validation
    assert valid["valid_loss"] == history[-1]["valid_loss"]
    assert valid["accuracy"] == history[-1]["accuracy"]
    preds, _ = learn.get_preds()
    x = loaders[1].dataset.tensors[0]
    assert preds.dtype == torch.float32  # computed in dtype, returned in float32
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
        expected = learn.model.eval()(x.cuda()).float().cpu()
    torch.testing.assert_close(preds, expected)
    assert learn.predict(x[:3]).dtype == torch.float32
    assert not torch.is_autocast_enabled("cuda")
