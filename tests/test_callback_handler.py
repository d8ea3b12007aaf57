"""``fitlib.callback_handler.CallbackHandler``: the order it calls hooks in,
what it does with what they return (updates, control flags, refused keys),
errors and Ctrl-C, the smoothed loss and counters, and a handler driven by
hand."""

import os
import signal

import pytest
import torch
from helpers import clone_params, make_data, make_model, train
from torch.nn import functional as F  # noqa: N812

from fitlib import Callback, CallbackHandler, HPOptimizer, fit, loss_batch, validate
from fitlib.callback import EVENTS, WRITABLE
from fitlib.callbacks import (
    GradientAccumulation,
    GradientClipping,
    MixedPrecision,
    Recorder,
)


class EveryHook(Callback):
    def __init__(self):
        self.events = []


for _ev in EVENTS:
    setattr(
        EveryHook,
        _ev,
        lambda self, _ev=_ev, **kw: self.events.append((_ev, kw["train"])),
    )


def test_events_fire_in_the_documented_order():
    cb = EveryHook()
    data = make_data(n_train=32, n_valid=16, bs=16)
    train([cb], data=data, epochs=1)
    training = [
        "on_batch_begin",
        "on_loss_begin",
        "on_backward_begin",
        "on_backward_end",
        "on_step_end",
        "on_batch_end",
    ]
    valid = ["on_batch_begin", "on_loss_begin", "on_batch_end"]
    expected = ["on_train_begin", "on_epoch_begin", *training * 2, *valid]
    expected += ["on_epoch_end", "on_train_end"]
    assert [e for e, _ in cb.events] == expected
    flags = [t for e, t in cb.events if e == "on_batch_end"]
    assert flags == [True, True, False]


def test_callback_overriding_only_epoch_end_is_never_called_per_batch(monkeypatch):
    def boom(self, **kwargs):
        raise AssertionError("a hook nobody overrides was dispatched")

    for ev in EVENTS:
        if ev != "on_epoch_end":
            monkeypatch.setattr(Callback, ev, boom)

    class EpochOnly(Callback):
        calls = 0

        def on_epoch_end(self, **kwargs):
            type(self).calls += 1

    handler = CallbackHandler([EpochOnly()])
    assert [ev for ev in EVENTS if handler._hooks[ev]] == ["on_epoch_end"]
    train([EpochOnly()], epochs=3)
    assert EpochOnly.calls == 3


def test_callbacks_run_by_order_and_stably_for_equal_orders():
    seen = []

    class Named(Callback):
        def __init__(self, name, order):
            self.label, self.order = name, order

        def on_train_begin(self, **kwargs):
            seen.append(self.label)

    cbs = [Named("a", 5), Named("b", 0), Named("c", 5), Named("d", -1)]
    train(cbs, epochs=1)
    assert seen == ["d", "b", "a", "c"]


def test_returned_update_reaches_later_callbacks_and_the_loop():
    class Double(Callback):
        order = 0

        def on_backward_begin(self, last_loss, **kwargs):
            return {"last_loss": last_loss * 2}

    class Check(Callback):
        order = 1

        def __init__(self):
            self.pairs = []

        def on_loss_begin(self, **kwargs):
            pass

        def on_backward_begin(self, last_loss, last_output, last_target, **kwargs):
            self.pairs.append((last_loss, F.cross_entropy(last_output, last_target)))

    check = Check()
    data = make_data(n_train=16, n_valid=16, bs=16)
    # skip the step so the gradient stays readable after the batch
    grads = []

    class KeepGrad(Callback):
        order = 2

        def on_backward_end(self, model, **kwargs):
            grads.append(next(model.parameters()).grad.clone())
            return {"skip_step": True}

    model = make_model()
    rec = Recorder()
    train([Double(), check, KeepGrad(), rec], data=data, model=model, epochs=1)
    loss, plain = check.pairs[0]
    torch.testing.assert_close(loss, plain * 2)
    # the doubled loss drove backward only: the recorded loss is loss_func's
    assert rec.losses[0] == pytest.approx(plain.item())

    model2 = make_model()
    grads_plain = []

    class KeepGrad2(KeepGrad):
        def on_backward_end(self, model, **kwargs):
            grads_plain.append(next(model.parameters()).grad.clone())
            return {"skip_step": True}

    train([KeepGrad2()], data=data, model=model2, epochs=1)
    torch.testing.assert_close(grads[0], grads_plain[0] * 2)


