"""Row-compressed (`Ell`) blocks: their algebra, and what their static pattern says.

Every function here is exact. The pattern (`Ell.tmap`, `Ell.mask`) is NumPy, computed at
trace time; only `val` is traced, and work on it is slicing, padding, gathering with static
indices and elementwise arithmetic, never a product with a basis.
"""

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ._compat import is_tracer
from ._custom_types import common_dtype
from ._structure import (
    _plain_add,
    BAND,
    contract,
    Ell,
    expand,
    fresh_label,
    is_known,
    place,
    Struct,
)


# A pattern with more entries per row than this fraction of the in axes it points into is
# stored dense instead: past it, the pattern costs more than the numbers it saves.
DENSE_FRACTION = 0.5


def too_full(entries: int, n_group: int) -> bool:
    return entries > 1 and entries > DENSE_FRACTION * n_group


# ---- NumPy or JAX -----------------------------------------------------------------------


def _xp(*arrays):
    return np if all(is_known(a) for a in arrays) else jnp


def eval_known(fn, *args):
    """`fn(*args)` evaluated at trace time on known (NumPy) arguments, as NumPy."""
    with jax.ensure_compile_time_eval():
        out = fn(*args)
    return jax.tree_util.tree_map(np.asarray, out)


def apply_known_or_traced(fn, arr, *args):
    """`fn(arr, *args)`, at trace time (a NumPy result) when `arr` is NumPy."""
    if is_known(arr):
        with jax.ensure_compile_time_eval():
            out = fn(arr, *args)
        return out if is_known(out) or is_tracer(out) else np.asarray(out)
    return fn(arr, *args)


# ---- common forms -----------------------------------------------------------------------


def _categories(b: Struct) -> list[str]:
    """Per in axis: "G" (in the `Ell`), "T" (a delta), "D" (dense in `val`), "B" (broadcast)."""
    cats = []
    for l, label in enumerate(b.in_labels):
        if b.ell is not None and l in b.ell.in_axes:
            cats.append("G")
        elif b.ell is None and label in b.out_labels:
            cats.append("T")
        elif label in b.val_labels:
            cats.append("D")
        else:
            cats.append("B")
    return cats


def common_form(blocks: Sequence[Struct], force_ell: bool = False) -> list[Struct]:
    """The blocks (same in shape) brought to one form: either all without an `Ell` with the
    same deltas (only if their out shapes agree and `force_ell` is false), or all with an
    `Ell` over the same in axes.

    An in axis that is dense in one block and a delta (or in an `Ell`) in another is either
    absorbed into the pattern of the dense ones (their entries multiplied by its size),
    where that keeps the pattern sparse, or made dense in all of them, as their sum would
    be."""
    blocks = [b.canonical() for b in blocks]
    n_in = len(blocks[0].in_shape)
    in_shape = blocks[0].in_shape
    while True:
        cats = [_categories(b) for b in blocks]
        conflict = [
            l
            for l in range(n_in)
            if any(c[l] in "TG" for c in cats) and any(c[l] in "DB" for c in cats)
        ]
        if not conflict:
            break
        grouped = {l for l in range(n_in) if any(c[l] in "TG" for c in cats)}
        n_group = math.prod(in_shape[l] for l in grouped)
        entries = []
        for b, c in zip(blocks, cats):
            S = 1 if b.ell is None else b.ell.S
            entries.append(S * math.prod(in_shape[l] for l in conflict if c[l] in "DB"))
        if not too_full(max(entries), n_group):
            blocks = [
                absorb_in_axes(b, [l for l in conflict if c[l] in "DB"]).canonical()
                for b, c in zip(blocks, cats)
            ]
            continue
        l = conflict[0]
        for i, c in enumerate(cats):
            if c[l] == "T":
                k = blocks[i].out_labels.index(blocks[i].in_labels[l])
                blocks[i] = blocks[i].untie_out(k)
            elif c[l] == "G":
                blocks[i] = ell_to_plain(blocks[i]).canonical()
    if not force_ell and all(b.ell is None for b in blocks):
        ties = blocks[0].ties
        if all(b.ties == ties and b.out_shape == blocks[0].out_shape for b in blocks):
            return blocks
    return [b.to_ell() for b in blocks]


def absorb_in_axes(b: Struct, axes: Sequence[int]) -> Struct:
    """The block with the dense (or broadcast) in axes `axes` moved into its `Ell`: each
    entry becomes one entry per element of those axes."""
    b = b.to_ell().canonical()
    if not axes:
        return b
    ell = b.ell
    axes = sorted(axes)
    labels = [b.in_labels[l] for l in axes]
    b = b.broadcast_labels([BAND]).canonical()
    val, val_labels = b.val, list(b.val_labels)
    sizes = b.sizes
    # Entry axis, then the absorbed axes (broadcast where `val` lacks them), merged.
    for label in labels:
        if label not in val_labels:
            val = expand(val, val_labels, val_labels + [label], sizes)
            val_labels.append(label)
    band_at = val_labels.index(BAND)
    moved = [val_labels.index(label) for label in labels]
    order = [a for a in range(len(val_labels)) if a not in moved]
    pos = order.index(band_at)
    order = order[: pos + 1] + moved + order[pos + 1 :]
    val = val.transpose(order)
    new_labels = [val_labels[a] for a in order]
    shape = val.shape
    n_absorbed = math.prod(shape[pos + 1 : pos + 1 + len(moved)])
    val = val.reshape(shape[:pos] + (shape[pos] * n_absorbed,) + shape[pos + 1 + len(moved) :])
    del new_labels[pos + 1 : pos + 1 + len(moved)]
    # The new pattern: flat index over the old group axes and the absorbed ones.
    new_axes = tuple(sorted(set(ell.in_axes) | set(axes)))
    old_shape = b.group_shape
    new_shape = tuple(b.in_shape[l] for l in new_axes)
    S = ell.S
    old = np.unravel_index(ell.tmap, old_shape) if old_shape else ()
    grid = np.indices(tuple(b.in_shape[l] for l in axes)).reshape(len(axes), -1)
    coords = []
    for l in new_axes:
        if l in ell.in_axes:
            c = old[ell.in_axes.index(l)]
            coords.append(np.broadcast_to(c[:, None], (S, grid.shape[1]) + c.shape[1:]))
        else:
            g = grid[axes.index(l)].reshape((1, -1) + (1,) * len(b.out_shape))
            coords.append(np.broadcast_to(g, (S, grid.shape[1]) + b.out_shape))
    tmap = np.ravel_multi_index(tuple(coords), new_shape).reshape((-1,) + b.out_shape)
    mask = np.broadcast_to(ell.full_mask()[:, None], (S, grid.shape[1]) + b.out_shape).reshape(
        (-1,) + b.out_shape
    )
    in_labels = list(b.in_labels)
    for l in axes:
        in_labels[l] = fresh_label()
    return simplify(
        Struct.build(
            val,
            new_labels,
            b.out_labels,
            in_labels,
            b.out_shape,
            b.in_shape,
            Ell(tmap, mask, new_axes),
        )
    )


def _band_val(b: Struct, labels: Sequence[int], traced=False):
    """`b.val` broadcast to carry `labels` (which include `BAND`), in that order."""
    return expand(b.val, b.val_labels, labels, b.sizes, traced)


def ell_concat_entries(blocks: Sequence[Struct]) -> Struct:
    """The sum of `Ell` blocks over the same in axes: their entries side by side."""
    labels = sorted({label for b in blocks for label in b.val_labels} | {BAND})
    dtype = common_dtype(*[b.val.dtype for b in blocks])
    traced = not all(is_known(b.val) for b in blocks)
    vals = [_band_val(b, labels, traced) for b in blocks]
    axis = labels.index(BAND)
    xp = _xp(*vals)
    val = xp.concatenate([v.astype(dtype) for v in vals], axis=axis)
    tmap = np.concatenate([b.ell.tmap for b in blocks])
    mask = np.concatenate([b.ell.full_mask() for b in blocks])
    b0 = blocks[0]
    return Struct.build(
        val,
        labels,
        b0.out_labels,
        b0.in_labels,
        b0.out_shape,
        b0.in_shape,
        Ell(tmap, mask, b0.ell.in_axes),
    )


