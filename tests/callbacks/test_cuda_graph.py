"""CudaGraph and the loop's ``step_fn``: the refusals and the core split on
the CPU; the graph itself in the tests marked ``cuda`` (``make gpu-check``).

The CUDA tests compare a fit whose steps are replayed with one whose steps
all run eagerly through the same callback (``CudaGraph(warmup=10**6)``: the
same capturable optimizer and tensor hyper-parameters, so the same
arithmetic). Tolerance: rtol 1e-5, atol 1e-6 (float32 kernels launched by
a graph or one by one compute the same values; the margin covers a
reduction order that may differ). Against a plain eager fit (float
hyper-parameters, a non-capturable optimizer) only the losses are compared,
within rtol 1e-3: a float32 lr rounds unlike a Python float.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
from helpers import clone_params, make_data, make_dataset, train
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from fitlib import Callback, DataBunch, HPOptimizer, Learner, MultiOptimizer, fit
from fitlib.callbacks import (
    SWA,
    ActivationCheckpointing,
    BackboneFinetuning,
    GradientAccumulation,
    GradientClipping,
    MixedPrecision,
    OneCycleScheduler,
    ParamScheduler,
    TrainStats,
    every,
)
from fitlib.callbacks.cuda_graph import (
    CudaGraph,
    _baked,
    _capture_error,
    _copy_into,
    _replayer,
    _shapes,
    _sync_message,
)
from fitlib.callbacks.schedule import linear
from fitlib.core import train_step
from fitlib.graph_capture import check_not_distributed

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
EAGER = 10**6  # CudaGraph(warmup=EAGER): every step eager, the same arithmetic


# -- the loop's step_fn (CPU) ------------------------------------------------------
class OwnStep(Callback):
    """Sets a step_fn that notes its arguments and calls core's train_step."""

    def __init__(self):
        self.calls, self.events = [], []

    def on_train_begin(self):
        return {"step_fn": self.step}

    def step(self, model, xb, yb, loss_func, opt, cb_handler, first):
        self.calls.append((model, xb, yb, loss_func, opt, cb_handler, first))
        self.events.append("step_fn")
        state = cb_handler.state
        assert state["train"] is True  # never a validation batch
        assert (state["last_input"] is xb) and (state["last_target"] is yb)
        return train_step(model, xb, yb, loss_func, opt, cb_handler, first)

    def on_step_end(self):
        self.events.append("on_step_end")


def test_a_step_fn_replaces_the_step_of_training_batches_only():
    own = OwnStep()
    model = train([own], epochs=2)
    plain = train([], epochs=2)
    assert len(own.calls) == 14  # 7 training batches an epoch; none of validation
    assert [c[6] for c in own.calls] == [True] + [False] * 13  # first: checked
    assert all(c[3] is F.cross_entropy for c in own.calls)
    assert all(isinstance(c[4], HPOptimizer) for c in own.calls)
    # on_step_end (and zero_grad) still run in the loop, after each step
    assert own.events == ["step_fn", "on_step_end"] * 14
    assert all(torch.equal(a, b) for a, b in zip(clone_params(model),
                                                 clone_params(plain)))  # fmt: skip


def test_step_fn_is_refused_after_on_train_begin():
    class Late(Callback):
        def on_batch_begin(self):
            return {"step_fn": train_step}

    with pytest.raises(ValueError, match="step_fn"):
        train([Late()], epochs=1)


def test_no_step_fn_steps_as_before():
    class Nothing(Callback):
        def on_train_begin(self):
            return {"step_fn": None}

    a, b = train([Nothing()]), train([])
    assert all(torch.equal(x, y) for x, y in zip(clone_params(a), clone_params(b)))


