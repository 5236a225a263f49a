"""`solve_ensemble(..., shared_step=True)`: the paths solved together as one system with
one step size, checked against the per-path solves (at a fixed step) and against the
batch written out by hand as one flattened SDE (adaptive)."""

import diffrax as dfx
import diffrax_linearize as dl
import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import optimistix as optx
import pytest


jax.config.update("jax_enable_x64", True)

D = 3
T1 = 1.0
N = 5
KEYS = jax.random.split(jax.random.key(7), N)
Y0 = jnp.array([1.0, -0.5, 0.25])
SAVEAT = dfx.SaveAt(ts=jnp.linspace(0.0, T1, 5))


def _burst(t):
    # The noise is ten times larger on [0.4, 0.6] for every path: where one step for
    # all paths is the right step.
    return 0.2 + 2.0 * jnp.exp(-200.0 * (t - 0.5) ** 2)


def _f(t, y, args):
    return -args * y + jnp.sin(y[::-1])


def _g_diagonal(t, y, args):
    return _burst(t) * (1.0 + 0.5 * jnp.cos(y))


def _g_general(t, y, args):
    a = jnp.array([[0.3, -0.2], [0.1, 0.4], [0.2, 0.1]], y.dtype)
    return _burst(t) * (jnp.sin(y)[:, None] * a + 0.2 * y[::-1][:, None])


def _tree(key, shape, levy_area=dfx.SpaceTimeLevyArea, dtype=jnp.float64):
    return dfx.VirtualBrownianTree(
        jnp.asarray(0.0, dtype),
        jnp.asarray(T1, dtype),
        tol=2**-12,
        shape=jax.ShapeDtypeStruct(shape, dtype),
        key=key,
        levy_area=levy_area,
    )


def _diagonal_terms(key, dtype=jnp.float64):
    diffusion = lambda t, y, args: lx.DiagonalLinearOperator(_g_diagonal(t, y, args))
    return dfx.MultiTerm(dfx.ODETerm(_f), dfx.ControlTerm(diffusion, _tree(key, (D,), dtype=dtype)))


def _general_terms(key):
    path = dl.LevyAreaBrownianPath(_tree(key, (2,), dfx.BrownianIncrement), dt=0.1)
    return dfx.MultiTerm(dfx.ODETerm(_f), dfx.ControlTerm(_g_general, path))


def _pid(norm=optx.rms_norm, rtol=1e-3):
    return dfx.PIDController(rtol=rtol, atol=rtol, pcoeff=0.1, icoeff=0.3, norm=norm)


def _solve(terms, solver, shared, *, saveat=SAVEAT, dt0=0.05, keys=KEYS, **kwargs):
    return dl.solve_ensemble(
        terms,
        solver,
        0.0,
        T1,
        dt0,
        Y0,
        0.7,
        keys=keys,
        saveat=saveat,
        shared_step=shared,
        **kwargs,
    )


_SQUARE = dfx.SaveAt(subs=[SAVEAT.subs, dfx.SubSaveAt(t1=True, fn=lambda t, y, a: a * y**2)])


