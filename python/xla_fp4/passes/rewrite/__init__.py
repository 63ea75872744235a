"""Rewrite: apply the plans (policy.Plan), one per NVFP4 dot, to the module; decides nothing.

Before (fprop of a linear layer):
  %y = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<8x32xbf16>, tensor<32x64xbf16>) -> ...
After (Form.WHOLE_TENSOR; emitter.py shows every form):
  %qx, %sx = stablehlo.custom_call @xla_fp4_qdq_with_scale(%x) {axis, block_2d, stochastic, rht, rht_seed, salt}
  %qw, %sw = ... the same for %w ...
  %acc = stablehlo.dot_general %qx, %qw (same dims and precision) -> f32
  %y   = convert(%acc * (%sx * %sw))
The dot is erased; its uses read %y (same type). Where a scanned stack's block index is visible only at the call of
the dot's function (BlockIndex.PASSED_IN), the function gets it as an extra argument, once per function and call;
a shard_map body around the dot gets it as an operand (scope.py).

  emitter.py      dispatch on the plan's form; the kept-iteration select or case around it
  quantize.py     dense operand quantization (q·scale and its decode scale)
  emulated.py     the emulated GEMM (Form.WHOLE_TENSOR, Form.PARTITIONED)
  packed.py       the packed FP4 GEMM (Form.PACKED)
  cases.py        a scanned stack's kept-iteration cases that select alike merged, once every dot is rewritten
  pairs.py        then a value's row-wise and column-wise packed copies from one read
  hoist.py        moving the pure ops that compute some values above an op (for both)
  experts.py      expert GEMMs (Form.GROUPED, Form.PACKED_GROUPED)
  probes.py       the telemetry of one dot (the `telemetry` option): the Probe the forms report to
  context.py      what the forms share: kernels, twins, seed, reuse
  kernel_sets.py  FFI custom calls or lowered twins
  reuse.py        quantizations, reshapes and selectors shared between dots
  dims.py         operand layouts (merged contracting dims, K-major matrices)
  scope.py        values brought into functions and shard_map bodies; the isolation check before the verifier
  values.py       small MLIR value builders
"""

from jax._src.lib.mlir import ir

from xla_fp4.passes.analysis.records import BlockIndex
from xla_fp4.passes.rewrite import cases, pairs
from xla_fp4.passes.rewrite.emitter import Emitter
from xla_fp4.passes.rewrite.kernel_sets import FfiKernels, KernelSet, ReferenceKernels, Twins
from xla_fp4.passes.rewrite.probes import Probes, Settings
from xla_fp4.passes.rewrite.scope import bodies_to_check, into_shard_maps, isolation_violations, plumb_block_value

__all__ = ["Emitter", "FfiKernels", "KernelSet", "ReferenceKernels", "Settings", "Twins", "apply"]


def apply(module, plans, kernel_set, *, seed, matrix_gemm=False, emulate=False, platform=None, telemetry=None,
          verify=True):
  """Rewrite every planned dot of `module` (in place, in program order) with `kernel_set`; the module must verify
  after. `verify`: verify it here (the strict option: the error is then raised in the pass); else its first
  verification is jax's, which verifies every module it compiles (the pass pipeline that makes its cache key), and
  the hook compiles the original when that fails (tests/passes/test_end_to_end.py); verifying a 12-block step took a
  seventh of the pass's time (benchmarks/pass_overhead.py). `matrix_gemm`: emit emulated GEMMs as plain matrices
  where XLA CPU needs them (Emitter). `emulate`: the packed GEMMs (Form.PACKED) run emulated on each device (the
  emulate backend of a partitioned program). `platform`: JAX's name of the platform the twins are lowered for
  (Twins). `telemetry`: probes.Settings, which add the telemetry probes (probes.py) to every GEMM; returns the plans
  that got them."""
  twins = Twins(module, platform)
  probes = None if telemetry is None else Probes(kernel_set, twins, seed, telemetry)
  emitter = Emitter(kernel_set, twins, seed, matrix_gemm=matrix_gemm, emulate=emulate, probes=probes)
  passed_in = {}  # (function, id of the entry call) -> the block index inside the function
  replacements = []
  for plan in plans:
    dot = plan.record.op
    # Probes number a scanned stack's records by iteration, so they read the block index where no select does.
    source = plan.block_source or (plan.record.block_source if probes is not None else None)
    y = emitter.emit(plan, _block_value(module, plan, source, passed_in))
    dot.results[0].replace_all_uses_with(y)
    dot.erase()
    replacements.append(y)
  # The verifier has crashed the process on a use across an isolated region (scope.py): such a module is refused first.
  # Where block indices were plumbed into functions, every function is checked; otherwise the shard_map bodies around
  # the rewritten dots, the only isolated regions the rewrite's ops can sit in (checking every op of a 12-block step
  # took half the pass's time). Found before cases.py erases the cases that some replacements are results of; it and
  # pairs.py move ops within their blocks only.
  if passed_in:
    scope = [op for op in module.body.operations if op.operation.name == "func.func"]
  else:
    scope = bodies_to_check(replacements)
  cases.merge(emitter.ctx.cases)  # a stack's kept-iteration cases that select alike, in one where independent
  pairs.fuse(kernel_set, emitter.ctx.packings)  # one read of a value for both its packed copies
  bad = isolation_violations(scope)
  if bad:
    raise RuntimeError("xla_fp4 built a module that reads values across an isolated region: " + "; ".join(bad))
  if verify and not module.operation.verify():
    raise RuntimeError("xla_fp4 produced a module that does not verify")
  return [] if probes is None else probes.measured


def _block_value(module, plan, source, passed_in):
  """The iteration's block index from `source` where the dot can read it (None: not per iteration)."""
  if source is None or source.kind is BlockIndex.UNAVAILABLE:
    return None
  if source.kind is BlockIndex.IN_SCOPE:
    return into_shard_maps(source.value, plan.record.op)
  key = (plan.site.func, id(source.entry_call))
  if key not in passed_in:
    passed_in[key] = plumb_block_value(source.value, source.entry_call, _func(module, plan.site.func))
  return into_shard_maps(passed_in[key], plan.record.op)


def _func(module, name):
  return next(op.operation for op in module.body.operations
              if op.operation.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == name)
