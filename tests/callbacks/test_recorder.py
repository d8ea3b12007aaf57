import io
import math
import sys

import matplotlib.pyplot as plt
import pytest
import torch
from helpers import make_data, make_model, scripted_record, train
from matplotlib.axes import Axes
from torch.nn import functional as F  # noqa: N812

from fitlib import Callback, DataBunch, HPOptimizer, fit
from fitlib.callback import call_hook
from fitlib.callbacks import Checkpoint
from fitlib.callbacks import recorder as recorder_module
from fitlib.callbacks.recorder import Recorder
from fitlib.metrics import Metrics, accuracy, error_rate
from fitlib.running_loss import LossSmoother


class FakeOpt:
    """Just the param_groups the Recorder reads."""

    def __init__(self, *groups):
        self.param_groups = list(groups)


def record_step(rec, loss, bs, opt):
    """Calls on_batch_end for a training batch as the handler would."""
    call_hook(
        rec,
        "on_batch_end",
        train=True,
        opt=opt,
        last_loss=torch.tensor(loss),
        last_target=torch.zeros(bs),
        last_input=torch.zeros(bs, 3),
    )


def drive_epoch(rec, losses, sizes, last_metrics, opt=None, valid_batches=2):
    """Calls the hooks of one epoch the way the handler would."""
    opt = opt or FakeOpt({"lr": 0.1, "momentum": 0.9})
    call_hook(rec, "on_epoch_begin")
    for loss, bs in zip(losses, sizes, strict=True):
        record_step(rec, loss, bs, opt)
    for _ in range(valid_batches):  # validation batches must not be recorded
        call_hook(
            rec,
            "on_batch_end",
            last_loss=torch.tensor(99.0),
            last_target=torch.zeros(5),
        )
    record = scripted_record(losses, sizes, last_metrics, rec.metric_names)
    call_hook(rec, "on_epoch_end", last_metrics=last_metrics, record=record)


class LossSpy(Callback):
    """Reads every training loss (a sync per batch: fine in a test)."""

    def __init__(self):
        self.losses, self.sizes = [], []

    def on_batch_end(self, train, last_loss, last_target, **kwargs):
        if train:
            self.losses.append(float(last_loss))
            self.sizes.append(len(last_target))


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_smooth_losses_are_the_loops_smooth_loss():
    class Watch(Callback):
        def __init__(self):
            self.smooth = []

        def on_batch_end(self, train, smooth_loss):
            if train:
                self.smooth.append(float(smooth_loss))

    rec, watch = Recorder(), Watch()
    train([rec, watch], epochs=2, metrics=[accuracy], mom=0.9)
    # a new fit starts a new average, as the loop
    train([rec, watch], epochs=1, metrics=[accuracy], mom=0.9)
    assert rec.smooth_losses == pytest.approx(watch.smooth, rel=1e-6)
    assert rec.smooth_losses[0] == rec.losses[0] != rec.smooth_losses[1]


# -- scripted hooks --------------------------------------------------------------
def test_epoch_train_loss_is_sample_weighted_with_a_ragged_last_batch():
    rec = Recorder()
    call_hook(rec, "on_train_begin", metrics=Metrics([accuracy]))
    drive_epoch(
        rec, [1.0, 2.0, 6.0], [4, 4, 2], [torch.tensor(0.5), torch.tensor(0.75)]
    )
    # (4*1 + 4*2 + 2*6) / 10 = 2.4, where the mean of batch means says 3.0.
    assert rec.train_losses == [pytest.approx(2.4)]
    assert rec.losses == [1.0, 2.0, 6.0]
    # The debiased average, as a weighted sum: sum 0.98**(n-i) 0.02 l_i / (1-0.98**n)
    smooth = [
        sum(0.98 ** (n - i) * 0.02 * v for i, v in enumerate([1.0, 2.0, 6.0][:n], 1))
        / (1 - 0.98**n)
        for n in (1, 2, 3)
    ]
    assert rec.smooth_losses == pytest.approx(smooth, rel=1e-12)
    assert rec.batch_sizes == [4, 4, 2]
    assert rec.valid_losses == [0.5]
    assert rec.metrics == [[0.75]]
    assert rec.metric_names == ["accuracy"]
    assert rec.iterations == [0, 1, 2]
    assert rec.epoch_iterations == [2]


def test_values_are_python_floats_after_an_epoch():
    rec = Recorder()
    call_hook(rec, "on_train_begin", metrics=Metrics([accuracy]))
    drive_epoch(rec, [1.0, 2.0], [3, 3], [torch.tensor(0.5), torch.tensor(0.25)])
    for values in (
        rec.losses,
        rec.smooth_losses,
        rec.lrs,
        rec.train_losses,
        rec.valid_losses,
        rec.metrics[0],
        rec.times,
    ):
        assert all(type(v) is float for v in values)