# -- CudaGraph's refusals (CPU) ------------------------------------------------------
def adamw_fit(*callbacks, opt_func=torch.optim.AdamW, one_cycle=False, moms=None):
    model = nn.Linear(8, 3)
    opt = HPOptimizer(model.parameters(), opt_func, lr=1e-3)
    cycle = [OneCycleScheduler(1e-3, moms=moms)] if one_cycle else []
    cbs = [*callbacks, *cycle]
    fit(1, model, F.cross_entropy, opt, make_data(), cbs)
    return model, opt


def test_repr_and_warmup_check():
    assert repr(CudaGraph()) == "CudaGraph(warmup=3)"
    assert repr(CudaGraph(warmup=11)) == "CudaGraph(warmup=11)"
    with pytest.raises(ValueError, match=r"CudaGraph: warmup must be an int >= 1"):
        CudaGraph(warmup=0)
    with pytest.raises(TypeError, match="warmup"):
        CudaGraph(warmup=2.5)


def test_refuses_a_model_on_the_cpu_before_any_step():
    model = nn.Linear(8, 3)
    before = clone_params(model)
    opt = HPOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    with pytest.raises(ValueError, match=r"CudaGraph: the model is on 'cpu'.*Fix"):
        fit(1, model, F.cross_entropy, opt, make_data(), [CudaGraph()])
    assert all(torch.equal(a, b) for a, b in zip(before, clone_params(model)))


def test_a_refused_fit_leaves_the_optimizer_as_it_was():
    model = nn.Linear(8, 3)
    opt = HPOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    with pytest.raises(ValueError, match="CudaGraph"):
        fit(1, model, F.cross_entropy, opt, make_data(), [CudaGraph()])
    group = opt.param_groups[0]
    assert group["capturable"] is False
    assert type(group["lr"]) is float and group["lr"] == 1e-3
    assert all(type(b) is float for b in group["betas"])
    assert not opt.opt._optimizer_state_dict_post_hooks  # eager_state: removed


class ReadsGrads(Callback):
    def on_backward_end(self, model):
        self.norm = sum(p.grad.norm() for p in model.parameters())


@pytest.mark.parametrize(
    "callback, name",
    [
        (ReadsGrads(), "ReadsGrads"),
        (GradientAccumulation(2), "GradientAccumulation"),
        (TrainStats(), "TrainStats"),
    ],
)
def test_refuses_a_callback_inside_the_step_not_declared_safe(callback, name):
    with pytest.raises(ValueError, match=rf"CudaGraph: {name} runs inside the step"
                       r".*cuda_graph_safe = True"):  # fmt: skip
        adamw_fit(callback, CudaGraph())


def test_the_built_in_step_callbacks_say_whether_a_graph_may_hold_them():
    assert MixedPrecision.cuda_graph_safe is True
    assert callable(MixedPrecision.graph_replay)  # its unscale's flags, replayed
    assert GradientClipping.cuda_graph_safe is True
    assert GradientAccumulation.cuda_graph_safe is not True
    assert TrainStats.cuda_graph_safe is not True
    assert Callback.cuda_graph_safe is None


def test_a_declared_callback_passes_the_callback_check():
    class Declared(ReadsGrads):
        cuda_graph_safe = True

    with pytest.raises(ValueError, match="the model is on 'cpu'"):  # the next check
        adamw_fit(Declared(), CudaGraph())


def test_refuses_float16_loss_scaling_with_an_optimizer_not_fused():
    with (
        pytest.warns(RuntimeWarning, match="float16"),
        pytest.raises(
            ValueError,
            match=r"CudaGraph: MixedPrecision\(float16\) with "
            r"AdamW not fused.*fused=True.*to_fp16",
        ),  # fmt: skip
    ):
        adamw_fit(MixedPrecision(torch.float16), CudaGraph())


def test_refuses_an_optimizer_it_cannot_make_capturable():
    with pytest.raises(ValueError, match=r"CudaGraph: Adagrad has no capturable"):
        adamw_fit(CudaGraph(), opt_func=torch.optim.Adagrad)


