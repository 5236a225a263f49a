"""Command-line entry point: `python -m benchmarks NAME [--quick]`.

`demo` is the project's main job (`make demo`): a short step-cost run that prints a table
and writes a PNG plot. `all` runs every benchmark (`make bench`).
"""

import argparse
import importlib
import os
import pathlib
import sys
import time


BENCHMARKS = {
    "step-cost": "benchmarks.step_cost",
    "materialise": "benchmarks.materialise",
    "structure": "benchmarks.structure",
    "stiff": "benchmarks.stiff",
    "adjoint": "benchmarks.adjoint",
    "squared-grads": "benchmarks.squared_grads",
    "work-precision": "benchmarks.work_precision",
    "ensemble": "benchmarks.ensemble",
    "stiff-peers": "benchmarks.stiff_peers",
    "adaptive-sde": "benchmarks.adaptive_sde",
    "linear-crossover": "benchmarks.linear_crossover",
    "ensemble-lanes": "benchmarks.ensemble_lanes",
    "stiff-device": "benchmarks.stiff_device",
    "xla-cpu-flags": "benchmarks.xla_cpu_flags",
}


def _run(name: str, quick: bool):
    module = importlib.import_module(BENCHMARKS[name])
    t0 = time.perf_counter()
    rows = module.run(quick=quick)
    print(f"[{name}] {len(rows)} rows in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("name", choices=["demo", "all", *BENCHMARKS])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ns = parser.parse_args(argv)
    if ns.quick or ns.name == "demo":
        quick_dir = pathlib.Path(__file__).parent / "results" / "quick"
        os.environ.setdefault("DIFFRAX_LINEARIZE_RESULTS", str(quick_dir))
    if ns.name == "demo":
        from benchmarks._common import plot_path

        _run("step-cost", quick=True)
        print(f"\nPlot written to {plot_path('step_cost')}")
        return 0
    names = list(BENCHMARKS) if ns.name == "all" else [ns.name]
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the test extra
        tqdm = None
    iterator = tqdm(names, desc="benchmarks", file=sys.stderr) if tqdm and len(names) > 1 else names
    for name in iterator:
        _run(name, ns.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
