"""CUDA paths; skipped cleanly on machines without a GPU (CI has none).

The CPU suite covers the logic; these check what only a GPU can show: that
batches and the model land on the device and that a whole ``Learner.fit``
adds no CUDA synchronization per batch (PyTorch's sync debug mode counts them).
"""

import time
import warnings

import pytest
import torch
from helpers import make_dataset, make_model
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

from fitlib import DataBunch, Learner
from fitlib.metrics import F1Score, accuracy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cuda_syncs_during_fit(n_train: int) -> tuple[int, Learner]:
    loaders = [
        DataLoader(make_dataset(n, seed=s), 16, shuffle=s == 0, pin_memory=True)
        for n, s in ((n_train, 0), (n_train // 2, 1))
    ]
    learn = Learner(DataBunch(*loaders, device="cuda"), make_model(), F.cross_entropy,
                    metrics=[accuracy, F1Score()])  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            learn.fit(2, lr=1e-2)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return syncs, learn


def test_fit_on_cuda_adds_no_sync_per_batch(monkeypatch):
    monkeypatch.setattr(time, "perf_counter", lambda: 1000.0)  # no paced refresh
    few, learn = cuda_syncs_during_fit(64)
    many, _ = cuda_syncs_during_fit(256)
    assert next(learn.model.parameters()).device.type == "cuda"
    assert few > 0  # the instrument works: epoch ends do read values
    assert few == many


def test_predictions_come_back_to_the_cpu(tmp_path):
    _, learn = cuda_syncs_during_fit(32)
    preds, targets = learn.get_preds()
    assert preds.device.type == "cpu" and targets.device.type == "cpu"
    learn.path = tmp_path
    learn.save("gpu")
    reloaded = learn.load("gpu").get_preds()[0]
    assert torch.equal(reloaded, preds)
