"""Tests for `diffrax_linearize.ItoMilstein` and `.StratonovichMilstein`.

References: Diffrax's own Milstein solvers on the same Brownian path (to float64
rounding), exact solutions of geometric Brownian motion for the strong order, a dense
`jax.jacfwd` materialisation for the Itô trace term, and Diffrax's solver (through
`RecursiveCheckpointAdjoint`) for gradients.
"""

import functools
import re

import jax


jax.config.update("jax_enable_x64", True)

import diffrax as dfx
import diffrax_linearize as dl
import equinox as eqx
import jax.flatten_util as jfu
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import lineax as lx
import numpy as np
import pytest
from diffrax_linearize import _term as _term_module
from diffrax_linearize._solver import milstein as milstein_module


T0, T1 = 0.0, 1.0
D = 3


def _drift(t, y, args):
    return jtu.tree_map(lambda x: -0.5 * x + 0.1 * jnp.sin(t), y)


#
# Diffusions: name -> (vector field, Brownian shape). All commutative except the last.
#

_RNG = np.random.default_rng(0)
_Q, _ = np.linalg.qr(_RNG.normal(size=(D, D)))
# g(y)[:, j] = B_j y with commuting B_j = Q diag(b_j) Q^T.
_B_COMMUTING = jnp.asarray(np.einsum("ik,jk,lk->ijl", _Q, 0.4 * _RNG.normal(size=(D, D)), _Q))
_B_GENERAL = jnp.asarray(0.4 * _RNG.normal(size=(D, D, D)))
_G_ADDITIVE = jnp.asarray(0.5 * _RNG.normal(size=(D, 2)))


def _vf_diagonal_lineax(t, y, args):
    return lx.DiagonalLinearOperator(0.5 * jnp.sin(y) + 0.2 * y)


def _vf_diagonal_dense(t, y, args):
    return jnp.diag(0.5 * jnp.cos(y) * y + 0.1 * t)


def _vf_scalar(t, y, args):
    return 0.3 * y + 0.1 * jnp.sin(y)


def _vf_scalar_1(t, y, args):
    return (0.3 * y + 0.1 * jnp.sin(y))[:, None]


def _vf_additive(t, y, args):
    return _G_ADDITIVE * (1 + t)


def _vf_commuting_linear(t, y, args):
    return jnp.einsum("ijk,k->ij", _B_COMMUTING.astype(y.dtype), y)


def _vf_general_linear(t, y, args):
    return jnp.einsum("ijk,k->ij", _B_GENERAL.astype(y.dtype), y)


def _vf_general_nonlinear(t, y, args):
    # A derivative stored bigger than g that depends on y: the JVP reads B once, as a
    # contraction of the derivative would.
    return jnp.einsum("ijk,k->ij", _B_GENERAL.astype(y.dtype), jnp.tanh(y))


def _vf_row_scaled(t, y, args):
    # g_ij = f(y_i) G_ij: a derivative that stores no more numbers than g (a delta times
    # G), so the Itô correction contracts it term by term, not with one formed matrix.
    return (0.5 * jnp.sin(y) + 0.3 * y)[:, None] * _B_GENERAL[:, :, 0].astype(y.dtype)


def _vf_row_scaled_linear(t, y, args):
    # g_ij = y_i G_ij: linear in y, so the Itô correction's trace term is contracted as
    # (D . D) . y, a sum of squares of G over the noise channels times y.
    return y[:, None] * _B_GENERAL[:, :, 0].astype(y.dtype)


def _vf_column_scaled_linear(t, y, args):
    # g_ij = G_ij y_j: linear in y, with the derivative's state axis tied to the control
    # axis rather than to the row (the general contraction of the linear path).
    return _B_GENERAL[:, :, 1].astype(y.dtype) * y[None, :]


DIFFUSIONS = {
    "diagonal_lineax": (_vf_diagonal_lineax, (D,)),
    "diagonal_dense": (_vf_diagonal_dense, (D,)),
    "scalar": (_vf_scalar, ()),
    "scalar_1": (_vf_scalar_1, (1,)),
    "additive": (_vf_additive, (2,)),
    "commuting_linear": (_vf_commuting_linear, (D,)),
    "general_linear": (_vf_general_linear, (D,)),
    "general_nonlinear": (_vf_general_nonlinear, (D,)),
    "row_scaled": (_vf_row_scaled, (D,)),
    "row_scaled_linear": (_vf_row_scaled_linear, (D,)),
    "column_scaled_linear": (_vf_column_scaled_linear, (D,)),
}

_Y0 = jnp.array([1.0, 0.5, -0.3])


def _terms(vf, bm, drift=_drift):
    return dfx.MultiTerm(dfx.ODETerm(drift), dfx.ControlTerm(vf, bm))


def _vbt(shape, key, tol=2**-12):
    return dfx.VirtualBrownianTree(T0, T1, tol=tol, shape=shape, key=key)


class _FixedIncrements(dfx.AbstractPath):
    """A control whose increment over any interval is `dw`: for testing single steps
    against each other without compiling a Brownian tree."""

    dw: jax.Array
    t0 = -jnp.inf
    t1 = jnp.inf

    def evaluate(self, t0, t1=None, left=True):
        return self.dw


def _steps(solvers, vf, shape, num=8, seed=2):
    """One step of each solver from `num` random (t0, dt, y0, dw), vmapped."""

    @eqx.filter_jit  # so that run-time errors carry their message
    @jax.vmap
    def steps(t0, dt, y0, dw):
        terms = _terms(vf, _FixedIncrements(dw * jnp.sqrt(dt)))
        return [s.step(terms, t0, t0 + dt, y0, None, None, False)[0] for s in solvers]

    k1, k2, k3, k4 = jr.split(jr.key(seed), 4)
    t0 = jr.uniform(k1, (num,), maxval=0.5)
    dt = jr.uniform(k2, (num,), minval=0.01, maxval=0.5)
    y0 = jr.normal(k3, (num, D))
    dw = jr.normal(k4, (num, *shape))
    return steps(t0, dt, y0, dw)


def _assert_tree_close(a, b, rtol=1e-12, atol=1e-12):
    leaves_a, tree_a = jtu.tree_flatten(a)
    leaves_b, tree_b = jtu.tree_flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


#
# Agreement with Diffrax on the same path
#


@pytest.mark.parametrize("name", list(DIFFUSIONS))
def test_step_agrees_with_diffrax(name):
    # Both implement the same (commutative-noise) formula, so they agree on
    # non-commutative noise too: there both drop the Lévy areas.
    vf, shape = DIFFUSIONS[name]
    solvers = [
        dl.ItoMilstein(),
        dfx.ItoMilstein(),
        dl.StratonovichMilstein(),
        dfx.StratonovichMilstein(),
    ]
    ito, ito_diffrax, strat, strat_diffrax = _steps(solvers, vf, shape)
    assert np.all(np.isfinite(ito))
    np.testing.assert_allclose(ito, ito_diffrax, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(strat, strat_diffrax, rtol=1e-12, atol=1e-14)
    # Not a vacuous comparison: the Itô correction is there unless the noise is
    # additive.
    if name != "additive":
        assert np.max(np.abs(ito - strat)) > 1e-3


@pytest.mark.slow
def test_diffeqsolve_agrees_with_diffrax_vmapped_over_paths():
    saveat = dfx.SaveAt(ts=jnp.linspace(T0, T1, 7))  # dense output, between steps

    @jax.jit
    @jax.vmap
    def solve(key):
        terms = _terms(_vf_commuting_linear, _vbt((D,), key))
        return [
            dfx.diffeqsolve(terms, solver, T0, T1, 0.1, _Y0, saveat=saveat).ys
            for solver in (dl.ItoMilstein(), dfx.ItoMilstein())
        ]

    ours, theirs = solve(jr.split(jr.key(1), 3))
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-13)
    assert not np.allclose(ours[0, -1], _Y0)
    assert not np.allclose(ours[0], ours[1])  # really different paths


