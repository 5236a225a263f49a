"""Sums of squared per-example gradients and per-example gradient norms: ours against
plain `jax.value_and_grad` and per-example `vmap(grad)`.

Models: an MLP 784-512-512-10 (float32) and a transformer block (sequence 64,
width 128, 4 heads) whose weights are shared over positions. The methods of a model and
batch size are timed interleaved (round-robin); reports the fastest round with the spread,
compile time and XLA scratch (`memory_analysis().temp_size_in_bytes`). Every ratio is of
the fastest rounds.

    python -m benchmarks.squared_grads [--quick]
"""

import argparse
import math

import jax
import jax.numpy as jnp
import matplotlib


matplotlib.use("Agg")
import diffrax_linearize as dl
import matplotlib.pyplot as plt

from benchmarks._common import (
    fmt_spread,
    markdown_table,
    memory_scratch_bytes,
    save_plot,
    time_contenders,
    write_results,
)


NAME = "squared_grads"


def _mlp(key, sizes=(784, 512, 512, 10)):
    keys = jax.random.split(key, len(sizes))
    params = [
        (
            jax.random.normal(k, (m, n), jnp.float32) / math.sqrt(m),
            jnp.zeros((n,), jnp.float32),
        )
        for k, m, n in zip(keys, sizes[:-1], sizes[1:])
    ]

    def loss(params, x, label):
        for w, b in params[:-1]:
            x = jax.nn.relu(x @ w + b)
        w, b = params[-1]
        return -jax.nn.log_softmax(x @ w + b)[label]

    def batch(key, n):
        kx, ky = jax.random.split(key)
        x = jax.random.normal(kx, (n, sizes[0]), jnp.float32)
        return x, jax.random.randint(ky, (n,), 0, sizes[-1])

    return loss, params, batch


def _transformer(key, seq=64, width=128, heads=4):
    d = width // heads
    keys = jax.random.split(key, 6)
    s = 1 / math.sqrt(width)
    params = {
        "wqkv": jax.random.normal(keys[0], (width, 3 * width), jnp.float32) * s,
        "wo": jax.random.normal(keys[1], (width, width), jnp.float32) * s,
        "ln1": jnp.ones((width,), jnp.float32),
        "ln2": jnp.ones((width,), jnp.float32),
        "w1": jax.random.normal(keys[2], (width, 2 * width), jnp.float32) * s,
        "b1": jnp.zeros((2 * width,), jnp.float32),
        "w2": jax.random.normal(keys[3], (2 * width, width), jnp.float32) * s,
        "b2": jnp.zeros((width,), jnp.float32),
    }

    def norm(h, scale):
        return h * scale / jnp.sqrt(jnp.mean(h**2, axis=-1, keepdims=True) + 1e-5)

    def loss(p, x, y):
        h = norm(x, p["ln1"])
        q, k, v = jnp.split(h @ p["wqkv"], 3, axis=-1)
        q, k, v = (z.reshape(seq, heads, d) for z in (q, k, v))
        scores = jnp.einsum("thd,shd->hts", q, k) / math.sqrt(d)
        att = jnp.einsum("hts,shd->thd", jax.nn.softmax(scores, axis=-1), v)
        x = x + att.reshape(seq, width) @ p["wo"]
        h = norm(x, p["ln2"])
        x = x + jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
        return jnp.mean((x - y) ** 2)

    def batch(key, n):
        kx, ky = jax.random.split(key)
        x = jax.random.normal(kx, (n, seq, width), jnp.float32)
        return x, jax.random.normal(ky, (n, seq, width), jnp.float32)

    return loss, params, batch


def _methods(loss):
    def plain(params, *batch):
        summed = lambda p: jnp.sum(jax.vmap(loss, in_axes=(None, 0, 0))(p, *batch))
        return jax.value_and_grad(summed)(params)

    def per_example(params, *batch):
        return jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(params, *batch)

    def vmap_sq(params, *batch):
        grads = per_example(params, *batch)
        return jax.tree.map(lambda g: jnp.sum(g * g, axis=0), grads)

    def vmap_norms(params, *batch):
        grads = per_example(params, *batch)
        return jnp.sqrt(
            sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, 1) for g in jax.tree.leaves(grads))
        )

    return {
        "value_and_grad": plain,
        "vmap(grad) squares": vmap_sq,
        "sum_squared_grads": lambda p, *b: dl.sum_squared_grads(loss, p, *b),
        "value_grad_and_sum_squared_grads": lambda p, *b: dl.value_grad_and_sum_squared_grads(
            loss, p, *b
        ),
        "vmap(grad) norms": vmap_norms,
        "per_example_grad_norms": lambda p, *b: dl.per_example_grad_norms(loss, p, *b),
    }


