"""``CudaGraph``: the training step captured once as a CUDA graph, then replayed."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from fitlib.callback import Callback
from fitlib.checks import check_int
from fitlib.core import train_step
from fitlib.data import model_device
from fitlib.graph_capture import (
    changed,
    check_callbacks,
    check_device,
    check_loss_scaler,
    check_no_unfreezing,
    check_not_distributed,
    check_optimizers,
    check_scheduled_floats,
    make_capturable,
    refuse_changes,
    trains,
)
from fitlib.multi_optimizer import MultiOptimizer
from fitlib.optim import HPOptimizer
from fitlib.sharding import torch_optimizers
from fitlib.structure import map_tensors, tensors

_TORCH_DIR = os.path.dirname(torch.__file__)


class CudaGraph(Callback):
    """Replays each training step as one CUDA graph: forward, loss, backward
    and the optimizer's step launched in one call, for models whose steps are
    bound by kernel launches and Python (small and medium models, static
    shapes).

    The first ``warmup`` training batches are ordinary steps, run on a side
    stream as torch requires before a capture (the count starts again when a
    batch's shapes differ from the one before: the captured batch has the
    shapes of the warm-up batches before it); the next one is
    captured (``fitlib.core.train_step`` with the hooks inside it, under
    ``torch.cuda.set_sync_debug_mode("error")``, so the first operation that
    would read the device on the host fails the capture loudly, naming its
    line) and replayed; every later batch is copied into the graph's input
    buffers and replayed. ``on_batch_begin``, ``on_step_end`` (schedules,
    the step count, loss scaling's update, checkpoints) and ``on_batch_end``
    run in Python at every batch, outside the graph. The returned loss is a
    copy; ``last_output`` and ``last_loss`` are the graph's tensors, which
    the next replay overwrites.

    What a graph bakes in, and what this callback does about it:

    - The hyper-parameters: ``lr`` is held as a 0-d tensor on the device
      (``HPOptimizer.hypers_as_tensors``), which a schedule fills in place;
      optimizers that have ``capturable`` are made capturable for the fit
      (their ``step`` counters moved to the device). Both are put back when
      the fit ends. The other values stay floats and are baked in: momentum
      and Adam's betas (torch's eager Adam steps, foreach, single-tensor or
      fused, read tensor betas on the host: torch 2.11 to 2.14), weight
      decay, and SGD's ``lr`` unless ``fused=True`` (its foreach step reads
      a tensor lr). A schedule of one is refused before training (for
      1cycle: ``fit_one_cycle(..., moms=None)``), any other change at the
      next replay, naming it.
    - The shapes: a batch whose shapes or dtypes differ from the captured
      one (a ragged last batch) is trained eagerly, its gradients apart from
      the graph's; ``drop_last=True`` avoids it. Other values in the batch
      (a Python number) and attributes of the model (a dropout's ``p``) are
      baked: a schedule of an attribute that is not a tensor is refused.
    - The objects and the trainable parameters: a replay that finds another
      model, loss function or optimizer than the captured ones, or (checked
      at each epoch's first replay) other parameters training, raises a
      ``ValueError`` naming the change.
    - Checkpoints written during the fit hold the eager optimizer's state
      (``capturable`` as before the fit, the step counters on the CPU unless
      fused), so a resumed fit warms up and captures again, and an eager fit
      can load them.

    Refused before training, with the reason and the fix: a model not on a
    CUDA device; a distributed fit (``DistributedTrainer``, a
    ``DistributedDataParallel`` model: not yet tested on GPUs);
    ``BackboneFinetuning`` (``Learner.fine_tune``), which unfreezes mid-fit;
    ``ActivationCheckpointing`` (not yet tested on a GPU under a capture);
    ``ProgressiveResizing`` with several sizes; ``SWA(swa_lr=...)`` with a
    float lr;
    a callback that overrides ``on_loss_begin``,
    ``on_backward_begin`` or ``on_backward_end`` without declaring
    ``cuda_graph_safe = True`` (``MixedPrecision``, ``GradientClipping``
    do; ``GradientAccumulation`` cannot: it decides per batch whether to
    step); float16 ``MixedPrecision`` with an optimizer that is not fused
    (its loss scaler would read the device: ``Learner.to_fp16()`` makes it
    fused); an optimizer whose step cannot be captured.

    A callback declared ``cuda_graph_safe`` whose later hooks read Python
    state its step hooks set (a flag, a tensor) defines ``graph_replay()``:
    called once right after the capture, it returns a function that
    ``CudaGraph`` calls after each replay to put that state back (or None).

    Args:
        warmup: eager steps before the capture (an int >= 1).

    Examples:
        >>> CudaGraph()  # on a GPU: fit(..., callbacks=[CudaGraph()])
        CudaGraph(warmup=3)
        >>> Learner(data, model, F.cross_entropy, callbacks=[CudaGraph(5)]).callbacks
        [CudaGraph(warmup=5)]
    """

    order = -5  # after Checkpoint (-100) loaded and MixedPrecision (-20) set up
    in_lr_find = False  # a sweep's few steps: nothing to gain

    def __init__(self, warmup: int = 3) -> None:
        self.warmup = check_int(warmup, "warmup", minimum=1, owner="CudaGraph",
                                example=3)  # fmt: skip
        self._release()
        self._undo: list[Callable[[], None]] = []
        self.replays = 0  # steps the last fit replayed (the captured one too)

    def on_train_begin(
        self,
        model: nn.Module,
        opt: Any,
        callbacks: list | None = None,
        loss_func: Any = None,
    ) -> dict | None:
        """Runs before training: refuses what a graph cannot replay, makes the
        optimizer capturable, and sets the loop's ``step_fn``."""
        if opt is None:  # (an evaluation: no step)
            return None
        callbacks = callbacks or []
        check_loss_scaler(opt)
        check_optimizers(opt)
        check_callbacks(callbacks)
        check_not_distributed(model, callbacks)
        check_no_unfreezing(callbacks)
        self._release()
        self.replays = 0
        self._undo = make_capturable(opt)  # (put back by on_train_end)
        check_scheduled_floats(opt, callbacks, model, loss_func)
        check_device(model)
        self._stream = torch.cuda.Stream(device=model_device(model))
        return {"step_fn": self.step}

    def on_epoch_begin(self) -> None:
        """Runs before each epoch: its first replay checks again which
        parameters train (``changed``)."""
        self._recheck = True

    def on_step_end(self) -> dict | None:
        """Runs after each step: keeps the graph's gradients after a replay
        (``skip_zero``: the graph writes them in place)."""
        return {"skip_zero": True} if self._replayed else None

    def on_train_end(self, opt: Any) -> None:
        """Runs at the end, also after an error: lets go of the graph and its
        buffers, and puts the optimizer back as it was (floats, capturable as
        before, its step counters where they were)."""
        self._release()
        if opt is not None:
            opt.zero_grad(set_to_none=True)  # (the graph's own gradients)
        while self._undo:
            self._undo.pop()()

    def step(self, *args: Any) -> torch.Tensor:
        """The loop's ``step_fn`` (``fitlib.core.train_step``'s arguments):
        warm-up steps, the capture, then replays."""
        model, xb, yb, loss_func, opt, cb_handler, first = args
        args = (model, xb, yb, loss_func, opt, cb_handler)
        self._replayed = False
        if self._graph is None:
            if self._warming(_shapes(xb, yb)):
                return self._side_stream(*args, first)
            self._captured = (model, loss_func, opt)
            self._flags = trains(model)
            self._recheck = False
            return self._capture(*args)
        if _shapes(xb, yb) != self._shapes:  # a ragged batch: eagerly
            return self._eager(*args)
        captured = self._captured
        if model is not captured[0] or loss_func is not captured[1] or (
            opt is not captured[2]) or self._recheck:  # fmt: skip
            refuse_changes(changed(captured, self._flags, model, loss_func, opt))
            self._recheck = False
        self._check_baked(opt)
        return self._replay(xb, yb, opt, cb_handler.state)

    def _warming(self, shapes: tuple) -> bool:
        """Whether the batch of ``shapes`` is a warm-up step (else it is
        captured): the warm-up follows the latest batch's shapes, its count
        starting again when they change, so the captured batch has the shapes
        of the ``warmup`` batches before it (a fit resumed at an epoch's short
        last batch captures the full ones that follow)."""
        if shapes != self._shapes:
            self._shapes, self._seen = shapes, 0
        if self._seen < self._warm:
            self._seen += 1
            return True
        return False

    def _side_stream(self, *args: Any) -> torch.Tensor:
        """An eager step on the side stream that also captures (autograd's
        gradient accumulators keep the stream they were made on)."""
        current = torch.cuda.current_stream()
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream), _quiet():
            loss = train_step(*args)
        current.wait_stream(self._stream)
        return loss

    def _capture(self, model, xb, yb, loss_func, opt, cb_handler) -> torch.Tensor:
        self._static = (map_tensors(torch.clone, xb), map_tensors(torch.clone, yb))
        opt.zero_grad(set_to_none=True)  # backward allocates the graph's own
        state = cb_handler.state  # hooks inside read the graph's inputs
        state["last_input"], state["last_target"] = self._static
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self._stream,
                                  capture_error_mode="thread_local"):  # fmt: skip
                mode = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    loss = train_step(model, *self._static, loss_func, opt, cb_handler)
                finally:
                    torch.cuda.set_sync_debug_mode(mode)
        except RuntimeError as e:
            self._static = None
            cause = _capture_error(e)
            if cause is None:
                raise
            raise RuntimeError(_sync_message(cause)) from e
        finally:
            state["last_input"], state["last_target"] = xb, yb
        if state["skip_bwd"] or state["skip_step"]:
            raise ValueError(
                "CudaGraph: a callback skipped the backward or the step of the "
                "batch it captured (skip_bwd/skip_step), so every replay would "
                "skip it. Fix: leave out the callback that skips steps (gradient "
                "accumulation), or CudaGraph."
            )
        self._graph, self._loss = graph, loss.detach()
        self._out = map_tensors(torch.Tensor.detach, state["last_output"])
        self._bwd = state["last_loss"].detach()
        self._parts = state["last_loss_parts"]
        self._grads = [(p, p.grad) for o in torch_optimizers(opt)
                       for g in o.param_groups for p in g["params"]]  # fmt: skip
        self._baked = _baked(opt)
        self._after = [f for f in map(_replayer, state["callbacks"]) if f]
        graph.replay()  # a capture records the kernels; this runs them
        return self._replayed_out(opt, state)

    def _replay(self, xb: Any, yb: Any, opt: Any, state: dict) -> torch.Tensor:
        static_x, static_y = self._static
        if type(xb) is torch.Tensor:  # (the common batch inline: per step)
            static_x.copy_(xb, non_blocking=True)
        else:
            _copy_into(static_x, xb)
        if type(yb) is torch.Tensor:
            static_y.copy_(yb, non_blocking=True)
        else:
            _copy_into(static_y, yb)
        if self._eager_since:  # the graph's gradients, as the capture left them
            for p, grad in self._grads:
                p.grad = grad
            self._eager_since = False
        self._graph.replay()
        for after in self._after:
            after()
        return self._replayed_out(opt, state)

    def _replayed_out(self, opt: Any, state: dict) -> torch.Tensor:
        """The state as a step leaves it (the graph's tensors; copies of what
        the record keeps, which the next replay overwrites); the loss, a copy."""
        state["last_output"], state["last_loss"] = self._out, self._bwd
        if self._parts:
            state["last_loss_parts"] = {k: v.clone() for k, v in self._parts.items()}
        _note_stepped(opt)
        self._replayed, self.replays = True, self.replays + 1
        return self._loss.clone()

    def _eager(self, model, xb, yb, loss_func, opt, cb_handler) -> torch.Tensor:
        # Its own gradients: backward would add to the graph's otherwise.
        opt.zero_grad(set_to_none=True)
        self._eager_since = True
        return self._side_stream(model, xb, yb, loss_func, opt, cb_handler)

    def _check_baked(self, opt: Any) -> None:
        for owner, key, value in self._baked:
            now = owner[key] if isinstance(owner, dict) else getattr(owner, key)
            if type(now) is not type(value) or now != value:
                raise ValueError(
                    f"CudaGraph: the optimizer's {key} changed from {value!r} to "
                    f"{now!r} after the step was captured; a value that is not "
                    "a tensor is baked into the graph, so the replays would go "
                    f"on with {value!r}. Fix: schedule only the lr (with SGD, "
                    "SGD(fused=True)), or train without CudaGraph."
                )

    def _release(self) -> None:
        """Forgets the graph and every tensor it holds (its memory frees)."""
        self._graph = self._static = self._loss = self._out = self._bwd = None
        self._parts, self._grads, self._baked, self._after = None, [], [], []
        self._shapes: Any = None
        self._seen, self._warm, self._stream = 0, self.warmup, None
        self._replayed = self._eager_since = self._recheck = False
        self._captured: tuple = ()
        self._flags: tuple = ()

    def __repr__(self) -> str:
        return f"{self.name}(warmup={self.warmup})"