def pad_entries(b: Struct, S: int) -> Struct:
    """An `Ell` block with masked-out entries appended up to `S` entries."""
    extra = S - b.ell.S
    if extra == 0:
        return b
    b = b.broadcast_labels([BAND])
    axis = b.val_labels.index(BAND)
    xp = _xp(b.val)
    pad = [(0, 0)] * b.val.ndim
    pad[axis] = (0, extra)
    val = xp.pad(b.val, pad)
    tpad = [(0, extra)] + [(0, 0)] * len(b.out_shape)
    tmap = np.pad(b.ell.tmap, tpad)
    mask = np.pad(b.ell.full_mask(), tpad)
    return Struct.build(
        val,
        b.val_labels,
        b.out_labels,
        b.in_labels,
        b.out_shape,
        b.in_shape,
        Ell(tmap, mask, b.ell.in_axes),
    )


def stack_rows(blocks: Sequence[Struct]):
    """The rows (flattened out positions) of `Ell` blocks over the same in axes, one block
    after the other, with a common number of entries `S` and a common set of dense in axes.

    **Returns:** `(val, tmap, mask, dense_axes)`: `val` of shape `(rows, S) + dense shape`,
    `tmap` and `mask` of shape `(S, rows)`, `dense_axes` the in axes `val` carries after
    the entry axis."""
    S = max(b.ell.S for b in blocks)
    blocks = [pad_entries(b.canonical(), S) for b in blocks]
    dense_axes = sorted(
        {l for b in blocks for l, label in enumerate(b.in_labels) if label in b.val_labels}
    )
    in_shape = blocks[0].in_shape
    dtype = common_dtype(*[b.val.dtype for b in blocks])
    traced = not all(is_known(b.val) for b in blocks)
    vals, tmaps, masks = [], [], []
    for b in blocks:
        labels = list(b.out_labels) + [BAND] + [b.in_labels[l] for l in dense_axes]
        v = expand(b.val, b.val_labels, labels, b.sizes, traced).astype(dtype)
        rows = math.prod(b.out_shape)
        vals.append(v.reshape((rows, S) + tuple(in_shape[l] for l in dense_axes)))
        tmaps.append(b.ell.tmap.reshape(S, rows))
        masks.append(b.ell.full_mask().reshape(S, rows))
    xp = _xp(*vals)
    val = vals[0] if len(vals) == 1 else xp.concatenate(vals)
    return val, np.concatenate(tmaps, axis=1), np.concatenate(masks, axis=1), dense_axes


# ---- simplification -----------------------------------------------------------------------


def _merge_entries(b: Struct, groups: list[list[int]]) -> Struct:
    """Merge the entries of each group into one (their targets agree wherever two of them
    are unmasked): `val`s summed where live, masks joined."""
    ell = b.ell
    mask = ell.full_mask()
    tmap = []
    new_mask = []
    for g in groups:
        t = ell.tmap[g[0]].copy()
        m = mask[g[0]].copy()
        for s in g[1:]:
            t = np.where(mask[s], ell.tmap[s], t)
            m = m | mask[s]
        tmap.append(t)
        new_mask.append(m)
    tmap = np.stack(tmap)
    new_mask = np.stack(new_mask)
    uneven = [g for g in groups if len(g) > 1 and any((mask[s] != mask[g[0]]).any() for s in g)]
    live = None
    if uneven:
        # Entries outside their mask hold anything: sum only where each is live. The
        # masks vary along few axes (a stacked species axis, a padded edge): `val` gains
        # only those.
        members = sorted({s for g in uneven for s in g})
        varying = [
            k
            for k in range(len(b.out_shape))
            if not (mask[members] == np.take(mask[members], [0], axis=1 + k)).all()
        ]
        b = b.broadcast_labels([b.out_labels[k] for k in varying] + [BAND]).canonical()
        small = mask
        for k in range(len(b.out_shape)):
            if k not in varying:
                small = np.take(small, [0], axis=1 + k)
        small = small.reshape((small.shape[0],) + tuple(b.out_shape[k] for k in varying))
        axis = b.val_labels.index(BAND)
        out_pos = [b.val_labels.index(b.out_labels[k]) for k in varying]
        live = _place_mask(small, axis, out_pos, b.val.ndim)
    if BAND in b.val_labels and _xp(b.val) is jnp and len(groups) > _UNROLLED_GROUPS:
        val = _merge_traced_entries(b.val, b.val_labels.index(BAND), groups, uneven, live)
        val_labels = b.val_labels
    elif BAND in b.val_labels:
        axis = b.val_labels.index(BAND)
        xp = _xp(b.val)
        pieces = []
        for g in groups:
            if len(g) == 1 and xp is jnp:
                piece = jax.lax.index_in_dim(b.val, g[0], axis=axis, keepdims=False)
            elif len(g) == 1:
                piece = xp.take(b.val, g[0], axis=axis)
            elif live is not None and g in uneven:
                piece = sum(
                    xp.where(
                        np.take(live, e, axis=axis),
                        jax.lax.index_in_dim(b.val, e, axis=axis, keepdims=False)
                        if xp is jnp
                        else np.take(b.val, e, axis=axis),
                        np.zeros((), b.val.dtype),
                    )
                    for e in g
                )
            elif xp is jnp:
                piece = sum(jax.lax.index_in_dim(b.val, e, axis=axis, keepdims=False) for e in g)
            else:
                piece = xp.take(b.val, np.asarray(g), axis=axis).sum(axis=axis)
            pieces.append(piece)
        val = xp.stack(pieces, axis=axis)
        val_labels = b.val_labels
    else:
        counts = np.asarray([len(g) for g in groups])
        if (counts == 1).all():
            val, val_labels = b.val, b.val_labels
        elif (counts == counts[0]).all():
            val, val_labels = b.val * np.asarray(counts[0], b.val.dtype), b.val_labels
        else:
            val_labels = b.val_labels + (BAND,)
            c = counts.astype(b.val.dtype).reshape((1,) * b.val.ndim + (len(groups),))
            val = b.val[..., None] * c
    return Struct.build(
        val,
        val_labels,
        b.out_labels,
        b.in_labels,
        b.out_shape,
        b.in_shape,
        Ell(tmap, new_mask, ell.in_axes),
    )


# Past this many merged entries, a traced `val` is merged by one gather and one sum rather
# than one slice (and one sum) per entry: the sum over the bodies of an N-body field folds
# thousands of entries, and the program grew by that many equations.
_UNROLLED_GROUPS = 16


def _merge_traced_entries(val, axis, groups, uneven, live):
    """`_merge_entries`' sums of the entries of each group of a traced `val` (entry axis
    `axis`), as one gather along that axis and one sum: the groups padded to the longest,
    the padding and (for the `uneven` groups) the entries outside their `live` mask
    selected out."""
    width = max(len(g) for g in groups)
    idx = np.zeros((len(groups), width), np.int32)
    for i, g in enumerate(groups):
        idx[i, : len(g)] = g
    lengths = np.asarray([len(g) for g in groups])
    taken = jnp.take(val, idx.reshape(-1), axis=axis, mode="clip")
    shape = val.shape[:axis] + (len(groups), width) + val.shape[axis + 1 :]

    def along_axis(flags):  # one flag per taken entry, laid out along `axis`
        return flags.reshape((1,) * axis + (-1,) + (1,) * (val.ndim - axis - 1))

    counted = np.arange(width)[None, :] < lengths[:, None]  # not padding
    if live is not None:
        uneven_at = {tuple(g) for g in uneven}
        masked = np.asarray([tuple(g) in uneven_at for g in groups])
        masked = np.repeat(masked[:, None], width, axis=1) & counted
        keep = np.take(live, idx.reshape(-1), axis=axis) | ~along_axis(masked.reshape(-1))
        keep = keep & along_axis(counted.reshape(-1))
        taken = jnp.where(keep, taken, jnp.zeros((), val.dtype))
    elif not counted.all():
        taken = jnp.where(along_axis(counted.reshape(-1)), taken, jnp.zeros((), val.dtype))
    return taken.reshape(shape).sum(axis=axis + 1)


