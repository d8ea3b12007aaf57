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
