"""benchmarks/gpu.py, the GPU check's benchmark, runs on the CPU with --dry-run.

CI has no GPU, so this proves the script itself still runs against the current
API (every configuration and every part), and that its sync counter sorts
syncs into those inside a training step and those outside.
"""

import subprocess
import sys
import warnings
from pathlib import Path

import torch
from helpers import make_data, make_model
from torch.nn import functional as F  # noqa: N812

from fitlib import Callback, Learner

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu  # noqa: E402


def test_the_dry_run_writes_every_part(tmp_path):
    out = tmp_path / "gpu.md"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--dry-run"]
    cmd += ["--steps", "4", "--rounds", "1", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    text = out.read_text()
    for name in gpu.sync_configs():
        row = next(line for line in text.splitlines() if line.startswith(f"| {name} |"))
        assert row.endswith("ok |") or "skipped 1 step" in row, row
    for part in ("## 1. Host syncs", "## 2. µs per training step",
                 "## 3. Host time against GPU time"):  # fmt: skip
        assert part in text
    tables = [line for line in text.splitlines() if line.startswith("### ")]
    assert [t.split(",")[0] for t in tables] == [
        "### launch-bound MLP 32-64-10",
        "### a tiny convnet (ResNet-18's stand-in) at 4x4",
        "### a tiny convnet (ResNet-18's stand-in) at 16x16",
    ]
    for row in ("hand-written eager", "fitlib eager (Learner.fit, no bar)",
                "fitlib eager, CPU data, side-stream copies",
                "fitlib eager, CPU data, prefetch=False"):  # fmt: skip
        assert text.count(f"| {row} | ") == 3, row
    assert "| fitlib CudaGraph(warmup=3) | needs CUDA |" in text
    assert "**Goal, fitlib's fastest mode at least 2x" in text
    assert "| launch-bound MLP 32-64-10, batch 64, fp32, AdamW | fitlib |" in text
    assert "failed" not in text


class FakeSync(Callback):
    """Warns as PyTorch's sync debug mode does: once in each training step's
    backward, and once at each epoch's end."""

    def on_backward_end(self):
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)

    def on_epoch_end(self):
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)


def test_syncs_are_counted_inside_and_outside_the_steps(monkeypatch):
    monkeypatch.setattr(gpu, "DEV", "cpu")
    callbacks = [gpu._StepBegins(), gpu._StepEnds(), FakeSync()]
    learn = Learner(
        make_data(64, 32),
        make_model(),
        F.cross_entropy,
        progress=False,
        callbacks=callbacks,
    )
    found, _ = gpu.count_syncs(lambda: learn.fit(2, lr=0.1))
    steps = 2 * len(learn.data.train_dl)
    counts = {phase: sum(c.values()) for phase, c in found.items()}
    assert counts == {"first": 1, "step": steps - 1, "outside": 2}
    (where,) = found["step"]
    assert "on_backward_end" in where or "fitlib/callback.py" in where
    assert gpu._phase[0] == "outside"
    assert torch.is_grad_enabled()


def test_the_step_clock_times_from_step_skip_to_the_last(monkeypatch):
    reads = iter(range(100))
    monkeypatch.setattr(gpu.time, "perf_counter", lambda: float(next(reads)))
    monkeypatch.setattr(gpu, "DEV", "cpu")
    clock = gpu.StepClock(last=gpu.SKIP + 2)
    for _ in range(gpu.SKIP + 3):
        clock.begin()
        clock.end()
    assert clock.seconds == 1.0  # one read at step SKIP, one after the last
    clock.reset()
    assert clock.seconds is None and clock.i == 0


def test_the_goal_row_names_fitlibs_fastest_mode_and_whether_it_reaches_2x():
    lines = []
    speeds = {"hand-written eager": 1.0, "fitlib eager (Learner.fit, no bar)": 0.98,
              "fitlib CudaGraph(warmup=3)": 2.4, "Lightning (2.6)": 5.0}  # fmt: skip
    gpu.goal_row(speeds, lines.append)
    assert lines[0].endswith("met** (fitlib CudaGraph(warmup=3): 2.40x).\n")
    assert "NOT met" not in lines[0]
    gpu.goal_row({"fitlib compile(step=True)": 1.5}, lines.append)
    assert "NOT met** (fitlib compile(step=True): 1.50x)" in lines[1]