@pytest.mark.parametrize(
    "opt_func, moms, name",
    [
        (torch.optim.SGD, None, "'lr'"),  # not fused: its step reads a tensor lr
        (functools.partial(torch.optim.SGD, fused=True), (0.95, 0.85), "'mom'"),
        (torch.optim.AdamW, (0.95, 0.85), "'mom'"),  # beta1: a float for torch
    ],
)
def test_refuses_a_schedule_of_a_value_the_graph_bakes_in(opt_func, moms, name):
    with pytest.raises(ValueError, match=rf"CudaGraph: OneCycleScheduler schedules "
                       rf"{name}.*baked.*moms=None"):  # fmt: skip
        adamw_fit(CudaGraph(), opt_func=opt_func, one_cycle=True, moms=moms)


def test_a_one_cycle_lr_schedule_passes_the_schedule_check():
    # the lr is a tensor: only the device check is left to refuse
    with pytest.raises(ValueError, match="the model is on 'cpu'"):
        adamw_fit(CudaGraph(), one_cycle=True)
    with pytest.raises(ValueError, match="the model is on 'cpu'"):
        sgd = functools.partial(torch.optim.SGD, fused=True)
        adamw_fit(CudaGraph(), opt_func=sgd, one_cycle=True)


def test_the_baked_values_are_those_not_held_as_tensors():
    model = nn.Linear(8, 3)
    sgd = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, mom=0.9, wd=1e-4)
    baked = {key: value for _, key, value in _baked(sgd)}
    assert baked["momentum"] == 0.9 and baked["weight_decay"] == 1e-4
    assert baked["lr"] == 0.1  # a float here: baked too
    adamw = HPOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    adamw.hypers_as_tensors()
    keys = {key for _, key, _ in _baked(adamw)}
    assert "lr" not in keys and "betas" not in keys and "weight_decay" in keys


def test_a_change_of_a_baked_value_is_refused_naming_it():
    model = nn.Linear(8, 3)
    sgd = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, mom=0.9)
    graph = CudaGraph()
    graph._baked = _baked(sgd)
    graph._check_baked(sgd)  # unchanged: nothing to say
    sgd.mom = 0.8
    with pytest.raises(ValueError, match=r"momentum changed from 0.9 to 0.8.*Fix"):
        graph._check_baked(sgd)


def test_batches_match_the_captured_one_by_shapes_and_dtypes():
    x, y = torch.zeros(4, 8), torch.zeros(4, dtype=torch.long)
    assert _shapes(x, y) == _shapes(torch.ones(4, 8), y)
    assert _shapes(x, y) != _shapes(torch.zeros(3, 8), y[:3])  # ragged
    assert _shapes(x, y) != _shapes(x.double(), y)
    nested = ({"a": x, "b": (x, x)}, ())
    assert _shapes(*nested) == _shapes({"a": x, "b": (x, x + 1)}, ())
    assert _shapes(*nested) != _shapes({"a": x, "b": (x, x[:2])}, ())


def test_a_nested_batch_is_copied_into_the_static_buffers():
    static = {"a": torch.zeros(2), "b": (torch.zeros(3),)}
    _copy_into(static, {"a": torch.ones(2), "b": (torch.full((3,), 2.0),)})
    assert static["a"].tolist() == [1, 1] and static["b"][0].tolist() == [2, 2, 2]


def test_a_sync_inside_the_capture_names_the_callback_and_its_line():
    class Reader(Callback):
        def on_backward_end(self):
            raise RuntimeError("called a synchronizing CUDA operation")

    try:
        Reader().on_backward_end()
    except RuntimeError as e:
        cause = _capture_error(e)
        message = _sync_message(cause)
    assert cause is not None
    assert message.startswith("CudaGraph: Reader.on_backward_end (test_cuda_graph.py:")
    assert "cuda_graph_safe" in message and "Fix" in message
    assert _capture_error(RuntimeError("shape mismatch")) is None  # other errors