def test_linear_diffusion_vmapped_over_args_and_differentiated():
    # g_ij = y_i G_ij with G batched (the linearity check traces under `jax.vmap`) and
    # differentiated (the sum of squares of G carries the gradient): one Itô step.
    def vf(t, y, G):
        return y[:, None] * G

    def step(G, solver):
        terms = _terms(vf, _FixedIncrements(jnp.array([0.3, -0.2, 0.25])))
        return solver.step(terms, 0.0, 0.1, _Y0, G, None, False)[0]

    Gs = 0.4 * jr.normal(jr.key(5), (2, D, D))
    ours, theirs = dl.ItoMilstein(), dfx.ItoMilstein()
    got = jax.jit(jax.vmap(lambda G: step(G, ours)))(Gs)
    expected = jax.vmap(lambda G: step(G, theirs))(Gs)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-13)
    assert not np.allclose(got[0], got[1])
    grad = jax.jit(jax.grad(lambda G: jnp.sum(step(G, ours))))(Gs[0])
    grad_theirs = jax.grad(lambda G: jnp.sum(step(G, theirs)))(Gs[0])
    np.testing.assert_allclose(grad, grad_theirs, rtol=1e-12, atol=1e-13)


def test_unsafe_brownian_path_agrees_with_diffrax():
    terms = _terms(_vf_commuting_linear, dfx.UnsafeBrownianPath((D,), jr.key(3)))

    @jax.jit
    def solve(y0):
        return [
            dfx.diffeqsolve(terms, solver, T0, T1, 0.05, y0, adjoint=dfx.ForwardMode()).ys
            for solver in (dl.ItoMilstein(), dfx.ItoMilstein())
        ]

    ours, theirs = solve(_Y0)
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-13)


#
# The Itô trace term: sum_j (d g_{:, j} / dy) g_{:, j}
#


def _dense_trace(vf, y, m):
    """Reference: materialise the d x m diffusion and its d x m x d Jacobian."""
    g = lambda _y: jnp.reshape(vf(0.3, _y, None), (y.size, m))
    jac = jax.jacfwd(g)(y)  # (d, m, d): [i, j, k] = d g_ij / d y_k
    return jnp.einsum("ijk,kj->i", jac, g(y))


@pytest.mark.parametrize(
    "name",
    [
        "diagonal_dense",
        "scalar_1",
        "additive",
        "commuting_linear",
        "general_linear",
        "row_scaled",
        "row_scaled_linear",
        "column_scaled_linear",
    ],
)
def test_ito_trace_term_against_jacfwd(name, monkeypatch):
    vf, shape = DIFFUSIONS[name]
    m = int(np.prod(shape))
    diffusion = dfx.ControlTerm(vf, _vbt(shape, jr.key(0)))
    y = jnp.array([0.7, -1.1, 0.4])
    expected = _dense_trace(vf, y, m)
    got = milstein_module.ito_trace_term(diffusion, 0.3, y, None)
    np.testing.assert_allclose(got, expected, rtol=1e-13, atol=1e-14)
    # The plain vmapped-JVP version, and its chunked path (used for large diffusions),
    # give the same result.
    plain = milstein_module.ito_trace_term_jvp(diffusion, 0.3, y, None)
    np.testing.assert_allclose(plain, expected, rtol=1e-13, atol=1e-14)
    monkeypatch.setattr(milstein_module, "_MAX_BATCHED_ELEMENTS", 4)
    chunked = milstein_module.ito_trace_term_jvp(diffusion, 0.3, y, None)
    np.testing.assert_allclose(chunked, expected, rtol=1e-13, atol=1e-14)


#
# PyTree states and PyTree Brownian motions
#

_SPLIT = {"a": 2, "b": 1}  # noise channels per block


class _DictBrownianPath(dfx.AbstractPath):
    """A flat Brownian path seen as a dict, so that a PyTree solve and a flat solve
    see exactly the same increments."""

    path: dfx.AbstractPath

    @property
    def t0(self):
        return self.path.t0

    @property
    def t1(self):
        return self.path.t1

    def evaluate(self, t0, t1=None, left=True):
        w = self.path.evaluate(t0, t1, left)
        return {"a": w[: _SPLIT["a"]], "b": w[_SPLIT["a"] :]}


def _vf_tree(t, y, args):
    # Coupled across blocks: each block's diffusion depends on the other block.
    scale = 1 + 0.2 * jnp.sum(y["b"])
    return {
        "a": jnp.diag(0.4 * jnp.sin(y["a"])) * scale,
        "b": (0.3 * y["b"] * jnp.cos(y["a"][0]))[:, None],
    }


def _vf_flat(t, y, args):
    g = _vf_tree(t, {"a": y[:2], "b": y[2:]}, args)
    return jax.scipy.linalg.block_diag(g["a"], g["b"])


