"""`materialise` and `materialise_operator` against `jax.jacfwd` (or `jax.jacrev` where
`jax.jacfwd` cannot run): one case per structure rule, pytrees, transformations, the
structure of the traced program, caching, and errors."""

import functools
import warnings

import diffrax_linearize as dl
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.scipy as jsp
import jax.tree_util as jtu
import lineax as lx
import numpy as np
import pytest
from diffrax_linearize import _materialise
from helpers import assert_jacobian_equal, assert_tree_allclose, count_matmuls


_TOL = {jnp.float32: dict(rtol=2e-4, atol=2e-5), jnp.float64: dict(rtol=1e-10, atol=1e-12)}


def _const(shape, seed, dtype, positive=False):
    """A fixed random constant, cast to the inputs' dtype."""
    c = np.random.RandomState(seed).randn(*shape)
    if positive:
        c = 1.5 + np.abs(c)
    return jnp.asarray(c, dtype=dtype)


def _input(shape, dtype, seed=0):
    return jnp.asarray(np.random.RandomState(100 + seed).randn(*shape), dtype=dtype)


# ---- one case per rule ----------------------------------------------------------------
#
# Each case is `make(dtype) -> (fn, args)`; `argnums` is 0 unless the case says otherwise.
# Constants are built from the dtype so that float32 cases stay float32.

CASES = {}


def case(name, *, reference="jacfwd", modes=("forward", "reverse"), argnums=0):
    def decorator(make):
        CASES[name] = (make, reference, modes, argnums)
        return make

    return decorator


@case("neg")
def _(dt):
    return lambda x: -x, (_input((3, 4), dt),)


@case("complex")
def _(dt):
    return lambda x: lax.complex(x, 2 * x), (_input((4,), dt),)


@case("conj")
def _(dt):
    return lambda x: jnp.conj(lax.complex(x, jnp.sin(x))) * (1 + 2j), (_input((4,), dt),)


@case("real_imag")
def _(dt):
    def fn(x):
        z = lax.complex(x, x**2) * (1 - 3j)
        return 2 * jnp.real(z) + jnp.imag(z)

    return fn, (_input((4,), dt),)


@case("convert_element_type")
def _(dt):
    other = jnp.float64 if dt == jnp.float32 else jnp.float32
    return lambda x: (3 * x).astype(other).astype(dt) * 2, (_input((4,), dt),)


@case("copy")
def _(dt):
    return lambda x: jnp.copy(2 * x), (_input((3, 2), dt),)


# `jax.jacfwd` and `jax.jacrev` differ here (the tangent is rounded after the scaling, the
# cotangent before it): each mode is compared with its own reference.
@case("reduce_precision", reference="per-mode")
def _(dt):
    return lambda x: lax.reduce_precision(0.1 * x, exponent_bits=5, mantissa_bits=4), (
        _input((4,), dt),
    )


@case("transpose_2d")
def _(dt):
    return lambda x: x.T, (_input((3, 4), dt),)


@case("transpose_3d")
def _(dt):
    return lambda x: jnp.transpose(x, (2, 0, 1)), (_input((2, 3, 4), dt),)


@case("broadcast_new_axes")
def _(dt):
    return lambda x: jnp.broadcast_to(x, (2, 3, 4)), (_input((3, 4), dt),)


@case("broadcast_size_one")
def _(dt):
    return lambda x: jnp.broadcast_to(x, (3, 4)), (_input((3, 1), dt),)


@case("broadcast_in_dim_middle")
def _(dt):
    return lambda x: lax.broadcast_in_dim(x, (3, 2, 4, 1), (0, 2, 3)), (_input((3, 1, 1), dt),)


@case("broadcast_scalar")
def _(dt):
    return lambda x: jnp.broadcast_to(x, (2, 3)), (_input((), dt),)


@case("reshape_merge")
def _(dt):
    return lambda x: x.reshape(6, 4), (_input((2, 3, 4), dt),)


@case("reshape_split")
def _(dt):
    return lambda x: x.reshape(2, 3, 4), (_input((6, 4), dt),)


@case("reshape_add_size_one")
def _(dt):
    return lambda x: x.reshape(3, 1, 4, 1), (_input((3, 4), dt),)


@case("reshape_remove_size_one")
def _(dt):
    return lambda x: x.reshape(3, 4), (_input((1, 3, 1, 4), dt),)


@case("reshape_regroup")
def _(dt):
    return lambda x: x.reshape(3, 2, 2), (_input((2, 6), dt),)


@case("reshape_of_diagonal")
def _(dt):
    return lambda x: jnp.sin(x).reshape(4, 3).T, (_input((2, 6), dt),)


@case("squeeze")
def _(dt):
    return lambda x: lax.squeeze(x, (1,)), (_input((3, 1, 4), dt),)


@case("expand_dims")
def _(dt):
    return lambda x: jnp.expand_dims(x, (0, 2)), (_input((3, 4), dt),)


@case("rev")
def _(dt):
    return lambda x: x[::-1, ::-1] + lax.rev(x, (1,)), (_input((3, 4), dt),)


@case("slice_strided")
def _(dt):
    return lambda x: x[1:6:2, ::3], (_input((7, 5), dt),)


@case("slice_of_dense")
def _(dt):
    A = _const((6, 6), 1, dt)
    return lambda x: (A @ x)[1:5:2], (_input((6,), dt),)


@case("dynamic_slice")
def _(dt):
    return lambda x: lax.dynamic_slice(x, (1, 2), (2, 2)), (_input((4, 5), dt),)


@case("dynamic_slice_traced_index", argnums=0)
def _(dt):
    return lambda x, i: lax.dynamic_slice(x, (i,), (3,)), (_input((6,), dt), jnp.int32(2))


@case("index_out_of_range_negative")
def _(dt):
    # `x[-4]` of three entries: `jnp` wraps -4 to -1 and `dynamic_slice` clamps that to 0
    # (XLA's semantics), so the value is `x[0]`. `lax.dynamic_slice` would wrap the -1 again,
    # to `x[2]`: reverse mode's rule took that path.
    return lambda x: x[-4] + 2 * x[1, -5], (_input((3, 3), dt),)


@case("dynamic_slice_traced_start_out_of_range", argnums=0)
def _(dt):
    # The primitive clamps a traced start into range: -3 gives rows 0 and 1.
    A = _const((4, 3), 4, dt)
    fn = lambda x, i: lax.dynamic_slice(A @ x, (i,), (2,), allow_negative_indices=False)
    return fn, (_input((3,), dt), jnp.int32(-3))


@case("dynamic_update_slice_traced_start_out_of_range", argnums=0)
def _(dt):
    A = _const((2, 3), 5, dt)

    def fn(x, i):
        base = jnp.zeros(5, dt) + jnp.sum(x)
        return lax.dynamic_update_slice(base, A @ x, (i,), allow_negative_indices=False)

    return fn, (_input((3,), dt), jnp.int32(-1))


@case("dynamic_update_slice_operand")
def _(dt):
    upd = _const((2,), 2, dt)
    return lambda x: lax.dynamic_update_slice(x, upd, (1,)), (_input((5,), dt),)


@case("dynamic_update_slice_update")
def _(dt):
    base = _const((6,), 3, dt)
    return lambda x: lax.dynamic_update_slice(base, 2 * x[:3], (2,)), (_input((4,), dt),)


@case("dynamic_update_slice_both")
def _(dt):
    return lambda x: lax.dynamic_update_slice(x, jnp.sin(x[:2]), (3,)), (_input((5,), dt),)


@case("dynamic_update_slice_empty_update", argnums=(0, 1))
def _(dt):
    # An update with no elements: the output is the operand, and its block w.r.t. the
    # update has no columns.
    fn = lambda x, u: lax.dynamic_update_slice(jnp.sin(x), 2 * u, (2, 1))
    return fn, (_input((4, 3), dt), _input((0, 2), dt, 1))


@case("pad_negative_interior")
def _(dt):
    return lambda x: lax.pad(x, jnp.zeros((), dt), [(1, -1, 1), (-1, 2, 0)]), (_input((3, 4), dt),)


@case("pad_linear_padding_value")
def _(dt):
    return lambda x: lax.pad(x, x[0], [(2, 1, 2)]), (_input((3,), dt),)


@case("concatenate")
def _(dt):
    c = _const((2, 3), 4, dt)
    return lambda x: jnp.concatenate([x, 2 * x, c], axis=0), (_input((2, 3), dt),)


@case("concatenate_axis1")
def _(dt):
    A = _const((2, 2), 5, dt)
    return lambda x: jnp.concatenate([jnp.sin(x), A @ x], axis=1), (_input((2, 3), dt),)


@case("reduce_sum")
def _(dt):
    return lambda x: (x.sum(0), x.sum(), x.sum((0, 2))), (_input((2, 3, 4), dt),)


@case("cumsum")
def _(dt):
    return lambda x: jnp.cumsum(x, axis=1), (_input((3, 4), dt),)


@case("cumsum_reverse")
def _(dt):
    return lambda x: lax.cumsum(x, axis=0, reverse=True), (_input((4, 2), dt),)


@case("mul_scalar_constant")
def _(dt):
    return lambda x: 3 * x * 2.5, (_input((3, 4), dt),)


@case("mul_full_constant")
def _(dt):
    c = _const((3, 4), 6, dt)
    return lambda x: c * x, (_input((3, 4), dt),)


@case("mul_broadcast_size_one")
def _(dt):
    c = _const((1, 4), 7, dt)
    d = _const((3, 1), 8, dt)
    return lambda x: c * x * d, (_input((3, 4), dt),)


@case("div_constants")
def _(dt):
    c = _const((3, 4), 9, dt, positive=True)
    return lambda x: (x / c, x / 3.0, x / c[:1]), (_input((3, 4), dt),)


@case("add_sub_scalar")
def _(dt):
    return lambda x: (x + 1.0, 2.0 - x, x - x.sum(), x.sum() + x), (_input((3, 4), dt),)


@case("add_broadcast_lin")
def _(dt):
    return lambda x: x[:, :1] + x - x[:1, :], (_input((3, 4), dt),)


@case("dot_matvec")
def _(dt):
    A = _const((5, 4), 10, dt)
    return lambda x: A @ x, (_input((4,), dt),)


@case("dot_matmul_rhs")
def _(dt):
    A = _const((5, 4), 11, dt)
    return lambda x: A @ x, (_input((4, 3), dt),)


@case("dot_matmul_lhs")
def _(dt):
    W = _const((4, 3), 12, dt)
    return lambda x: x @ W, (_input((2, 4), dt),)


@case("dot_vecmat")
def _(dt):
    W = _const((4, 3), 13, dt)
    return lambda x: x @ W, (_input((4,), dt),)


@case("dot_batched_einsum")
def _(dt):
    C = _const((2, 3, 4), 14, dt)
    return lambda x: (
        jnp.einsum("bij,bjk->bik", C, x),
        jnp.einsum("bjk,bij->bki", x, C),
    ), (_input((2, 4, 3), dt),)


@case("dot_multi_contraction")
def _(dt):
    C = _const((5, 3, 4), 15, dt)
    return lambda x: (jnp.tensordot(C, x, axes=2), jnp.tensordot(x, C, axes=[(0, 1), (1, 2)])), (
        _input((3, 4), dt),
    )


@case("dot_both_linear")
def _(dt):
    return lambda x: x @ x + x.T @ jnp.sin(x), (_input((3, 3), dt),)


@case("dot_inner_product")
def _(dt):
    c = _const((4,), 16, dt)
    return lambda x: jnp.dot(c, x) * x, (_input((4,), dt),)


@case("select_n_where")
def _(dt):
    mask = jnp.asarray([True, False, True, True])
    return lambda x: (jnp.where(mask, x, 2 * x), jnp.where(x > 0, x, 0.0)), (_input((4,), dt),)


@case("select_n_three_way")
def _(dt):
    which = jnp.asarray([0, 2, 1, 0], dtype=jnp.int32)
    return lambda x: lax.select_n(which, x, jnp.sin(x), 3 * x), (_input((4,), dt),)


