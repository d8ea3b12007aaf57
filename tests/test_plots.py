"""Recorder plots appear where matplotlib users expect them: once each at the
end of a notebook cell, and on ``plt.show()`` in a script."""

import os
import subprocess
import sys
from pathlib import Path

import nbclient
import nbformat
import pytest
from ipykernel.kernelspec import install

ROOT = Path(__file__).parents[1]

# A tiny fit, then the quick start's way to look at it.
TRAIN = """\
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from fitlib import DataBunch, Learner

torch.manual_seed(0)
x = torch.randn(64, 4)
y = (x[:, 0] > 0).long()
ds = TensorDataset(x, y)
data = DataBunch(DataLoader(ds, 16), DataLoader(ds, 32), device="cpu")
learn = Learner(data, torch.nn.Linear(4, 2), F.cross_entropy, progress=False)
learn.fit(2, lr=0.1)
"""
PLOT_TWO = "learn.recorder.plot_losses(); learn.recorder.plot_lr()"


@pytest.fixture
def kernel_of_this_python(tmp_path_factory, monkeypatch):
    """A ``python3`` kernelspec that runs ``sys.executable``, with the
    notebook's own plotting backend (as ``tests/integration/test_notebooks.py``)."""
    prefix = tmp_path_factory.mktemp("jupyter")
    spec_dir = Path(install(kernel_name="python3", prefix=str(prefix)))
    monkeypatch.setenv("JUPYTER_PATH", str(spec_dir.parents[1]))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel picks inline


def test_a_notebook_cell_shows_each_plot_once(tmp_path, kernel_of_this_python):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(TRAIN), nbformat.v4.new_code_cell(PLOT_TWO)]
    client = nbclient.NotebookClient(
        nb,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    outputs = nb.cells[1].outputs
    pngs = [o["data"]["image/png"] for o in outputs if "image/png" in o.get("data", {})]
    # One image per figure: the losses and the learning rate, neither twice.
    assert len(pngs) == 2, [o.get("data", o).keys() for o in outputs]
    assert pngs[0] != pngs[1]
    # The cell's value is the last Axes (text), as with any matplotlib call.
    results = [o for o in outputs if o["output_type"] == "execute_result"]
    assert [r["data"]["text/plain"] for r in results] == [
        "<Axes: xlabel='iteration', ylabel='learning rate'>"
    ]


# A backend whose show() writes how many figures pyplot has open.
COUNTING_BACKEND = """\
import os

from matplotlib.backends.backend_agg import FigureCanvasAgg as FigureCanvas  # noqa


def show(*args, **kwargs):
    import matplotlib.pyplot as plt

    with open(os.environ["SHOWN_FILE"], "a") as f:
        f.write(f"{len(plt.get_fignums())}\\n")
"""


def test_a_script_shows_both_plots_on_plt_show(tmp_path):
    (tmp_path / "counting_backend.py").write_text(COUNTING_BACKEND)
    script = tmp_path / "script.py"
    script.write_text(
        f"{TRAIN}{PLOT_TWO}\n\nimport matplotlib.pyplot as plt\n\nplt.show()\n"
    )
    shown = tmp_path / "shown.txt"
    env = os.environ | {
        "MPLBACKEND": "module://counting_backend",
        "PYTHONPATH": os.pathsep.join(
            [str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]
        ),
        "SHOWN_FILE": str(shown),
    }
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert shown.read_text().split() == ["2"]  # show() ran once, with 2 figures
