import logging
import math
import re
import time

import pytest
import torch
from helpers import make_data, scripted_record, train

from fitlib.callback import call_hook
from fitlib.callbacks.accumulation import GradientAccumulation
from fitlib.callbacks.recorder import Recorder
from fitlib.callbacks.text_logger import TextLogger
from fitlib.metrics import Metrics, accuracy
from fitlib.running_loss import RunningLoss
from fitlib.tracking import TrainClock


class FakeOpt:
    def __init__(self, lr, stepped=None):
        self.param_groups = [{"lr": lr}]
        self.stepped = stepped


@pytest.fixture
def clock(monkeypatch):
    """A clock the test sets by hand: clock["now"] is what perf_counter says."""
    clock = {"now": 0.0}
    monkeypatch.setattr(time, "perf_counter", lambda: clock["now"])
    return clock


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.INFO, logger="fitlib")
    return caplog


def lines(caplog, name="fitlib"):
    return [r.getMessage() for r in caplog.records if r.name == name]


def batch(cb, loss, size, step, epoch=0, opt=None, train=True):
    call_hook(
        cb,
        "on_batch_end",
        train=train,
        step=step,
        epoch=epoch,
        opt=opt or FakeOpt(0.1),
        last_loss=torch.tensor(loss),
        last_target=torch.zeros(size),
    )


def begin(cb, iteration=0, metrics=(accuracy,)):
    call_hook(cb, "on_train_begin", iteration=iteration, metrics=Metrics(list(metrics)))


# -- helpers ---------------------------------------------------------------------
def test_running_loss_is_sample_weighted_and_adds_a_restored_sum():
    loss = RunningLoss()
    loss.add(torch.tensor(1.0), 4)
    loss.add(torch.tensor(6.0), 1)
    assert loss.samples == 5
    state = loss.state_dict()
    assert state == {"total": 10.0, "count": 5}
    restored = RunningLoss()
    restored.load_state_dict(state)
    restored.add(torch.tensor(0.0), 5)
    assert restored.mean([0.0]) == 1.0
    assert math.isnan(RunningLoss().mean([]))


def test_train_clock_leaves_out_the_paused_time(clock):
    tc = TrainClock()
    clock["now"] = 2.0
    tc.pause()
    clock["now"] = 5.0  # validation
    tc.pause()  # paused twice: still counted once
    tc.resume()
    clock["now"] = 6.0
    assert tc.lap() == 3.0
    clock["now"] = 6.5
    assert tc.elapsed() == 0.5


# -- scripted hooks --------------------------------------------------------------
def test_the_epoch_line_has_losses_metrics_and_time(logs, clock):
    cb = TextLogger(every_n_steps=None)
    begin(cb)
    call_hook(cb, "on_epoch_begin", epoch=0)
    for i, (loss, size) in enumerate([(1.0, 4), (2.0, 4), (6.0, 2)]):
        batch(cb, loss, size, step=i + 1)
    clock["now"] = 1.5
    last = [torch.tensor(0.5), torch.tensor(0.75)]
    losses, sizes = [1.0, 2.0, 6.0], [4, 4, 2]
    record = scripted_record(losses, sizes, last, ["accuracy"], seconds=1.5)
    call_hook(cb, "on_epoch_end", epoch=0, record=record)
    assert lines(logs) == [
        "epoch 0: train_loss 2.4 valid_loss 0.5 accuracy 0.75 time 1.50s"
    ]


def test_a_skipped_validation_says_n_a(logs):
    cb = TextLogger()
    begin(cb)
    call_hook(cb, "on_epoch_begin", epoch=3)
    batch(cb, 2.0, 3, step=1, epoch=3)
    record = scripted_record([2.0], [3], None, ["accuracy"], epoch=3)
    call_hook(cb, "on_epoch_end", epoch=3, record=record)
    assert lines(logs)[0].startswith(
        "epoch 3: train_loss 2 valid_loss n/a accuracy n/a time"
    )


