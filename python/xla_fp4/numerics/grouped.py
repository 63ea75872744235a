"""The grouped NVFP4 recipe: `jax.lax.ragged_dot` (the expert GEMMs of a mixture of experts) with its operands in
NVFP4, emulated exactly: the reference (`ragged_dot`, `ragged_contracting_dot`), and the forms the pass emits for
expert GEMMs (`slice_qdq` + `scaled_output` around a dot_general, `ragged_rows`, `ragged_contracting`), which compute
the same numbers (docs/design.md §3).

The rows of `lhs` (tokens, sorted by expert) form consecutive groups, `group_sizes[g]` rows for expert g:
- `ragged_dot(lhs, rhs, group_sizes)`: lhs [M, K], rhs [G, K, N] -> [M, N], the rows of group g times rhs[g]: an
  expert layer's forward (activations, weights) and dgrad (output gradients, weights with K and N swapped).
- `ragged_contracting_dot(lhs, rhs, group_sizes)`: lhs [M, K], rhs [M, N] -> [G, K, N], the contraction over the rows
  of each group: the wgrad (lhs: activations, rhs: output gradients).

Scaling (as Transformer Engine and torchao do for grouped GEMMs; arXiv 2509.25149 §4 per GEMM):
- a global decode scale per expert for an expert weight (`rhs` of ragged_dot), 16x16 tiles within it (block_2d);
- a global decode scale per group of rows for activations and gradients, 1x16 blocks along the contraction;
- in the wgrad the contraction runs over the rows: 1x16 blocks (and the 16-row RHT) along the rows.

A group whose size is not a multiple of 16 is handled by masking, not padding: each group quantizes the whole row
range with the other groups' rows zeroed, so blocks stay aligned to the rows as they lie in memory and a block that
straddles two groups holds, for each group, only that group's values: its scale, rounding and RHT (a zero row adds
nothing after the orthogonal transform) see no other group's. The price: a partial block at each group edge.

Stochastic rounding draws per group: group g's key is fold_in(key, g) after the per-operand fold_in(key, 1|2) of
`dot_general`; element (r, c) draws at its row-major position in the whole operand. Gradients: straight-through.

What the pass emits (its twins, lowered into the program; passes/rewrite/emitter.py):
- a dot_general with a group dim on both operands (JAX's CPU expansion of a ragged dot, whose operand is masked per
  group; an expert einsum `ecd,edf->ecf`): `slice_qdq` quantizes each slice along the group dims with its own scale and
  key. The expansion's forward and dgrad then run the program's GEMM over all groups and `masked_output` takes each
  row's own group's alpha (a row holds one group's products only); other dots run the GEMM with the group dims as
  batch dims and `scaled_output` applies alpha per group (summing over group dims the program contracted). A group
  dim free in one operand (a dense MoE's up projection `BSM,EMH->BSEH`: every token meets every expert, so the other
  operand is one slice) stays a free dim of the GEMM, and that operand's scales lie along it.
- a `chlo.ragged_dot` (JAX's lowering for GPU): one ragged GEMM on quantized operands, as many FLOPs as the original.
  `ragged_rows` (forward, dgrad): lhs rows with their group's scale and key, one scale per expert matrix.
  `ragged_contracting` (wgrad, blocks along the rows): each group's rows copied into blocks of their own at their
  offset within a 16-row block (`_padded_rows`): a block holds one group's rows and zeros, the reference's masked
  block. Both quantize as the reference; the GEMM sums the same products in another order.
Four Over Six (a recipe tuple's 4th entry) takes each group's scale as amax / 1536 and each block's scale to 4 or 6.
"""

import jax
import jax.numpy as jnp
import numpy as np

from xla_fp4.numerics import collective
from xla_fp4.numerics import formats
from xla_fp4.numerics import kernel_twins
from xla_fp4.numerics import nvfp4 as qz
from xla_fp4.numerics import packing
from xla_fp4.numerics.gemm import OperandRecipe
from xla_fp4.numerics.rht import rht_f32


