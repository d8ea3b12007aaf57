"""Several optimizers in one fit: a MultiOptimizer, one optimizer per part."""

import copy
import warnings
from functools import partial

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from helpers import make_dataset
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

from fitlib import Callback, DataBunch, HPOptimizer, Learner, MultiOptimizer, fit
from fitlib.callbacks import (
    Checkpoint,
    GradientAccumulation,
    GradientClipping,
    MixedPrecision,
    OneCycleScheduler,
    ParamScheduler,
    ReduceLROnPlateau,
    TrainStats,
)
from fitlib.callbacks.schedule import constant, linear
from fitlib.tracking import optimizer_params

SGD_MOM = partial(torch.optim.SGD, momentum=0.9)


class EncDec(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.decoder = nn.Linear(16, 3)

    def forward(self, x):
        return self.decoder(torch.relu(self.encoder(x)))


def data(valid=False):
    train = DataLoader(make_dataset(96), 16, shuffle=True)
    return DataBunch(train, DataLoader(make_dataset(32, seed=1), 16) if valid else None)


def two_opts(model, lr_enc=1e-2, lr_dec=0.1):
    return {
        "encoder": torch.optim.Adam(model.encoder.parameters(), lr=lr_enc),
        "decoder": torch.optim.SGD(model.decoder.parameters(), lr=lr_dec, momentum=0.9),
    }


def hand_written(epochs=2):
    """The loop a user writes for two optimizers: step both, zero both."""
    model = EncDec()
    opts = two_opts(model)
    torch.manual_seed(1)
    for _ in range(epochs):
        model.train()
        for xb, yb in data().train_dl:
            F.cross_entropy(model(xb), yb).backward()
            for opt in opts.values():
                opt.step()
            for opt in opts.values():
                opt.zero_grad()
    return model


def learner(**kwargs):
    kwargs = {"opt_func": {"encoder": torch.optim.Adam, "decoder": SGD_MOM}} | kwargs
    kwargs = {"progress": False, "metrics": [], "wd": 0.0, **kwargs}
    return Learner(data(valid=True), EncDec(), F.cross_entropy, **kwargs)


def assert_same_weights(a, b):
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name


# -- training equals the hand-written loop -------------------------------------
def test_fit_with_a_dict_of_optimizers_matches_a_hand_written_loop_bit_for_bit():
    model = EncDec()
    opts = two_opts(model)
    torch.manual_seed(1)
    fit(2, model, F.cross_entropy, opts, data())
    assert_same_weights(model, hand_written())


def test_learner_with_an_optimizer_class_per_part_matches_the_hand_written_loop():
    learn = learner(true_wd=False)
    learn.data = data()
    torch.manual_seed(1)
    learn.fit(2, lr={"encoder": 1e-2, "decoder": 0.1})
    assert isinstance(learn.opt, MultiOptimizer)
    assert type(learn.opt["encoder"].opt) is torch.optim.Adam
    assert type(learn.opt["decoder"].opt) is torch.optim.SGD
    assert_same_weights(learn.model, hand_written())


def test_a_list_of_optimizers_trains_each_as_its_own_part():
    model = EncDec()
    opts = list(two_opts(model).values())
    torch.manual_seed(1)
    fit(2, model, F.cross_entropy, opts, data())
    assert_same_weights(model, hand_written())


# -- hyper-parameters ----------------------------------------------------------
def test_hyper_parameters_are_read_and_set_for_every_part_or_one():
    model = EncDec()
    opt = MultiOptimizer(two_opts(model))
    assert opt.lr == [1e-2, 0.1] and opt.mom == 0.9  # Adam's beta1, SGD's momentum
    opt.mom = 0.8  # every part, each under its own key
    assert opt["encoder"].opt.param_groups[0]["betas"][0] == 0.8
    assert opt["decoder"].opt.param_groups[0]["momentum"] == 0.8
    opt.lr = {"decoder": 0.05}  # one part by name
    assert opt.lr == [1e-2, 0.05]
    opt["encoder"].lr = 3e-3
    assert opt.lr == [3e-3, 0.05]
    opt.lr = torch.tensor(0.02)  # a 0-dim tensor is one number, as for HPOptimizer
    assert opt.lr == pytest.approx(0.02)
    opt.lr = [3e-3, 0.05]  # one value per group, over the parts in order
    opt.set("beta", {"encoder": 0.95})  # where the part has it
    assert opt["encoder"].beta == 0.95
    with pytest.raises(
        ValueError, match=r"'decoder': 'SGD'.*no hyper-parameter 'beta'"
    ):
        opt.beta = 0.99


def test_discriminative_rates_and_layer_groups_work_inside_a_part():
    model = EncDec()
    groups = {"encoder": [model.encoder[0], model.encoder[2]]}
    learn = Learner(data(), model, F.cross_entropy, progress=False, metrics=[],
                    opt_func={"encoder": torch.optim.Adam, "decoder": SGD_MOM},
                    layer_groups=groups)  # fmt: skip
    learn.fit(1, lr={"encoder": slice(1e-4, 1e-2), "decoder": 0.1})
    assert learn.opt.lr == pytest.approx([1e-4, 1e-2, 0.1])
    assert len(learn.layer_groups) == 3
    learn.freeze()  # every group but the last (the decoder) frozen
    assert not any(p.requires_grad for p in model.encoder.parameters())
    assert all(p.requires_grad for p in model.decoder.parameters())


# -- callbacks see every optimizer ---------------------------------------------
class Rates(Callback):
    """Each step's rates and momentums of both parts, as the step used them."""

    def __init__(self):
        self.seen = []

    def on_backward_end(self, opt):
        self.seen.append((opt["encoder"].lr, opt["decoder"].lr, opt.mom))


def test_one_cycle_schedules_every_part_from_its_own_peak_and_momentum_by_name():
    rates = Rates()
    learn = learner(callbacks=[rates])
    learn.fit_one_cycle(2, lr={"encoder": 1e-3, "decoder": 0.1})
    enc, dec, moms = zip(*rates.seen)
    assert max(enc) == pytest.approx(1e-3, rel=0.01)  # (12 steps: near the peak)
    assert [d / e for e, d in zip(enc, dec)] == pytest.approx([100] * len(enc))
    assert moms[0] == pytest.approx(0.95) and min(moms) == pytest.approx(0.85, rel=0.01)


def test_a_scheduler_of_one_part_leaves_the_other_alone():
    rates = Rates()
    sched = ParamScheduler({"lr": linear(0.1, 0.01)}, part="decoder")
    enc_sched = ParamScheduler({"lr": constant(2e-3)}, part="encoder")
    learner(callbacks=[rates, sched, enc_sched]).fit(2, lr=1e-3)
    enc, dec, _ = zip(*rates.seen)
    assert set(enc) == {2e-3}
    assert dec[0] == pytest.approx(0.1) and dec[-1] == pytest.approx(0.01)


def test_a_schedule_of_every_part_and_one_of_a_part_on_the_same_value_is_refused():
    both = [ParamScheduler({"lr": constant(0.1)}),
            ParamScheduler({"lr": constant(0.1)}, part="decoder")]  # fmt: skip
    with pytest.raises(ValueError, match="both set 'lr'"):
        learner().fit(1, callbacks=both)


def test_lr_find_puts_every_optimizer_back():
    learn = learner()
    learn.fit(1, lr=1e-3)
    before = copy.deepcopy(learn.opt.state_dict())
    weights = copy.deepcopy(learn.model.state_dict())
    learn.lr_find(num_it=10)
    after = learn.opt.state_dict()
    for name in ("encoder", "decoder"):
        saved, now = before["parts"][name]["opt"], after["parts"][name]["opt"]
        assert saved["param_groups"] == now["param_groups"]
        for i, state in saved["state"].items():
            for key, value in state.items():
                assert torch.equal(value, now["state"][i][key]), (name, key)
    assert_same_weights(learn.model, _loaded(weights))


def _loaded(state):
    model = EncDec()
    model.load_state_dict(state)
    return model


class InfInDecoder(Callback):
    """Makes one decoder gradient infinite at the first step, before
    MixedPrecision unscales (order -25)."""

    order = -25

    def on_backward_end(self, model, iteration):
        if iteration == 0:
            grad = model.decoder.weight.grad
            grad[0, 0] = float("inf")


def test_float16_skips_every_part_when_one_part_overflows():
    mp = MixedPrecision(torch.float16)
    learn = learner(callbacks=[mp, InfInDecoder()])
    learn.data = data()
    encoder = copy.deepcopy(learn.model.encoder.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # float16 on the CPU
        learn.fit(1, lr=1e-2, max_steps=1)
    assert mp.skipped_steps == 1
    for k, v in encoder.items():  # the encoder's finite step was skipped too
        assert torch.equal(learn.model.encoder.state_dict()[k], v), k
    assert learn.opt.grad_scaler is None  # detached after the fit, from every part


class Norm(Callback):
    order = -5  # after GradientClipping (-10), before the step

    def __init__(self):
        self.norms = []

    def on_backward_end(self, model):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.cat(
            [g.flatten() for g in grads]))))  # fmt: skip


