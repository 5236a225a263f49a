# Every target sets itself up: a local virtual environment in .venv, made if missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-latest bench docs lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m benchmarks demo

bench: $(STAMP)
	$(PY) -m benchmarks all

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: $(STAMP) lint
	$(PY) -m pytest -q

# The suite against the newest releases, without constraints (jax 0.12 needs Python 3.12+):
#   make test-latest PYTHON_LATEST=/path/to/python3.12
PYTHON_LATEST ?= python3.12
test-latest:
	$(PYTHON_LATEST) -m venv .venv-latest
	.venv-latest/bin/python -m pip install -q --upgrade pip
	.venv-latest/bin/python -m pip install -q --upgrade -e '.[test]'
	.venv-latest/bin/python -c "import jax; print('jax', jax.__version__)"
	.venv-latest/bin/python -m pytest -q

docs: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[docs]'
	$(PY) -m benchmarks.report
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) .venv-latest site .pytest_cache .ruff_cache
