#!/usr/bin/env bash
# Bazel build of the C++ kernels (docs/bazel.md), offline with Debian's bazel-bootstrap 4.2.3:
#   1. installs bazel-bootstrap if bazel is missing (apt-get; needs root, as CI runs),
#   2. `bazel test //...`: builds the CPU kernel library and the extension, runs the C++ unit tests,
#   3. loads the Bazel-built _xla_fp4_ext.so next to the pip build in one Python process, registers its qdq handler
#      under another target name, runs both on the same inputs (every qdq variant, float32 and bfloat16) and compares
#      bit for bit.
# Bazel's output root is build/bazel/root (ignored by git); its disk cache is outside the checkout
# (XLA_FP4_BAZEL_CACHE, default ~/.cache/xla_fp4/bazel-disk-cache), so that a clean checkout on a machine that built
# the same sources before compiles nothing again (7 of CI's minutes cold on two cores). Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export XLA_FP4_PYTHON=${XLA_FP4_PYTHON:-$("$PY" -c 'import sys; print(sys.executable)')}
# The venv that ./dev made has the runtime deps only; the Bazel overlays read nanobind's sources from PyPI's package.
"$XLA_FP4_PYTHON" -c "import nanobind" 2>/dev/null || "$XLA_FP4_PYTHON" -m pip install --quiet nanobind

if ! command -v bazel >/dev/null; then
  echo "installing bazel-bootstrap"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bazel-bootstrap >/dev/null
fi
bazel --version || true

mkdir -p build/bazel
BAZEL=(bazel --output_user_root="$PWD/build/bazel/root")
start=$(date +%s)
"${BAZEL[@]}" test //... --noshow_progress --disk_cache="${XLA_FP4_BAZEL_CACHE:-$HOME/.cache/xla_fp4/bazel-disk-cache}"
echo "bazel test //...: $(( $(date +%s) - start ))s"
EXT="$("${BAZEL[@]}" info bazel-bin 2>/dev/null)/xla_fp4/_xla_fp4_ext.so"
test -f "$EXT"

"$PY" - "$EXT" <<'PY'
import importlib.util, sys
import numpy as np, jax, jax.numpy as jnp
import xla_fp4._xla_fp4_ext as pip_ext

spec = importlib.util.spec_from_file_location("_xla_fp4_ext", sys.argv[1])
bazel_ext = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bazel_ext)
assert set(bazel_ext.registrations()) == set(pip_ext.registrations()), "the two builds register different targets"
for name, ext in (("pip", pip_ext), ("bazel", bazel_ext)):
    jax.ffi.register_ffi_target(f"bazel_check_qdq_{name}", ext.registrations()["xla_fp4_qdq"], platform="cpu")

x32 = np.random.default_rng(0).standard_normal((64, 256), dtype=np.float32) * 3
s_dec = jnp.float32(float(np.max(np.abs(x32))) / 2688)
key = jnp.uint32(1234)
failures = 0
variants = [dict(), dict(block_2d=True), dict(stochastic=True), dict(rht=True, rht_seed=7),
            dict(four_over_six=True, block_2d=True), dict(apply_global_scale=False)]  # the last as the pass emits it
for x, variant in [(jnp.asarray(x32, dtype), v) for dtype in (jnp.float32, jnp.bfloat16) for v in variants]:
    attrs = dict(axis=np.int64(-1), block_2d=False, stochastic=False, rht=False, rht_seed=np.int64(0),
                 apply_global_scale=True, four_over_six=False)
    attrs.update({k: (np.int64(v) if isinstance(v, int) and not isinstance(v, bool) else v) for k, v in variant.items()})
    out = {}
    for name in ("pip", "bazel"):
        call = jax.ffi.ffi_call(f"bazel_check_qdq_{name}", jax.ShapeDtypeStruct(x.shape, x.dtype))
        out[name] = np.asarray(jax.jit(lambda x, s, k: call(x, s, k, **attrs))(x, s_dec, key))
    same = np.array_equal(out["pip"].view(np.uint8), out["bazel"].view(np.uint8))
    changed = not np.array_equal(out["pip"], np.asarray(x))
    print(f"qdq {x.dtype} {variant or 'nearest 1x16'}: pip vs bazel bit-identical={same}, quantized={changed}")
    failures += (not same) + (not changed)
sys.exit(1 if failures else 0)
PY
echo "bazel check: OK"
