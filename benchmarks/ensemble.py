"""Scaling of `diffrax_linearize.solve_ensemble`: paths per second against CPU devices and
JAX processes, one core per device.

A compute-bound SDE (d=32, dense `tanh` drift, diagonal noise from a
`VirtualBrownianTree`, Euler, many steps), only the mean and variance returned. Each
configuration runs in fresh processes (the device count of a process is fixed when JAX
starts), each pinned to its own cores:

- 1 process, 1 device, 1 core: the baseline;
- 1 process, 2 simulated devices (`--xla_force_host_platform_device_count=2`), 2 cores;
- 2 processes, 1 device each, 1 core each: `jax.distributed` on 127.0.0.1 with gloo
  collectives, as `examples/ensemble_multiprocess.py` (the multi-host recipe) runs them;
- 1 process, 1 device, 2 cores: not a scaling point, but the reason for pinning. XLA's
  CPU compiler splits every large enough loop fusion over a thread pool the size of the
  process's cores; for the small per-step operations of an SDE solve, that costs more
  than it gains, so one device with two cores is slower than with one.

The configurations are timed interleaved: round after round, each configuration is started
afresh in its turn (A B C D A B C D ...) and times a few calls, so that a machine whose load
drifts slows every configuration alike. A configuration's time is its fastest call over all
rounds (load only ever adds time), with the median and slowest beside it (the spread).

Speedup is against the baseline, by fastest calls; efficiency is speedup per core used. CPU
time (of all threads, summed over processes) per call, against the baseline's, shows the
overhead directly, and moves less than wall-clock time when other jobs share the machine.

Run: `python -m benchmarks.ensemble [--quick]`, or `--gpu` for one device of the default
backend, in this process. Writes the JSON and plot, prints the table, and (full runs)
regenerates the tables in `docs/ensembles.md` and the README via `benchmarks.report`.
"""

import argparse
import json
import os
import sys
import tempfile
import traceback


if __package__ in (None, ""):  # run as `python benchmarks/ensemble.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples import ensemble_multiprocess as example


D = 32
# (processes, devices per process, cores per process).
CONFIGS = ((1, 1, 1), (1, 2, 2), (2, 1, 1), (1, 1, 2))


def _sizes(quick: bool) -> tuple[int, int]:
    return (32, 200) if quick else (256, 1000)  # paths, steps


def _worker(quick: bool, repeats: int) -> dict:
    """Times one ensemble solve on all devices of all processes (after
    `jax.distributed.initialize`, if there are several)."""
    import time

    import diffrax
    import diffrax_linearize as dl
    import jax
    import jax.numpy as jnp
    import jax.random as jr
    import lineax as lx
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from benchmarks._common import _cpu_time, block

    mesh = Mesh(np.asarray(jax.devices()), ("paths",))
    num_paths, num_steps = _sizes(quick)
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

    make_keys = jax.jit(
        lambda: jr.split(jr.key(0), num_paths), out_shardings=NamedSharding(mesh, P("paths"))
    )
    keys = make_keys()
    t0 = time.perf_counter()
    compiled = jax.jit(solve).lower(keys).compile()
    compile_s = time.perf_counter() - t0
    block(compiled(keys))  # warm-up
    # A fixed number of calls: with several processes, every one must make the same calls
    # (each call ends in a collective), so no process may decide on its own to stop.
    times, cpu_times = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), _cpu_time()
        block(compiled(keys))
        times.append(time.perf_counter() - t0)
        cpu_times.append(_cpu_time() - c0)
    return {
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "paths": num_paths,
        "steps": num_steps,
        "d": D,
        "compile_s": compile_s,
        "times": times,
        "cpu_times": cpu_times,
    }


