"""``find_batch_size``: the largest training batch that fits, found by
training a few steps at growing batch sizes, with every state put back.

Each trial trains ``steps_per_trial`` real steps (forward, backward, the
optimizer's step) through ``fit``, the one loop, with the callbacks that
shape a step, on batches of the trial's size from the training set; what
the callbacks left out will hold is counted as held. The size doubles from
``init_val`` until a trial fails (CUDA's ``OutOfMemoryError``, caught, or
more than ``max_memory``: see ``fitlib.peak_memory``) or a limit;
``mode="binsearch"`` then bisects. The size found is run once more to
verify it. After the search the model, the optimizer's state, the
callbacks' states and the random generators are what they were, bit for
bit; the loaders keep their batch size unless ``apply=True``.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import fitlib.ranks as ranks
from fitlib.callback import Callback, inner_callback
from fitlib.callbacks.ema import EMA
from fitlib.callbacks.swa import SWA
from fitlib.checks import check_flag, check_int
from fitlib.core import fit
from fitlib.data import DataBunch, model_device
from fitlib.errors import did_you_mean
from fitlib.peak_memory import (
    OverBudget,
    PeakMemory,
    format_bytes,
    held_tensors,
    is_out_of_memory,
    parse_bytes,
)
from fitlib.rng import get_rng_state, set_rng_state
from fitlib.serialization import host_copy
from fitlib.sharding import local
from fitlib.weight_averaging import chosen_modules, tracked_tensors

MODES = ("power", "binsearch")
OWNER = "find_batch_size"


@dataclass
class Trial:
    """One trial: its batch ``size``, whether it ``fit``, why not (``why``)
    and its peak memory in bytes (``peak``; None when not measured)."""

    size: int
    fit: bool
    why: str = ""
    peak: int | None = None

    def __str__(self) -> str:
        peak = "" if self.peak is None else f", peak {format_bytes(self.peak)}"
        if self.fit:
            return f"batch size {self.size}: fits{peak}"
        return f"batch size {self.size}: does not fit ({self.why})"

    def __repr__(self) -> str:
        return f"Trial({self})"

    def short(self) -> str:
        """The trial in a list of trials: its size, ✗ when it failed."""
        return str(self.size) if self.fit else f"{self.size} ✗"

    def said(self) -> str:
        """The trial in words: its size, and why it failed."""
        return str(self.size) if self.fit else f"{self.size} ({self.why})"


@dataclass
class BatchSizeResult:
    """What ``find_batch_size`` found: ``batch_size`` (its run once more:
    ``verified``), the ``trials`` in order, the limit that ended them
    (``stopped_by``), ``max_memory`` and ``extra_memory`` (bytes), the
    ``processes`` and the size this one found (``found_here``) when several
    took the smallest. ``str()`` is the line it prints, ``repr()`` short."""

    batch_size: int
    trials: list[Trial]
    stopped_by: str
    verified: Trial
    max_memory: int | None = None
    extra_memory: int = 0
    processes: int = 1
    found_here: int | None = None

    @property
    def first_failure(self) -> Trial | None:
        """The first trial that did not fit, None if all did."""
        return next((t for t in self.trials if not t.fit), None)

    def __str__(self) -> str:
        failure = self.first_failure
        peak = self.verified.peak
        budget = f" of {format_bytes(self.max_memory)}" if self.max_memory else ""
        return (
            f"batch size {self.batch_size} (verified: "
            + (f"peak {format_bytes(peak)}{budget}" if peak is not None else "it fits")
            + (f", {format_bytes(self.extra_memory)} of it for callbacks left out"
               if self.extra_memory else "")
            + f"); tried {', '.join(t.short() for t in self.trials)}; first failure: "
            + (failure.said() if failure else "none")
            + f"; stopped by {self.stopped_by}"
            + (f"; the smallest over {self.processes} processes (this one: "
               f"{self.found_here})" if self.processes > 1 else "")
        )  # fmt: skip

    def __repr__(self) -> str:
        return (
            f"BatchSizeResult(batch_size={self.batch_size}, {len(self.trials)} "
            f"trials, stopped by {self.stopped_by})"
        )


def find_batch_size(
    model: nn.Module,
    loss_func: Any,
    opt: Any,
    data: DataBunch,
    *,
    callbacks: Iterable[Callback] = (),
    left_out: Iterable[Callback] = (),
    mode: str = "power",
    init_val: int = 2,
    max_trials: int = 25,
    steps_per_trial: int = 3,
    max_batch_size: int | None = None,
    max_memory: int | str | None = None,
    extra_memory: int | str | None = None,
    apply: bool = False,
    verbose: bool = True,
) -> BatchSizeResult:
    """The largest training batch size that fits, found by training
    ``steps_per_trial`` steps at each size tried; every state is put back.

    Args:
        model: the model, as ``fit`` takes it.
        loss_func: its loss, as ``fit`` takes it.
        opt: its optimizer (its state is counted, and put back).
        data: a ``DataBunch`` whose ``train_dl`` is a ``DataLoader`` with a
            ``batch_size``: its dataset, sampler and collate function make
            the trials' batches.
        callbacks: those that shape a step (``MixedPrecision``,
            ``GradientAccumulation``, your own): they change what a step holds.
            Their states are put back after each trial.
        left_out: the real fit's callbacks that the trials leave out: what
            they will hold (``memory_left_out``: ``EMA``'s, ``SWA``'s average)
            is counted as held in every trial.
        mode: ``"power"``: double from ``init_val`` until a trial fails or a
            limit; ``"binsearch"``: then search between the last size that fit
            and the first that failed, to one sample.
        init_val: the first size tried.
        max_trials: the most trials (the verification not counted).
        steps_per_trial: optimizer steps a trial trains.
        max_batch_size: the largest size to try (the data set's size caps it
            too).
        max_memory: the memory the steps may take: bytes or a string such as
            ``"2GB"``. Needed on the CPU (it runs out only when the machine
            does); optional on CUDA (else: until it runs out of memory).
        extra_memory: more memory the real fit holds that the trials do not
            (another model, a callback of yours): bytes or a string such as
            ``"40MB"``, counted as held through every trial, with
            ``left_out``'s (on CUDA, allocated for the search).
        apply: set ``data.train_dl`` to a copy of it with the size found
            (validation is unchanged). Under a process group every process
            takes the smallest size found, so all train with one size.
        verbose: print the one line that says what it found (rank 0 only).

    Returns:
        A ``BatchSizeResult``: ``batch_size``, the ``trials``, what stopped it.

    Raises:
        ValueError: on the CPU without ``max_memory``; when not even batches
            of 1 fit. An error of a trial other than running out of memory is
            raised as it is (after every state is put back).

    The copies it keeps to put the states back (weights, buffers, gradients,
    optimizer state) take that much host memory again, not counted.

    Examples:
        >>> from fitlib.batch_size_finder import find_batch_size
        >>> found = find_batch_size(model, F.cross_entropy, opt, data,
        ...                         max_memory="15kB", verbose=False)
        >>> found.batch_size, data.train_dl.batch_size  # the loader unchanged
        (32, 16)
        >>> found
        BatchSizeResult(batch_size=32, 6 trials, stopped by the first failure (power
        mode))
        >>> print(found)  # what it prints with verbose=True
        batch size 32 (verified: peak ... kB of 15 kB); tried 2, 4, 8, 16, 32, 64 ✗;
        first failure: 64 (over the 15 kB budget: stopped at ... kB); stopped by
        the first failure (power mode)
    """
    limits = _checked(model, data, mode, init_val, max_trials, steps_per_trial,
                      max_batch_size, max_memory, apply, verbose)  # fmt: skip
    extra = memory_left_out(left_out, model) + (0 if extra_memory in (None, 0)
        else parse_bytes(extra_memory, "extra_memory", OWNER))  # fmt: skip
    callbacks = list(callbacks)
    saved = _snapshot(model, opt, callbacks, data.train_dl)
    run = _TrialRunner(model, loss_func, opt, data, callbacks, saved,
                       steps_per_trial, limits["max_memory"], extra)  # fmt: skip
    try:
        trials, stopped_by = _search(run, init_val, mode, max_trials, limits)
        verified = _verify(run, trials)
    finally:
        run.placeholder = None  # the extra memory, given back
    found = ranks.gather_to_all(verified.size)  # [size] in one process
    result = BatchSizeResult(min(found), trials, stopped_by, verified,
                             limits["max_memory"], extra, len(found),
                             verified.size if len(found) > 1 else None)  # fmt: skip
    if apply:
        data.train_dl = resized_loader(data.train_dl, result.batch_size)
    if verbose and ranks.is_main():
        print(f"{OWNER}: {result}")
    return result


def resized_loader(
    loader: DataLoader,
    batch_size: int,
    drop_last: bool | None = None,
    num_workers: int | None = None,
) -> DataLoader:
    """A ``DataLoader`` like ``loader`` (its dataset, sampler, collate
    function, workers, generator, ...) with batches of ``batch_size``
    (and ``drop_last``, ``num_workers`` if given).

    Examples:
        >>> from fitlib.batch_size_finder import resized_loader
        >>> bigger = resized_loader(data.train_dl, 32)
        >>> bigger.batch_size, len(bigger), bigger.sampler is data.train_dl.sampler
        (32, 2, True)
    """
    _check_resizable(loader, "loader")
    iterable = isinstance(loader.dataset, IterableDataset)
    workers = loader.num_workers if num_workers is None else num_workers
    kwargs = {
        "batch_size": batch_size,
        "drop_last": loader.drop_last if drop_last is None else drop_last,
        "num_workers": workers,
        "prefetch_factor": loader.prefetch_factor if workers else None,
        "persistent_workers": loader.persistent_workers and workers > 0,
    }
    if not iterable:  # an IterableDataset's loader takes no sampler
        kwargs["sampler"] = loader.sampler
    for name in ("collate_fn", "pin_memory", "timeout", "worker_init_fn",
                 "multiprocessing_context", "generator", "pin_memory_device",
                 "in_order"):  # fmt: skip
        if hasattr(loader, name):
            kwargs[name] = getattr(loader, name)
    return DataLoader(loader.dataset, **kwargs)


def memory_left_out(callbacks: Iterable[Callback], model: nn.Module) -> int:
    """The bytes ``callbacks`` (left out of the trials) will hold through a
    fit of ``model``: ``EMA``'s and ``SWA``'s average (a float32 copy of
    what they average), or what a callback's ``memory_held(model)`` returns.

    Examples:
        >>> from fitlib.batch_size_finder import memory_left_out
        >>> n = sum(p.numel() for p in model.parameters())
        >>> memory_left_out([EMA(decay=0.9)], model) == 4 * n
        True
    """
    total = 0
    for cb in callbacks:
        cb = inner_callback(cb)
        if callable(getattr(cb, "memory_held", None)):
            total += int(cb.memory_held(model))
        elif isinstance(cb, (EMA, SWA)):
            buffers = cb.buffers if isinstance(cb, EMA) else "copy"
            tensors = tracked_tensors(chosen_modules(model, cb.parts, cb.name), buffers)
            total += sum(_average_bytes(local(t)) for t in tensors)
    return total


def _average_bytes(t: torch.Tensor) -> int:  # float32, but float64 and ints kept
    keep = not t.is_floating_point() or t.dtype == torch.float64
    return t.numel() * (t.dtype.itemsize if keep else 4)


# -- the search ----------------------------------------------------------------
def _search(
    run: _TrialRunner, init_val: int, mode: str, max_trials: int, limits: dict
) -> tuple[list[Trial], str]:
    """Trials from ``init_val`` on, and what ended them: doubling until a
    failure or the cap; halving while nothing fit; in binsearch mode then
    bisecting between the largest size that fit and the smallest that failed."""
    cap, trials = limits["cap"], []
    fits, fails = 0, None  # the largest size that fit, the smallest that failed
    size = init_val if cap is None else min(init_val, cap)
    while len(trials) < max_trials:
        trial = run(size)
        trials.append(trial)
        if trial.fit:
            fits = max(fits, size)
        else:
            fails = size if fails is None else min(fails, size)
        if fails is None:  # growing
            if cap is not None and size >= cap:
                return trials, limits["cap_reason"]
            size = 2 * size if cap is None else min(2 * size, cap)
        elif fits == 0:  # nothing fit yet: halve
            if size == 1:
                _none_fits(trials)
            size //= 2
        elif mode == "power":
            return trials, "the first failure (power mode)"
        elif fails - fits <= 1:
            return trials, f"the binary search ({fits} fits, {fails} does not)"
        else:
            size = (fits + fails) // 2
    if fits == 0:
        _none_fits(trials)
    return trials, f"max_trials={max_trials}"


def _verify(run: _TrialRunner, trials: list[Trial]) -> Trial:
    """One more trial at the largest size that fit; if it fails now (memory
    fragmented, another process took some), the next largest."""
    for size in sorted({t.size for t in trials if t.fit}, reverse=True):
        trial = run(size)
        if trial.fit:
            return trial
        trials.append(trial)
    _none_fits(trials)


def _none_fits(trials: list[Trial]) -> None:
    raise ValueError(
        f"{OWNER}: no batch size fits: tried "
        f"{', '.join(t.said() for t in trials)}. "
        "Fix: a larger max_memory, mixed precision (learn.to_bf16(), or "
        "to_fp16() on a GPU), or a smaller model."
    )


class _TrialRunner:
    """Runs one trial at a batch size, then puts every state back."""

    def __init__(self, model, loss_func, opt, data, callbacks, saved, steps,
                 budget, extra=0) -> None:  # fmt: skip
        self.model, self.loss_func, self.opt = model, loss_func, opt
        self.data, self.callbacks, self.saved = data, callbacks, saved
        self.steps, self.budget = steps, budget
        self.device = model_device(model)
        # What the real fit holds besides the steps, held here: counted on
        # the CPU (its pages untouched, so not taken), allocated on CUDA.
        self.placeholder = (
            torch.empty(extra, dtype=torch.uint8, device=self.device) if extra else None
        )

    def __call__(self, size: int) -> Trial:
        # In this process (num_workers=0), so the batches' memory counts.
        loader = resized_loader(self.data.train_dl, size, drop_last=True,
                                num_workers=0)  # fmt: skip
        data = DataBunch(loader, None, device=self.device,
                         batch_fn=self.data.batch_fn)  # fmt: skip
        cuda = self.device.type == "cuda"
        held = held_tensors(self.model, self.opt)
        if self.placeholder is not None:
            held.append(self.placeholder)
        meter = PeakMemory(self.device, held, None if cuda else self.budget)
        why = ""
        try:
            with meter:
                fit(None, self.model, self.loss_func, self.opt, data,
                    self.callbacks, max_steps=self.steps)  # fmt: skip
        except OverBudget as e:
            why = (f"over the {format_bytes(e.limit)} budget: stopped at "
                   f"{format_bytes(e.held)}")  # fmt: skip
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            why = "out of memory"
        finally:
            _restore(self.saved, self.model, self.opt, self.callbacks)
        del loader, data
        if not why and self.budget is not None and meter.peak > self.budget:
            why = (f"over the {format_bytes(self.budget)} budget: peak "
                   f"{format_bytes(meter.peak)}")  # fmt: skip
        if why and self.device.type != "cpu":
            _free_memory(self.device)
        return Trial(size, not why, why, meter.peak)


def _free_memory(device: torch.device) -> None:
    """Frees what a failed trial left on an accelerator (tensors in reference
    cycles, then CUDA's cached blocks), so the next trial starts from empty.
    (Not on the CPU: ``TensorBytes`` counts what a step holds, not what is
    free, and a collection costs a second in a large process.)"""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- states saved and put back --------------------------------------------------
def _snapshot(
    model: nn.Module, opt: Any, callbacks: list[Callback], loader: Any
) -> dict:
    """Copies (on the host) of what a trial changes."""
    tensors = [(m, kind, name, t, host_copy(t)) for m in model.modules()
               for kind in ("_parameters", "_buffers")
               for name, t in getattr(m, kind).items() if t is not None]  # fmt: skip
    grads = [(p, None if p.grad is None else host_copy(p.grad))
             for p in model.parameters()]  # fmt: skip
    return {
        "tensors": tensors,
        "grads": grads,
        "training": [(m, m.training) for m in model.modules()],
        "opt": host_copy(opt.state_dict()),
        "callbacks": [copy.deepcopy(cb.state_dict()) for cb in callbacks],
        "rng": get_rng_state(loader),
        "loader": loader,
    }


def _restore(saved: dict, model: nn.Module, opt: Any, callbacks: list) -> None:
    """Puts back what ``_snapshot`` saved; it can run again: what it loads
    are copies, which later trials cannot change."""
    with torch.no_grad():
        for module, kind, name, t, value in saved["tensors"]:
            getattr(module, kind)[name] = t  # the same object, if one was swapped
            t.copy_(value)
        for p, grad in saved["grads"]:
            p.grad = None if grad is None else grad.to(p.device, copy=True)
    for module, training in saved["training"]:
        module.training = training
    opt.load_state_dict(copy.deepcopy(saved["opt"]))
    if hasattr(opt, "stepped"):
        opt.stepped = None  # the trials' steps are undone
    for cb, state in zip(callbacks, saved["callbacks"], strict=True):
        cb.load_state_dict(copy.deepcopy(state))
    set_rng_state(saved["rng"], saved["loader"])


# -- the arguments ----------------------------------------------------------------
def _checked(model, data, mode, init_val, max_trials, steps, max_batch_size,
             max_memory, apply, verbose) -> dict:  # fmt: skip
    """The limits of the search, once its arguments are checked: ``cap``
    (and ``cap_reason``) and ``max_memory`` in bytes."""
    if mode not in MODES:
        raise ValueError(
            f"{OWNER}: mode must be 'power' or 'binsearch'; got {mode!r}"
            f"{did_you_mean(mode, MODES)}. Fix: e.g. mode='binsearch'."
        )
    for name, value, minimum in (("init_val", init_val, 1), ("max_trials",
            max_trials, 1), ("steps_per_trial", steps, 1)):  # fmt: skip
        check_int(value, name, minimum=minimum, owner=OWNER)
    check_int(max_batch_size, "max_batch_size", minimum=1, owner=OWNER,
              example=4096, allow_none=True)  # fmt: skip
    check_flag(apply, "apply", OWNER, "apply=True")
    check_flag(verbose, "verbose", OWNER, "verbose=False")
    _check_resizable(getattr(data, "train_dl", None), "data.train_dl")
    budget = None if max_memory is None else parse_bytes(max_memory, owner=OWNER)
    if budget is None and model_device(model).type == "cpu":
        raise ValueError(
            f"{OWNER}: on the CPU a batch too large does not fail, it swaps or "
            "the system ends the process, so the search needs a memory budget; "
            "got max_memory=None. Fix: the memory training may take, e.g. "
            "max_memory='2GB'."
        )
    return {"max_memory": budget, **_cap(data.train_dl, max_batch_size)}


def _cap(loader: DataLoader, max_batch_size: int | None) -> dict:
    """The largest size to try, and its reason: ``max_batch_size`` or the
    number of samples an epoch draws (its sampler's length: a trial needs
    one full batch)."""
    n = None if isinstance(loader.dataset, IterableDataset) else len(loader.sampler)
    if n is not None and (max_batch_size is None or n < max_batch_size):
        return {"cap": n, "cap_reason": f"the data set's size ({n} samples)"}
    reason = None if max_batch_size is None else f"max_batch_size={max_batch_size}"
    return {"cap": max_batch_size, "cap_reason": reason}


def _check_resizable(loader: Any, name: str) -> None:
    if isinstance(loader, DataLoader) and loader.batch_size is not None:
        return
    got = (
        f"a DataLoader with a batch_sampler ({type(loader.batch_sampler).__name__})"
        if isinstance(loader, DataLoader)
        else f"{type(loader).__name__}"
    )
    raise TypeError(
        f"{OWNER}: {name} must be a torch DataLoader built with a batch_size, to "
        f"rebuild with other batch sizes; got {got}. Fix: build it as "
        "DataLoader(dataset, batch_size=..., shuffle=..., collate_fn=...)."
    )
