"""Structure rules, one per primitive (or family of primitives), for the interpreter in
`_interpreter.py`. Every rule is exact; where a rule cannot keep the structure of an axis it
makes that axis dense (`Struct.densify_out`), never wrong, only slower.

Data movement along an axis that is a delta (a slice, pad, reversal, concatenation, a gather
with indices known at trace time) keeps the structure as a row-compressed pattern (an
`Ell`, see `_structure.py`), computed at trace time with NumPy."""

import itertools
import math

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np

from ._compat import bind_eqn, is_tracer, prim
from ._interpreter import (
    call_jaxpr,
    Context,
    dense_fallback,
    interpret,
    known,
    Lin,
    map_columns,
    register_rule,
)
from ._sparsity import (
    add,
    apply_known_or_traced,
    common_form,
    conform_val,
    ell_to_plain,
    eval_known,
    fold_out_axes,
    gather_rows,
    map_out_axes,
    simplify,
    to_dense,
    too_full,
)
from ._structure import BAND, contract, Ell, fresh_label, is_known, is_unit, place, Struct


# ---- helpers --------------------------------------------------------------------------


def _out_aval(eqn, k=0):
    return eqn.outvars[k].aval


def _lin_positions(vals):
    return [i for i, x in enumerate(vals) if isinstance(x, Lin)]


def _single_linear(vals):
    """The position of the only linear input, or `None` if there are several."""
    pos = _lin_positions(vals)
    return pos[0] if len(pos) == 1 else None


def _has_pattern(x: Lin) -> bool:
    """Whether some block of `x` has deltas or an `Ell`: structure that data movement can
    keep as a pattern."""
    return any(b.ell is not None or b.ties for b in x.blocks.values())


def _cast(block: Struct, dtype) -> Struct:
    if jnp.issubdtype(block.dtype, jnp.complexfloating) and not jnp.issubdtype(
        dtype, jnp.complexfloating
    ):
        block = block.map_val(lambda v: v.real)
    return block.astype(dtype)


def _blockwise(fn):
    """Lift `fn(block, eqn, vals, pos) -> block` acting on the one linear input to a rule."""

    def rule(ctx, eqn, vals):
        pos = _single_linear(vals)
        if pos is None:
            return NotImplemented
        x = vals[pos]
        aval = _out_aval(eqn)
        blocks = {p: _cast(fn(b, eqn, vals, pos), aval.dtype) for p, b in x.blocks.items()}
        return [Lin(blocks, aval.shape, aval.dtype)]

    return rule


def _with_ell(b: Struct, tmap=None, mask=None) -> Ell | None:
    """`b`'s `Ell` with a new `tmap` and `mask` (`None` if `b` has none)."""
    if b.ell is None:
        return None
    return Ell(tmap, mask, b.ell.in_axes)


def _forget_size_one(val, val_labels: list, label, in_labels):
    """Drop a size-one out axis's `label` from `val` (in place on `val_labels`), unless the
    in side still carries it. Returns the new `val`."""
    if label in val_labels and label not in in_labels:
        a = val_labels.index(label)
        val = val.reshape(val.shape[:a] + val.shape[a + 1 :])
        del val_labels[a]
    return val


def _broadcast_pattern(arr, shape, broadcast_dimensions):
    """`lax.broadcast_in_dim` of a pattern array (leading entry axis) on NumPy."""
    new = [arr.shape[0]] + [1] * len(shape)
    for j, k in enumerate(broadcast_dimensions):
        new[1 + k] = arr.shape[1 + j]
    return np.broadcast_to(arr.reshape(new), (arr.shape[0],) + tuple(shape))


def _broadcast_block(block: Struct, shape, broadcast_dimensions) -> Struct:
    """`lax.broadcast_in_dim` on the out side of a block."""
    out_labels = [None] * len(shape)
    val, val_labels = block.val, list(block.val_labels)
    for j, k in enumerate(broadcast_dimensions):
        label = block.out_labels[j]
        if block.out_shape[j] == shape[k]:
            out_labels[k] = label
        else:  # a size-one axis expanded: the block is constant along the new axis
            out_labels[k] = fresh_label()
            val = _forget_size_one(val, val_labels, label, block.in_labels)
    for k in range(len(shape)):
        if out_labels[k] is None:
            out_labels[k] = fresh_label()
    ell = None
    if block.ell is not None:
        ell = _with_ell(
            block,
            _broadcast_pattern(block.ell.tmap, shape, broadcast_dimensions),
            _broadcast_pattern(block.ell.full_mask(), shape, broadcast_dimensions),
        )
    return Struct.build(val, val_labels, out_labels, block.in_labels, shape, block.in_shape, ell)


def _to_shape(x: Lin, shape) -> Lin:
    """Broadcast a linear operand of a binary op to the op's `shape`: binary ops accept
    rank-zero operands, and operands with size-one axes."""
    shape = tuple(shape)
    if tuple(x.shape) == shape:
        return x
    dims = () if x.shape == () else tuple(range(len(shape)))
    blocks = {p: _broadcast_block(b, shape, dims) for p, b in x.blocks.items()}
    return Lin(blocks, shape, x.dtype)


def _const_labels(c, block: Struct):
    """Labels for a constant operand `c` of an elementwise op whose output is the block's
    out side; size-one axes of `c` that broadcast are dropped. Returns `(c, labels)`."""
    if c.ndim == 0:
        return c, ()
    assert c.ndim == len(block.out_shape)
    drop = [k for k in range(c.ndim) if c.shape[k] == 1 and block.out_shape[k] != 1]
    if drop:
        c = c.reshape(tuple(d for k, d in enumerate(c.shape) if k not in drop))
    return c, tuple(label for k, label in enumerate(block.out_labels) if k not in drop)


def _const_array(c):
    if isinstance(c, jax.Array) and c.size == 1 and not is_tracer(c):
        # A scalar the linearisation keeps as a concrete array (the `2e-5` of
        # `2e-5 * lap(u)`): as a NumPy one, a product with a block known at trace time
        # stays known (see `split_of`).
        return np.asarray(c)
    return c if isinstance(c, np.ndarray) or hasattr(c, "shape") else np.asarray(c)


def _scale(block: Struct, c, combine=None) -> Struct:
    """`c * block` for a constant `c` of the block's out shape (or a scalar)."""
    c, c_labels = _const_labels(_const_array(c), block)
    if combine is None:
        keep = tuple(block.val_labels) + tuple(
            label for label in c_labels if label not in block.val_labels
        )
        val, labels = contract([(block.val, block.val_labels), (c, c_labels)], keep, block.sizes)
        return Struct.build(
            val,
            labels,
            block.out_labels,
            block.in_labels,
            block.out_shape,
            block.in_shape,
            block.ell,
        )
    # Division: place `c` against `val`'s labels, broadcasting `val` where needed.
    labels = tuple(block.val_labels) + tuple(
        label for label in c_labels if label not in block.val_labels
    )
    sizes = block.sizes
    v = place(block.val, block.val_labels, labels)
    cc = place(c, c_labels, labels)
    val = combine(v, cc)
    full = tuple(sizes[label] for label in labels)
    if tuple(val.shape) != full:
        val = jnp.broadcast_to(val, full)
    return Struct.build(
        val, labels, block.out_labels, block.in_labels, block.out_shape, block.in_shape, block.ell
    )


def _apply_along_out(ctx: Context, eqn, vals, positions=None, lost: str | None = None):
    """Apply the equation's primitive to the blocks' values, vectorised over their in-side
    axes. The equation must be linear in the inputs at `positions`. The out axes become
    dense; the in side keeps its structure where there is a single linear input.

    `lost` says why a rule that keeps structure in other cases could not here: a pattern
    (deltas, an `Ell`) made dense is then recorded in `ctx` with that reason, as the dense
    fallback is, so that `strict=True` and `structure_report` name it. Without `lost` the
    primitive is one whose result is dense anyway (a solve, an FFT)."""
    if positions is None:
        positions = _lin_positions(vals)
    if len(positions) != 1:
        return dense_fallback(ctx, eqn, vals, reason=lost or "several linear inputs")
    (pos,) = positions
    x = vals[pos]
    if lost is not None and _has_pattern(x):
        ctx.record(str(eqn.primitive), lost)
    aval = _out_aval(eqn)
    n_out = len(x.shape)
    blocks = {}
    for p, b in x.blocks.items():
        b = ell_to_plain(b).densify_out()
        in_side = [label for label in b.val_labels if label not in b.out_labels]
        order = list(b.out_labels) + in_side
        v = place(b.val, b.val_labels, order)
        v = jnp.asarray(v, dtype=x.dtype)
        flat = v.reshape(v.shape[:n_out] + (math.prod(v.shape[n_out:]),))
        in_axes = [None] * len(vals)
        in_axes[pos] = -1
        args = list(vals)
        args[pos] = flat
        res = map_columns(lambda *a: bind_eqn(eqn, a)[0], args, in_axes)
        sizes = b.sizes
        res = res.reshape(tuple(aval.shape) + tuple(sizes[label] for label in in_side))
        out_labels = [fresh_label() for _ in aval.shape]
        blocks[p] = Struct.build(
            res, out_labels + in_side, out_labels, b.in_labels, aval.shape, b.in_shape
        )
    return [Lin(blocks, aval.shape, aval.dtype)]