def _spawn(processes: int, devices: int, cores: int, quick: bool, repeats: int) -> dict:
    """One configuration in fresh processes, pinned to cores of their own."""
    available = sorted(os.sched_getaffinity(0))
    needed = processes * cores
    if needed > len(available):
        raise RuntimeError(f"{processes} x {cores} cores needed, {len(available)} available")
    core_sets = [set(available[i * cores : (i + 1) * cores]) for i in range(processes)]
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")

    def argv(i, coordinator):
        cmd = [sys.executable, "-m", "benchmarks.ensemble", "--worker", "--repeats", str(repeats)]
        cmd += ["--quick"] if quick else []
        if processes > 1:
            cmd += ["--coordinator", coordinator, "--processes", str(processes)]
            cmd += ["--process-id", str(i)]
        return cmd

    with tempfile.TemporaryDirectory() as log_dir:
        procs = example.start_local(processes, argv, log_dir, cores=core_sets, env=env)
        finished = example.wait_local(procs, timeout=1800)
        failed = [p for p in procs if p.returncode != 0]
        if failed or not finished:
            raise RuntimeError(
                f"{processes} process(es) x {devices} device(s) failed:\n"
                + "\n".join(f"process {p.process_id}:\n{p.stderr[-4000:]}" for p in procs)
            )
        results = []
        for p in procs:
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")][-1]
            results.append(json.loads(line[len("RESULT ") :]))
    # Wall-clock times are process 0's (every call ends in a collective, so the processes
    # keep step); CPU time is the sum over processes.
    row = results[0]
    assert (row["processes"], row["devices"]) == (processes, processes * devices), row
    cpu_times = [sum(c) for c in zip(*(r["cpu_times"] for r in results))]
    return {**row, "cpu_times": cpu_times, "cores": needed}


def _combine(rounds: list[dict]) -> dict:
    """One configuration's row from its rounds: the fastest call over all of them, with the
    median and slowest (the spread), the median CPU time per call, the fastest compile."""
    import statistics

    from benchmarks._common import summarise_times

    times = [t for r in rounds for t in r["times"]]
    row = {k: v for k, v in rounds[0].items() if k not in ("times", "cpu_times")}
    row.update(
        compile_s=min(r["compile_s"] for r in rounds),
        **summarise_times(times),
        cpu_s=statistics.median(c for r in rounds for c in r["cpu_times"]),
        # Each call is timed alone; `spawns` is the number of fresh starts they came from.
        rounds=len(times),
        repeats=len(times),
        spawns=len(rounds),
    )
    row["paths_per_sec"] = row["paths"] / row["run_min_s"]
    return row


def _plot(rows, name):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks._common import save_plot

    base = rows[0]["paths_per_sec"]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    scaling = [r for r in rows if r["cores"] == r["devices"]]
    one_process = [r for r in scaling if r["processes"] == 1]
    many = [rows[0]] + [r for r in scaling if r["processes"] > 1]
    cores = sorted({r["cores"] for r in rows})
    ax.plot(cores, [base * c for c in cores], "k--", lw=1, label="ideal: linear in cores")
    ax.plot(
        [r["devices"] for r in one_process],
        [r["paths_per_sec"] for r in one_process],
        "o-",
        label="devices of one process",
    )
    if len(many) > 1:
        ax.plot(
            [r["devices"] for r in many],
            [r["paths_per_sec"] for r in many],
            "s-",
            label="processes, one device each",
        )
    for r in rows:
        if r["cores"] != r["devices"]:
            ax.plot(r["cores"], r["paths_per_sec"], "x", ms=9, color="C3")
            ax.annotate(
                "1 device on 2 cores",
                (r["cores"], r["paths_per_sec"]),
                textcoords="offset points",
                xytext=(-10, -14),
                ha="right",
                fontsize=8,
            )
    ax.set_xlabel("CPU cores (one per device)")
    ax.set_ylabel("paths / s")
    ax.set_xticks(cores)
    ax.set_ylim(bottom=0)
    ax.set_title(f"solve_ensemble, d={D} SDE, Euler, {rows[0]['steps']} steps")
    ax.legend(fontsize=8)
    save_plot(fig, name)


COLUMNS = [
    ("processes", "processes"),
    ("devices", "devices"),
    ("cores", "cores"),
    ("run", "run: fastest (spread)"),
    ("paths_per_sec", "paths / s (fastest)"),
    ("speedup", "speedup"),
    ("efficiency", "efficiency"),
    ("cpu_ratio", "CPU time / baseline"),
]


