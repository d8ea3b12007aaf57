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
    assert len(table) == 8 and "errors.py" in table[0]
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


# -- imports land on their definitions -----------------------------------------
def defined_names(source: str) -> set[str]:
    """The names a module defines at its top level (not those it imports)."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def import_problems(sources: dict[str, str]) -> list[str]:
    """``"<module>: <what>"`` for each import inside the package that does not
    land on a definition: a bare ``import fitlib`` (or ``import fitlib.x``
    without ``as``, which binds ``fitlib``), a ``from fitlib import x`` (the
    package's exports are for users), a relative import, a name reached
    through a module that only re-exports it (``from fitlib.metrics import
    Metrics``, or ``fm.Metrics`` after ``import fitlib.metrics as fm``), and a
    private name taken from another module. ``fitlib/__init__.py`` and the
    subpackages' ``__init__`` (the public exports) are exempt as importers,
    never as sources."""
    defined = {m: defined_names(s) for m, s in sources.items()}
    problems = []
    for module, source in sorted(sources.items()):
        if module not in PUBLIC_EXPORTS:
            problems += module_problems(module, ast.parse(source), defined)
    return problems


def module_problems(module: str, tree: ast.Module, defined: dict) -> list[str]:
    problems, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "fitlib" or (
                    a.name.startswith("fitlib.") and not a.asname
                ):
                    problems.append(f"{module}: import {a.name}")
                elif a.name.startswith("fitlib."):
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.level:
            problems.append(f"{module}: a relative import (from {'.' * node.level}"
                            f"{node.module or ''} import ...)")  # fmt: skip
        elif isinstance(node, ast.ImportFrom) and node.module == "fitlib":
            names = ", ".join(a.name for a in node.names)
            problems.append(f"{module}: from fitlib import {names}")
        elif isinstance(node, ast.ImportFrom) and node.module.startswith("fitlib."):
            for a in node.names:
                problems += name_problems(module, node.module, a.name, defined)
    for node in ast.walk(tree):  # fm.Metrics after import fitlib.metrics as fm
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            source = aliases.get(node.value.id)
            if source is not None:
                problems += name_problems(module, source, node.attr, defined)
    return problems


def name_problems(module: str, source: str, name: str, defined: dict) -> list[str]:
    where = f"{module}: from {source} import {name}"
    if f"{source}.{name}" in defined:  # a submodule
        return []
    if source not in defined:
        return [f"{where} (no such module)"]
    if name not in defined[source]:
        return [f"{where}, which {source} only re-exports"]
    if name.startswith("_") and not name.startswith("__"):
        return [f"{where}, a private name of another module"]
    return []


PUBLIC_EXPORTS = {"fitlib", "fitlib.callbacks", "fitlib.metrics"}


def test_imports_land_on_their_definitions():
    assert import_problems(package_sources()) == []


def test_the_check_catches_each_kind_of_import():
    """The instrument: each kind of import it must refuse is refused."""
    sources = package_sources()
    sources["fitlib.plots"] += (
        "\nimport fitlib\nfrom fitlib import Learner\n"
        "from fitlib.metrics import Metrics\n"  # defined in metrics.collection
        "from fitlib.errors import _no_such_private\n"
        "def f():\n    from fitlib.core import fit  # fine: defined there\n"
        "from . import learner\n"
        "import fitlib.core\n"  # binds the name fitlib: fitlib.Learner works
        "import fitlib.metrics as fm\nfm.Metrics\nfm.functions\n"
        "import fitlib.ranks as ranks\nranks.is_main\n"  # fine: defined there
    )
    sources["fitlib.errors"] += "\ndef _no_such_private():\n    pass\n"
    assert import_problems(sources) == [
        "fitlib.plots: import fitlib",
        "fitlib.plots: from fitlib import Learner",
        "fitlib.plots: from fitlib.metrics import Metrics, which fitlib.metrics "
        "only re-exports",
        "fitlib.plots: from fitlib.errors import _no_such_private, a private "
        "name of another module",
        "fitlib.plots: a relative import (from . import ...)",
        "fitlib.plots: import fitlib.core",
        "fitlib.plots: from fitlib.metrics import Metrics, which fitlib.metrics "
        "only re-exports",
    ]


def callback_classes(source: str, bases: set[str]) -> list[str]:
    """The public classes of a module (anywhere in it: inside an ``if`` too)
    that subclass one of ``bases``, by name or by an alias it imports them
    under (``from fitlib.callback import Callback as CB``). A private class
    that helps the module's one callback (the filters' ``_Every``) is not
    counted."""
    tree = ast.parse(source)
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    names = {a.asname: a.name for n in imports for a in n.names if a.asname}
    return [
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_")
        and any(names.get(base_name(b), base_name(b)) in bases for b in node.bases)
    ]  # fmt: skip


def callback_bases() -> set[str]:
    """``Callback`` and every class of ``fitlib/callbacks/`` that derives from
    it (``ParamScheduler``, ``Filter``), by name, to a fixed point."""
    bases, sources = {"Callback"}, [p.read_text() for p in callback_files()]
    while True:
        found = bases.union(*(callback_classes(s, bases) for s in sources))
        if found == bases:
            return bases
        bases = found


def callback_files() -> list[Path]:
    return sorted((PACKAGE / "callbacks").glob("*.py"))


def base_name(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")


def test_each_callbacks_file_holds_one_callback():
    bases = callback_bases()
    found = {p.name: callback_classes(p.read_text(), bases) for p in callback_files()}
    assert {name: cbs for name, cbs in found.items() if len(cbs) > 1} == {}


def test_the_one_callback_check_catches_a_second_callback():
    source = (PACKAGE / "callbacks" / "clipping.py").read_text()
    source += (
        "\nclass Another(ParamScheduler):\n    pass\n"
        "from fitlib.callback import Callback as CB\n"
        "if True:\n    class Hidden(CB):\n        pass\n"
    )
    assert callback_classes(source, callback_bases()) == [
        "GradientClipping",
        "Another",
        "Hidden",
    ]


# -- the tests mirror the modules --------------------------------------------------
TESTS = ROOT / "tests"
# The contract's own test: it reads ARCHITECTURE.md, not one module.
NOT_FOR_A_MODULE = {"test_architecture.py"}
# Modules that need no test file of their own.
UNTESTED = {"__init__.py", "version.py"}


def module_stems(modules: list[str]) -> dict[str, set[str]]:
    """The stems a test file may be named for, by folder under ``tests/``:
    ``{"callbacks": {"init", "recorder", ...}}`` for
    ``callbacks/__init__.py``, ``callbacks/recorder.py`` (paths under
    ``fitlib/``)."""
    stems: dict[str, set[str]] = {}
    for module in modules:
        folder, _, name = module.rpartition("/")
        stem = "init" if name == "__init__.py" else name.removesuffix(".py")
        stems.setdefault(folder, set()).add(stem)
    return stems


def module_tested_by(test: str, stems: dict[str, set[str]]) -> str | None:
    """The module a test file (a path under ``tests/``) is named for:
    ``test_<module>.py`` or ``test_<module>_<aspect>.py`` in the folder that
    mirrors the module's (the longest module name that fits), else None."""
    folder, _, name = test.rpartition("/")
    stem = name.removeprefix("test_").removesuffix(".py")
    fits = [s for s in stems.get(folder, ()) if stem == s or stem.startswith(s + "_")]
    if not fits:
        return None
    module = max(fits, key=len)
    return "/".join(filter(None, [folder, "__init__" if module == "init" else module]))


