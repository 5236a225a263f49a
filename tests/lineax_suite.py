"""Lineax 0.1.1's own tests, run with this project's operators and linear solver added.

`make test-lineax` (or `python tests/lineax_suite.py [pytest arguments]`) runs Lineax's
operator and solver tests with

- this project's four operators, `diffrax_linearize.BlockDiagonalLinearOperator`,
  `.BandedLinearOperator`, `.SparseLinearOperator` and `.CSRLinearOperator`, added to the
  operators Lineax's tests build from a matrix (`helpers.make_operators`), so that every
  test that takes an operator (`mv`, `as_matrix`, `transpose`, lineax's `singledispatch`
  functions `diagonal`, `tridiagonal`, `is_symmetric`, ..., `linearise`, `materialise`,
  arithmetic with lineax's operators, JVPs through the constructor, `vmap`) and every
  solver Lineax tests takes ours too;
- `diffrax_linearize.StructuredLinearSolver`, with its default dense crossover and with
  `dense_below=0` (every sparse operator kept sparse: the reordered band), added to the
  solvers (`helpers.solvers_tags_pseudoinverse`), so that Lineax's checks of a solver
  (against `jnp.linalg.lstsq` and `pinv`, JVPs through the solve, with and without a
  precomputed state, `vmap`, transposes, the well-posed systems of every operator) run
  on ours.

Only the cases that involve ours run (`pytest_collection_modifyitems`): a parametrised
test keeps the cases of our operators or solvers; `test_operator.py`'s tests that loop
over every operator run whole. Lineax's conftest makes JAX's dtype promotion strict and
rank promotion an error, so our operators and solver are checked under those too.

Each operator is built from the test's dense matrix with the pattern the test's tags
promise (`_pattern`): a diagonal matrix is stored as its diagonal (`n` blocks of one
entry, one band, one entry per row), a tridiagonal one by its three bands, a triangular
one by its half, any other by every entry. The entries come from the matrix by indexing,
so JVPs and `vmap` through the constructor, which Lineax's tests take, reach them. An
operator that cannot hold the matrix, a block-diagonal or banded operator of a matrix
that is not square (Lineax's `test_structures_vector` and its singular systems, which
trim a row or a column), is not built: those cases are deselected (`_UNSQUARE`).

Lineax's tests are not in the PyPI sdist of lineax either, and come from its git
repository, the first of: `LINEAX_TESTS=/path/to/tests` (Lineax 0.1.1's `tests/` files),
`LINEAX_GIT=/path/to/lineax` (a clone or bare git directory with the tag `v0.1.1`), or a
`git clone --depth 1 --branch v0.1.1` from GitHub into `.lineax-tests/`. Every file used
is checked against its git blob hash at `v0.1.1` (`outside_suite.py`). The result is
recorded in `docs/devdocs/lineax_tests.md`.
"""

import sys


TAG = "v0.1.1"
REPO = "https://github.com/patrick-kidger/lineax"

# `git rev-parse v0.1.1:tests/<file>` in Lineax's repository.
BLOBS = {
    "__init__.py": "7ba50f9339ddd13a9168c8e3eb29006160dc651d",
    "conftest.py": "9fbeedda22121d1e2dd83dfd304bc72e65138f14",
    "helpers.py": "5b3dac0922e49b1dd9c16d014cc1cac43edc553e",
    "test_operator.py": "cced2f84e38b45ae98ca145465e3259d49701389",
    "test_adjoint.py": "5c0ff2ffa41c69c9d1e03045e2a80eb55fc3f3a7",
    "test_well_posed.py": "4686ce862d2f2329a808d2d4d17f24ae5e0dc944",
    "test_singular.py": "04c18ec419522115b90d33cfbfab1e72ac20e314",
    "test_transpose.py": "51b5821a8338acb840ebe43b416964a15d18df03",
    "test_jvp.py": "592e53096cf60f89e2afb7fe3169756c2863c1b9",
    "test_vmap.py": "7a4d5e479c21d910323bf40cdd13f6dd8ee16bbd",
    "test_jvp_jvp1.py": "6014af6dcdad7541fae7757c676cc3945ff3e05c",
    "test_jvp_jvp2.py": "8781c2c325c0e85e2b16635484ea2f5ab8142996",
    "test_vmap_jvp.py": "ec280974cfd30697245dd9ec93abadd237d22ca4",
    "test_vmap_vmap.py": "8e2b98d6eeb38a1b4389100e9e9498b3f4636892",
}
# Lineax's tests that loop over every operator of `make_operators` inside one test.
WHOLE = ("tests/test_operator.py::",)