def test_clipping_clips_the_gradients_of_every_part_together():
    norm = Norm()
    learner(callbacks=[GradientClipping(0.05), norm]).fit(1, lr=1e-3)
    assert max(norm.norms) == pytest.approx(0.05, rel=1e-4)


def test_accumulation_steps_every_part_once_per_n_batches():
    adams = {"encoder": torch.optim.Adam, "decoder": torch.optim.AdamW}
    learn = learner(opt_func=adams, callbacks=[GradientAccumulation(3)])
    learn.fit(1, lr=1e-3)  # 6 batches: 2 steps
    for part in ("encoder", "decoder"):
        states = learn.opt[part].state.values()
        assert {int(s["step"]) for s in states} == {2}, part


def test_save_and_load_restore_every_part(tmp_path):
    learn = learner(path=tmp_path)
    learn.fit(1, lr={"encoder": 1e-3, "decoder": 0.05})
    learn.save("two")
    other = learner(path=tmp_path).load("two")
    assert other.opt.lr == [1e-3, 0.05]
    saved, loaded = learn.opt.state_dict(), other.opt.state_dict()
    for name in ("encoder", "decoder"):
        for i, state in saved["parts"][name]["opt"]["state"].items():
            for key, value in state.items():
                got = loaded["parts"][name]["opt"]["state"][i][key]
                assert torch.equal(value, got), (name, key)


