"""Sums of squared per-example gradients (the diagonal of $J^\\top J$) and per-example
gradient norms, found from the jaxpr of the loss instead of from `vmap(grad)`.

A recursion on the structure engine (see the developer page on the engine):

1. `loss_fn` is traced for *one* example and walked by the engine's walker
   (`eval_jaxpr`). A parameter followed through one-operand equations that JAX can
   transpose (transpose, reshape, convert, neg, slice, broadcast, sums: the *chain*)
   reaches a *use*: an equation with other operands that is linear in it. Anything else
   a parameter meets sends it to the exact `vmap(grad)` fallback.
2. The structure engine gives the block $J$ of the use's output with respect to the
   parameter (chain included). The use is *fast* when every parameter entry reaches at
   most one output entry (deltas, broadcast values, row-compressed patterns with one
   entry per column): then squares commute with $J^\\top$,
   $\\sum_b (J_b^\\top g_b)^2 = \\sum_b (J_b^{\\circ 2})^\\top g_b^2$, the squared block's
   values contracted with the squared cotangents over the batch (for a dense layer
   `square(x).T @ square(g)`).
3. One backward pass over the batch gives the output cotangent `g` of every use: a zero
   perturbation is added to each use's output and differentiated together with the
   parameters. The use's other operands are recorded on the way.
4. A parameter with one fast use takes step 2; anything else forms its per-example
   gradients from the recorded operands and cotangents (summed over its uses), in
   chunks. Per-example norms of a use that is not fast may come from the recursion's own
   rules (`register_rule(..., recursion="squared_grads")`: the Gram form for a dense
   layer shared over positions).
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Float, PyTree

from . import _loops as _loops, _rules as _rules  # noqa: F401  (register the structure rules)
from ._colouring import apply_block
from ._compat import bind_eqn, is_literal, jaxpr_as_fun, new_jaxpr, prim
from ._custom_types import common_dtype
from ._interpreter import (
    Context,
    eval_jaxpr,
    interpret,
    Lin,
    lookup_rule,
    read_value,
    register_rule,
    rule_registry,
    subjaxprs,
)
from ._sparsity import flat_entries
from ._structure import contract, expand, fresh_label, is_known, Struct


# Upper bound on the bytes of per-example gradients held at once by the chunked paths.
_CHUNK_BYTES = 2**26

SQUARED_GRADS = "squared_grads"
"""The name of this recursion's rule registry: `rule(eqn, index, others, g)` returns the
`(B,)` squared norms of the per-example gradients of operand `index` of `eqn` from the
batched other operands `others` and output cotangents `g`, or `None` for the generic
per-example computation."""

_USE_RULES = rule_registry(SQUARED_GRADS)


@dataclasses.dataclass(frozen=True)
class UseKind:
    """How a use reaches its parameter, as the structure engine sees it.

    **Arguments:**

    - `fast`: whether every entry of the parameter reaches at most one entry of the use's
        output (for one example): the block of the use with respect to the parameter has
        at most one entry per column.
    - `block`: that block (canonical, its `val` a `jax.ShapeDtypeStruct`), or `None`.
    - `isometric`: whether the chain from the parameter to the use's operand has
        orthonormal rows (each operand entry is $\\pm$ one parameter entry, no two the
        same), so that norms of gradients with respect to the operand are the parameter's.
    - `norms`: the recursion's rule for the use's primitive, or `None`.
    """

    fast: bool
    block: Struct | None = None
    isometric: bool = False
    norms: Callable[..., Array | None] | None = None


def _dot_general_layout(eqn, index: int):
    """Axes of the other operand `x` (contracting, batch, free) and of the output
    (batch, x-free, w-free) for `dot_general` with the parameter in operand `index`."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = (aval.shape for aval in (v.aval for v in eqn.invars))
    x_shape, w_shape = (rhs, lhs) if index == 0 else (lhs, rhs)
    xc, xb, wc, wb = (rc, rb, lc, lb) if index == 0 else (lc, lb, rc, rb)
    xf = [d for d in range(len(x_shape)) if d not in xc and d not in xb]
    wf = [d for d in range(len(w_shape)) if d not in wc and d not in wb]
    nb = len(lb)
    if index == 0:  # out: batch, w-free, x-free
        out_wf = list(range(nb, nb + len(wf)))
        out_xf = list(range(nb + len(wf), nb + len(wf) + len(xf)))
    else:
        out_xf = list(range(nb, nb + len(xf)))
        out_wf = list(range(nb + len(xf), nb + len(xf) + len(wf)))
    k = math.prod(x_shape[d] for d in xb)
    c = math.prod(x_shape[d] for d in xc)
    t = math.prod(x_shape[d] for d in xf)
    f = math.prod(w_shape[d] for d in wf)
    return (list(xb), list(xc), xf), (list(range(nb)), out_xf, out_wf), (k, c, t, f)


