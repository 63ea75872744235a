"""The number formats: NVFP4's E2M1 elements, E4M3 block scales and FP32 tensor scales, and the Format records of
NVFP4 and the OCP MX formats (numerics/mx.py).

Constants and the element-wise rounding rules of the recipe (docs/design.md §2, arXiv 2509.25149 §2). Everything is
computed in float32 with operations whose results are exact or correctly rounded, so the C++ kernels
(`xla_fp4/nvfp4_format.h`) reproduce them bit for bit.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

E2M1_MAX = 6.0
E4M3_MAX = 448.0
# s_dec = amax / (E2M1_MAX * E4M3_MAX): the largest block scale then lands exactly on E4M3's largest value.
GLOBAL_SCALE_DIVISOR = E2M1_MAX * E4M3_MAX
# ... computed as amax * INV_GLOBAL_SCALE_DIVISOR (what XLA makes of a division by a constant; kInvGlobalScaleDivisor).
INV_GLOBAL_SCALE_DIVISOR = np.float32(1.0) / np.float32(GLOBAL_SCALE_DIVISOR)
# Four Over Six (nvfp4.global_decode_scale): E4M3's range taken as 256, so that 1.5 times any block scale fits it.
INV_FOUR_OVER_SIX_DIVISOR = np.float32(1.0) / np.float32(E2M1_MAX * 256.0)
BLOCK = 16

# All non-negative E2M1 values, for tests and documentation.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def _e2m1_step(a):
  """Spacing of the E2M1 grid at magnitude a (0.5 below 2, 1 below 4, else 2)."""
  return jnp.where(a < 2.0, 0.5, jnp.where(a < 4.0, 1.0, 2.0)).astype(jnp.float32)


def _saturate(a):
  # `where` instead of `minimum` so that NaN stays NaN (as in the C++ kernels).
  return jnp.where(a > E2M1_MAX, jnp.float32(E2M1_MAX), a)


def flush_subnormal(v):
  """Float32 v with its subnormal values as zeros of their sign. The recipe never depends on a subnormal: XLA CPU
  flushes them (FTZ/DAZ) and a GPU does not, so the twins and kernels (nvfp4_format.h FlushSubnormal) flush the
  inputs, the tensor and block scales and the decoded values explicitly, and CPU and GPU agree (docs/design.md §2)."""
  v = jnp.asarray(v, jnp.float32)
  tiny = jnp.full(v.shape, np.finfo(np.float32).tiny, jnp.float32)
  return jax.lax.select(jax.lax.lt(jax.lax.abs(v), tiny), v * jnp.float32(0), v)  # lax: no private function


def round_e2m1_nearest(v):
  """Round float32 `v` to the E2M1 grid, nearest-even, saturating at ±6. NaN stays NaN; the sign of zero is kept."""
  a = _saturate(jnp.abs(v))
  step = _e2m1_step(a)
  return jnp.copysign(jnp.round(a / step) * step, v)  # jnp.round is round-half-to-even; a/step is exact.


def round_e2m1_stochastic(v, u):
  """Round float32 `v` up to its upper E2M1 neighbour with probability equal to its distance from the lower one.

  `u` holds uniform numbers in [0, 1). Unbiased: E[result] = v for |v| <= 6 (recipe: gradients, dgrad and wgrad).
  """
  a = _saturate(jnp.abs(v))
  step = _e2m1_step(a)
  lo = jnp.floor(a / step) * step
  frac = (a - lo) / step  # exact: lo <= a < lo + step <= 2 lo (Sterbenz), step a power of two
  return jnp.copysign(jnp.where(u < frac, lo + step, lo), v)


def round_e4m3(v):
  """Float32 -> E4M3 (round to nearest even), saturating at 448 (NaN stays NaN). Returns float8_e4m3fn."""
  v = jnp.where(v > E4M3_MAX, jnp.float32(E4M3_MAX), v)
  return v.astype(jnp.float8_e4m3fn)


# ---- counter-based random bits (same function in xla_fp4/nvfp4_format.h) ----

def mix32(x, xp=jnp):
  """A 32-bit integer finalizer with good avalanche (Wellons' lowbias32); `xp` is jax.numpy or numpy."""
  x = xp.asarray(x, xp.uint32)
  with np.errstate(over="ignore"):  # uint32 arithmetic wraps by design
    x = x ^ (x >> xp.uint32(16))
    x = x * xp.uint32(0x7FEB352D)
    x = x ^ (x >> xp.uint32(15))
    x = x * xp.uint32(0x846CA68B)
    return x ^ (x >> xp.uint32(16))


def fold_in(key, data, xp=jnp):
  """Derive a new uint32 key from `key` and `data` (both uint32)."""
  return mix32(xp.asarray(key, xp.uint32) ^ mix32(data, xp), xp)


def fold_in_int(key: int, data: int) -> int:
  """fold_in on Python ints, for keys fixed at compile time (the pass's per-site salts)."""
  def mix(x):
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)
  return mix((key & 0xFFFFFFFF) ^ mix(data & 0xFFFFFFFF))


