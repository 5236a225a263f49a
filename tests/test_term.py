import warnings

import diffrax
import diffrax_linearize as dl
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import lineax as lx
import numpy as np
import pytest
from diffrax_linearize._sparsity import to_dense
from diffrax_linearize._term import control_zeros
from diffrax_linearize.internal import structured_blocks


jax.config.update("jax_enable_x64", True)

D, M = 4, 3


def _keys(n, seed=0):
    return jax.random.split(jax.random.PRNGKey(seed), n)


def _bm(shape, key):
    return diffrax.VirtualBrownianTree(0.0, 1.0, tol=1e-3, shape=shape, key=key)


def _reference(term, t, y, args):
    """The obvious slow reference: `jax.jacfwd` through `term.prod`."""
    control = control_zeros(term, t)
    vf = term.vf(t, y, args)
    holomorphic = all(jnp.iscomplexobj(c) for c in jtu.tree_leaves(control))
    return jax.jacfwd(lambda c: term.prod(vf, c), holomorphic=holomorphic)(control)


def _assert_tree_close(a, b, rtol=1e-12, atol=1e-12):
    assert jtu.tree_structure(a) == jtu.tree_structure(b)
    for x, y in zip(jtu.tree_leaves(a), jtu.tree_leaves(b)):
        assert jnp.shape(x) == jnp.shape(y)
        assert jnp.result_type(x) == jnp.result_type(y)
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _compiled_has_dot(fn, *args) -> bool:
    text = jax.jit(fn).lower(*args).compile().as_text()
    return " dot(" in text or "dot_general" in text or "custom-call" in text


class EinsumTerm(diffrax.AbstractTerm):
    """A user-defined term with a matrix-valued control and its own bilinear `prod`."""

    weights: jax.Array
    control: diffrax.AbstractPath

    def vf(self, t, y, args):
        return jnp.tanh(self.weights * y[:, None, None])

    def contr(self, t0, t1, **kwargs):
        return self.control.evaluate(t0, t1)

    def prod(self, vf, control):
        return jnp.einsum("ijk,jk->i", vf, control)


class ComplexPath(diffrax.AbstractPath):
    t0 = 0.0
    t1 = 1.0

    def evaluate(self, t0, t1=None, left=True):
        return jnp.array([1.0 + 2.0j, 3.0 - 1.0j]) * (t1 - t0)


def _weakly_diagonal(vf, control):
    # Deprecated in diffrax 0.7 but still shipped: we support it while it is.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return diffrax.WeaklyDiagonalControlTerm(vf, control)


def _terms():
    k = _keys(6)
    g = jax.random.normal(k[0], (D, M))
    a = jax.random.normal(k[1], (D, M, D))
    w = jax.random.normal(k[2], (D, 2, 5))
    return {
        "constant": diffrax.ControlTerm(lambda t, y, args: g, _bm((M,), k[3])),
        "row_scaled": diffrax.ControlTerm(lambda t, y, args: y[:, None] * g, _bm((M,), k[3])),
        "linear": diffrax.ControlTerm(
            lambda t, y, args: jnp.einsum("ijk,k->ij", a, y), _bm((M,), k[3])
        ),
        "nonlinear": diffrax.ControlTerm(
            lambda t, y, args: jnp.sin(jnp.einsum("ijk,k->ij", a, y)) + args, _bm((M,), k[3])
        ),
        "diagonal_lineax": diffrax.ControlTerm(
            lambda t, y, args: lx.DiagonalLinearOperator(jnp.cos(y) * t), _bm((D,), k[4])
        ),
        "diagonal_coupled": diffrax.ControlTerm(
            lambda t, y, args: lx.DiagonalLinearOperator(jnp.sin(y) * jnp.sum(y**2)),
            _bm((D,), k[4]),
        ),
        "matrix_lineax": diffrax.ControlTerm(
            lambda t, y, args: lx.MatrixLinearOperator(y[:, None] * g), _bm((M,), k[3])
        ),
        "weakly_diagonal": _weakly_diagonal(lambda t, y, args: y**2, _bm((D,), k[4])),
        "ode": diffrax.ODETerm(lambda t, y, args: -(y**3) + t),
        "user_einsum": EinsumTerm(w, _bm((2, 5), k[5])),
        "complex_vf": diffrax.ControlTerm(
            lambda t, y, args: (1.0 + 1.0j) * y[:, None] * g, _bm((M,), k[3])
        ),
        "complex_control": diffrax.ControlTerm(
            lambda t, y, args: jnp.stack([y, 2 * y], axis=-1).astype(jnp.complex128),
            ComplexPath(),
        ),
    }


