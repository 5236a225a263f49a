"""Extension hooks for advanced users: a structure rule for a primitive of your own, or a
recursion of your own on the structure engine.

The engine walks a jaxpr in one place, [`eval_jaxpr`][diffrax_linearize.internal.eval_jaxpr]:
it reads and writes the environment, recurses into calls (`jit`, `closed_call`, `remat`)
when asked, and hands each equation to a function you give. A recursion is that function
plus a rule registry: a plain dict per recursion name, filled with
[`register_rule`][diffrax_linearize.internal.register_rule]`(*prims, recursion=name)` and
read with [`lookup_rule`][diffrax_linearize.internal.lookup_rule].

The structure engine's own recursion (`"jacobian"`) propagates structured Jacobian blocks:
a rule is `rule(ctx, eqn, invals) -> outvals`, where `invals` holds, per input of the
equation, either a [`Lin`][diffrax_linearize.internal.Lin] (the structured Jacobian of a
value that depends on the differentiated inputs: one
[`Struct`][diffrax_linearize.internal.Struct] block per input leaf) or a constant array; it
returns one value per output. Return `NotImplemented` to hand an equation to the exact
dense fallback. [`interpret`][diffrax_linearize.internal.interpret] runs it; the squared
gradients and [`diffrax_linearize.jacobian_diagonal`][] are built on its blocks. See the
developer page on the structure engine for how to write a recursion.
"""

from .._interpreter import (
    call_jaxpr as call_jaxpr,
    Context as Context,
    dense_fallback as dense_fallback,
    eval_jaxpr as eval_jaxpr,
    interpret as interpret,
    iter_eqns as iter_eqns,
    Lin as Lin,
    lookup_rule as lookup_rule,
    register_rule as register_rule,
    registered_primitives as registered_primitives,
    rule_registry as rule_registry,
)
from .._materialise import structured_blocks as structured_blocks
from .._sparsity import (
    add as add,
    diagonal as diagonal,
    to_dense as to_dense,
    transpose as transpose,
)
from .._structure import contract as contract, Struct as Struct
