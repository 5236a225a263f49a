"""The explicit strong order 1.5 Itô-Taylor scheme for commutative noise, with the space-time
Lévy area of Diffrax's Brownian paths and an embedded error estimate (the scheme's order-1.5
terms: its difference from the Milstein step)."""

from typing import ClassVar

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from diffrax import (
    AbstractAdaptiveSolver,
    AbstractItoSolver,
    AbstractSpaceTimeLevyArea,
    RESULTS,
)

from .._brownian_carry import carried_terms
from .._term import milstein_trace_term, real_noise_on_complex_state
from .milstein import (
    _BoolScalarLike,
    _RealScalarLike,
    _SolverState,
    _Terms,
    _Y,
    SDESolverCommon,
)


def _add(*trees):
    with jax.numpy_dtype_promotion("standard"):
        return jtu.tree_map(lambda *xs: sum(xs[1:], xs[0]), *trees)


def _scale(c, tree):
    with jax.numpy_dtype_promotion("standard"):
        return jtu.tree_map(lambda x: c * x, tree)


def _levy_message(inc) -> str:
    return (
        "`diffrax_linearize.ItoTaylor15` needs the space-time Lévy area of every step (the "
        "integrals of the Brownian motion in time), but the diffusion's control returned "
        f"`{type(inc).__name__}`. Use a Brownian motion that samples it: "
        "`diffrax.VirtualBrownianTree(t0, t1, tol, shape, key, "
        "levy_area=diffrax.SpaceTimeLevyArea)` (or `diffrax.UnsafeBrownianPath(shape, key, "
        "levy_area=diffrax.SpaceTimeLevyArea)` for fixed steps only). Without it, use "
        "`diffrax_linearize.ItoMilstein` (strong order 1)."
    )