@case("gather")
def _(dt):
    idx = jnp.asarray([2, 0, 0, 3])
    return lambda x: (x[idx], x[:, idx[:2]], x[1]), (_input((4, 5), dt),)


@case("gather_of_dense")
def _(dt):
    idx = jnp.asarray([2, 0, 2])
    A = _const((4, 4), 17, dt)
    return lambda x: jnp.tanh(A @ x)[idx], (_input((4,), dt),)


@case("scatter_set")
def _(dt):
    return lambda x: x.at[1].set(0.0).at[2].set(x[0] * 3), (_input((4,), dt),)


@case("scatter_add")
def _(dt):
    idx = jnp.asarray([0, 2, 0])
    return lambda x: jnp.zeros((4, 2), dt).at[idx].add(x[:3]), (_input((3, 2), dt),)


@case("scatter_add_every_update_dropped", argnums=(0, 1))
def _(dt):
    # Out of bounds: `.at[]` updates drop them by default, so `y` has no effect on the
    # output (a zero block), and the operand passes through.
    return lambda x, y: x.at[4].add(2 * y), (_input((3, 4, 5), dt), _input((4, 5), dt, 1))


@case("conv_constant_kernel")
def _(dt):
    k = _const((3, 2, 3, 3), 18, dt)

    def fn(x):
        return lax.conv_general_dilated(x, k, (1, 1), "SAME")

    return fn, (_input((1, 2, 5, 4), dt),)


@case("conv_kernel_is_input")
def _(dt):
    img = _const((2, 2, 5, 5), 19, dt)

    def fn(k):
        return lax.conv_general_dilated(img, k, (2, 1), "VALID", rhs_dilation=(1, 2))

    return fn, (_input((3, 2, 2, 2), dt),)


@case("avg_pool")
def _(dt):
    def fn(x):
        s = lax.reduce_window(x, 0.0, lax.add, (2, 2), (1, 2), "VALID")
        return s / 4

    return fn, (_input((4, 6), dt),)


@case("max_pool")
def _(dt):
    def fn(x):
        return lax.reduce_window(x, -jnp.inf, lax.max, (2, 2), (2, 1), "VALID")

    return fn, (_input((4, 5), dt),)


@case("fft")
def _(dt):
    return lambda x: (
        jnp.fft.fft(x),
        jnp.fft.rfft(x),
        jnp.fft.fft2(lax.complex(jnp.zeros_like(x), x)),
    ), (_input((4, 6), dt),)


@case("triangular_solve_rhs")
def _(dt):
    L = jnp.tril(_const((4, 4), 20, dt)) + 4 * jnp.eye(4, dtype=dt)
    return lambda x: jsp.linalg.solve_triangular(L, x, lower=True), (_input((4, 2), dt),)


@case("triangular_solve_matrix")
def _(dt):
    b = _const((4,), 21, dt)

    def fn(m):
        U = jnp.triu(m) + 4 * jnp.eye(4, dtype=dt)
        return jsp.linalg.solve_triangular(U, b, lower=False)

    return fn, (_input((4, 4), dt),)


@case("linalg_solve_rhs")
def _(dt):
    A = _const((4, 4), 22, dt) + 4 * jnp.eye(4, dtype=dt)
    return lambda x: jnp.linalg.solve(A, x), (_input((4,), dt),)


@case("linalg_solve_matrix")
def _(dt):
    b = _const((3,), 23, dt)
    return lambda m: jnp.linalg.solve(m + 4 * jnp.eye(3, dtype=dt), b), (_input((3, 3), dt),)


@case("lineax_linear_solve")
def _(dt):
    A = _const((4, 4), 24, dt) + 4 * jnp.eye(4, dtype=dt)

    def fn(x):
        return lx.linear_solve(lx.MatrixLinearOperator(A), x, lx.LU()).value

    return fn, (_input((4,), dt),)


@case("lineax_linear_solve_matrix")
def _(dt):
    b = _const((3,), 25, dt)

    def fn(m):
        op = lx.MatrixLinearOperator(m + 4 * jnp.eye(3, dtype=dt))
        return lx.linear_solve(op, b, lx.LU()).value

    return fn, (_input((3, 3), dt),)


@case("jit_nesting")
def _(dt):
    A = _const((4, 4), 26, dt)
    inner = jax.jit(lambda y: jnp.sin(A @ y))
    return jax.jit(lambda x: 2 * inner(jax.jit(lambda z: z * z)(x))), (_input((4,), dt),)


@case("checkpoint")
def _(dt):
    A = _const((4, 4), 27, dt)
    return jax.checkpoint(lambda x: jnp.sin(A @ x) * x), (_input((4,), dt),)


@case("custom_jvp_relu_softplus")
def _(dt):
    return lambda x: (jax.nn.relu(x), jax.nn.softplus(x), jax.nn.gelu(x)), (_input((5,), dt),)


@jax.custom_vjp
def _cube(x):
    return x**3


def _cube_fwd(x):
    return x**3, x


def _cube_bwd(x, g):
    return (3 * x**2 * g,)


_cube.defvjp(_cube_fwd, _cube_bwd)


@case("custom_vjp", reference="jacrev")
def _(dt):
    A = _const((3, 4), 28, dt)
    return lambda x: A @ _cube(jnp.sin(x)), (_input((4,), dt),)


@case("custom_vjp_in_jit", reference="jacrev")
def _(dt):
    return jax.jit(lambda x: _cube(x) + x), (_input((2, 2), dt),)


# custom_vjp inside control flow and checkpoints: forward mode used to fail there
# (`can't apply forward-mode autodiff (jvp) to a custom_vjp function`).
@case("custom_vjp_in_scan", reference="jacrev")
def _(dt):
    xs = _const((3, 4), 29, dt)
    return lambda x: lax.scan(lambda c, a: (_cube(c) * 0.5 + a, c), x, xs)[0], (_input((4,), dt),)


@case("custom_vjp_in_cond", reference="jacrev")
def _(dt):
    return lambda x: lax.cond(jnp.sum(x) > 0, _cube, jnp.sin, x), (_input((4,), dt),)


@case("custom_vjp_in_switch", reference="jacrev")
def _(dt):
    return lambda x: lax.switch(jnp.int32(x[0] > 0), [jnp.cos, _cube], x), (_input((4,), dt),)


@case("custom_vjp_in_checkpoint", reference="jacrev")
def _(dt):
    return lambda x: jax.checkpoint(lambda y: _cube(y) * y)(x), (_input((4,), dt),)


@case("cond_traced_predicate")
def _(dt):
    A = _const((4, 4), 29, dt)

    def fn(x):
        return lax.cond(x.sum() > 0, lambda y: A @ y, lambda y: jnp.sin(y), x)

    return fn, (_input((4,), dt),)


@case("cond_traced_predicate_other_branch")
def _(dt):
    A = _const((4, 4), 29, dt)

    def fn(x):
        return lax.cond(x.sum() < 0, lambda y: A @ y, lambda y: jnp.sin(y), x)

    return fn, (_input((4,), dt),)


@case("cond_concrete_predicate")
def _(dt):
    return lambda x: lax.cond(True, lambda y: y**2, lambda y: -y, x), (_input((3,), dt),)


@case("switch_index_argument")
def _(dt):
    def fn(x, i):
        return lax.switch(i, [jnp.sin, jnp.cos, lambda y: 3 * y], x)

    return fn, (_input((3,), dt), jnp.int32(1))


@case("scan")
def _(dt):
    A = 0.5 * _const((3, 3), 30, dt)
    xs = _const((4, 3), 31, dt)

    def fn(x):
        def body(c, a):
            c = jnp.tanh(A @ c) + a * c
            return c, 2 * c

        return lax.scan(body, x, xs)

    return fn, (_input((3,), dt),)


@case("scan_of_a_reversed_product")
def _(dt):
    # The carry's block: a reversal pattern (an `Ell`) whose values vary along the last in
    # axis (mixed by `M`). The loop's template of it is a sum of zeros, which `compress`
    # makes constant along every axis: `join` must put that in axis back (found by the
    # random programs, seed 1113: "5 is not in list").
    M = _const((2, 2), 34, dt)
    xs = _const((3, 5, 5, 2), 35, dt)

    def fn(x):
        def body(c, a):
            c = jnp.tanh(c) * a + c / 2
            return c, c

        return lax.scan(body, (x @ M)[::-1, ::-1], xs)[0]

    return fn, (_input((5, 5, 2), dt),)


@case("scan_over_input")
def _(dt):
    def fn(x):
        return lax.scan(lambda c, a: (c + jnp.sin(a), c * a), jnp.zeros(2, dt), x)

    return fn, (_input((3, 2), dt),)


@case("fori_loop")
def _(dt):
    A = 0.5 * _const((3, 3), 32, dt)
    return lambda x: lax.fori_loop(0, 3, lambda i, c: A @ jnp.tanh(c), x), (_input((3,), dt),)


@case("while_loop")  # `jax.jacrev` cannot run here: reverse is checked against jacfwd
def _(dt):
    A = 0.5 * _const((3, 3), 33, dt)

    def fn(x):
        def body(state):
            i, c = state
            return i + 1, A @ jnp.sin(c)

        return lax.while_loop(lambda s: s[0] < 3, body, (0, x))[1]

    return fn, (_input((3,), dt),)


def _rule_cases():
    # Every case in both dtypes; `make test` runs each case in one of them, float64 and
    # float32 by turns down the table (so both dtypes meet every kind of rule there), and
    # `make test-slow` the other (the test is compile-bound: 50 s of a worker for both).
    for i, name in enumerate(CASES):
        for j, dtype in enumerate(("float64", "float32")):
            marks = () if (i + j) % 2 == 0 else pytest.mark.slow
            yield pytest.param(name, dtype, marks=marks, id=f"{name}-{dtype}")


@pytest.mark.parametrize("name, dtype_name", _rule_cases())
def test_rule(name, dtype_name):
    make, reference, modes, argnums = CASES[name]
    references = {
        "forward": jax.jacrev if reference == "jacrev" else jax.jacfwd,
        "reverse": jax.jacfwd if reference == "jacfwd" else jax.jacrev,
    }
    dtypes = {dtype_name: getattr(jnp, dtype_name)}
    programs = {key: make(dtype) for key, dtype in dtypes.items()}

    # One compilation for both modes and the references: compiling dominates.
    @jax.jit
    def run(all_args):
        out = {}
        for dtype, (fn, _) in programs.items():  # dict keys: strings, sortable
            args = all_args[dtype]
            for mode in modes:
                expected = references[mode](fn, argnums=argnums)(*args)
                actual = dl.materialise(fn, *args, argnums=argnums, mode=mode)
                out[dtype, mode] = (actual, expected)
        return out

    results = run({dtype: args for dtype, (_, args) in programs.items()})
    for (dtype, mode), (actual, expected) in results.items():
        try:
            assert_tree_allclose(actual, expected, **_TOL[dtypes[dtype]])
        except AssertionError as e:
            raise AssertionError(f"{name}, {dtype}, mode={mode}: {e}") from None


def test_custom_vjp_jacfwd_fails():
    # Why the `custom_vjp` cases compare against `jax.jacrev`.
    with pytest.raises(TypeError):
        jax.jacfwd(_cube)(jnp.ones(3))


def test_auto_mode():
    A = _const((2, 6), 34, jnp.float64)
    x = _input((6,), jnp.float64)
    for fn in (lambda x: A @ jnp.sin(x), lambda x: jnp.sin(A.T @ (A @ x))):
        assert_tree_allclose(dl.materialise(fn, x), jax.jacfwd(fn)(x), **_TOL[jnp.float64])


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_auto_mode_keeps_precision(dtype):
    """More inputs than outputs, but the inputs are of lower precision than the float64
    outputs: reverse mode (`jax.jacrev`) would round the Jacobian to the inputs' dtype, so
    `auto` goes forward and equals `jax.jacfwd`."""
    A = _const((2, 6), 35, jnp.float64)
    fn = lambda x: A @ jnp.sin(x.astype(jnp.float64))
    x = _input((6,), dtype)
    expected = jax.jacfwd(fn)(x)
    assert expected.dtype == jnp.float64
    np.testing.assert_allclose(dl.materialise(fn, x), expected, rtol=1e-14, atol=0)
    assert not np.allclose(jax.jacrev(fn)(x), expected, rtol=1e-10, atol=0)  # what reverse gives


