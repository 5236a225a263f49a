import diffrax
import diffrax_linearize as dl
import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
import scipy.integrate
import scipy.linalg
from helpers import (
    assert_grad_matches_central_difference,
    assert_vmap_matches_jit,
    brusselator_2d,
)


def _robertson(t, y, args):
    y1, y2, y3 = y[..., 0], y[..., 1], y[..., 2]
    return jnp.stack(
        [
            -0.04 * y1 + 1e4 * y2 * y3,
            0.04 * y1 - 1e4 * y2 * y3 - 3e7 * y2**2,
            3e7 * y2**2,
        ],
        axis=-1,
    )


def _robertson_np(t, y):
    y1, y2, y3 = y
    return [-0.04 * y1 + 1e4 * y2 * y3, 0.04 * y1 - 1e4 * y2 * y3 - 3e7 * y2**2, 3e7 * y2**2]


_Y0 = np.array([1.0, 0.0, 0.0])


def _nonlinear(t, y, args):
    # Smooth, non-autonomous and nonlinear: exercises the df/dt stage terms.
    return jnp.stack([-(y[0] ** 2) + jnp.sin(3 * t) * y[1], -0.5 * y[1] + jnp.cos(t) * y[0]])


def _nonlinear_ref(t1, y0):
    def f(t, y):
        return [-(y[0] ** 2) + np.sin(3 * t) * y[1], -0.5 * y[1] + np.cos(t) * y[0]]

    sol = scipy.integrate.solve_ivp(f, (0, t1), y0, method="DOP853", rtol=1e-13, atol=1e-15)
    return sol.y[:, -1]


def _order_conditions(tab, weights):
    """The residuals of the order conditions of a Rosenbrock method up to order 4
    (Hairer & Wanner, Solving ODEs II, table IV.7.1), for the solution with `weights` in
    the W-transformed variables of the tableau."""
    s = len(tab.c)
    G = np.linalg.inv(np.eye(s) / tab.gamma - tab.C)  # the gamma_ij
    alpha = tab.a @ G
    beta = alpha + G - np.diag(np.diag(G))  # alpha_ij + gamma_ij, j < i
    b = weights @ G
    a_i, bp = alpha.sum(1), beta.sum(1)
    g = tab.gamma
    return {
        "c": np.max(np.abs(a_i - tab.c)),
        "d": np.max(np.abs(G.sum(1) - tab.d)),
        1: b.sum() - 1,
        2: b @ bp - (0.5 - g),
        3: max(abs(b @ a_i**2 - 1 / 3), abs(b @ beta @ bp - (1 / 6 - g + g**2))),
        4: max(
            abs(b @ a_i**3 - 1 / 4),
            abs(b @ (a_i * (alpha @ bp)) - (1 / 8 - g / 3)),
            abs(b @ beta @ a_i**2 - (1 / 12 - g / 3)),
            abs(b @ beta @ beta @ bp - (1 / 24 - g / 2 + 1.5 * g**2 - g**3)),
        ),
    }


@pytest.mark.parametrize("solver", [dl.Rodas5P, dl.Rodas4P])
def test_tableau_order_conditions(solver):
    """The stored coefficients reproduce the stage times and time-derivative weights, and
    satisfy the order conditions (up to order 4) of the method and of its embedded one."""
    tab = solver.tableau
    s = len(tab.c)
    solution = tab.a[-1] + np.eye(s)[-1]
    embedded = tab.a[-1]
    res = _order_conditions(tab, solution)
    assert res["c"] < 1e-12 and res["d"] < 1e-12, res
    for p in range(1, min(tab.order, 4) + 1):
        assert abs(res[p]) < 1e-12, (p, res)
    res_embedded = _order_conditions(tab, embedded)
    for p in range(1, tab.order):
        assert abs(res_embedded[p]) < 1e-12, (p, res_embedded)
    if tab.order == 4:  # the embedded method is of order 3, not 4: the estimate is O(h^4)
        assert abs(res_embedded[4]) > 1e-6, res_embedded