# -- what changes after the capture is refused -------------------------------------
def test_refuses_backbone_finetuning_before_training_naming_the_fix():
    with pytest.raises(ValueError, match=r"CudaGraph: BackboneFinetuning unfreezes"
                       r".*Fix: train without CudaGraph while unfreezing"):  # fmt: skip
        adamw_fit(every(BackboneFinetuning(1), when=lambda epoch: True), CudaGraph())


def test_swa_annealing_a_float_lr_is_refused_before_training():
    # SWA sets the lr without listing it in sets_hypers (its named exception):
    # with plain SGD the lr is a float the graph would bake in at capture.
    with pytest.raises(ValueError, match=r"CudaGraph: SWA schedules 'lr', which "
                       r"SGD holds as a float.*Fix"):  # fmt: skip
        adamw_fit(SWA(swa_start=0, swa_lr=0.05), CudaGraph(), opt_func=torch.optim.SGD)
    with pytest.raises(ValueError, match=r"CudaGraph: the model is on 'cpu'"):
        adamw_fit(SWA(swa_start=0), CudaGraph(), opt_func=torch.optim.SGD)  # no lr


def test_activation_checkpointing_is_refused_until_tested_on_a_gpu():
    with pytest.raises(ValueError, match=r"CudaGraph: ActivationCheckpointing "
                       r"recomputes.*not yet tested on a GPU.*Fix"):  # fmt: skip
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        opt = HPOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        fit(1, model, F.cross_entropy, opt, make_data(),
            [ActivationCheckpointing(["0"]), CudaGraph()])  # fmt: skip


def test_learn_fine_tune_with_cuda_graph_is_refused_before_training():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    learn = Learner(make_data(), model, F.cross_entropy, progress=False,
                    layer_groups=[model[0], model[2]]).cuda_graph()  # fmt: skip
    before = clone_params(model)
    with pytest.raises(ValueError, match="CudaGraph: BackboneFinetuning unfreezes"):
        learn.fine_tune(1, base_lr=1e-3, freeze_epochs=1)
    assert all(torch.equal(a, b) for a, b in zip(before, clone_params(model)))


class State:
    """A stand-in for the CallbackHandler (its ``state``)."""

    state: ClassVar[dict] = {}


def mocked_graph(paths, warmup=3):
    """A CudaGraph whose GPU parts are stand-ins that note the path taken."""
    graph = CudaGraph(warmup=warmup)
    graph._side_stream = lambda *a: paths.append("warm") or torch.zeros(())
    graph._eager = lambda *a: paths.append("eager") or torch.zeros(())

    def capture(*a):
        paths.append(f"capture({a[1].shape[0]})")
        graph._graph = object()
        return torch.zeros(())

    graph._capture = capture
    graph._replay = lambda *a: paths.append("replay") or torch.zeros(())
    return graph


def mocked_step(graph, xb, model=None, loss_func=F.cross_entropy, opt=None):
    y = torch.zeros(xb.shape[0], dtype=torch.long)
    return graph.step(model or MODEL, xb, y, loss_func, opt or OPT, State, False)


MODEL = nn.Linear(8, 3)
OPT = HPOptimizer(MODEL.parameters(), torch.optim.SGD, lr=0.1)


def test_a_fit_resumed_at_a_short_last_batch_captures_the_full_batches():
    paths = []
    graph = mocked_graph(paths)
    full, short = torch.zeros(16, 8), torch.zeros(4, 8)
    epoch = [full] * 6 + [short]
    for xb in [short, *epoch, *epoch]:  # resumed before epoch 1's last batch
        mocked_step(graph, xb)
    assert paths == ["warm"] + ["warm"] * 3 + ["capture(16)"] + ["replay"] * 2 + [
        "eager"] + ["replay"] * 6 + ["eager"]  # fmt: skip


