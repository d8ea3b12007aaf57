"""Compile: training through torch.compile, the module kept plain."""

import pytest
import torch
from helpers import Crash, make_data, make_dataset
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

from fitlib import Callback, DataBunch, HPOptimizer, Learner, fit
from fitlib.callbacks import Checkpoint, Compile

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def fresh_compiler():
    """Dynamo reuses graphs across modules of one structure, whatever backend
    made them: each test compiles afresh."""
    torch.compiler.reset()
    yield
    torch.compiler.reset()


class Counting:
    """A torch.compile backend that runs the graph eagerly and counts the
    graphs it was given: each call is one compilation."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3)
    )


def even_data():
    """Batches of one size (96 and 32 samples by 16): one graph per mode."""
    return DataBunch(
        DataLoader(make_dataset(96), 16, shuffle=True),
        DataLoader(make_dataset(32, seed=1), 16),
        device="cpu",
    )


def learner(data=None, callbacks=(), **kwargs):
    return Learner(
        data or even_data(), mlp(), F.cross_entropy, opt_func=torch.optim.SGD,
        progress=False, callbacks=list(callbacks), **kwargs,
    )  # fmt: skip


def test_inductor_trains_like_eager_and_its_checkpoints_resume_plain(tmp_path):
    torch.manual_seed(0)
    ref = learner()
    ref.fit(2, lr=0.1)
    # Compiled with inductor (the default), killed after step 9, resumed plain.
    torch.manual_seed(0)
    compiled = learner(callbacks=[Checkpoint(tmp_path, every_n_steps=2), Crash(8)],
                       compile=True)  # fmt: skip
    with pytest.raises(RuntimeError, match="crash"):
        compiled.fit(2, lr=0.1)
    steps = compiled.recorder.losses
    assert len(steps) == 8  # (the crash came before the Recorder saw step 9)
    # Inductor's kernels round differently: equal within 1e-5 (seen: 1e-7).
    assert steps == pytest.approx(ref.recorder.losses[:8], rel=1e-5)
    assert list(compiled.model.state_dict()) == list(ref.model.state_dict())
    torch.manual_seed(0)
    resumed = learner(callbacks=[Checkpoint(tmp_path, every_n_steps=2)])
    resumed.fit(2, lr=0.1)
    for a, b in zip(resumed.model.state_dict().values(),
                    ref.model.state_dict().values(), strict=True):  # fmt: skip
        assert torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-6)


def test_files_of_plain_training_load_into_a_compiled_learner(tmp_path):
    plain = learner()
    plain.fit(1, lr=0.1)
    plain.save(tmp_path / "plain")
    compiled = learner(compile={"backend": Counting()})
    compiled.fit(1, lr=0.1)
    compiled.save(tmp_path / "compiled")
    compiled.load(tmp_path / "plain")
    plain.load(tmp_path / "compiled")
    assert list(compiled.model.state_dict()) == list(plain.model.state_dict())


def test_a_ragged_last_batch_compiles_once_not_every_epoch():
    backend = Counting()

    class Graphs(Callback):
        def __init__(self):
            self.seen = []

        def on_epoch_end(self):
            self.seen.append(backend.graphs)

    graphs = Graphs()
    learn = learner(make_data(), [graphs])  # 100 and 37 samples: ragged ends
    learn.compile(backend=backend)
    learn.fit(3, lr=0.1)
    assert graphs.seen[0] >= 2  # training and evaluation, a ragged one more
    assert graphs.seen[1:] == [graphs.seen[0]] * 2  # nothing new after epoch 0


@pytest.mark.filterwarnings("ignore:lr_find")  # a 5-step sweep's suggestions
def test_the_lr_finder_runs_plain_and_the_module_is_plain_after_fit():
    backend = Counting()
    learn = learner(compile={"backend": backend})
    learn.lr_find(num_it=5)
    assert backend.graphs == 0  # the sweep ran the plain module
    learn.fit(1, lr=0.1)
    trained = backend.graphs
    assert trained > 0
    with torch.no_grad():
        learn.model.eval()(torch.zeros(7, 8))  # a new shape: eager, no graph
    assert backend.graphs == trained


def test_validate_get_preds_and_predict_run_compiled_then_leave_it_plain():
    backend = Counting()
    learn = learner(compile={"backend": backend})
    history = learn.fit(1, lr=0.1)
    assert learn.validate()["valid_loss"] == history[-1]["valid_loss"]
    for evaluate in (learn.validate, learn.get_preds,
                     lambda: learn.predict(torch.zeros(5, 8))):  # fmt: skip
        torch.compiler.reset()  # (graphs of the same code would be reused)
        before = backend.graphs
        evaluate()
        assert backend.graphs > before, evaluate
        assert learn.model._compiled_call_impl is None  # plain again


def test_compiles_with_mixed_precision():
    backend = Counting()
    learn = learner(compile={"backend": backend}).to_bf16()
    history = learn.fit(1, lr=0.1)
    assert backend.graphs > 0 and torch.isfinite(torch.tensor(history[0]["train_loss"]))


def test_fit_takes_compile_as_a_callback():
    backend = Counting()
    model = mlp()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    fit(1, model, F.cross_entropy, opt, even_data(), [Compile(backend=backend)])
    assert backend.graphs > 0


# -- bad input ---------------------------------------------------------------------
def test_an_argument_torch_compile_does_not_take_is_refused():
    with pytest.raises(
        TypeError, match=r"\['fast'\] are not arguments of torch.compile"
    ):
        Compile(fast=True)


def test_an_unknown_backend_is_refused_with_the_list():
    with pytest.raises(ValueError, match=r"backend='nope'.*inductor"):
        Learner(even_data(), mlp(), F.cross_entropy, compile={"backend": "nope"})


def test_learner_compile_takes_true_false_or_a_dict():
    with pytest.raises(TypeError, match="compile must be True, False or a dict"):
        learner(compile="yes")


def test_a_backend_that_cannot_compile_says_how_to_fall_back():
    import torch._inductor.config as inductor

    learn = learner(compile=True)
    # torch's own patch: monkeypatch would delete the setting on undo, and
    # every later compilation in this process would fail ("cpp.cxx does not
    # exist").
    with (
        inductor.patch({"cpp.cxx": ("/nonexistent/g++",)}),
        pytest.raises(RuntimeError, match="backend='aot_eager'") as caught,
    ):
        learn.fit(1, lr=0.1)
    assert "C++ compiler" in str(caught.value)
    assert learn.recorder.losses == []  # before any step


SAID = "fitlib: compiling the model (the first batches are slow)"


def test_a_compiled_fit_says_once_that_it_compiles(capsys):
    learn = learner(compile={"backend": Counting()})
    learn.fit(2, lr=0.1)
    assert capsys.readouterr().out.count(SAID) == 1  # once, not per epoch
    learn.get_preds()  # compiled already: nothing to say
    assert SAID not in capsys.readouterr().out
    learn.fit(1, lr=0.1)
    assert capsys.readouterr().out.count(SAID) == 1  # once per fit
    fresh = learner(compile={"backend": Counting()})
    fresh.validate()  # its first compilation: said
    assert capsys.readouterr().out.count(SAID) == 1


@pytest.mark.parametrize("main", [True, False])
def test_only_rank_0_says_that_it_compiles(capsys, monkeypatch, main):
    import fitlib.ranks

    monkeypatch.setattr(fitlib.ranks, "is_main", lambda: main)
    learner(compile={"backend": Counting()}).fit(1, lr=0.1)
    assert capsys.readouterr().out.count(SAID) == main


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"fullgraph": 1},
            TypeError,
            r"Compile: fullgraph must be True or False; "
            r"got 1 \(int\)\. Fix: e\.g\. Compile\(fullgraph=True\)",
        ),
        ({"disable": "no"}, TypeError, r"disable must be True or False; got 'no'"),
        (
            {"dynamic": "yes"},
            TypeError,
            r"dynamic must be True, False or None; got 'yes' \(str\)",
        ),
        (
            {"backend": 3},
            TypeError,
            r"backend must be a backend's name \(str\) or "
            r"a backend function; got 3 \(int\)\. Fix: e\.g\. Compile\(backend=",
        ),
        ({"backend": None}, TypeError, r"backend must be .*; got None"),
        ({"mode": 3}, TypeError, r"mode must be a str or None; got 3 \(int\)"),
        ({"options": "x"}, TypeError, r"options must be a dict or None; got 'x'"),
        ({"recompile_limit": 0}, ValueError, r"recompile_limit must be an int >= 1"),
        (
            {"mode": "max-autotune", "options": {}},
            ValueError,
            r"Compile: pass mode or options, not both.*Fix",
        ),
        (
            {"mode": "fast"},
            ValueError,
            r"Compile: torch\.compile refused "
            r"mode='fast': Unrecognized mode=fast.*max-autotune.*Fix",
        ),
        (
            {"options": {"nonsense": 1}},
            ValueError,
            r"refused options=\{'nonsense': 1\}: Unexpected optimization option",
        ),
    ],
)
def test_each_bad_argument_is_refused_when_compile_is_asked_for(kwargs, error, match):
    learn = learner()
    with pytest.raises(error, match=match):
        learn.compile(**kwargs)
    assert not any(isinstance(cb, Compile) for cb in learn.callbacks)


def test_an_evaluation_inside_a_fit_keeps_the_fit_compiled():
    backend = Counting()
    seen = []

    class Steps(Callback):
        def on_batch_begin(self, train, model):
            if train:
                seen.append(model._compiled_call_impl is not None)

    learn = learner(compile={"backend": backend})
    for _ in learn.fit_snapshots(12, every=3, lr=0.1, callbacks=[Steps()]):
        learn.validate()  # runs the Learner's Compile too, then ends it
    assert seen == [True] * 12
    assert learn.model._compiled_call_impl is None  # plain after the fit


def test_a_users_own_compiled_model_stays_compiled_after_validate():
    backend = Counting()
    learn = learner(compile={"backend": backend})
    learn.model.compile(backend=backend)
    own = learn.model._compiled_call_impl
    learn.validate()
    learn.predict(torch.zeros(8))
    assert learn.model._compiled_call_impl is own
