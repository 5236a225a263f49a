"""Linear operators for the sparse structures the engine finds: block-diagonal, banded and
general row-compressed matrices (ELLPACK for even rows, CSR for uneven ones), registered
with lineax's `singledispatch` functions as lineax registers its own operators. Each acts
on arrays of any shape (its input and output structures), as a matrix on their flattened
forms, and stores at most twice its nonzeros in its array leaves: the pattern (offsets,
column indices) is static."""

import functools as ft
import hashlib
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jaxtyping import Array, Inexact

from ._compat import made_by_transpose
from ._sparsity import (
    compressed_diagonal,
    flat_entries,
    flat_pattern,
    gather_sum,
    storage_plan,
)


class StaticArray:
    """A NumPy array held as static data in a module: hashed and compared by its bytes."""

    __slots__ = ("array", "_digest")

    def __init__(self, array):
        self.array = np.ascontiguousarray(array)
        self.array.flags.writeable = False
        self._digest = hashlib.blake2b(
            self.array.tobytes() + str((self.array.shape, self.array.dtype.str)).encode(),
            digest_size=16,
        ).hexdigest()

    def __hash__(self):
        return hash(self._digest)

    def __eq__(self, other):
        return isinstance(other, StaticArray) and self._digest == other._digest

    def __repr__(self):
        return f"StaticArray(shape={self.array.shape}, dtype={self.array.dtype})"


def _flat(x):
    return jnp.reshape(x, (-1,))


def _structs_match(op, n_in, n_out):
    if math.prod(op.input_structure.shape) != n_in:
        raise ValueError(f"`{type(op).__name__}`: the input structure has the wrong size.")
    if math.prod(op.output_structure.shape) != n_out:
        raise ValueError(f"`{type(op).__name__}`: the output structure has the wrong size.")


class BlockDiagonalLinearOperator(lx.AbstractLinearOperator):
    """A block-diagonal matrix of `n` square blocks of size `k`, acting on arrays of
    `n * k` elements (flattened in row-major order): for example `N` independent systems of
    `k` unknowns each, stored as `(N, k, k)` numbers.

    Solved by [`diffrax_linearize.StructuredLinearSolver`][] with one batched LU
    factorisation, $O(n k^3)$.
    """

    blocks: Inexact[Array, "n k k"]
    input_structure: jax.ShapeDtypeStruct = eqx.field(static=True)
    output_structure: jax.ShapeDtypeStruct = eqx.field(static=True)

    def __init__(self, blocks, input_structure=None, output_structure=None):
        """**Arguments:**

        - `blocks`: an array of shape `(n, k, k)`: block `i` maps elements
          `i k, ..., i k + k - 1` of the input to the same elements of the output.
        - `input_structure`, `output_structure`: `jax.ShapeDtypeStruct`s of the arrays the
          operator acts on and returns (default: vectors of `n * k` elements).
        """
        blocks = jnp.asarray(blocks)
        if blocks.ndim != 3 or blocks.shape[1] != blocks.shape[2]:
            raise ValueError(
                "`diffrax_linearize.BlockDiagonalLinearOperator`: `blocks` must have shape "
                f"(n, k, k), got {blocks.shape}."
            )
        size = blocks.shape[0] * blocks.shape[1]
        default = jax.ShapeDtypeStruct((size,), blocks.dtype)
        self.blocks = blocks
        self.input_structure = default if input_structure is None else input_structure
        self.output_structure = default if output_structure is None else output_structure
        _structs_match(self, size, size)

    def mv(self, vector):
        n, k, _ = self.blocks.shape
        x = jnp.reshape(vector, (n, k))
        y = jnp.einsum("nij,nj->ni", self.blocks, x)
        return jnp.reshape(y, self.output_structure.shape).astype(self.output_structure.dtype)

    def as_matrix(self):
        n, k, _ = self.blocks.shape
        rows = np.arange(n * k).reshape(n, k)
        r = np.broadcast_to(rows[:, :, None], (n, k, k))
        c = np.broadcast_to(rows[:, None, :], (n, k, k))
        out = jnp.zeros((n * k, n * k), self.blocks.dtype)
        return out.at[r, c].set(self.blocks)

    def transpose(self):
        return BlockDiagonalLinearOperator(
            jnp.swapaxes(self.blocks, 1, 2), self.output_structure, self.input_structure
        )

    def in_structure(self):
        return self.input_structure

    def out_structure(self):
        return self.output_structure


