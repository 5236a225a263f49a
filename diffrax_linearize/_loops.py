"""Structure rules for loops: `scan` and `while`.

A loop keeps structure when the structure of its linear carries reaches a fixed point: the
body is interpreted abstractly (inside `jax.eval_shape`, so nothing is computed) on the
carries' current structure, the structure it returns is joined with it, and this repeats
until nothing changes, as JAX's batching does for the batch dimensions of `scan` carries.
Then the loop runs once, for real, with the carries' values in that structure. A loop whose
carries' row-compressed patterns keep growing (a stencil applied again and again widens its
band) is widened: those carries are made dense over their patterns' in axes, after which the
structure always settles. A `scan` without linear carries is a map over its inputs and is
interpreted as the `jax.vmap` of its body."""

import math

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np

from ._colouring import apply_block, colour_columns, decompress, pattern_of
from ._compat import bind_eqn, is_literal, prim, scan_counts
from ._interpreter import (
    Context,
    dense_fallback,
    eval_jaxpr,
    interpret,
    known,
    Lin,
    map_columns,
    register_rule,
)
from ._rules import conform, join
from ._sparsity import ell_to_plain, too_full
from ._structure import Ell, fresh_label, Struct


_MAX_ITERATIONS = 8


def _key(templates):
    return tuple(
        None if t is None else tuple((p, b.structure_key()) for p, b in sorted(t.items()))
        for t in templates
    )


def _rebuild(templates, avals, flat):
    """Carries from their templates (`None`: a constant carry) and flat values."""
    it = iter(flat)
    out = []
    for t, aval in zip(templates, avals):
        if t is None:
            out.append(next(it))
        else:
            blocks = {p: b.with_val(next(it)) for p, b in sorted(t.items())}
            out.append(Lin(blocks, aval.shape, aval.dtype))
    return out


def _flatten(templates, values):
    """Flat values of carries written in their templates' structure."""
    flat = []
    for t, x in zip(templates, values):
        if t is None:
            flat.append(x)
            continue
        blocks = x.blocks if isinstance(x, Lin) else {}
        for p, b in sorted(t.items()):
            if p in blocks:
                flat.append(jnp.asarray(conform(blocks[p], b), b.dtype))
            else:
                flat.append(jnp.zeros(np.shape(b.val), b.dtype))
    return flat


def _placeholders(templates, avals):
    flat = []
    for t, aval in zip(templates, avals):
        if t is None:
            flat.append(jax.ShapeDtypeStruct(aval.shape, aval.dtype))
        else:
            for _, b in sorted(t.items()):
                flat.append(jax.ShapeDtypeStruct(np.shape(b.val), b.dtype))
    return flat


def _initial_templates(values, avals):
    templates = []
    for x, aval in zip(values, avals):
        if isinstance(x, Lin):
            templates.append({p: join([_abstract(b)], aval.dtype) for p, b in x.blocks.items()})
        else:
            templates.append(None)
    return templates


def _widen(templates):
    return [
        None if t is None else {p: ell_to_plain(b).canonical() for p, b in t.items()}
        for t in templates
    ]


_WIDENED = (
    "its carries' row-compressed pattern grows every iteration (a stencil applied again and "
    "again), so they were made dense over the pattern's axes"
)


def _fixed_point(templates, avals, step, widen=None):
    """Iterate `templates -> join(templates, step(templates))` to a fixed point, widening
    once if it does not settle (with `widen`, a callback recording that loss: the name of
    the loop's primitive is recorded in the `Context`). `step` returns the carries'
    structures after one iteration (a list of `{leaf: block}` or `None` per carry). Returns
    `None` if no fixed point."""
    for widened in (False, True) if widen is not None else (False,):
        if widened:
            if any(b.ell is not None for t in templates if t for b in t.values()):
                widen()
            templates = _widen(templates)
        for _ in range(_MAX_ITERATIONS):
            outs = step(templates)
            new = []
            for t, o, aval in zip(templates, outs, avals):
                if t is None and o is None:
                    new.append(None)
                    continue
                t = t or {}
                o = o or {}
                joined = {}
                for p in sorted(set(t) | set(o)):
                    bs = [b for b in (t.get(p), o.get(p)) if b is not None]
                    joined[p] = join(bs, aval.dtype)
                new.append(joined)
            if widened:
                new = _widen(new)
            if _key(new) == _key(templates):
                return templates
            templates = new
    return None


def _abstract(b: Struct) -> Struct:
    """`b` with zeros (known, and free to hold: a broadcast NumPy scalar) for `val`: a
    structure, with no values that belong to any trace."""
    return b.with_val(np.broadcast_to(np.zeros((), b.dtype), np.shape(b.val)))