_ORDERS = [(dl.Rodas5P, 4.5, 5.6), (dl.Rodas4P, 3.8, 4.8)]


@pytest.mark.parametrize("solver, low, high", _ORDERS)
def test_order(solver, low, high):
    """Fixed steps on a nonlinear non-autonomous problem: the fitted global order is the
    method's (5.12 for Rodas5P, 4.39 for Rodas4P when written)."""
    y0 = jnp.array([1.0, 0.5])
    ref = _nonlinear_ref(2.0, [1.0, 0.5])

    @jax.jit
    def solve(dt):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(_nonlinear), solver(), 0.0, 2.0, dt, y0, max_steps=100
        )
        return sol.ys[-1]

    ns = np.array([8, 16, 32, 64])
    errs = [float(jnp.max(jnp.abs(solve(2.0 / n) - ref))) for n in ns]
    order = -np.polyfit(np.log(ns), np.log(errs), 1)[0]
    assert low < order < high, (order, errs)


_LAMBDA = 1e4


def _prothero_robinson(t, y, args):
    # y' = M (y - phi(t)) + phi'(t), exact solution phi, stiff: h * lambda up to 2500.
    phi = jnp.stack([jnp.sin(t), jnp.cos(t)])
    dphi = jnp.stack([jnp.cos(t), -jnp.sin(t)])
    M = jnp.array([[-_LAMBDA, 1.0], [0.0, -_LAMBDA / 10]])
    return M @ (y - phi) + dphi


@pytest.mark.parametrize("solver, low, high", [(dl.Rodas5P, 3.0, 4.5), (dl.Rodas4P, 2.5, 3.5)])
def test_order_stiff(solver, low, high):
    """Fixed steps on a stiff linear non-autonomous problem (Prothero-Robinson, against its
    exact solution): in the stiff regime the order drops to about the stage order plus
    one, 3.54 for Rodas5P and 2.82 for Rodas4P when written; Rodas4P's coefficients were
    chosen to keep 3 here."""
    y0 = jnp.array([0.0, 1.0])
    ref = np.array([np.sin(2.0), np.cos(2.0)])

    @jax.jit
    def solve(dt):
        term = diffrax.ODETerm(_prothero_robinson)
        return diffrax.diffeqsolve(term, solver(), 0.0, 2.0, dt, y0, max_steps=200).ys[-1]

    ns = np.array([8, 16, 32, 64, 128])
    errs = [float(jnp.max(jnp.abs(solve(2.0 / n) - ref))) for n in ns]
    order = -np.polyfit(np.log(ns), np.log(errs), 1)[0]
    assert low < order < high, (order, errs)


@pytest.mark.parametrize("solver, tol, ratio", [(dl.Rodas5P, 5e-7, 16), (dl.Rodas4P, 2e-5, 8)])
def test_dense_output(solver, tol, ratio):
    """The dense output between the steps agrees with a tight reference, and converges at
    more than its order in the step (Rodas5P's is of order 4: 16x for half the step;
    Rodas4P's of order 3: 8x; 24x and 15x when written)."""
    y0 = jnp.array([1.0, 0.5])
    ts = jnp.linspace(0.05, 1.95, 7)
    ref = np.stack([_nonlinear_ref(float(t), [1.0, 0.5]) for t in ts])
    errs = []
    for dt in (0.1, 0.05):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(_nonlinear),
            solver(),
            0.0,
            2.0,
            jnp.asarray(dt),  # traced: one compilation for both step sizes
            y0,
            saveat=diffrax.SaveAt(ts=ts),
            max_steps=64,
        )
        errs.append(np.max(np.abs(np.asarray(sol.ys) - ref)))
    assert errs[0] < tol, errs
    assert errs[0] / errs[1] > ratio, errs


def test_reversed_time():
    """Solving back from the forward solution at t = 2 recovers y0 (Diffrax wraps the term
    so that its control, the step, is negative)."""
    y2 = _nonlinear_ref(2.0, [1.0, 0.5])
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(_nonlinear), dl.Rodas5P(), 2.0, 0.0, -0.05, jnp.asarray(y2)
    )
    np.testing.assert_allclose(sol.ys[-1], [1.0, 0.5], atol=1e-7)


