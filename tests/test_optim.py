import copy
import re

import pytest
import torch
from torch import nn

from fitlib import HPOptimizer


def params(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def train(model, opt, steps=5):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    ("opt_func", "mom_key", "beta_key"),
    [
        (torch.optim.SGD, ("momentum", None), None),
        (torch.optim.RMSprop, ("momentum", None), ("alpha", None)),
        (torch.optim.Adam, ("betas", 0), ("betas", 1)),
        (torch.optim.AdamW, ("betas", 0), ("betas", 1)),
    ],
)
def test_setters_write_the_optimizers_own_hyper_parameters(opt_func, mom_key, beta_key):
    opt = HPOptimizer(params().parameters(), opt_func, lr=0.1)
    opt.lr, opt.mom, opt.wd = 0.01, 0.8, 1e-3
    group = opt.param_groups[0]
    assert group["lr"] == 0.01 and group["weight_decay"] == 1e-3
    key, i = mom_key
    assert (group[key] if i is None else group[key][i]) == 0.8
    assert (opt.lr, opt.mom, opt.wd) == (0.01, 0.8, 1e-3)
    if beta_key is None:
        with pytest.raises(ValueError, match="SGD has no hyper-parameter 'beta'"):
            opt.beta = 0.99
    else:
        opt.beta = 0.9
        key, i = beta_key
        assert (group[key] if i is None else group[key][i]) == 0.9
        assert opt.beta == 0.9


def test_mom_on_an_optimizer_without_momentum_says_what_it_has():
    opt = HPOptimizer(params().parameters(), torch.optim.Adagrad, lr=0.1)
    with pytest.raises(ValueError, match="Adagrad has no hyper-parameter 'mom'") as e:
        opt.mom = 0.9
    assert "It has: lr, wd" in str(e.value)


def test_constructor_arguments_match_the_plain_optimizer():
    a, b = params(), params()
    opt = HPOptimizer(a.parameters(), torch.optim.SGD, lr=0.1, mom=0.9, wd=1e-2)
    ref = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
    for x, y in zip(train(a, opt), train(b, ref)):
        assert torch.equal(x, y)


def test_values_per_parameter_group_for_discriminative_rates():
    m = params()
    groups = [{"params": m[0].parameters()}, {"params": m[1].parameters()}]
    opt = HPOptimizer(groups, torch.optim.Adam, lr=[1e-3, 1e-2], mom=0.9)
    assert opt.lr == [1e-3, 1e-2]
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 1e-2]
    assert opt.mom == 0.9  # equal across groups reads as one float
    opt.mom = (0.8, 0.85)
    assert [g["betas"][0] for g in opt.param_groups] == [0.8, 0.85]
    with pytest.raises(ValueError, match="got 3 values"):
        opt.lr = [1e-3, 1e-2, 1e-1]


@pytest.mark.parametrize("bad", [0, -1e-3, [1e-3, 0.0]])
def test_non_positive_lr_is_rejected(bad):
    with pytest.raises(
        ValueError, match=rf"lr must be > 0: .*got {re.escape(repr(bad))}"
    ):
        HPOptimizer(params().parameters(), torch.optim.SGD, lr=bad)


def test_true_wd_with_adam_equals_adamw():
    a, b = params(), params()
    opt = HPOptimizer(a.parameters(), torch.optim.Adam, lr=1e-2, wd=0.1, true_wd=True)
    ref = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in zip(train(a, opt), train(b, ref)):
        assert torch.equal(x, y)
    assert opt.wd == 0.1


def test_true_wd_with_sgd_decays_weights_apart_from_the_gradient():
    a, b = params(), params()
    lr, wd = 0.1, 0.05
    opt = HPOptimizer(a.parameters(), torch.optim.SGD, lr=lr, wd=wd, true_wd=True)
    assert opt.param_groups[0]["weight_decay"] == 0.0  # not L2 in the gradient
    ref = torch.optim.SGD(b.parameters(), lr=lr)

    class Decoupled:
        def step(self):
            with torch.no_grad():
                for p in b.parameters():
                    p.mul_(1 - lr * wd)
            ref.step()

        def zero_grad(self):
            ref.zero_grad()

    for x, y in zip(train(a, opt), train(b, Decoupled())):
        assert torch.equal(x, y)


