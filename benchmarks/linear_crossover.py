"""Where dense LU overtakes the structured factorisations of `StructuredLinearSolver`.

For each operator kind that `materialise_operator` returns (block-diagonal with 4 x 4
blocks; banded with bandwidth 2; sparse with a POLLU-like irregular pattern of about 10
entries per row; sparse with a periodic 1D stencil, whose wrap-around entries make it
banded only after reordering) and each size `n`, three ways to solve `A x = b`:

- `structured`: `StructuredLinearSolver(dense_below=0)`, the structured path (batched block
  inversion, block-tridiagonal LU, the reverse Cuthill-McKee band, or GMRES);
- `dense LU`: the matrix made dense and factored by LAPACK's LU (`lineax.LU`), what
  Diffrax's default does and what `StructuredLinearSolver` does below `dense_below`;
- `dense GJ`: the dense matrix inverted by the Gauss-Jordan loop the block path uses.

Two costs each: a factorisation and one solve (`factor_solve`), and a solve with a
factorisation made beforehand (`solve`), as the stages of a Rosenbrock step or the
iterations of a chord method reuse it. Each is 64 repetitions in one `lax.fori_loop`
(the operator's values depend on the loop counter, so nothing is hoisted), so that the
figure is the cost inside a compiled solve, without the dispatch of a jitted call.
Single-threaded CPU (XLA's intra-op parallelism off), float64, contenders of one size
timed interleaved. The crossover is the smallest `n` from which the structured path's
`factor_solve` beats dense LU's on every kind.

End to end, POLLU (20 species, a `SparseLinearOperator`): `Kvaerno5(root_finder=
dl.VeryChord())` and `dl.Rodas5P()` with the default `dense_below` and with `dense_below=0`
(the reordered band), against Diffrax's default, at rtol = atol 1e-4 and 1e-6.

    python -m benchmarks linear-crossover [--quick]
"""

import os


os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)

import argparse

import jax
import jax.lax as lax
import jax.numpy as jnp
import lineax as lx
import matplotlib
import numpy as np


matplotlib.use("Agg")
import matplotlib.pyplot as plt


jax.config.update("jax_enable_x64", True)

import diffrax_linearize as dl
from diffrax_linearize._linear_solver import _inverse

from benchmarks._common import markdown_table, save_plot, time_contenders, write_results


REPEATS = 64  # factorisations (or solves) per timed call


