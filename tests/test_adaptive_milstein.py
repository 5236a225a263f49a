"""Adaptive step sizes for the Milstein solvers through their embedded error estimate.

References: a fine fixed-step solve on the same Brownian path (for the local error the
estimate should track, and for adaptive solutions), the exact solution of geometric
Brownian motion (for the strong order over tolerances), Diffrax's own
`StratonovichMilstein` (for fixed steps staying bit for bit what they were), and
`diffrax.RecursiveCheckpointAdjoint` (for backsolve gradients).
"""

import jax


jax.config.update("jax_enable_x64", True)

import diffrax as dfx
import diffrax_linearize as dl
import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optimistix as optx
import pytest


MU, SIGMA = 0.5, 0.8
_G = jnp.array([[0.3, -0.2], [0.1, 0.4]])


def _drift(t, y, args):
    return -y + jnp.sin(4 * t)


def _diag(t, y, args):
    # Diagonal (commutative) noise, nonlinear, with a volatility spike near t = 0.5.
    return jnp.diag((0.3 + jnp.exp(-50 * (t - 0.5) ** 2)) * jnp.sin(y + 1.0))


def _noncommuting(t, y, args):
    return (
        jnp.sin(y)[:, None] * _G.astype(y.dtype)
        + 0.2 * jnp.eye(2, dtype=y.dtype) * y[::-1][:, None]
    )


# name -> (solver, diffusion, Lévy areas needed)
SOLVERS = {
    "ItoMilstein": (dl.ItoMilstein(), _diag, False),
    "StratonovichMilstein": (dl.StratonovichMilstein(), _diag, False),
    "GeneralItoMilstein": (dl.GeneralItoMilstein(), _noncommuting, True),
    "GeneralStratonovichMilstein": (dl.GeneralStratonovichMilstein(), _noncommuting, True),
    "ImplicitItoMilstein": (dl.ImplicitItoMilstein(), _diag, False),
    "ImplicitStratonovichMilstein": (dl.ImplicitStratonovichMilstein(theta=0.5), _diag, False),
    "ImplicitItoMilstein_general": (
        dl.ImplicitItoMilstein(general_noise=True),
        _noncommuting,
        True,
    ),
    "ImplicitEulerMaruyama": (dl.ImplicitEulerMaruyama(), _diag, False),
}
_Y0 = jnp.array([1.0, -0.5])


def _terms(vf, key, levy, dtype=jnp.float64, t1=1.0, tol=2**-12):
    shape = jax.ShapeDtypeStruct((2,), dtype)
    bm = dfx.VirtualBrownianTree(0.0, t1, tol=tol, shape=shape, key=key)
    path = dl.LevyAreaBrownianPath(bm, dt=0.1) if levy else bm
    return dfx.MultiTerm(dfx.ODETerm(_drift), dfx.ControlTerm(vf, path)), bm


# Two cheap cases by default (one per dtype); every solver in both dtypes under slow.
_PID_CASES = [
    pytest.param(
        name,
        dtype,
        id=f"{name}-{np.dtype(dtype).name}",
        marks=()
        if (name, dtype) in {("ItoMilstein", jnp.float64), ("StratonovichMilstein", jnp.float32)}
        else pytest.mark.slow,
    )
    for name in SOLVERS
    for dtype in (jnp.float64, jnp.float32)
]