def test_true_wd_decides_on_wd_alone_so_a_step_at_lr_0_keeps_its_decay():
    # A CUDA graph captured at lr 0 replays the kernels it recorded: the decay
    # must be launched at lr 0 too (a no-op there), to act once the tensor lr
    # is filled with more.
    m = params()
    opt = HPOptimizer(m.parameters(), torch.optim.SGD, lr=0.1, wd=0.5, true_wd=True)
    opt.hypers_as_tensors(("lr",))
    opt.lr = 0.0  # (a schedule's end, or its start)
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    before = [p.clone() for p in m.parameters()]
    versions = [p._version for p in m.parameters()]
    opt._decay()
    assert [p._version for p in m.parameters()] != versions  # launched at lr 0
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before))  # no-op
    opt.lr = 0.1
    opt._decay()
    assert all(torch.allclose(p, q * (1 - 0.1 * 0.5))
               for p, q in zip(m.parameters(), before))  # fmt: skip
    opt.hypers_as_floats()
    opt.lr = 0.0
    opt.step()  # floats: lr 0 then lr > 0 decays as before
    assert all(torch.allclose(p, q * (1 - 0.1 * 0.5))
               for p, q in zip(m.parameters(), before))  # fmt: skip
    opt.lr = 0.2
    opt.step()
    assert all(torch.allclose(p, q * 0.95 * 0.9 - 0.2)
               for p, q in zip(m.parameters(), before))  # fmt: skip


def test_true_wd_skips_parameters_without_gradient():
    m = params()
    m[0].requires_grad_(False)
    before = m[0].weight.clone()
    opt = HPOptimizer(m.parameters(), torch.optim.SGD, lr=0.1, wd=0.5, true_wd=True)
    train(m, opt, steps=2)
    assert torch.equal(m[0].weight, before)


def test_state_dict_round_trip_restores_hyper_parameters_and_moments():
    a, b = params(), params()
    opt = HPOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2, mom=0.8, wd=0.1)
    train(a, opt, steps=3)
    state = copy.deepcopy(opt.state_dict())  # as a save and load would
    b.load_state_dict(a.state_dict())
    other = HPOptimizer(b.parameters(), torch.optim.AdamW, lr=0.5, mom=0.5, wd=0.0)
    other.load_state_dict(state)
    assert (other.lr, other.mom, other.wd) == (1e-2, 0.8, 0.1)
    for x, y in zip(train(a, opt), train(b, other)):
        assert torch.equal(x, y)


def test_loading_a_bare_torch_state_dict_explains_the_fix():
    opt = HPOptimizer(params().parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"opt.opt.load_state_dict"):
        opt.load_state_dict(opt.opt.state_dict())


def test_a_misspelled_hyper_parameter_lists_what_the_groups_hold():
    opt = HPOptimizer(params().parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"hold no 'momentom' \(did you mean "
                       r"'momentum'\?\)") as e:  # fmt: skip
        opt.set("momentom", 0.9)
    assert "lr, mom, wd, momentum, dampening, weight_decay" in str(e.value)


# -- any hyper-parameter of the parameter groups, by its torch name ----------------
def test_any_number_in_the_groups_is_read_and_set_by_its_torch_name():
    adam = HPOptimizer(params().parameters(), torch.optim.Adam, lr=1e-3)
    adam.set("eps", 1e-6)
    adam.set("betas[1]", 0.98)
    group = adam.param_groups[0]
    assert group["eps"] == 1e-6 and group["betas"] == (0.9, 0.98)
    assert adam.get("eps") == [1e-6] and adam.beta == 0.98
    sgd = HPOptimizer(params().parameters(), torch.optim.SGD, lr=0.1, mom=0.9)
    sgd.set("dampening", 0.1)
    assert sgd.param_groups[0]["dampening"] == 0.1 and sgd.has("dampening")
    assert not sgd.has("eps") and sgd.has("momentum")


def test_hyper_names_list_fitlibs_names_then_the_groups_numbers():
    adam = HPOptimizer(params().parameters(), torch.optim.Adam, lr=1e-3)
    assert adam.hyper_names() == [
        "lr", "mom", "wd", "beta", "betas[0]", "betas[1]", "eps", "weight_decay",
    ]  # fmt: skip
    assert all(adam.has(n) for n in adam.hyper_names())


