"""Runs every notebook in ``notebooks/`` top to bottom, as ``make test`` does.

Each notebook checks its own results with ``assert`` lines, so a broken library
fails here, not only a notebook that crashes.
"""

import sys
from pathlib import Path

import nbclient
import nbformat
import pytest
from ipykernel.kernelspec import install

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def kernel_of_this_python(tmp_path_factory):
    """A ``python3`` kernelspec that runs ``sys.executable``, found first.

    The default spec usually resolves to this interpreter too, but a stale
    user-wide spec (``~/.local/share/jupyter``) would win over it and run the
    notebooks without fitlib installed.
    """
    prefix = tmp_path_factory.mktemp("jupyter")
    spec_dir = Path(install(kernel_name="python3", prefix=str(prefix)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", str(spec_dir.parents[1]))
        yield


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_and_its_checks_hold(path, tmp_path, kernel_of_this_python):
    nb = nbformat.read(path, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert any("assert " in cell.source for cell in code), (
        f"{path.name} checks nothing: end it with assert lines on its results"
    )
    client = nbclient.NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's cwd
    )
    client.execute()  # raises CellExecutionError, with the traceback, on failure
    assert all(cell.execution_count is not None for cell in code)
    assert not list(tmp_path.iterdir()), "the notebook left files behind"


def test_kernel_runs_this_interpreter(kernel_of_this_python):
    from jupyter_client.kernelspec import KernelSpecManager

    assert KernelSpecManager().get_kernel_spec("python3").argv[0] == sys.executable
