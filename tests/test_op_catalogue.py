"""The op catalogue: `materialise`, `materialise_operator` and `structure_report` against
`jax.jacfwd` for every op of a table, under every wrapper, in float64 and float32.

The table follows the op lists of JAX's own autodiff tests (`lax_autodiff_test.py`'s
`LAX_GRAD_OPS`, `lax_numpy_operators_test.py`'s one-to-one and compound records), in our
own words: each record names a function, the shapes of its floating arguments, a sampler
of points inside its domain, and (where it has one) values outside it, spliced into a few
entries of the input, where `jax.jacfwd` gives NaN or infinity. A case is one record at
one point, in one dtype, under one wrapper, checked through one API; each case is its own
test, so a failing one names exactly what failed, and a known failure is marked
`xfail(strict=True)` in `KNOWN_FAILURES` (a fix that lands turns it into an XPASS, which
fails: remove the marker then).

The default run checks every sixth case of a fixed sample that holds every record once;
`make test-slow` runs the rest of the sample, `make test-sweep` the whole product. `python
tests/test_op_catalogue.py` prints the survey of reports that say "No dense fallback"
while the operator is dense.
"""

import fnmatch
import functools
from collections.abc import Callable
from typing import NamedTuple

import diffrax_linearize as dl
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.scipy as jsp
import lineax as lx
import numpy as np
import pytest
from helpers import assert_jacobian_equal


jax.config.update("jax_enable_x64", True)  # as conftest.py, for the survey run as a script


# ---- samplers: (rng, shape) -> float64 NumPy array -------------------------------------


def normal(rng, shape):
    return rng.randn(*shape)


def positive(rng, shape):
    return 0.5 + np.abs(rng.randn(*shape))


def unit(rng, shape):  # inside (-1, 1), away from the ends
    return rng.uniform(-0.9, 0.9, shape)


def above_one(rng, shape):
    return 1.2 + np.abs(rng.randn(*shape))


def nonzero(rng, shape):
    return np.where(rng.rand(*shape) < 0.5, -1, 1) * positive(rng, shape)


def off_integers(rng, shape):  # away from the jumps of floor, round, remainder, ...
    return np.round(3 * rng.randn(*shape)) + rng.uniform(0.1, 0.4, shape)


def distinct(rng, shape):  # no ties: sort, max, top_k have one answer
    n = int(np.prod(shape))
    return (rng.permutation(n) + rng.uniform(0.1, 0.5, n)).reshape(shape) / max(n, 1)


def spd(rng, shape):  # symmetric positive definite
    a = rng.randn(*shape)
    return a @ a.T / shape[0] + np.eye(shape[0])


def well_conditioned(rng, shape):
    return rng.randn(*shape) / np.sqrt(shape[0]) + 2 * np.eye(*shape)


# ---- the table --------------------------------------------------------------------------


class Op(NamedTuple):
    """One record: `fn(*floats, *ints)` with `floats` drawn by `domain` at `shapes`;
    `outside`, where given, is one list of values per floating argument, spliced into
    entries 0, 2, 4, ... of that argument (`None` keeps the sampled value) for the point
    outside the domain; `ints` are integer arguments (traced indices), not differentiated;
    `exact` says the Jacobian is zeros and ones, so it must be equal bit for bit;
    `linear_jvp=False` that `jax.jvp` is not linear in the tangent (`reduce_precision`
    rounds it), so an operator's `mv` is checked against `jax.jacfwd`'s matrix instead,
    and `mode="reverse"` against `jax.jacrev`."""

    name: str
    fn: Callable
    shapes: tuple
    domain: Callable | tuple = normal
    outside: tuple | None = None
    ints: tuple = ()
    exact: bool = False
    linear_jvp: bool = True


S = (2, 3)  # elementwise ops
V = (5,)
M = (3, 3)
inf, nan = np.inf, np.nan


def unary(name, fn, domain=normal, outside=None, exact=False):
    return Op(name, fn, (S,), domain, None if outside is None else (outside,), exact=exact)


def binary(name, fn, domain=normal, outside=None, shapes=(S, S)):
    return Op(name, fn, shapes, domain, outside)


def _first(fn):  # the first output of a function returning several
    return lambda *a: fn(*a)[0]