def test_records_lr_and_momentum_of_the_last_param_group():
    rec = Recorder()
    opt = FakeOpt({"lr": 0.1, "momentum": 0.9}, {"lr": 0.01, "betas": (0.8, 0.99)})
    drive_epoch(rec, [1.0, 1.0], [2, 2], None, opt=opt)
    assert rec.lrs == [0.01, 0.01]
    assert rec.moms == [0.8, 0.8]
    drive_epoch(rec, [1.0], [2], None, opt=FakeOpt({"lr": 0.5}))
    assert rec.lrs[-1] == 0.5
    assert rec.moms[-1] is None


def test_skipped_validation_records_nan_for_valid_loss_and_metrics():
    rec = Recorder()
    call_hook(rec, "on_train_begin", metrics=Metrics([accuracy, accuracy]))
    drive_epoch(rec, [1.0], [2], None)
    assert math.isnan(rec.valid_losses[0])
    assert len(rec.metrics[0]) == 2 and all(math.isnan(m) for m in rec.metrics[0])


def test_reading_losses_mid_epoch_keeps_the_epoch_mean_exact():
    rec = Recorder()
    opt = FakeOpt({"lr": 0.1})
    call_hook(rec, "on_epoch_begin")
    for i, (loss, bs) in enumerate([(1.0, 4), (2.0, 4), (6.0, 2)]):
        record_step(rec, loss, bs, opt)
        assert len(rec.losses) == i + 1  # a read moves the pending steps
    valid = [torch.tensor(1.0)]
    record = scripted_record([1.0, 2.0, 6.0], [4, 4, 2], valid)
    call_hook(rec, "on_epoch_end", last_metrics=valid, record=record)
    assert rec.train_losses == [pytest.approx(2.4)]


def test_epoch_table_has_one_row_per_epoch_with_metric_columns():
    rec = Recorder()
    call_hook(rec, "on_train_begin", metrics=Metrics([accuracy]))
    drive_epoch(rec, [1.0], [2], [torch.tensor(0.5), torch.tensor(0.75)])
    drive_epoch(rec, [2.0], [2], [torch.tensor(0.25), torch.tensor(1.0)])
    table = rec.epoch_table()
    assert [r["epoch"] for r in table] == [0, 1]
    assert list(table[1]) == ["epoch", "train_loss", "valid_loss", "accuracy", "time"]
    assert (table[1]["train_loss"], table[1]["accuracy"]) == (2.0, 1.0)


def test_reset_forgets_the_history():
    rec = Recorder()
    drive_epoch(rec, [1.0, 2.0], [2, 2], [torch.tensor(1.0)])
    rec.reset()
    assert rec.losses == [] and rec.iterations == [] and rec.epochs == []
    assert rec.epoch_table() == []


# -- through fit -----------------------------------------------------------------
def test_train_loss_through_fit_is_the_exact_sample_weighted_mean():
    rec, spy = Recorder(), LossSpy()
    # 100 samples in batches of 16: the last has 4
    train([rec, spy], epochs=1, metrics=[accuracy], mom=0.9)
    assert spy.sizes[-1] == 4
    expected = sum(v * n for v, n in zip(spy.losses, spy.sizes, strict=True)) / 100
    assert rec.train_losses[0] == pytest.approx(expected, rel=1e-6)
    assert rec.train_losses[0] != pytest.approx(sum(spy.losses) / len(spy.losses))
    assert rec.losses == pytest.approx(spy.losses)


class ChangeLr(Callback):
    """Sets the lr for the next step after batch 2, and for batch 4 itself."""

    def on_batch_begin(self, train, iteration, opt, **kwargs):
        if train and iteration == 4:
            opt.lr = 0.001

    def on_batch_end(self, train, iteration, opt, **kwargs):
        if train and iteration == 2:
            opt.lr = 0.01


def test_lrs_follow_an_lr_changed_during_training():
    rec = Recorder()
    train([rec, ChangeLr()], epochs=1, metrics=[accuracy], mom=0.9)
    # Each step is recorded with the lr that opt.step() used.
    assert rec.lrs == [0.1] * 3 + [0.01] + [0.001] * 3
    assert rec.moms == [0.9] * 7


def test_history_continues_across_two_fits():
    rec = Recorder()
    train([rec], epochs=2, metrics=[accuracy], mom=0.9)
    train([rec], epochs=1, metrics=[accuracy], mom=0.9)
    assert rec.iterations == list(range(21))
    assert rec.epochs == [0, 1, 2]
    assert rec.epoch_iterations == [6, 13, 20]
    assert len(rec.losses) == len(rec.lrs) == len(rec.batch_sizes) == 21
    assert len(rec.train_losses) == len(rec.valid_losses) == len(rec.times) == 3


