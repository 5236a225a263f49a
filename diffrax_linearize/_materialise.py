import contextlib
import functools
import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any, get_args

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import lineax as lx
import numpy as np
from jax.dtypes import float0

from . import _loops as _loops, _rules as _rules  # noqa: F401  (register the structure rules)
from ._colouring import colour_columns, pattern_of
from ._compat import bind_eqn, dce_jaxpr, is_literal, prim
from ._custom_types import all_finite, common_dtype, MaterialiseMode, mixed_dtypes
from ._interpreter import (
    call_jaxpr,
    Context,
    eval_jaxpr,
    evaluate_known,
    interpret,
    iter_eqns,
    jvp_may_add_constants,
    known,
    Lin,
    map_columns,
    split_of,
    subjaxprs,
)
from ._loops import is_cell_loop, unrolled
from ._operators import dense_from_parts, sparse_operator, SparseLinearOperator
from ._sparsity import describe, reshape_in, to_dense, too_full, transpose
from ._structure import Ell, Struct


# ---- argument checking ----------------------------------------------------------------


def _is_array_leaf(x) -> bool:
    return isinstance(
        x, jax.Array | np.ndarray | np.generic | float | int | complex
    ) and not isinstance(x, bool)


def _check_argnums(argnums, nargs: int, api: str) -> tuple[int, ...]:
    if isinstance(argnums, int):
        nums = (argnums,)
    elif isinstance(argnums, tuple | list):
        nums = tuple(argnums)
    else:  # not iterable (`1.0`), or iterable but not a sequence of positions (`"0"`)
        nums = ()
    if not nums or not all(isinstance(i, int) for i in nums):
        raise TypeError(
            f"`{api}`: `argnums` must be an int or a non-empty tuple of ints, got {argnums!r}."
        )
    for i in nums:
        if not -nargs <= i < nargs:
            raise ValueError(
                f"`{api}`: `argnums={argnums!r}` is out of range: `fn` was given {nargs} "
                "positional argument(s)."
            )
    return tuple(i % nargs for i in nums)


# The APIs that take `holomorphic=`, which an error may advise.
_HOLOMORPHIC_APIS = ("diffrax_linearize.materialise", "diffrax_linearize.materialise_operator")


def _check_inputs(leaves, holomorphic: bool, api: str):
    if not leaves:
        raise TypeError(
            f"`{api}`: the differentiated argument(s) hold no arrays. Pass arrays (or pytrees "
            "of arrays) at the positions named by `argnums`."
        )
    for x in leaves:
        if not _is_array_leaf(x):
            raise TypeError(
                f"`{api}`: every leaf of the differentiated argument(s) must be an array, got "
                f"{type(x).__name__}. Move non-array data to another argument, or close over it."
            )
        dtype = jnp.result_type(x)
        if holomorphic:
            if not jnp.issubdtype(dtype, jnp.complexfloating):
                raise TypeError(
                    f"`{api}` with `holomorphic=True` requires complex inputs, got {dtype}."
                )
        elif not jnp.issubdtype(dtype, jnp.floating):
            if not jnp.issubdtype(dtype, jnp.complexfloating):
                hint = " Convert integer or boolean inputs to a floating dtype first."
            elif api in _HOLOMORPHIC_APIS:
                hint = " For holomorphic functions of complex inputs pass `holomorphic=True`."
            else:  # an API without the option
                hint = " Split complex inputs into their real and imaginary parts."
            raise TypeError(
                f"`{api}` requires real floating-point inputs (as `jax.jacfwd` does), got "
                f"{dtype}.{hint}"
            )


# ---- tracing and the compiled kernel --------------------------------------------------


class _Spec:
    """The static part of a materialisation: a jaxpr (compared by its text, so retracing
    the same function does not recompile), the options, the jaxpr's integer constants
    (indices, known at trace time so that the structure rules can read them; compared by
    their bytes), and the constants of its nested closed jaxprs.

    The text of a jaxpr does not show the values of the constants that a nested `jax.jit`
    closes over (`{ lambda c:f64[4]; a:f64[4]. ... }`): they are compiled into the kernel,
    and keyed by their bytes, or, when large, by their identity, so that a later call with
    other values never reuses the kernel. (The spec holds them, so no other array can take
    their identity while the kernel is cached.)"""

    def __init__(
        self,
        jaxpr,
        n_diff: int,
        mode: str,
        strict: bool,
        structured: bool,
        static_consts=None,
        nan_as_jacfwd: bool = True,
    ):
        self.jaxpr = jaxpr
        self.nan_as_jacfwd = nan_as_jacfwd
        self.n_diff = n_diff
        self.mode = mode
        self.strict = strict
        self.structured = structured
        self.static_consts = dict(static_consts or {})
        static_key = tuple(
            (i, c.dtype.str, c.shape, hashlib.blake2b(c.tobytes(), digest_size=16).hexdigest())
            for i, c in sorted(self.static_consts.items())
        )
        self._nested_consts = _nested_consts(jaxpr)
        self._key = (
            str(jaxpr),
            _callable_ids(jaxpr),
            tuple(_const_key(c) for c in self._nested_consts),
            n_diff,
            mode,
            strict,
            structured,
            static_key,
            nan_as_jacfwd,
        )

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Spec) and self._key == other._key

    def consts(self, dynamic):
        """The jaxpr's constants: the kernel's arguments, with the static ones put back."""
        return [self.static_consts.get(i, c) for i, c in enumerate(dynamic)]


_STATIC_CONST_SIZE = 1 << 20


def _split_consts(consts):
    """`(dynamic, static)`: integer and boolean constants known at trace time (indices) are
    kept static, the others (closed-over arrays) become arguments of the kernel."""
    dynamic, static = [], {}
    for i, c in enumerate(consts):
        k = known(c)
        if (
            k is not None
            and not jnp.issubdtype(k.dtype, jnp.inexact)
            and k.size <= _STATIC_CONST_SIZE
        ):
            static[i] = k
            dynamic.append(None)
        else:
            dynamic.append(c)
    return dynamic, static


def _nested_consts(jaxpr) -> list:
    """The constants of the closed jaxprs held in the equations' parameters, at any depth,
    in a fixed order (a nested `jax.jit` keeps those it closes over there)."""
    consts = []
    for eqn in iter_eqns(jaxpr):
        for value in eqn.params.values():
            for item in value if isinstance(value, tuple | list) else (value,):
                if _is_closed(item):
                    consts.extend(item.consts)
    return consts


_HASHED_CONST_SIZE = 1 << 20


def _const_key(c):
    """A key for a constant compiled into the kernel: its bytes while small, else its
    identity (hashing a large array on every call would cost more than it saves)."""
    shape, dtype = np.shape(c), jnp.result_type(c)
    if (
        not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)  # PRNG keys have no bytes
        and math.prod(shape) * dtype.itemsize <= _HASHED_CONST_SIZE
    ):
        data = np.ascontiguousarray(np.asarray(c)).tobytes()
        return shape, dtype.str, hashlib.blake2b(data, digest_size=16).hexdigest()
    return shape, dtype.str, id(c)


def _callable_ids(jaxpr) -> tuple:
    """Identities of the Python callables in the equations' parameters (custom derivative
    rules), which the jaxpr's text does not show."""
    ids = []
    for eqn in iter_eqns(jaxpr):
        for value in eqn.params.values():
            for item in value if isinstance(value, tuple | list) else (value,):
                if callable(item) and not isinstance(item, type) and not _is_jaxpr(item):
                    ids.append(id(item))
    return tuple(ids)