def test_a_replay_with_another_model_loss_or_optimizer_is_refused():
    other_opt = HPOptimizer(MODEL.parameters(), torch.optim.SGD, lr=0.1)
    for changed in ({"model": nn.Linear(8, 3)}, {"loss_func": F.nll_loss},
                    {"opt": other_opt}):  # fmt: skip
        paths = []
        graph = mocked_graph(paths, warmup=1)
        for _ in range(3):
            mocked_step(graph, torch.zeros(4, 8))
        what = {"model": "the model", "loss_func": "the loss function",
                "opt": "the optimizer"}[next(iter(changed))]  # fmt: skip
        with pytest.raises(ValueError, match=rf"CudaGraph: {what} changed after the "
                           r"step was captured.*Fix"):  # fmt: skip
            mocked_step(graph, torch.zeros(4, 8), **changed)
        assert paths == ["warm", "capture(4)", "replay"]


def test_an_unfreeze_is_refused_at_the_next_epochs_first_replay():
    paths = []
    graph = mocked_graph(paths, warmup=1)
    graph.on_epoch_begin()
    for _ in range(3):
        mocked_step(graph, torch.zeros(4, 8))
    MODEL.bias.requires_grad_(False)
    try:
        graph.on_epoch_begin()
        with pytest.raises(ValueError, match=r"which parameters train.*changed"):
            mocked_step(graph, torch.zeros(4, 8))
    finally:
        MODEL.bias.requires_grad_(True)
    assert paths == ["warm", "capture(4)", "replay"]


# -- schedules of attributes and of one part ---------------------------------------
class Weighted(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.ones(3)

    def forward(self, out, y):
        return F.cross_entropy(out, y, weight=self.weight)


def schedule_fit(schedule, opt_func=torch.optim.AdamW, loss_func=F.cross_entropy):
    body, head = nn.Linear(8, 16), nn.Sequential(nn.Dropout(0.5), nn.Linear(16, 3))
    parts = {"body": HPOptimizer(body.parameters(), opt_func, lr=1e-3),
             "head": HPOptimizer(head.parameters(), opt_func, lr=1e-3)}  # fmt: skip
    fit(1, nn.Sequential(body, head), loss_func, MultiOptimizer(parts), make_data(),
        [schedule, CudaGraph()])  # fmt: skip


def test_a_schedule_of_a_tensor_attribute_passes_the_schedule_check():
    with pytest.raises(ValueError, match="the model is on 'cpu'"):  # the next check
        schedule_fit(ParamScheduler({"loss_func.weight": linear(1.0, 2.0)}),
                     loss_func=Weighted())  # fmt: skip


def test_a_schedule_of_an_attribute_that_is_not_a_tensor_is_refused_naming_it():
    refused = r"'model.1.0.p', which holds 0.5 \(float\), not a tensor.*Fix"
    with pytest.raises(
        ValueError, match=rf"CudaGraph: ParamScheduler schedules {refused}"
    ):
        schedule_fit(ParamScheduler({"model.1.0.p": linear(0.5, 0.0)}))


def test_a_schedule_of_one_parts_hyper_parameter_checks_that_part():
    head_lr = ParamScheduler({"lr": linear(1e-3, 0.0)}, part="head")
    with pytest.raises(ValueError, match="the model is on 'cpu'"):  # AdamW: a tensor
        schedule_fit(head_lr)
    with pytest.raises(ValueError, match=r"CudaGraph: ParamScheduler schedules "
                       r"'head.lr', which SGD holds as a float"):  # fmt: skip
        schedule_fit(ParamScheduler({"lr": linear(0.1, 0.0)}, part="head"),
                     opt_func=torch.optim.SGD)  # fmt: skip


# -- distributed fits: refused -----------------------------------------------------
def test_refuses_a_distributed_fit_before_training():
    class DistributedTrainer(Callback):  # a stand-in, by name (no process group)
        pass

    why = r"not yet tested on GPUs.*Fix: train without CudaGraph under DDP"
    with pytest.raises(ValueError, match=rf"CudaGraph: the fit is distributed.*{why}"):
        adamw_fit(DistributedTrainer(), CudaGraph())
    ddp = DistributedDataParallel.__new__(DistributedDataParallel)  # (no group)
    with pytest.raises(ValueError, match="CudaGraph: the fit is distributed"):
        check_not_distributed(ddp, [])


# -- GradientClipping's norm after a replay ----------------------------------------
def test_clipping_last_norm_is_the_graphs_again_after_each_replay():
    clip = GradientClipping(max_norm=1.0)
    model = nn.Linear(8, 3)
    F.cross_entropy(
        model(torch.randn(4, 8)), torch.zeros(4, dtype=torch.long)
    ).backward()
    clip.on_backward_end(model, skip_step=False)  # the captured step's norm
    captured = clip.last_norm
    graph = CudaGraph()
    graph._graph = SimpleNamespace(replay=lambda: None)  # the replay's stand-in
    graph._static = (torch.zeros(4, 8), torch.zeros(4, dtype=torch.long))
    graph._loss, graph._out, graph._bwd = torch.zeros(()), torch.zeros(4, 3), None
    graph._after = [f for f in map(_replayer, [clip]) if f]
    clip.last_norm = torch.tensor(5.0)  # an eager (ragged) step's own
    graph._replay(torch.ones(4, 8), torch.ones(4, dtype=torch.long), OPT, {})
    assert clip.last_norm is captured
    assert GradientClipping(max_value=1.0).graph_replay() is None  # no norm


# -- on a GPU ------------------------------------------------------------------------
def gpu_learner(callbacks=(), opt_func=torch.optim.AdamW, n=96, bs=16, model=None,
                data=None):  # fmt: skip
    """A seeded MLP (no dropout: its masks are not what this compares) on
    ``n`` samples in unshuffled batches of ``bs``."""
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                   nn.Linear(32, 3))  # fmt: skip
    valid = DataLoader(make_dataset(37, seed=1), bs)
    data = data or DataBunch(DataLoader(make_dataset(n), bs), valid, device="cuda")
    return Learner(data, model, F.cross_entropy, opt_func=opt_func, progress=False,
                   callbacks=list(callbacks))  # fmt: skip


