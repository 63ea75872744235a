"""Where a value can be used: the one rule of MLIR regions that both the analysis (may a block index be brought to a
dot?) and the rewrite (may an earlier value be reused at a dot? does the built module read across an isolated
region?) apply.

Ops whose regions are isolated from above (ISOLATED: functions and shard_map bodies) see nothing defined outside; what
such a body needs comes in as the op's operands, bound to its block arguments.
"""

from jax._src.lib.mlir import ir

ISOLATED = frozenset({"func.func", "sdy.manual_computation"})


def op_of(value_or_owner):
  """The ir.Operation behind an op view or operation."""
  return value_or_owner.operation if hasattr(value_or_owner, "operation") else value_or_owner


def is_argument(value):
  """Whether `value` is a block argument. The bindings hand values out as OpResult or BlockArgument, which isinstance
  tells apart at a tenth of the cost of reading the owner (each read builds a binding object)."""
  if isinstance(value, ir.BlockArgument):
    return True
  return not isinstance(value, ir.OpResult) and isinstance(value.owner, ir.Block)


def in_scope(value, op):
  """Whether `value` is defined in a block around `op` (before `op` where it is op's own block), crossing shard_map
  bodies: what `thread` (rewrite/scope.py) can bring to `op` as shard_map operands."""
  return _defined_around(value, op, stop=("func.func",))


def visible(value, op):
  """Whether `op` can use `value` as it stands: defined in a block around it, before it in its own block, and not
  outside an op isolated from above (ISOLATED) that holds `op`."""
  return _defined_around(value, op, stop=ISOLATED)


def _defined_around(value, op, stop):
  if isinstance(value.owner, ir.Block):
    vblock, vop = value.owner, None
  else:
    vop = op_of(value.owner)
    vblock = vop.block
  cur = op
  while cur is not None:
    if cur.block == vblock:
      return vop is None or vop.is_before_in_block(cur)
    cur = cur.parent
    if cur is not None and cur.name in stop:
      return False
  return False
