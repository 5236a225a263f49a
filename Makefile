# Every target sets itself up: a local virtual environment in .venv, made if missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-latest test-diffrax bench docs lint clean

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
	.venv-latest/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e '.[test]'
	.venv-latest/bin/python -c "import importlib.metadata as m, sys; print('Python', sys.version.split()[0], *(f'{p} {m.version(p)}' for p in ('jax', 'jaxlib', 'diffrax', 'equinox', 'lineax')))"
	.venv-latest/bin/python -m pytest -q

# Diffrax 0.7.2's own tests with our ItoMilstein, StratonovichMilstein and BacksolveAdjoint
# in place of Diffrax's (not part of `make test`; see tests/diffrax_suite.py for where the
# tests come from: DIFFRAX_GIT=/path/to/diffrax-clone or DIFFRAX_TESTS=/path/to/test).
test-diffrax: $(STAMP)
	$(PY) tests/diffrax_suite.py -q

docs: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[docs]'
	$(PY) -m benchmarks.report
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) .venv-latest site .pytest_cache .ruff_cache .diffrax-tests