@pytest.mark.standard_promotion
def test_complex_output_auto_mode():
    # Fewer outputs than inputs selects reverse mode; a real-to-complex map must not lose
    # the imaginary part of its Jacobian there.
    x = _input((4,), jnp.float64)
    for fn in (lambda x: jnp.sum(x * (1 + 2j)), lambda x: jnp.fft.fft(x)[:2]):
        assert_tree_allclose(dl.materialise(fn, x), jax.jacfwd(fn)(x), **_TOL[jnp.float64])


# ---- pytrees and argnums --------------------------------------------------------------


def _pytree_fn(p, c, q):
    a, (b,) = p["a"], p["b"]
    return {"out": (a * c + jnp.sum(b), jnp.sin(b) * q[0])}, a @ b[:2]


def _pytree_args(dtype):
    p = {"a": _input((2,), dtype, 1), "b": (_input((3,), dtype, 2),)}
    return p, _input((2,), dtype, 3), [_input((), dtype, 4)]


@pytest.mark.parametrize(
    "argnums, dtype, mode",
    [
        (0, jnp.float64, "forward"),
        (0, jnp.float32, "reverse"),
        (1, jnp.float64, "reverse"),
        ((0,), jnp.float64, "auto"),
        ((0, 2), jnp.float32, "forward"),
        ((0, 2), jnp.float64, "reverse"),
        ((2, 0), jnp.float64, "forward"),
        ((2, 0), jnp.float32, "reverse"),
        (-1, jnp.float64, "auto"),
    ],
)
def test_pytrees_and_argnums(argnums, dtype, mode):
    args = _pytree_args(dtype)
    expected = jax.jacfwd(_pytree_fn, argnums=argnums)(*args)
    actual = dl.materialise(_pytree_fn, *args, argnums=argnums, mode=mode)
    assert jtu.tree_structure(actual) == jtu.tree_structure(expected)
    assert_tree_allclose(actual, expected, **_TOL[dtype])


def test_non_array_other_arguments():
    # Only the differentiated arguments must be arrays.
    def fn(x, name, scale, flag):
        assert name == "hello" and flag is None
        return scale * jnp.sin(x)

    x = _input((3,), jnp.float64)
    actual = dl.materialise(fn, x, "hello", 2.0, None)
    assert_tree_allclose(actual, jax.jacfwd(fn)(x, "hello", 2.0, None))


def test_integer_output():
    def fn(x):
        return jnp.sin(x), jnp.arange(3)

    x = _input((4,), jnp.float64)
    assert_tree_allclose(dl.materialise(fn, x), jax.jacfwd(fn)(x))


def test_output_independent_of_input():
    c = _const((2, 2), 35, jnp.float64)
    x = _input((3,), jnp.float64)
    for mode in ("forward", "reverse"):
        actual = dl.materialise(lambda x: (c, jnp.sin(x)), x, mode=mode)
        assert_tree_allclose(actual, jax.jacfwd(lambda x: (c, jnp.sin(x)))(x))


# ---- under jit, vmap, grad --------------------------------------------------------------


def _nonlinear(x, A):
    return jnp.tanh(A @ x) * x[0]


def test_under_jit():
    A = _const((3, 4), 36, jnp.float64)
    x = _input((4,), jnp.float64)
    actual = jax.jit(lambda x, A: dl.materialise(_nonlinear, x, A))(x, A)
    expected = jax.jacfwd(_nonlinear)(x, A)
    assert_tree_allclose(actual, expected, **_TOL[jnp.float64])


@pytest.mark.parametrize("argnums", [0, 1])
def test_under_vmap(argnums):
    A = _const((5, 3, 4), 37, jnp.float64)
    x = _const((5, 4), 38, jnp.float64)
    actual = jax.vmap(lambda x, A: dl.materialise(_nonlinear, x, A, argnums=argnums))(x, A)
    expected = jax.vmap(jax.jacfwd(_nonlinear, argnums=argnums))(x, A)
    assert_tree_allclose(actual, expected, **_TOL[jnp.float64])


def test_under_vmap_unbatched_argument():
    A = _const((3, 4), 39, jnp.float64)
    x = _const((5, 4), 40, jnp.float64)
    actual = jax.vmap(lambda x: dl.materialise(_nonlinear, x, A))(x)
    expected = jax.vmap(lambda x: jax.jacfwd(_nonlinear)(x, A))(x)
    assert_tree_allclose(actual, expected, **_TOL[jnp.float64])


@pytest.mark.parametrize("wrt", [0, 1])
def test_under_grad(wrt):
    A = _const((3, 4), 41, jnp.float64)
    x = _input((4,), jnp.float64)

    def loss(jacobian, x, A):
        return jnp.sum(jacobian(_nonlinear)(x, A) ** 2)

    actual = jax.grad(lambda x, A: loss(lambda f: lambda *a: dl.materialise(f, *a), x, A), wrt)
    expected = jax.grad(lambda x, A: loss(jax.jacfwd, x, A), wrt)
    assert_tree_allclose(actual(x, A), expected(x, A), **_TOL[jnp.float64])


# ---- structure: matrix-matrix products in the traced program ----------------------------


N = 6


def _matrices():
    return _const((N, N), 42, jnp.float64), _const((N, N), 43, jnp.float64)


def test_linear_map_is_its_matrix():
    A, _ = _matrices()
    x = _input((N,), jnp.float64)
    assert count_matmuls(lambda x: dl.materialise(lambda x: A @ x, x), x) == 0
    # The reference counter does see the product jacfwd computes.
    assert count_matmuls(jax.jacfwd(lambda x: A @ x), x) == 1
    np.testing.assert_array_equal(dl.materialise(lambda x: A @ x, x), A)
    A32 = A.astype(jnp.float32)
    out = dl.materialise(lambda x: A32 @ x, x.astype(jnp.float32))
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, A32)


def test_no_matmul_scaled_plus_transpose():
    A, _ = _matrices()
    x = _input((N,), jnp.float64)
    fn = lambda x: 2 * x + A.T @ x
    assert count_matmuls(lambda x: dl.materialise(fn, x), x) == 0
    assert_tree_allclose(dl.materialise(fn, x), 2 * jnp.eye(N) + A.T, rtol=1e-14)


def test_one_matmul_for_two_linear_maps():
    A, B = _matrices()
    x = _input((N,), jnp.float64)
    fn = lambda x: B @ (A @ x)
    assert count_matmuls(lambda x: dl.materialise(fn, x), x) == 1
    assert_tree_allclose(dl.materialise(fn, x), B @ A, rtol=1e-12)


@pytest.mark.parametrize("mode", ["auto", "forward", "reverse"])
def test_one_matmul_for_nonlinear(mode):
    A, B = _matrices()
    x = _input((N,), jnp.float64)
    fn = lambda x: B @ jnp.tanh(A @ x)
    assert count_matmuls(lambda x: dl.materialise(fn, x, mode=mode), x) == 1
    assert count_matmuls(jax.jacfwd(fn), x) == 2
    assert_tree_allclose(dl.materialise(fn, x, mode=mode), jax.jacfwd(fn)(x), rtol=1e-12)


def test_batched_linear_layer_no_matmul():
    W = _const((3, 4), 44, jnp.float64)
    X = _input((5, 4), jnp.float64)
    fn = lambda X: X @ W.T
    assert count_matmuls(lambda X: dl.materialise(fn, X), X) == 0
    assert_tree_allclose(dl.materialise(fn, X), jax.jacfwd(fn)(X), rtol=1e-14)


# ---- materialise_operator ---------------------------------------------------------------


def test_operator_kinds():
    A, _ = _matrices()
    x = _input((N,), jnp.float64)
    ident = dl.materialise_operator(lambda x: x, x)
    assert isinstance(ident, lx.IdentityLinearOperator)
    for fn in (jnp.sin, lambda x: 3 * x):
        op = dl.materialise_operator(fn, x)
        assert isinstance(op, lx.DiagonalLinearOperator)
        np.testing.assert_allclose(op.as_matrix(), jax.jacfwd(fn)(x), rtol=1e-14)
    op = dl.materialise_operator(lambda x: A @ x, x)
    assert isinstance(op, lx.MatrixLinearOperator)
    np.testing.assert_array_equal(op.as_matrix(), A)
    np.testing.assert_array_equal(ident.as_matrix(), jnp.eye(N))


@pytest.mark.parametrize(
    "fn",
    [jnp.sin, lambda x: x, lambda x: jnp.tanh(x).T @ x, lambda x: jnp.cumsum(x, axis=1)],
    ids=["diagonal", "identity", "dense", "cumsum"],
)
def test_operator_mv_matches_jvp(fn):
    # Matrix-valued inputs: the operator acts on the array as `jax.jvp` does.
    x = _input((3, 3), jnp.float64)
    v = _input((3, 3), jnp.float64, 1)
    op = dl.materialise_operator(fn, x)
    assert op.in_structure() == jax.ShapeDtypeStruct(x.shape, x.dtype)
    np.testing.assert_allclose(op.mv(v), jax.jvp(fn, (x,), (v,))[1], rtol=1e-12, atol=1e-14)


def test_operator_dtype_change():
    x = _input((4,), jnp.float64)
    op = dl.materialise_operator(lambda x: 2 * x.astype(jnp.float32), x)
    assert op.in_structure() == jax.ShapeDtypeStruct((4,), jnp.float64)
    assert op.out_structure() == jax.ShapeDtypeStruct((4,), jnp.float32)


@pytest.mark.parametrize(
    "fn",
    [
        jnp.floor,
        jnp.round,
        jnp.sign,
        jnp.ceil,
        lambda x: (x > 0).astype(x.dtype),
        lambda x: jnp.floor(x)[:2] * jnp.sign(x[1:]),  # not square
    ],
    ids=["floor", "round", "sign", "ceil", "comparison", "nonsquare"],
)
def test_zero_jacobian_operator(fn):
    # A zero Jacobian is a `SparseLinearOperator` with no entries: no numbers stored, and
    # `mv`, `as_matrix`, `transpose` and lineax's queries agree with the zero matrix.
    x = _input((3,), jnp.float64)
    v = _input((3,), jnp.float64, 1)
    op = dl.materialise_operator(fn, x)
    assert isinstance(op, dl.SparseLinearOperator)
    assert sum(leaf.size for leaf in jax.tree_util.tree_leaves(op)) == 0
    expected = jax.jacfwd(fn)(x)
    np.testing.assert_array_equal(op.as_matrix(), expected)
    np.testing.assert_array_equal(op.mv(v), jax.jvp(fn, (x,), (v,))[1])
    assert op.out_structure() == jax.eval_shape(fn, x)
    t = op.transpose()
    assert isinstance(t, dl.SparseLinearOperator) and t.values.size == 0
    np.testing.assert_array_equal(t.as_matrix(), expected.T)
    np.testing.assert_array_equal(t.mv(jnp.ones(expected.shape[0])), jnp.zeros(3))
    if expected.shape[0] == 3:
        np.testing.assert_array_equal(lx.diagonal(op), jnp.zeros(3))
        with pytest.raises(ValueError, match="has no entries"):
            lx.linear_solve(op, v, dl.StructuredLinearSolver())
    assert dl.structure_report(fn, x).kinds[0].startswith("zero: 0 numbers stored")


def test_report_counts_in_words():
    # One number stored is "1 number", not "1 numbers"; the count is the operator's.
    x = _input((4,), jnp.float64)
    (kind,) = dl.structure_report(lambda x: 2.0 * x, x).kinds
    assert kind == "scaled identity: 1 number stored, dense 16", kind
    (kind,) = dl.structure_report(jnp.sin, x).kinds
    assert kind == "diagonal: 4 numbers stored, dense 16", kind


