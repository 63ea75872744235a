"""The CUDA kernels' warp-cooperative quantizer (xla_fp4/warp_quantize.h), run on the CPU by a host simulation of a
warp (xla_fp4/tests/warp_quantize_sim.cc: 32 threads whose xor shuffles meet at a barrier), against the CPU kernels
bit for bit: its lane layout, its exchanges and the order of its sums are those of the one-thread-per-block numbers,
for every recipe, both element widths (float32: 4 lanes a run; 16-bit: 2) and tiles cut at the end of the rows.

The CUDA kernels call the same function with warp shuffles (cuda/block_kernel.cuh); the GPU test
(test_cuda_kernels.py) runs them on a device where there is one.
"""

import os
import shutil
import subprocess

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from nvfp4_testing import assert_same_bits, extension_or_skip
from xla_fp4 import kernels

# Its module fixture takes a while (a measurement or a compile): every test of this file runs on one worker (./dev
# passes --dist loadgroup), so the fixture runs once, not once per worker.
pytestmark = pytest.mark.xdist_group(__name__)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
  extension_or_skip()
  cxx = shutil.which("g++") or shutil.which("c++")
  assert cxx, "the tests need a C++20 compiler (g++), as the extension's build does"
  exe = str(tmp_path_factory.mktemp("warp") / "warp_quantize_sim")
  # -ffp-contract=off as the kernels build (nvfp4_format.h): a fused multiply-add would change results.
  subprocess.run([cxx, "-std=c++20", "-O1", "-pthread", "-ffp-contract=off", f"-I{ROOT}",
                  os.path.join(ROOT, "xla_fp4", "tests", "warp_quantize_sim.cc"), "-o", exe], check=True)
  return exe


def _run(exe, tmp_path, x, *, block_2d, stochastic, rht, four_over_six, s_dec, key, mode):
  rows, k = x.shape
  src, dst = tmp_path / "x.bin", tmp_path / "out.bin"
  np.asarray(x, np.float32).tofile(src)
  args = [exe, str(src), str(dst), str(rows), str(k), str(x.dtype.itemsize), str(int(block_2d)), str(int(stochastic)),
          str(int(rht)), "7", str(int(four_over_six)), repr(float(s_dec)), str(key), mode]
  subprocess.run(args, check=True, timeout=600)
  out = np.fromfile(dst, np.uint8)
  if mode == "qdq":
    return out.view(np.float32).reshape(rows, k)
  return out[:rows * k // 2].reshape(rows, k // 2), out[rows * k // 2:].reshape(rows, k // 16)


def _input(rows, k, dtype, seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((rows, k)).astype(np.float32) * rng.choice([0.01, 1.0, 30.0], size=(rows, 1))
  x[0, :16] = [0.0, -0.0, 0.25, 0.75, 1.25, 6.0, -6.0, 3.5, 5.0, 2.5, -1.75, 0.5, 4.0, -3.0, 1.0, 0.125]  # ties
  x[-1, -16:] = 0.0  # a block of zeros
  return x.astype(dtype)


RECIPES = [dict(block_2d=b2, stochastic=st, rht=rh, four_over_six=fos)
           for b2, st, rh, fos in [(False, False, False, False), (True, False, False, False),
                                   (False, True, False, False), (False, False, True, False),
                                   (False, True, True, False), (False, False, False, True),
                                   (True, False, False, True), (True, True, True, True), (False, True, True, True)]]


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: "-".join(k for k, v in r.items() if v) or "nearest")
def test_warp_qdq_matches_cpu_kernel(sim, tmp_path, dtype, recipe):
  # 37 rows: the last tile and warp are partial; each recipe its own data
  x = _input(37, 64, dtype, seed=sum(v << i for i, v in enumerate(recipe.values())))
  s_dec, key = 0.0173, 12345
  got = _run(sim, tmp_path, x, s_dec=s_dec, key=key, mode="qdq", **recipe)
  want = np.asarray(kernels.qdq(jnp.asarray(x), s_dec, key, axis=-1, rht_seed=7, **recipe))
  assert_same_bits(got.astype(dtype), want)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("recipe", RECIPES[:5] + RECIPES[7:8], ids=lambda r: "-".join(k for k, v in r.items() if v)
                         or "nearest")
def test_warp_packed_matches_cpu_kernel(sim, tmp_path, dtype, recipe):
  x = _input(21, 48, dtype, seed=3)
  s_dec, key = 0.5, 99
  data, scales = _run(sim, tmp_path, x, s_dec=s_dec, key=key, mode="packed", **recipe)
  want_data, want_scales = kernels.quantize_packed(jnp.asarray(x), s_dec, key, axis=1, rht_seed=7, **recipe)
  np.testing.assert_array_equal(data, np.asarray(want_data))
  np.testing.assert_array_equal(scales, np.asarray(want_scales).view(np.uint8))
