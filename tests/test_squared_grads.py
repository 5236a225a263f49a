"""`sum_squared_grads`, `per_example_grad_norms` and
`value_grad_and_sum_squared_grads` against per-example `vmap(grad)`."""

import diffrax_linearize as dl
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from diffrax_linearize import _squared_grads
from diffrax_linearize._compat import subjaxprs


jax.config.update("jax_enable_x64", True)

B = 7


def _keys(n, seed=0):
    return list(jax.random.split(jax.random.key(seed), n))


def _normal(key, shape):
    return jax.random.normal(key, shape, dtype=jnp.float64)


def _reference(loss_fn, params, *batch):
    """Per-example gradients by `vmap(filter_grad)`: the obviously-correct slow path."""
    in_axes = (None,) + (0,) * len(batch)
    grads = jax.vmap(eqx.filter_grad(loss_fn), in_axes=in_axes)(params, *batch)
    sq = jtu.tree_map(lambda g: jnp.sum(g**2, axis=0), grads)
    flat = [g.reshape(g.shape[0], -1) for g in jtu.tree_leaves(grads)]
    norms = jnp.sqrt(sum(jnp.sum(g**2, axis=1) for g in flat))
    total_grad = jtu.tree_map(lambda g: jnp.sum(g, axis=0), grads)
    losses = jax.vmap(loss_fn, in_axes=in_axes)(params, *batch)
    return jnp.sum(losses), total_grad, sq, norms


def _assert_tree_close(actual, expected, rtol=1e-10):
    a_leaves, a_def = jtu.tree_flatten(actual, is_leaf=lambda x: x is None)
    e_leaves, e_def = jtu.tree_flatten(expected, is_leaf=lambda x: x is None)
    assert a_def == e_def
    for a, e in zip(a_leaves, e_leaves):
        if e is None:
            assert a is None
            continue
        assert a.shape == e.shape and a.dtype == e.dtype
        scale = float(jnp.max(jnp.abs(e))) if e.size else 1.0
        np.testing.assert_allclose(a, e, rtol=rtol, atol=1e-12 * max(scale, 1e-30))


# Small programs: optimising the compiled code costs more than running it.
_FAST_COMPILE = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}


def _flat_args(params_batch):
    params, batch = params_batch
    return (params, *batch)


def _check(loss_fn, params, *batch, chunk_size=None, jit=True):
    """All three functions against the reference, compiled together (one compile per
    model keeps the test file fast)."""
    kw = dict(chunk_size=chunk_size)

    def run(p, *b):
        return (
            _reference(loss_fn, p, *b),
            dl.sum_squared_grads(loss_fn, p, *b, **kw),
            dl.per_example_grad_norms(loss_fn, p, *b, **kw),
            dl.value_grad_and_sum_squared_grads(loss_fn, p, *b, **kw),
        )

    if jit:
        dynamic, static = eqx.partition((params, batch), eqx.is_array)
        jitted = jax.jit(
            lambda d: run(*_flat_args(eqx.combine(d, static))),
            compiler_options=_FAST_COMPILE,
        )
        out = jitted(dynamic)
    else:
        out = run(params, *batch)
    (ref_loss, ref_grad, ref_sq, ref_norms), sq, norms, (loss, grad, sq2) = out
    # The reference must be non-trivial, or the comparison could not fail.
    assert any(float(jnp.max(s)) > 0 for s in jtu.tree_leaves(ref_sq))
    _assert_tree_close(sq, ref_sq)
    assert norms.shape == (batch[0].shape[0],)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-10)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-12)
    _assert_tree_close(grad, ref_grad)
    _assert_tree_close(sq2, ref_sq)


#
# Models
#


def _mlp_case():
    k = _keys(8)
    params = {
        "layers": [
            (_normal(k[0], (5, 6)), _normal(k[1], (6,))),
            (_normal(k[2], (6, 6)), _normal(k[3], (6,))),
            (_normal(k[4], (6, 3)), _normal(k[5], (3,))),
        ]
    }
    acts = [jnp.tanh, jax.nn.relu, jax.nn.gelu]

    def loss(p, x, y):
        for (w, b), act in zip(p["layers"], acts):
            x = act(x @ w + b)
        return jnp.sum((x - y) ** 2)

    return loss, params, _normal(k[6], (B, 5)), _normal(k[7], (B, 3))


