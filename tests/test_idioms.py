"""A corpus of vector fields written the way new users write them (issue 24): each
Jacobian is exact against `jax.jacfwd`, is not stored dense, and (where the current
storages fit) holds at most twice its nonzeros. Sizes are small: the structure does not
depend on them."""

import diffrax_linearize as dl
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from benchmarks import structure
from diffrax_linearize import _loops
from helpers import jacfwd_compiled


# ---- the fields ---------------------------------------------------------------------------


def _neumann_laplacian(p, axis):
    n = p.shape[axis] - 2
    lo = jax.lax.slice_in_dim(p, 0, n, axis=axis)
    mid = jax.lax.slice_in_dim(p, 1, n + 1, axis=axis)
    hi = jax.lax.slice_in_dim(p, 2, n + 2, axis=axis)
    return lo - 2 * mid + hi


def reaction_diffusion_species_first(y):
    # Two species on a 1D grid, shape (species, n), zero-flux (edge-padded) boundary.
    u, v = y[0], y[1]
    p = jnp.pad(y, ((0, 0), (1, 1)), mode="edge")
    lap = _neumann_laplacian(p, 1)
    react = jnp.stack([1 - u * v**2, u * v**2 - 0.5 * v])
    return jnp.array([[0.1], [0.05]]) * lap + react


def reaction_diffusion_species_last(y):
    # The same model in the (n, species) layout.
    u, v = y[:, 0], y[:, 1]
    p = jnp.pad(y, ((1, 1), (0, 0)), mode="edge")
    lap = _neumann_laplacian(p, 0)
    react = jnp.stack([1 - u * v**2, u * v**2 - 0.5 * v], axis=1)
    return jnp.array([0.1, 0.05]) * lap + react


def reflect_padded(y):
    p = jnp.pad(y, ((0, 0), (1, 1)), mode="reflect")
    return _neumann_laplacian(p, 1) - y**3


def symmetric_padded(y):
    p = jnp.pad(y, ((1, 1), (0, 0)), mode="symmetric")
    return _neumann_laplacian(p, 0) + jnp.sin(y)


# A ring of 16 nodes with three chords.
_EDGES = np.array([[i, (i + 1) % 16] for i in range(16)] + [[0, 8], [3, 11], [5, 13]])


def graph_laplacian(x):
    src, dst = _EDGES[:, 0], _EDGES[:, 1]
    flow = x[src] - x[dst]
    out = jax.ops.segment_sum(-flow, src, num_segments=16)
    return out + jax.ops.segment_sum(flow, dst, num_segments=16) - x**3


# A chain of 16 species: S_i + S_{i+1} -> S_{i+2}, and S_{i+2} -> S_i: mass action with
# `.at[].add`.
_REACTIONS = [((i, i + 1), (i + 2,), 1.0 + 0.1 * i) for i in range(14)] + [
    ((i + 2,), (i,), 0.5) for i in range(14)
]


def mass_action(c):
    out = jnp.zeros_like(c)
    for reactants, products, k in _REACTIONS:
        rate = k * jnp.prod(c[np.array(reactants)])
        out = out.at[np.array(reactants)].add(-rate)
        out = out.at[np.array(products)].add(rate)
    return out


def stencil_3d(u):
    # The structure benchmark's field (it takes the cube flat).
    return structure.stencil_3d(u.reshape(-1)).reshape(u.shape)


def gradient_field(u):
    return jnp.gradient(u) * u + jnp.gradient(jnp.gradient(u))


def cell_loop(y):
    def body(i, out):
        return out.at[i].set(y[i] ** 2 - y[i - 1])

    return jax.lax.fori_loop(1, y.shape[0], body, jnp.zeros_like(y))


def cumsum_coupling(y):
    return jnp.cumsum(y) * y


_PERM = np.array([1, 3, 0, 2, 5, 4, 7, 6])


@jax.jit
def _take_inner(y):
    return jnp.take(y, _PERM) * y


def take_in_nested_jit(y):
    return jax.jit(_take_inner)(y) + y


def _state(shape):
    return jnp.asarray(np.random.default_rng(0).uniform(0.5, 1.5, shape))


