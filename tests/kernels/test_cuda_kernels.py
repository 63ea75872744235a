"""The CUDA kernels against the pure-JAX reference, bit for bit; the cuBLASLt FP4 GEMM against numerics.dot_general.

Needs the CUDA kernels built (`pip install .` builds them where nvcc >= 12.8 and cuBLASLt are found; docs/cuda.md)
and a CUDA device; the GEMM also needs
compute capability 10.x. Each test skips with the reason otherwise. References run on the CPU backend: they define the
numbers.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4_testing import assert_same_bits, extension_or_skip, mx_subnormal_cases, subnormal_cases
from xla_fp4 import kernels
from xla_fp4.kernels import registry
from xla_fp4 import numerics as nv
from xla_fp4.numerics import nvfp4 as qz
from xla_fp4.numerics.rht import rht_f32

# (shape, axis): 1D blocks along K with inner > 1, 2D tiles along inner (a partial last tile), along outer (axis last,
# a partial last tile), and a 3-D tensor.
SHAPES = [((64, 48), -1), ((48, 80), 0), ((40, 32), 1), ((3, 32, 20), 1)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# (dtype, block_2d, stochastic, rht, apply_global_scale): every recipe switch in float32, plus the unscaled output of
# the emulated GEMM; the 16-bit types only change loads and stores.
QDQ_CASES = ([(jnp.float32, *flags, True) for flags in itertools.product([False, True], repeat=3)] +
             [(jnp.float32, True, False, False, False)] +
             [(dtype, *flags) for dtype in DTYPES[1:] for flags in [(False,) * 3 + (True,), (True,) * 4]])
RHT_SEED = 1234


def _built_with_cuda():
  extension_or_skip()
  module, why = registry._load_cuda()
  if module is None:
    pytest.skip(why)
  return module


@pytest.fixture(scope="module")
def gpu():
  _built_with_cuda()
  try:
    devices = jax.devices("cuda")
  except (RuntimeError, ValueError) as e:
    pytest.skip(f"no CUDA device: {e}")
  kernels.register("cuda")
  return devices[0]


@pytest.fixture(scope="module")
def fp4_gemm(gpu):
  supported, reason = kernels.fp4_gemm_supported()
  if not supported and str(getattr(gpu, "compute_capability", "")).startswith("10."):
    # Blackwell must run the FP4 GEMM (an old libcublasLt found first, say): fail, never skip what the tests are for
    pytest.fail(f"compute capability {gpu.compute_capability} but no FP4 GEMM: {reason}")
  if not supported:
    pytest.skip(reason)
  return gpu


def _run(device, fn, *args, **static):
  """fn(*args, **static) compiled for and executed on `device`, as numpy."""
  args = [jax.device_put(a, device) for a in args]
  out = jax.jit(functools.partial(fn, **static))(*args)
  return jax.tree.map(np.asarray, out)


def _cpu():
  return jax.devices("cpu")[0]


def _data(shape, dtype, seed=0):
  """Normal values with a few outliers (so blocks get different scales), in `dtype`."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32)
  x *= np.where(rng.random(shape) < 0.02, 50.0, 1.0).astype(np.float32)
  return np.array(jnp.asarray(x, dtype))  # writable: tests plant special values


def _transformed(x, axis, rht):
  x32 = jnp.asarray(x, jnp.float32)
  return rht_f32(x32, axis, RHT_SEED) if rht else x32


def _s_dec(x, axis=-1, rht=False):
  """The global decode scale amax / (6 * 448) that the graph would pass: exactly numerics' without the RHT; after the
  RHT computed in float64 (kernel and reference take it as an input, so any positive value tests the same)."""
  x = np.asarray(x, np.float32)
  if rht:
    x = np.moveaxis(x, axis, -1).astype(np.float64)
    x = x.reshape(x.shape[:-1] + (-1, nv.BLOCK)) @ nv.hadamard_matrix(RHT_SEED)
  return np.float32(np.max(np.abs(x))) / np.float32(nv.GLOBAL_SCALE_DIVISOR)


def _qdq_reference(x, s_dec, key, *, axis, block_2d, stochastic, rht, apply_global_scale):
  """kernels.qdq's contract in numerics terms: qdq of (rht(x) if rht) with s_dec, kept in the RHT space."""
  rounding = "stochastic" if stochastic else "nearest"
  q, scales = qz._encode(_transformed(x, axis, rht), axis, block_2d, rounding, key, s_dec)
  y = qz._decode(q, scales, s_dec if apply_global_scale else jnp.float32(1))
  return y.reshape(x.shape).astype(x.dtype)


