"""Robertson x N and the 2D Brusselator of `benchmarks.stiff_peers` on an accelerator (GPU or
TPU), beside the CPU of the same machine, in one run: issue 23's device rows.

Float32, JAX's default, on every device: the state, the tolerances and Diffrax's times. (A
TPU compiles no float64 Diffrax solve: its compiler rejects the `nextafter` Diffrax applies
to float64 times. The run tries one first and records the error, per device, as
`float64_compile_error` in its JSON.)
Tolerances rtol 1e-4 and 1e-5 (atol = rtol / 100, as `stiff_peers`), within what float32
resolves. Not 1e-3: at atol 1e-5 Robertson's middle species (1e-5 and below) is unresolved,
a concentration turns negative and grows without bound, in float64 as in float32 (ours BDF
var at rtol 1e-3 ends at y_1 = -2.1e6 in float64, N = 1 or 1000; in float32 at N = 1000 it
accepts 253 steps to t = 8.2e9, then rejects to `max_steps`; CVODE's float64 solves of
`stiff_peers` at rtol 1e-4, N >= 1000, end with negative digits for the same reason). Accuracy
as there, the significant correct digits (mescd) against a float64
reference solved by scipy on the host (Radau at rtol 1e-12 for one Robertson system, tiled;
BDF with the sparse Jacobian pattern at rtol 1e-9 for the Brusselator).

Contenders: ours `dl.BDF(max_order=5, variable_order=True)` ("ours BDF var") and
`dl.Rodas5P()`, with the controllers of `stiff_peers.controller_for`, each compiled once per
case and device (the tolerances are arguments) and timed interleaved, device and CPU of one
case and tolerance in one round-robin (`time_round_robin`: three rounds and at least 0.5 s
of timed solves each). The peers (CVODE, diffsol, casadi) are CPU libraries, run in float64
by `stiff_peers` on the project's 2-core machine: a comparison with them crosses machines
and precisions.

    python -m benchmarks.stiff_device [--quick]      # on a machine with an accelerator
    bash benchmarks/gpu.sh                           # runs it with the rest there

On a machine with no accelerator it runs the CPU alone (the CPU's rows of a device run are
the ones to compare: the same machine, interleaved). The result is written after every case,
so a run stopped at its time limit keeps the cases it finished.
"""

import argparse
import functools as ft
import time

import jax
import jax.numpy as jnp
import matplotlib
import matplotlib.ticker
import numpy as np
import scipy.integrate


matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks import stiff_peers
from benchmarks._common import (
    fmt_ratio,
    fmt_spread,
    machine,
    markdown_table,
    save_plot,
    time_round_robin,
    write_results,
)


METHODS = ("ours BDF var", "ours Rodas5P")
RTOLS = (1e-4, 1e-5)
RATIO = 1e-2  # atol = rtol * RATIO, as stiff_peers on these problems


def sizes(quick: bool = False) -> list[tuple[str, int]]:
    rober = (1, 1000) if quick else (1, 100, 10_000, 100_000)
    bruss = (16, 64) if quick else (16, 32, 64)
    return [("robertson", n) for n in rober] + [("brusselator_2d", n) for n in bruss]


@ft.cache
def _bruss_ref(n: int) -> np.ndarray:
    y0 = stiff_peers.bruss_y0(n)
    sol = scipy.integrate.solve_ivp(
        lambda t, y: stiff_peers.bruss_np(y), (0, 1), y0, method="BDF", rtol=1e-9,
        atol=1e-11, jac_sparsity=stiff_peers.bruss_sparsity(n),
    )  # fmt: skip
    return sol.y[:, -1]


def problem(name: str, size: int):
    """`(rhs_jnp, y0, t1, ref)` of one case."""
    from benchmarks.structure import brusselator_2d, robertson_stack

    if name == "robertson":
        return (
            robertson_stack,
            np.tile([1.0, 0, 0], size),
            1e10,
            np.tile(stiff_peers._rober_ref(), size),
        )
    return brusselator_2d, stiff_peers.bruss_y0(size), 1.0, _bruss_ref(size)


def devices() -> dict[str, jax.Device]:
    """The default device and, where that is an accelerator, the CPU beside it."""
    default = jax.devices()[0]
    out = {default.platform: default}
    if default.platform != "cpu":
        out["cpu"] = jax.devices("cpu")[0]
    return out


def float64_probe(device) -> str | None:
    """Whether a float64 solve (ours BDF var, Robertson N = 1) compiles on `device`: `None`
    if it does, else the error, shortened."""
    rhs, y0, t1, _ = problem("robertson", 1)
    jax.config.update("jax_enable_x64", True)
    try:
        make = stiff_peers._ours("ours BDF var")
        stiff_peers._jax_compiled(make, rhs, y0, t1, jnp.float64, device)
        return None
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:240]}"
    finally:
        jax.config.update("jax_enable_x64", False)


