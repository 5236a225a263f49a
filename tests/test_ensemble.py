import os
import pathlib
import subprocess
import sys

import diffrax
import diffrax_linearize as dl
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import lineax as lx
import numpy as np
import pytest
from diffrax_linearize._ensemble import _from_ordered_int, _to_ordered_int
from helpers import assert_equal_to_rounding


D = 3
T1 = 1.0
DT = 0.1
SAVEAT = diffrax.SaveAt(ts=jnp.linspace(0.0, T1, 5))
Y0 = jnp.array([1.0, -0.5, 0.25])


def _terms(key):
    return _levy_terms(key, levy_area=diffrax.BrownianIncrement)


def _levy_terms(key, levy_area=diffrax.SpaceTimeLevyArea):
    bm = diffrax.VirtualBrownianTree(0.0, T1, 1e-2, (D,), key, levy_area=levy_area)
    drift = diffrax.ODETerm(lambda t, y, args: -args * y + 0.1 * y**3)
    diffusion = diffrax.ControlTerm(lambda t, y, args: lx.DiagonalLinearOperator(0.5 * y + 0.1), bm)
    return diffrax.MultiTerm(drift, diffusion)


def _matvec_terms(key):
    a = jnp.array([[-1.0, 0.3, 0.0], [0.2, -0.5, 0.1], [0.0, -0.4, -0.7]])
    bm = diffrax.VirtualBrownianTree(0.0, T1, 1e-2, (D,), key)
    drift = diffrax.ODETerm(lambda t, y, args: a @ y)
    diffusion = diffrax.ControlTerm(lambda t, y, args: lx.DiagonalLinearOperator(0.3 * y), bm)
    return diffrax.MultiTerm(drift, diffusion)


def _vmap_reference(terms, solver, keys, y0, args, *, batch_y0=False, batch_args=False):
    def solve(key, y0, args):
        return diffrax.diffeqsolve(terms(key), solver, 0.0, T1, DT, y0, args, saveat=SAVEAT).ys

    in_axes = (0, 0 if batch_y0 else None, 0 if batch_args else None)
    run = eqx.filter_jit(lambda *xs: jax.vmap(solve, in_axes=in_axes)(*xs))
    return np.asarray(run(keys, y0, args))


# On one device and without chunking, `solve_ensemble` runs `vmap` over all the paths
# in one batch, so even a drift with a matrix product (whose rounding XLA's CPU kernels
# may vary with the batch size) matches bit for bit.
@pytest.mark.parametrize(
    "solver, terms",
    [
        (diffrax.Euler(), _terms),
        pytest.param(diffrax.Euler(), _matvec_terms, marks=pytest.mark.slow),
        pytest.param(diffrax.Heun(), _matvec_terms, marks=pytest.mark.slow),
        pytest.param(diffrax.SPaRK(), _levy_terms, marks=pytest.mark.slow),
    ],
)
def test_single_device_matches_vmap(solver, terms):
    keys = jr.split(jr.key(0), 7)
    out = dl.solve_ensemble(
        terms, solver, 0.0, T1, DT, Y0, 1.0, keys=keys, saveat=SAVEAT, reductions=()
    )
    expected = _vmap_reference(terms, solver, keys, Y0, 1.0)
    assert out.paths.ys.dtype == jnp.float64
    np.testing.assert_array_equal(out.paths.ys, expected)
    np.testing.assert_array_equal(out.ts, SAVEAT.subs.ts)
    assert out.mean is None and out.var is None and out.quantiles is None
    assert out.num_paths == 7
    assert int(out.num_failed) == 0