def _classifier_case():
    k = _keys(5, seed=1)
    params = {
        "w1": _normal(k[0], (4, 8)),
        "w2": _normal(k[1], (8, 3)),
        "s": _normal(k[2], (8,)),
    }

    def loss(p, x, label):
        h = jax.nn.softplus(x @ p["w1"]) * p["s"]  # an elementwise scale
        logits = jax.nn.sigmoid(h) @ p["w2"]
        return -jax.nn.log_softmax(logits)[label]

    labels = jax.random.randint(k[4], (B,), 0, 3)
    return loss, params, _normal(k[3], (B, 4)), labels


def _equinox_case():
    k = _keys(4, seed=2)
    model = eqx.nn.MLP(4, 2, width_size=6, depth=2, activation=jax.nn.silu, key=k[0])
    model = jtu.tree_map(lambda x: x.astype(jnp.float64) if eqx.is_inexact_array(x) else x, model)
    head = eqx.nn.Linear(2, 1, use_bias=True, key=k[1], dtype=jnp.float64)

    def loss(params, x, y):
        mlp, lin = params
        return jnp.sum((lin(jnp.tanh(mlp(x))) - y) ** 2)

    return loss, (model, head), _normal(k[2], (B, 4)), _normal(k[3], (B, 1))


def _flax_case():
    nn = pytest.importorskip("flax.linen")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(6, param_dtype=jnp.float64, dtype=jnp.float64)(x)
            x = nn.LayerNorm(param_dtype=jnp.float64, dtype=jnp.float64)(x)
            x = nn.relu(x)
            return nn.Dense(2, param_dtype=jnp.float64, dtype=jnp.float64)(x)

    k = _keys(3, seed=3)
    model = Model()
    x = _normal(k[1], (B, 4))
    params = model.init(k[0], x[0])

    def loss(p, x, y):
        return jnp.sum((model.apply(p, x) - y) ** 2)

    return loss, params, x, _normal(k[2], (B, 2))


def _reused_layer_case():
    k = _keys(4, seed=4)
    params = {"w": _normal(k[0], (5, 5)) / 2, "b": _normal(k[1], (5,))}

    def loss(p, x, y):
        layer = lambda h: jnp.tanh(h @ p["w"] + p["b"])
        return jnp.sum((layer(layer(x)) - y) ** 2)

    return loss, params, _normal(k[2], (B, 5)), _normal(k[3], (B, 5))


def _attention_case(t, c):
    """A transformer block on `t` positions of width `c`: weights shared over
    positions, two heads through an einsum with a batch dimension."""
    k = _keys(10, seed=5)
    heads, d = 2, c // 2
    params = {
        "wqkv": _normal(k[0], (3, heads, c, d)) / c**0.5,
        "wo": _normal(k[1], (heads, d, c)) / c**0.5,
        "bo": _normal(k[2], (c,)),
        "ln": _normal(k[3], (c,)),
        "w1": _normal(k[4], (c, 2 * c)) / c**0.5,
        "w2": _normal(k[5], (2 * c, c)) / c**0.5,
    }

    def loss(p, x, y):
        q, kk, v = (jnp.einsum("tc,hcd->htd", x, p["wqkv"][i]) for i in range(3))
        scores = jnp.einsum("htd,hsd->hts", q, kk) / d**0.5
        att = jnp.einsum("hts,hsd->htd", jax.nn.softmax(scores, axis=-1), v)
        h = x + jnp.einsum("htd,hdc->tc", att, p["wo"]) + p["bo"]
        h = h * p["ln"] / jnp.sqrt(jnp.mean(h**2, axis=-1, keepdims=True) + 1e-3)
        h = h + jax.nn.gelu(h @ p["w1"]) @ p["w2"]
        return jnp.mean((h - y) ** 2)

    return loss, params, _normal(k[6], (B, t, c)), _normal(k[7], (B, t, c))


def _unrolled_rnn_case():
    k = _keys(5, seed=6)
    params = {
        "wx": _normal(k[0], (3, 4)),
        "wh": _normal(k[1], (4, 4)) / 2,
        "b": _normal(k[2], (4,)),
    }

    def loss(p, xs, y):
        h = jnp.zeros(4)
        for t in range(xs.shape[0]):
            h = jnp.tanh(xs[t] @ p["wx"] + h @ p["wh"] + p["b"])
        return jnp.sum((h - y) ** 2)

    return loss, params, _normal(k[3], (B, 5, 3)), _normal(k[4], (B, 4))


