"""Built-in callbacks, one feature per module.

Within an event, callbacks run by their ``order`` (lower first). Why each
built-in callback has its order is in ``ORDER_REASONS``; ``order_table()``
gives the rows the reference shows (docs/reference/state.md). The filters
``every``, ``once`` and ``first`` take the order of the callback they wrap.
"""

from fitlib.callback import Callback
from fitlib.callbacks.accumulation import GradientAccumulation
from fitlib.callbacks.activation_checkpointing import ActivationCheckpointing
from fitlib.callbacks.backbone_finetuning import BackboneFinetuning
from fitlib.callbacks.channels_last import ChannelsLast
from fitlib.callbacks.checkpoint import Checkpoint
from fitlib.callbacks.clipping import GradientClipping
from fitlib.callbacks.compile import Compile
from fitlib.callbacks.csv_logger import CSVLogger
from fitlib.callbacks.cuda_graph import CudaGraph
from fitlib.callbacks.cutmix import CutMix
from fitlib.callbacks.distributed_trainer import DistributedTrainer
from fitlib.callbacks.early_stopping import EarlyStopping
from fitlib.callbacks.ema import EMA
from fitlib.callbacks.filters import every, first, once
from fitlib.callbacks.gan_trainer import GANTrainer
from fitlib.callbacks.lr_finder import LRFinder
from fitlib.callbacks.mixed_precision import MixedPrecision
from fitlib.callbacks.mixup import MixUp
from fitlib.callbacks.mlflow_logger import MLflowLogger
from fitlib.callbacks.model_summary import ModelSummary
from fitlib.callbacks.one_cycle import OneCycleScheduler
from fitlib.callbacks.optuna_pruning import OptunaPruning
from fitlib.callbacks.plateau import ReduceLROnPlateau
from fitlib.callbacks.progress import ProgressBar
from fitlib.callbacks.progressive_resizing import ProgressiveResizing
from fitlib.callbacks.recorder import Recorder
from fitlib.callbacks.schedule import (
    ParamScheduler,
    constant,
    cosine,
    exponential,
    linear,
)
from fitlib.callbacks.stop_when import StopWhen
from fitlib.callbacks.swa import SWA
from fitlib.callbacks.sweep_bar import SweepBar
from fitlib.callbacks.tensorboard import TensorBoardLogger
from fitlib.callbacks.terminate_on_nan import TerminateOnNaN
from fitlib.callbacks.text_logger import TextLogger
from fitlib.callbacks.time_limit import TimeLimit
from fitlib.callbacks.torch_scheduler import TorchScheduler
from fitlib.callbacks.train_stats import TrainStats
from fitlib.callbacks.validation import ValidationSchedule
from fitlib.lr_suggestions import SuggestedLRs

__all__ = [
    "EMA",
    "SWA",
    "ActivationCheckpointing",
    "BackboneFinetuning",
    "CSVLogger",
    "ChannelsLast",
    "Checkpoint",
    "Compile",
    "CudaGraph",
    "CutMix",
    "DistributedTrainer",
    "EarlyStopping",
    "GANTrainer",
    "GradientAccumulation",
    "GradientClipping",
    "LRFinder",
    "MLflowLogger",
    "MixUp",
    "MixedPrecision",
    "ModelSummary",
    "OneCycleScheduler",
    "OptunaPruning",
    "ParamScheduler",
    "ProgressBar",
    "ProgressiveResizing",
    "Recorder",
    "ReduceLROnPlateau",
    "StopWhen",
    "SuggestedLRs",
    "SweepBar",
    "TensorBoardLogger",
    "TerminateOnNaN",
    "TextLogger",
    "TimeLimit",
    "TorchScheduler",
    "TrainStats",
    "ValidationSchedule",
    "constant",
    "cosine",
    "every",
    "exponential",
    "first",
    "linear",
    "once",
    "order_table",
]

