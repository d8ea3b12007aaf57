"""Every code block of the documentation site (docs/**/*.md) runs as written.

One test per page. A page's blocks run in order, in an empty working
directory, with torch on one thread and matplotlib's Agg backend:

- ```python blocks run in ONE namespace (a module that stands in for
  ``__main__``, so classes a page defines can be pickled), so a later block
  may use the names of an earlier one;
- a block whose first line is ``# file: NAME`` is not run but written to NAME
  (a script, a config), for a later block to use;
- ```bash blocks run with ``bash -e`` there, with this Python's bin folder
  first on PATH (``python``, ``torchrun``) and the checkout's fitlib importable;
- ```console blocks are not run, so they may hold only install and set-up
  commands (``pip install``, ``make``, ``git clone``, ...): that is checked;
- every fence names its language; ```text, ```toml and the like are not code.

A ```text block that directly follows a ```python or ```bash block (only blank
lines between the two fences) is that block's expected output, and is
compared with what the block writes:

- a python block's stdout and stderr are captured together, in the order they
  are written, as one would see them in a terminal; a warning is shown as its
  first line without the location, ``UserWarning: message`` (the paths and
  line numbers Python prints before it differ between machines), once per
  place in the code per page, as in a script (Python's default filters: a
  ``DeprecationWarning`` only from the page's own code);
- a bash block's stdout and stderr are read together from one pipe;
- the output is compared with the text by ``doctest.OutputChecker``, ``ELLIPSIS``,
  ``NORMALIZE_WHITESPACE`` and ``DONT_ACCEPT_TRUE_FOR_1``: runs of spaces and
  newlines count as one space, and ``...`` stands for any text, which is
  how a page writes what varies between runs (a time, a temporary path, a
  file's size); everything else, numbers included, must be exact.

A ```text block after prose (or after anything but a python or bash block) is
illustrative and not compared: put a sentence before the output of code the
page does not run, or that is not the output of the block above it.

A failing block fails its page's test with ``PAGE:LINE`` (the line of the
block's opening fence) and the traceback, whose lines are the page's lines;
a block whose output differs from its ```text block fails with ``PAGE:LINE``
of the text block and a diff of the shown output and the real one.
"""

from __future__ import annotations

