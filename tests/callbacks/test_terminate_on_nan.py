import math
import time

import pytest
import torch
from helpers import make_data, make_model, train
from torch.nn import functional as F  # noqa: N812

from fitlib import Callback, HPOptimizer, fit
from fitlib.callback import call_hook
from fitlib.callbacks.terminate_on_nan import TerminateOnNaN

STOP_NOW = {"stop_training": True, "skip_validate": True}


def stops(update, skip_validate=True):
    """Whether ``update`` stops training (its stop_reason aside)."""
    expected = STOP_NOW if skip_validate else {"stop_training": True}
    return update is not None and {**update, "stop_reason": None} == {
        **expected, "stop_reason": None
    }  # fmt: skip


@pytest.fixture
def clock(monkeypatch):
    """A clock the test sets by hand: clock["now"] is what perf_counter says."""
    clock = {"now": 0.0}
    monkeypatch.setattr(time, "perf_counter", lambda: clock["now"])
    return clock


def batch(cb, loss, iteration, epoch=0, num_batch=None, train=True):
    """Calls on_batch_end for one batch as the handler would."""
    return call_hook(
        cb,
        "on_batch_end",
        train=train,
        last_loss=torch.tensor(loss),
        iteration=iteration,
        epoch=epoch,
        num_batch=iteration if num_batch is None else num_batch,
    )


# -- scripted hooks --------------------------------------------------------------
def test_no_check_before_check_every_seconds_pass(clock):
    cb = TerminateOnNaN(check_every=1.0)
    call_hook(cb, "on_train_begin")
    for i, t in enumerate([0.1, 0.5, 0.99]):
        clock["now"] = t
        assert batch(cb, math.nan, i) is None
    assert cb.nan_iteration is None  # the NaN is pending, not yet seen
    clock["now"] = 1.0
    assert stops(batch(cb, 1.0, 3))
    assert cb.nan_iteration == 0


def test_the_check_reports_the_first_bad_loss_among_several(clock, capsys):
    cb = TerminateOnNaN(check_every=2.0)
    call_hook(cb, "on_train_begin")
    losses = [1.0, 0.5, math.inf, math.nan, 0.2, -math.inf]
    for i, loss in enumerate(losses):
        assert batch(cb, loss, iteration=10 + i, epoch=1, num_batch=3 + i) is None
    clock["now"] = 2.5
    assert stops(batch(cb, 0.1, iteration=16, epoch=1, num_batch=9))
    assert (cb.nan_iteration, cb.nan_epoch, cb.nan_batch) == (12, 1, 5)
    assert cb.nan_loss == math.inf
    assert cb.stop_iteration == 16
    line = capsys.readouterr().err.strip()
    assert "\n" not in line
    assert "loss was inf at iteration 12 (epoch 1, batch 5)" in line
    assert "stopped after iteration 16" in line
    assert "every 2 s and at each epoch end" in line


def test_epoch_end_always_checks_and_does_not_skip_validation(clock, capsys):
    cb = TerminateOnNaN(check_every=60.0)
    call_hook(cb, "on_train_begin")
    assert batch(cb, 1.0, 0) is None
    assert batch(cb, math.nan, 1) is None
    assert batch(cb, 2.0, 2) is None
    # Validation ran already: only stop_training, and the last batch was 2.
    assert stops(call_hook(cb, "on_epoch_end", iteration=3), skip_validate=False)
    assert (cb.nan_iteration, cb.nan_batch, cb.stop_iteration) == (1, 1, 2)
    assert math.isnan(cb.nan_loss)
    assert "stopped after iteration 2" in capsys.readouterr().err


def test_finite_losses_never_stop_training(clock):
    cb = TerminateOnNaN(check_every=0)
    call_hook(cb, "on_train_begin")
    assert all(batch(cb, float(i), i) is None for i in range(5))
    assert call_hook(cb, "on_epoch_end", iteration=5) is None
    assert cb.nan_iteration is None and cb.stop_iteration is None


def test_validation_losses_are_not_checked(clock):
    cb = TerminateOnNaN(check_every=0)
    call_hook(cb, "on_train_begin")
    assert batch(cb, math.nan, 0, train=False) is None
    assert call_hook(cb, "on_epoch_end", iteration=0) is None
    assert cb.nan_iteration is None


def test_check_every_zero_stops_at_the_bad_batch_itself(clock):
    cb = TerminateOnNaN(check_every=0)
    call_hook(cb, "on_train_begin")
    assert batch(cb, 1.0, 0) is None
    assert stops(batch(cb, math.nan, 1))
    assert cb.nan_iteration == cb.stop_iteration == 1


