"""The README's quick start runs as written: documentation that cannot rot."""

import re
from pathlib import Path

import matplotlib
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def quick_start_code() -> str:
    section = README.read_text().split("## Quick start", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_quick_start_runs_and_learns(tmp_path, monkeypatch):
    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)  # learn.save writes under ./models
    namespace = {}
    exec(compile(quick_start_code(), "README.md", "exec"), namespace)
    learn = namespace["learn"]
    assert learn.validate()["accuracy"] > 0.85
    assert (tmp_path / "models" / "stage1.pth").is_file()
    assert len(learn.recorder.train_losses) == 3


def test_every_fitlib_name_the_readme_imports_or_mentions_exists():
    import importlib

    text = README.read_text()
    imports = re.findall(r"^from (fitlib[\w.]*) import ([\w, ]+)$", text, re.M)
    assert imports, "the README shows no imports"
    for module, names in imports:
        for name in names.split(","):
            assert hasattr(importlib.import_module(module), name.strip()), (
                f"README: from {module} import {name.strip()}"
            )


def tracker_recipe() -> str:
    section = README.read_text().split("**Any other tracker**", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    return "\n".join(line.removeprefix("  ") for line in block.splitlines())


def test_the_tracker_recipe_sends_every_record_and_step_point():
    from helpers import make_data, make_model
    from torch.nn import functional as F  # noqa: N812

    from fitlib import Learner
    from fitlib.metrics import accuracy

    namespace = {}
    exec(compile(tracker_recipe(), "README.md", "exec"), namespace)

    class FakeRun:  # what wandb.init() returns, as far as the recipe uses it
        def __init__(self):
            self.config, self.logged, self.exit_code = {}, [], None

        def log(self, values, step):
            self.logged.append((step, dict(values)))

        def finish(self, exit_code):
            self.exit_code = exit_code

    run = FakeRun()
    tracker = namespace["TrackerLogger"](run, every_n_steps=3)
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
