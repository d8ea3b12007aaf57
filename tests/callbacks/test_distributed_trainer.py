"""DistributedTrainer in this process: off without torchrun; bad input, in a
one-process gloo group. tests/integration/test_distributed_trainer_torchrun.py
launches real 2-process runs."""

import pytest
import torch
from helpers import make_data, make_model
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, IterableDataset

from fitlib import Callback, DataBunch, Learner, ranks
from fitlib.callbacks import DistributedTrainer


def test_without_torchrun_it_does_nothing(monkeypatch, tmp_path):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    learn = Learner(make_data(), make_model(), F.cross_entropy, progress=False,
                    path=tmp_path).to_distributed()  # fmt: skip
    learn.fit(1, lr=0.1)
    assert not ranks.active() and not learn.callbacks[-1].enabled
    assert learn.recorder.epochs == [0] and type(learn.model).__name__ == "Sequential"


def test_a_learner_on_the_cpu_picks_gloo_where_cuda_is_visible(monkeypatch, tmp_path):
    # With one GPU on the host, NCCL would put rank 1 on cuda:1 and fail; a
    # Learner whose DataBunch says "cpu" trains on the CPU, so gloo.
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    learn = Learner(make_data(), make_model(), F.cross_entropy, progress=False,
                    path=tmp_path).to_distributed()  # fmt: skip
    assert learn.callbacks[-1].backend == "gloo"
    assert learn.to_distributed(backend="nccl").callbacks[-1].backend == "nccl"


def test_under_a_launcher_it_trains_and_gives_the_plain_model_back(one_process_group):
    learn = Learner(make_data(), make_model(), F.cross_entropy, progress=False)
    learn.to_distributed(backend="gloo")
    learn.fit(2, lr=0.1)
    assert ranks.active() and ranks.world_size() == 1
    assert learn.recorder.epochs == [0, 1] and learn.metrics  # validation ran
    assert learn.opt.param_groups[0]["params"][0] is next(learn.model.parameters())


def test_nccl_without_a_gpu_is_a_clear_error(one_process_group):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: NCCL can run")
    with pytest.raises(ValueError, match=r"NCCL needs CUDA GPUs.*backend='gloo'"):
        DistributedTrainer(backend="nccl")


def test_an_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="backend must be 'nccl'"):
        DistributedTrainer(backend="mpi")


class Stream(IterableDataset):
    def __iter__(self):
        return iter([(torch.randn(8), torch.tensor(0)) for _ in range(16)])


def test_a_loader_whose_sampler_cannot_be_replaced_is_a_clear_error(
    one_process_group,
):
    data = DataBunch(DataLoader(Stream(), 4), None, device="cpu")
    learn = Learner(data, make_model(), F.cross_entropy, progress=False, metrics=[])
    learn.to_distributed(backend="gloo")
    with pytest.raises(ValueError, match="cannot give each rank its shard of train_dl"):
        learn.fit(1, lr=0.1)


def test_batch_caps_take_the_first_batches_of_each_ranks_shard(one_process_group):
    counted = []

    class Count(Callback):
        def on_batch_end(self, train):
            counted.append(train)

    learn = Learner(make_data(), make_model(), F.cross_entropy, progress=False)
    learn.to_distributed(backend="gloo")
    learn.fit(2, lr=0.1, train_batches=2, valid_batches=1, callbacks=[Count()])
    assert counted == [True, True, False] * 2
    trainer = learn.callbacks[-1]
    assert trainer._valid == (1, 1)  # FSDP's pace: the capped shard's batches
