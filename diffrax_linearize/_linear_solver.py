"""A lineax solver that exploits the structure of the operators `materialise_operator`
returns: one batched LU for block-diagonal matrices, a block-tridiagonal LU for banded
ones, a reordering to a band or GMRES with a diagonal preconditioner for other sparse
patterns (ELLPACK or CSR), lineax's own solvers
for identity, diagonal and tridiagonal operators, and for dense ones an unrolled inverse
(up to `SMALL_DENSE` unknowns) or LU."""

import functools as ft
import math
from typing import Any

import equinox as eqx
import jax
import jax.flatten_util as jfu
import jax.lax as lax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jaxtyping import Array

from ._operators import (
    _row_ids,
    BandedLinearOperator,
    BlockDiagonalLinearOperator,
    CSRLinearOperator,
    SparseLinearOperator,
    StaticArray,
)
from ._sparsity import compressed_diagonal


_API = "diffrax_linearize.StructuredLinearSolver"

# Below this many unknowns a sparse operator is solved dense (see
# `StructuredLinearSolver.dense_below`). Measured by `python -m benchmarks
# linear-crossover` (single-threaded CPU, float64, busy 2-core machine: rough): a factor and
# solve of the reordered band or GMRES costs more than dense LU up to 96-128 unknowns on a
# periodic stencil and up to 128-192 on an irregular (POLLU-like) pattern; block-diagonal
# and banded operators beat dense LU from 16-32 unknowns (from 4 counting a step's eight
# solves per factorisation), so they keep their factorisation at every size.
DENSE_BELOW = 128


def resolution(dtype) -> float:
    """The smallest relative tolerance an iteration in `dtype` can meet: ten units in the
    last significant digit (1e-5 in float32, 1e-14 in float64). Tolerances below it are
    raised to it: no update or residual can be made smaller, and a root finder or GMRES
    asked for less would only run out of steps (float32 is JAX's default)."""
    return 10.0 ** (1 - jnp.finfo(dtype).precision)


# At most this many unknowns, a dense operator is inverted by `_inverse` (statically
# unrolled) rather than LU-factored by lineax. Measured by the factor and six solves of a
# Rodas4P step in a `lax.fori_loop` (float64, 2-core CPU, loaded: rough): lineax's LU costs
# about 3 us whatever the size up to 8 (LAPACK custom calls, a pivot permutation and two
# triangular solves per right-hand side), the unrolled inverse 0.4-0.8 us up to 5 unknowns,
# then 2.4 us at 6 and 3 us at 8; in whole solves (Rodas4P, Rodas5P, ROS34PW2, BDF) it cost
# 0.3-0.6 times LU's per step on ROBER (3 unknowns) but 0.75-1.9 times on HIRES (8).
SMALL_DENSE = 5


# `_inverse` and `_inverse_blocks` are two Gauss-Jordan eliminations on purpose: one
# elimination over a trailing batch axis serving both (the dense case a batch of one) was
# slower on one of the two cases in every form tried (2026-12-05, interleaved, fastest
# rounds, loaded 2-core machine: rough; the merged form's time over the current one's).
# `_inverse`'s row selects with the batch minor: 10x at 10^4 blocks of 3 x 3 (the argmax and
# the pivot row's one-hot sum do not fuse), 2.4x with the pivot row found by selects over
# static rows. `_inverse_blocks`'s written-out entries on a batch of one: 1.3x on a dense
# matrix at n = 4 and 1.2-2x at n = 5, with twice the compile time at n = 5 (its size
# grows as $m^3$).


def _inverse(a):
    """The inverse of a square matrix by Gauss-Jordan elimination with partial pivoting.

    For small dense matrices and the small blocks of block-diagonal and block-tridiagonal
    factorisations: XLA's CPU triangular solves with a matrix right-hand side (what
    `lu_solve(lu, C)` needs) cost milliseconds for a 62 x 62 block, this a fraction of
    one; a solve is then one matrix-vector product, which XLA fuses with what is around
    it, where `lu_solve` makes two triangular-solve calls.

    Row swaps and updates are selects on whole rows (`jnp.where`), not scatters: XLA
    fuses a step into one loop. Up to `SMALL_DENSE` unknowns the elimination is unrolled
    at trace time, so the steps fuse with each other too. A zero pivot (a singular
    matrix) gives non-finite entries, as LU's division by a zero pivot does."""
    m = a.shape[-1]
    aug = jnp.concatenate([a, jnp.eye(m, dtype=a.dtype)], axis=1)
    idx = jnp.arange(m)

    def eliminate(k, aug):
        p = jnp.argmax(jnp.where(idx >= k, jnp.abs(aug[:, k]), -1))
        row_k, row_p = aug[k], aug[p]
        row_p = row_p / row_p[k]
        aug = jnp.where((idx == k)[:, None], row_p, jnp.where((idx == p)[:, None], row_k, aug))
        factor = jnp.where(idx == k, 0, aug[:, k])
        return aug - factor[:, None] * row_p[None, :]

    if m <= SMALL_DENSE:
        for k in range(m):
            aug = eliminate(k, aug)
    else:
        aug = lax.fori_loop(0, m, eliminate, aug)
    return aug[:, m:]


