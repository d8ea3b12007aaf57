import copy
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import child_env, kill_until_done, make_data, make_dataset, make_model
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils._pytree import tree_leaves
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    SubsetRandomSampler,
    TensorDataset,
)

import fitlib.batch_size_finder
import fitlib.ranks
from fitlib import Callback, DataBunch, HPOptimizer, MultiOptimizer, fit
from fitlib.batch_size_finder import Trial, find_batch_size, resized_loader
from fitlib.peak_memory import PeakMemory
from fitlib.serialization import safe_load

pytestmark = pytest.mark.usefixtures("one_thread")  # small models: faster


class RunsOutAbove(nn.Module):
    """make_model's MLP that raises CUDA's out-of-memory error on a training
    batch of more than ``limit`` samples (the ``at_call``-th time it sees
    one of ``flaky`` samples too): a GPU's failures, on the CPU."""

    def __init__(self, limit: int, flaky: int | None = None, at_call: int = 0):
        super().__init__()
        self.net, self.limit = make_model(), limit
        self.flaky, self.at_call, self.calls = flaky, at_call, 0

    def forward(self, x):
        n = x.shape[0]
        self.calls += n == self.flaky
        flaky = n == self.flaky and self.calls == self.at_call
        if self.training and (n > self.limit or flaky):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate")
        return self.net(x)


def search(model=None, n_train=1000, **kwargs):
    """find_batch_size on make_data(n_train) with SGD; a budget of 1 GB
    (never reached here) unless given."""
    model = model or make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    kwargs = {"max_memory": "1GB", "verbose": False, **kwargs}
    return find_batch_size(model, F.cross_entropy, opt, make_data(n_train), **kwargs)


def sizes(result):
    return [t.size for t in result.trials]


# -- the search ------------------------------------------------------------------
def test_power_mode_doubles_until_out_of_memory_and_returns_the_last_size_that_fit():
    found = search(RunsOutAbove(40))
    assert sizes(found) == [2, 4, 8, 16, 32, 64]
    assert found.batch_size == 32 and found.verified.size == 32
    assert found.first_failure.size == 64
    assert found.first_failure.why == "out of memory"
    assert found.stopped_by == "the first failure (power mode)"


def test_binsearch_mode_narrows_to_the_largest_size_that_fits():
    found = search(RunsOutAbove(40), mode="binsearch")
    assert sizes(found) == [2, 4, 8, 16, 32, 64, 48, 40, 44, 42, 41]
    assert found.batch_size == 40
    assert found.stopped_by == "the binary search (40 fits, 41 does not)"


def test_a_first_size_too_large_is_halved_until_one_fits():
    assert sizes(search(RunsOutAbove(40), init_val=100)) == [100, 50, 25]
    assert search(RunsOutAbove(40), init_val=100, mode="binsearch").batch_size == 40


def test_init_val_is_the_first_size_tried():
    assert sizes(search(RunsOutAbove(40), init_val=3))[:3] == [3, 6, 12]


def test_stops_at_max_batch_size_and_says_so():
    found = search(RunsOutAbove(1000), max_batch_size=20)
    assert sizes(found) == [2, 4, 8, 16, 20]
    assert found.batch_size == 20 and found.first_failure is None
    assert found.stopped_by == "max_batch_size=20"


def test_stops_at_the_size_of_the_data_set():
    found = search(RunsOutAbove(1000), n_train=100, mode="binsearch")
    assert sizes(found) == [2, 4, 8, 16, 32, 64, 100]
    assert found.batch_size == 100
    assert found.stopped_by == "the data set's size (100 samples)"


def test_stops_after_max_trials_with_the_largest_size_that_fit():
    found = search(RunsOutAbove(1000), max_trials=3)
    assert sizes(found) == [2, 4, 8]
    assert found.batch_size == 8 and found.stopped_by == "max_trials=3"


def test_a_size_that_fails_its_verification_gives_way_to_the_next_that_fit():
    # 32 fits in the search, then runs out of memory when it is verified.
    found = search(RunsOutAbove(40, flaky=32, at_call=4), steps_per_trial=3)
    assert found.batch_size == 16 and found.verified.size == 16
    assert sizes(found) == [2, 4, 8, 16, 32, 64, 32]
    assert not found.trials[-1].fit


