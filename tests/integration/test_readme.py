"""The README runs and leads somewhere: its quick start runs as written, the
names it imports exist, and every link it makes reaches a file of the
repository (so the "Find your answer" list works on GitHub, without a built
site)."""

import doctest
import importlib
import re
import subprocess
import sys
from pathlib import Path

import matplotlib
import pytest
from helpers import child_env

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# [text](target): the text may hold backticks and line breaks, not brackets.
# How the quick start's output is compared with the README's (as in the docs).
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def quick_start_code() -> str:
    section = README.read_text().split("## Quick start", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def relative_links() -> list[str]:
    """The README's link targets that point into the repository, without any
    #fragment."""
    targets = LINK.findall(README.read_text())
    external = ("http://", "https://", "mailto:", "#")
    return [t.partition("#")[0] for t in targets if not t.startswith(external)]


def test_readme_quick_start_runs_and_learns(tmp_path, monkeypatch):
    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)  # learn.save writes under ./models
    namespace = {}
    exec(compile(quick_start_code(), "README.md", "exec"), namespace)
    learn = namespace["learn"]
    assert learn.validate()["accuracy"] > 0.85
    assert (tmp_path / "models" / "stage1.pth").is_file()
    assert len(learn.recorder.train_losses) == 3


def test_the_quick_start_prints_what_the_readme_shows_in_a_fresh_process(tmp_path):
    # As a script, in a fresh process: the once-per-process notes on the
    # defaults come first. The epochs' times vary: they are not compared.
    section = README.read_text().split("## Quick start", 1)[1]
    shown = re.search(r"```python\n.*?```.*?```text\n(.*?)```", section, re.S)[1]
    done = subprocess.run(
        [sys.executable, "-c", quick_start_code()],
        cwd=tmp_path,
        env=child_env(MPLBACKEND="Agg", OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    times = re.compile(r"\d\d:\d\d$", re.M)
    checker = doctest.OutputChecker()
    got = times.sub("00:00", done.stdout + done.stderr)
    assert checker.check_output(times.sub("00:00", shown), got, FLAGS), got


def test_every_fitlib_name_the_readme_imports_exists():
    text = README.read_text()
    imports = re.findall(r"^from (fitlib[\w.]*) import ([\w, ]+)$", text, re.M)
    assert imports, "the README shows no imports"
    for module, names in imports:
        for name in names.split(","):
            assert hasattr(importlib.import_module(module), name.strip()), (
                f"README: from {module} import {name.strip()}"
            )


def test_every_relative_link_of_the_readme_reaches_a_file():
    links = relative_links()
    assert len(links) > 40, links  # the course table and the answers list
    missing = [t for t in links if not (ROOT / t).is_file()]
    assert not missing, f"README links to files that do not exist: {missing}"


# A fenced code block: its text is code, not links.
FENCED = re.compile(r"^([ \t]*)(`{3,}|~{3,}).*?^\1\2[ \t]*$", re.S | re.M)
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]


def broken_links(page: Path, text: str | None = None) -> list[str]:
    """The relative links of a Markdown page that reach no file of the
    repository, read from where the page lies (as GitHub reads them)."""
    text = FENCED.sub("", page.read_text() if text is None else text)
    external = ("http://", "https://", "mailto:", "#")
    targets = [t for t in LINK.findall(text) if not t.startswith(external)]
    return [t for t in targets if not (page.parent / t.partition("#")[0]).is_file()]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_of_the_readme_and_docs_reaches_a_file(page):
    # The docs read on GitHub too: a page links the notebook
    # (notebooks/NN_*.ipynb) and ARCHITECTURE.md, not the pages the site
    # makes of them (docs/hooks.py rewrites those links for the site).
    assert not broken_links(page), f"links to no file: {broken_links(page)}"


def test_a_link_to_a_page_only_the_site_has_is_broken():
    page = ROOT / "docs/how-to/resume-a-crashed-run.md"
    text = (
        "[a](../../notebooks/01_quickstart.ipynb) [b](../index.md#x) "
        "[c](../tutorials/01_quickstart.ipynb) [d](../explanation/architecture.md)"
        "\n```python\nx = [e](../nowhere.md)\n```\n"
    )
    assert broken_links(page, text) == [
        "../tutorials/01_quickstart.ipynb",
        "../explanation/architecture.md",
    ]


def test_the_link_pattern_reads_a_link_over_two_lines():
    text = "[the state\n  keys](docs/reference/state.md#keys) [x](https://a.b)"
    assert LINK.findall(text) == ["docs/reference/state.md#keys", "https://a.b"]


def test_the_course_table_links_every_notebook():
    linked = {t for t in relative_links() if t.startswith("notebooks/")}
    stored = {f"notebooks/{p.name}" for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert linked == stored


def test_the_answers_list_links_every_how_to_and_explanation_page():
    linked = set(relative_links())
    pages = [
        p.relative_to(ROOT).as_posix()
        for part in ("how-to", "explanation")
        for p in (ROOT / "docs" / part).glob("*.md")
        # the explanation page that shows ARCHITECTURE.md: the README links
        # the file itself
        if p.name not in ("index.md", "architecture.md")
    ]
    assert "ARCHITECTURE.md" in linked
    omitted = [p for p in pages if p not in linked]
    assert not omitted, f"pages the README's answers list omits: {omitted}"


def test_the_readme_stays_short():
    # The reference, recipes and measurements live on the documentation site.
    assert len(README.read_bytes()) <= 12 * 1024
