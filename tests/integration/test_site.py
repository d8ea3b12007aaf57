"""The documentation site builds with warnings as errors (a broken link,
anchor or reference fails it), every part is there, and the generated tables
and reference pages match the code."""

from __future__ import annotations

import fcntl
import html
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fitlib
import fitlib.callbacks
import fitlib.metrics
from fitlib.callback import STATE_KEYS, WRITABLE

ROOT = Path(__file__).resolve().parents[2]


def load_hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs/hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Path:
    """``make docs``'s build, into a temporary folder: built once per test
    run, whichever pytest-xdist workers ask for it (the first builds under a
    lock, the others wait for it and read its result)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker's: the run's is above
        shared = shared.parent
    out, result = shared / "site", shared / "site.result"
    with open(shared / "site.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            done = subprocess.run(
                [sys.executable, "-m", "mkdocs", "build", "--strict",
                 "--site-dir", str(out)],
                cwd=ROOT, capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            result.write_text(f"{done.returncode}\n{done.stderr}")
    code, _, stderr = result.read_text().partition("\n")
    assert code == "0", f"mkdocs build --strict failed:\n{stderr}"
    return out


def text_of(page: Path) -> str:
    """A page's text, tags removed and entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


def test_the_site_builds_with_warnings_as_errors_and_has_each_part(site):
    assert (
        "patience"
        in (site / "reference/callbacks/early_stopping/index.html").read_text()
    )
    quickstart = (site / "tutorials/01_quickstart/index.html").read_text()
    assert re.search(
        r"<img [^>]*src=\"data:image/png;base64,", quickstart
    )  # stored plot
    assert (site / "tutorials/01_quickstart/01_quickstart.ipynb").is_file()
    assert '<a href="01_quickstart.ipynb" download' in quickstart  # its button
    course = (site / "tutorials/index.html").read_text()
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert f'href="{notebook.stem}/"' in course, notebook.name
    assert "<h1" in (site / "how-to/write-a-callback/index.html").read_text()
    architecture = text_of(site / "explanation/architecture/index.html")
    first_heading = re.search(
        r"^## (.+)$", (ROOT / "ARCHITECTURE.md").read_text(), re.M
    )
    assert first_heading[1] in architecture


def tables(page: Path) -> list[list[list[str]]]:
    """The tables of a page: rows of cells (the cells' HTML), headers left out."""
    found = re.findall(r"<table>(.*?)</table>", page.read_text(), re.S)
    return [
        [re.findall(r"<td[^>]*>(.*?)</td>", row, re.S) for row in
         re.findall(r"<tr>(.*?)</tr>", table, re.S)][1:]
        for table in found
    ]  # fmt: skip