def test_state_dict_round_trip_restores_an_equal_history():
    rec = Recorder()
    train([rec], epochs=2, metrics=[accuracy], mom=0.9)
    buf = io.BytesIO()
    torch.save(rec.state_dict(), buf)
    buf.seek(0)
    restored = Recorder()
    restored.load_state_dict(torch.load(buf, weights_only=True))
    assert restored.state_dict() == rec.state_dict()
    assert restored.epoch_table() == rec.epoch_table()
    # and it continues from there
    train([restored], epochs=1, metrics=[accuracy], mom=0.9)
    assert restored.epochs == [0, 1, 2]
    assert restored.iterations == list(range(21))


def test_state_dict_holds_only_plain_python_values():
    rec = Recorder()
    train([rec], epochs=1, metrics=[accuracy], mom=0.9)

    def plain(v):
        if isinstance(v, dict):
            return all(isinstance(k, str) and plain(o) for k, o in v.items())
        if isinstance(v, list):
            return all(plain(o) for o in v)
        return v is None or isinstance(v, (int, float, str))

    sd = rec.state_dict()
    assert all(plain(v) for v in sd.values())
    sd["lrs"].append(123.0)  # a copy: changing it leaves the Recorder alone
    assert 123.0 not in rec.lrs


def test_load_state_dict_rejects_missing_keys_and_truncated_lists():
    rec = Recorder()
    train([rec], epochs=1, metrics=[accuracy], mom=0.9)
    sd = rec.state_dict()
    with pytest.raises(ValueError, match=r"lacks.*'times'"):
        Recorder().load_state_dict({k: v for k, v in sd.items() if k != "times"})
    sd["losses"] = sd["losses"][:-1]
    with pytest.raises(ValueError, match="truncated"):
        Recorder().load_state_dict(sd)


# -- plots -----------------------------------------------------------------------
def test_plots_return_the_axes_they_drew_with_the_expected_lines():
    rec = Recorder()
    train([rec], epochs=2, metrics=[accuracy, error_rate], mom=0.9)
    ax = rec.plot_losses()
    assert isinstance(ax, Axes)
    labels = [line.get_label() for line in ax.lines]
    assert labels == ["train (raw)", "train (smoothed)", "train (epoch mean)", "valid"]
    lr_ax = rec.plot_lr()
    assert isinstance(lr_ax, Axes) and list(lr_ax.lines[0].get_ydata()) == rec.lrs
    lr, mom = rec.plot_lr(show_moms=True)
    assert lr.figure is mom.figure and mom.get_ylabel() == "momentum"
    assert list(mom.lines[0].get_ydata()) == [0.9] * 14
    acc, err = rec.plot_metrics()
    assert (acc.get_ylabel(), err.get_ylabel()) == ("accuracy", "error_rate")
    assert acc.figure is err.figure
    assert all(len(a.lines[0].get_xdata()) == 2 for a in (acc, err))
    single = Recorder()
    train([single], epochs=1, metrics=[accuracy], mom=0.9)
    assert isinstance(single.plot_metrics(), Axes)  # one metric: one Axes


def test_plot_losses_shows_each_epochs_mean_train_loss_beside_the_valid_loss():
    rec = Recorder()
    train([rec], epochs=3, metrics=[accuracy], mom=0.9)
    lines = {line.get_label(): line for line in rec.plot_losses().lines}
    means, valid = lines["train (epoch mean)"], lines["valid"]
    # At each epoch's last iteration: the numbers of the epoch table.
    assert list(means.get_xdata()) == list(valid.get_xdata()) == rec.epoch_iterations
    assert list(means.get_ydata()) == [r["train_loss"] for r in rec.epoch_table()]
    assert list(valid.get_ydata()) == rec.valid_losses
    assert means.get_marker() == "s" and means.get_linestyle() == "None"
    # Train points share the train curves' colour; valid has its own.
    assert means.get_color() == lines["train (smoothed)"].get_color()
    assert valid.get_color() != means.get_color()


def test_plot_losses_without_validation_draws_the_train_lines_and_epoch_means():
    rec = Recorder()
    data = make_data()
    train([rec], epochs=1, data=DataBunch(data.train_dl, None), mom=0.9)
    labels = [line.get_label() for line in rec.plot_losses().lines]
    assert labels == ["train (raw)", "train (smoothed)", "train (epoch mean)"]
    train([rec], epochs=1, mom=0.9)  # one epoch with validation, one without
    valid = rec.plot_losses().lines[-1]
    assert valid.get_label() == "valid"
    ys = list(valid.get_ydata())
    assert math.isnan(ys[0]) and ys[1] == rec.valid_losses[1]


