"""Shared test utilities: tree comparison and counting matrix-matrix products in a
traced program."""

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from diffrax_linearize._interpreter import (  # the engine's walk over a program
    subjaxprs,
)


def jacfwd_compiled(fn, *args, **kwargs):
    """`jax.jacfwd(fn, **kwargs)(*args)`, the reference Jacobian, compiled as one program.
    Run eagerly, each primitive of the reference is a compilation of its own: several
    times the time on these small programs, most of some test files' time. For
    comparisons within a tolerance, and exact ones where the Jacobian's entries are whole
    numbers, which no compilation rounds (`test_sparsity.py`'s window-pattern and 0-d
    transpose tests); the NaN patterns "as `jax.jacfwd` (eager)" and the other exact
    comparisons keep the eager reference."""
    return jax.jit(jax.jacfwd(fn, **kwargs))(*args)


def tree_allclose(x, y, *, rtol=1e-5, atol=1e-8, check_dtype=True) -> bool:
    """Same tree structure, and every pair of leaves has the same shape (and dtype) and is
    close."""
    x_leaves, x_tree = jtu.tree_flatten(x)
    y_leaves, y_tree = jtu.tree_flatten(y)
    if x_tree != y_tree:
        return False
    for a, b in zip(x_leaves, y_leaves):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return False
        if check_dtype and a.dtype != b.dtype:
            return False
        if a.dtype == jax.dtypes.float0 or b.dtype == jax.dtypes.float0:
            continue
        if not np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True):
            return False
    return True


def assert_tree_allclose(actual, expected, *, rtol=1e-5, atol=1e-8, check_dtype=True):
    """As `tree_allclose`, with a message saying which leaf differs and by how much."""
    a_leaves, a_tree = jtu.tree_flatten(actual)
    e_leaves, e_tree = jtu.tree_flatten(expected)
    assert a_tree == e_tree, f"tree structures differ:\n{a_tree}\n{e_tree}"
    for k, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape, f"leaf {k}: shape {a.shape} != {e.shape}"
        if check_dtype:
            assert a.dtype == e.dtype, f"leaf {k}: dtype {a.dtype} != {e.dtype}"
        if a.dtype == jax.dtypes.float0:
            continue
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=f"leaf {k}")


def assert_equal_to_rounding(actual, expected, *, ulps=16):
    """`actual == expected` up to `ulps` units in the last place of `expected`'s largest
    entry.

    For results that are the same arithmetic compiled at another batch size (a chunk of
    paths, one device's shard) and compared with one `vmap` over everything. XLA may
    vectorise those programs differently (vector body against remainder loop, fused
    multiply-adds), which can change the last bits: jax 0.10 and 0.11 give equal bits in
    these tests, jax 0.12 differs by up to 4 ulp in a few entries. A wrong key, path order
    or padding differs by far more than this bound.
    """
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
    scale = float(np.max(np.abs(expected), initial=0.0))
    atol = ulps * np.finfo(expected.dtype).eps * scale
    np.testing.assert_allclose(actual, expected, rtol=0, atol=atol)


def assert_jacobian_equal(actual, expected, *, ulps=256, exact=False, what="jacobian"):
    """`actual` is what `jax.jacfwd` gave as `expected`: the same pytree structure, and for
    each leaf the same shape, the same dtype, the same NaN mask, the same infinities (with
    their signs), and finite values equal up to `ulps` units in the last place of the
    leaf's dtype, relative to the larger of 1 and the leaf's largest finite entry; or
    bit-for-bit equal where `exact` (a Jacobian of zeros and ones, such as a gather's,
    has no rounding to forgive)."""
    a_leaves, a_tree = jtu.tree_flatten(actual)
    e_leaves, e_tree = jtu.tree_flatten(expected)
    assert a_tree == e_tree, f"{what}: tree structures differ:\n{a_tree}\n{e_tree}"
    for k, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        a, e = np.asarray(a), np.asarray(e)
        where = f"{what}, leaf {k}"
        assert a.shape == e.shape, f"{where}: shape {a.shape} != {e.shape}"
        assert a.dtype == e.dtype, f"{where}: dtype {a.dtype} != {e.dtype}"
        if e.dtype == jax.dtypes.float0 or not jnp.issubdtype(e.dtype, jnp.inexact):
            assert np.array_equal(a, e), f"{where}: values differ"
            continue
        a_nan, e_nan = np.isnan(a), np.isnan(e)
        assert np.array_equal(a_nan, e_nan), (
            f"{where}: NaN patterns differ: ours NaN at {np.argwhere(a_nan & ~e_nan).tolist()}"
            f" where jacfwd is not; jacfwd NaN at {np.argwhere(e_nan & ~a_nan).tolist()}"
            f" where ours is not"
        )
        a_inf, e_inf = np.isinf(a), np.isinf(e)
        assert np.array_equal(a_inf, e_inf) and np.array_equal(a[a_inf], e[e_inf]), (
            f"{where}: infinities differ: ours {np.argwhere(a_inf).tolist()},"
            f" jacfwd {np.argwhere(e_inf).tolist()}"
        )
        finite = np.isfinite(e)
        a, e = a[finite], e[finite]
        if exact:
            assert np.array_equal(a, e), f"{where}: not bit-for-bit equal, {a} != {e}"
            continue
        eps = float(jnp.finfo(e.dtype).eps)  # NumPy's `finfo` knows no bfloat16
        if e.dtype.itemsize < 4:  # float16, bfloat16: compared in float32
            a, e = a.astype(np.float32), e.astype(np.float32)
        scale = max(1.0, float(np.max(np.abs(e), initial=0.0)))
        np.testing.assert_allclose(a, e, rtol=0, atol=ulps * eps * scale, err_msg=where)