def _ends(sizes):
  """The running sums of a few group sizes (exact integers): a sum under a triangular mask, which lowers alike on
  every platform (jnp.cumsum lowers to chlo.scan for CUDA, which XLA CPU cannot compile: the twins lowered for CUDA
  are compiled for the CPU in tests/passes/test_experts.py)."""
  g = jnp.arange(sizes.shape[0])
  return jnp.sum(jnp.where(g[None, :] <= g[:, None], sizes[None, :], 0), axis=1).astype(sizes.dtype)


def _group_masks(group_sizes, num_rows):
  """bool [G, M]: row r belongs to group g."""
  ends = _ends(group_sizes)
  starts = ends - group_sizes
  rows = jnp.arange(num_rows)
  return (rows[None, :] >= starts[:, None]) & (rows[None, :] < ends[:, None])


def _group_key(key, group):
  return None if key is None else formats.fold_in(key, group)


def _key(key, operand, group):
  return None if key is None else _group_key(formats.fold_in(key, operand), group)


def _quantized(x32, axis, recipe, key, rht_seed, encoded=False, peers=()):
  """(q·scale in float32, s_dec) of one group's operand (other groups' rows already zero); `encoded`: (q, its E4M3
  scales) in place of q·scale (`_encoded`); `peers`: the devices whose parts make up the group's operand (a shard_map
  body's, collective.py), whose amax the scale is."""
  if recipe.rht:
    x32 = rht_f32(x32, axis, rht_seed)
  s_dec = qz.global_decode_scale(collective.max_over_peers(qz.amax(x32), peers), recipe.four_over_six)
  if encoded:
    return _encoded(x32, axis, recipe, key, s_dec), s_dec
  return qz.unscaled_values(x32, axis, recipe.block_2d, recipe.rounding, key, s_dec, None, recipe.four_over_six), s_dec


def _encoded(x32, axis, recipe, key, s_dec, bits=None):
  """(q on the E2M1 grid in x32's shape, float8_e4m3fn scales: x32's dims with `axis` divided by 16) of the
  quantization whose q·scale qz.unscaled_values computes with the same arguments (their product, exactly)."""
  q, scales = qz._encode(x32, axis, recipe.block_2d, recipe.rounding, key, s_dec, bits)
  return q.reshape(x32.shape), scales.reshape(qz._scale_shape(x32.shape, qz.canonical_axis(x32.shape, axis)[0]))


def _k_major_packed(q, scales, axis):
  """(codes uint8 (rows, K/2), E4M3 scales as uint8 (rows, K/16)) of a matrix `q` on the E2M1 grid quantized along
  `axis` (0 or 1) with `scales` (`_encoded`): numerics/packing.py's K-major storage, which the FP4 GEMMs read."""
  if axis == 0:
    q, scales = q.T, scales.T
  codes = packing.e2m1_codes(q).reshape(q.shape[0], -1, 2)
  return codes[..., 0] | (codes[..., 1] << 4), jax.lax.bitcast_convert_type(scales, jnp.uint8)


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


# -- what the pass emits ------------------------------------------------------------------------------------------


def _recipe(block_2d, stochastic, rht, four_over_six=False):  # the pass's recipe tuples: 3 entries, or 4 with 4/6
  return OperandRecipe(block_2d=block_2d, rounding=qz.Rounding.STOCHASTIC if stochastic else qz.Rounding.NEAREST,
                       rht=rht, four_over_six=four_over_six)


def _operand_key(x, salt, stochastic):
  """The pass's key of an operand (kernel_twins.stochastic_key), or None when it rounds to nearest."""
  return kernel_twins.stochastic_key(x, salt) if stochastic else None


def slice_qdq(x, salt, *, groups, axis, block_2d, stochastic, rht, rht_seed, peers=(), four_over_six=False):
  """(q·scale in x's dtype, s_dec shaped like x's `groups` dims): every slice of x along the group dims quantized
  along `axis` with its own global decode scale and key fold_in(key, slice number), as the reference quantizes a
  group. The slices of a masked operand [G, M, K] are the reference's masked groups; those of an expert weight
  [G, K, N] its experts. `axis` may be a tuple of dims (a wgrad over batch and sequence): they are quantized as one,
  merged in that order after the slice's other dims, as the emulated GEMM merges several contracting dims."""
  key = _operand_key(x, salt, stochastic)
  slices, inner, unslice = as_slices(x, groups, axis)
  recipe = _recipe(block_2d, stochastic, rht, four_over_six)
  q, s_dec = jax.vmap(lambda v, g: _quantized(v, inner, recipe, _group_key(key, g), rht_seed, peers=peers))(
      slices.astype(jnp.float32), jnp.arange(slices.shape[0]))
  return unslice(q.astype(x.dtype)), s_dec.reshape([x.shape[d] for d in groups])


