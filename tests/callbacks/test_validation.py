"""ValidationSchedule: validation every n epochs, every n steps, from epoch k."""

import logging
import math
import re

import matplotlib.pyplot as plt
import pytest
import torch
from helpers import Crash, make_data, make_model
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

from fitlib import Callback, DataBunch, HPOptimizer, Learner, fit, validate
from fitlib.callbacks import (
    Checkpoint,
    CSVLogger,
    EarlyStopping,
    GradientAccumulation,
    ProgressBar,
    Recorder,
    ReduceLROnPlateau,
    TextLogger,
    ValidationSchedule,
)
from fitlib.metrics import accuracy
from fitlib.serialization import safe_load

pytestmark = pytest.mark.usefixtures("one_thread")


class Spy(Callback):
    """Keeps each training batch's (loss, size, step, model.training), each
    validation batch, and at each record an independent validation."""

    order = 70  # after every built-in: sees the record as they left it

    def __init__(self, check=True):
        self.batches, self.valid_batches, self.checks = [], 0, []
        self.check = check  # (its validation draws random numbers, as any does)

    def on_batch_begin(self, train, model):
        if train:
            self.training_mode = model.training

    def on_batch_end(self, train, last_loss, last_target, step, model):
        if train:
            size = len(last_target)
            self.batches.append((last_loss.item(), size, step, self.training_mode))
        else:
            self.valid_batches += 1

    def on_epoch_end(self, model, data, record):
        if not self.check:
            return
        loss, acc = validate(model, data.valid_dl, F.cross_entropy, metrics=[accuracy])
        self.checks.append((record, loss.item(), acc.item(), len(self.batches)))


def train(schedule, epochs=2, callbacks=(), data=None, check=True, **kwargs):
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    spy = Spy(check)
    cbs = [schedule, spy, *callbacks]
    history = fit(
        epochs, model, F.cross_entropy, opt, data or make_data(), cbs,
        metrics=[accuracy], **kwargs,
    )  # fmt: skip
    return history, spy


# -- when it validates -------------------------------------------------------------
def test_every_n_epochs_validates_those_epochs_and_always_the_last():
    history, spy = train(ValidationSchedule(every_n_epochs=2), epochs=5)
    validated = [r["valid_loss"] is not None for r in history]
    assert validated == [False, True, False, True, True]  # epochs 2, 4 and 5
    assert spy.valid_batches == 3 * 3  # 3 validations of 3 batches
    assert [r["epoch"] for r in history] == [0, 1, 2, 3, 4]
    assert "step" not in history[0]  # epochs only: the record as without it


def test_start_epoch_holds_validation_back():
    history, _ = train(ValidationSchedule(start_epoch=2), epochs=4)
    assert [r["valid_loss"] is not None for r in history] == [False, False, True, True]


def test_max_steps_ends_with_a_validation_even_in_an_epoch_not_due():
    history, _ = train(ValidationSchedule(every_n_epochs=5), epochs=None, max_steps=9)
    assert [r["valid_loss"] is not None for r in history] == [False, True]


def test_every_n_steps_ends_a_record_at_each_validation_inside_the_epoch():
    # 7 batches per epoch (100 samples by 16): validations after steps 3, 6;
    # the epoch's end (7); then 9, 12 and the end (14).
    history, spy = train(ValidationSchedule(every_n_steps=3))
    assert [(r["epoch"], r["step"]) for r in history] == [
        (0, 3), (0, 6), (0, 7), (1, 9), (1, 12), (1, 14),
    ]  # fmt: skip
    assert list(history[0])[:3] == ["epoch", "step", "train_loss"]
    assert spy.valid_batches == 6 * 3
    start = 0
    for record, loss, acc, done in spy.checks:
        # Each record: the training since the previous one, and a validation
        # of the model as it was at that moment.
        part = spy.batches[start:done]
        mean = sum(v * n for v, n, _, _ in part) / sum(n for _, n, _, _ in part)
        assert record["train_loss"] == pytest.approx(mean, rel=1e-6)
        assert record["valid_loss"] == pytest.approx(loss, rel=1e-6)
        assert record["accuracy"] == pytest.approx(acc, rel=1e-9)
        start = done
    assert len(spy.batches) == 14  # every batch trained once, none twice


