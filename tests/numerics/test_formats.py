"""E2M1 / E4M3 rounding, random bits and RHT signs: the jnp reference and the C++ helpers (nvfp4_format.h) against
ml_dtypes' casts, on every representable value, every midpoint, its float32 neighbours, saturation, NaN, -0 and
subnormals."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from nvfp4_testing import assert_same_bits, digest_np, extension_or_skip
from xla_fp4 import numerics as nv
from xla_fp4.numerics import formats, packing


def _around(points):
  """points, their float32 neighbours, and the same negated."""
  p = np.asarray(points, np.float32)
  with np.errstate(over="ignore"):
    up, down = np.nextafter(p, np.float32(np.inf)), np.nextafter(p, np.float32(-np.inf))
  v = np.concatenate([p, up, down])
  return np.concatenate([v, -v]).astype(np.float32)


def _e2m1_probe():
  grid = nv.E2M1_VALUES
  mid = (grid[1:] + grid[:-1]) / 2
  special = [0.0, 6.0, 6.5, 7.0, 1e30, np.finfo(np.float32).max, np.inf, 1e-40, 1e-45, 0.1, 0.3]
  return _around(np.concatenate([grid, mid, special]))


def _e4m3_grid():
  return np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _e4m3_probe():
  g = _e4m3_grid()
  g = np.unique(np.abs(g[np.isfinite(g)]))
  mid = (g[1:] + g[:-1]) / 2  # includes ties between subnormals and at the normal boundary
  special = [448.0, 460.0, 464.0, 470.0, 480.0, 1e6, np.inf, 2.0**-9, 2.0**-10, 2.0**-6, 1e-40, 2.0**-12]
  return _around(np.concatenate([g, mid, special]))


def _ref_e2m1_nearest(v):
  return np.asarray(nv.round_e2m1_nearest(jnp.asarray(v)))


def test_e2m1_nearest_matches_ml_dtypes():
  v = _e2m1_probe()
  # ml_dtypes saturates too; it has no NaN (so NaN is checked separately below).
  expected = v.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
  assert_same_bits(_ref_e2m1_nearest(v), expected)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_e2m1_nan_stays_nan_and_zero_keeps_sign(rounding):
  v = np.array([np.nan, -np.nan, 0.0, -0.0], np.float32)
  u = np.full(4, 0.5, np.float32)
  out = np.asarray(_ref_e2m1_nearest(v) if rounding == "nearest" else nv.round_e2m1_stochastic(v, u))
  assert np.isnan(out[:2]).all()
  assert_same_bits(out[2:], v[2:])


def test_e2m1_cpp_nearest_matches_reference():
  f = extension_or_skip().format
  v = np.concatenate([_e2m1_probe(), [np.nan, -np.nan]]).astype(np.float32)
  out = np.empty_like(v)
  f.round_e2m1_nearest(v, out)
  assert_same_bits(out, _ref_e2m1_nearest(v))


def test_e2m1_stochastic_cpp_matches_reference_and_picks_a_neighbour():
  f = extension_or_skip().format
  rng = np.random.default_rng(0)
  v = np.concatenate([_e2m1_probe(), rng.uniform(-7, 7, 20000)]).astype(np.float32)
  u = np.array(nv.uniform_from_bits(rng.integers(0, 2**32, v.size, dtype=np.uint32)))
  u[:8] = [0.0, np.nextafter(np.float32(1), np.float32(0)), 0.5, 0.25, 0.0, 0.0, 0.99, 0.01]
  out = np.empty_like(v)
  f.round_e2m1_stochastic(v, u, out)
  ref = np.asarray(nv.round_e2m1_stochastic(jnp.asarray(v), jnp.asarray(u)))
  assert_same_bits(out, ref)
  # The result is one of the two grid neighbours of the saturated value; grid values are returned unchanged.
  a = np.minimum(np.abs(v), 6)
  grid = nv.E2M1_VALUES
  lo = grid[np.searchsorted(grid, a, side="right") - 1]
  hi = grid[np.minimum(np.searchsorted(grid, a, side="left"), 7)]
  assert ((np.abs(ref) == lo) | (np.abs(ref) == hi)).all()
  on_grid = np.isin(a, grid)
  assert (np.abs(ref)[on_grid] == a[on_grid]).all()


def test_e4m3_reference_matches_ml_dtypes():
  v = _e4m3_probe()
  got = np.asarray(nv.round_e4m3(jnp.asarray(v))).view(np.uint8)
  # The reference saturates positive values at 448 first; ml_dtypes turns overflow into NaN.
  expected = np.where(v > 448, np.float32(448), v).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
  np.testing.assert_array_equal(got, expected)
  assert (got[v > 448] == 0x7E).all()
  assert (got[(v < -464) | (v == -np.inf)] == 0xFF).all()  # negative overflow is NaN (never produced by the recipe)


def test_e4m3_cpp_encode_matches_reference():
  f = extension_or_skip().format
  v = np.concatenate([_e4m3_probe(), [np.nan, -np.nan]]).astype(np.float32)
  out = np.empty(v.shape, np.uint8)
  f.e4m3_encode(v, out)
  expected = np.asarray(nv.round_e4m3(jnp.asarray(v))).view(np.uint8)
  nan = np.isnan(v)
  np.testing.assert_array_equal(out[~nan], expected[~nan])
  assert (out[nan] & 0x7F == 0x7F).all()


def test_e4m3_cpp_decode_matches_ml_dtypes_for_all_codes():
  f = extension_or_skip().format
  codes = np.arange(256, dtype=np.uint8)
  out = np.empty(256, np.float32)
  f.e4m3_decode(codes, out)
  assert_same_bits(out, _e4m3_grid())
  # and encode inverts decode on every non-NaN code
  back = np.empty(256, np.uint8)
  f.e4m3_encode(out, back)
  finite = np.isfinite(out)
  np.testing.assert_array_equal(back[finite], codes[finite])


def test_e2m1_codes_cpp_match_packing():
  f = extension_or_skip().format
  codes = np.arange(16, dtype=np.uint8)
  values = np.empty(16, np.float32)
  f.e2m1_decode(codes, values)
  expected = np.asarray(packing.e2m1_from_codes(jnp.asarray(codes)).astype(jnp.float32))
  assert_same_bits(values, expected)
  back = np.empty(16, np.uint8)
  f.e2m1_code(values, back)
  np.testing.assert_array_equal(back, codes)
  np.testing.assert_array_equal(np.asarray(packing.e2m1_codes(jnp.asarray(values).astype(jnp.float4_e2m1fn))), codes)


def test_mix32_uniform_and_rht_signs_cpp_match_reference():
  f = extension_or_skip().format
  x = np.random.default_rng(1).integers(0, 2**32, 4096, dtype=np.uint32)
  x[:3] = [0, 1, 2**32 - 1]
  out = np.empty_like(x)
  f.mix32(x, out)
  with np.errstate(over="ignore"):
    np.testing.assert_array_equal(out, nv.mix32(x, np))
  u = np.empty(x.shape, np.float32)
  f.uniform_from_bits(x, u)
  assert_same_bits(u, np.asarray(nv.uniform_from_bits(jnp.asarray(x))))
  assert u.min() >= 0 and u.max() < 1
  for seed in (0, 1, 42, 2**32 - 1):
    s = np.empty(16, np.float32)
    f.rht_signs(seed, s)
    assert_same_bits(s, nv.rht_signs(seed))


def test_inverse_of_six_is_numpys_float32():
  f = extension_or_skip().format
  assert np.float32(f.INV_E2M1_MAX) == np.float32(1 / 6)
  assert np.float32(1 / 6).view(np.uint32) == 0x3E2AAAAB


def test_global_scale_constant_and_compile_time_keys_match_everywhere():
  f = extension_or_skip().format
  assert_same_bits(np.float32(f.INV_GLOBAL_SCALE_DIVISOR), formats.INV_GLOBAL_SCALE_DIVISOR)
  amax = np.float32(3.7)
  assert_same_bits(np.asarray(nv.global_decode_scale(amax)), amax * formats.INV_GLOBAL_SCALE_DIVISOR)
  rng = np.random.default_rng(2)
  for key, data in [(0, 0), (2**32 - 1, 1), *rng.integers(0, 2**32, (20, 2)).tolist()]:
    with np.errstate(over="ignore"):
      want = int(nv.fold_in(np.uint32(key), np.uint32(data), np))
    assert formats.fold_in_int(key, data) == want


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_tensor_digest_is_a_wrapping_sum_of_the_bits(dtype):
  x = np.random.default_rng(3).standard_normal((300, 70)).astype(np.float32) * 1e4
  xd = np.asarray(jnp.asarray(x, dtype))
  assert int(nv.tensor_digest(jnp.asarray(xd))) == digest_np(xd)
