"""Shared timing, result-writing and plotting helpers for the benchmark scripts.

Every benchmark reports compile time separately from run time, times its contenders
interleaved ([`time_contenders`][]) and compares their fastest rounds, with the spread
(median and slowest round) beside them, and writes
`benchmarks/results/<name>-<platform>-<device>.json` (with the versions and machine it ran
on) and a PNG plot beside it.
"""

import datetime
import json
import math
import os
import pathlib
import platform
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax


# Recorded results live in `benchmarks/results/`; quick and demo runs write to
# `benchmarks/results/quick/` (not committed) so they never overwrite recorded ones.
RESULTS = pathlib.Path(
    os.environ.get("DIFFRAX_LINEARIZE_RESULTS", pathlib.Path(__file__).parent / "results")
)


def block(x):
    return jax.block_until_ready(x)


def time_compiled(
    fn: Callable, *args, repeats: int = 7, min_time: float = 0.2, max_time: float = 30.0
) -> dict[str, float]:
    """Compile `jax.jit(fn)` on `args`, then time it.

    Returns `{"compile_s": ..., "run_s": median, "run_min_s": ..., "cpu_s": ...}`, where
    `cpu_s` is the median CPU time of this process (all its threads) per call: on a busy
    machine, less disturbed by other processes than the wall-clock `run_s`. Repeats until
    both `repeats` runs and `min_time` seconds are reached, stopping early past `max_time`.
    """
    return time_compiled_output(
        fn, *args, repeats=repeats, min_time=min_time, max_time=max_time, warmup=True
    )[1]


def time_compiled_output(
    fn: Callable,
    *args,
    repeats: int = 3,
    min_time: float = 0.0,
    max_time: float = 30.0,
    warmup: bool = False,
) -> tuple[Any, dict[str, float]]:
    """As [`time_compiled`][], also returning the output of the first timed run. Without a
    warm-up by default: for solves of seconds to minutes (the stiff benchmark), where a
    discarded run would double the cost and the first run is not slower."""
    jitted = jax.jit(fn)
    t0 = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    if warmup:
        block(compiled(*args))
    times, cpu_times, out = [], [], None
    start = time.perf_counter()
    while True:
        t0, c0 = time.perf_counter(), _cpu_time()
        result = block(compiled(*args))
        times.append(time.perf_counter() - t0)
        cpu_times.append(_cpu_time() - c0)
        if out is None:
            out = result
        elapsed = time.perf_counter() - start
        if (len(times) >= repeats and elapsed >= min_time) or elapsed > max_time:
            break
    return out, {
        "compile_s": compile_s,
        "run_s": statistics.median(times),
        "run_min_s": min(times),
        "cpu_s": statistics.median(cpu_times),
        "repeats": len(times),
    }


def _cpu_time() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def time_eager(fn: Callable, *args, repeats: int = 5) -> dict[str, float]:
    """Time an un-jitted call: the first call (with any compilation) and the median of
    `repeats` later calls."""
    t0 = time.perf_counter()
    block(fn(*args))
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        block(fn(*args))
        times.append(time.perf_counter() - t0)
    return {"first_s": first_s, "run_s": statistics.median(times)}


def memory_scratch_bytes(fn: Callable, *args) -> int | None:
    """XLA's temporary (scratch) allocation for `jax.jit(fn)` on `args`, if reported."""
    compiled = jax.jit(fn).lower(*args).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    return int(analysis.temp_size_in_bytes)


def machine() -> dict[str, Any]:
    """The versions and machine a result came from."""
    import importlib.metadata as md

    versions = {}
    for pkg in ("jax", "jaxlib", "diffrax", "equinox", "lineax", "diffrax_linearize"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    device = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "platform": device.platform,
        "device": device.device_kind,
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "versions": versions,
    }


def result_stem(name: str) -> str:
    device = jax.devices()[0]
    kind = "".join(c if c.isalnum() else "-" for c in device.device_kind.lower()).strip("-")
    return f"{name}-{device.platform}-{kind or 'unknown'}"


