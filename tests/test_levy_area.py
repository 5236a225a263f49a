"""The Lévy-area sampler: exact algebraic identities, moments against closed forms (with
fixed keys and tolerances of about four standard errors), consistency with the wrapped
`VirtualBrownianTree`, and Chen's relation on a grid against a direct loop."""

import math

import diffrax
import diffrax_linearize as dl
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest


def _samples(key, n, m, h, n_terms, method="mrongowius-roessler", dW=None):
    """`n` independent (increment, area) pairs; unconditional if `dW` is None."""
    k_w, k_a = jr.split(key)
    if dW is None:
        dWs = jnp.sqrt(h) * jr.normal(k_w, (n, m))
    else:
        dWs = jnp.broadcast_to(jnp.asarray(dW), (n, m))
    areas = jax.jit(jax.vmap(lambda k, w: dl.sample_levy_area(k, w, h, n_terms, method=method)))(
        jr.split(k_a, n), dWs
    )
    return np.asarray(dWs), np.asarray(areas)


def test_identities(getkey):
    m, h = 4, 0.3
    dW = jnp.sqrt(h) * jr.normal(getkey(), (m,))
    inc = dl.sample_iterated_integrals(getkey(), dW, h, 7)
    area, ito, strat = np.asarray(inc.A), np.asarray(inc.ito()), np.asarray(inc.stratonovich())
    w = np.asarray(dW)
    assert np.array_equal(area, -area.T)
    assert np.all(np.diag(area) == 0)
    off = ~np.eye(m, dtype=bool)
    # I_{j1 j2} + I_{j2 j1} = dW_{j1} dW_{j2} (j1 != j2), I_jj = (dW_j^2 - h) / 2.
    np.testing.assert_allclose((ito + ito.T)[off], np.outer(w, w)[off], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(np.diag(ito), (w**2 - h) / 2, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(strat, ito + 0.5 * h * np.eye(m), rtol=1e-13, atol=1e-15)
    # The area is not trivially zero or symmetric.
    assert np.abs(area[off]).min() > 0


@pytest.mark.parametrize("n_terms", [0, 3])
def test_unconditional_moments(getkey, n_terms):
    # Lévy's formula E[exp(iuA)] = 1 / cosh(uh / 2): Var A = h^2 / 4, E A^4 = 5 h^4 / 16.
    n, m, h = 200_000, 3, 0.5
    _, areas = _samples(getkey(), n, m, h, n_terms)
    pairs = areas[:, [0, 0, 1], [1, 2, 2]]  # A_12, A_13, A_23
    var = h**2 / 4
    se_mean = math.sqrt(var / n)
    assert np.all(np.abs(pairs.mean(0)) < 4 * se_mean)
    # Var of a sample variance: (kurtosis - 1) var^2 / n, kurtosis 5.
    np.testing.assert_allclose((pairs**2).mean(0), var, rtol=4 * math.sqrt(4 / n))
    # Different pairs are uncorrelated (but not independent).
    corr = np.corrcoef(pairs.T)
    assert np.all(np.abs(corr[np.triu_indices(3, 1)]) < 4 / math.sqrt(n))
    # The fourth moment sees the non-Gaussian part of the law: a Gaussian with the exact
    # conditional variance (n_terms=0) gives 3 E[v^2] = 13 h^4 / 48, 13% too small.
    fourth = (pairs**4).mean()
    exact = 5 * h**4 / 16
    rel_se = math.sqrt(1385 / 256 - 25 / 256) / (5 / 16) / math.sqrt(n)
    if n_terms == 0:
        np.testing.assert_allclose(fourth, 13 * h**4 / 48, rtol=4 * rel_se)
        assert abs(fourth / exact - 1) > 0.07
    else:
        np.testing.assert_allclose(fourth, exact, rtol=4 * rel_se)


@pytest.mark.parametrize(
    "method,n_terms,exact",
    [("mrongowius-roessler", 0, True), ("mrongowius-roessler", 5, True), ("fourier", 5, False)],
)
def test_conditional_covariance(getkey, method, n_terms, exact):
    # Given dW: Cov(A_ij, A_kl) = (h^2 / 24) Sigma with Sigma_(ij)(ij) = 2 + 2 (w_i^2 + w_j^2)
    # and Sigma_(12)(13) = 2 w_2 w_3, w = dW / sqrt(h). The tail correction makes this exact
    # for any number of terms; the bare Fourier series only keeps sum_{r <= p} 1 / r^2.
    n, m, h = 100_000, 3, 0.2
    dW = math.sqrt(h) * np.array([1.5, -0.5, 1.0])
    _, areas = _samples(getkey(), n, m, h, n_terms, method=method, dW=dW)
    a12, a13, a23 = areas[:, 0, 1], areas[:, 0, 2], areas[:, 1, 2]
    w = dW / math.sqrt(h)
    var12 = h**2 / 12 * (1 + w[0] ** 2 + w[1] ** 2)
    var23 = h**2 / 12 * (1 + w[1] ** 2 + w[2] ** 2)
    cov_12_13 = h**2 / 12 * w[1] * w[2]
    if not exact:
        kept = sum(1 / r**2 for r in range(1, n_terms + 1)) / (math.pi**2 / 6)
        var12, var23, cov_12_13 = kept * var12, kept * var23, kept * cov_12_13
    assert abs(a12.mean()) < 4 * math.sqrt(var12 / n)
    rtol = 4 * math.sqrt(2 / n) * 1.5  # near-Gaussian sample variances
    np.testing.assert_allclose(a12.var(), var12, rtol=rtol)
    np.testing.assert_allclose(a23.var(), var23, rtol=rtol)
    se_cov = math.sqrt(var12 * h**2 / 12 * (1 + w[0] ** 2 + w[2] ** 2) / n)
    assert abs(np.mean(a12 * a13) - cov_12_13) < 4 * se_cov
    if not exact:
        # ... which is measurably too small: 4 % for five terms.
        full = h**2 / 12 * (1 + w[0] ** 2 + w[1] ** 2)
        assert a12.var() < full * (1 - 10 * math.sqrt(2 / n))


@pytest.mark.slow
def test_tree_consistency_and_reproducibility(getkey):
    m = 3
    key = getkey()
    t0s = jnp.array([0.0, 0.25, 0.3, 0.1])
    t1s = jnp.array([0.1, 0.5, 0.3125, 0.2])

    @jax.jit
    def evaluate(path):
        def one(t0, t1):
            return (
                path.bm.evaluate(t0, t1),
                path.evaluate(t0, t1),
                path.evaluate(t0, t1, use_levy=True),
            )

        return jax.vmap(one)(t0s, t1s)

    def make(key, path_key=None):
        bm = diffrax.VirtualBrownianTree(0.0, 1.0, tol=1e-3, shape=(m,), key=key)
        return dl.LevyAreaBrownianPath(bm, dt=0.1, key=path_key)

    path = make(key)
    assert path.n_terms == dl.levy_area_n_terms(m, 0.1)
    w_tree, w_path, inc = evaluate(path)
    assert isinstance(inc, dl.IteratedIntegrals)
    # The increments are the tree's own, with or without the area.
    assert np.array_equal(w_path, w_tree)
    assert np.array_equal(inc.W, w_tree)
    np.testing.assert_allclose(inc.dt, t1s - t0s, rtol=1e-15)
    # Reproducible from the key: a rebuilt path gives the same areas, and so does an
    # un-jitted call.
    _, _, again = evaluate(make(key))
    assert np.array_equal(inc.A, again.A)
    eager = path.evaluate(t0s[1], t1s[1], use_levy=True)
    np.testing.assert_allclose(eager.A, inc.A[1], rtol=1e-14, atol=1e-16)
    # Different steps, or another key, give different areas.
    areas = np.asarray(inc.A)
    assert not np.allclose(areas[0], areas[3])
    _, _, other = evaluate(make(key, getkey()))
    assert np.array_equal(other.W, inc.W) and not np.allclose(other.A, inc.A)
    # `t1=None` is the increment from the start of the path, as for diffrax.
    t = jnp.array(0.5)
    assert np.array_equal(path.evaluate(t), path.bm.evaluate(t))
    assert np.array_equal(
        path.evaluate(t, use_levy=True).A, path.evaluate(jnp.array(0.0), t, use_levy=True).A
    )


def test_tree_joint_law(getkey):
    # Through the tree: (dW, A) over [0, h] has Var dW = h, Var A_12 = h^2 / 4, and the
    # area's conditional variance grows with dW as it should.
    n, m, h = 20_000, 2, 0.5

    def one(key):
        bm = diffrax.VirtualBrownianTree(0.0, 1.0, tol=0.25, shape=(m,), key=key)
        return dl.LevyAreaBrownianPath(bm, n_terms=4).evaluate(0.0, h, use_levy=True)

    inc = jax.jit(jax.vmap(one))(jr.split(getkey(), n))
    a12, w1 = np.asarray(inc.A[:, 0, 1]), np.asarray(inc.W[:, 0])
    np.testing.assert_allclose(np.var(w1), h, rtol=4 * math.sqrt(2 / n))
    np.testing.assert_allclose(np.mean(a12**2), h**2 / 4, rtol=4 * math.sqrt(4 / n))
    # E[A^2 w1^2] = E[(h^2/12)(1 + (w1^2 + w2^2)/h) w1^2] = h^3/12 (1 + 3 + 1) = 5 h^3 / 12.
    np.testing.assert_allclose(np.mean(a12**2 * w1**2), 5 * h**3 / 12, rtol=0.12)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_strict_dtype_promotion(getkey, dtype):
    # Under `jax_numpy_dtype_promotion="strict"` (Diffrax's, Lineax's and Optimistix's
    # test suites run so), the same areas as under the standard rules: the step's key came
    # from `jnp.promote_types(dtype, float32)`, which raised for float64 there.
    shape = jax.ShapeDtypeStruct((2,), dtype)
    bm = diffrax.VirtualBrownianTree(0.0, 1.0, tol=0.25, shape=shape, key=getkey())
    levy = dl.LevyAreaBrownianPath(bm, n_terms=3)
    standard = levy.evaluate(0.1, 0.6, use_levy=True)
    with jax.numpy_dtype_promotion("strict"):
        strict = levy.evaluate(0.1, 0.6, use_levy=True)
    assert strict.A.dtype == dtype
    np.testing.assert_array_equal(strict.A, standard.A)
    np.testing.assert_array_equal(strict.W, standard.W)


@pytest.mark.slow
def test_grid_path_chen(getkey):
    # Against a direct loop over iterated Itô integrals:
    # I[s, u] = I[s, t] + I[t, u] + dW[s, t] (x) dW[t, u].
    m, n, h = 3, 12, 0.05
    ts = jnp.arange(n + 1.0) * h
    dW = jnp.sqrt(h) * jr.normal(getkey(), (n, m))
    areas = jax.vmap(lambda k, w: dl.sample_levy_area(k, w, h, 3))(jr.split(getkey(), n), dW)
    path = dl.GridLevyAreaPath(ts, dW, areas)
    pairs = [(0, 1), (0, n), (3, 7), (5, 6), (2, 11)]
    i_s, j_s = jnp.array([p[0] for p in pairs]), jnp.array([p[1] for p in pairs])
    evaluate = jax.jit(
        jax.vmap(lambda a, b: (path.evaluate(a, b), path.evaluate(a, b, use_levy=True)))
    )
    w_only, incs = evaluate(ts[i_s], ts[j_s])
    for q, (i, j) in enumerate(pairs):
        w = np.zeros(m)
        ito = np.zeros((m, m))
        for k in range(i, j):
            w_k, a_k = np.asarray(dW[k]), np.asarray(areas[k])
            step_ito = 0.5 * (np.outer(w_k, w_k) - h * np.eye(m)) + a_k
            ito = ito + step_ito + np.outer(w, w_k)
            w = w + w_k
        np.testing.assert_allclose(incs.W[q], w, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(incs.dt[q], (j - i) * h, rtol=1e-12)
        step = dl.IteratedIntegrals(dt=incs.dt[q], W=incs.W[q], A=incs.A[q])
        np.testing.assert_allclose(step.ito(), ito, rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(w_only[q], w, rtol=1e-12, atol=1e-14)
    # from_path keeps exactly the wrapped path's increments and areas.
    bm = diffrax.VirtualBrownianTree(0.0, 1.0, tol=1e-3, shape=(m,), key=getkey())
    levy = dl.LevyAreaBrownianPath(bm, n_terms=2)
    grid = dl.GridLevyAreaPath.from_path(levy, ts)
    direct = levy.evaluate(ts[3], ts[4], use_levy=True)
    inc = jax.jit(lambda g: g.evaluate(ts[3], ts[4], use_levy=True))(grid)
    np.testing.assert_allclose(inc.W, direct.W, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(inc.A, direct.A, rtol=1e-9, atol=1e-14)
    with pytest.raises(Exception, match="grid points"):
        jax.block_until_ready(path.evaluate(ts[0], 0.5 * (ts[1] + ts[2])))


def test_n_terms_rule():
    # sqrt(m) h / (sqrt(12) pi p) <= h^{3/2}, and p grows like 1 / sqrt(h).
    for m, h in [(2, 0.1), (10, 1e-3), (100, 1e-4)]:
        p = dl.levy_area_n_terms(m, h)
        assert math.sqrt(m) * h / (math.sqrt(12) * math.pi * p) <= h**1.5
        assert p == 1 or math.sqrt(m) * h / (math.sqrt(12) * math.pi * (p - 1)) > h**1.5
    assert dl.levy_area_n_terms(100, 1e-4) == 92


def test_errors(getkey):
    with pytest.raises(ValueError, match="shape `\\(m,\\)`"):
        dl.sample_levy_area(getkey(), jnp.zeros((2, 2)), 0.1, 3)
    with pytest.raises(ValueError, match="n_terms"):
        dl.sample_levy_area(getkey(), jnp.zeros(2), 0.1, 0, method="fourier")
    with pytest.raises(ValueError, match="method"):
        dl.sample_levy_area(getkey(), jnp.zeros(2), 0.1, 3, method="wiktorsson")  # type: ignore
    bm = diffrax.VirtualBrownianTree(0.0, 1.0, tol=1e-3, shape=(2,), key=getkey())
    with pytest.raises(ValueError, match="exactly one"):
        dl.LevyAreaBrownianPath(bm)
    bm_h = diffrax.VirtualBrownianTree(
        0.0, 1.0, tol=1e-3, shape=(2,), key=getkey(), levy_area=diffrax.SpaceTimeLevyArea
    )
    with pytest.raises(ValueError, match="BrownianIncrement"):
        dl.LevyAreaBrownianPath(bm_h, n_terms=3)
    bm_2d = diffrax.VirtualBrownianTree(0.0, 1.0, tol=1e-3, shape=(2, 2), key=getkey())
    with pytest.raises(ValueError, match="shape `\\(m,\\)`"):
        dl.LevyAreaBrownianPath(bm_2d, n_terms=3)
