"""``CallbackHandler``: keys a callback returns take effect: the data, the
batch, the output, the loss, the optimizer and its lr, the loss function, the
model and the metrics, mid-epoch, and the skip and stop flags (fastai v1's
"EyeOfSauron")."""

import pytest
import torch
from helpers import make_dataset
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

from fitlib import Callback, DataBunch, HPOptimizer, fit, validate
from fitlib.metrics import Accuracy, F1Score, accuracy


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(8, 3)


def loader(n=96, seed=0):
    return DataLoader(make_dataset(n, seed=seed), 16)  # no shuffle: batches known


def double_ce(out, y):
    return 2 * F.cross_entropy(out, y)


class EyeOfSauron(Callback):
    """Changes everything it may, once each, at known batches."""

    def __init__(self, new_opt):
        self.new_opt = new_opt

    def on_batch_begin(self, iteration, last_input, train):
        if train and iteration == 0:
            return {"last_input": last_input * 2}  # the data
        return None

    def on_loss_begin(self, iteration, last_output, train):
        if train and iteration == 1:
            return {"last_output": -last_output}  # the output
        return None

    def on_backward_begin(self, iteration, last_loss):
        if iteration == 2:
            return {"last_loss": last_loss * 0.5}  # the loss backward uses
        return None

    def on_backward_end(self, iteration):
        if iteration == 3:
            return {"skip_step": True}  # a step skipped (its gradients dropped)
        return None

    def on_batch_end(self, iteration, train, opt):
        if not train:
            return None
        if iteration == 3:  # the optimizer, at another lr, and the loss
            self.new_opt.param_groups[0]["lr"] = 0.5
            return {"opt": self.new_opt, "loss_func": double_ce}
        if iteration == 4:
            return {"stop_epoch": True}  # the epoch, after its 5th batch
        return None


def hand_written():
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    loss_func, losses = F.cross_entropy, []
    for i, (x, y) in enumerate(loader()):
        if i == 0:
            x = x * 2
        out = m(x)
        if i == 1:
            out = -out
        loss = loss_func(out, y)
        losses.append(float(loss.detach()))
        (loss * 0.5 if i == 2 else loss).backward()
        if i != 3:
            opt.step()
        opt.zero_grad()
        if i == 3:
            opt = torch.optim.SGD(m.parameters(), lr=0.5)
            loss_func = double_ce
        if i == 4:
            break
    return m, losses


def test_eye_of_sauron_changes_each_thing_where_it_says():
    m = model()
    first = torch.optim.SGD(m.parameters(), lr=0.1)
    second = torch.optim.SGD(m.parameters(), lr=0.01)  # set to 0.5 mid-epoch
    eye = EyeOfSauron(second)
    history = fit(1, m, F.cross_entropy, first, DataBunch(loader(), loader(32, 1)),
                  callbacks=[eye])  # fmt: skip
    ref, losses = hand_written()
    assert torch.equal(m.weight, ref.weight) and torch.equal(m.bias, ref.bias)
    record = history[0]
    assert record["train_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-6)
    # validated with the loss function it was given mid-epoch
    valid = validate(ref, loader(32, 1), double_ce)[0]
    assert record["valid_loss"] == pytest.approx(float(valid), rel=1e-6)
    assert record["lr"] == 0.5  # the lr the new optimizer's last step used


class Swap(Callback):
    """Returns ``key: value`` from ``on_epoch_begin`` at epoch ``at``."""

    def __init__(self, key, value, at=1):
        self.key, self.value, self.at = key, value, at

    def on_epoch_begin(self, epoch):
        return {self.key: self.value} if epoch == self.at else None


def test_a_model_returned_at_an_epoch_trains_and_validates_from_that_epoch():
    first, second = model(0), model(1)
    untouched = model(0)
    start = second.weight.clone()
    history = fit(2, first, F.cross_entropy,
                  {"a": torch.optim.SGD(first.parameters(), lr=0.1),
                   "b": torch.optim.SGD(second.parameters(), lr=0.1)},
                  DataBunch(loader(), loader(32, 1)),
                  callbacks=[Swap("model", second)])  # fmt: skip
    one_epoch = model(0)
    fit(1, one_epoch, F.cross_entropy, torch.optim.SGD(one_epoch.parameters(), lr=0.1),
        DataBunch(loader()))  # fmt: skip
    assert torch.equal(first.weight, one_epoch.weight)  # epoch 0 only
    assert not torch.equal(second.weight, start)  # trained in epoch 1
    valid = validate(second, loader(32, 1), F.cross_entropy)[0]
    assert history[1]["valid_loss"] == pytest.approx(float(valid), rel=1e-6)
    assert not torch.equal(untouched.weight, first.weight)


def test_metrics_returned_with_the_same_names_are_used_at_the_next_validation():
    m = model()
    macro = F1Score(average="macro")
    micro = F1Score(average="micro")  # same name, another average
    history = fit(2, m, F.cross_entropy, torch.optim.SGD(m.parameters(), lr=0.1),
                  DataBunch(loader(), loader(32, 1)), metrics=[macro],
                  callbacks=[Swap("metrics", [micro])])  # fmt: skip
    acc = validate(m, loader(32, 1), F.cross_entropy, metrics=[Accuracy()])[1]
    assert history[1]["f1_score"] == pytest.approx(float(acc))  # micro F1 = accuracy


def test_metrics_with_other_names_are_refused_naming_both():
    m = model()
    with pytest.raises(ValueError, match=r"named \['accuracy'\].*\['f1_score'\]"):
        fit(2, m, F.cross_entropy, torch.optim.SGD(m.parameters(), lr=0.1),
            DataBunch(loader(), loader(32, 1)), metrics=[F1Score()],
            callbacks=[Swap("metrics", [accuracy])])  # fmt: skip


def test_data_returned_at_an_epoch_is_what_that_epoch_trains_on():
    seen = []

    class Spy(Callback):
        order = 5

        def on_batch_begin(self, epoch, last_input, train):
            if train:
                seen.append((epoch, last_input[0, 0].item()))

    other = loader(48, seed=7)
    m = model()
    fit(2, m, F.cross_entropy, torch.optim.SGD(m.parameters(), lr=0.1),
        DataBunch(loader()), callbacks=[Swap("data",
        DataBunch(other)), Spy()])  # fmt: skip
    firsts = [x[0, 0].item() for x, _ in other]
    assert [v for e, v in seen if e == 1] == firsts


def test_a_returned_model_on_another_device_or_a_non_module_is_refused():
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"a model is an nn\.Module"):
        fit(2, m, F.cross_entropy, opt, DataBunch(loader()),
            callbacks=[Swap("model", "resnet")])  # fmt: skip
    meta = nn.Linear(8, 3, device="meta")
    with pytest.raises(ValueError, match="on meta, but the fit's batches go to cpu"):
        fit(2, m, F.cross_entropy, opt, DataBunch(loader()),
            callbacks=[Swap("model", meta)])  # fmt: skip


