"""Stiff ODEs and SDEs: Diffrax's implicit solvers with their default root finder against
`root_finder=diffrax_linearize.VeryChord()`, and the drift-implicit Milstein method against
explicit solvers on a stiff SPDE. Float64, jitted. The contenders of each case are timed
interleaved (A B C A B C ..., up to five rounds, a contender stopping after 30 s of timed
solves): each one's fastest solve, with the median and slowest beside it (the spread).

(a) N independent Robertson systems (Diffrax issue #545): `Kvaerno5` with
    `PIDController(rtol=1e-6, atol=1e-8)`, t in [0, 10], for N in {10, 100, 1000, 10000}:
    Diffrax's default root finder (dense LU of the 3N x 3N Jacobian every step; run up to
    N = 1000), ours, `dl.Rodas5P()` and `dl.Rodas4P()` (Rosenbrock: one factorisation a
    step), `dl.ROS34PW2()` (a Rosenbrock-W method: one Jacobian for up to 20 steps), these
    three with `dl.PredictiveController` at the same tolerances (ROS34PW2's with
    `steady=(0.9, 1.2)`), `dl.BDF()` (chord iterations with a Jacobian and factorisation
    carried across steps; `diffrax.PIDController`),
    and `jax.vmap` of `diffeqsolve` over the systems (what the maintainers suggested in
    #545; valid only because the systems are uncoupled).
(b) A coupled stiff problem where `vmap` does not apply: the 2D Brusselator on an n x n
    periodic grid (2 n^2 unknowns), n in {8, 16, 32, 64, 128}, t in [0, 1]: Kvaerno5 with
    ours, with Diffrax's default, and `dl.BDF()`.
(c) A stiff SPDE: the stochastic Allen-Cahn equation
    du = (eps u_xx + u - u^3) dt + sigma u dW on a 1D grid with Dirichlet boundaries,
    diagonal multiplicative noise. Work-precision at t = 1: `ImplicitItoMilstein` at steps
    the explicit methods cannot take, against `diffrax.Euler` (Euler-Maruyama) and
    `ItoMilstein` at the steps their stability allows (dt < dx^2 / (2 eps)); error against
    a fine-step solution on the same Brownian paths, by a method of another family
    (Euler-Maruyama, `diffrax.Euler`, at twice the steps of the finest explicit row, whose
    own error then bounds the reference's: `reference_steps` in the JSON). With
    noise at every grid point, no method resolves in time the modes with `dt |lambda| >> 1`
    (their response to the noise of the last `1 / |lambda|` of a unit): below the explicit
    limit's steps the implicit solver's error falls slowly (observed order about 0.3), and
    faster once `dt |lambda_max|` nears 1. The implicit rows run on to about the explicit
    limit's steps to show both regimes.

    python -m benchmarks stiff [--quick] [--problems P... --update]

`--problems robertson brusselator_2d allen_cahn` runs only those parts; with `--update` the
other parts' rows are kept from the recorded result, each with the date of the run that
measured it (`recorded`).
"""

import argparse
import math

import diffrax
import jax
import jax.numpy as jnp
import jax.random as jr
import lineax as lx
import matplotlib
import numpy as np


matplotlib.use("Agg")
import diffrax_linearize as dl
import matplotlib.pyplot as plt

from benchmarks._common import (
    kept_rows,
    machine,
    markdown_table,
    parse_partial_rerun,
    save_plot,
    time_contenders_output,
    write_results,
)
from benchmarks.structure import brusselator_2d, robertson_stack


def _stats(sol):
    return {
        "accepted_steps": int(sol.stats["num_accepted_steps"]),
        "rejected_steps": int(sol.stats["num_rejected_steps"]),
    }


def _rel(a, b):
    return float(jnp.max(jnp.abs(a - b) / (1e-8 + jnp.abs(b))))


# ---- (a) Robertson x N ------------------------------------------------------------------------


def robertson(t, y, args):
    return robertson_stack(y)  # N Robertson systems, written with y[:, k] and jnp.stack


_CONTROLLER = diffrax.PIDController(rtol=1e-6, atol=1e-8)


def _rosenbrock_controller(solver):
    # Gustafsson's predictive control for the Rosenbrock solvers, as Hairer's RODAS
    # (`diffrax.PIDController` never shrinks the step after an accepted one); the W-method
    # holds its step size (`steady`) to reuse its factorisation.
    steady = (0.9, 1.2) if isinstance(solver, dl.AbstractRosenbrockW) else None
    return dl.PredictiveController(rtol=1e-6, atol=1e-8, steady=steady)


def _controller(solver):
    if solver is None or isinstance(solver, dl.BDF):
        return _CONTROLLER
    return _rosenbrock_controller(solver)


