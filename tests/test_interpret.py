"""ClassificationInterpretation: the numbers against counts made by hand, the
grid against the dataset's items, on a TensorDataset and an ImageFolder."""

import math
from collections import Counter
from functools import partial

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from helpers import make_data, make_model
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

from fitlib import ClassificationInterpretation, DataBunch, Learner
from fitlib.interpret import show_image


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def scores_for(predicted, n_classes, confident=3.0):
    """Logits whose argmax is ``predicted``."""
    out = torch.zeros(len(predicted), n_classes)
    out[torch.arange(len(predicted)), torch.tensor(predicted)] = confident
    return out


TRUE = [0, 0, 0, 1, 1, 2, 2, 2, 2, 0]
PRED = [0, 1, 1, 1, 2, 2, 0, 2, 1, 0]


def test_numbers_match_counts_made_by_hand():
    interp = ClassificationInterpretation(
        scores_for(PRED, 4), torch.tensor(TRUE), classes=["a", "b", "c", "d"]
    )
    counts = Counter(zip(TRUE, PRED, strict=True))
    expected = [[counts[(i, j)] for j in range(4)] for i in range(4)]
    assert interp.confusion_matrix().tolist() == expected
    per_class = interp.per_class_accuracy()
    assert per_class["a"] == 2 / 4 and per_class["b"] == 1 / 2
    assert per_class["c"] == 2 / 4 and math.isnan(per_class["d"])  # no items
    assert interp.accuracy == sum(t == p for t, p in zip(TRUE, PRED)) / len(TRUE)
    # (a, b) twice; then once each, in class order.
    assert interp.most_confused() == [
        ("a", "b", 2), ("b", "c", 1), ("c", "a", 1), ("c", "b", 1)
    ]  # fmt: skip
    assert interp.most_confused(min_count=2) == [("a", "b", 2)]


def test_losses_default_to_cross_entropy_and_top_losses_sort_them():
    g = torch.Generator().manual_seed(0)
    preds = torch.randn(20, 5, generator=g)
    targets = torch.randint(0, 5, (20,), generator=g)
    interp = ClassificationInterpretation(preds, targets)
    expected = torch.stack(
        [F.cross_entropy(preds[i], targets[i]) for i in range(20)]
    )  # fmt: skip
    assert torch.allclose(interp.losses, expected)
    losses, idx = interp.top_losses(4)
    assert idx.tolist() == sorted(range(20), key=lambda i: -expected[i])[:4]
    assert torch.equal(losses, interp.losses[idx])
    assert interp.classes == [0, 1, 2, 3, 4]
    assert torch.allclose(interp.probs.sum(dim=1), torch.ones(20))
    # Log-probabilities give the same losses and probabilities as logits.
    logp = ClassificationInterpretation(preds.log_softmax(dim=1), targets)
    assert torch.allclose(logp.losses, interp.losses, atol=1e-6)
    assert torch.allclose(logp.probs, interp.probs, atol=1e-6)


