"""GANs: a generator and a critic trained in turns (GANTrainer), in the one loop."""

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

from fitlib import Callback, DataBunch, GANLoss, GANModule, Learner, MultiOptimizer, fit
from fitlib.callbacks import GANTrainer, GradientAccumulation

ADAM = {"generator": torch.optim.Adam, "critic": torch.optim.Adam}


def ring(n=256, seed=0):
    """Samples of 8 Gaussians on a circle of radius 2."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(0, 8, (n,), generator=g)
    angle = k.float() * 2 * math.pi / 8
    centres = torch.stack([2 * angle.cos(), 2 * angle.sin()], 1)
    return centres + 0.05 * torch.randn(n, 2, generator=g)


def gan(seed=0):
    torch.manual_seed(seed)
    generator = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
    critic = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    return GANModule(generator, critic, noise_size=4)


def loader(inputs_only=True):
    ds = (
        TensorDataset(ring())
        if inputs_only
        else TensorDataset(ring(), torch.zeros(256))
    )
    return DataLoader(ds, 32, shuffle=True)


def optimizers(model, lr=1e-3):
    return {
        "generator": torch.optim.Adam(
            model.generator.parameters(), lr, betas=(0.5, 0.9)
        ),
        "critic": torch.optim.Adam(model.critic.parameters(), lr, betas=(0.5, 0.9)),
    }


def hand_written(kind, n_critic, epochs=2, penalty=None):
    """The alternating loop a user writes: one part's step per batch
    (``penalty(critic, real, fake)``: a term added to the critic's loss)."""
    model = gan()
    opts = optimizers(model)
    g, c = model.generator, model.critic
    torch.manual_seed(1)
    step = 0
    for _ in range(epochs):
        for (real,) in loader():
            z = torch.randn(real.shape[0], 4)
            if step % (n_critic + 1) < n_critic:
                with torch.no_grad():
                    fake = g(z)
                real_s, fake_s = c(real), c(fake)
                if kind == "bce":
                    loss = F.binary_cross_entropy_with_logits(
                        real_s, torch.ones_like(real_s)
                    ) + F.binary_cross_entropy_with_logits(
                        fake_s, torch.zeros_like(fake_s)
                    )
                else:
                    loss = fake_s.mean() - real_s.mean()
                if penalty is not None:
                    loss = loss + penalty(c, real, fake)
                loss.backward()
                opts["critic"].step()
            else:
                for p in c.parameters():
                    p.requires_grad_(False)
                fake_s = c(g(z))
                if kind == "bce":
                    loss = F.binary_cross_entropy_with_logits(
                        fake_s, torch.ones_like(fake_s)
                    )
                else:
                    loss = -fake_s.mean()
                loss.backward()
                opts["generator"].step()
                for p in c.parameters():
                    p.requires_grad_(True)
            for opt in opts.values():
                opt.zero_grad()
            step += 1
    return model


@pytest.mark.parametrize(("kind", "n_critic"), [("bce", 1), ("wgan", 3)])
def test_alternating_training_matches_a_hand_written_loop_bit_for_bit(kind, n_critic):
    model = gan()
    torch.manual_seed(1)
    history = fit(2, model, GANLoss(kind), optimizers(model), DataBunch(loader()),
                  callbacks=[GANTrainer(n_critic=n_critic)])  # fmt: skip
    ref = hand_written(kind, n_critic)
    for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(p, q), name
    # each part's loss is its own value in the record
    assert history[-1]["train_critic"] is not None
    assert history[-1]["train_generator"] is not None


def test_each_part_steps_and_learns_only_in_its_turn():
    model = gan()
    seen = []

    class Spy(Callback):  # after GANTrainer (order 0)
        def on_backward_end(self, model, opt):
            grads = {
                name: any(p.grad is not None for p in getattr(model, name).parameters())
                for name in ("generator", "critic")
            }
            seen.append((model.mode, opt.active, grads))

    fit(1, model, GANLoss("wgan"), optimizers(model), DataBunch(loader()),
        callbacks=[GANTrainer(n_critic=3), Spy()])  # fmt: skip
    modes = [m for m, _, _ in seen]
    assert modes == ["critic"] * 3 + ["generator"] + ["critic"] * 3 + ["generator"]
    for mode, active, grads in seen:
        assert active == (mode,)
        assert grads == {"critic": mode == "critic", "generator": mode == "generator"}
    assert all(p.requires_grad for p in model.parameters())  # put back after
    assert model.mode is None


def test_the_record_has_each_parts_loss_for_training_and_validation():
    learn = Learner(DataBunch(loader(), DataLoader(TensorDataset(ring(64, 1)), 32)),
                    gan(), GANLoss("bce"), opt_func=ADAM, progress=False,
                    callbacks=[GANTrainer()])  # fmt: skip
    history = learn.fit(1, lr=1e-3)
    record = history[-1]
    for name in ("train_critic", "train_generator", "valid_critic", "valid_generator"):
        assert record[name] is not None and math.isfinite(record[name]), name
    assert record["valid_loss"] == pytest.approx(record["valid_critic"])
    # a random critic: about log(2) per BCE term, so ~1.39 for the critic's two
    assert 0.5 < record["valid_critic"] < 3


def test_accumulation_keeps_one_part_for_every_batch_of_a_step():
    model = gan()
    turns = []

    class Spy(Callback):
        def on_batch_begin(self, train, model):
            if train:
                turns.append(model.mode)

    fit(1, model, GANLoss("wgan"), optimizers(model), DataBunch(loader()),
        callbacks=[GANTrainer(n_critic=2), GradientAccumulation(2), Spy()])  # fmt: skip
    assert turns == ["critic"] * 4 + ["generator"] * 2 + ["critic"] * 2


def test_batches_with_targets_train_as_inputs_only_do():
    a, b = gan(), gan()
    for model, inputs_only in ((a, True), (b, False)):
        torch.manual_seed(1)
        fit(1, model, GANLoss("hinge"), optimizers(model),
            DataBunch(loader(inputs_only)), callbacks=[GANTrainer()])  # fmt: skip
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


# -- bad input -----------------------------------------------------------------
def test_a_gan_module_without_its_trainer_says_so_at_the_first_batch():
    model = gan()
    with pytest.raises(RuntimeError, match=r"callbacks=\[GANTrainer\(\)\]"):
        fit(1, model, GANLoss(), optimizers(model), DataBunch(loader()))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="n_critic"):
        GANTrainer(n_critic=0)
    with pytest.raises(ValueError, match="unknown kind 'wasserstein'"):
        GANLoss("wasserstein")
    with pytest.raises(TypeError, match=r"critic must be an nn\.Module"):
        GANModule(nn.Linear(1, 1), lambda x: x, noise_size=1)


