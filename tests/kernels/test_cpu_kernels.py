"""The C++ CPU kernels against the pure-JAX reference: bit for bit over shapes, axes, dtypes and recipes."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from nvfp4_testing import assert_same_bits, digest_np, extension_or_skip
from xla_fp4 import kernels, numerics as nv
from xla_fp4.numerics import formats, kernel_twins
from xla_fp4.numerics import nvfp4 as qz
from xla_fp4.numerics.rht import rht_f32


pytestmark = pytest.mark.usefixtures("_extension")
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@pytest.fixture(scope="module")
def _extension():
  extension_or_skip()


# ---- the reference, jitted ----

@functools.partial(jax.jit, static_argnames=("axis", "block_2d", "stochastic", "rht", "rht_seed", "apply_global_scale"))
def ref_qdq(x, s_dec, key, *, axis, block_2d, stochastic, rht, rht_seed, apply_global_scale=True):
  """The kernel's contract: numerics qdq of (rht(x) if rht else x) with the caller's s_dec and key; without the global
  scale the result is q * scale."""
  x32 = x.astype(jnp.float32)
  if rht:
    x32 = rht_f32(x32, axis, rht_seed)
  q, scales = qz._encode(x32, axis, block_2d, "stochastic" if stochastic else "nearest", key, s_dec)
  return qz._decode(q, scales, s_dec if apply_global_scale else 1.0).reshape(x.shape).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("block_2d", "stochastic", "rht", "rht_seed"))
def ref_packed(x, s_dec, key, *, block_2d, stochastic, rht, rht_seed):
  x = rht_f32(x.astype(jnp.float32), -1, rht_seed) if rht else x
  p = nv.pack(nv.quantize(x, block_2d=block_2d, rounding="stochastic" if stochastic else "nearest", key=key,
                          global_scale=s_dec))
  return p.data, jax.lax.bitcast_convert_type(p.scales, jnp.uint8)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def ref_dequantize_packed(data, scales, s_dec, shape, dtype):
  p = nv.PackedNVFP4(data=data, scales=jax.lax.bitcast_convert_type(scales, jnp.float8_e4m3fn), global_scale=s_dec,
                     shape=shape)
  return nv.dequantize(nv.unpack(p), dtype)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def s_dec_of(x, axis, rht, rht_seed):
  x32 = jnp.asarray(x, jnp.float32)
  return nv.global_decode_scale(nv.amax(rht_f32(x32, axis, rht_seed) if rht else x32))


# ---- inputs ----

@st.composite
def tensors(draw, max_rank=3, k_last=False):
  rank = 2 if k_last else draw(st.integers(1, max_rank))
  axis = rank - 1 if k_last else draw(st.integers(-rank, rank - 1))
  shape = [draw(st.sampled_from([1, 2, 5, 16, 17, 33])) for _ in range(rank)]
  shape[axis] = draw(st.sampled_from([16, 32, 48]))
  dtype = draw(st.sampled_from(DTYPES))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  x = rng.standard_normal(shape).astype(np.float32) * np.float32(2.0 ** draw(st.integers(-20, 20)))
  special = draw(st.sampled_from(["none", "zeros", "outliers", "nan", "inf", "tiny", "negzero"]))
  flat = x.reshape(-1)
  if special == "zeros":
    flat[: flat.size // 2] = 0
  elif special == "outliers":
    flat[rng.integers(0, flat.size, 3)] *= 1000
  elif special in ("nan", "inf"):
    flat[rng.integers(0, flat.size)] = np.nan if special == "nan" else -np.inf
  elif special == "tiny":
    flat[::3] = 1e-39  # float32 subnormal
  elif special == "negzero":
    flat[::2] = -0.0
  return jnp.asarray(x).astype(dtype), axis


recipes = st.fixed_dictionaries(dict(block_2d=st.booleans(), stochastic=st.booleans(), rht=st.booleans(),
                                     rht_seed=st.integers(0, 2**32 - 1)))


# ---- qdq and rht ----

@SETTINGS
@given(t=tensors(), recipe=recipes, key=st.integers(0, 2**32 - 1), scale_kind=st.sampled_from(["amax", "given"]),
       apply_global_scale=st.booleans())
def test_qdq_matches_reference(t, recipe, key, scale_kind, apply_global_scale):
  x, axis = t
  recipe = dict(recipe, apply_global_scale=apply_global_scale)
  s_dec = s_dec_of(x, axis, recipe["rht"], recipe["rht_seed"]) if scale_kind == "amax" else jnp.float32(1e-3)
  key = jnp.uint32(key)
  got = kernels.qdq(x, s_dec, key, axis=axis, **recipe)
  assert_same_bits(got, ref_qdq(x, s_dec, key, axis=axis, **recipe))


def test_decoded_values_are_exact_in_every_dtype():
  """q * scale, what xla_fp4_qdq stores without the global scale, is exact in float32, bfloat16 and float16 for every
  E2M1 value and every E4M3 scale, and zero or at least 2**-10 in magnitude: so the kernels skip DecodeElement's flush
  and store bfloat16 by truncation (cpu_quantize.h StoreExact)."""
  scales = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
  scales = scales[np.isfinite(scales)]
  q = np.concatenate([formats.E2M1_VALUES, -formats.E2M1_VALUES]).astype(np.float64)
  exact = (q[:, None] * scales[None, :]).ravel()
  p = exact.astype(np.float32)
  np.testing.assert_array_equal(p.astype(np.float64), exact)
  for dtype in (ml_dtypes.bfloat16, np.float16):
    np.testing.assert_array_equal(p.astype(dtype).astype(np.float32), p)
  assert np.all((p == 0) | (np.abs(p) >= 2.0**-10))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_qdq_takes_every_block_scale_bit_for_bit(dtype, stochastic):
  """A tensor whose 1x16 blocks take every E4M3 code (block amax 6 * scale with s_dec = 1), a zero block, a NaN block
  and an Inf block: xla_fp4_qdq without the global scale equals the reference bit for bit."""
  rng = np.random.default_rng(0)
  scales = np.arange(128, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)[:127]  # 0 .. 448
  rows = rng.uniform(-1, 1, (scales.size + 2, 16)).astype(np.float32) * np.append(scales, [1, 1])[:, None] * 6
  rows[: scales.size, 0] = 6 * scales  # the block's amax
  rows[-2, 3], rows[-1, 5] = np.nan, -np.inf
  x = jnp.asarray(rows.astype(dtype))
  recipe = dict(axis=-1, block_2d=False, stochastic=stochastic, rht=False, rht_seed=0, apply_global_scale=False)
  key = jnp.uint32(7)
  assert_same_bits(kernels.qdq(x, jnp.float32(1.0), key, **recipe), ref_qdq(x, jnp.float32(1.0), key, **recipe))


@SETTINGS
@given(t=tensors(), seed=st.integers(0, 2**32 - 1))
def test_rht_matches_reference(t, seed):
  x, axis = t
  assert_same_bits(kernels.rht(x, axis=axis, seed=seed), jax.jit(rht_f32, static_argnums=(1, 2))(
      x.astype(jnp.float32), axis, seed))


@SETTINGS
@given(t=tensors(), rht=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_block_amax_matches_reference(t, rht, seed):
  """Per 1x16 block max |rht(x) or x|, NaN counted as Inf; its max is what s_dec is made of."""
  x, axis = t
  got = kernels.block_amax(x, axis=axis, rht=rht, rht_seed=seed)
  want = jax.jit(nv.block_amax, static_argnames=("axis", "rht_seed"))(x, axis=axis, rht_seed=seed if rht else None)
  assert_same_bits(got, want)
  x32 = np.asarray(x, np.float32)
  src = np.asarray(jax.jit(rht_f32, static_argnums=(1, 2))(x32, axis, seed)) if rht else x32
  assert np.asarray(got).max() == np.float32(np.where(np.isnan(src), np.inf, np.abs(src)).max())


@SETTINGS
@given(t=tensors(), rht=st.booleans())
def test_block_amax_digests_each_block_in_the_same_pass(t, rht):
  """With digest: the maxima as without, and each block's wrapping sum of its element bits (16-bit floats
  zero-extended), which sum to x's digest: the stochastic-rounding key of a partitioned program, bit for bit the
  whole-tensor quantizer's."""
  x, axis = t
  maxima, digests = kernels.block_amax(x, axis=axis, rht=rht, rht_seed=7, digest=True)
  assert_same_bits(maxima, kernels.block_amax(x, axis=axis, rht=rht, rht_seed=7))
  assert digests.dtype == jnp.uint32
  np.testing.assert_array_equal(digests, jax.jit(nv.block_digest, static_argnames="axis")(x, axis=axis))
  bits = np.asarray(x).view(np.uint32 if np.asarray(x).dtype.itemsize == 4 else np.uint16).astype(np.uint64)
  assert int(np.asarray(digests, np.uint64).sum()) % 2**32 == int(bits.sum()) % 2**32 == int(nv.tensor_digest(x))