def _robertson_ref(t1):
    sol = scipy.integrate.solve_ivp(
        _robertson_np, (0, t1), _Y0, method="Radau", rtol=1e-12, atol=1e-14
    )
    return sol.y[:, -1]


@pytest.mark.parametrize("solver, max_steps", [(dl.Rodas5P, 100), (dl.Rodas4P, 150)])
def test_robertson_adaptive(solver, max_steps):
    rtol, atol = 1e-6, 1e-10
    ref = _robertson_ref(100.0)
    ctrl = diffrax.PIDController(rtol=rtol, atol=atol)
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(_robertson),
        solver(),
        0.0,
        100.0,
        1e-4,
        jnp.asarray(_Y0),
        stepsize_controller=ctrl,
        max_steps=10_000,
    )
    y1 = np.asarray(sol.ys[-1])
    # Each component to within 10x rtol relative, or the absolute tolerance scale.
    np.testing.assert_allclose(y1, ref, rtol=10 * rtol, atol=10 * atol)
    assert int(sol.stats["num_steps"]) < max_steps, sol.stats  # Rodas5P 49 when written


def _stacked(t, y, args):
    return _robertson(t, y.reshape(3, 3), args).ravel()


_Y0_STACK = jnp.array([[1.0, 0.0, 0.0], [0.5, 0.0, 0.5], [0.9, 1e-5, 0.1]])


def test_block_diagonal_step_matches_single():
    """One step on a stack of independent Robertson systems (a block-diagonal Jacobian,
    factored block by block) gives each block the single system's step and error."""
    op = dl.materialise_operator(lambda y: _stacked(0.0, y, None), _Y0_STACK.ravel())
    assert isinstance(op, dl.BlockDiagonalLinearOperator)
    solver = dl.Rodas5P()

    @jax.jit
    def step(y0, t1):
        term = diffrax.ODETerm(_stacked if y0.ndim == 1 and y0.size == 9 else _robertson)
        y1, err, _, _, result = solver.step(term, 0.0, t1, y0, None, None, False)
        return y1, err, result

    for t1 in (1e-4, 1e-2):  # h times the third block's fastest rate reaches ~10
        whole, whole_err, result = step(_Y0_STACK.ravel(), t1)
        assert result == diffrax.RESULTS.successful
        for i in range(3):
            single, single_err, _ = step(_Y0_STACK[i], t1)
            np.testing.assert_allclose(whole.reshape(3, 3)[i], single, rtol=1e-12, atol=1e-15)
            np.testing.assert_allclose(
                whole_err.reshape(3, 3)[i], single_err, rtol=1e-8, atol=1e-15
            )


@pytest.mark.slow  # compiles two whole solves: ~15 s on 2 cores
def test_block_diagonal_matches_single():
    """A stack of independent Robertson systems (a block-diagonal Jacobian, factored
    block by block) gives each block the single system's answer."""
    y0 = jnp.array([[1.0, 0.0, 0.0], [0.5, 0.0, 0.5], [0.9, 1e-5, 0.1]])

    def stacked(t, y, args):
        return _robertson(t, y.reshape(3, 3), args).ravel()

    op = dl.materialise_operator(lambda y: stacked(0.0, y, None), y0.ravel())
    assert isinstance(op, dl.BlockDiagonalLinearOperator)

    # Prescribed steps (an adaptive controller on the stack sees all blocks at once) keep
    # the comparison exact up to rounding; geometric, as Robertson's time scales are.
    ts = jnp.concatenate([jnp.zeros(1), jnp.geomspace(1e-5, 10.0, 100)])
    kw = dict(t0=0.0, t1=10.0, dt0=None, stepsize_controller=diffrax.StepTo(ts))
    whole = diffrax.diffeqsolve(diffrax.ODETerm(stacked), dl.Rodas5P(), y0=y0.ravel(), **kw)

    def single(y0_i):  # vmapped: each batch element is still one dense 3x3 system
        term = diffrax.ODETerm(_robertson)
        return diffrax.diffeqsolve(term, dl.Rodas5P(), y0=y0_i, **kw).ys[-1]

    singles = jax.vmap(single)(y0)
    np.testing.assert_allclose(whole.ys[-1].reshape(3, 3), singles, rtol=1e-10, atol=1e-14)


