"""``fitlib.data``: ``DataBunch``, devices, and the batches the loop takes
from a loader: structure kept on a device, loaders that are empty, spent or
no loaders at all, batches that are no ``(x, y)`` pair and the code that fixes
them, ``batch_fn``, and batches copied to a CUDA device on a side stream
(``prefetch``; the tests marked ``cuda`` run on a GPU, ``make gpu-check``)."""

import warnings
from types import SimpleNamespace

import pytest
import torch
from helpers import Crash, make_data, make_dataset, make_model, same_weights, train
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, Dataset, TensorDataset

import fitlib.data
from fitlib import DataBunch, HPOptimizer, Learner, fit, validate
from fitlib.callbacks import Checkpoint, Recorder
from fitlib.data import (
    FirstBatches,
    _SideStreamCopy,
    batches,
    limit_batches,
    side_stream_copy,
    to_device,
)
from fitlib.metrics import accuracy
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


# -- side-stream copies to a CUDA device (prefetch) ------------------------------
# The CUDA tests (marked) run on a GPU machine; on the CPU a stand-in for
# torch.cuda shows the order of what the copier does.
class FakeCuda:
    """torch.cuda's stream calls, logged; ``current_device`` for a bare 'cuda'."""

    def __init__(self, log):
        self.log = log

    def Stream(self, device):  # noqa: N802 (torch's name)
        return SimpleNamespace(name="side")

    def current_stream(self, device):
        log = self.log
        return SimpleNamespace(
            name="current", wait_stream=lambda s: log.append(("wait", s.name))
        )

    def stream(self, s):
        log = self.log

        class Context:
            def __enter__(self):
                log.append(("enter", s.name))

            def __exit__(self, *exc):
                log.append(("exit", s.name))

        return Context()


class FakeCopy(_SideStreamCopy):
    """Copies to the meta device's stand-in: a clone, logged with its value."""

    def upload(self, t):
        self.cuda.log.append(("upload", t.flatten()[0].item()))
        return t.clone()

    def used_by(self, t, stream):
        self.cuda.log.append(("used_by", stream.name))


def fake_copy(log, pinned_only=False):
    return FakeCopy(torch.device("meta"), cuda=FakeCuda(log), pinned_only=pinned_only)


def test_the_default_copies_plainly_on_the_cpu_and_prefetch_true_is_refused_there():
    cpu = torch.device("cpu")
    assert side_stream_copy(cpu, None) is None and side_stream_copy(cpu, False) is None
    assert make_data().prefetch is None
    fix = r"Fix: prefetch=None \(the default\) or device='cuda'"
    with pytest.raises(ValueError, match=rf"^DataBunch: prefetch=True .*cpu\. {fix}"):
        DataBunch(make_data().train_dl, device="cpu", prefetch=True)
    with pytest.raises(ValueError, match=rf"^train_dl: prefetch=True .*cpu\. {fix}"):
        next(batches(make_data().train_dl, cpu, "train_dl", prefetch=True))


def test_prefetch_is_true_false_or_none_and_shows_when_given():
    with pytest.raises(TypeError, match=r"DataBunch: prefetch must be True or False; "
                       r"got 'yes' \(str\)\. Fix: e\.g\. DataBunch\(train_dl, "
                       r"valid_dl, prefetch=False\) \(or left out\)"):  # fmt: skip
        DataBunch(make_data().train_dl, prefetch="yes")
    off = DataBunch(make_data().train_dl, device="cpu", prefetch=False)
    assert off.prefetch is False
    assert repr(off) == (
        "DataBunch(7 train batches, None valid batches, device=cpu, prefetch=False)"
    )
    assert "prefetch" not in repr(make_data())
    capped = limit_batches(off, train_batches=2)
    assert capped.prefetch is False  # (a fit's caps keep it)


def test_a_side_stream_copy_moves_every_host_tensor_then_the_step_waits_once():
    log = []
    there = torch.zeros(2, device="meta")
    batch = ((torch.full((2,), 1.0), [torch.full((1,), 2.0)], there),
             {"k": torch.full((3,), 3.0), "name": "label"})  # fmt: skip
    moved = fake_copy(log)(batch)
    assert log == [("enter", "side"), ("upload", 1.0), ("upload", 2.0),
                   ("upload", 3.0), ("exit", "side"), ("wait", "side"),
                   ("used_by", "current"), ("used_by", "current"),
                   ("used_by", "current")]  # fmt: skip
    assert isinstance(moved[0][1], list) and moved[1]["name"] == "label"
    assert moved[0][2] is there  # on the device already: not copied
    assert torch.equal(moved[1]["k"], batch[1]["k"])
    log.clear()
    fake_copy(log)((there, ()))
    assert ("wait", "side") not in log  # nothing copied: nothing to wait for


