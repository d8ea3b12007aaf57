import io
import math

import pytest
import torch
from helpers import make_data, make_dataset, make_model, scripted_record, train
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

from fitlib import Callback, DataBunch, HPOptimizer, fit
from fitlib.callback import call_hook
from fitlib.callbacks.early_stopping import EarlyStopping
from fitlib.core import validate
from fitlib.metrics import Metrics, accuracy, error_rate


def begin(cb, metrics=(), iteration=0):
    call_hook(cb, "on_train_begin", iteration=iteration, metrics=Metrics(list(metrics)))


def feed(cb, values, first_epoch=0, model=None):
    """One on_epoch_end per value (a validation loss) until one stops: [its epoch]."""
    stops = []
    for epoch, v in enumerate(values, first_epoch):
        last = None if v is None else [torch.tensor(v, dtype=torch.float64)]
        record = scripted_record(last_metrics=last, epoch=epoch)
        update = call_hook(cb, "on_epoch_end", epoch=epoch, last_metrics=last,
                           record=record, model=model)  # fmt: skip
        if update is not None:
            assert update == {"stop_training": True}
            stops.append(epoch)
            break  # as fit does
    return stops


def scripted(values, **kwargs):
    cb = EarlyStopping(**kwargs)
    begin(cb)
    return feed(cb, values), cb


# -- the rule --------------------------------------------------------------------
# Scripted sequences from Keras 3's and Lightning's own early-stopping tests
# (values per epoch -> the epoch after which training stops, 0-based, and the
# best epoch): the same rule as theirs, the count of epochs without
# improvement *reaching* patience. (source, values, patience, baseline, stop, best)
PEERS = [
    ("keras p0", [10, 9, 8, 9, 8.9, 8.8, 8.7, 8.6, 8.5], 0, None, 3, 2),
    ("keras p1", [10, 9, 8, 9, 8.9, 8.8, 8.7, 8.6, 8.5], 1, None, 3, 2),
    ("keras p2", [10, 9, 8, 9, 8.9, 8.8, 8.7, 8.6, 8.5], 2, None, 4, 2),
    ("keras p3", [10, 9, 8, 9, 8.9, 8.8, 8.7, 8.6, 8.5], 3, None, 5, 2),
    ("keras restore", [0.2, 0.15, 0.1, 0.11, 0.12], 2, None, 4, 2),
    # No value beats the baseline: patience counts from the first epoch.
    ("keras baseline", [0.9, 0.8, 0.7, 0.71, 0.72, 0.73], 5, 0.5, 4, 2),
    ("lightning flat", [6, 5, 5, 5, 5, 5], 3, None, 4, 1),
    ("lightning p1", [6, 5, 4, 4, 3, 3], 1, None, 3, 2),
    ("lightning bump", [6, 5, 6, 5, 5, 5], 3, None, 4, 1),
    ("lightning thresholds", [8, 4, 2, 3, 4, 5, 8, 10], 3, None, 5, 2),
    ("lightning multiple", [8, 4, 2, 3, 4, 5, 8, 10], 1, None, 3, 2),
    ("lightning constant", [0, 0, 0, 0, 0, 0], 3, None, 3, 0),
]


@pytest.mark.parametrize(
    ("values", "patience", "baseline", "stop", "best"),
    [case[1:] for case in PEERS],
    ids=[case[0] for case in PEERS],
)
def test_stops_where_keras_and_lightning_stop(values, patience, baseline, stop, best):
    stops, cb = scripted([float(v) for v in values], patience=patience,
                         baseline=baseline)  # fmt: skip
    assert stops == [stop] and cb.stopped_epoch == stop
    assert cb.best_epoch == best


@pytest.mark.parametrize(("patience", "stops_at"), [(0, 2), (1, 2), (2, 3), (3, 4)])
def test_stops_when_the_epochs_without_improvement_reach_patience(patience, stops_at):
    # 1.0 and 0.8 improve, then three epochs without improvement.
    stops, cb = scripted([1.0, 0.8, 0.8, 0.9, 0.85], patience=patience)
    assert stops == ([] if stops_at is None else [stops_at])
    assert cb.stopped_epoch == stops_at
    assert cb.monitor.best == 0.8 and cb.best_epoch == 1


