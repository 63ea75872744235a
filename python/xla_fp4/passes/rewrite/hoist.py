"""Hoisting: moving the pure ops that compute some values above an op of their block, so that a new op placed there
can read them (pairs.py: a wgrad's scale and key above its dgrad's quantizer; cases.py: a dot's operands above an
earlier kept-iteration case). Moving a pure op earlier changes no number: its operands are computed first either way.
"""

import functools

from jax._src.lib.mlir import ir

_MOVABLE = ("stablehlo.", "func.call")  # pure ops (side-effecting custom calls aside) and the twins' calls


def before(op, values, forbidden):
  """Move the ops of `op`'s block after it that compute `values` above it, in program order; False (nothing moved)
  where one of them cannot move: one of `forbidden`, an op with side effects or with regions (a reduction's aside)."""
  cone = _cone(op, values, forbidden)
  if cone is None:
    return False
  for moved in cone:
    moved.move_before(op)
  return True


def acts_on_host(op):
  """Whether `op` is a custom call with side effects (telemetry's): XLA must neither move nor remove it."""
  return "has_side_effect" in op.attributes and ir.BoolAttr(op.attributes["has_side_effect"]).value


def _cone(first, values, forbidden):
  cone, stack = set(), list(values)
  while stack:
    v = stack.pop()
    owner = v.owner
    if not isinstance(owner, ir.Operation):
      owner = getattr(owner, "operation", None)
    if owner is None or owner.block != first.block or owner.is_before_in_block(first):
      continue  # a block argument, a value of an enclosing block, or one made before `first`
    if owner in forbidden:
      return None
    if owner in cone:
      continue
    name = owner.name
    if not name.startswith(_MOVABLE) or acts_on_host(owner) or (len(owner.regions) and name != "stablehlo.reduce"):
      return None
    cone.add(owner)
    stack.extend(owner.operands)
  order = lambda a, b: -1 if a.is_before_in_block(b) else 1  # noqa: E731
  return sorted(cone, key=functools.cmp_to_key(order))