def test_loading_a_one_optimizer_file_into_parts_is_refused(tmp_path):
    one = learner(path=tmp_path, opt_func=torch.optim.Adam)
    one.fit(1, lr=1e-3)
    one.save("one")
    with pytest.raises(
        ValueError, match=r"MultiOptimizer\(encoder=Adam, decoder=SGD\)"
    ):
        learner(path=tmp_path).load("one")


# -- bad input, before training ------------------------------------------------
def test_parts_that_overlap_are_refused():
    with pytest.raises(ValueError, match=r"parts 'encoder' and 'encoder\.0' overlap"):
        learner(opt_func={"encoder": torch.optim.Adam, "encoder.0": torch.optim.SGD,
                          "decoder": torch.optim.SGD})  # fmt: skip
    model = EncDec()
    shared = list(model.parameters())
    with pytest.raises(ValueError, match="share a parameter"):
        MultiOptimizer(
            {
                "a": HPOptimizer(shared, torch.optim.SGD, lr=0.1),
                "b": HPOptimizer(shared[:1], torch.optim.SGD, lr=1),
            }
        )


def test_parameters_in_no_part_are_refused_in_the_learner_and_in_fit():
    with pytest.raises(ValueError, match=r"in no part.*decoder.weight"):
        learner(opt_func={"encoder": torch.optim.Adam})
    model = EncDec()
    only_encoder = {"encoder": torch.optim.Adam(model.encoder.parameters())}
    with pytest.raises(ValueError, match=r"in no part.*decoder.weight"):
        fit(1, model, F.cross_entropy, only_encoder, data())


