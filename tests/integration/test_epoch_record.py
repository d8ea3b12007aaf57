"""The epoch record through fit: one transfer, values added by name (training
metrics, loss parts, a callback's), every consumer, a resumed run."""

import csv
import logging
import math

import pytest
import torch
from helpers import Crash, make_data, make_model
from torch.nn import functional as F  # noqa: N812

from fitlib import Callback, HPOptimizer, Learner, fit
from fitlib.callbacks import (
    Checkpoint,
    CSVLogger,
    EarlyStopping,
    ProgressBar,
    Recorder,
    ReduceLROnPlateau,
    TensorBoardLogger,
    TextLogger,
)
from fitlib.metrics import accuracy


def sgd(model, lr=0.1):
    return HPOptimizer(model.parameters(), torch.optim.SGD, lr=lr, mom=0.9)


def parts_loss(out, y):
    """Cross-entropy plus a small penalty, with both parts reported."""
    ce = F.cross_entropy(out, y)
    penalty = 0.01 * out.pow(2).mean()
    return {"loss": ce + penalty, "ce": ce, "penalty": penalty}


class GradNorm(Callback):
    """A user's value: the epoch's mean gradient norm, summed on the device."""

    record_names = ("grad_norm",)

    def on_epoch_begin(self):
        self.total, self.n = None, 0

    def on_backward_end(self, model):
        norm = torch.linalg.vector_norm(
            torch.stack([p.grad.norm() for p in model.parameters()])
        )
        self.total = norm if self.total is None else self.total + norm
        self.n += 1

    def on_epoch_end(self):
        return {"record": {"grad_norm": self.total / self.n}}


# -- one host transfer -----------------------------------------------------------
class Mark(Callback):
    """Notes the sync count after each validation batch (the last one stays)."""

    order = -1000

    def __init__(self, counter):
        self.counter, self.mark = counter, None

    def on_batch_end(self, train):
        if not train:
            self.mark = self.counter["n"]


class Count(Callback):
    """After every other on_epoch_end: the syncs since the last validation batch."""

    order = 1000

    def __init__(self, counter, mark):
        self.counter, self.mark, self.counts = counter, mark, []

    def on_epoch_end(self):
        self.counts.append(self.counter["n"] - self.mark.mark)


def test_an_epoch_end_costs_one_host_transfer_for_every_consumer(
    sync_counter, frozen_clock, tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger="fitlib")
    mark = Mark(sync_counter)
    count = Count(sync_counter, mark)
    learn = Learner(make_data(), make_model(), F.cross_entropy, torch.optim.SGD,
                    metrics=[accuracy], progress=True)  # fmt: skip
    callbacks = [
        EarlyStopping(patience=5),
        ReduceLROnPlateau(patience=5),
        CSVLogger(tmp_path / "log.csv"),
        TextLogger(every_n_steps=None),
        mark,
        count,
    ]
    learn.fit(3, lr=0.1, callbacks=callbacks)
    # Recorder, ProgressBar, EarlyStopping, ReduceLROnPlateau, CSVLogger and
    # TextLogger each read their values themselves before: six transfers.
    assert count.counts == [1, 1, 1]
    assert len(read_csv(tmp_path / "log.csv")) == 4 and len(caplog.records) == 3


# -- the record ------------------------------------------------------------------
def test_fit_returns_the_history_of_records_and_the_recorder_keeps_every_fit():
    model, rec = make_model(), Recorder()
    data = make_data()
    history = fit(2, model, F.cross_entropy, sgd(model), data, [rec], [accuracy])
    assert [list(r) for r in history] == [
        ["epoch", "train_loss", "valid_loss", "accuracy", "lr", "time"]
    ] * 2
    assert [r["epoch"] for r in history] == [0, 1]
    assert all(type(v) in (int, float) for r in history for v in r.values())
    again = fit(1, model, F.cross_entropy, sgd(model), data, [rec], [accuracy])
    assert len(again) == 1 and again[0]["epoch"] == 0
    table = rec.epoch_table()
    assert [r["epoch"] for r in table] == [0, 1, 2]  # counted across fits
    assert [r["valid_loss"] for r in table] == [
        r["valid_loss"] for r in [*history, *again]
    ]


def test_learner_fit_returns_its_history():
    learn = Learner(make_data(), make_model(), F.cross_entropy, torch.optim.SGD,
                    metrics=[accuracy], progress=False)  # fmt: skip
    history = learn.fit(2, lr=0.1)
    assert len(history) == 2
    assert history[-1]["accuracy"] == learn.recorder.epoch_table()[-1]["accuracy"]
    assert history[-1]["lr"] == 0.1


