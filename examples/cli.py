"""The command line the examples share: their arguments and their result line.

Every example has ``main(epochs, batch_size, n, progress, seed)`` that trains
and returns its ``Learner``; ``python examples/<name>.py --help`` lists the
arguments, with the example's own defaults.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from typing import Any


def positive(text: str) -> int:
    """An int >= 1, or argparse's usage error."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text}")
    return value


def args(main: Callable[..., Any], doc: str) -> dict[str, Any]:
    """``main``'s keyword arguments from the command line."""
    defaults = {k: p.default for k, p in inspect.signature(main).parameters.items()}
    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    epochs, bs = defaults["epochs"], defaults["batch_size"]
    parser.add_argument(
        "--epochs",
        type=positive,
        default=epochs,
        help=f"epochs (default: {epochs or 'see the description'})",
    )
    parser.add_argument(
        "--batch-size", type=positive, default=bs, help=f"batch size (default: {bs})"
    )
    parser.add_argument(
        "--n",
        type=positive,
        default=None,
        help="number of samples (default: the example's)",
    )
    seed = defaults["seed"]
    parser.add_argument(
        "--seed",
        type=int,
        default=seed,
        help=f"seeds data, weights, order (default: {seed})",
    )
    for name, default in defaults.items():  # an example's own switches
        if isinstance(default, bool) and name != "progress":
            flag = "--" + name.replace("_", "-")
            parser.add_argument(flag, action="store_true", help=f"{name} (off)")
    return vars(parser.parse_args())


def result_line(name: str, learn: Any, metric: str) -> str:
    """The losses of the first and the last epoch, the last value of
    ``metric``, and the seconds the fit's epochs took (the Recorder's)."""
    table = learn.recorder.epoch_table()
    first, last = table[0], table[-1]
    return (
        f"{name}: train_loss {first['train_loss']:.4f} -> {last['train_loss']:.4f}, "
        f"valid_loss {first['valid_loss']:.4f} -> {last['valid_loss']:.4f}, "
        f"{metric} {last[metric]:.4f}, {sum(learn.recorder.times):.1f} seconds"
    )
