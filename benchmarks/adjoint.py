"""Backsolve adjoints: `diffrax_linearize.BacksolveAdjoint` against `diffrax.BacksolveAdjoint`
and `diffrax.RecursiveCheckpointAdjoint`.

`jax.value_and_grad` of `sum(y(1)**2)` with respect to `y0` and the diffusion's parameter
`G`, for the SDE $dy = -\\theta y\\,dt + g(y) \\circ dW$ with $g_{ij} = y_i G_{ij}$ (d = m),
over `steps` constant steps, float32. The adjoints of a solver and size are timed
interleaved (round-robin); reports the fastest round with the spread (compile excluded),
every ratio ours over the other's of the fastest rounds, and XLA's scratch memory, also at
twice the steps: the backsolve adjoints need O(1) memory in
the number of steps, checkpointing (with `max_steps` = the number of steps) O(steps).
Diffrax's backsolve does not support `StratonovichMilstein` (its terms are a `MultiTerm`):
those rows say so.

    python -m benchmarks.adjoint [--quick]
"""

import argparse
import sys

import diffrax
import diffrax_linearize as dl
import equinox as eqx
import jax
import jax.numpy as jnp

from ._common import (
    fmt_spread,
    markdown_table,
    memory_scratch_bytes,
    save_plot,
    time_contenders,
    write_results,
)


class _Diffusion(eqx.Module):
    G: jax.Array

    def __call__(self, t, y, args):
        return y[:, None] * self.G


def _problem(d: int, solver, adjoint, steps: int):
    key_g, key_y, key_bm = jax.random.split(jax.random.key(0), 3)
    G = 0.5 * jax.random.normal(key_g, (d, d), jnp.float32) / jnp.sqrt(d)
    y0 = jax.random.normal(key_y, (d,), jnp.float32)
    dt = 1.0 / steps
    bm = diffrax.VirtualBrownianTree(0.0, 1.0, dt / 8, (d,), key=key_bm)
    theta = jnp.array(0.5, jnp.float32)

    def loss(y0, diffusion):
        terms = diffrax.MultiTerm(
            diffrax.ODETerm(lambda t, y, args: -args * y), diffrax.ControlTerm(diffusion, bm)
        )
        sol = diffrax.diffeqsolve(
            terms,
            solver,
            0.0,
            1.0,
            dt,
            y0,
            theta,
            adjoint=adjoint,
            saveat=diffrax.SaveAt(t1=True),
            max_steps=steps,
        )
        return jnp.sum(sol.ys[-1] ** 2)

    return jax.value_and_grad(loss, argnums=(0, 1)), (y0, _Diffusion(G))


_SOLVERS = {
    "ReversibleHeun": diffrax.ReversibleHeun,
    "Heun": diffrax.Heun,
    "StratonovichMilstein": dl.StratonovichMilstein,
}
_ADJOINTS = {
    "ours": dl.BacksolveAdjoint,
    "diffrax backsolve": diffrax.BacksolveAdjoint,
    "checkpoint": diffrax.RecursiveCheckpointAdjoint,
}


def _measure(solver_name: str, d: int, steps: int, max_time: float) -> list[dict]:
    """The rows of each adjoint for `solver_name` at size `d`, timed interleaved."""
    rows, contenders = {}, {}
    for adjoint_name, adjoint in _ADJOINTS.items():
        row = dict(solver=solver_name, adjoint=adjoint_name, d=d, steps=steps)
        rows[adjoint_name] = row
        fn, args = _problem(d, _SOLVERS[solver_name](), adjoint(), steps)
        try:
            jax.eval_shape(fn, *args)
        except Exception as e:  # diffrax's backsolve rejects MultiTerm solvers
            row["note"] = f"unsupported: {type(e).__name__}"
            continue
        contenders[adjoint_name] = (fn, args)
    timings = time_contenders(contenders, repeats=5, max_time=max_time)
    for adjoint_name, (fn, args) in contenders.items():
        row = rows[adjoint_name]
        row.update(timings[adjoint_name])
        row["scratch_MiB"] = memory_scratch_bytes(fn, *args) / 2**20
        fn2, args2 = _problem(d, _SOLVERS[solver_name](), _ADJOINTS[adjoint_name](), 2 * steps)
        row["scratch_2x_MiB"] = memory_scratch_bytes(fn2, *args2) / 2**20
    return list(rows.values())


