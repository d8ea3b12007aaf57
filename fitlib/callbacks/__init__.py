"""Built-in callbacks, one feature per module.

Order of the built-in callbacks (lower runs first within an event):

==============  =====  ======================================================
callback        order  why there
==============  =====  ======================================================
Recorder          50   after callbacks that change the loss or hyper-params,
                       so it records the final values
ProgressBar       60   after Recorder: shows what the epoch ended with
==============  =====  ======================================================
"""

from fitlib.callbacks.progress import ProgressBar
from fitlib.callbacks.recorder import Recorder

__all__ = ["ProgressBar", "Recorder"]