def _sum_lins(lins, shape, dtype) -> Lin:
    blocks: dict[int, Struct] = {}
    for x in lins:
        for p, b in x.blocks.items():
            b = _cast(b, dtype)
            blocks[p] = add(blocks[p], b).astype(dtype) if p in blocks else b
    return Lin(blocks, shape, dtype)


def _move_out(block: Struct, axes, fn, out_shape, pattern_known: bool = True) -> Struct:
    """Data movement `fn(arr, positions, fill)` along the out axes `axes` of a block (a
    slice, pad, reversal, ...), to the new `out_shape`. A delta on a moved axis becomes a
    row-compressed pattern, if the movement is known at trace time (`pattern_known`);
    otherwise that axis is made dense."""
    axes = list(axes)
    if not axes:
        return block
    tied = any(block.out_labels[k] in block.in_labels for k in axes)
    if pattern_known and (block.ell is not None or tied):
        return map_out_axes(block.to_ell(), axes, fn, out_shape)
    if not pattern_known:
        block = ell_to_plain(block)
    block = block.densify_out(axes).canonical()
    positions = [block.val_labels.index(block.out_labels[k]) for k in axes]
    val = apply_known_or_traced(fn, block.val, positions, np.zeros((), block.val.dtype))
    return Struct.build(
        val, block.val_labels, block.out_labels, block.in_labels, out_shape, block.in_shape
    )


def _permute_out(b: Struct, perm) -> Struct:
    """The block with its out axes permuted: new axis `k` is old axis `perm[k]`."""
    perm = list(perm)
    ell = None
    if b.ell is not None:
        tperm = [0] + [1 + k for k in perm]
        ell = _with_ell(b, b.ell.tmap.transpose(tperm), b.ell.full_mask().transpose(tperm))
    return Struct.build(
        b.val,
        b.val_labels,
        [b.out_labels[k] for k in perm],
        b.in_labels,
        [b.out_shape[k] for k in perm],
        b.in_shape,
        ell,
    )


# ---- elementwise linear maps of one input ---------------------------------------------


register_rule(prim("neg"), termwise=True, nan_faithful=True)(
    _blockwise(lambda b, eqn, vals, pos: b.map_val(lambda v: -v))
)
register_rule(prim("conj"))(_blockwise(lambda b, eqn, vals, pos: b.map_val(lambda v: v.conj())))
register_rule(prim("real"))(_blockwise(lambda b, eqn, vals, pos: b.map_val(lambda v: v.real)))
register_rule(prim("imag"))(_blockwise(lambda b, eqn, vals, pos: b.map_val(lambda v: v.imag)))
register_rule(prim("convert_element_type"), termwise=True, nan_faithful=True)(
    _blockwise(lambda b, eqn, vals, pos: b)
)


@register_rule(
    prim("copy"),
    prim("copy_p"),
    prim("sharding_constraint"),
    prim("device_put"),
    prim("optimization_barrier"),
    nan_faithful=True,
)
def _identity_rule(ctx, eqn, vals):
    if len(vals) != len(eqn.outvars):
        return NotImplemented
    return list(vals)


@register_rule(prim("reduce_precision"))
def _reduce_precision_rule(ctx, eqn, vals):
    (x,) = vals
    params = eqn.params

    def fn(v):
        if is_unit(v):
            return v
        return lax.reduce_precision(
            jnp.asarray(v),
            exponent_bits=params["exponent_bits"],
            mantissa_bits=params["mantissa_bits"],
        )

    return [Lin({p: b.map_val(fn) for p, b in x.blocks.items()}, x.shape, x.dtype)]


# ---- shape manipulation ---------------------------------------------------------------


@register_rule(prim("transpose"), termwise=True, nan_faithful=True)
@_blockwise
def _transpose_rule(b, eqn, vals, pos):
    return _permute_out(b, eqn.params["permutation"])


@register_rule(prim("broadcast_in_dim"), termwise=True, nan_faithful=True)
def _broadcast_in_dim_rule(ctx, eqn, vals):
    if len(vals) != 1:  # dynamic shapes
        return NotImplemented
    (x,) = vals
    shape, dims = eqn.params["shape"], eqn.params["broadcast_dimensions"]
    aval = _out_aval(eqn)
    blocks = {p: _broadcast_block(b, shape, dims) for p, b in x.blocks.items()}
    return [Lin(blocks, aval.shape, aval.dtype)]


def _drop_out_axes(b: Struct, axes) -> Struct:
    """Remove size-one out axes."""
    val, val_labels = b.val, list(b.val_labels)
    for k in axes:
        val = _forget_size_one(val, val_labels, b.out_labels[k], b.in_labels)
    keep = [k for k in range(len(b.out_shape)) if k not in axes]
    ell = None
    if b.ell is not None:
        squeeze = tuple(1 + k for k in axes)
        ell = _with_ell(
            b, np.squeeze(b.ell.tmap, axis=squeeze), np.squeeze(b.ell.full_mask(), axis=squeeze)
        )
    return Struct.build(
        val,
        val_labels,
        [b.out_labels[k] for k in keep],
        b.in_labels,
        [b.out_shape[k] for k in keep],
        b.in_shape,
        ell,
    )


@register_rule(prim("squeeze"), termwise=True, nan_faithful=True)
@_blockwise
def _squeeze_rule(b, eqn, vals, pos):
    axes = [d % len(b.out_shape) for d in eqn.params["dimensions"]]
    return _drop_out_axes(b, axes)


def _reshape_groups(old, new):
    """Split two shapes of equal size into aligned groups `(old_axes, new_axes)` of equal
    products, ignoring size-one axes (returned separately)."""
    old_ax = [i for i, d in enumerate(old) if d != 1]
    new_ax = [i for i, d in enumerate(new) if d != 1]
    groups = []
    i = j = 0
    while i < len(old_ax) or j < len(new_ax):
        go, gn = [old_ax[i]], [new_ax[j]]
        po, pn = old[old_ax[i]], new[new_ax[j]]
        i += 1
        j += 1
        while po != pn:
            if po < pn:
                go.append(old_ax[i])
                po *= old[old_ax[i]]
                i += 1
            else:
                gn.append(new_ax[j])
                pn *= new[new_ax[j]]
                j += 1
        groups.append((go, gn))
    return groups


def _reshape_block(b: Struct, new_shape) -> Struct:
    """A row-major reshape of the block's out side. Axes that really split or merge are
    made dense, or, where they carry a delta, kept as a row-compressed pattern."""
    old_shape = b.out_shape
    groups = _reshape_groups(old_shape, new_shape)
    merge_axes = [k for go, gn in groups if len(go) > 1 or len(gn) > 1 for k in go]
    if b.ell is not None or any(b.out_labels[k] in b.in_labels for k in merge_axes):
        b = b.to_ell()
    b = b.densify_out(merge_axes).canonical()
    ones_old = [k for k, d in enumerate(old_shape) if d == 1]
    val, val_labels = b.val, list(b.val_labels)
    new_labels = [None] * len(new_shape)
    # Build the new val: for merged groups, the group's val axes are consecutive
    # (canonical labels are ordered by out axis), so reshape them in place.
    for go, gn in reversed(groups):
        if len(go) == 1 and len(gn) == 1:
            new_labels[gn[0]] = b.out_labels[go[0]]
            continue
        first = val_labels.index(b.out_labels[go[0]])
        assert [val_labels[first + t] for t in range(len(go))] == [b.out_labels[k] for k in go]
        labels = [fresh_label() for _ in gn]
        val = val.reshape(
            val.shape[:first] + tuple(new_shape[k] for k in gn) + val.shape[first + len(go) :]
        )
        val_labels[first : first + len(go)] = labels
        for k, label in zip(gn, labels):
            new_labels[k] = label
    # Size-one axes: dropped from the old side, fresh on the new side.
    for k in ones_old:
        val = _forget_size_one(val, val_labels, b.out_labels[k], b.in_labels)
    for k, d in enumerate(new_shape):
        if new_labels[k] is None:
            new_labels[k] = fresh_label()
    ell = None
    if b.ell is not None:
        S = b.ell.S
        ell = _with_ell(
            b,
            b.ell.tmap.reshape((S,) + tuple(new_shape)),
            b.ell.full_mask().reshape((S,) + tuple(new_shape)),
        )
    out = Struct.build(val, val_labels, new_labels, b.in_labels, new_shape, b.in_shape, ell)
    return simplify(out)


