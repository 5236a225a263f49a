#!/usr/bin/env bash
# Issue 23's device rows (`benchmarks.stiff_device`: Robertson x N and the 2D Brusselator,
# float32, the TPU beside the same machine's CPU) on a TPU machine, in one prepared command.
#
# That machine has Python 3.11 with JAX, numpy and scipy, a package index of its own on its
# disk (matplotlib), and no network: diffrax, equinox, lineax, optimistix and jaxtyping
# travel as wheels, fetched here first into .whl-tpu/ (ignored by git: add `/.whl-tpu/` to
# .git/info/exclude):
#
#   bash benchmarks/tpu.sh --fetch     # here, with network
#   bash benchmarks/tpu.sh             # there (the device tool: carry .whl-tpu)
#   QUICK=1 bash benchmarks/tpu.sh     # smoke run
#   CORE=1 bash benchmarks/tpu.sh      # gpu.sh's core benchmarks instead, quick sizes
#   CORE=1 CORE_ONLY="materialise adjoint" BENCH_TIMEOUT=560 bash benchmarks/tpu.sh
#                                      # some of them, each with a longer limit
#   SEED=1 bash benchmarks/tpu.sh      # only jax.jacfwd(A @ x) at N = 10,000 against ours
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --fetch ]; then
  # The versions of constraints.txt, for the TPU machine's Python.
  pins=$(grep -iE '^(diffrax|equinox|lineax|optimistix|jaxtyping|wadler_lindig|typing_extensions)==' constraints.txt)
  exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
    --implementation cp --platform any --platform manylinux_2_17_x86_64 -d .whl-tpu $pins
fi
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
site=/tmp/dl-site
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps \
  --no-compile --no-cache-dir --upgrade --target "$site" .whl-tpu/*.whl || exit 1
# matplotlib and what it needs, from the machine's own index (not JAX's numpy: --no-deps).
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --no-deps \
  --index-url file:///opt/pypi/simple --target "$site" matplotlib contourpy cycler fonttools \
  kiwisolver pyparsing pillow python-dateutil || exit 1
# After the machine's own JAX (PYTHONPATH names it), and the source tree.
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$site:$PWD"
python3 -c "import jax; print(jax.__version__, jax.devices())"
flag=""; [ "${QUICK:-0}" = 1 ] && flag="--quick"
status=0
if [ -n "${SEED:-}" ]; then
  # SEED=1: only the seed report's case, jax.jacfwd(A @ x) at N = 10,000 against ours, at
  # the TPU's default matmul precision (what a user gets).
  timeout "${BENCH_TIMEOUT:-240}" python3 -m benchmarks.materialise --seed-only --seed-n 10000 \
    || status=1
elif [ -n "${CORE:-}" ]; then
  # CORE=1: instead, gpu.sh's core benchmarks at their quick sizes (results/quick/, the JSON
  # says "quick": true), float32 as JAX's default, matrix products at full float32
  # precision (a TPU's default rounds their inputs to bfloat16: jax.jacfwd's A @ I would
  # not be A). On 2026-12-06 materialise and adjoint did not finish in 110 s each there
  # (compiles); the seed report's case has SEED=1 of its own.
  export JAX_DEFAULT_MATMUL_PRECISION=highest DIFFRAX_LINEARIZE_RESULTS="$PWD/benchmarks/results/quick"
  export DIFFRAX_LINEARIZE_MACHINE_NOTE="quick sizes, float32, JAX_DEFAULT_MATMUL_PRECISION=highest (\`CORE=1 bash benchmarks/tpu.sh\`)"
  for bench in ${CORE_ONLY:-step_cost materialise squared_grads adjoint}; do
    args="$bench --quick"
    echo "=== $args"
    timeout "${BENCH_TIMEOUT:-110}" python3 -m benchmarks.$args || { echo "!!! $args"; status=1; }
  done
else
  timeout "${BENCH_TIMEOUT:-540}" python3 -m benchmarks.stiff_device $flag || status=1
fi
if [ -n "${OUT:-}" ]; then
  cp benchmarks/results/*-tpu-* benchmarks/results/quick/*-tpu-* "$OUT"/ 2>/dev/null || true
fi
exit $status
