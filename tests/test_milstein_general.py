"""The general-noise Milstein solvers: one step against a dense `jax.jacfwd` reference,
the same result as diffrax's Milstein on commutative noise (same Brownian path), the exact
Itô/Stratonovich drift correspondence, and a fitted strong order on non-commutative noise
against a fine-step reference driven by the same iterated integrals."""

import diffrax
import diffrax_linearize as dl
import jax
import jax.numpy as jnp
import jax.random as jr
import lineax as lx
import numpy as np
import pytest


def _linear_noise(key, d, m, scale):
    return scale * jr.normal(key, (m, d, d)) / jnp.sqrt(d)


def _terms(f, g, path):
    return diffrax.MultiTerm(diffrax.ODETerm(f), diffrax.ControlTerm(g, path))


def _grid_path(key, ts, m, n_terms=3):
    k_w, k_a = jr.split(key)
    h = ts[1] - ts[0]
    n = ts.shape[0] - 1
    dW = jnp.sqrt(h) * jr.normal(k_w, (n, m))
    areas = jax.vmap(lambda k, w: dl.sample_levy_area(k, w, h, n_terms))(jr.split(k_a, n), dW)
    return dl.GridLevyAreaPath(ts, dW, areas)


@pytest.mark.parametrize("ito", [pytest.param(True, marks=pytest.mark.slow), False])
def test_step_against_dense_reference(getkey, ito):
    # A nonlinear diffusion with a dense derivative; the double sum from `jax.jacfwd` and
    # explicit loops over j1, j2.
    d, m = 3, 4
    w1 = jr.normal(getkey(), (d * m, d))
    b = jr.normal(getkey(), (d * m,))

    def g(t, y, args):
        return jnp.tanh(w1 @ y + b).reshape(d, m) * (1 + 0.1 * t)

    def f(t, y, args):
        return -y + jnp.sin(y)

    ts = jnp.array([0.0, 0.1])
    path = _grid_path(getkey(), ts, m)
    y0 = jr.normal(getkey(), (d,))
    inc = path.evaluate(ts[0], ts[1], use_levy=True)
    integrals = np.asarray(inc.ito() if ito else inc.stratonovich())
    g0 = np.asarray(g(0.0, y0, None))
    dg = np.asarray(jax.jacfwd(lambda y: g(0.0, y, None))(y0))  # (d, m, d)
    expected = np.asarray(y0 + 0.1 * f(0.0, y0, None)) + g0 @ np.asarray(inc.W)
    for j1 in range(m):
        for j2 in range(m):
            l_g = dg[:, j2, :] @ g0[:, j1]  # L^{j1} g_{:, j2}
            expected = expected + l_g * integrals[j1, j2]

    cls = dl.GeneralItoMilstein if ito else dl.GeneralStratonovichMilstein
    terms = _terms(f, g, path)
    for method in ("contract", "jvp", "auto"):
        y1, *_ = cls(method=method).step(terms, ts[0], ts[1], y0, None, None, False)
        np.testing.assert_allclose(y1, expected, rtol=1e-12, atol=1e-13)
    # A diffusion returning a lineax operator goes through `prod` (`mv`) the same way.
    terms_lx = _terms(f, lambda t, y, a: lx.MatrixLinearOperator(g(t, y, a)), path)
    for method in ("contract", "jvp"):
        y1, *_ = cls(method=method).step(terms_lx, ts[0], ts[1], y0, None, None, False)
        np.testing.assert_allclose(y1, expected, rtol=1e-12, atol=1e-13)


@pytest.mark.slow
@pytest.mark.parametrize("ito", [True, False])
def test_commutative_noise_matches_diffrax(getkey, ito):
    # Diagonal noise commutes: the (antisymmetric) Lévy area drops out, and the step is
    # diffrax's own Milstein on the same `VirtualBrownianTree`.
    d = 3
    sigma = jnp.array([0.5, 0.3, 0.8])

    def g(t, y, args):
        return jnp.diag(sigma * jnp.sin(y) + 0.2)

    def f(t, y, args):
        return -0.5 * y

    bm = diffrax.VirtualBrownianTree(0.0, 1.0, tol=2**-6, shape=(d,), key=getkey())
    terms = _terms(f, g, dl.LevyAreaBrownianPath(bm, dt=0.05))
    y0 = jnp.array([1.0, 0.5, -0.3])
    ours = dl.GeneralItoMilstein() if ito else dl.GeneralStratonovichMilstein()
    theirs = diffrax.ItoMilstein() if ito else diffrax.StratonovichMilstein()
    saveat = diffrax.SaveAt(ts=jnp.linspace(0, 1, 5))
    sol = diffrax.diffeqsolve(terms, ours, 0.0, 1.0, 0.05, y0, saveat=saveat)
    ref = diffrax.diffeqsolve(terms, theirs, 0.0, 1.0, 0.05, y0, saveat=saveat)
    np.testing.assert_allclose(sol.ys, ref.ys, rtol=1e-12, atol=1e-12)
    assert np.abs(np.asarray(sol.ys[-1] - y0)).min() > 1e-3  # the solve went somewhere


