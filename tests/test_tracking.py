"""``fitlib.tracking``, what the loggers share: the training clock, the
per-step loss points read in one transfer, the optimizer's parameters, and
the checkpoint directory's id."""

import os
import subprocess
import sys
import time

import pytest
import torch

from fitlib import HPOptimizer
from fitlib.tracking import (
    RUN_ID_FILE,
    TrainClock,
    directory_id,
    optimizer_params,
    process_gone,
    read_into,
)


def test_the_train_clock_counts_only_while_running(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    clock = TrainClock()
    now[0] = 103.0
    clock.pause()  # validation: not counted
    now[0] = 110.0
    clock.resume()
    now[0] = 112.0
    assert clock.lap() == 5.0
    now[0] = 113.0
    assert clock.elapsed() == 1.0  # the next lap from zero
    clock.reset(40.0)  # restored from a checkpoint
    assert clock.elapsed() == 40.0


def test_read_into_adds_the_size_weighted_losses_and_empties_the_list():
    interval = [0.0, 0]
    unread = [(torch.tensor(2.0), 3), (torch.tensor(1.0), 1)]
    read_into(interval, unread)
    assert interval == [7.0, 4] and unread == []


def test_optimizer_params_names_the_class_and_the_last_groups_values():
    opt = HPOptimizer(torch.nn.Linear(2, 1).parameters(), torch.optim.SGD, lr=0.1,
                      mom=0.9)  # fmt: skip
    params = optimizer_params(opt, ("lr", "mom", "beta"))
    assert params == {"optimizer": "SGD", "lr": 0.1, "mom": 0.9}  # no beta: left out


def test_the_directory_id_is_made_once_and_a_strange_one_is_refused(tmp_path):
    first = directory_id(tmp_path)
    assert len(first) == 32 and directory_id(tmp_path) == first
    (tmp_path / RUN_ID_FILE).write_text("not an id\n")
    with pytest.raises(ValueError, match=r"holds 'not an id\\n', not an id fitlib"):
        directory_id(tmp_path)


def test_process_gone_only_when_surely_ended():
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    assert process_gone(ended.stdout.strip())
    assert not process_gone(os.getpid()) and not process_gone("abc")