def _place_mask(mask, axis, out_pos, ndim):
    """An `Ell` mask (entry axis first, then out axes) laid out like a `val` whose entry
    axis is at `axis` and out axes at `out_pos`, size one elsewhere."""
    src = [axis] + list(out_pos)
    order = sorted(range(len(src)), key=lambda i: src[i])
    arr = np.transpose(mask, order)
    shape = [1] * ndim
    for i in order:
        shape[src[i]] = mask.shape[i]
    return arr.reshape(shape)


_GREEDY_WORK = 2**24


def _entry_groups(ell: Ell) -> list[list[int]]:
    """Groups of entries that can be merged: exact duplicates, then (greedily) entries whose
    masks leave them never pointing at different targets in the same row. Entries masked
    out everywhere are dropped (an empty list if all are)."""
    mask = ell.full_mask()
    S = ell.S
    flat_t = ell.tmap.reshape(S, -1)
    flat_m = mask.reshape(S, -1)
    live = [s for s in range(S) if flat_m[s].any()]
    if not live:
        return []
    groups: dict[bytes, list[int]] = {}
    for s in live:
        key = np.where(flat_m[s], flat_t[s], -1).tobytes()
        groups.setdefault(key, []).append(s)
    groups = sorted(groups.values(), key=lambda g: g[0])
    full = [g for g in groups if flat_m[g[0]].all()]
    partial = [g for g in groups if not flat_m[g[0]].all()]
    merged: list[tuple[list[int], np.ndarray, np.ndarray]] = []
    if len(partial) ** 2 * flat_m.shape[1] > _GREEDY_WORK:
        # Many partial entries (a hub's row of a graph): the greedy merge costs their
        # number squared times the rows; `_compact_rows` merges them row by row instead.
        return sorted(full + partial, key=lambda g: g[0])
    for g in partial:
        t, m = flat_t[g[0]], flat_m[g[0]]
        for entry in merged:
            et, em = entry[1], entry[2]
            both = m & em
            if not (both & (t != et)).any():
                entry[0].extend(g)
                entry[1][:] = np.where(m, t, et)
                entry[2][:] = m | em
                break
        else:
            merged.append((list(g), t.copy(), m.copy()))
    out = full + [e[0] for e in merged]
    return sorted(out, key=lambda g: g[0])


# Up to this many entries per row, `_compact_rows` first compares them pairwise.
_PAIRWISE_ENTRIES = 8


def _some_row_full(ell: Ell) -> bool:
    """Whether some row has all its entries live and pointing at different targets, so
    that merging entries row by row cannot leave fewer (found in `S^2` passes over the
    pattern, where the merge sorts it: a pairwise difference of positions, `x[j] - x[i]`
    over every pair of bodies, is such a pattern of millions of rows)."""
    t = ell.tmap.reshape(ell.S, -1)
    rows = ell.full_mask().reshape(ell.S, -1).all(axis=0)
    for i in range(ell.S):
        for j in range(i + 1, ell.S):
            if not rows.any():
                return False
            rows = rows & (t[i] != t[j])
    return bool(rows.any())


def _compact_rows(b: Struct) -> Struct:
    """Row by row, merge the live entries that point at the same target, if that leaves
    fewer entries than whole-entry merging did (the entries of a stacked block that play
    different roles in different rows)."""
    ell = b.ell
    S = ell.S
    if S <= _PAIRWISE_ENTRIES and _some_row_full(ell):
        return b
    t = ell.tmap.reshape(S, -1).astype(np.int64)
    m = ell.full_mask().reshape(S, -1)
    big = np.iinfo(np.int64).max
    key = np.where(m, t, big)
    order = np.argsort(key, axis=0, kind="stable")
    sk = np.take_along_axis(key, order, axis=0)
    first = np.ones_like(sk, dtype=bool)
    first[1:] = sk[1:] != sk[:-1]
    first &= sk != big
    slot_sorted = np.cumsum(first, axis=0) - 1
    n_slots = int(slot_sorted.max(initial=0)) + 1 if first.any() else 1
    if n_slots >= S:
        return b
    slot = np.empty_like(slot_sorted)
    np.put_along_axis(slot, order, slot_sorted, axis=0)
    live = m
    P = t.shape[1]
    s_idx, p_idx = np.nonzero(live)
    new_t = np.zeros((n_slots, P), np.int32)
    new_m = np.zeros((n_slots, P), bool)
    new_t[slot[s_idx, p_idx], p_idx] = t[s_idx, p_idx]
    new_m[slot[s_idx, p_idx], p_idx] = True
    b = b.canonical()
    rest = [label for label in b.val_labels if label not in b.out_labels and label != BAND]
    # Entry axis first, as a canonical `val` holds it: no transposes in the program.
    labels = [BAND] + list(b.out_labels) + rest
    traced = not is_known(b.val)
    val = _band_val(b, labels, traced)
    rest_shape = val.shape[len(b.out_shape) + 1 :]
    val = val.reshape((S * P,) + rest_shape)
    dest = slot[s_idx, p_idx] * P + p_idx  # into `out` flattened, entry-major
    src = s_idx * P + p_idx
    shape = (n_slots * P,) + rest_shape
    if traced:
        out = gather_sum(val, src, dest, shape[0])
    else:
        out = np.zeros(shape, val.dtype)
        np.add.at(out, dest, val[src])
    out = out.reshape((n_slots,) + b.out_shape + rest_shape)
    return Struct.build(
        out,
        labels,
        b.out_labels,
        b.in_labels,
        b.out_shape,
        b.in_shape,
        Ell(
            new_t.reshape((n_slots,) + b.out_shape),
            new_m.reshape((n_slots,) + b.out_shape),
            ell.in_axes,
        ),
    )


def zero_block(b: Struct) -> Struct:
    """The zero block of `b`'s shapes, as an `Ell` with one masked-out entry."""
    tmap = np.zeros((1,) + b.out_shape, np.int32)
    return Struct(
        np.zeros((), b.val.dtype),
        (),
        b.out_labels,
        b.in_labels,
        b.out_shape,
        b.in_shape,
        Ell(tmap, np.zeros(tmap.shape, bool), b.ell.in_axes if b.ell is not None else ()),
    ).canonical()


def simplify(b: Struct) -> Struct:
    """An equivalent block with fewer `Ell` entries: duplicates merged, entries that are
    never live dropped, dense when the entries cover most of the in axes, and back to
    deltas when the pattern is one."""
    if b.ell is None:
        return b
    b = b.canonical()
    groups = _entry_groups(b.ell)
    if not groups:
        return zero_block(b)
    if len(groups) != b.ell.S or any(len(g) > 1 for g in groups):
        b = _merge_entries(b, groups)
    if b.ell.S > 1:
        b = _compact_rows(b)
    n_group = math.prod(b.group_shape)
    if too_full(b.ell.S, n_group) and mostly_live(b.ell, n_group):
        return ell_to_plain(b)
    return as_deltas(compress(b))


