"""The model summary (``fitlib.summary``): layers, shapes from one forward
pass that changes nothing, counts, optimizer, callbacks, precision (its text
and HTML drawing: test_summary_text.py). Cases ported from Lightning's and
Keras's summary tests: trainable and frozen counts, an unused layer, nested
modules by depth, several outputs, a model without parameters, an RNN, a
scripted layer, lazy layers."""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import partial

import numpy as np
import pytest
import torch
from helpers import make_data, make_model
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

from fitlib import DataBunch, HPOptimizer, Learner, MultiOptimizer, fit
from fitlib.callbacks import (
    ChannelsLast,
    Compile,
    EarlyStopping,
    MixedPrecision,
    OneCycleScheduler,
    Recorder,
)
from fitlib.rng import get_rng_state
from fitlib.sequences import PadCollate
from fitlib.summary import learner_summary, shape_of, summarize
from fitlib.summary_text import shape_text


class Unordered(nn.Module):
    """Layers registered out of call order, one never called (Lightning's)."""

    def __init__(self):
        super().__init__()
        self.second = nn.Linear(10, 2)
        self.combine = nn.Linear(7, 9)
        self.first = nn.Linear(3, 5)
        self.relu = nn.ReLU()
        self.unused = nn.Conv2d(1, 1, 1)

    def forward(self, x, y):
        return self.combine(self.relu(torch.cat([self.first(x), self.second(y)], 1)))


def one_batch(*xs):
    return [(tuple(xs),)]  # a loader of one batch of inputs only: model(*xs)


def test_rows_are_the_leaves_with_type_shape_and_count_and_an_unused_one_is_unknown():
    model = Unordered()
    s = summarize(model, one_batch(torch.zeros(2, 3), torch.zeros(2, 10)))
    assert [r.name for r in s.layers] == [
        "second",
        "combine",
        "first",
        "relu",
        "unused",
    ]
    assert [r.type for r in s.layers] == ["Linear"] * 3 + ["ReLU", "Conv2d"]
    assert [r.shape for r in s.layers] == [(2, 2), (2, 9), (2, 5), (2, 7), None]
    assert [r.params for r in s.layers] == [22, 72, 20, 0, 2]
    assert s.layers[-1].calls == 0
    assert s.output_shape == (2, 9)
    unused = str(s).splitlines()[7]
    assert unused.split() == ["unused", "Conv2d", "?", "2", "yes"]


def test_counts_total_trainable_and_frozen_with_a_frozen_layer():
    model = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 3))
    model[0].requires_grad_(False)
    s = summarize(model)
    assert (s.total, s.trainable, s.frozen) == (27, 15, 12)
    assert "Parameters: 27 total, 15 trainable, 12 frozen (108 B)" in str(s)
    assert [r.trainable for r in s.layers] == [0, 0, 15]
    assert str(s).splitlines()[3].split()[-1] == "no"


class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.branch = nn.Sequential(nn.Linear(5, 5), nn.Sequential(nn.Linear(5, 5),
                                    nn.Sequential(nn.Linear(5, 3))))  # fmt: skip
        self.scale = nn.Parameter(torch.ones(3))  # the parent's own parameter
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(self.branch(x) * self.scale)


@pytest.mark.parametrize(
    "depth, names",
    [
        (None, ["", "branch.0", "branch.1.0", "branch.1.1.0", "head"]),
        (0, [""]),
        (1, ["", "branch", "head"]),
        (2, ["", "branch.0", "branch.1", "head"]),
        (9, ["", "branch.0", "branch.1.0", "branch.1.1.0", "head"]),
    ],
)
def test_depth_picks_the_rows_and_they_add_up_to_the_total(depth, names):
    s = summarize(Deep(), one_batch(torch.zeros(4, 5)), depth=depth)
    assert [r.name for r in s.layers] == names
    assert sum(r.params for r in s.layers) == s.total == 30 + 30 + 18 + 3 + 8
    assert all(r.name.count(".") < (depth or 99) for r in s.layers)
    shapes = {r.name: r.shape for r in s.layers}
    assert shapes[""] == (4, 2)
    if depth == 1:
        assert shapes["branch"] == (4, 3) and s.layers[0].params == 3


@pytest.mark.parametrize("depth", [-1, 1.5, "all"])
def test_depth_must_be_none_or_an_int_from_zero(depth):
    with pytest.raises((ValueError, TypeError), match="summarize: depth must be"):
        summarize(Deep(), depth=depth)


