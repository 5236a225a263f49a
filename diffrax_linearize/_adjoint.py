"""The continuous (backsolve) adjoint, with the adjoint vector field taken from the
structure engine, for the solvers and SDEs that `diffrax.BacksolveAdjoint` rejects.

The backward solve runs forwards in reversed time (`_TimeReversed`), so that solvers
that read the step or the Lévy areas directly (stochastic Runge-Kutta) see true
increments.

Diffrax's `AdjointTerm.vf` materialises the linear map `control -> vf_prod(..., control)`
with `jax.jacfwd`/`jax.jacrev` over the control: $1 + m$ forward-over-reverse passes per
evaluation. Here the same matrix comes from [`diffrax_linearize.materialise`][], and the
solver that calls `vf` at every step, `diffrax.ReversibleHeun`, is run backwards in an
exactly equivalent form that needs `vf_prod` (one VJP) only.
"""

import functools as ft
import typing
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import diffrax
import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import optimistix as optx
from jaxtyping import PyTree

from ._compat import (
    AbstractSRK,
    AdditiveCoeffs,
    is_sde,
    is_unsafe_sde,
    nondiff_solver_controller_state as _nondiff_solver_controller_state,
    only_transpose_ys as _only_transpose_ys,
    save_y,
)
from ._levy_area import IteratedIntegrals
from ._materialise import solver_jacobian
from ._solver.implicit import (
    ImplicitEulerMaruyama as _ImplicitEulerMaruyama,
    ImplicitItoMilstein as _ImplicitItoMilstein,
    ImplicitStratonovichMilstein as _ImplicitStratonovichMilstein,
)
from ._solver.milstein import (
    ItoMilstein as _OurItoMilstein,
    StratonovichMilstein as _OurStratonovichMilstein,
)
from ._term import milstein_trace_term


_API = "diffrax_linearize.BacksolveAdjoint"


def _is_subsaveat(x: Any) -> bool:
    return isinstance(x, diffrax.SubSaveAt)


def _is_term(x: Any) -> bool:
    return isinstance(x, diffrax.AbstractTerm)


def _add(*xs):
    with jax.numpy_dtype_promotion("standard"):
        return ft.reduce(lambda a, b: a + b, xs)


def _control_zeros(term: diffrax.AbstractTerm, t, **kwargs) -> PyTree:
    # Only the shape of the control matters (the maps below are linear in it), so do not
    # evaluate the Brownian path.
    struct = eqx.filter_eval_shape(lambda _t: term.contr(_t, _t, **kwargs), t)
    return jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), struct)


# --- terms


def _identity(terms):
    return terms


class _ItoCorrectedDrift(diffrax.AbstractTerm):
    r"""The drift of the Stratonovich SDE equivalent to an Itô SDE:
    $\tilde f = f - \tfrac{1}{2} \sum_j (\partial g_{:, j} / \partial y) g_{:, j}$, the
    sum from [`diffrax_linearize.milstein_trace_term`][]. The control is the drift's own
    scalar control (`dt`); `drift=None` stands for a zero drift."""

    drift: diffrax.AbstractTerm | None
    diffusion: diffrax.AbstractTerm

    def contr(self, t0, t1, **kwargs):
        if self.drift is None:
            return t1 - t0
        return self.drift.contr(t0, t1, **kwargs)

    def vf(self, t, y, args):
        trace = milstein_trace_term(self.diffusion, t, y, args)
        if self.drift is None:
            return jtu.tree_map(lambda c: -0.5 * c, trace)
        one = jtu.tree_map(jnp.ones_like, _control_zeros(self.drift, t))
        f = self.drift.vf_prod(t, y, args, one)
        with jax.numpy_dtype_promotion("standard"):
            return jtu.tree_map(lambda a, c: a - 0.5 * c, f, trace)

    def prod(self, vf, control):
        with jax.numpy_dtype_promotion("standard"):
            return jtu.tree_map(lambda v: v * control, vf)

    def vf_prod(self, t, y, args, control):
        return self.prod(self.vf(t, y, args), control)


def _split_sde(terms) -> tuple[diffrax.AbstractTerm | None, diffrax.AbstractTerm]:
    """`(drift, diffusion)` of an Itô SDE given as `MultiTerm(drift, diffusion)` (in any
    order) or as a lone diffusion term."""
    parts = terms.terms if isinstance(terms, diffrax.MultiTerm) else (terms,)
    noise = [p for p in parts if is_sde(p)]
    drift = [p for p in parts if not is_sde(p)]
    if len(noise) != 1 or len(drift) > 1:
        raise ValueError(
            f"`{_API}` differentiates an Itô SDE by converting it to the equivalent "
            "Stratonovich SDE, which needs the terms to be one diffusion term driven by a "
            "Brownian motion and at most one drift term, as "
            "`diffrax.MultiTerm(diffrax.ODETerm(drift), diffrax.ControlTerm(diffusion, "
            f"brownian_motion))`; got {len(noise)} Brownian term(s) and {len(drift)} other "
            "term(s). Combine the diffusions into one `diffrax.ControlTerm` (and the drifts "
            "into one `diffrax.ODETerm`), or use `diffrax.RecursiveCheckpointAdjoint`."
        )
    return (drift[0] if drift else None), noise[0]


def _ito_to_stratonovich(terms):
    drift, diffusion = _split_sde(terms)
    return diffrax.MultiTerm(_ItoCorrectedDrift(drift, diffusion), diffusion)


