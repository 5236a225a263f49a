"""Itô and Stratonovich Milstein solvers for commutative noise, without materialising
the diffusion through `prod`.

Every quantity that depends on the structure of the diffusion goes through
`ito_trace_term`, the double sums of `_term.py` (`ito_milstein_correction`,
`stratonovich_milstein_correction`, for general noise) and, when asked for,
`commutator_defect`: these are the hooks that the structure engine plugs into. Everything
else is one JVP, whatever the diffusion.
"""

import abc
import sys
from collections.abc import Callable
from typing import Any, ClassVar, TypeAlias

import equinox as eqx
import jax
import jax.flatten_util as jfu
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
from diffrax import (
    AbstractAdaptiveSolver,
    AbstractItoSolver,
    AbstractStratonovichSolver,
    AbstractTerm,
    HalfSolver,
    LocalLinearInterpolation,
    MultiTerm,
    RESULTS,
)
from jaxtyping import ArrayLike, Bool, PyTree, Real, Scalar

from .._brownian_carry import BrownianCarry, carried_terms, init_carry
from .._term import (
    ito_milstein_correction,
    linear_diffusion_prod,
    milstein_trace_term,
    real_noise_on_complex_state,
    stratonovich_milstein_correction,
)


_RealScalarLike: TypeAlias = Real[ArrayLike, ""]
_BoolScalarLike: TypeAlias = Bool[ArrayLike, ""]
_Y: TypeAlias = PyTree[ArrayLike]
_ErrorEstimate: TypeAlias = PyTree[ArrayLike]
# The Brownian tree's value at the end of the last step (`_brownian_carry.py`).
_SolverState: TypeAlias = BrownianCarry | None
_Terms: TypeAlias = MultiTerm[tuple[AbstractTerm[Any, _RealScalarLike], AbstractTerm]]

# Above this many elements in the stacked tangents of the diffusion (one copy of
# `diffusion.vf` per noise channel), the noise channels are processed in chunks rather
# than all at once, so that memory stays bounded for large dense diffusions.
_MAX_BATCHED_ELEMENTS = 2**26


def _control_basis(diffusion: AbstractTerm, t: _RealScalarLike) -> tuple[PyTree, int]:
    """The standard basis of the control space of `diffusion`, stacked along a new
    leading axis of every leaf, and its size `m`."""
    # Work around https://github.com/google/jax/issues/21825, as diffrax does.
    control_struct = eqx.filter_eval_shape(diffusion.contr, t, t)
    zeros = jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), control_struct)
    flat, unravel = jfu.ravel_pytree(zeros)
    basis = jax.vmap(unravel)(jnp.eye(flat.size, dtype=flat.dtype))
    return basis, flat.size


