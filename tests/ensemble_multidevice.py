"""Multi-device checks of `diffrax_linearize.solve_ensemble`, run by
`tests/test_ensemble.py` in a subprocess: simulating several CPU devices needs
`XLA_FLAGS` set before JAX starts, which must not leak into the other tests.

Runs in float32 (the in-process tests cover float64). Prints one summary line,
`ensemble-multidevice: N checks passed on D devices`, and exits nonzero on failure.
"""

import os
import sys
import time


NUM_DEVICES = 8
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={NUM_DEVICES}"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import diffrax
import diffrax_linearize as dl
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import lineax as lx
import numpy as np
from helpers import assert_equal_to_rounding
from jax.sharding import Mesh, PartitionSpec as P


assert jax.device_count() == NUM_DEVICES, jax.devices()
checks = 0
D = 3
T1 = 1.0
DT = 0.1
SAVEAT = diffrax.SaveAt(ts=jnp.linspace(0.0, T1, 4))
A = -0.5 * jnp.eye(D) + 0.3 * jr.normal(jr.key(1), (D, D))


def elementwise_terms(key):
    bm = diffrax.VirtualBrownianTree(0.0, T1, 1e-2, (D,), key, levy_area=diffrax.SpaceTimeLevyArea)
    drift = diffrax.ODETerm(lambda t, y, args: -args * y * jnp.cos(y))
    diffusion = diffrax.ControlTerm(
        lambda t, y, args: lx.DiagonalLinearOperator(0.5 * jnp.sin(y) + 0.1), bm
    )
    return diffrax.MultiTerm(drift, diffusion)


def matvec_terms(key):
    bm = diffrax.VirtualBrownianTree(0.0, T1, 1e-2, (D,), key)
    drift = diffrax.ODETerm(lambda t, y, args: A @ y)
    diffusion = diffrax.ControlTerm(lambda t, y, args: lx.DiagonalLinearOperator(0.2 * y), bm)
    return diffrax.MultiTerm(drift, diffusion)


def reference(terms, solver, keys, y0, args, batch_y0=False, batch_args=False):
    def solve(key, y0, args):
        return diffrax.diffeqsolve(terms(key), solver, 0.0, T1, DT, y0, args, saveat=SAVEAT).ys

    # `filter_jit`, as in `solve_ensemble`: Python scalars in `args` are compile-time
    # constants in both, so XLA fuses (and rounds) the two programs alike.
    in_axes = (0, 0 if batch_y0 else None, 0 if batch_args else None)
    run = eqx.filter_jit(lambda *xs: jax.vmap(solve, in_axes=in_axes)(*xs))
    return np.asarray(run(keys, y0, args))


def stage(name, _t=[time.perf_counter()]):
    print(f"  {name}: {time.perf_counter() - _t[0]:.1f} s", file=sys.stderr)
    _t[0] = time.perf_counter()


def check(cond, what):
    global checks
    if not cond:
        raise AssertionError(what)
    checks += 1


y0 = jnp.array([1.0, -0.5, 0.25])

