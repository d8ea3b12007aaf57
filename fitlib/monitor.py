"""``Monitor``: the quantity a callback watches, and whether it improved.

Shared by the callbacks that act on a monitored value (``ReduceLROnPlateau``;
later ``EarlyStopping`` and ``Checkpoint(monitor=...)``). It is a helper, not
a callback: its owner calls it from its own hooks.

The value is read from the epoch's record (``state["record"]``), which the
loop reads from the device once per epoch for every consumer: ``valid_loss``,
``train_loss``, a metric, a training metric, a loss part or a value a
callback added, by name.
"""

from __future__ import annotations

import math
import re
from typing import Any

from fitlib.errors import closest, did_you_mean, is_number

MODES = ("auto", "min", "max")
DELTA_MODES = ("abs", "rel")
LOSSES = ("valid_loss", "train_loss")
# Words that say which way a quantity should go, for mode="auto". A name is
# split into words ("top_k_accuracy" -> top, k, accuracy); trailing digits are
# dropped ("acc1", "iou50") unless the word itself has them ("r2", "f1").
_DOWN = frozenset({
    "loss", "error", "err", "mse", "mae", "rmse", "msle", "rmsle", "mape", "smape",
    "wape", "nll", "perplexity", "distance", "divergence", "hamming", "wer", "cer",
    "ce", "bce", "kl", "kld", "huber",  # loss parts: valid_ce, train_kl...
})  # fmt: skip
_UP = frozenset({
    "accuracy", "acc", "f1", "fbeta", "r2", "precision", "recall", "auc", "auroc",
    "ap", "map", "dice", "iou", "miou", "jaccard", "kappa", "mcc", "matthews",
    "corr", "corrcoef", "pearson", "spearman", "specificity", "sensitivity",
    "bleu", "rouge", "psnr", "ssim", "ndcg", "explained",
})  # fmt: skip
_F_SCORE = re.compile(r"f\d+(\.\d+)?")  # f1, f2, f0.5: FBeta's names
_WORDS = sorted(_DOWN | _UP)


def direction(name: str) -> str | None:
    """``"min"`` or ``"max"``: which way ``name`` improves; None if unknown.

    Examples:
        >>> from fitlib.monitor import direction
        >>> direction("valid_loss"), direction("f0.5_score"), direction("x")
        ('min', 'max', None)
    """
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()  # camelCase
    ways = set()
    for word in re.findall(r"[a-z]+\d+(?:\.\d+)?|[a-z]+", name):
        stem = re.sub(r"[\d.]+$", "", word)
        if word in _DOWN or stem in _DOWN:
            ways.add("min")
        if word in _UP or stem in _UP or _F_SCORE.fullmatch(word):
            ways.add("max")
    # Both ("accuracy_loss") is as unknown as neither: the user must say.
    return ways.pop() if len(ways) == 1 else None


