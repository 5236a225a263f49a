"""Write `docs/benchmarks.md`, the README's table of measured numbers, and the figures
quoted in the guides (between `<!-- generated:NAME -->` and `<!-- /generated:NAME -->`)
from the JSON results in `benchmarks/results/`, so that none can drift from them.

    python -m benchmarks.report            # docs/benchmarks.md and README.md
    python -m benchmarks.report --plots    # also redraw the PNG plots from the JSON
    python -m benchmarks.report --rederive # first recompute ratios and summaries in the JSON

Every benchmark gets a section. When more than one machine recorded it (CPU and GPU), the
section opens with a side-by-side table: one line per case, its run and compile time on
each machine. Then one full table per machine, with the versions and machine each result
came from.
"""

import argparse
import importlib
import json
import pathlib
import re

from benchmarks._common import fmt_time, markdown_table, RESULTS


ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
# The files with generated figures in them.
QUOTING = (ROOT / "README.md", ROOT / "docs" / "ensembles.md")

TITLES = {
    "step_cost": "Step cost of one SDE step",
    "materialise": "materialise against jax.jacfwd",
    "structure": "Sparse structure in vector fields, against jax.jacfwd and asdex",
    "stiff": "Stiff ODEs and SDEs: structured root finders and drift-implicit Milstein",
    "adjoint": "Backsolve adjoint",
    "squared_grads": "Squared per-example gradients",
    "work_precision": "Work-precision on non-commutative noise",
    "ensemble": "Ensembles: throughput against devices and processes",
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
}


def _cell(key, value):
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if key.endswith("_s"):
            return fmt_time(value)
        return f"{value:.3g}"
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)


def _table(rows) -> str:
    columns: list[str] = []
    for row in rows:
        for key in row:
            if key not in columns:
                columns.append(key)
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_cell(k, row.get(k)) for k in columns) + " |")
    return "\n".join(lines)


def _side_by_side(name: str, results: list) -> list[str]:
    """Run and compile times of each case on each machine, one line per case."""
    keys = CASE_KEYS.get(name)
    if keys is None or len(results) < 2:
        return []
    labels = [path.stem.removeprefix(f"{name}-") for path, _ in results]
    joined: dict[tuple, dict] = {}
    for label, (_, data) in zip(labels, results):
        for row in data.get("rows", []):
            case = joined.setdefault(tuple(row.get(k) for k in keys), {k: row.get(k) for k in keys})
            case[f"{label}:run_s"] = row.get("run_s")
            case[f"{label}:compile_s"] = row.get("compile_s")
    columns = [(k, k) for k in keys] + [
        (f"{label}:{what}_s", f"{what} ({label})")
        for label in labels
        for what in ("run", "compile")
    ]
    return ["### Side by side", "", markdown_table(list(joined.values()), columns), ""]


def _ratios(ratios: dict) -> list[str]:
    """The materialise benchmark's acceptance ratios, `"what (want >= x)": value`."""
    rows = []
    for key, value in ratios.items():
        match = re.fullmatch(r"(.*) \(want (<=|>=) ([\d.]+)\)", key)
        what, op, bound = match.groups() if match else (key, None, None)
        met = (
            None if op is None else (value >= float(bound) if op == ">=" else value <= float(bound))
        )
        rows.append(
            dict(what=what, value=f"{value:.3g}", want=f"{op} {bound}" if op else "—", met=met)
        )
    return [_table(rows), ""]


def _work_precision_summary(data: dict) -> list[str]:
    noisy = _noisy(data)
    rows = []
    for s in data["summary"]:
        series = sorted(
            (r for r in data["rows"] if (r["m"], r["method"]) == (s["m"], s["method"])),
            key=lambda r: r["steps"],
        )
        # An extrapolation runs along the last three points: say if one of them is noisy.
        used = {(s["m"], s["method"], r["steps"]) for r in series[-3:]}
        how = "extrapolated" if s["extrapolated"] else "interpolated"
        if s["extrapolated"] and used & set(noisy):
            how += ", from a noisy timing"
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
        ("run_s", "time per path there"),
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
            + '. The costs marked "from a noisy timing" (here, the order of the two '
            "commutative Milstein solvers at m = 50) are not to be relied on.",
            "",
        ]
    return out


def _noisy(data: dict) -> dict:
    from benchmarks.work_precision import noisy_points

    return noisy_points(data["rows"])


def _notes(name: str, data: dict) -> list[str]:
    """The recorded notes beside the rows: small values as a list, tables as tables."""
    out, listed = [], []
    for key, value in data.items():
        if key in ("benchmark", "machine", "rows"):
            continue
        if name == "materialise" and key == "ratios":
            out += ["Acceptance ratios:", ""] + _ratios(value)
        elif name == "work_precision" and key == "summary":
            out += _work_precision_summary(data)
        elif name == "structure" and key == "summary":
            from benchmarks.structure import COLUMNS

            out += ["Side by side, per field and size:", "", markdown_table(value, COLUMNS), ""]
        elif name == "stiff" and key == "summary":
            from benchmarks.stiff import SUMMARY_COLUMNS

            out += ["Per solve:", "", markdown_table(value, SUMMARY_COLUMNS), ""]
        else:
            listed.append(f"- {key}: {_cell(key, value)}")
    return (listed + [""] if listed else []) + out