def test_an_improvement_resets_the_count_of_bad_epochs():
    # Bad, improved, bad, improved, bad: never two bad epochs in a row.
    stops, cb = scripted([1.0, 1.1, 0.9, 1.0, 0.85, 0.9], patience=2)
    assert stops == [] and cb.wait == 1
    assert feed(cb, [0.99], first_epoch=6) == [6]


def test_an_improvement_smaller_than_min_delta_is_a_bad_epoch():
    stops, cb = scripted([1.0, 0.96, 0.97, 0.5], min_delta=0.05, patience=2)
    # 0.96 and 0.97 are not more than 0.05 better than 1.0: two bad epochs.
    assert stops == [2] and cb.monitor.best == 1.0 and cb.best_epoch == 0
    stops, cb = scripted([1.0, 0.94, 0.97], min_delta=0.05, patience=0)
    assert stops == [2] and cb.best_epoch == 1


@pytest.mark.parametrize(
    ("monitor", "values", "stops"),
    [
        ("accuracy", [0.5, 0.6, 0.55], [2]),  # goes up
        ("error_rate", [0.5, 0.4, 0.45], [2]),  # goes down
        ("accuracy", [0.5, 0.4, 0.3], [1]),  # falling accuracy is bad
    ],
)
def test_auto_mode_knows_which_way_metrics_improve(monitor, values, stops):
    cb = EarlyStopping(monitor)
    begin(cb, metrics=[accuracy, error_rate])
    index = 1 + ["accuracy", "error_rate"].index(monitor)
    got = []
    for epoch, v in enumerate(values):
        last = [torch.tensor(9.0)] * 3
        last[index] = torch.tensor(v)
        names = ["accuracy", "error_rate"]
        record = scripted_record(last_metrics=last, names=names, epoch=epoch)
        if call_hook(cb, "on_epoch_end", epoch=epoch, record=record):
            got.append(epoch)
            break
    assert got == stops


def test_nan_is_a_bad_epoch_and_skipped_validation_is_not_counted():
    stops, cb = scripted([1.0, None, None, math.nan, None, 0.5, math.nan],
                         patience=2)  # fmt: skip
    assert stops == [] and cb.wait == 1 and cb.best_epoch == 5
    assert feed(cb, [math.nan], first_epoch=7) == [7]


@pytest.mark.parametrize("patience", [0, 1])
def test_a_nan_at_the_first_epoch_stops_there_where_keras_goes_on(patience):
    # Keras guards its stop with epoch > 0; fitlib counts epoch 0 as any
    # other (documented in the docstring, so in the reference page).
    stops, cb = scripted([math.nan, 1.0, 0.5], patience=patience)
    assert stops == [0] and cb.stopped_epoch == 0 and cb.best_epoch is None
    assert "NaN at the first epoch" in EarlyStopping.__doc__


def test_with_a_baseline_it_stops_unless_the_value_beats_it_within_patience():
    stops, cb = scripted([0.9, 0.8, 0.7, 0.71], baseline=0.5, patience=3)
    # None beats the baseline: every epoch counts, from the first; the 4th
    # epoch reaches patience=3 and does not improve: it stops (as Keras).
    assert stops == [3] and cb.wait == 4
    assert cb.monitor.best == 0.7 and cb.best_epoch == 2  # the best seen
    stops, cb = scripted([0.9, 0.8, 0.4, 0.45, 0.45], baseline=0.5, patience=3)
    assert stops == [] and cb.wait == 2  # 0.4 beat it: counting starts again


def test_with_a_baseline_an_epoch_that_improves_on_the_best_never_stops():
    # As Keras: the count grows (no value beats the baseline), but training
    # goes on while the value still improves; the first epoch that does not
    # stops it.
    stops, cb = scripted([0.9, 0.8, 0.7, 0.6, 0.55, 0.56], baseline=0.5, patience=1)
    assert stops == [5] and cb.wait == 6


def test_a_value_that_beats_the_baseline_but_not_the_best_is_a_bad_epoch():
    stops, cb = scripted([0.3, 0.4], baseline=0.5, patience=0)
    assert stops == [1] and cb.wait == 1


