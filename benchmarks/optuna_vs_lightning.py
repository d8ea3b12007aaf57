"""The same Optuna search pruned by fitlib's ``OptunaPruning`` and by
optuna-integration's ``PyTorchLightningPruningCallback``: which trials each
prunes, and why they differ (results: benchmarks/results/optuna-pruning.md).

The search: an MLP on scikit-learn's digits (1440 training images, 357 for
validation, batches of 60: 24 steps an epoch), SGD with momentum 0.9 for 6
epochs, lr and weight decay sampled by a TPE sampler of a fixed seed,
``MedianPruner(n_startup_trials=3)``, 16 trials, the validation loss
monitored. Both trainers start each trial from the same weights and see
the same batches in the same order, and both average the validation loss
over samples, so the values they report agree to float rounding (the
script prints the largest difference). Two settings:

- ``epoch``: one validation per epoch (both libraries' default);
- ``twice``: two validations per epoch, after its 12th and 24th step
  (fitlib ``ValidationSchedule(every_n_steps=12)``, Lightning
  ``val_check_interval=0.5``).

Lightning and optuna-integration are not fitlib dependencies. Run it in a
throwaway virtual environment that sees fitlib's::

    python -m venv /tmp/lt && /tmp/lt/bin/pip install lightning optuna-integration
    echo "$PWD/.venv/lib/python3.11/site-packages" > \\
        /tmp/lt/lib/python3.11/site-packages/fitlib-venv.pth
    /tmp/lt/bin/python benchmarks/optuna_vs_lightning.py

Without Lightning installed it runs fitlib's half alone.
"""

from __future__ import annotations

import io
import sys
import tempfile
import warnings
from contextlib import redirect_stderr
from functools import partial
from pathlib import Path
from typing import Any

import optuna
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fitlib import Callback, DataBunch, Learner
from fitlib.callbacks import OptunaPruning, ValidationSchedule

N_TRIALS, EPOCHS, BS, SEED = 16, 6, 60, 0
EVERY = 12  # the "twice" setting: a validation every 12 steps (24 an epoch)


def datasets() -> tuple[TensorDataset, TensorDataset]:
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    return TensorDataset(x[:1440], y[:1440]), TensorDataset(x[1440:], y[1440:])


def loaders() -> tuple[DataLoader, DataLoader]:
    """The batches in one fixed order: with ``shuffle=True`` and a seeded
    generator, fitlib draws the shuffles a plain loop draws and Lightning
    others from the second epoch on (measured: the first epoch's validation
    loss agrees, the second's differs by 4%), which would hide the
    callbacks' differences behind the trainers'."""
    train, valid = datasets()
    return DataLoader(train, BS), DataLoader(valid, 256)


def model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def hypers(trial: optuna.Trial) -> dict:
    return {
        "lr": trial.suggest_float("lr", 1e-3, 1.0, log=True),
        "wd": trial.suggest_float("wd", 1e-6, 1e-1, log=True),
    }


# -- fitlib ----------------------------------------------------------------------------
class Steps(Callback):
    """Notes the optimizer steps a fit trained."""

    def on_train_end(self, step: int) -> None:
        self.step = step


def fitlib_objective(setting: str, extra: tuple = ()):
    def objective(trial: optuna.Trial) -> float:
        h = hypers(trial)
        train, valid = loaders()
        opt = partial(torch.optim.SGD, momentum=0.9)
        learn = Learner(DataBunch(train, valid), model(), F.cross_entropy,
                        opt_func=opt, metrics=[], progress=False,
                        true_wd=False, wd=h["wd"])  # fmt: skip
        steps = Steps()
        callbacks = [OptunaPruning(trial), steps, *extra]
        if setting == "twice":
            callbacks.append(ValidationSchedule(every_n_steps=EVERY))
        try:
            learn.fit(EPOCHS, lr=h["lr"], callbacks=callbacks)
        finally:
            trial.set_user_attr("steps", steps.step)
        return learn.recorder.valid_losses[-1]

    return objective


# -- Lightning -------------------------------------------------------------------------
def lightning_objective(setting: str, extra: tuple = (), logger: Any = False):
    import lightning.pytorch as pl
    from optuna_integration import PyTorchLightningPruningCallback

    class Module(pl.LightningModule):
        def __init__(self, lr: float, wd: float) -> None:
            super().__init__()
            self.net, self.lr, self.wd = model(), lr, wd

        def training_step(self, batch, _):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def validation_step(self, batch, _):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("valid_loss", loss, batch_size=len(x))  # sample-weighted

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), self.lr, momentum=0.9,
                                   weight_decay=self.wd)  # fmt: skip

    def objective(trial: optuna.Trial) -> float:
        h = hypers(trial)
        train, valid = loaders()
        prune = PyTorchLightningPruningCallback(trial, monitor="valid_loss")
        interval = 0.5 if setting == "twice" else 1.0
        trainer = pl.Trainer(max_epochs=EPOCHS, callbacks=[prune, *extra],
                             logger=logger, enable_progress_bar=False,
                             enable_checkpointing=bool(extra),
                             enable_model_summary=False, num_sanity_val_steps=0,
                             accelerator="cpu", val_check_interval=interval,
                             deterministic=True)  # fmt: skip
        try:
            trainer.fit(Module(h["lr"], h["wd"]), train, valid)
        finally:
            trial.set_user_attr("steps", trainer.global_step)
            trial.set_user_attr("status", trainer.state.status.value)
        return trainer.callback_metrics["valid_loss"].item()

    return objective