def _inverse_blocks(blocks):
    """The inverses of `n` blocks `(n, m, m)`, each by Gauss-Jordan elimination with
    partial pivoting.

    Blocks of up to 3 x 3 (a Robertson-like system per grid point) are eliminated with
    the elimination written out on the `n` entries of each position: every operation is
    elementwise over long arrays, which XLA fuses, where `jax.vmap` of the loop makes
    operations on arrays of `m` columns; for `10^4` blocks of 3 x 3 it is a few times
    faster. From 4 x 4 the written-out elimination costs more to compile than it saves
    (its size grows as $m^3$), and the loop stays. Not merged with `_inverse`: see the
    comment above it."""
    n, m, _ = blocks.shape
    if m > 3:
        return jax.vmap(_inverse)(blocks)
    a = jnp.moveaxis(blocks, 0, -1)
    one, zero = jnp.ones((n,), blocks.dtype), jnp.zeros((n,), blocks.dtype)
    aug = [
        [a[i, j] for j in range(m)] + [one if j == i else zero for j in range(m)] for i in range(m)
    ]
    for k in range(m):
        # The largest entry of column k, from row k down, swapped into row k.
        for i in range(k + 1, m):
            swap = jnp.abs(aug[i][k]) > jnp.abs(aug[k][k])
            row_k, row_i = aug[k], aug[i]
            aug[k] = [jnp.where(swap, x, y) for x, y in zip(row_i, row_k)]
            aug[i] = [jnp.where(swap, y, x) for x, y in zip(row_i, row_k)]
        pivot = aug[k][k]
        aug[k] = [x / pivot for x in aug[k]]
        for i in range(m):
            if i != k:
                factor = aug[i][k]
                aug[i] = [x - factor * y for x, y in zip(aug[i], aug[k])]
    return jnp.moveaxis(jnp.stack([jnp.stack(row[m:]) for row in aug]), -1, 0)


class _State(eqx.Module):
    """A factorisation, or what a solve needs, with the operator it was made from."""

    operator: lx.AbstractLinearOperator

    def solve(self, vector, options):
        raise NotImplementedError

    def transpose(self, solver, options):
        return _factor(self.operator.transpose(), solver, options)


class _BlockLU(_State):
    inverse: jax.Array  # (n, k, k): the inverse of each block

    def solve(self, vector, options):
        n, k, _ = self.inverse.shape
        b = jnp.reshape(vector, (n, k)).astype(self.inverse.dtype)
        x = jnp.einsum("nij,nj->ni", self.inverse, b)
        return jnp.reshape(x, self.operator.in_structure().shape), lx.RESULTS.successful, {}


class _BlockTridiagonalLU(_State):
    """`A = L U` for `A` block tridiagonal with blocks `D_i` (diagonal), `B_i` (below) and
    `C_i` (above): `S_0 = D_0`, `S_i = D_i - B_i S_{i-1}^{-1} C_{i-1}`, each `S_i`
    inverted with partial pivoting."""

    s_inverse: jax.Array  # S_i^{-1}, (nb, m, m)
    below: jax.Array  # B_i, (nb, m, m); B_0 unused
    x_above: jax.Array  # S_i^{-1} C_i, (nb, m, m)
    n: int = eqx.field(static=True)

    def solve(self, vector, options):
        nb, m, _ = self.s_inverse.shape
        b = jnp.reshape(vector, (-1,)).astype(self.s_inverse.dtype)
        b = jnp.pad(b, (0, nb * m - self.n)).reshape(nb, m)

        def forward(y_prev, inputs):
            s_inv, below, b_i = inputs
            y = s_inv @ (b_i - below @ y_prev)
            return y, y

        _, y = lax.scan(forward, jnp.zeros((m,), b.dtype), (self.s_inverse, self.below, b))

        def backward(x_next, inputs):
            y_i, xa = inputs
            x = y_i - xa @ x_next
            return x, x

        _, x = lax.scan(backward, jnp.zeros((m,), b.dtype), (y, self.x_above), reverse=True)
        x = x.reshape(-1)[: self.n]
        return jnp.reshape(x, self.operator.in_structure().shape), lx.RESULTS.successful, {}


def _givens(a, b):
    """The rotation `[[c, s], [-conj(s), c]]` (`c` real) taking `(a, b)` to `(r, 0)`."""
    real = jnp.finfo(jnp.result_type(a)).dtype
    r = jnp.sqrt(jnp.abs(a) ** 2 + jnp.abs(b) ** 2)
    zero_a = jnp.abs(a) == 0
    safe_abs_a = jnp.where(zero_a, 1, jnp.abs(a))
    safe_r = jnp.where(r == 0, 1, r)
    phase = jnp.where(zero_a, 1, a / safe_abs_a)
    c = jnp.where(zero_a, 0, jnp.abs(a) / safe_r).astype(real)
    s = jnp.where(zero_a, 1, phase * jnp.conj(b) / safe_r)
    return c, s.astype(jnp.result_type(a)), jnp.where(zero_a, b, phase * r)


def _row(a, i):
    # `a[i]` for an index known to be in bounds: `lax.dynamic_index_in_dim` skips the
    # wrapping of negative indices that `a[i]` makes (a small operation of its own, in a
    # loop where each costs an overhead on XLA's CPU backend).
    return lax.dynamic_index_in_dim(a, i, keepdims=False)


def _set_row(a, i, row):
    # `a.at[i].set(row)` for an index known to be in bounds: one in-place update, where
    # `.at[].set` adds the check and selection that drop an out-of-bounds write.
    return lax.dynamic_update_index_in_dim(a, row, i, 0)


