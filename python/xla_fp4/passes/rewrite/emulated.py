"""The emulated GEMM (Form.WHOLE_TENSOR, Form.PARTITIONED): the program's dot_general on q·scale operands
(quantize.py), accumulated in f32, both decode scales folded into the output as cuBLASLt's alpha would be:

  %qa, %sa = <quantize.py: lhs>;  %qb, %sb = <quantize.py: rhs>
  %acc = stablehlo.dot_general %qa, %qb (the dot's dims and precision) -> f32
  %y   = convert(%acc * broadcast(%sa * %sb))                              (the dot's type)

and where the program's one reader of the dot transposes it to (rhs free, lhs free) (emit):

  %acc = stablehlo.dot_general %qb, %qa -> f32 (rhs free, lhs free)
  %y   = transpose(convert(%acc * broadcast(%sa * %sb)))                   (back to the dot's order)

One contracting dim per operand is quantized in place; several are merged first (dims.py): by a reshape where they
are adjacent and in order, else by a transpose to (batch, free, K). With a kept-iteration `select` (emitter.py) each
operand is selected between itself (s_dec = 1) and its q·scale: one GEMM per iteration, and a weight that a layout
all-gathers is gathered once, after the select, for every dot that reads it (docs/design.md §8).
"""

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

from xla_fp4.passes.policy import Operand
from xla_fp4.passes.rewrite import dims
from xla_fp4.passes.rewrite import quantize
from xla_fp4.passes.rewrite.probes import UNPROBED
from xla_fp4.passes.rewrite.values import broadcast, f32, tensor_type


def emit(ctx, probe, plan, select):
  """The value that replaces `plan`'s dot (its type). Where the program transposes the dot's (lhs free, rhs free)
  result to (rhs free, lhs free) (JAX's wgrad of a kernel: dot_general(dy, x), then a transpose to the kernel's
  shape), the GEMM is emitted with its operands swapped and transposed back: XLA then cancels the two transposes, as
  it folds the program's transpose into its own dot. Otherwise the multiply by alpha between them kept the transpose,
  which XLA fused into every reader (a strided read in each of AdamW's two moment updates: 3.4 ms against 0.6 ms per
  2048x512 kernel on the d512 step of benchmarks/pass_overhead.py)."""
  dot = plan.record.op
  back = _transpose_back(dot, plan.site.gemm)
  acc, alpha = _gemm(ctx, probe, plan, select, swapped=back is not None)
  out_type = tensor_type(dot.results[0])
  undo = lambda v: v if back is None else hlo.TransposeOp(v, ir.DenseI64ArrayAttr.get(back)).result  # noqa: E731
  if probe is not UNPROBED:
    probe.took_output(undo(acc), alpha)
  y = hlo.MulOp(acc, broadcast(alpha, tensor_type(acc))).result  # fold both s_dec into the f32 output
  if out_type.element_type != f32():
    y = hlo.ConvertOp(ir.RankedTensorType.get(tensor_type(acc).shape, out_type.element_type), y).result
  return undo(y)


def _transpose_back(dot, gemm):
  """The permutation from (rhs free, lhs free) back to the dot's (lhs free, rhs free) where the dot (no batch dims)
  has one reader, a transpose to (rhs free, lhs free); else None."""
  (lb, _), (lc, rc) = gemm.batch, gemm.contracting
  uses = list(dot.results[0].uses)
  if lb or len(uses) != 1 or uses[0].owner.name != "stablehlo.transpose":
    return None
  nl = len(tensor_type(dot.operands[0]).shape) - len(lc)
  nr = len(tensor_type(dot.operands[1]).shape) - len(rc)
  if list(ir.DenseI64ArrayAttr(uses[0].owner.attributes["permutation"])) != [*range(nl, nl + nr), *range(nl)]:
    return None
  return [*range(nr, nr + nl), *range(nr)]