TERMS = _terms()
Y = jax.random.normal(_keys(1, seed=7)[0], (D,))


@pytest.mark.parametrize(
    "name",
    [
        # A complex vector field times the real control: standard promotion, as in Diffrax's
        # `ControlTerm.prod`.
        pytest.param(n, marks=pytest.mark.standard_promotion) if n == "complex_vf" else n
        for n in sorted(TERMS)
    ],
)
def test_term_matches_jacfwd(name):
    term = TERMS[name]
    t, args = 0.3, 0.5
    _assert_tree_close(dl.materialise(term, t, Y, args), _reference(term, t, Y, args))


@pytest.mark.parametrize("name", ["row_scaled", "linear", "diagonal_lineax", "ode"])
def test_term_under_jit_and_vmap(name):
    term = TERMS[name]
    ys = jax.random.normal(_keys(1, seed=3)[0], (5, D))
    ours = jax.jit(jax.vmap(lambda y: dl.materialise(term, 0.3, y, 0.5)))(ys)
    ref = jax.vmap(lambda y: _reference(term, 0.3, y, 0.5))(ys)
    _assert_tree_close(ours, ref)


def test_control_term_array_is_returned_without_work():
    g = jax.random.normal(_keys(1)[0], (D, M))
    term = diffrax.ControlTerm(lambda t, y, args: g, _bm((M,), _keys(2)[1]))
    out = dl.materialise(term, 0.0, Y, None)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(g))
    jaxpr = jax.make_jaxpr(lambda y: dl.materialise(term, 0.0, y, None))(Y)
    assert "dot_general" not in str(jaxpr)
    assert not _compiled_has_dot(lambda y: dl.materialise(term, 0.0, y, None), Y)


def test_diagonal_lineax_gives_its_diagonal_matrix():
    term = TERMS["diagonal_lineax"]
    out = dl.materialise(term, 0.7, Y, None)
    np.testing.assert_allclose(np.asarray(out), np.diag(np.cos(np.asarray(Y)) * 0.7))
    assert "dot_general" not in str(jax.make_jaxpr(lambda y: dl.materialise(term, 0.7, y, None))(Y))
    assert not _compiled_has_dot(lambda y: dl.materialise(term, 0.7, y, None), Y)
    op = dl.materialise_operator(term, 0.7, Y, None)
    assert isinstance(op, lx.DiagonalLinearOperator)
    np.testing.assert_allclose(np.asarray(op.as_matrix()), np.asarray(out))


def test_user_term_with_matrix_control():
    term = TERMS["user_einsum"]
    out = dl.materialise(term, 0.0, Y, None)
    assert out.shape == (D, 2, 5)
    _assert_tree_close(out, _reference(term, 0.0, Y, None))


def test_multiterm_one_entry_per_term():
    term = diffrax.MultiTerm(TERMS["ode"], TERMS["row_scaled"])
    out = dl.materialise(term, 0.2, Y, None)
    assert isinstance(out, tuple) and len(out) == 2
    assert out[0].shape == (D,) and out[1].shape == (D, M)
    _assert_tree_close(out, _reference(term, 0.2, Y, None))


class _PytreePath(diffrax.AbstractPath):
    paths: dict
    t0 = 0.0
    t1 = 1.0

    def evaluate(self, t0, t1=None, left=True):
        return {k: p.evaluate(t0, t1, left) for k, p in self.paths.items()}