def test_raises_with_what_it_tried_when_not_even_one_sample_fits():
    with pytest.raises(ValueError, match=r"no batch size fits: tried 2 \(out of "):
        search(RunsOutAbove(0))


def test_an_error_other_than_out_of_memory_is_raised_and_the_model_put_back():
    class Broken(RunsOutAbove):
        def forward(self, x):
            if x.shape[0] == 8:
                raise ValueError("a bug in the model")
            return self.net(x)

    model = Broken(1000)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="a bug in the model"):
        search(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# -- the CPU's memory budget -------------------------------------------------------
def test_on_the_cpu_the_estimate_grows_with_the_batch_and_is_the_same_each_run():
    runs = [search(max_memory="60kB", mode="binsearch") for _ in range(2)]
    first, second = ([(t.size, t.peak) for t in r.trials] for r in runs)
    assert first == second
    fitting = sorted((size, peak) for size, peak in first if peak <= 60_000)
    peaks = [peak for _, peak in fitting]
    # The smallest batches share a floor: the sampler's permutation of the
    # data set's indices (8 kB), drawn at the epoch's start.
    assert peaks == sorted(peaks) and peaks[-1] > peaks[0]
    found = runs[0]
    assert found.verified.peak <= 60_000 < found.first_failure.peak
    assert found.stopped_by.startswith("the binary search")
    assert "over the 60 kB budget" in found.first_failure.why


def test_a_peak_read_after_the_trial_is_held_to_the_budget(monkeypatch):
    """As on CUDA, whose allocator's peak is read once the trial is over (it
    cannot stop a step part way): a meter that only measures."""

    class MeasuresOnly(PeakMemory):
        def __init__(self, device, tensors=(), limit=None):
            super().__init__(device, tensors, limit=None)

    monkeypatch.setattr(fitlib.batch_size_finder, "PeakMemory", MeasuresOnly)
    found = search(max_memory="60kB", mode="binsearch")
    assert found.first_failure.why.startswith("over the 60 kB budget: peak ")
    assert found.first_failure.peak > 60_000 >= found.verified.peak
    assert found.stopped_by.startswith("the binary search")


def test_a_budget_too_small_for_the_model_itself_fits_nothing():
    with pytest.raises(ValueError, match=r"over the 1 kB budget"):
        search(max_memory=1000)


def test_the_cpu_needs_a_memory_budget_and_says_how_to_give_it():
    with pytest.raises(ValueError, match=r"Fix: .*, e\.g\. max_memory='2GB'\.$"):
        search(max_memory=None)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"mode": "binary"},
            r"mode must be 'power' or 'binsearch'; got 'binary' "
            r"\(did you mean 'binsearch'\?\)\. Fix: e\.g\. "
            r"mode='binsearch'\.$",
        ),
        ({"init_val": 0}, r"init_val must be an int >= 1; got 0"),
        ({"steps_per_trial": 1.5}, "steps_per_trial must be an int"),
        ({"max_batch_size": 0}, "max_batch_size must be an int >= 1"),
        ({"max_memory": "lots"}, "max_memory must be a size of memory"),
        ({"apply": "yes"}, "apply must be True or False"),
    ],
)
def test_refuses_bad_arguments_before_any_trial(kwargs, match):
    model = RunsOutAbove(1000)
    with pytest.raises(ValueError, match=match):
        search(model, **kwargs)
    assert model.calls == 0 and not any(p.grad is not None for p in model.parameters())


def test_refuses_a_loader_it_cannot_rebuild_with_another_batch_size():
    ds = make_dataset(64)
    sampler = BatchSampler(RandomSampler(ds), 16, drop_last=False)
    data = DataBunch(DataLoader(ds, batch_sampler=sampler), device="cpu")
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match=r"DataLoader built with a batch_size.*"
                       "BatchSampler"):  # fmt: skip
        find_batch_size(model, F.cross_entropy, opt, data, max_memory="1GB")


# -- every state put back ------------------------------------------------------------
class CountsBatches(Callback):
    """A stateful callback: the training batches it saw, and their sizes."""

    def __init__(self):
        self.n, self.sizes = 0, []

    def on_batch_begin(self, train, last_input):
        if train:
            self.n += 1
            self.sizes.append(last_input.shape[0])

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def seeded_run():
    """A model with batch norm and dropout, Adam with state (a first epoch
    trained), a loader shuffled by its own generator."""
    torch.manual_seed(0)
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.Adam, lr=1e-2)
    loader = DataLoader(make_dataset(96), 16, shuffle=True,
                        generator=torch.Generator().manual_seed(1))  # fmt: skip
    data = DataBunch(loader, DataLoader(make_dataset(32, seed=1), 16), device="cpu")
    fit(1, model, F.cross_entropy, opt, data)
    return model, opt, data


