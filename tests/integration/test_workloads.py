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
        TypeError, match=r"(?s)inputs only: \(x,\), a tensor or a dict.*b\[1:\]"
    ):
        fit(1, model, F.mse_loss, opt, DataBunch(dl, None, device="cpu"))


# -- structured outputs ----------------------------------------------------------
class Detector(nn.Module):
    """SSD-style: class scores and a box per sample."""

    def __init__(self, out=lambda *heads: heads):
        super().__init__()
        self.body, self.cls, self.box = (
            nn.Linear(5, 16),
            nn.Linear(16, 3),
            nn.Linear(16, 4),
        )
        self.out = out

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.out(self.cls(h), self.box(h))


def detection_data(n=48, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    y_cls = x[:, :3].argmax(1)
    y_box = x[:, 1:5] * 2
    ds = TensorDataset(x, y_cls, y_box)

    def collate(b):  # (x, (y_cls, y_box)): two targets
        x, y_cls, y_box = (torch.stack(column) for column in zip(*b, strict=True))
        return x, (y_cls, y_box)

    train = DataLoader(ds, 8, shuffle=True, generator=g, collate_fn=collate)
    return (
        x,
        y_cls,
        y_box,
        DataBunch(train, DataLoader(ds, 20, collate_fn=collate), device="cpu"),
    )


def detection_loss(out, y_cls, y_box):
    ce, box = F.cross_entropy(out[0], y_cls), F.mse_loss(out[1], y_box)
    return {"loss": ce + box, "ce": ce, "box": box}


def test_a_two_head_model_trains_with_a_metric_per_head_and_its_loss_parts():
    from fitlib.metrics import Part, mse

    x, y_cls, y_box, data = detection_data()
    torch.manual_seed(0)
    metrics = [
        Part(accuracy, output=0, target=0),
        Part(mse, output=1, target=1, name="box_mse"),
    ]
    learn = Learner(data, Detector(), detection_loss, metrics=metrics, progress=False)
    history = learn.fit(4, lr=0.02)
    last = history[-1]
    assert {
        "accuracy",
        "box_mse",
        "train_ce",
        "valid_ce",
        "train_box",
        "valid_box",
    } <= last.keys()
    assert last["valid_box"] < history[0]["valid_box"]
    with torch.no_grad():
        cls, box = learn.model.eval()(x)
    assert last["accuracy"] == pytest.approx(
        (cls.argmax(1) == y_cls).double().mean().item()
    )
    assert last["box_mse"] == pytest.approx(F.mse_loss(box, y_box).item(), rel=1e-5)
    assert last["valid_box"] == pytest.approx(last["box_mse"], rel=1e-5)


def test_predict_keeps_the_structure_for_one_item_and_for_a_batch():
    x, _, _, data = detection_data()
    learn = Learner(data, Detector(), detection_loss, progress=False)
    with torch.no_grad():
        cls, box = learn.model.eval()(x[:4])
    one = learn.predict(x[0])
    assert isinstance(one, tuple) and [t.shape for t in one] == [(3,), (4,)]
    assert torch.allclose(one[0], cls[0]) and torch.allclose(one[1], box[0])
    batch = learn.predict(x[:4])
    assert [t.shape for t in batch] == [(4, 3), (4, 4)]
    assert torch.allclose(batch[1], box)


@pytest.mark.parametrize("kind", ["dict", "dataclass"])
def test_get_preds_and_predict_join_dict_and_dataclass_outputs(kind):
    import dataclasses

    @dataclasses.dataclass
    class Output:
        logits: torch.Tensor
        boxes: torch.Tensor

    make = (lambda c, b: {"logits": c, "boxes": b}) if kind == "dict" else Output
    x, y_cls, y_box, data = detection_data()
    model = Detector(out=make)

    def loss(out, y_cls, y_box):
        get = out.__getitem__ if kind == "dict" else functools.partial(getattr, out)
        return F.cross_entropy(get("logits"), y_cls) + F.mse_loss(get("boxes"), y_box)

    learn = Learner(data, model, loss, metrics=[Part_of("logits")], progress=False)
    learn.fit(1, lr=0.01)
    preds, targets = learn.get_preds()
    with torch.no_grad():
        want = learn.model.eval()(x)
    get = (lambda o, k: o[k]) if kind == "dict" else getattr
    assert type(preds) is type(want)
    assert torch.allclose(get(preds, "boxes"), get(want, "boxes"))
    assert torch.equal(targets[0], y_cls) and torch.equal(targets[1], y_box)
    one = learn.predict(x[0])
    assert get(one, "logits").shape == (3,)


def Part_of(key):  # noqa: N802
    from fitlib.metrics import Part

    return Part(accuracy, output=key, target=0)


def test_get_preds_pads_outputs_whose_length_varies_between_batches():
    lengths = [3, 5]  # batch 1: 3 tokens, batch 2: 5
    batches = []
    g = torch.Generator().manual_seed(4)
    for t in lengths:
        x = torch.randint(0, 4, (2, t), generator=g)
        batches.append((x, x.clone()))
    model = nn.Sequential(nn.Embedding(4, 8), nn.Linear(8, 4))

    def loss(out, y):
        return F.cross_entropy(out.transpose(1, 2), y)

    learn = Learner(
        DataBunch(batches[:1], batches, device="cpu"), model, loss, progress=False
    )
    preds, targets = learn.get_preds()
    assert preds.shape == (4, 5, 4) and targets.shape == (4, 5)
    assert torch.isnan(preds[:2, 3:]).all() and not torch.isnan(preds[:2, :3]).any()
    assert (targets[:2, 3:] == -100).all()
    assert torch.equal(targets[2:], batches[1][1]) and torch.equal(
        targets[:2, :3], batches[0][1]
    )


def test_a_metric_on_a_structured_output_says_how_to_point_it_at_a_part():
    from fitlib.metrics import Part

    _, _, _, data = detection_data()
    learn = Learner(
        data, Detector(), detection_loss, metrics=[accuracy], progress=False
    )
    with pytest.raises(
        TypeError,
        match=r"accuracy scores a tensor.*Part\(accuracy, output=0\).*\[0, 1\]",
    ):
        learn.validate()
    learn.metrics = [Part(accuracy, output="logits")]
    with pytest.raises(
        ValueError,
        match=r"no part 'logits' in accuracy: the output: its parts are \[0, 1\]",
    ):
        learn.validate()


def test_torchmetrics_pointed_at_one_head():
    classification = pytest.importorskip("torchmetrics.classification")
    from fitlib.metrics import Part

    x, y_cls, _, data = detection_data()
    tm = classification.MulticlassAccuracy(num_classes=3, average="micro")
    learn = Learner(
        data,
        Detector(),
        detection_loss,
        metrics=[Part(tm, output=0, target=0)],
        progress=False,
    )
    got = learn.validate()["multiclass_accuracy"]
    with torch.no_grad():
        cls, _ = learn.model.eval()(x)
    assert got == pytest.approx((cls.argmax(1) == y_cls).float().mean().item())


# -- loaders of another format ---------------------------------------------------
class DALIBatch:
    """A DALI-style batch: lists of tensors in ``data`` and ``label``."""

    def __init__(self, x, y):
        self.data, self.label = [x], [y]


class DALILoader:
    """Re-iterable, sized, yields ``DALIBatch`` objects (no (x, y) pairs)."""

    def __init__(self, x, y, bs):
        self.x, self.y, self.bs = x, y, bs
        self.epochs = 0

    def __len__(self):
        return -(-len(self.x) // self.bs)

    def __iter__(self):
        self.epochs += 1
        for i in range(0, len(self.x), self.bs):
            yield DALIBatch(self.x[i : i + self.bs], self.y[i : i + self.bs])


def dali_data(batch_fn):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 4, generator=g)
    y = (x[:, 0] > 0).long()
    return (
        x,
        y,
        DataBunch(
            DALILoader(x, y, 8), DALILoader(x, y, 16), device="cpu", batch_fn=batch_fn
        ),
    )


def test_batch_fn_adapts_a_loader_of_batch_objects_every_epoch():
    def from_dali(b):
        return b.data[0], b.label[0]

    x, y, data = dali_data(from_dali)
    torch.manual_seed(0)
    learn = Learner(
        data, nn.Linear(4, 2), F.cross_entropy, metrics=[accuracy], progress=False
    )
    history = learn.fit(3, lr=0.1)
    assert data.train_dl.epochs == 3 and data.valid_dl.epochs == 3
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    with torch.no_grad():
        want = (learn.model(x).argmax(1) == y).double().mean().item()
    assert history[-1]["accuracy"] == pytest.approx(want)
    preds, targets = learn.get_preds()  # the inference loop adapts too
    assert preds.shape == (40, 2) and torch.equal(targets, y)
    assert learn.validate()["accuracy"] == pytest.approx(want)


def test_batch_fn_returning_something_else_says_what_it_returned():
    _, _, data = dali_data(lambda b: b.data[0].tolist())
    learn = Learner(data, nn.Linear(4, 2), F.cross_entropy, progress=False)
    with pytest.raises(
        TypeError,
        match=r"<lambda> returned \[\[float.*8 items\] for a batch of train_dl.*\(x, y",
    ):
        learn.fit(1, lr=0.1)
    with pytest.raises(TypeError, match=r"batch_fn must be a function or None; got 3"):
        DataBunch([], None, batch_fn=3)


def test_get_preds_on_a_test_set_without_labels_needs_no_loss():
    x = detection_data()[0]
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    train = DataLoader(TensorDataset(x, x[:, :3].argmax(1)), 8)
    learn = Learner(
        DataBunch(train, None, device="cpu"), model, F.cross_entropy, progress=False
    )
    preds, targets = learn.get_preds(dl=DataLoader(TensorDataset(x), 16))
    assert targets is None
    with torch.no_grad():
        assert torch.allclose(preds, model(x))


def test_predict_tells_one_item_from_a_batch_with_loaders_that_are_lists():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(6, 2))
    batches = [(torch.randn(4, 2, 3), torch.zeros(4, dtype=torch.long))]
    learn = Learner(
        DataBunch(batches, batches, device="cpu"),
        model,
        F.cross_entropy,
        progress=False,
    )
    item = batches[0][0][1]
    with torch.no_grad():
        want = model(item[None])[0]
    assert torch.allclose(learn.predict(item), want)
    assert learn.predict(batches[0][0]).shape == (4, 2)


