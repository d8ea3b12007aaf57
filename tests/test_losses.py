"""``fitlib.losses``: one loss per named output (``LossDict``), weighted and
summed, its parts in the record; ``as_loss`` for ``fit``/``Learner``.

Cases ported from Keras's tests of ``compile(loss=dict/list, loss_weights=...)``
(``CompileLoss``: dict and list outputs, weights that leave a part out of the
total while it is still reported, weights that do not match the losses, an
output name the model does not have, targets of another structure)."""

import dataclasses
from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

from fitlib import DataBunch, fit
from fitlib.callbacks import EarlyStopping
from fitlib.losses import LossDict, as_loss

A_PRED = torch.tensor([[1.2, 1.1], [1.0, 0.9], [0.8, 0.7]])
A_TRUE = torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]])
B_PRED = torch.tensor([[0.6, 0.5], [0.4, 0.3], [0.2, 0.1]])
B_TRUE = torch.tensor([[0.7, 0.8], [0.9, 1.0], [1.1, 1.2]])
MSE_A, MSE_B, MAE_B = (F.mse_loss(A_PRED, A_TRUE), F.mse_loss(B_PRED, B_TRUE),
                       F.l1_loss(B_PRED, B_TRUE))  # fmt: skip


# -- scripted --------------------------------------------------------------------
def test_dict_output_and_targets_give_the_sum_and_each_part():
    loss = LossDict({"a": F.mse_loss, "b": F.l1_loss})
    out = loss({"a": A_PRED, "b": B_PRED}, {"b": B_TRUE, "a": A_TRUE})
    assert list(out) == ["loss", "a", "b"]
    torch.testing.assert_close(out["a"], MSE_A)
    torch.testing.assert_close(out["b"], MAE_B)
    torch.testing.assert_close(out["loss"], MSE_A + MAE_B)
    assert loss.part_names == ("a", "b")


def test_weights_scale_the_total_and_the_parts_stay_unweighted():
    loss = LossDict({"a": F.mse_loss, "b": F.mse_loss}, weights={"a": 2, "b": 0})
    out = loss({"a": A_PRED, "b": B_PRED}, {"a": A_TRUE, "b": B_TRUE})
    torch.testing.assert_close(out["loss"], 2 * MSE_A)
    torch.testing.assert_close(out["b"], MSE_B)  # reported, not in the total
    partial = LossDict({"a": F.mse_loss, "b": F.mse_loss}, weights={"b": 0.5})
    out = partial({"a": A_PRED, "b": B_PRED}, {"a": A_TRUE, "b": B_TRUE})
    torch.testing.assert_close(out["loss"], MSE_A + 0.5 * MSE_B)  # a: weight 1


def test_a_list_of_losses_takes_a_tuple_output_and_targets_in_order():
    loss = LossDict([F.mse_loss, F.l1_loss], weights=[1.0, 3.0])
    out = loss((A_PRED, B_PRED), A_TRUE, B_TRUE)
    assert loss.part_names == ("output_0", "output_1")
    torch.testing.assert_close(out["loss"], MSE_A + 3 * MAE_B)
    torch.testing.assert_close(out["output_1"], MAE_B)


def test_named_losses_read_a_plain_tuple_output_by_position():
    loss = LossDict({"value": F.mse_loss, "other": F.l1_loss})
    out = loss((A_PRED, B_PRED), A_TRUE, B_TRUE)  # targets as (x, (y1, y2)) gives
    torch.testing.assert_close(out["value"], MSE_A)
    torch.testing.assert_close(out["other"], MAE_B)


def test_namedtuple_and_dataclass_outputs_are_read_by_name():
    Out = namedtuple("Out", ["b", "a"])

    @dataclasses.dataclass
    class DOut:
        a: torch.Tensor
        b: torch.Tensor

    loss = LossDict({"a": F.mse_loss, "b": F.l1_loss})
    for out in (Out(B_PRED, A_PRED), DOut(A_PRED, B_PRED)):
        got = loss(out, Out(B_TRUE, A_TRUE))  # named targets too
        torch.testing.assert_close(got["loss"], MSE_A + MAE_B)


def test_one_loss_on_a_plain_tensor_output():
    loss = LossDict({"mse": F.mse_loss})
    torch.testing.assert_close(loss(A_PRED, A_TRUE)["mse"], MSE_A)


def test_the_total_carries_the_graph():
    pred = A_PRED.clone().requires_grad_()
    LossDict({"a": F.mse_loss}, {"a": 2.0})({"a": pred}, {"a": A_TRUE})[
        "loss"
    ].backward()
    torch.testing.assert_close(pred.grad, 2 * 2 * (A_PRED - A_TRUE) / A_PRED.numel())


# -- errors ----------------------------------------------------------------------
def test_an_output_name_the_model_does_not_have_is_named():
    loss = LossDict({"a": F.mse_loss, "c": F.mse_loss})
    with pytest.raises(ValueError, match=r"LossDict: the model's output has no part "
                       r"'c'; its parts are \['a', 'b'\]"):  # fmt: skip
        loss({"a": A_PRED, "b": B_PRED}, {"a": A_TRUE, "c": B_TRUE})


def test_a_missing_target_name_is_named():
    loss = LossDict({"a": F.mse_loss, "b": F.mse_loss})
    parts = r"their parts are \['a', 'bb'\]"
    with pytest.raises(ValueError, match=r"LossDict: the targets have no part 'b' "
                       r"\(did you mean 'bb'\?\); " + parts):  # fmt: skip
        loss({"a": A_PRED, "b": B_PRED}, {"a": A_TRUE, "bb": B_TRUE})


