"""ChannelsLast: the model's 4-D weights and 4-D inputs in NHWC order."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

from fitlib import Callback, DataBunch, HPOptimizer, Learner, fit
from fitlib.callbacks import ChannelsLast

pytestmark = pytest.mark.usefixtures("one_thread")
NHWC = torch.channels_last


def images(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 8, 8, generator=g)
    return TensorDataset(x, (x[:, 0].mean((1, 2)) > 0).long())


def convnet():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(8, 2),
    )  # fmt: skip


def data():
    return DataBunch(DataLoader(images(), 16, shuffle=True),
                     DataLoader(images(32, seed=1), 16), device="cpu")  # fmt: skip


class Layout(Callback):
    """Notes, at each forward, whether the input and the first conv's weight
    are channels-last."""

    def __init__(self):
        self.seen = []

    def on_loss_begin(self, last_input, model):
        weight = model[0].weight
        self.seen.append((last_input.is_contiguous(memory_format=NHWC),
                          weight.is_contiguous(memory_format=NHWC)))  # fmt: skip


def test_trains_nhwc_with_the_results_of_nchw():
    results = []
    for extra in ([], [ChannelsLast()]):
        torch.manual_seed(0)
        model, layout = convnet(), Layout()
        opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        history = fit(2, model, F.cross_entropy, opt, data(), [layout, *extra])
        results.append((history, layout.seen, model))
    (plain, plain_seen, _), (nhwc, nhwc_seen, model) = results
    assert all(seen == (False, False) for seen in plain_seen)
    assert all(seen == (True, True) for seen in nhwc_seen)  # validation too
    assert len(nhwc_seen) == 2 * (4 + 2)
    for a, b in zip(plain, nhwc, strict=True):  # rounding apart, the same run
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
        assert b["valid_loss"] == pytest.approx(a["valid_loss"], rel=1e-5)
    assert model[0].weight.is_contiguous(memory_format=NHWC)


def test_learner_to_channels_last_converts_every_fit():
    learn = Learner(data(), convnet(), F.cross_entropy, progress=False)
    layout = Layout()
    assert learn.to_channels_last() is learn
    learn.fit(1, lr=0.01, callbacks=[layout])
    assert all(seen == (True, True) for seen in layout.seen)
    assert sum(isinstance(cb, ChannelsLast) for cb in learn.callbacks) == 1


def test_a_model_without_4d_weights_is_refused_before_training():
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 2))
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="no 4-D weights"):
        fit(1, model, F.cross_entropy, opt, data(), [ChannelsLast()])
    learn = Learner(data(), model, F.cross_entropy, progress=False)
    with pytest.raises(ValueError, match="no 4-D weights"):
        learn.to_channels_last()  # at once, and the Learner left as it was
    assert not any(isinstance(cb, ChannelsLast) for cb in learn.callbacks)


def test_inputs_without_a_4d_tensor_are_refused_with_their_shapes():
    model = nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 2, 3),
                          nn.Flatten(), nn.Linear(2 * 6 * 6, 2))  # fmt: skip
    x = torch.randn(32, 64)
    flat = DataBunch(DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), 16),
                     device="cpu")  # fmt: skip
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"shape=\(16, 64\).*none is 4-D"):
        fit(1, model, F.cross_entropy, opt, flat, [ChannelsLast()])


class InputLayout(nn.Module):
    """A layer that notes whether each input it sees is channels-last."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(x.is_contiguous(memory_format=NHWC))
        return x


def test_validate_get_preds_and_predict_run_channels_last_too():
    spy = InputLayout()
    learn = Learner(data(), nn.Sequential(spy, *convnet()), F.cross_entropy,
                    progress=False).to_channels_last()  # fmt: skip
    history = learn.fit(1, lr=0.01)
    spy.seen.clear()
    assert learn.validate()["valid_loss"] == history[-1]["valid_loss"]
    learn.get_preds()
    x = images(4, seed=2).tensors[0]
    learn.predict(x)
    learn.predict(x[0])
    assert spy.seen == [True] * (2 + 2 + 1 + 1)  # 2 batches twice, 2 predictions
    # A Learner not trained yet evaluates channels-last as well.
    fresh = Learner(data(), nn.Sequential(InputLayout(), *convnet()),
                    F.cross_entropy, progress=False).to_channels_last()  # fmt: skip
    fresh.get_preds()
    assert fresh.model[0].seen == [True, True]
    assert fresh.model[1].weight.is_contiguous(memory_format=NHWC)