def digits_learner(shuffle_valid=False):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images[:600], dtype=torch.float32).unsqueeze(1) / 16
    y = torch.tensor(digits.target[:600])
    train, valid = TensorDataset(x[:450], y[:450]), TensorDataset(x[450:], y[450:])
    g = torch.Generator().manual_seed(0)
    data = DataBunch(
        DataLoader(train, 32, shuffle=True, generator=g),
        DataLoader(valid, 64, shuffle=shuffle_valid, generator=g),
        device="cpu",
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    learn = Learner(data, model, F.cross_entropy, progress=False)
    learn.fit(1, lr=0.05)
    return learn, valid


def test_from_learner_on_a_tensor_dataset_and_its_grid():
    learn, valid = digits_learner()
    interp = ClassificationInterpretation.from_learner(learn)
    preds, targets = learn.get_preds()
    cm = interp.confusion_matrix()
    assert cm.sum() == len(valid) and torch.equal(interp.targets, targets)
    assert cm.trace() / len(valid) == pytest.approx(learn.validate()["accuracy"])
    # The Learner's loss of each item alone.
    expected = F.cross_entropy(preds, targets, reduction="none")
    assert torch.allclose(interp.losses, expected, atol=1e-6)

    axes = interp.plot_top_losses(6, ncols=3)
    assert axes.shape == (2, 3)
    _, worst = interp.top_losses(6)
    for ax, i in zip(axes.flat, worst.tolist(), strict=True):
        # The image drawn is the dataset's item i, and the title names the
        # prediction and the truth of item i.
        np.testing.assert_array_equal(
            ax.images[0].get_array(), valid[i][0][0].numpy()
        )  # fmt: skip
        pred, true = interp.predicted[i].item(), valid[i][1].item()
        assert ax.get_title().startswith(f"{pred} / {true}\n")
        assert f"loss {interp.losses[i]:.2f}" in ax.get_title()


def test_image_folder_classes_and_items(tmp_path):
    from PIL import Image
    from torchvision import datasets, transforms

    g = torch.Generator().manual_seed(0)
    for name, level in (("cat", 40), ("dog", 200)):
        (tmp_path / name).mkdir()
        for k in range(6):
            noise = torch.randint(0, 30, (6, 6, 3), generator=g)
            pixels = (level + noise).to(torch.uint8).numpy()
            Image.fromarray(pixels).save(tmp_path / name / f"{k}.png")
    folder = datasets.ImageFolder(str(tmp_path), transform=transforms.ToTensor())
    data = DataBunch(
        DataLoader(folder, 4, shuffle=True, generator=g), DataLoader(folder, 5),
        device="cpu",
    )  # fmt: skip
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(108, 2))
    learn = Learner(data, model, F.cross_entropy, progress=False)
    learn.fit(1, lr=0.1)
    interp = ClassificationInterpretation.from_learner(learn)
    assert interp.classes == ["cat", "dog"]  # the folder names
    assert interp.confusion_matrix().sum() == 12
    axes = interp.plot_top_losses(4, ncols=2)
    _, worst = interp.top_losses(4)
    for ax, i in zip(axes.flat, worst.tolist(), strict=True):
        drawn = ax.images[0].get_array()
        np.testing.assert_allclose(drawn, folder[i][0].permute(1, 2, 0).numpy())
        true = folder.classes[folder[i][1]]
        assert ax.get_title().split("\n")[0].endswith(f"/ {true}")


def test_confusion_matrix_plot_shows_the_numbers():
    interp = ClassificationInterpretation(scores_for(PRED, 3), torch.tensor(TRUE))
    ax = interp.plot_confusion_matrix()
    shown = [[None] * 3 for _ in range(3)]
    for text in ax.texts:
        x, y = text.get_position()
        shown[int(y)][int(x)] = int(text.get_text())
    assert shown == interp.confusion_matrix().tolist()
    assert ax.get_xlabel() == "predicted" and ax.get_ylabel() == "true"
    ax = interp.plot_confusion_matrix(normalize=True)
    rows = np.asarray(ax.images[0].get_array()).sum(axis=1)
    np.testing.assert_allclose(rows, 1.0, rtol=1e-6)


def test_shuffled_loader_has_no_grid_and_says_why():
    learn, _ = digits_learner(shuffle_valid=True)
    interp = ClassificationInterpretation.from_learner(learn)
    assert interp.confusion_matrix().sum() == 150  # the numbers still work
    with pytest.raises(ValueError, match=r"RandomSampler.*shuffle=True"):
        interp.plot_top_losses()


def test_a_custom_loss_gives_per_item_losses():
    data = make_data()
    learn = Learner(data, make_model(), F.cross_entropy, progress=False)
    smoothing = nn.CrossEntropyLoss(label_smoothing=0.1)
    interp = ClassificationInterpretation.from_learner(learn, loss_func=smoothing)
    preds, targets = learn.get_preds()
    expected = F.cross_entropy(preds, targets, reduction="none", label_smoothing=0.1)
    assert torch.allclose(interp.losses, expected, atol=1e-6)


