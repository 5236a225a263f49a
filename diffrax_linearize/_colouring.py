"""The sparse fallback: Jacobian values from compressed JVPs over a colouring of the
columns, for an equation whose sparsity pattern is known (found by the structure rules at
trace time, as NumPy index sets) but whose values the rules cannot write down (a loop whose
carries' pattern grows every iteration).

As asdex and Julia's SparseDiffTools do: columns that never share a row get one colour; the
equation is applied to one seed per colour (the sum of the basis vectors of that colour),
and each entry of the pattern is read off the seed of its column's colour. `c` colours cost
`c` applications of the equation instead of one per column."""

import math

import jax.numpy as jnp
import numpy as np

from ._sparsity import absorb_in_axes, flat_entries, simplify
from ._structure import BAND, contract, Ell, expand, fresh_label, Struct


def _valid(colours, patterns) -> bool:
    """No row of any pattern holds two different columns of the same colour."""
    for columns, live in patterns:
        c = np.where(live, colours[columns], -1 - np.arange(columns.shape[0])[:, None])
        order = np.argsort(c, axis=0, kind="stable")
        sc = np.take_along_axis(c, order, axis=0)
        scol = np.take_along_axis(columns, order, axis=0)
        clash = (sc[1:] == sc[:-1]) & (sc[1:] >= 0) & (scol[1:] != scol[:-1])
        if clash.any():
            return False
    return True


def colour_columns(patterns, n: int, max_modular: int = 512) -> np.ndarray:
    """Colours for `n` columns such that no row of any pattern `(columns, live)` (each of
    shape `(entries, rows)`) holds two columns of one colour. Modular colourings `j mod m`
    first (optimal for bands and block-diagonal patterns), then a greedy colouring of the
    column intersection graph."""
    lower = max((int(live.sum(axis=0).max(initial=0)) for _, live in patterns), default=1)
    for m in range(max(lower, 1), min(n, max_modular) + 1):
        colours = np.arange(n) % m
        if _valid(colours, patterns):
            return colours
    # Greedy, column by column, over the columns that share a row with each column.
    neighbours = [set() for _ in range(n)]
    for columns, live in patterns:
        for r in range(columns.shape[1]):
            cols = np.unique(columns[live[:, r], r])
            for j in cols:
                neighbours[j].update(cols.tolist())
    colours = np.full(n, -1)
    for j in range(n):
        used = {colours[k] for k in neighbours[j] if k != j}
        c = 0
        while c in used:
            c += 1
        colours[j] = c
    return colours


def apply_block(b: Struct, seeds):
    """`J @ seeds` for a block `J` and `seeds` of shape `in_shape + (c,)`: an array of shape
    `out_shape + (c,)`."""
    c = seeds.shape[-1]
    if b.ell is None:
        label = fresh_label()
        sizes = {**b.sizes, label: c}
        val, labels = contract(
            [(b.val, b.val_labels), (seeds, tuple(b.in_labels) + (label,))],
            tuple(b.out_labels) + (label,),
            sizes,
        )
        return expand(jnp.asarray(val), labels, tuple(b.out_labels) + (label,), sizes)
    values, columns, _ = flat_entries(b)
    flat = jnp.reshape(seeds, (-1, c))
    out = jnp.einsum("re,rec->rc", jnp.asarray(values), flat[columns.T])
    return jnp.reshape(out, b.out_shape + (c,))


def pattern_of(b: Struct):
    """The flat pattern `(columns, live)` of a block over all its in axes (see
    `flat_entries`), and the number of entries per row."""
    if b.ell is None:
        b = b.to_ell()
    rest = [l for l in range(len(b.in_shape)) if l not in b.ell.in_axes]
    if rest:
        b = absorb_in_axes(b, rest)
        if b.ell is None:
            return None
    _, columns, live = flat_entries(b.with_val(np.zeros(np.shape(b.val), b.dtype)))
    # One live entry per (row, column): a compressed seed holds the whole entry.
    big = np.iinfo(np.int64).max
    key = np.where(live, columns, big)
    order = np.argsort(key, axis=0, kind="stable")
    sk = np.take_along_axis(key, order, axis=0)
    dup = np.zeros_like(live)
    dup[1:] = (sk[1:] == sk[:-1]) & (sk[1:] != big)
    keep = np.empty_like(live)
    np.put_along_axis(keep, order, ~dup, axis=0)
    return columns, live & keep


def decompress(compressed, columns, live, colours, out_shape, in_shape, dtype) -> Struct:
    """The block whose entry `(r, e)` is `compressed[r, colour of its column]`."""
    rows = math.prod(out_shape)
    flat = jnp.reshape(compressed, (rows, -1))
    idx = colours[columns].T  # (rows, entries)
    val = jnp.take_along_axis(flat, jnp.asarray(idx), axis=1)
    val = jnp.where(live.T, val, 0).astype(dtype)
    E = columns.shape[0]
    val = jnp.reshape(val, tuple(out_shape) + (E,))
    out_labels = [fresh_label() for _ in out_shape]
    in_labels = [fresh_label() for _ in in_shape]
    return simplify(
        Struct.build(
            val,
            out_labels + [BAND],
            out_labels,
            in_labels,
            tuple(out_shape),
            tuple(in_shape),
            Ell(
                columns.reshape((E,) + tuple(out_shape)),
                live.reshape((E,) + tuple(out_shape)),
                tuple(range(len(in_shape))),
            ),
        )
    )
