r"""Drift-implicit SDE solvers: the drift is treated implicitly (the theta method), the
diffusion and the Milstein correction explicitly, so that stiff drifts (reaction-diffusion
SPDEs, stiff mean reversion) can be stepped at the step size the noise needs, not the one
the drift's stiffness forces on explicit methods.

Each step solves $z - \theta\, \Delta t\, f(t_1, z) = r$ with a root finder whose Jacobian
comes from the structure engine ([`diffrax_linearize.VeryChord`][] by default), so a
block-diagonal, banded or sparse drift Jacobian is factored as such. Kloeden & Platen,
Numerical Solution of Stochastic Differential Equations, section 12.2.
"""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import lineax as lx
import optimistix as optx
from diffrax import (
    AbstractAdaptiveSolver,
    AbstractImplicitSolver,
    AbstractItoSolver,
    AbstractStratonovichSolver,
    LocalLinearInterpolation,
    RESULTS,
)

from .._brownian_carry import carried_terms, init_carry
from .._linear_solver import StructuredLinearSolver
from .._materialise import solver_operator
from .._root_finder import VeryChord
from .._term import real_noise_on_complex_state
from .failure import rejectable
from .milstein import _error_estimate, _milstein_parts, _StepParts, _Terms, _Y
from .milstein_general import _general_milstein_parts


def _default_root_finder():
    # Fixed steps: terminate once an update is within the tolerances (the rate test of
    # `diffrax.VeryChord` reports divergence when the predictor is already converged).
    return VeryChord(rtol=1e-8, atol=1e-8, norm=optx.max_norm, cauchy_termination=True)


def _check(solver, name: str):
    if not (isinstance(solver.theta, int | float) and 0 <= solver.theta <= 1):
        raise ValueError(f"`diffrax_linearize.{name}`: `theta` must lie in [0, 1].")
    if not isinstance(solver.root_finder, optx.AbstractRootFinder):
        raise TypeError(
            f"`diffrax_linearize.{name}`: `root_finder` must be an "
            "`optimistix.AbstractRootFinder`, such as `diffrax_linearize.VeryChord(rtol=1e-8, "
            "atol=1e-8, norm=optimistix.max_norm)`."
        )
    if not isinstance(solver.root_find_max_steps, int) or solver.root_find_max_steps < 1:
        raise ValueError(f"`diffrax_linearize.{name}`: `root_find_max_steps` must be >= 1.")


def _implicit_drift(solver, terms, t0, t1, y0, args, explicit: _Y):
    r"""Given the explicit step `explicit` (drift at `t0`), solve
    $z = \text{explicit} + \theta \Delta t (f(t_1, z) - f(t_0, y_0))$ for `z`. Returns `z`,
    the result, and, with `VeryChord`, the operator it linearised and its factorisation
    (`None` otherwise), for the error filter."""
    drift, _ = terms.terms
    theta = solver.theta
    if theta == 0:
        return explicit, RESULTS.successful, None
    f0 = drift.vf_prod(t0, y0, args, drift.contr(t0, t1))
    with jax.numpy_dtype_promotion("standard"):
        rhs = jtu.tree_map(lambda e, f: e - theta * f, explicit, f0)

    def relation(z, args):
        fz = drift.vf_prod(t1, z, args, drift.contr(t0, t1))
        with jax.numpy_dtype_promotion("standard"):
            return jtu.tree_map(lambda z, f, r: z - theta * f - r, z, fz, rhs)

    sol = optx.root_find(
        relation,
        solver.root_finder,
        explicit,
        args,
        throw=False,
        max_steps=solver.root_find_max_steps,
    )
    # `VeryChord` keeps its operator, `I - theta dt df/dy` at the predictor, and its
    # factorisation in its state: the filter's operator, but for where it is taken.
    factored = sol.state.linear_state if isinstance(solver.root_finder, VeryChord) else None
    return sol.value, RESULTS.promote(sol.result), factored


