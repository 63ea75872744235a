"""Packed storage: NVFP4's two E2M1 codes per byte and one E4M3 scale per row and 16-element block of K; the MX
formats' (`pack_mx`) codes, E2M1 pairs (MXFP4) or E4M3 bytes (MXFP8), and one E8M0 scale per 32.

Rows are the non-contraction dim of a GEMM operand (M for A, N for B) and K is contiguous ("TN": both operands K-major).
Element k of a row sits in byte k // 2, the even element in the low nibble. The scales are a (rows, K/16) matrix, row
major: the same dims as the data, so a shard of rows or of whole blocks along K is the packed form of its shard of the
tensor (sharding/packed.py). cuBLASLt's FP4 GEMM reads them swizzled, which its handler does in scratch memory
(`swizzle_scales` specifies it): the scale of (row r, block c) sits at
  ((r // 128) * (C' / 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
with C' = K/16 rounded up to 4 and rows padded to 128 (cuBLAS docs, "1D block scaling factors layout"); padding is zero.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xla_fp4.numerics import formats, mx
from xla_fp4.numerics import nvfp4 as qz
from xla_fp4.numerics.formats import BLOCK, E2M1_VALUES

TILE_ROWS, TILE_COLS = 128, 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedNVFP4:
  data: Any  # uint8 (rows, K / 2)
  scales: Any  # float8_e4m3fn (rows, K / 16)
  global_scale: Any  # float32 scalar
  shape: tuple = dataclasses.field(metadata=dict(static=True))  # the logical shape; K is the last dim


def padded_scale_shape(rows, k, block=BLOCK):
  cols = k // block
  return -(-rows // TILE_ROWS) * TILE_ROWS, -(-cols // TILE_COLS) * TILE_COLS


def e2m1_codes(values):
  """float4_e2m1fn -> uint8 4-bit codes (sign bit 3, magnitude index 0..7 in bits 0..2)."""
  a = jnp.abs(values.astype(jnp.float32))
  index = jnp.where(a < 2, a * 2, jnp.where(a < 4, a + 2, a / 2 + 4)).astype(jnp.uint8)
  return index | (jnp.signbit(values.astype(jnp.float32)).astype(jnp.uint8) << 3)


def e2m1_from_codes(codes):
  magnitude = jnp.asarray(E2M1_VALUES)[(codes & 7).astype(jnp.int32)]
  return jnp.where(codes & 8, -magnitude, magnitude).astype(jnp.float4_e2m1fn)


def swizzle_scales(scales2d):
  """(rows, K/block) scales -> flat cuBLASLt tile layout (the same for NVFP4's blocks of 16 and MX's of 32)."""
  rows, cols = scales2d.shape
  rp, cp = padded_scale_shape(rows, cols * BLOCK)
  s = jnp.zeros((rp, cp), scales2d.dtype).at[:rows, :cols].set(scales2d)
  s = s.reshape(rp // 128, 4, 32, cp // 4, 4).transpose(0, 3, 2, 1, 4)
  return s.reshape(-1)


def unswizzle_scales(flat, rows, k):
  rp, cp = padded_scale_shape(rows, k)
  s = flat.reshape(rp // 128, cp // 4, 32, 4, 4).transpose(0, 3, 2, 1, 4).reshape(rp, cp)
  return s[:rows, :k // BLOCK]


def pack(t: qz.NVFP4Tensor) -> PackedNVFP4:
  """Pack an NVFP4Tensor quantized along its last axis (leading dims are flattened into rows)."""
  shape = t.values.shape
  if t.axis != len(shape) - 1:
    raise ValueError(f"pack needs K (the quantization axis) last so that K is contiguous, but axis is {t.axis} of "
                     f"shape {shape}; quantize the transposed tensor instead")
  k = shape[-1]
  rows = int(np.prod(shape[:-1], dtype=np.int64))
  codes = e2m1_codes(t.values).reshape(rows, k // 2, 2)
  data = codes[..., 0] | (codes[..., 1] << 4)
  return PackedNVFP4(data=data, scales=t.scales.reshape(rows, k // BLOCK),
                     global_scale=t.global_scale, shape=tuple(shape))


def unpack(p: PackedNVFP4, block_2d=False) -> qz.NVFP4Tensor:
  shape = p.shape
  k = shape[-1]
  codes = jnp.stack([p.data & 15, p.data >> 4], axis=-1).reshape(shape)
  return qz.NVFP4Tensor(values=e2m1_from_codes(codes),
                        scales=p.scales.reshape(shape[:-1] + (k // BLOCK,)),
                        global_scale=p.global_scale, axis=len(shape) - 1, block_2d=block_2d)


def pack_mx(x, fmt, *, block_2d=False, rounding="nearest", key=None):
  """x (rows, K) quantized along K in the MX format `fmt` ("mxfp4" / "mxfp8") -> (codes, scales) as the packed MX
  kernels store them: codes uint8 (rows, K/2) E2M1 pairs (the even element in the low nibble) or (rows, K) E4M3
  bytes; scales uint8 (rows, K/32), E8M0: the exponent s stored as s + 127, 0xFF for a block with a NaN or an Inf.
  From numerics/mx.py's quantize (the reference), not from the kernels."""
  fmt = formats.FORMATS[fmt] if isinstance(fmt, str) else fmt
  x32 = jnp.asarray(x).astype(jnp.float32)
  rows, k = x32.shape
  stochastic = rounding == "stochastic"
  q, s, nan = mx.quantize(x32, -1, fmt, block_2d, stochastic, formats.key_to_u32(key) if stochastic else None)
  scales = jnp.where(nan, jnp.uint8(0xFF), (s + 127).astype(jnp.uint8)).reshape(rows, k // mx.MX_BLOCK)
  q = jnp.where(nan, jnp.float32(0), q).reshape(rows, k)  # a NaN block's codes are not read (its scale is NaN)
  if fmt.element == "e4m3":
    return jax.lax.bitcast_convert_type(q.astype(jnp.float8_e4m3fn), jnp.uint8), scales
  codes = e2m1_codes(q).reshape(rows, k // 2, 2)
  return codes[..., 0] | (codes[..., 1] << 4), scales


def unpack_mx(codes, scales, fmt):
  """The float32 values q * 2^s of pack_mx's (codes, scales): 2^-127 decodes as zero, 0xFF as NaN."""
  fmt = formats.FORMATS[fmt] if isinstance(fmt, str) else fmt
  rows = codes.shape[0]
  if fmt.element == "e4m3":
    q = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float32)
  else:
    q = e2m1_from_codes(jnp.stack([codes & 15, codes >> 4], axis=-1).reshape(rows, -1)).astype(jnp.float32)
  s = scales.astype(jnp.int32) - 127
  scale = jnp.where(s >= -126, mx.pow2(s), jnp.float32(0))
  scale = jnp.where(scales == 0xFF, jnp.float32(jnp.nan), scale)
  return (q.reshape(rows, -1, 32) * scale[:, :, None]).reshape(q.shape)
