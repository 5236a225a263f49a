"""Work-precision: RMS strong error at t=1 against cost, on a non-commutative linear SDE

    dy = B y dt + sum_j A_j y dW_j,    y in R^8, m noise channels, [A_i, A_j] != 0,

for Euler-Maruyama (`diffrax.Euler`), diffrax's `ItoMilstein`, our commutative
`ItoMilstein`, and our `GeneralItoMilstein` (with simulated Lévy areas).

Error: every path is sampled once on a fine grid of 2^11 steps (increments and Lévy
areas); every solver at every step size sees that same path, coarse steps getting its
iterated integrals through Chen's relation (`GridLevyAreaPath`), and the reference is
`GeneralItoMilstein` on the fine grid.

Cost: wall time per path of a jitted solve of a batch of paths, in the way a user would
run it: the increments from a `diffrax.VirtualBrownianTree` (the same tree for every
method), and for `GeneralItoMilstein` the Lévy areas sampled on the fly by
`LevyAreaBrownianPath(bm, dt=h)`, with the number of Fourier terms that step size needs.
Every method at every step size is timed interleaved with the others of the same m
(round-robin, `time_contenders`), and the fastest round is the cost, with the median and
slowest rounds beside it (the spread). Compile time is excluded and reported separately.
The cost of each method at RMS error 1e-3 is interpolated in log-log space (extrapolated
along the fitted line when the measured range does not reach 1e-3, and flagged).

Run: `python -m benchmarks.work_precision [--quick]`.
"""

import argparse
import math

import diffrax
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np


jax.config.update("jax_enable_x64", True)

import diffrax_linearize as dl  # noqa: E402

from benchmarks._common import (
    fmt_spread,
    markdown_table,
    save_plot,
    time_contenders,
    write_results,
)


D = 8
N_FINE = 2**11
TARGET = 1e-3


def _methods():
    return {
        "Euler-Maruyama (diffrax.Euler)": (diffrax.Euler(), False),
        "diffrax.ItoMilstein": (diffrax.ItoMilstein(), False),
        "ItoMilstein (ours, commutative)": (dl.ItoMilstein(), False),
        "GeneralItoMilstein (ours)": (dl.GeneralItoMilstein(), True),
    }


def _problem(m: int):
    key_a, key_b = jr.split(jr.key(20240501))
    # Scaled so the total noise strength does not depend on m.
    a = 0.5 * jr.normal(key_a, (m, D, D)) / math.sqrt(D * m)
    b = -0.5 * jnp.eye(D) + 0.2 * jr.normal(key_b, (D, D)) / math.sqrt(D)
    y0 = jnp.ones(D) / math.sqrt(D)

    def f(t, y, args):
        return b @ y

    def g(t, y, args):
        return jnp.einsum("jik,k->ij", a, y)

    return f, g, y0


def _solve(f, g, y0, solver, path, dt, max_steps):
    terms = diffrax.MultiTerm(diffrax.ODETerm(f), diffrax.ControlTerm(g, path))
    sol = diffrax.diffeqsolve(
        terms,
        solver,
        0.0,
        1.0,
        dt,
        y0,
        saveat=diffrax.SaveAt(t1=True),
        max_steps=max_steps,
    )
    return sol.ys[-1]


def _errors(m, steps, n_paths, chunk):
    """RMS error at t=1 of every method at every step size, against the fine reference."""
    f, g, y0 = _problem(m)
    ts = jnp.linspace(0.0, 1.0, N_FINE + 1)
    h_fine = 1.0 / N_FINE

    def grid_path(key):
        k_w, k_a = jr.split(key)
        dW = math.sqrt(h_fine) * jr.normal(k_w, (N_FINE, m))
        n_terms = dl.levy_area_n_terms(m, h_fine)
        keys = jr.split(k_a, N_FINE)
        areas = jax.vmap(lambda k, w: dl.sample_levy_area(k, w, h_fine, n_terms))(keys, dW)
        return dl.GridLevyAreaPath(ts, dW, areas)

    make_paths = jax.jit(jax.vmap(grid_path))

    def solve_batch(solver, keys, dt):
        paths = make_paths(keys)
        return jax.vmap(lambda p: _solve(f, g, y0, solver, p, dt, N_FINE))(paths)

    solve_batch = jax.jit(solve_batch, static_argnums=0)
    keys = jr.split(jr.key(m), n_paths)
    chunks = [keys[i : i + chunk] for i in range(0, n_paths, chunk)]
    reference = jnp.concatenate(
        [solve_batch(dl.GeneralItoMilstein(), c, jnp.asarray(h_fine)) for c in chunks]
    )
    out = {}
    for name, (solver, _) in _methods().items():
        errs = []
        for h in steps:
            ys = jnp.concatenate([solve_batch(solver, c, jnp.asarray(h)) for c in chunks])
            errs.append(float(jnp.sqrt(jnp.mean(jnp.sum((ys - reference) ** 2, axis=-1)))))
        out[name] = errs
    return out


