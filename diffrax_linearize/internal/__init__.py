"""Extension hooks for advanced users: register a structure rule for a primitive of your own.

A rule is `rule(ctx, eqn, invals) -> outvals`: `invals` holds, per input of the equation,
either a [`Lin`][diffrax_linearize.internal.Lin] (the structured Jacobian of a value that
depends on the differentiated inputs: one [`Struct`][diffrax_linearize.internal.Struct]
block per input leaf) or a constant array; it returns one value per output. Return
`NotImplemented` to hand an equation to the exact dense fallback.
"""

from .._interpreter import (
    Context as Context,
    dense_fallback as dense_fallback,
    interpret as interpret,
    Lin as Lin,
    lookup_rule as lookup_rule,
    register_rule as register_rule,
    registered_primitives as registered_primitives,
)
from .._materialise import structured_blocks as structured_blocks
from .._squared_grads import (
    register_structural_rule as register_structural_rule,
    register_use_rule as register_use_rule,
)
from .._structure import add as add, contract as contract, Struct as Struct
