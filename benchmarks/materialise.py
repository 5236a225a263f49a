"""`diffrax_linearize.materialise` against `jax.jacfwd`, `lineax.materialise` of a
`lineax.FunctionLinearOperator`, and a jitted copy of the matrix (the floor).

Problems (float32, 2-core CPU in the issue's acceptance):

- `A @ x` for N in {500, 1000, 2000, 4000}: run and compile time, jitted, `A` an argument.
- `B @ tanh(A @ x)` at the same N: `jax.jacfwd` against ours.
- the first un-jitted call with `A` closed over, N=3000: `materialise(f, x)` against the
  first call of `jax.jit(jax.jacfwd(f))` (compilation included), and whether our result is
  `A` bit for bit.
- with `--seed-n 10000` (the GPU run): the seed report's case, `A @ x` at N = 10,000,
  compiled and first calls, and how far each compiled result is from `A`; `--seed-only`
  runs that case alone (`materialise_seed-*.json`, for a device whose time is short).
- Equinox layers (`Conv1d`, `Conv2d`, `ConvTranspose1d`, `Linear`, a grouped `Conv1d`,
  a strided `ConvTranspose1d`), the Jacobian with respect to the input and to the
  parameters: ours against `jax.jacfwd`, where structure
  may not pay (ours must not be slower beyond timing noise).

    python -m benchmarks.materialise [--quick] [--seed-n N [--seed-only]]
"""

import argparse
import time

import equinox as eqx
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
    block,
    fmt_spread,
    markdown_table,
    plot_path,
    save_plot,
    summarise_times,
    time_contenders,
    time_contenders_output,
    write_results,
)


def _matrix(n, seed):
    return jnp.asarray(np.random.RandomState(seed).randn(n, n) / np.sqrt(n), dtype=jnp.float32)


# ---- A @ x, jitted, A an argument ------------------------------------------------------


def _linear_methods():
    def jacfwd(x, A):
        return jax.jacfwd(lambda x: A @ x)(x)

    def lineax_materialise(x, A):
        op = lx.FunctionLinearOperator(lambda x: A @ x, jax.ShapeDtypeStruct(x.shape, x.dtype))
        return lx.materialise(op).as_matrix()

    def ours(x, A):
        return dl.materialise(lambda x: A @ x, x)

    def copy(x, A):
        return jnp.copy(A)

    return {
        "jax.jacfwd": jacfwd,
        "lineax.materialise": lineax_materialise,
        "ours": ours,
        "copy of A": copy,
    }


def _nonlinear_methods():
    def f(x, A, B):
        return B @ jnp.tanh(A @ x)

    def jacfwd(x, A, B):
        return jax.jacfwd(f)(x, A, B)

    def ours(x, A, B):
        return dl.materialise(f, x, A, B)

    return {"jax.jacfwd": jacfwd, "ours": ours}


def _layers():
    """`(name, layer, input)` for the layer cases, float32."""
    keys = jr.split(jr.key(0), 6)
    return [
        ("Conv1d(4, 8, 3)", eqx.nn.Conv1d(4, 8, 3, padding=1, key=keys[0]), (4, 64)),
        ("Conv2d(3, 8, 3)", eqx.nn.Conv2d(3, 8, 3, padding=1, key=keys[1]), (3, 16, 16)),
        ("ConvTranspose1d(4, 8, 3)", eqx.nn.ConvTranspose1d(4, 8, 3, key=keys[2]), (4, 32)),
        ("Linear(64, 64)", eqx.nn.Linear(64, 64, key=keys[3]), (64,)),
        (
            "Conv1d(4, 8, 3, groups=2)",
            eqx.nn.Conv1d(4, 8, 3, padding=1, groups=2, key=keys[4]),
            (4, 64),
        ),
        (
            "ConvTranspose1d(4, 8, 3, stride=2)",
            eqx.nn.ConvTranspose1d(4, 8, 3, stride=2, key=keys[5]),
            (4, 32),
        ),
    ]


def _layer_methods(layer, x):
    params, static = eqx.partition(layer, eqx.is_inexact_array)

    def wrt_input(jac):
        return lambda x, params: jac(lambda x: eqx.combine(params, static)(x), x)

    def wrt_params(jac):
        return lambda x, params: jac(lambda p: eqx.combine(p, static)(x), params)

    def jacfwd(f, x):
        return jax.jacfwd(f)(x)

    ours = dl.materialise
    return params, {
        ("input", "jax.jacfwd"): wrt_input(jacfwd),
        ("input", "ours"): wrt_input(ours),
        ("params", "jax.jacfwd"): wrt_params(jacfwd),
        ("params", "ours"): wrt_params(ours),
    }


