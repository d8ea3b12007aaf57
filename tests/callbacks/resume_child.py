"""A training run for the SIGKILL test of test_checkpoint.py.

Run as ``python resume_child.py CHECKPOINT_DIR RESULT_FILE [parts] [options]``:
it trains (with ``parts``: an Adam and an SGD part, one optimizer each; with
``options``: Checkpoint's stateful options on, for test_checkpoint_options.py:
the top 2 files by valid_loss under a template, a threshold, weights-only
best files, a save every 0.15 s of wall clock instead of every 2 steps) (and
resumes from CHECKPOINT_DIR when a checkpoint is there), then writes the final
weights and the Recorder's history to RESULT_FILE. Saves and batches are
slowed down so that a kill at a random moment often lands inside a write.
"""

import sys
import time
from functools import partial

import torch
from helpers import make_dataset
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

import fitlib.serialization
from fitlib import Callback, DataBunch, Learner
from fitlib.callbacks import Checkpoint

real_save = torch.save
THRESHOLD = 0.95  # beaten after a few epochs: the first have no best file
OPT_FUNCS = {"0": torch.optim.Adam, "3": partial(torch.optim.SGD, momentum=0.9)}


def slow_save(obj, f, *args, **kwargs):
    real_save(obj, f, *args, **kwargs)
    time.sleep(0.02)  # written, not yet renamed: a kill here leaves a temp file


class Slow(Callback):
    def on_batch_end(self):
        time.sleep(0.004)


EVERY = {"every_n_steps": 2, "keep_last": 2}
OPTIONS = {
    "every_n_seconds": 0.15,
    "monitor": "valid_loss",
    "save_top_k": 2,
    "filename": "{epoch:02d}-{valid_loss:.4f}",
    "initial_value_threshold": THRESHOLD,
    "save_weights_only": True,
}


def main(ckpt_dir: str, result: str, parts: bool = False, options=False) -> None:
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
    ckpt = Checkpoint(ckpt_dir, **(OPTIONS if options else EVERY))
    learn = Learner(
        data,
        model,
        F.cross_entropy,
        opt_func=OPT_FUNCS if parts else torch.optim.SGD,
        progress=False,
        callbacks=[ckpt, Slow()],
    )
    print("started", flush=True)
    lr = {"0": 0.01, "3": 0.1} if parts else 0.1
    learn.fit_one_cycle(8, max_lr=lr, moms=(0.95, 0.85))
    rec = learn.recorder
    fitlib.serialization.atomic_save(
        {
            "weights": learn.model.state_dict(),
            "losses": rec.losses,
            "lrs": rec.lrs,
            "valid_losses": rec.valid_losses,
            "best": [(p.name, v) for p, v in ckpt.best_files] if options else None,
        },
        result,
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "parts" in sys.argv[3:], "options" in sys.argv[3:])