# The basis of GMRES's first cycle (see `_gmres`).
_FIRST_CYCLE = 5


def _gmres(mv, b, target, restart: int, max_iters: int):
    """Restarted GMRES for `B v = b` (flat vectors), stopping when the root mean square of
    the residual `b - B v` is at most `target`. Returns `(v, iterations, result)`.

    Arnoldi by modified Gram-Schmidt; the least-squares problem is kept triangular by
    Givens rotations, which give the residual's norm at every iteration, so a solve stops
    at the first iteration that meets `target` (lineax's `GMRES` checks once per cycle of
    `restart` iterations, and wants two cycles). A cycle that meets `target` by that
    estimate ends the solve, as CVODE's GMRES ends; one that does not recomputes the true
    residual, from which the next cycle starts.

    The first cycle holds a basis of at most `_FIRST_CYCLE` vectors, the later ones of
    `restart`: the basis is an `(m + 1, n)` array written in full when a cycle starts, and
    the solves of an integrator's chord or Newton iteration (a tolerance a fraction of the
    step's) mostly take a few iterations, for which zeroing a basis of `restart + 1`
    long vectors cost as much as the iterations themselves (CVODE's default basis is 5).

    The rotations are kept as their product `Q`, a small `(m + 1)` square matrix, so that
    an iteration applies them all in one matrix-vector product and the residual is
    `beta Q[:, 0]`: XLA's CPU backend runs every small operation with an overhead of its
    own (microseconds, more on a loaded machine), so a loop over the `j` rotations cost
    more than the products of the short vectors it handles. Classical Gram-Schmidt (two
    products with the whole basis) cost more than the few projections of a typical solve
    (a few iterations): see `git log`."""
    n = b.size
    dtype = b.dtype
    tol2 = target * math.sqrt(n)  # on the 2-norm

    def cycle(m, v0, r, beta, iters):
        idx = jnp.arange(m + 1)
        V = _set_row(jnp.zeros((m + 1, n), dtype), 0, r / beta.astype(dtype))
        R = jnp.zeros((m + 1, m), dtype)
        Q = jnp.eye(m + 1, dtype=dtype)

        def cond(carry):
            j, _, _, _, done = carry
            return (j < m) & ~done & (iters + j < max_iters)

        def body(carry):
            j, V, R, Q, _ = carry
            w = mv(_row(V, j))

            def orthogonalise(i, carry):
                w, h = carry
                v_i = _row(V, i)
                hij = jnp.vdot(v_i, w)
                return w - hij * v_i, jnp.where(idx == i, hij, h)

            w, h = lax.fori_loop(0, j + 1, orthogonalise, (w, jnp.zeros((m + 1,), dtype)))
            h_next = jnp.linalg.norm(w)
            # An invariant subspace (lucky breakdown): the solution lies in it. The norm of
            # `w` before the projections is that of `(h, h_next)` (Pythagoras), which saves
            # a pass over the long vector.
            w_norm = jnp.sqrt(jnp.sum(jnp.abs(h) ** 2) + h_next**2)
            breakdown = h_next <= jnp.finfo(beta.dtype).eps * w_norm
            V = _set_row(V, j + 1, jnp.where(breakdown, 0, w / jnp.where(breakdown, 1, h_next)))
            h = jnp.where(idx == j + 1, h_next.astype(dtype), h)
            # The rotations so far (rows 0 to j of Q; row j + 1 is still the identity's).
            h = jnp.matmul(Q, h, precision=lax.Precision.HIGHEST)
            c, s, rjj = _givens(h[j], h[j + 1])
            h = jnp.where(idx == j, rjj, jnp.where(idx == j + 1, 0, h))
            q_j, q_next = _row(Q, j), _row(Q, j + 1)
            Q = _set_row(Q, j, c * q_j + s * q_next)
            Q = _set_row(Q, j + 1, c * q_next - jnp.conj(s) * q_j)
            R = lax.dynamic_update_index_in_dim(R, h, j, 1)
            done = breakdown | (jnp.abs(beta * Q[j + 1, 0]) <= tol2)
            return j + 1, V, R, Q, done

        init = (jnp.array(0), V, R, Q, jnp.array(False))
        j, V, R, Q, _ = lax.while_loop(cond, body, init)
        g = beta.astype(dtype) * Q[:m, 0]
        # The columns not reached are the identity's, with zeros on the right.
        used = idx[:m] < j
        R = jnp.where(used[None, :], R[:m], jnp.eye(m, dtype=dtype))
        y = jax.scipy.linalg.solve_triangular(R, jnp.where(used, g, 0), lower=False)
        # The `j` vectors of the basis made, one pass each (a product with the whole
        # basis would read all `m + 1`).
        v = lax.fori_loop(0, j, lambda i, v: v + y[i] * _row(V, i), v0)
        return v, j, jnp.abs(beta * Q[j, 0]).astype(beta.dtype)

    m_first = min(_FIRST_CYCLE, restart, n)
    m_later = min(restart, n)

    def outer_cond(carry):
        _, _, r_norm, iters, _, stalled = carry
        return (r_norm > tol2) & (iters < max_iters) & (stalled < 3) & jnp.isfinite(r_norm)

    def outer_body(carry):
        v, r, r_norm, iters, best, stalled = carry
        args = (v, r, r_norm, iters)
        if m_first == m_later:
            v, j, estimate = cycle(m_later, *args)
        else:
            v, j, estimate = lax.cond(
                iters == 0, lambda: cycle(m_first, *args), lambda: cycle(m_later, *args)
            )

        def residual():
            r = b - mv(v)
            return r, jnp.linalg.norm(r)

        r, r_norm = lax.cond(estimate <= tol2, lambda: (r, estimate), residual)
        stalled = jnp.where(r_norm < best, 0, stalled + 1)
        return v, r, r_norm, iters + j, jnp.minimum(best, r_norm), stalled

    b_norm = jnp.linalg.norm(b)
    init = (jnp.zeros_like(b), b, b_norm, jnp.array(0), b_norm, jnp.array(0))
    v, _, r_norm, iters, _, stalled = lax.while_loop(outer_cond, outer_body, init)
    result = lx.RESULTS.where(r_norm <= tol2, lx.RESULTS.successful, lx.RESULTS.max_steps_reached)
    result = lx.RESULTS.where((r_norm > tol2) & (stalled >= 3), lx.RESULTS.stagnation, result)
    result = lx.RESULTS.where(jnp.isfinite(r_norm), result, lx.RESULTS.breakdown)
    return v, iters, result