RECORDS = [
    # -- unary elementwise
    unary("neg", jnp.negative, exact=True),
    unary("positive", jnp.positive, exact=True),
    unary("abs", jnp.abs, nonzero, [0.0, inf, -inf], exact=True),
    unary("sign", jnp.sign, nonzero, [0.0, inf]),
    unary("floor", jnp.floor, off_integers, [1.0, inf]),
    unary("ceil", jnp.ceil, off_integers, [1.0]),
    unary("round", jnp.round, off_integers, [0.5, 1.5]),
    unary("rint", jnp.rint, off_integers),
    unary("trunc", jnp.trunc, off_integers, [-1.0]),
    unary("exp", jnp.exp, normal, [inf, -inf, 800.0]),
    unary("exp2", jnp.exp2, normal, [inf, 2000.0]),
    unary("expm1", jnp.expm1, normal, [inf, -inf]),
    unary("log", jnp.log, positive, [0.0, -1.0, inf]),
    unary("log2", jnp.log2, positive, [0.0, -1.0]),
    unary("log10", jnp.log10, positive, [0.0, -2.0]),
    unary("log1p", jnp.log1p, positive, [-1.0, -2.0]),
    unary("sqrt", jnp.sqrt, positive, [0.0, -1.0, inf]),
    unary("rsqrt", lax.rsqrt, positive, [0.0, -1.0]),
    unary("cbrt", jnp.cbrt, nonzero, [0.0]),
    unary("square", jnp.square, normal, [inf, nan]),
    unary("reciprocal", jnp.reciprocal, nonzero, [0.0, inf]),
    unary("integer_pow3", lambda x: lax.integer_pow(x, 3), normal, [inf]),
    unary("integer_pow-2", lambda x: lax.integer_pow(x, -2), nonzero, [0.0]),
    unary("pow2.5", lambda x: x**2.5, positive, [0.0, -1.0]),
    unary("sin", jnp.sin, normal, [inf]),
    unary("cos", jnp.cos, normal, [inf]),
    unary("tan", jnp.tan, unit, [inf]),
    unary("arcsin", jnp.arcsin, unit, [1.0, -1.0, 1.5]),
    unary("arccos", jnp.arccos, unit, [1.0, -1.0, 2.0]),
    unary("arctan", jnp.arctan, normal, [inf, -inf]),
    unary("sinh", jnp.sinh, normal, [inf, 800.0]),
    unary("cosh", jnp.cosh, normal, [inf]),
    unary("tanh", jnp.tanh, normal, [inf, -inf, 30.0]),
    unary("arcsinh", jnp.arcsinh, normal, [inf, 1e200]),
    unary("arccosh", jnp.arccosh, above_one, [1.0, 0.5, inf]),
    unary("arctanh", jnp.arctanh, unit, [1.0, -1.0, 2.0]),
    unary("deg2rad", jnp.deg2rad),
    unary("rad2deg", jnp.rad2deg),
    unary("sinc", jnp.sinc, nonzero, [0.0, inf]),
    unary("logistic", lax.logistic, normal, [inf, -inf, 800.0]),
    unary("log_sigmoid", jax.nn.log_sigmoid, normal, [inf, -inf]),
    unary("softplus", jax.nn.softplus, normal, [inf, -inf]),
    unary("relu", jax.nn.relu, nonzero, [0.0, inf]),
    unary("gelu", jax.nn.gelu, normal, [inf, -inf]),
    unary("erf", jsp.special.erf, normal, [inf, 30.0]),
    unary("erfc", jsp.special.erfc, normal, [inf, -inf]),
    unary("erfinv", jsp.special.erfinv, unit, [1.0, -1.0, 2.0]),
    unary("ndtri", jsp.special.ndtri, lambda r, s: r.uniform(0.1, 0.9, s), [0.0, 1.0, 2.0]),
    unary("ndtr", jsp.special.ndtr, normal, [inf, -inf]),
    unary("lgamma", jsp.special.gammaln, positive, [0.0, -1.0, -2.5]),
    unary("digamma", jsp.special.digamma, positive, [0.0, -1.0]),
    unary("i0e", jsp.special.i0e, normal, [inf]),
    unary("i1e", jsp.special.i1e, normal, [inf]),
    unary("logit", jsp.special.logit, lambda r, s: r.uniform(0.1, 0.9, s), [0.0, 1.0, 2.0]),
    unary("entr", jsp.special.entr, positive, [0.0, -1.0]),
    unary("clip", lambda x: jnp.clip(x, -0.5, 0.5), off_integers, [0.5, -0.5, inf]),
    unary("nan_to_num", jnp.nan_to_num, normal, [nan, inf, -inf]),
    unary("where_positive", lambda x: jnp.where(x > 0, jnp.log(x), x), nonzero, [0.0]),
    unary("where_masked_nan", lambda x: jnp.where(x > 0, jnp.sqrt(x), 0.0), nonzero, [-1.0]),
    unary("select_n", lambda x: lax.select_n(x > 0, -x, jnp.sin(x)), nonzero),
    unary("stop_gradient", lambda x: x * lax.stop_gradient(x)),
    unary("astype_f32", lambda x: jnp.sin(x).astype(jnp.float32)),
    unary("reduce_precision", lambda x: lax.reduce_precision(x, 5, 10) * x)._replace(
        linear_jvp=False
    ),
    # -- binary elementwise
    binary("add", jnp.add, outside=([inf, inf], [-inf, 1.0])),
    binary("sub", jnp.subtract),
    binary("mul", jnp.multiply, outside=([inf, 0.0], [0.0, inf])),
    binary("div", jnp.divide, (normal, nonzero), ([1.0, 0.0, inf], [0.0, 0.0, inf])),
    binary("floor_divide", jnp.floor_divide, (off_integers, nonzero), ([1.0], [0.0])),
    binary("power", jnp.power, (positive, normal), ([0.0, -1.0, 0.0], [2.0, 0.5, -1.0])),
    binary("float_power", jnp.float_power, (positive, normal), ([0.0, -1.0], [0.5, 2.0])),
    binary("arctan2", jnp.arctan2, (normal, nonzero), ([0.0, inf], [0.0, inf])),
    binary("hypot", jnp.hypot, (nonzero, nonzero), ([0.0, inf], [0.0, 1.0])),
    binary("remainder", jnp.remainder, (off_integers, nonzero), ([1.0, 2.0], [0.0, 1.0])),
    binary("mod", jnp.mod, (off_integers, nonzero), ([inf], [2.0])),
    binary("fmod", jnp.fmod, (off_integers, nonzero), ([1.0], [0.0])),
    binary("maximum", jnp.maximum, outside=([1.0, nan], [1.0, 2.0])),
    binary("minimum", jnp.minimum, outside=([1.0, nan], [1.0, 2.0])),
    binary("fmax", jnp.fmax, outside=([1.0, nan], [1.0, 2.0])),
    binary("fmin", jnp.fmin, outside=([1.0], [1.0])),
    binary("copysign", jnp.copysign, (normal, nonzero), ([1.0, 0.0], [0.0, -0.0])),
    binary("heaviside", jnp.heaviside, (nonzero, normal), ([0.0], [0.5])),
    binary("logaddexp", jnp.logaddexp, outside=([-inf, inf, inf], [-inf, inf, 1.0])),
    binary("logaddexp2", jnp.logaddexp2, outside=([-inf, inf], [-inf, inf])),
    binary("xlogy", jsp.special.xlogy, (normal, positive), ([0.0, 1.0], [0.0, -1.0])),
    binary("xlog1py", jsp.special.xlog1py, (normal, positive), ([0.0, 1.0], [-1.0, -2.0])),
    binary("where", lambda x, y: jnp.where(x > 0, x, y), (nonzero, normal)),
    binary("add_broadcast_row", jnp.add, shapes=(S, (3,))),
    binary("mul_broadcast_scalar", jnp.multiply, shapes=(S, ())),
    binary("div_broadcast_col", jnp.divide, (normal, nonzero), shapes=(S, (2, 1))),
    Op("clip_arrays", lambda x, lo, hi: jnp.clip(x, lo, hi - 0.0), (S, S, S), normal),
    # -- reductions and cumulative ops
    Op("sum", jnp.sum, (S,)),
    Op("sum_axis0", lambda x: jnp.sum(x, axis=0), (S,), exact=True),
    Op("mean_keepdims", lambda x: jnp.mean(x, axis=1, keepdims=True), (S,)),
    Op("prod", jnp.prod, (S,), nonzero, ([0.0],)),
    Op("prod_two_zeros", lambda x: jnp.prod(x, axis=1), (S,), nonzero, ([0.0, 0.0],)),
    Op("max", jnp.max, (S,), distinct, ([9.0, 9.0],)),
    Op("min_axis1", lambda x: jnp.min(x, axis=1), (S,), distinct, ([-9.0, -9.0],)),
    Op("argmax_take", lambda x: x[jnp.argmax(x)], (V,), distinct, exact=True),
    Op("var", jnp.var, (S,)),
    Op("std", jnp.std, (V,), normal, ([1.0, 1.0, 1.0],)),
    Op("norm", jnp.linalg.norm, (V,), normal, ([0.0, 0.0, 0.0],)),
    Op("logsumexp", jsp.special.logsumexp, (S,), normal, ([-inf, inf],)),
    Op("softmax", jax.nn.softmax, (V,), normal, ([-inf, 800.0],)),
    Op("cumsum", lambda x: jnp.cumsum(x, axis=1), (S,), exact=True),
    Op("cumsum_reverse", lambda x: lax.cumsum(x, axis=0, reverse=True), (S,), exact=True),
    Op("cumprod", lambda x: jnp.cumprod(x, axis=1), (S,), nonzero, ([0.0],)),
    Op("cummax", lambda x: lax.cummax(x, axis=0), (V,), distinct, ([2.0, 2.0],)),
    Op("cummin", lambda x: lax.cummin(x, axis=0, reverse=True), (V,), distinct),
    Op("cumlogsumexp", lambda x: lax.cumlogsumexp(x, axis=0), (V,), normal, ([-inf],)),
    Op(
        "reduce_window_max",
        lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (2, 2), (1, 1), "VALID"),
        ((3, 4),),
        distinct,
    ),
    Op(
        "reduce_window_sum",
        lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 2), (1, 2), "SAME"),
        ((3, 4),),
        exact=True,
    ),
    # -- shape ops
    Op("reshape", lambda x: x.reshape(3, 2), (S,), exact=True),
    Op("transpose", jnp.transpose, ((2, 3, 2),), exact=True),
    Op("swapaxes", lambda x: jnp.swapaxes(x, 0, 2), ((2, 1, 3),), exact=True),
    Op("expand_squeeze", lambda x: jnp.squeeze(x[:, None], 0), ((1, 3),), exact=True),
    Op("broadcast_to", lambda x: jnp.broadcast_to(x, (2, 4, 3)), ((4, 1),), exact=True),
    Op("concatenate", lambda x, y: jnp.concatenate([x, y, x], 0), (S, (1, 3)), exact=True),
    Op("stack", lambda x, y: jnp.stack([y, x], 1), (V, V), exact=True),
    Op("slice", lambda x: x[1:, ::2], ((3, 5),), exact=True),
    Op("slice_negative_stride", lambda x: x[::-2], ((5,),), exact=True),
    Op("rev", lambda x: lax.rev(x, (0, 1)), (S,), exact=True),
    Op("flip", lambda x: jnp.flip(x, 1), (S,), exact=True),
    Op("roll", lambda x: jnp.roll(x, 2, axis=1), ((2, 4),), exact=True),
    Op("rot90", jnp.rot90, (S,), exact=True),
    Op("tril", jnp.tril, (M,), exact=True),
    Op("triu_k1", lambda x: jnp.triu(x, 1), ((3, 4),), exact=True),
    Op("diagonal", jnp.diagonal, ((3, 4),), exact=True),
    Op("diagonal_offset", lambda x: jnp.diagonal(x, -1), (M,), exact=True),
    Op("trace", jnp.trace, (M,), exact=True),
    Op("diag_vector", jnp.diag, (V,), exact=True),
    Op("repeat", lambda x: jnp.repeat(x, 2, axis=0), (S,), exact=True),
    Op("tile", lambda x: jnp.tile(x, (2, 1)), (S,), exact=True),
    Op(
        "lax_pad",
        # `lax` converts a Python float to float64 under x64, and `lax.pad` wants the operand's
        # dtype: the padding value is cast, as a float32 program must.
        lambda x: lax.pad(x, jnp.array(0.5, x.dtype), [(1, -1, 1), (-1, 2, 0)]),
        (S,),
        exact=True,
    ),
    Op("lax_pad_traced_value", lambda x, v: lax.pad(x, v, [(1, 0, 1)]), (V, ()), exact=True),
    *[
        Op(f"pad_{m}", functools.partial(jnp.pad, pad_width=((1, 2), (2, 1)), mode=m), (S,))
        for m in ("constant", "edge", "reflect", "symmetric", "wrap", "maximum", "minimum")
    ],
    Op("pad_linear_ramp", lambda x: jnp.pad(x, 2, mode="linear_ramp", end_values=1.0), (S,)),
    Op("pad_mean", lambda x: jnp.pad(x, 1, mode="mean"), (S,)),
    Op("pad_empty", lambda x: jnp.pad(x, 1, mode="empty") * 0 + jnp.pad(x, 1), (V,)),
    Op("dynamic_slice", lambda x, i: lax.dynamic_slice(x, (i, i * 0 + 1), (2, 2)), (M,), ints=(1,)),
    Op(
        "dynamic_slice_clamped",
        lambda x, i: lax.dynamic_slice_in_dim(x, i, 3),
        (V,),
        ints=(4,),
        exact=True,
    ),
    Op(
        "dynamic_update_slice",
        lambda x, u, i: lax.dynamic_update_slice(x, u, (i, i * 0)),  # int32, as `lax` wants
        (M, (1, 3)),
        ints=(2,),
        exact=True,
    ),
    Op(
        "dynamic_update_slice_empty",
        lambda x, i: lax.dynamic_update_slice(x, jnp.zeros((0,), x.dtype), (i,)),
        (V,),
        ints=(1,),
        exact=True,
    ),
    Op("take", lambda x: jnp.take(x, np.array([2, 0, 2]), axis=1), (S,), exact=True),
    Op("take_traced", lambda x, i: jnp.take(x, i, axis=0), (V,), ints=([4, 0, 4],), exact=True),
    Op(
        "take_along_axis",
        lambda x: jnp.take_along_axis(x, np.array([[2, 0], [1, 1]]), axis=1),
        (S,),
        exact=True,
    ),
    Op("fancy_index", lambda x: x[np.array([1, 0, 1]), np.array([0, 2, 2])], (S,), exact=True),
    Op("at_get_oob", lambda x: x.at[np.array([0, 7])].get(mode="fill", fill_value=0), (V,)),
    Op("at_set", lambda x, u: x.at[np.array([3, 0])].set(u), (V, (2,)), exact=True),
    Op("at_set_zero", lambda x: x.at[1].set(0.0), (V,), exact=True),
    Op("at_add_repeated", lambda x, u: x.at[np.array([1, 1, 4])].add(u), (V, (3,)), exact=True),
    Op("at_mul", lambda x, u: x.at[np.array([2, 0])].mul(u, unique_indices=True), (V, (2,))),
    Op("at_min", lambda x, u: x.at[np.array([2, 0])].min(u), (V, (2,)), distinct),
    Op("at_max", lambda x, u: x.at[np.array([2, 0])].max(u), (V, (2,)), distinct),
    Op("at_set_traced_index", lambda x, i: x.at[i].set(2 * x[0]), (V,), ints=(3,)),
    Op("sort", jnp.sort, (S,), distinct),
    Op("sort_axis0", lambda x: jnp.sort(x, axis=0), (S,), distinct, exact=True),
    Op("argsort_take", lambda x: x[jnp.argsort(x)], (V,), distinct, exact=True),
    Op("lax_sort_two", lambda x, y: lax.sort((x, y), num_keys=1)[1], (V, V), distinct),
    Op("top_k", lambda x: lax.top_k(x, 3)[0], (V,), distinct, exact=True),
    # -- products, contractions and convolutions
    Op("dot", jnp.dot, (V, V)),
    Op("matmul", jnp.matmul, ((2, 3), (3, 4))),
    Op("matvec", jnp.matmul, (M, (3,))),
    Op("batched_matmul", jnp.matmul, ((2, 2, 3), (2, 3, 2))),
    Op("outer", jnp.outer, ((3,), (2,))),
    Op("kron", jnp.kron, ((2, 2), (2, 1))),
    Op("einsum_ij_jk", lambda a, b: jnp.einsum("ij,jk->ik", a, b), ((2, 3), (3, 2))),
    Op("einsum_trace", lambda a: jnp.einsum("ii->", a), (M,), exact=True),
    Op("einsum_bij_bj", lambda a, b: jnp.einsum("bij,bj->bi", a, b), ((2, 2, 3), (2, 3))),
    Op("tensordot", lambda a, b: jnp.tensordot(a, b, 2), ((2, 3, 2), (3, 2))),
    Op("convolve_full", lambda x, k: jnp.convolve(x, k), ((6,), (3,))),
    Op("correlate_valid", lambda x, k: jnp.correlate(x, k, "valid"), ((6,), (3,))),
    Op(
        "conv_general_dilated",
        lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME", rhs_dilation=(1, 2)),
        ((1, 2, 4, 4), (3, 2, 2, 2)),
    ),
    Op(
        "conv_strided_grouped",
        lambda x, k: lax.conv_general_dilated(
            x, k, (2,), [(1, 0)], dimension_numbers=("NCH", "OIH", "NCH"), feature_group_count=2
        ),
        ((1, 2, 6), (4, 1, 3)),
    ),
    Op(
        "conv_transpose",
        lambda x, k: lax.conv_transpose(
            x, k, (2,), "SAME", dimension_numbers=("NHC", "HIO", "NHC")
        ),
        ((1, 4, 2), (3, 2, 1)),
    ),
    # -- linear algebra
    Op("inv", jnp.linalg.inv, (M,), well_conditioned, ([0.0] * 5,)),
    Op("solve", jnp.linalg.solve, (M, (3,)), (well_conditioned, normal)),
    Op("det", jnp.linalg.det, (M,), well_conditioned, ([0.0] * 5,)),
    Op("slogdet", lambda a: jnp.linalg.slogdet(a)[1], (M,), well_conditioned, ([0.0] * 5,)),
    Op("cholesky", jnp.linalg.cholesky, (M,), spd, ([-1.0],)),
    Op("eigh_values", lambda a: jnp.linalg.eigvalsh(a + a.T), (M,)),
    Op(
        "eigh_vectors_abs",
        lambda a: jnp.abs(jnp.linalg.eigh(a + a.T)[1]),
        (M,),
        normal,
        ([1.0, 0.0, 1.0, 0.0, 1.0],),  # a + a.T = 2 I: repeated eigenvalues
    ),
    Op("qr_r", lambda a: jnp.linalg.qr(a)[1], (M,), well_conditioned),
    Op("svd_values", lambda a: jnp.linalg.svd(a, compute_uv=False), ((3, 2),)),
    Op("expm", jsp.linalg.expm, (M,), lambda r, s: 0.5 * r.randn(*s)),
    Op(
        "solve_triangular",
        lambda a, b: jsp.linalg.solve_triangular(a, b, lower=True),
        (M, (3, 2)),
        (well_conditioned, normal),
    ),
    Op("matrix_power", lambda a: jnp.linalg.matrix_power(a, 3), (M,)),
    Op("pinv", jnp.linalg.pinv, ((3, 2),), well_conditioned),
    # -- control flow inside the op
    Op(
        "while_loop",
        lambda x: lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.sin(c[1])), (0, x))[
            1
        ],
        (V,),
    ),
    Op(
        "fori_loop_scan",
        lambda x: lax.fori_loop(0, 3, lambda i, c: c * x + i, jnp.ones_like(x)),
        (V,),
    ),
    Op("custom_jvp_relu6", jax.nn.relu6, (S,), nonzero, ([0.0, 6.0],)),
]