def _map_channels(fn: Callable, basis: PyTree, m: int, per_channel_size: int):
    """`jax.vmap(fn)(basis)`, in chunks if the batched intermediate would be large."""
    if m * per_channel_size <= _MAX_BATCHED_ELEMENTS:
        return jax.vmap(fn)(basis)
    batch_size = max(1, _MAX_BATCHED_ELEMENTS // max(per_channel_size, 1))
    return lax.map(fn, basis, batch_size=batch_size)


def _vf_size(diffusion: AbstractTerm, t, y, args) -> int:
    vf_struct = eqx.filter_eval_shape(diffusion.vf, t, y, args)
    leaves = jtu.tree_leaves(vf_struct, is_leaf=eqx.is_array_like)
    return sum(int(getattr(leaf, "size", 1)) for leaf in leaves)


def ito_trace_term(diffusion: AbstractTerm, t: _RealScalarLike, y: _Y, args) -> _Y:
    r"""$\sum_j (\partial g_{:,j} / \partial y)\, g_{:,j}$: for each noise channel $j$,
    the derivative of the $j$-th column of the diffusion matrix in the direction of
    that column, summed over $j$.

    This is the Itô correction of Milstein's method: the only part of the Itô step
    whose cost depends on the structure of the diffusion. It is computed by
    [`diffrax_linearize.milstein_trace_term`][] from the structure the engine detects:
    zero for additive noise, one JVP for scalar and diagonal noise, and otherwise one
    contraction of the structured derivative of the diffusion matrix with the matrix (for
    `g(y) = A y` the stored tensor `A`; for `g_ij = y_i G_ij` a delta times `G`), never
    `m` JVPs through `prod`.

    **Arguments:**

    - `diffusion`: the diffusion term, as in `MultiTerm(drift, diffusion)`.
    - `t`: the time at which to evaluate the diffusion.
    - `y`: the state, any PyTree.
    - `args`: passed on to `diffusion.vf`.

    **Returns:**

    A PyTree shaped like `y`.
    """
    return milstein_trace_term(diffusion, t, y, args)


def ito_trace_term_jvp(diffusion: AbstractTerm, t: _RealScalarLike, y: _Y, args) -> _Y:
    """The same as [`ito_trace_term`][], the obvious way: one JVP of `diffusion.vf` per
    noise channel, vectorised with `jax.vmap` over the standard basis of the control
    space. Kept as a reference for the tests."""
    basis, m = _control_basis(diffusion, t)
    g = diffusion.vf(t, y, args)

    def column_derivative(e):
        column = diffusion.prod(g, e)
        _, out = jax.jvp(lambda _y: diffusion.prod(diffusion.vf(t, _y, args), e), (y,), (column,))
        return out

    if m == 1:
        return column_derivative(jtu.tree_map(lambda b: b[0], basis))
    per_channel = _vf_size(diffusion, t, y, args)
    derivatives = _map_channels(column_derivative, basis, m, per_channel)
    return jtu.tree_map(lambda x: jnp.sum(x, axis=0), derivatives)


def commutator_defect(
    diffusion: AbstractTerm, t: _RealScalarLike, y: _Y, args
) -> tuple[Scalar, Scalar]:
    r"""How far the noise is from commuting at `(t, y)`.

    With $L^{j} = \sum_k g_{k j} \partial_k$, returns
    $\max_{i, j_1, j_2} |L^{j_1} g_{i j_2} - L^{j_2} g_{i j_1}|$ and
    $\max_{i, j_1, j_2} |L^{j_1} g_{i j_2}|$ (as a scale for a relative test).
    Materialises the $m \times m \times d$ tensor $L^{j_1} g_{:, j_2}$ with one JVP per
    noise channel: meant for an opt-in run-time check, not for every solve.
    """
    basis, m = _control_basis(diffusion, t)
    g = diffusion.vf(t, y, args)
    columns = jax.vmap(lambda e: diffusion.prod(g, e))(basis)

    def derivatives_along(column):
        # L^{j1} g_{:, j2} for all j2, with j1 fixed by `column`.
        _, dg = jax.jvp(lambda _y: diffusion.vf(t, _y, args), (y,), (column,))
        return jax.vmap(lambda e: diffusion.prod(dg, e))(basis)

    per_channel = m * _vf_size(diffusion, t, y, args)
    lg = _map_channels(derivatives_along, columns, m, per_channel)
    defect = jtu.tree_map(lambda x: jnp.abs(x - jnp.swapaxes(x, 0, 1)), lg)
    scale = jtu.tree_map(jnp.abs, lg)

    def _max(tree):
        leaves = [jnp.max(x, initial=0) for x in jtu.tree_leaves(tree)]
        return jnp.max(jnp.stack(leaves)) if leaves else jnp.array(0.0)

    return _max(defect), _max(scale)


def _commutativity_message(name: str) -> str:
    # Plain text: this is printed as it stands, no Markdown or LaTeX is rendered.
    general, bm = f"General{name}", "LevyAreaBrownianPath"
    return (
        f"`diffrax_linearize.{name}` assumes commutative noise, but the diffusion does not "
        "commute at the current state: L^j1 g_j2 != L^j2 g_j1 for some noise channels j1, "
        "j2 (g_j is the j-th column of the diffusion matrix and L^j = sum_k g_kj d/dy_k "
        "the derivative along it). On such noise this solver converges with strong order "
        f"0.5 only. For strong order 1 on any noise use `diffrax_linearize.{general}`, "
        f"with the Brownian motion wrapped in a `diffrax_linearize.{bm}`: "
        f"`diffrax.ControlTerm(g, diffrax_linearize.{bm}(bm, dt=dt0))`. (Solvers of "
        "strong order 0.5 on general noise: `diffrax.Euler` for an Itô SDE, "
        "`diffrax.EulerHeun` or `diffrax.SPaRK` for a Stratonovich SDE.) This check was "
        f"requested with `diffrax_linearize.{name}(check_commutativity=True)`."
    )


def _check_flag(solver, field: str):
    value = getattr(solver, field)
    if not isinstance(value, bool):
        raise TypeError(
            f"`diffrax_linearize.{type(solver).__name__}({field}=...)` must be `True` or "
            f"`False`, got {value!r}."
        )


class _StepParts(eqx.Module):
    """What the error estimate of a Milstein step needs from the step: the controls and
    the three products at `(t0, y0)` (each already multiplied by its control)."""

    dt: Any
    dw: Any
    f0_prod: Any
    g0_prod: Any
    # sum_{j1, j2} (L^{j1} g_{:, j2}) dw_{j1} dw_{j2}: the symmetric (Stratonovich) double
    # sum without Lévy areas and without the Itô trace term.
    v0_prod: Any


def _milstein_parts(
    name: str,
    ito: bool,
    check_commutativity: bool,
    terms: _Terms,
    t0: _RealScalarLike,
    t1: _RealScalarLike,
    y0: _Y,
    args,
) -> tuple[_Y, _StepParts]:
    drift, diffusion = terms.terms
    dt = drift.contr(t0, t1)
    dw = diffusion.contr(t0, t1)

    f0_prod = drift.vf_prod(t0, y0, args, dt)
    # For a linear diffusion with a compactly stored derivative, without forming g.
    # (The Stratonovich step also where the derivative is bigger than g: it needs no g.)
    g0_prod = linear_diffusion_prod(diffusion, t0, y0, args, dw, any_size=not ito)
    if g0_prod is None:
        g0_prod = diffusion.vf_prod(t0, y0, args, dw)

    # sum_{j1, j2} (L^{j1} g_{:, j2}) dw_{j1} dw_{j2}: the derivative of y -> g(y) dw in
    # the direction g(y0) dw. One JVP, unless the structured derivative does it cheaper.
    if ito:
        # For general noise, the whole Itô double sum in one contraction of the structured
        # derivative of the diffusion (each stored entry read once).
        correction = ito_milstein_correction(diffusion, t0, y0, args, g0_prod, dw, dt)
    else:
        # For general noise with a compactly stored derivative, one matrix-vector product
        # with it instead of a JVP that forms a d x m array; for g = A y, (A dw) applied to
        # g0_prod, the matrix A dw shared with g0_prod's (one pass over A in all).
        correction = stratonovich_milstein_correction(diffusion, t0, y0, args, g0_prod, dw)
    if correction is None:
        _, sym_prod = jax.jvp(lambda _y: diffusion.vf_prod(t0, _y, args, dw), (y0,), (g0_prod,))
        v0_prod = sym_prod
        if ito:
            # dw_{j1} dw_{j2} - delta_{j1 j2} dt: remove the diagonal dt part.
            trace = ito_trace_term(diffusion, t0, y0, args)
            with jax.numpy_dtype_promotion("standard"):
                v0_prod = jtu.tree_map(lambda v, tr: v - dt * tr, v0_prod, trace)
    elif not ito:
        v0_prod = sym_prod = correction
    else:
        v0_prod = correction
        # Only the error estimate needs the symmetric sum on its own: under a constant step
        # size the compiler drops this.
        trace = ito_trace_term(diffusion, t0, y0, args)
        with jax.numpy_dtype_promotion("standard"):
            sym_prod = jtu.tree_map(lambda v, tr: v + dt * tr, v0_prod, trace)

    with jax.numpy_dtype_promotion("standard"):
        y1 = jtu.tree_map(lambda y, f, g, v: y + f + g + 0.5 * v, y0, f0_prod, g0_prod, v0_prod)

    if check_commutativity:
        defect, scale = commutator_defect(diffusion, t0, y0, args)
        dtype = jnp.result_type(*jtu.tree_leaves(y0))
        rtol = jnp.sqrt(jnp.finfo(dtype).eps)
        y1 = eqx.error_if(y1, defect > rtol * scale, _commutativity_message(name))
    return y1, _StepParts(dt, dw, f0_prod, g0_prod, sym_prod)


def _milstein_step(
    name: str,
    ito: bool,
    check_commutativity: bool,
    terms: _Terms,
    t0: _RealScalarLike,
    t1: _RealScalarLike,
    y0: _Y,
    args,
) -> _Y:
    y1, _ = _milstein_parts(name, ito, check_commutativity, terms, t0, t1, y0, args)
    return y1


def _error_estimate(
    terms: _Terms,
    t1: _RealScalarLike,
    y1: _Y,
    args,
    parts: _StepParts,
    drift_weight: float = 0.5,
    milstein: bool = True,
) -> _Y:
    r"""The embedded error estimate of a Milstein step: the difference between the step
    and the stochastic trapezoidal (Heun) step that uses it as its predictor,

    $$E = w\,\big(f(t_1, y_1) - f(t_0, y_0)\big) \Delta t
    + \tfrac12 \big(g(t_1, y_1) - g(t_0, y_0)\big) \Delta W
    - \tfrac12 \sum_{j_1, j_2} (L^{j_1} g_{:, j_2}) \Delta W_{j_1} \Delta W_{j_2},$$

    with $w = \tfrac12$ for the explicit solvers and $w = \tfrac12 - \theta$ for the
    drift-implicit ones (the difference from the trapezoidal rule in the drift). The
    last term is dropped for Euler-Maruyama (`milstein=False`). Expanding $g(t_1, y_1)$
    about $(t_0, y_0)$, the $O(h)$ terms cancel and what is left is $O(h^{3/2})$: the
    mixed terms $\tfrac12 (L^j f) \Delta W_j h$ and $\tfrac12 (L^0 g) \Delta W h$ and
    the triple term $\tfrac14 \sum (L^{j_1} L^{j_2} g_{:, j_3}) \Delta W_{j_1}
    \Delta W_{j_2} \Delta W_{j_3}$, which are (up to their Lévy-area parts, and the
    $\tfrac14$ for a $\tfrac16$) the leading local error terms of Milstein's method, plus
    the $O(h^2)$ drift term $\tfrac12 (L^0 f) h^2$. Costs one drift and one diffusion
    product at $(t_1, y_1)$.
    """
    drift, diffusion = terms.terms
    f1_prod = drift.vf_prod(t1, y1, args, parts.dt)
    g1_prod = diffusion.vf_prod(t1, y1, args, parts.dw)

    def leaf(y, f0, f1, g0, g1, v=None):
        e = drift_weight * (f1 - f0) + 0.5 * (g1 - g0)
        if v is not None:
            e = e - 0.5 * v
        return e.astype(jnp.result_type(y))

    trees = (y1, parts.f0_prod, f1_prod, parts.g0_prod, g1_prod)
    if milstein:
        trees = (*trees, parts.v0_prod)
    with jax.numpy_dtype_promotion("standard"):
        return jtu.tree_map(leaf, *trees)


def _called_by_half_solver(solver, frame) -> bool:
    # Diffrax shows a solver neither the step-size controller nor a wrapping solver, so the
    # only sign of `diffrax.HalfSolver` is that its `step` calls ours: a few frames up
    # (equinox's bound-method call sits in between), at trace time, so this costs nothing
    # in the compiled program.
    for _ in range(4):
        if frame is None:
            return False
        owner = frame.f_locals.get("self")
        if isinstance(owner, HalfSolver) and owner.solver is solver:
            return True
        frame = frame.f_back
    return False


def _check_not_in_half_solver(solver, frame) -> None:
    if not _called_by_half_solver(solver, frame):
        return
    name = type(solver).__name__
    raise ValueError(
        f"`diffrax.HalfSolver(diffrax_linearize.{name}())`: `diffrax_linearize.{name}` "
        "cannot be wrapped in `diffrax.HalfSolver`, which estimates the error of a step "
        "from its two halves: the Lévy areas sampled for a step and for its halves are not "
        "related by Chen's relation, so that estimate, and any adaptive step sizes chosen "
        "from it, would be wrong. The solver has an error estimate of its own: pass it "
        "unwrapped with the step-size controller, "
        f"`diffrax.diffeqsolve(terms, diffrax_linearize.{name}(), ..., "
        "stepsize_controller=diffrax.PIDController(rtol=..., atol=...))`, or solve with "
        "fixed steps (`diffrax.ConstantStepSize`)."
    )


class SDESolverCommon:
    """What every explicit one-step SDE solver here shares (the Milstein solvers and
    `ItoTaylor15`): as solver state the Brownian tree's value at the end of the last step
    (so that each step descends the tree once, `_brownian_carry.py`), no order as an ODE
    solver, local linear interpolation, and `func` evaluating the drift and the
    diffusion."""

    interpolation_cls: ClassVar[Callable[..., LocalLinearInterpolation]] = LocalLinearInterpolation

    def order(self, terms):
        raise ValueError(
            f"`diffrax_linearize.{type(self).__name__}` should not be used to solve ODEs."
        )

    def init(self, terms: _Terms, t0: _RealScalarLike, t1: _RealScalarLike, y0: _Y, args):
        return init_carry(terms, t0)

    def func(self, terms: _Terms, t0: _RealScalarLike, y0: _Y, args):
        drift, diffusion = terms.terms
        return drift.vf(t0, y0, args), diffusion.vf(t0, y0, args)


class MilsteinCommon(SDESolverCommon):
    """What every Milstein solver here shares: `SDESolverCommon`'s, strong order one, and
    a `step` around the solver's own `_y1(terms, t0, t1, y0, args)` that returns the
    embedded error estimate of `_error_estimate`. Solvers with `fixed_steps_only` (those
    that sample Lévy areas) refuse to be wrapped in `diffrax.HalfSolver`."""

    fixed_steps_only: ClassVar[bool] = False

    def strong_order(self, terms):
        return 1

    @abc.abstractmethod
    def _y1(
        self, terms: _Terms, t0: _RealScalarLike, t1: _RealScalarLike, y0: _Y, args
    ) -> tuple[_Y, _StepParts]:
        """The state at `t1` after one step from `y0` at `t0`, and what its error
        estimate needs."""

    def step(
        self,
        terms: _Terms,
        t0: _RealScalarLike,
        t1: _RealScalarLike,
        y0: _Y,
        args,
        solver_state: _SolverState,
        made_jump: _BoolScalarLike,
    ) -> tuple[_Y, _ErrorEstimate, dict[str, _Y], _SolverState, RESULTS]:
        del made_jump
        if self.fixed_steps_only:
            _check_not_in_half_solver(self, sys._getframe(1))
        terms, solver_state = carried_terms(terms, t0, t1, solver_state)
        terms = real_noise_on_complex_state(terms, t0, y0)
        y1, parts = self._y1(terms, t0, t1, y0, args)
        # Under a constant step size nothing reads the estimate and the compiler drops it.
        y_error = _error_estimate(terms, t1, y1, args, parts)
        return y1, y_error, dict(y0=y0, y1=y1), solver_state, RESULTS.successful


class ItoMilstein(MilsteinCommon, AbstractAdaptiveSolver, AbstractItoSolver):
    r"""Milstein's method; Itô version. Converges to the Itô solution, with strong
    order 1 on commutative noise. Uses local linear interpolation for dense/ts output.

    For the SDE $\mathrm{d}y = f(t, y)\,\mathrm{d}t + g(t, y)\,\mathrm{d}W$ with $m$
    noise channels, one step from $y_0$ over $[t_0, t_1]$ is

    $$y_1 = y_0 + f \Delta t + g \Delta W + \tfrac{1}{2} \sum_{j_1, j_2}
    (L^{j_1} g_{:, j_2}) (\Delta W_{j_1} \Delta W_{j_2} - \delta_{j_1 j_2} \Delta t),
    \qquad L^{j} = \sum_k g_{k j} \partial_k,$$

    with $f$, $g$ evaluated at $(t_0, y_0)$. The double sum is never formed: it is one
    JVP of $y \mapsto g(y) \Delta W$ in the direction $g \Delta W$, minus
    $\Delta t \sum_j L^j g_{:, j}$, so no $d \times m$ matrix and no
    $d \times m \times m$ tensor is built.

    !!! warning

        Requires **commutative noise**: $L^{j_1} g_{:, j_2} = L^{j_2} g_{:, j_1}$ for
        all $j_1, j_2$. This holds for scalar, diagonal and additive noise, and for
        $g(y) = [A_1 y, \ldots, A_m y]$ with commuting $A_j$. On non-commutative noise
        the step drops the Lévy areas and converges with strong order 0.5 only
        (exactly as `diffrax.ItoMilstein` does). The assumption is not checked
        unless `check_commutativity=True`.

    This should be called with `terms=MultiTerm(drift_term, diffusion_term)`, where the
    drift is a `diffrax.ODETerm`. It is a drop-in replacement for
    `diffrax.ItoMilstein`: same term structure, interpolation and orders, and the
    same result on the same Brownian path up to floating-point rounding. Unlike Diffrax
    0.7.2's, it accepts PyTree-valued Brownian motions.

    **Adaptive steps.** The step returns an embedded error estimate, the difference from
    the stochastic trapezoidal (Heun) step that takes this step as its predictor:

    $$E = \tfrac12 \big(f(t_1, y_1) - f(t_0, y_0)\big) \Delta t
    + \tfrac12 \big(g(t_1, y_1) - g(t_0, y_0)\big) \Delta W
    - \tfrac12 \sum_{j_1, j_2} (L^{j_1} g_{:, j_2}) \Delta W_{j_1} \Delta W_{j_2},$$

    which is $O(h^{3/2})$: its terms are the leading local error terms of the step (the
    mixed terms $L^j f$, $L^0 g$ and the triple term $L^{j_1} L^{j_2} g$), as in the
    estimators of Julia's `RKMil` (Rackauckas & Nie 2017), which uses the drift part and
    a bound on the triple term. One drift and one diffusion product more per step, and
    nothing under a constant step size (the compiler drops what nobody reads). So
    `diffrax.diffeqsolve(terms, solver, t0, t1, None, y0,
    stepsize_controller=diffrax.PIDController(rtol=..., atol=...))` works, with
    Diffrax's error order of `strong_order + 0.5 = 1.5`; the Brownian motion must be one
    that can be re-queried on rejected steps, a `diffrax.VirtualBrownianTree` (Diffrax
    refuses `diffrax.UnsafeBrownianPath` with adaptive step sizes). Wrapping it in
    `diffrax.HalfSolver` works too, at three steps per step.

    Complex states and complex Brownian motions (real and imaginary parts independent,
    as Diffrax samples them) work: the result is that of `diffrax.ItoMilstein` on the
    equivalent real SDE for $(\mathrm{Re}\,y, \mathrm{Im}\,y)$. Diffrax 0.7.2's
    `diffrax.ItoMilstein` run on complex input differs from that by about $10^{-2}$ per
    step of size $0.1$ (proportionally to the step size), even with a real Brownian
    motion: there this solver is not a drop-in, it is a correction.
    """

    check_commutativity: bool = eqx.field(default=False, static=True)

    term_structure: ClassVar = _Terms

    def __init__(self, check_commutativity: bool = False):
        r"""**Arguments:**

        - `check_commutativity`: if `True`, check at every step that the noise commutes:
            compute $L^{j_1} g_{:, j_2} - L^{j_2} g_{:, j_1}$ numerically (one JVP per
            noise channel, and an $m \times m \times d$ tensor) and raise an error,
            through `equinox.error_if`, if it is not zero up to a relative tolerance of
            $\sqrt{\varepsilon}$ of the floating-point type. Expensive: for debugging.
            Defaults to `False`: the assumption is not checked.
        """
        self.check_commutativity = check_commutativity

    def __check_init__(self):
        _check_flag(self, "check_commutativity")

    def _y1(self, terms, t0, t1, y0, args):
        return _milstein_parts(
            "ItoMilstein", True, self.check_commutativity, terms, t0, t1, y0, args
        )


class StratonovichMilstein(MilsteinCommon, AbstractAdaptiveSolver, AbstractStratonovichSolver):
    r"""Milstein's method; Stratonovich version. Converges to the Stratonovich
    solution, with strong order 1 on commutative noise. Uses local linear
    interpolation for dense/ts output.

    For the SDE $\mathrm{d}y = f(t, y)\,\mathrm{d}t + g(t, y)\,\mathrm{d}W$ with $m$
    noise channels, one step from $y_0$ over $[t_0, t_1]$ is

    $$y_1 = y_0 + f \Delta t + g \Delta W + \tfrac{1}{2} \sum_{j_1, j_2}
    (L^{j_1} g_{:, j_2}) \Delta W_{j_1} \Delta W_{j_2},
    \qquad L^{j} = \sum_k g_{k j} \partial_k,$$

    with $f$, $g$ evaluated at $(t_0, y_0)$. The double sum is one JVP of
    $y \mapsto g(y) \Delta W$ in the direction $g \Delta W$, or, for general noise whose
    structured derivative stores no more numbers than $g$ (for $g_{ij} = f(y_i) G_{ij}$),
    one matrix-vector product with that derivative.

    !!! warning

        Requires **commutative noise**: $L^{j_1} g_{:, j_2} = L^{j_2} g_{:, j_1}$ for
        all $j_1, j_2$. This holds for scalar, diagonal and additive noise, and for
        $g(y) = [A_1 y, \ldots, A_m y]$ with commuting $A_j$. On non-commutative noise
        the step drops the Lévy areas and converges with strong order 0.5 only
        (exactly as `diffrax.StratonovichMilstein` does). The assumption is not
        checked unless `check_commutativity=True`.

    This should be called with `terms=MultiTerm(drift_term, diffusion_term)`, where the
    drift is a `diffrax.ODETerm`. It is a drop-in replacement for
    `diffrax.StratonovichMilstein`: same term structure, interpolation and orders,
    and the same result on the same Brownian path up to floating-point rounding.

    **Adaptive steps.** As for [`diffrax_linearize.ItoMilstein`][]: the step returns the
    same embedded error estimate (the difference from the stochastic trapezoidal step
    that takes it as predictor, $O(h^{3/2})$), so `diffrax.PIDController` works unwrapped
    with a `diffrax.VirtualBrownianTree`, and `diffrax.HalfSolver` works too.
    """

    check_commutativity: bool = eqx.field(default=False, static=True)

    term_structure: ClassVar = _Terms

    def __init__(self, check_commutativity: bool = False):
        r"""**Arguments:**

        - `check_commutativity`: if `True`, check at every step that the noise commutes:
            compute $L^{j_1} g_{:, j_2} - L^{j_2} g_{:, j_1}$ numerically (one JVP per
            noise channel, and an $m \times m \times d$ tensor) and raise an error,
            through `equinox.error_if`, if it is not zero up to a relative tolerance of
            $\sqrt{\varepsilon}$ of the floating-point type. Expensive: for debugging.
            Defaults to `False`: the assumption is not checked.
        """
        self.check_commutativity = check_commutativity

    def __check_init__(self):
        _check_flag(self, "check_commutativity")

    def _y1(self, terms, t0, t1, y0, args):
        return _milstein_parts(
            "StratonovichMilstein", False, self.check_commutativity, terms, t0, t1, y0, args
        )