def random_bits(key, shape, index=None):
  """uint32 random bits for each element of `shape`: mix32(index ^ mix32(key)), index = row-major position unless
  given (uint32, `shape`: an element's position in another layout). `key` is a scalar, or an array broadcastable to
  `shape` (one key per row: numerics/grouped.py)."""
  key = jnp.asarray(key, jnp.uint32)
  n = int(np.prod(shape, dtype=np.int64))
  if n > 2**32:
    raise ValueError(f"stochastic rounding supports tensors of at most 2**32 elements, got shape {shape}")
  if index is None:
    index = jax.lax.iota(jnp.uint32, n).reshape(shape) if n else jnp.zeros(shape, jnp.uint32)
  return mix32(index ^ mix32(key))


def uniform_from_bits(bits):
  """uint32 bits -> float32 uniform in [0, 1) with 24 bits of resolution (exact)."""
  return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def key_to_u32(key):
  """Accept a jax PRNG key (typed or raw uint32[2]) or an integer scalar; return a uint32 scalar."""
  if key is None:
    raise ValueError("rounding='stochastic' needs a key: pass key=jax.random.key(n) or an integer seed")
  if isinstance(key, (int, np.integer)):
    return jnp.uint32(int(key) & 0xFFFFFFFF)
  key = jnp.asarray(key) if not hasattr(key, "dtype") else key
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return jax.random.bits(key, (), jnp.uint32)
  if key.shape == (2,) and key.dtype == jnp.uint32:
    return jax.random.bits(jax.random.wrap_key_data(key), (), jnp.uint32)
  if key.shape == () and jnp.issubdtype(key.dtype, jnp.integer):
    return key.astype(jnp.uint32)
  raise TypeError(f"key must be a jax PRNG key or an integer scalar, got {key.dtype}{list(key.shape)}")


def canonical_axis(shape, axis, block=BLOCK):
  """Normalize `axis` and check that blocks of `block` fit along it; returns (axis, outer, K, inner)."""
  rank = len(shape)
  if not -rank <= axis < rank:
    raise ValueError(f"axis {axis} is out of range for a tensor of rank {rank}")
  axis %= rank
  k = shape[axis]
  if k % block:
    raise ValueError(f"{'NVFP4 quantizes' if block == BLOCK else 'The MX formats quantize'} blocks of {block} along "
                     f"the contraction axis, but axis {axis} of shape {tuple(shape)} has size {k}; pad it to a multiple "
                     f"of {block} or keep this tensor in high precision")
  outer = int(np.prod(shape[:axis], dtype=np.int64))
  inner = int(np.prod(shape[axis + 1:], dtype=np.int64))
  return axis, outer, k, inner


@dataclasses.dataclass(frozen=True)
class Format:
  """A block-scaled number format, and which parts of the NVFP4 recipe (arXiv 2509.25149 §4) it takes."""
  name: str
  element: str  # "e2m1" | "e4m3"
  elem_max: float
  block: int  # elements along the contraction that share a scale
  scale: str  # "e4m3" (NVFP4's, under a tensor scale) | "e8m0" (a power of two)
  tensor_scale: bool  # an FP32 scale per tensor (NVFP4's s_dec)
  rht: bool  # the wgrad operands may take the 16x16 random Hadamard transform
  stochastic: bool  # gradients may be rounded stochastically
  tiles_2d: bool  # weights may take block x block tiles, shared by a weight and its transpose
  bits: float  # per element, scales included (what a packed operand moves)


# NVFP4 (the recipe's); MXFP4 and MXFP8 as OCP MX v1.0 defines them. MXFP4 takes the recipe's parts as NVFP4 does (its
# E2M1 elements need them as much); MXFP8 follows Transformer Engine's MXFP8 recipe: nearest rounding, no RHT, 1x32
# blocks for weights too (its 8-bit elements lose little to either).
FORMATS = {
    "nvfp4": Format("nvfp4", "e2m1", E2M1_MAX, BLOCK, "e4m3", True, True, True, True, 4 + 8 / BLOCK),
    "mxfp4": Format("mxfp4", "e2m1", E2M1_MAX, 32, "e8m0", False, True, True, True, 4 + 8 / 32),
    "mxfp8": Format("mxfp8", "e4m3", E4M3_MAX, 32, "e8m0", False, False, False, False, 8 + 8 / 32),
}
