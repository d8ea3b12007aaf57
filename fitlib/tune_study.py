"""What ``fitlib.tune.search`` sets up before its first trial: its arguments
checked (``Options``), the study opened in its storage (the journal file by
default), the default sampler and pruner, and the refusal of a search
launched by ``torchrun``."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import fitlib.ranks as ranks
from fitlib.callbacks.checkpoint import Checkpoint
from fitlib.checks import check_flag, check_int, check_number, check_path
from fitlib.errors import did_you_mean
from fitlib.monitor import direction as monitor_direction

JOURNAL = "study.log"
OWNER = "fitlib.tune.search"


def open_study(optuna: Any, opts: Options) -> Any:
    storage = opts.storage
    if storage is None:
        backend = optuna.storages.journal.JournalFileBackend(
            str(opts.directory / JOURNAL)
        )
        storage = optuna.storages.JournalStorage(backend)
    return optuna.create_study(
        storage=storage,
        study_name=opts.study_name,
        direction=opts.direction,
        sampler=opts.sampler,
        pruner=opts.pruner or default_pruner(optuna),
        load_if_exists=True,
    )


def default_sampler(optuna: Any, seed: int, number: int) -> Any:
    """TPE for trial ``number``, seeded from (seed, number): not seed + number,
    which would give seed 1's trials the values of seed 0's next ones."""
    drawn = int(np.random.SeedSequence([seed, number]).generate_state(1)[0])
    return optuna.samplers.TPESampler(seed=drawn, n_startup_trials=5)


def default_pruner(optuna: Any) -> Any:
    return optuna.pruners.MedianPruner(n_startup_trials=5, n_min_trials=3)


@dataclass
class Options:
    make_learner: Callable
    fit: Callable
    n_trials: int
    monitor: str
    direction: str | None
    directory: Path
    storage: Any
    study_name: str
    sampler: Any
    pruner: Any
    seed: int
    timeout: float | None
    mlflow: str | None
    progress: bool | None
    checkpoint: dict
    retry: bool
    max_retries: int
    own_sampler: bool = False

    @classmethod
    def checked(cls, args: dict) -> Options:
        for name in ("make_learner", "fit"):
            if not callable(args[name]):
                raise TypeError(
                    f"{OWNER}: {name} must be a function; got {args[name]!r}. "
                    "Fix: e.g. search(make_learner, lambda learn, trial: "
                    "learn.fit(3, lr=trial.suggest_float('lr', 1e-4, 1e-1, "
                    "log=True)))."
                )
        kept = {k: args[k] for k in cls.__dataclass_fields__ if k in args}
        check_int(args["n_trials"], "n_trials", minimum=1, owner=OWNER, example=20)
        check_int(args["seed"], "seed", owner=OWNER, example=0)
        check_int(args["max_retries"], "max_retries", owner=OWNER, example=3)
        check_number(args["timeout"], "timeout", minimum=0, owner=OWNER,
                     example=600, allow_none=True)  # fmt: skip
        check_flag(args["retry"], "retry", OWNER, "search(..., retry=False)")
        if args["progress"] is not None:
            check_flag(
                args["progress"], "progress", OWNER, "search(..., progress=False)"
            )
        kept["directory"] = check_path(
            args["directory"], "directory", owner=OWNER, what="a directory path",
            example="'runs'",
        )  # fmt: skip
        if not isinstance(args["checkpoint"], (dict, type(None))):
            raise TypeError(
                f"{OWNER}: checkpoint must be a dict of Checkpoint's arguments "
                f"or None; got {args['checkpoint']!r}. Fix: e.g. "
                "search(..., checkpoint={'every_n_steps': 50})."
            )
        kept["checkpoint"] = dict(args["checkpoint"] or {})
        kept["direction"] = checked_direction(
            args["direction"], args["monitor"], args["study"]
        )
        # Its arguments checked now, last: a Checkpoint makes its directory.
        Checkpoint(kept["directory"], **kept["checkpoint"])
        return cls(**kept)


def checked_direction(direction: Any, monitor: Any, study: Any) -> str | None:
    if not isinstance(monitor, str):
        raise TypeError(
            f"{OWNER}: monitor must be a record value's name; got {monitor!r}. "
            "Fix: e.g. monitor='valid_loss'."
        )
    if study is not None:
        return None
    if direction is None:
        way = monitor_direction(monitor)
        if way is None:
            usual = did_you_mean(monitor, ("valid_loss", "train_loss", "accuracy"))
            raise ValueError(
                f"{OWNER}: cannot tell whether monitor={monitor!r}{usual} should "
                "go down or up. Fix: pass direction='minimize' or "
                "direction='maximize' (or a record value's name)."
            )
        return {"min": "minimize", "max": "maximize"}[way]
    if direction not in ("minimize", "maximize"):
        raise ValueError(
            f"{OWNER}: direction must be 'minimize', 'maximize' or None; got "
            f"{direction!r}. Fix: e.g. direction='maximize' for an accuracy."
        )
    return direction


def refuse_distributed() -> None:
    """Refuses a search launched by ``torchrun`` (several ranks): each rank
    would be a worker of its own, and two trials would train in one process
    group."""
    launched = int(os.environ.get("WORLD_SIZE", 1)) if ranks.launched() else 1
    size = max(ranks.world_size(), launched)
    if size > 1:
        raise ValueError(
            f"{OWNER}: launched on {size} ranks (torchrun): each rank would run "
            "trials of its own, and two trials would train together in one "
            "process group. Fix: run search in one process per worker; to train "
            "each trial on several GPUs, write the objective as the OptunaPruning "
            "reference page's torchrun script does (rank 0 runs the study, the "
            "other ranks pass trial=None)."
        )


def optuna_module() -> Any:
    try:
        import optuna
    except ImportError as e:
        raise ImportError(
            "fitlib.tune needs optuna, an optional extra. Fix: pip install "
            "'fitlib[optuna]' (or pip install optuna)."
        ) from e
    return optuna