class _Krylov(_State):
    # Jacobi by default, held as the inverse diagonal (an array), not as a
    # `lineax.FunctionLinearOperator`: a W-method carries this state from step to step
    # through `lax.cond`/`while_loop`, whose carry holds arrays only (a function's
    # closure-converted jaxpr is not one).
    inverse_diagonal: Array | None
    preconditioner: lx.AbstractLinearOperator | None
    solver: "StructuredLinearSolver" = eqx.field(static=True)

    def solve(self, vector, options):
        structure = self.operator.in_structure()
        shape = structure.shape
        solver = self.solver
        b = jnp.reshape(vector, (-1,))
        dtype = jnp.result_type(b, structure.dtype)
        b = b.astype(dtype)
        res = resolution(dtype)

        def A(x):
            return jnp.reshape(self.operator.mv(jnp.reshape(x, shape)), (-1,)).astype(dtype)

        def P(v):
            if self.preconditioner is None:
                return jnp.reshape(self.inverse_diagonal, (-1,)) * v
            return jnp.reshape(self.preconditioner.mv(jnp.reshape(v, shape)), (-1,)).astype(dtype)

        rhs = b
        y0 = options.get("y0")
        if y0 is not None:
            y0 = jnp.reshape(y0, (-1,)).astype(dtype)
            b = b - A(y0)
        # The residual is weighted entry by entry and measured by its root mean square, as
        # CVODE measures it: by the caller's scale (its error weights) against a fraction
        # of the caller's tolerance, or by GMRES's own `atol + rtol |b_i|` against 1.
        if "scale" in options and "tolerance" in options:
            weights = 1 / jfu.ravel_pytree(options["scale"])[0].astype(dtype).real
            target = solver.linear_fraction * jnp.asarray(options["tolerance"]).real
            # No finer than rounding of the weighted right-hand side.
            rms_b = jnp.linalg.norm(weights * rhs) / math.sqrt(b.size)
            target = jnp.maximum(target.astype(rms_b.dtype), res * rms_b)
        else:
            # Where `b_i` is zero the scale is `atol` alone, but the residual cannot fall
            # below the rounding of the other entries, about `resolution |b|` (float32
            # stagnates at an `atol` of 1e-10).
            floor = res * jnp.max(jnp.abs(rhs), initial=0)
            atol = jnp.maximum(solver.atol, floor)
            weights = 1 / (atol + max(solver.rtol, res) * jnp.abs(rhs))
            target = jnp.ones((), weights.dtype)
        # Right-preconditioned and scaled: B = W A P W^{-1}, v = W P^{-1} x, so that the
        # residual GMRES minimises is the weighted one.
        weights = weights.astype(dtype)

        def B(v):
            return weights * A(P(v / weights))

        max_iters = 10 * b.size if solver.max_steps is None else solver.max_steps
        v, iters, result = _gmres(B, weights * b, target, solver.restart, max_iters)
        x = P(v / weights)
        if y0 is not None:
            x = x + y0
        return jnp.reshape(x, shape), result, {"num_steps": iters}


class _MatrixFree(_State):
    """GMRES's state `krylov` multiplying by `function` (a `lineax.FunctionLinearOperator`)
    in place of `operator`, which serves its transpose (a solve of the adjoint system in
    reverse-mode differentiation): the materialised operator, or `function` itself, then
    transposed by `jax.linear_transpose` with the same Jacobi preconditioner (a matrix
    and its transpose have one diagonal)."""

    krylov: "_Krylov"
    function: lx.AbstractLinearOperator

    def solve(self, vector, options):
        k = self.krylov
        return _Krylov(self.function, k.inverse_diagonal, k.preconditioner, k.solver).solve(
            vector, options
        )

    def transpose(self, solver, options):
        if not isinstance(self.operator, lx.FunctionLinearOperator):
            return _factor(self.operator.transpose(), solver, options)
        k = self.krylov
        function = self.function.transpose()
        krylov = _Krylov(function, k.inverse_diagonal, k.preconditioner, k.solver)
        return _MatrixFree(function, krylov, function)


