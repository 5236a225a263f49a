"""Write `docs/benchmarks.md`, the README's table of measured numbers, and the figures
quoted in the guides (between `<!-- generated:NAME -->` and `<!-- /generated:NAME -->`)
from the JSON results in `benchmarks/results/`, so that none can drift from them.

    python -m benchmarks.report            # docs/benchmarks.md and README.md
    python -m benchmarks.report --plots    # also redraw the PNG plots from the JSON
    python -m benchmarks.report --rederive # first recompute ratios and summaries in the JSON

Every benchmark gets a section: its plot, a short table (at most eight columns, every
ratio ours over the other's) and a link to the full JSON, per machine that recorded it;
when more than one did (CPU and GPU), first a side-by-side table of run times. The site
serves the PNG and JSON files from `benchmarks/results/` (the hook
`docs/_scripts/benchmark_results.py`), so the docs hold no copies of them.
"""

import argparse
import importlib
import json
import pathlib
import re

from benchmarks._common import fmt_ratio, fmt_spread, fmt_time, markdown_table, RESULTS


ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
# The files with generated figures in them.
QUOTING = (
    ROOT / "README.md",
    ROOT / "docs" / "ensembles.md",
    ROOT / "docs" / "squared_grads.md",
    ROOT / "docs" / "milstein.md",
    ROOT / "docs" / "stiff.md",
)

TITLES = {
    "step_cost": "Step cost of one SDE step",
    "materialise": "materialise against jax.jacfwd",
    "structure": "Sparse structure in vector fields, against jax.jacfwd and asdex",
    "stiff": "Stiff ODEs and SDEs: structured root finders and drift-implicit Milstein",
    "adjoint": "Backsolve adjoint",
    "squared_grads": "Squared per-example gradients",
    "work_precision": "Work-precision on non-commutative noise",
    "ensemble": "Ensembles: throughput against devices and processes",
    "stiff_peers": "Stiff ODEs against SUNDIALS, diffsol, casadi and scipy",
    "stiff_peers_quick": "Stiff ODEs against SUNDIALS, diffsol, casadi and scipy (quick mode)",
    "adaptive_sde": "Adaptive steps on SDEs whose difficulty varies along the path",
    "adaptive_sde_quick": "Adaptive steps on SDEs whose difficulty varies along the path "
    "(quick mode)",
    "adaptive_sde_breakdown": "Adaptive steps: the cost of a loop iteration, ingredient by "
    "ingredient",
    "adaptive_sde_breakdown_quick": "Adaptive steps: the cost of a loop iteration, ingredient "
    "by ingredient (quick mode)",
    "linear_crossover": "Linear solvers: where dense LU overtakes the structured ones",
    "ensemble_lanes": "Ensembles of adaptive solves: refilling lanes against vmapped batches",
    "materialise_seed": "The seed report's case alone: the Jacobian of A @ x at N = 10,000",
    "stiff_device": "Stiff ODEs on an accelerator, beside the same machine's CPU",
    "stiff_device_quick": "Stiff ODEs on an accelerator, beside the same machine's CPU "
    "(quick mode)",
    "xla_cpu_flags": "Compile and run time with XLA:CPU's fusion emitters off",
}


# The columns that name a case (the rest are measurements), for the side-by-side tables.
CASE_KEYS = {
    "step_cost": ("diffusion", "d", "m", "solver"),
    "materialise": ("problem", "N", "method"),
    "structure": ("field", "unknowns", "method"),
    "stiff": ("problem", "N", "method", "steps"),
    "adjoint": ("solver", "adjoint", "d", "steps"),
    "squared_grads": ("model", "B", "method"),
    "work_precision": ("m", "method", "steps"),
    "ensemble": ("processes", "devices", "cores", "paths", "steps", "d"),
    "stiff_peers": ("problem", "size", "rtol", "method"),
    "stiff_peers_quick": ("problem", "size", "rtol", "method"),
    "adaptive_sde": ("problem", "method", "param"),
    "adaptive_sde_quick": ("problem", "method", "param"),
    "adaptive_sde_breakdown": ("problem", "path", "variant"),
    "adaptive_sde_breakdown_quick": ("problem", "path", "variant"),
    "linear_crossover": ("kind", "n"),
    "ensemble_lanes": ("problem", "rtol", "width"),
    "materialise_seed": ("problem", "N", "method"),
    "stiff_device": ("problem", "size", "rtol", "method", "device"),
    "stiff_device_quick": ("problem", "size", "rtol", "method", "device"),
    "xla_cpu_flags": ("workload", "config"),
}


# The columns by which a partial re-run (`--update`) names the cases it re-measures: the
# older rows of a record are listed by these.
RERUN_KEYS = {
    "structure": ("field",),
    "stiff_peers": ("problem", "size"),
    "stiff_peers_quick": ("problem", "size"),
    "stiff": ("problem",),
}


# Where the built site serves each result's PNG and JSON (`docs/_scripts/benchmark_results.py`
# adds them to the site from `benchmarks/results/`, so the docs hold no copies).
ASSETS = "assets/benchmarks"

_ADAPTIVE_SDE = (
    "RMS strong error at t = 1 against cost per path (wall time of a vmapped batch, steps) "
    "on three SDEs (commutative, non-commutative, stiff) for ours adaptive "
    "(`PIDController`, each path its own steps), ours adaptive with one step for the whole "
    "batch, ours at fixed steps, `HalfSolver(ours)` and Diffrax's adaptive "
    "SDE solvers. The first table: the acceptance ratios at the error of ours adaptive at "
    "rtol 1e-3 (costs interpolated in log-log space; * extrapolated); the second: the three "
    "criteria at the error of each of its tolerances; the JSON has every point."
)

_ADAPTIVE_SDE_BREAKDOWN = (
    "One iteration of the vmapped solve's loop on the SDEs of adaptive_sde, ours at a fixed "
    "step, then with per-path step times, then adaptive with every step accepted (the error "
    "estimate and the controller), then adaptive at rtol 1e-3: time per iteration (fastest "
    "round over the iterations of the slowest path) and the kernels XLA runs per iteration "
    "(n/a where the Brownian tree's descent is a loop inside the loop); each SDE on its own "
    "path and, where that is a Brownian tree, on the cheap grid path too."
)

_STIFF_DEVICE = (
    "Robertson x N and the 2D Brusselator of stiff_peers in float32 (a TPU compiles no "
    "float64 Diffrax solve), ours BDF var and Rodas5P on the accelerator and on the same "
    "machine's CPU, timed interleaved: time (fastest run) and significant correct digits "
    "against a float64 scipy reference; the table shows rtol 1e-4, the JSON rtol 1e-5 too."
)

