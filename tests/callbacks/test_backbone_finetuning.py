"""``BackboneFinetuning``: the backbone frozen until an epoch, then ramped up
(Lightning's ``BackboneFinetuning`` / ``BaseFinetuning`` cases, in fitlib's
terms)."""

from collections import OrderedDict
from functools import partial

import pytest
import torch
import torchvision
from helpers import Crash, make_data
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

from fitlib import Callback, DataBunch, Learner
from fitlib.callbacks import (
    BackboneFinetuning,
    Checkpoint,
    GradientAccumulation,
    ReduceLROnPlateau,
    every,
)
from fitlib.callbacks.backbone_finetuning import set_trainable

SGD_MOM = partial(torch.optim.SGD, momentum=0.9)


class Probe(Callback):
    """Each epoch's first-step lr per group, and its end's weights and
    ``requires_grad`` of the backbone's first weight."""

    order = 20  # after BackboneFinetuning set the epoch's factor

    def __init__(self, learn_model):
        self.model = learn_model
        self.lrs, self.weights, self.trainable = [], [], []

    def on_epoch_begin(self, opt):
        self.lrs.append(opt.get("lr"))

    def on_epoch_end(self):
        self.weights.append([p.detach().clone() for p in self.model.parameters()])
        self.trainable.append(self.model[0][0].weight.requires_grad)


def learner(callbacks=(), opt_func=SGD_MOM, **kwargs):
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU())
    model = nn.Sequential(body, nn.Linear(16, 3))
    return Learner(make_data(), model, F.cross_entropy, opt_func=opt_func,
                   metrics=[], progress=False, layer_groups=[body, model[1]],
                   callbacks=list(callbacks), **kwargs)  # fmt: skip


def test_ratio_ramps_from_the_unfreeze_epoch_and_aligns_at_one():
    ramp = BackboneFinetuning(3, initial_ratio=0.1, multiplier=1.5)
    ratios = [ramp.ratio(e) for e in range(10)]
    assert ratios[:3] == [1.0, 1.0, 1.0]  # frozen: the factor does not apply
    assert ratios[3:7] == pytest.approx([0.1, 0.15, 0.225, 0.3375])
    assert ratios[-1] == 1.0 and all(r <= 1.0 for r in ratios)
    unaligned = BackboneFinetuning(3, initial_ratio=0.5, multiplier=2.0, align=False)
    assert unaligned.ratio(6) == 4.0


def test_frozen_until_the_epoch_then_ramped_below_the_heads_rate_until_aligned():
    learn = learner()
    probe = Probe(learn.model)
    learn.fit(8, lr=0.1, callbacks=[BackboneFinetuning(3), probe])
    assert probe.trainable == [False] * 3 + [True] * 5
    backbone = [lrs[0] for lrs in probe.lrs]
    assert backbone[:3] == [0.1] * 3  # (only its norm layers train: train_bn)
    assert backbone[3:] == pytest.approx([0.01, 0.015, 0.0225, 0.03375, 0.050625])
    assert all(lrs[1] == 0.1 for lrs in probe.lrs)  # the head's, untouched


@pytest.mark.parametrize("opt_func", [SGD_MOM, torch.optim.AdamW])
def test_a_frozen_backbone_does_not_move_with_momentum_and_weight_decay(opt_func):
    learn = learner(opt_func=opt_func, wd=0.1, train_bn=False)
    probe = Probe(learn.model)
    before = [p.detach().clone() for p in learn.model.parameters()]
    ramp = BackboneFinetuning(2, train_bn=False)
    learn.fit(3, lr=0.1, callbacks=[ramp, probe])
    body = len(list(learn.model[0].parameters()))  # linear weight, bn weight+bias
    for epoch in (0, 1):
        assert all(map(torch.equal, probe.weights[epoch][:body], before[:body]))
        assert not torch.equal(probe.weights[epoch][body], before[body])  # head
    assert not any(map(torch.equal, probe.weights[2][:body], before[:body]))