def test_a_part_naming_no_submodule_is_refused_with_the_children():
    with pytest.raises(
        ValueError, match=r"no submodule 'decodr'.*\['encoder', 'decoder'\]"
    ):
        learner(opt_func={"encoder": torch.optim.Adam, "decodr": torch.optim.SGD})


def test_a_hyper_parameter_scheduled_on_a_part_without_it_is_refused_before_training():
    learn = learner()
    with pytest.raises(ValueError, match=r"schedules \['beta'\].*\['decoder'\]"):
        learn.fit(1, callbacks=[ParamScheduler({"beta": constant(0.99)})])
    assert learn.recorder.iterations == []


def test_a_rate_per_part_that_leaves_one_out_or_names_none_is_refused():
    with pytest.raises(ValueError, match=r"leaves out \['decoder'\]"):
        learner().fit(1, lr={"encoder": 1e-3})
    with pytest.raises(ValueError, match=r"names no part \['head'\]"):
        learner().fit(1, lr={"encoder": 1e-3, "decoder": 0.1, "head": 1.0})
    one = learner(opt_func=torch.optim.Adam)
    with pytest.raises(ValueError, match="gives a value per part"):
        one.fit(1, lr={"encoder": 1e-3, "decoder": 0.1})


def test_a_weight_decay_per_part_that_leaves_one_out_is_refused_in_fit_too():
    learn = learner()
    with pytest.raises(ValueError, match=r"wd: the dict leaves out \['decoder'\]"):
        learn.fit(1, lr=1e-3, wd={"encoder": 1e-3})
    learn.fit(1, lr=1e-3, wd={"encoder": 1e-3, "decoder": 0.0})
    assert learn.opt.wd == [1e-3, 0.0]


def test_a_slice_for_a_part_of_one_group_says_how_to_split_that_part():
    with pytest.raises(ValueError, match=r"layer_groups=\{'encoder': \[body, head\]\}"):
        learner().fit(1, lr={"encoder": slice(1e-4, 1e-2), "decoder": 0.1})


# -- found in review -----------------------------------------------------------
def test_reduce_lr_on_plateau_reduces_every_part():
    plateau = ReduceLROnPlateau(
        monitor="valid_loss", patience=0, min_delta=10.0, factor=0.2
    )
    learn = learner(callbacks=[plateau])
    learn.fit(2, lr={"encoder": 1e-3, "decoder": 0.1})
    assert learn.opt.lr == pytest.approx([2e-4, 0.02])  # after epoch 0 (none after 1)


def test_a_part_schedule_does_not_stop_a_checkpoint_from_resuming(tmp_path):
    def make(crash_at=None):
        sched = ParamScheduler({"lr": linear(0.1, 0.01)}, part="decoder")
        extra = [Crash(crash_at)] if crash_at is not None else []
        return learner(callbacks=[Checkpoint(tmp_path / "ck"), sched, *extra])

    ref = learner(callbacks=[ParamScheduler({"lr": linear(0.1, 0.01)}, part="decoder")])
    ref.fit(3, lr=1e-3)
    with pytest.raises(RuntimeError, match="crash"):
        make(crash_at=8).fit(3, lr=1e-3)
    resumed = make()
    resumed.fit(3, lr=1e-3)  # not refused as "another run"
    assert_same_weights(resumed.model, ref.model)


class Crash(Callback):
    def __init__(self, at):
        self.at = at

    def on_batch_begin(self, iteration, train):
        if train and iteration == self.at:
            raise RuntimeError("crash")


def test_frozen_parameters_may_be_in_no_part():
    model = EncDec()
    model.encoder.requires_grad_(False)
    learn = Learner(data(), model, F.cross_entropy, progress=False, metrics=[],
                    opt_func={"decoder": torch.optim.SGD})  # fmt: skip
    learn.fit(1, lr=0.1)
    assert learn.opt.names == ["decoder"]


def test_weight_decay_zero_with_a_part_that_has_none_is_fine():
    learn = learner(opt_func={"encoder": torch.optim.SGD, "decoder": torch.optim.Rprop})
    learn.fit(1, lr=1e-3, wd=0.0)
    assert learn.opt["encoder"].wd == 0.0


