"""Build hooks of the documentation site (``hooks:`` in mkdocs.yml).

- ``on_files`` adds the notebooks, which stay in ``notebooks/``, as the pages
  ``tutorials/<stem>.ipynb`` (mkdocs-jupyter renders them with their stored
  outputs) and ``ARCHITECTURE.md``, which stays at the repository's root, as
  the page ``explanation/architecture.md``;
- ``on_page_markdown`` rewrites each page's links to the site's pages (see
  ``site_links``) and replaces the markers of ``reference/state.md`` with
  tables generated from the code that defines them: ``STATE_KEYS``,
  ``WRITABLE`` (``fitlib.callback``) and the callbacks' ``order``
  (``fitlib.callbacks.order_table``), so the tables cannot drift;
- ``on_serve`` makes ``mkdocs serve`` rebuild when those sources change.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files
from mkdocs.utils import get_relative_url
from mkdocs_jupyter.plugin import NotebookFile

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NOTEBOOKS = ROOT / "notebooks"
ARCHITECTURE = ROOT / "ARCHITECTURE.md"
ARCHITECTURE_PAGE = "explanation/architecture.md"
STATE_PAGE = "reference/state.md"


class TutorialFile(NotebookFile):
    """mkdocs-jupyter's page for a notebook, for one outside docs/: its
    ``NotebookFile`` forwards attributes to the file it wraps, but the source
    path it would compute from docs/, which a generated file has not."""

    @property
    def abs_src_path(self) -> str | None:
        return self.file.abs_src_path


def notebook_pages() -> dict[str, Path]:
    """The tutorial pages, ``tutorials/<stem>.ipynb``, and their notebooks."""
    return {f"tutorials/{nb.name}": nb for nb in sorted(NOTEBOOKS.glob("*.ipynb"))}


# A Markdown link, [text](target), and a fenced code block (left as it is).
LINK = re.compile(r"\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)\)")
FENCED = re.compile(r"^([ \t]*)(`{3,}|~{3,}).*?^\1\2[ \t]*$", re.S | re.M)


def site_link(match: re.Match, source: Path, uri: str) -> str:
    """One link of the page ``uri`` (written in ``source``), for the site."""
    target = match["target"]
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or target.startswith(("/", "#")):
        return match[0]
    path, hash_, fragment = target.partition("#")
    real = (source.parent / unquote(path)).resolve()
    if real.parent == NOTEBOOKS and real.suffix == ".ipynb":
        page = f"tutorials/{real.name}"
    elif real == ARCHITECTURE:
        page = ARCHITECTURE_PAGE
    elif DOCS in real.parents and DOCS not in source.parents:
        page = real.relative_to(DOCS).as_posix()  # from ARCHITECTURE.md
    elif real.is_file() and ROOT in real.parents and DOCS not in real.parents:
        return match["text"]  # a source file: the site has no page for it
    else:
        return match[0]  # mkdocs checks it (and fails on a broken one)
    return f"[{match['text']}]({get_relative_url(page, uri)}{hash_}{fragment})"


def site_links(markdown: str, uri: str) -> str:
    """A page's links as the site needs them.

    The Markdown under docs/ links the files of the repository, so that it
    reads on GitHub: a notebook as ``notebooks/<stem>.ipynb``, the contract
    as ``ARCHITECTURE.md``. The site shows them as the pages
    ``tutorials/<stem>.ipynb`` and ``explanation/architecture.md``, so such a
    link becomes one to that page, relative to ``uri``. A link to another
    file of the repository outside docs/ (a reference page's source file)
    becomes its text: the site has no page for it. Code blocks are left as
    they are; every other link is, too, for mkdocs to check.
    """
    source = ARCHITECTURE if uri == ARCHITECTURE_PAGE else DOCS / uri

    def links(text: str) -> str:
        return LINK.sub(lambda m: site_link(m, source, uri), text)

    out, end = [], 0
    for block in FENCED.finditer(markdown):
        out += [links(markdown[end : block.start()]), block[0]]
        end = block.end()
    return "".join([*out, links(markdown[end:])])


def cell(text: str) -> str:
    """Text for one cell of a Markdown table: on one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def state_keys_table() -> str:
    """The state a hook receives, from ``fitlib.callback.STATE_KEYS``."""
    from fitlib.callback import STATE_KEYS

    if not isinstance(STATE_KEYS, dict):
        raise PluginError(
            "fitlib.callback.STATE_KEYS must map each key to what it holds (a "
            f"dict), not a {type(STATE_KEYS).__name__}"
        )
    rows = [f"| `{key}` | {cell(meaning)} |" for key, meaning in STATE_KEYS.items()]
    return "\n".join(["| key | what it holds |", "|---|---|", *rows])


def writable_table() -> str:
    """The events whose hooks may return each key, from ``fitlib.callback.WRITABLE``."""
    from fitlib.callback import WRITABLE

    rows = [
        f"| `{key}` | {', '.join(f'`{event}`' for event in events)} |"
        for key, events in WRITABLE.items()
    ]
    header = "| key | a hook may return it in |"
    return "\n".join([header, "|---|---|", *rows])


def order_page(name: str) -> str:
    """The reference page of a callback class, relative to reference/state.md."""
    import fitlib.callbacks

    if name == "Callback":
        return "callback.md"
    module = getattr(fitlib.callbacks, name).__module__.rsplit(".", 1)[-1]
    return f"callbacks/{module}.md"


def order_markdown_table() -> str:
    """The callback order table, from ``fitlib.callbacks.order_table()``."""
    from fitlib.callbacks import order_table

    rows = [
        f"| {order} | [`{name}`]({order_page(name)}) | {cell(why)} |"
        for name, order, why in order_table()
    ]
    return "\n".join(["| order | callback | why there |", "|---:|---|---|", *rows])


# The markers of reference/state.md and the tables that replace them.
TABLES = {
    "<!-- generated: state-keys -->": state_keys_table,
    "<!-- generated: writable -->": writable_table,
    "<!-- generated: callback-order -->": order_markdown_table,
}


# After mkdocs-jupyter's on_files (priority 0), which would wrap these files in
# its NotebookFile; they are wrapped in TutorialFile here instead.
@event_priority(-100)
def on_files(files: Files, config) -> Files:
    generated = {
        uri: TutorialFile(File.generated(config, uri, abs_src_path=str(path)), **config)
        for uri, path in notebook_pages().items()
    }
    generated[ARCHITECTURE_PAGE] = File.generated(
        config, ARCHITECTURE_PAGE, content=ARCHITECTURE.read_text(encoding="utf-8")
    )
    for uri, file in generated.items():
        if files.get_file_from_path(uri) is not None:
            raise PluginError(
                f"docs/{uri} exists, but the build makes that page from "
                f"{file.abs_src_path or ARCHITECTURE}: delete docs/{uri}"
            )
        files.append(file)
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = site_links(markdown, page.file.src_uri)
    if page.file.src_uri != STATE_PAGE:
        return markdown
    for marker, table in TABLES.items():
        if marker not in markdown:
            raise PluginError(f"docs/{STATE_PAGE} has lost its marker {marker}")
        markdown = markdown.replace(marker, table())
    return markdown


def on_serve(server, config, builder):
    for path in (NOTEBOOKS, ARCHITECTURE, ROOT / "fitlib"):
        server.watch(str(path))
    return server