def write_results(name: str, rows: Sequence[dict], **extra) -> pathlib.Path:
    """Write rows and the machine description to `benchmarks/results/`. Returns the path.

    A note on the state of the machine (`"busy shared 2-core machine: rough"`), from the
    environment variable `DIFFRAX_LINEARIZE_MACHINE_NOTE`, is recorded as `machine_note`
    (unless `extra` has one). `extra` may hold the run's `machine`, taken once, where the
    run stamps its rows with its date (a partial re-run)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{result_stem(name)}.json"
    note = os.environ.get("DIFFRAX_LINEARIZE_MACHINE_NOTE")
    if note and "machine_note" not in extra:
        extra = {**extra, "machine_note": note}
    run_machine = extra.pop("machine", None) or machine()
    payload = {"benchmark": name, "machine": run_machine, **extra, "rows": list(rows)}
    path.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    return path


def recorded_result(name: str) -> dict | None:
    """The recorded result `name` (its JSON), or `None` when there is none yet."""
    path = RESULTS / f"{result_stem(name)}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def kept_rows(
    name: str, rerun: Callable[[dict], bool], carry: Sequence[str] = ()
) -> tuple[list[dict], list[dict]]:
    """For a partial re-run (`python -m benchmarks.structure --fields nbody --update`): the
    rows of the recorded result `name` that this run does not re-measure (`rerun(row)` is
    false), each stamped with the date (`recorded`) of the run that measured it, and the
    earlier runs those rows come from (their `machine`, `machine_note` and the entries of
    the record named in `carry`, such as the peers' versions), to pass to `write_results`
    as `earlier_runs` so that the record says which rows are older. Nothing when there is
    no record yet."""
    old = recorded_result(name)
    if old is None:
        return [], []
    date = old["machine"]["date"]
    kept = [{**r, "recorded": r.get("recorded", date)} for r in old["rows"] if not rerun(r)]
    days = {r["recorded"] for r in kept}
    runs = [
        {
            "machine": old["machine"],
            "machine_note": old.get("machine_note"),
            **{k: old[k] for k in carry if k in old},
        }
    ]
    runs = [r for r in [*old.get("earlier_runs", []), *runs] if r["machine"]["date"] in days]
    return kept, runs


def parse_partial_rerun(parser, argv, *selectors: str):
    """Adds `--update` to `parser` and parses `argv`. `--update` is a partial re-run: the
    cases named by the options `selectors` (such as `"fields"` for `--fields`) replace
    their rows in the recorded result and the other rows are kept (`kept_rows`); without
    any of those options it would re-run nothing, so the parser refuses it."""
    flags = ", ".join(f"--{s}" for s in selectors)
    parser.add_argument(
        "--update",
        action="store_true",
        help=f"with {flags}: replace the named cases' rows in the recorded result, keep the rest",
    )
    ns = parser.parse_args(argv)
    if ns.update and not any(getattr(ns, s) for s in selectors):
        parser.error(f"--update re-runs the cases named by {flags}; name them")
    return ns


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fmt_ratio(x: float | None) -> str:
    """A ratio of times, ours over the other's: `0.487x`, or `1/793` below 0.01 (which
    reads better than `0.00126x`)."""
    if x is None:
        return "—"
    if x < 0.01:
        return f"1/{float(f'{1 / x:.3g}'):,.0f}"
    return f"{x:.3g}x"


def markdown_table(rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> str:
    """A Markdown table; `columns` is `(key, heading)` pairs. Times (keys ending in `_s`)
    are formatted, missing values are a dash."""
    head = "| " + " | ".join(h for _, h in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    lines = [head, sep]
    for row in rows:
        cells = []
        for key, _ in columns:
            value = row.get(key)
            if key.endswith("_s"):
                cells.append(fmt_time(value))
            elif isinstance(value, float):
                cells.append(f"{value:.3g}")
            else:
                cells.append("—" if value is None else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_path(name: str) -> pathlib.Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    return RESULTS / f"{result_stem(name)}.png"


def save_plot(fig, name: str, out=None, *, dpi: int = 120, rect=None) -> pathlib.Path:
    """Lay `fig` out (within `rect` of the figure, if given, leaving room for a legend or
    a title outside the axes), write it to `out` or to the plot of benchmark `name` beside
    its JSON, and close it. Returns the path written."""
    import matplotlib.pyplot as plt

    fig.tight_layout(rect=rect)  # None: the whole figure
    path = pathlib.Path(out) if out is not None else plot_path(name)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def time_interleaved(
    fns: dict[str, tuple[Callable, tuple]],
    rounds: int = 21,
    batch_time: float = 0.01,
    slow_s: float = 0.05,
    max_time: float = 30.0,
) -> dict[str, dict[str, float]]:
    """[`time_contenders`][] with `rounds` rounds, kept for its callers. (`slow_s` is no
    longer used: every contender is interleaved, a slow one bounded by `max_time`.)"""
    del slow_s
    return time_contenders(fns, repeats=rounds, max_time=max_time, batch_time=batch_time)


def summarise_times(times: Sequence[float]) -> dict[str, float]:
    """The minimum of `times` (the figure to compare: load only ever adds time) and its
    spread: the median and the maximum."""
    return {
        "run_min_s": min(times),
        "run_s": statistics.median(times),
        "run_max_s": max(times),
    }


def time_contenders(
    fns: dict[str, tuple[Callable, tuple]],
    *,
    repeats: int = 7,
    min_time: float = 0.0,
    max_time: float = 30.0,
    warmup: bool = True,
    batch_time: float = 0.01,
) -> dict[str, dict[str, float]]:
    """Compile several contenders, then time them interleaved, round-robin (A B C A B C
    ...), so that a drifting or shared machine slows all of them alike.

    Each contender is jitted and compiled (timed apart), called twice untimed if `warmup`,
    and then timed once per round, blocking on its result; a round of a contender faster
    than `batch_time` is a batch of calls lasting about that long, sized from its fastest
    call so far. Rounds go on until every
    contender has `repeats` rounds and `min_time` seconds of timed calls; a contender that
    has spent `max_time` seconds drops out.

    **Arguments:** `fns` maps a name to `(fn, args)`.

    **Returns:** per name, `{"compile_s", "run_min_s" (the fastest round, per call: the
    figure to compare), "run_s" (median round), "run_max_s", "cpu_s" (median CPU time of
    this process per call), "rounds", "repeats" (timed calls)}`.
    """
    return time_contenders_output(
        fns,
        repeats=repeats,
        min_time=min_time,
        max_time=max_time,
        warmup=warmup,
        batch_time=batch_time,
    )[1]


def time_contenders_output(
    fns: dict[str, tuple[Callable, tuple]], **options
) -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
    """As [`time_contenders`][] (with its keyword options), also returning each
    contender's output of its first timed call."""
    compiled, compile_s = {}, {}
    for name, (fn, args) in fns.items():
        t0 = time.perf_counter()
        compiled[name] = jax.jit(fn).lower(*args).compile()
        compile_s[name] = time.perf_counter() - t0
    calls = {
        name: (lambda c=compiled[name], args=args: c(*args)) for name, (_, args) in fns.items()
    }
    outputs, out = time_round_robin(calls, **options)
    return outputs, {name: {"compile_s": compile_s[name], **out[name]} for name in fns}


