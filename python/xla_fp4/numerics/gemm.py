"""Emulated NVFP4 GEMM: C = (Σ_k (q_a·scale_a)(q_b·scale_b)) · s_dec_a · s_dec_b, float32 accumulation.

q·scale is exact in float32, so the only roundings are the float32 accumulation and the final alpha multiply, as in
cuBLASLt's FP4 GEMM with alpha = s_dec_a·s_dec_b (docs/design.md §2: never fold s_dec into the operands).
"""

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np

from xla_fp4.numerics import formats, mx, nvfp4 as qz
from xla_fp4.numerics.nvfp4 import Rounding
from xla_fp4.numerics.rht import rht_f32


@dataclasses.dataclass(frozen=True, kw_only=True)
class OperandRecipe:
  """How one GEMM operand is quantized (docs/design.md §2 table)."""
  block_2d: bool = False
  rounding: Rounding = Rounding.NEAREST
  rht: bool = False
  format: str = "nvfp4"  # noqa: A003 (formats.FORMATS: nvfp4, mxfp4, mxfp8)
  four_over_six: bool = False  # NVFP4 only: each block's scale to 4 or to 6 (arXiv 2512.02010; nvfp4._encode)

  @property
  def stochastic(self):
    return self.rounding == Rounding.STOCHASTIC


def _canonical(x, batch, contract):
  """Transpose to (batch..., free..., contract...) and merge the contraction dims into one trailing axis."""
  free = [d for d in range(x.ndim) if d not in batch and d not in contract]
  y = jnp.transpose(x, list(batch) + free + list(contract))
  k = int(np.prod([x.shape[d] for d in contract], dtype=np.int64))
  return y.reshape(y.shape[:len(batch) + len(free)] + (k,))


def _canonical_dimension_numbers(num_batch, a, b):
  batch = tuple(range(num_batch))
  return ((a.ndim - 1,), (b.ndim - 1,)), (batch, batch)


def _scaled_operand(x, recipe, key, rht_seed):
  """Canonical operand -> (q·scale in float32, s_dec); an MX format's s_dec is 1 (numerics/mx.py)."""
  x32 = x.astype(jnp.float32)
  if recipe.rht:
    x32 = rht_f32(x32, -1, rht_seed)
  if recipe.format != "nvfp4":
    fmt = formats.FORMATS[recipe.format]
    return mx.unscaled_values(x32, -1, fmt, recipe.block_2d, recipe.stochastic, key), jnp.float32(1)
  s_dec = qz.global_decode_scale(qz.amax(x32), recipe.four_over_six)
  return qz.unscaled_values(x32, -1, recipe.block_2d, recipe.rounding, key, s_dec,
                            four_over_six=recipe.four_over_six), s_dec


def _emulated(a, b, dimension_numbers, a_recipe, b_recipe, rht_seed, out_dtype, key):
  (ca, cb), (ba, bb) = dimension_numbers
  a_c, b_c = _canonical(a, ba, ca), _canonical(b, bb, cb)
  ka = formats.fold_in(key, 1) if key is not None else None
  kb = formats.fold_in(key, 2) if key is not None else None
  qa, sa = _scaled_operand(a_c, a_recipe, ka, rht_seed)
  qb, sb = _scaled_operand(b_c, b_recipe, kb, rht_seed)
  acc = jax.lax.dot_general(qa, qb, _canonical_dimension_numbers(len(ba), qa, qb),
                            precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  return (acc * (sa * sb)).astype(out_dtype)


def dot_general(a, b, dimension_numbers, *, a_recipe=OperandRecipe(), b_recipe=OperandRecipe(), key=None,
                rht_seed=0, preferred_element_type=None):
  """`jax.lax.dot_general` with both operands in NVFP4 (or the format their recipes name), emulated exactly.

  The contraction (all contracting dims together) must be a multiple of 16 (32 for the MX formats). With RHT on an operand, both operands
  should use it (the transforms cancel only in pairs). Gradients are straight-through: d/da uses the quantized b and
  vice versa, as the forward does. `key` (PRNG key or integer) is required when an operand rounds stochastically.
  """
  a, b = jnp.asarray(a), jnp.asarray(b)
  (ca, cb), (ba, bb) = dimension_numbers
  ka_size = int(np.prod([a.shape[d] for d in ca], dtype=np.int64))
  block = max(formats.FORMATS[r.format].block for r in (a_recipe, b_recipe))
  if ka_size % block:
    raise ValueError(f"these GEMMs need a contraction size that is a multiple of {block}; got {ka_size} "
                     f"(lhs shape {a.shape}, contracting dims {tuple(ca)}). Keep this GEMM in high precision.")
  for r in (a_recipe, b_recipe):
    qz._check_rounding(r.rounding)
  stochastic = a_recipe.stochastic or b_recipe.stochastic
  key = formats.key_to_u32(key) if stochastic else None
  out_dtype = preferred_element_type or jnp.result_type(a.dtype, b.dtype)
  dn = ((tuple(ca), tuple(cb)), (tuple(ba), tuple(bb)))
  out = _emulated(jax.lax.stop_gradient(a), jax.lax.stop_gradient(b), dn, a_recipe, b_recipe, rht_seed, out_dtype, key)
  # Straight-through: the derivative is that of a plain dot of the two fake-quantized operands (nearest rounding).
  a_hat = qz.qdq(_canonical(a, ba, ca), block_2d=a_recipe.block_2d)
  b_hat = qz.qdq(_canonical(b, bb, cb), block_2d=b_recipe.block_2d)
  ref = jax.lax.dot_general(a_hat, b_hat, _canonical_dimension_numbers(len(ba), a_hat, b_hat),
                            preferred_element_type=out_dtype)
  return qz.straight_through(ref, jax.lax.stop_gradient(out))
