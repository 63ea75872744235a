"""Telemetry probes: what the pass adds to an NVFP4 GEMM when the `telemetry` option is on (docs/design.md §7).

The emitter hands over, per operand, what it quantized (`Measure`s: the operand as quantized, its q·scale and decode
scale where they exist as tensors); `Probes.emit` then adds, after the GEMM's pattern:

  %block = the global block index (a scanned stack's iteration + its first block), else the static block or -1
  %step  = stablehlo.custom_call @xla_fp4_telemetry_step(%block) {module, site, every}   (-1: not recorded)
  %rows = stablehlo.case (%step >= 0 [and not a kept iteration]) {
    ^skip: stablehlo.return zeros
    ^record:
      one FIELDS row per operand (numerics/telemetry.py) and one for a wgrad's output (output_zeros),
               f32[3, FIELDS]: xla_fp4_qdq_stats(x, s_dec, key), the quantizer run again on x with the GEMM's own
               scale and key (bit-identical q, one read of x, no write); in a partitioned program the twins
               (operand_stats on x and the GEMM's q·scale), whose reductions XLA partitions; grouped operands:
               sliced_stats
  }
  stablehlo.custom_call @xla_fp4_telemetry_record(%rows, %step, %block) {module, site, strict_row}   (step -1: drops)

Nothing the program computes reads either call: its values are those of the run without telemetry, bit for bit. The
statistics are computed only in recorded steps (the case) and reach the host through the record call (no
synchronisation on CUDA: telemetry_kernels.cu). The twins are plain JAX reductions, so XLA's partitioner reduces a
sharded tensor's statistics across its shards; every device records the same rows.
"""

import dataclasses
from typing import Any, Optional

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

from xla_fp4.kernels import targets
from xla_fp4.numerics import kernel_twins
from xla_fp4.numerics import telemetry as stats
from xla_fp4.passes.analysis.records import Role
from xla_fp4.passes.policy import Operand
from xla_fp4.passes.rewrite.values import const, f32, scalar_type, tensor_type, u32

_ROW = len(stats.FIELDS)


@dataclasses.dataclass(frozen=True)
class Measure:
  """One quantization of an operand: x as quantized along `axis` per `recipe`, with decode scale `s_dec` and
  stochastic-rounding salt `salt`; `q` its q·scale where the program holds it (None in the native forms); `groups`:
  the group dims of a per-slice quantization (numerics/grouped.py slice_qdq; `s_dec` then one per slice)."""
  x: Any
  axis: Any
  recipe: Any  # policy.OperandRecipe
  salt: Any
  s_dec: Any
  q: Any = None
  groups: Optional[tuple] = None


@dataclasses.dataclass(frozen=True)
class Settings:
  module: int  # the module's key in the host's registry (xla_fp4/telemetry.py)
  every: int
  strict: bool


