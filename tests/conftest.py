import gc
import itertools
import os
import re


# The suite is compile-bound: about a thousand tests each trace and compile small programs,
# and LLVM's optimisation passes are most of an XLA:CPU compile, while nothing here times the
# compiled code. So `make test` compiles at LLVM's -O0 (about 12% less wall time on two
# cores). A program's numerics do not depend on the level up to the last bits, and the
# comparisons that want bits (ours against Diffrax's, fixed steps) compile both sides alike.
# It also compiles each program as one LLVM module, not split for parallel code generation:
# these programs are small, and splitting them costs more than it saves (11-12% less wall
# time again, test_stiff.py and test_brownian_carry.py with test_rosenbrock.py in one
# process, 2026-12-06; the split changes no numbers, only how the code is cut up).
# And it emits fusions with XLA:CPU's older elemental emitters, not its MLIR fusion
# emitters, whose compiles are the slower for programs this small: `make test` took 354 s
# against 558 s the run before on the same idle machine (2026-12-06, jax 0.10.2; user time
# 11.0 against 17.4 min), every test passing both ways.
# `make test-latest` sets DIFFRAX_LINEARIZE_TEST_FAST_COMPILE=0 and so runs the suite as
# users compile (XLA's defaults); an XLA_FLAGS that names any of these settings keeps it.
_FAST_FLAGS = (
    "xla_backend_optimization_level=0",
    "xla_cpu_parallel_codegen_split_count=1",
    "xla_cpu_use_fusion_emitters=false",
)
_FLAGS = os.environ.get("XLA_FLAGS", "")
if os.environ.get("DIFFRAX_LINEARIZE_TEST_FAST_COMPILE", "1") != "0":
    for _flag in _FAST_FLAGS:
        if _flag.split("=")[0] not in _FLAGS:
            _FLAGS = f"{_FLAGS} --{_flag}".strip()
    os.environ["XLA_FLAGS"] = _FLAGS
# Read back from the flags, not from the test above: pytest-xdist's workers inherit the
# XLA_FLAGS that this module set in the controlling process (3 is XLA's default level).
_LEVEL = re.findall(r"--xla_backend_optimization_level=(\d+)", os.environ.get("XLA_FLAGS", ""))
BELOW_DEFAULT_OPT = bool(_LEVEL) and int(_LEVEL[-1]) < 3

import jax  # noqa: E402  (after XLA_FLAGS: the backend reads them when it starts)
import pytest  # noqa: E402


# Float64 everywhere: the references (`jax.jacfwd`, per-example `vmap(grad)`, diffrax's own
# solvers) are compared to tight tolerances. Tests of float32 ask for it explicitly.
jax.config.update("jax_enable_x64", True)
# Strict dtype promotion, as Diffrax's, Lineax's and Optimistix's suites run: an implicit
# promotion between two dtypes raises. Run so, their suites found promotions inside the
# library that users who set it would meet (the Lévy areas' keys, the ensemble
# reductions, a complex state under real noise, the root finders on a mixed state, the
# squared gradients of a mixed-precision model); the whole suite now does. Nothing here
# depends on the rules otherwise: a program that passes under them computes the same
# numbers under the standard ones. Tests whose own code needs the standard rules (a real
# array times a Python complex, as users write under them) are marked `standard_promotion`.
jax.config.update("jax_numpy_dtype_promotion", "strict")


def pytest_runtest_teardown(item, nextitem):
    # Every compiled XLA:CPU program keeps a few memory mappings for its code while JAX's
    # caches hold it (about 40 per test of the op catalogue), and a process may have at most
    # `vm.max_map_count` (65530 by default) of them: a pytest-xdist worker that runs the
    # slow tests crashed in XLA's compiler ("Segmentation fault" in
    # `backend_compile_and_load`, three times in two runs, 2026-12-06) once it had compiled
    # that many. So each test module's programs are dropped when the next module starts;
    # the tests of a module still share theirs. (Dropping them only once a process holds
    # half that many mappings, so that modules share the small programs of eager
    # operations, was not faster: 677 s for `make test` against 601 s the run before,
    # 2026-12-06, on a machine whose speed drifts by up to 15% between runs.)
    if nextitem is None or nextitem.module is not item.module:
        jax.clear_caches()
        gc.collect()


def pytest_collection_modifyitems(config, items):
    # Tests marked `default_xla_opt` want two XLA programs to agree to the step: that holds
    # while their rounding differences flip no accept/reject decision, as at XLA's default
    # level on their paths, not at -O0. They run in `make test-latest`.
    if BELOW_DEFAULT_OPT:
        skip = pytest.mark.skip(
            reason="compiled below XLA's default level (`make test`: -O0); runs in make test-latest"
        )
        for item in items:
            if "default_xla_opt" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _promotion_rules(request):
    if request.node.get_closest_marker("standard_promotion") is None:
        yield
        return
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.fixture
def getkey():
    """`getkey()` returns a fresh PRNG key on each call; the sequence is the same in every
    test, so failures reproduce."""
    counter = itertools.count()
    base = jax.random.key(5678)
    return lambda: jax.random.fold_in(base, next(counter))
