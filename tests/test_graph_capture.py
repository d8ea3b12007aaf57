"""What CudaGraph checks and changes for a fit, on the CPU: the optimizer
made capturable and put back (also after a resume), checkpoints holding the
eager optimizer's state, and what differs from a capture. The refusals
through a fit are in tests/callbacks/test_cuda_graph.py."""

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from fitlib import HPOptimizer
from fitlib.graph_capture import changed, eager_state, make_capturable, trains


def stepped_adamw(**kwargs):
    model = nn.Linear(4, 2)
    opt = HPOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, **kwargs)
    F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,))).backward()
    opt.step()  # (its state: step counters)
    return model, opt


def test_a_checkpoint_written_during_the_fit_holds_the_eager_optimizer_state():
    _, opt = stepped_adamw()
    undo = make_capturable(opt)  # as CudaGraph.on_train_begin
    assert opt.param_groups[0]["capturable"] is True  # live: captured steps
    saved = opt.state_dict()  # as Checkpoint during the fit
    assert saved["opt"]["param_groups"][0]["capturable"] is False
    live = opt.opt.state[opt.param_groups[0]["params"][0]]
    assert all(
        isinstance(s["step"], torch.Tensor) for s in saved["opt"]["state"].values()
    )
    for u in reversed(undo):
        u()
    assert opt.opt.state[opt.param_groups[0]["params"][0]] is live
    assert opt.opt._optimizer_state_dict_post_hooks == {}  # the hook goes with the fit
    # an eager fit (here the CPU) loads it and steps, no capturable error
    model2, opt2 = stepped_adamw()
    opt2.load_state_dict(saved)
    F.cross_entropy(model2(torch.randn(8, 4)), torch.randint(0, 2, (8,))).backward()
    opt2.step()


def test_a_resumed_fit_puts_capturable_back_to_the_optimizers_default():
    _, opt = stepped_adamw()
    saved = opt.state_dict()
    saved["opt"]["param_groups"][0]["capturable"] = True  # an older checkpoint's
    _, resumed = stepped_adamw()
    resumed.load_state_dict(saved)  # Checkpoint.on_train_begin
    undo = make_capturable(resumed)  # CudaGraph.on_train_begin, after it
    assert resumed.state_dict()["opt"]["param_groups"][0]["capturable"] is False
    for u in reversed(undo):
        u()
    assert resumed.param_groups[0]["capturable"] is False
    step = next(iter(resumed.opt.state.values()))["step"]
    assert step.device.type == "cpu" and step.dtype == torch.float32


def test_the_eager_state_hook_writes_plain_groups_and_leaves_the_live_state():
    # a device's counter stands in as a float64 one: what differs from an
    # eager counter (a CPU float32 tensor) is copied, in a new dict
    live = {"step": torch.tensor(3.0, dtype=torch.float64), "exp_avg": torch.zeros(2)}
    fused = {"step": torch.tensor(3.0, dtype=torch.float64)}
    groups = [{"params": [0], "capturable": True},
              {"params": [1], "capturable": True, "fused": True}]  # fmt: skip
    saved = {"state": {0: live, 1: fused}, "param_groups": groups}
    out = eager_state(None, saved, groups=(0, 1))
    assert [g["capturable"] for g in out["param_groups"]] == [False, False]
    step = out["state"][0]["step"]
    assert step.device.type == "cpu" and step.dtype == torch.float32 and step == 3
    assert out["state"][0]["exp_avg"] is live["exp_avg"]
    assert live["step"].dtype == torch.float64  # the live state: as it was
    assert out["state"][1] is fused  # fused: torch keeps its counter where it is


def test_what_changed_since_the_capture_is_named():
    model, opt = nn.Linear(8, 3), object()
    captured, flags = (model, F.cross_entropy, opt), trains(model)
    assert changed(captured, flags, model, F.cross_entropy, opt) == []
    assert changed(captured, flags, nn.Linear(8, 3), F.cross_entropy, opt) == [
        "the model"]  # fmt: skip
    assert changed(captured, flags, model, F.mse_loss, object()) == [
        "the loss function", "the optimizer"]  # fmt: skip
    model.bias.requires_grad_(False)
    assert changed(captured, flags, model, F.cross_entropy, opt) == [
        "which parameters train (requires_grad: a freeze or unfreeze)"]  # fmt: skip