def _baked(opt: Any) -> list[tuple[Any, str, Any]]:
    """(owner, key, value) of every value of the parameter groups that the
    graph bakes in (not a tensor; fitlib's scale factors excluded, which the
    step does not read), and the parts that step (``MultiOptimizer.active``)."""
    baked: list[tuple[Any, str, Any]] = []
    for o in torch_optimizers(opt):
        for group in o.param_groups:
            for key, value in group.items():
                values = value if isinstance(value, (tuple, list)) else (value,)
                tensor = any(isinstance(v, torch.Tensor) for v in values)
                if not (key == "params" or key.endswith("_scale") or tensor):
                    baked.append((group, key, value))
    if isinstance(opt, MultiOptimizer):
        baked.append((opt, "active", opt.active))
    return baked


def _note_stepped(opt: Any) -> None:
    """``stepped`` as a step in Python notes it (the Recorder reads it)."""
    if isinstance(opt, MultiOptimizer):
        parts = list(opt.parts.values())
        for part in parts:
            part.stepped = part.lr_and_momentum()
        opt.stepped = parts[-1].lr_and_momentum()
    elif isinstance(opt, HPOptimizer):
        opt.stepped = opt.lr_and_momentum()


def _shapes(xb: Any, yb: Any) -> tuple:
    """What a replay needs of a batch to match the captured one."""
    if type(xb) is torch.Tensor and type(yb) is torch.Tensor:  # (per step)
        return (xb.shape, xb.dtype, yb.shape, yb.dtype)
    return tuple((path, t.shape, t.dtype) for path, t in tensors((xb, yb)))