@pytest.mark.parametrize("dtype,block_2d,stochastic,rht,apply_global_scale", QDQ_CASES,
                         ids=lambda v: None if isinstance(v, bool) else jnp.dtype(v).name)
def test_qdq_matches_reference(gpu, dtype, block_2d, stochastic, rht, apply_global_scale):
  flags = dict(block_2d=block_2d, stochastic=stochastic, rht=rht, apply_global_scale=apply_global_scale)
  for (shape, axis), key in zip(SHAPES, [7, 0xFFFFFFFF, 12345, 3]):
    x = _data(shape, dtype)
    s_dec, key = _s_dec(x, axis, rht), np.uint32(key)
    got = _run(gpu, kernels.qdq, x, s_dec, key, axis=axis, rht_seed=RHT_SEED, **flags)
    want = _run(_cpu(), _qdq_reference, x, s_dec, key, axis=axis, **flags)
    assert_same_bits(got, want)


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_qdq_special_values(gpu, dtype, stochastic):
  """Zero blocks, NaN and Inf (which must stay visible), subnormal scales, a zero global scale."""
  x = _data((32, 64), dtype)
  x[0, :16] = 0
  x[1, 3] = np.nan
  x[2, 5] = np.inf
  x[3, :16] *= 1e-6
  flags = dict(axis=-1, block_2d=False, stochastic=stochastic, rht=False, apply_global_scale=True)
  for s_dec in [_s_dec(x[4:]), np.float32(0)]:
    got = _run(gpu, kernels.qdq, x, s_dec, np.uint32(5), rht_seed=0, **flags)
    want = _run(_cpu(), _qdq_reference, x, s_dec, np.uint32(5), **flags)
    assert_same_bits(got, want)
  assert np.isnan(got[1:3]).any(axis=1).all()