@pytest.mark.parametrize("shared", [False, True])
def test_validations_inside_epochs_do_not_change_training(shared):
    runs = []
    for schedule in (ValidationSchedule(), ValidationSchedule(every_n_steps=2)):
        data = make_data()
        if shared:  # one generator for both loaders' orders, a common recipe
            g = torch.Generator().manual_seed(0)
            data = DataBunch(
                DataLoader(data.train_dl.dataset, 16, shuffle=True, generator=g),
                DataLoader(data.valid_dl.dataset, 16, shuffle=True, generator=g),
                device="cpu",
            )
        history, spy = train(schedule, epochs=3, check=False, data=data)
        runs.append(([loss for loss, *_ in spy.batches], history[-1]))
    (losses_a, last_a), (losses_b, last_b) = runs
    assert losses_a == losses_b  # the same batches, in the same order
    assert last_a["valid_loss"] == last_b["valid_loss"]


def test_a_validation_cut_short_does_not_cut_the_training_short():
    class OneValidationBatch(Callback):
        def on_batch_end(self, train):
            if not train:
                return {"stop_epoch": True}

    history, spy = train(ValidationSchedule(every_n_steps=3),
                         callbacks=[OneValidationBatch()])  # fmt: skip
    assert len(spy.batches) == 14
    assert [(r["epoch"], r["step"]) for r in history] == [
        (0, 3), (0, 6), (0, 7), (1, 9), (1, 12), (1, 14),
    ]  # fmt: skip


def test_training_goes_on_in_train_mode_after_a_validation_inside_the_epoch():
    _, spy = train(ValidationSchedule(every_n_steps=2))
    assert all(training for *_, training in spy.batches)
    assert len(spy.batches) == 14


def test_a_validation_on_the_epochs_last_step_is_the_epochs_own():
    data = make_data(n_train=96)  # 6 batches: steps 3 and 6 end epoch 0
    history, spy = train(ValidationSchedule(every_n_steps=3), data=data)
    assert [(r["epoch"], r["step"]) for r in history] == [(0, 3), (0, 6), (1, 9),
                                                          (1, 12)]  # fmt: skip
    assert spy.valid_batches == 4 * 3


def test_steps_are_optimizer_steps_under_gradient_accumulation():
    data = make_data(n_train=128)  # 8 batches, 4 steps per epoch
    schedule = ValidationSchedule(every_n_epochs=None, every_n_steps=2)
    history, spy = train(schedule, epochs=1, callbacks=[GradientAccumulation(2)],
                         data=data)  # fmt: skip
    assert [r["step"] for r in history] == [2, 4]
    assert [done for *_, done in spy.checks] == [4, 8]  # after batches 4 and 8


def test_a_stop_that_skips_validation_cancels_one_asked_for():
    class StopWithoutValidation(Callback):
        def on_batch_end(self, train, step):
            if train and step == 3:
                return {"stop_training": True, "skip_validate": True}

    history, spy = train(ValidationSchedule(every_n_steps=3), epochs=1,
                         callbacks=[StopWithoutValidation()])  # fmt: skip
    assert len(history) == 1 and history[0]["valid_loss"] is None
    assert spy.valid_batches == 0


# -- where each validation goes ------------------------------------------------------
def test_each_validation_reaches_the_table_recorder_and_loggers(tmp_path, caplog):
    bar, rec = ProgressBar(bars=False), Recorder()
    csv = CSVLogger(tmp_path / "log.csv")
    text = TextLogger("fitlib.test.validation")
    with caplog.at_level(logging.INFO, "fitlib.test.validation"):
        history, _ = train(ValidationSchedule(every_n_steps=3),
                           callbacks=[bar, rec, csv, text])  # fmt: skip
    assert bar.rows[0] == ["epoch", "step", "train_loss", "valid_loss", "accuracy",
                           "time"]  # fmt: skip
    assert [row[:2] for row in bar.rows[1:]] == [
        ["0", "3"], ["0", "6"], ["0", "7"], ["1", "9"], ["1", "12"], ["1", "14"],
    ]  # fmt: skip
    assert rec.epochs == [0, 0, 0, 1, 1, 1]
    assert rec.epoch_iterations == [2, 5, 6, 8, 11, 13]  # each record's last batch
    assert rec.valid_losses == [r["valid_loss"] for r in history]
    lines = (tmp_path / "log.csv").read_text().splitlines()
    assert lines[0].startswith("epoch,step,train_loss,valid_loss,accuracy")
    assert [line.split(",")[:2] for line in lines[1:]][:3] == [
        ["0", "3"], ["0", "6"], ["0", "7"],
    ]  # fmt: skip
    logged = [m for m in caplog.messages if m.startswith("epoch")]
    assert [m.split(":")[0] for m in logged[:3]] == [
        "epoch 0 step 3", "epoch 0 step 6", "epoch 0 step 7",
    ]  # fmt: skip


