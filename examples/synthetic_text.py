"""A synthetic sentiment data set for the text examples; nothing to download.

Token ids stand for words: ``0`` is padding, a few ids are negations ("not"),
some are positive ("good") or negative ("bad") words, the rest are neutral.
Each sentence (5 to 40 tokens) hides 1 to 3 sentiment phrases among neutral
words; a phrase is a sentiment word, or a negation followed by one, which
flips it ("not bad" is positive). The label is the sign of the phrases' sum
(1: positive, 0: negative). A negation counts only right before a sentiment
word, and some negations stand before neutral words and change nothing, so
a model must read the words in order: a bag of words cannot tell "not good
... bad" from "good ... not bad".

Example:
    >>> data = sentiment_data(n=1000, batch_size=32, seed=0)
    >>> (x, lengths), y = next(iter(data.train_dl))  # x: (32, T), padded with 0
"""

from __future__ import annotations

import random

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from fitlib import DataBunch
from fitlib.sequences import PadCollate

PAD = 0
VOCAB_SIZE = 300
NEGATIONS = range(1, 4)
POSITIVE = range(4, 24)
NEGATIVE = range(24, 44)
NEUTRAL = range(44, VOCAB_SIZE)


def make_sentence(rng: random.Random, min_len: int = 5, max_len: int = 40):
    """One sentence: a 1-d tensor of token ids and its label, 0 or 1."""
    label = rng.randint(0, 1)
    polarity = 1 if label else -1
    while True:  # 1 to 3 phrases, most agreeing with the label, their sum too
        signs = [polarity if rng.random() < 0.8 else -polarity
                 for _ in range(rng.randint(1, 3))]  # fmt: skip
        if sum(signs) * polarity > 0:
            break
    phrases = []
    for sign in signs:
        negated = rng.random() < 0.4  # "not bad" says +1 with a -1 word
        word = rng.choice(POSITIVE if sign * (-1 if negated else 1) > 0 else NEGATIVE)
        phrases.append([rng.choice(NEGATIONS), word] if negated else [word])
    n_left = rng.randint(min_len, max_len) - sum(map(len, phrases))
    words = []
    while n_left > 0:  # neutral filler; a negation before one does nothing
        if n_left >= 2 and rng.random() < 0.05:
            words.append([rng.choice(NEGATIONS), rng.choice(NEUTRAL)])
        else:
            words.append([rng.choice(NEUTRAL)])
        n_left -= len(words[-1])
    for phrase in phrases:
        words.insert(rng.randint(0, len(words)), phrase)
    return torch.tensor([t for w in words for t in w]), label


def make_sentences(n: int, seed: int = 0) -> tuple[list[Tensor], list[int]]:
    """``n`` sentences (token tensors) and their labels, the same for a seed."""
    rng = random.Random(seed)
    pairs = [make_sentence(rng) for _ in range(n)]
    return [x for x, _ in pairs], [y for _, y in pairs]


def sentiment_data(
    n: int = 4000, batch_size: int = 64, seed: int = 0, valid_pct: float = 0.2
) -> DataBunch:
    """``n`` sentences split train/valid, in DataLoaders whose ``PadCollate``
    gives batches ``((x, lengths), y)``: ``x`` padded with ``PAD`` to the
    longest sentence of the batch; the training order is drawn from ``seed``."""
    xs, ys = make_sentences(n, seed)
    items = [(x, torch.tensor(y)) for x, y in zip(xs, ys)]
    n_valid = max(1, int(n * valid_pct))
    train, valid = items[n_valid:], items[:n_valid]
    collate = PadCollate(pad_value=PAD)
    order = torch.Generator().manual_seed(seed)
    train_dl = DataLoader(
        train, batch_size, shuffle=True, collate_fn=collate, generator=order
    )
    valid_dl = DataLoader(valid, 2 * batch_size, collate_fn=collate)
    return DataBunch(train_dl, valid_dl)
