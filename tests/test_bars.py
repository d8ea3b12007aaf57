"""``fitlib.bars``: whether a fit draws bars, and the stand-ins that draw
nothing and print only the table (a log, CI)."""

import pytest

from fitlib.bars import NoBar, TableOnly, check_refresh, draws_bars, master_bar


def test_bars_none_draws_only_in_a_terminal(monkeypatch):
    from fastprogress import fastprogress

    monkeypatch.setattr(fastprogress, "IN_NOTEBOOK", False)
    monkeypatch.setattr("sys.stdout.isatty", lambda: False)
    assert draws_bars(None) is False
    assert isinstance(master_bar(3, None), TableOnly)
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    assert draws_bars(None) is True
    assert draws_bars(False) is False and draws_bars(True) is True


def test_table_only_prints_aligned_rows_and_hands_out_bars_that_draw_nothing(
    capsys,
):
    table = TableOnly()
    table.write(["epoch", "train_loss", "time"])
    table.write(["0", "1.234567", "00:01"])
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["epoch     train_loss  time", "0         1.234567    00:01"]
    bar = table.progress(range(7), total=7)
    assert isinstance(bar, NoBar) and bar.total == 7
    assert NoBar("noinfer").total is None  # fastprogress's "count it yourself"


def test_refresh_must_be_a_number_of_seconds():
    assert check_refresh(0.5, "ProgressBar") == 0.5
    with pytest.raises(ValueError, match=r"ProgressBar: refresh must be .* >= 0"):
        check_refresh(-1, "ProgressBar")
    with pytest.raises(TypeError, match=r"got 'often' \(str\)"):
        check_refresh("often", "ProgressBar")
