"""``fitlib.resume``: what a resume reads besides the files: callback states
given back by class, where a fit ended, what identifies a run, and the
callbacks that change without saving (``StateWatch``). ``Checkpoint``'s use
of them: ``tests/callbacks/test_checkpoint.py``."""

import warnings

import pytest
import torch

from fitlib import Callback, HPOptimizer
from fitlib.callbacks import Recorder
from fitlib.resume import (
    Position,
    StateWatch,
    check_callbacks,
    check_interval,
    final_position,
    give_states,
    run_differences,
    run_signature,
)


class Counter(Callback):
    def __init__(self, n=0):
        self.n = n

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


class Plain(Callback):
    pass


def test_states_go_to_callbacks_of_their_class_in_order():
    first, second, plain = Counter(), Counter(), Plain()
    waiting = give_states([first, plain, second], [["Counter", {"n": 3}],
                                                   ["Counter", {"n": 5}]])  # fmt: skip
    assert (first.n, second.n) == (3, 5)
    assert waiting == [plain]


def test_a_stateful_callback_the_run_lacked_is_refused_before_any_loads(tmp_path):
    first, second = Counter(), Counter()
    with pytest.raises(ValueError, match=r"no state for callback\(s\) \['Counter'\]"):
        check_callbacks([first, second], [["Counter", {"n": 3}]], tmp_path / "c.pth")
    assert (first.n, second.n) == (0, 0)
    check_callbacks([Counter(), Plain()], [["Counter", {"n": 3}]], tmp_path)


def state(**changes):
    return {"exception": None, "epoch": 1, "num_batch": 3, "iteration": 9,
            "step": 9, "n_epochs": 4, "max_steps": None, "stop_training": False,
            "train": True, "skip_step": False, "validate_now": False,
            **changes}  # fmt: skip


def test_final_position_is_resumable_between_steps_finished_at_the_end_or_none():
    assert final_position(state()) == Position(1, 3, 9, 9)
    assert final_position(state(epoch=4)) == Position(4, 0, 9, 9, finished=True)
    assert final_position(state(stop_training=True)).finished
    assert final_position(state(exception=KeyboardInterrupt())) is None
    assert final_position(state(train=False)) is None  # inside validation
    assert final_position(state(validate_now=True)) is None


def test_a_run_differs_in_its_lr_and_length_but_not_a_scheduled_hyper():
    model = torch.nn.Linear(2, 1)
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    saved = run_signature(opt, 3, None, range(8), [])
    opt.lr = 0.2
    ours = run_signature(opt, 5, None, range(8), [])
    assert run_differences(saved, ours, opt, opt.state_dict()["opt"]) == [
        "lr: the checkpoint's run 0.1, this run 0.2",
        "epochs: the checkpoint's run 3, this run 5",
    ]

    class LrSchedule(Callback):
        sets_hypers = ("lr",)

    scheduled = run_signature(opt, 3, None, range(8), [LrSchedule()])
    assert scheduled["schedules"] == {"lr": "LrSchedule(order=0)"}
    assert "lr" not in scheduled["hyper"]  # the schedule's settings say it
    assert scheduled["batches_per_epoch"] == 8


def test_checkpoint_needs_exactly_one_interval():
    check_interval(1, None)
    with pytest.raises(ValueError, match=r"exactly one.*got both"):
        check_interval(1, 500)
    with pytest.raises(ValueError, match="every_n_steps must be an int >= 1"):
        check_interval(None, 0)


def test_state_watch_warns_once_about_a_users_callback_that_changed():
    plain, recorder = Plain(), Recorder()
    watch = StateWatch([plain, recorder, Counter()])
    plain.seen = 1  # created by a hook: lost only by a resume inside an epoch
    recorder.losses.append(1.0)  # fitlib's own: not watched
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        watch.warn_changed()
    with pytest.warns(UserWarning, match=r"Plain changed its attributes \['seen'\]"):
        watch.warn_changed(inside_epoch=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        plain.seen = 2
        watch.warn_changed(inside_epoch=True)


def test_a_run_differs_in_a_schedule_of_any_hyper_or_attribute():
    from fitlib.callbacks import ParamScheduler, cosine, linear

    model = torch.nn.Sequential(torch.nn.Linear(2, 1), torch.nn.Dropout(0.1))
    opt = HPOptimizer(model.parameters(), torch.optim.Adam, lr=0.1)

    def signature(eps_end, p_end):
        sched = ParamScheduler(
            {"eps": cosine(1e-8, eps_end), "model.1.p": linear(0.1, p_end)}
        )
        return run_signature(opt, 3, None, range(8), [sched])

    saved, ours = signature(1e-6, 0.5), signature(1e-5, 0.2)
    lines = run_differences(saved, ours, opt, opt.state_dict()["opt"])
    assert len(lines) == 1 and lines[0].startswith("schedule of eps, model.1.p:")
    assert (
        run_differences(saved, signature(1e-6, 0.5), opt, opt.state_dict()["opt"]) == []
    )
