"""Every ``>>>`` example in fitlib's docstrings runs, and shows its real output.

The reference site renders the docstrings, examples included, so each example
is code a reader may paste. Every docstring of every module under ``fitlib/``
that holds examples is one test (its id: the object's qualified name, e.g.
``fitlib.learner.Learner.fit_one_cycle``), run by ``doctest`` with
``ELLIPSIS`` (``...`` in a shown output stands for any text: long or varying
parts) and ``NORMALIZE_WHITESPACE``, in an empty working directory, with
torch on one thread. No example is skipped: one that needs a GPU, several
processes or a server shows what it does on a CPU instead.

Each docstring runs in a fresh namespace that holds this shared context, so
an example may use these names without defining them:

- ``torch``, ``nn`` (``torch.nn``) and ``F`` (``torch.nn.functional``);
- ``model``: a tiny classifier, ``nn.Sequential(nn.Linear(8, 16), nn.ReLU(),
  nn.Linear(16, 3))``: 8 features in, 3 class scores out;
- ``data``: a ``DataBunch`` of tiny random tensors: 64 training samples
  (shuffled batches of 16) and 32 validation samples (batches of 16), 8
  features each, labels 0-2 that depend on the features (so a fit learns);
- ``opt``: ``HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)``;
- ``learn``: ``Learner(data, model, F.cross_entropy, progress=False)`` (the
  same ``model``; the defaults: accuracy, AdamW, weight decay 0.01);
- ``fit`` and every other public name of ``fitlib``, ``fitlib.callbacks`` and
  ``fitlib.metrics`` (``Learner``, ``DataBunch``, ``EarlyStopping``,
  ``Recorder``, ``accuracy``, ...).

torch's random generator is seeded (0) before the context is built, so the
numbers an example shows are the ones it computes. Any other name an example
uses, it imports (``from fitlib.errors import describe``). An example passes
``lr`` to every fit: fitlib says once per process that it picked one, and
which example would show that note depends on the order the tests run.
Losses show their first digits and ``...``: the last ones may differ
between CPUs (the order of a matrix product's sums).
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

import fitlib
import fitlib.callbacks
import fitlib.metrics

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
PACKAGE = Path(fitlib.__file__).parent


def shared_context() -> dict:
    """A fresh namespace for one docstring's examples (see the module's
    docstring): the shared context every example may use."""
    names: dict = {}
    for module in (fitlib, fitlib.callbacks, fitlib.metrics):
        names |= {name: getattr(module, name) for name in module.__all__}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def dataset(n: int) -> TensorDataset:
        x = torch.randn(n, 8)
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
        return TensorDataset(x, y)

    data = fitlib.DataBunch(
        DataLoader(dataset(64), 16, shuffle=True), DataLoader(dataset(32), 16)
    )
    opt = fitlib.HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    # fitlib says once per process which defaults it picked (metrics,
    # optimizer, weight decay): here, before any example, so none shows it.
    learn = fitlib.Learner(data, model, F.cross_entropy, progress=False)
    context = dict(torch=torch, nn=nn, F=F, model=model, data=data, opt=opt)
    return names | context | {"learn": learn, "__name__": "__main__"}


def docstring_tests() -> list[doctest.DocTest]:
    """The docstrings with examples of every module under ``fitlib/``."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests = []
    for info in pkgutil.walk_packages(fitlib.__path__, "fitlib."):
        module = importlib.import_module(info.name)
        tests += [test for test in finder.find(module) if test.examples]
    # A name re-exported by a package appears once: where it is defined.
    unique = {(test.filename, test.lineno, test.name): test for test in tests}
    return sorted(unique.values(), key=lambda test: test.name)


def run_examples(test: doctest.DocTest) -> tuple[doctest.TestResults, str]:
    """Runs one docstring's examples in the shared context; returns the
    results and doctest's report of each failure."""
    fresh = doctest.DocTest(
        test.examples, shared_context(), test.name, test.filename, test.lineno,
        test.docstring,
    )  # fmt: skip
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    try:
        results = runner.run(fresh, out=report.append, clear_globs=True)
    finally:
        plt.close("all")
    return results, "".join(report)


TESTS = docstring_tests()


@pytest.fixture(autouse=True)
def empty_cwd(tmp_path, monkeypatch, one_thread):
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("test", TESTS, ids=[test.name for test in TESTS])
def test_docstring_examples_run_and_show_their_output(test):
    results, report = run_examples(test)
    assert results.attempted == len(test.examples)
    assert results.failed == 0, report


def test_a_wrong_output_fails():
    def scratch():
        """Example:
        >>> accuracy(torch.tensor([[0.1, 0.9]]), torch.tensor([1]))
        tensor(0.5000)
        """

    (test,) = doctest.DocTestFinder().find(scratch, "scratch", globs={})
    results, report = run_examples(test)
    assert results.failed == 1
    assert "Expected:\n    tensor(0.5000)\nGot:\n    tensor(1.)" in report


def test_an_example_that_raises_fails_and_one_of_the_context_passes():
    def scratch():
        """Example:
        >>> learn.fit(1, lr=0.1)[-1]["epoch"]
        0
        >>> undefined_name
        """

    (test,) = doctest.DocTestFinder().find(scratch, "scratch", globs={})
    results, report = run_examples(test)
    assert (results.attempted, results.failed) == (2, 1)
    assert "NameError: name 'undefined_name' is not defined" in report


def test_every_example_in_the_package_is_collected():
    # Each ``>>>`` line of a source file (but a comment) is one example: none
    # is missed (an object doctest cannot find, a docstring built at run time).
    lines = sum(
        len(re.findall(r"^\s*>>> (?!#)", path.read_text(), re.M))
        for path in PACKAGE.rglob("*.py")
    )
    assert sum(len(test.examples) for test in TESTS) == lines


def test_no_example_is_skipped():
    directives = [
        (test.name, example.source)
        for test in TESTS
        for example in test.examples
        if example.options.get(doctest.SKIP)
    ]
    assert directives == []
