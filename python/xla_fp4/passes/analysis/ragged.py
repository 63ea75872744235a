"""Ragged dots: how `jax.lax.ragged_dot` (grouped GEMMs: MoE experts) reaches the pass, so that it is decided alike on
every platform.

On CUDA, XLA keeps `chlo.ragged_dot`, which is no dot_general: the pass leaves it in high precision. On CPU JAX
expands it into dot_generals with a group dim whose operand is masked per group:

  %mask = and(compare LE, %starts, %iota), compare LT, %iota, %ends)   ; %iota along the rows, bounds from the groups
  %xg   = stablehlo.select %mask, broadcast(%x), broadcast(0.0)        ; row r of group g: x's row where r is in g
  %y    = stablehlo.dot_general %xg, %w, contracting_dims = [2, 0] x [1, 0]

A dot with such an operand (its forward, dgrad and wgrad alike) is `ragged`. Its `Groups` say along which dims each
slice of an operand is a matrix of its own, with its own global decode scale (numerics/grouped.py):
- the CPU expansion: the masked operand's group dim (the one the broadcast adds) and its partner in the other operand
  (contracted in the forward and dgrad, a batch dim in the wgrad): Grouping.SLICES;
- an expert einsum (`ecd,edf->ecf`): a linear layer's batch dims, one matrix per expert: Grouping.SLICES;
- a chlo.ragged_dot: lhs rows in groups times one rhs matrix per group (forward, dgrad: Grouping.RAGGED_ROWS), or
  both operands' rows in groups, contracted per group (wgrad: Grouping.RAGGED_CONTRACTING).
The rewrite quantizes what the grouping says per slice or group; forms it does not take have no Groups.
"""

import math

from jax._src.lib.mlir import ir

from xla_fp4.passes.analysis.callgraph import defining_op, shape, unforwarded
from xla_fp4.passes.analysis.records import Grouping, Groups
from xla_fp4.passes.analysis.trace import dot_dims, ragged_dot_dims

_MASK_OPS = {"stablehlo.and", "stablehlo.or", "stablehlo.compare", "stablehlo.broadcast_in_dim", "stablehlo.reshape"}


def _masking_select(value):
  """The select(mask from an iota, x, zero) that `value` is through pass-through ops, else None."""
  op = defining_op(unforwarded(value))
  if op is not None and op.name == "stablehlo.select" and _is_zero(op.operands[2]) and _from_iota(op.operands[0]):
    return op
  return None


def is_group_masked(value) -> bool:
  """Whether `value` is, through pass-through ops, select(mask from an iota, x, zero): a ragged dot's operand."""
  return _masking_select(value) is not None


def group_mask(value):
  """The i1 mask of a group-masked operand (true where the element belongs to the slice's group), else None."""
  select = _masking_select(value)
  return None if select is None else select.operands[0]


def unmasked(value):
  """The tensor a group-masked operand masks (x, before the broadcast to every group), else `value` itself: the
  forward, dgrad and wgrad of one expert layer mask the same activations and gradients."""
  select = _masking_select(value)
  if select is None:
    return value
  op = defining_op(select.operands[1])
  return op.operands[0] if op is not None and op.name == "stablehlo.broadcast_in_dim" else value


def _group_dim(value):
  """The dim of a group-masked operand that numbers the groups: the one its broadcast adds (None if not one)."""
  select = _masking_select(value)
  op = defining_op(select.operands[1]) if select is not None else None
  if op is None or op.name != "stablehlo.broadcast_in_dim" or shape(value) != shape(op.results[0]):
    return None
  kept = set(ir.DenseI64ArrayAttr(op.attributes["broadcast_dimensions"]))
  added = [d for d in range(len(shape(value))) if d not in kept]
  return added[0] if len(added) == 1 else None


def groups(op, linear) -> "Groups | None":
  """The Groups of a dot_general or chlo.ragged_dot (`linear`: it is a linear layer's GEMM), None where it has none
  or a form the grouped rewrite does not take."""
  if op.name == "chlo.ragged_dot":
    return _ragged_groups(op)
  (lc, rc), (lb, rb) = dot_dims(op)
  partner = dict(zip(lc + lb, rc + rb))
  partner.update({v: k for k, v in zip(lc + lb, rc + rb)})
  for side in (0, 1):
    d = _group_dim(op.operands[side])
    if d is not None and d in partner:
      found = (d, partner[d]) if side == 0 else (partner[d], d)
      return _slices(op, found[:1], found[1:], lc, rc)
  if lb and linear:
    return _slices(op, lb, rb, lc, rc)
  return None


def _slices(op, lhs, rhs, lc, rc):
  """Grouping.SLICES when every slice has a contraction left to quantize along (one or more dims, merged)."""
  left = [d for d in lc if d not in lhs]
  if not left:
    return None
  return Groups(kind=Grouping.SLICES, lhs=tuple(lhs), rhs=tuple(rhs),
                k=math.prod(shape(op.operands[0])[d] for d in left))


def _ragged_groups(op):
  """JAX's ragged dots (jax.lax.ragged_dot and its transposes): lhs [M, K] ragged along its rows."""
  ((lc, rc), (lb, rb)), rhs_groups, lhs_ragged = ragged_dot_dims(op)
  if lb or rb or lhs_ragged != (0,) or len(shape(op.operands[0])) != 2 or len(lc) != 1:
    return None
  k = shape(op.operands[0])[lc[0]]
  if rhs_groups == (0,) and lc == (1,) and len(shape(op.operands[1])) == 3:
    return Groups(kind=Grouping.RAGGED_ROWS, lhs=(0,), rhs=rhs_groups, k=k)
  if not rhs_groups and lc == (0,) and rc == (0,) and len(shape(op.operands[1])) == 2:
    return Groups(kind=Grouping.RAGGED_CONTRACTING, lhs=(0,), rhs=(0,), k=k)
  return None


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