def test_a_fit_after_the_finder_trains_exactly_as_one_without_it():
    random.seed(3)
    np.random.seed(3)
    plain, plain_opt, plain_data = seeded_run()
    fit(2, plain, F.cross_entropy, plain_opt, plain_data)
    after_plain = (torch.rand(3), np.random.rand(), random.random())

    random.seed(3)
    np.random.seed(3)
    model, opt, data = seeded_run()
    counter = CountsBatches()
    found = find_batch_size(
        model, F.cross_entropy, opt, data, callbacks=[counter],
        max_memory="60kB", mode="binsearch", verbose=False,
    )  # fmt: skip
    assert len(found.trials) > 5 and max(counter.sizes) > 16  # it trained
    assert counter.n == 0  # its callback's state is put back
    fit(2, model, F.cross_entropy, opt, data)
    after = (torch.rand(3), np.random.rand(), random.random())

    pairs = zip(model.state_dict().values(), plain.state_dict().values())
    assert all(torch.equal(a, b) for a, b in pairs)  # BN statistics included
    adam = [s["exp_avg"] for s in opt.opt.state.values()]
    plain_adam = [s["exp_avg"] for s in plain_opt.opt.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(adam, plain_adam, strict=True))
    assert torch.equal(after[0], after_plain[0]) and after[1:] == after_plain[1:]


def test_puts_back_the_modes_and_gradients_and_leaves_the_loaders():
    model, opt, data = seeded_run()
    model.eval()
    model[0].train()
    grads = [torch.full_like(p, 0.5) for p in model.parameters()]
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    loaders = data.train_dl, data.valid_dl
    find_batch_size(model, F.cross_entropy, opt, data, max_memory="60kB",
                    verbose=False)  # fmt: skip
    assert [m.training for m in model.modules()] == [False, True, False, False,
                                                      False, False]  # fmt: skip
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert (data.train_dl, data.valid_dl) == loaders
    assert data.train_dl.batch_size == 16


def test_several_optimizers_have_their_states_put_back():
    model = make_model()
    opt = MultiOptimizer({
        "body": HPOptimizer(model[:2].parameters(), torch.optim.Adam, lr=1e-3),
        "head": HPOptimizer(model[4].parameters(), torch.optim.SGD, lr=0.1, mom=0.9),
    })  # fmt: skip
    fit(1, model, F.cross_entropy, opt, make_data())
    before = tree_leaves(copy.deepcopy(opt.state_dict()))
    found = find_batch_size(model, F.cross_entropy, opt, make_data(400),
                            max_memory="40kB", verbose=False)  # fmt: skip
    after = tree_leaves(opt.state_dict())
    assert found.batch_size > 16 and len(after) == len(before) > 10
    assert all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        for a, b in zip(after, before, strict=True)
    )


def test_apply_rebuilds_the_training_loader_with_the_size_found():
    model, opt, data = seeded_run()
    old, valid = data.train_dl, data.valid_dl
    found = find_batch_size(model, F.cross_entropy, opt, data, max_memory="60kB",
                            apply=True, verbose=False)  # fmt: skip
    assert data.train_dl.batch_size == found.batch_size != 16
    assert data.train_dl.sampler is old.sampler
    assert data.train_dl.generator is old.generator
    assert data.valid_dl is valid
    assert sum(len(y) for _, y in data.train_dl) == 96


def test_resized_loader_keeps_everything_but_the_batch_size():
    ds = make_dataset(50)
    loader = DataLoader(ds, 8, shuffle=True, drop_last=True,
                        collate_fn=lambda b: ("custom", len(b)))  # fmt: skip
    bigger = resized_loader(loader, 20)
    assert list(bigger) == [("custom", 20), ("custom", 20)]
    assert resized_loader(loader, 20, drop_last=False).drop_last is False