# ---- wrappers: fn -> fn' with args -> args' ---------------------------------------------


def _stack_args(args, more):
    return [np.stack([a, b]) for a, b in zip(args, more)]


def _scan_one_step(fn):
    def wrapped(*args):
        _, out = lax.scan(lambda c, xs: (c, fn(*xs)), None, tuple(a[None] for a in args))
        return jax.tree.map(lambda o: o[0], out)

    return wrapped


def _in_cond(fn):
    def wrapped(*args):
        a = jnp.asarray(args[0])
        pred = jnp.all(a == a) | jnp.any(a != a)  # always true, but known only at run time
        shapes = jax.eval_shape(fn, *args)
        other = lambda *_: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        return lax.cond(pred, fn, other, *args)

    return wrapped


WRAPPERS = {
    # name: (fn -> fn, outer: call -> call, batched)
    "eager": (lambda f: f, None, False),
    "reverse": (lambda f: f, None, False),  # mode="reverse"
    "jit": (lambda f: f, jax.jit, False),  # jax.jit(dl.materialise(...))
    "nested_jit": (jax.jit, None, False),
    "scan": (_scan_one_step, None, False),
    "cond": (_in_cond, None, False),
    "vmap": (jax.vmap, None, True),
    "checkpoint": (jax.checkpoint, None, False),
}
DTYPES = {"f64": np.float64, "f32": np.float32}
APIS = ("materialise", "operator", "report")


