"""The GPU check: host syncs per step, and speed against hand-written loops.

Three parts, each written to the results file as soon as it is done:

1. **Host syncs.** Each configuration (the default ``Learner`` with metrics
   and the progress bar, bfloat16, float16 with the fused AdamW ``to_fp16()``
   makes, 1cycle, clipping, accumulation, TerminateOnNaN, TrainStats, all of
   them together, and float16 with a forced overflow) trains 200 steps on
   batches held on the GPU, with validation after each epoch, under
   ``torch.cuda.set_sync_debug_mode("warn")``. Every sync PyTorch reports is
   counted where it happened: in the first training step (from the first
   ``on_batch_begin`` to the last ``on_batch_end``), in a later one, or
   outside them (validation, epoch ends), with the Python line that made it.
2. **ResNet-18** on CIFAR-sized synthetic data held on the GPU: ``Learner.fit``
   against a hand-written loop (same AdamW, same data, both fp32), and
   bfloat16 + channels_last (+ ``torch.compile`` with ``--compile``) against
   fp32 eager, in images per second.
3. **A launch-bound MLP** (batch 64): ``Learner.fit`` against the
   hand-written loop and against Lightning, when installed, in one run.

Runs are interleaved, in a new random order each round, and each ratio is the
median of the per-round ratios; a second hand-written run is the control.

Run: ``make gpu-check`` (the CUDA tests, then this), or
``python3 benchmarks/gpu.py --out benchmarks/results/gpu.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import platform
import random
import re
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

import fitlib
from fitlib import Callback, DataBunch, Learner
from fitlib.callbacks import (
    GradientAccumulation,
    GradientClipping,
    TerminateOnNaN,
    TrainStats,
)
from fitlib.metrics import F1Score, accuracy

ROOT = Path(__file__).resolve().parents[1]
# --dry-run (tests/integration/test_gpu_check.py) runs every part on the CPU, tiny: it
# proves the script runs, not what it measures.
DEV, SIZE = "cuda", 1.0


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def sized(n: int, least: int) -> int:
    return max(least, int(n * SIZE))


class Batches:
    """Slices of tensors already on the device, reshuffled each epoch."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, bs: int, shuffle: bool):
        self.x, self.y, self.bs, self.shuffle = x, y, bs, shuffle

    def __len__(self) -> int:
        return (len(self.x) + self.bs - 1) // self.bs

    def __iter__(self):
        x, y = self.x, self.y
        if self.shuffle:
            idx = torch.randperm(len(x), device=x.device)
            x, y = x[idx], y[idx]
        for i in range(0, len(x), self.bs):
            yield x[i : i + self.bs], y[i : i + self.bs]


def classification(n: int, n_in: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_in, 10, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, n_in, generator=g)
    return x, (x @ w + 0.5 * torch.randn(n, 10, generator=g)).argmax(1)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def mlp_data(device: str, n_train: int, n_valid: int, bs: int = 64):
    x, y = classification(n_train + n_valid, 32, seed=1)
    x, y = x.to(device), y.to(device)
    train = Batches(x[:n_train], y[:n_train], bs, shuffle=True)
    return train, Batches(x[n_train:], y[n_train:], bs, shuffle=False)


# -- 1. host syncs -------------------------------------------------------------
# Where the fit is: "first" (the first training batch: the loss's input checks
# read the targets once), "step" (any later training batch), "outside" (the
# rest: validation, epoch ends).
_phase = ["outside"]
_seen = [0]


class _StepBegins(Callback):
    order = -(10**6)

    def on_batch_begin(self, train: bool) -> None:
        if train:
            _phase[0] = "step" if _seen[0] else "first"
            _seen[0] += 1


class _StepEnds(Callback):
    order = 10**6

    def on_batch_end(self) -> None:
        _phase[0] = "outside"


def _where() -> str:
    """The innermost lines outside this file and the warnings machinery."""
    frames = [
        f
        for f in traceback.extract_stack()[:-2]
        if "warnings" not in f.filename and not f.filename.endswith("gpu.py")
    ]
    keep = []
    for f in reversed(frames):
        name = f.filename.split("site-packages/")[-1].replace(str(ROOT) + "/", "")
        keep.append(f"{name}:{f.lineno} {f.name}")
        if "fitlib/" in name or len(keep) == 3:
            break
    return " <- ".join(keep)