_CASES = {
    "reaction_diffusion_species_first": (reaction_diffusion_species_first, (2, 7)),
    "reaction_diffusion_species_last": (reaction_diffusion_species_last, (7, 2)),
    "reflect_padded": (reflect_padded, (2, 7)),
    "symmetric_padded": (symmetric_padded, (7, 2)),
    "graph_laplacian": (graph_laplacian, (16,)),
    "mass_action": (mass_action, (16,)),
    "stencil_3d": (stencil_3d, (4, 4, 4)),
    "gradient_field": (gradient_field, (24,)),
    "cell_loop": (cell_loop, (8,)),
    "cumsum_coupling": (cumsum_coupling, (8,)),
    "take_in_nested_jit": (take_in_nested_jit, (8,)),
}


def _stored(op) -> int:
    return sum(x.size for x in jax.tree_util.tree_leaves(eqx.filter(op, eqx.is_array)))


@pytest.mark.slow  # the default run checks each field once, in test_not_dense
@pytest.mark.parametrize("name", list(_CASES))
def test_exact(name):
    fn, shape = _CASES[name]
    y = _state(shape)
    np.testing.assert_allclose(
        np.asarray(dl.materialise(fn, y)), np.asarray(jax.jacfwd(fn)(y)), rtol=1e-12, atol=1e-12
    )


# `cumsum` is triangular: stored dense it holds n^2 numbers, within 2x its n(n+1)/2
# nonzeros, and no current storage holds it in fewer; its loss is reported.
_SPARSE = [n for n in _CASES if n != "cumsum_coupling"]


def test_cumsum_reported():
    y = _state((8,))
    report = dl.structure_report(cumsum_coupling, y)
    assert "cumsum" in report.reasons and "triangular" in report.reasons["cumsum"][0]
    nnz = np.count_nonzero(np.asarray(jax.jacfwd(cumsum_coupling)(y)))
    assert _stored(dl.materialise_operator(cumsum_coupling, y)) <= 2 * nnz


@pytest.mark.slow  # the default run checks each field once, in test_not_dense
@pytest.mark.parametrize("name", _SPARSE)
def test_at_most_twice_nonzeros(name):
    # Each storage is taken only within twice the pattern's nonzeros, else CSR: reflect
    # padding's blocks of 7 x 7, each tridiagonal but for its corners, are stored banded.
    fn, shape = _CASES[name]
    y = _state(shape)
    nnz = np.count_nonzero(np.asarray(jax.jacfwd(fn)(y)))
    assert _stored(dl.materialise_operator(fn, y)) <= 2 * nnz


@pytest.mark.slow  # the default run checks each field once, in test_not_dense
@pytest.mark.parametrize("name", _SPARSE)
def test_report_matches_operator(name):
    # The report's kind and count come from the storage decision the operator is built by.
    fn, shape = _CASES[name]
    y = _state(shape)
    (kind,) = dl.structure_report(fn, y).kinds
    stored = _stored(dl.materialise_operator(fn, y))
    assert f": {stored:,} numbers stored" in kind


@pytest.mark.parametrize("name", _SPARSE)
def test_not_dense(name):
    fn, shape = _CASES[name]
    report = dl.structure_report(fn, _state(shape))
    assert not report.densified, str(report)
    assert not any(k.startswith("dense") for k in report.kinds), str(report)
    op = dl.materialise_operator(fn, _state(shape))
    dense = np.asarray(jacfwd_compiled(fn, _state(shape)))
    np.testing.assert_allclose(np.asarray(op.as_matrix()), dense.reshape(op.as_matrix().shape))
    assert _stored(op) < dense.size


# ---- loops over cells -----------------------------------------------------------------------


def _species_loop(y):
    # Two species on a line of cells, each cell's reaction and its neighbours' diffusion.
    n = y.shape[1]

    def body(i, out):
        left, right = y[:, jnp.maximum(i - 1, 0)], y[:, jnp.minimum(i + 1, n - 1)]
        u, v = y[0, i], y[1, i]
        rate = jnp.stack([-u * v**2, u * v**2 - v])
        return out.at[:, i].set(rate + left - 2 * y[:, i] + right)

    return jax.lax.fori_loop(0, n, body, jnp.zeros_like(y))