import contextlib
import difflib
import doctest
import io
import itertools
import os
import re
import subprocess
import sys
import traceback
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import pytest
import torch
from helpers import child_env

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,})(?P<info>[^`]*)$")
FILE_HEADER = re.compile(r"^#\s*file:\s*(?P<name>\S+)\s*$")
# Spellings of the languages this runner handles: one spelling each, so that no
# block escapes it under another name.
RENAMED = {
    "py": "python",
    "python3": "python",
    "sh": "bash",
    "shell": "bash",
    "zsh": "bash",
    "shell-session": "console",
    "pycon": "python",
}
SETUP_COMMANDS = (
    "pip install",
    "pip3 install",
    "python -m pip install",
    "python3 -m pip install",
    ".venv/bin/pip install",
    ".venv/bin/python -m pip install",
    "uv pip install",
    "uv venv",
    "python -m venv",
    "python3 -m venv",
    "source ",
    ". ",
    "cd ",
    "git clone",
    "make",
    "apt-get install",
    "apt install",
    "sudo apt-get install",
    "sudo apt install",
    "sudo apt-get update",
    "apt-get update",
    "conda install",
    "conda create",
    "conda activate",
)
BASH_TIMEOUT = 300
# How a ```text block is compared with the output of the block above it.
OUTPUT_FLAGS = (
    doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE | doctest.DONT_ACCEPT_TRUE_FOR_1
)


class DocsBlockError(AssertionError):
    """A code block of a docs page failed or breaks the page conventions."""


@dataclass
class Block:
    lang: str  # the fence's first word, lower case ("" when none)
    line: int  # 1-based line of the opening fence
    code: str  # the block's lines, the fence's indentation removed
    end: int = 0  # 1-based line of the closing fence


def blocks(text: str, where: str) -> list[Block]:
    """The fenced code blocks of a Markdown page, in order."""
    lines = text.splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks = m["indent"], m["ticks"]
        lang = (m["info"].split() or [""])[0].lower().lstrip(".{")
        body, j = [], i + 1
        while j < len(lines):
            close = lines[j].strip()
            if close.startswith(ticks) and not close.strip("`"):
                break
            body.append(
                lines[j][len(indent) :]
                if lines[j].startswith(indent)
                else lines[j].lstrip()
            )
            j += 1
        else:
            raise DocsBlockError(f"{where}:{i + 1}: the code block is never closed")
        found.append(Block(lang, i + 1, "\n".join(body) + "\n", j + 1))
        i = j + 1
    return found


def expected_outputs(page_blocks: list[Block], lines: list[str]) -> dict[int, Block]:
    """The ```text block that shows each python or bash block's output.

    Keyed by the code block's index; a text block counts only when nothing
    but blank lines separates it from the code block before it.
    """
    found = {}
    for k, (code, nxt) in enumerate(itertools.pairwise(page_blocks)):
        between = lines[code.end : nxt.line - 1]
        if (
            RENAMED.get(code.lang, code.lang) in ("python", "bash")
            and nxt.lang == "text"
            and not FILE_HEADER.match(code.code.split("\n", 1)[0])
            and not any(line.strip() for line in between)
        ):
            found[k] = nxt
    return found


def check_output(shown: Block, got: str, where: str) -> None:
    """Fails unless ``got`` matches the output a ```text block shows."""
    checker = doctest.OutputChecker()
    if checker.check_output(shown.code, got, OUTPUT_FLAGS):
        return
    diff = difflib.unified_diff(
        shown.code.splitlines(),
        got.splitlines(),
        f"{where}:{shown.line} (the ```text block)",
        "the output",
        lineterm="",
    )
    raise DocsBlockError(
        f"{where}:{shown.line}: the ```text block does not show what the block "
        "above it prints (write `...` only for what varies between runs: a time, "
        "a temporary path; spaces and newlines may differ)\n" + "\n".join(diff)
    )


def show_warning(message, category, filename, lineno, file=None, line=None):
    """Writes a warning as ``Category: message`` to the current stderr."""
    print(f"{category.__name__}: {message}", file=file or sys.stderr)


@contextlib.contextmanager
def script_warnings():
    """Warnings filtered as in a script (Python's default filters), one line each."""
    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.simplefilter("default")
        for category in (ImportWarning, PendingDeprecationWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings(
            "default", category=DeprecationWarning, module="__main__"
        )
        warnings.showwarning = show_warning
        yield


def check_console(block: Block, where: str) -> None:
    """A console block holds only install and set-up commands (it is not run)."""
    command = ""
    for raw in block.code.splitlines():
        line = raw.strip()
        if not line or (line.startswith("#") and not command):
            continue
        command += line.removeprefix("$ ").rstrip("\\").strip() + " "
        if line.endswith("\\"):
            continue
        for part in re.split(r"\s*(?:&&|;)\s*", command.strip()):
            if part and not part.startswith(SETUP_COMMANDS):
                raise DocsBlockError(
                    f"{where}:{block.line}: a ```console block is not run, so it may "
                    f"hold only install or set-up commands, not {part!r}; show code "
                    "in a ```python or ```bash block (they run in the tests) and "
                    "output in a ```text block"
                )
        command = ""


def run_python(code: str, line: int, page: Path, namespace: dict) -> None:
    # Padding keeps the page's line numbers in the traceback.
    padded = "\n" * line + code
    exec(compile(padded, str(page), "exec"), namespace)


def run_bash(block: Block, workdir: Path, where: str) -> str:
    """Runs a bash block; returns its stdout and stderr, read from one pipe."""
    bin_dir = str(Path(sys.executable).parent)
    env = child_env(
        PATH=os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
        MPLBACKEND="Agg",
        OMP_NUM_THREADS="1",
    )
    try:
        done = subprocess.run(
            ["bash", "-e", "-c", block.code],
            cwd=workdir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=BASH_TIMEOUT,
        )
    except subprocess.TimeoutExpired as e:
        raise DocsBlockError(
            f"{where}:{block.line}: the bash block ran past {BASH_TIMEOUT} s"
        ) from e
    if done.returncode:
        raise DocsBlockError(
            f"{where}:{block.line}: the bash block exited with {done.returncode}\n"
            f"--- stdout and stderr\n{done.stdout}"
        )
    return done.stdout


def run_block(
    block: Block, page: Path, workdir: Path, where: str, namespace: dict, capture: bool
) -> str:
    """Runs one block of a page; returns its output when ``capture`` is set."""
    lang = RENAMED.get(block.lang, block.lang)
    if not block.lang:
        raise DocsBlockError(
            f"{where}:{block.line}: the code block names no language; "
            "use ```python, ```bash, ```console or ```text (output)"
        )
    if lang != block.lang:
        raise DocsBlockError(
            f"{where}:{block.line}: write ```{lang}, not ```{block.lang}, "
            "so the block runs in the tests"
        )
    if header := FILE_HEADER.match(block.code.split("\n", 1)[0]):
        target = workdir / header["name"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.code)
    elif lang == "python":
        out = io.StringIO()
        try:
            with contextlib.ExitStack() as redirect:
                if capture:  # stdout and stderr, in the order they are written
                    redirect.enter_context(contextlib.redirect_stdout(out))
                    redirect.enter_context(contextlib.redirect_stderr(out))
                run_python(block.code, block.line, page, namespace)
        except Exception as e:
            raise DocsBlockError(
                f"{where}:{block.line}: the python block raised "
                f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
                + (f"--- its output\n{out.getvalue()}" if capture else "")
            ) from e
        return out.getvalue()
    elif lang == "bash":
        return run_bash(block, workdir, where)
    elif lang == "console":
        check_console(block, where)
    return ""


def run_page(page: Path, workdir: Path, where: str | None = None) -> None:
    """Runs the code blocks of one page in ``workdir`` (the current directory).

    Raises:
        DocsBlockError: naming ``where:LINE`` of the first block that fails,
            or of each ```text block that differs from its block's output.
    """
    where = where or str(page)
    text = page.read_text()
    page_blocks = blocks(text, where)
    shown = expected_outputs(page_blocks, text.splitlines())
    mismatches = []
    main = types.ModuleType("__main__")
    saved_main, threads = sys.modules["__main__"], torch.get_num_threads()
    matplotlib.use("Agg")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    sys.modules["__main__"] = main
    try:
        with script_warnings():
            for k, block in enumerate(page_blocks):
                got = run_block(
                    block, page, workdir, where, main.__dict__, capture=k in shown
                )
                if k in shown:
                    try:
                        check_output(shown[k], got, where)
                    except DocsBlockError as e:
                        mismatches.append(str(e))  # and run on: report them all
    finally:
        sys.modules["__main__"] = saved_main
        torch.set_num_threads(threads)
        import matplotlib.pyplot as plt

        plt.close("all")
    if mismatches:
        raise DocsBlockError("\n\n".join(mismatches))


@pytest.mark.parametrize(
    "page", PAGES, ids=[p.relative_to(DOCS).as_posix() for p in PAGES]
)
def test_the_code_blocks_of_a_docs_page_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_page(page, tmp_path, where=f"docs/{page.relative_to(DOCS).as_posix()}")


# The runner itself, on scratch pages: each broken block fails, naming its line.


def scratch(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "scratch.md"
    page.write_text(text)
    work = tmp_path / "work"
    work.mkdir()
    return page


def test_a_broken_python_block_fails_naming_its_page_and_line(tmp_path, monkeypatch):
    page = scratch(
        tmp_path,
        "# A page\n\n```python\nx = 1\n```\n\n```python\ny = x + 1\n1 / 0\n```\n",
    )
    monkeypatch.chdir(tmp_path / "work")
    with pytest.raises(DocsBlockError, match=r"scratch\.md:7: .*ZeroDivision") as e:
        run_page(page, tmp_path / "work", where="scratch.md")
    assert f'File "{page}", line 9' in str(e.value)  # the page's own line


def test_the_blocks_of_a_page_share_one_namespace_and_a_later_one_sees_the_names(
    tmp_path, monkeypatch
):
    page = scratch(
        tmp_path,
        "```python\nx = 41\n```\ntext\n```python\n"
        "with open('x.txt', 'w') as f:\n    f.write(str(x + 1))\n```\n",
    )
    monkeypatch.chdir(tmp_path / "work")
    run_page(page, tmp_path / "work")
    assert (tmp_path / "work" / "x.txt").read_text() == "42"


def test_a_file_block_is_written_and_a_bash_block_runs_it_with_fitlib(
    tmp_path, monkeypatch
):
    page = scratch(
        tmp_path,
        "```python\n# file: sub/script.py\nimport fitlib\n"
        "open('out.txt', 'w').write(fitlib.__name__)\n```\n\n"
        "```bash\npython sub/script.py\n```\n",
    )
    monkeypatch.chdir(tmp_path / "work")
    run_page(page, tmp_path / "work")
    assert (tmp_path / "work" / "sub" / "script.py").read_text().startswith("# file:")
    assert (tmp_path / "work" / "out.txt").read_text() == "fitlib"


def test_a_failing_bash_block_fails_naming_its_line(tmp_path, monkeypatch):
    page = scratch(tmp_path, "intro\n\n```bash\ntrue\nfalse\necho never\n```\n")
    monkeypatch.chdir(tmp_path / "work")
    with pytest.raises(DocsBlockError, match=r"scratch\.md:3: the bash block exited"):
        run_page(page, tmp_path / "work", where="scratch.md")


@pytest.mark.parametrize(
    "text, line",
    [
        ("```console\npip install fitlib\npython train.py\n```\n", 1),
        ("x\n```console\n$ make docs && python -c 'print(1)'\n```\n", 2),
        ("```\nprint(1)\n```\n", 1),  # no language: not run, so refused
        ("```py\nprint(1)\n```\n", 1),  # another spelling of python
        ("```python\nprint(1)\n", 1),  # never closed
    ],
)
def test_a_block_the_runner_would_not_run_fails(tmp_path, monkeypatch, text, line):
    page = scratch(tmp_path, text)
    monkeypatch.chdir(tmp_path / "work")
    with pytest.raises(DocsBlockError, match=rf"scratch\.md:{line}: "):
        run_page(page, tmp_path / "work", where="scratch.md")


def test_set_up_commands_and_indented_blocks_pass(tmp_path, monkeypatch):
    page = scratch(
        tmp_path,
        "```console\n$ git clone https://x/fitlib && cd fitlib\n"
        'make docs\npip install -e ".[docs]" \\\n  -c constraints.txt\n```\n'
        "1. A step\n\n    ```python\n    z = 3\n    ```\n\n"
        "An example, after prose: not compared.\n\n```text\nnot code\n```\n",
    )
    monkeypatch.chdir(tmp_path / "work")
    run_page(page, tmp_path / "work")


# A ```text block right after a python or bash block is its expected output.


def test_a_shown_output_that_differs_from_the_real_one_fails_with_a_diff(
    tmp_path, monkeypatch
):
    page = scratch(
        tmp_path,
        "# A page\n\n```python\nprint('same weights:', 1 + 1 == 3)\n```\n\n"
        "```text\nsame weights: True\n```\n",
    )
    monkeypatch.chdir(tmp_path / "work")
    with pytest.raises(DocsBlockError, match=r"scratch\.md:7: the ```text block") as e:
        run_page(page, tmp_path / "work", where="scratch.md")
    assert "\n-same weights: True\n+same weights: False" in str(e.value)


@pytest.mark.parametrize(
    "code, shown",
    [
        ("print(True)", "1"),  # doctest would take 1 for True: not here
        ("print(0.6345126330852509)", "0.6345126330852"),  # numbers are exact
        ("print('a')\nprint('b')", "a"),  # a line left out
        ("x = 1", "1"),  # nothing printed
        ("import sys\nprint('oops', file=sys.stderr)", "..."),  # stderr counts...
    ],
)
def test_each_kind_of_drift_between_code_and_shown_output_fails(
    tmp_path, monkeypatch, code, shown
):
    page = scratch(tmp_path, f"```python\n{code}\n```\n```text\n{shown}\n```\n")
    monkeypatch.chdir(tmp_path / "work")
    if shown == "...":  # ... and "..." matches it
        run_page(page, tmp_path / "work", where="scratch.md")
        return
    with pytest.raises(DocsBlockError, match=r"scratch\.md:\d+: the ```text block"):
        run_page(page, tmp_path / "work", where="scratch.md")


def test_dots_stand_for_what_varies_and_stdout_stderr_and_warnings_come_in_order(
    tmp_path, monkeypatch
):
    page = scratch(
        tmp_path,
        "```python\nimport sys, time, warnings\n"
        "print('took', time.perf_counter(), 's')\n"
        "print('to stderr', file=sys.stderr)\n"
        "warnings.warn('careful')\n"
        "print('done:',\n  42)\n```\n\n\n"
        "```text\ntook ... s\nto stderr\nUserWarning: careful\ndone:   42\n```\n",
    )
    monkeypatch.chdir(tmp_path / "work")
    run_page(page, tmp_path / "work", where="scratch.md")


def test_a_bash_blocks_output_is_compared_and_prose_before_a_text_block_is_not(
    tmp_path, monkeypatch
):
    good = "```bash\necho out; echo err >&2\n```\n\n```text\nout\nerr\n```\n"
    prose = "```python\nprint(1)\n```\n\nFor example:\n\n```text\n2\n```\n"
    for text in (good, prose):
        (tmp_path / "scratch.md").write_text(text)
        run_page(tmp_path / "scratch.md", tmp_path)
    page = scratch(tmp_path, good.replace("echo err", "echo error"))
    monkeypatch.chdir(tmp_path / "work")
    with pytest.raises(DocsBlockError, match=r"(?s)scratch\.md:5: .*\n-err\n\+error$"):
        run_page(page, tmp_path / "work", where="scratch.md")
