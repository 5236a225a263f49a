"""`jacobian_diagonal` against `jnp.diagonal(jax.jacfwd(f)(x))` on the engine's vector
field corpus, on pytrees, under `jit` and `vmap`; and its storage at scale."""

import math

import diffrax_linearize as dl
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from diffrax_linearize._compat import subjaxprs
from helpers import jacfwd_compiled
from jax.flatten_util import ravel_pytree
from test_sparsity import _input, FIELDS, laplacian_pad


def _reference(fn, x):
    """The obviously-correct slow path: the dense Jacobian of the flattened function."""
    flat, unravel = ravel_pytree(x)
    jac = jacfwd_compiled(lambda v: ravel_pytree(fn(unravel(v)))[0], flat)
    return unravel(jnp.diagonal(jac))


def _check(fn, x, rtol=1e-11):
    got = jax.jit(lambda x: dl.jacobian_diagonal(fn, x))(x)
    want = _reference(fn, x)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("name", list(FIELDS))
def test_fields(name):
    fn, n = FIELDS[name]
    _check(fn, _input(n, jnp.float64))


_A = jnp.asarray(np.random.RandomState(0).randn(6, 6))

EXTRA = {
    "elementwise": (lambda y: jnp.sin(y) * y, (6,)),
    "dense": (lambda y: _A @ jnp.tanh(_A @ y), (6,)),
    "block_diagonal_einsum": (
        lambda y: jnp.einsum("nij,nj->ni", jnp.stack([_A[:3, :3]] * 4), y**2),
        (4, 3),
    ),
    "transpose": (lambda y: jnp.sin(y.T) * 2, (4, 4)),
    "reshaped_output": (lambda y: jnp.cos(y).reshape(3, 4), (12,)),
    "constant": (lambda y: jnp.ones_like(y), (5,)),
}


@pytest.mark.parametrize("name", list(EXTRA))
def test_extra(name):
    fn, shape = EXTRA[name]
    _check(fn, _input(math.prod(shape), jnp.float64).reshape(shape))


def test_pytree():
    def fn(p):
        a, b = p["a"], p["b"]
        return {"a": jnp.sin(a) * jnp.sum(b), "b": b**2 + a[:2, None]}

    _check(fn, {"a": _input(3, jnp.float64), "b": _input(4, jnp.float64, 1).reshape(2, 2)})


def test_pytree_of_other_shapes():
    # Output leaves of shapes (3,), (2,) for input leaves (2,), (3,): the diagonal crosses
    # blocks.
    def fn(p):
        a, b = p
        return jnp.concatenate([jnp.sin(a), b[:1]]) * b[2], b[1:] ** 3

    _check(fn, (_input(2, jnp.float64), _input(3, jnp.float64, 1)))


def test_vmap_and_float32():
    fn = FIELDS["brusselator_1d"][0]
    xs = jnp.stack([_input(24, jnp.float32, seed) for seed in range(3)])
    got = jax.jit(jax.vmap(lambda x: dl.jacobian_diagonal(fn, x)))(xs)
    want = jax.jit(jax.vmap(lambda x: jnp.diagonal(jax.jacfwd(fn)(x))))(xs)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_errors():
    with pytest.raises(ValueError, match="jacobian_diagonal.*as many elements"):
        dl.jacobian_diagonal(lambda y: y[:2], jnp.ones(3))


def _largest_intermediate(fn, x) -> int:
    """The number of elements of the largest value in the traced program of `fn(x)`."""

    def sizes(jaxpr):
        for eqn in jaxpr.eqns:
            for v in eqn.outvars:
                yield math.prod(v.aval.shape)
        for sub in subjaxprs(jaxpr):
            yield from sizes(sub)

    closed = jax.make_jaxpr(fn)(x)
    consts = [math.prod(jnp.shape(c)) for c in closed.consts]
    return max([*sizes(closed.jaxpr), *consts, 0])


def test_storage_is_linear_for_a_tridiagonal_field():
    # The measurement can fail: the dense reference forms an (n, n) Jacobian.
    x = jax.ShapeDtypeStruct((300,), jnp.float64)
    assert _largest_intermediate(lambda x: jnp.diagonal(jax.jacfwd(laplacian_pad)(x)), x) >= 300**2
    n = 10_000
    x = jax.ShapeDtypeStruct((n,), jnp.float64)
    largest = _largest_intermediate(lambda x: dl.jacobian_diagonal(laplacian_pad, x), x)
    assert largest <= 8 * n, largest
    for name, m in [("robertson_stack", 3000), ("brusselator_2d", 2 * 40 * 40)]:
        x = jax.ShapeDtypeStruct((m,), jnp.float64)
        largest = _largest_intermediate(lambda x: dl.jacobian_diagonal(FIELDS[name][0], x), x)
        assert largest <= 16 * m, (name, largest)  # entries per row, not m