def test_a_value_per_group_must_match_the_groups():
    body, head = params()
    groups = [{"params": body.parameters()}, {"params": head.parameters()}]
    opt = HPOptimizer(groups, torch.optim.Adam, lr=1e-3)
    opt.set("eps", [1e-8, 1e-6])
    assert opt.get("eps") == [1e-8, 1e-6]
    with pytest.raises(ValueError, match=r"eps: got 3 values .* for 2 parameter"):
        opt.set("eps", [1e-8, 1e-7, 1e-6])


@pytest.mark.parametrize(
    ("torch_name", "ours", "opt_func", "value"),
    [
        ("weight_decay", "wd", torch.optim.SGD, 1e-3),
        ("momentum", "mom", torch.optim.SGD, 0.8),
        ("betas[0]", "mom", torch.optim.Adam, 0.8),
        ("betas[1]", "beta", torch.optim.Adam, 0.95),
        ("alpha", "beta", torch.optim.RMSprop, 0.95),
    ],
)
def test_a_torch_name_of_fitlibs_hyper_parameter_is_the_same_one(
    torch_name, ours, opt_func, value
):
    opt = HPOptimizer(params().parameters(), opt_func, lr=0.1)
    assert opt.canonical(torch_name) == ours
    opt.set(torch_name, value)
    assert getattr(opt, ours) == value
    opt.scale(torch_name, 0.5)  # one factor, whichever name scales
    opt.set_scheduled(ours, value)
    assert getattr(opt, ours) == pytest.approx(value * 0.5)


def test_weight_decay_by_its_torch_name_stays_decoupled_with_true_wd():
    opt = HPOptimizer(params().parameters(), torch.optim.SGD, lr=0.1, true_wd=True)
    opt.set("weight_decay", 0.1)
    assert opt.param_groups[0]["weight_decay"] == 0.0  # not the coupled decay
    assert opt.wd == 0.1 and opt.get("weight_decay") == [0.1]


def test_momentum_on_adam_is_refused_not_taken_for_beta1():
    adam = HPOptimizer(params().parameters(), torch.optim.Adam, lr=1e-3)
    assert adam.canonical("momentum") == "momentum"
    with pytest.raises(ValueError, match="Adam has no hyper-parameter 'momentum'"):
        adam.set("momentum", 0.9)


class Scaled(torch.optim.SGD):
    """A custom optimizer with its own hyper-parameter in the groups."""

    def __init__(self, params, lr=0.1, gain=1.0):
        super().__init__(params, lr=lr)
        for group in self.param_groups:
            group["gain"] = gain

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] * group["gain"])


def test_a_custom_optimizers_own_key_is_a_hyper_parameter():
    model = params()
    opt = HPOptimizer(model.parameters(), Scaled, lr=0.1)
    assert "gain" in opt.hyper_names()
    opt.set("gain", -2.0)  # any finite number: fitlib knows no range for it
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    p, g = next(model.parameters()), next(model.parameters()).grad
    assert torch.allclose(p, before[0] + 0.2 * g)
    with pytest.raises(ValueError, match="gain must be a finite number"):
        opt.set("gain", float("inf"))


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "betas",
            r"'betas' holds 2 values \(0.9, 0.999\).*name one, e.g. 'betas\[0\]'",
        ),
        ("betas[2]", r"'betas' holds \(0.9, 0.999\), which has no number at"),
        ("amsgrad", "'amsgrad' holds False, not a number"),
        ("eps.1", "is no hyper-parameter name"),
        ("epz", r"\(did you mean 'eps'\?\)"),
    ],
)
def test_a_name_the_groups_hold_no_number_under_is_refused(name, message):
    adam = HPOptimizer(params().parameters(), torch.optim.Adam, lr=1e-3)
    with pytest.raises(ValueError, match=message):
        adam.get(name)
    assert not adam.has(name) if name != "eps.1" else True


def test_a_key_only_some_groups_hold_is_refused():
    body, head = params()
    groups = [{"params": body.parameters(), "gain": 1.0}, {"params": head.parameters()}]
    opt = HPOptimizer(groups, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="only some parameter groups hold 'gain'"):
        opt.set("gain", 2.0)


