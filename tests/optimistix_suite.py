"""Optimistix 0.1.0's own root-finding tests, run with this project's root finders added.

`make test-optimistix` (or `python tests/optimistix_suite.py [pytest arguments]`) runs
Optimistix's `test_root_find.py`, whose `test_root_find` and `test_root_find_jvp` solve
every problem of its fixed-point table (pytrees, arguments closed over, with and without
auxiliary outputs; the JVP through the root, in float64 and complex128, against finite
differences) with each root finder of the module's `_root_finders` (`optimistix.Newton`,
`optimistix.Chord`). Before those tests are parametrised, ours are added to their
`solver` list (`pytest_generate_tests`), at the module's tolerances with Optimistix's
default norm (ours take `rtol`, `atol` and `norm` together, or none of them and then the
step-size controller's):

- `diffrax_linearize.VeryChord`, with its divergence and rate-based termination (Diffrax's,
  as fixed upstream) and with `cauchy_termination=True` (as `optimistix.Chord` stops);
- `diffrax_linearize.Newton`.

Only the cases of ours run. Optimistix's conftest makes JAX's dtype promotion strict and
rank promotion an error, so ours are checked under both. The tests come from Optimistix's
git repository as Lineax's do for `lineax_suite.py` (`OPTIMISTIX_TESTS`, `OPTIMISTIX_GIT`,
or a clone of `v0.1.0` into `.optimistix-tests/`), each file checked against its git blob
hash. The result is recorded in `docs/devdocs/lineax_tests.md`.
"""

import sys

import pytest


TAG = "v0.1.0"
REPO = "https://github.com/patrick-kidger/optimistix"

# `git rev-parse v0.1.0:tests/<file>` in Optimistix's repository.
BLOBS = {
    "__init__.py": "8b137891791fe96927ad78e64b0aad7bded08bdc",
    "conftest.py": "8368845e955fde4b0e3409122d58cd330a336ed0",
    "helpers.py": "5480952d6b90c1f0c57e2d59ebc260067c6f1c74",
    "test_root_find.py": "fbcf0aba958dc99d1757d5a8ccbd45dfe3921810",
}
# The tests parametrised by `_root_finders`.
TESTS = ("test_root_find", "test_root_find_jvp")
# The module's tolerances (`atol = rtol = 1e-6`, as `_root_finders` are built).
RTOL = ATOL = 1e-6


def _ours():
    """`{id: root finder}` of ours, as `_root_finders` builds Optimistix's."""
    import diffrax_linearize as dl
    import optimistix as optx

    norm = optx.max_norm
    return {
        "VeryChord": dl.VeryChord(RTOL, ATOL, norm),
        "VeryChord-cauchy": dl.VeryChord(RTOL, ATOL, norm, cauchy_termination=True),
        "Newton": dl.Newton(RTOL, ATOL, norm),
    }


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc):
    """Ours appended to the `solver` parameters of `TESTS`, before pytest's own hook
    reads them (`tryfirst`)."""
    if metafunc.function.__name__ not in TESTS:
        return
    markers = metafunc.definition.own_markers
    for i, mark in enumerate(markers):
        if mark.name == "parametrize" and mark.args[0] == "solver":
            values = list(mark.args[1])
            ids = [type(v).__name__ for v in values]
            ours = _ours()
            markers[i] = pytest.mark.parametrize(
                "solver", values + list(ours.values()), ids=ids + [f"ours-{k}" for k in ours]
            ).mark


def pytest_collection_modifyitems(config, items):
    import diffrax_linearize as dl
    from outside_suite import select

    def keep(item):
        solver = getattr(getattr(item, "callspec", None), "params", {}).get("solver")
        return isinstance(solver, (dl.VeryChord, dl.Newton))

    select(config, items, keep)


def pytest_report_header(config):
    names = ", ".join(
        f"{k}: {type(v).__module__}.{type(v).__qualname__}" for k, v in _ours().items()
    )
    return f"Optimistix {TAG}'s root-finding tests with diffrax_linearize's root finders ({names})"


def main(argv: list[str]) -> int:
    from outside_suite import run

    return run("optimistix_suite", "optimistix", REPO, TAG, BLOBS, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