def weights(learn):
    return [t.detach().float().cpu() for t in learn.model.state_dict().values()]


def assert_close(a, b, rtol=1e-5, atol=1e-6, what="weights"):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        x, y = torch.as_tensor(x), torch.as_tensor(y)
        assert torch.allclose(x, y, rtol=rtol, atol=atol), (
            f"{what}[{i}] differ: max abs difference "
            f"{(x - y).abs().max().item():.3g} (rtol {rtol}, atol {atol})"
        )


def graph_and_eager(make, fit_args=(2, 1e-2), one_cycle=True):
    """(replayed Learner, its CudaGraph), (eager Learner, its CudaGraph)."""
    out = []
    for warmup in (3, EAGER):
        graph = CudaGraph(warmup=warmup)
        learn = make(graph)
        if one_cycle:  # (a momentum schedule would be refused: floats in torch)
            learn.fit_one_cycle(*fit_args, moms=None)
        else:
            learn.fit(*fit_args)
        out.append((learn, graph))
    return out


@pytest.mark.cuda
@needs_cuda
def test_a_one_cycle_adamw_fit_replayed_equals_the_eager_fit():
    (g, graph), (e, eager) = graph_and_eager(lambda cg: gpu_learner([cg]))
    assert graph.replays == 12 - 3 and eager.replays == 0  # 6 batches x 2 epochs
    assert_close(g.recorder.losses, e.recorder.losses, what="losses")
    assert_close(weights(g), weights(e))
    assert_close(g.recorder.lrs, e.recorder.lrs, what="lrs")
    plain = gpu_learner()
    plain.fit_one_cycle(2, 1e-2, moms=None)
    assert_close(g.recorder.losses, plain.recorder.losses, rtol=1e-3, atol=1e-5,
                 what="losses against a plain fit")  # fmt: skip
    group = g.opt.param_groups[0]  # put back as it was
    assert group["capturable"] is False and type(group["lr"]) is float


