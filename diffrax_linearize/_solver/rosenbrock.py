r"""Rosenbrock (linearly implicit) ODE solvers: each step takes one Jacobian and one
factorisation, reused by every stage, and makes no Newton iterations.

The Jacobian comes from the structure engine
([`diffrax_linearize.materialise_operator`][]), so a block-diagonal, banded or sparse
vector field is factored as such by [`diffrax_linearize.StructuredLinearSolver`][].
"""

import dataclasses
from typing import Any, ClassVar, TYPE_CHECKING

import diffrax
import equinox as eqx
import jax
import jax.flatten_util as jfu
import jax.numpy as jnp
import jax.tree_util as jtu
import lineax as lx
import numpy as np
from diffrax import AbstractAdaptiveSolver, AbstractLocalInterpolation, RESULTS

from .._linear_solver import jvp_product, matrix_free, StructuredLinearSolver
from .._materialise import solver_operator
from .failure import rejectable


if TYPE_CHECKING:
    from typing import ClassVar as AbstractClassVar
else:
    from equinox import AbstractClassVar


@dataclasses.dataclass(frozen=True)
class _RodasTableau:
    r"""A stiffly accurate Rosenbrock method of the Rodas family in the W-transformed form
    of Hairer & Wanner (*Solving ODEs II*, section IV.7: the variables
    $u_i = \sum_j \gamma_{ij} k_j$), as OrdinaryDiffEq.jl's `RodasTableau` stores it.

    Stage `i` solves $(I/\gamma - h J) u_i = h f(t_0 + c_i h, y_0 + \sum_j a_{ij} u_j) +
    d_i h^2 \partial f / \partial t + \sum_j C_{ij} u_j$. The last row of `a` is the one
    before it plus the previous stage's increment, and the solution is the last stage's
    input plus its increment: the embedded solution is $y_0 + \sum_j a_{sj} u_j$ and
    $u_s$ is the error estimate. Dense output:
    $y(t_0 + \theta h) = (1 - \theta) y_0 + \theta (y_1 + (1 - \theta)(q_1 + \theta (q_2 +
    \dots)))$ with $q_i = \sum_j H_{ij} u_j$.
    """

    gamma: float
    a: np.ndarray  # (s, s), strictly lower triangular
    C: np.ndarray  # (s, s), strictly lower triangular
    c: np.ndarray  # (s,)
    d: np.ndarray  # (s,)
    H: np.ndarray  # (r, s)
    order: int
    dense_order: int
    # Solution and error weights on the u_j, for a tableau whose embedded solution is not
    # a stage's input (as OrdinaryDiffEq.jl's `b` and `btilde`); `None` for the Rodas
    # layout above.
    b: np.ndarray | None = None
    btilde: np.ndarray | None = None

    def __post_init__(self):
        s = self.a.shape[0]
        if self.b is None:
            last = self.a[s - 2] + np.eye(s)[s - 2]
            assert np.array_equal(self.a[s - 1], last) and self.c[s - 1] == 1

    def adds_last(self, i: int) -> bool:
        """Whether stage `i`'s input is stage `i - 1`'s plus its increment."""
        return i > 0 and np.array_equal(self.a[i], self.a[i - 1] + np.eye(len(self.a))[i - 1])


def _lower(rows, s: int) -> np.ndarray:
    out = np.zeros((s, s))
    for i, row in enumerate(rows, start=1):
        out[i, : len(row)] = row
    return out


# Rodas5P: coefficients of Steinebach (2023), as listed by OrdinaryDiffEq.jl's
# `Rodas5PTableau`. Stages 6-8 are at t1, each adding its increment to the last: after
# stage 7 the embedded order-4 solution, after stage 8 the order-5 one.
_GAMMA = 0.21193756319429014
_A = [
    [3.0],
    [2.849394379747939, 0.45842242204463923],
    [-6.954028509809101, 2.489845061869568, -10.358996098473584],
    [2.8029986275628964, 0.5072464736228206, -0.3988312541770524, -0.04721187230404641],
    [
        -7.502846399306121,
        2.561846144803919,
        -11.627539656261098,
        -0.18268767659942256,
        0.030198172008377946,
    ],
]
_C = [
    [-14.155112264123755],
    [-17.97296035885952, -2.859693295451294],
    [147.12150275711716, -1.41221402718213, 71.68940251302358],
    [165.43517024871676, -0.4592823456491126, 42.90938336958603, -5.961986721573306],
    [
        24.854864614690072,
        -3.0009227002832186,
        47.4931110020768,
        5.5814197821558125,
        -0.6610691825249471,
    ],
    [
        30.91273214028599,
        -3.1208243349937974,
        77.79954646070892,
        34.28646028294783,
        -19.097331116725623,
        -28.087943162872662,
    ],
    [
        37.80277123390563,
        -3.2571969029072276,
        112.26918849496327,
        66.9347231244047,
        -40.06618937091002,
        -54.66780262877968,
        -9.48861652309627,
    ],
]
# Stage times (stages 1-5; stages 6-8 are at t1) and the time-derivative weights (zero for
# stages 6-8).
_CT = [0.0, 0.6358126895828704, 0.4095798393397535, 0.9769306725060716, 0.4288403609558664]
_D = [
    0.21193756319429014,
    -0.42387512638858027,
    -0.3384627126235924,
    1.8046452872882734,
    2.325825639765069,
]
_H = np.array(
    [
        [
            25.948786856663858,
            -2.5579724845846235,
            10.433815404888879,
            -2.3679251022685204,
            0.524948541321073,
            1.1241088310450404,
            0.4272876194431874,
            -0.17202221070155493,
        ],
        [
            -9.91568850695171,
            -0.9689944594115154,
            3.0438037242978453,
            -24.495224566215796,
            20.176138334709044,
            15.98066361424651,
            -6.789040303419874,
            -6.710236069923372,
        ],
        [
            11.419903575922262,
            2.8879645146136994,
            72.92137995996029,
            80.12511834622643,
            -52.072871366152654,
            -59.78993625266729,
            -0.15582684282751913,
            4.883087185713722,
        ],
    ]
)


