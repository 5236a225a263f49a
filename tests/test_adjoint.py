"""`diffrax_linearize.BacksolveAdjoint` against `diffrax.RecursiveCheckpointAdjoint` (the exact
gradient of the discrete forward pass) on the same Brownian path."""

import diffrax
import diffrax_linearize as dl
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from diffrax_linearize._adjoint import _AdjointTerm, _identity


jax.config.update("jax_enable_x64", True)

D = M = 3
T1 = 1.0


class Drift(eqx.Module):
    W: jax.Array

    def __call__(self, t, y, args):
        return jnp.tanh(self.W @ y) * args - 0.1 * y


class Diffusion(eqx.Module):
    """$g_{ij} = \\sin(y_i) G_{ij}$: commutative noise
    ($L^{j_1} g_{i j_2} = \\sin y_i \\cos y_i G_{i j_1} G_{i j_2}$ is symmetric), so Milstein
    methods reach strong order one."""

    G: jax.Array

    def __call__(self, t, y, args):
        return jnp.sin(y)[:, None] * self.G


def _model(key):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    drift = Drift(0.5 * jax.random.normal(k1, (D, D)))
    diffusion = Diffusion(0.3 * jax.random.normal(k2, (D, M)))
    bm = diffrax.VirtualBrownianTree(0.0, T1, 1e-5, (M,), key=k3)
    y0 = 1.0 + 0.1 * jax.random.normal(k4, (D,))
    return drift, diffusion, bm, y0, jnp.array(0.7)


def _grads(adjoint, solver, drift, diffusion, bm, y0, args, *, dt, saveat, sde=True):
    @eqx.filter_jit
    def grads(y0, args, drift, diffusion):
        def loss(y0, args, drift, diffusion):
            if sde:
                terms = diffrax.MultiTerm(
                    diffrax.ODETerm(drift), diffrax.ControlTerm(diffusion, bm)
                )
            else:
                terms = diffrax.ODETerm(drift)
            sol = diffrax.diffeqsolve(
                terms, solver, 0.0, T1, dt, y0, args, saveat=saveat, adjoint=adjoint
            )
            return jnp.sum(sol.ys**2) + jnp.sum(jnp.cos(sol.ys))

        return jax.grad(loss, argnums=(0, 1, 2, 3))(y0, args, drift, diffusion)

    return grads(y0, args, drift, diffusion)


def _rel_errors(actual, expected) -> list[float]:
    """Relative error of every leaf, in the Euclidean norm."""
    a_leaves, a_tree = jtu.tree_flatten(actual)
    e_leaves, e_tree = jtu.tree_flatten(expected)
    assert a_tree == e_tree
    errors = []
    for a, e in zip(a_leaves, e_leaves):
        a, e = np.asarray(a), np.asarray(e)
        scale = np.linalg.norm(e)
        errors.append(float(np.linalg.norm(a - e) / (scale if scale > 0 else 1.0)))
    return errors


# Save times on the step grid: the backward pass solves between save times, and a save
# time off the grid would put its steps (and Brownian increments) elsewhere.
SAVEATS = {
    "t1": diffrax.SaveAt(t1=True),
    "ts": diffrax.SaveAt(ts=jnp.array([0.25, 0.5, 0.75, T1])),
    "t0+ts": diffrax.SaveAt(t0=True, ts=jnp.array([0.5, T1])),
}


@pytest.mark.parametrize(
    "solver, dt, saveat",
    [
        # FSAL: calls the adjoint `vf` (structure engine). 12 s on two cores: the slow
        # tier (test_adjoint_vf_matches_jacfwd checks that `vf` in `make test`).
        pytest.param(diffrax.Tsit5(), 2.0**-4, "t1", marks=pytest.mark.slow),
        # The vf_prod-only backward solver; with several save times Diffrax's own
        # backsolve is off by 1e-4 here (see `_ReversibleHeunVfProd`).
        pytest.param(diffrax.ReversibleHeun(), 2.0**-6, "t0+ts", marks=pytest.mark.slow),
    ],
)
def test_ode(getkey, solver, dt, saveat):
    drift, diffusion, bm, y0, args = _model(getkey())
    kw = dict(dt=dt, saveat=SAVEATS[saveat], sde=False)
    ours = _grads(dl.BacksolveAdjoint(), solver, drift, diffusion, bm, y0, args, **kw)
    ref = _grads(diffrax.RecursiveCheckpointAdjoint(), solver, drift, diffusion, bm, y0, args, **kw)
    assert max(_rel_errors(ours, ref)) < 1e-7