def _layer_rows():
    rows = []
    for name, layer, shape in _layers():
        x = jnp.asarray(np.random.RandomState(3).randn(*shape), jnp.float32)
        params, methods = _layer_methods(layer, x)
        timings = time_contenders(
            {key: (fn, (x, params)) for key, fn in methods.items()}, repeats=21, min_time=0.2
        )
        for (wrt, method), t in timings.items():
            rows.append({"problem": f"{name} wrt {wrt}", "N": x.size, "method": method, **t})
        for wrt in ("input", "params"):  # the timed programs agree
            a = jax.jit(methods[(wrt, "ours")])(x, params)
            b = jax.jit(methods[(wrt, "jax.jacfwd")])(x, params)
            for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
                np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-6)
    return rows


def _repeats(n):
    return 15 if n <= 1000 else 5


# Each first call is timed this many times, ours and `jax.jit(jax.jacfwd)` alternately,
# each at a size of its own (N, N + 1, ...), so that no call finds a warm cache.
FIRST_CALL_ROUNDS = 3


def _first_call(n):
    """The first un-jitted call with `A` closed over: ours against the first call of
    `jax.jit(jax.jacfwd(f))`, interleaved over [`FIRST_CALL_ROUNDS`][] rounds. Each round
    takes a fresh matrix and a shape seen nowhere else (N, N + 1, ...), so that no cache is
    warm; the fastest round is the figure to compare, as for the compiled timings."""
    ours_times, ref_times, bitwise, close = [], [], True, True
    for k in range(FIRST_CALL_ROUNDS):
        A = _matrix(n + k, 7 + k)
        x = jnp.ones((n + k,), jnp.float32)
        block(A)
        t0 = time.perf_counter()
        ours = block(dl.materialise(lambda x: A @ x, x))
        ours_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ref = block(jax.jit(jax.jacfwd(lambda x: A @ x))(x))
        ref_times.append(time.perf_counter() - t0)
        bitwise &= bool(np.array_equal(np.asarray(ours), np.asarray(A)))
        close &= bool(np.allclose(np.asarray(ours), np.asarray(ref), rtol=1e-4, atol=1e-5))

    def timing(times):
        summary = summarise_times(times)
        return {
            "first_s": summary["run_min_s"],
            "first_median_s": summary["run_s"],
            "first_max_s": summary["run_max_s"],
            "rounds": len(times),
        }

    return [
        {
            "problem": "first call A @ x",
            "N": n,
            "method": "ours (eager)",
            **timing(ours_times),
            "bitwise_equal": bitwise,
            "matches_jacfwd": close,
        },
        {
            "problem": "first call A @ x",
            "N": n,
            "method": "jax.jit(jax.jacfwd) first call",
            **timing(ref_times),
        },
    ]


def _seed_rows(n):
    """The seed report's case (JAX #9215): `A @ x` at size `n` (10,000 there, on a GPU),
    compiled and run, `jax.jacfwd` against ours, and both first calls."""
    A = _matrix(n, 5)
    x = jnp.ones((n,), jnp.float32)
    methods = _linear_methods()
    outputs, timings = time_contenders_output(
        {name: (methods[name], (x, A)) for name in ("jax.jacfwd", "ours")},
        repeats=3,
        max_time=60.0,
    )
    # Whether each timed program returns A: at a TPU's default matmul precision,
    # `jax.jacfwd`'s A @ I rounds the entries of A to bfloat16.
    scale = float(jnp.max(jnp.abs(A)))
    rows = [
        {
            "problem": "A @ x (seed size)", "N": n, "method": name, **t,
            "max_error_over_max_A": float(jnp.max(jnp.abs(outputs[name] - A))) / scale,
        }
        for name, t in timings.items()
    ]  # fmt: skip
    return rows + _first_call(n)


# The printed table's columns, each run's own last.
_COLUMNS = [
    ("problem", "problem"),
    ("N", "N"),
    ("method", "method"),
    ("run", "run (fastest, +median spread)"),
    ("compile_s", "compile"),
    ("first_s", "first call (fastest)"),
]


