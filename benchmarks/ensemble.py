"""Scaling of `diffrax_linearize.solve_ensemble`: paths per second against device count.

A compute-bound SDE (d=32, dense drift, diagonal noise from a `VirtualBrownianTree`,
Euler, many steps), only the mean and variance returned. Each device count runs in
its own subprocess, since the number of simulated CPU devices
(`--xla_force_host_platform_device_count`) is fixed when JAX starts. Each simulated
device is held to one thread (`--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1`), so that one device uses one core and the comparison
with several devices is honest.

Run: `python -m benchmarks.ensemble [--quick] [--devices 1 2 4]`.
"""

import argparse
import json
import os
import subprocess
import sys


if __package__ in (None, ""):  # run as `python benchmarks/ensemble.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CPU_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
D = 32


def _worker(num_devices: int, quick: bool) -> dict:
    """Runs in the subprocess: times one ensemble solve on `num_devices` devices."""
    import diffrax
    import diffrax_linearize as dl
    import jax
    import jax.numpy as jnp
    import jax.random as jr
    import lineax as lx
    import numpy as np

    from benchmarks._common import time_compiled

    devices = jax.devices()[:num_devices]
    assert len(devices) == num_devices, jax.devices()
    mesh = jax.sharding.Mesh(np.asarray(devices), ("paths",))
    num_paths = 32 if quick else 128
    num_steps = 200 if quick else 1000
    t1 = 1.0
    a = -jnp.eye(D) + 0.5 * jr.normal(jr.key(1), (D, D)) / np.sqrt(D)

    def terms(key):
        bm = diffrax.VirtualBrownianTree(0.0, t1, 1e-3, (D,), key)
        drift = diffrax.ODETerm(lambda t, y, args: jnp.tanh(a @ y))
        diffusion = diffrax.ControlTerm(
            lambda t, y, args: lx.DiagonalLinearOperator(0.2 * jnp.cos(y)), bm
        )
        return diffrax.MultiTerm(drift, diffusion)

    def solve(keys):
        out = dl.solve_ensemble(
            terms,
            diffrax.Euler(),
            0.0,
            t1,
            t1 / num_steps,
            jnp.ones(D),
            keys=keys,
            saveat=diffrax.SaveAt(ts=jnp.linspace(0.0, t1, 11)),
            return_paths=False,
            mesh=mesh,
            max_steps=num_steps + 1,
            throw=False,
        )
        return out.mean, out.var

    keys = jr.split(jr.key(0), num_paths)
    timing = time_compiled(solve, keys, repeats=3 if quick else 5, min_time=0.5)
    return {
        "devices": num_devices,
        "paths": num_paths,
        "steps": num_steps,
        "d": D,
        **timing,
        "paths_per_sec": num_paths / timing["run_s"],
    }


def _spawn(num_devices: int, quick: bool) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={num_devices} {CPU_FLAGS}"
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "benchmarks.ensemble", "--worker", str(num_devices)]
    if quick:
        cmd.append("--quick")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"worker for {num_devices} devices failed:\n{proc.stderr[-4000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def run(quick: bool = False, devices: tuple[int, ...] = (1, 2)) -> list[dict]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks._common import markdown_table, plot_path, write_results

    rows = [_spawn(n, quick) for n in devices]
    base = rows[0]["paths_per_sec"] / rows[0]["devices"]
    for row in rows:
        row["speedup"] = row["paths_per_sec"] / rows[0]["paths_per_sec"]
        row["efficiency"] = row["paths_per_sec"] / (base * row["devices"])
    print(
        markdown_table(
            rows,
            [
                ("devices", "devices"),
                ("paths", "paths"),
                ("steps", "steps"),
                ("compile_s", "compile"),
                ("run_s", "run (median)"),
                ("paths_per_sec", "paths / s"),
                ("speedup", "speedup"),
                ("efficiency", "efficiency"),
            ],
        )
    )
    name = "ensemble-quick" if quick else "ensemble"
    path = write_results(name, rows, xla_flags=CPU_FLAGS, cpu_devices="simulated")
    print(f"wrote {path}")

    fig, ax = plt.subplots(figsize=(5, 3.5))
    n = [r["devices"] for r in rows]
    ax.plot(n, [r["paths_per_sec"] for r in rows], "o-", label="measured")
    ax.plot(n, [base * k for k in n], "k--", lw=1, label="ideal (linear)")
    ax.set_xlabel("simulated CPU devices")
    ax.set_ylabel("paths / s")
    ax.set_xticks(n)
    ax.set_title(f"solve_ensemble, d={D} SDE, Euler")
    ax.legend()
    fig.tight_layout()
    fig.savefig(plot_path(name), dpi=120)
    plt.close(fig)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker is not None:
        print("RESULT " + json.dumps(_worker(ns.worker, ns.quick), default=float))
    else:
        run(quick=ns.quick, devices=tuple(ns.devices))
