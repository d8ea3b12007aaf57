import pytest
import torch
from helpers import make_data, make_model
from torch import nn
from torch.nn import functional as F  # noqa: N812

from fitlib import Callback, Learner
from fitlib.metrics import accuracy
from fitlib.serialization import atomic_save


def learner(tmp_path, model=None, **kw):
    kw.setdefault("metrics", [accuracy])
    kw.setdefault("progress", False)
    return Learner(
        make_data(), model or make_model(), F.cross_entropy, path=tmp_path, **kw
    )


def body_head_model():
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
    return nn.Sequential(body, nn.Linear(16, 3))


def snapshot(module):
    return [p.detach().clone() for p in module.parameters()]


def changed(before, module):
    return [not torch.equal(a, b) for a, b in zip(before, module.parameters())]


def test_save_load_round_trip_restores_predictions_and_optimizer(tmp_path):
    learn = learner(tmp_path)
    learn.fit(1, lr=1e-2)
    path = learn.save("stage1")
    assert path == tmp_path / "models" / "stage1.pth"
    preds, _ = learn.get_preds()

    fresh = learner(tmp_path, model=make_model(seed=123)).load("stage1")
    assert torch.equal(fresh.get_preds()[0], preds)
    saved, loaded = learn.opt.state_dict(), fresh.opt.state_dict()
    assert saved["opt"]["param_groups"] == loaded["opt"]["param_groups"]
    for k, state in saved["opt"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, loaded["opt"]["state"][k][name])


@pytest.mark.filterwarnings("ignore:MixedPrecision.float16. on the CPU")
def test_save_keeps_the_loss_scale_and_load_gives_it_back(tmp_path):
    learn = learner(tmp_path, opt_func=torch.optim.SGD).to_fp16()
    learn.callbacks[0].scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    learn.fit(1, lr=1e-2)
    scale = learn.callbacks[0].scaler.get_scale()
    learn.save("fp16")
    fresh = learner(tmp_path, opt_func=torch.optim.SGD).to_fp16().load("fp16")
    assert fresh.callbacks[0].state_dict() == learn.callbacks[0].state_dict()
    fresh.fit(1, lr=1e-2)  # the scaler starts from the loaded scale
    assert fresh.callbacks[0].scaler.get_scale() == scale
    # In float32 the saved scale is not needed.
    learner(tmp_path, opt_func=torch.optim.SGD).load("fp16")


def test_loading_into_a_different_model_lists_the_keys(tmp_path):
    learn = learner(tmp_path)
    learn.save("m")
    other = learner(tmp_path, model=nn.Sequential(nn.Linear(8, 3)))
    with pytest.raises(ValueError, match="different model") as info:
        other.load("m")
    assert "unexpected keys: 1.bias" in str(info.value)
    assert "0.weight: saved (16, 8) vs model (3, 8)" in str(info.value)


def test_loading_a_truncated_file_is_a_clear_error(tmp_path):
    learn = learner(tmp_path)
    path = learn.save("m")
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match="truncated, corrupt"):
        learn.load("m")
    with pytest.raises(FileNotFoundError, match="call save"):
        learn.load("missing")


