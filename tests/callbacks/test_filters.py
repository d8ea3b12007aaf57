import io

import pytest
import torch
from helpers import make_data, make_model, train
from torch.nn import functional as F  # noqa: N812

from fitlib import Callback, CallbackHandler, fit
from fitlib.callback import EVENTS, call_hook, overrides
from fitlib.callbacks.accumulation import GradientAccumulation
from fitlib.callbacks.filters import Filter, every, first, once
from fitlib.callbacks.recorder import Recorder


class Counter(Callback):
    """Writes down each hook call it gets: (event, epoch, step, skip_step)."""

    order = 7

    def __init__(self):
        self.calls = []
        self.n = 0

    def on_train_begin(self, iteration):
        self.calls.append(("on_train_begin", iteration))

    def on_epoch_begin(self, epoch):
        self.calls.append(("on_epoch_begin", epoch))

    def on_batch_begin(self, train, step):
        self.calls.append(("on_batch_begin", train, step))

    def on_step_end(self, step, skip_step):
        self.calls.append(("on_step_end", step, skip_step))

    def on_batch_end(self, train, step, skip_step, epoch):
        self.calls.append(("on_batch_end", train, step, skip_step, epoch))
        self.n += train

    def on_epoch_end(self, epoch):
        self.calls.append(("on_epoch_end", epoch))

    def on_train_end(self, exception):
        self.calls.append(("on_train_end", exception))

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]

    def of(self, event):
        return [c[1:] for c in self.calls if c[0] == event]


def batch_end(cb, step, train=True, skip_step=False, epoch=0):
    call_hook(cb, "on_batch_end", train=train, step=step, skip_step=skip_step,
              epoch=epoch)  # fmt: skip


# -- scripted --------------------------------------------------------------------
def test_every_n_steps_forwards_the_batches_of_steps_n_2n_3n():
    counter = Counter()
    wrapped = every(counter, 3, unit="steps")
    for step in range(1, 11):  # in on_batch_end, step counts the batch's step
        batch_end(wrapped, step)
    assert [c[1] for c in counter.of("on_batch_end")] == [3, 6, 9]
    assert wrapped.calls == 3


def test_before_the_step_a_batch_counts_as_the_step_it_is_making():
    counter = Counter()
    wrapped = every(counter, 3)
    for done in range(6):  # on_batch_begin: `step` steps done before the batch
        call_hook(wrapped, "on_batch_begin", train=True, step=done)
        call_hook(wrapped, "on_step_end", step=done, skip_step=False, train=True)
    assert counter.of("on_batch_begin") == [(True, 2), (True, 5)]
    assert counter.of("on_step_end") == [(2, False), (5, False)]


def test_a_batch_that_does_not_step_belongs_to_the_next_step():
    counter = Counter()
    wrapped = every(counter, 2)
    batch_end(wrapped, 1, skip_step=True)  # accumulating towards step 2
    batch_end(wrapped, 2, skip_step=False)  # made step 2
    batch_end(wrapped, 2, skip_step=True)  # towards step 3: not selected
    assert [c[1:3] for c in counter.of("on_batch_end")] == [(1, True), (2, False)]


def test_with_steps_epoch_hooks_and_validation_batches_always_run():
    counter = Counter()
    wrapped = every(counter, 100)
    call_hook(wrapped, "on_epoch_begin", epoch=0)
    batch_end(wrapped, 1)  # a training batch of step 1: filtered out
    batch_end(wrapped, 1, train=False)  # a validation batch
    call_hook(wrapped, "on_epoch_end", epoch=0)
    assert counter.of("on_epoch_begin") == [(0,)] == counter.of("on_epoch_end")
    assert counter.of("on_batch_end") == [(False, 1, False, 0)]


def test_every_n_epochs_runs_all_hooks_of_epochs_n_2n_only():
    counter = Counter()
    wrapped = every(counter, 2, unit="epochs")
    for epoch in range(5):
        call_hook(wrapped, "on_epoch_begin", epoch=epoch)
        batch_end(wrapped, epoch + 1, epoch=epoch)
        batch_end(wrapped, epoch + 1, train=False, epoch=epoch)
        call_hook(wrapped, "on_epoch_end", epoch=epoch)
    assert counter.of("on_epoch_begin") == [(1,), (3,)] == counter.of("on_epoch_end")
    assert [c[3] for c in counter.of("on_batch_end")] == [1, 1, 3, 3]


