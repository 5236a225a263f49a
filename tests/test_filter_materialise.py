"""`filter_materialise` against `equinox.filter_jacfwd`, on whole Equinox modules.

(A file of its own rather than a section of `test_materialise.py`, which covers
`materialise` itself.)"""

import diffrax_linearize as dl
import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import assert_tree_allclose


jax.config.update("jax_enable_x64", True)


class _Scaled(eqx.Module):
    """Floating, integer and Python fields, and a static one."""

    weight: jax.Array
    bias: jax.Array
    index: jax.Array  # integer array: held fixed
    power: int  # Python int leaf: held fixed
    name: str = eqx.field(static=True)

    def __call__(self, x):
        return {"y": jnp.tanh(self.weight @ x + self.bias) ** self.power, "z": x[self.index]}


def _mlp(key, **kwargs):
    return eqx.nn.MLP(4, 3, 8, 2, key=key, dtype=jnp.float64, **kwargs)


@pytest.mark.parametrize("mode", ["forward", "reverse", "auto"])
def test_mlp_matches_filter_jacfwd(mode):
    k = jax.random.split(jax.random.key(0), 2)
    mlp = _mlp(k[0])
    x = jax.random.normal(k[1], (4,), jnp.float64)
    fn = lambda m, x: m(x)
    got = dl.filter_materialise(fn, mlp, x, mode=mode)
    expected = eqx.filter_jacfwd(fn)(mlp, x)
    assert_tree_allclose(got, expected, rtol=1e-12, atol=1e-14)
    assert got.activation is None and got.layers[1].weight.shape == (3, 8, 8)


def test_integer_and_static_fields_are_held_fixed():
    k = jax.random.split(jax.random.key(1), 3)
    module = _Scaled(
        jax.random.normal(k[0], (3, 4), jnp.float64),
        jax.random.normal(k[1], (3,), jnp.float64),
        jnp.array([2, 0]),
        3,
        "scaled",
    )
    x = jax.random.normal(k[2], (4,), jnp.float64)
    fn = lambda m, x, c: jax.tree.map(lambda o: c * o, m(x))
    got = dl.filter_materialise(fn, module, x, 2.0)
    expected = eqx.filter_jacfwd(fn)(module, x, 2.0)
    assert_tree_allclose(got, expected, rtol=1e-12, atol=1e-14)
    for out in ("y", "z"):
        assert got[out].index is None and got[out].power is None
        assert got[out].name == "scaled"
    assert got["y"].weight.shape == (3, 3, 4)
    # `z` does not depend on the floating fields.
    assert not got["z"].weight.any() and not got["z"].bias.any()


def test_errors_name_filter_materialise():
    fn = lambda m: m * 2.0
    with pytest.raises(TypeError, match=r"`diffrax_linearize.filter_materialise`.*no floating"):
        dl.filter_materialise(fn, jnp.arange(3))
    with pytest.raises(TypeError, match=r"filter_materialise.*holomorphic=True"):
        dl.filter_materialise(fn, jnp.ones(2, jnp.complex128))
    with pytest.raises(TypeError, match=r"filter_materialise.*callable"):
        dl.filter_materialise(jnp.ones(2), jnp.ones(2))