def test_a_failed_save_leaves_the_previous_file_intact(tmp_path, monkeypatch):
    path = atomic_save({"v": torch.ones(2)}, tmp_path / "state.pth")

    def crash(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        atomic_save({"v": torch.zeros(2)}, path)
    monkeypatch.undo()
    assert torch.equal(torch.load(path, weights_only=True)["v"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["state.pth"]


def test_get_preds_matches_a_manual_pass(tmp_path):
    learn = learner(tmp_path)
    learn.fit(1)
    preds, targets = learn.get_preds()
    x, y = learn.data.valid_dl.dataset.tensors
    learn.model.eval()
    with torch.no_grad():
        expected = learn.model(x)
    torch.testing.assert_close(preds, expected)
    assert torch.equal(targets, y)
    probs, _ = learn.get_preds(activation=lambda o: o.softmax(-1))
    torch.testing.assert_close(probs, expected.softmax(-1))


def test_predict_takes_one_item_or_a_batch(tmp_path):
    learn = learner(tmp_path)
    x = learn.data.valid_dl.dataset.tensors[0][:5]
    batch = learn.predict(x)
    one = learn.predict(x[2])
    assert batch.shape == (5, 3) and one.shape == (3,)
    torch.testing.assert_close(one, batch[2])


def test_validate_returns_named_loss_and_metrics(tmp_path):
    learn = learner(tmp_path)
    result = learn.validate()
    assert list(result) == ["valid_loss", "accuracy"]
    preds, targets = learn.get_preds()
    assert result["valid_loss"] == pytest.approx(F.cross_entropy(preds, targets).item())
    assert result["accuracy"] == pytest.approx(accuracy(preds, targets).item())


def test_optimizer_and_its_state_survive_repeated_fits(tmp_path):
    learn = learner(tmp_path)
    learn.fit(1, lr=1e-2)
    opt = learn.opt
    steps = [s["step"].item() for s in opt.state.values()]
    learn.fit(1, lr=1e-3)
    assert learn.opt is opt and opt.lr == 1e-3
    assert [s["step"].item() for s in opt.state.values()] == [2 * n for n in steps]


def test_freeze_trains_only_the_head_and_norm_layers(tmp_path):
    model = body_head_model()
    body, head = model[0], model[1]
    learn = learner(tmp_path, model=model, layer_groups=[body, head])
    learn.freeze()
    linear, norm, head_before = snapshot(body[0]), snapshot(body[1]), snapshot(head)
    learn.fit(1, lr=1e-2)
    assert not any(changed(linear, body[0]))
    assert all(changed(norm, body[1]))  # train_bn keeps norm layers trainable
    assert all(changed(head_before, head))

    learn.unfreeze()
    linear = snapshot(body[0])
    learn.fit(1, lr=1e-2)
    assert all(changed(linear, body[0]))


def test_freeze_with_train_bn_false_freezes_norm_layers_too(tmp_path):
    model = body_head_model()
    learn = learner(
        tmp_path, model=model, layer_groups=[model[0], model[1]], train_bn=False
    )
    learn.freeze()
    norm = snapshot(model[0][1])
    learn.fit(1)
    assert not any(changed(norm, model[0][1]))


def test_discriminative_learning_rates_from_a_slice(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3))
    learn = learner(tmp_path, model=model, layer_groups=list(model))
    learn.fit(1, lr=slice(1e-4, 1e-2))
    assert learn.opt.lr == pytest.approx([1e-4, 1e-3, 1e-2])
    assert learn.lr_range(slice(1e-2)) == pytest.approx([1e-3, 1e-3, 1e-2])
    with pytest.raises(ValueError, match="got 2 values"):
        learn.fit(1, lr=[1e-3, 1e-2])


def test_default_metric_for_cross_entropy_is_accuracy_and_said_once(capsys, tmp_path):
    import fitlib.learner

    fitlib.learner._said.clear()
    learn = learner(tmp_path, metrics=None)
    Learner(make_data(), make_model(), F.cross_entropy, progress=False)
    assert learn.metrics == [accuracy]
    assert capsys.readouterr().out.count("reporting accuracy") == 1
    regression = Learner(make_data(), nn.Linear(8, 1), F.mse_loss, progress=False)
    assert regression.metrics == []


@pytest.mark.parametrize("lr", [0, -1e-3])
def test_non_positive_lr_is_rejected_before_training(tmp_path, lr):
    learn = learner(tmp_path)
    before = snapshot(learn.model)
    with pytest.raises(ValueError, match=rf"lr must be > 0: .*got {lr!r}"):
        learn.fit(1, lr=lr)
    assert not any(changed(before, learn.model))


def test_learner_needs_data_with_train_dl_and_a_loss(tmp_path):
    with pytest.raises(TypeError, match="train_dl attribute"):
        Learner([1, 2], make_model(), F.cross_entropy)
    with pytest.raises(TypeError, match="loss_func must be callable"):
        Learner(make_data(), make_model(), "cross_entropy")
    # No loss_func: the model's own loss, which a plain model has not.
    learn = Learner(make_data(), make_model(), progress=False)
    with pytest.raises(ValueError, match=r"loss_func=None.*no loss.*pass a loss_func"):
        learn.fit(1)


def test_progress_bar_is_on_by_default_and_easy_to_turn_off(tmp_path):
    from fitlib.callbacks import ProgressBar, Recorder

    learn = learner(tmp_path, progress=True)
    names = [type(cb) for cb in learn._callbacks(None)]
    assert names == [Recorder, ProgressBar]
    learn.progress = False
    assert [type(cb) for cb in learn._callbacks(None)] == [Recorder]


def test_repr_says_what_the_learner_holds(tmp_path):
    text = repr(learner(tmp_path))
    assert text.startswith("Learner(Sequential, loss_func=cross_entropy")
    assert "opt_func=AdamW" in text and "metrics=['accuracy']" in text
    assert "DataBunch(7 train batches, 3 valid batches, device=cpu)" in text


def test_freeze_with_a_single_layer_group_says_how_to_split_the_model(tmp_path):
    with pytest.raises(ValueError, match=r"1 layer group.*layer_groups=\[body, head\]"):
        learner(tmp_path).freeze()


def test_a_second_fit_works_with_an_optimizer_without_weight_decay(tmp_path):
    learn = learner(tmp_path, opt_func=torch.optim.Rprop, wd=0.0, true_wd=False)
    learn.fit(1, lr=1e-2)
    before = snapshot(learn.model)
    learn.fit(1, lr=1e-2)
    assert any(changed(before, learn.model))


def test_get_preds_of_a_model_with_two_outputs_gives_a_tuple(tmp_path):
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 3), nn.Linear(8, 2)

        def forward(self, x):
            return self.a(x), self.b(x)

    def first_head_loss(out, y):
        return F.cross_entropy(out[0], y)

    learn = Learner(make_data(), TwoHeads(), first_head_loss, progress=False)
    (a, b), targets = learn.get_preds()
    assert a.shape == (37, 3) and b.shape == (37, 2) and targets.shape == (37,)


def test_predict_with_an_iterable_dataset_treats_input_as_a_batch(tmp_path):
    from torch.utils.data import DataLoader, IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            g = torch.Generator().manual_seed(0)
            for _ in range(32):
                yield torch.randn(8, generator=g), torch.tensor(1)

    data = make_data()
    data.valid_dl = DataLoader(Stream(), 8)
    learn = Learner(data, make_model(), F.cross_entropy, progress=False)
    assert learn.predict(torch.randn(4, 8)).shape == (4, 3)


# -- save and load: optimizer checks and file modes --------------------------------
def test_load_refuses_another_optimizers_state_before_changing_anything(tmp_path):
    sgd = learner(tmp_path, opt_func=torch.optim.SGD)
    sgd.fit(1, lr=1e-2)
    sgd.save("sgd")
    adamw = learner(tmp_path, model=make_model(seed=1), opt_func=torch.optim.AdamW)
    before = snapshot(adamw.model)
    with pytest.raises(ValueError, match="the file's SGD, this Learner's AdamW") as e:
        adamw.load("sgd")
    assert "with_opt=False" in str(e.value)
    assert not any(changed(before, adamw.model))  # refused before loading
    assert "betas" in adamw.opt.param_groups[0]
    adamw.load("sgd", with_opt=False)  # the weights alone load
    assert not any(changed(snapshot(sgd.model), adamw.model))


def test_load_refuses_another_number_of_layer_groups(tmp_path):
    one = learner(tmp_path, model=body_head_model())
    one.create_opt(1e-2)  # the optimizer is saved with the weights
    one.save("one_group")
    model = body_head_model()
    two = learner(tmp_path, model=model, layer_groups=[model[0], model[1]])
    with pytest.raises(ValueError, match="parameter groups: the file's 1, this"):
        two.load("one_group")


def test_load_refuses_an_older_file_of_another_optimizer(tmp_path):
    sgd = learner(tmp_path, opt_func=torch.optim.SGD)
    sgd.create_opt(1e-2)
    path = sgd.save("sgd")
    state = torch.load(path, weights_only=True)
    state.pop("opt_identity", None)  # as fitlib wrote it before
    atomic_save(state, path)
    adamw = learner(tmp_path, opt_func=torch.optim.AdamW)
    with pytest.raises(ValueError, match=r"hyper-parameters: .*'momentum'.*'betas'"):
        adamw.load("sgd")


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600)])
def test_saved_files_get_the_mode_open_gives_under_the_umask(tmp_path, umask, mode):
    import os
    import stat

    learn = learner(tmp_path)
    old = os.umask(umask)
    try:
        path = learn.save("m")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == mode
    path.chmod(0o640)
    learn.save("m")  # an overwrite keeps the file's mode, as open() would
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


