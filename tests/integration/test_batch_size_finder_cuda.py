"""find_batch_size on a GPU: real out-of-memory errors caught and the memory
emptied, and CUDA's allocator peak against a budget. Skipped without CUDA;
tests/test_batch_size_finder.py covers the search's logic on the CPU (with a
fake out-of-memory error)."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

from fitlib import DataBunch, HPOptimizer, find_batch_size

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CAP = 2**14


def wide_regression(width: int):
    """A regression whose activations take ``width`` floats per sample in
    each of two layers, on CUDA, with SGD; a loader of CAP samples."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, width), nn.ReLU(), nn.Linear(width, 1)).cuda()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=1e-3, mom=0.9)
    ds = TensorDataset(torch.randn(CAP, 1), torch.randn(CAP, 1))
    return model, opt, DataBunch(DataLoader(ds, 64, shuffle=True), device="cuda")


def test_grows_until_cuda_runs_out_of_memory_or_the_cap_and_puts_all_back(capsys):
    # 2**20 floats (4 MB) per sample and layer: 2**14 samples need >100 GB.
    model, opt, data = wide_regression(2**20)
    weights = [p.detach().cpu().clone() for p in model.parameters()]
    model(torch.randn(2, 1, device="cuda")).sum().backward()  # cuBLAS workspaces
    model.zero_grad(set_to_none=True)
    allocated = torch.cuda.memory_allocated()
    found = find_batch_size(model, F.mse_loss, opt, data, max_batch_size=CAP)
    line = capsys.readouterr().out
    ends = {f"max_batch_size={CAP}", "the first failure (power mode)"}
    assert found.stopped_by in ends, f"stopped by {found.stopped_by!r}: {line}"
    assert f"stopped by {found.stopped_by}" in line, line
    failure = found.first_failure
    if failure is not None:  # the message says which limit ended it
        assert failure.why == "out of memory", line
        assert f"first failure: {failure.size} (out of memory)" in line, line
    assert found.verified.fit and found.batch_size == found.verified.size, line
    peaks = [t.peak for t in found.trials if t.fit]
    assert peaks == sorted(peaks), f"allocator peaks not growing: {peaks}"
    assert torch.cuda.memory_allocated() <= allocated + 2**26, (  # 64 MiB
        f"{torch.cuda.memory_allocated() - allocated} bytes still held after: {line}"
    )
    now = [p.detach().cpu() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(weights, now)), "weights changed"
    assert all(p.grad is None for p in model.parameters()), "gradients left"
    assert data.train_dl.batch_size == 64


def test_a_budget_on_cuda_is_compared_with_the_allocators_peak():
    # 2**16 floats (256 kB) per sample and layer: about 1 MB a sample.
    model, opt, data = wide_regression(2**16)
    found = find_batch_size(model, F.mse_loss, opt, data, max_memory="500MB",
                            mode="binsearch", verbose=False)  # fmt: skip
    failure = found.first_failure
    assert failure is not None, f"nothing failed: {found}"
    assert failure.why.startswith("over the 500 MB budget: peak "), str(found)
    assert failure.peak > 500e6 >= found.verified.peak, str(found)
    assert found.stopped_by.startswith("the binary search"), str(found)


def test_extra_memory_is_allocated_on_cuda_through_the_search_then_freed():
    # The same search with 100 MB held besides the steps: each trial's
    # allocator peak is 100 MB higher (to the allocator's rounding), so a
    # budget 50 MB above the plain search's peak takes a smaller batch; after
    # it, the 100 MB is freed.
    model, opt, data = wide_regression(2**16)  # about 1 MB a sample
    plain = find_batch_size(model, F.mse_loss, opt, data, max_batch_size=64,
                            verbose=False)  # fmt: skip
    assert plain.batch_size == 64, str(plain)
    budget = plain.verified.peak + 50 * 10**6
    allocated = torch.cuda.memory_allocated()
    extra = find_batch_size(model, F.mse_loss, opt, data, max_memory=budget,
                            max_batch_size=64, extra_memory="100MB",
                            verbose=False)  # fmt: skip
    gaps = [b.peak - a.peak for a, b in zip(plain.trials, extra.trials)]
    assert all(abs(g - 10**8) <= 2**20 for g in gaps), f"peak gaps {gaps}: {extra}"
    assert extra.batch_size < 64, f"{plain} / {extra}"
    assert torch.cuda.memory_allocated() <= allocated + 2**20, (
        f"{torch.cuda.memory_allocated() - allocated} bytes still held after"
    )