def _rodas5p() -> _RodasTableau:
    a = _lower(_A, 8)
    a[6] = a[5] + np.eye(8)[5]
    a[7] = a[6] + np.eye(8)[6]
    return _RodasTableau(
        gamma=_GAMMA,
        a=a,
        C=_lower(_C, 8),
        c=np.array(_CT + [1.0, 1.0, 1.0]),
        d=np.array(_D + [0.0, 0.0, 0.0]),
        H=_H,
        order=5,
        dense_order=4,
    )


# Rodas4P: coefficients of Steinebach (1995), as listed by OrdinaryDiffEq.jl's
# `Rodas4PTableau` (from Hairer & Wanner's RODAS code with Steinebach's coefficients).
# Stages 5 and 6 are at t1: after stage 5 the embedded order-3 solution, after stage 6 the
# order-4 one.
_RODAS4P = _RodasTableau(
    gamma=0.25,
    a=_lower(
        [
            [3.0],
            [1.831036793486759, 0.4955183967433795],
            [2.304376582692669, -0.05249275245743001, -1.176798761832782],
            [-7.170454962423024, -4.741636671481785, -16.31002631330971, -1.062004044111401],
            [
                -7.170454962423024,
                -4.741636671481785,
                -16.31002631330971,
                -1.062004044111401,
                1.0,
            ],
        ],
        6,
    ),
    C=_lower(
        [
            [-12.0],
            [-8.791795173947035, -2.207865586973518],
            [10.81793056857153, 6.780270611428266, 19.53485944642410],
            [34.19095006749676, 15.49671153725963, 54.74760875964130, 14.16005392148534],
            [
                34.62605830930532,
                15.30084976114473,
                56.99955578662667,
                18.40807009793095,
                -5.714285714285717,
            ],
        ],
        6,
    ),
    c=np.array([0.0, 0.75, 0.21, 0.63, 1.0, 1.0]),
    d=np.array([0.25, -0.5, -0.023504, -0.0362, 0.0, 0.0]),
    H=np.array(
        [
            [
                25.09876703708589,
                11.62013104361867,
                28.49148307714626,
                -5.664021568594133,
                0.0,
                0.0,
            ],
            [
                1.638054557396973,
                -0.7373619806678748,
                8.477918219238990,
                15.99253148779520,
                -1.882352941176471,
                0.0,
            ],
        ]
    ),
    order=4,
    dense_order=3,
)


class _RodasInterpolation(AbstractLocalInterpolation):
    t0: Any
    t1: Any
    y0: Any
    y1: Any
    q: Any  # the pytree of y, each leaf with a leading axis of the tableau's rows of H

    def evaluate(self, t0, t1=None, left: bool = True):
        del left
        if t1 is not None:
            return jtu.tree_map(lambda a, b: a - b, self.evaluate(t1), self.evaluate(t0))
        with jax.numpy_dtype_promotion("standard"):
            s = (t0 - self.t0) / (self.t1 - self.t0)

            def _eval(y0, y1, q):
                s_ = s.astype(y0.dtype)
                r = 1 - s_
                poly = q[-1]
                for j in range(q.shape[0] - 2, -1, -1):
                    poly = q[j] + s_ * poly
                return r * y0 + s_ * (y1 + r * poly)

            return jtu.tree_map(_eval, self.y0, self.y1, self.q)


def _check_ode(solver, terms, t0, t1):
    control = terms.contr(t0, t1)
    leaves = jtu.tree_leaves(control)
    if isinstance(terms, diffrax.MultiTerm) or len(leaves) != 1 or jnp.shape(leaves[0]) != ():
        raise TypeError(
            f"`diffrax_linearize.{type(solver).__name__}` solves ODEs: pass one "
            "`diffrax.ODETerm`. For an SDE (a `diffrax.MultiTerm` with a "
            "`diffrax.ControlTerm`), use a stochastic solver such as "
            "`diffrax_linearize.ImplicitEulerMaruyama` or "
            "`diffrax_linearize.ImplicitItoMilstein`."
        )