# -- defaults are said; bad arguments are refused before training ---------------
def test_the_defaults_the_learner_picks_are_said_once_each(capsys, tmp_path):
    import fitlib.learner

    fitlib.learner._said.clear()
    learn = learner(tmp_path)
    learner(tmp_path)
    out = capsys.readouterr().out
    assert out.count("no opt_func given; using torch.optim.AdamW") == 1
    assert out.count("no wd given; using weight decay 0.01") == 1
    learn.fit(1)
    learn.fit(1)
    assert capsys.readouterr().out.count("no lr given; training at lr=1e-3") == 1
    assert learn.opt.lr == 1e-3 and learn.opt.wd == 0.01
    assert isinstance(learn.opt.opt, torch.optim.AdamW)
    fitlib.learner._said.clear()
    learner(tmp_path, opt_func=torch.optim.SGD, wd=0.0).fit(1, lr=0.1)
    assert "fitlib: no" not in capsys.readouterr().out


def test_bad_learner_arguments_are_refused_naming_them(tmp_path):
    with pytest.raises(TypeError, match=r"opt_func must be a torch optimizer .*'adam'"):
        learner(tmp_path, opt_func="adam")
    with pytest.raises(
        TypeError,
        match=r"wd must be a number.*got '0\.01' \(str\)\. Fix: .*Learner\(\.\.\., wd=",
    ):
        learner(tmp_path, wd="0.01")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=r"path '.*notes\.txt' is a file"):
        Learner(make_data(), make_model(), F.cross_entropy, path=a_file)
    with pytest.raises(ValueError, match=r"only 1 parameter group"):
        learner(tmp_path).fit(1, lr=slice(1e-4, 1e-2))