def test_weight_decay_per_part_without_parts_is_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"one optimizer \(no parts\)"):
        learner(opt_func=torch.optim.SGD, wd={"encoder": 0.0})


def test_one_cycle_of_one_part_with_a_rate_per_part_is_refused():
    with pytest.raises(ValueError, match=r"that part's own"):
        OneCycleScheduler(lr={"encoder": 1e-3, "decoder": 0.1}, part="decoder")


def test_trackers_log_every_parts_class_and_hyper_parameters():
    model = EncDec()
    opt = MultiOptimizer(two_opts(model))
    params = optimizer_params(opt, ("mom", "wd"))
    assert params["optimizer"] == "MultiOptimizer(encoder=Adam, decoder=SGD)"
    assert params["encoder.mom"] == 0.9 and params["decoder.mom"] == 0.9
    assert optimizer_params(opt["decoder"], ("mom",)) == {
        "optimizer": "SGD",
        "mom": 0.9,
    }


def test_train_stats_reads_the_gradients_of_every_part():
    stats, norm = TrainStats(every_n_steps=1), Norm()
    learner(callbacks=[stats, norm]).fit(1, lr=1e-3)
    # TrainStats (order -15) and Norm (-5, nothing between them clips) agree:
    # the norm over the encoder's and the decoder's gradients together.
    reported = [h["grad_norm"] for h in stats.history]
    assert reported == pytest.approx(norm.norms, rel=1e-5)


def test_plot_lr_says_which_part_its_rates_are():
    learn = learner()
    learn.fit(1, lr={"encoder": 1e-3, "decoder": 0.05})
    assert set(learn.recorder.lrs) == {0.05}  # the last part's
    lr_ax, mom_ax = learn.recorder.plot_lr(show_moms=True)
    assert lr_ax.get_ylabel() == "learning rate (part 'decoder')"
    assert mom_ax.get_ylabel() == "momentum (part 'decoder')"
    one = learner(opt_func=torch.optim.SGD)
    one.fit(1, lr=0.1)
    assert one.recorder.plot_lr().get_ylabel() == "learning rate"
    plt.close("all")


def test_weight_decay_on_a_part_without_it_names_the_part():
    rprop = {"encoder": torch.optim.SGD, "decoder": torch.optim.Rprop}
    learn = learner(opt_func=rprop, true_wd=False)  # (true_wd: the wrapper decays)
    with pytest.raises(
        ValueError, match=r"\{'decoder': 'Rprop'\} have no hyper-parameter 'wd'"
    ):
        learn.fit(1, lr=1e-3, wd=1e-2)


def test_layer_groups_naming_no_part_shows_a_groups_example():
    with pytest.raises(ValueError, match=r"layer_groups=\{'encoder': \[body, head\]\}"):
        learner(layer_groups={"head": []})


# -- every argument, as a user might get it wrong --------------------------------
def multi():
    model = EncDec()
    return MultiOptimizer(two_opts(model)), model


def set_attr(name, value):
    return lambda: setattr(multi()[0], name, value)


