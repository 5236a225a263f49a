"""One descent of the Brownian tree per step: the tree's value at the start of a step,
carried over from the end of the step before.

`diffrax.VirtualBrownianTree.evaluate(t0, t1)` descends the tree twice, to `t0` and to
`t1`, and differences the two values (Chen's relation). On the SDEs of
`benchmarks/adaptive_sde.py` those two descents are 97-99% of the cost of a step. A solver
that steps contiguously has already descended to `t0`, at the end of the step before. So
the SDE solvers here keep that value in their solver state (`BrownianCarry`) and descend
once per step, to `t1`. The increment is formed from the two values exactly as the tree
forms it (`_compat.brownian_tree_increment`). The same values give the same increment,
so the result is that of `evaluate`, bit for bit.

The carried value is used only when it is the tree's value at the start of this step:
the same place on the tree's `[0, 1]` scale and the same tree (key, interval and
tolerance). Otherwise (the first step, a step after a jump of the controller's `jump_ts`,
a solver state from another solve) the step descends to both ends, as `evaluate` does.
Diffrax keeps the old solver state on a rejected step, so a rejected step's retry starts
from the carried value too; so do the two half steps and the full step of
`diffrax.HalfSolver`, each from the state it is given.

The diffusion is recognised in three forms: a `diffrax.ControlTerm` over a
`diffrax.VirtualBrownianTree`, over a `LevyAreaBrownianPath` around one, and either of
these in the `WrapTerm` (direction of time) that `diffrax.diffeqsolve` puts around every
term. Any other diffusion is stepped as before, with no solver state.
"""

import diffrax
import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PyTree

from ._compat import (
    brownian_tree_increment,
    brownian_tree_value,
    has_brownian_tree_internals,
    linear_rescale,
    WrapTerm,
)
from ._levy_area import LevyAreaBrownianPath


class BrownianCarry(eqx.Module):
    """A Brownian tree's value at one time: where (on the tree's `[0, 1]` scale; NaN for
    nowhere yet), which tree (its key, interval and tolerance) and the value itself."""

    r: Array
    tree: PyTree[Array]
    value: PyTree[Array]


class _KnownIncrement(diffrax.AbstractTerm):
    """The user's control term over one step whose Brownian increment is already known:
    `contr` returns it (what the tree's `evaluate` would, for this step), everything else
    is the user's term's."""

    term: diffrax.AbstractTerm
    # The tree's increment over the step, with its Lévy area if the tree has one.
    increment: PyTree[Array]
    # The user's `LevyAreaBrownianPath`, if the tree is inside one: it samples the areas.
    levy_path: LevyAreaBrownianPath | None

    def vf(self, t, y, args):
        return self.term.vf(t, y, args)

    def contr(self, t0, t1, **kwargs):
        use_levy = kwargs.get("use_levy", False)
        if self.levy_path is not None:
            return self.levy_path._with_increment(self.increment.W, t0, t1, use_levy)
        return self.increment if use_levy else self.increment.W

    def prod(self, vf, control):
        return self.term.prod(vf, control)

    def vf_prod(self, t, y, args, control):
        return self.term.vf_prod(t, y, args, control)

    def is_vf_expensive(self, t0, t1, y, args):
        return self.term.is_vf_expensive(t0, t1, y, args)


def _parts(terms):
    """`(direction, control_term, tree, levy_path)` for a `MultiTerm(drift, diffusion)`
    whose diffusion is recognised (module docstring), else `None`. `direction` is `None`
    for an unwrapped term."""
    if not has_brownian_tree_internals or not isinstance(terms, diffrax.MultiTerm):
        return None
    if len(terms.terms) != 2:
        return None
    diffusion = terms.terms[1]
    direction = None
    if isinstance(diffusion, WrapTerm):
        direction, diffusion = diffusion.direction, diffusion.term
    if type(diffusion) is not diffrax.ControlTerm:
        return None
    path, levy_path = diffusion.control, None
    if type(path) is LevyAreaBrownianPath:
        path, levy_path = path.bm, path
    if type(path) is not diffrax.VirtualBrownianTree:
        return None
    return direction, diffusion, path, levy_path