def _is_jaxpr(item) -> bool:
    return hasattr(item, "eqns") or (hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"))


def _custom_vjp_as_jvp(eqn, used=None):
    """A function equal to the `custom_vjp_call` equation, differentiable in forward mode:
    its JVP is the dense Jacobian from the custom VJP rule (reverse mode), applied to the
    tangents. `jax.jacfwd` fails on such functions; we do not.

    The equation's first `num_consts` inputs are values its function closes over (the
    constants of `jax.experimental.ode.odeint`'s Runge-Kutta tableau), which its VJP
    rule does not cover: they are not differentiated, and a tangent that reaches one is an
    error, as in `jax.jacrev`. `used` tells which outputs the rest of the program reads
    (default: all): only those are pulled back, so that the `bwd` rule sees the cotangents
    `jax.jacrev` would give it (a symbolic zero for an output nothing reads)."""
    num_consts = eqn.params.get("num_consts", 0)

    def primal(*xs):
        # Values known at trace time are NumPy arrays here; the rules are Python code
        # that may index them with a tracer (`odeint`'s backward scan, `ts[i]`).
        xs = [jnp.asarray(x) if isinstance(x, np.ndarray) else x for x in xs]
        return bind_eqn(eqn, xs)

    @jax.custom_jvp
    def fn(*xs):
        return primal(*xs)

    def fn_jvp(xs, ts):
        zero = [isinstance(t, jax.custom_derivatives.SymbolicZero) for t in ts]
        if not all(zero[:num_consts]):
            raise ValueError(
                "diffrax_linearize: the function differentiates a `jax.custom_vjp` function "
                "with respect to a value that function closes over, which its VJP rule does "
                "not cover (`jax.jacrev` refuses it too). Pass that value to the "
                "`custom_vjp` function as an argument, and give its `fwd`/`bwd` rules its "
                "cotangent."
            )
        diff = [
            i
            for i, x in enumerate(xs)
            if i >= num_consts and not zero[i] and jnp.issubdtype(jnp.result_type(x), jnp.inexact)
        ]

        outs = primal(*xs)
        # Only the floating outputs that are read have a Jacobian (`jax.jacrev` refuses
        # the others: a loop's step counter, a flag); the others' tangents are zeros
        # (`float0` for integers).
        floating = [
            k
            for k, o in enumerate(outs)
            if jnp.issubdtype(o.dtype, jnp.inexact) and (used is None or used[k])
        ]

        def of_diff(*d):
            full = list(xs)
            for i, v in zip(diff, d):
                full[i] = v
            outs = primal(*full)
            return [outs[k] for k in floating]

        t_outs = [
            jnp.zeros(jnp.shape(o), o.dtype)
            if jnp.issubdtype(o.dtype, jnp.inexact)
            else np.zeros(o.shape, float0)
            for o in outs
        ]
        if not diff or not floating:
            return outs, t_outs
        jac = jax.jacrev(of_diff, argnums=tuple(range(len(diff))))(*[xs[i] for i in diff])
        for n, k in enumerate(floating):
            for j, i in enumerate(diff):
                ti = ts[i]
                t = jnp.tensordot(jac[n][j], ti, axes=jnp.ndim(ti))
                t_outs[k] = t_outs[k] + t.astype(t_outs[k].dtype)
        return outs, t_outs

    fn.defjvp(fn_jvp, symbolic_zeros=True)
    return fn


def _eval_forward_differentiable(jaxpr, consts, args):
    """Evaluate `jaxpr`, replacing every `custom_vjp_call` (inside calls and control flow
    too) by a forward-differentiable equivalent, and inlining every `custom_vmap_call`'s
    function."""

    def apply_eqn(eqn, vals):
        if eqn.primitive is prim("custom_vjp_call"):
            return _custom_vjp_as_jvp(eqn, used.get(id(eqn)))(*vals)
        if eqn.primitive is prim("custom_vmap_call"):
            # `jax.custom_batching.custom_vmap`: only its batching rule is custom, and
            # JAX differentiates its function (`custom_vmap_jvp`), as this inlining does;
            # bound, it has no rule to split its linear part off (`jax.linearize` raises
            # "Linearization failed to produce known values"), though `jax.jacfwd` works.
            call = eqn.params["call"]
            return evaluate(call.jaxpr, call.consts, vals)
        if is_cell_loop(eqn, vals):
            outs = _coloured_cell_loop(eqn, vals, evaluate, used.get(id(eqn)))
            if outs is not None:
                return outs
        if _has_custom_vjp(eqn):
            return bind_eqn(eqn.replace(params=_forward_differentiable_params(eqn)), vals)
        # Index computations on known values stay known, so that the linear program's
        # gathers and scatters have indices the structure rules can read.
        outs = evaluate_known(eqn, vals)
        return bind_eqn(eqn, vals) if outs is None else outs

    # Calls holding a `custom_vjp_call` are inlined: a checkpoint only changes what
    # reverse mode stores. So are calls given known indices (`jnp.take_along_axis(x, idx)`
    # is a `jit`): inlined, their index computations are evaluated at trace time too.
    # Also calls that close over known indices (a `jnp.take` inside a nested `jax.jit`).
    def inline(eqn, vals):
        if _has_custom_vjp(eqn) or any(_is_known_index(v) for v in vals):
            return True
        return _closes_over_known_index(eqn)

    # Which outputs of each loop and `custom_vjp_call` the rest of its jaxpr uses: an
    # unused carry (a running total) must not make a loop over cells look dense, and an
    # unused output of a `custom_vjp` is not pulled back.
    used = {}

    def evaluate(jaxpr, consts, args):
        read = {v for e in jaxpr.eqns for v in e.invars if not is_literal(v)}
        read |= {v for v in jaxpr.outvars if not is_literal(v)}
        for e in jaxpr.eqns:
            if e.primitive in (prim("scan"), prim("custom_vjp_call")):
                used[id(e)] = [v in read for v in e.outvars]
        return eval_jaxpr(jaxpr, consts, args, apply_eqn, inline=inline)

    return evaluate(jaxpr, consts, args)


def _coloured_cell_loop(eqn, vals, evaluate, used=None):
    """A loop over cells (see `_loops.is_cell_loop`) as a function whose JVP is its local
    Jacobian, coloured: the pattern of that Jacobian is found at trace time by unrolling the
    loop, where every iteration's indices are known, and interpreting the unrolled program's
    linearisation (abstractly: nothing of it is compiled); its values by `c` JVPs of the
    rolled loop, one per colour of that pattern; the JVP is then that sparse matrix times
    the tangents, with indices known at trace time, which the structure rules keep. So the
    program holds the loop rolled, and the Jacobian is as sparse as the cells' coupling.
    `None` (the loop stays as it is) if the pattern is too full to be worth it. `used`:
    which of the loop's outputs are used (default all); the others get zero tangents."""
    used = [True] * len(eqn.outvars) if used is None else used
    diff = [i for i, x in enumerate(vals) if _is_float(x)]
    if not diff:
        return None
    avals = [jax.ShapeDtypeStruct(jnp.shape(vals[i]), jnp.result_type(vals[i])) for i in diff]

    def with_diff(d):
        full = list(vals)
        for i, x in zip(diff, d):
            full[i] = x
        return full

    found = []

    def probe(*d):
        _, f_jvp = jax.linearize(lambda *d: unrolled(eqn, with_diff(d), evaluate), *d)
        out_avals = [v.aval for v in eqn.outvars]
        found.append(_forward(f_jvp, d, out_avals))
        return 0.0

    jax.eval_shape(probe, *avals)
    ((blocks, ctx),) = found
    if ctx.densified:
        return None
    # Per input: a colouring of its columns valid for every output's pattern.
    colourings = []
    patterns = [[None] * len(diff) for _ in eqn.outvars]
    for j, aval in enumerate(avals):
        n = math.prod(aval.shape)
        for k, row in enumerate(blocks):
            if row[j] is not None and _is_float_aval(eqn.outvars[k].aval) and used[k]:
                patterns[k][j] = pattern_of(row[j])
                if patterns[k][j] is None:
                    return None
        pats = [patterns[k][j] for k in range(len(blocks)) if patterns[k][j] is not None]
        colours = colour_columns(pats, n) if pats else np.zeros(n, np.int64)
        c = int(colours.max(initial=0)) + 1
        if pats and too_full(c, n):
            return None
        colourings.append((colours, c))

    def loop(*d):
        return bind_eqn(eqn, with_diff(d))

    fn = jax.custom_jvp(loop)

    @fn.defjvp
    def fn_jvp(d, t):
        outs = loop(*d)
        t_outs = [
            jnp.zeros(v.aval.shape, v.aval.dtype)
            if _is_float_aval(v.aval)
            else np.zeros(v.aval.shape, jax.dtypes.float0)  # an integer output's tangent
            for v in eqn.outvars
        ]
        for j, (colours, c) in enumerate(colourings):
            if all(patterns[k][j] is None for k in range(len(outs))):
                continue
            shape = avals[j].shape
            seeds = np.eye(c, dtype=avals[j].dtype)[colours].reshape(shape + (c,))

            def push(seed, j=j):
                tangents = [jnp.zeros(a.shape, a.dtype) for a in avals]
                tangents[j] = seed
                return jax.jvp(loop, tuple(d), tuple(tangents))[1]

            compressed = jax.vmap(push, in_axes=-1, out_axes=-1)(jnp.asarray(seeds))
            flat_t = jnp.reshape(t[j], (-1,))
            for k, v in enumerate(eqn.outvars):
                if patterns[k][j] is None:
                    continue
                columns, live = patterns[k][j]
                rows = math.prod(v.aval.shape)
                values = jnp.take_along_axis(
                    jnp.reshape(compressed[k], (rows, c)), jnp.asarray(colours[columns].T), axis=1
                )
                # The sparse product, one entry per row at a time: gathers at positions
                # known at trace time (evaluated as such), which the structure rules keep.
                with jax.ensure_compile_time_eval():
                    product = sum(
                        jnp.where(live[e], values[:, e] * flat_t[columns[e]], 0)
                        for e in range(columns.shape[0])
                    )
                t_outs[k] = t_outs[k] + jnp.reshape(product, v.aval.shape).astype(v.aval.dtype)
        return outs, t_outs

    return fn(*[vals[i] for i in diff])


def _is_float(x) -> bool:
    return known(x) is None and jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _is_float_aval(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def _closes_over_known_index(eqn) -> bool:
    sub = call_jaxpr(eqn)
    if sub is None:
        return False
    jaxpr, consts = sub
    return any(_is_known_index(c) for c in consts) or any(
        _closes_over_known_index(e) for e in jaxpr.eqns
    )


def _is_known_index(x) -> bool:
    k = known(x)
    return k is not None and not jnp.issubdtype(k.dtype, jnp.inexact)


def _forward_differentiable_closed(closed):
    """A closed jaxpr computing the same as `closed`, with its `custom_vjp_call`s replaced
    (retraced; same inputs and outputs)."""
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    return jax.make_jaxpr(
        lambda *args: _eval_forward_differentiable(closed.jaxpr, closed.consts, list(args))
    )(*avals)


def _forward_differentiable_params(eqn) -> dict:
    """`eqn`'s parameters with every closed sub-jaxpr (`scan`'s body, `cond`'s branches,
    `while`'s body and condition) made forward differentiable."""
    params = {}
    for name, value in eqn.params.items():
        if isinstance(value, tuple | list) and any(_is_closed(v) for v in value):
            params[name] = type(value)(
                _forward_differentiable_closed(v) if _is_closed(v) else v for v in value
            )
        elif _is_closed(value):
            params[name] = _forward_differentiable_closed(value)
        else:
            params[name] = value
    return params


def _is_closed(value) -> bool:
    return hasattr(value, "jaxpr") and hasattr(value, "consts")


def _has_custom_vjp(eqn) -> bool:
    """Whether a sub-jaxpr of `eqn` (at any depth) holds a `custom_vjp_call`."""
    return any(
        inner.primitive is prim("custom_vjp_call")
        for jaxpr in subjaxprs(eqn)
        for inner in iter_eqns(jaxpr)
    )


def _to_lin_outputs(outs, out_avals):
    res = []
    for x, aval in zip(outs, out_avals):
        if isinstance(x, Lin):
            res.append(x)
        else:  # a constant output of a linear map is zero
            res.append(Lin({}, aval.shape, aval.dtype))
    return res


def _function(spec: _Spec, consts, rest):
    """The traced function of the differentiated leaves alone."""
    jaxpr = spec.jaxpr
    consts = spec.consts(consts)

    def f(*d):
        return _eval_forward_differentiable(jaxpr, consts, list(d) + list(rest))

    return f


def _structured_jacobian(spec: _Spec, consts, diff, rest, f_jvp=None):
    """Returns `blocks[q][p]`: the block of output leaf `q` w.r.t. input leaf `p`, or
    `None` for zero; the interpreter's `Context` (which primitives lost structure); and,
    when the blocks came from reverse mode, a function of no arguments computing the same
    blocks and context in forward mode from the same linearisation (else `None`).
    `f_jvp` is the linearisation, if the caller has it."""
    jaxpr = spec.jaxpr
    if f_jvp is None:
        _, f_jvp = jax.linearize(_function(spec, consts, rest), *diff)
    out_avals = [v.aval for v in jaxpr.outvars]
    in_shapes = [tuple(jnp.shape(x)) for x in diff]
    mode = spec.mode
    if mode == "auto":
        n_in = sum(math.prod(s) for s in in_shapes)
        n_out = sum(math.prod(a.shape) for a in out_avals)
        # Reverse mode computes in the outputs' dtype and rounds to the inputs': only where
        # every dtype is the same is it `jax.jacfwd`'s result (up to summation order).
        dtypes = {jnp.result_type(x) for x in diff} | {a.dtype for a in out_avals}
        mode = "reverse" if n_out < n_in and len(dtypes) == 1 else "forward"
    forward = functools.partial(_forward, f_jvp, diff, out_avals)
    if mode == "reverse" and all(jnp.issubdtype(a.dtype, jnp.floating) for a in out_avals):
        try:
            return *_reverse(f_jvp, diff, out_avals), forward
        except Exception:  # e.g. a `while` loop cannot be transposed: go forward instead
            pass
    return *forward(), None


def _forward(f_jvp, diff, out_avals):
    """Forward accumulation: structure propagated through the linear program from the
    identity on the inputs."""
    leaf_shapes = [tuple(jnp.shape(x)) for x in diff]
    lin = jax.make_jaxpr(f_jvp)(*diff)
    jaxpr = _reshaped_inputs(lin.jaxpr)
    in_shapes = [tuple(v.aval.shape) for v in jaxpr.invars]
    ctx = Context(in_shapes=in_shapes)
    invals = [
        Lin({p: Struct.identity(s, jnp.result_type(x))}, s, jnp.result_type(x))
        for p, (s, x) in enumerate(zip(in_shapes, diff))
    ]
    outs = interpret(ctx, jaxpr, lin.consts, invals)
    outs = _to_lin_outputs(outs, out_avals)
    blocks = [
        [
            None if (b := x.blocks.get(p)) is None else _reshape_in(ctx, b, leaf_shapes[p])
            for p in range(len(diff))
        ]
        for x in outs
    ]
    return blocks, ctx


def _reshape_in(ctx: Context, b: Struct, in_shape) -> Struct:
    """`reshape_in`, keeping the record of a block's known and traced parts (`split_of`)."""
    out = reshape_in(b, in_shape)
    found = ctx.splits.get(id(b))
    if out is not b and found is not None and found[0] is b:
        ctx.splits[id(out)] = (out, reshape_in(found[1], in_shape), reshape_in(found[2], in_shape))
    return out


def _reshaped_inputs(jaxpr):
    """`jaxpr` taking each input that it only reshapes (`p = x.reshape(-1, 3)`, the bodies
    of an N-body field) in its reshaped form. The identity on the reshaped input keeps a
    delta per axis, so that `p[None, :] - p[:, None]` is a sum of blocks with deltas
    (see `LazySum`), where the reshape of the identity on the flat input would be a
    row-compressed pattern over every out position; the blocks' in sides are reshaped back
    at the end (`reshape_in`), by then often dense."""
    uses: dict = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not is_literal(v):
                uses.setdefault(v, []).append(eqn)
    outvars = {v for v in jaxpr.outvars if not is_literal(v)}
    invars, drop = [], set()
    for v in jaxpr.invars:
        found = uses.get(v, [])
        eqn = found[0] if len(found) == 1 else None
        if (
            eqn is not None
            and v not in outvars
            and eqn.primitive is prim("reshape")
            and eqn.params.get("dimensions") is None
            and len(eqn.invars) == 1
        ):
            invars.append(eqn.outvars[0])
            drop.add(id(eqn))
        else:
            invars.append(v)
    if not drop:
        return jaxpr
    return jaxpr.replace(invars=invars, eqns=[e for e in jaxpr.eqns if id(e) not in drop])


def _reverse(f_jvp, diff, out_avals):
    """Reverse accumulation: structure propagated forward through the transposed linear
    program, then each block transposed (free)."""
    f_vjp = jax.linear_transpose(f_jvp, *diff)
    cts = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals]
    lin = jax.make_jaxpr(lambda *c: f_vjp(list(c)))(*cts)
    ctx = Context(in_shapes=[tuple(a.shape) for a in out_avals])
    invals = [
        Lin({q: Struct.identity(tuple(a.shape), a.dtype)}, a.shape, a.dtype)
        for q, a in enumerate(out_avals)
    ]
    outs = interpret(ctx, lin.jaxpr, lin.consts, invals)
    outs = _to_lin_outputs(outs, [v.aval for v in lin.jaxpr.outvars])
    blocks = []
    for q in range(len(out_avals)):
        row = []
        for p in range(len(diff)):
            b = outs[p].blocks.get(q)
            row.append(None if b is None else transpose(b))
        blocks.append(row)
    return blocks, ctx


def _without_dead_code(fn, *args):
    """`fn(*args)`, traced and evaluated with dead code removed: `jax.linearize` computes
    the primal outputs (for `A @ x`, a matrix-vector product) that a Jacobian never uses,
    and they should not appear in the program."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    jaxpr = dce_jaxpr(closed.jaxpr)
    outs = eval_jaxpr(jaxpr, closed.consts, jtu.tree_leaves(args), bind_eqn)
    return jtu.tree_unflatten(jtu.tree_structure(out_shape), outs)


@functools.partial(jax.jit, static_argnums=0)
def _run_dense(spec: _Spec, consts, diff, rest):
    return _without_dead_code(functools.partial(_dense_jacobian, spec), consts, diff, rest)


def _dense_jacobian(spec: _Spec, consts, diff, rest):
    _, f_jvp = jax.linearize(_function(spec, consts, rest), *diff)
    blocks, ctx, reverse = _structured_jacobian(spec, consts, diff, rest, f_jvp)
    _check_strict(spec, ctx.densified, ctx.reasons)
    if reverse is None and _dense_by_nature(ctx, blocks):
        # `jax.jacfwd`'s own computation: its NaN pattern too, with nothing to check.
        return _jacfwd_cells(spec, f_jvp, diff, chunk=None)
    split = lambda b: split_of(ctx, b)  # noqa: E731
    if not spec.nan_as_jacfwd:
        return _dense_cells(spec, blocks, diff, split)
    # `jax.jacfwd` pushes every basis vector through the linearisation, so a NaN or
    # infinite partial derivative meets the basis's zeros (`0 * inf` is NaN) wherever it
    # is formed, also where the structure knows the tangent to be zero and forms nothing
    # (the rows of a constant that `jnp.concatenate` joins to `x` and `jnp.sqrt` then
    # differentiates at 0; `x * y` at `x = inf, y = 0`; `A @ x` with an infinite entry of
    # `A`). Reverse mode also forms `0 * inf` where forward mode does not: where `select_n`
    # drops a NaN or infinite tangent, its transpose gives that entry a zero cotangent.
    # Both are found by one more push through the linearisation, of ones: a non-finite
    # value that `jax.jacfwd` forms in some basis direction is formed there too (a sum
    # with, or a product by, a non-finite value is never finite), so where that push and
    # the structured result are finite, `jax.jacfwd`'s result is finite and equal to ours
    # up to rounding. Otherwise it is `jax.jacfwd` itself, in a branch that runs only
    # then (under `jax.vmap`, where `cond` is a `select`, always), with its NaN pattern.
    # It is the same Jacobian, so it is not checked by `strict`.

    # In forward mode a non-finite entry of ours is one `jax.jacfwd` forms too, and so the
    # push finds it; reverse mode's are checked in its stored values (not the dense
    # result, which is built in the branch that returns it). Both pass an optimisation
    # barrier: where they are constants of the program (the `A` of `A @ x` closed over
    # under `jax.jit`), XLA would otherwise fold the check at compile time, seconds at
    # n = 2000.
    stored = [] if reverse is None else [b.val for row in blocks for b in row if b is not None]

    @jax.jit  # named, as the fallback below: the cost of one Jacobian-vector product
    def nonfinite_check():
        ones = jax.lax.optimization_barrier([jnp.ones_like(x) for x in diff])
        return [*jax.lax.optimization_barrier(stored), *f_jvp(*ones)]

    checked = nonfinite_check()
    finite = all_finite(c for c in checked if jnp.issubdtype(c.dtype, jnp.inexact))

    @jax.jit  # a call named in the program, so that tests can tell it from the rest
    def nonfinite_fallback():
        return _jacfwd_cells(spec, f_jvp, diff)

    return jax.lax.cond(finite, lambda: _dense_cells(spec, blocks, diff, split), nonfinite_fallback)


_FALLBACK_CHUNK = 64


def _dense_by_nature(ctx: Context, blocks) -> bool:
    """Whether every block of the Jacobian is dense and the walk saved less than half of
    the work of `jax.jacfwd` (`Context.count_work`; an FFT, where the transform is applied
    to the identity, and every equation after it to dense blocks): then `jax.jacfwd`'s own
    program, every basis vector pushed through the linearisation, is as fast, compiles
    faster (no transposes between the rules' layouts, no check for `jax.jacfwd`'s NaNs and
    no branch recomputing them: it forms them itself), and is what `jax.jacfwd` computes.
    Never with control flow, whose bodies the walk counts more than once."""
    return (
        not ctx.control_flow
        and ctx.jacfwd_work > 0
        and 2 * ctx.structured_work >= ctx.jacfwd_work
        and all(b is not None and b.kind() == "dense" for row in blocks for b in row)
    )


def _jacfwd_cells(spec: _Spec, f_jvp, diff, chunk: int | None = _FALLBACK_CHUNK):
    """`jax.jacfwd`'s computation, as `_dense_cells`: the linearisation of every leaf of
    `diff` at once, mapped over the basis of all of them (the other leaves' tangents are
    zeros, not symbolic zeros, as in `jax.jacfwd`), `_FALLBACK_CHUNK` basis vectors at a
    time, so that the program's untaken branch holds no `n x n` temporaries (XLA allocates
    those on every call: 10-50x the time of a dense `tanh` Jacobian at n = 2000). The basis
    passes an optimisation barrier: XLA rewrites a product with a visible identity into a
    select, which drops the `0 * inf` NaNs that eager `jax.jacfwd` forms (under `jax.jit`,
    `jax.jacfwd(lambda x: jnp.inf * x)` gives zeros off the diagonal, eagerly NaNs).
    With `chunk=None` there is no loop: the whole basis is pushed at once, as
    `jax.jacfwd` does."""
    sizes = [math.prod(jnp.shape(x)) for x in diff]
    n = sum(sizes)
    dtype = common_dtype(*diff)
    splits = np.cumsum(sizes)[:-1].tolist()
    chunk = n if chunk is None else min(n, chunk)
    avals = [v.aval for v in spec.jaxpr.outvars]
    dtypes = [_tangent_dtype(a.dtype) for a in avals]

    def push(row):
        parts = jnp.split(row, splits)
        return f_jvp(*[t.reshape(jnp.shape(x)).astype(x.dtype) for t, x in zip(parts, diff)])

    def pushed(start):
        """Columns `start` to `start + chunk` of every output's Jacobian."""
        rows = jax.lax.broadcasted_iota(jnp.int32, (chunk, n), 0) + start
        basis = (rows == jax.lax.broadcasted_iota(jnp.int32, (chunk, n), 1)).astype(dtype)
        basis = jax.lax.optimization_barrier(basis)
        try:
            outs = jax.vmap(push)(basis)
        except Exception:  # no batching rule for a leading axis: `map_columns`'s ways
            outs = [jnp.moveaxis(o, -1, 0) for o in map_columns(push, [basis.T], [-1])]
        return [
            None if d == jax.dtypes.float0 else t.reshape(chunk, math.prod(a.shape)).T.astype(d)
            for t, d, a in zip(outs, dtypes, avals)
        ]

    def body(k, columns):
        # The last chunk ends at `n`, overlapping the one before it: the same values.
        start = jnp.minimum(k * chunk, n - chunk)
        return [
            c if c is None else jax.lax.dynamic_update_slice(c, t, (0, start))
            for c, t in zip(columns, pushed(start))
        ]

    if chunk == n:
        columns = pushed(0)
    else:
        columns = [
            None if d == jax.dtypes.float0 else jnp.zeros((math.prod(a.shape), n), d)
            for a, d in zip(avals, dtypes)
        ]
        columns = jax.lax.fori_loop(0, -(-n // chunk), body, columns)
    out = []
    for aval, c in zip(avals, columns):
        cells = []
        offset = 0
        for x, size in zip(diff, sizes):
            if c is None:
                cells.append(_integer_cell(aval, x))
            else:
                cells.append(c[:, offset : offset + size].reshape(_cell_shape(aval, x)))
            offset += size
        out.append(cells)
    return out


def _cell_shape(out_aval, x) -> tuple[int, ...]:
    return tuple(out_aval.shape) + tuple(jnp.shape(x))


def _integer_cell(out_aval, x):
    """As `jax.jacfwd` gives the Jacobian of an integer output (whose tangent is `float0`):
    zeros of the output's own dtype."""
    return jnp.zeros(_cell_shape(out_aval, x), out_aval.dtype)


def _dense_cells(spec: _Spec, blocks, diff, split):
    out = []
    for q, row in enumerate(blocks):
        aval = spec.jaxpr.outvars[q].aval
        dtype = _tangent_dtype(aval.dtype)
        cells = []
        for p, b in enumerate(row):
            if dtype == jax.dtypes.float0:
                cells.append(_integer_cell(aval, diff[p]))
            elif b is None:
                cells.append(jnp.zeros(_cell_shape(aval, diff[p]), dtype))
            else:
                # A row-compressed sum of a known and a traced part: its entries summed as
                # `materialise_operator` sums them, so that the two agree bit for bit.
                parts = split(b) if b.ell is not None else None
                dense = None if parts is None else dense_from_parts(b, parts, dtype)
                cells.append(to_dense(b).astype(dtype) if dense is None else dense)
        out.append(cells)
    return out


def _densified_names(densified: dict[str, int], reasons: dict[str, list[str]]) -> str:
    """Each primitive that lost structure, how often, and the reasons recorded for it, as
    "`gather` (2x: why), `sin` (1x)"."""
    names = []
    for k, v in sorted(densified.items()):
        why = "; ".join(reasons.get(k, ()))
        names.append(f"`{k}` ({v}x: {why})" if why else f"`{k}` ({v}x)")
    return ", ".join(names)


def _check_strict(spec: _Spec, densified: dict[str, int], reasons=None):
    if spec.strict and densified:
        names = _densified_names(densified, reasons or {})
        raise ValueError(
            "`materialise(..., strict=True)`: these primitives took the exact dense fallback "
            f"and lost structure: {names}. Register a rule with "
            "`diffrax_linearize.internal.register_rule`, or pass `strict=False`."
        )


def _tangent_dtype(dtype):
    if jnp.issubdtype(dtype, jnp.inexact):
        return dtype
    return jax.dtypes.float0


def _trace(fn, args, argnums, holomorphic, api):
    """Flatten the arguments, trace `fn` to a jaxpr whose constants are hoisted to
    arguments, and return everything needed to call the compiled kernel."""
    if not callable(fn):
        raise TypeError(
            f"`{api}`: the first argument must be a callable (or a `diffrax.AbstractTerm`), "
            f"got {type(fn).__name__}."
        )
    nums = _check_argnums(argnums, len(args), api)
    diff_args = tuple(args[i] for i in nums)
    diff_tree_arg = diff_args[0] if isinstance(argnums, int) else diff_args
    diff_leaves, diff_tree = jtu.tree_flatten(diff_tree_arg)
    _check_inputs(diff_leaves, holomorphic, api)
    diff_leaves = [jnp.asarray(x) for x in diff_leaves]
    others = [a for i, a in enumerate(args) if i not in nums]
    dyn_others, static_others = eqx.partition(others, _is_array_leaf)
    other_leaves, other_tree = jtu.tree_flatten(dyn_others)
    out_tree_box = []

    def flat_fn(*flat):
        d = jtu.tree_unflatten(diff_tree, flat[: len(diff_leaves)])
        o = eqx.combine(jtu.tree_unflatten(other_tree, flat[len(diff_leaves) :]), static_others)
        d = (d,) if isinstance(argnums, int) else d
        full, by_pos, it_o = [], dict(zip(nums, d)), iter(o)  # argnums in any order
        for i in range(len(args)):
            full.append(by_pos[i] if i in nums else next(it_o))
        out = fn(*full)
        leaves, tree = jtu.tree_flatten(out)
        for leaf in leaves:
            if not _is_array_leaf(leaf):
                raise TypeError(
                    f"`{api}`: `fn` must return a pytree of arrays, but it returned a leaf of "
                    f"type {type(leaf).__name__}."
                )
        out_tree_box.append(tree)
        return [jnp.asarray(x) for x in leaves]

    with traced_as_jit(api):
        closed = jax.make_jaxpr(flat_fn)(*diff_leaves, *other_leaves)
    out_tree = out_tree_box[0]
    if holomorphic:
        for v in closed.jaxpr.outvars:
            if not jnp.issubdtype(v.aval.dtype, jnp.complexfloating):
                raise TypeError(f"`{api}` with `holomorphic=True` requires complex outputs.")
    return closed, diff_leaves, other_leaves, diff_tree, out_tree


@contextlib.contextmanager
def traced_as_jit(api: str):
    """Where `fn` is traced: JAX's error for a value read as a Python number gets a note
    saying why that happens here too, and what to do instead."""
    try:
        yield
    except jax.errors.ConcretizationTypeError as e:
        e.add_note(
            f"`{api}` traces `fn` as `jax.jit` does, also when called outside `jax.jit`: no "
            "value computed inside `fn` (from its inputs or from the arrays it closes over) "
            "can be read as a Python number, where `jax.jacfwd` called outside `jax.jit` "
            "allows it. Give such a value to `fn` as a Python number instead: for "
            "`jax.ops.segment_sum`, `segment_max` and their kin, pass `num_segments=`; "
            "compute a size or an index with NumPy, outside `fn`."
        )
        raise


_MODES = get_args(MaterialiseMode)
_LINEAX_JAC = {"fwd": "forward", "bwd": "reverse"}


def _check_mode(mode, api):
    if mode not in _MODES:
        ours = _LINEAX_JAC.get(mode)
        hint = f" (lineax's `jac={mode!r}` is `mode={ours!r}` here)" if ours else ""
        raise ValueError(f"`{api}`: `mode` must be one of {_MODES}, got {mode!r}{hint}.")


@functools.singledispatch
def materialise(
    fn: Callable,
    *args: Any,
    argnums: int | Sequence[int] = 0,
    holomorphic: bool = False,
    mode: MaterialiseMode = "auto",
    strict: bool = False,
):
    """The Jacobian of `fn` at `args`, as `jax.jacfwd(fn, argnums)(*args)` returns it, computed
    by propagating symbolic structure through `fn`'s linearised jaxpr instead of pushing an
    identity basis through it.

    For a linear `fn` the result is the matrix of the map: `materialise(lambda x: A @ x, x)`
    is `A` itself, with no matrix-matrix product in the traced program. A nonlinear `fn` is
    linearised at `args` first (`jax.linearize`), so `B @ tanh(A @ x)` costs one matrix-matrix
    product, `(B * sech²(A x)) @ A`, where `jax.jacfwd` pays two.

    Structure kept per value: zero, identity, scaled identity, diagonal, dense, axis-level
    structure (identity or broadcast along some axes, diagonal along others), and sparse
    patterns known at trace time: block-diagonal systems, bands and stencils, gathers with
    known indices (see [Sparse Jacobians of vector fields](../sparse.md);
    [`diffrax_linearize.structure_report`][] says what was found). Every primitive without a
    structure rule takes an exact dense fallback: its JVP vectorised over the basis, never
    wrong, only slower; `strict=True` reports which ones did.

    Closed-over arrays are hoisted to arguments of the compiled kernel, and the kernel is
    cached on the text of the jaxpr, so an un-jitted call does not compile the closed-over
    arrays into the program, and a repeated call does not recompile. Arrays closed over
    inside a nested `jax.jit` are part of that inner program, as they are for JAX: they
    are compiled in, and the cache is keyed on their values (their identity past 1 MiB),
    so another array in their place compiles anew and never reuses a stale kernel.

    Also accepts a `diffrax.AbstractTerm` as first argument, `materialise(term, t, y, args)`:
    see [Diffrax terms](terms.md).

    **Arguments:**

    - `fn`: a function of `args` returning a pytree of arrays.
    - `*args`: the arguments; those named by `argnums` must be pytrees of floating arrays.
    - `argnums`: an int or a tuple of ints, as for `jax.jacfwd`.
    - `holomorphic`: as for `jax.jacfwd`: complex inputs and outputs, complex-linear `fn`.
    - `mode`: `"forward"`, `"reverse"`, or `"auto"` (the default: reverse when the outputs
      are smaller than the inputs and all inputs and outputs have the same dtype, as one
      would choose between `jax.jacfwd` and `jax.jacrev`; reverse mode would round a
      float64 Jacobian of a float16 input to float16, as `jax.jacrev` does). These are
      lineax's `jac="fwd"` and `jac="bwd"`; the result is the same either way, up to
      rounding.
    - `strict`: raise a `ValueError` naming every primitive that took the dense fallback.

    **Returns:**

    Exactly the pytree `jax.jacfwd(fn, argnums=argnums, holomorphic=holomorphic)(*args)`
    returns: for each output leaf, a pytree like the differentiated argument(s) of arrays of
    shape `out.shape + in.shape`.

    Where a partial derivative is NaN or infinite, `jax.jacfwd` multiplies it by the zeros
    of its basis (`0 * inf` is NaN), also where the structure knows the tangent to be
    zero: `x * y` at `x = inf, y = 0` is NaN in every entry of its row. The result is
    `jax.jacfwd`'s there too, NaN pattern included: one Jacobian-vector product (of ones)
    finds whether `jax.jacfwd` would form a NaN or infinity anywhere, and only then is the
    Jacobian recomputed as `jax.jacfwd` computes it, eagerly or under `jax.jit`. (Under
    `jax.jit`, `jax.jacfwd` itself can lose those NaNs: XLA rewrites a product with its
    visible identity basis into a select, so `jax.jit(jax.jacfwd(lambda x: jnp.inf * x))`
    has zeros off the diagonal; here the basis is hidden from XLA, and the eager pattern
    holds.) Under `jax.vmap` that recomputation is a `select`, so it always runs; where
    the NaN pattern does not matter, [`diffrax_linearize.materialise_operator`][] has no
    such check.
    """
    return _materialise(fn, args, argnums, holomorphic, mode, strict, nan_as_jacfwd=True)


def _materialise(fn, args, argnums, holomorphic, mode, strict, *, nan_as_jacfwd: bool):
    """`materialise`; with `nan_as_jacfwd=False`, without the check for (and recomputation
    of) a non-finite Jacobian: for the solvers, which have no use for `jax.jacfwd`'s NaN
    pattern and run under `jax.vmap`, where the recomputation would always run."""
    api = "diffrax_linearize.materialise"
    _check_mode(mode, api)
    closed, diff, rest, diff_tree, out_tree = _trace(fn, args, argnums, holomorphic, api)
    dynamic, static = _split_consts(closed.consts)
    spec = _Spec(
        closed.jaxpr,
        len(diff),
        mode,
        strict,
        structured=False,
        static_consts=static,
        nan_as_jacfwd=nan_as_jacfwd,
    )
    cells = _run_dense(spec, dynamic, diff, rest)
    return out_tree.unflatten([diff_tree.unflatten(row) for row in cells])


def solver_jacobian(fn: Callable, *args):
    """`materialise(fn, *args)` for the solvers' own matrices: without the check for
    `jax.jacfwd`'s NaN pattern (see `_materialise`)."""
    return _materialise(fn, args, 0, False, "auto", False, nan_as_jacfwd=False)


def solver_operator(fn: Callable, *args):
    """`materialise_operator(fn, *args)` for the solvers' own operators (root finders,
    Rosenbrock methods): without the search for rows that `jax.jvp` makes NaN whatever the
    vector (two more Jacobian-vector products per operator), where a solve has no use for
    `jax.jvp`'s NaN and the structure's derivative is the better one.

    A complex state (the first argument) takes the complex Jacobian that
    `jax.jacfwd(..., holomorphic=True)` gives, as Diffrax's implicit solvers take it
    (`lineax.JacobianLinearOperator` materialises a complex function that way).

    The Python scalars among the other arguments (an `args=0.7` that `diffrax.diffeqsolve`
    passes on as it is) are closed over, not traced: the functions the solvers hand over
    are closure-converted by optimistix and lineax, which keep such leaves static and refuse
    to be called with an array in their place."""
    y, rest = args[0], args[1:]
    holomorphic = any(jnp.iscomplexobj(leaf) for leaf in jtu.tree_leaves(y))
    dynamic, static = eqx.partition(rest, eqx.is_array)

    def with_static(y, dynamic):
        return fn(y, *eqx.combine(dynamic, static))

    return _materialise_operator(
        with_static, (y, dynamic), 0, holomorphic, "auto", False, nan_as_jacfwd=False
    )


def _block_operator(
    b: Struct | None, out_aval, in_shape, in_dtype, parts=None
) -> lx.AbstractLinearOperator:
    out_struct = jax.ShapeDtypeStruct(tuple(out_aval.shape), out_aval.dtype)
    in_struct = jax.ShapeDtypeStruct(tuple(in_shape), in_dtype)
    if b is None:
        m, n = math.prod(out_aval.shape), math.prod(in_shape)
        if m and n:  # the zero matrix: no entries, no numbers stored
            values = jnp.zeros((m, 0), out_aval.dtype)
            return SparseLinearOperator(values, np.zeros((0, m), np.int32), in_struct, out_struct)
        zeros = jnp.zeros(tuple(out_aval.shape) + tuple(in_shape), out_aval.dtype)
        return lx.PyTreeLinearOperator(zeros, out_struct)
    kind = b.kind() if out_aval.dtype == in_dtype else "dtype-changing"
    if kind == "sparse":
        return sparse_operator(b, in_struct, out_struct, parts)
    if kind == "identity":
        return lx.IdentityLinearOperator(in_struct, out_struct)
    if kind in ("scaled_identity", "diagonal"):
        c = b.canonical()
        diag = jnp.broadcast_to(
            jnp.asarray(c.val, dtype=out_aval.dtype).reshape(
                tuple(c.sizes[k] if k in c.val_labels else 1 for k in range(len(c.out_shape)))
            ),
            c.out_shape,
        )
        return lx.DiagonalLinearOperator(diag)
    dense = to_dense(b).astype(out_aval.dtype)
    if len(out_aval.shape) == 1 and len(in_shape) == 1:
        return lx.MatrixLinearOperator(dense)
    return lx.PyTreeLinearOperator(dense, out_struct)


@functools.singledispatch
def materialise_operator(
    fn: Callable,
    *args: Any,
    argnums: int = 0,
    holomorphic: bool = False,
    mode: MaterialiseMode = "auto",
    strict: bool = False,
) -> lx.AbstractLinearOperator:
    """The Jacobian of `fn` at `args` as a `lineax.AbstractLinearOperator` that keeps the
    detected structure, so that `lineax.linear_solve` can exploit it.

    For one array in and one array out: an identity becomes a
    `lineax.IdentityLinearOperator`, a scaled identity or diagonal a
    `lineax.DiagonalLinearOperator`, a block-diagonal, banded or other sparse pattern a
    [`diffrax_linearize.BlockDiagonalLinearOperator`][],
    `lineax.TridiagonalLinearOperator`, [`diffrax_linearize.BandedLinearOperator`][],
    [`diffrax_linearize.SparseLinearOperator`][] (ELLPACK: one with no entries for a zero
    Jacobian, such as `jnp.floor`'s) or [`diffrax_linearize.CSRLinearOperator`][] (rows
    of uneven lengths: the first of these that stores at most twice the pattern's
    nonzeros, else CSR; solve them with
    [`diffrax_linearize.StructuredLinearSolver`][]), a dense map of vectors a
    `lineax.MatrixLinearOperator`, anything else a `lineax.PyTreeLinearOperator`. With
    pytrees in or out, a `lineax.PyTreeLinearOperator` of the whole Jacobian (its structure
    queries such as `lineax.is_diagonal` then see a dense operator). A map that changes
    dtype (`x.astype(jnp.float32)`) is a `lineax.ComposedLinearOperator` of one of these
    and a `lineax.IdentityLinearOperator` that casts its input.

    **Arguments:**

    - `fn`, `*args`, `mode`, `strict`: as for [`diffrax_linearize.materialise`][].
    - `argnums`: a single int: the operator acts on one argument (a pytree).
    - `holomorphic`: as for `jax.jacfwd`: complex inputs and outputs. The operator is the
        matrix `jax.jacfwd(fn, holomorphic=True)` returns, whose columns are the
        derivatives along the real unit directions, as `lineax.JacobianLinearOperator`
        materialises a complex Jacobian: exact for a holomorphic `fn`, and for any other
        only the complex-linear map that agrees with the derivative on real directions.

    **Returns:** a `lineax.AbstractLinearOperator` from the differentiated argument's
    structure to `fn`'s output structure.

    The operator is for solves: its `mv` is `jax.jvp` of `fn`, so a NaN or infinite
    derivative (a function outside its domain) affects only the entries it multiplies.
    Where `jax.jvp` is NaN whatever the vector (a custom JVP rule that multiplies the
    zero tangent of a constant by an infinite factor, as `xlogy`'s does at `x = y = 0`;
    the zero rows `concatenate` gives a constant, times `sqrt`'s infinite derivative at
    0), the operator's row is NaN too: such rows are looked for, at the cost of two more
    Jacobian-vector products, wherever the linearisation may hold such a term (an
    identity then comes back as a `lineax.DiagonalLinearOperator`).
    Its `as_matrix()` is lineax's matrix of the operator, which for a diagonal operator
    is NaN only on the diagonal; [`diffrax_linearize.materialise`][] is the one that
    returns `jax.jacfwd`'s array exactly, whole NaN rows included.
    """
    return _materialise_operator(fn, args, argnums, holomorphic, mode, strict, nan_as_jacfwd=True)


def _materialise_operator(fn, args, argnums, holomorphic, mode, strict, *, nan_as_jacfwd: bool):
    api = "diffrax_linearize.materialise_operator"
    _check_mode(mode, api)
    if not isinstance(argnums, int):
        raise TypeError(f"`{api}`: `argnums` must be a single int, got {argnums!r}.")
    closed, diff, rest, diff_tree, out_tree = _trace(fn, args, argnums, holomorphic, api)
    dtypes = mixed_dtypes(diff)
    if dtypes is not None:
        raise TypeError(
            f"`{api}`: the differentiated argument mixes arrays of dtypes "
            f"{dtypes}, and a `lineax` operator takes one input dtype. Give every "
            "array the same dtype (`jax.tree.map(lambda x: x.astype(jnp.float64), y)`), or "
            "use `diffrax_linearize.materialise`, whose blocks keep their own dtypes."
        )
    dynamic, static = _split_consts(closed.consts)
    spec = _Spec(
        closed.jaxpr,
        len(diff),
        mode,
        strict,
        structured=True,
        static_consts=static,
        nan_as_jacfwd=nan_as_jacfwd,
    )
    op = _run_operator(spec, dynamic, diff, rest, diff_tree, out_tree)
    out_avals = [v.aval for v in closed.jaxpr.outvars]
    if len(diff) == 1 and len(out_avals) == 1 and out_avals[0].dtype != diff[0].dtype:
        # lineax's matrix operators take their input dtype from the matrix: a map that
        # changes dtype is the operator after a cast of its input, which lineax's identity
        # between the two structures does. (Not a `lineax.FunctionLinearOperator`, which
        # holds a jaxpr and so cannot be returned from `jax.jit`.)
        in_struct = jax.eval_shape(lambda: diff_tree.unflatten(diff))
        cast = lx.IdentityLinearOperator(in_struct, op.in_structure())
        return lx.ComposedLinearOperator(op, cast)
    return op


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _run_operator(spec: _Spec, consts, diff, rest, diff_tree, out_tree):
    fn = functools.partial(_operator, spec, diff_tree=diff_tree, out_tree=out_tree)
    return _without_dead_code(fn, consts, diff, rest)


def _operator(spec: _Spec, consts, diff, rest, *, diff_tree, out_tree):
    # Built inside `jit`, where the structure (a NumPy one for an identity, say) is known.
    _, f_jvp = jax.linearize(_function(spec, consts, rest), *diff)
    blocks, ctx, forward = _structured_jacobian(spec, consts, diff, rest, f_jvp)
    _check_strict(spec, ctx.densified, ctx.reasons)
    build = functools.partial(
        _blocks_operator, spec, diff, diff_tree, out_tree, split=lambda b: split_of(ctx, b)
    )
    if forward is None and _dense_by_nature(ctx, blocks):
        # `jax.jacfwd`'s matrix, as `materialise`: it holds `jax.jvp`'s NaN rows itself.
        cells = _jacfwd_cells(spec, f_jvp, diff, chunk=None)
        out_ndims = [len(v.aval.shape) for v in spec.jaxpr.outvars]
        return build([[Struct.from_dense(c, k) for c in row] for row, k in zip(cells, out_ndims)])
    adds_constants = spec.nan_as_jacfwd and jvp_may_add_constants(
        _function(spec, consts, rest), diff
    )
    if adds_constants:
        plain = build
        build = lambda blocks: plain(_with_constant_nan_rows(spec, f_jvp, diff, blocks))
    op = _structured_operator(build, blocks, forward)
    # A forward walk by rules that form no non-finite entry `jax.jacfwd` does not form
    # (`Context.nan_faithful`: an N-body field's) needs no branch recomputing `jax.jacfwd`'s
    # matrix: that branch, a loop over the basis, took most of the program's compile time.
    faithful = forward is None and ctx.nan_faithful and not adds_constants
    if (
        spec.nan_as_jacfwd
        and not faithful
        and isinstance(op, lx.MatrixLinearOperator | lx.PyTreeLinearOperator)
    ):
        op = _dense_operator_as_jacfwd(spec, f_jvp, diff, op)
    return op


def _dense_operator_as_jacfwd(spec: _Spec, f_jvp, diff, op):
    """A dense operator with a non-finite entry is `jax.jacfwd`'s matrix, NaN pattern
    included, computed in a branch that runs only then (as `materialise` does; see
    `_dense_jacobian`): the structured walk can form NaN where `jax.jacfwd` does not (a
    singular solve in one lane of a `jax.vmap`ped `jnp.linalg.inv` reaching the others'
    rows), which `mv` would then add to finite products."""
    if isinstance(op, lx.MatrixLinearOperator):
        leaves, treedef = [op.matrix], None
    else:
        leaves, treedef = jtu.tree_flatten(op.pytree)
    inexact = [x for x in leaves if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    if not inexact:
        return op
    finite = all_finite(inexact)

    @jax.jit  # named as `materialise`'s, so that tests can tell it from the rest
    def nonfinite_fallback():
        cells = [c for row in _jacfwd_cells(spec, f_jvp, diff) for c in row]
        if treedef is None:
            (cell,) = cells
            return [cell.reshape(op.matrix.shape).astype(op.matrix.dtype)]
        return [c.astype(jnp.result_type(x)) for c, x in zip(cells, leaves)]

    kept = jax.lax.cond(finite, lambda: [jnp.asarray(x) for x in leaves], nonfinite_fallback)
    if treedef is None:
        return lx.MatrixLinearOperator(kept[0])
    return lx.PyTreeLinearOperator(jtu.tree_unflatten(treedef, kept), op.out_structure())


def _structured_operator(build, blocks, forward):
    op = build(blocks)
    if forward is None:
        return op
    # As in `materialise`: reverse mode can form NaN where forward mode (`jax.jacfwd`'s
    # order) does not (a zero cotangent meeting an infinite factor), so a non-finite
    # operator is rebuilt in forward mode, in a branch that runs only then. Where the
    # forward structure differs from the reverse one, the branches cannot share a
    # type, and the operator is built in forward mode alone.
    dynamic, static = eqx.partition(op, _is_traced)
    leaves = [x for x in jtu.tree_leaves(dynamic) if jnp.issubdtype(x.dtype, jnp.inexact)]
    if not leaves:
        return op
    finite = all_finite(leaves)
    statics = []

    def rebuilt():
        dyn, st = eqx.partition(build(forward()[0]), _is_traced)
        statics.append(st)
        return dyn

    try:
        dynamic = jax.lax.cond(finite, lambda: dynamic, rebuilt)
        same = bool(eqx.tree_equal(statics[0], static))
    except (TypeError, ValueError):  # the branches' pytrees, shapes or dtypes differ
        same = False
    if not same:
        return build(forward()[0])
    return eqx.combine(dynamic, static)


def _with_constant_nan_rows(spec: _Spec, f_jvp, diff, blocks):
    """`blocks` with NaN rows where `jax.jvp` of the function is NaN whatever the vector:
    where the linearisation holds a constant term (see `may_add_constants`) that is not
    finite, which `jax.jacfwd` adds to every column of the row. Such a row is one where
    the linearisation of zeros is not finite but every entry the row stores is (else an
    infinite stored derivative met a zero of the vector), or where the linearisation of
    ones is NaN but no stored entry is (the term added to a stored infinite derivative).
    The operator's row is then NaN in the entries it stores (every row stores one for
    this)."""
    zeros, ones = jax.lax.optimization_barrier(
        ([jnp.zeros_like(x) for x in diff], [jnp.ones_like(x) for x in diff])
    )
    at_zeros, at_ones = f_jvp(*zeros), f_jvp(*ones)
    out = []
    for q, row in enumerate(blocks):
        aval = spec.jaxpr.outvars[q].aval
        if not jnp.issubdtype(aval.dtype, jnp.inexact) or not any(
            math.prod(jnp.shape(x)) for x in diff
        ):
            out.append(row)
            continue
        stored = [b for b in row if b is not None]
        finite = functools.reduce(
            jnp.logical_and, [b.rows_all(jnp.isfinite) for b in stored], jnp.bool_(True)
        )
        no_nan = functools.reduce(
            jnp.logical_and,
            [b.rows_all(lambda v: jnp.logical_not(jnp.isnan(v))) for b in stored],
            jnp.bool_(True),
        )
        bad = (jnp.logical_not(jnp.isfinite(at_zeros[q])) & finite) | (
            jnp.isnan(at_ones[q]) & no_nan
        )
        # The NaNs go into the first block of the row that has entries.
        p = next((p for p, b in enumerate(row) if b is not None), None)
        if p is None:
            p = next(p for p, x in enumerate(diff) if math.prod(jnp.shape(x)))
            row = [*row[:p], _zero_rows(aval, jnp.shape(diff[p])), *row[p + 1 :]]
        out.append([b.with_nan_rows(bad) if i == p else b for i, b in enumerate(row)])
    return out


def _zero_rows(out_aval, in_shape) -> Struct:
    """The zero block of these shapes as an `Ell` of one masked-out entry per row (pointing
    at the first input entry)."""
    k, n = len(out_aval.shape), len(in_shape)
    tmap = np.zeros((1,) + tuple(out_aval.shape), np.int32)
    ell = Ell(tmap, np.zeros(tmap.shape, bool), tuple(range(n)))
    labels = tuple(range(k + n))
    zero = np.zeros((), out_aval.dtype)
    return Struct(zero, (), labels[:k], labels[k:], out_aval.shape, in_shape, ell).canonical()


def _is_traced(x) -> bool:
    return isinstance(x, jax.Array)


def _blocks_operator(spec: _Spec, diff, diff_tree, out_tree, blocks, split=None):
    out_avals = [v.aval for v in spec.jaxpr.outvars]
    if jtu.treedef_is_leaf(diff_tree) and jtu.treedef_is_leaf(out_tree):
        b = blocks[0][0]
        parts = None if split is None or b is None else split(b)
        return _block_operator(b, out_avals[0], diff[0].shape, diff[0].dtype, parts)
    cells = []
    for q, row in enumerate(blocks):
        aval = out_avals[q]
        cells.append(
            [
                jnp.zeros(tuple(aval.shape) + tuple(diff[p].shape), aval.dtype)
                if b is None
                else to_dense(b).astype(aval.dtype)
                for p, b in enumerate(row)
            ]
        )
    jac = out_tree.unflatten([diff_tree.unflatten(row) for row in cells])
    out_struct = out_tree.unflatten([jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals])
    return lx.PyTreeLinearOperator(jac, out_struct)


def structured_blocks(fn: Callable, *args, mode: MaterialiseMode = "forward"):
    """For use inside a trace (a solver step): the structured Jacobian of `fn` with respect
    to its first argument, as `(blocks, in_tree, out_tree)` where `blocks[q][p]` is the
    [`diffrax_linearize.internal.Struct`][] of output leaf `q` w.r.t. input leaf `p`, or
    `None` where it is zero. Nothing is compiled separately. `mode` is as for
    [`diffrax_linearize.materialise`][], but defaults to `"forward"`."""
    api = "diffrax_linearize.internal.structured_blocks"
    closed, diff, rest, diff_tree, out_tree = _trace(fn, args, 0, False, api)
    dynamic, static = _split_consts(closed.consts)
    spec = _Spec(closed.jaxpr, len(diff), mode, False, structured=True, static_consts=static)
    blocks, _, _ = _structured_jacobian(spec, dynamic, diff, rest)
    return blocks, diff_tree, out_tree


class StructureReport:
    """What the structure engine found in a Jacobian: for each (output leaf, input leaf)
    pair, the kind of block and the numbers it stores against a dense block's, and the
    primitives that took the exact dense fallback. Returned by
    [`diffrax_linearize.structure_report`][]; `str(report)` is a table.

    **Arguments:**

    - `rows`: one dictionary per (output leaf, input leaf) pair, with keys `"output"` and
        `"input"` (the leaves' paths) and `"structure"` (the block's description).
    - `densified`: for each primitive that took the exact dense fallback (or whose rule
        could not keep the structure of its input), how many of its equations did.
    - `coloured`: for each primitive computed by the sparse fallback (compressed
        evaluations over a colouring of its pattern), the colour count of each equation.
    - `reasons`: for each primitive in `densified`, why it lost structure (such as
        `"no structure rule"`, or a gather's indices not known at trace time).
    """

    def __init__(self, rows, densified, coloured, reasons=None):
        self.rows = rows
        self.densified = densified
        self.coloured = coloured
        self.reasons = {} if reasons is None else reasons

    @property
    def kinds(self) -> list[str]:
        """The description of each block, in the order of `rows`."""
        return [row["structure"] for row in self.rows]

    def __str__(self):
        lines = ["output leaf | input leaf | structure", "---|---|---"]
        for row in self.rows:
            lines.append(f"{row['output']} | {row['input']} | {row['structure']}")
        if self.densified:
            names = _densified_names(self.densified, self.reasons)
            lines.append(f"\nDense fallback (structure lost): {names}")
        else:
            lines.append("\nNo dense fallback.")
        if self.coloured:
            names = ", ".join(
                f"`{k}` ({', '.join(map(str, v))} colours)"
                for k, v in sorted(self.coloured.items())
            )
            lines.append(f"Sparse fallback (compressed evaluations over a colouring): {names}")
        return "\n".join(lines)

    __repr__ = __str__


def structure_report(
    fn: Callable, *args: Any, argnums: int | Sequence[int] = 0, mode: MaterialiseMode = "auto"
) -> StructureReport:
    """Report the structure [`diffrax_linearize.materialise`][] finds in the Jacobian of
    `fn` at `args`, without computing it (only a trace): each block's kind, such as
    `"diagonal"`, `"block-diagonal 1000 x 3 x 3"`, `"banded, offsets -1..1"` or
    `"sparse, 6 entries per row"`, with the numbers it stores against the dense
    Jacobian's, and the primitives that took the exact dense fallback.

    **Arguments:** `fn`, `*args`, `argnums`, `mode` as for
    [`diffrax_linearize.materialise`][].

    **Returns:** a `StructureReport`; print it for a table.
    """
    api = "diffrax_linearize.structure_report"
    _check_mode(mode, api)
    closed, diff, rest, diff_tree, out_tree = _trace(fn, args, argnums, False, api)
    dynamic, static = _split_consts(closed.consts)
    spec = _Spec(closed.jaxpr, len(diff), mode, False, structured=True, static_consts=static)
    found = []

    def run(dynamic, diff, rest):
        blocks, ctx, _ = _structured_jacobian(spec, dynamic, diff, rest)
        found.append((blocks, ctx))
        return 0

    jax.eval_shape(run, dynamic, diff, rest)
    blocks, ctx = found[0]
    in_paths = [
        jtu.keystr(p) or "x" for p, _ in jtu.tree_flatten_with_path(diff_tree.unflatten(diff))[0]
    ]
    out_avals = [v.aval for v in closed.jaxpr.outvars]
    out_paths = [
        jtu.keystr(p) or "out"
        for p, _ in jtu.tree_flatten_with_path(out_tree.unflatten(out_avals))[0]
    ]
    rows = []
    for q, row in enumerate(blocks):
        for p, b in enumerate(row):
            if b is None:
                n = math.prod(out_avals[q].shape) * math.prod(jnp.shape(diff[p]))
                text = f"zero: 0 numbers stored, dense {n:,}"
            else:
                text = describe(b)
            rows.append({"output": out_paths[q], "input": in_paths[p], "structure": text})
    reasons = {k: list(v) for k, v in ctx.reasons.items()}
    return StructureReport(rows, dict(ctx.densified), dict(ctx.coloured), reasons)


def filter_materialise(
    fn: Callable, x: Any, *args: Any, mode: MaterialiseMode = "auto", strict: bool = False
):
    """The Jacobian of `fn` with respect to the floating-point arrays of its first
    argument, as `equinox.filter_jacfwd(fn)(x, *args)` returns it, computed by
    [`diffrax_linearize.materialise`][].

    As `equinox.filter_jacfwd`, for a whole Equinox module or any pytree `x`: its
    inexact-array leaves (`equinox.is_inexact_array`) are differentiated; every other
    leaf (integer arrays, Python numbers, functions, ...) is held fixed, and its place in
    the Jacobian is `None`. `args` are not differentiated; `fn` is called with them as
    given, closed over.

    ```python
    import equinox as eqx
    import jax
    import diffrax_linearize as dl

    mlp = eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0))
    x = jax.numpy.ones(3)
    J = dl.filter_materialise(lambda m, x: m(x), mlp, x)
    assert J.layers[0].weight.shape == (2, 8, 3)
    assert J.activation is None  # a function, not differentiated
    ```

    **Arguments:**

    - `fn`: a function `fn(x, *args)` returning a pytree of arrays.
    - `x`: a pytree, such as an `equinox.Module`; its floating-point array leaves are
        differentiated. Complex leaves are refused, as by `equinox.filter_jacfwd`: use
        `diffrax_linearize.materialise(..., holomorphic=True)` for those.
    - `*args`: further arguments of `fn`, held fixed.
    - `mode`, `strict`: as for [`diffrax_linearize.materialise`][].

    **Returns:**

    Exactly the pytree `equinox.filter_jacfwd(fn)(x, *args)` returns: for each output
    leaf, a pytree like `x` with `None` for the leaves held fixed and arrays of shape
    `out.shape + leaf.shape` for the others.
    """
    api = "diffrax_linearize.filter_materialise"
    if not callable(fn):
        raise TypeError(f"`{api}`: the first argument must be a callable, got {type(fn).__name__}.")
    diff_x, static_x = eqx.partition(x, eqx.is_inexact_array)
    leaves = jtu.tree_leaves(diff_x)
    if not leaves:
        raise TypeError(
            f"`{api}`: the first argument of `fn` holds no floating-point arrays to "
            "differentiate (integer arrays and non-array leaves are held fixed, as with "
            "`equinox.filter_jacfwd`). Pass floating-point parameters, or convert them with "
            "`jnp.asarray(x, dtype=float)`."
        )
    if any(jnp.issubdtype(leaf.dtype, jnp.complexfloating) for leaf in leaves):
        raise TypeError(
            f"`{api}` differentiates real floating-point leaves only (as "
            "`equinox.filter_jacfwd` and `jax.jacfwd` do), but the first argument holds "
            "complex arrays. For a holomorphic function of complex inputs, use "
            "`diffrax_linearize.materialise(fn, x, holomorphic=True)`."
        )
    return materialise(
        lambda d: fn(eqx.combine(d, static_x), *args), diff_x, mode=mode, strict=strict
    )