def test_pytree_state_and_brownian_motion():
    flat_bm = _vbt((3,), jr.key(4))
    y0_tree = {"a": jnp.array([0.8, -0.5]), "b": jnp.array([1.2, 0.3, -0.7])}
    y0_flat = jnp.concatenate([y0_tree["a"], y0_tree["b"]])
    ours, theirs = dl.ItoMilstein(), dfx.ItoMilstein()

    @jax.jit
    def solve():
        tree_terms = _terms(_vf_tree, _DictBrownianPath(flat_bm))
        flat_terms = _terms(_vf_flat, flat_bm)
        kw = dict(t0=T0, t1=T1, dt0=0.1)
        ys_tree = dfx.diffeqsolve(tree_terms, ours, y0=y0_tree, **kw).ys
        ys_flat = dfx.diffeqsolve(flat_terms, theirs, y0=y0_flat, **kw).ys
        return ys_tree, ys_flat

    ys_tree, ys_flat = solve()
    assert set(ys_tree) == {"a", "b"}
    np.testing.assert_allclose(ys_tree["a"], ys_flat[:, :2], rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(ys_tree["b"], ys_flat[:, 2:], rtol=1e-12, atol=1e-13)


def test_ito_trace_term_pytree():
    diffusion = dfx.ControlTerm(_vf_tree, _DictBrownianPath(_vbt((3,), jr.key(0))))
    y = {"a": jnp.array([0.8, -0.5]), "b": jnp.array([1.2, 0.3, -0.7])}
    flat_y, _ = jfu.ravel_pytree(y)
    expected = _dense_trace(_vf_flat, flat_y, 3)
    got = milstein_module.ito_trace_term(diffusion, 0.3, y, None)
    np.testing.assert_allclose(
        jnp.concatenate([got["a"], got["b"]]), expected, rtol=1e-13, atol=1e-14
    )


def _dense_correction(vf, y, m, dw, dt):
    """Reference for the Itô double sum: sum_{j1 j2} (L^{j1} g_{j2}) (dw_j1 dw_j2 - delta dt)
    from the dense d x m x d Jacobian, term by term."""
    g = lambda _y: jnp.reshape(vf(0.3, _y, None), (y.size, m))
    jac = jax.jacfwd(g)(y)  # [i, j, k] = d g_ij / d y_k
    lg = jnp.einsum("ijk,kl->ilj", jac, g(y))  # [i, j1, j2] = L^{j1} g_{i j2}
    return jnp.einsum("iab,ab->i", lg, jnp.outer(dw, dw) - dt * jnp.eye(m, dtype=dw.dtype))


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
@pytest.mark.parametrize(
    "name",
    [
        "diagonal_dense",
        "commuting_linear",
        "general_linear",
        "row_scaled",
        "row_scaled_linear",
        "column_scaled_linear",
    ],
)
def test_ito_milstein_correction_against_jacfwd(name, dtype):
    vf, shape = DIFFUSIONS[name]
    m = int(np.prod(shape))
    diffusion = dfx.ControlTerm(vf, _vbt(jax.ShapeDtypeStruct(shape, dtype), jr.key(0)))
    y = jnp.array([0.7, -1.1, 0.4], dtype)
    dw = jr.normal(jr.key(1), (m,), dtype)
    dt = jnp.asarray(0.05, dtype)
    g_prod = diffusion.prod(vf(0.3, y, None), dw)
    got = _term_module.ito_milstein_correction(diffusion, 0.3, y, None, g_prod, dw, dt)
    expected = _dense_correction(vf, y, m, dw, dt)
    assert got.dtype == dtype
    tol = 1e-12 if dtype == jnp.float64 else 1e-5
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol)
    assert np.max(np.abs(expected)) > 1e-3  # not a comparison of zeros


@pytest.mark.parametrize(
    "name",
    [
        "diagonal_dense",
        "row_scaled",
        "row_scaled_linear",
        "column_scaled_linear",
        "general_linear",
        "commuting_linear",
    ],
)
def test_stratonovich_milstein_correction_against_jacfwd(name):
    # The symmetric double sum, from the dense Jacobian (the Itô one with dt = 0).
    vf, shape = DIFFUSIONS[name]
    m = int(np.prod(shape))
    diffusion = dfx.ControlTerm(vf, _vbt(shape, jr.key(0)))
    y = jnp.array([0.7, -1.1, 0.4])
    dw = jr.normal(jr.key(1), (m,))
    g_prod = diffusion.prod(vf(0.3, y, None), dw)
    got = _term_module.stratonovich_milstein_correction(diffusion, 0.3, y, None, g_prod, dw)
    expected = _dense_correction(vf, y, m, dw, 0.0)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-13)
    assert np.max(np.abs(expected)) > 1e-3


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_materialised_is_exact(dtype):
    x = jnp.array([[0.3, -1.7e-30, jnp.inf], [-jnp.inf, jnp.nan, 2.5e30]], dtype)
    got = jax.jit(_term_module._materialised)(x)
    assert got.shape == x.shape and got.dtype == x.dtype
    np.testing.assert_array_equal(got, x)


def _dense_linear_vf(t, y, A):
    return jnp.einsum("imk,k->im", A, y)


def _dense_linear_step(solver, y, A, key):
    """One step of `solver` on dy = -y dt + (A y) dW, with an `UnsafeBrownianPath` of
    A's dtype (one `normal`)."""
    bm = dfx.UnsafeBrownianPath(jax.ShapeDtypeStruct((A.shape[1],), A.dtype), key)
    terms = dfx.MultiTerm(dfx.ODETerm(lambda t, y, A: -y), dfx.ControlTerm(_dense_linear_vf, bm))
    # Times of A's dtype: float64 Python times would make the drift's dt float64, which
    # (under the suite's strict promotion) Diffrax's `ODETerm` refuses for a float32 state.
    t0, t1 = jnp.asarray(0.0, A.dtype), jnp.asarray(0.01, A.dtype)
    state = solver.init(terms, t0, t1, y, A)
    return solver.step(terms, t0, t1, y, A, state, False)[0]


def test_ito_step_samples_the_increment_once():
    # g = A y: the one contraction forms W = (g dW) dW^T - dt g, d x m. In the compiled
    # step no fusion that writes d*m numbers may compute the increment's sampling (the
    # erf_inv of `jax.random.normal`): XLA fuses cheap elementwise producers into an outer
    # product, repeating them per entry, unless dW comes through `_materialised`.
    d = m = 6
    A = jr.normal(jr.key(0), (d, m, d)) / d
    vf = _dense_linear_vf
    step = functools.partial(_dense_linear_step, dl.ItoMilstein())
    y, key = jnp.linspace(0.5, 1.5, d), jr.key(1)
    dw = dfx.UnsafeBrownianPath((m,), key).evaluate(0.0, 0.01)
    g_prod = vf(0.0, y, A) @ dw
    expected = (
        y - 0.01 * y + g_prod + 0.5 * _dense_correction(lambda t, y, _: vf(t, y, A), y, m, dw, 0.01)
    )
    np.testing.assert_allclose(jax.jit(step)(y, A, key), expected, rtol=1e-12, atol=1e-12)
    if jax.default_backend() != "cpu":
        pytest.skip("the fusion checked below is XLA's CPU backend's")
    hlo = jax.jit(step).lower(y, A, key).compile().as_text()
    computations = re.split(r"\n(?=\S)", hlo)
    # The sampling: the erf_inv of `jax.random.normal` (jax <= 0.12.0) or, from jax 0.12.1,
    # which expands it, the bit shifts that turn the random bits into floats.
    sampling = [c for c in computations if "erf_inv" in c or "shift-right-logical" in c]
    assert sampling  # the check below looks at something
    # The sizes of what each computation writes (a tuple for a multi-output fusion).
    roots = [line for c in sampling for line in c.splitlines() if "ROOT " in line]
    sizes = [
        int(np.prod([int(n) for n in shape.split(",") if n]))
        for line in roots
        for shape in re.findall(r"\b[a-z]+\d*\[([\d,]*)\]", line.split(" = ", 1)[1])
    ]
    assert len(roots) == len(sampling) and sizes, roots
    assert max(sizes) < d * m, roots


@pytest.mark.parametrize("name", ["general_nonlinear", "diagonal_lineax", "scalar_1", "additive"])
def test_stratonovich_milstein_correction_leaves_the_rest_to_the_jvp(name):
    # A derivative stored bigger than g that depends on y (the JVP reads what it is made
    # of once, where the contraction would first form it) or simple noise: the one JVP is
    # no dearer.
    vf, shape = DIFFUSIONS[name]
    diffusion = dfx.ControlTerm(vf, _vbt(shape, jr.key(0)))
    y = jnp.array([0.7, -1.1, 0.4])
    dw = jnp.ones(shape)
    g_prod = diffusion.prod(vf(0.3, y, None), dw)
    assert (
        _term_module.stratonovich_milstein_correction(diffusion, 0.3, y, None, g_prod, dw) is None
    )


