"""Structure rules, one per primitive (or family of primitives), for the interpreter in
`_interpreter.py`. Every rule is exact; where a rule cannot keep the structure of an axis it
makes that axis dense (`Struct.densify_out`), never wrong, only slower."""

import math

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np

from ._compat import prim
from ._interpreter import Context, dense_fallback, interpret, Lin, register_rule
from ._structure import add, contract, fresh_label, is_unit, place, Struct


# ---- helpers --------------------------------------------------------------------------


def _out_aval(eqn, k=0):
    return eqn.outvars[k].aval


def _lin_positions(vals):
    return [i for i, x in enumerate(vals) if isinstance(x, Lin)]


def _single_linear(vals):
    """The position of the only linear input, or `None` if there are several."""
    pos = _lin_positions(vals)
    return pos[0] if len(pos) == 1 else None


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


def _forget_size_one(val, val_labels: list, label, in_labels):
    """Drop a size-one out axis's `label` from `val` (in place on `val_labels`), unless the
    in side still carries it. Returns the new `val`."""
    if label in val_labels and label not in in_labels:
        a = val_labels.index(label)
        val = val.reshape(val.shape[:a] + val.shape[a + 1 :])
        del val_labels[a]
    return val


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
    return Struct.build(val, val_labels, out_labels, block.in_labels, shape, block.in_shape)


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
        val, labels, block.out_labels, block.in_labels, block.out_shape, block.in_shape
    )


def _apply_along_out(ctx: Context, eqn, vals, positions=None):
    """Apply the equation's primitive to the blocks' values, vectorised over their in-side
    axes. The equation must be linear in the inputs at `positions`. The out axes become
    dense; the in side keeps its structure where there is a single linear input."""
    if positions is None:
        positions = _lin_positions(vals)
    if len(positions) != 1:
        return dense_fallback(ctx, eqn, vals)
    (pos,) = positions
    x = vals[pos]
    aval = _out_aval(eqn)
    n_out = len(x.shape)
    blocks = {}
    for p, b in x.blocks.items():
        b = b.densify_out()
        in_side = [label for label in b.val_labels if label not in b.out_labels]
        order = list(b.out_labels) + in_side
        v = place(b.val, b.val_labels, order)
        v = jnp.asarray(v, dtype=x.dtype)
        flat = v.reshape(v.shape[:n_out] + (math.prod(v.shape[n_out:]),))
        in_axes = [None] * len(vals)
        in_axes[pos] = -1
        args = list(vals)
        args[pos] = flat
        from ._compat import bind_eqn

        res = jax.vmap(lambda *a: bind_eqn(eqn, a)[0], in_axes=in_axes, out_axes=-1)(*args)
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


def _densify_and(block: Struct, axes, fn) -> Struct:
    """Densify the given out axes, then apply `fn(val, val_axes)` where `val_axes` are the
    positions in `val` of those out axes; `fn` returns the new `val` with the same rank."""
    block = block.densify_out(axes).canonical()
    val_axes = [block.val_labels.index(block.out_labels[k]) for k in axes]
    return fn(jnp.asarray(block.val), val_axes), block


def _rebuild_out(block: Struct, val, out_shape) -> Struct:
    """A block whose out axes are resized to `out_shape` (all resized axes were dense)."""
    return Struct.build(
        val,
        block.val_labels,
        block.out_labels,
        block.in_labels,
        out_shape,
        block.in_shape,
    )


# ---- elementwise linear maps of one input ---------------------------------------------


register_rule(prim("neg"))(_blockwise(lambda b, eqn, vals, pos: b.map_val(lambda v: -v)))
register_rule(prim("conj"))(_blockwise(lambda b, eqn, vals, pos: b.map_val(lambda v: v.conj())))
register_rule(prim("real"))(_blockwise(lambda b, eqn, vals, pos: b.map_val(lambda v: v.real)))
register_rule(prim("imag"))(_blockwise(lambda b, eqn, vals, pos: b.map_val(lambda v: v.imag)))
register_rule(prim("convert_element_type"))(_blockwise(lambda b, eqn, vals, pos: b))