def test_one_callback_is_accepted_where_a_list_is_expected(tmp_path):
    from fitlib.callbacks import Recorder

    extra = Recorder()
    learn = Learner(make_data(), make_model(), F.cross_entropy, callbacks=extra,
                    progress=False, path=tmp_path)  # fmt: skip
    learn.fit(1, lr=1e-2, callbacks=Recorder())
    assert learn.callbacks == [extra] and len(extra.losses) == 7


# -- evaluation inside training leaves training as it was ------------------------
def test_evaluating_inside_fit_snapshots_leaves_the_model_training(tmp_path):
    learn = learner(tmp_path)
    modes = []

    class Probe(Callback):
        def on_batch_begin(self, train, model):
            if train:
                modes.append(model.training)

    item = learn.data.valid_dl.dataset[0][0]
    for _ in learn.fit_snapshots(12, every=3, lr=1e-2, callbacks=[Probe()]):
        learn.validate()
        learn.get_preds()
        learn.predict(item)
    assert len(modes) == 12 and all(modes), modes
    learn.model.eval()
    learn.validate(), learn.predict(item)
    assert not any(m.training for m in learn.model.modules())


@pytest.mark.parametrize("name", ["progress", "train_bn"])
def test_a_flag_that_is_not_a_bool_is_refused(name):
    with pytest.raises(TypeError, match=rf"{name} must be True or False; got 'no'"):
        Learner(make_data(), make_model(), F.cross_entropy, **{name: "no"})


