"""``fitlib.evaluation``: what ``Learner.validate``, ``get_preds`` and
``predict`` run, called with the Learner."""

import pytest
import torch
from helpers import make_data, make_model
from torch.nn import functional as F  # noqa: N812

from fitlib import DataBunch, Learner
from fitlib.evaluation import predictions, valid_loader, validation_values


def learner(**kwargs):
    return Learner(make_data(), make_model(), F.cross_entropy, progress=False,
                   **kwargs)  # fmt: skip


def test_the_functions_give_what_the_learner_methods_give():
    learn = learner()
    learn.fit(1, lr=1e-2)
    assert validation_values(learn) == learn.validate()
    preds, targets = predictions(learn)
    ref_preds, ref_targets = learn.get_preds()
    assert torch.equal(preds, ref_preds) and torch.equal(targets, ref_targets)
    assert preds.shape == (37, 3)


def test_valid_loader_refuses_a_learner_without_a_validation_set():
    data = make_data()
    learn = Learner(DataBunch(data.train_dl, None, "cpu"), make_model(),
                    F.cross_entropy, progress=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"no validation set.*validate\(dl="):
        valid_loader(learn, None)
    assert valid_loader(learn, data.train_dl) is data.train_dl