class _AdjointTerm(diffrax.AbstractTerm):
    r"""The adjoint of one term of the forward SDE/ODE, acting on the augmented state
    $(y, a_y, a_\text{args}, a_\text{terms})$.

    The term is `convert(terms)` (or its `index`-th part if that is a `MultiTerm`), but the
    parameters differentiated are those of the original `terms`, so gradients come back
    in the structure `diffrax.diffeqsolve` was given, whatever `convert` does (the Itô
    correction reuses the diffusion's parameters).
    """

    terms: PyTree[diffrax.AbstractTerm]
    convert: Callable = eqx.field(static=True)
    index: int | None = eqx.field(static=True)

    def _term(self, terms) -> diffrax.AbstractTerm:
        converted = self.convert(terms)
        return converted if self.index is None else converted.terms[self.index]

    def contr(self, t0, t1, **kwargs):
        return self._term(self.terms).contr(t0, t1, **kwargs)

    def vf_prod(self, t, y, args, control):
        y, a_y, _, _ = y
        diff_args, nondiff_args = eqx.partition(args, eqx.is_inexact_array)
        diff_terms, nondiff_terms = eqx.partition(self.terms, eqx.is_inexact_array)

        def _to_vjp(_y, _diff_args, _diff_terms):
            _args = eqx.combine(_diff_args, nondiff_args)
            _term = self._term(eqx.combine(_diff_terms, nondiff_terms))
            return _term.vf_prod(t, _y, _args, control)

        dy, vjp = jax.vjp(_to_vjp, y, diff_args, diff_terms)
        da_y, da_args, da_terms = vjp(jtu.tree_map(jnp.negative, a_y))
        return dy, da_y, da_args, da_terms

    def vf(self, t, y, args):
        # `vf_prod` is linear in the control: its matrix is what the solver asks for. The
        # structure engine reads it off the jaxpr of the VJP (for `g_ij = y_i G_ij` it is
        # `y[:, None] * G` and `-a[:, None] * G`, with no pass per noise channel). Without
        # `materialise`'s check for `jax.jacfwd`'s NaN pattern, which under `jax.vmap`
        # (ensembles) would recompute every Jacobian as `jax.jacfwd` does.
        control = _control_zeros(self, t)
        fn = lambda c: self.vf_prod(t, y, args, c)
        out_tree = jtu.tree_structure(jax.eval_shape(fn, control))
        jac = solver_jacobian(fn, control)
        # Diffrax's `AdjointTerm` layout: control tree outermost.
        return jtu.tree_transpose(out_tree, jtu.tree_structure(control), jac)

    def prod(self, vf, control):
        c_leaves, c_tree = jtu.tree_flatten(control)
        pieces = c_tree.flatten_up_to(vf)
        out = [
            jtu.tree_map(lambda v, c=c: jnp.tensordot(v, c, axes=jnp.ndim(c)), piece)
            for piece, c in zip(pieces, c_leaves)
        ]
        return jtu.tree_map(_add, *out)

    def is_vf_expensive(self, t0, t1, y, args) -> bool:
        control = eqx.filter_eval_shape(self.contr, t0, t1)
        return sum(c.size for c in jtu.tree_leaves(control)) not in (0, 1)


def _adjoint_terms(terms, convert: Callable, split: bool):
    """The adjoint terms for the backward solve: one `_AdjointTerm` for the whole of
    `convert(terms)`, or, for a solver that needs a `MultiTerm`, a `MultiTerm` of the
    adjoints of its parts (the adjoint equation is linear in the controls, so the adjoint
    of a sum of terms is the sum of their adjoints on the shared augmented state)."""
    converted = convert(terms)
    if split:
        n = len(converted.terms)
        return diffrax.MultiTerm(*[_AdjointTerm(terms, convert, i) for i in range(n)])
    return _AdjointTerm(terms, convert, None)


# --- the backward solve, forwards in reversed time


def _is_brownian(term: diffrax.AbstractTerm) -> bool:
    # `_ItoCorrectedDrift` holds the diffusion (and so a Brownian motion) but is driven by dt.
    return not isinstance(term, _ItoCorrectedDrift) and is_sde(term)


def _reversed_increment(control):
    """The increment over $[s_0, s_1]$ of the reversed Brownian motion $B(s) = W(-s)$, from
    `control`, that of $W$ over $[-s_1, -s_0]$: $W$ and the odd Lévy areas change sign, the
    space-time area $H$ and the step `dt` do not (see the class docstring)."""
    neg = lambda x: jtu.tree_map(jnp.negative, x)
    if isinstance(control, IteratedIntegrals):
        return eqx.tree_at(lambda c: (c.W, c.A), control, replace_fn=neg)
    if isinstance(control, diffrax.AbstractSpaceTimeTimeLevyArea):
        return eqx.tree_at(lambda c: (c.W, c.K), control, replace_fn=neg)
    if isinstance(control, diffrax.AbstractBrownianIncrement):
        # A plain increment or a space-time area: exactly these two kinds are known here.
        if type(control) not in (diffrax.BrownianIncrement, diffrax.SpaceTimeLevyArea):
            raise NotImplementedError(
                f"`{_API}` solves the adjoint backwards in time, which needs the Brownian "
                f"increments reversed in time; it does not know how for "
                f"`{type(control).__name__}`. Use `diffrax.RecursiveCheckpointAdjoint`."
            )
        return eqx.tree_at(lambda c: c.W, control, replace_fn=neg)
    return neg(control)


def _reverse_control(term: diffrax.AbstractTerm, control):
    """The control of `term` over $[-s_1, -s_0]$ made that of the same term in reversed
    time over $[s_0, s_1]$."""
    if isinstance(term, diffrax.MultiTerm):
        return tuple(_reverse_control(t, c) for t, c in zip(term.terms, control))
    if _is_brownian(term):
        return _reversed_increment(control)
    return jtu.tree_map(jnp.negative, control)