def _splice(x, values):
    x = x.copy()
    flat = x.reshape(-1)
    for k, v in enumerate(values):
        if v is not None and 2 * k < flat.size:
            flat[2 * k] = v
    return x


def _domain(op, k):
    return op.domain[k] if isinstance(op.domain, tuple) else op.domain


def _sample(op, point, seed):
    rng = np.random.RandomState(seed)
    floats = [_domain(op, k)(rng, shape) for k, shape in enumerate(op.shapes)]
    if point == "outside":
        floats = [_splice(x, vals) for x, vals in zip(floats, op.outside)]
    return floats


class Case(NamedTuple):
    op: Op
    point: str  # "inside" or "outside"
    dtype: str
    wrapper: str
    api: str

    @property
    def id(self):
        return f"{self.op.name}-{self.point}-{self.dtype}-{self.wrapper}-{self.api}"

    def build(self):
        """`(fn, args, argnums, mode)` to give `materialise` and `jax.jacfwd`."""
        op, dtype = self.op, DTYPES[self.dtype]
        wrap, _, batched = WRAPPERS[self.wrapper]
        seed = sum(map(ord, op.name))  # a fixed point per record, not per dtype
        floats = _sample(op, self.point, seed)
        ints = [np.asarray(i, np.int32) for i in op.ints]
        if batched:
            floats = _stack_args(floats, _sample(op, "inside", seed + 1))
            ints = _stack_args(ints, ints)
        args = [jnp.asarray(x, dtype) for x in floats] + [jnp.asarray(i) for i in ints]
        argnums = 0 if len(op.shapes) == 1 else tuple(range(len(op.shapes)))
        mode = "reverse" if self.wrapper == "reverse" else "auto"
        return wrap(op.fn), args, argnums, mode


