"""The command line the examples share: their arguments and their result line.

Every example has ``main(epochs, batch_size, n, progress, seed)`` that trains
and returns its ``Learner``; ``python examples/<name>.py --help`` lists the
arguments, with the example's own defaults.

``--threads`` (default 1) sets torch's CPU threads before training: the
figures of the examples page (docs/examples.md) are at one thread, and the
same seed gives other numbers with another thread count (a sum split over more
threads rounds differently, and training carries the difference on).
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from typing import Any

import torch


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
    parser.add_argument(
        "--threads",
        type=positive,
        default=1,
        help="torch CPU threads (default: 1, as docs/examples.md's figures were run; "
        "another count gives other numbers)",
    )
    for name, default in defaults.items():  # an example's own switches
        if isinstance(default, bool) and name != "progress":
            flag = "--" + name.replace("_", "-")
            parser.add_argument(flag, action="store_true", help=f"{name} (off)")
    parsed = vars(parser.parse_args())
    torch.set_num_threads(parsed.pop("threads"))
    return parsed


def result_line(name: str, learn: Any, metric: str) -> str:
    """The losses of the first and the last epoch, the last value of
    ``metric``, the seconds the fit's epochs took (the Recorder's) and the
    number of torch threads (the figures depend on it)."""
    table = learn.recorder.epoch_table()
    first, last = table[0], table[-1]
    threads = torch.get_num_threads()
    return (
        f"{name}: train_loss {first['train_loss']:.4f} -> {last['train_loss']:.4f}, "
        f"valid_loss {first['valid_loss']:.4f} -> {last['valid_loss']:.4f}, "
        f"{metric} {last[metric]:.4f}, {sum(learn.recorder.times):.1f} seconds "
        f"on {threads} thread{'s' if threads > 1 else ''}"
    )
