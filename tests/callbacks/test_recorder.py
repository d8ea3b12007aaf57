import io
import math

import matplotlib.pyplot as plt
import pytest
import torch
from helpers import make_data, make_model
from matplotlib.figure import Figure
from torch.nn import functional as F  # noqa: N812

from fitlib import Callback, DataBunch, HPOptimizer, fit
from fitlib.callback import call_hook
from fitlib.callbacks.recorder import Recorder
from fitlib.metrics import Metrics, accuracy, error_rate


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
    call_hook(rec, "on_epoch_end", last_metrics=last_metrics)


def train(callbacks, epochs=2, data=None, metrics=(accuracy,), lr=0.1, mom=0.9):
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=lr, mom=mom)
    data = data or make_data()
    fit(epochs, model, F.cross_entropy, opt, data, callbacks, list(metrics))


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
    train([rec, watch], epochs=2)
    train([rec, watch], epochs=1)  # a new fit starts a new average, as the loop
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
    call_hook(rec, "on_epoch_end", last_metrics=[torch.tensor(1.0)])
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
    train([rec, spy], epochs=1)  # 100 samples in batches of 16: the last has 4
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
    train([rec, ChangeLr()], epochs=1)
    # Each step is recorded with the lr that opt.step() used.
    assert rec.lrs == [0.1] * 3 + [0.01] + [0.001] * 3
    assert rec.moms == [0.9] * 7


def test_history_continues_across_two_fits():
    rec = Recorder()
    train([rec], epochs=2)
    train([rec], epochs=1)
    assert rec.iterations == list(range(21))
    assert rec.epochs == [0, 1, 2]
    assert rec.epoch_iterations == [6, 13, 20]
    assert len(rec.losses) == len(rec.lrs) == len(rec.batch_sizes) == 21
    assert len(rec.train_losses) == len(rec.valid_losses) == len(rec.times) == 3


def test_state_dict_round_trip_restores_an_equal_history():
    rec = Recorder()
    train([rec], epochs=2)
    buf = io.BytesIO()
    torch.save(rec.state_dict(), buf)
    buf.seek(0)
    restored = Recorder()
    restored.load_state_dict(torch.load(buf, weights_only=True))
    assert restored.state_dict() == rec.state_dict()
    assert restored.epoch_table() == rec.epoch_table()
    train([restored], epochs=1)  # and it continues from there
    assert restored.epochs == [0, 1, 2]
    assert restored.iterations == list(range(21))


def test_state_dict_holds_only_plain_python_values():
    rec = Recorder()
    train([rec], epochs=1)

    def plain(v):
        if isinstance(v, list):
            return all(plain(o) for o in v)
        return v is None or isinstance(v, (int, float, str))

    sd = rec.state_dict()
    assert all(plain(v) for v in sd.values())
    sd["lrs"].append(123.0)  # a copy: changing it leaves the Recorder alone
    assert 123.0 not in rec.lrs


def test_load_state_dict_rejects_missing_keys_and_truncated_lists():
    rec = Recorder()
    train([rec], epochs=1)
    sd = rec.state_dict()
    with pytest.raises(ValueError, match=r"lacks.*'times'"):
        Recorder().load_state_dict({k: v for k, v in sd.items() if k != "times"})
    sd["losses"] = sd["losses"][:-1]
    with pytest.raises(ValueError, match="truncated"):
        Recorder().load_state_dict(sd)


# -- plots -----------------------------------------------------------------------
def test_plots_return_figures_with_the_expected_axes_and_lines():
    rec = Recorder()
    train([rec], epochs=2, metrics=[accuracy, accuracy])
    fig = rec.plot_losses()
    assert isinstance(fig, Figure)
    assert len(fig.axes) == 1 and len(fig.axes[0].lines) == 3  # raw, smooth, valid
    valid_line = fig.axes[0].lines[2]
    assert list(valid_line.get_xdata()) == rec.epoch_iterations
    assert len(rec.plot_lr().axes) == 1
    moms = rec.plot_lr(show_moms=True)
    assert len(moms.axes) == 2 and list(moms.axes[1].lines[0].get_ydata()) == [0.9] * 14
    metrics = rec.plot_metrics()
    assert len(metrics.axes) == 2
    assert all(len(ax.lines[0].get_xdata()) == 2 for ax in metrics.axes)


def test_plot_losses_without_validation_draws_only_the_train_lines():
    rec = Recorder()
    data = make_data()
    train([rec], epochs=1, data=DataBunch(data.train_dl, None), metrics=[])
    assert len(rec.plot_losses().axes[0].lines) == 2


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


def test_plots_leave_no_open_pyplot_figure():
    import matplotlib.pyplot as plt

    rec = Recorder()
    train([rec], epochs=2)
    plt.close("all")
    figs = [rec.plot_losses(), rec.plot_lr(show_moms=True), rec.plot_metrics()]
    assert plt.get_fignums() == []
    assert all(len(fig.axes) >= 1 for fig in figs)


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
    axes = rec.plot_metrics().axes
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
    train([rec, spy], epochs=2, metrics=[accuracy])
    train([rec, spy], epochs=1, metrics=[error_rate, accuracy])
    table = rec.epoch_table()
    assert [list(r) for r in table] == [
        ["epoch", "train_loss", "valid_loss", "accuracy", "time"]
    ] * 2 + [["epoch", "train_loss", "valid_loss", "error_rate", "accuracy", "time"]]
    for row, expected in zip(table, spy.rows, strict=True):
        got = {k: v for k, v in row.items() if k not in ("epoch", "train_loss", "time")}
        assert got == pytest.approx(expected)
    assert table[2]["error_rate"] == pytest.approx(1 - table[2]["accuracy"])
    axes = rec.plot_metrics().axes
    assert [ax.get_ylabel() for ax in axes] == ["accuracy", "error_rate"]
    accs = [r["accuracy"] for r in spy.rows]
    assert list(axes[0].lines[0].get_ydata()) == pytest.approx(accs)
    errors = list(axes[1].lines[0].get_ydata())
    assert all(math.isnan(e) for e in errors[:2])
    assert errors[2] == pytest.approx(spy.rows[2]["error_rate"])


def test_state_dict_round_trip_keeps_the_metric_names_of_each_epoch():
    rec = Recorder()
    train([rec], epochs=1, metrics=[accuracy])
    train([rec], epochs=1, metrics=[error_rate])
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
    train([rec, StepEveryOther()], epochs=1)
    # Batch 1 steps with the lr set after batch 0; batch 2 has no step and
    # repeats it; batch 3 steps with the lr set after batch 2.
    assert rec.lrs[1:4] == [0.05, 0.05, 0.1 / 4]