@pytest.mark.parametrize("name,dtype", _PID_CASES)
def test_pid_controller_runs_and_converges(name, dtype):
    # `PIDController` with the solver unwrapped, jitted and vmapped over Brownian paths:
    # the adaptive solution is close to a fine fixed-step solution on the same path, and
    # a tighter tolerance takes more steps.
    solver, vf, levy = SOLVERS[name]
    eps = 1e-4 if dtype == jnp.float32 else 1e-9

    @jax.jit
    @jax.vmap
    def solve(key, rtol):
        terms, _ = _terms(vf, key, levy, dtype)
        y0 = _Y0.astype(dtype)
        t0, t1 = jnp.asarray(0.0, dtype), jnp.asarray(1.0, dtype)
        adaptive = dfx.diffeqsolve(
            terms,
            solver,
            t0,
            t1,
            None,
            y0,
            stepsize_controller=dfx.PIDController(rtol=rtol, atol=rtol, dtmax=0.1),
            max_steps=2**12,
        )
        fine = dfx.diffeqsolve(terms, solver, t0, t1, 2**-9, y0, max_steps=2**10)
        return adaptive.ys[-1], fine.ys[-1], adaptive.stats["num_accepted_steps"]

    keys = jr.split(jr.key(0), 4)
    loose, fine, n_loose = solve(keys, jnp.full(4, 1e-2, dtype))
    tight, _, n_tight = solve(keys, jnp.full(4, 1e-3, dtype))
    assert loose.dtype == dtype
    assert np.all(np.isfinite(tight))
    assert np.all(n_tight > n_loose)
    err_loose = np.sqrt(np.mean((loose - fine) ** 2))
    err_tight = np.sqrt(np.mean((tight - fine) ** 2))
    assert err_tight < 0.1 + eps
    assert err_tight < err_loose


def _one_step_errors(solver, vf, levy, n=48):
    """For `n` random (h, y0, path): the norm of the step's error estimate, and of its
    true local error against a fine solve (256 steps of the same solver) from the same
    state on the same Brownian path."""

    @jax.jit
    @jax.vmap
    def one(key):
        k1, k2, k3 = jr.split(key, 3)
        h = jnp.exp(jr.uniform(k1, minval=jnp.log(0.01), maxval=jnp.log(0.3)))
        y0 = _Y0 + 0.5 * jr.normal(k2, (2,))
        terms, _ = _terms(vf, k3, levy, t1=0.3, tol=2**-16)
        y1, y_error, *_ = solver.step(terms, 0.0, h, y0, None, None, False)
        fine = dfx.diffeqsolve(terms, solver, 0.0, h, h / 256, y0, max_steps=300).ys[-1]
        return jnp.linalg.norm(y_error), jnp.linalg.norm(y1 - fine)

    return [np.asarray(x) for x in one(jr.split(jr.key(1), n))]


@pytest.mark.parametrize(
    "name",
    [
        "ItoMilstein",
        pytest.param("StratonovichMilstein", marks=pytest.mark.slow),
        pytest.param("GeneralItoMilstein", marks=pytest.mark.slow),
        pytest.param("ImplicitItoMilstein", marks=pytest.mark.slow),
    ],
)
def test_estimate_tracks_true_local_error(name):
    solver, vf, levy = SOLVERS[name]
    estimate, true = _one_step_errors(solver, vf, levy)
    corr = np.corrcoef(np.log(estimate), np.log(true))[0, 1]
    ratio = np.median(estimate / true)
    assert corr > 0.6, corr
    assert 0.2 < ratio < 5, ratio


def _gbm_errors(solver, rtols, n_paths):
    """RMS error at T = 1 against the exact solution of geometric Brownian motion, and
    the mean number of accepted steps, for each tolerance."""

    @jax.jit
    @jax.vmap
    def solve(key, rtol):
        bm = dfx.VirtualBrownianTree(0.0, 1.0, tol=2**-16, shape=(1,), key=key)
        terms = dfx.MultiTerm(
            dfx.ODETerm(lambda t, y, a: MU * y),
            dfx.ControlTerm(lambda t, y, a: SIGMA * y[:, None], bm),
        )
        sol = dfx.diffeqsolve(
            terms,
            solver,
            0.0,
            1.0,
            None,
            jnp.ones(1),
            stepsize_controller=dfx.PIDController(rtol=rtol, atol=rtol),
            max_steps=2**14,
        )
        w = bm.evaluate(0.0, 1.0)
        if isinstance(solver, dfx.AbstractItoSolver):
            exact = jnp.exp((MU - 0.5 * SIGMA**2) + SIGMA * w)
        else:
            exact = jnp.exp(MU + SIGMA * w)
        return sol.ys[-1] - exact, sol.stats["num_accepted_steps"]

    keys = jr.split(jr.key(2), n_paths)
    errs, steps = [], []
    for rtol in rtols:
        e, n = solve(keys, jnp.full(n_paths, rtol))
        errs.append(np.sqrt(np.mean(np.asarray(e) ** 2)))
        steps.append(np.mean(np.asarray(n)))
    return np.array(errs), np.array(steps)