def test_the_training_bar_goes_on_from_where_the_epoch_is(capsys):
    bar = ProgressBar(bars=True, refresh=0)  # fastprogress's console bars
    train(ValidationSchedule(every_n_steps=3), epochs=1, callbacks=[bar])
    out = capsys.readouterr().out.replace("\r", "\n")
    drawn = [(int(n), int(total)) for n, total in re.findall(r"\[(\d+)/(\d+)", out)]
    first_validation = drawn.index((0, 3))  # the validation bar: 3 batches
    after = [n for n, total in drawn[first_validation:] if total == 7]
    assert 1 not in after and 2 not in after  # not started over
    assert {3, 4, 5, 6, 7} <= set(after)
    assert "Epoch 1/1" in out and "Epoch 2/" not in out  # the epoch bar: 1 epoch


def test_a_fit_stopped_inside_an_epoch_leaves_the_next_fit_a_new_epoch(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    from fitlib.callbacks import TensorBoardLogger

    rec, tb = Recorder(), TensorBoardLogger(tmp_path)
    learn = Learner(make_data(), make_model(), F.cross_entropy, progress=False,
                    opt_func=torch.optim.SGD, callbacks=[rec, tb])  # fmt: skip
    stop = EarlyStopping("score", mode="max", patience=2)
    learn.fit(3, lr=0.1, callbacks=[ValidationSchedule(every_n_steps=2),
                                    Score(lambda step: 1.0), stop])  # fmt: skip
    learn.fit(1, lr=0.1)  # stopped at step 6 of epoch 0: this is epoch 1
    assert rec.epochs == [0, 0, 0, 1]
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    events.Reload()
    assert [p.value for p in events.Scalars("epoch/epoch")] == [0, 0, 0, 1]


def test_recorder_plots_records_inside_epochs_at_their_iterations():
    rec = Recorder()
    train(ValidationSchedule(every_n_steps=3), callbacks=[rec])
    ax = rec.plot_metrics()
    assert ax.get_xlabel() == "iteration"
    assert list(ax.lines[0].get_xdata()) == [2, 5, 6, 8, 11, 13]
    ax = rec.plot_losses()
    labels = [line.get_label() for line in ax.lines]
    assert "train (row mean)" in labels and "valid" in labels
    plt.close("all")


def test_tensorboard_gets_each_validation_at_its_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    from fitlib.callbacks import TensorBoardLogger

    history, _ = train(ValidationSchedule(every_n_steps=3),
                       callbacks=[TensorBoardLogger(tmp_path)])  # fmt: skip
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    events.Reload()
    points = events.Scalars("epoch/valid_loss")
    assert [p.step for p in points] == [3, 6, 7, 9, 12, 14]
    assert [p.value for p in points] == pytest.approx(
        [r["valid_loss"] for r in history], rel=1e-6
    )
    assert "epoch/step" not in events.Tags()["scalars"]


class Score(Callback):
    """Adds a score to each record: a function of its step."""

    record_names = ("score",)

    def __init__(self, score):
        self.score, self.weights = score, {}

    def on_epoch_end(self, step, model):
        self.weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
        return {"record": {"score": self.score(step)}}


def test_early_stopping_counts_validations_and_stops_inside_the_epoch(capsys):
    stop = EarlyStopping("score", mode="max", patience=2)
    history, spy = train(ValidationSchedule(every_n_steps=2), epochs=3,
                         callbacks=[Score(lambda step: 1.0), stop])  # fmt: skip
    # Best at step 2, no better at 4 and 6: the third validation stops it.
    assert [r["step"] for r in history] == [2, 4, 6]
    assert len(spy.batches) == 6  # epoch 0 (7 batches) cut after its 6th
    assert (stop.stopped_epoch, stop.stopped_step, stop.best_step) == (0, 6, 2)
    out = capsys.readouterr().out
    assert "stopped after epoch 0 (step 6)" in out
    assert "did not improve for 2 validation(s)" in out
    assert "at epoch 0 (step 2)" in out


def test_reduce_lr_on_plateau_acts_right_after_a_validation_inside_the_epoch():
    plateau = ReduceLROnPlateau("score", mode="max", patience=0, factor=0.5)
    history, _ = train(ValidationSchedule(every_n_steps=2), epochs=1,
                       callbacks=[Score(lambda step: 1.0), plateau])  # fmt: skip
    # Best at step 2; not better at 4, nor 6: halved after each, inside epoch 0
    # (a record's lr is the one its last step used).
    assert [r["step"] for r in history] == [2, 4, 6, 7]
    assert [r["lr"] for r in history] == pytest.approx([0.1, 0.1, 0.05, 0.025])
    assert plateau.reductions == [0, 0, 0]  # and after the epoch's end


@pytest.mark.filterwarnings("ignore:Checkpoint. callback")  # the test's spies
def test_checkpoint_keeps_the_best_validation_inside_an_epoch(tmp_path):
    score = Score(lambda step: -abs(step - 4))  # best at step 4
    ckpt = Checkpoint(tmp_path, monitor="score", mode="max")
    train(ValidationSchedule(every_n_steps=2), epochs=1, callbacks=[score, ckpt])
    best = safe_load(tmp_path / "best.pth")
    assert best["position"]["step"] == 4 and best["position"]["num_batch"] == 4
    assert best["position"]["epoch"] == 0
    for name, value in score.weights[4].items():
        assert torch.equal(best["model"][name], value), name


# -- resume ------------------------------------------------------------------------
def learner(callbacks=()):
    data = make_data()
    return Learner(
        DataBunch(data.train_dl, data.valid_dl, device="cpu"),
        make_model(),
        F.cross_entropy,
        metrics=[accuracy],
        progress=False,
        opt_func=torch.optim.SGD,
        callbacks=[
            ValidationSchedule(every_n_steps=3),
            ReduceLROnPlateau("valid_loss", patience=0, factor=0.7),
            *callbacks,
        ],
    )


@pytest.mark.parametrize("crashes", [[3], [4, 10], [6], [7, 12]])
def test_a_run_resumed_after_validations_inside_epochs_is_exact(tmp_path, crashes):
    torch.manual_seed(0)
    ref = learner([CSVLogger(tmp_path / "ref.csv")])
    ref.fit(2, lr=0.1)
    for at in [*crashes, None]:  # killed after batch `at`, then rerun
        torch.manual_seed(0)
        extra = [Crash(at)] if at is not None else []
        log = CSVLogger(tmp_path / "run.csv")
        learn = learner([Checkpoint(tmp_path, every_n_steps=2), log, *extra])
        try:
            learn.fit(2, lr=0.1)
        except RuntimeError:
            assert at is not None

    def table(learn):
        return [{k: v for k, v in r.items() if k != "time"}
                for r in learn.recorder.epoch_table()]  # fmt: skip

    assert table(learn) == table(ref)
    assert len(table(ref)) == 6 and ref.recorder.epochs == [0, 0, 0, 1, 1, 1]

    def rows(name):  # the CSV file: every record once, time left out
        lines = (tmp_path / name).read_text().splitlines()
        return [line.rsplit(",", 1)[0] for line in lines]

    assert rows("run.csv") == rows("ref.csv") and len(rows("ref.csv")) == 7
    assert learn.recorder.losses == ref.recorder.losses
    for a, b in zip(learn.model.state_dict().values(), ref.model.state_dict().values(),
                    strict=True):  # fmt: skip
        assert torch.equal(a, b)


def test_a_fit_closed_while_a_validation_is_pending_resumes_with_it(tmp_path):
    torch.manual_seed(0)
    ref = learner()
    for _ in ref.fit_snapshots(n_steps=14, every=3):
        pass
    torch.manual_seed(0)
    learn = learner([Checkpoint(tmp_path, every_n_steps=2)])
    for _ in learn.fit_snapshots(n_steps=14, every=3):
        break  # at step 3, whose validation was asked for and has not run
    torch.manual_seed(0)
    resumed = learner([Checkpoint(tmp_path, every_n_steps=2)])
    for _ in resumed.fit_snapshots(n_steps=14, every=3):
        pass

    def table(learn):
        return [{k: v for k, v in r.items() if k != "time"}
                for r in learn.recorder.epoch_table()]  # fmt: skip

    assert table(resumed) == table(ref)
    assert [r["step"] for r in table(ref)] == [3, 6, 7, 9, 12, 14]


# -- bad input ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_n_epochs": 0}, "every_n_epochs must be an int >= 1"),
        ({"every_n_steps": 0}, "every_n_steps must be an int >= 1"),
        ({"start_epoch": -1}, "start_epoch must be an int >= 0"),
        ({"every_n_epochs": None}, "every_n_epochs=None, every_n_steps=None"),
        ({"every_n_epochs": 1.5}, r"every_n_epochs must be an int .*1\.5 \(float\)"),
        ({"every_n_steps": True}, r"every_n_steps must be an int .*True \(bool\)"),
        ({"every_n_steps": "500"}, r"every_n_steps must be an int .*'500' \(str\)"),
        ({"start_epoch": None}, r"start_epoch must be an int .*None \(NoneType\)"),
    ],
)
def test_bad_arguments_are_refused_with_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        ValidationSchedule(**kwargs)
    assert "Fix: " in str(info.value)


