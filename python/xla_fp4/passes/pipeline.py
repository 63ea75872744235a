"""The pass pipeline, entry point of the compile hook: clone -> one copy per call site -> analyze -> decide -> plan ->
rewrite -> dump. Each phase is a package or module of its own (analysis/, policy.py, backend.py, rewrite/); this
one only drives them.

`transform` never mutates the module it is given (JAX keeps it for `Lowered.as_text()` and cache keys); it returns a
fresh module, or the original when nothing was selected. Errors are the caller's business (hook.py falls back and
warns).
"""

import contextlib
import dataclasses
import gc
import json
import os

import jax
from jax._src.lib.mlir import ir

from xla_fp4 import notice
from xla_fp4 import report
from xla_fp4 import state
from xla_fp4 import telemetry
from xla_fp4.config import Config
from xla_fp4.passes import analysis as analysis_mod
from xla_fp4.passes import policy
from xla_fp4.passes import rewrite
from xla_fp4.passes.backend import choose_backend, is_cpu, is_cuda, lowering_platform


@dataclasses.dataclass
class Result:
  module: ir.Module
  rows: list  # decision rows (report.py format)
  unmatched_rules: list
  changed: bool
  blocks: tuple = ()  # how the blocks were found (Analysis.blocks_found)
  num_blocks: int = 0
  backend: dict = None  # Backend.describe() when anything was rewritten


def clone_module(module: ir.Module) -> ir.Module:
  """A fresh ModuleOp holding clones of the top-level ops (cloning the ModuleOp itself gives one XLA rejects)."""
  with module.context, module.operation.location:
    new = ir.Module.create()
    attrs = module.operation.attributes
    for i in range(len(attrs)):
      named = attrs[i]
      new.operation.attributes[named.name] = named.attr
    for op in module.body.operations:
      new.body.append(op.clone())
  return new


def module_name(module) -> str:
  return ir.StringAttr(module.operation.attributes["sym_name"]).value if "sym_name" in module.operation.attributes \
      else "module"


def num_partitions(module) -> int:
  """How many SPMD partitions the module runs as (jit's mhlo.num_partitions; 1 when absent)."""
  attrs = module.operation.attributes
  return ir.IntegerAttr(attrs["mhlo.num_partitions"]).value if "mhlo.num_partitions" in attrs else 1


def _analyze_and_decide(module, config):
  graph = analysis_mod.specialize_call_sites(module)
  analysis = analysis_mod.analyze(module, graph)
  decided, unmatched = policy.decide(analysis, config)
  return analysis, decided, unmatched


def decisions(module: ir.Module, config: Config):
  """Analyze and decide only: (decision rows, unmatched rule names, how the blocks were found)."""
  module = clone_module(module)
  with module.context, ir.Location.unknown():
    analysis, decided, unmatched = _analyze_and_decide(module, config)
    return report.rows(analysis.sites, decided), unmatched, analysis.blocks_found


@contextlib.contextmanager
def _collector_paused():
  """Python's cyclic garbage collector off for the pass: the pass allocates binding objects by the hundred thousand,
  which set the collector off every few hundred, and its older generations' collections walk every object of the
  process (4-9% of the pass's time on benchmarks/pass_overhead.py's step). What the pass leaves for it, it collects
  once afterwards (0.1 ms there)."""
  enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if enabled:
      gc.enable()


def transform(module: ir.Module, config: Config, platform: str = "cpu", kernels=None) -> Result:
  """Rewrite a clone of `module`. `kernels(module) -> KernelSet` overrides the per-platform choice."""
  with _collector_paused():
    return _transform(module, config, platform, kernels)


def _transform(module, config, platform, kernels):
  new = clone_module(module)
  with new.context, ir.Location.unknown():
    analysis, decided, unmatched = _analyze_and_decide(new, config)
    changed = any(d.decision is not policy.Verdict.KEEP for d in decided)
    plans, backend = [], None
    if changed:
      partitions = num_partitions(new)
      partitioned = partitions > 1
      backend = choose_backend(config, platform, new, kernels, partitioned=partitions)
      plans = policy.plan(analysis, decided, partitioned=partitioned, native=backend.gemm == "native",
                          cuda=is_cuda(platform), packed=backend.kernel_set.has_packed and config.packed_gathers)
      settings = _telemetry(config, backend, platform, (
          module_name(new), config.telemetry, platform, partitions, backend.kernels, backend.gemm,
          tuple((p.site.index, p.site.layer, str(p.site.role), p.site.block, str(p.form)) for p in plans)))
      probed = rewrite.apply(new, plans, backend.kernel_set, seed=config.seed, matrix_gemm=is_cpu(platform),
                             emulate=backend.gemm != "native",
                             platform=lowering_platform(platform), telemetry=settings, verify=config.strict)
      for p in probed:
        telemetry.register_site(settings.module, p.site.index, telemetry.Site(
            directory=config.telemetry, module=module_name(new), layer=p.site.layer, role=str(p.site.role),
            operands=tuple(str(o.kind) for o in p.operands), underflow=config.telemetry_underflow,
            snr_db=config.telemetry_snr_db,
            format=str(p.decision.decision) + ("+4/6" if p.decision.lhs.four_over_six else "")),
            f"{p.site.layer or 'a GEMM'} ({p.site.role}, module {module_name(new)})")
    notes = {p.site.index: "; ".join(p.notes) for p in plans if p.notes}
    rows = report.rows(analysis.sites, decided, notes)
  return Result(module=new if changed else module, rows=rows, unmatched_rules=unmatched, changed=changed,
                backend=backend.describe() if changed else None, blocks=analysis.blocks_found,
                num_blocks=analysis.num_blocks)


def _telemetry(config, backend, platform, program):
  """The probes' settings where the telemetry option is on and the kernels that record run here, else None.
  `program`: what identifies the compiled training step (telemetry.register_module)."""
  if not config.telemetry:
    return None
  if not isinstance(backend.kernel_set, rewrite.FfiKernels):
    current = state.current()
    if current.first_time("telemetry without kernels"):
      notice.warn("xla_fp4: XLA_FP4_TELEMETRY records through the compiled kernels, which are not registered on "
                  "this platform (python -m xla_fp4 info says why); no telemetry is recorded")
    return None
  return rewrite.Settings(module=telemetry.register_module(program), every=config.telemetry_every, strict=config.strict,
                         one_process=jax.process_count() == 1, record_in_case=not is_cuda(platform))


def dump(dump_dir, before: ir.Module, result: Result):
  """Write the module before and after, and the decisions (JSON and a table), numbered per process."""
  os.makedirs(dump_dir, exist_ok=True)
  current = state.current()
  with current.lock:
    n = next(current.dumps)
  stem = os.path.join(dump_dir, f"{n:04d}_{module_name(before)}")
  with open(stem + ".before.mlir", "w") as f:
    f.write(before.operation.get_asm(enable_debug_info=True))
  with open(stem + ".after.mlir", "w") as f:
    f.write(result.module.operation.get_asm(enable_debug_info=True))
  payload = {"module": module_name(before), "backend": result.backend, "decisions": result.rows,
             "unmatched_rules": result.unmatched_rules, "blocks": list(result.blocks), "num_blocks": result.num_blocks}
  with open(stem + ".decisions.json", "w") as f:
    json.dump(payload, f, indent=1)
  with open(stem + ".decisions.txt", "w") as f:
    f.write(report.table(result.rows, result.unmatched_rules, title=module_name(before), backend=result.backend,
                         blocks=result.blocks))
  return stem
