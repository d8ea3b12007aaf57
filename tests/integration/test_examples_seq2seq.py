"""The sequence-to-sequence and regression examples train and learn:
``examples/translation.py`` and ``examples/linear_regression.py``."""

import math
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))

import linear_regression
import translation

pytestmark = pytest.mark.usefixtures("one_thread")


def changed(trained: torch.nn.Module, untrained: torch.nn.Module) -> bool:
    before = untrained.state_dict()
    return any(not torch.equal(v, before[k]) for k, v in trained.state_dict().items())


def finite(record: dict) -> bool:
    return all(math.isfinite(record[k]) for k in ("train_loss", "valid_loss"))


def test_translation_trains_at_batch_size_1():
    learn = translation.main(epochs=1, batch_size=1, n=10, progress=False)
    (record,) = learn.recorder.epoch_table()
    assert finite(record)
    assert 0 <= record["token_accuracy"] <= 1
    assert record["perplexity"] >= 1
    untrained = translation.build(batch_size=1, n=10, progress=False).model
    assert changed(learn.model, untrained)


def test_translation_learns():
    learn = translation.main(epochs=4, batch_size=32, n=1500, progress=False)
    table = learn.recorder.epoch_table()
    assert table[-1]["train_loss"] < 0.5 * table[0]["train_loss"]
    # Chance: always predicting the most frequent target token (EOS, one a
    # sentence, is more frequent than any word).
    counts = Counter()
    for _, y_out in learn.data.valid_dl:
        counts.update(y_out[y_out != translation.IGNORE].tolist())
    baseline = max(counts.values()) / sum(counts.values())
    assert table[-1]["token_accuracy"] > baseline + 0.3
    # Greedy decoding feeds back its own words: where the teacher-forced
    # prediction is right at every position, it must give the same sentence.
    (src, lengths, y_in), y_out = next(iter(learn.data.valid_dl))
    model = learn.model.eval()
    with torch.no_grad():
        forced = model(src, lengths, y_in).argmax(-1)
        pred = model.greedy(src, lengths)
    assert torch.equal(pred[:, 0], forced[:, 0])  # both start from BOS
    keep = y_out != translation.IGNORE
    right = [bool((forced[i] == y_out[i])[keep[i]].all()) for i in range(len(y_out))]
    assert sum(right) >= 2
    for i in [i for i, r in enumerate(right) if r]:
        n = int(keep[i].sum())
        assert pred[i, :n].tolist() == y_out[i, :n].tolist()
        assert pred[i, n - 1] == translation.EOS


def test_linear_regression_trains_at_batch_size_1():
    learn = linear_regression.main(epochs=1, batch_size=1, n=20, progress=False)
    (record,) = learn.recorder.epoch_table()
    assert finite(record)
    assert math.isfinite(record["rmse"]) and math.isfinite(record["r2_score"])
    untrained = linear_regression.build(batch_size=1, n=20, progress=False).model
    assert changed(learn.model, untrained)


def test_linear_regression_learns_w_and_b():
    learn = linear_regression.main(epochs=5, batch_size=32, progress=False)
    table = learn.recorder.epoch_table()
    assert table[-1]["train_loss"] < 0.1 * table[0]["train_loss"]
    assert table[-1]["r2_score"] > 0.9
    w = learn.model.weight.detach().squeeze(0)
    torch.testing.assert_close(w, linear_regression.TRUE_W, atol=0.1, rtol=0)
    assert abs(learn.model.bias.item() - linear_regression.TRUE_B) < 0.1
