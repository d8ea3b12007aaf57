"""``fitlib.callback``: what a hook receives (every state key, or only the
keys it names), the hook signatures refused before training, and
``call_hook``."""

import pytest
from helpers import make_data, train

from fitlib import Callback, CallbackHandler
from fitlib.callback import EVENTS, STATE_KEYS, call_hook


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
