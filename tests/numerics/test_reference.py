"""Properties of the pure-JAX reference (xla_fp4.numerics), the oracle of every kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4_testing import assert_same_bits, dequantize, qdq, quantize
from xla_fp4 import numerics as nv


def _normal(shape, seed=0, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


# ---- stochastic rounding ----

def test_stochastic_rounding_is_unbiased():
  n = 1 << 16
  v = np.array([0.1, 0.25, 0.7, 1.3, 2.2, 2.5, 3.9, 4.5, 5.99, -0.3, -1.75, -5.0], np.float32)
  u = nv.uniform_from_bits(nv.random_bits(jnp.uint32(7), (v.size, n)))
  mean = np.asarray(jnp.mean(nv.round_e2m1_stochastic(jnp.asarray(v)[:, None], u), axis=1))
  # The rounding error is at most one grid step (<= 2): the std of a mean over n samples is <= 1 / sqrt(n).
  np.testing.assert_allclose(mean, v, atol=5 / np.sqrt(n))


def test_random_bits_depend_on_key_only():
  x = _normal((64, 64))
  a, b, c = (qdq(x, rounding="stochastic", key=jnp.uint32(k)) for k in (1, 1, 2))
  assert_same_bits(a, b)
  assert (np.asarray(a) != np.asarray(c)).mean() > 0.1
  bits1, bits2 = nv.random_bits(jnp.uint32(1), (1000,)), nv.random_bits(jnp.uint32(2), (1000,))
  assert (np.asarray(bits1) != np.asarray(bits2)).all()


# ---- RHT ----

def test_rht_preserves_dot_products_and_is_the_documented_matrix():
  a, b = _normal((8, 64), 1), _normal((8, 64), 2)
  ta, tb = (jax.jit(nv.random_hadamard_transform, static_argnames=("axis", "seed"))(t, axis=1, seed=5) for t in (a, b))
  np.testing.assert_allclose(ta @ tb.T, a @ b.T, rtol=1e-5, atol=1e-4)
  m = nv.hadamard_matrix(5).astype(np.float64)
  np.testing.assert_allclose(m @ m.T, np.eye(16), atol=1e-12)
  expected = (np.asarray(a, np.float64).reshape(8, 4, 16) @ m).reshape(8, 64)
  np.testing.assert_allclose(np.asarray(ta), expected, rtol=1e-5, atol=1e-5)


def test_rht_signs_reproducible_from_seed():
  np.testing.assert_array_equal(nv.rht_signs(3), nv.rht_signs(3))
  assert set(np.unique(nv.rht_signs(3))) <= {-1.0, 1.0}
  assert not np.array_equal(nv.rht_signs(3), nv.rht_signs(4))


def test_rht_along_leading_axis_equals_transposed():
  x = _normal((32, 24), 3)
  assert_same_bits(nv.random_hadamard_transform(x, axis=0, seed=9), nv.random_hadamard_transform(x.T, axis=1, seed=9).T)


# ---- 2D scaling, packing ----

@pytest.mark.parametrize("shape", [(64, 48), (32, 40), (16, 16)])
def test_2d_scaling_is_transpose_consistent(shape):
  w = _normal(shape, 4)
  t, tt = quantize(w, axis=0, block_2d=True), quantize(w.T, axis=1, block_2d=True)
  assert_same_bits(t.values.astype(jnp.float32), tt.values.astype(jnp.float32).T)
  assert_same_bits(t.scales, tt.scales.T)
  # every 16x16 tile has one scale
  s = np.asarray(t.scales.astype(jnp.float32))
  for c0 in range(0, s.shape[1], 16):
    assert (s[:, c0:c0 + 16] == s[:, c0:c0 + 1]).all()


def test_pack_unpack_round_trip():
  x = _normal((48, 64), 5)
  t = quantize(x, block_2d=True)
  u = nv.unpack(nv.pack(t), block_2d=True)
  assert_same_bits(u.values.astype(jnp.float32), t.values.astype(jnp.float32))
  assert_same_bits(u.scales, t.scales)
  assert_same_bits(dequantize(u), dequantize(t))


@pytest.mark.parametrize("rows,k", [(1, 16), (130, 80), (256, 128)])
def test_swizzled_layout_matches_the_index_formula(rows, k):
  cols = k // 16
  scales = (np.arange(rows * cols) % 250 + 1).astype(np.uint8).reshape(rows, cols)
  flat = np.asarray(nv.swizzle_scales(jnp.asarray(scales)))
  rp, cp = nv.padded_scale_shape(rows, k)
  expected = np.zeros(rp * cp, np.uint8)
  for r in range(rows):
    for c in range(cols):
      expected[((r // 128) * (cp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4] = scales[r, c]
  np.testing.assert_array_equal(flat, expected)
  np.testing.assert_array_equal(np.asarray(nv.unswizzle_scales(jnp.asarray(flat), rows, k)), scales)


# ---- emulated GEMM ----

def _scaled64(t):
  """q * scale of an NVFP4Tensor quantized along its last axis, float64."""
  q = np.asarray(t.values.astype(jnp.float32), np.float64)
  s = np.repeat(np.asarray(t.scales.astype(jnp.float32), np.float64), 16, axis=-1)
  return q * s


@pytest.mark.parametrize("rht", [False, True])
def test_emulated_gemm_equals_float64_formula(rht):
  a, b = _normal((32, 64), 6), _normal((64, 24), 7) * 3
  out = jax.jit(lambda a, b: nv.dot_general(a, b, (((1,), (0,)), ((), ())), a_recipe=nv.OperandRecipe(rht=rht),
                                            b_recipe=nv.OperandRecipe(block_2d=True, rht=rht), rht_seed=11))(a, b)
  prep = (lambda x: nv.random_hadamard_transform(x, axis=-1, seed=11)) if rht else (lambda x: x)
  ta = quantize(prep(a), axis=-1)
  tb = quantize(prep(b.T), axis=-1, block_2d=True)
  expected = (_scaled64(ta) @ _scaled64(tb).T) * (np.float64(ta.global_scale) * np.float64(tb.global_scale))
  np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_gemm_rejects_bad_contraction_size():
  with pytest.raises(ValueError, match="multiple of 16"):
    nv.dot_general(jnp.ones((4, 24)), jnp.ones((24, 4)), (((1,), (0,)), ((), ())))


def test_quantize_rejects_bad_axis_size():
  with pytest.raises(ValueError, match="multiple of 16"):
    quantize(jnp.ones((4, 24)), axis=1)


# ---- transformations and dtypes ----

def test_jit_vmap_grad():
  x = _normal((4, 32, 32), 8)
  eager = np.stack([np.asarray(nv.qdq(xi)) for xi in x])
  assert_same_bits(jax.jit(jax.vmap(nv.qdq))(x), eager)
  w = _normal((32, 32), 9)
  g = jax.grad(lambda x: jnp.sum(qdq(x) * w))(x[0])
  assert_same_bits(g, w)  # straight-through
  b = _normal((32, 16), 10)
  dn = (((1,), (0,)), ((), ()))
  ga = jax.jit(jax.grad(lambda a: jnp.sum(nv.dot_general(a, b, dn))))(x[0])
  assert ga.shape == (32, 32) and np.isfinite(np.asarray(ga)).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_dtypes(dtype):
  x = _normal((16, 64), 11, dtype)
  y = qdq(x)
  assert y.dtype == dtype
  assert_same_bits(y, qdq(x.astype(jnp.float32)).astype(dtype))
  t = quantize(x)
  assert t.values.dtype == jnp.float4_e2m1fn and t.scales.dtype == jnp.float8_e4m3fn


# ---- edge cases ----

def test_all_zero_has_no_nan():
  t = quantize(jnp.zeros((16, 32)))
  assert float(t.global_scale) == 0
  assert np.asarray(dequantize(t)).tolist() == np.zeros((16, 32)).tolist()
  assert not np.isnan(np.asarray(qdq(jnp.zeros((16, 32)), rounding="stochastic", key=1))).any()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_propagate(bad):
  x = np.array(_normal((16, 32), 12))
  x[3, 5] = bad
  assert not np.isfinite(np.asarray(qdq(x))).all()
  assert not np.isfinite(np.asarray(dequantize(quantize(x)))).all()


def test_e4m3_scale_overflow_saturates():
  x = _normal((16, 32), 13)
  s_dec = nv.global_decode_scale(nv.amax(x)) / 4  # too small: block scales would exceed 448
  t = quantize(x, global_scale=s_dec)
  assert np.nanmax(np.asarray(t.scales.astype(jnp.float32))) == 448
  y = np.asarray(dequantize(t))
  assert np.isfinite(y).all() and np.abs(y).max() == np.float32(6 * 448) * np.float32(s_dec)


def test_subnormals_and_tiny_blocks():
  x = np.ones((2, 32), np.float32)
  x[0, :16] = 1e-30  # its block scale rounds to zero: encodes zeros, no NaN
  x[1, 16:] = 1e-40  # float32 subnormal inputs
  y = np.asarray(qdq(x))
  assert np.isfinite(y).all()
  assert (y[0, :16] == 0).all() and (y[0, 16:] == 1).all()
  assert (y[1, 16:] == 0).all()


def test_negative_zero_keeps_its_sign():
  x = np.ones((1, 16), np.float32)
  x[0, 3] = -0.0
  y = np.asarray(qdq(x))
  assert y[0, 3] == 0 and np.signbit(y[0, 3])
  assert np.signbit(np.asarray(quantize(x).values.astype(jnp.float32))[0, 3])


def test_nan_propagates_through_amax_in_every_layout():
  """XLA CPU's max reduction drops NaN for some layouts; the reference must not (regression)."""
  x = np.array(_normal((16, 16, 16), 14))
  x[14, 5, 7] = np.nan
  assert np.isnan(jax.jit(nv.amax)(x))
  t = quantize(x)
  assert np.isnan(np.asarray(t.scales.astype(jnp.float32))[14, 5, 0])
  assert np.isnan(np.asarray(dequantize(t))[14, 5]).all()
