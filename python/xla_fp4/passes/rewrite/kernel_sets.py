"""Kernel sets: what the emitter calls to run a kernel target (kernels/targets.py) at the insertion point.

Every set has one method, `call(target, operands, attrs, *, result_types=None, k_follows_dot=False)`, returning the
call's results; the result types come from the target's record unless given.
- `FfiKernels`: a `stablehlo.custom_call` to the compiled FFI target (C++ on CPU, CUDA on GPU), row-major layouts
  fixed; in a partitioned program a block-local or packed target also carries its Shardy rule (sharding/partition.py,
  sharding/packed.py).
- `ReferenceKernels`: a call to the target's pure-JAX twin, lowered into the module (`Twins`): the same numbers, for
  platforms without compiled kernels. XLA partitions the twins itself. The packed targets have no twin here.
"""

import hashlib
import typing

import jax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import func as func_dialect

from xla_fp4 import state
from xla_fp4.kernels.targets import shape_dtype
from xla_fp4.passes.rewrite.values import const, u32

class KernelSet(typing.Protocol):
  has_packed: bool  # whether the packed targets (quantize_packed, gemm_packed) run, i.e. the native backend can
  partitioned: bool  # a partitioned program's custom calls (they carry their Shardy rules)

  def call(self, target, operands, attrs, *, result_types=None, k_follows_dot=False) -> list: ...


class FfiKernels:
  """Custom calls to the compiled FFI targets; contract in xla_fp4/kernels/__init__.py."""
  has_packed = True

  def __init__(self, partitioned=False, mesh=None):
    from xla_fp4 import kernels  # the compiled extension is only needed on this path
    from xla_fp4.sharding import device_rows, packed, partition
    self._kernels, self._partition, self._packed, self._rows = kernels, partition, packed, device_rows
    self.partitioned = partitioned  # block-local calls carry their Shardy rule
    # The Shardy mesh over all partitions (device_rows.device_mesh): telemetry's per-device statistics rows are split
    # over it; without one (GSPMD) a partitioned program's statistics come from the twins (probes.py).
    self.mesh = mesh if partitioned else None
    # built once per pass run:
    self._configs = {}  # (target, attributes but a salt) -> ({name: attribute}, their DictAttr if unsalted)
    self._types = {}  # (target, operand types, attributes) -> result types
    self._attributes = {}  # what custom calls share: types' layouts, targets' names (kernels.custom_call)

  def call(self, target, operands, attrs, *, result_types=None, k_follows_dot=False):
    unsalted = tuple(sorted((k, v) for k, v in attrs.items() if k != "salt"))
    operand_types = [o.type for o in operands]
    if result_types is None:  # the results' types do not depend on a call's salt (one per operand: no cache hit)
      signature = (target.name, unsalted, tuple(operand_types))
      types = self._types.get(signature)
      if types is None:
        types = self._types[signature] = target.result_types(operand_types, attrs)
    else:
      types = result_types
    known = self._configs.get((target.name, unsalted))
    if known is None:
      attributes = self._kernels.backend_config_attributes(target.name, attrs)
      known = self._configs[(target.name, unsalted)] = (attributes, None if "salt" in attrs else
                                                        ir.DictAttr.get(attributes))
    attributes, config = known
    if "salt" in attrs:  # one salt per operand: its DictAttr is its own
      config = ir.DictAttr.get({**attributes, "salt": self._kernels.attribute(target.name, "salt", attrs["salt"])})
    op = self._kernels.custom_call(target.name, types, operands, config, has_side_effect=target.side_effect,
                                   cache=self._attributes)
    if self.partitioned and target.block_local is not None:
      op.attributes["sdy.sharding_rule"] = self._partition.sharding_rule(
          target.name, operand_types, types, attrs, k_follows_dot)
    if self.partitioned and target.packed is not None:
      op.attributes["sdy.sharding_rule"] = self._packed.sharding_rule(target.name, operand_types, types, attrs)
    if self.partitioned and target.device_stats:
      if self.mesh is None:
        raise ValueError(f"{target.name} in a partitioned program needs a Shardy mesh over all devices")
      op.attributes["sdy.sharding"] = self._rows.device_stats_sharding(self.mesh, types)
    if self.partitioned and target.side_effect:
      # XLA's partitioner requires a sharding on a side-effecting op: every device runs it on whole values, but a
      # record of parts on its own row of the statistics (partition.py).
      op.attributes["sdy.sharding"] = ir.Attribute.parse(
          "#sdy.sharding_per_value<[" + ", ".join("<mesh<[]>, []>" for _ in types) + "]>")
      if attrs.get("parts", 1) > 1:
        op.attributes["sdy.sharding_rule"] = self._rows.parts_rule([o.type for o in operands], types)
    return list(op.results)


