"""The OCP MX formats beside NVFP4 (OCP Microscaling Formats v1.0): MXFP4 (E2M1 elements) and MXFP8 (E4M3 elements),
each block of 32 consecutive elements along the contraction axis with one E8M0 scale (a power of two, 2^-127 ..
2^127), and no tensor scale.

The block scale (docs/design.md §2): 2^s with s the smallest integer such that the block's amax <= elem_max * 2^s,
i.e. s = ceil(log2(amax / elem_max)), clamped to [-127, 127]. The scale is rounded up, as Transformer Engine's MXFP8
quantizer does, so that no element of the block saturates; OCP's example rule, floor(log2(amax)) - emax_elem, leaves
the block's largest magnitudes up to 8 / 6 (E2M1) or 512 / 448 (E4M3) times the largest element and clips them, and
the largest values of a block are the ones a GEMM feels most. The price is up to one binade of unused range.

An element is v / 2^s rounded to the element grid (E2M1: nearest-even or stochastic, as NVFP4's elements; E4M3:
nearest-even); dividing by a power of two is exact, and so is q * 2^s, so q·scale, the operand of the emulated GEMM,
is exact in float32 and the GEMM needs no alpha (1). A zero block has scale 2^-127 and zero elements; a block with a
NaN or an infinity has a NaN scale (E8M0's 0xFF), and decodes to NaN. 2D blocks (`block_2d`) are 32x32 tiles, the
largest magnitude of the tile deciding its one scale, so that a weight and its transpose share them (as NVFP4's 16x16).
"""

import jax
import jax.numpy as jnp
import numpy as np

from xla_fp4.numerics import formats

MX_BLOCK = 32
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127


def scale_exponent(amax, elem_max):
  """int32 s, the smallest integer with amax <= elem_max * 2^s, clamped to [-127, 127], from the bits of amax (>= 0,
  finite): its exponent less elem_max's, plus one where its mantissa exceeds elem_max's (6 = 1.5 * 2^2,
  448 = 1.75 * 2^8). A zero or subnormal amax gives -127: subnormals count as zero, as under XLA CPU's DAZ, on every
  platform alike (xla_fp4/nvfp4_format.h MxScaleExponent computes the same)."""
  bits = jax.lax.bitcast_convert_type(jnp.asarray(amax, jnp.float32), jnp.uint32) & jnp.uint32(0x7FFFFFFF)
  top = int(np.float32(elem_max).view(np.uint32))
  exponent = (bits >> 23).astype(jnp.int32)
  s = exponent - (top >> 23) + jnp.where((bits & 0x7FFFFF) > (top & 0x7FFFFF), 1, 0)
  return jnp.clip(jnp.where(exponent == 0, E8M0_MIN_EXP, s), E8M0_MIN_EXP, E8M0_MAX_EXP).astype(jnp.int32)