class BandedLinearOperator(lx.AbstractLinearOperator):
    """A square banded matrix, stored by diagonals: `diagonals[j, r]` is the entry in row
    `r`, column `r + offsets[j]` (entries outside the matrix are ignored). Acts on arrays of
    `n` elements, flattened in row-major order: for example a 1D stencil, or a stencil on a
    grid whose band is the grid's row length.

    Solved by [`diffrax_linearize.StructuredLinearSolver`][] with a block-tridiagonal LU
    factorisation with blocks of the bandwidth, $O(n\\, w^2)$ for bandwidth $w$.
    """

    diagonals: Inexact[Array, "d n"]
    offsets: tuple[int, ...] = eqx.field(static=True)
    input_structure: jax.ShapeDtypeStruct = eqx.field(static=True)
    output_structure: jax.ShapeDtypeStruct = eqx.field(static=True)

    def __init__(self, diagonals, offsets, input_structure=None, output_structure=None):
        """**Arguments:**

        - `diagonals`: an array of shape `(len(offsets), n)`.
        - `offsets`: distinct ints, one per diagonal (`0` the main diagonal, `1` the first
          above it, `-1` the first below it).
        - `input_structure`, `output_structure`: as for
          [`diffrax_linearize.BlockDiagonalLinearOperator`][].
        """
        diagonals = jnp.asarray(diagonals)
        offsets = tuple(int(d) for d in offsets)
        if diagonals.ndim != 2 or diagonals.shape[0] != len(offsets):
            raise ValueError(
                "`diffrax_linearize.BandedLinearOperator`: `diagonals` must have shape "
                f"(len(offsets), n) = ({len(offsets)}, n), got {diagonals.shape}."
            )
        if len(set(offsets)) != len(offsets):
            raise ValueError(
                f"`diffrax_linearize.BandedLinearOperator`: repeated offsets {offsets}."
            )
        n = diagonals.shape[1]
        default = jax.ShapeDtypeStruct((n,), diagonals.dtype)
        self.diagonals = diagonals
        self.offsets = offsets
        self.input_structure = default if input_structure is None else input_structure
        self.output_structure = default if output_structure is None else output_structure
        _structs_match(self, n, n)

    @property
    def bandwidths(self) -> tuple[int, int]:
        """`(lower, upper)`."""
        return max(0, -min(self.offsets)), max(0, max(self.offsets))

    def mv(self, vector):
        n = self.diagonals.shape[1]
        lower, upper = self.bandwidths
        x = jnp.pad(_flat(vector).astype(self.diagonals.dtype), (lower, upper))
        y = sum(
            self.diagonals[j] * jax.lax.dynamic_slice_in_dim(x, lower + d, n)
            for j, d in enumerate(self.offsets)
        )
        return jnp.reshape(y, self.output_structure.shape).astype(self.output_structure.dtype)

    def as_matrix(self):
        n = self.diagonals.shape[1]
        out = jnp.zeros((n, n), self.diagonals.dtype)
        for j, d in enumerate(self.offsets):
            rows = np.arange(max(0, -d), min(n, n - d))
            out = out.at[rows, rows + d].set(self.diagonals[j, rows])
        return out

    def transpose(self):
        # Entry (r, r + d) becomes (r + d, r): diagonal -d, read at row r + d.
        n = self.diagonals.shape[1]
        new = []
        for j, d in enumerate(self.offsets):
            shifted = jnp.zeros((n,), self.diagonals.dtype)
            rows = np.arange(max(0, -d), min(n, n - d))
            new.append(shifted.at[rows + d].set(self.diagonals[j, rows]))
        return BandedLinearOperator(
            jnp.stack(new),
            tuple(-d for d in self.offsets),
            self.output_structure,
            self.input_structure,
        )

    def in_structure(self):
        return self.input_structure

    def out_structure(self):
        return self.output_structure