# ---- counting matrix-matrix products ----------------------------------------------------


def _is_var(v) -> bool:
    # Literals have a `val`; variables do not.
    return not hasattr(v, "val")


_CALLS = ("jit", "pjit", "closed_call", "core_call", "remat", "checkpoint", "custom_jvp_call")


def _is_matmul(eqn) -> bool:
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars
    lhs_free = lhs.aval.ndim - len(lhs_contract) - len(lhs_batch)
    rhs_free = rhs.aval.ndim - len(rhs_contract) - len(rhs_batch)
    return lhs_free > 0 and rhs_free > 0


# `materialise`'s check for a non-finite Jacobian (one Jacobian-vector product, a matrix
# product only where the function has one) and its exact `jax.jacfwd`, which runs only then.
_NOT_COUNTED = ("nonfinite_check", "nonfinite_fallback")


def _count_live(jaxpr, live_out: list[bool]) -> tuple[int, list[bool]]:
    """Matrix-matrix `dot_general`s that contribute to the outputs marked live; returns the
    count and which inputs are live. Equations are walked backwards from the outputs; a
    call-like equation is recursed into with its live outputs, so dead code inside `jit`
    (such as the primal `A @ x` of `jax.linearize`) is not counted."""
    live = {v for v, keep in zip(jaxpr.outvars, live_out) if keep and _is_var(v)}
    count = 0
    for eqn in reversed(jaxpr.eqns):
        out_live = [v in live for v in eqn.outvars]
        if not any(out_live) and not eqn.effects:
            continue
        name = eqn.primitive.name
        if name in ("jit", "pjit") and eqn.params.get("name") in _NOT_COUNTED:
            continue
        subs = list(subjaxprs(eqn))
        if name in _CALLS and len(subs) == 1:
            c, in_live = _count_live(subs[0], out_live)
            count += c
            live.update(v for v, keep in zip(eqn.invars, in_live) if keep and _is_var(v))
            continue
        if name == "dot_general" and _is_matmul(eqn):
            count += 1
        for sub in subs:  # control flow: every equation of each branch/body counts
            count += _count_live(sub, [True] * len(sub.outvars))[0]
        live.update(v for v in eqn.invars if _is_var(v))
    in_live = [v in live for v in jaxpr.invars]
    return count, in_live


def count_matmuls(fn, *args) -> int:
    """The number of live matrix-matrix products (`dot_general`s where both operands keep
    free, non-contracting non-batch, dimensions) in `jax.make_jaxpr(fn)(*args)`, but for
    `materialise`'s calls named in `_NOT_COUNTED`: the Jacobian-vector product that checks
    for a non-finite Jacobian, and the `jax.jacfwd` that recomputes one, only then."""
    closed = jax.make_jaxpr(fn)(*args)
    return _count_live(closed.jaxpr, [True] * len(closed.jaxpr.outvars))[0]


def primitive_names(fn, *args) -> set[str]:
    """The names of every primitive in `jax.make_jaxpr(fn)(*args)`, sub-jaxprs included,
    but for those of `materialise`'s calls named in `_NOT_COUNTED` (see `count_matmuls`)."""

    def names(jaxpr):
        out = set()
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("jit", "pjit") and eqn.params.get("name") in _NOT_COUNTED:
                continue
            out.add(eqn.primitive.name)
            for sub in subjaxprs(eqn):
                out |= names(sub)
        return out

    return names(jax.make_jaxpr(fn)(*args).jaxpr)


def random_normal(key, shape, dtype=jnp.float64):
    return jax.random.normal(key, shape, dtype=dtype)


def assert_vmap_matches_jit(solve, y0s, *args, rtol):
    """`jax.jit(jax.vmap(solve))` over the rows of `y0s` (the other arguments shared) gives,
    lane by lane, what the jitted unbatched `solve` gives."""
    batched = jax.jit(jax.vmap(solve, in_axes=(0,) + (None,) * len(args)))(y0s, *args)
    single = jax.jit(solve)
    for i in range(len(y0s)):
        np.testing.assert_allclose(batched[i], single(y0s[i], *args), rtol=rtol)


def assert_grad_matches_central_difference(loss, x, *, eps=1e-5, rtol=1e-5):
    """The jitted `jax.grad` of a scalar `loss` at the scalar `x` against the central
    difference with step `eps`."""
    g = jax.jit(jax.grad(loss))(x)
    fd = (loss(x + eps) - loss(x - eps)) / (2 * eps)
    np.testing.assert_allclose(g, fd, rtol=rtol)


def brusselator_2d(n):
    """The 2D Brusselator on a periodic `n x n` grid (`jnp.roll`), as `(field, y0)` with
    `field(y)`: a sparse Jacobian too wide to band, which takes the GMRES path."""

    def field(y):
        u, v = y.reshape(2, n, n)

        def lap(w):
            rolled = sum(jnp.roll(w, s, axis) for s in (1, -1) for axis in (0, 1))
            return 0.02 * (n - 1) ** 2 * (rolled - 4 * w)

        du = 1 + u * u * v - 4.4 * u + lap(u)
        dv = 3.4 * u - u * u * v + lap(v)
        return jnp.concatenate([du.ravel(), dv.ravel()])

    x = jnp.linspace(0, 1, n)
    X, Y = jnp.meshgrid(x, x)
    y0 = jnp.concatenate([(22 * (Y * (1 - Y)) ** 1.5).ravel(), (27 * (X * (1 - X)) ** 1.5).ravel()])
    return field, y0
