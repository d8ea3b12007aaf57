"""``fitlib.host_copy``: device values read on the host, in one transfer or
without waiting. On a GPU: ``tests/integration/test_cuda.py``."""

import pytest
import torch

from fitlib.host_copy import HostCopy, to_floats


def test_to_floats_reads_scalars_then_extra_values_in_one_transfer(monkeypatch):
    calls = []
    tolist = torch.Tensor.tolist

    def counted(self):
        calls.append(1)
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    scalars = [torch.tensor(1.5), torch.tensor(2, dtype=torch.int64)]
    extra = [3, torch.tensor(0.25, dtype=torch.float16)]
    assert to_floats(scalars, extra) == [1.5, 2.0, 3.0, 0.25]
    assert calls == [1]


def test_to_floats_of_nothing_reads_nothing():
    assert to_floats([]) == []
    assert to_floats([], [1.0]) == [1.0]


def test_a_host_copy_on_the_cpu_is_ready_at_once_with_the_values_as_floats():
    copy = HostCopy([torch.tensor(2.5), torch.tensor([[4]])])
    assert copy.ready()
    assert copy.get() == [2.5, 4.0]
    assert all(type(v) is float for v in copy.get())


def test_a_host_copy_detaches_what_it_copies():
    w = torch.tensor(3.0, requires_grad=True)
    assert HostCopy([w * 2]).get() == [pytest.approx(6.0)]
