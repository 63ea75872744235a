"""Scope: bringing a value the rewrite needs to the dot that reads it, and checking, before MLIR's verifier runs, that
no op reads a value across a region isolated from above.

A scanned stack's block index is a value of the loop body; the dot that selects on it may sit in a function the body
calls, inside a shard_map body (`sdy.manual_computation`, MaxText's sparse MoE under FSDP), or both. Neither region
sees the loop's values, so the value comes in as an argument of each:

  before                                            after
  %i = ...loop's block index...                     %i = ...
  %r = func.call @layer(%h)                         %r = func.call @layer(%h, %i)
  func.func @layer(%h)                              func.func @layer(%h, %arg_i)
    %y = sdy.manual_computation(%h)                   %y = sdy.manual_computation(%h, %arg_i)
        in_shardings=[<@mesh, [{"fsdp"}, {}]>]            in_shardings=[<@mesh, [{"fsdp"}, {}]>, <@mesh, []>]
        (%a: tensor<16x64xf32>) {                         (%a: tensor<16x64xf32>, %b: tensor<i32>) {
      ... dot reading %a ...                              ... select on %b, dot ...

A scalar bound replicated is the same on every device. `isolation_violations` is the check: the verifier reports such
a use, but on some modules (MaxText's Qwen3-MoE and Mixtral under FSDP) it crashed the process instead, beyond the
reach of any fallback, so the pipeline never hands it a module that fails this check.
"""

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import func as func_dialect
from jax._src.lib.mlir.dialects import sdy

from xla_fp4.passes.regions import ISOLATED, op_of, visible


def plumb_block_value(value, entry_call, func_op):
  """Make `value` (in scope at `entry_call`) available inside `func_op` by adding an argument; returns it there."""
  value = into_shard_maps(value, entry_call)
  block = func_op.regions[0].blocks[0]
  arg = block.add_argument(value.type, ir.Location.unknown())
  ftype = ir.FunctionType(ir.TypeAttr(func_op.attributes["function_type"]).value)
  func_op.attributes["function_type"] = ir.TypeAttr.get(
      ir.FunctionType.get(list(ftype.inputs) + [value.type], list(ftype.results)))
  if "arg_attrs" in func_op.attributes:
    attrs = list(ir.ArrayAttr(func_op.attributes["arg_attrs"]))
    func_op.attributes["arg_attrs"] = ir.ArrayAttr.get(attrs + [ir.DictAttr.get({})])
  with ir.InsertionPoint(entry_call), entry_call.location:
    new_call = func_dialect.CallOp([r.type for r in entry_call.results], entry_call.attributes["callee"],
                                   list(entry_call.operands) + [value])
  for old, new in zip(entry_call.results, new_call.results):
    old.replace_all_uses_with(new)
  entry_call.erase()
  return arg


def into_shard_maps(value, op):
  """`value` as `op` can read it: through every shard_map body between its definition and `op` (outermost first), each
  taking it as one more operand, replicated, once per body."""
  bodies, cur = [], op
  while not visible(value, cur):
    cur = cur.parent
    if cur is None or cur.name == "func.func":
      raise ValueError(f"xla_fp4: {value} is not in scope at {op.name}")
    if cur.name == "sdy.manual_computation":
      bodies.append(op_of(cur))
  for manual in reversed(bodies):
    value = _thread(value, manual)
  return value


def _thread(value, manual):
  """The block argument of `manual`'s body bound to `value`, adding it as an operand where it is not one yet.
  `manual` is replaced by a copy with one more operand (an op's operand count is fixed); its body block moves over."""
  body = manual.regions[0].blocks[0]
  for i, operand in enumerate(manual.operands):
    if operand == value:
      return body.arguments[i]
  ins = list(sdy.TensorShardingPerValueAttr(manual.attributes["in_shardings"]).shardings)
  shardings = ins or list(sdy.TensorShardingPerValueAttr(manual.attributes["out_shardings"]).shardings)
  if not shardings:
    raise ValueError("a shard_map body with neither operands nor results: no mesh to bind the block index on")
  mesh = sdy.TensorShardingAttr(shardings[0]).mesh_or_ref
  rank = len(ir.RankedTensorType(value.type).shape)
  ins.append(sdy.TensorShardingAttr.get(mesh, [sdy.DimensionShardingAttr.get([], is_closed=True)] * rank))
  with ir.InsertionPoint(manual), manual.location:
    new = sdy.ManualComputationOp([r.type for r in manual.results], list(manual.operands) + [value],
                                  sdy.TensorShardingPerValueAttr.get(ins), manual.attributes["out_shardings"],
                                  manual.attributes["manual_axes"])
  for i in range(len(manual.attributes)):
    named = manual.attributes[i]
    if named.name not in new.operation.attributes:
      new.operation.attributes[named.name] = named.attr
  arg = body.add_argument(value.type, ir.Location.unknown())
  body.append_to(new.regions[0])
  for old, fresh in zip(manual.results, new.results):
    old.replace_all_uses_with(fresh)
  manual.erase()
  return arg


def bodies_to_check(values):
  """The outermost ops isolated from above other than functions (shard_map bodies) around the ops defining `values`
  (the rewritten dots' replacements): where a rewrite can read across an isolated region without plumbing. Around a
  dot that no such body holds, the rewrite's ops sit in the dot's function and read the function's values."""
  found = {}
  for value in values:
    if isinstance(value.owner, ir.Block):
      continue
    outermost, cur = None, op_of(value.owner).parent
    while cur is not None and cur.name != "func.func":
      if cur.name in ISOLATED:
        outermost = cur
      cur = cur.parent
    if outermost is not None:
      found.setdefault(outermost, outermost)
  return list(found.values())


def isolation_violations(func_ops, limit=3):
  """Up to `limit` descriptions of ops in `func_ops` (functions or other ops isolated from above, and the regions inside
  them) that read a value defined outside the innermost op around them that is isolated from above (ISOLATED): what
  MLIR's verifier must never see."""
  found = []

  def check(isolated):
    inside = _blocks_of(isolated)

    def visit(op):
      if len(found) >= limit:
        return ir.WalkResult.INTERRUPT
      if op.operation != isolated and op.name in ISOLATED:  # its own check; only its operands are read here
        for v in op.operands:
          _record(found, op, v, inside)
        check(op.operation)
        return ir.WalkResult.SKIP
      for v in op.operands:
        _record(found, op, v, inside)
      return ir.WalkResult.ADVANCE

    for region in isolated.regions:
      for block in region.blocks:
        for op in block.operations:
          op.operation.walk(visit, ir.WalkOrder.PRE_ORDER)

  for f in func_ops:
    check(op_of(f))
  return found


def _blocks_of(isolated):
  """The blocks inside `isolated`, nested regions included."""
  blocks = set()

  def visit(op):
    for region in op.regions:
      blocks.update(region.blocks)
    return ir.WalkResult.ADVANCE

  isolated.walk(visit, ir.WalkOrder.PRE_ORDER)
  return blocks


def _record(found, op, value, inside):
  owner = value.owner
  block = owner if isinstance(owner, ir.Block) else op_of(owner).block
  if block not in inside:
    found.append(f"'{op.name}' at {op.location} reads a value defined outside the region of the op isolated from "
                 f"above around it")