@pytest.mark.cuda
@needs_cuda
def test_bf16_mixed_precision_and_clipping_replayed_equal_eager():
    def make(cg):
        cbs = [MixedPrecision(torch.bfloat16), GradientClipping(max_norm=0.5), cg]
        return gpu_learner(cbs)

    (g, graph), (e, _) = graph_and_eager(make)
    assert graph.replays == 9
    assert_close(g.recorder.losses, e.recorder.losses, what="losses")
    assert_close(weights(g), weights(e))


@pytest.mark.cuda
@needs_cuda
def test_fp16_with_a_fused_optimizer_replayed_equals_eager_and_skips_an_inf_step():
    x, y = make_dataset(96).tensors
    x = x.clone()
    x[5 * 16] = math.inf  # batch 5 of each epoch: replayed; non-finite gradients

    def make(cg):
        valid = DataLoader(make_dataset(37, seed=1), 16)
        data = DataBunch(DataLoader(TensorDataset(x, y), 16), valid, device="cuda")
        torch.manual_seed(0)  # (both runs: the same weights)
        mlp = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))  # no BN:
        return gpu_learner([cg], data=data, model=mlp).to_fp16()  # inf stats

    (g, graph), (e, _) = graph_and_eager(make, one_cycle=False)
    assert graph.replays == 9
    g_mp = next(cb for cb in g.callbacks if isinstance(cb, MixedPrecision))
    e_mp = next(cb for cb in e.callbacks if isinstance(cb, MixedPrecision))
    assert e_mp.skipped_steps >= 2  # the inf batch, once per epoch
    assert g_mp.skipped_steps == e_mp.skipped_steps
    assert g_mp.scaler.get_scale() == e_mp.scaler.get_scale()
    assert_close(weights(g), weights(e))
    finite = [v for v in e.recorder.losses if math.isfinite(v)]
    assert_close([v for v in g.recorder.losses if math.isfinite(v)], finite,
                 what="losses")  # fmt: skip


@pytest.mark.cuda
@needs_cuda
def test_a_host_read_inside_the_captured_step_fails_loudly_naming_it():
    class ItemReader(Callback):
        cuda_graph_safe = True  # by mistake: it reads the device

        def on_backward_end(self, last_loss):
            self.seen = last_loss.item()

    learn = gpu_learner([ItemReader(), CudaGraph()])
    with pytest.raises(RuntimeError, match=r"CudaGraph: ItemReader.on_backward_end "
                       r"\(test_cuda_graph.py:\d+\)"):  # fmt: skip
        learn.fit(1, 1e-2)
    assert learn.opt.param_groups[0]["capturable"] is False  # put back


@pytest.mark.cuda
@needs_cuda
def test_a_ragged_last_batch_trains_eagerly_and_the_fit_equals_eager():
    # 100 samples in batches of 16: 6 full, then 4 (each epoch)
    (g, graph), (e, _) = graph_and_eager(lambda cg: gpu_learner([cg], n=100))
    assert graph.replays == 14 - 3 - 2  # the two ragged batches ran eagerly
    assert_close(g.recorder.losses, e.recorder.losses, what="losses")
    assert_close(weights(g), weights(e))
    assert [r["train_loss"] for r in g.recorder.epoch_table()] == pytest.approx(
        [r["train_loss"] for r in e.recorder.epoch_table()], rel=1e-5)  # fmt: skip