def _timings(m, steps, n_batch, repeats):
    """Wall time per path (fastest, median and slowest round) and compile time, with the
    tree and, for the general solver, the sampled Lévy areas: every method at every step
    size timed interleaved with the others."""
    f, g, y0 = _problem(m)
    keys = jr.split(jr.key(1), n_batch)
    batches = {}  # one function per method and number of Fourier terms; dt is traced
    contenders = {}
    for name, (solver, needs_levy) in _methods().items():
        for h in steps:
            n_terms = dl.levy_area_n_terms(m, h) if needs_levy else None
            if (name, n_terms) not in batches:

                def batch(keys, dt, solver=solver, n_terms=n_terms):
                    def one(key):
                        bm = diffrax.VirtualBrownianTree(0.0, 1.0, tol=2**-12, shape=(m,), key=key)
                        path = bm if n_terms is None else dl.LevyAreaBrownianPath(bm, n_terms)
                        return _solve(f, g, y0, solver, path, dt, N_FINE)

                    return jax.vmap(one)(keys)

                batches[(name, n_terms)] = batch
                first = True
            else:
                first = False  # the same function: JAX's caches reuse its compilation
            contenders[(name, h)] = (
                batches[(name, n_terms)],
                (keys, jnp.asarray(h)),
                n_terms,
                first,
            )
    timings = time_contenders(
        {key: (fn, args) for key, (fn, args, _, _) in contenders.items()},
        repeats=repeats,
        max_time=60.0,
    )
    out = {}
    for (name, h), (_, _, n_terms, first) in contenders.items():
        t = timings[(name, h)]
        out.setdefault(name, []).append(
            dict(
                run_min_s=t["run_min_s"] / n_batch,
                run_s=t["run_s"] / n_batch,
                run_max_s=t["run_max_s"] / n_batch,
                rounds=t["rounds"],
                compile_s=t["compile_s"] if first else None,
                n_terms=n_terms,
            )
        )
    return out


def _cost_at(errors, costs, target=TARGET):
    """Cost at `target` error, interpolated (or extrapolated along a least-squares line
    through the last three points) in log-log space."""
    le, lc = np.log(np.asarray(errors)), np.log(np.asarray(costs))
    order = np.argsort(le)
    le, lc = le[order], lc[order]
    lt = math.log(target)
    if le[0] <= lt <= le[-1]:
        return float(np.exp(np.interp(lt, le, lc))), False
    sel = slice(0, 3) if lt < le[0] else slice(-3, None)
    slope, intercept = np.polyfit(le[sel], lc[sel], 1)
    return float(np.exp(intercept + slope * lt)), True


# A run whose time per step is this many times that of the run with half as many steps
# is marked noisy: a method's cost per step does not grow with the number of steps (the
# Fourier terms of the Lévy areas grow like the square root, well under this).
NOISY_JUMP = 1.5