def _small(t, y, args):
    return jnp.stack([-args * y[0] + y[1] ** 2, -y[1] + jnp.sin(t) * y[0]])


def _solve_small(y0, k, adaptive=True):
    if adaptive:
        controller = diffrax.PIDController(rtol=1e-8, atol=1e-8)
    else:
        controller = diffrax.ConstantStepSize()
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(_small),
        dl.Rodas5P(),
        0.0,
        1.0,
        0.1,
        y0,
        args=k,
        stepsize_controller=controller,
        adjoint=diffrax.RecursiveCheckpointAdjoint(),
    )
    return sol.ys[-1]


def test_jit_vmap():
    def solve(y0, k):
        return _solve_small(y0, k, adaptive=False)

    assert_vmap_matches_jit(solve, jnp.array([[1.0, 0.5], [0.3, -0.2]]), 2.0, rtol=1e-10)


@pytest.mark.slow  # compiling the reverse pass through adaptive steps: ~30 s on 2 cores
def test_grad_recursive_checkpoint():
    def loss(k):
        return jnp.sum(_solve_small(jnp.array([1.0, 0.5]), k) ** 2)

    assert_grad_matches_central_difference(loss, 2.0)


def test_pytree_state():
    def f(t, y, args):
        a, b = y["a"], y["b"]
        return {"a": -a + b, "b": -(10 * b) + a}

    y0 = {"a": jnp.array(1.0), "b": jnp.array(0.5)}
    sol = diffrax.diffeqsolve(diffrax.ODETerm(f), dl.Rodas5P(), 0.0, 1.0, 0.05, y0)
    M = np.array([[-1.0, 1.0], [1.0, -10.0]])
    ref = scipy.linalg.expm(M) @ np.array([1.0, 0.5])
    np.testing.assert_allclose(sol.ys["a"][-1], ref[0], rtol=1e-6)
    np.testing.assert_allclose(sol.ys["b"][-1], ref[1], rtol=1e-6)


_A_COMPLEX = np.array(
    [[-1.0 + 2.0j, 0.5, 0.0], [0.3j, -2.0 - 1.0j, 1.0], [0.0, -0.5 + 0.5j, -0.5 + 3.0j]]
)


def _complex_rhs(t, y, args):
    # Holomorphic in y, non-autonomous (the stages' df/dt term in complex arithmetic).
    phase = jnp.exp(1j * jnp.asarray(t).astype(jnp.complex128))
    return jnp.asarray(_A_COMPLEX) @ y + phase * jnp.array([1.0, 0.0, -1.0j])


def _split_rhs(t, uv, args):
    z = _complex_rhs(t, uv[:3] + 1j * uv[3:], args)
    return jnp.concatenate([z.real, z.imag])


