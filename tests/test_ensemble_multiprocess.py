"""`solve_ensemble` across JAX processes: the multi-host recipe of `docs/ensembles.md`, as
`examples/ensemble_multiprocess.py`, run as several processes on 127.0.0.1 (gloo CPU
collectives, one CPU device per process).

Every test bounds its run time and stops the processes it started (only those: they are
killed by process id, and die with the test process if it is killed itself).
"""

import pathlib
import re
import sys
import textwrap
import time

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_equal_to_rounding


ROOT = pathlib.Path(__file__).parent.parent
sys.path.insert(0, str(ROOT))
from examples import ensemble_multiprocess as example  # noqa: E402


pytestmark = pytest.mark.multiprocess

PATHS, STEPS, DIM, SEED = 16, 20, 3, 7
# Seconds: a whole run (start, join, compile, solve) takes 10-30 s on the shared 2-core
# machine; a hang would otherwise last until JAX's own timeouts (5 minutes).
RUN_TIMEOUT = 240
ARGS = ["--paths", str(PATHS), "--steps", str(STEPS), "--dim", str(DIM), "--seed", str(SEED)]


def _report(procs) -> str:
    return "\n".join(
        f"--- process {p.process_id}: exit {p.returncode}"
        f"{' (killed by the test)' if p.killed else ''}\n"
        f"stdout:\n{p.stdout[-2000:]}\nstderr:\n{p.stderr[-4000:]}"
        for p in procs
    )


def _run(tmp_path, num_processes, args, timeout=RUN_TIMEOUT):
    args = [*args, "--num-processes", str(num_processes), "--out", str(tmp_path)]
    procs = example.start_local(num_processes, example.worker_argv(args), tmp_path)
    finished = example.wait_local(procs, timeout)
    assert finished, f"not finished within {timeout} s, so stopped:\n{_report(procs)}"
    assert all(p.returncode == 0 for p in procs), _report(procs)
    return procs


def _reference():
    """All paths, one process, one device: `jax.vmap` of `diffrax.diffeqsolve`."""
    with jax.enable_x64(False):  # as the processes run, float32
        terms = example.make_terms(DIM)
        keys = jax.random.split(jax.random.key(SEED), PATHS)
        saveat = diffrax.SaveAt(ts=jnp.linspace(example.T0, example.T1, 11))
        dt0 = (example.T1 - example.T0) / STEPS

        def solve(key):
            sol = diffrax.diffeqsolve(
                terms(key),
                diffrax.Euler(),
                example.T0,
                example.T1,
                dt0,
                jnp.ones(DIM),
                1.0,
                saveat=saveat,
            )
            return sol.ys

        return np.asarray(jax.jit(jax.vmap(solve))(keys)), np.asarray(saveat.subs.ts)


# Processes that each compile the solve: 12-20 s on two cores for the two, the slow tier
# (`make test` keeps test_killed_process_stops_the_others, which starts processes too).
@pytest.mark.slow
@pytest.mark.parametrize("num_processes", [2, pytest.param(4, id="4 (4 compiles)")])
def test_recipe_matches_vmap(tmp_path, num_processes):
    _run(tmp_path, num_processes, [*ARGS, "--return-paths"])
    expected, ts = _reference()
    results = [dict(np.load(tmp_path / f"process-{i}.npz")) for i in range(num_processes)]
    for i, r in enumerate(results):
        assert r["process_count"] == num_processes and r["device_count"] == num_processes
        assert r["ys"].dtype == np.float32
        # Every process gathered every path: each equals its own unsharded solve.
        assert_equal_to_rounding(r["ys"], expected)
        np.testing.assert_array_equal(r["ts"], ts)
        assert r["num_failed"] == 0
        # The reductions crossed processes (`psum` over gloo) and are replicated.
        np.testing.assert_allclose(r["mean"], expected.mean(0), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(r["var"], expected.var(0), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(
            r["quantiles"], np.quantile(expected, (0.05, 0.5, 0.95), axis=0), rtol=1e-6, atol=1e-6
        )
        for key in ("mean", "var", "quantiles", "ys"):
            np.testing.assert_array_equal(r[key], results[0][key], err_msg=f"{key}, process {i}")


def _wait_for(proc, text, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in proc.stderr:
            return
        if proc.popen.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"process {proc.process_id} never printed {text!r}")


@pytest.mark.parametrize(
    "victim", [pytest.param(1, marks=pytest.mark.slow), 0], ids=["worker", "coordinator"]
)
def test_killed_process_stops_the_others(tmp_path, victim):
    # A short heartbeat timeout, as a cluster job would choose; JAX's default is 100 s.
    # The coordinator notices a killed worker only by it (most of this test's time).
    args = [*ARGS, "--num-processes", "2", "--heartbeat-timeout", "5"]
    procs = example.start_local(2, example.worker_argv(args), tmp_path)
    try:
        _wait_for(procs[victim], "joined:", timeout=120)
        procs[victim].popen.kill()
        killed_at = time.monotonic()
        finished = example.wait_local(procs, timeout=90)
    finally:
        example.stop_local(procs)
    (survivor,) = [p for p in procs if p.process_id != victim]
    assert finished and survivor.returncode != 0, _report(procs)
    assert survivor.ended - killed_at < 60, _report(procs)
    # Either the collective with the dead process fails (gloo), or JAX's coordination
    # service notices the missing heartbeats; both say what happened.
    clear = ("Gloo all-reduce failed", "another task died")
    assert any(m in survivor.stderr for m in clear), _report(procs)


@pytest.mark.slow
def test_wrong_num_processes_fails_in_bounded_time(tmp_path):
    # Two processes, each told there are three: the third never joins.
    args = [*ARGS, "--num-processes", "3", "--join-timeout", "5"]
    argv = example.worker_argv(args)
    procs = example.start_local(2, argv, tmp_path)
    started = time.monotonic()
    finished = example.wait_local(procs, timeout=90)
    assert finished, _report(procs)
    for p in procs:
        assert p.returncode != 0, _report(procs)
        assert p.ended - started < 60, _report(procs)
        assert "waiting up to 5 s for all 3 processes" in p.stderr, _report(procs)
        assert "DEADLINE_EXCEEDED" in p.stderr, _report(procs)


def _region(text: str, name: str) -> str:
    match = re.search(rf"# --8<-- \[start:{name}\]\n(.*?)\n *# --8<-- \[end:{name}\]", text, re.S)
    assert match, name
    return textwrap.dedent(match.group(1))


def test_docs_quote_the_example():
    # The docs show the example's code verbatim, so they cannot drift from what runs here.
    source = (ROOT / "examples" / "ensemble_multiprocess.py").read_text()
    docs = (ROOT / "docs" / "ensembles.md").read_text()
    for name in ("initialize", "solve"):
        assert _region(source, name) in docs, f"docs/ensembles.md lacks the {name!r} code"
