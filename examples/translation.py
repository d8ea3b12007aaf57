"""Sequence-to-sequence "translation" with attention, trained with fitlib.

The script makes its own language pair (no download). A source sentence is
3 to 12 random words of a 20-word vocabulary (``a`` ... ``t``); its
translation is the sentence reversed, each word mapped through a fixed
permutation of the vocabulary, between ``<bos>`` and ``<eos>``. Reversing
sentences of any length needs attention: the decoder's ``k``-th word is the
source's ``k``-th word from the end.

The model is a bidirectional GRU encoder and a GRU decoder with dot-product
attention over the encoder's states, padding masked out. Batches come from
``fitlib.sequences.PadCollate(teacher_forcing=True)``, which pads the
sentences, returns the source lengths and the decoder's input (the target
shifted right: teacher forcing). The loss is ``masked_cross_entropy``, the
metrics ``TokenAccuracy()`` and ``Perplexity()``, padding left out of all
three. At the end the script greedy-decodes two validation sentences.

Run it with::

    python examples/translation.py [--epochs N] [--batch-size B] [--n N] [--seed S]
"""

from __future__ import annotations

import random
import string

import cli  # the shared command line (examples/cli.py)
import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F  # noqa: N812
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.data import DataLoader

from fitlib import DataBunch, Learner
from fitlib.metrics import Perplexity, TokenAccuracy
from fitlib.sequences import PadCollate, masked_cross_entropy, sequence_mask

PAD, BOS, EOS = 0, 1, 2
N_WORDS = 20  # words of each language, ids 3 .. 22
VOCAB = 3 + N_WORDS  # one id space for both languages
MIN_LEN, MAX_LEN = 3, 12
N_DEFAULT = 4000  # sentence pairs, split 80/20
IGNORE = -100  # the label of padding in the targets (PadCollate's default)
NAMES = ["<pad>", "<bos>", "<eos>", *string.ascii_lowercase[:N_WORDS]]


def make_pairs(n: int, generator: torch.Generator) -> list[tuple[Tensor, Tensor]]:
    """``n`` pairs ``(source, [BOS, *translation, EOS])`` of token ids."""
    perm = 3 + torch.randperm(N_WORDS, generator=generator)  # the dictionary
    lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (n,), generator=generator)
    pairs = []
    for length in lengths.tolist():
        src = torch.randint(3, VOCAB, (length,), generator=generator)
        words = perm[src.flip(0) - 3]
        tgt = torch.cat([torch.tensor([BOS]), words, torch.tensor([EOS])])
        pairs.append((src, tgt))
    return pairs


def make_data(n: int, batch_size: int, generator: torch.Generator) -> DataBunch:
    pairs = make_pairs(n, generator)
    n_train = max(1, int(0.8 * n))
    collate = PadCollate(pad_value=PAD, ignore_index=IGNORE, teacher_forcing=True)
    train_dl = DataLoader(
        pairs[:n_train], batch_size, shuffle=True, collate_fn=collate,
        generator=generator,
    )  # fmt: skip
    valid_dl = DataLoader(pairs[n_train:], 2 * batch_size, collate_fn=collate)
    return DataBunch(train_dl, valid_dl)


