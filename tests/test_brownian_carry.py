"""The SDE solvers descend a `diffrax.VirtualBrownianTree` once per step, carrying its
value at the end of one step to the next (`_brownian_carry.py`): the same solution as
descending to both ends of every step, as the tree's `evaluate` does."""

import diffrax as dfx
import diffrax_linearize as dl
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from conftest import BELOW_DEFAULT_OPT
from diffrax_linearize import _brownian_carry
from diffrax_linearize._compat import WrapTerm


class _Opaque(dfx.AbstractBrownianPath):
    """The same Brownian motion through `evaluate` alone: not recognised as a tree, so a
    solver steps it as Diffrax's do, descending twice per step."""

    bm: dfx.AbstractBrownianPath

    @property
    def t0(self):
        return self.bm.t0

    @property
    def t1(self):
        return self.bm.t1

    @property
    def levy_area(self):
        return self.bm.levy_area

    def evaluate(self, t0, t1=None, left=True, use_levy=False):
        return self.bm.evaluate(t0, t1, left, use_levy)


def _drift(t, y, args):
    return -y + jnp.sin(y)


def _diag(t, y, args):
    return jnp.diag(0.4 * y + 0.1)


def _general(t, y, args):
    # Non-commutative: rotations mixed with scalings.
    return jnp.stack([jnp.array([-y[1], y[0], 0.2]), 0.3 * y], axis=1)


def _tree(levy=dfx.BrownianIncrement, shape=(3,), key=0, t0=-1.0, t1=2.0):
    return dfx.VirtualBrownianTree(t0, t1, tol=2**-12, shape=shape, key=jr.key(key), levy_area=levy)


_Y0 = jnp.array([1.0, 0.5, -0.2])

# (solver, kind of path, adaptive): the increment alone, with a space-time Lévy area, or
# inside a `LevyAreaBrownianPath` (whose solvers take fixed steps).
_SOLVERS = {
    "ItoMilstein": (dl.ItoMilstein(), "increment", True),
    "StratonovichMilstein": (dl.StratonovichMilstein(), "increment", True),
    "ImplicitEulerMaruyama": (dl.ImplicitEulerMaruyama(), "increment", True),
    "ImplicitItoMilstein": (dl.ImplicitItoMilstein(), "increment", True),
    "ImplicitStratonovichMilstein": (dl.ImplicitStratonovichMilstein(), "increment", True),
    "ItoTaylor15": (dl.ItoTaylor15(), "space-time", True),
    "GeneralItoMilstein": (dl.GeneralItoMilstein(), "levy-path", False),
}
# One solver of each kind of path by default (ImplicitItoMilstein reads increments too).
_DEFAULT = ("ItoMilstein", "ItoTaylor15", "GeneralItoMilstein")


def _path(kind, key=0):
    if kind == "space-time":
        return _tree(dfx.SpaceTimeLevyArea, key=key)
    if kind == "levy-path":
        return dl.LevyAreaBrownianPath(_tree(shape=(2,), key=key), n_terms=8)
    return _tree(key=key)


def _solve(solver, path, t0, t1, adaptive, **kwargs):
    vf = _general if isinstance(solver, dl.GeneralItoMilstein) else _diag
    terms = dfx.MultiTerm(dfx.ODETerm(_drift), dfx.ControlTerm(vf, path))
    dt0 = 0.05 if t1 > t0 else -0.05
    controller = (
        dfx.PIDController(rtol=1e-3, atol=1e-3, **kwargs) if adaptive else dfx.ConstantStepSize()
    )
    return dfx.diffeqsolve(
        terms, solver, t0, t1, dt0, _Y0, stepsize_controller=controller,
        saveat=dfx.SaveAt(steps=True), max_steps=256,
    )  # fmt: skip


def _cases():
    # The default run: forwards, one solver of each kind of path; backwards, ItoMilstein.
    for span, direction in [((0.0, 1.5), "forward"), ((1.5, -0.5), "backward")]:
        for name in _SOLVERS:
            default = name in _DEFAULT if direction == "forward" else name == "ItoMilstein"
            marks = () if default else pytest.mark.slow
            yield pytest.param(name, span, marks=marks, id=f"{direction}-{name}")