class _TimeReversed(diffrax.AbstractTerm):
    r"""An adjoint term in reversed time $s = -t$, so that the backward pass is a solve
    forwards in $s$ and every solver sees increasing times and true increments.

    Diffrax would run the backward solve itself with decreasing times, wrapping every term
    so that its control is negated. That is wrong for two kinds of solver. Stochastic
    Runge-Kutta methods (`diffrax.SPaRK`, `diffrax.GeneralShARK`, ...) take the drift's
    control to be the step $h = t_1 - t_0$ rather than `drift.contr(t0, t1)`, so a wrapped
    drift runs forwards in time: with dy = -y/2 dt, d/dy0 came out as 1.6487 (e^{1/2})
    instead of 0.6065. And negating a Brownian increment negates its Lévy areas: for the
    reversed path $B(s) = W(-s)$ the increment is $-\Delta W$, but the space-time area is
    $+H$ (the time-time area $-K$, the Lévy area $-A$), and the step is $+h$.

    So here: a term driven by time (or by any non-Brownian control) keeps the control of
    $[-s_1, -s_0]$, which is $+h$ for time, and has its vector field negated; a Brownian
    term has its increment reversed as above and its vector field unchanged; a
    `MultiTerm` (one adjoint term over drift and diffusion, for solvers that take a single
    term) has each part of its control reversed. Each is exactly the reversed-time SDE, and
    for the solvers that use `contr` the numbers are those of Diffrax's own reversal.
    """

    term: _AdjointTerm

    def _part(self) -> diffrax.AbstractTerm:
        return self.term._term(self.term.terms)

    def _negates_vf(self) -> bool:
        part = self._part()
        return not isinstance(part, diffrax.MultiTerm) and not _is_brownian(part)

    def contr(self, s0, s1, **kwargs):
        control = self.term.contr(-s1, -s0, **kwargs)
        return control if self._negates_vf() else _reverse_control(self._part(), control)

    def vf(self, s, y, args):
        vf = self.term.vf(-s, y, args)
        return jtu.tree_map(jnp.negative, vf) if self._negates_vf() else vf

    def vf_prod(self, s, y, args, control):
        if self._negates_vf():
            control = jtu.tree_map(jnp.negative, control)
        return self.term.vf_prod(-s, y, args, control)

    def prod(self, vf, control):
        return self.term.prod(vf, control)

    def is_vf_expensive(self, s0, s1, y, args) -> bool:
        return self.term.is_vf_expensive(-s1, -s0, y, args)


def _time_reversed(terms):
    return jtu.tree_map(_TimeReversed, terms, is_leaf=lambda x: isinstance(x, _AdjointTerm))


# --- the backward solver for ReversibleHeun


class _ReversibleHeunVfProd(diffrax.AbstractAdaptiveSolver, diffrax.AbstractStratonovichSolver):
    """`diffrax.ReversibleHeun` with `prod(vf(t, y), control)` replaced by
    `vf_prod(t, y, control)`, for the backward pass.

    Reversible Heun keeps `vf(t0, yhat0)` in its state and uses it as
    `prod(vf(t0, yhat0), control)`. Keeping `yhat0` alone and evaluating
    `vf_prod(t0, yhat0, control)` gives the same numbers (`prod` is bilinear and
    `prod(vf(t, y), c) = vf_prod(t, y, c)`), at two `vf_prod`s per step and no
    materialised vector field: on the adjoint term `vf_prod` is one VJP, while the vector
    field is a $(2d + p) \\times m$ matrix.

    Jumps differ, on purpose. On the backward pass a jump adds the cotangent of a saved
    output to the adjoint state. `diffrax.ReversibleHeun` then re-evaluates the vector field
    at `y0` but keeps `yhat0`, so `2 y0 - yhat0` takes in the jump twice over, an error
    that never decays: with `SaveAt(ts=...)` Diffrax's backsolve is off by about 1e-4
    even for ODEs, and by 1e-2 for SDEs. Here the jump moves `yhat0` by as much as `y0`
    (the state keeps the end point of the last step to measure it), which is exactly the
    scheme continued when the jump is zero.
    """

    term_structure: ClassVar = diffrax.AbstractTerm
    interpolation_cls: ClassVar[Callable[..., diffrax.LocalLinearInterpolation]] = (
        diffrax.LocalLinearInterpolation
    )

    def order(self, terms):
        return 2

    def strong_order(self, terms):
        return 0.5

    def init(self, terms, t0, t1, y0, args):
        del t1
        return y0, y0

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        yhat0, y_end = solver_state
        with jax.numpy_dtype_promotion("standard"):
            yhat0 = lax.cond(
                made_jump,
                lambda: jtu.tree_map(lambda h, a, b: h + (a - b), yhat0, y0, y_end),
                lambda: yhat0,
            )
            control = terms.contr(t0, t1)
            k0 = terms.vf_prod(t0, yhat0, args, control)
            yhat1 = jtu.tree_map(lambda a, b, k: 2 * a - b + k, y0, yhat0, k0)
            k1 = terms.vf_prod(t1, yhat1, args, control)
            y1 = jtu.tree_map(lambda a, p, q: a + 0.5 * (p + q), y0, k0, k1)
            y1_error = jtu.tree_map(lambda p, q: 0.5 * (q - p), k0, k1)
        dense_info = dict(y0=y0, y1=y1)
        return y1, y1_error, dense_info, (yhat1, y1), diffrax.RESULTS.successful

    def func(self, terms, t0, y0, args):
        return terms.vf(t0, y0, args)


