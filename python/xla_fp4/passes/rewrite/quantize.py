"""Dense operand quantization: one operand of an emulated GEMM as q·scale (in x's dtype) and its decode scale.

  Form.WHOLE_TENSOR   %q, %s = xla_fp4_qdq_with_scale(%x) {axis, block_2d, stochastic, rht, rht_seed, salt}
                      one call measures x itself (amax, key)
  Form.PARTITIONED    %b(, %d) = xla_fp4_block_amax(%x) {digest where stochastic}
                      %s = decode_scale twin(%b)                 a max reduce, which XLA turns into an all-reduce
                      %key = %salt ^ digest_of_blocks twin(%d)   a sum, all-reduced likewise; once per value
                                                                 (reuse.py), or the salt where rounding is nearest
                      %q = xla_fp4_qdq(%x, %s, %key) {apply_global_scale = false}

Four Over Six (OperandRecipe.four_over_six) takes the same patterns, the kernels' `four_over_six` attribute set (and
decode_scale's 1536 divisor); its telemetry rows come from the twins (probes.py), not from the measuring kernels.

An MX format (mxfp4, mxfp8) has no tensor scale: its q·scale comes from one kernel in either form (on shards in a
partitioned program), and its decode scale is 1:
                      %key = %salt, or stochastic_key twin(%x, %salt) where rounding is stochastic
                      %q = xla_fp4_mx_qdq(%x, %key) {axis, block_2d, stochastic, rht, rht_seed, fp8}

Operands follow their OperandPlan: a `reusable` one (nearest rounding, not `fresh`) takes an earlier quantization of
the same elements in the same blocks (reuse.py); an `after_gradient` operand takes the gradient's decode scale,
bitcast to uint32, as its key: a nearest-rounded qdq never reads its key, so this orders the call after the gradient
without changing a number (StableHLO has no control dependency). Stochastic-rounding keys are
`digest(operand) ^ fold_in(seed, salt_id)`: they change every step and differ between layers, yet are reproducible.

With telemetry (the Probe of the GEMM has a step) the same quantizers' `with_stats` forms also measure what they do,
in the same pass (probes.py).
"""

from jax._src.lib.mlir.dialects import hlo

from xla_fp4.kernels import targets
from xla_fp4.numerics import kernel_twins
from xla_fp4.passes.policy import Form
from xla_fp4.passes.rewrite.context import peers
from xla_fp4.passes.rewrite.probes import device_rows_type
from xla_fp4.passes.rewrite.reuse import blocking
from xla_fp4.passes.rewrite.values import const, f32, scalar_type, tensor_type, u32


def scale_and_key(ctx, x, axis, operand, user):
  """The global decode scale of x (after the RHT where it applies) and the stochastic-rounding key, as the
  partitioned pattern computes them: per-block maxima (block-local, so each shard measures its own), then the twins
  kernel_twins.decode_scale (a plain max reduce, which XLA partitions into a scalar all-reduce) and
  digest_of_blocks (a sum of the per-block digests, all-reduced likewise) where no earlier dot `user` sees has
  digested x's elements (reuse.py)."""
  recipe = operand.recipe
  digest = ctx.reuse.digest(x, user) if recipe.stochastic else None
  # The key's digest comes from the same pass over x (the kernel's per-block digests): as a reduction of its own, XLA
  # CPU materialized x's bits as uint32 for it, and a GPU would read x once more (docs/design.md §8).
  measured = ctx.kernels.call(targets.BLOCK_AMAX, [x], dict(axis=axis, rht=recipe.rht, rht_seed=ctx.seed,
                                                             digest=recipe.stochastic and digest is None))
  s_dec = ctx.twins.call(kernel_twins.decode_scale, [measured[0]], [scalar_type(f32())], **peers(operand),
                         **_four_over_six(recipe))[0]
  salt = ctx.salt(operand)
  if not recipe.stochastic:
    return s_dec, salt
  if digest is None:
    digest = ctx.twins.call(kernel_twins.digest_of_blocks, [measured[1]], [scalar_type(u32())])[0]
    ctx.reuse.remember_digest(x, digest)
  return s_dec, hlo.XorOp(salt, digest).result


