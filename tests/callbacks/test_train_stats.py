import logging
import math
import time

import pytest
import torch
from helpers import make_data, train
from torch import nn

from fitlib import Callback
from fitlib.callback import call_hook
from fitlib.callbacks.accumulation import GradientAccumulation
from fitlib.callbacks.clipping import GradientClipping
from fitlib.callbacks.train_stats import TrainStats, global_norm


@pytest.fixture
def clock(monkeypatch):
    """A clock the test sets by hand: clock["now"] is what perf_counter says."""
    clock = {"now": 0.0}
    monkeypatch.setattr(time, "perf_counter", lambda: clock["now"])
    return clock


def flat_norm(tensors):
    return torch.cat([t.detach().double().flatten() for t in tensors]).norm().item()


def tiny_model():
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(1.0)  # 6 ones and 2 zeros: weight norm sqrt(6)
        model.bias.zero_()
    return model


def step(cb, model, grad, step, size=4, skip_step=False):
    """One training batch as the handler calls it; every gradient is ``grad``."""
    for p in model.parameters():
        p.grad = torch.full_like(p, grad)
    call_hook(cb, "on_backward_end", model=model, skip_step=skip_step)
    call_hook(
        cb,
        "on_batch_end",
        train=True,
        step=step,
        model=model,
        last_target=torch.zeros(size),
    )


class GradSpy(Callback):
    """Reads the global gradient norm of every step, at a chosen order."""

    def __init__(self, order):
        self.order, self.norms = order, []

    def on_backward_end(self, model, skip_step):
        if not skip_step:
            self.norms.append(flat_norm([p.grad for p in model.parameters()]))


# -- the norm --------------------------------------------------------------------
def test_global_norm_is_the_norm_of_all_tensors_as_one_vector():
    tensors = [torch.randn(3, 4), torch.randn(7), torch.randn(())]
    assert global_norm(tensors).item() == pytest.approx(flat_norm(tensors), rel=1e-6)
    assert global_norm([]) is None


def test_global_norm_of_float16_tensors_does_not_overflow():
    big = [torch.full((100,), 300.0, dtype=torch.float16)] * 2
    norm = global_norm(big)
    assert norm.dtype == torch.float32
    assert norm.item() == pytest.approx(flat_norm(big), rel=1e-3)


# -- scripted hooks --------------------------------------------------------------
def test_a_report_every_n_steps_with_speed_and_norms(clock):
    cb, model = TrainStats(every_n_steps=2), tiny_model()
    call_hook(cb, "on_train_begin", iteration=0)
    call_hook(cb, "on_epoch_begin")
    for i, grad in enumerate([1.0, 3.0, 2.0, 2.0], start=1):
        clock["now"] = 0.5 * i
        step(cb, model, grad, step=i)
    # 8 gradient entries of 1 then 3: norms sqrt(8) and 3 sqrt(8), mean 2 sqrt(8).
    assert [h["step"] for h in cb.history] == [2, 4]
    first = cb.history[0]
    assert first["grad_norm"] == pytest.approx(2 * math.sqrt(8))
    assert first["weight_norm"] == pytest.approx(math.sqrt(6))
    assert first["sec_per_step"] == 0.5
    assert first["samples_per_sec"] == 8.0
    assert first["nonfinite_steps"] == 0
    assert cb.history[1]["grad_norm"] == pytest.approx(2 * math.sqrt(8))


def test_batches_that_do_not_step_count_samples_but_no_norm(clock):
    cb, model = TrainStats(every_n_steps=1), tiny_model()
    call_hook(cb, "on_train_begin", iteration=0)
    call_hook(cb, "on_epoch_begin")
    step(cb, model, 100.0, step=0, skip_step=True)  # accumulating: no step
    clock["now"] = 2.0
    step(cb, model, 1.0, step=1)
    (report,) = cb.history
    assert report["grad_norm"] == pytest.approx(math.sqrt(8))
    assert report["samples_per_sec"] == 4.0  # 8 samples in 2 s


def test_non_finite_gradients_are_counted_and_left_out_of_the_mean():
    cb, model = TrainStats(every_n_steps=3), tiny_model()
    call_hook(cb, "on_train_begin", iteration=0)
    for i, grad in enumerate([1.0, math.inf, math.nan], start=1):
        step(cb, model, grad, step=i)
    assert cb.history[0]["grad_norm"] == pytest.approx(math.sqrt(8))
    assert cb.history[0]["nonfinite_steps"] == 2


def test_validation_time_is_left_out(clock):
    cb, model = TrainStats(every_n_steps=2), tiny_model()
    call_hook(cb, "on_train_begin", iteration=0)
    call_hook(cb, "on_epoch_begin")
    clock["now"] = 1.0
    step(cb, model, 1.0, step=1)
    call_hook(cb, "on_batch_end", train=False, step=1, model=model)
    clock["now"] = 50.0
    call_hook(cb, "on_epoch_end")
    call_hook(cb, "on_epoch_begin")
    clock["now"] = 53.0
    step(cb, model, 1.0, step=2)
    assert cb.history[0]["sec_per_step"] == 2.0  # (1 + 3) s over 2 steps