def test_operator_linear_solve():
    A, _ = _matrices()
    A = A + N * jnp.eye(N)
    x = _input((N,), jnp.float64)
    b = _input((N,), jnp.float64, 1)
    fn = lambda x: A @ jnp.sin(x) + x
    op = dl.materialise_operator(fn, x)
    expected = jnp.linalg.solve(jax.jacfwd(fn)(x), b)
    np.testing.assert_allclose(lx.linear_solve(op, b).value, expected, rtol=1e-10)
    diag = dl.materialise_operator(jnp.sin, x)
    expected = jnp.linalg.solve(jax.jacfwd(jnp.sin)(x), b)
    np.testing.assert_allclose(lx.linear_solve(diag, b).value, expected, rtol=1e-10)


def test_operator_pytree():
    x = {"a": _input((2,), jnp.float64), "b": _input((3,), jnp.float64, 1)}
    fn = lambda p: (jnp.sin(p["a"]), p["b"] * p["a"][0])
    op = dl.materialise_operator(fn, x)
    assert isinstance(op, lx.PyTreeLinearOperator)
    assert_tree_allclose(op.pytree, jax.jacfwd(fn)(x), rtol=1e-14)


_CA = jax.lax.complex(_const((6, 6), 46, jnp.float64), _const((6, 6), 47, jnp.float64))


@pytest.mark.parametrize(
    "fn, kind",
    [
        (lambda x: _CA @ x, lx.MatrixLinearOperator),
        (lambda x: -2j * x + x**2, lx.DiagonalLinearOperator),
        (lambda x: jnp.conj(x) * (1 + 2j) + jnp.abs(x) * x, lx.DiagonalLinearOperator),
        (lambda x: (x.reshape(3, 2) @ _CA[:2, :2]).reshape(6) * jnp.exp(x), None),
        (lambda x: jnp.roll(x, 1) - 2 * x + jnp.roll(x, -1) + jnp.sin(x), None),
    ],
    ids=["dense", "diagonal", "not-holomorphic", "block-diagonal", "stencil"],
)
@pytest.mark.standard_promotion  # `jnp.abs(x) * x`: a real array times a complex one
def test_operator_holomorphic(fn, kind):
    # Complex in and out: the matrix `jax.jacfwd(holomorphic=True)` gives (the derivatives
    # along real directions), which is what `lineax.JacobianLinearOperator` materialises.
    x = _input((6,), jnp.complex128) * (1 + 0.5j) + 0.3j
    op = dl.materialise_operator(fn, x, holomorphic=True)
    if kind is not None:
        assert isinstance(op, kind)
    else:
        assert isinstance(op, dl.BlockDiagonalLinearOperator | dl.SparseLinearOperator)
    expected = jax.jacfwd(fn, holomorphic=True)(x)
    np.testing.assert_allclose(op.as_matrix(), expected, rtol=1e-13, atol=1e-15)


def test_complex_input_error_names_existing_options():
    x = jnp.ones(3, jnp.complex128)
    with pytest.raises(TypeError, match="holomorphic=True"):
        dl.materialise_operator(jnp.sin, x)
    with pytest.raises(TypeError, match="real and imaginary parts") as info:
        dl.structure_report(jnp.sin, x)
    assert "holomorphic" not in str(info.value)


@pytest.mark.parametrize(
    "api", [dl.materialise, dl.materialise_operator, dl.jacobian_diagonal, dl.structure_report]
)
def test_concrete_value_error_names_the_fix(api):
    # `segment_max` without `num_segments` reads `max(ids) + 1` as a Python number: fine
    # for `jax.jacfwd` outside `jax.jit`, not inside it, nor inside ours, which traces as
    # `jax.jit` does. JAX's error says where; the note says why here, and the fix.
    ids = np.array([0, 1, 1, 2], np.int32)
    fn = lambda x: jax.ops.segment_max(x, ids)  # noqa: E731
    x = jnp.linspace(0.0, 1.0, 4)
    assert jax.jacfwd(fn)(x).shape == (3, 4)
    with pytest.raises(jax.errors.ConcretizationTypeError) as info:
        api(fn, x)
    note = "".join(getattr(info.value, "__notes__", []))
    assert f"`diffrax_linearize.{api.__name__}` traces `fn` as `jax.jit` does" in note
    assert "pass `num_segments=`" in note
    expected = jax.jacfwd(lambda x: jax.ops.segment_max(x, ids, num_segments=3))(x)
    np.testing.assert_array_equal(
        dl.materialise(lambda x: jax.ops.segment_max(x, ids, num_segments=3), x), expected
    )


# ---- compilation ------------------------------------------------------------------------


def test_no_recompilation_fresh_lambda():
    A = _const((7, 7), 45, jnp.float32)
    x = _input((7,), jnp.float32)
    dl.materialise(lambda x: A @ x, x)
    size = _materialise._run_dense._cache_size()
    for _ in range(3):
        out = dl.materialise(lambda x: A @ x, x)
    assert _materialise._run_dense._cache_size() == size
    np.testing.assert_array_equal(out, A)
    # A different closed-over matrix of the same shape reuses the kernel too.
    A2 = A + 1
    np.testing.assert_array_equal(dl.materialise(lambda x: A2 @ x, x), A2)
    assert _materialise._run_dense._cache_size() == size


def test_different_program_compiles_anew():
    # The counter above can fail: a different program is a new cache entry.
    x = _input((9,), jnp.float32)
    size = _materialise._run_dense._cache_size()
    dl.materialise(lambda x: jnp.cos(x) * x[::-1] + 17.5, x)
    assert _materialise._run_dense._cache_size() == size + 1


def _kernel_text(fn, *args):
    """The HLO text of the kernel an un-jitted `materialise(fn, *args)` compiles."""
    api = "materialise"
    closed, diff, rest, _, _ = _materialise._trace(fn, args, 0, False, api)
    spec = _materialise._Spec(closed.jaxpr, len(diff), "auto", False, structured=False)
    return _materialise._run_dense.lower(spec, list(closed.consts), diff, rest).as_text()


def test_closed_over_array_not_a_constant():
    n = 512
    A = _const((n, n), 46, jnp.float32)
    x = _input((n,), jnp.float32)
    for fn in (lambda x: A @ x, lambda x: jnp.tanh(A @ x) + A[0] * x):
        # An embedded f32[512, 512] constant would be over 1 MB of text.
        assert len(_kernel_text(fn, x)) < 20_000
    # The measurement can fail: a program that does embed `A` is large. (From jax 0.12.1,
    # `jax.jit` no longer embeds closed-over arrays either, and has no such program.)
    if tuple(int(p) for p in jax.__version__.split(".")[:3]) < (0, 12, 1):
        assert len(jax.jit(lambda x: A @ x).lower(x).as_text()) > n * n


# The same program text closing over other constants, at each level of nesting: the kernel
# cached for the first constants must never be reused for the second (a nested `jax.jit`
# keeps its closed-over arrays in its own closed jaxpr, which the jaxpr's text does not show).
def _scale_by(c):
    return lambda z: (c @ jnp.sin(z)) if c.ndim == 2 else c * jnp.sin(z)


_NESTINGS = {
    "plain": lambda g: g,
    "jit": lambda g: jax.jit(g),
    "jit_in_jit": lambda g: jax.jit(lambda z: jax.jit(g)(z) + z),
    "scan": lambda g: (
        lambda z: jax.lax.scan(lambda carry, _: (jax.jit(g)(carry), None), z, None, length=2)[0]
    ),
    "fori_loop": lambda g: lambda z: jax.lax.fori_loop(0, 2, lambda i, w: jax.jit(g)(w), z),
    "while_loop": lambda g: (
        lambda z: jax.lax.while_loop(
            lambda s: s[0] < 2, lambda s: (s[0] + 1, jax.jit(g)(s[1])), (0, z)
        )[1]
    ),
    "cond": lambda g: lambda z: jax.lax.cond(z[0] < 100.0, jax.jit(g), lambda w: w, z),
    "custom_jvp": lambda g: _with_custom_jvp(jax.jit(g)),
    "checkpoint": lambda g: jax.checkpoint(jax.jit(g)),
    "vmap": lambda g: lambda z: jax.vmap(jax.jit(g))(z[None])[0],
}


def _with_custom_jvp(g):
    @jax.custom_jvp
    def h(z):
        return g(z)

    h.defjvp(lambda primals, tangents: jax.jvp(g, primals, tangents))
    return h


# Small constants are keyed by their bytes; past 1 MiB, by their identity.
# The default run: the nestings that each keep constants in another place (a jit's closed
# jaxpr, a loop body, a branch, a custom rule), and the large-constant key; the rest slow.
_DEFAULT_NESTINGS = ("jit", "scan", "cond", "custom_jvp")


@pytest.mark.parametrize(
    "nesting, shape",
    [
        pytest.param(n, (4,), marks=() if n in _DEFAULT_NESTINGS else pytest.mark.slow)
        for n in sorted(_NESTINGS)
    ]
    + [("jit", (400, 400)), pytest.param("scan", (400, 400), marks=pytest.mark.slow)],
)
def test_closed_over_constants_never_stale(nesting, shape):
    wrap = _NESTINGS[nesting]
    y = jnp.linspace(0.1, 0.9, shape[-1])
    for value in (2.0, 3.0):
        c = jnp.full(shape, value)  # a new array each time, of the same shape
        fn = wrap(_scale_by(c))
        expected = jax.jacfwd(fn)(y)
        np.testing.assert_allclose(dl.materialise(fn, y), expected, rtol=1e-14)
        np.testing.assert_allclose(jax.jit(dl.materialise, static_argnums=0)(fn, y), expected)
        op = dl.materialise_operator(fn, y)
        np.testing.assert_allclose(op.as_matrix(), expected, rtol=1e-14)


@pytest.mark.parametrize("nesting", ["jit", pytest.param("scan", marks=pytest.mark.slow), "cond"])
def test_closed_over_indices_never_stale(nesting):
    # Integer constants are read by the structure rules at trace time: a gather's indices.
    wrap = _NESTINGS[nesting]
    y = jnp.linspace(0.1, 0.9, 5)
    for perm in ([4, 3, 2, 1, 0], [1, 2, 3, 4, 0]):
        idx = jnp.array(perm)
        fn = wrap(lambda z: z[idx] * 2.0)
        np.testing.assert_array_equal(dl.materialise(fn, y), jax.jacfwd(fn)(y))
        op = dl.materialise_operator(fn, y)
        np.testing.assert_array_equal(op.as_matrix(), jax.jacfwd(fn)(y))


# Pairwise fields whose self term is masked away (gravity, Coulomb, any N-body model): the
# masked entries' tangents are NaN (0 / 0), and `jax.jacfwd` is finite because a select
# drops them; a product with a zero mask would not.
def _pairwise(mask):
    def field(p):
        d = p[:, None, :] - p[None, :, :]
        r = jnp.sqrt(jnp.sum(d**2, axis=-1, keepdims=True))
        return jnp.sum(mask(d / r**3, p.shape[0]), axis=1)

    return field


_MASKS = {
    "where": lambda q, n: jnp.where(jnp.eye(n, dtype=bool)[..., None], 0.0, q),
    "at_set": lambda q, n: q.at[jnp.arange(n), jnp.arange(n)].set(0.0),
    "select_n": lambda q, n: jax.lax.select_n(
        jnp.broadcast_to(jnp.eye(n, dtype=bool)[..., None], q.shape), q, jnp.zeros_like(q)
    ),
}


@pytest.mark.parametrize(
    "mask", [pytest.param(m, marks=() if m == "where" else pytest.mark.slow) for m in _MASKS]
)
def test_masked_nan_tangents_do_not_leak(mask):
    p = jax.random.normal(jax.random.key(3), (5, 3))
    fn = _pairwise(_MASKS[mask])
    expected = jax.jacfwd(fn)(p)
    assert np.isfinite(expected).all()
    np.testing.assert_allclose(dl.materialise(fn, p), expected, rtol=1e-12, atol=1e-14)
    flat = lambda x: fn(x.reshape(p.shape)).ravel()
    op = dl.materialise_operator(flat, p.ravel())
    np.testing.assert_allclose(op.as_matrix(), expected.reshape(15, 15), rtol=1e-12, atol=1e-14)


