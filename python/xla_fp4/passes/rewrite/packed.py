"""The packed GEMM (Form.PACKED): E2M1 codes and E4M3 scales, K-major ("TN"), and the FP4 GEMM, which applies alpha =
s_dec_a * s_dec_b to its f32 accumulator and writes the dot's own output type (f32, bf16 or f16), as cuBLASLt's
epilogue does:

  %b(, %d) = xla_fp4_block_amax(%x); %s = decode_scale twin(%b); %key = ...     (quantize.scale_and_key)
  %codes, %scales = xla_fp4_quantize_packed(%x_read, %s, %key) {axis, block_2d, stochastic, rht, rht_seed}
  %y = xla_fp4_gemm_packed(%codes_a, %scales_a, %codes_b, %scales_b, %sa * %sb) {emulate, b_transposed}

Once every dot is rewritten, a value's quantizers along either axis become one xla_fp4_quantize_packed_pair (pairs.py).

Each operand is read as a matrix in place where its contracting dims lead or trail (`dims.as_read`: (K, rows) or
(rows, K), a reshape; else a K-major copy). Where K leads, the uint8 codes and scales are transposed, not the wide
operand: a pair of codes shares a byte along K either way, so XLA moves a tensor an eighth the size of a float32
K-major copy. The decode scales are taken as in Form.PARTITIONED (block maxima, then a max that XLA all-reduces), so
the form partitions (sharding/packed.py); in a partitioned program it is also the emulate backend's form, the GEMM's
`emulate` making shards dequantize and use XLA's dot. An operand whose plan has `tiles_alike` (a weight in 16x16
tiles with nearest rounding) is packed once: a dgrad takes its forward's codes as Bᵀ (`b_transposed`), so both GEMMs
read one value, which FSDP gathers once (reuse.py).

The MX formats (numerics/packing.py pack_mx) take the same pattern without a tensor scale: no block maxima, decode
scale or alpha; the key is the salt, or with stochastic rounding the stochastic_key twin's digest of x and the salt
(as quantize._mx); weights in 32x32 tiles (MXFP4) are packed once alike:

  %codes, %scales = xla_fp4_mx_quantize_packed(%x_read, %key) {axis, block_2d, stochastic, rht, rht_seed, fp8}
  %y = xla_fp4_mx_gemm_packed(%codes_a, %scales_a, %codes_b, %scales_b) {emulate, b_transposed, fp8}

With telemetry an MX operand is measured by its statistics twin (probes.py), as in the emulated forms.
"""

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

from xla_fp4.kernels import targets
from xla_fp4.passes.rewrite import dims
from xla_fp4.passes.rewrite import pairs
from xla_fp4.passes.rewrite import quantize
from xla_fp4.passes.rewrite.context import dtype_name
from xla_fp4.passes.rewrite.probes import device_rows_type
from xla_fp4.passes.rewrite.values import const, f32, tensor_type


def emit(ctx, probe, plan):
  """The value that replaces `plan`'s dot (its type)."""
  dot, (lc, rc) = plan.record.op, plan.site.gemm.contracting
  out_type = tensor_type(dot.results[0])
  y = fp4_gemm(ctx, probe, dot.operands[0], dot.operands[1], lc, rc, plan, out_type.element_type)
  return hlo.ReshapeOp(out_type, y).result


def fp4_gemm(ctx, probe, lhs, rhs, lc, rc, plan, element_type):
  """lhs x rhs (contracting lc with rc, no batch dims) as the FP4 GEMM -> (M, N) in `element_type`."""
  reshape = lambda v, shape: ctx.reuse.reshaped(v, shape, plan.record.op)  # noqa: E731
  operands = [dims.as_read(v, c, reshape) for v, c in ((lhs, lc), (rhs, rc))]  # (M, K) or (K, M); (N, K) or (K, N)
  # The decode scale and key read the operand as the program has it where K is one dim (the same blocks; the digest is
  # order-free): only the quantizer reads a K-major copy where one is made, which XLA then need not hold for them
  # (less temporary memory in every layout but tensor parallelism: docs/design.md §8).
  measured = [(v, c[0]) if len(c) == 1 else read for v, c, read in ((lhs, lc, operands[0]), (rhs, rc, operands[1]))]
  (pa, sa, ka), _ = _packed_tiles(ctx, probe, *operands[0], measured[0], plan.operands[0], plan.record.op, False)
  (pb, sb, kb), b_transposed = _packed_tiles(ctx, probe, *operands[1], measured[1], plan.operands[1], plan.record.op,
                                             True)
  for i, ((x, axis), s_dec, key, codes) in enumerate(zip(operands, (sa, sb), (ka, kb), (pa[0], pb[0]))):
    probe.measure(i, x=x, axis=axis, recipe=plan.operands[i].recipe, salt=ctx.salt_value(plan.operands[i]),
                  s_dec=s_dec, key=key, row=probe.row(codes))
  attrs = dict(emulate=ctx.emulate, b_transposed=b_transposed)
  fmt = plan.operands[0].recipe.format
  if fmt == "nvfp4":
    target, operands = targets.GEMM_PACKED, [*pa, *pb, hlo.MulOp(sa, sb).result]
  else:
    target, operands = targets.MX_GEMM_PACKED, [*pa, *pb]
    attrs["fp8"] = fmt == "mxfp8"
  dtype = dtype_name(ir.RankedTensorType.get([], element_type))  # the GEMM writes the dot's own output type
  return ctx.kernels.call(target, operands, attrs,
                          result_types=target.result_types([v.type for v in operands], attrs, dtype))[0]


