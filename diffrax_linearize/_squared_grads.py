"""Sums of squared per-example gradients (the diagonal of $J^\\top J$) and per-example
gradient norms, found from the jaxpr of the loss instead of from `vmap(grad)`.

How it works:

1. `loss_fn` is traced for *one* example. Every equation that consumes a parameter,
   possibly after cheap structural operations (transpose, reshape, convert, neg, slice,
   broadcast), is a *use*; a per-primitive rule in `_USE_RULES` says whether the
   primitive is linear in that operand, and whether each parameter entry reaches at
   most one output entry (then squares commute with the transpose of the use).
2. One backward pass over the batch gives the output cotangent `g` of every use: a zero
   perturbation is added to each use's output and differentiated together with the
   parameters. The use's other operands (activations `x`) are recorded on the way.
3. Per parameter: a single use whose entries reach at most one output entry takes
   $\\sum_b (J_b^\\top g_b)^2 = \\sum_b (J_b^{\\circ 2})^\\top g_b^2$ (for a dense layer
   `square(x).T @ square(g)`); anything else forms its per-example gradients from the
   recorded `x` and `g` (summed over its uses), in chunks; a parameter consumed by a
   primitive without a rule takes `vmap(grad)` for that parameter only, in chunks.
"""

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.extend.core import (
    ClosedJaxpr,
    Jaxpr,
    jaxpr_as_fun,
    JaxprEqn,
    Literal,
    Primitive,
    primitives as prims,
)
from jaxtyping import Array, Float, PyTree


# Upper bound on the bytes of per-example gradients held at once by the chunked paths.
_CHUNK_BYTES = 2**26


#
# Rule registries
#


@dataclasses.dataclass(frozen=True)
class UseKind:
    """How a primitive uses one of its operands, as reported by a use rule.

    **Arguments:**

    - `fast`: whether every entry of the operand reaches at most one entry of the
        output (for one example). Then the squared per-example gradients sum as
        $\\sum_b (J_b^{\\circ 2})^\\top g_b^2$ and `squared` must be given.
    - `squared`: `squared(w, others)` evaluates the linear map whose Jacobian is the
        elementwise square of the primitive's Jacobian in the operand, at `w`, where
        `others` are the remaining operands (in order, unsquared).
    - `norms`: optional `norms(others, g)` returning the `(B,)` squared norms
        of the per-example gradients of the operand from batched `others` and output
        cotangents `g`, or `None` to use the generic per-example computation.
    """

    fast: bool
    squared: Callable[[Array, Sequence[Any]], Array] | None = None
    norms: Callable[..., Array | None] | None = None


# primitive -> rule(eqn, operand_index) -> UseKind | None (None: not linear there).
_USE_RULES: dict[Primitive, Callable[[JaxprEqn, int], UseKind | None]] = {}
# primitive -> rule(eqn) -> bool: a one-operand linear map whose Jacobian has at most
# one nonzero per column, entries +-1 (True), or linear otherwise (False).
_STRUCTURAL_RULES: dict[Primitive, Callable[[JaxprEqn], bool]] = {}
# Call-like primitives whose sub-jaxpr is inlined (same values and derivatives).
_INLINE: dict[Primitive, str] = {
    prims.jit_p: "jaxpr",
    prims.closed_call_p: "call_jaxpr",
    prims.remat_p: "jaxpr",
}


def register_use_rule(prim: Primitive):
    """Register a use rule for `prim` (a decorator).

    The rule is called as `rule(eqn, index)` for an equation `eqn` whose operand
    `index` is derived from exactly one parameter; it returns a `UseKind` if the
    output is linear in that operand (the other operands held fixed), else `None`.
    A primitive without a rule takes the exact `vmap(grad)` fallback for the parameter.
    """

    def _register(rule):
        _USE_RULES[prim] = rule
        return rule

    return _register


