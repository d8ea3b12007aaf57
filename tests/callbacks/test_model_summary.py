"""``ModelSummary``: the summary shown as the first fit begins, changing nothing."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from helpers import make_data, make_model, train
from torch.nn import functional as F  # noqa: N812

from fitlib import Learner, Summary
from fitlib.callbacks import ModelSummary, Recorder


def test_a_fit_with_it_equals_one_without_bit_for_bit(capsys):
    with_it = train([ModelSummary()], epochs=2, mom=0.9)
    assert "Parameters: 227 total" in capsys.readouterr().out
    without = train([], epochs=2, mom=0.9)
    for a, b in zip(with_it.state_dict().values(), without.state_dict().values()):
        assert torch.equal(a, b)


def test_it_shows_the_summary_at_the_first_fit_only(capsys):
    shown = ModelSummary(depth=1)
    sgd = torch.optim.SGD
    learn = Learner(make_data(), make_model(), F.cross_entropy, metrics=[],
                    opt_func=sgd, callbacks=[shown], progress=False)  # fmt: skip
    learn.fit_one_cycle(1, 0.1)
    out = capsys.readouterr().out
    assert out.count("Parameters: 227 total, 227 trainable, 0 frozen") == 1
    assert "lr: set at every step by OneCycleScheduler" in out
    first = shown.summary
    assert first.callbacks[0] == (-250, "ModelSummary(depth=1)")
    names = [name.split("(")[0] for _, name in first.callbacks]
    assert names[1:] == ["OneCycleScheduler", "Recorder"]
    assert [r.name for r in first.layers] == ["0", "1", "2", "3", "4"]
    learn.fit(1, lr=0.1)
    assert "Parameters" not in capsys.readouterr().out
    assert shown.summary is first


def test_in_a_notebook_it_displays_the_html_table(monkeypatch, capsys):
    from fitlib.bars import fastprogress_module

    shown = []
    display = types.SimpleNamespace(display=shown.append)
    monkeypatch.setitem(sys.modules, "IPython.display", display)
    monkeypatch.setattr(fastprogress_module(), "IN_NOTEBOOK", True)
    train([ModelSummary()], epochs=1)
    assert len(shown) == 1 and isinstance(shown[0], Summary)
    assert "<table>" in shown[0]._repr_html_()
    assert "Parameters" not in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore:lr_find")
def test_the_lr_finder_sweep_does_not_show_it(capsys):
    learn = Learner(make_data(), make_model(), F.cross_entropy, metrics=[],
                    callbacks=[ModelSummary()], progress=False)  # fmt: skip
    learn.lr_find(num_it=5)
    assert "Parameters" not in capsys.readouterr().out
    assert learn.callbacks[0].summary is None


def test_it_runs_before_every_built_in_callback():
    assert ModelSummary.order < min(Recorder.order, -210)


@pytest.mark.parametrize("depth", [-1, "1"])
def test_depth_is_checked_when_it_is_built(depth):
    with pytest.raises(ValueError, match="ModelSummary: depth must be an int >= 0"):
        ModelSummary(depth=depth)
