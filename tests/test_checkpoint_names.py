import pytest

from fitlib.checkpoint_names import FileTemplate


def test_fills_record_values_and_counters_with_their_specs():
    names = FileTemplate("{epoch:03d}-{step}-{f0.5_score:.2f}")
    record = {"epoch": 2, "f0.5_score": 0.8765}
    assert names.fill(record, step=30, iteration=31) == "002-30-0.88.pth"
    assert names.record_names == ["f0.5_score"]  # a name with a dot is one name


def test_a_value_missing_from_the_record_is_written_nan():
    names = FileTemplate("{epoch}-{valid_loss:.3f}")
    assert names.fill({"epoch": 1, "valid_loss": None}, 7, 7) == "1-nan.pth"


def test_a_template_ending_in_pth_is_not_given_a_second_one():
    assert FileTemplate("w{epoch}.pth").fill({"epoch": 0}, 0, 0) == "w0.pth"


def test_names_not_in_the_fit_are_refused_with_the_names_that_exist():
    from fitlib.metrics import Metrics, accuracy

    names = FileTemplate("{epoch}-{acc:.2f}")
    with pytest.raises(ValueError, match=r"uses \{acc\}.*exist are \[.*'accuracy'\]"):
        names.check(Metrics([accuracy]), None, None, (), None)
    FileTemplate("{accuracy}").check(Metrics([accuracy]), None, None, (), None)


@pytest.mark.parametrize(
    ("template", "message"),
    [("{valid_loss:d}", "format spec"), ("best{}", "names no value"),
     ("{a.b}x{", "not a format template"), ("best", "no field"), (3, "str")],
)  # fmt: skip
def test_bad_templates_are_refused(template, message):
    with pytest.raises((ValueError, TypeError), match=message):
        FileTemplate(template)


def test_a_filled_name_of_a_regular_checkpoint_is_refused():
    names = FileTemplate("{tag}")  # a value a callback adds, a string here
    with pytest.raises(ValueError, match="regular checkpoints'"):
        names.fill({"tag": "checkpoint-3"}, 0, 0)
