"""Per-pixel and per-token class metrics: where the classes sit, what is
ignored, and exact whole-set values over ragged batches."""

import functools

import numpy as np
import pytest
import torch
from metric_data import run
from sklearn import metrics as skm
from torch.nn import functional as F  # noqa: N812

from fitlib.metrics import (
    Accuracy,
    AvgMetric,
    Dice,
    ErrorRate,
    F1Score,
    MeanIoU,
    Metrics,
    Perplexity,
    TokenAccuracy,
    accuracy,
    as_metric,
    error_rate,
    find_class_dim,
)

PAD = -100


def segmentation(gen, n=9, c=3, h=5, w=6, ignore=None):
    """Channels-first scores (N, C, H, W), masks (N, H, W); a quarter of the
    pixels set to ``ignore`` when given."""
    out = torch.randn(n, c, h, w, generator=gen)
    y = torch.randint(0, c, (n, h, w), generator=gen)
    if ignore is not None:
        y[torch.rand(n, h, w, generator=gen) < 0.25] = ignore
    return out, y


def sequences(gen, n=9, t=7, c=5):
    """(N, T, C) logits and (N, T) tokens, padded with PAD after a random
    length per sequence: batches count different numbers of tokens."""
    out = torch.randn(n, t, c, generator=gen)
    y = torch.randint(0, c, (n, t), generator=gen)
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    y[torch.arange(t) >= lengths[:, None]] = PAD
    return out, y


def flat_pixels(out, y, ignore=None):
    """Whole-set per-pixel predictions and targets, ignored ones left out."""
    pred = out.argmax(1).reshape(-1).numpy()
    t = y.reshape(-1).numpy()
    keep = t != ignore if ignore is not None else np.ones_like(t, dtype=bool)
    return t[keep], pred[keep]


def test_accuracy_finds_channels_first_classes_per_pixel(gen):
    out, y = segmentation(gen)
    t, pred = flat_pixels(out, y)
    want = skm.accuracy_score(t, pred)
    assert accuracy(out, y).item() == pytest.approx(want)
    # Ragged batches (4, 4, 1) in a Metrics: the whole set's pixel accuracy.
    assert run([accuracy, error_rate], out, y, (4, 4, 1)) == pytest.approx(
        [want, 1 - want]
    )


def test_accuracy_ignores_pixels_and_counts_the_rest_over_the_whole_set(gen):
    out, y = segmentation(gen, ignore=255)
    t, pred = flat_pixels(out, y, ignore=255)
    want = skm.accuracy_score(t, pred)
    got = run([functools.partial(accuracy, ignore_index=255)], out, y, (4, 4, 1))
    assert got == pytest.approx([want], rel=1e-12)


def test_token_accuracy_counts_tokens_not_sequences(gen):
    out, y = sequences(gen)
    keep = y != PAD
    want = ((out.argmax(-1) == y) & keep).sum().item() / keep.sum().item()
    sizes = (4, 4, 1)
    assert run([TokenAccuracy()], out, y, sizes) == pytest.approx([want], rel=1e-12)
    # A mean of batch means weighted by sequences would be another number.
    by_sequences = run(
        [AvgMetric(functools.partial(accuracy, ignore_index=PAD))], out, y, sizes
    )
    assert by_sequences[0] != pytest.approx(want, rel=1e-6)


def test_f1_mean_iou_and_dice_per_pixel_match_sklearn(gen):
    out, y = segmentation(gen, c=4, ignore=255)
    t, pred = flat_pixels(out, y, ignore=255)
    metrics = [
        F1Score(ignore_index=255),
        MeanIoU(ignore_index=255),
        Dice(ignore_index=255),
    ]
    got = run(metrics, out, y, (4, 4, 1))
    f1 = skm.f1_score(t, pred, average="macro")
    iou = skm.jaccard_score(t, pred, average="macro")
    assert got == pytest.approx([f1, iou, f1], rel=1e-12)
    assert iou < f1  # IoU = F1 / (2 - F1) per class: a different number


def test_mean_iou_of_binary_masks_from_one_logit_channel(gen):
    out = torch.randn(6, 1, 4, 4, generator=gen)
    y = torch.randint(0, 2, (6, 4, 4), generator=gen)
    pred = (out[:, 0] > 0).long().reshape(-1).numpy()
    want = skm.jaccard_score(y.reshape(-1).numpy(), pred, average="macro")
    assert run([MeanIoU()], out, y, (4, 2)) == pytest.approx([want], rel=1e-12)


def test_perplexity_is_exp_of_the_whole_set_token_cross_entropy(gen):
    out, y = sequences(gen)
    want = F.cross_entropy(out.reshape(-1, 5).double(), y.reshape(-1)).exp().item()
    assert run([Perplexity()], out, y, (4, 4, 1)) == pytest.approx([want], rel=1e-12)
    # Channels first (B, C, T), as cross_entropy takes it: the same value.
    chw = run([Perplexity()], out.transpose(1, 2), y, (4, 4, 1))
    assert chw == pytest.approx([want], rel=1e-12)


def test_class_dim_says_where_the_classes_are_when_both_dims_fit(gen):
    out = torch.randn(4, 3, 3, generator=gen)  # (B, T, C) or (B, C, T)?
    y = torch.randint(0, 3, (4, 3), generator=gen)
    with pytest.raises(
        ValueError, match=r"dim 1 or in the last dim.*partial\(accuracy, class_dim=-1\)"
    ):
        accuracy(out, y)
    last = (out.argmax(-1) == y).float().mean().item()
    first = (out.argmax(1) == y).float().mean().item()
    assert last != first
    assert accuracy(out, y, class_dim=-1).item() == pytest.approx(last)
    assert run([Accuracy(class_dim=1)], out, y, (4,)) == pytest.approx([first])
    assert find_class_dim(out, y, "accuracy", -1) == 2