def _copy_into(static: Any, new: Any) -> None:
    for (_, s), (_, t) in zip(tensors(static), tensors(new), strict=True):
        s.copy_(t, non_blocking=True)


def _replayer(cb: Callback) -> Callable[[], None] | None:
    """What ``cb`` asks to run after each replay (``graph_replay``), if any."""
    make = getattr(cb, "graph_replay", None)
    return make() if callable(make) else None


@contextmanager
def _quiet() -> Iterator[None]:
    """Silences torch's warning that a capturable optimizer steps outside a
    capture (the warm-up and ragged batches do, on purpose)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*capturable=True.*")
        yield


def _capture_error(e: BaseException) -> BaseException | None:
    """The error in ``e``'s chain that a sync (or an operation a capture
    forbids) raised, or None for any other error."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if "synchroniz" in str(e) or "captur" in str(e):
            return e
        e = e.__cause__ or e.__context__
    return None


def _sync_message(e: BaseException) -> str:
    where = _last_user_frame(e)
    return (
        f"CudaGraph: {where} reads the device on the host (a sync: .item(), "
        "float(t), bool(t), .cpu(), .tolist(), a nonzero/mask index) or does "
        "what a CUDA graph cannot capture, inside the captured step. A graph "
        "replays kernels only, so that read would never happen again. Fix: "
        "keep that value on the device (or read it once per epoch), or, for a "
        "callback, do not declare it cuda_graph_safe (CudaGraph then refuses "
        f"it before training). torch said: {str(e).strip().splitlines()[0]}"
    )


def _last_user_frame(e: BaseException) -> str:
    """The last frame of ``e``'s traceback outside torch: the line that
    synced, with the callback it belongs to."""
    found = "an operation"
    tb = e.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        path = frame.f_code.co_filename
        if not path.startswith(_TORCH_DIR) and path != __file__:
            owner = frame.f_locals.get("self")
            whose = f"{owner.name}." if isinstance(owner, Callback) else ""
            where = f"{os.path.basename(path)}:{tb.tb_lineno}"
            found = f"{whose}{frame.f_code.co_name} ({where})"
        tb = tb.tb_next
    return found
