"""A Monte Carlo ensemble over several JAX processes: the multi-host recipe of
`docs/ensembles.md`, runnable as it stands (the docs quote this file, and
`tests/test_ensemble_multiprocess.py` runs it).

On a cluster, start one copy per host (or per accelerator), for example with `RANK` set
by your launcher:

    python examples/ensemble_multiprocess.py --coordinator 10.0.0.1:1234 \\
        --num-processes 4 --process-id $RANK

Under a cluster manager that JAX detects (Slurm, Open MPI, Kubernetes with JobSet, Cloud
TPU), leave out all three. To try it on one machine, `--local N` starts N processes on
127.0.0.1 (the coordinator on a free port, listening on loopback only), each pinned to
its own CPU cores with one CPU device, waits for them (at most `--timeout` seconds) and
prints what they printed:

    python examples/ensemble_multiprocess.py --local 2

Every process prints the reductions it received, and with `--out DIR` writes them to
`DIR/process-<i>.npz`.
"""

import argparse
import contextlib
import ctypes
import dataclasses
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback


T0, T1 = 0.0, 1.0


def make_terms(d: int):
    """The SDE of the usage example in `docs/ensembles.md`: $dy = -a y\\,dt + 0.2
    \\cos(y)\\,dW$ in $d$ dimensions, diagonal noise, one Brownian motion per key."""
    import diffrax
    import jax.numpy as jnp
    import lineax as lx

    def terms(key):
        bm = diffrax.VirtualBrownianTree(T0, T1, tol=1e-3, shape=(d,), key=key)
        drift = diffrax.ODETerm(lambda t, y, args: -args * y)
        diffusion = diffrax.ControlTerm(
            lambda t, y, args: lx.DiagonalLinearOperator(0.2 * jnp.cos(y)), bm
        )
        return diffrax.MultiTerm(drift, diffusion)

    return terms


def join(coordinator, num_processes, process_id, join_timeout=120, heartbeat_timeout=20):
    """Joins this process to the others: `jax.distributed.initialize`. Must come before
    anything else touches JAX's devices."""
    # --8<-- [start:initialize]
    import jax

    # CPU devices of different processes talk through gloo; GPUs and TPUs need no setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Under a cluster manager that JAX detects (Slurm, Open MPI, Kubernetes with JobSet,
    # Cloud TPU) the first three arguments may be left out.
    jax.distributed.initialize(
        coordinator_address=coordinator,  # "host:port" of process 0, the same everywhere
        num_processes=num_processes,
        process_id=process_id,  # 0, 1, ..., num_processes - 1
        # Without these, a process that never starts holds the others for 5 minutes, and
        # one that dies is noticed only after 100 s.
        initialization_timeout=join_timeout,
        heartbeat_timeout_seconds=heartbeat_timeout,
    )
    # --8<-- [end:initialize]


def solve(terms, y0, num_paths, num_steps, *, seed=0, chunk_size=None, return_paths=False):
    """The ensemble, on every device of every process. Returns numpy arrays, the same on
    every process: `(ts, mean, var, quantiles, num_failed, ys)`, `ys` (all paths, gathered
    from every process) only with `return_paths=True`."""
    t0, t1, dt0 = T0, T1, (T1 - T0) / num_steps
    ys = None
    # --8<-- [start:solve]
    import diffrax
    import diffrax_linearize as dl
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.multihost_utils import process_allgather
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.asarray(jax.devices()), ("paths",))  # every process's devices
    # The keys as a global array, sharded like the paths: each process makes (and
    # solves) only the keys of its own devices.
    make_keys = jax.jit(
        lambda: jax.random.split(jax.random.key(seed), num_paths),
        out_shardings=NamedSharding(mesh, P("paths")),
    )
    out = dl.solve_ensemble(
        terms,
        diffrax.Euler(),
        t0,
        t1,
        dt0,
        y0,
        1.0,  # args
        keys=make_keys(),
        mesh=mesh,
        saveat=diffrax.SaveAt(ts=jnp.linspace(t0, t1, 11)),
        quantiles=(0.05, 0.5, 0.95),
        chunk_size=chunk_size,
        return_paths=return_paths,
    )
    # The reductions are replicated on every device of every process: each may read them.
    mean, var, quantiles = np.asarray(out.mean), np.asarray(out.var), np.asarray(out.quantiles)
    if return_paths:
        # The paths are sharded across processes; this copies all of them to every one.
        ys = process_allgather(out.paths.ys, tiled=True)
    # --8<-- [end:solve]
    return np.asarray(out.ts), mean, var, quantiles, int(out.num_failed), ys