@pytest.mark.slow
def test_chunking_and_reductions_against_numpy():
    keys = jr.split(jr.key(1), 10)
    qs = (0.0, 1 / 9, 0.3, 0.5, 1.0)
    expected = _vmap_reference(_terms, diffrax.Euler(), keys, Y0, 1.0)
    out = dl.solve_ensemble(
        _terms,
        diffrax.Euler(),
        0.0,
        T1,
        DT,
        Y0,
        1.0,
        keys=keys,
        saveat=SAVEAT,
        quantiles=qs,
        chunk_size=3,  # does not divide 10: the last chunk is padded.
    )
    # Chunks of 3 against one `vmap` over 10: the same arithmetic, to rounding.
    assert_equal_to_rounding(out.paths.ys, expected)
    np.testing.assert_allclose(out.mean, expected.mean(0), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(out.var, expected.var(0), rtol=1e-11, atol=1e-15)
    np.testing.assert_allclose(
        out.quantiles, np.quantile(expected, qs, axis=0), rtol=1e-13, atol=1e-15
    )
    # (n - 1) q is an integer for q = 0, 1/9, 1: order statistics of the paths, exactly.
    np.testing.assert_array_equal(
        np.asarray(out.quantiles)[[0, 1, 4]],
        np.quantile(np.asarray(out.paths.ys), [0, 1 / 9, 1], axis=0),
    )

    # Summaries only: each chunk's statistics are kept, not its paths. Saved values that
    # are a tuple are reduced leaf by leaf.
    summary = dl.solve_ensemble(
        _terms,
        diffrax.Euler(),
        0.0,
        T1,
        DT,
        Y0,
        1.0,
        keys=keys,
        saveat=diffrax.SaveAt(ts=SAVEAT.subs.ts, fn=lambda t, y, args: (y, y[0] ** 2)),
        return_paths=False,
        chunk_size=4,
    )
    assert summary.paths is None and summary.quantiles is None
    squares = expected[..., 0] ** 2
    np.testing.assert_allclose(summary.mean[0], expected.mean(0), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(summary.var[0], expected.var(0), rtol=1e-11, atol=1e-15)
    np.testing.assert_allclose(summary.mean[1], squares.mean(0), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(summary.var[1], squares.var(0), rtol=1e-11, atol=1e-15)


@pytest.mark.slow
def test_batched_y0_and_args_and_legacy_keys():
    keys = jax.vmap(jr.PRNGKey)(jnp.arange(6))  # raw uint32 keys, shape (6, 2)
    y0s = jr.normal(jr.key(3), (6, D))
    argss = jnp.linspace(0.5, 1.5, 6)
    out = dl.solve_ensemble(
        _terms,
        diffrax.Heun(),
        0.0,
        T1,
        DT,
        y0s,
        argss,
        keys=keys,
        batch_y0=True,
        batch_args=True,
        saveat=SAVEAT,
        chunk_size=4,
    )
    expected = _vmap_reference(
        _terms, diffrax.Heun(), keys, y0s, argss, batch_y0=True, batch_args=True
    )
    assert_equal_to_rounding(out.paths.ys, expected)


def test_failed_paths():
    keys = jr.split(jr.key(4), 3)
    with pytest.raises(Exception, match="solve_ensemble"):
        out = dl.solve_ensemble(
            _terms, diffrax.Euler(), 0.0, T1, DT, Y0, 1.0, keys=keys, max_steps=3
        )
        jax.block_until_ready(out)
    out = dl.solve_ensemble(
        _terms,
        diffrax.Euler(),
        0.0,
        T1,
        DT,
        Y0,
        1.0,
        keys=keys,
        max_steps=3,
        throw=False,
    )
    assert int(out.num_failed) == 3 and int(out.num_used) == 0
    # No path to reduce over: NaN, not the `inf` that the failed paths saved.
    assert np.isnan(out.mean).all() and np.isnan(out.var).all()


def _stiff_terms(key):
    bm = diffrax.VirtualBrownianTree(0.0, T1, 1e-3, (D,), key)
    drift = diffrax.ODETerm(lambda t, y, args: -args * y)
    diffusion = diffrax.ControlTerm(
        lambda t, y, args: lx.DiagonalLinearOperator(0.1 * jnp.cos(y)), bm
    )
    return diffrax.MultiTerm(drift, diffusion)


@pytest.mark.parametrize("promotion", ["standard", "strict"])
def test_failed_paths_are_left_out_of_the_reductions(promotion):
    # One path in five is stiff (rate 300): the adaptive explicit solver runs out of
    # `max_steps` on it, and its saved values after the failure are `inf`. Also under
    # `jax_numpy_dtype_promotion="strict"`, where the reductions' integer counts met
    # floats implicitly (found by running the suite in strict mode).
    keys = jr.split(jr.key(4), 5)
    rates = jnp.array([1.0, 2.0, 300.0, 0.5, 1.5])
    qs = (0.0, 0.3, 0.5, 1.0)
    with jax.numpy_dtype_promotion(promotion):
        out = dl.solve_ensemble(
            _stiff_terms,
            diffrax.Heun(),
            0.0,
            T1,
            DT,
            Y0,
            rates,
            keys=keys,
            batch_args=True,
            saveat=SAVEAT,
            quantiles=qs,
            chunk_size=2,  # the failed path is in the second chunk, with a good one
            stepsize_controller=diffrax.PIDController(rtol=1e-2, atol=1e-2),
            max_steps=40,
            throw=False,
        )
    ok = np.asarray(out.paths.result._value) == 0
    np.testing.assert_array_equal(ok, [True, True, False, True, True])
    assert int(out.num_failed) == 1 and int(out.num_used) == 4
    ys = np.asarray(out.paths.ys)
    assert np.isinf(ys[2, -1]).all()
    np.testing.assert_allclose(out.mean, ys[ok].mean(0), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(out.var, ys[ok].var(0), rtol=1e-11, atol=1e-15)
    np.testing.assert_allclose(
        out.quantiles, np.quantile(ys[ok], qs, axis=0), rtol=1e-13, atol=1e-15
    )
    # (n - 1) q is an integer for q = 0, 1 (n = 4): order statistics of the used paths.
    np.testing.assert_array_equal(
        np.asarray(out.quantiles)[[0, 3]], np.quantile(ys[ok], [0, 1], axis=0)
    )


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32, jnp.float64])
def test_ordered_int_is_monotone(dtype):
    # The exact quantile algorithm bisects over these integers.
    info = jnp.finfo(dtype)
    values = np.array(
        [-np.inf, float(info.min), -2.5, -1.0, -float(info.tiny), -0.0, 0.0]
        + [float(info.tiny), 1e-3, 1.0, 3.0, float(info.max), np.inf],
        dtype=dtype,
    )
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.permutation(values))
    ints = _to_ordered_int(x)
    order = np.argsort(np.asarray(ints), kind="stable")
    sorted_x = np.asarray(x)[order]
    np.testing.assert_array_equal(sorted_x, np.sort(values))
    assert np.all(np.diff(np.asarray(ints)[order]) > 0)
    np.testing.assert_array_equal(
        np.asarray(_from_ordered_int(ints, x.dtype)).view(np.uint8),
        np.asarray(x).view(np.uint8),
    )


def test_errors():
    keys = jr.split(jr.key(5), 4)
    solve = lambda *a, **kw: dl.solve_ensemble(*a[:1], diffrax.Euler(), 0.0, T1, DT, *a[1:], **kw)
    with pytest.raises(TypeError, match="solve_ensemble.*`keys`"):
        solve(_terms, Y0, keys=jnp.zeros((4,)))
    with pytest.raises(TypeError, match="solve_ensemble.*`keys`"):
        solve(_terms, Y0, keys=keys.reshape(2, 2))
    with pytest.raises(TypeError, match="solve_ensemble.*`terms`"):
        solve(_terms(keys[0]), Y0, keys=keys)
    with pytest.raises(ValueError, match="solve_ensemble.*`y0`.*5 entries.*4 keys"):
        solve(_terms, jnp.ones((5, D)), keys=keys, batch_y0=True)
    with pytest.raises(ValueError, match="solve_ensemble.*`args`.*scalar"):
        solve(_terms, Y0, 1.0, keys=keys, batch_args=True)
    with pytest.raises(ValueError, match="solve_ensemble.*reduction 'median'"):
        solve(_terms, Y0, keys=keys, reductions=("median",))
    with pytest.raises(ValueError, match="solve_ensemble.*`quantiles`"):
        solve(_terms, Y0, keys=keys, quantiles=(1.5,))
    with pytest.raises(ValueError, match="solve_ensemble.*steps=True"):
        solve(_terms, Y0, keys=keys, saveat=diffrax.SaveAt(steps=True))
    for chunk_size in (0, -1, 2.5, 2.0, True, "3"):
        with pytest.raises(ValueError, match="solve_ensemble.*`chunk_size` must be a positive"):
            solve(_terms, Y0, keys=keys, chunk_size=chunk_size)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("x",))
    with pytest.raises(ValueError, match="solve_ensemble.*'y'.*not an axis"):
        solve(_terms, Y0, keys=keys, mesh=mesh, axis_names="y")