def table(rows) -> str:
    """The Markdown table of `docs/ensembles.md`: eight columns, then a line with the
    problem size (paths and steps per configuration) and a pointer to the JSON for the
    compile and CPU times."""
    from benchmarks._common import fmt_spread, fmt_time, markdown_table

    sizes = sorted({(r.get("paths"), r.get("steps")) for r in rows})
    size = "; ".join(f"{p} paths of {s} steps" for p, s in sizes)
    if all("rounds" in r for r in rows):
        cells = [dict(r, run=fmt_spread(r)) for r in rows]
        how = (
            ", timed interleaved with the others (rounds of fresh processes, A B C D A B C D"
            " ...): its fastest call, and in brackets how far its median call lay above it"
        )
        columns = COLUMNS
    else:  # a result from before the configurations were timed interleaved
        cells = [dict(r, run=fmt_time(r["run_s"])) for r in rows]
        how = " (the median of its calls)"
        columns = [
            (k, {"run": "run (median)", "paths_per_sec": "paths / s"}.get(k, h)) for k, h in COLUMNS
        ]
    return (
        markdown_table(cells, columns)
        + f"\n\nEach configuration solves {size}{how}. Compile and CPU times per configuration"
        " are in `benchmarks/results/ensemble-cpu-cpu.json`."
    )


def summary(rows) -> str:
    """The one-line figure of the README."""

    def find(processes, devices):
        for r in rows:
            if (r["processes"], r["devices"], r["cores"]) == (processes, devices, devices):
                return r
        return None

    base, two_devices, two_processes = find(1, 1), find(1, 2), find(2, 2)
    parts = [f"{base['paths_per_sec']:.0f} paths/s on 1 core"]
    for r, what in ((two_devices, "2 devices of one process"), (two_processes, "2 processes")):
        if r is not None:
            parts.append(f"{r['paths_per_sec']:.0f} on {what} ({r['efficiency']:.2f} efficiency)")
    return "; ".join(parts)


def run(quick: bool = False, gpu: bool = False) -> list[dict]:
    from benchmarks._common import write_results

    # Rounds of a few calls per configuration, interleaved (A B C D A B C D ...).
    rounds, repeats = (2, 2) if quick else (3, 3)
    if gpu:
        rows = [_combine([{**_worker(quick, rounds * repeats), "cores": None}])]
    else:
        timed = {config: [] for config in CONFIGS}
        for _ in range(rounds):
            for p, d, c in CONFIGS:
                timed[(p, d, c)].append(_spawn(p, d, c, quick, repeats))
        rows = [_combine(timed[config]) for config in CONFIGS]
    base = rows[0]["paths_per_sec"]
    for row in rows:
        row["speedup"] = row["paths_per_sec"] / base
        row["efficiency"] = None if row["cores"] is None else row["speedup"] / row["cores"]
        # How much more CPU time the same paths took than on one core: the overhead.
        row["cpu_ratio"] = row["cpu_s"] / rows[0]["cpu_s"]
    print(table(rows))
    name = "ensemble-quick" if quick else "ensemble"
    notes = {"timing": "interleaved rounds; fastest call, median and slowest"}
    if not gpu:
        notes |= {"cpu_devices": "simulated", "pinned": "each process to its cores"}
    path = write_results(name, rows, **notes)
    print(f"wrote {path}")
    if not gpu:
        _plot(rows, name)
    if not quick:
        from benchmarks import report

        report.main([])
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--gpu", action="store_true", help="one device, this process")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=7, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker:
        try:
            example.local_setup()
            if ns.processes > 1:
                example.join(ns.coordinator, ns.processes, ns.process_id)
            row = _worker(ns.quick, ns.repeats)
            print("RESULT " + json.dumps(row, default=float), flush=True)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)  # not JAX's exit, which would wait for the other processes
    else:
        run(quick=ns.quick, gpu=ns.gpu)