# At 2^-10 steps the continuous adjoint agrees with the discrete gradient to 1e-4 or
# better for these schemes (Milstein: strong order one on this commutative noise).
@pytest.mark.parametrize(
    "solver, saveat",
    [
        pytest.param(diffrax.ReversibleHeun(), "ts", marks=pytest.mark.slow),
        pytest.param(diffrax.Heun(), "t1", marks=pytest.mark.slow),
        pytest.param(diffrax.EulerHeun(), "t1", marks=pytest.mark.slow),
        (dl.StratonovichMilstein(), "t1"),
    ],
    ids=lambda x: type(x).__name__ if not isinstance(x, str) else x,
)
def test_stratonovich_sde(getkey, solver, saveat):
    drift, diffusion, bm, y0, args = _model(getkey())
    kw = dict(dt=2.0**-10, saveat=SAVEATS[saveat])
    ours = _grads(dl.BacksolveAdjoint(), solver, drift, diffusion, bm, y0, args, **kw)
    ref = _grads(diffrax.RecursiveCheckpointAdjoint(), solver, drift, diffusion, bm, y0, args, **kw)
    assert max(_rel_errors(ours, ref)) < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize(
    "solver, dt, rtol",
    [
        (dl.ItoMilstein(), 2.0**-10, 1e-3),  # backward: StratonovichMilstein
        (diffrax.Euler(), 2.0**-10, 2e-2),  # backward: EulerHeun; strong order 0.5
    ],
    ids=["ItoMilstein", "Euler"],
)
def test_ito_sde(getkey, solver, dt, rtol):
    drift, diffusion, bm, y0, args = _model(getkey())
    kw = dict(dt=dt, saveat=SAVEATS["t1"])
    ours = _grads(dl.BacksolveAdjoint(), solver, drift, diffusion, bm, y0, args, **kw)
    ref = _grads(diffrax.RecursiveCheckpointAdjoint(), solver, drift, diffusion, bm, y0, args, **kw)
    assert max(_rel_errors(ours, ref)) < rtol
    if not isinstance(solver, dl.ItoMilstein):
        return
    # The Itô correction matters here: the Stratonovich gradient is far from the Itô one,
    # so a backward pass that forgot the correction would fail the check above.
    strat = _grads(
        diffrax.RecursiveCheckpointAdjoint(),
        diffrax.EulerHeun(),
        drift,
        diffusion,
        bm,
        y0,
        args,
        **kw,
    )
    assert max(_rel_errors(strat, ref)) > 10 * rtol


class PytreeDrift(eqx.Module):
    W: jax.Array

    def __call__(self, t, y, args):
        a, b = y["a"], y["b"]
        return {"a": jnp.tanh(self.W @ b)[:2] * args, "b": -0.3 * b + jnp.sum(a**2)}


class PytreeDiffusion(eqx.Module):
    G: jax.Array

    def __call__(self, t, y, args):
        return {"a": 0.2 * jnp.cos(y["a"])[:, None] * self.G[:2, :2], "b": 0.1 * self.G}


# A pytree Brownian motion matching the pytree diffusion.
_PYTREE_NOISE = {
    "a": jax.ShapeDtypeStruct((2,), jnp.float64),
    "b": jax.ShapeDtypeStruct((M,), jnp.float64),
}