def test_once_runs_only_at_the_given_step_or_epoch():
    counter = Counter()
    wrapped = once(counter, at=4)
    for step in range(1, 9):
        batch_end(wrapped, step)
    assert [c[1] for c in counter.of("on_batch_end")] == [4]
    by_epoch = Counter()
    wrapped = once(by_epoch, at=1, unit="epochs")  # the first epoch: epoch 0
    for epoch in range(3):
        call_hook(wrapped, "on_epoch_end", epoch=epoch)
    assert by_epoch.of("on_epoch_end") == [(0,)]


def test_first_runs_each_hook_only_the_first_time_its_event_fires():
    counter = Counter()
    wrapped = first(counter)
    for epoch in range(3):
        call_hook(wrapped, "on_epoch_begin", epoch=epoch)
        for step in range(1, 4):
            batch_end(wrapped, step + 3 * epoch, epoch=epoch)
        call_hook(wrapped, "on_epoch_end", epoch=epoch)
    assert counter.of("on_epoch_begin") == [(0,)] == counter.of("on_epoch_end")
    assert counter.of("on_batch_end") == [(True, 1, False, 0)]
    assert wrapped.state_dict()["filter"]["done"] == [
        "on_batch_end", "on_epoch_begin", "on_epoch_end"
    ]  # fmt: skip


def test_train_begin_and_end_always_run_and_get_their_keys():
    counter = Counter()
    wrapped = once(counter, at=10**6)
    call_hook(wrapped, "on_train_begin", iteration=0)
    error = RuntimeError("x")
    call_hook(wrapped, "on_train_end", exception=error)
    assert counter.calls == [("on_train_begin", 0), ("on_train_end", error)]


def test_it_returns_the_wrapped_hooks_updates():
    class Stop(Callback):
        def on_batch_end(self, step):
            return {"stop_training": True}

    wrapped = every(Stop(), 5)
    assert call_hook(wrapped, "on_batch_end", train=True, step=4) is None
    assert call_hook(wrapped, "on_batch_end", train=True, step=5) == {
        "stop_training": True
    }


def test_a_hook_taking_kwargs_receives_the_whole_state():
    class Everything(Callback):
        def on_batch_end(self, **kwargs):
            self.got = kwargs

    cb = Everything()
    call_hook(every(cb, 1), "on_batch_end", train=True, step=1, last_loss=3)
    assert cb.got["last_loss"] == 3 and cb.got["step"] == 1
    assert "n_epochs" in cb.got and "smooth_loss" in cb.got


# -- the wrapper's shape ---------------------------------------------------------
def test_it_has_only_the_hooks_the_wrapped_callback_overrides():
    class OnlyBatchEnd(Callback):
        def on_batch_end(self, last_loss):
            pass

    wrapped = every(OnlyBatchEnd(), 10)
    overridden = [e for e in EVENTS if overrides(wrapped, e)]
    assert overridden == ["on_train_begin", "on_batch_end"]  # it resets at begin
    handler = CallbackHandler([wrapped])
    assert handler._hooks["on_batch_begin"] == []
    assert handler._hooks["on_step_end"] == []
    assert not handler._smooth_read  # naming keys, not **kwargs: no smooth loss


def test_it_has_the_wrapped_callbacks_order_and_a_name_saying_what_it_does():
    rec = Recorder()
    assert every(rec, 100).name == "every(100 steps, Recorder)"
    assert every(rec, 2, "epochs").order == rec.order == 50
    assert once(rec, at=500).name == "once(step 500, Recorder)"
    assert once(rec, at=3, unit="epochs").name == "once(epoch 3, Recorder)"
    assert first(rec).name == "first(Recorder)"
    assert isinstance(first(rec), Filter) and first(rec).callback is rec
    assert repr(every(Counter(), 3)) == "every(Counter(order=7), n=3, unit='steps')"


