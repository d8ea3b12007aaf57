"""Real workloads through the Learner: segmentation (per-pixel metrics),
sequences (per-token metrics)."""

import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

from fitlib import DataBunch, Learner
from fitlib.metrics import Dice, MeanIoU, Perplexity, TokenAccuracy, accuracy


def segmentation_data(n=24, c=3, size=8, seed=0):
    """Images whose pixel classes are a function of the pixel's channels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, size, size, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()  # classes 0..2
    y[:, 0, :] = 255  # an unlabelled border row
    ds = TensorDataset(x, y)
    return DataBunch(
        DataLoader(ds, 8, shuffle=True, generator=g), DataLoader(ds, 7), device="cpu"
    )


def test_a_segmentation_model_trains_with_per_pixel_metrics():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 3, 1))
    loss = functools.partial(F.cross_entropy, ignore_index=255)
    metrics = [
        functools.partial(accuracy, ignore_index=255),
        MeanIoU(ignore_index=255),
        Dice(ignore_index=255),
    ]
    learn = Learner(
        segmentation_data(),
        model,
        loss,
        metrics=metrics,
        train_metrics=[functools.partial(accuracy, ignore_index=255)],
        progress=False,
    )
    history = learn.fit(3, lr=0.05)
    first, last = history[0], history[-1]
    assert {"accuracy", "mean_iou", "dice", "train_accuracy"} <= last.keys()
    assert last["valid_loss"] < first["valid_loss"]
    assert 0 < first["mean_iou"] < last["mean_iou"] <= last["dice"] < 1
    # The validation accuracy equals a whole-set count of the labelled pixels.
    x, y = learn.data.valid_dl.dataset.tensors
    with torch.no_grad():
        pred = learn.model.eval()(x).argmax(1)
    keep = y != 255
    want = ((pred == y) & keep).sum().item() / keep.sum().item()
    assert last["accuracy"] == pytest.approx(want, rel=1e-9)


def test_a_sequence_model_reports_token_accuracy_and_perplexity():
    g = torch.Generator().manual_seed(1)
    vocab, t = 6, 5
    x = torch.randint(0, vocab, (32, t), generator=g)
    y = x.clone()  # learn to copy the tokens
    y[:, 3:][torch.rand(32, 2, generator=g) < 0.5] = -100  # padding
    ds = TensorDataset(x, y)
    data = DataBunch(DataLoader(ds, 8), DataLoader(ds, 8), device="cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(vocab, 16), nn.Linear(16, vocab))

    def token_ce(out, y):
        return F.cross_entropy(out.reshape(-1, vocab), y.reshape(-1))

    learn = Learner(
        data, model, token_ce, metrics=[TokenAccuracy(), Perplexity()], progress=False
    )
    history = learn.fit(4, lr=0.01)
    assert history[-1]["token_accuracy"] > history[0]["token_accuracy"]
    assert history[-1]["perplexity"] < history[0]["perplexity"]
    # Perplexity is exp of the token cross-entropy over the whole set.
    with torch.no_grad():
        out = learn.model.eval()(x)
    want = token_ce(out.double(), y).exp().item()
    assert history[-1]["perplexity"] == pytest.approx(want, rel=1e-9)


# -- batches of inputs only ------------------------------------------------------
def autoencoder_loaders(as_tuple):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 6, generator=g) @ torch.randn(6, 6, generator=g)
    if as_tuple:  # a TensorDataset of one tensor yields [x] batches
        return x, DataLoader(TensorDataset(x), 8), DataLoader(TensorDataset(x), 16)
    return x, DataLoader(x, 8), DataLoader(x, 16)  # bare tensor batches


def reconstruction(out):
    return out[1].mean()  # the model returns (code, error per sample)


class AutoEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.dec = nn.Linear(6, 3), nn.Linear(3, 6)

    def forward(self, x):
        code = self.enc(x)
        return code, (self.dec(code) - x).pow(2).mean(1)


@pytest.mark.parametrize("as_tuple", [True, False])
def test_batches_of_inputs_only_call_the_loss_with_the_output_alone(as_tuple):
    x, train_dl, valid_dl = autoencoder_loaders(as_tuple)
    torch.manual_seed(0)
    seen = []

    def loss(*args):
        seen.append(len(args))
        return reconstruction(args[0])

    learn = Learner(
        DataBunch(train_dl, valid_dl, device="cpu"), AutoEncoder(), loss, progress=False
    )
    history = learn.fit(3, lr=0.05)
    assert set(seen) == {1}  # loss_func(output): no targets
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    # valid_loss is the sample-weighted mean over the set.
    with torch.no_grad():
        want = F.mse_loss(learn.model.dec(learn.model.enc(x)), x).item()
    assert history[-1]["valid_loss"] == pytest.approx(want, rel=1e-5)
    preds, targets = learn.get_preds()
    assert targets is None and [p.shape for p in preds] == [(40, 3), (40,)]


def test_a_batch_of_three_is_refused_with_the_inputs_only_forms_named():
    from fitlib import fit

    dl = [(torch.zeros(2, 3), torch.zeros(2), torch.zeros(2))]
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with pytest.raises(
        TypeError, match=r"(?s)inputs only: \(x,\) or a tensor.*b\[1:\]"
    ):
        fit(1, model, F.mse_loss, opt, DataBunch(dl, None, device="cpu"))
