"""Row-compressed (CSR) storage for patterns with uneven rows (issue 24 item 2): a
scale-free graph, a random graph and a mass-action network, whose ELLPACK storage would
hold more than twice their nonzeros. Each operator is compared with `jax.jacfwd` and its
dense matrix; storage is counted in the operator's array leaves; solves are compared with
dense ones."""

import diffrax_linearize as dl
import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import optimistix as optx
import pytest
from helpers import assert_jacobian_equal


# ---- the fields ---------------------------------------------------------------------------


def _preferential_attachment(n, m=2, seed=0):
    """The edges of a Barabási-Albert graph: each new node joins `m` existing ones, chosen
    in proportion to their degree, so a few early nodes become hubs."""
    rng = np.random.default_rng(seed)
    edges = [(i, j) for i in range(m + 1) for j in range(i)]
    ends = [v for e in edges for v in e]
    for new in range(m + 1, n):
        chosen = set()
        while len(chosen) < m:
            chosen.add(ends[rng.integers(len(ends))])
        for t in sorted(chosen):
            edges.append((new, t))
            ends += [new, t]
    return np.array(edges)


def _random_graph(n, mean_degree=3, seed=0):
    rng = np.random.default_rng(seed)
    edges = rng.integers(0, n, (n * mean_degree // 2, 2))
    return edges[edges[:, 0] != edges[:, 1]]


def _graph_field(edges, n):
    src, dst = edges[:, 0], edges[:, 1]

    def field(x):
        flow = x[src] - x[dst]
        out = jax.ops.segment_sum(-flow, src, num_segments=n)
        return out + jax.ops.segment_sum(flow, dst, num_segments=n) - x**3

    return field


def _mass_action_field(n, n_reactions, seed=0):
    """`A + B -> P` with rate `k c_A c_B`, written with `.at[].add`; in a third of the
    reactions `B` is one of four cofactors (as ATP, NADH), which so take part in most."""
    rng = np.random.default_rng(seed)
    A = rng.integers(0, n, n_reactions)
    B = np.where(rng.random(n_reactions) < 0.3, rng.integers(0, 4, n_reactions), A[::-1])
    P = rng.integers(0, n, n_reactions)
    k = rng.uniform(0.5, 2.0, n_reactions)

    def field(c):
        rate = k.astype(c.dtype) * c[A] * c[B]
        return jnp.zeros_like(c).at[A].add(-rate).at[B].add(-rate).at[P].add(rate) - 0.1 * c

    return field


_N = 60
FIELDS = {
    "scale_free": _graph_field(_preferential_attachment(_N), _N),
    "random_graph": _graph_field(_random_graph(_N, seed=2), _N),
    "mass_action": _mass_action_field(_N, 2 * _N),
}


def _state(n, dtype=jnp.float64, seed=0):
    return jnp.asarray(np.random.default_rng(seed).uniform(0.5, 1.5, n), dtype)


def _stored(op) -> int:
    return sum(x.size for x in jax.tree_util.tree_leaves(eqx.filter(op, eqx.is_array)))


# ---- storage ------------------------------------------------------------------------------


def _slow(*names):
    return [pytest.param(n, marks=pytest.mark.slow) if n in names else n for n in FIELDS]


@pytest.mark.parametrize("name", list(FIELDS))
def test_uneven_rows_are_stored_compressed(name):
    fn = FIELDS[name]
    y = _state(_N)
    J = np.asarray(jax.jit(jax.jacfwd(fn))(y))
    nnz = np.count_nonzero(J)
    # The field is one this test is about: ELLPACK, as wide as the longest row, would
    # hold more than twice the nonzeros.
    assert _N * np.count_nonzero(J, axis=1).max() > 2 * nnz
    op = dl.materialise_operator(fn, y)
    assert isinstance(op, dl.CSRLinearOperator), type(op)
    assert _stored(op) == op.nnz <= 2 * nnz
    assert_jacobian_equal(op.as_matrix(), J)
    # The same numbers as `materialise`'s array, bit for bit: one engine.
    np.testing.assert_array_equal(op.as_matrix(), dl.materialise(fn, y))
    (kind,) = dl.structure_report(fn, y).kinds
    assert kind.startswith("sparse (CSR), "), kind
    assert f": {_stored(op):,} numbers stored, dense {J.size:,}" in kind, kind
    _check_products(op, J, rtol=1e-12)


def _star(n):
    """A hub joined to every other node."""
    return np.array([(0, i) for i in range(1, n)])


def _hubs_and_random(n, n_hubs=3, seed=0):
    """A few hubs, each joined to a random two thirds of the nodes (rows wider than half
    the graph), over a random graph."""
    rng = np.random.default_rng(seed)
    spokes = [(h, int(i)) for h in range(n_hubs) for i in rng.choice(n, 2 * n // 3, replace=False)]
    spokes = np.array([e for e in spokes if e[0] != e[1]])
    return np.concatenate([spokes, _random_graph(n, seed=seed + 1)])


def _check_compressed(fn, y):
    """`fn`'s operator is CSR holding each nonzero once, equal to `jax.jacfwd`'s matrix,
    and `structure_report` says so."""
    J = np.asarray(jax.jit(jax.jacfwd(fn))(y))
    nnz = np.count_nonzero(J)
    op = dl.materialise_operator(fn, y)
    assert isinstance(op, dl.CSRLinearOperator), type(op)
    assert _stored(op) == op.nnz == nnz
    assert_jacobian_equal(op.as_matrix(), J)
    (kind,) = dl.structure_report(fn, y).kinds
    lengths = np.count_nonzero(J, axis=1)
    assert kind == (
        f"sparse (CSR), {lengths.min()} to {lengths.max()} entries per row: "
        f"{nnz:,} numbers stored, dense {J.size:,}"
    ), kind
    return op, J


def test_star_graph_is_stored_compressed():
    # The hub's row holds every node: as wide as the graph, but its other rows hold two
    # entries. The engine keeps it row-compressed (it is not mostly live), and the
    # operator stores the nonzeros only.
    n = 40
    fn = _graph_field(_star(n), n)
    y = _state(n)
    op, J = _check_compressed(fn, y)
    assert op.nnz == 3 * n - 2
    np.testing.assert_array_equal(op.as_matrix(), dl.materialise(fn, y))
    _check_products(op, J, rtol=1e-12)


@pytest.mark.parametrize(
    "edges, n",
    [
        pytest.param(_star(2000), 2000, id="star_2000", marks=pytest.mark.slow),
        pytest.param(_hubs_and_random(300), 300, id="hubs_and_random_300"),
    ],
)
def test_hub_graphs_are_stored_compressed(edges, n):
    fn = _graph_field(edges, n)
    op, J = _check_compressed(fn, _state(n))
    # The field is one this test is about: a dense block would hold more than 4x the
    # nonzeros (what the engine's dense rule would have built).
    assert J.size > 4 * op.nnz
    _check_products(op, J, rtol=1e-12)


# ---- a known transport term plus a traced reaction ------------------------------------------


def _largest_value(fn, y) -> int:
    """The most elements of any value computed by the program of `materialise_operator`
    (its constants, known when it is traced, not counted)."""
    from diffrax_linearize._interpreter import iter_eqns

    jaxpr = jax.make_jaxpr(lambda y: dl.materialise_operator(fn, y))(y).jaxpr
    return max(int(np.prod(v.aval.shape)) for eqn in iter_eqns(jaxpr) for v in eqn.outvars)


@pytest.mark.parametrize("hub", [False, True], ids=["scale_free", "star"])
def test_known_laplacian_plus_traced_reaction_is_assembled_from_its_parts(hub):
    # The graph Laplacian's block is known when traced (its values are +-1), its rows as
    # wide as the hub's; `- x**3` adds a traced diagonal. The operator stores the known
    # part as a constant and computes the diagonal's entries only: no value of the
    # program is as large as the engine's `rows x widest row` slots (n^2 for the star).
    n = 400
    edges = _star(n) if hub else _preferential_attachment(n)
    fn = _graph_field(edges, n)
    y = _state(n)
    J = np.asarray(jax.jit(jax.jacfwd(fn))(y))
    widest = np.count_nonzero(J, axis=1).max()
    op = dl.materialise_operator(fn, y)
    assert isinstance(op, dl.CSRLinearOperator), type(op)
    assert _stored(op) == op.nnz == np.count_nonzero(J)
    assert_jacobian_equal(op.as_matrix(), J)
    # Summed as `jax.jacfwd` sums them (the Laplacian's entries, then the reaction), and
    # `materialise` sums them so too.
    np.testing.assert_array_equal(op.as_matrix(), J)
    np.testing.assert_array_equal(dl.materialise(fn, y), J)
    assert _largest_value(fn, y) <= 2 * op.nnz < n * widest
    _check_products(op, J, rtol=1e-12)


def _species_stencil(y):
    """Two species on a Dirichlet grid, species last (as Gray-Scott): a Laplacian with
    constant coefficients plus a traced reaction, stacked and flattened."""
    y = y.reshape(8, 8, 2)
    u, v = y[..., 0], y[..., 1]

    def lap(w):
        p = jnp.pad(w, 1)
        return 81.0 * (p[2:, 1:-1] + p[:-2, 1:-1] + p[1:-1, 2:] + p[1:-1, :-2] - 4 * w)

    du = 2e-3 * lap(u) - u * v**2 + 0.04 * (1 - u)
    dv = 1e-3 * lap(v) + u * v**2 - 0.1 * v
    return jnp.stack([du, dv], axis=-1).reshape(-1)


@pytest.mark.parametrize(
    "fn, size, operator",
    [
        (_species_stencil, 128, dl.BandedLinearOperator),
        (
            lambda u: jnp.gradient(u) * u + jnp.gradient(jnp.gradient(u)),
            50,
            dl.BandedLinearOperator,
        ),
        (_graph_field(_random_graph(60, seed=2), 60), 60, dl.CSRLinearOperator),
    ],
    ids=["species_stencil", "gradient", "random_graph"],
)
def test_sum_of_known_and_traced_parts(fn, size, operator):
    # The engine follows the known part (stencil coefficients, scaled by literals) and
    # the traced part (the reaction) of the field's final sums through `jnp.stack` and
    # `reshape`; the operator is assembled from the two, equal to `jax.jacfwd`'s matrix
    # and to `materialise`'s array bit for bit.
    from diffrax_linearize import _materialise
    from diffrax_linearize._interpreter import split_of
    from diffrax_linearize._structure import is_known

    y = _state(size)
    J = np.asarray(jax.jit(jax.jacfwd(fn))(y))
    op = dl.materialise_operator(fn, y)
    assert isinstance(op, operator), type(op)
    assert_jacobian_equal(op.as_matrix(), J)
    np.testing.assert_array_equal(op.as_matrix(), dl.materialise(fn, y))
    v = jnp.asarray(np.random.default_rng(1).standard_normal(size))
    np.testing.assert_allclose(op.mv(v), J @ np.asarray(v), rtol=1e-12, atol=1e-12)

    def parts(y):
        closed = jax.make_jaxpr(fn)(y)
        dynamic, static = _materialise._split_consts(closed.consts)
        spec = _materialise._Spec(
            closed.jaxpr, 1, "forward", False, structured=True, static_consts=static
        )
        blocks, ctx, _ = _materialise._structured_jacobian(spec, dynamic, [y], [])
        found = split_of(ctx, blocks[0][0])
        assert found is not None
        known, traced = found
        assert is_known(known.val) and not is_known(traced.val)
        return 0.0

    jax.jit(parts)(y)


def _laplacian_1d(u):
    p = jnp.pad(u, 1)
    return p[2:] - 2 * u + p[:-2] - u**3


def _periodic_2d(y):
    u = y.reshape(8, 8)
    lap = jnp.roll(u, 1, 0) + jnp.roll(u, -1, 0) + jnp.roll(u, 1, 1) + jnp.roll(u, -1, 1)
    return (lap - 4 * u + jnp.sin(u)).reshape(-1)


def _dirichlet_2d(y):
    u = y.reshape(8, 8)
    p = jnp.pad(u, 1)
    lap = p[2:, 1:-1] + p[:-2, 1:-1] + p[1:-1, 2:] + p[1:-1, :-2] - 4 * u
    return (lap - u**3).reshape(-1)


def _blocks(y):
    y = y.reshape(-1, 3)
    return jnp.stack([y[:, 0] * y[:, 1], y[:, 1] - y[:, 2] ** 2, y[:, 0] + y[:, 2]], 1).reshape(-1)


@pytest.mark.parametrize(
    "fn, kind",
    [
        (_laplacian_1d, lx.TridiagonalLinearOperator),
        (_periodic_2d, dl.SparseLinearOperator),
        (_dirichlet_2d, dl.BandedLinearOperator),
        (_blocks, dl.BlockDiagonalLinearOperator),
    ],
    ids=["laplacian_1d", "periodic_2d", "dirichlet_2d", "blocks"],
)
def test_regular_patterns_keep_their_storage(fn, kind):
    y = _state(63 if fn is _blocks else 64)
    op = dl.materialise_operator(fn, y)
    assert isinstance(op, kind), type(op)
    J = np.asarray(jax.jacfwd(fn)(y))
    assert_jacobian_equal(op.as_matrix(), J)
    assert _stored(op) <= 2 * np.count_nonzero(J)
    (report,) = dl.structure_report(fn, y).kinds
    assert f": {_stored(op):,} numbers stored" in report, report


# ---- the operator ---------------------------------------------------------------------------


@jax.jit
def _products(op, v, u):
    return op.mv(v), op.T.mv(u), op.as_matrix(), op.T.as_matrix(), lx.tridiagonal(op)


def _check_products(op, J, rtol):
    rng = np.random.default_rng(1)
    v = jnp.asarray(rng.standard_normal(J.shape[1]), op.values.dtype)
    u = jnp.asarray(rng.standard_normal(J.shape[0]), op.values.dtype)
    mv, tmv, A, AT, (d, lower, upper) = _products(op, v, u)
    np.testing.assert_allclose(mv, J @ np.asarray(v), rtol=rtol, atol=rtol)
    np.testing.assert_allclose(tmv, J.T @ np.asarray(u), rtol=rtol, atol=rtol)
    np.testing.assert_array_equal(AT, np.asarray(A).T)
    # The diagonals are read off the stored entries: `as_matrix`'s, bit for bit.
    np.testing.assert_array_equal(lx.diagonal(op), np.diag(A))
    np.testing.assert_array_equal(d, np.diag(A))
    np.testing.assert_array_equal(lower, np.diag(A, -1))
    np.testing.assert_array_equal(upper, np.diag(A, 1))
    np.testing.assert_allclose(d, np.diag(J), rtol=rtol)


@pytest.mark.parametrize("name", _slow("random_graph", "mass_action"))
def test_float32(name):
    fn = FIELDS[name]
    y = _state(_N, jnp.float32)
    op = dl.materialise_operator(fn, y)
    assert isinstance(op, dl.CSRLinearOperator) and op.values.dtype == jnp.float32
    J = np.asarray(jax.jit(jax.jacfwd(fn))(y))
    assert_jacobian_equal(op.as_matrix(), J)
    _check_products(op, J, rtol=1e-4)


def test_jit_and_vmap():
    fn = FIELDS["scale_free"]
    ys = jnp.stack([_state(_N, seed=s) for s in range(3)])
    v = jnp.asarray(np.random.default_rng(2).standard_normal(_N))
    mv = lambda y, v: dl.materialise_operator(fn, y).mv(v)
    tmv = lambda y, v: dl.materialise_operator(fn, y).T.mv(v)
    Js = np.asarray(jax.vmap(jax.jacfwd(fn))(ys))
    np.testing.assert_allclose(jax.jit(mv)(ys[0], v), Js[0] @ v, rtol=1e-12)
    np.testing.assert_allclose(jax.vmap(mv, (0, None))(ys, v), Js @ v, rtol=1e-12)
    np.testing.assert_allclose(
        jax.jit(jax.vmap(tmv, (0, None)))(ys, v), np.einsum("bij,i->bj", Js, v), rtol=1e-12
    )
    # Batched vectors through one operator.
    op = dl.materialise_operator(fn, ys[0])
    vs = jnp.asarray(np.random.default_rng(3).standard_normal((4, _N)))
    np.testing.assert_allclose(jax.vmap(op.mv)(vs), vs @ Js[0].T, rtol=1e-12)


def _handmade():
    # Rows of 0, 3, 1 and 2 entries (unsorted within a row), on a (2, 3) input.
    indptr = np.array([0, 0, 3, 4, 6])
    indices = np.array([5, 0, 2, 1, 3, 4])
    values = jnp.arange(1.0, 7.0)
    op = dl.CSRLinearOperator(values, indices, indptr, jax.ShapeDtypeStruct((2, 3), jnp.float64))
    A = np.zeros((4, 6))
    A[[1, 1, 1, 2, 3, 3], indices] = np.arange(1.0, 7.0)
    return op, A


def test_handmade_operator():
    op, A = _handmade()
    np.testing.assert_array_equal(op.as_matrix(), A)
    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(op.mv(x), A @ np.arange(6.0))
    assert op.out_structure() == jax.ShapeDtypeStruct((4,), jnp.float64)
    assert op.T.in_structure() == op.out_structure()
    np.testing.assert_array_equal(op.T.mv(jnp.arange(4.0)), (A.T @ np.arange(4.0)).reshape(2, 3))
    np.testing.assert_array_equal(op.T.T.as_matrix(), A)
    np.testing.assert_array_equal(lx.conj(op).as_matrix(), A)
    assert lx.materialise(op) is op and lx.linearise(op) is op
    assert not lx.is_diagonal(op) and not lx.is_symmetric(op)
    # A pattern that is its own decides the structural queries.
    tri = dl.CSRLinearOperator(
        jnp.ones(5), np.array([0, 0, 1, 1, 2]), np.array([0, 1, 3, 5]),
        jax.ShapeDtypeStruct((3,), jnp.float64),
    )  # fmt: skip
    assert lx.is_lower_triangular(tri) and lx.is_tridiagonal(tri)
    assert not lx.is_upper_triangular(tri) and not lx.is_diagonal(tri)


def test_one_by_one_operators_are_diagonal():
    # As lineax reports for its own untagged operators of one entry (found by Lineax's
    # `test_is_diagonal_scalar`, `tests/lineax_suite.py`): an ELLPACK pattern decides
    # nothing else, its padding holding zeros in arbitrary columns.
    struct = jax.ShapeDtypeStruct((1,), jnp.float64)
    one = dl.SparseLinearOperator(jnp.array([[2.0]]), np.array([[0]]), struct)
    assert lx.is_diagonal(one) and lx.is_tridiagonal(one)
    assert lx.is_diagonal(lx.MatrixLinearOperator(jnp.array([[2.0]])))
    # Diagonal in its values, but a padded pattern says nothing: unknown (`False`).
    wide = dl.SparseLinearOperator(
        jnp.array([[2.0, 0.0], [3.0, 0.0]]), np.array([[0, 1], [0, 0]]),
        jax.ShapeDtypeStruct((2,), jnp.float64),
    )  # fmt: skip
    assert not lx.is_diagonal(wide) and not lx.is_tridiagonal(wide)
    csr = dl.CSRLinearOperator(jnp.array([2.0]), np.array([0]), np.array([0, 1]), struct)
    assert lx.is_diagonal(csr)


def test_operator_errors():
    struct = jax.ShapeDtypeStruct((3,), jnp.float64)
    with pytest.raises(ValueError, match="more than once"):
        dl.CSRLinearOperator(jnp.ones(2), np.array([1, 1]), np.array([0, 2, 2, 2]), struct)
    with pytest.raises(ValueError, match="indptr"):
        dl.CSRLinearOperator(jnp.ones(2), np.array([0, 1]), np.array([0, 2, 1, 2]), struct)
    with pytest.raises(ValueError, match="indices"):
        dl.CSRLinearOperator(jnp.ones(2), np.array([0, 3]), np.array([0, 1, 2, 2]), struct)
    with pytest.raises(TypeError, match="integer NumPy"):
        dl.CSRLinearOperator(jnp.ones(1), np.array([0.5]), np.array([0, 1, 1, 1]), struct)
    empty = dl.CSRLinearOperator(jnp.ones(0), np.zeros(0, int), np.zeros(4, int), struct)
    with pytest.raises(ValueError, match="no entries"):
        lx.linear_solve(empty, jnp.ones(3), dl.StructuredLinearSolver())


# ---- solves ---------------------------------------------------------------------------------


# The scale-free graph's hubs and the network's cofactors keep the reordered band wide:
# GMRES. The random graph at this size reorders to a narrow band: factored. A
# preconditioner passed in `options` takes the GMRES path whatever the pattern.
_PATHS = {"scale_free": "_Krylov", "random_graph": "_Permuted", "mass_action": "_Krylov"}


@pytest.mark.parametrize(
    "name, options, transposed",
    [
        ("scale_free", "default", False),
        ("random_graph", "default", False),
        pytest.param("scale_free", "default", True, marks=pytest.mark.slow),
        pytest.param("random_graph", "default", True, marks=pytest.mark.slow),
        pytest.param("mass_action", "default", True, marks=pytest.mark.slow),
        pytest.param("random_graph", "preconditioner", True, marks=pytest.mark.slow),
    ],
)
def test_linear_solve_against_dense(name, options, transposed):
    fn = FIELDS[name]
    y = _state(_N)
    step = lambda y: y - 0.5 * fn(y)  # I - h J, stiff for the hubs
    op = dl.materialise_operator(step, y)
    assert isinstance(op, dl.CSRLinearOperator)
    b = jnp.cos(y)
    dense = np.asarray(jax.jit(jax.jacfwd(step))(y))
    expected = np.linalg.solve(dense, np.asarray(b))
    # Below `dense_below` unknowns the default is a dense LU; the sparse paths are taken
    # with `dense_below=0`, and both must agree with the dense solve.
    default_state = dl.StructuredLinearSolver().init(op, {})
    assert _N < dl.StructuredLinearSolver().dense_below
    assert type(default_state).__name__ == "_Delegate"
    np.testing.assert_allclose(
        lx.linear_solve(op, b, dl.StructuredLinearSolver()).value, expected, rtol=1e-8, atol=1e-9
    )
    solver = dl.StructuredLinearSolver(dense_below=0)
    if options == "default":
        options, path = {}, _PATHS[name]
    else:
        options, path = {"preconditioner": lx.IdentityLinearOperator(op.in_structure())}, "_Krylov"
    assert type(solver.init(op, options)).__name__ == path
    x = lx.linear_solve(op, b, solver, options=options).value
    np.testing.assert_allclose(x, expected, rtol=1e-8, atol=1e-9)
    if transposed:  # through lineax's transpose of the solver state
        t_state, _ = solver.transpose(solver.init(op, options), options)
        xt, _, _ = solver.compute(t_state, b, options)
        expected_t = np.linalg.solve(dense.T, np.asarray(b))
        np.testing.assert_allclose(xt, expected_t, rtol=1e-8, atol=1e-9)


def test_gradient_through_products():
    fn = FIELDS["scale_free"]
    y = _state(_N)
    v = jnp.asarray(np.random.default_rng(4).standard_normal(_N))
    loss = lambda y: jnp.sum(dl.materialise_operator(fn, y).T.mv(v) ** 2)
    reference = lambda y: jnp.sum((v @ jax.jacfwd(fn)(y)) ** 2)
    np.testing.assert_allclose(jax.grad(loss)(y), jax.grad(reference)(y), rtol=1e-11)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FIELDS))
def test_gradient_through_solve(name):
    fn = FIELDS[name]
    y = _state(_N)

    def solve(y):
        op = dl.materialise_operator(lambda z: z - 0.5 * fn(z), y)
        return lx.linear_solve(op, jnp.cos(y), dl.StructuredLinearSolver()).value

    def dense(y):
        return jnp.linalg.solve(jax.jacfwd(lambda z: z - 0.5 * fn(z))(y), jnp.cos(y))

    np.testing.assert_allclose(jax.jit(solve)(y), dense(y), rtol=1e-9)
    g = jax.grad(lambda y: jnp.sum(solve(y) ** 2))(y)
    g_ref = jax.grad(lambda y: jnp.sum(dense(y) ** 2))(y)
    np.testing.assert_allclose(g, g_ref, rtol=1e-7)


@pytest.mark.parametrize(
    "name, root_finder",
    [
        ("scale_free", dl.VeryChord),
        pytest.param("scale_free", dl.Newton, marks=pytest.mark.slow),
        pytest.param("mass_action", dl.VeryChord, marks=pytest.mark.slow),
        pytest.param("mass_action", dl.Newton, marks=pytest.mark.slow),
    ],
)
def test_implicit_step_root_find(name, root_finder):
    """One implicit Euler step of size 1 (stiff: the hubs' rates are tens), solved with the
    CSR Jacobian, against optimistix's Newton on the dense one."""
    fn = FIELDS[name]
    y0 = _state(_N)
    residual = lambda y, y0: y - 1.0 * fn(y) - y0
    tols = dict(rtol=1e-10, atol=1e-10, norm=optx.max_norm)
    ours = optx.root_find(residual, root_finder(**tols), y0, y0, max_steps=64)
    reference = optx.root_find(residual, optx.Newton(**tols), y0, y0, max_steps=64)
    np.testing.assert_allclose(ours.value, reference.value, rtol=1e-8, atol=1e-9)
    np.testing.assert_allclose(residual(ours.value, y0), 0.0, atol=1e-8)


@pytest.mark.slow
def test_stiff_solve_with_kvaerno5():
    """An adaptive stiff solve of the mass-action network, with our `VeryChord` solving
    with the CSR `I - h γ J` (GMRES, as the cofactors keep its band wide)."""
    import diffrax

    fn = FIELDS["mass_action"]
    term = diffrax.ODETerm(lambda t, y, args: fn(y))

    def solve(root_finder, rtol=1e-8, atol=1e-10):
        return diffrax.diffeqsolve(
            term,
            diffrax.Kvaerno5(root_finder=root_finder),
            0.0,
            5.0,
            None,
            _state(_N),
            saveat=diffrax.SaveAt(ts=jnp.linspace(0.0, 5.0, 4)),
            stepsize_controller=diffrax.PIDController(rtol=rtol, atol=atol),
            max_steps=100_000,
        )

    ours = solve(dl.VeryChord())
    # The same root finder on the dense matrix (lineax's LU of `as_matrix()`): the same
    # steps, so the same solution to rounding.
    with_lu = solve(dl.VeryChord(linear_solver=lx.LU()))
    np.testing.assert_allclose(ours.ys, with_lu.ys, rtol=1e-9, atol=1e-12)
    assert ours.stats["num_steps"] == with_lu.stats["num_steps"]
    # Against a tight solve with Diffrax's own (dense) root finder: the global error in the
    # mixed scale `atol / rtol + |y|`, about 100 times the local 1e-8 (1.4e-6 measured).
    reference = solve(diffrax.with_stepsize_controller_tols(diffrax.VeryChord)(), 1e-12, 1e-14)
    error = np.max(np.abs(ours.ys - reference.ys) / (1e-2 + np.abs(reference.ys)))
    assert error < 1e-5, error
