"""Materialising Diffrax terms.

Diffrax keeps the interaction of a vector field with its control abstract:
`diffrax.AbstractTerm.prod` is any bilinear map. The functions here give the matrix of
`control -> term.prod(term.vf(t, y, args), control)`, its derivative with respect to the
state, and the structure queries that the Milstein solvers use, all through the structure
engine rather than `jax.jacfwd`.
"""

import functools
from typing import Literal

import diffrax
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.flatten_util import ravel_pytree
from jaxtyping import Array, PyTree

from ._compat import used_inputs
from ._custom_types import MaterialiseMode
from ._diagonal import jacobian_diagonal
from ._interpreter import may_add_constants
from ._materialise import (
    _materialise,
    materialise,
    materialise_operator,
    solver_jacobian,
    structured_blocks,
)
from ._sparsity import ell_to_plain
from ._structure import contract, fresh_label, place


NoiseStructure = Literal["additive", "scalar", "diagonal", "general"]
"""The noise structures that [`diffrax_linearize.noise_structure`][] tells apart, as the
type `Literal["additive", "scalar", "diagonal", "general"]`:

- `"additive"`: the diffusion does not depend on the state;
- `"scalar"`: one noise channel;
- `"diagonal"`: the diffusion matrix is diagonal (one state array and one control array of
  the same shape);
- `"general"`: anything else.

Additive, scalar and diagonal noise (with $g_{ii}$ depending on $y_i$ only) are
commutative, so [`diffrax_linearize.ItoMilstein`][] converges with strong order one on
them; for general noise use [`diffrax_linearize.GeneralItoMilstein`][].
"""


def _check_term(term, api: str):
    if not isinstance(term, diffrax.AbstractTerm):
        raise TypeError(f"`{api}` expects a `diffrax.AbstractTerm`, got {type(term).__name__}.")


def control_zeros(term: diffrax.AbstractTerm, t) -> PyTree[Array]:
    """Zeros shaped like `term.contr(t0, t1)`: the control space of `term`."""
    shapes = jax.eval_shape(lambda t: term.contr(t, t), t)
    return jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


class _PromotingProducts(diffrax.AbstractTerm):
    """`term` whose products with its control promote under JAX's standard rules."""

    term: diffrax.AbstractTerm

    def vf(self, t, y, args):
        return self.term.vf(t, y, args)

    def contr(self, t0, t1, **kwargs):
        return self.term.contr(t0, t1, **kwargs)

    def prod(self, vf, control):
        with jax.numpy_dtype_promotion("standard"):
            return self.term.prod(vf, control)

    def vf_prod(self, t, y, args, control):
        with jax.numpy_dtype_promotion("standard"):
            return self.term.vf_prod(t, y, args, control)

    def is_vf_expensive(self, t0, t1, y, args):
        return self.term.is_vf_expensive(t0, t1, y, args)


def real_noise_on_complex_state(terms: diffrax.MultiTerm, t0, y0) -> diffrax.MultiTerm:
    """`MultiTerm(drift, diffusion)`, its diffusion's products with the control promoting
    where the state is complex and the control real: a real Brownian motion driving a
    complex SDE. The control stays real (a complex one is taken to be a complex Brownian
    motion, whose Itô correction differs); each product promotes, as Diffrax's stochastic
    Runge-Kutta solvers promote theirs, so that the step runs under JAX's strict
    promotion (`jax_numpy_dtype_promotion="strict"`) too."""
    drift, diffusion = terms.terms
    if not any(jnp.iscomplexobj(y) for y in jtu.tree_leaves(y0)):
        return terms
    control = jax.eval_shape(lambda t: diffusion.contr(t, t), t0)
    if not any(jnp.issubdtype(c.dtype, jnp.floating) for c in jtu.tree_leaves(control)):
        return terms
    return diffrax.MultiTerm(drift, _PromotingProducts(diffusion))


def _vf(term, t, y, args, api: str):
    """`term.vf(t, y, args)`, checking that `term.prod` of it gives a `y`-shaped result."""
    control = control_zeros(term, t)
    try:
        out = jax.eval_shape(lambda y: term.prod(term.vf(t, y, args), control), y)
    except Exception as e:
        raise ValueError(
            f"`{api}`: evaluating `term.prod(term.vf(t, y, args), control)` failed for the "
            f"given `y` ({_describe(y)}). `y` must be a state of the shape and structure the "
            f"term's vector field expects. The error was: {type(e).__name__}: {e}"
        ) from e
    y_struct = jax.eval_shape(lambda: y)
    if jtu.tree_structure(out) != jtu.tree_structure(y_struct) or any(
        a.shape != b.shape for a, b in zip(jtu.tree_leaves(out), jtu.tree_leaves(y_struct))
    ):
        raise ValueError(
            f"`{api}`: `term.prod(term.vf(t, y, args), control)` has structure "
            f"{_describe(out)} but `y` has structure {_describe(y_struct)}. `y` must be a "
            "state of the structure the term's vector field is written for."
        )
    return term.vf(t, y, args), control


