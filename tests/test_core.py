import pytest
import torch
from helpers import make_data, make_dataset, make_model
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

from fitlib import Callback, DataBunch, HPOptimizer, Learner, fit, validate
from fitlib.callbacks import ProgressBar, Recorder
from fitlib.core import batch_size, iter_fit, loss_batch, to_device
from fitlib.metrics import accuracy

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-3)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=1e-2)),
}


def hand_written(model, opt, data, epochs):
    """The plain PyTorch loop that fit() must reproduce bit for bit."""
    for _ in range(epochs):
        model.train()
        for x, y in data.train_dl:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            for x, y in data.valid_dl:
                accuracy(model(x), y)
    return model


def hp_optimizer(model, name):
    opt_func, kw = OPTIMIZERS[name]
    mom = kw.get("momentum")
    return HPOptimizer(
        model.parameters(), opt_func, lr=kw["lr"], mom=mom, wd=kw["weight_decay"]
    )


def reference(name, epochs=2):
    torch.manual_seed(42)
    model = make_model()
    opt_func, kw = OPTIMIZERS[name]
    return hand_written(model, opt_func(model.parameters(), **kw), make_data(), epochs)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_fit_matches_a_hand_written_loop_bit_for_bit(name):
    ref = reference(name)
    torch.manual_seed(42)
    model = make_model()
    opt = hp_optimizer(model, name)
    watchers = [Recorder(), ProgressBar(bars=True, refresh=0)]  # must not perturb
    fit(2, model, F.cross_entropy, opt, make_data(), watchers, metrics=[accuracy])
    assert len(watchers[0].losses) == 2 * 7
    for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_learner_fit_matches_a_hand_written_loop_bit_for_bit(name):
    ref = reference(name)
    torch.manual_seed(42)
    model = make_model()
    opt_func, kw = OPTIMIZERS[name]
    learn = Learner(
        make_data(),
        model,
        F.cross_entropy,
        opt_func=opt_func,
        metrics=[accuracy],
        wd=kw["weight_decay"],
        true_wd=False,
    )
    if "momentum" in kw:
        learn.create_opt(kw["lr"]).mom = kw["momentum"]
    learn.fit(2, lr=kw["lr"])
    for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
        assert torch.equal(a, b)


# -- batch forms -----------------------------------------------------------------
class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 2), nn.Linear(5, 2)

    def forward(self, left, right):
        return self.a(left) + self.b(right)


def test_tuple_inputs_call_model_with_star_args_and_tuple_targets_star_the_loss():
    n = 12
    xs = (torch.randn(n, 3), torch.randn(n, 5))
    ys = (torch.randn(n, 2), torch.rand(n, 2))

    def weighted_mse(out, target, weight):
        return (weight * (out - target) ** 2).mean()

    model = TwoInputs()
    loss = loss_batch(model, xs, ys, weighted_mse)
    torch.testing.assert_close(loss, weighted_mse(model(*xs), *ys))


def test_dict_inputs_call_model_with_keyword_arguments():
    model = TwoInputs()
    x = {"right": torch.randn(4, 5), "left": torch.randn(4, 3)}
    y = torch.randn(4, 2)
    loss = loss_batch(model, x, y, F.mse_loss)
    torch.testing.assert_close(loss, F.mse_loss(model(**x), y))


def test_to_device_keeps_the_structure_of_the_batch():
    batch = ((torch.ones(2), [torch.zeros(1)]), {"k": torch.ones(3)}, "label")
    moved = to_device(batch, torch.device("cpu"))
    assert isinstance(moved, tuple) and isinstance(moved[0][1], list)
    assert torch.equal(moved[1]["k"], batch[1]["k"]) and moved[2] == "label"


def test_batch_size_reads_targets_then_inputs():
    assert batch_size(torch.zeros(7)) == 7
    assert batch_size((torch.zeros(5, 2), torch.zeros(5))) == 5
    assert batch_size(torch.tensor(1.0), {"x": torch.zeros(3, 1)}) == 3


