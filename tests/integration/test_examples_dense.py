"""The dense-prediction examples train: FCN segmentation and SSD detection."""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))

import fcn_segmentation
import ssd_detection

pytestmark = pytest.mark.usefixtures("one_thread")


def initial_weights(model_class: type, seed: int = 0) -> list[torch.Tensor]:
    """The weights ``main(seed=seed)`` starts from (it seeds, then builds)."""
    torch.manual_seed(seed)
    return [p.detach().clone() for p in model_class().parameters()]


def changed(before: list[torch.Tensor], model: torch.nn.Module) -> bool:
    after = list(model.parameters())
    assert len(after) == len(before)
    return all(not torch.equal(b, a.detach()) for b, a in zip(before, after))


def test_fcn_trains_on_single_images():
    before = initial_weights(fcn_segmentation.FCN)
    learn = fcn_segmentation.main(epochs=1, batch_size=1, n=4, progress=False)
    (record,) = learn.recorder.epoch_table()
    for name in ("train_loss", "valid_loss", "accuracy", "mean_iou", "dice"):
        assert math.isfinite(record[name]), (name, record)
    assert 0 <= record["mean_iou"] <= 1 and 0 <= record["accuracy"] <= 1
    assert changed(before, learn.model)
    x, y = learn.data.valid_dl.dataset[0]
    pred = learn.predict(x)
    assert pred.shape == (3, *y.shape)  # class scores per pixel, no batch dim


def test_fcn_learns_to_segment():
    learn = fcn_segmentation.main(epochs=3, batch_size=16, n=240, progress=False)
    table = learn.recorder.epoch_table()
    assert table[-1]["train_loss"] < 0.5 * table[0]["train_loss"]
    # Predicting background everywhere: accuracy = its share of the pixels,
    # mean IoU = that share over 3 classes.
    masks = learn.data.valid_dl.dataset.tensors[1]
    background = (masks == 0).float().mean().item()
    assert table[-1]["accuracy"] > 1 - 0.75 * (1 - background)  # a quarter fewer errors
    assert table[-1]["mean_iou"] > background / 3 + 0.15


def test_ssd_trains_on_single_images():
    before = initial_weights(ssd_detection.TinySSD)
    learn = ssd_detection.main(epochs=1, batch_size=1, n=4, progress=False)
    (record,) = learn.recorder.epoch_table()
    names = ["train_loss", "valid_loss", "anchor_accuracy", "anchor_f1"]
    names += ["train_cls", "train_box", "valid_cls", "valid_box"]
    for name in names:
        assert math.isfinite(record[name]), (name, record)
    # The parts add up to the loss (both are per-sample means over the epoch).
    assert record["train_cls"] + record["train_box"] == pytest.approx(
        record["train_loss"], rel=1e-4
    )
    assert record["valid_cls"] + record["valid_box"] == pytest.approx(
        record["valid_loss"], rel=1e-4
    )
    assert changed(before, learn.model)
    x, _ = learn.data.valid_dl.dataset[0]
    scores, offsets = learn.predict(x)  # a tuple, without the batch dim
    n_anchors = len(ssd_detection.ANCHORS)
    assert scores.shape == (n_anchors, len(ssd_detection.CLASSES))
    assert offsets.shape == (n_anchors, 4)


def test_ssd_matching_round_trips():
    boxes = torch.tensor([[10.0, 12.0, 9.0, 9.0], [24.0, 24.0, 13.0, 13.0]])
    labels = torch.tensor([1, 2])
    classes, offsets = ssd_detection.match(boxes, labels)
    assert set(classes.unique().tolist()) == {0, 1, 2}
    decoded = ssd_detection.decode(offsets, ssd_detection.ANCHORS)
    for box, label in zip(boxes, labels, strict=True):
        assert torch.allclose(decoded[classes == label], box.expand(1, 4), atol=1e-5)
    assert (offsets[classes == 0] == 0).all()


def test_ssd_learns_to_detect():
    learn = ssd_detection.main(epochs=5, batch_size=16, n=480, progress=False)
    table = learn.recorder.epoch_table()
    assert table[-1]["train_loss"] < 0.5 * table[0]["train_loss"]
    assert table[-1]["valid_box"] < table[0]["valid_box"]
    # Every anchor background: accuracy = the background share of the anchors,
    # and macro F1 about 1/3 (background's F1 near 1, the classes' 0).
    classes = learn.data.valid_dl.dataset.classes
    background = (classes == 0).float().mean().item()
    assert table[-1]["anchor_accuracy"] > 1 - 0.75 * (1 - background)
    assert table[-1]["anchor_f1"] > 0.6
