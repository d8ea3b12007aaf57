"""``fitlib.callback``: what a hook receives (every state key, or only the
keys it names), the hook signatures refused before training, and
``call_hook``."""

import pytest
import torch
from helpers import make_data, make_model, train
from torch.nn import functional as F  # noqa: N812

from fitlib import Callback, CallbackHandler, fit
from fitlib.callback import EVENTS, STATE_KEYS, call_hook, overrides
from fitlib.callbacks import GradientAccumulation, Recorder


def test_state_holds_every_documented_key_in_every_hook():
    keys = []

    class Keys(Callback):
        def on_batch_end(self, **kwargs):
            keys.append(set(kwargs))

    train([Keys()], epochs=1)
    assert all(k >= set(STATE_KEYS) for k in keys)


def test_state_holds_every_documented_key_in_every_hook_of_every_event():
    seen = {}

    class Keys(Callback):
        pass

    def hook_for(event):
        def hook(self, **kwargs):
            seen[event] = set(kwargs)

        return hook

    for ev in EVENTS:
        setattr(Keys, ev, hook_for(ev))
    train([Keys()], epochs=1)
    assert set(seen) == set(EVENTS)
    assert all(keys >= set(STATE_KEYS) for keys in seen.values())
    assert "exception" in seen["on_train_end"]


def test_a_hook_without_kwargs_receives_only_the_keys_it_names():
    seen = []

    class Named(Callback):
        def on_train_begin(self):
            seen.append("begin")

        def on_epoch_begin(self, *, epoch):  # keyword-only works too
            seen.append(("epoch", epoch))

        def on_batch_end(self, train, iteration, num_batch):
            seen.append((train, iteration, num_batch))
            if train and num_batch == 1:
                return {"stop_epoch": True}

        def on_epoch_end(self, last_metrics, epoch):
            seen.append(("end", epoch, len(last_metrics)))

        def on_train_end(self, exception):
            seen.append(exception)

    train([Named()], epochs=2, data=make_data(n_train=64, n_valid=16, bs=16))
    epoch = ["begin", ("epoch", 0), (True, 0, 0), (True, 1, 1), (False, 2, 0)]
    epoch += [("end", 0, 1), ("epoch", 1), (True, 2, 0), (True, 3, 1)]
    assert seen == [*epoch, (False, 4, 0), ("end", 1, 1), None]


def test_a_hook_naming_an_unknown_key_is_a_type_error_before_training():
    class Typo(Callback):
        def on_batch_end(self, lastloss, iteration, _bound=0):
            pass

    with pytest.raises(TypeError, match=r"Typo\.on_batch_end") as info:
        CallbackHandler([Typo()])
    message = str(info.value)
    assert "'lastloss'" in message and "last_loss" in message and "**kwargs" in message
    assert "'iteration'" not in message and "_bound" not in message


def test_a_parameter_with_a_default_that_is_no_state_key_keeps_its_default():
    seen = []

    class Bound(Callback):
        def on_epoch_end(self, epoch, tag="a"):
            seen.append((epoch, tag))

        def on_train_end(self, tag="b", **kwargs):
            seen.append((tag, "epoch" in kwargs))

    train([Bound()], epochs=2)
    assert seen == [(0, "a"), (1, "a"), ("b", True)]


def test_only_on_train_end_may_name_the_exception():
    class Early(Callback):
        def on_epoch_end(self, exception):
            pass

    with pytest.raises(TypeError, match=r"Early\.on_epoch_end.*'exception'"):
        CallbackHandler([Early()])


def test_a_hook_taking_star_args_is_a_type_error():
    class Positional(Callback):
        def on_batch_end(self, *args):
            pass

    with pytest.raises(TypeError, match=r"Positional\.on_batch_end.*\*args"):
        CallbackHandler([Positional()])


def test_call_hook_drives_a_hook_as_the_handler_does():
    class Stop(Callback):
        def on_epoch_end(self, epoch, last_metrics):
            return {"stop_training": epoch == 2 and last_metrics is None}

    assert call_hook(Stop(), "on_epoch_end", epoch=2) == {"stop_training": True}
    assert call_hook(Stop(), "on_epoch_end") == {"stop_training": False}
    key = r"unknown state key 'lastmetrics' \(did you mean 'last_metrics'\?\)"
    with pytest.raises(ValueError, match=key):
        call_hook(Stop(), "on_epoch_end", lastmetrics=None)
    with pytest.raises(ValueError, match="only on_train_end gets exception"):
        call_hook(Stop(), "on_epoch_end", exception=None)
    event = r"unknown event 'on_epochend' \(did you mean 'on_epoch_end'\?\)"
    with pytest.raises(ValueError, match=event):
        call_hook(Stop(), "on_epochend")


