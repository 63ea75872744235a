"""NVFP4 quantization of one tensor along one axis: the pure-JAX reference of the recipe (docs/design.md §2).

A tensor of any rank is viewed as (outer, K, inner) around the quantization axis (no data movement). Blocks are 16
consecutive elements along K. With `block_2d=True` a block is a 16x16 tile: 16 along K times 16 consecutive positions of
the flattened trailing dims (inner), or of the flattened leading dims (outer) when the axis is the last one. Either way a
weight quantized along K and its transpose quantized along N share the same tiles (arXiv 2509.25149 §4.3: 2D weight
scaling keeps fprop and dgrad consistent). Scales are stored one per 1x16 row segment (a 2D tile repeats its scale), the
layout cuBLASLt's VEC16_UE4M3 mode reads.
"""

import dataclasses
import enum
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xla_fp4.numerics import formats
from xla_fp4.numerics.formats import BLOCK, canonical_axis
from xla_fp4.numerics.rht import rht_f32



class Rounding(enum.StrEnum):
  NEAREST = "nearest"  # round half to even
  STOCHASTIC = "stochastic"  # unbiased, from a key's random bits (gradients: arXiv 2509.25149 §4)


ROUNDINGS = tuple(Rounding)
_INV_E2M1_MAX = np.float32(1.0 / formats.E2M1_MAX)  # 0x1.555556p-3f, the same constant in nvfp4_format.h


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Tensor:
  """A quantized tensor: decoded value = values * scales (broadcast over each block) * global_scale."""
  values: Any  # float4_e2m1fn, the shape of the original tensor
  scales: Any  # float8_e4m3fn, the original shape with `axis` divided by 16
  global_scale: Any  # float32 scalar decode scale amax / (6 * 448)
  axis: int = dataclasses.field(metadata=dict(static=True))
  block_2d: bool = dataclasses.field(metadata=dict(static=True))


def _check_rounding(rounding):
  if rounding not in ROUNDINGS:
    raise ValueError(f"rounding must be one of {[str(r) for r in ROUNDINGS]}, got {rounding!r}")


def _check_float(x):
  if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
    raise TypeError(f"NVFP4 quantization takes float32, bfloat16 or float16 tensors, got {x.dtype}")


def _max(a, axis=None, keepdims=False):
  """jnp.max that always propagates NaN: XLA CPU's max reduction drops NaN in some layouts (measured on jax 0.10.2)."""
  m = jnp.max(a, axis=axis, keepdims=keepdims)
  return jnp.where(jnp.isnan(a).any(axis=axis, keepdims=keepdims), jnp.float32(jnp.nan), m)