def test_unknown_state_key_names_the_callback_the_key_and_the_valid_keys():
    class Typo(Callback):
        def on_batch_end(self, **kwargs):
            return {"stop_trainig": True}

    with pytest.raises(ValueError, match=r"Typo\.on_batch_end") as info:
        train([Typo()], epochs=1)
    assert "stop_trainig" in str(info.value)
    assert all(k in str(info.value) for k in ("stop_training", "last_loss"))


def test_a_hook_returning_something_else_than_a_dict_is_a_type_error():
    class Bad(Callback):
        def on_epoch_end(self, **kwargs):
            return True

    with pytest.raises(TypeError, match=r"Bad\.on_epoch_end returned bool"):
        train([Bad()], epochs=1)


def test_exception_in_a_callback_names_it_and_on_train_end_still_runs():
    ended = []

    class Fails(Callback):
        def on_step_end(self, **kwargs):
            raise RuntimeError("boom")

    class Watch(Callback):
        def on_train_end(self, exception, **kwargs):
            ended.append(exception)

    with pytest.raises(RuntimeError, match="boom") as info:
        train([Fails(), Watch()], epochs=1)
    assert any("Fails.on_step_end" in note for note in info.value.__notes__)
    assert isinstance(ended[0], RuntimeError)


def test_on_train_end_receives_none_after_success():
    got = []

    class Watch(Callback):
        def on_train_end(self, exception, **kwargs):
            got.append(exception)

    train([Watch()], epochs=1)
    assert got == [None]


def test_passing_a_callback_class_or_other_object_is_a_type_error():
    with pytest.raises(TypeError, match=r"pass Callback\(\)"):
        CallbackHandler([Callback])
    with pytest.raises(TypeError, match=r"not a fitlib\.Callback"):
        CallbackHandler([lambda: None])


# -- control flags ---------------------------------------------------------------
def _flag_cb(event, update, when=lambda it: True):
    class Flag(Callback):
        def __init__(self):
            self.iterations = []

    def hook(self, iteration, train, **kwargs):
        if train:
            self.iterations.append(iteration)
        if train and when(iteration):
            return dict(update)

    setattr(Flag, event, hook)
    return Flag()


def test_stop_training_at_batch_end_stops_after_that_batch():
    counter = _flag_cb("on_batch_end", {"stop_training": True}, lambda i: i == 2)
    epochs = []

    class Epochs(Callback):
        def on_epoch_end(self, epoch, **kwargs):
            epochs.append(epoch)

    train([counter, Epochs()], epochs=3)
    assert counter.iterations == [0, 1, 2]
    assert epochs == [0]


def test_stop_epoch_ends_only_the_current_epoch():
    cb = _flag_cb("on_batch_end", {"stop_epoch": True})
    train([cb], epochs=3)
    assert cb.iterations == [0, 1, 2]  # one batch per epoch