def test_frozen_parameters_may_stay_out_of_a_gan_part_and_missing_ones_are_named():
    model = gan()
    model.generator[0].requires_grad_(False)
    opts = {
        "generator": torch.optim.Adam(model.generator[2].parameters()),
        "critic": torch.optim.Adam(model.critic.parameters()),
    }
    fit(1, model, GANLoss("wgan"), opts, DataBunch(loader()), callbacks=[GANTrainer()])
    assert not model.generator[0].weight.requires_grad  # still frozen after
    partial_critic = {
        "generator": torch.optim.Adam(model.generator[2].parameters()),
        "critic": torch.optim.Adam(model.critic[0].parameters()),
    }
    with pytest.raises(
        ValueError, match=r"leaves out gan.critic's trainable \['2.weight', '2.bias'\]"
    ):
        GANTrainer().on_train_begin(model=model, opt=MultiOptimizer(partial_critic))


def test_a_critic_with_two_scores_per_sample_is_refused_at_the_first_batch():
    model = gan()
    model.critic[2] = nn.Linear(32, 2)  # a classifier's head: (n, 2) scores
    opts = optimizers(model)
    with pytest.raises(
        ValueError, match=r"critic.*\(n,\) or \(n, 1\).*returned shape \(32, 2\)"
    ):
        fit(1, model, GANLoss("bce"), opts, DataBunch(loader()),
            callbacks=[GANTrainer()])  # fmt: skip
    # nothing stepped: the check comes before the first backward
    assert all(not s for s in opts["critic"].state.values())


@pytest.mark.parametrize("flat", [True, False])
def test_one_score_per_sample_passes_as_n_or_n_by_1(flat):
    model = gan()
    if flat:
        model.critic.append(nn.Flatten(0))  # (n,) scores; else (n, 1)
    history = fit(1, model, GANLoss("wgan"), optimizers(model), DataBunch(loader()),
                  callbacks=[GANTrainer()])  # fmt: skip
    assert history[-1]["train_critic"] is not None


def test_a_generator_whose_samples_differ_from_the_real_ones_is_named():
    model = gan()
    model.generator[2] = nn.Linear(32, 3)  # makes (n, 3) for (n, 2) real samples
    with pytest.raises(ValueError, match=r"generator made samples of shape \(32, 3\)"):
        fit(1, model, GANLoss("bce"), optimizers(model), DataBunch(loader()),
            callbacks=[GANTrainer()])  # fmt: skip


def noise_2(n, device):
    return torch.randn(n, 4, device=device)


