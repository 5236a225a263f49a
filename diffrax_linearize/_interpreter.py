"""The structure interpreter: evaluates a linear jaxpr on structured Jacobian blocks.

Each variable of the jaxpr holds either a constant (an ordinary array: it does not depend on
the inputs being differentiated) or a [`Lin`][diffrax_linearize.internal.Lin]: the Jacobian
of the variable with respect to every input leaf, one structured block per leaf. Equations
whose inputs are all constant are evaluated as usual. The others go to the rule registered
for their primitive, or to the exact dense fallback: the equation applied, with `jax.vmap`,
to the dense Jacobian columns.
"""

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ._compat import (
    bind_eqn,
    eqn_as_jaxpr,
    is_literal,
    is_tracer,
    literal_value,
    prim,
    scan_counts,
    used_inputs,
)
from ._sparsity import add, to_dense
from ._structure import is_known, Struct


class Lin:
    """A linear value: one structured Jacobian block per input leaf (absent means zero).

    **Arguments:**

    - `blocks`: a dict from the index of an input leaf to the
        [`Struct`][diffrax_linearize.internal.Struct] of this value with respect to it.
    - `shape`, `dtype`: the shape and dtype of the value.
    """

    __slots__ = ("blocks", "shape", "dtype")

    def __init__(self, blocks: dict[int, Struct], shape, dtype):
        self.blocks = blocks
        self.shape = tuple(shape)
        self.dtype = dtype

    def __repr__(self):
        kinds = {p: b.kind() for p, b in self.blocks.items()}
        return f"Lin(shape={self.shape}, dtype={self.dtype}, blocks={kinds})"


@dataclasses.dataclass
class Context:
    """What the interpreter needs besides the values: the input leaves' shapes, and a record
    of the primitives that lost structure.

    **Arguments:**

    - `in_shapes`: the shape of each input leaf, in order.
    - `densified`: filled in by `record`: how many equations of each primitive took the
        dense fallback or otherwise lost structure (what `materialise(..., strict=True)`
        reports).
    - `reasons`: filled in by `record`: for each primitive in `densified`, why its
        equations lost structure (each distinct reason once).
    - `coloured`: filled in by `record_colouring`: for each primitive computed by the
        sparse fallback, the number of colours (compressed evaluations) of each of its
        equations.
    - `structured_work`, `jacfwd_work`, `control_flow`: filled in by `count_work`: the
        numbers the rules' traced blocks held, those `jax.jacfwd` computes for the same
        equations, and whether the walk met a loop or a branch.
    - `splits`: filled in by `apply_rule` (see `split_of`): for blocks that are the sum of
        a part known at trace time and a traced part, those two parts, keyed by the
        block's `id`.
    - `nan_faithful`: cleared by `apply_rule` when an equation took a rule not registered
        with `nan_faithful=True` (or the dense fallback): while set, every non-finite entry of a
        forward walk's blocks is one that `jax.jacfwd` forms too.
    """

    in_shapes: list[tuple[int, ...]]
    densified: dict[str, int] = dataclasses.field(default_factory=dict)
    coloured: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    reasons: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    structured_work: int = 0
    jacfwd_work: int = 0
    control_flow: bool = False
    splits: dict[int, tuple[Struct, Struct, Struct]] = dataclasses.field(default_factory=dict)
    nan_faithful: bool = True

    def record(self, name: str, reason: str | None = None):
        """An equation of primitive `name` whose result was made dense, and why."""
        self.densified[name] = self.densified.get(name, 0) + 1
        if reason is not None:
            known_reasons = self.reasons.setdefault(name, [])
            if reason not in known_reasons:
                known_reasons.append(reason)

    def count_work(self, eqn, vals, outs):
        """Count an equation the rules evaluated: the numbers its traced blocks hold (in
        and out, whichever is more), against the numbers `jax.jacfwd` computes for it
        (its linear inputs or outputs, whichever are more, once per basis vector, times
        the contracted size of a product). Calls are counted by their equations; control
        flow only marks the walk (its bodies are walked more than once)."""
        if call_jaxpr(eqn, custom_jvp=True) is not None:
            return
        if any(eqn.primitive is prim(name) for name in _CONTROL_FLOW):
            self.control_flow = True
            return

        def stored(xs):
            return sum(
                math.prod(np.shape(b.val))
                for x in xs
                if isinstance(x, Lin)
                for b in x.blocks.values()
                if not isinstance(b.val, np.ndarray | np.generic)
            )

        def size(xs):
            return sum(math.prod(x.shape) for x in xs if isinstance(x, Lin))

        n_in = sum(math.prod(s) for s in self.in_shapes)
        self.structured_work += max(stored(vals), stored(outs))
        self.jacfwd_work += n_in * max(size(vals), size(outs)) * _contracted_size(eqn)

    def record_colouring(self, name: str, colours: int):
        """An equation computed by the sparse fallback, with `colours` compressed
        evaluations."""
        self.coloured.setdefault(name, []).append(colours)