def _scan_rnn_case():
    loss_unrolled, params, xs, y = _unrolled_rnn_case()

    def loss(p, xs, y):
        def step(h, x):
            return jnp.tanh(x @ p["wx"] + h @ p["wh"] + p["b"]), None

        h, _ = jax.lax.scan(step, jnp.zeros(4), xs)
        return jnp.sum((h - y) ** 2)

    return loss, params, xs, y


def _conv_case():
    k = _keys(5, seed=7)
    conv = eqx.nn.Conv2d(2, 3, kernel_size=3, padding=1, key=k[0], dtype=jnp.float64)
    params = {
        "conv": conv,
        "head": _normal(k[1], (3 * 6 * 6, 2)) / 10,
        "hb": _normal(k[2], (2,)),
    }

    def loss(p, img, y):
        h = jax.nn.relu(p["conv"](img))
        return jnp.sum((h.reshape(-1) @ p["head"] + p["hb"] - y) ** 2)

    return loss, params, _normal(k[3], (B, 2, 6, 6)), _normal(k[4], (B, 2))


def _unknown_primitive_case():
    k = _keys(5, seed=8)
    params = {
        "w": _normal(k[0], (4, 4)),
        "s": _normal(k[1], (4,)),
        "c": _normal(k[2], (4,)),
    }

    def loss(p, x, y):
        scale = jnp.sort(p["s"])  # no rule for sort: vmap(grad) fallback for `s`
        h = jnp.tanh(x @ p["w"]) * scale
        h = h * jax.lax.cumprod(p["c"])  # nor for cumprod
        return jnp.sum((h - y) ** 2)

    return loss, params, _normal(k[3], (B, 4)), _normal(k[4], (B, 4))


def _structural_case():
    """Parameters through transpose, neg, slice, broadcast, division, a nested `jit`
    and a `custom_jvp` (the last one takes the fallback)."""
    k = _keys(7, seed=9)
    params = {
        "w": _normal(k[0], (3, 5)),
        "b": _normal(k[1], (5,)),
        "a": _normal(k[2], ()),
        "v": _normal(k[3], (6, 4)),
        "r": _normal(k[4], (4,)),
    }

    @jax.jit
    def inner(x, v):
        return jnp.tanh(x @ v[:5])

    def loss(p, x, y):
        h = x @ (-p["w"].T).T - p["b"]
        h = p["a"] * h / 3.0
        h = inner(h, p["v"]) * jax.nn.relu(p["r"])
        return jnp.sum((h - y) ** 2)

    return loss, params, _normal(k[5], (B, 3)), _normal(k[6], (B, 4))


def _static_leaves_case():
    k = _keys(4, seed=10)
    params = {
        "w": _normal(k[0], (3, 2)),
        "steps": jnp.array(3, jnp.int32),
        "mask": jnp.array([1, 0], jnp.int32),
        "power": 2,
        "name": "model",
        "unused": _normal(k[1], (2,)),
    }

    def loss(p, x, y):
        h = (x @ p["w"]) * (p["mask"] * p["steps"]).astype(x.dtype)
        return jnp.sum(jnp.abs(h - y) ** p["power"])

    return loss, params, _normal(k[2], (B, 3)), _normal(k[3], (B, 2))


def _structured_uses_case():
    """Parameters through uses the structure engine sees through (a `where`, slices of a
    parameter summed, a stack): each takes the structured path, not `vmap(grad)`."""
    k = _keys(5, seed=12)
    params = {
        "w": _normal(k[0], (3, 6)),
        "gate": _normal(k[1], (6,)),
        "band": _normal(k[2], (8,)),
    }

    def loss(p, x, y):
        h = x @ p["w"]
        h = jnp.where(h > 0, h * p["gate"], -p["gate"])  # select_n
        h = h + p["band"][1:7] + p["band"][:6] - 2 * p["band"][2:8]  # slices, summed
        h = jnp.stack([h[:3], h[3:] * p["gate"][:3]]).reshape(-1)
        return jnp.sum((jnp.tanh(h) - y) ** 2)

    return loss, params, _normal(k[3], (B, 3)), _normal(k[4], (B, 6))