@SETTINGS
@given(t=tensors(), recipe=recipes, salt=st.integers(0, 2**32 - 1))
def test_qdq_with_scale_measures_x_itself(t, recipe, salt):
  """s_dec = max |rht(x) or x| (NaN counted as Inf) * f32(1/2688); key = salt ^ digest(x) when stochastic: the numbers
  the pass's reductions feed xla_fp4_qdq in a partitioned program, and those of the pure-JAX twin."""
  x, axis = t
  y, s_dec = kernels.qdq_with_scale(x, salt, axis=axis, **recipe)
  x32 = x.astype(jnp.float32)
  src = np.asarray(jax.jit(rht_f32, static_argnums=(1, 2))(x32, axis, recipe["rht_seed"]) if recipe["rht"] else x32)
  want_s = np.float32(np.where(np.isnan(src), np.inf, np.abs(src)).max()) * formats.INV_GLOBAL_SCALE_DIVISOR
  assert_same_bits(s_dec, jnp.float32(want_s))
  key = jnp.uint32(salt ^ digest_np(x) if recipe["stochastic"] else salt)
  assert_same_bits(y, ref_qdq(x, jnp.float32(want_s), key, axis=axis, apply_global_scale=False, **recipe))
  twin_y, twin_s = jax.jit(functools.partial(kernel_twins.qdq_with_scale, axis=axis, **recipe))(x, jnp.uint32(salt))
  assert_same_bits(twin_y, y)
  assert_same_bits(twin_s, s_dec)


