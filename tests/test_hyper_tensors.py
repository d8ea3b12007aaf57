"""Hyper-parameters held as 0-d tensors (``HPOptimizer.hypers_as_tensors``):
a compiled optimizer step that a 1cycle schedule does not recompile."""

import pytest
import torch
import torch._dynamo
from helpers import Crash, make_data
from torch._dynamo.testing import CompileCounter
from torch.nn import functional as F  # noqa: N812

from fitlib import Callback, HPOptimizer, Learner, MultiOptimizer, fit
from fitlib.callbacks import Checkpoint, OneCycleScheduler


def compiled_step(opt: HPOptimizer) -> list[int]:
    """Replaces the torch optimizer's step by ``torch.compile`` of it (the
    "eager" backend, fast on a CPU); returns the frames compiled after each
    step, appended as the fit goes: a recompile adds one."""
    torch._dynamo.reset()
    counter, frames = CompileCounter(), []
    compiled = torch.compile(opt.opt.step, backend=counter)

    def step(closure=None):
        out = compiled()
        frames.append(counter.frame_count)
        return out

    opt.opt.step = step
    return frames


def mlp():
    """No batch norm: a bias before one has no gradient but rounding noise,
    which Adam's normalised step would blow up to the size of lr."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )


def one_cycle_fit(opt_func, tensors, compile_step, moms=(0.95, 0.85), **kwargs):
    model = mlp()
    opt = HPOptimizer(model.parameters(), opt_func, lr=1e-2, **kwargs)
    names = opt.hypers_as_tensors() if tensors else ()
    frames = compiled_step(opt) if compile_step else []
    lrs = []
    watch = Callback.from_hooks(on_batch_end=lambda opt: lrs.append(opt.stepped))
    sched = OneCycleScheduler(max_lr=1e-2, moms=moms)
    fit(2, model, F.cross_entropy, opt, make_data(), [sched, watch])
    return model, opt, names, frames, lrs


def test_a_compiled_adamw_step_never_recompiles_across_a_one_cycle_fit():
    model, _, names, frames, lrs = one_cycle_fit(torch.optim.AdamW, True, True)
    assert names == ("lr", "mom", "beta")
    assert len(frames) == 14 and len(set(lrs)) == 14  # lr and mom change each step
    assert frames[-1] == frames[0]  # zero recompiles after the first step
    ref, *_ = one_cycle_fit(torch.optim.AdamW, False, False)  # eager, floats
    for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_float_hyper_parameters_recompile_the_compiled_step():
    # The same fit with floats: the test above can fail. (torch 2.14 makes a
    # float that changed dynamic: one recompile, at the second step.)
    *_, frames, _ = one_cycle_fit(torch.optim.AdamW, False, True)
    assert frames[-1] > frames[0]


def test_sgd_holds_lr_as_a_tensor_and_a_lr_schedule_never_recompiles():
    model, opt, names, frames, _ = one_cycle_fit(
        torch.optim.SGD, True, True, moms=None, mom=0.9
    )
    assert names == ("lr",)  # SGD's step tests momentum != 0 in Python
    assert isinstance(opt.param_groups[0]["momentum"], float)
    # The first step makes the momentum buffers, which the second compiles
    # for: the warm-up. None after it.
    assert frames[-1] == frames[1]
    ref, *_ = one_cycle_fit(torch.optim.SGD, False, False, moms=None, mom=0.9)
    for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_setters_write_into_the_same_tensors_and_getters_give_floats():
    opt = HPOptimizer(mlp().parameters(), torch.optim.AdamW, lr=1e-3)
    assert opt.hypers_as_tensors() == ("lr", "mom", "beta")
    group = opt.param_groups[0]
    lr, (b1, b2) = group["lr"], group["betas"]
    assert lr.ndim == 0 and lr.device == torch.device("cpu")
    opt.lr, opt.mom = 3e-3, 0.8
    opt.set_scheduled("beta", 0.99)
    opt.scale("lr", 0.5)
    opt.set("betas[1]", 0.98)
    assert group["lr"] is lr and group["betas"][0] is b1 and group["betas"][1] is b2
    assert lr.item() == pytest.approx(1.5e-3) and b1.item() == pytest.approx(0.8)
    assert b2.item() == pytest.approx(0.98)
    assert (opt.lr, opt.mom, opt.beta) == (1.5e-3, 0.8, 0.98)
    assert type(opt.lr) is float and opt.get("betas[0]") == [0.8]
    assert opt.hypers_as_tensors() == ("lr", "mom", "beta")  # idempotent
    assert opt.param_groups[0]["lr"] is lr


def test_stepped_and_state_dict_hold_floats_and_a_load_fills_the_tensors():
    model = mlp()
    opt = HPOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    opt.hypers_as_tensors()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    assert opt.stepped == (1e-3, 0.9) and all(type(v) is float for v in opt.stepped)
    saved = opt.state_dict()
    group = saved["opt"]["param_groups"][0]
    assert group["lr"] == 1e-3 and group["betas"] == (0.9, 0.999)
    assert type(group["lr"]) is float
    lr = opt.param_groups[0]["lr"]
    opt.lr = 5.0
    assert saved["opt"]["param_groups"][0]["lr"] == 1e-3  # not the live tensor
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(1e-3)
    assert opt.lr == 1e-3
    floats = HPOptimizer(mlp().parameters(), torch.optim.AdamW, lr=1.0)
    floats.load_state_dict(saved)  # files of both kinds load into both
    assert floats.param_groups[0]["lr"] == 1e-3


def test_true_wd_decays_with_a_tensor_lr_as_with_a_float_one():
    def run(tensors):
        model = mlp()
        opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, wd=0.1,
                          true_wd=True)  # fmt: skip
        if tensors:
            opt.hypers_as_tensors()
        fit(1, model, F.cross_entropy, opt, make_data())
        return model

    for a, b in zip(run(True).state_dict().values(), run(False).state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_foreach_without_capturable_is_refused_with_the_fix():
    params = mlp().parameters()
    opt = HPOptimizer(params, torch.optim.AdamW, lr=1e-3)
    opt.opt.param_groups[0]["foreach"] = True  # a GPU's default
    with pytest.raises(
        ValueError,
        match=r"AdamW\(foreach=True, capturable=False\).*Fix:.*capturable=True",
    ):
        opt.hypers_as_tensors()
    assert type(opt.param_groups[0]["lr"]) is float  # nothing converted


def test_a_hyper_parameter_torch_tests_in_python_is_refused_when_named():
    opt = HPOptimizer(mlp().parameters(), torch.optim.SGD, lr=0.1, mom=0.9)
    with pytest.raises(ValueError, match=r"SGD cannot hold 'mom'.*Fix: leave 'mom'"):
        opt.hypers_as_tensors(("lr", "mom"))
    with pytest.raises(ValueError, match=r"SGD cannot hold 'wd'"):
        opt.hypers_as_tensors("wd")
    with pytest.raises(ValueError, match=r"names must be some of"):
        opt.hypers_as_tensors(("eps",))
    assert opt.hypers_as_tensors(("lr",)) == ("lr",)


def test_multi_optimizer_converts_every_part_and_names_a_refusing_part():
    body, head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)
    multi = MultiOptimizer({
        "body": torch.optim.AdamW(body.parameters(), lr=1e-3),
        "head": torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9),
    })  # fmt: skip
    assert multi.hypers_as_tensors() == {"body": ("lr", "mom", "beta"),
                                         "head": ("lr",)}  # fmt: skip
    multi.lr = {"body": 2e-3, "head": 0.2}
    assert multi.lr == [2e-3, 0.2] and multi["head"].param_groups[0]["lr"].item() == (
        pytest.approx(0.2)
    )
    torch.nn.Sequential(body, head)(torch.randn(2, 8)).sum().backward()
    multi.step()
    assert multi.stepped == (0.2, 0.9)
    with pytest.raises(ValueError, match=r"part 'head': .*SGD cannot hold 'mom'"):
        multi.hypers_as_tensors(("lr", "mom"))


class TensorHypers(Callback):
    """Holds the fit's hyper-parameters as tensors (what a compiled step does)."""

    def on_train_begin(self, opt):
        opt.hypers_as_tensors()


