import functools
import math
import warnings

import pytest
import torch
from metric_data import multiclass, run
from sklearn import metrics as skm
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

from fitlib import DataBunch, Learner
from fitlib.metrics import (
    Accuracy,
    ErrorRate,
    F1Score,
    FBeta,
    MeanIoU,
    Metrics,
    accuracy,
)


@pytest.mark.parametrize("average", ["macro", "micro"])
@pytest.mark.parametrize("beta", [1.0, 2.0])
def test_fbeta_multiclass_matches_sklearn(gen, average, beta):
    out, y = multiclass(gen, n=40)
    pred = out.argmax(-1)
    expected = skm.fbeta_score(y, pred, beta=beta, average=average, zero_division=0)
    got = run([FBeta(beta, average)], out, y, (16, 16, 8))
    assert got == pytest.approx([expected])


@pytest.mark.parametrize("beta", [0.5, 1.0, 2.0])
def test_fbeta_binary_matches_sklearn(gen, beta):
    out = torch.randn(17, generator=gen)
    y = torch.randint(0, 2, (17,), generator=gen)
    expected = skm.fbeta_score(y, (out > 0).long(), beta=beta, zero_division=0)
    assert run([FBeta(beta, "binary")], out, y) == pytest.approx([expected])


def test_f1_binary_accepts_two_class_columns(gen):
    out, y = multiclass(gen, c=2)
    expected = skm.f1_score(y, out.argmax(-1))
    assert run([F1Score("binary")], out, y) == pytest.approx([expected])


def test_macro_f1_skips_classes_absent_from_targets_and_predictions(gen):
    out, y = multiclass(gen, c=5)
    out[:, 4] = -100.0  # class 4 is never predicted and never a target
    y[y == 4] = 0
    expected = skm.f1_score(y, out.argmax(-1), average="macro", zero_division=0)
    assert run([F1Score()], out, y) == pytest.approx([expected])


def test_fbeta_out_of_range_target_makes_result_nan(gen):
    out, y = multiclass(gen, c=3)
    y[2] = 7
    assert math.isnan(run([F1Score()], out, y)[0])


def test_fbeta_names():
    assert F1Score().name == "f1_score"
    assert FBeta(2.0).name == "f2_score"
    assert FBeta(0.5).name == "f0.5_score"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"beta": 0.0}, "beta.*0.0"),
        ({"beta": True}, "beta.*True"),
        ({"average": "weighted"}, "average.*'binary', 'macro', 'micro'"),
        ({"num_classes": 1}, "num_classes.*1"),
    ],
)
def test_fbeta_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FBeta(**kwargs)


def test_binary_fbeta_rejects_multiclass_output(gen):
    out, y = multiclass(gen, c=3)
    with pytest.raises(ValueError, match=r"f1_score.*binary"):
        Metrics([F1Score("binary")]).update(out, (y,))


# -- one score per sample: a logit or a probability ------------------------------
def probabilities(gen, n=17):
    """A sigmoid model's outputs, (N, 1), and 0/1 targets of that shape (BCE's)."""
    p = torch.sigmoid(2 * torch.randn(n, 1, generator=gen))
    return p, torch.randint(0, 2, (n, 1), generator=gen).float()


@pytest.mark.parametrize("threshold", [0.5, 0.3])
def test_binary_f1_and_accuracy_of_probabilities_match_torchmetrics(gen, threshold):
    tm = pytest.importorskip("torchmetrics.classification")
    p, y = probabilities(gen)
    f1 = tm.BinaryF1Score(threshold=threshold)(p, y.long()).item()
    acc = tm.BinaryAccuracy(threshold=threshold)(p, y.long()).item()
    kw = {"from_logits": False, "threshold": threshold}
    got = run([F1Score("binary", **kw), Accuracy(**kw)], p, y)
    assert got == pytest.approx([f1, acc])
    # The functions take them too, and a partial in metrics=[...] is counted.
    assert accuracy(p, y, **kw).item() == pytest.approx(acc)
    assert run([functools.partial(accuracy, **kw)], p, y) == pytest.approx([acc])
    # Logits with a threshold: the logit of the probability is compared.
    logit = torch.logit(p)
    assert run([F1Score("binary", threshold=threshold)], logit, y) == pytest.approx(
        [f1]
    )


def sigmoid_fit(metrics, loss_func, train_metrics=None):
    torch.manual_seed(0)
    x = torch.randn(32, 4)
    y = (x[:, :1] > 0).float()
    dl = DataLoader(TensorDataset(x, y), batch_size=16)
    model = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
    learn = Learner(
        DataBunch(dl, dl, device="cpu"), model, loss_func, metrics=metrics,
        train_metrics=train_metrics or [], progress=False,
    )  # fmt: skip
    return learn