@pytest.mark.slow
def test_ito_stratonovich_correspondence(getkey):
    # For g(y)_{:, j} = A_j y, the Stratonovich step with drift f is the Itô step with
    # drift f + (1/2) sum_j A_j A_j y, step by step (J = I + h delta / 2).
    d, m = 3, 2
    a = _linear_noise(getkey(), d, m, 0.6)
    drift = jr.normal(getkey(), (d, d)) * 0.3

    def g(t, y, args):
        return jnp.einsum("jik,k->ij", a, y)

    correction = 0.5 * jnp.einsum("jik,jkl->il", a, a)
    bm = diffrax.VirtualBrownianTree(0.0, 1.0, tol=2**-6, shape=(m,), key=getkey())
    path = dl.LevyAreaBrownianPath(bm, dt=0.0625)
    y0 = jnp.ones(d)
    strat = diffrax.diffeqsolve(
        _terms(lambda t, y, _: drift @ y, g, path),
        dl.GeneralStratonovichMilstein(),
        0.0,
        1.0,
        0.0625,
        y0,
    )
    ito = diffrax.diffeqsolve(
        _terms(lambda t, y, _: (drift + correction) @ y, g, path),
        dl.GeneralItoMilstein(),
        0.0,
        1.0,
        0.0625,
        y0,
    )
    np.testing.assert_allclose(strat.ys, ito.ys, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_strong_order_non_commutative(getkey):
    # dy = B y dt + sum_j A_j y dW_j with non-commuting A_j (d = m = 2). Each path is
    # sampled on a fine grid of 2^11 steps (increments and areas); coarse steps see the
    # same path's iterated integrals through Chen's relation (`GridLevyAreaPath`), and the
    # reference is the same solver on the fine grid.
    m, n_paths, n_fine = 2, 200, 2**11
    a = jnp.stack([jnp.array([[0.3, 0.6], [0.0, 0.2]]), jnp.array([[0.2, 0.0], [-0.6, 0.3]])])
    assert float(jnp.abs(a[0] @ a[1] - a[1] @ a[0]).max()) > 0.3
    b = jnp.array([[-0.5, 0.2], [0.1, -0.3]])
    y0 = jnp.array([1.0, 1.0])
    ts = jnp.linspace(0.0, 1.0, n_fine + 1)
    paths = jax.jit(jax.vmap(lambda k: _grid_path(k, ts, m, n_terms=4)))(
        jr.split(getkey(), n_paths)
    )

    def g(t, y, args):
        return jnp.einsum("jik,k->ij", a, y)

    def solve_all(solver, dt):
        # dt is a power of two, so the step times are exact grid points.
        def solve(path):
            sol = diffrax.diffeqsolve(
                _terms(lambda t, y, _: b @ y, g, path),
                solver,
                0.0,
                1.0,
                dt,
                y0,
                saveat=diffrax.SaveAt(t1=True),
                max_steps=n_fine,
            )
            return sol.ys[-1]

        return jax.vmap(solve)(paths)

    solve_all = jax.jit(solve_all, static_argnums=0)
    reference = solve_all(dl.GeneralItoMilstein(), jnp.asarray(1.0 / n_fine))
    steps = [2.0**-k for k in range(2, 8)]

    def slope(solver):
        errors = [
            float(
                jnp.sqrt(
                    jnp.mean(jnp.sum((solve_all(solver, jnp.asarray(h)) - reference) ** 2, -1))
                )
            )
            for h in steps
        ]
        return np.polyfit(np.log(steps), np.log(errors), 1)[0], errors

    order, errors = slope(dl.GeneralItoMilstein())
    assert order >= 0.9, (order, errors)
    assert errors[-1] < 0.01  # and not just a slope: the coarse solutions do converge
    # Controls: without the Lévy areas the same problem converges with order 0.5.
    order_em, _ = slope(diffrax.Euler())
    order_commutative, errors_commutative = slope(dl.ItoMilstein())
    assert 0.35 < order_em < 0.7
    assert 0.35 < order_commutative < 0.7
    assert errors_commutative[-1] > 4 * errors[-1]


def test_errors(getkey):
    bm = diffrax.VirtualBrownianTree(0.0, 1.0, tol=2**-6, shape=(2,), key=getkey())
    terms = _terms(lambda t, y, _: -y, lambda t, y, _: jnp.diag(y), bm)
    with pytest.raises(Exception, match="LevyAreaBrownianPath"):
        diffrax.diffeqsolve(terms, dl.GeneralItoMilstein(), 0.0, 1.0, 0.1, jnp.ones(2))
    with pytest.raises(ValueError, match="should not be used to solve ODEs"):
        dl.GeneralStratonovichMilstein().order(terms)


def test_method_checked_at_construction():
    for cls in (dl.GeneralItoMilstein, dl.GeneralStratonovichMilstein):
        with pytest.raises(ValueError, match=rf"{cls.__name__}\(method=\.\.\.\)` must be one"):
            cls(method="dense")  # pyright: ignore
        for method in ("auto", "contract", "jvp"):
            assert cls(method=method).method == method


@pytest.mark.parametrize(
    "controller",
    [diffrax.PIDController(rtol=1e-3, atol=1e-3), diffrax.ConstantStepSize()],
    ids=["pid", "constant"],
)
@pytest.mark.parametrize(
    "cls",
    # The check is shared code: the second class is slow (each case compiles a solve).
    [dl.GeneralItoMilstein, pytest.param(dl.GeneralStratonovichMilstein, marks=pytest.mark.slow)],
)
def test_half_solver_rejected(getkey, cls, controller):
    # Documented as fixed-step only: `HalfSolver` used to run silently with a PID controller.
    bm = dl.LevyAreaBrownianPath(
        diffrax.VirtualBrownianTree(0.0, 1.0, tol=2**-8, shape=(2,), key=getkey()), dt=0.1
    )
    terms = _terms(lambda t, y, _: -y, lambda t, y, _: jnp.stack([y, y[::-1] ** 2], 1), bm)
    solve = lambda solver: diffrax.diffeqsolve(
        terms, solver, 0.0, 1.0, 0.1, jnp.ones(2), stepsize_controller=controller
    )
    with pytest.raises(ValueError, match=rf"HalfSolver\(diffrax_linearize\.{cls.__name__}\(\)\)"):
        solve(diffrax.HalfSolver(cls()))
    if isinstance(controller, diffrax.ConstantStepSize):
        solve(cls())  # unwrapped, fixed steps: fine


_C_GENERAL = jnp.asarray(np.random.default_rng(0).normal(size=(3, 3, 2)) * 0.3 + 0j)


def _general_complex(t, y, args):
    # Non-commuting complex linear noise, applied to a complex state.
    return jnp.stack([_C_GENERAL[:, :, j] @ y for j in range(2)], axis=1)


def _general_real(t, u, args):
    # The same SDE on (Re y, Im y); `diffrax.ControlTerm` applies `conj(vf) @ dw`.
    g = jnp.conj(_general_complex(t, jax.lax.complex(u[:3], u[3:]), args))
    return jnp.concatenate([g.real, g.imag])


@pytest.mark.filterwarnings("ignore:Complex dtype support in Diffrax")
@pytest.mark.parametrize(
    "solver",
    [dl.GeneralItoMilstein(), dl.GeneralStratonovichMilstein()],
    ids=lambda s: type(s).__name__,
)
def test_complex_state_real_noise(solver):
    # A complex state driven by a real Brownian motion, under JAX's strict promotion: the
    # solve against the same solver on the equivalent real SDE, on the same path. (The
    # default `method="auto"` materialised the diffusion's derivative, which takes real
    # states only, and raised; a complex state now takes the JVPs.)
    bm = diffrax.VirtualBrownianTree(0.0, 1.0, 2**-8, (2,), jr.key(1))
    path = dl.LevyAreaBrownianPath(bm, dt=0.05)
    y0 = jnp.array([0.5 + 0.2j, -0.3 + 0.1j, 0.8 - 0.4j])

    def drift(t, y, args):
        return -0.5 * y

    def solve(vf, y0):
        terms = diffrax.MultiTerm(diffrax.ODETerm(drift), diffrax.ControlTerm(vf, path))
        return diffrax.diffeqsolve(terms, solver, 0.0, 1.0, 0.05, y0).ys[-1]

    with jax.numpy_dtype_promotion("strict"):
        y = solve(_general_complex, y0)
        u = solve(_general_real, jnp.concatenate([y0.real, y0.imag]))
    np.testing.assert_allclose(y, jax.lax.complex(u[:3], u[3:]), rtol=1e-12, atol=1e-13)
    assert np.max(np.abs(y - y0)) > 0.1
    contract = type(solver)(method="contract")
    with pytest.raises(ValueError, match="method='jvp'"):
        diffrax.diffeqsolve(
            diffrax.MultiTerm(diffrax.ODETerm(drift), diffrax.ControlTerm(_general_complex, path)),
            contract, 0.0, 1.0, 0.05, y0,
        )  # fmt: skip