def _fitted_order(errs, steps):
    # error ~ (mean step size)^order = (T / steps)^order
    return -np.polyfit(np.log(steps), np.log(errs), 1)[0]


def test_strong_order_over_tolerances_small():
    errs, steps = _gbm_errors(dl.ItoMilstein(), [1e-3, 1e-4, 1e-5], 64)
    order = _fitted_order(errs, steps)
    assert np.all(np.diff(steps) > 0)
    assert 0.8 < order < 1.2, (order, errs, steps)


@pytest.mark.slow
@pytest.mark.parametrize(
    "solver",
    [dl.ItoMilstein(), dl.StratonovichMilstein(), dl.ImplicitItoMilstein()],
    ids=["ito", "stratonovich", "implicit_ito"],
)
def test_strong_order_over_tolerances(solver):
    errs, steps = _gbm_errors(solver, [1e-3, 3e-4, 1e-4, 3e-5, 1e-5], 256)
    order = _fitted_order(errs, steps)
    assert 0.9 < order < 1.1, (order, errs, steps)


def test_fixed_steps_bit_identical_to_diffrax():
    # The Stratonovich step is the same JVP as Diffrax's, so fixed-step solves agree bit
    # for bit: computing the error estimate (dropped under `ConstantStepSize`) changes
    # nothing in the solution.
    terms, _ = _terms(_diag, jr.key(3), False)
    saveat = dfx.SaveAt(ts=jnp.linspace(0.0, 1.0, 11))
    solve = jax.jit(
        lambda solver: dfx.diffeqsolve(terms, solver, 0.0, 1.0, 0.05, _Y0, saveat=saveat).ys
    )
    ours = solve(dl.StratonovichMilstein())
    theirs = solve(dfx.StratonovichMilstein())
    np.testing.assert_array_equal(ours, theirs)
    assert not np.allclose(ours[-1], _Y0)


def test_error_order_and_adaptive_marker():
    terms, _ = _terms(_diag, jr.key(0), False)
    for name, (solver, _, _) in SOLVERS.items():
        assert isinstance(solver, dfx.AbstractAdaptiveSolver), name
        expected = 1.0 if name == "ImplicitEulerMaruyama" else 1.5
        assert solver.error_order(terms) == expected, name


def test_unsafe_brownian_path_refused_with_adaptive_steps():
    bm = dfx.UnsafeBrownianPath(shape=(2,), key=jr.key(0))
    terms = dfx.MultiTerm(dfx.ODETerm(_drift), dfx.ControlTerm(_diag, bm))
    with pytest.raises(ValueError, match="UnsafeBrownianPath"):
        dfx.diffeqsolve(
            terms,
            dl.ItoMilstein(),
            0.0,
            1.0,
            None,
            _Y0,
            stepsize_controller=dfx.PIDController(rtol=1e-3, atol=1e-3),
        )


@pytest.mark.parametrize("cls", [dl.GeneralItoMilstein, dl.GeneralStratonovichMilstein])
def test_half_solver_still_rejected_and_names_the_fix(cls):
    terms, _ = _terms(_noncommuting, jr.key(0), True)
    with pytest.raises(ValueError, match="PIDController"):
        dfx.diffeqsolve(
            terms,
            dfx.HalfSolver(cls()),
            0.0,
            1.0,
            0.1,
            _Y0,
            stepsize_controller=dfx.PIDController(rtol=1e-3, atol=1e-3),
        )