@register_rule(prim("dot_general"), recursion=SQUARED_GRADS)
def _dot_general_rule(eqn, index, others, g):
    """$\\|dW_b\\|^2$ from `x` `(B, K, C, T)` and `g` `(B, K, T, F)`: the outer-product
    form for `T == 1`, the Gram form when $T^2 (C + F) \\le T C F$, else `None`
    (per-example contraction)."""
    (xb, xc, xf), (ob, oxf, owf), (k, c, t, f) = _dot_general_layout(eqn, index)
    if t != 1 and t * (c + f) > c * f:
        return None
    (x,) = others
    batch = x.shape[0]
    x = jnp.transpose(x, [0, *(1 + d for d in (*xb, *xc, *xf))])
    x = x.reshape(batch, k, c, t)
    g = jnp.transpose(g, [0, *(1 + d for d in (*ob, *oxf, *owf))])
    g = g.reshape(batch, k, t, f)
    if t == 1:
        xx = jnp.sum(x * x, axis=(2, 3))
        gg = jnp.sum(g * g, axis=(2, 3))
        return jnp.sum(xx * gg, axis=1)
    xx = jnp.einsum("bkct,bkcs->bkts", x, x)
    gg = jnp.einsum("bktf,bksf->bkts", g, g)
    return jnp.sum(xx * gg, axis=(1, 2, 3))


#
# Analysis of the per-example jaxpr
#


@dataclasses.dataclass(frozen=True)
class _Origin:
    leaf: int
    chain: tuple = ()


@dataclasses.dataclass(frozen=True)
class _Use:
    """A use: `jaxpr` maps `(leaf, *others)` to the use's output through the chain, where
    `others` are the use's operands at `positions` (not literals, each once)."""

    key: tuple[int, ...]
    leaf: int
    chain: tuple
    eqn: Any
    index: int
    kind: UseKind
    jaxpr: Any = None
    positions: tuple[int, ...] = ()


def _is_float(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.floating)


def _struct_of(aval) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(aval.shape), aval.dtype)


def _linear_in(eqn, index: int) -> bool:
    """Whether JAX can transpose `eqn` in operand `index`, the others held fixed: the
    condition for the use's per-example gradients to be `J_b^T g_b`."""

    def probe(*vals):
        def f(w):
            return bind_eqn(eqn, [w if j == index else v for j, v in enumerate(vals)])

        w = vals[index]
        return jax.linear_transpose(f, w)(f(w))

    args = [read_value({}, v) if is_literal(v) else _struct_of(v.aval) for v in eqn.invars]
    try:
        jax.eval_shape(probe, *args)
    except Exception:  # no transpose rule, or not linear there
        return False
    return True


def _block(jaxpr, leaf_struct, others) -> Struct | None:
    """The structure engine's block of `jaxpr`'s output with respect to its first input,
    at the other inputs `others` (canonical), or `None` where it is zero."""
    shape, dtype = tuple(leaf_struct.shape), leaf_struct.dtype
    lin = Lin({0: Struct.identity(shape, dtype)}, shape, dtype)
    (out,) = interpret(Context(in_shapes=[shape]), jaxpr, [], [lin, *others])
    b = out.blocks.get(0) if isinstance(out, Lin) else None
    return None if b is None else b.canonical()


def _at_most_one_per_column(b: Struct | None) -> bool:
    if b is None:
        return False
    if b.ell is None:  # an out axis that is not a delta spreads each entry along it
        return all(
            size == 1 or label in b.in_labels for label, size in zip(b.out_labels, b.out_shape)
        )
    _, columns, live = flat_entries(b)
    return np.bincount(columns[live].ravel(), minlength=1).max() <= 1


def _isometric(b: Struct | None) -> bool:
    """Each out entry is $\\pm$ one in entry, and no two out entries the same one."""
    if b is None or not is_known(b.val) or not np.all(np.abs(b.val) == 1):
        return False
    if b.ell is None:
        tied_in = all(s == 1 or l in b.out_labels for l, s in zip(b.in_labels, b.in_shape))
        return tied_in and _at_most_one_per_column(b)
    _, columns, live = flat_entries(b)
    return bool((live.sum(axis=0) == 1).all()) and _at_most_one_per_column(b)