class ReferenceKernels:
  """The targets as calls to their pure-JAX twins (Twins); for platforms without compiled kernels."""
  has_packed = False
  partitioned = False  # no custom calls: XLA partitions the twins' plain StableHLO itself

  def __init__(self, module, platform=None):
    self.twins = Twins(module, platform)

  def call(self, target, operands, attrs, *, result_types=None, k_follows_dot=False):
    if target.twin is None:
      raise ValueError(f"{target.name} has no twin the pass can lower (ReferenceKernels runs no packed target)")
    as_operands, params = target.twin_arguments(attrs)
    # Operands, not parameters, so that all sites share one function per shape and recipe.
    extra = [const(value, u32()) for value in as_operands]
    types = result_types or target.result_types([o.type for o in operands], attrs)
    return list(self.twins.call(target.twin, list(operands) + extra, types, **params))


class Twins:
  """Calls to private functions lowered from the pure-JAX twins (xla_fp4.numerics.kernel_twins, numerics.grouped)
  into `module`: one function per twin, operand types and parameters. `platform` (JAX's name: cpu, cuda, rocm) is
  the one the module is compiled for, which decides how JAX lowers some ops (a ragged dot: chlo.ragged_dot on GPU);
  None lowers for the default backend."""

  def __init__(self, module, platform=None):
    self.module = module
    self.platform = platform
    self.names = {}  # function name -> its result types

  def call(self, fn, operands, result_types=None, **params):
    """A call of fn(*operands, **params) lowered into the module; `result_types` default to the lowering's."""
    arg_types = [o.type for o in operands]
    sig = repr((fn.__module__, fn.__name__, [str(t) for t in arg_types], sorted(params.items()), self.platform))
    name = "xla_fp4_twin_" + fn.__name__ + "_" + hashlib.sha256(sig.encode()).hexdigest()[:12]
    if name not in self.names:
      table = ir.SymbolTable(self.module.operation)
      if name not in table:  # another Twins on this module may have defined it
        self._define(name, sig, fn, arg_types, params)
        table = ir.SymbolTable(self.module.operation)
      self.names[name] = list(ir.FunctionType(ir.TypeAttr(table[name].attributes["function_type"]).value).results)
    return func_dialect.CallOp(result_types or self.names[name], ir.FlatSymbolRefAttr.get(name), operands).results

  def _define(self, name, sig, fn, arg_types, params):
    lowered_twins = state.current().lowered_twins  # one lowering per signature and process
    text = lowered_twins.get(sig)
    if text is None:
      avals = [shape_dtype(t) for t in arg_types]
      # Outside the user's mesh (the pass runs inside their jit): a twin takes whole tensors, and its functions must
      # not name a mesh that the module lacks.
      platforms = {} if self.platform is None else dict(lowering_platforms=(self.platform,))
      with jax.set_mesh(None):
        lowered = jax.jit(lambda *a: fn(*a, **params), keep_unused=True).trace(*avals).lower(**platforms)
      text = lowered_twins[sig] = lowered.as_text(debug_info=False)
    helper = ir.Module.parse(text, context=self.module.context)
    funcs = [op for op in helper.body.operations if op.operation.name == "func.func"]  # not a mesh JAX may add
    for op in funcs:  # rename every symbol first, so that calls between helper functions follow
      sym = ir.StringAttr(op.attributes["sym_name"]).value
      new = name if sym == "main" else f"{name}_{sym}"
      ir.SymbolTable.replace_all_symbol_uses(sym, new, helper.operation)
      op.attributes["sym_name"] = ir.StringAttr.get(new)
      op.attributes["sym_visibility"] = ir.StringAttr.get("private")
      for attr in ("arg_attrs", "res_attrs"):
        if attr in op.attributes:
          del op.attributes[attr]
    for op in funcs:
      self.module.body.append(op.clone())
