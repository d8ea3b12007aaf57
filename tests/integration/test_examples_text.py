"""The text examples: the synthetic data, and each model trains on it."""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))

import birnn_sentiment
import synthetic_text
import textcnn_sentiment

EXAMPLES = {"birnn": birnn_sentiment, "textcnn": textcnn_sentiment}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def birnn_run():
    """One normal-size BiLSTM run, shared by the loss and accuracy tests."""
    return birnn_sentiment.main(epochs=3, batch_size=64, n=3000, progress=False)


def initial_weights(name: str, seed: int = 0) -> dict:
    """The weights ``main(seed=seed)`` starts from."""
    torch.manual_seed(seed)
    if name == "birnn":
        model = birnn_sentiment.BiLSTMClassifier(synthetic_text.VOCAB_SIZE)
    else:
        model = textcnn_sentiment.TextCNN(synthetic_text.VOCAB_SIZE)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_sentences_are_deterministic_and_labelled_by_the_words():
    xs, ys = synthetic_text.make_sentences(200, seed=3)
    xs2, ys2 = synthetic_text.make_sentences(200, seed=3)
    assert ys == ys2 and all(torch.equal(a, b) for a, b in zip(xs, xs2))
    assert {len(x) for x in xs} <= set(range(5, 41)) and len({len(x) for x in xs}) > 5
    assert all(int(x.min()) > synthetic_text.PAD for x in xs)
    assert 60 < sum(ys) < 140  # both classes
    # The label is the sign of the phrases, a negation flipping the next word.
    pos, neg, nots = (set(r) for r in (synthetic_text.POSITIVE,
                      synthetic_text.NEGATIVE, synthetic_text.NEGATIONS))  # fmt: skip
    for x, y in zip(xs, ys):
        t = x.tolist()
        score = sum(
            (1 if w in pos else -1) * (-1 if i and t[i - 1] in nots else 1)
            for i, w in enumerate(t)
            if w in pos or w in neg
        )
        assert score != 0 and (score > 0) == bool(y)


def test_loaders_pad_and_give_lengths():
    data = synthetic_text.sentiment_data(n=100, batch_size=8, seed=0)
    assert len(data.train_dl.dataset) == 80 and len(data.valid_dl.dataset) == 20
    (x, lengths), y = next(iter(data.train_dl))
    assert x.shape == (8, int(lengths.max())) and y.shape == (8,)
    for row, n in zip(x, lengths):
        assert (row[n:] == synthetic_text.PAD).all() and (row[:n] > 0).all()


@pytest.mark.parametrize("name", EXAMPLES)
def test_trains_at_batch_size_1(name):
    learn = EXAMPLES[name].main(epochs=1, batch_size=1, n=15, progress=False)
    (row,) = learn.recorder.epoch_table()
    assert math.isfinite(row["train_loss"]) and math.isfinite(row["valid_loss"])
    assert 0 <= row["accuracy"] <= 1
    assert learn.recorder.batch_sizes[0] == 1
    before = initial_weights(name)
    after = learn.model.state_dict()
    assert before.keys() == after.keys()
    assert not any(torch.equal(before[k], after[k]) for k in before)


def test_birnn_loss_goes_down(birnn_run):
    losses = birnn_run.recorder.train_losses
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.6 * losses[0]


def word_counts(dl):
    """Each sentence as counts of its words (order lost), and the labels."""
    rows, labels = [], []
    for (x, lengths), y in dl:
        for sentence, n in zip(x, lengths, strict=True):
            rows.append(
                torch.bincount(sentence[:n], minlength=synthetic_text.VOCAB_SIZE)
            )
        labels += y.tolist()
    return torch.stack(rows).numpy(), labels


def test_birnn_learns_the_word_order(birnn_run):
    # "not good ... bad" and "good ... not bad" hold the same words: a bag of
    # words, fitted on the same split, stays well below the BiLSTM.
    from sklearn.linear_model import LogisticRegression

    accuracy = birnn_run.recorder.epoch_table()[-1]["accuracy"]
    assert accuracy >= 0.8
    bag = LogisticRegression(max_iter=2000).fit(*word_counts(birnn_run.data.train_dl))
    assert accuracy > bag.score(*word_counts(birnn_run.data.valid_dl)) + 0.05


def test_textcnn_loss_goes_down():
    learn = textcnn_sentiment.main(epochs=4, batch_size=32, n=2000, progress=False)
    losses = learn.recorder.train_losses
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.6 * losses[0]
    assert learn.recorder.epoch_table()[-1]["accuracy"] > 0.7


def test_textcnn_ignores_the_padding():
    """A sentence scores the same alone and padded in a batch of longer ones."""
    torch.manual_seed(0)
    model = textcnn_sentiment.TextCNN(synthetic_text.VOCAB_SIZE).eval()
    x = torch.tensor([[50, 60, 70, 80, 90, 100, 110], [5, 60, 7, 0, 0, 0, 0]])
    lengths = torch.tensor([7, 3])
    alone = model(x[1:, :3], lengths[1:])
    assert torch.allclose(model(x, lengths)[1:], alone, atol=1e-6)