@pytest.mark.parametrize(
    ("preds", "targets", "error", "match"),
    [
        ((torch.zeros(4, 3),), torch.zeros(4), TypeError, r"\(preds\[0\], targets,"),
        (torch.zeros(4, 1), torch.zeros(4).long(), ValueError, "zeros_like"),
        (torch.zeros(4, 3, 5), torch.zeros(4).long(), ValueError, r"-1, C\)\[keep\]"),
        (torch.zeros(4, 3), torch.zeros(4, 3), ValueError, "argmax"),
        (torch.zeros(4, 3), torch.zeros(4, 1), ValueError, r"targets.view\(-1\)"),
        (torch.zeros(4, 3), torch.zeros(4), ValueError, r"targets.long\(\)"),
        (torch.zeros(4, 3), torch.rand(4) + 0.1, ValueError, "regression"),
        (torch.zeros(4, 3), torch.tensor([0, 1, -100, 2]), ValueError, "-100"),
    ],
)
def test_bad_input_is_refused_with_the_fix(preds, targets, error, match):
    with pytest.raises(error, match=match):
        ClassificationInterpretation(preds, targets)


def test_wrong_class_names_and_dataset_length_are_refused():
    preds, targets = scores_for(PRED, 3), torch.tensor(TRUE)
    with pytest.raises(ValueError, match=r"classes: 2 names.*3 scores"):
        ClassificationInterpretation(preds, targets, classes=["x", "y"])
    # A class_to_idx dict is not taken as a list of its keys.
    with pytest.raises(TypeError, match=r"classes=sorted\(d, key=d.get\)"):
        ClassificationInterpretation(preds, targets, classes={"b": 1, "a": 0, "c": 2})
    with pytest.raises(TypeError, match="classes must be a list of 3 names"):
        ClassificationInterpretation(preds, targets, classes=3)
    short = TensorDataset(torch.zeros(4, 2))
    with pytest.raises(ValueError, match="4 items but there are 10"):
        ClassificationInterpretation(preds, targets, dataset=short)
    no_inputs = ClassificationInterpretation(preds, targets)
    with pytest.raises(ValueError, match="no dataset was given"):
        no_inputs.plot_top_losses()


def test_show_image_draws_every_layout_and_refuses_others():
    ax = plt.figure().add_subplot()
    chw = torch.rand(3, 4, 5)
    show_image(chw, ax)
    np.testing.assert_allclose(ax.images[-1].get_array(), chw.permute(1, 2, 0))
    normalized = torch.tensor([[-2.0, 0.0], [1.0, 2.0]])  # rescaled to [0, 1]
    show_image(normalized, ax)
    np.testing.assert_allclose(ax.images[-1].get_array(), [[0, 0.5], [0.75, 1]])
    with pytest.raises(ValueError, match=r"shape \(7,\).*show="):
        show_image(torch.arange(7), ax)
    with pytest.raises(ValueError, match=r"shape \(5, 6, 7\)"):
        show_image(torch.rand(5, 6, 7), ax)


def test_the_single_logit_fix_in_the_message_works():
    s = torch.tensor([[2.0], [-1.0], [0.5]])
    targets = torch.tensor([[1.0], [0.0], [0.0]])  # as BCEWithLogitsLoss takes them
    with pytest.raises(ValueError, match="one score per item") as info:
        ClassificationInterpretation(s, targets)
    assert "torch.cat([torch.zeros_like(s), s], dim=1)" in str(info.value)
    s = s.view(-1, 1)
    both = torch.cat([torch.zeros_like(s), s], dim=1)
    interp = ClassificationInterpretation(both, targets.view(-1).long())
    assert interp.predicted.tolist() == [1, 0, 1]
    assert torch.allclose(interp.probs[:, 1], torch.sigmoid(s.view(-1)))