@pytest.mark.parametrize(
    "vf, linear",
    [
        (_vf_row_scaled_linear, True),
        (_vf_column_scaled_linear, True),
        (_vf_general_linear, True),
        (lambda t, y, args: 2.0 * (0.5 * y)[:, None] * _B_GENERAL[:, :, 0], True),
        (_vf_row_scaled, False),  # sin(y_i): the derivative depends on y
        (lambda t, y, args: _vf_row_scaled_linear(t, y, args) + _G_ADDITIVE[:, :1], False),
        (lambda t, y, args: (y + 1.0)[:, None] * _B_GENERAL[:, :, 0], False),
    ],
)
def test_linear_in_state(vf, linear):
    # Which diffusions the Itô correction treats as g = D y (its trace term then
    # contracts the derivative with itself, then with y): a wrong `True` would drop a
    # constant term of g from the correction.
    diffusion = dfx.ControlTerm(vf, _vbt((D,), jr.key(0)))
    y = jnp.array([0.7, -1.1, 0.4])
    assert _term_module._linear_in_state(diffusion, 0.3, y, None) is linear
    expected = _dense_trace(vf, y, D)
    got = milstein_module.ito_trace_term(diffusion, 0.3, y, None)
    np.testing.assert_allclose(got, expected, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("name", ["diagonal_lineax", "scalar_1", "additive"])
def test_ito_milstein_correction_leaves_simple_noise_to_the_jvp(name):
    # Additive, scalar and diagonal noise keep one JVP plus the trace term: no cheaper.
    vf, shape = DIFFUSIONS[name]
    diffusion = dfx.ControlTerm(vf, _vbt(shape, jr.key(0)))
    y = jnp.array([0.7, -1.1, 0.4])
    dw = jnp.ones(shape)
    g_prod = diffusion.prod(vf(0.3, y, None), dw)
    assert _term_module.ito_milstein_correction(diffusion, 0.3, y, None, g_prod, dw, 0.1) is None


def test_sum_of_squares_is_a_reduction():
    # The trace term of g_ij = y_i G_ij, y_i sum_j G_ij^2: one reduction of the squares
    # over the noise channels (read by nothing else, so hoisted out of a solve's loop),
    # against the dense jacfwd references.
    vf, shape = DIFFUSIONS["row_scaled_linear"]
    m = int(np.prod(shape))
    diffusion = dfx.ControlTerm(vf, _vbt(shape, jr.key(0)))
    y = jnp.array([0.7, -1.1, 0.4])
    got = milstein_module.ito_trace_term(diffusion, 0.3, y, None)
    np.testing.assert_allclose(got, _dense_trace(vf, y, m), rtol=1e-13, atol=1e-14)
    # With G an argument (a closed-over G is summed in NumPy).
    row_scaled = dfx.ControlTerm(lambda t, y, G: y[:, None] * G, _vbt(shape, jr.key(0)))
    trace = lambda G: milstein_module.ito_trace_term(row_scaled, 0.3, y, G)  # noqa: E731
    assert "reduce_sum" in str(jax.make_jaxpr(trace)(_B_GENERAL[:, :, 0]))
    np.testing.assert_allclose(trace(_B_GENERAL[:, :, 0]), got, rtol=1e-13, atol=1e-14)
    dw, dt = jr.normal(jr.key(1), (m,)), 0.05
    g_prod = diffusion.prod(vf(0.3, y, None), dw)
    got = _term_module.ito_milstein_correction(diffusion, 0.3, y, None, g_prod, dw, dt)
    expected = _dense_correction(vf, y, m, dw, dt)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    assert np.max(np.abs(expected)) > 1e-3


@pytest.mark.parametrize(
    "name, applies, any_size",
    [
        ("row_scaled_linear", True, True),
        ("column_scaled_linear", True, True),
        # A y: the derivative A is bigger than g; only where asked (the Stratonovich step).
        ("general_linear", False, True),
        ("commuting_linear", False, True),
        ("general_nonlinear", False, False),  # bigger and not linear
        ("row_scaled", False, False),  # sin(y_i) G_ij: not linear
        ("diagonal_dense", False, False),
        ("diagonal_lineax", False, False),
        ("additive", False, False),
    ],
)
def test_linear_diffusion_prod(name, applies, any_size):
    # g(y) dW without forming g, for a linear diffusion: against the term's own `vf_prod`.
    vf, shape = DIFFUSIONS[name]
    diffusion = dfx.ControlTerm(vf, _vbt(shape, jr.key(0)))
    y = jnp.array([0.7, -1.1, 0.4])
    dw = jr.normal(jr.key(1), shape)
    expected = diffusion.vf_prod(0.3, y, None, dw)
    assert np.max(np.abs(expected)) > 1e-3
    for any_size_ in (False, True):
        got = _term_module.linear_diffusion_prod(diffusion, 0.3, y, None, dw, any_size=any_size_)
        if not (applies or (any_size and any_size_)):
            assert got is None, any_size_
            continue
        assert got.shape == expected.shape and got.dtype == expected.dtype
        np.testing.assert_allclose(got, expected, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_stratonovich_step_reads_a_once(dtype):
    # g = A y: the Stratonovich step is y + f dt + (A dW) y + (A dW)(A dW) y / 2, so in the
    # compiled step one instruction reads A (the matrix A dW, shared by both products),
    # where g and then the JVP along g dW read it twice. Against Diffrax's step, too.
    d = m = 6
    A = jr.normal(jr.key(0), (d, m, d), dtype) / d
    ours = jax.jit(functools.partial(_dense_linear_step, dl.StratonovichMilstein()))
    theirs = jax.jit(functools.partial(_dense_linear_step, dfx.StratonovichMilstein()))
    y, key = jnp.linspace(0.5, 1.5, d, dtype=dtype), jr.key(1)
    got, expected = ours(y, A, key), theirs(y, A, key)
    assert got.dtype == expected.dtype == dtype
    tol = 1e-12 if dtype == jnp.float64 else 1e-5
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol)
    if jax.default_backend() != "cpu":
        pytest.skip("the instructions counted below are XLA's CPU backend's")
    entry = ours.lower(y, A, key).compile().as_text().split("\nENTRY ", 1)[1]
    kind = jnp.dtype(dtype).name.replace("float", "f")
    (param,) = re.findall(rf"%(\S+) = {kind}\[6,6,6\]\{{[\d,]+\}} parameter", entry)
    names = {param} | set(re.findall(rf"%(\S+) = \S+ bitcast\(%{re.escape(param)}\)", entry))
    readers = [
        line
        for line in entry.splitlines()
        if " = " in line
        and " bitcast(" not in line
        and any(re.search(rf"%{re.escape(n)}\b", line.split(" = ", 1)[1]) for n in names)
    ]
    assert len(readers) == 1, readers


def test_linear_diffusion_prod_forms_no_matrix():
    # For g_ij = y_i G_ij (G an argument), y * (G dW): in the compiled program no d x m
    # array but G itself, where the term's `vf_prod` forms g.
    m = 4
    term = dfx.ControlTerm(lambda t, y, G: y[:, None] * G, _vbt((m,), jr.key(0)))
    G = jr.normal(jr.key(2), (D, m))
    y, dw = jnp.array([0.7, -1.1, 0.4]), jr.normal(jr.key(1), (m,))

    def matrices(fn):
        hlo = jax.jit(fn).lower(y, G, dw).compile().as_text()
        return [line for line in hlo.splitlines() if re.search(rf"= \w+\[{D},{m}\]", line)]

    prod = lambda y, G, dw: _term_module.linear_diffusion_prod(term, 0.3, y, G, dw)  # noqa: E731
    assert all("parameter(" in line for line in matrices(prod))
    assert not all("parameter(" in line for line in matrices(lambda *a: term.vf_prod(0.3, *a)))
    np.testing.assert_allclose(prod(y, G, dw), term.vf_prod(0.3, y, G, dw), rtol=1e-13)


def test_ito_milstein_correction_pytree():
    diffusion = dfx.ControlTerm(_vf_tree, _DictBrownianPath(_vbt((3,), jr.key(0))))
    y = {"a": jnp.array([0.8, -0.5]), "b": jnp.array([1.2, 0.3, -0.7])}
    flat_dw = jnp.array([0.3, -0.8, 0.5])
    dw = {"a": flat_dw[:2], "b": flat_dw[2:]}
    g_prod = diffusion.prod(_vf_tree(0.3, y, None), dw)
    got = _term_module.ito_milstein_correction(diffusion, 0.3, y, None, g_prod, dw, 0.1)
    flat_y, _ = jfu.ravel_pytree(y)
    expected = _dense_correction(_vf_flat, flat_y, 3, flat_dw, 0.1)
    np.testing.assert_allclose(
        jnp.concatenate([got["a"], got["b"]]), expected, rtol=1e-13, atol=1e-14
    )


#
# Transformations: vmap over paths, grad
#


@pytest.mark.slow
def test_grad_against_diffrax():
    bm = _vbt((D,), jr.key(6))

    def vf(t, y, sigma):
        return jnp.diag(sigma * jnp.sin(y) + 0.1 * y)

    def loss(solver, y0, sigma):
        terms = _terms(vf, bm)
        sol = dfx.diffeqsolve(
            terms,
            solver,
            T0,
            T1,
            0.05,
            y0,
            args=sigma,
            adjoint=dfx.RecursiveCheckpointAdjoint(),
            max_steps=32,
        )
        return jnp.sum(sol.ys[-1] ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(1, 2)), static_argnums=0)
    sigma = jnp.array(0.6)
    ours = grad(dl.ItoMilstein(), _Y0, sigma)
    theirs = grad(dfx.ItoMilstein(), _Y0, sigma)
    _assert_tree_close(ours, theirs, rtol=1e-10, atol=1e-12)
    assert abs(float(ours[1])) > 1e-3  # the parameter really matters