def test_a_returned_optimizer_of_another_model_is_refused():
    m, other = model(), model(1)
    stray = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="none of which is a trainable parameter"):
        fit(
            2,
            m,
            F.cross_entropy,
            torch.optim.SGD(m.parameters(), lr=0.1),
            DataBunch(loader()),
            callbacks=[Swap("opt", stray)],
        )


@pytest.mark.filterwarnings("ignore:MixedPrecision.float16. on the CPU")
def test_a_swapped_optimizer_takes_the_loss_scaler_and_the_old_one_lets_go():
    from fitlib.callbacks import MixedPrecision

    m = model()
    old = HPOptimizer(m.parameters(), torch.optim.SGD, lr=0.1)
    new = HPOptimizer(m.parameters(), torch.optim.SGD, lr=0.1)
    mp, seen = MixedPrecision(torch.float16), []

    class Spy(Callback):
        order = 5

        def on_backward_end(self, opt, epoch):
            seen.append((epoch, opt is new, opt.grad_scaler is mp.scaler))

    fit(2, m, F.cross_entropy, old, DataBunch(loader()),
        callbacks=[mp, Swap("opt", new), Spy()])  # fmt: skip
    assert {s for s in seen if s[0] == 1} == {(1, True, True)}
    assert old.grad_scaler is None and new.grad_scaler is None  # after the fit


def test_a_checkpoint_saves_the_optimizer_and_model_a_callback_swapped_in(tmp_path):
    from fitlib.callbacks import Checkpoint
    from fitlib.serialization import safe_load

    m = model()
    adam = HPOptimizer(m.parameters(), torch.optim.Adam, lr=1e-3)
    ckpt = Checkpoint(tmp_path)
    fit(3, m, F.cross_entropy, torch.optim.SGD(m.parameters(), lr=0.1),
        DataBunch(loader()), callbacks=[ckpt, Swap("opt", adam)])  # fmt: skip
    saved = safe_load(ckpt.checkpoints()[-1])
    assert "betas" in saved["opt"]["opt"]["param_groups"][0]  # Adam's, not SGD's
    assert len(saved["opt"]["opt"]["state"]) == 2  # the steps Adam took


@pytest.mark.filterwarnings("ignore:MixedPrecision.float16. on the CPU")
def test_returning_the_optimizer_in_use_keeps_its_loss_scaler():
    from fitlib.callbacks import MixedPrecision

    m = model()
    opt = HPOptimizer(m.parameters(), torch.optim.SGD, lr=0.1)
    mp, seen = MixedPrecision(torch.float16), []

    class Spy(Callback):
        order = 5

        def on_backward_end(self, opt):
            seen.append(opt.grad_scaler is mp.scaler)

    fit(2, m, F.cross_entropy, opt, DataBunch(loader()),
        callbacks=[mp, Swap("opt", opt), Spy()])  # fmt: skip
    assert all(seen) and len(seen) == 12


def test_a_model_swapped_without_an_optimizer_for_it_is_refused():
    m, other = model(), model(1)
    with pytest.raises(ValueError, match="none of which is a trainable parameter"):
        fit(2, m, F.cross_entropy, torch.optim.SGD(m.parameters(), lr=0.1),
            DataBunch(loader()), callbacks=[Swap("model", other)])  # fmt: skip


def test_an_undeclared_record_name_close_to_a_declared_one_gets_it():
    class GradNorm(Callback):
        record_names = ("grad_norm",)

        def on_epoch_end(self):
            return {"record": {"gradnorm": 1.0}}

    m = model()
    opt = HPOptimizer(m.parameters(), torch.optim.SGD, lr=0.1)
    close = r"'gradnorm' \(did you mean 'grad_norm'\?\) to the epoch record"
    with pytest.raises(ValueError, match=close):
        fit(1, m, F.cross_entropy, opt, DataBunch(loader(), loader(32)), [GradNorm()])