def as_slices(x, groups, axis):
  """(the slices of x along the dims `groups`, stacked: [slices, ...], the quantization axis within a slice, the
  inverse: slices -> x's layout). `axis` may be a tuple of dims, merged in that order into one trailing K."""
  axes = (axis,) if isinstance(axis, int) else tuple(axis)
  rest = tuple(d for d in range(x.ndim) if d not in groups and (len(axes) == 1 or d not in axes))
  order = tuple(groups) + rest + (axes if len(axes) > 1 else ())
  moved = jnp.transpose(x, order)
  group_shape = moved.shape[:len(groups)]
  slice_shape = moved.shape[len(groups):]
  if len(axes) > 1:  # merge the contraction dims into one trailing K
    slice_shape = slice_shape[:len(rest)] + (int(np.prod(slice_shape[len(rest):])),)
  slices = moved.reshape((int(np.prod(group_shape)),) + slice_shape)
  inner = order.index(axes[0]) - len(groups) if len(axes) == 1 else len(rest)
  return slices, inner, lambda s: jnp.transpose(s.reshape(moved.shape), np.argsort(order))


def scaled_output(acc, lhs_scale, rhs_scale, *, lhs_groups, rhs_groups, summed, dtype):
  """The GEMM's f32 accumulator `acc` times alpha = lhs_scale * rhs_scale (each scale's dims lie along acc's dims
  `lhs_groups`, `rhs_groups`, in the scale's order: both along the same dims for group dims the operands share, one
  along an operand's own free dim, a scalar where an operand has no group dim), summed over the positions `summed`
  (the group dims the program contracted), in `dtype`: the reference's `acc * (sx * sw)` and its sum over the
  groups."""
  def along(scale, dims):
    order = sorted(range(len(dims)), key=lambda i: dims[i])
    shape = [1] * acc.ndim
    for i in order:
      shape[dims[i]] = scale.shape[i]
    return jnp.transpose(scale, order).reshape(shape)

  y = acc * (along(lhs_scale, lhs_groups) * along(rhs_scale, rhs_groups))
  if summed:
    y = jnp.sum(y, axis=tuple(summed))
  return y.astype(dtype)


def masked_output(acc, mask, lhs_scale, rhs_scale, *, group_dim, contracted, rows_first, dtype):
  """A ragged dot's CPU expansion, whose GEMM contracts the group dim: `acc` (f32, the program's output shape) holds
  each row's own group's products only (the other groups' rows are masked to zero), so alpha = lhs_scale * rhs_scale
  of the row's group multiplies it: `mask` is the masked operand's mask (its `group_dim` numbers the groups, its
  `contracted` dims are the contraction's), whose remaining dims are acc's leading dims (`rows_first`) or trailing
  ones. The same numbers as the reference's sum over groups of acc_g * alpha_g, of which one term per row is not
  zero, and the all-reduce of a split contraction stays the size of the output."""
  rows = jnp.any(mask, axis=tuple(contracted), keepdims=True)
  rows = jnp.moveaxis(rows, group_dim, 0)
  alpha = lhs_scale * rhs_scale
  row_alpha = jnp.sum(jnp.where(rows, alpha.reshape((-1,) + (1,) * (rows.ndim - 1)), 0.0), axis=0)
  row_alpha = jnp.squeeze(row_alpha, axis=tuple(d - (d > group_dim) for d in contracted))
  extra = acc.ndim - row_alpha.ndim
  shape = row_alpha.shape + (1,) * extra if rows_first else (1,) * extra + row_alpha.shape
  return (acc * row_alpha.reshape(shape)).astype(dtype)


