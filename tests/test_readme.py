"""The README's quick start runs as written: documentation that cannot rot."""

import re
from pathlib import Path

import matplotlib

README = Path(__file__).resolve().parents[1] / "README.md"


def quick_start_code() -> str:
    section = README.read_text().split("## Quick start", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_quick_start_runs_and_learns(tmp_path, monkeypatch):
    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)  # learn.save writes under ./models
    namespace = {}
    exec(compile(quick_start_code(), "README.md", "exec"), namespace)
    learn = namespace["learn"]
    assert learn.validate()["accuracy"] > 0.85
    assert (tmp_path / "models" / "stage1.pth").is_file()
    assert len(learn.recorder.train_losses) == 3


def test_every_fitlib_name_the_readme_imports_or_mentions_exists():
    import importlib

    text = README.read_text()
    imports = re.findall(r"^from (fitlib[\w.]*) import ([\w, ]+)$", text, re.M)
    assert imports, "the README shows no imports"
    for module, names in imports:
        for name in names.split(","):
            assert hasattr(importlib.import_module(module), name.strip()), (
                f"README: from {module} import {name.strip()}"
            )
