"""Refilling lanes against fixed batches: `solve_ensemble(lanes=L)` against
`solve_ensemble(chunk_size=L)` (a `jax.vmap` of `diffrax.diffeqsolve` over each batch of L
paths), time per path at equal rtol, on the double well of `benchmarks/adaptive_sde.py`
(`diffrax_linearize.ItoMilstein` with its PI controller, a `VirtualBrownianTree` per path),
as it is and with a per-path rate (the drift times a rate drawn log-uniformly from
[1, 30], so that paths differ much in their step counts).

A vmapped adaptive solve steps every batch until its slowest path is done; the lanes take a
new path as soon as theirs finishes. The loop iterations each schedule needs follow from the
per-path step counts (the same for both, which is checked): for the batches the sum over
batches of the most steps in the batch; for the lanes a simulation of the queue (each
finished lane takes the next path). The ratio of the two times, against the ratio of their
iterations, gives what an iteration of the lanes' loop costs against one of the vmapped
loop (the refill bookkeeping: the lane-wise selects, the scatter of finished paths, the
restarts).

Run: `python -m benchmarks.ensemble_lanes [--quick]`. Writes JSON to the results directory
(`$DIFFRAX_LINEARIZE_RESULTS`) and prints the table.
"""

import argparse
import heapq

import diffrax as dfx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np


jax.config.update("jax_enable_x64", True)

import diffrax_linearize as dl  # noqa: E402

from benchmarks._common import (  # noqa: E402
    fmt_ratio,
    markdown_table,
    plot_path,
    time_contenders_output,
    write_results,
)
from benchmarks.adaptive_sde import CONTROLLER, M, PROBLEMS, T1  # noqa: E402


PROBLEM = PROBLEMS["double well, noise burst"]
BM_TOL = T1 / 2**14


def _terms(key):
    bm = dfx.VirtualBrownianTree(
        0.0, T1, tol=BM_TOL, shape=(M,), key=key, levy_area=dfx.SpaceTimeLevyArea
    )
    return dfx.MultiTerm(dfx.ODETerm(PROBLEM["f"]), dfx.ControlTerm(PROBLEM["g"], bm))


def _rate_terms(key):
    bm = dfx.VirtualBrownianTree(
        0.0, T1, tol=BM_TOL, shape=(M,), key=key, levy_area=dfx.SpaceTimeLevyArea
    )
    drift = dfx.ODETerm(lambda t, y, rate: rate * PROBLEM["f"](t, y, None))
    return dfx.MultiTerm(drift, dfx.ControlTerm(PROBLEM["g"], bm))


def _solve(schedule: str, width: int, rtol: float, rates):
    kwargs = dict(lanes=width) if schedule == "lanes" else dict(chunk_size=width)

    def solve(keys):
        out = dl.solve_ensemble(
            _terms if rates is None else _rate_terms,
            PROBLEM["ours"],
            0.0,
            T1,
            None,
            jnp.asarray(PROBLEM["y0"]),
            rates,
            batch_args=rates is not None,
            keys=keys,
            reductions=("mean",),
            stepsize_controller=dfx.PIDController(rtol=rtol, atol=rtol, **CONTROLLER),
            max_steps=2**14,
            throw=False,
            **kwargs,
        )
        return out.paths.ys[:, -1], out.paths.stats["num_steps"], out.num_failed

    return solve


def batch_iterations(steps: np.ndarray, width: int) -> int:
    """Loop iterations of `lax.map` over batches of `width` paths, each a vmapped solve."""
    pad = -len(steps) % width
    padded = np.concatenate([steps, np.full(pad, steps[0])])
    return int(padded.reshape(-1, width).max(axis=1).sum())


def lane_iterations(steps: np.ndarray, width: int) -> int:
    """Loop iterations of `width` lanes taking paths in order as they finish."""
    free = [0] * min(width, len(steps))
    heapq.heapify(free)
    end = 0
    for s in steps:
        start = heapq.heappop(free)
        end = max(end, start + int(s))
        heapq.heappush(free, start + int(s))
    return end