class Monitor:
    """Reads a monitored quantity at epoch end and tells if it improved.

    A value improves when it beats ``best`` by more than a margin in the
    mode's direction: ``min_delta`` itself (``min_delta_mode="abs"``), or
    ``min_delta * abs(best)`` (``"rel"``: ``min_delta=0.01`` asks for 1% better,
    torch's ``threshold_mode="rel"``; for a negative best torch's rule,
    ``best * (1 - min_delta)``, would take a worse value as an improvement,
    this one does not). NaN never improves. ``best`` starts at the worst
    value (``inf`` for "min", ``-inf`` for "max"), which any finite value
    beats, in either delta mode.

    Args:
        monitor: a name of the epoch record: ``"valid_loss"``,
            ``"train_loss"``, a metric's name, ``"train_<metric>"``, a loss
            part (``"valid_<part>"``) or a value a callback adds.
        mode: ``"min"``, ``"max"``, or ``"auto"`` to infer it from the name.
        min_delta: the least change that counts as an improvement (>= 0).
        owner: the owning callback's name, for error messages.
        min_delta_mode: ``"abs"`` (``min_delta`` is an amount of the value)
            or ``"rel"`` (a fraction of the best value's size).

    Examples:
        >>> from fitlib.monitor import Monitor
        >>> m = Monitor("accuracy", owner="EarlyStopping")
        >>> m.mode, m.best
        ('max', -inf)
        >>> m.start(Metrics([accuracy]), data)  # in on_train_begin
        >>> m.update(m.read({"valid_loss": 0.7, "accuracy": 0.8}))  # on_epoch_end
        True
        >>> m.update(m.read({"valid_loss": 0.6, "accuracy": 0.75}))
        False
        >>> m.best
        0.8
    """

    def __init__(
        self,
        monitor: str = "valid_loss",
        mode: str = "auto",
        min_delta: float = 0.0,
        owner: str = "Monitor",
        min_delta_mode: str = "abs",
    ) -> None:
        self.owner = owner
        self.name = _check_name(monitor, owner)
        self._pending = False  # mode="auto" on a loss part: decided by start()
        self.mode = self._resolve_mode(mode)
        self.min_delta = _check_min_delta(min_delta, owner)
        self.min_delta_mode = _check_delta_mode(min_delta_mode, owner)
        self._known: list[str] = []  # the names known before training
        self.reset()

    def reset(self) -> None:
        """Forgets the best value (a new run starts)."""
        self.best = math.inf if self.mode == "min" else -math.inf

    def start(
        self,
        metrics: Any,
        data: Any = None,
        train_metrics: Any = None,
        callbacks: Any = (),
        loss_func: Any = None,
    ) -> None:
        """Checks, before training, that the value will be in the record.

        The names known before training are the losses, the metrics, the
        training metrics (``train_<name>``), the values the ``callbacks``
        declare (``record_names``) and the parts ``loss_func`` declares
        (``part_names``: ``train_<part>``, ``valid_<part>``). A name outside
        them that could be a part of a loss that declares none (``train_...``,
        ``valid_...``: known at the first batch) is checked at the first
        epoch's end instead, unless it is close to a known name without
        extending it (a typo: ``valid_los``; ``valid_loss2`` may be a part).

        Raises a ValueError listing the names that exist when it does not,
        or when ``data`` has no ``valid_dl`` to compute a validation value on.
        """
        metric_names = list(getattr(metrics, "names", None) or [])
        train_names = getattr(train_metrics, "names", None) or []
        declared = [n for cb in callbacks or () for n in cb.record_names]
        parts = getattr(loss_func, "part_names", None)
        part_names = [f"{w}_{p}" for p in parts or () for w in ("train", "valid")]
        names = [*LOSSES, *metric_names, *(f"train_{n}" for n in train_names)]
        self._known = [*names, *part_names, *declared]
        known = [*self._known, "lr", "time"]  # in the record too, rarely watched
        bare = self.name.removeprefix("train_")
        if bare != self.name and bare in metric_names and bare not in train_names:
            raise ValueError(
                f"{self.owner}: monitor={self.name!r} is a training metric, but "
                f"{bare!r} is computed on the validation set only. Fix: add it "
                f"to train_metrics=[...] (Learner or fit), or monitor={bare!r}."
            )
        if self.name not in known:
            self._refuse_unknown(known, parts)
        if self._pending and self.name not in part_names:  # not a loss part
            raise ValueError(self._cannot_tell())
        validated = self.name in ("valid_loss", *metric_names)
        if (validated or self.name.startswith("valid_")) and _lacks_validation(data):
            raise ValueError(
                f"{self.owner}: monitor={self.name!r} needs validation, but "
                "data.valid_dl is None, so it would never be computed. Fix: "
                "pass a valid_dl, or monitor='train_loss'."
            )

    def _refuse_unknown(self, known: list[str], parts: Any) -> None:
        """Raises for a name not in ``known``, unless it may be a part of a
        loss whose parts are not declared (``part_names``) and is no slip."""
        part = self.name.startswith(("train_", "valid_")) and parts is None
        slip = _slip(self.name, known) if part else None
        if slip or not part:
            hint = did_you_mean(
                self.name, [slip] if slip else known, 0 if slip else 0.6
            )
            raise ValueError(
                f"{self.owner}: monitor={self.name!r} is not computed in this "
                f"fit{hint}; the names that exist are {self._known}. Fix: pass "
                "one of them, or add the metric to metrics=[...] (or "
                "train_metrics=[...]); a callback that adds a value lists it in "
                "its record_names, a loss that returns a dict its part_names."
            )

    def read(self, record: dict | None) -> float | None:
        """The epoch's value, or None when it was not computed this epoch
        (validation skipped, or no training batch for a training value)."""
        if record is None:
            return None
        if self.name not in record:
            names = _values(record)
            raise ValueError(
                f"{self.owner}: monitor={self.name!r} is not in the epoch's "
                f"record{did_you_mean(self.name, names)}; the names that exist "
                f"are {names}. Fix: pass "
                "one of them (a loss part is reported as train_<part> and "
                "valid_<part> when loss_func returns a dict)."
            )
        value = record[self.name]
        return None if value is None else float(value)

    def is_improvement(self, value: float) -> bool:
        """Whether ``value`` beats ``best`` by more than the margin
        (``min_delta``, or ``min_delta * abs(best)`` in ``"rel"`` mode)."""
        margin = self.min_delta
        if self.min_delta_mode == "rel":  # (the starting inf: any value beats it)
            margin *= abs(self.best) if math.isfinite(self.best) else 0.0
        if self.mode == "min":
            return value < self.best - margin
        return value > self.best + margin  # False for NaN, as above

    def beats(self, value: float, reference: float) -> bool:
        """Whether ``value`` is strictly better than ``reference`` in the
        mode's direction (no margin; False for NaN)."""
        return value < reference if self.mode == "min" else value > reference

    def update(self, value: float) -> bool:
        """Records ``value`` as the best when it improves; returns whether it did."""
        improved = self.is_improvement(value)
        if improved:
            self.best = value
        return improved

    def state_dict(self) -> dict:
        """The best value and what it is the best of."""
        return {"monitor": self.name, "mode": self.mode, "best": self.best}

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict``; refuses the state of another quantity."""
        keys = {"monitor", "mode", "best"}
        if not isinstance(state, dict) or not keys <= set(state) <= keys | {"partial"}:
            raise ValueError(
                f"{self.owner}: expected the dict Monitor.state_dict() returns "
                f"(keys 'best', 'mode', 'monitor'); got {state!r}."
            )
        if (state["monitor"], state["mode"]) != (self.name, self.mode):
            raise ValueError(
                f"{self.owner}: the state is for monitor={state['monitor']!r}, "
                f"mode={state['mode']!r}, but this one watches {self.name!r} "
                f"({self.mode!r}). Fix: create it with the same monitor and mode."
            )
        self.best = float(state["best"])  # ("partial": an older train_loss sum)

    def __repr__(self) -> str:
        return (
            f"Monitor({self.name!r}, mode={self.mode!r}, "
            f"min_delta={self.min_delta}, min_delta_mode={self.min_delta_mode!r}, "
            f"best={self.best})"
        )

    def _resolve_mode(self, mode: Any) -> str:
        if mode not in MODES:
            raise ValueError(
                f"{self.owner}: mode must be one of {MODES}; got {mode!r}. Fix: "
                "mode='min' when lower is better, 'max' when higher is better."
            )
        if mode != "auto":
            return mode
        found = direction(self.name)
        respelt = _respelt(self.name) if found is None else None
        if respelt is not None:  # a typo: the fix is the name, not mode=
            raise ValueError(
                f"{self.owner}: monitor={self.name!r} is not a name mode='auto' "
                f"knows{did_you_mean(self.name, [respelt], cutoff=0)}. Fix: correct "
                f"the name; if {self.name!r} is a value of yours, pass "
                "mode='min' (lower is better) or mode='max'."
            )
        if found is None and self.name.startswith(("train_", "valid_")):
            # Maybe a part of the loss (a LossDict's output name): a loss goes
            # down, which start() confirms once it sees the loss's parts.
            self._pending = True
            return "min"
        if found is None:
            raise ValueError(self._cannot_tell())
        return found

    def _cannot_tell(self) -> str:
        return (
            f"{self.owner}: mode='auto' cannot tell whether {self.name!r} "
            "improves by going down (losses, errors) or up (accuracy, "
            "f-scores, r2, ...). Fix: pass mode='min' or mode='max'."
        )


def _respelt(name: str) -> str | None:
    """``name`` with one misspelt word put right (``valid_los``: ``valid_loss``)
    when that tells its direction, else None (a name of the user's own)."""
    words = re.split(r"([^a-zA-Z]+)", name)  # the separators kept, odd indices
    for i in range(0, len(words), 2):
        word = closest(words[i].lower(), _WORDS, cutoff=0.8)
        fixed = "".join([*words[:i], word or "", *words[i + 1 :]])
        if word and word != words[i].lower() and direction(fixed) is not None:
            return fixed
    return None


def _slip(name: str, known: list[str]) -> str | None:
    """The known name that a ``train_...``/``valid_...`` name (maybe a loss
    part, known only at the first batch) is one slip of the keys away from:
    ``valid_los`` is ``valid_loss``, ``valid_ce`` is a part. A name that
    extends a known one (``valid_loss2``, ``valid_rmse`` beside ``mse``) may
    be a part too: only shorter or as long close names are slips."""
    prefix, _, rest = name.partition("_")
    train = prefix == "train"  # else valid: its names are the unprefixed ones too
    tails = {k.removeprefix(f"{prefix}_"): k for k in known
             if k.startswith("train_") == train}  # fmt: skip
    match = closest(rest, tails, cutoff=0.8)
    return None if match is None or _extends(rest, match) else tails[match]


def _extends(name: str, known: str) -> bool:
    """Whether ``name`` is ``known`` with characters inserted or appended."""
    chars = iter(name)
    return len(name) > len(known) and all(c in chars for c in known)


def _check_name(monitor: Any, owner: str) -> str:
    if not isinstance(monitor, str) or not monitor:
        raise TypeError(
            f"{owner}: monitor must be a name (a non-empty str); got {monitor!r}. "
            "Fix: e.g. monitor='valid_loss' or the name of a metric."
        )
    return monitor


def _check_min_delta(min_delta: Any, owner: str) -> float:
    number = is_number(min_delta)
    if not number or not 0 <= min_delta < math.inf:
        raise ValueError(
            f"{owner}: min_delta must be a finite number >= 0; got {min_delta!r}. "
            "Fix: e.g. min_delta=0.0 (any improvement counts) or 1e-4."
        )
    return float(min_delta)


def _check_delta_mode(min_delta_mode: Any, owner: str) -> str:
    if min_delta_mode not in DELTA_MODES:
        raise ValueError(
            f"{owner}: min_delta_mode must be one of {DELTA_MODES}; got "
            f"{min_delta_mode!r}. Fix: min_delta_mode='abs' (min_delta is an "
            "amount of the value) or 'rel' (a fraction of the best value)."
        )
    return min_delta_mode


def _lacks_validation(data: Any) -> bool:
    # Only a data object that says so: hooks driven in tests may pass none.
    return data is not None and getattr(data, "valid_dl", True) is None


def _values(record: dict) -> list[str]:
    """The names of a record that can be monitored."""
    return [k for k in record if k not in ("epoch", "lr", "time")]
