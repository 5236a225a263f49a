r"""A BDF/NDF solver for large stiff ODEs: the Jacobian and the factorisation of the Newton
matrix are carried across steps, so that most steps make one or two linear solves with an
old factorisation and no new Jacobian, as CVODE, scipy's `BDF` and OrdinaryDiffEq.jl's
`FBDF` do.

The design is scipy's (`scipy/integrate/_ivp/bdf.py`, after L. F. Shampine and M. W.
Reichelt, *The MATLAB ODE suite*, SIAM J. Sci. Comput. 18, 1997): the history is the array
of backward differences of the interpolating polynomial, rescaled when the step size
changes; the corrector is solved by a chord iteration; the local error is estimated from
the difference between the corrector and the predictor. The Jacobian comes from the
structure engine and is factored by [`diffrax_linearize.StructuredLinearSolver`][], through
the machinery of [`diffrax_linearize.ROS34PW2`][].
"""

from typing import Any, ClassVar

import diffrax
import equinox as eqx
import jax
import jax.flatten_util as jfu
import jax.numpy as jnp
import jax.tree_util as jtu
import lineax as lx
import numpy as np
import optimistix as optx
from diffrax import (
    AbstractAdaptiveSolver,
    AbstractImplicitSolver,
    AbstractLocalInterpolation,
    RESULTS,
)

from .._diagonal import jacobian_diagonal
from .._linear_solver import (
    detach,
    is_detached,
    jvp_product,
    matrix_free,
    StructuredLinearSolver,
    with_diagonal,
)
from .._materialise import solver_operator
from .._root_finder import check_real_or_complex, VeryChord
from .corrector import corrector, without_derivatives
from .failure import rejectable
from .rosenbrock import _affine, _check_ode, _flat_increment


_MAX_ORDER = 5
# The scaled error that the variable order returns to hold the step size: the default
# `safety` of `diffrax.PIDController` and `PredictiveController`, whose factor
# `safety / error` is then 1. Diffrax's PI factor `safety / error**(i + p) * prev**p`
# (`prev` < 1, an accepted error) is then at most 1 for `i + p <= 1`, and Diffrax clips it
# to 1 after an accepted step.
_HOLD = 0.9
# A relative change of the step size below which the variable order counts the step as
# one of equal size (for its q + 1 steps between choices).
_SAME_H = 1e-2
# The NDF coefficients of Shampine & Reichelt (kappa = 0 is the BDF), as scipy's.
_KAPPA = np.array([0.0, -0.1850, -1 / 9, -0.0823, -0.0415, 0.0])


def _real(dtype):
    # The real dtype of a state's dtype: step sizes, coefficients, rates and norms are
    # real for a complex state too (as scipy's `BDF` and Diffrax's controllers keep them).
    return jnp.finfo(dtype).dtype


def _coefficients(ndf: bool):
    kappa = _KAPPA if ndf else np.zeros_like(_KAPPA)
    gamma = np.concatenate([[0.0], np.cumsum(1 / np.arange(1, _MAX_ORDER + 1))])
    alpha = (1 - kappa) * gamma
    error_const = kappa * gamma + 1 / np.arange(1, _MAX_ORDER + 2)
    return gamma, alpha, error_const


def _combine(weights, rows):
    """`weights @ rows`, for a small `(m, r)` matrix of weights and `r` long rows (the
    differences `D`): written out as `m` sums of `r` scaled rows, which XLA fuses into one
    pass over the rows. XLA's CPU backend makes a product or a reduction over a few long
    rows (`jnp.sum(..., axis=0)`, `jnp.cumsum`) several times slower, and on GPUs a
    float32 product would round through TF32."""
    m, r = weights.shape
    # Real weights on a complex state's rows: cast, exactly, as strict promotion wants.
    weights = weights.astype(jnp.result_type(rows[0]))
    return jnp.stack([sum(weights[i, j] * rows[j] for j in range(r)) for i in range(m)])


def _matmul(a, b):
    # Of small matrices of coefficients: at full precision, not TF32 on GPUs.
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def _rescale_matrix(order: int, factor):
    """scipy's `compute_R`, for the largest order: its leading `(q + 1, q + 1)` block is
    the matrix for order `q` (the rows are cumulative products down the columns)."""
    # In the dtype of `factor` and of equal ranks: integer arrays would not promote, nor
    # ranks broadcast, under JAX's strict promotion (`jax_numpy_dtype_promotion="strict"`,
    # `jax_numpy_rank_promotion="raise"`, as Diffrax's own tests run).
    dtype = jnp.result_type(factor)
    i = np.arange(1, order + 1, dtype=dtype)[:, None]
    j = np.arange(1, order + 1, dtype=dtype)[None, :]
    m = (i - 1 - factor * j) / i
    m = jnp.concatenate([jnp.ones((1, order), m.dtype), m], axis=0)
    m = jnp.concatenate([jnp.ones((order + 1, 1), m.dtype), m], axis=1)
    m = m.at[1:, 0].set(0.0).at[0].set(1.0)
    return jnp.cumprod(m, axis=0)


def _rescale_weights(q, factor, max_order: int):
    r"""scipy's `change_D` as a matrix: the rows `0` to `max_order` of the differences for
    step size $h$ to those for $\text{factor} \cdot h$, of the polynomial of degree `q`
    (a traced order; rows above `q` are kept)."""
    dtype = factor.dtype
    R = _rescale_matrix(max_order, factor)
    U = _rescale_matrix(max_order, np.ones((), dtype))
    RU = _matmul(R, U)
    idx = jnp.arange(max_order + 1, dtype=jnp.int32)
    inside = (idx[:, None] <= q) & (idx[None, :] <= q)
    return jnp.where(inside, RU, jnp.eye(max_order + 1, dtype=dtype)).T