@register_rule(
    prim("copy"),
    prim("sharding_constraint"),
    prim("device_put"),
    prim("optimization_barrier"),
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


@register_rule(prim("transpose"))
@_blockwise
def _transpose_rule(b, eqn, vals, pos):
    perm = eqn.params["permutation"]
    return Struct.build(
        b.val,
        b.val_labels,
        [b.out_labels[k] for k in perm],
        b.in_labels,
        [b.out_shape[k] for k in perm],
        b.in_shape,
    )


@register_rule(prim("broadcast_in_dim"))
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
    return Struct.build(
        val,
        val_labels,
        [b.out_labels[k] for k in keep],
        b.in_labels,
        [b.out_shape[k] for k in keep],
        b.in_shape,
    )


@register_rule(prim("squeeze"))
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


@register_rule(prim("reshape"))
def _reshape_rule(ctx, eqn, vals):
    if len(vals) != 1 or eqn.params.get("dimensions") is not None:
        return NotImplemented
    (x,) = vals
    aval = _out_aval(eqn)
    new_shape = tuple(aval.shape)
    if math.prod(x.shape) == 0:
        return NotImplemented
    groups = _reshape_groups(x.shape, new_shape)
    blocks = {}
    for p, b in x.blocks.items():
        # Densify the axes of groups that really split or merge.
        merge_axes = [k for go, gn in groups if len(go) > 1 or len(gn) > 1 for k in go]
        b = b.densify_out(merge_axes).canonical()
        ones_old = [k for k, d in enumerate(x.shape) if d == 1]
        val, val_labels = (
            jnp.asarray(b.val) if merge_axes else b.val,
            list(b.val_labels),
        )
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
        blocks[p] = Struct.build(val, val_labels, new_labels, b.in_labels, new_shape, b.in_shape)
    return [Lin(blocks, aval.shape, aval.dtype)]


@register_rule(prim("rev"))
@_blockwise
def _rev_rule(b, eqn, vals, pos):
    axes = list(eqn.params["dimensions"])
    val, b = _densify_and(b, axes, lambda v, va: jnp.flip(v, axis=tuple(va)))
    return b.with_val(val)


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

    def fn(v, va):
        s, li, st = [0] * v.ndim, list(v.shape), [1] * v.ndim
        for k, a in zip(axes, va):
            s[a], li[a], st[a] = start[k], limit[k], strides[k]
        return lax.slice(v, s, li, st)

    val, b = _densify_and(b, axes, fn)
    return _rebuild_out(b, val, out_shape)


@register_rule(prim("dynamic_slice"))
def _dynamic_slice_rule(ctx, eqn, vals):
    if _lin_positions(vals) != [0]:
        return NotImplemented
    x, *starts = vals
    sizes = eqn.params["slice_sizes"]
    aval = _out_aval(eqn)
    axes = [k for k in range(len(sizes)) if sizes[k] != x.shape[k]]
    blocks = {}
    for p, b in x.blocks.items():

        def fn(v, va):
            idx = [jnp.zeros_like(starts[0]) if starts else 0] * v.ndim  # starts' int type
            sz = list(v.shape)
            for k, a in zip(axes, va):
                idx[a] = starts[k]
                sz[a] = sizes[k]
            return lax.dynamic_slice(v, idx, sz)

        val, bb = _densify_and(b, axes, fn)
        blocks[p] = _cast(_rebuild_out(bb, val, aval.shape), aval.dtype)
    return [Lin(blocks, aval.shape, aval.dtype)]


@register_rule(prim("pad"))
def _pad_rule(ctx, eqn, vals):
    if _lin_positions(vals) != [0]:
        return NotImplemented
    x, _ = vals  # the padding value is a constant: its tangent is zero
    config = eqn.params["padding_config"]
    aval = _out_aval(eqn)
    axes = [k for k, c in enumerate(config) if tuple(c) != (0, 0, 0)]
    blocks = {}
    for p, b in x.blocks.items():

        def fn(v, va):
            cfg = [(0, 0, 0)] * v.ndim
            for k, a in zip(axes, va):
                cfg[a] = tuple(int(c) for c in config[k])
            return lax.pad(v, jnp.zeros((), v.dtype), cfg)

        val, bb = _densify_and(b, axes, fn)
        blocks[p] = _cast(_rebuild_out(bb, val, aval.shape), aval.dtype)
    return [Lin(blocks, aval.shape, aval.dtype)]


@register_rule(prim("concatenate"))
def _concatenate_rule(ctx, eqn, vals):
    dim = eqn.params["dimension"]
    aval = _out_aval(eqn)
    total = aval.shape[dim]
    parts = []
    offset = 0
    for x in vals:
        size = x.shape[dim]
        if isinstance(x, Lin):
            blocks = {}
            for p, b in x.blocks.items():

                def fn(v, va, offset=offset, size=size):
                    cfg = [(0, 0, 0)] * v.ndim
                    cfg[va[0]] = (offset, total - offset - size, 0)
                    return lax.pad(v, jnp.zeros((), v.dtype), cfg)

                val, bb = _densify_and(b, [dim], fn)
                blocks[p] = _rebuild_out(bb, val, aval.shape)
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
        blocks = {}
        for p, b in x.blocks.items():

            def fn(val, va, start=start, size=size):
                return lax.slice_in_dim(val, start, start + size, axis=va[0])

            val, bb = _densify_and(b, [axis], fn)
            blocks[p] = _cast(_rebuild_out(bb, val, v.aval.shape), v.aval.dtype)
        outs.append(Lin(blocks, v.aval.shape, v.aval.dtype))
        start += size
    return outs


@register_rule(prim("tile"))
def _tile_rule(ctx, eqn, vals):
    """`tile` repeats each tiled out axis: that axis is made dense and its values are
    concatenated `reps` times."""
    (x,) = vals
    reps = eqn.params["reps"]
    aval = _out_aval(eqn)
    axes = [k for k, r in enumerate(reps) if r != 1]

    def fn(v, va):
        for k, a in zip(axes, va):
            v = jnp.concatenate([v] * reps[k], axis=a)
        return v

    blocks = {}
    for p, b in x.blocks.items():
        val, bb = _densify_and(b, axes, fn)
        blocks[p] = _cast(_rebuild_out(bb, val, aval.shape), aval.dtype)
    return [Lin(blocks, aval.shape, aval.dtype)]


@register_rule(prim("reduce_sum"))
@_blockwise
def _reduce_sum_rule(b, eqn, vals, pos):
    axes = sorted(eqn.params["axes"])
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


@register_rule(prim("cumsum"))
@_blockwise
def _cumsum_rule(b, eqn, vals, pos):
    axis, reverse = eqn.params["axis"], eqn.params["reverse"]
    val, b = _densify_and(b, [axis], lambda v, va: lax.cumsum(v, axis=va[0], reverse=reverse))
    return b.with_val(val)


# ---- arithmetic -----------------------------------------------------------------------


@register_rule(prim("add"), prim("add_jaxvals"), prim("sub"))
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


@register_rule(prim("mul"))
def _mul_rule(ctx, eqn, vals):
    pos = _single_linear(vals)
    if pos is None:
        return NotImplemented  # a product of two linear values is not linear
    aval = _out_aval(eqn)
    x = _to_shape(vals[pos], aval.shape)
    c = vals[1 - pos]
    blocks = {p: _cast(_scale(b, c), aval.dtype) for p, b in x.blocks.items()}
    return [Lin(blocks, aval.shape, aval.dtype)]


@register_rule(prim("div"))
def _div_rule(ctx, eqn, vals):
    if _lin_positions(vals) != [0]:
        return NotImplemented
    aval = _out_aval(eqn)
    x = _to_shape(vals[0], aval.shape)
    c = vals[1]
    blocks = {
        p: _cast(_scale(b, c, combine=lambda v, cc: v / cc), aval.dtype)
        for p, b in x.blocks.items()
    }
    return [Lin(blocks, aval.shape, aval.dtype)]


@register_rule(prim("select_n"))
def _select_n_rule(ctx, eqn, vals):
    pred, *cases = vals
    if isinstance(pred, Lin):
        return NotImplemented
    aval = _out_aval(eqn)
    pred = _const_array(pred)
    terms = []
    for k, x in enumerate(cases):
        if not isinstance(x, Lin):
            continue
        x = _to_shape(x, aval.shape)
        if pred.dtype == np.bool_:
            mask = pred if k == 1 else jnp.logical_not(pred)
        else:
            mask = pred == k
        mask = jnp.asarray(mask).astype(aval.dtype)
        terms.append(Lin({p: _scale(b, mask) for p, b in x.blocks.items()}, x.shape, x.dtype))
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


@register_rule(prim("dot_general"))
def _dot_general_rule(ctx, eqn, vals):
    pos = _single_linear(vals)
    if pos is None:
        return NotImplemented
    aval = _out_aval(eqn)
    a = _const_array(vals[1 - pos])
    precision = eqn.params.get("precision")
    blocks = {
        p: _dot_block(
            b,
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


@register_rule(
    prim("gather"),
    prim("dynamic_update_slice"),
    prim("scatter_add"),
    prim("scatter"),
    prim("conv_general_dilated"),
    prim("reduce_window_sum"),
    prim("select_and_gather_add"),
    prim("select_and_scatter_add"),
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


def _call_jaxpr(eqn):
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if name in eqn.params:
            return eqn.params[name]
    return None


@register_rule(prim("jit"), prim("closed_call"), prim("remat"), prim("custom_jvp_call"))
def _call_rule(ctx, eqn, vals):
    closed = _call_jaxpr(eqn)
    if closed is None:
        return NotImplemented
    jaxpr = getattr(closed, "jaxpr", closed)
    consts = getattr(closed, "consts", ())
    return interpret(ctx, jaxpr, consts, vals)


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
    try:
        i = int(np.asarray(index))
    except (
        TypeError,
        jax.errors.ConcretizationTypeError,
        jax.errors.TracerArrayConversionError,
    ):
        i = None
    if i is not None:
        branch = branches[min(max(i, 0), len(branches) - 1)]
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
        for outs in dry:
            if isinstance(outs[k], Lin):
                for p, b in outs[k].blocks.items():
                    b = _cast(b, dtype)
                    templates[k][p] = add(templates[k][p], b) if p in templates[k] else b
    zeros = [
        {p: t.with_val(jnp.zeros(jnp.shape(t.val), t.dtype)) for p, t in templates[k].items()}
        for k in range(n_out)
    ]

    def conformed(branch):
        def fn():
            outs = run(branch)
            flat = []
            for k in range(n_out):
                if not linear[k]:
                    flat.append(outs[k])
                    continue
                blocks = outs[k].blocks if isinstance(outs[k], Lin) else {}
                for p, zero in zeros[k].items():
                    if p in blocks:
                        b = add(_cast(blocks[p], zero.dtype), zero)
                        assert b.structure_key() == zero.structure_key()
                        flat.append(jnp.asarray(b.canonical().val, zero.dtype))
                    else:
                        flat.append(zero.val)
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
        blocks = {p: zero.with_val(next(it)) for p, zero in zeros[k].items()}
        results.append(Lin(blocks, aval.shape, aval.dtype))
    return results