def test_a_metric_of_the_output_alone_on_inputs_only_batches():
    x, train_dl, valid_dl = autoencoder_loaders(as_tuple=True)

    def code_size(out):  # a user's metric of a structured output, no targets
        return out[0].abs().mean()

    learn = Learner(
        DataBunch(train_dl, valid_dl, device="cpu"),
        AutoEncoder(),
        reconstruction,
        metrics=[code_size],
        progress=False,
    )
    with torch.no_grad():
        want = learn.model.enc(x).abs().mean().item()
    assert learn.validate()["code_size"] == pytest.approx(want, rel=1e-5)


def test_a_part_of_the_output_with_several_targets_must_name_its_target():
    from fitlib.metrics import Part

    _, _, _, data = detection_data()
    learn = Learner(
        data,
        Detector(),
        detection_loss,
        metrics=[Part(accuracy, output=0)],
        progress=False,
    )
    with pytest.raises(
        ValueError, match=r"have 2 targets.*Part\(\.\.\., output=0, target=0\)"
    ):
        learn.validate()


def test_a_loss_that_needs_targets_on_batches_without_them_says_so():
    _, train_dl, valid_dl = autoencoder_loaders(as_tuple=True)
    learn = Learner(
        DataBunch(train_dl, valid_dl, device="cpu"),
        nn.Linear(6, 6),
        F.mse_loss,
        progress=False,
    )
    with pytest.raises(TypeError, match=r"The batch has no targets.*return \(x, y\)"):
        learn.fit(1, lr=0.1)
