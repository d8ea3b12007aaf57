"""Fixtures for the test suite; the builders live in helpers.py."""

import os
import socket
import time

import matplotlib
import pytest
import torch
import torch.distributed as dist
from helpers import make_data, make_model

matplotlib.use("Agg")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs the suite on one worker process per core (pytest-xdist
    # -n auto; two on the CI machine): torch on one thread in each (and in
    # every process a test starts: notebook kernels, torchrun), as several
    # processes of several threads each would spin and wait on each other.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption(
        "--store-outputs",
        action="store_true",
        help="tests/integration/test_notebooks.py writes each executed notebook "
        "back, with its outputs (`make notebooks`)",
    )


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module's tests: small models train faster,
    and stay fast when other processes share the cores (torch's threads spin
    and wait on each other there). The setting is put back afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def data():
    return make_data()


@pytest.fixture
def model():
    return make_model()


@pytest.fixture
def one_process_group(monkeypatch):
    """The environment torchrun sets, for a world of one process (gloo)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


# Tensor methods that make the host wait for a GPU. ``nonzero``'s output size
# depends on the data, so it syncs too.
SYNCING = ["item", "__float__", "__int__", "__bool__", "tolist", "cpu", "numpy"]
SYNCING += ["nonzero"]


@pytest.fixture
def sync_counter(monkeypatch):
    """Counts the calls that would sync with a GPU: ``counts["n"]``.

    On a CPU there is no device to wait for, so the Python calls that would
    force a sync are counted; ``.to()`` counts only copies from a device to
    the host (GradScaler and fused optimizers move tensors to the device they
    are already on).
    """
    counts = {"n": 0}
    for name in SYNCING:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            counts["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    original_to = torch.Tensor.to

    def counted_to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        to_host = target is not None and str(target).startswith("cpu")
        counts["n"] += to_host and self.device.type != "cpu"
        return original_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counted_to)
    return counts


@pytest.fixture
def frozen_clock(monkeypatch):
    """``time.perf_counter`` stops: paced refreshes and checks happen once."""
    monkeypatch.setattr(time, "perf_counter", lambda: 1000.0)
