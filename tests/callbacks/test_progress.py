import re
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
from fastprogress import fastprogress
from helpers import make_data, train

from fitlib import Callback, DataBunch
from fitlib.callback import call_hook
from fitlib.callbacks import progress
from fitlib.callbacks.progress import ProgressBar
from fitlib.callbacks.recorder import Recorder
from fitlib.metrics import Metrics, accuracy


# -- the table -------------------------------------------------------------------
def test_table_has_a_header_and_one_row_per_epoch_equal_to_the_recorder():
    rec, bar = Recorder(), ProgressBar(bars=True)
    train([rec, bar], epochs=3, metrics=[accuracy])
    header, *rows = bar.rows
    assert header == ["epoch", "train_loss", "valid_loss", "accuracy", "time"]
    assert [r[0] for r in rows] == ["0", "1", "2"]
    for row, epoch in zip(rows, rec.epoch_table(), strict=True):
        assert row[1] == f"{epoch['train_loss']:.6f}"
        assert row[2] == f"{epoch['valid_loss']:.6f}"
        assert row[3] == f"{epoch['accuracy']:.6f}"
        assert re.fullmatch(r"\d\d:\d\d", row[4])


def test_without_a_valid_set_the_valid_columns_show_na():
    bar = ProgressBar(bars=True)
    data = make_data()
    train([bar], epochs=1, data=DataBunch(data.train_dl, None), metrics=[accuracy])
    assert bar.rows[1][2:4] == ["#na#", "#na#"]
    assert bar.rows[1][1] != "#na#"


def test_each_fit_writes_its_own_table():
    bar = ProgressBar(bars=True)
    train([bar], epochs=2, metrics=[accuracy])
    train([bar], epochs=1)
    assert bar.rows[0] == ["epoch", "train_loss", "valid_loss", "time"]
    assert len(bar.rows) == 2


# -- bars ------------------------------------------------------------------------
def test_refresh_of_the_comment_is_paced_by_the_clock(
    clock, bar_calls, monkeypatch, capsys
):
    monkeypatch.setattr(fastprogress, "printing", lambda: True)  # as on a terminal
    reads = []
    copy = progress.HostCopy  # each read of the loss is a copy to the host
    monkeypatch.setattr(progress, "HostCopy", lambda ts: reads.append(1) or copy(ts))
    data = SimpleNamespace(train_dl=range(60), valid_dl=None)
    bar = ProgressBar(refresh=0.25, bars=True)
    call_hook(bar, "on_train_begin", n_epochs=1, metrics=Metrics([]), data=data)
    call_hook(bar, "on_epoch_begin")

    def batch(loss):
        t = torch.tensor(loss)
        call_hook(
            bar,
            "on_batch_end",
            train=True,
            data=data,
            last_loss=t,
            smooth_loss=t,
            last_target=torch.zeros(4),
        )

    batch(1.5)  # the first batch is drawn at once
    assert len(reads) == 1 and bar.pb.comment.endswith("1.5000")
    updates = sum(c[0] == "update" for c in bar_calls)
    for _ in range(40):  # frozen clock: no read, no redraw
        batch(2.0)
    assert len(reads) == 1
    assert sum(c[0] == "update" for c in bar_calls) == updates
    assert "/60" in capsys.readouterr().out
    clock.now += 0.3
    batch(3.0)
    assert len(reads) == 2 and bar.pb.comment.endswith("3.0000")
    assert bar_calls[-1][:3] == ("update", bar.pb, 42)
    out = capsys.readouterr().out  # drawn, with the new comment
    assert "[42/60" in out and "smooth loss 3.0000" in out
    batch(4.0)
    assert len(reads) == 2


class SlowCopy:
    """A copy to the host that arrives only when the test says (as on CUDA)."""

    arrived: ClassVar[set] = set()

    def __init__(self, scalars):
        self.value = scalars[0].item()

    def ready(self):
        return self.value in self.arrived

    def get(self):
        self.arrived.add(self.value)  # waiting for it: it arrives
        return [self.value]


def test_on_cuda_a_redraw_shows_the_last_copy_that_arrived_and_never_waits(
    clock, monkeypatch
):
    monkeypatch.setattr(progress, "HostCopy", SlowCopy)
    SlowCopy.arrived = set()
    data = SimpleNamespace(train_dl=range(4), valid_dl=None)
    bar = ProgressBar(refresh=0.25, bars=False)
    call_hook(bar, "on_train_begin", n_epochs=1, metrics=Metrics([]), data=data)
    call_hook(bar, "on_epoch_begin")

    def batch(loss):
        clock.now += 0.3  # every batch redraws
        t = torch.tensor(loss)
        call_hook(bar, "on_batch_end", train=True, data=data, smooth_loss=t)
        return bar.pb.comment

    assert batch(1.0) == ""  # its copy has not arrived: nothing shown yet
    SlowCopy.arrived.add(1.0)
    assert batch(2.0) == "smooth loss 1.0000"  # the earlier copy, not waited for
    assert batch(3.0) == "smooth loss 1.0000"  # 2.0 has not arrived
    assert SlowCopy.arrived == {1.0}  # no redraw waited
    pb = bar.pb
    assert batch(4.0) == "smooth loss 1.0000"
    call_hook(bar, "on_train_end", exception=None)  # the loader's end: it waits
    assert pb.comment == "smooth loss 4.0000" and 4.0 in SlowCopy.arrived


