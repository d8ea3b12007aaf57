"""ActivationCheckpointing: chosen submodules recomputed in the backward pass;
the same gradients as the plain model, a lower peak of memory, nothing left
on the model after the fit."""

import itertools
from pathlib import Path

import pytest
import torch
from helpers import Crash, make_data
from recipes_child import killed_and_resumed_equal
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.profiler import ProfilerActivity, profile

from fitlib import Callback, HPOptimizer, Learner, fit
from fitlib.callback import call_hook
from fitlib.callbacks import (
    ActivationCheckpointing,
    Compile,
    MixedPrecision,
)

pytestmark = pytest.mark.usefixtures("one_thread")
HERE = Path(__file__).parent


def blocks(width=64, depth=3, seed=0):
    """An MLP of ``depth`` blocks (named "0", "1", ...), each with dropout:
    8 features in, 3 classes out."""
    torch.manual_seed(seed)
    sizes = [8] + [32] * (depth - 1) + [3]
    return nn.Sequential(*[
        nn.Sequential(nn.Linear(a, width), nn.GELU(), nn.Dropout(0.3),
                      nn.Linear(width, b))
        for a, b in itertools.pairwise(sizes)
    ])  # fmt: skip


def run(model, *callbacks, epochs=2):
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    torch.manual_seed(1)
    return fit(epochs, model, F.cross_entropy, opt, make_data(),
               callbacks=list(callbacks))  # fmt: skip


def step_grads(model, x, y, seed=2):
    """The gradients of one training step, dropout drawing from ``seed``."""
    model.zero_grad()
    torch.manual_seed(seed)
    F.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def values(history):
    """A history's records without their times."""
    return [{k: v for k, v in r.items() if k != "time"} for r in history]


def state(model):
    return [t.clone() for t in model.state_dict().values()]


# -- what it computes ----------------------------------------------------------------
def test_gradients_with_dropout_equal_the_plain_models_bit_for_bit():
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    plain, wrapped = blocks(), blocks()
    ac = ActivationCheckpointing(["0", "2"])
    call_hook(ac, "on_train_begin", model=wrapped)
    assert same(step_grads(plain, x, y), step_grads(wrapped, x, y))
    unkept = ActivationCheckpointing(["0", "2"], preserve_rng_state=False)
    call_hook(ac, "on_train_end")
    call_hook(unkept, "on_train_begin", model=wrapped)  # the control: other masks
    assert not same(step_grads(plain, x, y), step_grads(wrapped, x, y))


def test_a_whole_fit_trains_as_the_plain_model_bit_for_bit():
    plain, wrapped = blocks(), blocks()
    ref = run(plain)
    history = run(wrapped, ActivationCheckpointing(["0", "1", "2"]))
    assert same(state(plain), state(wrapped)) and values(history) == values(ref)


def bn_blocks(seed=0):
    """Two blocks holding BatchNorm (one with momentum=None, a cumulative
    average that divides by num_batches_tracked): 8 features in, 3 out."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU()),
        nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16, momentum=None),
                      nn.ReLU(), nn.Linear(16, 3)),
    )  # fmt: skip


def test_batchnorm_statistics_update_once_per_step_as_the_plain_models():
    # the recomputation in the backward runs BatchNorm's forward again: its
    # running statistics and num_batches_tracked must not move a second time
    plain, wrapped = bn_blocks(), bn_blocks()
    ref = run(plain)
    history = run(wrapped, ActivationCheckpointing(["0", "1"]))
    a, b = plain.state_dict(), wrapped.state_dict()
    tracked = "0.1.num_batches_tracked"
    assert b[tracked] == a[tracked] == 2 * 7  # 2 epochs of 7 batches
    assert all(torch.equal(a[k], b[k]) for k in a), [
        k for k in a if not torch.equal(a[k], b[k])
    ]
    assert values(history) == values(ref)


def test_a_chosen_batchnorm_itself_updates_once_per_step():
    plain, wrapped = bn_blocks(), bn_blocks()
    run(plain)
    run(wrapped, ActivationCheckpointing(nn.BatchNorm1d))
    a, b = plain.state_dict(), wrapped.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


class Calls(nn.Module):
    """Counts its forward calls, by grad mode."""

    def __init__(self):
        super().__init__()
        self.lin, self.grad, self.no_grad = nn.Linear(8, 3), 0, 0

    def forward(self, x):
        if torch.is_grad_enabled():
            self.grad += 1
        else:
            self.no_grad += 1
        return self.lin(x)


def test_a_training_step_runs_the_chosen_forward_twice_validation_once():
    model = nn.Sequential(Calls())
    run(model, ActivationCheckpointing("0"), epochs=1)  # 7 batches, 3 in validation
    assert (model[0].grad, model[0].no_grad) == (7 + 7, 3)  # recomputed in backward
    run(model, epochs=1)
    assert (model[0].grad, model[0].no_grad) == (14 + 7, 6)  # plain after the fit


def peak_bytes(model, x, y):
    """The peak of the CPU allocator's bytes in one training step, from the
    allocations and frees torch's CPU allocator reports to the profiler."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        F.cross_entropy(model(x), y).backward()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]"]  # fmt: skip
    now = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        now += e.nbytes()
        peak = max(peak, now)
    return peak


