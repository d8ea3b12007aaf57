"""``fitlib.core``: the loop (``fit``, ``fit_states``, ``loss_batch``,
``validate``) matches a hand-written one, takes batches of every form, checks
its arguments, the model's output and the loss before training, counts steps,
and puts back the modes it found."""

import pytest
import torch
from helpers import make_data, make_dataset, make_model, train
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

from fitlib import Callback, DataBunch, HPOptimizer, Learner, fit, validate
from fitlib.callbacks import OneCycleScheduler, ProgressBar, Recorder
from fitlib.checks import len_or_none
from fitlib.core import fit_states, loss_batch
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


@pytest.mark.parametrize("epochs", [0, -2, 2.5, True, "3"])
def test_epochs_must_be_a_positive_int(epochs):
    with pytest.raises(
        ValueError, match=rf"epochs must be an int >= 1 or None; got {epochs!r}"
    ):
        train(epochs=epochs)


def test_model_output_the_loss_cannot_take_names_the_shapes():
    bce = F.binary_cross_entropy_with_logits  # wants the target's shape: (16,)
    with pytest.raises(ValueError) as info:
        train(loss_func=bce, epochs=1)
    text = str(info.value)
    assert "loss_func binary_cross_entropy_with_logits got an output of shape " in text
    assert "(16, 3) and targets of shape (16,), which do not match" in text


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
        train(model=Pair(), epochs=1)


def test_non_scalar_loss_says_how_to_reduce_it():
    def per_sample(out, y):
        return F.cross_entropy(out, y, reduction="none")

    with pytest.raises(
        ValueError, match=r"returned Tensor\(shape=\(16,\).*reduction='mean'"
    ):
        train(loss_func=per_sample, epochs=1)


def test_failing_metric_is_named():
    def broken_metric(out, y):
        raise RuntimeError("nope")

    with pytest.raises(RuntimeError, match="broken_metric"):
        train(metrics=[broken_metric], epochs=1)


def test_model_forward_error_gets_the_input_shapes_as_a_note():
    class Broken(nn.Module):
        def forward(self, x):
            raise RuntimeError("custom failure")

    with pytest.raises(RuntimeError, match="custom failure") as info:
        train(model=nn.Sequential(nn.Linear(8, 3), Broken()), epochs=1)
    assert any("Tensor(shape=(16, 8)" in n for n in info.value.__notes__)


def test_a_wrong_input_size_names_the_layer_and_what_it_expects():
    with pytest.raises(ValueError) as info:
        train(model=nn.Linear(5, 3), epochs=1)
    text = str(info.value)
    assert "the model (Linear(in_features=5, out_features=3, bias=True)) got " in text
    assert "input Tensor(shape=(16, 8), float32): it expects 5 features" in text
    assert "It said: mat1 and mat2 shapes cannot be multiplied" in text
    deep = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(5, 3))
    with pytest.raises(
        ValueError, match=r"layer '2' of the model \(Linear\(in_f"
    ) as info:
        train(model=deep, epochs=1)
    assert "input Tensor(shape=(16, 4), float32): it expects 5 features" in str(
        info.value
    )
    assert "the model was called with Tensor(shape=(16, 8), float32)" in str(info.value)
    images = [(torch.zeros(4, 3, 8, 8), torch.zeros(4).long())]
    conv = nn.Sequential(nn.Conv2d(1, 3, 3), nn.Flatten(), nn.LazyLinear(3))
    with pytest.raises(ValueError, match=r"it expects 1 channels in dimension -3"):
        train(model=conv, data=DataBunch(images), epochs=1)


def test_an_input_of_another_dtype_than_the_layer_is_a_type_error():
    ints = [(torch.randint(0, 5, (16, 8)), torch.randint(0, 3, (16,)))]
    with pytest.raises(TypeError, match=r"layer '0' of the model .* has float32 "):
        train(data=DataBunch(ints), epochs=1)


