# Every target sets itself up: a local virtual environment in .venv, made if missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-sweep test-latest test-diffrax test-lineax test-optimistix test-jax-indexing test-jax-shadow bench docs chromium check-wheel lint clean

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

# The suite runs on two pytest-xdist workers (CI's two cores; TEST_WORKERS=1 for one
# process). `test-slow` runs the tests kept out of `make test` to keep it under 10 minutes
# (second solvers and cases of a check, the costlier strong-order fits, adjoints and
# guides): CI runs them after it. `test-sweep` runs the generated sweeps, thousands of
# cases (the op catalogue's whole product, 3175 random programs): hours, not in CI.
TEST_WORKERS ?= 2
test: $(STAMP) lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=20

test-slow: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m slow --durations=20

test-sweep: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m sweep

# The suite against the newest releases, without constraints (jax 0.12 needs Python 3.12+):
#   make test-latest PYTHON_LATEST=/path/to/python3.12
PYTHON_LATEST ?= python3.12
test-latest:
	$(PYTHON_LATEST) -m venv .venv-latest
	.venv-latest/bin/python -m pip install -q --upgrade pip
	.venv-latest/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e '.[test]'
	.venv-latest/bin/python -c "import importlib.metadata as m, sys; print('Python', sys.version.split()[0], *(f'{p} {m.version(p)}' for p in ('jax', 'jaxlib', 'diffrax', 'equinox', 'lineax')))"
	DIFFRAX_LINEARIZE_TEST_FAST_COMPILE=0 .venv-latest/bin/python -m pytest -q -n $(TEST_WORKERS)

# Diffrax 0.7.2's own tests with our ItoMilstein, StratonovichMilstein and BacksolveAdjoint
# in place of Diffrax's, then its implicit-solver tests with Diffrax's own root finders
# (the baseline), with our VeryChord and with our Newton as the root finder of every
# implicit solver, its tests of implicit solvers with our stiff solvers in their place, and
# its tests that name diffrax.PIDController with our PredictiveController in its place
# (alone, and with our stiff solvers in place of Diffrax's implicit ones), and its SDE
# solver tests with our SDE solvers added to their lists (not part of `make test`; see
# tests/diffrax_suite.py for where the tests come from: DIFFRAX_GIT=/path/to/diffrax-clone
# or DIFFRAX_TESTS=/path/to/test). All legs run; the target fails if any failed. Record in
# docs/devdocs/diffrax_tests.md.
test-diffrax: $(STAMP)
	rc=0; \
	$(PY) tests/diffrax_suite.py -q || rc=1; \
	$(PY) tests/diffrax_suite.py --implicit diffrax -q -rfEx || rc=1; \
	$(PY) tests/diffrax_suite.py --implicit verychord -q -rfEx || rc=1; \
	$(PY) tests/diffrax_suite.py --implicit newton -q -rfEx || rc=1; \
	$(PY) tests/diffrax_suite.py --stiff -q -rfEx || rc=1; \
	$(PY) tests/diffrax_suite.py --stiff --controller -q -rfEx || rc=1; \
	$(PY) tests/diffrax_suite.py --controller -q -rfEx || rc=1; \
	$(PY) tests/diffrax_suite.py --sde -q -rfEx || rc=1; \
	exit $$rc

# Lineax 0.1.1's own operator and solver tests with our four operators and
# StructuredLinearSolver added to theirs (not part of `make test`; see
# tests/lineax_suite.py for where the tests come from: LINEAX_GIT=/path/to/lineax-clone or
# LINEAX_TESTS=/path/to/tests). Record in docs/devdocs/lineax_tests.md.
test-lineax: $(STAMP)
	$(PY) tests/lineax_suite.py -q -n $(TEST_WORKERS) -rfEX

# Optimistix 0.1.0's root-finding tests with our VeryChord and Newton added to their root
# finders (tests/optimistix_suite.py; OPTIMISTIX_GIT=... or OPTIMISTIX_TESTS=...).
test-optimistix: $(STAMP)
	$(PY) tests/optimistix_suite.py -q -n $(TEST_WORKERS) -rfEX

# JAX 0.10.2's indexing catalogue (tests/lax_numpy_indexing_test.py: its index
# expressions, indexing strategies and modes, and .at[] updates) through materialise and
# materialise_operator against jax.jacfwd and jax.jacrev (tests/jax_indexing_suite.py;
# JAX_GIT=/path/to/jax-clone or JAX_TESTS=/path/to/tests; ALL=1 for the whole product).
# Record in docs/devdocs/structure_engine.md.
test-jax-indexing: $(STAMP)
	$(PY) tests/jax_indexing_suite.py -q -n $(TEST_WORKERS) -rfE $(if $(ALL),--all)

# JAX's own control-flow, custom-derivative, linalg and scipy tests, with `materialise`
# checked on every function they differentiate (tests/jax_shadow_suite.py).
test-jax-shadow: $(STAMP)
	$(PY) tests/jax_shadow_suite.py -q -n $(TEST_WORKERS)

# The site, then the checks on it (tests/test_site.py): every public name described, no
# network requests, and the maths typeset offline in a headless Chromium (screenshot in
# build/docs-check/).
docs: $(STAMP) chromium
	$(PY) -m pip install -q -c constraints.txt -e '.[docs]'
	$(PY) -m benchmarks.report
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	mkdir -p build/docs-check
	DOCS_SITE=site DOCS_SCREENSHOT=build/docs-check/maths.png \
		$(PY) -m pytest -q -o addopts="" -m "not slow" tests/test_site.py

# The browser check (tests/test_site.py) needs a headless Chromium. A build installs no
# system packages: without one the check is skipped, and says so (`.ci/run` installs
# Debian's `chromium` before `make docs`, and makes its absence an error there).
BROWSERS := chromium chromium-browser google-chrome chrome
chromium:
	@for b in $(BROWSERS); do command -v $$b >/dev/null 2>&1 && exit 0; done; \
	echo "make docs: no Chromium found ($(BROWSERS)), so the browser check of the maths is" \
		"skipped. Install one to run it, e.g. 'apt-get install chromium' on Debian."

# The wheel as a user gets it: built from a clean copy, its metadata checked, installed with
# its dependencies into a fresh virtual environment, imported there from outside the clone.
WHEEL_DIR := build/wheel
check-wheel: $(STAMP)
	rm -rf $(WHEEL_DIR) && mkdir -p $(WHEEL_DIR)
	$(PY) -m pip wheel -q --no-deps -w $(WHEEL_DIR) .
	$(PY) tests/check_wheel.py $(WHEEL_DIR)/diffrax_linearize-*.whl
	$(PYTHON) -m venv $(WHEEL_DIR)/venv
	$(WHEEL_DIR)/venv/bin/python -m pip install -q -c constraints.txt $(WHEEL_DIR)/diffrax_linearize-*.whl
	cd $(WHEEL_DIR) && venv/bin/python -c "import diffrax_linearize as dl, pathlib; \
		assert (pathlib.Path(dl.__file__).parent / 'py.typed').is_file(); \
		assert 'site-packages' in dl.__file__, dl.__file__; \
		print('import diffrax_linearize', dl.__version__, 'from', dl.__file__)"

clean:
	rm -rf $(VENV) .venv-latest site build .pytest_cache .ruff_cache .diffrax-tests .lineax-tests .optimistix-tests
