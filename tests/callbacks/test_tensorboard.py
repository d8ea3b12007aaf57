import copy
import sys
import time

import pytest
import torch
from helpers import make_data, make_model, scripted_record, train
from torch import nn
from torch.nn import functional as F  # noqa: N812

pytest.importorskip(
    "tensorboard",
    reason="tensorboard is not installed (pip install fitlib[tensorboard], or "
    "the dev extra)",
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

from fitlib import Callback, DataBunch, HPOptimizer, fit
from fitlib.callback import call_hook
from fitlib.callbacks import OneCycleScheduler, Recorder
from fitlib.callbacks.tensorboard import TensorBoardLogger
from fitlib.metrics import Metrics, accuracy


# -- reading the event files back ----------------------------------------------
def read_run(log_dir):
    """The scalars {tag: [(step, value)]} and the hparams ({} if none)."""
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {
        tag: [(e.step, e.value) for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }
    try:
        contents = acc.PluginTagToContent("hparams")
    except KeyError:
        return scalars, {}, []
    start = HParamsPluginData.FromString(contents["_hparams_/session_start_info"])
    hparams = {
        name: getattr(value, value.WhichOneof("kind"))
        for name, value in start.session_start_info.hparams.items()
    }
    experiment = HParamsPluginData.FromString(contents["_hparams_/experiment"])
    metric_tags = [m.name.tag for m in experiment.experiment.metric_infos]
    return scalars, hparams, metric_tags


def next_second():
    """Waits for the next second of the clock before a resumed writer opens.

    TensorBoard reads a run's event files in the order of their names, which
    start with the second they were made in: a resume in a new process comes
    seconds later, but a test resumes at once.
    """
    second = int(time.time())
    while int(time.time()) == second:
        time.sleep(0.01)


def steps(points):
    return [step for step, _ in points]


def values(points):
    return [value for _, value in points]


# -- scripted hooks ------------------------------------------------------------
def begin(tb, **state):
    model = nn.Linear(2, 2)
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, mom=0.9, wd=1e-4)
    call_hook(
        tb,
        "on_train_begin",
        model=model,
        opt=opt,
        metrics=Metrics([accuracy]),
        n_epochs=1,
        **state,
    )
    return opt


def batch(tb, opt, loss, size, step, train=True):
    call_hook(
        tb,
        "on_batch_end",
        train=train,
        step=step,
        opt=opt,
        last_loss=torch.tensor(loss),
        last_target=torch.zeros(size),
        last_input=torch.zeros(size, 2),
    )


def test_scripted_epoch_writes_interval_means_and_epoch_scalars(tmp_path):
    tb = TensorBoardLogger(tmp_path, every_n_steps=2)
    opt = begin(tb)
    call_hook(tb, "on_epoch_begin")
    for loss, size, step in [(1.0, 4, 1), (2.0, 4, 2), (6.0, 2, 3)]:
        batch(tb, opt, loss, size, step)
    batch(tb, opt, 99.0, 5, 3, train=False)  # validation: not a training loss
    last_metrics = [torch.tensor(0.5), torch.tensor(0.75)]
    record = scripted_record([1.0, 2.0, 6.0], [4, 4, 2], last_metrics, ["accuracy"])
    call_hook(tb, "on_epoch_end", epoch=0, step=3, record=record)
    call_hook(tb, "on_train_end", step=3, epoch=1, opt=opt)
    scalars, hparams, metric_tags = read_run(tmp_path)
    # (4*1 + 4*2) / 8 at step 2; the clean end writes the rest at step 3.
    assert scalars["step/loss"] == [(2, 1.5), (3, 6.0)]
    assert scalars["step/lr"] == [(2, pytest.approx(0.1)), (3, pytest.approx(0.1))]
    assert scalars["epoch/train_loss"] == [(3, pytest.approx(2.4))]  # weighted
    assert scalars["epoch/valid_loss"] == [(3, 0.5)]
    assert scalars["epoch/accuracy"] == [(3, 0.75)]
    assert scalars["epoch/epoch"] == [(3, 0.0)]
    assert set(scalars) >= {"epoch/lr", "epoch/time"}
    assert hparams == {
        "lr": pytest.approx(0.1),
        "mom": pytest.approx(0.9),
        "wd": pytest.approx(1e-4),
        "batch_size": 4,
        "epochs": 1,
        "optimizer": "SGD",
        "model": "Linear",
    }
    assert metric_tags == ["epoch/train_loss", "epoch/valid_loss", "epoch/accuracy"]
    assert tb.writer is None  # closed


def test_batches_without_a_step_join_the_next_point(tmp_path):
    tb = TensorBoardLogger(tmp_path, every_n_steps=1)
    opt = begin(tb)
    # Gradient accumulation over 2 batches: the step count moves every other batch.
    for loss, step in [(1.0, 0), (3.0, 1), (5.0, 1), (7.0, 2)]:
        batch(tb, opt, loss, 2, step)
    call_hook(tb, "on_train_end", exception=RuntimeError("stop"), step=2)
    scalars, _, _ = read_run(tmp_path)
    assert scalars["step/loss"] == [(1, 2.0), (2, 6.0)]  # one point per step


def test_skipped_validation_writes_no_valid_loss_or_metrics(tmp_path):
    tb = TensorBoardLogger(tmp_path)
    opt = begin(tb)
    batch(tb, opt, 1.0, 2, 1)
    record = scripted_record([1.0], [2], None, ["accuracy"])
    call_hook(tb, "on_epoch_end", epoch=0, step=1, record=record)
    call_hook(tb, "on_train_end", step=1, epoch=1, opt=opt)
    scalars, _, metric_tags = read_run(tmp_path)
    assert "epoch/valid_loss" not in scalars and "epoch/accuracy" not in scalars
    assert scalars["epoch/train_loss"] == [(1, 1.0)]
    assert metric_tags == ["epoch/train_loss"]


def test_state_dict_is_plain_and_round_trips(tmp_path):
    tb = TensorBoardLogger(tmp_path, every_n_steps=5)
    opt = begin(tb)
    batch(tb, opt, 1.0, 4, 1)
    batch(tb, opt, 2.0, 2, 2)
    state = tb.state_dict()  # reads the unread losses: one transfer

    def plain(v):
        if isinstance(v, (list, dict)):
            items = v.values() if isinstance(v, dict) else v
            return all(plain(o) for o in items)
        return v is None or isinstance(v, (int, float, str))

    assert all(plain(v) for v in state.values())
    assert state["interval"] == [8.0, 6] and "epoch_sums" not in state  # loop's
    restored = TensorBoardLogger(tmp_path / "other")
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    call_hook(tb, "on_train_end", exception=RuntimeError("stop"), step=2)


def test_resume_from_a_state_saved_before_the_point_writes_each_step_once(tmp_path):
    tb = TensorBoardLogger(tmp_path, every_n_steps=3)
    opt = begin(tb)
    for step in range(1, 6):
        batch(tb, opt, float(step), 1, step)
    state = tb.state_dict()  # a checkpoint at step 6, before the logger's hook
    for step in (6, 7, 8):  # the interrupted run goes on: writes the point at 6
        batch(tb, opt, float(step), 1, step)
    call_hook(tb, "on_train_end", exception=RuntimeError("killed"), step=8)

    next_second()
    tb = TensorBoardLogger(tmp_path, every_n_steps=3)
    tb.load_state_dict(state)
    opt = begin(tb, iteration=6, step=6)
    # Accumulation: the first batch after the resume takes no step.
    for loss, step in [(10.0, 6), (20.0, 7), (30.0, 8), (40.0, 9)]:
        batch(tb, opt, loss, 1, step)
    call_hook(tb, "on_train_end", exception=RuntimeError("stop"), step=9)
    scalars, _, _ = read_run(tmp_path)
    # 6 is kept from the interrupted run; 9 averages the resumed batches only.
    assert scalars["step/loss"] == [(3, 2.0), (6, 5.0), (9, 25.0)]


def test_load_state_dict_rejects_a_state_that_lacks_keys(tmp_path):
    state = TensorBoardLogger(tmp_path).state_dict()
    del state["interval"]
    with pytest.raises(ValueError, match=r"lacks \['interval'\]"):
        TensorBoardLogger(tmp_path).load_state_dict(state)


# -- through fit ---------------------------------------------------------------
def test_fit_writes_epoch_and_step_scalars_that_match_the_recorder(tmp_path):
    tb, rec = TensorBoardLogger(tmp_path, every_n_steps=3), Recorder()
    train([tb, rec], epochs=2, metrics=[accuracy], mom=0.9)  # 7 batches per epoch
    scalars, hparams, _ = read_run(tmp_path)
    assert steps(scalars["step/loss"]) == [3, 6, 9, 12, 14]  # 14: the clean end
    assert values(scalars["step/loss"])[1] == pytest.approx(
        sum(v * n for v, n in zip(rec.losses[3:6], rec.batch_sizes[3:6]))
        / sum(rec.batch_sizes[3:6])
    )
    for tag, expected in [
        ("epoch/train_loss", rec.train_losses),
        ("epoch/valid_loss", rec.valid_losses),
        ("epoch/accuracy", [m[0] for m in rec.metrics]),
        ("epoch/epoch", [0, 1]),
    ]:
        assert steps(scalars[tag]) == [7, 14]
        assert values(scalars[tag]) == pytest.approx(expected, rel=1e-6)
    assert hparams["epochs"] == 2 and hparams["batch_size"] == 16
    assert hparams["model"] == "Sequential" and hparams["mom"] == pytest.approx(0.9)


def test_hparams_lr_is_the_schedules_peak_and_step_lr_the_steps_lr(tmp_path):
    tb = TensorBoardLogger(tmp_path, every_n_steps=2, hparams={"dropout": 0.3})
    rec = Recorder()
    train([OneCycleScheduler(0.5), tb, rec], epochs=2, metrics=[accuracy], mom=0.9)
    scalars, hparams, _ = read_run(tmp_path)
    assert hparams["lr"] == pytest.approx(max(rec.lrs))
    assert hparams["dropout"] == pytest.approx(0.3)
    expected = [rec.lrs[step - 1] for step in steps(scalars["step/lr"])]
    assert values(scalars["step/lr"]) == pytest.approx(expected, rel=1e-6)


def test_a_second_fit_in_the_same_second_is_read_after_the_first(tmp_path, monkeypatch):
    # Event files of one second sort by a counter written as text: the 10th
    # writer's file (".10") sorts before the 9th's (".9"), and TensorBoard
    # would skip it. The second fit's file must still be read.
    from tensorboard.summary.writer import event_file_writer

    monkeypatch.setattr(
        event_file_writer, "_global_uid", event_file_writer.AtomicCounter(9)
    )
    tb = TensorBoardLogger(tmp_path, every_n_steps=5)
    model = train([tb], epochs=1, metrics=[accuracy], mom=0.9)
    train([tb], epochs=1, model=model, metrics=[accuracy], mom=0.9)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert [name.rsplit(".", 1)[-1] for name in files] == ["9", "10"], files
    scalars, _, _ = read_run(tmp_path)
    assert scalars["epoch/epoch"] == [(7, 0.0), (14, 1.0)]


def test_a_second_fit_continues_the_step_and_epoch_count(tmp_path):
    tb = TensorBoardLogger(tmp_path, every_n_steps=5)
    model = train([tb], epochs=1, metrics=[accuracy], mom=0.9)
    train([tb], epochs=2, model=model, metrics=[accuracy], mom=0.9)
    scalars, _, _ = read_run(tmp_path)
    assert scalars["epoch/epoch"] == [(7, 0.0), (14, 1.0), (21, 2.0)]
    assert steps(scalars["step/loss"]) == [5, 7, 10, 15, 20, 21]  # 7, 21: ends


def test_max_steps_ends_with_a_last_point_at_the_budget(tmp_path):
    tb = TensorBoardLogger(tmp_path, every_n_steps=4)
    train([tb], epochs=None, metrics=[accuracy], mom=0.9, max_steps=10)
    scalars, hparams, _ = read_run(tmp_path)
    assert steps(scalars["step/loss"]) == [4, 8, 10]
    assert hparams["max_steps"] == 10 and "epochs" not in hparams


class Crash(Callback):
    order = 60  # after the logger: its hooks of that batch ran

    def __init__(self, at_iteration):
        self.at = at_iteration

    def on_batch_end(self, train, iteration):
        if train and iteration == self.at:
            raise RuntimeError("killed")


def test_an_error_closes_the_writer_and_writes_no_hparams(tmp_path):
    tb = TensorBoardLogger(tmp_path, every_n_steps=2)
    with pytest.raises(RuntimeError, match="killed"):
        train([tb, Crash(at_iteration=4)], metrics=[accuracy], mom=0.9)
    assert tb.writer is None
    scalars, hparams, _ = read_run(tmp_path)
    assert steps(scalars["step/loss"]) == [2, 4]  # what was written is on disk
    assert hparams == {}


class Snapshot(Callback):
    """A stand-in for Checkpoint: saves after epoch `at`, before the logger."""

    order = -100

    def __init__(self, logger, at):
        self.logger, self.at, self.saved = logger, at, None

    def on_epoch_end(self, epoch, iteration, step, model, opt):
        if epoch == self.at:
            self.saved = {
                "model": copy.deepcopy(model.state_dict()),
                "opt": copy.deepcopy(opt.state_dict()),
                "rng": torch.get_rng_state(),
                "logger": self.logger.state_dict(),
                "position": {"epoch": epoch + 1, "iteration": iteration, "step": step},
            }


class Restore(Callback):
    order = -100

    def __init__(self, position):
        self.position = position

    def on_train_begin(self):
        return dict(self.position)


def test_a_resumed_run_shows_the_points_of_an_uninterrupted_one(tmp_path):
    data = make_data(shuffle=False)
    train(
        [TensorBoardLogger(tmp_path / "whole", 3)],
        epochs=3,
        data=data,
        metrics=[accuracy],
        mom=0.9,
    )
    tb = TensorBoardLogger(tmp_path / "resumed", 3)
    snap = Snapshot(tb, at=0)  # after step 7
    with pytest.raises(RuntimeError, match="killed"):
        train(
            [snap, tb, Crash(at_iteration=11)],
            epochs=3,
            data=data,
            metrics=[accuracy],
            mom=0.9,
        )
    crashed, _, _ = read_run(tmp_path / "resumed")
    assert steps(crashed["step/loss"]) == [3, 6, 9, 12]  # 9, 12: after the snapshot

    saved = snap.saved
    model = make_model()
    model.load_state_dict(saved["model"])
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, mom=0.9)
    opt.load_state_dict(saved["opt"])
    torch.set_rng_state(saved["rng"])
    tb = TensorBoardLogger(tmp_path / "resumed", 3)
    tb.load_state_dict(saved["logger"])
    next_second()
    callbacks = [Restore(saved["position"]), tb]
    fit(3, model, F.cross_entropy, opt, data, callbacks, [accuracy])

    whole, _, _ = read_run(tmp_path / "whole")
    resumed, hparams, _ = read_run(tmp_path / "resumed")
    assert resumed.keys() == whole.keys()
    for tag in whole.keys() - {"epoch/time"}:
        assert resumed[tag] == whole[tag], tag  # the same steps, once each
    assert steps(resumed["step/loss"]) == [3, 6, 9, 12, 15, 18, 21]
    assert hparams["mom"] == pytest.approx(0.9) and hparams["epochs"] == 3