def _structures(outs):
    """The structures of a body's outputs: per output `{leaf: block}` or `None`."""
    return [
        {p: _abstract(b) for p, b in x.blocks.items()} if isinstance(x, Lin) else None for x in outs
    ]


# ---- scan ---------------------------------------------------------------------------------


def _xs_slice(x: Lin):
    """The per-iteration blocks of a linear `scan` input (out axis 0 is the scanned one),
    and where their values come from: `("scan", array)` (scanned along its axis 0) or
    `("const", array)` (the same every iteration). The scanned axis must be dense in `val`,
    or constant; a delta on it, or a pattern that varies along it, is made dense."""
    blocks, sources = {}, {}
    for p, b in sorted(x.blocks.items()):
        if b.ell is not None:
            tmap, mask = b.ell.tmap, b.ell.full_mask()
            if not ((tmap == tmap[:, :1]).all() and (mask == mask[:, :1]).all()):
                b = ell_to_plain(b)
        if b.ell is None and b.out_labels[0] in b.in_labels:
            b = b.untie_out(0)
        b = b.canonical()
        label = b.out_labels[0]
        ell = None
        if b.ell is not None:
            ell = Ell(b.ell.tmap[:, 0], b.ell.full_mask()[:, 0], b.ell.in_axes)
        if label in b.val_labels:
            a = b.val_labels.index(label)
            scanned = jnp.moveaxis(jnp.asarray(b.val), a, 0)
            sources[p] = ("scan", scanned)
            val = scanned[0]
        else:
            sources[p] = ("const", b.val)
            val = b.val
        val_labels = [lb for lb in b.val_labels if lb != label]
        blocks[p] = Struct.build(
            val, val_labels, b.out_labels[1:], b.in_labels, b.out_shape[1:], b.in_shape, ell
        )
    return blocks, sources


@register_rule(prim("scan"))
def _scan_rule(ctx: Context, eqn, vals):
    params = eqn.params
    nc, nk = scan_counts(params)
    body = params["jaxpr"]
    consts, init, xs = vals[:nc], vals[nc : nc + nk], vals[nc + nk :]
    length, reverse = params["length"], params["reverse"]
    carry_avals = [v.aval for v in eqn.outvars[:nk]]
    ys_avals = [v.aval for v in eqn.outvars[nk:]]
    if nk == 0:
        return _scan_as_map(ctx, body, consts, xs)
    # The inputs, per iteration: constants as they are; linear ones as blocks whose
    # values are scanned (or constant).
    x_templates, sources = [], []
    for x in xs:
        if isinstance(x, Lin):
            blocks, src = _xs_slice(x)
            x_templates.append(blocks)
            sources.extend(src[p] for p in sorted(src))
        else:
            x_templates.append(None)
            sources.append(("scan", x))
    x_avals = [jax.ShapeDtypeStruct(v.aval.shape[1:], v.aval.dtype) for v in eqn.invars[nc + nk :]]
    probe_ctx = Context(in_shapes=ctx.in_shapes)
    ys_structures = []

    def step(templates):
        found = []

        def run(flat_c, flat_x):
            carries = _rebuild(templates, carry_avals, flat_c)
            x_t = _rebuild(x_templates, x_avals, flat_x)
            found.append(interpret(probe_ctx, body.jaxpr, body.consts, consts + carries + x_t))
            return [0.0]

        jax.eval_shape(
            run, _placeholders(templates, carry_avals), _placeholders(x_templates, x_avals)
        )
        outs = found[0]
        ys_structures[:] = [_structures(outs[nk:])]
        return _structures(outs[:nk])

    initial = _initial_templates(init, carry_avals)
    templates = _fixed_point(initial, carry_avals, step)
    if templates is None:
        out = _scan_by_colouring(ctx, eqn, vals, initial, step, length, nk, ys_structures)
        if out is not None:
            return out
        templates = _fixed_point(
            initial, carry_avals, step, widen=lambda: ctx.record(str(eqn.primitive), _WIDENED)
        )
    if templates is None:
        return dense_fallback(ctx, eqn, vals, reason="its carries' structure found no fixed point")
    step(templates)  # the outputs' structures for the fixed-point carries
    ys_templates = [
        None if s is None else {p: join([b], aval.dtype) for p, b in s.items()}
        for s, aval in zip(ys_structures[0], ys_avals)
    ]
    scanned = [v for kind, v in sources if kind == "scan"]

    def body_fn(carry, xs_t):
        it = iter(xs_t)
        flat_x = [next(it) if kind == "scan" else v for kind, v in sources]
        carries = _rebuild(templates, carry_avals, carry)
        x_t = _rebuild(x_templates, x_avals, flat_x)
        outs = interpret(ctx, body.jaxpr, body.consts, consts + carries + x_t)
        return _flatten(templates, outs[:nk]), _flatten(ys_templates, outs[nk:])

    final, ys = lax.scan(
        body_fn,
        _flatten(templates, init),
        scanned,
        length=length,
        reverse=reverse,
        unroll=params.get("unroll", 1),
    )
    outs = list(_rebuild(templates, carry_avals, final))
    it = iter(ys)
    for t, aval in zip(ys_templates, ys_avals):
        if t is None:
            outs.append(next(it))
            continue
        blocks = {p: _stacked(b, next(it), length) for p, b in sorted(t.items())}
        outs.append(Lin(blocks, aval.shape, aval.dtype))
    return outs