def _gemm(ctx, probe, plan, select, swapped=False):
  """The dot_general on q·scale operands (with `select`, on the operands themselves in kept iterations),
  accumulated in f32 -> (acc, s_dec_a * s_dec_b); `swapped`: acc is the transpose, (rhs free, lhs free)."""
  dot, site = plan.record.op, plan.site
  (lc, rc), (lb, rb) = site.gemm.contracting, site.gemm.batch
  lhs, rhs = dot.operands[0], dot.operands[1]
  dimension_numbers = dot.attributes["dot_dimension_numbers"]
  if len(lc) == 1:
    la, ra = lc[0], rc[0]
  elif dims.adjacent(lc) and dims.adjacent(rc):
    lhs, rhs = (ctx.reuse.reshaped(v, dims.merged_shape(v, c), dot) for v, c in ((lhs, lc), (rhs, rc)))
    la, ra = lc[0], rc[0]
    dimension_numbers = hlo.DotDimensionNumbers.get(
        lhs_batching_dimensions=[dims.after_merge(d, lc) for d in lb],
        rhs_batching_dimensions=[dims.after_merge(d, rc) for d in rb],
        lhs_contracting_dimensions=[la], rhs_contracting_dimensions=[ra])
  else:
    lhs, rhs = dims.canonical(lhs, lb, lc), dims.canonical(rhs, rb, rc)
    la, ra = len(tensor_type(lhs).shape) - 1, len(tensor_type(rhs).shape) - 1
    batch = list(range(len(lb)))
    dimension_numbers = hlo.DotDimensionNumbers.get(
        lhs_batching_dimensions=batch, rhs_batching_dimensions=batch,
        lhs_contracting_dimensions=[la], rhs_contracting_dimensions=[ra])
  values, axes, quantized, after = (lhs, rhs), (la, ra), [None, None], None
  for i in plan.order:
    operand = plan.operands[i]
    quantized[i] = quantize.operand(ctx, probe, values[i], axes[i], operand, dot, plan.form, select,
                                    after if operand.after_gradient else None)
    probe.measure(i, x=values[i], axis=axes[i], recipe=operand.recipe, salt=ctx.salt_value(operand),
                  q=quantized[i][0], s_dec=quantized[i][1], row=probe.row(quantized[i][0]))
    if operand.kind is Operand.GRADIENT:
      after = quantized[i][1]
  (qa, sa), (qb, sb) = quantized
  shape = tensor_type(dot.results[0]).shape
  if not swapped:
    acc = f32_dot(ctx, dot, qa, qb, dimension_numbers, shape)
  else:
    dimension_numbers = hlo.DotDimensionNumbers.get(
        lhs_batching_dimensions=[], rhs_batching_dimensions=[], lhs_contracting_dimensions=[ra],
        rhs_contracting_dimensions=[la])
    nl = len(tensor_type(qa).shape) - 1  # one K per operand here
    acc = f32_dot(ctx, dot, qb, qa, dimension_numbers, [*shape[nl:], *shape[:nl]])
  return acc, hlo.MulOp(sa, sb).result


def f32_dot(ctx, dot, qa, qb, dimension_numbers, shape, shared=False):
  """dot_general(qa, qb) accumulated in f32 with `dot`'s precision. `shared`: an operand is a quantization other dots
  read too, which XLA CPU then reads in float32 in all of them (one convert)."""
  acc_type = ir.RankedTensorType.get(shape, f32())
  kwargs = {}
  if "precision_config" in dot.attributes:
    kwargs["precision_config"] = dot.attributes["precision_config"]
  if not ctx.matrix_gemm or tensor_type(qa).element_type == f32():
    return hlo.DotGeneralOp(acc_type, qa, qb, dimension_numbers, **kwargs).result
  reshape = lambda v, shape: ctx.reuse.reshaped(v, shape, dot)  # noqa: E731
  matrices = None if shared else dims.as_matrices(qa, qb, dimension_numbers, reshape)
  if matrices is None:
    # Not matrices without moving data (batch dims not leading, K inside or several K dims), or shared: the operands in
    # f32 (exact: q·scale fits), which XLA CPU multiplies in any layout. Transposing them to matrices would merge
    # contracting dims, and a merged K keeps only its outer dim's sharding (the inner one's was gathered); a shared
    # weight read as bf16 by one dot and in f32 by another was all-gathered twice under FSDP (docs/design.md §8).
    qa, qb = ctx.reuse.converted(qa, f32(), dot), ctx.reuse.converted(qb, f32(), dot)
    return hlo.DotGeneralOp(acc_type, qa, qb, dimension_numbers, **kwargs).result
  qa, qb, dimension_numbers, matrix_shape = matrices
  acc = hlo.DotGeneralOp(ir.RankedTensorType.get(matrix_shape, f32()), qa, qb, dimension_numbers, **kwargs).result
  return hlo.ReshapeOp(acc_type, acc).result  # (batch, lhs free, rhs free): the dot's own output order