def test_filters_nest():
    counter = Counter()
    wrapped = every(first(counter), 2, unit="epochs")
    assert wrapped.name == "every(2 epochs, first(Counter))"
    for epoch in range(4):
        call_hook(wrapped, "on_epoch_end", epoch=epoch)
    assert counter.of("on_epoch_end") == [(1,)]


# -- saved state -----------------------------------------------------------------
def round_trip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_state_dict_holds_its_counter_and_the_wrapped_ones_state():
    counter = Counter()
    wrapped = first(counter)
    call_hook(wrapped, "on_train_begin", iteration=0)
    batch_end(wrapped, 1)
    batch_end(wrapped, 2)
    state = round_trip(wrapped.state_dict())
    assert state == {"filter": {"calls": 1, "done": ["on_batch_end"]},
                     "callback": {"n": 1}}  # fmt: skip
    resumed = first(Counter())
    resumed.load_state_dict(state)
    call_hook(resumed, "on_train_begin", iteration=5)  # resumed: state kept
    batch_end(resumed, 6)
    assert resumed.state_dict() == state and resumed.callback.n == 1
    call_hook(resumed, "on_train_begin", iteration=0)  # a new fit resets
    assert resumed.state_dict()["filter"] == {"calls": 0, "done": []}
    with pytest.raises(ValueError, match=r"expected \{'filter'"):
        resumed.load_state_dict({"calls": 1})


# -- through fit -----------------------------------------------------------------
def test_through_fit_every_3_steps_runs_on_steps_3_6_9_12():
    counter = Counter()
    train([every(counter, 3)], epochs=2)  # 7 batches an epoch: 14 steps
    train_ends = [c for c in counter.of("on_batch_end") if c[0]]
    assert [c[1] for c in train_ends] == [3, 6, 9, 12]
    assert [c[1] for c in counter.of("on_batch_begin") if c[0]] == [2, 5, 8, 11]
    assert counter.of("on_epoch_end") == [(0,), (1,)]  # epoch hooks: all
    assert len([c for c in counter.of("on_batch_end") if not c[0]]) == 2 * 3
    assert counter.calls[0] == ("on_train_begin", 0)
    assert counter.calls[-1] == ("on_train_end", None)


def test_through_fit_with_gradient_accumulation_steps_are_optimizer_steps():
    counter = Counter()
    # 7 batches an epoch in groups of 2: 4 optimizer steps an epoch, 12 in all.
    train([every(counter, 3), GradientAccumulation(2)], epochs=3)
    train_ends = [c[1:3] for c in counter.of("on_batch_end") if c[0]]
    stepped = [step for step, skipped in train_ends if not skipped]
    assert stepped == [3, 6, 9, 12]
    # The batches whose gradients each selected step uses (step 12: 1 batch).
    assert train_ends == [(2, True), (3, False), (5, True), (6, False),
                          (8, True), (9, False), (12, False)]  # fmt: skip


def test_through_fit_every_2_epochs_runs_in_epochs_2_and_4():
    counter = Counter()
    train([every(counter, 2, unit="epochs")], epochs=4)
    assert counter.of("on_epoch_begin") == [(1,), (3,)]
    assert {c[3] for c in counter.of("on_batch_end")} == {1, 3}
    assert len(counter.of("on_batch_end")) == 2 * (7 + 3)


def test_through_fit_a_wrapped_callback_can_stop_training():
    class StopNow(Callback):
        def on_batch_end(self, train, step):
            return {"stop_training": True} if train else None

    rec = Recorder()
    train([once(StopNow(), at=5), rec], epochs=3)
    assert len(rec.losses) == 5  # stopped after the 5th step


def test_through_fit_a_filtered_recorder_records_every_n_steps():
    rec = Recorder()
    train([every(rec, 7)], epochs=3)
    assert len(rec.losses) == 3  # steps 7, 14, 21
    assert len(rec.metrics) == 3  # epoch ends are not filtered by steps