_COLOURING_MAX_LENGTH = 256


def _scan_by_colouring(ctx, eqn, vals, initial, step, length, nk, ys_structures):
    """The sparse fallback for a `scan` whose carries' pattern does not settle (a stencil
    applied again and again): the pattern after `length` iterations is found by iterating
    the structure abstractly, and the values by `c` compressed evaluations of the loop, one
    per colour of that pattern. `None` if it does not apply (linear outputs other than the
    carries, or a pattern too full to be worth it)."""
    if length > _COLOURING_MAX_LENGTH:
        return None
    structures = initial
    for _ in range(length):
        structures = step(structures)
        if any(s is not None for s in ys_structures[0]):
            return None  # stacked outputs: not handled here
        structures = [None if s is None else s for s in structures]
    leaves = sorted({p for s in structures if s for p in s})
    patterns = {p: [] for p in leaves}
    for k, s in enumerate(structures):
        for p, b in (s or {}).items():
            pat = pattern_of(b)
            if pat is None:
                return None
            patterns[p].append((k, pat))
    in_shapes = ctx.in_shapes
    colourings = {}
    for p in leaves:
        n = math.prod(in_shapes[p])
        colours = colour_columns([pat for _, pat in patterns[p]], n)
        c = int(colours.max(initial=0)) + 1
        if too_full(c, n):
            return None
        colourings[p] = (colours, c)
    outs = [None] * len(eqn.outvars)
    blocks = [dict() for _ in range(nk)]
    for p in leaves:
        colours, c = colourings[p]
        seeds = jnp.asarray(np.eye(c)[colours].reshape(tuple(in_shapes[p]) + (c,)))
        args, axes = [], []
        for x in vals:
            if isinstance(x, Lin):
                if p in x.blocks:
                    args.append(apply_block(x.blocks[p], seeds).astype(x.dtype))
                else:
                    args.append(jnp.zeros(tuple(x.shape) + (c,), x.dtype))
                axes.append(-1)
            else:
                args.append(x)
                axes.append(None)
        compressed = map_columns(lambda *a: bind_eqn(eqn, a), args, axes)
        for k, (columns, live) in patterns[p]:
            aval = eqn.outvars[k].aval
            blocks[k][p] = decompress(
                compressed[k], columns, live, colours, aval.shape, in_shapes[p], aval.dtype
            )
        ctx.record_colouring(str(eqn.primitive), c)
    # Outputs that are not linear (constant carries, constant stacked outputs): as usual.
    constant = bind_eqn(
        eqn, [jnp.zeros(x.shape, x.dtype) if isinstance(x, Lin) else x for x in vals]
    )
    for k, v in enumerate(eqn.outvars):
        if k < nk and structures[k] is not None:
            outs[k] = Lin(blocks[k], v.aval.shape, v.aval.dtype)
        else:
            outs[k] = constant[k]
    return outs


def _stacked(b: Struct, val, length: int) -> Struct:
    """The block of a `scan` output stacked along a new leading out axis."""
    label = fresh_label()
    ell = None
    if b.ell is not None:
        S = b.ell.S
        tmap = np.broadcast_to(b.ell.tmap[:, None], (S, length) + b.out_shape)
        mask = np.broadcast_to(b.ell.full_mask()[:, None], (S, length) + b.out_shape)
        ell = Ell(tmap, mask, b.ell.in_axes)
    return Struct.build(
        val,
        (label,) + b.val_labels,
        (label,) + b.out_labels,
        b.in_labels,
        (length,) + b.out_shape,
        b.in_shape,
        ell,
    )