def _block(n, rng):
    k = 4
    blocks = rng.randn(n // k, k, k) + 4 * np.eye(k)
    return blocks, lambda v: dl.BlockDiagonalLinearOperator(v)


def _band(n, rng):
    offsets = (-2, -1, 0, 1, 2)
    diags = rng.randn(len(offsets), n)
    diags[2] += 6
    return diags, lambda v: dl.BandedLinearOperator(v, offsets)


def _sparse(n, columns, rng):
    values = rng.randn(n, columns.shape[0])
    values[:, 0] += columns.shape[0] + 2  # entry 0 is the diagonal: dominant
    struct = jax.ShapeDtypeStruct((n,), jnp.float64)
    return values, lambda v: dl.SparseLinearOperator(v, columns, struct)


def _irregular(n, rng):
    # POLLU-like: the diagonal and up to 9 other entries per row, at random columns.
    per_row = min(n, 10)
    cols = [np.arange(n)]
    for _ in range(per_row - 1):
        cols.append(rng.randint(0, n, n))
    return _sparse(n, np.stack(cols), rng)


def _ring(n, rng):
    # A periodic 1D stencil of width 2: banded but for its wrap-around corners.
    cols = np.stack([(np.arange(n) + s) % n for s in (0, -2, -1, 1, 2)])
    return _sparse(n, cols, rng)


KINDS = {
    "block-diagonal (4 x 4 blocks)": _block,
    "banded (bandwidth 2)": _band,
    "sparse, irregular (POLLU-like, 10 per row)": _irregular,
    "sparse, periodic stencil": _ring,
}


def _solve_fn(path):
    if path == "structured":
        solver = dl.StructuredLinearSolver(dense_below=0)
        return lambda op, b: lx.linear_solve(op, b, solver).value
    if path == "dense LU":
        return lambda op, b: (
            lx.linear_solve(lx.MatrixLinearOperator(op.as_matrix()), b, lx.LU()).value
        )
    return lambda op, b: _inverse(op.as_matrix()) @ b


def _paths(n):
    # The Gauss-Jordan loop is O(n^3) in scalar steps: past a few dozen unknowns it only
    # costs time to measure.
    return ("structured", "dense LU", "dense GJ") if n <= 32 else ("structured", "dense LU")


def _contenders(values, make, b):
    fns = {}
    for path in _paths(b.shape[0]):
        solve = _solve_fn(path)

        def factor_solve(values, b, solve=solve):
            def body(i, x):
                op = make(values * (1 + 1e-9 * i))
                return solve(op, x / jnp.max(jnp.abs(x)))

            return lax.fori_loop(0, REPEATS, body, b)

        # The factorisation once, outside the loop; the loop solves with it.
        if path == "structured":
            solver = dl.StructuredLinearSolver(dense_below=0)

            def solve_only(values, b):
                op = make(values)
                state = solver.init(op, {})

                def body(i, x):
                    y = x / jnp.max(jnp.abs(x))
                    return solver.compute(state, y, {})[0].reshape(y.shape)

                return lax.fori_loop(0, REPEATS, body, b)
        elif path == "dense LU":

            def solve_only(values, b):
                state = lx.LU().init(lx.MatrixLinearOperator(make(values).as_matrix()), {})

                def body(i, x):
                    return lx.LU().compute(state, x / jnp.max(jnp.abs(x)), {})[0]

                return lax.fori_loop(0, REPEATS, body, b)
        else:

            def solve_only(values, b):
                inv = _inverse(make(values).as_matrix())
                return lax.fori_loop(0, REPEATS, lambda i, x: inv @ (x / jnp.max(jnp.abs(x))), b)

        fns[(path, "factor_solve")] = (factor_solve, (values, b))
        fns[(path, "solve")] = (solve_only, (values, b))
    return fns


def _check(values, make, b):
    """Every path solves the system (one factor-and-solve, against numpy's dense solve)."""
    op = make(values)
    expected = np.linalg.solve(np.asarray(op.as_matrix()), np.asarray(b))
    for path in _paths(b.shape[0]):
        x = np.asarray(jax.jit(_solve_fn(path))(op, b))
        err = np.max(np.abs(x - expected)) / np.max(np.abs(expected))
        assert err < 1e-8, (path, err)


def run(quick: bool = False) -> list[dict]:
    # The block and band paths beat dense LU from a few unknowns on; the sparse ones later.
    small = [4, 16, 64] if quick else [4, 8, 16, 32, 64, 128]
    large = [4, 16, 64, 128] if quick else [4, 8, 16, 32, 64, 96, 128, 192, 256]
    rng = np.random.RandomState(0)
    rows = []
    sizes = {kind: small if kind.startswith(("block", "band")) else large for kind in KINDS}
    for kind, build in KINDS.items():
        for n in sizes[kind]:
            values, make = build(n, rng)
            values = jnp.asarray(values)
            b = jnp.asarray(rng.randn(n))
            _check(values, make, b)
            times = time_contenders(
                {f"{p}|{c}": fn for (p, c), fn in _contenders(values, make, b).items()},
                repeats=3 if quick else 7,
                batch_time=0.005,
            )
            row = {"kind": kind, "n": n}
            for key, t in times.items():
                path, cost = key.split("|")
                row[f"{path} {cost}_s"] = t["run_min_s"] / REPEATS
                row[f"{path} {cost} median_s"] = t["run_s"] / REPEATS
            for path in _paths(n):  # a Rosenbrock step: one factorisation, eight solves
                row[f"{path} factor_8solves_s"] = (
                    row[f"{path} factor_solve_s"] + 7 * row[f"{path} solve_s"]
                )
            for cost in ("factor_solve", "factor_8solves"):
                row[f"structured / dense LU, {cost}"] = (
                    row[f"structured {cost}_s"] / row[f"dense LU {cost}_s"]
                )
            rows.append(row)
            print(
                f"{kind:45s} n={n:4d}  factor+solve: structured "
                f"{row['structured factor_solve_s'] * 1e6:8.1f} µs, dense LU "
                f"{row['dense LU factor_solve_s'] * 1e6:8.1f} µs;  solve: structured "
                f"{row['structured solve_s'] * 1e6:8.1f} µs, dense LU "
                f"{row['dense LU solve_s'] * 1e6:8.1f} µs",
                flush=True,
            )
    crossover = {
        cost: {
            kind: _crossover([r for r in rows if r["kind"] == kind], sizes[kind], cost)
            for kind in KINDS
        }
        for cost in ("factor_solve", "factor_8solves")
    }
    columns = [
        ("kind", "operator"),
        ("n", "n"),
        ("structured factor_solve_s", "structured: factor + solve"),
        ("dense LU factor_solve_s", "dense LU: factor + solve"),
        ("dense GJ factor_solve_s", "dense GJ: factor + solve"),
        ("structured solve_s", "structured: solve"),
        ("dense LU solve_s", "dense LU: solve"),
        ("structured / dense LU, factor_solve", "structured / dense LU"),
        ("structured / dense LU, factor_8solves", "same, factor + 8 solves"),
    ]
    print(markdown_table(rows, columns))
    print(f"\nCrossover (structured faster than dense LU from this n on): {crossover}")
    pollu = pollu_rows(3 if quick else 5)
    path = write_results(
        "linear_crossover",
        rows,
        pollu=pollu,
        crossover=crossover,
        dense_below_default_when_run=dl.StructuredLinearSolver().dense_below,
        repeats_per_call=REPEATS,
        xla_flags=os.environ.get("XLA_FLAGS"),
        quick=quick,
        note="single-threaded CPU, float64; busy shared 2-core machine: rough",
    )
    print(f"Results: {path}")
    print(f"Plot: {plot(rows)}")
    return rows


def plot(rows, out=None):
    """One panel per operator kind: the factor + solve time of each path against `n`
    (log-log), the structured path's crossover with dense LU marked."""
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.2 * len(kinds), 3.8), squeeze=False)
    styles = {"structured": "o-", "dense LU": "s--", "dense GJ": "^:"}
    for ax, kind in zip(axes.flat, kinds):
        mine = sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["n"])
        for path, style in styles.items():
            pts = [
                (r["n"], r[f"{path} factor_solve_s"]) for r in mine if f"{path} factor_solve_s" in r
            ]
            if pts:
                ax.loglog(*zip(*pts), style, label=f"{path}: factor + solve", ms=4)
        sizes = [r["n"] for r in mine]
        n = _crossover(mine, sizes, "factor_solve")
        if n is not None:
            ax.axvline(n, color="grey", lw=0.8)
            ax.annotate(
                f"crossover n={n}",
                (n, ax.get_ylim()[1]),
                fontsize=7,
                va="top",
                ha="right",
                rotation=90,
            )  # noqa: E501
        ax.set_title(kind, fontsize=9)
        ax.set_xlabel("n (unknowns)", fontsize=8)
        ax.set_ylabel("time per factor + solve, fastest round (s)", fontsize=8)
    handles, names = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(styles))
    fig.suptitle(
        "Linear solves inside a compiled loop: structured paths against dense LU"
        " (float64, one thread)"
    )
    return save_plot(fig, "linear_crossover", out, dpi=110, rect=(0, 0.08, 1, 0.95))