# -- speed ---------------------------------------------------------------------
def count_syncs(counter, tmp_path, n_train, every):
    data = DataBunch(make_data(n_train).train_dl, make_data().valid_dl)
    before = counter["n"]
    train(
        [TensorBoardLogger(tmp_path / f"{n_train}", every)],
        data=data,
        metrics=[accuracy],
        mom=0.9,
    )
    return counter["n"] - before


def test_no_sync_per_batch_only_one_per_point(sync_counter, frozen_clock, tmp_path):
    few = count_syncs(sync_counter, tmp_path, 64, every=1000)  # 8 steps
    many = count_syncs(sync_counter, tmp_path, 256, every=1000)  # 32 steps
    assert few == many > 0
    few = count_syncs(sync_counter, tmp_path / "b", 64, every=4)  # points 4, 8
    many = count_syncs(sync_counter, tmp_path / "b", 256, every=4)  # 4 ... 32
    assert many - few == 8 - 2  # one host transfer per extra point


# -- bad input -----------------------------------------------------------------
@pytest.mark.parametrize("every", [0, -1, 2.5, True, "10"])
def test_every_n_steps_must_be_a_positive_int(tmp_path, every):
    with pytest.raises(
        ValueError, match=r"every_n_steps must be an int >= 1; got.*Fix"
    ):
        TensorBoardLogger(tmp_path, every_n_steps=every)


def test_log_dir_must_be_a_path_and_not_a_file(tmp_path):
    with pytest.raises(TypeError, match="log_dir must be a directory path"):
        TensorBoardLogger(123)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        TensorBoardLogger(tmp_path / "file")


def test_log_dir_that_cannot_be_created_fails_before_training(tmp_path):
    (tmp_path / "file").write_text("x")
    tb, rec = TensorBoardLogger(tmp_path / "file" / "run"), Recorder()
    with pytest.raises(ValueError, match="cannot be written to"):
        train([tb, rec], metrics=[accuracy], mom=0.9)
    assert rec.losses == []  # no batch ran


@pytest.mark.parametrize("hparams", [[("a", 1)], {"a": None}, {1: 2.0}])
def test_hparams_must_map_names_to_plain_values(tmp_path, hparams):
    with pytest.raises(TypeError, match="hparams must be a dict"):
        TensorBoardLogger(tmp_path, hparams=hparams)


def test_missing_tensorboard_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install fitlib\[tensorboard\]"):
        TensorBoardLogger(tmp_path)
