"""Telemetry probes: what the pass adds to an NVFP4 GEMM when the `telemetry` option is on (docs/design.md §7).

Before the GEMM's operands are quantized, `Probes.begin`:
  %step  = stablehlo.custom_call @xla_fp4_telemetry_step() {module, site, every, calls}   (-1: not recorded)
           (decided on the host; `calls`: a scanned stack's GEMM runs once per layer and step; -1 in kept iterations)
The forms then quantize with the step at hand and hand over, per operand, what they quantized (`Probe.measure`), and
`Probes.emit` adds after the GEMM's pattern:
  %rows  = f32[3, FIELDS] (numerics/telemetry.py): a row per operand and one for a wgrad's output zeros
  stablehlo.custom_call @xla_fp4_telemetry_record(%rows, %step, %block) {module, site, strict_row, parts = 1}
where the rows come, in a program whose tensors are whole on the device, from the kernels, which measure in the pass
in which they quantize and do nothing more in an unrecorded step:
  - %q, %s_dec, %row = xla_fp4_qdq_with_scale_stats(%x, %step)    (the emulated GEMM's whole-tensor form)
  - %codes, %scales, %row = xla_fp4_quantize_packed_stats(%x, %s_dec, %key, %step)   (the native forms, whose q·scale
    never exists as a tensor: the packed quantizer itself measures; a weight's packed tiles that its dgrad reuses
    bring their row along)
  - xla_fp4_output_stats(%y, %step) for a wgrad's output.
In a partitioned program (with a Shardy mesh over all devices) the same quantizers measure shards, and each device
contributes its own rows (sharding/partition.py, sharding/packed.py: replicas contribute zeros):
  %q, %rows_a = xla_fp4_qdq_and_stats(%x, %s_dec, %key, %step)                  (the partitioned quantizer)
  %codes, %scales, %rows_b = xla_fp4_quantize_packed_stats(%x, %s_dec, %key, %step)   (the native forms, on shards)
  %rows_y     = xla_fp4_output_stats(%y, %step)
  each f32[devices, FIELDS], split one row per device (a replica's kernel gets step -1: zeros)
  stablehlo.case(%step >= 0) {                                        (on CPU; on GPU unconditionally: Settings)
    %table = f32[devices, 3, FIELDS] of the rows (sdy.sharding_constraint: one row per device)
    xla_fp4_telemetry_record(%table, %step, %block) {parts = devices}  (each device records its row: its part)
  }
and the sink adds a GEMM's parts in device order once all are in (telemetry_sink.h AddPart): no collective. Where
the devices span several processes a process sees only its own parts, so the table is gathered for the record
instead (parts = 1; the record adds the gathered rows).
A chlo.ragged_dot's operands exist only inside its twin: twins of the grouped quantizers measure them
(numerics/telemetry.py ragged_rows_stats, ragged_contracting_stats), inside a case on the step.
Per-slice expert operands (and partitioned programs without a Shardy mesh) take the twins instead, inside a
stablehlo.case on the step: plain JAX reductions, which XLA partitions. (On XLA CPU such a case slows an unrecorded
step, as it holds the tensors it reads; the kernels' paths have none: docs/design.md §8.)

Nothing the program computes reads the statistics or either call: its values are those of the run without
telemetry, bit for bit. The rows reach the host through the record call, with no synchronisation on CUDA
(telemetry_kernels.cu); every device records the same rows, or its part of them.
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
from xla_fp4.passes.rewrite.dims import reshape_source
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
  # the statistics the quantizer itself computed, where it did: a FIELDS row (xla_fp4_qdq_with_scale_stats,
  # xla_fp4_quantize_packed_stats), or in a partitioned program [devices, FIELDS] (xla_fp4_qdq_and_stats,
  # xla_fp4_quantize_packed_stats)
  row: Any = None
  key: Any = None  # the stochastic-rounding key the quantizer took (the native forms'), where it took one
  # a chlo.ragged_dot's (statistics twin, its operands, its parameters): the twin's [2, FIELDS] rows are both
  # operands' as the GEMM's twin quantizes them (numerics/telemetry.py ragged_rows_stats, ragged_contracting_stats)
  ragged: Optional[tuple] = None


class Probe:
  """The telemetry of one GEMM while the forms build its pattern (Probes.begin), the one interface they call:
  `step`, the GEMM's telemetry step (int32, -1 where not recorded: the quantizers' `with_stats` forms take it), or
  None without telemetry (UNPROBED); `measure(i, ...)`, what operand i's quantizer did (a Measure); `took_output`,
  an emulated GEMM's (f32 accumulator, alpha), from which its output's statistics are made; `row` / `keep_row`, the
  statistics row a quantizer computed of a value, kept across GEMMs (a reused quantization brings its row along)."""

  def __init__(self, step, block, rows):
    self.step = step
    self.block = block  # int32: a scanned stack's iteration + its first block, else the static block or -1
    self.measures = ([], [])
    self.output = None
    self._rows = rows  # the Probes' q·scale value (or packed codes) -> its statistics row

  def measure(self, i, **measure):
    self.measures[i].append(Measure(**measure))

  def took_output(self, acc, alpha):
    self.output = (acc, alpha)

  def row(self, q):
    """The statistics row the quantizer of q computed, or None. A reuse reshapes an earlier q (a weight its dgrad reads
    with dims merged, as MaxText's attention projections): the same elements, the same row."""
    return self._rows.get(reshape_source(q))

  def keep_row(self, q, row):
    if row is not None:
      self._rows[q] = row


class _Unprobed(Probe):
  """No telemetry: no step, nothing measured or kept."""

  def __init__(self):
    super().__init__(None, None, {})

  def measure(self, i, **measure):
    pass

  def took_output(self, acc, alpha):
    pass

  def row(self, q):
    return None

  def keep_row(self, q, row):
    pass


UNPROBED = _Unprobed()


@dataclasses.dataclass(frozen=True)
class Settings:
  module: int  # the module's key in the host's registry (xla_fp4/telemetry.py)
  every: int
  strict: bool
  # A partitioned program's per-device rows: where all devices are this process's, each device records its own and
  # the sink adds them (no collective); else they are gathered for the record.
  one_process: bool = True
  # ... and its record sits in a conditional on the step: on CPU, where XLA orders side-effecting calls and an
  # unconditional record after each GEMM slowed unrecorded steps (docs/design.md §8); not on GPU, where a
  # conditional's predicate is read on the host, a synchronisation per GEMM and step.
  record_in_case: bool = True


def device_rows_type(mesh):
  """f32[devices, FIELDS]: a partitioned call's statistics, one row per device of `mesh` (sharding/device_rows.py)."""
  return ir.RankedTensorType.get([mesh.devices, _ROW], f32())


class Probes:
  def __init__(self, kernels, twins, seed, settings):
    self.kernels, self.twins, self.seed, self.settings = kernels, twins, seed, settings
    self.measured = []  # the sites that got probes
    self._rows = {}  # q·scale value (or packed codes) -> the statistics row its quantizer computed (Probe.row)

  def begin(self, plan, block_value, select):
    """The Probe of `plan`'s GEMM, its telemetry step taken before its operands are quantized.
    `block_value`: a scanned stack's iteration (or None), `select`: true in kept iterations, which record nothing."""
    site = plan.site
    i32 = ir.IntegerType.get_signless(32)
    if block_value is not None:
      block = block_value
      if tensor_type(block).element_type != i32:
        block = hlo.ConvertOp(scalar_type(i32), block).result
      block = hlo.MulOp(block, const(site.block_stride, i32)).result if site.block_stride != 1 else block
      block = hlo.AddOp(block, const(site.block_offset or 0, i32)).result
    else:
      block = const(-1 if site.block is None else site.block, i32)
    calls = (site.num_stacked or 1) if block_value is not None else 1  # a scanned GEMM runs once per layer and step
    step = self.kernels.call(targets.TELEMETRY_STEP, [], dict(module=self.settings.module, site=site.index,
                                                              every=self.settings.every, calls=calls))[0]
    if select is not None:
      step = hlo.SelectOp(select, const(-1, i32), step).result
    return Probe(step, block, self._rows)

  def emit(self, plan, probe, result):
    """The statistics and the record of `plan`'s GEMM, whose `probe` (begin) holds what its operands' quantizers did
    (probe.measures: [lhs Measures], [rhs Measures]) and, for an emulated GEMM, its (f32 accumulator, alpha), from
    which the statistics make its output (so that the result itself is not held for them, where XLA would otherwise
    fuse it into its readers); else its `result`. A partitioned program measures `result` itself: made again from the
    accumulator, XLA computed it a second time in every step, recorded or not (docs/design.md §8)."""
    site, step, measures, output = plan.site, probe.step, probe.measures, probe.output or result
    gradients = [i for i, o in enumerate(plan.operands) if o.kind is Operand.GRADIENT]
    strict_row = gradients[0] if self.settings.strict and gradients else -1
    attrs = dict(module=self.settings.module, site=site.index, strict_row=strict_row, parts=1)
    record = lambda table, **kw: self.kernels.call(  # noqa: E731
        targets.TELEMETRY_RECORD, [table, step, probe.block], dict(attrs, **kw))[0]
    if self.kernels.partitioned and self._per_device(measures):
      from xla_fp4.sharding import device_rows  # with the compiled kernels, as FfiKernels
      rows = self._device_rows(plan, measures, result, step)
      parts = self.kernels.mesh.devices if self.settings.one_process else 1
      table = lambda: device_rows.device_rows_constraint(self.kernels.mesh, _stacked_rows(rows))  # noqa: E731
      if self.settings.record_in_case:  # the table made and recorded in recorded steps only
        _when_recorded(step, step.type, lambda: record(table(), parts=parts), lambda: step)
      else:
        record(table(), parts=parts)
    else:
      # The twins where no kernel measured: expert operands, partitioned programs, and the quantizations that have no
      # measuring kernel (the MX formats, Four Over Six: no Measure.row)
      if self.kernels.partitioned or any(m.groups is not None or m.ragged or m.row is None for ms in measures
                                         for m in ms):
        table = self._computed_in_case(plan, measures, output, step)
      else:
        table = _stacked([self._kernel_row(ms) for ms in measures] + [self._output_row(plan, output, step)])
      record(table)
    self.measured.append(plan)

  def _per_device(self, measures):
    """Whether every operand was quantized once, by a partitioned quantizer that measured its shard per device
    (xla_fp4_qdq_and_stats, xla_fp4_quantize_packed_stats: a [devices, FIELDS] row)."""
    if getattr(self.kernels, "mesh", None) is None:
      return False
    return all(len(ms) == 1 and ms[0].groups is None and ms[0].row is not None
               and len(tensor_type(ms[0].row).shape) == 2 for ms in measures)

  def _device_rows(self, plan, measures, output, step):
    """The [devices, FIELDS] rows of a partitioned GEMM's operands (what each device's shards contribute, zeros on a
    replica: sharding/partition.py), then its output's zeros (a wgrad: `output`, the GEMM's result), or None."""
    rows = [ms[0].row for ms in measures]
    if plan.site.role is Role.WGRAD:
      rows.append(self.kernels.call(targets.OUTPUT_STATS, [output, step], {}, result_types=[rows[0].type])[0])
    else:
      rows.append(None)
    return rows

  def _kernel_row(self, measures):
    """An operand's row from the quantizer that measured it in its own pass (Measure.row: xla_fp4_qdq_with_scale_stats,
    xla_fp4_quantize_packed_stats), which measures nothing in an unrecorded step. Several Measures (per expert): one
    row."""
    rows = [m.row for m in measures]
    if any(r is None for r in rows):
      raise ValueError("telemetry: an operand of a whole-tensor GEMM was quantized without its statistics")
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
    slow XLA CPU's unrecorded steps: the kernels' path has no case.)"""
    table_type = ir.RankedTensorType.get([len(measures) + 1, _ROW], f32())
    return _when_recorded(step, table_type, lambda: self._twin_table(plan, measures, output),
                          lambda: _zeros(table_type))

  def _twin_table(self, plan, measures, output):
    """[operands + 1, FIELDS] from the twins (a ragged dot's both operands from one), then the output's row."""
    ragged = [m.ragged for ms in measures for m in ms if m.ragged]
    if ragged:  # both operands' rows from one twin
      fn, operands, params = ragged[0]
      pair = self.twins.call(fn, operands, [ir.RankedTensorType.get([2, _ROW], f32())], **params)[0]
      rows = [hlo.SliceOp(pair, ir.DenseI64ArrayAttr.get([i, 0]), ir.DenseI64ArrayAttr.get([i + 1, _ROW]),
                          ir.DenseI64ArrayAttr.get([1, 1])).result for i in (0, 1)]
    else:
      rows = [self._twin_row(ms) for ms in measures]
    if plan.site.role is Role.WGRAD:
      if isinstance(output, tuple):
        dtype = targets.shape_dtype(plan.record.op.results[0].type).dtype.name
        rows.append(self.twins.call(stats.scaled_output_zeros, list(output), [_row_type()], dtype=dtype)[0])
      else:
        rows.append(self.twins.call(stats.output_zeros, [output], [_row_type()])[0])
    else:
      rows.append(_zeros(_row_type()))
    return _stacked(rows)

  def _twin_row(self, measures):
    rows = []
    for m in measures:
      recipe = dict(block_2d=m.recipe.block_2d, rht=m.recipe.rht, rht_seed=self.seed)
      if m.recipe.format != "nvfp4":  # an MX format: q·scale and no tensor scale (numerics/telemetry.py)
        q = m.q
        if q is None:  # the packed form holds codes: the same q·scale from the quantizer's twin, in recorded steps
          q = self.twins.call(kernel_twins.mx_qdq, [m.x, m.key], [m.x.type], axis=m.axis,
                              stochastic=m.recipe.stochastic, fp8=m.recipe.format == "mxfp8", **recipe)[0]
        rows.append(self.twins.call(stats.mx_operand_stats, [m.x, q], [_row_type()], axis=m.axis,
                                    fmt=m.recipe.format, **recipe)[0])
      elif m.groups is not None:
        rows.append(self.twins.call(stats.sliced_stats, [m.x, m.q, m.s_dec], [_row_type()], groups=m.groups,
                                    axis=m.axis, **recipe)[0])
      elif m.q is not None:
        rows.append(self.twins.call(stats.operand_stats, [m.x, m.q, m.s_dec], [_row_type()], axis=m.axis,
                                    **recipe)[0])
      else:
        i32 = ir.IntegerType.get_signless(32)
        fos = dict(four_over_six=True) if m.recipe.four_over_six else {}  # the same twin as before otherwise
        rows.append(self.twins.call(stats.qdq_stats, [m.x, m.s_dec, const(0, i32), const(m.salt, u32())],
                                    [_row_type()], axis=m.axis, stochastic=m.recipe.stochastic, **recipe, **fos)[0])
    return rows[0] if len(rows) == 1 else self.twins.call(stats.combine, [_stacked(rows)], [_row_type()])[0]


def _stacked_rows(rows):
  """[devices, n, FIELDS] from n [devices, FIELDS] rows (None: zeros)."""
  devices = tensor_type(next(r for r in rows if r is not None)).shape[0]
  row_type = ir.RankedTensorType.get([devices, 1, _ROW], f32())
  return hlo.ConcatenateOp([_zeros(row_type) if r is None else hlo.ReshapeOp(row_type, r).result for r in rows],
                           1).result


def _when_recorded(step, result_type, build, otherwise):
  """A stablehlo.case on `step` that runs `build()` where it is >= 0 (a recorded step) and `otherwise()` else, each
  one value of `result_type`."""
  i32 = ir.IntegerType.get_signless(32)
  recorded = hlo.CompareOp(step, const(0, i32), hlo.ComparisonDirectionAttr.get("GE")).result
  case = hlo.CaseOp([result_type], hlo.SelectOp(recorded, const(1, i32), const(0, i32)).result, 2)
  with ir.InsertionPoint(case.regions[0].blocks.append()):
    hlo.ReturnOp([otherwise()])
  with ir.InsertionPoint(case.regions[1].blocks.append()):
    hlo.ReturnOp([build()])
  return case.results[0]


def _stacked(rows):
  """[n, FIELDS] from n FIELDS rows."""
  row_type = ir.RankedTensorType.get([1, _ROW], f32())
  return hlo.ConcatenateOp([hlo.ReshapeOp(row_type, r).result for r in rows], 0).result


def _zeros(tensor_type_):
  return hlo.ConstantOp(ir.DenseElementsAttr.get_splat(tensor_type_, ir.FloatAttr.get(f32(), 0.0))).result


def _row_type():
  return ir.RankedTensorType.get([_ROW], f32())