@pytest.mark.parametrize("plot", ["plot_losses", "plot_lr", "plot_metrics"])
def test_plotting_before_fit_says_to_call_fit(plot):
    with pytest.raises(ValueError, match="call fit first"):
        getattr(Recorder(), plot)()


def test_plot_metrics_without_metrics_and_moms_without_momentum_explain_why():
    rec = Recorder()
    drive_epoch(rec, [1.0], [2], [torch.tensor(1.0)], opt=FakeOpt({"lr": 0.1}))
    with pytest.raises(ValueError, match=r"metrics=\[\.\.\.\]"):
        rec.plot_metrics()
    with pytest.raises(ValueError, match="show_moms=False"):
        rec.plot_lr(show_moms=True)


def test_plots_leave_their_figures_open_for_pyplot_to_show():
    rec = Recorder()
    train([rec], epochs=2, metrics=[accuracy, error_rate], mom=0.9)
    plt.close("all")
    losses = rec.plot_losses()
    lr, _ = rec.plot_lr(show_moms=True)
    metrics, _ = rec.plot_metrics()
    # One open figure per call: plt.show() (or a notebook cell's end) shows each.
    figures = [ax.figure.number for ax in (losses, lr, metrics)]
    assert plt.get_fignums() == figures and len(set(figures)) == 3


def test_plots_draw_into_the_axes_given_and_make_no_figure():
    rec = Recorder()
    train([rec], epochs=2, metrics=[accuracy, error_rate], mom=0.9)
    plt.close("all")
    _, (left, right) = plt.subplots(1, 2)
    assert rec.plot_losses(ax=left) is left and len(left.lines) == 4
    assert rec.plot_lr(ax=right) is right and len(right.lines) == 1
    _, grid = plt.subplots(1, 2)  # the array plt.subplots returns
    assert rec.plot_lr(show_moms=True, ax=grid) == list(grid)
    assert rec.plot_metrics(ax=[left, right]) == [left, right]
    assert right.get_ylabel() == "error_rate"
    assert len(plt.get_fignums()) == 2  # no figure of their own


def test_a_wrong_number_of_axes_is_refused_with_the_number_needed():
    rec = Recorder()
    train([rec], epochs=1, metrics=[accuracy, error_rate], mom=0.9)
    _, (a, b, c) = plt.subplots(1, 3)
    with pytest.raises(ValueError, match=r"needs 2 Axes.*got 1"):
        rec.plot_lr(show_moms=True, ax=a)
    with pytest.raises(ValueError, match=r"\(accuracy, error_rate\) and needs 2"):
        rec.plot_metrics(ax=[a, b, c])
    with pytest.raises(ValueError, match=r"plot_losses .*needs 1 Axes.*got 2"):
        rec.plot_losses(ax=[a, b])
    with pytest.raises(TypeError, match="ax must be a matplotlib Axes"):
        rec.plot_lr(ax="left")
    assert rec.plot_losses(ax=[a]) is a  # a sequence of the right length is fine


def test_plots_without_matplotlib_say_how_to_install_it(monkeypatch):
    rec = Recorder()
    drive_epoch(rec, [1.0], [2], [torch.tensor(1.0)])
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)  # import fails
    with pytest.raises(ImportError, match="pip install matplotlib"):
        rec.plot_losses()


# -- plot_lr_find ------------------------------------------------------------------
def sweep(n=40, suggestions=None):
    """An LR finder result: flat, falling to a minimum, then a 100x spike."""
    lrs = [1e-6 * 10 ** (7 * i / (n - 1)) for i in range(n)]
    losses = [
        2.0 - 1.5 * math.exp(-(((i - 0.7 * n) / (0.15 * n)) ** 2)) for i in range(n)
    ]
    losses[-3:] = [5.0, 20.0, 200.0]  # the divergence
    return {"lrs": lrs, "losses": losses, "suggestions": suggestions or {}}


def test_plot_lr_find_leaves_out_the_ends_and_clips_the_divergence():
    rec = Recorder()
    rec.lr_find_result = result = sweep(40)
    ax = rec.plot_lr_find(skip_start=3, skip_end=2)
    curve = ax.lines[0]
    assert list(curve.get_xdata()) == result["lrs"][3:38]
    assert list(curve.get_ydata()) == result["losses"][3:38]
    assert ax.get_xscale() == "log"
    bottom, top = ax.get_ylim()
    start, low = result["losses"][3], min(result["losses"])
    # The spike (up to 20 here) is cut a little above the curve's start.
    assert start < top <= start + 0.2 * (start - low) and bottom < low
    default = rec.plot_lr_find()
    assert list(default.lines[0].get_xdata()) == result["lrs"][5:35]