def test_estimate_is_zero_where_the_step_is_exact():
    # Additive constant noise and a constant drift: Milstein is exact, and so is the
    # trapezoidal step; the estimate is zero (a check that no O(h) term is left over).
    terms = dfx.MultiTerm(
        dfx.ODETerm(lambda t, y, a: jnp.ones_like(y)),
        dfx.ControlTerm(
            lambda t, y, a: _G, dfx.VirtualBrownianTree(0.0, 1.0, 1e-3, (2,), jr.key(0))
        ),
    )
    for solver in (dl.ItoMilstein(), dl.StratonovichMilstein(), dl.ImplicitItoMilstein()):
        _, y_error, *_ = solver.step(terms, 0.0, 0.3, _Y0, None, None, False)
        np.testing.assert_allclose(y_error, 0.0, atol=1e-14)
    # Linear noise: the estimate is not zero (the triple term), and scales like h^1.5.
    terms = dfx.MultiTerm(
        dfx.ODETerm(lambda t, y, a: jnp.zeros_like(y)),
        dfx.ControlTerm(lambda t, y, a: jnp.diag(y), _FixedIncrement(jnp.array([1.0, -1.0]))),
    )
    sizes = []
    for h in (0.01, 0.04):
        scaled = eqx.tree_at(lambda t: t.terms[1].control.dw, terms, jnp.sqrt(h) * jnp.ones(2))
        _, y_error, *_ = dl.StratonovichMilstein().step(scaled, 0.0, h, _Y0, None, None, False)
        sizes.append(np.linalg.norm(y_error))
    np.testing.assert_allclose(sizes[1] / sizes[0], 4**1.5, rtol=0.05)


class _FixedIncrement(dfx.AbstractPath):
    dw: jax.Array
    t0 = -jnp.inf
    t1 = jnp.inf

    def evaluate(self, t0, t1=None, left=True):
        return self.dw


#
# Backsolve adjoint and ensembles with adaptive steps
#


def _param_terms(key):
    # The parameters (mu, sigma) are `args`.
    bm = dfx.VirtualBrownianTree(0.0, 1.0, tol=2**-12, shape=(2,), key=key)
    return dfx.MultiTerm(
        dfx.ODETerm(lambda t, y, a: a[0] * jnp.sin(y) - 0.3 * y),
        dfx.ControlTerm(lambda t, y, a: a[1] * jnp.diag(jnp.cos(y)), bm),
    )


@pytest.mark.slow  # about two minutes on the 2-core machine
@pytest.mark.parametrize(
    "solver", [dl.ItoMilstein(), dl.StratonovichMilstein()], ids=["ito", "stratonovich"]
)
def test_backsolve_adjoint_with_pid_controller(solver):
    # The forward and the backward solves each adapt on their own (the backward pass
    # runs `diffrax.diffeqsolve` with the same `PIDController`). The gradients are those
    # of the continuous solution to the tolerance, so they agree with checkpointing
    # through the adaptive forward solve to about the tolerance.
    key = jr.key(5)
    controller = dfx.PIDController(rtol=1e-5, atol=1e-5)

    def loss(params, adjoint):
        sol = dfx.diffeqsolve(
            _param_terms(key),
            solver,
            0.0,
            1.0,
            None,
            _Y0,
            params,
            stepsize_controller=controller,
            adjoint=adjoint,
            max_steps=2**13,
        )
        return jnp.sum(sol.ys[-1] ** 2)

    params = (jnp.array(0.7), jnp.array(0.4))
    grad = lambda adjoint: jax.jit(jax.grad(lambda p: loss(p, adjoint)))(params)
    ours = grad(dl.BacksolveAdjoint())
    ref = grad(dfx.RecursiveCheckpointAdjoint())
    ours, ref = np.array(ours), np.array(ref)
    assert np.all(np.abs(ref) > 1e-2)
    np.testing.assert_allclose(ours, ref, rtol=2e-2)


