"""Sparse structure in real vector fields: `materialise_operator` against `jax.jacfwd` and
asdex (sparsity detection and graph colouring), side by side in one run.

The corpus: N Robertson systems written two ways (`y[:, k]` with `jnp.stack`, and
`jax.vmap`), a `lax.scan` over the systems, a 1D heat equation with a cubic term (Laplacian
by `jnp.pad` and slices), a 1D Brusselator, a 2D Brusselator on a periodic grid (`jnp.roll`),
a 2D Gray-Scott on a Dirichlet grid (species as the last axis), and Lorenz-96; then the
idioms of issue 24: diffusion on a random graph and on a scale-free one (`segment_sum`), a
mass-action network (`.at[].add`), `jnp.gradient`, a 3D stencil, a two-species field with
a zero-flux boundary (`jnp.pad(mode="edge")`), a per-cell MLP under `jax.vmap`, a
`fori_loop` over cells, and two fields dense by nature (N-body, an FFT Laplacian); at sizes
from 10^2 to 10^5 unknowns (float64, jitted).

Per field and size:

- `f`: one jitted evaluation of the field (the floor: the Jacobian has at least that many
  nonzeros to compute);
- `ours`: jitted `diffrax_linearize.materialise_operator`, with the structure it found and
  the numbers its operator's array leaves hold;
- `ours_dense`: jitted `diffrax_linearize.materialise` (the dense Jacobian), where it fits;
- `jacfwd`: jitted `jax.jacfwd`, where the dense Jacobian fits (at most 4000 unknowns here);
- `asdex`: `asdex.jacobian_from_coloring(f, colouring, output_format="bcoo")`, jitted, with
  the one-off `asdex.jacobian_coloring` (detection and colouring) timed separately.

At the smallest size of each field the Jacobians are checked against `jax.jacfwd`.

    python -m benchmarks structure [--quick]     # needs `pip install -e '.[bench]'` for asdex
    python -m benchmarks.structure --fields nbody cell_mlp --update

The second form re-runs some fields and keeps the other rows of the recorded result (each
row says in `recorded` when it was measured; `earlier_runs` holds the older runs' machines).
"""

import argparse
import math
import time

import jax
import jax.lax as lax
import jax.numpy as jnp
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
    time_contenders,
    write_results,
)


# ---- the corpus -----------------------------------------------------------------------------


def robertson_stack(y):
    y = y.reshape(-1, 3)
    y1, y2, y3 = y[:, 0], y[:, 1], y[:, 2]
    d1 = -0.04 * y1 + 1e4 * y2 * y3
    d3 = 3e7 * y2**2
    return jnp.stack([d1, -d1 - d3, d3], axis=1).reshape(-1)


def _robertson_one(y):
    y1, y2, y3 = y
    d1 = -0.04 * y1 + 1e4 * y2 * y3
    d3 = 3e7 * y2**2
    return jnp.stack([d1, -d1 - d3, d3])


def robertson_vmap(y):
    return jax.vmap(_robertson_one)(y.reshape(-1, 3)).reshape(-1)


def robertson_scan(y):
    _, out = lax.scan(lambda c, s: (c, _robertson_one(s)), 0.0, y.reshape(-1, 3))
    return out.reshape(-1)


def heat_cubic(u):
    n = u.shape[0]
    up = jnp.pad(u, 1)
    return (n + 1) ** 2 * (up[2:] - 2 * up[1:-1] + up[:-2]) - u**3


def brusselator_1d(y):
    n = y.shape[0] // 2
    u, v = y[:n], y[n:]
    a = 0.02 * (n + 1) ** 2

    def lap(w, edge):
        p = jnp.pad(w, 1, constant_values=edge)
        return p[2:] - 2 * w + p[:-2]

    du = 1 + u**2 * v - 4 * u + a * lap(u, 1.0)
    dv = 3 * u - u**2 * v + a * lap(v, 3.0)
    return jnp.concatenate([du, dv])


