"""WeightAverage's arithmetic, the in-place swap, the parts and buffers
chosen, and the BatchNorm statistics recomputed, against torch.optim.swa_utils."""

import pytest
import torch
from helpers import make_data, make_model
from torch import nn
from torch.optim.swa_utils import update_bn

from fitlib.weight_averaging import (
    WeightAverage,
    average_of,
    check_choice,
    chosen_modules,
    recompute_batch_norm,
    tracked_tensors,
)


def test_first_update_copies_then_lerps_by_the_weight():
    w = torch.zeros(3)
    avg = WeightAverage([w])
    w += 4.0
    avg.update(0.25)  # the first update copies, whatever the weight
    assert torch.equal(avg.averages[0], torch.full((3,), 4.0))
    w += 4.0
    avg.update(0.25)
    assert torch.equal(avg.averages[0], torch.full((3,), 5.0))
    assert avg.updates == 2


def test_averages_are_float32_for_bf16_parameters_and_keep_precision():
    w = torch.zeros(4, dtype=torch.bfloat16)
    avg = WeightAverage([w])
    assert avg.averages[0].dtype == torch.float32
    avg.update(1.0)
    for _ in range(10):
        w.fill_(1.0)
        avg.update(0.001)  # steps a bf16 average could not take (1e-3 < eps)
    expected = 1 - 0.999**10
    assert avg.averages[0][0].item() == pytest.approx(expected, rel=1e-5)


def test_swap_in_and_out_restores_the_live_values_bit_for_bit():
    model = make_model()
    live = [t.clone() for t in model.state_dict().values()]
    avg = average_of(model, None, "average", "EMA")
    avg.update(1.0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) / 3)  # live moves away from the average
    moved = [t.clone() for t in model.state_dict().values()]
    with avg.averaged():
        inside = [t.clone() for t in model.state_dict().values()]
        assert avg.swapped
    after = list(model.state_dict().values())
    assert all(torch.equal(a, b) for a, b in zip(inside, live, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(after, moved, strict=True))
    assert not avg.swapped


def test_swap_before_any_update_changes_nothing():
    model = make_model()
    avg = average_of(model, None, "average", "EMA")
    avg.swap_in()
    assert not avg.swapped


def test_buffers_copy_follows_parameters_only():
    model = make_model()
    params = len(list(model.parameters()))
    assert len(tracked_tensors([model], "copy")) == params
    # BatchNorm1d: running_mean, running_var, num_batches_tracked
    assert len(tracked_tensors([model], "average")) == params + 3


def test_integer_buffers_are_copied_not_averaged():
    model = make_model()
    avg = average_of(model, None, "average", "EMA")
    avg.update(1.0)
    model[1].num_batches_tracked += 7
    avg.update(0.5)
    counts = [a for a in avg.averages if not a.is_floating_point()]
    assert [int(c) for c in counts] == [7]


def test_parts_choose_submodules_and_an_unknown_one_is_refused():
    model = nn.Sequential()
    model.add_module("encoder", nn.Linear(2, 2))
    model.add_module("decoder", nn.Linear(2, 2))
    assert chosen_modules(model, ["decoder"], "EMA") == [model.decoder]
    with pytest.raises(
        ValueError, match=r"unknown part 'decodr' .*did you mean 'decoder'"
    ):
        chosen_modules(model, ["decodr"], "EMA")
    with pytest.raises(TypeError, match="parts must be a non-empty list"):
        chosen_modules(model, "decoder", "EMA")


def test_check_choice_names_the_owner_and_the_choices():
    assert check_choice("EMA", "final", "live", ("ema", "live")) == "live"
    with pytest.raises(ValueError, match=r"EMA: unknown final value 'lve'.*'live'"):
        check_choice("EMA", "final", "lve", ("ema", "live"))


def test_load_refuses_an_average_of_another_model():
    avg = average_of(make_model(), None, "copy", "EMA")
    other = average_of(nn.Linear(8, 3), None, "copy", "EMA")
    with pytest.raises(ValueError, match="saved for another model"):
        avg.load_state_dict(other.state_dict())


def test_recompute_batch_norm_matches_update_bn_and_leaves_rng_and_modes():
    data = make_data(shuffle=True)
    ours, ref = make_model(), make_model()
    ours.eval()
    momenta = [m.momentum for m in ours.modules() if isinstance(m, nn.BatchNorm1d)]
    rng = torch.get_rng_state()
    seen = recompute_batch_norm(ours, data.train_dl)
    assert seen == len(data.train_dl)
    assert torch.equal(torch.get_rng_state(), rng)
    assert not ours.training and not ours[1].training
    assert [
        m.momentum for m in ours.modules() if isinstance(m, nn.BatchNorm1d)
    ] == momenta
    update_bn(data.train_dl, ref)
    assert torch.allclose(ours[1].running_mean, ref[1].running_mean, atol=1e-6)
    assert torch.allclose(ours[1].running_var, ref[1].running_var, atol=1e-6)


def test_recompute_batch_norm_without_batch_norm_does_nothing():
    model = nn.Linear(8, 3)
    assert recompute_batch_norm(model, make_data().train_dl) == 0


def test_bf16_update_casts_one_tensor_at_a_time(monkeypatch):
    import weakref

    params = [torch.zeros(50, dtype=torch.bfloat16) for _ in range(6)]
    avg = WeightAverage(params)
    avg.update(1.0)
    alive, most = [0], [0]
    plain_float = torch.Tensor.float

    def counted_float(t, *args, **kwargs):
        out = plain_float(t, *args, **kwargs)
        alive[0] += 1
        most[0] = max(most[0], alive[0])
        weakref.finalize(out, lambda: alive.__setitem__(0, alive[0] - 1))
        return out

    monkeypatch.setattr(torch.Tensor, "float", counted_float)
    for p in params:
        p.fill_(1.0)
    avg.update(0.5)
    monkeypatch.undo()
    assert most[0] == 1  # one float32 temporary at a time, not six
    assert all(torch.equal(a, torch.full((50,), 0.5)) for a in avg.averages)
