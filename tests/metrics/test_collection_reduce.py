"""Validation summed across processes equals one process over the whole set.

Ranks are simulated by threads that share a fake all-reduce (no process group),
each running ``validate`` on its shard with its own ``Metrics``.

How exact: count-based scores (F-scores, torchmetrics counts) are bit-identical,
since whole counts add up exactly in float64. Sums of float values (loss,
batch-mean metrics, squared errors) are added in another order, so they match
to float64 rounding (rel 1e-12) when each rank's batches are batches of the
one-process run. When the shards cut the set into other batches (every
world-th sample, as ``ShardSampler`` does), a batch-mean metric or loss is
rounded in float32 per batch before fitlib sums it, so those match only to
float32 rounding (rel 1e-6); per-sample sums (RMSE, R2, F-scores) stay exact.
"""

import functools
import threading
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, Subset, TensorDataset

from fitlib import validate
from fitlib.metrics import (
    RMSE,
    F1Score,
    FBeta,
    Metric,
    Metrics,
    R2Score,
    accuracy,
    error_rate,
    mae,
    mse,
    top_k_accuracy,
)

top2 = functools.partial(top_k_accuracy, k=2)
BS = 8
# The 6 batches of 41 samples (8, 8, 8, 8, 8, 1) dealt unevenly to 3 ranks.
BATCH_SHARDS = [[0, 3], [1, 4, 5], [2]]


class FakeGroup:
    """Threads as ranks; ``reducer(rank)`` sums every rank's tensor in rank
    order, as ``all_reduce`` would."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=30)
        self.inputs: list = [None] * world
        self.calls: list = [[] for _ in range(world)]

    def reducer(self, rank: int):
        def all_reduce(t):
            self.calls[rank].append(t.clone())
            self.inputs[rank] = t.clone()
            self.barrier.wait()
            total = sum(self.inputs[1:], self.inputs[0].clone())
            self.barrier.wait()  # no rank overwrites inputs before all summed
            return total

        return all_reduce

    def run(self, fn):
        """``fn(rank)`` on every rank at once; the results in rank order."""
        out, errors = [None] * self.world, []

        def target(r):
            try:
                out[r] = fn(r)
            except BaseException as e:
                errors.append(e)
                self.barrier.abort()

        threads = [
            threading.Thread(target=target, args=(r,)) for r in range(self.world)
        ]
        [t.start() for t in threads]
        [t.join() for t in threads]
        if errors:
            raise errors[0]
        return out


def distributed_validate(ds, shards, loss_func, make_metrics):
    """Each rank validates its shard (index lists) with its own Metrics."""
    group = FakeGroup(len(shards))

    def rank(r):
        ms = Metrics(make_metrics())
        ms.reducer = group.reducer(r)
        dl = DataLoader(Subset(ds, shards[r]), BS)
        return validate(nn.Identity(), dl, loss_func, metrics=ms)

    return group, group.run(rank)


def batch_aligned(shards, n):
    """Sample indices of each rank when it takes whole batches of size BS."""
    return [
        [i for b in bs for i in range(b * BS, min(n, (b + 1) * BS))] for bs in shards
    ]


def interleaved(n, world):
    """Every world-th sample, as DistributedTrainer's ShardSampler deals them."""
    return [list(range(r, n, world)) for r in range(world)]


def check(ds, shards, loss_func, make_metrics, exact, rel_float):
    """Every rank's results equal one validate() over the whole set."""
    one = validate(nn.Identity(), DataLoader(ds, BS), loss_func, metrics=make_metrics())
    group, ranks = distributed_validate(ds, shards, loss_func, make_metrics)
    for res in ranks:
        assert len(res) == len(one)
        for i, (got, want) in enumerate(zip(res, one, strict=True)):
            if i in exact:
                assert torch.equal(got, want), (i, got, want)
            else:
                assert got.item() == pytest.approx(want.item(), rel=rel_float[i])
    assert all(len(c) == 1 for c in group.calls)  # one collective per validate
    return one, ranks


def classification(n=41, c=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(n, c, generator=g), torch.randint(0, c, (n,), generator=g)
    )


def classification_metrics():
    return [
        accuracy,
        error_rate,
        top2,
        F1Score(),
        F1Score("micro"),
        FBeta(2.0, "micro"),
    ]


def test_batch_aligned_shards_give_the_whole_set_loss_and_metrics():
    ds = classification()
    shards = batch_aligned(BATCH_SHARDS, len(ds))
    assert sorted(i for s in shards for i in s) == list(range(41))  # each sample once
    rel = {i: 1e-12 for i in range(4)}  # loss, accuracy, error_rate, top2
    one, _ = check(ds, shards, F.cross_entropy, classification_metrics, {4, 5, 6}, rel)
    assert 0 < one[1].item() < 1  # not a degenerate score


def test_interleaved_shards_match_to_float32_rounding_of_batch_means():
    ds = classification()
    rel = {i: 1e-6 for i in range(4)}
    check(
        ds, interleaved(41, 2), F.cross_entropy, classification_metrics, {4, 5, 6}, rel
    )