# ---- our operators, built from a test's matrix


def _pattern(tags, shape):
    """The (row, column) pairs a matrix with these lineax tags can hold, as NumPy arrays
    in row-major order."""
    import lineax as lx
    import numpy as np

    m, n = shape
    rows, cols = np.nonzero(np.ones((m, n), bool))
    tags = tags if isinstance(tags, tuple) else (tags,)
    if lx.diagonal_tag in tags:
        keep = rows == cols
    elif lx.tridiagonal_tag in tags:
        keep = np.abs(rows - cols) <= 1
    elif lx.lower_triangular_tag in tags:
        keep = cols <= rows
    elif lx.upper_triangular_tag in tags:
        keep = cols >= rows
    else:
        keep = np.ones(rows.shape, bool)
    return rows[keep], cols[keep]


def _tagged(operator, tags):
    import lineax as lx

    # Untagged, ours reach the solver as they are (a `TaggedLinearOperator` would be
    # solved as any other operator); tagged, lineax's tag-driven solvers can use them.
    return operator if tags == () else lx.TaggedLinearOperator(operator, tags)


def _square(matrix, what):
    if matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"a {what} operator is square; got a {matrix.shape} matrix")


def make_block_diagonal_operator(getkey, matrix, tags):
    import diffrax_linearize as dl
    import jax.numpy as jnp
    import lineax as lx

    del getkey
    _square(matrix, "block-diagonal")
    n = matrix.shape[0]
    tag_set = tags if isinstance(tags, tuple) else (tags,)
    if lx.diagonal_tag in tag_set:  # n blocks of one entry
        blocks = jnp.diagonal(matrix)[:, None, None]
    else:  # one block
        blocks = matrix[None]
    assert blocks.shape[0] * blocks.shape[1] == n
    return _tagged(dl.BlockDiagonalLinearOperator(blocks), tags)


def make_banded_operator(getkey, matrix, tags):
    import diffrax_linearize as dl
    import jax.numpy as jnp
    import numpy as np

    del getkey
    _square(matrix, "banded")
    n = matrix.shape[0]
    rows, cols = _pattern(tags, matrix.shape)
    offsets = sorted(set((cols - rows).tolist()))
    r = np.arange(n)
    diagonals = []
    for d in offsets:
        inside = (r + d >= 0) & (r + d < n)
        entries = matrix[r, np.clip(r + d, 0, n - 1)]
        diagonals.append(jnp.where(inside, entries, jnp.zeros((), matrix.dtype)))
    return _tagged(dl.BandedLinearOperator(jnp.stack(diagonals), offsets), tags)


def make_sparse_operator(getkey, matrix, tags):
    import diffrax_linearize as dl
    import jax
    import jax.numpy as jnp
    import numpy as np

    del getkey
    m, n = matrix.shape
    rows, cols = _pattern(tags, matrix.shape)
    width = int(np.bincount(rows, minlength=m).max())
    # ELLPACK: row r's entries in slots 0, 1, ...; a short row's spare slots hold zero
    # (column 0).
    slot = np.arange(len(rows)) - np.searchsorted(rows, rows)
    columns = np.zeros((width, m), np.int64)
    columns[slot, rows] = cols
    values = jnp.zeros((m, width), matrix.dtype).at[rows, slot].set(matrix[rows, cols])
    struct = jax.ShapeDtypeStruct((n,), matrix.dtype)
    return _tagged(dl.SparseLinearOperator(values, columns, struct), tags)


