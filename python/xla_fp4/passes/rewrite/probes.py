"""Telemetry probes: what the pass adds to an NVFP4 GEMM when the `telemetry` option is on (docs/design.md §7).

The emitter hands over, per operand, what it quantized (`Measure`s: the operand as quantized, its q·scale and decode
scale where they exist as tensors); `Probes.emit` then adds, after the GEMM's pattern:

  %block = the global block index (a scanned stack's iteration + its first block), else the static block or -1
  %step  = stablehlo.custom_call @xla_fp4_telemetry_step(%block) {module, site, every}   (-1: not recorded)
  stablehlo.case (%step >= 0 [and not a kept iteration]) {
    ^skip: stablehlo.return
    ^record:
      %rows  = numerics/telemetry.py twins, one FIELDS row per operand (operand_stats / sliced_stats /
               requantized_stats) and one for a wgrad's output (output_zeros), f32[3, FIELDS]
      stablehlo.custom_call @xla_fp4_telemetry_record(%rows, %step, %block) {module, site, strict_row}
  }

Nothing the program computes reads either call: its values are those of the run without telemetry, bit for bit. The
statistics are computed only in recorded steps (the case), from the tensors the GEMM reads, and reach the host
through the record call (no synchronisation on CUDA: telemetry_kernels.cu). The twins are plain JAX reductions, so
XLA's partitioner reduces a sharded tensor's statistics across its shards; every device records the same rows.
"""

import dataclasses
from typing import Any, Optional

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

from xla_fp4.kernels import targets
from xla_fp4.numerics import telemetry as stats
from xla_fp4.passes.analysis.records import Role
from xla_fp4.passes.policy import Operand
from xla_fp4.passes.rewrite.values import const, f32, scalar_type, tensor_type

_ROW = len(stats.FIELDS)


@dataclasses.dataclass(frozen=True)
class Measure:
  """One quantization of an operand: x as quantized along `axis`; `q`, `s_dec` its q·scale and decode scale (None
  where only the packed kernels hold them: the row requantizes x with `salt`); `groups`: per-slice scales."""
  x: Any
  axis: Any
  recipe: Any  # policy.OperandRecipe
  q: Any = None
  s_dec: Any = None
  salt: Any = None
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

  def emit(self, plan, measures, y, block_value, select):
    """Probes for `plan`'s GEMM, whose operands were quantized as `measures` ([lhs Measures], [rhs Measures]) and
    whose result is `y`; `block_value`: the stack's iteration (or None), `select`: true in kept iterations."""
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
    # The case returns the record call's result (unused) so that XLA's partitioner sees the call's sharding.
    case = hlo.CaseOp([step.type], hlo.SelectOp(record, const(1, i32), const(0, i32)).result, 2)
    with ir.InsertionPoint(case.regions[0].blocks.append()):
      hlo.ReturnOp([step])
    with ir.InsertionPoint(case.regions[1].blocks.append()):
      rows = [self._row(m) for m in measures] + [self._output_row(site, y)]
      row_type = ir.RankedTensorType.get([1, _ROW], f32())
      table = hlo.ConcatenateOp([hlo.ReshapeOp(row_type, r).result for r in rows], 0).result
      gradients = [i for i, o in enumerate(plan.operands) if o.kind is Operand.GRADIENT]
      strict_row = gradients[0] if self.settings.strict and gradients else -1
      hlo.ReturnOp(self.kernels.call(targets.TELEMETRY_RECORD, [table, step, block],
                                     dict(attrs, strict_row=strict_row)))
    self.measured.append(plan)

  def _row(self, measures):
    rows = [self._one_row(m) for m in measures]
    if len(rows) == 1:
      return rows[0]
    row_type = ir.RankedTensorType.get([1, _ROW], f32())
    table = hlo.ConcatenateOp([hlo.ReshapeOp(row_type, r).result for r in rows], 0).result
    return self.twins.call(stats.combine, [table], [_row_type()])[0]

  def _one_row(self, m):
    recipe = dict(block_2d=m.recipe.block_2d, rht=m.recipe.rht, rht_seed=self.seed)
    if m.q is None:
      return self.twins.call(stats.requantized_stats, [m.x, m.salt], [_row_type()], axis=m.axis,
                             stochastic=m.recipe.stochastic, **recipe)[0]
    if m.groups is not None:
      return self.twins.call(stats.sliced_stats, [m.x, m.q, m.s_dec], [_row_type()], groups=m.groups, axis=m.axis,
                             **recipe)[0]
    return self.twins.call(stats.operand_stats, [m.x, m.q, m.s_dec], [_row_type()], axis=m.axis, **recipe)[0]

  def _output_row(self, site, y):
    if site.role is Role.WGRAD:
      return self.twins.call(stats.output_zeros, [y], [_row_type()])[0]
    return hlo.ConstantOp(ir.DenseElementsAttr.get_splat(_row_type(), ir.FloatAttr.get(f32(), 0.0))).result


def _row_type():
  return ir.RankedTensorType.get([_ROW], f32())