#
# Adaptive steps
#


@pytest.mark.slow  # 21 s on two idle cores; PID control itself: tests/test_adaptive_milstein.py
def test_halfsolver_pidcontroller():
    mu, sigma = 0.2, 0.5
    keys = jr.split(jr.key(7), 8)
    bm_tol = 2**-12

    def solve(solver, rtol, key):
        bm = _vbt((), key, tol=bm_tol)
        terms = _terms(lambda t, y, a: sigma * y, bm, lambda t, y, a: mu * y)
        sol = dfx.diffeqsolve(
            terms,
            dfx.HalfSolver(solver),
            T0,
            T1,
            0.1,
            jnp.array(1.0),
            stepsize_controller=dfx.PIDController(rtol=rtol, atol=rtol, dtmin=2**-12),
            max_steps=2**12,
        )
        exact = jnp.exp((mu - 0.5 * sigma**2) * T1 + sigma * bm.evaluate(T0, T1))
        return sol.ys[-1], exact, sol.stats["num_accepted_steps"]

    run = jax.jit(jax.vmap(solve, in_axes=(None, None, 0)), static_argnums=0)
    rtol = jnp.array(1e-2)
    y_ours, exact, steps_loose = run(dl.ItoMilstein(), rtol, keys)
    y_tight, _, steps_tight = run(dl.ItoMilstein(), rtol / 100, keys)
    err_loose = jnp.sqrt(jnp.mean((y_ours - exact) ** 2))
    err_tight = jnp.sqrt(jnp.mean((y_tight - exact) ** 2))
    assert jnp.all(steps_tight > steps_loose)
    assert err_tight < 0.2 * err_loose
    assert err_tight < 1e-2


def _adaptive(solver, vf, key, rtol=1e-4):
    shape = (2,) if vf is _vf_noncommuting_2 else (D,)
    sol = dfx.diffeqsolve(
        _terms(vf, _vbt(shape, key)),
        dfx.HalfSolver(solver),
        T0,
        T1,
        None,
        _Y0,
        stepsize_controller=dfx.PIDController(rtol=rtol, atol=rtol),
        saveat=dfx.SaveAt(steps=True),
        max_steps=4096,
    )
    n = int(sol.stats["num_accepted_steps"])
    return np.asarray(sol.ts[:n]), np.asarray(sol.ys[:n])


def _vf_noncommuting_2(t, y, args):
    return jnp.sin(y)[:, None] * jnp.array([[0.3, -0.2], [0.1, 0.4], [-0.5, 0.2]])


@pytest.mark.parametrize(
    "vf",
    # Slow (25 s on two idle cores): the default run keeps the fixed-step bit-identity and
    # the PID-controller tests of tests/test_adaptive_milstein.py.
    [
        pytest.param(_vf_diagonal_dense, marks=pytest.mark.slow),
        # Bit for bit only at XLA's default level: at -O0 the two programs round
        # differently, and by step 50 an ulp has become one step more (52 against 51).
        pytest.param(_vf_noncommuting_2, marks=[pytest.mark.slow, pytest.mark.default_xla_opt]),
    ],
    ids=["diagonal", "yG"],
)
def test_adaptive_stratonovich_path_identical_to_diffrax(vf):
    # The Stratonovich step is the same single JVP as Diffrax's, so even the rounding is
    # the same: every accepted time and state of an adaptive solve equal bit for bit.
    ts, ys = _adaptive(dl.StratonovichMilstein(), vf, jr.key(0))
    ts_ref, ys_ref = _adaptive(dfx.StratonovichMilstein(), vf, jr.key(0))
    assert len(ts) > 20
    np.testing.assert_array_equal(ts, ts_ref)
    np.testing.assert_array_equal(ys, ys_ref)


@pytest.mark.slow
def test_adaptive_ito_agrees_with_diffrax_to_tolerance():
    # The Itô step differs from Diffrax's by rounding only (the correction is a JVP minus
    # dt times the trace term, where Diffrax contracts a d x m x m tensor), and the step-size
    # controller can turn an ulp in an error estimate into a different step sequence, so
    # adaptive paths need not be identical (docs: "Parity with Diffrax"). They are equally
    # good solutions: the same to well within the tolerance, and the same distance from a
    # fine fixed-step solution on the same Brownian path.
    rtol = 1e-3
    for seed in range(3):
        key = jr.key(seed)
        terms = _terms(_vf_noncommuting_2, _vbt((2,), key))
        fine = dfx.diffeqsolve(terms, dfx.ItoMilstein(), T0, T1, 2**-12, _Y0).ys[-1]
        ours = _adaptive(dl.ItoMilstein(), _vf_noncommuting_2, key, rtol)[1][-1]
        theirs = _adaptive(dfx.ItoMilstein(), _vf_noncommuting_2, key, rtol)[1][-1]
        assert np.max(np.abs(ours - theirs)) < rtol
        err_ours, err_theirs = np.max(np.abs(ours - fine)), np.max(np.abs(theirs - fine))
        assert abs(err_ours - err_theirs) < 0.1 * err_theirs + rtol