@pytest.mark.parametrize(
    "terms, solver",
    [
        # 9-17 s on two cores: all in the slow tier (`make test` keeps the adaptive check).
        pytest.param(_diagonal_terms, dl.ItoMilstein(), marks=pytest.mark.slow),
        pytest.param(_diagonal_terms, dfx.SPaRK(), marks=pytest.mark.slow),
        pytest.param(_general_terms, dl.GeneralItoMilstein(), marks=pytest.mark.slow),
        pytest.param(_diagonal_terms, dl.ImplicitItoMilstein(), marks=pytest.mark.slow),
    ],
    ids=["ItoMilstein", "SPaRK", "GeneralItoMilstein", "ImplicitItoMilstein"],
)
def test_fixed_step_is_the_per_path_solve(terms, solver):
    # At a fixed step the shared step changes nothing: path for path the same values (a
    # `jax.vmap` of the solver's step over the paths instead of over whole solves), the
    # saved functions of the state applied path by path, and the same reductions.
    per_path = _solve(terms, solver, False, saveat=_SQUARE)
    shared = _solve(terms, solver, True, saveat=_SQUARE)
    for a, b in zip(jax.tree.leaves(shared.paths.ys), jax.tree.leaves(per_path.paths.ys)):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(shared.mean[0], per_path.mean[0], rtol=1e-12)
    np.testing.assert_allclose(shared.var[1], per_path.var[1], rtol=1e-12)
    for a, b in zip(jax.tree.leaves(shared.paths.ts), jax.tree.leaves(per_path.paths.ts)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(shared.paths.stats["num_steps"], 20)
    # Not the transposed batch: the paths differ, and each is in its own place.
    assert np.abs(np.diff(np.asarray(shared.paths.ys[0][:, -1]), axis=0)).min() > 1e-6


class _BatchedPath(dfx.AbstractBrownianPath):
    """The reference's Brownian motion: every path's own tree, queried at the same times,
    flattened into one path of `N * D` channels."""

    paths: dfx.VirtualBrownianTree

    @property
    def t0(self):
        return self.paths.t0

    @property
    def t1(self):
        return self.paths.t1

    @property
    def levy_area(self):
        return self.paths.levy_area

    def evaluate(self, t0, t1=None, left=True, use_levy=False):
        out = jax.vmap(lambda path: path.evaluate(t0, t1, left, use_levy))(self.paths)
        if not use_levy:
            return out.reshape(-1)
        return dfx.SpaceTimeLevyArea(dt=out.dt[0], W=out.W.reshape(-1), H=out.H.reshape(-1))


def _flattened(batch_norm, rtol):
    """The batch written out as one SDE of `N * D` unknowns (its diffusion diagonal), with
    the controller's norm `batch_norm` of the flattened scaled error: its step times and
    the number of steps."""
    paths = jax.vmap(lambda key: _tree(key, (D,)))(KEYS)
    drift = lambda t, y, args: jax.vmap(lambda y: _f(t, y, args))(y.reshape(N, D)).reshape(-1)

    def diffusion(t, y, args):
        g = jax.vmap(lambda y: _g_diagonal(t, y, args))(y.reshape(N, D))
        return lx.DiagonalLinearOperator(g.reshape(-1))

    terms = dfx.MultiTerm(dfx.ODETerm(drift), dfx.ControlTerm(diffusion, _BatchedPath(paths)))
    sol = dfx.diffeqsolve(
        terms,
        dl.ItoMilstein(),
        0.0,
        T1,
        0.05,
        jnp.tile(Y0, N),
        0.7,
        saveat=dfx.SaveAt(steps=True),
        stepsize_controller=_pid(batch_norm, rtol),
    )
    return np.asarray(sol.ts), int(sol.stats["num_steps"])


def _shared_adaptive(norm, rtol):
    return _solve(
        _diagonal_terms,
        dl.ItoMilstein(),
        True,
        saveat=dfx.SaveAt(steps=True),
        reductions=(),
        stepsize_controller=_pid(norm, rtol),
    )


@pytest.mark.parametrize(
    "norm", [optx.rms_norm, pytest.param(optx.max_norm, marks=pytest.mark.slow)], ids=["rms", "max"]
)
def test_adaptive_is_the_batch_as_one_system(norm):
    # Adaptive: the steps of the batch solved by hand as one flattened SDE whose
    # controller takes the largest of the paths' norms, every path each step. The two
    # round differently (a `jax.vmap` over paths against one flattened system), and the
    # controller amplifies rounding from step to step (1e-17 in the step times at step 3,
    # 1e-12 at step 15), so the step times are compared where rounding has not yet grown
    # (to 1e-9) and the step counts to a few steps.
    rtol = 1e-3
    shared = _shared_adaptive(norm, rtol)
    ts = np.asarray(shared.paths.ts[0])
    steps = shared.paths.stats["num_steps"]
    np.testing.assert_array_equal(steps, steps[0])
    per_path_norm = lambda e: jnp.max(jax.vmap(norm)(e.reshape(N, D)))
    ts_ref, steps_ref = _flattened(per_path_norm, rtol)
    np.testing.assert_allclose(ts[:12], ts_ref[:12], rtol=1e-9, atol=0)
    assert abs(int(steps[0]) - steps_ref) <= 0.03 * steps_ref, (steps[0], steps_ref)
    # The value at t1: the last of the saved steps (the rest are `inf`).
    last = int(shared.paths.stats["num_accepted_steps"][0]) - 1
    np.testing.assert_array_equal(ts[last], T1)


@pytest.mark.slow
@pytest.mark.parametrize("norm", [optx.rms_norm, optx.max_norm], ids=["rms", "max"])
def test_adaptive_batch_is_held_to_each_paths_tolerance(norm):
    # The batch takes at least as many steps as its paths alone would; every path is
    # within the tolerance's reach of a fine solve on its own path; and the norm is taken
    # path by path, not over the whole batch.
    rtol = 1e-3
    shared = _shared_adaptive(norm, rtol)
    steps = shared.paths.stats["num_steps"]
    options = dict(saveat=dfx.SaveAt(t1=True))
    alone = _solve(
        _diagonal_terms, dl.ItoMilstein(), False, stepsize_controller=_pid(norm, rtol), **options
    )
    assert steps[0] >= alone.paths.stats["num_steps"].max()
    last = int(shared.paths.stats["num_accepted_steps"][0]) - 1
    fine = _solve(_diagonal_terms, dl.ItoMilstein(), False, dt0=2**-12, **options)
    err = np.abs(shared.paths.ys[:, last] - fine.paths.ys[:, -1]).max()
    assert err < 30 * rtol, err
    if norm is optx.rms_norm:
        # The check can fail: the RMS over the whole batch (not path by path) takes other
        # steps from the first rejection on.
        ts_other, _ = _flattened(norm, rtol)
        assert np.abs(ts_other[:12] - np.asarray(shared.paths.ts[0])[:12]).max() > 1e-6


@pytest.mark.slow
def test_chunks_are_solved_apart():
    # With chunks, each chunk is its own system: the same as solving its paths alone,
    # the last (short) chunk included, whose padding must not change its steps.
    keys = jax.random.split(jax.random.key(3), 7)
    options = dict(saveat=dfx.SaveAt(t1=True), stepsize_controller=_pid())
    chunked = _solve(_diagonal_terms, dl.ItoMilstein(), True, keys=keys, chunk_size=3, **options)
    for lo, hi in ((0, 3), (3, 6), (6, 7)):
        alone = _solve(_diagonal_terms, dl.ItoMilstein(), True, keys=keys[lo:hi], **options)
        np.testing.assert_allclose(chunked.paths.ys[lo:hi], alone.paths.ys, rtol=1e-12)
        np.testing.assert_array_equal(
            chunked.paths.stats["num_steps"][lo:hi], alone.paths.stats["num_steps"]
        )
    steps = chunked.paths.stats["num_steps"]
    assert len({int(steps[0]), int(steps[3]), int(steps[6])}) > 1


def test_implicit_solver_takes_the_controller_tolerances():
    # Diffrax's `Kvaerno5` with its root finder left to take the controller's tolerances
    # (which `diffeqsolve` cannot see through the batch's term: `solve_ensemble` does it),
    # on an ODE whose rate is drawn per path; the first step chosen automatically.
    def terms(key):
        rate = 10.0 ** jax.random.uniform(key, minval=0.0, maxval=3.0)
        return dfx.ODETerm(lambda t, y, args: -rate * (y - jnp.cos(t)))

    sol = dl.solve_ensemble(
        terms,
        dfx.Kvaerno5(),
        0.0,
        T1,
        None,
        Y0,
        keys=KEYS,
        shared_step=True,
        stepsize_controller=dfx.PIDController(rtol=1e-8, atol=1e-10),
    )
    rates = jax.vmap(lambda key: 10.0 ** jax.random.uniform(key, minval=0.0, maxval=3.0))(KEYS)
    # y' = -r (y - cos t): y = c e^{-rt} + r (r cos t + sin t) / (1 + r^2).
    r = rates[:, None]
    steady = lambda t: r * (r * jnp.cos(t) + jnp.sin(t)) / (1 + r**2)
    exact = (Y0 - steady(0.0)) * jnp.exp(-r * T1) + steady(T1)
    np.testing.assert_allclose(sol.paths.ys[:, -1], exact, rtol=1e-6)
    with pytest.raises(ValueError, match="fixed step size controller"):
        dl.solve_ensemble(terms, dfx.Kvaerno5(), 0.0, T1, 0.1, Y0, keys=KEYS, shared_step=True)


@pytest.mark.slow
def test_grad_under_jit():
    # Reverse mode through the shared-step solve (checkpointed), under `jax.jit`, equals
    # the per-path solves' at a fixed step.
    def loss(y0, shared):
        sol = dl.solve_ensemble(
            _diagonal_terms,
            dl.ItoMilstein(),
            0.0,
            T1,
            0.05,
            y0,
            0.7,
            keys=KEYS,
            shared_step=shared,
            saveat=dfx.SaveAt(t1=True),
            reductions=("mean",),
        )
        return jnp.sum(sol.mean**2)

    grad = eqx.filter_jit(jax.grad(loss))
    np.testing.assert_allclose(grad(Y0, True), grad(Y0, False), rtol=1e-10)


@pytest.mark.slow
def test_float32():
    # Adaptive in float32 stays float32. (The multi-device script runs its ensembles, the
    # shared step's included, in float32; test_adaptive_milstein the adaptive solvers.)
    f32 = jnp.float32
    sol = dl.solve_ensemble(
        lambda key: _diagonal_terms(key, f32),
        dl.ItoMilstein(),
        f32(0.0),
        f32(T1),
        None,
        Y0.astype(f32),
        f32(0.7),
        keys=KEYS,
        shared_step=True,
        saveat=dfx.SaveAt(t1=True),
        stepsize_controller=_pid(rtol=1e-3),
    )
    assert sol.paths.ys.dtype == f32 and sol.mean.dtype == f32
    assert bool(jnp.all(jnp.isfinite(sol.paths.ys)))


def test_errors():
    pid = dict(stepsize_controller=_pid())
    cases = [
        (dict(lanes=2), "not both"),
        (dict(saveat=dfx.SaveAt(dense=True), reductions=()), "dense"),
        (dict(event=dfx.Event(lambda t, y, args, **kw: y[0] > 10.0)), "events"),
        (dict(adjoint=dl.BacksolveAdjoint()), "adjoint BacksolveAdjoint"),
    ]
    for options, match in cases:
        with pytest.raises(ValueError, match=match):
            _solve(_diagonal_terms, dl.ItoMilstein(), True, **{**pid, **options})
    with pytest.raises(ValueError, match="Euler's method"):
        _solve(_diagonal_terms, dfx.Euler(), True, **pid)

    def unsafe(key):
        bm = dfx.UnsafeBrownianPath((D,), key)
        return dfx.MultiTerm(dfx.ODETerm(_f), dfx.ControlTerm(lambda t, y, a: jnp.diag(y), bm))

    with pytest.raises(ValueError, match="UnsafeBrownianPath"):
        _solve(unsafe, dl.ItoMilstein(), True, **pid)


def test_wrapped_controllers_norm_per_path():
    # The norm of a controller inside another (`diffrax.ClipStepSizeController`'s) is taken
    # path by path too, not left as the norm over the whole batch.
    from diffrax_linearize._shared_step import _per_path_norms, MaxOverPaths

    for controller, inner in (
        (_pid(), lambda c: c),
        (dfx.ClipStepSizeController(_pid(), step_ts=[0.5]), lambda c: c.controller),
    ):
        wrapped = _per_path_norms(controller)
        norms = jax.tree.leaves(wrapped, is_leaf=lambda x: isinstance(x, MaxOverPaths))
        assert sum(isinstance(x, MaxOverPaths) for x in norms) == 1
        assert isinstance(inner(wrapped).norm, MaxOverPaths)
        errors = jnp.array([[0.1, 0.2, 0.2], [3.0, 0.0, 0.0]])
        np.testing.assert_allclose(inner(wrapped).norm(errors), np.sqrt(3.0))
