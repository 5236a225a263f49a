from typing import ClassVar

import diffrax
import diffrax_linearize as dl
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
import scipy.integrate
import scipy.linalg
from diffrax_linearize._solver.rosenbrock import _RODAS4P
from helpers import (
    assert_grad_matches_central_difference,
    assert_vmap_matches_jit,
    brusselator_2d,
)
from test_rosenbrock import _order_conditions, _robertson, _robertson_ref, _Y0


def _pendulum(t, y, args):
    # Smooth, nonlinear and non-autonomous: its Jacobian changes along the solution, so a
    # stale one is a wrong one.
    return jnp.stack([y[1], -jnp.sin(y[0]) - 0.1 * y[1] + 0.2 * jnp.cos(t)])


def _pendulum_ref(t1, y0):
    def f(t, y):
        return [y[1], -np.sin(y[0]) - 0.1 * y[1] + 0.2 * np.cos(t)]

    sol = scipy.integrate.solve_ivp(f, (0, t1), y0, method="DOP853", rtol=1e-13, atol=1e-15)
    return sol.y[:, -1]


class _FrozenRodas4P(dl.AbstractRosenbrockW):
    """Rodas4P's tableau (not a W-method) with the W-method's Jacobian reuse: the
    negative control of the order test."""

    linear_solver: lx.AbstractLinearSolver = dl.StructuredLinearSolver()
    jacobian_every: int = 20
    refactor_ratio: float = 2.0
    rtol: float | None = None
    atol: float | None = None
    tableau: ClassVar = _RODAS4P


def _fitted_order(solver, ns=(20, 40, 80, 160), t1=5.0):
    y0 = np.array([1.0, 0.0])
    ref = _pendulum_ref(t1, y0)
    errs = []
    for n in ns:
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(_pendulum), solver, 0.0, t1, t1 / n, jnp.asarray(y0)
        )
        errs.append(np.max(np.abs(np.asarray(sol.ys[-1]) - ref)))
    return -np.polyfit(np.log(ns), np.log(errs), 1)[0]


def test_tableau_order_conditions():
    """The coefficients from OrdinaryDiffEq.jl reproduce the stage times and
    time-derivative weights and satisfy the (exact-Jacobian) order conditions: order 3,
    embedded order 2 and not 3."""
    tab = dl.ROS34PW2.tableau
    res = _order_conditions(tab, tab.b)
    assert res["c"] < 1e-12 and res["d"] < 1e-12, res
    for p in (1, 2, 3):
        assert abs(res[p]) < 1e-12, (p, res)
    res_embedded = _order_conditions(tab, tab.b - tab.btilde)
    for p in (1, 2):
        assert abs(res_embedded[p]) < 1e-12, (p, res_embedded)
    assert abs(res_embedded[3]) > 1e-6, res_embedded


@pytest.mark.slow  # compiles a fixed-step solve per solver: > 5 s on 2 cores
@pytest.mark.parametrize("jacobian_every", [1, 10, 10**6])
def test_order_with_stale_jacobian(jacobian_every):
    """Fixed steps: order 3 with a fresh Jacobian, one every 10 steps and one for the
    whole run (measured 2.94, 2.95, 2.88 when written). This is what makes it a
    W-method: see the negative control below."""
    assert 2.7 < _fitted_order(dl.ROS34PW2(jacobian_every=jacobian_every)) < 3.3


@pytest.mark.slow  # compiles a fixed-step solve per solver: > 5 s on 2 cores
def test_order_negative_control():
    """The same Jacobian reuse with Rodas4P's tableau: order 4 with a fresh Jacobian,
    order 1 (0.96 when written) with one for the whole run. So the order test above can
    fail."""
    assert _fitted_order(_FrozenRodas4P(jacobian_every=1)) > 3.7
    assert _fitted_order(_FrozenRodas4P(jacobian_every=10**6)) < 1.5


