"""The emitter: the NVFP4 pattern of one planned dot (policy.Plan) at the dot, returning the value that replaces it.
It dispatches on the plan's form to the module that builds it, and holds the one thing around every form: the
per-iteration choice of a scanned stack with kept blocks.

  Form.WHOLE_TENSOR, Form.PARTITIONED    emulated.py (operands: quantize.py)
  Form.PACKED                            packed.py
  Form.GROUPED, Form.PACKED_GROUPED      experts.py
  telemetry (the `telemetry` option)     probes.py: Probes.begin before the operands are quantized, the forms report
                                         to its Probe, Probes.emit after the GEMM

Per-iteration select of a scanned stack with kept blocks (`block_value` is the iteration's block index): in the
emulated forms a `stablehlo.select` per operand gives the GEMM the operand itself (and s_dec = 1) in kept iterations
and its q·scale in the others: one GEMM per iteration, and a weight that a layout all-gathers is gathered once, after
the select, for every dot that reads it (a case around the whole dot made each dot gather its weight in its own
branch: docs/design.md §8). The packed and ragged forms hold the original dot and the FP4 pattern in the two branches
of a `stablehlo.case`:

  %kept = %block == b0 or %block == b1 ...
  %y = stablehlo.case(select(%kept, 0, 1)) {mhlo.frontend_attributes = {xla_fp4_branch_runs = "kept,other"}}
         { the original dot }, { the pattern }
"""

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

from xla_fp4.passes.analysis.records import Grouping
from xla_fp4.passes.policy import Form
from xla_fp4.passes.rewrite import emulated
from xla_fp4.passes.rewrite import experts
from xla_fp4.passes.rewrite import packed
from xla_fp4.passes.rewrite.context import Context
from xla_fp4.passes.rewrite.probes import UNPROBED
from xla_fp4.passes.rewrite.values import const, tensor_type
from xla_fp4.sharding.cost import BRANCH_RUNS


class Emitter:
  def __init__(self, kernels, twins, seed, matrix_gemm=False, emulate=False, probes=None):
    self.ctx = Context(kernels, twins, seed, matrix_gemm=matrix_gemm, emulate=emulate)
    self.probes = probes  # probes.Probes where the telemetry option is on

  def emit(self, plan, block_value=None):
    """Insert `plan`'s pattern before its dot; returns the value that replaces the dot's result (same type)."""
    ctx, dot, site, keep_blocks = self.ctx, plan.record.op, plan.site, plan.decision.keep_blocks
    with ir.InsertionPoint(dot), ir.Location.name(f"xla_fp4/{site.layer or 'dot'}/{site.role}", dot.location):
      select = None
      if keep_blocks and block_value is not None:
        select = ctx.reuse.selector(block_value, keep_blocks, dot, lambda: _kept(block_value, keep_blocks))
      # Telemetry: the step is taken here, before the operands are quantized (whose kernels measure in recorded steps)
      # and outside a kept-iteration case (so that every iteration counts).
      probe = UNPROBED if self.probes is None else self.probes.begin(plan, block_value, select)
      runs = (len(keep_blocks), site.num_stacked - len(keep_blocks)) if select is not None else None

      def probed(build):
        y = build(ctx, probe)
        if probe is not UNPROBED:
          self.probes.emit(plan, probe, result=y)
        return y

      if plan.form is Form.PACKED_GROUPED:
        native = experts.native_per_expert if site.groups.kind is Grouping.SLICES else experts.native_ragged
        return _in_case(ctx, select, runs, dot, lambda: probed(lambda c, p: native(c, p, plan)))
      if plan.form is Form.GROUPED and site.groups.kind is Grouping.SLICES:
        return probed(lambda c, p: experts.slices(c, p, plan, select))
      if plan.form is Form.GROUPED:
        return _in_case(ctx, select, runs, dot, lambda: probed(lambda c, p: experts.ragged(c, p, plan)))
      if plan.form is not Form.PACKED:
        return probed(lambda c, p: emulated.emit(c, p, plan, select))
      return _in_case(ctx, select, runs, dot, lambda: probed(lambda c, p: packed.emit(c, p, plan)))


def _in_case(ctx, select, runs, dot, build):
  """`build()`, or with `select` a stablehlo.case that runs the original op in kept iterations and `build()`'s pattern
  in the others. `runs` (kept, other iterations of the stack) goes with the case as the frontend attribute
  BRANCH_RUNS, so that a cost model of the compiled step weights each branch by how often it runs (sharding/cost.py)
  rather than taking the dearer one: a kept branch gathers its weight at full width. The case goes into ctx.cases,
  which cases.py merges once every dot is rewritten."""
  if select is None:
    return build()
  i32 = ir.IntegerType.get_signless(32)
  case = hlo.CaseOp([dot.results[0].type], hlo.SelectOp(select, const(0, i32), const(1, i32)).result, 2)
  case.attributes["mhlo.frontend_attributes"] = ir.DictAttr.get(
      {BRANCH_RUNS: ir.StringAttr.get(",".join(str(n) for n in runs))})
  with ir.InsertionPoint(case.regions[0].blocks.append()):
    hlo.ReturnOp([dot.operation.clone().results[0]])
  with ir.InsertionPoint(case.regions[1].blocks.append()):
    hlo.ReturnOp([build()])
  ctx.cases.append((case.operation, select))
  return case.results[0]


def _kept(block, keep_blocks):
  """Whether `block` is one of `keep_blocks` (high precision): an i1 scalar."""
  etype = tensor_type(block).element_type
  kept = None
  for b in keep_blocks:
    c = hlo.CompareOp(block, const(b, etype), hlo.ComparisonDirectionAttr.get("EQ")).result
    kept = c if kept is None else hlo.OrOp(kept, c).result
  return kept
