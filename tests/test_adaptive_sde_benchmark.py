"""The pieces of `benchmarks/adaptive_sde.py` that its numbers rest on: the grid Brownian path
of the general-noise problem (against Chen's relations, written out here independently), the
Stratonovich drift given to Diffrax's solvers (against the correction by hand), the
acceptance ratios (against a synthetic work-precision curve), and, under `slow`, the
reference against the solvers on the same path."""

import jax


jax.config.update("jax_enable_x64", True)

import diffrax as dfx
import diffrax_linearize as dl
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from benchmarks import adaptive_sde as bench


N = 64


def _grid_checks():
    """Every quantity the test compares, computed in one jitted function (eager dispatch is
    slow on the busy machine)."""
    # Any antisymmetric cell areas will do (the sampler of `_grid_data` is the library's).
    h = bench.T1 / N
    k_w, k_a, k_h = jr.split(jr.key(0), 3)
    dW = jnp.sqrt(h) * jr.normal(k_w, (N, 2))
    x = h * jr.normal(k_a, (N,))
    areas = jnp.stack([jnp.stack([0 * x, x], -1), jnp.stack([-x, 0 * x], -1)], -2)
    H = jnp.sqrt(h / 12) * jr.normal(k_h, (N, 2))
    sums = bench._grid_sums(h, dW, areas, H)
    iterated = bench._GridPath(h, "iterated", sums)
    spacetime = bench._GridPath(h, "spacetime", sums)
    s, t, u = 5 * h, 23 * h, 50 * h
    a, b, c = (iterated.evaluate(*x, use_levy=True) for x in ((s, t), (t, u), (s, u)))
    # The library's own grid path over the same cells.
    ks = jnp.arange(N) * h
    cells = jax.vmap(lambda x, y: iterated.evaluate(x, y, use_levy=True))(ks, ks + h)
    grid = dl.GridLevyAreaPath(jnp.linspace(0.0, 1.0, N + 1), cells.W, cells.A)
    p, q, r = (spacetime.evaluate(*x, use_levy=True) for x in ((s, t), (t, u), (s, u)))
    return dict(
        a=a,
        b=b,
        c=c,
        theirs=grid.evaluate(s, u, use_levy=True),
        p=p,
        q=q,
        r=r,
        h=(s, t, u),
        # Times off the grid are rounded to it; an empty step has no increment and no area.
        off=iterated.evaluate(s + 0.3 * h, u - 0.2 * h, use_levy=True),
        empty=spacetime.evaluate(s, s + 0.2 * h, use_levy=True),
    )