def _robertson_y0(N):
    # Slightly different initial conditions, so the systems are not all the same.
    return jnp.tile(jnp.array([1.0, 0.0, 0.0]), N) * (1 + 0.1 * jnp.linspace(0, 1, 3 * N))


def _solve_rob(root_finder, y0, t1=10.0, solver=None):
    kwargs = {} if root_finder is None else dict(root_finder=root_finder)
    return diffrax.diffeqsolve(
        diffrax.ODETerm(robertson),
        diffrax.Kvaerno5(**kwargs) if solver is None else solver,
        0.0,
        t1,
        None,
        y0,
        stepsize_controller=_controller(solver),
        max_steps=100_000,
    )


def _solve_rob_vmap(y0, t1=10.0):
    def one(y):
        return _solve_rob(None, y, t1).ys[-1]

    return jax.vmap(one)(y0.reshape(-1, 3)).reshape(-1)


def robertson_rows(sizes, default_max):
    rows = []
    for N in sizes:
        y0 = _robertson_y0(N)
        base = {"problem": "robertson", "N": N, "unknowns": 3 * N}
        fns = {"ours": (lambda y0: _solve_rob(dl.VeryChord(), y0), (y0,))}
        # Rosenbrock: one factorisation a step, no Newton iterations (ROS34PW2: one Jacobian
        # for up to 20 steps)
        for name in ("Rodas5P", "Rodas4P", "ROS34PW2", "BDF"):
            solver = getattr(dl, name)()
            fns[f"ours {name}"] = (
                lambda y0, solver=solver: _solve_rob(None, y0, solver=solver),
                (y0,),
            )
        fns["vmap"] = (_solve_rob_vmap, (y0,))
        if N <= default_max:
            fns["diffrax default"] = (lambda y0: _solve_rob(None, y0), (y0,))
        outputs, timings = _time(fns)
        ours = outputs["ours"].ys[-1]
        for method, t in timings.items():
            out = outputs[method]
            row = {**base, "method": method, **t}
            if method != "vmap":
                row.update(_stats(out))
            if method != "ours":
                row["max_rel_diff_vs_ours"] = _rel(out if method == "vmap" else out.ys[-1], ours)
            rows.append(row)
        if N > default_max:
            rows.append(
                {
                    **base,
                    "method": "diffrax default",
                    "note": f"not run: a {3 * N} x {3 * N} dense LU every step",
                }
            )
        print(f"  robertson N={N}", flush=True)
    return rows


def _time(fns):
    """The contenders of one case timed interleaved: solves of seconds to minutes, so no
    discarded warm-up run, and a contender stops after 30 s of timed solves (one solve
    at least)."""
    return time_contenders_output(fns, repeats=5, max_time=30.0, warmup=False)


# ---- (b) 2D Brusselator -----------------------------------------------------------------------


def brusselator(t, y, args):
    return brusselator_2d(y)  # periodic five-point Laplacian, written with jnp.roll


def _bruss_y0(n):
    xs = jnp.linspace(0, 1, n)
    X, Y = jnp.meshgrid(xs, xs)
    return jnp.concatenate(
        [(22 * (Y * (1 - Y)) ** 1.5).ravel(), (27 * (X * (1 - X)) ** 1.5).ravel()]
    )


def _solve_bruss(root_finder, y0, solver=None):
    kwargs = {} if root_finder is None else dict(root_finder=root_finder)
    return diffrax.diffeqsolve(
        diffrax.ODETerm(brusselator),
        diffrax.Kvaerno5(**kwargs) if solver is None else solver,
        0.0,
        1.0,
        None,
        y0,
        stepsize_controller=_CONTROLLER,
        max_steps=100_000,
    )


def brusselator_rows(sizes, default_max):
    rows = []
    for n in sizes:
        y0 = _bruss_y0(n)
        base = {"problem": "brusselator_2d", "N": n, "unknowns": 2 * n * n}
        fns = {
            "ours": (lambda y0: _solve_bruss(dl.VeryChord(), y0), (y0,)),
            "ours BDF": (lambda y0: _solve_bruss(None, y0, solver=dl.BDF()), (y0,)),
        }
        if n <= default_max:
            fns["diffrax default"] = (lambda y0: _solve_bruss(None, y0), (y0,))
        outputs, timings = _time(fns)
        ours = outputs["ours"].ys[-1]
        for method, t in timings.items():
            row = {**base, "method": method, **t, **_stats(outputs[method])}
            if method != "ours":
                row["max_rel_diff_vs_ours"] = _rel(outputs[method].ys[-1], ours)
            rows.append(row)
        if n > default_max:
            n2 = 2 * n * n
            rows.append(
                {
                    **base,
                    "method": "diffrax default",
                    "note": f"not run: a {n2} x {n2} dense LU every step",
                }
            )
        print(f"  brusselator n={n}", flush=True)
    return rows