def _reference_solve(y0, t1, n):
    """ROS34PW2 with a dense Jacobian (jax.jacfwd) and a dense solve at every step, from
    the tableau in its untransformed form (alpha, Gamma, b)."""
    tab = dl.ROS34PW2.tableau
    s = len(tab.c)
    G = np.linalg.inv(np.eye(s) / tab.gamma - tab.C)
    alpha, b = tab.a @ G, tab.b @ G
    h = t1 / n
    y, t = y0, 0.0
    for _ in range(n):
        J = jax.jacfwd(lambda z: _pendulum(t, z, None))(y)
        ft = jax.jacfwd(lambda tt: _pendulum(tt, y, None))(t)
        M = np.eye(2) - h * tab.gamma * np.asarray(J)
        ks = []
        for i in range(s):
            yi = y + sum(alpha[i, j] * ks[j] for j in range(i))
            rhs = h * _pendulum(t + tab.c[i] * h, yi, None) + h**2 * tab.d[i] * ft
            rhs = rhs + h * J @ sum((G[i, j] * ks[j] for j in range(i)), jnp.zeros(2))
            ks.append(jnp.asarray(np.linalg.solve(M, np.asarray(rhs))))
        y = y + sum(b[j] * ks[j] for j in range(s))
        t = t + h
    return np.asarray(y)


@pytest.mark.slow  # compiles a fixed-step solve per solver: > 5 s on 2 cores
def test_fresh_jacobian_matches_reference():
    y0 = jnp.array([1.0, 0.0])
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(_pendulum), dl.ROS34PW2(jacobian_every=1), 0.0, 2.0, 0.1, y0
    )
    np.testing.assert_allclose(sol.ys[-1], _reference_solve(y0, 2.0, 20), rtol=1e-11)


def _adaptive(solver, f, y0, t1, rtol, atol, dt0=1e-4, **kwargs):
    return diffrax.diffeqsolve(
        diffrax.ODETerm(f),
        solver,
        0.0,
        t1,
        dt0,
        y0,
        stepsize_controller=diffrax.PIDController(rtol=rtol, atol=atol),
        max_steps=10_000,
        **{"saveat": diffrax.SaveAt(t1=True, solver_state=True), **kwargs},
    )


def test_robertson_adaptive_reuses_jacobian():
    rtol, atol = 1e-6, 1e-10
    sol = _adaptive(dl.ROS34PW2(), _robertson, jnp.asarray(_Y0), 100.0, rtol, atol)
    assert sol.result == diffrax.RESULTS.successful
    np.testing.assert_allclose(sol.ys[-1], _robertson_ref(100.0), rtol=20 * rtol, atol=10 * atol)
    steps = int(sol.stats["num_accepted_steps"])
    n_jac = int(sol.solver_state.num_jacobians)
    n_fac = int(sol.solver_state.num_factorisations)
    # Every step refactors (the PID controller changes h every step), but Jacobians are
    # renewed only every 20 steps or when h has doubled since the last one.
    assert 1 <= n_jac < steps / 2, (n_jac, steps)
    assert n_jac <= n_fac <= steps + 1, (n_fac, steps)


def test_jacobian_every_one_counts_every_step():
    sol = _adaptive(dl.ROS34PW2(jacobian_every=1), _robertson, jnp.asarray(_Y0), 1.0, 1e-5, 1e-9)
    # One in `init`, then one in every accepted step but the first.
    assert int(sol.solver_state.num_jacobians) == int(sol.stats["num_accepted_steps"])


def test_stiff_linear():
    M = np.array([[-1.0, 1.0, 0.0], [0.0, -100.0, 50.0], [0.0, 0.0, -1e4]])

    def f(t, y, args):
        return jnp.asarray(M) @ y

    y0 = np.array([1.0, 1.0, 1.0])
    sol = _adaptive(dl.ROS34PW2(), f, jnp.asarray(y0), 2.0, 1e-7, 1e-10)
    ref = scipy.linalg.expm(2.0 * M) @ y0
    np.testing.assert_allclose(sol.ys[-1], ref, rtol=1e-5, atol=1e-9)
    # A linear problem's Jacobian never changes: only the step-size rule renews it.
    assert int(sol.solver_state.num_jacobians) < int(sol.stats["num_accepted_steps"]) / 2


@pytest.mark.slow  # ~5 s of compilation; the default suite is held under 10 minutes
def test_float32():
    with jax.enable_x64(False):
        sol = _adaptive(dl.ROS34PW2(), _robertson, jnp.asarray(_Y0, jnp.float32), 100.0, 1e-4, 1e-7)
        assert sol.ys.dtype == jnp.float32
    assert sol.result == diffrax.RESULTS.successful
    np.testing.assert_allclose(sol.ys[-1], _robertson_ref(100.0), rtol=1e-2, atol=1e-6)