@pytest.mark.parametrize("block_2d,stochastic,rht", [(False, False, False), (True, False, False), (False, True, True),
                                                     (False, False, True)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_qdq_with_scale_matches_the_cpu_kernel(gpu, dtype, block_2d, stochastic, rht):
  """The measured amax (a grid-wide atomic max), the digest key and the values equal the CPU kernel's, which the CPU
  tests hold to the reference; one case with a NaN and an Inf, which must make s_dec Inf."""
  flags = dict(block_2d=block_2d, stochastic=stochastic, rht=rht, rht_seed=RHT_SEED)
  for i, (shape, axis) in enumerate(SHAPES):
    x = _data(shape, dtype, seed=i)
    if i == 0:
      x.reshape(-1)[[3, 77]] = [np.nan, np.inf]
    got = _run(gpu, kernels.qdq_with_scale, x, salt=99, axis=axis, **flags)
    want = _run(_cpu(), kernels.qdq_with_scale, x, salt=99, axis=axis, **flags)
    assert_same_bits(got[1], want[1])
    assert_same_bits(got[0], want[0])
    assert i or np.isinf(got[1])


MX_SHAPES = [((64, 64), -1), ((64, 96), 0), ((2, 64, 32), 1)]  # K a multiple of 32; 32x32 tiles need partners too


@pytest.mark.parametrize("fp8,block_2d,stochastic,rht", [(False, False, False, False), (False, True, False, False),
                                                         (False, False, True, True), (True, False, False, False),
                                                         (True, True, False, True)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_mx_qdq_matches_the_cpu_kernel(gpu, dtype, fp8, block_2d, stochastic, rht):
  """xla_fp4_mx_qdq (MXFP4 and MXFP8) on the device bit for bit the CPU kernel, which the CPU tests hold to
  numerics/mx.py; one case with a NaN block, which decodes to NaN."""
  flags = dict(fp8=fp8, block_2d=block_2d, stochastic=stochastic, rht=rht, rht_seed=RHT_SEED)
  for i, (shape, axis) in enumerate(MX_SHAPES):
    x = _data(shape, dtype, seed=i)
    if i == 0:
      x.reshape(-1)[5] = np.nan
    got = _run(gpu, kernels.mx_qdq, x, np.uint32(7), axis=axis, **flags)
    assert_same_bits(got, _run(_cpu(), kernels.mx_qdq, x, np.uint32(7), axis=axis, **flags))
    assert i or np.isnan(got.reshape(-1)[5])


def test_subnormal_rule_on_the_device(gpu):
  """The subnormal and NaN rule (nvfp4_format.h; tests/kernels/test_fp_mode_rule.py): tensors whose decode scale or
  block denominators are subnormal, subnormal inputs, and MX's 2^-127 scale give on the device the CPU kernels' bits
  (zeros, never NaN), and telemetry's amax and live blocks treat a NaN block alike."""
  for name, x in subnormal_cases().items():
    s_dec = np.float32(nv.global_decode_scale(np.abs(x).max()))
    got = _run(gpu, kernels.qdq, x, s_dec)
    assert_same_bits(got, _run(_cpu(), kernels.qdq, x, s_dec))
    assert np.isfinite(got).all(), name
  x = mx_subnormal_cases()
  for fp8 in (False, True):
    assert_same_bits(_run(gpu, kernels.mx_qdq, x, fp8=fp8), _run(_cpu(), kernels.mx_qdq, x, fp8=fp8))
  x = _data((4, 32), jnp.float32)
  x[1, 3], x[2, :16] = np.nan, 0.0
  got = _run(gpu, kernels.qdq_and_stats, x, np.float32(1 / 2688), np.uint32(5))[1]
  want = _run(_cpu(), kernels.qdq_and_stats, x, np.float32(1 / 2688), np.uint32(5))[1]
  assert np.isnan(got[0]) and np.isnan(want[0])
  counts = [1, 2, 3, 4, 5, 8, 9, 10]  # all but amax and the energies (summed in another order on the device)
  np.testing.assert_array_equal(got[counts], want[counts])


@pytest.mark.parametrize("block_2d,stochastic,rht", [(False, False, False), (True, False, False), (False, True, True)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_telemetry_kernels_match_the_cpu_kernels(gpu, dtype, block_2d, stochastic, rht):
  """xla_fp4_qdq_with_scale_stats, xla_fp4_qdq_and_stats, xla_fp4_quantize_packed_stats (matrices) and
  xla_fp4_output_stats on the device: the quantized values bit for bit, the counts exactly and the energies to float
  rounding (the device sums in another order) against the CPU kernels; zeros in an unrecorded step."""
  from xla_fp4.kernels import targets
  from xla_fp4.numerics import telemetry
  flags = dict(block_2d=block_2d, stochastic=stochastic, rht=rht, rht_seed=RHT_SEED)
  counts = [i for i, f in enumerate(telemetry.FIELDS) if f not in ("energy", "error_energy")]
  for i, (shape, axis) in enumerate(SHAPES):
    x = _data(shape, dtype, seed=i)
    for step in (3, -1):
      with_stats = lambda x: kernels._call(targets.QDQ_WITH_SCALE_STATS, [x, jnp.int32(step)], salt=7,  # noqa: E731
                                           axis=axis, four_over_six=False, **flags)
      got, want = _run(gpu, with_stats, x), _run(_cpu(), with_stats, x)
      assert_same_bits(got[0], want[0])
      assert_same_bits(got[1], want[1])
      zeros = lambda x: kernels.output_stats(x, step)  # noqa: E731
      both = lambda x, s: kernels.qdq_and_stats(x, s, 0x5EED, step=step, axis=axis, **flags)  # noqa: E731
      got_both, want_both = _run(gpu, both, x, want[1]), _run(_cpu(), both, x, want[1])
      assert_same_bits(got_both[0], want_both[0])
      pairs = [(got[2], want[2]), (_run(gpu, zeros, x), _run(_cpu(), zeros, x)), (got_both[1], want_both[1])]
      if x.ndim == 2 and shape[axis] % 16 == 0:  # the packed quantizer takes K's axis as 0 or 1
        packed = lambda x, s: kernels.quantize_packed_stats(x, s, 0x5EED, step=step, axis=axis % 2,  # noqa: E731
                                                            **flags)
        got_packed, want_packed = _run(gpu, packed, x, want[1]), _run(_cpu(), packed, x, want[1])
        assert_same_bits(got_packed[0], want_packed[0])
        assert_same_bits(got_packed[1], want_packed[1])
        pairs.append((got_packed[2], want_packed[2]))
      for a, b in pairs:
        np.testing.assert_array_equal(a[counts], b[counts])
        np.testing.assert_allclose(a, b, rtol=1e-5)
        assert step >= 0 or not a.any()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_rht_matches_reference(gpu, dtype):
  for shape, axis in SHAPES:
    x = _data(shape, dtype)
    got = _run(gpu, kernels.rht, x, axis=axis, seed=RHT_SEED)
    assert_same_bits(got, _run(_cpu(), rht_f32, jnp.asarray(x, jnp.float32), axis=axis, seed=RHT_SEED))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("rht", [False, True])
def test_block_amax_matches_reference(gpu, dtype, rht):
  for shape, axis in SHAPES:
    x = _data(shape, dtype)
    x.reshape(-1)[3] = np.nan  # counted as +Inf
    got = _run(gpu, kernels.block_amax, x, axis=axis, rht=rht, rht_seed=RHT_SEED)
    assert_same_bits(got, _run(_cpu(), nv.block_amax, x, axis=axis, rht_seed=RHT_SEED if rht else None))
    maxima, digests = _run(gpu, kernels.block_amax, x, axis=axis, rht=rht, rht_seed=RHT_SEED, digest=True)
    assert_same_bits(maxima, got)
    assert_same_bits(digests, _run(_cpu(), nv.block_digest, x, axis=axis))


def _packed_reference(x, s_dec, key, *, block_2d, stochastic, rht):
  t = nv.quantize(_transformed(x, -1, rht), axis=-1, block_2d=block_2d,
                  rounding="stochastic" if stochastic else "nearest", key=key, global_scale=s_dec)
  p = nv.pack(t)
  return p.data, jax.lax.bitcast_convert_type(p.scales, jnp.uint8)


@pytest.mark.parametrize("block_2d,stochastic,rht", list(itertools.product([False, True], repeat=3)))
def test_quantize_packed_matches_reference(gpu, block_2d, stochastic, rht):
  # 200 rows and 5 blocks per row: both kinds of scale padding, and a partial 2D tile.
  for dtype in DTYPES:
    x = _data((200, 80), dtype)
    s_dec, key = _s_dec(x, -1, rht), np.uint32(99)
    flags = dict(block_2d=block_2d, stochastic=stochastic, rht=rht)
    data, scales = _run(gpu, kernels.quantize_packed, x, s_dec, key, rht_seed=RHT_SEED, **flags)
    want_data, want_scales = _run(_cpu(), _packed_reference, x, s_dec, key, **flags)
    np.testing.assert_array_equal(data, want_data)
    np.testing.assert_array_equal(scales, want_scales)


@pytest.mark.parametrize("block_2d,stochastic,rht", list(itertools.product([False, True], repeat=3)))
def test_quantize_packed_along_axis_0_matches_the_cpu_kernel(gpu, block_2d, stochastic, rht):
  # x (K, rows) read in place: 80 = 5 blocks down K, 200 rows (a partial 2D tile); codes (K/2, rows), scales (K/16, rows)
  for dtype in DTYPES:
    x = _data((80, 200), dtype)
    s_dec, key = _s_dec(x, 0, rht), np.uint32(99)
    flags = dict(axis=0, block_2d=block_2d, stochastic=stochastic, rht=rht, rht_seed=RHT_SEED)
    data, scales = _run(gpu, kernels.quantize_packed, x, s_dec, key, **flags)
    want_data, want_scales = _run(_cpu(), kernels.quantize_packed, x, s_dec, key, **flags)
    np.testing.assert_array_equal(data, want_data)
    np.testing.assert_array_equal(scales, want_scales)


@pytest.mark.parametrize("row_stochastic,col_rht,four_over_six", [(False, True, False), (True, True, False),
                                                                    (True, False, True)])
def test_quantize_packed_pair_matches_the_cpu_kernel(gpu, row_stochastic, col_rht, four_over_six):
  # 48 rows (3 strips), 528 columns (two full 256-column tiles and a partial one), NaN and subnormals planted
  for dtype in DTYPES:
    x = _data((48, 528), dtype)
    x[5, 7], x[::3, ::5] = np.nan, 1e-39
    flags = dict(row_stochastic=row_stochastic, col_stochastic=True, col_rht=col_rht, rht_seed=RHT_SEED,
                 four_over_six=four_over_six)
    finite = np.nan_to_num(np.asarray(x, np.float32))
    args = (x, _s_dec(finite), _s_dec(finite, 0, col_rht), np.uint32(99), np.uint32(7))
    got = _run(gpu, kernels.quantize_packed_pair, *args, **flags)
    want = _run(_cpu(), kernels.quantize_packed_pair, *args, **flags)
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_dequantize_packed_matches_reference(gpu, dtype):
  x = _data((200, 80), jnp.float32)
  s_dec = _s_dec(x)
  data, scales = _run(_cpu(), _packed_reference, x, s_dec, np.uint32(0), block_2d=False, stochastic=False, rht=False)
  got = _run(gpu, kernels.dequantize_packed, data, scales, s_dec, dtype=dtype)
  packed = nv.PackedNVFP4(data=data, scales=jax.lax.bitcast_convert_type(scales, jnp.float8_e4m3fn),
                          global_scale=s_dec, shape=x.shape)
  want = _run(_cpu(), lambda p: nv.dequantize(nv.unpack(p), dtype), packed)
  assert_same_bits(got, want)


def test_qdq_rejects_a_bad_contract(gpu):
  x = np.ones((8, 24), np.float32)
  with pytest.raises(Exception, match="multiple of 16"):
    _run(gpu, kernels.qdq, x, np.float32(1), np.uint32(0), axis=-1)


def test_fp4_gemm_gate_gives_a_reason():
  supported, reason = kernels.fp4_gemm_supported()
  assert isinstance(supported, bool) and isinstance(reason, str) and (supported or reason), (supported, reason)


def _gemm_operands(m, n, k):
  a, b = _data((m, k), jnp.float32, seed=1), _data((n, k), jnp.float32, seed=2)
  sa, sb = _s_dec(a), _s_dec(b)
  flags = dict(block_2d=False, stochastic=False, rht=False)
  pa = _run(_cpu(), _packed_reference, a, sa, np.uint32(0), **flags)
  pb = _run(_cpu(), _packed_reference, b, sb, np.uint32(0), **flags)
  return a, b, pa, pb, np.float32(sa * sb)


# Shape classes: aligned; K/16 not a multiple of 4 (the 128x4 scale swizzle pads K: 96, 160); M and N not multiples of
# 16 or 128 (80 x 72: N a multiple of 8, the smallest output row cuBLASLt takes in bf16/f16; policy._output_rows).
@pytest.mark.parametrize("m,n,k", [(128, 128, 128), (256, 192, 512), (64, 320, 1024), (128, 128, 96), (80, 72, 160)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_fp4_gemm_matches_dot_general(fp4_gemm, m, n, k, dtype):
  a, b, (a_data, a_scales), (b_data, b_scales), alpha = _gemm_operands(m, n, k)
  got = _run(fp4_gemm, kernels.gemm_packed, a_data, a_scales, b_data, b_scales, alpha, dtype=dtype)
  dn = (((1,), (1,)), ((), ()))
  want = _run(_cpu(), nv.dot_general, a, b, dimension_numbers=dn, preferred_element_type=jnp.float32)
  # Only the float32 summation order may differ: bound it by K ulps of the sum of |products|, plus the output rounding.
  magnitude = _run(_cpu(), nv.dot_general, np.abs(a), np.abs(b), dimension_numbers=dn,
                   preferred_element_type=jnp.float32)
  rounding = {jnp.bfloat16: 2.0**-8, jnp.float16: 2.0**-11}.get(dtype, 0)  # the output's own rounding
  tolerance = k * 2.0**-23 * magnitude + np.abs(want) * rounding
  np.testing.assert_array_less(np.abs(got.astype(np.float32) - want), tolerance + 1e-30)


def test_fp4_gemm_reads_a_transposed_tiled_b_as_the_cpu_reference(fp4_gemm):
  """b_transposed (a dgrad reading its forward's packed weight): the CUDA GEMM re-pairs Bᵀ's 16x16 tiles K-major for
  cuBLASLt and equals the C++ reference, which decodes and transposes, up to the float32 summation order."""
  m, n, k = 64, 96, 128
  a, w = _data((m, k), jnp.float32, seed=1), _data((n, k), jnp.float32, seed=2)
  pa = _run(_cpu(), _packed_reference, a, _s_dec(a), np.uint32(0), block_2d=False, stochastic=False, rht=False)
  # Bᵀ (k, n) packed along n in 16x16 tiles
  pt = _run(_cpu(), _packed_reference, w.T, _s_dec(w), np.uint32(0), block_2d=True, stochastic=False, rht=False)
  args = (pa[0], pa[1], pt[0], pt[1], np.float32(0.75))
  got = _run(fp4_gemm, kernels.gemm_packed, *args, b_transposed=True)
  want = _run(_cpu(), kernels.gemm_packed, *args, b_transposed=True)
  assert got.shape == want.shape == (m, n)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=k * 2.0**-23 * np.abs(want).max())


# Routings that change every step (one compiled GEMM, new group shapes per call): the grouped GEMM's shape classes
# (M or K rounded up to a power of two, the class's algorithm checked per group, the exact shape where it fails).
ROUTINGS = {False: ([37, 0, 100, 41], [1, 129, 0, 70], [200, 0, 0, 0], [50, 50, 50, 49]),
            True: ([64, 0, 96, 32], [32, 32, 160, 32], [256, 0, 0, 0], [0, 128, 0, 64])}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("ragged_k", [False, True], ids=["groups_of_rows", "groups_of_k"])
def test_grouped_fp4_gemm_matches_the_cpu_reference(fp4_gemm, ragged_k, dtype):
  """xla_fp4_ragged_gemm_packed (cuBLASLt's FP4 GEMM once per group, the sizes read on the host) against the C++
  reference on the same packed operands, over routings that change from call to call: uneven groups of rows with
  rows after the last (a group's rows start anywhere: offset output pointers), or groups of K in multiples of 32,
  empty groups, one group holding everything; float32 summation order only."""
  m, n, k = (200, 96, 128) if not ragged_k else (64, 96, 256)
  a = _data((m, k), jnp.float32, seed=1)
  pa = _run(_cpu(), _packed_reference, a, _s_dec(a), np.uint32(0), block_2d=False, stochastic=False, rht=False)
  experts = 1 if ragged_k else 4
  pb = [_run(_cpu(), _packed_reference, b, _s_dec(b), np.uint32(0), block_2d=True, stochastic=False, rht=False)
        for b in (_data((n, k), jnp.float32, seed=2 + e) for e in range(experts))]
  b_data, b_scales = (pb[0][0], pb[0][1]) if ragged_k else (np.stack([p[0] for p in pb]), np.stack([p[1] for p in pb]))
  # (float16: smaller, so that the outliers' products stay below its 65504)
  alpha = (np.linspace(0.5, 2.0, 4) * (2.0**-8 if dtype == jnp.float16 else 1.0)).astype(np.float32)
  for routing in ROUTINGS[ragged_k]:
    sizes = np.asarray(routing, np.int32)
    args = (pa[0], pa[1], b_data, b_scales, sizes, alpha)
    got = _run(fp4_gemm, kernels.ragged_gemm_packed, *args, ragged_k=ragged_k, dtype=dtype).astype(np.float32)
    want = _run(_cpu(), kernels.ragged_gemm_packed, *args, ragged_k=ragged_k, dtype=dtype).astype(np.float32)
    magnitude = np.abs(want).max()
    assert np.isfinite(magnitude)
    # float32 summation order, then (16-bit outputs) one output rounding apart at most
    rtol = {jnp.bfloat16: 2.0**-7, jnp.float16: 2.0**-10}.get(dtype, 1e-5)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=k * 2.0**-23 * magnitude + 1e-30, err_msg=str(routing))
    empty = [g for g, size in enumerate(routing) if size == 0] if ragged_k else slice(int(sizes.sum()), None)
    assert not got[empty].any(), routing


# Rows and K/16 on and off the 128x4 swizzle tiles; stride > 0: scales that are columns of a wider matrix (a group's
# range of K in the grouped wgrad).
@pytest.mark.parametrize("rows,k,stride", [(128, 64, 0), (256, 128, 0), (200, 96, 0), (37, 160, 0), (130, 64, 12)])
def test_scale_swizzle_matches_numerics(gpu, rows, k, stride):
  """SwizzleScales, which every FP4 GEMM call runs on its scales, bit for bit numerics.packing.swizzle_scales on any
  CUDA device (Hopper too: no cuBLASLt involved), the padding zero."""
  from xla_fp4.numerics import packing
  cuda = registry._load_cuda()[0]
  cols = k // nv.BLOCK
  wide = np.random.default_rng(rows + k).integers(1, 256, (rows, stride or cols), dtype=np.uint8)
  want = np.asarray(packing.swizzle_scales(jnp.asarray(wide[:, :cols])))
  got = np.full(want.size, 0xAB, np.uint8)  # the kernel must write every byte, padding included
  cuda.swizzle_scales(wide.reshape(-1), rows, k, stride, got)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("k,n", [(128, 64), (96, 160), (32, 16)])
def test_tile_transpose_matches_numerics(gpu, k, n):
  """TransposeTiles (a dgrad's GEMM reading its forward's packed weight: Bᵀ's 16x16 tiles re-paired K-major) bit for
  bit the packing of B itself: with 16x16 tiles, B and Bᵀ quantize to the same values and scales."""
  cuda = registry._load_cuda()[0]
  w = _data((n, k), jnp.float32, seed=3)
  s_dec = _s_dec(w)
  flags = dict(block_2d=True, stochastic=False, rht=False)
  t_data, t_scales = _run(_cpu(), _packed_reference, w.T.copy(), s_dec, np.uint32(0), **flags)
  want_data, want_scales = _run(_cpu(), _packed_reference, w, s_dec, np.uint32(0), **flags)
  got_data = np.full(n * (k // 2), 0xAB, np.uint8)
  got_scales = np.full(n * (k // nv.BLOCK), 0xAB, np.uint8)
  cuda.transpose_tiles(np.ascontiguousarray(t_data).reshape(-1), np.ascontiguousarray(t_scales).reshape(-1), k, n,
                       got_data, got_scales)
  np.testing.assert_array_equal(got_data.reshape(n, k // 2), want_data)
  np.testing.assert_array_equal(got_scales.reshape(n, k // nv.BLOCK), want_scales)


def test_fp4_gemm_fails_loudly_where_unsupported(gpu):
  if kernels.fp4_gemm_supported()[0]:
    pytest.skip("the FP4 GEMM is supported on this device")
  _, _, (a_data, a_scales), (b_data, b_scales), alpha = _gemm_operands(128, 128, 128)
  with pytest.raises(Exception, match="cuBLASLt|cublasLt"):
    _run(gpu, kernels.gemm_packed, a_data, a_scales, b_data, b_scales, alpha)


# ---- the packed MX formats ----

@pytest.mark.parametrize("fp8,block_2d,stochastic,rht", [(False, False, False, False), (False, True, False, False),
                                                         (False, False, True, True), (True, False, False, False),
                                                         (True, False, False, True)])
@pytest.mark.parametrize("axis", [1, 0])
def test_mx_quantize_packed_matches_the_cpu_kernel(gpu, axis, fp8, block_2d, stochastic, rht):
  """xla_fp4_mx_quantize_packed on the device: the CPU kernel's codes and E8M0 bytes (which the CPU tests hold to
  numerics.packing.pack_mx) byte for byte, along either axis, a NaN block's scale 0xFF; the dequantizer likewise."""
  flags = dict(fp8=fp8, block_2d=block_2d, stochastic=stochastic, rht=rht, rht_seed=RHT_SEED, axis=axis)
  for dtype in DTYPES:
    x = _data((96, 64) if axis == 1 else (64, 96), dtype, seed=4)
    x.reshape(-1)[7] = np.nan
    got = _run(gpu, kernels.mx_quantize_packed, x, np.uint32(11), **flags)
    want = _run(_cpu(), kernels.mx_quantize_packed, x, np.uint32(11), **flags)
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, w)
    data, scales = (want[0].T, want[1].T) if axis == 0 else want
    for out in DTYPES:
      assert_same_bits(_run(gpu, kernels.mx_dequantize_packed, data, scales, fp8=fp8, dtype=out),
                       _run(_cpu(), kernels.mx_dequantize_packed, data, scales, fp8=fp8, dtype=out))


@pytest.mark.parametrize("m,n,k", [(128, 128, 128), (80, 72, 160), (64, 320, 1024)])
@pytest.mark.parametrize("fp8", [False, True], ids=["mxfp4", "mxfp8"])
def test_mx_gemm_matches_the_cpu_reference(fp4_gemm, m, n, k, fp8):
  """xla_fp4_mx_gemm_packed through cuBLASLt's VEC32_UE8M0 block-scaled GEMM (E2M1 or E4M3 operands, scales per 32
  swizzled in the 128x4 layout) against the C++ reference on the same packed operands, three output dtypes, and a
  weight's 32x32-tiled copy read along its other axis (b_transposed, MXFP4); float32 summation order only."""
  a, b = _data((m, k), jnp.float32, seed=1), _data((n, k), jnp.float32, seed=2)
  pa = _run(_cpu(), kernels.mx_quantize_packed, a, np.uint32(0), fp8=fp8)
  pb = _run(_cpu(), kernels.mx_quantize_packed, b, np.uint32(0), fp8=fp8, block_2d=not fp8)
  for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    got = _run(fp4_gemm, kernels.mx_gemm_packed, *pa, *pb, fp8=fp8, dtype=dtype).astype(np.float32)
    want = _run(_cpu(), kernels.mx_gemm_packed, *pa, *pb, fp8=fp8, dtype=dtype).astype(np.float32)
    rtol = {jnp.bfloat16: 2.0**-7, jnp.float16: 2.0**-10}.get(dtype, 1e-5)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=k * 2.0**-23 * np.abs(want).max() + 1e-30)
  if not fp8 and n % 32 == 0:
    t = _run(_cpu(), kernels.mx_quantize_packed, np.ascontiguousarray(b.T), np.uint32(0), block_2d=True)  # (K, N/2)
    got = _run(fp4_gemm, kernels.mx_gemm_packed, *pa, *t, b_transposed=True)
    want = _run(_cpu(), kernels.mx_gemm_packed, *pa, *t, b_transposed=True)
    assert got.shape == (m, n)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=k * 2.0**-23 * np.abs(want).max())


@pytest.mark.parametrize("rows,k", [(128, 128), (200, 96), (37, 320)])
def test_mx_scale_swizzle_matches_numerics(gpu, rows, k):
  """SwizzleScales with blocks of 32 (the MX GEMM's E8M0 scales): numerics.packing.swizzle_scales of (rows, K/32)."""
  from xla_fp4.numerics import packing
  cuda = registry._load_cuda()[0]
  scales = np.random.default_rng(rows + k).integers(1, 256, (rows, k // 32), dtype=np.uint8)
  want = np.asarray(packing.swizzle_scales(jnp.asarray(scales)))
  got = np.full(want.size, 0xAB, np.uint8)
  cuda.swizzle_scales(scales.reshape(-1), rows, k, 0, got, block=32)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fp8", [False, True], ids=["e2m1", "e4m3"])
def test_mx_tile_transpose_matches_the_packing_of_b(gpu, fp8):
  """TransposeTiles with 32x32 tiles (and one E4M3 code a byte): B's packed codes and scales from Bᵀ's, bit for bit the
  packing of B itself (in 32x32 tiles B and Bᵀ quantize alike)."""
  cuda = registry._load_cuda()[0]
  k, n = 128, 96
  w = _data((n, k), jnp.float32, seed=3)
  per = 1 if fp8 else 2
  t_data, t_scales = _run(_cpu(), kernels.mx_quantize_packed, w.T.copy(), np.uint32(0), fp8=fp8, block_2d=True)
  want_data, want_scales = _run(_cpu(), kernels.mx_quantize_packed, w, np.uint32(0), fp8=fp8, block_2d=True)
  got_data = np.full(n * (k // per), 0xAB, np.uint8)
  got_scales = np.full(n * (k // 32), 0xAB, np.uint8)
  cuda.transpose_tiles(np.ascontiguousarray(t_data).reshape(-1), np.ascontiguousarray(t_scales).reshape(-1), k, n,
                       got_data, got_scales, per_byte=per, block=32)
  np.testing.assert_array_equal(got_data.reshape(n, k // per), want_data)
  np.testing.assert_array_equal(got_scales.reshape(n, k // 32), want_scales)


@pytest.mark.parametrize("block_2d,stochastic,rht", [(False, False, False), (True, False, False), (False, True, True),
                                                     (True, True, False)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_four_over_six_on_the_device_matches_the_cpu_kernels(gpu, dtype, block_2d, stochastic, rht):
  """Four Over Six in the CUDA quantizers (a 16x16 tile's error sums over its half-warp by shuffles, in the twin's
  order): xla_fp4_qdq_with_scale, xla_fp4_qdq and xla_fp4_quantize_packed bit for bit the CPU kernels, which the CPU
  tests hold to the twins; on data where some blocks choose 4 and others 6."""
  rng = np.random.default_rng(9)
  n = 64 * 96
  near_max = np.sign(rng.standard_normal(n)) * rng.uniform(0.7, 1.0, n)
  x = np.array(jnp.asarray(np.where(np.arange(n) < n // 2, near_max, rng.standard_normal(n)).reshape(64, 96), dtype))
  flags = dict(block_2d=block_2d, stochastic=stochastic, rht=rht, rht_seed=RHT_SEED, four_over_six=True)
  for axis in (-1, 0):
    got = _run(gpu, kernels.qdq_with_scale, x, np.uint32(5), axis=axis, **flags)
    want = _run(_cpu(), kernels.qdq_with_scale, x, np.uint32(5), axis=axis, **flags)
    for g, w in zip(got, want):
      assert_same_bits(g, w)
    s_dec = want[1]
    assert_same_bits(_run(gpu, kernels.qdq, x, s_dec, np.uint32(5), axis=axis, apply_global_scale=False, **flags),
                     _run(_cpu(), kernels.qdq, x, s_dec, np.uint32(5), axis=axis, apply_global_scale=False, **flags))
    packed = [_run(d, kernels.quantize_packed, x, s_dec, np.uint32(5), axis=axis % 2, **flags) for d in (gpu, _cpu())]
    for g, w in zip(*packed):
      np.testing.assert_array_equal(g, w)