def adamw_learner(callbacks):
    data = make_data()
    return Learner(data, mlp(), F.cross_entropy, opt_func=torch.optim.AdamW,
                   progress=False, callbacks=list(callbacks))  # fmt: skip


def test_a_run_with_tensor_hypers_resumes_exactly_through_checkpoint(tmp_path):
    ref = adamw_learner([TensorHypers()])
    ref.fit_one_cycle(3, 1e-2)
    for at in (4, 11, None):
        extra = [Crash(at)] if at is not None else []
        ckpt = Checkpoint(tmp_path, every_n_steps=3)
        learn = adamw_learner([ckpt, TensorHypers(), *extra])
        try:
            learn.fit_one_cycle(3, 1e-2)
        except RuntimeError:
            assert at is not None
    assert learn.opt.hypers_as_tensors() == ("lr", "mom", "beta")
    assert isinstance(learn.opt.param_groups[0]["lr"], torch.Tensor)
    for a, b in zip(ref.model.state_dict().values(), learn.model.state_dict().values()):
        assert torch.equal(a, b)
    assert ref.recorder.lrs == learn.recorder.lrs
    assert all(type(lr) is float for lr in learn.recorder.lrs)
    groups = param_groups(torch.load(next(tmp_path.rglob("checkpoint-*.pth"))))
    assert groups and all(type(g["lr"]) is float for g in groups)  # floats in files
    assert all(type(b) is float for g in groups for b in g["betas"])


