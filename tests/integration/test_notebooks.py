"""Runs every notebook in ``notebooks/`` top to bottom, as ``make test`` does.

Each notebook checks its own results with ``assert`` lines, so a broken library
fails here, not only a notebook that crashes. The notebooks are stored with
their outputs (so that GitHub shows the plots), all of them from one run of
the current code: ``make notebooks`` runs this file with ``--store-outputs``,
which writes each executed notebook back with a hash of its code, and
``test_stored_outputs_are_from_the_current_code`` fails when a notebook's code
changed after its outputs were made.
"""

import hashlib
import sys
from pathlib import Path

import nbclient
import nbformat
import pytest
from ipykernel.kernelspec import install

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))
IDS = [p.name for p in NOTEBOOKS]


def code_hash(nb) -> str:
    code = [cell.source for cell in nb.cells if cell.cell_type == "code"]
    return hashlib.sha256("\0".join(code).encode()).hexdigest()[:16]


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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_runs_and_its_checks_hold(
    path, tmp_path, kernel_of_this_python, request
):
    nb = nbformat.read(path, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert any("assert " in cell.source for cell in code), (
        f"{path.name} checks nothing: end it with assert lines on its results"
    )
    client = nbclient.NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        record_timing=False,  # no timestamps in the stored notebook
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's cwd
    )
    client.execute()  # raises CellExecutionError, with the traceback, on failure
    assert all(cell.execution_count is not None for cell in code)
    assert not list(tmp_path.iterdir()), "the notebook left files behind"
    if request.config.getoption("store_outputs"):
        nb.metadata["fitlib"] = {"code_sha256": code_hash(nb)}
        nbformat.write(nb, path)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_stored_outputs_are_from_the_current_code(path):
    nb = nbformat.read(path, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    stale = f"{path.name}: its stored outputs are stale. Fix: make notebooks"
    assert nb.metadata.get("fitlib", {}).get("code_sha256") == code_hash(nb), stale
    # One run from a fresh kernel, top to bottom, every cell.
    counts = [cell.execution_count for cell in code]
    assert counts == list(range(1, len(code) + 1)), (stale, counts)
    errors = [out for cell in code for out in cell.outputs if "ename" in out]
    assert not errors, errors


def test_kernel_runs_this_interpreter(kernel_of_this_python):
    from jupyter_client.kernelspec import KernelSpecManager

    assert KernelSpecManager().get_kernel_spec("python3").argv[0] == sys.executable