_START = time.monotonic()


def _say(process_id, num_processes, message):
    elapsed = time.monotonic() - _START
    print(
        f"[process {process_id} of {num_processes}, {elapsed:.1f} s] {message}",
        file=sys.stderr,
        flush=True,
    )


def worker(ns) -> None:
    """One process of the ensemble."""
    i, n = ns.process_id, ns.num_processes
    _say(
        i,
        n,
        f"joining the coordinator at {ns.coordinator}; waiting up to {ns.join_timeout} s "
        f"for all {n} processes (if one never starts, or `--num-processes` is wrong, "
        "JAX stops with DEADLINE_EXCEEDED below)",
    )
    join(ns.coordinator, n, i, ns.join_timeout, ns.heartbeat_timeout)
    import jax
    import jax.numpy as jnp
    import numpy as np

    if jax.process_count() != n:
        raise RuntimeError(
            f"this process was started with `--num-processes {n}`, but the coordinator "
            f"at {ns.coordinator} was started with {jax.process_count()}: pass the same "
            "`--num-processes` to every process."
        )
    _say(i, n, f"joined: {jax.process_count()} processes, {jax.device_count()} devices in all")
    ts, mean, var, quantiles, num_failed, ys = solve(
        make_terms(ns.dim),
        jnp.ones(ns.dim),
        ns.paths,
        ns.steps,
        seed=ns.seed,
        chunk_size=ns.chunk_size,
        return_paths=ns.return_paths,
    )
    _say(i, n, "solved")
    with np.printoptions(precision=4, suppress=True):
        print(
            f"[process {i} of {n}] {ns.paths} paths on {jax.device_count()} devices: "
            f"mean at t={ts[-1]:g}: {mean[-1, :4]}..., var: {var[-1, :4]}..., "
            f"median: {quantiles[1, -1, :4]}...; {num_failed} failed",
            flush=True,
        )
    if ns.out is not None:
        extra = {} if ys is None else {"ys": ys}
        out = pathlib.Path(ns.out) / f"process-{i}.npz"
        np.savez(
            out,
            ts=ts,
            mean=mean,
            var=var,
            quantiles=quantiles,
            num_failed=num_failed,
            process_count=jax.process_count(),
            device_count=jax.device_count(),
            **extra,
        )
    _say(i, n, "done")