def _describe(tree) -> str:
    leaves = jtu.tree_leaves(tree)
    return f"{jtu.tree_structure(tree)} with shapes {[tuple(jnp.shape(x)) for x in leaves]}"


def _is_holomorphic(control) -> bool:
    leaves = jtu.tree_leaves(control)
    return bool(leaves) and all(jnp.iscomplexobj(x) for x in leaves)


# `materialise(term, t, y, args)` is a `singledispatch` registration: Python would
# report missing arguments against the private functions below, so they are checked here.
_MISSING = object()


def _check_point(t, y, args, api: str):
    missing = [name for name, x in (("t", t), ("y", y), ("args", args)) if x is _MISSING]
    if missing:
        raise TypeError(
            f"`{api}(term, t, y, args)` evaluates the term's vector field as "
            f"`term.vf(t, y, args)`, but {', '.join(f'`{m}`' for m in missing)} "
            f"{'was' if len(missing) == 1 else 'were'} not given. Pass all three, with "
            f"`args=None` if the vector field takes no arguments: `{api}(term, t, y, None)`."
        )


@materialise.register(diffrax.AbstractTerm)
def _materialise_term(
    term: diffrax.AbstractTerm,
    t=_MISSING,
    y=_MISSING,
    args=_MISSING,
    *,
    mode: MaterialiseMode = "auto",
    strict: bool = False,
):
    """The matrix of the linear map `control -> term.prod(term.vf(t, y, args), control)`, in
    exactly the layout of `jax.jacfwd(lambda c: term.prod(term.vf(t, y, args), c))(control)`
    for a control shaped like `term.contr(t0, t1)`: for pytree states and controls, diffrax's
    `(tree(y), tree(control), leaf(y), leaf(control))` layout.

    A `diffrax.ControlTerm` whose vector field returns an array gives that array back with no
    work; one returning a `lineax` operator gives its matrix; any other term (`ODETerm`,
    `MultiTerm`, your own subclass with a custom bilinear `prod`) goes through the structure
    engine. Non-finite entries are the vector field's own: unlike `jax.jacfwd` (and
    [`diffrax_linearize.materialise`][] of a function), no `0 * inf` NaNs are added where
    they meet the zeros of a basis.

    **Arguments:**

    - `term`: any `diffrax.AbstractTerm`.
    - `t`, `y`, `args`: where to evaluate the vector field.
    - `mode`, `strict`: as for [`diffrax_linearize.materialise`][].

    **Returns:** a pytree of arrays as described.
    """
    api = "diffrax_linearize.materialise"
    _check_point(t, y, args, api)
    vf, control = _vf(term, t, y, args, api)
    # The matrix as the vector field gives it: without `materialise`'s check for
    # `jax.jacfwd`'s `0 * inf` NaNs, which the solvers that call this have no use for, and
    # which under `jax.vmap` (ensembles) would recompute every matrix as `jax.jacfwd` does.
    return _materialise(
        lambda c, vf: term.prod(vf, c),
        (control, vf),
        0,
        _is_holomorphic(control),
        mode,
        strict,
        nan_as_jacfwd=False,
    )


@materialise_operator.register(diffrax.AbstractTerm)
def _materialise_operator_term(
    term: diffrax.AbstractTerm,
    t=_MISSING,
    y=_MISSING,
    args=_MISSING,
    *,
    mode: MaterialiseMode = "auto",
    strict: bool = False,
):
    """The linear map `control -> term.prod(term.vf(t, y, args), control)` as a `lineax`
    operator keeping its structure: a diagonal vector field gives a
    `lineax.DiagonalLinearOperator`, an array vector field a `lineax.MatrixLinearOperator`."""
    api = "diffrax_linearize.materialise_operator"
    _check_point(t, y, args, api)
    vf, control = _vf(term, t, y, args, api)
    return materialise_operator(
        lambda c, vf: term.prod(vf, c), control, vf, mode=mode, strict=strict
    )