class _Preconditioner(_State):
    """GMRES's Jacobi preconditioner alone, without the operator it was made from (its
    `operator` is a placeholder of the same structure): what an integrator that
    multiplies by its own function carries between steps (see `detach`). It solves
    nothing until [`matrix_free`][] gives it that function."""

    inverse_diagonal: Array
    solver: "StructuredLinearSolver" = eqx.field(static=True)

    def solve(self, vector, options):
        raise ValueError(
            f"`{_API}`: a detached GMRES state solves only through `matrix_free` (a bug "
            "in diffrax_linearize: please report it)."
        )

    def transpose(self, solver, options):
        return self.solve(None, options)


def detach(state):
    """GMRES's state `state` without the materialised operator it holds, to be carried
    between the steps of an integrator that multiplies by its own function (see
    [`matrix_free`][], which gives that state back its operators): the operator is as
    large as the Jacobian, and a step's `lax.cond`s and Diffrax's choice between the new
    and the old solver state copy it at every step. Any other state is returned as it
    is."""
    if not isinstance(state, _Krylov) or state.preconditioner is not None:
        return state
    structure = state.operator.in_structure()
    if structure != state.operator.out_structure():
        return state
    identity = lx.IdentityLinearOperator(structure)
    return _Preconditioner(identity, state.inverse_diagonal, state.solver)


def is_detached(state) -> bool:
    """Whether `state` is GMRES's state made by [`detach`][] (for an integrator, a static
    choice of what it carries: the Jacobi preconditioner only needs a diagonal)."""
    return isinstance(state, _Preconditioner)


def with_diagonal(state, diagonal):
    """The detached GMRES state `state` (see [`detach`][]) with the Jacobi preconditioner
    of an operator whose diagonal is `diagonal` (flat): what `init` would make of that
    operator, for an integrator that carries only the diagonals of its operators."""
    if not is_detached(state):
        raise ValueError(
            f"`{_API}`: `with_diagonal` takes a detached GMRES state (a bug in "
            "diffrax_linearize: please report it)."
        )
    inverse = jnp.reshape(_jacobi(diagonal), state.inverse_diagonal.shape)
    return _Preconditioner(
        state.operator, inverse.astype(state.inverse_diagonal.dtype), state.solver
    )


def jvp_product(g, t, y):
    r"""`v -> J v` with $J = \partial g / \partial y$ at `(t, y)`, by forward-mode
    differentiation of `g(t, y)` (flat vectors to flat vectors): for an integrator's
    [`matrix_free`][] product by its iteration matrix, a pass over the state as cheap as
    an evaluation of `g`, where a product by the materialised operator gathers every
    entry of every row (several times the cost). Each caller adds its own shift
    (`v - c J v`, `v / gamma - J v`).

    `t` and `y` are taken without derivatives, as the factorisation the product stands
    in for: lineax differentiates a solve through its operator, not through its state.

    For a complex `y`, $J$ is the complex Jacobian the materialised operator holds
    (`jax.jacfwd(..., holomorphic=True)`'s, whose columns are the derivatives along the
    real unit directions): `J v` is the products by the real and imaginary parts of `v`,
    recombined, two tangents of one forward pass. One `jax.jvp` by `v` would be the
    same for a holomorphic `g` but, for another (`jnp.conj`, `jnp.abs`), a map that is
    not complex-linear, which GMRES cannot solve with and the preconditioner does not
    match."""
    t, y = jax.lax.stop_gradient((t, y))

    def jvp(v):
        _, jv = jax.jvp(lambda z: g(t, z), (y,), (v,))
        return jv

    if not jnp.iscomplexobj(y):
        return jvp

    def mv(v):
        parts = jnp.stack([v.real, v.imag]).astype(v.dtype)
        jv = jax.vmap(jvp)(parts)
        return jv[0] + 1j * jv[1]

    return mv


def matrix_free(state, mv, operator):
    """The state `state` of [`diffrax_linearize.StructuredLinearSolver`][] for solves with
    `operator` by its product `mv` (flat vectors to flat vectors), when that state is
    GMRES's (made by `init`, or `detach`ed), which only multiplies by its operator: its
    preconditioner stays the one `state` holds. `operator` is the materialised one `state`
    was made from (it serves the transpose), or a `lineax.FunctionLinearOperator` of `mv`
    (then transposed as a function). Any other state (a factorisation) is returned as it
    is. For an integrator that knows a cheaper product than the materialised operator's
    (forward-mode differentiation of its vector field); `mv` must be the product by
    `operator`, up to rounding."""
    if isinstance(state, _Preconditioner):
        state = _Krylov(operator, state.inverse_diagonal, None, state.solver)
    if not isinstance(state, _Krylov):
        return state
    structure = state.operator.in_structure()
    if structure != state.operator.out_structure():
        return state

    def fn(x):
        return jnp.reshape(mv(jnp.reshape(x, (-1,))), structure.shape)

    return _MatrixFree(operator, state, lx.FunctionLinearOperator(fn, structure))


class _Delegate(_State):
    """A lineax solver's state, for the operators lineax solves well itself."""

    solver: lx.AbstractLinearSolver = eqx.field(static=True)
    state: Any

    def solve(self, vector, options):
        return self.solver.compute(self.state, vector, options)

    def transpose(self, solver, options):
        state, _ = self.solver.transpose(self.state, options)
        return _Delegate(self.operator.transpose(), self.solver, state)


