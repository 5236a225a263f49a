"""The cost of one jitted SDE step: `diffrax_linearize`'s Milstein solvers against
Diffrax's Milstein, Euler(-Maruyama) and Euler-Heun solvers.

Three diffusions, each with d = m (state dimension = number of Brownian channels):

- `diagonal`: a `ControlTerm` whose vector field returns
  `lineax.DiagonalLinearOperator(sigma * y)` (diagonal noise);
- `row_scaled`: the dense matrix `g_ij = y_i G_ij` (commutative noise);
- `dense_linear`: `g(y) = A y` with a dense `A` of shape `(d, m, d)`.

The drift is `-y`. Each cell calls `solver.init` and then times `solver.step` alone
(with an `UnsafeBrownianPath`, so that drawing the increment is one `normal`), jitted,
compile time separately. A cell is skipped when its estimate from the previous size
says it would take longer than 30 s. Run with `python -m benchmarks.step_cost [--quick]`.
"""

import argparse
import math
import pathlib
import sys


if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import diffrax as dfx
import diffrax_linearize as dl
import jax
import jax.numpy as jnp
import jax.random as jr
import lineax as lx

from benchmarks._common import (
    fmt_ratio,
    fmt_spread,
    markdown_table,
    save_plot,
    time_contenders,
    write_results,
)


NAME = "step_cost"
SIZES = (16, 64, 256, 1024)
QUICK_SIZES = (16, 64)
BUDGET_S = 30.0
T0, T1 = 0.0, 0.01

SOLVERS = {
    "ours_ito": dl.ItoMilstein(),
    "ours_strat": dl.StratonovichMilstein(),
    "diffrax_ito": dfx.ItoMilstein(),
    "diffrax_strat": dfx.StratonovichMilstein(),
    "euler": dfx.Euler(),
    "euler_heun": dfx.EulerHeun(),
}
# The largest growth exponent of step cost in d = m used to extrapolate to the next size:
# the d x m x m tensor that `diffrax.ItoMilstein` builds is d^3. (Small sizes are dominated
# by fixed overheads, so a slope measured from them can exceed this; it is capped.)
_DEFAULT_EXPONENT = 3.0


def _diagonal_vf(t, y, sigma):
    return lx.DiagonalLinearOperator(sigma * y)


def _row_scaled_vf(t, y, G):
    return y[:, None] * G


def _dense_linear_vf(t, y, A):
    return jnp.einsum("imk,k->im", A, y)


def _params(diffusion: str, d: int, key):
    scale = 0.5 / math.sqrt(d)
    if diffusion == "diagonal":
        return 0.5 * jr.uniform(key, (d,))
    if diffusion == "row_scaled":
        return scale * jr.normal(key, (d, d))
    if diffusion == "dense_linear":
        # Slice by slice: at d = 1024 `A` is 4 GiB in float32, and drawing it at once
        # would hold its random bits and their transforms beside it.
        return jax.lax.map(lambda k: scale * jr.normal(k, (d, d)) / math.sqrt(d), jr.split(key, d))
    raise ValueError(diffusion)


DIFFUSIONS = {
    "diagonal": _diagonal_vf,
    "row_scaled": _row_scaled_vf,
    "dense_linear": _dense_linear_vf,
}


def _drift(t, y, args):
    return -y


def make_step(solver, vf, d: int):
    """One step of `solver`, as a function of arrays only (for `jax.jit`)."""

    def step(y0, params, key):
        bm = dfx.UnsafeBrownianPath((d,), key)
        terms = dfx.MultiTerm(dfx.ODETerm(_drift), dfx.ControlTerm(vf, bm))
        state = solver.init(terms, T0, T1, y0, params)
        y1, _, _, _, _ = solver.step(terms, T0, T1, y0, params, state, False)
        return y1

    return step


def _estimate_s(history: list[tuple[int, float, float]], d: int) -> float | None:
    """Estimated compile + warm-up + one timed run at size `d`, from earlier sizes."""
    if not history:
        return None
    d_prev, compile_prev, run_prev = history[-1]
    exponent = _DEFAULT_EXPONENT
    if len(history) >= 2:
        d_prev2, _, run_prev2 = history[-2]
        if run_prev > 0 and run_prev2 > 0:
            measured = math.log(run_prev / run_prev2) / math.log(d_prev / d_prev2)
            exponent = min(max(measured, 1.0), _DEFAULT_EXPONENT)
    ratio = d / d_prev
    return compile_prev * ratio + 2 * run_prev * ratio**exponent