# 1. Every path equals an unsharded `jax.vmap` on the same keys, bit for bit, for
# two solvers, path counts (uneven: 13 and 21 on 8 devices) and chunk sizes. (Other
# solvers are checked on one device in `test_ensemble.py`: nothing about sharding
# depends on the solver.) The vector
# fields are elementwise, so batching cannot change any floating-point operation.
cases = [
    (diffrax.Euler(), 13, None),
    (diffrax.Euler(), 21, 2),
    (diffrax.Heun(), 16, None),
]
for solver, num_paths, chunk_size in cases:
    keys = jr.split(jr.key(num_paths), num_paths)
    expected = reference(elementwise_terms, solver, keys, y0, 1.0)
    out = dl.solve_ensemble(
        elementwise_terms,
        solver,
        0.0,
        T1,
        DT,
        y0,
        1.0,
        keys=keys,
        saveat=SAVEAT,
        chunk_size=chunk_size,
    )
    assert_equal_to_rounding(out.paths.ys, expected)
    check(out.paths.ys.shape == (num_paths, 4, D), "shape")
    check(int(out.num_failed) == 0, "num_failed")
    np.testing.assert_array_equal(out.ts, SAVEAT.subs.ts)
    checks += 2
    if num_paths % NUM_DEVICES == 0:
        # Evenly divisible: the paths stay sharded, one block per device.
        check(out.paths.ys.sharding.spec == P("paths"), out.paths.ys.sharding)
        check(
            {s.data.shape[0] for s in out.paths.ys.addressable_shards}
            == {num_paths // NUM_DEVICES},
            "shard sizes",
        )

stage("before 2")
# 2. Reductions against numpy on the gathered paths (13 paths: padding must be masked
# out exactly, or the mean would be visibly off). Quantiles at integer positions are
# order statistics, so they must be exact; the others interpolate as numpy does.
keys = jr.split(jr.key(0), 13)
qs = (0.0, 0.25, 0.5, 0.9, 1.0)
for chunk_size in (1,):
    out = dl.solve_ensemble(
        elementwise_terms,
        diffrax.Heun(),
        0.0,
        T1,
        DT,
        y0,
        1.0,
        keys=keys,
        saveat=SAVEAT,
        quantiles=qs,
        chunk_size=chunk_size,
    )
    ys = np.asarray(out.paths.ys)
    np.testing.assert_allclose(out.mean, ys.mean(0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out.var, ys.var(0), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(out.quantiles, np.quantile(ys, qs, axis=0), rtol=1e-6, atol=1e-7)
    # (n - 1) q is an integer for q = 0, 0.25, 0.5, 1 with n = 13.
    np.testing.assert_array_equal(
        np.asarray(out.quantiles)[[0, 1, 2, 4]], np.quantile(ys, [0, 0.25, 0.5, 1], axis=0)
    )
    check(out.mean.sharding.is_fully_replicated, "mean replicated")
    checks += 4

stage("before 3")
# 3. Summaries only (no paths kept): same mean and variance.
out_summary = dl.solve_ensemble(
    elementwise_terms,
    diffrax.Heun(),
    0.0,
    T1,
    DT,
    y0,
    1.0,
    keys=keys,
    saveat=SAVEAT,
    return_paths=False,
    chunk_size=1,
)
check(out_summary.paths is None, "paths dropped")
np.testing.assert_allclose(out_summary.mean, ys.mean(0), rtol=1e-6, atol=1e-6)
np.testing.assert_allclose(out_summary.var, ys.var(0), rtol=1e-5, atol=1e-7)
checks += 2

stage("before 4")
# 4. Batched initial conditions and args.
keys = jr.split(jr.key(3), 11)
y0s = jr.normal(jr.key(4), (11, D))
argss = jnp.linspace(0.5, 1.5, 11)
out = dl.solve_ensemble(
    elementwise_terms,
    diffrax.Euler(),
    0.0,
    T1,
    DT,
    y0s,
    argss,
    keys=keys,
    batch_y0=True,
    batch_args=True,
    saveat=SAVEAT,
    chunk_size=1,
)
expected = reference(
    elementwise_terms, diffrax.Euler(), keys, y0s, argss, batch_y0=True, batch_args=True
)
assert_equal_to_rounding(out.paths.ys, expected)
checks += 1

stage("before 5")
# 5. A matrix-vector drift: XLA's CPU dot kernels depend on the batch size, so the
# sharded result (per-device batch of 2) is bit for bit equal to `vmap` over batches of
# the same size, and only within rounding to `vmap` over all 16 paths at once.
keys = jr.split(jr.key(5), 16)
out = dl.solve_ensemble(matvec_terms, diffrax.Euler(), 0.0, T1, DT, y0, keys=keys, saveat=SAVEAT)
same_batches = np.concatenate(
    [reference(matvec_terms, diffrax.Euler(), keys[i : i + 2], y0, None) for i in range(0, 16, 2)]
)
np.testing.assert_array_equal(out.paths.ys, same_batches)
whole = reference(matvec_terms, diffrax.Euler(), keys, y0, None)
np.testing.assert_allclose(out.paths.ys, whole, rtol=1e-5, atol=1e-6)
checks += 2

stage("before 6")
# 6. A two-dimensional (4x2) mesh, paths sharded over both axes.
keys = jr.split(jr.key(6), 13)
expected = reference(elementwise_terms, diffrax.Euler(), keys, y0, 1.0)
meshes = [
    (Mesh(np.asarray(jax.devices()).reshape(4, 2), ("a", "b")), None),
]
for mesh, axis_names in meshes:
    out = dl.solve_ensemble(
        elementwise_terms,
        diffrax.Euler(),
        0.0,
        T1,
        DT,
        y0,
        1.0,
        keys=keys,
        saveat=SAVEAT,
        mesh=mesh,
        axis_names=axis_names,
        quantiles=(0.5,),
    )
    assert_equal_to_rounding(out.paths.ys, expected)
    np.testing.assert_allclose(out.mean, expected.mean(0), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out.quantiles[0], np.median(np.asarray(out.paths.ys), axis=0))
    checks += 3

stage("before 7")
# 7. Failed paths: `throw=True` raises on the host (no deadlock); `throw=False` counts.
try:
    dl.solve_ensemble(
        elementwise_terms, diffrax.Euler(), 0.0, T1, DT, y0, 1.0, keys=keys, max_steps=3
    )
except RuntimeError as e:
    check("solve_ensemble" in str(e), str(e))
else:
    raise AssertionError("expected a RuntimeError for failed paths")
out = dl.solve_ensemble(
    elementwise_terms,
    diffrax.Euler(),
    0.0,
    T1,
    DT,
    y0,
    1.0,
    keys=keys,
    max_steps=3,
    throw=False,
)
check(int(out.num_failed) == 13, out.num_failed)
check(np.isnan(out.mean).all(), "no path used: NaN mean")

# Some paths failed: the reductions over devices leave them out. Two stiff paths of
# 13 (rate 300) run out of `max_steps`, on different devices.
rates = jnp.ones(13).at[3].set(300.0).at[10].set(300.0)


def stiff_terms(key):
    bm = diffrax.VirtualBrownianTree(0.0, T1, 1e-3, (D,), key)
    drift = diffrax.ODETerm(lambda t, y, args: -args * y)
    diffusion = diffrax.ControlTerm(
        lambda t, y, args: lx.DiagonalLinearOperator(0.1 * jnp.cos(y)), bm
    )
    return diffrax.MultiTerm(drift, diffusion)


out = dl.solve_ensemble(
    stiff_terms,
    diffrax.Heun(),
    0.0,
    T1,
    DT,
    y0,
    rates,
    keys=keys,
    batch_args=True,
    saveat=SAVEAT,
    quantiles=(0.0, 0.5, 1.0),
    stepsize_controller=diffrax.PIDController(rtol=1e-2, atol=1e-2),
    max_steps=40,
    throw=False,
)
ok = np.asarray(out.paths.result._value) == 0
check(ok.sum() == 11 and not ok[3] and not ok[10], ok)
check(int(out.num_failed) == 2 and int(out.num_used) == 11, out.num_failed)
ys = np.asarray(out.paths.ys)
np.testing.assert_allclose(out.mean, ys[ok].mean(0), rtol=1e-6, atol=1e-6)
np.testing.assert_allclose(out.var, ys[ok].var(0), rtol=1e-5, atol=1e-7)
# (n - 1) q is an integer for q = 0, 0.5, 1 with n = 11: order statistics, exactly.
np.testing.assert_array_equal(out.quantiles, np.quantile(ys[ok], (0.0, 0.5, 1.0), axis=0))
checks += 3

# Refilling lanes (`lanes=2`) on every device, 13 paths of very different rates (uneven:
# two per device, and padding that is never solved): each path takes the steps of
# `diffeqsolve` on its own, and the reductions leave out the two that run out of steps.
rates = jnp.array([1.0, 30.0, 2.0, 300.0, 5.0, 0.5, 60.0, 1.5, 10.0, 3.0, 300.0, 0.7, 20.0])
controller = diffrax.PIDController(rtol=1e-2, atol=1e-2)


def lanes_reference(key, rate):
    sol = diffrax.diffeqsolve(
        stiff_terms(key),
        diffrax.Heun(),
        0.0,
        T1,
        DT,
        y0,
        rate,
        stepsize_controller=controller,
        max_steps=40,
        throw=False,
    )
    return sol.ys, sol.stats["num_steps"], sol.result._value


expected_ys, expected_steps, expected_result = eqx.filter_jit(jax.vmap(lanes_reference))(
    keys, rates
)
out = dl.solve_ensemble(
    stiff_terms,
    diffrax.Heun(),
    0.0,
    T1,
    DT,
    y0,
    rates,
    keys=keys,
    batch_args=True,
    lanes=2,
    stepsize_controller=controller,
    max_steps=40,
    throw=False,
)
np.testing.assert_array_equal(out.paths.stats["num_steps"], expected_steps)
np.testing.assert_array_equal(out.paths.result._value, expected_result)
assert_equal_to_rounding(out.paths.ys, expected_ys)
ok = np.asarray(expected_result) == 0
check(len(np.unique(expected_steps)) > 5 and 0 < ok.sum() < 13, expected_steps)
check(int(out.num_failed) == (~ok).sum(), out.num_failed)
np.testing.assert_allclose(out.mean, np.asarray(expected_ys)[ok].mean(0), rtol=1e-5, atol=1e-6)
checks += 4
stage("refilling lanes")


# 8. Implicit solvers, whose `lineax.linear_solve`s failed under `jax.shard_map` (lineax
# issue #185): Kvaerno3 on a stiff ODE and the drift-implicit Milstein with an adaptive
# controller, with and without lanes, path for path against `diffeqsolve` (13 paths:
# uneven over 8 devices). (`ImplicitItoMilstein` with lanes is checked against itself on
# one device: its lanes follow `diffeqsolve` only to the tolerance, as rounding changes
# its root finder's iteration counts, see `test_ensemble_lanes.py`.)
def stiff_ode_terms(key):
    del key
    return diffrax.ODETerm(lambda t, y, args: -args * jnp.stack([y[0] - y[1] ** 2, y[1], y[2]]))


def implicit_reference(terms, solver, controller):
    def solve(key, rate):
        sol = diffrax.diffeqsolve(
            terms(key),
            solver,
            0.0,
            T1,
            DT,
            y0,
            rate,
            stepsize_controller=controller,
            throw=False,
        )
        return sol.ys, sol.stats["num_steps"]

    return eqx.filter_jit(jax.vmap(solve))(keys, rates)


implicit_cases = [
    (stiff_ode_terms, diffrax.Kvaerno3(), diffrax.PIDController(rtol=1e-4, atol=1e-6), True),
    (stiff_terms, dl.ImplicitItoMilstein(), controller, False),
]
for terms, solver, implicit_controller, lanes_exact in implicit_cases:
    expected_ys, expected_steps = implicit_reference(terms, solver, implicit_controller)
    check(len(np.unique(expected_steps)) > 3, expected_steps)
    for lanes in (None, 2):
        solve = lambda **mesh: dl.solve_ensemble(
            terms,
            solver,
            0.0,
            T1,
            DT,
            y0,
            rates,
            keys=keys,
            batch_args=True,
            lanes=lanes,
            stepsize_controller=implicit_controller,
            throw=False,
            **mesh,
        )
        out = solve()
        check(int(out.num_failed) == 0, out.num_failed)
        if lanes is None or lanes_exact:
            np.testing.assert_array_equal(out.paths.stats["num_steps"], expected_steps)
            assert_equal_to_rounding(out.paths.ys, expected_ys)
            np.testing.assert_allclose(
                out.mean, np.asarray(expected_ys).mean(0), rtol=1e-5, atol=1e-6
            )
            checks += 3
        else:
            one = solve(mesh=Mesh(np.asarray(jax.devices()[:1]), ("paths",)))
            np.testing.assert_array_equal(
                out.paths.stats["num_steps"], one.paths.stats["num_steps"]
            )
            assert_equal_to_rounding(out.paths.ys, one.paths.ys)
            checks += 2
stage("implicit solvers")


# One step size per device (`shared_step=True`): 13 paths of very different rates, two per
# device (the last device's second path, and the whole of the eighth device, padding). Each
# device's pair is one system with its own steps: the same as that pair solved alone on one
# device, and the lone last path solved alone (its padding a copy of itself, not of path 0).
def shared(keys, rates, **mesh):
    return dl.solve_ensemble(
        stiff_terms,
        diffrax.Heun(),
        0.0,
        T1,
        DT,
        y0,
        rates,
        keys=keys,
        batch_args=True,
        shared_step=True,
        saveat=diffrax.SaveAt(t1=True),
        stepsize_controller=controller,
        max_steps=2000,
        throw=False,
        **mesh,
    )


out = shared(keys, rates)
one_device = Mesh(np.asarray(jax.devices()[:1]), ("paths",))
steps = []
for lo in range(0, 13, 2):
    alone = shared(keys[lo : lo + 2], rates[lo : lo + 2], mesh=one_device)
    np.testing.assert_array_equal(
        out.paths.stats["num_steps"][lo : lo + 2], alone.paths.stats["num_steps"]
    )
    assert_equal_to_rounding(out.paths.ys[lo : lo + 2], alone.paths.ys)
    steps.append(int(alone.paths.stats["num_steps"][0]))
    checks += 2
check(len(set(steps)) > 3 and int(out.num_failed) == 0, (steps, out.num_failed))
stage("shared step")

# 8b. A default device set (`jax.default_device`, a device or a platform name) is where
# the default mesh puts the ensemble, as JAX puts a jitted function: that device alone,
# not all of `jax.devices()`; and its paths are those of a mesh of that device given.
keys16 = jr.split(jr.key(8), 16)
expected = reference(elementwise_terms, diffrax.Heun(), keys16, y0, 1.0)
for default, device in [(jax.devices()[3], jax.devices()[3]), ("cpu", jax.devices()[0])]:
    with jax.default_device(default):
        out = dl.solve_ensemble(
            elementwise_terms, diffrax.Heun(), 0.0, T1, DT, y0, 1.0, keys=keys16, saveat=SAVEAT
        )
    check(out.paths.ys.sharding.device_set == {device}, (default, out.paths.ys.sharding))
    check(out.mean.sharding.device_set == {device}, (default, out.mean.sharding))
    assert_equal_to_rounding(out.paths.ys, expected)
    checks += 1
everywhere = dl.solve_ensemble(
    elementwise_terms, diffrax.Heun(), 0.0, T1, DT, y0, 1.0, keys=keys16, saveat=SAVEAT
)
check(everywhere.paths.ys.sharding.device_set == set(jax.devices()), everywhere.paths.ys.sharding)
stage("default device")

# 9. The paths are solved where they live: the compiled program holds each device's
# block of paths (16 / 8 = 2; shape (1 device, 2 paths, 3)) and never the whole batch,
# and gathers nothing.
keys16 = jr.split(jr.key(7), 16)
lowered = jax.jit(
    lambda keys: (
        dl.solve_ensemble(
            elementwise_terms, diffrax.Heun(), 0.0, T1, DT, y0, 1.0, keys=keys, throw=False
        ).mean
    )
).lower(keys16)
hlo = lowered.compile().as_text()
check("all-gather" not in hlo and "all-to-all" not in hlo, "gathers")
check(
    "f32[1,2,3]" in hlo and "f32[8,2,3]" not in hlo and "f32[16,3]" not in hlo,
    "per-device blocks",
)

print(f"ensemble-multidevice: {checks} checks passed on {jax.device_count()} devices")
sys.exit(0)
