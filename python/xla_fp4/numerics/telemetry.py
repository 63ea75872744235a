"""What 4 bits do to one operand of an NVFP4 GEMM: the statistics the pass's telemetry records (docs/design.md §7).

`operand_stats(x, q, s_dec, ...)` compares an operand x with its quantized values as the GEMM sees them: q = q·scale
(the emulated GEMM's operand, RHT-transformed where the recipe applies it) and the global decode scale s_dec, so the
decoded value is q * s_dec. It returns one float32 row, FIELDS in order:

  amax, s_dec          the tensor's amax (after the RHT) and its global decode scale
  elements, nonzero    how many elements, how many are not zero
  underflow            nonzero elements that quantize to zero
  quantized_nonzero    elements that do not quantize to zero (0 with nonzero > 0: the operand became all zeros)
  energy, error_energy sum x², sum (x - q·s_dec)²: snr_db = 10·log10(energy / error_energy)
  live_blocks          1x16 blocks (of 16x16 tiles, for 2D weights) whose amax is not zero
  scale_underflow      live blocks whose E4M3 scale rounds to zero: the whole block is lost
  scale_saturated      live blocks whose scale E4M3 clips: at least 464 before rounding, which an E4M3 with more
                       range would round up to 480 (the tensor's amax block lands on 448 within rounding)

An MX format (numerics/mx.py; `mx_operand_stats`) has no tensor scale: s_dec is 1, and its blocks are 1x32 (of 32x32
tiles): live_blocks counts those; scale_underflow the live blocks whose E8M0 scale is 2^-127, which decodes to zero
(the subnormal rule of docs/design.md §2: the whole block is lost, as an E4M3 scale of zero loses an NVFP4 block);
scale_saturated stays 0, an E8M0 scale reaching every finite float32. Elements count as in NVFP4: underflow is the
E2M1 (MXFP4) or E4M3 (MXFP8, whose subnormal elements reach 2^-9 of the scale) elements lost to the block's scale.
With Four Over Six the element fields are exact and the block-scale fields are those of the scale to 6 (its 4 is 1.5
times larger: an upper bound of the blocks lost, and no block saturates, s_dec being amax / 1536).

Counts are int32 sums, so the pass's copy of these functions (lowered into the program) reduces a sharded tensor
exactly (XLA's partitioner turns each sum into an all-reduce): the statistics are the whole tensor's, not a shard's.
`summary` turns a row into the fractions a person reads.
"""

import math

import jax
import jax.numpy as jnp

from xla_fp4.numerics import formats
from xla_fp4.numerics import grouped
from xla_fp4.numerics import grouped_mx
from xla_fp4.numerics import kernel_twins
from xla_fp4.numerics import mx
from xla_fp4.numerics import nvfp4
from xla_fp4.numerics.rht import rht_f32

FIELDS = ("amax", "s_dec", "elements", "nonzero", "underflow", "quantized_nonzero", "energy", "error_energy",
          "live_blocks", "scale_underflow", "scale_saturated")
_CLIPPED = formats.E4M3_MAX + 16  # halfway to 480, the next step of E4M3's grid above 448
_MAXED = ("amax", "s_dec")  # combined over slices by max; every other field by sum


def _count(mask):
  return jnp.sum(mask, dtype=jnp.int32).astype(jnp.float32)


def _element_sums(x32, q32, s_dec):
  """(amax, nonzero, underflow, quantized nonzero, energy, error energy) of x32 and q32 · s_dec in one pass: one
  variadic reduction, which XLA runs as one loop over both tensors (separate reductions would read them once each)."""
  zero, one = jnp.int32(0), jnp.int32(1)
  nonzero = x32 != 0
  error = x32 - q32 * s_dec
  operands = (jnp.abs(x32), jnp.where(nonzero, one, zero), jnp.where(nonzero & (q32 == 0), one, zero),
              jnp.where(q32 != 0, one, zero), x32 * x32, error * error)
  inits = (jnp.float32(0), zero, zero, zero, jnp.float32(0), jnp.float32(0))

  def step(a, b):
    return (jnp.maximum(a[0], b[0]), a[1] + b[1], a[2] + b[2], a[3] + b[3], a[4] + b[4], a[5] + b[5])

  flat = tuple(o.reshape(-1) for o in operands)
  return jax.lax.reduce(flat, inits, step, (0,))