# What each section measures, in a sentence, above its plot.
WHAT = {
    "materialise_seed": "JAX #9215's `jax.jacfwd(lambda x: A @ x)` at N = 10,000 against "
    "`materialise`, compiled and first calls, and how far each result is from A "
    "(`python -m benchmarks.materialise --seed-only --seed-n 10000`, for a device whose time "
    "is short).",
    "stiff_device": _STIFF_DEVICE,
    "stiff_device_quick": _STIFF_DEVICE,
    "xla_cpu_flags": "Typical solves compiled and run in fresh processes under XLA:CPU's "
    "defaults and with `XLA_FLAGS=--xla_cpu_use_fusion_emitters=false`, alternately, five "
    "rounds each: trace + compile time (fastest round, what a first call pays before it "
    "runs) and run time (fastest run), and how far the outputs differ "
    "(`python -m benchmarks.xla_cpu_flags`).",
    "linear_crossover": "`StructuredLinearSolver`'s structured paths against dense LU, per "
    "operator kind and size: the cost of a factorisation and one solve, and of a solve, inside "
    "a compiled loop (single-threaded CPU, float64); and POLLU end to end.",
    "step_cost": "One jitted `solver.step`, d = m, for three diffusions. For `dense_linear` "
    "(g(y) = A y, A of d * m * d numbers) the Itô step reads A twice, to form g and then "
    "for its correction's one contraction (which needs g), where the Euler step reads it "
    "once: where reading A dominates (d = 1024, A is 4 GiB in float32) two Euler steps are "
    "its floor. The Stratonovich step reads A once (docs: Milstein, why it is faster).",
    "materialise": "`materialise` of linear maps and layers against `jax.jacfwd`.",
    "structure": "The Jacobian of a vector field with sparse structure, from `materialise`, "
    "`jax.jacfwd` and asdex (detection and colouring timed apart).",
    "stiff": "Implicit solves whose Newton systems have the structure `materialise` finds, "
    "against Diffrax's default dense LU; and a stiff SPDE with drift-implicit Milstein.",
    "adjoint": "`value_and_grad` through 100 steps of an SDE solve, d = m.",
    "squared_grads": "Loss, gradient and squared per-example gradients (or per-example "
    "gradient norms) in one backward pass, against per-example `vmap(grad)`.",
    "work_precision": "Cost per path against strong error on non-commutative noise (d = 8).",
    "ensemble": "`solve_ensemble` throughput: 256 SDE paths (d = 32), 1000 steps.",
    "stiff_peers": "Stiff test-set problems (published end values), Robertson x N and the 2D "
    "Brusselator: time (fastest run) against significant correct digits (scd, the test "
    "set's mixed error) for ours, Diffrax's default, scipy and the optional peers; the "
    "table shows rtol 1e-6, the JSON every tolerance.",
    "stiff_peers_quick": "Stiff test-set problems (published end values), Robertson x N and the 2D "
    "Brusselator: time (fastest run) against significant correct digits (scd, the test "
    "set's mixed error) for ours, Diffrax's default, scipy and the optional peers; the "
    "table shows rtol 1e-6, the JSON every tolerance.",
    "adaptive_sde": _ADAPTIVE_SDE,
    "adaptive_sde_quick": _ADAPTIVE_SDE,
    "adaptive_sde_breakdown": _ADAPTIVE_SDE_BREAKDOWN,
    "adaptive_sde_breakdown_quick": _ADAPTIVE_SDE_BREAKDOWN,
    "ensemble_lanes": "`solve_ensemble(lanes=L)` against `solve_ensemble(chunk_size=L)` (vmapped "
    "batches of L paths) on 256 paths of the adaptive double well, as it is and with a per-path "
    "rate that spreads the step counts: time, loop iterations and the cost of one iteration, "
    "lanes over batches (below 1: the lanes are cheaper).",
}


def _side_by_side(name: str, results: list) -> list[str]:
    """The run time of each case on each machine, one line per case."""
    keys = CASE_KEYS.get(name)
    if keys is None or len(results) < 2:
        return []
    labels = [path.stem.removeprefix(f"{name}-") for path, _ in results]
    joined: dict[tuple, dict] = {}
    for label, (_, data) in zip(labels, results):
        for row in data.get("rows", []):
            case = joined.setdefault(tuple(row.get(k) for k in keys), {k: row.get(k) for k in keys})
            case["case"] = ", ".join(f"{k} {row[k]}" for k in keys if row.get(k) is not None)
            case[f"{label}:run_s"] = _fastest(row)
    # At most eight columns: the case in one column where its keys would make more.
    case_columns = [(k, k) for k in keys] if len(keys) + len(labels) <= 8 else [("case", "case")]
    columns = case_columns + [(f"{label}:run_s", f"fastest ({label})") for label in labels]
    return ["### Side by side", "", markdown_table(list(joined.values()), columns), ""]


def _fastest(row: dict | None) -> float | None:
    """A row's fastest round (`run_min_s`), or its `run_s` where the benchmark records no
    minimum."""
    if not row:
        return None
    return row.get("run_min_s", row.get("run_s"))


def _spread(row: dict | None) -> str | None:
    """A row's fastest time with its spread, as [`fmt_spread`][] writes it; for a first
    call (`first_s`), the fastest of its rounds. `None` for a row that was not timed."""
    if not row:
        return None
    if "first_s" in row:
        row = dict(
            run_min_s=row["first_s"],
            run_s=row.get("first_median_s"),
            rounds=row.get("rounds", 1),
        )
    if "run_s" not in row and "run_min_s" not in row:
        return None
    return fmt_spread(row)


def _ratio_cells(rows: list[dict], keys) -> list[dict]:
    """`rows` with the ratios under `keys` written as [`fmt_ratio`][] does."""
    return [dict(r, **{k: fmt_ratio(r[k]) for k in keys if r.get(k) is not None}) for r in rows]


# Above the tables of the benchmarks timed with `time_contenders`.
_INTERLEAVED = (
    "Times: the fastest of the interleaved rounds, and in brackets how far the median round "
    "lay above it (the spread); ratios of the fastest rounds, ours / the other's."
)


def _by(rows, *keys) -> dict:
    return {tuple(r.get(k) for k in keys): r for r in rows}


def _adjoint(data: dict) -> list[str]:
    rows = data["rows"]
    by = _by(rows, "solver", "d", "adjoint")
    out = []
    for r in rows:
        if r["adjoint"] != "ours":
            continue
        theirs = by[(r["solver"], r["d"], "diffrax backsolve")]
        out.append(
            dict(
                solver=r["solver"],
                d=r["d"],
                ours=_spread(r),
                diffrax=_spread(theirs) if "run_s" in theirs else "unsupported",
                checkpoint=_spread(by[(r["solver"], r["d"], "checkpoint")]),
                vs_diffrax=fmt_ratio(r.get("ours_over_diffrax")),
                vs_checkpoint=fmt_ratio(r.get("ours_over_checkpoint")),
                scratch=f"{r['scratch_MiB']:.3g} / {r['scratch_2x_MiB']:.3g} MiB",
            )
        )
    columns = [
        ("solver", "solver"),
        ("d", "d = m"),
        ("ours", "ours"),
        ("diffrax", "diffrax backsolve"),
        ("checkpoint", "checkpointing"),
        ("vs_diffrax", "ours / diffrax backsolve"),
        ("vs_checkpoint", "ours / checkpointing"),
        ("scratch", "our scratch, 100 / 200 steps"),
    ]
    return [_INTERLEAVED, "", markdown_table(out, columns), ""]


def _ensemble(data: dict) -> list[str]:
    interleaved = all("run_min_s" in r and "rounds" in r for r in data["rows"])
    columns = [
        ("processes", "processes"),
        ("devices", "devices"),
        ("cores", "cores"),
        ("run", "run: fastest (spread)" if interleaved else "run (median)"),
        ("paths_per_sec", "paths / s"),
        ("speedup", "speed-up over 1 core"),
        ("efficiency", "efficiency (speed-up / cores)"),
        ("cpu_ratio", "CPU time / 1 core's"),
    ]
    rows = [dict(r, run=_spread(r) if interleaved else fmt_time(r["run_s"])) for r in data["rows"]]
    if not interleaved:
        return [markdown_table(rows, columns), ""]
    head = (
        "Times: each configuration's fastest call over rounds of fresh processes timed "
        "interleaved with the others', and in brackets how far its median call lay above it "
        "(the spread); rates and speed-ups from the fastest calls."
    )
    return [head, "", markdown_table(rows, columns), ""]


def _linear_crossover(data: dict) -> list[str]:
    columns = [
        ("kind", "operator"),
        ("n", "n"),
        ("structured factor_solve_s", "structured: factor + solve"),
        ("dense LU factor_solve_s", "dense LU: factor + solve"),
        ("structured solve_s", "structured: solve"),
        ("dense LU solve_s", "dense LU: solve"),
        ("structured / dense LU, factor_solve", "structured / dense LU"),
        ("structured / dense LU, factor_8solves", "same, factor + 8 solves"),
    ]
    out = [markdown_table(data["rows"], columns), ""]
    crossover = data.get("crossover", {}).get("factor_solve", {})
    if crossover:
        out += [
            "Structured faster than dense LU (factor + solve) from n = "
            + "; ".join(f"{kind}: {n}" for kind, n in crossover.items())
            + f". `StructuredLinearSolver.dense_below`: {data.get('dense_below_chosen')} "
            "(sparse operators only).",
            "",
        ]
    if data.get("pollu"):
        rows = [dict(r, time=fmt_spread(r)) for r in data["pollu"]]
        cols = [("problem", "problem"), ("rtol", "rtol"), ("method", "method"), ("time", "time")]
        out += ["End to end:", "", markdown_table(rows, cols), ""]
    note = data.get("note")
    return out + ([f"{note}", ""] if note else [])