def test_the_peak_memory_of_a_step_falls():
    x, y = torch.randn(512, 8), torch.randint(0, 3, (512,))
    model = blocks(width=1024, depth=4)
    plain = peak_bytes(model, x, y)
    # the instrument sees the activations: each block keeps 512 x 1024 float32
    # (4 MiB) at least three times (its first layer's output, the GELU's, the
    # dropout's) and a mask
    assert plain > 4 * 3 * 512 * 1024 * 4
    call_hook(ActivationCheckpointing(["0", "1", "2", "3"]), "on_train_begin",
              model=model)  # fmt: skip
    model.zero_grad(set_to_none=True)
    checkpointed = peak_bytes(model, x, y)
    assert checkpointed < 0.6 * plain, (checkpointed, plain)


# -- composes with the others --------------------------------------------------------
def test_with_bfloat16_mixed_precision_trains_as_the_plain_model():
    plain, wrapped = blocks(), blocks()
    ref = run(plain, MixedPrecision(torch.bfloat16))
    history = run(wrapped, MixedPrecision(torch.bfloat16),
                  ActivationCheckpointing(["0", "1", "2"]))  # fmt: skip
    assert same(state(plain), state(wrapped)) and values(history) == values(ref)


@pytest.fixture
def fresh_compiler():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


class AotEager:
    """torch.compile's "aot_eager" backend, noting each graph's code."""

    def __init__(self):
        self.codes = []

    def __call__(self, gm, example_inputs):
        self.codes.append(gm.code)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


@pytest.mark.usefixtures("fresh_compiler")
def test_under_compile_trains_as_the_compiled_plain_model():
    plain, wrapped, graphs = blocks(), blocks(), AotEager()
    run(plain, Compile(backend="aot_eager"))
    run(wrapped, Compile(backend=graphs), ActivationCheckpointing(["0", "1"]))
    for a, b in zip(state(plain), state(wrapped), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # traced into the graph (torch's higher-order checkpoint op), not broken off
    assert "checkpoint" in graphs.codes[0]
    assert "forward" not in vars(wrapped[0])


@pytest.mark.usefixtures("fresh_compiler")
def test_under_compile_batchnorm_statistics_update_once_per_step():
    def model():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU()),
            nn.Linear(16, 3),
        )

    plain, wrapped, graphs = model(), model(), AotEager()
    run(plain, Compile(backend="aot_eager"))
    run(wrapped, Compile(backend=graphs), ActivationCheckpointing("0"))
    a, b = plain.state_dict(), wrapped.state_dict()
    assert b["0.1.num_batches_tracked"] == a["0.1.num_batches_tracked"] == 2 * 7
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)
    assert "checkpoint" in graphs.codes[0]  # still traced, not broken off


def test_with_several_optimizers_trains_as_the_plain_model():
    def learner(*callbacks):
        learn = Learner(
            make_data(),
            blocks(),
            F.cross_entropy,
            progress=False,
            opt_func={
                "0": torch.optim.SGD,
                "1": torch.optim.Adam,
                "2": torch.optim.SGD,
            },
            callbacks=list(callbacks),
        )
        torch.manual_seed(1)
        learn.fit(2, lr={"0": 0.1, "1": 0.01, "2": 0.1})
        return learn

    plain, wrapped = learner(), learner(ActivationCheckpointing(["0", "2"]))
    assert same(state(plain.model), state(wrapped.model))


def test_under_ddp_it_trains_as_the_plain_model_and_recomputes(one_process_group):
    def learner(model, *callbacks):
        learn = Learner(
            make_data(),
            model,
            F.cross_entropy,
            progress=False,
            opt_func=torch.optim.SGD,
            callbacks=list(callbacks),
        )
        learn.to_distributed(backend="gloo")
        torch.manual_seed(1)
        learn.fit(1, lr=0.1)
        return learn

    plain = learner(blocks())
    wrapped = learner(blocks(), ActivationCheckpointing(["0", "1", "2"]))
    assert same(state(plain.model), state(wrapped.model))
    counted = nn.Sequential(Calls())
    learner(counted, ActivationCheckpointing("0"))  # 7 batches, 3 in validation
    assert (counted[0].grad, counted[0].no_grad) == (7 + 7, 3)


