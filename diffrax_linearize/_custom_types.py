"""Type aliases shared between modules."""

from typing import Literal, TypeAlias


# How `materialise` computes a Jacobian. Spelt out rather than as lineax's
# `jac="fwd" | "bwd"`, since `"auto"` (no lineax counterpart) is the default.
MaterialiseMode: TypeAlias = Literal["auto", "forward", "reverse"]