def _fmt_per_step(seconds: float) -> str:
    """A time per step to two significant figures: `24 ns`, `0.8 µs`, `17 µs`."""
    if seconds < 1e-7:
        return f"{seconds * 1e9:.0f} ns"
    if seconds < 1e-4:
        return f"{float(f'{seconds * 1e6:.2g}'):g} µs"
    return fmt_time(seconds)


def _stiff_peers(data: dict) -> list[str]:
    """At each case's rtol 1e-6: the fastest of ours against the fastest peer and Diffrax's
    default, each with its significant correct digits; then the cost per step at Robertson
    N = 1 beside Diffrax's bare loop (what bounds ours)."""
    rows = [r for r in data["rows"] if r.get("rtol") == 1e-6 and r.get("run_min_s")]
    cases = dict.fromkeys((r["problem"], r["size"]) for r in rows)
    ours_names = ("ours ", "diffrax default")

    def cell(r):
        return f"{r['method']}: {_spread(r)}, {r['mescd']:.1f} digits" if r else "—"

    table = []
    for case in cases:
        here = [r for r in rows if (r["problem"], r["size"]) == case]
        ours = min((r for r in here if r["method"].startswith("ours ")), key=_fastest, default=None)
        peers = [r for r in here if not r["method"].startswith(ours_names)]
        peer = min(peers, key=_fastest, default=None)
        default = next((r for r in here if r["method"] == "diffrax default"), None)
        table.append(
            dict(
                case=f"{case[0]} {case[1]}",
                ours=cell(ours),
                peer=cell(peer),
                default=_spread(default),
                vs_peer=fmt_ratio(_fastest(ours) / _fastest(peer)) if ours and peer else None,
                vs_default=(
                    fmt_ratio(_fastest(ours) / _fastest(default)) if ours and default else None
                ),
            )
        )
    columns = [
        ("case", "case (unknowns)"),
        ("ours", "fastest of ours"),
        ("peer", "fastest peer"),
        ("default", "Diffrax default"),
        ("vs_peer", "ours / peer"),
        ("vs_default", "ours / Diffrax default"),
    ]
    out = [
        "At rtol 1e-6, each case's fastest contender of ours and fastest peer (CVODE, "
        "diffsol, casadi, scipy), with the significant correct digits each reached (the "
        "test set's mixed error); every contender at every tolerance is in the JSON. "
        + _INTERLEAVED,
        "",
        markdown_table(table, columns),
        "",
    ]
    out += _equal_accuracy(data.get("equal_accuracy", []))
    per_step = {**data.get("per_step", {}), **data.get("loop_floor", {})}
    if per_step:
        steps = [
            dict(method=k, per_step=_fmt_per_step(v["s_per_step"]), steps=v["steps"])
            for k, v in sorted(per_step.items(), key=lambda kv: kv[1]["s_per_step"])
        ]
        out += [
            "Cost per step on Robertson (3 unknowns, rtol 1e-6): the fastest run over its "
            "steps (accepted and rejected; peers: accepted). The *Diffrax loop* lines are "
            "Diffrax's own loop with its cheapest solvers (`stiff_peers._loop_floor`): the "
            "floor of any step of a `diffeqsolve`, and of an adaptive one; the *XLA loop* "
            "line, one LAPACK LU factorisation and solve of a 3 x 3 matrix per iteration, "
            "what a step that factors its matrix pays for it.",
            "",
            markdown_table(
                steps, [("method", "contender"), ("per_step", "per step"), ("steps", "steps")]
            ),
            "",
        ]
    note = data.get("note")
    return out + ([f"{note}", ""] if note else [])


def _stiff_device(data: dict) -> list[str]:
    """The run's own table (rtol 1e-4: each device's fastest run, accelerator over CPU), and
    on which devices a float64 solve did not compile."""
    out = [_INTERLEAVED, "", data["markdown_table"], ""]
    failed = {d: e for d, e in data.get("float64_compile_error", {}).items() if e}
    if failed:
        errors = "; ".join(f"{d}: `{e}`" for d, e in failed.items())
        out += [f"A float64 solve (ours BDF var, Robertson N = 1) did not compile on {errors}.", ""]
    return out


def _equal_accuracy(rows: list[dict]) -> list[str]:
    """Per case and rtol, the peer that ours is furthest behind at equal accuracy (the
    largest ours / peer, of `stiff_peers.equal_accuracy`)."""
    worst = {}
    for r in rows:
        key = (r["problem"], r["size"], r["rtol"])
        if r["ratio"] is not None and r["ratio"] > worst.get(key, {}).get("ratio", -1):
            worst[key] = r
    if not worst:
        return []
    table = []
    for (problem, size, rtol), r in worst.items():
        lo, hi = r["ours_rtols"]
        table.append(
            dict(
                case=f"{problem} {size}, rtol {rtol:g}",
                peer=f"{r['peer']}: {fmt_time(r['peer_s'])}, {r['digits']:.2f} digits",
                ours=fmt_time(r["ours_s"]),
                bracket=(
                    f"rtol {lo:.3g} to {hi:.3g} ({r['gap']:.2f} digits apart)"
                    if r["how"] == "interpolated"
                    else f"at most: rtol {lo:.3g} gives more digits"
                ),
                ratio=fmt_ratio(r["ratio"]),
            )
        )
    columns = [
        ("case", "case"),
        ("peer", "peer (CVODE, diffsol, casadi) furthest ahead"),
        ("ours", f"{r['ours']} at its digits"),
        ("bracket", "read between"),
        ("ratio", "ours / peer"),
    ]
    return [
        "At equal accuracy: the time of ours at each peer's significant correct digits, "
        "log-time interpolated in digits between the two of ours' runs that first bracket "
        "them as its rtol tightens (`stiff_peers.time_at_digits`; ours is also solved at "
        "quarter decades of rtol for this, the small open markers of the plot); per case "
        "and rtol the peer with the largest ratio ours / peer, by fastest runs.",
        "",
        markdown_table(table, columns),
        "",
    ]


def _materialise(data: dict) -> list[str]:
    rows = data["rows"]
    by = _by(rows, "problem", "N", "method")
    cases = dict.fromkeys((r["problem"], r["N"]) for r in rows)
    out = []
    for problem, n in cases:
        if problem.startswith("first call"):
            ours = by.get((problem, n, "ours (eager)"))
            jacfwd = by.get((problem, n, "jax.jit(jax.jacfwd) first call"))
            fastest = lambda row: row and row.get("first_s")  # noqa: E731
        else:
            ours, jacfwd = by.get((problem, n, "ours")), by.get((problem, n, "jax.jacfwd"))
            fastest = _fastest
        out.append(
            dict(
                problem=problem,
                N=n,
                ours=_spread(ours),
                jacfwd=_spread(jacfwd),
                lineax=_spread(by.get((problem, n, "lineax.materialise"))),
                copy=_spread(by.get((problem, n, "copy of A"))),
                ratio=(
                    fmt_ratio(fastest(ours) / fastest(jacfwd))
                    if fastest(ours) and fastest(jacfwd)
                    else None
                ),
            )
        )
    columns = [
        ("problem", "problem"),
        ("N", "N"),
        ("ours", "ours"),
        ("jacfwd", "jax.jacfwd"),
        ("lineax", "lineax.materialise"),
        ("copy", "copy of A"),
        ("ratio", "ours / jax.jacfwd"),
    ]
    ratios = data.get("ratios")
    return (["Acceptance ratios:", ""] + _acceptance(ratios) if ratios else []) + [
        _INTERLEAVED + " The first-call line: the first, un-jitted call of each, compilation "
        "included, the fastest of rounds at fresh sizes N, N + 1, ... (no cache warm).",
        "",
        markdown_table(out, columns),
        "",
    ]