def test_says_in_one_line_what_it_tried_and_found(capsys):
    search(RunsOutAbove(40), mode="binsearch", verbose=True)
    out = capsys.readouterr().out
    assert re.fullmatch(
        r"find_batch_size: batch size 40 \(verified: peak \d\d\.\d+ kB of 1 GB\); "
        r"tried 2, 4, 8, 16, 32, 64 ✗, 48 ✗, 40, 44 ✗, 42 ✗, 41 ✗; first failure: "
        r"64 \(out of memory\); stopped by the binary search \(40 fits, 41 does "
        r"not\)\n",
        out,
    )


def test_a_run_that_searches_then_trains_resumes_exactly_after_sigkill(tmp_path):
    """A user's script, killed at random moments and rerun: each rerun finds
    the same size (the run's signature would refuse another) and the search
    does not disturb what the checkpoint restores."""
    env = child_env()
    child = [sys.executable, str(Path(__file__).parent / "batch_size_finder_child.py")]
    subprocess.run([*child, str(tmp_path / "ref"), str(tmp_path / "ref.pth")],
                   env=env, check=True, capture_output=True)  # fmt: skip
    cmd = [*child, str(tmp_path / "ckpt"), str(tmp_path / "run.pth")]
    kills = kill_until_done(cmd, env, seed=33)
    assert kills >= 2, "the run was too fast to kill: slow the child down"
    ref, run = safe_load(tmp_path / "ref.pth"), safe_load(tmp_path / "run.pth")
    assert run["batch_size"] == ref["batch_size"] != 16
    assert run["losses"] == ref["losses"]
    assert all(torch.equal(run["weights"][k], v) for k, v in ref["weights"].items())


def test_the_samples_an_epoch_draws_cap_the_size():
    ds = make_dataset(200)
    loader = DataLoader(ds, 16, sampler=SubsetRandomSampler(range(50)))
    model = make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    data = DataBunch(loader, device="cpu")
    found = find_batch_size(model, F.cross_entropy, opt, data, max_memory="1GB",
                            verbose=False)  # fmt: skip
    assert found.batch_size == 50
    assert found.stopped_by == "the data set's size (50 samples)"


def test_the_data_set_held_in_memory_is_not_counted():
    """The training set, a slice of a large tensor in memory, is not what a
    step takes: each trial's count is the same however large that tensor."""

    def peaks(rows):
        x, y = torch.randn(rows, 8), torch.randint(0, 3, (rows,))
        data = DataBunch(DataLoader(TensorDataset(x[:200], y[:200]), 16), device="cpu")
        model = make_model()
        opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        found = find_batch_size(model, F.cross_entropy, opt, data, verbose=False,
                                max_memory="1GB", max_batch_size=8)  # fmt: skip
        return [t.peak for t in found.trials]

    assert peaks(200) == peaks(100_000)


def test_a_trial_says_its_size_whether_it_fit_and_its_peak():
    assert str(Trial(32, True, peak=12_345)) == "batch size 32: fits, peak 12.35 kB"
    assert str(Trial(64, False, "out of memory")) == (
        "batch size 64: does not fit (out of memory)"
    )
    assert repr(Trial(8, True, peak=10)) == "Trial(batch size 8: fits, peak 10 B)"


def test_extra_memory_is_counted_as_held_through_every_trial():
    plain = search(max_batch_size=64)
    extra = search(max_batch_size=64, extra_memory="1MB")
    assert [t.peak - 10**6 for t in extra.trials] == [t.peak for t in plain.trials]
    smaller = search(max_memory=plain.trials[-1].peak + 10**6 - 1, extra_memory="1MB")
    assert smaller.batch_size < plain.batch_size == 64
    with pytest.raises(ValueError, match=r"extra_memory must be a size of memory"):
        search(extra_memory="lots")


def test_under_several_processes_every_one_takes_the_smallest_size_found(
    monkeypatch, capsys
):
    """Ranks that found different sizes (other GPUs, other loads) must not
    train with different batches: each takes the smallest, before apply."""
    monkeypatch.setattr(fitlib.ranks, "gather_to_all", lambda size: [size, 5, 12])
    data, model = make_data(200), make_model()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    found = find_batch_size(model, F.cross_entropy, opt, data, max_memory="1GB",
                            max_batch_size=16, apply=True)  # fmt: skip
    assert found.batch_size == data.train_dl.batch_size == 5
    assert found.verified.size == 16
    assert "the smallest over 3 processes (this one: 16)" in capsys.readouterr().out