def test_only_the_first_bad_loss_is_reported(clock, capsys):
    cb = TerminateOnNaN(check_every=0)
    call_hook(cb, "on_train_begin")
    assert stops(batch(cb, math.nan, 0))
    assert batch(cb, math.inf, 1) is None  # e.g. another callback kept going
    assert call_hook(cb, "on_epoch_end", iteration=2) is None
    assert cb.nan_iteration == 0
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_on_train_begin_forgets_the_previous_fit(clock):
    cb = TerminateOnNaN(check_every=10.0)
    call_hook(cb, "on_train_begin")
    batch(cb, 1.0, 0)
    call_hook(cb, "on_epoch_end", iteration=1)
    batch(cb, math.nan, 1)  # pending when the fit ended
    clock["now"] = 5.0
    call_hook(cb, "on_train_begin")  # the clock restarts at 5.0
    clock["now"] = 14.0
    assert batch(cb, 1.0, 0) is None  # 9 s since the new start: no check
    assert call_hook(cb, "on_epoch_end", iteration=1) is None  # the NaN is gone

    cb2 = TerminateOnNaN(check_every=0)
    call_hook(cb2, "on_train_begin")
    batch(cb2, math.nan, 0)
    call_hook(cb2, "on_train_begin")
    assert cb2.nan_iteration is cb2.nan_loss is cb2.stop_iteration is None


# -- through fit -----------------------------------------------------------------
class NaNFrom:
    """cross_entropy, but NaN from the k-th training call on (0-based)."""

    def __init__(self, k):
        self.k, self.train_calls = k, 0

    def __call__(self, out, y):
        loss = F.cross_entropy(out, y)
        if not torch.is_grad_enabled():  # validation
            return loss
        self.train_calls += 1
        return loss * math.nan if self.train_calls > self.k else loss


class CountValidation(Callback):
    def __init__(self):
        self.valid_batches = 0

    def on_batch_end(self, train):
        self.valid_batches += not train


def test_fit_stops_right_after_the_first_nan_loss_when_checking_every_batch():
    loss_func, cb, valid = NaNFrom(9), TerminateOnNaN(check_every=0), CountValidation()
    # 7 batches per epoch: step 9 is epoch 1, batch 2
    train([cb, valid], epochs=3, loss_func=loss_func)
    assert (cb.nan_iteration, cb.nan_epoch, cb.nan_batch) == (9, 1, 2)
    assert cb.stop_iteration == 9 and math.isnan(cb.nan_loss)
    assert loss_func.train_calls == 10  # no batch after the bad one
    assert valid.valid_batches == 3  # epoch 0 only: epoch 1's was skipped


def test_fit_with_a_frozen_clock_stops_at_the_epoch_end(monkeypatch):
    monkeypatch.setattr(time, "perf_counter", lambda: 1000.0)
    loss_func, cb = NaNFrom(9), TerminateOnNaN(check_every=1.0)
    train([cb], epochs=3, loss_func=loss_func)
    assert (cb.nan_iteration, cb.nan_epoch, cb.nan_batch) == (9, 1, 2)
    assert cb.stop_iteration == 13  # the rest of epoch 1 trained
    assert loss_func.train_calls == 14  # and no epoch 2


def test_its_stop_reason_names_the_bad_loss_and_where_it_was(clock):
    cb = TerminateOnNaN(check_every=2.0)
    call_hook(cb, "on_train_begin")
    for i, loss in enumerate([1.0, math.inf, math.nan]):
        batch(cb, loss, iteration=10 + i, epoch=1, num_batch=3 + i)
    clock["now"] = 2.5
    reason = "TerminateOnNaN: training loss was inf at iteration 11 (epoch 1, batch 4)"
    assert batch(cb, 0.1, iteration=13, epoch=1, num_batch=6) == {
        **STOP_NOW, "stop_reason": reason
    }  # fmt: skip
    assert cb.stop_reason == reason
    other = TerminateOnNaN(check_every=60.0)  # found at the epoch end
    call_hook(other, "on_train_begin")
    batch(other, math.nan, iteration=0)
    update = call_hook(other, "on_epoch_end", iteration=1)
    where = "training loss was nan at iteration 0 (epoch 0, batch 0)"
    assert update == {"stop_training": True, "stop_reason": f"TerminateOnNaN: {where}"}


def test_through_fit_the_history_says_which_loss_was_not_finite():
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    cb = TerminateOnNaN(check_every=0)
    history = fit(3, model, NaNFrom(9), opt, make_data(), [cb])
    assert history.stop_reason == (
        "TerminateOnNaN: training loss was nan at iteration 9 (epoch 1, batch 2)"
    )
    assert cb.stop_reason == history.stop_reason