def _group_of_rows(group_sizes, num_rows):
  """int32 [num_rows]: the group of each row; len(group_sizes) for rows after the last group."""
  return jnp.searchsorted(_ends(group_sizes), jnp.arange(num_rows), side="right").astype(jnp.int32)


def _group_scales(amax, group, num_groups, peers=(), four_over_six=False):
  """(s_dec per group, s_dec per item) from `amax` of items (rows or blocks) of groups `group` (num_groups: none):
  a group's amax is its items' max (on every device of `peers`: collective.py), 0 for a group without items."""
  per_group = jax.ops.segment_max(amax, group, num_segments=num_groups + 1)[:num_groups]
  per_group = collective.max_over_peers(per_group, peers)
  s_dec = qz.global_decode_scale(jnp.maximum(per_group, 0.0), four_over_six)
  return s_dec, jnp.take(s_dec, group, mode="fill", fill_value=0.0)


def ragged_rows(lhs, rhs, group_sizes, lhs_salt, rhs_salt, *, lhs_contracting, rhs_contracting, rhs_group,
                lhs_recipe, rhs_recipe, rht_seed, dtype, peers=()):
  """chlo.ragged_dot with lhs [M, K] in groups of rows and rhs [G, ...] one matrix per group (a forward or dgrad of
  an expert layer) in the grouped recipe, as one ragged GEMM. Recipes are (block_2d, stochastic, rht)."""
  _, qx, s_x, _, qw, s_w = ragged_rows_operands(
      lhs, rhs, group_sizes, lhs_salt, rhs_salt, lhs_contracting=lhs_contracting, rhs_contracting=rhs_contracting,
      rhs_group=rhs_group, lhs_recipe=lhs_recipe, rhs_recipe=rhs_recipe, rht_seed=rht_seed, peers=peers)
  group = _group_of_rows(group_sizes, lhs.shape[0])
  dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(([lhs_contracting], [rhs_contracting]), ([], [])), lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[rhs_group])
  acc = jax.lax.ragged_dot_general(qx.astype(lhs.dtype), qw, group_sizes, dims,
                                   preferred_element_type=jnp.float32)
  alpha = jnp.take(s_x * s_w, group, mode="fill", fill_value=0.0)
  return (acc * alpha[:, None]).astype(dtype)


def ragged_rows_operands(lhs, rhs, group_sizes, lhs_salt, rhs_salt, *, lhs_contracting, rhs_contracting, rhs_group,
                         lhs_recipe, rhs_recipe, rht_seed, peers=()):
  """ragged_rows' quantized operands: (lhs in float32 as quantized (rows outside the groups zeroed, after any RHT), its
  q·scale, s_dec per group, s_dec per row, rhs's q·scale, s_dec per expert)."""
  x32, s_x, s_row, row_key, recipe = _token_rows(lhs, group_sizes, lhs_salt, rhs.shape[rhs_group], lhs_contracting,
                                                 lhs_recipe, rht_seed, peers)
  qx = qz.unscaled_values(x32, lhs_contracting, recipe.block_2d, recipe.rounding, row_key, s_row[:, None, None], None,
                          recipe.four_over_six)
  rhs_recipe = _recipe(*rhs_recipe)
  qw, s_w = slice_qdq(rhs, rhs_salt, groups=(rhs_group,), axis=rhs_contracting, block_2d=rhs_recipe.block_2d,
                      stochastic=rhs_recipe.stochastic, rht=rhs_recipe.rht, rht_seed=rht_seed, peers=peers,
                      four_over_six=rhs_recipe.four_over_six)
  return x32, qx, s_x, s_row, qw, s_w


def _token_rows(lhs, group_sizes, salt, num_groups, axis, recipe, rht_seed, peers=()):
  """The lhs of ragged_rows as it is quantized: (float32, rows outside the groups zeroed, after any RHT; s_dec per
  group; s_dec per row; the stochastic-rounding key per row or None; the OperandRecipe)."""
  recipe = _recipe(*recipe)
  group = _group_of_rows(group_sizes, lhs.shape[0])
  x32 = jnp.where((group < num_groups)[:, None], lhs.astype(jnp.float32), 0.0)
  if recipe.rht:
    x32 = rht_f32(x32, axis, rht_seed)
  s_x, s_row = _group_scales(qz._max(jnp.abs(x32), axis=1), group, num_groups, peers, recipe.four_over_six)
  key = _operand_key(lhs, salt, recipe.stochastic)
  row_key = None if key is None else _group_key(key, group)[:, None]
  return x32, s_x, s_row, row_key, recipe


