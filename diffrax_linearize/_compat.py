"""Every use of JAX (and Diffrax) internals in this package, in one place.

JAX's internals differ between the versions we support (0.10, 0.11, 0.12): a JAX upgrade
should be a change to this file alone. Public `jax.extend` names are preferred where
they exist.
"""

import diffrax
import diffrax._adjoint as _diffrax_adjoint
import diffrax._brownian.tree as _diffrax_tree
import diffrax._misc as _diffrax_misc
import jax
import jax.extend.core as jex_core
from diffrax._heuristics import is_sde as is_sde, is_unsafe_sde as is_unsafe_sde
from diffrax._integrate import _clip_to_end
from diffrax._misc import static_select as static_select
from diffrax._root_finder import use_stepsize_tol as use_stepsize_tol
from diffrax._saveat import save_y as save_y
from diffrax._solution import is_okay as is_okay, is_successful as is_successful
from diffrax._solver.srk import AbstractSRK as AbstractSRK, AdditiveCoeffs as AdditiveCoeffs
from diffrax._step_size_controller.pid import _select_initial_step
from diffrax._term import WrapTerm as WrapTerm
from equinox.internal import prevbefore as prevbefore
from jax.extend.core import primitives as _prims
from jax.interpreters import ad as ad, batching as batching, mlir as mlir
from optimistix.internal import implicit_jvp as implicit_jvp


# Diffrax 0.7.2's own custom-VJP helpers, reused by the backsolve adjoint so that its
# forward pass and checks are exactly Diffrax's.
nondiff_solver_controller_state = _diffrax_adjoint._nondiff_solver_controller_state
only_transpose_ys = _diffrax_adjoint._only_transpose_ys
# Diffrax 0.7.2's initial step (Hairer, Norsett & Wanner I, section II.4), so that
# `PredictiveController` starts where `diffrax.PIDController` does.
select_initial_step = _select_initial_step
# Diffrax 0.7.2's rounding of a step's end to `t1`, reused by the refilling ensemble loop
# (`_refill.py`) so that its steps are exactly `diffeqsolve`'s.
clip_to_end = _clip_to_end
# `VirtualBrownianTree`'s two halves of `evaluate(t0, t1)`: its value at one time (one
# descent of the tree) and the increment between two values (Chen's relation, then back
# to the tree's time scale). The SDE solvers carry the value at the end of a step to the
# next (`_brownian_carry.py`), and form the increment exactly as `evaluate` does. Without
# these internals they descend twice per step, through `evaluate`.
try:
    linear_rescale = _diffrax_misc.linear_rescale
    _levy_diff = _diffrax_tree._levy_diff
    _levy_tree_transpose = _diffrax_tree.levy_tree_transpose
    has_brownian_tree_internals = all(
        hasattr(diffrax.VirtualBrownianTree, name) for name in ("_evaluate", "_denormalise_bm_inc")
    )
except AttributeError:
    linear_rescale = None
    has_brownian_tree_internals = False


def brownian_tree_value(tree, r):
    """The tree's value (its `_LevyVal`s) at `r` on its `[0, 1]` scale: one descent."""
    return tree._evaluate(r)


def brownian_tree_increment(tree, levy_0, levy_1):
    """The increment between the tree's values `levy_0` and `levy_1`, with its Lévy area
    if the tree has one: `tree.evaluate(t0, t1, use_levy=True)` from its two halves."""
    out = jax.tree_util.tree_map(_levy_diff, tree.shape, levy_0, levy_1)
    out = _levy_tree_transpose(tree.shape, out)
    return tree._denormalise_bm_inc(out)


# `WrapTerm` (above): how `diffrax.diffeqsolve` wraps every term with the direction of
# time; the shared-step ensemble solver (`_shared_step.py`) wraps each path's terms alike.
# `implicit_jvp` (above): optimistix's implicit-function-theorem JVP, the piece behind
# Diffrax's implicit solvers' `ImplicitAdjoint`, reused for `BDF`'s corrector
# (`_solver/corrector.py`).


Jaxpr = jex_core.Jaxpr
ClosedJaxpr = jex_core.ClosedJaxpr
JaxprEqn = jex_core.JaxprEqn
Literal = jex_core.Literal
Var = jex_core.Var
Primitive = jex_core.Primitive
jaxpr_as_fun = jex_core.jaxpr_as_fun
subjaxprs = jex_core.subjaxprs


# Names that differ between JAX versions: ours -> the alternatives, newest first.
_ALIASES = {"jit": ("jit", "pjit"), "add_jaxvals": ("add_jaxvals", "add_any")}


def _internal_prims():
    """Primitives that `jax.extend.core.primitives` does not export in every version."""
    found = {}
    try:
        from jax._src.lax import lax as _lax_internal

        for name in ("split", "tile", "stack", "unstack"):
            p = getattr(_lax_internal, f"{name}_p", None)
            if p is not None:
                found[name] = p
    except ImportError:  # pragma: no cover
        pass
    try:
        from jax._src.custom_batching import custom_vmap_p

        found["custom_vmap_call"] = custom_vmap_p
    except ImportError:  # pragma: no cover
        pass
    try:
        from lineax._solve import linear_solve_p as _lineax_solve_p

        found["lineax_linear_solve"] = _lineax_solve_p
    except ImportError:  # pragma: no cover
        pass
    return found


