"""``fitlib.hyper_checks``: a learning rate checked once (``check_lr``) and
spread over the parameter groups once (``lr_per_group``), the other
hyper-parameters' values, the optimizer class and its parameters. Through
``HPOptimizer``: ``tests/test_optim.py``."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from fitlib.errors import ArgTypeError
from fitlib.hyper_checks import (
    check_hyper,
    check_lr,
    check_no_parts,
    check_opt_func,
    check_params,
    is_hyper_number,
    lr_per_group,
)
from fitlib.lr_suggestions import SuggestedLRs


def test_lr_per_group_spreads_a_slice_geometrically_or_a_tenth_below_its_top():
    assert lr_per_group(slice(1e-4, 1e-2), 3) == pytest.approx([1e-4, 1e-3, 1e-2])
    assert lr_per_group(slice(1e-2), 3) == pytest.approx([1e-3, 1e-3, 1e-2])
    assert lr_per_group(0.1, 2) == [0.1, 0.1]
    assert lr_per_group(np.array([0.1, 0.2]), 2) == [0.1, 0.2]


def test_a_slice_of_learning_rates_needs_several_groups():
    for lr in (slice(1e-4, 1e-2), slice(1e-2)):
        with pytest.raises(ValueError, match=r"only 1 parameter group.*layer_groups"):
            lr_per_group(lr, 1)
    assert lr_per_group(slice(1e-2), 2) == [1e-3, 1e-2]


def test_a_count_unlike_the_groups_says_value_and_group_in_the_singular():
    with pytest.raises(ValueError) as info:
        lr_per_group([1e-3], 3)
    assert "lr: got 1 value [0.001] for 3 parameter groups." in str(info.value)
    with pytest.raises(ValueError) as info:
        lr_per_group([1e-3, 1e-2], 1, name="max_lr")
    message = str(info.value)
    assert "max_lr: got 2 values [0.001, 0.01] for 1 parameter group." in message
    assert message.endswith("Fix: pass one number.") and "1 values" not in message


@pytest.mark.parametrize(
    "bad", ["1e-3", None, [], [1e-3, "x"], slice(None, None), iter([1e-3])]
)
def test_an_lr_of_the_wrong_type_is_a_type_error_naming_it(bad):
    with pytest.raises(TypeError, match=r"lr must be > 0: a number, one per "):
        check_lr(bad)


def test_check_lr_accepts_what_lr_per_group_spreads_and_a_dict_by_part():
    for lr in (1e-3, [1e-3, 1e-2], slice(1e-4, 1e-2), slice(1e-2), torch.tensor(0.1)):
        check_lr(lr)
    check_lr({"encoder": 1e-3, "decoder": slice(1e-4, 1e-3)})
    with pytest.raises(ValueError, match=r"lr\['decoder'\] must be > 0"):
        check_lr({"encoder": 1e-3, "decoder": 0.0})
    with pytest.raises(ValueError, match="max_lr must be > 0") as info:
        check_lr(math.inf, "max_lr")
    assert not isinstance(info.value, TypeError)  # a value out of range


def test_lr_finds_suggestions_are_refused_naming_the_one_to_pick():
    with pytest.raises(ArgTypeError, match=r"Fix: pass the one to use, e\.g\. lr=s"):
        check_lr(SuggestedLRs(1e-3, 2e-3, 5e-4))


def test_hyper_values_torch_would_refuse_are_refused_by_range():
    check_hyper("mom", [0.0, 0.99])
    with pytest.raises(ValueError, match=r"mom must be in \[0, 1\)"):
        check_hyper("mom", [1.0])
    with pytest.raises(ValueError, match="wd must be a finite number >= 0"):
        check_hyper("wd", [-1e-2], fix="Learner(..., wd=1e-2)")
    with pytest.raises(TypeError, match=r"beta must be a number .*opt\.beta"):
        check_hyper("beta", ["0.9"])
    assert is_hyper_number(torch.tensor(0.5)) and not is_hyper_number(torch.ones(2))
    assert not is_hyper_number(True) and not is_hyper_number(torch.tensor(True))


def test_opt_func_params_and_parts_are_checked():
    check_opt_func(torch.optim.SGD)
    with pytest.raises(TypeError, match="got an instance of SGD"):
        check_opt_func(torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1))
    layer = nn.Linear(2, 1)
    assert check_params(layer.parameters()) == list(layer.parameters())
    with pytest.raises(ValueError, match="params is empty"):
        check_params([{"params": []}])
    check_no_parts(0.1, "lr")
    with pytest.raises(ValueError, match=r"lr=\{'encoder': 0\.1\} gives a value per"):
        check_no_parts({"encoder": 0.1}, "lr")


def test_other_keys_of_the_groups_are_checked_by_what_torch_allows():
    check_hyper("eps", [0.0, 1e-8])
    with pytest.raises(ValueError, match=r"eps must be a finite number >= 0"):
        check_hyper("eps", [-1e-8])
    check_hyper("gain", [-2.0])  # a custom optimizer's key: any finite number
    with pytest.raises(ValueError, match=r"gain must be a finite number \(a NaN"):
        check_hyper("gain", [math.nan])
    with pytest.raises(TypeError, match=r"Fix: e.g. opt.set\('gain', 0.5\)"):
        check_hyper("gain", [None])


def test_a_fix_sets_fitlibs_names_as_properties_and_others_with_set():
    from fitlib.hyper_checks import example_setting

    assert example_setting("wd") == "opt.wd = 1e-2"
    assert example_setting("betas[1]", "0.99") == "opt.set('betas[1]', 0.99)"


def test_groups_given_as_generators_keep_their_parameters():
    from fitlib.optim import HPOptimizer

    body, head = torch.nn.Linear(2, 3), torch.nn.Linear(3, 1)
    groups = [{"params": body.parameters()}, {"params": head.parameters(), "lr": 1.0}]
    opt = HPOptimizer(groups, torch.optim.SGD, lr=0.1)
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