def _scan_over_cells(y):
    # `lax.scan` over the cell indices, stacking each cell's value; the running total it
    # also carries is not used (its row would be dense).
    def body(total, i):
        value = jnp.sin(y[i]) * y[(i + 1) % y.shape[0]]
        return total + value, value

    _, values = jax.lax.scan(body, 0.0, jnp.arange(y.shape[0]))
    return values


def _reversed_pytree_loop(y):
    # Two carried fields, filled from the last cell down.
    n = y["u"].shape[0]

    def body(k, carry):
        a, b = carry
        i = n - 1 - k
        return a.at[i].set(y["u"][i] * y["v"][i]), b.at[i].add(y["u"][i - 1] ** 3)

    a, b = jax.lax.fori_loop(0, n, body, (jnp.zeros(n), jnp.ones(n)))
    return {"a": a, "b": b}


_CELL_LOOPS = {
    "species": (_species_loop, lambda: _state((2, 9))),
    "scan_over_cells": (_scan_over_cells, lambda: _state((11,))),
    "reversed_pytree": (
        _reversed_pytree_loop,
        lambda: {"u": _state((10,)), "v": _state((10,)) + 1},
    ),
}


@pytest.mark.parametrize("name", list(_CELL_LOOPS))
def test_cell_loops(name):
    fn, state = _CELL_LOOPS[name]
    y = state()
    report = dl.structure_report(fn, y)
    assert not report.densified, str(report)
    assert not any(k.startswith("dense") for k in report.kinds), str(report)
    expected = jacfwd_compiled(fn, y)
    got = dl.materialise(fn, y)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(expected)
    for g, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_cell_loop_transforms():
    y = _state((40,))
    expected = np.asarray(jacfwd_compiled(cell_loop, y))
    jitted = jax.jit(lambda y: dl.materialise(cell_loop, y))
    np.testing.assert_allclose(np.asarray(jitted(y)), expected, rtol=1e-12)
    np.testing.assert_allclose(
        np.asarray(dl.materialise(cell_loop, y, mode="reverse")), expected, rtol=1e-12
    )
    ys = jnp.stack([y, 2 * y, y**2])
    batched = jax.vmap(lambda y: dl.materialise_operator(cell_loop, y).as_matrix())(ys)
    np.testing.assert_allclose(
        np.asarray(batched), np.asarray(jax.jit(jax.vmap(jax.jacfwd(cell_loop)))(ys)), rtol=1e-12
    )
    # Differentiating the Jacobian: the loop's values come from JVPs of the loop itself.
    second = jax.jacfwd(lambda y: dl.materialise(cell_loop, y))(y)
    np.testing.assert_allclose(
        np.asarray(second), np.asarray(jacfwd_compiled(jax.jacfwd(cell_loop), y)), rtol=1e-12
    )
    single = y.astype(jnp.float32)
    got = dl.materialise(cell_loop, single)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(jacfwd_compiled(cell_loop, single)), rtol=1e-6
    )


# 256 iterations unrolled take seconds to trace: by default that boundary is checked at a
# limit of 16 (`test_cell_loop_unroll_limit`), and at the limit itself under slow.
@pytest.mark.parametrize("n", [pytest.param(257, marks=pytest.mark.slow), 300])
def test_long_cell_loop(n):
    # Up to 256 iterations the loop is unrolled at trace time for its pattern (banded here);
    # a longer one keeps the dense fallback, exact all the same.
    y = _state((n,))
    op = dl.materialise_operator(cell_loop, y)
    dense = np.asarray(jacfwd_compiled(cell_loop, y))
    np.testing.assert_allclose(np.asarray(op.as_matrix()), dense, rtol=1e-12)
    assert (_stored(op) <= 3 * n) == (n <= 257)


def test_cell_loop_unroll_limit(monkeypatch):
    # `test_long_cell_loop`'s boundary, at a limit of 16 iterations: up to it unrolled
    # (banded), one more dense, both exact.
    assert _loops._CELL_LOOP_MAX_LENGTH == 256  # the limit `test_long_cell_loop` names
    monkeypatch.setattr(_loops, "_CELL_LOOP_MAX_LENGTH", 16)
    for n in (17, 18):  # 16 and 17 iterations
        y = _state((n,))
        op = dl.materialise_operator(cell_loop, y)
        dense = np.asarray(jacfwd_compiled(cell_loop, y))
        np.testing.assert_allclose(np.asarray(op.as_matrix()), dense, rtol=1e-12)
        assert (_stored(op) <= 3 * n) == (n <= 17)


