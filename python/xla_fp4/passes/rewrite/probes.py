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
    whose result is `output`: the value, or an emulated GEMM's (f32 accumulator, alpha), from which the statistics
    make it (so that the result itself is not held for them, where XLA would otherwise fuse it into its readers);
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
    calls = (site.num_stacked or 1) if block_value is not None else 1  # a scanned GEMM runs once per layer and step
    step = self.kernels.call(targets.TELEMETRY_STEP, [], dict(attrs, every=self.settings.every, calls=calls))[0]
    if select is not None:  # a kept iteration records nothing
      step = hlo.SelectOp(select, const(-1, i32), step).result
    if self.kernels.partitioned or any(m.groups is not None for ms in measures for m in ms):
      table = self._computed_in_case(plan, measures, output, step)
    else:
      rows = [self._kernel_row(ms, step) for ms in measures] + [self._output_row(plan, output, step)]
      table = _stacked(rows)
    gradients = [i for i, o in enumerate(plan.operands) if o.kind is Operand.GRADIENT]
    strict_row = gradients[0] if self.settings.strict and gradients else -1
    self.kernels.call(targets.TELEMETRY_RECORD, [table, step, block], dict(attrs, strict_row=strict_row))
    self.measured.append(plan)

  def _kernel_row(self, measures, step):
    """An operand's row from the quantizer itself (xla_fp4_qdq_stats: x requantized with the GEMM's scale and key,
    bit-identical, one read of x; nothing in an unrecorded step). Several Measures (per expert): one row."""
    rows = []
    for m in measures:
      attrs = dict(axis=m.axis, block_2d=m.recipe.block_2d, stochastic=m.recipe.stochastic, rht=m.recipe.rht,
                   rht_seed=self.seed, salt=m.salt)
      rows.append(self.kernels.call(targets.QDQ_STATS, [m.x, m.s_dec, step], attrs)[0])
    return rows[0] if len(rows) == 1 else self.twins.call(stats.combine, [_stacked(rows)], [_row_type()])[0]

  def _output_row(self, plan, output, step):
    if plan.site.role is not Role.WGRAD:
      return _zeros(_row_type())
    if isinstance(output, tuple):  # an emulated GEMM's (acc, alpha): its output, made where it is measured
      dtype = targets.shape_dtype(plan.record.op.results[0].type).dtype.name
      output = self.twins.call(stats.scaled_output, list(output), [plan.record.op.results[0].type], dtype=dtype)[0]
    return self.kernels.call(targets.OUTPUT_STATS, [output, step], {})[0]

  def _computed_in_case(self, plan, measures, output, step):
    """The rows from the twins (plain JAX reductions, which XLA partitions: a sharded tensor's statistics are the
    whole tensor's), inside a stablehlo.case on the step, which computes nothing in an unrecorded step. (Its captures
    cost XLA CPU 5% of an unrecorded step, measured: the kernels' path has no case.)"""
    i32 = ir.IntegerType.get_signless(32)
    recorded = hlo.CompareOp(step, const(0, i32), hlo.ComparisonDirectionAttr.get("GE")).result
    table_type = ir.RankedTensorType.get([len(measures) + 1, _ROW], f32())
    case = hlo.CaseOp([table_type], hlo.SelectOp(recorded, const(1, i32), const(0, i32)).result, 2)
    with ir.InsertionPoint(case.regions[0].blocks.append()):
      hlo.ReturnOp([_zeros(table_type)])
    with ir.InsertionPoint(case.regions[1].blocks.append()):
      rows = [self._twin_row(ms) for ms in measures]
      if plan.site.role is Role.WGRAD:
        if isinstance(output, tuple):
          dtype = targets.shape_dtype(plan.record.op.results[0].type).dtype.name
          rows.append(self.twins.call(stats.scaled_output_zeros, list(output), [_row_type()], dtype=dtype)[0])
        else:
          rows.append(self.twins.call(stats.output_zeros, [output], [_row_type()])[0])
      else:
        rows.append(_zeros(_row_type()))
      hlo.ReturnOp([_stacked(rows)])
    return case.results[0]

  def _twin_row(self, measures):
    rows = []
    for m in measures:
      recipe = dict(block_2d=m.recipe.block_2d, rht=m.recipe.rht, rht_seed=self.seed)
      if m.groups is not None:
        rows.append(self.twins.call(stats.sliced_stats, [m.x, m.q, m.s_dec], [_row_type()], groups=m.groups,
                                    axis=m.axis, **recipe)[0])
      elif m.q is not None:
        rows.append(self.twins.call(stats.operand_stats, [m.x, m.q, m.s_dec], [_row_type()], axis=m.axis,
                                    **recipe)[0])
      else:
        i32 = ir.IntegerType.get_signless(32)
        rows.append(self.twins.call(stats.qdq_stats, [m.x, m.s_dec, const(0, i32), const(m.salt, u32())],
                                    [_row_type()], axis=m.axis, stochastic=m.recipe.stochastic, **recipe)[0])
    return rows[0] if len(rows) == 1 else self.twins.call(stats.combine, [_stacked(rows)], [_row_type()])[0]


def _stacked(rows):
  """[n, FIELDS] from n FIELDS rows."""
  row_type = ir.RankedTensorType.get([1, _ROW], f32())
  return hlo.ConcatenateOp([hlo.ReshapeOp(row_type, r).result for r in rows], 0).result


def _zeros(tensor_type_):
  return hlo.ConstantOp(ir.DenseElementsAttr.get_splat(tensor_type_, ir.FloatAttr.get(f32(), 0.0))).result


def _row_type():
  return ir.RankedTensorType.get([_ROW], f32())
