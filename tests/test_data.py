"""``fitlib.data``: ``DataBunch``, devices, and the batches the loop takes
from a loader: structure kept on a device, loaders that are empty, spent or
no loaders at all, batches that are no ``(x, y)`` pair and the code that fixes
them, and ``batch_fn``."""

from types import SimpleNamespace

import pytest
import torch
from helpers import make_data, make_dataset, make_model, train
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

from fitlib import DataBunch, HPOptimizer, fit, validate
from fitlib.callbacks import Recorder
from fitlib.data import FirstBatches, limit_batches, to_device
from fitlib.rng import loader_generators


def test_to_device_keeps_the_structure_of_the_batch():
    batch = ((torch.ones(2), [torch.zeros(1)]), {"k": torch.ones(3)}, "label")
    moved = to_device(batch, torch.device("cpu"))
    assert isinstance(moved, tuple) and isinstance(moved[0][1], list)
    assert torch.equal(moved[1]["k"], batch[1]["k"]) and moved[2] == "label"


def test_data_without_train_dl_says_how_to_wrap_loaders():
    with pytest.raises(
        TypeError, match=r"train_dl attribute; got DataLoader.*DataBunch"
    ):
        train(data=make_data().train_dl, epochs=1)


def test_empty_training_loader_is_caught_before_training():
    empty = DataLoader(TensorDataset(torch.zeros(0, 8), torch.zeros(0)))
    with pytest.raises(ValueError, match=r"^train_dl is empty \(len 0\)"):
        DataBunch(empty)
    with pytest.raises(ValueError, match=r"data.train_dl is empty \(len 0\)"):
        train(data=SimpleNamespace(train_dl=empty, valid_dl=None), epochs=1)


def test_loader_without_len_that_yields_nothing():
    with pytest.raises(ValueError, match="train_dl yielded no batches"):
        train(data=DataBunch(iter([])), epochs=1)


def test_batch_that_is_not_an_x_y_pair():
    triples = [(torch.zeros(2, 8), torch.zeros(2).long(), torch.zeros(2))]
    three = r"\(Tensor.*, Tensor.*, Tensor.*\)"
    with pytest.raises(
        TypeError, match=rf"train_dl yielded a batch of {three}; .*pair"
    ):
        train(data=DataBunch(triples), epochs=1)


# -- loaders ---------------------------------------------------------------------
def test_a_dataset_where_a_loader_is_expected_is_refused():
    with pytest.raises(TypeError, match=r"train_dl is a Dataset \(TensorDataset\)"):
        DataBunch(make_dataset())
    with pytest.raises(TypeError, match=r"train_dl is None"):
        DataBunch(None)
    for_inference = DataBunch(None, make_data().valid_dl)  # evaluation only
    validate(make_model(), for_inference.valid_dl, F.cross_entropy)
    with pytest.raises(TypeError, match=r"data.train_dl is None"):
        train(data=for_inference, epochs=1)
    with pytest.raises(ValueError, match=r"dl is empty"):
        validate(make_model(), [], F.cross_entropy)


def test_devices_that_are_not_or_not_here_are_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"device 'tpu' is not a torch device"):
        DataBunch(make_data().train_dl, device="tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"'cuda' is not available.*device='cpu'"):
        DataBunch(make_data().train_dl, device="cuda")


def test_a_one_shot_iterator_is_refused_for_several_epochs_and_explained():
    batches = list(make_data().train_dl)
    with pytest.raises(ValueError, match=r"iterator \(generator\).*only once"):
        train(epochs=2, data=DataBunch(b for b in batches))
    train(epochs=1, data=DataBunch(b for b in batches))  # one pass is fine
    with pytest.raises(ValueError, match=r"(?s)can be iterated only once.*__iter__"):
        train(epochs=None, max_steps=100, data=DataBunch(b for b in batches))
    with pytest.raises(ValueError) as info:
        train(epochs=2, data=DataBunch(b for b in batches))
    namespace = {
        "DataBunch": DataBunch,
        "make_batches": lambda: (b for b in batches),
        "n_batches": len(batches),
        "valid_dl": None,
    }
    exec(advised_code(info.value), namespace)  # the advice, as written
    rec = Recorder()
    train(epochs=2, data=namespace["data"], callbacks=[rec])
    assert len(rec.losses) == 2 * len(batches)


def advised_code(error):
    """The code block of an error's fix (its lines indented by 4), in its
    message or its notes."""
    lines = "\n".join([str(error), *getattr(error, "__notes__", [])]).split("\n")
    return "\n".join(line[4:] for line in lines if line.startswith("    "))


@pytest.mark.parametrize("kind", ["dict", "triple"])
def test_the_fix_for_a_batch_that_is_no_pair_is_code_that_works(kind):
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    batch = {"image": x, "label": y} if kind == "dict" else (x, y, y.float())
    train_dl = valid_dl = [batch] * 2
    # A dict is taken as the model's inputs (model(**batch)): the model's
    # error then gives the fix.
    refused = r"model\(\*\*batch\).*batch_fn" if kind == "dict" else r"an \(x, y\) pair"
    with pytest.raises(TypeError, match=refused) as info:
        train(data=DataBunch(train_dl), epochs=1)
    code = advised_code(info.value)
    namespace = {"DataBunch": DataBunch, "train_dl": train_dl, "valid_dl": valid_dl}
    exec(code, namespace)  # the advice, as written

    def loss(out, y, *more):
        return F.cross_entropy(out, y)

    rec = Recorder()
    train(epochs=2, data=namespace["data"], loss_func=loss, callbacks=[rec])
    assert len(rec.losses) == 4  # two epochs: the wrapper lasts


def test_a_sized_iterator_that_restarts_in_iter_is_a_fine_loader():
    class Prefetcher:  # its own iterator, restarted by __iter__ each epoch
        def __init__(self, dl):
            self.dl, self.it = dl, None

        def __iter__(self):
            self.it = iter(self.dl)
            return self

        def __next__(self):
            return next(self.it)

        def __len__(self):
            return len(self.dl)

    rec = Recorder()
    train(epochs=2, data=DataBunch(Prefetcher(make_data().train_dl)), callbacks=[rec])
    assert len(rec.losses) == 14


def test_a_spent_sized_iterator_stops_an_endless_fit_with_an_error():
    class Once:  # says it has 7 batches, but yields them only once
        def __init__(self, batches):
            self.it = iter(batches)

        def __iter__(self):
            return self

        def __next__(self):
            return next(self.it)

        def __len__(self):
            return 7

    with pytest.raises(ValueError, match=r"train_dl yielded no batches.*only once"):
        train(epochs=None, max_steps=100, data=DataBunch(Once(make_data().train_dl)))


def test_a_batch_fn_returning_numpy_arrays_is_refused_at_the_first_batch():
    x, y = make_dataset(32).tensors
    batches = [{"x": x[i : i + 16].numpy(), "y": y[i : i + 16].numpy()}
               for i in (0, 16)]  # fmt: skip
    data = DataBunch(batches, batches, device="cpu",
                     batch_fn=lambda b: (b["x"], b["y"]))  # fmt: skip
    recorder = Recorder()
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match=(
        r"batch_fn <lambda> returned \(ndarray, ndarray\) for a batch of "
        r"train_dl: numpy arrays \(the first: shape \(16, 8\), float32\), where "
        r"fitlib needs tensors .*Fix: .*torch\.as_tensor"
    )):  # fmt: skip
        fit(1, model, F.cross_entropy, opt, data, [recorder])
    assert recorder.losses == []  # refused before any step