def _annotated_rows(name: str, data: dict) -> list[dict]:
    rows = data.get("rows", [])
    if name == "work_precision":
        noisy = _noisy(data)
        return [
            dict(
                r,
                noisy=(
                    f"{noisy[c]:.1f}x"
                    if (c := (r["m"], r["method"], r["steps"])) in noisy
                    else None
                ),
            )
            for r in rows
        ]
    return rows


def _machine_line(m) -> str:
    v = m.get("versions", {})
    versions = ", ".join(f"{k} {v[k]}" for k in sorted(v) if v[k])
    return (
        f"{m.get('platform', '?')} / {m.get('device', '?')} ({m.get('cpu_count')} CPU cores, "
        f"{m.get('device_count')} device(s)), Python {m.get('python')}, {versions}; "
        f"recorded {m.get('date')}"
    )


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
        "edit by hand. Times are medians of repeats after compilation; compile times are "
        "reported separately. Plots are the PNG files beside the JSON.",
        "",
    ]
    for name in sorted(by_bench):
        out += [f"## {TITLES.get(name, name)}", ""]
        out += _side_by_side(name, by_bench[name])
        for path, data in by_bench[name]:
            out += [f"### {path.stem}", "", _machine_line(data.get("machine", {})), ""]
            out += _notes(name, data)
            out += [_table(_annotated_rows(name, data)), ""]
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
        return {"ensemble-summary": missing, "ensemble-table": f"\n\n({missing}.)\n\n"}
    data = json.loads(paths[0].read_text())
    table = ensemble.table(rows)
    source = f"`benchmarks/results/{paths[0].name}`; {_machine_line(data['machine'])}."
    return {
        "ensemble-summary": ensemble.summary(rows),
        "ensemble-table": f"\n\n{table}\n\nFrom {source}\n\n",
    }


def figures() -> dict[str, str]:
    """The generated figures, by name."""
    return _ensemble_figures()


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


def readme_table() -> str:
    """The README's table of headline numbers, each read from the recorded JSON."""
    mat, step, wp = _load("materialise"), _load("step_cost"), _load("work_precision")
    adj, sq = _load("adjoint"), _load("squared_grads")
    t = lambda data, key="run_s", **match: _fmt3(_row(data, **match)[key])  # noqa: E731
    rows = []
    ours = _row(mat, problem="A @ x", N=2000, method="ours")
    rows.append(
        (
            "`materialise(lambda x: A @ x)`, N=2000",
            f"{_fmt3(ours['run_s'])} (bit-equal to `A`)",
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
        r = _row(step, diffusion=diffusion, d=d, solver="ours_ito")
        rows.append(
            (
                f"Itô Milstein step, {what}",
                f"{_fmt3(r['run_s'])} ({r['ratio_to_euler']:.1f}x Euler)",
                f"`diffrax.ItoMilstein` {t(step, diffusion=diffusion, d=d, solver='diffrax_ito')}",
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
        how = "extrapolated, " if e["extrapolated"] else ""
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
            f"{_fmt3(r['run_s'])}, {_mib(r['scratch_MiB'])} {same}".strip(),
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
            f"{_fmt3(combined['run_s'])} ({_x(combined['time_vs_grad'])} `value_and_grad`)",
            f"`vmap(grad)` {_fmt3(vmap['run_s'])}, {_mib(vmap['scratch_MiB'])} scratch",
        )
    )
    norms = _row(sq, model="mlp", B=1024, method="per_example_grad_norms")
    rows.append(
        (
            "per-example gradient norms, same MLP",
            f"{_fmt3(norms['run_s'])} ({_x(norms['time_vs_grad'])} `value_and_grad`)",
            f"`vmap(grad)` {t(sq, model='mlp', B=1024, method='vmap(grad) norms')}",
        )
    )
    tc = _row(sq, model="transformer", B=1024, method="value_grad_and_sum_squared_grads")
    tv = _row(sq, model="transformer", B=1024, method="vmap(grad) squares")
    rows.append(
        (
            "the same three, transformer block (64 positions, width 128), B=1024",
            f"{_fmt3(tc['run_s'])} ({_x(tc['time_vs_grad'])} `value_and_grad`)",
            f"`vmap(grad)` squares alone {_fmt3(tv['run_s'])}",
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
        f"Recorded {m['date'][:10]} with jax {v['jax']}, diffrax {v['diffrax']}, equinox "
        f"{v['equinox']}, lineax {v['lineax']}, Python {m['python']}, on this project's "
        f"{m['cpu_count']}-core {m['machine']} CI-class machine (JSON and plots in "
        "`benchmarks/results/`)."
    )
    lines = [head, "", "| what | ours | reference |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


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
}


def derived(data: dict) -> dict:
    """`data` (one JSON result) with its derived numbers (ratios, summaries) recomputed from
    its timings by its benchmark's `derive`; unchanged for a benchmark without one."""
    module = PLOTTERS.get(data["benchmark"])
    derive = getattr(importlib.import_module(module), "derive", None) if module else None
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
        module = PLOTTERS.get(data["benchmark"])
        if module is not None:
            importlib.import_module(module).plot(data["rows"], out=path.with_suffix(".png"))
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
