"""``EMA``: an exponential moving average of the weights, updated after each
optimizer step on the device, validated on and kept at the end.

The arithmetic (float32 averages, the in-place swap, the buffers) is in
``fitlib.weight_averaging``; this file decides when to update and what the
validation and the model after the fit hold.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

import fitlib.ranks as ranks
from fitlib.callback import Callback, inner_callback
from fitlib.callback_handler import CallbackHandler
from fitlib.checks import check_flag, check_int, check_number
from fitlib.core import call_model, validate
from fitlib.rng import get_rng_state, set_rng_state
from fitlib.sharding import unwrap
from fitlib.weight_averaging import (
    BUFFER_POLICIES,
    WeightAverage,
    average_of,
    broadcast_buffers,
    check_choice,
    refuse_two_averages,
)

VALIDATE_ON = ("ema", "live", "both")
FINALS = ("ema", "live")


class EMA(Callback):
    """Keeps an exponential moving average of the model's weights.

    After each optimizer step (not after the batches of a gradient
    accumulation that do not step) every averaged tensor ``a`` moves toward
    the live weight ``w``: ``a = decay * a + (1 - decay) * w``, one
    ``torch._foreach_lerp_`` on the device, nothing read on the host. The
    averages are float32 copies (bf16 parameters are averaged in float32).
    The first update copies the weights, as ``torch.optim.swa_utils.
    AveragedModel`` does; with the defaults the average equals
    ``AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay),
    use_buffers=True)`` updated after each step.

    ``warmup=True`` lowers the decay early, as TensorFlow's
    ``ExponentialMovingAverage(num_updates=...)``: the t-th update (0-based)
    uses ``min(decay, (1 + t) / (10 + t))``, so the first averages are not
    stuck near the random initial weights.

    Validation runs on the averaged weights (``validate_on="ema"``: the
    record's ``valid_loss`` and metrics are the average's), on the live ones
    (``"live"``), or on both (``"both"``: ``valid_loss`` and the metrics are
    the live weights', ``ema_valid_loss`` and ``ema_<metric>`` the
    average's, so ``EarlyStopping("ema_valid_loss")`` or ``StopWhen`` can
    watch them). The swap copies the averages into the model's own tensors
    and back (a temporary copy of the live values meanwhile): no second
    model. ``"both"`` runs its second pass without the fit's callbacks (no
    autocast of ``MixedPrecision``), so in float32.

    When the fit ends (not after an error nor a suspend) the model holds the
    average (``final="ema"``, the default, as Lightning's
    ``EMAWeightAveraging`` and Keras' ``use_ema`` leave it: what was
    validated is what you keep), or its live weights (``final="live"``;
    ``with ema.averaged(): ...`` runs code on the average then). A fit that
    starts afresh starts a new average from the model's weights; a resumed
    one (``Checkpoint``) keeps the saved average and update count, so it
    continues bit for bit. Every checkpoint, ``best.pth`` included, holds
    both, as saved during the fit: the live weights as the model, the
    average in this callback's state; ``Learner.load`` of one, then
    ``ema.copy_to(learn.model)`` (or ``with ema.averaged(learn.model):``),
    gives its average. ``Learner.save`` after the fit saves the model as it
    is then: with ``final="ema"`` the average (the live weights are gone),
    with ``final="live"`` the live weights beside the average.

    When a fit ends after fewer than two half-lives of updates (without
    ``warmup``), one line says so: the average then still weighs the first
    weights heavily.

    Refused before training, as they would silently give other weights than
    the ones ranked: ``EarlyStopping(restore_best=True)`` with
    ``validate_on="ema"``, ``final="ema"`` or watching an ``ema_`` value;
    a ``Checkpoint(monitor=...,
    save_weights_only=True)`` ranking the average's values; ``SWA`` in the
    same fit; a ``start_step`` the fit never reaches.

    BatchNorm buffers: averaged like the weights (``buffers="average"``, the
    default, as timm's ``ModelEmaV3`` and Lightning's ``EMAWeightAveraging``
    do: running statistics that match the averaged weights), or not
    averaged (``"copy"``): the average holds no buffers, and is validated
    (and kept, with ``final="ema"``) with the model's live running
    statistics. That is not ``AveragedModel(use_buffers=False)``, whose own
    buffers are copied once and never updated (until ``update_bn``).

    Several optimizers: ``parts=["generator"]`` averages only the named
    submodules (default: every parameter). Under DDP the parameters, and so
    their average, are the same on every rank; each rank averages its own
    BatchNorm statistics, and a validation uses rank 0's, as DDP does for
    the live ones (one broadcast per validation). Under FSDP each rank
    averages its own slice, with no communication (the checkpoint keeps
    each rank's); ``"both"``'s second pass runs in step on every rank, as
    the fit's validation does.

    Args:
        decay: the average's decay per update, in (0, 1); default 0.999 when
            ``half_life`` is not given.
        half_life: instead of ``decay``: the optimizer steps after which a
            weight's share of the average halves; ``decay = 0.5 **
            (every_n_steps / half_life)``.
        every_n_steps: update every n optimizer steps (>= 1).
        start_step: the first update comes after this many optimizer steps
            of the fit (>= 0); until then validation uses the live weights.
        warmup: ramp the decay up early (see above).
        validate_on: ``"ema"``, ``"live"`` or ``"both"``.
        final: what ``learn.model`` holds after the fit: ``"ema"`` or ``"live"``.
        parts: names of the submodules to average, or None for all.
        buffers: ``"average"`` or ``"copy"`` (see above).

    Examples:
        >>> ema = EMA(half_life=4, validate_on="both")
        >>> history = fit(3, model, F.cross_entropy, opt, data, callbacks=[ema],
        ...               metrics=[accuracy])
        >>> [name for name in history[-1] if name.startswith("ema_")]
        ['ema_valid_loss', 'ema_accuracy']
        >>> ema.updates  # one per optimizer step: 4 batches, 3 epochs
        12
    """

    order = -90  # after Checkpoint's restore and final save (see ORDER_REASONS)
    in_lr_find = False  # a sweep's weights are thrown away
    averages_weights = True  # one weight average per fit (not with SWA)

    def __init__(
        self,
        decay: float | None = None,
        half_life: float | None = None,
        every_n_steps: int = 1,
        start_step: int = 0,
        warmup: bool = False,
        validate_on: str = "ema",
        final: str = "ema",
        parts: list[str] | None = None,
        buffers: str = "average",
    ) -> None:
        owner = self.name
        self.every_n_steps = check_int(every_n_steps, "every_n_steps", minimum=1,
                                       owner=owner)  # fmt: skip
        self.decay = _decay(decay, half_life, self.every_n_steps)
        self.start_step = check_int(start_step, "start_step", owner=owner)
        self.warmup = check_flag(warmup, "warmup", owner)
        self.validate_on = check_choice(owner, "validate_on", validate_on, VALIDATE_ON)
        self.final = check_choice(owner, "final", final, FINALS)
        self.buffers = check_choice(owner, "buffers", buffers, BUFFER_POLICIES)
        self.parts = parts
        self.record_names = ("ema_valid_loss",) if validate_on == "both" else ()
        self.average: WeightAverage | None = None
        self._pending: dict | None = None  # loaded before the fit built one

    @property
    def updates(self) -> int:
        """The updates of the average so far (0 before the first)."""
        if self.average is None:
            return int((self._pending or {}).get("updates", 0))
        return self.average.updates

    def on_train_begin(self, model: Any, iteration: int, metrics: Any,
                       callbacks: Any = (), n_steps: Any = None) -> None:  # fmt: skip
        """Runs before training: refuses what would give other weights than
        the ones ranked; a new average, or the loaded one (a resume)."""
        refuse_two_averages(self, callbacks)
        for cb in map(inner_callback, callbacks):  # every(cb): the wrapped one
            self._refuse_with(cb)
        first = self.start_step + self.every_n_steps  # the first update's step
        if n_steps is not None and first > n_steps:
            raise ValueError(
                f"EMA: start_step={self.start_step} (every_n_steps="
                f"{self.every_n_steps}): the first update would come after "
                f"optimizer step {first}, but this fit has {n_steps} batches, "
                "so the average would never start. Fix: a smaller start_step, "
                f"e.g. EMA(start_step={n_steps // 4}), or a longer fit."
            )
        names = list(getattr(metrics, "names", None) or [])
        if self.validate_on == "both":
            self.record_names = ("ema_valid_loss", *(f"ema_{n}" for n in names))
        self.average = average_of(model, self.parts, self.buffers, self.name)
        if iteration > 0 and self._pending is not None:
            self.average.load_state_dict(self._pending)
        self._pending = None

    def _refuse_with(self, cb: Any) -> None:
        """Refuses a callback that would keep or restore other weights than
        the ones whose value it ranked (found by its attributes)."""
        watched = getattr(getattr(cb, "monitor", None), "name", None)
        ranked_on_average = self.validate_on == "ema" or (
            self.validate_on == "both" and str(watched).startswith("ema_")
        )
        if getattr(cb, "restore_best", False) is True and (
            ranked_on_average or self.final == "ema"
        ):
            raise ValueError(
                f"EMA(validate_on={self.validate_on!r}, final={self.final!r}) "
                f"and {cb.name}(restore_best=True): restore_best would put back "
                "the live weights of the best epoch, "
                + ("whose value was the average's, " if ranked_on_average else "")
                + (
                    "then final='ema' would replace them by the last average. "
                    if self.final == "ema"
                    else ""
                )
                + f"Fix: {cb.name}(restore_best=False) to keep the last "
                "average, or EMA(validate_on='live', final='live') to restore "
                "the best live weights, or Checkpoint(monitor=...) to keep the "
                "best epoch's average in best.pth (load it, then "
                "ema.copy_to(learn.model))."
            )
        if (
            getattr(cb, "save_weights_only", False) is True
            and watched
            and (ranked_on_average)
        ):
            raise ValueError(
                f"EMA(validate_on={self.validate_on!r}) and {cb.name}(monitor="
                f"{watched!r}, save_weights_only=True): best.pth and the top-k "
                "files would hold the live weights of the epoch whose average "
                f"ranked best. Fix: {cb.name}(save_weights_only=False): the "
                "file then holds the live weights and the average (load it, "
                "then ema.copy_to(learn.model)); or EMA(validate_on='live')."
            )

    def on_step_end(self, skip_step: bool, step: int) -> None:
        """Runs after each step: updates the average on the device."""
        done = step + 1 - self.start_step  # steps counted from start_step
        if skip_step or done <= 0 or done % self.every_n_steps:
            return
        decay = self.decay
        if self.warmup:
            t = self.average.updates
            decay = min(decay, (1 + t) / (10 + t))
        self.average.update(1.0 - decay)

    def on_batch_begin(self, train: bool, model: Any) -> None:
        """Runs before each batch: a validation batch runs on the average."""
        if not train and self.validate_on == "ema" and self.average.swap_in():
            self._same_buffers(model)

    def _same_buffers(self, model: Any) -> None:
        # Under DDP each rank averaged its own BatchNorm statistics: rank 0's
        # validate, as DDP's live ones do (a sharded model keeps its own).
        if self.buffers == "average" and not self.average.sharded:
            broadcast_buffers(model)

    def on_epoch_end(self, **state: Any) -> dict | None:
        """Runs after validation: the live weights back; with ``"both"``,
        the average's validation values added to the record."""
        self.average.swap_out()
        if self.validate_on != "both" or not self.average.updates:
            return None
        valid_dl = getattr(state["data"], "valid_dl", None)
        if valid_dl is None or state["last_metrics"] is None:
            return None
        values = self._validate_average(state, valid_dl)
        names = ("valid_loss", *(state["metrics"].names or []))
        return {"record": {f"ema_{n}": v for n, v in zip(names, values, strict=True)}}

    def _validate_average(self, state: dict, valid_dl: Any) -> list:
        """The fit's validation again, on the average: without the fit's
        callbacks, but in step with the other ranks, as the fit's is."""
        model = unwrap(state["model"])
        handler = CallbackHandler([_Lockstep(valid_dl, self.average.sharded)])
        handler.on_train_begin(None, model=model, opt=None, data=state["data"],
                               loss_func=state["loss_func"])  # fmt: skip
        rng = get_rng_state(valid_dl)  # the loader draws a seed as it starts
        try:
            with self.average.averaged():
                self._same_buffers(model)
                batch_fn = getattr(state["data"], "batch_fn", None)
                return validate(model, valid_dl, state["loss_func"], handler,
                                state["metrics"], batch_fn)  # fmt: skip
        finally:
            set_rng_state(rng, valid_dl)

    def on_train_end(self, exception: Any, suspend: bool, model: Any) -> None:
        """Runs at the end: the live weights back, then the average in the
        model if the fit ended (``final="ema"``; under DDP with rank 0's
        averaged buffers, so that every rank ends with one model)."""
        if self.average is None:
            return
        self.average.swap_out()
        if exception is not None or suspend:
            return
        if self.final == "ema" and self.average.updates:
            self.average.copy_to_model()
            self._same_buffers(model)
        self._say_if_young()

    def _say_if_young(self) -> None:
        updates = self.average.updates
        half_life = math.log(0.5) / math.log(self.decay)  # in updates
        if self.warmup or not updates or updates >= 2 * half_life:
            return
        if ranks.is_main():
            print(
                f"EMA: the fit ended after {updates} updates, under 2 "
                f"half-lives ({half_life:.0f} updates each): the average still "
                "weighs the first weights heavily (a shorter half_life, or a "
                "longer fit, if that is not what you want)."
            )

    @contextmanager
    def averaged(self, model: Any = None) -> Iterator[None]:
        """Runs the block with the average in the model, then the weights it
        had (after a fit with ``final="live"``: evaluate the average). After
        ``Learner.load`` of a checkpoint (``best.pth``) in a new process,
        name the model: ``ema.averaged(learn.model)``.

        Examples:
            >>> ema = EMA(decay=0.5, final="live")
            >>> _ = fit(1, model, F.cross_entropy, opt, data, callbacks=[ema])
            >>> with ema.averaged():
            ...     ema_loss = validate(model, data.valid_dl, F.cross_entropy)[0]
        """
        with self._average_for(model, "averaged").averaged():
            yield

    def copy_to(self, model: Any = None) -> None:
        """Puts the average in ``model`` for good (default: the fit's model),
        e.g. after ``Learner.load`` of ``best.pth``, which holds the live
        weights as the model and the average in this callback's state.

        Examples:
            >>> ema = EMA(decay=0.5, final="live")
            >>> _ = fit(1, model, F.cross_entropy, opt, data, callbacks=[ema])
            >>> ema.copy_to(model)
            >>> torch.equal(model[0].weight, ema.average.averages[0])
            True
        """
        self._average_for(model, "copy_to").copy_to_model()

    def _average_for(self, model: Any, what: str) -> WeightAverage:
        """The average, over ``model``'s tensors when given (built from the
        loaded state when this callback has not fitted ``model``)."""
        if model is not None and not self._tracks(model):
            state = self.state_dict()
            if not state:
                raise RuntimeError(
                    f"EMA.{what}: no average yet for this model: it is built "
                    "when a fit starts or loaded with a checkpoint. Fix: fit "
                    "with this callback first, or learn.load(...) a checkpoint "
                    "saved with it."
                )
            average = average_of(model, self.parts, self.buffers, self.name)
            average.load_state_dict(state)
            self.average, self._pending = average, state
        if self.average is None:
            raise RuntimeError(
                f"EMA.{what}: no average yet: it is built when a fit starts "
                "(after learn.load of a checkpoint, name the model: "
                f"ema.{what}(learn.model)). Fix: fit with this callback first."
            )
        return self.average

    def _tracks(self, model: Any) -> bool:
        if self.average is None:
            return False
        own = {id(t) for t in unwrap(model).parameters()}
        own |= {id(t) for t in unwrap(model).buffers()}
        return any(id(t) in own for t in self.average.tensors)

    def state_dict(self) -> dict:
        """The average (float32 tensors) and its update count."""
        if self.average is None:
            return dict(self._pending or {})
        return self.average.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restores the average; kept until the resumed fit builds its own."""
        if not state:
            return
        if self.average is not None and state.get("averages") is not None:
            self.average.load_state_dict(state)
        self._pending = {"updates": state["updates"], "averages": state["averages"]}

    def __repr__(self) -> str:
        return (
            f"EMA(decay={self.decay:.6g}, every_n_steps={self.every_n_steps}, "
            f"validate_on={self.validate_on!r}, final={self.final!r})"
        )


class _Lockstep(Callback):
    """EMA's second validation under FSDP: a rank whose shard has fewer
    batches runs one more (uncounted) forward, as ``DistributedTrainer``
    does in the fit's, so that every rank gathers the weights as often."""

    def __init__(self, valid_dl: Any, sharded: bool) -> None:
        counts = ranks.gather_to_all(len(valid_dl)) if sharded else [0]
        self.mine, self.most = (len(valid_dl) if sharded else 0), max(counts)

    def on_batch_end(self, num_batch: int, last_input: Any, model: Any) -> None:
        if num_batch + 1 == self.mine < self.most:
            with torch.no_grad():
                call_model(model, last_input)


def _decay(decay: Any, half_life: Any, every: int) -> float:
    if decay is not None and half_life is not None:
        raise ValueError(
            f"EMA: give decay or half_life, not both; got decay={decay!r} and "
            f"half_life={half_life!r}. Fix: e.g. EMA(half_life={half_life!r})."
        )
    if half_life is not None:
        half_life = check_number(half_life, "half_life", above=0, what="a number "
                                 "of steps", owner="EMA", example=1000)  # fmt: skip
        return 0.5 ** (every / half_life)
    if decay is None:
        return 0.999
    return check_number(decay, "decay", above=0, below=1, owner="EMA", example=0.999)