CASES = {
    "mlp": _mlp_case,
    "classifier": _classifier_case,
    "equinox": _equinox_case,
    "flax": _flax_case,  # flax.linen.BatchNorm needs the standard promotion rules
    "reused_layer": _reused_layer_case,
    "attention_gram": lambda: _attention_case(t=3, c=8),
    "attention_per_example": lambda: _attention_case(t=6, c=4),
    "unrolled_rnn": _unrolled_rnn_case,
    "scan_rnn": _scan_rnn_case,
    "conv": _conv_case,
    "unknown_primitive": _unknown_primitive_case,
    "structural": _structural_case,
    "static_leaves": _static_leaves_case,
    "structured_uses": _structured_uses_case,
}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.slow)
        if c.startswith("attention")
        else pytest.param(c, marks=pytest.mark.standard_promotion)
        if c == "flax"
        else c
        for c in CASES
    ],
)
def test_matches_vmap_grad(case):
    _check(*CASES[case]())


@pytest.mark.parametrize(
    "case",
    [pytest.param("attention_per_example", marks=pytest.mark.slow), "unknown_primitive"],
)
def test_chunks(case):
    # chunk_size=3 does not divide B=7: the padded examples must not count.
    _check(*CASES[case](), chunk_size=3)


@pytest.mark.parametrize("promotion", ["standard", "strict"])
def test_mixed_precision_parameters(promotion):
    # float32 weights beside a bfloat16 scale, as in mixed-precision training. Under strict
    # promotion the three functions raised JAX's TypePromotionError (the norms' dtype was
    # the parameters' common dtype), where `jax.vmap(jax.grad(...))` works.
    params = {
        "w": jnp.asarray(np.random.RandomState(0).randn(4, 3), jnp.float32),
        "v": jnp.asarray(np.random.RandomState(1).randn(3), jnp.bfloat16),
    }
    x = jnp.asarray(np.random.RandomState(2).randn(6, 4), jnp.float32)

    def loss(p, x):
        return jnp.sum(jnp.tanh(x @ p["w"]) * p["v"].astype(jnp.float32))

    grads = jax.vmap(jax.grad(loss), (None, 0))(params, x)
    ref_sq = jtu.tree_map(lambda g: jnp.sum(g.astype(jnp.float32) ** 2, axis=0), grads)
    ref_norms = jnp.sqrt(
        sum(jnp.sum(g.astype(jnp.float32).reshape(6, -1) ** 2, axis=1) for g in grads.values())
    )
    with jax.numpy_dtype_promotion(promotion):
        sq = dl.sum_squared_grads(loss, params, x)
        norms = dl.per_example_grad_norms(loss, params, x)
        value, grad, sq2 = dl.value_grad_and_sum_squared_grads(loss, params, x)
    assert sq["w"].dtype == jnp.float32 and sq["v"].dtype == jnp.bfloat16
    assert norms.dtype == jnp.float32
    for got in (sq, sq2):
        np.testing.assert_allclose(got["w"], ref_sq["w"], rtol=1e-5)
        np.testing.assert_allclose(got["v"].astype(jnp.float32), ref_sq["v"], rtol=2e-2)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-2)
    np.testing.assert_allclose(value, jnp.sum(jax.vmap(loss, (None, 0))(params, x)), rtol=1e-5)
    np.testing.assert_allclose(grad["w"], jnp.sum(grads["w"], axis=0), rtol=1e-5)


def test_eager():
    _check(*_static_leaves_case(), jit=False)