class StructuredLinearSolver(lx.AbstractLinearSolver):
    r"""A `lineax` linear solver that exploits the structure of the operators returned by
    [`diffrax_linearize.materialise_operator`][]:

    - [`diffrax_linearize.BlockDiagonalLinearOperator`][]: each block inverted (batched
      Gauss-Jordan elimination with partial pivoting), $O(n k^3)$ for `n` blocks of size
      `k`;
    - [`diffrax_linearize.BandedLinearOperator`][]: a block-tridiagonal LU factorisation
      with blocks of the bandwidth $w$ (partial pivoting inside each block), $O(n w^2)$;
    - [`diffrax_linearize.SparseLinearOperator`][] and
      [`diffrax_linearize.CSRLinearOperator`][] of fewer than `dense_below` (128)
      unknowns: LU of the dense matrix, which is faster at that size whatever the
      pattern;
    - larger ones (a stencil on a periodic 2D grid, whose flattened bandwidth is the whole
      grid; a graph, a reaction network): the unknowns are reordered by reverse
      Cuthill-McKee (from the static pattern, at trace time), and where that makes the
      matrix banded with a band cheap to factor ($n w^2 \le 10^6$) it is factored as one:
      on an `n x n` periodic grid the band is about `4 n`. Otherwise,
      or when a `preconditioner` is passed in `options`: restarted GMRES, preconditioned by
      the inverse of the diagonal (or that preconditioner);
    - `lineax.IdentityLinearOperator`, `lineax.DiagonalLinearOperator`,
      `lineax.TridiagonalLinearOperator`: lineax's `Diagonal` and `Tridiagonal` solvers;
    - anything else: LU of the dense matrix, as `lineax.AutoLinearSolver(well_posed=True)`.

    Dense matrices of at most 5 unknowns (a sparse operator below `dense_below`, or any
    other operator) are inverted instead, by Gauss-Jordan elimination with partial
    pivoting unrolled at trace time, so that a solve is one matrix-vector product: for
    such small systems lineax's LU costs several times more per step of a stiff solver
    (LAPACK calls, pivot permutations and triangular solves that XLA cannot fuse).

    The factorisations are exact up to rounding. The block-tridiagonal factorisation does
    not pivot between blocks: like the Thomas algorithm it is stable for (block)
    diagonally dominant matrices, such as the `I - h γ J` of an implicit step of a
    diffusion-dominated problem, and may lose accuracy otherwise.

    The GMRES path is iterative (right-preconditioned, restarted after 5 iterations and
    then every `restart`, the residual checked at every iteration): it stops at the tolerances
    below, and reports failure (`lineax.RESULTS`) if it does not converge. A caller that
    knows what accuracy it needs (an integrator's Newton or chord iteration) passes it in
    lineax's `options`, as CVODE's integrator tells its Krylov solver:

    - `options["scale"]`, of the vector's structure (positive), and `options["tolerance"]`,
      a scalar: GMRES stops when the root mean square of `residual / scale` is at most
      `linear_fraction * tolerance`. [`diffrax_linearize.BDF`][],
      [`diffrax_linearize.VeryChord`][] and [`diffrax_linearize.Newton`][] pass their
      error weights (`atol + rtol |y|`) as `scale` and their convergence tolerance (a
      fraction of the step's error tolerance) as `tolerance`, so that a linear solve
      makes a few iterations, not the many that `rtol` asks.

    Without them GMRES meets `rtol` and `atol`. The direct factorisations ignore both.
    """

    rtol: float
    atol: float
    restart: int
    max_steps: int | None
    dense_below: int
    linear_fraction: float

    def __init__(
        self,
        rtol: float = 1e-10,
        atol: float = 1e-10,
        restart: int = 20,
        max_steps: int | None = None,
        dense_below: int = DENSE_BELOW,
        linear_fraction: float = 0.05,
    ):
        """**Arguments:**

        - `dense_below`: a [`diffrax_linearize.SparseLinearOperator`][] or
          [`diffrax_linearize.CSRLinearOperator`][] with fewer than this many unknowns is made dense
          and LU-factored, whatever its pattern: for small systems the reordered band and GMRES cost
          more than dense LU (measured by `python -m benchmarks linear-crossover`; the crossover
          lies between 96 and 192 unknowns). Block-diagonal and banded operators keep their
          factorisation at every size: it is faster than dense LU from a few unknowns on. `0` keeps
          every structure; a `preconditioner` in `options` always takes GMRES.

        The others are used by the GMRES path only; the factorisations are direct.

        - `rtol`, `atol`: without a caller's tolerance in `options`, GMRES stops when the
          root mean square of `residual_i / (atol + rtol |b_i|)` is at most 1. Tolerances
          below the resolution of the operator's dtype (1e-5 in float32) are raised to it:
          `rtol` to it, `atol` to it times `max |b|`.
        - `restart`: the Krylov subspace size before a restart (the first cycle's is at
          most 5, enough for most solves of an integrator's chord or Newton iteration).
        - `max_steps`: the most GMRES iterations, or `None` for `10 n` (`n` unknowns).
        - `linear_fraction`: with a caller's `options["scale"]` and
          `options["tolerance"]`, GMRES stops when the root mean square of
          `residual / scale` is at most `linear_fraction * tolerance` (no finer than the
          dtype resolves); 0.05 by default, CVODE's `epslin`: a Newton correction then
          errs by a twentieth of what the Newton iteration tolerates.
        """
        self.rtol = rtol
        self.atol = atol
        self.restart = restart
        self.max_steps = max_steps
        self.dense_below = dense_below
        self.linear_fraction = linear_fraction

    def __check_init__(self):
        for name in ("rtol", "atol", "linear_fraction"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value < 0:
                raise ValueError(f"`{_API}`: `{name}` must be a non-negative number.")
        if not isinstance(self.restart, int) or self.restart < 1:
            raise ValueError(f"`{_API}`: `restart` must be a positive int.")
        if not isinstance(self.dense_below, int) or self.dense_below < 0:
            raise ValueError(f"`{_API}`: `dense_below` must be a non-negative int.")

    def init(self, operator, options):
        if operator.in_size() != operator.out_size():
            raise ValueError(
                f"`{_API}` solves square systems; the operator maps {operator.in_size()} "
                f"to {operator.out_size()} elements."
            )
        if operator.in_size() == 0:
            # A state with no entries: lineax's `Diagonal` solver takes the largest entry of
            # the diagonal (its rank check), which an empty one has not; the dense LU of a
            # 0 x 0 matrix solves it exactly, with an empty solution.
            return _dense(operator, options)
        return _factor(operator, self, options)

    def compute(self, state, vector, options):
        # GMRES mixes real norms, rotations and weights with a complex operator's vectors
        # on purpose: promoted as NumPy would, whatever promotion the caller has set
        # (Diffrax's tests set JAX's strict one). A real system promotes nothing.
        with jax.numpy_dtype_promotion("standard"):
            return state.solve(vector, options)

    def transpose(self, state, options):
        return state.transpose(self, options), options

    def conj(self, state, options):
        return _factor(lx.conj(state.operator), self, options), options

    def assume_full_rank(self):
        return True

    # lineax < 0.1 asked these of solvers
    def allow_dependent_columns(self, operator):  # pragma: no cover
        return False

    def allow_dependent_rows(self, operator):  # pragma: no cover
        return False


@ft.singledispatch
def _factor(operator, solver: StructuredLinearSolver, options):
    if lx.is_diagonal(operator):
        lsolver = lx.Diagonal()
    elif lx.is_tridiagonal(operator) and len(operator.in_structure().shape) <= 1:
        lsolver = lx.Tridiagonal()
    else:
        return _dense(operator, options)
    return _Delegate(operator, lsolver, lsolver.init(operator, options))


@_factor.register(lx.IdentityLinearOperator)
@_factor.register(lx.DiagonalLinearOperator)
def _(operator, solver, options):
    lsolver = lx.Diagonal()
    return _Delegate(operator, lsolver, lsolver.init(operator, options))


@_factor.register(lx.TridiagonalLinearOperator)
def _(operator, solver, options):
    lsolver = lx.Tridiagonal()
    return _Delegate(operator, lsolver, lsolver.init(operator, options))


class _SmallDense(_State):
    """A small dense operator's inverse, for a solve that is one matrix-vector product."""

    inverse: jax.Array  # (n, n)

    def solve(self, vector, options):
        dtype = jnp.result_type(self.inverse, vector)
        b = jnp.reshape(vector, (-1,)).astype(dtype)
        x = self.inverse.astype(dtype) @ b
        return jnp.reshape(x, self.operator.in_structure().shape), lx.RESULTS.successful, {}

    def transpose(self, solver, options):
        return _SmallDense(self.operator.transpose(), self.inverse.T)


def _dense(operator, options) -> _State:
    """The dense matrix inverted (up to `SMALL_DENSE` unknowns) or LU-factored, for systems
    too small for their structure to pay."""
    # Pytree states are left to lineax, which ravels them.
    arrays = all(
        isinstance(s, jax.ShapeDtypeStruct)
        for s in (operator.in_structure(), operator.out_structure())
    )
    if arrays and operator.in_size() <= SMALL_DENSE:
        return _SmallDense(operator, _inverse(operator.as_matrix()))
    lsolver = lx.LU()
    return _Delegate(operator, lsolver, lsolver.init(operator, options))


@_factor.register(BlockDiagonalLinearOperator)
def _(operator, solver, options):
    return _BlockLU(operator, _inverse_blocks(operator.blocks))


def _block_tridiagonal_lu(operator, rows, cols, values, n: int, width: int):
    """Factor the matrix with entries `values` at static `(rows, cols)` (within `width` of
    the diagonal), as a block-tridiagonal matrix with blocks of size `width`."""
    m = max(width, 1)
    nb = math.ceil(n / m)
    dtype = values.dtype
    # Entry (r, c) lies in block row r // m, block column c // m, one of three blocks.
    kind = cols // m - rows // m + 1  # 0 below, 1 diagonal, 2 above
    blocks = jnp.zeros((3, nb, m, m), dtype)
    blocks = blocks.at[kind, rows // m, rows % m, cols % m].add(values)
    pad = nb * m - n
    if pad:  # the last block row is padded with an identity
        extra = np.arange(n, nb * m)
        blocks = blocks.at[1, extra // m, extra % m, extra % m].set(1)
    B, D, C = blocks[0], blocks[1], blocks[2]

    # One block at a time (a scan): LAPACK's LU (`jnp.linalg.inv`) beats the Gauss-Jordan
    # loop from blocks of 8 (126 x 126: 0.5 ms a block against 2.1 ms, 2-core CPU), which
    # stays for the many small blocks of a block-diagonal matrix, inverted all at once.
    invert = jnp.linalg.inv if m >= 8 else _inverse

    def step(x_prev, inputs):
        d, b, c = inputs
        s_inv = invert(d - b @ x_prev)
        xa = s_inv @ c
        return xa, (s_inv, xa)

    _, (s_inv, xa) = lax.scan(step, jnp.zeros((m, m), dtype), (D, B, C))
    return _BlockTridiagonalLU(operator, s_inv, B, xa, n)


@_factor.register(BandedLinearOperator)
def _(operator, solver, options):
    lower, upper = operator.bandwidths
    n = operator.diagonals.shape[1]
    rows, cols, picks = [], [], []
    for j, d in enumerate(operator.offsets):
        r = np.arange(max(0, -d), min(n, n - d))
        rows.append(r)
        cols.append(r + d)
        picks.append(j * n + r)
    rows, cols, picks = map(np.concatenate, (rows, cols, picks))
    values = jnp.reshape(operator.diagonals, (-1,))[picks]
    return _block_tridiagonal_lu(operator, rows, cols, values, n, max(lower, upper))


# A sparse pattern is factored directly when some ordering of the unknowns makes it banded
# with a band cheap enough to factor: n w^2 for n unknowns and bandwidth w. Past that, one
# factorisation per step costs more than GMRES's solves. Measured on the 2D Brusselator
# (Kvaerno5, 2-core CPU): an 8 x 8 grid (n w^2 = 1e5) 0.09 s direct, 0.20 s GMRES;
# 16 x 16 (2e6) 1.05 s against 0.80 s; 32 x 32 (3e7) 7.8 s against 3.4 s.
_DIRECT_FLOPS = 1e6


def _banded_ordering(rows, cols, m: int):
    """A reverse Cuthill-McKee ordering of the `m` unknowns of the static pattern `(rows,
    cols)` (at trace time) and the bandwidths of the reordered matrix."""
    import scipy.sparse as sp
    from scipy.sparse.csgraph import reverse_cuthill_mckee

    pattern = sp.csr_matrix((np.ones(rows.size, np.int8), (rows, cols)), (m, m))
    perm = np.asarray(reverse_cuthill_mckee(pattern + pattern.T, symmetric_mode=True))
    inv = np.argsort(perm)
    off = inv[cols] - inv[rows]
    return perm, inv, int(max(0, -off.min())), int(max(0, off.max()))


class _Permuted(_State):
    """A factorisation of the matrix with its unknowns reordered: `B = A[perm][:, perm]`."""

    inner: _State
    perm: Any = eqx.field(static=True)
    inv: Any = eqx.field(static=True)

    def solve(self, vector, options):
        b = jnp.reshape(vector, (-1,))[self.perm.array]
        y, result, stats = self.inner.solve(b, options)
        x = jnp.reshape(y, (-1,))[self.inv.array]
        return jnp.reshape(x, self.operator.in_structure().shape), result, stats


def _jacobi(diagonal):
    # The inverse of the diagonal, 1 where it is zero (no scaling rather than a division by
    # zero).
    d = diagonal
    return jnp.where(d == 0, 1, 1 / jnp.where(d == 0, 1, d))


def _factor_sparse(operator, rows, cols, values, diagonal, solver, options):
    """The sparse path, for the entries `values` at the static `(rows, cols)` of a square
    operator of `m` unknowns: reordered to a band and factored where that is cheap, else
    GMRES preconditioned by the inverse of `diagonal` (or the preconditioner in
    `options`)."""
    m = operator.out_size()
    if rows.size == 0:
        raise ValueError(
            f"`{_API}`: the `{type(operator).__name__}` has no entries (a zero Jacobian, such "
            "as that of `jnp.floor` or `jnp.sign`), so the linear system is singular. Check "
            "the function whose Jacobian this is."
        )
    if m < solver.dense_below and "preconditioner" not in options:
        return _dense(operator, options)
    if "preconditioner" not in options and m > 1:
        perm, inv, lower, upper = _banded_ordering(rows, cols, m)
        width = max(lower, upper, 1)
        if width < m // 2 and m * width**2 <= _DIRECT_FLOPS:
            inner = _block_tridiagonal_lu(operator, inv[rows], inv[cols], values, m, width)
            return _Permuted(operator, inner, StaticArray(perm), StaticArray(inv))
    # Jacobi: the diagonal read off the pattern, as `jacobian_diagonal` reads it.
    inv_d = jnp.reshape(_jacobi(diagonal), operator.in_structure().shape)
    preconditioner = options.get("preconditioner")
    if preconditioner is not None:
        inv_d = None
    return _Krylov(operator, inv_d, preconditioner, solver)


@_factor.register(SparseLinearOperator)
def _(operator, solver, options):
    m, S = operator.values.shape
    rows = np.broadcast_to(np.arange(m)[:, None], (m, S)).ravel()
    cols = operator.columns.array.T.ravel()
    values = jnp.reshape(operator.values, (-1,))
    diagonal = compressed_diagonal(operator.values, operator.columns.array)
    return _factor_sparse(operator, rows, cols, values, diagonal, solver, options)


@_factor.register(CSRLinearOperator)
def _(operator, solver, options):
    rows, cols = _row_ids(operator.indptr), operator.indices.array
    return _factor_sparse(
        operator, rows, cols, operator.values, operator.diagonal(), solver, options
    )