def brusselator_2d(y):
    n = math.isqrt(y.shape[0] // 2)
    y = y.reshape(2, n, n)
    u, v = y[0], y[1]
    alpha = 0.02 * (n - 1) ** 2

    def lap(w):
        return (
            jnp.roll(w, 1, 0) + jnp.roll(w, -1, 0) + jnp.roll(w, 1, 1) + jnp.roll(w, -1, 1) - 4 * w
        )

    du = 1.0 + u**2 * v - 4.4 * u + alpha * lap(u)
    dv = 3.4 * u - u**2 * v + alpha * lap(v)
    return jnp.stack([du, dv]).reshape(-1)


def gray_scott_2d(y):
    n = math.isqrt(y.shape[0] // 2)
    y = y.reshape(n, n, 2)
    u, v = y[..., 0], y[..., 1]

    def lap(w):
        p = jnp.pad(w, 1)
        return (n + 1) ** 2 * (p[2:, 1:-1] + p[:-2, 1:-1] + p[1:-1, 2:] + p[1:-1, :-2] - 4 * w)

    du = 2e-5 * lap(u) - u * v**2 + 0.04 * (1 - u)
    dv = 1e-5 * lap(v) + u * v**2 - 0.1 * v
    return jnp.stack([du, dv], axis=-1).reshape(-1)


def lorenz96(x):
    return (jnp.roll(x, -1) - jnp.roll(x, 2)) * jnp.roll(x, 1) - x + 8.0


def _grid(n):  # 2 species on an n x n grid
    return 2 * n * n


# The idioms of issue 24's held-out trial: graphs, networks and meshes whose pattern
# depends on the size, built per size (`_PerSize`), and fields that are dense by nature.


class _PerSize:
    """A field whose structure depends on its size: `make(n)` is the field of `n`
    unknowns."""

    def __init__(self, make):
        self.make = make
        self.__name__ = make.__name__


def _field_at(fn, n):
    return fn.make(n) if isinstance(fn, _PerSize) else fn


def _graph_field(src, dst, n):
    src, dst = jnp.asarray(src), jnp.asarray(dst)

    def laplacian(x):
        flow = x[src] - x[dst]
        out = jax.ops.segment_sum(-flow, src, num_segments=n)
        return out + jax.ops.segment_sum(flow, dst, num_segments=n) - x**3

    return laplacian


@_PerSize
def graph_laplacian(n):
    """Diffusion on a random graph of `4 n` edges (`segment_sum`), with a cubic sink."""
    rng = np.random.RandomState(0)
    return _graph_field(rng.randint(0, n, 4 * n), rng.randint(0, n, 4 * n), n)


@_PerSize
def scale_free_graph(n):
    """The same on a preferential-attachment graph (two edges per new node, hubs of
    hundreds of neighbours): rows of very uneven length."""
    rng = np.random.RandomState(0)
    targets, ends = [0, 1], []
    for i in range(2, n):
        for t in rng.choice(targets, 2, replace=False) if len(set(targets)) > 1 else [0]:
            ends.append((i, int(t)))
        targets.extend([i, i, *[int(t) for _, t in ends[-2:]]])
    e = np.asarray(ends)
    return _graph_field(e[:, 0], e[:, 1], n)


@_PerSize
def mass_action(n):
    """A random mass-action network of `n` species and `2 n` reactions `A + B -> C` (rates
    `k c_A c_B`), written with `.at[].add` as a chemist would."""
    rng = np.random.RandomState(0)
    a, b, c = (jnp.asarray(rng.randint(0, n, 2 * n)) for _ in range(3))
    k = jnp.asarray(rng.uniform(0.5, 2.0, 2 * n))

    def field(x):
        rate = k * x[a] * x[b]
        out = jnp.zeros_like(x).at[a].add(-rate).at[b].add(-rate)
        return out.at[c].add(rate) - 0.1 * x

    return field


def gradient_field(u):
    """Advection and diffusion by `jnp.gradient` (one-sided at the ends)."""
    return jnp.gradient(u) * u + jnp.gradient(jnp.gradient(u))


def stencil_3d(u):
    """A 7-point Laplacian on a cube with a Dirichlet boundary, plus a quadratic term."""
    m = round(u.shape[0] ** (1 / 3))
    u = u.reshape(m, m, m)
    p = jnp.pad(u, 1)
    lap = (
        p[2:, 1:-1, 1:-1]
        + p[:-2, 1:-1, 1:-1]
        + p[1:-1, 2:, 1:-1]
        + p[1:-1, :-2, 1:-1]
        + p[1:-1, 1:-1, 2:]
        + p[1:-1, 1:-1, :-2]
        - 6 * u
    )
    return (lap + u**2).reshape(-1)


def neumann_reaction_diffusion(y):
    """Two species on a 2D grid, species first, with a zero-flux boundary by
    `jnp.pad(mode="edge")` on the grid axes only."""
    n = math.isqrt(y.shape[0] // 2)
    y = y.reshape(2, n, n)
    p = jnp.pad(y, ((0, 0), (1, 1), (1, 1)), mode="edge")
    lap = p[:, 2:, 1:-1] + p[:, :-2, 1:-1] + p[:, 1:-1, 2:] + p[:, 1:-1, :-2] - 4 * y
    u, v = y[0], y[1]
    react = jnp.stack([1 - u * v**2, u * v**2 - 0.5 * v])
    return (jnp.array([0.1, 0.05])[:, None, None] * lap + react).reshape(-1)


_W1 = jnp.asarray(np.random.RandomState(1).randn(16, 4) / 2)
_W2 = jnp.asarray(np.random.RandomState(2).randn(4, 16) / 4)


def cell_mlp(y):
    """A small MLP per cell of 4 states (`jax.vmap` over cells), coupled to its neighbour
    cells by a ring diffusion."""
    y = y.reshape(-1, 4)
    react = jax.vmap(lambda c: _W2 @ jnp.tanh(_W1 @ c))(y)
    return (react + jnp.roll(y, 1, 0) + jnp.roll(y, -1, 0) - 2 * y).reshape(-1)


def cell_loop(y):
    """A `fori_loop` over cells writing `out.at[i].set(...)` (patterned for loops of at most
    256 iterations)."""

    def body(i, out):
        return out.at[i].set(y[i] ** 2 - y[i - 1])

    return lax.fori_loop(1, y.shape[0], body, jnp.zeros_like(y))


def nbody(x):
    """Softened gravitational accelerations of `n / 3` bodies in 3D: dense."""
    p = x.reshape(-1, 3)
    d = p[None, :, :] - p[:, None, :]
    r2 = jnp.sum(d**2, -1) + 0.01
    return jnp.sum(d * r2[..., None] ** -1.5, axis=1).reshape(-1)


def fft_field(u):
    """A spectral (FFT) Laplacian on a periodic grid, plus a cubic term: dense."""
    k = jnp.fft.rfftfreq(u.shape[0], 1.0 / u.shape[0])
    return jnp.fft.irfft(-(k**2) * jnp.fft.rfft(u), n=u.shape[0]) - u**3


FIELDS = {
    "robertson_stack": (robertson_stack, [3 * 34, 3 * 1000, 3 * 10_000, 3 * 33_334]),
    "robertson_vmap": (robertson_vmap, [3 * 34, 3 * 1000, 3 * 10_000, 3 * 33_334]),
    "robertson_scan": (robertson_scan, [3 * 34, 3 * 1000, 3 * 10_000]),
    "heat_cubic": (heat_cubic, [100, 4000, 10_000, 100_000]),
    "brusselator_1d": (brusselator_1d, [100, 4000, 20_000, 100_000]),
    "brusselator_2d": (brusselator_2d, [_grid(8), _grid(32), _grid(64), _grid(128), _grid(256)]),
    "gray_scott_2d": (gray_scott_2d, [_grid(8), _grid(32), _grid(64), _grid(128), _grid(256)]),
    "lorenz96": (lorenz96, [100, 4000, 10_000, 100_000]),
    "graph_laplacian": (graph_laplacian, [100, 4000, 10_000, 50_000]),
    "scale_free_graph": (scale_free_graph, [100, 4000, 10_000, 50_000]),
    "mass_action": (mass_action, [100, 4000, 10_000, 100_000]),
    "gradient_field": (gradient_field, [100, 4000, 10_000, 100_000]),
    "stencil_3d": (stencil_3d, [5**3, 15**3, 22**3, 46**3]),
    "neumann_reaction_diffusion": (
        neumann_reaction_diffusion,
        [_grid(8), _grid(32), _grid(64), _grid(200)],
    ),
    "cell_mlp": (cell_mlp, [4 * 25, 4 * 1000, 4 * 2500, 4 * 25_000]),
    "cell_loop": (cell_loop, [64, 256]),
    "nbody": (nbody, [3 * 34, 3 * 500, 3 * 1000]),
    "fft_field": (fft_field, [128, 1024, 4000]),
}
# asdex's detection and colouring of a loop over cells took 206-638 s in issue 24's trial:
# not run.
NO_ASDEX = {"cell_loop": "not run: asdex's colouring of a loop over cells takes minutes"}
QUICK = {name: (fn, sizes[:2]) for name, (fn, sizes) in FIELDS.items()}
DENSE_MAX = 4000  # unknowns; a dense float64 Jacobian of 4000 is 128 MB


def _input(n):
    return jnp.asarray(0.5 + 0.5 * np.random.RandomState(0).rand(n), jnp.float64)


def _leaf_size(op) -> int:
    return sum(int(np.size(leaf)) for leaf in jax.tree_util.tree_leaves(op))


def _asdex(fn, x):
    """asdex's jitted-able Jacobian of `fn` at `x`, the time of its one-off detection and
    colouring, and the number of colours; `None` without asdex."""
    try:
        import asdex
    except ImportError:
        return None
    t0 = time.perf_counter()
    colouring = asdex.jacobian_coloring(fn, x)
    detect_s = time.perf_counter() - t0
    jac = asdex.jacobian_from_coloring(fn, colouring, output_format="bcoo")
    colours = getattr(colouring, "n_colors", None)
    if colours is None:
        colours = getattr(getattr(colouring, "coloring", None), "n_colors", None)
    return jac, detect_s, colours


def _max_error(actual, expected) -> float:
    return float(
        jnp.max(jnp.abs(jnp.asarray(actual) - expected)) / (1 + jnp.max(jnp.abs(expected)))
    )


def run(quick: bool = False, only=None, update: bool = False) -> list[dict]:
    """Time every field of the corpus (`only`: these fields). With `update`, the rows of
    the other fields are kept from the recorded result, each with the date of its run."""
    jax.config.update("jax_enable_x64", True)
    fields = QUICK if quick else FIELDS
    if only:
        fields = {name: fields[name] for name in only}
    kept, earlier = kept_rows("structure", lambda r: r["field"] in fields) if update else ([], [])
    rows = []
    for name, (field, sizes) in fields.items():
        for i, n in enumerate(sizes):
            fn = _field_at(field, n)
            x = _input(n)
            base = {"field": name, "unknowns": n}
            op = jax.jit(lambda x: dl.materialise_operator(fn, x))(x)
            report = dl.structure_report(fn, x)
            # Every method of a case timed interleaved (round-robin) against the others, so
            # that a drifting or shared machine slows all of them alike.
            contenders = {"f": (fn, (x,)), "ours": (lambda x: dl.materialise_operator(fn, x), (x,))}
            extra = {
                "ours": {
                    "operator": type(op).__name__,
                    "stored": _leaf_size(op),
                    "structure": report.kinds[0],
                    "dense_fallback": dict(report.densified),
                }
            }
            reference = None
            if n <= DENSE_MAX:
                contenders["ours_dense"] = (lambda x: dl.materialise(fn, x), (x,))
                contenders["jacfwd"] = (jax.jacfwd(fn), (x,))
                if i == 0:
                    reference = jax.jacfwd(fn)(x)
                    extra["ours"]["max_error_vs_jacfwd"] = _max_error(op.as_matrix(), reference)
            found = None
            if name in NO_ASDEX:
                extra["asdex"] = {"note": NO_ASDEX[name]}
            else:
                try:
                    found = _asdex(fn, x)
                except Exception as e:  # asdex has no rule for some primitives (`fft`)
                    extra["asdex"] = {"note": f"asdex failed: {type(e).__name__}: {e}"[:300]}
            if found is not None:
                jac, detect_s, colours = found
                contenders["asdex"] = (jac, (x,))
                extra["asdex"] = {"detect_s": detect_s, "colours": colours}
                if reference is not None:
                    extra["asdex"]["max_error_vs_jacfwd"] = _max_error(jac(x).todense(), reference)
            timings = time_contenders(contenders, repeats=7, min_time=0.2, max_time=20.0)
            for method, timing in timings.items():
                rows.append({**base, "method": method, **timing, **extra.get(method, {})})
            if "asdex" in extra and "asdex" not in timings:
                rows.append({**base, "method": "asdex", **extra["asdex"]})
                if method == "ours":
                    rows[-1]["ratio_to_f"] = timing["run_min_s"] / timings["f"]["run_min_s"]
            if n > DENSE_MAX:
                rows.append(
                    {
                        **base,
                        "method": "jacfwd",
                        "note": f"not run: the dense Jacobian is {n * n * 8 / 2**30:.1f} GiB",
                    }
                )
            print(f"  {name} n={n}: {report.kinds[0]}", flush=True)
    # One date for the run and the rows it measured (`report._earlier_runs` tells the
    # older rows by theirs).
    here = machine()
    if update:
        order = list(FIELDS)
        rows = sorted(
            [*kept, *({**r, "recorded": here["date"]} for r in rows)],
            key=lambda r: (order.index(r["field"]), r["unknowns"]),
        )
    path = write_results(
        "structure",
        rows,
        machine=here,
        summary=summary(rows),
        quick=quick,
        note=(
            "The methods of each field and size timed interleaved (round-robin) after "
            "compiling: `run_min_s` is the fastest round, `run_s` the median and `run_max_s` "
            "the slowest (the spread). The summary's times are the fastest rounds and its "
            "ratios (ours over the other's) are of the fastest rounds; asdex's detection and "
            "colouring (`detect_s`) is one call, timed once."
            + (
                " A partial re-run: each row's `recorded` is the date of the run that "
                "measured it; `earlier_runs` describes the runs of the older rows."
                if earlier
                else ""
            )
        ),
        **({"earlier_runs": earlier} if earlier else {}),
    )
    print(markdown_table(summary(rows), COLUMNS))
    print(f"\nResults: {path}\nPlot: {plot(rows)}")
    return rows


def summary(rows) -> list[dict]:
    """One row per field and size: ours against jacfwd and asdex, from the fastest rounds
    (the `_s` times are fastest rounds; ratios are ours over the other's)."""
    out = []
    keys = sorted(
        {(r["field"], r["unknowns"]) for r in rows}, key=lambda k: (list(FIELDS).index(k[0]), k[1])
    )
    for field, n in keys:
        by = {r["method"]: r for r in rows if r["field"] == field and r["unknowns"] == n}
        fastest = lambda method: _fastest(by.get(method))  # noqa: E731
        ours, ad, jf = fastest("ours"), fastest("asdex"), fastest("jacfwd")
        out.append(
            {
                "field": field,
                "unknowns": n,
                "structure": by["ours"].get("structure") if "ours" in by else None,
                "stored": by["ours"].get("stored") if "ours" in by else None,
                "f_s": fastest("f"),
                "ours_s": ours,
                "ours_compile_s": by["ours"].get("compile_s") if "ours" in by else None,
                "jacfwd_s": jf,
                "jacfwd_compile_s": by["jacfwd"].get("compile_s") if "jacfwd" in by else None,
                "asdex_s": ad,
                "asdex_detect_s": by["asdex"].get("detect_s") if "asdex" in by else None,
                "colours": by["asdex"].get("colours") if "asdex" in by else None,
                "ours_over_asdex": ours / ad if ours and ad else None,
                "ours_over_jacfwd": ours / jf if ours and jf else None,
            }
        )
    return out


def _fastest(row: dict | None) -> float | None:
    """A row's fastest round (a result from before the interleaved timings: its median)."""
    if row is None:
        return None
    return row.get("run_min_s", row.get("run_s"))


def derive(data: dict) -> dict:
    """`data` with its summary recomputed from its timings."""
    return dict(data, summary=summary(data["rows"]))


COLUMNS = [
    ("field", "field"),
    ("unknowns", "unknowns"),
    ("structure", "structure found"),
    ("stored", "numbers in operator"),
    ("f_s", "one f"),
    ("ours_s", "ours (fastest)"),
    ("ours_compile_s", "ours compile"),
    ("jacfwd_s", "jax.jacfwd"),
    ("jacfwd_compile_s", "jax.jacfwd compile"),
    ("asdex_s", "asdex"),
    ("asdex_detect_s", "asdex detection + colouring"),
    ("colours", "asdex colours"),
    ("ours_over_asdex", "ours / asdex"),
    ("ours_over_jacfwd", "ours / jax.jacfwd"),
]


def plot(rows, out=None):
    fields = list(dict.fromkeys(r["field"] for r in rows))
    cols = 4
    n_rows = math.ceil(len(fields) / cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(16, 3.2 * n_rows + 1), squeeze=False)
    labels = {
        "f": "one evaluation of f",
        "ours": "materialise_operator (ours)",
        "jacfwd": "jax.jacfwd",
        "asdex": "asdex (jitted, colouring done once)",
    }
    for ax, field in zip(axes.flat, fields):
        for method, style in [("f", ":"), ("ours", "o-"), ("jacfwd", "s--"), ("asdex", "^-")]:
            pts = [
                (r["unknowns"], _fastest(r))
                for r in rows
                if r["field"] == field and r["method"] == method and r.get("run_s")
            ]
            if pts:
                ax.loglog(*zip(*pts), style, label=labels[method])
        ax.set_title(field)
        ax.set_xlabel("unknowns")
        ax.set_ylabel("run time, fastest round (s)")
    for ax in list(axes.flat)[len(fields) :]:
        ax.axis("off")
    handles, names = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=4)
    fig.suptitle("Jacobians of vector fields: run time against unknowns (float64, jitted)")
    return save_plot(fig, "structure", out, dpi=110, rect=(0, 0.05, 1, 0.96))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--fields", nargs="+", choices=list(FIELDS), help="these fields only")
    ns = parse_partial_rerun(parser, argv, "fields")
    run(quick=ns.quick, only=ns.fields, update=ns.update)


if __name__ == "__main__":
    main()
