"""The epoch's loss of a token (or pixel) loss is its mean over the whole
set's tokens, not the mean of the batches' means weighted by their samples:
``fitlib.running_loss.loss_count`` says what each batch's loss is a mean over
(and ``batch_size`` how many samples a batch holds)."""

import functools

import pytest
import torch
from test_sequences import Tagger, pairs
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

from fitlib import Callback, DataBunch, HPOptimizer, Learner, fit, validate
from fitlib.host_copy import to_floats
from fitlib.running_loss import RunningLoss, batch_size, loss_count
from fitlib.sequences import PadCollate, masked_cross_entropy


class ChannelsFirst(nn.Module):
    """The tagger's logits as ``(B, C, T)``, as ``F.cross_entropy`` takes them."""

    def __init__(self):
        super().__init__()
        self.tagger = Tagger()

    def forward(self, x, lengths):
        return self.tagger(x, lengths).transpose(1, 2)


class Frozen(Callback):
    """Skips every step: the weights stay, so the training loss is a mean
    over one fixed model, as a pass over the set computes it afterwards."""

    def on_backward_end(self):
        return {"skip_step": True}


def loaders(bs=4):
    # Lengths 2..7 in batches of 4: the batches' token counts differ a lot.
    collate = PadCollate()
    train = DataLoader(pairs(40), bs, collate_fn=collate)
    return DataBunch(train, DataLoader(pairs(30, seed=1), bs, collate_fn=collate))


def whole_set_mean(model, dl, loss_sum):
    """What one pass over the set computes: summed token losses / tokens."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for (x, lengths), y in dl:
            total += loss_sum(model.eval()(x, lengths), y).item()
            tokens += (y != -100).sum().item()
    return total / tokens


def sample_weighted_mean(model, dl, loss_func):
    """What weighting each batch's mean by its samples gives (the old way)."""
    total, n = 0.0, 0
    with torch.no_grad():
        for (x, lengths), y in dl:
            total += loss_func(model.eval()(x, lengths), y).item() * len(y)
            n += len(y)
    return total / n