Rule = Callable[..., object]

_CONTROL_FLOW = ("scan", "while", "cond")


def _contracted_size(eqn) -> int:
    """How many products each output element of `eqn` sums: the contracted size of a
    `dot_general` or a convolution, else one."""
    if eqn.primitive is prim("dot_general"):
        (contracting, _), _ = eqn.params["dimension_numbers"]
        return math.prod(eqn.invars[0].aval.shape[d] for d in contracting)
    if eqn.primitive is prim("conv_general_dilated"):
        rhs = eqn.invars[1].aval.shape
        out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
        return max(1, math.prod(rhs) // max(1, out_features))
    return 1


JACOBIAN = "jacobian"
"""The name of the structure engine's own recursion: the rules that propagate
[`Struct`][diffrax_linearize.internal.Struct] blocks through linear equations."""

# One registry family: recursion name -> {primitive: rule}. Each is a plain dict.
_REGISTRIES: dict[str, dict[object, Rule]] = {JACOBIAN: {}}
_RULES = _REGISTRIES[JACOBIAN]


def rule_registry(recursion: str = JACOBIAN) -> dict[object, Rule]:
    """The rule registry of one recursion: a plain dict `{primitive: rule}`, created empty
    on first use.

    **Arguments:**

    - `recursion`: the recursion's name: `"jacobian"` (the default) for the structure
        engine's rules, `"squared_grads"` for the per-example gradient norms, or your own.

    **Returns:** the dict itself (rules are added with `register_rule`).
    """
    return _REGISTRIES.setdefault(recursion, {})


def register_rule(
    *prims, recursion: str = JACOBIAN, termwise: bool = False, nan_faithful: bool = False
):
    """Decorator: register a rule for the given primitives in the registry of `recursion`.

    For the structure engine's own recursion (the default, `"jacobian"`) the rule is
    `rule(ctx, eqn, invals) -> outvals`: `invals` holds, per input of the equation, a
    [`Lin`][diffrax_linearize.internal.Lin] or a constant array; the rule returns one value
    per output. A rule may return `NotImplemented` to hand the equation to the exact dense
    fallback (for a case it does not cover). Another recursion defines its own rule
    signature (see [Writing a recursion](../devdocs/structure_engine.md)).

    **Arguments:**

    - `*prims`: the primitives (`None` entries, for primitives this JAX version lacks, are
        skipped).
    - `recursion`: the name of the recursion the rule belongs to.
    - `termwise`: for the `"jacobian"` recursion, whether the rule may be applied to each
        term of a sum of blocks of different structure, the results added: it must be
        linear in its one traced input (one output, the other inputs constant) and cheap
        (no sub-jaxpr to interpret once per term). The flag is set on the rule itself
        (`rule.termwise`); see *Sums of different deltas* in the developer page on the
        structure engine.
    - `nan_faithful`: for the `"jacobian"` recursion, whether the rule computes each entry
        of its output blocks from the same products of the same constants that
        `jax.jacfwd`'s push of a basis vector through the equation forms, leaving out only
        products with a zero the structure knows of (where `to_dense` forms `0 * v`, as the
        push does): so that a non-finite entry it forms, `jax.jacfwd` forms too (up to
        overflow of a product rounded in another order). Rules that apply a primitive to
        whole columns (solves, the dense fallback), move entries by traced indices or hold
        control flow must not say so. A walk through such rules only needs no branch
        recomputing `jax.jacfwd`'s matrix for its non-finite entries
        (`Context.nan_faithful`). Set on the rule itself (`rule.nan_faithful`).
    """

    def decorator(rule: Rule) -> Rule:
        if termwise:
            rule.termwise = True  # pyright: ignore[reportFunctionMemberAccess]
        if nan_faithful:
            rule.nan_faithful = True  # pyright: ignore[reportFunctionMemberAccess]
        registry = rule_registry(recursion)
        for p in prims:
            if p is not None:
                registry[p] = rule
        return rule

    return decorator


def lookup_rule(primitive, recursion: str = JACOBIAN) -> Rule | None:
    """The rule registered for `primitive` with
    [`register_rule`][diffrax_linearize.internal.register_rule], or `None`. For the
    `"jacobian"` recursion `None` means that the equation takes the exact
    [`dense_fallback`][diffrax_linearize.internal.dense_fallback].

    **Arguments:**

    - `primitive`: a JAX primitive.
    - `recursion`: the name of the recursion whose registry is searched.
    """
    return _REGISTRIES.get(recursion, {}).get(primitive)


def registered_primitives(recursion: str = JACOBIAN) -> list[str]:
    """The names of all primitives that have a rule in the registry of `recursion`, sorted:
    for the structure engine, those not listed take the exact dense fallback.

    **Arguments:**

    - `recursion`: the name of the recursion (default `"jacobian"`).
    """
    return sorted(str(p) for p in rule_registry(recursion))


def known(x):
    """`x` as a NumPy array if it is known at trace time (NumPy, a Python scalar, a
    concrete JAX array), else `None`."""
    if isinstance(x, Lin):
        return None
    if isinstance(x, np.ndarray | np.generic | int | float | bool | complex):
        return np.asarray(x)
    if (
        isinstance(x, jax.Array)
        and not is_tracer(x)
        and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)
    ):
        return np.asarray(x)
    return None


