"""``Checkpoint``: atomic saves of the whole training state, and exact resume.

A checkpoint holds the model, the optimizer (with its hyper-parameters), the
state of every callback of the fit (schedulers, Recorder history, early
stopping, loss scaler...), the RNG states (python, numpy, torch, CUDA, the
loader's generators) and the loop's position: epoch, batch within the epoch,
iteration and optimizer step. It also keeps the RNG states of the start of
the epoch, which decide the order of its batches. (``smooth_loss``, a display
value, restarts its average at a resume; the Recorder's smoothed history
continues exactly.)

Resuming (``resume=True``, the default) finds the newest checkpoint in
``dirpath`` when the fit begins. For a checkpoint taken inside an epoch it
sets the RNG states of that epoch's start, draws the batches again and skips
those already trained on (so shuffling, and augmentation in DataLoader
workers, replay exactly), then sets the RNG states of the moment before the
next batch was loaded. The run then ends with the same weights, bit for bit,
as a run that never stopped:

- covered: shuffled DataLoaders (with or without ``generator=``, with or
  without workers), augmentation and dropout drawing from the torch, numpy
  or python global generators, the optimizer's state, schedulers, mixed
  precision's loss scale, gradient accumulation (checkpoints fall between two
  steps), the Recorder's history, loggers' partial sums;
- not covered: random augmentation that runs in the main process
  (``num_workers=0``) *and* draws from its own generator object that fitlib
  does not know; nondeterministic GPU kernels (set
  ``torch.use_deterministic_algorithms(True)`` for bit-exact CUDA runs); a
  loader without a length (there, ``every_n_steps`` is refused: resume at
  epoch boundaries with ``every_n_epochs``); a different number of DataLoader
  workers than the run that saved; a different script (epochs, schedule).

A run that reaches its end (its epochs or ``max_steps``, or a callback's
``stop_training``) writes a final checkpoint marked finished; rerunning then
trains nothing. Its weights are those of the last step: ``EarlyStopping
(restore_best=True)`` restores the best ones after it (``monitor`` keeps
them in ``best.pth``). A ``fit_iter`` closed between two steps leaves a
checkpoint to resume from; an exception or Ctrl-C leaves the last regular
one (it may have cut a step in two). Only the first fit of a ``Checkpoint``
object resumes: a second fit in the same process starts anew.

Files are written atomically (temporary file, fsync, rename, fsync of the
directory): killing the process at any moment leaves the previous checkpoint
loadable. Files: ``checkpoint-<number>.pth``, numbered after the newest in
``dirpath`` whichever run wrote it (the newest ``keep_last`` are kept), and
``best.pth`` (with ``monitor``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from fitlib import distributed as fd
from fitlib.callback import Callback
from fitlib.callbacks.monitor import Monitor
from fitlib.callbacks.resume import (
    Position,
    Resumed,
    check_interval,
    check_writable,
    final_position,
    load_callbacks,
    remove_temporaries,
)
from fitlib.core import len_or_none
from fitlib.rng import get_rng_state, set_rng_state
from fitlib.serialization import atomic_save, host_copy, load_model_state, safe_load
from fitlib.sharding import load_optimizer_state, model_state, optimizer_state

_NAME = re.compile(r"checkpoint-(\d+)\.pth")
_DEFAULT = object()  # every_n_epochs left at its default


class Checkpoint(Callback):
    """Saves the training state regularly and resumes from the newest one.

    Args:
        dirpath: the directory of the checkpoints (created if missing).
        every_n_epochs: save after every n epochs (default 1, unless
            ``every_n_steps`` is given).
        every_n_steps: save after every n optimizer steps instead.
        keep_last: how many regular checkpoints to keep (>= 1), counting
            files that earlier runs left in ``dirpath``.
        monitor: also keep the best checkpoint by this quantity
            (``"valid_loss"``, a metric's name...) in ``best.pth``.
        mode: ``"min"``, ``"max"`` or ``"auto"`` for ``monitor``.
        save_best: write ``best.pth`` (with ``monitor``).
        resume: continue from the newest checkpoint in ``dirpath``; if it
            marks training as finished, say so and train nothing.

    Example:
        >>> ckpt = Checkpoint("runs/exp1", every_n_steps=500)
        >>> learn.fit_one_cycle(10, 1e-2, callbacks=[ckpt])  # rerun to resume
    """

    order = -100  # first: restores before others begin; saves before they act
    in_lr_find = False  # a sweep is not part of the run it records

    def __init__(
        self,
        dirpath: str | os.PathLike,
        every_n_epochs: Any = _DEFAULT,
        every_n_steps: int | None = None,
        keep_last: int = 3,
        monitor: str | None = None,
        mode: str = "auto",
        save_best: bool = True,
        resume: bool = True,
    ) -> None:
        if every_n_epochs is _DEFAULT:
            every_n_epochs = None if every_n_steps is not None else 1
        check_interval(every_n_epochs, every_n_steps)
        if (
            isinstance(keep_last, bool)
            or not isinstance(keep_last, int)
            or keep_last < 1
        ):
            raise ValueError(
                f"keep_last must be an int >= 1 (checkpoints kept); got "
                f"{keep_last!r}. Fix: e.g. keep_last=3."
            )
        self.dirpath = Path(dirpath)
        check_writable(self.dirpath)
        self.every_n_epochs, self.every_n_steps = every_n_epochs, every_n_steps
        self.keep_last, self.save_best, self.resume = keep_last, save_best, resume
        if monitor == "train_loss":
            raise ValueError(
                "Checkpoint keeps the best checkpoint by a validation value; "
                "monitor='train_loss' would judge by the training loss alone. "
                "Fix: monitor='valid_loss' or a metric's name."
            )
        owner = "Checkpoint"
        self.monitor = None if monitor is None else Monitor(monitor, mode, 0.0, owner)
        self._resume: dict | None = None  # a loaded checkpoint being resumed
        self._due = False
        self._fits = 0  # only the first fit of a process resumes

    # -- hooks -----------------------------------------------------------------
    def on_train_begin(
        self, model: Any, opt: Any, data: Any, metrics: Any, callbacks: list
    ) -> dict | None:
        """Runs first: checks the directory; resumes from the newest checkpoint."""
        if fd.is_main():
            check_writable(self.dirpath)
        if self.every_n_steps and len_or_none(data.train_dl) is None:
            raise ValueError(
                "Checkpoint(every_n_steps=...) needs a train_dl with a length, to "
                "resume inside an epoch. Fix: give the loader a __len__, or use "
                "every_n_epochs."
            )
        if self.monitor is not None:
            self.monitor.start(metrics, data)
        # The same objects all fit long: kept for the saves.
        self._model, self._opt, self._loader = model, opt, data.train_dl
        self._others = [cb for cb in callbacks if cb is not self]
        self._due, self._resume, self._epoch_rng = False, None, None
        self._rng_before_fetch: dict | None = None
        if fd.is_main():
            remove_temporaries(self.dirpath)
        fd.barrier()  # every rank sees the same files
        # A later fit of this object continues the process, not a crashed run.
        newest = self.checkpoints()[-1:] if self.resume and not self._fits else []
        self._fits += 1
        return self._load(newest[0]) if newest else None

    def on_epoch_begin(
        self, epoch: int, iteration: int, step: int, data: Any
    ) -> dict | None:
        """Runs first in each epoch: saves at an epoch boundary, or resumes."""
        if self._resume is not None:
            return self._resume_epoch(data)
        every = self.every_n_epochs
        if self._due or (every and epoch and epoch % every == 0):
            self._save(Position(epoch, 0, iteration, step))
        self._epoch_rng = get_rng_state(self._loader)  # decides this epoch's order
        return None

    def on_batch_begin(
        self, train: bool, epoch: int, num_batch: int, iteration: int, step: int
    ) -> None:
        """Runs first for each batch: saves when a checkpoint is due."""
        if train and self._due:  # after a step: no gradients half accumulated
            self._save(Position(epoch, num_batch, iteration, step))

    def on_batch_end(self, train: bool) -> None:
        """Runs first after each batch: notes the RNG before the next is loaded."""
        # A save at the next batch's start comes after that batch was fetched,
        # which may draw random numbers (augmentation): resume from before it.
        if train and self._due:
            self._rng_before_fetch = get_rng_state(self._loader)

    def on_step_end(self, skip_step: bool, step: int) -> None:
        """Runs after each step: a checkpoint falls due every n steps."""
        # The handler counts this step after the hooks: step + 1 steps are done.
        if (
            self.every_n_steps
            and not skip_step
            and (step + 1) % self.every_n_steps == 0
        ):
            self._due = True

    def on_epoch_end(
        self, epoch: int, iteration: int, step: int, last_metrics: Any, data: Any
    ) -> dict | None:
        """Runs after validation: keeps the best checkpoint; ends a resumed epoch."""
        if self.monitor is not None and self.save_best:
            value = self.monitor.read(last_metrics)
            if value is not None and self.monitor.update(value):
                where = Position(epoch + 1, 0, iteration, step)
                self._write(self.dirpath / "best.pth", where)
        original = getattr(data, "resumed_from", None)
        return {"data": original} if original is not None else None

    def on_train_end(self, **state: Any) -> None:
        """Runs at the end: a final checkpoint marks a run that reached its end;
        one stopped cleanly between batches (a closed ``fit_iter``) gets a
        checkpoint to resume from."""
        if getattr(self, "_model", None) is not None:
            where = final_position(state)
            if where is not None:
                self._rng_before_fetch = get_rng_state(self._loader)  # none fetched
                self._save(where)
        self._model = self._opt = None  # no references kept between fits

    # -- files -----------------------------------------------------------------
    def checkpoints(self) -> list[Path]:
        """The regular checkpoints in ``dirpath``, oldest first."""
        found = [(int(m[1]), p) for p in self.dirpath.glob("checkpoint-*.pth")
                 if (m := _NAME.fullmatch(p.name))]  # fmt: skip
        return [p for _, p in sorted(found)]

    def _save(self, where: Position) -> None:
        # Numbered after the newest file, whichever run wrote it: the newest
        # is always the highest number, and keep_last drops the lowest.
        newest = self.checkpoints()[-1:]
        number = int(_NAME.fullmatch(newest[0].name)[1]) + 1 if newest else 0
        path = self.dirpath / f"checkpoint-{number:06d}.pth"
        self._write(path, where)
        self._due = False
        if fd.is_main():
            for old in self.checkpoints()[: -self.keep_last]:
                old.unlink(missing_ok=True)
        fd.barrier()  # no rank runs ahead of a save

    def _write(self, path: Path, where: Position) -> None:
        # Every rank's RNG states (each draws its own dropout) and callback
        # states (each sums its own losses); rank 0 writes.
        rng = self._rng_before_fetch if where.num_batch else get_rng_state(self._loader)
        rngs, epoch_rngs = fd.gather_to_all(rng), fd.gather_to_all(self._epoch_rng)
        states = [[cb.name, cb.state_dict()] for cb in self._others]
        several = fd.world_size() > 1  # then host tensors only: they cross ranks
        states = fd.gather_to_all(host_copy(states) if several else states)
        # A sharded model's and optimizer's whole state, gathered from every rank.
        model, opt = model_state(self._model), optimizer_state(self._opt, self._model)
        if not fd.is_main():
            return
        atomic_save(
            {
                "fitlib_checkpoint": 1,
                "model": model,
                "opt": opt,
                "callbacks": states[0],
                "rank_callbacks": states if len(states) > 1 else None,
                "monitor": self.monitor.state_dict() if self.monitor else None,
                "position": where._asdict(),
                # Inside an epoch: the RNG before its next batch was loaded.
                "rng": rngs,
                "opt_class": type(getattr(self._opt, "opt", self._opt)).__name__,
                # Inside an epoch: what decided its order, to draw it again.
                "epoch_rng": epoch_rngs if where.num_batch else None,
            },
            path,
        )

    # -- resuming --------------------------------------------------------------
    def _load(self, path: Path) -> dict:
        saved = safe_load(path, map_location="cpu")
        if not isinstance(saved, dict) or saved.get("fitlib_checkpoint") != 1:
            raise ValueError(
                f"{str(path)!r} is not a fitlib Checkpoint file. Fix: move it out "
                "of the checkpoint directory, or use another dirpath."
            )
        load_model_state(self._model, saved["model"], repr(str(path)))
        _own_states(saved, path)
        opt_class = type(getattr(self._opt, "opt", self._opt)).__name__
        if saved["opt_class"] != opt_class:
            raise ValueError(
                f"{str(path)!r} was saved with optimizer {saved['opt_class']}, "
                f"this fit uses {opt_class}: its state cannot continue. Fix: use "
                f"{saved['opt_class']}, or Checkpoint(resume=False)."
            )
        load_optimizer_state(self._opt, self._model, saved["opt"])
        load_callbacks(self._others, saved["callbacks"], path)
        if self.monitor is not None and saved["monitor"] is not None:
            self.monitor.load_state_dict(saved["monitor"])
        pos = saved["position"]
        if pos["finished"]:
            _say(
                f"fitlib: Checkpoint: training in {str(self.dirpath)!r} already "
                f"finished (epoch {pos['epoch']}, step {pos['step']}); nothing to "
                "do. Fix: Checkpoint(resume=False), or another dirpath, to train "
                "anew."
            )
            self._model = None  # nothing trained: no final checkpoint either
            # The finished run's position: callbacks see a resumed fit and
            # keep their restored state (logs are not started anew).
            done = {k: pos[k] for k in ("epoch", "iteration", "step")}
            return {**done, "stop_training": True}
        _say(
            f"fitlib: Checkpoint: resuming from {path.name} (epoch {pos['epoch']}, "
            f"batch {pos['num_batch']}, step {pos['step']})."
        )
        self._resume = saved
        return {k: pos[k] for k in ("epoch", "iteration", "step")}

    def _resume_epoch(self, data: Any) -> dict | None:
        """The first epoch of a resumed fit: its order, then skip what was done."""
        saved, done = self._resume, self._resume["position"]["num_batch"]
        if not done:  # an epoch boundary: its order is drawn from here
            set_rng_state(saved["rng"], self._loader)
            self._resume = None
            self._epoch_rng = get_rng_state(self._loader)
            return None
        set_rng_state(saved["epoch_rng"], self._loader)
        self._epoch_rng = saved["epoch_rng"]
        left = len(data.train_dl) - done
        # The epoch's order, drawn again (unless its training was all done).
        batches = iter(data.train_dl) if left else iter(())
        for _ in range(done if left else 0):
            next(batches)
        set_rng_state(saved["rng"], self._loader)  # as before the next fetch
        self._resume = None
        return {"data": Resumed(data, batches, left), "num_batch": done}

    def __repr__(self) -> str:
        return f"{self.name}({str(self.dirpath)!r})"


def _own_states(saved: dict, path: Path) -> None:
    """Keeps this rank's RNG and callback states of a checkpoint (one per rank
    that saved)."""
    world = fd.world_size()
    if len(saved["rng"]) != world:
        raise ValueError(
            f"{str(path)!r} was saved by {len(saved['rng'])} process(es); this "
            f"run has {world}. Fix: launch as many (torchrun --nproc_per_node), "
            "or Checkpoint(resume=False)."
        )
    saved["rng"] = saved["rng"][fd.rank()]
    if saved.get("rank_callbacks"):
        saved["callbacks"] = saved["rank_callbacks"][fd.rank()]
    if saved["epoch_rng"] is not None:
        saved["epoch_rng"] = saved["epoch_rng"][fd.rank()]


def _say(message: str) -> None:
    if fd.is_main():  # one line, not one per process
        print(message)
