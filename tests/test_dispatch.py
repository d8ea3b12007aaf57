import pytest

from fitlib.dispatch import hook_caller

KEYS = ("epoch", "train", "last_loss")
STATE = {"epoch": 3, "train": True, "last_loss": 0.5}


def test_named_parameters_receive_their_keys_in_any_order():
    call = hook_caller(lambda last_loss, epoch: (last_loss, epoch), "h", KEYS)
    assert call(STATE) == (0.5, 3)
    assert hook_caller(lambda train: train, "h", KEYS)(STATE) is True
    assert hook_caller(lambda: "none", "h", KEYS)(STATE) == "none"


def test_keyword_only_and_defaulted_parameters_are_passed_by_name():
    def hook(epoch, tag="kept", *, train):
        return epoch, tag, train

    assert hook_caller(hook, "h", KEYS)(STATE) == (3, "kept", True)


def test_kwargs_receive_the_whole_state():
    call = hook_caller(lambda epoch, **kwargs: (epoch, kwargs), "h", KEYS)
    assert call(STATE) == (3, {"train": True, "last_loss": 0.5})


def test_a_callable_without_a_signature_gets_the_whole_state_as_keywords():
    # dict() has no inspectable signature: it is called with every key.
    assert hook_caller(dict, "h", KEYS)(STATE) == STATE


def test_a_required_parameter_no_key_matches_is_named_in_the_error():
    with pytest.raises(TypeError, match=r"MyCb\.on_epoch_end requires .*'epochs'"):
        hook_caller(lambda epochs, tag=1: None, "MyCb.on_epoch_end", KEYS)


def test_a_parameter_close_to_a_key_gets_the_key_in_the_error():
    with pytest.raises(TypeError, match=r"'epochs' \(did you mean 'epoch'\?\)"):
        hook_caller(lambda epochs: None, "MyCb.on_epoch_end", KEYS)


def positional_only(epoch, /):
    return epoch


@pytest.mark.parametrize("hook", [lambda *args: None, positional_only])
def test_positional_parameters_are_a_type_error(hook):
    with pytest.raises(TypeError, match="positionally"):
        hook_caller(hook, "h", KEYS)


def test_a_wrapper_taking_args_and_kwargs_gets_the_state_as_keywords():
    def wrapper(*args, **kwargs):  # a decorator without functools.wraps
        return args, kwargs

    assert hook_caller(wrapper, "h", KEYS)(STATE) == ((), STATE)