def noisy_points(rows: list[dict]) -> dict[tuple, float]:
    """`(m, method, steps) -> jump` for each timing whose time per step is more than
    `NOISY_JUMP` times that of the same method at half the steps: a timing disturbed by
    something else running, to be re-measured."""
    by_case = {(r["m"], r["method"], r["steps"]): r for r in rows if r.get("run_s")}
    fastest = lambda r: r.get("run_min_s", r["run_s"])  # noqa: E731
    noisy = {}
    for (m, method, steps), r in by_case.items():
        half = by_case.get((m, method, steps // 2))
        if half is not None and steps % 2 == 0:
            jump = (fastest(r) / steps) / (fastest(half) / half["steps"])
            if jump > NOISY_JUMP:
                noisy[(m, method, steps)] = jump
    return noisy


def run(quick: bool = False, ms: list[int] | None = None) -> list[dict]:
    if ms is None:
        ms = [2, 10] if quick else [2, 10, 50]
    steps = [2.0**-k for k in range(2, 8 if quick else 9)]
    n_paths = 64 if quick else 128
    rows = []
    summary = []
    for m in ms:
        chunk = 4 if m >= 50 else 32
        errors = _errors(m, steps, n_paths, chunk)
        timings = _timings(m, steps, n_batch=16, repeats=3 if quick else 5)
        for name in errors:
            for h, err, tm in zip(steps, errors[name], timings[name]):
                rows.append(
                    dict(
                        m=m,
                        method=name,
                        dt=h,
                        steps=round(1 / h),
                        rms_error=err,
                        **tm,
                    )
                )
            slope = float(np.polyfit(np.log(steps), np.log(errors[name]), 1)[0])
            cost, extrapolated = _cost_at(errors[name], [t["run_min_s"] for t in timings[name]])
            steps_at, _ = _cost_at(errors[name], [1 / h for h in steps])
            summary.append(
                dict(
                    m=m,
                    method=name,
                    order=slope,
                    run_s_at_1e_3=cost,
                    steps_at_1e_3=steps_at,
                    extrapolated=extrapolated,
                )
            )
    print(
        markdown_table(
            [dict(r, time=fmt_spread(r)) for r in rows],
            [
                ("m", "m"),
                ("method", "method"),
                ("steps", "steps"),
                ("rms_error", "RMS error"),
                ("n_terms", "Fourier terms"),
                ("time", "time / path (fastest, +median spread)"),
                ("compile_s", "compile"),
            ],
        )
    )
    print()
    print(f"Cost at RMS error {TARGET:g} (log-log interpolation; * = extrapolated):")
    for s in summary:
        s["method_flagged"] = s["method"] + (" *" if s["extrapolated"] else "")
    print(
        markdown_table(
            summary,
            [
                ("m", "m"),
                ("method_flagged", "method"),
                ("order", "fitted strong order"),
                ("steps_at_1e_3", "steps"),
                ("run_s_at_1e_3", "time / path"),
            ],
        )
    )
    path = write_results(
        "work_precision",
        rows,
        summary=summary,
        quick=quick,
        d=D,
        n_fine=N_FINE,
        note=(
            "Every method at every step size of one m timed interleaved (round-robin) after "
            "compiling: per path, `run_min_s` is the fastest round, `run_s` the median and "
            "`run_max_s` the slowest (the spread). The summary's `run_s_at_1e_3` is the cost "
            "at RMS error 1e-3 from the fastest rounds. `compile_s` is given once per "
            "compiled program (a step size sharing its number of Fourier terms shares it)."
        ),
    )
    print(f"\nwrote {path}")
    plot(rows)
    return rows


def _fastest(row: dict) -> float:
    """A row's fastest round (a result from before the interleaved timings: its median)."""
    return row.get("run_min_s", row["run_s"])


def plot(rows, out=None):
    """The work-precision plot of `rows` (as recorded in the JSON), noisy timings ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = sorted({r["m"] for r in rows})
    noisy = noisy_points(rows)
    fig, axes = plt.subplots(1, len(ms), figsize=(5 * len(ms), 4.2), squeeze=False)
    for ax, m in zip(axes[0], ms):
        for name in _methods():
            sel = [r for r in rows if r["m"] == m and r["method"] == name]
            ax.loglog([_fastest(r) for r in sel], [r["rms_error"] for r in sel], "o-", label=name)
        bad = [r for r in rows if r["m"] == m and (m, r["method"], r["steps"]) in noisy]
        if bad:
            ax.loglog(
                [_fastest(r) for r in bad],
                [r["rms_error"] for r in bad],
                "o",
                ms=14,
                mfc="none",
                mec="red",
                label=f"noisy timing (> {NOISY_JUMP}x the time per step at half the steps)",
            )
        ax.axhline(TARGET, color="grey", lw=0.8, ls="--")
        ax.set_title(f"d = {D}, m = {m}, non-commutative linear noise")
        ax.set_xlabel("wall time per path, fastest round (s)")
        ax.set_ylabel("RMS error at t = 1")
        ax.grid(True, which="both", alpha=0.3)
        if bad or ax is axes[0][0]:
            ax.legend(fontsize=7)
    out = save_plot(fig, "work_precision", out)
    print(f"wrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="m in {2, 10}, fewer steps")
    parser.add_argument("--ms", type=int, nargs="+", help="the noise dimensions m to run")
    ns = parser.parse_args()
    run(quick=ns.quick, ms=ns.ms)
