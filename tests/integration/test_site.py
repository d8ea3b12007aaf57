"""The documentation site builds with warnings as errors (a broken link,
anchor or reference fails it), every part is there, and the generated tables
and reference pages match the code."""

from __future__ import annotations

import html
import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """``make docs``'s build, into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr}"
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