def _materialise_seed(data: dict) -> list[str]:
    """`_materialise`'s table, and how far each compiled result is from A at the run's
    matmul precision."""
    errors = ", ".join(
        f"{r['method']} {r['max_error_over_max_A']:.2g}"
        for r in data["rows"]
        if "max_error_over_max_A" in r
    )
    precision = data.get("matmul_precision", "default")
    line = f"max abs(J - A) / max abs(A), matmul precision {precision}: {errors}."
    return _materialise(data) + [line, ""]


def _acceptance(ratios: dict) -> list[str]:
    """The materialise benchmark's acceptance ratios, `"what (want <= x)": value`."""
    rows = []
    for key, value in ratios.items():
        match = re.fullmatch(r"(.*) \(want (<=|>=) ([\d.]+)\)", key)
        what, op, bound = match.groups() if match else (key, None, None)
        met = (
            None if op is None else (value >= float(bound) if op == ">=" else value <= float(bound))
        )
        rows.append(
            dict(what=what, value=fmt_ratio(value), want=f"{op} {bound}" if op else None, met=met)
        )
    columns = [("what", "what"), ("value", "ratio"), ("want", "want"), ("met", "met")]
    for row in rows:
        row["met"] = {True: "yes", False: "no", None: None}[row["met"]]
    return [markdown_table(rows, columns), ""]


def _squared_grads(data: dict) -> list[str]:
    rows = data["rows"]
    from benchmarks.squared_grads import REFERENCES

    by = _by(rows, "model", "B", "method")
    out = []
    for r in rows:
        if r["method"] not in REFERENCES:
            continue
        ref = by[(r["model"], r["B"], REFERENCES[r["method"]])]
        out.append(
            dict(
                model=r["model"],
                B=r["B"],
                method=f"`{r['method']}`",
                run=_spread(r),
                vs_grad=fmt_ratio(r["time_vs_grad"]),
                ref=_spread(ref),
                vs_vmap=fmt_ratio(r["ours_over_vmap"]),
                scratch=f"{_mib(r['scratch_MiB'])} / {_mib(ref['scratch_MiB'])}",
            )
        )
    columns = [
        ("model", "model"),
        ("B", "B"),
        ("method", "ours"),
        ("run", "run"),
        ("vs_grad", "ours / value_and_grad"),
        ("ref", "vmap(grad)"),
        ("vs_vmap", "ours / vmap(grad)"),
        ("scratch", "scratch, ours / vmap(grad)"),
    ]
    return [_INTERLEAVED, "", markdown_table(out, columns), ""]


def _step_cost(data: dict) -> list[str]:
    rows = data["rows"]
    by = _by(rows, "diffusion", "d", "solver")
    cells = dict.fromkeys((r["diffusion"], r["d"]) for r in rows)
    out = []
    for diffusion, d in cells:
        t = lambda solver: by[(diffusion, d, solver)].get("run_min_s")  # noqa: E731
        ratio = lambda a, b: fmt_ratio(a / b) if a and b else None  # noqa: E731
        spread = lambda solver: (  # noqa: E731
            fmt_spread(by[(diffusion, d, solver)]) if t(solver) else None
        )
        out.append(
            dict(
                diffusion=diffusion,
                d=d,
                ito=spread("ours_ito"),
                diffrax_ito=spread("diffrax_ito"),
                vs_ito=ratio(t("ours_ito"), t("diffrax_ito")),
                strat=spread("ours_strat"),
                vs_strat=ratio(t("ours_strat"), t("diffrax_strat")),
                vs_euler=ratio(t("ours_ito"), t("euler")),
            )
        )
    columns = [
        ("diffusion", "diffusion"),
        ("d", "d = m"),
        ("ito", "ours, Itô"),
        ("diffrax_ito", "diffrax.ItoMilstein"),
        ("vs_ito", "ours / diffrax.ItoMilstein"),
        ("strat", "ours, Stratonovich"),
        ("vs_strat", "ours / diffrax.StratonovichMilstein"),
        ("vs_euler", "ours, Itô / diffrax.Euler"),
    ]
    skipped = {}
    for r in rows:
        if "skipped" in r:
            skipped.setdefault((r["diffusion"], r["d"], r["skipped"]), []).append(r["solver"])
    out_lines = [
        "Fastest of the interleaved rounds of each step, and in brackets how far the median "
        "round lay above it (the spread); ratios from the fastest rounds (a step takes "
        "microseconds, and on a shared machine a median carries the neighbours' load: by "
        "medians the diagonal step would come out cheaper than the Euler step it contains).",
        "",
        markdown_table(out, columns),
        "",
    ]
    if skipped:
        every = len({r["solver"] for r in rows})
        notes = [
            f"{diffusion}, d = {d}"
            + ("" if len(solvers) == every else ", " + ", ".join(solvers))
            + f" ({why})"
            for (diffusion, d, why), solvers in skipped.items()
        ]
        out_lines += ["Not run (a dash): " + "; ".join(notes) + ".", ""]
    return out_lines


def _stiff(data: dict) -> list[str]:
    interleaved = all("rounds" in r for r in data["rows"] if "run_s" in r)
    by = _by(data["rows"], "problem", "N", "method")
    summary = []
    for s in data["summary"]:
        n = s["N"]
        size = f"{n} x {n} grid" if s["problem"] == "brusselator_2d" else f"x {n}"
        summary.append(
            dict(
                s,
                problem=f"{s['problem']}, {size}",
                ratio=fmt_ratio(s.get("ours_over_default")),
                diff=None if s.get("diff") is None else f"{s['diff']:.1e}",
                **{
                    key: _spread(row) if interleaved else fmt_time((row or {}).get("run_s"))
                    for key, method in (
                        ("ours", "ours"),
                        ("default", "diffrax default"),
                        ("vmap", "vmap"),
                    )
                    for row in [by.get((s["problem"], n, method))]
                },
            )
        )
    how = "" if interleaved else " (median)"
    columns = [
        ("problem", "problem"),
        ("unknowns", "unknowns"),
        ("ours", f"ours{how}"),
        ("default", f"diffrax default{how}"),
        ("ratio", "ours / diffrax default"),
        ("vmap", f"vmap(diffeqsolve){how}"),
        ("steps", "steps (accepted + rejected)"),
        ("diff", "max rel. difference"),
    ]
    spde = [r for r in data["rows"] if "rms_error" in r]
    head = [_INTERLEAVED, ""] if interleaved else []
    out = [*head, "Per solve:", "", markdown_table(summary, columns), ""]
    if spde:
        (stable,) = {r["stable_steps"] for r in spde}
        (problem,) = {(r["problem"], r["N"]) for r in spde}
        refs = {r.get("reference_steps") for r in spde}
        ref = (
            f"; RMS error against Euler-Maruyama at {refs.pop()} steps on the same paths"
            if len(refs) == 1 and None not in refs
            else ""
        )
        out += [
            f"{problem[0]} (n = {problem[1]}), per path; explicit schemes are stable from "
            f"about {stable} steps{ref}:",
            "",
            markdown_table(
                [
                    dict(r, rms_error=f"{r['rms_error']:.2e}", path_s=r["run_s_per_path"])
                    for r in spde
                ],
                [
                    ("method", "method"),
                    ("steps", "steps"),
                    (
                        "path_s",
                        "time per path (fastest run)" if interleaved else "time per path (1 run)",
                    ),
                    ("rms_error", "RMS error"),
                ],
            ),
            "",
        ]
    return out


def _structure(data: dict) -> list[str]:
    summary = _ratio_cells(data["summary"], ("ours_over_jacfwd", "ours_over_asdex"))
    by = _by(data["rows"], "field", "unknowns", "method")
    for s in summary:
        for method in ("ours", "jacfwd", "asdex"):
            s[method] = _spread(by.get((s["field"], s["unknowns"], method)))
    columns = [
        ("field", "field"),
        ("unknowns", "unknowns"),
        ("structure", "structure found"),
        ("ours", "ours"),
        ("jacfwd", "jax.jacfwd"),
        ("asdex", "asdex"),
        ("ours_over_jacfwd", "ours / jax.jacfwd"),
        ("ours_over_asdex", "ours / asdex"),
    ]
    return [_INTERLEAVED, "", markdown_table(summary, columns), ""]