def time_round_robin(
    calls: dict[str, Callable[[], Any]],
    *,
    repeats: int = 7,
    min_time: float = 0.0,
    max_time: float = 30.0,
    warmup: bool = True,
    batch_time: float = 0.01,
) -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
    """Time ready-to-run contenders interleaved, round-robin, as [`time_contenders`][]
    does after compiling: for contenders that are not JAX functions (another library's
    solver, set up beforehand), or already compiled.

    **Arguments:** `calls` maps a name to a function of no arguments, blocked on (its
    result passed through `jax.block_until_ready`); the options as [`time_contenders`][].

    **Returns:** each contender's output of its first timed call, and per name
    `{"run_min_s", "run_s", "run_max_s", "cpu_s", "rounds", "repeats"}`.
    """
    batch = dict.fromkeys(calls, 1)
    if warmup:
        for name, call in calls.items():
            fastest = math.inf
            for _ in range(2):
                t0 = time.perf_counter()
                block(call())
                fastest = min(fastest, time.perf_counter() - t0)
            batch[name] = _calls(fastest, batch_time)
    times: dict[str, list[float]] = {name: [] for name in calls}
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    spent = dict.fromkeys(calls, 0.0)
    counted = dict.fromkeys(calls, 0)
    outputs: dict[str, Any] = {}

    def done(name):
        return spent[name] >= max_time or (len(times[name]) >= repeats and spent[name] >= min_time)

    while not all(done(name) for name in calls):
        for name, call in calls.items():
            if spent[name] >= max_time:
                continue
            t0, c0 = time.perf_counter(), _cpu_time()
            for _ in range(batch[name]):
                result = call()
            block(result)
            elapsed = time.perf_counter() - t0
            times[name].append(elapsed / batch[name])
            cpu[name].append((_cpu_time() - c0) / batch[name])
            spent[name] += elapsed
            counted[name] += batch[name]
            if name not in outputs:
                outputs[name] = result
            # Batches sized from the fastest call so far, not from the first alone: a first
            # call can run 10-150x slower than later ones (caches, allocator, thread pools
            # waking), and a contender timed in batches of 2 calls against another's 30 reads
            # up to 3x slower per call on a fast kernel (hX, 2026-12-05, four copies of one
            # `diffrax.Euler` step in one cell).
            batch[name] = _calls(min(times[name]), batch_time)
    out = {
        name: dict(
            summarise_times(times[name]),
            cpu_s=statistics.median(cpu[name]),
            rounds=len(times[name]),
            repeats=counted[name],
        )
        for name in calls
    }
    return outputs, out


def _calls(seconds: float, batch_time: float) -> int:
    return max(1, int(batch_time / max(seconds, 1e-7)))


def fmt_spread(row: dict) -> str:
    """A row's fastest time with its spread: `39 µs (+12%)`, where +12% is how far its
    median round lay above the fastest; `(1 run)` where it was timed once."""
    fastest = row.get("run_min_s", row.get("run_s"))
    if fastest is None:
        return "—"
    median = row.get("run_s")
    if row.get("rounds", row.get("repeats")) == 1 or median is None:
        return f"{fmt_time(fastest)} (1 run)"
    return f"{fmt_time(fastest)} (+{100 * (median / fastest - 1):.0f}%)"
