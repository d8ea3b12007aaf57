"""``GANTrainer``: a generator and a critic trained in turns, in the one loop.

Each training batch is one optimizer step of one part: ``n_critic`` critic
steps, then ``n_generator`` generator steps, counted in optimizer steps (the
state key ``step``), so an exact resume takes up the same turn and gradient
accumulation keeps one part for every batch of a step. Before each batch
the trainer sets the ``GANModule``'s ``mode`` (what the forward computes),
the ``MultiOptimizer``'s ``active`` part (which optimizer steps) and which
part's parameters require gradients (the other's get none).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fitlib.callback import Callback
from fitlib.checks import check_int
from fitlib.gan import GANModule


class GANTrainer(Callback):
    """Trains a ``GANModule`` in turns: ``n_critic`` critic steps, then
    ``n_generator`` generator steps, over and over.

    Needs a ``MultiOptimizer`` with a part for each (named ``generator`` and
    ``critic``: ``Learner(..., opt_func={"generator": ..., "critic": ...})``),
    each over its module's parameters.

    Args:
        n_critic: critic steps per round (5 is usual for WGAN).
        n_generator: generator steps per round.

    Examples:
        >>> from torch.optim import Adam
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> gen, critic = nn.Linear(8, 2), nn.Linear(2, 1)
        >>> points = DataBunch(DataLoader(TensorDataset(torch.randn(64, 2)), 16))
        >>> learn = Learner(points, GANModule(gen, critic, noise_size=8),
        ...                 GANLoss("wgan"), callbacks=[GANTrainer(n_critic=5)],
        ...                 opt_func={"generator": Adam, "critic": Adam},
        ...                 progress=False)
        >>> learn.fit(2, lr=1e-4)
        History(2 epochs: train_loss ... -> ..., train_critic ... -> ...,
                train_generator ...)
    """

    order = -40  # before accumulation and mixed precision: decides what steps

    def __init__(self, n_critic: int = 1, n_generator: int = 1) -> None:
        owner = "GANTrainer"
        self.n_critic = check_int(
            n_critic, "n_critic", minimum=1, owner=owner, example=5
        )
        self.n_generator = check_int(
            n_generator, "n_generator", minimum=1, owner=owner, example=1
        )
        self._gan: GANModule | None = None
        self._grad: dict[int, bool] = {}  # requires_grad as the fit found it
        self._turn: str | None = None
        self._opt: Any = None  # the optimizer whose active part was set

    def turn(self, step: int) -> str:
        """Whose turn optimizer step ``step`` (0-based) is."""
        in_round = step % (self.n_critic + self.n_generator)
        return "critic" if in_round < self.n_critic else "generator"

    def on_train_begin(self, model: nn.Module, opt: Any) -> None:
        """Runs before training: checks the model and the optimizer's parts."""
        gan = getattr(model, "module", model)  # (inside DistributedDataParallel)
        if not isinstance(gan, GANModule):
            raise ValueError(
                f"GANTrainer trains a GANModule (a generator and a critic); the "
                f"model is a {type(gan).__name__}. Fix: model=GANModule("
                "generator, critic, noise_size=...)."
            )
        if getattr(model, "find_unused_parameters", True) is False:  # DDP's
            raise ValueError(
                "GANTrainer under DistributedDataParallel: each turn leaves one "
                "part's parameters without gradients, which DDP refuses unless "
                "it looks for unused parameters. Fix: learn.to_distributed("
                "find_unused_parameters=True) (DistributedTrainer(..., "
                "find_unused_parameters=True))."
            )
        _check_parts(gan, opt)
        self._gan, self._turn = gan, None
        self._grad = {id(p): p.requires_grad for p in gan.parameters()}

    def on_batch_begin(self, train: bool, step: int, opt: Any, model: Any) -> None:
        """Runs before each batch: sets the turn, what steps, what learns."""
        if not train:
            return
        gan = getattr(model, "module", model)  # (a callback may swap them)
        if gan is not self._gan:
            self.on_train_begin(model, opt)
        turn = self.turn(step)
        if turn != self._turn or opt is not self._opt:  # (not every batch)
            self._turn, self._opt = turn, opt
            opt.active = (turn,)
            self._gan.mode = turn
            other = "generator" if turn == "critic" else "critic"
            for p in getattr(self._gan, other).parameters():
                p.requires_grad_(False)
            for p in getattr(self._gan, turn).parameters():
                p.requires_grad_(self._grad.get(id(p), True))

    def on_train_end(self, opt: Any) -> None:
        """Runs at the end, also after an error: every part steps and learns
        again, as before the fit."""
        if self._gan is None:
            return
        for p in self._gan.parameters():
            p.requires_grad_(self._grad.get(id(p), p.requires_grad))
        self._gan.mode, self._gan, self._turn, self._opt = None, None, None, None
        if hasattr(opt, "active"):
            opt.active = None

    def __repr__(self) -> str:
        return f"GANTrainer(n_critic={self.n_critic}, n_generator={self.n_generator})"


def _check_parts(gan: GANModule, opt: Any) -> None:
    parts = getattr(opt, "parts", None)
    has = list(parts) if parts is not None else "no parts (one optimizer)"
    if parts is None or not {"generator", "critic"} <= set(parts):
        raise ValueError(
            f"GANTrainer needs an optimizer part named 'generator' and one named "
            f"'critic'; the optimizer has {has}. Fix: Learner(..., opt_func="
            "{'generator': torch.optim.Adam, 'critic': torch.optim.Adam})."
        )
    for name in ("generator", "critic"):
        module = getattr(gan, name)
        want = {id(p) for p in module.parameters() if p.requires_grad}
        got = {id(p) for g in parts[name].param_groups for p in g["params"]}
        names = {id(p): n for n, p in module.named_parameters()}
        missing = [n for i, n in names.items() if i in want - got]  # (model order)
        if missing or got - set(names):
            what = (
                f"leaves out gan.{name}'s trainable {missing[:3]}"
                if missing
                else f"holds parameters that are not gan.{name}'s"
            )
            raise ValueError(
                f"GANTrainer: the optimizer part {name!r} {what}. Fix: build "
                f"part {name!r} over gan.{name}.parameters()."
            )
