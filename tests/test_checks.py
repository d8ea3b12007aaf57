import math
from pathlib import Path

import numpy as np
import pytest

from fitlib.callbacks import Checkpoint, CSVLogger, TensorBoardLogger
from fitlib.checks import check_flag, check_int, check_number, check_path
from fitlib.errors import ArgTypeError


# -- check_int -------------------------------------------------------------------
def test_check_int_returns_an_int_at_or_above_the_minimum():
    assert check_int(3, "n", minimum=1) == 3
    assert check_int(0, "n") == 0  # the default minimum is 0
    assert check_int(np.int64(5), "n", minimum=1) == 5
    assert type(check_int(np.int64(5), "n", minimum=1)) is int


@pytest.mark.parametrize("bad", [True, False, 2.0, 1.5, "3", None, [2]])
def test_check_int_refuses_what_is_no_int_with_a_type_error(bad):
    with pytest.raises(TypeError, match=r"n_batches must be an int >= 1; got"):
        check_int(bad, "n_batches", minimum=1)


def test_a_wrong_type_is_also_a_value_error_as_these_checks_raised_before():
    with pytest.raises(ValueError, match="must be an int"):
        check_int(2.5, "every", minimum=1)


@pytest.mark.parametrize(("value", "minimum"), [(0, 1), (-1, 0), (1, 2)])
def test_check_int_refuses_an_int_below_the_minimum(value, minimum):
    with pytest.raises(ValueError, match=rf"must be an int >= {minimum}; got {value}"):
        check_int(value, "n", minimum=minimum)


def test_check_int_takes_none_only_when_allowed():
    assert check_int(None, "total_steps", minimum=1, allow_none=True) is None
    with pytest.raises(ValueError, match=r"an int >= 1 or None; got 0"):
        check_int(0, "total_steps", minimum=1, allow_none=True)
    with pytest.raises(TypeError, match=r"an int >= 1; got None \(NoneType\)"):
        check_int(None, "total_steps", minimum=1)


def test_check_int_message_names_owner_argument_value_type_and_fix():
    with pytest.raises(ValueError) as info:
        check_int(1.5, "patience", owner="EarlyStopping", example=3)
    assert str(info.value) == (
        "EarlyStopping: patience must be an int >= 0; got 1.5 (float). "
        "Fix: e.g. EarlyStopping(patience=3)."
    )
    with pytest.raises(ValueError) as info:
        check_int(0, "every", minimum=1)
    assert str(info.value) == (
        "every must be an int >= 1; got 0 (int). Fix: e.g. every=1."
    )


# -- check_number ----------------------------------------------------------------
def test_check_number_returns_a_float_inside_the_range():
    assert check_number(1, "refresh", minimum=0, example=0.25) == 1.0
    assert type(check_number(1, "refresh", minimum=0, example=0.25)) is float
    assert check_number(0.5, "pct", above=0, below=1, example=0.3) == 0.5


@pytest.mark.parametrize(
    ("value", "bounds", "words"),
    [
        (0, {"above": 0, "below": 1}, r"pct must be a number in \(0, 1\); got 0 "),
        (1.0, {"above": 0, "below": 1}, r"in \(0, 1\); got 1\.0"),
        (-0.1, {"minimum": 0}, r"pct must be a number >= 0; got -0\.1"),
        (0.0, {"above": 0}, r"pct must be a number > 0; got 0\.0"),
        (math.nan, {"minimum": 0}, r">= 0; got nan"),
        (math.inf, {"above": 0, "below": math.inf}, r"a number > 0; got inf"),
    ],
)
def test_check_number_refuses_values_outside_the_range(value, bounds, words):
    with pytest.raises(ValueError, match=words):
        check_number(value, "pct", example=0.3, **bounds)


@pytest.mark.parametrize("bad", [True, "0.5", None])
def test_check_number_refuses_what_is_no_number_with_a_type_error(bad):
    with pytest.raises(TypeError, match=r"refresh must be a number of seconds >= 0"):
        check_number(bad, "refresh", minimum=0, what="a number of seconds", example=1)


def test_check_number_message_names_owner_argument_value_type_and_fix():
    assert check_number(None, "beta", above=0, example=1.0, allow_none=True) is None
    with pytest.raises(ValueError) as info:
        check_number(
            2.0, "pct_start", above=0, below=1, what="a fraction of training",
            owner="OneCycleScheduler", example=0.3,
        )  # fmt: skip
    assert str(info.value) == (
        "OneCycleScheduler: pct_start must be a fraction of training in (0, 1); "
        "got 2.0 (float). Fix: e.g. OneCycleScheduler(pct_start=0.3)."
    )


# -- check_flag ------------------------------------------------------------------
@pytest.mark.parametrize("value", [True, False, np.True_, np.False_])
def test_check_flag_takes_python_and_numpy_bools_as_bools(value):
    flag = check_flag(value, "resume", "Checkpoint", "Checkpoint(dir, resume=False)")
    assert type(flag) is bool and flag == bool(value)