@register_rule(prim("reshape"), nan_faithful=True)
def _reshape_rule(ctx, eqn, vals):
    if len(vals) != 1:
        return NotImplemented
    (x,) = vals
    aval = _out_aval(eqn)
    new_shape = tuple(aval.shape)
    if math.prod(x.shape) == 0:
        # An empty array (the width-0 side of `jnp.pad(..., mode="edge")`) has an empty
        # Jacobian: no blocks, which the rules read as zero.
        return [Lin({}, aval.shape, aval.dtype)]
    dims = eqn.params.get("dimensions")
    blocks = {}
    for p, b in x.blocks.items():
        if dims is not None:  # `lax.reshape(x, shape, dimensions)`: transpose, then reshape
            b = _permute_out(b, dims)
        blocks[p] = _reshape_block(b, new_shape)
    return [Lin(blocks, aval.shape, aval.dtype)]


# Data movement on an array of `val` or of a pattern: NumPy (at trace time) for known
# arrays, `lax` for traced ones. Each takes per moved axis a position (or `None`).


def _np_pad(v, fill, config):
    """`lax.pad` on NumPy: negative padding removes, interior padding interleaves."""
    for a, (lo, hi, interior) in enumerate(config):
        if interior:
            n = v.shape[a]
            shape = list(v.shape)
            shape[a] = n + max(n - 1, 0) * interior
            out = np.full(shape, fill, v.dtype)
            index = [slice(None)] * v.ndim
            index[a] = slice(None, None, interior + 1)
            out[tuple(index)] = v
            v = out
        if lo < 0 or hi < 0:
            index = [slice(None)] * v.ndim
            index[a] = slice(max(-lo, 0), v.shape[a] - max(-hi, 0))
            v = v[tuple(index)]
        if lo > 0 or hi > 0:
            widths = [(0, 0)] * v.ndim
            widths[a] = (max(lo, 0), max(hi, 0))
            v = np.pad(v, widths, constant_values=fill)
    return v


def _pad(v, fill, config):
    if is_known(v):
        return _np_pad(np.asarray(v), np.asarray(fill, v.dtype), config)
    return lax.pad(v, jnp.asarray(fill, v.dtype), config)


def _slice(v, start, limit, strides):
    if is_known(v):
        return v[tuple(slice(a, b, c) for a, b, c in zip(start, limit, strides))]
    return lax.slice(v, start, limit, strides)


def _concat(parts, axis):
    xp = np if all(is_known(p) for p in parts) else jnp
    return xp.concatenate(parts, axis=axis)


def _rev(v, positions, fill):
    axes = tuple(a for a in positions if a is not None)
    if not axes:
        return v
    return np.flip(v, axis=axes) if is_known(v) else jnp.flip(v, axis=axes)


@register_rule(prim("rev"))
@_blockwise
def _rev_rule(b, eqn, vals, pos):
    axes = list(eqn.params["dimensions"])
    return _move_out(b, axes, _rev, b.out_shape)


def _slice_fn(axes, start, limit, strides):
    def fn(v, positions, fill):
        s, li, st = [0] * v.ndim, list(v.shape), [1] * v.ndim
        for k, a in zip(axes, positions):
            if a is not None:
                s[a], li[a], st[a] = start[k], limit[k], strides[k]
        return _slice(v, s, li, st)

    return fn


@register_rule(prim("slice"))
@_blockwise
def _slice_rule(b, eqn, vals, pos):
    start, limit, strides = (
        eqn.params["start_indices"],
        eqn.params["limit_indices"],
        eqn.params["strides"],
    )
    strides = strides or (1,) * len(start)
    axes = [
        k for k in range(len(start)) if (start[k], limit[k], strides[k]) != (0, b.out_shape[k], 1)
    ]
    out_shape = _out_aval(eqn).shape
    return _move_out(b, axes, _slice_fn(axes, start, limit, strides), out_shape)


@register_rule(prim("dynamic_slice"))
def _dynamic_slice_rule(ctx, eqn, vals):
    if _lin_positions(vals) != [0]:
        return NotImplemented
    x, *starts = vals
    sizes = eqn.params["slice_sizes"]
    aval = _out_aval(eqn)
    axes = [k for k in range(len(sizes)) if sizes[k] != x.shape[k]]
    static = [known(s) for s in starts]
    if all(s is not None for s in static):
        # Known offsets: a slice (clamped into range, as `lax.dynamic_slice` does).
        begin = [int(min(max(int(s), 0), x.shape[k] - sizes[k])) for k, s in enumerate(static)]
        limit = [begin[k] + sizes[k] for k in range(len(sizes))]
        fn = _slice_fn(axes, begin, limit, [1] * len(sizes))
        blocks = {
            p: _cast(_move_out(b, axes, fn, aval.shape), aval.dtype) for p, b in x.blocks.items()
        }
        return [Lin(blocks, aval.shape, aval.dtype)]

    if axes and _has_pattern(x):
        ctx.record(str(eqn.primitive), "its start indices are not known at trace time")

    def slicer(moved):
        def fn(v, positions, fill):
            idx = [jnp.zeros_like(starts[0])] * v.ndim  # starts' int type
            sz = list(v.shape)
            for k, a in zip(moved, positions):
                if a is not None:
                    idx[a] = starts[k]
                    sz[a] = sizes[k]
            # The primitive's own semantics: a start out of range is clamped into it.
            # `lax.dynamic_slice` would first wrap a negative start around the end (as
            # NumPy indexing does), which `jnp` indexing has already done where it applies.
            return lax.dynamic_slice(v, idx, sz, allow_negative_indices=False)

        return fn

    blocks = {}
    for p, b in x.blocks.items():
        # A delta on a moved axis (`y[i]` of the identity, `i` traced, in a loop over
        # cells): its rows are one-hot at traced positions, built at the slice's size
        # rather than by slicing the whole identity.
        tied = [k for k in axes if b.ell is None and b.out_labels[k] in b.in_labels]
        for k in tied:
            b = _one_hot_rows(b, k, starts[k], sizes[k])
        rest = [k for k in axes if k not in tied]
        moved = _move_out(b, rest, slicer(rest), aval.shape, pattern_known=False)
        blocks[p] = _cast(moved, aval.dtype)
    return [Lin(blocks, aval.shape, aval.dtype)]


def _one_hot_rows(b: Struct, k: int, start, size: int) -> Struct:
    """`b` sliced along its out axis `k`, a delta, from the traced `start` (clamped into
    range, as `lax.dynamic_slice` does) for `size` rows: the delta becomes the rows of the
    identity at those positions, `size x n` numbers."""
    label = b.out_labels[k]
    n = b.out_shape[k]
    start = jnp.clip(start, 0, n - size)
    rows = start + jnp.arange(size, dtype=jnp.result_type(start))
    one_hot = (rows[:, None] == jnp.arange(n, dtype=rows.dtype)[None, :]).astype(b.dtype)
    new = fresh_label()
    sizes = {**b.sizes, new: size}
    keep = tuple(dict.fromkeys((*b.val_labels, new, label)))
    val, labels = contract([(b.val, b.val_labels), (one_hot, (new, label))], keep, sizes)
    out_labels = list(b.out_labels)
    out_labels[k] = new
    out_shape = list(b.out_shape)
    out_shape[k] = size
    return Struct.build(val, labels, out_labels, b.in_labels, tuple(out_shape), b.in_shape)


@register_rule(prim("pad"))
def _pad_rule(ctx, eqn, vals):
    if _lin_positions(vals) != [0]:
        return _data_movement(ctx, eqn, vals)  # a linear padding value
    x, _ = vals  # the padding value is a constant: its tangent is zero
    config = eqn.params["padding_config"]
    aval = _out_aval(eqn)
    axes = [k for k, c in enumerate(config) if tuple(c) != (0, 0, 0)]

    def fn(v, positions, fill):
        cfg = [(0, 0, 0)] * v.ndim
        for k, a in zip(axes, positions):
            if a is not None:
                cfg[a] = tuple(int(c) for c in config[k])
        return _pad(v, fill, cfg)

    blocks = {p: _cast(_move_out(b, axes, fn, aval.shape), aval.dtype) for p, b in x.blocks.items()}
    return [Lin(blocks, aval.shape, aval.dtype)]


@register_rule(prim("concatenate"))
def _concatenate_rule(ctx, eqn, vals):
    """Each linear part is padded into place along the axis; the sum of the parts keeps the
    structure they share (their patterns cover disjoint rows and merge)."""
    dim = eqn.params["dimension"]
    aval = _out_aval(eqn)
    total = aval.shape[dim]
    parts = []
    offset = 0
    for x in vals:
        size = x.shape[dim]
        if isinstance(x, Lin):

            def fn(v, positions, fill, offset=offset, size=size):
                if positions[0] is None:
                    return v
                cfg = [(0, 0, 0)] * v.ndim
                cfg[positions[0]] = (offset, total - offset - size, 0)
                return _pad(v, fill, cfg)

            blocks = {p: _move_out(b, [dim], fn, aval.shape) for p, b in x.blocks.items()}
            parts.append(Lin(blocks, aval.shape, aval.dtype))
        offset += size
    return [_sum_lins(parts, aval.shape, aval.dtype)]