# The APIs under each wrapper: `materialise` under all of them; the operator and the report,
# which share `materialise`'s walk, under those that change what the walk sees.
API_WRAPPERS = {
    "materialise": tuple(WRAPPERS),
    "operator": ("eager", "jit", "scan", "vmap"),
    "report": ("eager", "scan", "cond", "vmap"),
}


def all_cases():
    cases = []
    for op in RECORDS:
        points = ("inside", "outside") if op.outside is not None else ("inside",)
        for point in points:
            for dtype in DTYPES:
                for api, wrappers in API_WRAPPERS.items():
                    for wrapper in wrappers:
                        cases.append(Case(op, point, dtype, wrapper, api))
    return cases


# ---- known failures of the current engine (issue 27) ------------------------------------
# (op, point, dtype, wrapper, api) as fnmatch patterns, and the reason. Each matching case
# is `xfail(strict=True)`: a fix turns it into an XPASS, which fails; then remove the line.

KNOWN_FAILURES: list[tuple[tuple[str, str, str, str, str], str]] = []


def _marks(case):
    key = (case.op.name, case.point, case.dtype, case.wrapper, case.api)
    for pattern, reason in KNOWN_FAILURES:
        if all(fnmatch.fnmatchcase(k, p) for k, p in zip(key, pattern)):
            return [pytest.mark.xfail(strict=True, reason=f"issue 27: {reason}")]
    return []