def register_structural_rule(prim: Primitive):
    """Register a structural (one-operand, linear) primitive that a parameter is
    followed through (a decorator). The rule returns whether each output entry comes
    from exactly one input entry with coefficient $\\pm 1$ and each input entry reaches
    at most one output entry (a signed partial permutation).

    **Arguments:**

    - `prim`: the `jax.extend.core.Primitive` the decorated rule is for.
    """

    def _register(rule):
        _STRUCTURAL_RULES[prim] = rule
        return rule

    return _register


def _bind(eqn: JaxprEqn, *args):
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # older JAX: (subfuns, params)
        subfuns, params = params
        args = (*subfuns, *args)
    out = eqn.primitive.bind(*args, **params)
    return out if eqn.primitive.multiple_results else [out]


def _insert(others: Sequence[Any], index: int, w) -> list:
    args = list(others)
    args.insert(index, w)
    return args


def _same_shape(eqn: JaxprEqn, index: int) -> bool:
    return tuple(eqn.invars[index].aval.shape) == tuple(eqn.outvars[0].aval.shape)


def _squared_bind(eqn: JaxprEqn, index: int):
    def squared(w, others):
        return _bind(eqn, *_insert([o * o for o in others], index, w))[0]

    return squared


def _identity_squared(w, others):
    del others
    return w


for _p in (prims.transpose_p, prims.reshape_p, prims.squeeze_p, prims.rev_p):
    register_structural_rule(_p)(lambda eqn: True)
for _p in (prims.convert_element_type_p, prims.copy_p, prims.reduce_precision_p):
    register_structural_rule(_p)(lambda eqn: True)
register_structural_rule(prims.neg_p)(lambda eqn: True)
register_structural_rule(prims.slice_p)(lambda eqn: True)


@register_structural_rule(prims.broadcast_in_dim_p)
def _broadcast_rule(eqn):
    return math.prod(eqn.outvars[0].aval.shape) == math.prod(eqn.invars[0].aval.shape)


@register_use_rule(prims.add_p)
@register_use_rule(prims.sub_p)
@register_use_rule(prims.add_any_p if hasattr(prims, "add_any_p") else prims.add_jaxvals_p)
def _add_rule(eqn, index):
    fast = _same_shape(eqn, index)
    return UseKind(fast=fast, squared=_identity_squared if fast else None)


@register_use_rule(prims.mul_p)
def _mul_rule(eqn, index):
    fast = _same_shape(eqn, index)
    return UseKind(fast=fast, squared=_squared_bind(eqn, index) if fast else None)


@register_use_rule(prims.div_p)
def _div_rule(eqn, index):
    if index != 0:
        return None
    fast = _same_shape(eqn, index)
    return UseKind(fast=fast, squared=_squared_bind(eqn, index) if fast else None)


@register_use_rule(prims.reduce_sum_p)
@register_use_rule(prims.cumsum_p)
@register_use_rule(prims.conv_general_dilated_p)
def _linear_rule(eqn, index):
    del eqn, index
    return UseKind(fast=False)


def _dot_general_layout(eqn: JaxprEqn, index: int):
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


@register_use_rule(prims.dot_general_p)
def _dot_general_rule(eqn, index):
    _, _, (k, c, t, f) = _dot_general_layout(eqn, index)

    def norms(others, g):
        # ||dW_b||^2 from x (B, K, C, T) and g (B, K, T, F): the outer-product form for
        # T == 1, the Gram form when T^2 (C + F) <= T C F, else per-example (None).
        if t != 1 and t * (c + f) > c * f:
            return None
        (xb, xc, xf), (ob, oxf, owf), _ = _dot_general_layout(eqn, index)
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

    fast = t == 1
    return UseKind(fast=fast, squared=_squared_bind(eqn, index) if fast else None, norms=norms)


#
# Analysis of the per-example jaxpr
#


@dataclasses.dataclass(frozen=True)
class _Origin:
    leaf: int
    chain: tuple[JaxprEqn, ...]


@dataclasses.dataclass(frozen=True)
class _Use:
    key: tuple[int, ...]
    leaf: int
    chain: tuple[JaxprEqn, ...]
    eqn: JaxprEqn
    index: int
    kind: UseKind

    @property
    def injective(self) -> bool:
        return all(_STRUCTURAL_RULES[e.primitive](e) for e in self.chain)