def _combine(coefficients, ks):
    return sum(float(a) * k for a, k in zip(coefficients, ks) if a != 0)


def _empty_step(y0, dense_info, solver_state):
    """The step of a state with no entries (`y0=None`, or arrays of size zero, which
    Diffrax's own tests solve with every solver that is not a
    `diffrax.AbstractImplicitSolver`): nothing to linearise, factor or solve."""
    zeros = jtu.tree_map(jnp.zeros_like, y0)
    return y0, zeros, dense_info, solver_state, RESULTS.successful


def _stages(tab: _RodasTableau, g, solve, t0, h, flat0, dtype):
    r"""The stages of one Rosenbrock step in the W-transformed form, shared by the Rodas
    and W-methods: `g(t, y)` is the increment $f(t, y) h$ and `solve(b)` the solve with
    $W = I/\gamma - h J$ (for a W-method, $J$ may be any matrix). Returns the solution,
    the error estimate, $g(t_0, y_0)$, the stage increments and the solves' result."""
    g0, dgdt = jax.jvp(lambda t: g(t, flat0), (t0,), (jnp.ones_like(t0),))
    with jax.numpy_dtype_promotion("standard"):
        h_dgdt = (h * dgdt).astype(dtype)
    ks = []
    result = RESULTS.successful
    y_stage = flat0
    for i in range(len(tab.c)):
        if i == 0:
            fi = g0
        else:
            if tab.adds_last(i):
                y_stage = y_stage + ks[-1]
            else:
                y_stage = flat0 + _combine(tab.a[i], ks)
            fi = g(t0 + float(tab.c[i]) * h, y_stage)
        b = fi
        if tab.d[i] != 0:
            b = b + float(tab.d[i]) * h_dgdt
        if i > 0:
            b = b + _combine(tab.C[i], ks)
        sol = solve(b)
        ks.append(sol.value)
        result = RESULTS.where(result == RESULTS.successful, RESULTS.promote(sol.result), result)
    if tab.b is None:
        return y_stage + ks[-1], ks[-1], g0, ks, result
    return flat0 + _combine(tab.b, ks), _combine(tab.btilde, ks), g0, ks, result


def _check_tolerances(solver):
    # Both or neither, as `diffrax.PIDController` takes both with no default: an `atol`
    # is on the scale of the state, so no default fits every problem, and with `rtol`
    # alone the weights `atol + rtol |y0|` are undefined (with `atol` alone it would be
    # silently unused).
    if (solver.rtol is None) != (solver.atol is None):
        name = f"diffrax_linearize.{type(solver).__name__}"
        given, missing = ("rtol", "atol") if solver.atol is None else ("atol", "rtol")
        raise ValueError(
            f"`{name}({given}=...)` was given without `{missing}`: pass both, the "
            f"step-size controller's (`{name}(rtol=..., atol=...)` with the same values "
            "as `diffrax.PIDController(rtol=..., atol=...)`), or neither, to keep "
            "GMRES's own tolerance."
        )


# The stage solves' tolerance on the GMRES path, in the error weights `atol + rtol |y0|`
# of the step: GMRES stops at `linear_fraction` (0.05) of it. A Rosenbrock step has no
# Newton iteration to absorb a linear solve's error, and its stages combine the increments
# with coefficients up to ~150 (Rodas5P's `C`).
_LINEAR_TOLERANCE = 1e-2


def _stage_solver(solver, W, state, g, t0, flat0, gamma, exact: bool):
    """`solve(b)`, the stage solves with `W = I/gamma - dg/dy` (materialised; its
    factorisation or GMRES state `state`). On the GMRES path, with the solver's `rtol`
    and `atol` (the step-size controller's), GMRES stops at a fraction of the step's
    error weights rather than at `StructuredLinearSolver`'s 1e-10; where `W` is the exact
    Jacobian's (`exact`), it multiplies by `W` with `jax.jvp` of the vector field, a pass
    over the state where the materialised operator's product gathers every entry."""
    dtype = flat0.dtype
    if exact:
        jv = jvp_product(g, t0, flat0)

        def mv(v):
            return v / gamma - jv(v)

        state = matrix_free(state, mv, W)
    options = {}
    if solver.rtol is not None:
        with jax.numpy_dtype_promotion("standard"):
            scale = (solver.atol + solver.rtol * jnp.abs(flat0)).astype(dtype)
        tolerance = jnp.asarray(_LINEAR_TOLERANCE, dtype)
        options = jax.lax.stop_gradient(dict(scale=scale, tolerance=tolerance))

    def solve(b):
        return lx.linear_solve(
            W, b, solver.linear_solver, options=options, state=state, throw=False
        )

    return solve