def vf_derivative(term: diffrax.AbstractTerm, t, y, args) -> PyTree[Array]:
    """The derivative with respect to the state of the term's matrix: the Jacobian of
    `y -> materialise(term, t, y, args)`, in `jax.jacfwd` layout (for array `y` and control:
    shape `(d, m, d)`, entry `[i, j, k]` being $\\partial g_{ij} / \\partial y_k$).

    Computed by the structure engine: for a diffusion linear in `y`, `g(y) = A y`, the stored
    tensor `A` comes back with no work.

    **Arguments:** `term`, `t`, `y`, `args` as for [`diffrax_linearize.materialise`][].

    **Returns:** a pytree of arrays.
    """
    api = "diffrax_linearize.vf_derivative"
    _check_term(term, api)
    _vf(term, t, y, args, api)
    return solver_jacobian(lambda y: materialise(term, t, y, args), y)


# ---- structure queries ----------------------------------------------------------------


def _matrix_blocks(term, t, y, args, api):
    vf, control = _vf(term, t, y, args, api)
    blocks, _, _ = structured_blocks(lambda c, vf: term.prod(vf, c), control, vf)
    return blocks, control


def _is_complex(term, t, y, args) -> bool:
    structs = jax.eval_shape(lambda y: (y, control_zeros(term, t), term.vf(t, y, args)), y)
    return any(jnp.issubdtype(x.dtype, jnp.complexfloating) for x in jtu.tree_leaves(structs))


def _check_real(term, t, y, args, api: str):
    if _is_complex(term, t, y, args):
        raise TypeError(
            f"`{api}` classifies real noise only (the structure engine works over the real "
            "numbers), but the state, the control or the vector field is complex. "
            "`diffrax_linearize.milstein_trace_term` and the Milstein solvers accept "
            "complex terms."
        )


def _dense_matrix_flat(term, t, args):
    """`y -> [M[q][p] for q for p]`: the term's matrix, flattened into blocks."""

    def fn(y):
        m = materialise(term, t, y, args)
        return jtu.tree_leaves(m)

    return fn


def noise_structure(term: diffrax.AbstractTerm, t, y, args) -> NoiseStructure:
    """Classify the noise of a diffusion term at trace time, from the structure the engine
    detects (no numbers are compared):

    - `"additive"`: the term's matrix does not depend on `y`;
    - `"scalar"`: the control has a single element;
    - `"diagonal"`: one state array and one control array of the same shape, and the matrix
      is diagonal (for example a vector field returning a `lineax.DiagonalLinearOperator`);
    - `"general"`: anything else.

    **Arguments:** `term`, `t`, `y`, `args` as for [`diffrax_linearize.materialise`][].

    **Returns:** one of the strings above (a Python string: usable in Python control flow
    inside `jax.jit`).
    """
    api = "diffrax_linearize.noise_structure"
    _check_term(term, api)
    return _noise_structure(term, t, y, args, api)


def _noise_structure(term, t, y, args, api: str) -> NoiseStructure:
    _vf(term, t, y, args, api)
    _check_real(term, t, y, args, api)
    blocks, control = _matrix_blocks(term, t, y, args, api)
    dblocks, _, _ = structured_blocks(_dense_matrix_flat(term, t, args), y)
    if all(b is None for row in dblocks for b in row):
        return "additive"
    if sum(jnp.size(c) for c in jtu.tree_leaves(control)) == 1:
        return "scalar"
    if len(blocks) == 1 and len(blocks[0]) == 1 and blocks[0][0] is not None:
        if blocks[0][0].kind() in ("identity", "scaled_identity", "diagonal"):
            return "diagonal"
    return "general"


def is_additive_noise(term: diffrax.AbstractTerm, t, y, args) -> bool:
    """Whether `noise_structure(term, t, y, args) == "additive"`; see
    [`diffrax_linearize.noise_structure`][]."""
    return noise_structure(term, t, y, args) == "additive"


def is_scalar_noise(term: diffrax.AbstractTerm, t, y, args) -> bool:
    """Whether the control of `term` has a single element, that is whether
    `noise_structure(term, t, y, args) == "scalar"`; see
    [`diffrax_linearize.noise_structure`][]."""
    return noise_structure(term, t, y, args) == "scalar"


def is_diagonal_noise(term: diffrax.AbstractTerm, t, y, args) -> bool:
    """Whether `noise_structure(term, t, y, args) == "diagonal"`; see
    [`diffrax_linearize.noise_structure`][]."""
    return noise_structure(term, t, y, args) == "diagonal"


def _quadratic(term, t, y, args, control):
    """$\\sum_{j_1 j_2} c_{j_1} c_{j_2} L^{j_1} g^{j_2}$: one JVP of `y -> g(y) c` in the
    direction `g(y) c`."""

    def g_c(y):
        return term.prod(term.vf(t, y, args), control)

    direction = g_c(y)
    return jax.jvp(g_c, (y,), (direction,))[1]


