"""A search worker for test_tune.py's tests across processes.

Run as ``python tune_child.py DIRECTORY MODE N_TRIALS``. Each trial trains a
seeded MLP (width and lr from the trial) for 3 epochs of 7 batches on the
tests' tiny problem, with a checkpoint every 2 steps, and appends
``<trial number> <run directory> <pid>`` to ``DIRECTORY/ran.txt`` as it
starts. MODE ``kill``: the process sends itself SIGKILL after training batch
10 of its first trial (mid-epoch, after a checkpoint); ``kill_done``: after
its first trial's fit returned, before Optuna's ``tell``; ``kill_pruned``:
the same with a pruner that prunes at the first validation, after ``fit``
raised ``TrialPruned``; ``pruned``: it searches to the end with that pruner;
``run``: it searches to the end; ``worker``: it first waits until 3 workers
are ready, then searches (the multi-worker test).
"""

import os
import signal
import sys
import time
from pathlib import Path

import optuna
import torch
from helpers import make_dataset
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

from fitlib import Callback, DataBunch, Learner
from fitlib.tune import search


class KillAt(Callback):
    def __init__(self, iteration: int) -> None:
        self.iteration = iteration

    def on_batch_end(self, train: bool, iteration: int) -> None:
        if train and iteration == self.iteration:
            os.kill(os.getpid(), signal.SIGKILL)


def main(directory: str, mode: str, n_trials: str) -> None:
    torch.set_num_threads(1)
    ran = Path(directory) / "ran.txt"

    def make_learner(trial):
        with open(ran, "a") as f:  # one short line: appended whole
            f.write(f"{trial.number} {trial.user_attrs['run_dir']} {os.getpid()}\n")
        width = trial.suggest_categorical("width", [8, 32])
        model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Dropout(0.2),
                              nn.Linear(width, 3))  # fmt: skip
        data = DataBunch(
            DataLoader(make_dataset(100), 16, shuffle=True),
            DataLoader(make_dataset(37, seed=1), 16),
            device="cpu",
        )
        kill = [KillAt(10)] if mode == "kill" else []
        return Learner(data, model, F.cross_entropy, opt_func=torch.optim.SGD,
                       progress=False, callbacks=kill)  # fmt: skip

    def fit(learn, trial):
        try:
            learn.fit(3, lr=trial.suggest_float("lr", 1e-3, 0.5, log=True))
        except optuna.TrialPruned:
            if mode == "kill_pruned":
                os.kill(os.getpid(), signal.SIGKILL)
            raise
        if mode == "kill_done":
            os.kill(os.getpid(), signal.SIGKILL)

    if mode == "worker":
        Path(directory, f"ready-{os.getpid()}").touch()
        while len(list(Path(directory).glob("ready-*"))) < 3:
            time.sleep(0.05)
    print("started", flush=True)
    always = optuna.pruners.ThresholdPruner(upper=0.0)  # every loss is > 0
    search(make_learner, fit, int(n_trials), directory=directory,
           checkpoint={"every_n_steps": 2}, progress=False,
           pruner=always if "pruned" in mode else None)  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:])