@pytest.mark.standard_promotion
def test_grid_path_matches_chen_and_the_grid_path():
    x = jax.jit(_grid_checks)()
    a, b, c = x["a"], x["b"], x["c"]
    s, t, u = x["h"]
    np.testing.assert_allclose(c.W, a.W + b.W, rtol=1e-12, atol=1e-14)
    chen = a.A + b.A + 0.5 * (jnp.outer(a.W, b.W) - jnp.outer(b.W, a.W))
    np.testing.assert_allclose(c.A, chen, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(c.dt, u - s)
    assert not np.allclose(c.A, 0.0)
    np.testing.assert_allclose(c.W, x["theirs"].W, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(c.A, x["theirs"].A, rtol=1e-10, atol=1e-13)
    # Space-time area: h H = h1 H1 + h2 H2 + (h2 dW1 - h1 dW2) / 2.
    p, q, r = x["p"], x["q"], x["r"]
    h1, h2 = t - s, u - t
    combined = (h1 * p.H + h2 * q.H + 0.5 * (h2 * p.W - h1 * q.W)) / (h1 + h2)
    np.testing.assert_allclose(r.H, combined, rtol=1e-10, atol=1e-13)
    assert isinstance(r, dfx.SpaceTimeLevyArea)
    np.testing.assert_allclose(x["off"].A, c.A)
    np.testing.assert_array_equal(x["empty"].W, 0.0)
    np.testing.assert_array_equal(x["empty"].H, 0.0)


def test_stratonovich_drift_of_diagonal_noise():
    # g = diag(sigma_i(y_i)): the correction is -1/2 sigma_i sigma_i'.
    y = jnp.array([0.3, -1.2])
    t = 0.47
    s = bench._burst(t) * 0.5
    by_hand = bench._well_f(t, y, None) - 0.5 * (s * jnp.sqrt(1 + y**2)) * (
        s * y / jnp.sqrt(1 + y**2)
    )
    ours = jax.jit(bench._stratonovich(bench._well_f, bench._well_g))(t, y, None)
    np.testing.assert_allclose(ours, by_hand, rtol=1e-12)


def test_acceptance_ratios_on_a_synthetic_curve():
    # Fixed steps: error = 1 / steps; adaptive: error = 1 / (4 steps), so at equal error the
    # fixed step needs 4x the steps (and, at equal time per step, 4x the time).
    rows = []
    for method, gain, params in (
        ("ours fixed", 1.0, [1 / 16, 1 / 64, 1 / 256]),
        ("ours adaptive", 4.0, [1e-2, 1e-3, 1e-4]),
        ("HalfSolver(ours)", 2.0, [1e-2, 1e-3, 1e-4]),
        ("diffrax.SPaRK", 8.0, [1e-2, 1e-3, 1e-4]),
    ):
        for k, p in enumerate(params):
            steps = 16.0 * 4**k
            rows.append(
                dict(
                    problem="p",
                    method=method,
                    param=p,
                    rms_error=1 / (gain * steps),
                    steps=steps,
                    time_per_path_s=1e-6 * steps,
                    failed_paths=0,
                )
            )
    acc = {a["what"]: a for a in bench.acceptance(rows)}
    np.testing.assert_allclose(acc["fixed / adaptive"]["steps_ratio"], 4.0, rtol=1e-12)
    np.testing.assert_allclose(acc["fixed / adaptive"]["time_ratio"], 4.0, rtol=1e-12)
    np.testing.assert_allclose(acc["HalfSolver / adaptive"]["steps_ratio"], 2.0, rtol=1e-12)
    np.testing.assert_allclose(acc["adaptive / Diffrax best"]["time_ratio"], 2.0, rtol=1e-12)
    assert acc["adaptive / Diffrax best"]["time_ratio_vs"] == "diffrax.SPaRK"
    assert acc["fixed / adaptive"]["met"] and acc["HalfSolver / adaptive"]["met"]
    assert not acc["adaptive / Diffrax best"]["met"]
    assert max(line.count("|") - 1 for line in bench.table(list(acc.values())).splitlines()) <= 8


def test_cost_at_interpolates_and_refuses_a_flat_extrapolation():
    # cost = error^(-1/2) (order 2): exact in log-log space, inside and outside the points.
    errors = [1e-1, 1e-2, 1e-3]
    costs = [e**-0.5 for e in errors]
    c, extrapolated = bench._cost_at(errors, costs, 3e-2)
    np.testing.assert_allclose(c, 3e-2**-0.5, rtol=1e-12)
    assert not extrapolated
    c, extrapolated = bench._cost_at(errors, costs, 1e-4)
    np.testing.assert_allclose(c, 1e-4**-0.5, rtol=1e-9)
    assert extrapolated
    # Two points of almost equal error (one path dominating both): no extrapolation.
    assert bench._cost_at([0.0296, 0.029], [131.0, 459.0], 0.037) == (None, True)


def test_fixed_steps_on_a_synthetic_curve():
    # Ours at fixed steps: error = dt; SPaRK: error = dt / 4 at twice the time per step.
    # SPaRK at dt is ours at dt / 4 (k = 4) for 2x the cost per step: at equal error it is
    # 2x cheaper.
    dts = [2.0**-k for k in range(3, 8)]
    rows = []
    for method, gain, cost in (("ours fixed", 1.0, 1.0), ("SPaRK fixed", 4.0, 2.0)):
        for dt in dts:
            rows.append(
                dict(
                    problem="p",
                    method=method,
                    adaptive=False,
                    param=dt,
                    rms_error=dt / gain,
                    steps=1 / dt,
                    time_per_path_s=1e-6 * cost / dt,
                    traced_calls_per_step=3 * cost,
                    failed_paths=0,
                )
            )
    fixed = bench.fixed_steps(rows)
    assert [f["dt"] for f in fixed] == sorted(dts, reverse=True)
    inside = [f for f in fixed if not f["k_extrapolated"]]
    # SPaRK's errors at its two smallest steps lie below ours' smallest: extrapolated.
    assert len(inside) == 3
    for f in fixed:
        np.testing.assert_allclose(f["k"], 4.0, rtol=1e-9)
        np.testing.assert_allclose(f["cost_per_step_ratio"], 2.0, rtol=1e-12)
        np.testing.assert_allclose(f["calls_per_step_ratio"], 2.0, rtol=1e-12)
        np.testing.assert_allclose(f["spark_cheaper_by"], 2.0, rtol=1e-9)
    acc = {a["what"]: a for a in bench.acceptance(rows + _adaptive_row())}
    # At equal error ours at fixed steps takes 4x SPaRK's steps, each half the time.
    np.testing.assert_allclose(acc["fixed / SPaRK fixed"]["steps_ratio"], 4.0, rtol=1e-9)
    np.testing.assert_allclose(acc["fixed / SPaRK fixed"]["time_ratio"], 2.0, rtol=1e-9)
    assert "n/a" not in bench.fixed_table(fixed)


def _adaptive_row():
    """One point of ours adaptive at the target tolerance (the error every ratio is at)."""
    return [
        dict(
            problem="p",
            method="ours adaptive",
            adaptive=True,
            param=bench.TARGET_RTOL,
            rms_error=2.0**-6,
            steps=10.0,
            time_per_path_s=1e-5,
            failed_paths=0,
        )
    ]


@pytest.mark.slow  # compiles three solves: about a minute on the busy 2-core machine
@pytest.mark.parametrize("name", list(bench.PROBLEMS))
def test_reference_and_solvers_agree(name):
    # The benchmark's self-check at small sizes: ours adaptive at rtol 1e-3 and SPaRK (on
    # the Stratonovich drift, the same solution) come close to the fine reference on the same
    # paths, and the reference moves much less than ours' error when its step is doubled.
    problem = bench.PROBLEMS[name]
    contenders = bench._contenders(problem, quick=True)
    n_ref = 2**12
    keys = bench.path_inputs(problem, jr.split(jr.key(1), 8), n_ref)
    spec = dict(contenders["ours fixed"], solver=problem.get("reference", problem["ours"]))
    fixed = jax.jit(bench._make_solve(problem, spec, n_ref, n_ref))
    ref, _, ok = fixed(keys, 1 / n_ref)
    half, _, _ = fixed(keys, 2 / n_ref)
    assert np.all(ok)
    rms = lambda a: float(jnp.sqrt(jnp.mean(jnp.sum((a - ref) ** 2, axis=-1))))  # noqa: E731
    for c in ("ours adaptive", "diffrax.SPaRK"):
        solve = jax.jit(bench._make_solve(problem, contenders[c], n_ref, n_ref))
        ys, steps, ok = solve(keys, 1e-3)
        assert np.all(ok), c
        assert rms(ys) < 0.1, (c, rms(ys))
        if c == "ours adaptive":
            # (SPaRK at rtol 1e-3 comes as close to the reference as the reference's own
            # step halving: its tightest points in the benchmark are reference-limited.)
            assert rms(half) < 0.3 * rms(ys), (c, rms(half), rms(ys))


def _loop(n_dots: int, nested: bool = False):
    def fn(x, n):
        def body(i, x):
            for _ in range(n_dots):
                x = jnp.sin(x @ x)
            if nested:
                x = jax.lax.fori_loop(0, n, lambda j, y: jnp.cos(y @ y), x)
            return x

        return jax.lax.fori_loop(0, n, body, x)

    # A trip count known only at run time, so that the compiler keeps the loop.
    return jax.jit(fn).lower(jnp.eye(3), 5).compile().as_text()


def test_loop_kernels_counts_the_loop_and_refuses_an_inner_loop():
    # Each product is a kernel of its own: two more products, at least two more kernels.
    one, three = bench._loop_kernels(_loop(1)), bench._loop_kernels(_loop(3))
    assert one is not None and three is not None and three >= one + 2 > 2
    assert bench._loop_kernels(_loop(1, nested=True)) is None
    assert bench._loop_kernels(jax.jit(jnp.sin).lower(1.0).compile().as_text()) is None


@pytest.mark.slow
def test_breakdown_variants_take_the_fixed_steps():
    # The breakdown's variants of ours at a fixed step (per-path step times; adaptive with
    # every step accepted) take the same steps as the fixed solve and land where it does.
    name = "double well, noise burst"
    problem, n_ref, dt = bench.PROBLEMS[name], 2**8, 2.0**-4
    keys = bench.path_inputs(problem, jr.split(jr.key(0), 3), n_ref, grid=True)
    fixed = dict(solver=problem["ours"], ito=True, adaptive=False, grid=True)
    loose = dict(bench.CONTROLLER, rtol=1e6, atol=1e6, dtmax=dt)
    accepted = dict(fixed, adaptive=True, controller=loose, dt0=dt)
    controller_only = dict(accepted, solver=bench._WithoutEstimate(problem["ours"]))

    @jax.jit
    def solves(keys):
        return (
            bench._make_solve(problem, fixed, n_ref, n_ref)(keys, dt),
            bench._make_solve(problem, fixed, n_ref, n_ref, param_axis=0)(keys, jnp.full(3, dt)),
            bench._make_solve(problem, accepted, n_ref, n_ref)(keys, 0.0),
            bench._make_solve(problem, controller_only, n_ref, n_ref)(keys, 0.0),
        )

    (y, steps, ok), (y_path, steps_path, _), *adaptive = solves(keys)
    assert bool(jnp.all(ok))
    assert np.all(np.asarray(steps) == 16) and np.all(np.asarray(steps_path) == 16)
    np.testing.assert_allclose(y_path, y, rtol=1e-12, atol=1e-12)
    for y_adaptive, steps_adaptive, ok_adaptive in adaptive:
        assert bool(jnp.all(ok_adaptive))
        assert np.all(np.asarray(steps_adaptive) == 16)
        np.testing.assert_allclose(y_adaptive, y, rtol=1e-10, atol=1e-10)
    # Not a solve that ignores the path: another path lands elsewhere.
    assert float(jnp.max(jnp.abs(y[0] - y[1]))) > 1e-3


# Van der Pol (the implicit solver on the batch: 16 s in the suite) is a second case of the
# same wrapper (`_make_shared_solve`, `_BatchedPath`): slow.
# Every SDE in the slow suite (13 s for the double well, the cheapest): this checks the
# benchmark's wiring; the library's shared step is checked by default in
# test_ensemble_shared.py (at a fixed step it is the per-path solve, path for path, on
# commutative and general noise) and test_ensemble.py (grid data passed as keys).
_SHARED = [pytest.param(n, marks=pytest.mark.slow) for n in bench.PROBLEMS]


@pytest.mark.parametrize("name", _SHARED)
def test_shared_step_solves_the_same_paths(name):
    # The shared-step contenders (`solve_ensemble(..., shared_step=True)`) solve the batch as
    # one system on the paths' own trees or grid paths: at a fixed step it is the per-path
    # solve, path for path; adaptive, every path takes the same steps.
    problem = bench.PROBLEMS[name]
    contenders = bench._contenders(problem, quick=True)
    shared = contenders["ours adaptive, shared step"]
    n_ref = 2**10
    paths = bench.path_inputs(problem, jr.split(jr.key(2), 4), n_ref)
    per_path = bench._make_solve(problem, contenders["ours fixed"], n_ref, n_ref)
    fixed_shared = bench._make_solve(problem, dict(shared, adaptive=False), n_ref, n_ref)
    # (Van der Pol's fixed Newton solve fails at steps above about 2^-7.)
    dt = 2.0**-8
    ys, steps, ok = jax.jit(per_path)(paths, dt)
    ys_shared, steps_shared, ok_shared = jax.jit(fixed_shared)(paths, dt)
    assert np.all(ok) and np.all(ok_shared)
    assert np.array_equal(steps, steps_shared)
    np.testing.assert_allclose(ys_shared, ys, rtol=1e-12, atol=1e-12)
    ys, steps, ok = jax.jit(bench._make_solve(problem, shared, n_ref, n_ref))(paths, 1e-2)
    assert np.all(ok) and steps.shape == (4,) and len(set(np.asarray(steps).tolist())) == 1
    assert np.all(np.isfinite(ys))
    # SPaRK's shared-step contender (Stratonovich drift, space-time Lévy areas) likewise.
    spark, spark_shared = contenders["SPaRK fixed"], contenders["diffrax.SPaRK, shared step"]
    ys = jax.jit(bench._make_solve(problem, spark, n_ref, n_ref))(paths, dt)[0]
    spark_fixed_shared = dict(spark_shared, adaptive=False)
    ys_shared = jax.jit(bench._make_solve(problem, spark_fixed_shared, n_ref, n_ref))(paths, dt)[0]
    np.testing.assert_allclose(ys_shared, ys, rtol=1e-12, atol=1e-12)


def test_acceptance_over_tolerances_on_a_synthetic_curve():
    # Fixed steps: error = 1 / steps. Ours adaptive: as good as fixed at its loose
    # tolerance (16 steps, error 1/16) and as good as 4x the fixed steps at its tight one
    # (64 steps, error 1/256): fixed / adaptive is 1 at the first, 4 at the second.
    rows = [
        dict(
            problem="p",
            method="ours fixed",
            param=1 / n,
            rms_error=1 / n,
            steps=float(n),
            time_per_path_s=1e-6 * n,
            failed_paths=0,
        )
        for n in (16, 64, 256)
    ]
    for rtol, steps, error in ((1e-2, 16.0, 1 / 16), (1e-4, 64.0, 1 / 256)):
        rows.append(
            dict(
                problem="p",
                method="ours adaptive",
                param=rtol,
                rms_error=error,
                steps=steps,
                time_per_path_s=1e-6 * steps,
                failed_paths=0,
            )
        )
    (entry,) = [e for e in bench.over_tolerances(rows) if e["what"] == "fixed / adaptive"]
    loose, tight = entry["cells"]["0.01"], entry["cells"]["0.0001"]
    np.testing.assert_allclose(loose["time_ratio"], 1.0, rtol=1e-12)
    np.testing.assert_allclose(tight["time_ratio"], 4.0, rtol=1e-12)
    assert not loose["met"] and tight["met"]
    assert (loose["rms_error"], tight["rms_error"]) == (1 / 16, 1 / 256)
    table = bench.over_tolerances_table(bench.over_tolerances(rows))
    assert "| p | 0.01 | 0.062 | 1x |" in table and "| p | 0.0001 | 0.0039 | **4x** |" in table