def test_a_loader_with_a_random_batch_sampler_has_no_grid():
    from torch.utils.data import BatchSampler, RandomSampler

    learn, valid = digits_learner()
    shuffled = DataLoader(
        valid, batch_sampler=BatchSampler(RandomSampler(valid), 32, False)
    )  # fmt: skip
    interp = ClassificationInterpretation.from_learner(learn, dl=shuffled)
    assert interp.confusion_matrix().sum() == len(valid)
    with pytest.raises(ValueError, match="RandomSampler"):
        interp.plot_top_losses()
    # Unshuffled batches of a BatchSampler keep the grid.
    from torch.utils.data import SequentialSampler

    ordered = DataLoader(
        valid, batch_sampler=BatchSampler(SequentialSampler(valid), 32, False)
    )  # fmt: skip
    assert ClassificationInterpretation.from_learner(learn, dl=ordered).dataset


def test_class_names_through_a_subset_and_the_small_options():
    from torch.utils.data import Subset

    class Named(TensorDataset):
        classes = ("x", "y", "z")

    named = Named(torch.zeros(10, 2), torch.tensor(TRUE))
    interp = ClassificationInterpretation(
        scores_for(PRED, 3), torch.tensor(TRUE), dataset=Subset(named, range(10))
    )  # fmt: skip
    assert interp.classes == ["x", "y", "z"]  # found through the Subset
    assert all(count >= 1 for *_, count in interp.most_confused(min_count=0))
    assert torch.equal(interp.top_losses(np.int64(2))[1], interp.top_losses(2)[1])
    ax = interp.plot_confusion_matrix(normalize=True)
    assert ax.get_title() == "confusion matrix (shares of each row)"


def test_weighted_dict_and_missing_losses():
    learn, _ = digits_learner()
    preds, targets = learn.get_preds()
    weight = torch.linspace(1, 10, 10)
    weighted = nn.CrossEntropyLoss(weight=weight)
    interp = ClassificationInterpretation.from_learner(learn, loss_func=weighted)
    # Each item's loss with its class weight, as training weighed it.
    expected = F.cross_entropy(preds, targets, weight=weight, reduction="none")
    assert torch.allclose(interp.losses, expected, atol=1e-5)
    assert weighted.reduction == "mean"  # the Learner's loss is left as it was

    def with_parts(out, y):
        ce = F.cross_entropy(out, y)
        return {"loss": 2 * ce, "ce": ce}

    parts = ClassificationInterpretation.from_learner(learn, loss_func=with_parts)
    assert torch.allclose(
        parts.losses, 2 * F.cross_entropy(preds, targets, reduction="none")
    )
    learn.loss_func = None
    with pytest.raises(ValueError, match=r"no loss_func.*loss_func=torch"):
        ClassificationInterpretation.from_learner(learn)


def test_a_batch_sampler_subclass_that_reorders_has_no_grid():
    from torch.utils.data import BatchSampler, SequentialSampler

    class Reversed(BatchSampler):  # e.g. bucketing by length
        def __iter__(self):
            return reversed(list(super().__iter__()))

    learn, valid = digits_learner()
    batches = Reversed(SequentialSampler(valid), 32, False)
    interp = ClassificationInterpretation.from_learner(
        learn, dl=DataLoader(valid, batch_sampler=batches)
    )  # fmt: skip
    with pytest.raises(ValueError, match="Reversed"):
        interp.plot_top_losses()


def test_show_image_reads_torch_tensors_channels_first_and_refuses_dicts():
    ax = plt.figure().add_subplot()
    chw = torch.rand(3, 6, 4)  # (C, H, W) even though 4 could be channels
    show_image(chw, ax)
    np.testing.assert_allclose(ax.images[-1].get_array(), chw.permute(1, 2, 0))
    hwc = np.random.default_rng(0).random((3, 6, 4))  # numpy: (H, W, C)
    show_image(hwc, ax)
    assert ax.images[-1].get_array().shape == (3, 6, 4)
    with pytest.raises(ValueError, match=r"show_image\(x\['image'\], ax\)"):
        show_image({"image": chw, "label": 1}, ax)


# -- losses that are not classification losses, scores that are not numbers ----
@pytest.fixture(scope="module")
def trained():
    return digits_learner()[0]


def _square_error(out, y):  # broadcasts (N, C) against (N,)
    return ((out - y) ** 2).mean()