def text_of_cell(cell: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", cell)).strip()


def test_the_state_page_tables_are_the_code_s_state_keys_writable_and_order(site):
    state, writable, order = tables(site / "reference/state/index.html")[:3]
    assert [text_of_cell(key) for key, _ in state] == list(STATE_KEYS)
    assert {text_of_cell(key): re.findall(r"<code>(\w+)</code>", events)
            for key, events in writable} == {
        key: list(events) for key, events in WRITABLE.items()
    }  # fmt: skip
    shown = [(text_of_cell(name), int(text_of_cell(n))) for n, name, _ in order]
    expected = [(name, n) for name, n, _ in fitlib.callbacks.order_table()]
    assert shown == expected
    assert [n for _, n in shown] == sorted(n for _, n in shown)  # first to last


def documented_ids(site: Path) -> set[str]:
    ids = set()
    for page in (site / "reference").rglob("index.html"):
        ids |= set(re.findall(r'id="(fitlib[\w.]*)"', page.read_text()))
    return ids


@pytest.mark.parametrize(
    "module", [fitlib, fitlib.callbacks, fitlib.metrics], ids=lambda m: m.__name__
)
def test_every_public_name_has_a_reference_entry(site, module):
    ids = documented_ids(site)
    names = [n for n in module.__all__ if not inspect.ismodule(getattr(module, n))]
    missing = [n for n in names if f"{module.__name__}.{n}" not in ids]
    assert not missing, f"no reference entry for {module.__name__}: {missing}"


def test_every_callback_module_has_its_reference_page():
    modules = {p.stem for p in (ROOT / "fitlib/callbacks").glob("*.py")} - {"__init__"}
    pages = {p.stem for p in (ROOT / "docs/reference/callbacks").glob("*.md")}
    assert modules == pages


def test_the_generated_tables_follow_the_code_and_a_lost_marker_fails_the_build():
    from mkdocs.exceptions import PluginError

    hooks = load_hooks()
    state = hooks.state_keys_table().splitlines()
    assert [line.split("`")[1] for line in state[2:]] == list(STATE_KEYS)
    writable = hooks.writable_table().splitlines()
    assert [line.split("`")[1] for line in writable[2:]] == list(WRITABLE)
    order = hooks.order_markdown_table().splitlines()[2:]
    assert len(order) == len(fitlib.callbacks.order_table())

    class Page:
        class file:  # noqa: N801
            src_uri = hooks.STATE_PAGE

    text = (ROOT / "docs" / hooks.STATE_PAGE).read_text()
    filled = hooks.on_page_markdown(text, Page, None, None)
    assert "<!-- generated:" not in filled and "| `model` |" in filled
    with pytest.raises(PluginError, match="generated: writable"):
        hooks.on_page_markdown(
            text.replace("<!-- generated: writable -->", ""), Page, None, None
        )


def test_the_hook_points_links_to_repository_files_at_the_site_s_pages():
    hooks = load_hooks()
    text = (
        "[03](../../notebooks/03_writing_callbacks.ipynb) "
        "[rules](../../ARCHITECTURE.md#speed-rules) [why](../explanation/errors.md)\n"
        "Source: [`fitlib/learner.py`](../../fitlib/learner.py) [x](../nowhere.md)\n"
        "```python\n[a](../../notebooks/08_text.ipynb)\n```\n"
    )
    assert hooks.site_links(text, "how-to/write-a-callback.md") == (
        "[03](../tutorials/03_writing_callbacks.ipynb) "
        "[rules](../explanation/architecture.md#speed-rules) "
        "[why](../explanation/errors.md)\n"
        "Source: `fitlib/learner.py` [x](../nowhere.md)\n"
        "```python\n[a](../../notebooks/08_text.ipynb)\n```\n"
    )
    assert hooks.site_links(
        "[01](../../notebooks/01_quickstart.ipynb)", "tutorials/index.md"
    ) == ("[01](01_quickstart.ipynb)")


def page_sources(page: Path) -> list[str]:
    """The files that define what a reference page's ``:::`` lines render."""
    files = []
    for name in re.findall(r"^::: (\S+)", page.read_text(), re.M):
        module, _, attribute = name.rpartition(".")
        try:
            found = getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError, ValueError):
            found = importlib.import_module(name)
        source = Path(inspect.getsourcefile(found)).relative_to(ROOT).as_posix()
        files += [source] if source not in files else []
    return files


REFERENCE = sorted((ROOT / "docs/reference").rglob("*.md"))


@pytest.mark.parametrize(
    "page",
    [p for p in REFERENCE if p != ROOT / "docs/reference/index.md"],
    ids=lambda p: p.relative_to(ROOT / "docs/reference").as_posix(),
)
def test_each_reference_page_names_its_source_files_and_the_examples_context(page):
    # On GitHub a reference page is its ::: lines: its Source line leads to
    # the code whose docstrings the site renders there.
    (line,) = re.findall(r"^Source: .*$", page.read_text(), re.M)
    linked = re.findall(r"\[`([^`]+)`\]\(([^)]+)\)", line.split(":", 1)[1])
    for shown, target in linked:
        assert (page.parent / target).resolve() == ROOT / shown, (shown, target)
    expected = page_sources(page)
    if page.name == "state.md":  # its tables come from fitlib/callback.py
        expected = ["fitlib/callback.py", *expected]
    assert [shown for shown, _ in linked] == expected
    index = Path(os.path.relpath(ROOT / "docs/reference/index.md", page.parent))
    assert f"]({index.as_posix()}#about-the-examples)" in line


def test_the_reference_index_states_the_examples_shared_context():
    # docs/reference/index.md, "About the examples", lists the names the
    # docstring examples' context holds, as test_docstring_examples.py does.
    def bullets(text: str) -> list[str]:
        return [
            " ".join(b.split())
            for b in re.findall(r"^- (.*?)(?=^- |^$)", text, re.M | re.S)
        ]

    spec = importlib.util.spec_from_file_location(
        "docstring_examples", ROOT / "tests/integration/test_docstring_examples.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    doc = module.__doc__.replace("``", "`")
    index = (ROOT / "docs/reference/index.md").read_text()
    section = index.split("## About the examples", 1)[1]
    assert bullets(section) == bullets(doc)
    context = set(module.shared_context()) - {"__name__"}
    page = {}
    exec(re.search(r"```python\n(.*?)```", section, re.S)[1], page)
    assert context <= set(page)
    assert torch.equal(
        page["model"][0].weight, module.shared_context()["model"][0].weight
    )


def test_docstrings_head_their_examples_examples_not_example():
    """griffe reads a Google-style ``Examples:`` section as code, but
    ``Example:`` as a note whose ``>>>`` lines the site shows as quotes."""
    singular = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "fitlib").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if line.strip() == "Example:"
    ]
    assert singular == []