def _params(cases):
    return [pytest.param(c, id=c.id, marks=_marks(c)) for c in cases]


def default_sample():
    """Every record once in the default run, in a seeded choice of point (the one outside
    the domain half the time, where the record has one), dtype, API and wrapper."""
    rng = np.random.RandomState(27)
    sample = []
    for op in RECORDS:
        point = "outside" if op.outside is not None and rng.rand() < 0.5 else "inside"
        api = APIS[rng.choice(3, p=[0.6, 0.25, 0.15])]
        wrapper = API_WRAPPERS[api][rng.randint(len(API_WRAPPERS[api]))]
        sample.append(Case(op, point, list(DTYPES)[rng.randint(2)], wrapper, api))
    return sample


# ---- the checks ---------------------------------------------------------------------------


def _call(case, api_fn):
    fn, args, argnums, mode = case.build()
    outer = WRAPPERS[case.wrapper][1]
    call = lambda *a: api_fn(fn, *a, argnums=argnums, mode=mode)
    return (outer(call) if outer is not None else call)(*args)


def _first_argnum(argnums):
    return 0 if isinstance(argnums, int) else argnums[0]


def _operator(fn, *args, argnums, mode):
    return dl.materialise_operator(fn, *args, argnums=_first_argnum(argnums), mode=mode)


