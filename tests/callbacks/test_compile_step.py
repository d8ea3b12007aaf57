"""Compile(step=True): the optimizer's step compiled too, the loop unchanged."""

import pytest
import torch
from helpers import Crash, clone_params, make_data, make_dataset, make_model
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

from fitlib import Callback, DataBunch, HPOptimizer, Learner, fit
from fitlib.callbacks import (
    Checkpoint,
    Compile,
    GradientAccumulation,
    GradientClipping,
    MixedPrecision,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def fresh_compiler():
    """Dynamo reuses graphs of the same code: each test compiles afresh."""
    torch.compiler.reset()
    yield
    torch.compiler.reset()


class Graphs:
    """A torch.compile backend that runs each graph eagerly and counts them:
    the optimizer's step (its inputs come from ``param_groups``) apart from
    the model's."""

    def __init__(self):
        self.step = self.model = 0

    def __call__(self, gm, example_inputs):
        inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        if any("param_groups" in name for name in inputs):
            self.step += 1
        else:
            self.model += 1
        return gm.forward


class PerEpoch(Callback):
    """The step graphs made by the end of each epoch."""

    def __init__(self, graphs):
        self.graphs, self.seen = graphs, []

    def on_epoch_end(self):
        self.seen.append(self.graphs.step)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))


def data():
    return DataBunch(
        DataLoader(make_dataset(96), 16, shuffle=True),
        DataLoader(make_dataset(32, seed=1), 16),
        device="cpu",
    )


def learner(*callbacks, opt_func=torch.optim.AdamW):
    torch.manual_seed(0)
    return Learner(data(), mlp(), F.cross_entropy, opt_func=opt_func,
                   progress=False, callbacks=list(callbacks))  # fmt: skip


STEP_SAID = "fitlib: compiling the model and the optimizer step"


# AdamW's lr and betas are tensors: one graph. SGD's momentum stays a float
# (its step tests it in Python): the first step makes the momentum buffers
# and the second sees them and a changed momentum, traced as an input.
@pytest.mark.parametrize(
    ("opt_func", "graphs_made"), [(torch.optim.AdamW, 1), (torch.optim.SGD, 2)]
)
def test_a_one_cycle_fit_compiles_the_step_once_and_trains_like_eager(
    capsys, opt_func, graphs_made
):
    eager = learner(opt_func=opt_func)
    eager.fit_one_cycle(3, 0.01)  # lr and momentum change at every step
    graphs = Graphs()
    per_epoch = PerEpoch(graphs)
    compiled = learner(per_epoch, opt_func=opt_func)
    compiled.compile(step=True, backend=graphs)
    compiled.fit_one_cycle(3, 0.01)
    assert STEP_SAID in capsys.readouterr().out
    assert per_epoch.seen == [graphs_made] * 3  # none after the first steps
    for a, b in zip(clone_params(compiled.model), clone_params(eager.model),
                    strict=True):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert compiled.recorder.lrs == eager.recorder.lrs


def test_after_the_fit_the_optimizer_steps_plainly_and_saves_plain_state():
    graphs = Graphs()
    learn = learner(Compile(step=True, backend=graphs))
    learn.fit(1, lr=0.01)
    inner = learn.opt.opt
    assert "step" not in vars(inner)  # the class's own step again
    before = graphs.step
    history = learn.validate()  # evaluation: no step compiled
    learn.fit(1, lr=0.01, callbacks=[])  # the Learner's Compile: compiles again
    assert graphs.step == before  # the same code: dynamo reuses its graphs
    assert "step" not in vars(inner) and history["valid_loss"] is not None
    state = learn.opt.state_dict()
    fresh = learner()
    fresh.opt = HPOptimizer(fresh.model.parameters(), torch.optim.AdamW, lr=0.01)
    fresh.opt.load_state_dict(state)  # a plain optimizer takes it