def mostly_live(ell: Ell, n_group: int) -> bool:
    """Whether the live entries of `ell` fill more than `DENSE_FRACTION` of a dense block
    over its in axes. A pattern as wide as its in axes because of a few long rows (a hub
    joined to every node of a graph) is not: it stays row-compressed, so that the operator
    stores its nonzeros only (CSR), not the dense block."""
    rows = math.prod(ell.tmap.shape[1:])
    live = ell.tmap.size if ell.mask is None else int(np.count_nonzero(ell.mask))
    return live > DENSE_FRACTION * rows * n_group


def compress(b: Struct) -> Struct:
    """A block whose known `val` is constant along some of its axes, without those axes
    (so that it stays small, and small in the program it ends up in)."""
    if not is_known(b.val) or b.val.ndim == 0:
        return b
    val, labels = np.asarray(b.val), list(b.val_labels)
    for a in reversed(range(val.ndim)):
        if val.shape[a] > 1 and (val == np.take(val, [0], axis=a)).all():
            val = np.take(val, 0, axis=a)
            del labels[a]
    if len(labels) == len(b.val_labels):
        return b
    return Struct.build(val, labels, b.out_labels, b.in_labels, b.out_shape, b.in_shape, b.ell)


def as_deltas(b: Struct) -> Struct:
    """The block without its `Ell` if the `Ell` is a set of deltas (one live entry per out
    position, each in axis following one out axis); otherwise `b` itself."""
    ell = b.ell
    if ell is None or ell.S != 1 or ell.mask is not None:
        return b
    gshape = b.group_shape
    coords = np.unravel_index(ell.tmap[0], gshape) if gshape else ()
    used = set()
    tie = {}
    for j, l in enumerate(ell.in_axes):
        c = coords[j]
        for k, n in enumerate(b.out_shape):
            if k in used or n != b.in_shape[l]:
                continue
            shape = [1] * len(b.out_shape)
            shape[k] = n
            if np.array_equal(c, np.broadcast_to(np.arange(n).reshape(shape), c.shape)):
                tie[l] = k
                used.add(k)
                break
        else:
            return b
    in_labels = list(b.in_labels)
    for l, k in tie.items():
        in_labels[l] = b.out_labels[k]
    val, val_labels = b.val, list(b.val_labels)
    if BAND in val_labels:
        a = val_labels.index(BAND)
        val = val.reshape(val.shape[:a] + val.shape[a + 1 :])
        del val_labels[a]
    return Struct.build(val, val_labels, b.out_labels, in_labels, b.out_shape, b.in_shape)


# ---- conversions ----------------------------------------------------------------------------


def _rows_by_scatter(val, cols, live, size: int):
    """`out[r, cols[r, s]] += val[r, s]` over the live slots `s` of each row `r`, for the
    traced `val` of shape `(rows, S, *rest)` and the static `cols` and `live` (`None`: all
    live) of shape `(rows, S)`: one scatter-add, the cheapest way on a CPU or a GPU."""
    n_rows, S = cols.shape
    rows = np.broadcast_to(np.arange(n_rows)[:, None], (n_rows, S))
    if live is None:
        rows, cols = rows.reshape(-1), cols.reshape(-1)
        val = val.reshape((n_rows * S,) + val.shape[2:])
    else:
        rows, cols, val = rows[live], cols[live], val[np.nonzero(live)]
    return jnp.zeros((n_rows, size) + val.shape[1:], val.dtype).at[rows, cols].add(val)


def _rows_by_selects(val, cols, live, size: int):
    """As `_rows_by_scatter`, as a sum over the slots of selects: `out[r, t]` is the sum
    of `val[r, s]` over the live slots with `cols[r, s] == t`, a comparison with an iota
    that XLA fuses with the sum into one pass. `S` times the work of writing `out`, and no
    scatter, which a TPU runs at about 16 ns per entry: there (v5e, 2026-12-06)
    `materialise` of `eqx.nn.Conv2d(3, 8, 3, padding=1)` on a 3 x 16 x 16 input (27
    slots, 2048 x 768) takes 0.18 ms instead of 0.88, of a 5 x 5 one with 8 channels (200
    slots, 2048 x 2048) 1.3 ms instead of 6.9. Exact, as the scatter: each entry is its
    slots' values added to zeros (a value off its column, even a NaN, is selected away,
    not multiplied by 0)."""
    n_rows, S = cols.shape
    rest = val.shape[2:]
    dead = np.zeros((n_rows, S), bool) if live is None else ~live
    cols = jnp.asarray(np.where(dead, -1, cols).astype(np.int32))
    target = jax.lax.broadcasted_iota(jnp.int32, (n_rows, S, size), 2)
    hit = (cols[:, :, None] == target).reshape((n_rows, S, size) + (1,) * len(rest))
    picked = jnp.where(hit, val[:, :, None], jnp.zeros((), val.dtype))
    return jnp.sum(picked, axis=1)


# A TPU's select costs about 1.5 ps per output entry and slot (measured by the 200-slot
# case of `_rows_by_selects`), its scatter about 16 ns per entry written: the selects pay
# while they do at most about 10^4 times the scatter's entries. With a margin of 2.5: a
# pattern with a few long rows (a hub of a graph), whose slots are mostly dead, keeps the
# scatter, where the selects would cost the output's size times the longest row.
_SELECTS_PER_ENTRY = 4096


def _selects_pay(slots: tuple[int, int], size: int, live: int, dtype) -> bool:
    """Whether `_rows_by_selects` (work `rows * S * size`) is the cheaper way to a dense
    block on a TPU than the scatter of its `live` entries.

    Only for dtypes of at most 32 bits (complex64, never tried with the selects on a TPU,
    keeps the scatter too): a TPU's compiler emulates 64-bit floats, and aborts the
    process on these selects in float64 (v5e, jax 0.10.2, 2026-12-06: "Check failed:
    return_shape->IsTuple() Invalid index {0} for shape pred[...]" in
    `HloReplicationAnalysis`, from `materialise` of `jnp.sum(jnp.roll(y, 1) * y)` in
    forward mode; the scatter compiles and is exact)."""
    n_rows, S = slots
    small = jnp.dtype(dtype).itemsize <= 4
    return small and n_rows * S * size <= _SELECTS_PER_ENTRY * max(live, 1)


def _ell_to_plain(b: Struct) -> Struct:
    b = b.canonical()
    ell = b.ell
    n_out = len(b.out_shape)
    gshape = b.group_shape
    n_group = math.prod(gshape)
    rest = [label for label in b.val_labels if label not in b.out_labels and label != BAND]
    labels = list(b.out_labels) + [BAND] + rest
    sizes = b.sizes
    val = _band_val(b, labels)
    n_rows = math.prod(b.out_shape)
    rest_shape = tuple(sizes[label] for label in rest)
    S = ell.S
    val = val.reshape((n_rows, S) + rest_shape)
    cols = np.moveaxis(ell.tmap, 0, -1).reshape(n_rows, S)
    live = None if ell.mask is None else np.moveaxis(ell.mask, 0, -1).reshape(n_rows, S)
    shape = (n_rows, n_group) + rest_shape
    if is_known(val):
        dense = np.zeros(shape, val.dtype)
        rows = np.broadcast_to(np.arange(n_rows)[:, None], (n_rows, S))
        keep = np.ones((n_rows, S), bool) if live is None else live
        np.add.at(dense, (rows[keep], cols[keep]), val[keep])
    elif _selects_pay(
        cols.shape, n_group, n_rows * S if live is None else int(live.sum()), val.dtype
    ):
        dense = jax.lax.platform_dependent(
            val,
            tpu=lambda v: _rows_by_selects(v, cols, live, n_group),
            default=lambda v: _rows_by_scatter(v, cols, live, n_group),
        )
    else:
        dense = _rows_by_scatter(val, cols, live, n_group)
    dense = dense.reshape(b.out_shape + gshape + rest_shape)
    group_labels = [b.in_labels[l] for l in ell.in_axes]
    val_labels = list(b.out_labels) + group_labels + rest
    del n_out
    return Struct.build(dense, val_labels, b.out_labels, b.in_labels, b.out_shape, b.in_shape)