_MASK = np.array([True, False, True, False, True])
_REVERSE_MASKED = {
    # `d == 0` off the mask: the division's tangent is infinite there and dropped.
    "division": lambda x: jnp.sum(jnp.where(_MASK, x / np.where(_MASK, 2.0, 0.0), x) ** 2),
    # `sqrt` of negative entries: a NaN factor, dropped.
    "sqrt": lambda x: jax.nn.softplus(jnp.where(x < 0, x, jnp.sqrt(x)))[:3],
}


@pytest.mark.parametrize("name", sorted(_REVERSE_MASKED))
def test_masked_nan_tangents_do_not_leak_in_reverse_mode(name):
    # The transpose of the select gives the dropped entries a zero cotangent, which then
    # meets the NaN or infinite factor that `jax.jacfwd` never multiplies.
    fn = _REVERSE_MASKED[name]
    x = jnp.array([0.3, -0.5, 0.7, -1.1, 1.3])
    expected = jax.jacfwd(fn)(x)
    assert np.isfinite(expected).all()
    assert not np.isfinite(jax.jacrev(fn)(x)).all()  # the test can fail
    for mode in ("reverse", "auto"):
        np.testing.assert_allclose(dl.materialise(fn, x, mode=mode), expected, rtol=1e-14)
        jitted = jax.jit(lambda x: dl.materialise(fn, x, mode=mode))
        np.testing.assert_allclose(jitted(x), expected, rtol=1e-14)


# ---- strict mode --------------------------------------------------------------------------


def _linear_primitive():
    """A linear primitive (doubling) with no structure rule: it takes the dense fallback."""
    from diffrax_linearize._compat import ad, batching, mlir, Primitive

    p = Primitive("double_without_rule")
    p.def_impl(lambda x: 2 * x)
    p.def_abstract_eval(lambda x: x)
    ad.deflinear2(p, lambda t, x: [p.bind(t)])
    mlir.register_lowering(p, mlir.lower_fun(lambda x: 2 * x, multiple_results=False))
    batching.defvectorized(p)
    return p


_DOUBLE = _linear_primitive()


def test_strict():
    A, _ = _matrices()
    x = _input((N,), jnp.float64)
    np.testing.assert_array_equal(dl.materialise(lambda x: A @ x, x, strict=True), A)

    def fn(x):
        return A @ _DOUBLE.bind(jnp.sin(x))

    with pytest.raises(ValueError, match="double_without_rule"):
        dl.materialise(fn, x, strict=True)
    with pytest.raises(ValueError, match="double_without_rule"):
        dl.materialise_operator(fn, x, strict=True)
    assert_tree_allclose(dl.materialise(fn, x), jax.jacfwd(fn)(x), rtol=1e-12)
    with pytest.raises(ValueError, match=r"`double_without_rule` \(1x: no structure rule\)"):
        dl.materialise(fn, x, strict=True)
    report = dl.structure_report(fn, x)
    assert report.densified == {"double_without_rule": 1}
    assert report.reasons == {"double_without_rule": ["no structure rule"]}
    assert "`double_without_rule` (1x: no structure rule)" in str(report)


def test_custom_vjp_in_while_loop():
    # jax.jacrev cannot differentiate a while loop and jax.jacfwd cannot a custom_vjp: the
    # reference is the same loop with the cube written out.
    x = _input((4,), jnp.float64)

    def loop(cube):
        return lambda x: lax.while_loop(
            lambda s: s[0] < 2, lambda s: (s[0] + 1, cube(s[1]) * 0.5), (0, x)
        )[1]

    for mode in ("auto", "forward"):
        out = dl.materialise(loop(_cube), x, mode=mode)
        assert_tree_allclose(out, jax.jacfwd(loop(lambda y: y**3))(x), rtol=1e-12)


def _assert_every_mode(fn, x, expected, *, rtol):
    """`materialise(fn, x)` is `expected` in every mode, and in the automatic one jitted."""
    for mode in ("auto", "forward", "reverse"):
        assert_tree_allclose(dl.materialise(fn, x, mode=mode), expected, rtol=rtol)
    jitted = jax.jit(lambda x: dl.materialise(fn, x))(x)
    assert_tree_allclose(jitted, expected, rtol=rtol)


def test_custom_vjp_with_constants():
    # `odeint` is a `custom_vjp` whose equation takes its Runge-Kutta tableau as leading
    # constants (`num_consts`), which its VJP rule does not cover: differentiating them
    # raised JAX's "differentiation of a custom_vjp function with respect to a closed-over
    # value" in every mode, where `jax.jacrev` works. Found by JAX's ode_test.py under the
    # shadow suite.
    from jax.experimental.ode import odeint

    def solve(y0, ts, a):
        return odeint(lambda y, t, a: -a * y + jnp.sin(t) * y[::-1], y0, ts, a)

    y0, ts, a = _input((2,), jnp.float64), jnp.array([0.0, 0.5, 1.0]), jnp.array(2.0)
    for argnums in (0, (1, 2)):
        expected = jax.jacrev(solve, argnums=argnums)(y0, ts, a)
        for mode in ("auto", "forward", "reverse"):
            out = dl.materialise(solve, y0, ts, a, argnums=argnums, mode=mode)
            assert_tree_allclose(out, expected, rtol=1e-12, atol=1e-14)
    jitted = jax.jit(lambda y0: dl.materialise(solve, y0, ts, a))(y0)
    assert_tree_allclose(jitted, jax.jacrev(solve)(y0, ts, a), rtol=1e-12, atol=1e-14)
    # Times closed over: known at trace time, a NumPy array that the backward rule
    # indexed with a tracer (`TracerArrayConversionError`; JAX's test_closure_nondiff).
    closed = lambda y0: solve(y0, jnp.arange(4.0), a)  # noqa: E731
    out = dl.materialise(closed, y0, mode="forward")
    assert_tree_allclose(out, jax.jacrev(closed)(y0), rtol=1e-12, atol=1e-14)


# Standard promotion: `diffrax.BacksolveAdjoint`'s backward solve multiplies its
# direction, an integer, by a float; its `custom_vjp` equation re-bound from our jaxpr
# passes it as a strongly typed array, which strict promotion refuses.
@pytest.mark.standard_promotion
@pytest.mark.parametrize(
    "adjoint",
    [
        "recursive_checkpoint",  # Diffrax's default
        pytest.param("diffrax_backsolve", marks=pytest.mark.slow),
        pytest.param("ours", marks=pytest.mark.slow),
    ],
)
def test_through_diffeqsolve_adjoints(adjoint):
    # Diffrax's adjoints are `custom_vjp`s whose outputs include integers (the loop's step
    # counter, flags), and `diffrax.BacksolveAdjoint`'s has leading constants: every mode
    # raised (an AssertionError with the default adjoint, a CustomVJPException with
    # `diffrax.BacksolveAdjoint`) where `jax.jacrev` works.
    import diffrax as dfx

    adjoint = {
        "recursive_checkpoint": dfx.RecursiveCheckpointAdjoint(),
        "diffrax_backsolve": dfx.BacksolveAdjoint(),
        "ours": dl.BacksolveAdjoint(),
    }[adjoint]
    A = 0.3 * _const((3, 3), 37, jnp.float64)

    def solve(y0):
        term = dfx.ODETerm(lambda t, y, args: A @ jnp.tanh(y))
        controller = dfx.PIDController(rtol=1e-8, atol=1e-10)
        sol = dfx.diffeqsolve(
            term, dfx.Tsit5(), 0.0, 1.0, 0.1, y0, adjoint=adjoint, stepsize_controller=controller
        )
        return sol.ys[-1]

    y0 = _input((3,), jnp.float64)
    _assert_every_mode(solve, y0, jax.jacrev(solve)(y0), rtol=1e-10)


def test_custom_vjp_closing_over_the_input():
    # Its VJP rule does not cover a value it closes over: a clear error, as JAX's.
    def fn(x):
        @jax.custom_vjp
        def g(y):
            return y * x

        g.defvjp(lambda y: (y * x, None), lambda r, ct: (ct * x,))
        return g(jnp.sin(x))

    with pytest.raises(ValueError, match="closes over"):
        dl.materialise(fn, _input((3,), jnp.float64))


def test_custom_vjp_unread_output():
    # An output that nothing reads is not pulled back: the `bwd` rule gets a symbolic
    # zero for it, as under `jax.jacrev` (JAX's test_symbolic_zero_custom_vjp_vmap_output
    # asserts this inside its rule, and failed under ours).
    cotangents = []

    @jax.custom_vjp
    def f(x, y):
        return 2 * x, 3 * y

    def fwd(x, y):
        return f(x.value, y.value), None

    def bwd(_, g):
        gx, gy = g
        cotangents.append(type(gy))
        if isinstance(gy, jax.custom_derivatives.SymbolicZero):
            gy = jnp.zeros(gy.shape, gy.dtype)
        return 2 * gx, 3 * gy

    f.defvjp(fwd, bwd, symbolic_zeros=True)
    fn = lambda x, y: jax.vmap(f)(x, y)[0] * x  # noqa: E731
    x, y = _input((3,), jnp.float64), _input((3,), jnp.float64, seed=1)
    for mode in ("auto", "forward", "reverse"):
        out = dl.materialise(fn, x, y, mode=mode)
        assert_tree_allclose(out, jax.jacrev(fn)(x, y), rtol=1e-14)
    assert cotangents and set(cotangents) == {jax.custom_derivatives.SymbolicZero}


def test_primitives_without_a_batching_rule():
    # `jax.experimental.sparse`'s COO primitives have no batching rule (`jax.jacfwd`
    # fails), and `bcoo_dot_general`'s refuses a trailing batch axis: the dense fallback
    # vmapped over one, and raised "Batching rule for 'coo_todense' not implemented" or
    # "batch_dims must be None or satisfy 0 < dim < n_batch" in every mode where
    # `jax.jacrev` works (JAX's sparse tests, under the shadow suite).
    from jax.experimental import sparse
    from jax.experimental.sparse import coo

    M = jnp.where(_const((5, 8), 39, jnp.float64) > 0.3, _const((5, 8), 38, jnp.float64), 0.0)
    data, row, col = coo._coo_fromdense(M, nse=int((M != 0).sum()))
    info = coo.COOInfo(shape=M.shape, rows_sorted=True)
    X = sparse.BCOO.fromdense(M)
    y = _input((8,), jnp.float64)
    cases = [
        (lambda d: coo._coo_todense(d, row, col, spinfo=info), data),
        (lambda d: coo._coo_matvec(d, row, col, y, spinfo=info) ** 2, data),
        (lambda d: jnp.sin(sparse.BCOO((d, X.indices), shape=X.shape) @ y), X.data),
        (lambda y: jnp.sin(X @ y) * y[:5], y),
    ]
    # Batch and dense dimensions (JAX's sparse_bcoo_bcsr_test.py): their batching rules
    # raise `ValueError` for a trailing batch axis.
    for shape, n_batch, n_dense in [((3, 4, 5), 2, 0), ((2, 3, 4, 5), 1, 1)]:
        A = jnp.where(_const(shape, 40, jnp.float64) > 0, _const(shape, 41, jnp.float64), 0.0)
        nse = sparse.util._count_stored_elements(A, n_batch=n_batch, n_dense=n_dense)
        to_bcoo = functools.partial(
            sparse.BCOO.fromdense, nse=nse, n_batch=n_batch, n_dense=n_dense
        )
        cases.append((lambda A, to_bcoo=to_bcoo: 2 * to_bcoo(A).todense(), A))
    for fn, x in cases:
        _assert_every_mode(fn, x, jax.jacrev(fn)(x), rtol=1e-13)


def _custom_vmap_sin():
    @jax.custom_batching.custom_vmap
    def f(x):
        return jnp.sin(x)

    @f.def_vmap
    def rule(axis_size, in_batched, xs):
        return jnp.sin(xs), in_batched[0]

    return f