class AbstractRodas(AbstractAdaptiveSolver):
    r"""A stiffly accurate Rosenbrock method of the Rodas family, given by its tableau.

    Each step materialises the Jacobian $J = \partial f / \partial y$ at $(t_0, y_0)$ once
    (with [`diffrax_linearize.materialise_operator`][], keeping a block-diagonal, banded or
    sparse structure), factors $W = I / (h \gamma) - J$ once (scaled by $h$: $I/\gamma -
    h J$) and solves every linear stage with that factorisation: no Newton iterations.
    The order conditions assume the exact Jacobian, which is what the structure engine
    gives. A non-autonomous vector field's $\partial f / \partial t$ is one `jax.jvp` in
    $t$. The error estimate is the last stage's increment, the difference between the
    solution and the embedded one (both stiffly accurate: the last stages are at $t_1$),
    as in OrdinaryDiffEq.jl; use it with a [`diffrax_linearize.PredictiveController`][]
    (a `diffrax.PIDController` works too, with more rejected steps).

    For ODEs only (one `diffrax.ODETerm`). The state may be any pytree of real arrays,
    float32 or float64 (it is flattened with `jax.flatten_util.ravel_pytree`; a single
    array keeps its Jacobian's structure), or of complex ones: the Jacobian is then the
    complex one `jax.jacfwd(..., holomorphic=True)` gives, exact for a vector field
    holomorphic in $y$ (for another, an approximation that costs the order).
    """

    linear_solver: eqx.AbstractVar[lx.AbstractLinearSolver]
    rtol: eqx.AbstractVar[float | None]
    atol: eqx.AbstractVar[float | None]
    tableau: AbstractClassVar[_RodasTableau]

    term_structure: ClassVar = diffrax.AbstractTerm
    interpolation_cls: ClassVar = _RodasInterpolation

    def __check_init__(self):
        _check_tolerances(self)

    def order(self, terms):
        return self.tableau.order

    def init(self, terms, t0, t1, y0, args):
        _check_ode(self, terms, t0, t1)
        return None

    def func(self, terms, t0, y0, args):
        return terms.vf(t0, y0, args)

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        del solver_state, made_jump
        _check_ode(self, terms, t0, t1)
        tab = self.tableau
        flat0, unravel = jfu.ravel_pytree(y0)
        dtype = flat0.dtype
        if flat0.size == 0:
            q = jax.vmap(unravel)(jnp.zeros((tab.H.shape[0], 0), dtype))
            return _empty_step(y0, dict(y0=y0, y1=y0, q=q), None)
        t0 = jnp.asarray(t0)
        h = jnp.asarray(t1) - t0
        control = terms.contr(t0, t1)

        # The increment g = f dt (`vf_prod`, so that a reversed-time solve's
        # `diffrax.WrapTerm`, whose control is negative, is handled as Diffrax does):
        # the stages then read (I/gamma - dg/dy) k_i = g(t_i, Y_i) + d_i h dg/dt + sum_j
        # C_ij k_j, the W-transformed form with the step size scaled out.
        def g(t, flat):
            out = terms.vf_prod(t, unravel(flat), args, control)
            out_flat, _ = jfu.ravel_pytree(out)
            return out_flat.astype(dtype)

        # W = I/gamma - h J as one materialised operator: the structure engine sees the
        # identity, so W keeps J's block, band or sparsity pattern (with its diagonal). A
        # complex state's J is the complex Jacobian, as Diffrax's implicit solvers take.
        gamma = tab.gamma
        W = solver_operator(lambda y, _: y / gamma - g(t0, y), flat0, None)
        state = self.linear_solver.init(W, {})
        solve = _stage_solver(self, W, state, g, t0, flat0, gamma, exact=True)
        flat1, error, _, ks, result = _stages(tab, g, solve, t0, h, flat0, dtype)
        k = jnp.stack(ks)
        q = jnp.asarray(tab.H, dtype) @ k
        y1, y_error = rejectable(result, y0, unravel(flat1), unravel(error))
        qs = jax.vmap(unravel)(q)
        dense_info = dict(y0=y0, y1=y1, q=qs)
        return y1, y_error, dense_info, None, result