# Equations on known values are evaluated at trace time when their outputs are indices
# (integers, booleans: what gathers, scatters and selections need to be known) or small;
# large floating results stay in the program, which must not hold them as constants.
_KNOWN_INDEX_SIZE = 1 << 24
_KNOWN_FLOAT_SIZE = 1 << 12


def evaluate_known(eqn, vals):
    """`eqn` applied to `vals` at trace time, as NumPy outputs, if every input is known and
    the outputs are indices or small; else `None`."""
    if eqn.effects:
        return None
    for v in eqn.outvars:
        if not isinstance(getattr(v.aval, "dtype", None), np.dtype):
            return None  # PRNG keys, tokens
        n = math.prod(v.aval.shape)
        if jnp.issubdtype(v.aval.dtype, jnp.inexact):
            if n > _KNOWN_FLOAT_SIZE:
                return None
        elif n > _KNOWN_INDEX_SIZE:
            return None
    args = [known(x) for x in vals]
    if any(a is None for a in args):
        return None
    with jax.ensure_compile_time_eval():
        outs = bind_eqn(eqn, [jnp.asarray(a) for a in args])
    return [np.asarray(o) for o in outs]


def read_value(env, v):
    if is_literal(v):
        return np.asarray(literal_value(v), dtype=v.aval.dtype)
    return env[v]


# Call-like primitives whose sub-jaxpr computes the same values as the equation.
_CALLS = ("jit", "closed_call", "remat")


def call_jaxpr(eqn, custom_jvp: bool = False):
    """The sub-jaxpr of a call equation, which computes the same values as the equation.

    **Arguments:**

    - `eqn`: a `JaxprEqn`.
    - `custom_jvp`: also open `custom_jvp_call` equations (their sub-jaxpr has the same
        values but not the same derivatives: right for a linear program, not for a
        recursion that differentiates).

    **Returns:** `(jaxpr, consts)` for a `jit`, `closed_call` or `remat` equation (and with
    `custom_jvp`, a `custom_jvp_call`), else `None`.
    """
    names = _CALLS + (("custom_jvp_call",) if custom_jvp else ())
    if not any(eqn.primitive is prim(name) for name in names):
        return None
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if name in eqn.params:
            closed = eqn.params[name]
            return getattr(closed, "jaxpr", closed), getattr(closed, "consts", ())
    return None


def eval_jaxpr(jaxpr, consts, invals, apply_eqn: Callable, *, inline=None, path=None) -> list:
    """The one jaxpr walker: evaluate `jaxpr` equation by equation, each through
    `apply_eqn(eqn, vals)`, reading and writing the environment here.

    **Arguments:**

    - `jaxpr`, `consts`, `invals`: a `Jaxpr`, the values of its constvars and invars.
    - `apply_eqn`: `apply_eqn(eqn, vals) -> outs`; with `path`, `apply_eqn(eqn, vals, key)`
        where `key` is `path` followed by the equation's index (nested calls append theirs),
        so that a recursion can tell apart two calls of the same sub-jaxpr.
    - `inline`: optional `inline(eqn, vals[, key]) -> bool`, asked for each call equation
        (see `call_jaxpr`): `True` evaluates its sub-jaxpr here, by the same walker.
    - `path`: the key prefix of this jaxpr's equations, or `None` for no keys.

    **Returns:** one value per outvar.
    """
    env = {}
    for v, val in zip(jaxpr.constvars, consts):
        env[v] = val
    for v, val in zip(jaxpr.invars, invals):
        env[v] = val
    for i, eqn in enumerate(jaxpr.eqns):
        vals = [read_value(env, v) for v in eqn.invars]
        extra = () if path is None else ((*path, i),)
        sub = None if inline is None else call_jaxpr(eqn)
        if sub is not None and inline(eqn, vals, *extra):
            sub_path = None if path is None else extra[0]
            outs = eval_jaxpr(*sub, vals, apply_eqn, inline=inline, path=sub_path)
        else:
            outs = apply_eqn(eqn, vals, *extra)
        for v, out in zip(eqn.outvars, outs):
            env[v] = out
    return [read_value(env, v) for v in jaxpr.outvars]


def subjaxprs(eqn):
    """The sub-jaxprs (open `Jaxpr`s) held in `eqn`'s parameters: call bodies, branches,
    loop bodies."""
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if hasattr(item, "eqns"):
                yield item
            elif hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):
                yield item.jaxpr