@pytest.mark.parametrize("name, span", _cases())
def test_solution_is_that_of_two_descents_per_step(name, span):
    solver, kind, adaptive = _SOLVERS[name]
    path = _path(kind)
    carried = _solve(solver, path, *span, adaptive)
    reference = _solve(solver, _Opaque(path), *span, adaptive)
    assert int(carried.stats["num_rejected_steps"]) > 0 or not adaptive
    if BELOW_DEFAULT_OPT:
        # At -O0 (`make test`) the two programs round alike: the same steps, bit for bit.
        assert int(carried.stats["num_steps"]) == int(reference.stats["num_steps"])
        np.testing.assert_array_equal(carried.ts, reference.ts)
        np.testing.assert_array_equal(carried.ys, reference.ys)
    else:
        # At XLA's default level the compiler may round the descent or the Lévy area's
        # difference otherwise in the two programs: a step can then end an ulp apart and an
        # accept/reject decision go the other way. Both are then solutions to the tolerance.
        final = lambda sol: sol.ys[int(sol.stats["num_accepted_steps"]) - 1]  # noqa: E731
        np.testing.assert_allclose(final(carried), final(reference), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    "levy",
    # The space-time area's solution is checked in the default run, its increments in CI's.
    [dfx.BrownianIncrement, pytest.param(dfx.SpaceTimeLevyArea, marks=pytest.mark.slow)],
    ids=["increment", "space-time"],
)
def test_increments_are_the_trees(levy):
    """Step by step over contiguous random steps, forwards and backwards in time, with a
    rejected step in between: the increment handed to the solver is the tree's."""
    tree = _tree(levy)
    terms = dfx.MultiTerm(dfx.ODETerm(_drift), dfx.ControlTerm(_diag, tree))
    ts = np.concatenate(
        [[-1.0], np.sort(np.asarray(jr.uniform(jr.key(1), (5,), minval=-1, maxval=2)))]
    )

    def increments(ts, direction):
        wrapped = dfx.MultiTerm(*(WrapTerm(t, direction) for t in terms.terms))
        carry = _brownian_carry.init_carry(wrapped, ts[0])
        out = []
        for a, b in zip(ts[:-1], ts[1:]):
            # A rejected (shorter) step first, whose state is thrown away.
            _brownian_carry.carried_terms(wrapped, a, 0.5 * (a + b), carry)
            stepped, carry = _brownian_carry.carried_terms(wrapped, a, b, carry)
            out.append(stepped.terms[1].contr(a, b, use_levy=True))
        return out

    for direction, times in [(1, ts), (-1, -ts[::-1])]:
        got = jax.jit(increments, static_argnums=1)(jnp.asarray(times), direction)
        for i, (a, b) in enumerate(zip(times[:-1], times[1:])):
            want = WrapTerm(terms.terms[1], direction).contr(a, b, use_levy=True)
            np.testing.assert_array_equal(got[i].W, want.W)
            if levy is dfx.SpaceTimeLevyArea:
                np.testing.assert_allclose(got[i].H, want.H, rtol=1e-12, atol=1e-15)


def _count_descents(monkeypatch):
    calls = []
    descend = _brownian_carry.brownian_tree_value

    def counted(tree, r):
        jax.debug.callback(lambda: calls.append(1))
        return descend(tree, r)

    monkeypatch.setattr(_brownian_carry, "brownian_tree_value", counted)
    return calls


def test_one_descent_per_step(monkeypatch):
    calls = _count_descents(monkeypatch)
    sol = _solve(dl.ItoMilstein(), _tree(), 0.0, 1.0, True)
    jax.effects_barrier()
    steps = int(sol.stats["num_steps"])
    assert steps > 10 and int(sol.stats["num_rejected_steps"]) > 0
    # Both ends on the first step only.
    assert len(calls) == steps + 1
    calls.clear()
    # `diffrax.HalfSolver`'s three steps per step start where a carried value is: three.
    sol = _solve(dfx.HalfSolver(dl.ItoMilstein()), _tree(), 0.0, 1.0, True)
    jax.effects_barrier()
    assert len(calls) == 3 * int(sol.stats["num_steps"]) + 2


def test_jumps_and_other_trees_are_descended_again():
    """A step that does not start where the carried value is (after a jump, or with a
    state carried from another tree at the same place) descends to its start."""
    solver = dl.ItoMilstein()
    jumped = _solve(solver, _tree(), 0.0, 1.0, True, jump_ts=[0.3, 0.6])
    reference = _solve(solver, _Opaque(_tree()), 0.0, 1.0, True, jump_ts=[0.3, 0.6])
    np.testing.assert_array_equal(jumped.ys, reference.ys)

    terms = [
        dfx.MultiTerm(dfx.ODETerm(_drift), dfx.ControlTerm(_diag, _tree(key=k))) for k in (0, 1)
    ]
    # Jitted: one program per function for both trees (eagerly, twice the time).
    init, step = eqx.filter_jit(solver.init), eqx.filter_jit(solver.step)
    state = init(terms[0], 0.0, 0.1, _Y0, None)
    _, _, _, state, _ = step(terms[0], 0.0, 0.1, _Y0, None, state, False)
    # The other tree, from the first's state at 0.1; then from its own fresh state.
    y1, *_ = step(terms[1], 0.1, 0.2, _Y0, None, state, False)
    fresh = init(terms[1], 0.1, 0.2, _Y0, None)
    y1_fresh, *_ = step(terms[1], 0.1, 0.2, _Y0, None, fresh, False)
    np.testing.assert_array_equal(y1, y1_fresh)
    assert not np.array_equal(y1, step(terms[0], 0.1, 0.2, _Y0, None, state, False)[0])


@pytest.mark.slow  # the heaviest test of `make test` (18 s on two cores): the slow tier
def test_vmap_and_grad():
    """Under `jax.vmap` over keys and `jax.grad` through the solve, as without the carry."""

    def loss(y0, key, wrap):
        path = dfx.VirtualBrownianTree(0.0, 1.0, tol=2**-12, shape=(3,), key=key)
        path = _Opaque(path) if wrap else path
        terms = dfx.MultiTerm(dfx.ODETerm(_drift), dfx.ControlTerm(_diag, path))
        sol = dfx.diffeqsolve(
            terms, dl.ItoMilstein(), 0.0, 1.0, 0.05, y0,
            stepsize_controller=dfx.PIDController(rtol=1e-3, atol=1e-3),
        )  # fmt: skip
        return jnp.sum(sol.ys**2)

    keys = jr.split(jr.key(3), 4)
    fn = jax.jit(jax.vmap(jax.value_and_grad(loss), in_axes=(None, 0, None)), static_argnums=2)
    value, grad = fn(_Y0, keys, False)
    value_ref, grad_ref = fn(_Y0, keys, True)
    np.testing.assert_array_equal(value, value_ref)
    np.testing.assert_array_equal(grad, grad_ref)
    assert np.all(np.isfinite(grad)) and np.all(grad != 0)
