"""What a step of ours returns when it fails."""

import jax.numpy as jnp
import jax.tree_util as jtu
from diffrax import is_okay, RESULTS
from jaxtyping import PyTree


def rejectable(result: RESULTS, y0: PyTree, y1: PyTree, y_error: PyTree):
    """`(y1, y_error)` of a step that an adaptive controller can reject where `result`
    says it failed (a root find that did not converge, a linear solve that met a
    non-finite input): an infinite error, as Diffrax's implicit Runge-Kutta solvers
    return, and the step's start as its end, every entry finite.

    Not the failed end itself: where it is infinite, `diffrax.PIDController`'s error scale
    `atol + rtol max(|y0|, |y1|)` is infinite (the controller replaces a NaN end by `y0`,
    not an infinite one), the scaled error inf / inf = NaN, the next step size NaN, and
    every later step is rejected until `max_steps`. A rejected step's end is never used;
    under a constant step size the failure is reported by `result`, as before.
    """
    ok = is_okay(result)
    y_error = jtu.tree_map(lambda e: jnp.where(ok, e, jnp.inf), y_error)
    y1 = jtu.tree_map(lambda a, b: jnp.where(ok, a, b), y1, y0)
    return y1, y_error