@pytest.mark.parametrize(
    "loss_func",
    [F.mse_loss, nn.MSELoss(), F.l1_loss, _square_error,
     partial(F.mse_loss, reduction="none")],
)  # fmt: skip
def test_a_loss_that_broadcasts_scores_against_class_indices_is_refused(
    trained, loss_func
):
    learn = trained
    with pytest.raises(ValueError, match=r"loss_func .*F\.cross_entropy") as info:
        ClassificationInterpretation.from_learner(learn, loss_func=loss_func)
    assert "(N, C) scores" in str(info.value) or "(2, 10)" in str(info.value)


def test_a_per_item_loss_of_another_shape_is_refused(trained):
    learn = trained

    def column(out, y):  # (N, 1): one loss per item, in the wrong shape
        return F.cross_entropy(out, y, reduction="none")[:, None]

    with pytest.raises(ValueError, match=r"loss_func column returned .*\(2, 1\)"):
        ClassificationInterpretation.from_learner(learn, loss_func=column)


def test_classification_losses_of_every_form_give_the_same_per_item_losses(trained):
    learn = trained
    preds, targets = learn.get_preds()
    expected = F.cross_entropy(preds, targets, reduction="none")

    def focal(out, y, gamma=0.0):  # gamma 0: cross-entropy
        ce = F.cross_entropy(out, y, reduction="none")
        return ((1 - torch.exp(-ce)) ** gamma * ce).mean()

    for loss_func in (
        focal,
        partial(F.cross_entropy, reduction="none"),
        nn.CrossEntropyLoss(reduction="sum"),
        lambda out, y: F.nll_loss(out.log_softmax(dim=1), y),
    ):
        interp = ClassificationInterpretation.from_learner(learn, loss_func=loss_func)
        assert torch.allclose(interp.losses, expected, atol=1e-5)


def test_nan_or_inf_scores_are_refused_with_the_count():
    preds, targets = scores_for(PRED, 3), torch.tensor(TRUE)
    preds[2, 1], preds[5, 0], preds[7] = float("nan"), float("inf"), float("-inf")
    with pytest.raises(ValueError, match=r"NaN or inf .*3 of 10 items.*item 2"):
        ClassificationInterpretation(preds, targets)
    losses = torch.ones(10)
    losses[4] = float("nan")
    with pytest.raises(ValueError, match=r"losses .*NaN or inf .*1 of 10 items"):
        ClassificationInterpretation(scores_for(PRED, 3), targets, losses=losses)


# -- every argument, as a user might get it wrong --------------------------------
def interp_with_items():
    items = TensorDataset(torch.rand(10, 4, 4), torch.tensor(TRUE))
    return ClassificationInterpretation(
        scores_for(PRED, 3), torch.tensor(TRUE), dataset=items
    )


def new(**kwargs):
    return lambda: ClassificationInterpretation(
        scores_for(PRED, 3), torch.tensor(TRUE), **kwargs
    )


def method(name, *args, **kwargs):
    return lambda: getattr(interp_with_items(), name)(*args, **kwargs)