class Rodas5P(AbstractRodas):
    r"""Rodas5P, a stiffly accurate Rosenbrock method of order 5 with an embedded method
    of order 4 and 8 stages (G. Steinebach, *Construction of Rosenbrock-Wanner method
    Rodas5P and numerical benchmarks within the Julia Differential Equations package*, BIT
    Numerical Mathematics 63, 27 (2023); coefficients as in OrdinaryDiffEq.jl, which
    recommends it for stiff problems at moderate to tight tolerances).

    Each step materialises the Jacobian $J = \partial f / \partial y$ at $(t_0, y_0)$ once
    (with [`diffrax_linearize.materialise_operator`][], keeping a block-diagonal, banded or
    sparse structure), factors $W = I / (h \gamma) - J$ once (scaled by $h$: $I/\gamma -
    h J$) and solves the eight linear stages with that factorisation: no Newton
    iterations. The method is linearly implicit and L-stable, and its order conditions
    assume the exact Jacobian, which is what the structure engine gives. A
    non-autonomous vector field's $\partial f / \partial t$ is one `jax.jvp` in $t$.

    - **Error estimate:** the increment $k_8$ of the last stage, which is the difference
      between the order-5 solution and the embedded order-4 one (both stiffly accurate:
      stages 6 to 8 are at $t_1$), as in OrdinaryDiffEq.jl; use it with a
      [`diffrax_linearize.PredictiveController`][] (a `diffrax.PIDController` never
      shrinks the step after an accepted one, and rejects more steps).
    - **Interpolation:** Rodas5P's own dense output, $y(t_0 + s h) = (1 - s) y_0 + s (y_1 +
      (1 - s)(q_1 + s (q_2 + s q_3)))$ with the $q_i$ fixed combinations of the stage
      increments (the tableau's `h` coefficients): a degree-4 polynomial, order 4.

    For ODEs only (one `diffrax.ODETerm`). The state may be any pytree of real arrays,
    float32 or float64 (it is flattened with `jax.flatten_util.ravel_pytree`; a single
    array keeps its Jacobian's structure), or of complex ones: the Jacobian is then the
    complex one `jax.jacfwd(..., holomorphic=True)` gives, exact for a vector field
    holomorphic in $y$ (for another, an approximation that costs the order).

    **Arguments:**

    - `linear_solver`: the `lineax` solver that factors $W$;
        [`diffrax_linearize.StructuredLinearSolver`][] by default.
    - `rtol`, `atol`: the step-size controller's tolerances, for the GMRES path of
        [`diffrax_linearize.StructuredLinearSolver`][] only: its stage solves then stop
        when the root mean square of the residual over `atol + rtol |y0|` is below
        `linear_fraction` (0.05) times 1e-2, rather than at GMRES's own 1e-10 (no finer
        than the dtype resolves). `None` (the default) keeps 1e-10. Give both or
        neither. A Rosenbrock solver has no root finder through which
        `diffrax.diffeqsolve` could pass them.

    ```python
    import diffrax
    import jax.numpy as jnp
    import diffrax_linearize as dl

    def robertson(t, y, args):
        y1, y2, y3 = y
        return jnp.stack([
            -0.04 * y1 + 1e4 * y2 * y3,
            0.04 * y1 - 1e4 * y2 * y3 - 3e7 * y2**2,
            3e7 * y2**2,
        ])

    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(robertson), dl.Rodas5P(), t0=0.0, t1=100.0, dt0=1e-4,
        y0=jnp.array([1.0, 0.0, 0.0]),
        stepsize_controller=dl.PredictiveController(rtol=1e-6, atol=1e-10),
    )
    ```
    """

    linear_solver: lx.AbstractLinearSolver = StructuredLinearSolver()
    rtol: float | None = None
    atol: float | None = None
    tableau: ClassVar[_RodasTableau] = _rodas5p()


class Rodas4P(AbstractRodas):
    r"""Rodas4P, a stiffly accurate Rosenbrock method of order 4 with an embedded method
    of order 3 and 6 stages: Hairer & Wanner's RODAS (*Solving Ordinary Differential
    Equations II*, section IV.7) with the coefficients of G. Steinebach, *Order-reduction
    of ROW-methods for DAEs and method of lines applications*, Preprint 1741, FB
    Mathematik, TH Darmstadt (1995), chosen so that the order does not drop on
    semi-discretised parabolic problems and DAEs of index one (coefficients as listed by
    OrdinaryDiffEq.jl's `Rodas4PTableau`).

    One Jacobian, one factorisation and six linear solves per step, against
    [`diffrax_linearize.Rodas5P`][]'s eight: cheaper per step, for loose to moderate
    tolerances. As [`diffrax_linearize.Rodas5P`][] in everything else:

    - **Error estimate:** the increment of the sixth stage, the difference between the
      order-4 solution and the embedded order-3 one (stages 5 and 6 are at $t_1$).
    - **Interpolation:** Rodas4P's own dense output, $y(t_0 + s h) = (1 - s) y_0 + s (y_1 +
      (1 - s)(q_1 + s q_2))$, a degree-3 polynomial, order 3.

    **Arguments:**

    - `linear_solver`: the `lineax` solver that factors $W$;
        [`diffrax_linearize.StructuredLinearSolver`][] by default.
    - `rtol`, `atol`: the step-size controller's tolerances, for the GMRES path of
        [`diffrax_linearize.StructuredLinearSolver`][] only: its stage solves then stop
        when the root mean square of the residual over `atol + rtol |y0|` is below
        `linear_fraction` (0.05) times 1e-2, rather than at GMRES's own 1e-10 (no finer
        than the dtype resolves). `None` (the default) keeps 1e-10. Give both or
        neither. A Rosenbrock solver has no root finder through which
        `diffrax.diffeqsolve` could pass them.

    ```python
    import diffrax
    import jax.numpy as jnp
    import diffrax_linearize as dl

    def robertson(t, y, args):
        y1, y2, y3 = y
        return jnp.stack([
            -0.04 * y1 + 1e4 * y2 * y3,
            0.04 * y1 - 1e4 * y2 * y3 - 3e7 * y2**2,
            3e7 * y2**2,
        ])

    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(robertson), dl.Rodas4P(), t0=0.0, t1=100.0, dt0=1e-4,
        y0=jnp.array([1.0, 0.0, 0.0]),
        stepsize_controller=dl.PredictiveController(rtol=1e-6, atol=1e-10),
    )
    ```
    """

    linear_solver: lx.AbstractLinearSolver = StructuredLinearSolver()
    rtol: float | None = None
    atol: float | None = None
    tableau: ClassVar[_RodasTableau] = _RODAS4P