def compressed_diagonal(values, columns, live=None):
    """The main diagonal of a square row-compressed matrix: `values` of shape `(rows, E)`,
    NumPy `columns` (and `live`, default all) of shape `(E, rows)`. O(rows x E): the one
    place the diagonal of a sparse pattern is read, by `_sparsity.diagonal`,
    `SparseLinearOperator.diagonal` and the Jacobi preconditioner of
    `StructuredLinearSolver`."""
    rows = values.shape[0]
    hit = np.asarray(columns).T == np.arange(rows)[:, None]
    if live is not None:
        hit = hit & np.asarray(live).T
    return jnp.where(hit, jnp.asarray(values), 0).sum(axis=1)


def _ell_diagonal(b: Struct):
    """`J[o, o]` of a canonical `Ell` block with equal out and in shapes."""
    values, columns, live = flat_entries(b)
    return compressed_diagonal(values, columns, live).reshape(b.out_shape)


def _ell_transpose(b: Struct) -> Struct:
    """The transposed block, row-compressed again (entries regrouped at trace time)."""
    b = b.canonical()
    ell = b.ell
    n_out = len(b.out_shape)
    out_rows = math.prod(b.out_shape)
    gshape = b.group_shape
    n_group = math.prod(gshape)
    S = ell.S
    flat_t = np.moveaxis(ell.tmap, 0, -1).reshape(out_rows * S)
    flat_m = np.moveaxis(ell.full_mask(), 0, -1).reshape(out_rows * S)
    live = np.flatnonzero(flat_m)
    targets = flat_t[live]
    order = np.argsort(targets, kind="stable")
    live, targets = live[order], targets[order]
    counts = np.bincount(targets, minlength=n_group)
    C = max(1, int(counts.max(initial=0)))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    pos = np.arange(len(live)) - starts[targets]
    src = np.zeros((n_group, C), np.int64)
    valid = np.zeros((n_group, C), bool)
    src[targets, pos] = live
    valid[targets, pos] = True
    rest = [label for label in b.val_labels if label not in b.out_labels and label != BAND]
    sizes = b.sizes
    rest_shape = tuple(sizes[label] for label in rest)
    val = _band_val(b, list(b.out_labels) + [BAND] + rest).reshape((out_rows * S,) + rest_shape)
    xp = _xp(val)
    gathered = xp.take(val, src.reshape(-1), axis=0).reshape((n_group, C) + rest_shape)
    vmask = valid.reshape((n_group, C) + (1,) * len(rest_shape))
    gathered = xp.where(vmask, gathered, xp.zeros((), gathered.dtype))
    # The transpose: out axes are b's in axes, in axes are b's out axes (all in the `Ell`).
    new_out_shape = b.in_shape
    group_labels = [fresh_label() for _ in ell.in_axes]
    new_out_labels = list(b.in_labels)
    for j, l in enumerate(ell.in_axes):
        new_out_labels[l] = group_labels[j]
    new_in_labels = [fresh_label() for _ in b.out_shape]
    val_t = gathered.reshape(gshape + (C,) + rest_shape)
    val_labels = group_labels + [BAND] + rest
    # tmap[c, i]: the flat out index of entry c of row i; constant along non-group axes.
    t = (src // S).reshape(gshape + (C,))
    v = valid.reshape(gshape + (C,))
    t = np.moveaxis(t, -1, 0)
    v = np.moveaxis(v, -1, 0)
    placed_shape = [C] + [1] * len(new_out_shape)
    for j, l in enumerate(ell.in_axes):
        placed_shape[1 + l] = gshape[j]
    t = np.broadcast_to(t.reshape(placed_shape), (C,) + new_out_shape)
    v = np.broadcast_to(v.reshape(placed_shape), (C,) + new_out_shape)
    del n_out
    out = Struct.build(
        val_t,
        val_labels,
        new_out_labels,
        new_in_labels,
        new_out_shape,
        b.out_shape,
        Ell(np.ascontiguousarray(t), np.ascontiguousarray(v), tuple(range(len(b.out_shape)))),
    )
    return simplify(out)


# ---- operations on the out side -----------------------------------------------------------


def map_out_axes(b: Struct, axes: Sequence[int], fn: Callable, out_shape: Sequence[int]) -> Struct:
    """Apply a data movement along the out axes `axes` of an `Ell` block: `fn(arr,
    positions, fill)` moves the given axes of `arr` (slice, pad, flip, ...; a position
    `None` is an axis `arr` does not have) and fills new positions with `fill`. Applied to
    the pattern (`tmap` fill zero, `mask` fill false) and to `val`."""
    assert b.ell is not None
    # `val` moves along the axes it varies on; along the others it is constant, and the
    # pattern's mask marks the new (filled) positions.
    positions = [
        b.val_labels.index(b.out_labels[k]) if b.out_labels[k] in b.val_labels else None
        for k in axes
    ]
    val = b.val
    if any(a is not None for a in positions):
        val = apply_known_or_traced(fn, b.val, positions, np.zeros((), b.val.dtype))
    tpos = [1 + k for k in axes]
    tmap = np.asarray(apply_known_or_traced(fn, b.ell.tmap, tpos, np.zeros((), np.int32)))
    mask = np.asarray(apply_known_or_traced(fn, b.ell.full_mask(), tpos, np.zeros((), bool)))
    return simplify(
        Struct.build(
            val,
            b.val_labels,
            b.out_labels,
            b.in_labels,
            tuple(out_shape),
            b.in_shape,
            Ell(tmap, mask, b.ell.in_axes),
        )
    )


def fold_out_axes(b: Struct, axes: Sequence[int]) -> Struct:
    """Sum an `Ell` block over the out axes `axes`: the entries of the summed rows become
    entries of the remaining row."""
    axes = sorted(axes)
    fold_labels = [b.out_labels[k] for k in axes]
    b = b.broadcast_labels(fold_labels + [BAND])
    val, val_labels = b.val, list(b.val_labels)
    # Move the folded labels right after BAND and merge them into it.
    band_at = val_labels.index(BAND)
    order = [a for a, label in enumerate(val_labels) if label not in fold_labels]
    band_pos = order.index(band_at)
    moved = [val_labels.index(label) for label in fold_labels]
    order = order[: band_pos + 1] + moved + order[band_pos + 1 :]
    val = val.transpose(order) if order != list(range(len(order))) else val
    new_labels = [val_labels[a] for a in order]
    shape = list(val.shape)
    merged = math.prod(shape[band_pos : band_pos + 1 + len(moved)])
    val = val.reshape(
        tuple(shape[:band_pos]) + (merged,) + tuple(shape[band_pos + 1 + len(moved) :])
    )
    new_labels = new_labels[: band_pos + 1] + new_labels[band_pos + 1 + len(moved) :]
    tpos = [1 + k for k in axes]
    rest = [a for a in range(1 + len(b.out_shape)) if a not in tpos and a != 0]
    tmap = np.transpose(b.ell.tmap, [0] + tpos + rest)
    mask = np.transpose(b.ell.full_mask(), [0] + tpos + rest)
    keep_shape = tuple(b.out_shape[k] for k in range(len(b.out_shape)) if k not in axes)
    tmap = tmap.reshape((-1,) + keep_shape)
    mask = mask.reshape((-1,) + keep_shape)
    out_labels = [label for k, label in enumerate(b.out_labels) if k not in axes]
    return simplify(
        Struct.build(
            val,
            new_labels,
            out_labels,
            b.in_labels,
            keep_shape,
            b.in_shape,
            Ell(tmap, mask, b.ell.in_axes),
        )
    )


def gather_rows(blocks: Sequence[Struct], src, valid, out_shape) -> Struct:
    """A block whose row `o` holds, for each `c`, the entries of row `src[c, o]` of the rows
    of `blocks` (their out positions, flattened and stacked in order; see `stack_rows`),
    or nothing where `valid[c, o]` is false: a gather (one `c`) or a sum of gathers (several)
    with indices known at trace time. `src` and `valid` are NumPy, of shape
    `(C,) + out_shape`; the `blocks` must have an `Ell` over the same in axes."""
    if len(blocks) == 1 and not set(blocks[0].out_labels) & set(blocks[0].val_labels):
        return _gather_pattern(blocks[0], src, valid, out_shape)
    val, tmap, mask, dense_axes = stack_rows(blocks)
    b0 = blocks[0].canonical()
    S = tmap.shape[0]
    out_shape = tuple(out_shape)
    C = src.shape[0]
    ok = valid.reshape(C, -1)
    s = np.where(ok, src.reshape(C, -1), 0)
    n_new = s.shape[1]
    rest_shape = val.shape[2:]
    # Entry (c, e) of new row o: entry e of old row s[c, o].
    new_tmap = np.transpose(tmap[:, s], (1, 0, 2)).reshape((C * S,) + out_shape)
    new_mask = np.transpose(mask[:, s] & ok[None], (1, 0, 2)).reshape((C * S,) + out_shape)
    xp = _xp(val)
    g = xp.take(val, s.reshape(-1), axis=0).reshape((C, n_new, S) + rest_shape)
    okv = ok.reshape((C, n_new) + (1,) * (1 + len(rest_shape)))
    g = xp.where(okv, g, xp.zeros((), g.dtype))
    g = xp.moveaxis(g, 0, 1).reshape(out_shape + (C * S,) + rest_shape)
    out_labels = [fresh_label() for _ in out_shape]
    in_labels = [fresh_label() for _ in b0.in_shape]
    val_labels = out_labels + [BAND] + [in_labels[l] for l in dense_axes]
    return simplify(
        Struct.build(
            g,
            val_labels,
            out_labels,
            in_labels,
            out_shape,
            b0.in_shape,
            Ell(new_tmap, new_mask, b0.ell.in_axes),
        )
    )


def _gather_pattern(b: Struct, src, valid, out_shape) -> Struct:
    """`gather_rows` of one block whose `val` is constant along its out axes: only the
    pattern moves."""
    b = b.canonical()
    S = b.ell.S
    C = src.shape[0]
    out_shape = tuple(out_shape)
    ok = valid.reshape(C, -1)
    s = np.where(ok, src.reshape(C, -1), 0)
    tmap = b.ell.tmap.reshape(S, -1)
    mask = b.ell.full_mask().reshape(S, -1)
    new_tmap = np.transpose(tmap[:, s], (1, 0, 2)).reshape((C * S,) + out_shape)
    new_mask = np.transpose(mask[:, s] & ok[None], (1, 0, 2)).reshape((C * S,) + out_shape)
    val, val_labels = b.val, list(b.val_labels)
    if C > 1:  # entry (c, e) holds entry e's value
        if BAND in val_labels:
            a = val_labels.index(BAND)
            val = _xp(val).concatenate([val] * C, axis=a)
    out_labels = [fresh_label() for _ in out_shape]
    return simplify(
        Struct.build(
            val,
            val_labels,
            out_labels,
            b.in_labels,
            out_shape,
            b.in_shape,
            Ell(new_tmap, new_mask, b.ell.in_axes),
        )
    )


# ---- what a pattern is ------------------------------------------------------------------


def _plural(n: int, word: str, words: str) -> str:
    return f"{n} {word if n == 1 else words}"


def _structured_wording(b: Struct) -> str:
    """A block with neither a pattern nor the form of a diagonal or a dense block: out axes
    tied to in axes (zero off their diagonal), axes along which it is constant."""
    parts = []
    if b.ties:
        parts.append(f"zero off the diagonal of {_plural(len(b.ties), 'axis pair', 'axis pairs')}")
    constant = [
        label
        for label in {*b.out_labels, *b.in_labels}
        if label not in b.val_labels and not (label in b.out_labels and label in b.in_labels)
    ]
    if constant:
        parts.append(f"constant along {_plural(len(constant), 'axis', 'axes')}")
    return "structured: " + ", ".join(parts) if parts else "structured"


def describe(b: Struct) -> str:
    """ "identity", "diagonal", "dense 4 x 4", "block-diagonal 1000 x 3 x 3", "banded,
    offsets -1..1", "sparse, 5 entries per row", "sparse (CSR), 1 to 80 entries per row",
    with the numbers stored against a dense block's: for an `Ell` block, those of the
    operator `sparse_operator` builds from it (`storage_plan`), otherwise those of `val`."""
    dense = math.prod(b.out_shape) * math.prod(b.in_shape)
    stored = b.stored_size()
    if b.ell is None:
        kind = b.kind()
        if kind == "dense":
            kind = f"dense {' x '.join(map(str, b.out_shape + b.in_shape)) or 'scalar'}"
        elif kind == "structured":
            kind = _structured_wording(b)
        text = kind.replace("_", " ")
    else:
        columns, live = flat_pattern(b)
        vector = len(b.in_shape) == 1 and b.in_shape == b.out_shape
        plan = storage_plan(columns, live, math.prod(b.in_shape), tridiagonal=vector)
        text = plan.describe(math.prod(b.out_shape), columns.shape[0])
        stored = plan.stored
    return f"{text}: {stored:,} {'number' if stored == 1 else 'numbers'} stored, dense {dense:,}"


# ---- conforming to a joined structure -----------------------------------------------------


def conform_val(b: Struct, t: Struct):
    """`b`'s values written in the structure of `t` (a join of structures that include
    `b`'s, as the branches of a `cond` or the iterations of a loop need): an array shaped
    like `t.val`."""
    t = t.canonical()
    b2, t2 = common_form([b, t])
    assert t2.structure_key() == t.structure_key(), "the template must include the block"
    b2 = b2.canonical()
    if t.ell is None:
        assert b2.ell is None and b2.ties == t.ties
        return expand(b2.val, b2.val_labels, t.val_labels, t.sizes, traced=True)
    out_labels = list(t.out_labels)
    rest = [label for label in t.val_labels if label not in out_labels and label != BAND]
    n_rows = math.prod(t.out_shape)
    sizes = t.sizes
    rest_shape = tuple(sizes[label] for label in rest)
    bsizes = b2.sizes
    val_b = expand(b2.val, b2.val_labels, out_labels + [BAND] + rest, bsizes, traced=True)
    Sb, St = b2.ell.S, t.ell.S
    val_b = val_b.reshape((n_rows, Sb) + rest_shape)
    tt = t.ell.tmap.reshape(St, n_rows)
    tm = t.ell.full_mask().reshape(St, n_rows)
    bt = b2.ell.tmap.reshape(Sb, n_rows)
    bm = b2.ell.full_mask().reshape(Sb, n_rows)
    rows, cols, srcs = [], [], []
    for s in range(Sb):
        match = tm & (tt == bt[s][None])
        live = bm[s]
        assert match[:, live].any(axis=0).all(), "an entry has no place in the template"
        slot = np.argmax(match, axis=0)
        p = np.flatnonzero(live)
        rows.append(p)
        cols.append(slot[p])
        srcs.append(p * Sb + s)
    rows, cols, srcs = np.concatenate(rows), np.concatenate(cols), np.concatenate(srcs)
    flat_b = val_b.reshape((n_rows * Sb,) + rest_shape)
    dtype = t.val.dtype
    if is_known(flat_b):
        out = np.zeros((n_rows, St) + rest_shape, dtype)
        np.add.at(out, (rows, cols), flat_b[srcs].astype(dtype))
    else:
        out = (
            jnp.zeros((n_rows, St) + rest_shape, dtype)
            .at[rows, cols]
            .add(jnp.take(flat_b, srcs, axis=0).astype(dtype))
        )
    out = out.reshape(t.out_shape + (St,) + rest_shape)
    return place(out, out_labels + [BAND] + rest, t.val_labels)


# ---- as a matrix --------------------------------------------------------------------------


def flat_pattern(b: Struct):
    """The static pattern of an `Ell` block as a row-compressed matrix of its flattened out
    and in sides: NumPy `(columns, live)` of shape `(E, rows)`, entry `e` of row `r` in
    column `columns[e, r]`, part of the matrix where `live[e, r]`."""
    b = b.canonical()
    ell = b.ell
    rest = [l for l in range(len(b.in_shape)) if l not in ell.in_axes]
    rows = math.prod(b.out_shape)
    rest_shape = tuple(b.in_shape[l] for l in rest)
    n_rest = math.prod(rest_shape)
    S = ell.S
    gshape = b.group_shape
    group = np.unravel_index(ell.tmap.reshape(S, rows), gshape) if gshape else ()
    rest_idx = np.unravel_index(np.arange(n_rest), rest_shape) if rest_shape else ()
    coords = [None] * len(b.in_shape)
    for j, l in enumerate(ell.in_axes):
        coords[l] = np.broadcast_to(group[j][:, None, :], (S, n_rest, rows))
    for j, l in enumerate(rest):
        coords[l] = np.broadcast_to(rest_idx[j][None, :, None], (S, n_rest, rows))
    if b.in_shape:
        columns = np.ravel_multi_index(tuple(coords), b.in_shape)
    else:
        columns = np.zeros((S, n_rest, rows), np.int64)
    columns = columns.reshape(S * n_rest, rows)
    live = np.broadcast_to(ell.full_mask().reshape(S, 1, rows), (S, n_rest, rows)).reshape(
        S * n_rest, rows
    )
    return columns, live


def flat_entries(b: Struct, entries_first: bool = False, masked: bool = True):
    """An `Ell` block as a row-compressed matrix of its flattened out and in sides.

    **Arguments:**

    - `b`: an `Ell` block.
    - `entries_first`: lay `values` out as `(E, rows)`, the layout a canonical `val` has
        (no transpose in the program), rather than `(rows, E)`.
    - `masked`: zero the entries that are not live. A caller that reads live entries only
        (the operators' layouts) passes `False`: the select is a pass over every slot,
        with a constant mask as large as the block.

    **Returns:** `(values, columns, live)`: `values` of shape `(rows, E)` (zero where not
    live, with `masked`; `(E, rows)` with `entries_first`), NumPy `columns` and `live` of
    shape `(E, rows)`, as `flat_pattern` gives them."""
    b = b.canonical()
    ell = b.ell
    rest = [l for l in range(len(b.in_shape)) if l not in ell.in_axes]
    rest_labels = [b.in_labels[l] for l in rest]
    if entries_first:
        labels = [BAND] + list(b.out_labels) + rest_labels
    else:
        labels = list(b.out_labels) + [BAND] + rest_labels
    val = _band_val(b, labels)
    columns, live = flat_pattern(b)
    if entries_first:
        # (S, rows, rest) to (S, rest, rows): the order of `flat_pattern`'s entries.
        rows = math.prod(b.out_shape)
        val = val.reshape((ell.S, rows, -1))
        if val.shape[2] > 1:
            val = _xp(val).swapaxes(val, 1, 2)
        val = val.reshape(columns.shape)
        mask = live
    else:
        val = val.reshape(columns.shape[::-1])
        mask = live.T
    if masked and not live.all():
        val = _xp(val).where(mask, val, np.zeros((), val.dtype))
    return val, columns, live


# ---- how an operator stores a pattern -------------------------------------------------------

# No storage may hold more than this many numbers per distinct nonzero of the pattern:
# past it, the rows are compressed (CSR), one number per nonzero.
STORAGE_FACTOR = 2


@dataclasses.dataclass(frozen=True)
class Storage:
    """How `sparse_operator` stores a row-compressed block, decided from its static pattern
    alone (by `storage_plan`), so that `structure_report` and the operator agree.

    - `kind`: `"zero"`, `"block-diagonal"`, `"tridiagonal"`, `"banded"`, `"ellpack"` or
      `"csr"`;
    - `stored`: the numbers the operator's arrays hold;
    - `nnz`: the distinct (row, column) pairs of the pattern;
    - `block`: the block size (block-diagonal); `offsets`: the diagonals (banded);
      `row_lengths`: the fewest and most entries of a row (CSR).
    """

    kind: str
    stored: int
    nnz: int
    block: int = 0
    offsets: tuple[int, ...] = ()
    row_lengths: tuple[int, int] = (0, 0)

    def describe(self, rows: int, entries: int) -> str:
        if self.kind == "zero":
            return "zero"
        if self.kind == "block-diagonal":
            k = self.block
            return f"block-diagonal {rows // k} x {k} x {k}"
        if self.kind in ("tridiagonal", "banded"):
            return f"banded, offsets {min(self.offsets)}..{max(self.offsets)}"
        if self.kind == "ellpack":
            return f"sparse, {_plural(entries, 'entry', 'entries')} per row"
        lo, hi = self.row_lengths
        return f"sparse (CSR), {lo} to {hi} entries per row"


def _block_size(rows, cols, n) -> int | None:
    for k in range(1, n):
        if n % k == 0 and (rows // k == cols // k).all():
            return k
    return None


def storage_plan(columns, live, n_in: int, tridiagonal: bool) -> Storage:
    """The storage of the row-compressed matrix with the static pattern `columns`, `live`
    (of shape `(E, rows)`, as `flat_pattern` gives them) acting on `n_in` elements: the
    first of block-diagonal (blocks of at most 256), tridiagonal (`tridiagonal`: when the
    operator maps vectors to vectors of the same shape), banded (the diagonals used, for a
    band of at most `4 sqrt(n)`) and ELLPACK that holds at most `STORAGE_FACTOR` numbers per
    distinct nonzero; otherwise CSR, one number per nonzero."""
    E, m = columns.shape
    live_t = np.asarray(live).T
    rows = np.broadcast_to(np.arange(m)[:, None], (m, E))[live_t]
    cols = np.asarray(columns).T[live_t].astype(np.int64)
    keys = np.unique(rows * np.int64(max(n_in, 1)) + cols)
    nnz = len(keys)
    if nnz == 0:
        return Storage("zero", 0, 0)
    budget = STORAGE_FACTOR * nnz
    if m == n_in and m > 1:
        k = _block_size(rows, cols, m)
        if k is not None and k <= 256 and m * k <= budget:
            return Storage("block-diagonal", m * k, nnz, block=k)
        off = cols - rows
        width = int(max(-off.min(), off.max(), 0))
        if width <= 4 * math.isqrt(m) and width < m // 2:
            # Only the diagonals the pattern uses: a 2D stencil on a grid of rows of
            # length r has five, at offsets 0, +-1 and +-r, not the 2r + 1 of its band.
            offsets = tuple(int(d) for d in np.unique(off))
            if tridiagonal and set(offsets) <= {-1, 0, 1} and 3 * m - 2 <= budget:
                return Storage("tridiagonal", 3 * m - 2, nnz, offsets=offsets)
            if len(offsets) * m <= budget:
                return Storage("banded", len(offsets) * m, nnz, offsets=offsets)
    if m * E <= budget:
        return Storage("ellpack", m * E, nnz)
    lengths = np.bincount(keys // max(n_in, 1), minlength=m)
    return Storage("csr", nnz, nnz, row_lengths=(int(lengths.min()), int(lengths.max())))


# ---- the block algebra over every storage -------------------------------------------------
#
# `Struct` (in `_structure`) knows its plain forms: deltas, broadcasts, dense axes. What
# needs a row-compressed pattern's algebra as well lives here, above it, so that the layering
# is one-directional: `_structure` imports nothing of this module.


def ell_to_plain(b: Struct) -> Struct:
    """The same block without an `Ell`: the in axes the `Ell` points into become dense
    axes of `val`. Exact; costs what a dense block costs."""
    return b if b.ell is None else _ell_to_plain(b)


def transpose(b: Struct) -> Struct:
    """The block of the transposed map: out and in swapped. Free without an `Ell`; an
    `Ell` is transposed at trace time.

    **Arguments:**

    - `b`: a [`Struct`][diffrax_linearize.internal.Struct] block.

    **Returns:** the block of the transposed map, whose out side is `b`'s in side.
    """
    if b.ell is not None:
        return _ell_transpose(b)
    return Struct(
        b.val, b.val_labels, b.in_labels, b.out_labels, b.in_shape, b.out_shape
    ).canonical()


def reshape_in(b: Struct, in_shape) -> Struct:
    """The block with its in side reshaped to `in_shape` (row-major, as `jnp.reshape`):
    `val` reshaped where the in axes are dense; otherwise every in axis is moved into the
    pattern, whose flat index over all of them is the same for any shape.

    **Arguments:**

    - `b`: a [`Struct`][diffrax_linearize.internal.Struct] block.
    - `in_shape`: the new in shape, of the same size.

    **Returns:** the same map, with in shape `in_shape`.
    """
    in_shape = tuple(in_shape)
    if in_shape == b.in_shape:
        return b
    assert math.prod(in_shape) == math.prod(b.in_shape)
    n_out, n_in = len(b.out_shape), len(b.in_shape)
    new_labels = tuple(range(n_out, n_out + len(in_shape)))
    if b.ell is None and not b.ties:
        b = b.broadcast_labels(b.in_labels).canonical()
        val = b.val.reshape(b.val.shape[: len(b.val_labels) - n_in] + in_shape)
        return Struct.build(
            val,
            b.val_labels[: len(b.val_labels) - n_in] + new_labels,
            b.out_labels,
            new_labels,
            b.out_shape,
            in_shape,
        )
    b = b.to_ell().canonical()
    rest = [l for l in range(n_in) if l not in b.ell.in_axes]
    if rest:
        b = absorb_in_axes(b, rest).canonical()
    assert b.ell.in_axes == tuple(range(n_in)), b.ell.in_axes
    return Struct.build(
        b.val,
        b.val_labels,
        b.out_labels,
        new_labels,
        b.out_shape,
        in_shape,
        Ell(b.ell.tmap, b.ell.mask, tuple(range(len(in_shape)))),
    )


def to_dense(b: Struct):
    """The block as a plain array of shape `out_shape + in_shape`.

    Built from `val` by broadcasting and selecting along the deltas: no `dot_general`.
    Off a delta an entry is `0 * v`, `v` the value of its row, not `0`: `jax.jacfwd`
    multiplies a derivative by the zeros of its identity basis, so a NaN or infinite
    derivative makes its whole row NaN, and so does this (a product with an identity
    would not: XLA rewrites it as a select). Where the block is already dense this is
    a transpose at most.

    **Arguments:**

    - `b`: a [`Struct`][diffrax_linearize.internal.Struct] block.

    **Returns:** an array of shape `b.out_shape + b.in_shape`.
    """
    b = ell_to_plain(b)
    sizes = b.sizes
    in_labels = list(b.in_labels)
    deltas = []
    for l, label in enumerate(in_labels):
        if label in b.out_labels:
            new = fresh_label()
            sizes[new] = sizes[label]
            in_labels[l] = new
            deltas.append((label, new))
    target = tuple(b.out_labels) + tuple(in_labels)
    val = expand(jnp.asarray(b.val, dtype=b.dtype), b.val_labels, target, sizes)
    if not deltas:
        return val
    on = None
    for label, new in deltas:
        eye = place(jnp.eye(sizes[label], dtype=bool), (label, new), target)
        on = eye if on is None else on & eye
    return jnp.where(on, val, jnp.zeros((), val.dtype) * val)


def diagonal(b: Struct):
    """The diagonal `J[o, o]` of a block whose out and in shapes are equal, as an array
    of that shape, in O(stored numbers): free for a block that is a delta along every
    axis (identity, scaled identity, diagonal); the diagonals of `val` along the axes
    that are not deltas (block-diagonal blocks); read off the pattern for an `Ell`.
    Only a block whose deltas pair different axes (a transpose) is made dense.

    **Arguments:**

    - `b`: a [`Struct`][diffrax_linearize.internal.Struct] block with equal out and in
        shapes.

    **Returns:** an array of shape `b.out_shape`.
    """
    assert b.out_shape == b.in_shape
    c = b.canonical()
    if c.ell is not None:
        return _ell_diagonal(c)
    if all(k == l for k, l in c.ties.items()):
        # In axis `l` is relabelled as out axis `l`: einsum reads `val`'s diagonals.
        rename = {label: c.out_labels[l] for l, label in enumerate(c.in_labels)}
        labels = tuple(rename.get(label, label) for label in c.val_labels)
        sizes = c.sizes
        val, got = contract([(c.val, labels)], c.out_labels, sizes)
        diag = expand(jnp.asarray(val, c.dtype), got, c.out_labels, sizes)
        return jnp.asarray(diag, c.dtype)
    n = math.prod(b.out_shape)
    dense = to_dense(b).reshape(n, n)
    return jnp.diagonal(dense).reshape(b.out_shape)


def gather_sum(val, src, dest, size: int):
    """`zeros(size).at[dest].add(val[src])` along the first axis of the traced `val`, as
    gathers: the first source of each destination gathered into place (zero where none),
    the further ones (duplicates, few) added by a sorted scatter. A scatter-add of every
    entry is several times slower on a CPU.

    **Arguments:**

    - `val`: a traced array.
    - `src`, `dest`: NumPy integer arrays of the same length, into the first axes of `val`
        and of the result.
    - `size`: the length of the result's first axis.

    **Returns:** a traced array of shape `(size,) + val.shape[1:]`.
    """
    order = np.lexsort((np.arange(len(dest)), dest))
    dest, src = np.asarray(dest)[order], np.asarray(src)[order]
    first = np.ones(len(dest), bool)
    first[1:] = dest[1:] != dest[:-1]
    pos = np.full(size, -1, np.int64)
    pos[dest[first]] = src[first]
    empty = pos < 0
    if empty.all():
        out = jnp.zeros((size,) + val.shape[1:], val.dtype)
    else:
        out = jnp.take(val, np.where(empty, 0, pos).astype(np.int32), axis=0, mode="clip")
        if empty.any():
            shape = (size,) + (1,) * (val.ndim - 1)
            out = jnp.where(empty.reshape(shape), np.zeros((), val.dtype), out)
    if not first.all():
        extra = jnp.take(val, src[~first].astype(np.int32), axis=0, mode="clip")
        out = out.at[dest[~first].astype(np.int32)].add(
            extra, indices_are_sorted=True, mode="promise_in_bounds"
        )
    return out


def add(a: Struct, b: Struct) -> Struct:
    """The sum of two blocks of the same shapes, keeping the structure they share.

    **Arguments:**

    - `a`, `b`: [`Struct`][diffrax_linearize.internal.Struct] blocks of the same out and
        in shapes.

    **Returns:** the block of the sum of their maps.
    """
    assert a.out_shape == b.out_shape and a.in_shape == b.in_shape
    a, b = common_form([a, b])
    if a.ell is None:
        return _plain_add(a, b)
    return simplify(ell_concat_entries([a, b]))
