# `make demo` and `make test` set everything up from a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q -c constraints.txt

.PHONY: demo test lint bench clean

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
	$(PY) -m ruff check fitlib tests benchmarks examples notebooks
	$(PY) -m ruff format --check fitlib tests benchmarks examples notebooks
	$(PY) -m pytest -q

lint: $(VENV)/.dev
	$(PY) -m ruff check --fix fitlib tests benchmarks examples notebooks
	$(PY) -m ruff format fitlib tests benchmarks examples notebooks

bench: $(VENV)/.base
	$(PY) benchmarks/overhead.py --amp

clean:
	rm -rf $(VENV) build *.egg-info