def test_custom_vmap():
    # `custom_vmap` has a custom batching rule only: JAX differentiates its function, but
    # `jax.linearize` (and so `jax.jacrev`) fails on it ("Linearization failed to produce
    # known values"), and did in ours. `sequential_vmap` is one too; there `jax.jacfwd`
    # fails as well (it vmaps a scan over nothing), so its reference is written out.
    f = _custom_vmap_sin()
    g = jax.custom_batching.sequential_vmap(lambda x: jnp.cos(x) * x)
    x = _input((5,), jnp.float64)
    A = _const((5, 5), 36, jnp.float64)
    cases = [
        (f, jax.jacfwd(f)(x)),
        (lambda x: A @ f(A @ x), jax.jacfwd(lambda x: A @ f(A @ x))(x)),
        (lambda x: 2 * g(x) + x, jnp.diag(2 * (jnp.cos(x) - x * jnp.sin(x)) + 1)),
    ]
    for fn, expected in cases:
        for mode in ("auto", "forward", "reverse"):
            assert_tree_allclose(dl.materialise(fn, x, mode=mode), expected, rtol=1e-12)
            jitted = jax.jit(lambda x: dl.materialise(fn, x, mode=mode))(x)
            assert_tree_allclose(jitted, expected, rtol=1e-12)
        operator = dl.materialise_operator(fn, x)
        assert_tree_allclose(operator.as_matrix(), expected, rtol=1e-12)
        assert_tree_allclose(dl.jacobian_diagonal(fn, x), jnp.diagonal(expected), rtol=1e-12)
    assert isinstance(dl.materialise_operator(f, x), lx.DiagonalLinearOperator)
    xs = jnp.stack([x, 2 * x])
    batched = jax.vmap(lambda x: dl.materialise(f, x))(xs)
    assert_tree_allclose(batched, jax.vmap(jax.jacfwd(f))(xs), rtol=1e-12)


def test_while_loop_has_a_rule():
    A, _ = _matrices()
    x = _input((N,), jnp.float64)

    def fn(x):
        return lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, A @ s[1]), (0, x))[1]

    out = dl.materialise(fn, x, strict=True)
    assert_tree_allclose(out, jax.jacfwd(fn)(x), rtol=1e-12)


@pytest.mark.slow
def test_vmap_of_while_loop_with_data_dependent_trip_count():
    """Under `vmap`, a `while` loop whose trip count depends on the data has a batched
    predicate: each lane stops on its own (a carry keeps its value where its lane's
    predicate is false). The structure is kept: diagonal, block-diagonal."""

    def scalar(x):
        return lax.while_loop(lambda c: c[0] < 3.0, lambda c: (c[0] + c[1], 1.5 * c[1]), (x, x))

    def stencil(u):
        def body(c):
            n, u = c
            return n + jnp.sum(u**2), u + 0.1 * (jnp.roll(u, 1) - 2 * u) * jnp.cos(u)

        return lax.while_loop(lambda c: c[0] < 5.0, body, (0.0, u))[1]

    cases = [
        (jax.vmap(scalar), jnp.asarray([0.5, 1.0, 2.0, 4.0], jnp.float32), "diagonal"),
        (jax.vmap(stencil), 0.5 + jnp.abs(_input((4, 5), jnp.float64)), "block-diagonal 4 x 5"),
        (jax.vmap(jax.vmap(stencil)), jnp.abs(_input((2, 2, 5), jnp.float64)), "block-diagonal"),
    ]
    for fn, x, kind in cases:
        tol = _TOL[x.dtype.type]
        assert_tree_allclose(dl.materialise(fn, x, strict=True), jax.jacfwd(fn)(x), **tol)
        assert dl.structure_report(fn, x).kinds[-1].startswith(kind)
    fn, x, _ = cases[1]
    v = _input(x.shape, x.dtype, 1)
    mv = dl.materialise_operator(fn, x).mv(v)
    assert_tree_allclose(mv, jax.jvp(fn, (x,), (v,))[1], **_TOL[jnp.float64])


@pytest.mark.parametrize("which", ["mul", pytest.param("dot", marks=pytest.mark.slow)])
def test_mixed_precision_under_strict_promotion(which):
    """`lax.mul(..., out_dtype=...)` and `dot_general(..., preferred_element_type=...)` of
    float32 values computing in float64, in loops, and their transposes (`jax.grad` of
    them: products of a float32 and a float64 operand) under strict dtype promotion: the
    rules cast explicitly, as the primitives do (a float64 output is `jax.jacfwd`'s
    exactly)."""
    A = _const((3, 3), 40, jnp.float32)

    def mul(x):
        return lax.mul(x, jnp.sin(x), out_dtype=jnp.float64)

    def dot(x):
        dimension_numbers = (((1,), (0,)), ((), ()))
        return lax.dot_general(A, jnp.sin(x), dimension_numbers, preferred_element_type=jnp.float64)

    def in_scan(g):
        return lambda x: lax.scan(lambda c, _: (0.5 * c + g(x), None), jnp.zeros(3), length=2)[0]

    def in_fori(g):
        return lambda x: lax.fori_loop(0, 2, lambda i, c: 0.5 * c + g(x), jnp.zeros(3))

    def in_while(g):
        body = lambda c: (c[0] + 1, 0.5 * c[1] + g(c[2]), c[2])
        return lambda x: lax.while_loop(lambda c: c[0] < 2, body, (0, jnp.zeros(3), x))[1]

    def second(fn):  # `jax.grad` cannot run through `while`
        return jax.grad(lambda x: jnp.sum(fn(x)).astype(jnp.float32))

    x = _input((3,), jnp.float32)
    with jax.numpy_dtype_promotion("strict"):
        for g in {"mul": (mul,), "dot": (dot,)}[which]:
            for fn in (in_scan(g), in_fori(g), in_while(g)):
                np.testing.assert_array_equal(dl.materialise(fn, x), jax.jacfwd(fn)(x))
            for f in (in_scan(g), in_fori(g), second(in_scan(g)), second(in_fori(g))):
                expected = jax.jacfwd(f)(x)
                for mode in ("forward", "reverse"):
                    out = dl.materialise(f, x, mode=mode)
                    assert out.dtype == expected.dtype
                    assert_tree_allclose(out, expected, **_TOL[jnp.float32])


_OUTSIDE_DOMAIN = {
    "arccos": (jnp.arccos, [2.0, 0.5, -3.0, 0.1]),
    "arcsin": (jnp.arcsin, [2.0, 0.5, 0.1, -1.5]),
    "arccosh": (jnp.arccosh, [0.5, 2.0, 1.5, 3.0]),
    "float_power": (lambda x: jnp.float_power(x, 0.5), [-1.0, 2.0, 3.0, -4.0]),
    "logaddexp": (lambda x: jnp.logaddexp(x, x), [-jnp.inf, 1.0, jnp.inf, 0.0]),
}


@pytest.mark.parametrize("name", list(_OUTSIDE_DOMAIN))
def test_nan_derivatives_as_jacfwd(name):
    """Outside a function's domain its derivative is NaN, and `jax.jacfwd`'s whole row is
    NaN (the identity basis times NaN): `materialise` returns that array exactly, for 0-d,
    1-D and 2-D inputs. The operator is for solves: its `mv` is `jax.jvp`, NaN only where
    the derivative is."""
    fn, points = _OUTSIDE_DOMAIN[name]
    x = jnp.asarray(points, jnp.float64)
    for x in (x[0], x, x.reshape(2, 2)):
        expected = jax.jacfwd(fn)(x)
        assert np.isnan(expected).any()
        np.testing.assert_array_equal(dl.materialise(fn, x), expected)
        np.testing.assert_array_equal(dl.materialise(fn, x, mode="reverse"), expected)
        op = dl.materialise_operator(fn, x)
        for v in (jnp.ones_like(x), _input(x.shape, jnp.float64)):
            np.testing.assert_array_equal(op.mv(v), jax.jvp(fn, (x,), (v,))[1])


_CROSS_BLOCK = {
    # A non-finite partial derivative that reaches its row through a product of several
    # blocks: `jax.jacfwd` multiplies it by the zero tangents of the other basis vectors.
    "product-of-inputs": (
        lambda x, y: x * y,
        (jnp.array([jnp.inf, 1.0, 2.0]), jnp.array([0.0, 2.0, jnp.nan])),
        (0, 1),
    ),
    "matrix-with-inf": (
        lambda x: jnp.arange(16.0).reshape(4, 4).at[1, 2].set(jnp.inf) @ x,
        (jnp.ones(4),),
        0,
    ),
    "logsumexp": (jax.nn.logsumexp, (jnp.array([1.0, jnp.inf, 2.0, -jnp.inf]),), 0),
    "scaled-selection": (
        lambda x: (jnp.array([jnp.inf, 1.0, 2.0]) * x)[jnp.array([0, 2])],
        (jnp.array([1.0, 0.0, 3.0]),),
        0,
    ),
    "sum-then-scale": (lambda x: jnp.inf * jnp.sum(x[:2]) + x[2], (jnp.ones(3),), 0),
    # Non-finite partials at entries whose tangent the structure knows to be zero, which
    # `jax.jvp` instantiates (the constant joined by `concatenate`, `pad`, `scatter`): the
    # structure forms nothing there, `jax.jacfwd` forms `0 * inf`.
    "sqrt-of-concatenated-zero": (
        lambda x: jnp.sqrt(jnp.concatenate([x, jnp.zeros(1)])),
        (jnp.array([0.0, 1.0, 2.0]),),
        0,
    ),
    "sum-of-sqrt-of-concatenated-zero": (
        lambda x: jnp.sum(jnp.sqrt(jnp.concatenate([x + 1, jnp.zeros(1)]))),
        (jnp.array([0.0, 1.0, 2.0]),),
        0,
    ),
    "sqrt-of-padded": (lambda x: jnp.sqrt(jnp.pad(x, 1)), (jnp.array([0.0, 1.0, 2.0]),), 0),
    "sqrt-of-scattered": (
        lambda x: jnp.sqrt(jnp.zeros(3).at[0].set(x[0])),
        (jnp.array([0.0, 1.0, 2.0]),),
        0,
    ),
    "scaled-by-inf": (lambda x: jnp.inf * x, (jnp.array([0.0, 1.0, 2.0]),), 0),
    "pytree": (
        lambda p: {"a": p["u"] * p["v"], "b": jnp.sin(p["u"])},
        ({"u": jnp.array([jnp.inf, 1.0]), "v": jnp.array([0.0, 3.0])},),
        0,
    ),
}


@pytest.mark.parametrize("name", list(_CROSS_BLOCK))
def test_nan_pattern_across_blocks_as_jacfwd(name):
    """`jax.jacfwd`'s NaN pattern where the non-finite partial derivative meets the zero
    tangents through a product of blocks (`x * y` at `x = inf, y = 0`; `A @ x` with an
    infinite entry of `A`; `logsumexp` at infinite entries): the rest of its row is NaN,
    in every mode, eager and jitted."""
    fn, args, argnums = _CROSS_BLOCK[name]
    expected = jax.jacfwd(fn, argnums=argnums)(*args)
    if name == "scaled-by-inf":  # the test can fail: XLA drops these NaNs of `jax.jacfwd`
        jitted_jacfwd = jax.jit(jax.jacfwd(fn, argnums=argnums))(*args)
        assert not np.isnan(jitted_jacfwd).any() and np.isnan(expected).any()
    leaves = jax.tree.leaves(expected)
    assert any(np.isnan(e).any() for e in leaves)
    for mode in ("auto", "forward", "reverse"):
        out = dl.materialise(fn, *args, argnums=argnums, mode=mode)
        jitted = jax.jit(lambda *a: dl.materialise(fn, *a, argnums=argnums, mode=mode))(*args)
        for got in (out, jitted):
            assert jax.tree.structure(got) == jax.tree.structure(expected)
            for g, e in zip(jax.tree.leaves(got), leaves):
                np.testing.assert_array_equal(g, e)