def _trapezoidal_drift_error(terms, t0, t1, y0, y1, args, parts: _StepParts) -> _Y:
    r"""The trapezoidal rule's own local drift error, $-\tfrac1{12} h^3 y^{(3)}$,
    estimated as $-\tfrac1{12} h^2 \big(\ddot y(t_1) - \ddot y(t_0)\big)$, with $\ddot y =
    \partial_t f + \partial_y f\, f$ at $(t_0, y_0)$ and at $(t_1, y_1)$: one JVP of the drift
    at each end of the step.

    The theta method's local drift error (exact minus step) is $(\tfrac12 - \theta) h^2 y''
    - (\tfrac\theta2 - \tfrac16) h^3 y^{(3)}$. The weight $\tfrac12 - \theta$ of
    `_error_estimate` gives the difference from the trapezoidal rule, $(\tfrac12 - \theta)
    h (f_1 - f_0) = (\tfrac12 - \theta)(h^2 y'' + \tfrac12 h^3 y^{(3)}) + O(h^4)$; this is
    the rest. At $\theta = \tfrac12$ it is the whole drift part of the estimate, which
    would otherwise be zero: the controller would see no drift error and take steps far too
    long on a drift-dominated SDE. The difference of $\ddot y$, not of $f$, keeps the noise
    out: $f(t_1, y_1) - f(t_0, y_0)$ carries $\partial_y f\, g\, \Delta W$, of order
    $h^{1/2}$, which $h^2 \ddot y$ carries only at order $h^{5/2}$. Under a constant step
    size nothing reads it."""
    drift, _ = terms.terms
    dt = parts.dt

    def curvature(t, y, f_prod):
        # h^2 (d/dt) f(t, y(t)) = the drift's JVP along (h, f h).
        t = jnp.asarray(t)
        h = jnp.asarray(t1 - t0, dtype=t.dtype)
        return jax.jvp(lambda t, z: drift.vf_prod(t, z, args, dt), (t, y), (h, f_prod))[1]

    c0 = curvature(t0, y0, parts.f0_prod)
    c1 = curvature(t1, y1, drift.vf_prod(t1, y1, args, dt))

    def leaf(y, c0, c1):
        return (-(c1 - c0) / 12).astype(jnp.result_type(y))

    with jax.numpy_dtype_promotion("standard"):
        return jtu.tree_map(leaf, y1, c0, c1)


def _filter_stiff(solver, terms, t0, t1, y1, args, y_error: _Y, factored) -> _Y:
    r"""$(I - \theta \Delta t\, \partial_y f)^{-1} E$: the error estimate with its stiff
    components damped as the implicit step damps them. Unfiltered, an estimate built from
    $f(t_1, y_1) - f(t_0, y_0)$ grows like $|\Delta t \lambda|$ along a stiff eigenvalue
    $\lambda$ of the drift, where the step's true error is damped, and the controller
    shrinks the step to the explicit stability limit (Shampine's filter; Hairer & Wanner,
    Solving ODEs II, section IV.8). Any $\partial_y f$ near the step's serves, as in
    RADAU5, which filters with the factorisation of its step: `factored`, `VeryChord`'s
    operator at the predictor and its factorisation, is used as it is (no Jacobian and no
    factorisation more); with another root finder (`None`) the operator is taken at
    $(t_1, y_1)$, with the drift Jacobian's structure kept. Under a constant step size
    nothing reads it."""
    # A failed root find's infinite estimate stays infinite (the step is rejected).
    finite = jtu.tree_map(lambda e: jnp.where(jnp.isfinite(e), e, 0), y_error)
    if factored is None:
        drift, _ = terms.terms
        dt = drift.contr(t0, t1)

        def relation(z, args):
            fz = drift.vf_prod(t1, z, args, dt)
            with jax.numpy_dtype_promotion("standard"):
                return jtu.tree_map(lambda z, f: z - solver.theta * f, z, fz)

        operator = solver_operator(relation, y1, args)
        sol = lx.linear_solve(operator, finite, StructuredLinearSolver(), throw=False)
    else:
        operator, state = factored
        linear_solver = solver.root_finder.linear_solver
        sol = lx.linear_solve(operator, finite, linear_solver, state=state, throw=False)
    return jtu.tree_map(lambda f, e: jnp.where(jnp.isfinite(e), f, e), sol.value, y_error)