def _skip_reason(diffusion: str, d: int) -> str | None:
    # Nothing is skipped for its size alone: at d = 1024 dense_linear's `A` has d*m*d =
    # 2^30 entries (4 GiB in float32), which a 24 GiB machine holds; the solvers that would
    # form more (Diffrax's Itô Milstein, through `jax.jacfwd`) are skipped by the budget.
    del diffusion, d
    return None


def run(
    quick: bool = False,
    sizes: tuple[int, ...] | None = None,
    diffusions: tuple[str, ...] | None = None,
) -> list[dict]:
    sizes = sizes or (QUICK_SIZES if quick else SIZES)
    diffusions = diffusions or tuple(DIFFUSIONS)
    rows = []
    for diffusion in diffusions:
        vf = DIFFUSIONS[diffusion]
        history: dict[str, list[tuple[int, float, float]]] = {s: [] for s in SOLVERS}
        for d in sizes:
            y0 = jnp.ones(d)
            params = _params(diffusion, d, jr.key(0))
            key = jr.key(1)
            to_time = {}
            for solver_name, solver in SOLVERS.items():
                row = {"diffusion": diffusion, "d": d, "m": d, "solver": solver_name}
                reason = _skip_reason(diffusion, d)
                estimate = _estimate_s(history[solver_name], d)
                if reason is None and estimate is not None and estimate > BUDGET_S:
                    who = "diffrax" if solver_name.startswith("diffrax") else solver_name
                    reason = f"{who} > {BUDGET_S:.0f} s"
                    row["estimate_s"] = estimate
                if reason is not None:
                    row["skipped"] = reason
                    rows.append(row)
                    print(f"{diffusion:>12} d={d:<5} {solver_name:>13}: skipped ({reason})")
                    continue
                to_time[solver_name] = (make_step(solver, vf, d), (y0, params, key))
                rows.append(row)
            # All solvers of a cell timed against each other, interleaved: the ratios are
            # what matter, and interleaving keeps a drifting machine from biasing them.
            timings = time_contenders(to_time, repeats=21, max_time=BUDGET_S)
            for row in rows:
                if row["diffusion"] == diffusion and row["d"] == d and row["solver"] in timings:
                    timing = timings[row["solver"]]
                    row.update(timing)
                    history[row["solver"]].append((d, timing["compile_s"], timing["run_min_s"]))
                    print(
                        f"{diffusion:>12} d={d:<5} {row['solver']:>13}: "
                        f"run {fmt_spread(timing):>16}, "
                        f"compile {timing['compile_s']:6.2f} s",
                        flush=True,
                    )
            del params
    rows = derive({"rows": rows})["rows"]
    print()
    print(table(rows))
    path = write_results(
        NAME,
        rows,
        quick=quick,
        dtype=str(jnp.zeros(()).dtype),
        step=f"[{T0}, {T1}]",
        note=(
            "One jitted `solver.step` (after `solver.init`), UnsafeBrownianPath, "
            "d = m; the solvers of a cell timed interleaved (round-robin). `run_min_s` is "
            "the fastest round, `run_s` the median and `run_max_s` the slowest (the "
            "spread). `ratio_to_euler` is run_min_s / run_min_s of diffrax.Euler at the "
            "same cell. Skipped cells say why."
        ),
    )
    print(f"\nwrote {path}")
    plot(rows)
    return rows


def derive(data: dict) -> dict:
    """`data` with each step's time over Euler's at the same cell recomputed."""
    rows = [{k: v for k, v in r.items() if k != "ratio_to_euler"} for r in data["rows"]]
    euler = {
        (r["diffusion"], r["d"]): r["run_min_s"]
        for r in rows
        if r["solver"] == "euler" and "run_min_s" in r
    }
    for r in rows:
        base = euler.get((r["diffusion"], r["d"]))
        if base and "run_min_s" in r:
            r["ratio_to_euler"] = r["run_min_s"] / base
    return dict(data, rows=rows)