# --- choosing the backward solve


def _is_multiterm_structure(term_structure) -> bool:
    return term_structure is diffrax.MultiTerm or typing.get_origin(term_structure) is (
        diffrax.MultiTerm
    )


def _check_term_structure(solver, role: str):
    structure = solver.term_structure
    if jtu.tree_structure(structure) != jtu.tree_structure(0):
        raise NotImplementedError(
            f"`{_API}` supports solvers whose `term_structure` is a single term or a "
            f"`diffrax.MultiTerm`; the {role} solver `{type(solver).__name__}` takes a "
            f"PyTree of terms ({structure}). Use `diffrax.RecursiveCheckpointAdjoint` "
            "with this solver."
        )
    if isinstance(solver, AbstractSRK) and isinstance(
        getattr(solver.tableau, "coeffs_w", None), AdditiveCoeffs
    ):
        raise NotImplementedError(
            f"`{type(solver).__name__}` is only correct for additive noise, and the "
            f"adjoint SDE that `{_API}` solves backwards never has additive noise (its "
            "diffusion depends on the adjoint state). Pass a general-noise solver for the "
            f"backward pass, e.g. `{_API}(solver=diffrax.SPaRK())`, or use "
            "`diffrax.RecursiveCheckpointAdjoint`."
        )


def _backward_plan(terms, solver, user_solver) -> tuple[Any, Callable]:
    """`(backward_solver, convert)`: the solver for the adjoint equation and the map from
    the forward terms to the Stratonovich (or ODE) terms whose adjoint it solves."""
    convert = _identity
    if is_sde(terms) and isinstance(solver, diffrax.AbstractItoSolver):
        _split_sde(terms)  # raises a clear error for unsupported layouts
        drift, _ = _split_sde(terms)
        if drift is not None:
            control = eqx.filter_eval_shape(lambda: drift.contr(0.0, 1.0))
            leaves = jtu.tree_leaves(control)
            if len(leaves) != 1 or leaves[0].shape != ():
                raise ValueError(
                    f"`{_API}` converts an Itô SDE to Stratonovich form by correcting the "
                    "drift, which needs the drift's control to be the scalar time "
                    f"increment (as for `diffrax.ODETerm`); got {control}."
                )
        convert = _ito_to_stratonovich
        if user_solver is not None:
            if not isinstance(user_solver, diffrax.AbstractStratonovichSolver):
                raise ValueError(
                    f"`{_API}` solves the adjoint of an Itô SDE as a Stratonovich SDE, so "
                    f"the backward solver must converge to the Stratonovich solution; got "
                    f"`{_API}(solver={type(user_solver).__name__}())`. Pass e.g. "
                    "`solver=diffrax.EulerHeun()` or "
                    "`solver=diffrax_linearize.StratonovichMilstein()`, or leave `solver` "
                    "out to get the default."
                )
            backward = user_solver
        elif isinstance(solver, (diffrax.ItoMilstein, _OurItoMilstein)):
            backward = _OurStratonovichMilstein()
        elif isinstance(solver, (_ImplicitItoMilstein, _ImplicitEulerMaruyama)):
            # The adjoint of a stiff drift is as stiff: keep the drift implicit backwards.
            # Euler-Maruyama's backward step is Milstein's (Stratonovich needs the
            # correction to converge), on commutative noise unless told otherwise.
            backward = _ImplicitStratonovichMilstein(
                theta=solver.theta,
                general_noise=getattr(solver, "general_noise", False),
                root_finder=solver.root_finder,
                root_find_max_steps=solver.root_find_max_steps,
            )
        else:
            backward = diffrax.EulerHeun()
    else:
        if is_sde(terms) and not isinstance(solver, diffrax.AbstractStratonovichSolver):
            warnings.warn(
                f"{type(solver).__name__} is not marked as converging to either the Itô "
                f"or the Stratonovich solution; `{_API}` treats the SDE as Stratonovich."
            )
        backward = solver if user_solver is None else user_solver
        _check_term_structure(solver, "forward")
    _check_term_structure(backward, "backward")
    if type(backward) is diffrax.ReversibleHeun:
        backward = _ReversibleHeunVfProd()
    return backward, convert


# --- the custom VJP (diffrax's `_loop_backsolve`, with our adjoint terms and solver)


_inner_loop = jax.named_call(ft.partial(eqx.internal.while_loop, kind="lax"), name="inner-loop")
_outer_loop = jax.named_call(ft.partial(eqx.internal.while_loop, kind="lax"), name="outer-loop")


@eqx.filter_custom_vjp
def _loop_backsolve(y__args__terms, *, self, throw, init_state, backward, convert, **kwargs):
    del throw, backward, convert
    y, args, terms = y__args__terms
    init_state = eqx.tree_at(lambda s: s.y, init_state, y)
    return self._loop(
        args=args,
        terms=terms,
        init_state=init_state,
        inner_while_loop=_inner_loop,
        outer_while_loop=_outer_loop,
        **kwargs,
    )


@_loop_backsolve.def_fwd
def _loop_backsolve_fwd(perturbed, y__args__terms, **kwargs):
    del perturbed
    final_state, aux_stats = _loop_backsolve(y__args__terms, **kwargs)
    ts = final_state.save_state.ts
    ys = final_state.save_state.ys
    return (final_state, aux_stats), (ts, ys)


def _materialise_none(y, grad_y):
    if grad_y is None and eqx.is_inexact_array(y):
        return jnp.zeros_like(y)
    return grad_y