def _rescale(D, q, factor, max_order: int):
    """The differences `D` rescaled by `_rescale_weights` (rows above `max_order`
    kept)."""
    weights = _rescale_weights(q, factor.astype(_real(D.dtype)), max_order)
    return D.at[: max_order + 1].set(_combine(weights, D[: max_order + 1]))


def _scaled_norm(norm, v, scale):
    # The norm of `v / scale`, real (optimistix's norms take magnitudes of complex
    # entries); `scale` is real, as Diffrax's controllers keep it.
    with jax.numpy_dtype_promotion("standard"):
        return jnp.asarray(norm(v / scale)).astype(scale.dtype)


class BDFState(eqx.Module):
    r"""The state a [`diffrax_linearize.BDF`][] solver carries between steps (read it with
    `diffrax.SaveAt(solver_state=True)`).

    **Arguments:**

    - `D`: the backward differences of the interpolating polynomial, for the step size
        `h`, flattened (rows `0` to `order + 2` used; row 0 is the state).
    - `h`: the size of the last accepted step.
    - `order`: the order of the next step. It starts at 1; with `variable_order=False`
        it rises to `max_order` while the history fills, with `variable_order=True` the
        solver chooses it (1 to `max_order`).
    - `steps_at_order`: the accepted steps made at `order` (with `variable_order=True`,
        at `order` and the step size `h`, since the order was last considered).
    - `M_J`, `dM`: $M = I - c_J J$ and $-h_J J$ at the Jacobian's step, the structured
        operators of [`diffrax_linearize.materialise_operator`][], so that
        $I - c J = M_J + ((c - c_J)/h_J)\, dM$; on the GMRES path of
        [`diffrax_linearize.StructuredLinearSolver`][], their diagonals only
        (`lineax.DiagonalLinearOperator`s), all that its Jacobi preconditioner reads.
    - `h_J`, `c_J`: the step size and the coefficient $c = h / \alpha_q$ of the
        Jacobian; `c_W`: the coefficient of the factorisation.
    - `t_J`, `y_J`: where the Jacobian was evaluated (for its products by forward-mode
        differentiation of the vector field, when the linear solver is GMRES).
    - `factorisation`: the linear solver's state for $I - c_W J$.
    - `jacobian_age`: the accepted steps since the Jacobian was evaluated.
    - `slow`: whether the last step's chord iteration converged slowly (the next step
        evaluates a new Jacobian).
    - `rate`: the last estimated rate of convergence of the chord iteration (CVODE's
        `crate`), 1 after a new factorisation.
    - `num_jacobians`, `num_factorisations`, `num_newton_iterations`: the Jacobians,
        factorisations and chord iterations (one linear solve and one evaluation of $f$
        each) of the accepted steps and of `init`; a rejected step's state is discarded
        by Diffrax, so its work is not counted.
    - `num_steps_by_order`: the accepted steps made at each order, orders 1 to 5 (entry
        `i` for order `i + 1`).
    """

    D: Any
    h: Any
    order: Any
    steps_at_order: Any
    M_J: lx.AbstractLinearOperator
    dM: lx.AbstractLinearOperator
    h_J: Any
    c_J: Any
    t_J: Any
    y_J: Any
    c_W: Any
    factorisation: Any
    jacobian_age: Any
    slow: Any
    rate: Any
    num_jacobians: Any
    num_factorisations: Any
    num_newton_iterations: Any
    num_steps_by_order: Any


class _BDFInterpolation(AbstractLocalInterpolation):
    r"""The interpolating polynomial of the step's history, as scipy's `BdfDenseOutput`:
    $y(t) = D_0 + \sum_{j=1}^{q} D_j \prod_{i=0}^{j-1} (t - t_1 + i h) / ((i + 1) h)$,
    with the differences of the step, of order `order` (rows above it are not used)."""

    t0: Any
    t1: Any
    y0: Any
    D: Any  # flat, (max_order + 2, n)
    order: Any

    def evaluate(self, t0, t1=None, left: bool = True):
        del left
        if t1 is not None:
            return jtu.tree_map(lambda a, b: a - b, self.evaluate(t1), self.evaluate(t0))
        _, unravel = jfu.ravel_pytree(self.y0)
        dtype = self.D.dtype
        with jax.numpy_dtype_promotion("standard"):
            h = jnp.asarray(self.t1 - self.t0)
            x = (t0 - self.t1 + h * np.arange(self.D.shape[0] - 1)) / (
                h * (1 + np.arange(self.D.shape[0] - 1))
            )
            p = jnp.cumprod(x).astype(dtype)
        p = jnp.where(np.arange(1, self.D.shape[0], dtype=np.int32) <= self.order, p, 0)
        return unravel(self.D[0] + _combine(p[None], self.D[1:])[0])