BAD = [  # (call, error type, match)
    (new(classes=["a", "a", "b"]), ValueError, r"\['a'\] appear twice"),
    (new(dataset="abcdefghij"), TypeError, r"dataset must be the items.*got str"),
    (new(dataset=5), TypeError, "dataset must be the items"),
    (new(losses=[1.0] * 10), ValueError, r"losses must be a tensor of shape \(10,\)"),
    (lambda: ClassificationInterpretation(scores_for(PRED, 3), np.array(TRUE)),
     TypeError, r"targets must be a tensor.*torch.as_tensor\(targets\)"),
    (method("top_losses", -1), ValueError, r"top_losses: k must be an int >= 0"),
    (method("top_losses", "3"), TypeError, r"k must be .*got '3' \(str\)"),
    (method("top_losses", 2.0), TypeError, r"got 2.0 \(float\)"),
    (method("most_confused", -3), ValueError, r"min_count must be an int >= 0"),
    (method("most_confused", None), TypeError, "min_count"),
    (method("most_confused", "2"), TypeError, r"got '2' \(str\)"),
    (method("plot_confusion_matrix", normalize="yes"), TypeError,
     r"normalize must be True or False; got 'yes'"),
    (method("plot_confusion_matrix", ax="left"), TypeError, "ax must be a matplotlib"),
    (method("plot_confusion_matrix", cmap=3), TypeError, "cmap must be a matplotlib"),
    (method("plot_confusion_matrix", figsize=8), TypeError, r"figsize must be \(width"),
    (method("plot_confusion_matrix", figsize=(8, -1)), ValueError, "both > 0"),
    (lambda: interp_with_items().plot_confusion_matrix(
        ax=plt.figure().add_subplot(), figsize=(4, 4)), ValueError,
     "figsize sizes a new figure"),
    (method("plot_top_losses", 0), ValueError, r"plot_top_losses: k must be .*>= 1"),
    (method("plot_top_losses", -1), ValueError, r"k must be an int >= 1"),
    (method("plot_top_losses", 4, ncols=0), ValueError,
     r"plot_top_losses: ncols must be an int >= 1; got 0"),
    (method("plot_top_losses", 4, ncols="3"), TypeError, r"ncols.*got '3'"),
    (method("plot_top_losses", 4, ncols=2.0), TypeError, r"ncols.*got 2.0"),
    (method("plot_top_losses", 4, show="image"), TypeError, "show must be a function"),
    (method("plot_top_losses", 4, figsize=(5,)), ValueError, "figsize must be"),
    (method("plot_items", [100]), ValueError, r"ints in \[0, 10\); got list \[100\]"),
    (method("plot_items", 3), TypeError, "indices must be a non-empty list"),
    (method("plot_items", ["a"]), TypeError, "indices must be"),
    (method("plot_items", []), ValueError, "non-empty list"),
    (method("plot_items", [1], ncols=-2), ValueError, "plot_items: ncols"),
]  # fmt: skip


@pytest.mark.parametrize(("call", "error", "match"), BAD)
def test_every_bad_argument_is_refused_with_the_fix(call, error, match):
    with pytest.raises(error, match=match) as info:
        call()
    assert "Fix:" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"learn": nn.Linear(2, 3)}, TypeError, "learn must be a fitlib Learner"),
        ({"dl": "valid"}, TypeError, r"dl must be a loader .*got str 'valid'"),
        ({"dl": 3}, TypeError, "dl must be a loader"),
        ({"loss_func": "cross_entropy"}, TypeError, "loss_func must be a loss func"),
        ({"loss_func": nn.CrossEntropyLoss}, TypeError, r"got the class .*instance"),
        ({"classes": 10}, TypeError, "classes must be a list of 10 names"),
    ],
)
def test_bad_from_learner_arguments_are_refused_with_the_fix(
    trained, kwargs, error, match
):
    kwargs = {"learn": trained} | kwargs
    with pytest.raises(error, match=match) as info:
        ClassificationInterpretation.from_learner(**kwargs)
    assert "Fix:" in str(info.value)


def test_numpy_ints_tensors_of_indices_and_figsize_are_accepted():
    interp = interp_with_items()
    assert interp.most_confused(np.int64(2)) == [(0, 1, 2)]
    assert (
        interp.top_losses(np.int32(3))[1].tolist() == interp.top_losses(3)[1].tolist()
    )
    axes = interp.plot_items(torch.tensor([1, 2]), ncols=np.int64(2), figsize=(6, 3))
    assert axes.shape == (1, 2)
    assert tuple(axes[0, 0].figure.get_size_inches()) == (6, 3)
    axes = interp.plot_items(np.array([0, -1]))  # numpy indices, and from the end
    assert axes[0, 1].get_title().startswith("0 / 0")  # item 9: predicted 0, true 0
    ax = interp.plot_confusion_matrix(normalize=False, figsize=(5, 4))
    assert tuple(ax.figure.get_size_inches()) == (5, 4)