def _trace_by_channels(term, t, y, args) -> PyTree[Array]:
    """The Itô correction of `milstein_trace_term` by one JVP per noise channel: for
    complex terms, which the structure engine does not take."""
    control = control_zeros(term, t)
    flat, unravel = ravel_pytree(control)
    basis = jax.vmap(unravel)(jnp.eye(flat.size, dtype=flat.dtype))
    vf = term.vf(t, y, args)

    def along(e, direction):
        # The derivative of y -> g(y) e in the direction g(y) `direction`.
        column = lambda _y: term.prod(term.vf(t, _y, args), e)
        return jax.jvp(column, (y,), (term.prod(vf, direction),))[1]

    def channel(e):
        if not jnp.iscomplexobj(flat):
            return along(e, e)
        # Re W_j and Im W_j, each of variance h/2: columns g e_j and i g e_j, so
        # (1/2) (D(g e_j)[g e_j] + D(i g e_j)[i g e_j]), and D(i g e_j) = i D(g e_j).
        i_e = jtu.tree_map(lambda x: 1j * x, e)
        with jax.numpy_dtype_promotion("standard"):
            return jtu.tree_map(lambda a, b: 0.5 * (a + 1j * b), along(e, e), along(e, i_e))

    return jtu.tree_map(lambda x: jnp.sum(x, axis=0), jax.vmap(channel)(basis))


def milstein_trace_term(term: diffrax.AbstractTerm, t, y, args) -> PyTree[Array]:
    """$\\sum_j L^j g^j = \\sum_j (\\partial g_{:, j} / \\partial y)\\, g_{:, j}$: the
    derivative of each column of the diffusion matrix in the direction of that column,
    summed over the noise channels. This is the Itô correction of the Milstein method, and
    (times $-\\tfrac12$) the drift correction between Itô and Stratonovich SDEs.

    Exact for any noise, and computed from the detected structure: zero for additive noise;
    one JVP for scalar noise; for diagonal noise $g = \\mathrm{diag}(\\sigma(y))$,
    $\\sigma \\odot \\mathrm{diag}(\\partial \\sigma / \\partial y)$ with the diagonal of
    the structured Jacobian of $\\sigma$ (free when $\\sigma$ acts elementwise); otherwise
    one contraction of the structured derivative of the diffusion matrix with the matrix
    (for $g(y) = A y$ the stored tensor $A$; for $g_{ij} = y_i G_{ij}$ a delta times $G$),
    never `m` JVPs through `prod` and never a dense `d x m x d` tensor unless the
    derivative is dense.

    Complex states, controls or vector fields are supported, by one JVP per noise channel
    (the structure engine works over the reals). A complex control is taken to be a
    complex Brownian motion as Diffrax samples it, real and imaginary parts independent
    with variance $h/2$ each: its real noise channels are $\\mathrm{Re}\\,W_j$ and
    $\\mathrm{Im}\\,W_j$, so the Itô correction is
    $\\tfrac12 \\sum_j (L^j g_{:, j} + i\\, \\partial g_{:, j}[i\\, g_{:, j}])$, zero for a
    diffusion holomorphic in $y$ (for which Itô and Stratonovich calculus agree).

    **Arguments:** `term`, `t`, `y`, `args` as for [`diffrax_linearize.materialise`][].

    **Returns:** a pytree like `y`.
    """
    api = "diffrax_linearize.milstein_trace_term"
    _check_term(term, api)
    _vf(term, t, y, args, api)
    if _is_complex(term, t, y, args):
        return _trace_by_channels(term, t, y, args)
    kind = _noise_structure(term, t, y, args, api)
    if kind == "additive":
        return jtu.tree_map(jnp.zeros_like, y)
    control = control_zeros(term, t)
    ones = jtu.tree_map(jnp.ones_like, control)
    if kind == "scalar":
        return _quadratic(term, t, y, args, ones)
    if kind == "diagonal":
        # g = diag(sigma): sum_j sum_k d g_ij / d y_k g_kj = sigma_i d sigma_i / d y_i.
        def sigma(y):
            return term.prod(term.vf(t, y, args), ones)

        s = sigma(y)
        return s * jacobian_diagonal(sigma, y).astype(s.dtype)
    return _contract_derivative(term, t, y, args, lambda m, r, p: [(1, m)])


