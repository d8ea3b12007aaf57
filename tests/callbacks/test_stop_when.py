import math

import pytest
import torch
from helpers import Crash, make_data, make_model, scripted_record
from torch.nn import functional as F  # noqa: N812

from fitlib import Callback, HPOptimizer, fit
from fitlib.callback import call_hook
from fitlib.callbacks import (
    ORDER_REASONS,
    Checkpoint,
    EarlyStopping,
    ValidationSchedule,
)
from fitlib.callbacks.stop_when import RecordKeyError, StopWhen
from fitlib.metrics import Metrics, accuracy


def record_of(valid_loss, epoch=0, **extra):
    last = None if valid_loss is None else [torch.tensor(valid_loss)]
    return scripted_record(losses=[1.0], sizes=[4], last_metrics=last,
                           epoch=epoch) | extra  # fmt: skip


def judge(cb, *records):
    """on_epoch_end per record until one stops: the epoch it stops after."""
    call_hook(cb, "on_train_begin")
    for record in records:
        update = call_hook(cb, "on_epoch_end", epoch=record["epoch"], record=record)
        if update is not None:
            assert update == {"stop_training": True, "stop_reason": cb.stop_reason}
            return record["epoch"]
    return None


# -- the condition ---------------------------------------------------------------
def test_stops_at_the_first_record_the_condition_holds_for():
    cb = StopWhen(lambda record: record["valid_loss"] < 0.05)
    records = [record_of(v, epoch=e) for e, v in enumerate([0.3, 0.1, 0.04, 0.01])]
    assert judge(cb, *records) == 2 and cb.stopped_epoch == 2


def test_the_default_reason_is_the_lambdas_body_with_the_values_it_read():
    cb = StopWhen(lambda record: record["valid_loss"] < 0.05)
    judge(cb, record_of(0.04))
    assert cb.stop_reason == 'StopWhen: record["valid_loss"] < 0.05 (valid_loss=0.04)'


def test_a_named_function_and_a_given_reason_read_as_such():
    def good_enough(record):
        return record["train_loss"] < 2 and record["valid_loss"] < 0.5

    cb = StopWhen(good_enough)
    judge(cb, record_of(0.25))
    assert cb.stop_reason == (
        "StopWhen: good_enough(record) is true (train_loss=1, valid_loss=0.25)"
    )
    cb = StopWhen(lambda r: r["valid_loss"] < 0.5, reason="good enough")
    judge(cb, record_of(0.25))
    assert cb.stop_reason == "StopWhen: good enough (valid_loss=0.25)"


def test_a_record_whose_value_read_is_none_is_not_judged():
    # None: validation skipped that epoch; the condition reads it as not there.
    cb = StopWhen(lambda record: record["valid_loss"] < 1.0)
    assert judge(cb, record_of(None, epoch=0), record_of(0.5, epoch=1)) == 1
    # record.get sees the None itself.
    cb = StopWhen(lambda record: record.get("valid_loss") is None)
    assert judge(cb, record_of(0.5, epoch=0), record_of(None, epoch=1)) == 1


def test_the_condition_cannot_change_the_record():
    def meddle(record):
        record["valid_loss"] = 0.0
        return False

    record = record_of(0.5)
    judge(StopWhen(meddle), record)
    assert record["valid_loss"] == 0.5


# -- bad input -------------------------------------------------------------------
@pytest.mark.parametrize("condition", [3, "valid_loss < 0.05", None])
def test_a_condition_that_is_not_callable_raises(condition):
    with pytest.raises(TypeError, match=r"StopWhen: condition must be a function of "
                       r"the record.*Fix: e\.g\. StopWhen\(lambda record"):  # fmt: skip
        StopWhen(condition)


@pytest.mark.parametrize(
    "condition", [lambda: True, lambda record, epoch: True, lambda *, record: True]
)
def test_a_condition_of_the_wrong_arity_raises_before_training(condition):
    with pytest.raises(TypeError, match=r"StopWhen: condition must take one "
                       r"argument, the record.*Fix:"):  # fmt: skip
        StopWhen(condition)


