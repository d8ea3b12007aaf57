"""``fitlib.interpret_checks``: what ``ClassificationInterpretation`` checks
before it reads predictions: the class names, values that are no numbers,
and the indices of items to plot."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fitlib.interpret_checks import check_classes, check_finite, check_indices


def test_class_names_come_from_the_argument_the_dataset_or_the_indices():
    assert check_classes(["cat", "dog"], None, 2) == ["cat", "dog"]
    subset = SimpleNamespace(dataset=SimpleNamespace(classes=["a", "b", "c"]))
    assert check_classes(None, subset, 3) == ["a", "b", "c"]  # through a Subset
    assert check_classes(None, None, 2) == [0, 1]
    with pytest.raises(TypeError, match=r"got a dict .*classes=sorted\(d, key=d.get\)"):
        check_classes({"cat": 0, "dog": 1}, None, 2)
    with pytest.raises(ValueError, match=r"3 names .* for 2 scores per item"):
        check_classes(["a", "b", "c"], None, 2)
    with pytest.raises(ValueError, match=r"the names \['a'\] appear twice"):
        check_classes(["a", "a"], None, 2)


def test_values_that_are_no_numbers_are_counted_by_item():
    preds = torch.zeros(4, 3)
    assert check_finite(preds, "preds", "here") is preds
    preds[1, 2], preds[3, 0] = float("nan"), float("inf")
    with pytest.raises(ValueError, match=r"here: preds has NaN or inf values for "
                       r"2 of 4 items \(e\.g\. item 1\).*\.all\(dim=1\)"):  # fmt: skip
        check_finite(preds, "preds", "here")


def test_indices_are_ints_in_range_from_a_list_a_tensor_or_an_array():
    assert check_indices(torch.tensor([0, -1]), 5) == [0, -1]
    assert check_indices(np.array([1, 4]), 5) == [1, 4]
    with pytest.raises(ValueError, match=r"ints in \[0, 5\); got list \[5\]"):
        check_indices([5], 5)
    with pytest.raises(TypeError, match="non-empty list of item indices"):
        check_indices([0.5], 5)
    with pytest.raises(ValueError, match="got an empty list"):
        check_indices([], 5)
