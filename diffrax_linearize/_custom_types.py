"""Type aliases shared between modules."""

from typing import Literal, TypeAlias

from jaxtyping import ArrayLike, Real


# How `materialise` computes a Jacobian. Spelt out rather than as lineax's
# `jac="fwd" | "bwd"`, since `"auto"` (no lineax counterpart) is the default.
MaterialiseMode: TypeAlias = Literal["auto", "forward", "reverse"]


# A real scalar: a Python number or a 0-d array (Diffrax's own alias is private).
RealScalarLike: TypeAlias = Real[ArrayLike, ""]