def assert_solves_pytree_state(solver):
    """A linear system in a dict state, against `expm` (shared with `test_bdf.py`)."""

    def f(t, y, args):
        a, b = y["a"], y["b"]
        return {"a": -a + b, "b": -(10 * b) + a}

    y0 = {"a": jnp.array(1.0), "b": jnp.array(0.5)}
    sol = _adaptive(solver, f, y0, 1.0, 1e-8, 1e-10, dt0=0.05)
    M = np.array([[-1.0, 1.0], [1.0, -10.0]])
    ref = scipy.linalg.expm(M) @ np.array([1.0, 0.5])
    np.testing.assert_allclose(sol.ys["a"][-1], ref[0], rtol=1e-6)
    np.testing.assert_allclose(sol.ys["b"][-1], ref[1], rtol=1e-6)


def test_pytree_state():
    assert_solves_pytree_state(dl.ROS34PW2())


def _solve_small(y0, k, solver=dl.ROS34PW2()):
    def f(t, y, args):
        return jnp.stack([-args * y[0] ** 3 + y[1], -50.0 * y[1] + jnp.sin(y[0])])

    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(f),
        solver,
        0.0,
        1.0,
        0.01,
        y0,
        args=k,
        stepsize_controller=diffrax.PIDController(rtol=1e-8, atol=1e-10),
    )
    return sol.ys[-1]


@pytest.mark.slow  # two compilations: ~5 s on 2 cores
def test_jit_vmap():
    assert_vmap_matches_jit(_solve_small, jnp.array([[1.0, 0.5], [0.3, -0.2]]), 2.0, rtol=1e-9)


@pytest.mark.slow  # the reverse pass through adaptive steps: compile time on 2 cores
def test_grad():
    def loss(k):
        return jnp.sum(_solve_small(jnp.array([1.0, 0.5]), k) ** 2)

    assert_grad_matches_central_difference(loss, 2.0)


def test_sde_error():
    bm = diffrax.VirtualBrownianTree(0.0, 1.0, tol=1e-3, shape=(), key=jax.random.key(0))
    terms = diffrax.MultiTerm(
        diffrax.ODETerm(lambda t, y, args: -y),
        diffrax.ControlTerm(lambda t, y, args: 0.1 * y, bm),
    )
    with pytest.raises(TypeError, match="diffrax_linearize.ROS34PW2"):
        diffrax.diffeqsolve(terms, dl.ROS34PW2(), 0.0, 1.0, 0.1, jnp.array(1.0))


@pytest.mark.parametrize("kwargs", [dict(jacobian_every=0), dict(refactor_ratio=1.0)])
def test_bad_fields(kwargs):
    with pytest.raises(ValueError, match="diffrax_linearize.ROS34PW2"):
        dl.ROS34PW2(**kwargs)


@pytest.mark.slow
def test_gmres_path_carried_across_steps():
    # A periodic 2D grid of 2 x 16 x 16 unknowns: its reordered band is too wide to factor
    # (`StructuredLinearSolver` takes GMRES), and the W-method carries GMRES's state from
    # step to step. Its Jacobi preconditioner was a `lineax.FunctionLinearOperator`, whose
    # jaxpr cannot pass through the solve's `lax.cond` (a TypeError at trace time).
    n = 16

    field, y0 = brusselator_2d(n)

    def brusselator(t, y, args):
        return field(y)

    op = dl.materialise_operator(lambda y: brusselator(0.0, y, None), y0)
    state = dl.StructuredLinearSolver().init(op, {})
    assert type(state).__name__ == "_Krylov"  # the path this test is for
    gmres = _adaptive(dl.ROS34PW2(), brusselator, y0, 0.05, 1e-6, 1e-8)
    dense = _adaptive(dl.ROS34PW2(linear_solver=lx.LU()), brusselator, y0, 0.05, 1e-6, 1e-8)
    assert gmres.result == diffrax.RESULTS.successful
    # GMRES stops at 1e-10: the same steps, the same solution up to that.
    assert int(gmres.stats["num_steps"]) == int(dense.stats["num_steps"])
    np.testing.assert_allclose(gmres.ys[-1], dense.ys[-1], rtol=1e-7, atol=1e-9)