def _sub_jaxpr(eqn: JaxprEqn) -> tuple[Jaxpr, Sequence[Any]]:
    sub = eqn.params[_INLINE[eqn.primitive]]
    if isinstance(sub, ClosedJaxpr):
        return sub.jaxpr, sub.consts
    return sub, ()


def _is_float(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.floating)


def _analyse(jaxpr: Jaxpr, in_origins, path, uses: list, fallback: set) -> list:
    env = {v: o for v, o in zip(jaxpr.invars, in_origins) if o is not None}

    def read(v):
        return None if isinstance(v, Literal) else env.get(v)

    for i, eqn in enumerate(jaxpr.eqns):
        key = (*path, i)
        ins = [read(v) for v in eqn.invars]
        derived = [j for j, o in enumerate(ins) if o is not None]
        if not derived:
            continue
        if eqn.primitive in _INLINE:
            sub, _ = _sub_jaxpr(eqn)
            outs = _analyse(sub, ins, key, uses, fallback)
            env.update((v, o) for v, o in zip(eqn.outvars, outs) if o is not None)
            continue
        if len(derived) == 1 and all(_is_float(v.aval) for v in eqn.outvars):
            (j,) = derived
            origin = ins[j]
            if eqn.primitive in _STRUCTURAL_RULES and len(eqn.invars) == 1:
                env[eqn.outvars[0]] = _Origin(origin.leaf, (*origin.chain, eqn))
                continue
            rule = _USE_RULES.get(eqn.primitive)
            kind = None if rule is None else rule(eqn, j)
            if kind is not None:
                uses.append(_Use(key, origin.leaf, origin.chain, eqn, j, kind))
                continue
        fallback.update(ins[j].leaf for j in derived)
    return [read(v) for v in jaxpr.outvars]


def _evaluate(jaxpr: Jaxpr, consts, args, path, ctx) -> list:
    """Evaluate `jaxpr`, adding `ctx.perts[key]` to the output of each use and
    recording its other operands in `ctx.records[key]`."""
    env = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for i, eqn in enumerate(jaxpr.eqns):
        key = (*path, i)
        invals = [read(v) for v in eqn.invars]
        if eqn.primitive in _INLINE and key in ctx.prefixes:
            sub, sub_consts = _sub_jaxpr(eqn)
            outvals = _evaluate(sub, sub_consts, invals, key, ctx)
        else:
            outvals = _bind(eqn, *invals)
            use = ctx.uses.get(key)
            if use is not None:
                ctx.records[key] = [x for j, x in enumerate(invals) if j != use.index]
                outvals = [outvals[0] + ctx.perts[key]]
        env.update(zip(eqn.outvars, outvals))
    return [read(v) for v in jaxpr.outvars]


@dataclasses.dataclass
class _EvalContext:
    uses: dict
    prefixes: set
    perts: dict
    records: dict


#
# Per-example gradients from recorded operands
#


def _apply_chain(chain, w, *, squared: bool):
    for eqn in chain:
        if squared and eqn.primitive is prims.neg_p:
            continue
        (w,) = _bind(eqn, w)
    return w


def _use_value(use: _Use, w, others):
    return _bind(use.eqn, *_insert(others, use.index, w))[0]


def _contribution(use: _Use, leaf_struct, others, g):
    """The gradient of one example's loss w.r.t. the leaf through this use."""

    def linear(leaf):
        return _use_value(use, _apply_chain(use.chain, leaf, squared=False), others)

    (out,) = jax.linear_transpose(linear, leaf_struct)(g)
    return out


def _fast_sum_squares(use: _Use, leaf_struct, others, g):
    """$\\sum_b (J_b^{\\circ 2})^\\top g_b^2$, mapped back through the chain."""
    assert use.kind.squared is not None
    w_aval = use.eqn.invars[use.index].aval
    w_struct = jax.ShapeDtypeStruct(w_aval.shape, w_aval.dtype)

    def squared_use(w):
        return jax.vmap(lambda o: use.kind.squared(w, o))(others)

    (sq,) = jax.linear_transpose(squared_use, w_struct)(g * g)
    (sq,) = jax.linear_transpose(
        lambda leaf: _apply_chain(use.chain, leaf, squared=True), leaf_struct
    )(sq)
    return sq