# -- bad input -------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, -3])
def test_n_or_at_below_1_raises(n):
    with pytest.raises(ValueError, match=f"every: n must be an int >= 1; got {n}"):
        every(Counter(), n)
    with pytest.raises(ValueError, match=f"once: at must be an int >= 1; got {n}"):
        once(Counter(), at=n)


def test_n_that_is_not_an_int_raises():
    with pytest.raises(TypeError, match="every: n must be an int"):
        every(Counter(), 2.5)


def test_an_unknown_unit_raises():
    with pytest.raises(ValueError, match=r"unit must be one of \('steps', 'epochs'"):
        every(Counter(), 3, unit="batches")
    with pytest.raises(ValueError, match="once: unit must be one of"):
        once(Counter(), 3, unit="step")


def test_wrapping_something_that_is_not_a_callback_instance_raises():
    with pytest.raises(TypeError, match=r"every: callback must be a fitlib\.Callback"):
        every(lambda: None, 3)
    with pytest.raises(TypeError, match=r"got the class Counter, not an instance"):
        first(Counter)


def test_a_hook_with_a_parameter_no_key_matches_fails_when_wrapped():
    class Typo(Callback):
        def on_batch_end(self, lastloss):
            pass

    with pytest.raises(TypeError, match=r"Typo\.on_batch_end requires.*'lastloss'"):
        every(Typo(), 3)


# -- every(cb, when=...) -----------------------------------------------------------
# Cases ported from Ignite's event filter tests (a handler runs only on chosen
# iterations or epochs; a filter with both a count and a function is refused;
# a filter function of the wrong shape is refused), in fitlib's terms.
SPECIAL = {1, 2, 5, 7, 11}


def test_when_runs_the_hooks_where_the_predicate_is_true():
    counter = Counter()
    wrapped = every(counter, when=lambda step, train: train and step in SPECIAL)
    for step in range(1, 13):
        batch_end(wrapped, step)
    assert [c[1] for c in counter.of("on_batch_end")] == [1, 2, 5, 7, 11]
    assert wrapped.calls == 5


def test_when_by_epoch_gates_every_hook_of_the_chosen_epochs():
    counter = Counter()
    wrapped = every(counter, when=lambda epoch: epoch + 1 in SPECIAL)
    for epoch in range(8):
        call_hook(wrapped, "on_epoch_begin", epoch=epoch)
        batch_end(wrapped, epoch + 1, epoch=epoch)
        batch_end(wrapped, epoch + 1, train=False, epoch=epoch)
        call_hook(wrapped, "on_epoch_end", epoch=epoch)
    assert counter.of("on_epoch_begin") == [(0,), (1,), (4,), (6,)]
    assert counter.of("on_epoch_end") == counter.of("on_epoch_begin")
    assert [c[3] for c in counter.of("on_batch_end")] == [0, 0, 1, 1, 4, 4, 6, 6]


def test_when_gets_the_state_of_the_event_it_gates():
    seen = []

    def when(train, last_loss, **kwargs):
        seen.append((train, last_loss, "record" in kwargs))
        return True

    counter = Counter()
    call_hook(every(counter, when=when), "on_batch_end", train=True, step=1,
              skip_step=False, last_loss=0.5)  # fmt: skip
    assert seen == [(True, 0.5, True)]
    assert counter.of("on_batch_end") == [(True, 1, False, 0)]


def test_when_leaves_train_begin_and_end_to_run():
    counter = Counter()
    wrapped = every(counter, when=lambda: False)
    call_hook(wrapped, "on_train_begin", iteration=0)
    batch_end(wrapped, 1)
    call_hook(wrapped, "on_epoch_end", epoch=0)
    call_hook(wrapped, "on_train_end", exception=None)
    assert counter.calls == [("on_train_begin", 0), ("on_train_end", None)]


