"""Sparse structure: block-diagonal, banded and stencil Jacobians of the vector fields people
write, loops, and the lineax operators and solver that keep the structure. Every Jacobian
is compared with `jax.jacfwd`; every operator with its dense matrix; storage is asserted by
counting the numbers held in the operators' array leaves."""

import re

import diffrax_linearize as dl
import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.scipy as jsp
import lineax as lx
import numpy as np
import pytest
from benchmarks import structure
from diffrax_linearize import _interpreter, _linear_solver, _materialise, _sparsity
from helpers import assert_tree_allclose, jacfwd_compiled, primitive_names


_TOL = {jnp.float32: dict(rtol=2e-5, atol=2e-5), jnp.float64: dict(rtol=1e-11, atol=1e-11)}


# ---- the fields ---------------------------------------------------------------------------


# The structure benchmark's fields where the tests use them unchanged: N Robertson systems
# written with `y[:, k]` and `jnp.stack`, with `vmap`, and with `lax.scan` over the systems
# (a map with no carry); Lorenz-96.
robertson_stack, robertson_vmap, lorenz96 = (
    structure.robertson_stack,
    structure.robertson_vmap,
    structure.lorenz96,
)
scan_field = structure.robertson_scan


def laplacian_pad(u):
    up = jnp.pad(u, 1)
    return up[2:] - 2 * up[1:-1] + up[:-2] - u**3


def laplacian_roll(u):
    return jnp.roll(u, 1) + jnp.roll(u, -1) - 2 * u + jnp.sin(u)


