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


def step_recipes() -> dict:
    """The README's recipes for steps the loop cannot express, executed."""
    section = README.read_text().split("**Steps the loop cannot express.**", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section.split("\n### ", 1)[0], re.S)
    namespace = {}
    for block in blocks:
        code = "\n".join(line.removeprefix("  ") for line in block.splitlines())
        exec(compile("import torch\nfrom fitlib import Callback\n" + code,
                     "README.md", "exec"), namespace)  # fmt: skip
    return namespace


def test_the_wgan_gp_recipe_equals_a_hand_written_wgan_gp_loop():
    import torch
    from test_gan import gan, hand_written, loader, optimizers

    from fitlib import DataBunch, GANLoss, fit
    from fitlib.callbacks import GANTrainer

    penalty = step_recipes()["GradientPenalty"](weight=10.0)
    model = gan()
    torch.manual_seed(1)
    fit(2, model, GANLoss("wgan"), optimizers(model), DataBunch(loader()),
        callbacks=[GANTrainer(n_critic=2), penalty])  # fmt: skip

    def gradient_penalty(c, real, fake):
        eps = torch.rand(len(real), 1)
        x_hat = (eps * real + (1 - eps) * fake).requires_grad_(True)
        (grad,) = torch.autograd.grad(c(x_hat).sum(), x_hat, create_graph=True)
        return 10.0 * ((grad.norm(dim=1) - 1) ** 2).mean()

    ref = hand_written("wgan", n_critic=2, penalty=gradient_penalty)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_the_sam_recipe_equals_a_hand_written_sam_loop():
    import torch
    from helpers import make_dataset
    from torch import nn
    from torch.nn import functional as F  # noqa: N812
    from torch.utils.data import DataLoader

    from fitlib import DataBunch, fit

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    dl = DataLoader(make_dataset(64), 16)
    sam = step_recipes()["SAM"](rho=0.05)
    m = model()
    fit(2, m, F.cross_entropy, torch.optim.SGD(m.parameters(), lr=0.1),
        DataBunch(dl), callbacks=[sam])  # fmt: skip

    ref = model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        for x, y in dl:
            F.cross_entropy(ref(x), y).backward()
            params = list(ref.parameters())
            with torch.no_grad():
                norm = torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(p.grad) for p in params])
                )
                climbs = [p.grad * (0.05 / (norm + 1e-12)) for p in params]
                for p, e in zip(params, climbs):
                    p.add_(e)
                    p.grad = None
            F.cross_entropy(ref(x), y).backward()
            with torch.no_grad():
                for p, e in zip(params, climbs):
                    p.sub_(e)
            opt.step()
            opt.zero_grad()
    plain = model()
    fit(2, plain, F.cross_entropy, torch.optim.SGD(plain.parameters(), lr=0.1),
        DataBunch(dl))  # fmt: skip
    for p, q, r in zip(m.parameters(), ref.parameters(), plain.parameters()):
        assert torch.equal(p, q)
        assert not torch.equal(p, r)  # SAM's step is not the plain one


def test_the_hand_driven_loop_runs_as_written_and_trains():
    section = README.read_text().split("Your own loop can drive callbacks too", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    handler = namespace["handler"]
    assert [r["epoch"] for r in handler.history] == [0, 1, 2]
    assert handler.state["step"] == 3 * 3  # 6 batches an epoch, in pairs
    losses = [r["valid_loss"] for r in handler.history]
    assert losses[-1] < losses[0]