def count_syncs(run) -> tuple[dict[str, Counter], object]:
    """Runs ``run()`` in sync debug mode "warn": the syncs at the first
    training step, at the later ones and outside them, each counted by where
    it happened."""
    found = {"first": Counter(), "step": Counter(), "outside": Counter()}

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            found[_phase[0]][_where()] += 1

    _phase[0], _seen[0] = "outside", 0
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        sync()
        if DEV == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                result = run()
        finally:
            if DEV == "cuda":
                torch.cuda.set_sync_debug_mode("default")
            _phase[0] = "outside"
    return found, result


def _overflow_loss():
    calls = [0]

    def loss_func(out, y):
        loss = F.cross_entropy(out, y)
        if torch.is_grad_enabled():
            calls[0] += 1
            if calls[0] == 3:
                return loss * math.inf
        return loss

    return loss_func


def sync_configs():
    """name -> (callbacks, precision, how to fit, loss_func)."""
    ce = F.cross_entropy
    return {
        "default (accuracy, F1Score, progress bar)": ([], None, "fit", ce),
        "bfloat16 (to_bf16)": ([], "bf16", "fit", ce),
        "float16 (to_fp16, fused AdamW)": ([], "fp16", "fit", ce),
        "1cycle (fit_one_cycle)": ([], None, "one_cycle", ce),
        "GradientClipping(1.0)": ([GradientClipping(1.0)], None, "fit", ce),
        "GradientAccumulation(2)": ([GradientAccumulation(2)], None, "fit", ce),
        "TerminateOnNaN()": ([TerminateOnNaN()], None, "fit", ce),
        "TrainStats()": ([TrainStats()], None, "fit", ce),
        "all of them, float16": (
            [
                GradientClipping(1.0),
                GradientAccumulation(2),
                TerminateOnNaN(),
                TrainStats(),
            ],
            "fp16",
            "one_cycle",
            ce,
        ),
        "float16, inf loss at step 3": ([], "fp16", "fit", _overflow_loss()),
    }


def sync_check(steps: int, out) -> bool:
    epochs = 2
    n_train = steps // epochs * 64
    out(
        f"## 1. Host syncs: {steps} training steps ({epochs} epochs of "
        f"{steps // epochs} batches of 64, validation after each)\n\n"
        'Counted in sync debug mode "warn". *Later steps* must have none but '
        "TrainStats' reports (one read per report, every `every_n_steps`, by "
        "design); *first step*: the loss's input checks read the targets once "
        "per fit; *outside*: validation and epoch ends.\n"
    )
    out("| configuration | first step | later steps | outside | where | check |")
    out("|---|---|---|---|---|---|")
    ok = True
    for name, (cbs, precision, how, loss_func) in sync_configs().items():
        train, valid = mlp_data(DEV, n_train, sized(1024, 128))
        learn = Learner(
            DataBunch(train, valid, device=DEV),
            mlp(),
            loss_func,
            metrics=[accuracy, F1Score()],
            callbacks=[_StepBegins(), _StepEnds(), *cbs],
        )
        if precision == "bf16":
            learn.to_bf16()
        elif precision == "fp16":
            learn.to_fp16()

        def run(learn=learn, how=how):
            if how == "one_cycle":
                return learn.fit_one_cycle(epochs, 1e-2)
            return learn.fit(epochs, lr=1e-2)

        try:
            found, _ = count_syncs(run)
        except Exception as e:  # reported; the next one runs
            out(f"| {name} | failed: `{type(e).__name__}: {e}` | | | | FAIL |")
            ok = False
            continue
        reports = sum(len(cb.history) for cb in cbs if isinstance(cb, TrainStats))
        later = sum(found["step"].values())
        check = "ok" if later == reports else "FAIL"
        if reports:
            check += f" ({reports} TrainStats reports)"
        mp = [cb for cb in learn.callbacks if type(cb).__name__ == "MixedPrecision"]
        if "inf loss" in name:
            scale = mp[0].scaler.get_scale()
            fine = mp[0].skipped_steps == 1 and scale < 2.0**16
            check += f"; skipped {mp[0].skipped_steps} step, scale {scale:g}"
            check = check if fine else check + " FAIL"
        ok &= "FAIL" not in check
        where = "<br>".join(
            f"{phase}: {n}x `{w}`"
            for phase, c in found.items()
            for w, n in c.most_common(8)
        )
        counts = " | ".join(str(sum(c.values())) for c in found.values())
        out(f"| {name} | {counts} | {where} | {check} |")
    out("")
    return ok