def iter_eqns(jaxpr):
    """Every equation of `jaxpr` and, depth first, of its sub-jaxprs: for queries over a
    program (which primitives, which callables it holds) that evaluate nothing.

    **Arguments:**

    - `jaxpr`: a `Jaxpr`.

    **Returns:** an iterator of `JaxprEqn`s.
    """
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in subjaxprs(eqn):
            yield from iter_eqns(sub)


def interpret(ctx: Context, jaxpr, consts, invals) -> list:
    """Evaluate `jaxpr` on `invals`, each a [`Lin`][diffrax_linearize.internal.Lin] or a
    constant: constant equations as usual, the others by their structure rules.

    **Arguments:**

    - `ctx`: the [`Context`][diffrax_linearize.internal.Context] of the interpretation.
    - `jaxpr`, `consts`: a `Jaxpr` and the values of its constvars.
    - `invals`: one value per invar of `jaxpr`.

    **Returns:** one value per outvar, each a `Lin` or a constant array.
    """

    def apply_eqn(eqn, vals):
        if any(isinstance(x, Lin) for x in vals):
            return [_without_empty(x) for x in apply_rule(ctx, eqn, vals)]
        outs = evaluate_known(eqn, vals)
        return bind_eqn(eqn, vals) if outs is None else outs

    invals = [_without_empty(x) for x in invals]
    return [settle(x) for x in eval_jaxpr(jaxpr, consts, invals, apply_eqn)]


def _without_empty(x):
    """`x` without its blocks of no entries (an empty value, or with respect to an empty
    input): they are zero, and absent blocks are zero, so no rule meets an empty axis."""
    if not isinstance(x, Lin):
        return x
    if math.prod(x.shape) == 0:
        return Lin({}, x.shape, x.dtype) if x.blocks else x
    empty = [p for p, b in x.blocks.items() if math.prod(_terms(b)[0].in_shape) == 0]
    if not empty:
        return x
    return Lin({p: b for p, b in x.blocks.items() if p not in empty}, x.shape, x.dtype)


class LazySum:
    """A block kept as a sum of terms of different structure, inside `interpret` only.

    The sum of blocks whose deltas differ (`p[None, :] - p[:, None]`, the pairwise
    differences of an N-body field) has no delta form: merged, it is a row-compressed
    pattern with one entry per term, whose `tmap` holds every out position (`O(n^2)`
    NumPy work at trace time and index constants in the program), and every later sum over
    an out axis folds those entries into more. Each term alone keeps its deltas, and the
    rules are linear, so the equations that follow such a sum apply their rule to each
    term; terms of one structure are added as they meet, and the rest are added only where
    an equation needs one block (any other rule, the outputs), by then often dense
    anyway, with no pattern on the way."""

    __slots__ = ("terms",)

    def __init__(self, terms):
        self.terms = tuple(terms)


# Equations applied term by term to a `LazySum`: sums, and those of one linear input whose
# rule says it may be (`register_rule(..., termwise=True)`: the elementwise and shape
# equations that follow a sum of differences, cheap per term, never a sub-jaxpr
# interpreted once per term).
_SUMS = frozenset({"add", "add_any", "sub"})


def _termwise(rule) -> bool:
    return getattr(rule, "termwise", False)


def _terms(b) -> tuple:
    return b.terms if isinstance(b, LazySum) else (b,)


def _is_lazy(x) -> bool:
    return isinstance(x, Lin) and any(isinstance(b, LazySum) for b in x.blocks.values())


def settle(x):
    """`x` with every `LazySum` block added up into one block."""
    if not _is_lazy(x):
        return x
    blocks = {}
    for p, b in x.blocks.items():
        # The terms with fewest deltas first, so that no partial sum is more structured
        # than the whole: two terms each dense where the other has a delta add up to a
        # wide pattern (`O(n^2)` at trace time), though a dense third makes the sum dense.
        terms = sorted(_terms(b), key=lambda t: (t.ell is not None, len(t.ties)))
        out = terms[0]
        for t in terms[1:]:
            out = add(out, t).astype(x.dtype)
        blocks[p] = out
    return Lin(blocks, x.shape, x.dtype)


def _term_lins(x: Lin) -> list[Lin]:
    n = max((len(_terms(b)) for b in x.blocks.values()), default=1)
    return [
        Lin({p: _terms(b)[k] for p, b in x.blocks.items() if k < len(_terms(b))}, x.shape, x.dtype)
        for k in range(n)
    ]


def _same_form(a: Struct, b: Struct) -> bool:
    if a.out_shape != b.out_shape:
        return False
    if a.ell is not None or b.ell is not None:
        return a.ell is not None and b.ell is not None
    # A block without deltas decides the sum's structure on its own: no use waiting.
    return not a.ties or not b.ties or a.canonical().ties == b.canonical().ties


