"""The script test_optuna_torchrun.py launches with torchrun (1 or 2 CPU
processes, gloo): an Optuna search whose trials train under DDP.

``python -m torch.distributed.run --standalone --nproc_per_node=N
optuna_dist_child.py SEED OUT``: rank 0 runs the study (in memory) and gives
each trial to ``OptunaPruning``; the other ranks run the same objective with
``trial=None``, getting rank 0's parameters by one broadcast per trial. Each
rank writes what it saw to OUT/rank<r>.pth.
"""

import datetime
import sys
from pathlib import Path

import optuna
import torch
import torch.distributed as dist
from helpers import make_dataset
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

from fitlib import DataBunch, Learner, ranks
from fitlib.callbacks import DistributedTrainer, OptunaPruning, ValidationSchedule
from fitlib.serialization import atomic_save

N_TRIALS = 6


def objective(trial, trainer, seen):
    """One trial on every rank: rank 0 samples, the others receive."""
    params = (
        None
        if trial is None
        else {"lr": trial.suggest_float("lr", 1e-3, 1.0, log=True)}
    )
    box = [params]
    dist.broadcast_object_list(box, src=0)  # the trial's parameters, once
    lr = box[0]["lr"]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    data = DataBunch(
        # 16 a step in all: 8 on each of two ranks
        DataLoader(make_dataset(96), 16 // ranks.world_size(), shuffle=True),
        DataLoader(make_dataset(37, seed=1), 8),
        device="cpu",
    )
    prune = OptunaPruning(trial, monitor="valid_loss")
    callbacks = [trainer, ValidationSchedule(every_n_steps=2), prune]
    learn = Learner(data, model, F.cross_entropy, opt_func=torch.optim.SGD,
                    callbacks=callbacks, progress=False)  # fmt: skip
    try:
        learn.fit(3, lr=lr)
    finally:
        seen.append({"lr": lr, "pruned_at": prune.pruned_at,
                     "reported": dict(prune.reported)})  # fmt: skip
    return learn.recorder.valid_losses[-1]


def main(seed: int, out: Path) -> None:
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    trainer = DistributedTrainer(timeout=datetime.timedelta(seconds=60))
    seen: list[dict] = []
    result: dict = {"world": ranks.world_size(), "seen": seen}
    if ranks.rank() == 0:
        sampler = optuna.samplers.TPESampler(seed=seed)
        pruner = optuna.pruners.MedianPruner(n_startup_trials=2)
        study = optuna.create_study(sampler=sampler, pruner=pruner)
        study.optimize(lambda t: objective(t, trainer, seen), n_trials=N_TRIALS)
        result["trials"] = [(t.state.name, dict(t.intermediate_values))
                            for t in study.trials]  # fmt: skip
    else:
        raised = result["raised"] = []
        for _ in range(N_TRIALS):
            try:
                objective(None, trainer, seen)
                raised.append(False)
            except optuna.TrialPruned:
                raised.append(True)
    atomic_save(result, out / f"rank{ranks.rank()}.pth")


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