@pytest.mark.slow
def test_pytree_state(getkey):
    solver = diffrax.EulerHeun()  # a MultiTerm solver
    k1, k2, k3 = jax.random.split(getkey(), 3)
    drift = PytreeDrift(0.5 * jax.random.normal(k1, (D, D)))
    diffusion = PytreeDiffusion(jax.random.normal(k2, (D, M)))
    bm = diffrax.VirtualBrownianTree(0.0, T1, 1e-5, _PYTREE_NOISE, key=k3)
    y0 = {"a": jnp.array([0.3, -0.2]), "b": jnp.array([1.0, 0.5, -0.5])}

    def grads(adjoint):
        @eqx.filter_jit
        def _grads(y0, args, drift, diffusion):
            def loss(y0, args, drift, diffusion):
                terms = diffrax.MultiTerm(
                    diffrax.ODETerm(drift), diffrax.ControlTerm(diffusion, bm)
                )
                sol = diffrax.diffeqsolve(
                    terms,
                    solver,
                    0.0,
                    T1,
                    2.0**-10,
                    y0,
                    args,
                    saveat=SAVEATS["t1"],
                    adjoint=adjoint,
                )
                return sum(jnp.sum(jnp.sin(x)) for x in jtu.tree_leaves(sol.ys))

            return jax.grad(loss, argnums=(0, 1, 2, 3))(y0, args, drift, diffusion)

        return _grads(y0, jnp.array(0.7), drift, diffusion)

    ours = grads(dl.BacksolveAdjoint())
    ref = grads(diffrax.RecursiveCheckpointAdjoint())
    assert max(_rel_errors(ours, ref)) < 1e-3


def test_adjoint_vf_matches_jacfwd(getkey):
    # The adjoint vector field from the structure engine is exactly Diffrax's
    # (jacfwd/jacrev over the control), pytree state included.
    k1, k2, k3, k4 = jax.random.split(getkey(), 4)
    diffusion = PytreeDiffusion(jax.random.normal(k1, (D, M)))
    bm = diffrax.VirtualBrownianTree(0.0, T1, 1e-3, _PYTREE_NOISE, key=k2)
    term = diffrax.ControlTerm(diffusion, bm)
    y = {"a": jax.random.normal(k3, (2,)), "b": jax.random.normal(k4, (3,))}
    a_y = jtu.tree_map(lambda x: 2.0 * x + 1.0, y)
    a_terms = jtu.tree_map(jnp.zeros_like, eqx.filter(term, eqx.is_inexact_array))
    aug = (y, a_y, None, a_terms)
    ours = _AdjointTerm(term, _identity, None).vf(0.3, aug, None)
    theirs = diffrax._term.AdjointTerm(term).vf(0.3, aug, None)  # pyright: ignore
    assert _rel_errors(ours, theirs) and max(_rel_errors(ours, theirs)) < 1e-14


def _solve(adjoint, solver=diffrax.EulerHeun(), saveat=None, unsafe=False):
    drift, diffusion, bm, y0, args = _model(jax.random.key(0))
    if unsafe:
        bm = diffrax.UnsafeBrownianPath((M,), key=jax.random.key(1))
    terms = diffrax.MultiTerm(diffrax.ODETerm(drift), diffrax.ControlTerm(diffusion, bm))

    def loss(y0):
        sol = diffrax.diffeqsolve(
            terms,
            solver,
            0.0,
            T1,
            0.1,
            y0,
            args,
            saveat=saveat or diffrax.SaveAt(t1=True),
            adjoint=adjoint,
        )
        return jnp.sum(sol.ys)

    return jax.grad(loss)(y0)


def test_errors():
    with pytest.raises(NotImplementedError, match=r"diffrax_linearize\.BacksolveAdjoint.*steps"):
        _solve(dl.BacksolveAdjoint(), saveat=diffrax.SaveAt(steps=True))
    with pytest.raises(ValueError, match=r"Stratonovich.*EulerHeun"):
        _solve(dl.BacksolveAdjoint(solver=diffrax.Euler()), solver=diffrax.Euler())
    with pytest.raises(NotImplementedError, match=r"SRA1.*additive noise.*SPaRK"):
        _solve(dl.BacksolveAdjoint(solver=diffrax.SRA1()))
    with pytest.raises(ValueError, match=r"unexpected keyword arguments \['saveat'\]"):
        dl.BacksolveAdjoint(saveat=diffrax.SaveAt(t1=True))
    with pytest.raises(
        ValueError, match=r"diffrax_linearize\.BacksolveAdjoint.*UnsafeBrownianPath"
    ):
        _solve(dl.BacksolveAdjoint(), unsafe=True)