def check(case: Case):
    fn, args, argnums, mode = case.build()
    exact = case.op.exact
    if case.api == "materialise":
        # Where `jax.jvp` is not linear (it rounds the tangent), reverse mode rounds the
        # cotangent instead: its Jacobian is `jax.jacrev`'s.
        reference = jax.jacrev if mode == "reverse" and not case.op.linear_jvp else jax.jacfwd
        expected = reference(fn, argnums=argnums)(*args)
        actual = _call(case, dl.materialise)
        assert_jacobian_equal(actual, expected, exact=exact, what=case.id)
    elif case.api == "operator":
        out = jax.eval_shape(fn, *args)
        if not isinstance(out, jax.ShapeDtypeStruct):
            pytest.skip("materialise_operator: one array in, one array out only")
        p = _first_argnum(argnums)
        expected = jax.jacfwd(fn, argnums=p)(*args)
        op = _call(case, _operator)
        assert isinstance(op, lx.AbstractLinearOperator)
        n_in = int(np.prod(args[p].shape))
        # A structured operator stores exact zeros where `jax.jacfwd` multiplies a zero
        # tangent by a NaN or infinite partial derivative (`0 * inf` is NaN), so its matrix
        # has NaN only where the partial derivative itself is NaN. With a non-finite
        # reference the matrix is therefore not compared; `mv` against `jax.jvp` is.
        if np.all(np.isfinite(expected)):
            assert_jacobian_equal(
                op.as_matrix(), expected.reshape(-1, n_in), exact=exact, what=f"{case.id} matrix"
            )
        v = jnp.asarray(np.random.RandomState(0).randn(*args[p].shape), args[p].dtype)

        # The operator is the derivative with respect to argument `p` alone: the others
        # are constants (symbolic zero tangents, as for `jax.jacfwd(fn, argnums=p)`), not
        # inputs with a zero tangent, which would meet an infinite partial derivative of
        # theirs (0 * inf = NaN) in `jax.jvp`.
        def partial(a):
            return fn(*args[:p], a, *args[p + 1 :])

        if case.op.linear_jvp:
            _, jvp = jax.jvp(partial, (args[p],), (v,))
        else:
            jvp = (expected.reshape(-1, n_in) @ v.reshape(-1)).reshape(expected.shape[: -v.ndim])
        assert_jacobian_equal(op.mv(v), jvp, what=f"{case.id} mv")
    else:
        jax.jacfwd(fn, argnums=argnums)(*args)  # the report must work wherever jacfwd does
        report = dl.structure_report(fn, *args, argnums=argnums, mode=mode)
        assert isinstance(str(report), str)
        assert len(report.rows) == len(jax.tree.leaves(jax.eval_shape(fn, *args))) * (
            1 if isinstance(argnums, int) else len(argnums)
        )