#
# Several processes on one machine
#


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_cores(num_processes: int, cores_per_process: int | None = None) -> list[set[int]]:
    """Disjoint sets of this process's CPU cores, one per process (shared round-robin when
    there are fewer cores than processes). Each process's XLA then sizes its thread pool to
    its own cores, instead of every process running one thread per core of the machine."""
    cores = sorted(os.sched_getaffinity(0))
    per = cores_per_process or max(1, len(cores) // num_processes)
    return [{cores[(i * per + k) % len(cores)] for k in range(per)} for i in range(num_processes)]


# How `start_local` tells each process its cores and its parent: read by `local_setup`
# in the new process itself (not in a `preexec_fn`, which is unsafe to run in a forked
# copy of a multithreaded parent such as one that has imported JAX).
_CPUS_ENV, _PARENT_ENV = "ENSEMBLE_LOCAL_CPUS", "ENSEMBLE_LOCAL_PARENT"


def local_setup() -> None:
    """In a process started by `start_local`, before JAX is imported: pin this process
    to its cores, and have it killed when its parent (the launcher or test) dies."""
    if cpus := os.environ.get(_CPUS_ENV):
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    if parent := os.environ.get(_PARENT_ENV):
        with contextlib.suppress(Exception):  # Linux only
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != int(parent):  # the parent died before that
            os._exit(1)


@dataclasses.dataclass
class LocalProcess:
    """One process started by `start_local`; its output goes to two files."""

    process_id: int
    popen: subprocess.Popen
    stdout_path: pathlib.Path
    stderr_path: pathlib.Path
    started: float
    ended: float | None = None
    killed: bool = False

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode


def start_local(num_processes, argv, log_dir, *, cores=None, env=None) -> list[LocalProcess]:
    """Starts `num_processes` processes on this machine, `argv(process_id, coordinator)`
    each (a list of strings), with the coordinator on a free port of 127.0.0.1 and
    listening only there, on CPU devices, pinned to `cores[process_id]` (a set of core
    numbers, or `None` for all; default `split_cores`). Output goes to files in
    `log_dir`. Each process must call `local_setup` before it imports JAX. (Linux kills
    them when the thread that started them ends: call this from the main thread.)"""
    coordinator = f"127.0.0.1:{free_port()}"
    cores = split_cores(num_processes) if cores is None else cores
    log_dir = pathlib.Path(log_dir)
    procs = []
    for i in range(num_processes):
        child_env = dict(os.environ if env is None else env)
        child_env.update(
            JAX_PLATFORMS="cpu",
            JAX_COORDINATOR_BIND_ADDRESS=coordinator,
            PYTHONUNBUFFERED="1",
            **{_PARENT_ENV: str(os.getpid())},
        )
        if cores[i] is not None:
            child_env[_CPUS_ENV] = ",".join(map(str, sorted(cores[i])))
        out, err = log_dir / f"process-{i}.stdout", log_dir / f"process-{i}.stderr"
        with open(out, "wb") as fout, open(err, "wb") as ferr:
            popen = subprocess.Popen(
                argv(i, coordinator),
                stdout=fout,
                stderr=ferr,
                stdin=subprocess.DEVNULL,
                env=child_env,
            )
        procs.append(LocalProcess(i, popen, out, err, time.monotonic()))
    return procs


def wait_local(procs: list[LocalProcess], timeout: float) -> bool:
    """Waits for every process to exit, at most `timeout` seconds; then kills (SIGKILL)
    those still running. Returns whether all exited by themselves. Always leaves every
    process of `procs` stopped and reaped."""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            for p in procs:
                if p.ended is None and p.popen.poll() is not None:
                    p.ended = time.monotonic()
            if all(p.ended is not None for p in procs):
                return True
            time.sleep(0.05)
        return False
    finally:
        stop_local(procs)


def stop_local(procs: list[LocalProcess]) -> None:
    """Kills (SIGKILL) and reaps every process of `procs` still running."""
    for p in procs:
        if p.popen.poll() is None:
            p.popen.kill()
            p.killed = True
    for p in procs:
        p.popen.wait()
        if p.ended is None:
            p.ended = time.monotonic()


def worker_argv(args: list[str]):
    """`argv(process_id, coordinator)` for `start_local`: this script as one worker."""

    def argv(i, coordinator):
        return [sys.executable, os.path.abspath(__file__), *args] + [
            "--coordinator",
            coordinator,
            "--process-id",
            str(i),
        ]

    return argv


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def launch(num_processes: int, args: list[str], timeout: float) -> int:
    with tempfile.TemporaryDirectory() as log_dir:
        args = [*args, "--num-processes", str(num_processes)]
        procs = start_local(num_processes, worker_argv(args), log_dir)
        finished = wait_local(procs, timeout)
        for p in procs:
            print(_tail(p.stdout), flush=True)
        failed = [p for p in procs if p.returncode != 0]
        for p in failed:
            how = "was stopped after the timeout" if p.killed else f"exited with {p.returncode}"
            print(f"\nprocess {p.process_id} {how}; its stderr:\n{_tail(p.stderr)}", flush=True)
        if not finished:
            print(f"\nnot every process finished within --timeout {timeout} s", flush=True)
        return 1 if failed or not finished else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local", type=int, metavar="N", help="start N processes here")
    parser.add_argument("--timeout", type=float, default=600.0, help="with --local, seconds")
    parser.add_argument("--coordinator", help="host:port of process 0")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--join-timeout", type=int, default=120, help="seconds")
    parser.add_argument("--heartbeat-timeout", type=int, default=20, help="seconds")
    parser.add_argument("--paths", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument(
        "--return-paths", action="store_true", help="also gather every path on every process"
    )
    parser.add_argument("--out", help="directory for process-<i>.npz")
    ns = parser.parse_args(argv)
    if ns.local is not None:
        return launch(ns.local, _worker_args(ns), ns.timeout)
    try:
        local_setup()
        worker(ns)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        # Leave at once: JAX's exit would wait at a shutdown barrier for the other
        # processes, which may be the ones that failed.
        os._exit(1)
    return 0


def _worker_args(ns) -> list[str]:
    """The options that `--local` passes on to each of its processes."""
    args = [
        "--join-timeout",
        str(ns.join_timeout),
        "--heartbeat-timeout",
        str(ns.heartbeat_timeout),
    ]
    args += ["--paths", str(ns.paths), "--steps", str(ns.steps), "--dim", str(ns.dim)]
    args += ["--seed", str(ns.seed)]
    if ns.chunk_size is not None:
        args += ["--chunk-size", str(ns.chunk_size)]
    if ns.return_paths:
        args.append("--return-paths")
    if ns.out is not None:
        args += ["--out", os.path.abspath(ns.out)]
    return args


if __name__ == "__main__":
    sys.exit(main())
