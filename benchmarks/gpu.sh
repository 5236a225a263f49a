#!/usr/bin/env bash
# The whole benchmark suite on an NVIDIA GPU machine, in one prepared command (< 12 min).
#
# That machine has no network: its Python already has jax with CUDA, diffrax, equinox and
# lineax, so the package is installed without dependencies. Results land in
# benchmarks/results/ (named by platform and device) and, when $OUT is set (the device
# tool of this workplace), are copied there too.
#
#   bash benchmarks/gpu.sh            # everything, full sizes where they fit the budget
#   QUICK=1 bash benchmarks/gpu.sh    # smoke run
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false MPLBACKEND=Agg
# No network there: build with the machine's own setuptools (no build isolation). Should that
# fail, the source tree on PYTHONPATH serves as well: every benchmark runs from the repo root.
python3 -m pip install -q --no-deps --no-build-isolation -e . \
  || echo "!!! pip install failed; using the source tree on PYTHONPATH"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import jax; print(jax.__version__, jax.devices())"
flag=""; [ "${QUICK:-0}" = 1 ] && flag="--quick"
limit="${BENCH_TIMEOUT:-75}"  # seconds per benchmark: ten of them fit the 15-minute lease
status=0
run() {
  echo "=== $*"
  timeout "$limit" python3 "$@" || { echo "!!! $* failed or timed out"; status=1; }
}
for name in step-cost adjoint squared-grads; do
  run -m benchmarks "$name" $flag
done
# With the seed report's own case: jit(jacfwd(A @ x)) at N = 10,000 (compile and run).
run -m benchmarks.materialise $flag --seed-n 10000
# Quick sizes (the JSON says "quick": true): the full ones do not fit the lease.
run -m benchmarks.structure --quick
run -m benchmarks.stiff --quick
# Issue 23's device rows: Robertson x N and the Brusselator, float32, beside this CPU.
run -m benchmarks.stiff_device --quick
# m = 50 takes too long for the lease; m in {2, 10} covers the acceptance's m = 10.
run -m benchmarks.work_precision --ms 2 10 $flag
# One GPU: throughput on one device (the CPU table pins processes to cores; see docs/ensembles.md).
run -m benchmarks.ensemble --gpu $flag
if [ -n "${OUT:-}" ]; then
  # The device tool returns at most 8 files: every JSON and plot in one archive.
  tar czf "$OUT"/gpu-results.tar.gz benchmarks/results/*-gpu-*.json \
    benchmarks/results/*-gpu-*.png 2>/dev/null || true
fi
exit $status