def test_when_name_repr_order_and_shape():
    def warm(epoch):
        return epoch >= 2

    rec = Recorder()
    wrapped = every(rec, when=warm)
    assert wrapped.name == "every(when warm, Recorder)"
    assert repr(wrapped) == "every(Recorder(order=50), when=warm)"
    assert wrapped.order == 50 and wrapped.callback is rec
    counter = Counter()
    only = every(counter, when=lambda step: True)
    hooks = [e for e in EVENTS if overrides(counter, e)]
    assert [e for e in EVENTS if overrides(only, e)] == hooks
    handler = CallbackHandler([every(OnlyEpochEnd(), when=lambda epoch: True)])
    assert [e for e, hooks in handler._hooks.items() if hooks] == [
        "on_train_begin", "on_epoch_end"]  # fmt: skip
    assert not handler._smooth_read


class OnlyEpochEnd(Callback):
    def on_epoch_end(self, epoch):
        self.last = epoch


def test_when_state_dict_holds_the_calls_and_a_new_fit_resets_them():
    counter = Counter()
    wrapped = every(counter, when=lambda step: step % 2 == 0)
    call_hook(wrapped, "on_train_begin", iteration=0)
    for step in range(1, 5):
        batch_end(wrapped, step)
    state = round_trip(wrapped.state_dict())
    assert state == {"filter": {"calls": 2}, "callback": {"n": 2}}
    resumed = every(Counter(), when=lambda step: step % 2 == 0)
    resumed.load_state_dict(state)
    call_hook(resumed, "on_train_begin", iteration=4)  # resumed: kept
    assert resumed.state_dict() == state
    call_hook(resumed, "on_train_begin", iteration=0)
    assert resumed.state_dict()["filter"] == {"calls": 0}


def test_through_fit_when_runs_on_the_chosen_steps_and_epochs():
    counter = Counter()
    train([every(counter, when=lambda train, step, skip_step: train and (
        step if not skip_step else step + 1) in SPECIAL)], epochs=2)  # fmt: skip
    assert [c[1] for c in counter.of("on_batch_end")] == [1, 2, 5, 7, 11]
    by_epoch = Counter()
    train([every(by_epoch, when=lambda epoch: epoch == 1)], epochs=3)
    assert by_epoch.of("on_epoch_end") == [(1,)]
    assert len(by_epoch.of("on_batch_end")) == 7 + 3


def test_through_fit_a_wrapped_callback_stops_when_the_predicate_lets_it():
    class Stop(Callback):
        def on_epoch_end(self):
            return {"stop_training": True}

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stop = every(Stop(), when=lambda record: record["valid_loss"] < 10)
    history = fit(3, model, F.cross_entropy, opt, make_data(), callbacks=[stop])
    assert len(history) == 1  # the filter's name says what stopped it
    assert history.stop_reason == "every(when <lambda>, Stop) stopped training"


def test_when_and_n_together_are_refused_and_one_is_needed():
    with pytest.raises(TypeError, match=r"every: pass n or when, not both"):
        every(Counter(), 3, when=lambda step: True)
    with pytest.raises(TypeError, match=r"every: pass n .* or when"):
        every(Counter())
    with pytest.raises(TypeError, match=r"every: unit applies to n"):
        every(Counter(), when=lambda step: True, unit="epochs")


def test_when_must_be_a_function_of_state_keys():
    with pytest.raises(TypeError, match=r"every: when must be callable; got 3"):
        every(Counter(), when=3)
    with pytest.raises(TypeError, match=r"every\.when requires parameter\(s\) "
                       r"'stpe' \(did you mean 'step'\?\)"):  # fmt: skip
        every(Counter(), when=lambda stpe: True)
    with pytest.raises(TypeError, match=r"'state'.*names the keys it reads"):
        every(Counter(), when=lambda state: True)  # Ignite's (engine, event) shape


def test_when_returning_a_tensor_or_a_non_bool_is_refused():
    wrapped = every(Counter(), when=lambda last_loss: last_loss > 1)
    with pytest.raises(TypeError, match=r"returned a Tensor.*host"):
        call_hook(wrapped, "on_batch_end", train=True, step=1,
                  last_loss=torch.tensor(2.0))  # fmt: skip
    wrapped = every(Counter(), when=lambda step: step % 100)  # an int, truthy
    with pytest.raises(
        TypeError, match=r"the value when returns must be True or False; got 1 \(int\)"
    ):
        call_hook(wrapped, "on_batch_end", train=True, step=1)