def operand_stats(x, q, s_dec, *, axis, block_2d, rht, rht_seed):
  """The FIELDS row of operand x quantized along `axis` to q (q·scale, x's shape) with decode scale s_dec."""
  x32 = x.astype(jnp.float32)
  if rht:
    x32 = rht_f32(x32, axis, rht_seed)
  s_dec = jnp.asarray(s_dec, jnp.float32)
  return _row(x32, q, s_dec, s_dec, s_dec, axis=axis, block_2d=block_2d, elements=x.size)


def _row(x32, q, s_elements, s_blocks, s_dec, *, axis, block_2d, elements):
  """The FIELDS row of float32 x32 (after any RHT) quantized along `axis` to q with decode scales `s_elements`
  (broadcast against x32) and `s_blocks` (against nvfp4.block_scales' block amaxes); `s_dec` the row's s_dec field
  (the largest group's where groups have their own), `elements` its element count (the operand's, not a padded copy's)."""
  x32 = formats.flush_subnormal(x32)  # as the kernels load it
  _, block_amax, wanted = nvfp4.block_scales(x32, axis, block_2d, s_blocks)
  live = block_amax > 0
  scales = formats.round_e4m3(wanted).astype(jnp.float32)
  amax, nonzero, underflow, kept, energy, error = _element_sums(x32, q.astype(jnp.float32), s_elements)
  f = lambda v: v.astype(jnp.float32)  # noqa: E731
  return jnp.stack([amax, jnp.max(s_dec).astype(jnp.float32), jnp.float32(elements), f(nonzero), f(underflow),
                    f(kept), energy, error, _count(live), _count(live & (scales == 0)),
                    _count(live & (wanted >= _CLIPPED))])


def ragged_rows_stats(lhs, rhs, group_sizes, lhs_salt, rhs_salt, *, lhs_contracting, rhs_contracting, rhs_group,
                      lhs_recipe, rhs_recipe, rht_seed, dtype, peers=()):
  """[2, FIELDS]: the rows of grouped.ragged_rows' operands as it quantizes them (the token rows with their group's
  scale; the expert weights per expert: sliced_stats)."""
  x32, qx, s_x, s_row, qw, s_w = grouped.ragged_rows_operands(
      lhs, rhs, group_sizes, lhs_salt, rhs_salt, lhs_contracting=lhs_contracting, rhs_contracting=rhs_contracting,
      rhs_group=rhs_group, lhs_recipe=lhs_recipe, rhs_recipe=rhs_recipe, rht_seed=rht_seed, peers=peers)
  x_row = _row(x32, qx, s_row[:, None], s_row[:, None, None], s_x, axis=lhs_contracting, block_2d=lhs_recipe[0],
               elements=lhs.size)
  w_row = sliced_stats(rhs, qw, s_w, groups=(rhs_group,), axis=rhs_contracting, block_2d=rhs_recipe[0],
                       rht=rhs_recipe[2], rht_seed=rht_seed)
  return jnp.stack([x_row, w_row])


def ragged_contracting_stats(lhs, rhs, group_sizes, lhs_salt, rhs_salt, *, lhs_recipe, rhs_recipe, rht_seed, dtype,
                             peers=()):
  """[2, FIELDS]: the rows of grouped.ragged_contracting's operands as it quantizes them (along the rows, in blocks of
  one group each, each group's scale)."""
  rows = []
  for x, salt, recipe in ((lhs, lhs_salt, lhs_recipe), (rhs, rhs_salt, rhs_recipe)):
    v, q, s_dec, s_block = grouped.ragged_contracting_operand(x, group_sizes, salt, recipe, rht_seed, peers=peers)
    rows.append(_row(v, q, jnp.repeat(s_block, formats.BLOCK)[:, None], s_block[None, :, None], s_dec, axis=0,
                     block_2d=recipe[0], elements=x.size))
  return jnp.stack(rows)


def mx_operand_stats(x, q, *, axis, block_2d, rht, rht_seed, fmt):
  """The FIELDS row of operand x quantized in the MX format `fmt` along `axis` to q (q·scale, x's shape; the RHT where
  the recipe applies it): the module docstring's MX fields."""
  x32 = x.astype(jnp.float32)
  if rht:
    x32 = rht_f32(x32, axis, rht_seed)
  return _mx_row(x32, q, axis=axis, block_2d=block_2d, fmt=fmt, elements=x.size)