def test_a_model_without_parameters():
    s = summarize(
        nn.Sequential(nn.ReLU(), nn.Flatten()), one_batch(torch.zeros(2, 3, 4))
    )
    assert (s.total, s.trainable, s.size_bytes) == (0, 0, 0)
    assert [r.shape for r in s.layers] == [(2, 3, 4), (2, 12)]
    assert "Parameters: 0 total, 0 trainable, 0 frozen (0 B)" in str(s)
    assert "Precision: fp32 (no weights)" in str(s)


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 6)
        self.rnn = nn.LSTM(6, 8, batch_first=True, num_layers=2)
        self.out = nn.Linear(8, 4)

    def forward(self, x, lengths):
        h, _ = self.rnn(self.embed(x))
        return self.out(h)


def test_an_lstm_shows_a_shape_per_element_of_the_first_batch_of_variable_length():
    items = [
        (torch.arange(1, n + 1), torch.zeros(n, dtype=torch.long)) for n in [5, 9, 3, 7]
    ]
    dl = DataLoader(items, 2, collate_fn=PadCollate())  # first batch: length 9
    s = summarize(Tagger(), DataBunch(dl, device="cpu"))
    shapes = {r.name: r.shape for r in s.layers}
    assert shapes["rnn"] == ((2, 9, 8), ((2, 2, 8), (2, 2, 8)))
    assert shapes["embed"] == (2, 9, 6) and shapes["out"] == (2, 9, 4)
    assert s.input_shape == ((2, 9), (2,))
    assert shape_text(shapes["rnn"]) == "([2, 9, 8], ([2, 2, 8], [2, 2, 8]))"


@dataclass
class Boxes:
    logits: torch.Tensor
    box: torch.Tensor


class TwoHeads(nn.Module):
    def __init__(self, as_dict: bool):
        super().__init__()
        self.as_dict = as_dict
        self.body, self.cls, self.reg = (
            nn.Linear(8, 16),
            nn.Linear(16, 3),
            nn.Linear(16, 4),
        )

    def forward(self, x):
        h = self.body(x)
        out = Boxes(self.cls(h), self.reg(h))
        return vars(out) if self.as_dict else out


@pytest.mark.parametrize("as_dict", [True, False])
def test_several_outputs_show_a_shape_per_output(as_dict):
    s = summarize(TwoHeads(as_dict), make_data(bs=4))
    assert s.output_shape == {"logits": (4, 3), "box": (4, 4)}
    assert "output {logits: [4, 3], box: [4, 4]}" in str(s).splitlines()[0]


def test_shape_of_a_packed_sequence_and_of_other_values():
    packed = nn.utils.rnn.pack_sequence([torch.zeros(3, 2), torch.zeros(1, 2)])
    assert shape_of(packed) == "packed [4, 2]"
    assert shape_of([None, 3]) == ("NoneType", "int")
    assert shape_text(shape_of(torch.tensor(1.0))) == "[]"


class Keywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)

    def forward(self, input_ids, attention_mask, labels=None):
        return self.embed(input_ids) * attention_mask[..., None]


def test_a_dict_batch_calls_the_model_with_keywords():
    batch = {"input_ids": torch.zeros(2, 5, dtype=torch.long),
             "attention_mask": torch.ones(2, 5), "labels": torch.zeros(2)}  # fmt: skip
    s = summarize(Keywords(), [batch])
    assert s.layers[0].shape == (2, 5, 4)
    assert s.input_shape == {
        "input_ids": (2, 5),
        "attention_mask": (2, 5),
        "labels": (2,),
    }


@pytest.mark.parametrize("batch", [torch.zeros(3, 8), (torch.zeros(3, 8),)])
def test_inputs_only_batches(batch):
    s = summarize(make_model(), [batch])
    assert s.output_shape == (3, 3)


def test_a_batch_fn_turns_the_loaders_batches_into_inputs():
    data = DataBunch(
        [[{"data": torch.zeros(5, 8)}]], batch_fn=lambda b: (b[0]["data"],)
    )
    assert summarize(make_model(), data).input_shape == (5, 8)


def test_without_data_or_with_a_one_shot_iterator_the_shapes_are_unknown():
    batches = iter([(torch.zeros(2, 8), torch.zeros(2))])
    for data, note in [(None, "no data"), (batches, "one-shot iterator")]:
        s = summarize(make_model(), data)
        assert all(r.shape is None for r in s.layers) and s.output_shape is None
        assert note in str(s) and "input ?, output ?" in str(s)
    assert next(batches)[0].shape == (2, 8)  # its batch was not drawn


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.again = self.lin  # one module, two names
        self.embed = nn.Embedding(10, 4)
        self.decode = nn.Linear(4, 10, bias=False)
        self.decode.weight = self.embed.weight  # tied weights

    def forward(self, x):
        return self.decode(self.again(self.lin(self.embed(x))))


def test_shared_modules_and_tied_weights_are_counted_once_in_the_totals():
    s = summarize(Shared(), one_batch(torch.zeros(2, 5, dtype=torch.long)))
    assert [r.name for r in s.layers] == ["lin", "embed", "decode"]
    assert s.layers[0].calls == 2 and "[2, 5, 4] x2" in str(s)
    assert s.total == 20 + 40
    assert "40 parameters are shared by several layers" in str(s)