def make_csr_operator(getkey, matrix, tags):
    import diffrax_linearize as dl
    import jax
    import numpy as np

    del getkey
    m, n = matrix.shape
    rows, cols = _pattern(tags, matrix.shape)
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=m))])
    struct = jax.ShapeDtypeStruct((n,), matrix.dtype)
    operator = dl.CSRLinearOperator(matrix[rows, cols], cols, indptr, struct)
    return _tagged(operator, tags)


MAKERS = (
    make_block_diagonal_operator,
    make_banded_operator,
    make_sparse_operator,
    make_csr_operator,
)
# Square only, by their definition.
_UNSQUARE = (make_block_diagonal_operator, make_banded_operator)
# The tests that build each operator of theirs from a matrix that is not square (3 x 5),
# or may be (singular systems with a row or a column trimmed).
_UNSQUARE_TESTS = ("test_structures_vector", "test_adjoint", "test_small_singular")
# Lineax's tests that fail with ours added, why, and the exception they must fail with
# (`outside_suite.select` marks them `xfail(strict=True, raises=...)`).
KNOWN_FAILURES = {
    f"tests/test_operator.py::test_materialise_large[{dtype}]": (
        "builds every operator of `make_operators` from one 200 x 500 matrix; a "
        "block-diagonal or banded operator is square by definition, and its maker raises",
        ValueError,
    )
    for dtype in ("float64", "complex128")
}


def _solvers():
    """Ours as `(solver, tags, pseudoinverse)` rows of Lineax's solver list: untagged, and
    with the two tags that it solves with lineax's own structured solvers."""
    import diffrax_linearize as dl
    import lineax as lx

    rows = []
    for solver in (dl.StructuredLinearSolver(), dl.StructuredLinearSolver(dense_below=0)):
        for tags in ((), lx.diagonal_tag, lx.tridiagonal_tag):
            rows.append((solver, tags, False))
    return rows


# ---- the pytest plugin


def pytest_configure(config):
    # Lineax's test modules import these lists from `tests.helpers` at collection: ours
    # are appended to the same list objects before that. Its conftest first: `helpers`
    # reads the x64 setting that the conftest makes when it is imported.
    from tests import conftest, helpers

    del conftest

    for maker in MAKERS:
        helpers.make_operators.append(maker)
    for solver, tags, pseudo in _solvers():
        helpers.solvers_tags_pseudoinverse.append((solver, tags, pseudo))
        helpers.solvers_tags.append((solver, tags))
        helpers.solvers.append(solver)
        if pseudo:
            helpers.pseudosolvers_tags.append((solver, tags))


def _is_ours(value) -> bool:
    import diffrax_linearize as dl

    return value in MAKERS or isinstance(value, dl.StructuredLinearSolver)


def pytest_collection_modifyitems(config, items):
    from outside_suite import select

    def keep(item):
        params = getattr(getattr(item, "callspec", None), "params", {})
        ours = any(_is_ours(v) for v in params.values())
        unsquare = params.get("make_operator") in _UNSQUARE and any(
            f"::{name}[" in item.nodeid for name in _UNSQUARE_TESTS
        )
        return (ours or item.nodeid.startswith(WHOLE)) and not unsquare

    select(config, items, keep, KNOWN_FAILURES)


def pytest_report_header(config):
    names = ", ".join(m.__name__ for m in MAKERS)
    return (
        f"Lineax {TAG}'s tests with diffrax_linearize's operators ({names}) and "
        "StructuredLinearSolver (default and dense_below=0) added"
    )


# ---- the driver


def main(argv: list[str]) -> int:
    from outside_suite import run

    return run("lineax_suite", "lineax", REPO, TAG, BLOBS, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