def _classify(origin: _Origin, eqn, index: int, leaf_struct) -> tuple[UseKind, Any, tuple]:
    start = origin.chain[0].invars[0] if origin.chain else eqn.invars[index]
    other_vars, positions = [], []
    for j, v in enumerate(eqn.invars):
        if j != index and not is_literal(v) and not any(v is u for u in other_vars):
            other_vars.append(v)
            positions.append(j)
    # The chain may cross into a call's sub-program (`jnp.where` is a `jit`), where the
    # same value has another variable: relink each equation to its predecessor's output.
    links, prev = [], start
    for link in origin.chain:
        link = link.replace(invars=[prev])
        links.append(link)
        prev = link.outvars[0]
    invars = list(eqn.invars)
    invars[index] = prev
    use = eqn.replace(invars=invars)
    jaxpr = new_jaxpr([start, *other_vars], [*links, use], [use.outvars[0]])
    chain = new_jaxpr([start], links, [prev])
    found = []

    def probe(*others):
        b = _block(jaxpr, leaf_struct, others)
        chain_block = _block(chain, leaf_struct, [])
        template = None if b is None else b.with_val(_struct_of(b.val))
        found.append((template, _at_most_one_per_column(b), _isometric(chain_block)))
        return 0

    jax.eval_shape(probe, *[_struct_of(v.aval) for v in other_vars])
    ((template, fast, isometric),) = found
    norms = lookup_rule(eqn.primitive, SQUARED_GRADS)
    return UseKind(fast, template, isometric, norms), jaxpr, tuple(positions)


def _analyse(jaxpr, in_origins, path, uses: list, fallback: set) -> list:
    """Walk `jaxpr` from `in_origins` (an `_Origin` per parameter input, `None` for the
    others), appending each use to `uses` and each parameter that takes the `vmap(grad)`
    fallback to `fallback`; returns the origins of the outputs."""

    def apply_eqn(eqn, vals, key):
        derived = [j for j, o in enumerate(vals) if isinstance(o, _Origin)]
        if not derived:
            return [None] * len(eqn.outvars)
        if (
            len(derived) == 1
            and len(eqn.outvars) == 1
            and _is_float(eqn.outvars[0].aval)
            and not any(True for _ in subjaxprs(eqn))
            and _linear_in(eqn, derived[0])
        ):
            (j,) = derived
            origin = vals[j]
            if len(eqn.invars) == 1:
                return [_Origin(origin.leaf, (*origin.chain, eqn))]
            start = origin.chain[0].invars[0] if origin.chain else eqn.invars[j]
            kind, use_jaxpr, positions = _classify(origin, eqn, j, _struct_of(start.aval))
            uses.append(_Use(key, origin.leaf, origin.chain, eqn, j, kind, use_jaxpr, positions))
            return [None]
        fallback.update(vals[j].leaf for j in derived)
        return [None] * len(eqn.outvars)

    def inline(eqn, vals, key):
        return any(isinstance(o, _Origin) for o in vals)

    consts = [None] * len(jaxpr.constvars)
    outs = eval_jaxpr(jaxpr, consts, in_origins, apply_eqn, inline=inline, path=path)
    return [o if isinstance(o, _Origin) else None for o in outs]


def _evaluate(jaxpr, consts, args, path, ctx) -> list:
    """Evaluate `jaxpr`, adding `ctx.perts[key]` to the output of each use and
    recording its other operands in `ctx.records[key]`."""

    def apply_eqn(eqn, vals, key):
        outs = bind_eqn(eqn, vals)
        use = ctx.uses.get(key)
        if use is not None:
            ctx.records[key] = [vals[j] for j in use.positions]
            outs = [outs[0] + ctx.perts[key]]
        return outs

    def inline(eqn, vals, key):
        return key in ctx.prefixes

    return eval_jaxpr(jaxpr, consts, args, apply_eqn, inline=inline, path=path)


@dataclasses.dataclass
class _EvalContext:
    uses: dict
    prefixes: set
    perts: dict
    records: dict


#
# Per-example gradients from recorded operands
#


def _contribution(use: _Use, leaf_struct, others, g):
    """The gradient of one example's loss w.r.t. the leaf through this use."""

    def linear(leaf):
        return eval_jaxpr(use.jaxpr, [], [leaf, *others], bind_eqn)[0]

    (out,) = jax.linear_transpose(linear, leaf_struct)(g)
    return out


def _batched_vals(use: _Use, leaf_struct, others, n: int):
    """The values of the use's block for every example, `(n, *block.val.shape)`."""

    def one(*o):
        b = _block(use.jaxpr, leaf_struct, list(o))
        t = use.kind.block
        assert b is not None and (b.val_labels, b.out_labels, b.in_labels) == (
            t.val_labels,
            t.out_labels,
            t.in_labels,
        )
        return jnp.asarray(b.val)

    return jax.vmap(one, axis_size=n)(*others)


def _apply(b: Struct, w):
    return apply_block(b, w[..., None])[..., 0]