def test_a_condition_with_defaults_or_star_args_and_a_callable_object_are_taken():
    class Below:
        def __call__(self, record):
            return record["valid_loss"] < 1

    for condition in [lambda record, limit=1: True, lambda *args: True, Below()]:
        assert StopWhen(condition).condition is condition
    assert StopWhen(Below()).reason == "Below(record) is true"


# -- names checked before training (a probe on a stand-in record) -------------------
def fit_with(*callbacks, loss_func=F.cross_entropy, **kwargs):
    """A fit of make_model(); returns (the model's parameters before, the model)."""
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    fit(3, model, loss_func, opt, make_data(), list(callbacks), **kwargs)
    return before, model


@pytest.mark.parametrize(
    "condition",
    [
        lambda record: record["val_loss"] < 0.1,
        lambda record: record["epoch"] >= 1 and record["val_loss"] < 0.1,
        lambda record: record["valid_loss"] < 0.1 or record["val_loss"] < 0.1,
    ],
)
def test_a_name_no_record_will_have_is_refused_before_training(condition):
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(RecordKeyError) as info:
        fit(3, model, F.cross_entropy, opt, make_data(), [StopWhen(condition)])
    assert all(map(torch.equal, before, model.parameters()))  # no step ran
    message = str(info.value)
    assert isinstance(info.value, KeyError)
    assert "StopWhen: the condition read record['val_loss']" in message
    assert "did you mean 'valid_loss'?" in message
    assert "'train_loss', 'valid_loss'" in message


def test_the_names_known_before_training_are_not_refused():
    class Width(Callback):
        record_names = ("width",)

        def on_epoch_end(self):
            return {"record": {"width": 1.0}}

    names = ["epoch", "train_loss", "valid_loss", "accuracy", "train_accuracy",
             "width", "lr", "time"]  # fmt: skip
    seen = []

    def all_of_them(record):
        seen.extend(name for name in names if record[name] is not None)
        return False

    cb = StopWhen(all_of_them)
    call_hook(cb, "on_train_begin", metrics=Metrics([accuracy]),
              train_metrics=Metrics([accuracy]), callbacks=[Width(), cb])  # fmt: skip
    assert seen[: len(names)] == names
    # step is in the record only with validations inside epochs
    step = StopWhen(lambda record: record["step"] > 10)
    with pytest.raises(RecordKeyError, match=r"record\['step'\]"):
        call_hook(step, "on_train_begin", callbacks=[step])
    schedule = ValidationSchedule(every_n_steps=2)
    call_hook(step, "on_train_begin", callbacks=[step, schedule])


def test_a_loss_part_is_refused_only_when_the_loss_declares_its_parts():
    part = StopWhen(lambda record: record["valid_ce"] < 0.1)
    # A loss that declares no parts may return them at the first batch.
    call_hook(part, "on_train_begin", loss_func=F.cross_entropy)
    slip = StopWhen(lambda record: record["valid_los"] < 0.1)  # a typo, no part
    with pytest.raises(RecordKeyError, match="did you mean 'valid_loss'"):
        call_hook(slip, "on_train_begin", loss_func=F.cross_entropy)

    def loss(out, y):
        return {"loss": F.cross_entropy(out, y), "ce": F.cross_entropy(out, y)}

    loss.part_names = ("ce",)
    call_hook(part, "on_train_begin", loss_func=loss)
    other = StopWhen(lambda record: record["valid_kl"] < 0.1)
    with pytest.raises(RecordKeyError, match=r"record\['valid_kl'\]"):
        call_hook(other, "on_train_begin", loss_func=loss)


def test_a_condition_that_fails_on_the_stand_in_record_still_trains():
    limits = {}  # filled once training runs: the probe cannot read it
    conditions = [
        lambda record: int(record["valid_loss"]) >= 0,  # int(nan) raises
        lambda record: record["valid_loss"] < limits["loss"],  # a KeyError not ours
        lambda record: record.get("val_loss") is None and record["epoch"] >= 1,
    ]
    for condition in conditions:
        limits.clear()
        setter = Callback.from_hooks(on_epoch_begin=lambda: limits.update(loss=9.0))
        stop = StopWhen(condition)
        before, model = fit_with(setter, stop)
        assert stop.stopped_epoch is not None
        assert not all(map(torch.equal, before, model.parameters()))