def test_validate_averages_over_samples_with_a_ragged_last_batch():
    torch.manual_seed(0)
    model = make_model().eval()
    ds = make_dataset(37)
    val_loss, acc = validate(
        model, DataLoader(ds, 16), F.cross_entropy, metrics=[accuracy]
    )
    x, y = ds.tensors
    with torch.no_grad():
        out = model(x)
    torch.testing.assert_close(val_loss, F.cross_entropy(out, y), check_dtype=False)
    torch.testing.assert_close(acc, accuracy(out, y), check_dtype=False)


def test_fit_with_no_valid_dl_trains_and_reports_no_metrics():
    seen = []

    class Watch(Callback):
        def on_epoch_end(self, last_metrics, **kwargs):
            seen.append(last_metrics)

    model = make_model()
    data = DataBunch(make_data().train_dl)
    fit(1, model, F.cross_entropy, hp_optimizer(model, "sgd"), data, [Watch()])
    assert seen == [None]


# -- bad input -------------------------------------------------------------------
def _fit(epochs=1, data=None, loss_func=F.cross_entropy, model=None, **kw):
    model = model or make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    fit(epochs, model, loss_func, opt, data or make_data(), **kw)


@pytest.mark.parametrize("epochs", [0, -2, 2.5, True, "3"])
def test_epochs_must_be_a_positive_int(epochs):
    with pytest.raises(
        ValueError, match=rf"epochs must be a positive int; got {epochs!r}"
    ):
        _fit(epochs)


def test_data_without_train_dl_says_how_to_wrap_loaders():
    with pytest.raises(
        TypeError, match=r"train_dl attribute; got DataLoader.*DataBunch"
    ):
        _fit(data=make_data().train_dl)


def test_empty_training_loader_is_caught_before_training():
    empty = DataBunch(DataLoader(TensorDataset(torch.zeros(0, 8), torch.zeros(0))))
    with pytest.raises(ValueError, match=r"data.train_dl is empty \(len 0\)"):
        _fit(data=empty)


def test_loader_without_len_that_yields_nothing():
    with pytest.raises(ValueError, match="train_dl yielded no batches"):
        _fit(data=DataBunch(iter([])))


def test_batch_that_is_not_an_x_y_pair():
    triples = [(torch.zeros(2, 8), torch.zeros(2).long(), torch.zeros(2))]
    three = r"\(Tensor.*, Tensor.*, Tensor.*\)"
    with pytest.raises(
        TypeError, match=rf"train_dl yielded a batch of {three}; .*pair"
    ):
        _fit(data=DataBunch(triples))


def test_model_output_the_loss_cannot_take_names_the_shapes():
    bce = F.binary_cross_entropy_with_logits  # wants the target's shape: (16,)
    with pytest.raises(ValueError) as info:
        _fit(loss_func=bce)
    text = str(info.value)
    assert "loss_func binary_cross_entropy_with_logits failed" in text
    assert "output Tensor(shape=(16, 3), float32)" in text
    assert "targets (Tensor(shape=(16,), int64),)" in text
    assert "It said: Target size" in text


def test_model_returning_a_tuple_to_a_loss_that_wants_a_tensor():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 3)

        def forward(self, x):
            return self.lin(x), x

    with pytest.raises(
        TypeError, match=r"output \(Tensor\(shape=\(16, 3\), float32\), Tensor"
    ):
        _fit(model=Pair())


def test_non_scalar_loss_says_how_to_reduce_it():
    def per_sample(out, y):
        return F.cross_entropy(out, y, reduction="none")

    with pytest.raises(
        ValueError, match=r"returned Tensor\(shape=\(16,\).*reduction='mean'"
    ):
        _fit(loss_func=per_sample)


def test_failing_metric_is_named():
    def broken_metric(out, y):
        raise RuntimeError("nope")

    with pytest.raises(RuntimeError, match="broken_metric"):
        _fit(metrics=[broken_metric])


def test_model_forward_error_gets_the_input_shapes_as_a_note():
    with pytest.raises(RuntimeError) as info:
        _fit(model=nn.Linear(5, 3))
    assert any("Tensor(shape=(16, 8)" in n for n in info.value.__notes__)