@pytest.mark.parametrize(
    ("name", "value", "error", "message"),
    [
        ("eps", "1e-8", TypeError, r"eps must be a number .* opt.set\('eps', "),
        ("eps", -1e-8, ValueError, "eps must be a finite number >= 0"),
        ("betas[1]", 1.0, ValueError, r"beta must be in \[0, 1\)"),
        ("weight_decay", -0.1, ValueError, "wd must be a finite number >= 0"),
    ],
)
def test_a_value_of_the_wrong_type_or_range_is_refused(name, value, error, message):
    adam = HPOptimizer(params().parameters(), torch.optim.Adam, lr=1e-3)
    with pytest.raises(error, match=message):
        adam.set(name, value)
    assert adam.get("eps") == [1e-8] and adam.beta == 0.999  # unchanged


def test_scale_of_any_key_persists_under_a_schedule_until_reset():
    adam = HPOptimizer(params().parameters(), torch.optim.Adam, lr=1e-3)
    adam.scale("eps", 0.1)
    adam.set_scheduled("eps", 1e-6)
    assert adam.get("eps") == [pytest.approx(1e-7)]
    adam.reset_scales()
    adam.set_scheduled("eps", 1e-6)
    assert adam.get("eps") == [1e-6]
    assert not [k for k in adam.param_groups[0] if k.endswith("_scale")]


def test_set_is_the_one_write_path_for_checks_and_decoupled_decay():
    opt = HPOptimizer(params().parameters(), torch.optim.Adam, lr=1e-2, true_wd=True)
    opt.set("wd", 0.5)
    group = opt.param_groups[0]
    assert group["weight_decay"] == 0.5 and group["decoupled_weight_decay"]
    with pytest.raises(ValueError, match="lr must be a finite number >= 0"):
        opt.set("lr", -1e-3)
    opt.set("lr", 0)  # a schedule may anneal to 0: allowed after construction
    assert opt.lr == 0.0


def test_zero_weight_decay_is_accepted_by_optimizers_without_weight_decay():
    opt = HPOptimizer(params().parameters(), torch.optim.Rprop, lr=0.01)
    opt.wd = 0.0  # e.g. a Learner's second fit: nothing to do
    with pytest.raises(ValueError, match="Rprop has no hyper-parameter 'wd'"):
        opt.wd = 0.1


def test_wrap_adopts_an_existing_optimizer_as_it_is():
    model = params()
    raw = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = HPOptimizer.wrap(raw)
    assert opt.opt is raw and (opt.lr, opt.mom) == (0.1, 0.9)
    assert HPOptimizer.wrap(opt) is opt
    with pytest.raises(TypeError, match=r"opt must be a torch\.optim\.Optimizer"):
        HPOptimizer.wrap(object())


@pytest.mark.parametrize(
    ("opt_func", "mom"),
    [(torch.optim.SGD, 0.9), (torch.optim.AdamW, 0.8), (torch.optim.Rprop, None)],
)
def test_step_notes_the_lr_and_momentum_it_used(opt_func, mom):
    model = params()
    kwargs = {} if mom is None else {"mom": mom}
    opt = HPOptimizer(model.parameters(), opt_func, lr=0.1, **kwargs)
    assert opt.stepped is None
    train(model, opt, steps=1)
    opt.lr = 0.01  # a scheduler setting the next step's lr
    if mom is not None:
        opt.mom = 0.5
    assert opt.stepped == (0.1, mom)
    train(model, opt, steps=1)
    assert opt.stepped == (0.01, None if mom is None else 0.5)


# -- values torch would refuse ---------------------------------------------------
@pytest.mark.parametrize(
    "name, value, error, words",
    [
        ("mom", "high", TypeError, r"mom must be a number .*got 'high' \(str\)"),
        ("mom", 1.0, ValueError, r"mom must be in \[0, 1\).*got 1\.0"),
        ("beta", -0.1, ValueError, r"beta must be in \[0, 1\)"),
        ("wd", -1e-4, ValueError, r"wd must be a finite number >= 0.*opt\.wd = 1e-2"),
        ("wd", "0.01", TypeError, r"wd must be a number.*got '0\.01' \(str\)"),
        ("lr", float("inf"), ValueError, r"lr must be a finite number >= 0"),
        ("lr", [0.1, "x"], TypeError, r"lr must be a number"),
    ],
)
def test_values_torch_would_refuse_are_refused_naming_the_value(
    name, value, error, words
):
    opt = HPOptimizer(params().parameters(), torch.optim.Adam, lr=1e-2)
    before = copy.deepcopy(opt.param_groups[0])
    with pytest.raises(error, match=words):
        setattr(opt, name, value)
    assert {k: v for k, v in opt.param_groups[0].items() if k != "params"} == {
        k: v for k, v in before.items() if k != "params"
    }


