"""Variable-length sequences: padding with lengths, the teacher-forcing
shift, masks, and a cross-entropy over the real tokens, through a fit."""

import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.data import DataLoader

from fitlib import Callback, DataBunch, Learner
from fitlib.callbacks import Checkpoint
from fitlib.metrics import TokenAccuracy
from fitlib.sequences import PadCollate, masked_cross_entropy, sequence_mask


def pairs(n=40, vocab=8, seed=0):
    """Token sequences of lengths 2..7 and their tags (the token's parity)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = int(torch.randint(2, 8, (), generator=g))
        x = torch.randint(1, vocab, (t,), generator=g)
        out.append((x, x % 2))
    return out


def test_pad_collate_pads_inputs_and_targets_and_returns_lengths():
    items = [
        (torch.tensor([5, 6, 7]), torch.tensor([1, 0, 1])),
        (torch.tensor([8]), torch.tensor([0])),
    ]
    (x, lengths), y = PadCollate(pad_value=0)(items)
    assert x.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert lengths.tolist() == [3, 1] and lengths.dtype == torch.long
    assert y.tolist() == [[1, 0, 1], [0, -100, -100]]
    assert torch.equal(sequence_mask(lengths), x != 0)
    # One label per sequence (sentiment): stacked, not padded.
    labels = [
        (torch.tensor([5, 6]), torch.tensor(1)),
        (torch.tensor([7]), torch.tensor(0)),
    ]
    assert PadCollate()(labels)[1].tolist() == [1, 0]


def test_teacher_forcing_shifts_the_target_into_the_decoders_input():
    bos, eos = 1, 2
    items = [
        (torch.tensor([5, 6]), torch.tensor([bos, 7, 8, eos])),
        (torch.tensor([9]), torch.tensor([bos, 7, eos])),
    ]
    (x, lengths, y_in), y_out = PadCollate(teacher_forcing=True)(items)
    assert x.tolist() == [[5, 6], [9, 0]] and lengths.tolist() == [2, 1]
    assert y_in.tolist() == [[bos, 7, 8], [bos, 7, 0]]
    assert y_out.tolist() == [[7, 8, eos], [7, eos, -100]]
    with pytest.raises(ValueError, match=r"target 1 of the batch has shape \(\)"):
        PadCollate(teacher_forcing=True)(
            [items[0], (torch.tensor([5]), torch.tensor(3))]
        )


def test_masked_cross_entropy_averages_over_real_tokens_in_either_layout():
    g = torch.Generator().manual_seed(1)
    out = torch.randn(3, 5, 4, generator=g)  # (B, T, C)
    y = torch.randint(0, 4, (3, 5), generator=g)
    y[0, 3:] = y[2, 1:] = -100
    keep = y != -100
    want = F.cross_entropy(out[keep], y[keep])
    assert torch.allclose(masked_cross_entropy(out, y), want)
    assert torch.allclose(masked_cross_entropy(out.transpose(1, 2), y), want)


class Tagger(nn.Module):
    """Embedding, a GRU over the real tokens only (packed), a tag per token."""

    def __init__(self, vocab=8):
        super().__init__()
        self.emb, self.rnn = (
            nn.Embedding(vocab, 16, padding_idx=0),
            nn.GRU(16, 16, batch_first=True),
        )
        self.head = nn.Linear(16, 2)

    def forward(self, x, lengths):
        packed = pack_padded_sequence(
            self.emb(x), lengths.cpu(), batch_first=True, enforce_sorted=False
        )
        h, _ = pad_packed_sequence(
            self.rnn(packed)[0], batch_first=True, total_length=x.shape[1]
        )
        return self.head(h)  # (B, T, 2)


def test_a_tagger_trains_on_padded_batches_with_the_masked_loss():
    collate = PadCollate()
    train = DataLoader(pairs(), 8, shuffle=True, collate_fn=collate)
    data = DataBunch(
        train, DataLoader(pairs(seed=1), 8, collate_fn=collate), device="cpu"
    )
    torch.manual_seed(0)
    learn = Learner(
        data, Tagger(), masked_cross_entropy, metrics=[TokenAccuracy()], progress=False
    )
    history = learn.fit(5, lr=0.03)
    assert history[-1]["token_accuracy"] > max(0.8, history[0]["token_accuracy"])
    # Token accuracy counts the real tokens of the whole set.
    (x, lengths), y = collate(pairs(seed=1))
    with torch.no_grad():
        pred = learn.model.eval()(x, lengths).argmax(-1)
    keep = sequence_mask(lengths)
    want = (pred == y)[keep].double().mean().item()
    assert history[-1]["token_accuracy"] == pytest.approx(want)


def test_pad_collate_refuses_what_it_cannot_pad():
    with pytest.raises(
        TypeError, match=r"item 0 of the batch is Tensor; it takes \(x, y\)"
    ):
        PadCollate()([torch.tensor([1, 2])])
    with pytest.raises(
        TypeError, match=r"teacher_forcing must be True or False; got 'yes'"
    ):
        PadCollate(teacher_forcing="yes")


# -- the class dim, decided once per fit -------------------------------------------
def tag_pairs(lengths, tags=5, seed=0):
    """One (tokens, tags) item per length, in order."""
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(1, 8, (t,), generator=g),
            torch.randint(0, tags, (t,), generator=g),
        )
        for t in lengths
    ]


class TagLinear(nn.Module):
    """Channels last: a tag score per token, (B, T, tags)."""

    def __init__(self, tags=5):
        super().__init__()
        self.emb, self.head = nn.Embedding(8, 8), nn.Linear(8, tags)

    def forward(self, x, lengths):
        return self.head(self.emb(x))


class TagConv(TagLinear):
    """Channels first, as a Conv1d gives them: (B, tags, T)."""

    def forward(self, x, lengths):
        return super().forward(x, lengths).transpose(1, 2)


@pytest.mark.parametrize("model", [TagLinear, TagConv])
def test_a_batch_whose_length_equals_the_tag_count_keeps_the_fits_class_dim(model):
    # Batches padded to 3, 4 then 5 tokens with 5 tags: the third batch's
    # (B, 5, 5) output fits both layouts; the first batch decided.
    train = tag_pairs([3, 2, 4, 1, 5, 5])
    valid = tag_pairs([5, 4, 2, 3], seed=1)  # its first batch is ambiguous too
    collate = PadCollate()
    data = DataBunch(
        DataLoader(train, 2, collate_fn=collate),
        DataLoader(valid, 2, collate_fn=collate),
        device="cpu",
    )
    torch.manual_seed(0)
    learn = Learner(
        data, model(), masked_cross_entropy, metrics=[TokenAccuracy()],
        train_metrics=[TokenAccuracy()], progress=False,
    )  # fmt: skip
    record = learn.fit(2, lr=0.1)[-1]
    (x, lengths), y = collate(valid)
    with torch.no_grad():
        out = learn.model(x, lengths)
    scores = out if model is TagLinear else out.transpose(1, 2)
    keep = y != -100
    want_acc = (scores.argmax(-1) == y)[keep].double().mean().item()
    assert record["token_accuracy"] == pytest.approx(want_acc)
    want_loss = F.cross_entropy(scores[keep], y[keep]).item()
    assert record["valid_loss"] == pytest.approx(want_loss, rel=1e-5)


def test_a_first_batch_that_fits_both_layouts_asks_for_class_dim_before_training():
    collate = PadCollate()
    dl = DataLoader(tag_pairs([5, 2, 3, 4]), 2, collate_fn=collate)
    learn = Learner(
        DataBunch(dl, dl, device="cpu"), TagLinear(), masked_cross_entropy,
        progress=False,
    )  # fmt: skip
    before = [p.clone() for p in learn.model.parameters()]
    with pytest.raises(ValueError, match=r"class_dim.*partial\(masked_cross_entropy"):
        learn.fit(1, lr=0.1)
    assert all(torch.equal(a, b) for a, b in zip(before, learn.model.parameters()))
    # Said once, it holds for the fit.
    learn.loss_func = functools.partial(masked_cross_entropy, class_dim=-1)
    assert learn.fit(1, lr=0.1)[-1]["valid_loss"] > 0


def test_a_decision_lives_as_long_as_its_fit_and_survives_an_evaluation_inside_it():
    collate = PadCollate()
    train = DataLoader(tag_pairs([3, 2, 5, 5, 4, 1]), 2, collate_fn=collate)
    valid = DataLoader(tag_pairs([5, 4, 2, 3], seed=1), 2, collate_fn=collate)
    torch.manual_seed(0)
    learn = Learner(
        DataBunch(train, valid, device="cpu"), TagLinear(), masked_cross_entropy,
        metrics=[TokenAccuracy()], progress=False,
    )  # fmt: skip
    # fit_snapshots yields after each step: validate() there evaluates the
    # same model (sharing its decisions), then the fit's second batch,
    # (2, 5, 5), still reads channels last as the first batch decided.
    for _ in learn.fit_snapshots(n_steps=3, every=1, lr=0.1):
        learn.validate(DataLoader(tag_pairs([3, 2]), 2, collate_fn=collate))
    # The decisions are the model's: another model's channels-first (2, 5, 5)
    # output is ambiguous again, not read as the first model's layout.
    other = Learner(
        DataBunch(valid, valid, device="cpu"), TagConv(), masked_cross_entropy,
        progress=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"class_dim"):
        other.validate()


def _tag_data(train_lengths, valid_lengths):
    collate = PadCollate()
    return DataBunch(
        DataLoader(tag_pairs(train_lengths), 2, collate_fn=collate),
        DataLoader(tag_pairs(valid_lengths, seed=1), 2, collate_fn=collate),
        device="cpu",
    )


def test_validate_after_a_fit_keeps_the_class_dim_the_fit_decided():
    # The validation set's first batch, (2, 5, 5), fits both layouts: the
    # fit's first training batch decided channels last for this model.
    torch.manual_seed(0)
    learn = Learner(
        _tag_data([3, 2, 4, 1, 5, 5], [5, 4, 2, 3]), TagLinear(),
        masked_cross_entropy, metrics=[TokenAccuracy()], progress=False,
    )  # fmt: skip
    record = learn.fit(1, lr=0.1)[-1]
    got = learn.validate()
    assert got["valid_loss"] == record["valid_loss"]
    assert got["token_accuracy"] == record["token_accuracy"]


class _Die(Callback):
    def on_batch_begin(self, step, train):
        if train and step == 1:
            raise KeyboardInterrupt


def test_a_resumed_fit_keeps_the_class_dim_its_first_run_decided(tmp_path):
    # Killed after step 1 (a (2, 3, 5) batch decided channels last); the
    # resumed fit's first batch, (2, 5, 5), fits both layouts.
    def make(callbacks):
        torch.manual_seed(0)
        return Learner(
            _tag_data([3, 2, 5, 5, 4, 1], [3, 4, 2, 1]), TagLinear(),
            masked_cross_entropy, progress=False, callbacks=callbacks,
        )  # fmt: skip

    with pytest.raises(KeyboardInterrupt):
        make([Checkpoint(tmp_path, every_n_steps=1), _Die()]).fit(1, lr=0.1)
    resumed = make([Checkpoint(tmp_path, every_n_steps=1)]).fit(1, lr=0.1)[-1]
    unbroken = make([]).fit(1, lr=0.1)[-1]
    assert resumed["train_loss"] == unbroken["train_loss"]
    assert resumed["valid_loss"] == unbroken["valid_loss"]


# -- what PadCollate cannot pad, and its arguments ---------------------------------
def test_pad_collate_names_the_item_whose_target_is_a_label_among_sequences():
    items = [
        (torch.tensor([5, 6]), torch.tensor([1, 0])),
        (torch.tensor([7]), torch.tensor(1)),
    ]
    with pytest.raises(
        ValueError, match=r"item 1's y is a single label.*item 0's.*a sequence.*Fix"
    ):
        PadCollate()(items)


def test_pad_collate_says_str_tokens_need_ids():
    with pytest.raises(TypeError, match=r"item 0's x holds str.*Fix: map.*ids"):
        PadCollate()([(["the", "cat"], 1)])
    with pytest.raises(TypeError, match=r"item 1's y holds str.*Fix"):
        PadCollate()([([1, 2], 0), ([3], "pos")])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"pad_value": None},
            TypeError,
            r"PadCollate: pad_value must be an int; got None",
        ),
        (
            {"pad_value": 1.5},
            TypeError,
            r"PadCollate: pad_value must be an int; got 1.5",
        ),
        ({"pad_value": True}, TypeError, r"pad_value must be an int; got True"),
        ({"ignore_index": "x"}, TypeError, r"ignore_index must be an int; got 'x'"),
        ({"ignore_index": None}, TypeError, r"ignore_index must be an int; got None"),
        ({"teacher_forcing": 1}, TypeError, r"teacher_forcing must be True or False"),
    ],
)
def test_pad_collate_checks_its_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        PadCollate(**kwargs)