def test_a_resumed_run_starts_the_master_bar_at_its_epoch():
    data = SimpleNamespace(train_dl=range(3), valid_dl=None)
    bar = ProgressBar(bars=True)
    call_hook(
        bar, "on_train_begin", n_epochs=5, epoch=2, metrics=Metrics([]), data=data
    )
    call_hook(bar, "on_epoch_begin", epoch=2)
    t = torch.tensor(1.0)
    call_hook(
        bar,
        "on_batch_end",
        train=True,
        epoch=2,
        data=data,
        last_loss=t,
        smooth_loss=t,
        last_target=torch.zeros(2),
    )
    assert bar.pb.prefix.startswith("Epoch 3/5")


def test_train_and_valid_loaders_get_their_own_bar_that_ends_full(bar_calls):
    bar = ProgressBar(bars=True)
    train(
        [bar], epochs=1, metrics=[accuracy]
    )  # 7 training batches, 3 validation batches
    children = {c[1] for c in bar_calls if c[1] is not bar.mb.main_bar}
    assert sorted(b.total for b in children) == [3, 7]
    for child in children:
        last = [c[2] for c in bar_calls if c[0] == "update" and c[1] is child][-1]
        assert last == child.total and bar_calls.closed(child)
    assert bar_calls.closed(bar.mb.main_bar)


class Boom(Callback):
    def __init__(self, error):
        self.error = error

    def on_batch_end(self, iteration, **kwargs):
        if iteration == 3:
            raise self.error("boom")


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_bars_close_after_another_callback_raises(error, bar_calls):
    bar = ProgressBar(bars=True)
    with pytest.raises(error, match="boom") as info:
        train([Boom(error), bar], epochs=3, metrics=[accuracy])
    assert "ProgressBar" not in "".join(getattr(info.value, "__notes__", []))
    interrupted = [c[1] for c in bar_calls if c[0] == "on_interrupt"]
    assert bar.mb.main_bar in interrupted  # the master bar is finished
    assert any(b is not bar.mb.main_bar for b in interrupted)  # and the child
    assert bar.pb is None
    assert bar.rows == []  # no epoch finished: no table, not even its header


class StopAfter(Callback):
    def on_batch_end(self, train, iteration, **kwargs):
        if train and iteration == 2:
            return {"stop_training": True}


def test_stopping_early_closes_the_short_bar_and_the_master_bar(bar_calls):
    bar = ProgressBar(bars=True)
    train([StopAfter(), bar], epochs=3, metrics=[accuracy])
    train_bar = next(c[1] for c in bar_calls if getattr(c[1], "total", 0) == 7)
    assert bar_calls.closed(train_bar)
    assert bar_calls.closed(bar.mb.main_bar)
    assert len(bar.rows) == 2  # the epoch that stopped still has its row


class Unsized:
    """A loader without a length."""

    def __init__(self, dl):
        self.dl = dl

    def __iter__(self):
        return iter(self.dl)


def test_a_loader_without_length_gets_its_total_at_the_end(bar_calls):
    bar = ProgressBar(bars=True)
    data = make_data()
    train(
        [bar],
        epochs=1,
        data=DataBunch(Unsized(data.train_dl), data.valid_dl),
        metrics=[accuracy],
    )
    child = next(c[1] for c in bar_calls if c[0] == "update" and c[2] == 7)
    assert child.total == 7 and bar_calls.closed(child)


def test_refresh_must_be_a_non_negative_number():
    with pytest.raises(ValueError, match="refresh"):
        ProgressBar(refresh=-1)


# -- no host-device sync per batch -----------------------------------------------
SYNCS = ("item", "__float__", "__bool__", "tolist", "cpu")


def count_syncs(data):
    counts = dict.fromkeys(SYNCS, 0)
    with pytest.MonkeyPatch.context() as mp:
        for name in SYNCS:
            original = getattr(torch.Tensor, name)

            def counted(self, *args, _name=name, _original=original, **kwargs):
                counts[_name] += 1
                return _original(self, *args, **kwargs)

            mp.setattr(torch.Tensor, name, counted)
        train([Recorder(), ProgressBar()], epochs=2, data=data, metrics=[accuracy])
    return counts


def test_recorder_and_progress_bar_do_not_sync_per_batch(clock):
    few = make_data(n_train=64, n_valid=32, bs=16, shuffle=False)  # 4 + 2 batches
    many = make_data(n_train=256, n_valid=128, bs=16, shuffle=False)  # 16 + 8
    counts_few = count_syncs(few)
    counts_many = count_syncs(many)
    assert counts_few == counts_many
    assert counts_few["tolist"] >= 2  # the epoch-end transfers are counted


def test_without_a_terminal_only_the_aligned_table_is_printed(capsys):
    bar = ProgressBar()  # bars=None decides; pytest's stdout is no terminal
    data = make_data(n_train=40, n_valid=20, bs=8)
    train([Recorder(), bar], epochs=2, data=data, metrics=[accuracy])
    out = capsys.readouterr().out
    assert "█" not in out and "Epoch" not in out and "\r" not in out
    lines = out.splitlines()
    assert [line.split() for line in lines] == bar.rows
    assert lines[0].startswith("epoch     train_loss  valid_loss  accuracy  time")
    assert len(lines) == 3 and lines[1].index(bar.rows[1][1]) == len("epoch     ")


def test_without_a_terminal_stopping_mid_epoch_closes_the_bars(capsys):
    bar = ProgressBar(bars=False)  # the table-only bars, as in a log or CI
    train(
        [StopAfter(), bar], epochs=3, metrics=[accuracy]
    )  # stops in the first epoch's 3rd batch
    assert len(bar.rows) == 2 and "valid_loss" in capsys.readouterr().out