def layout_problems(modules: list[str], tests: list[str]) -> list[str]:
    """Test files outside ``integration/`` not named for a module at the
    mirrored path, and modules (but ``UNTESTED``) without a test file."""
    stems = module_stems(modules)
    problems, tested = [], set()
    for test in tests:
        if test.split("/")[0] == "integration" or test in NOT_FOR_A_MODULE:
            continue
        module = module_tested_by(test, stems)
        if module is None:
            problems.append(
                f"tests/{test} is named for no module: name it test_<module>.py "
                "(or test_<module>_<aspect>.py) in the folder mirroring the "
                "module's, or move it to tests/integration/ if it crosses modules"
            )
        tested.add(module)
    for module in modules:
        name = module.rpartition("/")[2]
        if name not in UNTESTED and module.removesuffix(".py") not in tested:
            problems.append(f"fitlib/{module} has no test file")
    return problems


def test_every_test_file_is_named_for_a_module_and_every_module_has_one():
    modules = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")]
    tests = [p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py")]
    assert layout_problems(modules, tests) == []


def test_the_layout_check_catches_misnamed_tests_and_untested_modules():
    modules = ["__init__.py", "version.py", "core.py", "callback.py",
               "callback_handler.py", "callbacks/__init__.py",
               "callbacks/recorder.py"]  # fmt: skip
    good = ["test_core.py", "test_callback.py", "test_callback_handler.py",
            "test_callback_handler_returned_keys.py", "callbacks/test_init.py",
            "callbacks/test_recorder.py", "integration/test_anything.py",
            "test_architecture.py"]  # fmt: skip
    assert layout_problems(modules, good) == []
    misnamed = ["test_loop.py", "test_recorder.py", "callbacks/test_core.py",
                "other/test_core.py"]  # fmt: skip
    problems = layout_problems(modules, good + misnamed)
    assert [p.split()[0] for p in problems] == [f"tests/{t}" for t in misnamed]
    # test_callback_handler.py tests the handler, not callback.py: the longest
    # module name that fits is the one it is named for.
    problems = layout_problems(modules, [*good[:1], *good[2:]])
    assert problems == ["fitlib/callback.py has no test file"]


def long_modules(limit: int = 500) -> list[str]:
    """The package's modules over ``limit`` lines, as paths under fitlib/."""
    paths = sorted(PACKAGE.rglob("*.py"))
    return [str(p.relative_to(PACKAGE)) for p in paths
            if len(p.read_text().splitlines()) > limit]  # fmt: skip


def unexplained(modules: list[str]) -> list[str]:
    """Those of ``modules`` that ARCHITECTURE.md's size rule does not name."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    rule = text.split("a module over about 500 lines says", 1)[1].split("\n- ", 1)[0]
    return [m for m in modules if f"`{m}`" not in rule]


def test_a_module_over_500_lines_says_why_in_the_contract():
    assert unexplained(long_modules()) == []


def test_the_size_check_catches_a_long_module_not_named():
    assert unexplained(["learner.py", "callbacks/early_stopping.py"]) == [
        "callbacks/early_stopping.py"
    ]
