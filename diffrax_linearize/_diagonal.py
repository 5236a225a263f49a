"""The diagonal of a Jacobian: a recursion on the structure engine that needs no
per-primitive rules of its own. The engine's Jacobian recursion gives structured blocks;
the diagonal is read off each one in O(stored numbers) (`_sparsity.diagonal`)."""

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from ._custom_types import common_dtype
from ._materialise import structured_blocks, traced_as_jit
from ._sparsity import diagonal, to_dense


def jacobian_diagonal(fn: Callable[[PyTree], PyTree], x: PyTree) -> PyTree:
    """The exact diagonal of the Jacobian of `fn` at `x`, without forming the Jacobian
    where it has structure.

    Equal to `jnp.diagonal(jax.jacfwd(f)(x_flat))` for `f` the function `fn` on the
    flattened `x` (and flattened output), reshaped like `x`. The structure engine's blocks
    give the diagonal in O(n) for diagonal, block-diagonal, banded and other sparse
    (stencil) Jacobians; only a Jacobian that is dense is formed densely, as
    `jax.jacfwd` forms it. Works under `jax.jit` and `jax.vmap`.

    **Arguments:**

    - `fn`: a function of one pytree of floating arrays, returning a pytree of arrays with
        as many elements in all as `x` (usually the same structure: a vector field).
    - `x`: the point, a pytree of floating arrays.

    **Returns:**

    A pytree like `x`: entry `i` of the flattened result is $\\partial f_i / \\partial x_i$.
    """
    api = "diffrax_linearize.jacobian_diagonal"
    with traced_as_jit(api):
        out_shape = jax.eval_shape(fn, x)
    in_leaves, in_tree = jtu.tree_flatten(x)
    out_leaves = jtu.tree_leaves(out_shape)
    n_in = sum(math.prod(jnp.shape(a)) for a in in_leaves)
    n_out = sum(math.prod(a.shape) for a in out_leaves)
    if n_in != n_out:
        raise ValueError(
            f"`{api}`: `fn` must return as many elements as `x` holds (a square Jacobian), "
            f"got {n_out} for {n_in}."
        )
    blocks, _, _ = structured_blocks(fn, x)
    in_shapes = [tuple(jnp.shape(a)) for a in in_leaves]
    dtype = common_dtype(*out_leaves) if out_leaves else common_dtype(*in_leaves)
    if [a.shape for a in out_leaves] == in_shapes:  # leaf by leaf: the diagonal blocks
        diags = [
            jnp.zeros(s, dtype) if blocks[p][p] is None else diagonal(blocks[p][p])
            for p, s in enumerate(in_shapes)
        ]
    else:  # leaves of other shapes: the diagonal crosses blocks, read densely
        flat = jnp.zeros((n_in,), dtype)
        out_start = 0
        for q, aval in enumerate(out_leaves):
            nq, in_start = math.prod(aval.shape), 0
            for p, s in enumerate(in_shapes):
                np_, b = math.prod(s), blocks[q][p]
                lo, hi = max(out_start, in_start), min(out_start + nq, in_start + np_)
                if b is not None and lo < hi:
                    i = jnp.arange(lo, hi)
                    dense = to_dense(b).reshape(nq, np_)
                    flat = flat.at[i].set(dense[i - out_start, i - in_start].astype(dtype))
                in_start += np_
            out_start += nq
        offsets = [0]
        for s in in_shapes:
            offsets.append(offsets[-1] + math.prod(s))
        diags = [flat[a:b].reshape(s) for a, b, s in zip(offsets, offsets[1:], in_shapes)]
    return jtu.tree_unflatten(in_tree, [d.astype(dtype) for d in diags])