# ROS34PW2 of J. Rang and L. Angermann, *New Rosenbrock W-methods of order 3 for partial
# differential algebraic equations of index 1*, BIT Numerical Mathematics 45, 761-787
# (2005), in the W-transformed form as listed by OrdinaryDiffEq.jl's
# `ROS34PW2RodasTableau` (lib/OrdinaryDiffEqRosenbrockTableaus/src/rosenbrock_tableaus.jl).
# Its order conditions (order 3, embedded order 2) hold for any W, which
# `tests/test_wmethod.py` checks by the fitted order with a stale Jacobian.
_ROS34PW2 = _RodasTableau(
    gamma=0.435866521508459,
    a=_lower(
        [
            [2.0],
            [1.4192173174557647, -0.2592322116729697],
            [4.18476048231916, -0.28519201735549593, 2.294280360279042],
        ],
        4,
    ),
    C=_lower(
        [
            [-4.588560720558084],
            [-4.18476048231916, 0.28519201735549593],
            [-6.368179200128359, -6.795620944466837, 2.8700986043310563],
        ],
        4,
    ),
    c=np.array([0.0, 0.871733043016918, 0.7315799577888524, 1.0]),
    d=np.array([0.435866521508459, -0.435866521508459, -0.4133333762338865, 0.0]),
    H=np.zeros((0, 4)),
    order=3,
    dense_order=3,
    b=np.array([4.1847604823191595, -0.28519201735549565, 2.2942803602790414, 1.0]),
    btilde=np.array([0.2777499476479681, -1.4032398951759992, 1.7726301276675507, 0.5]),
)


class WState(eqx.Module):
    r"""The state a [`diffrax_linearize.AbstractRosenbrockW`][] solver carries between
    steps (read it with `diffrax.SaveAt(solver_state=True)`).

    **Arguments:**

    - `W_J`: $W = I/\gamma - h_J J$ at the step size $h_J$ the Jacobian was evaluated
      for, the structured operator of [`diffrax_linearize.materialise_operator`][].
    - `dW`: $-h_J J$ in the same structure, so that $W(h) = W_J + (h/h_J - 1)\,dW$.
    - `h_J`, `h_W`: the step sizes of the Jacobian and of the factorisation.
    - `factorisation`: the linear solver's state for $W(h_W)$.
    - `steps`: the accepted steps since the Jacobian was evaluated.
    - `num_jacobians`, `num_factorisations`: how many Jacobians and factorisations the
      accepted steps (and `init`) made; a rejected step's state is discarded by Diffrax,
      so its work is not counted.
    """

    W_J: lx.AbstractLinearOperator
    dW: lx.AbstractLinearOperator
    h_J: Any
    h_W: Any
    factorisation: Any
    steps: Any
    num_jacobians: Any
    num_factorisations: Any


def _affine(W_J, dW, r):
    return jtu.tree_map(lambda a, b: a + r.astype(a.dtype) * b, W_J, dW)


def _flat_increment(terms, t0, t1, y0, args):
    """`(flat0, unravel, dtype, g)`: the state flattened, and the increment
    `g(t, y) = f(t, y) dt` on flat states, through `vf_prod` (as `AbstractRodas.step`), so
    that a reversed-time solve's `diffrax.WrapTerm` is handled as Diffrax does. Shared by
    the solvers that carry a Jacobian across steps (W-methods, BDF)."""
    flat0, unravel = jfu.ravel_pytree(y0)
    dtype = flat0.dtype
    control = terms.contr(t0, t1)

    def g(t, flat):
        out = terms.vf_prod(t, unravel(flat), args, control)
        out_flat, _ = jfu.ravel_pytree(out)
        return out_flat.astype(dtype)

    return flat0, unravel, dtype, g