_OUT_OF_STEPS = (
    f"`{_API}`: the backward solve reached `max_steps`. It recomputes the state "
    "backwards in time, where any error grows as fast as the ODE's solutions converge "
    "forwards: on a stiff ODE (the modes that decay fast forwards, an eigenvalue -lambda "
    "of the Jacobian, grow as exp(lambda |t|), whatever the solver: `diffrax.Kvaerno5` as "
    "`diffrax_linearize.BDF`) or a chaotic or strongly dissipative one (the Lorenz "
    "system over more than a short interval), no number of steps is enough. "
    "Differentiate such a solve with `adjoint=diffrax.RecursiveCheckpointAdjoint()` (the "
    "default) or `diffrax.DirectAdjoint()`; otherwise raise "
    f"`{_API}(max_steps=...)`."
)


# How far, in units of the controller's tolerance (the RMS of the difference over
# `atol + rtol |y|`), the state recomputed by a segment of the backward solve may end from
# the forward solve's (at `t0` or a save time): `_RECOMPUTED_PER_STEP` per accepted step
# of the segment, and at least `_RECOMPUTED_TOLERANCES`. Each step of the forward and of
# the backward solve may leave about one tolerance of local error, and on an ODE whose
# solutions neither converge nor diverge fast these add up about linearly, so a fixed
# bound fails long solves: a pendulum over 45 periods ends 780 tolerances away (2466
# backward steps, rtol 1e-8), Lotka-Volterra over 11 periods with `diffrax_linearize.BDF`
# 1.1e4 (3146 steps, rtol 1e-6) and over 22 in float32 at rtol 1e-8 (below its
# resolution) 5e3 (3186 steps): at most 3.4 per step, each with the gradient of
# `diffrax.BacksolveAdjoint` and within 6e-3 of `diffrax.RecursiveCheckpointAdjoint`'s.
# Where the forward solutions converge fast (a stiff ODE's decaying modes, a chaotic
# attractor's contracting directions), the errors grow exponentially backwards in time:
# 3e5 tolerances on a linear ODE with an eigenvalue -1000 (19-83 steps: 3.5e3 to 1.5e4 per
# step), 4.4e3 on Lorenz over t in [0, 0.5] (38 steps: 115 per step), 5e10 over [0, 2],
# 6e5 on the pendulum above at rtol 1e-3 (276 steps: 2e3 per step), with gradients wrong
# by 3e-4 at rtol 1e-6 and more, and no solve failing.
_RECOMPUTED_TOLERANCES = 1e3
_RECOMPUTED_PER_STEP = 100

_NOT_RECOMPUTED = (
    f"`{_API}`: the state recomputed by the backward solve ends far from the forward "
    "solve's (at `t0` or a save time; more than "
    f"{_RECOMPUTED_PER_STEP:g} times the step-size controller's tolerance per step, and "
    f"at least {_RECOMPUTED_TOLERANCES:g}), so the gradients would be wrong. The backward "
    "solve recomputes the state backwards in time, where any error grows as fast as the "
    "ODE's solutions converge forwards: on a stiff ODE (fast decaying modes, whatever the "
    "solver) or a chaotic or strongly dissipative one (the Lorenz system over more than "
    "a short interval), no tolerance is enough; otherwise the tolerances may be too loose "
    "for the length of the solve. Differentiate such a solve with "
    "`adjoint=diffrax.RecursiveCheckpointAdjoint()` (the default) or "
    "`diffrax.DirectAdjoint()`, or tighten `rtol` and `atol`."
)


def _recomputed_distance(controller):
    """The function `(y_back, y) -> ` the RMS distance of the recomputed state `y_back`
    from the forward solve's `y` in units of `controller`'s tolerances, or `None` when
    it has none (constant steps)."""
    rtol, atol = getattr(controller, "rtol", None), getattr(controller, "atol", None)
    if rtol is None or atol is None:
        return None

    def scaled(back, forward):
        return (back - forward) / (atol + rtol * jnp.abs(forward))

    def distance(y_back, y):
        # `optimistix.rms_norm`, the controller's default norm: 0 for a state with no
        # entries, where a mean over none is NaN.
        with jax.numpy_dtype_promotion("standard"):
            return optx.rms_norm(jtu.tree_map(scaled, y_back, y))

    return distance


def _allowed(steps):
    """How far (see `_RECOMPUTED_TOLERANCES`) a segment of `steps` accepted steps may end."""
    return jnp.maximum(_RECOMPUTED_TOLERANCES, _RECOMPUTED_PER_STEP * steps)


def _check_backward(sol):
    sol = eqx.error_if(sol, sol.result == diffrax.RESULTS.max_steps_reached, _OUT_OF_STEPS)
    return sol.result.error_if(sol, jnp.invert(diffrax.is_okay(sol.result)))


