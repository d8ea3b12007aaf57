"""fitlib: train PyTorch models with one small loop; everything else is a callback."""

from fitlib import metrics, sequences
from fitlib.batch_size_finder import BatchSizeResult, find_batch_size
from fitlib.callback import Callback
from fitlib.callback_handler import CallbackHandler
from fitlib.core import fit, fit_states, loss_batch, validate
from fitlib.core import iter_fit as iter_fit  # deprecated: the former fit_states
from fitlib.data import DataBunch
from fitlib.gan import GANLoss, GANModule, GANOutput
from fitlib.history import History
from fitlib.interpret import ClassificationInterpretation
from fitlib.label_smoothing import label_smoothed
from fitlib.learner import Learner
from fitlib.losses import LossDict
from fitlib.multi_optimizer import MultiOptimizer
from fitlib.optim import HPOptimizer
from fitlib.summary import Summary, summarize
from fitlib.version import __version__ as __version__

__all__ = [
    "BatchSizeResult",
    "Callback",
    "CallbackHandler",
    "ClassificationInterpretation",
    "DataBunch",
    "GANLoss",
    "GANModule",
    "GANOutput",
    "HPOptimizer",
    "History",
    "Learner",
    "LossDict",
    "MultiOptimizer",
    "Summary",
    "find_batch_size",
    "fit",
    "fit_states",
    "label_smoothed",
    "loss_batch",
    "metrics",
    "sequences",
    "summarize",
    "validate",
]