def test_the_default_takes_the_side_stream_towards_cuda_for_pinned_batches_only(
    monkeypatch,
):
    made = []
    monkeypatch.setattr(fitlib.data, "_SideStreamCopy",
                        lambda device, **kw: made.append(kw) or "copier")  # fmt: skip
    cuda = torch.device("cuda", 0)
    assert side_stream_copy(cuda, None) == side_stream_copy(cuda, True) == "copier"
    assert made == [{"pinned_only": True}, {"pinned_only": False}]
    assert side_stream_copy(cuda, False) is None


def test_an_unpinned_batch_is_copied_plainly_by_default_a_pinned_one_on_the_side(
    monkeypatch,
):
    log = []
    batch = (torch.full((2, 8), 1.0), torch.zeros(2, dtype=torch.long))
    moved = fake_copy(log, pinned_only=True)(batch)  # a loader that did not pin
    assert log == []  # no side stream, no pinning: the plain non_blocking copy
    assert moved[0].device.type == "meta" and moved[1].device.type == "meta"
    nested = ({"x": batch[0]}, batch[1])
    fake_copy(log, pinned_only=True)(nested)
    assert log == []
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)  # pin_memory=True
    fake_copy(log, pinned_only=True)(batch)
    assert log[:3] == [("enter", "side"), ("upload", 1.0), ("upload", 0.0)]
    log.clear()
    fake_copy(log, pinned_only=True)(nested)
    assert ("enter", "side") in log and ("wait", "side") in log


def test_batches_fetch_each_batch_only_when_the_loop_asks_for_it(monkeypatch):
    """No read-ahead: a loader's random draws (augmentation) and a resumed
    epoch's batches stay where they are without side-stream copies."""
    log = []
    monkeypatch.setattr(fitlib.data, "side_stream_copy", lambda *a: fake_copy(log))

    def loader():
        for i in range(3):
            log.append(("fetch", i))
            yield torch.full((2, 8), float(i)), torch.full((2,), i)

    for x, _ in batches(loader(), torch.device("meta"), prefetch=True):
        log.append(("step", x[0, 0].item()))
    steps = [e for e in log if e[0] in ("fetch", "upload", "step")]
    assert steps == [(kind, i) for i in (0, 1, 2)
                     for kind in ("fetch", "upload", "upload", "step")]  # fmt: skip


def test_batches_copied_on_the_side_keep_their_order_form_and_ragged_last_batch(
    monkeypatch,
):
    log = []
    monkeypatch.setattr(fitlib.data, "side_stream_copy", lambda *a: fake_copy(log))
    meta = torch.device("meta")
    dl = DataLoader(make_dataset(37), 16)
    plain = list(batches(dl, torch.device("cpu")))
    side = list(batches(dl, meta, prefetch=True))
    assert [len(y) for _, y in side] == [16, 16, 5] == [len(y) for _, y in plain]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(plain, side))  # fmt: skip
    pairs = list(batches(dl, meta, batch_fn=lambda b: ({"x": b[0]},), prefetch=True))
    assert [tuple(p[0]) for p in pairs] == [("x",)] * 3 and pairs[0][1] == ()
    assert log.count(("wait", "side")) == 6  # one per copied batch


# -- on a GPU (make gpu-check) ---------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Augmented(Dataset):
    """``make_dataset``'s samples with noise drawn per item from torch's CPU
    generator, as a random augmentation draws: batches fetched in another
    order than the steps would get other noise."""

    def __init__(self, n):
        self.data = make_dataset(n)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return x + 0.1 * torch.randn(x.shape), y


def cuda_learner(prefetch, pin=False, callbacks=()):
    torch.manual_seed(0)
    train_dl = DataLoader(Augmented(100), 16, shuffle=True, pin_memory=pin)
    valid_dl = DataLoader(make_dataset(37, seed=1), 16)  # 7 and 3 batches, ragged
    data = DataBunch(train_dl, valid_dl, device="cuda", prefetch=prefetch)
    return Learner(data, make_model(), F.cross_entropy, metrics=[accuracy],
                   progress=False, callbacks=list(callbacks))  # fmt: skip


def count_side_copies(monkeypatch):
    calls = [0]
    copy = _SideStreamCopy.__call__

    def counted(self, batch):
        calls[0] += 1
        return copy(self, batch)

    monkeypatch.setattr(_SideStreamCopy, "__call__", counted)
    return calls


