"""A cluster job for the SIGKILL test of test_time_limit.py.

Run as ``python time_limit_child.py CHECKPOINT_DIR RESULT_FILE MODE``: it
fits 3 epochs with 1cycle, a ``Checkpoint`` (every 2 steps) and a fake clock
that moves one second per training batch. MODE ``limit``: a ``TimeLimit(5)``
suspends the fit (it prints the reason); ``kill``: the process sends itself
SIGKILL after its fourth batch, in the middle of an epoch; ``none``: it
trains to the end and writes the final weights and the Recorder's losses
to RESULT_FILE.
"""

import os
import signal
import sys

import torch
from helpers import FakeClock, resume_learner

import fitlib.time_budget
from fitlib import Callback
from fitlib.callbacks import Checkpoint, TimeLimit
from fitlib.serialization import atomic_save


class Tick(Callback):
    def on_batch_end(self, train):
        fitlib.time_budget.time.now += 1.0 if train else 0.0


class KillAt(Callback):
    def __init__(self, batches):
        self.batches = batches

    def on_batch_end(self, train, iteration):
        self.batches -= train
        if self.batches == 0:  # (iteration: wherever the resume started)
            os.kill(os.getpid(), signal.SIGKILL)


def main(ckpt_dir: str, result: str, mode: str) -> None:
    torch.set_num_threads(1)
    fitlib.time_budget.time = FakeClock()
    extra = {"limit": [TimeLimit(5)], "kill": [KillAt(4)], "none": []}[mode]
    callbacks = [Checkpoint(ckpt_dir, every_n_steps=2), Tick(), *extra]
    learn = resume_learner(callbacks)
    history = learn.fit_one_cycle(3, 0.1)
    print(history.stop_reason, flush=True)
    if history.stop_reason is None:
        rec = learn.recorder
        atomic_save({"weights": learn.model.state_dict(), "losses": rec.losses,
                     "valid_losses": rec.valid_losses}, result)  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:])