class AbstractRosenbrockW(AbstractAdaptiveSolver):
    r"""A Rosenbrock-W method, given by its tableau: a Rosenbrock method whose order
    conditions hold for any matrix in place of the Jacobian, so that one Jacobian and one
    factorisation serve many steps. A stale Jacobian costs stability and the quality of
    the error estimate, never the order.

    The solver state ([`diffrax_linearize.WState`][]) carries the materialised Jacobian
    (with [`diffrax_linearize.materialise_operator`][], keeping a block-diagonal, banded
    or sparse structure) and the factorisation of $W = I/\gamma - h J$. A step evaluates
    a new Jacobian at $(t_0, y_0)$ when `jacobian_every` steps have used the old one,
    after a jump (`made_jump`), or when $h$ differs from the step size the Jacobian was
    evaluated for by more than a factor `refactor_ratio` either way (this is how a step
    after rejections sees them: Diffrax discards a rejected step's state and the
    controller shrinks $h$). It refactors $W$, without a new Jacobian, whenever $h$
    differs from the factored one. Both are `jax.lax.cond`s: under `jax.vmap` over
    initial conditions a `cond` on batched values becomes a `select` that runs both
    branches, so every step then pays for a Jacobian and a factorisation.
    Dense output is the cubic Hermite interpolant, one extra evaluation of $f$ per step.

    For ODEs only (one `diffrax.ODETerm`), any pytree of real arrays, float32 or float64,
    or of complex ones (the Jacobian is then the complex one, as for
    [`diffrax_linearize.Rodas5P`][]; the order holds with it whatever the vector field).
    """

    linear_solver: eqx.AbstractVar[lx.AbstractLinearSolver]
    rtol: eqx.AbstractVar[float | None]
    atol: eqx.AbstractVar[float | None]
    jacobian_every: eqx.AbstractVar[int]
    refactor_ratio: eqx.AbstractVar[float]
    tableau: AbstractClassVar[_RodasTableau]

    term_structure: ClassVar = diffrax.AbstractTerm
    interpolation_cls: ClassVar = diffrax.ThirdOrderHermitePolynomialInterpolation.from_k

    def __check_init__(self):
        _check_tolerances(self)
        if not (isinstance(self.jacobian_every, int) and self.jacobian_every >= 1):
            raise ValueError(
                f"`diffrax_linearize.{type(self).__name__}(jacobian_every=...)` must be "
                f"an integer of at least 1, not {self.jacobian_every!r}."
            )
        if not self.refactor_ratio > 1:
            raise ValueError(
                f"`diffrax_linearize.{type(self).__name__}(refactor_ratio=...)` must be "
                f"greater than 1, not {self.refactor_ratio!r}."
            )

    def order(self, terms):
        return self.tableau.order

    def func(self, terms, t0, y0, args):
        return terms.vf(t0, y0, args)

    def _jacobian(self, g, t0, flat0):
        # W(s) = I/gamma - s dg/dy as one materialised operator (the structure engine sees
        # the identity, so W keeps J's pattern with its diagonal); affine in s, so its
        # derivative in s is -dg/dy in the same structure: one forward-mode pass.
        gamma = self.tableau.gamma
        one = jnp.ones((), flat0.dtype)

        def W_of(s):
            return solver_operator(lambda y, _: y / gamma - s * g(t0, y), flat0, None)

        return eqx.filter_jvp(W_of, (one,), (one,))

    def _factor(self, W):
        return jtu.tree_map(jax.lax.stop_gradient, self.linear_solver.init(W, {}))

    def init(self, terms, t0, t1, y0, args):
        _check_ode(self, terms, t0, t1)
        t0 = jnp.asarray(t0)
        h = jnp.asarray(t1) - t0
        flat0, _, _, g = _flat_increment(terms, t0, t1, y0, args)
        one = jnp.array(1, jnp.int32)
        if flat0.size == 0:  # see `_empty_step`: no Jacobian, no factorisation
            zero = jnp.array(0, jnp.int32)
            return WState(None, None, h, h, None, zero, zero, zero)
        W_J, dW = self._jacobian(g, t0, flat0)
        return WState(
            W_J=W_J,
            dW=dW,
            h_J=h,
            h_W=h,
            factorisation=self._factor(W_J),
            steps=jnp.array(0, jnp.int32),
            num_jacobians=one,
            num_factorisations=one,
        )

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        _check_ode(self, terms, t0, t1)
        tab = self.tableau
        st = solver_state
        t0 = jnp.asarray(t0)
        h = jnp.asarray(t1) - t0
        flat0, unravel, dtype, g = _flat_increment(terms, t0, t1, y0, args)
        if flat0.size == 0:
            k = jtu.tree_map(lambda a: jnp.stack([a, a]), y0)
            return _empty_step(y0, dict(y0=y0, y1=y0, k=k), st)

        with jax.numpy_dtype_promotion("standard"):
            ratio = h / st.h_J
        refresh = (
            jnp.asarray(made_jump)
            | (st.steps >= self.jacobian_every)
            | (ratio > self.refactor_ratio)
            | (ratio < 1 / self.refactor_ratio)
        )
        W_J, dW, h_J = jax.lax.cond(
            refresh,
            lambda: (*self._jacobian(g, t0, flat0), h),
            lambda: (st.W_J, st.dW, st.h_J),
        )
        with jax.numpy_dtype_promotion("standard"):
            W = _affine(W_J, dW, h / h_J - 1)
        refactor = refresh | (h != st.h_W)
        factorisation = jax.lax.cond(refactor, lambda: self._factor(W), lambda: st.factorisation)

        solve = _stage_solver(self, W, factorisation, g, t0, flat0, tab.gamma, exact=False)
        flat1, error, g0, _, result = _stages(tab, g, solve, t0, h, flat0, dtype)
        y1, y_error = rejectable(result, y0, unravel(flat1), unravel(error))
        g1 = g(t0 + h, flat1)
        k = jtu.tree_map(lambda a, b: jnp.stack([a, b]), unravel(g0), unravel(g1))
        dense_info = dict(y0=y0, y1=y1, k=k)
        new_state = WState(
            W_J=W_J,
            dW=dW,
            h_J=h_J,
            h_W=h,
            factorisation=factorisation,
            steps=jnp.where(refresh, 1, st.steps + 1).astype(jnp.int32),
            num_jacobians=st.num_jacobians + refresh.astype(jnp.int32),
            num_factorisations=st.num_factorisations + refactor.astype(jnp.int32),
        )
        return y1, y_error, dense_info, new_state, result


