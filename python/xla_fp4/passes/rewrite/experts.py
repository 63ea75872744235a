"""Expert GEMMs (Form.GROUPED, Form.PACKED_GROUPED): numerics/grouped.py's twins lowered into the program, each
group (expert) quantized with its own decode scale (docs/design.md §2).

Form.GROUPED:
  a dot_general with group dims (Grouping.SLICES), e.g. on CPU a ragged dot's forward, which contracts the group dim G
  of %xg = select(%mask, broadcast(%x), 0) [G, M, K] and %w [G, K, N]:
                      %qx, %sx = slice_qdq(%xg, %salt) {groups = [0], axis = 2}   (%sx: f32[G], one per group)
                      %qw, %sw = slice_qdq(%w, %salt') {groups = [0], axis = 1, block_2d}
                      %acc = dot_general %qx, %qw, contracting_dims = [2, 0] x [1, 0] -> f32   (as the program's)
                      %y = masked_output(%acc, %mask, %sx, %sw)   (alpha of each row's group)
  an expert einsum (`ecd,edf->ecf`): the GEMM batched over the experts, %y = scaled_output(%acc, %sx, %sw)
  a chlo.ragged_dot:  %y = ragged_rows(%x, %w, %group_sizes, %salt, %salt')        (forward, dgrad)
                      %y = ragged_contracting(%x, %dy, %group_sizes, %salt, %salt') (wgrad)
  one ragged GEMM on the quantized operands inside, as many FLOPs as the original.
Form.PACKED_GROUPED (the native backend):
  with one group dim per operand, per expert e the operands' slices %x_e, %w_e packed with their own decode scales
  and %y_e = xla_fp4_gemm_packed -> f32 (packed.py); then the %y_e stacked along the expert dim (an einsum's batch
  dim) or summed in expert order (a contracted group dim), in the dot's type. A chlo.ragged_dot:
                      %a, %as, %b, %bs, %alpha = ragged_rows_packed(%x, %w, %group_sizes, %salt, %salt')
                      %y = xla_fp4_ragged_gemm_packed(%a, %as, %b, %bs, %group_sizes, %alpha) {ragged_k = false}
  (forward, dgrad); the wgrad's twin ragged_contracting_packed also returns its groups' padded sizes, which the GEMM
  takes with ragged_k = true (the groups split K) -> [G, K, N].
"""

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

from xla_fp4.kernels import targets
from xla_fp4.numerics import grouped
from xla_fp4.numerics import grouped_mx
from xla_fp4.numerics import telemetry
from xla_fp4.passes.analysis.records import Grouping
from xla_fp4.passes.rewrite import emulated
from xla_fp4.passes.rewrite import packed
from xla_fp4.passes.rewrite.context import dtype_name, peers
from xla_fp4.passes.rewrite.values import broadcast, const, f32, tensor_type


