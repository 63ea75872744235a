#!/usr/bin/env bash
# Compile check of the CUDA kernels and the cuBLASLt FP4 GEMM for sm_90 and sm_100: configures the build with
# XLA_FP4_CUDA=ON into build/cuda-check and builds the CUDA module only (the CPU module, from the same CMakeLists, is
# the one ./dev installed: compiling its kernels again here took 5 of CI's minutes), checks that both architectures'
# code is in the CUDA module, that it imports and registers a handler for every target of the installed CPU module,
# and that the configuration tells the CPU module it was built with CUDA. Nothing here needs a GPU;
# tests/kernels/test_cuda_kernels.py runs the kernels on one.
# Exits 0 with "SKIPPED: <reason>" only when there is no nvcc.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
BUILD=build/cuda-check

NVCC=${CUDACXX:-$(command -v nvcc || true)}
if [[ -z "$NVCC" ]]; then  # the toolkit's standard prefixes, newest first
  NVCC=$(ls -d /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc 2>/dev/null | sort -rV | head -n1 || true)
fi
if [[ -z "$NVCC" || ! -x "$NVCC" ]]; then
  echo "SKIPPED: no nvcc (not on PATH, CUDACXX unset, none under /usr/local/cuda*)"
  exit 0
fi
CUDA_VERSION=$("$NVCC" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
CUDA_MAJOR=${CUDA_VERSION%%.*}
echo "nvcc: $NVCC (CUDA $CUDA_VERSION)"

# cuBLASLt headers and library come from NVIDIA's wheel, matching the toolkit's CUDA version.
if [[ "$CUDA_MAJOR" -ge 13 ]]; then
  CUBLAS_PACKAGE="nvidia-cublas==${CUDA_VERSION}.*" CUBLAS_MODULE="nvidia.cu${CUDA_MAJOR}"
else
  CUBLAS_PACKAGE="nvidia-cublas-cu${CUDA_MAJOR}==${CUDA_VERSION}.*" CUBLAS_MODULE="nvidia.cublas"
fi
HAS_CUBLAS="import os, $CUBLAS_MODULE as m; assert any(os.path.exists(p + '/include/cublasLt.h') for p in m.__path__)"
if ! "$PY" -c "$HAS_CUBLAS" 2>/dev/null; then
  echo "installing $CUBLAS_PACKAGE"
  "$PY" -m pip install --quiet "$CUBLAS_PACKAGE"
fi

# The venv that ./dev made has the runtime deps only; the build deps (pyproject's build-system) come from PyPI.
if ! "$PY" -c "import nanobind, ninja" 2>/dev/null; then
  "$PY" -m pip install --quiet nanobind ninja
fi
export PATH="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')"):$PATH"  # the venv's ninja

cmake -S . -B "$BUILD" -G Ninja -DXLA_FP4_CUDA=ON -DCMAKE_CUDA_COMPILER="$NVCC" \
  -DCMAKE_CUDA_ARCHITECTURES="90;100" -DPython_EXECUTABLE="$("$PY" -c 'import sys; print(sys.executable)')"
cmake --build "$BUILD" -j "$(nproc)" --target _xla_fp4_cuda

CUDA_EXT=$(ls "$BUILD"/_xla_fp4_cuda*.so)
BUILD_INFO="$BUILD/generated/xla_fp4/build_info.h"  # what the CPU module built from this configuration reports
# Both architectures reached nvcc (and it succeeded); cuobjdump, where the toolkit has it, lists the SASS as well.
for arch in sm_90 sm_100; do
  grep -q "code=\[[^]]*$arch" "$BUILD/build.ninja" || { echo "FAILED: nvcc was not asked for $arch code"; exit 1; }
done
CUOBJDUMP=$(command -v cuobjdump || true)
if [[ -n "$CUOBJDUMP" ]]; then
  "$CUOBJDUMP" --list-elf "$CUDA_EXT"
fi

# The CUDA module must import without a GPU, have a handler for every target of the installed CPU module, and say why
# the FP4 GEMM cannot run; the CPU module's build status must say it was built with CUDA.
"$PY" - "$CUDA_EXT" "$BUILD_INFO" <<'PYEOF'
import importlib.util, re, sys
import xla_fp4._xla_fp4_ext as ext
spec = importlib.util.spec_from_file_location("xla_fp4._xla_fp4_cuda", sys.argv[1])
cuda = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cuda)
status = re.search(r'#define XLA_FP4_CUDA_STATUS "(.*)"', open(sys.argv[2]).read()).group(1)
print("CPU module's build status:", status)
assert status.startswith("built for sm_90, sm_100 "), status
targets = sorted(cuda.registrations())
assert targets == sorted(ext.registrations()), (targets, sorted(ext.registrations()))
assert tuple(cuda.ffi_api_version) == tuple(ext.ffi_api_version)
print("CUDA targets:", ", ".join(targets))
print("fp4_gemm_supported():", cuda.fp4_gemm_supported())
PYEOF
echo "PASSED: CUDA compile check (sm_90, sm_100)"