def _collect(terms, dtype):
    """One block, or a `LazySum` of the terms of different structure."""
    groups: list[Struct] = []
    for t in terms:
        for k, g in enumerate(groups):
            if _same_form(g, t):
                groups[k] = add(g, t).astype(dtype)
                break
        else:
            groups.append(t)
    return groups[0] if len(groups) == 1 else LazySum(groups)


def _ties_differ(vals) -> bool:
    """Whether two linear inputs of a sum hold blocks of one leaf without a pattern and
    with different deltas (or shapes, broadcast by the sum): their merged block could be a
    pattern."""
    seen: dict[int, Struct] = {}
    for x in vals:
        if not isinstance(x, Lin):
            continue
        for p, b in x.blocks.items():
            if b.ell is not None:
                continue
            if p in seen and not _same_form(seen[p], b):
                return True
            seen.setdefault(p, b)
    return False


def _apply_termwise(ctx: Context, eqn, vals) -> list:
    """The equation applied to each term of its linear inputs (it is linear in them), the
    results collected per leaf."""
    collected: dict[int, list] = {}
    out_lin = None
    for i, x in enumerate(vals):
        if not isinstance(x, Lin):
            continue
        for xk in _term_lins(x):
            sub = [
                xk if j == i else (Lin({}, v.shape, v.dtype) if isinstance(v, Lin) else v)
                for j, v in enumerate(vals)
            ]
            (out,) = apply_rule(ctx, eqn, sub)
            if not isinstance(out, Lin):
                return NotImplemented
            out_lin = out
            for p, b in out.blocks.items():
                collected.setdefault(p, []).append(b)
    blocks = {p: _collect(ts, out_lin.dtype) for p, ts in collected.items()}
    return [Lin(blocks, out_lin.shape, out_lin.dtype)]


def apply_rule(ctx: Context, eqn, vals) -> list:
    name = eqn.primitive.name
    lazy = any(_is_lazy(x) for x in vals)
    rule = lookup_rule(eqn.primitive)
    if len(eqn.outvars) == 1:
        outs = NotImplemented
        if name in _SUMS and (lazy or _ties_differ(vals)):
            outs = _apply_termwise(ctx, eqn, vals)
        elif lazy and _termwise(rule) and sum(isinstance(x, Lin) for x in vals) == 1:
            outs = _apply_termwise(ctx, eqn, vals)
        if outs is not NotImplemented:
            return outs
    vals = [settle(x) for x in vals]
    outs = NotImplemented if rule is None else rule(ctx, eqn, vals)
    if outs is NotImplemented:
        reason = "no structure rule" if rule is None else "its rule does not cover this case"
        outs = dense_fallback(ctx, eqn, vals, reason=reason)
    elif eqn.primitive.name in _SPLIT_PRIMITIVES:
        _record_splits(ctx, rule, eqn, vals, outs)
    if not getattr(rule, "nan_faithful", False):
        ctx.nan_faithful = False
    ctx.count_work(eqn, vals, outs)
    return outs


def split_of(ctx: Context, block: Struct) -> tuple[Struct, Struct] | None:
    """`(known, traced)` where `block` was recorded as their sum: `known` with a `val`
    known at trace time (a NumPy array), `traced` with a traced one; else `None`.

    A vector field is often a transport term with constant coefficients (a stencil, a
    graph Laplacian: its block's `val` is a NumPy array) plus a traced reaction term (a
    diagonal): the sum's `val` is traced and holds every entry of both, as wide as the
    widest row. An operator assembled from the two parts stores the known part as a
    constant and computes only the traced part's entries: worth it where the traced part
    stores less than two thirds of the sum's numbers (measured on the structure benchmark:
    a block-diagonal sum whose traced part holds two of three entries a row is assembled
    faster whole), `None` otherwise."""
    found = ctx.splits.get(id(block))
    if found is None or found[0] is not block:
        return None
    known, traced = found[1], found[2]
    if 3 * traced.stored_size() >= 2 * block.stored_size():
        return None
    return known, traced


# Equations through which the known and traced parts of a sum are followed (each part is
# applied the equation's rule again): sums, and the moves that end a vector field (a
# `jnp.stack` of species, a `reshape` to a vector), while the known part stays known.
_SPLIT_PRIMITIVES = frozenset(
    {
        "add",
        "add_any",
        "sub",
        "neg",
        "mul",
        "reshape",
        "squeeze",
        "concatenate",
        "stack",
        "convert_element_type",
        "transpose",
    }
)


def _parts(ctx: Context, x: Lin) -> tuple[Lin, Lin]:
    known, traced = {}, {}
    for p, b in x.blocks.items():
        split = split_of(ctx, b)
        if split is not None:
            known[p], traced[p] = split
        elif is_known(b.val):
            known[p] = b
        else:
            traced[p] = b
    return Lin(known, x.shape, x.dtype), Lin(traced, x.shape, x.dtype)


