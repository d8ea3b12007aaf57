import functools

import pytest
import torch

from fitlib.errors import add_note, describe, name_of, reraise


def test_describe_shows_types_and_shapes_compactly():
    x = (torch.zeros(2, 3), [torch.zeros(4, dtype=torch.long)], {"m": 1.0})
    assert describe(x) == (
        "(Tensor(shape=(2, 3), float32), [Tensor(shape=(4,), int64)], {'m': float})"
    )
    assert describe((torch.zeros(1),)) == "(Tensor(shape=(1,), float32),)"
    assert describe(list(range(6))).endswith(", ... 6 items]")


def test_reraise_keeps_plain_types_and_puts_the_message_first():
    with pytest.raises(ValueError, match=r"^context here\nIt said: bad shape") as info:
        try:
            raise ValueError("bad shape")
        except ValueError as e:
            reraise(e, "context here")
    assert isinstance(info.value.__cause__, ValueError)


def test_reraise_keeps_other_exceptions_as_they_are_with_a_note():
    class OutOfMemoryError(RuntimeError):
        pass

    original = OutOfMemoryError("no memory")
    with pytest.raises(OutOfMemoryError) as info:
        try:
            raise original
        except OutOfMemoryError as e:
            reraise(e, "context here")
    assert info.value is original and info.value.__notes__ == ["context here"]


def test_add_note_without_native_notes_keeps_them_and_shows_them_in_the_message():
    class Py310Error(Exception):  # hides add_note, as on Python 3.10
        @property
        def add_note(self):
            raise AttributeError

    e = Py310Error("boom")
    add_note(e, "fitlib: raised in callback X.on_batch_end")
    assert e.__notes__ == ["fitlib: raised in callback X.on_batch_end"]
    assert str(e) == "boom\nfitlib: raised in callback X.on_batch_end"


def test_name_of_functions_partials_and_callable_objects():
    def loss(out, y):
        return out

    class Scaled:
        def __call__(self, out, y):
            return out

    assert name_of(loss) == "loss"
    assert name_of(functools.partial(loss, y=1)) == "loss"
    assert name_of(Scaled()) == "Scaled"


def test_did_you_mean_names_the_closest_choice_or_nothing():
    from fitlib.errors import did_you_mean

    choices = ["valid_loss", "train_loss", "accuracy"]
    assert did_you_mean("valid_los", choices) == " (did you mean 'valid_loss'?)"
    assert did_you_mean("accuracyy", iter(choices)) == " (did you mean 'accuracy'?)"
    assert did_you_mean("score", choices) == ""
    assert did_you_mean(3, choices) == ""  # not a str: nothing to compare


def test_unknown_name_builds_one_message_with_the_choices_and_the_fix():
    from fitlib.errors import unknown_name

    events = ["on_epoch_end", "on_train_end"]
    text = unknown_name(
        "call_hook", "event", "on_epochend", events, "pass one of them."
    )
    assert text == (
        "call_hook: unknown event 'on_epochend' (did you mean 'on_epoch_end'?); "
        "the events are 'on_epoch_end', 'on_train_end'. Fix: pass one of them."
    )
