"""A training run for the SIGKILL test of test_batch_size_finder.py.

Run as ``python batch_size_finder_child.py CHECKPOINT_DIR RESULT_FILE``, as a
user's script: it finds the largest batch size under a CPU memory budget
(binsearch, ``apply=True``), then trains a Learner (Adam, a model with
BatchNorm and dropout) on batches of that size, with a Checkpoint every 2
steps, resuming from CHECKPOINT_DIR when a checkpoint is there; then writes
the size, the final weights and the Recorder's losses to RESULT_FILE.
Batches are slowed down so that a kill at a random moment lands anywhere
in the fit; every rerun searches again before it resumes.
"""

import sys
import time

import torch
from helpers import make_dataset
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

import fitlib.serialization
from fitlib import Callback, DataBunch, Learner, find_batch_size
from fitlib.callbacks import Checkpoint


class Slow(Callback):
    def on_batch_end(self):
        time.sleep(0.02)


def main(ckpt_dir: str, result: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(),
                          nn.Dropout(0.3), nn.Linear(32, 3))  # fmt: skip
    data = DataBunch(
        DataLoader(make_dataset(400), 16, shuffle=True),
        DataLoader(make_dataset(64, seed=1), 32),
        device="cpu",
    )
    learn = Learner(data, model, F.cross_entropy, torch.optim.Adam, metrics=[],
                    progress=False, callbacks=[Checkpoint(ckpt_dir, every_n_steps=2),
                                               Slow()])  # fmt: skip
    learn.create_opt(1e-2)
    found = find_batch_size(learn.model, learn.loss_func, learn.opt, data,
                            max_memory="40kB", mode="binsearch", apply=True,
                            verbose=False)  # fmt: skip
    print("started", flush=True)  # each rerun searches again, then resumes
    learn.fit(4, lr=1e-2)
    fitlib.serialization.atomic_save(
        {"batch_size": found.batch_size, "weights": learn.model.state_dict(),
         "losses": learn.recorder.losses}, result)  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:])
