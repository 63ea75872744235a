"""Tracing values upstream: a dot operand to the @main argument it reads (a weight, `Tracer`), and a tensor to the
value it is a pass-through copy of (`root`: dots that read the same tensor get the same root).

Both look through `callgraph.forwarded` ops; they differ in how they cross functions and loops:
- `Tracer.trace` follows call results into callees and function arguments back to their call sites (the call it came
  down through, else every call site, the first that traces wins), loop carries to the loop's initial operand and
  shard_map arguments to the op's operand and shard_map results to what the body returns, and a scan's stacked output
  of its iterations' slices (`_stacked_update`) to the sliced value; a `dynamic_slice` of a stacked parameter records
  the slice's start index (the block of a scanned stack) in the scope of the call that entered the dot's function.
- `root` follows functions with a single call site (nested jit, remat and custom_jvp bodies) and functions that
  return an argument, not into loops: a loop-carried value is another tensor every iteration.
"""

import dataclasses
from typing import Any, Optional

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo
from jax._src.lib.mlir.dialects import sdy

from xla_fp4.passes.analysis.callgraph import (Binding, CallGraph, defining_op, forwarded, shape, terminator,
                                              unforwarded)
from xla_fp4.passes.regions import is_argument


@dataclasses.dataclass
class Source:
  """Where a dot operand comes from: a @main argument, sliced per iteration in a scanned stack."""
  arg: int  # @main argument index
  index: Any = None  # dynamic_slice start index (layer of a stacked weight), in `entry_call`'s caller scope
  stacked: Optional[int] = None  # layers in the stack (the product over nested stacks)
  entry_call: Any = None  # the call op through which the dot's function was entered, if any


class Tracer:
  def __init__(self, graph: CallGraph):
    self.graph = graph

  def trace(self, value, stack=(), entry=None, depth=0) -> Optional[Source]:
    """The Source of `value`, or None when it reads no @main argument. `stack`: the calls whose results led here."""
    if depth > 200:
      return None
    if is_argument(value):
      origin = self.graph.argument_origin(value)
      if origin.binding is Binding.MAIN:
        return Source(arg=origin.number, entry_call=entry)
      if origin.binding is Binding.FUNCTION:
        if stack:  # we came down into this callee through a call result: go back up the same call
          return self.trace(origin.operand(stack[-1]), stack[:-1], entry, depth + 1)
        for call in origin.calls:
          src = self.trace(origin.operand(call), (), entry or call, depth + 1)
          if src is not None:
            return src
        return None
      if origin.binding in (Binding.LOOP, Binding.MANUAL):  # loop carries, shard_map bodies
        return self.trace(origin.operand(), stack, entry, depth + 1)
      return None
    op, number = defining_op(value), ir.OpResult(value).result_number
    through = forwarded(op, number)
    if through is not None:
      return self.trace(through, stack, entry, depth + 1)
    if op.name == "stablehlo.dynamic_slice":
      src = self.trace(op.operands[0], stack, entry, depth + 1)
      layers = shape(op.operands[0])[0]
      if src is not None and (src.stacked is None or src.stacked == 1):  # a stack of one around it adds nothing
        src.index = self._lift(op.operands[1], stack)
        src.stacked = layers
      elif src is not None and layers > 1:
        # A slice of a slice (nested scans): the flat layer index is no value of the program.
        src.index, src.stacked = None, src.stacked * layers
      return src
    if op.name == "func.call":
      inner = self.graph.returned(op, number)
      return None if inner is None else self.trace(inner, stack + (op,), entry, depth + 1)
    if op.name == "sdy.manual_computation":  # a residual a shard_map body returns (a remat's gathered weight)
      return self.trace(terminator(op.regions[0]).operands[number], stack, entry, depth + 1)
    if op.name == "stablehlo.while":
      update = self._stacked_update(op, number)
      src = None if update is None else self.trace(update, stack, entry, depth + 1)
      if src is not None:  # the stack holds iteration i's slice at i: the stacked parameter again, unsliced
        src.index, src.stacked = None, None
      return src
    return None

  def _stacked_update(self, loop, number):
    """The value a scan's loop stacks into its result `number` (`ys`: the loop's carry `number` updated at one index
    per iteration, `dynamic_update_slice`, in the loop body or a function it calls), or None. A scan over nested
    scanned layers hands its backward the weights this way: each iteration's slice of the stacked parameter, stacked
    again in iteration order."""
    body = loop.regions[1].blocks[0]
    value, call = terminator(loop.regions[1]).operands[number], None
    if not is_argument(value) and defining_op(value).name == "func.call":
      call = defining_op(value)
      value = self.graph.returned(call, ir.OpResult(value).result_number)
      if value is None:
        return None
    if is_argument(value) or defining_op(value).name != "stablehlo.dynamic_update_slice":
      return None
    update_op = defining_op(value)
    buffer, update = update_op.operands[0], unforwarded(update_op.operands[1])
    if call is not None:  # the callee's arguments stand for the call's operands
      if not (is_argument(buffer) and is_argument(update)):
        return None
      buffer = call.operands[ir.BlockArgument(buffer).arg_number]
      update = call.operands[ir.BlockArgument(update).arg_number]
    return update if buffer == body.arguments[number] else None

  def _lift(self, value, stack):
    """Express a callee-local block argument in the scope of the calls on `stack`."""
    stack = list(stack)
    while stack and is_argument(value):
      if self.graph.argument_origin(value).binding not in (Binding.MAIN, Binding.FUNCTION):
        break
      value = stack.pop().operands[ir.BlockArgument(value).arg_number]
    return value if not stack else None