def slices(ctx, probe, plan, select):
  """A dot_general with group dims (Grouping.SLICES): every slice quantized with its own scale (slice_qdq); a ragged
  dot's CPU expansion (DotRecord.group_mask) then runs its GEMM as the program does, over the groups, and takes alpha
  per row (masked_output); other grouped dots run theirs with the group dims as batch dims and take alpha per group
  (scaled_output, which sums over group dims the program contracted). A group dim free in one operand (Groups.free:
  a dense MoE's up projection and its wgrad) stays free, its scales along the accumulator's dim. Only slices whose
  plan has `tiles_alike` (expert weights) are shared between dots; each dot quantizes its other operands."""
  dot, site = plan.record.op, plan.site
  groups = site.groups
  (lc, rc), (lb, rb) = site.gemm.contracting, site.gemm.batch
  contracted = [i for i, d in enumerate(lc) if d in groups.lhs]
  batch = (list(lb) + [lc[i] for i in contracted], list(rb) + [rc[i] for i in contracted])
  contracting = ([d for i, d in enumerate(lc) if i not in contracted],
                 [d for i, d in enumerate(rc) if i not in contracted])
  lhs_groups = [d for d in batch[0] if d in groups.lhs]
  free = [[d for side, d in groups.free if side == i] for i in (0, 1)]  # expert dims free in one operand
  group_dims = (lhs_groups + free[0], [batch[1][batch[0].index(d)] for d in lhs_groups] + free[1])
  quantized, shared = [None, None], False
  for i in plan.order:
    x, operand = dot.operands[i], plan.operands[i]
    q, s_dec, tiled = _slice_qdq(ctx, x, operand, group_dims[i], contracting[i], select, dot)
    shared = shared or tiled
    probe.measure(i, x=x, axis=contracting[i][0] if len(contracting[i]) == 1 else tuple(contracting[i]),
                  recipe=operand.recipe, salt=None, q=q, s_dec=s_dec, groups=tuple(group_dims[i]))
    if select is not None:
      q = hlo.SelectOp(select, x, q).result
      s_dec = hlo.SelectOp(select, broadcast(const(1.0, f32()), tensor_type(s_dec)), s_dec).result
    quantized[i] = (q, s_dec)
  (qa, sa), (qb, sb) = quantized
  out_type = tensor_type(dot.results[0])
  if contracted and plan.record.group_mask is not None and not lb:
    # A ragged dot's CPU expansion: one GEMM over the groups as the program has it, alpha per row (masked_output)
    i, mask = plan.record.group_mask
    acc = emulated.f32_dot(ctx, dot, qa, qb, dot.attributes["dot_dimension_numbers"], out_type.shape)
    return ctx.twins.call(grouped.masked_output, [acc, mask, sa, sb], [out_type],
                          group_dim=group_dims[i][0], contracted=tuple(contracting[i]), rows_first=i == 0,
                          dtype=dtype_name(out_type))[0]
  numbers = hlo.DotDimensionNumbers.get(
      lhs_batching_dimensions=batch[0], rhs_batching_dimensions=batch[1],
      lhs_contracting_dimensions=contracting[0], rhs_contracting_dimensions=contracting[1])
  # The accumulator's dims: the batch dims, then each operand's free dims (dot_general's order).
  acc_dims = [(0, d) for d in batch[0]] + [
      (i, d) for i, v in ((0, qa), (1, qb)) for d in range(len(tensor_type(v).shape))
      if d not in batch[i] and d not in contracting[i]]
  acc_shape = [tensor_type((qa, qb)[i]).shape[d] for i, d in acc_dims]
  acc = emulated.f32_dot(ctx, dot, qa, qb, numbers, acc_shape, shared=shared)

  def position(i, d):  # where each operand's scales go: paired group dims are batch dims (the lhs's), free ones its own
    return acc_dims.index((0, batch[0][batch[1].index(d)]) if i == 1 and d in batch[1] else (i, d))
  return ctx.twins.call(grouped.scaled_output, [acc, sa, sb], [out_type],
                        lhs_groups=tuple(position(0, d) for d in group_dims[0]),
                        rhs_groups=tuple(position(1, d) for d in group_dims[1]),
                        summed=tuple(len(lb) + j for j in range(len(contracted))),
                        dtype=dtype_name(out_type))[0]


def _slice_qdq(ctx, x, operand, group_dims, contracting, select, user):
  """(q·scale, per-slice s_dec, whether shared) of x quantized slice by slice along `contracting`. A 16x16-tiled
  matrix per slice quantizes alike along either of its dims: a dgrad reuses its fprop's expert weights (a second
  quantization was a second all-gather of the weights under FSDP: docs/design.md §8)."""
  shape, recipe = tensor_type(x).shape, operand.recipe
  scale_type = ir.RankedTensorType.get([shape[d] for d in group_dims], f32())
  tiled = operand.tiles_alike and len(shape) - len(group_dims) == 2
  blocks = ("slices", tuple(shape), tuple(group_dims)) if tiled else None
  found = ctx.reuse.quantized(x, blocks, select, user) if tiled else None
  if found is not None:
    return (*found, tiled)
  axis = contracting[0] if len(contracting) == 1 else tuple(contracting)
  q, s_dec = ctx.twins.call(grouped.slice_qdq, [x, ctx.salt(operand)], [x.type, scale_type],
                            groups=tuple(group_dims), block_2d=recipe.block_2d, axis=axis,
                            stochastic=recipe.stochastic, rht=recipe.rht, rht_seed=ctx.seed, **peers(operand),
                            **({"four_over_six": True} if recipe.four_over_six else {}))
  if tiled:
    ctx.reuse.remember(x, blocks, select, q, s_dec)
  return q, s_dec, tiled


def ragged(ctx, probe, plan):
  """A chlo.ragged_dot in the grouped recipe: one twin that quantizes per group and runs one ragged GEMM. In an MX
  format the twins of numerics/grouped_mx.py, whose block-local scales need no group's decode scale."""
  rows, operands, params = _ragged_operands(ctx, probe, plan)
  fn = _ragged_twins(plan.operands[0].recipe.format, rows)[0]
  return ctx.twins.call(fn, operands, [tensor_type(plan.record.op.results[0])], **params)[0]


def native_ragged(ctx, probe, plan):
  """A chlo.ragged_dot under the native backend: the twin that packs its operands as `ragged`'s quantizes them
  (numerics/grouped.py ragged_rows_packed, ragged_contracting_packed), then the grouped FP4 GEMM, which takes the
  group sizes at run time (xla_fp4_ragged_gemm_packed; the wgrad's groups split its K, in a layout of whole blocks
  per group)."""
  rows, operands, params = _ragged_operands(ctx, probe, plan)
  del params["dtype"]
  if rows:
    a, a_scales, b, b_scales, alpha = ctx.twins.call(grouped.ragged_rows_packed, operands, **params)
    sizes = operands[2]
  else:
    a, a_scales, b, b_scales, sizes, alpha = ctx.twins.call(grouped.ragged_contracting_packed, operands, **params)
  return ctx.kernels.call(targets.RAGGED_GEMM_PACKED, [a, a_scales, b, b_scales, sizes, alpha],
                          dict(ragged_k=not rows), result_types=[tensor_type(plan.record.op.results[0])])[0]


