"""Compile and run time of typical solves under XLA:CPU's defaults and with
`--xla_cpu_use_fusion_emitters=false`, side by side.

    python -m benchmarks.xla_cpu_flags           # 5 rounds of each, recorded
    python -m benchmarks.xla_cpu_flags --quick   # 1 round, smaller sizes

XLA reads `XLA_FLAGS` once, when JAX starts its backend, so each configuration runs in a
process of its own (this script, `--child`), alternately, for `rounds` rounds: a fresh
process compiles everything from scratch, as a user's first call does. In each, every
workload is traced and lowered, compiled and run (the fastest of its runs), and its output
saved; the parent compares the outputs of the two configurations (the flag changes how XLA
fuses and emits kernels, so float results may differ in their last bits, not more).

The test suite (`tests/conftest.py`) compiles with this flag beside `-O0`, which took
`make test` from 558 s to 354 s; this benchmark asks what it does for a user, at XLA's
default optimisation level.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np


FLAG = "--xla_cpu_use_fusion_emitters=false"
CONFIGS = {"XLA default": "", "fusion emitters off": FLAG}


# ---- the workloads (run in the child) -----------------------------------------------------


def _workloads(quick: bool):
    """name -> (function to jit, args), built in the child only: `benchmarks.report` imports
    this module for its table and need not import the solvers."""
    import diffrax
    import diffrax_linearize as dl
    import jax.numpy as jnp
    import jax.random as jr

    from benchmarks import squared_grads, step_cost, stiff

    n_rob = 10 if quick else 100
    n_grid = 8 if quick else 32
    y_rob = stiff._robertson_y0(n_rob)
    y_bruss = stiff._bruss_y0(n_grid)
    rob, bruss = stiff.robertson, stiff.brusselator

    def solve(term_fn, solver, y0, t1, controller):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(term_fn),
            solver,
            0.0,
            t1,
            None,
            y0,
            stepsize_controller=controller,
            max_steps=100_000,
        )
        return sol.ys[-1], sol.stats["num_steps"]

    pid = diffrax.PIDController(rtol=1e-6, atol=1e-8)
    out = {
        f"Kvaerno5 + VeryChord, Robertson x {n_rob}": (
            lambda y: solve(rob, diffrax.Kvaerno5(root_finder=dl.VeryChord()), y, 1e4, pid),
            (y_rob,),
        ),
        f"Rodas5P, Robertson x {n_rob}": (
            lambda y: solve(rob, dl.Rodas5P(), y, 1e4, stiff._rosenbrock_controller(dl.Rodas5P())),
            (y_rob,),
        ),
        f"BDF, Brusselator {n_grid} x {n_grid}": (
            lambda y: solve(bruss, dl.BDF(), y, 1.0, pid),
            (y_bruss,),
        ),
        "Diffrax default Kvaerno5, Robertson x 1": (
            lambda y: solve(rob, diffrax.Kvaerno5(), y, 1e4, pid),
            (stiff._robertson_y0(1),),
        ),
        f"materialise_operator, Brusselator {n_grid} x {n_grid}": (
            lambda y: dl.materialise_operator(lambda z: stiff.brusselator(0.0, z, None), y),
            (y_bruss,),
        ),
    }
    d = 64 if quick else 256
    key = jr.key(0)
    G = step_cost._params("row_scaled", d, key).astype(jnp.float32)
    out[f"ItoMilstein step, row-scaled, d = m = {d}"] = (
        step_cost.make_step(dl.ItoMilstein(), step_cost.DIFFUSIONS["row_scaled"], d),
        (jnp.ones(d, jnp.float32), G, jr.key(1)),
    )
    loss, params, batch = squared_grads._mlp(jr.key(2))
    x, label = batch(jr.key(3), 64)
    out["value_grad_and_sum_squared_grads, MLP, B = 64"] = (
        lambda p, x, lab: dl.value_grad_and_sum_squared_grads(loss, p, x, lab),
        (params, x, label),
    )
    return out


def _child(quick: bool, outdir: pathlib.Path, min_time: float) -> dict:
    import jax

    jax.config.update("jax_enable_x64", True)
    rows = {}
    for i, (name, (fn, args)) in enumerate(_workloads(quick).items()):
        t0 = time.perf_counter()
        lowered = jax.jit(fn).lower(*args)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        result = jax.block_until_ready(compiled(*args))
        t3 = time.perf_counter()
        runs = [t3 - t2]
        while (sum(runs) < min_time or len(runs) < 20) and len(runs) < 100_000:
            s = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            runs.append(time.perf_counter() - s)
        leaves = [np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(result)]
        np.save(outdir / f"{i}.npy", np.concatenate(leaves))
        rows[name] = {
            "trace_lower_s": t1 - t0,
            "compile_s": t2 - t1,
            "first_run_s": t3 - t2,
            "run_s": min(runs),
            "runs": len(runs),
        }
    return rows


# ---- the parent ---------------------------------------------------------------------------


def _spawn(config: str, quick: bool, outdir: pathlib.Path, min_time: float) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), CONFIGS[config]) if f)
    cmd = [sys.executable, "-m", "benchmarks.xla_cpu_flags", "--child", str(outdir)]
    cmd += ["--min-time", str(min_time)] + (["--quick"] if quick else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{config}: the child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    scale = np.maximum(np.abs(b), np.max(np.abs(b)) * 1e-12 + 1e-300)
    return float(np.max(np.abs(a - b) / scale)) if a.size else 0.0


def run(quick: bool = False, rounds: int | None = None, min_time: float = 1.0) -> list[dict]:
    import jax

    if jax.default_backend() != "cpu":
        backend = jax.default_backend()
        raise SystemExit(f"xla_cpu_flags: {FLAG} is XLA:CPU's; this backend is a {backend}")
    rounds = rounds or (1 if quick else 5)
    times: dict[tuple[str, str], list[dict]] = {}
    first_out: dict[str, list[np.ndarray]] = {}
    diffs: dict[str, float] = {}
    names: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = list(CONFIGS) if r % 2 == 0 else list(CONFIGS)[::-1]
            for config in order:
                outdir = pathlib.Path(tmp) / f"{r}-{list(CONFIGS).index(config)}"
                outdir.mkdir()
                t0 = time.perf_counter()
                rows = _spawn(config, quick, outdir, min_time)
                print(f"  round {r + 1}, {config}: {time.perf_counter() - t0:.1f} s", flush=True)
                names = list(rows)
                for name, row in rows.items():
                    times.setdefault((name, config), []).append(row)
                if config not in first_out:
                    first_out[config] = [np.load(outdir / f"{i}.npy") for i in range(len(names))]
        ref, other = (first_out[c] for c in CONFIGS)
        for i, name in enumerate(names):
            diffs[name] = _rel_diff(other[i], ref[i])
    out = []
    for name in names:
        for config in CONFIGS:
            rs = times[(name, config)]
            compile_s = [r["trace_lower_s"] + r["compile_s"] for r in rs]
            out.append(
                {
                    "workload": name,
                    "config": config,
                    "xla_flags": CONFIGS[config],
                    "compile_s": min(compile_s),
                    "compile_median_s": statistics.median(compile_s),
                    "xla_compile_s": min(r["compile_s"] for r in rs),
                    "run_s": min(r["run_s"] for r in rs),
                    "rounds": len(rs),
                    "per_round": rs,
                }
            )
            if config != "XLA default":
                out[-1]["max_rel_diff_vs_default"] = diffs[name]
    from benchmarks._common import write_results

    ratios = summary(out)
    path = write_results(
        "xla_cpu_flags",
        out,
        quick=quick,
        flag=FLAG,
        note=(
            "Each round runs every workload in a fresh process per configuration, the two "
            "alternately. compile_s: trace + lower + XLA compile, fastest round; run_s: "
            "fastest run (x64 on; the Milstein step and the MLP in float32). "
            "max_rel_diff_vs_default: the outputs of the first rounds compared."
        ),
        summary=ratios,
    )
    print(table(ratios))
    print(f"\nwrote {path} and {plot(out)}")
    return out


def summary(rows: list[dict]) -> list[dict]:
    """Per workload: the flag's trace + compile and run times over XLA's defaults."""
    by = {(r["workload"], r["config"]): r for r in rows}
    out = []
    for (name, config), r in by.items():
        if config == "XLA default":
            continue
        base = by[(name, "XLA default")]
        out.append(
            {
                "workload": name,
                "compile_default_s": base["compile_s"],
                "compile_flag_s": r["compile_s"],
                "compile_ratio": r["compile_s"] / base["compile_s"],
                "run_default_s": base["run_s"],
                "run_flag_s": r["run_s"],
                "run_ratio": r["run_s"] / base["run_s"],
                "max_rel_diff": r["max_rel_diff_vs_default"],
            }
        )
    return out


def derive(data: dict) -> dict:
    return {**data, "summary": summary(data["rows"])}


def table(ratios: list[dict]) -> str:
    from benchmarks._common import fmt_ratio, fmt_time, markdown_table

    rows = [
        {
            "workload": s["workload"],
            "compile": f"{fmt_time(s['compile_default_s'])} -> {fmt_time(s['compile_flag_s'])}",
            "compile ratio": fmt_ratio(s["compile_ratio"]),
            "run": f"{fmt_time(s['run_default_s'])} -> {fmt_time(s['run_flag_s'])}",
            "run ratio": fmt_ratio(s["run_ratio"]),
            "max rel diff": f"{s['max_rel_diff']:.1e}",
        }
        for s in ratios
    ]
    cols = [
        ("workload", "workload"),
        ("compile", "trace + compile, default -> flag"),
        ("compile ratio", "flag / default"),
        ("run", "run, default -> flag"),
        ("run ratio", "flag / default"),
        ("max rel diff", "outputs' max rel diff"),
    ]
    return markdown_table(rows, cols)


def plot(rows: list[dict], out=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks._common import save_plot

    ratios = summary(rows)
    names = [s["workload"] for s in ratios]
    y = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.5))
    ax.barh(y - 0.2, [s["compile_ratio"] for s in ratios], 0.4, label="trace + compile")
    ax.barh(y + 0.2, [s["run_ratio"] for s in ratios], 0.4, label="run (fastest)")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(y, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time with the flag / XLA default (below 1: the flag is faster)")
    ax.set_title(FLAG, fontsize=9)
    ax.legend(fontsize=8)
    return save_plot(fig, "xla_cpu_flags", out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--min-time", type=float, default=1.0)
    parser.add_argument("--child", type=pathlib.Path, default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.child is not None:
        print(json.dumps(_child(ns.quick, ns.child, ns.min_time)))
        return 0
    run(ns.quick, ns.rounds, ns.min_time)
    return 0


if __name__ == "__main__":
    sys.exit(main())
