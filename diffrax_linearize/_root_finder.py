"""Root finders for Diffrax's implicit solvers whose Jacobians come from the structure
engine: `diffrax.Kvaerno5(root_finder=diffrax_linearize.VeryChord())` factors a
block-diagonal, banded or sparse `I - h γ J` instead of a dense one."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import lineax as lx
import optimistix as optx
from jaxtyping import Array, Bool, PyTree, Scalar

from ._compat import use_stepsize_tol
from ._custom_types import all_finite, mixed_dtypes
from ._linear_solver import resolution, StructuredLinearSolver
from ._materialise import solver_operator


def _small(diffsize: Scalar) -> Bool[Array, ""]:
    resolution = 10 ** (2 - jnp.finfo(diffsize.dtype).precision)
    return diffsize < resolution


def _diverged(rate: Scalar) -> Bool[Array, ""]:
    return jnp.invert(jnp.isfinite(rate)) | (rate > 2)


def _converged(factor: Scalar, tol: float) -> Bool[Array, ""]:
    return (factor > 0) & (factor < tol)


def _jacobian(solver, fn, y, args) -> lx.AbstractLinearOperator:
    """The Jacobian of `y -> fn(y, args)[0]` as a structured operator: a block-diagonal,
    banded or sparse pattern is kept (`diffrax_linearize.materialise_operator`).

    A complex state takes the complex Jacobian `jax.jacfwd(..., holomorphic=True)` gives,
    as Diffrax's default root finder does (`lineax.JacobianLinearOperator` materialises a
    complex function that way): exact for a holomorphic vector field; for another, the
    complex-linear map that agrees with the derivative along real directions, with which
    the iteration still converges for small enough steps, only more slowly."""
    _check_not_mixed(solver, y)
    return solver_operator(lambda y, args: fn(y, args)[0], y, args)


def check_real_or_complex(name: str, leaves) -> None:
    """The arrays of a state are all real or all complex (the root finders, and `BDF`,
    whose flattened state would cast real arrays to complex and back)."""
    complex_leaves = [jnp.iscomplexobj(x) for x in leaves]
    if any(complex_leaves) and not all(complex_leaves):
        raise TypeError(
            f"`{name}`: the state mixes real and complex arrays. Make every array of the "
            "initial state complex (`y0.astype(jnp.complex128)`), or every one real (split "
            "a complex array into its real and imaginary parts)."
        )


def _check_not_mixed(solver, y) -> None:
    """A state of one dtype: the Jacobian is a lineax operator, which has one input dtype.
    Checked before anything else of the iteration (under strict dtype promotion the
    iteration's own scalars would otherwise fail first, with JAX's promotion error)."""
    leaves = jtu.tree_leaves(y)
    name = f"diffrax_linearize.{type(solver).__name__}"
    check_real_or_complex(name, leaves)
    dtypes = mixed_dtypes(leaves)
    if dtypes is not None:
        raise TypeError(
            f"`{name}`: the state mixes arrays of dtypes {dtypes}, and its "
            "Jacobian is a `lineax` operator, which takes one input dtype. Give every array "
            "of the initial state the same dtype, e.g. "
            "`jax.tree.map(lambda x: x.astype(jnp.float64), y0)`."
        )


class _ChordState(eqx.Module):
    linear_state: Any
    diff: PyTree
    diffsize: Scalar
    diffsize_prev: Scalar
    result: optx.RESULTS
    step: Scalar


def _initial_state(y, linear_state) -> _ChordState:
    leaves = jtu.tree_leaves(y)
    dtype = jnp.result_type(*leaves) if leaves else jnp.result_type(float)
    dtype = jnp.finfo(dtype).dtype  # the real dtype of a complex state
    return _ChordState(
        linear_state=linear_state,
        diff=jtu.tree_map(lambda x: jnp.full(x.shape, jnp.inf, x.dtype), y),
        diffsize=jnp.array(jnp.inf, dtype=dtype),
        diffsize_prev=jnp.array(1.0, dtype=dtype),
        result=optx.RESULTS.successful,
        step=jnp.array(0),
    )


def _scale(solver, y):
    with jax.numpy_dtype_promotion("standard"):
        return jtu.tree_map(
            lambda v: solver.atol + jnp.maximum(solver.rtol, resolution(v.dtype)) * jnp.abs(v), y
        )


def _update(solver, y, fx, jac, linear_state, state: _ChordState):
    # An iterative linear solver needs to be only as accurate as the iteration's tests,
    # `kappa` in the norm of the scaled update (lineax takes no derivative through
    # `options`).
    options = lax.stop_gradient(dict(scale=_scale(solver, y), tolerance=solver.kappa))
    if linear_state is None:  # Newton: factored here
        sol = lx.linear_solve(jac, fx, solver.linear_solver, options=options, throw=False)
    else:
        sol = lx.linear_solve(
            jac, fx, solver.linear_solver, options=options, state=linear_state, throw=False
        )
    diff = sol.value
    new_y = jtu.tree_map(lambda a, b: a - b, y, diff)
    # An update that overflows (or a failed solve) ends the iteration as diverged (its
    # size is not finite); it returns the last finite iterate, not the infinite one. A
    # Diffrax implicit solver takes the returned value as its step's end, and an infinite
    # end makes `diffrax.PIDController`'s error scale infinite (it replaces a NaN end, not
    # an infinite one), its scaled error inf / inf = NaN and the next step size NaN: every
    # later step is then rejected, until `max_steps`.
    finite = all_finite(jtu.tree_leaves(new_y))
    new_y = jtu.tree_map(lambda a, b: jnp.where(finite, a, b), new_y, y)
    scale = _scale(solver, new_y)
    with jax.numpy_dtype_promotion("standard"):
        diffsize = solver.norm(jtu.tree_map(lambda d, s: d / s, diff, scale))
    new_state = _ChordState(
        linear_state=state.linear_state,
        diff=diff,
        diffsize=jnp.asarray(diffsize, state.diffsize.dtype),
        diffsize_prev=state.diffsize,
        result=optx.RESULTS.promote(sol.result),
        step=state.step + 1,
    )
    return new_y, new_state


def _terminate(solver, state: _ChordState):
    linsolve_fail = state.result != optx.RESULTS.successful
    if solver.cauchy_termination:
        # The last update is within `kappa` times the tolerances (atol + rtol |y|, in
        # `norm`): the stage equations are then solved well inside the error the step-size
        # controller allows the step (Hairer & Wanner, Solving ODEs II, IV.8: kappa Tol).
        # Within the tolerances alone, the iterate's error is as large as the step's: Newton
        # gave 0.7 fewer correct digits on HIRES at rtol 1e-4 (4.0 against 4.7).
        # No finer than the dtype resolves, though: in float32 at rtol 1e-5 an update
        # below kappa times the relative tolerance is below rounding, and would never come
        # (a purely absolute tolerance, rtol 0, keeps kappa).
        res = resolution(state.diffsize.dtype)
        rtol = jnp.asarray(solver.rtol)
        floor = jnp.where(rtol > 0, res / jnp.maximum(rtol, res), 0.0)
        threshold = jnp.maximum(solver.kappa, floor)
        converged = (state.step >= 1) & (state.diffsize < threshold)
        diverged = (state.step >= 1) & jnp.invert(jnp.isfinite(state.diffsize))
        result = optx.RESULTS.where(
            diverged, optx.RESULTS.nonlinear_divergence, optx.RESULTS.successful
        )
        result = optx.RESULTS.where(linsolve_fail, state.result, result)
        return linsolve_fail | converged | diverged, result
    at_least_two = state.step >= 2
    rate = state.diffsize / state.diffsize_prev
    factor = state.diffsize * rate / (1 - rate)
    small = _small(state.diffsize)
    diverged = _diverged(rate)
    converged = _converged(factor, solver.kappa)
    terminate = at_least_two & (small | diverged | converged)
    # Divergence only when the iterates diverge. Reporting a not-yet-converged iteration
    # as a divergence (Diffrax 0.7.2's `VeryChord`, optimistix <= 0.0.11) stops the loop
    # after its second step and rejects the Runge-Kutta step: about half of all steps on
    # stiff problems (optimistix issue #221, fixed upstream by optimistix PR #230).
    terminate_result = optx.RESULTS.where(
        at_least_two & jnp.invert(small) & diverged,
        optx.RESULTS.nonlinear_divergence,
        optx.RESULTS.successful,
    )
    result = optx.RESULTS.where(linsolve_fail, state.result, terminate_result)
    return linsolve_fail | terminate, result


class VeryChord(optx.AbstractRootFinder):
    """The chord method, linearised once per step, as `diffrax.VeryChord` (the root
    finder of Diffrax's implicit solvers) with its Jacobian from the structure engine.

    `diffrax.VeryChord` materialises `I - h γ J` through the identity basis and LU-factors
    it dense: $O(n^3)$ per step and $O(n^2)$ memory, whatever the structure of the vector
    field. Here the Jacobian of the stage function is
    [`diffrax_linearize.materialise_operator`][] of it, so a block-diagonal, banded or
    sparse pattern is kept through the shift, and it is factored by
    [`diffrax_linearize.StructuredLinearSolver`][] (a batched LU, a banded LU, GMRES) or
    LU where it is dense. The iteration and the `init_state` option Diffrax's Runge-Kutta
    methods use to linearise once per step are `diffrax.VeryChord`'s; its termination test
    is as fixed after Diffrax 0.7.2 (optimistix PR #230): a divergence only when the iterates
    diverge, not whenever two steps have not converged, which rejected about half of all
    steps on stiff problems. Tolerances below the resolution of the state's dtype (1e-5 in
    float32) are raised to it. A drop-in:

    ```python
    import diffrax
    import diffrax_linearize as dl

    solver = diffrax.Kvaerno5(root_finder=dl.VeryChord())
    ```

    A root finder, not a differential equation solver: pass it as `root_finder=` of an
    implicit solver (Diffrax's `ImplicitEuler`, `Kvaerno3`-`5`, `KenCarp3`-`5`, or
    [`diffrax_linearize.ImplicitEulerMaruyama`][] and the implicit Milstein solvers),
    never as the `solver` of `diffrax.diffeqsolve`, where Diffrax fails with
    `AttributeError: 'VeryChord' object has no attribute 'term_structure'`.
    """

    rtol: Any
    atol: Any
    norm: Callable[[PyTree], Scalar] | Any
    kappa: float
    linear_solver: lx.AbstractLinearSolver
    cauchy_termination: bool = eqx.field(static=True)

    def __init__(
        self,
        rtol=use_stepsize_tol,
        atol=use_stepsize_tol,
        norm=use_stepsize_tol,
        kappa: float = 1e-2,
        linear_solver: lx.AbstractLinearSolver = StructuredLinearSolver(),
        cauchy_termination: bool = False,
    ):
        """**Arguments:**

        - `rtol`, `atol`, `norm`: the tolerances and the norm for terminating the solve.
            By default they are taken from the step-size controller, as for Diffrax's
            default root finder (`diffrax.with_stepsize_controller_tols`); pass all three
            for a fixed step size.
        - `kappa`: the tolerance of the convergence tests, as a fraction of the
            tolerances: that of the rate test as in `diffrax.VeryChord`, and the bound on
            the last update of the Cauchy test.
        - `linear_solver`: the linear solver for the Newton step. Defaults to
            [`diffrax_linearize.StructuredLinearSolver`][].
        - `cauchy_termination`: `False` (the default) terminates as `diffrax.VeryChord`
            does, by the estimated rate of convergence (with the termination fixed as
            above, so fewer rejected steps than Diffrax 0.7.2's default). `True`
            terminates as soon as an update is within `kappa` times the tolerances (the
            test `optimistix.Chord` uses by default, there within the tolerances): robust
            where the
            first iterate is already converged (fixed steps), where the rate test can
            report divergence.
        """
        self.rtol = rtol
        self.atol = atol
        self.norm = norm
        self.kappa = kappa
        self.linear_solver = linear_solver
        self.cauchy_termination = cauchy_termination

    def __check_init__(self):
        _check_tols(self)

    def init(self, fn, y, args, options, f_struct, aux_struct, tags):
        try:
            return options["init_state"]
        except KeyError:
            pass
        jac = _jacobian(self, fn, y, args)
        linear_state = self.linear_solver.init(jac, options={})
        dynamic, static = eqx.partition(linear_state, eqx.is_array)
        linear_state = eqx.combine(lax.stop_gradient(dynamic), static)
        return _initial_state(y, (jac, linear_state))

    def step(self, fn, y, args, options, state, tags):
        fx, aux = fn(y, args)
        jac, linear_state = state.linear_state
        # Array leaves only: a Krylov solver's state holds its preconditioner as a function.
        dynamic, static = eqx.partition(linear_state, eqx.is_array)
        linear_state = eqx.combine(lax.stop_gradient(dynamic), static)
        new_y, new_state = _update(self, y, fx, jac, linear_state, state)
        return new_y, new_state, aux

    def terminate(self, fn, y, args, options, state, tags):
        return _terminate(self, state)

    def postprocess(self, fn, y, aux, args, options, state, tags, result):
        return y, aux, {}


class Newton(optx.AbstractRootFinder):
    """Newton's method with its Jacobian from the structure engine, recomputed at every
    iteration: as `optimistix.Newton`, but `J` is
    [`diffrax_linearize.materialise_operator`][] of the function, factored by
    [`diffrax_linearize.StructuredLinearSolver`][]. For `root_finder=` of Diffrax's implicit
    solvers, like [`diffrax_linearize.VeryChord`][]; more expensive per iteration, and
    more robust on strongly nonlinear stage equations.

    A root finder, not a differential equation solver: pass it as `root_finder=`
    (`diffrax.Kvaerno5(root_finder=dl.Newton())`), never as the `solver` of
    `diffrax.diffeqsolve`, where Diffrax fails with `AttributeError: 'Newton' object has
    no attribute 'term_structure'`.
    """

    rtol: Any
    atol: Any
    norm: Callable[[PyTree], Scalar] | Any
    kappa: float
    linear_solver: lx.AbstractLinearSolver
    cauchy_termination: bool = eqx.field(static=True)

    def __init__(
        self,
        rtol=use_stepsize_tol,
        atol=use_stepsize_tol,
        norm=use_stepsize_tol,
        kappa: float = 1e-2,
        linear_solver: lx.AbstractLinearSolver = StructuredLinearSolver(),
        cauchy_termination: bool = True,
    ):
        """**Arguments:**

        - `rtol`, `atol`, `norm`: the tolerances and the norm for terminating the solve.
            By default they are taken from the step-size controller, as for Diffrax's
            default root finder (`diffrax.with_stepsize_controller_tols`); pass all three
            for a fixed step size.
        - `kappa`: the tolerance of the convergence tests, as a fraction of the
            tolerances (as Hairer and Wanner's $\\kappa\\,\\mathrm{Tol}$ for the stage
            equations of an implicit Runge-Kutta step).
        - `linear_solver`: the linear solver for the Newton step. Defaults to
            [`diffrax_linearize.StructuredLinearSolver`][].
        - `cauchy_termination`: `True` (the default) terminates as soon as an update is
            within `kappa` times the tolerances (`optimistix.Newton` stops within the
            tolerances themselves, which leaves the stage equations solved only as well as
            the step's error is controlled); `False` by the estimated rate of convergence,
            as [`diffrax_linearize.VeryChord`][] does by default.
        """
        self.rtol = rtol
        self.atol = atol
        self.norm = norm
        self.kappa = kappa
        self.linear_solver = linear_solver
        self.cauchy_termination = cauchy_termination

    def __check_init__(self):
        _check_tols(self)

    def init(self, fn, y, args, options, f_struct, aux_struct, tags):
        _check_not_mixed(self, y)
        return _initial_state(y, None)

    def step(self, fn, y, args, options, state, tags):
        fx, aux = fn(y, args)
        jac = _jacobian(self, fn, y, args)
        new_y, new_state = _update(self, y, fx, jac, None, state)
        return new_y, new_state, aux

    def terminate(self, fn, y, args, options, state, tags):
        return _terminate(self, state)

    def postprocess(self, fn, y, aux, args, options, state, tags, result):
        return y, aux, {}


def _check_tols(solver):
    name = f"diffrax_linearize.{type(solver).__name__}"
    given = [getattr(solver, a) is not use_stepsize_tol for a in ("rtol", "atol", "norm")]
    if any(given) and not all(given):
        raise ValueError(
            f"`{name}`: pass all of `rtol`, `atol` and `norm`, or none of them (then they "
            "are taken from the step-size controller)."
        )
    for attr in ("rtol", "atol"):
        value = getattr(solver, attr)
        if value is not use_stepsize_tol and not (isinstance(value, int | float) and value >= 0):
            raise ValueError(f"`{name}`: `{attr}` must be a non-negative number, got {value!r}.")
    if not isinstance(solver.kappa, int | float) or solver.kappa <= 0:
        raise ValueError(f"`{name}`: `kappa` must be a positive number.")
    if not isinstance(solver.linear_solver, lx.AbstractLinearSolver):
        raise TypeError(
            f"`{name}`: `linear_solver` must be a `lineax.AbstractLinearSolver`, such as "
            "`diffrax_linearize.StructuredLinearSolver()`."
        )