def _record_splits(ctx: Context, rule, eqn, vals, outs):
    """Where the equation's linear inputs hold known and traced parts, the rule applied
    to each (it is linear in them), recorded in `ctx.splits` for the outputs' blocks while
    the known part stays known."""
    lins = [k for k, x in enumerate(vals) if isinstance(x, Lin)]
    parts = {k: _parts(ctx, vals[k]) for k in lins}
    if not any(parts[k][0].blocks for k in lins) or not any(parts[k][1].blocks for k in lins):
        return
    record = (dict(ctx.densified), {k: list(v) for k, v in ctx.reasons.items()})
    try:
        both = []
        for side in (0, 1):
            side_vals = [parts[k][side] if k in parts else x for k, x in enumerate(vals)]
            both.append(rule(ctx, eqn, side_vals))
    except Exception:  # a rule that does not take an input without blocks: no split
        return
    finally:
        ctx.densified, ctx.reasons = record
    known_outs, traced_outs = both
    if known_outs is NotImplemented or traced_outs is NotImplemented:
        return
    for out, known, traced in zip(outs, known_outs, traced_outs):
        if not all(isinstance(x, Lin) for x in (out, known, traced)):
            continue
        for p, b in out.blocks.items():
            k, t = known.blocks.get(p), traced.blocks.get(p)
            if k is None or t is None or not is_known(k.val) or is_known(t.val):
                continue
            if k.out_shape != b.out_shape or t.out_shape != b.out_shape:
                continue
            ctx.splits[id(b)] = (b, k, t)


def zeros_like_lin(x: Lin):
    return jnp.zeros(x.shape, x.dtype)


def linear_outputs(eqn, vals) -> list[bool]:
    """Which outputs of `eqn` depend on its linear inputs. Only equations holding
    sub-jaxprs (control flow) can mix constant and linear outputs."""
    return _depending_outputs(eqn, [isinstance(x, Lin) for x in vals])


def _depending_outputs(eqn, is_lin) -> list[bool]:
    n = len(eqn.outvars)
    if not any(True for _ in subjaxprs(eqn)):
        return [True] * n
    jaxpr = eqn_as_jaxpr(eqn)
    out = []
    for k in range(n):
        used = used_inputs(jaxpr, [j == k for j in range(n)])
        out.append(any(u and lin for u, lin in zip(used, is_lin)))
    return out


def map_columns(fn: Callable, args, in_axes) -> list:
    """`jax.vmap(fn, in_axes=in_axes, out_axes=-1)(*args)`, with each of `in_axes` either
    `-1` or `None`: `fn` applied to each column (the last axis) of the mapped arguments.

    Some primitives have no batching rule (`jax.experimental.sparse`'s `coo_todense`, for
    which `jax.jacfwd` fails too), or one for leading batch axes only (the BCOO
    primitives raise `NotImplementedError` or `ValueError` for a trailing one). Where
    mapping over the trailing axis raises, the leading one is tried, and then
    `jax.lax.map`, a loop that needs no batching rule; an error of `fn` itself is raised
    by that last one."""
    try:
        return jax.vmap(fn, in_axes=in_axes, out_axes=-1)(*args)
    except Exception:
        pass
    front = [a if ax is None else jnp.moveaxis(a, -1, 0) for a, ax in zip(args, in_axes)]
    axes = [None if ax is None else 0 for ax in in_axes]
    try:
        return jax.vmap(fn, in_axes=axes, out_axes=-1)(*front)
    except Exception:
        pass
    mapped = [k for k, ax in enumerate(in_axes) if ax is not None]

    def column(cols):
        full = list(args)
        for k, c in zip(mapped, cols):
            full[k] = c
        return fn(*full)

    outs = jax.lax.map(column, [front[k] for k in mapped])
    return jax.tree.map(lambda o: jnp.moveaxis(o, 0, -1), outs)