def test_counts_that_do_not_match_the_losses_are_refused():
    loss = LossDict([F.mse_loss, F.mse_loss])
    with pytest.raises(ValueError, match=r"2 losses.*3 outputs"):
        loss((A_PRED, B_PRED, B_PRED), A_TRUE, B_TRUE)
    with pytest.raises(ValueError, match=r"2 losses.*1 target"):
        loss((A_PRED, B_PRED), A_TRUE)
    with pytest.raises(ValueError, match=r"one output, Tensor.*for 2 losses"):
        loss(A_PRED, A_TRUE, B_TRUE)


def test_bad_weights_are_refused_when_made():
    losses = {"a": F.mse_loss, "b": F.mse_loss}
    with pytest.raises(ValueError, match=r"weights: unknown loss 'bb' \(did you "
                       r"mean 'b'\?\)"):  # fmt: skip
        LossDict(losses, weights={"bb": 1.0})
    with pytest.raises(ValueError, match=r"; the losses are 'a', 'b'\."):
        LossDict(losses, weights={"bb": 1.0})
    with pytest.raises(ValueError, match=r"Fix: e\.g\. weights=\{'a': 0\.5\}\.$"):
        LossDict(losses, weights={"a": -1})
    with pytest.raises(ValueError, match=r"LossDict: weights\['a'\] must be a "
                       r"number >= 0; got -1"):  # fmt: skip
        LossDict(losses, weights={"a": -1})
    with pytest.raises(TypeError, match=r"weights\['a'\] must be a number"):
        LossDict(losses, weights={"a": "1"})
    with pytest.raises(ValueError, match=r"2 weights for 3 losses"):
        LossDict([F.mse_loss] * 3, weights=[1, 2])
    with pytest.raises(TypeError, match=r"weights must be a dict"):
        LossDict(losses, weights=[1, 2])


def test_bad_losses_are_refused_when_made():
    with pytest.raises(TypeError, match=r"LossDict: the loss of 'a' is 3"):
        LossDict({"a": 3})
    with pytest.raises(ValueError, match=r"'loss' is the total"):
        LossDict({"loss": F.mse_loss})
    with pytest.raises(ValueError, match=r"at least one loss"):
        LossDict({})
    with pytest.raises(TypeError, match=r"names must be non-empty str"):
        LossDict({1: F.mse_loss})
    with pytest.raises(TypeError, match=r"a dict name -> loss"):
        LossDict(F.mse_loss)


def test_a_parts_first_batch_is_checked_as_a_single_loss_is():
    loss = LossDict({"cls": F.cross_entropy})
    with pytest.raises(ValueError, match=r"cross_entropy got float targets"):
        loss({"cls": torch.randn(4, 3)}, {"cls": torch.tensor([0.0, 1.0, 2.0, 1.0])})


# -- as_loss ---------------------------------------------------------------------
def test_as_loss_makes_a_loss_dict_of_a_dict_or_list_and_keeps_the_rest():
    made = as_loss({"a": F.mse_loss}, {"a": 2.0})
    assert isinstance(made, LossDict) and made.weights == {"a": 2.0}
    assert isinstance(as_loss([F.mse_loss, F.l1_loss], None), LossDict)
    assert as_loss(F.mse_loss, None) is F.mse_loss
    assert as_loss(None, None) is None
    loss = LossDict({"a": F.mse_loss})
    assert as_loss(loss, None) is loss


def test_as_loss_refuses_weights_without_several_losses():
    with pytest.raises(TypeError, match=r"loss_weights=\{'a': 2\} needs several "
                       r"losses"):  # fmt: skip
        as_loss(F.mse_loss, {"a": 2})
    with pytest.raises(TypeError, match=r"LossDict\(\.\.\., weights="):
        as_loss(LossDict({"a": F.mse_loss}), {"a": 2})


# -- through fit -----------------------------------------------------------------
class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 16)
        self.value = nn.Linear(16, 1)
        self.classes = nn.Linear(16, 3)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return {"value": self.value(h), "classes": self.classes(h)}


def two_head_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 4, generator=g)
    y = {"value": x[:, :1] * 2, "classes": (x[:, 1] > 0).long() + (x[:, 2] > 0).long()}
    ds = [(x[i], {k: v[i] for k, v in y.items()}) for i in range(120)]
    return DataBunch(DataLoader(ds[:90], 30), DataLoader(ds[90:], 30), device="cpu")


def test_through_fit_each_part_is_averaged_and_recorded():
    loss = as_loss({"value": F.mse_loss, "classes": F.cross_entropy},
                   {"value": 0.5})  # fmt: skip
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stop = EarlyStopping(monitor="valid_classes", patience=5)  # a part: min
    history = fit(2, model, loss, opt, two_head_data(), callbacks=[stop])
    rec = history[-1]
    assert [k for k in rec if k.endswith(("value", "classes"))] == [
        "train_value", "train_classes", "valid_value", "valid_classes"]  # fmt: skip
    total = 0.5 * rec["valid_value"] + rec["valid_classes"]
    assert rec["valid_loss"] == pytest.approx(total, rel=1e-5)
    assert history[0]["train_classes"] > rec["train_classes"]  # it trains


def test_through_fit_a_missing_output_is_refused_at_the_first_batch():
    loss = LossDict({"value": F.mse_loss, "class": F.cross_entropy})
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"no part 'class' \(did you mean 'classes'"):
        fit(1, model, loss, opt, two_head_data())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
