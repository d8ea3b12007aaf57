"""A training run for the SIGKILL test of test_checkpoint.py.

Run as ``python resume_child.py CHECKPOINT_DIR RESULT_FILE``: it trains (and
resumes from CHECKPOINT_DIR when a checkpoint is there), then writes the final
weights and the Recorder's history to RESULT_FILE. Saves and batches are
slowed down so that a kill at a random moment often lands inside a write.
"""

import sys
import time

import torch
from helpers import make_dataset
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

import fitlib.serialization
from fitlib import Callback, DataBunch, Learner
from fitlib.callbacks import Checkpoint

real_save = torch.save


def slow_save(obj, f, *args, **kwargs):
    real_save(obj, f, *args, **kwargs)
    time.sleep(0.02)  # written, not yet renamed: a kill here leaves a temp file


class Slow(Callback):
    def on_batch_end(self):
        time.sleep(0.004)


def main(ckpt_dir: str, result: str) -> None:
    torch.set_num_threads(1)
    fitlib.serialization.torch.save = slow_save
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3)
    )
    data = DataBunch(
        DataLoader(make_dataset(100), 16, shuffle=True),
        DataLoader(make_dataset(37, seed=1), 16),
        device="cpu",
    )
    learn = Learner(
        data,
        model,
        F.cross_entropy,
        opt_func=torch.optim.SGD,
        progress=False,
        callbacks=[Checkpoint(ckpt_dir, every_n_steps=2, keep_last=2), Slow()],
    )
    print("started", flush=True)
    learn.fit_one_cycle(8, max_lr=0.1, moms=(0.95, 0.85))
    rec = learn.recorder
    fitlib.serialization.atomic_save(
        {
            "weights": learn.model.state_dict(),
            "losses": rec.losses,
            "lrs": rec.lrs,
            "valid_losses": rec.valid_losses,
        },
        result,
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