@_loop_backsolve.def_bwd
def _loop_backsolve_bwd(
    residuals,
    grad_final_state__aux_stats,
    perturbed,
    y__args__terms,
    *,
    self,
    solver,
    stepsize_controller,
    event,
    saveat,
    t0,
    t1,
    dt0,
    max_steps,
    throw,
    init_state,
    progress_meter,
    backward,
    convert,
):
    del perturbed, init_state, t1, progress_meter, event, solver
    ts, ys = residuals
    grad_final_state, _ = grad_final_state__aux_stats
    grad_ys = jtu.tree_map(_materialise_none, ys, grad_final_state.save_state.ys)
    y, args, terms = y__args__terms
    diff_args = eqx.filter(args, eqx.is_inexact_array)
    diff_terms = eqx.filter(terms, eqx.is_inexact_array)
    adjoint_terms = _adjoint_terms(terms, convert, _is_multiterm_structure(backward.term_structure))
    solve_kwargs = dict(
        args=args,
        adjoint=self,
        solver=backward,
        stepsize_controller=stepsize_controller,
        dt0=None if dt0 is None else -dt0,
        max_steps=max_steps,
        throw=throw,
    )
    solve_kwargs.update({k: v for k, v in self.kwargs.items() if k != "solver"})
    # The backward solve's failures are raised below, where running out of steps gets
    # its own message: Diffrax's ("increase `max_steps`") misleads on stiff ODEs.
    throw = solve_kwargs.pop("throw")
    # Solved forwards in s = -t (see `_TimeReversed`): the step-size controller reversed
    # as `diffrax.diffeqsolve` would for decreasing times, and `dt0` (negative, as for a
    # solve from t1 to t0) made positive.
    solve_kwargs.update(
        terms=_time_reversed(adjoint_terms),
        stepsize_controller=solve_kwargs["stepsize_controller"].wrap(-1),
        dt0=None if solve_kwargs["dt0"] is None else -solve_kwargs["dt0"],
    )
    saveat_t0 = saveat.subs.t0
    # Each segment recomputes the state from the forward solve's value at its start, and
    # must end near the forward solve's value at its end (see `_NOT_RECOMPUTED`): checked
    # for ODEs only, as an SDE's backward solve recomputes its state only to the solver's
    # strong order.
    distance = None
    if throw and not is_sde(terms):
        distance = _recomputed_distance(solve_kwargs["stepsize_controller"])

    def scan_fun(state, vals, first=False):
        _t1, _t0, _y0, _grad_y0 = vals
        (y_back, furthest, steps, a_y0, a_args0, a_terms0), solver_state, controller_state = state
        if distance is not None and not first:
            furthest = jnp.maximum(furthest, distance(y_back, _y0) / _allowed(steps))
        with jax.numpy_dtype_promotion("standard"):
            a_y0 = jtu.tree_map(jnp.add, a_y0, _grad_y0)
        sol = diffrax.diffeqsolve(
            t0=-_t0,
            t1=-_t1,
            y0=(_y0, a_y0, a_args0, a_terms0),
            solver_state=solver_state,
            controller_state=controller_state,
            made_jump=not first,  # adding _grad_y0, above, is a jump
            saveat=diffrax.SaveAt(t1=True, solver_state=True, controller_state=True),
            throw=False,
            **solve_kwargs,
        )
        if throw:
            sol = _check_backward(sol)
        y1, a_y1, a_args1, a_terms1 = jtu.tree_map(lambda x: x[0], sol.ys)
        steps = sol.stats["num_accepted_steps"].astype(furthest.dtype)
        adjoint_state = (y1, furthest, steps, a_y1, a_args1, a_terms1)
        return (adjoint_state, sol.solver_state, sol.controller_state), None

    furthest = jnp.zeros((), jnp.result_type(*jtu.tree_leaves(y)))
    zeros = jtu.tree_map(jnp.zeros_like, (y, furthest, furthest, y, diff_args, diff_terms))
    state = (zeros, None, None)
    last = lambda tree, i: jtu.tree_map(lambda x: x[i], tree)
    segment = lambda tree, lo, hi: jtu.tree_map(lambda x: x[lo:hi], tree)

    # Backpropagate from ts[-1] to t0, one diffeqsolve between adjacent save times; the
    # first segment runs outside the scan to give the solver state its structure.
    if saveat_t0:
        if len(ts) > 2:
            val0 = (ts[-2], ts[-1], last(ys, -1), last(grad_ys, -1))
            state, _ = scan_fun(state, val0, first=True)
            vals = (ts[:-2], ts[1:-1], segment(ys, 1, -1), segment(grad_ys, 1, -1))
            state, _ = lax.scan(scan_fun, state, vals, reverse=True)
        elif len(ts) == 2:
            state, _ = scan_fun(state, (ts[0], ts[1], last(ys, 1), last(grad_ys, 1)), True)
        (y_back, furthest, steps, a_y1, a_args1, a_terms1), _, _ = state
        with jax.numpy_dtype_promotion("standard"):
            a_y1 = jtu.tree_map(jnp.add, a_y1, last(grad_ys, 0))
    else:
        if len(ts) > 1:
            val0 = (ts[-2], ts[-1], last(ys, -1), last(grad_ys, -1))
            state, _ = scan_fun(state, val0, first=True)
            vals = (
                jnp.concatenate([jnp.asarray(t0, ts.dtype)[None], ts[:-2]]),
                ts[:-1],
                segment(ys, None, -1),
                segment(grad_ys, None, -1),
            )
            state, _ = lax.scan(scan_fun, state, vals, reverse=True)
        else:
            state, _ = scan_fun(state, (t0, ts[0], last(ys, 0), last(grad_ys, 0)), True)
        (y_back, furthest, steps, a_y1, a_args1, a_terms1), _, _ = state
    if distance is not None and (len(ts) > 1 or not saveat_t0):
        furthest = jnp.maximum(furthest, distance(y_back, y) / _allowed(steps))
        # On all the cotangents: a gradient with respect to `args` alone reads no other.
        too_far = ~(furthest <= 1)
        return eqx.error_if((a_y1, a_args1, a_terms1), too_far, _NOT_RECOMPUTED)
    return a_y1, a_args1, a_terms1


# --- the public adjoint