def test_two_schedules_in_one_fit_are_refused_before_training_naming_both():
    # One would cancel the other's validations (skip_validate): refused.
    first = ValidationSchedule(every_n_epochs=2)
    second = ValidationSchedule(every_n_steps=3)
    model = make_model()
    with pytest.raises(ValueError, match=r"ValidationSchedule\(every_n_epochs=2, "
                       r".*ValidationSchedule\(every_n_epochs=1, every_n_steps=3.*"
                       r"Fix: merge them into one") as info:  # fmt: skip
        fit(3, model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
            make_data(), [first, Spy(), second])  # fmt: skip
    assert "every_n_steps and start_epoch" in str(info.value)


def test_a_start_epoch_past_the_fits_last_epoch_warns_and_validates_at_the_end():
    # A schedule kept in learn.callbacks across fits of different lengths:
    # the short fit still validates after its last epoch, with a warning.
    with pytest.warns(UserWarning, match=r"start_epoch=3 .* fit of 3 epoch"):
        history, _ = train(ValidationSchedule(start_epoch=3), epochs=3)
    assert [r["valid_loss"] is not None for r in history] == [False, False, True]
    history, _ = train(ValidationSchedule(start_epoch=2), epochs=3)
    assert [r["valid_loss"] is not None for r in history] == [False, False, True]


def test_data_without_a_validation_set_is_refused_before_training():
    data = make_data()
    with pytest.raises(ValueError, match="valid_dl is None"):
        train(ValidationSchedule(), data=DataBunch(data.train_dl, device="cpu"))


def test_validate_now_is_refused_where_nothing_would_read_it():
    class Late(Callback):
        def on_epoch_end(self):
            return {"validate_now": True}

    with pytest.raises(ValueError, match="validate_now"):
        train(ValidationSchedule(), callbacks=[Late()])


def test_records_of_a_callback_of_yours_that_validates_inside_epochs():
    class EveryFive(Callback):
        validates_mid_epoch = True  # its records carry their step

        def on_batch_end(self, train, iteration):
            if train and (iteration + 1) % 5 == 0:
                return {"validate_now": True}

    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    history = fit(1, model, F.cross_entropy, opt, make_data(), [EveryFive()])
    assert [(r["step"], math.isfinite(r["valid_loss"])) for r in history] == [
        (5, True), (7, True),
    ]  # fmt: skip