def run(quick: bool = False) -> list[dict]:
    num_paths = 64 if quick else 256
    widths = (16,) if quick else (16, 64)
    rtols = (1e-2,) if quick else (1e-2, 1e-3)
    keys = jr.split(jr.key(0), num_paths)
    rates = jnp.exp(jr.uniform(jr.key(1), (num_paths,), minval=0.0, maxval=jnp.log(30.0)))
    rows = []
    for variant, rates_ in (("double well", None), ("double well, rate in [1, 30]", rates)):
        for rtol in rtols:
            for width in widths:
                rows.append(_compare(variant, keys, rates_, rtol, width))
                print(rows[-1], flush=True)
    name = "ensemble_lanes_quick" if quick else "ensemble_lanes"
    write_results(name, rows, quick=quick)
    plot(rows, out=plot_path(name))
    print(table(rows))
    return rows


def _compare(variant, keys, rates, rtol, width) -> dict:
    num_paths = keys.shape[0]
    fns = {s: (_solve(s, width, rtol, rates), (keys,)) for s in ("vmap batches", "lanes")}
    outputs, timings = time_contenders_output(fns, repeats=5, max_time=60.0)
    (y_b, steps_b, fail_b), (y_l, steps_l, fail_l) = (
        outputs["vmap batches"],
        outputs["lanes"],
    )
    steps = np.asarray(steps_b)
    # Same steps, same values: the schedule changes only the order of the work.
    assert np.array_equal(steps, np.asarray(steps_l))
    assert np.allclose(np.asarray(y_b), np.asarray(y_l), rtol=1e-10, atol=1e-12)
    assert int(fail_b) == int(fail_l) == 0
    it_b, it_l = batch_iterations(steps, width), lane_iterations(steps, width)
    t_b = timings["vmap batches"]["run_min_s"]
    t_l = timings["lanes"]["run_min_s"]
    return dict(
        problem=variant,
        rtol=rtol,
        width=width,
        paths=num_paths,
        mean_steps=float(steps.mean()),
        max_over_mean_steps=float(steps.max() / steps.mean()),
        iterations_batches=it_b,
        iterations_lanes=it_l,
        ideal_iterations=float(steps.sum() / width),
        time_per_path_batches_s=t_b / num_paths,
        time_per_path_lanes_s=t_l / num_paths,
        ratio_lanes_over_batches=t_l / t_b,
        cpu_ratio_lanes_over_batches=timings["lanes"]["cpu_s"] / timings["vmap batches"]["cpu_s"],
        iteration_cost_lanes_over_batches=(t_l / it_l) / (t_b / it_b),
        compile_batches_s=timings["vmap batches"]["compile_s"],
        compile_lanes_s=timings["lanes"]["compile_s"],
    )


def table(rows: list[dict]) -> str:
    """The recorded rows as the benchmarks page shows them."""
    shown = [
        dict(
            problem=r["problem"],
            rtol=f"{r['rtol']:g}",
            width=r["width"],
            spread=f"{r['max_over_mean_steps']:.2f}",
            iterations=f"{r['iterations_batches']} / {r['iterations_lanes']}",
            time=fmt_ratio(r["ratio_lanes_over_batches"]),
            per_iteration=fmt_ratio(r["iteration_cost_lanes_over_batches"]),
        )
        for r in rows
    ]
    return markdown_table(
        shown,
        [
            ("problem", "SDE"),
            ("rtol", "rtol"),
            ("width", "lanes = batch"),
            ("spread", "max / mean steps"),
            ("iterations", "loop iterations, batches / lanes"),
            ("time", "time lanes / batches"),
            ("per_iteration", "per iteration lanes / batches"),
        ],
    )


def plot(rows: list[dict], out=None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['problem']}\nrtol {r['rtol']:g}, L = {r['width']}" for r in rows]
    xs = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(xs - 0.2, [r["ratio_lanes_over_batches"] for r in rows], 0.4, label="time")
    ax.bar(
        xs + 0.2,
        [r["iterations_lanes"] / r["iterations_batches"] for r in rows],
        0.4,
        label="loop iterations",
    )
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(xs, labels, fontsize=7)
    ax.set_ylabel("lanes / vmapped batches (below 1: lanes cheaper)")
    ax.set_title(f"solve_ensemble(lanes=L) against batches of L paths, {rows[0]['paths']} paths")
    ax.legend()
    fig.tight_layout()
    if out is not None:
        fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    run(quick=parser.parse_args(argv).quick)


if __name__ == "__main__":
    main()