# -- save and load: flags and the path ----------------------------------------------
@pytest.mark.parametrize("method", ["save", "load"])
def test_with_opt_that_is_not_a_bool_is_refused(tmp_path, method):
    learn = learner(tmp_path)
    learn.save("m")
    with pytest.raises(TypeError, match=rf"{method}: with_opt must be True or False; "
                       r"got 'no' \(str\)\. Fix: e\.g\."):  # fmt: skip
        getattr(learn, method)("m", with_opt="no")


def test_a_path_assigned_as_a_string_is_a_path(tmp_path):
    learn = learner(tmp_path / "a")
    learn.path = str(tmp_path / "b")
    assert learn.path == tmp_path / "b"
    assert learn.save("m") == tmp_path / "b" / "models" / "m.pth"
    learn.load("m")
    with pytest.raises(TypeError, match=r"Learner: path must be .*got 3 \(int\)"):
        learn.path = 3
    assert learn.path == tmp_path / "b"  # unchanged by the refused value


@pytest.mark.parametrize("name", ["metrics", "train_metrics"])
def test_metrics_that_are_not_a_list_are_refused_by_the_learner(tmp_path, name):
    with pytest.raises(TypeError, match=(
        rf"Learner: {name} must be a list of metrics or None; got accuracy "
        rf"\(function\)\. Fix: e\.g\. Learner\(\.\.\., {name}=\[accuracy\]\)"
    )):  # fmt: skip
        learner(tmp_path, **{name: accuracy})


def test_loading_a_directory_says_what_it_is(tmp_path):
    (tmp_path / "models" / "m.pth").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"m\.pth' is a directory, not a file"):
        learner(tmp_path).load("m")


def test_an_empty_path_or_an_empty_dict_of_optimizers_is_refused():
    model = make_model()
    with pytest.raises(ValueError, match=r"Learner: path must be a directory path"):
        Learner(make_data(), model, F.cross_entropy, path="")
    with pytest.raises(ValueError, match="opt_func"):
        Learner(make_data(), model, F.cross_entropy, opt_func={})


def test_evaluations_inside_a_fit_change_neither_the_order_nor_the_weights(tmp_path):
    def train(evaluate):
        torch.manual_seed(1)
        learn = learner(tmp_path, opt_func=torch.optim.SGD)  # shuffled train_dl
        for _ in learn.fit_snapshots(12, every=3, lr=0.1):
            if evaluate:
                state = torch.get_rng_state()
                learn.validate()
                learn.get_preds()
                learn.predict(torch.zeros(8))
                assert torch.equal(state, torch.get_rng_state())
        return snapshot(learn.model)

    assert all(map(torch.equal, train(False), train(True)))


def test_metrics_set_on_the_learner_as_one_metric_say_the_attribute_fix(tmp_path):
    learn = learner(tmp_path)
    learn.metrics = accuracy
    fix = (
        r"Learner: metrics must be a list.*got accuracy.*learn\.metrics = \[accuracy\]"
    )
    with pytest.raises(TypeError, match=fix):
        learn.fit(1)
    with pytest.raises(TypeError, match=fix):
        learn.validate()
    learn.metrics, learn.train_metrics = [], accuracy
    with pytest.raises(TypeError, match=r"learn\.train_metrics = \[accuracy\]"):
        learn.fit(1)


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 4)

    def forward(self, x):
        h = self.body(x)
        return {"a": h[:, :3], "b": h[:, 3:]}


def test_a_dict_of_losses_and_their_weights_reach_every_record():
    data = make_data()
    from fitlib import DataBunch

    twin = DataBunch(data.train_dl, data.valid_dl,
                     batch_fn=lambda b: (b[0], (b[1], b[0][:, :1])))  # fmt: skip
    losses = {"a": F.cross_entropy, "b": F.mse_loss}
    learn = Learner(twin, _TwoHeads(), losses, loss_weights={"b": 0.0},
                    metrics=[], progress=False)  # fmt: skip
    record = learn.fit(1, lr=0.1)[-1]
    assert {"train_a", "train_b", "valid_a", "valid_b"} <= record.keys()
    # b weighs 0: the loss is a's alone
    assert record["valid_loss"] == pytest.approx(record["valid_a"])
    with pytest.raises(TypeError, match=r"loss_weights=.*needs several losses"):
        Learner(data, make_model(), F.cross_entropy, loss_weights={"a": 1})


