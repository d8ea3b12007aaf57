"""Variable-length sequences: padding with lengths, the teacher-forcing
shift, masks, and a cross-entropy over the real tokens, through a fit."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.data import DataLoader

from fitlib import DataBunch, Learner
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