def test_qdq_with_scale_key_changes_with_x():
  x = jax.random.normal(jax.random.key(0), (64, 64))
  recipe = dict(axis=1, stochastic=True)
  a, _ = kernels.qdq_with_scale(x, 1, **recipe)
  b, _ = kernels.qdq_with_scale(x.at[0, 0].add(1e-3), 1, **recipe)
  c, _ = kernels.qdq_with_scale(x, 2, **recipe)
  assert not jnp.array_equal(a[1:], b[1:]) and not jnp.array_equal(a, c)


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("axis", [0, 1])
def test_qdq_large_multithreaded_under_jit(axis, block_2d, stochastic):
  """Big enough to run on several threads, inside jit, including values whose scales are float32 subnormals (XLA
  flushes them; the helper threads must too)."""
  x = jax.random.normal(jax.random.key(1), (512, 528), jnp.float32)
  x = x.at[:16].multiply(1e-36)
  recipe = dict(axis=axis, block_2d=block_2d, stochastic=stochastic, rht=False, rht_seed=0)
  for s_dec in (s_dec_of(x, axis, False, 0), jnp.float32(1e-40)):
    got = jax.jit(lambda x, s: kernels.qdq(x, s, 3, **recipe))(x, s_dec)
    assert_same_bits(got, ref_qdq(x, s_dec, jnp.uint32(3), **recipe))


# ---- packed ----

@SETTINGS
@given(t=tensors(k_last=True), recipe=recipes, key=st.integers(0, 2**32 - 1), out_dtype=st.sampled_from(DTYPES))
def test_packed_quantize_and_dequantize_match_reference(t, recipe, key, out_dtype):
  x, _ = t
  s_dec = s_dec_of(x, -1, recipe["rht"], recipe["rht_seed"])
  key = jnp.uint32(key)
  data, scales = kernels.quantize_packed(x, s_dec, key, **recipe)
  ref_data, ref_scales = ref_packed(x, s_dec, key, **recipe)
  np.testing.assert_array_equal(np.asarray(data), np.asarray(ref_data))
  np.testing.assert_array_equal(np.asarray(scales), np.asarray(ref_scales))
  assert_same_bits(kernels.dequantize_packed(data, scales, s_dec, dtype=out_dtype),
                   ref_dequantize_packed(ref_data, ref_scales, s_dec, x.shape, out_dtype))


