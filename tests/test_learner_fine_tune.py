"""``Learner.fine_tune``: the head trained alone, then everything with
discriminative rates (fastai's ``fine_tune``), as one fit."""

import math
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
    OneCycleScheduler,
)


class Probe(Callback):
    """Notes each training step's lr per group and, at each epoch's end, the
    weights and which parameters may train."""

    def __init__(self):
        self.lrs, self.weights, self.trainable = [], [], []

    def on_batch_begin(self, opt, train):
        if train:
            self.lrs.append(opt.get("lr"))

    def on_epoch_end(self, model):
        self.weights.append({k: v.clone() for k, v in model.state_dict().items()})
        self.trainable.append({n: p.requires_grad for n, p in model.named_parameters()})


def resnet_learner(opt_func=torch.optim.AdamW, **kwargs):
    """A resnet18 built without weights, on 16 random 32x32 images (2 batches
    an epoch), in three layer groups: stem to layer2, layer3-4, the head."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 4, (16,))
    train, valid = TensorDataset(x, y), TensorDataset(x[:8], y[:8])
    data = DataBunch(DataLoader(train, 8, shuffle=True), DataLoader(valid, 8), "cpu")
    m = torchvision.models.resnet18(weights=None, num_classes=4)
    groups = [nn.Sequential(m.conv1, m.bn1, m.layer1, m.layer2),
              nn.Sequential(m.layer3, m.layer4), m.fc]  # fmt: skip
    return Learner(data, m, F.cross_entropy, opt_func=opt_func, metrics=[],
                   layer_groups=groups, progress=False, **kwargs)  # fmt: skip


def mlp_learner(callbacks=(), **kwargs):
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
    model = nn.Sequential(body, nn.Linear(16, 3))
    return Learner(make_data(), model, F.cross_entropy, metrics=[], progress=False,
                   layer_groups=[body, model[1]], callbacks=list(callbacks),
                   **kwargs)  # fmt: skip


SGD_MOM = partial(torch.optim.SGD, momentum=0.9)


@pytest.mark.parametrize("opt_func", [torch.optim.AdamW, SGD_MOM])
def test_the_body_stays_bit_for_bit_while_frozen_then_trains(opt_func):
    learn, probe = resnet_learner(opt_func, wd=0.1), Probe()
    before = {k: v.clone() for k, v in learn.model.state_dict().items()}
    learn.fine_tune(1, callbacks=[probe])
    frozen, after = probe.weights
    convs = [n for n, m in learn.model.named_modules() if isinstance(m, nn.Conv2d)]
    for name in convs:  # weight decay and momentum left them alone too
        assert torch.equal(frozen[f"{name}.weight"], before[f"{name}.weight"]), name
        assert not torch.equal(after[f"{name}.weight"], before[f"{name}.weight"])
    # train_bn (the default): the body's batch norms train while it is frozen
    assert not torch.equal(frozen["bn1.weight"], before["bn1.weight"])
    assert not torch.equal(frozen["fc.weight"], before["fc.weight"])
    assert probe.trainable[0]["bn1.weight"] and not probe.trainable[0]["conv1.weight"]
    assert all(probe.trainable[1].values())
    assert all(p.requires_grad for p in learn.model.parameters())


def test_train_bn_false_freezes_the_norm_layers_too():
    learn, probe = resnet_learner(train_bn=False), Probe()
    before = {k: v.clone() for k, v in learn.model.named_parameters()}
    learn.fine_tune(1, callbacks=[probe])
    body = [k for k in before if not k.startswith("fc.")]
    assert all(torch.equal(probe.weights[0][k], before[k]) for k in body)
    assert not torch.equal(probe.weights[0]["fc.weight"], before["fc.weight"])


def test_the_rates_are_fastais_two_cycles_per_group():
    learn, probe = resnet_learner(), Probe()
    learn.fine_tune(2, base_lr=1e-2, freeze_epochs=1, lr_mult=100, callbacks=[probe])
    assert len(probe.lrs) == 6  # 2 steps frozen, then 4
    # frozen: 1cycle at slice(1e-2): the body's groups at 1e-3, from /25 ...
    assert probe.lrs[0] == pytest.approx([1e-3 / 25, 1e-3 / 25, 1e-2 / 25])
    # ... to /(25 * 1e4) at the phase's last step (pct_start=0.99)
    assert probe.lrs[1] == pytest.approx([1e-3 / 25e4, 1e-3 / 25e4, 1e-2 / 25e4])
    # unfrozen: base_lr halved, slice(5e-3 / 100, 5e-3) geometric, from /div=5
    top = [5e-5, 5e-5 * 10, 5e-3]
    assert probe.lrs[2] == pytest.approx([v / 5 for v in top])
    for lrs in probe.lrs[2:]:  # each step: the slice's ratios between groups
        assert [v / lrs[0] for v in lrs] == pytest.approx([1, 10, 100])
    assert probe.lrs[5] == pytest.approx([v / 5e4 for v in top])
    # the Recorder's lr is the head's, as each step used it
    assert learn.recorder.lrs == pytest.approx([lrs[-1] for lrs in probe.lrs])


def test_returns_one_history_of_both_phases():
    learn = mlp_learner()
    history = learn.fine_tune(2, freeze_epochs=2)
    assert [r["epoch"] for r in history] == [0, 1, 2, 3]
    assert "4 epochs" in repr(history)
    assert [r["epoch"] for r in learn.recorder.epoch_table()] == [0, 1, 2, 3]


def test_callbacks_passed_in_run_and_a_second_lr_schedule_is_refused():
    seen = []

    class Count(Callback):
        def on_epoch_end(self, epoch):
            seen.append(epoch)

    learn = mlp_learner()
    learn.fine_tune(1, callbacks=[Count()])
    assert seen == [0, 1]
    with pytest.raises(ValueError, match="both set 'lr'"):
        learn.fine_tune(1, callbacks=[OneCycleScheduler(lr=1e-2)])
    with pytest.raises(ValueError, match="another BackboneFinetuning"):
        learn.fine_tune(1, callbacks=[BackboneFinetuning(1)])


def test_a_learner_of_one_layer_group_is_refused_before_training():
    learn = Learner(make_data(), nn.Linear(8, 3), F.cross_entropy, progress=False)
    before = [p.clone() for p in learn.model.parameters()]
    with pytest.raises(ValueError, match=r"1 layer group.*layer_groups=\[body, head\]"):
        learn.fine_tune(1)
    assert learn.opt is None
    assert all(map(torch.equal, before, learn.model.parameters()))
    # without a frozen phase there is nothing to freeze: one 1cycle at base_lr / 2
    history = learn.fine_tune(1, freeze_epochs=0, base_lr=2e-2)
    assert len(history) == 1 and max(learn.recorder.lrs) == pytest.approx(
        1e-2, rel=0.05
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [({"epochs": 0}, "epochs must be an int >= 1"),
     ({"freeze_epochs": -1}, "freeze_epochs must be an int >= 0"),
     ({"base_lr": 0}, "base_lr must be"),
     ({"lr_mult": -1}, "lr_mult must be"),
     ({"pct_start": 1.0}, "pct_start")],
)  # fmt: skip
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mlp_learner().fine_tune(**{"epochs": 1, **kwargs})


def same_run(a, b):
    weights = all(map(torch.equal, a.model.state_dict().values(),
                      b.model.state_dict().values()))  # fmt: skip
    ra, rb = a.recorder, b.recorder
    return weights and (ra.losses, ra.lrs) == (rb.losses, rb.lrs)


@pytest.mark.parametrize("crashes", [[3], [9], [3, 15]])  # 7 steps an epoch
def test_a_killed_fine_tune_resumes_in_its_phase_bit_for_bit(tmp_path, crashes):
    # crash 3: in the frozen phase; 9 and 15: after the unfreezing
    ref = mlp_learner(opt_func=SGD_MOM)
    ref.fine_tune(2, base_lr=0.05)
    for at in [*crashes, None]:
        extra = [Crash(at)] if at is not None else []
        learn = mlp_learner(opt_func=SGD_MOM)
        try:
            learn.fine_tune(
                2,
                base_lr=0.05,
                callbacks=[Checkpoint(tmp_path, every_n_steps=2), *extra],
            )
        except RuntimeError:
            assert at is not None
        if at is not None:  # frozen as the crash found it
            assert learn.model[0][0].weight.requires_grad == (at >= 7)
    assert same_run(ref, learn)
    assert len(learn.recorder.losses) == 21
    assert all(p.requires_grad for p in learn.model.parameters())


def test_the_phases_split_the_steps_in_whole_epochs():
    learn, probe = mlp_learner(), Probe()  # 7 batches an epoch
    learn.fine_tune(1, base_lr=1e-2, freeze_epochs=2, callbacks=[probe])
    head = [lrs[-1] for lrs in probe.lrs]
    # the frozen cycle's last step (13) ends low; the next starts at peak / 5
    assert head[13] == pytest.approx(1e-2 / 25e4)
    assert head[14] == pytest.approx(5e-3 / 5)
    assert math.isclose(max(head[:14]), 1e-2, rel_tol=0.05)


def epoch_lrs(probe_lrs, per_epoch):
    """The head's lr at each training batch, cut into epochs of ``per_epoch``
    batches."""
    head, out = [lrs[-1] for lrs in probe_lrs], []
    for n in per_epoch:
        out, head = [*out, head[:n]], head[n:]
    return out


def test_the_phases_change_where_the_backbone_unfreezes_with_uneven_epochs():
    # epoch 0 steps every 4 batches (2 steps of 7 batches), epoch 1 every batch
    learn, probe = mlp_learner(), Probe()
    acc = GradientAccumulation({0: 4, 1: 1})
    learn.fine_tune(1, base_lr=1e-2, callbacks=[acc, probe])
    frozen, unfrozen = epoch_lrs(probe.lrs, [7, 7])
    assert frozen[:4] == pytest.approx([1e-2 / 25] * 4)  # the cycle's first step
    assert frozen[4:] == pytest.approx([1e-2 / 25e4] * 3)  # its last: it ends here
    assert unfrozen[0] == pytest.approx(5e-3 / 5)  # the second cycle's start
    assert math.isclose(max(unfrozen), 5e-3, rel_tol=0.05)
    assert unfrozen[-1] == pytest.approx(5e-3 / 5e4)


def test_the_phases_follow_train_batches_with_accumulation():
    # 5 batches an epoch: 3 steps while frozen (2 batches each), then 5
    learn, probe = mlp_learner(), Probe()
    acc = GradientAccumulation({0: 2, 1: 1})
    learn.fine_tune(1, base_lr=1e-2, callbacks=[acc, probe], train_batches=5)
    frozen, unfrozen = epoch_lrs(probe.lrs, [5, 5])
    assert len(probe.lrs) == 10
    assert frozen[-1] == pytest.approx(1e-2 / 25e4)  # the frozen cycle's end
    assert unfrozen[0] == pytest.approx(5e-3 / 5)
    assert unfrozen[-1] == pytest.approx(5e-3 / 5e4)


@pytest.mark.parametrize("crashes", [[2], [10], [3, 12]])  # epoch 0: 4 steps
def test_a_killed_fine_tune_with_accumulation_resumes_bit_for_bit(tmp_path, crashes):
    def run(extra=()):
        learn = mlp_learner(opt_func=SGD_MOM)
        learn.fine_tune(1, base_lr=0.05, callbacks=[
            GradientAccumulation({0: 2, 1: 1}), *extra])  # fmt: skip
        return learn

    ref = run()
    for at in [*crashes, None]:
        extra = [Crash(at)] if at is not None else []
        try:
            learn = run([Checkpoint(tmp_path, every_n_steps=1), *extra])
        except RuntimeError:
            assert at is not None
    # (the Recorder's lr at a batch that does not step differs after a resume
    # inside a group, a known difference of its own: the weights and losses)
    weights = zip(ref.model.state_dict().values(), learn.model.state_dict().values())
    assert all(torch.equal(a, b) for a, b in weights)
    assert ref.recorder.losses == learn.recorder.losses


def test_freeze_epochs_0_unfreezes_a_frozen_learner():
    learn = mlp_learner()
    learn.freeze()
    body = learn.model[0][0].weight
    before = body.detach().clone()
    learn.fine_tune(1, freeze_epochs=0)
    assert body.requires_grad and not torch.equal(body, before)
    assert all(p.requires_grad for p in learn.model.parameters())
