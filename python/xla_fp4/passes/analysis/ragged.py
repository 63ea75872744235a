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
- a dense MoE's up projection (`BSM,EMH->BSEH`, every token meets every expert): the expert is a free dim of the
  weight, which an attention projection's heads are too (`BTD,DNH->BTNH`); it is an expert dim where the output's dim
  flows, through element-wise ops, into a batch dim of an expert GEMM (the down projection `BSEH,EHM->BSEM`), while
  heads flow into attention's dots, which read no weight. Its dgrad pairs the gradient's expert dim with the weight's,
  its wgrad has it free in the gradient: Grouping.SLICES with `free` dims (`dense_expert_groups`);
- a chlo.ragged_dot: lhs rows in groups times one rhs matrix per group (forward, dgrad: Grouping.RAGGED_ROWS), or
  both operands' rows in groups, contracted per group (wgrad: Grouping.RAGGED_CONTRACTING).
The rewrite quantizes what the grouping says per slice or group; forms it does not take have no Groups.
"""

import math

from jax._src.lib.mlir import ir

from xla_fp4.passes.analysis.callgraph import defining_op, shape, unforwarded, users
from xla_fp4.passes.analysis.records import Grouping, Groups, Role
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


def expansion_mask(op):
  """(operand, i1 mask shaped like it) of the first operand of `op` that is masked per group in full: a ragged dot's
  CPU expansion, whose GEMM runs over the groups as the program has it (rewrite/experts.py); else None."""
  for i in (0, 1):
    mask = group_mask(op.operands[i])
    if mask is not None and shape(mask) == shape(op.operands[i]):
      return i, mask
  return None


def unmasked(value):
  """The tensor a group-masked operand masks (x, before the broadcast to every group), else `value` itself: the
  forward, dgrad and wgrad of one expert layer mask the same activations and gradients."""
  return unmasked_and_masked(value)[0]


def unmasked_and_masked(value):
  """(unmasked(value), is_group_masked(value)), from one look at what produces `value`."""
  select = _masking_select(value)
  if select is None:
    return value, False
  op = defining_op(select.operands[1])
  return (op.operands[0] if op is not None and op.name == "stablehlo.broadcast_in_dim" else value), True


def _group_dim(value):
  """The dim of a group-masked operand that numbers the groups: the one its broadcast adds (None if not one)."""
  select = _masking_select(value)
  op = defining_op(select.operands[1]) if select is not None else None
  if op is None or op.name != "stablehlo.broadcast_in_dim" or shape(value) != shape(op.results[0]):
    return None
  kept = set(ir.DenseI64ArrayAttr(op.attributes["broadcast_dimensions"]))
  added = [d for d in range(len(shape(value))) if d not in kept]
  return added[0] if len(added) == 1 else None


def groups(op, linear, masked=(True, True)) -> "Groups | None":
  """The Groups of a dot_general or chlo.ragged_dot (`linear`: it is a linear layer's GEMM), None where it has none
  or a form the grouped rewrite does not take. `masked`: whether each operand may be group-masked (False where the
  caller has seen that it is not: no second look)."""
  if op.name == "chlo.ragged_dot":
    return _ragged_groups(op)
  (lc, rc), (lb, rb) = dot_dims(op)
  partner = dict(zip(lc + lb, rc + rb))
  partner.update({v: k for k, v in zip(lc + lb, rc + rb)})
  for side in (0, 1):
    d = _group_dim(op.operands[side]) if masked[side] else None
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


def dense_expert_groups(graph, dots, found):
  """{dot index: Groups} of the expert GEMMs whose expert dim is a free dim of the weight (the module docstring):
  each fprop without Groups whose weight has a free dim that reaches a batch dim of an expert GEMM (a linear layer
  whose Groups in `found`, {dot index: Groups}, pair batch dims), and its dgrad and wgrad, read through their
  gradient operand, which has the fprop's output shape."""
  experts = {dots[i].op for i, g in found.items() if g is not None and g.kind is Grouping.SLICES
             and dots[i].role is Role.FPROP and dot_dims(dots[i].op)[1][0]}
  out = {}
  backward = {}  # fprop index -> its dgrads and wgrads
  for j, b in enumerate(dots if experts else ()):
    if b.partner is not None and b.op.name == "stablehlo.dot_general":
      backward.setdefault(b.partner, []).append(j)
  for i, d in enumerate(dots if experts else ()):
    if d.role is not Role.FPROP or found.get(i) is not None or d.op.name != "stablehlo.dot_general":
      continue
    (lc, rc), (lb, rb) = dot_dims(d.op)
    if lb:
      continue
    dims_out = _output_dims(d.op)
    weight_free = [p for p, (side, dim) in enumerate(dims_out) if side == d.w]
    position = next((p for p in weight_free if _reaches_expert_batch(graph, d.op.results[0], p, experts)), None)
    if position is None:
      continue
    k = math.prod(shape(d.op.operands[0])[c] for c in lc)
    out[i] = Groups(kind=Grouping.SLICES, lhs=(), rhs=(), k=k, free=(dims_out[position],))
    for j in backward.get(i, ()):
      groups = _backward_groups(dots[j], position, shape(d.op.results[0]))
      if groups is not None:
        out[j] = groups
  return out


def _output_dims(op):
  """(operand, dim) of each dim of a dot_general's result, in order: batch (as the lhs's), lhs free, rhs free."""
  (lc, rc), (lb, rb) = dot_dims(op)
  free = [[(side, x) for x in range(len(shape(op.operands[side])))
           if x not in (lc, rc)[side] and x not in (lb, rb)[side]] for side in (0, 1)]
  return [(0, x) for x in lb] + free[0] + free[1]


def _reaches_expert_batch(graph, value, position, experts, depth=0, seen=None):
  """Whether dim `position` of `value` reaches, through ops that keep its shape (element-wise ops, the calls of
  outlined activations), a batch dim of a dot in `experts`."""
  seen = set() if seen is None else seen
  if depth > 12 or value in seen:
    return False
  seen.add(value)
  for op, number in users(value):
    if op in experts:
      (_, _), (lb, rb) = dot_dims(op)
      if position in (lb, rb)[number]:
        return True
      continue
    if op.name == "func.call":
      callee = graph.callee(op)
      if callee is not None and _reaches_expert_batch(graph, callee.regions[0].blocks[0].arguments[number],
                                                      position, experts, depth + 1, seen):
        return True
    if op.name == "func.return":
      continue
    for result in op.results:
      if shape(result) == shape(value) and _reaches_expert_batch(graph, result, position, experts, depth + 1, seen):
        return True
  return _returned(graph, value, position, experts, depth, seen)


def _returned(graph, value, position, experts, depth, seen):
  """A value an outlined function returns continues as the results of that function's calls."""
  for op, number in users(value):
    if op.name == "func.return":
      for call in graph.calls.get(graph.enclosing_func(op), ()):
        if _reaches_expert_batch(graph, call.results[number], position, experts, depth + 1, seen):
          return True
  return False


def _backward_groups(b, position, out_shape):
  """The Groups of a dgrad or wgrad of a dense expert fprop whose output's expert dim is `position`: read through its
  gradient operand (the fprop's output shape), paired with the weight's dim in a dgrad, free in a wgrad."""
  g = 1 - b.w if b.role is Role.DGRAD else b.gradient if b.role is Role.WGRAD else None
  if g is None or shape(b.op.operands[g]) != out_shape:
    return None
  (lc, rc), (lb, rb) = dot_dims(b.op)
  mine, other = ((lc, lb), (rc, rb)) if g == 0 else ((rc, rb), (lc, lb))
  k = math.prod(shape(b.op.operands[0])[c] for c in lc)
  for dims, partners in zip(mine, other):
    if position in dims:
      partner = partners[dims.index(position)]
      lhs, rhs = (position, partner) if g == 0 else (partner, position)
      left = [c for c in lc if c != lhs]
      if not left:
        return None
      return Groups(kind=Grouping.SLICES, lhs=(lhs,), rhs=(rhs,), k=math.prod(shape(b.op.operands[0])[c] for c in left))
  return Groups(kind=Grouping.SLICES, lhs=(), rhs=(), k=k, free=((g, position),)) if b.role is Role.WGRAD else None


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