def run(quick: bool = False) -> list[dict]:
    sizes = (64,) if quick else (64, 256)
    steps = 100
    rows = []
    for d in sizes:
        for solver_name in _SOLVERS:
            for row in _measure(solver_name, d, steps, max_time=5.0 if quick else 20.0):
                rows.append(row)
                print(row, file=sys.stderr, flush=True)
    rows = derive({"rows": rows})["rows"]
    columns = [
        ("solver", "solver"),
        ("adjoint", "adjoint"),
        ("d", "d = m"),
        ("run", "run (fastest, +median spread)"),
        ("compile_s", "compile"),
        ("scratch_MiB", "scratch MiB (100 steps)"),
        ("scratch_2x_MiB", "scratch MiB (200 steps)"),
        ("ours_over_diffrax", "ours / diffrax backsolve"),
        ("ours_over_checkpoint", "ours / checkpoint"),
        ("note", "note"),
    ]
    print(
        markdown_table(
            [dict(r, run=fmt_spread(r) if "run_s" in r else None) for r in rows], columns
        )
    )
    path = write_results(
        "adjoint",
        rows,
        steps=steps,
        dtype="float32",
        note=(
            "The adjoints of each solver and size timed interleaved (round-robin) after "
            "compiling: `run_min_s` is the fastest round, `run_s` the median and `run_max_s` "
            "the slowest (the spread). `ours_over_diffrax` and `ours_over_checkpoint` are "
            "ratios of the fastest rounds, ours over the other's."
        ),
    )
    print(f"\nresults: {path}")
    plot(rows)
    return rows


# Our run time over another adjoint's, on our rows, by that adjoint.
RATIOS = {"diffrax backsolve": "ours_over_diffrax", "checkpoint": "ours_over_checkpoint"}


def derive(data: dict) -> dict:
    """`data` with its ratios (our fastest round over each other adjoint's, per `d` and
    solver) recomputed from its timings."""
    rows = [{k: v for k, v in r.items() if k not in RATIOS.values()} for r in data["rows"]]
    for row in rows:
        if row["adjoint"] != "ours" or "run_s" not in row:
            continue
        for other in rows:
            key = RATIOS.get(other["adjoint"])
            if key and (other["d"], other["solver"]) == (row["d"], row["solver"]):
                if "run_s" in other:
                    row[key] = row["run_min_s"] / other["run_min_s"]
    return dict(data, rows=rows)


def plot(rows: list[dict], out=None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["d"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    short = {"StratonovichMilstein": "Stratonovich-\nMilstein"}
    labels = [f"{short.get(s, s)}\nd={d}" for d in sizes for s in _SOLVERS]
    width = 0.8 / len(_ADJOINTS)
    for k, adjoint_name in enumerate(_ADJOINTS):
        times, mems = [], []
        for d in sizes:
            for s in _SOLVERS:
                match = [
                    r for r in rows if (r["d"], r["solver"], r["adjoint"]) == (d, s, adjoint_name)
                ]
                r = match[0] if match else {}
                times.append(r.get("run_min_s", float("nan")) * 1e3)
                mems.append(
                    r.get("scratch_2x_MiB", float("nan")) / max(r.get("scratch_MiB", 1.0), 1e-9)
                )
        xs = [i + k * width for i in range(len(labels))]
        axes[0].bar(xs, times, width, label=adjoint_name)
        axes[1].bar(xs, mems, width, label=adjoint_name)
    for ax in axes:
        ax.set_xticks([i + width for i in range(len(labels))], labels, fontsize=7)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("value_and_grad, 100 steps, fastest round (ms)")
    axes[1].set_ylabel("scratch memory, 200 steps / 100 steps")
    axes[0].legend(fontsize=8)
    fig.suptitle("Backsolve adjoints (missing bars: unsupported)")
    save_plot(fig, "adjoint", out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="d = m = 64 only")
    run(quick=parser.parse_args().quick)
