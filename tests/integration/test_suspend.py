"""The ``suspend`` state key: a fit ended before its end (a time limit), that
a ``Checkpoint`` resumes exactly, unlike ``stop_training``, which finishes;
and fit's caps on batches (``train_batches``, ``valid_batches``), which a
``Checkpoint`` resumes exactly too."""

import pytest
import torch
from helpers import Crash, resume_learner, same_weights
from torch.nn import functional as F  # noqa: N812

from fitlib import Callback, HPOptimizer, fit
from fitlib.callbacks import (
    Checkpoint,
    GradientAccumulation,
    OneCycleScheduler,
    Recorder,
)


class SuspendAt(Callback):
    """Suspends the fit at a training batch's end (``iteration``), or at the
    end of an epoch (``epoch``)."""

    def __init__(self, iteration=None, epoch=None):
        self.iteration, self.epoch = iteration, epoch

    def on_batch_end(self, iteration, train):
        if train and iteration == self.iteration:
            return {"suspend": True, "stop_reason": "time is up"}

    def on_epoch_end(self, epoch):
        if epoch == self.epoch:
            return {"suspend": True, "stop_reason": "time is up"}


# An epoch is 7 batches (iterations 0-6 in epoch 0). At its last batch the fit
# suspends before the epoch's validation: the resumed run validates it.
@pytest.mark.parametrize(
    "where, accumulate, recorded",
    [({"iteration": 9}, 1, [0]), ({"epoch": 1}, 1, [0, 1]),
     ({"iteration": 6}, 1, []), ({"iteration": 8}, 4, [0])],
    ids=str,
)  # fmt: skip
def test_a_suspended_fit_resumes_exactly_and_keeps_no_partial_record(
    tmp_path, where, accumulate, recorded
):
    extra = [GradientAccumulation(accumulate)]
    learn = resume_learner([Checkpoint(tmp_path), SuspendAt(**where), *extra])
    history = learn.fit_one_cycle(3, 0.1)
    assert history.stop_reason == "time is up" and history.suspended
    assert [r["epoch"] for r in history] == recorded  # none for a partial epoch
    resumed = resume_learner([Checkpoint(tmp_path), *extra])
    rest = resumed.fit_one_cycle(3, 0.1)
    assert rest.stop_reason is None and rest[-1]["epoch"] == 2
    assert not rest.suspended
    unbroken = resume_learner(extra)
    whole = unbroken.fit_one_cycle(3, 0.1)
    assert same_weights(resumed, unbroken)
    assert resumed.recorder.losses == unbroken.recorder.losses
    assert [r["valid_loss"] for r in history + rest] == [r["valid_loss"] for r in whole]


def test_inside_a_gradient_group_the_fit_suspends_at_the_groups_end(tmp_path):
    seen = []

    class Watch(Callback):
        order = 100

        def on_train_end(self, iteration, step):
            seen.append((iteration, step))

    learn = resume_learner([SuspendAt(iteration=5), GradientAccumulation(4), Watch()])
    learn.fit(2, lr=0.1)
    assert seen == [(7, 2)]  # groups of batches 0-3 and 4-6 (the ragged last)


def test_stop_training_finishes_the_run_where_suspend_leaves_it_open(tmp_path):
    class Stop(Callback):
        def on_epoch_end(self, epoch):
            if epoch == 0:
                return {"stop_training": True}

    stopped = resume_learner([Checkpoint(tmp_path / "a"), Stop()]).fit(3, lr=0.1)
    assert stopped.stop_reason == "Stop stopped training" and not stopped.suspended
    rerun = resume_learner([Checkpoint(tmp_path / "a")]).fit(3, lr=0.1)
    assert len(rerun) == 0 and not rerun.suspended  # finished: no requeue
    assert rerun.stop_reason.endswith("already finished")
    resume_learner([Checkpoint(tmp_path / "b"), SuspendAt(epoch=0)]).fit(3, lr=0.1)
    assert len(resume_learner([Checkpoint(tmp_path / "b")]).fit(3, lr=0.1)) == 2


# -- caps on batches, with a Checkpoint -----------------------------------------------
def capped_fit(tmp_path, callbacks=(), train_batches=4):
    """fit with 1cycle over 3 epochs of the first 4 (of 7) batches, 2 of 3
    validation batches; returns the model and the Recorder."""
    learn = resume_learner()  # (its model, data and seed)
    recorder = Recorder()
    opt = HPOptimizer(learn.model.parameters(), torch.optim.SGD, lr=0.1)
    cbs = [OneCycleScheduler(max_lr=0.1), recorder, *callbacks]
    fit(3, learn.model, F.cross_entropy, opt, learn.data, cbs,
        train_batches=train_batches, valid_batches=2)  # fmt: skip
    return learn.model, recorder


def test_a_capped_run_crashed_mid_epoch_resumes_exactly(tmp_path):
    model, rec = capped_fit(tmp_path)
    for crash in (5, 9, None):  # inside epoch 1, then at epoch 2's first batch
        extra = [Crash(crash)] if crash is not None else []
        try:
            resumed, rrec = capped_fit(
                tmp_path, [Checkpoint(tmp_path, every_n_steps=1), *extra]
            )
        except RuntimeError:
            assert crash is not None
    assert len(rec.losses) == 12 and rrec.losses == rec.losses
    assert rrec.valid_losses == rec.valid_losses and len(rrec.lrs) == 12
    pairs = zip(model.state_dict().values(), resumed.state_dict().values())
    assert all(torch.equal(a, b) for a, b in pairs)


def test_a_capped_and_suspended_run_resumes_exactly(tmp_path):
    model, rec = capped_fit(tmp_path)
    capped_fit(tmp_path, [Checkpoint(tmp_path), SuspendAt(iteration=5)])
    resumed, rrec = capped_fit(tmp_path, [Checkpoint(tmp_path)])
    assert rrec.losses == rec.losses and rrec.valid_losses == rec.valid_losses
    pairs = zip(model.state_dict().values(), resumed.state_dict().values())
    assert all(torch.equal(a, b) for a, b in pairs)


def test_another_cap_is_another_run_for_a_checkpoint(tmp_path):
    capped_fit(tmp_path, [Checkpoint(tmp_path), SuspendAt(iteration=5)])
    with pytest.raises(ValueError, match=r"batches per epoch .*: the checkpoint's "
                       r"run 4, this run 5"):  # fmt: skip
        capped_fit(tmp_path, [Checkpoint(tmp_path)], train_batches=5)


def test_a_stop_in_the_batch_that_suspends_finishes_the_run_with_its_reason(tmp_path):
    # max_steps is reached at the batch the time runs out: the run finishes,
    # validates as max_steps says, and its checkpoint is a finished one.
    learn = resume_learner([Checkpoint(tmp_path), SuspendAt(iteration=3)])
    history = learn.fit(None, lr=0.1, max_steps=4)
    assert history.stop_reason == "max_steps=4 reached" and not history.suspended
    assert len(history) == 1  # the epoch's validation ran
    assert (
        len(resume_learner([Checkpoint(tmp_path)]).fit(None, lr=0.1, max_steps=4)) == 0
    )
    # A suspend inside a gradient group, then max_steps at the group's end.
    seen = resume_learner([SuspendAt(iteration=1), GradientAccumulation(4)])
    history = seen.fit(None, lr=0.1, max_steps=1)
    assert history.stop_reason == "max_steps=1 reached" and not history.suspended