def ragged_rows_packed(lhs, rhs, group_sizes, lhs_salt, rhs_salt, *, lhs_contracting, rhs_contracting, rhs_group,
                       lhs_recipe, rhs_recipe, rht_seed, peers=()):
  """ragged_rows' operands as the native backend's grouped FP4 GEMM reads them (xla_fp4_ragged_gemm_packed, ragged_k
  false): (lhs codes (M, K/2), scales (M, K/16), rhs codes (G, N, K/2), scales (G, N, K/16), alpha = s_dec of the
  tokens times s_dec of the expert, per group). The same quantization as ragged_rows_operands (lhs [M, K] contracting
  its dim 1), K-major."""
  if lhs.ndim != 2 or lhs_contracting != 1 or rhs.ndim != 3:
    raise ValueError(f"ragged_rows_packed takes lhs [M, K] and rhs [G, ., .], got {lhs.shape} contracting "
                     f"{lhs_contracting} and {rhs.shape}")
  x32, s_x, s_row, row_key, recipe = _token_rows(lhs, group_sizes, lhs_salt, rhs.shape[rhs_group], 1, lhs_recipe,
                                                 rht_seed, peers)
  a_codes, a_scales = _k_major_packed(*_encoded(x32, 1, recipe, row_key, s_row[:, None, None]), 1)
  recipe = _recipe(*rhs_recipe)
  key = _operand_key(rhs, rhs_salt, recipe.stochastic)
  slices, inner, _ = as_slices(rhs, (rhs_group,), rhs_contracting)
  (q, scales), s_w = jax.vmap(lambda v, g: _quantized(v, inner, recipe, _group_key(key, g), rht_seed, encoded=True,
                                                      peers=peers))(
      slices.astype(jnp.float32), jnp.arange(slices.shape[0]))
  b_codes, b_scales = jax.vmap(lambda q, s: _k_major_packed(q, s, inner))(q, scales)
  return a_codes, a_scales, b_codes, b_scales, s_x * s_w