# -- caps on batches (fit's train_batches, valid_batches) -------------------------
class CountingLoader:
    """A shuffled DataLoader that counts the batches fetched from it."""

    def __init__(self, n=100, bs=16):
        self.dl = DataLoader(make_dataset(n), bs, shuffle=True)
        self.fetched = 0

    def __iter__(self):
        for batch in self.dl:
            self.fetched += 1
            yield batch

    def __len__(self):
        return len(self.dl)


def test_first_batches_draws_a_new_order_each_pass_and_fetches_no_more():
    loader = CountingLoader()
    capped = FirstBatches(loader, 3)
    torch.manual_seed(0)
    first, second = list(capped), list(capped)
    assert len(capped) == len(first) == len(second) == 3 and loader.fetched == 6
    assert not torch.equal(first[0][1], second[0][1])  # shuffled anew


def test_a_cap_above_the_loaders_length_is_the_loaders_length():
    capped = FirstBatches(DataLoader(make_dataset(100), 16), 50)
    assert len(capped) == len(list(capped)) == 7
    assert repr(capped) == "FirstBatches(DataLoader, 7 of 7 batches)"


def test_a_loader_without_a_length_gets_the_caps_length_and_a_generator_goes_on():
    batches = ((torch.full((2, 8), float(i)), torch.zeros(2).long()) for i in range(9))
    capped = FirstBatches(batches, 4)
    assert (
        len(capped) == 4 and repr(capped) == "FirstBatches(generator, 4 of ? batches)"
    )
    assert [b[0][0, 0].item() for b in capped] == [0, 1, 2, 3]
    assert [b[0][0, 0].item() for b in capped] == [4, 5, 6, 7]  # the next pass


def test_the_loaders_sampler_and_generators_show_through_for_rng_states():
    g = torch.Generator().manual_seed(3)
    dl = DataLoader(make_dataset(100), 16, shuffle=True, generator=g)
    capped = FirstBatches(dl, 2)
    assert capped.sampler is dl.sampler and capped.generator is g
    assert capped.dataset is dl.dataset and capped.batch_size == 16
    assert loader_generators(capped) == loader_generators(dl) == [g]


def test_limit_batches_caps_a_copy_and_leaves_the_data_as_it_was():
    data = make_data()
    limited = limit_batches(data, train_batches=2, valid_batches=1)
    assert (len(limited.train_dl), len(limited.valid_dl)) == (2, 1)
    assert limited.train_dl.loader is data.train_dl and len(data.train_dl) == 7
    assert limited.batch_fn is data.batch_fn and limited.device == data.device
    assert limit_batches(data) is data  # no cap: the data itself


@pytest.mark.parametrize(
    "kwargs, error, match",
    [({"train_batches": 0}, ValueError, r"fit: train_batches must be an int >= 1"),
     ({"valid_batches": 2.0}, TypeError, r"valid_batches must be an int >= 1 or "
      r"None; got 2\.0 \(float\)"),
     ({"train_batches": True}, TypeError, "got True")],
    ids=str,
)  # fmt: skip
def test_a_cap_that_is_no_int_from_1_is_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        limit_batches(make_data(), **kwargs)