class CountsCalls(nn.Module):
    """Updates a buffer even in eval mode: the summary must undo it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen += 1
        self.seen = self.seen * 1  # a new tensor object, too
        return F.dropout(self.lin(x), 0.5, training=True)  # draws numbers


def state_of(model, dl):
    rng = get_rng_state(dl)
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state()[1].tolist(),
        "torch": rng["torch"],
        "loader": rng["loader"],
        "modes": [m.training for m in model.modules()],
        "grad": torch.is_grad_enabled(),
        "flags": [p.requires_grad for p in model.parameters()],
        "buffers": {n: (b, b.clone()) for n, b in model.named_buffers()},
        "hooks": [len(m._forward_hooks) for m in model.modules()],
    }


def assert_same_state(before, after):
    for key in ("python", "numpy", "modes", "grad", "flags", "hooks"):
        assert before[key] == after[key], key
    assert torch.equal(before["torch"], after["torch"])
    assert all(torch.equal(a, b) for a, b in zip(before["loader"], after["loader"]))
    for name, (buffer, value) in before["buffers"].items():
        now, _ = after["buffers"][name]
        assert now is buffer and torch.equal(now, value), name


@pytest.mark.parametrize("grad", [True, False])
def test_the_forward_pass_leaves_every_state_as_it_found_it(grad):
    model = nn.Sequential(make_model(), CountsCalls())
    model[0][1].eval()  # a module in eval mode inside a model in train mode
    model[0][0].weight.requires_grad_(False)
    dl = DataLoader(make_data().train_dl.dataset, 16, shuffle=True,
                    generator=torch.Generator().manual_seed(3))  # fmt: skip
    model(torch.randn(4, 8))  # non-zero BatchNorm statistics
    with torch.set_grad_enabled(grad):
        before = state_of(model, dl)
        s = summarize(model, dl)
        after = state_of(model, dl)
    assert s.output_shape == (16, 3)
    assert_same_state(before, after)


def test_hooks_are_removed_and_states_restored_after_the_model_fails():
    model = nn.Sequential(nn.Linear(8, 3), nn.Linear(4, 2))  # 3 != 4
    before = state_of(model, None)
    with pytest.raises(ValueError, match="it expects 4 features"):
        summarize(model, make_data())
    assert_same_state(before, state_of(model, None))


def trained_weights(summary_first: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(make_model(), CountsCalls())
    data = make_data()
    if summary_first:
        summarize(model, data)
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, mom=0.9)
    fit(2, model, F.cross_entropy, opt, data)
    return [t.clone() for t in model.state_dict().values()]


def test_the_next_fit_is_bit_identical_with_and_without_a_summary_before_it():
    with_summary, without = trained_weights(True), trained_weights(False)
    assert all(torch.equal(a, b) for a, b in zip(with_summary, without, strict=True))


def test_lazy_layers_are_counted_on_a_copy_and_left_uninitialized():
    model = nn.Sequential(nn.LazyLinear(5), nn.ReLU(), nn.LazyLinear(2))
    s = summarize(model, one_batch(torch.zeros(3, 4)))
    assert s.total == 4 * 5 + 5 + 5 * 2 + 2
    assert [r.shape for r in s.layers] == [(3, 5), (3, 5), (3, 2)]
    assert nn.parameter.is_lazy(model[0].weight)
    assert "lazy layers" in str(s)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_a_scripted_layer_takes_no_hook_and_shows_an_unknown_shape():
    model = nn.Sequential(torch.jit.script(nn.Linear(5, 3)), nn.Linear(3, 2))
    s = summarize(model, one_batch(torch.zeros(2, 5)))
    assert [r.shape for r in s.layers] == [None, (2, 2)]
    assert s.total == 18 + 8


def test_the_optimizer_hyper_parameters_per_group():
    model = make_model()
    groups = [
        [*model[0].parameters()],
        [*model[1].parameters(), *model[4].parameters()],
    ]
    opt = HPOptimizer([{"params": g} for g in groups], torch.optim.Adam,
                      lr=[1e-3, 1e-2], wd=0.1, true_wd=True)  # fmt: skip
    s = summarize(model, opt=opt)
    assert [g.params for g in s.groups] == [144, 32 + 51]
    assert s.groups[1].hypers == {"lr": 0.01, "mom": 0.9, "wd": 0.1, "beta": 0.999,
                                  "eps": 1e-8}  # fmt: skip
    assert s.optimizer == "Adam, weight decay decoupled (true_wd)"
    lines = str(s).splitlines()
    at = lines.index("Optimizer: Adam, weight decay decoupled (true_wd)")
    assert lines[at + 1].split() == ["group", "params", "trainable", "lr", "mom", "wd",
                                     "beta", "eps"]  # fmt: skip
    assert lines[at + 4].split() == ["1", "83", "83", "0.01", "0.9", "0.1", "0.999",
                                     "1e-08"]  # fmt: skip


def test_a_torch_optimizer_shows_its_own_names_and_what_differs_from_the_defaults():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    (group,) = summarize(model, opt=opt).groups
    assert group.hypers == {"lr": 0.1, "momentum": 0.9}
    assert opt.param_groups[0]["lr"] == 0.1


def test_several_optimizers_show_each_part_and_parameters_in_no_group():
    model = TwoHeads(as_dict=True)
    opt = MultiOptimizer({
        "body": HPOptimizer(model.body.parameters(), torch.optim.Adam, lr=1e-3),
        "cls": HPOptimizer(model.cls.parameters(), torch.optim.SGD, lr=0.1),
    })  # fmt: skip
    s = summarize(model, opt=opt)
    assert [(g.part, g.optimizer, g.hypers["lr"]) for g in s.groups] == [
        ("body", "Adam", 0.001), ("cls", "SGD", 0.1)]  # fmt: skip
    assert "68 parameters are in no group (no optimizer)" in str(s)
    assert "group  part  params  trainable  optimizer  lr" in str(s)


def test_a_scheduled_hyper_parameter_is_said_to_be_set_by_its_scheduler():
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    s = summarize(model, opt=opt, callbacks=[OneCycleScheduler(0.1)])
    assert s.scheduled == {"lr": "OneCycleScheduler", "mom": "OneCycleScheduler"}
    assert "lr: set at every step by OneCycleScheduler" in str(s)


def test_callbacks_are_listed_in_the_order_they_run():
    cbs = [EarlyStopping(patience=2), Recorder(), MixedPrecision(torch.bfloat16)]
    s = summarize(make_model(), callbacks=cbs)
    assert [order for order, _ in s.callbacks] == [-20, 45, 50]
    assert s.callbacks[0][1] == "MixedPrecision(dtype=torch.bfloat16)"
    assert s.callbacks[2][1] == "Recorder"


@pytest.mark.parametrize(
    "callbacks, text",
    [
        ([], "fp32 (weights float32)"),
        (
            [MixedPrecision(torch.bfloat16)],
            "bf16 mixed (autocast to bfloat16; weights float32)",
        ),
        (
            [MixedPrecision(torch.float16)],
            "fp16 mixed (autocast to float16, loss scaling; ",
        ),
        ([ChannelsLast()], "fp32 (weights float32); channels_last"),
        (
            [Compile(mode="reduce-overhead")],
            "; compiled (Compile(mode='reduce-overhead'))",
        ),
    ],
)
def test_the_precision_memory_format_and_compilation(callbacks, text):
    model = nn.Sequential(nn.Conv2d(3, 4, 1))
    assert text in summarize(model, callbacks=callbacks).precision


def test_weights_in_half_precision_are_said():
    assert summarize(make_model().to(torch.bfloat16)).precision == "weights bfloat16"


def test_a_learners_summary_has_its_layer_groups_before_and_after_the_first_fit():
    model = make_model()
    learn = Learner(make_data(), model, F.cross_entropy, opt_func=torch.optim.SGD,
                    layer_groups=[model[:2], model[2:]], progress=False)  # fmt: skip
    learn.freeze()
    s = learner_summary(learn)
    assert s.optimizer == "SGD (created at the first fit)"
    assert [(g.params, g.trainable) for g in s.groups] == [(144 + 32, 32), (51, 51)]
    assert s.callbacks == [(50, "Recorder")]
    learn.fit(1, lr=[0.01, 0.1])
    s = learner_summary(learn)
    assert [g.hypers["lr"] for g in s.groups] == [0.01, 0.1]


def test_an_opt_func_of_a_partial_or_of_parts_is_named():
    adam = partial(torch.optim.Adam, betas=(0.8, 0.9))
    assert (
        summarize(make_model(), opt=adam).optimizer == "Adam (created at the first fit)"
    )
    both = {"a": adam, "b": torch.optim.SGD}
    assert summarize(make_model(), opt=both).optimizer == (
        "Adam and SGD (created at the first fit)"
    )


class Spy(nn.Module):
    def forward(self, x):
        self.seen = (self.training, torch.is_grad_enabled())
        return x


def test_the_forward_runs_in_eval_mode_without_gradients_so_a_batch_of_one_works():
    model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4), Spy())
    s = summarize(model, [(torch.zeros(1, 8), torch.zeros(1))])  # train mode: error
    assert s.output_shape == (1, 4)
    assert model[2].seen == (False, False)
    assert model.training