def test_fit_without_nan_runs_every_epoch():
    loss_func, cb = NaNFrom(10**6), TerminateOnNaN(check_every=0)
    train([cb], epochs=3, loss_func=loss_func)
    assert loss_func.train_calls == 21
    assert cb.nan_iteration is None


# -- no host-device sync per batch -----------------------------------------------
@pytest.fixture
def sync_count(sync_counter, frozen_clock):
    """The suite's sync counter (conftest.py), with the clock frozen."""
    return sync_counter


def syncs_of_fit(counts, n_train, callbacks):
    before = counts["n"]
    train(
        callbacks, epochs=2, data=make_data(n_train=n_train), loss_func=F.cross_entropy
    )
    return counts["n"] - before


def syncs_of_callback(counts, n_train, check_every):
    """The syncs a fit makes with TerminateOnNaN, less those it makes without
    (the DataLoader's shuffling reads a few values per epoch)."""
    baseline = syncs_of_fit(counts, n_train, [])
    return syncs_of_fit(counts, n_train, [TerminateOnNaN(check_every)]) - baseline


def test_the_per_batch_path_does_not_sync(sync_count):
    few = syncs_of_callback(sync_count, 64, check_every=1.0)  # 4 batches an epoch
    many = syncs_of_callback(sync_count, 256, check_every=1.0)  # 16 an epoch
    assert few == many == 2  # the one transfer of each epoch end


def test_check_every_zero_syncs_once_per_batch(sync_count):
    few = syncs_of_callback(sync_count, 64, check_every=0)
    many = syncs_of_callback(sync_count, 256, check_every=0)
    assert (few, many) == (2 * 4, 2 * 16)  # the counter sees a per-batch check


# -- bad input -------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-1, -0.5, math.nan, "1", None, True])
def test_check_every_that_is_not_a_number_of_seconds_is_rejected(bad):
    with pytest.raises(ValueError, match=r"check_every must be.*>= 0; got.*Fix"):
        TerminateOnNaN(check_every=bad)


def test_check_every_inf_checks_only_at_epoch_ends(clock, capsys):
    cb = TerminateOnNaN(check_every=math.inf)
    call_hook(cb, "on_train_begin")
    clock["now"] = 1e9
    assert batch(cb, math.nan, 0) is None
    assert stops(call_hook(cb, "on_epoch_end", iteration=1), skip_validate=False)
    assert "checked at each epoch end" in capsys.readouterr().err


# -- several processes -------------------------------------------------------------
@pytest.fixture
def two_ranks(monkeypatch):
    """This process as rank 1 of 2; rank 0's side of each check is scripted:
    script["rank0"] is what rank 0 says (its first bad loss or None, its pace)."""
    from fitlib import ranks

    script = {"rank0": (None, 3.0), "checks": []}

    def gather(obj):
        script["checks"].append(obj)
        return [script["rank0"], obj]

    monkeypatch.setattr(ranks, "world_size", lambda: 2)
    monkeypatch.setattr(ranks, "rank", lambda: 1)
    monkeypatch.setattr(ranks, "gather_to_all", gather)
    return script


def test_ranks_check_at_the_iterations_rank_0_paces(clock, two_ranks):
    cb = TerminateOnNaN(check_every=1.0)
    call_hook(cb, "on_train_begin", iteration=0)
    for i in range(8):
        clock["now"] += 10.0  # this rank's clock would check every batch
        assert batch(cb, 1.0, i) is None
    # After the first batch, then every 3 batches: rank 0's pace, not ours.
    assert len(two_ranks["checks"]) == 3


def test_every_rank_stops_when_one_has_a_bad_loss(clock, two_ranks, capsys):
    cb = TerminateOnNaN(check_every=1.0)
    call_hook(cb, "on_train_begin", iteration=0)
    assert batch(cb, 1.0, 0) is None
    two_ranks["rank0"] = ((math.inf, 2, 0, 2), 3.0)  # rank 0's loss at iteration 2
    assert batch(cb, 1.0, 1) is None
    assert batch(cb, 1.0, 2) is None
    assert stops(batch(cb, 1.0, 3))  # the agreed check: this rank stops too
    assert (cb.nan_loss, cb.nan_iteration, cb.stop_iteration) == (math.inf, 2, 3)
    assert capsys.readouterr().err == ""  # rank 0 says it, once


def test_the_epoch_end_check_is_agreed_too(clock, two_ranks):
    cb = TerminateOnNaN(check_every=math.inf)
    call_hook(cb, "on_train_begin", iteration=0)
    for i in range(4):
        batch(cb, 1.0, i)
    two_ranks["rank0"] = ((math.nan, 3, 0, 3), math.inf)
    assert stops(call_hook(cb, "on_epoch_end", iteration=4), skip_validate=False)
    assert cb.nan_iteration == 3