def test_constructor_arguments_checked():
    api = r"diffrax_linearize\.BacksolveAdjoint"
    for kwargs, wanted in [
        (dict(solver="heun"), rf"{api}\(solver=\.\.\.\)` must be a `diffrax.AbstractSolver`"),
        (dict(solver=diffrax.Heun), r"takes an instance, got the class `Heun`"),
        (dict(stepsize_controller=0.1), r"must be a `diffrax.AbstractStepSizeController`"),
        (dict(adjoint="backsolve"), r"must be a `diffrax.AbstractAdjoint`"),
        (dict(dt0="0.1"), r"\(dt0=\.\.\.\)` must be a real scalar"),
        (dict(max_steps=10.5), r"\(max_steps=\.\.\.\)` must be an int or `None`"),
        (dict(throw="yes"), r"\(throw=\.\.\.\)` must be `True` or `False`"),
    ]:
        with pytest.raises(TypeError, match=wanted):
            dl.BacksolveAdjoint(**kwargs)
    # Valid arguments are accepted.
    dl.BacksolveAdjoint(
        solver=diffrax.Heun(),
        stepsize_controller=diffrax.ConstantStepSize(),
        adjoint=diffrax.RecursiveCheckpointAdjoint(),
        dt0=-0.1,
        max_steps=100,
        throw=False,
    )


def test_saveat_errors_name_what_was_asked():
    for saveat, flag in [
        (diffrax.SaveAt(dense=True), "dense=True"),
        (diffrax.SaveAt(steps=True), "steps=True"),
    ]:
        with pytest.raises(NotImplementedError, match=rf"SaveAt\({flag}\)") as info:
            _solve(dl.BacksolveAdjoint(), saveat=saveat)
        message = str(info.value)
        assert "subs" not in message and message.count("instead") <= 1, message


# ---- stochastic Runge-Kutta solvers: the backward pass in reversed time


