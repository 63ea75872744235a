"""The module as a call graph, and the one step every value walk takes across functions, loops and shard_map bodies.

A JAX module is @main plus outlined functions (scan bodies on jax 0.10, nested jit, remat, custom_jvp) entered by
`func.call`; loops are `stablehlo.while` with carried block arguments; shard_map bodies are `sdy.manual_computation`
regions. The walks of the analysis (trace.py: a weight to its parameter, a tensor to its origin; heads.py: the
slice upstream of a gradient, the path of an output to the loss) differ only in which of these steps they take, so
the steps are defined here once: `argument_origin` (a block argument -> the values it is bound to) and `returned`
(a call's result -> the value its callee returns), with `forwarded` (an op whose result is its operand up to
layout, dtype or sharding).

`specialize_call_sites` gives each call of a function holding a dot a copy of its own, so every dot is analysed and
rewritten in its own calling context.
"""

import dataclasses
import enum
from typing import Any

from jax._src.lib.mlir import ir

from xla_fp4.passes.regions import is_argument, op_of

_PASS_THROUGH = {"stablehlo.convert", "stablehlo.reshape", "stablehlo.transpose", "stablehlo.broadcast_in_dim",
                 "stablehlo.slice", "stablehlo.bitcast_convert", "stablehlo.copy", "mhlo.copy", "mhlo.sharding",
                 "sdy.sharding_constraint", "sdy.reshard"}
_SHARDING_TARGETS = {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "annotate_device_placement"}
_COLLECTED = {"stablehlo.dot_general", "func.call", "chlo.ragged_dot"}


def defining_op(value):
  """The operation whose result `value` is (None for a block argument)."""
  return None if is_argument(value) else value.owner.operation


def shape(value):
  return tuple(ir.RankedTensorType(value.type).shape)


def terminator(region):
  block = region.blocks[0]
  return block.operations[len(block.operations) - 1]


def users(value):
  """(user operation, operand number) of every use of `value`."""
  for use in value.uses:
    yield op_of(use.owner), use.operand_number


def func_name(func_op):
  return ir.StringAttr(func_op.attributes["sym_name"]).value


def forwarded(op, result_number):
  """The operand whose values `op`'s result `result_number` carries unchanged up to layout, dtype or sharding, or
  None: what every upstream walk looks through."""
  name = op.name
  if name in _PASS_THROUGH:
    return op.operands[0]
  if name == "stablehlo.custom_call" and \
      ir.StringAttr(op.attributes["call_target_name"]).value in _SHARDING_TARGETS:
    return op.operands[0]
  if name == "stablehlo.optimization_barrier":
    return op.operands[result_number]
  if name == "stablehlo.all_gather" and len(op.operands) == 1:  # a shard_map body's FSDP gather of a weight
    return op.operands[0]
  return None


def unforwarded(value):
  """The value a chain of `forwarded` ops starts from, within one function."""
  op = defining_op(value)
  while op is not None:
    through = forwarded(op, ir.OpResult(value).result_number)
    if through is None:
      break
    value, op = through, defining_op(through)
  return value


class Binding(enum.Enum):
  """What a block argument is an argument of."""
  MAIN = "main"  # @main: a parameter or input of the program
  FUNCTION = "function"  # another function: bound to the operand of each of its call sites
  LOOP = "loop"  # a stablehlo.while carry: bound to the loop's initial operand and to the body's yield
  MANUAL = "manual"  # an sdy.manual_computation (shard_map) body: bound to the op's operand
  OTHER = "other"  # a reduction or sort body, a case branch...: no walk continues


@dataclasses.dataclass(frozen=True)
class Origin:
  """Where a block argument's values come from, one step upstream."""
  binding: Binding
  number: int  # the argument's position
  owner: Any = None  # the func.func, stablehlo.while or sdy.manual_computation (ir.Operation)
  calls: tuple = ()  # FUNCTION: the call sites of the function, program order

  def operand(self, op=None):
    """The value bound at `op` (a call site for FUNCTION; the loop or manual computation itself otherwise)."""
    return (op if op is not None else self.owner).operands[self.number]

  def loop_carried(self):
    """LOOP: the value the body yields for the next iteration."""
    return terminator(self.owner.regions[1]).operands[self.number]