class _DriftImplicit:
    """What the drift-implicit solvers share: the Brownian tree's value at the end of the
    last step as solver state (`_brownian_carry.py`), local linear interpolation, `func`
    evaluating the drift and the diffusion, and a `step` that takes the solver's explicit
    step `_explicit(terms, t0, t1, y0, args)` (and what its error estimate needs) and makes
    its drift implicit."""

    # Whether the step has the Milstein correction (whose part the error estimate removes).
    _milstein: ClassVar[bool] = True

    interpolation_cls: ClassVar = LocalLinearInterpolation
    term_structure: ClassVar = _Terms

    def order(self, terms):
        return 1

    def init(self, terms, t0, t1, y0, args):
        return init_carry(terms, t0)

    def func(self, terms, t0, y0, args):
        drift, diffusion = terms.terms
        return drift.vf(t0, y0, args), diffusion.vf(t0, y0, args)

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        del made_jump
        terms, solver_state = carried_terms(terms, t0, t1, solver_state)
        terms = real_noise_on_complex_state(terms, t0, y0)
        explicit, parts = self._explicit(terms, t0, t1, y0, args)
        y1, result, factored = _implicit_drift(self, terms, t0, t1, y0, args, explicit)
        # The weight 1/2 - theta: the difference from the trapezoidal rule in the drift.
        y_error = _error_estimate(
            terms, t1, y1, args, parts, drift_weight=0.5 - self.theta, milstein=self._milstein
        )
        if self.theta != 0:
            # And the trapezoidal rule's own drift error: at theta = 1/2 the whole drift part.
            third = _trapezoidal_drift_error(terms, t0, t1, y0, y1, args, parts)
            y_error = jtu.tree_map(lambda e, d: e + d, y_error, third)
            y_error = _filter_stiff(self, terms, t0, t1, y1, args, y_error, factored)
        # A step whose root find failed is rejected by an adaptive controller (which then
        # shrinks the step), as for Diffrax's implicit solvers; under a constant step size
        # the failure is reported as before.
        y1, y_error = rejectable(result, y0, y1, y_error)
        return y1, y_error, dict(y0=y0, y1=y1), solver_state, result


class ImplicitEulerMaruyama(
    _DriftImplicit, AbstractImplicitSolver, AbstractAdaptiveSolver, AbstractItoSolver
):
    r"""The drift-implicit Euler-Maruyama method (the theta method in the drift). Converges
    to the Itô solution with strong order 0.5 (1 for additive noise). For the SDE
    $\mathrm{d}y = f(t, y)\,\mathrm{d}t + g(t, y)\,\mathrm{d}W$, one step is

    $$y_1 = y_0 + \big(\theta f(t_1, y_1) + (1 - \theta) f(t_0, y_0)\big) \Delta t
    + g(t_0, y_0) \Delta W,$$

    solved for $y_1$ with `root_finder`. With $\theta = 1$ (the default) it is
    A-stable in the drift: bounded for any step on a stiff linear drift, where
    `diffrax.Euler` needs $|h \lambda| < 2$.

    Call with `terms=MultiTerm(drift_term, diffusion_term)`, as `diffrax.Euler`.
    """

    theta: float
    root_finder: optx.AbstractRootFinder
    root_find_max_steps: int = eqx.field(static=True)

    _milstein: ClassVar[bool] = False

    def __init__(
        self,
        theta: float = 1.0,
        root_finder: optx.AbstractRootFinder | None = None,
        root_find_max_steps: int = 10,
    ):
        r"""**Arguments:**

        - `theta`: the weight of the drift at the end of the step: `1` is fully implicit
            (the default), `0.5` the trapezoidal rule, `0` explicit Euler-Maruyama.
        - `root_finder`: solves for the end of the step. Defaults to
            [`diffrax_linearize.VeryChord`][] with `rtol = atol = 1e-8`,
            `norm=optimistix.max_norm` and `cauchy_termination=True`,
            whose Jacobian keeps the drift's structure. A root finder whose tolerances are
            `diffrax`'s "taken from the step-size controller" default takes them from an
            adaptive controller (with `diffrax.HalfSolver`).
        - `root_find_max_steps`: the most root-finding iterations per step.
        """
        self.theta = theta
        self.root_finder = _default_root_finder() if root_finder is None else root_finder
        self.root_find_max_steps = root_find_max_steps

    def __check_init__(self):
        _check(self, "ImplicitEulerMaruyama")

    def strong_order(self, terms):
        return 0.5

    def _explicit(self, terms, t0, t1, y0, args):
        drift, diffusion = terms.terms
        f0 = drift.vf_prod(t0, y0, args, drift.contr(t0, t1))
        g0 = diffusion.vf_prod(t0, y0, args, diffusion.contr(t0, t1))
        with jax.numpy_dtype_promotion("standard"):
            explicit = jtu.tree_map(lambda y, f, g: y + f + g, y0, f0, g0)
        return explicit, _StepParts(drift.contr(t0, t1), diffusion.contr(t0, t1), f0, g0, None)