class Probes:
  def __init__(self, kernels, twins, seed, settings):
    self.kernels, self.twins, self.seed, self.settings = kernels, twins, seed, settings
    self.measured = []  # the sites that got probes

  def emit(self, plan, measures, output, block_value, select):
    """Probes for `plan`'s GEMM, whose operands were quantized as `measures` ([lhs Measures], [rhs Measures]) and
    whose result is `output`: the value, or an emulated GEMM's (f32 accumulator, alpha), from which the branch makes
    it (so that the result itself is not held for the branch, where XLA would otherwise fuse it into its readers);
    `block_value`: the stack's iteration (or None), `select`: true in kept iterations."""
    if not all(measures):
      return  # a form whose quantized values stay inside one twin (a chlo.ragged_dot's)
    site = plan.site
    i32 = ir.IntegerType.get_signless(32)
    if block_value is not None:
      block = block_value
      if tensor_type(block).element_type != i32:
        block = hlo.ConvertOp(scalar_type(i32), block).result
      block = hlo.AddOp(block, const(site.block_offset or 0, i32)).result
    else:
      block = const(-1 if site.block is None else site.block, i32)
    attrs = dict(module=self.settings.module, site=site.index)
    step = self.kernels.call(targets.TELEMETRY_STEP, [block], dict(attrs, every=self.settings.every))[0]
    record = hlo.CompareOp(step, const(0, i32), hlo.ComparisonDirectionAttr.get("GE")).result
    if select is not None:
      record = hlo.AndOp(record, hlo.NotOp(select).result).result
    # The case holds no side effect: it computes the statistics (zeros in unrecorded steps) and the record call, after
    # it, drops rows whose step is -1. A side-effecting op inside the case made XLA CPU order the case, and with it
    # the tensors it reads, among the program's other side effects: 5% of the step time in unrecorded steps, measured.
    table_type = ir.RankedTensorType.get([len(measures) + 1, _ROW], f32())
    case = hlo.CaseOp([table_type], hlo.SelectOp(record, const(1, i32), const(0, i32)).result, 2)
    with ir.InsertionPoint(case.regions[0].blocks.append()):
      hlo.ReturnOp([hlo.ConstantOp(ir.DenseElementsAttr.get_splat(table_type, ir.FloatAttr.get(f32(), 0.0))).result])
    with ir.InsertionPoint(case.regions[1].blocks.append()):
      rows = [self._row(m) for m in measures] + [self._output_row(plan, output)]
      row_type = ir.RankedTensorType.get([1, _ROW], f32())
      hlo.ReturnOp([hlo.ConcatenateOp([hlo.ReshapeOp(row_type, r).result for r in rows], 0).result])
    gradients = [i for i, o in enumerate(plan.operands) if o.kind is Operand.GRADIENT]
    strict_row = gradients[0] if self.settings.strict and gradients else -1
    self.kernels.call(targets.TELEMETRY_RECORD, [case.results[0], step, block], dict(attrs, strict_row=strict_row))
    self.measured.append(plan)

  def _row(self, measures):
    rows = [self._one_row(m) for m in measures]
    if len(rows) == 1:
      return rows[0]
    row_type = ir.RankedTensorType.get([1, _ROW], f32())
    table = hlo.ConcatenateOp([hlo.ReshapeOp(row_type, r).result for r in rows], 0).result
    return self.twins.call(stats.combine, [table], [_row_type()])[0]

  def _one_row(self, m):
    """The FIELDS row of one Measure: from the quantizer itself (xla_fp4_qdq_stats, which requantizes x in one read,
    bit-identical to the q the GEMM reads) where x is whole on the device; in a partitioned program from the twins,
    whose reductions XLA partitions (the statistics of the whole tensor)."""
    recipe = dict(block_2d=m.recipe.block_2d, rht=m.recipe.rht, rht_seed=self.seed)
    if m.groups is not None:
      return self.twins.call(stats.sliced_stats, [m.x, m.q, m.s_dec], [_row_type()], groups=m.groups, axis=m.axis,
                             **recipe)[0]
    key = m.salt
    if m.recipe.stochastic:
      key = self.twins.call(kernel_twins.stochastic_key, [m.x, m.salt], [scalar_type(u32())])[0]
    quantizer = dict(axis=m.axis, stochastic=m.recipe.stochastic, **recipe)
    if not self.kernels.partitioned:
      return self.kernels.call(targets.QDQ_STATS, [m.x, m.s_dec, key], quantizer)[0]
    if m.q is not None:
      return self.twins.call(stats.operand_stats, [m.x, m.q, m.s_dec], [_row_type()], axis=m.axis, **recipe)[0]
    return self.twins.call(stats.qdq_stats, [m.x, m.s_dec, key], [_row_type()], **quantizer)[0]

  def _output_row(self, plan, output):
    if plan.site.role is not Role.WGRAD:
      return hlo.ConstantOp(ir.DenseElementsAttr.get_splat(_row_type(), ir.FloatAttr.get(f32(), 0.0))).result
    if isinstance(output, tuple):
      dtype = targets.shape_dtype(plan.record.op.results[0].type).dtype.name
      return self.twins.call(stats.scaled_output_zeros, list(output), [_row_type()], dtype=dtype)[0]
    return self.twins.call(stats.output_zeros, [output], [_row_type()])[0]


def _row_type():
  return ir.RankedTensorType.get([_ROW], f32())
