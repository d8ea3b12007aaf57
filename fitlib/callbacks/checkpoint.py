"""``Checkpoint``: atomic saves of the whole training state, and exact resume.

A checkpoint holds the model, the optimizer (with its hyper-parameters), the
state of every callback of the fit (schedulers, Recorder history, early
stopping, loss scaler...), the RNG states (python, numpy, torch, CUDA, the
loader's generators) and the loop's position: epoch, batch within the epoch,
iteration and optimizer step. It also keeps the RNG states of the start of
the epoch, which decide the order of its batches. (``smooth_loss``, a display
value, restarts its average at a resume; the Recorder's smoothed history
continues exactly.)

Resuming (``resume=True``, the default) finds the newest intact checkpoint
in ``dirpath`` when the fit begins (``resume_from`` names another). For a
checkpoint taken inside an epoch it sets the RNG states of that epoch's
start, draws the batches again and skips those already trained on (so
shuffling, and augmentation in DataLoader workers, replay exactly), then
sets the RNG states of the moment before the next batch was loaded. The
run then ends with the same weights, bit for bit, as a run that never
stopped:

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
  workers than the run that saved; a different script that the run check
  below cannot see (another schedule's shape, another data set of the same
  length).

A run that reaches its end (its epochs or ``max_steps``, or a callback's
``stop_training``) writes a final checkpoint marked finished; rerunning then
trains nothing. Its weights are those of the last step: ``EarlyStopping
(restore_best=True)`` restores the best ones after it (``monitor`` keeps
them in ``best.pth``). A ``fit_snapshots`` closed between two steps leaves a
checkpoint to resume from; an exception or Ctrl-C leaves the last regular
one (it may have cut a step in two). Only the first fit of a ``Checkpoint``
object resumes: a second fit in the same process starts anew.

A checkpoint also records what identifies its run: the optimizer (class,
parameter groups), its hyper-parameters as the fit began (``lr``, ``wd``,
``mom``, ``beta`` per group) except those a schedule of the fit sets (for
them, the schedule's settings, e.g. ``OneCycleScheduler(max_lr=0.01, ...)``:
an interrupted fit in the same process leaves them mid-schedule) and the
planned length (epochs, ``max_steps``, batches per epoch). A fit resumes only a
checkpoint of the same run (and of the same model); otherwise it raises a
ValueError that lists every difference, before anything is loaded. To start
afresh: ``Checkpoint(dirpath, resume=False)`` (its checkpoints are numbered
after those in ``dirpath``, whose oldest go as it saves, past ``keep_last``),
or another ``dirpath``. Checkpoints of fitlib's previous format (1) carry no
run to compare; they resume with a note saying so.

One run at a time per directory: a fit takes an exclusive lock on
``dirpath/.fitlib.lock`` (``fcntl.flock``) before it touches any file, and
keeps it until it ends (also by an error). The holder writes its pid, host,
start time and command line into that file; a second fit on the directory
while that run lives raises a ValueError naming it. The operating system
releases the lock of a process that dies (even by SIGKILL), so the next run
takes over a dead run's directory. Two ``Checkpoint`` objects of one process
conflict too. Under torch.distributed rank 0 holds the lock for every rank.
Where ``fcntl`` does not exist (Windows) nothing is locked, with a warning;
on some network file systems (NFS without lock support, some FUSE mounts) a
lock does not stop a run on another machine.

With ``monitor``, a run that starts afresh next to a ``best.pth`` of the same
monitor and mode starts from its best value (the value inside a whole one,
else the record's): ``best.pth`` is replaced only by a better one (a line
says so). A ``best.pth`` of another monitor is replaced
by this run's best, and so is a damaged one (with a warning: its value is
lost, so this run starts the best over). A directory named ``best.pth`` is
refused before training.

Damaged files and odd entries: a checkpoint that cannot be resumed from (any
ValueError of ``safe_load``: truncated, flipped bits, not a torch file; a
file lacking an entry a checkpoint holds; a directory or a dangling link
under a checkpoint's name) is skipped with a warning naming it and why, and
the run resumes from the newest intact one. It stays for you to look at;
new checkpoints are numbered after it, and ``keep_last`` removes it as they
come (never a directory). When no entry is intact, a ValueError names each.
``resume_from`` picks the checkpoint to start from, as Lightning's
``ckpt_path``: a file name in ``dirpath``, ``"best"`` (``best.pth``),
``"last"`` (the default: the newest intact) or a path with a directory. It
is checked when the ``Checkpoint`` is made (a missing one lists the files
there); a damaged one is an error, not skipped. Every run of a script that
passes it starts from it, so ``keep_last`` never deletes the file it names
(it does not count among the ``keep_last``); checkpoints newer than it (of
the run being restarted) are named in a warning, and go as this run saves.
Once resumed, leave it out to resume from the newest. When no checkpoint is
intact, the error's fix offers ``resume_from='best'`` if ``best.pth`` is.

Files are written atomically (temporary file, fsync, rename, fsync of the
directory): killing the process at any moment leaves the previous checkpoint
loadable. They get the mode a plain ``open()`` would give them under the
user's umask (an existing file's mode is kept), and hold the plain model's
keys whatever wraps it (DDP, ``torch.compile``): whole ones load into a
plain process with ``Learner.load``; weights-only ones (``save_weights_only``)
with ``model.load_state_dict(torch.load(path, weights_only=True))``. Files:
``checkpoint-<number>.pth``, numbered after the newest in ``dirpath``
whichever run wrote it (the newest ``keep_last`` are kept), and ``best.pth``
(with ``monitor``), the top-k files (with ``save_top_k``) and
``.fitlib-best.json``, the record of what those are worth.

Files kept for their value: ``best.pth`` (the single best) and, with
``save_top_k=k``, the k best by ``monitor``, named by ``filename`` (a
template of the record's values and the counters ``epoch``, ``step``,
``iteration``; default ``"epoch={epoch}-step={step}"``; checked before
training: a name the record will not have, or a format spec that does not
fit, is refused). The template names only these files: the regular
checkpoints keep ``checkpoint-<number>.pth`` whatever it is, so a resume
finds the newest intact one by its number, and ``keep_last`` never counts
or removes a top-k file. A value enters the k best when it beats the worst
kept (a tie keeps the earlier file; NaN never enters) and, with
``initial_value_threshold``, that threshold: until then there is no best
file at all. A template whose text could give a regular checkpoint's name
(it begins with ``checkpoint``) is refused. The ranking (names and values)
is in every checkpoint: a resumed run continues it (replaying what followed
its checkpoint under the same names). A fresh run reads
``.fitlib-best.json`` (``checkpoint_ranking.BestFiles``), rewritten
atomically right after each file kept for its value changes, so it is never
older than those files (the newest checkpoint may be): with the same
monitor and mode it competes with the earlier run's files still there, so,
as with ``best.pth``, a kept file is replaced only by a better one (a
smaller ``save_top_k`` deletes those it cuts). Every other file already in
``dirpath`` is taken: never overwritten nor deleted (a name of this run
that clashes gets ``-v1``, ``-v2``), and files ranked by another monitor
are left alone, with one warning. A damaged record is warned about and the
ranking starts over. A file both best and among the k best is written once
(a hard link, or a copy). A top-k file is a whole checkpoint
(``resume_from`` may name it) unless
``save_weights_only``: then ``best.pth`` and the top-k files hold the plain
model's ``state_dict()`` alone, for export (``model.load_state_dict(
torch.load(path, weights_only=True))``), and the regular checkpoints stay
whole, so resuming is unchanged (``resume_from='best'`` is refused with it,
when the object is made; the value of a weights-only ``best.pth`` of an
earlier run is read from ``.fitlib-best.json``). A threshold or
``save_weights_only`` with neither ``best.pth`` nor top-k files to apply
to is refused.

``every_n_seconds`` saves a regular checkpoint once that many seconds of
wall clock (``time.monotonic()`` on the host, no device sync) have passed
since the fit began or the last save, at the next batch's start as the
other saves, so it resumes exactly as they do. Under torch.distributed
rank 0's clock decides for every rank, at checks paced to about ten per
interval (``checkpoint_clock.SaveClock``), never a collective per step.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import fitlib.ranks as ranks
from fitlib.callback import Callback
from fitlib.checkpoint_clock import SaveClock
from fitlib.checkpoint_files import (
    CHECKPOINT_NAME,
    CheckpointFileError,
    check_writable,
    checkpoint_files,
    link_or_copy,
    listing,
    not_a_file,
    numbered,
    read_checkpoint,
    remove_temporaries,
    resume_path,
)
from fitlib.checkpoint_names import DEFAULT_TEMPLATE, FileTemplate
from fitlib.checkpoint_ranking import BestFiles, check_best_options, watched
from fitlib.checks import check_flag, check_int, check_path, len_or_none
from fitlib.dir_lock import DirLock
from fitlib.metrics.functions import load_class_dims, saved_class_dims
from fitlib.monitor import Monitor
from fitlib.resume import (
    Position,
    Resumed,
    StateWatch,
    check_callbacks,
    check_interval,
    final_position,
    give_states,
    run_differences,
    run_signature,
)
from fitlib.rng import get_rng_state, set_rng_state
from fitlib.serialization import (
    atomic_save,
    check_model_state,
    host_copy,
    optimizer_differences,
)
from fitlib.sharding import (
    load_model,
    load_optimizer_state,
    model_state,
    optimizer_state,
    unwrap,
)

_DEFAULT = object()  # every_n_epochs left at its default
FORMAT = 2  # 2: checkpoints hold their run's signature ("run")


class Checkpoint(Callback):
    """Saves the training state regularly and resumes from the newest one.

    Args:
        dirpath: the directory of the checkpoints (created if missing); one
            run at a time uses it (see the module's notes on the lock).
        every_n_epochs: save after every n epochs (default 1, unless
            ``every_n_steps`` is given).
        every_n_steps: save after every n optimizer steps instead.
        keep_last: how many regular checkpoints to keep (>= 1), counting
            files that earlier runs left in ``dirpath``.
        monitor: also keep the best checkpoint by this quantity
            (``"valid_loss"``, a metric's name...) in ``best.pth``.
        mode: ``"min"``, ``"max"`` or ``"auto"`` for ``monitor``.
        save_best: write ``best.pth`` (with ``monitor``).
        resume: continue from the newest intact checkpoint in ``dirpath``
            (it must be of the same run; newer ones that are damaged are
            skipped with a warning); if it marks training as finished, say so
            and train nothing. False starts afresh.
        save_top_k: also keep the k best checkpoints by ``monitor`` (Lightning's
            ``save_top_k``, Ignite's ``n_saved``), named by ``filename``;
            ``-1`` keeps every one judged. The ranking is in the checkpoints'
            state: a resume keeps it, and a fresh run in ``dirpath`` that
            watches the same monitor competes with the files it lists.
        filename: the top-k files' name template (default
            ``"epoch={epoch}-step={step}"``), with the record's values and
            the counters ``epoch``, ``step``, ``iteration``:
            ``"{epoch:02d}-{valid_loss:.3f}"``. Checked before training.
        initial_value_threshold: no best (no ``best.pth``, no top-k file)
            until ``monitor`` beats this value (Keras).
        every_n_seconds: also save when this many seconds (wall clock) have
            passed since the last save (Lightning's ``train_time_interval``);
            alone, it replaces the default of every epoch.
        save_weights_only: ``best.pth`` and the top-k files hold the plain
            model's ``state_dict()`` only, for export (``torch.load(path,
            weights_only=True)``); the regular checkpoints stay whole, to
            resume from.
        resume_from: resume from this checkpoint instead of the newest (as
            Lightning's ``ckpt_path``): a file name in ``dirpath``
            (``"checkpoint-000040.pth"``), ``"best"`` (``best.pth``),
            ``"last"`` (the newest, the default) or a path with a directory.
            Checked as the object is made; used by every run of the script
            (leave it out once resumed, to resume later from the newest), so
            ``keep_last`` never deletes that file; newer checkpoints there
            are named in a warning.

    Examples:
        >>> import os
        >>> ckpt = Checkpoint("runs/exp1", every_n_steps=8)
        >>> learn.fit_one_cycle(4, 1e-2, callbacks=[ckpt])  # rerun to resume
        History(4 epochs: train_loss ... -> ..., valid_loss ... -> ...,
                accuracy ... -> ...)
        >>> sorted(os.listdir("runs/exp1"))
        ['.fitlib.lock', 'checkpoint-000000.pth', 'checkpoint-000001.pth']

        The same script run again resumes from the newest checkpoint; this
        run had finished, so there is nothing left to train:

        >>> learn.fit_one_cycle(4, 1e-2, callbacks=[Checkpoint("runs/exp1",
        ...                                                    every_n_steps=8)])
        fitlib: Checkpoint: training in 'runs/exp1' already finished (epoch 4,
        step 16); nothing to do. Fix: Checkpoint(resume=False), or another
        dirpath, to train anew.
        History(0 epochs)
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
        resume_from: str | os.PathLike | None = None,
        save_top_k: int | None = None,
        filename: str | None = None,
        initial_value_threshold: float | None = None,
        every_n_seconds: float | None = None,
        save_weights_only: bool = False,
    ) -> None:
        if every_n_epochs is _DEFAULT:
            others = (every_n_steps, every_n_seconds)
            every_n_epochs = 1 if others == (None, None) else None
        check_interval(every_n_epochs, every_n_steps, every_n_seconds)
        check_int(keep_last, "keep_last", minimum=1, owner=self.name, example=3)
        self.dirpath = check_path(
            dirpath,
            "dirpath",
            owner=self.name,
            what="a directory path",
            example="'runs/exp1'",
        )
        check_writable(self.dirpath)
        save_best = check_flag(
            save_best, "save_best", self.name, "Checkpoint(dir, save_best=False)"
        )
        resume = check_flag(
            resume, "resume", self.name, "Checkpoint(dir, resume=False)"
        )
        self.resume_from = resume_path(resume_from, self.dirpath, resume)
        self._options(monitor, save_top_k, filename, initial_value_threshold,
                      save_weights_only, every_n_seconds, save_best)  # fmt: skip
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
        self.best = None  # the files kept for their value (best.pth, top-k)
        if self.monitor is not None:
            self.best = BestFiles(self.dirpath, self.monitor, save_best, save_top_k,
                                  self.filename, initial_value_threshold)  # fmt: skip
        self._resume: dict | None = None  # a loaded checkpoint being resumed
        self._due = False
        self._fits = 0  # only the first fit of a process resumes
        self._lock = DirLock(self.dirpath)  # held by rank 0 during a fit
        self._tally: Any = None  # the loop's EpochTally, during a fit
        self._judge: tuple | None = None  # (record, position) to judge best on

    # -- hooks -----------------------------------------------------------------
    def on_train_begin(
        self,
        model: Any,
        opt: Any,
        data: Any,
        metrics: Any,
        train_metrics: Any,
        callbacks: list,
        n_epochs: int | None,
        max_steps: int | None,
        tally: Any,
        loss_func: Any,
    ) -> dict | None:
        """Runs first: locks the directory; resumes from the newest checkpoint."""
        self._lock_directory()
        inside = "every_n_steps" if self.every_n_steps else None
        inside = "every_n_seconds" if self.every_n_seconds else inside
        if inside and len_or_none(data.train_dl) is None:
            raise ValueError(
                f"Checkpoint({inside}=...) needs a train_dl with a length, to "
                "resume inside an epoch. Fix: give the loader a __len__, or use "
                "every_n_epochs."
            )
        if self.monitor is not None:
            self.monitor.start(metrics, data, train_metrics, callbacks, loss_func)
            if self.filename is not None:
                self.filename.check(metrics, data, train_metrics, callbacks, loss_func)
            self._check_best_entry()
        if self._clock is not None:
            self._clock.reset()
        # The same objects all fit long: kept for the saves.
        self._model, self._opt, self._loader = model, opt, data.train_dl
        self._tally, self._judge = tally, None
        self._noted = -1  # the iteration after which the RNG was last noted
        self._others = [cb for cb in callbacks if cb is not self]
        self._watch = StateWatch(self._others)  # warned at the first save
        self._due, self._resume, self._epoch_rng = False, None, None
        self._rng_before_fetch: dict | None = None
        # As the fit begins, before schedulers set their first values.
        self._run = run_signature(opt, n_epochs, max_steps, data.train_dl, callbacks)
        if ranks.is_main():
            remove_temporaries(self.dirpath)  # the lock says no run writes them
        ranks.barrier()  # every rank sees the same files
        # A later fit of this object continues the process, not a crashed run.
        found = self._to_resume() if self.resume and not self._fits else None
        self._fits += 1
        if found is not None:
            return self._load(*found)
        if self.best is not None:
            self.best.start(None)
        return None

    def on_epoch_begin(
        self, epoch: int, iteration: int, step: int, data: Any, model: Any, opt: Any
    ) -> dict | None:
        """Runs first in each epoch: saves at an epoch boundary, or resumes."""
        self._model, self._opt = model, opt  # (a callback may have swapped them)
        self._keep_best()
        if self._resume is not None:
            return self._resume_epoch(data)
        every = self.every_n_epochs
        if self._due or (every and epoch and epoch % every == 0):
            self._save(Position(epoch, 0, iteration, step))
        self._epoch_rng = get_rng_state(self._loader)  # decides this epoch's order
        return None

    def on_batch_begin(
        self,
        train: bool,
        epoch: int,
        num_batch: int,
        iteration: int,
        step: int,
        model: Any,
        opt: Any,
    ) -> None:
        """Runs first for each batch: judges a validation inside the epoch;
        saves when a checkpoint is due."""
        if not train:
            return
        self._model, self._opt = model, opt  # (a callback may have swapped them)
        if self._judge is not None:  # the record of a validation just before
            self._keep_best()
        if self._due:  # after a step: no gradients half accumulated
            self._save(Position(epoch, num_batch, iteration, step))

    def on_batch_end(self, train: bool, validate_now: bool, iteration: int) -> None:
        """Runs first after each batch: notes the RNG before the next is loaded."""
        # A save at the next batch's start comes after that batch was fetched,
        # which may draw random numbers (augmentation): resume from before it.
        # So does a best.pth judged there, after a validation inside the epoch.
        judges = validate_now and self._judging()
        if train and (self._due or judges):
            self._rng_before_fetch = get_rng_state(self._loader)
            self._noted = iteration

    def on_step_end(self, skip_step: bool, step: int) -> None:
        """Runs after each step: a checkpoint falls due every n steps."""
        # The handler counts this step after the hooks: step + 1 steps are done.
        if skip_step:
            return
        if self.every_n_steps and (step + 1) % self.every_n_steps == 0:
            self._due = True
        if self._clock is not None and self._clock.tick():
            self._due = True

    def on_epoch_end(
        self,
        epoch: int,
        iteration: int,
        step: int,
        record: dict,
        data: Any,
        mid_epoch: bool,
        num_batch: int,
    ) -> dict | None:
        """Runs after validation: notes the record to judge; ends a resumed epoch.

        The best checkpoint is judged once every callback's ``on_epoch_end``
        ran (at the next epoch's start, or the next batch's after a
        validation inside the epoch, or the end of training): the record is
        then complete (later callbacks may add values to it) and every
        callback's state is that of the record's end, as in a checkpoint
        saved there.
        """
        if self._judging():
            where = (epoch, num_batch) if mid_epoch else (epoch + 1, 0)
            self._judge = (record, Position(*where, iteration, step))
            if mid_epoch and self._noted != iteration - 1:
                # Asked for after this callback's on_batch_end (by a later
                # callback): the RNG as it is now, after the next batch's fetch.
                self._rng_before_fetch = get_rng_state(self._loader)
        if mid_epoch:
            return None  # the epoch goes on (a resumed one, in its batches)
        original = getattr(data, "resumed_from", None)
        return {"data": original} if original is not None else None

    def on_train_end(self, **state: Any) -> None:
        """Runs at the end: a final checkpoint marks a run that reached its end;
        one stopped cleanly between batches (a closed ``fit_snapshots``) gets a
        checkpoint to resume from. Then the directory is unlocked."""
        try:
            if state["exception"] is None or self._ended(state["epoch"]):
                self._keep_best()
            if getattr(self, "_model", None) is not None:
                self._model, self._opt = state["model"], state["opt"]
                where = final_position(state)
                if where is not None:
                    self._rng_before_fetch = get_rng_state(self._loader)
                    self._save(where)
        finally:
            self._model = self._opt = None  # no references kept between fits
            self._lock.release()

    def _ended(self, epoch: int) -> bool:
        """Whether the epoch to judge ran all its ``on_epoch_end`` hooks (the
        handler counts the epoch after them); a validation inside an epoch is
        judged only at the next batch, or at a clean end."""
        judge = self._judge
        return judge is not None and judge[1].num_batch == 0 and judge[1].epoch == epoch

    def _keep_best(self) -> None:
        """Writes ``best.pth`` if the epoch noted in ``on_epoch_end`` improved."""
        judge, self._judge = self._judge, None
        if judge is None or getattr(self, "_model", None) is None:
            return
        record, where = judge
        names = self.best.judge(record, where.step, where.iteration)
        if names:
            self._keep([self.dirpath / name for name in names], where)
        self.best.settle(bool(names))

    def _keep(self, paths: list[Path], where: Position) -> None:
        """Writes a file kept for its value (whole, or the weights alone)
        once, under each of its names."""
        if not self.save_weights_only:
            self._write(paths[0], where)
        else:
            weights = model_state(self._model)  # (every rank: a sharded one gathers)
            if ranks.is_main():
                atomic_save(host_copy(weights), paths[0])
        for path in paths[1:] if ranks.is_main() else ():
            link_or_copy(paths[0], path)

    def _judging(self) -> bool:
        """Whether records are judged: for best.pth, or for the top-k files."""
        return self.best is not None and self.best.judging

    @property
    def top_k(self) -> Any:
        """The ranking of the top-k files (``save_top_k``), or None."""
        return self.best.top_k if self.best is not None else None

    @property
    def best_files(self) -> list[tuple[Path, float]]:
        """The top-k files (``save_top_k``) and their values, best first."""
        entries = self.top_k.entries if self.top_k is not None else []
        return [(self.dirpath / name, value) for value, name in entries]

    def _options(
        self,
        monitor: Any,
        save_top_k: Any,
        filename: Any,
        threshold: Any,
        weights_only: Any,
        seconds: Any,
        save_best: bool,
    ) -> None:
        """Checks and keeps the options of the best files and of the clock."""
        fix = "Checkpoint(dir, save_weights_only=True)"
        weights_only = check_flag(weights_only, "save_weights_only", self.name, fix)
        check_best_options(monitor, save_top_k, filename, threshold, weights_only,
                           save_best)  # fmt: skip
        if weights_only and self.resume_from == self.dirpath / "best.pth":
            raise ValueError(
                "Checkpoint: resume_from='best' with save_weights_only=True: "
                "best.pth holds the weights alone, with nothing to resume the "
                "run from. Fix: resume from the newest checkpoint (leave "
                "resume_from out) or one of the checkpoint-<n>.pth files, or "
                "save_weights_only=False."
            )
        self.save_weights_only, self.threshold = weights_only, threshold
        if save_top_k is not None:
            template = DEFAULT_TEMPLATE if filename is None else filename
            self.filename = FileTemplate(template, self.name)
        else:
            self.filename = None
        self.every_n_seconds = None if seconds is None else float(seconds)
        self._clock = None if seconds is None else SaveClock(float(seconds))

    # -- the lock --------------------------------------------------------------
    def _lock_directory(self) -> None:
        """Rank 0 checks and locks the directory; every rank raises if it failed."""
        self._lock.release()  # hooks driven by hand, without on_train_end
        problem = None
        if ranks.is_main():
            try:
                check_writable(self.dirpath)
                self._lock.acquire()
            except Exception as e:  # raised below, once every rank knows
                problem = e
        if ranks.broadcast_int(problem is not None):  # no rank waits on a failed one
            raise problem or ValueError(
                f"Checkpoint: rank 0 could not use {str(self.dirpath)!r}; its "
                "error says why."
            )

    # -- files -----------------------------------------------------------------
    def checkpoints(self) -> list[Path]:
        """The regular checkpoint files in ``dirpath``, oldest first (not a
        directory or dangling link bearing such a name)."""
        return checkpoint_files(self.dirpath)

    def _save(self, where: Position) -> None:
        # Numbered after the newest entry, whichever run wrote it (and after
        # an odd entry of that name): the newest is always the highest
        # number, and keep_last drops the lowest files.
        entries = numbered(self.dirpath)
        number = entries[-1][0] + 1 if entries else 0
        path = self.dirpath / f"checkpoint-{number:06d}.pth"
        if ranks.is_main():
            self._watch.warn_changed(inside_epoch=where.num_batch > 0)
        self._write(path, where)
        self._due = False
        if self._clock is not None:
            self._clock.reset()
        if ranks.is_main():
            for old in self._removable()[: -self.keep_last]:
                old.unlink(missing_ok=True)
        ranks.barrier()  # no rank runs ahead of a save

    def _removable(self) -> list[Path]:
        """The checkpoints ``keep_last`` counts, oldest first: every file but
        the one ``resume_from`` names (a later run of the script starts from
        it again)."""
        kept = self.resume_from
        return [p for p in self.checkpoints() if kept is None or not _same(p, kept)]

    def _write(self, path: Path, where: Position) -> None:
        # Every rank's RNG states (each draws its own dropout) and callback
        # states (each sums its own losses); rank 0 writes.
        rng = self._rng_before_fetch if where.num_batch else get_rng_state(self._loader)
        rngs = ranks.gather_to_all(rng)
        epoch_rngs = ranks.gather_to_all(self._epoch_rng)
        states = [[cb.name, cb.state_dict()] for cb in self._others]
        # Inside an epoch: its sums so far (the record's train loss, ...).
        tally = self._tally.state_dict() if where.num_batch else None
        several = ranks.world_size() > 1  # then host tensors only: they cross ranks
        states = ranks.gather_to_all(host_copy(states) if several else states)
        tallies = ranks.gather_to_all(host_copy(tally) if several else tally)
        # A sharded model's and optimizer's whole state, gathered from every rank.
        model, opt = model_state(self._model), optimizer_state(self._opt, self._model)
        if not ranks.is_main():
            return
        atomic_save(
            {
                "fitlib_checkpoint": FORMAT,
                "run": self._run,  # what a resuming fit must match
                "model": model,
                "opt": opt,
                "callbacks": states[0],
                "rank_callbacks": states if len(states) > 1 else None,
                "tally": tallies if where.num_batch else None,
                "monitor": self.monitor.state_dict() if self.monitor else None,
                "top_k": self.top_k.state_dict() if self.top_k else None,
                "position": where._asdict(),
                # Inside an epoch: the RNG before its next batch was loaded.
                "rng": rngs,
                # Inside an epoch: what decided its order, to draw it again.
                "epoch_rng": epoch_rngs if where.num_batch else None,
                # The layouts its batches decided (find_class_dim): optional.
                "class_dims": saved_class_dims(unwrap(self._model)),
            },
            path,
        )

    # -- resuming --------------------------------------------------------------
    def _to_resume(self) -> tuple[Path, dict] | None:
        """The checkpoint to resume from, read: ``resume_from``'s, or the
        newest intact one."""
        if self.resume_from is None:
            return self._newest_intact()
        try:
            saved = read_checkpoint(self.resume_from, FORMAT)
        except CheckpointFileError as e:  # named by the user: not skipped
            raise ValueError(
                f"Checkpoint: resume_from names a checkpoint that cannot be "
                f"resumed from: {e}. The checkpoints in {str(self.dirpath)!r}: "
                f"{listing(self.dirpath)}. Fix: name another in resume_from."
            ) from e.__cause__
        self._warn_newer()
        return self.resume_from, saved

    def _warn_newer(self) -> None:
        """Warns once about the checkpoints newer than ``resume_from``'s: the
        run being restarted saved them, and this run's saves replace them."""
        newer = [p.name for p in _newer(self.dirpath, self.resume_from)]
        name = self.resume_from.name
        kept = f" (never {name})" if CHECKPOINT_NAME.fullmatch(name) else ""
        if newer and ranks.is_main():
            warnings.warn(
                f"Checkpoint: resuming from {name} (resume_from), although "
                f"{str(self.dirpath)!r} holds newer checkpoints: "
                f"{', '.join(newer)} (of the run being restarted). This run "
                "numbers its saves after them, and keep_last removes them as "
                f"it saves{kept}.",
                UserWarning,
                stacklevel=3,
            )

    def _newest_intact(self) -> tuple[Path, dict] | None:
        """The newest checkpoint that can be resumed from, read, after a
        warning for each newer one skipped (None: there are none). When every
        entry is unusable, an error names each."""
        skipped: list[CheckpointFileError] = []
        for _, path in reversed(numbered(self.dirpath)):
            try:
                saved = read_checkpoint(path, FORMAT)
            except CheckpointFileError as e:
                skipped.append(e)
                continue
            for e in skipped if ranks.is_main() else ():
                warnings.warn(
                    f"Checkpoint: skipped {e.path.name}: it {e.reason}. This run "
                    f"resumes from {path.name}, the newest intact checkpoint, "
                    "and leaves the skipped entry in place (keep_last removes "
                    "a file as this run saves).",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return path, saved
        if skipped:
            raise ValueError(self._none_intact(skipped))
        return None

    def _none_intact(self, skipped: list[CheckpointFileError]) -> str:
        """The error when no checkpoint can be resumed from: each entry and
        why, once, then one fix (``resume_from='best'`` when it is intact)."""
        entries = "; ".join(f"{e.path.name!r} {e.reason}" for e in skipped)
        here = str(self.dirpath)
        best = self.dirpath / "best.pth"
        try:
            read_checkpoint(best, FORMAT)
            from_best = (
                f"; or resume from best.pth, which is intact: Checkpoint({here!r}, "
                "resume_from='best')"
            )
        except (CheckpointFileError, ValueError):
            from_best = ""
        return (
            f"Checkpoint: no checkpoint in {here!r} can be resumed from: "
            f"{entries}. Fix: move these entries out of the directory (or delete "
            f"them), or pass Checkpoint({here!r}, resume=False), which numbers its "
            f"checkpoints after them, to start afresh{from_best}; or copy intact "
            "files back from where they came from."
        )

    def _load(self, path: Path, saved: dict) -> dict:
        # Everything is checked before anything is loaded.
        check_model_state(self._model, saved["model"], repr(str(path)))
        _own_states(saved, path)
        self._check_run(saved, path)
        check_callbacks(self._others, saved["callbacks"], path)
        load_model(self._model, saved["model"])
        load_optimizer_state(self._opt, self._model, saved["opt"])
        load_class_dims(unwrap(self._model), saved.get("class_dims") or ())
        give_states(self._others, saved["callbacks"])
        if saved.get("tally") is not None:  # (rank's own: see _own_states)
            self._tally.load_state_dict(saved["tally"])
        if self.best is not None:
            self.best.start(saved)
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
            reason = f"Checkpoint: the run in {str(self.dirpath)!r} already finished"
            return {**done, "stop_training": True, "stop_reason": reason}
        _say(
            f"fitlib: Checkpoint: resuming from {path.name} (epoch {pos['epoch']}, "
            f"batch {pos['num_batch']}, step {pos['step']})."
        )
        self._resume = saved
        return {k: pos[k] for k in ("epoch", "iteration", "step")}

    def _check_run(self, saved: dict, path: Path) -> None:
        """Refuses a checkpoint of another run, saying every difference."""
        whose = ("the checkpoint's run", "this run")
        if "run" in saved:
            found = run_differences(saved["run"], self._run, self._opt, saved["opt"])
        else:  # format 1: only its optimizer can be compared
            _say(
                f"fitlib: Checkpoint: {path.name} is of an earlier fitlib (format "
                "1) that did not record its run: only its optimizer is checked."
            )
            old = {"opt_class": saved["opt_class"]}
            found = optimizer_differences(self._opt, saved["opt"], old, whose)
        ours, kept = watched(self.monitor), watched(saved["monitor"])
        if None not in (ours, kept) and ours != kept:
            found.append(f"monitor: {whose[0]} {kept}, {whose[1]} {ours}")
        if found:
            raise ValueError(
                f"{str(path)!r} is a checkpoint of another run than this fit: "
                f"{'; '.join(found)}. Resuming it would mix two experiments. Fix: "
                "rerun the script that saved it to resume; or start afresh with "
                f"Checkpoint({str(self.dirpath)!r}, resume=False), which numbers "
                "its checkpoints after those there and, as it saves, deletes the "
                f"oldest beyond keep_last={self.keep_last} (the other run's "
                "too); or give this run another dirpath to keep both."
            )

    def _check_best_entry(self) -> None:
        """Refuses, before training, a ``best.pth`` that is no file to replace
        (a directory); a dangling link is simply replaced."""
        path = self.dirpath / "best.pth"
        if not self.save_best or path.is_symlink() or not path.exists():
            return
        if not path.is_file():
            raise ValueError(
                f"Checkpoint: {str(path)!r} {not_a_file(path)}, so the best "
                "checkpoint cannot be written there. Fix: move it out of "
                f"{str(self.dirpath)!r}, or Checkpoint(..., save_best=False)."
            )

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
    world = ranks.world_size()
    if len(saved["rng"]) != world:
        raise ValueError(
            f"{str(path)!r} was saved by {len(saved['rng'])} process(es); this "
            f"run has {world}. Fix: launch as many (torchrun --nproc_per_node), "
            "or Checkpoint(resume=False)."
        )
    saved["rng"] = saved["rng"][ranks.rank()]
    if saved.get("rank_callbacks"):
        saved["callbacks"] = saved["rank_callbacks"][ranks.rank()]
    if saved.get("tally") is not None:
        saved["tally"] = saved["tally"][ranks.rank()]
    if saved["epoch_rng"] is not None:
        saved["epoch_rng"] = saved["epoch_rng"][ranks.rank()]


def _same(a: Path, b: Path) -> bool:
    """Whether two paths name the same file."""
    try:
        return a.samefile(b)
    except OSError:  # one of them is gone
        return False


def _newer(dirpath: Path, named: Path) -> list[Path]:
    """The checkpoints in ``dirpath`` saved after ``named``: numbered after
    it when it is one of them, else modified after it."""
    files = [(n, p) for n, p in numbered(dirpath) if p.is_file()]
    match = CHECKPOINT_NAME.fullmatch(named.name)
    if match and any(_same(p, named) for _, p in files):
        return [p for n, p in files if n > int(match[1])]
    since = named.stat().st_mtime_ns
    return [p for _, p in files if p.stat().st_mtime_ns > since]


def _say(message: str) -> None:
    if ranks.is_main():  # one line, not one per process
        print(message)