def _contract_derivative(term, t, y, args, weight) -> PyTree[Array]:
    """$\\sum_{j, k} (\\partial g_{i j} / \\partial y_k)\\, W_{k j}$ for the matrix
    $W$ that `weight(g_rp, r, p)` gives per block (`g_rp` the block of the diffusion matrix
    for state leaf `r` and control leaf `p`, shaped as that block), as a list of
    `(coefficient, matrix)` terms and `(coefficient, (u, v))` outer products
    $u v^\\top$ (`u` shaped like leaf `r`, `v` like leaf `p`) whose sum is $W$.

    Where the derivative block stores more numbers than $W$ (for $g(y) = A y$ the tensor
    $A$) $W$ is formed and contracted once, so that each stored entry is read once; `v`
    enters it through `_materialised`, computed once rather than once per entry of `u`. Where
    it stores no more (for $g_{ij} = y_i G_{ij}$ a delta times $G$) each term is
    contracted on its own: an outer product as two vectors, so that nothing computed per
    entry of `u` or `v` (a Brownian increment's `erf_inv`) lands in a loop over the
    entries of $W$, where XLA would fuse and repeat it.

    Where moreover the diffusion is linear in the state, $g = D y$ with one state and one
    control array (for $g_{ij} = y_i G_{ij}$), a matrix term $g$ is contracted as
    $(D \\cdot D) \\cdot y$: the two copies of the derivative first, then `y`. For a delta
    times $G$ that is a sum of squares of $G$ over the noise channels (one reduction),
    which reads $G$ alone and depends on nothing else, so that XLA hoists it out of a
    solve's loop, where the contraction with $g$ reads $G$ and $g$ at every step."""
    matrix = jtu.tree_leaves(materialise(term, t, y, args))
    dblocks, _, _ = structured_blocks(_dense_matrix_flat(term, t, args), y)
    y_leaves, y_tree = jtu.tree_flatten(y)
    n_c = len(jtu.tree_leaves(control_zeros(term, t)))
    # Whether g = D y: asked only where it matters (it traces `term` twice more).
    linear = functools.cache(lambda: _linear_in_state(term, t, y, args))
    out = []
    for q, yq in enumerate(y_leaves):
        total = jnp.zeros(jnp.shape(yq), jnp.result_type(yq))
        nq = jnp.ndim(yq)
        for p in range(n_c):
            for r in range(len(y_leaves)):
                d = dblocks[q * n_c + p][r]
                if d is None:
                    continue
                d = ell_to_plain(d)
                g_rp = matrix[r * n_c + p]
                terms = weight(g_rp, r, p)
                y_labels = d.out_labels[:nq]
                in_labels = tuple(d.in_labels)
                c_labels = tuple(d.out_labels[nq:])
                dtype = jnp.result_type(g_rp)

                pieces = []
                # (`dt` may be a Python or a traced scalar of another precision.)
                with jax.numpy_dtype_promotion("standard"):
                    if jnp.size(d.val) > jnp.size(g_rp):
                        w_rp = sum(
                            c * jnp.multiply.outer(w[0], _materialised(w[1]))
                            if isinstance(w, tuple)
                            else c * w
                            for c, w in terms
                        )
                        pieces.append([(w_rp.astype(dtype), in_labels + c_labels)])
                    else:
                        for c, w in terms:
                            if isinstance(w, tuple):
                                u, v = (c * w[0]).astype(dtype), jnp.asarray(w[1], dtype)
                                pieces.append([(u, in_labels), (v, c_labels)])
                            elif w is g_rp and linear():
                                total = total + (c * _linear_trace(d, yq, nq)).astype(total.dtype)
                            else:
                                w_rp = (c * w).astype(dtype)
                                pieces.append([(w_rp, in_labels + c_labels)])
                for operands in pieces:
                    val, labels = contract([(d.val, d.val_labels), *operands], y_labels, d.sizes)
                    val = place(jnp.asarray(val), labels, y_labels)
                    total = total + jnp.broadcast_to(val, jnp.shape(yq)).astype(total.dtype)
        out.append(total)
    return jtu.tree_unflatten(y_tree, out)


def _materialised(x: Array) -> Array:
    """`x`, exactly, as the output of a matrix-vector product: computed once, into a buffer.

    An outer product $u v^\\top$ reads each entry of `v` once per entry of `u`, and XLA's
    CPU backend fuses a producer made of cheap elementwise operations (a Brownian
    increment's sampling: bits to a uniform, then the `erf_inv` polynomial) into such a
    consumer, recomputing it for every entry of the product (at d = m = 64, once per entry
    of a 64 x 64 matrix instead of 64 times). `lax.optimization_barrier` does not prevent
    this (none is left in the optimised CPU program, and the repetition stays); the operand
    of a dot is computed once, into a buffer. Here `[x, 0] . [1, 0]`, exact (`HIGHEST`
    precision, so a GPU's TF32 default cannot round it, and `x * 1 + 0 * 0` is `x`, NaN and
    infinity included), at two multiply-adds per entry."""
    x = jnp.asarray(x)
    flat = jnp.ravel(x)
    padded = jnp.stack([flat, jnp.zeros_like(flat)], axis=-1)
    select = jnp.array([1, 0], flat.dtype)
    out = jnp.dot(padded, select, precision=jax.lax.Precision.HIGHEST)
    return jnp.reshape(out, x.shape)