# -- Callback.from_hooks ---------------------------------------------------------
# Cases ported from Keras's LambdaCallback tests (the epoch and batch hooks run
# in a fit with validation; an empty one; extra keywords) and Lightning's
# (every hook given runs), in fitlib's terms: hooks name the state keys they read.
def test_from_hooks_runs_each_function_at_its_event_with_the_keys_it_names():
    seen = []
    cb = Callback.from_hooks(
        on_train_begin=lambda n_epochs: seen.append(("begin", n_epochs)),
        on_epoch_begin=lambda epoch: seen.append(("epoch", epoch)),
        on_epoch_end=lambda epoch, record: seen.append(
            ("end", epoch, sorted(record)[:2])
        ),
        on_train_end=lambda exception: seen.append(("done", exception)),
    )
    train([cb], epochs=2)
    ends = [("end", e, ["epoch", "lr"]) for e in (0, 1)]
    assert seen == [("begin", 2), ("epoch", 0), ends[0], ("epoch", 1), ends[1],
                    ("done", None)]  # fmt: skip


def test_from_hooks_batch_hooks_run_for_training_and_validation_batches():
    trains = []
    cb = Callback.from_hooks(on_batch_end=lambda train: trains.append(train))
    train([cb], epochs=1)  # 100 training samples and 37 validation, by 16
    assert trains == [True] * 7 + [False] * 3


def test_from_hooks_every_event_given_runs():
    seen = set()
    hooks = {ev: (lambda ev=ev, **kwargs: seen.add(ev)) for ev in EVENTS}
    train([Callback.from_hooks(**hooks)], epochs=1)
    assert seen == set(EVENTS)


def test_from_hooks_a_returned_dict_is_applied_as_a_class_hooks_is():
    stop = Callback.from_hooks(
        on_batch_end=lambda train, iteration: (
            {"stop_training": True, "stop_reason": "enough"}
            if train and iteration == 2
            else None
        )
    )
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = fit(3, model, F.cross_entropy, opt, make_data(), callbacks=[stop])
    assert len(history) == 1 and history.stop_reason == "enough"


def test_from_hooks_stop_without_a_reason_is_named_after_the_callback():
    stop = Callback.from_hooks(
        on_epoch_end=lambda: {"stop_training": True}, name="stopper"
    )
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = fit(3, model, F.cross_entropy, opt, make_data(), callbacks=[stop])
    assert history.stop_reason == "stopper stopped training"


def test_from_hooks_a_value_added_to_the_record_needs_record_names():
    add = Callback.from_hooks(
        on_epoch_end=lambda epoch: {"record": {"double": 2 * epoch}},
        record_names=("double",),
    )
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = fit(2, model, F.cross_entropy, opt, make_data(), callbacks=[add])
    assert [r["double"] for r in history] == [0, 2]


def test_from_hooks_costs_nothing_on_events_it_does_not_define():
    cb = Callback.from_hooks(on_epoch_end=lambda epoch: None)
    assert [ev for ev in EVENTS if overrides(cb, ev)] == ["on_epoch_end"]
    handler = CallbackHandler([cb])
    assert [ev for ev, hooks in handler._hooks.items() if hooks] == ["on_epoch_end"]
    assert not handler._smooth_read
    other = Callback.from_hooks(on_batch_end=lambda: None)
    assert not overrides(other, "on_epoch_end")  # a class per call


def test_from_hooks_name_order_repr_and_no_state():
    def log(epoch):
        pass

    cb = Callback.from_hooks(on_epoch_end=log, on_train_begin=lambda: None, order=-5)
    assert cb.name == "from_hooks(on_epoch_end, on_train_begin)"
    assert cb.order == -5 and isinstance(cb, Callback)
    assert repr(cb) == (
        "Callback.from_hooks(on_epoch_end=log, on_train_begin=<lambda>, order=-5)"
    )
    named = Callback.from_hooks(on_epoch_end=log, name="log_epochs")
    assert named.name == "log_epochs"
    assert repr(named) == "Callback.from_hooks(on_epoch_end=log, name='log_epochs')"
    assert cb.state_dict() == {}
    handler = CallbackHandler([Recorder(), cb])
    assert [c.name for c in handler.callbacks] == [cb.name, "Recorder"]  # by order