BAD = [  # (call, error type, match)
    (lambda: MultiOptimizer({}), ValueError, r"parts .*empty.*got \{\}"),
    (lambda: MultiOptimizer(None), TypeError, r"non-empty dict.*got None"),
    (lambda: MultiOptimizer({"encoder": torch.optim.SGD}), TypeError,
     r"part 'encoder' must be .*got the class SGD"),
    (lambda: MultiOptimizer({"encoder": None}), TypeError, r"part 'encoder'.*None"),
    (lambda: MultiOptimizer({"": torch.optim.SGD(EncDec().parameters())}), TypeError,
     "part names .* must be non-empty strings"),
    (set_attr("lr", {}), ValueError, r"lr: the dict by part is empty"),
    (set_attr("lr", {"encoder": None}), TypeError, r"lr\['encoder'\].*got None"),
    (set_attr("lr", {"encoder": "1e-3"}), TypeError, r"lr\['encoder'\].*'1e-3'"),
    (set_attr("mom", {"decoder": 2.0}), ValueError, r"mom\['decoder'\].*\[0, 1\)"),
    (set_attr("wd", {"encoder": -1.0}), ValueError, r"wd\['encoder'\].*>= 0"),
    (set_attr("lr", {"head": 0.1}), ValueError, r"names no part \['head'\]"),
    (set_attr("active", ("head",)), ValueError, r"active.*no part 'head'"),
    (set_attr("active", "encoder"), TypeError, r"active=\('encoder',\)"),
    (set_attr("active", ()), ValueError, r"active.*empty"),
    (lambda: multi()[0].zero_grad("no"), TypeError, "set_to_none must be True or"),
    (lambda: multi()[0].set_lr({}), ValueError, r"lr: the dict by part is empty"),
    (lambda: multi()[0].scale("lr", {"encoder": None}), TypeError,
     r"lr\['encoder'\]"),
    (lambda: learner(opt_func={"": torch.optim.Adam}), TypeError,
     r"part names .* must be non-empty.*opt_func=torch.optim.Adam"),
    (lambda: learner(opt_func={1: torch.optim.Adam}), TypeError,
     r"part names .* must be non-empty strings, .*got 1 \(int\)"),
    (lambda: learner().fit(1, lr={}), ValueError, r"lr: the dict by part is empty"),
]  # fmt: skip


@pytest.mark.parametrize(("call", "error", "match"), BAD)
def test_every_bad_argument_is_refused_with_the_fix(call, error, match):
    with pytest.raises(error, match=match) as info:
        call()
    assert "Fix:" in str(info.value)


def test_numpy_numbers_and_0_dim_tensors_are_accepted_per_part():
    opt, _ = multi()
    opt.lr = {"encoder": np.float64(0.5), "decoder": torch.tensor(0.25)}
    assert opt.lr == [0.5, 0.25]
    opt.active = ["decoder"]  # a list of part names, kept as a tuple
    assert opt.active == ("decoder",)
    opt.active = None
    learn = learner()
    learn.fit(1, lr={"encoder": np.float32(0.5), "decoder": torch.tensor(0.25)})
    assert learn.opt.lr == [0.5, 0.25]


# -- any hyper-parameter of a part's groups, by its torch name ---------------------
def test_a_key_of_one_parts_groups_is_read_and_set_on_that_part():
    opt = MultiOptimizer(two_opts(EncDec()))
    opt["encoder"].set("eps", 1e-6)
    opt.set("eps", {"encoder": 1e-5})
    assert opt["encoder"].get("eps") == [1e-5]
    opt.set("weight_decay", 1e-3)  # every part has it
    assert opt.wd == 1e-3 and opt.get("weight_decay") == [1e-3, 1e-3]
    assert opt.hyper_names() == ["lr", "mom", "wd", "weight_decay"]


def test_a_key_some_parts_lack_names_them_and_a_misspelled_one_says_the_closest():
    opt = MultiOptimizer(two_opts(EncDec()))
    with pytest.raises(ValueError, match=r"\{'decoder': 'SGD'\} have no .*'eps'.*"
                       r"opt\[part\].set\('eps'"):  # fmt: skip
        opt.set("eps", 1e-6)
    with pytest.raises(ValueError, match=r"eps\['decoder'\]: SGD has no"):
        opt.set("eps", {"decoder": 1e-6})
    with pytest.raises(ValueError, match=r"'epss'.*did you mean 'eps'"):
        opt.get("epss")


def test_a_schedule_of_one_parts_own_key_sets_it_there_every_step():
    seen = []

    class Eps(Callback):
        def on_batch_begin(self, opt, train):
            if train:
                seen.append(opt["encoder"].param_groups[0]["eps"])

    sched = ParamScheduler({"eps": linear(1e-6, 1e-8)}, part="encoder")
    assert sched.sets_hypers == ("encoder.eps",)
    learn = learner(callbacks=[sched, Eps()])
    learn.fit(2, lr=1e-3)
    assert seen == pytest.approx([1e-6 - (1e-6 - 1e-8) * i / 11 for i in range(12)])
    with pytest.raises(ValueError, match=r"schedules \['eps'\].*\['decoder'\]"):
        learner().fit(1, callbacks=[ParamScheduler({"eps": constant(1e-6)})])