@pytest.mark.parametrize("pin", [False, True], ids=["unpinned", "pinned loader"])
@pytest.mark.cuda
@needs_cuda
def test_a_cuda_fit_with_side_stream_copies_equals_one_without_bit_for_bit(
    monkeypatch, pin
):
    calls = count_side_copies(monkeypatch)
    plain = cuda_learner(prefetch=False, pin=pin)
    plain_history = plain.fit(2, lr=1e-2)
    assert calls[0] == 0, (
        f"prefetch=False still made {calls[0]} side-stream copies: the loop "
        "(core.fit_states, validate) does not pass DataBunch.prefetch to batches()"
    )
    side = cuda_learner(prefetch=True, pin=pin)
    side_history = side.fit(2, lr=1e-2)
    assert calls[0] == 2 * (7 + 3), f"{calls[0]} side-stream copies, not 20"
    differ = [k for k, v in plain.model.state_dict().items()
              if not torch.equal(v, side.model.state_dict()[k])]  # fmt: skip
    same = untimed(side_history) == untimed(plain_history) and not differ
    if not same:  # is a plain fit on this GPU the same twice? (the message says)
        again = untimed(cuda_learner(prefetch=False, pin=pin).fit(2, lr=1e-2))
        pytest.fail(
            f"records {untimed(side_history)} with side-stream copies, "
            f"{untimed(plain_history)} without; weights that differ: {differ}; "
            f"a second plain fit equals the first: {again == untimed(plain_history)}"
        )
    assert side.recorder.losses == plain.recorder.losses


def untimed(history):
    return [{k: v for k, v in r.items() if k != "time"} for r in history]


@pytest.mark.parametrize("pinned", [False, True], ids=["unpinned", "pinned"])
@pytest.mark.cuda
@needs_cuda
def test_the_side_stream_copy_runs_while_the_current_stream_is_busy(pinned):
    device = torch.device("cuda", torch.cuda.current_device())
    copier = _SideStreamCopy(device)
    x = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
    x = x.pin_memory() if pinned else x
    torch.cuda.synchronize()
    torch.cuda._sleep(300_000_000)  # the step before: ~0.2 s of GPU work
    moved, _ = copier((x, ()))
    copier.side.synchronize()  # the host waits for the copy alone
    reader = torch.cuda.Stream(device)
    reader.wait_stream(copier.side)
    with torch.cuda.stream(reader):
        seen = moved.cpu()  # waits for the reader stream only
    busy = not torch.cuda.current_stream(device).query()
    after = (moved + 0).cpu()  # on the current stream: after its wait
    assert busy, "the current stream's work ended before the check: sleep longer"
    assert torch.equal(seen, x), (
        "the copy was not done while the current stream was busy: it waited "
        f"for the step (first values {seen.flatten()[:4].tolist()})"
    )
    assert torch.equal(after, x) and moved.device == device


@pytest.mark.cuda
@needs_cuda
def test_side_stream_copies_add_no_host_sync_per_step():
    def syncs(n_batches):
        torch.manual_seed(0)
        train_dl = DataLoader(make_dataset(16 * n_batches), 16, shuffle=True)
        data = DataBunch(train_dl, None, device="cuda", prefetch=True)
        learn = Learner(data, make_model(), F.cross_entropy, metrics=[],
                        progress=False)  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                learn.fit(2, lr=1e-2)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        found = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
        return len(found), found

    (few, _), (many, where) = syncs(4), syncs(16)
    assert few == many, f"{few} syncs in 8 steps, {many} in 32: {where}"


@pytest.mark.cuda
@needs_cuda
def test_a_cuda_fit_resumed_part_way_with_side_stream_copies_equals_an_unbroken_one(
    tmp_path,
):
    unbroken = cuda_learner(prefetch=True)
    unbroken.fit(2, lr=1e-2)
    broken = cuda_learner(True, callbacks=[Checkpoint(tmp_path, every_n_steps=3),
                                           Crash(at=9)])  # fmt: skip
    with pytest.raises(RuntimeError, match="crash"):
        broken.fit(2, lr=1e-2)
    resumed = cuda_learner(True, callbacks=[Checkpoint(tmp_path, every_n_steps=3)])
    resumed.fit(2, lr=1e-2)
    a, b = unbroken.recorder, resumed.recorder
    assert (a.losses, a.valid_losses) == (b.losses, b.valid_losses), (
        a.losses,
        b.losses,
    )
    assert same_weights(resumed, unbroken), "weights differ after the resume"