def _work_precision(data: dict) -> list[str]:
    noisy = _noisy(data)
    measured = {}
    for r in data["rows"]:
        key = (r["m"], r["method"])
        measured[key] = max(measured.get(key, 0), r["steps"])
    rows = []
    for s in data["summary"]:
        series = sorted(
            (r for r in data["rows"] if (r["m"], r["method"]) == (s["m"], s["method"])),
            key=lambda r: r["steps"],
        )
        # An extrapolation runs along the last three points: say if one of them is noisy.
        used = {(s["m"], s["method"], r["steps"]) for r in series[-3:]}
        if s["extrapolated"]:
            most = measured[(s["m"], s["method"])]
            how = f"extrapolated {s['steps_at_1e_3'] / most:.0f}x past the {most} steps measured"
            if used & set(noisy):
                how += ", from a noisy timing"
        else:
            how = "interpolated"
        rows.append(
            dict(
                m=s["m"],
                method=s["method"],
                order=f"{s['order']:.2f}",
                steps=f"{s['steps_at_1e_3']:.0f}",
                run_s=s["run_s_at_1e_3"],
                how=how,
            )
        )
    columns = [
        ("m", "m"),
        ("method", "method"),
        ("order", "fitted strong order"),
        ("steps", "steps for RMS error 1e-3"),
        ("run_s", f"time per path there ({_wp_basis(data)})"),
        ("how", "how"),
    ]
    out = ["Cost per path at RMS error 1e-3:", "", markdown_table(rows, columns), ""]
    if noisy:
        out += [
            "A timing is marked *noisy* when its time per step is more than "
            "1.5 times that of the same method at half the steps (the cost per step of a "
            "method does not grow with the number of steps); it is ringed in red in the plot "
            "and should be re-measured on an idle machine. Noisy here: "
            + "; ".join(
                f"{method}, m = {m}, {steps} steps ({jump:.1f}x)"
                for (m, method, steps), jump in sorted(noisy.items())
            )
            + ". "
            + (
                'The costs marked "from a noisy timing" (here: '
                + "; ".join(f"{r['method']}, m = {r['m']}" for r in rows if "noisy" in r["how"])
                + ") are not to be relied on."
                if any("noisy" in r["how"] for r in rows)
                else "No cost above is extrapolated from a noisy timing."
            ),
            "",
        ]
    return out


def _wp_basis(data: dict) -> str:
    """What the work-precision costs are read from: the fastest interleaved rounds, or (a
    result from before them) medians."""
    return "fastest rounds" if all("run_min_s" in r for r in data["rows"]) else "from medians"


def _noisy(data: dict) -> dict:
    from benchmarks.work_precision import noisy_points

    return noisy_points(data["rows"])


def _adaptive_sde(data: dict) -> list[str]:
    from benchmarks.adaptive_sde import (
        OVER_TOLERANCES_NOTE,
        over_tolerances_table,
        table,
        TABLE_NOTE,
    )

    note = data.get("note")
    sweep = over_tolerances_table(data["over_tolerances"])
    return (
        [table(data["acceptance"]), "", TABLE_NOTE, ""]
        + [sweep, "", OVER_TOLERANCES_NOTE, ""]
        + ([note, ""] if note else [])
    )


def _adaptive_sde_breakdown(data: dict) -> list[str]:
    from benchmarks.adaptive_sde import breakdown_table

    return [breakdown_table(data["rows"]), ""]


def _ensemble_lanes(data: dict) -> list[str]:
    from benchmarks.ensemble_lanes import table

    return [table(data["rows"]), ""]


# Each benchmark's short table (at most eight columns), from one result file.
def _xla_cpu_flags(data: dict) -> list[str]:
    from benchmarks.xla_cpu_flags import table

    return [table(data["summary"]), ""]


SHORT = {
    "xla_cpu_flags": _xla_cpu_flags,
    "materialise_seed": _materialise_seed,
    "stiff_device": _stiff_device,
    "stiff_device_quick": _stiff_device,
    "ensemble_lanes": _ensemble_lanes,
    "adaptive_sde": _adaptive_sde,
    "adaptive_sde_quick": _adaptive_sde,
    "adaptive_sde_breakdown": _adaptive_sde_breakdown,
    "adaptive_sde_breakdown_quick": _adaptive_sde_breakdown,
    "linear_crossover": _linear_crossover,
    "stiff_peers": _stiff_peers,
    "stiff_peers_quick": _stiff_peers,
    "adjoint": _adjoint,
    "ensemble": _ensemble,
    "materialise": _materialise,
    "squared_grads": _squared_grads,
    "step_cost": _step_cost,
    "stiff": _stiff,
    "structure": _structure,
    "work_precision": _work_precision,
}


def _machine_line(m, note: str | None = None) -> str:
    """The machine a result came from, with its state when the run recorded one."""
    v = m.get("versions", {})
    versions = ", ".join(f"{k} {v[k]}" for k in sorted(v) if v[k])
    return (
        f"{m.get('platform', '?')} / {m.get('device', '?')} ({m.get('cpu_count')} CPU cores, "
        f"{m.get('device_count')} device(s)), Python {m.get('python')}, {versions}; "
        f"recorded {m.get('date')}" + (f" ({note})" if note else "")
    )


def _earlier_runs(data: dict) -> str:
    """For a partial re-run: the runs its older rows come from, and which cases those are."""
    runs = data.get("earlier_runs") or []
    if not runs:
        return ""
    latest = data["machine"]["date"]
    keys = RERUN_KEYS.get(data.get("benchmark"), ("field",))
    older = sorted(
        {
            tuple(r.get(k, "?") for k in keys)
            for r in data["rows"]
            if r.get("recorded", latest) != latest
        }
    )
    cases = [" ".join(str(v) for v in case) for case in older]
    which = f" (the rows of {', '.join(cases)})" if cases else ""
    lines = "; ".join(_machine_line(r["machine"], r.get("machine_note")) for r in runs)
    return f". Not re-run then, so from earlier runs{which}: {lines}"


def render() -> str:
    files = sorted(RESULTS.glob("*.json"))
    by_bench: dict[str, list] = {}
    for path in files:
        data = json.loads(path.read_text())
        by_bench.setdefault(data.get("benchmark", path.stem), []).append((path, data))
    out = [
        "# Benchmarks",
        "",
        "Generated by `python -m benchmarks.report` from `benchmarks/results/*.json`; do not "
        "edit by hand. The contenders of each case are timed interleaved (round-robin, after "
        "compiling), so that a busy machine slows all of them alike; a time is the fastest "
        "round, and in brackets how far the median round lay above it (the spread). A section "
        "whose table says *median* has not been re-timed that way yet. Compile times are "
        "reported separately, in the JSON. Every ratio is ours over the other's time, of the "
        "fastest rounds (below 1: ours is faster; `1/40` is 0.025). Each section has its plot, "
        "a short table and the full data (every row, with compile times, medians, slowest "
        "rounds, repeats and the versions) as JSON.",
        "",
    ]
    for name in sorted(by_bench):
        out += [f"## {TITLES.get(name, name)}", ""]
        if name in WHAT:
            out += [WHAT[name], ""]
        out += _side_by_side(name, by_bench[name])
        for path, data in by_bench[name]:
            png = path.with_suffix(".png")
            out += [f"### {path.stem}", ""]
            if png.is_file():
                out += [f"![{TITLES.get(name, name)}, {path.stem}]({ASSETS}/{png.name})", ""]
            out += SHORT[name](data) if name in SHORT else []
            out += [
                f"{_machine_line(data.get('machine', {}), data.get('machine_note'))}"
                f"{_earlier_runs(data)}. Full data: "
                f"[`{path.name}`]({ASSETS}/{path.name}).",
                "",
            ]
    if not by_bench:
        out.append("No results recorded yet: run `make bench`.")
    return "\n".join(out) + "\n"


_GENERATED = re.compile(
    r"<!-- generated:(?P<name>[\w-]+) -->.*?<!-- /generated:(?P=name) -->", re.S
)


