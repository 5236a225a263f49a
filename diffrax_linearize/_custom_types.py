"""Type aliases and dtype helpers shared between modules."""

import functools
from collections.abc import Iterable
from typing import Any, Literal, TypeAlias

import jax
import jax.numpy as jnp
from jaxtyping import ArrayLike, Real


# How `materialise` computes a Jacobian. Spelt out rather than as lineax's
# `jac="fwd" | "bwd"`, since `"auto"` (no lineax counterpart) is the default.
MaterialiseMode: TypeAlias = Literal["auto", "forward", "reverse"]


# A real scalar: a Python number or a 0-d array (Diffrax's own alias is private).
RealScalarLike: TypeAlias = Real[ArrayLike, ""]


def common_dtype(*xs: Any) -> Any:
    """`jnp.result_type(*xs)` under JAX's standard promotion rules, whatever the rules in
    force: the one dtype the library's own arrays take for inputs of several dtypes (the
    basis of a Jacobian of float32 and float64 leaves, the norms of a model's float32 and
    bfloat16 parameters), which has no value under `jax_numpy_dtype_promotion="strict"`.
    Each leaf's own numbers keep their dtype."""
    with jax.numpy_dtype_promotion("standard"):
        return jnp.result_type(*xs)


def mixed_dtypes(xs: Any) -> str | None:
    """The names of the dtypes among the arrays `xs`, comma-separated, if there is more
    than one; else `None`. (A lineax operator takes one input dtype.)"""
    names = sorted({str(jnp.result_type(x)) for x in xs})
    return ", ".join(names) if len(names) > 1 else None


def all_finite(xs: Iterable[Any]) -> Any:
    """Whether every entry of the arrays `xs` is finite, as one boolean scalar (true for
    none)."""
    return functools.reduce(
        jnp.logical_and, [jnp.all(jnp.isfinite(x)) for x in xs], jnp.bool_(True)
    )