def test_epochs_before_start_from_epoch_are_not_counted():
    stops, cb = scripted([5.0, 6.0, 7.0, 1.0, 1.0], start_from_epoch=3)
    assert stops == [4]
    assert cb.monitor.best == 1.0 and cb.best_epoch == 3  # 5.0 never counted


def test_the_best_weights_are_copied_at_improving_epochs_only():
    model = torch.nn.Linear(2, 1)
    cb = EarlyStopping(restore_best=True, patience=5)
    begin(cb)
    with torch.no_grad():
        for epoch, v in enumerate([1.0, 0.5, 0.7]):
            model.weight.fill_(epoch)
            feed(cb, [v], first_epoch=epoch, model=model)
    assert torch.equal(cb.best_weights["weight"], torch.full((1, 2), 1.0))
    assert cb.best_weights["weight"].data_ptr() != model.weight.data_ptr()
    call_hook(cb, "on_train_end", model=model)
    assert torch.equal(model.weight, torch.full((1, 2), 1.0))


def test_prints_one_line_with_the_epoch_and_the_best_value_when_it_stops(capsys):
    model = torch.nn.Linear(2, 1)
    cb = EarlyStopping(patience=2, restore_best=True)
    begin(cb)
    feed(cb, [1.0, 0.25, 0.5, 0.5], model=model)
    assert capsys.readouterr().out == ""  # printed at the end, after the table
    call_hook(cb, "on_train_end", model=model)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    assert "stopped after epoch 3" in lines[0]
    assert "best valid_loss=0.25 at epoch 1" in lines[0]
    assert "restored" in lines[0]


def test_nothing_is_printed_when_training_ends_without_a_stop(capsys):
    cb = EarlyStopping(patience=3)
    begin(cb)
    feed(cb, [1.0, 1.1])
    call_hook(cb, "on_train_end", model=torch.nn.Linear(2, 1))
    assert capsys.readouterr().out == ""


def test_the_baseline_message_says_it_was_not_beaten(capsys):
    cb = EarlyStopping(baseline=0.5)
    begin(cb)
    assert feed(cb, [0.9, 0.95]) == [1]
    call_hook(cb, "on_train_end", model=torch.nn.Linear(2, 1))
    assert "did not beat baseline=0.5" in capsys.readouterr().out


# -- saved state -----------------------------------------------------------------
def round_trip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_state_dict_round_trip_and_a_resumed_run_decides_as_an_unbroken_one():
    values = [1.0, 0.8, 0.9, 0.7, 0.75, 0.8, 0.9]
    unbroken, _ = scripted(values, patience=2)
    cb = EarlyStopping(patience=2)
    begin(cb)
    assert feed(cb, values[:4]) == []
    resumed = EarlyStopping(patience=2)
    resumed.load_state_dict(round_trip(cb.state_dict()))
    assert resumed.state_dict() == cb.state_dict()
    begin(resumed, iteration=28)  # a resumed fit keeps the loaded state
    assert feed(resumed, values[4:], first_epoch=4) == unbroken == [5]
    assert resumed.best_epoch == 3 and resumed.monitor.best == 0.7


def test_the_state_holds_the_best_weights_as_tensors_when_restore_best():
    model = torch.nn.Linear(2, 1)
    cb = EarlyStopping(restore_best=True)
    begin(cb)
    feed(cb, [1.0], model=model)
    state = round_trip(cb.state_dict())
    assert set(state) == {"monitor", "wait", "best_epoch", "stopped_epoch",
                          "best_step", "stopped_step", "best_weights"}  # fmt: skip
    assert torch.equal(state["best_weights"]["weight"], model.weight)
    other = EarlyStopping(restore_best=True)
    other.load_state_dict(state)
    with torch.no_grad():
        model.weight.zero_()
    other._fitting = True  # as after a resumed fit's on_train_begin
    call_hook(other, "on_train_end", model=model)
    assert torch.equal(model.weight, state["best_weights"]["weight"])
    assert "best_weights" not in EarlyStopping().state_dict()


def test_loading_a_state_of_other_keys_raises():
    with pytest.raises(ValueError, match="expected the keys"):
        EarlyStopping().load_state_dict({"wait": 1})
    state = EarlyStopping().state_dict()
    with pytest.raises(ValueError, match="restore_best=True"):
        EarlyStopping(restore_best=True).load_state_dict(state)


