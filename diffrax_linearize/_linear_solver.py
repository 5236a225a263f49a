"""A lineax solver that exploits the structure of the operators `materialise_operator`
returns: one batched LU for block-diagonal matrices, a block-tridiagonal LU for banded
ones, GMRES with a diagonal preconditioner for other sparse patterns, lineax's own solvers
for identity, diagonal and tridiagonal operators, and LU for dense ones."""

import functools as ft
import math
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import lineax as lx
import numpy as np

from ._operators import BandedLinearOperator, BlockDiagonalLinearOperator, SparseLinearOperator


_API = "diffrax_linearize.StructuredLinearSolver"


class _State(eqx.Module):
    """A factorisation, or what a solve needs, with the operator it was made from."""

    operator: lx.AbstractLinearOperator

    def solve(self, vector, options):
        raise NotImplementedError

    def transpose(self, solver, options):
        return _factor(self.operator.transpose(), solver, options)


class _BlockLU(_State):
    lu: jax.Array
    piv: jax.Array

    def solve(self, vector, options):
        n, k, _ = self.lu.shape
        b = jnp.reshape(vector, (n, k)).astype(self.lu.dtype)
        x = jax.vmap(lambda lu, piv, b: jsl.lu_solve((lu, piv), b))(self.lu, self.piv, b)
        return jnp.reshape(x, self.operator.in_structure().shape), lx.RESULTS.successful, {}


class _BlockTridiagonalLU(_State):
    """`A = L U` for `A` block tridiagonal with blocks `D_i` (diagonal), `B_i` (below) and
    `C_i` (above): `S_0 = D_0`, `S_i = D_i - B_i S_{i-1}^{-1} C_{i-1}`, each `S_i` LU
    factorised with partial pivoting."""

    lu: jax.Array  # (nb, m, m)
    piv: jax.Array
    below: jax.Array  # B_i, (nb, m, m); B_0 unused
    x_above: jax.Array  # S_i^{-1} C_i, (nb, m, m)
    n: int = eqx.field(static=True)

    def solve(self, vector, options):
        nb, m, _ = self.lu.shape
        b = jnp.reshape(vector, (-1,)).astype(self.lu.dtype)
        b = jnp.pad(b, (0, nb * m - self.n)).reshape(nb, m)

        def forward(y_prev, inputs):
            lu, piv, below, b_i = inputs
            y = jsl.lu_solve((lu, piv), b_i - below @ y_prev)
            return y, y

        _, y = lax.scan(forward, jnp.zeros((m,), b.dtype), (self.lu, self.piv, self.below, b))

        def backward(x_next, inputs):
            y_i, xa = inputs
            x = y_i - xa @ x_next
            return x, x

        _, x = lax.scan(backward, jnp.zeros((m,), b.dtype), (y, self.x_above), reverse=True)
        x = x.reshape(-1)[: self.n]
        return jnp.reshape(x, self.operator.in_structure().shape), lx.RESULTS.successful, {}


