# `make demo` and `make test` set everything up from a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q -c constraints.txt

.PHONY: demo test lint notebooks docs docs-serve docs-screenshots bench gpu-check clean

$(VENV)/.base: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -e ".[vision,plot]" scikit-learn
	touch $@

$(VENV)/.dev: $(VENV)/.base
	$(PIP) -e ".[dev]"
	touch $@

demo: $(VENV)/.base
	$(PY) examples/demo_digits.py

test: $(VENV)/.dev
	$(PY) -m ruff check fitlib tests benchmarks examples notebooks docs
	$(PY) -m ruff format --check fitlib tests benchmarks examples notebooks docs
	$(PY) -m pytest -q -n auto --dist worksteal

lint: $(VENV)/.dev
	$(PY) -m ruff check --fix fitlib tests benchmarks examples notebooks docs
	$(PY) -m ruff format fitlib tests benchmarks examples notebooks docs

# Runs every notebook and stores it with its outputs (the plots GitHub shows);
# tests/integration/test_notebooks.py fails when a notebook's code changed since.
notebooks: $(VENV)/.dev
	$(PY) -m ruff format notebooks
	$(PY) -m pytest -q -p no:cacheprovider -n auto tests/integration/test_notebooks.py \
		-k test_notebook_runs --store-outputs

# The documentation site (mkdocs.yml, docs/) into site/; a warning fails it.
# tests/integration/test_site.py runs the same build.
docs: $(VENV)/.dev
	$(PY) -m mkdocs build --strict --site-dir site

# Serves the site at http://127.0.0.1:8000 and rebuilds it when a page, a
# notebook or fitlib's code changes (Ctrl-C stops it).
docs-serve: $(VENV)/.dev
	$(PY) -m mkdocs serve -a 127.0.0.1:8000

# Builds the site and saves screenshots of some pages to look at (docs/screenshots.py).
docs-screenshots: $(VENV)/.dev
	$(PY) docs/screenshots.py

bench: $(VENV)/.base
	$(PY) benchmarks/overhead.py --amp

# On a machine with a CUDA GPU: every CUDA test (marked `cuda`), then
# benchmarks/gpu.py, which writes benchmarks/results/gpu-<device>.md. It runs
# with the Python that already has torch there (GPU_PYTHON), not .venv; it
# needs fastprogress importable (docs/explanation/speed.md, "GPU").
# GPU_BENCH_ARGS: --budget is the seconds of gpu.py's step tables (about 5
# minutes in all on an H100); e.g. GPU_BENCH_ARGS="--compile --budget 600".
GPU_PYTHON ?= python3
GPU_BENCH_ARGS ?= --compile --budget 180
gpu-check:
	status=0; \
	$(GPU_PYTHON) -m pytest -q -m cuda -p no:cacheprovider \
		$$(grep -rl "mark.cuda" tests) || status=1; \
	$(GPU_PYTHON) benchmarks/gpu.py $(GPU_BENCH_ARGS) || status=1; \
	exit $$status

clean:
	rm -rf $(VENV) build site *.egg-info
