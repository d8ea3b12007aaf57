"""``fitlib.grad_scaling``: a ``GradScaler``'s overflow read on the device
(``found_inf``), and several optimizers that skip a step together when any
of them overflowed (``unscale_all``)."""

import pytest
import torch
from torch import nn

from fitlib.grad_scaling import found_inf, unscale_all


def scaled_step(inf_in=None):
    """Two models with an optimizer each, their losses scaled and backpropagated;
    ``inf_in`` (0 or 1) gets a gradient that is not finite."""
    torch.manual_seed(0)
    models = [nn.Linear(2, 1), nn.Linear(2, 1)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    for model in models:
        scaler.scale(model(torch.ones(3, 2)).sum()).backward()
    if inf_in is not None:
        models[inf_in].weight.grad[0, 0] = float("inf")
    return models, opts, scaler


def test_found_inf_is_0_before_an_unscale_and_says_what_it_found():
    _, opts, scaler = scaled_step(inf_in=1)
    assert found_inf(scaler, opts[0]) == 0  # nothing checked yet
    for opt in opts:
        scaler.unscale_(opt)
    assert found_inf(scaler, opts[0]).item() == 0
    assert found_inf(scaler, opts[1]).item() == 1


@pytest.mark.parametrize("inf_in", [0, 1])
def test_an_overflow_in_one_optimizer_skips_every_ones_step(inf_in):
    models, opts, scaler = scaled_step(inf_in)
    before = [m.weight.detach().clone() for m in models]
    assert unscale_all(scaler, opts).item() == 1
    assert [found_inf(scaler, o).item() for o in opts] == [1, 1]
    for opt in opts:
        scaler.step(opt)
    scaler.update()
    assert all(torch.equal(b, m.weight) for b, m in zip(before, models))
    assert scaler.get_scale() == 2.0  # the overflow halved the scale


def test_without_an_overflow_every_optimizer_steps():
    models, opts, scaler = scaled_step()
    before = [m.weight.detach().clone() for m in models]
    assert unscale_all(scaler, opts).item() == 0
    for opt in opts:
        scaler.step(opt)
    assert not any(torch.equal(b, m.weight) for b, m in zip(before, models))


def test_one_optimizer_alone_reads_its_own_overflow():
    _, opts, scaler = scaled_step(inf_in=0)
    assert unscale_all(scaler, opts[:1]).item() == 1
    assert found_inf(scaler, opts[1]) == 0  # the other was not unscaled
