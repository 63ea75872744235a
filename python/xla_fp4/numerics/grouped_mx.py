"""The OCP MX formats (numerics/mx.py) on expert GEMMs, `jax.lax.ragged_dot`: the reference and the forms the pass
emits for a chlo.ragged_dot (grouped.py is NVFP4's).

An MX scale is local to its 32-block, so a group needs no decode scale of its own: a token row quantizes along K as
any row does, and an expert's matrix as any matrix does (its 32x32 tiles within the expert). Only the wgrad, whose
blocks run along the rows, must keep each block within one group:
- `ragged_dot(lhs, rhs, group_sizes, fmt)`: lhs [M, K] along K, rhs [G, K, N] per expert along K (32x32 tiles with
  the weight's recipe), then the ragged GEMM. The forward and the dgrad.
- `ragged_contracting_dot(lhs, rhs, group_sizes, fmt)`: out[g] = lhs[rows of g].T @ rhs[rows of g], both operands
  along the rows, each group masked in place (its 32-row blocks where they lie in the operand: a block that
  straddles two groups holds, for each, only that group's rows). The wgrad.
Stochastic rounding draws one key per operand; element (r, c) draws at its row-major position in the operand.

What the pass emits (passes/rewrite/experts.py): `ragged_rows` (forward, dgrad: the reference's own computation, for
any contracting and group dims) and `ragged_contracting` (wgrad), which copies each group's rows into 32-row blocks
of their own at their offsets (grouped._padded_rows with 32-row blocks), so that one ragged GEMM over the padded
groups multiplies exactly the reference's masked blocks. No alpha: q·scale is exact and needs no decode scale.
"""

import jax
import jax.numpy as jnp

from xla_fp4.numerics import formats
from xla_fp4.numerics import grouped
from xla_fp4.numerics import kernel_twins
from xla_fp4.numerics import mx
from xla_fp4.numerics.rht import rht_f32

MX_BLOCK = mx.MX_BLOCK


def _values(x32, axis, fmt, recipe, key, rht_seed, bits=None):
  """q·scale (float32) of float32 x32 along `axis` in MX format `fmt` with recipe (block_2d, stochastic, rht)."""
  return _transformed_and_values(x32, axis, fmt, recipe, key, rht_seed, bits)[1]


def _transformed_and_values(x32, axis, fmt, recipe, key, rht_seed, bits=None):
  """(x32 after the RHT where the recipe has it, its q·scale): _values and what telemetry compares it with."""
  block_2d, stochastic, rht = recipe
  if rht:
    x32 = rht_f32(x32, axis, rht_seed)
  return x32, mx.unscaled_values(x32, axis, formats.FORMATS[fmt], block_2d, stochastic, key, bits)


def _key(x, salt, recipe):
  return kernel_twins.stochastic_key(x, salt) if recipe[1] else None


def _experts(w, salt, group, contracting, fmt, recipe, rht_seed):
  """rhs of a ragged dot, [G, ...] with the group dim `group`, quantized per expert along `contracting` (32x32 tiles
  within an expert), in w's dtype; an expert's elements draw at their positions in w."""
  key = _key(w, salt, recipe)
  slices, inner, unslice = grouped.as_slices(w, (group,), contracting)
  if key is None:
    q = jax.vmap(lambda v: _values(v, inner, fmt, recipe, None, rht_seed))(slices.astype(jnp.float32))
  else:
    bits = grouped.as_slices(formats.random_bits(key, w.shape), (group,), contracting)[0]
    q = jax.vmap(lambda v, b: _values(v, inner, fmt, recipe, None, rht_seed, b))(slices.astype(jnp.float32), bits)
  return unslice(q.astype(w.dtype))


def ragged_rows(lhs, rhs, group_sizes, lhs_salt, rhs_salt, *, lhs_contracting, rhs_contracting, rhs_group,
                lhs_recipe, rhs_recipe, rht_seed, dtype, fmt):
  """chlo.ragged_dot with lhs [M, K] in groups of rows and rhs [G, ...] one matrix per group, both in MX format `fmt`
  (recipes: (block_2d, stochastic, rht)), as one ragged GEMM."""
  _, qx, qw = ragged_rows_operands(lhs, rhs, lhs_salt, rhs_salt, lhs_contracting=lhs_contracting,
                                   rhs_contracting=rhs_contracting, rhs_group=rhs_group, lhs_recipe=lhs_recipe,
                                   rhs_recipe=rhs_recipe, rht_seed=rht_seed, fmt=fmt)
  dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(([lhs_contracting], [rhs_contracting]), ([], [])), lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[rhs_group])
  acc = jax.lax.ragged_dot_general(qx.astype(lhs.dtype), qw, group_sizes, dims, preferred_element_type=jnp.float32)
  return acc.astype(dtype)


def ragged_rows_operands(lhs, rhs, lhs_salt, rhs_salt, *, lhs_contracting, rhs_contracting, rhs_group, lhs_recipe,
                         rhs_recipe, rht_seed, fmt):
  """ragged_rows' quantized operands: (lhs in float32 after any RHT, its q·scale in float32, rhs's q·scale per expert
  in rhs's dtype)."""
  x32, qx = _transformed_and_values(lhs.astype(jnp.float32), lhs_contracting, fmt, lhs_recipe,
                                    _key(lhs, lhs_salt, lhs_recipe), rht_seed)
  return x32, qx, _experts(rhs, rhs_salt, rhs_group, rhs_contracting, fmt, rhs_recipe, rht_seed)


