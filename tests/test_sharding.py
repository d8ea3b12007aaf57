"""FSDP2 in this process, in a one-process gloo group: sharding, the optimizer
moved along, whole state dicts for saving and loading.
tests/integration/test_distributed_trainer_torchrun.py runs 2 processes."""

import pytest
import torch
from helpers import make_data, make_model
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn import functional as F  # noqa: N812

from fitlib import Learner
from fitlib.callbacks import Checkpoint, DistributedTrainer, EarlyStopping, TrainStats
from fitlib.serialization import atomic_save, load_model_state
from fitlib.sharding import is_sharded, model_state, optimizer_state


def learner(tmp_path, model=None, **kwargs):
    return Learner(make_data(), model or make_model(), F.cross_entropy,
                   progress=False, path=tmp_path, **kwargs)  # fmt: skip


def fsdp(learn, **kwargs):
    return learn.to_distributed(backend="gloo", strategy="fsdp", **kwargs)


def ddp(learn):  # the baseline: the same sharded data order (a world of 1)
    return learn.to_distributed(backend="gloo")


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def opt_tensors(state):
    return [t for s in state["opt"]["state"].values() for t in s.values()]


def test_fsdp_trains_as_ddp(one_process_group, tmp_path):
    torch.manual_seed(1)
    plain = ddp(learner(tmp_path))
    plain.fit(2, lr=1e-2)
    torch.manual_seed(1)
    sharded = fsdp(learner(tmp_path), fsdp_units=(nn.Linear,))
    sharded.fit(2, lr=1e-2)
    assert is_sharded(sharded.model) and isinstance(sharded.model, FSDPModule)
    assert isinstance(sharded.model[0], FSDPModule)  # a unit of its own
    assert not isinstance(sharded.model[1], FSDPModule)  # batch norm: the root's
    assert same(model_state(sharded.model), plain.model.state_dict())
    # The optimizer steps the sharded parameters (it was built before sharding).
    params = {id(p) for p in sharded.model.parameters()}
    assert {id(p) for g in sharded.opt.param_groups for p in g["params"]} == params
    assert sharded.recorder.valid_losses == plain.recorder.valid_losses


def test_optimizer_state_moves_along_when_the_model_is_sharded(
    one_process_group, tmp_path
):
    torch.manual_seed(1)
    plain = learner(tmp_path)
    plain.fit(1, lr=1e-2)
    ddp(plain).fit(1, lr=1e-2)
    torch.manual_seed(1)
    learn = learner(tmp_path)
    learn.fit(1, lr=1e-2)  # AdamW state for the unsharded parameters
    fsdp(learn).fit(1, lr=1e-2)
    assert same(model_state(learn.model), plain.model.state_dict())


def test_a_sharded_save_loads_into_one_process_and_back(one_process_group, tmp_path):
    learn = fsdp(learner(tmp_path))
    learn.fit(1, lr=1e-2)
    path = learn.save("sharded")
    state = torch.load(path, weights_only=True)
    plain = learner(tmp_path).load("sharded")  # the format of a plain save
    assert same(plain.model.state_dict(), model_state(learn.model))
    assert state["opt"]["opt"]["state"].keys() == {0, 1, 2, 3, 4, 5}
    saved, loaded = opt_tensors(state["opt"]), opt_tensors(plain.opt.state_dict())
    assert len(saved) == 18 and all(map(torch.equal, saved, loaded))
    # Back: a plain save into a sharded model.
    plain.fit(1, lr=1e-2)
    plain.save("plain")
    learn.load("plain")
    assert same(model_state(learn.model), plain.model.state_dict())
    moved = opt_tensors(optimizer_state(learn.opt, learn.model))
    assert all(map(torch.equal, moved, opt_tensors(plain.opt.state_dict())))


def test_early_stopping_restores_the_best_sharded_weights(one_process_group, tmp_path):
    def run(learn):
        torch.manual_seed(1)
        stop = EarlyStopping(monitor="accuracy", patience=10, restore_best=True)
        learn.fit(4, lr=0.3, callbacks=[stop])  # a high rate: accuracy wobbles
        return stop, model_state(learn.model)

    stop, plain = run(ddp(learner(tmp_path)))
    sharded_stop, sharded = run(fsdp(learner(tmp_path)))
    assert sharded_stop.best_epoch == stop.best_epoch < 3
    assert same(sharded, plain)


def test_train_stats_norms_of_a_sharded_model(one_process_group, tmp_path):
    stats = [TrainStats(every_n_steps=3), TrainStats(every_n_steps=3)]
    torch.manual_seed(1)
    ddp(learner(tmp_path)).fit(1, lr=1e-2, callbacks=[stats[0]])
    torch.manual_seed(1)
    fsdp(learner(tmp_path)).fit(1, lr=1e-2, callbacks=[stats[1]])
    for key in ("grad_norm", "weight_norm"):
        want = [h[key] for h in stats[0].history]
        assert [h[key] for h in stats[1].history] == pytest.approx(want, rel=1e-6)