@pytest.mark.parametrize(
    "solver",
    # Both slow (20 s and more on two idle cores): the reversed-time backward pass is also
    # checked by the Milstein adjoint tests of the default run.
    [
        pytest.param(diffrax.SPaRK(), marks=pytest.mark.slow),
        pytest.param(diffrax.GeneralShARK(), marks=pytest.mark.slow),
    ],
    ids=lambda s: type(s).__name__,
)
def test_srk_ode_gradient(solver):
    # dy = -y/2 dt with zero diffusion: d y(1) / d y0 = exp(-1/2). Diffrax's own reversal
    # gave exp(+1/2) with `diffrax.SPaRK`, which takes the drift's control to be t1 - t0.
    bm = diffrax.VirtualBrownianTree(
        0.0, T1, 2**-6, (1,), key=jax.random.key(0), levy_area=diffrax.SpaceTimeLevyArea
    )

    def grad(adjoint, solver):
        def loss(y0):
            terms = diffrax.MultiTerm(
                diffrax.ODETerm(lambda t, y, a: -0.5 * y),
                diffrax.ControlTerm(lambda t, y, a: 0.0 * y[:, None], bm),
            )
            return diffrax.diffeqsolve(terms, solver, 0.0, T1, 0.1, y0, adjoint=adjoint).ys.sum()

        return jax.grad(loss)(jnp.ones(1))

    ours = grad(dl.BacksolveAdjoint(), solver)
    ref = grad(diffrax.RecursiveCheckpointAdjoint(), solver)
    np.testing.assert_allclose(ours, ref, rtol=1e-6)
    np.testing.assert_allclose(ours, np.exp(-0.5), rtol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize(
    "solver",
    [diffrax.SPaRK(), pytest.param(diffrax.GeneralShARK(), marks=pytest.mark.slow)],
    ids=lambda s: type(s).__name__,
)
def test_srk_sde(getkey, solver):
    # Multiplicative noise, so that the space-time Lévy area enters the diffusion stages:
    # with the area's sign flipped in the reversal (as negating the whole increment does)
    # SPaRK's error here is 1.1e-3, against 5.5e-5.
    drift, diffusion, _, y0, args = _model(getkey())
    bm = diffrax.VirtualBrownianTree(
        0.0, T1, 1e-5, (M,), key=getkey(), levy_area=diffrax.SpaceTimeLevyArea
    )
    kw = dict(dt=2.0**-8, saveat=SAVEATS["t1"])
    ours = _grads(dl.BacksolveAdjoint(), solver, drift, diffusion, bm, y0, args, **kw)
    ref = _grads(diffrax.RecursiveCheckpointAdjoint(), solver, drift, diffusion, bm, y0, args, **kw)
    assert max(_rel_errors(ours, ref)) < 3e-4


class _SmoothPath(diffrax.AbstractPath):
    """W(t) = (sin 3t + t^2, t^3) with its space-time(-time) Lévy areas by quadrature:
    a reference for the reversed increments that assumes nothing about their signs."""

    t0 = -10.0
    t1 = 10.0

    def _w(self, t):
        return jnp.stack([jnp.sin(3 * t) + t**2, t**3], axis=-1)

    def evaluate(self, t0, t1=None, left=True):
        h = t1 - t0
        u = jnp.linspace(0.0, 1.0, 4001)  # u = (s - t0) / h
        bridge = self._w(t0 + u * h) - self._w(t0) - u[:, None] * (self._w(t1) - self._w(t0))
        weights = jnp.full(u.shape, 1.0).at[0].set(0.5).at[-1].set(0.5) / (u.shape[0] - 1)
        H = jnp.einsum("s,si->i", weights, bridge)
        K = jnp.einsum("s,si->i", weights * (0.5 - u), bridge)
        return diffrax.SpaceTimeTimeLevyArea(dt=h, W=self._w(t1) - self._w(t0), H=H, K=K)


def test_reversed_increment_against_quadrature():
    from diffrax_linearize._adjoint import _reversed_increment

    path = _SmoothPath()

    class Reversed(diffrax.AbstractPath):
        t0 = -10.0
        t1 = 10.0

        def evaluate(self, t0, t1=None, left=True):
            return _SmoothPath.evaluate(self, t0, t1)  # pyright: ignore

        def _w(self, t):
            return path._w(-t)  # B(s) = W(-s)

    s0, s1 = 0.2, 0.9
    expected = Reversed().evaluate(s0, s1)
    actual = _reversed_increment(path.evaluate(-s1, -s0))
    for field in ("dt", "W", "H", "K"):
        np.testing.assert_allclose(getattr(actual, field), getattr(expected, field), atol=1e-9)
    assert np.all(np.abs(expected.H) > 1e-2) and np.all(np.abs(expected.K) > 1e-4)


def _lotka_volterra(t, y, p):
    return jnp.stack([p[0] * y[0] - p[1] * y[0] * y[1], p[3] * y[0] * y[1] - p[2] * y[1]])


def _lorenz(t, y, p):
    return jnp.stack([p[0] * (y[1] - y[0]), y[0] * (p[1] - y[2]) - y[1], y[0] * y[1] - p[2] * y[2]])


def _long_grad(adjoint, field, solver, y0, p, t1, rtol, atol, max_steps=16384):
    @eqx.filter_jit
    def grad(y0, p):
        def loss(y0, p):
            sol = diffrax.diffeqsolve(
                diffrax.ODETerm(field),
                solver,
                0.0,
                t1,
                1e-2,
                y0,
                p,
                stepsize_controller=diffrax.PIDController(rtol=rtol, atol=atol),
                adjoint=adjoint,
                max_steps=max_steps,
            )
            return jnp.sum(sol.ys**2)

        return jax.grad(loss, (0, 1))(y0, p)

    return jax.block_until_ready(grad(y0, p))


# ~30-60 s each on 2 loaded cores: two gradients of solves of ~3000 steps.
@pytest.mark.slow
@pytest.mark.parametrize(
    "solver, t1, rtol, atol, dtype, within",
    [
        # float32 at tolerances below its resolution: 5e3 tolerances in ~3200 steps.
        (diffrax.Tsit5(), 100.0, 1e-8, 1e-8, jnp.float32, 1e-3),
        # A low-order solver's global error: 1.1e4 tolerances in ~3100 steps.
        (dl.BDF(), 50.0, 1e-6, 1e-8, jnp.float64, 2e-2),
    ],
)
def test_backsolve_long_non_stiff(solver, t1, rtol, atol, dtype, within):
    """Lotka-Volterra over 10-20 periods: the recomputed state ends thousands of
    tolerances from the forward one, about one per step (errors adding up, not growing
    exponentially as on a stiff or chaotic ODE), and the backsolve gradient is
    `diffrax.BacksolveAdjoint`'s and close to `diffrax.RecursiveCheckpointAdjoint`'s
    (the continuous adjoint's, so to the solves' global error): no error."""
    with jax.enable_x64(dtype == jnp.float64):
        y0 = jnp.ones(2, dtype)
        p = jnp.array([1.5, 1.0, 3.0, 1.0], dtype)
        args = (_lotka_volterra, solver, y0, p, t1, rtol, atol)
        ours = _long_grad(dl.BacksolveAdjoint(), *args)
        ref = _long_grad(diffrax.RecursiveCheckpointAdjoint(), *args)
    assert max(_rel_errors(ours, ref)) < within


# ~20-40 s on 2 loaded cores
@pytest.mark.slow
def test_backsolve_chaotic_raises():
    """Lorenz's solutions converge fast onto the attractor, so recomputing them backwards
    in time multiplies any error, as on a stiff ODE: over t in [0, 2] the backsolve
    gradient (Diffrax's) is wrong by a factor of hundreds. Ours raises, with a message
    that names the chaotic case as well as the stiff one, whether the backward solve
    ends far from the forward one or (over [0, 20]) runs out of steps."""
    y0, p = jnp.ones(3), jnp.array([10.0, 28.0, 8 / 3])
    args = (_lorenz, diffrax.Tsit5(), y0, p)
    ref = _long_grad(diffrax.RecursiveCheckpointAdjoint(), *args, 2.0, 1e-6, 1e-8)
    theirs = _long_grad(diffrax.BacksolveAdjoint(), *args, 2.0, 1e-6, 1e-8, 100_000)
    assert max(_rel_errors(theirs, ref)) > 1
    wanted = r"(?s)BacksolveAdjoint`: the {}.*chaotic.*RecursiveCheckpointAdjoint"
    with pytest.raises(Exception, match=wanted.format("state recomputed")):
        _long_grad(dl.BacksolveAdjoint(), *args, 2.0, 1e-6, 1e-8, 100_000)
    with pytest.raises(Exception, match=wanted.format("backward solve reached `max_steps`")):
        _long_grad(dl.BacksolveAdjoint(), *args, 20.0, 1e-6, 1e-8, 4096)


def test_backsolve_state_with_no_entries():
    # The recomputed-state check measured a state with no entries as NaN tolerances away
    # (a mean over none) and raised. The reference is exact: the state has no entries, so
    # the gradient is that of `a**2` (Diffrax's own `BacksolveAdjoint` gives it too).
    def loss(a, adjoint):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(lambda t, y, a: -a * y),
            diffrax.Tsit5(),
            0.0,
            1.0,
            0.1,
            jnp.zeros(0),
            args=a,
            stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-8),
            adjoint=adjoint,
        )
        return jnp.sum(sol.ys) + a**2

    assert jax.grad(loss)(1.5, dl.BacksolveAdjoint()) == 3.0
