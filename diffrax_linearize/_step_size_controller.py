r"""A step-size controller for stiff solvers: Gustafsson's predictive controller, as
Hairer and Wanner's RODAS and RADAU5 and OrdinaryDiffEq.jl's `PredictiveController` use.
"""

from collections.abc import Callable

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optimistix as optx
from diffrax import RESULTS
from jaxtyping import Array, Bool, PyTree, Real

from ._compat import select_initial_step
from ._custom_types import RealScalarLike


class PredictiveState(eqx.Module):
    """The state a [`diffrax_linearize.PredictiveController`][] carries between steps:
    the last accepted step's size and error.

    **Arguments:**

    - `h_accepted`: the size of the last accepted step (the first step's size before
        any is accepted).
    - `error_accepted`: its scaled error, at least `1e-2` (as Hairer's codes bound it).
    - `any_accepted`: whether a step has been accepted yet; the prediction needs one.
    - `at_dtmin`: whether the step now proposed was raised to `dtmin`; with
        `force_dtmin=True` it is accepted whatever its error.
    """

    h_accepted: Real[Array, ""]
    error_accepted: Real[Array, ""]
    any_accepted: Bool[Array, ""]
    at_dtmin: Bool[Array, ""]


class PredictiveController(diffrax.AbstractAdaptiveStepSizeController):
    r"""Gustafsson's predictive step-size controller (K. Gustafsson, *Control-theoretic
    techniques for stepsize selection in implicit Runge-Kutta methods*, ACM TOMS 20,
    1994; Hairer & Wanner, *Solving ODEs II*, section IV.8), for stiff solvers such as
    [`diffrax_linearize.Rodas5P`][], [`diffrax_linearize.Rodas4P`][] and
    `diffrax.Kvaerno5` with [`diffrax_linearize.VeryChord`][] or
    [`diffrax_linearize.Newton`][], and the fixed-order [`diffrax_linearize.BDF`][]. Not
    the variable-order BDF, which chooses its own step sizes (a `ValueError` says so).

    With the scaled error $e_n$ of step $n$ (the `norm` of the error over
    $\mathrm{atol} + \mathrm{rtol} \max(|y_0|, |y_1|)$, as `diffrax.PIDController`
    computes it), step size $h_n$ and error order $k$, a step is accepted when $e_n < 1$
    and the next step size is $h_{n+1} = f h_n$ with

    $$f = \min\Bigl(s\, e_n^{-1/k},\ s\, \frac{h_n}{h_{\mathrm{acc}}}
    \Bigl(\frac{e_{\mathrm{acc}}}{e_n^2}\Bigr)^{1/k}\Bigr)$$

    after an accepted step ($h_{\mathrm{acc}}$ and $e_{\mathrm{acc}}$ are those of the
    accepted step before it; the second term is omitted on the first accepted step), and
    $f = s\, e_n^{-1/k}$ after a rejected one, each clipped to
    $[\mathrm{factormin}, \mathrm{factormax}]$ (below `safety` after a rejection). The
    second term predicts the error's trend from the last two accepted steps, and shrinks
    the step before a rise in the error rejects it. This is the step control of Hairer's
    RODAS and RADAU5 codes and of OrdinaryDiffEq.jl's `PredictiveController`.

    Unlike `diffrax.PIDController`, an accepted step may be followed by a smaller one.
    Diffrax's controller never shrinks the step after an accepted one, so a step accepted
    with an error just below one is repeated at the same size even when the error is
    growing, and the next is rejected: the cause of most rejected steps of
    [`diffrax_linearize.Rodas5P`][] and [`diffrax_linearize.Rodas4P`][] on the
    oscillating OREGO problem of the stiff test set: at `rtol=1e-6` more than one step in
    five is rejected with Diffrax's controller, fewer than one in five with this one, at
    the same accuracy (both checked by the test suite).

    Use it as any adaptive controller: `diffrax.diffeqsolve(...,
    stepsize_controller=dl.PredictiveController(rtol=1e-6, atol=1e-8))`. It works under
    `jax.jit`, `jax.vmap` and `jax.grad` (the step sizes are not differentiated, as
    Diffrax's controllers do), in float32 and float64 and for any pytree state. As the
    error norm, the tolerances `rtol` and `atol` are those of `diffrax.PIDController`, and
    an implicit solver's root finder takes them from this controller in the same way.

    **Arguments:**

    - `rtol`: relative tolerance.
    - `atol`: absolute tolerance.
    - `norm`: the norm of the scaled error; `optimistix.rms_norm` by default (Hairer's
        and Diffrax's).
    - `safety`: the safety factor $s$; 0.9 by default.
    - `factormin`: the smallest ratio of a step to the one before; 0.2 by default.
    - `factormax`: the largest ratio of a step to the one before; 10 by default.
    - `steady`: optional, a pair `(lo, hi)`: after an accepted step, a factor $f$ with
        $\mathrm{lo} \le f \le \mathrm{hi}$ is replaced by 1, the step size kept (Hairer's
        RADAU5 keeps it for $1 \le f \le 1.2$). A Rosenbrock-W method such as
        [`diffrax_linearize.ROS34PW2`][] then reuses its factorisation: pass
        `steady=(0.9, 1.2)` with it (on the stiff test set at `rtol=1e-6`, a third to
        half of the factorisations without it, and fewer than with
        `diffrax.PIDController`). Of no use to [`diffrax_linearize.Rodas5P`][] and
        [`diffrax_linearize.Rodas4P`][], which factor at every step.
    - `dtmax`: optional, the largest step size.
    - `dtmin`: optional, the smallest step size: a solve that would need a smaller step
        stops with `diffrax.RESULTS.dt_min_reached` (and raises with `throw=True`), unless
        `force_dtmin=True`.
    - `force_dtmin`: with `dtmin`, take a step of `dtmin` where a smaller one is asked
        for, and accept it whatever its error, as `diffrax.PIDController` does by
        default (a step of `dtmin` that fails, with a non-finite error, stops the solve
        with `diffrax.RESULTS.dt_min_reached`). `False` by default here: the solve stops
        rather than accept a step beyond its tolerance unannounced.
    - `error_order`: optional, the order $k$ of the solver's error estimate; the solver's
        `error_order` (its order, for an ODE) by default.

    ```python
    import diffrax
    import jax.numpy as jnp
    import diffrax_linearize as dl

    def van_der_pol(t, y, args):  # stiff for a large mu
        x, v = y
        return jnp.stack([v, 1000.0 * ((1 - x**2) * v - x)])

    # A W-method reuses its factorisation while the step size stays in `steady`.
    controller = dl.PredictiveController(rtol=1e-5, atol=1e-7, steady=(0.9, 1.2))
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(van_der_pol), dl.ROS34PW2(), t0=0.0, t1=1.0, dt0=None,
        y0=jnp.array([2.0, 0.0]), stepsize_controller=controller,
    )
    ```
    """

    rtol: RealScalarLike
    atol: RealScalarLike
    norm: Callable[[PyTree], RealScalarLike] = optx.rms_norm
    safety: RealScalarLike = 0.9
    factormin: RealScalarLike = 0.2
    factormax: RealScalarLike = 10.0
    steady: tuple[RealScalarLike, RealScalarLike] | None = None
    dtmax: RealScalarLike | None = None
    dtmin: RealScalarLike | None = None
    force_dtmin: bool = False
    error_order: RealScalarLike | None = None

    def __check_init__(self):
        if self.rtol is None or self.atol is None:
            raise ValueError(
                "`diffrax_linearize.PredictiveController` needs tolerances: pass `rtol` "
                "and `atol`, e.g. `PredictiveController(rtol=1e-6, atol=1e-8)`."
            )
        for name in ("safety", "factormin", "factormax"):
            value = getattr(self, name)
            if isinstance(value, (int, float)) and not value > 0:
                raise ValueError(
                    f"`diffrax_linearize.PredictiveController` needs `{name} > 0`, got {value}."
                )
        if self.steady is not None and not (
            isinstance(self.steady, tuple) and len(self.steady) == 2
        ):
            raise ValueError(
                "`diffrax_linearize.PredictiveController(steady=...)` must be a pair "
                f"`(lo, hi)` of step-size ratios, not {self.steady!r}."
            )
        if isinstance(self.factormin, (int, float)) and self.factormin >= 1:
            raise ValueError(
                "`diffrax_linearize.PredictiveController` needs `factormin < 1` (a rejected "
                f"step must be followed by a smaller one), got {self.factormin}."
            )

    def _error_order(self, error_order):
        order = error_order if self.error_order is None else self.error_order
        if order is None:
            raise ValueError(
                "The solver has no error order: pass "
                "`diffrax_linearize.PredictiveController(..., error_order=...)`."
            )
        return order

    def wrap(self, direction):
        return self

    def init(self, terms, t0, t1, y0, dt0, args, func, error_order):
        del t1
        # `func` is the solver's bound `func`. The variable-order BDF proposes its own step
        # sizes through the error it returns, and holds a step with a constant error: a
        # trend of none, which this controller's prediction reads as a shrinking step's
        # and so shrinks the step at every step until it stalls (measured on HIRES: h
        # halving from step to step down to zero).
        if getattr(getattr(func, "__self__", None), "variable_order", False) is True:
            raise ValueError(
                "`diffrax_linearize.PredictiveController` cannot drive "
                "`diffrax_linearize.BDF(variable_order=True)`, which chooses its own step "
                "sizes and reports them through its error: use "
                "`diffrax.PIDController(rtol=..., atol=...)` with it (with `pcoeff=0.3, "
                "icoeff=0.4` for stiff problems), or this controller with the fixed-order "
                "`BDF(variable_order=False)`."
            )
        if dt0 is None:
            dt0 = select_initial_step(
                terms, t0, y0, args, func, self._error_order(error_order), self.rtol,
                self.atol, self.norm,
            )  # fmt: skip
            # As `diffrax.PIDController`: step sizes are not differentiated.
            dt0 = jax.lax.stop_gradient(dt0)
        if self.dtmax is not None:
            dt0 = jnp.minimum(dt0, self.dtmax)
        at_dtmin = jnp.asarray(False)
        if self.dtmin is not None:
            if self.force_dtmin:
                # A first step raised to `dtmin` cannot shrink either.
                at_dtmin = jnp.asarray(dt0 <= self.dtmin)
            dt0 = jnp.maximum(dt0, self.dtmin)
        tnext = t0 + dt0
        leaves = jtu.tree_leaves(y0)
        dtype = jnp.result_type(*leaves) if leaves else jnp.result_type(float)
        real = jnp.finfo(dtype).dtype
        state = PredictiveState(
            h_accepted=jnp.asarray(dt0, dtype=jnp.result_type(tnext)),
            error_accepted=jnp.asarray(1.0, dtype=real),
            any_accepted=jnp.asarray(False),
            at_dtmin=at_dtmin,
        )
        return tnext, state

    def adapt_step_size(self, t0, t1, y0, y1_candidate, args, y_error, error_order, state):
        del args
        if y_error is None and y0 is not None:
            raise RuntimeError(
                "`diffrax_linearize.PredictiveController` needs a solver with an error "
                "estimate (a `diffrax.AbstractAdaptiveSolver`)."
            )
        k = self._error_order(error_order)
        h = t1 - t0

        def _scale(_y0, _y1, _e):
            # A step into a region where the vector field is undefined: scale by y0.
            _y1 = jnp.where(jnp.isnan(_y1).any(), _y0, _y1)
            with jax.numpy_dtype_promotion("standard"):
                return _e / (self.atol + jnp.maximum(jnp.abs(_y0), jnp.abs(_y1)) * self.rtol)

        error = self.norm(jtu.tree_map(_scale, y0, y1_candidate, y_error))
        error = jax.lax.stop_gradient(jnp.asarray(error))
        # A failed step (a NaN or infinite error) is rejected with the largest decrease.
        error = jnp.where(jnp.isfinite(error), error, jnp.inf)
        keep = error < 1
        if self.dtmin is not None and self.force_dtmin:
            # As `diffrax.PIDController(force_dtmin=True)`: a step of `dtmin` is kept,
            # unless it failed (a non-finite error; the solve stops below).
            keep = keep | (state.at_dtmin & jnp.isfinite(error))
        # An error of zero would ask for an infinite step: the floor only lets
        # `factormax` clip it.
        floor = jnp.finfo(error.dtype).tiny ** 0.25
        e = jnp.maximum(error, floor)
        with jax.numpy_dtype_promotion("standard"):
            factor = self.safety * e ** (-1 / k)
            ratio = h / state.h_accepted
            predicted = self.safety * ratio * (state.error_accepted / e**2) ** (1 / k)
            factor = jnp.where(keep & state.any_accepted, jnp.minimum(factor, predicted), factor)
            factor = jnp.clip(factor, self.factormin, jnp.where(keep, self.factormax, self.safety))
            factor = jnp.where(jnp.isfinite(error), factor, self.factormin)
            if self.steady is not None:
                lo, hi = self.steady
                factor = jnp.where(keep & (factor >= lo) & (factor <= hi), 1.0, factor)
            factor = jax.lax.stop_gradient(factor)
            dt = h * factor.astype(jnp.result_type(h))
        result = RESULTS.successful
        at_dtmin = jnp.asarray(False)
        if self.dtmax is not None:
            dt = jnp.minimum(dt, self.dtmax)
        if self.dtmin is not None:
            if self.force_dtmin:
                at_dtmin = dt <= self.dtmin
                # A failed step of `dtmin`: no smaller step may be tried.
                failed = state.at_dtmin & ~jnp.isfinite(error)
                result = RESULTS.where(failed, RESULTS.dt_min_reached, result)
            else:
                result = RESULTS.where(dt < self.dtmin, RESULTS.dt_min_reached, result)
            dt = jnp.maximum(dt, self.dtmin)
        next_t0 = jnp.where(keep, t1, t0)
        next_t1 = next_t0 + dt
        new_state = PredictiveState(
            h_accepted=jnp.where(keep, h, state.h_accepted).astype(state.h_accepted.dtype),
            error_accepted=jnp.where(keep, jnp.maximum(error, 1e-2), state.error_accepted).astype(
                state.error_accepted.dtype
            ),
            any_accepted=state.any_accepted | keep,
            at_dtmin=at_dtmin,
        )
        return keep, next_t0, next_t1, False, new_state, result