@SETTINGS
@given(t=tensors(k_last=True), recipe=recipes, key=st.integers(0, 2**32 - 1))
def test_packed_along_axis_0_reads_x_as_the_program_holds_it(t, recipe, key):
  """axis=0: x (K, rows) packs to (K/2, rows) codes and (K/16, rows) scales, read in place (the emitter's x @ w weight
  and wgrad operands). With nearest rounding they are the transposes of x.T's packed form, bit for bit; with any
  rounding they decode to qdq along axis 0 (stochastic rounding's bits follow each element's position in x)."""
  xt, _ = t
  x = xt.T  # (K, rows)
  k, rows = x.shape
  s_dec = s_dec_of(x, 0, recipe["rht"], recipe["rht_seed"])
  key = jnp.uint32(key)
  data, scales = kernels.quantize_packed(x, s_dec, key, axis=0, **recipe)
  assert data.shape == (k // 2, rows) and scales.shape == (k // formats.BLOCK, rows)
  if not recipe["stochastic"]:
    along_1 = kernels.quantize_packed(xt, s_dec, key, axis=1, **recipe)
    np.testing.assert_array_equal(np.asarray(data).T, np.asarray(along_1[0]))
    np.testing.assert_array_equal(np.asarray(scales).T, np.asarray(along_1[1]))
  if np.isfinite(np.asarray(x, np.float32)).all():  # E2M1 codes hold no NaN or Inf, which qdq passes through
    assert_same_bits(kernels.dequantize_packed(data.T, scales.T, s_dec, dtype=x.dtype),
                     kernels.qdq(x, s_dec, key, axis=0, **recipe).T)


pair_copies = st.fixed_dictionaries(dict(stochastic=st.booleans(), rht=st.booleans()))


@SETTINGS
@given(rows=st.sampled_from([16, 32, 80]), k=st.sampled_from([16, 48, 272, 528]), dtype=st.sampled_from(DTYPES),
       row=pair_copies, col=pair_copies, seed=st.integers(0, 2**32 - 1), four_over_six=st.booleans(),
       keys=st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)),
       special=st.sampled_from(["none", "nan", "tiny"]))