def run_case(name, size, where, quick=False):
    rhs, y0, t1, ref = problem(name, size)
    compiled = {}
    for method in METHODS:
        for dev_name, device in where.items():
            compiled[(method, dev_name)] = stiff_peers._jax_compiled(
                stiff_peers._ours(method), rhs, y0, t1, jnp.float32, device
            )
    rows = []
    for rtol in RTOLS[:1] if quick else RTOLS:
        atol = rtol * RATIO
        ready, info = {}, {}
        for (method, dev_name), (comp, compile_s) in compiled.items():
            call, finish, info[(method, dev_name)] = stiff_peers._jax_contender(
                comp, compile_s, y0, rtol, atol, jnp.float32, where[dev_name]
            )
            ready[f"{method} @ {dev_name}"] = (call, finish, method, dev_name)
        outputs, timings = time_round_robin(
            {k: v[0] for k, v in ready.items()}, repeats=3, min_time=0.5, max_time=20.0,
            warmup=False,
        )  # fmt: skip
        for key, (_, finish, method, dev_name) in ready.items():
            y, result = finish(outputs[key])
            row = {
                "problem": name, "size": size, "unknowns": int(np.size(y0)), "rtol": rtol,
                "atol": atol, "method": method, "device": dev_name,
                "device_kind": where[dev_name].device_kind, "dtype": "float32",
                **info[(method, dev_name)], **timings[key], **result,
                "mescd": stiff_peers.mescd(y, ref, rtol, atol),
            }  # fmt: skip
            rows.append(row)
            print(
                f"  {name} {size} rtol={rtol:g} {key}: {row['run_min_s']:.4g} s, "
                f"scd {row['mescd']:.3g}, steps {row['accepted_steps']}+{row['rejected_steps']}",
                flush=True,
            )
    return rows


def _summary(rows):
    """One row per case and contender at rtol 1e-4: the time on each device and the
    ratio accelerator / CPU (same machine, interleaved)."""
    out = []
    keyed = {(r["problem"], r["size"], r["rtol"], r["method"], r["device"]): r for r in rows}
    devs = sorted({r["device"] for r in rows}, key=lambda d: d == "cpu")
    for r in rows:
        if r["rtol"] != 1e-4 or r["device"] != devs[0]:
            continue
        s = {
            "case": f"{r['problem']} {r['size']} ({r['unknowns']} unknowns)",
            "method": r["method"],
            "steps": f"{r['accepted_steps']} + {r['rejected_steps']}",
            "scd": f"{r['mescd']:.1f}",
        }
        for d in devs:
            other = keyed.get((r["problem"], r["size"], r["rtol"], r["method"], d))
            s[d] = fmt_spread(other) if other else "—"
        if len(devs) > 1:
            cpu = keyed.get((r["problem"], r["size"], r["rtol"], r["method"], "cpu"))
            s["ratio"] = fmt_ratio(r["run_min_s"] / cpu["run_min_s"]) if cpu else "—"
        out.append(s)
    return out, devs


def summary_columns(devs):
    cols = [("case", "case"), ("method", "method")]
    cols += [(d, f"{d} (fastest run)") for d in devs]
    if len(devs) > 1:
        cols += [("ratio", f"{devs[0]} / cpu")]
    return cols + [("steps", "steps (acc. + rej.)"), ("scd", "scd")]


def derive(data: dict) -> dict:
    """`data` with its summary and table recomputed from its rows (`report --rederive`)."""
    summary, devs = _summary(data["rows"])
    table = markdown_table(summary, summary_columns(devs))
    return {**data, "summary": summary, "markdown_table": table}


def plot(rows, quick=False, out=None):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, name in zip(axes, ("robertson", "brusselator_2d")):
        for (method, dev), style in zip(
            sorted({(r["method"], r["device"]) for r in rows}), ("o-", "s--", "^-", "v--")
        ):
            pts = sorted(
                (r["unknowns"], r["run_min_s"])
                for r in rows
                if r["problem"] == name and r["rtol"] == 1e-4
                and r["method"] == method and r["device"] == dev
            )  # fmt: skip
            if pts:
                ax.loglog(*zip(*pts), style, label=f"{method} @ {dev}")
        ax.set_title(f"{name}, float32, rtol 1e-4")
        ax.set_xlabel("unknowns")
        ax.set_ylabel("time (fastest run) [s]")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return save_plot(fig, "stiff_device_quick" if quick else "stiff_device", out, dpi=100)


def run(quick: bool = False) -> list[dict]:
    jax.config.update("jax_enable_x64", False)
    name = "stiff_device_quick" if quick else "stiff_device"
    where = devices()
    probe = {d: float64_probe(dev) for d, dev in where.items()}
    print("float64 solve compiles:", {d: p or "yes" for d, p in probe.items()}, flush=True)
    here, rows = machine(), []
    for prob, size in sizes(quick):
        t0 = time.perf_counter()
        rows += run_case(prob, size, where, quick)
        print(f"{prob} {size}: {time.perf_counter() - t0:.0f} s", flush=True)
        record = dict(
            machine=dict(here), quick=quick, devices=list(where), float64_compile_error=probe,
            tolerances=list(RTOLS[:1] if quick else RTOLS), atol_over_rtol=RATIO,
        )  # fmt: skip
        derived = derive({**record, "rows": rows})
        table = derived["markdown_table"]
        path = write_results(name, rows, **record, summary=derived["summary"], markdown_table=table)
    print(table)
    print(f"\nResults: {path}\nPlot: {plot(rows, quick)}")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    ns = parser.parse_args(argv)
    run(ns.quick)


if __name__ == "__main__":
    main()