def test_a_condition_that_catches_the_missing_name_itself_is_not_refused():
    def tolerant(record):
        try:
            return record["width"] > 1
        except KeyError:
            return record["epoch"] >= 1

    stop = StopWhen(tolerant)
    fit_with(stop)
    assert stop.stopped_epoch == 1


def test_a_name_not_in_the_record_names_the_records_keys():
    cb = StopWhen(lambda record: record["valid_los"] < 0.05)
    with pytest.raises(RecordKeyError) as info:
        on_epoch_end_only(cb, record_of(0.5))
    message = str(info.value)
    assert "StopWhen: the condition read record['valid_los']" in message
    assert "did you mean 'valid_loss'?" in message
    assert "['epoch', 'train_loss', 'valid_loss', 'lr', 'time']" in message


def on_epoch_end_only(cb, record):
    return call_hook(cb, "on_epoch_end", epoch=record["epoch"], record=record)


def test_a_condition_that_returns_no_bool_raises():
    cb = StopWhen(lambda record: None)
    with pytest.raises(TypeError, match=r"StopWhen: condition returned None "
                       r"\(NoneType\); it must return True or False"):  # fmt: skip
        judge(cb, record_of(0.5))


def test_a_reason_that_is_not_a_string_raises():
    with pytest.raises(TypeError, match="StopWhen: reason must be a str or None"):
        StopWhen(lambda r: True, reason=3)


# -- order, through fit, resume --------------------------------------------------
def test_it_runs_after_your_callbacks_and_sees_the_values_they_add():
    assert StopWhen.order == EarlyStopping.order == 45
    assert "StopWhen" in ORDER_REASONS

    class Width(Callback):
        record_names = ("width",)

        def on_epoch_end(self, epoch):
            return {"record": {"width": float(epoch)}}

    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    stop = StopWhen(lambda record: record["width"] >= 2)
    history = fit(10, model, F.cross_entropy, opt, make_data(), [stop, Width()])
    assert len(history) == 3 and history.stop_reason == (
        'StopWhen: record["width"] >= 2 (width=2)'
    )


def test_through_fit_it_stops_after_the_record_and_prints_one_line(capsys):
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    stop = StopWhen(lambda record: record["epoch"] == 1, reason="two epochs")
    history = fit(10, model, F.cross_entropy, opt, make_data(), [stop])
    assert len(history) == 2 and history.stop_reason == "StopWhen: two epochs (epoch=1)"
    assert capsys.readouterr().out == (
        "StopWhen: stopped after epoch 1: two epochs (epoch=1)\n"
    )
    fit(1, model, F.cross_entropy, opt, make_data(), [stop])  # a new fit forgets
    assert stop.stopped_epoch is None and stop.stop_reason is None


def test_a_validation_inside_an_epoch_is_judged_and_said_with_its_step():
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    stop = StopWhen(lambda record: record["step"] >= 4)
    schedule = ValidationSchedule(every_n_steps=2)
    history = fit(3, model, F.cross_entropy, opt, make_data(), [stop, schedule])
    assert [r["step"] for r in history] == [2, 4]
    assert (stop.stopped_epoch, stop.stopped_step) == (0, 4)


def test_a_resumed_fit_stops_where_an_unbroken_one_does(tmp_path):
    def run(crash=None, directory=None):
        model = make_model()
        opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        stop = StopWhen(lambda record: record["valid_loss"] < 0.95)
        cbs = [stop] + ([] if crash is None else [Crash(crash)])
        if directory is not None:
            cbs.append(Checkpoint(directory, every_n_steps=3))
        return model, fit(20, model, F.cross_entropy, opt, make_data(), cbs)

    model, history = run()
    assert 2 <= len(history) < 20
    with pytest.raises(RuntimeError, match="crash"):
        run(7 * len(history) - 3, tmp_path)  # in the last epoch
    resumed_model, resumed = run(directory=tmp_path)
    assert resumed.stop_reason == history.stop_reason
    assert resumed[-1]["valid_loss"] == history[-1]["valid_loss"]
    assert all(map(torch.equal, model.state_dict().values(),
                   resumed_model.state_dict().values()))  # fmt: skip
    assert math.isfinite(history[-1]["valid_loss"])