GEN, CRITIC = nn.Linear(4, 2), nn.Linear(2, 1)
BAD = [  # (call, error type, match): what a user might pass
    (lambda: GANTrainer(n_critic="5"), TypeError, r"n_critic must be an int >= 1"),
    (lambda: GANTrainer(n_critic=2.0), TypeError, r"got 2.0 \(float\)"),
    (lambda: GANTrainer(n_generator=0), ValueError, r"n_generator must be .*got 0"),
    (lambda: GANTrainer(n_generator=None), TypeError, "n_generator"),
    (lambda: GANTrainer(n_critic=True), TypeError, r"got True \(bool\)"),
    (lambda: GANModule(GEN, CRITIC, noise_size=0), ValueError, r"noise_size.*got 0"),
    (lambda: GANModule(GEN, CRITIC, noise_size="4"), TypeError, "noise_size"),
    (lambda: GANModule(GEN, CRITIC, noise_size=4.0), TypeError, r"got 4.0"),
    (lambda: GANModule(GEN, CRITIC, noise_size=None), TypeError, "noise_size"),
    (lambda: GANModule(GEN, CRITIC, noise_size=(4, 0)), ValueError, r"got \(4, 0\)"),
    (lambda: GANModule(GEN, CRITIC, noise_size=()), ValueError, "non-empty tuple"),
    (lambda: GANModule(GEN, CRITIC, 4, noise="randn"), TypeError, "noise must be"),
    (lambda: GANModule("gen", CRITIC, 4), TypeError, "generator must be an nn"),
    (lambda: GANModule(GEN, CRITIC, 4).generate(-1), ValueError, "n must be"),
    (lambda: GANModule(GEN, CRITIC, 4).generate(2.5), TypeError, "got 2.5"),
    (lambda: GANModule(GEN, CRITIC, 4).generate("8"), TypeError, "n must be"),
    (lambda: GANModule(GEN, CRITIC, 4).generate(8, "gpu"), TypeError, "device"),
    (
        lambda: GANModule(nn.Linear(4, 4), nn.Unflatten(1, (2, 1, 2)), 4).eval()(
            torch.rand(3, 4)
        ),
        ValueError,
        r"\(3, 2, 1, 2\).*to 1 channel",
    ),
    (lambda: GANLoss("BCE"), ValueError, r"unknown kind 'BCE' \('bce'\?\)"),
    (lambda: GANLoss(None), TypeError, "kind must be one of"),
]


@pytest.mark.parametrize(("call", "error", "match"), BAD)
def test_every_bad_argument_is_refused_with_the_fix(call, error, match):
    with pytest.raises(error, match=match) as info:
        call()
    assert "Fix:" in str(info.value)


def test_numpy_ints_and_tuples_are_accepted_where_ints_are():
    trainer = GANTrainer(n_critic=np.int64(3), n_generator=np.int32(2))
    assert (trainer.n_critic, trainer.n_generator) == (3, 2)
    gan_ = GANModule(GEN, CRITIC, noise_size=np.int64(4), noise=noise_2)
    assert gan_.noise_size == (4,)
    assert GANModule(GEN, CRITIC, noise_size=[np.int64(4)]).noise_size == (4,)
    assert gan_.generate(np.int64(3), device=torch.device("cpu")).shape == (3, 2)
    assert gan_.generate(0).shape == (0, 2)


def test_a_patchgan_map_of_one_channel_is_one_score_map_per_sample():
    gan = GANModule(nn.Linear(4, 4), nn.Unflatten(1, (1, 2, 2)), 4).eval()
    out = gan(torch.rand(3, 4))
    assert out.fake_scores.shape == (3, 1, 2, 2)
    loss = GANLoss("bce")
    assert torch.isfinite(loss(out)["loss"])


def test_shapes_are_checked_once_per_turn_and_batch_shape(monkeypatch):
    import fitlib.gan as gan_module

    checks = []
    same_shape = gan_module._same_shape

    def counted(fake, real):
        checks.append(1)
        return same_shape(fake, real)

    monkeypatch.setattr(gan_module, "_same_shape", counted)
    model = gan()
    data = DataBunch(loader(), DataLoader(TensorDataset(ring(40, seed=1)), 32))
    fit(2, model, GANLoss("wgan"), optimizers(model), data, callbacks=[GANTrainer()])
    # critic and generator turns at (32, 2); validation ("both") at (32, 2), (8, 2)
    assert len(checks) == 4
    model.train().mode = "critic"
    model.critic[2] = nn.Linear(32, 2)  # a new shape is still checked
    with pytest.raises(ValueError, match=r"returned shape \(5, 2\)"):
        model(torch.zeros(5, 2))
