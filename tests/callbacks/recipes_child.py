"""A training run for the SIGKILL tests of test_progressive_resizing.py and
test_activation_checkpointing.py.

Run as ``python recipes_child.py MODE CHECKPOINT_DIR RESULT_FILE``, MODE
``resize`` (a small convnet on 32x32 images, ProgressiveResizing from 16 in
3 buckets) or ``checkpointing`` (an MLP of two blocks with dropout, both
under ActivationCheckpointing): it trains with a Checkpoint every 2 steps
(and resumes from CHECKPOINT_DIR when a checkpoint is there), then writes
the final weights and the Recorder's losses to RESULT_FILE. Saves and
batches are slowed down so that a kill at a random moment often lands inside
a write. The tests run ``train`` in their own process for the unbroken
reference; ``killed_and_resumed_equal`` is the check they share.
"""

import sys
import time
from pathlib import Path

import torch
from helpers import child_env, kill_until_done, make_dataset
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

import fitlib.serialization
from fitlib import Callback, DataBunch, Learner
from fitlib.callbacks import ActivationCheckpointing, Checkpoint, ProgressiveResizing
from fitlib.serialization import safe_load

real_save = torch.save


def slow_save(obj, f, *args, **kwargs):
    real_save(obj, f, *args, **kwargs)
    time.sleep(0.02)  # written, not yet renamed: a kill here leaves a temp file


class Slow(Callback):
    def on_batch_end(self):
        time.sleep(0.006)


def images(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, 32, 32, generator=g)
    return TensorDataset(x, (x[:, 0].mean((1, 2)) > 0.5).long())


def resize_run():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 2),
    )
    loaders = (DataLoader(images(100, 0), 16, shuffle=True),
               DataLoader(images(37, 1), 16))  # fmt: skip
    return model, loaders, ProgressiveResizing(start=16, buckets=3)


def checkpointing_run():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 32)),
        nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 3)),
    )
    loaders = (DataLoader(make_dataset(100), 16, shuffle=True),
               DataLoader(make_dataset(37, seed=1), 16))  # fmt: skip
    return model, loaders, ActivationCheckpointing(["0", "1"])


def train(mode: str, ckpt_dir: str) -> dict:
    """The run (resumed from ``ckpt_dir`` when a checkpoint is there): the
    final weights and the Recorder's losses."""
    model, loaders, recipe = {"resize": resize_run,
                              "checkpointing": checkpointing_run}[mode]()  # fmt: skip
    ckpt = Checkpoint(ckpt_dir, every_n_steps=2, keep_last=2)
    learn = Learner(DataBunch(*loaders, device="cpu"), model, F.cross_entropy,
                    opt_func=torch.optim.SGD, wd=0.01, metrics=[], progress=False,
                    callbacks=[recipe, ckpt, Slow()])  # fmt: skip
    print("started", flush=True)
    learn.fit_one_cycle(8, max_lr=0.1)
    rec = learn.recorder
    return {"weights": learn.model.state_dict(), "losses": rec.losses,
            "valid_losses": rec.valid_losses}  # fmt: skip


def killed_and_resumed_equal(tmp_path: Path, mode: str, seed: int) -> None:
    """This script in ``mode``, killed with SIGKILL at random moments and rerun
    until done, ends with the losses and weights of an unbroken run."""
    ref = train(mode, str(tmp_path / "ref"))  # unbroken, in the test's process
    cmd = [sys.executable, __file__, mode, str(tmp_path / "ckpt"),
           str(tmp_path / "run.pth")]  # fmt: skip
    kills = kill_until_done(cmd, child_env(), seed=seed, kills=3)
    assert kills >= 2, "the run was too fast to kill: slow recipes_child.py down"
    run_ = safe_load(tmp_path / "run.pth")
    assert run_["losses"] == ref["losses"]
    assert run_["valid_losses"] == ref["valid_losses"]
    assert all(torch.equal(run_["weights"][k], v) for k, v in ref["weights"].items())


def main(mode: str, ckpt_dir: str, result: str) -> None:
    torch.set_num_threads(1)
    fitlib.serialization.torch.save = slow_save
    fitlib.serialization.atomic_save(train(mode, ckpt_dir), result)


if __name__ == "__main__":
    main(*sys.argv[1:4])