def _ensemble_figures() -> dict[str, str]:
    from benchmarks import ensemble

    paths = sorted(RESULTS.glob("ensemble-cpu-*.json"))
    rows = json.loads(paths[0].read_text())["rows"] if paths else []
    if not rows or "processes" not in rows[0]:
        missing = "not measured yet: run `python -m benchmarks.ensemble` on an idle machine"
        return {
            "ensemble-summary": missing,
            "ensemble-table": f"\n\n({missing}.)\n\n",
            "ensemble-per-path-step": f"({missing})",
            "ensemble-10k-paths": f"({missing})",
        }
    data = json.loads(paths[0].read_text())
    table = ensemble.table(rows)
    source = f"`benchmarks/results/{paths[0].name}`; {_machine_line(data['machine'])}."
    # The one-core baseline's cost per path and step (fastest call), for the guide's sense of
    # scale.
    (base,) = [r for r in rows if (r["processes"], r["devices"], r["cores"]) == (1, 1, 1)]
    per_step = _fastest(base) / (base["paths"] * base["steps"])
    return {
        "ensemble-summary": ensemble.summary(rows),
        "ensemble-table": f"\n\n{table}\n\nFrom {source}\n\n",
        "ensemble-per-path-step": _fmt3(per_step),
        "ensemble-10k-paths": _fmt3(per_step * 10_000 * 1_000),
    }


SQUARED_GRADS_FIGURES = (
    "squared-grads-vmap-scratch",
    "squared-grads-mlp-vs-grad",
    "squared-grads-mlp-vs-vmap",
    "squared-grads-transformer-vs-grad",
    "squared-grads-transformer-vs-vmap",
)


def _squared_grads_figures() -> dict[str, str]:
    """The figures of `docs/squared_grads.md`'s prose."""
    if not (RESULTS / "squared_grads-cpu-cpu.json").is_file():
        missing = "(not measured yet: run `python -m benchmarks.squared_grads`)"
        return dict.fromkeys(SQUARED_GRADS_FIGURES, missing)
    data = _load("squared_grads")
    row = lambda model, B, method: _row(data, model=model, B=B, method=method)  # noqa: E731
    spread = lambda xs: (  # noqa: E731
        f"{min(xs):.2f}x to {max(xs):.2f}x"
        if f"{min(xs):.2f}" != f"{max(xs):.2f}"
        else f"{xs[0]:.2f}x"
    )
    both = "value_grad_and_sum_squared_grads"
    sizes = sorted({r["B"] for r in data["rows"] if r["model"] == "transformer"})
    return {
        "squared-grads-vmap-scratch": _mib(row("mlp", 1024, "vmap(grad) squares")["scratch_MiB"]),
        "squared-grads-mlp-vs-grad": f"{row('mlp', 1024, both)['time_vs_grad']:.2f}x",
        "squared-grads-mlp-vs-vmap": fmt_ratio(row("mlp", 1024, both)["ours_over_vmap"]),
        "squared-grads-transformer-vs-grad": spread(
            [row("transformer", B, both)["time_vs_grad"] for B in sizes]
        ),
        "squared-grads-transformer-vs-vmap": spread(
            [row("transformer", B, "sum_squared_grads")["ours_over_vmap"] for B in sizes]
        ),
    }


def _adaptive_sde_figures() -> dict[str, str]:
    """The acceptance table of the adaptive-steps benchmark, for `docs/milstein.md`."""
    paths = sorted(RESULTS.glob("adaptive_sde-cpu-*.json")) or sorted(
        RESULTS.glob("adaptive_sde_quick-cpu-*.json")
    )
    if not paths:
        missing = "(not measured yet: run `python -m benchmarks.adaptive_sde`)"
        return {"adaptive-sde-table": f"\n\n{missing}\n\n"}
    from benchmarks.adaptive_sde import table, TABLE_NOTE

    data = json.loads(paths[0].read_text())
    source = f"`benchmarks/results/{paths[0].name}`; {_machine_line(data['machine'])}"
    note = f" {data['note']}." if data.get("note") else ""
    text = f"{table(data['acceptance'])}\n\n{TABLE_NOTE} From {source}.{note}"
    return {"adaptive-sde-table": f"\n\n{text}\n\n"}


def _stiff_hires_figures() -> dict[str, str]:
    """`docs/stiff.md`'s HIRES at `rtol = 1e-6`: Diffrax's default against
    `Kvaerno5(root_finder=dl.VeryChord())` there, and where ours reaches the same digits."""
    if not (RESULTS / "stiff_peers-cpu-cpu.json").is_file():
        return {"stiff-hires-digits": "(not measured yet: run `python -m benchmarks.stiff_peers`)"}
    data = _load("stiff_peers")
    rows = [r for r in data["rows"] if r["problem"] == "HIRES" and r.get("ok")]
    default = _row({"rows": rows}, method="diffrax default", rtol=1e-6)
    ours = sorted((r for r in rows if r["method"] == "ours VeryChord"), key=lambda r: -r["rtol"])
    at = next(r for r in ours if r["rtol"] == 1e-6)
    # The loosest tolerance at which ours has the default's digits (to the digits shown).
    same = next(r for r in ours if round(r["mescd"], 1) >= round(default["mescd"], 1))
    steps = lambda r: f"accepts {r['accepted_steps']} steps and rejects {r['rejected_steps']}"  # noqa: E731
    text = (
        f"Diffrax's default {steps(default)} for {default['mescd']:.1f} significant correct "
        f"digits; ours {steps(at)} for {at['mescd']:.1f}, and at `rtol = {same['rtol']:g}` "
        f"{steps(same)} for {same['mescd']:.1f} digits, in "
        f"{fmt_ratio(same['run_min_s'] / default['run_min_s'])} of the time"
    )
    return {"stiff-hires-digits": text}


def _accelerator_result(name: str):
    """The first recorded result of benchmark `name` from an accelerator (not a CPU-only
    run), or `None`."""
    paths = [p for p in sorted(RESULTS.glob(f"{name}-*.json")) if "-cpu-" not in p.name]
    return paths[0] if paths else None


def _stiff_device_figures() -> dict[str, str]:
    """`docs/stiff.md`'s accelerator paragraph: ours BDF var at rtol 1e-4 on the accelerator
    against the same machine's CPU, smallest and largest case of each problem."""
    path = _accelerator_result("stiff_device")
    if path is None:
        return {"stiff-device": "(not measured yet: run `bash benchmarks/tpu.sh` on a TPU)"}
    data = json.loads(path.read_text())
    m = data["machine"]
    rows = [r for r in data["rows"] if r["rtol"] == 1e-4 and r["method"] == "ours BDF var"]
    by = _by(rows, "problem", "size", "device")
    parts = []
    labels = (
        ("robertson", "{} Robertson system(s)"),
        ("brusselator_2d", "the {0} x {0} Brusselator"),
    )
    for problem, label in labels:
        sizes = sorted({r["size"] for r in rows if r["problem"] == problem})
        for size in (sizes[0], sizes[-1]):
            acc, cpu = by[(problem, size, m["platform"])], by[(problem, size, "cpu")]
            parts.append(
                f"{label.format(f'{size:,}')} ({acc['unknowns']:,} unknowns) in "
                f"{fmt_time(acc['run_min_s'])} against {fmt_time(cpu['run_min_s'])} "
                f"({fmt_ratio(acc['run_min_s'] / cpu['run_min_s'])})"
            )
    text = (
        f"On one {m['device']} (`benchmarks/results/{path.name}`, {m['date'][:10]}), "
        f"`dl.BDF(max_order=5, variable_order=True)` at `rtol=1e-4` in float32 solves, "
        f"against the same machine's {m['cpu_count']}-core CPU (in brackets the accelerator's "
        f"time over the CPU's): " + "; ".join(parts)
    )
    return {"stiff-device": text}