def pow2(s):
  """2^s as float32 for s in [-127, 127], from its bits (2^-127 is the subnormal 0x00400000)."""
  bits = jnp.where(s >= -126, (s + 127).astype(jnp.uint32) << 23, jnp.uint32(0x00400000))
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _blocked(x32, axis):
  """x32 as (outer, K/32, 32, inner), and (axis, outer, K, inner)."""
  axis, outer, k, inner = formats.canonical_axis(x32.shape, axis, block=MX_BLOCK)
  return x32.reshape(outer, k // MX_BLOCK, MX_BLOCK, inner), (axis, outer, k, inner)


def _block_amax(xb, block_2d):
  """Each block's max |x| (NaN and infinities as NaN), (outer, K/32, inner); with block_2d its 32x32 tile's."""
  a = jnp.abs(xb)
  a = jnp.where(jnp.isinf(a), jnp.float32(jnp.nan), a)
  amax = jnp.max(jnp.where(jnp.isnan(a), jnp.float32(jnp.inf), a), axis=2)
  amax = jnp.where(jnp.isinf(amax), jnp.float32(jnp.nan), amax)
  if block_2d:
    outer, nk, inner = amax.shape
    axis = 2 if inner > 1 else 0
    n = amax.shape[axis]
    moved = jnp.moveaxis(amax, axis, -1)
    pad = -n % MX_BLOCK  # a partial tile at the end: zero padding never raises a max
    padded = jnp.pad(moved, [(0, 0)] * (moved.ndim - 1) + [(0, pad)])
    g = padded.reshape(padded.shape[:-1] + (padded.shape[-1] // MX_BLOCK, MX_BLOCK))
    g = jnp.where(jnp.isnan(g), jnp.float32(jnp.inf), g).max(axis=-1, keepdims=True)
    g = jnp.where(jnp.isinf(g), jnp.float32(jnp.nan), g)
    tiles = jnp.broadcast_to(g, g.shape[:-1] + (MX_BLOCK,)).reshape(padded.shape)[..., :n]
    amax = jnp.moveaxis(tiles, -1, axis)
  return amax


def _round_elements(v, fmt, stochastic, bits):
  if fmt.element == "e4m3":
    return formats.round_e4m3(v).astype(jnp.float32)
  if stochastic:
    return formats.round_e2m1_stochastic(v, formats.uniform_from_bits(bits))
  return formats.round_e2m1_nearest(v)


def quantize(x32, axis, fmt, block_2d=False, stochastic=False, key=None, bits=None):
  """(q, s, nan) of float32 `x32` blocked as (outer, K/32, 32, inner): q the elements x / 2^s on the element grid,
  s each block's int32 scale exponent (outer, K/32, 1, inner), nan where a block (tile) holds a NaN or an Inf (its
  scale is E8M0's NaN). `fmt` a formats.Format of the MX kind; stochastic rounding (E2M1 only) draws
  formats.random_bits(key) in row-major order, or `bits`."""
  xb, _ = _blocked(formats.flush_subnormal(x32), axis)
  amax = _block_amax(xb, block_2d)
  s = scale_exponent(jnp.where(jnp.isnan(amax), jnp.float32(0), amax), fmt.elem_max)[:, :, None, :]
  nan = jnp.isnan(amax)[:, :, None, :]
  # x * 2^-s rather than x / 2^s: 2^-s is a normal float32 for every s a finite float32 amax gives (s <= 126), where
  # 2^s is subnormal at s = -127 (a zero block's), which XLA CPU flushes to zero.
  inverse = jnp.where(nan, jnp.float32(jnp.nan), pow2(-s))
  if stochastic and bits is None:
    bits = formats.random_bits(key, x32.shape)
  q = _round_elements(xb * inverse, fmt, stochastic, None if bits is None else bits.reshape(xb.shape))
  return q, s, nan


def unscaled_values(x32, axis, fmt, block_2d=False, stochastic=False, key=None, bits=None):
  """q * 2^s of float32 `x32` in its own shape (exact), the operand of the emulated GEMM (`quantize`'s arguments)."""
  q, s, nan = quantize(x32, axis, fmt, block_2d, stochastic, key, bits)
  # E8M0's one subnormal scale, 2^-127, decodes as zero (nvfp4_format.h MxDecodeScale), as does a subnormal value.
  scale = jnp.where(s >= -126, pow2(s), jnp.float32(0))
  return jnp.where(nan, jnp.float32(jnp.nan), formats.flush_subnormal(q * scale)).reshape(x32.shape)


def qdq(x, fmt, *, axis=-1, block_2d=False, rounding="nearest", key=None):
  """Quantize `x` to the MX format `fmt` ("mxfp4", "mxfp8" or a formats.Format) along `axis` and decode it, in x's
  dtype (no gradient rule: a reference, not a training op)."""
  fmt = formats.FORMATS[fmt] if isinstance(fmt, str) else fmt
  if fmt.tensor_scale:
    raise ValueError(f"{fmt.name} is not an MX format (it has a tensor scale): use xla_fp4.numerics.qdq")
  x = jnp.asarray(x)
  key = formats.key_to_u32(key) if rounding == "stochastic" else None
  return unscaled_values(x.astype(jnp.float32), axis, fmt, block_2d, rounding == "stochastic", key).astype(x.dtype)