def test_skip_step_leaves_weights_unchanged():
    model = make_model()
    before = clone_params(model)
    train([_flag_cb("on_backward_end", {"skip_step": True})], model=model, epochs=1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_skip_bwd_leaves_no_gradient():
    grads = []

    class Grad(Callback):
        order = 1

        def on_backward_end(self, model, **kwargs):
            grads.append(next(model.parameters()).grad)

    train([_flag_cb("on_backward_begin", {"skip_bwd": True}), Grad()], epochs=1)
    assert grads and all(g is None for g in grads)


def test_skip_zero_accumulates_gradients():
    norms = []

    class Grad(Callback):
        order = 1

        def on_backward_end(self, model, **kwargs):
            norms.append(next(model.parameters()).grad.clone())
            return {"skip_step": True}

    data = make_data(n_train=32, bs=16, shuffle=False)
    model = make_model()
    model.eval()  # dropout off for a clean sum

    class Eval(Callback):
        def on_batch_begin(self, model, **kwargs):
            model.eval()

    train(
        [Eval(), _flag_cb("on_step_end", {"skip_zero": True}), Grad()],
        data=data,
        model=model,
        epochs=1,
    )
    train([Eval(), Grad()], data=data, model=make_model(), epochs=1)
    accumulated, single = norms[:2], norms[2:]
    torch.testing.assert_close(accumulated[1], single[0] + single[1])


def test_skip_validate_skips_validation_and_last_metrics_is_none():
    seen = []

    class Skip(Callback):
        def on_epoch_begin(self, epoch, **kwargs):
            return {"skip_validate": epoch == 0}

        def on_batch_begin(self, train, **kwargs):
            if not train:
                seen.append("valid")

        def on_epoch_end(self, last_metrics, **kwargs):
            seen.append(last_metrics)

    train([Skip()], epochs=2)
    assert seen[0] is None
    assert "valid" in seen[1:] and isinstance(seen[-1], list)


# -- Ctrl-C ------------------------------------------------------------------------
@pytest.fixture
def sigint_default():
    """Python's own Ctrl-C handler, as in a terminal or a notebook.

    A shell starts background jobs with SIGINT ignored, and fitlib rightly
    leaves an ignored signal alone; these tests are about the usual case.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("sigint_default")
def test_ctrl_c_stops_after_the_batch_in_progress_with_a_whole_step():
    """SIGINT between backward and step: the step still happens, then it stops."""
    ended = []

    class CtrlC(Callback):
        def on_backward_end(self, iteration, **kwargs):
            if iteration == 2:
                os.kill(os.getpid(), signal.SIGINT)

        def on_train_end(self, exception, **kwargs):
            ended.append(exception)

    data = make_data(shuffle=False)
    interrupted = make_model()
    with pytest.raises(KeyboardInterrupt):
        train([CtrlC()], data=data, model=interrupted, epochs=1)
    assert isinstance(ended[0], KeyboardInterrupt)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    reference = make_model()
    stop = _flag_cb("on_batch_end", {"stop_training": True}, lambda i: i == 2)
    skip = _flag_cb("on_epoch_begin", {"skip_validate": True})
    train([stop, skip], data=data, model=reference, epochs=1)
    for a, b in zip(interrupted.parameters(), reference.parameters()):
        assert torch.equal(a, b)


class ReadsSmoothLoss(Callback):
    def on_epoch_end(self, smooth_loss):
        pass


def test_smooth_loss_is_the_debiased_moving_average_of_training_losses():
    handler = CallbackHandler([ReadsSmoothLoss()])
    handler.on_train_begin(1)
    losses = [2.0, 1.0, 4.0, 0.5, 3.0]
    avg, expected = 0.0, []
    for n, value in enumerate(losses, start=1):
        avg = 0.98 * avg + 0.02 * value
        expected.append(avg / (1 - 0.98**n))
        handler.on_batch_begin(None, None, train=True)
        handler.on_batch_end(torch.tensor(value))
        torch.testing.assert_close(
            handler.state["smooth_loss"], torch.tensor(expected[-1])
        )
    handler.on_batch_begin(None, None, train=False)  # validation leaves it alone
    handler.on_batch_end(torch.tensor(100.0))
    torch.testing.assert_close(handler.state["smooth_loss"], torch.tensor(expected[-1]))


@pytest.mark.parametrize(
    ("callbacks", "kept"),
    [
        ([], False),
        ([Recorder()], False),  # it smooths the losses it keeps, at epoch end
        ([ReadsSmoothLoss()], True),
        ([EveryHook()], True),  # **kwargs receives every key
    ],
)
def test_smooth_loss_is_kept_only_when_a_callback_receives_it(callbacks, kept):
    handler = CallbackHandler(callbacks)
    handler.on_train_begin(1, opt=torch.optim.SGD([torch.zeros(1)], lr=0.1))
    for value in (2.0, 1.0):
        handler.on_batch_begin(None, None, train=True)
        handler.on_batch_end(torch.tensor(value))
    smooth = handler.state["smooth_loss"]
    assert (smooth is not None) == kept


def test_num_batch_counts_within_each_loader_and_iteration_across_epochs():
    seen = []

    class Count(Callback):
        def on_batch_end(self, train, num_batch, iteration, **kwargs):
            seen.append((train, num_batch, iteration))

    train([Count()], epochs=2, data=make_data(n_train=32, n_valid=32, bs=16))
    assert seen == [
        (True, 0, 0), (True, 1, 1), (False, 0, 2), (False, 1, 2),
        (True, 0, 2), (True, 1, 3), (False, 0, 4), (False, 1, 4),
    ]  # fmt: skip


def _count_valid_batches():
    class CountValid(Callback):
        order = 100

        def __init__(self):
            self.valid = []

        def on_epoch_begin(self, **kwargs):
            self.valid.append(0)

        def on_batch_end(self, train, **kwargs):
            if not train:
                self.valid[-1] += 1

    return CountValid()


def test_stop_flags_set_in_training_leave_validation_whole():
    data = make_data(n_train=64, n_valid=48, bs=16)  # 4 train, 3 valid batches
    for flag in ("stop_epoch", "stop_training"):
        counter = _count_valid_batches()
        stop = _flag_cb("on_batch_end", {flag: True}, lambda i: i == 1)
        train([stop, counter], epochs=2, data=data)
        expected = [3] if flag == "stop_training" else [3, 3]
        assert counter.valid == expected, flag


def test_stop_epoch_during_validation_ends_validation_early():
    class TwoValidBatches(Callback):
        def on_batch_end(self, train, num_batch, **kwargs):
            if not train and num_batch == 1:
                return {"stop_epoch": True}

    counter = _count_valid_batches()
    data = make_data(n_train=32, n_valid=64, bs=16)
    train([TwoValidBatches(), counter], epochs=2, data=data)
    assert counter.valid == [2, 2]


def test_stored_output_carries_no_graph_after_the_batch():
    graphs = []

    class Look(Callback):
        def on_backward_begin(self, last_output, **kwargs):
            graphs.append(last_output.grad_fn is not None)

        def on_batch_end(self, last_output, train, **kwargs):
            if train:
                graphs.append(last_output.grad_fn is not None)

    train([Look()], data=make_data(n_train=16, n_valid=16, bs=16), epochs=1)
    assert graphs == [True, False]


def _accumulator(param):
    """The parameter's gradient accumulator (the node backward() adds into)."""
    return param.view_as(param).grad_fn.next_functions[0][0]


def _accumulators_reused(skip_bwd_at=None):
    """Whether, at each training step after the first, the parameters' gradient
    accumulators are the previous step's (a mark left on them survives)."""
    seen = []

    class Mark(Callback):
        def on_loss_begin(self, model, iteration, train, **kwargs):
            if train and iteration > 0:  # after this step's forward
                seen.append(_accumulator(next(model.parameters())).metadata.get("mark"))

        def on_backward_begin(self, iteration, **kwargs):
            if iteration == skip_bwd_at:
                return {"skip_bwd": True}

        def on_batch_end(self, model, train, iteration, **kwargs):
            if train:
                _accumulator(next(model.parameters())).metadata["mark"] = iteration

    train([Mark()], data=make_data(n_train=64, n_valid=16, bs=16), epochs=1)
    return seen


def test_the_last_steps_graph_is_kept_so_gradient_accumulators_are_reused():
    # A hand-written loop keeps them alive through its ``loss`` variable;
    # building them again at every step costs about 14k instructions.
    assert _accumulators_reused() == [0, 1, 2]


def test_a_graph_whose_backward_was_skipped_is_not_kept():
    # It still holds its activations: keeping it would double their memory.
    assert _accumulators_reused(skip_bwd_at=1) == [0, None, 2]


def test_every_on_train_end_runs_even_when_one_fails():
    ran = []

    class Fails(Callback):
        order = 0

        def on_train_end(self, **kwargs):
            raise OSError("cannot close file")

    class Cleanup(Callback):
        order = 1

        def on_train_end(self, exception, **kwargs):
            ran.append(exception)

    with pytest.raises(OSError, match="cannot close file"):
        train([Fails(), Cleanup()], epochs=1)
    assert ran == [None]

    class Boom(Callback):
        def on_step_end(self, **kwargs):
            raise RuntimeError("training broke")

    with pytest.raises(RuntimeError, match="training broke") as info:
        train(
            [Boom(), Fails(), Cleanup()], epochs=1
        )  # the first error is the one raised
    assert any("cannot close file" in note for note in info.value.__notes__)
    assert isinstance(ran[-1], RuntimeError)


@pytest.mark.usefixtures("sigint_default")
def test_ctrl_c_after_the_last_batch_still_raises():
    ended = []

    class LateCtrlC(Callback):
        def on_epoch_end(self, **kwargs):
            os.kill(os.getpid(), signal.SIGINT)

        def on_train_end(self, exception, **kwargs):
            ended.append(exception)

    with pytest.raises(KeyboardInterrupt):
        train([LateCtrlC()], epochs=1)
    assert isinstance(ended[0], KeyboardInterrupt)


def test_an_ignored_ctrl_c_stays_ignored():
    """Under nohup or as a background job SIGINT is ignored: fit keeps it so."""
    seen = []

    class Watch(Callback):
        def on_batch_end(self, **kwargs):
            seen.append(signal.getsignal(signal.SIGINT))

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        train([Watch()], epochs=1)
        assert set(seen) == {signal.SIG_IGN}
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


# -- returned keys must take effect ------------------------------------------------
def returning(event, update):
    """A callback whose ``event`` hook returns ``update`` once."""

    class Returns(Callback):
        done = False

    def hook(self, **kwargs):
        if not self.done:
            self.done = True
            return dict(update)
        return None

    setattr(Returns, event, hook)
    return Returns()


@pytest.mark.parametrize(
    "event, key",
    [
        ("on_loss_begin", "opt"),
        ("on_backward_begin", "loss_func"),
        ("on_step_end", "metrics"),
        ("on_epoch_end", "n_epochs"),
        ("on_backward_end", "model"),
        ("on_epoch_end", "epoch"),
        ("on_step_end", "last_output"),
        ("on_step_end", "skip_step"),
    ],
)
def test_a_key_the_loop_would_not_read_is_refused_naming_where_it_may_go(event, key):
    with pytest.raises(ValueError) as info:
        train([returning(event, {key: None})], epochs=1)
    text = str(info.value)
    assert f"Returns.{event} returned {key!r}" in text
    assert f"In {event} a hook may change: " in text
    assert "would do nothing" in text or "would be ignored or misread" in text


def test_keys_where_they_take_effect_are_accepted():
    seen = []

    class Watch(Callback):
        order = 5

        def on_epoch_end(self, record, epoch):
            seen.append(record["half_loss"])

    class Halve(Callback):
        record_names = ("half_loss",)

        def on_epoch_end(self, record):
            return {"record": {"half_loss": record["valid_loss"] / 2}}

    plain = Recorder()
    train([plain], epochs=1)
    train([Halve(), Watch()], epochs=1)
    assert seen[0] == pytest.approx(plain.valid_losses[0] / 2)


@pytest.mark.parametrize("extra", [False, True])
def test_last_metrics_returned_from_on_epoch_end_is_refused_naming_the_record(extra):
    # Only later callbacks would see it: the record, history, monitors and
    # loggers keep the values the loop computed.
    class Halve(Callback):
        def on_epoch_end(self, last_metrics):
            more = [torch.tensor(0.5)] if extra else []
            return {"last_metrics": [last_metrics[0] / 2, *last_metrics[1:], *more]}

    match = (
        r"Halve\.on_epoch_end returned 'last_metrics'.*existing values cannot be "
        r"replaced.*add a value under a new name.*\{'record': .*record_names"
    )
    with pytest.raises(ValueError, match=match) as info:
        train([Halve()], epochs=1)
    assert "In on_epoch_end a hook may change: " in str(info.value)
    assert "last_metrics" not in WRITABLE


def test_a_value_returned_from_on_train_end_is_refused_and_the_others_still_end():
    ended = []

    class Ends(Callback):
        order = 1

        def on_train_end(self):
            ended.append(True)

    with pytest.raises(ValueError, match=r"nothing reads the state after"):
        train([returning("on_train_end", {"stop_training": True}), Ends()], epochs=1)
    assert ended == [True]
    train([returning("on_train_end", {})], epochs=1)  # an empty update is no update


def test_a_single_callback_is_accepted_where_a_list_is_expected():
    def fit_with(callbacks):
        model = make_model()
        opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        fit(1, model, F.cross_entropy, opt, make_data(), callbacks=callbacks)

    rec = Recorder()
    fit_with(rec)
    assert len(rec.losses) == 7
    with pytest.raises(TypeError, match=r"callbacks must be a list of fitlib"):
        fit_with("Recorder")


def test_two_callbacks_that_schedule_the_same_hyper_parameter_are_refused():
    from fitlib.callbacks import OneCycleScheduler, ParamScheduler, cosine, every

    one_cycle = OneCycleScheduler(0.1)
    with pytest.raises(ValueError, match=r"OneCycleScheduler and ParamScheduler both"):
        train([one_cycle, ParamScheduler({"lr": cosine(0.1, 0.0)})], epochs=1)
    with pytest.raises(ValueError, match=r"both set 'mom' at every step"):
        train(
            [every(ParamScheduler({"mom": cosine(0.9, 0.8)}), 2), one_cycle], epochs=1
        )
    train(
        [OneCycleScheduler(0.1, moms=None), ParamScheduler({"mom": cosine(0.9, 0.8)})],
        epochs=1,
    )


def test_a_hook_name_no_event_calls_is_a_type_error_naming_the_close_one():
    class Typo(Callback):
        def on_epoch_ends(self, epoch):  # never called: a typo
            pass

    with pytest.raises(TypeError, match=r"on_epoch_ends \(did you mean 'on_epoch_end'"):
        train([Typo()], epochs=1)


def test_an_unknown_key_returned_by_a_hook_gets_the_close_key():
    with pytest.raises(
        ValueError, match=r"'stop_trainig' \(did you mean 'stop_training'"
    ):
        train([returning("on_epoch_end", {"stop_trainig": True})], epochs=1)


# -- driving a handler by hand -----------------------------------------------------
def drive(handler, batch_begin=True, epochs=1):
    """A hand-written loop around ``handler``: the calls of
    docs/how-to/drive-the-loop-yourself.md."""
    data, model = make_data(), make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    for _ in range(epochs):
        handler.on_epoch_begin()
        for xb, yb in data.train_dl:
            if batch_begin:
                xb, yb = handler.on_batch_begin(xb, yb)
            handler.on_batch_end(loss_batch(model, xb, yb, F.cross_entropy, opt,
                                            handler))  # fmt: skip
    return model, opt, data


HAND_DRIVEN = [
    lambda: MixedPrecision(dtype=torch.bfloat16),
    lambda: GradientClipping(1.0),
    lambda: GradientAccumulation(2),
    Recorder,
]


@pytest.mark.parametrize("make", HAND_DRIVEN)
def test_a_handler_driven_without_on_train_begin_names_the_missing_call(make):
    begin = r"call handler\.on_train_begin\(n_epochs, model=model, opt=opt, data="
    with pytest.raises(RuntimeError, match=r"before on_train_begin.*" + begin):
        drive(CallbackHandler([make()]))
    data = make_data()
    with pytest.raises(RuntimeError, match=r"on_batch_begin before on_train_begin"):
        validate(
            make_model(), data.valid_dl, F.cross_entropy, CallbackHandler([make()])
        )
    drive(CallbackHandler())  # no callbacks: nothing to set up, nothing refused


def test_loss_batch_without_on_batch_begin_names_the_missing_call():
    # Gradient accumulation divided by zero: it sizes its group there.
    data, model = make_data(), make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    handler = CallbackHandler([GradientAccumulation(2)])
    handler.on_train_begin(1, model=model, opt=opt, data=data)
    with pytest.raises(RuntimeError, match=r"without on_batch_begin.*xb, yb = "
                       r"handler\.on_batch_begin\(xb, yb\)"):  # fmt: skip
        drive(handler, batch_begin=False)


@pytest.mark.parametrize(("make", "given", "missing"), [
    (lambda: MixedPrecision(dtype=torch.bfloat16), ("opt",), "model"),
    (lambda: GradientClipping(1.0), ("opt",), "model"),
    (lambda: GradientAccumulation(2), ("model", "opt"), "data"),
])  # fmt: skip
def test_a_hook_failing_on_a_key_on_train_begin_lacked_names_it(make, given, missing):
    data, model = make_data(), make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    have = {"model": model, "opt": opt, "data": data}
    handler = CallbackHandler([make()])
    with pytest.raises(AttributeError) as info:
        handler.on_train_begin(1, **{k: have[k] for k in given})
        drive(handler)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert f"on_train_begin got no {missing}" in notes
    assert "handler.on_train_begin(n_epochs, model=model, opt=opt, data=" in notes


def test_the_fit_says_why_it_stopped():
    class Enough(Callback):
        def on_epoch_end(self, epoch):
            if epoch == 1:
                return {"stop_training": True, "stop_reason": "good enough"}

    class Later(Callback):  # stops too, after: the first reason stands
        order = 5

        def on_epoch_end(self, epoch):
            if epoch == 1:
                return {"stop_training": True}

    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    history = fit(5, model, F.cross_entropy, opt, make_data(), [Enough(), Later()])
    assert len(history) == 2 and history.stop_reason == "good enough"
    history = fit(5, model, F.cross_entropy, opt, make_data(), [Later()])
    assert history.stop_reason == "Later stopped training"
    history = fit(None, model, F.cross_entropy, opt, make_data(), max_steps=3)
    assert history.stop_reason == "max_steps=3 reached"
    assert fit(1, model, F.cross_entropy, opt, make_data()).stop_reason is None


def test_a_stop_reason_that_is_not_a_str_is_refused():
    class Bad(Callback):
        def on_epoch_end(self):
            return {"stop_training": True, "stop_reason": 3}

    with pytest.raises(TypeError, match=r"Bad\.on_epoch_end returned stop_reason=3"):
        train([Bad()])


def test_a_schedule_of_an_optimizers_eps_and_one_of_a_losss_eps_do_not_clash():
    from fitlib.callbacks import ParamScheduler, linear

    class Smoothed:
        def __init__(self):
            self.eps = 0.0

        def __call__(self, out, y):
            return F.cross_entropy(out, y, label_smoothing=self.eps)

    loss = Smoothed()
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    scheds = [ParamScheduler({"eps": linear(1e-8, 1e-6)}),
              ParamScheduler({"loss_func.eps": linear(0.0, 0.2)})]  # fmt: skip
    fit(1, model, loss, opt, make_data(), scheds)
    assert loss.eps == pytest.approx(0.2, abs=0.05)  # the schedule ran
    twice = [ParamScheduler({"loss_func.eps": linear(0.0, 0.2)}) for _ in range(2)]
    with pytest.raises(ValueError, match=r"loss_func\.eps"):
        fit(1, model, loss, opt, make_data(), twice)


def test_a_stop_taken_back_leaves_no_reason():
    class Stop(Callback):
        def on_batch_end(self, iteration):
            if iteration == 1:
                return {"stop_training": True}

    class GoOn(Callback):  # later: takes the stop back, at every batch
        order = 1

        def on_batch_end(self):
            return {"stop_training": False}

    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    history = fit(2, model, F.cross_entropy, opt, make_data(), [Stop(), GoOn()])
    assert len(history) == 2 and history.stop_reason is None


def test_the_first_stops_reason_stands_over_a_later_stops_own():
    class First(Callback):
        def on_epoch_end(self):
            return {"stop_training": True, "stop_reason": "first"}

    class Second(Callback):
        order = 5

        def on_epoch_end(self):
            return {"stop_training": True, "stop_reason": "second"}

    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    history = fit(3, model, F.cross_entropy, opt, make_data(), [First(), Second()])
    assert history.stop_reason == "first"
