"""Classify variable-length sentences with a TextCNN and fitlib.

Shows a convolutional text classifier on padded batches: ``PadCollate`` pads
each batch and gives ``((x, lengths), y)``, fitlib calls the model as
``model(x, lengths)``, and the model masks the windows that start on padding
(``sequence_mask``) before the max-pool over time, so a sentence scores the
same however long the batch's longest one is. Embedding, Conv1d of widths 1,
2 and 3, max-pool over time, dropout, linear head; cross-entropy, accuracy,
1cycle.

The data is made here, no download: synthetic sentences whose sentiment
depends on word order ("not bad" is positive), from ``synthetic_text.py``.

Run it:
    python examples/textcnn_sentiment.py [--epochs N] [--batch-size B] [--n N]
                                         [--seed S]
"""

from __future__ import annotations

import math
import random

import cli  # the shared command line (examples/cli.py)
import torch
from synthetic_text import PAD, VOCAB_SIZE, sentiment_data
from torch import Tensor, nn
from torch.nn import functional as F  # noqa: N812

from fitlib import Learner
from fitlib.metrics import accuracy
from fitlib.sequences import sequence_mask


class TextCNN(nn.Module):
    """Kim's TextCNN: n-gram filters of several widths, each max-pooled over
    the windows that start on a real token, then dropout and a linear head."""

    def __init__(
        self,
        vocab_size: int,
        emb_dim: int = 64,
        n_filters: int = 64,
        widths: tuple[int, ...] = (1, 2, 3),
        n_classes: int = 2,
        dropout: float = 0.3,
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, emb_dim, padding_idx=PAD)
        self.convs = nn.ModuleList(nn.Conv1d(emb_dim, n_filters, w) for w in widths)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(n_filters * len(widths), n_classes)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        emb = self.emb(x).transpose(1, 2)  # (B, emb_dim, T): channels first
        # A window starting on a real token counts; the ones starting on padding
        # are set to -inf, so the max over time never picks them.
        starts_on_padding = ~sequence_mask(lengths.to(x.device), x.shape[1])[:, None]
        pooled = []
        for conv in self.convs:
            # Pad on the right so every token starts a window: T outputs.
            h = F.relu(conv(F.pad(emb, (0, conv.kernel_size[0] - 1))))
            pooled.append(h.masked_fill(starts_on_padding, -math.inf).amax(dim=2))
        return self.head(self.drop(torch.cat(pooled, dim=1)))


def main(
    epochs: int = 5,
    batch_size: int = 64,
    n: int | None = None,
    progress: bool = True,
    seed: int = 0,
) -> Learner:
    """Trains the TextCNN on ``n`` synthetic sentences (4,000 by default)."""
    random.seed(seed)
    torch.manual_seed(seed)  # the same weights and batch order on every run
    data = sentiment_data(n=n or 4000, batch_size=batch_size, seed=seed)
    model = TextCNN(VOCAB_SIZE)
    learn = Learner(
        data,
        model,
        loss_func=F.cross_entropy,
        opt_func=torch.optim.AdamW,
        wd=0.01,
        metrics=[accuracy],
        progress=progress,
    )
    learn.fit_one_cycle(epochs, lr=1e-2)
    return learn


if __name__ == "__main__":
    learn = main(**cli.args(main, __doc__))
    print(cli.result_line("textcnn_sentiment", learn, "accuracy"))