def test_step_lines_come_every_n_steps_with_speed_lr_and_mean_loss(logs, clock):
    cb = TextLogger(every_n_steps=3)
    begin(cb)
    call_hook(cb, "on_epoch_begin", epoch=0)
    opt = FakeOpt(0.01, stepped=(0.05, 0.9))  # the step used 0.05
    for step in range(1, 8):
        clock["now"] = step * 0.5
        batch(cb, float(step), 10, step=step, opt=opt)
    assert lines(logs) == [
        "step 3 (epoch 0): loss 2, lr 5.000e-02, 20.0 samples/s",
        "step 6 (epoch 0): loss 5, lr 5.000e-02, 20.0 samples/s",
    ]


def test_batches_without_a_step_count_samples_but_log_once(logs, clock):
    cb = TextLogger(every_n_steps=2)
    begin(cb)
    call_hook(cb, "on_epoch_begin", epoch=0)
    # Accumulation over two batches: the step count moves every other batch.
    for i, step in enumerate([0, 1, 1, 2, 2, 3, 3, 4]):
        clock["now"] = i + 1.0
        batch(cb, 1.0 + (i >= 4), 5, step=step)
    assert lines(logs) == [
        "step 2 (epoch 0): loss 1, lr 1.000e-01, 5.0 samples/s",
        "step 4 (epoch 0): loss 2, lr 1.000e-01, 5.0 samples/s",
    ]


def test_validation_time_is_left_out_of_the_speed(logs, clock):
    cb = TextLogger(every_n_steps=2)
    begin(cb)
    call_hook(cb, "on_epoch_begin", epoch=0)
    clock["now"] = 1.0
    batch(cb, 1.0, 10, step=1)
    batch(cb, 1.0, 10, step=1, train=False)  # validation from t=1 ...
    clock["now"] = 101.0
    record = scripted_record([1.0], [10], [torch.tensor(1.0)])
    call_hook(cb, "on_epoch_end", epoch=0, record=record)
    call_hook(cb, "on_epoch_begin", epoch=1)  # ... to t=101
    clock["now"] = 102.0
    batch(cb, 1.0, 10, step=2, epoch=1)
    assert lines(logs)[-1] == "step 2 (epoch 1): loss 1, lr 1.000e-01, 10.0 samples/s"


def test_a_disabled_logger_reads_nothing_and_logs_nothing(caplog, sync_counter):
    caplog.set_level(logging.WARNING, logger="fitlib")
    cb = TextLogger(every_n_steps=1)
    begin(cb)
    call_hook(cb, "on_epoch_begin", epoch=0)
    before = sync_counter["n"]
    batch(cb, 1.0, 2, step=1)
    record = scripted_record([1.0], [2], [1.0])  # (the loop reads it, not the logger)
    before = sync_counter["n"]
    call_hook(cb, "on_epoch_end", epoch=0, record=record)
    assert sync_counter["n"] == before
    assert lines(caplog) == []


def test_a_logger_object_and_a_level_name_are_used(caplog):
    logger = logging.getLogger("my.run")
    caplog.set_level(logging.DEBUG, logger="my.run")
    cb = TextLogger(logger, every_n_steps=1, level="warning")
    begin(cb, metrics=())
    call_hook(cb, "on_epoch_begin", epoch=0)
    batch(cb, 1.0, 2, step=1)
    assert [(r.name, r.levelno) for r in caplog.records] == [("my.run", 30)]


def test_a_restored_logger_continues_the_interval_exactly(logs, clock):
    def drive(cb, steps):
        for step in steps:
            batch(cb, float(step), 1 + step, step=step)

    whole = TextLogger(every_n_steps=4)
    begin(whole)
    call_hook(whole, "on_epoch_begin", epoch=0)
    drive(whole, range(1, 9))
    first = TextLogger(every_n_steps=4)
    begin(first)
    call_hook(first, "on_epoch_begin", epoch=0)
    drive(first, range(1, 7))
    saved = first.state_dict()  # a checkpoint at step 6, then a crash
    resumed = TextLogger(every_n_steps=4)
    resumed.load_state_dict(saved)
    begin(resumed, iteration=6)
    call_hook(resumed, "on_epoch_begin", epoch=0)
    drive(resumed, range(7, 9))
    loss_at_8 = [line.split(",")[0] for line in lines(logs) if "step 8" in line]
    assert len(loss_at_8) == 2 and loss_at_8[0] == loss_at_8[1]
    assert sum("step 4" in line for line in lines(logs)) == 2  # not repeated


