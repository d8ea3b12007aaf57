"""The layer table of ARCHITECTURE.md holds: no module imports a lower layer's
module (one listed further down the table), and every module has a layer."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fitlib"


def layer_table() -> list[list[str]]:
    """The modules of each row of the layer table, top row (lowest) first."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("## Layers, bottom to top", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [re.findall(r"`([\w/]+(?:\.py|/))`", row.split("|")[2]) for row in rows[1:]]


def module_of(path: Path) -> str:
    """``fitlib.callbacks.recorder`` for ``fitlib/callbacks/recorder.py``."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str, table: list[list[str]]) -> int | None:
    """The row whose entry names the module or a package that holds it."""
    rel = module.removeprefix("fitlib").lstrip(".").replace(".", "/")
    for index, entries in enumerate(table):
        for entry in entries:
            if entry.endswith("/") and (rel + "/").startswith(entry):
                return index
            if entry == f"{rel}.py" or (rel == "" and entry == "__init__.py"):
                return index
    return None


def fitlib_imports(source: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "fitlib":  # from fitlib import ranks
                found |= {f"fitlib.{alias.name}" for alias in node.names}
            elif node.module.startswith("fitlib."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("fitlib.")}
    return found


def upward_imports(sources: dict[str, str], table: list[list[str]]) -> list[str]:
    """``"<module> imports <module>"`` for each import of a lower layer."""
    upward = []
    for module, source in sorted(sources.items()):
        own = layer_of(module, table)
        for imported in sorted(fitlib_imports(source)):
            other = layer_of(imported, table)
            if other is not None and own is not None and other > own:
                upward.append(f"{module} imports {imported}")
    return upward


def package_sources() -> dict[str, str]:
    return {module_of(p): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_the_table_lists_every_layer_and_the_tests_read_it():
    table = layer_table()
    assert len(table) == 8 and table[0][0] == "errors.py"
    assert "callbacks/" in table[6] and "learner.py" in table[7]


def test_every_module_has_a_layer():
    table = layer_table()
    missing = [m for m in package_sources() if layer_of(m, table) is None]
    assert missing == [], "add them to ARCHITECTURE.md's layer table"


def test_no_module_imports_a_lower_layer():
    assert upward_imports(package_sources(), layer_table()) == []


def test_the_check_catches_an_upward_import():
    """The instrument itself: a helper that imports the loop is caught."""
    sources = package_sources()
    sources["fitlib.errors"] += "\nfrom fitlib.core import fit\n"
    sources["fitlib.callbacks.recorder"] += "\nfrom fitlib import learner\n"
    assert upward_imports(sources, layer_table()) == [
        "fitlib.callbacks.recorder imports fitlib.learner",
        "fitlib.errors imports fitlib.core",
    ]