class ItoTaylor15(SDESolverCommon, AbstractAdaptiveSolver, AbstractItoSolver):
    r"""The explicit strong order 1.5 Itô-Taylor scheme (Kloeden & Platen, *Numerical
    Solution of Stochastic Differential Equations*, section 10.4, schemes (10.4.1) and
    (10.4.6)) for **commutative noise**, with an embedded error estimate for adaptive steps.
    Converges to the Itô solution with strong order 1.5. Uses local linear interpolation for
    dense/ts output.

    For $\mathrm{d}y = f(t, y)\,\mathrm{d}t + g(t, y)\,\mathrm{d}W$ with $m$ noise channels
    (columns $g_j$), $L^0 = \partial_t + \sum_k f_k \partial_k + \tfrac12 \sum_{j,k,l}
    g_{kj} g_{lj} \partial_k \partial_l$ and $L^j = \sum_k g_{kj} \partial_k$, one step of
    size $h$ is the Milstein step plus the terms of order $3/2$ and $2$:

    $$y_1 = y_0 + f h + g \Delta W + \sum_{j_1, j_2} L^{j_1} g_{j_2} I_{(j_1, j_2)}
    + \sum_j L^j f\, I_{(j, 0)} + \sum_j L^0 g_j\, I_{(0, j)} + \tfrac12 L^0 f\, h^2
    + \sum_{j_1, j_2, j_3} L^{j_1} L^{j_2} g_{j_3} I_{(j_1, j_2, j_3)},$$

    everything at $(t_0, y_0)$. The time integrals come from the space-time Lévy area $H$
    of the step (Diffrax's convention, $h H = \int_{t_0}^{t_1} (W_s - W_{t_0}) \mathrm{d}s -
    h \Delta W / 2$): $I_{(j, 0)} = h (\Delta W_j / 2 + H_j)$, $I_{(0, j)} = h (\Delta W_j /
    2 - H_j)$. On commutative noise the double and triple sums need no Lévy areas between
    channels: with the Itô trace $\tau = \sum_j L^j g_j$ (as in
    [`diffrax_linearize.ItoMilstein`][]), the double sum is $\tfrac12 (L^{\Delta W} g
    \Delta W - h \tau)$ and the triple sum $\tfrac16 \big(L^{\Delta W} L^{\Delta W} g
    \Delta W - 3 h\, L^{\Delta W} \tau\big)$ (for diagonal noise, the familiar
    $\tfrac16 L^j L^j g_j (\Delta W_j^3 - 3 h \Delta W_j)$), where $L^{\Delta W} = \sum_j
    \Delta W_j L^j$ is one JVP in the direction $g \Delta W$. All derivatives are JVPs
    (second derivatives nested JVPs); $\tau$ is
    [`diffrax_linearize.milstein_trace_term`][], from the structure the engine detects.
    For diagonal or scalar noise a structured derivative saves nothing over a JVP, which
    is why the other terms are plain JVPs.

    One change from the textbook scheme, for the cost: the drift's second-order Itô term
    $\tfrac14 h^2 \sum_j \partial^2 f[g_j, g_j]$ inside $\tfrac12 L^0 f h^2$ would take
    one second-order JVP per noise channel; it is replaced by its one-sample estimate
    $\tfrac14 h\, \partial^2 f[g \Delta W, g \Delta W]$. The difference has mean zero and
    root-mean-square $O(h^2)$ per step, which keeps the strong order 1.5 (Milstein's
    fundamental theorem on mean and mean-square local errors). Exact for drifts linear in
    $y$. One addition beyond order 1.5: the time-only part of $\sum_j L^0 L^0 g_j
    I_{(0,0,j)}$, $\partial_t^2 g\, \mathbb{E}[I_{(0,0,\cdot)} \mid \Delta W, H] =
    \partial_t^2 g\, h^2 (\Delta W / 6 - H / 2)$, which dominates the rest for a diffusion
    that changes fast in time (a burst of width $\varepsilon$ has $\partial_t^2 g \sim
    g / \varepsilon^2$) and costs one second derivative in the scalar $t$.

    **Cost per step:** the drift, one JVP and one second-order JVP of it; the diffusion,
    two JVPs of $y \mapsto g \Delta W$ (one nested, for the triple sum), one JVP in
    $(t, y)$ of $y \mapsto g\, I_{(0, \cdot)}$, one second derivative in $t$, the trace
    $\tau$ and one JVP of it. No evaluation at $t_1$.

    **Adaptive steps.** The error estimate returned is the sum of the terms above beyond
    Milstein's (the mixed terms in $L^j f$ and $L^0 g$, the drift's $\tfrac12 L^0 f h^2$,
    the triple sum and the $\partial_t^2 g$ term): the difference between this step and the
    Milstein step, that is the leading local error of the Milstein step, $O(h^{3/2})$. The
    step propagates the order 1.5 solution (local extrapolation, as the Runge-Kutta pairs
    of ODE solvers do), and the error order the controller uses is $1.5$. So
    `diffrax.diffeqsolve(terms, diffrax_linearize.ItoTaylor15(), t0, t1, None, y0,
    stepsize_controller=diffrax.PIDController(rtol=..., atol=...))` works with a
    `diffrax.VirtualBrownianTree(..., levy_area=diffrax.SpaceTimeLevyArea)`. Over a sweep
    of tolerances the error falls only about like the mean step to the power one, not 1.5
    (tested on geometric Brownian motion). The cause is that the estimate is made of the
    increments of the step it accepts or rejects: the accepted steps are then not a
    non-anticipating partition of the path, and the local errors of order $h^2$, whose
    mean-zero sum is what makes the strong order 1.5, no longer cancel. The same step
    times on independent paths give order 1.5 (tested), and so does an estimate taken on
    an independent path (measured); the error order 1.5 itself is right (the accepted
    steps grow like $\mathrm{rtol}^{-1/1.5}$).

    !!! warning

        Requires **commutative noise** in both of Kloeden and Platen's senses:
        $L^{j_1} g_{j_2} = L^{j_2} g_{j_1}$ and $L^{j_1} L^{j_2} g_{j_3} = L^{j_2} L^{j_1}
        g_{j_3}$ for all channels. This holds for scalar and additive noise, diagonal noise
        $g = \mathrm{diag}(\sigma(t, y))$ with each $\sigma_i$ depending on $y_i$ only, and
        $g(y) = [A_1 y, \ldots, A_m y]$ with commuting $A_j$. It is not checked: on other
        noise the step is wrong at order one (use
        [`diffrax_linearize.GeneralItoMilstein`][] there).

    This should be called with `terms=MultiTerm(drift_term, diffusion_term)`, the drift a
    `diffrax.ODETerm` and the diffusion a term whose control is a Brownian motion with
    space-time Lévy area (the error otherwise says how to get one).
    """

    term_structure: ClassVar = _Terms
    # The diffusion's control is asked for its space-time Lévy area, as `diffrax.SPaRK`'s,
    # and the Lévy area it needs is declared as Diffrax's stochastic Runge-Kutta solvers
    # declare theirs (read by tools that build a Brownian motion for a solver, as Diffrax's
    # test helpers do).
    term_compatible_contr_kwargs: ClassVar = (dict(), dict(use_levy=True))
    minimal_levy_area: ClassVar = AbstractSpaceTimeLevyArea

    def strong_order(self, terms):
        return 1.5

    def error_order(self, terms):
        # The estimate is the Milstein step's local error, O(h^{3/2}): strong order 1 plus
        # one half, Diffrax's rule for an SDE pair of the lower order; not 1.5 + 0.5.
        return 1.5

    def step(
        self,
        terms: _Terms,
        t0: _RealScalarLike,
        t1: _RealScalarLike,
        y0: _Y,
        args,
        solver_state: _SolverState,
        made_jump: _BoolScalarLike,
    ):
        del made_jump
        terms, solver_state = carried_terms(terms, t0, t1, solver_state)
        terms = real_noise_on_complex_state(terms, t0, y0)
        drift, diffusion = terms.terms
        h = drift.contr(t0, t1)
        inc = diffusion.contr(t0, t1, use_levy=True)
        if not isinstance(inc, AbstractSpaceTimeLevyArea):
            raise ValueError(_levy_message(inc))
        w = inc.W
        with jax.numpy_dtype_promotion("standard"):
            i10 = jtu.tree_map(lambda w, H: h * (0.5 * w + H), w, inc.H)
            i01 = jtu.tree_map(lambda w, H: h * (0.5 * w - H), w, inc.H)
            # E[I_(0,0,j) | dW, H] = h^2 (dW / 6 - H / 2): the space-time-time area that
            # would make it exact is not sampled.
            i001 = jtu.tree_map(lambda w, H: h**2 * (w / 6 - 0.5 * H), w, inc.H)
        t0 = jnp.asarray(t0, dtype=jnp.result_type(h))
        one = jnp.ones_like(t0)

        def f(t, y):
            return drift.vf_prod(t, y, args, one)

        def g(t, y, control):
            return diffusion.vf_prod(t, y, args, control)

        vf = diffusion.vf(t0, y0, args)
        g_w, g_10, g_01 = (diffusion.prod(vf, c) for c in (w, i10, i01))
        f0 = f(t0, y0)
        trace = lambda y: milstein_trace_term(diffusion, t0, y, args)  # noqa: E731
        tau = trace(y0)

        # sum_{j1 j2} L^{j1} g_{j2} dW_{j1} dW_{j2} (`lw_gw`), and the triple sum's
        # L^{dW} L^{dW} g dW (`lww_gw`): one nested JVP of y -> D(g dW)(y)[g(y) dW].
        def l_w(y):
            return jax.jvp(lambda z: g(t0, z, w), (y,), (g(t0, y, w),))[1]

        lw_gw, lww_gw = jax.jvp(l_w, (y0,), (g_w,))
        # Dtau[g I_0 / 2 - h g dW / 2]: the second-order Itô part of L^0 g I_0
        # (sum_r D^2 g[g_r, g_r] = L^{.} tau - Dg[tau] on commutative noise), and the
        # triple sum's -3 h L^{dW} tau / 6.
        with jax.numpy_dtype_promotion("standard"):
            dir_tau = jtu.tree_map(lambda a, b: 0.5 * (a - h * b), g_01, g_w)
        _, dtau = jax.jvp(trace, (y0,), (dir_tau,))
        # L^0 g I_0 up to the part above: the time derivative and the derivative along the
        # Stratonovich drift f - tau / 2 (the -Dg[tau] / 2 of the Itô part).
        with jax.numpy_dtype_promotion("standard"):
            strat = jtu.tree_map(lambda a, b: a - 0.5 * b, f0, tau)
        _, l0_g = jax.jvp(lambda t, y: g(t, y, i01), (t0, y0), (one, strat))
        # Beyond order 1.5, the time-only part of L^0 L^0 g I_(0,0,j): for a diffusion that
        # changes fast in time (a burst of width eps has g_tt ~ g / eps^2) it dominates the
        # rest, and it is one second derivative in the scalar t.
        g_t = lambda t: jax.jvp(lambda s: g(s, y0, i001), (t,), (one,))[1]  # noqa: E731
        _, g_tt = jax.jvp(g_t, (t0,), (one,))
        # L^j f I_(j,0) + (f_t + f' f) h^2 / 2: one JVP in (t, y).
        half_h2 = 0.5 * h**2
        with jax.numpy_dtype_promotion("standard"):
            dir_f = jtu.tree_map(lambda a, b: a + half_h2 * b, g_10, f0)
        _, lf = jax.jvp(f, (t0, y0), (half_h2 * one, dir_f))
        # The drift's Itô term h^2/4 sum_j D^2 f[g_j, g_j], by its one-sample estimate.
        _, d2f = jax.jvp(lambda y: jax.jvp(lambda z: f(t0, z), (y,), (g_w,))[1], (y0,), (g_w,))

        with jax.numpy_dtype_promotion("standard"):

            def leaf(y, f0, gw, lwgw, tau, lww, dtau, l0g, lf, d2f, gtt):
                milstein = y + f0 * h + gw + 0.5 * (lwgw - h * tau)
                extra = lf + 0.25 * h * d2f + l0g + dtau + lww / 6 + gtt
                return (milstein + extra).astype(y.dtype), extra.astype(y.dtype)

            trees = (y0, f0, g_w, lw_gw, tau, lww_gw, dtau, l0_g, lf, d2f, g_tt)
            out = jtu.tree_map(leaf, *trees)
        y_struct = jtu.tree_structure(y0)
        y1, y_error = jtu.tree_transpose(y_struct, jtu.tree_structure((0, 0)), out)
        return y1, y_error, dict(y0=y0, y1=y1), solver_state, RESULTS.successful