class SparseLinearOperator(lx.AbstractLinearOperator):
    """A sparse matrix in row-compressed (ELLPACK) form: row `r` holds `S` entries, entry
    `s` being `values[r, s]` in column `columns[s, r]`. The column indices are static (known
    at trace time), the values traced. Acts on arrays of any shape, flattened in row-major
    order: for example a stencil on a periodic grid, or any pattern the engine found.

    Solved by [`diffrax_linearize.StructuredLinearSolver`][] with GMRES, preconditioned by
    the inverse of its diagonal (or a preconditioner you pass).
    """

    values: Inexact[Array, "m s"]
    columns: StaticArray = eqx.field(static=True)
    input_structure: jax.ShapeDtypeStruct = eqx.field(static=True)
    output_structure: jax.ShapeDtypeStruct = eqx.field(static=True)

    def __init__(self, values, columns, input_structure, output_structure=None):
        """**Arguments:**

        - `values`: an array of shape `(m, S)`; entries that are not part of the matrix hold
          zero. `S = 0` is the zero matrix, which stores no numbers.
        - `columns`: a NumPy integer array of shape `(S, m)`: the flat input index of each
          entry.
        - `input_structure`: a `jax.ShapeDtypeStruct` of the arrays the operator acts on.
        - `output_structure`: of the arrays it returns (default: vectors of `m` elements).
        """
        values = jnp.asarray(values)
        columns = np.asarray(columns)
        if values.ndim != 2 or columns.shape != (values.shape[1], values.shape[0]):
            raise ValueError(
                "`diffrax_linearize.SparseLinearOperator`: `values` must have shape (m, S) "
                f"and `columns` shape (S, m); got {values.shape} and {columns.shape}."
            )
        if not np.issubdtype(columns.dtype, np.integer):
            raise TypeError(
                "`diffrax_linearize.SparseLinearOperator`: `columns` must be an integer "
                "NumPy array (known at trace time)."
            )
        n_in = math.prod(input_structure.shape)
        if columns.size and (columns.min() < 0 or columns.max() >= n_in):
            raise ValueError(
                "`diffrax_linearize.SparseLinearOperator`: `columns` must lie in "
                f"[0, {n_in}), the size of the input."
            )
        self.values = values
        self.columns = StaticArray(columns.astype(np.int32))
        self.input_structure = input_structure
        # Not `output_structure or ...`: the truth value of a 0-d structure is an error.
        if output_structure is None:
            output_structure = jax.ShapeDtypeStruct((values.shape[0],), values.dtype)
        self.output_structure = output_structure
        _structs_match(self, n_in, values.shape[0])

    def mv(self, vector):
        x = _flat(vector).astype(self.values.dtype)
        cols = self.columns.array
        y = jnp.zeros(self.values.shape[:1], self.values.dtype)  # no entries: zero
        for s in range(cols.shape[0]):
            y = y + self.values[:, s] * x[cols[s]]
        return jnp.reshape(y, self.output_structure.shape).astype(self.output_structure.dtype)

    def as_matrix(self):
        m, S = self.values.shape
        n = math.prod(self.input_structure.shape)
        rows = np.broadcast_to(np.arange(m)[:, None], (m, S))
        out = jnp.zeros((m, n), self.values.dtype)
        return out.at[rows, self.columns.array.T].add(self.values)

    def transpose(self):
        m, S = self.values.shape
        n = math.prod(self.input_structure.shape)
        cols = self.columns.array.T.reshape(-1)  # entry (r, s) at flat r * S + s
        order = np.argsort(cols, kind="stable")
        targets = cols[order]
        counts = np.bincount(targets, minlength=n)
        C = int(counts.max(initial=0))  # zero for the zero matrix
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        pos = np.arange(len(order)) - starts[targets]
        src = np.zeros((n, C), np.int64)
        valid = np.zeros((n, C), bool)
        src[targets, pos] = order
        valid[targets, pos] = True
        values = jnp.where(valid, jnp.reshape(self.values, (-1,))[src], 0)
        return SparseLinearOperator(
            values, (src // S).T, self.output_structure, self.input_structure
        )

    def in_structure(self):
        return self.input_structure

    def out_structure(self):
        return self.output_structure

    def diagonal(self):
        """The main diagonal (of the flattened square matrix)."""
        return compressed_diagonal(self.values, self.columns.array)


@ft.lru_cache(maxsize=64)
def _row_ids(indptr: StaticArray) -> np.ndarray:
    """The row of each entry of a CSR pattern, at trace time."""
    counts = np.diff(indptr.array)
    return np.repeat(np.arange(len(counts), dtype=np.int32), counts)


class CSRLinearOperator(lx.AbstractLinearOperator):
    """A sparse matrix in compressed sparse row (CSR) form, laid out as
    `scipy.sparse.csr_array` lays it out: the entries of row `r` are
    `values[indptr[r]:indptr[r + 1]]`, in the columns `indices[indptr[r]:indptr[r + 1]]`.
    The indices are static (NumPy, known at trace time), the values traced. It holds one
    number per nonzero however uneven its rows are, where
    [`diffrax_linearize.SparseLinearOperator`][] (ELLPACK) holds as many in every row as
    the longest row has: a graph with hubs, or a reaction network in which a few species
    take part in most reactions. [`diffrax_linearize.materialise_operator`][] returns it
    for patterns that no other storage holds in at most twice their nonzeros.

    Acts on arrays of any shape, flattened in row-major order. `mv` is a gather and a
    sorted segment sum, $O(\\mathrm{nnz})$; the transpose is a static permutation of the
    values (the matrix's CSC form, read as CSR).

    Solved by [`diffrax_linearize.StructuredLinearSolver`][] as a
    `SparseLinearOperator` is: reordered to a band and factored where that band is narrow,
    otherwise by GMRES preconditioned by the inverse of its diagonal.
    """

    values: Inexact[Array, " nnz"]
    indices: StaticArray = eqx.field(static=True)
    indptr: StaticArray = eqx.field(static=True)
    input_structure: jax.ShapeDtypeStruct = eqx.field(static=True)
    output_structure: jax.ShapeDtypeStruct = eqx.field(static=True)

    def __init__(self, values, indices, indptr, input_structure, output_structure=None):
        """**Arguments:**

        - `values`: an array of shape `(nnz,)`.
        - `indices`: a NumPy integer array of shape `(nnz,)`: the flat input index
          (column) of each entry. A (row, column) pair appears at most once.
        - `indptr`: a NumPy integer array of shape `(m + 1,)`, non-decreasing from `0` to
          `nnz`: row `r` holds the entries `indptr[r]` to `indptr[r + 1] - 1`.
        - `input_structure`: a `jax.ShapeDtypeStruct` of the arrays the operator acts on.
        - `output_structure`: of the arrays it returns (default: vectors of `m` elements).
        """
        api = "`diffrax_linearize.CSRLinearOperator`"
        values = jnp.asarray(values)
        indices = np.asarray(indices)
        indptr = np.asarray(indptr)
        if not (
            np.issubdtype(indices.dtype, np.integer) and np.issubdtype(indptr.dtype, np.integer)
        ):
            raise TypeError(
                f"{api}: `indices` and `indptr` must be integer NumPy arrays (known at trace time)."
            )
        nnz = values.shape[0] if values.ndim == 1 else -1
        if values.ndim != 1 or indices.shape != (nnz,) or indptr.ndim != 1 or not len(indptr):
            raise ValueError(
                f"{api}: `values` and `indices` must have shape (nnz,) and `indptr` shape "
                f"(m + 1,); got {values.shape}, {indices.shape} and {indptr.shape}."
            )
        steps = np.diff(indptr)
        if indptr[0] != 0 or indptr[-1] != nnz or (steps < 0).any():
            raise ValueError(
                f"{api}: `indptr` must rise from 0 to the number of entries ({nnz}), never falling."
            )
        n_in = math.prod(input_structure.shape)
        if nnz and (indices.min() < 0 or indices.max() >= n_in):
            raise ValueError(f"{api}: `indices` must lie in [0, {n_in}), the size of the input.")
        m = len(indptr) - 1
        rows = np.repeat(np.arange(m, dtype=np.int64), steps)
        keys = rows * max(n_in, 1) + indices
        if len(np.unique(keys)) != nnz:
            raise ValueError(
                f"{api}: a (row, column) pair appears more than once; sum those entries into one."
            )
        self.values = values
        self.indices = StaticArray(indices.astype(np.int32))
        self.indptr = StaticArray(indptr.astype(np.int64))
        self.input_structure = input_structure
        if output_structure is None:
            output_structure = jax.ShapeDtypeStruct((m,), values.dtype)
        self.output_structure = output_structure
        _structs_match(self, n_in, m)

    @property
    def nnz(self) -> int:
        """The number of entries stored."""
        return self.indices.array.shape[0]

    def mv(self, vector):
        x = _flat(vector).astype(self.values.dtype)
        m = self.indptr.array.shape[0] - 1
        y = jax.ops.segment_sum(
            self.values * x[self.indices.array],
            _row_ids(self.indptr),
            num_segments=m,
            indices_are_sorted=True,
        )
        return jnp.reshape(y, self.output_structure.shape).astype(self.output_structure.dtype)

    def as_matrix(self):
        m = self.indptr.array.shape[0] - 1
        n = math.prod(self.input_structure.shape)
        out = jnp.zeros((m, n), self.values.dtype)
        return out.at[_row_ids(self.indptr), self.indices.array].set(self.values)

    def transpose(self):
        n = math.prod(self.input_structure.shape)
        cols = self.indices.array
        order = np.argsort(cols, kind="stable")  # by column, rows ascending within each
        indptr = np.concatenate([[0], np.cumsum(np.bincount(cols, minlength=n))])
        return CSRLinearOperator(
            self.values[order],
            _row_ids(self.indptr)[order],
            indptr,
            self.output_structure,
            self.input_structure,
        )

    def in_structure(self):
        return self.input_structure

    def out_structure(self):
        return self.output_structure

    def diagonal(self, offset: int = 0):
        """The diagonal `offset` of the flattened matrix (`0` the main one, `1` the first
        above it, `-1` the first below it), as `jnp.diagonal` gives it: a gather of the
        entries on it, zero where the pattern has none."""
        m = self.indptr.array.shape[0] - 1
        n = math.prod(self.input_structure.shape)
        rows, cols = _row_ids(self.indptr), self.indices.array
        length = max(0, min(m, n - offset) if offset >= 0 else min(m + offset, n))
        # Entry (r, c) lies on it at position min(r, c) when c - r == offset.
        on = np.flatnonzero(cols.astype(np.int64) - rows == offset)
        pick = np.full((length,), self.nnz, np.int64)
        pick[np.minimum(rows[on], cols[on])] = on
        padded = jnp.concatenate([self.values, jnp.zeros((1,), self.values.dtype)])
        return padded[pick]

    def _pattern_within(self, lower: int, upper: int) -> bool:
        if self.input_structure.shape != self.output_structure.shape:
            return False
        off = self.indices.array.astype(np.int64) - _row_ids(self.indptr)
        return bool(((off >= -lower) & (off <= upper)).all())


_OPERATORS = (
    BlockDiagonalLinearOperator,
    BandedLinearOperator,
    SparseLinearOperator,
    CSRLinearOperator,
)


def _register(fn, *types):
    def decorator(impl):
        for t in types:
            fn.register(t)(impl)
        return impl

    return decorator


@_register(lx.linearise, *_OPERATORS)
@_register(lx.materialise, *_OPERATORS)
def _(operator):
    return operator


@_register(lx.diagonal, BlockDiagonalLinearOperator)
def _(operator):
    return jnp.diagonal(operator.blocks, axis1=1, axis2=2).reshape(-1)


@_register(lx.diagonal, BandedLinearOperator)
def _(operator):
    n = operator.diagonals.shape[1]
    if 0 in operator.offsets:
        return operator.diagonals[operator.offsets.index(0)]
    return jnp.zeros((n,), operator.diagonals.dtype)


@_register(lx.diagonal, SparseLinearOperator)
def _(operator):
    return operator.diagonal()


@_register(lx.diagonal, CSRLinearOperator)
def _(operator):
    return operator.diagonal()


@_register(lx.tridiagonal, CSRLinearOperator)
def _(operator):
    return operator.diagonal(), operator.diagonal(-1), operator.diagonal(1)


@_register(lx.tridiagonal, BlockDiagonalLinearOperator, BandedLinearOperator, SparseLinearOperator)
def _(operator):
    matrix = operator.as_matrix()
    return (
        jnp.diagonal(matrix),
        jnp.diagonal(matrix, offset=-1),
        jnp.diagonal(matrix, offset=1),
    )


@_register(lx.is_diagonal, BlockDiagonalLinearOperator)
def _(operator):
    return operator.blocks.shape[1] == 1


@_register(lx.is_diagonal, BandedLinearOperator)
def _(operator):
    return set(operator.offsets) <= {0}


@_register(lx.is_tridiagonal, BlockDiagonalLinearOperator)
def _(operator):
    return operator.blocks.shape[1] <= 2


@_register(lx.is_tridiagonal, BandedLinearOperator)
def _(operator):
    return set(operator.offsets) <= {-1, 0, 1}


@_register(lx.is_lower_triangular, BandedLinearOperator)
def _(operator):
    return max(operator.offsets) <= 0


@_register(lx.is_upper_triangular, BandedLinearOperator)
def _(operator):
    return min(operator.offsets) >= 0


# The pattern of a CSR matrix is its own (no padding), so it decides these.
@_register(lx.is_diagonal, CSRLinearOperator)
def _(operator):
    return operator._pattern_within(0, 0)


@_register(lx.is_tridiagonal, CSRLinearOperator)
def _(operator):
    return operator._pattern_within(1, 1)


@_register(lx.is_lower_triangular, CSRLinearOperator)
def _(operator):
    return operator._pattern_within(operator.in_size(), 0)


@_register(lx.is_upper_triangular, CSRLinearOperator)
def _(operator):
    return operator._pattern_within(0, operator.in_size())


# An ELLPACK pattern's padding slots hold zeros in arbitrary columns, so the pattern
# decides nothing, except for a 1 x 1 matrix, which is diagonal (as lineax reports for
# its own untagged operators of one entry).
@_register(lx.is_diagonal, SparseLinearOperator)
@_register(lx.is_tridiagonal, SparseLinearOperator)
def _(operator):
    return operator.in_size() == 1 and operator.out_size() == 1


# Properties that the structure does not decide are reported as unknown (`False`), as
# lineax does for untagged operators.
@_register(lx.is_symmetric, *_OPERATORS)
@_register(lx.has_unit_diagonal, *_OPERATORS)
@_register(lx.is_lower_triangular, BlockDiagonalLinearOperator, SparseLinearOperator)
@_register(lx.is_upper_triangular, BlockDiagonalLinearOperator, SparseLinearOperator)
@_register(lx.is_positive_semidefinite, *_OPERATORS)
@_register(lx.is_negative_semidefinite, *_OPERATORS)
def _(operator):
    return False


@_register(lx.conj, BlockDiagonalLinearOperator)
def _(operator):
    return BlockDiagonalLinearOperator(
        operator.blocks.conj(), operator.input_structure, operator.output_structure
    )


@_register(lx.conj, BandedLinearOperator)
def _(operator):
    return BandedLinearOperator(
        operator.diagonals.conj(),
        operator.offsets,
        operator.input_structure,
        operator.output_structure,
    )


@_register(lx.conj, SparseLinearOperator)
def _(operator):
    return SparseLinearOperator(
        operator.values.conj(),
        operator.columns.array,
        operator.input_structure,
        operator.output_structure,
    )


@_register(lx.conj, CSRLinearOperator)
def _(operator):
    return CSRLinearOperator(
        operator.values.conj(),
        operator.indices.array,
        operator.indptr.array,
        operator.input_structure,
        operator.output_structure,
    )


# ---- from the engine's blocks -------------------------------------------------------------


def _assemble(values, target, live, size: int, period: int, size_first: bool = False):
    """`out[r, t]`: the sum of row `r`'s live slots `e` with `target[e, r] == t`, for the
    static `target` and `live` of shape `(E, rows)` and `values` of the same shape
    (entry-major, as `flat_entries(..., entries_first=True, masked=False)` gives them; only
    live slots are read); `period` divides the number of rows. Rows `r` and `r + period`
    share their slots' targets in a regular pattern (a stencil's diagonals, with
    `period = 1`; the rows of equal blocks, with the block size), so each
    `(r % period, t)` is a sum of whole slot rows of `values`, a static mask only where a
    slot is not live or lands elsewhere in some rows: elementwise work that XLA fuses into
    one pass. Patterns too irregular for that are assembled by `gather_sum`.

    XLA's CPU compiler fuses such slices and stacks with the program that computes
    `values` only where it can index that program's output directly: it fuses no
    concatenation of more than 8 operands (so the stacks are nested, one per row of a
    block), and it does not fuse a program whose output is transposed and then sliced
    several times (its limit on duplicated code). So where `values` is a transpose (the
    block of `jax.vmap` over cells, whose out axes the engine reorders), the slices are
    taken of the transpose back, which XLA cancels, and the assembled `(period, size)`
    pieces are transposed once at the end.

    **Arguments:**

    - `values`: a traced array of shape `(E, rows)`.
    - `target`, `live`: NumPy arrays of shape `(E, rows)`, integer and bool.
    - `size`: the number of targets.
    - `period`: a divisor of `rows`.
    - `size_first`: lay `out` out as `(size, rows)` (a band's diagonals), not
        `(rows, size)`.

    **Returns:** `out`, a traced array.
    """
    E, m = live.shape
    nb = m // period

    def gathered():
        e_idx, r_idx = np.nonzero(live)
        t_idx = np.asarray(target)[e_idx, r_idx].astype(np.int64)
        dest = t_idx * m + r_idx if size_first else r_idx * np.int64(size) + t_idx
        out = gather_sum(jnp.reshape(values, (-1,)), e_idx * np.int64(m) + r_idx, dest, m * size)
        return out.reshape((size, m) if size_first else (m, size))

    if period * size > 1024:
        return gathered()
    tgt = np.where(live, target, -1).reshape(E, nb, period)
    pieces = []
    for i in range(period):
        for t in range(size):
            hits = tgt[:, :, i] == t  # (E, nb)
            for e in np.nonzero(hits.any(axis=1))[0]:
                pieces.append((i, t, e, None if hits[e].all() else hits[e]))
    if len(pieces) > 4 * max(E, size) * period:
        return gathered()
    V = values.reshape(E, nb, period)
    # Slot rows `e, i` as contiguous vectors: of `V`, or of the transpose back (see above).
    transposed = period > 1 and not size_first and made_by_transpose(values)
    rows = jnp.swapaxes(V, 1, 2) if transposed else V
    columns = {}
    for i, t, e, mask in pieces:
        piece = rows[e, i] if transposed else rows[e, :, i]
        piece = piece if mask is None else jnp.where(mask, piece, np.zeros((), piece.dtype))
        columns[i, t] = piece if (i, t) not in columns else columns[i, t] + piece
    zero = jnp.zeros((nb,), values.dtype)
    if size_first and period == 1:
        return jnp.stack([columns.get((0, t), zero) for t in range(size)])
    if transposed:
        out = jnp.stack(
            [jnp.stack([columns.get((i, t), zero) for t in range(size)]) for i in range(period)]
        )
        return jnp.transpose(out, (2, 0, 1)).reshape(m, size)
    out = jnp.stack(
        [jnp.stack([columns.get((i, t), zero) for t in range(size)], -1) for i in range(period)],
        1,
    )
    out = out.reshape(m, size)
    return out.T if size_first else out


def _in_layout(kind: str, values, columns, live, layout, n: int):
    """The numbers an operator of storage `kind` holds for the row-compressed matrix with
    `values`, `columns`, `live` of shape `(E, rows)` (entry-major) acting on `n` elements,
    flat: the CSR values in the order of the sorted keys `row * n + column` given as
    `layout` (`"csr"`); blocks `(rows, k)` for the block size `layout`
    (`"block-diagonal"`); diagonals `(len(offsets), rows)` for the offsets `layout`
    (`"banded"`). The slots of a row that land in one place are summed. A NumPy `values`
    gives a NumPy array (a constant of the program). `None` where a live entry has no
    place in the layout."""
    E, m = columns.shape
    e_idx, r_idx = np.nonzero(np.asarray(live))
    cols = np.asarray(columns)[e_idx, r_idx].astype(np.int64)
    if kind == "csr":
        keys = r_idx * np.int64(max(n, 1)) + cols
        size = len(layout)
        dest = np.searchsorted(layout, keys)
        fits = (dest < size) & (layout[np.minimum(dest, max(size - 1, 0))] == keys)
    elif kind == "block-diagonal":
        fits = r_idx // layout == cols // layout
        dest = r_idx * np.int64(layout) + cols % layout
        size = m * layout
    else:
        offsets = np.asarray(layout, np.int64)
        index = np.searchsorted(offsets, cols - r_idx)
        fits = offsets[np.minimum(index, len(offsets) - 1)] == cols - r_idx
        dest = index * np.int64(m) + r_idx
        size = len(offsets) * m
    if not fits.all():
        return None
    src = e_idx * np.int64(m) + r_idx
    if isinstance(values, np.ndarray | np.generic):
        out = np.zeros(size, np.result_type(values))
        np.add.at(out, dest, np.reshape(values, (-1,))[src])
        return out
    if kind == "csr":
        return gather_sum(jnp.reshape(values, (-1,)), src, dest, size)
    if kind == "block-diagonal":
        return _assemble(values, columns % layout, live, layout, layout).reshape(-1)
    index = np.searchsorted(np.asarray(layout), columns.astype(np.int64) - np.arange(m))
    return _assemble(values, index, live, len(layout), 1, size_first=True).reshape(-1)


def _from_parts(kind: str, parts, layout, n: int, dtype):
    """The numbers of `_in_layout` for the sum of the blocks `parts` (a part known at trace
    time and a traced one; see `split_of`), each put in place alone: the known part's as
    a constant, the traced part's from its own entries only. `None` where an entry of a
    part has no place in the layout."""
    total = None
    for part in parts:
        values, columns, live = flat_entries(
            part if part.ell is not None else part.to_ell(), entries_first=True, masked=False
        )
        if not isinstance(values, np.ndarray | np.generic):
            values = jnp.asarray(values, dtype)
        out = _in_layout(kind, values, columns, live, layout, n)
        if out is None:
            return None
        total = out if total is None else total + out
    return jnp.asarray(total, dtype)


def dense_from_parts(block, parts, dtype):
    """The dense array (of shape `out_shape + in_shape`) of a row-compressed block that is
    the sum of `parts` (see `split_of`), its entries summed as `sparse_operator` sums
    them; `None` where a part does not fit the block's pattern."""
    columns, live = flat_pattern(block)
    m, n = columns.shape[1], math.prod(block.in_shape)
    e_idx, r_idx = np.nonzero(live)
    layout = np.unique(r_idx * np.int64(max(n, 1)) + columns[e_idx, r_idx])
    flat = _from_parts("csr", parts, layout, n, dtype)
    if flat is None:
        return None
    rows, cols = layout // max(n, 1), layout % max(n, 1)
    dense = jnp.zeros((m, n), dtype).at[rows, cols].set(flat, unique_indices=True)
    return dense.reshape(tuple(block.out_shape) + tuple(block.in_shape))


def sparse_operator(
    block, input_structure, output_structure, parts=None
) -> lx.AbstractLinearOperator:
    """The lineax operator of a row-compressed block (one with an `Ell`): block-diagonal,
    tridiagonal, banded, ELLPACK or CSR, whichever `storage_plan` picks for its static
    pattern (the one that `structure_report` describes). With `parts` (blocks whose sum is
    `block`: a known and a traced part, see `split_of`), the numbers are those of the
    parts, each put in place alone, where the storage is not ELLPACK."""
    columns, live = flat_pattern(block)
    m = columns.shape[1]
    n = math.prod(input_structure.shape)
    vector = len(input_structure.shape) == 1 and input_structure.shape == output_structure.shape
    plan = storage_plan(columns, live, n, tridiagonal=vector)
    dtype = output_structure.dtype
    if plan.kind == "zero":
        return SparseLinearOperator(
            jnp.zeros((m, 0), dtype),
            np.zeros((0, m), np.int32),
            input_structure,
            output_structure,
        )
    if plan.kind != "ellpack":
        if plan.kind == "csr":
            e_idx, r_idx = np.nonzero(live)
            layout = np.unique(r_idx * np.int64(max(n, 1)) + columns[e_idx, r_idx])
        else:
            layout = plan.block if plan.kind == "block-diagonal" else plan.offsets
        kind = plan.kind if plan.kind != "tridiagonal" else "banded"
        flat = None if parts is None else _from_parts(kind, parts, layout, n, dtype)
        if flat is None:  # entry-major values, as the block holds them: no transposes
            values, _, _ = flat_entries(block, entries_first=True, masked=False)
            flat = _in_layout(kind, jnp.asarray(values, dtype), columns, live, layout, n)
        if plan.kind == "csr":
            indptr = np.cumsum(np.bincount(layout // max(n, 1), minlength=m))
            indices = layout % max(n, 1)
            return CSRLinearOperator(
                flat, indices, np.concatenate([[0], indptr]), input_structure, output_structure
            )
        if plan.kind == "block-diagonal":
            # Row r's slots land in block r // k, at (r % k, column % k).
            k = plan.block
            blocks = flat.reshape(n // k, k, k)
            return BlockDiagonalLinearOperator(blocks, input_structure, output_structure)
        offsets = plan.offsets
        diagonals = flat.reshape(len(offsets), m)
        if plan.kind == "banded":
            return BandedLinearOperator(diagonals, offsets, input_structure, output_structure)
        full = {d: diagonals[offsets.index(d)] if d in offsets else None for d in (-1, 0, 1)}
        zero = jnp.zeros((n,), dtype)
        lo = full[-1] if full[-1] is not None else zero
        up = full[1] if full[1] is not None else zero
        mid = full[0] if full[0] is not None else zero
        return lx.TridiagonalLinearOperator(mid, lo[1:], up[:-1])
    values, _, _ = flat_entries(block)
    values = jnp.asarray(values, dtype)
    # Entries that are not part of the matrix point at the diagonal (with value zero), so
    # that the pattern a solver reads is the matrix's own.
    own = np.broadcast_to(np.minimum(np.arange(m), max(n - 1, 0)), columns.shape)
    return SparseLinearOperator(
        values, np.where(live, columns, own), input_structure, output_structure
    )