def test_training_metrics_accumulate_over_the_training_batches():
    class Spy(Callback):
        def on_epoch_begin(self):
            self.right, self.n = 0, 0

        def on_batch_end(self, train, last_output, last_target):
            if train:
                self.right += int((last_output.argmax(1) == last_target).sum())
                self.n += len(last_target)

    model, spy = make_model(), Spy()
    history = fit(2, model, F.cross_entropy, sgd(model), make_data(), [spy],
                  [accuracy], train_metrics=[accuracy])  # fmt: skip
    assert history[-1]["train_accuracy"] == pytest.approx(spy.right / spy.n)
    assert list(history[-1])[:5] == [
        "epoch", "train_loss", "valid_loss", "accuracy", "train_accuracy",
    ]  # fmt: skip


def test_a_training_metric_that_fails_on_training_batches_names_itself():
    def column_accuracy(out, y):  # wants (N, 1) targets
        return (out.argmax(1) == y[:, 0]).float().mean()

    class Batches(Callback):
        n = 0

        def on_batch_begin(self, train):
            Batches.n += train

    model = make_model()
    with pytest.raises(Exception, match="column_accuracy") as info:
        fit(2, model, F.cross_entropy, sgd(model), make_data(), [Batches()],
            train_metrics=[column_accuracy])  # fmt: skip
    assert Batches.n == 1, info.value  # at the first batch


def test_train_metrics_that_are_not_a_list_are_refused_by_name():
    model = make_model()
    with pytest.raises(TypeError, match="train_metrics must be a list"):
        fit(1, model, F.cross_entropy, sgd(model), make_data(),
            train_metrics=accuracy)  # fmt: skip
    with pytest.raises(TypeError, match="metrics must be a list"):
        Learner(make_data(), model, F.cross_entropy, train_metrics=accuracy)


def test_loss_parts_are_averaged_per_sample_for_training_and_validation():
    class Parts(Callback):
        def on_epoch_begin(self):
            self.sums = {"train": [0.0, 0], "valid": [0.0, 0]}

        def on_batch_end(self, train, last_loss_parts, last_target):
            sums = self.sums["train" if train else "valid"]
            sums[0] += float(last_loss_parts["ce"]) * len(last_target)
            sums[1] += len(last_target)

    model, spy = make_model(), Parts()
    history = fit(1, model, parts_loss, sgd(model), make_data(), [spy])
    record = history[0]
    assert list(record) == [
        "epoch", "train_loss", "valid_loss", "train_ce", "train_penalty",
        "valid_ce", "valid_penalty", "lr", "time",
    ]  # fmt: skip
    for phase in ("train", "valid"):
        total, n = spy.sums[phase]
        assert record[f"{phase}_ce"] == pytest.approx(total / n, rel=1e-6)
        assert record[f"{phase}_ce"] + record[f"{phase}_penalty"] == pytest.approx(
            record[f"{phase}_loss"], rel=1e-6
        )
    learn = Learner(make_data(), model, parts_loss, progress=False, metrics=[])
    assert learn.validate()["valid_ce"] == pytest.approx(record["valid_ce"])


@pytest.mark.parametrize(
    ("loss", "match"),
    [
        (lambda o, y: {"ce": F.cross_entropy(o, y)}, r"no 'loss'.*\{\"loss\": total"),
        (
            lambda o, y: {"loss": F.cross_entropy(o, y), "per": o.mean(1)},
            r"part 'per'.*tensor of one value",
        ),
    ],
)
def test_a_loss_dict_without_loss_or_with_a_non_scalar_part_says_what_it_needs(
    loss, match
):
    model = make_model()
    with pytest.raises(ValueError, match=match):
        fit(1, model, loss, sgd(model), make_data())


# -- values a callback adds ------------------------------------------------------
def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_a_callbacks_value_reaches_every_consumer(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="fitlib")
    learn = Learner(make_data(), make_model(), F.cross_entropy, torch.optim.SGD,
                    metrics=[accuracy], progress=True)  # fmt: skip
    bar = ProgressBar(bars=False)
    tb = TensorBoardLogger(tmp_path / "tb")
    stop = EarlyStopping("grad_norm", mode="min", patience=9)
    plateau = ReduceLROnPlateau("grad_norm", mode="min", patience=9)
    ckpt = Checkpoint(tmp_path / "ckpt", monitor="grad_norm", mode="min")
    learn.progress = False  # the bar below, to read its rows
    history = learn.fit(
        2,
        lr=0.1,
        callbacks=[
            GradNorm(), bar, tb, stop, plateau, ckpt,
            CSVLogger(tmp_path / "log.csv"), TextLogger(every_n_steps=None),
        ],
    )  # fmt: skip
    norms = [r["grad_norm"] for r in history]
    assert all(n > 0 for n in norms)
    assert bar.rows[0] == ["epoch", "train_loss", "valid_loss", "accuracy",
                           "grad_norm", "time"]  # fmt: skip
    assert [float(r[4]) for r in bar.rows[1:]] == pytest.approx(norms, rel=1e-5)
    assert [r["grad_norm"] for r in learn.recorder.epoch_table()] == norms
    rows = read_csv(tmp_path / "log.csv")
    assert rows[0][4] == "grad_norm"
    assert [float(r[4]) for r in rows[1:]] == norms
    assert "grad_norm" in caplog.records[-1].getMessage()
    assert stop.monitor.best == min(norms) and plateau.monitor.best == min(norms)
    saved = torch.load(tmp_path / "ckpt" / "best.pth", weights_only=True)
    assert saved["monitor"]["best"] == min(norms)
    axes = learn.recorder.plot_metrics()
    assert [ax.get_ylabel() for ax in axes] == ["accuracy", "grad_norm"]
    tb_scalars = tb_tags(tmp_path / "tb")
    assert "epoch/grad_norm" in tb_scalars