def test_plot_lr_find_keeps_half_a_short_sweep():
    rec = Recorder()
    rec.lr_find_result = result = sweep(10)
    xs = list(rec.plot_lr_find().lines[0].get_xdata())  # 5 + 5 of 10 points
    assert xs == result["lrs"][2:7]
    assert len(rec.plot_lr_find(skip_start=0, skip_end=9).lines[0].get_xdata()) == 5
    assert len(rec.plot_lr_find(skip_start=0, skip_end=0).lines[0].get_xdata()) == 10


def test_plot_lr_find_marks_every_suggestion_with_its_own_marker():
    rec = Recorder()
    result = sweep(40)
    lrs = result["lrs"]
    names = {"valley": lrs[20], "steepest": lrs[24], "min_div10": lrs[28] / 10}
    names["early"] = lrs[1]  # in the left-out start
    rec.lr_find_result = result | {"suggestions": names}
    ax = rec.plot_lr_find()
    marks = ax.lines[1:]
    labels = [m.get_label() for m in marks]
    assert [label.split(":")[0] for label in labels] == list(names)
    assert len({m.get_marker() for m in marks}) == 4
    valley = marks[0]
    assert (valley.get_xdata()[0], valley.get_ydata()[0]) == (
        lrs[20],
        result["losses"][20],
    )
    early = marks[3]  # hollow, at the first plotted point
    assert (early.get_xdata()[0], early.get_ydata()[0]) == (lrs[5], result["losses"][5])
    assert early.get_fillstyle() == "none" and "left out" in labels[3]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == labels


def test_plot_lr_find_draws_into_the_given_axes():
    rec = Recorder()
    rec.lr_find_result = sweep(20, {"valley": 1e-3})
    plt.close("all")
    fig, ax = plt.subplots()
    assert rec.plot_lr_find(ax=ax) is ax and len(ax.lines) == 2
    assert plt.get_fignums() == [fig.number]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"skip_start": -1}, r"skip_start must be an int >= 0; got -1"),
        ({"skip_end": 2.5}, r"skip_end must be an int >= 0; got 2.5"),
        ({"skip_end": True}, "skip_end"),
    ],
)
def test_plot_lr_find_refuses_bad_skips(kwargs, match):
    rec = Recorder()
    rec.lr_find_result = sweep(20)
    with pytest.raises(ValueError, match=match):
        rec.plot_lr_find(**kwargs)


# -- fits with different metrics -------------------------------------------------
def test_epoch_table_and_plot_keep_each_epochs_own_metric_names():
    rec = Recorder()
    call_hook(rec, "on_train_begin", metrics=Metrics([accuracy]))
    drive_epoch(rec, [1.0], [2], [torch.tensor(0.5), torch.tensor(0.75)])
    call_hook(rec, "on_train_begin", metrics=Metrics([error_rate, accuracy]))
    drive_epoch(rec, [1.0], [2], [torch.tensor(0.25), 0.125, torch.tensor(0.875)])
    first, second = ({k: r[k] for k in r if k != "time"} for r in rec.epoch_table())
    assert first == {"epoch": 0, "train_loss": 1.0, "valid_loss": 0.5, "accuracy": 0.75}
    assert second == {
        "epoch": 1,
        "train_loss": 1.0,
        "valid_loss": 0.25,
        "error_rate": 0.125,
        "accuracy": 0.875,
    }
    assert rec.epoch_metric_names == [["accuracy"], ["error_rate", "accuracy"]]
    assert rec.metric_names == ["error_rate", "accuracy"]
    axes = rec.plot_metrics()
    assert [ax.get_ylabel() for ax in axes] == ["accuracy", "error_rate"]
    assert list(axes[0].lines[0].get_ydata()) == [0.75, 0.875]
    errors = list(axes[1].lines[0].get_ydata())
    assert math.isnan(errors[0]) and errors[1] == 0.125


class MetricSpy(Callback):
    """Reads each epoch's validation results, named by the fit's metrics."""

    def __init__(self):
        self.rows = []

    def on_train_begin(self, metrics, **kwargs):
        self.names = list(metrics.names)

    def on_epoch_end(self, last_metrics, **kwargs):
        valid_loss, *values = (float(v) for v in last_metrics)
        self.rows.append(
            {"valid_loss": valid_loss} | dict(zip(self.names, values, strict=True))
        )