def test_binary_f1_with_one_logit_sums_exactly():
    g = torch.Generator().manual_seed(1)
    out = torch.randn(41, 1, generator=g)
    ds = TensorDataset(out, (torch.rand(41, generator=g) > 0.4).float())

    def loss(o, y):
        return F.binary_cross_entropy_with_logits(o.squeeze(1), y)

    def make():
        return [accuracy, F1Score("binary")]

    check(ds, interleaved(41, 3), loss, make, {2}, {0: 1e-6, 1: 1e-6})


def test_regression_scores_sum_to_float64_rounding_even_interleaved():
    g = torch.Generator().manual_seed(2)
    y = 3 + 2 * torch.randn(41, 2, generator=g)  # an offset mean: R2's hard case
    ds = TensorDataset(y + 0.5 * torch.randn(41, 2, generator=g), y)

    def make():
        return [RMSE(), R2Score(), mse, mae]

    rel = {0: 1e-6, 1: 1e-12, 2: 1e-12, 3: 1e-6, 4: 1e-6}
    check(ds, interleaved(41, 3), F.mse_loss, make, set(), rel)
    check(
        ds,
        batch_aligned(BATCH_SHARDS, 41),
        F.mse_loss,
        make,
        set(),
        {i: 1e-12 for i in range(5)},
    )


def test_r2_of_fewer_than_two_samples_in_all_is_nan():
    ds = TensorDataset(torch.tensor([[1.0]]), torch.tensor([[2.0]]))
    _, ranks = distributed_validate(ds, [[0]], F.mse_loss, lambda: [R2Score()])
    assert torch.isnan(ranks[0][1])


def test_without_metrics_the_loss_alone_is_summed():
    ds = classification()
    one, ranks = check(ds, interleaved(41, 2), F.cross_entropy, list, set(), {0: 1e-6})
    assert len(one) == 1 and len(ranks[0]) == 1


def test_one_float64_tensor_holds_loss_count_and_every_metric_state():
    ds = classification()
    group, _ = distributed_validate(ds, interleaved(41, 2), F.cross_entropy,
                                    lambda: [accuracy, F1Score()])  # fmt: skip
    sent = group.calls[0][0]
    # loss sum, count; accuracy's sum and count; F1's 4x4 counts + 1 invalid
    assert sent.dtype == torch.float64 and sent.shape == (2 + 2 + 17,)
    assert sent[1].item() == 21  # rank 0's samples: 0, 2, ..., 40
    totals = sum(c[0] for c in group.calls)
    assert totals[1].item() == 41 and totals[4:].sum().item() == 41


def test_a_reducer_that_is_identity_gives_single_process_results():
    ds = classification()
    dl = DataLoader(ds, BS)
    plain = validate(
        nn.Identity(), dl, F.cross_entropy, metrics=classification_metrics()
    )
    ms = Metrics(classification_metrics())
    ms.reducer = lambda t: t
    reduced = validate(nn.Identity(), dl, F.cross_entropy, metrics=ms)
    assert [v.item() for v in reduced] == pytest.approx(
        [v.item() for v in plain], rel=1e-12
    )
    assert all(torch.equal(a, b) for a, b in zip(reduced[4:], plain[4:]))


class Mean(Metric):
    """A user metric that implements sums: the mean output."""

    name = "mean_out"

    def reset(self):
        self.total, self.n = torch.zeros((), dtype=torch.float64), 0

    def update(self, output, *targets):
        self.total = self.total + output.double().sum()
        self.n += output.numel()

    def compute(self):
        return self.total / self.n

    def sums(self):
        return [self.total, self.total.new_full((), self.n)]

    def load_sums(self, sums):
        self.total, self.n = sums


def test_a_user_metric_with_sums_takes_part():
    ds = classification()
    check(
        ds,
        interleaved(41, 2),
        F.cross_entropy,
        lambda: [Mean()],
        set(),
        {0: 1e-6, 1: 1e-12},
    )


class NoSums(Metric):
    name = "plain"

    def reset(self):
        self.n = 0

    def update(self, output, *targets):
        self.n += 1

    def compute(self):
        return torch.tensor(self.n)


def test_a_user_metric_without_sums_is_refused_when_the_reducer_is_set():
    ms = Metrics([accuracy, NoSums()])
    with pytest.raises(
        TypeError, match=r"(?s)metric 'plain'.*NoSums.*sums\(\).*Fix: implement"
    ):
        ms.reducer = lambda t: t
    assert ms.reducer is None
    ms.reducer = None  # turning it off never fails


def test_a_reducer_that_is_not_callable_is_refused():
    with pytest.raises(TypeError, match=r"reducer must be a function.*got int.*Fix"):
        Metrics([accuracy]).reducer = 3


def test_a_reducer_that_returns_none_says_how_to_wrap_all_reduce():
    ms = Metrics([accuracy])
    ms.reducer = lambda t: None  # dist.all_reduce returns None: a common slip
    dl = DataLoader(classification(), BS)
    with pytest.raises(
        TypeError, match=r"reducer returned NoneType.*all_reduce\(t\); return t"
    ):
        validate(nn.Identity(), dl, F.cross_entropy, metrics=ms)


