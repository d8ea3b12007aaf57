"""SweepBar: the one bar LRFinder's sweep draws (no table), its loss read only
when redrawn."""

import pytest
import torch
from fastprogress import fastprogress
from helpers import train

from fitlib.callback import call_hook
from fitlib.callbacks.lr_finder import LRFinder
from fitlib.callbacks.sweep_bar import SweepBar


@pytest.mark.filterwarnings("ignore:lr_find:UserWarning")  # a toy sweep
def test_the_sweep_bar_draws_one_bar_over_the_sweeps_steps_and_no_table(
    bar_calls, monkeypatch, capsys
):
    monkeypatch.setattr(fastprogress, "printing", lambda: True)  # as on a terminal
    finder = LRFinder(1e-4, 1e-1, num_it=20)
    bar = SweepBar(20, bars=True)
    train([finder, bar], epochs=5)  # 3 epochs
    (drawn,) = {c[1] for c in bar_calls}  # one bar: no master bar, none per epoch
    updates = [c[2] for c in bar_calls if c[0] == "update"]
    assert drawn.total == 20 and updates[0] == 0 and updates[-1] == 20
    assert bar_calls.closed(drawn) and bar.pb is None
    out = capsys.readouterr().out
    assert "[20/20" in out and f"smooth loss {finder.losses[-1]:.4f}" in out
    assert "Epoch" not in out and "epoch" not in out and "#na#" not in out
    assert out.endswith("\n")  # what is printed next starts on its own line


def sweep_bar_batch(bar, step, loss, stop_training=False):
    call_hook(
        bar,
        "on_batch_end",
        train=True,
        step=step,
        smooth_loss=torch.tensor(loss),
        stop_training=stop_training,
    )


def test_the_sweep_bar_reads_the_loss_only_when_redrawn_and_closes_at_a_stop(
    clock, bar_calls, monkeypatch
):
    monkeypatch.setattr(fastprogress, "printing", lambda: True)
    reads = []
    original = torch.Tensor.__float__
    monkeypatch.setattr(
        torch.Tensor, "__float__", lambda t: reads.append(1) or original(t)
    )
    bar = SweepBar(100, refresh=0.25, bars=True)
    call_hook(bar, "on_train_begin")
    pb = bar.pb
    sweep_bar_batch(bar, 1, 2.3)  # the first step is drawn at once
    for step in range(2, 30):  # frozen clock: no read, no redraw
        sweep_bar_batch(bar, step, 2.2)
    assert len(reads) == 1 and pb.comment == "smooth loss 2.3000"
    clock.now += 0.3
    sweep_bar_batch(bar, 30, 2.0)
    assert len(reads) == 2 and bar_calls[-1][:3] == ("update", pb, 30)
    sweep_bar_batch(bar, 31, 9.0, stop_training=True)  # the finder saw a divergence
    assert len(reads) == 3 and pb.comment == "smooth loss 9.0000"
    assert ("update", pb, 31) in [c[:3] for c in bar_calls] and bar_calls.closed(pb)
    assert bar.pb is None
    call_hook(bar, "on_train_end")  # nothing left to close
    assert len(reads) == 3


def test_the_sweep_bar_is_interrupted_by_an_error_without_reading_the_loss(
    bar_calls, monkeypatch
):
    monkeypatch.setattr(fastprogress, "printing", lambda: True)
    bar = SweepBar(10, bars=True)
    call_hook(bar, "on_train_begin")
    pb = bar.pb
    sweep_bar_batch(bar, 1, 2.3)
    call_hook(bar, "on_train_end", exception=RuntimeError("boom"))
    assert any(c[0] == "on_interrupt" and c[1] is pb for c in bar_calls)
    assert bar.pb is None


@pytest.mark.filterwarnings("ignore:lr_find:UserWarning")  # a toy sweep
def test_the_sweep_bar_prints_nothing_without_a_terminal(capsys):
    bar = SweepBar(10)  # bars=None decides; pytest's stdout is no terminal
    train([LRFinder(num_it=10), bar], epochs=2)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("total", [0, 2.5, True, None])
def test_the_sweep_bar_needs_a_positive_int_total(total):
    with pytest.raises(ValueError, match=r"SweepBar: total must be an int >= 1; got"):
        SweepBar(total)
    with pytest.raises(ValueError, match=r"SweepBar\(refresh=0.25\)"):
        SweepBar(10, refresh=-1)