def tb_tags(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return acc.Tags()["scalars"]


class Adds(Callback):
    record_names = ("x",)

    def __init__(self, values, event="on_epoch_end"):
        self.values = values
        setattr(self, event, self._add)

    def _add(self, **kwargs):
        return {"record": self.values}


class AddsAtEpochEnd(Callback):
    record_names = ("x",)

    def __init__(self, values):
        self.values = values

    def on_epoch_end(self):
        return {"record": self.values}


@pytest.mark.parametrize(
    ("values", "error", "match"),
    [
        ({"valid_loss": 1.0}, ValueError, r"AddsAtEpochEnd.*'valid_loss'.*already"),
        ({"x": torch.ones(3)}, ValueError, r"AddsAtEpochEnd.*'x'.*one number"),
        ({"x": "high"}, ValueError, r"AddsAtEpochEnd.*'x'.*one number"),
        ({"y": 1.0}, ValueError, r"AddsAtEpochEnd.*'y'.*without declaring"),
        ([1.0], TypeError, r"AddsAtEpochEnd.*record=.*dict"),
    ],
)
def test_a_bad_added_value_is_refused_naming_the_callback_and_the_name(
    values, error, match
):
    model = make_model()
    with pytest.raises(error, match=match):
        fit(1, model, F.cross_entropy, sgd(model), make_data(),
            [AddsAtEpochEnd(values)])  # fmt: skip


@pytest.mark.parametrize(
    ("names", "order", "error", "match"),
    [
        ("grad_norm", 0, TypeError, r"Late.record_names must be a tuple.*comma"),
        (("valid_loss",), 0, ValueError, r"'valid_loss'.*the loop already adds"),
        (("x",), 70, ValueError, r"Late adds \['x'\].*order 70.*below 40"),
    ],
)
def test_record_names_are_checked_before_training(names, order, error, match):
    class Late(Callback):
        record_names = names

    Late.order = order
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(error, match=match):
        fit(1, model, F.cross_entropy, sgd(model), make_data(), [Late()])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_two_callbacks_declaring_one_name_are_refused():
    class A(Callback):
        record_names = ("x",)

    class B(Callback):
        record_names = ("x",)

    model = make_model()
    with pytest.raises(ValueError, match=r"B declares 'x'.*which A already adds"):
        fit(1, model, F.cross_entropy, sgd(model), make_data(), [A(), B()])


def test_a_loss_part_named_like_a_training_metric_is_refused():
    def loss(out, y):
        ce = F.cross_entropy(out, y)
        return {"loss": ce, "accuracy": ce}

    model = make_model()
    with pytest.raises(ValueError, match=r"loss part 'accuracy'.*train_accuracy"):
        fit(1, model, loss, sgd(model), make_data(), train_metrics=[accuracy])


def test_a_declared_value_of_a_callback_without_on_epoch_end_is_none():
    class Declares(Callback):
        record_names = ("never",)

    model = make_model()
    (record,) = fit(1, model, F.cross_entropy, sgd(model), make_data(), [Declares()])
    assert record["never"] is None and list(record)[-3:] == ["never", "lr", "time"]


def test_a_training_metric_that_is_not_computed_is_refused_before_training():
    model = make_model()
    with pytest.raises(ValueError, match=r"train_accuracy.*train_metrics=\[\.\.\.\]"):
        fit(1, model, F.cross_entropy, sgd(model), make_data(),
            [EarlyStopping("train_accuracy")], [accuracy])  # fmt: skip


def test_values_are_added_only_at_the_epochs_end():
    class Early(Callback):
        record_names = ("x",)

        def on_batch_end(self):
            return {"record": {"x": 1.0}}

    model = make_model()
    with pytest.raises(ValueError, match=r"Early.on_batch_end returned 'record'"):
        fit(1, model, F.cross_entropy, sgd(model), make_data(), [Early()])


def test_a_declared_value_not_added_is_none_and_keeps_its_column(tmp_path):
    class Sometimes(Callback):
        record_names = ("x",)

        def on_epoch_end(self, epoch):
            return {"record": {"x": 2.0}} if epoch == 1 else None

    model = make_model()
    history = fit(3, model, F.cross_entropy, sgd(model), make_data(),
                  [Sometimes(), CSVLogger(tmp_path / "log.csv")])  # fmt: skip
    assert [r["x"] for r in history] == [None, 2.0, None]
    assert [r[3] for r in read_csv(tmp_path / "log.csv")] == ["x", "", "2.0", ""]


# -- resuming --------------------------------------------------------------------
class StatefulGradNorm(GradNorm):
    """GradNorm whose epoch sums survive a checkpoint."""

    def state_dict(self):
        total = None if self.total is None else float(self.total)
        return {"total": total, "n": self.n}

    def load_state_dict(self, state):
        self.total, self.n = state["total"], state["n"]
        if self.total is not None:
            self.total = torch.tensor(self.total)

    def on_epoch_begin(self, num_batch):
        if num_batch == 0:  # not an epoch resumed part way
            super().on_epoch_begin()


def run(tmp_path, crash_at=None, epochs=3):
    torch.manual_seed(0)
    model = make_model()
    callbacks = [
        Checkpoint(tmp_path, every_n_steps=2),
        StatefulGradNorm(),
        *([Crash(crash_at)] if crash_at is not None else []),
    ]
    return fit(epochs, model, parts_loss, sgd(model), make_data(), callbacks,
               [accuracy], train_metrics=[accuracy])  # fmt: skip


def test_every_value_of_a_run_resumed_mid_epoch_equals_an_unbroken_runs(tmp_path):
    whole = run(tmp_path / "whole")
    with pytest.raises(RuntimeError, match="crash"):
        run(tmp_path / "broken", crash_at=10)  # mid-epoch 1 (7 batches/epoch)
    resumed = run(tmp_path / "broken")
    assert [r["epoch"] for r in resumed] == [1, 2]
    for got, want in zip(resumed, whole[1:], strict=True):
        assert list(got) == list(want)
        for key in set(got) - {"time"}:
            assert got[key] == pytest.approx(want[key], rel=1e-9), key


def test_a_callback_that_keeps_state_without_state_dict_is_warned_about(tmp_path):
    class History(Callback):
        def __init__(self):
            self.losses = []

        def on_epoch_end(self, record):
            self.losses.append(record["valid_loss"])

    model = make_model()
    with pytest.warns(UserWarning, match=r"History changed its attributes \['losses'"):
        fit(3, model, F.cross_entropy, sgd(model), make_data(),
            [Checkpoint(tmp_path), History()])  # fmt: skip


def test_no_warning_for_a_callback_whose_attributes_stay(tmp_path, recwarn):
    class Settings(Callback):
        def __init__(self):
            self.factor = 2.0

    model = make_model()
    fit(2, model, F.cross_entropy, sgd(model), make_data(),
        [Checkpoint(tmp_path), Settings(), ProgressBar(bars=False)])  # fmt: skip
    assert not [w for w in recwarn if "state_dict" in str(w.message)]


def test_skipped_validation_leaves_valid_values_none():
    class Skip(Callback):
        def on_epoch_begin(self):
            return {"skip_validate": True}

    model = make_model()
    (record,) = fit(1, model, parts_loss, sgd(model), make_data(), [Skip()],
                    [accuracy])  # fmt: skip
    assert record["valid_loss"] is None and record["accuracy"] is None
    assert record["valid_ce"] is None and record["train_ce"] is not None
    assert not math.isnan(record["train_loss"])


def test_snapshots_carry_the_last_finished_epochs_record_values():
    learn = Learner(make_data(), make_model(), F.cross_entropy, torch.optim.SGD,
                    metrics=[accuracy], train_metrics=[accuracy],
                    progress=False)  # fmt: skip
    snaps = list(learn.fit_snapshots(n_steps=14, every=7, lr=0.1))
    last = learn.recorder.epoch_table()[0]
    assert snaps[0].metrics == {}  # step 7 is the first epoch's last batch
    assert snaps[1].metrics == {
        "valid_loss": last["valid_loss"],
        "accuracy": last["accuracy"],
        "train_accuracy": last["train_accuracy"],
    }


def test_epoch_sums_without_state_dict_are_warned_about_at_a_mid_epoch_checkpoint(
    tmp_path,
):
    model = make_model()
    with pytest.warns(UserWarning, match=r"GradNorm changed its attributes.*inside"):
        fit(1, model, F.cross_entropy, sgd(model), make_data(),
            [Checkpoint(tmp_path, every_n_steps=3), GradNorm()])  # fmt: skip
