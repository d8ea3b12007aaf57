"""The script test_distributed_trainer_torchrun.py launches with torchrun (2
CPU processes, gloo).

``python -m torch.distributed.run --standalone --nproc_per_node=2
dist_child.py MODE OUT``: trains on the tiny data and writes each rank's final
weights and last validation results to OUT/rank<r>.pth.
"""

import datetime
import sys
from functools import partial
from pathlib import Path

import torch
from helpers import make_dataset
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

from fitlib import Callback, DataBunch, Learner, ranks
from fitlib.callbacks import (
    Checkpoint,
    Compile,
    CSVLogger,
    EarlyStopping,
    GradientAccumulation,
    GradientClipping,
    TerminateOnNaN,
    TrainStats,
    ValidationSchedule,
)
from fitlib.callbacks.distributed_trainer import DistributedTrainer
from fitlib.metrics import F1Score, accuracy
from fitlib.serialization import atomic_save
from fitlib.sharding import model_state


class Crash(Callback):
    def __init__(self, ranks=(0, 1)):
        self.ranks = ranks

    def on_batch_end(self, iteration, train):
        if train and iteration == 5 and ranks.rank() in self.ranks:
            raise RuntimeError(f"simulated crash on rank {ranks.rank()}")


class NaNOnRank1(Callback):
    def on_loss_begin(self, last_output, iteration, train):
        if train and iteration == 4 and ranks.rank() == 1:
            return {"last_output": last_output * float("nan")}
        return None


class Watch(EarlyStopping):
    """Notes each epoch's value (its train_loss sums every rank's losses)."""

    def __init__(self):
        super().__init__(monitor="train_loss", patience=100)
        self.values = []

    def step(self, value, epoch, model):
        self.values.append(value)
        return super().step(value, epoch, model)


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
    """MODE: plain, checkpoint, crash, rank1_fails, accumulate, big, tiny, nan,
    schedule (validations inside epochs), compile (aot_eager); a
    prefix fsdp_ (or fsdp alone for plain) shards the model with FSDP2; a
    suffix _parts (or parts alone) trains with one optimizer per layer (a
    MultiOptimizer: the same SGD, so the same weights as one optimizer)."""
    torch.set_num_threads(1)
    fsdp = mode.startswith("fsdp")
    parts = mode.endswith("parts")
    mode = mode.removeprefix("fsdp").removesuffix("parts").strip("_") or "plain"
    sharding = {"strategy": "fsdp", "fsdp_units": (nn.Linear,)} if fsdp else {}
    timeout = datetime.timedelta(seconds=60)  # a hang fails the test, soon
    trainer = DistributedTrainer(timeout=timeout, **sharding)  # joins the group
    bs = 16 if mode != "accumulate" else 8
    n_valid = 1 if mode == "tiny" else 37
    data = DataBunch(
        DataLoader(make_dataset(96), bs, shuffle=True),
        DataLoader(make_dataset(n_valid, seed=1), 8),
        device="cpu",
    )
    stats = TrainStats(every_n_steps=2)
    callbacks = [trainer, CSVLogger(out / "log.csv"), stats, GradientClipping(1.0)]
    watch = Watch()  # a resume inside an epoch restores each rank's part of it
    if mode in ("checkpoint", "crash"):
        callbacks += [Checkpoint(out / "ckpt", every_n_steps=2), watch]
    if mode == "crash":
        callbacks.append(Crash())
    if mode == "rank1_fails":
        callbacks.append(Crash(ranks=(1,)))
    if mode == "accumulate":
        callbacks.append(GradientAccumulation(2))
    nan = TerminateOnNaN(check_every=0)  # paced by batches: the same on both ranks
    if mode == "nan":
        callbacks += [NaNOnRank1(), nan]
    if mode == "schedule":
        callbacks.append(ValidationSchedule(every_n_steps=2))
    graphs = []  # what the compile backend was given (DDP: a graph per bucket)
    if mode == "compile":  # the DDP wrapper compiled, as torch recommends
        callbacks.append(Compile(backend=lambda gm, _: graphs.append(gm) or gm.forward))
    plain = mode in ("accumulate", "big")
    sgd = partial(torch.optim.SGD, momentum=0.9)  # a state to shard and resume
    if parts:  # every layer with parameters: its own optimizer
        sgd = {name: sgd for name in (("0", "2") if plain else ("0", "1", "4"))}
    learn = Learner(data, model(plain), F.cross_entropy, opt_func=sgd,
                    metrics=[accuracy, F1Score()], callbacks=callbacks)  # fmt: skip
    learn.fit(3, lr=0.1)
    rec = learn.recorder
    result = {
        "weights": model_state(learn.model),  # whole, on rank 0, also when sharded
        "grad_norms": [h["grad_norm"] for h in stats.history],
        "train_losses": watch.values,
        "valid_loss": rec.valid_losses[-1],
        "metrics": rec.metrics[-1],
        "world": ranks.world_size(),
        "nan": [nan.nan_iteration, nan.stop_iteration, rec.iterations],
        "graphs": len(graphs),
        "records": [
            {k: v for k, v in r.items() if k != "time"} for r in rec.epoch_table()
        ],
    }
    atomic_save(result, out / f"rank{ranks.rank()}.pth")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
