"""The grouped NVFP4 recipe: `jax.lax.ragged_dot` (the expert GEMMs of a mixture of experts) with its operands in
NVFP4, emulated exactly. The reference that a grouped rewrite must match bit for bit; the pass does not emit it yet
(it keeps ragged dots in high precision, docs/design.md §3).

The rows of `lhs` (tokens, sorted by expert) form consecutive groups, `group_sizes[g]` rows for expert g:
- `ragged_dot(lhs, rhs, group_sizes)`: lhs [M, K], rhs [G, K, N] -> [M, N], the rows of group g times rhs[g]. The
  forward (lhs: activations, rhs: expert weights) and the dgrad (lhs: output gradients, rhs: the weights with K and
  N swapped) of an expert layer.
- `ragged_contracting_dot(lhs, rhs, group_sizes)`: lhs [M, K], rhs [M, N] -> [G, K, N], the contraction over the rows
  of each group: the wgrad (lhs: activations, rhs: output gradients).

Scaling (as Transformer Engine and torchao do for grouped GEMMs; arXiv 2509.25149 §4 per GEMM):
- a global decode scale per expert for an expert weight (`rhs` of ragged_dot), 16x16 tiles within it (block_2d);
- a global decode scale per group of rows for activations and gradients, 1x16 blocks along the contraction;
- in the wgrad the contraction runs over the rows: 1x16 blocks (and the 16-row RHT) along the rows.

A group whose size is not a multiple of 16 is handled by masking, not padding: each group quantizes the whole row
range with the other groups' rows zeroed, so blocks stay aligned to the rows as they lie in memory (no copy, the
layout the kernels read) and a block that straddles two groups holds, for each group, only that group's values: its
scale, its rounding and its RHT (a zero row adds nothing after the orthogonal transform) see no other group's
numbers. The price is a partial block at each group edge, whose scale covers fewer than 16 values.

Stochastic rounding draws per group: the key of group g is fold_in(key, g), after the per-operand fold_in(key, 1|2)
of `dot_general`. Gradients of both functions are those of the plain ragged dot (straight-through).
"""

import jax
import jax.numpy as jnp

from xla_fp4.numerics import formats
from xla_fp4.numerics import nvfp4 as qz
from xla_fp4.numerics.gemm import OperandRecipe
from xla_fp4.numerics.rht import rht_f32


def _group_masks(group_sizes, num_rows):
  """bool [G, M]: row r belongs to group g."""
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  rows = jnp.arange(num_rows)
  return (rows[None, :] >= starts[:, None]) & (rows[None, :] < ends[:, None])


def _key(key, operand, group):
  return None if key is None else formats.fold_in(formats.fold_in(key, operand), group)


def _quantized(x32, axis, recipe, key, rht_seed):
  """(q·scale in float32, s_dec) of one group's operand (other groups' rows already zero)."""
  if recipe.rht:
    x32 = rht_f32(x32, axis, rht_seed)
  s_dec = qz.global_decode_scale(qz.amax(x32))
  return qz.unscaled_values(x32, axis, recipe.block_2d, recipe.rounding, key, s_dec), s_dec


def _prepared(lhs, rhs, group_sizes, recipes, key, preferred_element_type, contracting_rows):
  """Checked inputs: (lhs, rhs, group_sizes, the uint32 key or None, the output dtype, the group masks [G, M], lhs and
  rhs in float32 without gradient)."""
  lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
  contraction = lhs.shape[0] if contracting_rows else lhs.shape[1]
  if contraction % formats.BLOCK:
    raise ValueError(f"NVFP4 GEMMs need a contraction size that is a multiple of {formats.BLOCK}; got {contraction} "
                     f"(lhs shape {lhs.shape}). Keep this GEMM in high precision.")
  num_groups = group_sizes.shape[0] if contracting_rows else rhs.shape[0]
  if group_sizes.shape != (num_groups,):
    raise ValueError(f"group_sizes must have one entry per group ({num_groups}), got shape {group_sizes.shape}")
  for r in recipes:
    qz._check_rounding(r.rounding)
  key = formats.key_to_u32(key) if any(r.stochastic for r in recipes) else None
  out_dtype = preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype)
  as_f32 = lambda v: jax.lax.stop_gradient(v).astype(jnp.float32)  # noqa: E731
  return (lhs, rhs, group_sizes, key, out_dtype, _group_masks(group_sizes, lhs.shape[0]), as_f32(lhs),
          as_f32(rhs))


def ragged_dot(lhs, rhs, group_sizes, *, lhs_recipe=OperandRecipe(), rhs_recipe=OperandRecipe(block_2d=True),
               key=None, rht_seed=0, preferred_element_type=None):
  """jax.lax.ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N] with both operands in NVFP4: lhs per
  group of rows (scale per group, 1x16 along K), rhs per expert (scale per expert, 16x16 tiles by default)."""
  lhs, rhs, group_sizes, key, out_dtype, masks, x32, w32 = _prepared(
      lhs, rhs, group_sizes, (lhs_recipe, rhs_recipe), key, preferred_element_type, contracting_rows=False)

  def group(i):
    qx, sx = _quantized(jnp.where(masks[i][:, None], x32, 0.0), 1, lhs_recipe, _key(key, 1, i), rht_seed)
    qw, sw = _quantized(w32[i], 0, rhs_recipe, _key(key, 2, i), rht_seed)
    acc = jnp.matmul(qx, qw, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return acc * (sx * sw)  # rows of other groups are zero here

  out = jnp.sum(jax.vmap(group)(jnp.arange(rhs.shape[0])), axis=0).astype(out_dtype)
  return qz.straight_through(jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=out_dtype), out)


def ragged_contracting_dot(lhs, rhs, group_sizes, *, lhs_recipe=OperandRecipe(), rhs_recipe=OperandRecipe(),
                           key=None, rht_seed=0, preferred_element_type=None):
  """The wgrad of an expert layer: out[g] = lhs[rows of g].T @ rhs[rows of g], lhs [M, K], rhs [M, N] -> [G, K, N],
  both operands in NVFP4 along the rows (scale per group, 1x16 blocks along M; the RHT along M where the recipe has
  it). For the paper's wgrad recipe pass rhs_recipe (the gradient) stochastic and both with rht."""
  lhs, rhs, group_sizes, key, out_dtype, masks, x32, y32 = _prepared(
      lhs, rhs, group_sizes, (lhs_recipe, rhs_recipe), key, preferred_element_type, contracting_rows=True)

  def group(i):
    qx, sx = _quantized(jnp.where(masks[i][:, None], x32, 0.0), 0, lhs_recipe, _key(key, 1, i), rht_seed)
    qy, sy = _quantized(jnp.where(masks[i][:, None], y32, 0.0), 0, rhs_recipe, _key(key, 2, i), rht_seed)
    acc = jnp.matmul(qx.T, qy, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return acc * (sx * sy)

  out = jax.vmap(group)(jnp.arange(group_sizes.shape[0])).astype(out_dtype)
  dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                           lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
  plain = jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dims, preferred_element_type=out_dtype)
  return qz.straight_through(plain, out)
