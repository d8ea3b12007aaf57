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
            assert update == {"stop_training": True, "stop_reason": cb.stop_reason}
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


def test_a_baseline_stop_after_slow_improvement_says_how_long_it_was_not_beaten(
    capsys,
):
    # Improving on the best never stops training, baseline or not: this loss
    # improves for 5 epochs, far from the baseline, then stops improving.
    cb = EarlyStopping(baseline=0.01, patience=1)
    begin(cb)
    assert feed(cb, [0.9, 0.8, 0.7, 0.6, 0.5, 0.55]) == [5]
    call_hook(cb, "on_train_end", model=torch.nn.Linear(2, 1))
    assert capsys.readouterr().out == (
        "EarlyStopping: stopped after epoch 5: valid_loss did not beat "
        "baseline=0.01 in 6 epoch(s) and stopped improving (patience=1); best "
        "valid_loss=0.5 at epoch 4\n"
    )


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
                          "best_step", "stopped_step", "stop_rule", "stop_reason",
                          "best_weights"}  # fmt: skip
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


# -- the stopping rules: check_finite, thresholds, min_delta_mode ---------------
# Lightning's threshold cases (patience 3, its default): values per epoch ->
# the epoch after which training stops, and the rule that stops it.
THRESHOLDS = [
    (None, None, [8, 4, 2, 3, 4, 5, 8, 10], 5, "patience"),
    (2.9, None, [9, 8, 7, 6, 5, 6, 4, 3, 2, 1], 8, "stopping_threshold"),
    (None, 15.9, [9, 4, 2, 16, 32, 64], 3, "divergence_threshold"),
]


@pytest.mark.parametrize(("target", "hopeless", "values", "stop", "rule"), THRESHOLDS)
def test_the_thresholds_stop_where_lightnings_stop(
    target, hopeless, values, stop, rule
):
    floats = [float(v) for v in values]
    stops, cb = scripted(
        floats, patience=3, stopping_threshold=target, divergence_threshold=hopeless
    )
    assert stops == [stop] and cb.stopped_epoch == stop and cb.stop_rule == rule


def test_each_stop_says_the_rule_the_value_and_the_threshold():
    reasons = {
        "EarlyStopping: valid_loss=2 reached stopping_threshold=2.9":
            dict(values=[9.0, 2.0], stopping_threshold=2.9),
        "EarlyStopping: valid_loss=16 is worse than divergence_threshold=15.9":
            dict(values=[9.0, 16.0], divergence_threshold=15.9),
        "EarlyStopping: valid_loss=nan is not finite (check_finite=True)":
            dict(values=[9.0, math.nan], check_finite=True, patience=5),
        "EarlyStopping: valid_loss did not improve for 2 epoch(s) (patience=2)":
            dict(values=[9.0, 9.5, 9.5], patience=2),
        "EarlyStopping: valid_loss did not beat baseline=1 in 2 epoch(s) and "
        "stopped improving (patience=2)":
            dict(values=[9.0, 9.5], patience=2, baseline=1.0),
    }  # fmt: skip
    for reason, kwargs in reasons.items():
        stops, cb = scripted(kwargs.pop("values"), **kwargs)
        assert stops and cb.stop_reason == reason
    assert cb.stop_rule == "baseline"


@pytest.mark.parametrize("bad", [math.inf, math.nan, -math.inf])
def test_check_finite_stops_at_a_nan_or_infinite_value_as_lightning(bad):
    values = [4.0, 3.0, bad, 2.0, 1.0]
    stops, cb = scripted(values, check_finite=True, patience=3)
    assert stops == [2] and cb.stop_rule == "check_finite"
    assert cb.monitor.best == 3.0 and cb.best_epoch == 1  # -inf is no best
    stops, cb = scripted(values, patience=3)  # off: a bad epoch, as any other
    assert stops == [] and cb.monitor.best in (1.0, -math.inf)