# The types of `BacksolveAdjoint`'s keyword arguments, with an example of each.
_KWARG_TYPES = {
    "solver": (diffrax.AbstractSolver, "diffrax.Heun()"),
    "stepsize_controller": (
        diffrax.AbstractStepSizeController,
        "diffrax.PIDController(rtol=1e-3, atol=1e-6)",
    ),
    "adjoint": (diffrax.AbstractAdjoint, "diffrax.RecursiveCheckpointAdjoint()"),
}


def _check_kwarg(name: str, value) -> None:
    got = f"got {value!r} ({type(value).__name__})"
    if name in _KWARG_TYPES:
        cls, example = _KWARG_TYPES[name]
        if isinstance(value, cls):
            return
        if isinstance(value, type) and issubclass(value, cls):
            raise TypeError(
                f"`{_API}({name}=...)` takes an instance, got the class "
                f"`{value.__name__}`: pass `{name}={value.__module__.split('.')[0]}."
                f"{value.__name__}(...)`."
            )
        raise TypeError(
            f"`{_API}({name}=...)` must be a `diffrax.{cls.__name__}`, such as "
            f"`{name}={example}`; {got}."
        )
    is_bool = isinstance(value, bool)
    if name == "throw" and not is_bool:
        raise TypeError(f"`{_API}(throw=...)` must be `True` or `False`; {got}.")
    if name == "max_steps" and value is not None and (is_bool or not isinstance(value, int)):
        raise TypeError(f"`{_API}(max_steps=...)` must be an int or `None`; {got}.")
    if name == "dt0" and value is not None:
        real = eqx.is_array_like(value) and jnp.isrealobj(value) and jnp.ndim(value) == 0
        if is_bool or not real:
            raise TypeError(
                f"`{_API}(dt0=...)` must be a real scalar (the initial step of the backward "
                f"solve, negative as it runs from `t1` to `t0`) or `None`; {got}."
            )


