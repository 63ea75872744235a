"""Four Over Six (arXiv 2512.02010) in numerics/nvfp4.py against an independent reference: NumPy and ml_dtypes' casts
block by block. Per block (16x16 tile for weights): the E4M3 scale that maps its largest magnitude to 6 and the one
that maps it to 4 (1.5 times the first before rounding), under a tensor scale of amax / (6 * 256); the one whose
decoded values have the smaller sum of squared errors wins (float32, summed by halves as the spec says; a tie keeps
6)."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from xla_fp4.numerics import formats, nvfp4


def _tree_sum(v):
  v = np.asarray(v, np.float32)
  while v.shape[-1] > 1:
    half = v.shape[-1] // 2
    v = (v[..., :half] + v[..., half:]).astype(np.float32)
  return v[..., 0]


def _candidate(block, scale, s_dec):
  """(decoded block, its E4M3 scale) for one candidate block scale (float32, before its E4M3 rounding)."""
  e4m3 = np.float32(np.asarray(scale, np.float32).astype(ml_dtypes.float8_e4m3fn))
  denom = np.float32(e4m3 * s_dec)
  if denom == 0:
    return np.zeros_like(block), e4m3
  v = np.clip(block * (np.float32(1) / denom), -6, 6).astype(np.float32)
  q = v.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
  return ((q * e4m3).astype(np.float32) * s_dec).astype(np.float32), e4m3


def reference(x, block_2d=False):
  """Decoded x (rows, K), quantized along K in 1x16 blocks (16x16 tiles with block_2d)."""
  x = np.asarray(x, np.float32)
  s_dec = np.float32(np.max(np.abs(x)) * formats.INV_FOUR_OVER_SIX_DIVISOR)
  s_enc = np.float32(1) / s_dec
  out = np.empty_like(x)
  rows = 16 if block_2d else 1
  for r in range(0, x.shape[0], rows):
    for c in range(0, x.shape[1], 16):
      block = x[r:r + rows, c:c + 16]
      wanted = np.float32(np.max(np.abs(block)) * np.float32(s_enc * np.float32(1 / 6)))
      six, _ = _candidate(block, wanted, s_dec)
      four, _ = _candidate(block, np.float32(wanted * np.float32(1.5)), s_dec)
      err6 = _tree_sum(_tree_sum((block - six) ** 2))
      err4 = _tree_sum(_tree_sum((block - four) ** 2))
      out[r:r + rows, c:c + 16] = four if err4 < err6 else six
  return out


def _data(seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((32, 64)) * np.exp(rng.uniform(-3, 3, (32, 1)))
  x[2, :16] = np.linspace(-1, 1, 16) * 7.0  # evenly spread: scaling to 4 gives a finer grid for the large ones
  return x.astype(np.float32)


@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_equals_the_independent_reference(seed, block_2d):
  x = _data(seed)
  s_dec = nvfp4.global_decode_scale(jnp.max(jnp.abs(jnp.asarray(x))), four_over_six=True)
  got = np.asarray(nvfp4.unscaled_values(jnp.asarray(x), 1, block_2d, "nearest", None, s_dec, four_over_six=True)
                   * s_dec)
  np.testing.assert_array_equal(got, reference(x, block_2d))


def test_it_lowers_the_error_and_picks_both_candidates():
  x = _data(2)
  amax = jnp.max(jnp.abs(jnp.asarray(x)))
  plain_s, fos_s = nvfp4.global_decode_scale(amax), nvfp4.global_decode_scale(amax, four_over_six=True)
  plain = np.asarray(nvfp4.unscaled_values(jnp.asarray(x), 1, False, "nearest", None, plain_s) * plain_s)
  fos = np.asarray(nvfp4.unscaled_values(jnp.asarray(x), 1, False, "nearest", None, fos_s, four_over_six=True) * fos_s)
  assert np.linalg.norm(fos - x) < np.linalg.norm(plain - x)
  # some blocks take 4 (their largest decoded magnitude is 4 times the scale), others 6
  q, scales = nvfp4._encode(jnp.asarray(x), 1, False, "nearest", None, fos_s, four_over_six=True)
  top = np.max(np.abs(np.asarray(q)), axis=2)
  assert (top == 4).any() and (top == 6).any()