def _layout(group_sizes, num_rows):
  """grouped._padded_rows with 32-row blocks over `num_rows` rounded up to 32 (the rows past them zero, in no group):
  (the rounded row count, the original row at each position, whether it holds its group's row, padded group sizes)."""
  rows = -(-num_rows // MX_BLOCK) * MX_BLOCK
  original, holds, _, sizes = grouped._padded_rows(group_sizes, rows, MX_BLOCK, MX_BLOCK)
  return rows, original, holds, sizes


def _padded(x, group_sizes):
  """x's rows in `_layout`'s positions (float32, rows of no group zero) and the original row of each."""
  rows, original, holds, _ = _layout(group_sizes, x.shape[0])
  x32 = jnp.pad(x.astype(jnp.float32), [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
  return jnp.where(holds[:, None], x32[original], 0.0), original


def ragged_contracting(lhs, rhs, group_sizes, lhs_salt, rhs_salt, *, lhs_recipe, rhs_recipe, rht_seed, dtype, fmt):
  """chlo.ragged_dot with lhs [M, K] and rhs [M, N] contracted over the rows of each group -> [G, K, N] (an expert
  layer's wgrad), both operands in MX format `fmt` along the rows, copied into 32-row blocks of their own."""
  (_, qx), (_, qy) = (ragged_contracting_operand(x, group_sizes, salt, recipe, rht_seed, fmt)
                      for x, salt, recipe in ((lhs, lhs_salt, lhs_recipe), (rhs, rhs_salt, rhs_recipe)))
  sizes = _layout(group_sizes, lhs.shape[0])[3]
  dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                           lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
  acc = jax.lax.ragged_dot_general(qx.astype(lhs.dtype), qy.astype(rhs.dtype), sizes.astype(group_sizes.dtype), dims,
                                   preferred_element_type=jnp.float32)
  return acc.astype(dtype)


def ragged_contracting_operand(x, group_sizes, salt, recipe, rht_seed, fmt):
  """One operand of ragged_contracting as it quantizes it: (its 32-row-block copy in float32 after any RHT, the
  copy's q·scale in float32)."""
  v, original = _padded(x, group_sizes)
  key, bits = _key(x, salt, recipe), None
  if key is not None:  # element (r, c) draws at its position in the original operand
    index = (original[:, None] * x.shape[1] + jnp.arange(x.shape[1])[None, :]).astype(jnp.uint32)
    bits = formats.random_bits(key, v.shape, index)
  return _transformed_and_values(v, 0, fmt, recipe, None, rht_seed, bits)


# -- the reference --------------------------------------------------------------------------------------------------


def ragged_dot(lhs, rhs, group_sizes, fmt, *, lhs_recipe=(False, False, False), rhs_recipe=(True, False, False),
               lhs_salt=0, rhs_salt=0, rht_seed=0, preferred_element_type=None):
  """jax.lax.ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes) with both operands in MX format `fmt`, each group's
  rows and each expert's matrix quantized on their own: group g's rows masked, the expert's matrix sliced out."""
  dtype = preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype)
  masks = grouped._group_masks(jnp.asarray(group_sizes), lhs.shape[0])
  lhs_key, rhs_key = _key(lhs, lhs_salt, lhs_recipe), _key(rhs, rhs_salt, rhs_recipe)
  rhs_bits = None if rhs_key is None else formats.random_bits(rhs_key, rhs.shape)

  def group(g):
    qx = _values(jnp.where(masks[g][:, None], lhs.astype(jnp.float32), 0.0), 1, fmt, lhs_recipe, lhs_key, rht_seed)
    qw = _values(rhs[g].astype(jnp.float32), 0, fmt, rhs_recipe, None, rht_seed,
                 None if rhs_bits is None else rhs_bits[g])
    return jnp.matmul(qx.astype(lhs.dtype).astype(jnp.float32), qw.astype(rhs.dtype).astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)

  return jnp.sum(jax.vmap(group)(jnp.arange(rhs.shape[0])), axis=0).astype(dtype)


def ragged_contracting_dot(lhs, rhs, group_sizes, fmt, *, lhs_recipe=(False, False, False),
                           rhs_recipe=(False, False, False), lhs_salt=0, rhs_salt=0, rht_seed=0,
                           preferred_element_type=None):
  """The wgrad of an expert layer in MX format `fmt`: out[g] = lhs[rows of g].T @ rhs[rows of g] -> [G, K, N], both
  operands along the rows with group g's rows masked in place (blocks of 32 rows where they lie)."""
  dtype = preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype)
  masks = grouped._group_masks(jnp.asarray(group_sizes), lhs.shape[0])
  keys = _key(lhs, lhs_salt, lhs_recipe), _key(rhs, rhs_salt, rhs_recipe)

  def operand(x, recipe, key, g):
    rows = -(-x.shape[0] // MX_BLOCK) * MX_BLOCK  # whole blocks: the rows past M are zero, in no group
    v = jnp.pad(jnp.where(masks[g][:, None], x.astype(jnp.float32), 0.0), [(0, rows - x.shape[0]), (0, 0)])
    bits = None if key is None else jnp.pad(formats.random_bits(key, x.shape), [(0, rows - x.shape[0]), (0, 0)])
    return _values(v, 0, fmt, recipe, None, rht_seed, bits).astype(x.dtype).astype(jnp.float32)

  def group(g):
    qx, qy = operand(lhs, lhs_recipe, keys[0], g), operand(rhs, rhs_recipe, keys[1], g)
    return jnp.matmul(qx.T, qy, precision=jax.lax.Precision.HIGHEST)

  return jax.vmap(group)(jnp.arange(jnp.asarray(group_sizes).shape[0])).astype(dtype)