def test_stopping_threshold_counts_reaching_it_and_divergence_only_passing_it():
    assert scripted([1.0, 0.5], stopping_threshold=0.5, patience=9)[0] == [1]
    assert scripted([1.0, 2.0], divergence_threshold=2.0, patience=9)[0] == []
    assert scripted([1.0, 2.01], divergence_threshold=2.0, patience=9)[0] == [1]
    # In "max" mode the directions turn: a score reaches a target from below.
    cb = EarlyStopping("accuracy", stopping_threshold=0.9, divergence_threshold=0.1,
                       patience=9)  # fmt: skip
    begin(cb, metrics=[accuracy])
    assert feed_named(cb, "accuracy", [0.5, 0.8, 0.9]) == [2]
    cb = EarlyStopping("accuracy", divergence_threshold=0.1, patience=9)
    begin(cb, metrics=[accuracy])
    assert feed_named(cb, "accuracy", [0.5, 0.1, 0.05]) == [2]


def test_a_threshold_reached_with_a_new_best_is_the_best_epoch_restored():
    model = torch.nn.Linear(2, 1)
    cb = EarlyStopping(stopping_threshold=0.5, restore_best=True)
    begin(cb)
    with torch.no_grad():
        for epoch, v in enumerate([1.0, 0.8, 0.4]):
            model.weight.fill_(epoch)
            stops = feed(cb, [v], first_epoch=epoch, model=model)
    assert stops == [2] and cb.best_epoch == 2
    assert torch.equal(cb.best_weights["weight"], torch.full((1, 2), 2.0))


def test_a_relative_min_delta_asks_for_a_fraction_of_the_best():
    values = [100.0, 99.5, 98.9, 98.5]
    # 1% of 100 is 1: 99.5 is a bad epoch, 98.9 improves, 98.5 (< 1% of 98.9) is bad.
    stops, cb = scripted(values, min_delta=0.01, min_delta_mode="rel", patience=2)
    assert stops == [] and cb.best_epoch == 2 and cb.wait == 1
    # The same min_delta as an amount: every epoch improves.
    stops, cb = scripted(values, min_delta=0.01, patience=1)
    assert stops == [] and cb.best_epoch == 3 and cb.wait == 0


def feed_named(cb, name, values, first_epoch=0):
    """As feed, with the values as the metric ``name`` (valid_loss 1.0)."""
    stops = []
    for epoch, v in enumerate(values, first_epoch):
        last = [torch.tensor(1.0), torch.tensor(v, dtype=torch.float64)]
        record = scripted_record(last_metrics=last, names=[name], epoch=epoch)
        if call_hook(cb, "on_epoch_end", epoch=epoch, record=record):
            stops.append(epoch)
            break
    return stops