def test_a_loss_class_instead_of_an_instance_says_to_instantiate_it():
    with pytest.raises(
        TypeError, match=r"class CrossEntropyLoss.*CrossEntropyLoss\(\)"
    ):
        train(loss_func=torch.nn.CrossEntropyLoss, epochs=1)
    train(loss_func=torch.nn.CrossEntropyLoss(), epochs=1)  # an instance is a loss


def test_non_callable_loss_and_non_module_model_and_bad_opt():
    with pytest.raises(TypeError, match="loss_func must be callable"):
        train(loss_func="cross_entropy", epochs=1)
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
        train(model=model, epochs=1)


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
    train(epochs=None, callbacks=[steps, rec, GradientAccumulation(2)], max_steps=5)
    # 7 batches an epoch; groups of 2 and a ragged one: 4 steps an epoch.
    assert [s for _, s in steps.seen] == [0, 1, 1, 2, 2, 3, 4, 4, 5]
    assert rec.epochs == [0, 1]  # the epoch in progress still validated


def test_max_steps_and_epochs_whichever_comes_first():
    steps = Steps()
    train(epochs=2, callbacks=[steps], max_steps=100)
    assert len(steps.seen) == 14
    steps = Steps()
    train(epochs=5, callbacks=[steps], max_steps=3)
    assert steps.seen[-1] == (2, 3)


@pytest.mark.parametrize("max_steps", [0, -1, 2.0, True])
def test_max_steps_must_be_a_positive_int(max_steps):
    with pytest.raises(
        ValueError, match=rf"max_steps must be an int >= 1 or None; got {max_steps!r}"
    ):
        train(epochs=1, max_steps=max_steps)


def test_fit_needs_epochs_or_max_steps():
    with pytest.raises(ValueError, match="epochs=None and max_steps=None"):
        train(epochs=None)


def test_n_steps_is_capped_by_max_steps():
    seen = {}

    class NSteps(Callback):
        def on_train_begin(self, n_steps, max_steps):
            seen.update(n_steps=n_steps, max_steps=max_steps)

    train(epochs=3, callbacks=[NSteps()], max_steps=10)
    assert seen == {"n_steps": 10, "max_steps": 10}
    train(epochs=3, callbacks=[NSteps()])
    assert seen == {"n_steps": 21, "max_steps": None}


def test_fit_states_yields_after_each_training_batch_and_ends_cleanly_on_break():
    ends = []

    class End(Callback):
        def on_train_end(self, exception):
            ends.append(exception)

    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    gen = fit_states(3, model, F.cross_entropy, opt, make_data(), [End()])
    seen = []
    for state in gen:
        seen.append((state["iteration"], state["train"]))
        if len(seen) == 9:
            break
    assert seen == [(i, True) for i in range(1, 10)]
    assert ends == [] or ends == [None]
    gen.close()  # the for loop's break leaves it suspended until collected
    assert ends == [None]


def test_iter_fit_is_a_deprecated_alias_of_fit_states_yielding_the_same():
    import fitlib

    def run(loop):
        torch.manual_seed(0)
        model = make_model()
        opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        states = loop(2, model, F.cross_entropy, opt, make_data(), max_steps=9)
        return [(s["iteration"], s["step"], s["last_loss"]) for s in states]

    with pytest.warns(DeprecationWarning, match="called fit_states now"):
        old = run(fitlib.iter_fit)
    assert old == run(fitlib.fit_states) and len(old) == 9


# -- evaluation puts back the mode it found -----------------------------------
def modes(model):
    return [m.training for m in model.modules()]


def test_validate_puts_back_each_modules_mode_and_the_grad_mode():
    model, data = make_model(), make_data()
    model.train()
    model[1].eval()  # a frozen batch norm: a mode a user chose
    before = modes(model)
    validate(model, data.valid_dl, F.cross_entropy, metrics=[accuracy])
    assert modes(model) == before
    with torch.no_grad():  # validate left no_grad on: the block's mode stays
        validate(model, data.valid_dl, F.cross_entropy)
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()