# ---- the report's wording and its causes --------------------------------------------------


def test_report_wording():
    y = _state((6,))
    kinds = {
        "broadcast": dl.structure_report(lambda y: jnp.broadcast_to(y, (3, 6)), y).kinds[0],
        "sum": dl.structure_report(lambda y: jnp.sum(y) * jnp.ones(()), y).kinds[0],
        "permutation": dl.structure_report(lambda y: y.reshape(2, 3).T * 2, y).kinds[0],
    }
    assert kinds["broadcast"].startswith(
        "structured: zero off the diagonal of 1 axis pair, constant along 1 axis: 1 number stored"
    ), kinds
    assert kinds["sum"].startswith("structured: constant along 1 axis: 1 number stored"), kinds
    assert kinds["permutation"].startswith("sparse, 1 entry per row: 6 numbers stored"), kinds
    assert not any("delta axes" in k or "1 entries" in k for k in kinds.values())


@pytest.mark.parametrize("loop", ["while", "scan"])
def test_loop_widening_reported(loop):
    # A stencil applied again and again widens its band every iteration: the carries are
    # made dense over the pattern's axes, and the report says which loop and why.
    def field(y):
        def body(c):
            return jnp.roll(c, 1) * c

        if loop == "while":
            return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, body(c[1])), (0, y))[
                1
            ]
        return jax.lax.fori_loop(0, 300, lambda i, c: body(c), y)

    y = _state((20,))
    report = dl.structure_report(field, y)
    assert list(report.densified) == [loop], str(report)
    assert "grows every iteration" in report.reasons[loop][0]
    with pytest.raises(Exception, match=loop):
        dl.materialise(field, y, strict=True)
    np.testing.assert_allclose(
        np.asarray(dl.materialise(field, y)), np.asarray(jacfwd_compiled(field, y)), rtol=1e-10
    )


# ---- loops over cells too long to unroll ------------------------------------------------------


def _long_loops(kind):
    def field(y):
        n = y.shape[0]

        def body(i, out):
            value = y[i] ** 2 - y[i - 1]
            if kind == "set":
                return out.at[i].set(value)
            if kind == "add":
                return out.at[i].add(value * y[(i + 3) % n])
            return jax.lax.dynamic_update_slice(out, value[None] * out[i - 1][None], (i,))

        return jax.lax.fori_loop(1, n, body, y if kind == "update_slice" else jnp.zeros_like(y))

    return field


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


@pytest.mark.parametrize("kind", ["set", "add", "update_slice"])
def test_long_cell_loop_dense(kind):
    # Past 256 iterations a loop over cells is dense, computed as `jax.jacfwd` would: each
    # iteration writes one row of the carried Jacobian, and nothing of n x n size is built
    # or transposed inside the loop (the identity sliced at a traced row is a one-hot row;
    # the write takes the in side as trailing window axes). Checked on the program itself.
    n = 300
    field = _long_loops(kind)
    y = _state((n,))
    expected = np.asarray(jacfwd_compiled(field, y))
    np.testing.assert_allclose(np.asarray(dl.materialise(field, y)), expected, rtol=1e-12)
    batched = jax.vmap(lambda y: dl.materialise(field, y))(jnp.stack([y, 0.5 * y]))
    np.testing.assert_allclose(np.asarray(batched[0]), expected, rtol=1e-12)
    closed = jax.make_jaxpr(lambda y: dl.materialise(field, y))(y)
    loops = [e for e in _eqns(closed.jaxpr) if e.primitive.name == "scan"]
    assert loops
    for loop in loops:
        for eqn in _eqns(loop.params["jaxpr"].jaxpr):
            if eqn.primitive.name in ("scatter", "scatter-add", "dynamic_update_slice"):
                continue
            big = [v.aval.shape for v in eqn.outvars if np.prod(v.aval.shape) >= n * n]
            assert not big, (eqn.primitive, big)