def test_packed_pair_is_both_packed_copies_bit_for_bit(rows, k, dtype, row, col, seed, four_over_six, keys, special):
  """One read of x (rows, K) makes quantize_packed's copy along axis 1 with the row recipe and along axis 0 with the
  column recipe (K not a multiple of the CUDA kernel's 256-column tiles, and over a partial one, included)."""
  rng = np.random.default_rng(seed % 1000)
  x = rng.standard_normal((rows, k)).astype(np.float32) * np.float32(2.0 ** rng.integers(-20, 20))
  if special == "nan":
    x[rng.integers(0, rows), rng.integers(0, k)] = np.nan
  elif special == "tiny":
    x[::3, ::2] = 1e-39
  x = jnp.asarray(x).astype(dtype)
  s_row, s_col = s_dec_of(x, 1, row["rht"], seed), s_dec_of(x, 0, col["rht"], seed)
  got = kernels.quantize_packed_pair(x, s_row, s_col, keys[0], keys[1], row_stochastic=row["stochastic"],
                                     row_rht=row["rht"], col_stochastic=col["stochastic"], col_rht=col["rht"],
                                     rht_seed=seed, four_over_six=four_over_six)
  want = [*kernels.quantize_packed(x, s_row, keys[0], axis=1, rht_seed=seed, four_over_six=four_over_six, **row),
          *kernels.quantize_packed(x, s_col, keys[1], axis=0, rht_seed=seed, four_over_six=four_over_six, **col)]
  assert [g.shape for g in got] == [(rows, k // 2), (rows, k // 16), (rows // 2, k), (rows // 16, k)]
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_packed_pair_large_multithreaded_under_jit(dtype):
  """Strips of 16 rows spread over the thread pool give the single quantizers' numbers (the gradient's recipe:
  stochastic rounding both ways, the RHT on the column-wise copy)."""
  x = jax.random.normal(jax.random.PRNGKey(3), (1024, 768), dtype)
  s_row, s_col = s_dec_of(x, 1, False, 7), s_dec_of(x, 0, True, 7)
  pair = jax.jit(functools.partial(kernels.quantize_packed_pair, row_stochastic=True, col_stochastic=True,
                                   col_rht=True, rht_seed=7))
  got = pair(x, s_row, s_col, jnp.uint32(5), jnp.uint32(6))
  want = [*kernels.quantize_packed(x, s_row, 5, axis=1, stochastic=True, rht_seed=7),
          *kernels.quantize_packed(x, s_col, 6, axis=0, stochastic=True, rht=True, rht_seed=7)]
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("m,n,k", [(1, 1, 16), (130, 40, 256)])
def test_gemm_matches_emulated_dot_and_float64(m, n, k):
  a = jax.random.normal(jax.random.key(2), (m, k), jnp.float32)
  b = jax.random.normal(jax.random.key(3), (k, n), jnp.float32) * 5
  sa, sb = s_dec_of(a, -1, False, 0), s_dec_of(b, 0, False, 0)
  a_data, a_scales = kernels.quantize_packed(a, sa)
  b_data, b_scales = kernels.quantize_packed(b.T, sb, block_2d=True)
  c = np.asarray(kernels.gemm_packed(a_data, a_scales, b_data, b_scales, sa * sb))
  emulated = np.asarray(jax.jit(lambda a, b: nv.dot_general(a, b, (((1,), (0,)), ((), ())),
                                                            b_recipe=nv.OperandRecipe(block_2d=True)))(a, b))
  scale = np.abs(emulated).max()
  np.testing.assert_allclose(c, emulated, rtol=1e-5, atol=1e-6 * scale)

  def scaled64(data, scales, rows):
    x = np.asarray(kernels.dequantize_packed(data, scales, 1.0), np.float64)
    assert x.shape == (rows, k)
    return x

  exact = scaled64(a_data, a_scales, m) @ scaled64(b_data, b_scales, n).T * (np.float64(sa) * np.float64(sb))
  np.testing.assert_allclose(c, exact, rtol=1e-5, atol=k * 2.0**-24 * np.abs(exact).max())
  assert kernels.gemm_packed(a_data, a_scales, b_data, b_scales, sa * sb, dtype=jnp.bfloat16).dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gemm_reads_a_16x16_tiled_b_along_the_other_axis(dtype):
  """b_transposed: the forward's packed weight (codes along its K) serves the dgrad, which contracts the weight's other
  dim; in 16x16 tiles the codes are those of packing along that dim, so the product equals the plain GEMM's bit for
  bit (a dgrad reading its forward's copy computes what quantizing the weight again would)."""
  w = jax.random.normal(jax.random.key(4), (96, 64), dtype)  # (K_f, N_f) as x @ w holds it
  dy = jax.random.normal(jax.random.key(5), (40, 64), dtype)  # the dgrad contracts N_f
  sw, sg = s_dec_of(w, 0, False, 0), s_dec_of(dy, -1, False, 0)
  g_data, g_scales = kernels.quantize_packed(dy, sg)
  fwd_data, fwd_scales = kernels.quantize_packed(w, sw, axis=0, block_2d=True)  # (K_f/2, N_f): w packed along K_f
  fwd_data, fwd_scales = np.asarray(fwd_data).T, np.asarray(fwd_scales).T  # the fprop's b (N_f, K_f/2)
  again = kernels.quantize_packed(w, sw, axis=1, block_2d=True)  # (K_f, N_f/2): the dgrad's own packing
  for out in (jnp.float32, jnp.bfloat16):
    shared = kernels.gemm_packed(g_data, g_scales, fwd_data, fwd_scales, sg * sw, dtype=out, b_transposed=True)
    assert shared.shape == (40, 96)
    assert_same_bits(shared, kernels.gemm_packed(g_data, g_scales, *again, sg * sw, dtype=out))
  with pytest.raises(Exception, match="b_transposed"):
    kernels.gemm_packed(g_data, g_scales, fwd_data[:32], fwd_scales[:32], 1.0, b_transposed=True).block_until_ready()
  with pytest.raises(Exception, match="multiple of 16"):  # N = 24: a partial tile (CheckPackedData)
    kernels.gemm_packed(g_data, g_scales, fwd_data[:, :12], fwd_scales[:, :1], 1.0,
                        b_transposed=True).block_until_ready()


def _packed_rows(seed, shape, block_2d=False):
  x = jax.random.normal(jax.random.key(seed), shape, jnp.float32) * (1 + seed)
  s_dec = s_dec_of(x, -1, False, 0)
  return (*kernels.quantize_packed(x, s_dec, block_2d=block_2d), s_dec)


@pytest.mark.parametrize("sizes", [(20, 0, 9, 40, 11), (50, 60, -3, 7, 0)], ids=["rows_after", "clipped"])
def test_ragged_gemm_runs_each_group_of_rows_with_its_own_matrix(sizes):
  """xla_fp4_ragged_gemm_packed (ragged_k false): group g's rows times b[g] and alpha[g], bit for bit the dense FP4
  GEMM on those rows; rows after the last group are zero; sizes past M are clipped and negative ones are empty."""
  m, n, k, groups = 96, 24, 64, len(sizes)
  a_data, a_scales, _ = _packed_rows(1, (m, k))
  b = [_packed_rows(2 + g, (n, k), block_2d=True) for g in range(groups)]
  b_data, b_scales = jnp.stack([d for d, _, _ in b]), jnp.stack([s for _, s, _ in b])
  alpha = jnp.asarray([0.5 + g for g in range(groups)], jnp.float32)
  c = np.asarray(kernels.ragged_gemm_packed(a_data, a_scales, b_data, b_scales, sizes, alpha))
  assert c.shape == (m, n)
  start = 0
  for g, size in enumerate(sizes):
    r0, r1 = min(start, m), min(start + max(size, 0), m)
    start += max(size, 0)
    if r1 > r0:
      want = kernels.gemm_packed(a_data[r0:r1], a_scales[r0:r1], b_data[g], b_scales[g], alpha[g])
      assert_same_bits(c[r0:r1], want)
  assert not c[min(start, m):].any()
  bf16 = kernels.ragged_gemm_packed(a_data, a_scales, b_data, b_scales, sizes, alpha, dtype=jnp.bfloat16)
  assert_same_bits(bf16, jnp.asarray(c).astype(jnp.bfloat16))


def test_ragged_gemm_with_ragged_k_contracts_each_group_over_its_range_of_k():
  """ragged_k true (an expert layer's wgrad): C[g] = alpha[g] * A·Bᵀ over group g's columns, bit for bit the FP4
  GEMM on those columns; an empty group, and K after the last group, contribute nothing."""
  m, n, k, sizes = 40, 24, 160, (32, 0, 64, 16)
  (a_data, a_scales, _), (b_data, b_scales, _) = _packed_rows(1, (m, k)), _packed_rows(2, (n, k))
  alpha = jnp.asarray([1.0, 2.0, 0.25, 3.0], jnp.float32)
  c = np.asarray(kernels.ragged_gemm_packed(a_data, a_scales, b_data, b_scales, sizes, alpha, ragged_k=True))
  assert c.shape == (len(sizes), m, n)
  k0 = 0
  for g, size in enumerate(sizes):
    if size:
      cols, blocks = slice(k0 // 2, (k0 + size) // 2), slice(k0 // 16, (k0 + size) // 16)
      assert_same_bits(c[g], kernels.gemm_packed(a_data[:, cols], a_scales[:, blocks], b_data[:, cols],
                                                 b_scales[:, blocks], alpha[g]))
    else:
      assert not c[g].any()
    k0 += size


def test_ragged_gemm_errors_say_what_was_wrong():
  (a_data, a_scales, _), (b_data, b_scales, _) = _packed_rows(1, (32, 64)), _packed_rows(2, (16, 64))
  with pytest.raises(Exception, match="whole blocks of 16"):
    kernels.ragged_gemm_packed(a_data, a_scales, b_data, b_scales, [8, 8], [1.0, 1.0],
                               ragged_k=True).block_until_ready()
  with pytest.raises(Exception, match=r"b_data must be uint8 \(G, N, K/2\)"):
    kernels.ragged_gemm_packed(a_data, a_scales, b_data, b_scales, [16, 16], [1.0, 1.0]).block_until_ready()
  with pytest.raises(Exception, match="alpha"):
    kernels.ragged_gemm_packed(a_data, a_scales, b_data[None], b_scales[None], [16], [1.0, 2.0]).block_until_ready()


# ---- contract: errors, registration, attributes ----

# ---- the MX formats' quantizer (xla_fp4_mx_qdq) ----

MX_SHAPES = [((64, 96), 1), ((96, 64), 0), ((4, 64, 32), 1), ((2, 32, 3, 32), 1), ((48, 64), 1), ((64, 80), 0)]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("shape,axis", MX_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mx_qdq_matches_its_twin(shape, axis, dtype, fp8):
  """Every recipe the MX formats take (2D tiles, partial ones where the partner dims are not a multiple of 32 (48,
  80); stochastic rounding for E2M1 only, as the format records say), with blocks of very different magnitudes, a
  zero block and a NaN."""
  rng = np.random.default_rng(sum(shape) + axis)
  x = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, shape[:1] + (1,) * (len(shape) - 1)))
  x.reshape(-1)[:32] = 0.0
  x.reshape(-1)[100] = np.nan
  x = jnp.asarray(x, dtype)
  for block_2d in (False, True):
    for stochastic in ([False] if fp8 else [False, True]):
      for rht in (False, True):
        attrs = dict(axis=axis, block_2d=block_2d, stochastic=stochastic, rht=rht, rht_seed=5, fp8=fp8)
        got = kernels.mx_qdq(x, 1234, **attrs)
        want = jax.jit(functools.partial(kernel_twins.mx_qdq, **attrs))(x, jnp.uint32(1234))
        assert_same_bits(got, want)


# ---- the packed MX formats (xla_fp4_mx_quantize_packed, xla_fp4_mx_dequantize_packed, xla_fp4_mx_gemm_packed) ----

def _mx_operand(seed, shape, dtype=jnp.float32):
  """Rows of very different magnitudes (E8M0 scales from 2^-20 to 2^14), a zero block and a NaN block."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp2(rng.integers(-20, 12, (shape[0], 1)))
  x[0, :32] = 0.0
  x[1, 40] = np.nan
  return jnp.asarray(x, dtype)


@pytest.mark.parametrize("fp8", [False, True], ids=["mxfp4", "mxfp8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mx_packed_matches_the_reference_packing_and_decodes_to_mx_qdq(fp8, dtype):
  """The kernel's codes and E8M0 bytes equal numerics.packing.pack_mx (from numerics/mx.py, not the kernels) byte for
  byte, NaN block included (0xFF), in every recipe the format takes; they decode (kernel and reference alike) to
  xla_fp4_mx_qdq's values bit for bit; along axis 0 (x as (K, rows), read in place) the bytes are the transposes."""
  x = _mx_operand(7, (48, 96), dtype)
  fmt = "mxfp8" if fp8 else "mxfp4"
  for block_2d in (False, True):
    for stochastic in ([False] if fp8 else [False, True]):
      for rht in (False, True):
        attrs = dict(block_2d=block_2d, stochastic=stochastic, rht=rht, rht_seed=3, fp8=fp8)
        data, scales = kernels.mx_quantize_packed(x, 99, axis=1, **attrs)
        assert data.shape == (48, 96 if fp8 else 48) and scales.shape == (48, 3)
        qdq = kernels.mx_qdq(x, 99, axis=1, **attrs)
        decoded = kernels.mx_dequantize_packed(data, scales, fp8=fp8, dtype=dtype)
        assert_same_bits(decoded, qdq)
        if not rht:  # the reference packs x as given (the RHT is the kernels' own step)
          ref_data, ref_scales = nv.pack_mx(x, fmt, block_2d=block_2d,
                                            rounding="stochastic" if stochastic else "nearest", key=99)
          np.testing.assert_array_equal(np.asarray(scales), np.asarray(ref_scales))
          live = ~np.isnan(np.asarray(qdq, np.float32)).reshape(48, 3, 32).any(-1)  # a NaN block's codes are unread
          per = 1 if fp8 else 2
          np.testing.assert_array_equal(np.asarray(data).reshape(48, 3, 32 // per)[live],
                                        np.asarray(ref_data).reshape(48, 3, 32 // per)[live])
          assert_same_bits(nv.unpack_mx(ref_data, ref_scales, fmt).astype(dtype), qdq)
        if not stochastic:
          t_data, t_scales = kernels.mx_quantize_packed(x.T, 99, axis=0, **attrs)
          np.testing.assert_array_equal(np.asarray(t_data).T, np.asarray(data))
          np.testing.assert_array_equal(np.asarray(t_scales).T, np.asarray(scales))
  scales = np.asarray(kernels.mx_quantize_packed(x, fp8=fp8)[1])
  assert scales[1, 1] == 0xFF and scales[0, 0] == 0  # the NaN block; the zero block's 2^-127


@pytest.mark.parametrize("fp8", [False, True], ids=["mxfp4", "mxfp8"])
def test_mx_gemm_packed_is_the_dot_of_the_decoded_operands(fp8):
  """C = A·Bᵀ of the decoded operands (exact q·scale), float32 accumulation, no alpha: within K float32 roundings
  of the float64 product, and within float32 summation order of the emulated MX GEMM (numerics.dot_general); the
  output dtype is the caller's; b_transposed reads a weight's 32x32-tiled copy along its other axis bit for bit."""
  fmt = "mxfp8" if fp8 else "mxfp4"
  m, n, k = 40, 64, 96
  a = jax.random.normal(jax.random.key(1), (m, k), jnp.float32)
  w = jax.random.normal(jax.random.key(2), (k, n), jnp.float32)  # x @ w: B = wᵀ
  tiles = not fp8  # MXFP8 weights take 1x32 blocks (the format record)
  a_data, a_scales = kernels.mx_quantize_packed(a, fp8=fp8)
  b_data, b_scales = kernels.mx_quantize_packed(w, axis=0, fp8=fp8, block_2d=tiles)
  b_data, b_scales = b_data.T, b_scales.T  # K-major (N, K)
  c = np.asarray(kernels.mx_gemm_packed(a_data, a_scales, b_data, b_scales, fp8=fp8))
  a64 = np.asarray(kernels.mx_dequantize_packed(a_data, a_scales, fp8=fp8), np.float64)
  b64 = np.asarray(kernels.mx_dequantize_packed(b_data, b_scales, fp8=fp8), np.float64)
  exact = a64 @ b64.T
  np.testing.assert_allclose(c, exact, rtol=0, atol=k * 2.0**-24 * np.abs(a64).max() * np.abs(b64).max())
  emulated = jax.jit(lambda a, w: nv.dot_general(a, w, (((1,), (0,)), ((), ())),
                                                 a_recipe=nv.OperandRecipe(format=fmt),
                                                 b_recipe=nv.OperandRecipe(format=fmt, block_2d=tiles)))(a, w)
  np.testing.assert_allclose(c, np.asarray(emulated), rtol=1e-5, atol=1e-6 * np.abs(exact).max())
  assert kernels.mx_gemm_packed(a_data, a_scales, b_data, b_scales, fp8=fp8, dtype=jnp.bfloat16).dtype == jnp.bfloat16
  if tiles:
    g = jax.random.normal(jax.random.key(3), (24, n), jnp.float32)  # the dgrad contracts w's N
    g_data, g_scales = kernels.mx_quantize_packed(g, fp8=fp8)
    fwd = (np.asarray(kernels.mx_quantize_packed(w, axis=0, fp8=fp8, block_2d=True)[i]).T for i in (0, 1))
    again = kernels.mx_quantize_packed(w, axis=1, fp8=fp8, block_2d=True)  # (K_f, N_f/2): the dgrad's own packing
    shared = kernels.mx_gemm_packed(g_data, g_scales, *fwd, fp8=fp8, b_transposed=True)
    assert_same_bits(shared, kernels.mx_gemm_packed(g_data, g_scales, *again, fp8=fp8))


# ---- Four Over Six in the kernels (arXiv 2512.02010; numerics/nvfp4.py _four_over_six) ----

FOUR_OVER_SIX_SHAPES = [((48, 64), -1), ((64, 48), 0), ((3, 32, 40), 1), ((40, 32), -1)]  # partial 16x16 tiles too


@pytest.mark.parametrize("shape,axis", FOUR_OVER_SIX_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_four_over_six_kernels_match_the_twins(shape, axis, dtype):
  """xla_fp4_qdq, xla_fp4_qdq_with_scale (s_dec = amax / 1536) and xla_fp4_quantize_packed with four_over_six: bit for
  bit the twins (numerics.nvfp4's 4/6 rule: both candidates with the same random bits, errors summed by halves over a
  block and a tile) in 1x16 blocks and 16x16 tiles, nearest and stochastic rounding, with and without the RHT; blocks
  take both choices (else the test would not tell the rule from either scale)."""
  rng = np.random.default_rng(sum(shape))
  # The first half of the elements (whole 16x16 tiles) of nearly equal magnitude, which a scale to 4 decodes better;
  # the rest heavy-tailed, where 6 wins.
  n = int(np.prod(shape))
  near_max = np.sign(rng.standard_normal(n)) * rng.uniform(0.7, 1.0, n)
  tailed = rng.standard_normal(n) * np.exp(rng.uniform(-3, 3, n))
  x = jnp.asarray(np.where(np.arange(n) < n // 2, near_max, tailed).reshape(shape), dtype)
  for block_2d in (False, True):
    for stochastic in (False, True):
      for rht in (False, True):
        recipe = dict(axis=axis, block_2d=block_2d, stochastic=stochastic, rht=rht, rht_seed=5, four_over_six=True)
        q, s_dec = kernels.qdq_with_scale(x, 77, **recipe)
        want_q, want_s = jax.jit(functools.partial(kernel_twins.qdq_with_scale, **recipe))(x, jnp.uint32(77))
        assert_same_bits(s_dec, want_s)
        assert_same_bits(q, want_q)
        key = jnp.uint32(123)
        got = kernels.qdq(x, s_dec, key, apply_global_scale=False, **recipe)
        assert_same_bits(got, jax.jit(functools.partial(kernel_twins.qdq, **recipe))(x, s_dec, key))
        plain = kernels.qdq(x, s_dec, key, apply_global_scale=False, **dict(recipe, four_over_six=False))
        changed = np.mean(np.asarray(got) != np.asarray(plain))
        assert changed < 0.75 and (rht or changed > 0), changed  # some blocks (tiles) chose 4, others 6 (the RHT
        # makes the near-max half's magnitudes Gaussian-like, where 6 may win everywhere)
        if len(shape) == 2 and not rht:
          data, scales = kernels.quantize_packed(x, s_dec, key, **dict(recipe, axis=axis % 2))
          decoded = kernels.dequantize_packed(*((data.T, scales.T) if axis % 2 == 0 else (data, scales)), 1.0,
                                              dtype=dtype)
          assert_same_bits(decoded, got.T if axis % 2 == 0 else got)