def _materialise_seed_figures() -> dict[str, str]:
    """The README's sentence on the seed report's case on an accelerator (JAX #9215's
    `A @ x` at N = 10,000): times, and how far `jax.jacfwd`'s result is from A."""
    path = _accelerator_result("materialise_seed")
    if path is None:
        return {"materialise-seed-device": "(not measured on an accelerator yet)"}
    data = json.loads(path.read_text())
    m, rows = data["machine"], data["rows"]
    by = _by(rows, "problem", "method")
    jacfwd, ours = by[("A @ x (seed size)", "jax.jacfwd")], by[("A @ x (seed size)", "ours")]
    precision = data.get("matmul_precision", "default")
    exact = lambda r: (  # noqa: E731
        "`A` exactly"
        if r["max_error_over_max_A"] == 0
        else f"`A` with entries off by up to {r['max_error_over_max_A']:.1e} times its largest"
    )
    text = (
        f"On one {m['device']} ({m['date'][:10]}, `benchmarks/results/{path.name}`), at "
        f"N = {jacfwd['N']:,} and the {precision} matmul precision, the compiled "
        f"`jax.jacfwd(lambda x: A @ x)` takes {fmt_time(_fastest(jacfwd))} and returns "
        f"{exact(jacfwd)}; `materialise` takes {fmt_time(_fastest(ours))} and returns "
        f"{exact(ours)}"
    )
    return {"materialise-seed-device": text}


def _xla_cpu_flags_figures() -> dict[str, str]:
    """`docs/stiff.md`'s compile-time paragraph: the range of the flag's ratios."""
    if not (RESULTS / "xla_cpu_flags-cpu-cpu.json").is_file():
        return {"xla-cpu-flags": "(not measured yet: run `python -m benchmarks.xla_cpu_flags`)"}
    data = _load("xla_cpu_flags")
    ratios = data["summary"]
    by = lambda key: sorted(ratios, key=lambda s: s[key])  # noqa: E731
    low, high = by("compile_ratio")[0], by("compile_ratio")[-1]
    fast, slow = by("run_ratio")[0], by("run_ratio")[-1]
    cpus = data["machine"].get("cpu_count")
    text = (
        f"on a {cpus}-core CPU ({data['machine']['date'][:10]}, "
        f"`benchmarks/results/xla_cpu_flags-cpu-cpu.json`), seven typical workloads traced "
        f"and compiled in {fmt_ratio(low['compile_ratio'])} to "
        f"{fmt_ratio(high['compile_ratio'])} of the time they take under XLA's defaults "
        f"({low['workload']}: {fmt_time(low['compile_default_s'])} against "
        f"{fmt_time(low['compile_flag_s'])}), and then ran in "
        f"{fmt_ratio(fast['run_ratio'])} ({fast['workload']}) to "
        f"{fmt_ratio(slow['run_ratio'])} ({slow['workload']}) of the time, with outputs "
        f"equal to within {max(s['max_rel_diff'] for s in ratios):.0e} relatively"
    )
    return {"xla-cpu-flags": text}


def figures() -> dict[str, str]:
    """The generated figures, by name."""
    return (
        _xla_cpu_flags_figures()
        | _ensemble_figures()
        | _squared_grads_figures()
        | _adaptive_sde_figures()
        | _stiff_hires_figures()
        | _stiff_device_figures()
        | _materialise_seed_figures()
    )


def fill(text: str, pieces: dict[str, str]) -> str:
    """`text` with every generated region named in `pieces` replaced."""

    def sub(match):
        name = match["name"]
        if name not in pieces:
            return match[0]
        return f"<!-- generated:{name} -->{pieces[name]}<!-- /generated:{name} -->"

    return _GENERATED.sub(sub, text)


#
# The README's "Measured" table
#

README_START = (
    "<!-- measured: generated by `python -m benchmarks.report` from benchmarks/results/ -->"
)
README_END = "<!-- end measured -->"


def _load(name: str, stem: str = "cpu-cpu") -> dict:
    return json.loads((RESULTS / f"{name}-{stem}.json").read_text())


def _row(data: dict, **match) -> dict:
    (row,) = [r for r in data["rows"] if all(r.get(k) == v for k, v in match.items())]
    return row


def _summary(data: dict, m: int, method: str) -> dict:
    (row,) = [s for s in data["summary"] if (s["m"], s["method"]) == (m, method)]
    return row


