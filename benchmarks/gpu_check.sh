#!/usr/bin/env bash
# The prepared GPU check (docs/cuda.md): one command on a machine with one NVIDIA GPU and no network, where nvcc, jax
# with its CUDA plugin, flax, optax, nanobind, scikit-build-core and pytest are installed. Builds the extension with
# the CUDA kernels for this GPU, runs the CUDA kernel tests (bit for bit against the CPU kernels) and
# benchmarks/gpu_check.py, which writes ${OUT_DIR:-benchmarks/results}/gpu_check.json. Well under 8 minutes on an H200.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT_DIR:-benchmarks/results}
start=$(date +%s)

# This GPU's architecture only (a few minutes less of nvcc), unless CUDAARCHS says otherwise. Every Blackwell 10.x
# (10.0, 10.3) runs sm_100 code, which any nvcc with Blackwell support builds (10.3's own target needs nvcc >= 12.9).
if [[ -z "${CUDAARCHS:-}" ]]; then
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d '. ')
  if (( cap >= 100 && cap < 110 )); then CUDAARCHS=100; else CUDAARCHS="$cap"; fi
  export CUDAARCHS
fi
echo "== building with CUDA for sm_$CUDAARCHS"
XLA_FP4_CUDA=ON "$PY" -m pip install -q --no-build-isolation --no-deps --force-reinstall .
cd /tmp  # import the installed package, not the checkout's python/ folder
"$PY" -m xla_fp4 info
cd - > /dev/null

echo "== CUDA kernels against the CPU kernels and the reference"
"$PY" -m pytest -q -rs -p no:cacheprovider tests/kernels/test_cuda_kernels.py tests/passes/test_backends.py

echo "== train step on the GPU against the CPU emulation, and its time"
mkdir -p "$OUT_DIR"
"$PY" benchmarks/gpu_check.py --out "$OUT_DIR/gpu_check.json"
echo "== GPU check done in $(( $(date +%s) - start )) s"