def _scan_as_map(ctx, body, consts, xs):
    """A `scan` without carries: its outputs are its body mapped over the inputs."""

    def mapped(*args):
        c, x = args[: len(consts)], args[len(consts) :]

        def one(*x_t):
            return eval_jaxpr(body.jaxpr, body.consts, list(c) + list(x_t), bind_eqn)

        return jax.vmap(one)(*x)

    avals = [
        jax.ShapeDtypeStruct(x.shape, x.dtype)
        if isinstance(x, Lin)
        else jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
        for x in list(consts) + list(xs)
    ]
    closed = jax.make_jaxpr(mapped)(*avals)
    return interpret(ctx, closed.jaxpr, closed.consts, list(consts) + list(xs))


# ---- loops over cells ---------------------------------------------------------------------

# A `scan` whose trip count and integer carries are known at trace time, and whose body
# indexes an array by them (`fori_loop(1, n, lambda i, out: out.at[i].set(f(y[i], y[i-1])))`,
# a loop over the cells of a grid), has a Jacobian as sparse as its cells' coupling; but
# rolled, its indices are traced values, and the carries' structure can only be joined over
# every index: dense. Unrolled, every iteration's indices are known at trace time and its
# gathers and scatters keep their pattern. `is_cell_loop` finds such loops and `unrolled`
# evaluates one unrolled; the linearisation (`_materialise._coloured_cell_loop`) unrolls it
# abstractly, for the pattern alone, and keeps the loop rolled in the program.
_CELL_LOOP_MAX_LENGTH = 256
_CELL_LOOP_MAX_EQUATIONS = 1 << 15
_INDEXING = (
    "dynamic_slice",
    "dynamic_update_slice",
    "gather",
    "scatter",
    "scatter-add",
    "scatter-mul",
    "scatter-min",
    "scatter-max",
)


def _known_integer(x) -> bool:
    k = known(x)
    return k is not None and not np.issubdtype(k.dtype, np.inexact)


def _integral(aval) -> bool:
    dtype = getattr(aval, "dtype", None)
    return isinstance(dtype, np.dtype) and not np.issubdtype(dtype, np.inexact)


def is_cell_loop(eqn, vals) -> bool:
    """Whether `eqn` is a `scan` over cells: short enough to unroll, with integers known at
    trace time in every iteration (carries that stay known through its body, as loop
    counters do, or scanned inputs) that index an array of traced values there."""
    if eqn.primitive is not prim("scan"):
        return False
    params = eqn.params
    length = params["length"]
    body = params["jaxpr"].jaxpr
    if length > _CELL_LOOP_MAX_LENGTH or length * len(body.eqns) > _CELL_LOOP_MAX_EQUATIONS:
        return False
    nc, nk = scan_counts(params)
    # The body's variables known at trace time, given which of its inputs are: integers
    # computed from known integers alone. Carries must stay known through an iteration.
    carried = [k for k in range(nk) if _known_integer(vals[nc + k])]
    while True:
        inputs = {v for v, x in zip(body.invars[:nc], vals[:nc]) if _known_integer(x)}
        inputs |= {body.invars[nc + k] for k in carried}
        inputs |= {v for v, x in zip(body.invars[nc + nk :], vals[nc + nk :]) if _known_integer(x)}
        known_vars = set(inputs)
        for e in body.eqns:
            if e.effects or not all(_integral(v.aval) for v in e.outvars):
                continue
            if all(is_literal(v) or v in known_vars for v in e.invars):
                known_vars.update(e.outvars)
        stay = [k for k in carried if is_literal(body.outvars[k]) or body.outvars[k] in known_vars]
        if stay == carried:
            break
        carried = stay
    if not carried and not any(_known_integer(x) for x in vals[nc + nk :]):
        return False
    for e in body.eqns:
        if str(e.primitive) not in _INDEXING:
            continue
        indexed = any(not is_literal(v) and v in known_vars for v in e.invars)
        traced = any(
            not is_literal(v) and v not in known_vars and not _integral(v.aval) for v in e.invars
        )
        if indexed and traced:
            return True
    return False