# Ignite's cases (mode "max", its scores per call -> the call that stops, or
# None): the same rule, its count reaching patience. Its cumulative_delta=True
# is fitlib's rule: min_delta is measured from the best, which moves only on
# an improvement by more than min_delta.
IGNITE = [
    ("simple", [1.0, 0.8, 0.88], 2, 0.0, 2),
    ("state", [1.0, 0.8, 0.88], 2, 0.0, 2),
    ("on_delta", [1.0, 2.0, 2.01, 3.0, 3.01, 3.02], 2, 0.1, 5),
    ("cumulative_delta", [0.0, 0.3, 0.6], 2, 0.4, None),
    ("plateau", [42.0, 42.0], 1, 0.0, 1),
    ("no_stop", [1.0, 0.8, 1.2], 2, 0.0, None),
    ("engine", [1.0, 0.8, 1.2, 1.5, 0.9, 1.0, 0.99, 1.1, 0.9], 3, 0.0, 6),
    ("engine_plateau", [0.047] * 10, 4, 0.0, 4),
    ("engine_no_stop", [1.0, 0.8, 1.2, 1.23, 0.9, 1.0, 1.1, 1.253, 1.26, 1.2], 5,
     0.0, None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("scores", "patience", "min_delta", "stop"),
    [c[1:] for c in IGNITE],
    ids=[c[0] for c in IGNITE],
)
def test_stops_where_ignite_stops(scores, patience, min_delta, stop):
    cb = EarlyStopping("accuracy", patience=patience, min_delta=min_delta)
    begin(cb, metrics=[accuracy])
    assert feed_named(cb, "accuracy", scores) == ([] if stop is None else [stop])


@pytest.mark.parametrize(("patience", "start"), [(3, 2), (0, 2)])
def test_with_start_from_epoch_at_least_patience_plus_start_epochs_run_as_keras(
    patience, start
):
    stops, _ = scripted([1.0] * 20, patience=patience, start_from_epoch=start)
    assert stops and stops[0] + 1 >= patience + start


# -- min_epochs and min_steps ----------------------------------------------------
def feed_at(cb, values, epochs, steps, mid=()):
    """on_epoch_end per value at the given epochs and steps (mid: inside an
    epoch); the index of the record that stops, or None."""
    for i, (v, epoch, step) in enumerate(zip(values, epochs, steps)):
        record = scripted_record(last_metrics=[torch.tensor(v)], epoch=epoch)
        if call_hook(cb, "on_epoch_end", epoch=epoch, record=record, step=step,
                     mid_epoch=i in mid):  # fmt: skip
            return i
    return None


def test_no_rule_stops_before_min_epochs_and_each_later_record_is_judged_again():
    cb = EarlyStopping(patience=1, min_epochs=4)
    begin(cb)
    # Patience runs out at epoch 1; epoch 3 completes the 4th epoch but
    # improves: no stop; epoch 4 does not improve: stop.
    assert feed_at(cb, [1.0, 1.0, 1.0, 0.5, 0.6], range(5), range(0, 50, 10)) == 4
    assert cb.stop_rule == "patience" and cb.wait == 1
    cb = EarlyStopping(stopping_threshold=0.5, min_epochs=3, patience=9)
    begin(cb)
    # Reached at epoch 0, not at epoch 2 (the 3rd epoch): no stop; at epoch 3.
    assert feed_at(cb, [0.4, 0.45, 0.6, 0.3], range(4), range(4)) == 3


def test_a_validation_inside_an_epoch_counts_the_epochs_completed_before_it():
    cb = EarlyStopping(check_finite=True, min_epochs=2)
    begin(cb)
    # Inside epoch 1 one epoch has completed; at epoch 1's end two have.
    assert feed_at(cb, [math.nan] * 2, [1, 1], [15, 20], mid={0}) == 1
    cb = EarlyStopping(check_finite=True, min_epochs=2)
    begin(cb)
    assert feed_at(cb, [math.nan], [2], [25], mid={0}) == 0  # two completed


def test_no_rule_stops_before_min_steps():
    cb = EarlyStopping(check_finite=True, min_steps=30)
    begin(cb)
    assert feed_at(cb, [math.nan] * 4, range(4), [10, 20, 30, 40]) == 2


# Lightning's min_epochs/min_steps cases: (batches per epoch, min_epochs,
# min_steps) with a rule that says stop at every record. Lightning stops at
# the first step past the minimum; here at the first record past it, the
# epoch's end: the epochs that run are the same.
MINIMUMS = [(3, 0, 10), (5, 0, 10), (3, 2, 0), (5, 2, 0), (3, 1, 10), (5, 1, 10),
            (3, 3, 10), (5, 3, 10)]  # fmt: skip


@pytest.mark.parametrize(("batches", "min_epochs", "min_steps"), MINIMUMS)
def test_through_fit_min_epochs_and_min_steps_hold_back_the_stop_as_lightning(
    batches, min_epochs, min_steps
):
    stop = EarlyStopping(stopping_threshold=math.inf, min_epochs=min_epochs,
                         min_steps=min_steps)  # fmt: skip
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    data = make_data(n_train=16 * batches)
    history = fit(20, model, F.cross_entropy, opt, data, [stop])
    epochs = max(math.ceil(min_steps / batches), min_epochs, 1)
    assert len(history) == epochs and stop.stopped_epoch == epochs - 1
    assert history.stop_reason == stop.stop_reason
    assert "reached stopping_threshold=inf" in history.stop_reason


# -- their arguments -------------------------------------------------------------
def test_bad_thresholds_flags_and_minimums_raise_before_training():
    with pytest.raises(TypeError, match="stopping_threshold must be a number or None"):
        EarlyStopping(stopping_threshold="0.1")
    with pytest.raises(ValueError, match="divergence_threshold must be a number"):
        EarlyStopping(divergence_threshold=math.nan)
    better = r"stopping_threshold=5 must be better than divergence_threshold=1"
    with pytest.raises(ValueError, match=better + r" \(mode='min': below it\)"):
        EarlyStopping(stopping_threshold=5, divergence_threshold=1)
    with pytest.raises(ValueError, match=r"mode='max': above it"):
        EarlyStopping("accuracy", stopping_threshold=0.1, divergence_threshold=0.5)
    with pytest.raises(TypeError, match="check_finite must be True or False"):
        EarlyStopping(check_finite="yes")
    with pytest.raises(ValueError, match="min_epochs must be an int >= 0; got -1"):
        EarlyStopping(min_epochs=-1)
    with pytest.raises(TypeError, match="min_steps must be an int"):
        EarlyStopping(min_steps=2.5)
    with pytest.raises(ValueError, match="EarlyStopping: min_delta_mode must be"):
        EarlyStopping(min_delta_mode="percent")


# -- the reason through fit, and resume ------------------------------------------
def test_through_fit_the_history_and_the_printed_line_say_which_rule_fired(capsys):
    stop = EarlyStopping(divergence_threshold=1.5, patience=50)
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=50.0)  # it diverges
    history = fit(20, model, F.cross_entropy, opt, make_data(), [stop])
    assert stop.stop_rule == "divergence_threshold" and len(history) < 20
    assert history.stop_reason == stop.stop_reason
    assert history.stop_reason.startswith("EarlyStopping: valid_loss=")
    assert history.stop_reason.endswith(" is worse than divergence_threshold=1.5")
    out = capsys.readouterr().out
    assert "is worse than divergence_threshold=1.5; best valid_loss=" in out