def _linear_in_state(term, t, y, args) -> bool:
    """Whether the term's matrix is, as far as its program shows, linear in the one state
    array `y` (with one control array): its derivative does not depend on `y` and it holds
    no constant term."""
    y_leaves, y_tree = jtu.tree_flatten(y)
    if len(y_leaves) != 1 or len(jtu.tree_leaves(control_zeros(term, t))) != 1:
        return False

    def derivative_values(*leaves):
        blocks, _, _ = structured_blocks(
            _dense_matrix_flat(term, t, args), jtu.tree_unflatten(y_tree, leaves)
        )
        return [ell_to_plain(b).val for row in blocks for b in row if b is not None]

    closed = jax.make_jaxpr(derivative_values)(*y_leaves)
    if any(used_inputs(closed.jaxpr, [True] * len(closed.jaxpr.outvars))):
        return False
    closed = jax.make_jaxpr(
        lambda *leaves: _dense_matrix_flat(term, t, args)(jtu.tree_unflatten(y_tree, leaves))
    )(*y_leaves)
    return not may_add_constants(closed.jaxpr, [True] * len(closed.jaxpr.invars))


def _linear_trace(d, y, nq: int):
    """$\\sum_{j, k} D_{i j k}\\, g_{k j}$ for a diffusion linear in the one state array
    `y`, $g_{k j} = \\sum_l D_{k j l}\\, y_l$, with `d` the (plain) block of $D$: the two
    copies of $D$ contracted first, then `y`."""
    y_labels = tuple(d.out_labels[:nq])
    c_labels = tuple(d.out_labels[nq:])
    in_labels = tuple(d.in_labels)
    # The second copy's row axes are the first copy's state axes (its `in_labels`), its
    # control axes the same; every other label is a new one.
    rename = dict(zip(y_labels, in_labels))
    rename.update((c, c) for c in c_labels)
    sizes = dict(d.sizes)
    for label in (*d.val_labels, *in_labels):
        if label not in rename:
            rename[label] = fresh_label()
            sizes[rename[label]] = d.sizes[label]
    first = (d.val, tuple(d.val_labels))
    second = (d.val, tuple(rename[label] for label in d.val_labels))
    state = tuple(rename[label] for label in in_labels)
    keep = y_labels + tuple(label for label in state if label not in y_labels)
    if set(first[1]) == set(second[1]):
        # The product, then a sum: one reduction over the noise channels (a sum of squares
        # for a delta times G), which XLA runs without writing the product.
        every = first[1]
        val, labels = contract(
            [(first[0] * place(second[0], second[1], every), every)], keep, sizes
        )
    else:
        val, labels = contract([first, second], keep, sizes)
    val, labels = contract([(jnp.asarray(val), labels), (y, state)], y_labels, sizes)
    val = place(jnp.asarray(val), labels, y_labels)
    return jnp.broadcast_to(val, jnp.shape(y))


def _linear_block(term, t, y, args, dblocks, max_size: int | None = None):
    """The one (plain) block of `dblocks`, the structured derivative $D$ of the term's
    matrix, where the term has one state array `y` and one control array, is linear in
    `y`, and the block stores at most `max_size` numbers if given; else `None`."""
    if len(jtu.tree_leaves(y)) != 1 or len(jtu.tree_leaves(control_zeros(term, t))) != 1:
        return None
    d = dblocks[0][0]
    if d is None:
        return None
    d = ell_to_plain(d)
    # The size first: whether g = D y traces the term twice more.
    if max_size is not None and jnp.size(d.val) > max_size:
        return None
    return d if _linear_in_state(term, t, y, args) else None


def _control_first(d, control: Array, vector: Array, nq: int, big: bool) -> Array:
    """$(D c)\\, v$: the derivative block `d` contracted with the control `c` first, a
    matrix with the state's axes twice (for $g(y) = A y$ the matrix $\\sum_j A_{i j k}
    c_j$, one pass over $A$; for $g_{ij} = y_i G_{ij}$ the vector $G c$), then with
    `vector` (shaped like the state). Two such products with the same control share the
    first contraction, which XLA computes once.

    With `big` (the block stores more numbers than $g$), the first contraction is a
    product and then a sum, which XLA runs as one reduction that reads the block once in
    its order: as a `dot_general` it contracts an axis in the middle of $A$, which XLA:CPU
    ran 6-9x slower than $A y$ (d = 64 and 256)."""
    y_labels = tuple(d.out_labels[:nq])
    c_labels = tuple(d.out_labels[nq:])
    in_labels = tuple(d.in_labels)
    keep = y_labels + tuple(label for label in in_labels if label not in y_labels)
    every = tuple(d.val_labels)
    if big and set(c_labels) <= set(every) and len(set(every)) == len(every):
        dtype = jnp.result_type(d.val, control)
        scaled = jnp.asarray(d.val, dtype) * place(jnp.asarray(control, dtype), c_labels, every)
        val, labels = contract([(scaled, every)], keep, d.sizes)
    else:
        val, labels = contract([(d.val, d.val_labels), (control, c_labels)], keep, d.sizes)
    val, labels = contract([(jnp.asarray(val), labels), (vector, in_labels)], y_labels, d.sizes)
    return place(jnp.asarray(val), labels, y_labels)