def test_every_fit_method_takes_the_time_budget_and_the_batch_caps():
    seen = []

    class Count(Callback):
        def on_batch_end(self, train):
            seen.append(train)

    learn = Learner(make_data(), make_model(), F.cross_entropy, progress=False)
    for method in (learn.fit, learn.fit_one_cycle, learn.fit_flat_cos,
                   learn.fit_warmup_cos):  # fmt: skip
        seen.clear()
        method(1, callbacks=[Count()], train_batches=1, valid_batches=1)
        assert seen == [True, False], method.__name__
    seen.clear()
    list(learn.fit_snapshots(2, every=1, callbacks=[Count()], train_batches=1))
    assert seen.count(True) == 2
    history = learn.fit(3, lr=0.1, max_time=1e-9)
    assert history.stop_reason.startswith("max_time=") and len(history) == 0


def test_find_batch_size_trains_with_the_learners_precision_and_puts_all_back(capsys):
    def learner():
        data, model = make_data(n_train=400), make_model()
        return Learner(data, model, F.cross_entropy, progress=False, metrics=[],
                       opt_func=torch.optim.Adam)  # fmt: skip

    full, half = learner(), learner().to_bf16()
    before = {k: v.clone() for k, v in half.model.state_dict().items()}
    sizes = [learn.find_batch_size(max_memory="30kB", mode="binsearch").batch_size
             for learn in (full, half)]  # fmt: skip
    assert sizes[1] > sizes[0]  # bfloat16 activations take less memory
    pairs = zip(before.values(), half.model.state_dict().values())
    assert all(torch.equal(a, b) for a, b in pairs) and half.opt is None
    assert capsys.readouterr().out.count("find_batch_size: batch size ") == 2
    found = half.find_batch_size(max_memory="30kB", mode="binsearch", apply=True)
    assert half.data.train_dl.batch_size == found.batch_size == sizes[1]


def test_find_batch_size_counts_what_callbacks_left_out_of_the_trials_hold(capsys):
    """EMA is left out of the trials (its average would be thrown away), but
    the real fit holds its average: the trials count those bytes as held,
    and verbose=False, as the function takes it, prints nothing."""
    from fitlib.callbacks import EMA

    def learner(*callbacks):
        return Learner(make_data(n_train=400), make_model(), F.cross_entropy,
                       progress=False, metrics=[], opt_func=torch.optim.Adam,
                       wd=0.01, callbacks=list(callbacks))  # fmt: skip

    ema = EMA(decay=0.9)
    plain, averaged = learner(), learner(ema)
    found = [learn.find_batch_size(max_memory="1GB", max_batch_size=8, verbose=False)
             for learn in (plain, averaged)]  # fmt: skip
    assert capsys.readouterr().out == ""
    averaged.fit(1, 1e-3)  # what the average really takes
    held = sum(t.untyped_storage().nbytes() for t in ema.average.averages)
    assert held > 0
    assert [b.peak - a.peak for a, b in zip(*(f.trials for f in found))] == [held] * 3


def test_cuda_graph_replaces_an_earlier_one_and_a_bad_warmup_changes_nothing():
    from fitlib.callbacks import CudaGraph, GradientClipping

    clip = GradientClipping(max_norm=1.0)
    learn = Learner(make_data(), make_model(), F.cross_entropy, callbacks=[clip])
    assert learn.cuda_graph() is learn
    learn.cuda_graph(warmup=7)  # replaces the first: one graph per fit
    assert [repr(cb) for cb in learn.callbacks] == [repr(clip), "CudaGraph(warmup=7)"]
    before = list(learn.callbacks)
    with pytest.raises(ValueError, match=r"CudaGraph: warmup must be an int >= 1"):
        learn.cuda_graph(warmup=0)
    assert learn.callbacks == before and learn.callbacks[1].warmup == 7
    assert sum(isinstance(cb, CudaGraph) for cb in learn.callbacks) == 1