class ImplicitItoMilstein(
    _DriftImplicit, AbstractImplicitSolver, AbstractAdaptiveSolver, AbstractItoSolver
):
    r"""Milstein's method with an implicit drift; Itô version. Strong order 1 on
    commutative noise (on any noise with `general_noise=True`), and stable on stiff
    drifts. One step is

    $$y_1 = y_0 + \big(\theta f(t_1, y_1) + (1 - \theta) f(t_0, y_0)\big) \Delta t
    + g \Delta W + \tfrac{1}{2} \sum_{j_1, j_2} (L^{j_1} g_{:, j_2})
    (\Delta W_{j_1} \Delta W_{j_2} - \delta_{j_1 j_2} \Delta t),$$

    with $g$ and $L^j g = \sum_k g_{kj} \partial_k g$ at $(t_0, y_0)$, solved for $y_1$ with
    `root_finder` (Kloeden & Platen, section 12.2). The explicit part is
    [`diffrax_linearize.ItoMilstein`][]'s step (or
    [`diffrax_linearize.GeneralItoMilstein`][]'s, with simulated iterated integrals).

    Call with `terms=MultiTerm(drift_term, diffusion_term)`, as
    [`diffrax_linearize.ItoMilstein`][].
    """

    theta: float
    general_noise: bool = eqx.field(static=True)
    root_finder: optx.AbstractRootFinder
    root_find_max_steps: int = eqx.field(static=True)

    def __init__(
        self,
        theta: float = 1.0,
        general_noise: bool = False,
        root_finder: optx.AbstractRootFinder | None = None,
        root_find_max_steps: int = 10,
    ):
        r"""**Arguments:**

        - `theta`: the weight of the drift at the end of the step: `1` is fully implicit
            (the default), `0.5` the trapezoidal rule, `0` the explicit Milstein method.
        - `general_noise`: `False` (the default) for commutative noise: the Milstein
            correction is one JVP, as in [`diffrax_linearize.ItoMilstein`][]. `True` for
            any noise: the correction uses the iterated integrals of the Brownian motion,
            as in [`diffrax_linearize.GeneralItoMilstein`][], and the diffusion's control
            must be a [`diffrax_linearize.LevyAreaBrownianPath`][].
        - `root_finder`: solves for the end of the step. Defaults to
            [`diffrax_linearize.VeryChord`][] with `rtol = atol = 1e-8`,
            `norm=optimistix.max_norm` and `cauchy_termination=True`,
            whose Jacobian keeps the drift's structure.
        - `root_find_max_steps`: the most root-finding iterations per step.
        """
        self.theta = theta
        self.general_noise = general_noise
        self.root_finder = _default_root_finder() if root_finder is None else root_finder
        self.root_find_max_steps = root_find_max_steps

    def __check_init__(self):
        _check(self, "ImplicitItoMilstein")
        if not isinstance(self.general_noise, bool):
            raise TypeError(
                "`diffrax_linearize.ImplicitItoMilstein`: `general_noise` must be a bool."
            )

    def _explicit(self, terms, t0, t1, y0, args):
        if self.general_noise:
            return _general_milstein_parts(
                "ImplicitItoMilstein", True, "auto", terms, t0, t1, y0, args
            )
        return _milstein_parts("ImplicitItoMilstein", True, False, terms, t0, t1, y0, args)

    def strong_order(self, terms):
        return 1