def test_pytree_state_and_control():
    k = _keys(4, seed=11)
    ga = jax.random.normal(k[0], (3, 2))
    gb = jax.random.normal(k[1], (2, 2, 4))
    control = {"a": _bm((2,), k[2]), "b": _bm((4,), k[3])}

    def vf(t, y, args):
        return {"a": y["a"][:, None] * ga, "b": jnp.tanh(y["b"])[..., None] * gb}

    term = diffrax.ControlTerm(vf, _PytreePath(control))
    y = {"a": jnp.arange(3.0), "b": jnp.ones((2, 2))}
    out = dl.materialise(term, 0.1, y, None)
    ref = _reference(term, 0.1, y, None)
    _assert_tree_close(out, ref)
    assert out["b"]["b"].shape == (2, 2, 4)


def test_bad_inputs_name_materialise():
    term = TERMS["row_scaled"]
    with pytest.raises(TypeError, match="materialise"):
        dl.materialise(3.0, 0.0, Y, None)
    with pytest.raises(ValueError, match="materialise"):
        dl.materialise(term, 0.0, jnp.ones((D + 1, 2)), None)
    with pytest.raises(ValueError, match="materialise"):
        dl.materialise(term, 0.0, {"a": Y}, None)


@pytest.mark.parametrize("fn", [dl.materialise, dl.materialise_operator])
def test_missing_args_names_the_public_signature(fn):
    # `term.vf(t, y, args)` has no default for `args`, and neither has this.
    term = TERMS["row_scaled"]
    name = f"diffrax_linearize.{fn.__name__}"
    with pytest.raises(TypeError, match=rf"`{name}\(term, t, y, args\)`.*`args` was not") as e:
        fn(term, 0.0, Y)
    assert "_materialise" not in str(e.value)
    assert f"`{name}(term, t, y, None)`" in str(e.value)
    with pytest.raises(TypeError, match="`y`, `args` were not given"):
        fn(term, 0.0)
    # By keyword, as `term.vf(t=..., y=..., args=...)`, it runs.
    expected = fn(term, 0.0, Y, None)
    got = fn(term, t=0.0, y=Y, args=None)
    assert type(got) is type(expected)


def test_milstein_trace_term_errors_name_itself():
    term = TERMS["row_scaled"]
    with pytest.raises(ValueError, match="milstein_trace_term") as info:
        dl.milstein_trace_term(term, 0.0, jnp.ones((D + 1, 2)), None)
    assert "noise_structure" not in str(info.value)


# ---- derivative of the vector field ----------------------------------------------------


def test_vf_derivative_of_linear_diffusion_is_the_stored_tensor():
    a = jax.random.normal(_keys(1, seed=5)[0], (D, M, D))
    term = diffrax.ControlTerm(
        lambda t, y, args: jnp.einsum("ijk,k->ij", a, y), _bm((M,), _keys(2)[1])
    )
    out = dl.vf_derivative(term, 0.0, Y, None)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(a))
    assert not _compiled_has_dot(lambda y: dl.vf_derivative(term, 0.0, y, None), Y)


@pytest.mark.parametrize("name", ["row_scaled", "nonlinear", "diagonal_lineax", "weakly_diagonal"])
def test_vf_derivative_matches_jacfwd(name):
    term = TERMS[name]
    ref = jax.jacfwd(lambda y: _reference(term, 0.3, y, 0.5))(Y)
    _assert_tree_close(dl.vf_derivative(term, 0.3, Y, 0.5), ref)


def test_elementwise_diffusion_derivative_is_structured():
    """The derivative of `y -> diag(sigma(y))` keeps a delta between the state index of the
    output and the differentiated state index: O(d^2) stored, not O(d^3)."""
    term = TERMS["weakly_diagonal"]

    def matrix(y):
        return dl.materialise(term, 0.0, y, None)

    blocks, _, _ = structured_blocks(matrix, Y)
    (block,) = blocks[0]
    assert block.kind() != "dense"
    assert block.ties  # a delta between an out axis and the in axis
    assert np.size(block.val) <= D * D
    np.testing.assert_allclose(np.asarray(to_dense(block)), np.asarray(jax.jacfwd(matrix)(Y)))