# -- the search ------------------------------------------------------------------------
def search(objective) -> tuple[optuna.Study, int]:
    sampler = optuna.samplers.TPESampler(seed=SEED)
    pruner = optuna.pruners.MedianPruner(n_startup_trials=3)
    study = optuna.create_study(sampler=sampler, pruner=pruner)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with redirect_stderr(io.StringIO()):  # Lightning's notices
            study.optimize(objective, n_trials=N_TRIALS)
    dropped = sum("already reported" in str(w.message) for w in caught)
    return study, dropped


def describe(study: optuna.Study) -> list[str]:
    """A line per trial: its state, how many values it reported, the
    optimizer steps it trained."""
    rows = []
    for t in study.trials:
        n, trained = len(t.intermediate_values), t.user_attrs["steps"]
        rows.append(f"{t.number:>2} {t.state.name:<8} {n:>2} values {trained:>3} steps")
    return rows


def pruned_steps(study: optuna.Study) -> int:
    """The optimizer steps the pruned trials trained, in all."""
    return sum(t.user_attrs["steps"] for t in study.trials if t.state.name == "PRUNED")


def how_a_pruned_trial_ends(side: str, folder: Path) -> str:
    """One trial pruned at its first validation (``ThresholdPruner(upper=0)``
    prunes any loss), with a checkpoint and a CSV log: what is left."""
    study = optuna.create_study(pruner=optuna.pruners.ThresholdPruner(upper=0.0))
    if side == "fitlib":
        from fitlib.callbacks import Checkpoint, CSVLogger
        from fitlib.serialization import safe_load

        extra = (Checkpoint(folder / "ckpt"), CSVLogger(folder / "log.csv"))
        study.optimize(fitlib_objective("epoch", extra), n_trials=1)
        files = sorted((folder / "ckpt").glob("checkpoint-*.pth"))
        finished = files and safe_load(files[-1])["position"]["finished"]
        rows = len((folder / "log.csv").read_text().splitlines()) - 1
        state = study.trials[0].state.name
        return (f"{state}; checkpoints: {len(files)} (the last marked "
                f"finished: {bool(finished)}); CSV rows: {rows}")  # fmt: skip
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger as LightningCSV

    ckpt = ModelCheckpoint(folder / "ckpt", save_last=True)
    logger = LightningCSV(folder, name="log")
    with redirect_stderr(io.StringIO()):
        study.optimize(lightning_objective("epoch", (ckpt,), logger), n_trials=1)
    files = sorted(p.name for p in (folder / "ckpt").glob("*.ckpt"))
    logs = sorted(folder.glob("log/*/metrics.csv"))
    rows = len(logs[0].read_text().splitlines()) - 1 if logs else 0
    status = study.trials[0].user_attrs["status"]
    return (f"{study.trials[0].state.name}; trainer status: {status}; "
            f"checkpoints: {files}; CSV rows: {rows}")  # fmt: skip


def gap(a: list, b: list) -> float:
    """The largest relative difference between the two sides' first reported
    values (the same validation in both), over the trials of the same
    parameters."""
    firsts = [(x.intermediate_values, y.intermediate_values)
              for x, y in zip(a, b) if x.params == y.params]  # fmt: skip
    pairs = [(x[min(x)], y[min(y)]) for x, y in firsts if x and y]
    return max(abs(u - v) / abs(v) for u, v in pairs)


def main() -> None:
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        import lightning  # noqa: F401
        import optuna_integration  # noqa: F401

        sides = {"fitlib": fitlib_objective, "lightning": lightning_objective}
    except ImportError:
        print("lightning or optuna-integration missing: fitlib's half only")
        sides = {"fitlib": fitlib_objective}
    for setting in ("epoch", "twice"):
        print(f"## setting: {setting}")
        studies = {}
        for side, make in sides.items():
            study, dropped = search(make(setting))
            studies[side] = study
            pruned = [t.number for t in study.trials if t.state.name == "PRUNED"]
            print(f"{side}: pruned {pruned}, {pruned_steps(study)} steps "
                  f"trained by pruned trials; reports Optuna ignored: "
                  f"{dropped}")  # fmt: skip
        if len(studies) == 2:
            a, b = studies["fitlib"].trials, studies["lightning"].trials
            rows = zip(describe(studies["fitlib"]), describe(studies["lightning"]), a)
            print(f"{'':>2} {'fitlib':<31} {'lightning':<28} parameters")
            for x, y, p in rows:
                print(f"{x:<34} {y[3:]:<28} lr={p.params['lr']:.3g} "
                      f"wd={p.params['wd']:.2g}")  # fmt: skip
            same = [x.params == y.params for x, y in zip(a, b, strict=True)]
            print(f"same parameters in every trial: {all(same)}")
            print(f"largest relative difference of the first values: {gap(a, b):.2g}")
    print("## how a pruned trial ends (a checkpoint and a CSV log)")
    with tempfile.TemporaryDirectory() as tmp:
        for side in sides:
            print(f"{side}: {how_a_pruned_trial_ends(side, Path(tmp) / side)}")


if __name__ == "__main__":
    main()