def _tile_max(a, axis):
  """Max over groups of 16 consecutive positions along `axis` of `a`, broadcast back to every position."""
  n = a.shape[axis]
  a = jnp.moveaxis(a, axis, -1)
  pad = -n % BLOCK
  a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])  # |x| >= 0, so zero padding never raises a max
  g = a.reshape(a.shape[:-1] + (a.shape[-1] // BLOCK, BLOCK))
  g = jnp.broadcast_to(_max(g, axis=-1, keepdims=True), g.shape)
  return jnp.moveaxis(g.reshape(a.shape)[..., :n], -1, axis)


def global_decode_scale(amax, four_over_six=False):
  """s_dec = amax / (6 * 448), float32, computed as amax * f32(1 / 2688): XLA turns the division by a constant into
  that product anyway, and the kernels (kInvGlobalScaleDivisor) use the same form, so every path agrees bit for bit.
  With Four Over Six the E4M3 range is taken as 256 (amax / 1536), so that a block scaled to 4, 1.5 times its scale
  to 6, still fits E4M3 (arXiv 2512.02010; the authors' reference does the same)."""
  inverse = formats.INV_FOUR_OVER_SIX_DIVISOR if four_over_six else formats.INV_GLOBAL_SCALE_DIVISOR
  return formats.flush_subnormal(jnp.asarray(amax, jnp.float32) * inverse)  # a subnormal s_dec encodes zeros


def _element_bits(x):
  """x's element bits as uint32 (16-bit floats zero-extended)."""
  return jax.lax.bitcast_convert_type(x, jnp.uint32 if x.dtype.itemsize == 4 else jnp.uint16).astype(jnp.uint32)


def _per_block(v, axis, reduce):
  """reduce(.., axis=2) over every 1x16 block of v along `axis`: v's shape with the axis divided by 16."""
  axis, outer, k, inner = canonical_axis(v.shape, axis)
  blocks = reduce(v.reshape(outer, k // BLOCK, BLOCK, inner), axis=2)
  return blocks.reshape(v.shape[:axis] + (k // BLOCK,) + v.shape[axis + 1:])


def tensor_digest(x):
  """Wrapping uint32 sum of the bits of x's elements (16-bit floats zero-extended): cheap, order-free, different
  whenever x is; mixed into the stochastic-rounding key so that the rounding noise changes every step."""
  return jnp.sum(_element_bits(x), dtype=jnp.uint32)


def block_digest(x, *, axis=-1):
  """tensor_digest of every 1x16 block along `axis`: x's shape with the axis divided by 16, uint32. Wrapping sums
  are order-free, so their sum is x's digest, and a sharded tensor's shards digest their own blocks (the kernel
  xla_fp4_block_amax with digest)."""
  return _per_block(_element_bits(x), axis, functools.partial(jnp.sum, dtype=jnp.uint32))


def block_amax(x, *, axis=-1, rht_seed=None):
  """max |v| over every 1x16 block along `axis` as float32, NaN counted as +Inf; v = the block's RHT with `rht_seed`
  when one is given. The result has x's shape with the axis divided by 16, and its max is the tensor's amax. Blocks
  are local, so a sharded tensor's shards measure their own (the kernel xla_fp4_block_amax)."""
  v = formats.flush_subnormal(x.astype(jnp.float32))
  if rht_seed is not None:
    v = rht_f32(v, canonical_axis(x.shape, axis)[0], rht_seed)
  return _per_block(jnp.where(jnp.isnan(v), jnp.float32(jnp.inf), jnp.abs(v)), axis, jnp.max)


def amax(x):
  """max |x| over the whole tensor as float32 (NaN propagates)."""
  return _max(jnp.abs(x.astype(jnp.float32)))


def _encode(x32, axis, block_2d, rounding, key, s_dec, bits=None, four_over_six=False):
  """Core of the recipe on a float32 tensor. Returns (q, scales) with q float32 on the E2M1 grid shaped (outer, K/16,
  16, inner) and scales float8_e4m3fn shaped (outer, K/16, inner). `s_dec` is a scalar, or one per block
  (broadcastable to (outer, K/16, inner): the grouped recipe's per-group scales); `bits` (x32's shape) replaces the
  random bits drawn from `key` where the caller numbers elements otherwise (numerics/grouped.py). `four_over_six`:
  each block (16x16 tile with `block_2d`) takes the scale that maps its largest magnitude to 6 or the one that maps it
  to 4, whichever decodes it with the smaller sum of squared errors (`_four_over_six`)."""
  xb, _, wanted = block_scales(x32, axis, block_2d, s_dec)
  s_dec = jnp.asarray(s_dec, jnp.float32)
  uniform = None
  if rounding == "stochastic":
    def uniform():  # the same bits for every candidate scale
      drawn = formats.random_bits(key, x32.shape) if bits is None else bits
      return formats.uniform_from_bits(drawn.reshape(xb.shape))
  q, scales = _encode_with(xb, formats.round_e4m3(wanted), s_dec, uniform)
  if four_over_six:
    q4, scales4 = _encode_with(xb, formats.round_e4m3(wanted * jnp.float32(1.5)), s_dec, uniform)
    pick4 = _four_over_six(xb, (q, scales), (q4, scales4), s_dec, block_2d and xb.shape[3] > 1, block_2d)
    q = jnp.where(pick4[:, :, None, :], q4, q)
    scales = jnp.where(pick4, scales4, scales)
  return q, scales


def _encode_with(xb, scales, s_dec, uniform):
  """(q on the E2M1 grid, scales) of blocked xb with the given E4M3 block scales; `uniform()`: stochastic rounding's
  uniforms (None: nearest)."""
  denom = formats.flush_subnormal(scales.astype(jnp.float32) * s_dec)  # 1 / a subnormal overflows
  v = xb * (jnp.float32(1) / denom)[:, :, None, :]
  q = formats.round_e2m1_nearest(v) if uniform is None else formats.round_e2m1_stochastic(v, uniform())
  return jnp.where((denom == 0)[:, :, None, :], jnp.float32(0), q), scales  # a zero scale encodes zeros


def _tree_sum(v, axis):
  """Sum over `axis` (a power of two long) by halves, in a fixed order (the kernels sum alike): (0+8)+(4+12)..."""
  while v.shape[axis] > 1:
    half = v.shape[axis] // 2
    v = jax.lax.slice_in_dim(v, 0, half, axis=axis) + jax.lax.slice_in_dim(v, half, 2 * half, axis=axis)
  return jnp.squeeze(v, axis)


def _four_over_six(xb, six, four, s_dec, tiles_inner, block_2d):
  """bool (outer, K/16, inner): where the block's (tile's) scale to 4 decodes it with a smaller sum of squared errors
  than its scale to 6 (a tie keeps 6), the errors of the decoded values (q * scale) * s_dec against x, summed over the
  block's 16 elements, and over the tile's 16 blocks with `block_2d`, by halves."""
  s_dec = jnp.asarray(s_dec, jnp.float32)
  s_dec = s_dec[:, :, None, :] if s_dec.ndim == 3 else s_dec  # one per block (the grouped recipe's): per element

  def sse(q, scales):
    err = xb - _decode(q, scales, s_dec)
    per_block = _tree_sum(err * err, 2)  # (outer, K/16, inner)
    if not block_2d:
      return per_block
    axis = 2 if tiles_inner else 0
    n = per_block.shape[axis]
    moved = jnp.moveaxis(per_block, axis, -1)
    moved = jnp.pad(moved, [(0, 0)] * (moved.ndim - 1) + [(0, -n % BLOCK)])  # a partial tile's missing rows: no error
    tile = _tree_sum(moved.reshape(moved.shape[:-1] + (moved.shape[-1] // BLOCK, BLOCK)), moved.ndim)
    return jnp.moveaxis(jnp.repeat(tile, BLOCK, axis=-1)[..., :n], -1, axis)
  return sse(*four) < sse(*six)


def block_scales(x32, axis, block_2d, s_dec):
  """(x32 blocked as (outer, K/16, 16, inner), each block's amax (its 16x16 tile's with `block_2d`), the block scale
  before its E4M3 rounding: amax_b / 6 / s_dec), the last two shaped (outer, K/16, inner); `s_dec`: _encode."""
  axis, outer, k, inner = canonical_axis(x32.shape, axis)
  xb = formats.flush_subnormal(x32).reshape(outer, k // BLOCK, BLOCK, inner)
  block_amax = _max(jnp.abs(xb), axis=2)
  if block_2d:
    block_amax = _tile_max(block_amax, 2 if inner > 1 else 0)
  s_dec = formats.flush_subnormal(jnp.asarray(s_dec, jnp.float32))
  s_enc = jnp.where(s_dec == 0, jnp.float32(0), jnp.float32(1) / s_dec)
  return xb, block_amax, block_amax * (s_enc * _INV_E2M1_MAX)


def _times_scale(q, scales):
  """q * scale in float32 (exact: 2 x 4 significant bits), blocked shape."""
  return q * scales.astype(jnp.float32)[:, :, None, :]


def _decode(q, scales, s_dec):
  """(q * scale) * s_dec in float32: q*scale is exact, one rounding at the end."""
  return formats.flush_subnormal(_times_scale(q, scales) * jnp.asarray(s_dec, jnp.float32))


def unscaled_values(x32, axis, block_2d, rounding, key, s_dec, bits=None, four_over_six=False):
  """q * scale of float32 `x32` in its own shape, without the global decode scale: the operand of an emulated GEMM
  that folds both tensors' s_dec into its output (the kernels' apply_global_scale=false). `s_dec`, `bits`,
  `four_over_six`: _encode."""
  q, scales = _encode(x32, axis, block_2d, rounding, key, s_dec, bits, four_over_six)
  return _times_scale(q, scales).reshape(x32.shape)


def _scale_shape(shape, axis):
  return tuple(shape[:axis]) + (shape[axis] // BLOCK,) + tuple(shape[axis + 1:])


def _resolve(x, axis, rounding, key, global_scale):
  x = jnp.asarray(x)
  _check_float(x)
  _check_rounding(rounding)
  axis = canonical_axis(x.shape, axis)[0]
  x32 = x.astype(jnp.float32)
  s_dec = global_decode_scale(amax(x32)) if global_scale is None else jnp.asarray(global_scale, jnp.float32)
  key = formats.key_to_u32(key) if rounding == "stochastic" else None
  return x, x32, axis, s_dec, key


def quantize(x, *, axis=-1, block_2d=False, rounding="nearest", key=None, global_scale=None):
  """Quantize `x` to NVFP4 along `axis` (the GEMM contraction axis).

  Args:
    x: float32 / bfloat16 / float16 array of any rank; `x.shape[axis]` must be a multiple of 16.
    axis: the axis along which blocks of 16 share a scale.
    block_2d: 16x16 tiles share a scale (the recipe's weight scaling) instead of 1x16 segments.
    rounding: "nearest" (round half to even) or "stochastic" (unbiased; needs `key`).
    key: a jax PRNG key or integer seed for stochastic rounding.
    global_scale: the float32 decode scale to use; by default amax(x) / (6 * 448).
  Returns:
    An NVFP4Tensor.
  """
  x, x32, axis, s_dec, key = _resolve(x, axis, rounding, key, global_scale)
  q, scales = _encode(x32, axis, block_2d, rounding, key, s_dec)
  q = jnp.where(jnp.isnan(q), jnp.float32(0), q)  # E2M1 has no NaN: such blocks carry a NaN scale or global scale
  return NVFP4Tensor(values=q.reshape(x.shape).astype(jnp.float4_e2m1fn),
                     scales=scales.reshape(_scale_shape(x.shape, axis)),
                     global_scale=s_dec, axis=axis, block_2d=block_2d)


def dequantize(t: NVFP4Tensor, dtype=jnp.float32):
  """Decode an NVFP4Tensor to `dtype`."""
  shape = t.values.shape
  _, outer, k, inner = canonical_axis(shape, t.axis)
  q = t.values.astype(jnp.float32).reshape(outer, k // BLOCK, BLOCK, inner)
  scales = t.scales.reshape(outer, k // BLOCK, inner)
  return _decode(q, scales, t.global_scale).reshape(shape).astype(dtype)


def _qdq_value(x, axis, block_2d, rounding, key, global_scale):
  x, x32, axis, s_dec, key = _resolve(x, axis, rounding, key, global_scale)
  q, scales = _encode(x32, axis, block_2d, rounding, key, s_dec)
  return _decode(q, scales, s_dec).reshape(x.shape).astype(x.dtype)


@jax.custom_jvp
def straight_through(x, y):
  """Returns y; its derivative is the identity in x (the straight-through estimator for y = fake_quant(x))."""
  return y


@straight_through.defjvp
def _straight_through_jvp(primals, tangents):
  return primals[1], tangents[0]


def qdq(x, *, axis=-1, block_2d=False, rounding="nearest", key=None, global_scale=None):
  """Quantize then dequantize (fake quantization) in x's dtype; gradients pass straight through."""
  y = _qdq_value(jax.lax.stop_gradient(x), axis, block_2d, rounding,
                 None if key is None else jax.lax.stop_gradient(key), global_scale)
  return straight_through(x, y)
