"""The pass pipeline: clone → analyze → decide → rewrite → verify → dump. Entry point of the compile hook.

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


def _kernels_for(platform, module):
  """Compiled FFI kernels where the platform has them registered, else calls to the lowered pure-JAX reference."""
  from xla_fp4 import kernels
  if kernels.registered(platform):
    return rewrite_mod.FfiKernels(partitioned=num_partitions(module) > 1)
  return rewrite_mod.ReferenceKernels(module)


def _use_native(backend, platform, kernel_set):
  """native: packed operands + FP4 GEMM. auto picks it only where an FP4 GEMM runs in hardware (sm_100+)."""
  if backend == "emulate":
    return False
  has_packed = isinstance(kernel_set, rewrite_mod.FfiKernels)
  if backend == "native":
    if not has_packed:
      raise RuntimeError(f"XLA_FP4_BACKEND=native needs the compiled kernels for platform {platform!r}; "
                         "build them (see docs/cuda.md) or use XLA_FP4_BACKEND=emulate")
    return True
  from xla_fp4 import kernels
  return has_packed and platform is not None and platform.lower() in ("cuda", "gpu") and \
      kernels.fp4_gemm_supported()[0]


def decisions(module: ir.Module, config: Config):
  """Analyze and decide only: (decision rows, unmatched rule names)."""
  with module.context, ir.Location.unknown():
    analysis = analyze_mod.analyze(module)
    decided, unmatched = policy_mod.decide(analysis, config)
    return report.rows(analysis.sites, decided), unmatched


def transform(module: ir.Module, config: Config, platform: str = "cpu", kernels=None) -> Result:
  """Rewrite a clone of `module`. `kernels(module) -> KernelSet` overrides the per-platform choice."""
  new = clone_module(module)
  with new.context, ir.Location.unknown():
    analysis = analyze_mod.analyze(new)
    decided, unmatched = policy_mod.decide(analysis, config)
    selected = [d for d in decided if d.decision == "nvfp4"]
    notes = {}
    if selected:
      kernel_set = kernels(new) if kernels else _kernels_for(platform, new)
      use_native = _use_native(config.backend, platform, kernel_set)
      partitioned = num_partitions(new) > 1
      emitter = rewrite_mod.Emitter(kernel_set, config.seed, whole_tensors=not partitioned,
                                    matrix_gemm=(platform or "").lower() == "cpu")
      plumbed = {}  # (func name, id of the original entry call) -> block value inside the function
      for d in selected:
        site, dot = analysis.sites[d.index], analysis.ops[d.index]
        block_value = None
        if d.keep_blocks:
          value, entry = analysis.block_values[d.index]
          key = (site.func, id(entry))
          if key in plumbed:
            block_value = plumbed[key]
          elif entry is None and rewrite_mod.visible(value, dot):
            block_value = value
          elif entry is not None and value is not None and rewrite_mod.visible(value, entry):
            func_op = next(op for op in new.body.operations if op.operation.name == "func.func" and
                           ir.StringAttr(op.attributes["sym_name"]).value == site.func)
            block_value = plumbed[key] = rewrite_mod.plumb_block_value(value, entry, func_op.operation)
          else:
            notes[d.index] = "block index unavailable per iteration: every iteration runs in NVFP4"
        native = use_native and rewrite_mod.native_eligible(site) and not partitioned
        if use_native and not native:
          why = "the packed GEMM takes no batch dims" if not partitioned else \
              "partitioned program: the packed kernels have no partitioner"
          notes[d.index] = "; ".join(filter(None, [notes.get(d.index), f"{why}: emulated"]))
        y = emitter.emit(dot, site, d, block_value, native=native)
        dot.results[0].replace_all_uses_with(y)
        dot.erase()
      if not new.operation.verify():
        raise RuntimeError("xla_fp4 produced a module that does not verify")
    rows = report.rows(analysis.sites, decided, notes)
  return Result(module=new if selected else module, rows=rows, unmatched_rules=unmatched, changed=bool(selected))


def dump(dump_dir, before: ir.Module, result: Result):
  os.makedirs(dump_dir, exist_ok=True)
  with _dump_lock:
    n = next(_dump_counter)
  stem = os.path.join(dump_dir, f"{n:04d}_{module_name(before)}")
  with open(stem + ".before.mlir", "w") as f:
    f.write(before.operation.get_asm(enable_debug_info=True))
  with open(stem + ".after.mlir", "w") as f:
    f.write(result.module.operation.get_asm(enable_debug_info=True))
  payload = {"module": module_name(before), "decisions": result.rows, "unmatched_rules": result.unmatched_rules}
  with open(stem + ".decisions.json", "w") as f:
    json.dump(payload, f, indent=1)
  with open(stem + ".decisions.txt", "w") as f:
    f.write(report.table(result.rows, result.unmatched_rules, title=module_name(before)))
  return stem