def test_validate_puts_back_the_mode_after_an_error():
    model, data = make_model(), make_data()
    model.train()

    def broken(out, y):
        raise RuntimeError("boom")

    with pytest.raises(ValueError, match="boom"):
        validate(model, data.valid_dl, broken)
    assert all(modes(model)) and torch.is_grad_enabled()


def test_a_callback_that_validates_mid_epoch_leaves_training_in_train_mode():
    seen = []

    class Probe(Callback):
        def on_batch_begin(self, train, num_batch, model, data):
            if train:
                seen.append(model.training)
                if num_batch == 2:  # e.g. a callback that evaluates now and then
                    validate(model, data.valid_dl, F.cross_entropy)

    train(callbacks=[Probe()], epochs=1)
    assert seen and all(seen), seen


# -- a fit never steps on stale gradients --------------------------------------
def test_a_fit_never_steps_on_gradients_left_by_a_failed_one():
    class FailAfterBackward(Callback):
        def on_backward_end(self):
            raise RuntimeError("crash between backward and zero_grad")

    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    data = make_data(shuffle=False)
    with pytest.raises(RuntimeError, match="crash between"):
        fit(1, model, F.cross_entropy, opt, data, [FailAfterBackward()])
    assert any(p.grad is not None for p in model.parameters())  # left behind
    clean = make_model()
    clean.load_state_dict(model.state_dict())
    clean_opt = HPOptimizer(clean.parameters(), torch.optim.SGD, lr=0.1)
    torch.manual_seed(1)
    fit(1, model, F.cross_entropy, opt, data)
    torch.manual_seed(1)
    fit(1, clean, F.cross_entropy, clean_opt, data)
    for a, b in zip(model.parameters(), clean.parameters()):
        assert torch.equal(a, b)


# -- fits that would train nothing -----------------------------------------------
def test_an_optimizer_over_another_models_parameters_is_refused():
    model, other = make_model(), make_model()
    opt = HPOptimizer(other.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"none of which is a trainable parameter"):
        fit(1, model, F.cross_entropy, opt, make_data())


def test_a_model_on_the_meta_device_is_refused_before_training():
    model = nn.Linear(8, 3, device="meta")
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"'meta' device.*to_empty"):
        fit(1, model, F.cross_entropy, opt, make_data())


# -- loss inputs that torch would broadcast or misread ---------------------------
def regression_data(n=64, bs=16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.1  # shape (n,)
    ds = TensorDataset(x, y)
    return DataBunch(DataLoader(ds, bs), DataLoader(ds, bs), device="cpu")


@pytest.mark.parametrize(
    "loss_func",
    [
        F.mse_loss,
        nn.L1Loss(),
        F.smooth_l1_loss,
        nn.HuberLoss(),
        lambda o, y: ((o - y) ** 2).mean(),
    ],
    ids=["mse", "l1_module", "smooth_l1", "huber_module", "own_loss"],
)
def test_a_loss_whose_inputs_broadcast_is_refused_with_both_shapes(loss_func):
    model = nn.Linear(3, 1)  # (N, 1) against targets (N,): (N, N) if broadcast
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError) as info:
        fit(1, model, loss_func, opt, regression_data())
    text = str(info.value)
    assert "output of shape (16, 1) and targets of shape (16,)" in text
    assert "broadcasts to (16, 16)" in text and "y.reshape(-1, 1)" in text
    assert all(p.grad is None for p in model.parameters())  # before any step


def test_validate_refuses_a_broadcasting_loss_too():
    with pytest.raises(ValueError, match=r"shape \(16, 1\) and targets of shape"):
        validate(nn.Linear(3, 1), regression_data().valid_dl, F.mse_loss)