def dense_fallback(ctx: Context, eqn, vals, reason: str | None = None) -> list:
    """The exact fallback for any equation: for each input leaf, the dense Jacobians of the
    linear inputs are pushed through the equation with `jax.vmap` over the leaf's basis
    (`map_columns`), which is exact because the equation is linear in its linear inputs.

    **Arguments:** `ctx`, `eqn` (a `JaxprEqn`) and `vals` (its inputs, each a
    [`Lin`][diffrax_linearize.internal.Lin] or a constant), as a rule receives them, and
    optionally the `reason` recorded in `ctx` (why the equation takes the fallback);
    returns one value per output, as a rule does.
    """
    ctx.record(str(eqn.primitive), reason)
    ctx.nan_faithful = False
    is_lin = linear_outputs(eqn, vals)
    outs: list = [None] * len(eqn.outvars)
    if not all(is_lin):
        zero_in = [zeros_like_lin(x) if isinstance(x, Lin) else x for x in vals]
        const_outs = bind_eqn(eqn, zero_in)
        for k, lin in enumerate(is_lin):
            if not lin:
                outs[k] = const_outs[k]
    leaves = sorted({p for x in vals if isinstance(x, Lin) for p in x.blocks})
    blocks: list[dict[int, Struct]] = [{} for _ in eqn.outvars]
    for p in leaves:
        in_shape = ctx.in_shapes[p]
        n = math.prod(in_shape)
        args, in_axes = [], []
        for x in vals:
            if isinstance(x, Lin) and p in x.blocks:
                dense = to_dense(x.blocks[p]).astype(x.dtype)
                args.append(dense.reshape(x.shape + (n,)))
                in_axes.append(-1)
            elif isinstance(x, Lin):
                args.append(zeros_like_lin(x))
                in_axes.append(None)
            else:
                args.append(x)
                in_axes.append(None)
        columns = map_columns(lambda *a: bind_eqn(eqn, a), args, in_axes)
        for k, v in enumerate(eqn.outvars):
            if is_lin[k]:
                shape = tuple(v.aval.shape)
                blocks[k][p] = Struct.from_dense(
                    columns[k].reshape(shape + tuple(in_shape)), len(shape)
                )
    for k, v in enumerate(eqn.outvars):
        if is_lin[k]:
            outs[k] = Lin(blocks[k], v.aval.shape, v.aval.dtype)
    return outs


# The operands of a product that a linear operand multiplies: a constant there scales the
# linear map (`div`: the denominator).
_FACTORS = {"mul": (0, 1), "div": (1,), "dot_general": (0, 1), "conv_general_dilated": (0, 1)}

# Equations that move, sum or copy their operands without arithmetic on other values: zeros
# in gives zeros out, so a zero constant term passes through them harmless.
_ZERO_PRESERVING = (
    "add",
    "add_any",
    "sub",
    "neg",
    "reduce_sum",
    "broadcast_in_dim",
    "reshape",
    "squeeze",
    "expand_dims",
    "transpose",
    "slice",
    "dynamic_slice",
    "dynamic_update_slice",
    "gather",
    "scatter-add",
    "scatter_add",
    "scatter",
    "concatenate",
    "stack",
    "unstack",
    "split",
    "tile",
    "pad",
    "select_n",
    "convert_element_type",
    "copy",
    "copy_p",
    "cumsum",
    "rev",
    "real",
    "imag",
    "conj",
    "reduce_precision",
)


def _is_zero_literal(v) -> bool:
    return is_literal(v) and not np.any(np.asarray(literal_value(v)))


def _is_finite_literal(v) -> bool:
    return is_literal(v) and bool(np.all(np.isfinite(np.asarray(literal_value(v)))))


def may_add_constants(jaxpr, linear) -> bool:
    """Whether the linear program `jaxpr` (its inputs flagged `linear` are the linear ones)
    may hold a constant term, which its structure leaves out but `jax.jvp` adds to every
    product: a floating value that does not depend on the linear inputs, entering an
    equation that does other than as a factor of a product (a summand of `add`, a case of
    `select_n`, the padding of `pad`), or as a factor known to be zero when the program is
    traced (`0.0`, which the structure makes a zero block and `jax.jvp` multiplies).

    Such terms are what a custom JVP rule gives a zero tangent it instantiates (`xlogy`'s
    `y_dot * x / y`: NaN at `x = y = 0`), and the zeros `pad` or `concatenate` give the rows
    of a constant, which a later product with an infinite partial derivative makes NaN
    whatever the vector. A term that is zero when traced (the zeros `segment_sum` adds
    into, the padding of `jnp.pad`) is harmless until it meets such a product: it is
    followed through the equations that only move or sum values, and counts only where it
    enters any other one with a factor that is not a finite literal. A `scan`'s body is
    walked (`_scan_constant_terms`); conservative elsewhere: any such value entering a
    `while` loop or a branch counts.

    **Arguments:**

    - `jaxpr`: a `Jaxpr`, the linear program.
    - `linear`: one bool per input of `jaxpr`.

    **Returns:** a bool, known when the program is traced.
    """
    return _constant_terms(jaxpr, linear, [False] * len(linear)) is None