# -- 2./3. throughput ----------------------------------------------------------
def timed(fn) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def hand_written(model, train, valid, epochs, lr, autocast=None) -> None:
    """What a careful person writes: AdamW, the epoch's train loss kept on the
    device, validation loss and accuracy read once per epoch."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    ctx = autocast or contextlib.nullcontext()
    for _ in range(epochs):
        model.train()
        total, n = torch.zeros((), device=DEV), 0
        for x, y in train:
            with ctx:
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            total, n = total + loss.detach() * len(y), n + len(y)
        if valid is None:
            _ = float(total / n)
            continue
        model.eval()
        vloss, correct, m = 0.0, 0, 0
        with torch.no_grad(), ctx:
            for x, y in valid:
                out = model(x)
                vloss = vloss + F.cross_entropy(out, y) * len(y)
                correct, m = correct + (out.argmax(1) == y).sum(), m + len(y)
        _ = [float(total / n), float(vloss / m), float(correct / m)]


def fitlib_fit(model, train, valid, epochs, lr, bf16=False, progress=False, fast=None):
    """``fast``: None, or {"compile": bool}: the Learner's own one-call
    channels_last (and compile, with ``dynamic=False`` as the hand-written
    variant) on a plain model."""
    learn = Learner(
        DataBunch(train, valid, device=DEV),
        model,
        F.cross_entropy,
        metrics=[accuracy] if valid is not None else [],
        progress=progress,
    )
    if bf16:
        learn.to_bf16()
    if fast is not None:
        learn.to_channels_last()
        if fast["compile"]:
            learn.compile(dynamic=False)
    with contextlib.redirect_stdout(io.StringIO()):
        learn.fit(epochs, lr=lr, wd=0.01)


def interleave(variants: dict, rounds: int) -> dict[str, list[float]]:
    times = {k: [] for k in variants}
    for _ in range(rounds):
        order = list(variants)
        random.shuffle(order)
        for k in order:
            times[k].append(timed(variants[k]))
    return times


def ratio_rows(times, base, work: float, unit: str, out) -> None:
    out(f"| variant | median seconds | {unit} | speed vs `{base}` |")
    out("|---|---|---|---|")
    for k, ts in times.items():
        r = statistics.median(b / t for b, t in zip(times[base], ts))
        med = statistics.median(ts)
        out(f"| {k} | {med:.3f} | {work / med:,.0f} | {r:.3f}x |")
    out("")


def resnet_check(rounds: int, compile_: bool, out) -> None:
    import torchvision

    torch.backends.cudnn.benchmark = True
    n, epochs = sized(12_800, 32), 2
    g = torch.Generator().manual_seed(0)
    side = 32 if SIZE else 16
    x = torch.randn(n, 3, side, side, generator=g).to(DEV)
    y = torch.randint(0, 10, (n,), generator=g).to(DEV)
    x_cl = x.contiguous(memory_format=torch.channels_last)

    def net(channels_last=False, compiled=False):
        torch.manual_seed(0)
        m = torchvision.models.resnet18(num_classes=10).to(DEV)
        if channels_last:
            m = m.to(memory_format=torch.channels_last)
        if compiled:
            m.compile(dynamic=False)
        return m

    bf16 = torch.autocast(DEV, dtype=torch.bfloat16)
    fast = dict(channels_last=True, compiled=compile_)
    name = "bf16 + channels_last" + (" + compile" if compile_ else "")
    out(
        f"## 2. ResNet-18, {n} synthetic 3x{side}x{side} images held on the GPU, "
        f"{epochs} epochs, AdamW (foreach), no validation; {rounds} interleaved "
        "rounds after one warm-up round\n\nThe small batch shows the loop's "
        "overhead (kernels are short); the large one what mixed precision, "
        "channels_last and compilation give when the GPU is busy.\n"
    )

    def measure(bs: int) -> None:
        train = Batches(x, y, bs, shuffle=True)
        train_cl = Batches(x_cl, y, bs, shuffle=True)
        variants = {
            "hand-written fp32": lambda: hand_written(net(), train, None, epochs, 1e-3),
            "hand-written fp32 (control)": lambda: hand_written(
                net(), train, None, epochs, 1e-3
            ),
            "fitlib Learner.fit fp32": lambda: fitlib_fit(
                net(), train, None, epochs, 1e-3
            ),
            f"hand-written {name}": lambda: hand_written(
                net(**fast), train_cl, None, epochs, 1e-3, autocast=bf16
            ),
            f"fitlib {name} (to_bf16, to_channels_last, compile)": lambda: fitlib_fit(
                net(),
                train_cl,
                None,
                epochs,
                1e-3,
                bf16=True,
                fast={"compile": compile_},
            ),
        }
        start = time.perf_counter()
        for fn in variants.values():  # warm-up: cuDNN's autotuning, compilation
            fn()
        warm = time.perf_counter() - start
        out(f"### batch {bs} (warm-up round: {warm:.0f} s)\n")
        times = interleave(variants, rounds)
        ratio_rows(times, "hand-written fp32", n * epochs, "images/s", out)

    for bs in sorted({sized(256, 16), sized(1024, 16)}):
        measure(bs)


def lightning_variant(train, valid, epochs, lr):
    try:
        import lightning.pytorch as pl
    except ImportError:
        try:
            import pytorch_lightning as pl
        except ImportError:
            return None, "not installed"

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, _):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.log("train_loss", loss, on_step=False, on_epoch=True)
            return loss

        def validation_step(self, batch, _):
            x, y = batch
            out = self(x)
            self.log("valid_loss", F.cross_entropy(out, y))
            self.log("accuracy", (out.argmax(1) == y).float().mean())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=0.01)

    def run():
        trainer = pl.Trainer(
            accelerator="gpu" if DEV == "cuda" else "cpu",
            devices=1,
            max_epochs=epochs,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.fit(Module(), train, valid)

    return run, f"{pl.__name__} {pl.__version__}"


def mlp_check(rounds: int, out) -> None:
    n_train, epochs = sized(16_384, 256), 3
    train, valid = mlp_data(DEV, n_train, sized(4096, 128))
    variants = {
        "hand-written": lambda: hand_written(mlp().to(DEV), train, valid, epochs, 1e-3),
        "hand-written (control)": lambda: hand_written(
            mlp().to(DEV), train, valid, epochs, 1e-3
        ),
        "fitlib Learner.fit (no bar)": lambda: fitlib_fit(
            mlp(), train, valid, epochs, 1e-3
        ),
        "fitlib Learner.fit (progress bar)": lambda: fitlib_fit(
            mlp(), train, valid, epochs, 1e-3, progress=True
        ),
    }
    lightning, version = lightning_variant(train, valid, epochs, 1e-3)
    if lightning is not None:
        logging_off()
        variants[f"Lightning ({version})"] = lightning
    for fn in variants.values():
        fn()
    out(
        f"## 3. Launch-bound MLP 32-64-10, batch 64, {n_train} samples held on "
        f"the GPU, {epochs} epochs with validation (loss, accuracy); Lightning: "
        f"{version}; {rounds} interleaved rounds\n"
    )
    ratio_rows(
        interleave(variants, rounds),
        "hand-written",
        n_train * epochs / 64,
        "steps/s",
        out,
    )


def logging_off() -> None:
    import logging

    for name in ("lightning", "lightning.pytorch", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", module="pytorch_lightning")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results file; on a GPU, by default benchmarks/results/gpu-<device>.md",
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also torch.compile the fast ResNet-18 variant",
    )
    parser.add_argument("--only", choices=["syncs", "resnet", "mlp"], action="append")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="every part on the CPU, tiny (checks the script)",
    )
    args = parser.parse_args()
    if args.dry_run:
        global DEV, SIZE
        DEV, SIZE = "cpu", 0.0
    elif not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA GPU; none is available here.")
        return 2
    lines: list[str] = []

    def out(line: str) -> None:
        print(line, flush=True)
        lines.append(line)
        if args.out is not None:
            args.out.write_text("\n".join(lines) + "\n")

    if DEV == "cuda":
        p = torch.cuda.get_device_properties(0)
        name = torch.cuda.get_device_name(0)
        slug = "-".join(re.findall(r"[a-z0-9]+", name.lower()))
        args.out = args.out or ROOT / "benchmarks" / "results" / f"gpu-{slug}.md"
        memory = f"{p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs"
    else:
        name, memory = "the CPU (--dry-run: checks the script, measures nothing)", ""
    out(f"# GPU check on {name}\n")
    out(
        f"{memory}; torch "
        f"{torch.__version__}, CUDA {torch.version.cuda}, Python "
        f"{platform.python_version()}, fitlib {fitlib.__version__}; "
        f"{time.strftime('%Y-%m-%d')}. Command: `python3 benchmarks/gpu.py "
        f"{' '.join(sys.argv[1:])}`\n"
    )
    only = set(args.only or ["syncs", "resnet", "mlp"])
    ok = True
    for part, fn in (
        ("syncs", lambda: sync_check(args.steps, out)),
        ("resnet", lambda: resnet_check(args.rounds, args.compile, out)),
        ("mlp", lambda: mlp_check(args.rounds, out)),
    ):
        if part in only:
            try:
                ok &= fn() is not False
            except Exception:  # reported; the next part runs
                out(f"{part} failed:\n```\n{traceback.format_exc()}```\n")
                ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