def test_non_callable_loss_and_non_module_model_and_bad_opt():
    with pytest.raises(TypeError, match="loss_func must be callable"):
        _fit(loss_func="cross_entropy")
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        fit(1, object(), F.cross_entropy, None, make_data())
    with pytest.raises(TypeError, match=r"opt must be a torch\.optim\.Optimizer or"):
        fit(1, make_model(), F.cross_entropy, object(), make_data())


def test_a_plain_torch_optimizer_is_wrapped_so_callbacks_can_set_its_lr():
    seen = []

    class HalveLr(Callback):
        def on_batch_begin(self, opt, iteration, train, **kwargs):
            if train:
                opt.lr = 0.05 / (iteration + 1)

        def on_step_end(self, opt, **kwargs):
            seen.append((type(opt).__name__, opt.opt.param_groups[0]["lr"]))

    model = make_model()
    raw = torch.optim.SGD(model.parameters(), lr=0.1)
    fit(1, model, F.cross_entropy, raw, make_data(), callbacks=[HalveLr()])
    assert seen[:2] == [("HPOptimizer", 0.05), ("HPOptimizer", 0.025)]
    assert raw.param_groups[0]["lr"] == 0.05 / len(seen)  # the user's optimizer


def test_a_model_with_nothing_to_train_is_refused_before_training():
    model = make_model().requires_grad_(False)
    with pytest.raises(ValueError, match=r"no trainable parameter.*unfreeze"):
        _fit(model=model)


# -- step budgets and the iterator ----------------------------------------------
class Steps(Callback):
    """Keeps the state's step and iteration at each training batch's end."""

    def __init__(self):
        self.seen = []

    def on_batch_end(self, train, step, iteration):
        if train:
            self.seen.append((iteration, step))


def test_step_counts_optimizer_steps_and_max_steps_stops_across_epochs():
    from fitlib.callbacks import GradientAccumulation

    steps, rec = Steps(), Recorder()
    _fit(None, callbacks=[steps, rec, GradientAccumulation(2)], max_steps=5)
    # 7 batches an epoch; groups of 2 and a ragged one: 4 steps an epoch.
    assert [s for _, s in steps.seen] == [0, 1, 1, 2, 2, 3, 4, 4, 5]
    assert rec.epochs == [0, 1]  # the epoch in progress still validated


def test_max_steps_and_epochs_whichever_comes_first():
    steps = Steps()
    _fit(2, callbacks=[steps], max_steps=100)
    assert len(steps.seen) == 14
    steps = Steps()
    _fit(5, callbacks=[steps], max_steps=3)
    assert steps.seen[-1] == (2, 3)


@pytest.mark.parametrize("max_steps", [0, -1, 2.0, True])
def test_max_steps_must_be_a_positive_int(max_steps):
    with pytest.raises(ValueError, match="max_steps must be a positive int"):
        _fit(1, max_steps=max_steps)


def test_fit_needs_epochs_or_max_steps():
    with pytest.raises(ValueError, match="epochs=None and max_steps=None"):
        _fit(None)


def test_n_steps_is_capped_by_max_steps():
    seen = {}

    class NSteps(Callback):
        def on_train_begin(self, n_steps, max_steps):
            seen.update(n_steps=n_steps, max_steps=max_steps)

    _fit(3, callbacks=[NSteps()], max_steps=10)
    assert seen == {"n_steps": 10, "max_steps": 10}
    _fit(3, callbacks=[NSteps()])
    assert seen == {"n_steps": 21, "max_steps": None}


def test_iter_fit_yields_after_each_training_batch_and_ends_cleanly_on_break():
    ends = []

    class End(Callback):
        def on_train_end(self, exception):
            ends.append(exception)

    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    gen = iter_fit(3, model, F.cross_entropy, opt, make_data(), [End()])
    seen = []
    for state in gen:
        seen.append((state["iteration"], state["train"]))
        if len(seen) == 9:
            break
    assert seen == [(i, True) for i in range(1, 10)]
    assert ends == [] or ends == [None]
    gen.close()  # the for loop's break leaves it suspended until collected
    assert ends == [None]