@pytest.mark.parametrize("loss_func", [F.binary_cross_entropy, nn.BCELoss()])
@pytest.mark.parametrize(
    "metric", [F1Score("binary"), Accuracy(), accuracy, ErrorRate(), MeanIoU()]
)
def test_probabilities_read_as_logits_are_refused_at_the_first_batch(loss_func, metric):
    learn = sigmoid_fit([metric], loss_func)
    with pytest.raises(ValueError, match=r"probabilit.*from_logits=False.*logits"):
        learn.fit(1, lr=0.1)
    # as a training metric: refused at the first training batch
    learn = sigmoid_fit([], loss_func, train_metrics=[metric])
    with pytest.raises(ValueError, match=r"from_logits=False"):
        learn.fit(1, lr=0.1)


def test_probabilities_said_so_are_scored_with_the_threshold():
    learn = sigmoid_fit(
        [F1Score("binary", from_logits=False), Accuracy(from_logits=False)],
        F.binary_cross_entropy,
    )
    record = learn.fit(1, lr=0.1)[-1]
    x, y = learn.data.valid_dl.dataset.tensors
    with torch.no_grad():
        pred = (learn.model(x) > 0.5).float()
    want_acc = (pred == y).float().mean().item()
    want_f1 = skm.f1_score(y.numpy().ravel(), pred.numpy().ravel())
    assert record["accuracy"] == pytest.approx(want_acc)
    assert record["f1_score"] == pytest.approx(want_f1)


def test_from_logits_false_refuses_an_output_that_is_no_probability(gen):
    ms = Metrics([F1Score("binary", from_logits=False)])
    out = torch.randn(8, generator=gen) * 3
    with pytest.raises(ValueError, match=r"from_logits=False.*not a probability"):
        ms.check(out, (torch.randint(0, 2, (8,), generator=gen),))


def test_logits_under_a_logit_loss_pass_the_check(gen):
    out = torch.rand(8, 1, generator=gen)  # logits that happen to be in [0, 1]
    y = torch.randint(0, 2, (8, 1), generator=gen).float()
    ms = Metrics([F1Score("binary")])
    ms.check(out, (y,), loss_func=F.binary_cross_entropy_with_logits)
    with pytest.warns(UserWarning, match=r"\[0, 1\].*from_logits=True"):
        ms.check(out, (y,))  # no loss known: read as logits, with a warning


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"from_logits": "yes"}, TypeError, r"from_logits must be True, False or"),
        ({"from_logits": 1}, TypeError, r"from_logits must be True, False or"),
        ({"threshold": 1.5}, ValueError, r"threshold must be a probability in"),
        ({"threshold": 0}, ValueError, r"threshold must be a probability in"),
        ({"threshold": "0.5"}, TypeError, r"threshold must be a probability in"),
    ],
)
def test_from_logits_and_threshold_are_checked(kwargs, error, match):
    for make in (F1Score, Accuracy, MeanIoU):
        with pytest.raises(error, match=rf"{make.__name__}: {match}"):
            make(**kwargs)
    with pytest.raises(error, match=rf"accuracy: {match}"):
        accuracy(torch.zeros(2), torch.zeros(2), **kwargs)


@pytest.mark.parametrize(
    "loss_func",
    [lambda o, y: F.binary_cross_entropy(o, y), F.mse_loss],
    ids=["wrapped_bce", "mse"],
)
def test_probabilities_under_a_loss_not_known_to_take_logits_warn_with_the_fixes(
    loss_func,
):
    learn = sigmoid_fit([F1Score("binary")], loss_func)
    match = (
        r"f1_score reads one score.*as a logit.*every score of the first batch "
        r"lies in \[0, 1\].*from_logits=False.*from_logits=True.*"
        r"from fitlib\.metrics import F1Score"
    )
    with pytest.warns(UserWarning, match=match):
        learn.fit(1, lr=0.1)


@pytest.mark.parametrize(
    "loss_func", [F.binary_cross_entropy_with_logits, nn.BCEWithLogitsLoss()]
)
def test_scores_in_0_1_under_a_logit_loss_do_not_warn(loss_func, gen):
    out = torch.rand(8, 1, generator=gen)
    y = torch.randint(0, 2, (8, 1), generator=gen).float()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Metrics([F1Score("binary")]).check(out, (y,), loss_func=loss_func)


def test_probabilities_read_as_logits_stop_the_fit_before_any_step():
    # A validation metric: refused at the fit's first training batch, before
    # its step, not after an epoch of training.
    learn = sigmoid_fit([F1Score("binary")], F.binary_cross_entropy)
    before = [p.clone() for p in learn.model.parameters()]
    match = r"from_logits=False.*from fitlib\.metrics import F1Score"
    with pytest.raises(ValueError, match=match):
        learn.fit(1, lr=0.1)
    assert all(torch.equal(a, b) for a, b in zip(before, learn.model.parameters()))