# ---- (c) stochastic Allen-Cahn ---------------------------------------------------------------


def allen_cahn_terms(bm, n, eps=1e-3, sigma=0.5):
    dx = 1.0 / (n + 1)

    def drift(t, u, args):
        p = jnp.pad(u, 1)
        return eps * (p[2:] - 2 * u + p[:-2]) / dx**2 + u - u**3

    diffusion = diffrax.ControlTerm(lambda t, u, args: lx.DiagonalLinearOperator(sigma * u), bm)
    return diffrax.MultiTerm(diffrax.ODETerm(drift), diffusion), eps / dx**2


def _u0(n):
    x = jnp.linspace(0, 1, n + 2)[1:-1]
    return 0.5 * jnp.sin(2 * jnp.pi * x)


def allen_cahn_rows(n, n_paths, implicit_steps, explicit_factors):
    """Work-precision on `n_paths` Brownian paths: RMS over paths of the RMS error at t=1."""
    keys = jr.split(jr.key(0), n_paths)
    rows = []

    def path_solve(solver, steps):
        def fn(key):
            bm = diffrax.VirtualBrownianTree(0.0, 1.0, tol=2**-16, shape=(n,), key=key)
            terms, _ = allen_cahn_terms(bm, n)
            return diffrax.diffeqsolve(
                terms, solver, 0.0, 1.0, 1.0 / steps, _u0(n), max_steps=steps + 1
            ).ys[-1]

        return jax.vmap(fn)

    _, stiffness = allen_cahn_terms(None, n)
    stable = math.ceil(2 * stiffness)  # explicit steps need dt < 2 / |lambda_max| ~ dx^2/(2 eps)
    # The reference by a method of another family than the implicit solver measured, at twice
    # the steps of the finest explicit row (whose error then says how far the reference can
    # be trusted: about its own error, for a method of order about one).
    ref_steps = 2 * max(int(max(explicit_factors) * stable), max(implicit_steps))
    reference = jax.jit(path_solve(diffrax.Euler(), ref_steps))(keys)
    fns = {}
    for name, solver, steps_list in [
        ("ImplicitItoMilstein (ours)", dl.ImplicitItoMilstein(), implicit_steps),
        (
            "Euler-Maruyama (diffrax.Euler)",
            diffrax.Euler(),
            [int(f * stable) for f in explicit_factors],
        ),
        ("ItoMilstein (ours)", dl.ItoMilstein(), [int(f * stable) for f in explicit_factors]),
    ]:
        for steps in steps_list:
            fns[(name, steps)] = (path_solve(solver, steps), (keys,))
    # Every method at every step count timed interleaved; the slow explicit solves (tens of
    # seconds) once or twice.
    outputs, timings = time_contenders_output(fns, repeats=3, max_time=30.0, warmup=False)
    for (name, steps), t in timings.items():
        err = float(jnp.sqrt(jnp.mean((outputs[(name, steps)] - reference) ** 2)))
        rows.append(
            {
                "problem": "allen_cahn",
                "N": n,
                "unknowns": n,
                "method": name,
                "steps": steps,
                **t,
                "run_s_per_path": t["run_min_s"] / n_paths,
                "rms_error": err if np.isfinite(err) else None,
                "stable_steps": stable,
                "reference_steps": ref_steps,
            }
        )
    print("  allen-cahn", flush=True)
    return rows


PROBLEMS = ("robertson", "brusselator_2d", "allen_cahn")


def run(quick: bool = False, problems=None, update: bool = False) -> list[dict]:
    """The benchmark (`quick`: its short form); `problems`: only these parts (`None`: all).
    With `update`, the other parts' rows are kept from the recorded result, each with the
    date of the run that measured it (`recorded`)."""
    jax.config.update("jax_enable_x64", True)
    problems = PROBLEMS if problems is None else tuple(problems)
    name = "stiff"
    kept, earlier = [], []
    if update:
        kept, earlier = kept_rows(name, lambda r: r["problem"] in problems)
    here = machine()
    rows = []
    if "robertson" in problems:
        rows += robertson_rows(
            [10, 100] if quick else [10, 100, 1000, 10_000], 100 if quick else 1000
        )
    if "brusselator_2d" in problems:
        rows += brusselator_rows([8, 16] if quick else [8, 16, 32, 64, 128], 16 if quick else 32)
    if "allen_cahn" in problems:
        if quick:
            rows += allen_cahn_rows(64, 4, [16, 32], [1.0, 2.0])
        else:
            rows += allen_cahn_rows(1024, 8, [16, 32, 64, 128, 256, 1024, 2048], [1.0, 2.0, 4.0])
    extra = {}
    if update:
        rows = [*kept, *({**r, "recorded": here["date"]} for r in rows)]
        rows.sort(key=lambda r: PROBLEMS.index(r["problem"]))
        if earlier:
            extra = dict(
                earlier_runs=earlier,
                note=(
                    "a partial re-run: each row's `recorded` is the date of the run that "
                    "measured it, `earlier_runs` describes the runs of the older rows"
                ),
            )
    summary = _summary(rows)
    path = write_results(name, rows, summary=summary, quick=quick, machine=here, **extra)
    print(markdown_table(summary, SUMMARY_COLUMNS))
    print(f"\nResults: {path}\nPlot: {plot(rows)}")
    return rows