def linear_diffusion_prod(term, t, y, args, control, *, any_size: bool = False):
    """`term.vf_prod(t, y, args, control)`, $g(y)\\, c$, for a diffusion linear in the one
    state array `y` (general noise, one control array) whose structured derivative $D$
    stores no more numbers than $g$ (or any number, with `any_size`): one contraction of
    $D$ with `control` and then with `y`, without forming $g$ (for $g_{ij} = y_i G_{ij}$,
    $y \\odot (G c)$; for $g(y) = A y$, $(\\sum_j A_{: j :} c_j)\\, y$). `None` where this
    does not apply; there `term.vf_prod` forms $g$ and multiplies it.

    Forming $g$ writes and reads a $d \\times m$ array that the Milstein step needs for
    nothing else here: its correction contracts $D$ with $g\\, c$ and $c$ (for
    $g_{ij} = y_i G_{ij}$ the same $G c$, which XLA computes once) and its trace term reads
    $D$ alone. Where $D$ is bigger than $g$ ($g = A y$), the Itô step needs $g$ itself
    for its correction, so only the Stratonovich step asks `any_size`: its correction is
    $(D c)(g c)$, and with this $D c$ is formed once, one pass over $A$ for the whole
    step, where $g$ and then the JVP along $g c$ read $A$ twice."""
    if _is_complex(term, t, y, args):
        return None
    if len(jtu.tree_leaves(y)) != 1 or len(jtu.tree_leaves(control)) != 1:
        return None
    if _noise_structure(term, t, y, args, "diffrax_linearize.ItoMilstein") != "general":
        return None
    (g_struct,) = jtu.tree_leaves(jax.eval_shape(lambda y: materialise(term, t, y, args), y))
    dblocks, _, _ = structured_blocks(_dense_matrix_flat(term, t, args), y)
    d = _linear_block(term, t, y, args, dblocks, None if any_size else g_struct.size)
    if d is None:
        return None
    out_struct = jax.eval_shape(lambda y, c: term.vf_prod(t, y, args, c), y, control)
    ((yq,), (c,)) = jtu.tree_leaves(y), jtu.tree_leaves(control)
    (out_leaf,) = jtu.tree_leaves(out_struct)
    big = jnp.size(d.val) > g_struct.size
    val = _control_first(d, c, yq, jnp.ndim(yq), big)
    out = jnp.broadcast_to(val, out_leaf.shape).astype(out_leaf.dtype)
    return jtu.tree_unflatten(jtu.tree_structure(out_struct), [out])


def ito_milstein_correction(term, t, y, args, g_prod, dw, dt):
    """$\\sum_{j_1, j_2} (L^{j_1} g_{:, j_2}) (\\Delta W_{j_1} \\Delta W_{j_2} -
    \\delta_{j_1 j_2} \\Delta t)$, the double sum of the Itô Milstein step, where
    `g_prod` is $g(y) \\Delta W$, or `None` where this is not cheaper than one JVP along
    `g_prod` plus [`diffrax_linearize.milstein_trace_term`][] (additive, scalar, diagonal
    or complex noise).

    With $D_{i j k} = \\partial g_{i j} / \\partial y_k$ the sum is
    $\\sum_{j, k} D_{i j k} \\big((g \\Delta W)_k \\Delta W_j - \\Delta t\\, g_{k j}\\big)$:
    a contraction of the structured derivative with a matrix shaped like $g$, so each
    stored entry of $D$ is read once (for $g(y) = A y$ one pass over $A$ instead of two).
    Where the matrix is formed ($D$ stored bigger than $g$), $\\Delta W$ enters it through
    `_materialised`, so that its sampling is not repeated for each entry."""
    if _is_complex(term, t, y, args):
        return None
    if _noise_structure(term, t, y, args, "diffrax_linearize.ItoMilstein") != "general":
        return None
    g_leaves = jtu.tree_leaves(g_prod)
    dw_leaves = jtu.tree_leaves(dw)

    def weight(g_rp, r, p):
        return [(1, (g_leaves[r], dw_leaves[p])), (-dt, g_rp)]

    return _contract_derivative(term, t, y, args, weight)