class Seq2Seq(nn.Module):
    """A bidirectional GRU encoder; a GRU decoder whose output at each step
    attends (scaled dot product) to the encoder's states and is combined
    with the attended context to score the next word (Luong et al. 2015)."""

    def __init__(self, vocab: int = VOCAB, emb: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.src_emb = nn.Embedding(vocab, emb, padding_idx=PAD)
        self.encoder = nn.GRU(emb, hidden, batch_first=True, bidirectional=True)
        self.bridge = nn.Linear(2 * hidden, hidden)  # encoder's end -> decoder's h0
        self.tgt_emb = nn.Embedding(vocab, emb, padding_idx=PAD)
        self.decoder = nn.GRU(emb, hidden, batch_first=True)
        self.keys = nn.Linear(2 * hidden, hidden, bias=False)
        self.combine = nn.Linear(3 * hidden, hidden)
        self.head = nn.Linear(hidden, vocab)

    def encode(self, src: Tensor, lengths: Tensor) -> tuple[Tensor, ...]:
        """The encoder's states ``(B, S, 2H)``, their keys, the source mask
        ``(B, S)`` and the decoder's first hidden state ``(1, B, H)``."""
        packed = pack_padded_sequence(
            self.src_emb(src), lengths.cpu(), batch_first=True, enforce_sorted=False
        )
        states, h_n = self.encoder(packed)
        states, _ = pad_packed_sequence(
            states, batch_first=True, total_length=src.shape[1]
        )
        mask = sequence_mask(lengths.to(src.device), src.shape[1])
        h0 = torch.tanh(self.bridge(torch.cat([h_n[0], h_n[1]], -1))).unsqueeze(0)
        return states, self.keys(states), mask, h0

    def decode(
        self, y_in: Tensor, h: Tensor, states: Tensor, keys: Tensor, mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Logits ``(B, T, V)`` for the decoder inputs ``y_in`` ``(B, T)``,
        and the decoder's last hidden state."""
        out, h = self.decoder(self.tgt_emb(y_in), h)
        scores = out @ keys.transpose(1, 2) / keys.shape[-1] ** 0.5  # (B, T, S)
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        context = scores.softmax(-1) @ states  # (B, T, 2H)
        mixed = torch.tanh(self.combine(torch.cat([out, context], -1)))
        return self.head(mixed), h

    def forward(self, src: Tensor, lengths: Tensor, y_in: Tensor) -> Tensor:
        states, keys, mask, h = self.encode(src, lengths)
        return self.decode(y_in, h, states, keys, mask)[0]

    @torch.no_grad()
    def greedy(self, src: Tensor, lengths: Tensor, max_len: int = 20) -> Tensor:
        """Translations ``(B, <= max_len)`` word by word, each step fed the
        previous step's most likely word (EOS included; then padding)."""
        states, keys, mask, h = self.encode(src, lengths)
        y = torch.full((src.shape[0], 1), BOS, device=src.device)
        done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
        words = []
        for _ in range(max_len):
            logits, h = self.decode(y, h, states, keys, mask)
            y = logits.argmax(-1)
            words.append(y.masked_fill(done[:, None], PAD))
            done |= y.squeeze(1) == EOS
            if done.all():
                break
        return torch.cat(words, 1)


def build(
    batch_size: int = 64, n: int | None = None, progress: bool = True, seed: int = 0
) -> Learner:
    """The data, the model and the Learner, untrained, all seeded from ``seed``."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    data = make_data(N_DEFAULT if n is None else n, batch_size, generator)
    return Learner(
        data,
        Seq2Seq(),
        loss_func=masked_cross_entropy,
        metrics=[TokenAccuracy(), Perplexity()],
        opt_func=torch.optim.AdamW,
        wd=0.01,
        progress=progress,
    )


def main(
    epochs: int = 8,
    batch_size: int = 64,
    n: int | None = None,
    progress: bool = True,
    seed: int = 0,
) -> Learner:
    """Train the encoder-decoder on the synthetic pair; return the Learner."""
    learn = build(batch_size, n, progress, seed)
    learn.fit_one_cycle(epochs, lr=3e-3)
    return learn


def token_valid_loss(learn: Learner) -> float:
    """The cross-entropy per target token over the whole validation set."""
    model, total, count = learn.model, 0.0, 0
    model.eval()
    with torch.no_grad():
        for (src, lengths, y_in), y_out in learn.data.valid_dl:
            logits = model(src, lengths, y_in)
            total += F.cross_entropy(
                logits.flatten(0, 1), y_out.flatten(), ignore_index=IGNORE,
                reduction="sum",
            ).item()  # fmt: skip
            count += int((y_out != IGNORE).sum())
    return total / count


def words(ids: list[int]) -> str:
    return " ".join(NAMES[i] for i in ids if i not in (PAD, BOS, EOS))


def show_translations(learn: Learner, k: int = 2) -> None:
    """Greedy-decode the first ``k`` validation sentences; print them."""
    (src, lengths, _), y_out = next(iter(learn.data.valid_dl))
    learn.model.eval()
    pred = learn.model.greedy(src[:k], lengths[:k])
    for i in range(len(pred)):  # fewer than k when the set is smaller
        print(f"source:     {words(src[i, : lengths[i]].tolist())}")
        print(f"target:     {words(y_out[i][y_out[i] != IGNORE].tolist())}")
        print(f"prediction: {words(pred[i].tolist())}")


if __name__ == "__main__":
    learn = main(**cli.args(main, __doc__))
    show_translations(learn)
    # fitlib's valid_loss is the mean over the whole set's tokens (each batch
    # weighs by its tokens, not its sentences): the two are equal.
    print(
        f"valid loss per token (whole set): {token_valid_loss(learn):.6f}; "
        f"fitlib's valid_loss: {learn.recorder.epoch_table()[-1]['valid_loss']:.6f}"
    )
    print(cli.result_line("translation", learn, "token_accuracy"))