def test_train_bn_keeps_norm_layers_trainable_while_frozen():
    # Lightning's freeze/make_trainable cases, on a body of fitlib's groups
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))
    set_trainable(net.parameters(), False, net, train_bn=True)
    assert [p.requires_grad for p in net.parameters()] == [False, False, True, True,
                                                           False, False]  # fmt: skip
    set_trainable(net.parameters(), False, net, train_bn=False)
    assert not any(p.requires_grad for p in net.parameters())
    set_trainable(net.parameters(), True, net, train_bn=False)
    assert all(p.requires_grad for p in net.parameters())


def test_a_module_holding_its_own_parameter_is_frozen_with_its_children():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
            self.scale = nn.Parameter(torch.ones(1))  # a parent's own parameter

        def forward(self, x):
            return self.bn(self.conv(x)) * self.scale

    parts = OrderedDict(encoder=Block(), pool=nn.AdaptiveAvgPool2d(1),
                        flat=nn.Flatten(), head=nn.Linear(4, 2))  # fmt: skip
    model = nn.Sequential(parts)
    x, y = torch.randn(16, 3, 6, 6), torch.randint(0, 2, (16,))
    data = DataBunch(DataLoader(TensorDataset(x, y), 8), None, device="cpu")
    learn = Learner(data, model, F.cross_entropy, progress=False, metrics=[],
                    layer_groups=[model.encoder, model.head])  # fmt: skip
    enc, seen = model.encoder, []

    class Look(Callback):
        def on_epoch_end(self):
            seen.append([p.requires_grad for p in (enc.scale, enc.conv.weight,
                                                   enc.bn.weight)])  # fmt: skip

    learn.fit(2, lr=0.1, callbacks=[BackboneFinetuning(1), Look()])
    assert seen == [[False, False, True], [True, True, True]]


def test_a_fit_too_short_to_unfreeze_is_refused_before_training():
    learn = learner()
    with pytest.raises(ValueError, match=r"unfreeze_at_epoch=3, but the fit has 3"):
        learn.fit(3, lr=0.1, callbacks=[BackboneFinetuning(3)])


def test_composes_with_a_one_cycle_schedule_and_a_plateau():
    learn = learner()
    lrs = []

    class Steps(Callback):
        def on_batch_begin(self, opt, train):
            if train:
                lrs.append(opt.get("lr"))

    plateau = ReduceLROnPlateau("train_loss", factor=0.5, patience=0, min_delta=10)
    learn.fit_one_cycle(3, 0.1, callbacks=[BackboneFinetuning(1, 0.1, 2.0),
                                           plateau, Steps()])  # fmt: skip
    per_epoch = 7
    for step, (backbone, head) in enumerate(lrs):
        epoch = step // per_epoch
        assert backbone == pytest.approx(head * [1.0, 0.1, 0.2][epoch])
    assert lrs[-1][1] < lrs[per_epoch - 1][1]  # the plateau's halvings kept


def test_backbone_groups_and_the_parts_of_several_optimizers():
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    model = nn.Sequential(OrderedDict(encoder=encoder, decoder=nn.Linear(16, 3)))
    learn = Learner(
        make_data(),
        model,
        F.cross_entropy,
        progress=False,
        metrics=[],
        opt_func={"encoder": torch.optim.AdamW, "decoder": SGD_MOM},
    )
    probe = Probe(model)
    before = [p.detach().clone() for p in model.encoder.parameters()]
    learn.fit(2, lr=0.01, callbacks=[BackboneFinetuning(1, 0.5), probe])
    assert probe.trainable == [False, True]
    assert probe.lrs[1] == pytest.approx([0.005, 0.01])
    assert not any(map(torch.equal, before, model.encoder.parameters()))