@pytest.mark.slow  # 48 s on two busy cores; solve_ensemble's own tests cover the ensemble
def test_solve_ensemble_with_pid_controller():
    # Each path adapts its own steps inside the vmap; the ensemble's paths are the
    # individual adaptive solves.
    keys = jr.split(jr.key(6), 4)
    params = (jnp.array(0.7), jnp.array(0.4))
    controller = dfx.PIDController(rtol=1e-3, atol=1e-3)
    ens = dl.solve_ensemble(
        _param_terms,
        dl.ItoMilstein(),
        0.0,
        1.0,
        None,
        _Y0,
        params,
        keys=keys,
        stepsize_controller=controller,
        max_steps=2**12,
    )
    one = [
        dfx.diffeqsolve(
            _param_terms(k),
            dl.ItoMilstein(),
            0.0,
            1.0,
            None,
            _Y0,
            params,
            stepsize_controller=controller,
            max_steps=2**12,
        ).ys[-1]
        for k in keys[:2]
    ]
    np.testing.assert_allclose(ens.paths.ys[:2, -1], np.stack(one), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ens.mean[-1], np.mean(ens.paths.ys[:, -1], axis=0), rtol=1e-12)
    assert np.all(ens.paths.stats["num_accepted_steps"] > 5)


def _stiff_cubic():
    import optimistix as optx

    newton = dl.Newton(rtol=1e-10, atol=1e-10, norm=optx.max_norm, cauchy_termination=True)
    bm = dfx.VirtualBrownianTree(0.0, 1.0, tol=2**-10, shape=(2,), key=jr.key(7))
    terms = dfx.MultiTerm(
        dfx.ODETerm(lambda t, y, a: -50.0 * y**3),
        dfx.ControlTerm(lambda t, y, a: 0.1 * jnp.diag(y), bm),
    )
    return newton, terms, jnp.array([1.0, -2.0])


def test_failed_root_find_rejects_the_step():
    # A drift-implicit step whose root find fails (one Newton iteration on a stiff cubic
    # drift at a large step) returns an infinite error estimate, so that an adaptive
    # controller rejects it and shrinks the step, as for Diffrax's implicit solvers.
    newton, terms, y0 = _stiff_cubic()

    few = dl.ImplicitItoMilstein(root_finder=newton, root_find_max_steps=1)

    @jax.jit
    def step(h):
        _, y_error, _, _, result = few.step(terms, 0.0, h, y0, None, None, False)
        return y_error, result

    big_error, big = step(0.5)
    assert big != dfx.RESULTS.successful
    assert np.all(np.isinf(big_error))
    # A step the one iteration does solve (a linear problem: no noise, h tiny) keeps its
    # finite estimate.
    small_error, small = step(1e-9)
    assert small == dfx.RESULTS.successful
    assert np.all(np.isfinite(small_error))


@pytest.mark.slow  # 20 s on the busy 2-core machine
def test_adaptive_solve_recovers_from_failed_root_finds():
    # From a far too large first step the root finds fail, the steps are rejected and
    # shrunk, and the solve succeeds, close to a fine fixed-step solve on the same path.
    newton, terms, y0 = _stiff_cubic()
    solver = dl.ImplicitItoMilstein(root_finder=newton)

    @jax.jit
    def solves():
        controller = dfx.PIDController(rtol=1e-3, atol=1e-3)
        sol = dfx.diffeqsolve(
            terms, solver, 0.0, 1.0, 0.5, y0, stepsize_controller=controller, throw=False
        )
        fine = dfx.diffeqsolve(terms, solver, 0.0, 1.0, 2**-10, y0, max_steps=2**10)
        return sol.result, sol.stats, sol.ys[-1], fine.ys[-1]

    result, stats, y1, fine = solves()
    assert result == dfx.RESULTS.successful
    assert stats["num_rejected_steps"] > 0
    np.testing.assert_allclose(y1, fine, rtol=0.05)