@pytest.mark.parametrize(
    "extra",
    [
        lambda: [MixedPrecision(torch.bfloat16)],
        lambda: [GradientClipping(max_norm=0.5)],
        lambda: [GradientAccumulation(3)],
        lambda: [
            MixedPrecision(torch.bfloat16),
            GradientClipping(max_value=0.1),
            GradientAccumulation(2),
        ],
    ],
    ids=["bf16", "clipping", "accumulation", "all three"],
)
def test_mixed_precision_clipping_and_accumulation_keep_the_step_compiled(
    capsys, extra
):
    # Against the forward compiled alone: the same forward graphs, so only
    # the compiled step could make a difference.
    forward_only = learner(*extra(), Compile(backend=Graphs()))
    forward_only.fit_one_cycle(2, 0.01)
    graphs = Graphs()
    learn = learner(*extra(), Compile(step=True, backend=graphs))
    learn.fit_one_cycle(2, 0.01)
    assert STEP_SAID in capsys.readouterr().out
    assert graphs.step >= 1
    for a, b in zip(clone_params(learn.model), clone_params(forward_only.model),
                    strict=True):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:MixedPrecision\\(float16\\) on the CPU")
def test_the_loss_scalers_step_calls_the_compiled_step_of_an_unfused_optimizer():
    def trained(*callbacks):
        model = mlp()
        opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.05, mom=0.9)
        torch.manual_seed(0)
        fit(2, model, F.cross_entropy, opt, data(),
            [MixedPrecision(torch.float16), *callbacks])  # fmt: skip
        return clone_params(model)

    plain = trained()
    graphs = Graphs()
    compiled = trained(Compile(step=True, backend=graphs))
    assert graphs.step >= 1  # scaler.step(opt) called it
    for a, b in zip(compiled, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:MixedPrecision\\(float16\\) on the CPU")
def test_a_fused_optimizer_keeps_its_step_saying_why(capsys):
    graphs = Graphs()
    learn = learner(Compile(step=True, backend=graphs)).to_fp16()  # fused AdamW
    learn.fit(1, lr=0.01)
    assert (
        "the optimizer step stays eager: AdamW(fused=True) steps in fused kernels "
        "already" in capsys.readouterr().out
    )
    assert graphs.step == 0


class ReadsGradients(Callback):
    def on_backward_end(self, model):
        self.norm = sum(p.grad.norm() for p in model.parameters())


def test_an_undeclared_callback_inside_the_step_keeps_it_eager_saying_why(capsys):
    graphs = Graphs()
    learn = learner(ReadsGradients(), Compile(step=True, backend=graphs))
    learn.fit(1, lr=0.01)
    out = capsys.readouterr().out
    assert out.count("fitlib: compiling") == 1  # one line says it all
    assert (
        "fitlib: compiling the model (the first batches are slow); the optimizer "
        "step stays eager: ReadsGradients "
        "runs inside the step (on_backward_end) and does not declare "
        "compiled_step_safe = True. Fix: set it on ReadsGradients" in out
    )
    assert graphs.step == 0 and graphs.model > 0


def test_a_callback_that_declares_itself_safe_keeps_the_step_compiled(capsys):
    class Safe(ReadsGradients):
        compiled_step_safe = True

    graphs = Graphs()
    learner(Safe(), Compile(step=True, backend=graphs)).fit(1, lr=0.01)
    assert STEP_SAID in capsys.readouterr().out
    assert graphs.step >= 1


def test_an_optimizer_that_refuses_tensor_hyper_parameters_steps_eagerly(
    capsys, monkeypatch
):
    def refuse(self):
        raise ValueError("AdamW(foreach=False) cannot take tensor hyper-parameters.")

    monkeypatch.setattr(HPOptimizer, "hypers_as_tensors", refuse, raising=False)
    graphs = Graphs()
    learner(Compile(step=True, backend=graphs)).fit(1, lr=0.01)
    assert (
        "the optimizer step stays eager: AdamW(foreach=False) cannot take tensor "
        "hyper-parameters." in capsys.readouterr().out
    )
    assert graphs.step == 0


def test_the_step_takes_the_hyper_parameters_as_tensors_and_saves_floats():
    class Seen(Callback):
        def on_step_end(self, opt):
            self.lr = opt.param_groups[0]["lr"]
            self.saved = opt.state_dict()["opt"]["param_groups"][0]["lr"]

    seen = Seen()
    learner(seen, Compile(step=True, backend=Graphs())).fit(1, lr=0.01)
    assert isinstance(seen.lr, torch.Tensor) and seen.lr.dim() == 0
    assert type(seen.saved) is float  # a checkpoint holds what eager holds


def test_a_killed_compiled_fit_resumes_exactly(tmp_path):
    unbroken = learner(Compile(step=True, backend=Graphs()))
    unbroken.fit_one_cycle(2, 0.01)
    killed = learner(Checkpoint(tmp_path, every_n_steps=2), Crash(6),
                     Compile(step=True, backend=Graphs()))  # fmt: skip
    with pytest.raises(RuntimeError, match="crash"):
        killed.fit_one_cycle(2, 0.01)
    assert "step" not in vars(killed.opt.opt)  # taken off after the error too
    resumed = learner(Checkpoint(tmp_path, every_n_steps=2),
                      Compile(step=True, backend=Graphs()))  # fmt: skip
    resumed.fit_one_cycle(2, 0.01)
    for a, b in zip(clone_params(resumed.model), clone_params(unbroken.model),
                    strict=True):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_inductor_compiles_a_step_that_trains_like_eager():
    eager = learner()
    eager.fit_one_cycle(2, 0.01)
    learn = learner(Compile(step=True))
    learn.fit_one_cycle(2, 0.01)
    # Inductor's fused kernels round differently: close, not equal.
    for a, b in zip(clone_params(learn.model), clone_params(eager.model),
                    strict=True):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("step", ["yes", 1, None])
def test_step_must_be_a_bool(step):
    with pytest.raises(TypeError, match=r"Compile: step must be True or False; got"):
        Compile(step=step)
    learn = learner()
    with pytest.raises(TypeError, match=r"Fix: e\.g\. Compile\(step=True\)"):
        learn.compile(step=step)
    assert not any(isinstance(cb, Compile) for cb in learn.callbacks)


def test_repr_shows_step():
    assert repr(Compile(step=True, mode="max-autotune")) == (
        "Compile(step=True, mode='max-autotune')"
    )
    assert repr(Compile()) == "Compile()"


def test_a_torch_scheduler_drives_the_tensor_lr_of_a_compiled_step():
    from fitlib.callbacks import TorchScheduler

    def run(step):
        torch.manual_seed(0)
        learn = Learner(make_data(), make_model(), F.cross_entropy, progress=False,
                        opt_func=torch.optim.SGD)  # fmt: skip
        sched = TorchScheduler(
            lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
        )
        cbs = [sched] if step is None else [sched, Compile(backend="eager", step=step)]
        learn.fit(2, lr=1e-2, callbacks=cbs)
        return learn

    eager, compiled = run(None), run(True)
    # the schedule, step by step, exactly (the scheduler runs on floats)
    assert compiled.recorder.lrs == eager.recorder.lrs
    for a, b in zip(eager.model.parameters(), compiled.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def plain_fit(model, opt):
    torch.manual_seed(1)
    fit(1, model, F.cross_entropy, opt, data())
    return clone_params(model)


@pytest.mark.parametrize("crash", [False, True], ids=["ended", "after an error"])
def test_after_the_fit_the_hyper_parameters_are_floats_again(crash):
    import copy

    model = mlp()
    opt = HPOptimizer.wrap(torch.optim.AdamW(model.parameters(), lr=0.01))
    cbs = [Compile(step=True, backend=Graphs()), *([Crash(3)] if crash else [])]
    try:
        fit(1, model, F.cross_entropy, opt, data(), cbs)
    except RuntimeError:
        assert crash
    group = opt.param_groups[0]
    assert type(group["lr"]) is float and group["lr"] == opt.lr == 0.01
    assert all(type(b) is float for b in group["betas"])
    assert group["betas"] == (opt.mom, opt.beta) == (0.9, 0.999)
    # A later fit without Compile trains as a fresh optimizer with that state.
    twin_model = copy.deepcopy(model)
    twin = HPOptimizer.wrap(torch.optim.AdamW(twin_model.parameters(), lr=0.5))
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))  # (torch shares tensors)
    for a, b in zip(plain_fit(model, opt), plain_fit(twin_model, twin), strict=True):
        assert torch.equal(a, b)


def test_tensors_held_before_the_fit_stay_tensors_after_it():
    model = mlp()
    opt = HPOptimizer.wrap(torch.optim.AdamW(model.parameters(), lr=0.01))
    opt.hypers_as_tensors(("lr",))
    lr = opt.param_groups[0]["lr"]
    fit(1, model, F.cross_entropy, opt, data(), [Compile(step=True, backend=Graphs())])
    assert opt.param_groups[0]["lr"] is lr  # the user's, as before the fit
    assert all(type(b) is float for b in opt.param_groups[0]["betas"])  # Compile's