_EMPTY = {
    # Empty inputs, outputs, and values between (JAX's linalg tests take QR, SVD and the
    # pseudo-inverse of matrices with no rows or no columns).
    "empty input": (lambda x: jnp.sum(x) * jnp.ones(2), (0,)),
    "empty input and output": (jnp.sin, (0, 3)),
    "empty output": (lambda x: 2 * x[:0], (3,)),
    "empty reshape": (lambda x: (2 * x.reshape(0, 2, 3)).reshape(-1), (0, 6)),
    "empty cumsum": (lambda x: jnp.cumsum(x, axis=1), (3, 0)),
    "sum of an empty slice": (lambda x: x + jnp.sum(x[:0]), (3,)),
    "product with an empty slice": (lambda x: jnp.ones((3, 0)) @ x[:0] + x, (3,)),
    "outer with an empty slice": (lambda x: jnp.outer(x, x[:0]).sum() + x, (3,)),
    "qr with no columns": (lambda x: jnp.linalg.qr(x)[1], (2, 0)),
    "qr with no rows": (lambda x: jnp.linalg.qr(x)[0], (0, 2)),
    "svd with no columns": (lambda x: jnp.linalg.svd(x, compute_uv=False), (2, 0)),
    "pinv with no columns": (jnp.linalg.pinv, (3, 2, 0)),
    "pinv with no rows": (jnp.linalg.pinv, (3, 0, 2)),
}


@pytest.mark.parametrize("name", list(_EMPTY))
def test_empty_arrays_as_jacfwd(name):
    """Values with no entries, as inputs, outputs or on the way: `jax.jacfwd`'s (empty or
    zero) Jacobian in every mode, the operator's matrix and a report, where each of these
    raised before (a reshape with `-1` of an empty array, a pattern over an empty axis)."""
    fn, shape = _EMPTY[name]
    x = jnp.asarray(np.random.RandomState(0).randn(*shape))
    expected = jax.jacfwd(fn)(x)
    for mode in ("auto", "forward", "reverse"):
        assert_jacobian_equal(dl.materialise(fn, x, mode=mode), expected, what=mode)
        jitted = jax.jit(lambda x: dl.materialise(fn, x, mode=mode))(x)  # noqa: B023
        assert_jacobian_equal(jitted, expected, what=f"jit, {mode}")
    matrix = dl.materialise_operator(fn, x).as_matrix()
    assert_jacobian_equal(matrix, expected.reshape(matrix.shape), what="operator")
    assert "output leaf | input leaf" in str(dl.structure_report(fn, x))


def test_division_by_known_zero_warns_not():
    """A division by a count known to be zero when the Jacobian is traced (an all-masked
    row of a `mean` or `var` with `where=`), and by a known zero of the program: the
    Jacobian `jax.jacfwd` gives, NaNs and infinities included, and no NumPy
    `RuntimeWarning` on the way (those divisions are NumPy's, of known values)."""
    x = jnp.array([[jnp.nan, jnp.nan, jnp.nan], [1.0, 2.0, 4.0]])
    mask = jnp.array([[False] * 3, [True] * 3])
    fns = [
        lambda x: jnp.mean(x, axis=1, where=mask),
        lambda x: jnp.var(x, axis=1, where=mask),
        lambda x: jnp.nanmean(x, axis=1),
        lambda x: x / jnp.array([0.0, 1.0, 0.0]),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for fn in fns:
            expected = jax.jacfwd(fn)(x)
            for mode in ("forward", "reverse"):
                assert_jacobian_equal(dl.materialise(fn, x, mode=mode), expected)
            matrix = dl.materialise_operator(fn, x).as_matrix()
            expected = expected.reshape(matrix.shape)
            finite = np.isfinite(expected)  # the operator need not keep jax.jacfwd's NaNs
            assert_jacobian_equal(matrix[finite], expected[finite])


def test_operator_reverse_mode_nan_falls_back_to_forward():
    """A reverse-mode operator whose transposed select forms 0 * inf (NaN) where forward
    mode does not is rebuilt in forward mode: its matrix is `jax.jacfwd`'s, with the
    structure kept."""
    fn = lambda x: jnp.where(x > 0, jnp.sqrt(x), 0.0)[:2] * 3  # noqa: E731
    x = jnp.array([0.0, 1.0, 2.0])
    expected = jax.jacfwd(fn)(x)
    assert np.isfinite(expected).all()
    assert not np.isfinite(jax.jacrev(fn)(x)).all()  # the test can fail
    for mode in ("auto", "reverse"):
        op = dl.materialise_operator(fn, x, mode=mode)
        assert isinstance(op, dl.SparseLinearOperator)
        np.testing.assert_array_equal(op.as_matrix(), expected)
        jitted = jax.jit(lambda x: dl.materialise_operator(fn, x, mode=mode).as_matrix())
        np.testing.assert_array_equal(jitted(x), expected)


@jax.custom_jvp
def _with_constant_tangent(x, c):
    """`x`, whose JVP rule adds `c`'s tangent times infinity: `jax.jvp` instantiates the zero
    tangent of a constant `c`, and adds `0 * inf` (NaN) to every product, as `xlogy`'s rule
    adds `y_dot * x / y` at `x = y = 0`."""
    return x


@_with_constant_tangent.defjvp
def _with_constant_tangent_jvp(primals, tangents):
    (x, _), (x_dot, c_dot) = primals, tangents
    return x, x_dot + c_dot * jnp.inf


_c = jnp.ones(4)
_CONSTANT_TERMS = {
    # (fn, x, the operator's type, rows of jax.jvp that are NaN whatever the vector)
    "xlogy-at-zero": (
        lambda x: jsp.special.xlogy(x, jnp.array([0.0, -1.0, 0.0, 3.0])),
        jnp.array([0.0, 1.0, 2.0, 2.0]),
        lx.DiagonalLinearOperator,
        [0, 1, 2],
    ),
    "identity-plus-nan-term": (
        lambda x: _with_constant_tangent(x, _c),
        jnp.arange(4.0),
        lx.DiagonalLinearOperator,
        [0, 1, 2, 3],
    ),
    "zero-block-plus-nan-term": (
        lambda x: jnp.sqrt(jnp.pad(x[:0], (0, 2))),
        jnp.arange(4.0),
        dl.SparseLinearOperator,
        [0, 1],
    ),
    "sqrt-of-concatenated-zero": (
        lambda x: jnp.sqrt(jnp.concatenate([x, jnp.zeros(2)]))[1:],
        jnp.arange(4.0),
        dl.SparseLinearOperator,
        [3, 4],
    ),
    "pytree": (
        lambda p: {"a": jsp.special.xlog1py(p["u"], jnp.array([-1.0, 2.0])), "b": p["v"]},
        {"u": jnp.array([0.0, 1.0]), "v": jnp.array([1.0, 2.0])},
        lx.PyTreeLinearOperator,
        None,
    ),
}


@pytest.mark.parametrize("name", list(_CONSTANT_TERMS))
def test_operator_mv_as_jvp_with_constant_nan_terms(name):
    """`materialise_operator`'s `mv` is `jax.jvp` where the linearisation adds a NaN
    constant term (a custom JVP rule's instantiated zero tangent times an infinite
    factor, or the zero rows `concatenate` gives a constant, made NaN by `sqrt`'s infinite
    derivative at 0): those rows are NaN whatever the vector, eager and jitted, as
    `jax.jacfwd`'s rows are."""
    fn, x, kind, rows = _CONSTANT_TERMS[name]
    rng = np.random.RandomState(0)
    v = jtu.tree_map(lambda a: jnp.asarray(rng.randn(*np.shape(a))), x)
    _, expected = jax.jvp(fn, (x,), (v,))
    if rows is not None:  # the test can fail: these rows are NaN, the others finite
        assert np.flatnonzero(np.isnan(expected)).tolist() == rows
        assert np.isnan(jax.jacfwd(fn)(x)[np.array(rows)]).all()
    jitted = jax.jit(lambda x, v: dl.materialise_operator(fn, x).mv(v))
    op = dl.materialise_operator(fn, x)
    assert isinstance(op, kind), type(op)
    for got in (op.mv(v), jitted(x, v)):
        assert jax.tree.structure(got) == jax.tree.structure(expected)
        for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            np.testing.assert_array_equal(np.isnan(g), np.isnan(e))
            np.testing.assert_allclose(g, e, rtol=1e-12)


def test_dense_operator_nan_pattern_as_jacfwd():
    """A dense operator with a non-finite entry is `jax.jacfwd`'s matrix: a `jax.vmap`ped
    `jnp.linalg.inv` with one singular lane gave NaN in the other lane's rows too (the op
    catalogue's `inv` outside its domain, under `vmap`), so `mv` was NaN where `jax.jvp`
    is finite."""
    rng = np.random.RandomState(0)
    x = jnp.asarray(np.stack([np.zeros((3, 3)), rng.randn(3, 3) + 3 * np.eye(3)]))
    v = jnp.asarray(rng.randn(2, 3, 3))
    fn = jax.vmap(jnp.linalg.inv)
    expected = jax.jacfwd(fn)(x)
    _, jvp = jax.jvp(fn, (x,), (v,))
    assert np.isnan(jvp[0]).all() and np.isfinite(jvp[1]).all()  # the test can fail
    for op in (
        dl.materialise_operator(fn, x),
        jax.jit(dl.materialise_operator, static_argnums=0)(fn, x),
    ):
        assert isinstance(op, lx.PyTreeLinearOperator)
        np.testing.assert_array_equal(op.as_matrix(), expected.reshape(18, 18))
        np.testing.assert_allclose(op.mv(v), jvp, rtol=1e-12)
        np.testing.assert_array_equal(np.isnan(op.mv(v)), np.isnan(jvp))


def test_nbody_operator_without_jacfwd_branch_has_jacfwds_nan_rows():
    """An N-body field's walk forms a non-finite entry only where `jax.jacfwd` does
    (`Context.nan_faithful`), so its dense operator is built without the branch that
    recomputes `jax.jacfwd`'s matrix (a loop over the basis: most of its compile time),
    which `jnp.linalg.inv` under `jax.vmap` keeps. With two bodies at one place and no
    softening between them, the matrix has `jax.jacfwd`'s NaN rows, no more: a delta made
    dense (`Struct.untie_out`) put an infinite derivative in its column, every row's."""
    soft = np.full((5, 5), 0.01)
    soft[0, 1] = soft[1, 0] = 0.0

    def fn(x):
        p = x.reshape(-1, 3)
        d = p[None, :, :] - p[:, None, :]
        r2 = jnp.sum(d**2, -1) + soft
        return jnp.sum(d * r2[..., None] ** -1.5, axis=1).reshape(-1)

    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.rand(15))
    x = x.at[3:6].set(x[0:3])
    v = jnp.asarray(rng.randn(15))
    expected = jax.jacfwd(fn)(x)
    _, jvp = jax.jvp(fn, (x,), (v,))
    assert np.isnan(expected[:6]).all() and np.isfinite(expected[6:]).all()  # can fail
    jitted = jax.jit(dl.materialise_operator, static_argnums=0)
    for op in (dl.materialise_operator(fn, x), jitted(fn, x)):
        assert isinstance(op, lx.MatrixLinearOperator)
        matrix = op.as_matrix()
        np.testing.assert_array_equal(np.isnan(matrix), np.isnan(expected))
        finite = np.isfinite(expected)
        np.testing.assert_allclose(matrix[finite], expected[finite], rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(np.isnan(op.mv(v)), np.isnan(jvp))
    program = str(jax.make_jaxpr(lambda x: dl.materialise_operator(fn, x))(x))
    assert "nonfinite_fallback" not in program
    y = jnp.asarray(np.stack([np.zeros((3, 3)), rng.randn(3, 3) + 3 * np.eye(3)]))
    inv = jax.vmap(jnp.linalg.inv)
    assert "nonfinite_fallback" in str(jax.make_jaxpr(lambda y: dl.materialise_operator(inv, y))(y))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.astype(jnp.float32),
        lambda x: (2 * jnp.sin(x)).astype(jnp.float32),
        lambda x: (jnp.arange(16.0).reshape(4, 4) @ x).astype(jnp.float32),
    ],
)
def test_dtype_changing_operator_returned_from_jit(fn):
    """A map that changes dtype: the operator can be returned from `jax.jit` (the op
    catalogue's `astype` under `jit` raised: a `lineax.FunctionLinearOperator` holds a
    jaxpr), with `jax.jacfwd`'s matrix and dtype and `jax.jvp`'s products."""
    x = jnp.arange(4.0)
    v = x + 1
    expected = jax.jacfwd(fn)(x)
    for op in (
        dl.materialise_operator(fn, x),
        jax.jit(dl.materialise_operator, static_argnums=0)(fn, x),
    ):
        assert op.in_structure() == jax.ShapeDtypeStruct((4,), jnp.float64)
        assert op.out_structure() == jax.ShapeDtypeStruct((4,), jnp.float32)
        matrix = op.as_matrix()
        assert matrix.dtype == expected.dtype
        np.testing.assert_array_equal(matrix, expected)
        np.testing.assert_array_equal(op.mv(v), jax.jvp(fn, (x,), (v,))[1])


