"""The 16x16 random Hadamard transform applied to weight-gradient GEMM inputs (arXiv 2509.25149 §4.2).

Each group of 16 consecutive elements v along the contraction axis becomes Mᵀv with M = H16·diag(s)/4, that is
y = diag(s)·(H16·v)/4: H16 the Sylvester Hadamard matrix, s a ±1 sign vector drawn from `seed`. M is orthogonal, so
transforming both operands of a GEMM along their contraction axis leaves the product unchanged in exact arithmetic while
spreading outliers over 16 elements. H16·v is computed with a fixed butterfly (4 stages of add/subtract), the same
order as the C++ kernels, so results agree bit for bit.
"""

import jax.numpy as jnp
import numpy as np

from xla_fp4.numerics import formats
from xla_fp4.numerics.formats import BLOCK, canonical_axis


def rht_signs(seed):
  """The ±1 float32 sign vector s for `seed`: bit 31 of mix32(j ^ mix32(seed)) for j = 0..15."""
  bits = formats.mix32(np.arange(BLOCK, dtype=np.uint32) ^ formats.mix32(np.array([seed], np.uint32), np), np)
  return np.where(bits >> 31, np.float32(-1), np.float32(1)).astype(np.float32)


def hadamard_matrix(seed):
  """The 16x16 matrix M = H16·diag(s)/4 (for tests and documentation)."""
  h = np.array([[1.0]], np.float32)
  while h.shape[0] < BLOCK:
    h = np.block([[h, h], [h, -h]])
  return h * rht_signs(seed)[None, :] / 4


def rht_f32(x32, axis, seed):
  """Float32 in (subnormals read as zeros, formats.flush_subnormal), float32 out."""
  axis, outer, k, inner = canonical_axis(x32.shape, axis)
  v = formats.flush_subnormal(x32).reshape(outer, k // BLOCK, BLOCK, inner)
  half = 1
  while half < BLOCK:  # butterfly stage: pairs (i, i + half) within groups of 2*half
    g = v.reshape(outer, k // BLOCK, BLOCK // (2 * half), 2, half, inner)
    a, b = g[:, :, :, 0], g[:, :, :, 1]
    v = jnp.stack([a + b, a - b], axis=3).reshape(outer, k // BLOCK, BLOCK, inner)
    half *= 2
  scale = jnp.asarray(rht_signs(seed) * np.float32(0.25))  # exact: ±1/4
  return (v * scale[None, None, :, None]).reshape(x32.shape)


def random_hadamard_transform(x, *, axis=-1, seed=0):
  """Apply the RHT along `axis` (size a multiple of 16). Computed in float32, returned in x's dtype."""
  x = jnp.asarray(x)
  return rht_f32(x.astype(jnp.float32), axis, seed).astype(x.dtype)
