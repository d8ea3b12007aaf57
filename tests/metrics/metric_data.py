"""Data and a driver shared by the metrics tests."""

import torch

from fitlib.metrics import Metrics

SIZES = [7, 7, 3]  # ragged last batch on purpose


def run(metrics, out, y, sizes=SIZES):
    """Feed `out`, `y` through a Metrics in batches; return the values as floats."""
    ms = metrics if isinstance(metrics, Metrics) else Metrics(metrics)
    ms.reset()
    for o, t in zip(out.split(sizes), y.split(sizes), strict=True):
        ms.update(o, (t,))
    return [v.item() for v in ms.compute()]


def multiclass(gen, n=17, c=4):
    return torch.randn(n, c, generator=gen), torch.randint(0, c, (n,), generator=gen)


def regression(gen, n=17, d=None):
    shape = (n,) if d is None else (n, d)
    y = torch.randn(shape, generator=gen)
    return y + 0.5 * torch.randn(shape, generator=gen), y