def test_a_new_fit_resets_the_state():
    stops, cb = scripted([1.0, 2.0], patience=0)
    assert stops == [1]
    begin(cb)
    assert cb.wait == 0 and cb.stopped_epoch is None
    assert cb.monitor.best == math.inf and cb.best_epoch is None


# -- bad input -------------------------------------------------------------------
@pytest.mark.parametrize("name", ["patience", "start_from_epoch"])
def test_a_negative_patience_or_start_from_epoch_raises(name):
    with pytest.raises(ValueError, match=f"{name} must be an int >= 0; got -1"):
        EarlyStopping(**{name: -1})
    with pytest.raises(TypeError, match=f"{name} must be an int"):
        EarlyStopping(**{name: 1.5})


def test_a_negative_min_delta_raises():
    with pytest.raises(ValueError, match="EarlyStopping: min_delta must be"):
        EarlyStopping(min_delta=-0.1)


def test_a_bad_or_unknowable_mode_raises():
    with pytest.raises(ValueError, match="mode must be one of"):
        EarlyStopping(mode="down")
    with pytest.raises(ValueError, match="cannot tell whether 'score'"):
        EarlyStopping("score")


def test_a_baseline_or_restore_best_of_the_wrong_type_raises():
    with pytest.raises(TypeError, match="baseline must be a number"):
        EarlyStopping(baseline="0.5")
    with pytest.raises(ValueError, match="baseline must be a number"):
        EarlyStopping(baseline=math.nan)
    with pytest.raises(TypeError, match="restore_best must be True or False"):
        EarlyStopping(restore_best=1)


def test_an_unknown_monitor_raises_at_train_begin_listing_the_names():
    cb = EarlyStopping("accuracy")
    with pytest.raises(ValueError, match=r"names that exist are \['valid_loss', "
                       r"'train_loss', 'error_rate'\]"):  # fmt: skip
        begin(cb, metrics=[error_rate])


# -- through fit -----------------------------------------------------------------
class Snapshots(Callback):
    """Keeps a copy of the weights and the valid loss after each epoch."""

    def __init__(self):
        self.weights, self.losses = [], []

    def on_epoch_end(self, model, last_metrics):
        self.weights.append({k: v.clone() for k, v in model.state_dict().items()})
        self.losses.append(float(last_metrics[0]))


class FailAt(Callback):
    def __init__(self, epoch, error):
        self.epoch, self.error = epoch, error

    def on_epoch_begin(self, epoch):
        if epoch == self.epoch:
            raise self.error


def test_through_fit_it_stops_and_restores_the_best_epochs_weights(capsys):
    stop, snaps = EarlyStopping(patience=2, restore_best=True), Snapshots()
    model = train([stop, snaps], epochs=30, lr=2.0, mom=0.9)  # a large lr: it stalls
    assert stop.stopped_epoch is not None and stop.stopped_epoch < 29
    assert len(snaps.losses) == stop.stopped_epoch + 1  # no epoch after the stop
    best = min(range(len(snaps.losses)), key=snaps.losses.__getitem__)
    assert stop.best_epoch == best and stop.wait == 2
    for key, value in model.state_dict().items():
        assert torch.equal(value, snaps.weights[best][key]), key
    valid_loss = validate(model, make_data().valid_dl, F.cross_entropy)[0]
    assert float(valid_loss) == pytest.approx(snaps.losses[best])
    assert f"stopped after epoch {stop.stopped_epoch}" in capsys.readouterr().out


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_the_best_weights_are_restored_after_an_error_or_ctrl_c(error):
    stop, snaps = EarlyStopping(patience=10, restore_best=True), Snapshots()
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=2.0)
    with pytest.raises(type(error)):
        fit(
            8, model, F.cross_entropy, opt, make_data(), [stop, snaps, FailAt(4, error)]
        )
    assert len(snaps.weights) == 4
    for key, value in model.state_dict().items():
        assert torch.equal(value, snaps.weights[stop.best_epoch][key]), key