class BacksolveAdjoint(diffrax.AbstractAdjoint):
    r"""Backpropagate through `diffrax.diffeqsolve` by solving the continuous adjoint
    equations backwards in time: a drop-in replacement for `diffrax.BacksolveAdjoint`
    (same arguments, same `SaveAt` support, same Brownian-path requirements), with O(1)
    memory in the number of steps.

    Differences from Diffrax's:

    - **The adjoint vector field** (what `diffrax.ReversibleHeun` and FSAL Runge-Kutta
      solvers evaluate) is the matrix of the linear map
      $c \mapsto \mathrm{vf\_prod}(t, (y, a), c)$, read off its jaxpr by
      [`diffrax_linearize.materialise`][] rather than by one `jacfwd`/`jacrev` pass per
      noise channel. `diffrax.ReversibleHeun` goes further: it is run backwards in an
      algebraically identical form that stores the point where it evaluated the vector
      field instead of the vector field, and needs `vf_prod` (one VJP) only, never the
      $(2d + p) \times m$ matrix.
    - **`diffrax.ReversibleHeun` with save times before `t1` gives different gradients**
      from Diffrax's, closer to the exact ones. At each save time of `SaveAt(ts=...)` the
      backward pass jumps (the saved output's cotangent is added to the adjoint state).
      Diffrax's Reversible Heun then moves its state $y$ but not its second state
      $\hat y$, so the next step's $2 y - \hat y$ counts the jump twice, an error that
      never decays; here $\hat y$ moves with $y$. On the generator of Diffrax's neural SDE
      GAN example (float64, step 0.1, a save time every unit of time) the parameter
      gradients of the two backsolves differ by 4.2%, 30% and 104% at horizons 3, 15 and
      63, and ours are 0.49%, 0.92% and 56% from `diffrax.RecursiveCheckpointAdjoint`'s
      against Diffrax's 4.1%, 32% and 117% (`python -m benchmarks.reversible_heun_gradients`
      in a clone; see [the neural SDE guide](../neural_sde.md)). With only
      `SaveAt(t1=True)` the two agree to rounding.
    - **Solvers whose terms are a `diffrax.MultiTerm`** (`diffrax.EulerHeun`,
      `diffrax.StratonovichMilstein`, [`diffrax_linearize.StratonovichMilstein`][],
      `diffrax.SPaRK`, ...) work: the adjoint of `MultiTerm(f, g)` is
      `MultiTerm(adjoint(f), adjoint(g))` on the shared augmented state.
    - **The backward pass is solved forwards in reversed time** $s = -t$, with the
      Brownian increments of the reversed path (increment $-\Delta W$, space-time Lévy
      area $+H$, space-time-time area $-K$, Lévy area $-A$, step $+h$). Diffrax instead
      runs the solver with decreasing times and negates every control, which is wrong
      for the stochastic Runge-Kutta solvers (`diffrax.SPaRK`, `diffrax.GeneralShARK`,
      `diffrax.SlowRK`): they take the drift's control to be $t_1 - t_0$ and would run
      the drift forwards, and they read the sign of $H$. With them the backward pass is
      right here, tested against `diffrax.RecursiveCheckpointAdjoint`; for every other
      solver the numbers are those of the decreasing-time solve.
    - **Itô SDEs** work. An Itô SDE $dy = f\,dt + g\,dW$ is the Stratonovich SDE with drift
      $f - \tfrac12 \sum_j (\partial g_{:,j}/\partial y) g_{:,j}$ (the sum from
      [`diffrax_linearize.milstein_trace_term`][]); the backward pass solves the adjoint of
      that Stratonovich SDE, with [`diffrax_linearize.StratonovichMilstein`][] when the
      forward solver is an Itô Milstein method,
      [`diffrax_linearize.ImplicitStratonovichMilstein`][] (same `theta` and root finder)
      when it is [`diffrax_linearize.ImplicitItoMilstein`][] or
      [`diffrax_linearize.ImplicitEulerMaruyama`][], and `diffrax.EulerHeun` otherwise (or
      with `solver=` if given, which must be a Stratonovich solver). The terms must be
      `MultiTerm(drift, diffusion)` with one Brownian diffusion and a drift controlled by
      `dt`. For diagonal noise the correction assumes, as
      [`diffrax_linearize.milstein_trace_term`][] does, that $g_{ii}$ depends on $y_i$ only.

    As for any backsolve adjoint, the gradients are those of the continuous solution,
    accurate to the discretisation error of the forward and backward solves (not the exact
    gradients of the discrete forward pass, as `diffrax.RecursiveCheckpointAdjoint`
    gives), and the Brownian motion must be re-evaluable backwards in time: use
    `diffrax.VirtualBrownianTree`, not `diffrax.UnsafeBrownianPath`.

    **Adaptive steps.** With an adaptive controller (the Milstein solvers here have
    their own error estimates, so `diffrax.PIDController` takes them unwrapped) the
    backward solve adapts on its own: it is a `diffrax.diffeqsolve` of the adjoint SDE
    with the same step-size controller (or `stepsize_controller=` if given), between
    each pair of save times, and its steps need not be the forward ones. Its error
    estimate covers the whole augmented state (the state, its adjoint and the
    accumulated parameter gradients). Tested against `diffrax.RecursiveCheckpointAdjoint`
    through the same adaptive forward solve.

    **Stiff ODEs** cannot be differentiated by a backsolve adjoint, with any solver: the
    backward solve recomputes the state backwards in time, where the modes that decay
    fast forwards grow, so it runs out of steps, or (an L-stable solver damping those
    modes) ends far from the forward solution with wrong gradients and no error, as
    `diffrax.BacksolveAdjoint` does. The same holds for chaotic or strongly dissipative
    ODEs (the Lorenz system) over all but short intervals. Here both raise an error (with
    `throw=True`, the default) that says to use `diffrax.RecursiveCheckpointAdjoint`:
    running out of steps, and, for ODEs with an adaptive step-size controller, a
    recomputed state further from the forward solve's at `t0` or at a save time than
    100 of the controller's tolerances per step of the backward solve (at least $10^3$):
    a long solve of a non-stiff ODE accumulates about one per step.

    Gradients are with respect to `y0`, `args` and `terms`; anything else (`t0`, values
    closed over) raises JAX's `CustomVJPException`, as for Diffrax's.
    """

    kwargs: dict[str, Any]

    def __init__(self, **kwargs):
        """**Arguments:**

        - `**kwargs`: the arguments of the `diffrax.diffeqsolve` calls of the backward
            pass: `solver`, `dt0`, `stepsize_controller`, `adjoint`, `max_steps`, `throw`.
            For example `BacksolveAdjoint(solver=diffrax.EulerHeun())`. By default the
            backward pass uses the forward solver (for Itô SDEs, see above).
        """
        valid = {"dt0", "solver", "stepsize_controller", "adjoint", "max_steps", "throw"}
        invalid = set(kwargs) - valid
        if invalid:
            raise ValueError(
                f"`{_API}` got unexpected keyword arguments {sorted(invalid)}; the valid "
                f"ones are the backward solve's {sorted(valid)}."
            )
        for name, value in kwargs.items():
            _check_kwarg(name, value)
        self.kwargs = kwargs

    def loop(
        self,
        *,
        args,
        terms,
        solver,
        saveat,
        init_state,
        passed_solver_state,
        passed_controller_state,
        event,
        **kwargs,
    ):
        use_instead = "Use `diffrax.RecursiveCheckpointAdjoint` (the default) instead."
        save_at_ts = (
            "Save at `diffrax.SaveAt(ts=...)` with this adjoint, or use "
            "`diffrax.RecursiveCheckpointAdjoint` (the default)."
        )
        if saveat.dense:
            raise NotImplementedError(
                f"`{_API}` does not support `diffrax.SaveAt(dense=True)`. {save_at_ts}"
            )
        if jtu.tree_structure(saveat.subs, is_leaf=_is_subsaveat) != jtu.tree_structure(0):
            raise NotImplementedError(
                f"`{_API}` does not support `diffrax.SaveAt(subs=...)`. {use_instead}"
            )
        if saveat.subs.steps:
            raise NotImplementedError(
                f"`{_API}` does not support `diffrax.SaveAt(steps=True)`. {save_at_ts}"
            )
        if saveat.subs.fn is not save_y:
            raise NotImplementedError(
                f"`{_API}` does not support `diffrax.SaveAt(fn=...)`. {use_instead}"
            )
        if is_unsafe_sde(terms):
            raise ValueError(
                f"`{_API}` re-evaluates the Brownian motion backwards in time, which "
                "`diffrax.UnsafeBrownianPath` cannot do: use `diffrax.VirtualBrownianTree`, "
                "or `adjoint=diffrax.DirectAdjoint()`."
            )
        if event is not None:
            raise NotImplementedError(f"`{_API}` does not support events. {use_instead}")
        backward, convert = _backward_plan(terms, solver, self.kwargs.get("solver"))

        y = init_state.y
        init_state = eqx.tree_at(lambda s: s.y, init_state, object())
        init_state = _nondiff_solver_controller_state(
            self, init_state, passed_solver_state, passed_controller_state
        )
        final_state, aux_stats = _loop_backsolve(
            (y, args, terms),
            self=self,
            saveat=saveat,
            init_state=init_state,
            solver=solver,
            event=event,
            backward=backward,
            convert=convert,
            **kwargs,
        )
        return _only_transpose_ys(final_state), aux_stats
