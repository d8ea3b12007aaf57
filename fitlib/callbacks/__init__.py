"""Built-in callbacks, one feature per module.

Order of the built-in callbacks (lower runs first within an event):

====================  =====  ================================================
callback              order  why there
====================  =====  ================================================
ChannelsLast          -210   NHWC weights before DDP lays out its buckets;
                             converts each batch before any other hook
DistributedTrainer    -200   first: the model (DDP), device and sharded data
                             the others see are set here
Compile               -190   compiles the model in place (inside the DDP
                             wrapper that DistributedTrainer made)
Checkpoint            -100   first: restores before the others begin; saves
                             at the start of a batch or epoch, when the
                             others have finished the previous one (best.pth
                             too, once the epoch's record is complete)
GANTrainer             -40   whose turn: the part that steps and learns is
                             set before accumulation and mixed precision
GradientAccumulation   -30   first: decides whether this batch steps
                             (``skip_step``) and scales the loss; sets the
                             fit's ``n_steps`` before schedulers read it
MixedPrecision         -20   unscales the gradients of a step before any
                             later ``on_backward_end`` (clipping, yours)
TrainStats             -15   the raw gradient norm: unscaled, not yet clipped
GradientClipping       -10   clips true (unscaled) gradients right before the
                             step that uses them
every, once, first      (=)  filters take the order of the callback they wrap
(your callbacks)         0   see unscaled gradients; values added to the
                             epoch record reach the monitors, the Recorder,
                             the loggers and the bar (40 and up)
ValidationSchedule       0   any order: the loop reads what it sets
                             (``skip_validate``, ``validate_now``) after
                             the events
ParamScheduler,         10   set the hyper-parameters of the next step after
OneCycleScheduler,           each optimizer step; the LR finder also stops
LRFinder                     the sweep
ReduceLROnPlateau       40   lowers the lr after an epoch's validation
TerminateOnNaN          40   reads the losses at a paced check or epoch end
EarlyStopping           45   after a plateau lowered the lr; the Recorder and
                             the bar still show the epoch it stops after
Recorder                50   after callbacks that change the loss or hyper-
                             params, so it records the final values
CSVLogger,              55   after the Recorder: write each epoch's final
TextLogger,                  values and the lr each step used
TensorBoardLogger,
MLflowLogger
ProgressBar,            60   after Recorder: shows what the epoch ended with;
SweepBar                     after the LRFinder (10): sees its stop
====================  =====  ================================================
"""

from fitlib.callbacks.accumulation import GradientAccumulation
from fitlib.callbacks.channels_last import ChannelsLast
from fitlib.callbacks.checkpoint import Checkpoint
from fitlib.callbacks.clipping import GradientClipping
from fitlib.callbacks.compile import Compile
from fitlib.callbacks.csv_logger import CSVLogger
from fitlib.callbacks.distributed_trainer import DistributedTrainer
from fitlib.callbacks.early_stopping import EarlyStopping
from fitlib.callbacks.filters import every, first, once
from fitlib.callbacks.gan_trainer import GANTrainer
from fitlib.callbacks.lr_finder import LRFinder, SuggestedLRs
from fitlib.callbacks.mixed_precision import MixedPrecision
from fitlib.callbacks.mlflow_logger import MLflowLogger
from fitlib.callbacks.one_cycle import OneCycleScheduler
from fitlib.callbacks.plateau import ReduceLROnPlateau
from fitlib.callbacks.progress import ProgressBar, SweepBar
from fitlib.callbacks.recorder import Recorder
from fitlib.callbacks.schedule import (
    ParamScheduler,
    constant,
    cosine,
    exponential,
    linear,
)
from fitlib.callbacks.tensorboard import TensorBoardLogger
from fitlib.callbacks.terminate_on_nan import TerminateOnNaN
from fitlib.callbacks.text_logger import TextLogger
from fitlib.callbacks.train_stats import TrainStats
from fitlib.callbacks.validation import ValidationSchedule

__all__ = [
    "CSVLogger",
    "ChannelsLast",
    "Checkpoint",
    "Compile",
    "DistributedTrainer",
    "EarlyStopping",
    "GANTrainer",
    "GradientAccumulation",
    "GradientClipping",
    "LRFinder",
    "MLflowLogger",
    "MixedPrecision",
    "OneCycleScheduler",
    "ParamScheduler",
    "ProgressBar",
    "Recorder",
    "ReduceLROnPlateau",
    "SuggestedLRs",
    "SweepBar",
    "TensorBoardLogger",
    "TerminateOnNaN",
    "TextLogger",
    "TrainStats",
    "ValidationSchedule",
    "constant",
    "cosine",
    "every",
    "exponential",
    "first",
    "linear",
    "once",
]