class BDF(AbstractImplicitSolver, AbstractAdaptiveSolver):
    r"""A BDF (or NDF) method for large stiff ODEs, which keeps its Jacobian
    and the factorisation of its Newton matrix across steps: most steps evaluate no
    Jacobian, factor nothing and make one or two linear solves, as CVODE, scipy's `BDF`
    and OrdinaryDiffEq.jl's `FBDF` do. Against [`diffrax_linearize.ROS34PW2`][] (four
    solves a step) and `diffrax.Kvaerno5` (a factorisation every step, five implicit
    stages), it suits large systems whose Jacobian is expensive to evaluate or factor.

    The step of order $q$ is scipy's (Shampine & Reichelt's NDF in backward-difference
    form, with the differences $D$ rescaled when $h$ changes): predictor
    $y^{(0)} = \sum_{j \le q} D_j$, corrector $y - y^{(0)} = c\,f(t_1, y) - \psi$ with
    $c = h/\alpha_q$, $\psi = \sum_{j=1}^q \gamma_j D_j / \alpha_q$, solved by a chord
    iteration with the factorisation of $I - c_W J$; the error estimate is
    $(\kappa_q \gamma_q + 1/(q+1))\,(y - y^{(0)})$, of order $q + 1$.

    - **Variable order** (`variable_order=True`): the order is chosen as scipy's `BDF`
      and CVODE choose it. A solve starts at order 1 (and starts again there after a
      jump, `made_jump`); after $q + 1$ steps at order $q$, the scaled errors $E_{q-1}$,
      $E_q$ and $E_{q+1}$ that orders $q - 1$, $q$ and $q + 1$ would have made (from the
      differences of orders $q$ and $q + 2$; the last step's correction is rescaled when
      $h$ changes, as CVODE does, since Diffrax's controllers change $h$ at every step)
      give the step-size factors $E_k^{-1/(k+1)}$, and the next step takes the order
      with the largest. The solver carries its choice in its state and passes the step
      size it proposes to the controller through the error it returns: the order-$q$
      error, rescaled so that its scaled norm is the inverse of the proposed factor
      (`error_order` is then 1). Diffrax's adaptive controllers follow it (not
      [`diffrax_linearize.PredictiveController`][], whose prediction from the last two
      errors would read a held step's constant error as a trend; it raises):
      `diffrax.PIDController` with its default coefficients takes scipy's step size
      ($0.9$ times the factor, clipped to $[1, 10]$ after an accepted step), and accepts
      a step exactly when $E_q < 1$. Between two choices an accepted step returns an
      error of norm $0.9$, the default `safety` of `diffrax.PIDController`, which then
      keeps the step size (with PI coefficients too, when `pcoeff + icoeff <= 1`): as
      scipy and CVODE, the solver changes its step size and its order only after $q + 1$
      steps of one size (counted again after a rejection, or a step cut short by `t1`).
      Without that rest, with the step size changing at every step, orders 4 and 5 on
      Robertson's problem to $t = 10^{10}$ at `rtol=1e-4, atol=1e-6` let the small
      concentrations drift below zero, where the equations blow up. The scaling uses
      the tolerances and norm of `root_finder`, which `diffrax.diffeqsolve` takes from
      the controller: leave them unset (the default).
    - **Fixed order** (`variable_order=False`): order `max_order` once the history has
      filled, so that Diffrax's step-size controller, which takes one static order, sees
      the order of the error estimate it controls. The first steps ramp up from order
      1, one order after $q + 1$ steps at order $q$, as the history fills (and again
      after a jump); the controller then assumes order `max_order` for estimates of a
      lower order, and reacts less than it should: a few more steps and rejections at
      the start, never a wrong acceptance, since a step is accepted only when the
      estimate is below the tolerance.
    - **Jacobian and factorisation:** the Jacobian (from
      [`diffrax_linearize.materialise_operator`][], block-diagonal, banded or sparse as
      the vector field is; factored by `linear_solver`) is evaluated at the predictor
      when `jacobian_every` steps have used the old one, after a step whose chord
      iteration needed three iterations or more, after a jump, and when the chord
      iteration fails with an old one: then the step is retried at once with a fresh
      Jacobian (a `jax.lax.cond`), since Diffrax discards the state of a rejected step.
      The factorisation of $I - c J$ is renewed when $c$ has changed by more than a
      factor `refactor_ratio` since it was made; in between, the corrections are scaled
      by $2 / (1 + c / c_W)$ as CVODE does. Under `jax.vmap` over initial conditions
      the `cond`s become `select`s that run both branches: every step then pays for a
      Jacobian and a factorisation.
    - **Chord iteration:** at most `root_find_max_steps` iterations (4, scipy's); it
      stops when the estimated distance to the solution is below
      $\max(10 \epsilon / \mathrm{rtol}, \kappa)$ in the `norm` of the scaled error (a
      fixed fraction of the tolerance, as CVODE's test; scipy's iterates further at
      tight tolerances, to $\min(\kappa, \sqrt{\mathrm{rtol}})$), or fails when it
      diverges or will not converge in time (scipy's tests); the first iteration may
      stop alone with the previous step's rate (CVODE's test). `rtol`, `atol`, `norm`
      and `kappa` are those of `root_finder`, whose tolerances `diffrax.diffeqsolve`
      takes from the step-size controller, as for Diffrax's implicit solvers; the
      iteration itself is this solver's, with its own factorisation. When it fails the
      step returns an infinite error estimate: an adaptive controller rejects the step;
      with a constant step size the solve stops with
      `diffrax.RESULTS.nonlinear_divergence`.
    - **Interpolation:** the step's interpolating polynomial (scipy's `BdfDenseOutput`),
      of degree $q$.

    For ODEs only (one `diffrax.ODETerm`). The state may be any pytree of real arrays,
    float32 or float64 (flattened with `jax.flatten_util.ravel_pytree`; a single array
    keeps its Jacobian's structure), or of complex ones, complex64 or complex128 (not a
    mix of real and complex: a `TypeError`). For a complex state the step sizes,
    coefficients and norms stay real (the norms of magnitudes, as scipy's `BDF` and
    Diffrax's controllers take them) and the Jacobian is the complex one
    `jax.jacfwd(..., holomorphic=True)` gives, as for Diffrax's implicit solvers (on the
    GMRES path too, where its products are two tangents of one forward pass): exact for
    a vector field holomorphic in $y$; for another (`jnp.conj`, `jnp.abs`) the
    complex-linear map that agrees with the derivative along real directions, with
    which the chord iteration converges more slowly, to the same corrector. Gradients
    differentiate the corrector as its real and imaginary parts, exact for either. Use it with
    `diffrax.PIDController` or [`diffrax_linearize.PredictiveController`][]; with a
    constant step size, pass
    `root_finder=diffrax_linearize.VeryChord(rtol=..., atol=..., norm=...)`.

    **Arguments:**

    - `max_order`: the order $q$ of the method once its history has filled (the highest
        order it may choose, with `variable_order=True`), 1 to 5; 3 by default. Orders
        1 and 2 are A-stable; higher orders lose stability near the imaginary axis,
        and, more to the point here, stability under changes of the step size: scipy
        and CVODE change $h$ only after $q + 1$ steps of one size, where Diffrax's
        controllers change it at every step. Orders 4 and 5 take fewer steps at tight
        tolerances on smooth problems, but on Robertson's problem to $t = 10^{10}$ with
        `rtol=1e-4` a fixed order 5 lets the small components drift below zero, within
        `atol`, where the equations themselves blow up: use them with tight tolerances,
        or with `variable_order=True`, which rests between changes of step size. A
        [`diffrax_linearize.PredictiveController`][] with `steady=(0.9, 1.5)`, which
        keeps $h$ through moderate changes, helps the fixed order.
    - `variable_order`: `False` (the default) for a fixed order, `True` to choose the
        order of each step (see above).
    - `ndf`: `True` (the default) for Shampine & Reichelt's NDF coefficients (as
        scipy's `BDF`), `False` for the plain BDF (as CVODE and `FBDF`).
    - `linear_solver`: the `lineax` solver that factors $I - c J$;
        [`diffrax_linearize.StructuredLinearSolver`][] by default.
    - `root_finder`: carries the tolerances and `kappa` of the chord iteration;
        [`diffrax_linearize.VeryChord`][]`()` by default.
    - `root_find_max_steps`: the most chord iterations per attempt; 4 by default.
    - `jacobian_every`: the most steps one Jacobian serves; 20 by default (as
        [`diffrax_linearize.ROS34PW2`][]).
    - `refactor_ratio`: the factor by which $c = h / \alpha_q$ may change before the
        Newton matrix is refactored; 1.3 by default (CVODE's 30%).

    ```python
    import diffrax
    import jax.numpy as jnp
    import diffrax_linearize as dl

    # A reaction-diffusion equation on a grid of 1000 points: its Jacobian is banded,
    # and its diffusion makes it stiff.
    def allen_cahn(t, u, args):
        p = jnp.pad(u, 1)
        return 1e-2 * (p[2:] - 2 * u + p[:-2]) * 1000**2 + u - u**3

    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(allen_cahn), dl.BDF(), t0=0.0, t1=1.0, dt0=1e-4,
        y0=0.5 * jnp.sin(jnp.linspace(0.0, 6.0, 1000)),
        stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-8),
        saveat=diffrax.SaveAt(t1=True, solver_state=True),
    )
    sol.solver_state.num_jacobians  # far fewer than sol.stats["num_steps"]
    ```
    """

    max_order: int = eqx.field(static=True, default=3)
    ndf: bool = eqx.field(static=True, default=True)
    variable_order: bool = eqx.field(static=True, default=False)
    linear_solver: lx.AbstractLinearSolver = StructuredLinearSolver()
    root_finder: optx.AbstractRootFinder = VeryChord()
    root_find_max_steps: int = eqx.field(static=True, default=4)
    jacobian_every: int = eqx.field(static=True, default=20)
    refactor_ratio: float = 1.3

    term_structure: ClassVar = diffrax.AbstractTerm
    interpolation_cls: ClassVar = _BDFInterpolation

    def __check_init__(self):
        name = f"diffrax_linearize.{type(self).__name__}"
        if not (isinstance(self.max_order, int) and 1 <= self.max_order <= _MAX_ORDER):
            raise ValueError(f"`{name}(max_order=...)` must be 1 to 5, not {self.max_order!r}.")
        if not (isinstance(self.jacobian_every, int) and self.jacobian_every >= 1):
            raise ValueError(
                f"`{name}(jacobian_every=...)` must be an integer of at least 1, not "
                f"{self.jacobian_every!r}."
            )
        if not (isinstance(self.root_find_max_steps, int) and self.root_find_max_steps >= 1):
            raise ValueError(
                f"`{name}(root_find_max_steps=...)` must be an integer of at least 1, not "
                f"{self.root_find_max_steps!r}."
            )
        if not self.refactor_ratio > 1:
            raise ValueError(
                f"`{name}(refactor_ratio=...)` must be greater than 1, not {self.refactor_ratio!r}."
            )
        for attr in ("rtol", "atol", "norm", "kappa"):
            if not hasattr(self.root_finder, attr):
                raise ValueError(
                    f"`{name}(root_finder=...)` carries the chord iteration's tolerances: "
                    f"pass a `diffrax_linearize.VeryChord` (it has no `{attr}`)."
                )

    def order(self, terms):
        return self.max_order

    # Diffrax's default assumes an embedded pair (the estimate's order is the method's);
    # the BDF's estimate is its local error, one order higher, and the controller's
    # exponent must be 1/(q + 1) as scipy's.
    def error_order(self, terms):
        # With a variable order the error is returned normalised to order 1 (see `step`).
        return 1 if self.variable_order else self.max_order + 1

    def func(self, terms, t0, y0, args):
        return terms.vf(t0, y0, args)

    def _jacobian(self, g, t, y, s):
        # I - s dg/dy = I - s h J as one materialised operator (the structure engine sees
        # the identity, so it keeps J's pattern with its diagonal); affine in s, so its
        # derivative -h J in the same structure is one forward-mode pass.
        # A complex state's J is the complex one, as Diffrax's implicit solvers take it.
        def M_of(s_):
            return solver_operator(lambda z, _: z - s_ * g(t, z), y, None)

        M, dM = eqx.filter_jvp(M_of, (s,), (jnp.ones_like(s),))
        # A state with no entries: the operator's empty arrays get no tangent (`None`).
        dM = jtu.tree_map(
            lambda d, m: jnp.zeros_like(m) if d is None else d, dM, M, is_leaf=lambda x: x is None
        )
        return M, dM

    @staticmethod
    def _jacobian_diagonals(g, t, y, s):
        # The diagonals of `_jacobian`'s I - s dg/dy and of its derivative in s. For a
        # complex state, of its complex J, whose columns are the derivatives along real
        # directions: those of g along the real part, at the imaginary part's value.
        if jnp.iscomplexobj(y):
            dg = jacobian_diagonal(lambda x: g(t, jax.lax.complex(x, y.imag)), y.real)
        else:
            dg = jacobian_diagonal(lambda z: g(t, z), y)
        return (
            lx.DiagonalLinearOperator(1 - s.astype(dg.dtype) * dg),
            lx.DiagonalLinearOperator(-dg),
        )

    def _factor(self, M, like=None):
        # GMRES's state is carried without its operator: `attempt` multiplies by its own.
        # Its Jacobi preconditioner is remade from M's diagonal (`like`: the state it
        # replaces), as `M_J` and `dM` are then carried as diagonals (see `_carried`).
        if like is not None and is_detached(like):
            state = with_diagonal(like, lx.diagonal(M))
        else:
            state = detach(self.linear_solver.init(M, {}))
        return jtu.tree_map(jax.lax.stop_gradient, state)

    @staticmethod
    def _carried(M_J, dM, factorisation):
        # On the GMRES path a step multiplies by I - c J matrix-free and preconditions by
        # its diagonal: the full operators (six entries a row on a 2D stencil) would only
        # be passed through the step's `cond`s and Diffrax's choice between the new and
        # the old state, copies of twelve times the state's size every step.
        if not is_detached(factorisation):
            return M_J, dM
        return tuple(lx.DiagonalLinearOperator(lx.diagonal(op)) for op in (M_J, dM))

    def _initial_D(self, flat0, g0):
        n = flat0.shape[0]
        D = jnp.zeros((self.max_order + 2, n), flat0.dtype)
        return D.at[0].set(flat0).at[1].set(g0)

    def init(self, terms, t0, t1, y0, args):
        _check_ode(self, terms, t0, t1)
        t0 = jnp.asarray(t0)
        flat0, _, dtype, g = _flat_increment(terms, t0, t1, y0, args)
        # Flattened, real arrays beside complex ones would come back cast to real.
        check_real_or_complex("diffrax_linearize.BDF", jtu.tree_leaves(y0))
        real = _real(dtype)
        h = (jnp.asarray(t1) - t0).astype(real)
        _, alpha, _ = _coefficients(self.ndf)
        c = h / jnp.asarray(alpha[1], real)
        M_J, dM = self._jacobian(g, t0, flat0, jnp.asarray(1 / alpha[1], dtype))
        factorisation = self._factor(M_J)
        M_J, dM = self._carried(M_J, dM, factorisation)
        zero = jnp.array(0, jnp.int32)
        one = jnp.array(1, jnp.int32)
        return BDFState(
            D=self._initial_D(flat0, g(t0, flat0)),
            h=h,
            order=one,
            steps_at_order=zero,
            M_J=M_J,
            dM=dM,
            h_J=h,
            c_J=c,
            t_J=t0.astype(real),
            y_J=flat0,
            c_W=c,
            factorisation=factorisation,
            jacobian_age=zero,
            slow=jnp.array(False),
            rate=jnp.ones((), real),
            num_jacobians=one,
            num_factorisations=one,
            num_newton_iterations=zero,
            num_steps_by_order=jnp.zeros(_MAX_ORDER, jnp.int32),
        )

    def _chord_tolerance(self, dtype):
        # The distance to the solution the chord iteration stops at, in `norm` of the
        # scaled error: `kappa` of the tolerance, as CVODE's test is a fixed fraction of
        # its error test's tolerance at any rtol. scipy's `min(kappa, sqrt(rtol))` iterates
        # further at tight tolerances, for no digit the error test keeps; CVODE's own
        # fraction (0.1 of the tolerance of the error estimate, 0.3 to 1 here after its
        # error constant) saved a fifth of the iterations on the Brusselator at rtol 1e-4,
        # but left Robertson's small concentrations free to drift below zero there.
        rtol = self.root_finder.rtol
        eps = float(jnp.finfo(dtype).eps)
        with jax.numpy_dtype_promotion("standard"):
            tol = jnp.maximum(10 * eps / rtol, self.root_finder.kappa)
            return jnp.asarray(tol).astype(_real(dtype))

    def _chord(self, g, t1, y_predict, psi, alpha_q, solve, c, c_W, rate0, scale):
        """The chord iteration on the corrector, as scipy's `solve_bdf_system` (with
        CVODE's first-iteration test from the previous rate). Returns whether it
        converged, the iterations, the corrector and its difference from the
        predictor, and the last rate."""
        dtype = y_predict.dtype
        real = _real(dtype)
        norm = self.root_finder.norm
        tol = self._chord_tolerance(dtype)
        alpha_q = alpha_q.astype(dtype)
        with jax.numpy_dtype_promotion("standard"):
            # With the matrix of c_W for a step of c: the best single scale between the
            # stiff limit (c_W / c) and the non-stiff one (1), as CVODE's 2 / (1 + gamrat).
            boost = (2 / (1 + c / c_W)).astype(dtype)
        max_steps = self.root_find_max_steps

        def cond(carry):
            k, _, _, _, _, converged, failed = carry
            return (k < max_steps) & ~converged & ~failed

        def body(carry):
            k, y, d, dy_norm_old, rate, converged, failed = carry
            f = g(t1, y) / alpha_q
            sol = solve(f - psi - d)
            dy = boost * sol.value
            dy_norm = _scaled_norm(norm, dy, scale)
            # A non-finite f or dy makes the norm non-finite: one check of a scalar, not
            # two passes over the state.
            finite = jnp.isfinite(dy_norm)
            first = k == 0
            new_rate = jnp.where(first, rate, dy_norm / dy_norm_old)
            remaining = (max_steps - k).astype(real)
            diverging = ~first & (
                (new_rate >= 1) | (new_rate**remaining / (1 - new_rate) * dy_norm > tol)
            )
            bad = ~finite | diverging
            bad = bad | (sol.result != lx.RESULTS.successful)
            y = jnp.where(bad, y, y + dy)
            d = jnp.where(bad, d, d + dy)
            r = jnp.minimum(new_rate, 1 - 1e-3)
            done = (dy_norm == 0) | jnp.where(
                first, dy_norm * jnp.minimum(rate, 1) < tol, r / (1 - r) * dy_norm < tol
            )
            converged = ~bad & done
            return k + 1, y, d, dy_norm, new_rate, converged, bad

        zero = jnp.zeros((), real)
        init = (
            jnp.array(0, jnp.int32),
            y_predict,
            jnp.zeros_like(y_predict),
            zero,
            rate0,
            jnp.array(False),
            jnp.array(False),
        )
        k, y, d, _, rate, converged, _ = jax.lax.while_loop(cond, body, init)
        return converged, k, y, d, rate

    def _choose_order(self, q, steps_at_order, error, D_new, y0, y1, unravel, error_const):
        r"""The order of the next step, and the error normalised to order 1, as scipy's
        `BDF._step_impl` chooses them: after $q + 1$ steps at order $q$, the scaled
        errors $E_{q-1}$, $E_q$, $E_{q+1}$ of the orders around $q$ (from the differences
        $D_q$ and $D_{q+2}$) give the step-size factors $E_k^{-1/(k+1)}$, and the order
        allowing the largest step is taken. The error returned is the order-$q$ error
        rescaled so that its scaled norm is the inverse of the chosen factor (of the
        factor of order $q$ between choices, or when the step fails): a controller of
        error order 1 then proposes scipy's step size, accepts exactly when $E_q < 1$,
        and needs no access to the solver's state."""
        K = self.max_order
        dtype = _real(y1.dtype)
        norm, rtol, atol = self.root_finder.norm, self.root_finder.rtol, self.root_finder.atol
        with jax.numpy_dtype_promotion("standard"):
            # The scale of `diffrax.PIDController` and `PredictiveController`, so that a
            # controller sees exactly the normalised error computed here.
            scale = (atol + rtol * jnp.maximum(jnp.abs(y0), jnp.abs(y1))).astype(dtype)

        def scaled(v):
            return _scaled_norm(lambda x: norm(unravel(x)), v, scale)

        inf = jnp.asarray(jnp.inf, dtype)
        e_q = scaled(error)
        accepted = e_q < 1
        consider = (steps_at_order >= q + 1) & accepted

        def neighbours():
            const = error_const.astype(y1.dtype)
            e_m = jnp.where(q > 1, scaled(const[jnp.maximum(q - 1, 0)] * D_new[q]), inf)
            e_p = jnp.where(
                q < K,
                scaled(const[jnp.minimum(q + 1, K)] * D_new[jnp.minimum(q + 2, K + 1)]),
                inf,
            )
            return e_m, e_p

        # The errors of the orders around q only where the order is chosen (one step in
        # q + 1): two passes over the state that the other steps skip.
        e_m, e_p = jax.lax.cond(consider, neighbours, lambda: (inf, inf))
        orders = (q + jnp.arange(-1, 2, dtype=jnp.int32)).astype(dtype)
        with jax.numpy_dtype_promotion("standard"):
            factors = jnp.stack([e_m, e_q, e_p]) ** (-1 / (orders + 1))
        # The lowest order of equal factors, as scipy's.
        best = jnp.argmax(factors).astype(q.dtype)
        q_next = jnp.where(consider, q + best - 1, q)
        # Between choices an accepted step asks for the same step size again (`_HOLD`); a
        # rejected one for scipy's smaller step.
        hold = jnp.asarray(_HOLD, dtype)
        normalised = jnp.where(
            consider, 1 / factors[best], jnp.where(accepted, hold, 1 / factors[1])
        )
        # A zero error stays zero; an infinite one (a failed step) infinite.
        ratio = jnp.where((e_q > 0) & jnp.isfinite(e_q), normalised / e_q, 1)
        steps_at_order = jnp.where(consider, 0, steps_at_order)
        return q_next, steps_at_order, error * ratio.astype(error.dtype)

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        _check_ode(self, terms, t0, t1)
        st = solver_state
        K = self.max_order
        t0 = jnp.asarray(t0)
        flat0, unravel, dtype, g = _flat_increment(terms, t0, t1, y0, args)
        # Step sizes and the coefficients that combine the history are real; the history,
        # the corrector and the error have the state's dtype, real or complex.
        real = _real(dtype)
        h = (jnp.asarray(t1) - t0).astype(real)
        gamma, alpha, error_const = (jnp.asarray(a, real) for a in _coefficients(self.ndf))
        made_jump = jnp.asarray(made_jump)

        # The history for this step size (scipy's `change_D`) as weights on the rows of the
        # old one: the rescaled differences are only ever combined, into the predictor and
        # into the next history, so they are never formed. After a jump the history
        # restarts at order 1 from y0: row 1 becomes the slope there (a `cond`, so that
        # other steps evaluate no f) and the rows above it are dropped.
        slope = jax.lax.cond(made_jump, lambda: g(t0, flat0), lambda: st.D[1])
        history = [flat0, slope, *st.D[2:]]
        rows = jnp.arange(K + 2, dtype=jnp.int32)
        rescale = jnp.eye(K + 2, dtype=real)
        factor = h / st.h
        rescale = rescale.at[: K + 1, : K + 1].set(_rescale_weights(st.order, factor, K))
        # Row q + 1 is the last step's correction, of size h^(q+1) y^(q+1): rescaled to
        # leading order, as CVODE rescales its saved correction, so that the estimate of
        # order q + 1 (from its difference with this step's) holds when h changes between
        # steps, as Diffrax's controllers change it. No other row reads it.
        diag_next = (rows == st.order + 1)[:, None] & (rows == st.order + 1)[None, :]
        rescale = jnp.where(diag_next, factor ** (st.order + 1).astype(real), rescale)
        rescale = jnp.where(made_jump, jnp.diag((rows <= 1).astype(real)), rescale)
        q = jnp.where(made_jump, 1, st.order).astype(jnp.int32)
        restart = made_jump
        if self.variable_order:
            # scipy's `n_equal_steps`: the count restarts when h changes (after a choice,
            # a rejection, or a step cut short by `t1` or a jump time). Below `_SAME_H` the
            # change is the rounding of t0 + h, not the controller's.
            restart = restart | (jnp.abs(factor - 1) > _SAME_H)
        steps_at_order = jnp.where(restart, 0, st.steps_at_order).astype(jnp.int32)
        alpha_q = alpha[q]
        gamma_rows = jnp.where((rows >= 1) & (rows <= q), gamma[jnp.minimum(rows, K)], 0)
        predict = jnp.stack([(rows <= q).astype(real), gamma_rows / alpha_q])
        y_predict, psi = _combine(_matmul(predict, rescale), history)
        rows = rows[:, None]
        c = h / alpha_q
        rtol, atol = self.root_finder.rtol, self.root_finder.atol
        with jax.numpy_dtype_promotion("standard"):
            scale = (atol + rtol * jnp.abs(y_predict)).astype(real)

        def fresh_jacobian():
            s = (1 / alpha_q).astype(dtype)
            if is_detached(st.factorisation):
                # GMRES's path carries only the diagonals (`_carried`): read them off the
                # structure engine's blocks, without materialising every entry of J.
                M_J, dM = self._jacobian_diagonals(g, t1, y_predict, s)
            else:
                M_J, dM = self._jacobian(g, t1, y_predict, s)
            return M_J, dM, h, c, jnp.asarray(t1).astype(real), y_predict

        refresh = made_jump | st.slow | (st.jacobian_age >= self.jacobian_every)
        M_J, dM, h_J, c_J, t_J, y_J = jax.lax.cond(
            refresh, fresh_jacobian, lambda: (st.M_J, st.dM, st.h_J, st.c_J, st.t_J, st.y_J)
        )
        ratio = c / st.c_W
        refactor = refresh | (ratio > self.refactor_ratio) | (ratio < 1 / self.refactor_ratio)

        def operator(M_J, dM, h_J, c_J, c_W):
            return _affine(M_J, dM, (c_W - c_J) / h_J)

        c_W, factorisation = jax.lax.cond(
            refactor,
            lambda: (c, self._factor(operator(M_J, dM, h_J, c_J, c), st.factorisation)),
            lambda: (st.c_W, st.factorisation),
        )
        rate0 = jnp.where(refactor, jnp.ones((), real), st.rate)

        def attempt(M_J, dM, h_J, c_J, t_J, y_J, c_W, factorisation, rate0):
            # For GMRES, which only multiplies by M = I - c_W J: J v by forward-mode
            # differentiation at the Jacobian's point (`jvp_product`), without
            # derivatives, as the factorisation (`_factor`).
            jv = jvp_product(g, t_J, y_J)
            r = jax.lax.stop_gradient(c_W / h).astype(dtype)

            def mv(v):
                return v - r * jv(v)

            if is_detached(factorisation):
                M = lx.FunctionLinearOperator(mv, jax.eval_shape(lambda: y_predict))
            else:
                M = operator(M_J, dM, h_J, c_J, c_W)
            factorisation = matrix_free(factorisation, mv, M)

            # An iterative linear solver needs to be only as accurate as the chord iteration
            # (lineax takes no derivative through `options`).
            tol = self._chord_tolerance(dtype)
            options = jax.lax.stop_gradient(dict(scale=scale, tolerance=tol))

            def solve(b):
                return lx.linear_solve(
                    M, b, self.linear_solver, options=options, state=factorisation, throw=False
                )

            return self._chord(g, t1, y_predict, psi, alpha_q, solve, c, c_W, rate0, scale)

        first = without_derivatives(attempt, M_J, dM, h_J, c_J, t_J, y_J, c_W, factorisation, rate0)
        # A failure with an old Jacobian is retried here with a new one: Diffrax would
        # discard a new Jacobian made by a rejected step, with that step's state.
        retry = ~first[0] & ~refresh

        def again():
            M_J, dM, h_J, c_J, t_J, y_J = fresh_jacobian()
            factorisation = self._factor(operator(M_J, dM, h_J, c_J, c), st.factorisation)
            one = jnp.ones((), real)
            out = attempt(M_J, dM, h_J, c_J, t_J, y_J, c, factorisation, one)
            return (M_J, dM, h_J, c_J, t_J, y_J, c, factorisation), out

        jacobian = (M_J, dM, h_J, c_J, t_J, y_J, c_W, factorisation)
        jacobian, (converged, iters, y1, d, rate) = without_derivatives(
            lambda: jax.lax.cond(retry, again, lambda: (jacobian, first))
        )
        M_J, dM, h_J, c_J, t_J, y_J, c_W, factorisation = jacobian
        # Derivatives at the converged corrector, not through the chord iteration.
        y1, d = corrector(y1, d, self.linear_solver, g, t1, y_predict, psi, alpha_q.astype(dtype))
        iters = iters + jnp.where(retry, first[1], 0)

        error = error_const[q].astype(dtype) * d
        error = jnp.where(converged, error, jnp.inf)
        result = RESULTS.where(converged, RESULTS.successful, RESULTS.nonlinear_divergence)

        # The differences of the new polynomial (scipy's update): D_{q+1} = d and
        # D_i += D_{i+1} for i = q, ..., 1, that is D_i + ... + D_q + d, and D_0 = y1; and
        # D_{q+2} = d - D_{q+1}, the difference of order q + 2 (for the estimate of order
        # q + 1; no step reads it otherwise); as weights on the old history (through the
        # rescaling), on d and on y1.
        cols = rows.T
        update = jnp.where(
            rows <= q,
            ((rows >= 1) & (rows <= cols) & (cols <= q)).astype(real),
            jnp.where(
                rows == q + 2,
                -(cols == q + 1).astype(real),
                ((rows == cols) & (rows > q + 2)).astype(real),
            ),
        )
        # Row 0 is y1, and the other rows read neither y0 nor y1 (the rescaling keeps row 0
        # apart): combined from the old rows 1 to K + 1 and d only, a third fewer products
        # in a pass that is bound by them.
        on_d = (rows[1:] >= 1) & (rows[1:] <= q + 2)
        update = jnp.concatenate([_matmul(update, rescale)[1:, 1:], on_d.astype(real)], axis=1)
        D_new = jnp.concatenate([y1[None], _combine(update, [*history[1:], d])])
        steps_at_order = steps_at_order + 1
        if self.variable_order:
            q_next, steps_at_order, error = self._choose_order(
                q, steps_at_order, error, D_new, flat0, y1, unravel, error_const
            )
        else:
            raise_order = (steps_at_order >= q + 1) & (q < K)
            q_next = jnp.where(raise_order, q + 1, q)
            steps_at_order = jnp.where(raise_order, 0, steps_at_order)
        new_state = BDFState(
            D=D_new,
            h=h,
            order=q_next.astype(jnp.int32),
            steps_at_order=steps_at_order.astype(jnp.int32),
            M_J=M_J,
            dM=dM,
            h_J=h_J,
            c_J=c_J,
            t_J=t_J,
            y_J=y_J,
            c_W=c_W,
            factorisation=factorisation,
            jacobian_age=jnp.where(refresh | retry, 1, st.jacobian_age + 1).astype(jnp.int32),
            slow=iters >= 3,
            rate=rate,
            num_jacobians=st.num_jacobians + (refresh | retry).astype(jnp.int32),
            num_factorisations=st.num_factorisations + (refactor | retry).astype(jnp.int32),
            num_newton_iterations=st.num_newton_iterations + iters,
            num_steps_by_order=st.num_steps_by_order
            + (jnp.arange(1, _MAX_ORDER + 1, dtype=jnp.int32) == q).astype(jnp.int32),
        )
        dense_info = dict(y0=y0, D=D_new, order=q)
        y1, error = rejectable(result, y0, unravel(y1), unravel(error))
        return y1, error, dense_info, new_state, result