@pytest.mark.filterwarnings("ignore:MixedPrecision.float16. on the CPU")
def test_float16_with_fsdp_is_a_clear_error(one_process_group, tmp_path):
    learn = fsdp(learner(tmp_path)).to_fp16()
    with pytest.raises(ValueError, match=r"float16\) with a model sharded.*to_bf16"):
        learn.fit(1, lr=1e-2)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"strategy": "zero3"}, ValueError, "strategy must be 'ddp'"),
        ({"fsdp_units": (nn.Linear,)}, ValueError, "strategy is 'ddp'"),
        ({"strategy": "fsdp", "fsdp_units": ("Linear",)}, TypeError, "nn.Module cl"),
        ({"strategy": "fsdp", "fsdp_kwargs": {"mesh": 1}}, ValueError, "mesh or mod"),
        ({"strategy": "fsdp", "fsdp_kwargs": [1]}, TypeError, "must be a dict"),
    ],
)
def test_bad_sharding_arguments_are_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        DistributedTrainer(**kwargs)


# -- wrapped models: every file holds the plain model's keys -----------------------
def compiled(model):
    return torch.compile(model, backend="eager")  # a pass-through: fast


def keys_of(path):
    return set(torch.load(path, weights_only=True)["model"])


def unplug(monkeypatch):
    """The one-process group ends: what follows runs as a plain process."""
    torch.distributed.destroy_process_group()
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k)


@pytest.mark.parametrize("wrap", [lambda m: m, compiled], ids=["plain", "compiled"])
def test_a_ddp_runs_checkpoints_load_in_one_process(
    one_process_group, tmp_path, monkeypatch, capsys, wrap
):
    learn = ddp(learner(tmp_path, model=wrap(make_model())))
    ckpt = Checkpoint(tmp_path / "ckpt", monitor="valid_loss")
    learn.fit(2, lr=1e-2, callbacks=[ckpt])
    plain_keys = set(make_model().state_dict())
    files = [*ckpt.checkpoints(), tmp_path / "ckpt" / "best.pth"]
    assert [keys_of(p) for p in files] == [plain_keys] * len(files)
    assert keys_of(learn.save("after")) == plain_keys
    unplug(monkeypatch)
    alone = learner(tmp_path).load(tmp_path / "ckpt" / "best.pth", with_opt=False)
    assert set(alone.model.state_dict()) == plain_keys
    rerun = learner(tmp_path)  # the directory, rerun in one process
    rerun.fit(2, lr=1e-2, callbacks=[Checkpoint(tmp_path / "ckpt")])
    assert "already finished" in capsys.readouterr().out
    assert same(rerun.model.state_dict(), model_state(learn.model))


def test_a_compiled_models_files_hold_plain_keys_and_load_either_way(tmp_path):
    learn = learner(tmp_path, model=compiled(make_model()))
    learn.fit(1, lr=1e-2, callbacks=[Checkpoint(tmp_path / "ckpt")])
    plain_keys = set(make_model().state_dict())
    assert keys_of(Checkpoint(tmp_path / "ckpt").checkpoints()[-1]) == plain_keys
    assert keys_of(learn.save("compiled")) == plain_keys
    plain = learner(tmp_path, model=make_model(seed=5)).load("compiled")
    assert same(plain.model.state_dict(), model_state(learn.model))
    plain.save("plain")
    again = learner(tmp_path, model=compiled(make_model(seed=7))).load("plain")
    assert same(model_state(again.model), plain.model.state_dict())


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod."])
def test_files_of_earlier_versions_with_wrapper_prefixes_load(tmp_path, prefix):
    source = make_model(seed=3).state_dict()
    old = {"model": {prefix + k: v for k, v in source.items()}}
    atomic_save(old, tmp_path / "models" / "old.pth")
    for model in (make_model(), compiled(make_model())):
        learn = learner(tmp_path, model=model).load("old")
        assert same(model_state(learn.model), source)


def test_a_prefix_only_some_keys_have_is_not_stripped(tmp_path):
    state = make_model().state_dict()
    state = {("module." + k if k.startswith("0.") else k): v for k, v in state.items()}
    with pytest.raises(ValueError, match=r"different model.*module\.0\.weight"):
        load_model_state(make_model(), state, "the file")


def test_a_model_whose_own_keys_start_with_module_loads_its_plain_file(tmp_path):
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = make_model()

        def forward(self, x):
            return self.module(x)

    learn = learner(tmp_path, model=Holder())
    assert keys_of(learn.save("holder")) == set(Holder().state_dict())
    learner(tmp_path, model=Holder()).load("holder")  # no prefix stripped
