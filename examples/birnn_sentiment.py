"""Classify variable-length sentences with a bidirectional LSTM and fitlib.

Shows batches of padded sequences with their lengths: ``PadCollate`` pads each
batch and gives ``((x, lengths), y)``, fitlib calls the model as
``model(x, lengths)``, and the model packs the batch
(``pack_padded_sequence``) so the LSTM never reads the padding. Embedding,
bidirectional LSTM, max-pool of its outputs over the real tokens, linear head;
cross-entropy, accuracy, 1cycle.

The data is made here, no download: synthetic sentences whose sentiment
depends on word order ("not bad" is positive), from ``synthetic_text.py``.

Run it:
    python examples/birnn_sentiment.py [--epochs N] [--batch-size B] [--n N] [--seed S]
"""

from __future__ import annotations

import math
import random

import cli  # the shared command line (examples/cli.py)
import torch
from synthetic_text import PAD, VOCAB_SIZE, sentiment_data
from torch import Tensor, nn
from torch.nn import functional as F  # noqa: N812
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from fitlib import Learner
from fitlib.metrics import accuracy


class BiLSTMClassifier(nn.Module):
    """Embedding, a bidirectional LSTM over the real tokens, the max of its
    outputs over time (each position's gradient flows straight to the head,
    which learns faster than the last states alone), a linear head."""

    def __init__(
        self, vocab_size: int, emb_dim: int = 32, hidden: int = 64, n_classes: int = 2
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, emb_dim, padding_idx=PAD)
        self.lstm = nn.LSTM(emb_dim, hidden, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, n_classes)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        # Packing needs the lengths on the CPU, wherever the batch is.
        packed = pack_padded_sequence(
            self.emb(x), lengths.cpu(), batch_first=True, enforce_sorted=False
        )
        out, _ = self.lstm(packed)
        # Back to (B, T, 2 * hidden), padding at -inf so the max never picks it.
        out, _ = pad_packed_sequence(out, batch_first=True, padding_value=-math.inf)
        return self.head(out.max(dim=1).values)


def main(
    epochs: int = 4,
    batch_size: int = 64,
    n: int | None = None,
    progress: bool = True,
    seed: int = 0,
) -> Learner:
    """Trains the BiLSTM on ``n`` synthetic sentences (4,000 by default)."""
    random.seed(seed)
    torch.manual_seed(seed)  # the same weights and batch order on every run
    data = sentiment_data(n=n or 4000, batch_size=batch_size, seed=seed)
    model = BiLSTMClassifier(VOCAB_SIZE)
    learn = Learner(
        data,
        model,
        loss_func=F.cross_entropy,
        opt_func=torch.optim.AdamW,
        wd=0.01,
        metrics=[accuracy],
        progress=progress,
    )
    learn.fit_one_cycle(epochs, lr=2e-2)
    return learn


if __name__ == "__main__":
    learn = main(**cli.args(main, __doc__))
    print(cli.result_line("birnn_sentiment", learn, "accuracy"))