def _ragged_operands(ctx, probe, plan):
  """(whether the groups are the lhs's rows (forward, dgrad) rather than the contraction's (wgrad), the twin's
  operands: lhs, rhs, group sizes and the two salts, its parameters); telemetry measures them as the twin quantizes
  them (probes.py, in recorded steps)."""
  op, site = plan.record.op, plan.site
  lhs, rhs, sizes = op.operands
  recipes = {name: (o.recipe.block_2d, o.recipe.stochastic, o.recipe.rht) + ((True,) if o.recipe.four_over_six else ())
             for name, o in zip(("lhs_recipe", "rhs_recipe"), plan.operands)}  # Four Over Six: a 4th entry
  operands = [lhs, rhs, sizes] + [ctx.salt(o) for o in plan.operands]
  params = dict(rht_seed=ctx.seed, dtype=dtype_name(tensor_type(op.results[0])), **recipes, **peers(plan.operands[0]))
  rows = site.groups.kind is Grouping.RAGGED_ROWS
  fmt = plan.operands[0].recipe.format
  if fmt != "nvfp4":  # block-local scales: no peers' amax, the format named
    params = {k: v for k, v in params.items() if k != "peers"}
    params["fmt"] = fmt
  if rows:
    (lc, rc) = site.gemm.contracting
    params.update(lhs_contracting=lc[0], rhs_contracting=rc[0], rhs_group=site.groups.rhs[0])
  probe.measure(0, x=lhs, axis=None, recipe=plan.operands[0].recipe, salt=None, s_dec=None,
                ragged=(_ragged_twins(fmt, rows)[1], operands, dict(params)))
  return rows, operands, params


def _ragged_twins(fmt, rows):
  """(the twin of a chlo.ragged_dot in format `fmt`, its statistics twin): over groups of rows (forward, dgrad) or of
  K (wgrad); NVFP4's per-group scales (numerics/grouped.py) or an MX format's block-local ones (grouped_mx.py)."""
  if fmt == "nvfp4":
    return ((grouped.ragged_rows, telemetry.ragged_rows_stats) if rows
            else (grouped.ragged_contracting, telemetry.ragged_contracting_stats))
  return ((grouped_mx.ragged_rows, telemetry.mx_ragged_rows_stats) if rows
          else (grouped_mx.ragged_contracting, telemetry.mx_ragged_contracting_stats))


def native_per_expert(ctx, probe, plan):
  """An expert GEMM with one group dim per operand (Form.PACKED_GROUPED) as the FP4 GEMM once per expert: each
  expert's slices packed with their own decode scales (the per-expert scaling of numerics/grouped.py) and multiplied
  in f32; the products stacked along the group dim where it is a batch dim, summed in expert order where the program
  contracts it (a ragged dot's CPU expansion), then in the dot's output type."""
  dot, site = plan.record.op, plan.site
  (lc, rc), (gl, gr) = site.gemm.contracting, (site.groups.lhs[0], site.groups.rhs[0])
  out_type = tensor_type(dot.results[0])
  without = lambda dims_, g: [d - (d > g) for d in dims_ if d != g]  # noqa: E731
  products = []
  for e in range(tensor_type(dot.operands[0]).shape[gl]):
    y = packed.fp4_gemm(ctx, probe, _slice(dot.operands[0], gl, e), _slice(dot.operands[1], gr, e), without(lc, gl),
                        without(rc, gr), plan, f32())
    products.append(y)
  if gl in lc:
    total = products[0]
    for y in products[1:]:
      total = hlo.AddOp(total, y).result
  else:
    shape = tensor_type(products[0]).shape
    total = hlo.ConcatenateOp([hlo.ReshapeOp(ir.RankedTensorType.get([1] + shape, f32()), y).result
                               for y in products], 0).result
  total = hlo.ReshapeOp(ir.RankedTensorType.get(out_type.shape, f32()), total).result
  return total if out_type.element_type == f32() else hlo.ConvertOp(out_type, total).result


def _slice(x, dim, index):
  """x[..., index, ...] along `dim`, without that dim (a static slice)."""
  shape = list(tensor_type(x).shape)
  start, limit = [0] * len(shape), list(shape)
  start[dim], limit[dim] = index, index + 1
  piece = hlo.SliceOp(x, ir.DenseI64ArrayAttr.get(start), ir.DenseI64ArrayAttr.get(limit),
                      ir.DenseI64ArrayAttr.get([1] * len(shape))).result
  return hlo.ReshapeOp(ir.RankedTensorType.get(shape[:dim] + shape[dim + 1:], tensor_type(x).element_type),
                       piece).result