def run_seed(n: int) -> list[dict]:
    """The seed report's case alone (`--seed-only`), for a device whose time is short:
    written as `materialise_seed-<platform>-<device>.json`, with the matmul precision."""
    rows = _seed_rows(n)
    columns = [*_COLUMNS, ("max_error_over_max_A", "max abs(J - A) / max abs(A)")]
    print(markdown_table([dict(r, run=fmt_spread(r)) for r in rows], columns))
    precision = jax.config.jax_default_matmul_precision
    path = write_results(
        "materialise_seed", rows, matmul_precision=precision or "default",
        note="The seed report's case (JAX #9215) alone: `run_min_s` the fastest of the "
        "interleaved rounds after compiling, `first_s` the fastest first call at fresh sizes; "
        "`max_error_over_max_A` how far the compiled result is from A.",
    )  # fmt: skip
    print(f"\nResults: {path}\nPlot: {plot_seed(rows)}")
    return rows


def plot_seed(rows, out=None):
    """The seed case's times: compiled (fastest round) and first call, ours and
    `jax.jacfwd`, each bar labelled with how far its compiled result is from A."""
    n = rows[0]["N"]
    compiled = {r["method"]: r for r in rows if r["problem"] == "A @ x (seed size)"}
    first = {r["method"]: r for r in rows if r["problem"] == "first call A @ x"}
    pairs = [
        ("compiled", compiled["jax.jacfwd"]["run_min_s"], compiled["ours"]["run_min_s"]),
        (
            "first call",
            first["jax.jit(jax.jacfwd) first call"]["first_s"],
            first["ours (eager)"]["first_s"],
        ),
    ]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for i, (what, theirs, ours) in enumerate(pairs):
        ax.bar(i - 0.2, theirs, 0.4, color="C0", label="jax.jacfwd" if i == 0 else None)
        ax.bar(i + 0.2, ours, 0.4, color="C1", label="ours" if i == 0 else None)
    for name, x, color in (("jax.jacfwd", -0.2, "C0"), ("ours", 0.2, "C1")):
        error = compiled[name].get("max_error_over_max_A")
        if error is not None:
            label = "= A" if error == 0 else f"off A by {error:.1e}"
            ax.annotate(label, (x, compiled[name]["run_min_s"]), ha="center", va="bottom",
                        fontsize=8, color=color)  # fmt: skip
    ax.set_yscale("log")
    ax.set_xticks(range(len(pairs)), [what for what, *_ in pairs])
    ax.set_ylabel("seconds (fastest)")
    ax.set_title(f"Jacobian of A @ x, N = {n:,}, float32")
    ax.legend(fontsize=8)
    return save_plot(fig, "materialise_seed", out, dpi=100)


def run(quick: bool = False, seed_n: int | None = None) -> list[dict]:
    sizes = [500, 1000] if quick else [500, 1000, 2000, 4000]
    first_n = 1000 if quick else 3000
    rows = []
    for n in sizes:
        A, B = _matrix(n, 0), _matrix(n, 1)
        x = jnp.asarray(np.random.RandomState(2).randn(n), dtype=jnp.float32)
        # The contenders of a case timed interleaved (round-robin), so that a drifting or
        # shared machine slows all of them alike; the fastest rounds are compared.
        timing = dict(repeats=_repeats(n), min_time=0.2, max_time=20.0)
        linear = {name: (fn, (x, A)) for name, fn in _linear_methods().items()}
        for name, t in time_contenders(linear, **timing).items():
            rows.append({"problem": "A @ x", "N": n, "method": name, **t})
        nonlinear = {name: (fn, (x, A, B)) for name, fn in _nonlinear_methods().items()}
        for name, t in time_contenders(nonlinear, **timing).items():
            rows.append({"problem": "B @ tanh(A @ x)", "N": n, "method": name, **t})
        # Check the timed programs agree (outside the timings).
        ours = jax.jit(_linear_methods()["ours"])(x, A)
        assert np.array_equal(np.asarray(ours), np.asarray(A)), "ours is not A bit for bit"
    rows += _first_call(first_n)
    rows += _layer_rows()
    if seed_n is not None:
        rows += _seed_rows(seed_n)

    columns = [*_COLUMNS, ("bitwise_equal", "== A bit for bit")]
    print(markdown_table([dict(r, run=fmt_spread(r)) for r in rows], columns))
    ratios = _ratios(rows)
    print()
    for key, value in ratios.items():
        print(f"- {key}: {value:.3g}" if value is not None else f"- {key}: —")
    path = write_results(
        "materialise",
        rows,
        ratios=ratios,
        quick=quick,
        note=(
            "The contenders of each case timed interleaved (round-robin) after compiling: "
            "`run_min_s` is the fastest round, `run_s` the median and `run_max_s` the slowest "
            "(the spread). First calls: the fastest of "
            f"{FIRST_CALL_ROUNDS} interleaved rounds, each at a fresh size N, N + 1, ... "
            "(`first_s`; `first_median_s`, `first_max_s` the spread). Every ratio is ours over "
            "the other's, from the fastest rounds."
        ),
    )
    plot(rows)
    print(f"\nResults: {path}\nPlot: {plot_path('materialise')}")
    return rows