def test_a_fresh_fit_restarts_the_counters(logs):
    cb = TextLogger(every_n_steps=2)
    for _ in range(2):
        begin(cb)
        call_hook(cb, "on_epoch_begin", epoch=0)
        for step in (1, 2):
            batch(cb, 1.0, 2, step=step)
    assert sum(line.startswith("step 2 ") for line in lines(logs)) == 2


# -- through fit -----------------------------------------------------------------
def test_through_fit_it_logs_step_and_epoch_lines(logs):
    rec = Recorder()
    # 7 steps per epoch
    train([rec, TextLogger(every_n_steps=3)], epochs=2, metrics=[accuracy], mom=0.9)
    got = lines(logs)
    steps = [int(m[1]) for line in got if (m := re.match(r"step (\d+) ", line))]
    assert steps == [3, 6, 9, 12]
    epoch_lines = [line for line in got if line.startswith("epoch")]
    assert len(epoch_lines) == 2
    train_loss = float(re.search(r"train_loss (\S+)", epoch_lines[1])[1])
    assert train_loss == pytest.approx(rec.train_losses[1], rel=1e-5)
    first = re.match(r"step 3 \(epoch 0\): loss (\S+), lr (\S+), ", got[0])
    assert float(first[1]) == pytest.approx(sum(rec.losses[:3]) / 3, rel=1e-5)
    assert float(first[2]) == 0.1


def test_through_fit_with_accumulation_lines_follow_optimizer_steps(logs):
    train(
        [TextLogger(every_n_steps=2), GradientAccumulation(3)],
        epochs=2,
        metrics=[accuracy],
        mom=0.9,
    )
    steps = [int(m[1]) for line in lines(logs) if (m := re.match(r"step (\d+)", line))]
    # 7 batches per epoch in groups of 3 (the last ragged): 3 steps per epoch.
    assert steps == [2, 4, 6]


def test_one_transfer_per_line_and_none_per_batch(logs, sync_counter, frozen_clock):
    def count(n_train):
        before = sync_counter["n"]
        train(
            [TextLogger(every_n_steps=4)],
            data=make_data(n_train=n_train),
            metrics=[accuracy],
            mom=0.9,
        )
        return sync_counter["n"] - before

    few, many = count(64), count(256)  # 8 and 32 steps: 2 and 8 step lines
    assert many - few == 6


# -- bad input -------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, -3, 2.5, True, "10"])
def test_every_n_steps_must_be_a_positive_int(n):
    with pytest.raises(ValueError, match="every_n_steps must be an int >= 1"):
        TextLogger(every_n_steps=n)


@pytest.mark.parametrize("logger", [3, None])
def test_logger_must_be_a_logger_or_a_name(logger):
    with pytest.raises(TypeError, match=r"logger must be a logging\.Logger"):
        TextLogger(logger)


@pytest.mark.parametrize("logger", ["", "  "])
def test_an_empty_logger_name_is_a_value_error_not_the_root_logger(logger):
    with pytest.raises(ValueError, match="logger's name, not empty") as info:
        TextLogger(logger)
    assert not isinstance(info.value, TypeError)
    assert "TextLogger('root') for the root logger" in str(info.value)


@pytest.mark.parametrize("level", ["LOUD", -1, 2.5])
def test_level_must_be_a_logging_level(level):
    with pytest.raises(ValueError, match="level must be a logging level"):
        TextLogger(level=level)


def test_load_state_dict_refuses_another_dict():
    with pytest.raises(ValueError, match=r"TextLogger.load_state_dict.*line_step"):
        TextLogger().load_state_dict({"line": 3})