class _ScaledDiagonal(eqx.Module):
    scale: jax.Array

    def __call__(self, t, y, args):
        return lx.DiagonalLinearOperator(self.scale * y)


@pytest.mark.slow
def test_per_path_arrays_as_keys():
    # `keys` as a container of per-path arrays (here a key and a noise scale per path):
    # path i has the terms `terms(keys[i])`, in every mode, as a `jax.vmap` over them.
    data = dict(key=jr.split(jr.key(11), 4), scale=jnp.array([0.1, 0.2, 0.3, 0.4]))

    def terms(path):
        bm = diffrax.VirtualBrownianTree(0.0, T1, 1e-2, (D,), path["key"])
        # The scale as an array field of the terms, not a closure, as `lanes` asks.
        g = _ScaledDiagonal(path["scale"])
        return diffrax.MultiTerm(diffrax.ODETerm(lambda t, y, args: -y), diffrax.ControlTerm(g, bm))

    def reference(saveat, **options):
        solve = lambda path: (
            diffrax.diffeqsolve(
                terms(path), dl.ItoMilstein(), 0.0, T1, DT, Y0, saveat=saveat, **options
            ).ys
        )
        return np.asarray(jax.jit(jax.vmap(solve))(data))

    pid = dict(stepsize_controller=diffrax.PIDController(rtol=1e-3, atol=1e-3))
    t1 = diffrax.SaveAt(t1=True)
    at_ts = reference(SAVEAT)
    cases = [
        (dict(saveat=SAVEAT), at_ts, 1e-12),
        (dict(saveat=SAVEAT, chunk_size=3), at_ts, 1e-12),
        (dict(saveat=SAVEAT, shared_step=True), at_ts, 1e-12),
        # Adaptive: the controller amplifies the lanes loop's other rounding (3e-9 here);
        # a path given another path's data would be off by more than 1e-2.
        (dict(saveat=t1, lanes=2, **pid), reference(t1, **pid), 1e-7),
    ]
    for options, expected, rtol in cases:
        sol = dl.solve_ensemble(terms, dl.ItoMilstein(), 0.0, T1, DT, Y0, keys=data, **options)
        np.testing.assert_allclose(sol.paths.ys, expected, rtol=rtol, atol=1e-14)
    with pytest.raises(ValueError, match="solve_ensemble.*`keys`.*different leading"):
        dl.solve_ensemble(
            terms, dl.ItoMilstein(), 0.0, T1, DT, Y0, keys=dict(data, scale=jnp.ones(5))
        )


@pytest.mark.slow
def test_multidevice_subprocess():
    """Eight simulated CPU devices, in a fresh process: see `ensemble_multidevice.py`."""
    script = pathlib.Path(__file__).parent / "ensemble_multidevice.py"
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    result = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "checks passed on 8 devices" in result.stdout, result.stdout
