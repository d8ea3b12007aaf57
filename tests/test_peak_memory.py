import pytest
import torch
from helpers import make_model
from torch import nn
from torch.nn import functional as F  # noqa: N812

from fitlib.peak_memory import (
    OverBudget,
    PeakMemory,
    TensorBytes,
    format_bytes,
    held_tensors,
    is_out_of_memory,
    parse_bytes,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # small models: faster


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2GB", 2 * 10**9),
        ("1.5 GiB", 3 * 2**29),
        ("512mb", 512 * 10**6),
        ("800 kB", 800_000),
        ("64", 64),
        (4096, 4096),
        (1e9, 10**9),
    ],
)
def test_reads_sizes_of_memory_in_decimal_and_binary_units(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize("value", ["lots", "2 parsecs", "", 0, -5, "0GB", 1.5])
def test_refuses_what_is_no_size_of_memory_with_the_fix(value):
    with pytest.raises(ValueError, match=r"max_memory must be a size of memory.*'2GB'"):
        parse_bytes(value, owner="find_batch_size")


def test_refuses_a_size_of_another_type_as_a_type_error():
    with pytest.raises(TypeError, match=r"got None \(NoneType\)"):
        parse_bytes(None)


def test_formats_bytes_in_the_largest_decimal_unit():
    assert format_bytes(59_744) == "59.74 kB"
    assert format_bytes(2 * 10**9) == "2 GB"
    assert format_bytes(999) == "999 B"


def test_counts_a_tensor_until_it_is_freed_and_keeps_the_peak():
    with TensorBytes() as held:
        a = torch.empty(1000)  # 4000 bytes
        del a
        b = torch.empty(500)  # 2000 bytes, after a was freed
    assert (held.peak, held.held) == (4000, 2000)
    del b
    assert held.held == 0


def test_counts_a_storage_once_however_many_views_share_it():
    with TensorBytes() as held:
        a = torch.zeros(100, 10)
        views = [a[i] for i in range(100)] + [a.t(), a.view(-1)]
    assert held.peak == 4000 and len(views) == 102


def test_starts_from_the_tensors_it_is_given():
    model = make_model()
    sizes = sum(p.numel() * 4 for p in model.parameters())
    assert TensorBytes(model.parameters()).start == sizes


def test_counts_the_backward_pass_and_grows_with_the_batch():
    model = make_model()

    def peak(n: int, backward: bool) -> int:
        x, y = torch.randn(n, 8), torch.zeros(n, dtype=torch.long)
        with TensorBytes(model.parameters()) as held:
            loss = F.cross_entropy(model(x), y)
            if backward:
                loss.backward()
        model.zero_grad(set_to_none=True)
        return held.peak

    assert peak(64, backward=True) > peak(64, backward=False)
    assert peak(32, True) < peak(64, True) < peak(128, True)
    assert peak(64, True) == peak(64, True)  # the same on every run


def test_stops_a_step_as_soon_as_it_passes_the_limit():
    model = nn.Linear(100, 100)
    x, limit = torch.randn(1000, 100), TensorBytes(model.parameters(), limit=50_000)
    with pytest.raises(OverBudget, match="over the budget of 50 kB") as caught, limit:
        model(x).sum().backward()
    assert 50_000 < caught.value.held < 50_000 + 1000 * 100 * 4 + 1


def test_held_tensors_include_the_gradients_and_the_optimizer_state():
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    tensors = held_tensors(model, opt)
    assert any(t is model.weight.grad for t in tensors)
    exp_avg = opt.state[model.weight]["exp_avg"]
    assert any(t.untyped_storage() is exp_avg.untyped_storage() for t in tensors)


def test_peak_memory_on_the_cpu_counts_tensors_and_applies_the_limit():
    weights = torch.zeros(10)
    with PeakMemory("cpu", [weights]) as meter:
        torch.empty(100)
    assert meter.peak == 40 + 400
    with pytest.raises(OverBudget), PeakMemory("cpu", limit=100):
        torch.empty(100)


def test_tells_out_of_memory_errors_from_others():
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory."))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED"))
    assert is_out_of_memory(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED."))
    assert is_out_of_memory(
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried")
    )
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be"))
    assert not is_out_of_memory(ValueError("out of memory"))


def test_a_view_of_a_storage_made_before_counting_adds_nothing():
    """A TensorDataset's item is a view of the whole data set's storage: it
    holds no new memory, so it counts 0; a copy of it counts its own bytes."""
    data_set = torch.randn(1000, 10)
    with TensorBytes() as held:
        row, rows = data_set[3], data_set[:5].reshape(50)
        assert held.held == held.peak == 0
        copy = row.clone()
        assert held.held == copy.untyped_storage().nbytes() == 40
    del row, rows


def test_refuses_a_bool_as_a_type_error_naming_the_argument():
    with pytest.raises(TypeError, match=r"^find_batch_size: max_memory must be a "
                       r"size of memory.*got True \(bool\)"):  # fmt: skip
        parse_bytes(True, owner="find_batch_size")


def test_the_fix_reads_the_argument_alone_whoever_called():
    with pytest.raises(ValueError, match=r"Fix: e\.g\. max_memory='2GB'\.$"):
        parse_bytes("lots", owner="Learner.find_batch_size")