def test_reduce_without_a_reducer_is_an_error():
    with pytest.raises(RuntimeError, match=r"needs a reducer.*Fix"):
        Metrics([accuracy]).reduce([torch.zeros(())])


def test_a_rank_without_data_for_an_f_score_says_so():
    ms = Metrics([F1Score()])
    ms.reducer = lambda t: t
    with pytest.raises(
        RuntimeError,
        match=r"(?s)metric 'f1_score'.*no data in this process.*Fix: give every",
    ):
        ms.reduce([torch.zeros(())])


def test_a_rank_without_data_for_a_batch_mean_takes_part_with_zeros():
    group = FakeGroup(2)
    out, y = classification()[:]

    def rank(r):
        ms = Metrics([accuracy])
        ms.reducer = group.reducer(r)
        if r == 0:
            ms.update(out, (y,))
        ms.reduce([torch.zeros(())])
        return ms.compute()[0]

    want = Metrics([accuracy])
    want.update(out, (y,))
    assert all(
        v.item() == pytest.approx(want.compute()[0].item()) for v in group.run(rank)
    )


def test_reducing_never_syncs(sync_counter):
    out, y = classification()[:]
    ms = Metrics([accuracy, F1Score(), RMSE(), R2Score()])
    ms.reducer = lambda t: t * 2
    ms.update(out[:, :1], ((y > 1).long(),))
    loss = torch.zeros((), dtype=torch.float64)
    ms.reduce([loss, loss.new_full((), 41)])
    ms.compute()
    assert sync_counter["n"] == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_validate_with_a_reducer_adds_no_sync_per_batch_on_cuda():
    ds = classification()
    x, y = (t.cuda() for t in ds[:])
    model = nn.Linear(4, 4).cuda()
    dl = [(x[i : i + BS], y[i : i + BS]) for i in range(0, 41, BS)]

    def syncs(loader):
        ms = Metrics(classification_metrics())
        ms.reducer = lambda t: t
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                res = validate(model, loader, F.cross_entropy, metrics=ms)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert all(v.device.type == "cuda" for v in res)
        return sum("synchroniz" in str(w.message) for w in caught)

    # The first batch's checks of the class targets (the loss's, then each
    # metric's) read them once per validate call: none per batch.
    few, many = syncs(dl), syncs(dl * 4)
    assert few == many, (few, many)


# -- torchmetrics --------------------------------------------------------------
def test_a_torchmetrics_metric_sums_its_count_states():
    classification_tm = pytest.importorskip("torchmetrics.classification")

    def make():
        return [classification_tm.MulticlassAccuracy(num_classes=4, average="micro")]

    check(classification(), interleaved(41, 3), F.cross_entropy, make, {1}, {0: 1e-6})


def test_a_torchmetrics_metric_does_not_sync_again_after_load_sums():
    aggregation = pytest.importorskip("torchmetrics.aggregation")
    # A metric that believes it runs in a 2-process group: its own sync would
    # count every state twice on top of fitlib's sums.
    twice = aggregation.SumMetric(
        distributed_available_fn=lambda: True, dist_sync_fn=lambda t, group=None: [t, t]
    )
    ms = Metrics([twice])
    ms.reducer = lambda t: t * 3  # 3 ranks with the same data
    ms.update(torch.tensor([1.0, 2.0]), ())
    ms.reduce([torch.zeros(())])
    assert ms.compute()[0].item() == 9.0
    ms.reset()
    ms.update(torch.tensor([1.0, 2.0]), ())
    assert ms.compute()[0].item() == 6.0  # without load_sums its sync is its own


def test_a_torchmetrics_metric_with_list_states_is_refused():
    classification_tm = pytest.importorskip("torchmetrics.classification")
    ms = Metrics([classification_tm.BinaryAUROC()])
    with pytest.raises(
        TypeError, match=r"(?s)binary_auroc.*state 'preds'.*dim_zero_cat.*Fix"
    ):
        ms.reducer = lambda t: t


def test_dense_class_metrics_sum_across_processes():
    """Per-pixel counts (ignored pixels left out) and perplexity's sums."""
    from fitlib.metrics import Accuracy, Dice, MeanIoU, Perplexity

    g = torch.Generator().manual_seed(3)
    out = torch.randn(41, 3, 4, 4, generator=g)
    y = torch.randint(0, 3, (41, 4, 4), generator=g)
    y[torch.rand(41, 4, 4, generator=g) < 0.2] = -100
    ds = TensorDataset(out, y)

    def make():
        return [
            Accuracy(ignore_index=-100),
            MeanIoU(ignore_index=-100),
            Dice(ignore_index=-100),
            Perplexity(),
        ]

    def no_loss(o, y):  # the metrics are under test here, not the loss
        return o.sum() * 0

    rel = {0: 0, 4: 1e-12}  # perplexity's float sums
    check(ds, interleaved(41, 3), no_loss, make, {1, 2, 3}, rel)