def run(quick: bool = False) -> list[dict]:
    key = jax.random.key(0)
    if quick:
        models = {
            "mlp": (lambda k: _mlp(k, (784, 128, 128, 10)), (64,)),
            "transformer": (lambda k: _transformer(k, seq=16, width=32), (16,)),
        }
        timing = dict(repeats=3, min_time=0.05, max_time=10.0)
    else:
        models = {"mlp": (_mlp, (256, 1024)), "transformer": (_transformer, (256, 1024))}
        timing = dict(repeats=5, min_time=0.3, max_time=30.0)
    rows = []
    for model_name, (make, sizes) in models.items():
        loss, params, make_batch = make(key)
        for n in sizes:
            batch = make_batch(jax.random.key(n), n)
            methods = _methods(loss)
            timings = time_contenders(
                {method: (fn, (params, *batch)) for method, fn in methods.items()}, **timing
            )
            for method, times in timings.items():
                row = {
                    "model": model_name,
                    "B": n,
                    "method": method,
                    **times,
                    "scratch_MiB": (memory_scratch_bytes(methods[method], params, *batch) or 0)
                    / 2**20,
                }
                rows.append(row)
                line = markdown_table([dict(row, run=fmt_spread(row))], _COLUMNS).splitlines()[-1]
                print(line, flush=True)

    rows = derive({"rows": rows})["rows"]
    print()
    print(markdown_table([dict(r, run=fmt_spread(r)) for r in rows], _COLUMNS))
    write_results(
        NAME,
        rows,
        quick=quick,
        note=(
            "The methods of each model and batch size timed interleaved (round-robin) after "
            "compiling: `run_min_s` is the fastest round, `run_s` the median and `run_max_s` "
            "the slowest (the spread). `time_vs_grad` and `ours_over_vmap` are ratios of the "
            "fastest rounds, each method's (ours) over the other's."
        ),
    )
    plot(rows)
    return rows


_COLUMNS = [
    ("model", "model"),
    ("B", "B"),
    ("method", "method"),
    ("run", "run (fastest, +median spread)"),
    ("compile_s", "compile"),
    ("scratch_MiB", "scratch MiB"),
    ("time_vs_grad", "time / grad"),
    ("scratch_vs_grad", "scratch / grad"),
    ("ours_over_vmap", "ours / vmap(grad)"),
]

# Each of ours, by the per-example `vmap(grad)` reference it is timed against.
REFERENCES = {
    "sum_squared_grads": "vmap(grad) squares",
    "value_grad_and_sum_squared_grads": "vmap(grad) squares",
    "per_example_grad_norms": "vmap(grad) norms",
}


def derive(data: dict) -> dict:
    """`data` with its ratios recomputed from its timings: each method's time (fastest
    round) and scratch over `value_and_grad`'s, and each of ours over its `vmap(grad)`
    reference's."""
    derived = ("time_vs_grad", "scratch_vs_grad", "ours_over_vmap")
    rows = [{k: v for k, v in r.items() if k not in derived} for r in data["rows"]]
    for row in rows:
        by = {r["method"]: r for r in rows if (r["model"], r["B"]) == (row["model"], row["B"])}
        base = by["value_and_grad"]
        row["time_vs_grad"] = row["run_min_s"] / base["run_min_s"]
        row["scratch_vs_grad"] = row["scratch_MiB"] / max(base["scratch_MiB"], 1e-9)
        if row["method"] in REFERENCES:
            row["ours_over_vmap"] = row["run_min_s"] / by[REFERENCES[row["method"]]]["run_min_s"]
    return dict(data, rows=rows)


def plot(rows, out=None):
    groups = sorted({(r["model"], r["B"]) for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        times, scratch = [], []
        for group in groups:
            (row,) = [r for r in rows if (r["model"], r["B"]) == group and r["method"] == method]
            times.append(row["run_min_s"] * 1e3)
            scratch.append(row["scratch_MiB"])
        xs = [i + j * width for i in range(len(groups))]
        axes[0].bar(xs, times, width, label=method)
        axes[1].bar(xs, scratch, width, label=method)
    labels = [f"{m}\nB={n}" for m, n in groups]
    for ax, title in zip(axes, ("run time, fastest round (ms)", "XLA scratch (MiB)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], labels)
        ax.set_yscale("log")
        ax.set_title(title)
    # Below the bars, not over them.
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=3, fontsize=8, frameon=False)
    save_plot(fig, NAME, out, rect=(0, 0.12, 1, 1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, seconds")
    run(quick=parser.parse_args().quick)