CE_SUM = functools.partial(F.cross_entropy, ignore_index=-100, reduction="sum")
CASES = {
    "masked_cross_entropy": (
        Tagger,
        masked_cross_entropy,
        lambda out, y: CE_SUM(out.transpose(1, 2), y),
    ),
    "cross_entropy (B, C, T)": (ChannelsFirst, F.cross_entropy, CE_SUM),
    "CrossEntropyLoss with class weights": (
        ChannelsFirst,
        nn.CrossEntropyLoss(weight=torch.tensor([1.0, 3.0])),
        None,  # below: weighted by each token's class weight
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_train_and_valid_loss_are_the_whole_sets_token_means(case):
    model_class, loss_func, loss_sum = CASES[case]
    torch.manual_seed(0)
    model, data = model_class(), loaders()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    (record,) = fit(1, model, loss_func, opt, data, [Frozen()])
    if loss_sum is None:
        w = loss_func.weight

        def loss_sum(out, y):  # sum(w_y * loss) over tokens / sum(w_y)
            keep = y != -100
            per = F.cross_entropy(out, y, reduction="none", ignore_index=-100)
            return (w[y.where(keep, 0)] * per * keep).sum()

        def tokens(y):
            return (w[y.where(y != -100, 0)] * (y != -100)).sum().item()

    for key, dl in (("train_loss", data.train_dl), ("valid_loss", data.valid_dl)):
        want = whole_set_mean(model, dl, loss_sum)
        if case.startswith("CrossEntropyLoss"):
            total = sum(loss_sum(model(x, n), y).item() for (x, n), y in dl)
            want = total / sum(tokens(y) for _, y in dl)
        assert record[key] == pytest.approx(want, rel=1e-6), key
        old = sample_weighted_mean(model, dl, loss_func)
        assert abs(old - want) > 1e-4 * want  # far outside the tolerance above
    (valid_loss,) = validate(model, data.valid_dl, loss_func)
    assert valid_loss.item() == pytest.approx(record["valid_loss"], rel=1e-6)


def test_loss_parts_of_a_token_loss_are_token_means_too():
    def loss_func(out, y):
        ce = masked_cross_entropy(out, y)
        return {"loss": ce, "ce": ce}

    loss_func.count = masked_cross_entropy.count  # this dict loss averages tokens
    torch.manual_seed(0)
    model, data = Tagger(), loaders()
    learn = Learner(
        data, model, loss_func, metrics=[], progress=False, callbacks=[Frozen()]
    )
    (record,) = learn.fit(1, lr=0.1)
    assert record["train_ce"] == pytest.approx(record["train_loss"], rel=1e-6)
    assert record["valid_ce"] == pytest.approx(record["valid_loss"], rel=1e-6)
    want = whole_set_mean(model, data.valid_dl, CASES["masked_cross_entropy"][2])
    assert record["valid_loss"] == pytest.approx(want, rel=1e-6)


def test_what_counts_a_batch():
    y = torch.tensor([[1, 0, -100], [1, -100, -100]])
    assert loss_count(F.cross_entropy)(None, y).item() == 3
    zeros_out = torch.tensor([[1, 0, 2], [1, 0, 0]])
    assert loss_count(nn.CrossEntropyLoss(ignore_index=0))(None, zeros_out).item() == 3
    ignore_1 = functools.partial(F.cross_entropy, ignore_index=1)
    assert loss_count(ignore_1)(None, y).item() == 4
    masked = functools.partial(masked_cross_entropy, ignore_index=1)
    assert loss_count(masked)(None, y).item() == 4
    # One class index per sample: weighted by samples, as before.
    assert loss_count(F.cross_entropy)(None, torch.tensor([1, 0])) is None
    assert loss_count(F.mse_loss) is None


def test_a_running_loss_with_token_counts_saves_and_resumes_exactly():
    losses = [torch.tensor(v) for v in (1.0, 2.0, 4.0)]
    counts = [torch.tensor(n) for n in (1, 5, 2)]
    whole = RunningLoss()
    for v, n in zip(losses, counts, strict=True):
        whole.add(v, n)
    first = RunningLoss()
    first.add(losses[0], counts[0])
    resumed = RunningLoss()
    resumed.load_state_dict(first.state_dict())
    for v, n in zip(losses[1:], counts[1:], strict=True):
        resumed.add(v, n)
    want = (1 * 1 + 2 * 5 + 4 * 2) / 8
    assert whole.mean(to_floats(whole.pending())) == pytest.approx(want)
    assert resumed.mean(to_floats(resumed.pending())) == pytest.approx(want)
    assert resumed.state_dict() == pytest.approx(whole.state_dict())


def test_under_a_process_group_the_token_counts_are_summed_too(one_process_group):
    torch.manual_seed(0)
    model, data = Tagger(), loaders()
    learn = Learner(
        data, model, masked_cross_entropy, metrics=[], progress=False,
        callbacks=[Frozen()],
    )  # fmt: skip
    learn.to_distributed(backend="gloo")
    (record,) = learn.fit(1, lr=0.1)
    loss_sum = CASES["masked_cross_entropy"][2]
    want = whole_set_mean(learn.model, data.valid_dl, loss_sum)
    assert record["valid_loss"] == pytest.approx(want, rel=1e-6)
    want = whole_set_mean(learn.model, data.train_dl, loss_sum)
    assert record["train_loss"] == pytest.approx(want, rel=1e-6)


def test_a_batch_with_every_target_ignored_adds_nothing():
    def loaders_with_an_empty_batch():
        collate = PadCollate()
        items = pairs(12, seed=2)
        empty = [(x, torch.full_like(y, -100)) for x, y in pairs(4, seed=3)]
        return DataLoader(items[:4] + empty + items[4:], 4, collate_fn=collate)

    torch.manual_seed(0)
    model, dl = Tagger(), loaders_with_an_empty_batch()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    (record,) = fit(1, model, masked_cross_entropy, opt, DataBunch(dl, dl), [Frozen()])
    want = whole_set_mean(model, dl, CASES["masked_cross_entropy"][2])
    assert record["train_loss"] == pytest.approx(want, rel=1e-6)
    assert record["valid_loss"] == pytest.approx(want, rel=1e-6)


def test_a_summed_loss_is_weighted_by_samples_as_before():
    summed = functools.partial(F.cross_entropy, reduction="sum")
    assert loss_count(summed) is None
    assert loss_count(nn.CrossEntropyLoss(reduction="sum")) is None


def with_count(count):
    def loss_func(out, y):
        return masked_cross_entropy(out, y)

    loss_func.count = count
    return loss_func


@pytest.mark.parametrize(
    ("count", "error"),
    [
        (7, r"count attribute that is not a function: 7 \(int\).*Fix"),
        (
            lambda out, y: (y != -100).sum(1),
            r"count returned Tensor\(shape=\(4,\).*0-dim",
        ),
        (lambda out, y: 2.5, r"count returned 2.5.*an int or a 0-dim tensor"),
    ],
    ids=["not callable", "per-sequence counts", "a float"],
)
def test_a_count_that_is_not_one_number_is_refused_with_the_fix(count, error):
    torch.manual_seed(0)
    model, data = Tagger(), loaders()
    learn = Learner(data, model, with_count(count), metrics=[], progress=False)
    with pytest.raises(TypeError, match=error):
        learn.fit(1, lr=0.1)
    assert learn.recorder.train_losses == []  # refused at the first batch


def test_a_count_with_the_wrong_signature_says_so():
    torch.manual_seed(0)
    learn = Learner(
        loaders(), Tagger(), with_count(lambda y: y.numel()), metrics=[], progress=False
    )
    with pytest.raises(TypeError) as info:
        learn.fit(1, lr=0.1)
    assert "loss_func.count(output, *targets)" in "".join(info.value.__notes__)


def test_a_count_may_be_a_python_int():
    torch.manual_seed(0)
    model, data = Tagger(), loaders()
    loss_func = with_count(lambda out, y: int((y != -100).sum()))
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    (record,) = fit(1, model, loss_func, opt, data, [Frozen()])
    want = whole_set_mean(model, data.valid_dl, CASES["masked_cross_entropy"][2])
    assert record["valid_loss"] == pytest.approx(want, rel=1e-6)


def test_class_indices_of_one_dim_stop_asking_after_the_first_batch(monkeypatch):
    from helpers import make_data, make_model

    import fitlib.callback_handler

    calls, real = [], fitlib.callback_handler.loss_count

    def spying(loss_func):
        count = real(loss_func)

        def spy(out, yb):
            calls.append(yb.shape)
            return count(out, yb)

        spy.by_shape = count.by_shape
        return spy

    monkeypatch.setattr(fitlib.callback_handler, "loss_count", spying)
    learn = Learner(make_data(), make_model(), F.cross_entropy, progress=False)
    learn.fit(2, lr=0.1)
    assert len(calls) == 1  # no call per step for (B,) class indices
    assert learn.recorder.train_losses[-1] < learn.recorder.train_losses[0]


def test_batch_size_reads_targets_then_inputs():
    assert batch_size(torch.zeros(7)) == 7
    assert batch_size((torch.zeros(5, 2), torch.zeros(5))) == 5
    assert batch_size(torch.tensor(1.0), {"x": torch.zeros(3, 1)}) == 3