def param_groups(saved):
    """Every parameter group found anywhere in a saved file's dicts."""
    if not isinstance(saved, dict):
        return []
    found = saved.get("param_groups")
    found = found if isinstance(found, list) else []
    return found + [g for v in saved.values() for g in param_groups(v)]


def test_hypers_as_floats_puts_the_mirrors_floats_back_without_a_device_read():
    opt = HPOptimizer(mlp().parameters(), torch.optim.AdamW, lr=1e-3)
    opt.hypers_as_tensors()
    opt.lr, opt.mom = 1 / 3, 0.8  # 1/3: a float32 tensor could not hold it
    group = opt.param_groups[0]
    group["lr"].fill_(5.0)  # what the floats come from: the mirror, not the tensor
    assert opt.hypers_as_floats(("lr",)) == ("mom", "beta")
    assert type(group["lr"]) is float and group["lr"] == 1 / 3
    assert isinstance(group["betas"][0], torch.Tensor)
    assert opt.hypers_as_floats() == ()
    assert group["betas"] == (0.8, 0.999) and type(group["betas"][0]) is float
    assert opt.hypers_as_floats() == ()  # idempotent
    opt.lr = 0.1  # the setters write floats again
    assert group["lr"] == 0.1 and opt.hypers_as_tensors() == ("lr", "mom", "beta")


def test_multi_optimizer_puts_floats_back_in_every_part():
    body, head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)
    multi = MultiOptimizer({
        "body": torch.optim.AdamW(body.parameters(), lr=1e-3),
        "head": torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9),
    })  # fmt: skip
    multi.hypers_as_tensors()
    assert multi.hypers_as_floats() == {"body": (), "head": ()}
    assert [type(g["lr"]) for g in multi.param_groups] == [float, float]
    assert multi.lr == [1e-3, 0.1]


def test_a_tensor_lr_on_the_cpu_steps_as_the_float_lr_does():
    # float64 on the CPU: lr / bias_correction computed as with a Python float.
    def trained(tensors):
        model = mlp()
        opt = HPOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
        if tensors:
            opt.hypers_as_tensors(("lr",))
        fit(1, model, F.cross_entropy, opt, make_data())
        return model

    for a, b in zip(trained(True).parameters(), trained(False).parameters()):
        assert torch.equal(a, b)
