"""History: the records of one fit, a list with a short repr, a table and a plot."""

import copy
import math
import pickle

import matplotlib.pyplot as plt
import pytest

from fitlib import History


def rec(epoch, train, valid, acc, lr=0.1, seconds=1.5, **extra):
    values = {"train_loss": train, "valid_loss": valid, "accuracy": acc}
    return {"epoch": epoch, **values, **extra, "lr": lr, "time": seconds}


RECORDS = [rec(0, 0.9123, 0.8, 0.5), rec(1, 0.5, 0.6, 0.7), rec(2, 0.123456, 0.4, 0.9)]


def test_a_history_is_the_list_of_records():
    history = History(RECORDS)
    assert isinstance(history, list)
    assert history == RECORDS and list.__eq__(RECORDS, history)
    assert len(history) == 3 and history[-1]["accuracy"] == 0.9
    assert history[1:] == RECORDS[1:]
    assert type(copy.deepcopy(history)) is History
    assert pickle.loads(pickle.dumps(history)) == history


def test_repr_is_one_short_line_from_the_first_to_the_last_values():
    assert repr(History(RECORDS)) == (
        "History(3 epochs: train_loss 0.9123 -> 0.1235, valid_loss 0.8 -> 0.4, "
        "accuracy 0.5 -> 0.9)"
    )
    assert repr(History()) == "History(0 epochs)"
    one = History([rec(0, 0.5, None, None)])  # validation skipped: no values
    assert repr(one) == "History(1 epoch: train_loss 0.5)"


def test_repr_names_at_most_three_values_and_counts_the_others():
    many = History([rec(0, 1.0, 1.0, 0.1, f1=0.2, r2=0.3)])
    assert repr(many) == (
        "History(1 epoch: train_loss 1, valid_loss 1, accuracy 0.1; 2 more values "
        "in .table())"
    )


def test_repr_counts_records_and_epochs_with_validations_inside_epochs():
    rows = [{"epoch": e, "step": s, "train_loss": 1.0 / s, "lr": 0.1, "time": 1.0}
            for e, s in ((0, 1), (0, 2), (1, 4))]  # fmt: skip
    assert repr(History(rows)) == (
        "History(3 records in 2 epochs: train_loss 1 -> 0.25)"
    )


def test_table_shows_every_value_of_every_record():
    rows = [*RECORDS[:2], rec(2, 0.1, None, None)]
    lines = History(rows).table().splitlines()
    assert lines[0].split() == [
        "epoch", "train_loss", "valid_loss", "accuracy", "lr", "time",
    ]  # fmt: skip
    assert lines[1].split() == ["0", "0.912300", "0.800000", "0.500000",
                                "1.00e-01", "00:01"]  # fmt: skip
    assert lines[3].split()[2:4] == ["#na#", "#na#"]  # not computed
    assert lines[0].index("valid_loss") == lines[1].index("0.800000")  # aligned
    assert History().table() == ""


def test_plot_draws_the_losses_and_each_metric_against_the_epoch(tmp_path):
    rows = [rec(e, 1 - e / 4, 1 - e / 5, e / 4, train_accuracy=e / 3)
            for e in range(3)]  # fmt: skip
    rows[1]["valid_loss"] = None  # validation skipped: a gap
    axes = History(rows).plot()
    loss, acc = axes
    lines = {line.get_label(): list(line.get_ydata()) for line in loss.get_lines()}
    assert lines["train_loss"] == [1.0, 0.75, 0.5]
    assert lines["valid_loss"][0] == 1.0 and math.isnan(lines["valid_loss"][1])
    assert list(loss.get_lines()[0].get_xdata()) == [0, 1, 2]
    assert loss.get_ylabel() == "loss" and loss.get_xlabel() == "epoch"
    assert [line.get_label() for line in acc.get_lines()] == [
        "accuracy", "train_accuracy",
    ]  # fmt: skip
    axes[0].figure.savefig(tmp_path / "history.png")
    assert (tmp_path / "history.png").stat().st_size > 0
    plt.close("all")


def test_plot_with_validations_inside_epochs_is_against_the_step():
    rows = [{"epoch": 0, "step": s, "train_loss": 1.0 / s, "time": 1.0}
            for s in (5, 10)]  # fmt: skip
    ax = History(rows).plot()
    assert ax.get_xlabel() == "step"
    assert list(ax.get_lines()[0].get_xdata()) == [5, 10]
    plt.close("all")


def test_plot_of_an_empty_history_says_why():
    with pytest.raises(ValueError, match="no record"):
        History().plot()


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)  # import fails
    with pytest.raises(ImportError, match=r"History.*pip install matplotlib"):
        History(RECORDS).plot()


def test_a_history_in_a_torch_file_loads_with_weights_only(tmp_path):
    import torch

    history = History(RECORDS)
    torch.save({"h": history}, tmp_path / "h.pth")
    loaded = torch.load(tmp_path / "h.pth")  # weights_only=True, the default
    assert loaded["h"] == RECORDS and type(loaded["h"]) is History
    assert type(copy.copy(history)) is History


def test_a_slice_of_a_history_is_a_history():
    history = History(RECORDS)
    assert type(history[1:]) is History and history[1:] == RECORDS[1:]
    assert repr(history[:1]).startswith("History(1 epoch:")
    assert history[-1] == RECORDS[-1]  # one record stays a dict