def root(graph: CallGraph, value):
  """The value a chain of forwarded ops starts from (see the module docstring)."""
  for _ in range(256):
    if is_argument(value):
      origin = graph.argument_origin(value)
      if origin.binding is Binding.MANUAL or (origin.binding is Binding.FUNCTION and len(origin.calls) == 1):
        value = origin.operand(origin.calls[0] if origin.calls else None)
        continue
      return value
    op = defining_op(value)
    if op.name == "func.call":  # a value a function passes through (a residual returned by a jitted forward)
      inner = graph.returned(op, ir.OpResult(value).result_number)
      if inner is None or not is_argument(inner):
        return value
      value = op.operands[ir.BlockArgument(inner).arg_number]
      continue
    through = forwarded(op, ir.OpResult(value).result_number)
    if through is None:
      return value
    value = through
  return value


def dot_dims(op):
  """((lhs contracting, rhs contracting), (lhs batch, rhs batch)) of a dot_general or a chlo.ragged_dot."""
  if op.name == "chlo.ragged_dot":
    return ragged_dot_dims(op)[0]
  d = hlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
  return ((tuple(d.lhs_contracting_dimensions), tuple(d.rhs_contracting_dimensions)),
          (tuple(d.lhs_batching_dimensions), tuple(d.rhs_batching_dimensions)))


def ragged_dot_dims(op):
  """(dot_dims, rhs group dims, lhs ragged dims) of a chlo.ragged_dot: the group dim selects the rhs matrix of each
  group of rows."""
  from jax._src.lib.mlir.dialects import chlo
  d = chlo.RaggedDotDimensionNumbers(op.attributes["ragged_dot_dimension_numbers"])
  return (((tuple(d.lhs_contracting_dimensions), tuple(d.rhs_contracting_dimensions)),
           (tuple(d.lhs_batching_dimensions), tuple(d.rhs_batching_dimensions))), tuple(d.rhs_group_dimensions),
          tuple(d.lhs_ragged_dimensions))


def replicated_arguments(main):
  """Indices of @main's arguments whose sharding annotation shards them over no mesh axis: Shardy's `sdy.sharding`
  with no axis on any dim, or GSPMD's `mhlo.sharding = "{replicated}"`. No annotation (JAX's unspecified sharding,
  which propagation may still shard) is not replicated."""
  if main is None or "arg_attrs" not in main.attributes:
    return set()
  out = set()
  for i, attrs in enumerate(ir.ArrayAttr(main.attributes["arg_attrs"])):
    attrs = ir.DictAttr(attrs)
    if "sdy.sharding" in attrs:
      sharding = sdy.TensorShardingAttr(attrs["sdy.sharding"])
      replicated = all(not sdy.DimensionShardingAttr(d).axes for d in sharding.dimension_shardings)
    elif "mhlo.sharding" in attrs:
      replicated = ir.StringAttr(attrs["mhlo.sharding"]).value == "{replicated}"
    else:
      replicated = False
    if replicated:
      out.add(i)
  return out