def _packed_tiles(ctx, probe, x, axis, measured, operand, user, transposable):
  """(`_packed`'s result, whether its codes are Bᵀ): an operand whose plan has `tiles_alike` is packed once (reuse.py),
  and a later GEMM reads that copy, the rhs (`transposable`) also where it contracts the weight's other dim (a dgrad,
  as b_transposed: the same tiles hold the same codes along either axis)."""
  if not operand.tiles_alike:
    return _packed(ctx, probe, x, axis, measured, operand, user), False
  found = ctx.reuse.packed_tiles(x, user, None if transposable else axis)
  if found is not None:
    found_axis, packed, s_dec, key = found
    return (packed, s_dec, key), found_axis != axis
  packed, s_dec, key = _packed(ctx, probe, x, axis, measured, operand, user)
  ctx.reuse.remember_packed_tiles(x, axis, packed, s_dec, key)
  return (packed, s_dec, key), False


def _packed(ctx, probe, x, axis, measured, operand, user):
  """((codes, scales) K-major, s_dec, key) of the matrix x quantized along `axis` (dims.as_read); `measured`: (the
  same values, their K axis), from which the decode scale and the stochastic-rounding key are taken. Where K is x's
  first axis the codes and scales come (K/2, rows), (K/16, rows) and are transposed as bytes. An MX operand's s_dec is
  1 (it has none)."""
  recipe = operand.recipe
  attrs = dict(axis=axis, block_2d=recipe.block_2d, stochastic=recipe.stochastic, rht=recipe.rht, rht_seed=ctx.seed)
  row = None
  if recipe.format != "nvfp4":
    key = quantize.mx_key(ctx, measured[0], recipe, operand)
    packed = ctx.kernels.call(targets.MX_QUANTIZE_PACKED, [x, key], dict(attrs, fp8=recipe.format == "mxfp8"))
    s_dec = const(1.0, f32())
    return tuple(_k_major(packed, axis)), s_dec, key
  attrs["four_over_six"] = recipe.four_over_six
  s_dec, key = quantize.scale_and_key(ctx, *measured, operand, user)
  # Four Over Six's telemetry rows are the twins' (quantize.py)
  if probe.step is not None and not recipe.four_over_six and (ctx.mesh is not None or not ctx.kernels.partitioned):
    # The quantizer also measures what it does to x (each device to its shard), in the same pass.
    target = targets.QUANTIZE_PACKED.with_stats
    types = target.result_types([v.type for v in (x, s_dec, key, probe.step)], attrs)
    if ctx.mesh is not None:
      types[-1] = device_rows_type(ctx.mesh)
    *packed, row = ctx.kernels.call(target, [x, s_dec, key, probe.step], attrs, result_types=types)
  else:
    packed = ctx.kernels.call(targets.QUANTIZE_PACKED, [x, s_dec, key], attrs)
    ctx.packings.append(pairs.Packing(packed[0].owner.operation, x, axis, s_dec, key, attrs))
  packed = _k_major(packed, axis)
  probe.keep_row(packed[0], row)
  return tuple(packed), s_dec, key


def _k_major(packed, axis):
  """Codes and scales K-major: where K was x's first axis, transposed as bytes."""
  return [hlo.TransposeOp(v, ir.DenseI64ArrayAttr.get([1, 0])).result for v in packed] if axis == 0 else list(packed)