def _mx_row(x32, q, *, axis, block_2d, fmt, elements):
  """The MX row of float32 x32 (after any RHT) quantized along `axis` to q; `elements`: the operand's count."""
  x32 = formats.flush_subnormal(x32)  # as the quantizer reads it
  block_amax = mx._block_amax(mx._blocked(x32, axis)[0], block_2d)
  live = block_amax > 0  # NaN blocks are not live
  lost = live & (mx.scale_exponent(block_amax, formats.FORMATS[fmt].elem_max) < -126)
  amax, nonzero, underflow, kept, energy, error = _element_sums(x32, q.astype(jnp.float32), jnp.float32(1))
  f = lambda v: v.astype(jnp.float32)  # noqa: E731
  return jnp.stack([amax, jnp.float32(1), jnp.float32(elements), f(nonzero), f(underflow), f(kept), energy, error,
                    _count(live), _count(lost), jnp.float32(0)])


def mx_ragged_rows_stats(lhs, rhs, group_sizes, lhs_salt, rhs_salt, *, lhs_contracting, rhs_contracting, rhs_group,
                         lhs_recipe, rhs_recipe, rht_seed, dtype, fmt):
  """[2, FIELDS]: the rows of grouped_mx.ragged_rows' operands as it quantizes them (the token rows of the groups;
  the expert weights per expert)."""
  x32, qx, qw = grouped_mx.ragged_rows_operands(
      lhs, rhs, lhs_salt, rhs_salt, lhs_contracting=lhs_contracting, rhs_contracting=rhs_contracting,
      rhs_group=rhs_group, lhs_recipe=lhs_recipe, rhs_recipe=rhs_recipe, rht_seed=rht_seed, fmt=fmt)
  in_groups = (jnp.arange(lhs.shape[0]) < jnp.sum(group_sizes))[:, None]  # rows after the last group: no GEMM's
  x_row = _mx_row(jnp.where(in_groups, x32, 0.0), jnp.where(in_groups, qx, 0.0), axis=lhs_contracting,
                  block_2d=lhs_recipe[0], fmt=fmt, elements=lhs.size)
  xs, inner, _ = grouped.as_slices(rhs, (rhs_group,), rhs_contracting)
  qs = grouped.as_slices(qw, (rhs_group,), rhs_contracting)[0]
  w_rows = jax.vmap(lambda a, b: mx_operand_stats(a, b, axis=inner, block_2d=rhs_recipe[0], rht=rhs_recipe[2],
                                                  rht_seed=rht_seed, fmt=fmt))(xs, qs)
  return jnp.stack([x_row, combine(w_rows)])


def mx_ragged_contracting_stats(lhs, rhs, group_sizes, lhs_salt, rhs_salt, *, lhs_recipe, rhs_recipe, rht_seed, dtype,
                                fmt):
  """[2, FIELDS]: the rows of grouped_mx.ragged_contracting's operands as it quantizes them (along the rows, in 32-row
  blocks of one group each)."""
  rows = []
  for x, salt, recipe in ((lhs, lhs_salt, lhs_recipe), (rhs, rhs_salt, rhs_recipe)):
    v, q = grouped_mx.ragged_contracting_operand(x, group_sizes, salt, recipe, rht_seed, fmt)
    rows.append(_mx_row(v, q, axis=0, block_2d=recipe[0], fmt=fmt, elements=x.size))
  return jnp.stack(rows)


def combine(rows):
  """One FIELDS row from several (slices of one operand: [n, FIELDS])."""
  maxed = jnp.array([f in _MAXED for f in FIELDS])
  return jnp.where(maxed, jnp.max(rows, axis=0), jnp.sum(rows, axis=0))


def sliced_stats(x, q, s_dec, *, groups, axis, block_2d, rht, rht_seed):
  """The row of an expert operand quantized per slice along `groups` (numerics/grouped.py slice_qdq: q, and s_dec
  shaped like x's group dims); amax and s_dec are the largest slice's."""
  xs, inner, _ = grouped.as_slices(x, groups, axis)
  qs, _, _ = grouped.as_slices(q, groups, axis)
  rows = jax.vmap(lambda a, b, s: operand_stats(a, b, s, axis=inner, block_2d=block_2d, rht=rht, rht_seed=rht_seed))(
      xs, qs, jnp.reshape(s_dec, (-1,)))
  return combine(rows)


