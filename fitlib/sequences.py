"""Variable-length sequences: a padding ``collate_fn`` that returns the
lengths (and, for a decoder, the teacher-forcing shift), the mask of real
tokens, and a cross-entropy over the tokens that are not padding.

Examples:
    >>> from torch.utils.data import DataLoader
    >>> from fitlib.sequences import PadCollate
    >>> pairs = [(torch.tensor([5, 6, 7]), torch.tensor([1, 2, 3])),
    ...          (torch.tensor([8]), torch.tensor([4, 5]))]
    >>> dl = DataLoader(pairs, 32, collate_fn=PadCollate(teacher_forcing=True))
    >>> (src, src_lengths, tgt_in), tgt_out = next(iter(dl))
    >>> src.tolist(), src_lengths.tolist(), tgt_in.tolist(), tgt_out.tolist()
    ([[5, 6, 7], [8, 0, 0]], [3, 1], [[1, 2], [4, 0]], [[2, 3], [5, -100]])
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F  # noqa: N812
from torch.nn.utils.rnn import pad_sequence

from fitlib.checks import check_flag
from fitlib.metrics.functions import check_index, class_rows


class PadCollate:
    """A ``collate_fn`` for ``(x, y)`` items whose ``x`` (and ``y``) are 1-d
    sequences of different lengths.

    Returns ``((x, lengths), y)``: ``x`` padded with ``pad_value`` to the
    longest in the batch, ``(B, T)``; ``lengths`` its sequences' lengths (a
    CPU int64 tensor before ``fit`` moves the batch; ``pack_padded_sequence``
    wants ``lengths.cpu()``); ``y`` padded with ``ignore_index``, which
    ``cross_entropy`` and fitlib's token metrics leave out, or stacked when
    every ``y`` has one shape (a label per sequence).

    With ``teacher_forcing=True`` (a decoder that reads the target so far),
    each ``y`` is ``[BOS, w1, ..., EOS]`` and the batch is
    ``((x, lengths, y_in), y_out)``: ``y_in = y[:-1]`` padded with
    ``pad_value`` (the decoder's input), ``y_out = y[1:]`` padded with
    ``ignore_index`` (what it must predict).

    Examples:
        >>> from fitlib.sequences import PadCollate
        >>> collate = PadCollate()
        >>> (x, lengths), y = collate([(torch.tensor([5, 6, 7]), torch.tensor(1)),
        ...                            (torch.tensor([8]), torch.tensor(0))])
        >>> x.tolist(), lengths.tolist(), y.tolist()
        ([[5, 6, 7], [8, 0, 0]], [3, 1], [1, 0])
    """

    def __init__(
        self,
        pad_value: int = 0,
        ignore_index: int = -100,
        teacher_forcing: bool = False,
    ) -> None:
        self.pad_value = check_index(pad_value, "pad_value", "PadCollate", "0", False)
        self.ignore_index = check_index(
            ignore_index, "ignore_index", "PadCollate", "-100", False
        )
        self.teacher_forcing = check_flag(
            teacher_forcing, "teacher_forcing", "PadCollate",
            "PadCollate(teacher_forcing=True)",
        )  # fmt: skip

    def __call__(self, items: list) -> tuple:
        xs, ys = self._split(items)
        lengths = torch.tensor([len(x) for x in xs], dtype=torch.long)
        x = pad_sequence(xs, batch_first=True, padding_value=self.pad_value)
        if self.teacher_forcing:
            short = [i for i, y in enumerate(ys) if y.ndim != 1 or len(y) < 2]
            if short:
                raise ValueError(
                    f"PadCollate(teacher_forcing=True): target {short[0]} of the "
                    f"batch has shape {tuple(ys[short[0]].shape)}; each target "
                    "must be a sequence [BOS, ..., EOS] of 2 tokens or more."
                )
            y_in = pad_sequence([y[:-1] for y in ys], batch_first=True,
                                padding_value=self.pad_value)  # fmt: skip
            y_out = pad_sequence([y[1:] for y in ys], batch_first=True,
                                 padding_value=self.ignore_index)  # fmt: skip
            return (x, lengths, y_in), y_out
        if len({y.shape for y in ys}) == 1 and ys[0].ndim == 0:
            return (x, lengths), torch.stack(ys)
        _check_targets(ys)
        y = pad_sequence(ys, batch_first=True, padding_value=self.ignore_index)
        return (x, lengths), y

    @staticmethod
    def _split(items: list) -> tuple[list[Tensor], list[Tensor]]:
        xs, ys = [], []
        for i, item in enumerate(items):
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise TypeError(
                    f"PadCollate: item {i} of the batch is {type(item).__name__}; "
                    "it takes (x, y) items of 1-d sequences. Fix: make the "
                    "dataset return (tokens, target) pairs."
                )
            x, y = (_as_tensor(v, i, name) for v, name in zip(item, "xy"))
            if x.ndim != 1:
                raise ValueError(
                    f"PadCollate: item {i}'s x has shape {tuple(x.shape)}; it pads "
                    "1-d sequences of token ids. Fix: one sequence per item."
                )
            xs.append(x)
            ys.append(y)
        return xs, ys

    def __repr__(self) -> str:
        return (
            f"PadCollate(pad_value={self.pad_value}, ignore_index="
            f"{self.ignore_index}, teacher_forcing={self.teacher_forcing})"
        )


def _as_tensor(value: object, i: int, name: str) -> Tensor:
    """Item ``i``'s ``x`` or ``y`` as a tensor; str tokens are refused (torch
    refuses them too: they are looked for only then, not in every batch)."""
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        words = [value] if isinstance(value, str) else value
        if isinstance(words, (list, tuple)) and any(isinstance(w, str) for w in words):
            raise TypeError(
                f"PadCollate: item {i}'s {name} holds str tokens ({value!r:.60}); "
                "it pads token ids (ints). Fix: map the tokens to ids in the "
                "dataset, e.g. [vocab[w] for w in words] with vocab = {w: i for i, "
                "w in enumerate(sorted(set(all_words)), start=1)} (0 left for "
                "padding)."
            ) from None
        raise TypeError(
            f"PadCollate: item {i}'s {name} is {type(value).__name__}, which is "
            f"no sequence of numbers ({e}). Fix: make the dataset return "
            "tensors, or lists of token ids."
        ) from e


def _check_targets(ys: list[Tensor]) -> None:
    """Refuses targets that are labels for some items and sequences for
    others: ``pad_sequence`` cannot pad them together."""
    kinds = {"a single label" if y.ndim == 0 else "a sequence" for y in ys}
    if len(kinds) > 1:
        label = next(i for i, y in enumerate(ys) if y.ndim == 0)
        seq = next(i for i, y in enumerate(ys) if y.ndim != 0)
        raise ValueError(
            f"PadCollate: item {label}'s y is a single label (shape ()), but "
            f"item {seq}'s is a sequence (shape {tuple(ys[seq].shape)}): the "
            "targets of a batch are either one label per sequence (stacked) or "
            "one tag per token (padded). Fix: make the dataset return one kind, "
            "e.g. torch.tensor([label]) for a sequence of one."
        )


def sequence_mask(lengths: Tensor, max_len: int | None = None) -> Tensor:
    """``(B, T)`` booleans, True at the real tokens of sequences of
    ``lengths`` (padding after them); ``T`` is ``max_len`` or the longest.

    Examples:
        >>> from fitlib.sequences import sequence_mask
        >>> sequence_mask(torch.tensor([3, 1])).tolist()
        [[True, True, True], [True, False, False]]
    """
    if not isinstance(lengths, Tensor) or lengths.ndim != 1:
        raise ValueError(
            f"sequence_mask: lengths must be a 1-d tensor of sequence lengths; "
            f"got {lengths!r}. Fix: the lengths PadCollate returns."
        )
    t = int(lengths.max()) if max_len is None else max_len
    return torch.arange(t, device=lengths.device) < lengths[:, None]


def masked_cross_entropy(
    out: Tensor, y: Tensor, *, ignore_index: int = -100, class_dim: int | None = None
) -> Tensor:
    """Cross-entropy averaged over the tokens whose target is not
    ``ignore_index``, for logits ``(B, T, C)`` (channels last, as a decoder
    gives them) or ``(B, C, T)``: the class dim is found as the metrics find
    it (``find_class_dim``): a fit's first batch decides it, a later batch
    padded to as many tokens as there are classes keeps it, and a first
    batch that fits both asks for ``class_dim``.

    Examples:
        >>> from fitlib.sequences import masked_cross_entropy
        >>> masked_cross_entropy(torch.zeros(1, 3, 4), torch.tensor([[0, 2, -100]]))
        tensor(1.3863)
    """
    logits, t = class_rows(out, y, "masked_cross_entropy", class_dim)
    return F.cross_entropy(logits, t, ignore_index=ignore_index)


def _count_kept(
    out: Tensor, y: Tensor, *, ignore_index: int = -100, class_dim: int | None = None
) -> Tensor:
    """The tokens ``masked_cross_entropy`` averages over (targets that are not
    ``ignore_index``): the epoch's loss weighs each batch by them."""
    return (y != ignore_index).sum()


masked_cross_entropy.count = _count_kept  # read by fitlib.running_loss.loss_count