def operand(ctx, probe, x, axis, plan, user, form, select, after):
  """-> (q·scale in x's dtype, s_dec f32 scalar) of x quantized along `axis` per `plan` (an OperandPlan); with
  `select`, `stablehlo.select`s that give (x, 1.0) in kept iterations instead. `after`: the gradient's decode scale
  where the plan orders this operand after it."""
  blocks = blocking(tensor_type(x).shape, axis, plan.recipe)
  if plan.kept_recipe is not None and select is not None:  # kept iterations' MXFP8 blocks must agree too
    blocks += (blocking(tensor_type(x).shape, axis, plan.kept_recipe),)
  if plan.reusable:
    found = ctx.reuse.quantized(x, blocks, select, user)
    if found is not None:
      return found
  q, s_dec = _quantize(ctx, probe, x, axis, plan, form, after, user)
  if select is not None:
    measured = probe.row(q)
    # kept iterations: the operand itself, or its MXFP8 quantization (XLA_FP4_KEPT_FORMAT), whose scale is 1
    kept = x if plan.kept_recipe is None else _mx(ctx, x, axis, plan.kept_recipe, plan)
    q = hlo.SelectOp(select, kept, q).result
    probe.keep_row(q, measured)  # telemetry measures the quantization, in the iterations that run it
    s_dec = hlo.SelectOp(select, const(1.0, f32()), s_dec).result
  if plan.reusable:
    ctx.reuse.remember(x, blocks, select, q, s_dec)
  return q, s_dec


def mx_key(ctx, x, recipe, plan):
  """An MX quantizer's key: the salt, or with stochastic rounding the salt mixed with x's digest (stochastic_key)."""
  key = ctx.salt(plan)
  if recipe.stochastic:
    key = ctx.twins.call(kernel_twins.stochastic_key, [x, key], [scalar_type(u32())])[0]
  return key


def _mx(ctx, x, axis, recipe, plan):
  """q·scale of x in an MX format (numerics/mx.py): no tensor scale, so one kernel on whole tensors and on shards alike
  (its partitioner keeps 32-blocks and 32x32 tiles whole: sharding/partition.py)."""
  key = mx_key(ctx, x, recipe, plan)
  attrs = dict(axis=axis, block_2d=recipe.block_2d, stochastic=recipe.stochastic, rht=recipe.rht, rht_seed=ctx.seed,
               fp8=recipe.format == "mxfp8")
  return ctx.kernels.call(targets.MX_QDQ, [x, key], attrs)[0]


def _four_over_six(recipe):
  """The twins' `four_over_six` parameter where the recipe asks for it; none otherwise (the same twins as before)."""
  return dict(four_over_six=True) if recipe.four_over_six else {}


def _quantize(ctx, probe, x, axis, plan, form, after, user):
  recipe = plan.recipe
  if recipe.format != "nvfp4":
    return _mx(ctx, x, axis, recipe, plan), const(1.0, f32())
  attrs = dict(axis=axis, block_2d=recipe.block_2d, stochastic=recipe.stochastic, rht=recipe.rht, rht_seed=ctx.seed,
               four_over_six=recipe.four_over_six)
  # The quantizers measure what they do in recorded steps, in the same pass; Four Over Six's rows are the twins'.
  measuring = probe.step is not None and not recipe.four_over_six
  if form is Form.WHOLE_TENSOR:
    target, operands = targets.QDQ_WITH_SCALE, [x]
    if measuring:
      target, operands = target.with_stats, [x, probe.step]
    q, s_dec, *row = ctx.kernels.call(target, operands, dict(attrs, salt=ctx.salt_value(plan)))
    probe.keep_row(q, row[0] if row else None)
    return q, s_dec
  s_dec, key = scale_and_key(ctx, x, axis, plan, user)
  if after is not None and not recipe.stochastic:
    # Quantized where the backward reads it rather than held from the forward (docs/design.md §8).
    key = hlo.BitcastConvertOp(scalar_type(u32()), after).result
  if measuring and ctx.mesh is not None:
    # Each device's row of what the quantizer did to its shard, from the same pass (probes.py).
    q, rows = ctx.kernels.call(targets.QDQ.with_stats, [x, s_dec, key, probe.step], attrs,
                               result_types=[x.type, device_rows_type(ctx.mesh)], k_follows_dot=plan.k_follows_dot)
    probe.keep_row(q, rows)
    return q, s_dec
  q = ctx.kernels.call(targets.QDQ, [x, s_dec, key], dict(attrs, apply_global_scale=False),
                       k_follows_dot=plan.k_follows_dot)[0]
  return q, s_dec
