"""The metrics of a run: structured outputs resolved to the tensor a metric
scores, and ``Part``'s arguments."""

import dataclasses

import pytest
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

from fitlib import DataBunch, Learner
from fitlib.metrics import F1Score, Metrics, Part, accuracy, mse


@dataclasses.dataclass
class Out:
    hidden: torch.Tensor
    logits: torch.Tensor


class WithLogits(nn.Module):
    """A model whose output has a ``logits`` field, as transformers' do."""

    def __init__(self, structured=Out):
        super().__init__()
        self.lin, self.structured = nn.Linear(4, 3), structured

    def forward(self, x):
        logits = self.lin(x)
        return self.structured(logits.detach(), logits)


def logits_loss(out, y):
    return F.cross_entropy(out.logits if isinstance(out, Out) else out[0], y)


def fit_with(metrics, model=None):
    torch.manual_seed(0)
    x, y = torch.randn(24, 4), torch.randint(0, 3, (24,))
    dl = DataLoader(TensorDataset(x, y), batch_size=8)
    learn = Learner(
        DataBunch(dl, dl, device="cpu"), model or WithLogits(), logits_loss,
        metrics=metrics, progress=False,
    )  # fmt: skip
    return learn.fit(1, lr=0.1)[-1]


def test_part_without_output_scores_the_logits_as_a_plain_metric_does():
    plain = fit_with([accuracy])["accuracy"]
    assert fit_with([Part(accuracy, name="acc")])["acc"] == plain
    assert fit_with([Part(F1Score())])["f1_score"] is not None


def test_part_without_output_of_an_output_without_logits_says_which_part():
    def pair(hidden, logits):
        return (logits, hidden)

    with pytest.raises(TypeError, match=r"Part\(acc, output=0\).*parts are \[0, 1\]"):
        fit_with([Part(accuracy, name="acc")], WithLogits(pair))
    # the metric's own errors are the same with and without Part
    ms = Metrics([Part(accuracy)])
    with pytest.raises(TypeError, match=r"scores a tensor"):
        ms.check((torch.zeros(2, 3), torch.zeros(2)), (torch.zeros(2),))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"metric": 3}, TypeError, r"Part: metric: cannot use 3 \(type int\).*Fix"),
        (
            {"metric": "accuracy"},
            TypeError,
            r"Part: metric: cannot use 'accuracy'.*Fix",
        ),
        ({"output": 1.5}, TypeError, r"Part: output must be .*; got 1.5 \(float\)"),
        ({"output": True}, TypeError, r"Part: output must be .*; got True \(bool\)"),
        ({"output": [0, 1]}, TypeError, r"Part: output must be .*; got \[0, 1\]"),
        ({"output": ()}, ValueError, r"Part: output must be .*; got \(\)"),
        ({"target": 2.0}, TypeError, r"Part: target must be .*; got 2.0 \(float\)"),
        ({"target": (0, None)}, TypeError, r"Part: target must be .*; got \(0, None"),
        ({"name": ""}, ValueError, r"Part: name must be a non-empty str or None"),
        ({"name": 3}, TypeError, r"Part: name must be a non-empty str or None"),
    ],
)
def test_part_checks_its_arguments(kwargs, error, match):
    args = {"metric": mse, "output": 0, **kwargs}
    with pytest.raises(error, match=match):
        Part(**args)


def test_a_dict_of_targets_per_output_makes_the_fix_name_the_target_too():
    # A model with one output per head and the batches' targets in a dict of
    # the same keys: the metric must be pointed at an output AND a target.
    outs = {"a": torch.zeros(2, 1), "b": torch.zeros(2, 3)}
    targets = ({"a": torch.zeros(2, 1), "b": torch.zeros(2, dtype=torch.long)},)
    with pytest.raises(TypeError, match=r"output='a'.*target=\.\.\..*\['a', 'b'\]"):
        Metrics([accuracy]).check(outs, targets)
    with pytest.raises(ValueError, match=r"Part\(\.\.\., output='b', target='b'\)"):
        Metrics([Part(accuracy, output="b")]).check(outs, targets)
    ms = Metrics([Part(accuracy, output="b", target="b")])
    ms.check(outs, targets)  # pointed at both: accepted
    ms.update(outs, targets)
    assert ms.compute()[0].item() == pytest.approx(1.0)  # all zeros: class 0