# -- the model stays as it was -------------------------------------------------------
class Keys(Callback):
    def on_batch_end(self, model, train):
        if train:
            self.keys = list(model.state_dict())


def test_the_state_dict_keys_stay_the_plain_ones_during_and_after_the_fit():
    model, keys = blocks(), Keys()
    before = list(model.state_dict())
    run(model, ActivationCheckpointing(["0", "1"]), keys)
    assert keys.keys == before and list(model.state_dict()) == before
    assert "forward" not in vars(model[0]) and "forward" not in vars(model[1])


def test_an_error_in_training_puts_the_forwards_back():
    model = blocks()
    with pytest.raises(RuntimeError, match="crash"):
        run(model, ActivationCheckpointing(["0", "1"]), Crash(2))
    assert all("forward" not in vars(m) for m in model.modules())


def test_a_forward_the_user_set_on_a_module_is_put_back():
    model = blocks()
    own = model[1].forward
    model[1].forward = own  # an instance attribute of the user's
    run(model, ActivationCheckpointing("1"), epochs=1)
    assert vars(model[1])["forward"] is own


def test_a_submodule_inside_a_chosen_one_is_left_to_the_outer_one():
    model = blocks()
    ac = ActivationCheckpointing(["0", "0.1", "1"])
    assert ac.chosen(model) == ["0", "1"]
    by_type = ActivationCheckpointing(nn.Sequential)  # not the root: its blocks
    assert by_type.chosen(model) == ["0", "1", "2"]
    by_test = ActivationCheckpointing(lambda name, m: isinstance(m, nn.Linear))
    assert by_test.chosen(model)[:2] == ["0.0", "0.3"]


# -- refusals, before training -------------------------------------------------------
def test_an_unknown_submodule_is_refused_with_did_you_mean(data):
    model = blocks()
    before = state(model)
    with pytest.raises(
        ValueError,
        match=r"unknown submodule '0.4' \(did you mean "
        r"'0.3'\?\); the model's top-level submodules are '0', '1', "
        r"'2'. Fix: name submodules as model.named_modules\(\)",
    ):
        run(model, ActivationCheckpointing(["0", "0.4"]))
    assert same(before, state(model))
    assert all("forward" not in vars(m) for m in model.modules())


def test_a_choice_of_no_submodule_is_refused():
    with pytest.raises(ValueError, match=r"modules=Conv2d matched no submodule of "
                       r"Sequential, so nothing would be recomputed"):  # fmt: skip
        run(blocks(), ActivationCheckpointing(nn.Conv2d))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"modules": 3}, r"modules must be submodule names, nn.Module types, or a "),
        ({"modules": []}, r"got \[\]"),
        ({"modules": [nn.Linear, int]}, r"got \[<class"),
        ({"modules": "0", "preserve_rng_state": 1}, r"preserve_rng_state must be Tr"),
    ],
)
def test_refuses_bad_arguments_with_the_fix(kwargs, match):
    with pytest.raises(TypeError, match=match):
        ActivationCheckpointing(**kwargs)


# -- exact resume --------------------------------------------------------------------
def test_killed_with_sigkill_at_random_moments_the_run_ends_identical(tmp_path):
    killed_and_resumed_equal(tmp_path, "checkpointing", seed=32)


# -- CUDA ------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_peak_memory_falls_and_the_gradients_are_the_plain_ones():
    x = torch.randn(4096, 8, device="cuda")
    y = torch.randint(0, 3, (4096,), device="cuda")
    plain, wrapped = blocks(width=2048, depth=4).cuda(), blocks(width=2048, depth=4)
    wrapped = wrapped.cuda()
    peaks = []
    for model in (plain, wrapped):
        if model is wrapped:
            call_hook(ActivationCheckpointing(["0", "1", "2", "3"]),
                      "on_train_begin", model=model)  # fmt: skip
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads = step_grads(model, x, y)
        torch.cuda.synchronize()
        peaks.append((torch.cuda.max_memory_allocated() - base, grads))
    (plain_peak, plain_grads), (ac_peak, ac_grads) = peaks
    assert ac_peak < 0.6 * plain_peak, (
        f"peak above the step's start: {ac_peak / 2**20:.1f} MiB checkpointed, "
        f"{plain_peak / 2**20:.1f} MiB plain"
    )
    for i, (a, b) in enumerate(zip(plain_grads, ac_grads, strict=True)):
        diff = (a - b).abs().max().item()
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (
            f"gradient {i} ({tuple(a.shape)}) differs: max |diff| {diff:.3g}"
        )