def _fast_sum_squares(use: _Use, leaf_struct, others, g):
    """$\\sum_b (J_b^{\\circ 2})^\\top g_b^2$ from the squared values of the use's block."""
    t = use.kind.block
    assert t is not None
    n = g.shape[0]
    v2 = jnp.square(_batched_vals(use, leaf_struct, others, n))
    g2 = g * g
    if t.ell is None:  # one contraction over the batch: square(x).T @ square(g)
        batch = fresh_label()
        sizes = {**t.sizes, batch: n}
        val, labels = contract(
            [(v2, (batch, *t.val_labels)), (g2, (batch, *t.out_labels))], t.in_labels, sizes
        )
        sq = expand(jnp.asarray(val), labels, t.in_labels, sizes)
    else:

        def squared_use(w):
            return jax.vmap(lambda v: _apply(t.with_val(v), w.astype(v.dtype)))(v2)

        (sq,) = jax.linear_transpose(lambda w: squared_use(w).astype(g2.dtype), leaf_struct)(g2)
    return sq.astype(leaf_struct.dtype)


def _row_sums(b: Struct):
    """$\\sum_i J[o, i]$ for every out position `o` of a block."""
    if b.ell is not None:
        values, _, _ = flat_entries(b)
        return jnp.sum(jnp.asarray(values), axis=1).reshape(b.out_shape)
    sizes = b.sizes
    val, labels = contract([(b.val, b.val_labels)], b.out_labels, sizes)
    # In axes along which the block is constant (a sum) count once per entry.
    factor = math.prod(
        s
        for l, s in zip(b.in_labels, b.in_shape)
        if l not in b.val_labels and l not in b.out_labels
    )
    return expand(jnp.asarray(val) * factor, labels, b.out_labels, sizes)


def _fast_norms(use: _Use, leaf_struct, others, g):
    """$\\|J_b^\\top g_b\\|^2 = \\sum_o g_{bo}^2 \\sum_i J_b[o, i]^2$ for a fast use."""
    t = use.kind.block
    assert t is not None
    vals = _batched_vals(use, leaf_struct, others, g.shape[0])
    return jax.vmap(lambda v, gb: jnp.sum(gb * gb * _row_sums(t.with_val(v * v))))(vals, g)


def _masked_batch_sums(x: Array, mask: Array, powers: tuple[int, ...]) -> tuple[Array, ...]:
    """`sum_b where(mask[b], x[b] ** k, 0)` over the leading axis, for each `k` in
    `powers` (1: the gradient, 2: the squared gradients), from one read of `x`.

    XLA's CPU backend reduces over a leading axis with a strided loop, several times
    slower than reading `x` (for the per-example gradients of a transformer block, most
    of the run time). There the sums run example by example, each step a contiguous,
    fused add; elsewhere (GPUs reduce over any axis well) each is one reduction.
    """
    return jax.lax.platform_dependent(
        x,
        mask,
        cpu=lambda x, mask: _sums_by_example(x, mask, powers),
        default=lambda x, mask: _sums_at_once(x, mask, powers),
    )