def _get(rows, problem, n, method, key="run_min_s"):
    for r in rows:
        if r["problem"] == problem and r["N"] == n and r["method"] == method:
            return r.get(key)
    return None


def derive(data: dict) -> dict:
    """`data` with its acceptance ratios recomputed from its timings."""
    return dict(data, ratios=_ratios(data["rows"]))


def _ratios(rows):
    """The issue's acceptance ratios, each ours over the other. In a quick run the sizes
    asked for may be missing: the largest run size stands in."""
    sizes = sorted({r["N"] for r in rows if r["problem"] == "A @ x"})
    (first_n,) = {r["N"] for r in rows if r["problem"] == "first call A @ x"}
    n_lin = 2000 if 2000 in sizes else sizes[-1]
    n_tanh = 1000 if 1000 in sizes else sizes[-1]

    def ratio(a, b):
        return None if a is None or b is None else a / b

    ours = _get(rows, "A @ x", n_lin, "ours")
    return {
        f"A @ x, N={n_lin}: ours / jacfwd (want <= 0.05)": ratio(
            ours, _get(rows, "A @ x", n_lin, "jax.jacfwd")
        ),
        f"A @ x, N={n_lin}: ours / copy of A (want <= 2)": ratio(
            ours, _get(rows, "A @ x", n_lin, "copy of A")
        ),
        f"B @ tanh(A @ x), N={n_tanh}: ours / jacfwd (want <= 0.6)": ratio(
            _get(rows, "B @ tanh(A @ x)", n_tanh, "ours"),
            _get(rows, "B @ tanh(A @ x)", n_tanh, "jax.jacfwd"),
        ),
        f"first call, N={first_n}: ours / jit(jacfwd) (want <= 0.333)": ratio(
            _get(rows, "first call A @ x", first_n, "ours (eager)", "first_s"),
            _get(rows, "first call A @ x", first_n, "jax.jit(jax.jacfwd) first call", "first_s"),
        ),
        **{
            f"{p}: ours / jacfwd (want <= 1)": ratio(
                _get(rows, p, n, "ours"), _get(rows, p, n, "jax.jacfwd")
            )
            for p, n in dict.fromkeys(
                (r["problem"], r["N"]) for r in rows if " wrt " in r["problem"]
            )
        },
    }


def plot(rows, out=None):
    sizes = sorted({r["N"] for r in rows if r["problem"] == "A @ x"})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, problem in zip(axes, ["A @ x", "B @ tanh(A @ x)"]):
        methods = dict.fromkeys(r["method"] for r in rows if r["problem"] == problem)
        for method in methods:
            run = [_get(rows, problem, n, method) for n in sizes]
            comp = [_get(rows, problem, n, method, "compile_s") for n in sizes]
            (line,) = ax.loglog(sizes, run, "o-", label=f"{method} (run)")
            ax.loglog(
                sizes, comp, "x--", color=line.get_color(), alpha=0.5, label=f"{method} (compile)"
            )
        ax.set_title(f"Jacobian of {problem}, float32")
        ax.set_xlabel("N")
        ax.set_ylabel("seconds (run: fastest round)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    save_plot(fig, "materialise", out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="N in {500, 1000}, seconds")
    parser.add_argument(
        "--seed-n", type=int, default=None, help="also the seed report's A @ x at this N (GPU)"
    )
    parser.add_argument(
        "--seed-only", action="store_true", help="only the seed report's case (with --seed-n)"
    )
    ns = parser.parse_args()
    if ns.seed_only:
        if ns.seed_n is None:
            parser.error("--seed-only needs --seed-n N")
        run_seed(ns.seed_n)
    else:
        run(quick=ns.quick, seed_n=ns.seed_n)
