"""Ragged dots: how `jax.lax.ragged_dot` (grouped GEMMs: MoE experts) reaches the pass, so that it is decided alike on
every platform.

On CUDA, XLA keeps `chlo.ragged_dot`, which is no dot_general: the pass leaves it in high precision. On CPU JAX
expands it into dot_generals with a group dim whose operand is masked per group:

  %mask = and(compare LE, %starts, %iota), compare LT, %iota, %ends)   ; %iota along the rows, bounds from the groups
  %xg   = stablehlo.select %mask, broadcast(%x), broadcast(0.0)        ; row r of group g: x's row where r is in g
  %y    = stablehlo.dot_general %xg, %w, contracting_dims = [2, 0] x [1, 0]

A dot with such an operand (its forward, dgrad and wgrad alike) is `ragged`: the policy keeps it in high precision
until the recipe's grouped form exists, so that CPU emulation predicts the GPU run.
"""

from jax._src.lib.mlir import ir

from xla_fp4.passes.analysis.callgraph import defining_op, unforwarded

_MASK_OPS = {"stablehlo.and", "stablehlo.or", "stablehlo.compare", "stablehlo.broadcast_in_dim", "stablehlo.reshape"}


def is_group_masked(value) -> bool:
  """Whether `value` is, through pass-through ops, select(mask from an iota, x, zero): a ragged dot's operand."""
  op = defining_op(unforwarded(value))
  return op is not None and op.name == "stablehlo.select" and _is_zero(op.operands[2]) and _from_iota(op.operands[0])


def _is_zero(value):
  """A broadcast (or not) of a constant 0."""
  op = defining_op(value)
  while op is not None and op.name == "stablehlo.broadcast_in_dim":
    op = defining_op(op.operands[0])
  if op is None or op.name != "stablehlo.constant":
    return False
  attr = ir.DenseElementsAttr(op.attributes["value"])
  if not attr.is_splat or not isinstance(ir.RankedTensorType(attr.type).element_type, ir.FloatType):
    return False
  return ir.FloatAttr(attr.get_splat_value()).value == 0.0


def _from_iota(value, depth=0):
  """Whether a predicate is built from comparisons with an iota (row positions against group bounds)."""
  op = defining_op(value)
  if op is None or depth > 8:
    return False
  if op.name == "stablehlo.iota":
    return True
  if op.name not in _MASK_OPS:
    return False
  return any(_from_iota(o, depth + 1) for o in op.operands)