@register_rule(prim("split"))
def _split_rule(ctx, eqn, vals):
    (x,) = vals
    axis = eqn.params["axis"]
    outs = []
    start = 0
    for v in eqn.outvars:
        size = v.aval.shape[axis]

        def fn(val, positions, fill, start=start, size=size):
            if positions[0] is None:
                return val
            begin, end = [0] * val.ndim, list(val.shape)
            begin[positions[0]], end[positions[0]] = start, start + size
            return _slice(val, begin, end, [1] * val.ndim)

        blocks = {
            p: _cast(_move_out(b, [axis], fn, v.aval.shape), v.aval.dtype)
            for p, b in x.blocks.items()
        }
        outs.append(Lin(blocks, v.aval.shape, v.aval.dtype))
        start += size
    return outs


@register_rule(prim("tile"))
def _tile_rule(ctx, eqn, vals):
    """`tile` repeats each tiled out axis: its values are concatenated `reps` times."""
    (x,) = vals
    reps = eqn.params["reps"]
    aval = _out_aval(eqn)
    axes = [k for k, r in enumerate(reps) if r != 1]

    def fn(v, positions, fill):
        for k, a in zip(axes, positions):
            if a is not None:
                v = _concat([v] * reps[k], axis=a)
        return v

    blocks = {p: _cast(_move_out(b, axes, fn, aval.shape), aval.dtype) for p, b in x.blocks.items()}
    return [Lin(blocks, aval.shape, aval.dtype)]


@register_rule(prim("reduce_sum"), termwise=True, nan_faithful=True)
@_blockwise
def _reduce_sum_rule(b, eqn, vals, pos):
    axes = sorted(eqn.params["axes"])
    if b.ell is not None:
        return fold_out_axes(b, axes)
    val, val_labels = b.val, list(b.val_labels)
    factor = 1
    for k in axes:
        label = b.out_labels[k]
        if label in b.in_labels:
            continue  # a delta summed over its out index leaves the in index
        if label in val_labels:
            a = val_labels.index(label)
            val = val.sum(axis=a)
            del val_labels[a]
        else:
            factor *= b.out_shape[k]
    if factor != 1:
        val = val * np.asarray(factor, dtype=b.dtype)
    summed = Struct(val, val_labels, b.out_labels, b.in_labels, b.out_shape, b.in_shape)
    return _drop_out_axes(summed, axes)


def _cumsum_block(b, eqn, vals, pos):
    axis, reverse = eqn.params["axis"], eqn.params["reverse"]
    b = ell_to_plain(b).densify_out([axis]).canonical()
    a = b.val_labels.index(b.out_labels[axis])
    return b.with_val(lax.cumsum(jnp.asarray(b.val), axis=a, reverse=reverse))


@register_rule(prim("cumsum"))
def _cumsum_rule(ctx, eqn, vals):
    (x,) = vals
    axis = eqn.params["axis"]
    if x.shape[axis] > 1 and any(
        b.ell is not None or b.out_labels[axis] in b.in_labels for b in x.blocks.values()
    ):
        ctx.record(
            str(eqn.primitive),
            "a cumulative sum along an axis that is a delta or a pattern is triangular: "
            "stored dense along that axis",
        )
    return _blockwise(_cumsum_block)(ctx, eqn, vals)


# ---- data movement with indices known at trace time -----------------------------------


def _codes(eqn, vals):
    """Which element of which floating input each output element of a data-movement
    equation is: the equation applied at trace time to position codes (one-based, zero for
    none), every integer input (indices, predicates) being known. Returns
    `(out_codes, offsets, sizes)` or `None` where an index is not known."""
    args = []
    offsets, sizes = {}, {}
    total = 0
    for i, (v, x) in enumerate(zip(eqn.invars, vals)):
        if jnp.issubdtype(v.aval.dtype, jnp.inexact):
            n = math.prod(v.aval.shape)
            if isinstance(x, Lin):
                offsets[i], sizes[i] = total, n
                args.append(
                    np.arange(total + 1, total + 1 + n, dtype=np.int32).reshape(v.aval.shape)
                )
                total += n
            else:
                args.append(np.zeros(v.aval.shape, np.int32))
        else:
            k = known(x)
            if k is None:
                return None
            args.append(k.astype(v.aval.dtype))
    if total >= np.iinfo(np.int32).max:
        return None
    outs = eval_known(lambda *a: bind_eqn(eqn, a), *args)
    return [np.asarray(o) for o in outs], offsets, sizes


def _data_movement(ctx, eqn, vals, codes=None):
    """The rule for an equation each of whose output elements is one element of one of its
    floating inputs, or zero (concatenate, pad, gather, scatter, dynamic_update_slice,
    select_n with a known predicate, ...), with indices known at trace time: the output's
    rows are gathered from the inputs' rows as a row-compressed pattern."""
    if codes is None:
        codes = _codes(eqn, vals)
    if codes is None:
        return NotImplemented
    out_codes, offsets, sizes = codes
    leaves = sorted({p for x in vals if isinstance(x, Lin) for p in x.blocks})
    results = []
    for k, v in enumerate(eqn.outvars):
        aval = v.aval
        c = out_codes[k]
        blocks = {}
        for p in leaves:
            # An empty operand (a zero-size update) has no rows to gather from.
            operands = [i for i in offsets if p in vals[i].blocks and sizes[i]]
            if not operands:
                continue
            # Global code - 1 -> row in the stacked rows of the operands holding leaf p.
            lookup = np.full(sum(sizes.values()) + 1, -1, np.int64)
            base = 0
            for i in operands:
                lookup[1 + offsets[i] : 1 + offsets[i] + sizes[i]] = np.arange(
                    base, base + sizes[i]
                )
                base += sizes[i]
            src = lookup[c][None]
            ok = src >= 0
            parts = common_form([vals[i].blocks[p] for i in operands], force_ell=True)
            blocks[p] = _cast(gather_rows(parts, src, ok, aval.shape), aval.dtype)
        results.append(Lin(blocks, aval.shape, aval.dtype))
    return results


@register_rule(prim("stack"))
def _stack_rule(ctx, eqn, vals):
    """`stack`: each part gains a size-one axis and is padded into place."""
    axis = eqn.params["axis"]
    aval = _out_aval(eqn)
    parts = []
    for j, x in enumerate(vals):
        if not isinstance(x, Lin):
            continue
        shape = x.shape[:axis] + (1,) + x.shape[axis:]
        dims = tuple(k for k in range(len(shape)) if k != axis)

        def fn(v, positions, fill, j=j):
            if positions[0] is None:
                return v
            cfg = [(0, 0, 0)] * v.ndim
            cfg[positions[0]] = (j, len(vals) - j - 1, 0)
            return _pad(v, fill, cfg)

        blocks = {
            p: _move_out(_broadcast_block(b, shape, dims), [axis], fn, aval.shape)
            for p, b in x.blocks.items()
        }
        parts.append(Lin(blocks, aval.shape, aval.dtype))
    return [_sum_lins(parts, aval.shape, aval.dtype)]


@register_rule(prim("unstack"))
def _unstack_rule(ctx, eqn, vals):
    (x,) = vals
    axis = eqn.params["axis"]
    outs = []
    for j, v in enumerate(eqn.outvars):
        start = [0] * len(x.shape)
        limit = list(x.shape)
        start[axis], limit[axis] = j, j + 1
        fn = _slice_fn([axis], start, limit, [1] * len(x.shape))
        shape = tuple(limit[k] - start[k] for k in range(len(x.shape)))
        blocks = {
            p: _cast(_drop_out_axes(_move_out(b, [axis], fn, shape), [axis]), v.aval.dtype)
            for p, b in x.blocks.items()
        }
        outs.append(Lin(blocks, v.aval.shape, v.aval.dtype))
    return outs


def _index_known(eqn, vals) -> bool:
    return all(
        known(x) is not None
        for v, x in zip(eqn.invars, vals)
        if not jnp.issubdtype(v.aval.dtype, jnp.inexact)
    )


@register_rule(prim("gather"), prim("dynamic_update_slice"), prim("scatter"))
def _gather_scatter_rule(ctx, eqn, vals):
    """Known indices keep the pattern of deltas and row-compressed blocks; otherwise (or for
    dense blocks) the primitive is applied along the out side."""
    if any(_has_pattern(x) for x in vals if isinstance(x, Lin)) and _index_known(eqn, vals):
        out = _data_movement(ctx, eqn, vals)
        if out is not NotImplemented:
            return out
    if str(eqn.primitive) in ("scatter", "scatter-add", "dynamic_update_slice"):
        return _write_dense(ctx, eqn, vals)
    return _apply_along_out(ctx, eqn, vals, lost=_index_reason(eqn, vals))