class ImplicitStratonovichMilstein(
    _DriftImplicit, AbstractImplicitSolver, AbstractAdaptiveSolver, AbstractStratonovichSolver
):
    r"""Milstein's method with an implicit drift; Stratonovich version. Strong order 1 on
    commutative noise (on any noise with `general_noise=True`), and stable on stiff
    drifts. One step is

    $$y_1 = y_0 + \big(\theta f(t_1, y_1) + (1 - \theta) f(t_0, y_0)\big) \Delta t
    + g \Delta W + \tfrac{1}{2} \sum_{j_1, j_2} (L^{j_1} g_{:, j_2})
    \Delta W_{j_1} \Delta W_{j_2},$$

    solved for $y_1$ with `root_finder`. The explicit part is
    [`diffrax_linearize.StratonovichMilstein`][]'s step (or
    [`diffrax_linearize.GeneralStratonovichMilstein`][]'s).

    Call with `terms=MultiTerm(drift_term, diffusion_term)`, as
    [`diffrax_linearize.StratonovichMilstein`][].
    """

    theta: float
    general_noise: bool = eqx.field(static=True)
    root_finder: optx.AbstractRootFinder
    root_find_max_steps: int = eqx.field(static=True)

    def __init__(
        self,
        theta: float = 1.0,
        general_noise: bool = False,
        root_finder: optx.AbstractRootFinder | None = None,
        root_find_max_steps: int = 10,
    ):
        r"""**Arguments:**

        - `theta`: the weight of the drift at the end of the step: `1` is fully implicit
            (the default), `0.5` the trapezoidal rule, `0` the explicit Milstein method.
        - `general_noise`: `False` (the default) for commutative noise: the Milstein
            correction is one JVP, as in [`diffrax_linearize.StratonovichMilstein`][].
            `True` for any noise: the correction uses the iterated integrals of the
            Brownian motion, as in [`diffrax_linearize.GeneralStratonovichMilstein`][], and
            the diffusion's control must be a [`diffrax_linearize.LevyAreaBrownianPath`][].
        - `root_finder`: solves for the end of the step. Defaults to
            [`diffrax_linearize.VeryChord`][] with `rtol = atol = 1e-8`,
            `norm=optimistix.max_norm` and `cauchy_termination=True`,
            whose Jacobian keeps the drift's structure.
        - `root_find_max_steps`: the most root-finding iterations per step.
        """
        self.theta = theta
        self.general_noise = general_noise
        self.root_finder = _default_root_finder() if root_finder is None else root_finder
        self.root_find_max_steps = root_find_max_steps

    def __check_init__(self):
        _check(self, "ImplicitStratonovichMilstein")
        if not isinstance(self.general_noise, bool):
            raise TypeError(
                "`diffrax_linearize.ImplicitStratonovichMilstein`: `general_noise` must be a bool."
            )

    def _explicit(self, terms, t0, t1, y0, args):
        if self.general_noise:
            return _general_milstein_parts(
                "ImplicitStratonovichMilstein", False, "auto", terms, t0, t1, y0, args
            )
        return _milstein_parts(
            "ImplicitStratonovichMilstein", False, False, terms, t0, t1, y0, args
        )

    def strong_order(self, terms):
        return 1
