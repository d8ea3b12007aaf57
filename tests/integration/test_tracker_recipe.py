"""The tracker recipe of docs/how-to/log-to-any-tracker.md sends every value of
every record, and a mean loss every ``every_n_steps`` steps, to a run with
W&B's interface (a fake run here: the test needs no tracker installed)."""

import re
from pathlib import Path

import pytest
from helpers import make_data, make_model
from torch.nn import functional as F  # noqa: N812

from fitlib import Learner
from fitlib.metrics import accuracy

PAGE = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "log-to-any-tracker.md"


def tracker_recipe() -> str:
    """The page's block that defines ``TrackerLogger``."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    (block,) = [b for b in blocks if "class TrackerLogger(Callback)" in b]
    return block


class FakeRun:
    """What ``wandb.init()`` returns, as far as the recipe uses it."""

    def __init__(self):
        self.config, self.logged, self.exit_code = {}, [], None

    def log(self, values, step):
        self.logged.append((step, dict(values)))

    def finish(self, exit_code):
        self.exit_code = exit_code


def tracker_logger(**kwargs):
    namespace = {}
    exec(compile(tracker_recipe(), str(PAGE), "exec"), namespace)
    return namespace["TrackerLogger"](**kwargs)


def test_the_tracker_recipe_sends_every_record_and_step_point():
    run = FakeRun()
    tracker = tracker_logger(run=run, every_n_steps=3)
    learn = Learner(make_data(), make_model(), F.cross_entropy, metrics=[accuracy],
                    progress=False, callbacks=[tracker])  # fmt: skip
    history = learn.fit(2, lr=0.1)
    records = [(step, v) for step, v in run.logged if "train_loss" in v]
    assert [step for step, _ in records] == [7, 14]  # 7 steps an epoch
    assert [v for _, v in records] == history  # every value of each record
    points = [(step, v["step/loss"]) for step, v in run.logged if "step/loss" in v]
    assert [step for step, _ in points] == [3, 6, 9, 12]
    losses = learn.recorder.losses
    assert points[0][1] == pytest.approx(sum(losses[:3]) / 3, rel=1e-6)
    assert run.config == {"epochs": 2, "max_steps": None} and run.exit_code == 0


class BrokenLossError(Exception):
    """An error of the user's own: fitlib raises it as it is."""


def test_the_tracker_recipe_reports_a_failed_run():
    run = FakeRun()

    def broken_loss(out, y):
        raise BrokenLossError

    learn = Learner(make_data(), make_model(), broken_loss, progress=False,
                    callbacks=[tracker_logger(run=run)])  # fmt: skip
    with pytest.raises(BrokenLossError):
        learn.fit(1, lr=0.1)
    assert run.exit_code == 1