#
# Strong order of convergence
#

_STEPS = 2 ** np.arange(3, 8)  # 8 .. 128 steps over [0, 1]
_NUM_PATHS = 256


def _strong_order(solve_with_steps, steps=_STEPS):
    """Fit the slope of log(RMS error) against log(dt) over `steps`.

    `solve_with_steps(dt)` returns the per-path errors at `T1` for step `dt`; it is
    jitted once, with `dt` traced.
    """
    fn = jax.jit(solve_with_steps)
    errors = []
    for n in steps:
        err = fn(jnp.asarray((T1 - T0) / n))
        errors.append(float(jnp.sqrt(jnp.mean(jnp.sum(err**2, axis=-1)))))
    dts = (T1 - T0) / np.asarray(steps)
    order, _ = np.polyfit(np.log(dts), np.log(errors), 1)
    return order, errors


def _gbm_errors(solver, stratonovich, dt):
    mu, sigma = -0.5, 0.5
    keys = jr.split(jr.key(8), _NUM_PATHS)

    def per_path(key):
        bm = _vbt((), key)
        terms = _terms(lambda t, y, a: sigma * y, bm, lambda t, y, a: mu * y)
        y1 = dfx.diffeqsolve(
            terms, solver, T0, T1, dt, jnp.array([1.0]), max_steps=int(_STEPS[-1]) + 1
        ).ys[-1]
        drift = mu if stratonovich else mu - 0.5 * sigma**2
        exact = jnp.exp(drift * T1 + sigma * bm.evaluate(T0, T1))
        return y1 - exact

    return jax.vmap(per_path)(keys)


@pytest.mark.parametrize(
    "solver, stratonovich, low, high",
    [
        (dl.ItoMilstein(), False, 0.9, 1.1),
        # The second solver and the control are slow (a fit over many paths each); the Itô
        # fit's bounds 0.9-1.1 already fail for a method of order 0.5.
        pytest.param(dl.StratonovichMilstein(), True, 0.9, 1.1, marks=pytest.mark.slow),
        pytest.param(dfx.Euler(), False, 0.35, 0.65, marks=pytest.mark.slow),
    ],
    ids=["ito_milstein", "stratonovich_milstein", "euler_maruyama"],
)
def test_strong_order_gbm(solver, stratonovich, low, high):
    order, errors = _strong_order(lambda dt: _gbm_errors(solver, stratonovich, dt))
    assert low < order < high, (order, errors)


@pytest.mark.slow
def test_strong_order_commuting_linear_multidimensional():
    # dy = M y dt + sum_j B_j y dW_j with M, B_j commuting (simultaneously
    # diagonalised by Q): exact solution in the eigenbasis. Exercises the Itô trace
    # term with m = 3 noise channels that are not diagonal in y.
    rng = np.random.default_rng(1)
    mu = 0.2 * rng.normal(size=D)
    b = 0.5 * rng.normal(size=(D, D))  # b[j, k]: eigenvalue k of B_j
    q = jnp.asarray(_Q)
    M = q @ jnp.diag(mu) @ q.T
    B = jnp.einsum("ik,jk,lk->ijl", q, b, q)  # g(y)_{:, j} = B[:, j, :] @ y
    keys = jr.split(jr.key(9), _NUM_PATHS)

    def errors(dt):
        def per_path(key):
            bm = _vbt((D,), key)
            terms = _terms(lambda t, y, a: jnp.einsum("ijk,k->ij", B, y), bm, lambda t, y, a: M @ y)
            y1 = dfx.diffeqsolve(
                terms, dl.ItoMilstein(), T0, T1, dt, _Y0, max_steps=int(_STEPS[-1]) + 1
            ).ys[-1]
            w = bm.evaluate(T0, T1)
            z = (q.T @ _Y0) * jnp.exp((mu - 0.5 * jnp.sum(b**2, 0)) * T1 + w @ b)
            return y1 - q @ z

        return jax.vmap(per_path)(keys)

    order, errs = _strong_order(errors)
    assert 0.9 < order < 1.1, (order, errs)