_SRC, _DST = jnp.array([0, 1, 2, 2, 3]), jnp.array([1, 2, 3, 0, 0])


def _graph_laplacian(x):
    flow = x[_SRC] - x[_DST]
    out = jax.ops.segment_sum(-flow, _SRC, num_segments=4)
    return out + jax.ops.segment_sum(flow, _DST, num_segments=4) - x**3


@pytest.mark.parametrize(
    "fn, flagged",
    [
        (lambda x: jnp.tanh(jnp.arange(16.0).reshape(4, 4) @ x) * 2, False),
        (lambda x: jnp.sin(x) / jnp.cos(x), False),
        (lambda x: jnp.cumsum(x[::-1]), False),
        (lambda x: jsp.special.xlogy(x, jnp.arange(4.0)), True),
        # The zeros a constant's tangent is made of are harmless where no product follows:
        # the padding of `jnp.pad`, the case of a `where`, the zeros a `segment_sum` adds
        # into, a product with a finite literal.
        (lambda x: jnp.where(x > 0, x, 1.0), False),
        (lambda x: jnp.concatenate([jnp.ones(1), x]), False),
        (lambda x: jnp.pad(x, 1), False),
        (lambda x: 2.0 * jnp.pad(x, 1), False),
        (lambda x: jnp.where(x > 0, x, 0.0), False),
        (lambda x: jnp.concatenate([jnp.zeros(1), x]), False),
        (lambda x: jax.jit(lambda y: jnp.concatenate([y, jnp.zeros(1)]))(x), False),
        (_graph_laplacian, False),
        # Species stacked after a padded stencil (`jnp.stack` only moves the zeros).
        (lambda x: jnp.stack([2.0 * jnp.pad(x, 1)[2:], x**2], axis=-1), False),
        # ... and not where a product with an unknown or infinite factor follows, also
        # across a `jit` boundary.
        (lambda x: jnp.sqrt(jnp.pad(x, 1)), True),
        (lambda x: jnp.inf * jnp.pad(x, 1), True),
        (lambda x: x[0] * jnp.pad(x, 1), True),
        (lambda x: jnp.sqrt(jax.jit(lambda y: jnp.concatenate([y, jnp.zeros(1)]))(x)), True),
        (lambda x: jnp.sqrt(jnp.zeros(4).at[jnp.array([0, 2])].add(x[:2])), True),
        (lambda x: jnp.sqrt(jnp.stack([jnp.pad(x, 1)[2:], x])), True),
        # Inside a `scan` (its primal inputs are constants of the JVP program): a map over
        # cells adds nothing; a zero term does where a carry starts at a constant and
        # meets an infinite factor, and so does a padding meeting `sqrt` in the body.
        (lambda x: lax.scan(lambda c, s: (c, jnp.sin(s) * s), 0.0, x)[1], False),
        (lambda x: lax.scan(lambda c, s: (c, jnp.sqrt(c) * s), 0.0, x)[1], False),
        (lambda x: lax.scan(lambda c, s: (c + s, jnp.sqrt(c)), 0.0, x)[1], True),
        (lambda x: lax.scan(lambda c, s: (c, jnp.sqrt(jnp.pad(s[None], 1))), 0.0, x)[1], True),
        (lambda x: lax.scan(lambda c, s: (c, jsp.special.xlogy(s, 0.0 * s)), 0.0, x)[1], True),
    ],
)
def test_constant_terms_found_statically(fn, flagged):
    """Which programs' linearisations may hold a constant term (and so get their NaN rows
    checked): none of a product, a quotient or a prefix sum; those with a summand, a
    select's case or a padding that is not zero; and a zero one only where a product
    with a factor that may be infinite follows it, also inside a `jit`."""
    from diffrax_linearize._interpreter import jvp_may_add_constants

    assert jvp_may_add_constants(fn, [jnp.arange(4.0)]) == flagged


# ---- bad input ----------------------------------------------------------------------------


_x = np.ones(3)


@pytest.mark.parametrize(
    "fn, args, kwargs",
    [
        pytest.param(jnp.sin, ("a string",), {}, id="string-leaf"),
        pytest.param(lambda t: t[0] * t[1], ((_x, object()),), {}, id="object-leaf"),
        pytest.param(jnp.sin, (jnp.arange(3),), {}, id="integer-input"),
        pytest.param(jnp.sin, (True,), {}, id="bool-input"),
        pytest.param(jnp.sin, (None,), {}, id="none"),
        pytest.param(jnp.sin, ({},), {}, id="empty-pytree"),
        pytest.param(lambda x: "a string", (_x,), {}, id="string-output"),
        pytest.param(lambda x: (x, object()), (_x,), {}, id="object-output"),
        pytest.param(jnp.sin, (_x,), {"argnums": 1}, id="argnums-out-of-range"),
        pytest.param(jnp.sin, (_x,), {"argnums": (0, -2)}, id="argnums-negative"),
        pytest.param(jnp.sin, (_x,), {"argnums": ()}, id="argnums-empty"),
        pytest.param(jnp.sin, (_x,), {"argnums": "0"}, id="argnums-string"),
        pytest.param(jnp.sin, (_x,), {"argnums": 1.0}, id="argnums-float"),
        pytest.param(jnp.sin, (_x,), {"argnums": None}, id="argnums-none"),
        pytest.param(jnp.sin, (), {}, id="no-arguments"),
        pytest.param(np.ones(3), (_x,), {}, id="not-callable"),
        pytest.param(jnp.sin, (_x,), {"mode": "sideways"}, id="bad-mode"),
    ],
)
@pytest.mark.parametrize("api", ["materialise", "materialise_operator"])
def test_bad_input(api, fn, args, kwargs):
    with pytest.raises((TypeError, ValueError), match=api):
        getattr(dl, api)(fn, *args, **kwargs)


def test_argnums_not_iterable():
    # `argnums=1.0` once failed with "'float' object is not iterable".
    with pytest.raises(TypeError, match=r"`argnums` must be an int or a non-empty tuple"):
        dl.materialise(lambda x, y: x * y, _x, _x, argnums=1.0)


def test_bad_input_is_not_an_internal_error():
    # A clean message, not an exception from deep inside the interpreter.
    with pytest.raises(TypeError, match="integer") as info:
        dl.materialise(jnp.sin, jnp.arange(3))
    assert "`diffrax_linearize.materialise`" in str(info.value)


@pytest.mark.parametrize("promotion", ["standard", "strict"])
def test_mixed_dtypes(promotion):
    # Leaves of two dtypes. `materialise` returns each block in its own dtype, as
    # `jax.jacfwd` does; under strict promotion too, where `jax.jacfwd` itself raises (its
    # basis takes the leaves' common dtype), and so did `materialise` and
    # `jacobian_diagonal`. lineax's operators take one input dtype: `materialise_operator`
    # says so (lineax said "`pytree` does not have a consistent `input_structure`").
    y = (_input((2,), jnp.float32), _input((3,), jnp.float64, 1))

    def fn(y):
        return (jnp.sin(y[0]) * 2, jnp.cos(y[1]) * y[0][0].astype(jnp.float64))

    with jax.numpy_dtype_promotion("standard"):
        expected = jax.jacfwd(fn)(y)
    with jax.numpy_dtype_promotion(promotion):
        with pytest.raises(TypeError, match=r"materialise_operator`: .* float32, float64"):
            dl.materialise_operator(fn, y)
        for mode in ("forward", "reverse"):
            blocks = dl.materialise(fn, y, mode=mode)
            assert jax.tree.map(lambda b: b.dtype, blocks) == jax.tree.map(
                lambda b: b.dtype, expected
            )
            assert_tree_allclose(blocks, expected, rtol=1e-6)
        diagonal = dl.jacobian_diagonal(fn, y)
    for d, block in zip(diagonal, (expected[0][0], expected[1][1])):
        np.testing.assert_allclose(d, jnp.diagonal(block), rtol=1e-6)


@pytest.mark.parametrize(
    "name, fn",
    [
        ("split", lambda x: jnp.split(x, [2])[1] * 2),
        ("tile", lambda x: jnp.tile(jnp.sin(x).reshape(2, 3), (2, 1))),
        (
            "lineax_solve",
            lambda x: lx.linear_solve(lx.MatrixLinearOperator(jnp.eye(6) * 2 + 0.1), x).value,
        ),
        ("cond_traced", lambda x: jax.lax.cond(x[0] > 0, lambda: 2 * x, lambda: jnp.sin(x))),
        (
            "switch_traced",
            lambda x: jax.lax.switch(jnp.int32(x[1] > 0), [lambda: x[::-1], lambda: x**2]),
        ),
    ],
)
@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_structured_without_fallback(name, fn, mode):
    """These have structure rules: `strict=True` must not raise, and values match."""
    for x in (jnp.linspace(-1.0, 2.0, 6), -jnp.linspace(-1.0, 2.0, 6)):
        out = jax.jit(lambda x: dl.materialise(fn, x, mode=mode, strict=True))(x)
        assert_tree_allclose(out, jax.jacfwd(fn)(x))


@pytest.mark.parametrize("lineax_jac, ours", [("fwd", "forward"), ("bwd", "reverse")])
def test_mode_error_names_lineax_spelling(lineax_jac, ours):
    with pytest.raises(ValueError, match=f"`jac='{lineax_jac}'` is `mode='{ours}'`"):
        dl.materialise(lambda x: 2 * x, jnp.ones(3), mode=lineax_jac)
    with pytest.raises(ValueError, match="must be one of"):
        dl.materialise_operator(lambda x: 2 * x, jnp.ones(3), mode="sideways")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.complex128])
def test_contract_of_two_operands_over_the_same_labels(dtype):
    # `ab,ab->a`-like contractions (a product, then a sum) are a product and a
    # matrix-vector product with ones, not a batched `dot_general` (a loop of tiny dots on
    # CPU). Labels in different orders; two kept and two summed.
    from diffrax_linearize._structure import contract

    rng = np.random.default_rng(3)
    sizes = {0: 3, 1: 4, 2: 5, 3: 2}

    def draw(shape):
        x = rng.normal(size=shape)
        if jnp.issubdtype(dtype, jnp.complexfloating):
            x = x + 1j * rng.normal(size=shape)
        return jnp.asarray(x, dtype)

    a = draw((3, 4, 5, 2))  # labels 0 1 2 3
    b = draw((5, 3, 2, 4))  # labels 2 0 3 1

    def fn(a, b):
        return contract([(a, (0, 1, 2, 3)), (b, (2, 0, 3, 1))], (3, 0), sizes)[0]

    got = fn(a, b)
    expected = jnp.einsum("ijkl,kilj->li", a, b)
    assert got.shape == (2, 3) and got.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 1e-12
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol)
    batched = [
        eqn
        for eqn in jax.make_jaxpr(fn)(a, b).jaxpr.eqns
        if eqn.primitive.name == "dot_general" and eqn.params["dimension_numbers"][1][0]
    ]
    assert not batched