def test_two_fits_with_different_metrics_label_every_epoch_right():
    rec, spy = Recorder(), MetricSpy()
    train([rec, spy], epochs=2, metrics=[accuracy], mom=0.9)
    train([rec, spy], epochs=1, metrics=[error_rate, accuracy], mom=0.9)
    table = rec.epoch_table()
    assert [list(r) for r in table] == [
        ["epoch", "train_loss", "valid_loss", "accuracy", "time"]
    ] * 2 + [["epoch", "train_loss", "valid_loss", "error_rate", "accuracy", "time"]]
    for row, expected in zip(table, spy.rows, strict=True):
        got = {k: v for k, v in row.items() if k not in ("epoch", "train_loss", "time")}
        assert got == pytest.approx(expected)
    assert table[2]["error_rate"] == pytest.approx(1 - table[2]["accuracy"])
    axes = rec.plot_metrics()
    assert [ax.get_ylabel() for ax in axes] == ["accuracy", "error_rate"]
    accs = [r["accuracy"] for r in spy.rows]
    assert list(axes[0].lines[0].get_ydata()) == pytest.approx(accs)
    errors = list(axes[1].lines[0].get_ydata())
    assert all(math.isnan(e) for e in errors[:2])
    assert errors[2] == pytest.approx(spy.rows[2]["error_rate"])


def test_state_dict_round_trip_keeps_the_metric_names_of_each_epoch():
    rec = Recorder()
    train([rec], epochs=1, metrics=[accuracy], mom=0.9)
    train([rec], epochs=1, metrics=[error_rate], mom=0.9)
    buf = io.BytesIO()
    torch.save(rec.state_dict(), buf)
    buf.seek(0)
    restored = Recorder()
    restored.load_state_dict(torch.load(buf, weights_only=True))
    assert restored.epoch_metric_names == [["accuracy"], ["error_rate"]]
    assert restored.metric_names == ["error_rate"]
    assert restored.epoch_table() == rec.epoch_table()
    sd = rec.state_dict()
    sd["epoch_metric_names"][0].append("changed")  # state_dict copies the lists
    assert rec.epoch_metric_names[0] == ["accuracy"]
    restored.load_state_dict(sd)
    sd["epoch_metric_names"][1].append("changed")  # and so does load_state_dict
    assert restored.epoch_metric_names[1] == ["error_rate"]
    sd["epoch_metric_names"] = sd["epoch_metric_names"][:-1]
    with pytest.raises(ValueError, match="truncated"):
        Recorder().load_state_dict(sd)


def test_a_batch_without_a_step_records_the_latest_steps_lr():
    class StepEveryOther(Callback):  # as gradient accumulation does
        def on_backward_end(self, iteration, **kwargs):
            return {"skip_step": iteration % 2 == 0}

        def on_batch_end(self, train, iteration, opt, **kwargs):
            if train:
                opt.lr = 0.1 / (iteration + 2)

    rec = Recorder()
    train([rec, StepEveryOther()], epochs=1, metrics=[accuracy], mom=0.9)
    # Batch 1 steps with the lr set after batch 0; batch 2 has no step and
    # repeats it; batch 3 steps with the lr set after batch 2.
    assert rec.lrs[1:4] == [0.05, 0.05, 0.1 / 4]


# -- bounded per-step history -------------------------------------------------------
PER_EPOCH = 20


def script(i):
    """Step i's loss (exact in float32), batch size, lr and momentum."""
    return 1 + (i * 7 % 11) / 8, 3 + i % 4, 1e-3 * (i + 1), 0.9 - i / 1000


def valid_loss(epoch):
    return 0.5 + epoch / 8


def run_steps(rec, first, stop):
    """Drives steps first..stop-1 of a scripted fit, PER_EPOCH steps an epoch;
    a run that begins part way (first > 0) is a resumed one."""
    call_hook(rec, "on_train_begin", metrics=Metrics([]), iteration=first)
    for i in range(first, stop):
        if i % PER_EPOCH == 0 or i == first:
            call_hook(rec, "on_epoch_begin", num_batch=i % PER_EPOCH)
        loss, bs, lr, mom = script(i)
        record_step(rec, loss, bs, FakeOpt({"lr": lr, "momentum": mom}))
        if (i + 1) % PER_EPOCH == 0:
            epoch = i // PER_EPOCH
            last = [torch.tensor(valid_loss(epoch))]
            # The loop's record: the whole epoch's losses (resumed or not).
            steps = [script(k) for k in range(i + 1 - PER_EPOCH, i + 1)]
            losses, sizes = [s[0] for s in steps], [s[1] for s in steps]
            record = scripted_record(losses, sizes, last, epoch=epoch)
            call_hook(rec, "on_epoch_end", last_metrics=last, record=record)


def history(rec):
    """Every list of the history but the wall times."""
    keys = ["lrs", "moms", "losses", "smooth_losses", "iterations", "batch_sizes"]
    keys += ["epochs", "epoch_iterations", "train_losses", "valid_losses", "metrics"]
    return {key: getattr(rec, key) for key in keys}


