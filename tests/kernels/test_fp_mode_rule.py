"""One rule for subnormals and NaN on CPU and GPU (nvfp4_format.h FlushSubnormal, LiveBlock; issue 45 item 5).

XLA runs CPU executables with denormals flushed (FTZ/DAZ); a GPU computes with them. Before the rule, a tensor whose
amax is below ~3e-35 quantized to zeros on CPU and to NaN on a GPU (1 / a subnormal decode scale is Inf, 0 * Inf is
NaN), and telemetry's amax and live blocks treated NaN differently on each. These tests run the recipe's C++ steps in
the order the CUDA kernels take them, outside XLA where nothing flushes subnormals (as on a GPU: `format.qdq_blocks`),
and compare them bit for bit with the CPU kernels under XLA's FTZ/DAZ and with the twins.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4_testing import assert_same_bits, extension_or_skip, mx_subnormal_cases, subnormal_cases
from xla_fp4 import kernels
from xla_fp4.numerics import kernel_twins, nvfp4

TINY = np.finfo(np.float32).tiny  # 2^-126, the smallest normal float32


@pytest.fixture(scope="module")
def fmt():
  ext = extension_or_skip()
  # The caller's mode keeps subnormals (otherwise this file would not test the GPU's side).
  assert np.float32(TINY) * np.float32(0.25) != 0
  return ext.format


CASES = subnormal_cases()


@jax.jit
def _kernel(x):
  s_dec = nvfp4.global_decode_scale(nvfp4.amax(x))
  return kernels.qdq(x, s_dec)


@jax.jit
def _twin(x):
  s_dec = nvfp4.global_decode_scale(nvfp4.amax(x))
  return nvfp4.qdq(x, global_scale=s_dec)


@pytest.mark.parametrize("case", CASES)
def test_nvfp4_agrees_in_every_fp_mode(fmt, case):
  x = CASES[case]
  outside = np.empty_like(x.reshape(-1))
  fmt.qdq_blocks(x.reshape(-1), outside)  # no FTZ/DAZ: the GPU's arithmetic
  assert np.isfinite(outside).all(), case
  assert_same_bits(jnp.asarray(outside.reshape(x.shape)), _kernel(jnp.asarray(x)))
  assert_same_bits(jnp.asarray(outside.reshape(x.shape)), _twin(jnp.asarray(x)))
  if case in ("tiny tensor", "all subnormal"):
    assert not outside.any(), "a tensor whose decode scale is subnormal encodes zeros"
  else:
    assert outside.any()


@pytest.mark.parametrize("fp8", [False, True])
def test_mx_agrees_in_every_fp_mode(fmt, fp8):
  x = mx_subnormal_cases()
  outside = np.empty_like(x.reshape(-1))
  fmt.mx_qdq_blocks(x.reshape(-1), fp8, outside)
  assert np.isfinite(outside).all()
  got = jax.jit(lambda v: kernels.mx_qdq(v, fp8=fp8))(jnp.asarray(x))
  twin = jax.jit(lambda v: kernel_twins.mx_qdq(v, jnp.uint32(0), axis=-1, block_2d=False, stochastic=False, rht=False,
                                               rht_seed=0, fp8=fp8))(jnp.asarray(x))
  assert_same_bits(jnp.asarray(outside.reshape(x.shape)), got)
  assert_same_bits(jnp.asarray(outside.reshape(x.shape)), twin)
  assert outside.reshape(x.shape)[2].any()
  if not fp8:
    assert not outside.reshape(x.shape)[0].any(), "E8M0's subnormal scale 2^-127 decodes as zero"


def test_telemetry_nan_rule():
  """A NaN block: the row's amax is NaN and the block is not live, on the CPU kernel and the twin alike (the CUDA
  sink reads the same AmaxFromBits and LiveBlock)."""
  extension_or_skip()
  from xla_fp4.numerics import telemetry as st
  x = jnp.asarray(np.random.default_rng(2).standard_normal((4, 32)).astype(np.float32)).at[1, 3].set(jnp.nan).at[2, :16].set(0.0)
  s_dec = jnp.float32(1 / 2688)
  _, row = kernels.qdq_and_stats(x, s_dec, 5, step=0)
  _, want = jax.jit(lambda x: st.qdq_and_stats(x, s_dec, jnp.uint32(5), jnp.int32(0), axis=-1, block_2d=False,
                                               stochastic=False, rht=False, rht_seed=0))(x)
  row, want = np.asarray(row), np.asarray(want)
  amax, live = st.FIELDS.index("amax"), st.FIELDS.index("live_blocks")
  assert np.isnan(row[amax]) and np.isnan(want[amax])
  assert row[live] == want[live] == 8 - 2  # the NaN block and the zero block are not live