def _padded_rows(group_sizes, num_rows, multiple=formats.BLOCK, block=formats.BLOCK):
  """The copy of `ragged_contracting`: for each row p of a [P, ...] layout where group g's rows fill whole `block`-row
  blocks of their own (16; the MX formats' 32), each row at its offset within its block as in the original, a group's
  blocks rounded up to `multiple` rows with zero blocks: (the original row at p, whether p holds one of its group's
  rows, the group of p (G past the last), the padded group sizes). P = num_rows + `multiple` G."""
  num_groups = group_sizes.shape[0]
  ends = _ends(group_sizes)
  starts = ends - group_sizes
  first = starts // block
  blocks = jnp.where(group_sizes > 0, -(-ends // block) - first, 0)
  padded_sizes = -(-blocks * block // multiple) * multiple
  padded_ends = _ends(padded_sizes)
  rows = num_rows + multiple * num_groups
  p = jnp.arange(rows)
  group = jnp.searchsorted(padded_ends, p, side="right").astype(jnp.int32)
  g = jnp.minimum(group, num_groups - 1)
  original = first[g] * block + p - (padded_ends[g] - padded_sizes[g])
  holds = (group < num_groups) & (original >= starts[g]) & (original < ends[g])
  return jnp.clip(original, 0, num_rows - 1), holds, group, padded_sizes


def ragged_contracting_operand(x, group_sizes, salt, recipe, rht_seed, multiple=formats.BLOCK, encoded=False,
                               peers=()):
  """One operand of ragged_contracting as it quantizes it: (the `_padded_rows` copy in float32 after any RHT, its
  q·scale in x's dtype, s_dec per group, s_dec per 16-row block). `multiple`: `_padded_rows`' (a group's zero blocks
  add nothing); `encoded`: (q, its E4M3 scales) in place of q·scale (`_encoded`)."""
  num_groups = group_sizes.shape[0]
  original, holds, group, _ = _padded_rows(group_sizes, x.shape[0], multiple)
  recipe = _recipe(*recipe)
  v = jnp.where(holds[:, None], x.astype(jnp.float32)[original], 0.0)
  if recipe.rht:
    v = rht_f32(v, 0, rht_seed)
  block_amax = qz._max(jnp.abs(v).reshape(-1, formats.BLOCK, v.shape[1]), axis=(1, 2))
  s_dec, s_block = _group_scales(block_amax, group[::formats.BLOCK], num_groups, peers, recipe.four_over_six)
  key, bits = _operand_key(x, salt, recipe.stochastic), None
  if key is not None:  # element (r, c) draws at its position in the original operand, with its group's key
    index = (original[:, None] * x.shape[1] + jnp.arange(x.shape[1])[None, :]).astype(jnp.uint32)
    bits = formats.random_bits(_group_key(key, group)[:, None], v.shape, index)
  if encoded:
    return v, _encoded(v, 0, recipe, None, s_block[None, :, None], bits), s_dec, s_block
  q = qz.unscaled_values(v, 0, recipe.block_2d, recipe.rounding, None, s_block[None, :, None], bits,
                         recipe.four_over_six)
  return v, q.astype(x.dtype), s_dec, s_block


def ragged_contracting(lhs, rhs, group_sizes, lhs_salt, rhs_salt, *, lhs_recipe, rhs_recipe, rht_seed, dtype,
                       peers=()):
  """chlo.ragged_dot with lhs [M, K] and rhs [M, N] contracted over the rows of each group -> [G, K, N] (an expert
  layer's wgrad) in the grouped recipe: both operands along the rows, copied into `_padded_rows`' layout."""
  _, qx, s_x, _ = ragged_contracting_operand(lhs, group_sizes, lhs_salt, lhs_recipe, rht_seed, peers=peers)
  _, qy, s_y, _ = ragged_contracting_operand(rhs, group_sizes, rhs_salt, rhs_recipe, rht_seed, peers=peers)
  padded_sizes = _padded_rows(group_sizes, lhs.shape[0])[3]
  dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                           lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
  acc = jax.lax.ragged_dot_general(qx, qy, padded_sizes, dims, preferred_element_type=jnp.float32)
  return (acc * (s_x * s_y)[:, None, None]).astype(dtype)


# cuBLASLt's FP4 GEMM takes K a multiple of 32: a group's padded rows (its wgrad's contraction) are rounded up to it.
_GEMM_K_MULTIPLE = 32


def ragged_contracting_packed(lhs, rhs, group_sizes, lhs_salt, rhs_salt, *, lhs_recipe, rhs_recipe, rht_seed,
                              peers=()):
  """ragged_contracting's operands as the native backend's grouped FP4 GEMM reads them (xla_fp4_ragged_gemm_packed,
  ragged_k true): (lhs codes (K, P/2), scales (K, P/16), rhs codes (N, P/2), scales (N, P/16), the groups' row counts
  in the `_padded_rows` layout (P = M + 32 G), alpha per group). The same quantization as ragged_contracting's, each
  group's rows rounded up to 32 with zero blocks, K-major: the contraction runs over each group's padded rows."""
  packed = []
  for x, salt, recipe in ((lhs, lhs_salt, lhs_recipe), (rhs, rhs_salt, rhs_recipe)):
    _, (q, scales), s_dec, _ = ragged_contracting_operand(x, group_sizes, salt, recipe, rht_seed,
                                                          multiple=_GEMM_K_MULTIPLE, encoded=True, peers=peers)
    packed.append((*_k_major_packed(q, scales, 0), s_dec))
  (a_codes, a_scales, s_x), (b_codes, b_scales, s_y) = packed
  sizes = _padded_rows(group_sizes, lhs.shape[0], _GEMM_K_MULTIPLE)[3].astype(jnp.int32)
  return a_codes, a_scales, b_codes, b_scales, sizes, s_x * s_y