def test_reports_are_logged_on_fitlib_stats(caplog):
    caplog.set_level(logging.INFO, logger="fitlib.stats")
    cb, model = TrainStats(every_n_steps=1), tiny_model()
    call_hook(cb, "on_train_begin", iteration=0)
    step(cb, model, 1.0, step=1)
    (record,) = caplog.records
    assert record.name == "fitlib.stats"
    assert record.getMessage().startswith("step 1: ")
    assert "grad_norm 2.828, weight_norm 2.449" in record.getMessage()


def test_a_restored_instance_continues_the_interval_exactly(clock):
    grads = [1.0, 2.0, 3.0, 5.0, 8.0, 13.0]

    def drive(cb, model, steps):
        for i in steps:
            clock["now"] = float(i)
            step(cb, model, grads[i - 1], step=i, size=i)

    whole, model = TrainStats(every_n_steps=3), tiny_model()
    call_hook(whole, "on_train_begin", iteration=0)
    drive(whole, model, range(1, 7))
    clock["now"] = 0.0
    first = TrainStats(every_n_steps=3)
    call_hook(first, "on_train_begin", iteration=0)
    drive(first, model, range(1, 5))
    saved = first.state_dict()  # a checkpoint at step 4, then a crash
    assert isinstance(saved["grad_sum"], float) and saved["grad_steps"] == 1
    resumed = TrainStats(every_n_steps=3)
    resumed.load_state_dict(saved)
    call_hook(resumed, "on_train_begin", iteration=4)
    call_hook(resumed, "on_epoch_begin")
    drive(resumed, model, range(5, 7))
    assert resumed.history == whole.history
    assert resumed.history[1]["samples_per_sec"] == 15 / 3  # steps 4-6, 3 s


def test_a_fresh_fit_clears_the_history():
    cb, model = TrainStats(every_n_steps=1), tiny_model()
    call_hook(cb, "on_train_begin", iteration=0)
    step(cb, model, 1.0, step=1)
    call_hook(cb, "on_train_begin", iteration=3)  # resumed: kept
    assert len(cb.history) == 1
    call_hook(cb, "on_train_begin", iteration=0)
    assert cb.history == []


# -- through fit -----------------------------------------------------------------
def test_through_fit_the_grad_norm_is_the_raw_one_before_clipping():
    stats, before = TrainStats(every_n_steps=7), GradSpy(order=-16)
    clip = GradientClipping(max_norm=0.01)
    train([stats, before, clip], epochs=2, mom=0.9)  # 7 steps per epoch
    assert [h["step"] for h in stats.history] == [7, 14]
    for report, norms in zip(stats.history, (before.norms[:7], before.norms[7:])):
        assert report["grad_norm"] == pytest.approx(sum(norms) / 7, rel=1e-5)
        assert report["grad_norm"] > 0.01  # not the clipped norm
        assert report["samples_per_sec"] > 0 and report["sec_per_step"] > 0


def test_through_fit_the_weight_norm_is_the_models_after_the_step():
    class WeightSpy(Callback):
        def on_batch_end(self, train, step, model):
            if train and step == 6:
                self.norm = flat_norm(list(model.parameters()))

    stats, spy = TrainStats(every_n_steps=6), WeightSpy()
    train([stats, spy], epochs=1, mom=0.9)
    assert stats.history[0]["weight_norm"] == pytest.approx(spy.norm, rel=1e-6)


def test_through_fit_with_accumulation_reports_follow_optimizer_steps():
    stats, spy = TrainStats(every_n_steps=2), GradSpy(order=-16)
    train([stats, spy, GradientAccumulation(3)], epochs=2, mom=0.9)
    assert [h["step"] for h in stats.history] == [2, 4, 6]
    assert len(spy.norms) == 6
    assert stats.history[0]["grad_norm"] == pytest.approx(sum(spy.norms[:2]) / 2)


def test_one_transfer_per_report_and_none_per_batch(sync_counter, frozen_clock):
    def count(n_train):
        before = sync_counter["n"]
        train([TrainStats(every_n_steps=4)], data=make_data(n_train=n_train), mom=0.9)
        return sync_counter["n"] - before

    few, many = count(64), count(256)  # 8 and 32 steps: 2 and 8 reports
    assert many - few == 6


# -- bad input -------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, -1, 1.5, True, "10", None])
def test_every_n_steps_must_be_a_positive_int(n):
    with pytest.raises(ValueError, match="TrainStats: every_n_steps must be an int"):
        TrainStats(every_n_steps=n)


def test_load_state_dict_refuses_another_dict():
    with pytest.raises(ValueError, match=r"TrainStats.load_state_dict.*history"):
        TrainStats().load_state_dict({"steps": 1})