def test_matching_shapes_and_deliberate_broadcasting_are_left_alone():
    model = nn.Linear(3, 1)
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.05)
    columns = [(x, y.reshape(-1, 1)) for x, y in regression_data().train_dl]
    fit(1, model, F.mse_loss, opt, DataBunch(columns))  # (N, 1) and (N, 1)

    def aligns_itself(out, y):  # (N, 1) and (N,) given, aligned before comparing
        return F.mse_loss(out.squeeze(1), y)

    fit(1, model, aligns_itself, opt, regression_data())

    def per_row(out, y):  # (N, 3) minus (N, 1): only the targets expand
        return (out - y.unsqueeze(-1)).pow(2).mean()

    wide = nn.Linear(3, 3)
    fit(1, wide, per_row, HPOptimizer(wide.parameters(), torch.optim.SGD, lr=0.05),
        regression_data())  # fmt: skip


def test_cross_entropy_with_float_targets_says_to_make_them_long():
    data = make_data()
    floats = [(x, y.float()) for x, y in data.train_dl]
    with pytest.raises(ValueError, match=r"float targets .*class indices.*y\.long\(\)"):
        train(data=DataBunch(floats), epochs=1)


def test_a_class_index_out_of_range_names_it_and_the_number_of_classes():
    x, y = torch.randn(16, 8), torch.arange(16) % 5  # 5 labels, 3 outputs
    with pytest.raises(ValueError, match=r"class index [34] for an output with 3 "):
        train(data=DataBunch([(x, y)]), epochs=1)
    y[0] = -100  # ignore_index: allowed
    train(data=DataBunch([(x, y % 3 - 100 * (y == 0))]), epochs=1)


def test_float64_inputs_to_a_float32_model_say_which_to_convert():
    x, y = torch.randn(16, 8, dtype=torch.float64), torch.randint(0, 3, (16,))
    with pytest.raises(TypeError, match=r"has float32 parameters, got input .*float64"):
        train(data=DataBunch([(x, y)]), epochs=1)

    class Matmul(nn.Module):  # not a torch layer: judged on the whole model
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(8, 3))

        def forward(self, x):
            return x @ self.w

    with pytest.raises(TypeError, match=r"parameters are float32 but the input is "):
        train(model=Matmul(), data=DataBunch([(x, y)]), epochs=1)


def test_a_loss_returning_a_tuple_is_told_to_return_one_total():
    def two_parts(out, y):
        return F.cross_entropy(out, y), out.pow(2).mean()

    with pytest.raises(ValueError, match=r"returned \(Tensor.*sum of the parts"):
        train(loss_func=two_parts, epochs=1)


def test_an_own_loss_that_broadcasts_inside_is_caught_where_it_does():
    def own(out, y):
        return (out - y).abs().mean()

    model = nn.Linear(3, 1)
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError) as info:
        fit(1, model, own, opt, regression_data())
    assert "output of shape (16, 1) and targets of shape (16,). Inside it, 'sub' " in (
        str(info.value)
    )
    assert "which torch broadcasts to (16, 16)" in str(info.value)


def test_a_deliberate_outer_op_of_the_same_rank_is_left_alone():
    def chamfer(out, y):  # out (N, P, 3), y (N, M, 3): every point against every
        d = (out.unsqueeze(2) - y.unsqueeze(1)).pow(2).sum(-1)  # (N, P, M)
        return d.min(2).values.mean() + d.min(1).values.mean()

    class Points(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 5 * 3)

        def forward(self, x):
            return self.lin(x).view(-1, 5, 3)

    clouds = [(torch.randn(4, 8), torch.randn(4, 7, 3)) for _ in range(2)]
    model = Points()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.01)
    fit(1, model, chamfer, opt, DataBunch(clouds))


def test_soft_training_targets_do_not_trouble_class_metrics():
    class MixUp(Callback):  # training targets become class probabilities
        def on_batch_begin(self, last_input, last_target, train):
            if train:
                soft = F.one_hot(last_target, 3).float() * 0.8 + 0.2 / 3
                return {"last_target": soft}

    rec = Recorder()
    train(callbacks=[MixUp(), rec], metrics=[accuracy], epochs=1)
    assert 0 <= rec.metrics[0][0] <= 1