def stratonovich_milstein_correction(term, t, y, args, g_prod, dw):
    """$\\sum_{j_1, j_2} (L^{j_1} g_{:, j_2}) \\Delta W_{j_1} \\Delta W_{j_2}$, the double
    sum of the Stratonovich Milstein step, where `g_prod` is $g(y) \\Delta W$, or `None`
    where this is not cheaper than one JVP of $y \\mapsto g(y) \\Delta W$ along `g_prod`.

    Cheaper for general noise whose structured derivative stores, block by block, no more
    numbers than $g$ (for $g_{ij} = f(y_i) G_{ij}$ a delta times $G$): there it is
    $(g \\Delta W) \\odot (D \\Delta W)$, one matrix-vector product per block, where the
    JVP forms $D \\odot (g \\Delta W)$, a $d \\times m$ array, for one. Where the derivative
    is bigger ($g = A y$) both read it once, and the JVP is kept."""
    api = "diffrax_linearize.StratonovichMilstein"
    if _is_complex(term, t, y, args) or _noise_structure(term, t, y, args, api) != "general":
        return None
    matrix = jtu.tree_leaves(materialise(term, t, y, args))
    dblocks, _, _ = structured_blocks(_dense_matrix_flat(term, t, args), y)
    n_y, n_c = len(jtu.tree_leaves(y)), len(jtu.tree_leaves(dw))
    for q in range(n_y):
        for p in range(n_c):
            for r in range(n_y):
                d = dblocks[q * n_c + p][r]
                if d is not None and jnp.size(ell_to_plain(d).val) > jnp.size(matrix[r * n_c + p]):
                    # Bigger than g: for g = D y, (D c)(g c), sharing D c with the step's
                    # g c (`linear_diffusion_prod(..., any_size=True)`); otherwise the JVP.
                    d = _linear_block(term, t, y, args, dblocks)
                    if d is None:
                        return None
                    ((yq,), (c,), (v,)) = (jtu.tree_leaves(x) for x in (y, dw, g_prod))
                    v = jnp.asarray(v, jnp.result_type(yq))
                    val = _control_first(d, c, v, jnp.ndim(yq), big=True)
                    out = jnp.broadcast_to(val, jnp.shape(v)).astype(jnp.result_type(v))
                    return jtu.tree_unflatten(jtu.tree_structure(g_prod), [out])
    g_leaves = jtu.tree_leaves(g_prod)
    dw_leaves = jtu.tree_leaves(dw)
    return _contract_derivative(
        term, t, y, args, lambda g_rp, r, p: [(1, (g_leaves[r], dw_leaves[p]))]
    )


def commutativity_defect(term: diffrax.AbstractTerm, t, y, args) -> Array:
    """A numerical check, for debugging, of the commutativity condition
    $L^{j_1} g^{j_2} = L^{j_2} g^{j_1}$ at one point, where
    $L^{j} = \\sum_k g_{kj}\\, \\partial / \\partial y_k$.

    Milstein methods that do not simulate Lévy areas (`diffrax_linearize.ItoMilstein`,
    `diffrax_linearize.StratonovichMilstein`, and diffrax's own) reach strong order one only
    when this holds everywhere along the solution.

    **Arguments:** `term`, `t`, `y`, `args` as for [`diffrax_linearize.materialise`][].

    **Returns:** the scalar $\\max_{i, j_1, j_2} |(L^{j_1} g^{j_2})_i - (L^{j_2} g^{j_1})_i|$,
    over all state and control elements (pytrees are flattened). Zero (to rounding) for
    commutative noise.
    """
    api = "diffrax_linearize.commutativity_defect"
    _check_term(term, api)
    _vf(term, t, y, args, api)
    control = control_zeros(term, t)
    y_flat, unravel_y = ravel_pytree(y)
    c_flat, unravel_c = ravel_pytree(control)

    def matrix(yf):
        def prod(cf):
            out = term.prod(term.vf(t, unravel_y(yf), args), unravel_c(cf))
            return ravel_pytree(out)[0]

        return solver_jacobian(prod, c_flat)

    g = matrix(y_flat)  # (d, m)
    dg = solver_jacobian(matrix, y_flat)
    lg = jnp.einsum("ijk,kl->ijl", dg, g)  # [i, j2, j1] = (L^{j1} g^{j2})_i
    return jnp.max(jnp.abs(lg - jnp.swapaxes(lg, 1, 2)))