def test_max_points_must_be_an_int_of_at_least_two():
    for bad in (1, 0, 2.0, True, "8"):
        with pytest.raises(
            ValueError, match=r"Recorder: max_points must be an int >= 2; got"
        ):
            Recorder(max_points=bad)
    assert Recorder(max_points=2).max_points == 2


def test_points_never_exceed_the_budget_and_merge_in_pairs():
    rec = Recorder(max_points=8)
    call_hook(rec, "on_epoch_begin")
    counts = []
    for i in range(100):
        loss, bs, lr, mom = script(i)
        record_step(rec, loss, bs, FakeOpt({"lr": lr, "momentum": mom}))
        counts.append(len(rec.losses))  # reading moves the pending steps
        columns = (rec.lrs, rec.moms, rec.smooth_losses, rec.iterations)
        assert all(len(c) == counts[-1] for c in columns)
    assert max(counts) == 8 and counts[:8] == list(range(1, 9))
    assert counts[8] == 5  # step 9: 4 points of 2 steps, and the new step
    # After 100 steps a point covers 16 steps: 6 whole ones, then 4 steps.
    assert rec.steps_per_point == 16 and len(rec.losses) == 7
    steps = [script(i) for i in range(100)]
    smooth = LossSmoother()([loss for loss, *_ in steps])
    buckets = [range(k, min(k + 16, 100)) for k in range(0, 100, 16)]
    for b, bucket in enumerate(buckets):
        total = sum(steps[i][1] for i in bucket)
        mean = sum(steps[i][0] * steps[i][1] for i in bucket) / total
        last = bucket[-1]
        assert rec.losses[b] == pytest.approx(mean, rel=1e-12)
        assert rec.batch_sizes[b] == total
        assert rec.iterations[b] == last  # the last step's, exactly
        assert rec.lrs[b] == steps[last][2] and rec.moms[b] == steps[last][3]
        assert rec.smooth_losses[b] == smooth[last]


def test_the_history_is_one_point_per_step_up_to_the_budget():
    rec = Recorder(max_points=8)
    run_steps(rec, 0, 8)
    steps = [script(i) for i in range(8)]
    assert rec.losses == [loss for loss, *_ in steps]
    assert rec.lrs == [lr for _, _, lr, _ in steps]
    assert rec.batch_sizes == [bs for _, bs, *_ in steps]
    assert rec.iterations == list(range(8)) and rec.steps_per_point == 1


def test_an_odd_budget_keeps_the_odd_point_in_the_partial_one():
    rec = Recorder(max_points=5)
    run_steps(rec, 0, 11)
    # 10 steps fill 5 points of 2; the 11th halves them: 2 points of 4 steps,
    # and steps 8-10 partial.
    assert rec.iterations == [3, 7, 10] and rec.batch_sizes == [
        sum(script(i)[1] for i in range(a, b)) for a, b in ((0, 4), (4, 8), (8, 11))
    ]


def test_epoch_train_losses_stay_exact_when_points_merge():
    rec = Recorder(max_points=8)
    run_steps(rec, 0, 100)
    assert rec.epochs == [0, 1, 2, 3, 4]
    assert rec.epoch_iterations == [19, 39, 59, 79, 99]
    for epoch, mean in enumerate(rec.train_losses):
        steps = [script(i) for i in range(20 * epoch, 20 * epoch + 20)]
        total = sum(bs for _, bs, *_ in steps)
        assert mean == pytest.approx(
            sum(v * n for v, n, *_ in steps) / total, rel=1e-14
        )
    assert rec.valid_losses == [valid_loss(e) for e in range(5)]
    assert len(rec.losses) <= 8


def test_pending_device_losses_are_moved_every_flush_interval(monkeypatch):
    transfers, to_floats = [], recorder_module.to_floats
    assert recorder_module.FLUSH_EVERY == 1024  # the default: bounded

    def counting(scalars, extra=()):
        transfers.append(len(scalars))
        return to_floats(scalars, extra)

    monkeypatch.setattr(recorder_module, "FLUSH_EVERY", 4)
    monkeypatch.setattr(recorder_module, "to_floats", counting)
    rec = Recorder()
    call_hook(rec, "on_epoch_begin")
    for _ in range(10):  # one epoch that never ends
        record_step(rec, 1.0, 2, FakeOpt({"lr": 0.1}))
        assert len(rec._pending) < 4
    assert transfers == [4, 4]  # one transfer per 4 steps, never per step
    assert len(rec.losses) == 10 and transfers == [4, 4, 2]