# Why each built-in callback runs where it does (its class's ``order``), in
# the order of the table; "Callback" stands for yours (the default order).
ORDER_REASONS: dict[str, str] = {
    "ModelSummary": (
        "first of all: shows the model as given, before DistributedTrainer wraps "
        "or shards it; its one forward runs alone on rank 0 and changes nothing"
    ),
    "ProgressiveResizing": (
        "resizes each training batch's images before any other hook: ChannelsLast "
        "converts the resized images, autocast is not on yet"
    ),
    "ChannelsLast": (
        "NHWC weights before DDP lays out its buckets; converts each batch "
        "before any later hook (after ProgressiveResizing resized it)"
    ),
    "ActivationCheckpointing": (
        "wraps the plain model's submodules before DistributedTrainer wraps the "
        "model and Compile compiles it"
    ),
    "DistributedTrainer": (
        "before the rest: the model (DDP), device and sharded data the others see "
        "are set here (only what shapes the plain model or its batches comes first)"
    ),
    "Compile": (
        "compiles the model in place (inside the DDP wrapper that "
        "DistributedTrainer made)"
    ),
    "Checkpoint": (
        "first: restores before the others begin; saves at the start of a batch "
        "or epoch, when the others have finished the previous one (best.pth too, "
        "once the epoch's record is complete)"
    ),
    "EMA": (
        "after Checkpoint (its restore comes first, its final save holds the "
        "live weights); before the others: its validation values are declared "
        "as the monitors check them, and added before they read the record"
    ),
    "GANTrainer": (
        "whose turn: the part that steps and learns is set before accumulation "
        "and mixed precision"
    ),
    "MixUp": (
        "mixes a training batch after Checkpoint saved (a resume replays its "
        "draws), its loss before a loss term at -35 is added (unweighted) and "
        "before GradientAccumulation and MixedPrecision scale it"
    ),
    "CutMix": (
        "mixes a training batch after Checkpoint saved (a resume replays its "
        "draws), its loss before a loss term at -35 is added (unweighted) and "
        "before GradientAccumulation and MixedPrecision scale it"
    ),
    "GradientAccumulation": (
        "first: decides whether this batch steps (``skip_step``) and scales the "
        "loss; sets the fit's ``n_steps`` before schedulers read it"
    ),
    "MixedPrecision": (
        "unscales the gradients of a step before any later ``on_backward_end`` "
        "(clipping, yours)"
    ),
    "TrainStats": "the raw gradient norm: unscaled, not yet clipped",
    "GradientClipping": (
        "clips true (unscaled) gradients right before the step that uses them"
    ),
    "CudaGraph": (
        "sets the loop's step function once Checkpoint restored the optimizer and "
        "MixedPrecision attached its scaler; its step runs after every "
        "``on_batch_begin`` (autocast on)"
    ),
    "Callback": (
        "your callbacks (the default order): see unscaled gradients; values added "
        "to the epoch record reach the monitors, the Recorder, the loggers and the "
        "bar (40 and up)"
    ),
    "BackboneFinetuning": (
        "after your callbacks, before the schedulers: freezes or unfreezes the "
        "backbone and sets its lr factor as an epoch starts, once Checkpoint "
        "restored the position"
    ),
    "ValidationSchedule": (
        "any order: the loop reads what it sets (``skip_validate``, "
        "``validate_now``) after the events"
    ),
    "ParamScheduler": (
        "sets the hyper-parameters of the next step after each optimizer step"
    ),
    "OneCycleScheduler": (
        "sets the hyper-parameters of the next step after each optimizer step"
    ),
    "TorchScheduler": (
        "steps a torch lr scheduler after each optimizer step (or epoch) and "
        "sets the next step's lr"
    ),
    "LRFinder": (
        "sets the lr of the next step after each optimizer step, and stops the sweep"
    ),
    "SWA": ("after the schedulers: from swa_start on, its lr is the one that counts"),
    "ReduceLROnPlateau": "lowers the lr after an epoch's validation",
    "TerminateOnNaN": "reads the losses at a paced check or epoch end",
    "EarlyStopping": (
        "after a plateau lowered the lr; the Recorder and the bar still show the "
        "epoch it stops after"
    ),
    "StopWhen": (
        "as EarlyStopping: its condition sees the values your callbacks add; the "
        "Recorder and the bar still show the epoch it stops after"
    ),
    "OptunaPruning": (
        "as EarlyStopping: reports the values your callbacks add too; its stop "
        "comes before TimeLimit's suspend, and the Recorder, loggers and bar "
        "still show the record it pruned at"
    ),
    "TimeLimit": (
        "after the stopping rules: a stop that finishes the run comes first and "
        "says why; before the Recorder, loggers and bar (they see the suspend)"
    ),
    "Recorder": (
        "after callbacks that change the loss or hyper-params, so it records the "
        "final values"
    ),
    "CSVLogger": (
        "after the Recorder: writes each epoch's final values and the lr each step used"
    ),
    "TextLogger": (
        "after the Recorder: writes each epoch's final values and the lr each step used"
    ),
    "TensorBoardLogger": (
        "after the Recorder: writes each epoch's final values and the lr each step used"
    ),
    "MLflowLogger": (
        "after the Recorder: writes each epoch's final values and the lr each step used"
    ),
    "ProgressBar": "after the Recorder: shows what the epoch ended with",
    "SweepBar": (
        "after the Recorder: shows what the epoch ended with; after the LRFinder "
        "(10): sees its stop"
    ),
}


def order_table() -> list[tuple[str, int, str]]:
    """The built-in callbacks from first to last within an event.

    Returns:
        One ``(class name, order, why there)`` row per built-in callback, and
        a row ``"Callback"`` for yours (the default order), sorted by order
        (rows of one order in the order of ``ORDER_REASONS``). Each order is
        read from the class, so the table cannot drift from the code.

    Examples:
        >>> order_table()[0][:2]
        ('ModelSummary', -250)
    """
    classes = globals() | {"Callback": Callback}
    rows = [(name, classes[name].order, why) for name, why in ORDER_REASONS.items()]
    return sorted(rows, key=lambda row: row[1])