def _sums_by_example(x: Array, mask: Array, powers: tuple[int, ...]) -> tuple[Array, ...]:
    # Blocks of about sqrt(n) examples, summed one by one and then added up: rounding
    # grows like 2 sqrt(n) rather than n (float32, n = 16384: 1e-6 relative, not 6e-6).
    n = x.shape[0]
    block = math.isqrt(n - 1) + 1
    zeros = tuple(jnp.zeros(x.shape[1:], x.dtype) for _ in powers)

    def add_example(b, sums):
        xb = jnp.where(mask[b], x[b], 0)
        return tuple(s + xb**k for s, k in zip(sums, powers))

    def add_block(i, totals):
        start = i * block
        part = jax.lax.fori_loop(start, jnp.minimum(start + block, n), add_example, zeros)
        return tuple(t + s for t, s in zip(totals, part))

    return jax.lax.fori_loop(0, -(-n // block), add_block, zeros)


def _sums_at_once(x: Array, mask: Array, powers: tuple[int, ...]) -> tuple[Array, ...]:
    x = jnp.where(mask.reshape(-1, *(1,) * (x.ndim - 1)), x, 0)
    return tuple(jnp.sum(x**k, axis=0) for k in powers)


def _chunked(fn, xs, n: int, chunk: int):
    """Apply `fn(xs_chunk, mask) -> (sums, per_example)` over chunks of the leading axis
    of `xs`, adding up `sums` and concatenating `per_example` (trimmed to `n`)."""
    if chunk >= n:
        return fn(xs, jnp.ones((n,), bool))
    n_chunks = -(-n // chunk)
    chunk = -(-n // n_chunks)  # as even as possible: at most n_chunks - 1 padding
    pad = n_chunks * chunk - n

    def split(x):
        # Pad with copies of the last example (masked out later) so that the padding
        # evaluates `loss_fn` on valid inputs.
        x = jnp.concatenate([x, jnp.repeat(x[-1:], pad, axis=0)])
        return x.reshape(n_chunks, chunk, *x.shape[1:])

    mask = (jnp.arange(n_chunks * chunk) < n).reshape(n_chunks, chunk)
    xs = jtu.tree_map(split, xs)
    sums_shape, _ = jax.eval_shape(fn, jtu.tree_map(lambda x: x[0], xs), mask[0])
    init = jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape)

    def body(carry, inputs):
        sums, per_example = fn(*inputs)
        return jtu.tree_map(jnp.add, carry, sums), per_example

    sums, per_example = jax.lax.scan(body, init, (xs, mask))
    per_example = jtu.tree_map(lambda y: y.reshape(n_chunks * chunk, *y.shape[2:])[:n], per_example)
    return sums, per_example


#
# The driver
#


def _loss_name(loss_fn) -> str:
    """`loss_fn` as the error messages name it: the argument, and the function's own name
    where it has another."""
    name = getattr(loss_fn, "__name__", None)
    return "`loss_fn`" if name in (None, "loss_fn") else f"`loss_fn` (`{name}`)"


def _check_batch(fn_name: str, loss_fn, batch) -> tuple[list, Any, int]:
    name = _loss_name(loss_fn)
    if len(batch) == 0:
        raise ValueError(
            f"`diffrax_linearize.{fn_name}` needs at least one batch argument: call "
            f"it as `{fn_name}(loss_fn, params, *batch)`, where `loss_fn(params, "
            "*example)` takes one example and every leaf of `batch` has a leading "
            "batch axis."
        )
    leaves, treedef = jtu.tree_flatten(batch)
    sizes = {}
    for path, leaf in jtu.tree_flatten_with_path(batch)[0]:
        shape = jnp.shape(leaf)
        if len(shape) == 0:
            raise ValueError(
                f"`diffrax_linearize.{fn_name}`: the batch leaf at "
                f"`batch{jtu.keystr(path)}` for {name} is a scalar; every "
                "leaf of `batch` needs a leading batch axis. Close over per-batch "
                "constants in `loss_fn` instead of passing them as batch arguments."
            )
        sizes.setdefault(shape[0], []).append(f"batch{jtu.keystr(path)}")
    if len(sizes) != 1:
        detail = "; ".join(f"size {s}: {', '.join(p)}" for s, p in sizes.items())
        raise ValueError(
            f"`diffrax_linearize.{fn_name}`: the batch arguments of {name} "
            f"have mismatched leading (batch) axes ({detail}). Every leaf of `batch` "
            "must have the same leading axis, one entry per example."
        )
    (n,) = sizes
    if n == 0:
        raise ValueError(f"`diffrax_linearize.{fn_name}`: the batch is empty.")
    return leaves, treedef, n


def _check_loss_output(fn_name: str, loss_fn, out_shape) -> None:
    array = isinstance(out_shape, jax.ShapeDtypeStruct)
    if array and out_shape.shape == () and jnp.issubdtype(out_shape.dtype, jnp.floating):
        return
    if not array:
        got, fix = (
            f"a pytree ({jtu.tree_structure(out_shape)})",
            "Return the loss alone, a scalar (auxiliary outputs are not supported)",
        )
    elif out_shape.shape != ():
        got, fix = (
            f"an array of shape {out_shape.shape}",
            "Reduce its output to a scalar (e.g. `jnp.sum`) inside `loss_fn`; the batch "
            "axis is added by `diffrax_linearize`",
        )
    elif jnp.issubdtype(out_shape.dtype, jnp.complexfloating):
        got, fix = (
            f"a {out_shape.dtype} scalar",
            "Return a real loss, e.g. `jnp.abs(z) ** 2` or `jnp.real(z)` of a complex `z`",
        )
    else:
        got, fix = (
            f"a {out_shape.dtype} scalar",
            "Compute the loss in floating point: integer and boolean values have no gradient",
        )
    raise ValueError(
        f"`diffrax_linearize.{fn_name}`: {_loss_name(loss_fn)} must return a real "
        f"floating scalar for one example, but returned {got}. {fix}."
    )


def _compute(
    fn_name: str,
    loss_fn: Callable,
    params,
    batch,
    *,
    want_grad: bool,
    want_sq: bool,
    want_norms: bool,
    chunk_size: int | None,
):
    batch_leaves, batch_def, n = _check_batch(fn_name, loss_fn, batch)
    param_leaves, param_def = jtu.tree_flatten(params)
    diff_index = [i for i, x in enumerate(param_leaves) if eqx.is_inexact_array(x)]
    if not diff_index:
        # `jax.grad` raises for integer inputs; `equinox.filter_grad` would return only
        # `None`s, which here would be a gradient of nothing: norms of zero, silently.
        kinds = sorted({str(getattr(x, "dtype", type(x).__name__)) for x in param_leaves})
        raise TypeError(
            f"`diffrax_linearize.{fn_name}`: `params` has no floating-point array "
            f"leaves to differentiate (its leaves are {', '.join(kinds) or 'none'}). "
            "Non-floating leaves are held fixed, as with `equinox.filter_grad`; pass the "
            "parameters as floating arrays, e.g. `jnp.asarray(params, dtype=float)`."
        )
    diff_leaves = [jnp.asarray(param_leaves[i]) for i in diff_index]
    batch_leaves = [jnp.asarray(x) for x in batch_leaves]
    n_diff = len(diff_leaves)

    def per_example_loss(diff, example):
        leaves = list(param_leaves)
        for i, x in zip(diff_index, diff):
            leaves[i] = x
        p = jtu.tree_unflatten(param_def, leaves)
        return loss_fn(p, *jtu.tree_unflatten(batch_def, example))

    diff_structs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in diff_leaves]
    example_structs = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in batch_leaves]
    closed, out_shape = jax.make_jaxpr(per_example_loss, return_shape=True)(
        diff_structs, example_structs
    )
    _check_loss_output(fn_name, loss_fn, out_shape)

    uses: list[_Use] = []
    fallback: set[int] = set()
    outs = _analyse(
        closed.jaxpr,
        [_Origin(i, ()) for i in range(n_diff)] + [None] * len(batch_leaves),
        (),
        uses,
        fallback,
    )
    fallback.update(o.leaf for o in outs if o is not None)
    fallback.update(
        i for i, x in enumerate(diff_leaves) if not jnp.issubdtype(x.dtype, jnp.floating)
    )
    uses = [u for u in uses if u.leaf not in fallback]
    by_leaf: dict[int, list[_Use]] = {}
    for u in uses:
        by_leaf.setdefault(u.leaf, []).append(u)

    # One backward pass: per-example output cotangents of every use, and the gradient.
    use_map = {u.key: u for u in uses}
    prefixes = {u.key[:k] for u in uses for k in range(1, len(u.key))}
    perts = {
        u.key: jnp.zeros((n, *u.eqn.outvars[0].aval.shape), u.eqn.outvars[0].aval.dtype)
        for u in uses
    }

    def fast_squares(leaf: int) -> bool:
        leaf_uses = by_leaf.get(leaf, [])
        return len(leaf_uses) == 1 and leaf_uses[0].kind.fast

    # The gradient of a leaf whose per-example gradients are formed below is their sum:
    # the backward pass differentiates only the others (no second weight contraction).
    in_pass = [
        i
        for i in range(n_diff)
        if want_grad and not (want_sq and (i in fallback or (i in by_leaf and not fast_squares(i))))
    ]

    def one_example(diff, pert, example):
        ctx = _EvalContext(use_map, prefixes, pert, {})
        (loss,) = _evaluate(closed.jaxpr, closed.consts, [*diff, *example], (), ctx)
        return loss, ctx.records

    def total(pass_leaves, pert):
        diff = list(diff_leaves)
        for i, x in zip(in_pass, pass_leaves):
            diff[i] = x
        losses, records = jax.vmap(one_example, in_axes=(None, 0, 0))(diff, pert, batch_leaves)
        return jnp.sum(losses), records

    (loss, records), (pass_grads, cotangents) = jax.value_and_grad(
        total, argnums=(0, 1), has_aux=True
    )([diff_leaves[i] for i in in_pass], perts)
    grads: dict[int, Array] = dict(zip(in_pass, pass_grads))

    sq: dict[int, Array] = {}
    norms = jnp.zeros((n,), common_dtype(*diff_leaves) if diff_leaves else float)
    structs = {i: jax.ShapeDtypeStruct(x.shape, x.dtype) for i, x in enumerate(diff_leaves)}
    per_example_leaves = []  # leaves whose per-example gradients are formed
    for leaf, leaf_uses in by_leaf.items():
        single = len(leaf_uses) == 1
        u = leaf_uses[0]
        others, g = records[u.key], cotangents[u.key]
        need_sq, need_norms = want_sq, want_norms
        if want_sq and fast_squares(leaf):
            sq[leaf] = _fast_sum_squares(u, structs[leaf], others, g)
            need_sq = False
        if single and want_norms:
            leaf_norms = None
            if u.kind.fast:
                leaf_norms = _fast_norms(u, structs[leaf], others, g)
            elif u.kind.norms is not None and u.kind.isometric:
                leaf_norms = u.kind.norms(u.eqn, u.index, others, g)
            if leaf_norms is not None:
                norms = norms + leaf_norms
                need_norms = False
        if need_sq or need_norms:
            per_example_leaves.append(leaf)

    # Per-example gradients, in chunks: from the recorded operands and cotangents of
    # the uses, and by `vmap(grad)` for parameters with a use that has no rule.
    fallback_leaves = sorted(fallback)
    chunked_leaves = per_example_leaves + fallback_leaves
    if chunked_leaves:
        bytes_per_example = sum(
            diff_leaves[i].size * diff_leaves[i].dtype.itemsize for i in chunked_leaves
        )
        if fallback_leaves:  # the forward pass of one example is held too
            bytes_per_example *= 4
        chunk = chunk_size or max(1, _CHUNK_BYTES // max(1, bytes_per_example))
        loss_of = jaxpr_as_fun(closed)

        def per_example_grads(xs, mask):
            recs, cots, example = xs
            out = {}
            for leaf in per_example_leaves:
                total_grad = 0
                for u in by_leaf[leaf]:
                    contrib = jax.vmap(lambda o, gb, u=u: _contribution(u, structs[leaf], o, gb))(
                        recs[u.key], cots[u.key]
                    )
                    total_grad = total_grad + contrib
                out[leaf] = total_grad
            if fallback_leaves:

                def loss_fb(fb, ex):
                    diff = list(diff_leaves)
                    for i, x in zip(fallback_leaves, fb):
                        diff[i] = x
                    (value,) = loss_of(*diff, *ex)
                    return value

                fb = [diff_leaves[i] for i in fallback_leaves]
                fb_grads = jax.vmap(jax.grad(loss_fb), in_axes=(None, 0))(fb, example)
                out.update(zip(fallback_leaves, fb_grads))
            grad_sums, sq_sums, pe_norms = {}, {}, jnp.zeros(mask.shape, norms.dtype)
            powers = (1,) * want_grad + (2,) * want_sq
            for leaf, grad_b in out.items():
                if powers:
                    sums = _masked_batch_sums(grad_b, mask, powers)
                    if want_grad:
                        grad_sums[leaf] = sums[0]
                    if want_sq:
                        sq_sums[leaf] = sums[-1]
                if want_norms:  # padding rows are dropped by `_chunked`
                    flat = grad_b.reshape(grad_b.shape[0], -1)
                    pe_norms = pe_norms + jnp.sum(flat * flat, axis=1)
            return (grad_sums, sq_sums), pe_norms

        recs = {u.key: records[u.key] for leaf in per_example_leaves for u in by_leaf[leaf]}
        cots = {k: cotangents[k] for k in recs}
        example = batch_leaves if fallback_leaves else []
        (grad_sums, sq_sums), pe_norms = _chunked(
            per_example_grads, (recs, cots, example), n, chunk
        )
        grads.update(grad_sums)
        sq.update(sq_sums)
        norms = norms + pe_norms
    assert not want_grad or len(grads) == n_diff

    def assemble(values: dict[int, Array]):
        # A leaf the loss never uses has zero squared gradients.
        leaves: list[Any] = [None] * len(param_leaves)
        for j, i in enumerate(diff_index):
            leaves[i] = values.get(j, jnp.zeros_like(diff_leaves[j]))
        return jtu.tree_unflatten(param_def, leaves)

    return (
        loss,
        assemble(grads) if want_grad else None,
        assemble(sq) if want_sq else None,
        norms if want_norms else None,
    )


def sum_squared_grads(
    loss_fn: Callable[..., Float[Array, ""]],
    params: PyTree,
    *batch: PyTree,
    chunk_size: int | None = None,
) -> PyTree:
    """The sum over a batch of the squared per-example gradients,
    $\\sum_b (\\nabla_\\theta \\ell(\\theta, x_b))^2$ (the diagonal of $J^\\top J$),
    without forming every per-example gradient.

    Equal to `jax.tree.map(lambda g: jnp.sum(g**2, 0), jax.vmap(jax.grad(loss_fn),
    in_axes=(None, 0, ...))(params, *batch))`. For a parameter used once by a dense
    layer this is `square(x).T @ square(g)` from the layer's inputs `x` and output
    cotangents `g`; see [`diffrax_linearize.value_grad_and_sum_squared_grads`][] for
    how other parameters are treated.

    **Arguments:**

    - `loss_fn`: called as `loss_fn(params, *example)` for *one* example; must return
        a real floating scalar. Any JAX-traceable function: plain functions, equinox,
        flax or haiku models alike.
    - `params`: a pytree of parameters. Floating array leaves are differentiated;
        other leaves (integers, Python scalars, functions) are held fixed and their
        entries in the output are `None`, as with `equinox.filter_grad`. At least one
        leaf must be a floating array (else a `TypeError`, as from `jax.grad`).
    - `*batch`: pytrees whose array leaves all share a leading batch axis; example
        `b` is `jax.tree.map(lambda x: x[b], batch)`.
    - `chunk_size`: examples per chunk where per-example gradients must be formed
        (parameters used several times, with shared axes, or consumed nonlinearly).
        Default: chosen to keep about 64 MiB of them at once.

    **Returns:**

    A pytree like `params` holding the sums of squares (`None` for leaves that are
    not floating arrays).
    """
    _, _, sq, _ = _compute(
        "sum_squared_grads",
        loss_fn,
        params,
        batch,
        want_grad=False,
        want_sq=True,
        want_norms=False,
        chunk_size=chunk_size,
    )
    return sq


def value_grad_and_sum_squared_grads(
    loss_fn: Callable[..., Float[Array, ""]],
    params: PyTree,
    *batch: PyTree,
    chunk_size: int | None = None,
) -> tuple[Float[Array, ""], PyTree, PyTree]:
    """The summed loss, its gradient and the sum of squared per-example gradients,
    from one backward pass (what an adaptive optimiser needs).

    The parameters' uses are found in the jaxpr of `loss_fn` for one example.
    A parameter used once, where the structure engine finds that each parameter entry
    reaches at most one output entry (dense layers without shared axes, biases,
    elementwise scales, slices and reshapes of them), takes
    $\\sum_b (J_b^{\\circ 2})^\\top g_b^2$; one used several times, with shared axes
    (sequence positions, convolutions) or through a broadcast forms its per-example
    gradients from the recorded operands and cotangents, in chunks; one consumed
    nonlinearly before any linear use (e.g. by `sort`) takes `vmap(grad)` for that
    parameter only, in chunks. All paths are exact.

    **Arguments:**

    - `loss_fn`: called as `loss_fn(params, *example)` for *one* example; must return
        a real floating scalar. Any JAX-traceable function: plain functions, equinox,
        flax or haiku models alike.
    - `params`: a pytree of parameters. Floating array leaves are differentiated;
        other leaves (integers, Python scalars, functions) are held fixed and their
        entries in the output are `None`, as with `equinox.filter_grad`. At least one
        leaf must be a floating array (else a `TypeError`, as from `jax.grad`).
    - `*batch`: pytrees whose array leaves all share a leading batch axis; example
        `b` is `jax.tree.map(lambda x: x[b], batch)`.
    - `chunk_size`: examples per chunk where per-example gradients must be formed
        (parameters used several times, with shared axes, or consumed nonlinearly).
        Default: chosen to keep about 64 MiB of them at once.

    **Returns:**

    A tuple `(loss, grad, squared_sums)`: the sum of `loss_fn` over the batch, its
    gradient w.r.t. `params`, and the sums of squared per-example gradients (pytrees
    like `params`, `None` for leaves that are not floating arrays).
    """
    loss, grad, sq, _ = _compute(
        "value_grad_and_sum_squared_grads",
        loss_fn,
        params,
        batch,
        want_grad=True,
        want_sq=True,
        want_norms=False,
        chunk_size=chunk_size,
    )
    return loss, grad, sq


def per_example_grad_norms(
    loss_fn: Callable[..., Float[Array, ""]],
    params: PyTree,
    *batch: PyTree,
    chunk_size: int | None = None,
) -> Float[Array, " batch"]:
    """The L2 norm of each example's gradient (over all floating leaves of `params`),
    without forming every per-example gradient.

    For a dense layer used once this is $\\|g_b\\|\\,\\|x_b\\|$ (Opacus' ghost norm);
    with shared axes (sequence positions) the Gram form
    $\\sum_{t,s} (x_{bt}\\cdot x_{bs})(g_{bt}\\cdot g_{bs})$ or the per-example
    contraction, whichever needs fewer operations.

    **Arguments:**

    - `loss_fn`: called as `loss_fn(params, *example)` for *one* example; must return
        a real floating scalar. Any JAX-traceable function: plain functions, equinox,
        flax or haiku models alike.
    - `params`: a pytree of parameters, such as a whole Equinox module. Floating
        array leaves are differentiated; other leaves (integers, Python scalars,
        functions) are held fixed, as with `equinox.filter_grad`, and add nothing to
        the norms. At least one leaf must be a floating array (else a `TypeError`, as
        from `jax.grad`).
    - `*batch`: pytrees whose array leaves all share a leading batch axis; example
        `b` is `jax.tree.map(lambda x: x[b], batch)`.
    - `chunk_size`: examples per chunk where per-example gradients must be formed
        (parameters used several times, with shared axes, or consumed nonlinearly).
        Default: chosen to keep about 64 MiB of them at once.

    **Returns:**

    The `(B,)` array of per-example gradient norms.
    """
    _, _, _, norms = _compute(
        "per_example_grad_norms",
        loss_fn,
        params,
        batch,
        want_grad=False,
        want_sq=False,
        want_norms=True,
        chunk_size=chunk_size,
    )
    assert norms is not None
    return jnp.sqrt(norms)