def table(rows: list[dict]) -> str:
    """Step times (fastest interleaved round, with its spread), one line per (diffusion, d),
    one column per solver; then the ratios, each ours over the other's, from the fastest
    rounds; then compile times. Each table at most eight columns."""
    cells: dict[tuple[str, int], dict] = {}
    for r in rows:
        cell = cells.setdefault(
            (r["diffusion"], r["d"]), {"diffusion": r["diffusion"], "d": r["d"]}
        )
        if "run_s" in r:
            cell[r["solver"]] = fmt_spread(r)
            cell[f"{r['solver']}_min"] = r.get("run_min_s", r["run_s"])
            cell[f"{r['solver']}_compile_s"] = r["compile_s"]
        else:
            cell[r["solver"]] = None
    for cell in cells.values():
        ratio = lambda a, b: (  # noqa: E731
            fmt_ratio(cell[f"{a}_min"] / cell[f"{b}_min"])
            if cell.get(f"{a}_min") and cell.get(f"{b}_min")
            else None
        )
        cell["ito_vs_euler"] = ratio("ours_ito", "euler")
        cell["ito_vs_diffrax"] = ratio("ours_ito", "diffrax_ito")
        cell["strat_vs_diffrax"] = ratio("ours_strat", "diffrax_strat")
        cell["strat_vs_euler_heun"] = ratio("ours_strat", "euler_heun")
    head = [("diffusion", "diffusion"), ("d", "d = m")]
    columns = head + [(s, s) for s in SOLVERS]
    ratio_columns = head + [
        ("ito_vs_diffrax", "ours_ito / diffrax_ito"),
        ("strat_vs_diffrax", "ours_strat / diffrax_strat"),
        ("ito_vs_euler", "ours_ito / euler"),
        ("strat_vs_euler_heun", "ours_strat / euler_heun"),
    ]
    compile_columns = head + [(f"{s}_compile_s", f"{s} compile") for s in SOLVERS]
    skipped = [
        f"- {r['diffusion']} d={r['d']} {r['solver']}: {r['skipped']}"
        for r in rows
        if "skipped" in r
    ]
    out = [
        "Step time: the fastest of the interleaved rounds, and in brackets how far the "
        "median round lay above it (the spread):",
        "",
        markdown_table(list(cells.values()), columns),
        "",
        "Ratios of the fastest rounds, ours / the other's (below 1: ours is faster):",
        "",
        markdown_table(list(cells.values()), ratio_columns),
        "",
        "Compile time:",
        "",
        markdown_table(list(cells.values()), compile_columns),
    ]
    if skipped:
        out += ["", "Skipped (a dash above):", *skipped]
    return "\n".join(out)


# The solvers as a reader knows them (the JSON keeps the short keys of SOLVERS).
LABELS = {
    "ours_ito": "diffrax_linearize.ItoMilstein",
    "ours_strat": "diffrax_linearize.StratonovichMilstein",
    "diffrax_ito": "diffrax.ItoMilstein",
    "diffrax_strat": "diffrax.StratonovichMilstein",
    "euler": "diffrax.Euler",
    "euler_heun": "diffrax.EulerHeun",
}
TITLES = {
    "diagonal": "diagonal noise (lineax.DiagonalLinearOperator)",
    "row_scaled": "g_ij = y_i G_ij",
    "dense_linear": "g(y) = A y (dense)",
}


def plot(rows: list[dict], out: pathlib.Path | None = None) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    diffusions = list(dict.fromkeys(r["diffusion"] for r in rows))
    fig, axes = plt.subplots(1, len(diffusions), figsize=(5 * len(diffusions), 4), squeeze=False)
    for ax, diffusion in zip(axes[0], diffusions):
        for solver_name in SOLVERS:
            # The fastest round, as the benchmarks page quotes (a median of a microsecond
            # step carries the machine's load).
            points = [
                (r["d"], r["run_min_s"])
                for r in rows
                if r["diffusion"] == diffusion and r["solver"] == solver_name and "run_s" in r
            ]
            if points:
                ds, ts = zip(*points)
                style = "-" if solver_name.startswith("ours") else "--"
                ax.plot(ds, ts, style, marker="o", label=LABELS.get(solver_name, solver_name))
        skipped = {
            (r["d"], r["skipped"]) for r in rows if r["diffusion"] == diffusion and "skipped" in r
        }
        for d, why in sorted(skipped):
            ax.text(
                0.02, 0.98, f"d = {d} not run: {why}", transform=ax.transAxes, va="top", fontsize=7
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(TITLES.get(diffusion, diffusion))
        ax.set_xlabel("d = m")
        ax.set_ylabel("one step, fastest round (s)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("One jitted SDE step (solid: ours)")
    path = save_plot(fig, NAME, out)
    print(f"wrote {path}")
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="d = m in {16, 64} only")
    parser.add_argument("--sizes", type=int, nargs="+", help="override the sizes d = m to run")
    parser.add_argument("--diffusions", nargs="+", choices=list(DIFFUSIONS), help="a subset to run")
    ns = parser.parse_args(argv)
    run(
        quick=ns.quick,
        sizes=tuple(ns.sizes) if ns.sizes else None,
        diffusions=tuple(ns.diffusions) if ns.diffusions else None,
    )


if __name__ == "__main__":
    main()