def test_a_mask_of_another_size_names_both_shapes(gen):
    out, _ = segmentation(gen, h=8, w=8)
    y = torch.zeros(9, 4, 4, dtype=torch.long)
    for metric in (accuracy, MeanIoU(), F1Score()):
        with pytest.raises(
            ValueError, match=r"\(9, 3, 8, 8\).*\(9, 4, 4\).*\(9, 8, 8\)"
        ):
            Metrics([metric]).update(out, (y,))


def test_padding_in_targets_suggests_ignore_index_and_passes_with_it(gen):
    out, y = sequences(gen)
    with pytest.raises(ValueError, match=r"targets hold -100.*ignore_index=-100"):
        Metrics([accuracy]).check(out, (y,))
    for metric in (
        TokenAccuracy(),
        Accuracy(ignore_index=PAD),
        Perplexity(),
        F1Score(ignore_index=PAD),
    ):
        Metrics([metric]).check(out, (y,))
    with pytest.raises(ValueError, match=r"targets hold 7.*ignores only -100"):
        Metrics([TokenAccuracy()]).check(out, (torch.full_like(y, 7),))


def test_accuracy_and_error_rate_in_metrics_are_counted():
    assert type(as_metric(accuracy)) is Accuracy
    assert type(as_metric(error_rate)) is ErrorRate
    m = as_metric(functools.partial(accuracy, ignore_index=0, class_dim=1))
    assert (type(m), m.ignore_index, m.class_dim) == (Accuracy, 0, 1)
    assert m.name == "accuracy"
    # Another partial (or a function of the user's) stays a batch mean.
    assert type(as_metric(functools.partial(accuracy, out=None))) is AvgMetric


@pytest.mark.parametrize(
    "make, error, shown",
    [
        (lambda: Accuracy(class_dim="1"), TypeError, r"Accuracy: class_dim .*'1'"),
        (lambda: MeanIoU(ignore_index=1.5), TypeError, r"MeanIoU: ignore_index.*1.5"),
        (lambda: Perplexity(ignore_index=None), TypeError, r"Perplexity: ignore_ind"),
        (lambda: Dice(num_classes=1), ValueError, r"Dice: num_classes must be an int"),
    ],
)
def test_bad_arguments_name_the_metric_and_the_value(make, error, shown):
    with pytest.raises(error, match=shown):
        make()


def test_a_class_dim_outside_the_output_is_refused(gen):
    out, y = segmentation(gen)
    with pytest.raises(
        ValueError, match=r"class_dim=4 is not a dimension.*\(9, 3, 5, 6\)"
    ):
        Accuracy(class_dim=4).update(out, y)


def test_every_target_ignored_gives_nan_not_an_error(gen):
    out, y = sequences(gen)
    m = TokenAccuracy()
    m.update(out, torch.full_like(y, PAD))
    assert torch.isnan(m.compute())


def test_masks_with_a_channel_dim_are_told_to_drop_it(gen):
    out, y = segmentation(gen)
    with pytest.raises(
        ValueError,
        match=r"\(9, 1, 5, 6\), keep a channel dim.*\(9, 5, 6\).*squeeze\(1\)",
    ):
        accuracy(out, y[:, None])


def test_one_logit_channel_scores_masks_of_the_same_shape(gen):
    out = torch.randn(4, 1, 3, 3, generator=gen)
    y = (torch.rand(4, 1, 3, 3, generator=gen) > 0.5).float()  # BCE's masks
    want = ((out > 0).float() == y).float().mean().item()
    assert run([accuracy, MeanIoU()], out, y, (4,))[0] == pytest.approx(want)


def test_an_unlabelled_value_in_the_masks_suggests_ignoring_that_value(gen):
    out, y = segmentation(gen, ignore=255)
    for metric in (accuracy, MeanIoU(), Dice()):
        with pytest.raises(ValueError, match=r"hold 255.*Fix: .*ignore_index=255"):
            Metrics([metric]).check(out, (y,))


def torchmetrics_iou(out, y, ignore_index):
    tm = pytest.importorskip("torchmetrics.classification")
    c = out.shape[1]
    m = tm.MulticlassJaccardIndex(c, ignore_index=ignore_index, average="macro")
    return m(out, y).item()


@pytest.mark.parametrize("ignore_index", [0, 2, 255, None])
def test_mean_iou_with_ignore_index_matches_torchmetrics(gen, ignore_index):
    # Per pixel, channels first; the ignored class is also predicted.
    out, y = segmentation(gen, c=4, ignore=ignore_index)
    want = torchmetrics_iou(out, y, ignore_index)
    got = run([MeanIoU(ignore_index=ignore_index)], out, y, (4, 4, 1))
    assert got == pytest.approx([want])


def test_mean_iou_leaves_out_a_real_class_given_as_ignore_index(gen):
    # Flat (N, C) scores; class 0 is predicted where targets are other classes,
    # class 3 is neither a target nor predicted.
    out = torch.randn(17, 4, generator=gen)
    y = torch.randint(0, 3, (17,), generator=gen)
    out[:, 3] = -9.0
    out[:5, 0] = 9.0
    y[:5] = 1
    want = torchmetrics_iou(out, y, 0)
    assert run([MeanIoU(ignore_index=0)], out, y) == pytest.approx([want])
    # The same with every class-0 target removed: class 0 is still predicted.
    keep = y != 0
    out, y = out[keep], y[keep]
    got = run([MeanIoU(ignore_index=0)], out, y, (len(y),))
    assert got == pytest.approx([torchmetrics_iou(out, y, 0)])