def brusselator_1d(y):
    u, v = y[: y.shape[0] // 2], y[y.shape[0] // 2 :]
    lap = lambda w: jnp.pad(w, 1, mode="edge")[2:] - 2 * w + jnp.pad(w, 1, mode="edge")[:-2]
    du = 1 + u**2 * v - 4 * u + 0.02 * lap(u)
    dv = 3 * u - u**2 * v + 0.02 * lap(v)
    return jnp.concatenate([du, dv])


def brusselator_2d(y):
    n = int(round((y.shape[0] // 2) ** 0.5))
    y = y.reshape(2, n, n)
    u, v = y[0], y[1]

    def lap(w):
        return (
            jnp.roll(w, 1, 0) + jnp.roll(w, -1, 0) + jnp.roll(w, 1, 1) + jnp.roll(w, -1, 1) - 4 * w
        )

    du = 1.0 + u**2 * v - 4.4 * u + 0.5 * lap(u)
    dv = 3.4 * u - u**2 * v + 0.5 * lap(v)
    return jnp.stack([du, dv]).reshape(-1)


def gray_scott_2d(y):
    """Two species as the last axis of a grid, a Dirichlet boundary by padding."""
    n = int(round((y.shape[0] // 2) ** 0.5))
    y = y.reshape(n, n, 2)
    u, v = y[..., 0], y[..., 1]

    def lap(w):
        p = jnp.pad(w, 1)
        return p[2:, 1:-1] + p[:-2, 1:-1] + p[1:-1, 2:] + p[1:-1, :-2] - 4 * w

    du = 0.16 * lap(u) - u * v**2 + 0.06 * (1 - u)
    dv = 0.08 * lap(v) + u * v**2 - 0.12 * v
    return jnp.stack([du, dv], axis=-1).reshape(-1)


def heat_substeps(u):
    """Three explicit heat substeps inside the field: a `fori_loop` whose band widens."""
    return lax.fori_loop(0, 3, lambda i, w: w + 0.1 * laplacian_pad(w), u)


FIELDS = {
    "robertson_stack": (robertson_stack, 30),
    "robertson_vmap": (robertson_vmap, 30),
    "laplacian_pad": (laplacian_pad, 20),
    "laplacian_roll": (laplacian_roll, 20),
    "brusselator_1d": (brusselator_1d, 24),
    "brusselator_2d": (brusselator_2d, 2 * 6 * 6),
    "gray_scott_2d": (gray_scott_2d, 2 * 5 * 5),
    "lorenz96": (lorenz96, 16),
    "scan_field": (scan_field, 30),
    "heat_substeps": (heat_substeps, 24),
}


def _input(n, dtype, seed=0):
    return jnp.asarray(0.5 + np.random.RandomState(seed).rand(n), dtype)


# float32 in both modes under `make test-slow`; by default in forward mode only, as
# `test_idiom` (the rules are the same in both modes, and the default suite's time is
# bounded).
@pytest.mark.parametrize(
    "mode, dtype",
    [
        ("forward", jnp.float32),
        ("forward", jnp.float64),
        pytest.param("reverse", jnp.float32, marks=pytest.mark.slow),
        ("reverse", jnp.float64),
    ],
    ids=["forward-float32", "forward-float64", "reverse-float32", "reverse-float64"],
)
@pytest.mark.parametrize("name", list(FIELDS))
def test_field_matches_jacfwd(name, mode, dtype):
    fn, n = FIELDS[name]
    x = _input(n, dtype)
    out = jax.jit(lambda x: dl.materialise(fn, x, mode=mode, strict=True))(x)
    assert_tree_allclose(out, jacfwd_compiled(fn, x), **_TOL[dtype])


def _block(fn, x, mode="forward"):
    (block,) = _materialise.structured_blocks(fn, x, mode=mode)[0][0]
    return block


def _leaf_size(op):
    return sum(int(np.size(leaf)) for leaf in jax.tree_util.tree_leaves(op))


@pytest.mark.parametrize("name", ["robertson_stack", "robertson_vmap", "scan_field"])
def test_block_diagonal_storage(name):
    fn, _ = FIELDS[name]
    x = _input(3 * 50, jnp.float64)
    op = dl.materialise_operator(fn, x)
    assert isinstance(op, dl.BlockDiagonalLinearOperator)
    assert op.blocks.shape == (50, 3, 3)
    assert _leaf_size(op) == 9 * 50
    assert "block-diagonal 50 x 3 x 3" in _sparsity.describe(_block(fn, x))
    np.testing.assert_allclose(op.as_matrix(), jacfwd_compiled(fn, x), rtol=1e-12)


def _primitives(fn, x):
    from diffrax_linearize._interpreter import iter_eqns

    jaxpr = jax.make_jaxpr(lambda x: dl.materialise_operator(fn, x))(x).jaxpr
    return {eqn.primitive.name for eqn in iter_eqns(jaxpr)}


@pytest.mark.parametrize("name", ["robertson_stack", "robertson_vmap", "laplacian_pad"])
def test_regular_patterns_assemble_without_scatter(name):
    # Each slot of a stencil row lands on one diagonal, and the rows of equal blocks share
    # their layout: the operator's storage is slices of the values, not a scatter (XLA's
    # CPU scatter of 3 x 10^5 entries cost ten evaluations of the 1D Laplacian).
    fn, _ = FIELDS[name]
    x = _input(3 * 50, jnp.float64)
    assert not {"scatter", "scatter-add", "gather"} & _primitives(fn, x)


def _switched_cells(y):
    # Robertson's cells, the third species reading y3 in some cells only (a known
    # predicate): a slot live in some blocks and not in others.
    y1, y2, y3 = y.reshape(-1, 3).T
    d1 = -0.04 * y1 + 1e4 * y2 * y3
    d3 = jnp.where(np.arange(y1.shape[0]) % 3 == 0, 3e7 * y2**2 * y3, 3e7 * y2**2)
    return jnp.stack([d1, -d1 - d3, d3], axis=1).reshape(-1)


@pytest.mark.parametrize(
    "name", ["robertson_stack", "robertson_vmap", "laplacian_pad", "switched_cells"]
)
def test_operator_reads_live_slots_only(name):
    # The operators' layouts read the live slots of a block and nothing else (no pass that
    # zeroes the others first): NaN in every slot that is not live changes nothing.
    from diffrax_linearize import _operators
    from diffrax_linearize._structure import BAND

    fn = FIELDS[name][0] if name in FIELDS else _switched_cells
    x = _input(3 * 40, jnp.float64)
    b = _block(fn, x).canonical()
    assert b.val_labels == (BAND, 0) and not b.ell.full_mask().all()
    poisoned = b.with_val(jnp.where(b.ell.full_mask(), b.val, jnp.nan))
    struct = jax.ShapeDtypeStruct(x.shape, x.dtype)
    op = _operators.sparse_operator(poisoned, struct, struct)
    assert not isinstance(op, dl.SparseLinearOperator)  # not ELLPACK, which masks its slots
    np.testing.assert_allclose(op.as_matrix(), jacfwd_compiled(fn, x), rtol=1e-14, atol=0)


def test_made_by_transpose():
    from diffrax_linearize._compat import made_by_transpose

    def check(x, expected):
        assert made_by_transpose(x) == expected
        return x

    def program(a):
        check(a, False)
        check(a.T.reshape(-1).reshape(2, 6), True)
        check(jnp.stack([a, a]), False)
        check(jnp.sin(a.T), False)
        return a

    jax.make_jaxpr(program)(jnp.ones((3, 4)))
    check(np.ones((2, 2)), False)


def test_vmap_over_cells_is_assembled_from_the_transpose_back():
    # `jax.vmap` over cells gives the block of each cell's species with the species axis
    # first: the engine transposes it, and the operator slices the transpose back, so
    # that XLA cancels the two. (Slices of the transpose itself stop XLA's CPU compiler
    # fusing the field's program with the assembly: one more pass over the blocks.)
    x = _input(3 * 50, jnp.float64)
    field = jax.make_jaxpr(robertson_vmap)(x).jaxpr
    jaxpr = jax.make_jaxpr(lambda x: dl.materialise_operator(robertson_vmap, x))(x)
    transposes = [e for e in _interpreter.iter_eqns(jaxpr.jaxpr) if e.primitive.name == "transpose"]
    if any(e.primitive.name == "unstack" for e in field.eqns):
        # jax >= 0.12.1 batches the cell's unpacking into `unstack` along the species axis
        # and its result into `stack`: no axis to move, so no transpose to cancel (and the
        # compiled program is the field's fusion and the assembly's, as with `transpose`).
        assert transposes == []
    else:
        # The engine's (species after cells), the one back, and the blocks' at the end.
        shapes = [tuple(e.outvars[0].aval.shape) for e in transposes[-3:]]
        assert shapes == [(3, 50, 3), (3, 3, 50), (50, 3, 3)]
        assert transposes[-3].params["permutation"] == transposes[-2].params["permutation"]
    op = dl.materialise_operator(robertson_vmap, x)
    assert isinstance(op, dl.BlockDiagonalLinearOperator), op
    # Up to rounding: which sums XLA fuses, and so their last bit, differs between jax
    # versions (jax 0.12 rounds 17 of 22500 entries one unit apart from `materialise`).
    np.testing.assert_allclose(op.as_matrix(), dl.materialise(robertson_vmap, x), rtol=1e-14)
    np.testing.assert_allclose(op.as_matrix(), jacfwd_compiled(robertson_vmap, x), rtol=1e-14)


_IRREGULAR = {
    # A boundary row whose only slot is the diagonal: a slot landing on two diagonals.
    "boundary_row": lambda y: jnp.concatenate([2 * y[:1], y[1:] * y[:-1]]),
    # Two paths to the same entries: duplicates summed.
    "duplicates": lambda y: jnp.sin(y) + y**2 + jnp.pad(y[1:], (0, 1)) * y,
    # 2 x 2 blocks whose pattern alternates between blocks: masked slots.
    "alternating_blocks": lambda y: (
        jnp.where(jnp.arange(y.shape[0]) % 4 == 0, 1.0, 0.0) * y.reshape(-1, 2)[:, ::-1].reshape(-1)
        + y**3
    ),
    # 40 x 40 blocks: too many (row, column) pairs for slices; assembled by a scatter.
    "wide_blocks": lambda y: (
        (y.reshape(-1, 40)[:, :, None] * jnp.roll(y.reshape(-1, 40), 1, axis=1)[:, None, :])
        .sum(-1)
        .reshape(-1)
    ),
}


@pytest.mark.parametrize("name", list(_IRREGULAR))
def test_irregular_patterns_against_jacfwd(name):
    fn = _IRREGULAR[name]
    x = _input(120, jnp.float64)
    op = dl.materialise_operator(fn, x)
    assert isinstance(op, lx.TridiagonalLinearOperator | dl.BlockDiagonalLinearOperator), op
    np.testing.assert_allclose(op.as_matrix(), jacfwd_compiled(fn, x), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize(
    "layer, shape",
    [
        (lambda key: eqx.nn.Conv2d(3, 4, 3, padding=1, key=key), (3, 7, 6)),
        (lambda key: eqx.nn.Conv1d(2, 3, 3, stride=2, dilation=2, key=key), (2, 15)),
        (lambda key: eqx.nn.ConvTranspose1d(2, 3, 3, stride=2, key=key), (2, 8)),
        (lambda key: eqx.nn.Conv1d(4, 6, 3, groups=2, padding=1, key=key), (4, 12)),
    ],
    ids=["Conv2d", "Conv1d_strided_dilated", "ConvTranspose1d", "Conv1d_grouped"],
)
def test_conv_kernel_jacobian_is_the_patches(layer, shape):
    # With respect to its kernel, a convolution's Jacobian is the input's patches, each
    # output feature using its own kernel slice: stored as a pattern, not as the kernel's
    # identity pushed through the convolution (dense, out size x kernel size).
    layer = layer(jax.random.key(0))
    x = jnp.asarray(np.random.RandomState(0).randn(*shape), jnp.float64)
    w = jnp.asarray(layer.weight, jnp.float64)
    fn = lambda w: eqx.tree_at(lambda m: m.weight, layer, w)(x)
    np.testing.assert_allclose(
        dl.materialise(fn, w), jacfwd_compiled(fn, w), rtol=1e-12, atol=1e-14
    )
    (kind,) = dl.structure_report(fn, w).kinds
    stored, dense = re.search(r"([\d,]+) numbers stored, dense ([\d,]+)", kind).groups()
    assert int(stored.replace(",", "")) * layer.out_channels <= int(dense.replace(",", "")), kind
    # The patches are strided slices of the input, and the kernel's identity stays a delta
    # along each kernel axis: no scatter densifies a pattern, and no grouped convolution
    # builds the patches (each of those cost more on CPU than `jax.jacfwd`'s convolution).
    used = primitive_names(lambda w: dl.materialise(fn, w), w)
    assert not used & {"scatter-add", "scatter_add", "scatter", "conv_general_dilated"}, used


@pytest.mark.parametrize(
    "shape, kernel, kwargs",
    [
        # ConvTranspose-like: input dilation with a negative padding, two batch elements.
        ((2, 3, 9), (4, 3, 3), dict(window_strides=(1,), padding=((-1, 2),), lhs_dilation=(2,))),
        # Channels last, strided and dilated in one of two spatial axes.
        (
            (1, 6, 5, 2),
            (3, 3, 2, 3),
            dict(
                window_strides=(2, 1),
                padding="SAME",
                rhs_dilation=(1, 2),
                dimension_numbers=("NHWC", "HWIO", "NHWC"),
            ),
        ),
        ((1, 2, 4, 3, 5), (2, 2, 2, 1, 3), dict(window_strides=(1, 1, 2), padding="VALID")),
    ],
    ids=["dilated_input", "nhwc", "3d"],
)
def test_conv_kernel_route_layouts(shape, kernel, kwargs):
    # The kernel route's windows against `jax.jacfwd` for the layouts Equinox's layers do
    # not produce: input dilation and negative padding, channels-last dimension numbers,
    # three spatial axes.
    x = jnp.asarray(np.random.RandomState(1).randn(*shape), jnp.float64)
    w = jnp.asarray(np.random.RandomState(2).randn(*kernel), jnp.float64)
    fn = lambda w: lax.conv_general_dilated(x, w, **kwargs)
    np.testing.assert_allclose(
        dl.materialise(fn, w), jacfwd_compiled(fn, w), rtol=1e-12, atol=1e-14
    )


@pytest.mark.parametrize(
    "layer, shape",
    [
        (lambda key: eqx.nn.ConvTranspose1d(2, 3, 3, stride=2, key=key), (2, 9)),
        (lambda key: eqx.nn.ConvTranspose2d(2, 2, 3, stride=2, padding=1, key=key), (2, 4, 3)),
    ],
    ids=["ConvTranspose1d", "ConvTranspose2d"],
)
def test_strided_transposed_conv_input_jacobian_is_sparse(layer, shape):
    # A transposed convolution with a stride dilates its input: the windows of the
    # interior-padded input keep the input's structure (each output reads at most
    # ceil(kernel / stride) inputs per channel), rather than going dense.
    layer = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), layer(jax.random.key(0)))
    x = jnp.asarray(np.random.RandomState(0).randn(*shape), jnp.float64)
    np.testing.assert_allclose(
        dl.materialise(layer, x), jacfwd_compiled(layer, x), rtol=1e-12, atol=1e-14
    )
    (kind,) = dl.structure_report(layer, x).kinds
    assert kind.startswith("sparse"), kind


def test_banded_storage():
    x = _input(200, jnp.float64)
    op = dl.materialise_operator(laplacian_pad, x)
    assert isinstance(op, lx.TridiagonalLinearOperator)
    assert _leaf_size(op) == 200 + 2 * 199
    assert "banded, offsets -1..1" in _sparsity.describe(_block(laplacian_pad, x))
    np.testing.assert_allclose(op.as_matrix(), jacfwd_compiled(laplacian_pad, x), rtol=1e-12)
    # A wider stencil: a banded operator of bandwidth 2 that stores only the diagonals
    # its pattern uses (offsets -2, 0 and 2: three numbers per row, not five).
    fn = lambda u: jnp.pad(u, 2)[4:] + jnp.pad(u, 2)[:-4] - 2 * u + jnp.tanh(u)
    op = dl.materialise_operator(fn, x)
    assert isinstance(op, dl.BandedLinearOperator)
    assert op.offsets == (-2, 0, 2) and op.bandwidths == (2, 2) and _leaf_size(op) == 3 * 200
    np.testing.assert_allclose(op.as_matrix(), jacfwd_compiled(fn, x), rtol=1e-12)


@pytest.mark.parametrize("name, per_row", [("brusselator_2d", 6), ("laplacian_roll", 3)])
def test_periodic_stencil_storage(name, per_row):
    fn, _ = FIELDS[name]
    n = 2 * 12 * 12 if name == "brusselator_2d" else 100
    x = _input(n, jnp.float64)
    op = dl.materialise_operator(fn, x)
    assert isinstance(op, dl.SparseLinearOperator)
    assert op.values.shape == (n, per_row)
    assert _leaf_size(op) == per_row * n
    np.testing.assert_allclose(op.as_matrix(), jacfwd_compiled(fn, x), rtol=1e-12)


def test_dirichlet_2d_is_banded_by_grid_rows():
    x = _input(2 * 8 * 8, jnp.float64)
    op = dl.materialise_operator(gray_scott_2d, x)
    assert isinstance(op, dl.BandedLinearOperator)
    lower, upper = op.bandwidths
    assert lower == upper == 2 * 8  # species last: the grid's row is 16 numbers away
    np.testing.assert_allclose(op.as_matrix(), jacfwd_compiled(gray_scott_2d, x), rtol=1e-12)


def test_no_dense_block_at_scale():
    """At 2048 and 100,000 unknowns nothing dense is ever built: the structured blocks
    are formed inside a trace (no values), and their storage is counted."""
    for fn, n, most in [
        (brusselator_2d, 2 * 32 * 32, 6),
        (laplacian_pad, 100_000, 3),
        (robertson_stack, 3000, 3),
    ]:
        block = jax.eval_shape(lambda x: _block(fn, x).val, jax.ShapeDtypeStruct((n,), jnp.float64))
        assert np.prod(block.shape) <= most * n, (fn.__name__, block.shape)


def test_nbody_program_does_not_grow_with_the_bodies():
    """N-body, dense by nature: the sum over bodies folds the entries of every body into
    each row, merged by one gather whatever their number (the program grew by a slice per
    entry, thousands of equations to trace and compile)."""
    sizes = {}
    for bodies in (24, 48):
        x = jnp.asarray(np.random.RandomState(bodies).rand(3 * bodies))
        closed = jax.make_jaxpr(lambda x: dl.materialise(structure.nbody, x))(x)
        sizes[bodies] = sum(1 for _ in _interpreter.iter_eqns(closed.jaxpr))
    assert sizes[24] == sizes[48], sizes
    expected = jax.jit(jax.jacfwd(structure.nbody))(x)
    for fn in (dl.materialise, lambda f, x: dl.materialise_operator(f, x).as_matrix()):
        np.testing.assert_allclose(fn(structure.nbody, x), expected, rtol=1e-11, atol=1e-9)


def _closed_over(closed) -> int:
    """How many numbers a closed jaxpr and the closed jaxprs in its equations close over."""
    total = sum(np.size(c) for c in closed.consts)
    for eqn in closed.jaxpr.eqns:
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                if hasattr(sub, "consts") and hasattr(sub, "jaxpr"):
                    total += _closed_over(sub)
    return total


def test_nbody_holds_no_pattern_of_the_bodies():
    """The pairwise differences `p[None] - p[:, None]` are a sum of two blocks with
    different deltas, kept as two terms (`LazySum`) down to the sum over bodies, which makes
    them dense: no row-compressed pattern over the `n^2` pairs on the way, so the program
    closes over no index arrays that grow with the bodies (it held five of `n^2 / 3`
    entries, and their NumPy bookkeeping dominated the trace)."""
    consts = {}
    for bodies in (24, 48):
        x = jnp.asarray(np.random.RandomState(bodies).rand(3 * bodies))
        closed = jax.make_jaxpr(lambda x: dl.materialise_operator(structure.nbody, x))(x)
        consts[bodies] = _closed_over(closed)
        np.testing.assert_allclose(
            dl.materialise_operator(structure.nbody, x).as_matrix(),
            jacfwd_compiled(structure.nbody, x),
            rtol=1e-11,
            atol=1e-9,
        )
    assert consts[24] == consts[48] < 3 * 24, consts


def _pairs(x):
    p = x.reshape(-1, 2)
    return p[None, :, :] - p[:, None, :]


# Sums of blocks with different deltas (`LazySum`), followed by the equations applied term
# by term, by ones that need the sum first (`cumsum`, `pad`, `dot_general`), or output as
# they are.
LAZY_SUMS = {
    "pairs": _pairs,
    "outer_sum": lambda x: x[:, None] + 2.0 * x[None, :],
    "pairs_summed": lambda x: (lambda d: jnp.sum(d * jnp.sin(d), axis=1))(_pairs(x)),
    "pairs_then_cumsum": lambda x: jnp.cumsum(jnp.sum(_pairs(x) ** 2, -1), axis=1),
    "pairs_then_pad": lambda x: jnp.pad(jnp.sum(_pairs(x), 1), 1)[1:, 2:],
    "pairs_dot": lambda x: jnp.sum(_pairs(x) @ jnp.array([[1.0, 2.0], [3.0, -1.0]]), 0),
    "pairs_scaled_transposed": lambda x: (lambda d: (jnp.cos(d) * -d).transpose(2, 1, 0))(
        _pairs(x)
    ),
    "three_deltas": lambda x: jnp.sum(
        x[:, None, None] - x[None, :, None] + 3.0 * x[None, None, :] ** 2, axis=1
    ),
}


@pytest.mark.parametrize("name", sorted(LAZY_SUMS))
def test_sums_of_different_deltas(name):
    fn = LAZY_SUMS[name]
    x = jnp.asarray(np.random.RandomState(0).rand(8))
    expected = jacfwd_compiled(fn, x)
    np.testing.assert_allclose(dl.materialise(fn, x), expected, rtol=1e-12, atol=1e-12)
    op = dl.materialise_operator(fn, x)
    np.testing.assert_allclose(
        op.as_matrix(), expected.reshape(op.out_size(), -1), rtol=1e-12, atol=1e-12
    )


def test_termwise_is_a_flag_of_the_rules():
    """Which equations are applied term by term to a sum of different deltas is said by
    their rules (`register_rule(..., termwise=True)`), not by a list of names beside the
    registry: the same set as before the flag, and a rule registered again without it
    takes the sum added up."""
    registry = _interpreter.rule_registry()
    flagged = {str(p) for p, rule in registry.items() if getattr(rule, "termwise", False)}
    assert flagged == {
        "neg", "mul", "div", "reduce_sum", "broadcast_in_dim", "squeeze",
        "convert_element_type", "transpose", "dot_general",
    }  # fmt: skip
    neg = registry[lax.neg_p]
    # Two sizes: `materialise` caches its kernel on the text of the jaxpr.
    for flag, expected_calls, n in ((True, 2, 8), (False, 1, 10)):  # two terms, or their sum
        x = jnp.asarray(np.random.RandomState(0).rand(n))
        calls = []

        def counted(ctx, eqn, vals):
            calls.append(eqn)
            return neg(ctx, eqn, vals)

        def fn(x):
            return jnp.sum(-_pairs(x), axis=1)

        _interpreter.register_rule(lax.neg_p, termwise=flag)(counted)
        try:
            np.testing.assert_allclose(
                dl.materialise(fn, x), jacfwd_compiled(fn, x), rtol=1e-12, atol=1e-12
            )
        finally:
            registry[lax.neg_p] = neg
        assert len(calls) == expected_calls, (flag, calls)


def test_nan_faithful_is_a_flag_of_the_rules():
    """Which rules form each entry as `jax.jacfwd`'s push does (so a walk through them only
    needs no branch recomputing `jax.jacfwd`'s matrix for its NaNs) is said by the rules
    (`register_rule(..., nan_faithful=True)`), not by a list of names: products with
    constants, sums, reductions, broadcasts, reshapes, `dot_general`, identities and calls,
    and no solve, gather, scatter or control flow."""
    from diffrax_linearize._compat import prim

    registry = _interpreter.rule_registry()
    # By primitive, not by printed name (which differs between JAX versions, e.g. `pjit`).
    for name in (
        "neg", "mul", "div", "add", "sub", "reduce_sum", "broadcast_in_dim", "reshape",
        "squeeze", "transpose", "convert_element_type", "copy", "dot_general", "jit",
        "closed_call", "custom_jvp_call",
    ):  # fmt: skip
        p = prim(name)
        if p is not None:
            assert getattr(registry[p], "nan_faithful", False), name
    for p in (lax.linalg.triangular_solve_p, lax.gather_p, lax.scatter_add_p, lax.while_p):
        if p in registry:
            assert not getattr(registry[p], "nan_faithful", False), p


@pytest.mark.standard_promotion
def test_fft_field_is_jacfwds_program():
    """FFT, dense by nature: the transform of the identity leaves the walk nothing to
    save, and the Jacobian is `jax.jacfwd`'s own program, without the check for its NaNs
    or the branch recomputing them (no `cond`), NaN rows included."""
    u = jnp.asarray(np.random.RandomState(0).rand(64))
    for fn in (dl.materialise, lambda f, x: dl.materialise_operator(f, x).as_matrix()):
        assert "cond" not in primitive_names(lambda x: fn(structure.fft_field, x), u)
        np.testing.assert_allclose(
            fn(structure.fft_field, u), jax.jacfwd(structure.fft_field)(u), rtol=0, atol=1e-10
        )
    # An infinite derivative makes the rest of its row NaN, as `jax.jacfwd` (eager) does.
    u = u.at[5].set(jnp.inf)
    got, expected = dl.materialise(structure.fft_field, u), jax.jacfwd(structure.fft_field)(u)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    assert np.isnan(np.delete(expected[5], 5)).all()


# ---- idioms, one at a time ----------------------------------------------------------------


_IDX = np.array([3, 0, 2, 2, 5])

IDIOMS = {
    "static_index": lambda y: jnp.sin(y.reshape(4, 3)[:, 1]) * y.reshape(4, 3)[:, 2] + y[5],
    "gather_known": lambda y: jnp.sin(y)[_IDX] * y[_IDX[::-1]],
    "at_set": lambda y: jnp.sin(y).at[jnp.array([1, 4])].set(0.5) * 2,
    "at_add": lambda y: y.at[jnp.array([1, 4, 1])].add(jnp.cos(y[:3])),
    "at_min": lambda y: (y**2).at[2].min(0.7),
    "at_max": lambda y: (y**2).at[jnp.array([0, 5])].max(0.2),
    "reshape_dimensions": lambda y: lax.reshape(jnp.sin(y).reshape(3, 4), (4, 3), (1, 0)),
    "stack_scalars": lambda y: jnp.stack([y[0] * y[1], jnp.sin(y[2]), y[3]]),
    "roll_2d": lambda y: jnp.roll(y.reshape(3, 4) ** 2, (1, -1), axis=(0, 1)),
    "rev_strided": lambda y: jnp.sin(y)[::-2] + y[1::2],
    "dynamic_slice_static": lambda y: lax.dynamic_slice(jnp.sin(y), (3,), (5,)),
    "dynamic_update_slice_static": lambda y: lax.dynamic_update_slice(y, jnp.sin(y[:3]), (4,)),
    "tile_split": lambda y: jnp.tile(jnp.split(y, [4])[1], 2)[:10] * y[:10],
    "concat_with_constant": lambda y: jnp.concatenate([y[2:], jnp.ones(2, y.dtype), y[:1] ** 2]),
    "pad_interior": lambda y: lax.pad(y, jnp.zeros((), y.dtype), [(1, -1, 1)]) * 3,
    "broadcast_expand": lambda y: jnp.sum(
        jnp.broadcast_to(y[:4], (3, 4)) * jnp.arange(3.0, dtype=y.dtype)[:, None], 0
    ),
    "sum_of_stencil": lambda y: jnp.sum(jnp.roll(y, 1) * y),
    "dot_of_stencil": lambda y: jnp.ones((2, 12), y.dtype) @ (jnp.roll(y, 2) - y),
    "conv_same": lambda y: (
        jnp.convolve(y, jnp.array([1.0, -2.0, 1.0], y.dtype), mode="same") + y**2
    ),
    "conv_groups": lambda y: eqx.nn.Conv1d(4, 4, 3, groups=2, key=jax.random.key(0), dtype=y.dtype)(
        y.reshape(4, 3)
    ).reshape(-1),
    "conv_batch_groups": lambda y: lax.conv_general_dilated(
        y.reshape(2, 1, 6), jnp.ones((4, 1, 3), y.dtype), (1,), [(1, 1)], batch_group_count=2
    ).reshape(-1),
    "cond_of_stencils": lambda y: lax.cond(y[0] > 0.8, jnp.roll, lambda y, s: 2 * y[::-1], y, 1),
    "fori_static": lambda y: lax.fori_loop(0, 3, lambda i, u: u + 0.1 * jnp.sin(u), y),
    "fori_dynamic": lambda y: lax.fori_loop(
        0, (y[0] > 0).astype(int) + 2, lambda i, u: u * jnp.cos(u), y
    ),
    "while": lambda y: lax.while_loop(
        lambda s: s[0] < 3, lambda s: (s[0] + 1, jnp.sin(s[1])), (0, y)
    )[1],
    "lax_map": lambda y: lax.map(lambda r: jnp.sin(r) * r[::-1], y.reshape(4, 3)).reshape(-1),
    "scan_carry_and_xs": lambda y: lax.scan(
        lambda c, a: (0.5 * c + jnp.sin(a), c * a), jnp.zeros(3, y.dtype), y.reshape(4, 3)
    )[1].reshape(-1),
    "expm": lambda y: jsp.linalg.expm(0.1 * y[:9].reshape(3, 3)).reshape(-1),
}


# `expm` (a Pade approximant with a scaling loop) costs as much to compile as the rest.
_IDIOM_NAMES = [pytest.param(n, marks=pytest.mark.slow) if n == "expm" else n for n in IDIOMS]

# Idioms that lose structure, exactly, and say so (`strict=True` raises): `jnp.roll` in a
# `cond` branch with a traced predicate slices at an offset computed in the branch, a
# residual that is traced.
_LOSSY_IDIOMS = {"cond_of_stencils": "dynamic_slice"}


@pytest.mark.parametrize("mode", ["forward", "reverse"])
@pytest.mark.parametrize("name", _IDIOM_NAMES)
def test_idiom(name, mode):
    fn = IDIOMS[name]
    # float32 once per idiom (its tolerances do not depend on the mode).
    for dtype in (jnp.float32, jnp.float64) if mode == "forward" else (jnp.float64,):
        x = _input(12, dtype, seed=1)
        out = dl.materialise(fn, x, mode=mode, strict=name not in _LOSSY_IDIOMS)
        assert_tree_allclose(out, jacfwd_compiled(fn, x), **_TOL[dtype])


@pytest.mark.slow  # a second pass over every idiom (17 s on two cores): the slow tier
@pytest.mark.parametrize("name", _IDIOM_NAMES)
def test_idiom_with_patterns_kept(name, monkeypatch):
    """The same, with patterns never traded for dense storage: every rule's pattern path
    is exercised at these small sizes."""
    monkeypatch.setattr(_sparsity, "DENSE_FRACTION", np.inf)
    fn = IDIOMS[name]
    x = _input(12, jnp.float64, seed=2)
    expected = jacfwd_compiled(fn, x)
    for mode in ("forward", "reverse"):
        out = dl.materialise(fn, x, mode=mode, strict=name not in _LOSSY_IDIOMS)
        assert_tree_allclose(out, expected, **_TOL[jnp.float64])


@pytest.mark.parametrize("name", list(_LOSSY_IDIOMS))
def test_lossy_idiom_is_reported(name):
    x = _input(12, jnp.float64, seed=1)
    report = dl.structure_report(IDIOMS[name], x, mode="forward")
    (reason,) = report.reasons[_LOSSY_IDIOMS[name]]
    assert "not known at trace time" in reason
    with pytest.raises(ValueError, match=_LOSSY_IDIOMS[name]):
        dl.materialise(IDIOMS[name], x, strict=True)


def test_gather_with_known_indices_keeps_the_pattern():
    x = _input(40, jnp.float64)
    idx = np.random.RandomState(0).permutation(40)
    block = _block(lambda y: jnp.sin(y)[idx], x)
    assert block.ell is not None and block.ell.S == 1
    assert block.stored_size() == 40


def test_scatter_add_sums_rows():
    x = _input(10, jnp.float64)
    fn = lambda y: jnp.zeros(4).at[jnp.array([0, 1, 1, 3, 0, 0, 2, 3, 1, 2])].add(jnp.sin(y))
    block = _block(fn, x)
    assert block.ell is not None and block.ell.S == 3  # at most three elements per output
    assert_tree_allclose(dl.materialise(fn, x), jacfwd_compiled(fn, x), rtol=1e-12)


def test_loop_structure_reaches_a_fixed_point():
    x = _input(60, jnp.float64)
    fn = lambda y: lax.fori_loop(0, 5, lambda i, u: u * jnp.cos(u) + u, y)
    assert _block(fn, x).kind() == "diagonal"
    # Block-diagonal carries stay block-diagonal through a dynamic loop.
    fn = lambda y: lax.while_loop(
        lambda s: s[0] < 4, lambda s: (s[0] + 1, robertson_stack(s[1]) * 1e-9 + s[1]), (0, y)
    )[1]
    assert "block-diagonal 20 x 3 x 3" in _sparsity.describe(_block(fn, x))
    assert_tree_allclose(dl.materialise(fn, x), jacfwd_compiled(fn, x), rtol=1e-10)


def test_widening_band_is_widened_to_dense():
    # A stencil applied in a loop widens its band every iteration: no fixed point, so the
    # carry is made dense over its pattern; still exact, still no dense fallback.
    x = _input(16, jnp.float64)
    fn = lambda y: lax.fori_loop(0, 20, lambda i, u: u + 0.01 * laplacian_roll(u), y)
    out = dl.materialise(fn, x, strict=True)
    assert_tree_allclose(out, jacfwd_compiled(fn, x), rtol=1e-10)


# ---- random stencil programs --------------------------------------------------------------


def _random_stencil_program(seed):
    rng = np.random.RandomState(seed)
    n = int(rng.randint(6, 12))
    shape2 = (2, n // 2) if n % 2 == 0 else None
    steps, lines = [], []

    for _ in range(int(rng.randint(2, 7))):
        op = rng.choice(
            [
                "shift",
                "roll",
                "pad_stencil",
                "mul",
                "sin",
                "rev",
                "gather",
                "scatter",
                "reshape2",
                "sum_axis",
                "cumsum",
                "conv",
                "where",
                "matmul",
            ]
        )
        if op == "shift":
            k = int(rng.randint(1, 3))
            steps.append(lambda u, k=k: jnp.concatenate([u[k:], jnp.zeros(k, u.dtype)]) + u)
        elif op == "roll":
            k = int(rng.randint(-3, 4))
            steps.append(lambda u, k=k: jnp.roll(u, k) - 0.5 * u)
        elif op == "pad_stencil":
            steps.append(lambda u: jnp.pad(u, 1)[2:] + jnp.pad(u, 1)[:-2] - 2 * u)
        elif op == "mul":
            c = rng.randn(n)
            steps.append(lambda u, c=c: u * c)
        elif op == "sin":
            steps.append(jnp.sin)
        elif op == "rev":
            steps.append(lambda u: u[::-1] + 0.3 * u)
        elif op == "gather":
            idx = rng.randint(n, size=n)
            steps.append(lambda u, idx=idx: u[idx] * u)
        elif op == "scatter":
            idx = rng.randint(n, size=n)
            steps.append(lambda u, idx=idx: jnp.zeros_like(u).at[idx].add(u) + u)
        elif op == "reshape2" and shape2 is not None:
            steps.append(lambda u: jnp.roll(u.reshape(shape2), 1, axis=1).reshape(-1) * u)
        elif op == "sum_axis" and shape2 is not None:
            steps.append(lambda u: jnp.repeat(u.reshape(shape2).sum(0), 2) + u)
        elif op == "cumsum":
            steps.append(lambda u: jnp.cumsum(u[:3]).sum() + u)
        elif op == "conv":
            k = rng.randn(3)
            steps.append(lambda u, k=k: jnp.convolve(u, k, mode="same"))
        elif op == "where":
            m = rng.rand(n) < 0.5
            steps.append(lambda u, m=m: jnp.where(m, u, jnp.roll(u, 1)))
        elif op == "matmul":
            A = rng.randn(n, n) / n
            steps.append(lambda u, A=A: A @ u + u)
        else:
            continue
        lines.append(op)

    def fn(u):
        for step in steps:
            u = step(u)
        return u

    return fn, jnp.asarray(rng.randn(n)), " -> ".join(lines)


@pytest.mark.slow
@pytest.mark.parametrize("keep_patterns", [False, True])
def test_random_stencil_programs(keep_patterns, monkeypatch):
    if keep_patterns:
        monkeypatch.setattr(_sparsity, "DENSE_FRACTION", np.inf)
    programs = [_random_stencil_program(seed) for seed in range(16)]

    @jax.jit
    def run(xs):
        return [
            (dl.materialise(fn, x, mode=mode), jax.jacfwd(fn)(x))
            for (fn, _, _), x, mode in zip(programs, xs, ["forward", "reverse"] * 8)
        ]

    for (_, _, desc), (actual, expected) in zip(programs, run([p[1] for p in programs])):
        np.testing.assert_allclose(actual, expected, rtol=1e-10, atol=1e-10, err_msg=desc)


# ---- operators and the solver -------------------------------------------------------------


def _operators():
    rng = np.random.RandomState(3)
    n = 12
    blocks = jnp.asarray(rng.randn(4, 3, 3) + 3 * np.eye(3))
    yield dl.BlockDiagonalLinearOperator(blocks)
    yield dl.BlockDiagonalLinearOperator(
        blocks,
        jax.ShapeDtypeStruct((4, 3), blocks.dtype),
        jax.ShapeDtypeStruct((12,), blocks.dtype),
    )
    diags = jnp.asarray(rng.randn(4, n))
    diags = diags.at[2].add(6.0)
    yield dl.BandedLinearOperator(diags, (-2, -1, 0, 2))
    cols = np.stack([np.arange(n), (np.arange(n) + 5) % n, (np.arange(n) * 7) % n])
    values = jnp.asarray(rng.randn(n, 3)).at[:, 0].add(5.0)
    yield dl.SparseLinearOperator(values, cols, jax.ShapeDtypeStruct((3, 4), values.dtype))
    # Bandwidth 9: the block-tridiagonal LU inverts its 9 x 9 blocks with LAPACK's LU, not
    # the Gauss-Jordan loop of small blocks.
    wide = jnp.asarray(rng.randn(5, 40)).at[2].add(8.0)
    yield dl.BandedLinearOperator(wide, (-9, -1, 0, 1, 9))
    # Rows of 1 to 12 entries (row 0 dense), compressed by rows.
    mask = (rng.rand(n, n) < 0.2) | np.eye(n, dtype=bool)
    mask[0] = True
    rows, indices = np.nonzero(mask)
    dense = rng.randn(n, n) + 6 * np.eye(n)
    yield dl.CSRLinearOperator(
        jnp.asarray(dense[rows, indices]),
        indices,
        np.concatenate([[0], np.cumsum(mask.sum(1))]),
        jax.ShapeDtypeStruct((3, 4), jnp.float64),
    )


@pytest.mark.parametrize(
    "op",
    list(_operators()),
    ids=lambda op: f"{type(op).__name__}_{op.in_size()}",
)
@pytest.mark.parametrize(
    "dense_below",
    # The default threshold (small operators made dense) is the second case: slow tier.
    [0, pytest.param(None, marks=pytest.mark.slow)],
    ids=["structured", "default"],
)
def test_operator_against_its_matrix(op, dense_below):
    A = np.asarray(op.as_matrix())
    v = jnp.asarray(np.random.RandomState(4).randn(*op.in_structure().shape))
    np.testing.assert_allclose(op.mv(v).reshape(-1), A @ np.asarray(v).reshape(-1), rtol=1e-12)
    np.testing.assert_allclose(op.T.as_matrix(), A.T, rtol=1e-12)
    np.testing.assert_allclose(lx.diagonal(op), np.diag(A), rtol=1e-12)
    assert lx.materialise(op) is op and lx.linearise(op) is op
    b = jnp.asarray(np.random.RandomState(5).randn(*op.out_structure().shape))
    expected = np.linalg.solve(A, np.asarray(b).reshape(-1))
    kwargs = {} if dense_below is None else {"dense_below": dense_below}
    solver = dl.StructuredLinearSolver(**kwargs)
    x = lx.linear_solve(op, b, solver).value
    assert x.shape == op.in_structure().shape
    np.testing.assert_allclose(np.asarray(x).reshape(-1), expected, rtol=1e-8, atol=1e-9)
    # The transposed system, through lineax's transpose of the solver state.
    state = solver.init(op, {})
    t_state, _ = solver.transpose(state, {})
    xt, _, _ = solver.compute(t_state, jnp.reshape(b, op.in_structure().shape), {})
    np.testing.assert_allclose(
        np.asarray(xt).reshape(-1),
        np.linalg.solve(A.T, np.asarray(b).reshape(-1)),
        rtol=1e-8,
        atol=1e-9,
    )


@pytest.mark.parametrize("m", [2, 3, 5])
def test_block_inverse_pivots(m):
    # Blocks whose leading entries are zero or tiny, so that every elimination step must
    # pivot (the written-out elimination up to 3 x 3, the loop above), against NumPy.
    rng = np.random.RandomState(m)
    blocks = rng.randn(50, m, m) + m * np.eye(m)[::-1]
    blocks[:25, 0, 0] = 0.0
    blocks[25:, 0, 0] = 1e-12
    for dtype in (jnp.float64, jnp.complex128):
        b = jnp.asarray(blocks * (1 + 0.5j) if dtype == jnp.complex128 else blocks, dtype)
        np.testing.assert_allclose(
            _linear_solver._inverse_blocks(b), np.linalg.inv(np.asarray(b)), rtol=1e-9, atol=1e-9
        )


def _pollu_like(n, per_row=10, seed=0):
    rng = np.random.RandomState(seed)
    cols = np.stack([np.arange(n)] + [rng.randint(0, n, n) for _ in range(per_row - 1)])
    values = jnp.asarray(rng.randn(n, per_row)).at[:, 0].add(per_row + 2)
    return dl.SparseLinearOperator(values, cols, jax.ShapeDtypeStruct((n,), values.dtype))


@pytest.mark.slow
def test_small_sparse_is_solved_dense():
    """A sparse operator of fewer than `dense_below` unknowns (a POLLU-like pattern of 20,
    a periodic stencil of 32) is LU-factored dense, as measured faster; with
    `dense_below=0` it takes the structured path. Both agree with a dense solve."""
    from diffrax_linearize._linear_solver import _Delegate

    ring = np.stack([(np.arange(32) + s) % 32 for s in (0, -1, 1)])
    ring_values = jnp.asarray(np.random.RandomState(1).randn(32, 3)).at[:, 0].add(4.0)
    stencil = dl.SparseLinearOperator(ring_values, ring, jax.ShapeDtypeStruct((32,), jnp.float64))
    for op in (_pollu_like(20), stencil):
        A = np.asarray(op.as_matrix())
        b = jnp.asarray(np.random.RandomState(2).randn(op.in_size()))
        expected = np.linalg.solve(A, np.asarray(b))
        default = dl.StructuredLinearSolver()
        assert default.dense_below == 128
        state = default.init(op, {})
        assert isinstance(state, _Delegate) and isinstance(state.solver, lx.LU)
        structured = dl.StructuredLinearSolver(dense_below=0)
        assert not isinstance(structured.init(op, {}), _Delegate)
        for solver in (default, structured):
            x = lx.linear_solve(op, b, solver).value
            np.testing.assert_allclose(x, expected, rtol=1e-8, atol=1e-10)
        # The transposed system, through LU's transpose.
        t_state, _ = default.transpose(state, {})
        xt, _, _ = default.compute(t_state, b, {})
        np.testing.assert_allclose(xt, np.linalg.solve(A.T, np.asarray(b)), rtol=1e-8)
        # In the compiled solve: LAPACK's LU, not the band's scan or GMRES's loop.
        jaxpr = str(jax.make_jaxpr(lambda v: lx.linear_solve(op, v, default).value)(b))
        assert "lu" in jaxpr and "while" not in jaxpr and "scan" not in jaxpr
    # At the threshold and above, and with a preconditioner: the structured path.
    big = _pollu_like(128)
    assert not isinstance(dl.StructuredLinearSolver().init(big, {}), _Delegate)
    options = {"preconditioner": lx.IdentityLinearOperator(stencil.in_structure())}
    assert not isinstance(dl.StructuredLinearSolver().init(stencil, options), _Delegate)
    with pytest.raises(ValueError, match="dense_below"):
        dl.StructuredLinearSolver(dense_below=-1)


def _robertson_step_matrix(h_gamma):
    """`I - h γ J` at a point of Robertson's transient: stiff, and ill-conditioned for a
    large step."""
    y2, y3 = 3.6e-5, 0.1
    J = np.array(
        [
            [-0.04, 1e4 * y3, 1e4 * y2],
            [0.04, -1e4 * y3 - 6e7 * y2, -1e4 * y2],
            [0.0, 6e7 * y2, 0.0],
        ]
    )
    return np.eye(3) - h_gamma * J


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.complex128])
def test_small_dense_is_inverted(dtype):
    """Up to `SMALL_DENSE` unknowns a dense operator is inverted by the unrolled
    Gauss-Jordan elimination (no LAPACK call, no loop in the compiled solve), above it
    LU-factored by lineax; both exact up to rounding against a float64 solve, on random
    matrices (rows permuted), on matrices that need pivoting and on Robertson's `I - h γ J`
    for steps up to 1e8 (condition numbers up to about 1e12), and so is the transpose."""
    from diffrax_linearize._linear_solver import _Delegate, _SmallDense, SMALL_DENSE

    rng = np.random.RandomState(0)
    eps = float(jnp.finfo(dtype).eps)
    mats = []
    for n in (2, 3, SMALL_DENSE, SMALL_DENSE + 1):
        a = rng.randn(n, n) + 1j * rng.randn(n, n) if dtype == jnp.complex128 else rng.randn(n, n)
        mats.append(a[rng.permutation(n)])
    mats += [_robertson_step_matrix(hg) for hg in (1e-3, 1.0, 1e4, 1e8)]
    # Well conditioned, but wrong without pivoting: a tiny or zero leading pivot.
    mats += [np.array([[1e-20, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 2.0, 3.0]])]
    mats += [np.eye(SMALL_DENSE)[::-1]]
    solver = dl.StructuredLinearSolver()

    @jax.jit
    def solve(m, v):
        state = solver.init(lx.MatrixLinearOperator(m), {})
        t_state, _ = solver.transpose(state, {})
        return [solver.compute(st, v, {})[:2] for st in (state, t_state)]

    for a in mats:
        n = a.shape[0]
        m = jnp.asarray(a, dtype)
        a = np.asarray(m).astype(np.complex128)  # as rounded to `dtype`
        b = jnp.asarray(rng.randn(n), dtype)
        state = jax.eval_shape(lambda m: solver.init(lx.MatrixLinearOperator(m), {}), m)
        assert isinstance(state, _SmallDense if n <= SMALL_DENSE else _Delegate)
        cond = np.linalg.cond(a)
        for (x, result), mat in zip(solve(m, b), (a, a.T)):
            assert result == lx.RESULTS.successful
            expected = np.linalg.solve(mat, np.asarray(b))
            # Backward-stable solves: a forward error within the condition number times
            # the rounding unit (a wrong pivot or a swapped row is off by order one).
            err = np.max(np.abs(np.asarray(x) - expected)) / np.max(np.abs(expected))
            assert err <= 10 * n * eps * cond, (n, cond, err)
        # The factor and solve in the compiled code: LAPACK's only above `SMALL_DENSE`.
        names = primitive_names(solve, m, b)
        assert ("lu" in names) == (n > SMALL_DENSE) and "while" not in names, names


def test_small_dense_singular_like_lu():
    """A singular small matrix gives non-finite solutions, as lineax's LU does (a zero
    pivot is divided by), and lineax's LU still takes over above `SMALL_DENSE`."""
    for a in ([[1.0, 2.0], [2.0, 4.0]], [[0.0, 0.0, 0.0], [1.0, 2.0, 3.0], [0.0, 1.0, 1.0]]):
        op = lx.MatrixLinearOperator(jnp.asarray(a))
        b = jnp.ones(len(a))
        solve = jax.jit(lambda s: lx.linear_solve(op, b, s, throw=False).value, static_argnums=0)
        ours, lu = solve(dl.StructuredLinearSolver()), solve(lx.LU())
        assert not np.all(np.isfinite(lu))
        assert not np.all(np.isfinite(ours))


@pytest.mark.slow
def test_solver_on_materialised_operators_and_gradient():
    x = _input(2 * 6 * 6, jnp.float64)

    def solve(x, fn):
        op = dl.materialise_operator(lambda y: y - 0.05 * fn(y), x)
        return lx.linear_solve(op, jnp.cos(x), dl.StructuredLinearSolver()).value

    for name in ("robertson_stack", "brusselator_2d", "gray_scott_2d", "laplacian_pad"):
        fn, _ = FIELDS[name]
        n = 2 * 6 * 6 if name != "robertson_stack" else 72
        y = x[:n]
        J = jax.jacfwd(lambda y: y - 0.05 * fn(y))(y)
        expected = np.linalg.solve(J, np.cos(y))
        np.testing.assert_allclose(jax.jit(solve, static_argnums=1)(y, fn), expected, rtol=1e-7)
    # Differentiable, as any lineax solve.
    fn = FIELDS["brusselator_2d"][0]
    g = jax.grad(lambda x: jnp.sum(solve(x, fn) ** 2))(x)
    g_ref = jax.grad(
        lambda x: jnp.sum(
            jnp.linalg.solve(jax.jacfwd(lambda y: y - 0.05 * fn(y))(x), jnp.cos(x)) ** 2
        )
    )(x)
    np.testing.assert_allclose(g, g_ref, rtol=1e-6)


def test_operator_errors():
    with pytest.raises(ValueError, match="BlockDiagonalLinearOperator"):
        dl.BlockDiagonalLinearOperator(jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="BandedLinearOperator"):
        dl.BandedLinearOperator(jnp.ones((2, 4)), (0,))
    with pytest.raises(ValueError, match="SparseLinearOperator"):
        dl.SparseLinearOperator(
            jnp.ones((3, 1)), np.array([[0, 1, 5]]), jax.ShapeDtypeStruct((3,), jnp.float64)
        )
    with pytest.raises(ValueError, match="StructuredLinearSolver"):
        dl.StructuredLinearSolver(rtol=-1.0)
    with pytest.raises(ValueError, match="square"):
        op = dl.SparseLinearOperator(
            jnp.ones((2, 1)), np.array([[0, 1]]), jax.ShapeDtypeStruct((3,), jnp.float64)
        )
        lx.linear_solve(op, jnp.ones(2), dl.StructuredLinearSolver())


def test_operator_of_0d_input_transposes():
    """The Jacobian of `lax.pad` with respect to its 0-d padding value is a sparse column:
    its transpose has a 0-d output structure (whose truth value is an error, so it must not
    be tested with `or`)."""
    x = jnp.arange(1.0, 4.0)
    fn = lambda v: lax.pad(x, v, [(1, 2, 1)])
    v = jnp.float64(0.5)
    op = dl.materialise_operator(fn, v)
    assert isinstance(op, dl.SparseLinearOperator)
    ref = jacfwd_compiled(fn, v)
    np.testing.assert_array_equal(op.as_matrix()[:, 0], ref)
    u = jnp.arange(1.0, 1.0 + ref.size)
    assert op.T.out_structure() == jax.ShapeDtypeStruct((), jnp.float64)
    np.testing.assert_allclose(op.T.mv(u), ref @ u, rtol=1e-14)
    np.testing.assert_array_equal(op.T.as_matrix(), ref[None])


# ---- the sparse fallback ------------------------------------------------------------------


@pytest.mark.parametrize("steps", [3, 8])
def test_loop_by_colouring(steps):
    """A stencil applied `steps` times in a loop: no fixed point, so the pattern after
    `steps` iterations is found abstractly and the values come from `2 steps + 1`
    compressed evaluations of the loop (a band of that width), not from a dense basis."""
    x = _input(100, jnp.float64)
    fn = lambda y: lax.fori_loop(0, steps, lambda i, u: u + 0.1 * laplacian_pad(u), y)
    report = dl.structure_report(fn, x)
    assert report.coloured == {"scan": [2 * steps + 1]}
    assert report.kinds[0].startswith(f"banded, offsets -{steps}..{steps}")
    assert not report.densified
    for mode in ("forward", "reverse"):
        out = dl.materialise(fn, x, mode=mode, strict=True)
        assert_tree_allclose(out, jacfwd_compiled(fn, x), rtol=1e-11, atol=1e-12)
    assert isinstance(dl.materialise_operator(fn, x), dl.BandedLinearOperator)


def test_colourings_are_valid():
    from diffrax_linearize._colouring import _valid, colour_columns

    rng = np.random.RandomState(0)
    for trial in range(20):
        n, rows, entries = 30, 25, int(rng.randint(1, 6))
        columns = rng.randint(n, size=(entries, rows))
        live = rng.rand(entries, rows) < 0.8
        colours = colour_columns([(columns, live)], n, max_modular=4 if trial % 2 else 512)
        assert _valid(colours, [(columns, live)])
        # The check can fail: one colour for everything clashes in a row of two columns.
    columns = np.array([[0], [1]])
    assert not _valid(np.zeros(2, int), [(columns, np.ones((2, 1), bool))])


def test_structure_report():
    x = _input(3000, jnp.float64)
    report = dl.structure_report(robertson_stack, x)
    assert report.kinds == ["block-diagonal 1000 x 3 x 3: 9,000 numbers stored, dense 9,000,000"]
    assert "No dense fallback" in str(report)
    report = dl.structure_report(lambda y: _DOUBLE_FREE(y), x[:4])
    assert report.kinds[0].startswith("dense")


def _DOUBLE_FREE(y):
    return jnp.outer(y, y).sum(0)


# ---- structure lost, and said so --------------------------------------------------------


_PERMUTED = {
    "sort": (jnp.sort, {"forward": "gather", "reverse": "scatter-add"}),
    "top_k": (lambda x: lax.top_k(x, 3)[0], {"forward": "gather", "reverse": "scatter-add"}),
    "take_along_argsort": (
        lambda x: jnp.take_along_axis(jnp.sin(x), jnp.argsort(x), 0),
        {"forward": "gather", "reverse": "scatter-add"},
    ),
}


@pytest.mark.parametrize("name", list(_PERMUTED))
def test_data_dependent_permutation_is_reported(name):
    """A permutation or selection computed from the input (`jnp.sort`) is a gather whose
    indices are traced, so its pattern cannot be kept: the report names the primitive and
    why instead of saying "No dense fallback", and `strict=True` raises."""
    fn, prims = _PERMUTED[name]
    x = jnp.asarray(np.random.RandomState(4).randn(8))
    for mode, p in prims.items():
        report = dl.structure_report(fn, x, mode=mode)
        assert report.kinds[0].startswith("dense")
        assert report.densified == {p: 1}
        (reason,) = report.reasons[p]
        assert "not known at trace time" in reason
        assert f"Dense fallback (structure lost): `{p}` (1x: its indices" in str(report)
        np.testing.assert_array_equal(dl.materialise(fn, x, mode=mode), jax.jacfwd(fn)(x))
        with pytest.raises(ValueError, match=rf"`{p}` \(1x: its indices are not known"):
            dl.materialise(fn, x, mode=mode, strict=True)


def test_known_permutation_is_not_reported():
    # The same gather with indices known at trace time keeps its pattern: nothing lost.
    x = jnp.asarray(np.random.RandomState(4).randn(8))
    perm = np.argsort(np.asarray(x))
    fn = lambda y: jnp.take_along_axis(jnp.sin(y), perm, 0)
    report = dl.structure_report(fn, x)
    assert not report.densified and not report.reasons
    assert isinstance(dl.materialise_operator(fn, x), dl.SparseLinearOperator)
    np.testing.assert_array_equal(dl.materialise(fn, x), jax.jacfwd(fn)(x))


def test_traced_dynamic_slice_is_reported():
    x = jnp.asarray(np.random.RandomState(4).randn(8))
    fn = lambda y, i: lax.dynamic_slice(jnp.sin(y), (i,), (3,))
    i = jnp.int32(2)
    report = dl.structure_report(fn, x, i, mode="forward")
    assert report.reasons == {"dynamic_slice": ["its start indices are not known at trace time"]}
    # Reverse mode: its transpose, a `dynamic_update_slice` at the same traced offset.
    report = dl.structure_report(fn, x, i, mode="reverse")
    assert list(report.reasons) == ["dynamic_update_slice"]
    assert "not known at trace time" in report.reasons["dynamic_update_slice"][0]
    for mode in ("forward", "reverse"):
        np.testing.assert_array_equal(dl.materialise(fn, x, i, mode=mode), jax.jacfwd(fn)(x, i))


_POOLS = {
    "sum": lambda x: lax.reduce_window(x, 0.0, lax.add, (3,), (1,), "VALID"),
    "sum_dilated": lambda x: lax.reduce_window(
        jnp.sin(x), 0.0, lax.add, (2,), (2,), ((1, 2),), base_dilation=(2,), window_dilation=(2,)
    ),
    "max": lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (3,), (1,), "VALID"),
    # Ties (relu's zeros, the repeated 1.9) break as the primitive breaks them.
    "max_ties": lambda x: lax.reduce_window(jax.nn.relu(x), -jnp.inf, lax.max, (3,), (2,), "SAME"),
    "max_dilated": lambda x: lax.reduce_window(
        x, -jnp.inf, lax.max, (2,), (1,), "VALID", window_dilation=(3,)
    ),
    "min_2d": lambda x: lax.reduce_window(
        x.reshape(2, 4), jnp.inf, lax.min, (2, 2), (1, 1), ((0, 1), (1, 0))
    ),
}


@pytest.mark.parametrize("name", list(_POOLS))
def test_pool_keeps_the_window_pattern(name):
    """`reduce_window` sums and max/min pools are shifted slices (selected, for a pool, by
    the traced primal): a sparse pattern of one entry per window element, not dense."""
    fn = _POOLS[name]
    x = jnp.asarray([0.3, -1.2, 2.5, 1.9, -0.4, 1.9, 0.7, 0.0])
    expected = jacfwd_compiled(fn, x)
    if name != "max_dilated":  # JAX has no transpose for a dilated pool: forward only
        assert_tree_allclose(jax.jacrev(fn)(x), expected)
    for mode in ("forward", "reverse"):
        report = dl.structure_report(fn, x, mode=mode)
        assert not report.densified
        # `sum_dilated` reads only the padding: its Jacobian is zero, stored as no entries.
        assert report.kinds[0].startswith(("sparse", "banded", "zero")), report.kinds
        np.testing.assert_array_equal(dl.materialise(fn, x, mode=mode, strict=True), expected)
        op = dl.materialise_operator(fn, x, mode=mode)
        sparse = (dl.SparseLinearOperator, dl.BandedLinearOperator, dl.BlockDiagonalLinearOperator)
        assert isinstance(op, sparse), type(op)
        np.testing.assert_array_equal(op.as_matrix(), expected.reshape(-1, 8))


def test_unwrap_reports_its_cumsum():
    # `jnp.unwrap`'s Jacobian is the identity only numerically: the correction's tangent is
    # masked by predicates computed from the input, then summed cumulatively, a triangular
    # map stored dense. The report says where.
    x = jnp.asarray([0.3, 3.5, -2.9, 0.7, 6.1, 1.9])
    for mode in ("forward", "reverse"):
        report = dl.structure_report(jnp.unwrap, x, mode=mode)
        (reason,) = report.reasons["cumsum"]
        assert "triangular" in reason
        np.testing.assert_array_equal(
            dl.materialise(jnp.unwrap, x, mode=mode), jax.jacfwd(jnp.unwrap)(x)
        )
    # A cumulative sum of a block already dense along the axis loses nothing.
    A = jnp.asarray(np.random.RandomState(0).randn(6, 6))
    report = dl.structure_report(lambda y: jnp.cumsum(A @ y), x)
    assert not report.densified and not report.reasons


@pytest.mark.parametrize("size", [1, 7, 40])
def test_gather_sum_as_scatter_add(size):
    """`gather_sum` (the first source of each destination gathered, the rest added) is
    `zeros.at[dest].add(val[src])`, with empty destinations zero and repeated ones summed,
    over trailing axes too, eager and jitted."""
    rng = np.random.RandomState(size)
    val = jnp.asarray(rng.randn(30, 3))
    src = rng.randint(0, 30, 50)
    dest = rng.randint(0, size, 50)
    expected = np.zeros((size, 3))
    np.add.at(expected, dest, np.asarray(val)[src])
    assert (np.bincount(dest, minlength=size) > 1).any()  # the test can fail: repeats
    jitted = jax.jit(lambda v: _sparsity.gather_sum(v, src, dest, size))
    for got in (_sparsity.gather_sum(val, src, dest, size), jitted(val)):
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rest", [(), (3,)])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("assemble", ["_rows_by_scatter", "_rows_by_selects"])
def test_row_assembly_as_add_at(assemble, masked, rest):
    """Both ways a row-compressed block is made dense (the scatter of CPUs and GPUs, the
    selects of TPUs, chosen by `jax.lax.platform_dependent`, so that only one of them runs
    on this machine in `materialise`) are `np.add.at` over the live slots: repeated columns
    summed, dead slots' values, even NaNs, left out, over trailing axes too, jitted."""
    rng = np.random.RandomState(len(rest) + 2 * masked)
    n_rows, S, size = 9, 5, 11
    cols = rng.randint(0, size, (n_rows, S))
    live = rng.rand(n_rows, S) > 0.3 if masked else None
    val = rng.randn(n_rows, S, *rest)
    if masked:
        live[0, 0] = False
        val[0, 0] = np.nan
    keep = np.ones((n_rows, S), bool) if live is None else live
    expected = np.zeros((n_rows, size) + rest)
    rows = np.broadcast_to(np.arange(n_rows)[:, None], (n_rows, S))
    np.add.at(expected, (rows[keep], cols[keep]), val[keep])
    assert any(len(set(c[k])) < k.sum() for c, k in zip(cols, keep))  # repeats in a row
    fn = getattr(_sparsity, assemble)
    got = jax.jit(lambda v: fn(v, cols, live, size))(jnp.asarray(val))
    # Bit for bit on a CPU or a GPU; a TPU's emulated float64 sums in another order
    # (2.2e-15 off on a v5e): there at most S roundings of the largest value.
    emulated = jax.default_backend() == "tpu"
    atol = S * np.finfo(np.float64).eps * np.nanmax(np.abs(val)) if emulated else 0
    np.testing.assert_allclose(got, expected, rtol=1e-14, atol=atol)


def test_selects_only_where_they_pay():
    """On a TPU the selects replace the scatter where their work, the output's size times
    the slots of a row, stays within a few thousand times the live entries: a 3 x 3
    convolution over 3 channels (the case measured), not a graph whose hub row makes every
    row as long as the state (the selects would cost n^3)."""
    conv = (8 * 16 * 16, 27), 3 * 16 * 16, 50784
    assert _sparsity._selects_pay(*conv, jnp.float32)
    assert _sparsity._selects_pay(*conv, jnp.bfloat16)
    # float64: emulated on a TPU, whose compiler aborts on the selects there. complex64
    # (a TPU's own, but never tried with the selects there) keeps the scatter too.
    assert not _sparsity._selects_pay(*conv, jnp.float64)
    assert not _sparsity._selects_pay(*conv, jnp.complex64)
    n = 10_000  # a star graph: one row of n entries, the others of two
    assert not _sparsity._selects_pay((n, n), n, 3 * n, jnp.float32)


# ---- a layer per cell ---------------------------------------------------------------------

_W1 = np.random.RandomState(1).randn(16, 4) / 2
_W2 = np.random.RandomState(2).randn(4, 16) / 4


def _cell_layers(y):
    # The same MLP per cell without `jax.vmap`: the cells are the rows of a matrix product.
    h = jnp.tanh(y.reshape(-1, 4) @ _W1.T)
    return (h @ _W2.T + jnp.roll(y.reshape(-1, 4), 1, 0)).reshape(-1)


@pytest.mark.parametrize("fn", [structure.cell_mlp, _cell_layers], ids=["vmap", "matmul"])
def test_layer_per_cell_is_a_product_per_cell(fn):
    # The hidden units of a cell all read the cell's inputs: the second layer contracts
    # them by one matrix product, never forming the `entries x hidden x cells x outputs`
    # numbers (`64 n`) that folding them into the entries one by one would; the largest
    # value is the first layer's (at most 8 entries x 16 hidden units a cell).
    n = 4 * 50
    x = _input(n, jnp.float64)
    J = jacfwd_compiled(fn, x)
    op = dl.materialise_operator(fn, x)
    assert isinstance(op, dl.SparseLinearOperator), type(op)
    np.testing.assert_allclose(op.as_matrix(), J, **_TOL[jnp.float64])
    assert op.values.size == n * np.count_nonzero(np.asarray(J), axis=1).max()
    from diffrax_linearize._interpreter import iter_eqns

    jaxpr = jax.make_jaxpr(lambda x: dl.materialise_operator(fn, x))(x).jaxpr
    largest = max(int(np.prod(v.aval.shape)) for e in iter_eqns(jaxpr) for v in e.outvars)
    assert largest <= 32 * n