def unrolled(eqn, vals, evaluate) -> list:
    """The outputs of the `scan` equation `eqn` on `vals`, its body evaluated once per
    iteration by `evaluate(jaxpr, consts, invals)` (stacked outputs stacked here)."""
    params = eqn.params
    nc, nk = scan_counts(params)
    closed = params["jaxpr"]
    consts, carry, xs = list(vals[:nc]), list(vals[nc : nc + nk]), list(vals[nc + nk :])
    length = params["length"]
    order = range(length - 1, -1, -1) if params["reverse"] else range(length)
    ys = [None] * length
    for k in order:
        outs = evaluate(closed.jaxpr, closed.consts, consts + carry + [x[k] for x in xs])
        carry, ys[k] = list(outs[:nk]), list(outs[nk:])
    stacked = []
    for j, v in enumerate(eqn.outvars[nk:]):
        parts = [y[j] for y in ys]
        if not parts:
            stacked.append(jnp.zeros(v.aval.shape, v.aval.dtype))
        elif all(isinstance(x, np.ndarray | np.generic) for x in parts):
            stacked.append(np.stack(parts).astype(v.aval.dtype))
        else:
            stacked.append(jnp.stack([jnp.asarray(x, v.aval.dtype) for x in parts]))
    return carry + stacked


# ---- while ----------------------------------------------------------------------------------


@register_rule(prim("while"))
def _while_rule(ctx: Context, eqn, vals):
    params = eqn.params
    cn, bn = params["cond_nconsts"], params["body_nconsts"]
    cond, body = params["cond_jaxpr"], params["body_jaxpr"]
    cond_consts, body_consts, init = vals[:cn], vals[cn : cn + bn], vals[cn + bn :]
    if any(isinstance(x, Lin) for x in cond_consts):
        return NotImplemented
    avals = [v.aval for v in eqn.outvars]
    probe_ctx = Context(in_shapes=ctx.in_shapes)
    # Under `vmap` with a data-dependent trip count the predicate is batched: the loop runs
    # while any lane's predicate holds, and each carry keeps its old value in the lanes
    # whose predicate is false (`while`'s batched semantics). Those leading out axes must
    # then be in every linear carry's `val`, to select along them.
    lanes = len(cond.out_avals[0].shape)

    def along_lanes(structures):
        if not lanes:
            return structures
        return [
            None
            if t is None
            else {p: b.broadcast_labels(b.out_labels[:lanes]).canonical() for p, b in t.items()}
            for t in structures
        ]

    def step(templates):
        found = []

        def run(flat):
            carries = _rebuild(templates, avals, flat)
            found.append(interpret(probe_ctx, body.jaxpr, body.consts, body_consts + carries))
            return [0.0]

        jax.eval_shape(run, _placeholders(templates, avals))
        return along_lanes(_structures(found[0]))

    templates = _fixed_point(
        along_lanes(_initial_templates(init, avals)),
        avals,
        step,
        widen=lambda: ctx.record(str(eqn.primitive), _WIDENED),
    )
    if templates is None:
        return dense_fallback(ctx, eqn, vals, reason="its carries' structure found no fixed point")
    templates = along_lanes(templates)

    def constants(flat):
        """The carries with zeros for the linear ones: the predicate does not use them."""
        carries = _rebuild(templates, avals, flat)
        return [
            jnp.zeros(a.shape, a.dtype) if isinstance(c, Lin) else c for c, a in zip(carries, avals)
        ]

    def predicate(flat):
        (pred,) = eval_jaxpr(cond.jaxpr, cond.consts, list(cond_consts) + constants(flat), bind_eqn)
        return pred

    def cond_fn(flat):
        return jnp.any(predicate(flat)) if lanes else predicate(flat)

    def body_fn(flat):
        carries = _rebuild(templates, avals, flat)
        outs = interpret(ctx, body.jaxpr, body.consts, body_consts + carries)
        new = _flatten(templates, outs)
        if not lanes:
            return new
        pred = predicate(flat)
        return [
            jnp.where(_lanes_of(pred, label_lanes, np.ndim(v)), v, old)
            for v, old, label_lanes in zip(new, flat, _lane_axes(templates, avals, lanes))
        ]

    final = lax.while_loop(cond_fn, body_fn, _flatten(templates, init))
    return _rebuild(templates, avals, final)


def _lane_axes(templates, avals, lanes: int):
    """For each flat value of the carries: the axes of it that are the predicate's (the
    first `lanes` out axes), in order."""
    axes = []
    for t, aval in zip(templates, avals):
        if t is None:
            axes.append(tuple(range(lanes)))
            continue
        for _, b in sorted(t.items()):
            axes.append(tuple(b.val_labels.index(label) for label in b.out_labels[:lanes]))
    return axes


def _lanes_of(pred, axes, ndim: int):
    """`pred` placed along `axes` of an array of `ndim` axes, to broadcast against it."""
    order = sorted(range(len(axes)), key=lambda a: axes[a])
    shape = [1] * ndim
    for a in order:
        shape[axes[a]] = pred.shape[a]
    return jnp.transpose(pred, order).reshape(shape)