def _write_dense(ctx, eqn, vals):
    """A scatter (`.at[].set/add`) or `dynamic_update_slice` whose indices are not known at
    trace time (a loop over cells too long to unroll), its operand and updates dense: the
    primitive applied once, the in side as trailing window axes of both. `jax.vmap` over the
    in side would move it to the front, a transpose of the whole operand before and after:
    in a loop, one per iteration."""
    operand, updates = (
        (vals[0], vals[2])
        if str(eqn.primitive) != "dynamic_update_slice"
        else (
            vals[0],
            vals[1],
        )
    )
    lins = [x for x in (operand, updates) if isinstance(x, Lin)]
    if any(_has_pattern(x) for x in lins):
        ctx.record(str(eqn.primitive), _index_reason(eqn, vals))
    aval = _out_aval(eqn)
    dtype = aval.dtype
    blocks = {}
    for p in sorted({p for x in lins for p in x.blocks}):
        in_shape = next(x.blocks[p].in_shape for x in lins if p in x.blocks)
        n = math.prod(in_shape)

        def dense(x):
            if isinstance(x, Lin) and p in x.blocks:
                d = to_dense(x.blocks[p]).astype(dtype)
                return d.reshape(tuple(x.shape) + (n,))
            return jnp.zeros(tuple(jnp.shape(x)) + (n,), dtype)

        op, up = dense(operand), dense(updates)
        if str(eqn.primitive) == "dynamic_update_slice":
            starts = list(vals[2:])
            # Clamped as the primitive clamps (see `_dynamic_slice_rule`), not wrapped.
            res = lax.dynamic_update_slice(
                op, up, starts + [jnp.zeros_like(starts[0])], allow_negative_indices=False
            )
        else:
            dn = eqn.params["dimension_numbers"]
            params = dict(eqn.params)
            params["dimension_numbers"] = dn._replace(
                update_window_dims=tuple(dn.update_window_dims) + (up.ndim - 1,)
            )
            res = eqn.primitive.bind(op, vals[1], up, **params)
        blocks[p] = Struct.from_dense(res.reshape(tuple(aval.shape) + in_shape), len(aval.shape))
    return [Lin(blocks, aval.shape, dtype)]


def _index_reason(eqn, vals) -> str:
    """Why a data-movement equation's pattern is not known at trace time."""
    if _index_known(eqn, vals):
        return "too many elements for the pattern's int32 positions"
    return (
        "its indices are not known at trace time: they are computed from traced values "
        "(a data-dependent permutation or selection, as in `jnp.sort`, `lax.top_k` or "
        "`jnp.argsort`, or a traced offset)"
    )


def _scatter_destinations(eqn, indices, out_shape, updates_shape):
    """For `scatter-add(operand, indices, updates)`: the one-based flat output position each
    update element is added to (zero where it is dropped), from the gather that is its
    transpose, evaluated at trace time."""
    dn = eqn.params["dimension_numbers"]
    slice_sizes = []
    pos = 0
    batching = getattr(dn, "operand_batching_dims", ())
    for i in range(len(out_shape)):
        if i in dn.inserted_window_dims or i in batching:
            slice_sizes.append(1)
        else:
            slice_sizes.append(updates_shape[dn.update_window_dims[pos]])
            pos += 1
    gather_dn = lax.GatherDimensionNumbers(
        offset_dims=dn.update_window_dims,
        collapsed_slice_dims=dn.inserted_window_dims,
        start_index_map=dn.scatter_dims_to_operand_dims,
        operand_batching_dims=batching,
        start_indices_batching_dims=getattr(dn, "scatter_indices_batching_dims", ()),
    )
    codes = np.arange(1, math.prod(out_shape) + 1, dtype=np.int32).reshape(out_shape)
    return eval_known(
        lambda c, i: lax.gather(
            c,
            i,
            dimension_numbers=gather_dn,
            slice_sizes=tuple(slice_sizes),
            mode=eqn.params["mode"],
            fill_value=0,
        ),
        codes,
        indices,
    )


@register_rule(prim("scatter_add"), prim("scatter-add"))
def _scatter_add_rule(ctx, eqn, vals):
    """`scatter-add` with known indices: each output row gathers the operand's row and
    every update row added to it."""
    operand, indices, updates = vals
    idx = known(indices)
    lins = [x for x in (operand, updates) if isinstance(x, Lin)]
    if idx is None or not any(_has_pattern(x) for x in lins):
        return _write_dense(ctx, eqn, vals)
    aval = _out_aval(eqn)
    out_shape = tuple(aval.shape)
    upd_shape = tuple(eqn.invars[2].aval.shape)
    dest = _scatter_destinations(eqn, idx, out_shape, upd_shape).reshape(-1).astype(np.int64) - 1
    n_out = math.prod(out_shape)
    live = np.flatnonzero(dest >= 0)
    order = np.argsort(dest[live], kind="stable")
    live = live[order]
    targets = dest[live]
    counts = np.bincount(targets, minlength=n_out)
    C = int(counts.max(initial=0))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    pos = np.arange(len(live)) - starts[targets]
    leaves = sorted({p for x in lins for p in x.blocks})
    blocks = {}
    for p in leaves:
        parts = []
        base = 0
        rows = np.full((1 + C, n_out), -1, np.int64)
        if isinstance(operand, Lin) and p in operand.blocks:
            parts.append(operand.blocks[p])
            rows[0] = np.arange(n_out)
            base = n_out
        if isinstance(updates, Lin) and p in updates.blocks and C > 0:
            parts.append(updates.blocks[p])
            rows[1 + pos, targets] = base + live
        if not parts:
            # Only the updates depend on leaf p, and every one of them is dropped (out of
            # bounds under `mode="drop"`, the default of `.at[]` updates): a zero block.
            continue
        keep = (rows >= 0).any(axis=1)
        rows = rows[keep]
        parts = common_form(parts, force_ell=True)
        src = rows.reshape((-1,) + out_shape)
        blocks[p] = _cast(gather_rows(parts, src, src >= 0, out_shape), aval.dtype)
    return [Lin(blocks, aval.shape, aval.dtype)]


# ---- arithmetic -----------------------------------------------------------------------


@register_rule(prim("add"), prim("add_jaxvals"), prim("sub"), nan_faithful=True)
def _add_rule(ctx, eqn, vals):
    aval = _out_aval(eqn)
    terms = []
    for i, x in enumerate(vals):
        if not isinstance(x, Lin):
            continue  # a constant summand of a linear map is zero
        x = _to_shape(x, aval.shape)
        if eqn.primitive is prim("sub") and i == 1:
            x = Lin(
                {p: b.map_val(lambda v: -v) for p, b in x.blocks.items()},
                x.shape,
                x.dtype,
            )
        terms.append(x)
    return [_sum_lins(terms, aval.shape, aval.dtype)]


@register_rule(prim("mul"), termwise=True, nan_faithful=True)
def _mul_rule(ctx, eqn, vals):
    pos = _single_linear(vals)
    if pos is None:
        return NotImplemented  # a product of two linear values is not linear
    aval = _out_aval(eqn)
    x = _to_shape(vals[pos], aval.shape)
    # `mul` with `out_dtype` (or its transpose, with mixed inputs) casts both operands to
    # the output dtype first: so do we, never relying on implicit promotion.
    c = _in_dtype(_const_array(vals[1 - pos]), aval.dtype)
    blocks = {p: _scale(_cast(b, aval.dtype), c) for p, b in x.blocks.items()}
    return [Lin(blocks, aval.shape, aval.dtype)]


def _in_dtype(c, dtype):
    """The constant `c` cast to `dtype` (a complex one to its real part for a real dtype)."""
    if c.dtype == dtype:
        return c
    if jnp.issubdtype(c.dtype, jnp.complexfloating) and not jnp.issubdtype(
        dtype, jnp.complexfloating
    ):
        c = c.real
    return c.astype(dtype)