@pytest.mark.cuda
@needs_cuda
def test_a_change_of_sgds_momentum_after_the_capture_is_refused():
    class ChangeMomentum(Callback):  # not a declared schedule: seen at a replay
        def on_step_end(self, opt, step):
            if step == 4:  # at batch 4 (3 warm up, 3 is captured): 5 replays
                opt.mom = 0.8

    sgd = functools.partial(torch.optim.SGD, momentum=0.9)
    learn = gpu_learner([ChangeMomentum(), CudaGraph()], opt_func=sgd)
    with pytest.raises(ValueError, match=r"momentum changed from 0.9 to 0.8"):
        learn.fit(1, 1e-2)


@pytest.mark.cuda
@needs_cuda
def test_a_replayed_step_reads_nothing_on_the_host():
    import warnings

    def syncs(n):
        learn = gpu_learner([CudaGraph()], n=n)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                learn.fit_one_cycle(2, 1e-2, moms=None)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught), learn

    (few, a), (many, b) = syncs(64), syncs(256)
    cg_a = next(cb for cb in a.callbacks if isinstance(cb, CudaGraph))
    cg_b = next(cb for cb in b.callbacks if isinstance(cb, CudaGraph))
    assert (cg_a.replays, cg_b.replays) == (8 - 3, 32 - 3)
    assert few > 0  # the instrument works: the epochs' ends read values
    assert few == many, f"{many - few} more syncs in {32 - 8} more replayed steps"


@pytest.mark.cuda
@needs_cuda
def test_a_checkpoint_resume_replayed_equals_the_unbroken_replayed_fit(tmp_path):
    from helpers import Crash

    from fitlib.callbacks import Checkpoint

    def run(extra, path):
        learn = gpu_learner([Checkpoint(path, every_n_steps=2), CudaGraph(), *extra])
        learn.fit_one_cycle(2, 1e-2, moms=None)
        return learn

    whole = run([], tmp_path / "whole")
    with pytest.raises(RuntimeError, match="crash"):
        run([Crash(at=8)], tmp_path / "broken")
    resumed = run([], tmp_path / "broken")
    assert_close(weights(resumed), weights(whole))
    assert resumed.recorder.epoch_table()[-1]["train_loss"] == pytest.approx(
        whole.recorder.epoch_table()[-1]["train_loss"], rel=1e-5)  # fmt: skip


class TwoHeads(nn.Module):
    """Dict inputs (``x``, ``scale``), two outputs: a class and a value."""

    def __init__(self):
        super().__init__()
        self.body, self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 3), nn.Linear(32, 1)

    def forward(self, x, scale):
        h = torch.relu(self.body(x * scale[:, None]))
        return {"a": self.a(h), "b": self.b(h)}


class DictSet(torch.utils.data.Dataset):
    def __init__(self, n, seed=0):
        self.x, self.y = make_dataset(n, seed=seed).tensors

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        inputs = {"x": self.x[i], "scale": torch.tensor(1.0)}
        return inputs, {"a": self.y[i], "b": self.x[i, 1:2]}


@pytest.mark.cuda
@needs_cuda
def test_the_loss_parts_of_every_step_reach_the_record_the_captured_one_too():
    def make(cg):
        valid = DataLoader(DictSet(37, seed=1), 16)
        data = DataBunch(DataLoader(DictSet(96), 16), valid, device="cuda")
        torch.manual_seed(0)
        losses = {"a": F.cross_entropy, "b": F.mse_loss}  # parts: train_a...
        return Learner(data, TwoHeads(), losses, opt_func=torch.optim.AdamW,
                       progress=False, metrics=[], callbacks=[cg])  # fmt: skip

    (g, graph), (e, _) = graph_and_eager(make, one_cycle=False)
    assert graph.replays == 9
    names = ("train_loss", "train_a", "train_b", "valid_a", "valid_b")
    for ours, eager in zip(g.recorder.epoch_table(), e.recorder.epoch_table()):
        assert [ours[n] for n in names] == pytest.approx(
            [eager[n] for n in names], rel=1e-5), f"epoch {ours['epoch']}"  # fmt: skip