# The default run takes every sixth case of the sample (the suite's ten minutes on two
# cores); `make test-slow` the rest of it (in CI), `make test-sweep` the whole product.
@pytest.mark.parametrize("case", _params(default_sample()[::6]))
def test_catalogue_sample(case):
    check(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", _params([c for i, c in enumerate(default_sample()) if i % 6]))
def test_catalogue_sample_rest(case):
    check(case)


@pytest.mark.sweep
@pytest.mark.parametrize("case", _params(all_cases()))
def test_catalogue(case):
    check(case)


def test_catalogue_covers_the_op_list():
    names = {op.name for op in RECORDS}
    assert len(names) == len(RECORDS), "record names must be unique"
    sampled = {c.op.name for c in default_sample()}
    assert sampled == names
    # Every outside point really leaves the domain somewhere: jacfwd is not finite there,
    # or the op is one whose derivative stays finite (documented in the record's values).
    for op in RECORDS:
        if op.outside is not None:
            for x, vals in zip(_sample(op, "outside", 0), op.outside):
                assert any(v is not None for v in vals)
                assert len(vals) <= (x.size + 1) // 2, op.name


def test_checker_can_fail():
    case = Case(RECORDS[0], "inside", "f64", "eager", "materialise")
    fn, args, argnums, _ = case.build()
    expected = jax.jacfwd(fn)(*args)
    for wrong in (
        expected + 1e-12,
        expected.at[0, 0, 0, 0].set(np.nan),
        expected.astype(np.float32),
        (expected,),
    ):
        with pytest.raises(AssertionError):
            assert_jacobian_equal(wrong, expected, exact=True)
    with pytest.raises(AssertionError, match="NaN patterns differ"):
        assert_jacobian_equal(expected.at[0, 0, 0, 0].set(np.nan), expected)
    assert_jacobian_equal(expected * (1 + 1e-15), expected)


# ---- survey: reports that claim no dense fallback while the operator is dense ------------


def survey():
    """Print, for each record (eager, float64), the report's last line and the operator's
    kind, and list the silent losses: "No dense fallback." with a dense operator."""
    losses = []
    for op in RECORDS:
        case = Case(op, "inside", "f64", "eager", "report")
        fn, args, argnums, mode = case.build()
        if len(op.shapes) != 1 or not isinstance(jax.eval_shape(fn, *args), jax.ShapeDtypeStruct):
            continue
        try:
            text = str(dl.structure_report(fn, *args))
            operator = dl.materialise_operator(fn, *args)
        except Exception as e:
            print(f"{op.name}: raised {type(e).__name__}: {e}")
            continue
        jac = np.asarray(jax.jacfwd(fn)(*args)).reshape(-1, args[0].size)
        nonzero = float(np.mean(jac != 0))
        dense = isinstance(operator, (lx.MatrixLinearOperator, lx.PyTreeLinearOperator))
        print(f"{op.name}: {type(operator).__name__}, {nonzero:.0%} nonzero; {text!r}")
        if dense and "No dense fallback." in text and nonzero < 0.5:
            losses.append((op.name, type(operator).__name__, nonzero, text))
    print("\nSilent losses (no dense fallback reported, dense operator, < 50% nonzero):")
    for name, kind, nonzero, text in losses:
        print(f"- {name}: {kind}, {nonzero:.0%} nonzero; report: {text!r}")


if __name__ == "__main__":
    survey()