def test_nothing_is_restored_when_no_epoch_was_evaluated():
    stop = EarlyStopping(restore_best=True)
    model = train([stop], epochs=2, lr=0.5, mom=0.9)  # a first fit: best weights kept
    assert stop.best_weights is not None
    trained = {k: v.clone() for k, v in model.state_dict().items()}

    class Grow(Callback):  # changes the weights, then fails in epoch 0
        def on_batch_end(self, model, train):
            if train:
                with torch.no_grad():
                    model[0].weight.add_(1.0)
                raise RuntimeError("boom")

    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError):
        fit(2, model, F.cross_entropy, opt, make_data(), [stop, Grow()])
    assert stop.best_weights is None  # the new fit reset them
    assert not torch.equal(model[0].weight, trained["0.weight"])  # not restored


def test_a_fit_that_fails_before_its_train_begin_restores_nothing():
    stop = EarlyStopping(restore_best=True)
    model = train([stop], epochs=1, lr=0.5, mom=0.9)
    with torch.no_grad():
        model[0].weight.zero_()

    class FailFirst(Callback):
        order = -100

        def on_train_begin(self):
            raise RuntimeError("fails before EarlyStopping's on_train_begin")

    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError):
        fit(1, model, F.cross_entropy, opt, make_data(), [stop, FailFirst()])
    assert torch.count_nonzero(model[0].weight) == 0  # the old best not loaded


def test_its_state_resets_at_each_fit():
    stop = EarlyStopping(patience=0)
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=5.0)
    fit(20, model, F.cross_entropy, opt, make_data(), [stop])
    assert stop.stopped_epoch is not None and stop.best_epoch is not None
    fit(1, model, F.cross_entropy, opt, make_data(), [stop])
    assert stop.stopped_epoch is None  # not the first fit's
    assert stop.best_epoch == 0 and stop.wait == 0  # its 1st epoch is the best


def test_through_fit_monitoring_accuracy_and_train_loss_works():
    acc = EarlyStopping("accuracy", patience=100)
    train([acc], epochs=3, metrics=[accuracy], lr=0.5, mom=0.9)
    assert 0 <= acc.monitor.best <= 1 and acc.monitor.mode == "max"
    tl = EarlyStopping("train_loss", patience=100)
    train([tl], epochs=3, lr=0.5, mom=0.9)
    assert tl.best_epoch is not None and math.isfinite(tl.monitor.best)


def test_through_fit_a_typo_in_the_monitor_fails_before_any_batch():
    class Batches(Callback):
        n = 0

        def on_batch_begin(self):
            Batches.n += 1

    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"did you mean 'valid_loss'\?"):
        EarlyStopping("valid_los")
    stop = EarlyStopping("valid_los", mode="min")
    with pytest.raises(ValueError, match=r"'valid_los' is not computed in this fit "
                       r"\(did you mean 'valid_loss'\?\)"):  # fmt: skip
        fit(1, model, F.cross_entropy, opt, make_data(), [stop, Batches()])
    assert Batches.n == 0


def test_through_fit_an_unknown_monitor_fails_before_any_step():
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"EarlyStopping: monitor='f1'"):
        fit(1, model, F.cross_entropy, opt, make_data(), [EarlyStopping("f1")])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_it_adds_no_sync_per_batch(sync_counter):
    def syncs(n_train):
        data = DataBunch(
            DataLoader(make_dataset(n_train), 16, shuffle=True),
            DataLoader(make_dataset(32, seed=1), 16),
            device="cpu",
        )
        model = make_model()
        opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        stop = EarlyStopping("train_loss", patience=10, restore_best=True)
        before = sync_counter["n"]
        fit(3, model, F.cross_entropy, opt, data, [stop])
        return sync_counter["n"] - before

    few, many = syncs(64), syncs(512)
    assert few == many and few >= 3  # one read per epoch, 4 vs 32 batches


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_best_weights_are_kept_on_the_host_and_restored():
    stop, snaps = EarlyStopping(patience=1, restore_best=True), Snapshots()
    model = make_model().cuda()  # fit moves the batches to the model's device
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=2.0, mom=0.9)
    fit(30, model, F.cross_entropy, opt, make_data(), [stop, snaps])
    assert all(t.device.type == "cpu" for t in stop.best_weights.values())
    for key, value in model.state_dict().items():
        assert value.is_cuda
        assert torch.equal(value, snaps.weights[stop.best_epoch][key]), key