def test_an_empty_parameter_list_and_a_string_opt_func_are_refused():
    with pytest.raises(ValueError, match=r"params is empty.*model\.parameters\(\)"):
        HPOptimizer([], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="params is empty"):
        HPOptimizer(nn.ReLU().parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match=r"opt_func must be a torch optimizer .*'adam'"):
        HPOptimizer(params().parameters(), "adam", lr=0.1)


def test_a_count_of_values_unlike_the_groups_is_refused_naming_them():
    opt = HPOptimizer(params().parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"got 2 values \[0\.1, 0\.2\] for 1 param"):
        opt.mom = [0.1, 0.2]


def test_the_optimizer_spreads_a_slice_over_its_groups_when_made_and_in_set_lr():
    model = params()
    groups = [{"params": m.parameters()} for m in model]
    opt = HPOptimizer(groups, torch.optim.SGD, lr=slice(1e-3, 1e-2))
    assert opt.lr == pytest.approx([1e-3, 1e-2])
    opt.set_lr(slice(1e-1))
    assert opt.lr == pytest.approx([1e-2, 1e-1])
    opt.set_lr(0.5)
    assert opt.lr == 0.5
    with pytest.raises(ValueError, match=r"max_lr must be > 0: .*got -1"):
        opt.set_lr(-1, name="max_lr")


# -- scale: reductions that persist under a schedule -----------------------------
def test_scale_multiplies_now_and_every_scheduled_value_until_reset():
    model = params()
    groups = [{"params": m.parameters()} for m in model]
    opt = HPOptimizer(groups, torch.optim.SGD, lr=[0.1, 0.2])
    opt.scale("lr", 0.5)
    assert opt.lr == [0.05, 0.1]
    opt.set_scheduled("lr", [0.4, 0.8])
    assert opt.lr == [0.2, 0.4]
    opt.scale("lr", [0.5, 1.0])
    opt.set_scheduled("lr", 1.0)
    assert opt.lr == [0.25, 0.5]
    opt.lr = 0.3  # set writes exactly the value given
    assert opt.lr == 0.3
    # The factors live in the param groups: a saved state keeps them.
    copy_opt = HPOptimizer(
        [{"params": m.parameters()} for m in params()], torch.optim.SGD, lr=0.1
    )
    copy_opt.load_state_dict(opt.state_dict())
    copy_opt.set_scheduled("lr", 1.0)
    assert copy_opt.lr == [0.25, 0.5]
    opt.reset_scales()
    opt.set_scheduled("lr", 1.0)
    assert opt.lr == 1.0
    with pytest.raises(ValueError, match=r"lr factor must be a finite number >= 0"):
        opt.scale("lr", -1)


def test_numpy_numbers_arrays_and_0_dim_tensors_are_numbers_too():
    import numpy as np

    model = params()
    groups = [{"params": m.parameters()} for m in model]
    opt = HPOptimizer(groups, torch.optim.SGD, lr=0.1)
    opt.lr = np.array([1e-4, 1e-3])
    assert opt.lr == [1e-4, 1e-3]
    opt.mom, opt.wd = np.float32(0.5), torch.tensor(0.01)
    assert opt.mom == 0.5 and opt.wd == pytest.approx(0.01)


def test_an_optimizer_instance_for_opt_func_says_to_pass_the_class():
    opt = torch.optim.AdamW(params().parameters())
    with pytest.raises(TypeError, match=r"got an instance of AdamW.*optim\.AdamW \("):
        HPOptimizer(params().parameters(), opt, lr=0.1)


def test_an_int_lr_or_momentum_becomes_the_same_float():
    # So each step notes floats, which the Recorder keeps without converting.
    params = [torch.nn.Parameter(torch.ones(2))]
    opt = HPOptimizer.wrap(torch.optim.SGD(params, lr=1))  # momentum=0: an int
    group = opt.param_groups[0]
    assert (group["lr"], group["momentum"]) == (1.0, 0.0)
    assert type(group["lr"]) is float and type(group["momentum"]) is float
    params[0].grad = torch.ones(2)
    opt.step()
    assert opt.stepped == (1.0, 0.0) and all(type(v) is float for v in opt.stepped)