class CallGraph:
  """Symbol table, call graph, dots in program order and @main's arguments of a module."""

  def __init__(self, module):
    self.funcs = {}
    self._prefixes = {}  # function name -> call_prefix
    self.calls = {}  # callee -> [call ops], program order
    # (func name, op) for every dot_general, chlo.ragged_dot (JAX's ragged_dot lowered for GPU) and func.call, in
    # program order
    self.order = []
    for op in module.body.operations:
      if op.operation.name == "func.func":
        self.funcs[func_name(op)] = op
    for name, f in self.funcs.items():
      self._collect(name, f.operation)
    main = self.funcs.get("main")
    self.main = main.operation if main is not None else None

  def _collect(self, fname, func_op):
    """Dots and calls of one function; the walk itself runs in C++ (a Python walk was a third of the pass time), and
    `visit`, which runs for every op of the module, reads only local names and one attribute of the op."""
    collected, advance, order, calls = _COLLECTED, ir.WalkResult.ADVANCE, self.order, self.calls

    def visit(op):
      name = op.name
      if name in collected:
        op = op.operation
        order.append((fname, op))
        if name == "func.call":
          calls.setdefault(ir.FlatSymbolRefAttr(op.attributes["callee"]).value, []).append(op)
      return advance
    func_op.walk(visit, ir.WalkOrder.PRE_ORDER)

  def dots(self):
    """(function name, dot_general or chlo.ragged_dot) in program order."""
    return [(f, op) for f, op in self.order if op.name != "func.call"]

  def callee(self, call):
    """The func.func a func.call calls (None for an unknown symbol)."""
    return self.funcs.get(ir.FlatSymbolRefAttr(call.attributes["callee"]).value)

  def argument_origin(self, value) -> Origin:
    """The one step upstream from a block argument (see the module docstring)."""
    arg = ir.BlockArgument(value)
    owner = arg.owner.owner  # Block -> Operation
    if owner is None:
      return Origin(Binding.OTHER, arg.arg_number)
    owner = op_of(owner)
    if owner.name == "func.func":
      fname = func_name(owner)
      if fname == "main":
        return Origin(Binding.MAIN, arg.arg_number, owner)
      return Origin(Binding.FUNCTION, arg.arg_number, owner, tuple(self.calls.get(fname, ())))
    if owner.name == "stablehlo.while":
      return Origin(Binding.LOOP, arg.arg_number, owner)
    if owner.name == "sdy.manual_computation":
      return Origin(Binding.MANUAL, arg.arg_number, owner)
    return Origin(Binding.OTHER, arg.arg_number, owner)

  def returned(self, call, result_number):
    """The value `call`'s callee returns as result `result_number`, or None for an unknown callee."""
    callee = self.callee(call)
    return None if callee is None else terminator(callee.regions[0]).operands[result_number]

  def call_prefix(self, fname, seen=()):
    """Name stack of the first call site of `fname`, recursively; '' for main."""
    from xla_fp4.passes.analysis.names import name_of
    if fname in self._prefixes:
      return self._prefixes[fname]
    sites = self.calls.get(fname)
    if fname == "main" or not sites or fname in seen:
      return ""
    call = sites[0]
    prefix = self.call_prefix(self.enclosing_func(call), seen + (fname,))
    own = name_of(call.location)
    result = self._prefixes[fname] = f"{prefix}/{own}" if prefix and own else (prefix or own)
    return result

  def enclosing_func(self, op):
    """The name of the function `op` is in."""
    op = op.parent
    while op is not None and op.name != "func.func":
      op = op.parent
    return func_name(op) if op is not None else "main"

  def around(self, op):
    """The ops enclosing `op`, innermost first, leaving an outlined function through its first call site."""
    cur = op.parent
    while cur is not None:
      yield cur
      if cur.name == "func.func":
        calls = self.calls.get(func_name(cur))
        cur = calls[0] if calls else None
      else:
        cur = cur.parent

  def runs_before(self, a, b):
    """Whether dot `a` runs before dot `b` in the network: the ops around each, from @main inward (through the first
    call sites of outlined functions), compared where they first part in one block."""
    chain_a, chain_b = self._chain(a), self._chain(b)
    for x, y in zip(chain_a, chain_b):
      if x != y:
        return x.block == y.block and x.is_before_in_block(y)
    return False

  def _chain(self, op):
    return [o for o in reversed([op, *self.around(op)]) if o.name != "func.func"]

  def loop_of(self, op):
    """The innermost stablehlo.while around `op`, through the first call site of outlined functions; None if none."""
    return next((o for o in self.around(op) if o.name == "stablehlo.while"), None)


def specialize_call_sites(module) -> "CallGraph":
  """Give each call of a function that holds a dot_general a copy of its own (`<name>_site<k>`), so that every dot is
  analysed and rewritten in its own calling context: one jitted `dense` helper applied to 8 layers is 8 layers, each
  with its weight, its block and its decision. For the pipeline's clone, never the user's module; returns the call
  graph of the specialized module (for analyze: one walk of the module less). JAX lowers no recursion, so this
  ends."""
  while True:
    graph = CallGraph(module)
    holds_dot = {fname for fname, _ in graph.dots()}
    calls = [(fname, ir.FlatSymbolRefAttr(op.attributes["callee"]).value) for fname, op in graph.order
             if op.name == "func.call"]
    grown = True
    while grown:  # a function holds a dot when it or anything it calls does
      grown = bool({caller for caller, callee in calls if callee in holds_dot} - holds_dot)
      holds_dot |= {caller for caller, callee in calls if callee in holds_dot}
    shared = [(callee, sites) for callee, sites in graph.calls.items()
              if len(sites) > 1 and callee in holds_dot and callee in graph.funcs]
    if not shared:
      return graph
    for callee, sites in shared:
      for k, site in enumerate(sites[1:], start=1):
        copy = graph.funcs[callee].operation.clone()
        name = f"{callee}_site{k}"
        while name in graph.funcs:
          name += "_"
        copy.attributes["sym_name"] = ir.StringAttr.get(name)
        module.body.append(copy)
        graph.funcs[name] = copy
        site.attributes["callee"] = ir.FlatSymbolRefAttr.get(name)
