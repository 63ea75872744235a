"""The pass pipeline: clone → one copy per call site → analyze → decide → plan → rewrite → verify → dump. Entry point
of the compile hook. The phases live in their modules (analyze.py, policy.py, rewrite.py); this one only drives them.

`transform` never mutates the module it is given (JAX keeps it for `Lowered.as_text()` and cache keys); it returns a
fresh module, or the original when nothing was selected. Errors are the caller's business (hook.py falls back and
warns).
"""

import dataclasses
import itertools
import json
import os
import threading

from jax._src.lib.mlir import ir

from xla_fp4 import report
from xla_fp4.config import Config
from xla_fp4.passes import analyze as analyze_mod
from xla_fp4.passes import policy as policy_mod
from xla_fp4.passes import rewrite as rewrite_mod

_dump_counter = itertools.count()
_dump_lock = threading.Lock()


@dataclasses.dataclass
class Result:
  module: ir.Module
  rows: list  # decision rows (report.py format)
  unmatched_rules: list
  changed: bool
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


@dataclasses.dataclass(frozen=True)
class Backend:
  """What the rewrite emits on one platform, and why (shown in the decision report)."""
  kernel_set: object  # rewrite.FfiKernels or rewrite.ReferenceKernels
  kernels: str  # which kernels run: "cpu FFI kernels", "CUDA FFI kernels", or the plain StableHLO form and why
  gemm: str  # "native" (packed operands, FP4 GEMM) or "emulate" (high-precision GEMM on q·scale operands)
  gemm_reason: str

  def describe(self):
    return {"kernels": self.kernels, "gemm": self.gemm, "gemm_reason": self.gemm_reason}


def _is_cuda(platform):
  return (platform or "").lower() in ("cuda", "gpu")


def choose_backend(config: Config, platform, module, kernels=None) -> Backend:
  """The kernel set and GEMM for `platform`: the platform's FFI kernels where they are registered, else the plain
  StableHLO form lowered from `xla_fp4.numerics`; the FP4 GEMM where config.backend asks for it (native) or where one
  runs in hardware (auto: CUDA with compute capability 10.x and cuBLASLt >= 12.8). `kernels(module)` overrides."""
  from xla_fp4 import kernels as kernels_mod
  registered, why = kernels_mod.status(platform)
  if kernels is not None:
    kernel_set = kernels(module)
    described = type(kernel_set).__name__
  elif registered:
    kernel_set, described = rewrite_mod.FfiKernels(partitioned=num_partitions(module) > 1), why
  else:
    kernel_set, described = rewrite_mod.ReferenceKernels(module), f"plain StableHLO form ({why})"
  packed = kernel_set.has_packed
  if config.backend == "emulate":
    return Backend(kernel_set, described, "emulate", "XLA_FP4_BACKEND=emulate")
  if _is_cuda(platform):
    fp4_gemm, fp4_why = kernels_mod.fp4_gemm_supported()
  else:
    fp4_gemm, fp4_why = False, f"no FP4 tensor cores on {platform} (XLA_FP4_BACKEND=native runs the C++ reference GEMM)"
  if config.backend == "native":
    if not packed:
      raise RuntimeError(f"XLA_FP4_BACKEND=native needs the compiled kernels for platform {platform!r} ({described}); "
                         "build them (see docs/cuda.md) or use XLA_FP4_BACKEND=emulate")
    if _is_cuda(platform) and not fp4_gemm:  # the GEMM would fail at run time: refuse at compile time instead
      raise RuntimeError(f"XLA_FP4_BACKEND=native: {fp4_why}; use XLA_FP4_BACKEND=emulate or auto")
    return Backend(kernel_set, described, "native", "XLA_FP4_BACKEND=native")
  if fp4_gemm and packed:
    return Backend(kernel_set, described, "native", "auto: cuBLASLt FP4 GEMM (compute capability 10.x)")
  return Backend(kernel_set, described, "emulate", f"auto: {fp4_why if not fp4_gemm else described}")


def decisions(module: ir.Module, config: Config):
  """Analyze and decide only: (decision rows, unmatched rule names)."""
  module = clone_module(module)
  with module.context, ir.Location.unknown():
    analyze_mod.specialize_call_sites(module)
    analysis = analyze_mod.analyze(module)
    decided, unmatched = policy_mod.decide(analysis, config)
    return report.rows(analysis.sites, decided), unmatched


def transform(module: ir.Module, config: Config, platform: str = "cpu", kernels=None) -> Result:
  """Rewrite a clone of `module`. `kernels(module) -> KernelSet` overrides the per-platform choice."""
  new = clone_module(module)
  with new.context, ir.Location.unknown():
    analyze_mod.specialize_call_sites(new)
    analysis = analyze_mod.analyze(new)
    decided, unmatched = policy_mod.decide(analysis, config)
    selected = [d for d in decided if d.decision is policy_mod.Verdict.NVFP4]
    plans = []
    if selected:
      backend = choose_backend(config, platform, new, kernels)
      plans = policy_mod.plan(analysis, selected, partitioned=num_partitions(new) > 1,
                              native=backend.gemm == "native", cuda=_is_cuda(platform))
      emitter = rewrite_mod.Emitter(backend.kernel_set, rewrite_mod.Twins(new), config.seed,
                                    matrix_gemm=(platform or "").lower() == "cpu")
      passed_in = {}  # (func name, id of the entry call) -> the block index inside the function
      for p in plans:
        dot, block_value = analysis.ops[p.site.index], None
        if p.block_index is analyze_mod.BlockIndex.IN_SCOPE:
          block_value = analysis.block_values[p.site.index][0]
        elif p.block_index is analyze_mod.BlockIndex.PASSED_IN:
          value, entry = analysis.block_values[p.site.index]
          key = (p.site.func, id(entry))
          if key not in passed_in:
            passed_in[key] = rewrite_mod.plumb_block_value(value, entry, _func(new, p.site.func))
          block_value = passed_in[key]
        y = emitter.emit(dot, p, block_value)
        dot.results[0].replace_all_uses_with(y)
        dot.erase()
      if not new.operation.verify():
        raise RuntimeError("xla_fp4 produced a module that does not verify")
    notes = {p.site.index: "; ".join(p.notes) for p in plans if p.notes}
    rows = report.rows(analysis.sites, decided, notes)
  return Result(module=new if selected else module, rows=rows, unmatched_rules=unmatched, changed=bool(selected),
                backend=backend.describe() if selected else None)


def _func(module, name):
  return next(op.operation for op in module.body.operations
              if op.operation.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == name)


def dump(dump_dir, before: ir.Module, result: Result):
  os.makedirs(dump_dir, exist_ok=True)
  with _dump_lock:
    n = next(_dump_counter)
  stem = os.path.join(dump_dir, f"{n:04d}_{module_name(before)}")
  with open(stem + ".before.mlir", "w") as f:
    f.write(before.operation.get_asm(enable_debug_info=True))
  with open(stem + ".after.mlir", "w") as f:
    f.write(result.module.operation.get_asm(enable_debug_info=True))
  payload = {"module": module_name(before), "backend": result.backend, "decisions": result.rows,
             "unmatched_rules": result.unmatched_rules}
  with open(stem + ".decisions.json", "w") as f:
    json.dump(payload, f, indent=1)
  with open(stem + ".decisions.txt", "w") as f:
    f.write(report.table(result.rows, result.unmatched_rules, title=module_name(before), backend=result.backend))
  return stem