class _Krylov(_State):
    preconditioner: lx.AbstractLinearOperator
    gmres: lx.GMRES = eqx.field(static=True)

    def solve(self, vector, options):
        # GMRES iterates in the input's structure: an output of another shape (same size)
        # is read as one of the input's.
        structure = self.operator.in_structure()
        op = self.operator
        if op.out_structure() != structure:
            op = lx.FunctionLinearOperator(
                lambda v: jnp.reshape(self.operator.mv(v), structure.shape), structure
            )
        vector = jnp.reshape(vector, structure.shape)
        opts = {"preconditioner": self.preconditioner, **options}
        state = self.gmres.init(op, opts)
        return self.gmres.compute(state, vector, opts)


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
    """A `lineax` linear solver that exploits the structure of the operators returned by
    [`diffrax_linearize.materialise_operator`][]:

    - [`diffrax_linearize.BlockDiagonalLinearOperator`][]: one batched LU factorisation,
      $O(n k^3)$ for `n` blocks of size `k`;
    - [`diffrax_linearize.BandedLinearOperator`][]: a block-tridiagonal LU factorisation
      with blocks of the bandwidth $w$ (partial pivoting inside each block), $O(n w^2)$;
    - [`diffrax_linearize.SparseLinearOperator`][] (for example a stencil on a periodic 2D
      grid, whose flattened bandwidth is the whole grid): restarted GMRES, preconditioned
      by the inverse of the diagonal unless a `preconditioner` is passed in `options`;
    - `lineax.IdentityLinearOperator`, `lineax.DiagonalLinearOperator`,
      `lineax.TridiagonalLinearOperator`: lineax's `Diagonal` and `Tridiagonal` solvers;
    - anything else: LU of the dense matrix, as `lineax.AutoLinearSolver(well_posed=True)`.

    The factorisations are exact up to rounding. The block-tridiagonal factorisation does
    not pivot between blocks: like the Thomas algorithm it is stable for (block)
    diagonally dominant matrices, such as the `I - h γ J` of an implicit step of a
    diffusion-dominated problem, and may lose accuracy otherwise.

    The GMRES path is iterative: it stops at the tolerances below, and reports failure
    (`lineax.RESULTS`) if it does not converge.
    """

    rtol: float
    atol: float
    restart: int
    max_steps: int | None

    def __init__(
        self,
        rtol: float = 1e-10,
        atol: float = 1e-10,
        restart: int = 20,
        max_steps: int | None = None,
    ):
        """**Arguments:**

        These are used by the GMRES path only; the factorisations are direct.

        - `rtol`, `atol`: GMRES stops when the residual is below `atol + rtol * |b|`
          (lineax's `GMRES` convention, in the max norm).
        - `restart`: the Krylov subspace size before a restart.
        - `max_steps`: the most GMRES iterations, or `None` for no limit.
        """
        self.rtol = rtol
        self.atol = atol
        self.restart = restart
        self.max_steps = max_steps

    def __check_init__(self):
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value < 0:
                raise ValueError(f"`{_API}`: `{name}` must be a non-negative number.")
        if not isinstance(self.restart, int) or self.restart < 1:
            raise ValueError(f"`{_API}`: `restart` must be a positive int.")

    def init(self, operator, options):
        if operator.in_size() != operator.out_size():
            raise ValueError(
                f"`{_API}` solves square systems; the operator maps {operator.in_size()} "
                f"to {operator.out_size()} elements."
            )
        return _factor(operator, self, options)

    def compute(self, state, vector, options):
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
        lsolver = lx.LU()
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


@_factor.register(BlockDiagonalLinearOperator)
def _(operator, solver, options):
    lu, piv = jax.vmap(jsl.lu_factor)(operator.blocks)
    return _BlockLU(operator, lu, piv)


@_factor.register(BandedLinearOperator)
def _(operator, solver, options):
    lower, upper = operator.bandwidths
    n = operator.diagonals.shape[1]
    m = max(lower, upper, 1)
    nb = math.ceil(n / m)
    dtype = operator.diagonals.dtype
    # The band, padded to a multiple of the block size with an identity.
    diag = {d: operator.diagonals[j] for j, d in enumerate(operator.offsets)}
    pad = nb * m - n
    if pad:
        ones = jnp.ones((pad,), dtype)
        diag = {d: jnp.pad(v, (0, pad)) for d, v in diag.items()}
        diag[0] = diag.get(0, jnp.zeros((nb * m,), dtype)).at[n:].set(ones)
    size = nb * m

    def block(shift):
        """The blocks `A[i m + a, (i + shift) m + b]`, shape `(nb, m, m)`."""
        a = np.arange(m)[:, None]
        b = np.arange(m)[None, :]
        rows = np.arange(nb)[:, None, None] * m + a
        out = jnp.zeros((nb, m, m), dtype)
        for d, v in diag.items():
            hit = (b - a + shift * m) == d
            cols = rows + d
            ok = hit & (cols >= 0) & (cols < size)
            out = out + jnp.where(ok, v[np.clip(rows, 0, size - 1)], 0)
        return out

    D, B, C = block(0), block(-1), block(1)

    def step(x_prev, inputs):
        d, b, c = inputs
        s = d - b @ x_prev
        lu, piv = jsl.lu_factor(s)
        xa = jsl.lu_solve((lu, piv), c)
        return xa, (lu, piv, xa)

    _, (lu, piv, xa) = lax.scan(step, jnp.zeros((m, m), dtype), (D, B, C))
    return _BlockTridiagonalLU(operator, lu, piv, B, xa, n)


@_factor.register(SparseLinearOperator)
def _(operator, solver, options):
    d = operator.diagonal()
    structure = operator.in_structure()
    inv = jnp.reshape(jnp.where(d == 0, 1, 1 / jnp.where(d == 0, 1, d)), structure.shape)
    preconditioner = lx.FunctionLinearOperator(lambda v: v * inv, structure)
    if "preconditioner" in options:
        preconditioner = options["preconditioner"]
    gmres = lx.GMRES(
        rtol=solver.rtol, atol=solver.atol, restart=solver.restart, max_steps=solver.max_steps
    )
    return _Krylov(operator, preconditioner, gmres)
