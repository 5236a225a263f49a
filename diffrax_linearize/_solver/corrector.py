r"""Derivatives of [`diffrax_linearize.BDF`][]'s corrector by the implicit function theorem.

The corrector $y^*$ solves $F(y) = g(t_1, y)/\alpha_q - \psi - (y - y^{(0)}) = 0$ (with
$g = f\,h$) by a chord iteration, a `jax.lax.while_loop` that reverse-mode
differentiation cannot go through, and whose derivative would in any case be that of the
iteration (with its stale Jacobian), not that of the solution. As Diffrax's implicit
solvers (optimistix's `ImplicitAdjoint`), the solution is differentiated at the converged
point instead: $\dot y^* = -(\partial F/\partial y)^{-1}\, \partial F/\partial
\theta\, \dot\theta$, with the true Jacobian at $y^*$, a linear solve whose transpose
reverse mode takes.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import lineax as lx

from .._compat import implicit_jvp
from .._materialise import solver_operator


class _StructuredJacobian(lx.AbstractLinearSolver):
    """Solves with a `lineax.JacobianLinearOperator` (what `implicit_jvp` builds) by
    materialising it with the structure engine first, so that `solver` factors a
    block-diagonal, banded or sparse $\\partial F / \\partial y$ as such; lineax would
    make it dense (`jax.jacfwd`, $n$ products, and an $O(n^3)$ LU)."""

    solver: lx.AbstractLinearSolver

    def init(self, operator, options):
        op = solver_operator(operator.fn, operator.x, operator.args)
        return self.solver.init(op, options)

    def compute(self, state, vector, options):
        return self.solver.compute(state, vector, options)

    def transpose(self, state, options):
        return self.solver.transpose(state, options)

    def conj(self, state, options):
        return self.solver.conj(state, options)

    def assume_full_rank(self):
        return True

    def allow_dependent_columns(self, operator):  # pragma: no cover
        return False

    def allow_dependent_rows(self, operator):  # pragma: no cover
        return False


def _primal(inputs):
    # The root was found by the chord iteration outside: returned as it is, so that the
    # forward computation is unchanged bit for bit.
    y_star, _ = inputs
    return y_star, None


def _residual(root, _, inputs):
    _, residual = inputs
    return residual(root)


def corrector(y, d, linear_solver, g, t1, y_predict, psi, alpha_q):
    """The chord iteration's corrector `y` and its correction `d = y - y_predict`, as
    they are, with derivatives by the implicit function theorem (see the module's
    docstring) with respect to `y_predict`, `psi`, `t1` and whatever `g` closes over
    (the vector field's arguments and parameters)."""
    y_star = jax.lax.stop_gradient(y)

    def residual(z):
        return g(t1, z) / alpha_q - psi - (z - y_predict)

    if jnp.iscomplexobj(y_star):
        # A complex state is differentiated as its real and imaginary parts: the
        # implicit function theorem needs the derivative of the residual itself, which
        # for a vector field that is not holomorphic (`jnp.conj`, `jnp.abs`) is only
        # real-linear, where the complex Jacobian the chord iteration uses is not it.
        n = y_star.shape[0]
        complex_residual = residual

        def residual(u):
            r = complex_residual(jax.lax.complex(u[:n], u[n:]))
            return jnp.concatenate([r.real, r.imag])

        y_star = jnp.concatenate([y_star.real, y_star.imag])
    # Closure-converted, as `optimistix.root_find` converts its function: the arrays `g`
    # closes over become inputs that `implicit_jvp` differentiates.
    residual = eqx.filter_closure_convert(residual, y_star)
    solver = _StructuredJacobian(linear_solver)
    inputs = (y_star, residual)
    y_diff, _ = implicit_jvp(_primal, _residual, inputs, frozenset(), solver)
    if jnp.iscomplexobj(y):
        # Exactly `y` (its parts, put back together), with their derivatives.
        y_diff = jax.lax.complex(y_diff[:n], y_diff[n:])
    return y_diff, _correction(jax.lax.stop_gradient(d), y_diff, y_predict)


@jax.custom_jvp
def _correction(d, y, y_predict):
    """`d`, the iteration's own `y - y_predict` (which rounds differently from that
    difference), with the derivative of `y - y_predict`: no operation on the way."""
    return d


@_correction.defjvp
def _correction_jvp(primals, tangents):
    d, _, _ = primals
    _, t_y, t_predict = tangents
    return d, t_y - t_predict


def _stop(x):
    return jax.lax.stop_gradient(x) if eqx.is_inexact_array(x) else x


def without_derivatives(fn, *args):
    """`fn(*args)` with no derivatives through it, not even through the arrays `fn`
    closes over: for the chord iteration, whose result `corrector` differentiates, so
    that no tangent enters its `while_loop` (which reverse mode cannot transpose when a
    `diffrax.DirectAdjoint` linearises the whole solve) and forward mode computes none."""
    closed = eqx.filter_closure_convert(fn, *args)
    closed, args = jtu.tree_map(_stop, (closed, args))
    return closed(*args)