_INTERNAL = _internal_prims()


def prim(name: str) -> Primitive | None:
    """The primitive `name_p` from `jax.extend.core.primitives` (or, for the few it does not
    export, from JAX's or lineax's internals), or `None` where this version does not have
    it (its equations then take the exact dense fallback)."""
    for alias in _ALIASES.get(name, (name,)):
        p = getattr(_prims, f"{alias}_p", None)
        if p is not None:
            return p
    return _INTERNAL.get(name)


def bind_eqn(eqn: JaxprEqn, invals):
    """Apply an equation's primitive to `invals`, as `jax.core.eval_jaxpr` does. Always
    returns a list of outputs."""
    # jax <= 0.4 returned `(subfuns, params)`; jax >= 0.5 returns `params` alone.
    res = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(res, tuple) and len(res) == 2 and isinstance(res[1], dict):
        subfuns, bind_params = res
    else:
        subfuns, bind_params = (), res
    ctx = getattr(eqn, "ctx", None)
    if ctx is not None and hasattr(ctx, "manager"):
        with ctx.manager:
            out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    else:
        out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def used_inputs(jaxpr: Jaxpr, used_outputs) -> list[bool]:
    """Which inputs of `jaxpr` the outputs selected by `used_outputs` depend on."""
    from jax._src.interpreters import partial_eval as pe

    _, used = pe.dce_jaxpr(jaxpr, list(used_outputs))
    return used


def _new_var(aval) -> Var:
    try:
        return Var(aval)  # jax >= 0.5
    except TypeError:  # pragma: no cover - older jax: Var(suffix, aval)
        return Var("", aval)


def dce_jaxpr(jaxpr: Jaxpr) -> Jaxpr:
    """`jaxpr` with the equations that no output depends on removed (all inputs kept)."""
    from jax._src.interpreters import partial_eval as pe

    out, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    return out


def eqn_as_jaxpr(eqn: JaxprEqn) -> Jaxpr:
    """A jaxpr holding the single equation `eqn` (literal inputs made into variables)."""
    # Fresh variables throughout: a variable may appear twice among the inputs.
    invars = [_new_var(v.aval) for v in eqn.invars]
    outvars = [_new_var(v.aval) for v in eqn.outvars]
    new_eqn = eqn.replace(invars=invars, outvars=outvars)
    debug_info = jex_core.DebugInfo(
        "diffrax_linearize",
        str(eqn.primitive),
        tuple(f"in{i}" for i in range(len(invars))),
        tuple(f"out{i}" for i in range(len(outvars))),
    )
    return Jaxpr(
        constvars=(),
        invars=invars,
        outvars=outvars,
        eqns=[new_eqn],
        effects=eqn.effects,
        debug_info=debug_info,
    )


def new_jaxpr(invars, eqns, outvars) -> Jaxpr:
    """A jaxpr of existing equations `eqns` (in order), with inputs `invars` and outputs
    `outvars` (variables of those equations)."""
    effects = frozenset().union(*(e.effects for e in eqns)) if eqns else frozenset()
    debug_info = jex_core.DebugInfo(
        "diffrax_linearize",
        "sub-program",
        tuple(f"in{i}" for i in range(len(invars))),
        tuple(f"out{i}" for i in range(len(outvars))),
    )
    return Jaxpr(
        constvars=(),
        invars=list(invars),
        outvars=list(outvars),
        eqns=list(eqns),
        effects=effects,
        debug_info=debug_info,
    )


def literal_value(x):
    return x.val


def is_literal(x) -> bool:
    return isinstance(x, Literal)


try:
    _Tracer = jax.core.Tracer
except AttributeError:  # pragma: no cover - where `jax.core` no longer exports it
    from jax._src.core import Tracer as _Tracer


def is_tracer(x) -> bool:
    return isinstance(x, _Tracer)


def made_by_transpose(x) -> bool:
    """Whether the traced `x` is, up to reshapes, the output of a `transpose` equation of
    the program being traced. `False` for anything else, and wherever this JAX's tracers
    do not record the equation that made them (`DynamicJaxprTracer.parent`, jax 0.10): the
    answer only chooses between two equivalent ways of moving data."""
    while True:
        eqn = getattr(x, "parent", None) if is_tracer(x) else None
        name = getattr(getattr(eqn, "primitive", None), "name", None)
        if name == "transpose":
            return True
        if name not in ("reshape", "squeeze", "expand_dims"):
            return False
        x = eqn.in_tracers[0]


def scan_counts(params) -> tuple[int, int]:
    """`(num_consts, num_carry)` of a `scan` equation: parameters of their own up to jax
    0.11, the lengths of the first two groups of its `ft_in` flat tree from jax 0.12."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(list(consts)), len(list(carry))