def _divide(v, c):
    """`v / c`; where both are NumPy arrays (known at trace time), without NumPy's warnings
    for a division by zero: its infinities and NaNs are IEEE's, as XLA's are."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return v / c


@register_rule(prim("div"), termwise=True, nan_faithful=True)
def _div_rule(ctx, eqn, vals):
    if _lin_positions(vals) != [0]:
        return NotImplemented
    aval = _out_aval(eqn)
    x = _to_shape(vals[0], aval.shape)
    c = vals[1]
    blocks = {p: _cast(_scale(b, c, combine=_divide), aval.dtype) for p, b in x.blocks.items()}
    return [Lin(blocks, aval.shape, aval.dtype)]


def _where(val, mask):
    if is_known(val) and is_known(mask):
        return np.where(mask, val, np.zeros((), val.dtype))
    return jnp.where(mask, val, jnp.zeros((), val.dtype))


@register_rule(prim("select_n"))
def _select_n_rule(ctx, eqn, vals):
    pred, *cases = vals
    if isinstance(pred, Lin):
        return NotImplemented
    aval = _out_aval(eqn)
    pred_known = known(pred)
    pred = _const_array(pred)
    terms = []
    for k, x in enumerate(cases):
        if not isinstance(x, Lin):
            continue
        x = _to_shape(x, aval.shape)
        if pred.dtype == np.bool_:
            mask = pred if k == 1 else jnp.logical_not(pred)
            sel = None if pred_known is None else (pred_known if k == 1 else ~pred_known)
        else:
            mask = pred == k
            sel = None if pred_known is None else pred_known == k
        if sel is not None:
            mask = np.asarray(sel)
        blocks = {}
        for p, b in x.blocks.items():
            # A select, not a product with the mask: a NaN or inf tangent in an entry that
            # is not selected (the masked self-term of a pairwise field) must not leak.
            b = _scale(b, mask, combine=_where)
            if b.ell is not None and sel is not None:
                live = b.ell.full_mask() & np.broadcast_to(sel, aval.shape)[None]
                b = simplify(
                    Struct.build(
                        b.val,
                        b.val_labels,
                        b.out_labels,
                        b.in_labels,
                        b.out_shape,
                        b.in_shape,
                        Ell(b.ell.tmap, live, b.ell.in_axes),
                    )
                )
            blocks[p] = b
        terms.append(Lin(blocks, x.shape, x.dtype))
    return [_sum_lins(terms, aval.shape, aval.dtype)]


@register_rule(prim("complex"))
def _complex_rule(ctx, eqn, vals):
    aval = _out_aval(eqn)
    terms = []
    for k, x in enumerate(vals):
        if not isinstance(x, Lin):
            continue
        x = _to_shape(x, aval.shape)
        factor = np.asarray(1j if k == 1 else 1, dtype=aval.dtype)
        blocks = {
            p: b.astype(aval.dtype).map_val(lambda v: v * factor) for p, b in x.blocks.items()
        }
        terms.append(Lin(blocks, x.shape, aval.dtype))
    return [_sum_lins(terms, aval.shape, aval.dtype)]


def _dot_block(b: Struct, a, lin_is_lhs: bool, dimension_numbers, out_shape, dtype, precision):
    (lc, rc), (lb, rb) = dimension_numbers
    xc, ac, xb, ab = (lc, rc, lb, rb) if lin_is_lhs else (rc, lc, rb, lb)
    if b.ell is not None:
        folded = b.ell.S * math.prod(b.out_shape[k] for k in xc)
        if too_full(folded, math.prod(b.group_shape)):
            b = ell_to_plain(b)  # the product is dense over the pattern's in axes
        else:
            return _dot_block_ell(b, a, lin_is_lhs, xc, ac, xb, ab, out_shape, dtype)
    sizes = b.sizes
    a_labels = [None] * a.ndim
    for xi, ai in zip(xc, ac):
        a_labels[ai] = b.out_labels[xi]
    for xi, ai in zip(xb, ab):
        a_labels[ai] = b.out_labels[xi]
    a_free = [i for i in range(a.ndim) if a_labels[i] is None]
    for i in a_free:
        a_labels[i] = fresh_label()
        sizes[a_labels[i]] = a.shape[i]
    x_free = [k for k in range(len(b.out_shape)) if k not in xc and k not in xb]
    batch = [b.out_labels[k] for k in xb]
    x_free_labels = [b.out_labels[k] for k in x_free]
    a_free_labels = [a_labels[i] for i in a_free]
    if lin_is_lhs:
        out_labels = batch + x_free_labels + a_free_labels
    else:
        out_labels = batch + a_free_labels + x_free_labels
    keep = out_labels + [label for label in b.in_labels if label not in out_labels]
    val, labels = contract([(b.val, b.val_labels), (a, tuple(a_labels))], keep, sizes)
    block = Struct.build(val, labels, out_labels, b.in_labels, out_shape, b.in_shape)
    return _cast(block, dtype)


def _dot_block_ell(b, a, lin_is_lhs, xc, ac, xb, ab, out_shape, dtype):
    """`dot_general` of a row-compressed block with a constant: the constant's free axes
    are appended as broadcast out axes, the block scaled by the constant, and the
    contracted out axes folded into the entries."""
    if xc and _uniform_along(b.ell, xc):
        return _dot_block_ell_uniform(b, a, lin_is_lhs, xc, ac, xb, ab, out_shape, dtype)
    n_x = len(b.out_shape)
    a_free = [i for i in range(a.ndim) if i not in ac and i not in ab]
    new_labels = [fresh_label() for _ in a_free]
    new_shape = tuple(a.shape[i] for i in a_free)
    # 1. Append the constant's free axes (the block is constant along them).
    shape = tuple(b.out_shape) + new_shape
    dims = tuple(range(n_x))
    tmap = _broadcast_pattern(b.ell.tmap, shape, dims)
    mask = _broadcast_pattern(b.ell.full_mask(), shape, dims)
    wide = Struct.build(
        b.val,
        b.val_labels,
        tuple(b.out_labels) + tuple(new_labels),
        b.in_labels,
        shape,
        b.in_shape,
        Ell(tmap, mask, b.ell.in_axes),
    )
    # 2. Scale by the constant, aligned by labels (contracted and batch axes are the
    # block's out axes; free axes the new ones).
    a_labels = [None] * a.ndim
    for xi, ai in zip(xc, ac):
        a_labels[ai] = wide.out_labels[xi]
    for xi, ai in zip(xb, ab):
        a_labels[ai] = wide.out_labels[xi]
    for i, label in zip(a_free, wide.out_labels[n_x:]):
        a_labels[i] = label
    keep = tuple(wide.val_labels) + tuple(
        label for label in a_labels if label not in wide.val_labels
    )
    val, labels = contract([(wide.val, wide.val_labels), (a, tuple(a_labels))], keep, wide.sizes)
    scaled = Struct.build(
        val, labels, wide.out_labels, wide.in_labels, wide.out_shape, wide.in_shape, wide.ell
    )
    # 3. Fold the contracted axes; 4. order the out axes as `dot_general` does.
    folded = fold_out_axes(scaled, list(xc)) if xc else scaled
    remaining = [k for k in range(len(shape)) if k not in xc]
    x_free = [k for k in range(n_x) if k not in xc and k not in xb]
    free_new = list(range(n_x, len(shape)))
    order = list(xb) + (x_free + free_new if lin_is_lhs else free_new + x_free)
    perm = [remaining.index(k) for k in order]
    out = _permute_out(folded, perm)
    assert out.out_shape == tuple(out_shape), (out.out_shape, out_shape)
    return _cast(simplify(out), dtype)


def _uniform_along(ell: Ell, axes) -> bool:
    """Whether the pattern's entries point at the same targets, live alike, all along the
    out axes `axes` (the hidden units of a per-cell layer, all reading the cell's inputs)."""
    for arr in (ell.tmap, ell.mask):
        if arr is None:
            continue
        for k in axes:
            if not (arr == np.take(arr, [0], axis=1 + k)).all():
                return False
    return True


def _dot_block_ell_uniform(b, a, lin_is_lhs, xc, ac, xb, ab, out_shape, dtype):
    """`_dot_block_ell` where the pattern does not vary along the contracted axes: their
    rows' entries coincide, so the contraction is one of `val` with the constant (a
    matrix product), and the pattern loses those axes. (Folding them into the entries
    would first form the product over every contracted row and every free axis of the
    constant, `S x rows x free` numbers: for a per-cell MLP, 16 times the result.)"""
    n_x = len(b.out_shape)
    a_free = [i for i in range(a.ndim) if i not in ac and i not in ab]
    new_labels = [fresh_label() for _ in a_free]
    new_shape = tuple(a.shape[i] for i in a_free)
    sizes = b.sizes
    sizes.update(zip(new_labels, new_shape))
    a_labels = [None] * a.ndim
    for xi, ai in zip(xc, ac):
        a_labels[ai] = b.out_labels[xi]
    for xi, ai in zip(xb, ab):
        a_labels[ai] = b.out_labels[xi]
    for i, label in zip(a_free, new_labels):
        a_labels[i] = label
    contracted = {b.out_labels[k] for k in xc}
    keep = [label for label in b.val_labels if label not in contracted]
    keep += [label for label in a_labels if label not in contracted and label not in keep]
    val, labels = contract([(b.val, b.val_labels), (a, tuple(a_labels))], keep, sizes)
    # The pattern at the first row of each contracted axis, with the constant's free axes
    # appended (the block is constant along them), then ordered as `dot_general` orders.
    remaining = [k for k in range(n_x) if k not in xc]
    at = (slice(None),) + tuple(0 if k in xc else slice(None) for k in range(n_x))
    shape = tuple(b.out_shape[k] for k in remaining) + new_shape
    dims = tuple(range(len(remaining)))
    tmap = _broadcast_pattern(b.ell.tmap[at], shape, dims)
    mask = None if b.ell.mask is None else _broadcast_pattern(b.ell.mask[at], shape, dims)
    reduced = Struct.build(
        val,
        labels,
        [b.out_labels[k] for k in remaining] + new_labels,
        b.in_labels,
        shape,
        b.in_shape,
        Ell(tmap, mask, b.ell.in_axes),
    )
    wide = remaining + list(range(n_x, n_x + len(new_labels)))
    x_free = [k for k in range(n_x) if k not in xc and k not in xb]
    free_new = list(range(n_x, n_x + len(new_labels)))
    order = list(xb) + (x_free + free_new if lin_is_lhs else free_new + x_free)
    out = _permute_out(reduced, [wide.index(k) for k in order])
    assert out.out_shape == tuple(out_shape), (out.out_shape, out_shape)
    return _cast(simplify(out), dtype)


@register_rule(prim("dot_general"), termwise=True, nan_faithful=True)
def _dot_general_rule(ctx, eqn, vals):
    pos = _single_linear(vals)
    if pos is None:
        return NotImplemented
    aval = _out_aval(eqn)
    # Operands of another dtype than the output (`preferred_element_type`, mixed inputs)
    # are cast to the output dtype first, as `dot_general`'s lowering does on CPU and GPU.
    a = _in_dtype(_const_array(vals[1 - pos]), aval.dtype)
    precision = eqn.params.get("precision")
    blocks = {
        p: _dot_block(
            _cast(b, aval.dtype),
            a,
            pos == 0,
            eqn.params["dimension_numbers"],
            aval.shape,
            aval.dtype,
            precision,
        )
        for p, b in vals[pos].blocks.items()
    }
    return [Lin(blocks, aval.shape, aval.dtype)]


# ---- primitives applied to the values, vectorised over the in side ---------------------


def _conv_windows(x, kernel, params):
    """`(offset, window)` for each offset of the kernel: the strided slice of the padded
    (and, for `lhs_dilation`, interior-padded) input `x` of shape `(N, C, *spatial)` that
    the kernel's element at that offset meets, of shape `(N, C, *out_spatial)`. Data
    movement only: exact, structure-keeping, and on CPU several times cheaper than the
    grouped convolution of `lax.conv_general_dilated_patches`."""
    padding = [tuple(int(q) for q in p) for p in params["padding"]]
    ldil = params["lhs_dilation"]
    x = lax.pad(
        x,
        jnp.zeros((), x.dtype),
        [(0, 0, 0), (0, 0, 0)] + [(lo, hi, d - 1) for (lo, hi), d in zip(padding, ldil)],
    )
    strides, rdil = params["window_strides"], params["rhs_dilation"]
    N, C = x.shape[:2]
    out_sizes = [
        (x.shape[2 + d] - (kernel[d] - 1) * rdil[d] - 1) // strides[d] + 1
        for d in range(len(kernel))
    ]
    for k in itertools.product(*[range(n) for n in kernel]):
        start = [0, 0] + [k[d] * rdil[d] for d in range(len(kernel))]
        limit = [N, C] + [
            start[2 + d] + (out_sizes[d] - 1) * strides[d] + 1 for d in range(len(kernel))
        ]
        yield k, lax.slice(x, start, limit, [1, 1] + list(strides))


def _conv_as_shifts(lhs, rhs, params):
    """`conv_general_dilated(lhs, rhs)` as a sum over the kernel's offsets of a strided
    slice of the padded (and, for input dilation, interior-padded) input contracted with
    the kernel's slice: the same numbers, in terms of data movement that keeps
    structure."""
    lhs_spec, rhs_spec, out_spec = params["dimension_numbers"]
    x = jnp.transpose(lhs, lhs_spec)  # (N, C, *spatial)
    w = jnp.transpose(rhs, rhs_spec)  # (O, I, *kernel)
    G, B = params["feature_group_count"], params["batch_group_count"]
    N, C = x.shape[:2]
    O = w.shape[0]
    total = None
    for k, shifted in _conv_windows(x, w.shape[2:], params):
        wk = w[(slice(None), slice(None)) + k]  # (O, I)
        if G > 1:
            sh = shifted.reshape((N, G, C // G) + shifted.shape[2:])
            term = jnp.einsum("ngc...,goc->ngo...", sh, wk.reshape(G, O // G, -1))
            term = term.reshape((N, O) + term.shape[3:])
        elif B > 1:
            sh = shifted.reshape((B, N // B) + shifted.shape[1:])
            term = jnp.einsum("bnc...,boc->nbo...", sh, wk.reshape(B, O // B, -1))
            term = term.reshape((N // B, O) + term.shape[3:])
        else:
            term = jnp.einsum("nc...,oc->no...", shifted, wk)
        total = term if total is None else total + term
    return jnp.transpose(total, np.argsort(out_spec))


def _conv_as_patches(lhs, rhs, params):
    """`conv_general_dilated(lhs, rhs)` with one batch group, as the input's patches
    (constant when only the kernel is linear) contracted with the kernel: the Jacobian
    with respect to the kernel is then the patches, tied along the output features,
    rather than the kernel's identity pushed through the convolution (`jax.jacfwd`'s
    way). The patches keep the kernel's axes, `(N, I, *kernel, *out_spatial)`, so that
    the kernel's identity stays a delta along each of them (a flattened kernel would make
    it a row-compressed pattern, densified by a scatter)."""
    lhs_spec, rhs_spec, out_spec = params["dimension_numbers"]
    x = jnp.transpose(lhs, lhs_spec)  # (N, C, *spatial)
    w = jnp.transpose(rhs, rhs_spec)  # (O, I, *kernel)
    kernel = w.shape[2:]
    windows = [window for _, window in _conv_windows(x, kernel, params)]
    patches = jnp.stack(windows, axis=2)  # (N, C, prod(kernel), *out_spatial)
    N, C = patches.shape[:2]
    patches = patches.reshape((N, C) + kernel + patches.shape[3:])
    k = "".join(chr(ord("a") + d) for d in range(len(kernel)))
    G, O = params["feature_group_count"], w.shape[0]
    if G == 1:
        spec = f"ni{k}...,oi{k}->no..."
    else:
        # Output feature `o` reads its group's input features: the patches are repeated
        # per output feature, so that `o` pairs the patches with the kernel elementwise
        # (splitting the kernel's `o` into groups would break its delta into a pattern).
        patches = patches.reshape((N, G, C // G) + patches.shape[2:])
        patches = jnp.repeat(patches, O // G, axis=1)
        spec = f"noi{k}...,oi{k}->no..."
    out = jnp.einsum(
        spec,
        patches.astype(w.dtype),
        w,
        precision=params["precision"],
        preferred_element_type=params["preferred_element_type"],
    )
    return jnp.transpose(out, np.argsort(out_spec))


_CONV_MAX_WINDOW = 64


@register_rule(prim("conv_general_dilated"))
def _conv_rule(ctx, eqn, vals):
    """A convolution of a structured input with a constant kernel of a few elements (a
    stencil, a small filter) keeps the input's structure: it is rewritten as shifts and
    channel contractions. Anything else is applied along the out side."""
    lhs, rhs = vals
    params = eqn.params
    kernel = eqn.invars[1].aval.shape
    spatial = [kernel[d] for d in params["dimension_numbers"].rhs_spec[2:]]
    if (
        isinstance(lhs, Lin)
        and not isinstance(rhs, Lin)
        and _has_pattern(lhs)
        and math.prod(spatial) <= _CONV_MAX_WINDOW
        and not (params["feature_group_count"] > 1 and params["batch_group_count"] > 1)
    ):
        aval = eqn.invars[0].aval
        closed = jax.make_jaxpr(lambda x: _conv_as_shifts(x, rhs, params))(
            jax.ShapeDtypeStruct(aval.shape, aval.dtype)
        )
        return interpret(ctx, closed.jaxpr, closed.consts, [lhs])
    if isinstance(rhs, Lin) and not isinstance(lhs, Lin) and params["batch_group_count"] == 1:
        aval = eqn.invars[1].aval
        closed = jax.make_jaxpr(lambda w: _conv_as_patches(lhs, w, params))(
            jax.ShapeDtypeStruct(aval.shape, aval.dtype)
        )
        return interpret(ctx, closed.jaxpr, closed.consts, [rhs])
    if isinstance(rhs, Lin):
        lost = "batch groups, with the kernel differentiated"
    elif math.prod(spatial) > _CONV_MAX_WINDOW:
        lost = f"a kernel window of more than {_CONV_MAX_WINDOW} elements"
    else:
        lost = "feature and batch groups together"
    return _apply_along_out(ctx, eqn, vals, lost=lost)


def _window_slices(x, params, fill):
    """For each offset of a `reduce_window`'s window, the strided slice of the padded (and,
    for `base_dilation`, interior-padded) `x` that the window's element at that offset
    meets, of the output's shape: data movement only, so structure-keeping."""
    window, strides = params["window_dimensions"], params["window_strides"]
    base = params.get("base_dilation") or (1,) * x.ndim
    wdil = params.get("window_dilation") or (1,) * x.ndim
    config = [(int(lo), int(hi), d - 1) for (lo, hi), d in zip(params["padding"], base)]
    x = lax.pad(x, jnp.asarray(fill, x.dtype), config)
    out = [(x.shape[d] - (window[d] - 1) * wdil[d] - 1) // strides[d] + 1 for d in range(x.ndim)]
    for k in itertools.product(*[range(n) for n in window]):
        start = [k[d] * wdil[d] for d in range(x.ndim)]
        limit = [start[d] + (out[d] - 1) * strides[d] + 1 for d in range(x.ndim)]
        yield lax.slice(x, start, limit, strides)


def _interpret_fn(ctx, fn, x: Lin, aval):
    closed = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct(aval.shape, aval.dtype))
    return interpret(ctx, closed.jaxpr, closed.consts, [x])


@register_rule(prim("reduce_window_sum"))
def _reduce_window_sum_rule(ctx, eqn, vals):
    """A windowed sum (`lax.reduce_window` with `lax.add`, an average pool) of a structured
    input with a window of a few elements: a sum of shifted slices, which keeps the
    pattern (a band for an identity)."""
    (x,) = vals
    if not _has_pattern(x) or math.prod(eqn.params["window_dimensions"]) > _CONV_MAX_WINDOW:
        return _apply_along_out(ctx, eqn, vals, lost=_window_reason(eqn))

    def fn(v):
        return sum(_window_slices(v, eqn.params, 0))

    return _interpret_fn(ctx, fn, x, eqn.invars[0].aval)


def _window_reason(eqn) -> str:
    return f"a window of more than {_CONV_MAX_WINDOW} elements"


def _selection_kept(eqn, lin, operand, aval) -> bool:
    """Whether a pool's selection keeps its window pattern: a linear tangent with a
    pattern, a constant operand, a small window, and position codes exact in the dtype."""
    return (
        isinstance(lin, Lin)
        and not isinstance(operand, Lin)
        and _has_pattern(lin)
        and math.prod(eqn.params["window_dimensions"]) <= _CONV_MAX_WINDOW
        and math.prod(aval.shape) < 2 ** (jnp.finfo(aval.dtype).nmant + 1)
    )


@register_rule(prim("select_and_gather_add"))
def _select_and_gather_add_rule(ctx, eqn, vals):
    """The tangent of a max or min pool: each output takes the tangent at its window's
    selected element, an index computed from the (traced) primal. The pattern is still
    known, the window, with traced values: for each window offset, the shifted slice of
    the tangent where that offset is the one selected. Which one it is comes from the
    primitive itself, applied to the positions' codes (so ties break as it breaks them)."""
    t, operand = vals
    aval = eqn.invars[0].aval
    if not _selection_kept(eqn, t, operand, aval):
        return _apply_along_out(ctx, eqn, vals, lost=_window_reason(eqn))
    return _interpret_fn(ctx, _selection_as_shifts(eqn.params, operand, aval), t, aval)


def _selection_as_shifts(params, operand, aval):
    """`t -> select_and_gather_add(t, operand)` as a sum over the window's offsets of
    shifted slices of `t` kept where that offset is the selected one."""
    n = math.prod(aval.shape)
    codes = jnp.arange(1, n + 1, dtype=aval.dtype).reshape(aval.shape)
    selected = prim("select_and_gather_add").bind(codes, operand, **params)
    masks = [w == selected for w in _window_slices(codes, params, 0)]

    def fn(v):
        return sum(
            jnp.where(m, w, jnp.zeros((), v.dtype))
            for m, w in zip(masks, _window_slices(v, params, 0))
        )

    return fn


@register_rule(prim("select_and_scatter_add"))
def _select_and_scatter_add_rule(ctx, eqn, vals):
    """The transpose of `select_and_gather_add` (a max pool's tangent, in reverse mode):
    the transpose of its shifted, selected slices."""
    s, operand = vals
    aval = eqn.invars[1].aval
    if not _selection_kept(eqn, s, operand, aval):
        return _apply_along_out(ctx, eqn, vals, lost=_window_reason(eqn))
    params = dict(eqn.params, base_dilation=(1,) * len(aval.shape))
    params["window_dilation"] = params["base_dilation"]
    gather = _selection_as_shifts(params, operand, aval)
    transposed = jax.linear_transpose(gather, jax.ShapeDtypeStruct(aval.shape, aval.dtype))
    return _interpret_fn(ctx, lambda c: transposed(c)[0], s, eqn.invars[0].aval)


@register_rule(
    prim("fft"),
    prim("triangular_solve"),
    prim("linear_solve"),
    prim("tridiagonal_solve"),
    prim("lineax_linear_solve"),
)
def _along_out_rule(ctx, eqn, vals):
    """These primitives are linear in their floating inputs given their integer ones
    (indices) and their constant ones (a conv kernel, a triangular matrix). The out axes are
    made dense and the primitive applied to the values."""
    return _apply_along_out(ctx, eqn, vals)


# ---- calls and control flow -----------------------------------------------------------


@register_rule(
    prim("jit"), prim("closed_call"), prim("remat"), prim("custom_jvp_call"), nan_faithful=True
)
def _call_rule(ctx, eqn, vals):
    # A linear program's `custom_jvp_call` is linear too: its sub-jaxpr is the map.
    sub = call_jaxpr(eqn, custom_jvp=True)
    if sub is None:
        return NotImplemented
    return interpret(ctx, *sub, vals)


def join(blocks: list[Struct], dtype) -> Struct:
    """A structure every block of `blocks` can be written in (their sum's), with a `val`
    that carries every out label (and the entry axis) if it has an `Ell`."""
    t = _cast(blocks[0], dtype)
    for b in blocks[1:]:
        t = add(t, _cast(b, dtype))
    t = t.canonical()
    # The sum of structures with known values (the loops' templates hold zeros) may be
    # compressed along the axes where those values are constant (`compress`): every axis
    # of zeros. Each axis along which a block's `val` varies is put back.
    labels = list(t.out_labels) + [BAND] if t.ell is not None else []
    pattern = () if t.ell is None else t.ell.in_axes
    for b in blocks:
        b = b.canonical()
        for label in b.val_labels:
            if label in b.out_labels:
                labels.append(t.out_labels[b.out_labels.index(label)])
            elif label in b.in_labels and b.in_labels.index(label) not in pattern:
                labels.append(t.in_labels[b.in_labels.index(label)])
    labels = [label for label in dict.fromkeys(labels) if label in t.sizes]
    return t.broadcast_labels(labels).canonical()


def conform(block: Struct, template: Struct):
    """`block`'s values written in `template`'s structure (from `join`): an array shaped
    like `template.val`."""
    return conform_val(_cast(block, template.dtype), template)


@register_rule(prim("cond"))
def _cond_rule(ctx, eqn, vals):
    """A known index interprets the taken branch. A traced index interprets every branch
    once to learn its output structures, joins them, and selects with `lax.switch`
    between branches that each conform their blocks to the joined structure: only the
    taken branch runs, and the structure the branches share is kept."""
    index, *ops = vals
    if isinstance(index, Lin):
        return NotImplemented
    branches = eqn.params["branches"]
    i = known(index)
    if i is not None:
        branch = branches[min(max(int(i), 0), len(branches) - 1)]
        return interpret(ctx, branch.jaxpr, branch.consts, ops)

    def run(branch):
        return interpret(ctx, branch.jaxpr, branch.consts, ops)

    dry = [run(branch) for branch in branches]
    n_out = len(eqn.outvars)
    linear = [any(isinstance(outs[k], Lin) for outs in dry) for k in range(n_out)]
    templates: list[dict[int, Struct]] = [{} for _ in range(n_out)]
    for k in range(n_out):
        if not linear[k]:
            continue
        dtype = eqn.outvars[k].aval.dtype
        found: dict[int, list[Struct]] = {}
        for outs in dry:
            if isinstance(outs[k], Lin):
                for p, b in outs[k].blocks.items():
                    found.setdefault(p, []).append(b)
        templates[k] = {p: join(bs, dtype) for p, bs in found.items()}

    def conformed(branch):
        def fn():
            outs = run(branch)
            flat = []
            for k in range(n_out):
                if not linear[k]:
                    flat.append(outs[k])
                    continue
                blocks = outs[k].blocks if isinstance(outs[k], Lin) else {}
                for p, t in templates[k].items():
                    if p in blocks:
                        flat.append(jnp.asarray(conform(blocks[p], t), t.dtype))
                    else:
                        flat.append(jnp.zeros(jnp.shape(t.val), t.dtype))
            return flat

        return fn

    flat = lax.switch(jnp.clip(index, 0, len(branches) - 1), [conformed(b) for b in branches])
    it = iter(flat)
    results = []
    for k in range(n_out):
        aval = eqn.outvars[k].aval
        if not linear[k]:
            results.append(next(it))
            continue
        blocks = {p: t.with_val(next(it)) for p, t in templates[k].items()}
        results.append(Lin(blocks, aval.shape, aval.dtype))
    return results