def test_a_resumed_ramp_ends_bit_identical_to_an_unbroken_one(tmp_path):
    def make(extra=()):
        return learner([BackboneFinetuning(1, 0.1, 3.0), *extra])

    ref = make()
    ref.fit(4, lr=0.1)
    for at in [4, 9, 16, None]:  # frozen, at the unfreezing, mid-ramp
        learn = make([Checkpoint(tmp_path, every_n_steps=3),
                      *([Crash(at)] if at is not None else [])])  # fmt: skip
        try:
            learn.fit(4, lr=0.1)
        except RuntimeError:
            assert at is not None
    assert all(map(torch.equal, ref.model.state_dict().values(),
                   learn.model.state_dict().values()))  # fmt: skip
    assert (ref.recorder.losses, ref.recorder.lrs) == (
        learn.recorder.losses, learn.recorder.lrs)  # fmt: skip
    assert learn.opt.lr == pytest.approx([0.09, 0.1])
    cb = next(c for c in learn.callbacks if isinstance(c, BackboneFinetuning))
    assert cb.state_dict() == {"factor": pytest.approx(0.9)}


def test_one_layer_group_two_ramps_and_bad_arguments_are_refused():
    one = Learner(make_data(), nn.Linear(8, 3), F.cross_entropy, progress=False)
    with pytest.raises(ValueError, match=r"1 parameter group.*layer_groups"):
        one.fit(2, lr=0.1, callbacks=[BackboneFinetuning(1)])
    with pytest.raises(ValueError, match="backbone_groups=2, but the optimizer has 2"):
        learner().fit(2, lr=0.1, callbacks=[BackboneFinetuning(1, backbone_groups=2)])
    with pytest.raises(ValueError, match="another BackboneFinetuning"):
        two = [BackboneFinetuning(1), every(BackboneFinetuning(1), 1)]
        learner().fit(2, lr=0.1, callbacks=two)
    for kwargs, message in [({"unfreeze_at_epoch": -1}, "unfreeze_at_epoch"),
                            ({"initial_ratio": 0}, "initial_ratio"),
                            ({"multiplier": -1.0}, "multiplier"),
                            ({"align": "no"}, "align must be True or False"),
                            ({"backbone_groups": 0}, "backbone_groups")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            BackboneFinetuning(**kwargs)


def test_a_torchvision_resnet_without_weights_freezes_its_backbone():
    torch.manual_seed(0)
    m = torchvision.models.resnet18(weights=None, num_classes=4)
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 4, (16,))
    data = DataBunch(DataLoader(TensorDataset(x, y), 8), None, device="cpu")
    backbone = nn.Sequential(*list(m.children())[:-1])
    learn = Learner(data, m, F.cross_entropy, metrics=[], progress=False,
                    layer_groups=[backbone, m.fc])  # fmt: skip
    convs = {n: p.detach().clone() for n, p in m.named_parameters() if "conv" in n}
    seen = []

    class Look(Callback):
        def on_epoch_end(self, epoch, opt):
            same = all(torch.equal(convs[n], p) for n, p in m.named_parameters()
                       if n in convs)  # fmt: skip
            seen.append((same, opt.get("lr")))

    learn.fit(2, lr=1e-3, callbacks=[BackboneFinetuning(1, 0.25), Look()])
    assert seen == [(True, [1e-3, 1e-3]), (False, [pytest.approx(2.5e-4), 1e-3])]


def test_freezing_between_backward_and_step_drops_the_gradients():
    # The loop clears gradients as a fit starts, so only a freeze inside a fit
    # finds them: here after a group's first backward (GradientAccumulation).
    # SGD with momentum and coupled weight decay would step a frozen weight
    # that still holds a gradient.
    learn = learner(wd=0.1, true_wd=False, train_bn=False)
    body = list(learn.model[0].parameters())

    class FreezeMidGroup(Callback):
        def on_batch_end(self, iteration, model):
            if iteration == 0:
                assert body[0].grad is not None  # batch 0's, for the group
                set_trainable(body, False, model, train_bn=False)

    before = [p.detach().clone() for p in body]
    learn.fit(1, lr=0.1, callbacks=[GradientAccumulation(2), FreezeMidGroup()])
    assert all(map(torch.equal, body, before))
    assert all(p.grad is None for p in body)