def qdq_stats(x, s_dec, step, salt, *, axis, block_2d, stochastic, rht, rht_seed, four_over_six=False):
  """The row of x quantized as a GEMM's quantizer does with s_dec and the key it makes from `salt`
  (kernel_twins.stochastic_key); zeros where `step` is negative (not a recorded step). The probes' twin of a packed
  operand in a partitioned program without a Shardy mesh, whose statistics XLA partitions (passes/rewrite/probes.py)."""
  key = kernel_twins.stochastic_key(x, salt) if stochastic else salt
  q = kernel_twins.qdq(x, s_dec, key, axis=axis, block_2d=block_2d, stochastic=stochastic, rht=rht, rht_seed=rht_seed,
                       four_over_six=four_over_six)
  row = operand_stats(x, q, s_dec, axis=axis, block_2d=block_2d, rht=rht, rht_seed=rht_seed)
  return jnp.where(step >= 0, row, 0)


def qdq_and_stats(x, s_dec, key, step, *, axis, block_2d, stochastic, rht, rht_seed, four_over_six=False):
  """The twin of xla_fp4_qdq_and_stats: kernel_twins.qdq's q·scale of x with s_dec and `key`, and the row of that
  quantization (zeros where `step` is negative); its row is also xla_fp4_quantize_packed_stats's."""
  q = kernel_twins.qdq(x, s_dec, key, axis=axis, block_2d=block_2d, stochastic=stochastic, rht=rht, rht_seed=rht_seed,
                       four_over_six=four_over_six)
  row = operand_stats(x, q, s_dec, axis=axis, block_2d=block_2d, rht=rht, rht_seed=rht_seed)
  return q, jnp.where(step >= 0, row, 0)


def output_zeros(y):
  """A row for a GEMM's output: (exact zeros, elements, 0, ...): a wgrad's zero weight-gradient elements."""
  return jnp.zeros(len(FIELDS), jnp.float32).at[0].set(_count(y == 0)).at[1].set(jnp.float32(y.size))


def qdq_with_scale_stats(x, step, salt, *, axis, block_2d, stochastic, rht, rht_seed, four_over_six=False):
  """The twin of xla_fp4_qdq_with_scale_stats: kernel_twins.qdq_with_scale's (q·scale, s_dec), and the statistics of
  that quantization (zeros where `step` is negative)."""
  q, s_dec = kernel_twins.qdq_with_scale(x, salt, axis=axis, block_2d=block_2d, stochastic=stochastic, rht=rht,
                                         rht_seed=rht_seed, four_over_six=four_over_six)
  row = operand_stats(x, q, s_dec, axis=axis, block_2d=block_2d, rht=rht, rht_seed=rht_seed)
  return q, s_dec, jnp.where(step >= 0, row, 0)


def scaled_output(acc, alpha, *, dtype):
  """An emulated GEMM's output from its f32 accumulator: convert(acc * alpha) to `dtype`, as the pass makes it."""
  return (acc * alpha).astype(dtype)


def scaled_output_zeros(acc, alpha, *, dtype):
  """output_zeros of an emulated GEMM's output, made from its f32 accumulator."""
  return output_zeros(scaled_output(acc, alpha, dtype=dtype))


def output_stats(y, step):
  """The twin of xla_fp4_output_stats: output_zeros(y), or zeros where `step` is negative."""
  return jnp.where(step >= 0, output_zeros(y), 0)


def summary(row):
  """The fractions of a FIELDS row (a sequence of floats): amax, s_dec, underflow (of the nonzero elements),
  all_zero (nonzero elements and none survives), scale_underflow and scale_saturated (of the live blocks), snr_db
  (inf when exact, None for an all-zero tensor)."""
  v = dict(zip(FIELDS, (float(a) for a in row)))
  ratio = lambda a, b: v[a] / v[b] if v[b] else 0.0  # noqa: E731
  if v["energy"] == 0:
    snr = None
  elif v["error_energy"] == 0:
    snr = math.inf
  else:
    snr = 10 * math.log10(v["energy"] / v["error_energy"])
  return dict(amax=v["amax"], s_dec=v["s_dec"], elements=int(v["elements"]), underflow=ratio("underflow", "nonzero"),
              all_zero=v["nonzero"] > 0 and v["quantized_nonzero"] == 0,
              scale_underflow=ratio("scale_underflow", "live_blocks"),
              scale_saturated=ratio("scale_saturated", "live_blocks"), snr_db=snr)
