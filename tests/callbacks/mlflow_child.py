"""A training run that test_mlflow_logger.py launches as its own process:
``python mlflow_child.py URI EXPERIMENT CKPT_DIR|- KILL_AT|-``. It trains 2
epochs with an MLflowLogger (a point every step) and, with CKPT_DIR, a
Checkpoint every 2 steps; with KILL_AT it kills itself with SIGKILL after
that training batch, as an out-of-memory killer or a preempted node would."""

import os
import signal
import sys

import torch
from helpers import make_data, make_model
from torch.nn import functional as F  # noqa: N812

from fitlib import Callback, Learner
from fitlib.callbacks import Checkpoint, MLflowLogger
from fitlib.metrics import accuracy


class Kill(Callback):
    def __init__(self, at):
        self.at = at

    def on_batch_end(self, train, iteration):
        if train and iteration == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def main(uri, experiment, ckpt, kill_at):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    callbacks = [MLflowLogger(uri, experiment=experiment, every_n_steps=1)]
    if ckpt != "-":
        callbacks.append(Checkpoint(ckpt, every_n_steps=2))
    if kill_at != "-":
        callbacks.append(Kill(int(kill_at)))
    learn = Learner(
        make_data(),
        make_model(),
        F.cross_entropy,
        metrics=[accuracy],
        opt_func=torch.optim.SGD,
        progress=False,
        callbacks=callbacks,
    )
    learn.fit(2, lr=0.1)


if __name__ == "__main__":
    main(*sys.argv[1:])
