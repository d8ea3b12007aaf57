"""The script test_distributed.py launches with torchrun (2 CPU processes, gloo).

``python -m torch.distributed.run --standalone --nproc_per_node=2
dist_child.py MODE OUT``: trains on the tiny data and writes each rank's final
weights and last validation results to OUT/rank<r>.pth.
"""

import sys
from pathlib import Path

import torch
from helpers import make_dataset
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

from fitlib import Callback, DataBunch, Learner
from fitlib import distributed as fd
from fitlib.callbacks import Checkpoint, CSVLogger, GradientAccumulation
from fitlib.callbacks.distributed import DistributedTrainer
from fitlib.metrics import F1Score, accuracy
from fitlib.serialization import atomic_save


class Crash(Callback):
    def __init__(self, ranks=(0, 1)):
        self.ranks = ranks

    def on_batch_end(self, iteration, train):
        if train and iteration == 5 and fd.rank() in self.ranks:
            raise RuntimeError(f"simulated crash on rank {fd.rank()}")


def model(plain: bool = False) -> nn.Module:
    """With batch norm and dropout, or (plain) without, to compare batch sizes."""
    torch.manual_seed(0)
    if plain:
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    return nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2),
        nn.Linear(16, 3),
    )  # fmt: skip


def main(mode: str, out: Path) -> None:
    torch.set_num_threads(1)
    trainer = DistributedTrainer()  # joins the process group now
    bs = 16 if mode != "accumulate" else 8
    n_valid = 1 if mode == "tiny" else 37
    data = DataBunch(
        DataLoader(make_dataset(96), bs, shuffle=True),
        DataLoader(make_dataset(n_valid, seed=1), 8),
        device="cpu",
    )
    callbacks = [trainer, CSVLogger(out / "log.csv")]
    if mode in ("checkpoint", "crash"):
        callbacks.append(Checkpoint(out / "ckpt", every_n_steps=2))
    if mode == "crash":
        callbacks.append(Crash())
    if mode == "rank1_fails":
        callbacks.append(Crash(ranks=(1,)))
    if mode == "accumulate":
        callbacks.append(GradientAccumulation(2))
    plain = mode in ("accumulate", "big")
    learn = Learner(data, model(plain), F.cross_entropy, opt_func=torch.optim.SGD,
                    metrics=[accuracy, F1Score()], callbacks=callbacks)  # fmt: skip
    learn.fit(3, lr=0.1)
    rec = learn.recorder
    result = {
        "weights": learn.model.state_dict(),
        "valid_loss": rec.valid_losses[-1],
        "metrics": rec.metrics[-1],
        "world": fd.world_size(),
    }
    atomic_save(result, out / f"rank{fd.rank()}.pth")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