def test_loss_batch_in_a_loop_of_ones_own_checks_nothing_and_never_syncs(
    sync_counter,
):
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    batches = list(make_data().train_dl)
    sync_counter["n"] = 0
    for x, y in batches:
        loss_batch(model, x, y, F.cross_entropy, opt)
    assert sync_counter["n"] == 0


def test_fit_returns_a_history_that_is_the_list_of_its_records():
    from fitlib import History

    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    recorder = Recorder()
    history = fit(2, model, F.cross_entropy, opt, make_data(), [recorder],
                  metrics=[accuracy])  # fmt: skip
    assert type(history) is History and isinstance(history, list)
    assert history == list(history) and history[-1] is history[1]
    assert [r["train_loss"] for r in history] == recorder.train_losses
    assert repr(history).startswith("History(2 epochs: train_loss ")


def test_metrics_that_are_not_a_list_are_refused_naming_the_argument():
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    for name in ("metrics", "train_metrics"):
        with pytest.raises(TypeError, match=(
            rf"fit: {name} must be a list of metrics or None; got accuracy "
            rf"\(function\)\. Fix: .*{name}=\[accuracy\]"
        )):  # fmt: skip
            fit(1, model, F.cross_entropy, opt, make_data(), **{name: accuracy})


# -- caps on batches: fit(train_batches=, valid_batches=) -------------------------
class Count(Callback):
    """Counts the training and validation batches, and notes n_steps and the
    lengths the callbacks see."""

    def on_train_begin(self, n_steps, data):
        lengths = [
            len_or_none(getattr(data, k, None)) for k in ("train_dl", "valid_dl")
        ]
        self.n_steps, self.lengths = n_steps, tuple(lengths)
        self.train = self.valid = 0

    def on_batch_end(self, train):
        self.train += train
        self.valid += not train


def test_caps_train_and_validate_on_the_first_batches_of_each_epoch():
    count = Count()
    train(callbacks=[count], epochs=3, train_batches=3, valid_batches=1)
    assert (count.train, count.valid) == (9, 3)
    assert count.n_steps == 9 and count.lengths == (3, 1)


def test_a_cap_above_the_loaders_length_trains_the_whole_loader():
    count = Count()
    train(callbacks=[count], epochs=1, train_batches=100, valid_batches=100)
    assert (count.train, count.valid, count.n_steps) == (7, 3, 7)


def lrs_of_one_cycle(data, **caps):
    model, recorder = make_model(), Recorder()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    fit(2, model, F.cross_entropy, opt, data,
        [OneCycleScheduler(max_lr=0.1), recorder], **caps)  # fmt: skip
    return recorder.lrs


def test_a_one_cycle_schedule_ends_exactly_at_the_last_step_of_capped_epochs():
    """The lrs of 2 epochs capped at 3 batches are those of a loader of 3."""
    capped = lrs_of_one_cycle(make_data(), train_batches=3)  # 7 batches, capped
    short = lrs_of_one_cycle(make_data(n_train=48))  # 3 batches of 16
    assert capped == short and len(capped) == 6


def test_a_generator_without_a_length_trains_epochs_of_the_caps_batches():
    def stream():  # endless: the cap makes its epochs (Keras's steps_per_epoch)
        g = torch.Generator().manual_seed(0)
        while True:
            x = torch.randn(16, 8, generator=g)
            yield x, (x[:, 0] > 0).long()

    count, model = Count(), make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    data = DataBunch(stream(), device="cpu")
    history = fit(3, model, F.cross_entropy, opt, data, [count], train_batches=4)
    assert len(history) == 3 and count.train == 12
    assert count.n_steps == 12 and count.lengths == (4, None)


def test_a_bad_cap_is_refused_before_training():
    model, data = make_model(), make_data()
    before = [p.clone() for p in model.parameters()]
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"fit: train_batches must be an int >= 1"):
        fit(1, model, F.cross_entropy, opt, data, train_batches=0)
    assert all(map(torch.equal, before, model.parameters()))