@pytest.mark.parametrize("cls", [dl.GeneralItoMilstein, dl.GeneralStratonovichMilstein])
def test_general_estimate_contracted_equals_jvp(cls):
    # `method="contract"` forms the estimate's symmetric double sum from the materialised
    # derivative it already has; `method="jvp"` takes one JVP through the diffusion. Same
    # estimate up to rounding, and not a trivially small one.
    terms, _ = _terms(_noncommuting, jr.key(3), levy=True)
    steps = {
        method: cls(method=method).step(terms, 0.1, 0.35, _Y0, None, None, False)
        for method in ("contract", "jvp")
    }
    (y_c, err_c, *_), (y_j, err_j, *_) = steps["contract"], steps["jvp"]
    np.testing.assert_allclose(y_c, y_j, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(err_c, err_j, rtol=1e-10, atol=1e-14)
    assert np.linalg.norm(err_j) > 1e-3


_STIFF = jnp.array([-1e4, -1.0])


def _stiff_drift(t, y, args):
    return _STIFF * (y - jnp.cos(t))


def _stiff_terms(key):
    bm = dfx.VirtualBrownianTree(0.0, 1.0, tol=2**-14, shape=(2,), key=key)
    diffusion = dfx.ControlTerm(lambda t, y, a: jnp.diag(0.05 * (1 + 0.5 * jnp.sin(y))), bm)
    return dfx.MultiTerm(dfx.ODETerm(_stiff_drift), diffusion)


def _nonlinear_stiff_drift(t, y, args):
    # Its Jacobian depends on y (in the non-stiff component, where the predictor is close
    # enough for the chord iteration to converge): the filter's operator depends on where
    # it is taken.
    return _STIFF * (y - jnp.cos(t)) - jnp.array([0.0, 3.0]) * y**3


@pytest.mark.parametrize("root_finder", ["verychord", "newton"])
@pytest.mark.parametrize("theta", [1.0, 0.5])
def test_implicit_estimate_is_filtered_by_the_step_operator(theta, root_finder):
    # The drift-implicit estimate is the explicit one (`_error_estimate`) plus the
    # trapezoidal rule's drift error -h^2 (y''(t1) - y''(t0)) / 12, y'' = df/dt + J f, solved
    # against I - theta dt J; every derivative by `jax.jacfwd`, dense. With `VeryChord` J is
    # the one its chord iteration linearised and factored, at the predictor (the explicit
    # step): no Jacobian or factorisation more. With `Newton`, J at (t1, y1).
    from diffrax_linearize._solver.milstein import _error_estimate

    drift = _nonlinear_stiff_drift
    tol = dict(rtol=1e-12, atol=1e-12, norm=optx.max_norm)
    rf = dl.VeryChord(**tol, cauchy_termination=True) if root_finder == "verychord" else None
    solver = dl.ImplicitItoMilstein(theta=theta, root_finder=rf or dl.Newton(**tol))
    bm = dfx.VirtualBrownianTree(0.0, 1.0, tol=2**-14, shape=(2,), key=jr.key(4))
    diffusion = dfx.ControlTerm(lambda t, y, a: jnp.diag(0.05 * (1 + 0.5 * jnp.sin(y))), bm)
    terms = dfx.MultiTerm(dfx.ODETerm(drift), diffusion)
    t0, t1, y0 = 0.2, 0.25, jnp.array([1.3, -0.4])
    y1, y_error, _, _, result = solver.step(terms, t0, t1, y0, None, None, False)
    assert result == dfx.RESULTS.successful
    predictor, parts = solver._explicit(terms, t0, t1, y0, None)

    def second_derivative(t, y):
        t = jnp.asarray(t)
        dfdt = jax.jacfwd(drift, argnums=0)(t, y, None)
        return dfdt + jax.jacfwd(drift, argnums=1)(t, y, None) @ drift(t, y, None)

    trapezoidal = -((t1 - t0) ** 2) / 12 * (second_derivative(t1, y1) - second_derivative(t0, y0))
    raw = _error_estimate(terms, t1, y1, None, parts, drift_weight=0.5 - theta) + trapezoidal
    where = {"verychord": predictor, "newton": y1}
    filtered = {}
    for name, y in where.items():
        jac = jax.jacfwd(lambda y: drift(t1, y, None))(y)
        filtered[name] = jnp.linalg.solve(jnp.eye(2) - theta * (t1 - t0) * jac, raw)
    np.testing.assert_allclose(y_error, filtered[root_finder], rtol=1e-10, atol=1e-14)
    # The two operators differ enough here for the check above to tell them apart, and
    # either damps the stiff component by about 1 + theta dt 1e4, the other hardly.
    other = filtered["newton" if root_finder == "verychord" else "verychord"]
    assert not np.allclose(y_error, other, rtol=1e-6, atol=0)
    assert abs(y_error[0]) < abs(raw[0]) / (1 + 0.9 * theta * 0.05 * 1e4)
    np.testing.assert_allclose(y_error[1], raw[1], rtol=0.2)


@pytest.mark.slow  # 11-16 s on two cores; the estimate's filter is checked in `make test`
def test_implicit_drift_estimate_is_the_local_error():
    # Without noise the estimate of a drift-implicit step is its local error to leading
    # order, for every theta: at theta = 1/2 the trapezoidal rule's own h^3 error (an
    # estimate of the difference from the trapezoidal rule alone would be zero there, and
    # the controller would see no drift error at all), elsewhere the h^2 term and that one.
    # Its relative mismatch falls like h (the next terms, and the stiff filter's
    # (I - theta h J)^-1 = I + O(h)), at theta = 1/2 like h^2.
    rate = jnp.array([1.0, 3.0])
    drift = lambda t, y, args: -(rate + t) * y
    bm = dfx.VirtualBrownianTree(0.0, 1.0, tol=2**-10, shape=(2,), key=jr.key(0))
    terms = dfx.MultiTerm(dfx.ODETerm(drift), dfx.ControlTerm(lambda t, y, a: 0 * jnp.eye(2), bm))
    t0, y0 = 0.3, jnp.array([1.0, -0.5])
    newton = dl.Newton(rtol=1e-13, atol=1e-13, norm=optx.max_norm)
    step = eqx.filter_jit(lambda solver, t1: solver.step(terms, t0, t1, y0, None, None, False))
    for theta in (0.5, 0.75, 1.0):
        solver = dl.ImplicitItoMilstein(theta=theta, root_finder=newton)
        for h in (0.02, 0.01):
            y1, y_error, *_ = step(solver, t0 + h)
            exact = y0 * jnp.exp(-(rate * h + ((t0 + h) ** 2 - t0**2) / 2))
            rtol = 2 * h**2 if theta == 0.5 else 2 * h
            np.testing.assert_allclose(y_error, exact - y1, rtol=rtol)


@pytest.mark.slow
def test_implicit_adaptive_steps_past_the_stiff_limit():
    # Unfiltered, the estimate grows like |dt lambda| along the stiff eigenvalue (-1e4) and
    # the controller keeps dt near the explicit stability limit: hundreds of steps on
    # [0, 1] at rtol 1e-3. Filtered, a few dozen, and the solution still agrees with a fine
    # fixed-step solve on the same path.
    solver = dl.ImplicitItoMilstein()
    controller = dfx.PIDController(rtol=1e-3, atol=1e-3, pcoeff=0.3, icoeff=0.4)

    @jax.jit
    @jax.vmap
    def solve(key):
        terms = _stiff_terms(key)
        kw = dict(max_steps=2**14)
        y0 = jnp.ones(2)
        adaptive = dfx.diffeqsolve(
            terms, solver, 0.0, 1.0, None, y0, stepsize_controller=controller, **kw
        )
        fine = dfx.diffeqsolve(terms, solver, 0.0, 1.0, 2**-13, y0, **kw)
        return adaptive.ys[-1], fine.ys[-1], adaptive.stats["num_steps"]

    adaptive, fine, steps = solve(jr.split(jr.key(0), 4))
    assert np.all(np.asarray(steps) < 100), steps
    np.testing.assert_allclose(adaptive, fine, atol=0.05)