def _fast_norms(use: _Use, others, g):
    assert use.kind.squared is not None
    w_aval = use.eqn.invars[use.index].aval
    w_struct = jax.ShapeDtypeStruct(w_aval.shape, w_aval.dtype)

    def one(o, gb):
        (sq,) = jax.linear_transpose(lambda w: use.kind.squared(w, o), w_struct)(gb * gb)
        return jnp.sum(sq)

    return jax.vmap(one)(others, g)


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
        return len(leaf_uses) == 1 and leaf_uses[0].injective and leaf_uses[0].kind.fast

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
    norms = jnp.zeros((n,), jnp.result_type(*diff_leaves) if diff_leaves else float)
    structs = {i: jax.ShapeDtypeStruct(x.shape, x.dtype) for i, x in enumerate(diff_leaves)}
    per_example_leaves = []  # leaves whose per-example gradients are formed
    for leaf, leaf_uses in by_leaf.items():
        single = len(leaf_uses) == 1 and leaf_uses[0].injective
        u = leaf_uses[0]
        others, g = records[u.key], cotangents[u.key]
        need_sq, need_norms = want_sq, want_norms
        if want_sq and fast_squares(leaf):
            sq[leaf] = _fast_sum_squares(u, structs[leaf], others, g)
            need_sq = False
        if single and want_norms:
            leaf_norms = None if u.kind.norms is None else u.kind.norms(others, g)
            if leaf_norms is None and u.kind.fast:
                leaf_norms = _fast_norms(u, others, g)
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
        entries in the output are `None`, as with `equinox.filter_grad`.
    - `*batch`: pytrees whose array leaves all share a leading batch axis; example
        `b` is `jax.tree.map(lambda x: x[b], batch)`.
    - `chunk_size`: examples per chunk where per-example gradients must be formed
        (parameters used several times, with shared axes, or consumed by a primitive
        without a rule). Default: chosen to keep about 64 MiB of them at once.

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
    A parameter used once, through a primitive where each parameter entry reaches at
    most one output entry (dense layers without shared axes, biases, elementwise
    scales), takes $\\sum_b (J_b^{\\circ 2})^\\top g_b^2$; one used several times, with
    shared axes (sequence positions, convolutions) or through a broadcast forms its
    per-example gradients from the recorded operands and cotangents, in chunks; one
    consumed by a primitive without a rule (e.g. `sort`) takes `vmap(grad)` for that
    parameter only, in chunks. All paths are exact.

    **Arguments:**

    - `loss_fn`: called as `loss_fn(params, *example)` for *one* example; must return
        a real floating scalar. Any JAX-traceable function: plain functions, equinox,
        flax or haiku models alike.
    - `params`: a pytree of parameters. Floating array leaves are differentiated;
        other leaves (integers, Python scalars, functions) are held fixed and their
        entries in the output are `None`, as with `equinox.filter_grad`.
    - `*batch`: pytrees whose array leaves all share a leading batch axis; example
        `b` is `jax.tree.map(lambda x: x[b], batch)`.
    - `chunk_size`: examples per chunk where per-example gradients must be formed
        (parameters used several times, with shared axes, or consumed by a primitive
        without a rule). Default: chosen to keep about 64 MiB of them at once.

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
    - `params`: a pytree of parameters. Floating array leaves are differentiated;
        other leaves (integers, Python scalars, functions) are held fixed and their
        entries in the output are `None`, as with `equinox.filter_grad`.
    - `*batch`: pytrees whose array leaves all share a leading batch axis; example
        `b` is `jax.tree.map(lambda x: x[b], batch)`.
    - `chunk_size`: examples per chunk where per-example gradients must be formed
        (parameters used several times, with shared axes, or consumed by a primitive
        without a rule). Default: chosen to keep about 64 MiB of them at once.

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