def test_dense_layer_takes_the_fast_path():
    # For an MLP no (B, *W.shape) tensor may appear: the squares of a dense layer's
    # weights come from square(x).T @ square(g), not from per-example gradients.
    loss, params, x, y = _mlp_case()
    jaxpr = jax.make_jaxpr(lambda p: dl.value_grad_and_sum_squared_grads(loss, p, x, y))(params)
    weight_shapes = {(B, *w.shape) for w, _ in params["layers"]}

    def shapes(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn.primitive.name
            for v in eqn.outvars:
                yield tuple(v.aval.shape)
        for sub in subjaxprs(jaxpr):
            yield from shapes(sub)

    seen = set(shapes(jaxpr.jaxpr))
    assert not weight_shapes & seen
    assert "scan" not in seen
    # ...whereas a weight shared over positions is contracted per example.
    loss, params, x, y = _attention_case(t=6, c=4)
    jaxpr = jax.make_jaxpr(lambda p: dl.sum_squared_grads(loss, p, x, y, chunk_size=2))(params)
    assert "scan" in set(shapes(jaxpr.jaxpr))


def _analysed(case):
    """The uses and the fallback leaves that `_analyse` finds for one example of `case`
    (whose parameters are three leaves)."""
    loss, params, x, y = case()
    leaves = jtu.tree_leaves(params)
    closed = jax.make_jaxpr(
        lambda p, x, y: loss(jtu.tree_unflatten(jtu.tree_structure(params), p), x, y)
    )(leaves, x[0], y[0])
    uses, fallback = [], set()
    _squared_grads._analyse(
        closed.jaxpr,
        [_squared_grads._Origin(i, ()) for i in range(3)] + [None, None],
        (),
        uses,
        fallback,
    )
    return params, uses, fallback


def test_use_classification():
    params, uses, fallback = _analysed(_unknown_primitive_case)
    names = sorted(params)  # the order of `jtu.tree_leaves`
    assert {names[i] for i in fallback} == {"c", "s"}
    (use,) = [u for u in uses if names[u.leaf] == "w"]
    assert use.eqn.primitive.name == "dot_general" and use.kind.fast


def test_structured_uses_take_no_fallback():
    # Their blocks from the structure engine hold at most one entry per column, so no
    # parameter needs vmap(grad).
    _, uses, fallback = _analysed(_structured_uses_case)
    assert fallback == set()
    assert {u.leaf for u in uses} == {0, 1, 2}


_BATCH_SUMS = [_squared_grads._sums_by_example, _squared_grads._sums_at_once]


@pytest.mark.parametrize("sums", _BATCH_SUMS, ids=["cpu", "gpu"])
@pytest.mark.parametrize("n", [1, 7, 9])
def test_masked_batch_sums(sums, n):
    # Both platform branches of `_masked_batch_sums` (CPU tests reach only one through
    # the public functions): masked sums of the entries and of their squares. n = 7 and
    # 9 make a short last block and only full blocks of the CPU branch.
    x = jax.random.normal(jax.random.key(n), (n, 3, 5))
    mask = jnp.arange(n) % 3 != 2
    total, squares = sums(x, mask, (1, 2))
    kept = np.asarray(x)[np.asarray(mask)]
    np.testing.assert_allclose(total, kept.sum(0), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(squares, (kept**2).sum(0), rtol=1e-13, atol=1e-15)
    (only_squares,) = sums(x, mask, (2,))
    np.testing.assert_allclose(only_squares, squares, rtol=1e-13)


@pytest.mark.parametrize("sums", _BATCH_SUMS, ids=["cpu", "gpu"])
def test_masked_batch_sums_float32_rounding(sums):
    # A plain running sum over 4096 float32 examples is off by up to ~3e-6 relative;
    # blocks of sqrt(n) examples keep it near 5e-7.
    x = jax.random.normal(jax.random.key(0), (4096, 500), jnp.float32)
    (squares,) = sums(x, jnp.ones(4096, bool), (2,))
    exact = (np.asarray(x, np.float64) ** 2).sum(0)
    assert squares.dtype == jnp.float32
    np.testing.assert_allclose(squares, exact, rtol=1e-6)


def test_register_use_rule_is_a_plain_dict():
    assert _squared_grads._USE_RULES[jax.lax.dot_general_p] is _squared_grads._dot_general_rule
    assert jax.lax.sort_p not in _squared_grads._USE_RULES


#
# Errors
#


def _simple():
    k = _keys(2, seed=11)
    return {"w": _normal(k[0], (3, 2))}, _normal(k[1], (B, 3))


@pytest.mark.parametrize(
    "fn",
    [
        dl.sum_squared_grads,
        dl.per_example_grad_norms,
        dl.value_grad_and_sum_squared_grads,
    ],
)
def test_non_scalar_loss(fn):
    params, x = _simple()

    def vector_loss(p, x):
        return x @ p["w"]

    with pytest.raises(ValueError, match=rf"{fn.__name__}.*vector_loss.*scalar"):
        fn(vector_loss, params, x)

    def int_loss(p, x):
        return jnp.sum(x @ p["w"]).astype(jnp.int32)

    with pytest.raises(ValueError, match="int_loss.*floating scalar"):
        fn(int_loss, params, x)


@pytest.mark.parametrize(
    "fn",
    [
        dl.sum_squared_grads,
        dl.per_example_grad_norms,
        dl.value_grad_and_sum_squared_grads,
    ],
)
def test_mismatched_batch(fn):
    params, x = _simple()

    def my_loss(p, x, y):
        return jnp.sum((x @ p["w"] - y) ** 2)

    with pytest.raises(ValueError, match=rf"{fn.__name__}.*my_loss.*mismatched leading"):
        fn(my_loss, params, x, jnp.zeros((B + 1, 2)))
    with pytest.raises(ValueError, match=rf"{fn.__name__}.*my_loss.*scalar"):
        fn(my_loss, params, x, jnp.zeros(()))
    with pytest.raises(ValueError, match=rf"{fn.__name__}.*at least one batch"):
        fn(my_loss, params)


def test_error_wording():
    params, x = _simple()

    def loss_fn(p, x, y):
        return jnp.sum((x @ p["w"] - y) ** 2)

    # A function named `loss_fn` is not named twice.
    with pytest.raises(ValueError, match="batch arguments of `loss_fn` have") as info:
        dl.sum_squared_grads(loss_fn, params, x, jnp.zeros((B + 1, 2)))
    assert "`loss_fn` `loss_fn`" not in str(info.value)
    with pytest.raises(ValueError, match=r"for `loss_fn` is a scalar"):
        dl.sum_squared_grads(loss_fn, params, x, jnp.zeros(()))

    # Scalar losses of the wrong dtype are not told to reduce their output.
    def int_loss(p, x):
        return jnp.sum(x @ p["w"]).astype(jnp.int32)

    def complex_loss(p, x):
        s = jnp.sum(x @ p["w"])
        return jax.lax.complex(s, s)

    def pair_loss(p, x):
        return jnp.sum(x @ p["w"]), x

    for loss, wanted in [
        (int_loss, r"`int_loss`\) must return .* int32 scalar\. Compute the loss in floating"),
        (complex_loss, r"complex128 scalar\. Return a real loss"),
        (pair_loss, r"returned a pytree .* Return the loss alone"),
    ]:
        with pytest.raises(ValueError, match=wanted) as info:
            dl.sum_squared_grads(loss, params, x)
        assert "Reduce its output" not in str(info.value)


class _Counted(eqx.Module):
    mlp: eqx.nn.MLP
    scale: jax.Array  # integer array: held fixed
    steps: int  # Python integer: held fixed

    def __call__(self, x):
        return self.mlp(x * self.scale.astype(x.dtype)) / self.steps


@pytest.mark.slow  # the no-floating-leaf error stays in the default run
def test_integer_leaves_are_held_fixed_as_with_filter_grad():
    # A whole Equinox module: its integer leaves are not differentiated, as with
    # `equinox.filter_grad`, and add nothing to the norms.
    k = _keys(2, seed=12)
    model = _Counted(
        eqx.nn.MLP(3, "scalar", 4, 1, key=k[0], dtype=jnp.float64), jnp.array([1, 2, 3]), 2
    )
    x = _normal(k[1], (B, 3))

    def loss_fn(model, x):
        return jnp.tanh(model(x)) ** 2

    loss, grad, sq, norms = _reference(loss_fn, model, x)
    np.testing.assert_allclose(dl.per_example_grad_norms(loss_fn, model, x), norms, rtol=1e-10)
    got_sq = dl.sum_squared_grads(loss_fn, model, x)
    _assert_tree_close(got_sq, sq)
    assert got_sq.scale is None and got_sq.steps is None
    got_loss, got_grad, _ = dl.value_grad_and_sum_squared_grads(loss_fn, model, x)
    np.testing.assert_allclose(got_loss, loss, rtol=1e-12)
    _assert_tree_close(got_grad, grad)


@pytest.mark.parametrize(
    "fn",
    [
        dl.sum_squared_grads,
        dl.per_example_grad_norms,
        dl.value_grad_and_sum_squared_grads,
    ],
)
def test_no_floating_leaf_raises_as_jax_grad(fn):
    # Norms of zero (or a gradient of `None`s) would hide the mistake: `jax.grad` raises.
    x = _normal(_keys(1)[0], (B, 3))

    def loss_fn(w, x):
        return jnp.sum(x * w)

    with pytest.raises(TypeError, match="integer"):
        jax.grad(loss_fn)(jnp.arange(3), x[0])
    wanted = rf"`diffrax_linearize.{fn.__name__}`: `params` has no floating-point.*int"
    with pytest.raises(TypeError, match=wanted):
        fn(loss_fn, jnp.arange(3), x)