def pollu_rows(repeats: int = 5) -> list[dict]:
    import diffrax

    from benchmarks.stiff_peers import TEST_SET

    rhs, y0, t1, *_ = TEST_SET["POLLU"]
    y0 = jnp.asarray(y0, jnp.float64)
    band = dl.StructuredLinearSolver(dense_below=0)

    def make(solver, rtol):
        def fn(y0):
            sol = diffrax.diffeqsolve(
                diffrax.ODETerm(lambda t, y, args: jnp.stack(rhs(y))), solver, 0.0, t1,
                None, y0, stepsize_controller=diffrax.PIDController(rtol=rtol, atol=rtol),
                max_steps=200_000, throw=False,
            )  # fmt: skip
            return sol.ys[-1]

        return fn, (y0,)

    rows = []
    for rtol in (1e-4, 1e-6):
        contenders = {
            "VeryChord, band (dense_below=0)": diffrax.Kvaerno5(
                root_finder=dl.VeryChord(linear_solver=band)
            ),
            "VeryChord, dense (default)": diffrax.Kvaerno5(root_finder=dl.VeryChord()),
            "Rodas5P, band (dense_below=0)": dl.Rodas5P(linear_solver=band),
            "Rodas5P, dense (default)": dl.Rodas5P(),
            "diffrax default": diffrax.Kvaerno5(),
        }
        times = time_contenders(
            {k: make(v, rtol) for k, v in contenders.items()}, repeats=repeats, max_time=10
        )
        for method, t in times.items():
            rows.append({"problem": "POLLU", "rtol": rtol, "method": method, **t})
            print(f"POLLU rtol {rtol:g} {method:34s} {t['run_min_s'] * 1e3:8.2f} ms", flush=True)
    return rows


def _crossover(rows, sizes, cost):
    """The smallest n from which, at that size and every larger one measured, the
    structured path is faster than dense LU (`None`: at no size measured)."""
    for n in sizes:
        if all(r[f"structured / dense LU, {cost}"] < 1 for r in rows if r["n"] >= n):
            return n
    return None


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    run(quick=parser.parse_args(argv).quick)


if __name__ == "__main__":
    main()