# ---- structure queries -----------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected",
    [
        ("constant", "additive"),
        ("row_scaled", "general"),
        ("linear", "general"),
        ("diagonal_lineax", "diagonal"),
        ("weakly_diagonal", "diagonal"),
        ("ode", "scalar"),
    ],
)
def test_noise_structure(name, expected):
    term = TERMS[name]
    assert dl.noise_structure(term, 0.3, Y, 0.5) == expected
    assert dl.is_additive_noise(term, 0.3, Y, 0.5) == (expected == "additive")
    assert dl.is_diagonal_noise(term, 0.3, Y, 0.5) == (expected == "diagonal")
    assert dl.is_scalar_noise(term, 0.3, Y, 0.5) == (expected == "scalar")


def test_scalar_noise_with_one_channel():
    term = diffrax.ControlTerm(lambda t, y, args: jnp.sin(y)[:, None], _bm((1,), _keys(1)[0]))
    assert dl.noise_structure(term, 0.0, Y, None) == "scalar"


def _reference_trace(term, t, y, args):
    matrix = lambda y: _reference(term, t, y, args)  # noqa: E731
    return jnp.einsum("ijk,kj->i", jax.jacfwd(matrix)(y), matrix(y))


@pytest.mark.parametrize(
    "name",
    [
        "constant",
        "row_scaled",
        "linear",
        "nonlinear",
        "diagonal_lineax",
        "diagonal_coupled",  # diagonal but not commutative: still exact
        "weakly_diagonal",
    ],
)
def test_milstein_trace_term(name):
    term = TERMS[name]
    out = jax.jit(lambda y: dl.milstein_trace_term(term, 0.3, y, 0.5))(Y)
    np.testing.assert_allclose(
        np.asarray(out), np.asarray(_reference_trace(term, 0.3, Y, 0.5)), rtol=1e-12, atol=1e-12
    )


def test_milstein_trace_term_pytree():
    k = _keys(3, seed=2)
    g = jax.random.normal(k[0], (3, 2))
    term = diffrax.ControlTerm(
        lambda t, y, args: {"a": jnp.sin(y["a"])[:, None] * g, "b": y["b"][:, None] * y["a"][:2]},
        _PytreePath({"a": _bm((2,), k[1]), "b": _bm((2,), k[2])}),
    )
    y = {"a": jnp.array([0.3, -1.0, 2.0]), "b": jnp.array([0.5, 0.25])}
    out = dl.milstein_trace_term(term, 0.0, y, None)
    # Reference by flattening everything.
    from jax.flatten_util import ravel_pytree

    y_flat, unravel = ravel_pytree(y)
    c_flat, unravel_c = ravel_pytree(control_zeros(term, 0.0))

    def matrix(yf):
        vf = term.vf(0.0, unravel(yf), None)
        return jax.jacfwd(lambda cf: ravel_pytree(term.prod(vf, unravel_c(cf)))[0])(c_flat)

    ref = unravel(jnp.einsum("ijk,kj->i", jax.jacfwd(matrix)(y_flat), matrix(y_flat)))
    _assert_tree_close(out, ref)


def test_commutativity_defect():
    k = _keys(3, seed=4)
    b = jax.random.normal(k[0], (D, D))
    # Commuting matrices: polynomials of one matrix. g(y)[:, j] = A_j y.
    mats = jnp.stack([jnp.eye(D), b, b @ b], axis=1)  # (D, 3, D)
    commuting = diffrax.ControlTerm(
        lambda t, y, args: jnp.einsum("ijk,k->ij", mats, y), _bm((3,), k[1])
    )
    generic = diffrax.ControlTerm(
        lambda t, y, args: jnp.einsum("ijk,k->ij", jax.random.normal(k[2], (D, 3, D)), y),
        _bm((3,), k[1]),
    )
    assert float(dl.commutativity_defect(commuting, 0.0, Y, None)) < 1e-10
    assert float(dl.commutativity_defect(TERMS["diagonal_lineax"], 0.0, Y, None)) < 1e-12
    assert float(dl.commutativity_defect(generic, 0.0, Y, None)) > 1e-2


def test_structure_queries_are_static_under_jit():
    term = TERMS["diagonal_lineax"]

    @eqx.filter_jit
    def f(y):
        kind = dl.noise_structure(term, 0.0, y, None)
        assert isinstance(kind, str)
        return jnp.asarray(len(kind))

    assert int(f(Y)) == len("diagonal")