def _key_data(key):
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return key


def _tree_id(tree) -> PyTree[Array]:
    """What, besides the place, the tree's value depends on (its shape and kind of Lévy
    area are static: another would not fit the carried value)."""
    keys = [_key_data(k) for k in jtu.tree_leaves(tree.key)]
    return keys, jnp.asarray(tree.t0), jnp.asarray(tree.t1), jnp.asarray(tree.tol)


def _same_tree(a, b):
    leaves = jtu.tree_leaves(jtu.tree_map(lambda x, y: jnp.all(x == y), a, b))
    return jnp.all(jnp.stack(leaves))


def _ends(direction, t0, t1):
    """The step's two ends in the tree's time, as `WrapTerm.contr` and the tree's
    `evaluate` compute them, and whether the step runs forwards in the tree's time."""
    if direction is None:
        a, b, forward = t0, t1, True
    else:
        a = jnp.where(direction == 1, t0, -t1)
        b = jnp.where(direction == 1, t1, -t0)
        forward = direction == 1
    a = eqxi.nondifferentiable(a, name="t0")
    b = eqxi.nondifferentiable(b, name="t1")
    return a, b, forward


def _select(pred, x, y):
    if pred is True:
        return x
    return jtu.tree_map(lambda u, v: jnp.where(pred, u, v), x, y)


def init_carry(terms, t0) -> BrownianCarry | None:
    """The solver state of a step-by-step solve: nothing carried yet (or `None` for a
    diffusion that is not recognised)."""
    parts = _parts(terms)
    if parts is None:
        return None
    direction, _, tree, _ = parts
    a, _, _ = _ends(direction, t0, t0)
    r = linear_rescale(tree.t0, a, tree.t1)
    value = jax.eval_shape(lambda: brownian_tree_value(tree, r))
    value = jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), value)
    return BrownianCarry(jnp.full_like(r, jnp.nan), _tree_id(tree), value)


def carried_terms(terms, t0, t1, carry: BrownianCarry | None):
    """`terms` whose diffusion knows its increment over `[t0, t1]`, found with one
    descent of the tree where `carry` holds its value at the start, and the carry for
    the next step (the value at `t1`). Unchanged terms and `carry` for a diffusion that
    is not recognised."""
    parts = _parts(terms)
    if parts is None or carry is None:
        return terms, carry
    direction, control_term, tree, levy_path = parts
    a, b, forward = _ends(direction, t0, t1)
    ra = linear_rescale(tree.t0, a, tree.t1)
    rb = linear_rescale(tree.t0, b, tree.t1)
    r_start = _select(forward, ra, rb)
    r_end = _select(forward, rb, ra)
    tree_id = _tree_id(tree)
    known = (carry.r == r_start) & _same_tree(carry.tree, tree_id)

    # One descent (to the end) when the start is known, else two: a loop, so that under
    # `jax.vmap` the batch descends twice only when some path needs it.
    def body(state):
        i, at_start, at_end = state
        value = brownian_tree_value(tree, jnp.where(i == 0, r_start, r_end))
        return i + 1, _select(i == 0, value, at_start), _select(i == 1, value, at_end)

    first = jnp.where(known, 1, 0)
    _, at_start, at_end = lax.while_loop(
        lambda state: state[0] < 2, body, (first, carry.value, carry.value)
    )
    levy_0 = _select(forward, at_start, at_end)
    levy_1 = _select(forward, at_end, at_start)
    increment = brownian_tree_increment(tree, levy_0, levy_1)
    diffusion = _KnownIncrement(control_term, increment, levy_path)
    if direction is not None:
        diffusion = WrapTerm(diffusion, direction)
    terms = diffrax.MultiTerm(terms.terms[0], diffusion)
    return terms, BrownianCarry(r_end, tree_id, at_end)