SUMMARY_COLUMNS = [
    ("problem", "problem"),
    ("N", "N / n"),
    ("unknowns", "unknowns"),
    ("ours_s", "ours"),
    ("default_s", "diffrax default"),
    ("vmap_s", "vmap(diffeqsolve)"),
    ("ours_over_default", "ours / diffrax default"),
    ("steps", "steps (accepted + rejected)"),
    ("diff", "max rel. difference"),
]


def derive(data: dict) -> dict:
    """`data` with its summary recomputed from its timings."""
    return dict(data, summary=_summary(data["rows"]))


def _fastest(row):
    """A row's fastest run (`run_min_s`) where its contenders were timed interleaved
    (`rounds`), or its `run_s` (the median) in a result from before."""
    return row.get("run_min_s" if "rounds" in row else "run_s")


def _summary(rows):
    out = []
    for problem in ("robertson", "brusselator_2d"):
        for N in sorted({r["N"] for r in rows if r["problem"] == problem}):
            by = {r["method"]: r for r in rows if r["problem"] == problem and r["N"] == N}
            ours, default, vm = by["ours"], by.get("diffrax default", {}), by.get("vmap", {})
            out.append(
                {
                    "problem": problem,
                    "N": N,
                    "unknowns": ours["unknowns"],
                    "ours_s": _fastest(ours),
                    "default_s": _fastest(default),
                    "vmap_s": _fastest(vm),
                    "ours_over_default": (
                        _fastest(ours) / _fastest(default) if _fastest(default) else None
                    ),
                    "steps": f"{ours['accepted_steps']} + {ours['rejected_steps']}",
                    "diff": default.get("max_rel_diff_vs_ours"),
                }
            )
    return out


def plot(rows, out=None):
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    labels = {
        "ours": "Kvaerno5 + VeryChord (ours)",
        "diffrax default": "diffrax default",
        "vmap": "vmap(diffeqsolve)",
        "ours Rodas5P": "Rodas5P (ours)",
        "ours Rodas4P": "Rodas4P (ours)",
        "ours ROS34PW2": "ROS34PW2 (ours)",
        "ours BDF": "BDF (ours)",
    }
    for ax, problem, title in [
        (axes[0], "robertson", "N Robertson systems"),
        (axes[1], "brusselator_2d", "2D Brusselator"),
    ]:
        for method, style in [
            ("ours", "o-"),
            ("ours Rodas5P", "d-"),
            ("ours Rodas4P", "v-"),
            ("ours ROS34PW2", "x-"),
            ("ours BDF", "P-"),
            ("diffrax default", "s--"),
            ("vmap", "^:"),
        ]:
            pts = [
                (r["unknowns"], _fastest(r))
                for r in rows
                if r["problem"] == problem and r["method"] == method and _fastest(r)
            ]
            if pts:
                ax.loglog(*zip(*sorted(pts)), style, label=labels[method])
        ax.set_xlabel("unknowns")
        ax.set_ylabel("time per solve (s, fastest run)")
        ax.set_title(title)
        ax.legend()
    ax = axes[2]
    for method in dict.fromkeys(r["method"] for r in rows if r["problem"] == "allen_cahn"):
        pts = [
            (r["run_s_per_path"], r["rms_error"])
            for r in rows
            if r["problem"] == "allen_cahn" and r["method"] == method and r.get("rms_error")
        ]
        if pts:
            ax.loglog(*zip(*sorted(pts)), "o-", label=method)
    ax.set_xlabel("time per path (s)")
    ax.set_ylabel("RMS error at t = 1")
    ax.set_title("Stochastic Allen-Cahn: work-precision")
    ax.legend(fontsize=8)
    return save_plot(fig, "stiff", out, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--problems", nargs="+", choices=PROBLEMS, help="these parts only")
    ns = parse_partial_rerun(parser, argv, "problems")
    run(ns.quick, ns.problems, ns.update)


if __name__ == "__main__":
    main()
