"""``SWA``: stochastic weight averaging, with ``torch.optim.swa_utils``'
semantics: an equal-weight average of the weights at the end of each epoch
from ``swa_start`` on, the lr annealed to ``swa_lr`` as ``SWALR`` does, and
the BatchNorm statistics recomputed over the training data at the end, as
``update_bn`` does. The arithmetic is in ``fitlib.weight_averaging``.
"""

from __future__ import annotations

import math
from typing import Any

import fitlib.ranks as ranks
from fitlib.callback import Callback, inner_callback
from fitlib.checks import check_int, check_number
from fitlib.errors import is_int
from fitlib.weight_averaging import (
    WeightAverage,
    average_of,
    check_choice,
    recompute_batch_norm,
    refuse_two_averages,
)

STRATEGIES = ("cos", "linear")


class SWA(Callback):
    """Averages the weights of the last epochs, with equal weights.

    At the end of each epoch from ``swa_start`` on (0-based; a float in
    (0, 1) is a fraction of the fit's epochs, ``int(fraction * epochs)``, as
    Lightning's ``swa_epoch_start``), the average ``a`` of n snapshots takes
    the weights ``w`` in: ``a += (w - a) / (n + 1)`` on the device (the
    first copies). When the fit ends (not after an error nor a suspend) the
    model holds the average, and its BatchNorm running statistics are
    recomputed with one pass over the training data in train mode (momentum
    None: a plain mean over the batches, as ``update_bn``; under
    torch.distributed averaged over the processes), which leaves the random
    generators, the modes and the momenta as they were. Validation during
    the fit runs on the live weights; ``learn.validate()`` after it, on the
    average.

    With ``swa_lr`` the lr is SWA's from ``swa_start`` on, per epoch as
    ``SWALR`` stepped after each epoch: ``lr = swa_lr * alpha + lr0 * (1 -
    alpha)``, where ``lr0`` is each group's lr as epoch ``swa_start``
    begins and ``alpha = f(min(1, j / anneal_epochs))`` for the j-th SWA
    epoch (``f`` cosine, ``(1 - cos(pi t)) / 2``, or linear; ``alpha = 1``
    with ``anneal_epochs=0``). It runs after the schedulers (order 15), so
    from ``swa_start`` on its lr wins over a ``ParamScheduler``,
    ``fit_one_cycle`` or ``TorchScheduler`` that sets the lr, which run as
    given before: Lightning's precedence (the one exception to "the last
    schedule given wins"; a line names the schedulers it overrides when
    ``swa_start`` comes). ``ReduceLROnPlateau`` with ``swa_lr`` is refused
    (its reductions would be dropped). With ``swa_lr=None`` it leaves the lr
    alone.

    Refused before training: a ``swa_start`` at or after the fit's last
    epoch (nothing would be averaged), and ``EMA`` in the same fit (each
    puts its own average in the model).

    Its state (the average, its count, ``lr0``) is in every checkpoint: a
    resumed fit goes on bit for bit. ``parts`` and several optimizers as
    ``EMA``; buffers are not averaged (they are recomputed).

    Args:
        swa_start: the first epoch averaged (an int >= 0), or a fraction of
            the fit's epochs in (0, 1).
        swa_lr: the lr SWA anneals to (one for every group), or None.
        anneal_epochs: epochs of the annealing to ``swa_lr`` (>= 0).
        anneal_strategy: ``"cos"`` or ``"linear"``.
        parts: names of the submodules to average, or None for all.

    Examples:
        >>> swa = SWA(swa_start=2, swa_lr=0.05, anneal_epochs=1)
        >>> history = fit(4, model, F.cross_entropy, opt, data, callbacks=[swa])
        >>> swa.updates, [round(r["lr"], 3) for r in history]
        (2, [0.1, 0.1, 0.1, 0.05])
    """

    order = 15  # after the schedulers (10): from swa_start on its lr wins
    in_lr_find = False
    averages_weights = True  # one weight average per fit (not with EMA)

    def __init__(
        self,
        swa_start: int | float = 0.75,
        swa_lr: float | None = None,
        anneal_epochs: int = 10,
        anneal_strategy: str = "cos",
        parts: list[str] | None = None,
    ) -> None:
        owner = self.name
        if is_int(swa_start):
            self.swa_start = check_int(swa_start, "swa_start", owner=owner)
        else:
            self.swa_start = check_number(swa_start, "swa_start", above=0, below=1,
                                          what="an epoch (int >= 0) or a fraction",
                                          owner=owner, example=0.75)  # fmt: skip
        self.swa_lr = check_number(swa_lr, "swa_lr", above=0, owner=owner,
                                   example=0.05, allow_none=True)  # fmt: skip
        self.anneal_epochs = check_int(anneal_epochs, "anneal_epochs", owner=owner)
        self.anneal_strategy = check_choice(owner, "anneal_strategy",
                                            anneal_strategy, STRATEGIES)  # fmt: skip
        self.parts = parts
        self.average: WeightAverage | None = None
        self.lr0: list[float] | None = None  # each group's lr as SWA began
        self.start_epoch: int | None = None
        self._pending: dict | None = None
        self._overridden: list[str] = []  # the lr schedulers it overrides

    @property
    def updates(self) -> int:
        """The snapshots averaged so far."""
        if self.average is None:
            return int((self._pending or {}).get("updates", 0))
        return self.average.updates

    def on_train_begin(self, model: Any, iteration: int, n_epochs: Any, epoch: int,
                       opt: Any, callbacks: list) -> None:  # fmt: skip
        """Runs before training: refuses what would make it do nothing or
        drop another's lr; the first epoch averaged; a new average, or the
        loaded one (a resume), whose lr it sets again."""
        refuse_two_averages(self, callbacks)
        self.start_epoch = self._first_epoch(n_epochs)
        if n_epochs is not None and self.start_epoch >= n_epochs:
            raise ValueError(
                f"SWA: swa_start={self.swa_start}, but this fit has {n_epochs} "
                f"epoch(s) (0 to {n_epochs - 1}), so nothing would be averaged. "
                f"Fix: a swa_start below {n_epochs}, e.g. SWA(swa_start="
                f"{max(n_epochs - 2, 0)}) or a fraction, SWA(swa_start=0.75)."
            )
        self._overridden = self._check_schedulers(callbacks)
        self.average = average_of(model, self.parts, "copy", self.name)
        if iteration > 0 and self._pending is not None:
            self.average.load_state_dict(self._pending)
            self.lr0 = self._pending["lr0"] or None
        elif iteration == 0:
            self.lr0 = None
        self._pending = None
        if self.lr0 is not None:
            self._set_lr(opt, epoch)

    def _first_epoch(self, n_epochs: Any) -> int:
        if isinstance(self.swa_start, int):
            return self.swa_start
        if n_epochs is None:
            raise ValueError(
                f"SWA: swa_start={self.swa_start} is a fraction of the fit's "
                "epochs, but this fit has none (max_steps only). Fix: give an "
                "epoch, e.g. SWA(swa_start=3)."
            )
        return int(self.swa_start * n_epochs)

    def _check_schedulers(self, callbacks: list) -> list[str]:
        """The names of the lr schedules SWA's lr overrides from swa_start
        on (those listing an lr in ``sets_hypers``); a ReduceLROnPlateau
        (found by its class's name, not imported) is refused."""
        if self.swa_lr is None:
            return []
        found = []
        for cb in map(inner_callback, callbacks):
            kinds = {k.__name__ for k in type(cb).__mro__}
            if "ReduceLROnPlateau" in kinds:
                raise ValueError(
                    f"SWA(swa_lr={self.swa_lr}) and {cb.name}: SWA sets the lr "
                    "at every step from swa_start on, so the plateau's "
                    "reductions would be dropped. Fix: SWA(swa_lr=None) to "
                    f"keep {cb.name}'s lr, or drop {cb.name}."
                )
            hypers = [] if cb is self else list(getattr(cb, "sets_hypers", ()))
            if any(h.rpartition(".")[2] == "lr" and not h.startswith("model.")
                   for h in hypers):  # fmt: skip
                found.append(cb.name)
        return found

    def on_epoch_begin(self, epoch: int, opt: Any) -> None:
        """Runs as an epoch begins: from ``swa_start`` on, SWA's lr."""
        if self.swa_lr is None or epoch < self.start_epoch:
            return
        if self.lr0 is None:
            self.lr0 = list(opt.get("lr"))
            if self._overridden and ranks.is_main():
                print(
                    f"SWA: from epoch {epoch} on, the lr is SWA's (swa_lr="
                    f"{self.swa_lr}), over {', '.join(self._overridden)}'s."
                )
        self._set_lr(opt, epoch)

    def on_step_end(self, opt: Any, skip_step: bool, epoch: int) -> None:
        """Runs after each step: SWA's lr again, over a scheduler's."""
        if self.lr0 is not None and not skip_step:
            self._set_lr(opt, epoch)

    def lr_at(self, epoch: int) -> list[float]:
        """Each group's lr in ``epoch`` (of the SWA phase, once it began)."""
        j = epoch - self.start_epoch
        t = 1.0 if self.anneal_epochs == 0 else min(1.0, j / self.anneal_epochs)
        alpha = (1 - math.cos(math.pi * t)) / 2 if self.anneal_strategy == "cos" else t
        return [self.swa_lr * alpha + lr * (1 - alpha) for lr in self.lr0]

    def _set_lr(self, opt: Any, epoch: int) -> None:
        opt.set("lr", self.lr_at(epoch))

    def on_epoch_end(self, epoch: int, mid_epoch: bool) -> None:
        """Runs at an epoch's end: from ``swa_start`` on, averages it in."""
        if not mid_epoch and epoch >= self.start_epoch:
            self.average.update(1.0 / (self.average.updates + 1))

    def on_train_end(
        self, exception: Any, suspend: bool, data: Any, model: Any
    ) -> None:
        """Runs at the end: the average in the model, BatchNorm recomputed."""
        if self.average is None or exception is not None or suspend:
            return
        if self.average.updates:
            self.average.copy_to_model()
            data = getattr(data, "resumed_from", data)
            recompute_batch_norm(model, data.train_dl, getattr(data, "batch_fn", None))

    def state_dict(self) -> dict:
        """The average, its count and the lr SWA began from."""
        if self.average is None:
            return dict(self._pending or {})
        return self.average.state_dict() | {"lr0": list(self.lr0 or [])}

    def load_state_dict(self, state: dict) -> None:
        """Restores them; kept until the resumed fit builds its average."""
        if state:
            self._pending = dict(state)

    def __repr__(self) -> str:
        return (
            f"SWA(swa_start={self.swa_start}, swa_lr={self.swa_lr}, "
            f"anneal_epochs={self.anneal_epochs}, "
            f"anneal_strategy={self.anneal_strategy!r})"
        )