# Rodas4P shares Rodas5P's step (`AbstractRodas`): in the slow suite.
@pytest.mark.parametrize(
    "solver", [dl.Rodas5P, pytest.param(dl.Rodas4P, marks=pytest.mark.slow), dl.ROS34PW2]
)
@pytest.mark.standard_promotion  # the real system it is checked against mixes dtypes
def test_complex_state(solver):
    """A complex state (found by Diffrax's `test_ode_order[complex128-*]` in
    `tests/diffrax_suite.py --stiff`; it raised in `materialise_operator` before): the
    Jacobian is the complex one (`holomorphic=True`), so every step is exactly the step of
    the system split into real and imaginary parts, whose Jacobian is its real form; and
    the solution is scipy's."""
    y0 = jnp.array([1.0 + 0.5j, -0.5j, 0.25 + 0.0j])
    dt, t1 = 0.02, 2.0
    sol = diffrax.diffeqsolve(diffrax.ODETerm(_complex_rhs), solver(), 0.0, t1, dt, y0)
    uv0 = jnp.concatenate([y0.real, y0.imag])
    split = diffrax.diffeqsolve(diffrax.ODETerm(_split_rhs), solver(), 0.0, t1, dt, uv0)
    assert sol.ys.dtype == jnp.complex128
    z1 = sol.ys[-1]
    np.testing.assert_allclose(jnp.concatenate([z1.real, z1.imag]), split.ys[-1], atol=1e-12)

    def f(t, y):
        return np.asarray(_complex_rhs(t, jnp.asarray(y), None))

    ref = scipy.integrate.solve_ivp(f, (0, t1), np.asarray(y0), "DOP853", rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(z1, ref.y[:, -1], rtol=0, atol=1e-5)


# Each solver and each empty state once by default; the other two pairs are second cases.
@pytest.mark.parametrize(
    "solver, y0",
    [
        (dl.Rodas5P, None),
        (dl.ROS34PW2, jnp.zeros((0, 3))),
        pytest.param(dl.Rodas5P, jnp.zeros((0, 3)), marks=pytest.mark.slow),
        pytest.param(dl.ROS34PW2, None, marks=pytest.mark.slow),
    ],
    ids=["None-Rodas5P", "array-ROS34PW2", "array-Rodas5P", "None-ROS34PW2"],
)
def test_empty_state(solver, y0):
    """A state with no entries, which Diffrax's `test_basic` solves with every solver that
    is not implicit (found by `tests/diffrax_suite.py --stiff`; it raised in the linear
    solver or the W-method's update before): the solve goes through, as `diffrax.Tsit5`'s
    does, with the same (empty) solution and dense output."""
    term = diffrax.ODETerm(lambda t, y, args: jax.tree_util.tree_map(jnp.negative, y))
    kwargs = dict(
        stepsize_controller=diffrax.PIDController(rtol=1e-5, atol=1e-8),
        saveat=diffrax.SaveAt(t1=True, dense=True),
    )
    sol = diffrax.diffeqsolve(term, solver(), 0.0, 1.0, 0.1, y0, **kwargs)
    ref = diffrax.diffeqsolve(term, diffrax.Tsit5(), 0.0, 1.0, 0.1, y0, **kwargs)
    assert sol.result == diffrax.RESULTS.successful
    assert eqx.tree_equal(sol.ys, ref.ys)
    assert eqx.tree_equal(sol.evaluate(0.5), ref.evaluate(0.5))


@pytest.mark.parametrize("solver", [dl.Rodas5P, dl.Rodas4P])
def test_float32(solver):
    with jax.enable_x64(False):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(_robertson),
            solver(),
            0.0,
            100.0,
            1e-4,
            jnp.array([1.0, 0.0, 0.0], jnp.float32),
            stepsize_controller=diffrax.PIDController(rtol=1e-4, atol=1e-7),
            max_steps=10_000,
        )
        assert sol.ys.dtype == jnp.float32
    assert sol.result == diffrax.RESULTS.successful
    np.testing.assert_allclose(sol.ys[-1], _robertson_ref(100.0), rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("solver", [dl.Rodas5P, dl.Rodas4P])
def test_sde_error(solver):
    bm = diffrax.VirtualBrownianTree(0.0, 1.0, tol=1e-3, shape=(), key=jax.random.key(0))
    terms = diffrax.MultiTerm(
        diffrax.ODETerm(lambda t, y, args: -y),
        diffrax.ControlTerm(lambda t, y, args: 0.1 * y, bm),
    )
    with pytest.raises(TypeError, match=f"diffrax_linearize.{solver.__name__}"):
        diffrax.diffeqsolve(terms, solver(), 0.0, 1.0, 0.1, jnp.array(1.0))


def _brusselator_solve(solver, t1=0.05, rtol=1e-6, atol=1e-8, p=1.0, dtype=jnp.float64):
    """The 2 x 16 x 16 periodic Brusselator (512 unknowns: `StructuredLinearSolver` takes
    GMRES), its vector field scaled by `p`."""
    field, y0 = brusselator_2d(16)
    controller = diffrax.PIDController(rtol=rtol, atol=atol)
    return diffrax.diffeqsolve(
        diffrax.ODETerm(lambda t, y, args: args * field(y)),
        solver,
        0.0,
        t1,
        1e-4,
        y0.astype(dtype),
        args=jnp.asarray(p, dtype),
        stepsize_controller=controller,
    )


@pytest.mark.slow  # ~12 s each on 2 loaded cores: three solves of 512 unknowns
@pytest.mark.parametrize("solver", [dl.Rodas5P, dl.ROS34PW2])
def test_gmres_tolerance_from_controller(solver):
    """With the controller's `rtol` and `atol`, the GMRES stage solves stop at a fraction
    of the step's error weights (and Rodas5P multiplies by `jax.jvp`): the solution is
    still that of the exact stage solves (dense LU) to within the tolerance, and the
    solve takes about as many steps."""
    tight = _brusselator_solve(solver())
    loose = _brusselator_solve(solver(rtol=1e-6, atol=1e-8))
    exact = _brusselator_solve(solver(linear_solver=lx.LU()))
    assert loose.result == diffrax.RESULTS.successful
    np.testing.assert_allclose(tight.ys[-1], exact.ys[-1], rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(loose.ys[-1], exact.ys[-1], rtol=1e-6, atol=1e-8)
    steps = int(exact.stats["num_steps"])
    assert abs(int(loose.stats["num_steps"]) - steps) <= max(2, steps // 10)


@pytest.mark.slow  # ~12-15 s each on 2 loaded cores
@pytest.mark.parametrize("solver", [dl.Rodas5P, dl.ROS34PW2])
def test_gmres_float32(solver):
    """float32 on the GMRES path, with and without the controller's tolerances: against
    the float64 solve."""
    ref = _brusselator_solve(solver(), rtol=1e-4, atol=1e-6)
    with jax.enable_x64(False):
        for s in (solver(), solver(rtol=1e-4, atol=1e-6)):
            sol = _brusselator_solve(s, rtol=1e-4, atol=1e-6, dtype=jnp.float32)
            assert sol.result == diffrax.RESULTS.successful
            assert sol.ys.dtype == jnp.float32
            np.testing.assert_allclose(sol.ys[-1], ref.ys[-1], rtol=1e-3, atol=1e-4)


@pytest.mark.slow  # 30-60 s each on 2 loaded cores: a gradient's compilation at 512 unknowns
@pytest.mark.parametrize(
    "solver", [dl.Rodas5P(), dl.Rodas5P(rtol=1e-8, atol=1e-8), dl.ROS34PW2(rtol=1e-8, atol=1e-8)]
)
def test_grad_gmres(solver):
    """`jax.grad` through the GMRES path (lineax differentiates the stage solves through
    the materialised operator; the matrix-free product and the loose tolerance serve the
    primal solve only): against central differences."""

    def loss(p):
        sol = _brusselator_solve(solver, t1=0.1, rtol=1e-8, atol=1e-8, p=p)
        return jnp.sum(jnp.sin(sol.ys[-1]))

    assert_grad_matches_central_difference(loss, 1.0, eps=1e-6, rtol=1e-5)


@pytest.mark.parametrize("solver", [dl.Rodas5P, dl.Rodas4P, dl.ROS34PW2])
@pytest.mark.parametrize("given, missing", [("rtol", "atol"), ("atol", "rtol")])
def test_one_tolerance_alone(solver, given, missing):
    """`rtol` without `atol` (or `atol` without `rtol`) is a clear error when the solver
    is built, not a `TypeError` inside the stage solves (or, for `atol` alone, a
    tolerance silently unused); both or neither build."""
    with pytest.raises(ValueError, match=rf"{solver.__name__}\({given}=.*without `{missing}`"):
        solver(**{given: 1e-6})
    solver(rtol=1e-6, atol=1e-8)
    solver()