class ROS34PW2(AbstractRosenbrockW):
    r"""ROS34PW2, a stiffly accurate Rosenbrock-W method of order 3 with an embedded
    method of order 2 and 4 stages (J. Rang and L. Angermann, *New Rosenbrock W-methods of
    order 3 for partial differential algebraic equations of index 1*, BIT Numerical
    Mathematics 45, 761-787 (2005); coefficients as in OrdinaryDiffEq.jl). Its order
    conditions hold for any $W$, so the Jacobian and the factorisation of
    $W = I/\gamma - h J$ are kept across steps: see
    [`diffrax_linearize.AbstractRosenbrockW`][] for when they are renewed. Against
    [`diffrax_linearize.Rodas4P`][] (a Jacobian and a factorisation every step, order 4),
    it suits problems whose Jacobian is expensive to evaluate or factor, at loose to
    moderate tolerances.

    - **Error estimate:** the difference between the order-3 solution and the embedded
      order-2 one; use it with a [`diffrax_linearize.PredictiveController`][] with
      `steady=(0.9, 1.2)`, which keeps the step size, and so the factorisation, through
      small changes.
    - **Interpolation:** cubic Hermite, from $f$ at both ends of the step.

    **Arguments:**

    - `linear_solver`: the `lineax` solver that factors $W$;
        [`diffrax_linearize.StructuredLinearSolver`][] by default.
    - `rtol`, `atol`: the step-size controller's tolerances, for the GMRES path of
        [`diffrax_linearize.StructuredLinearSolver`][] only: its stage solves then stop
        when the root mean square of the residual over `atol + rtol |y0|` is below
        `linear_fraction` (0.05) times 1e-2, rather than at GMRES's own 1e-10 (no finer
        than the dtype resolves). `None` (the default) keeps 1e-10. Give both or
        neither. A Rosenbrock solver has no root finder through which
        `diffrax.diffeqsolve` could pass them.
    - `jacobian_every`: the most steps one Jacobian serves; 20 by default, CVODE's
        interval between linear-solver setups (`MSBP`): a W-method keeps its order
        with any Jacobian, so this bounds only how far stability and the error
        estimate may drift. `1` evaluates it every step.
    - `refactor_ratio`: a new Jacobian is evaluated when $h$ has changed by more than
        this factor since the last one (2 by default); a smaller change only refactors.

    ```python
    import diffrax
    import jax.numpy as jnp
    import diffrax_linearize as dl

    def robertson(t, y, args):
        y1, y2, y3 = y
        return jnp.stack([
            -0.04 * y1 + 1e4 * y2 * y3,
            0.04 * y1 - 1e4 * y2 * y3 - 3e7 * y2**2,
            3e7 * y2**2,
        ])

    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(robertson), dl.ROS34PW2(), t0=0.0, t1=100.0, dt0=1e-4,
        y0=jnp.array([1.0, 0.0, 0.0]),
        stepsize_controller=dl.PredictiveController(rtol=1e-4, atol=1e-8, steady=(0.9, 1.2)),
        saveat=diffrax.SaveAt(t1=True, solver_state=True),
    )
    sol.solver_state.num_jacobians  # far fewer than sol.stats["num_steps"]
    ```
    """

    linear_solver: lx.AbstractLinearSolver = StructuredLinearSolver()
    rtol: float | None = None
    atol: float | None = None
    jacobian_every: int = 20
    refactor_ratio: float = 2.0
    tableau: ClassVar[_RodasTableau] = _ROS34PW2