def _fmt3(seconds: float) -> str:
    """A time to three significant figures (the README's precision)."""
    for scale, unit in ((1, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if seconds >= scale or unit == "µs":
            return f"{seconds / scale:#.3g}".rstrip(".") + f" {unit}"
    raise AssertionError


def _mib(x: float) -> str:
    return f"{x / 1024:.2f} GiB" if x >= 1024 else f"{x:.2f} MiB"


def _x(x: float) -> str:
    return f"{x:.2f}x" if x < 10 else f"{x:.0f}x"


def _spreads_overlap(a: dict, b: dict) -> bool:
    """Whether two rows' spreads, from the fastest to the median round, overlap: their
    ratio of fastest rounds is then within the noise of the machine."""
    return a["run_min_s"] <= b["run_s"] and b["run_min_s"] <= a["run_s"]


def readme_table() -> str:
    """The README's table of headline numbers, each read from the recorded JSON."""
    mat, step, wp = _load("materialise"), _load("step_cost"), _load("work_precision")
    adj, sq = _load("adjoint"), _load("squared_grads")
    # The fastest round of each (interleaved against its peers, where the benchmark does so).
    t = lambda data, key=None, **match: _fmt3(  # noqa: E731
        _row(data, **match)[key] if key else _fastest(_row(data, **match))
    )
    rows = []
    ours = _row(mat, problem="A @ x", N=2000, method="ours")
    rows.append(
        (
            "`materialise(lambda x: A @ x)`, N=2000",
            f"{_fmt3(_fastest(ours))} (bit-equal to `A`)",
            f"`jax.jacfwd` {t(mat, problem='A @ x', N=2000, method='jax.jacfwd')}; "
            f"copy of `A` {t(mat, problem='A @ x', N=2000, method='copy of A')}",
        )
    )
    rows.append(
        (
            "`B @ tanh(A @ x)`, N=1000",
            t(mat, problem="B @ tanh(A @ x)", N=1000, method="ours"),
            f"`jax.jacfwd` {t(mat, problem='B @ tanh(A @ x)', N=1000, method='jax.jacfwd')}",
        )
    )
    rows.append(
        (
            "first un-jitted call, closed-over `A`, N=3000",
            t(mat, "first_s", problem="first call A @ x", method="ours (eager)"),
            "first call of `jit(jacfwd)` "
            + t(
                mat, "first_s", problem="first call A @ x", method="jax.jit(jax.jacfwd) first call"
            ),
        )
    )
    for diffusion, d, what in (
        ("diagonal", 1024, "diagonal `lineax` noise, d=m=1024"),
        ("row_scaled", 256, "`g_ij = y_i G_ij`, d=m=256"),
        ("dense_linear", 256, "`g(y) = A y`, d=m=256"),
    ):
        # The fastest round, as on the benchmarks page: by medians a microsecond step carries
        # the machine's load. Where the two steps' spreads (fastest to median round) overlap,
        # their ratio is noise, and the table says so rather than quote a Milstein step
        # cheaper than an Euler step as a result.
        r = _row(step, diffusion=diffusion, d=d, solver="ours_ito")
        e = _row(step, diffusion=diffusion, d=d, solver="euler")
        theirs = t(step, "run_min_s", diffusion=diffusion, d=d, solver="diffrax_ito")
        vs_euler = f"{r['run_min_s'] / e['run_min_s']:.1f}x Euler"
        if _spreads_overlap(r, e):
            vs_euler = f"within the spread of Euler's {_fmt3(e['run_min_s'])}: {vs_euler}"
        rows.append(
            (
                f"Itô Milstein step, {what} (fastest round)",
                f"{_fmt3(r['run_min_s'])} ({vs_euler})",
                f"`diffrax.ItoMilstein` {theirs}",
            )
        )
    for m in (10, 50):
        g = _summary(wp, m, "GeneralItoMilstein (ours)")
        e = _summary(wp, m, "Euler-Maruyama (diffrax.Euler)")
        what = (
            "non-commutative noise, m=10, cost per path at RMS error 1e-3"
            if m == 10
            else "the same, m=50"
        )
        ours_cell = f"{_fmt3(g['run_s_at_1e_3'])} (`GeneralItoMilstein`, order {g['order']:.2f})"
        if m != 10:
            ours_cell = f"{_fmt3(g['run_s_at_1e_3'])} (order {g['order']:.2f})"
        most = max(r["steps"] for r in wp["rows"] if (r["m"], r["method"]) == (m, e["method"]))
        how = (
            f"extrapolated {e['steps_at_1e_3'] / most:.0f}x past the {most} steps measured, "
            if e["extrapolated"]
            else ""
        )
        rows.append(
            (
                what,
                ours_cell,
                f"Euler–Maruyama {_fmt3(e['run_s_at_1e_3'])} ({how}order {e['order']:.2f})",
            )
        )
    r = _row(adj, solver="ReversibleHeun", adjoint="ours", d=256)
    same = "at 100 and 200 steps" if r["scratch_2x_MiB"] == r["scratch_MiB"] else ""
    rows.append(
        (
            "`value_and_grad`, ReversibleHeun, 100 steps, d=m=256",
            f"{_fmt3(_fastest(r))}, {_mib(r['scratch_MiB'])} {same}".strip(),
            "diffrax backsolve "
            + t(adj, solver="ReversibleHeun", adjoint="diffrax backsolve", d=256)
            + "; "
            + f"checkpointing {t(adj, solver='ReversibleHeun', adjoint='checkpoint', d=256)}",
        )
    )
    combined = _row(sq, model="mlp", B=1024, method="value_grad_and_sum_squared_grads")
    vmap = _row(sq, model="mlp", B=1024, method="vmap(grad) squares")
    rows.append(
        (
            "loss, grad and squared per-example grads, MLP 784-512-512-10, B=1024",
            f"{_fmt3(_fastest(combined))} ({_x(combined['time_vs_grad'])} `value_and_grad`)",
            f"`vmap(grad)` {_fmt3(_fastest(vmap))}, {_mib(vmap['scratch_MiB'])} scratch",
        )
    )
    norms = _row(sq, model="mlp", B=1024, method="per_example_grad_norms")
    rows.append(
        (
            "per-example gradient norms, same MLP",
            f"{_fmt3(_fastest(norms))} ({_x(norms['time_vs_grad'])} `value_and_grad`)",
            f"`vmap(grad)` {t(sq, model='mlp', B=1024, method='vmap(grad) norms')}",
        )
    )
    tc = _row(sq, model="transformer", B=1024, method="value_grad_and_sum_squared_grads")
    tv = _row(sq, model="transformer", B=1024, method="vmap(grad) squares")
    rows.append(
        (
            "the same three, transformer block (64 positions, width 128), B=1024",
            f"{_fmt3(_fastest(tc))} ({_x(tc['time_vs_grad'])} `value_and_grad`)",
            f"`vmap(grad)` squares alone {_fmt3(_fastest(tv))}",
        )
    )
    rows.append(
        (
            "`solve_ensemble`, 256 SDE paths (d=32), 1000 steps, one CPU core per device",
            "<!-- generated:ensemble-summary -->"
            + _ensemble_figures()["ensemble-summary"]
            + "<!-- /generated:ensemble-summary -->",
            "linear scaling: 2x the 1-core rate on 2",
        )
    )
    m = mat["machine"]
    v = m["versions"]
    head = (
        f"Recorded {_date_range(mat, step, wp, adj, sq)} with jax {v['jax']}, diffrax "
        f"{v['diffrax']}, equinox "
        f"{v['equinox']}, lineax {v['lineax']}, Python {m['python']}, on this project's "
        f"{m['cpu_count']}-core {m['machine']} CI-class machine (JSON and plots in "
        "`benchmarks/results/`). Times are the fastest of rounds timed interleaved with the "
        "reference's (spreads on the benchmarks page)" + _median_sources(wp)
    )
    lines = [head, "", "| what | ours | reference |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def _date_range(*results: dict) -> str:
    """The day the results were recorded, or the first and last of those days."""
    paths = sorted(RESULTS.glob("ensemble-cpu-*.json"))
    ensemble = [json.loads(paths[0].read_text())] if paths else []
    days = sorted({r["machine"]["date"][:10] for r in [*results, *ensemble]})
    return days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"


def _median_sources(wp: dict) -> str:
    """The end of the README table's heading: which of its figures, recorded before their
    benchmark timed interleaved rounds, still come from medians."""
    paths = sorted(RESULTS.glob("ensemble-cpu-*.json"))
    ensemble = json.loads(paths[0].read_text()) if paths else {"rows": []}
    medians = [
        what
        for what, old in (
            ("the work-precision costs", _wp_basis(wp) != "fastest rounds"),
            ("the ensemble rates", not all("rounds" in r for r in ensemble["rows"])),
        )
        if old
    ]
    return "; " + " and ".join(medians) + " come from medians." if medians else "."


def update_readme(text: str) -> str:
    """`text` (the README) with its generated block replaced by `readme_table()`."""
    start, end = text.index(README_START), text.index(README_END)
    return text[: start + len(README_START)] + "\n" + readme_table() + "\n" + text[end:]


# The plots, redrawn from the JSON (`--plots`). The ensemble's plot is drawn by its own
# benchmark only.
PLOTTERS = {
    "step_cost": "benchmarks.step_cost",
    "materialise": "benchmarks.materialise",
    "structure": "benchmarks.structure",
    "stiff": "benchmarks.stiff",
    "adjoint": "benchmarks.adjoint",
    "squared_grads": "benchmarks.squared_grads",
    "work_precision": "benchmarks.work_precision",
    "adaptive_sde": "benchmarks.adaptive_sde",
    "adaptive_sde_quick": "benchmarks.adaptive_sde",
    "linear_crossover": "benchmarks.linear_crossover",
    "ensemble_lanes": "benchmarks.ensemble_lanes",
    "materialise_seed": "benchmarks.materialise:plot_seed",
    "stiff_device": "benchmarks.stiff_device",
    "stiff_device_quick": "benchmarks.stiff_device",
    "adaptive_sde_breakdown": "benchmarks.adaptive_sde:plot_breakdown",
    "adaptive_sde_breakdown_quick": "benchmarks.adaptive_sde:plot_breakdown",
    "xla_cpu_flags": "benchmarks.xla_cpu_flags",
}


def derived(data: dict) -> dict:
    """`data` (one JSON result) with its derived numbers (ratios, summaries) recomputed from
    its timings by its benchmark's `derive`; unchanged for a benchmark without one."""
    # "module:function": a plot drawn by another benchmark's module, whose `derive` is that
    # benchmark's, not this one's.
    module, _, function = PLOTTERS.get(data["benchmark"], "").partition(":")
    derive = (
        getattr(importlib.import_module(module), "derive", None)
        if module and not function
        else None
    )
    return derive(data) if derive else data


def rederive():
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        new = derived(data)
        if new != data:
            path.write_text(json.dumps(new, indent=2, default=float) + "\n")
            print(f"rederived {path}")


def replot():
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        module, _, function = PLOTTERS.get(data["benchmark"], "").partition(":")
        if module:
            plot = getattr(importlib.import_module(module), function or "plot")
            plot(data["rows"], out=path.with_suffix(".png"))
            print(f"drew {path.with_suffix('.png')}")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__)
    parser.add_argument("--plots", action="store_true", help="also redraw the plots")
    parser.add_argument(
        "--rederive",
        action="store_true",
        help="first recompute the ratios and summaries in the JSON from its timings",
    )
    ns = parser.parse_args(argv)
    if ns.rederive:
        rederive()
    DOCS.write_text(render())
    print(f"wrote {DOCS}")
    README.write_text(update_readme(README.read_text()))
    print(f"wrote {README}")
    pieces = figures()
    for path in QUOTING:
        text = path.read_text()
        if fill(text, pieces) != text:
            path.write_text(fill(text, pieces))
            print(f"updated the generated figures in {path.relative_to(ROOT)}")
    if ns.plots:
        replot()


if __name__ == "__main__":
    main()