def test_a_resumed_fit_with_the_rules_on_equals_an_unbroken_one(tmp_path):
    from helpers import Crash

    from fitlib.callbacks import Checkpoint

    def run(crash=None, directory=None):
        stop = EarlyStopping(patience=1, min_delta=0.02, min_delta_mode="rel",
                             min_epochs=4, check_finite=True, restore_best=True,
                             divergence_threshold=100.0)  # fmt: skip
        model = make_model()
        opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.5)
        cbs = [stop] + ([] if crash is None else [Crash(crash)])
        if directory is not None:
            cbs.append(Checkpoint(directory, every_n_steps=3))
        history = fit(30, model, F.cross_entropy, opt, make_data(), cbs)
        return model, stop, history

    model, stop, history = run()
    # Epoch 2 does not improve (patience 1), but min_epochs=4 holds the stop
    # back; epoch 3 improves, epoch 4 does not: it stops there.
    assert stop.stop_rule == "patience" and stop.stopped_epoch == 4
    assert stop.best_epoch == 3
    for crash in (9, 31):  # in epochs 1 and 4 (7 batches each)
        with pytest.raises(RuntimeError, match="crash"):
            run(crash, tmp_path)
    resumed_model, resumed, resumed_history = run(directory=tmp_path)
    for key in ("stopped_epoch", "best_epoch", "wait", "stop_rule", "stop_reason"):
        assert getattr(resumed, key) == getattr(stop, key), key
    assert resumed.monitor.best == stop.monitor.best
    assert resumed_history.stop_reason == history.stop_reason
    untimed = [{k: v for k, v in r.items() if k != "time"} for r in history]
    assert [{k: v for k, v in r.items() if k != "time"} for r in resumed_history] == (
        untimed[-len(resumed_history) :]
    )
    for a, b in zip(model.state_dict().values(), resumed_model.state_dict().values()):
        assert torch.equal(a, b)