def _constant_terms(jaxpr, linear, carrying):
    """`may_add_constants`' walk: `None` where a constant term may be added, else whether
    each output carries a zero constant term (`carrying`: whether each input does)."""
    depends = {v for v, lin in zip(jaxpr.invars, linear) if lin}
    known = set()
    zeros = set()  # known values that are zero: `broadcast_in_dim 0.0` and its kin
    zero_term = {v for v, c in zip(jaxpr.invars, carrying) if c}  # linear, with a zero term
    preserving = tuple(p for p in map(prim, _ZERO_PRESERVING) if p is not None)
    for eqn in jaxpr.eqns:
        is_lin = [not is_literal(v) and v in depends for v in eqn.invars]
        if not any(is_lin):
            if all(is_literal(v) or v in known for v in eqn.invars):
                known.update(eqn.outvars)
                floats = [v for v in eqn.invars if jnp.issubdtype(v.aval.dtype, jnp.inexact)]
                if (
                    eqn.primitive in preserving
                    and floats
                    and all(_is_zero_literal(v) if is_literal(v) else v in zeros for v in floats)
                ):
                    zeros.update(eqn.outvars)
            continue
        constants = [
            i
            for i, (v, lin) in enumerate(zip(eqn.invars, is_lin))
            if not lin and jnp.issubdtype(v.aval.dtype, jnp.inexact)
        ]
        in_carry = [not is_literal(v) and v in zero_term for v in eqn.invars]
        carries = any(in_carry)
        out_carry = [False] * len(eqn.outvars)
        sub = call_jaxpr(eqn, custom_jvp=True)
        if sub is not None:
            found = _constant_terms(sub[0], is_lin, in_carry)
            if found is None:
                return None
            out_carry = found
        elif eqn.primitive is prim("scan"):
            is_zero = [
                _is_zero_literal(v) or (not is_literal(v) and v in zeros) for v in eqn.invars
            ]
            found = _scan_constant_terms(eqn, is_lin, in_carry, is_zero)
            if found is None:
                return None
            out_carry = found
        elif (
            (constants or carries)
            and eqn.primitive not in preserving  # a scatter's `update_jaxpr` is no branch
            and any(True for _ in subjaxprs(eqn))
        ):
            return None
        else:
            factors = next((f for name, f in _FACTORS.items() if eqn.primitive is prim(name)), ())
            adds_zero = False
            for i in constants:
                v = eqn.invars[i]
                zero = _is_zero_literal(v) or (not is_literal(v) and v in zeros)
                if i not in factors and zero and eqn.primitive in preserving:
                    adds_zero = True  # a zero summand, case or padding
                elif i not in factors or (not is_literal(v) and v in zeros):
                    return None
                elif is_literal(v) and not np.all(np.asarray(literal_value(v)) != 0):
                    return None
            if carries and eqn.primitive not in preserving:
                # A zero term meets arithmetic: harmless only as a product with finite
                # literal factors (`2.0 * t`), NaN where a factor is infinite.
                others = [v for v, lin in zip(eqn.invars, is_lin) if not lin]
                if not factors or not all(_is_finite_literal(v) for v in others):
                    return None
            if adds_zero or carries:
                out_carry = _depending_outputs(eqn, is_lin)
        zero_term.update(v for v, c in zip(eqn.outvars, out_carry) if c)
        depends.update(v for v, d in zip(eqn.outvars, _depending_outputs(eqn, is_lin)) if d)
    return [not is_literal(v) and v in zero_term for v in jaxpr.outvars]


def _scan_constant_terms(eqn, is_lin, in_carry, is_zero):
    """`_constant_terms` of a `scan` equation: its body walked with each carry linear (or
    carrying a zero term) where its initial value is or the body makes it so, to a fixed
    point. A carry that the body makes linear from a constant initial value counts where
    that value is not zero (a constant summand) and carries a zero term where it is (the
    tangent of a carry that starts at a constant). (A scan's primal inputs are constants
    of the JVP program: without this, every `scan` would count, and a `lax.scan` over
    cells would pay two more loops.) `is_zero`: whether each input is a known zero."""
    n_consts, n_carry = scan_counts(eqn.params)
    body = eqn.params["jaxpr"]
    body = getattr(body, "jaxpr", body)
    out_lin = _depending_outputs(eqn, is_lin)
    lin = list(is_lin)
    carrying = list(in_carry)
    for k in range(n_carry):
        i = n_consts + k
        if out_lin[k] and not is_lin[i]:
            if not jnp.issubdtype(eqn.invars[i].aval.dtype, jnp.inexact):
                continue
            if not is_zero[i]:
                return None
            lin[i] = carrying[i] = True
    for _ in range(n_carry + 1):
        found = _constant_terms(body, lin, carrying)
        if found is None:
            return None
        grown = False
        for k in range(n_carry):
            if found[k] and not carrying[n_consts + k]:
                carrying[n_consts + k] = grown = True
        if not grown:
            return found
    return None


def jvp_may_add_constants(fn: Callable, args) -> bool:
    """`may_add_constants` of `fn`'s JVP program at `args` (a list of arrays), where the
    zeros that a constant's tangent is made of are still visible as such (`jax.linearize`
    turns them into residuals, opaque under `jax.jit`).

    **Arguments:**

    - `fn`: a function of `len(args)` arrays.
    - `args`: the arrays.

    **Returns:** a bool, known when the program is traced.
    """
    n = len(args)
    jaxpr = jax.make_jaxpr(lambda *a: jax.jvp(fn, a[:n], a[n:])[1])(*args, *args).jaxpr
    return may_add_constants(jaxpr, [False] * n + [True] * n)
