"""numerics/mx.py against an independent reference: float64 NumPy for the scale (the smallest power of two that keeps
the block's largest magnitude within the element's range, found by search) and ml_dtypes' own casts for the
elements (float4_e2m1fn, float8_e4m3fn: round to nearest even)."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from xla_fp4.numerics import formats, mx

ELEMENT_TYPES = {"mxfp4": ml_dtypes.float4_e2m1fn, "mxfp8": ml_dtypes.float8_e4m3fn}


def reference(x, fmt, block_2d=False):
  """q * 2^s per 32-block along the last axis (32x32 tiles over the last two axes with block_2d), float64."""
  f = formats.FORMATS[fmt]
  x = np.asarray(x, np.float64)
  rows, k = x.shape
  out = np.empty_like(x)
  tile_rows = 32 if block_2d else 1
  for r0 in range(0, rows, tile_rows):
    for c0 in range(0, k, 32):
      block = x[r0:r0 + tile_rows, c0:c0 + 32]
      amax = np.max(np.abs(block))
      if not np.isfinite(amax):
        out[r0:r0 + tile_rows, c0:c0 + 32] = np.nan
        continue
      s = -127
      while s < 127 and amax > f.elem_max * 2.0 ** s:
        s += 1
      q = (block / 2.0 ** s).astype(ELEMENT_TYPES[fmt]).astype(np.float64)
      out[r0:r0 + tile_rows, c0:c0 + 32] = q * 2.0 ** s
  return out


def _data(seed, rows=64, k=128):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((rows, k)) * np.exp(rng.uniform(-8, 8, (rows, 1)))  # rows of different magnitudes
  x[3, 5] = 1e4  # an outlier: its block's other values fall by its scale
  x[7, 32:64] = 0.0  # a zero block
  x[9, 64:96] = 6.0 * 2.0 ** -3  # a block whose amax is exactly elem_max * 2^s (mxfp4): the scale 2^-3, no rounding up
  x[10, 64:96] = 448.0 * 2.0 ** 5  # ... and mxfp8's
  return x.astype(np.float32)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nearest_equals_the_independent_reference(fmt, seed):
  x = _data(seed)
  got = np.asarray(mx.qdq(jnp.asarray(x), fmt), np.float64)
  np.testing.assert_array_equal(got, reference(x, fmt))


@pytest.mark.parametrize("rows", [None, 48], ids=["whole_tiles", "partial_tiles"])
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_32x32_tiles_equal_the_reference_and_their_transpose(fmt, rows):
  """32x32 tiles, whole ones and a partial one at the end of the partner dim (48 rows: a 32x32 and a 16x32 tile)."""
  x = _data(3)[:rows]
  got = np.asarray(mx.qdq(jnp.asarray(x), fmt, axis=1, block_2d=True), np.float64)
  np.testing.assert_array_equal(got, reference(x, fmt, block_2d=True))
  along_rows = np.asarray(mx.qdq(jnp.asarray(x.T), fmt, axis=0, block_2d=True), np.float64)
  np.testing.assert_array_equal(along_rows.T, got)  # a weight and its transpose share the tiles


def test_the_scale_is_rounded_up_so_nothing_saturates():
  """The largest magnitude of a block stays within the element range: with OCP's floor rule 7.5 * 2^k would scale to
  7.5 and clip to 6 (20% error); here it scales to 3.75 and rounds to 4."""
  x = np.zeros((1, 32), np.float32)
  x[0, 0] = 7.5
  got = np.asarray(mx.qdq(jnp.asarray(x), "mxfp4"))
  assert got[0, 0] == 8.0  # 3.75 -> 4 (nearest even of 3.5, 4), times 2^1
  assert int(mx.scale_exponent(jnp.float32(7.5), 6.0)) == 1
  assert int(mx.scale_exponent(jnp.float32(6.0), 6.0)) == 0  # exactly at the top: no rounding up
  assert int(mx.scale_exponent(jnp.float32(448.0 * 2 ** -20), 448.0)) == -20


def test_bfloat16_input_and_nan_blocks():
  x = _data(4)
  x[12, 0] = np.nan
  x[13, 40] = np.inf
  got = np.asarray(mx.qdq(jnp.asarray(x, jnp.bfloat16), "mxfp8"), np.float64)
  want = reference(np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)), "mxfp8")
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  assert np.isnan(got[12, :32]).all() and np.isnan(got[13, 32:64]).all()  # the whole block decodes NaN
  np.testing.assert_array_equal(np.nan_to_num(got), np.asarray(jnp.asarray(np.nan_to_num(want), jnp.bfloat16),
                                                                np.float64))


def test_stochastic_rounding_is_unbiased_and_stays_on_the_grid():
  x = np.tile(np.linspace(-5.5, 5.5, 32, dtype=np.float32), (4096, 1))
  draws = np.asarray(jax.jit(lambda v, key: mx.qdq(v, "mxfp4", rounding="stochastic", key=key))(
      jnp.asarray(x), jnp.uint32(7)), np.float64)
  grid = np.concatenate([-formats.E2M1_VALUES[::-1], formats.E2M1_VALUES])
  assert np.isin(draws, grid).all()  # amax 5.5 -> scale 1
  lower = np.array([grid[grid <= v].max() for v in x[0]])
  upper = np.array([grid[grid >= v].min() for v in x[0]])
  assert ((draws == lower) | (draws == upper)).all()  # one of the two grid neighbours
  mean = draws.mean(axis=0)
  assert np.max(np.abs(mean - x[0])) < 0.03, np.max(np.abs(mean - x[0]))


def test_k_must_be_a_multiple_of_32():
  with pytest.raises(ValueError, match="blocks of 32"):
    mx.qdq(jnp.ones((4, 48)), "mxfp8")
  with pytest.raises(ValueError, match="not an MX format"):
    mx.qdq(jnp.ones((4, 64)), "nvfp4")


def test_format_records():
  f = formats.FORMATS
  assert (f["mxfp4"].block, f["mxfp8"].block, f["nvfp4"].block) == (32, 32, 16)
  assert not f["mxfp8"].rht and not f["mxfp8"].stochastic and not f["mxfp8"].tiles_2d and f["mxfp4"].tiles_2d
  assert math.isclose(f["mxfp8"].bits, 8.25) and math.isclose(f["mxfp4"].bits, 4.25) and f["nvfp4"].bits == 4.5