def test_state_dict_size_stops_growing_at_the_budget():
    def saved_size(steps):
        rec = Recorder(max_points=8)
        call_hook(rec, "on_epoch_begin")
        for i in range(steps):  # one long epoch: the epoch lists stay empty
            loss, bs, lr, mom = script(i)
            record_step(rec, loss, bs, FakeOpt({"lr": lr, "momentum": mom}))
        buf = io.BytesIO()
        torch.save(rec.state_dict(), buf)
        return len(buf.getvalue()), rec.state_dict()

    small, state = saved_size(300)
    large, _ = saved_size(3000)
    assert max(len(state[k]) for k in ("losses", "lrs", "iterations")) <= 8
    # 2,700 more steps, at 41 bytes a step unbounded; a few bytes here, as the
    # larger iteration numbers take more digits.
    assert abs(large - small) < 100, (small, large)


@pytest.mark.parametrize("stop_at", [37, 40, 5])
def test_a_resumed_history_equals_an_uninterrupted_one(stop_at):
    reference = Recorder(max_points=8)
    run_steps(reference, 0, 100)
    first = Recorder(max_points=8)
    run_steps(first, 0, stop_at)  # at 37: mid-epoch, after merges, a partial point
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = Recorder(max_points=8)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    run_steps(resumed, stop_at, 100)  # and more merges after the resume
    assert history(resumed) == history(reference)
    assert resumed.steps_per_point == reference.steps_per_point == 16


def test_loading_into_a_smaller_budget_merges_to_fit():
    big = Recorder(max_points=64)
    run_steps(big, 0, 50)
    small = Recorder(max_points=8)
    small.load_state_dict(big.state_dict())
    assert len(small.losses) <= 8 and small.iterations[-1] == 49
    assert small.train_losses == big.train_losses
    direct = Recorder(max_points=8)
    run_steps(direct, 0, 50)
    assert small.iterations == direct.iterations
    assert small.losses == pytest.approx(direct.losses, rel=1e-12)


def test_loads_a_state_saved_with_one_point_per_step_and_no_budget():
    full = Recorder(max_points=10_000)
    run_steps(full, 0, 30)  # stops 10 steps into the second epoch
    old = {k: v for k, v in full.state_dict().items()}
    for key in ("steps_per_point", "partial", "rows"):  # what 0.1 first saved
        del old[key]
    rec = Recorder(max_points=8)
    rec.load_state_dict(old)
    assert len(rec.losses) <= 8 and rec.iterations[-1] == 29
    run_steps(rec, 30, 40)  # the epoch in progress ends with the exact mean
    reference = Recorder(max_points=8)
    run_steps(reference, 0, 40)
    assert rec.train_losses == pytest.approx(reference.train_losses, rel=1e-14)
    assert rec.iterations == reference.iterations
    assert rec.lrs == reference.lrs


def test_load_state_dict_refuses_an_impossible_bucket():
    rec = Recorder(max_points=8)
    run_steps(rec, 0, 30)
    state = rec.state_dict()
    with pytest.raises(ValueError, match="corrupt"):
        Recorder().load_state_dict(state | {"steps_per_point": 3})
    partial = dict(state["partial"] or {}, steps=state["steps_per_point"])
    with pytest.raises(ValueError, match="corrupt"):
        Recorder().load_state_dict(state | {"partial": partial})


def test_a_small_budget_through_fit_and_a_checkpoint_resume(tmp_path):
    def run(callbacks):
        torch.manual_seed(0)
        rec = Recorder(max_points=4)
        model = make_model()
        opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, mom=0.9)
        fit(3, model, F.cross_entropy, opt, make_data(), [rec, *callbacks])
        return rec

    class Crash(Callback):
        def on_batch_end(self, train, iteration):
            if train and iteration == 11:  # mid-epoch 1, after merges
                raise RuntimeError("crash")

    spy = LossSpy()
    reference = run([spy])
    assert len(reference.losses) == 3 and reference.steps_per_point == 8  # 21 steps
    assert reference.iterations == [7, 15, 20]
    pairs = list(zip(spy.losses, spy.sizes, strict=True))
    for got, steps in zip(reference.losses, (pairs[:8], pairs[8:16], pairs[16:])):
        mean = sum(v * n for v, n in steps) / sum(n for _, n in steps)
        assert got == pytest.approx(mean, rel=1e-6)
    for epoch, got in enumerate(reference.train_losses):  # exact, per epoch
        steps = pairs[7 * epoch : 7 * epoch + 7]
        assert got == pytest.approx(sum(v * n for v, n in steps) / 100, rel=1e-6)
    with pytest.raises(RuntimeError, match="crash"):
        run([Checkpoint(tmp_path, every_n_steps=2), Crash()])
    resumed = run([Checkpoint(tmp_path, every_n_steps=2)])
    assert history(resumed) == history(reference)
