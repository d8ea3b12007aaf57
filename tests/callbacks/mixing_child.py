"""A job for the SIGKILL tests of test_mixup.py and test_cutmix.py.

Run as ``python mixing_child.py CHECKPOINT_DIR RESULT_FILE RECIPE KILL_AFTER``:
it fits 3 epochs (7 shuffled batches each, dropout) of a small CNN on 4x4
images (CutMix cuts a box in about half the batches) with ``MixUp`` or
``CutMix`` (RECIPE ``mixup`` or ``cutmix``) and a ``Checkpoint`` every 2
steps, resuming from CHECKPOINT_DIR. With KILL_AFTER > 0 the process sends
itself SIGKILL after that many training batches of its own; with 0 it
trains to the end and writes the final weights and the Recorder's losses to
RESULT_FILE. Either way it fails (an AssertionError) if no batch of its own
was mixed (``lam < 1``): a resume test that mixed nothing proves nothing.

Also what the tests of both share: ``killed_and_resumed`` (the SIGKILL
run and its unbroken twin) and ``reference_lams`` (the weights drawn, by
hand).
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from helpers import child_env, make_dataset
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

from fitlib import Callback, DataBunch, Learner
from fitlib.callbacks import Checkpoint
from fitlib.callbacks.cutmix import CutMix
from fitlib.callbacks.mixup import MixUp
from fitlib.serialization import atomic_save, safe_load

HERE = Path(__file__).parent


class KillAfter(Callback):
    def __init__(self, batches, mixed):
        self.batches, self.mixed = batches, mixed

    def on_batch_end(self, train):
        self.batches -= train
        if self.batches == 0:
            assert self.mixed.count, "no batch was mixed before the kill"
            os.kill(os.getpid(), signal.SIGKILL)


class Mixed(Callback):
    """Counts the training batches the recipe really mixed (``lam < 1``)."""

    order = 0  # after MixUp / CutMix (-36)

    def __init__(self, recipe):
        self.recipe, self.count = recipe, 0

    def on_batch_begin(self, train):
        if train:  # the recipe drew this batch's weight just before
            self.count += bool(self.recipe.lam < 1)


class Penalty(Callback):
    """A loss term at the order change-a-training-step.md gives loss terms."""

    order = -35

    def on_backward_begin(self, last_loss):
        return {"last_loss": last_loss + 100.0}


class BackwardLoss(Callback):
    """Keeps the loss backward() gets, before GradientAccumulation (-30)."""

    order = -33

    def __init__(self):
        self.seen = []

    def on_backward_begin(self, last_loss):
        self.seen.append(last_loss.detach().clone())


def images(n, seed):
    x, y = make_dataset(n, d=16, seed=seed).tensors
    return TensorDataset(x.view(n, 1, 4, 4), y)


def main(ckpt_dir: str, result: str, recipe: str, kill_after: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 6, (2, 2)), nn.ReLU(), nn.Dropout(0.2),
                          nn.Flatten(), nn.Linear(54, 3))  # fmt: skip
    data = DataBunch(DataLoader(images(100, 0), 16, shuffle=True),
                     DataLoader(images(37, 1), 16), device="cpu")  # fmt: skip
    mix = {"mixup": MixUp(alpha=0.4), "cutmix": CutMix(alpha=1.0)}[recipe]
    mixed = Mixed(mix)
    callbacks = [Checkpoint(ckpt_dir, every_n_steps=2), mix, mixed]
    if int(kill_after):
        callbacks.append(KillAfter(int(kill_after), mixed))
    learn = Learner(data, model, F.cross_entropy, progress=False,
                    callbacks=callbacks, opt_func=torch.optim.SGD)  # fmt: skip
    learn.fit_one_cycle(3, 0.1)
    assert mixed.count, f"{recipe}: no batch of this run was mixed (lam < 1)"
    rec = learn.recorder
    atomic_save({"weights": learn.model.state_dict(), "losses": rec.losses,
                 "valid_losses": rec.valid_losses}, result)  # fmt: skip


def killed_and_resumed(tmp_path: Path, recipe: str) -> tuple[dict, dict]:
    """This script killed by SIGKILL in the middle of its second epoch, then
    rerun to its end; and the same fit unbroken, in the calling process.
    Returns both results."""
    env = child_env()
    run = [sys.executable, str(HERE / "mixing_child.py"), str(tmp_path / "ckpt"),
           str(tmp_path / "run.pth"), recipe]  # fmt: skip
    killed = subprocess.run([*run, "10"], env=env, capture_output=True)
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    subprocess.run([*run, "0"], env=env, check=True, capture_output=True)
    main(str(tmp_path / "ref"), str(tmp_path / "ref.pth"), recipe, "0")
    return safe_load(tmp_path / "run.pth"), safe_load(tmp_path / "ref.pth")


def reference_lams(seed: int, n: int, alpha: float = 0.4) -> list[float]:
    """The first ``n`` weights ``MixUp(alpha, seed=seed)`` draws, by hand."""
    g = torch.Generator().manual_seed(seed)
    concentration = torch.tensor([alpha, alpha])
    lams = [torch._sample_dirichlet(concentration, generator=g)[0].item()
            for _ in range(n)]  # fmt: skip
    return [max(lam, 1 - lam) for lam in lams]


if __name__ == "__main__":
    main(*sys.argv[1:])
