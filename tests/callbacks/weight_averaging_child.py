"""A training run for the SIGKILL tests of test_ema.py and test_swa.py.

Run as ``python weight_averaging_child.py CHECKPOINT_DIR RESULT_FILE ema|swa``:
it trains a model with BatchNorm and dropout under ``EMA`` (validated on both
weights, BatchNorm buffers averaged) or ``SWA`` (from epoch 3, its own lr),
with a Checkpoint every 2 steps, resuming from CHECKPOINT_DIR when a
checkpoint is there; then writes the final weights, the callback's state
and the Recorder's values to RESULT_FILE. Batches are slowed down so that a
kill at a random moment lands anywhere in the fit.

Under torchrun, ``... OUT_DIR RESULT_STEM ddp|fsdp`` trains with
``DistributedTrainer`` (FSDP2 over the Linear layers for ``fsdp``) and EMA on
the parameters (validated on both), and each rank writes its averages (its
own slices under FSDP), its update count and the records to
``RESULT_STEM-rank<r>.pth``; ``ddp_bn`` trains a model with BatchNorm under
DDP with the average (buffers included) kept at the end, and each rank also
writes its model's state.
"""

import datetime
import sys
import time

import torch
from helpers import make_dataset
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

import fitlib.ranks as ranks
import fitlib.serialization
from fitlib import Callback, DataBunch, Learner
from fitlib.callbacks import EMA, SWA, Checkpoint, DistributedTrainer
from fitlib.metrics import accuracy


class Slow(Callback):
    def on_batch_end(self):
        time.sleep(0.004)


def main(ckpt_dir: str, result: str, which: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3),
        nn.Linear(32, 3),
    )  # fmt: skip
    data = DataBunch(
        DataLoader(make_dataset(100), 16, shuffle=True),
        DataLoader(make_dataset(37, seed=1), 16),
        device="cpu",
    )
    averager = (
        EMA(decay=0.8, warmup=True, validate_on="both")
        if which == "ema"
        else SWA(swa_start=3, swa_lr=0.02, anneal_epochs=2)
    )
    ckpt = Checkpoint(ckpt_dir, every_n_steps=2, keep_last=2)
    learn = Learner(data, model, F.cross_entropy, opt_func=torch.optim.SGD,
                    progress=False, metrics=[accuracy],
                    callbacks=[ckpt, averager, Slow()])  # fmt: skip
    print("started", flush=True)
    learn.fit_one_cycle(8, max_lr=0.1)
    rec = learn.recorder
    fitlib.serialization.atomic_save(
        {
            "weights": learn.model.state_dict(),
            "state": averager.state_dict(),
            "losses": rec.losses,
            "lrs": rec.lrs,
            "table": rec.epoch_table(),
        },
        result,
    )


def distributed(stem: str, strategy: str) -> None:
    torch.set_num_threads(1)
    sharding = (
        {"strategy": "fsdp", "fsdp_units": (nn.Linear,)} if strategy == "fsdp" else {}
    )
    trainer = DistributedTrainer(timeout=datetime.timedelta(seconds=60), **sharding)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    if strategy == "ddp_bn":
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(),
                              nn.Linear(16, 3))  # fmt: skip
    data = DataBunch(
        DataLoader(make_dataset(96), 16, shuffle=True),
        DataLoader(make_dataset(37, seed=1), 8),
        device="cpu",
    )
    final = "ema" if strategy == "ddp_bn" else "live"
    ema = EMA(decay=0.8, validate_on="both", final=final)
    learn = Learner(data, model, F.cross_entropy, opt_func=torch.optim.SGD,
                    progress=False, metrics=[accuracy],
                    callbacks=[trainer, ema])  # fmt: skip
    learn.fit(2, lr=0.1)
    table = [{k: v for k, v in r.items() if k != "time"}
             for r in learn.recorder.epoch_table()]  # fmt: skip
    fitlib.serialization.atomic_save(
        {
            "state": ema.state_dict(),
            "table": table,
            "world": ranks.world_size(),
            "model": model.state_dict(),
        },
        f"{stem}-rank{ranks.rank()}.pth",
    )


if __name__ == "__main__":
    if sys.argv[3] in ("ddp", "fsdp", "ddp_bn"):
        distributed(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1], sys.argv[2], sys.argv[3])