def test_from_hooks_an_unknown_hook_name_says_did_you_mean():
    with pytest.raises(TypeError, match=r"unknown hook 'on_epoch_ends' \(did you "
                       r"mean 'on_epoch_end'\?\)") as info:  # fmt: skip
        Callback.from_hooks(on_epoch_ends=lambda epoch: None)
    assert "on_train_begin" in str(info.value)  # the events are listed
    with pytest.raises(TypeError, match="unknown hook 'custom_method'"):
        Callback.from_hooks(custom_method=lambda: None)  # Keras would keep it


def test_from_hooks_a_parameter_no_state_key_matches_is_refused_when_made():
    with pytest.raises(TypeError, match=r"from_hooks\(on_epoch_end\)\.on_epoch_end "
                       r"requires parameter\(s\) 'recrd' \(did you mean "
                       r"'record'\?\)"):  # fmt: skip
        Callback.from_hooks(on_epoch_end=lambda epoch, recrd: None)
    with pytest.raises(TypeError, match=r"mine\.on_batch_end.*'exception'"):
        Callback.from_hooks(on_batch_end=lambda exception: None, name="mine")
    with pytest.raises(TypeError, match=r"\*args"):
        Callback.from_hooks(on_batch_end=lambda *args: None)


def test_from_hooks_refuses_a_value_that_is_not_callable_and_no_hooks():
    with pytest.raises(TypeError, match=r"on_epoch_end=3 is not callable"):
        Callback.from_hooks(on_epoch_end=3)
    with pytest.raises(TypeError, match="no hook given"):
        Callback.from_hooks(order=1)  # Keras allows an empty one: it would do nothing
    with pytest.raises(TypeError, match="order must be an int"):
        Callback.from_hooks(on_epoch_end=lambda: None, order=1.5)
    with pytest.raises(TypeError, match="name must be a non-empty str"):
        Callback.from_hooks(on_epoch_end=lambda: None, name=3)


def test_from_hooks_a_function_passed_positionally_says_to_name_its_event():
    match = (
        r"Callback\.from_hooks: hooks are passed by event name.*got 1 function "
        r"passed positionally.*Fix: e\.g\. Callback\.from_hooks\(on_epoch_end="
    )
    with pytest.raises(TypeError, match=match):
        Callback.from_hooks(lambda record: None)
    with pytest.raises(TypeError, match=r"got 2 function"):
        Callback.from_hooks(print, print, on_epoch_end=lambda: None)


def test_on_step_end_runs_at_every_training_batch_and_skip_step_says_if_a_step_ran():
    # Under gradient accumulation the step is skipped on most batches: a hook
    # that counts optimizer steps counts the calls with skip_step False.
    calls = []
    cb = Callback.from_hooks(on_step_end=lambda skip_step: calls.append(skip_step))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    opt.register_step_post_hook(lambda *args: steps.append(1))
    fit(2, model, F.cross_entropy, opt, make_data(),
        callbacks=[cb, GradientAccumulation(3)])  # fmt: skip
    assert len(calls) == 2 * 7  # every training batch (7 an epoch)
    assert calls.count(False) == len(steps) == 2 * 3  # 3 steps an epoch (3, 3, 1)
    assert "every training batch" in Callback.on_step_end.__doc__
    assert "skip_step" in Callback.on_step_end.__doc__


def test_from_hooks_a_hook_that_updates_a_key_it_may_not_is_refused_in_fit():
    cb = Callback.from_hooks(on_epoch_end=lambda: {"train": True}, name="bad")
    with pytest.raises(ValueError, match=r"bad\.on_epoch_end returned 'train'"):
        train([cb], epochs=1)


def test_from_hooks_call_hook_drives_one_hook():
    cb = Callback.from_hooks(
        on_backward_begin=lambda last_loss: {"last_loss": last_loss * 2}
    )
    assert call_hook(cb, "on_backward_begin", last_loss=3) == {"last_loss": 6}