@pytest.mark.slow
def test_strong_order_noncommutative():
    # dX1 = dW1, dX2 = X1 dW2: L^1 g^2 = (0, 1) != 0 = L^2 g^1. X2(1) = int W1 dW2
    # needs the Lévy area, which Milstein drops: strong order 0.5. Reference: the
    # same scheme on a 2^10-step grid, whose error is orthogonal to (and 16x smaller
    # in variance than) the finest one fitted.
    keys = jr.split(jr.key(10), _NUM_PATHS // 2)
    fine = 2**10
    steps = 2 ** np.arange(2, 7)

    def vf(t, y, args):
        return jnp.array([[1.0, 0.0], [0.0, y[0]]])

    def solve_all(dt):
        def per_path(key):
            terms = _terms(vf, _vbt((2,), key), lambda t, y, a: 0.0 * y)
            return dfx.diffeqsolve(
                terms, dl.ItoMilstein(), T0, T1, dt, jnp.zeros(2), max_steps=fine + 1
            ).ys[-1]

        return jax.vmap(per_path)(keys)

    solve_all = jax.jit(solve_all)
    reference = solve_all(jnp.asarray(1.0 / fine))
    order, errs = _strong_order(lambda dt: solve_all(dt) - reference, steps)
    assert 0.35 < order < 0.65, (order, errs)


#
# The opt-in commutativity check
#


@pytest.mark.parametrize(
    "solver_cls", [dl.ItoMilstein, dl.StratonovichMilstein], ids=lambda c: c.__name__
)
@pytest.mark.parametrize("name", ["diagonal_lineax", "commuting_linear", "additive"])
def test_commutativity_check_passes(solver_cls, name):
    vf, shape = DIFFUSIONS[name]
    checked, unchecked = _steps([solver_cls(check_commutativity=True), solver_cls()], vf, shape)
    np.testing.assert_array_equal(checked, unchecked)


def test_commutativity_check_raises():
    vf, shape = DIFFUSIONS["general_linear"]
    with pytest.raises(eqx.EquinoxRuntimeError, match="diffrax_linearize.StratonovichMilstein"):
        _steps([dl.StratonovichMilstein(check_commutativity=True)], vf, shape)
    # Inside `diffeqsolve`'s loop too.
    terms = _terms(vf, _vbt(shape, jr.key(11)))
    solver = dl.ItoMilstein(check_commutativity=True)
    with pytest.raises(eqx.EquinoxRuntimeError, match="diffrax_linearize.ItoMilstein"):
        dfx.diffeqsolve(terms, solver, T0, T1, 0.1, _Y0)

    # Sensitive: a perturbation of commuting noise by 1e-5 is caught.
    def nearly_commuting(t, y, args):
        return _vf_commuting_linear(t, y, args) + 1e-5 * vf(t, y, args)

    with pytest.raises(eqx.EquinoxRuntimeError, match="commutative noise"):
        _steps([dl.ItoMilstein(check_commutativity=True)], nearly_commuting, shape)


def test_solver_metadata():
    terms = _terms(_vf_scalar, _vbt((), jr.key(0)))
    for ours, theirs in [
        (dl.ItoMilstein(), dfx.ItoMilstein()),
        (dl.StratonovichMilstein(), dfx.StratonovichMilstein()),
    ]:
        assert ours.term_structure == theirs.term_structure or (
            ours.term_structure.__origin__ is theirs.term_structure.__origin__
        )
        assert ours.interpolation_cls is theirs.interpolation_cls
        assert ours.strong_order(terms) == theirs.strong_order(terms) == 1
        assert ours.error_order(terms) == theirs.error_order(terms)
        # The state is the Brownian tree's value at the end of the last step (nothing yet);
        # a path that is not a `VirtualBrownianTree` gets none, as Diffrax's solver.
        state = ours.init(terms, T0, T1, _Y0, None)
        assert jnp.isnan(state.r)
        unsafe = _terms(_vf_scalar, dfx.UnsafeBrownianPath((), jr.key(0)))
        assert ours.init(unsafe, T0, T1, _Y0, None) is theirs.init(unsafe, T0, T1, _Y0, None)
        with pytest.raises(ValueError, match="diffrax_linearize"):
            ours.order(terms)
    assert isinstance(dl.ItoMilstein(), dfx.AbstractItoSolver)
    assert isinstance(dl.StratonovichMilstein(), dfx.AbstractStratonovichSolver)


def test_constructor_arguments_checked():
    for cls in (dl.ItoMilstein, dl.StratonovichMilstein):
        with pytest.raises(TypeError, match=rf"{cls.__name__}\(check_commutativity=\.\.\.\)"):
            cls(check_commutativity="yes")  # pyright: ignore
        with pytest.raises(TypeError, match="must be `True` or `False`, got 1"):
            cls(check_commutativity=1)  # pyright: ignore
        assert cls(check_commutativity=True).check_commutativity is True


def test_commutativity_message_is_plain_text_and_suggests_general_solvers():
    vf, shape = DIFFUSIONS["general_linear"]
    for cls in (dl.ItoMilstein, dl.StratonovichMilstein):
        with pytest.raises(eqx.EquinoxRuntimeError) as info:
            _steps([cls(check_commutativity=True)], vf, shape)
        message = str(info.value)
        assert f"diffrax_linearize.General{cls.__name__}" in message
        assert "diffrax_linearize.LevyAreaBrownianPath" in message
        # No LaTeX: no maths delimiters, commands or braces.
        assert not any(c in message for c in "$\\{}"), message


#
# Complex states and Brownian motions
#

_C = jnp.asarray((_RNG.normal(size=(D, 2)) + 1j * _RNG.normal(size=(D, 2))) * 0.4)


def _drift_complex(t, y, args):
    return -0.5 * y + 0.1j * y**2


def _vf_holomorphic(t, y, args):
    return (y + 0.3 * y**2)[:, None] * _C


def _vf_not_holomorphic(t, y, args):
    return (0.3 * y + 0.2 * jnp.conj(y) + 0.1 * jnp.abs(y).astype(y.dtype))[:, None] * _C


class _RealView(dfx.AbstractPath):
    """A complex Brownian motion (real and imaginary parts independent, variance h/2
    each, as Diffrax samples it) as the real Brownian motion of twice the dimension and
    variance h: `sqrt(2) (Re W, Im W)`."""

    bm: dfx.AbstractBrownianPath
    t0 = T0
    t1 = T1

    def evaluate(self, t0, t1=None, left=True):
        w = self.bm.evaluate(t0, t1, left)
        return jnp.sqrt(2.0) * jnp.concatenate([w.real, w.imag])


def _real_system(vf, complex_noise):
    """The SDE on (Re y, Im y) equivalent to the complex one. `diffrax.ControlTerm` maps
    the control through `conj(vf) @ dw`, so the diffusion matrix is `conj(vf)`."""

    def split(y):
        return jnp.concatenate([y.real, y.imag])

    def drift(t, u, args):
        return split(_drift_complex(t, jax.lax.complex(u[:D], u[D:]), args))

    def diffusion(t, u, args):
        g = jnp.conj(vf(t, jax.lax.complex(u[:D], u[D:]), args))
        if complex_noise:  # g (a + i b) / sqrt(2) for the real channels (a, b)
            return jnp.block([[g.real, -g.imag], [g.imag, g.real]]) / jnp.sqrt(2.0)
        return jnp.concatenate([g.real, g.imag])

    return drift, diffusion


_Y0_COMPLEX = jnp.array([0.5 + 0.2j, -0.3 + 0.1j, 0.8 - 0.4j])
_VFS_COMPLEX = [_vf_holomorphic, _vf_not_holomorphic]
_SOLVERS_COMPLEX = [
    (dl.ItoMilstein(), dfx.ItoMilstein()),
    (dl.StratonovichMilstein(), dfx.StratonovichMilstein()),
]


@pytest.mark.parametrize("complex_noise", [True, False], ids=["complex_bm", "real_bm"])
@pytest.mark.standard_promotion
def test_complex_step_against_real_system(complex_noise):
    # Reference: Diffrax's own solver on the equivalent real SDE with the same increments.
    # (Diffrax's `ItoMilstein` run on the complex SDE itself is off by about 1e-2 per step
    # here, even with a real Brownian motion; its Stratonovich solver agrees with ours.)
    dtype = jnp.complex128 if complex_noise else jnp.float64

    @jax.jit
    @jax.vmap
    def steps(t0, dt, y0, dw):
        out = []
        for vf in _VFS_COMPLEX:
            drift, diffusion = _real_system(vf, complex_noise)
            dw_real = jnp.sqrt(2.0) * jnp.concatenate([dw.real, dw.imag]) if complex_noise else dw
            terms = dfx.MultiTerm(
                dfx.ODETerm(_drift_complex), dfx.ControlTerm(vf, _FixedIncrements(dw))
            )
            real_terms = dfx.MultiTerm(
                dfx.ODETerm(drift), dfx.ControlTerm(diffusion, _FixedIncrements(dw_real))
            )
            u0 = jnp.concatenate([y0.real, y0.imag])
            for ours, theirs in _SOLVERS_COMPLEX:
                y1 = ours.step(terms, t0, t0 + dt, y0, None, None, False)[0]
                u1 = theirs.step(real_terms, t0, t0 + dt, u0, None, None, False)[0]
                out.append((y1, u1[:D] + 1j * u1[D:]))
        return out

    k1, k2, k3, k4 = jr.split(jr.key(8), 4)
    num = 8
    t0 = jr.uniform(k1, (num,), maxval=0.5)
    dt = jr.uniform(k2, (num,), minval=0.01, maxval=0.3)
    y0 = _Y0_COMPLEX + 0.3 * jr.normal(k3, (num, D), jnp.complex128)
    dw = jr.normal(k4, (num, 2), dtype) * jnp.sqrt(dt)[:, None]
    for y1, expected in steps(t0, dt, y0, dw):
        assert y1.dtype == jnp.complex128
        np.testing.assert_allclose(y1, expected, rtol=1e-12, atol=1e-13)
        assert np.min(np.abs(y1 - y0)) > 1e-3  # the step moved the state


@pytest.mark.filterwarnings("ignore:Complex dtype support in Diffrax")
@pytest.mark.filterwarnings("ignore:Complex support in Optimistix")
@pytest.mark.parametrize(
    "solver",
    [
        dl.ItoMilstein(),
        dl.ImplicitItoMilstein(),
        # Compile-bound (four solves each): the rest in the slow tier.
        pytest.param(dl.StratonovichMilstein(), marks=pytest.mark.slow),
        pytest.param(dl.ItoTaylor15(), marks=pytest.mark.slow),
        pytest.param(dl.ImplicitEulerMaruyama(), marks=pytest.mark.slow),
        pytest.param(dl.ImplicitStratonovichMilstein(theta=0.5), marks=pytest.mark.slow),
    ],
    ids=lambda s: type(s).__name__,
)
def test_complex_state_real_noise_under_strict_promotion(solver):
    # A complex state driven by a real Brownian motion, under JAX's strict dtype promotion
    # (Diffrax's `test_sde2.py::test_weakly_diagonal_noise[complex128]`, which
    # `tests/diffrax_suite.py --sde` runs, raised a promotion error in every solver of
    # ours, and the drift-implicit ones raised for any complex state): the solve of the
    # complex SDE against the same solver on the equivalent real SDE, on the same path.
    # The drift is holomorphic, so the drift-implicit solvers' complex Jacobian is exact.
    bm = dfx.VirtualBrownianTree(T0, T1, 2**-8, (2,), jr.key(5), dfx.SpaceTimeLevyArea)
    saveat = dfx.SaveAt(ts=jnp.linspace(T0, T1, 5))

    @functools.partial(jax.jit, static_argnums=0)
    def solve(vf):
        terms = dfx.MultiTerm(dfx.ODETerm(_drift_complex), dfx.ControlTerm(vf, bm))
        y = dfx.diffeqsolve(terms, solver, T0, T1, 0.05, _Y0_COMPLEX, saveat=saveat).ys
        drift, diffusion = _real_system(vf, False)
        real_terms = dfx.MultiTerm(dfx.ODETerm(drift), dfx.ControlTerm(diffusion, bm))
        u0 = jnp.concatenate([_Y0_COMPLEX.real, _Y0_COMPLEX.imag])
        u = dfx.diffeqsolve(real_terms, solver, T0, T1, 0.05, u0, saveat=saveat).ys
        return y, jax.lax.complex(u[:, :D], u[:, D:])

    # Holomorphic and not: with a real Brownian motion the Itô correction is that of real
    # noise, not of a complex one (whose correction vanishes for a holomorphic diffusion).
    for vf in _VFS_COMPLEX:
        with jax.numpy_dtype_promotion("strict"):
            y, expected = solve(vf)
        assert y.dtype == jnp.complex128
        np.testing.assert_allclose(y, expected, rtol=1e-10, atol=1e-11)
        assert np.max(np.abs(y[-1] - _Y0_COMPLEX)) > 0.1


@pytest.mark.filterwarnings("ignore:Complex dtype support in Diffrax")
@pytest.mark.standard_promotion
def test_diffrax_ito_milstein_on_complex_input_is_off_as_documented():
    # `ItoMilstein`'s docstring and docs/milstein.md: Diffrax's own solver run on the
    # complex SDE is off by about 1e-2 per step of size 0.1, with a real Brownian motion.
    dt, num = 0.1, 16
    y0 = _Y0_COMPLEX + 0.3 * jr.normal(jr.key(9), (num, D), jnp.complex128)
    dw = jr.normal(jr.key(10), (num, 2), jnp.float64) * jnp.sqrt(dt)

    @jax.jit
    @jax.vmap
    def offsets(y0, dw):
        out = []
        for vf in _VFS_COMPLEX:
            drift, diffusion = _real_system(vf, False)
            terms = dfx.MultiTerm(
                dfx.ODETerm(_drift_complex), dfx.ControlTerm(vf, _FixedIncrements(dw))
            )
            real_terms = dfx.MultiTerm(
                dfx.ODETerm(drift), dfx.ControlTerm(diffusion, _FixedIncrements(dw))
            )
            y1 = dfx.ItoMilstein().step(terms, 0.0, dt, y0, None, None, False)[0]
            u0 = jnp.concatenate([y0.real, y0.imag])
            u1 = dfx.ItoMilstein().step(real_terms, 0.0, dt, u0, None, None, False)[0]
            out.append(jnp.max(jnp.abs(y1 - (u1[:D] + 1j * u1[D:]))))
        return jnp.stack(out)

    median = np.median(np.asarray(offsets(y0, dw)), axis=0)  # one per vector field
    assert np.all((1e-3 < median) & (median < 1e-1)), median


@pytest.mark.slow  # 22 s on two idle cores; the complex single-step tests stay in the default run
@pytest.mark.filterwarnings("ignore:Complex dtype support in Diffrax")
def test_complex_diffeqsolve_against_real_system():
    # The same through `diffeqsolve` with a complex `VirtualBrownianTree`, whose real and
    # imaginary parts are independent with variance h/2 each (non-holomorphic diffusion,
    # so that the Itô correction of complex noise does not vanish).
    bm = dfx.VirtualBrownianTree(
        T0, T1, 2**-10, jax.ShapeDtypeStruct((2,), jnp.complex128), jr.key(4)
    )
    saveat = dfx.SaveAt(ts=jnp.linspace(T0, T1, 5))

    @jax.jit
    def solve():
        terms = dfx.MultiTerm(dfx.ODETerm(_drift_complex), dfx.ControlTerm(_vf_not_holomorphic, bm))
        y = dfx.diffeqsolve(terms, dl.ItoMilstein(), T0, T1, 0.05, _Y0_COMPLEX, saveat=saveat).ys
        drift, diffusion = _real_system(_vf_not_holomorphic, True)
        real_terms = dfx.MultiTerm(dfx.ODETerm(drift), dfx.ControlTerm(diffusion, _RealView(bm)))
        u0 = jnp.concatenate([_Y0_COMPLEX.real, _Y0_COMPLEX.imag])
        u = dfx.diffeqsolve(real_terms, dfx.ItoMilstein(), T0, T1, 0.05, u0, saveat=saveat).ys
        return y, jax.lax.complex(u[:, :D], u[:, D:])

    y, expected = solve()
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-13)
    assert np.max(np.abs(y[-1] - _Y0_COMPLEX)) > 0.1


def test_noise_structure_rejects_complex():
    terms = dfx.ControlTerm(_vf_holomorphic, _FixedIncrements(jnp.ones(2, jnp.complex128)))
    with pytest.raises(TypeError, match="noise_structure.*complex.*milstein_trace_term"):
        dl.noise_structure(terms, 0.0, _Y0_COMPLEX, None)