@pytest.mark.parametrize("bad", ["no", 1, 0.0, None, np.int64(1)])
def test_check_flag_refuses_the_rest_with_an_arg_type_error(bad):
    with pytest.raises(ArgTypeError) as e:
        check_flag(bad, "with_opt", "Learner.load", "learn.load('m', with_opt=False)")
    assert str(e.value) == (
        f"Learner.load: with_opt must be True or False; got {bad!r} "
        f"({type(bad).__name__}). Fix: e.g. learn.load('m', with_opt=False)."
    )


def test_one_check_flag_serves_the_package(tmp_path):
    import fitlib.interpret_checks
    import fitlib.resume

    assert not hasattr(fitlib.resume, "check_flag")
    assert getattr(fitlib.interpret_checks, "check_flag", check_flag) is check_flag
    with pytest.raises(ArgTypeError, match=r"Checkpoint: resume must be True or F"):
        Checkpoint(tmp_path, resume="no")
    assert Checkpoint(tmp_path, resume=np.False_).resume is False


def _flag_owners(tmp_path):
    import torch
    from helpers import make_data, make_model
    from torch.nn import functional as F  # noqa: N812

    from fitlib import Learner, MultiOptimizer
    from fitlib.callbacks import EarlyStopping
    from fitlib.sequences import PadCollate

    def zero_grad(flag):
        model = make_model()
        opt = MultiOptimizer({"all": torch.optim.SGD(model.parameters(), lr=0.1)})
        opt.zero_grad(set_to_none=flag)
        return opt

    return {
        "EarlyStopping: restore_best": lambda f: EarlyStopping(restore_best=f),
        "CSVLogger: append": lambda f: CSVLogger(tmp_path / "a.csv", append=f),
        "PadCollate: teacher_forcing": lambda f: PadCollate(teacher_forcing=f),
        "Learner: progress": lambda f: Learner(
            make_data(), make_model(), F.cross_entropy, progress=f
        ),
        "Learner: train_bn": lambda f: Learner(
            make_data(), make_model(), F.cross_entropy, train_bn=f
        ),
        "MultiOptimizer.zero_grad: set_to_none": zero_grad,
    }


@pytest.mark.parametrize(
    "owner",
    [
        "EarlyStopping: restore_best",
        "CSVLogger: append",
        "PadCollate: teacher_forcing",
        "Learner: progress",
        "Learner: train_bn",
        "MultiOptimizer.zero_grad: set_to_none",
    ],
)
def test_every_flag_takes_numpy_bools_and_refuses_truthy_strings(owner, tmp_path):
    make = _flag_owners(tmp_path)[owner]
    make(np.False_)  # a config tool's bool is a bool
    with pytest.raises(ArgTypeError, match=rf"{owner} must be True or False; got 'no'"):
        make("no")


# -- check_path ------------------------------------------------------------------
def test_check_path_takes_a_str_or_a_path_like():
    assert check_path("runs/a", "dirpath", example="'runs/a'") == Path("runs/a")
    assert check_path(Path("b.csv"), "path", example="'b.csv'") == Path("b.csv")


@pytest.mark.parametrize("blank", ["", "   ", "\t\n"])
def test_check_path_refuses_an_empty_or_blank_path_with_a_value_error(blank):
    with pytest.raises(ValueError) as info:
        check_path(blank, "path", owner="CSVLogger", what="a file path",
                   example="'logs/run.csv'")  # fmt: skip
    assert not isinstance(info.value, TypeError)  # the type is right
    assert str(info.value) == (
        f"CSVLogger: path must be a file path, not empty or blank; got {blank!r} "
        "(str). Fix: e.g. CSVLogger(path='logs/run.csv')."
    )


@pytest.mark.parametrize("bad", [None, 3, b"runs", ["runs"]])
def test_check_path_refuses_what_is_no_path_with_a_type_error(bad):
    with pytest.raises(TypeError) as info:
        check_path(bad, "log_dir", owner="TensorBoardLogger", what="a directory path",
                   example="'runs/exp1'")  # fmt: skip
    assert str(info.value) == (
        f"TensorBoardLogger: log_dir must be a directory path (str or os.PathLike); "
        f"got {bad!r} ({type(bad).__name__}). Fix: e.g. "
        "TensorBoardLogger(log_dir='runs/exp1')."
    )


def test_check_path_refuses_a_nul_character():
    with pytest.raises(ValueError, match=r"without a NUL character; got 'a\\x00b'"):
        check_path("a\0b", "path", example="'log.csv'")


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (Checkpoint, "dirpath"),
        (CSVLogger, "path"),
        (TensorBoardLogger, "log_dir"),
    ],
)
@pytest.mark.parametrize("blank", ["", " "])
def test_every_constructor_taking_a_path_refuses_an_empty_one_alike(make, name, blank):
    with pytest.raises(ValueError, match=f"{make.__name__}: {name} must be") as info:
        make(blank)
    assert not isinstance(info.value, TypeError)
    assert f"not empty or blank; got {blank!r} (str). Fix: e.g." in str(info.value)
