"""A step that fails (a root find that does not converge, a linear solve that meets an
overflow) is rejected by `diffrax.PIDController` and retried smaller; it never stalls
the solve.

Each case below stalled before: the failed step's end was infinite, which makes the
controller's error scale `atol + rtol max(|y0|, |y1|)` infinite (it replaces a NaN end by
`y0`, not an infinite one), the scaled error inf / inf = NaN and the next step size NaN,
after which every step was rejected until `max_steps`. Now a failed step of ours returns
its start and an infinite error (`_solver/failure.py`), and our root finders return their
last finite iterate (what Diffrax's own implicit solvers take as the end of their step).
"""

import diffrax
import diffrax_linearize as dl
import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx
import pytest
import scipy.integrate


def _exp_field(t, y, args):
    # Stiff, and `exp` overflows at the stages of a long first step from y0[0] = -700.
    return jnp.stack([1.0 - jnp.exp(y[0]) + 50 * y[1] ** 2, y[0] - 1e3 * y[1]])


def _exp_field_np(t, y):
    return [1.0 - np.exp(y[0]) + 50 * y[1] ** 2, y[0] - 1e3 * y[1]]


_Y0 = np.array([-700.0, 5.0])
_T1 = 200.0


@pytest.fixture(scope="module")
def exp_reference():
    sol = scipy.integrate.solve_ivp(
        _exp_field_np, (0.0, _T1), _Y0, method="Radau", rtol=1e-11, atol=1e-13
    )
    assert sol.success
    return sol.y[:, -1]


_SOLVERS = {
    "Rodas5P": dl.Rodas5P,
    "ROS34PW2": dl.ROS34PW2,
    "Rodas4P": dl.Rodas4P,
    "BDF": dl.BDF,
    "Kvaerno5 VeryChord": lambda: diffrax.Kvaerno5(root_finder=dl.VeryChord()),
}


@pytest.mark.parametrize("name", list(_SOLVERS))
def test_overflowing_step_is_rejected_not_stalled(name, exp_reference):
    # Rodas5P and ROS34PW2 stalled here (36 and 0 steps accepted, then only rejections).
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(_exp_field),
        _SOLVERS[name](),
        0.0,
        _T1,
        100.0,
        jnp.asarray(_Y0),
        stepsize_controller=diffrax.PIDController(rtol=1e-5, atol=1e-7),
        max_steps=2000,
        throw=False,
    )
    assert sol.result == diffrax.RESULTS.successful, (sol.result, sol.stats)
    assert int(sol.stats["num_rejected_steps"]) < int(sol.stats["num_accepted_steps"])
    # Solved, not merely stopped: the solvers agree with scipy to their global error.
    np.testing.assert_allclose(sol.ys[-1], exp_reference, rtol=1e-2)


def test_failed_rosenbrock_step_returns_its_start():
    # One step too long: the stages overflow and a linear solve meets them.
    solver = dl.Rodas5P()
    term = diffrax.ODETerm(_exp_field)
    y0 = jnp.asarray(_Y0)
    state = solver.init(term, 0.0, 100.0, y0, None)
    y1, y_error, _, _, result = solver.step(term, 0.0, 100.0, y0, None, state, False)
    assert result != diffrax.RESULTS.successful
    np.testing.assert_array_equal(y1, y0)
    assert np.all(np.isinf(y_error))


def _vdp(t, y, args):
    return jnp.stack([y[1], 1e3 * (1 - y[0] ** 2) * y[1] - y[0]])


@pytest.mark.parametrize("root_finder", [dl.VeryChord, dl.Newton])
def test_diffrax_solver_with_our_root_finder_and_pid_controller(root_finder):
    # The drop-in use, `diffrax.Kvaerno5(root_finder=dl.VeryChord())` with Diffrax's own
    # controller: on Van der Pol (mu = 1e3) its root find once diverged to an infinite
    # iterate, Kvaerno5 took it as the step's end, and the solve stalled after 23 steps.
    def solve(solver, throw):
        return diffrax.diffeqsolve(
            diffrax.ODETerm(_vdp),
            solver,
            0.0,
            3000.0,
            None,
            jnp.array([2.0, 0.0]),
            stepsize_controller=diffrax.PIDController(rtol=1e-4, atol=1e-6),
            max_steps=4000,
            throw=throw,
        )

    sol = solve(diffrax.Kvaerno5(root_finder=root_finder()), throw=False)
    assert sol.result == diffrax.RESULTS.successful, (sol.result, sol.stats)
    # The same solve by Diffrax's own default, which takes many more steps.
    ref = solve(diffrax.Kvaerno5(), throw=True)
    np.testing.assert_allclose(sol.ys[-1], ref.ys[-1], rtol=2e-2)


@pytest.mark.parametrize("root_finder", [dl.VeryChord, dl.Newton])
def test_root_finder_returns_its_last_finite_iterate(root_finder):
    # An iteration whose first update overflows (the Jacobian at the guess is tiny, the
    # residual huge): it ends diverged, at its last finite iterate (the guess), not at inf.
    fn = lambda y, args: jnp.exp(y) - 1e300  # noqa: E731
    y0 = jnp.array([-700.0, -690.0])
    solver = root_finder(rtol=1e-8, atol=1e-8, norm=optx.max_norm)
    sol = optx.root_find(fn, solver, y0, throw=False, max_steps=10)
    assert sol.result != optx.RESULTS.successful
    np.testing.assert_array_equal(sol.value, y0)


def _vdp_sde_terms(key):
    # The stochastic Van der Pol of `benchmarks/adaptive_sde.py` (stiff where |x| > 1).
    c, mu = 8.0, 10.0
    drift = lambda t, y, args: jnp.stack(  # noqa: E731
        [c * mu * (y[0] - y[0] ** 3 / 3 - y[1]), c * y[0] / mu]
    )
    diffusion = lambda t, y, args: jnp.diag(  # noqa: E731
        jnp.stack([0.5 + 0 * y[0], 0.1 * jnp.sqrt(1 + y[1] ** 2)])
    )
    bm = diffrax.VirtualBrownianTree(0.0, 1.0, 2**-12, (2,), key)
    return diffrax.MultiTerm(diffrax.ODETerm(drift), diffrax.ControlTerm(diffusion, bm))


def test_drift_implicit_sde_solver_with_pid_controller():
    # The default `ImplicitItoMilstein` (`VeryChord` within 10 iterations): a long step's
    # root find failed at an infinite iterate and the solve stalled at t = 0.075, after 4
    # accepted steps.
    y0 = jnp.array([1.5, 1.5 - 1.5**3 / 3])
    terms = _vdp_sde_terms(jax.random.split(jax.random.key(0), 64)[0])
    controller = diffrax.PIDController(rtol=0.1, atol=0.1, pcoeff=0.3, icoeff=0.4)
    sol = diffrax.diffeqsolve(
        terms,
        dl.ImplicitItoMilstein(),
        0.0,
        1.0,
        None,
        y0,
        stepsize_controller=controller,
        max_steps=1000,
        throw=False,
    )
    assert sol.result == diffrax.RESULTS.successful, (sol.result, sol.stats)
    fine = diffrax.diffeqsolve(terms, dl.ImplicitItoMilstein(), 0.0, 1.0, 2**-12, y0)
    np.testing.assert_allclose(sol.ys[-1], fine.ys[-1], atol=0.3)
