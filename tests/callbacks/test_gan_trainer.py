"""``GANTrainer``: the turns it gives the generator and the critic, the
record's lr, and the models and optimizers it refuses (``tests/test_gan.py``
tests the GAN model, its loss and the training as a whole)."""

import pytest
import torch
from test_gan import ADAM, gan, loader, optimizers
from torch import nn

from fitlib import DataBunch, GANLoss, Learner, MultiOptimizer, fit
from fitlib.callbacks import GANTrainer


def test_a_gan_trainer_without_a_generator_or_a_critic_part_is_refused():
    model = gan()
    only_critic = {"critic": torch.optim.Adam(model.critic.parameters())}
    only_critic["generator_x"] = torch.optim.Adam(model.generator.parameters())
    with pytest.raises(
        ValueError, match=r"part named 'generator'.*\['critic', 'generator_x'\]"
    ):
        fit(
            1,
            model,
            GANLoss(),
            only_critic,
            DataBunch(loader()),
            callbacks=[GANTrainer()],
        )
    with pytest.raises(ValueError, match="one optimizer"):
        fit(1, model, GANLoss(), torch.optim.Adam(model.parameters()),
            DataBunch(loader()), callbacks=[GANTrainer()])  # fmt: skip


def test_a_gan_trainer_on_another_model_is_refused():
    model = nn.Sequential(nn.Linear(2, 1))
    model.generator, model.critic = nn.Linear(1, 1), nn.Linear(1, 1)
    with pytest.raises(ValueError, match="trains a GANModule"):
        fit(1, model, GANLoss(), torch.optim.Adam(model.parameters()),
            DataBunch(loader()), callbacks=[GANTrainer()])  # fmt: skip


def test_a_gan_trainer_under_ddp_without_unused_parameters_is_refused():
    class Wrapper(nn.Module):  # what DistributedDataParallel looks like here
        def __init__(self, module):
            super().__init__()
            self.module, self.find_unused_parameters = module, False

    model = gan()
    opt = MultiOptimizer(optimizers(model))
    with pytest.raises(ValueError, match="find_unused_parameters=True"):
        GANTrainer().on_train_begin(model=Wrapper(model), opt=opt)


def test_the_records_lr_is_the_last_parts_in_every_turn():
    learn = Learner(DataBunch(loader()), gan(), GANLoss("wgan"), opt_func=ADAM,
                    progress=False, callbacks=[GANTrainer(n_critic=2)])  # fmt: skip
    history = learn.fit(1, lr={"generator": 1e-4, "critic": 4e-4})
    assert set(learn.recorder.lrs) == {4e-4}  # the critic's, also in its off turns
    assert history[0]["lr"] == 4e-4


def test_the_trainer_sets_the_active_part_only_when_the_turn_changes():
    sets = []

    class Spy(MultiOptimizer):
        @MultiOptimizer.active.setter
        def active(self, names):
            sets.append(names)
            MultiOptimizer.active.fset(self, names)

    model = gan()
    fit(1, model, GANLoss("wgan"), Spy(optimizers(model)), DataBunch(loader()),
        callbacks=[GANTrainer(n_critic=5)])  # fmt: skip
    assert sets == [("critic",), ("generator",), ("critic",), None]  # 8 batches
