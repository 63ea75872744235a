"""Cases: a scanned stack's kept-iteration cases that select alike, merged into one where their dots are independent.

The packed forms of a stack with kept blocks put each dot in a case of its own (emitter.py _in_case): the original
dot in kept iterations, the FP4 pattern in the others. A value that several dots read is then quantized in several
regions, which neither XLA's CSE nor pairs.py can share: the q, k and v projections quantize their input three times,
an output gradient's dgrad and wgrad cannot take one pair quantizer. Once every dot is rewritten, each case is merged
into an earlier case of its block with the same selector, where it does not read that case's results:

  %i0 = select(%kept, 0, 1); %a = case(%i0) {dot A}, {A's pattern}
  ... %d = transpose(%dy) ...
  %i1 = select(%kept, 0, 1); %b = case(%i1) {dot B}, {B's pattern}
->
  %d = transpose(%dy)                                  (B's operands, pure ops that do not read %a, moved above)
  %a, %b = case(%i0) {dot A; dot B}, {A's pattern; B's pattern}

Each iteration runs the same dots, with the same operands, as before: no number changes. A case whose branches act on
the host (telemetry's records) is not merged: merging would move its effects before the ops between the two cases.
"""

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

from xla_fp4.passes.rewrite import hoist


def merge(cases):
  """Merge `cases` [(case op, kept-iteration predicate)], in program order, as the module docstring says; returns how
  many were merged into another."""
  open_cases, merged = {}, 0  # (block, predicate) -> the case later ones merge into
  for case, kept in cases:
    if _acts_on_host(case):
      continue
    key = (case.block, kept)
    into = open_cases.get(key)
    if into is not None:
      combined = _merged(into, case)
      if combined is not None:
        open_cases[key] = combined
        merged += 1
        continue
    open_cases[key] = case
  return merged


def _merged(first, second):
  """One case with both cases' branches and results, where `first`'s place holds it; None (nothing changed) where
  `second` reads `first` or an operand of it cannot move above `first`."""
  captured = list(second.operands) + [v for op in _ops_within(second) for v in op.operands]
  if not hoist.before(first, captured, {first}):
    return None
  with ir.InsertionPoint(first), first.location:
    case = hlo.CaseOp([r.type for r in list(first.results) + list(second.results)], first.operands[0], 2)
  if "mhlo.frontend_attributes" in first.attributes:  # the branches' run counts (sharding/cost.py BRANCH_RUNS)
    case.attributes["mhlo.frontend_attributes"] = first.attributes["mhlo.frontend_attributes"]
  for i in range(2):
    blocks = [first.regions[i].blocks[0], second.regions[i].blocks[0]]
    returns = [b.operations[len(b.operations) - 1] for b in blocks]
    with ir.InsertionPoint(case.regions[i].blocks.append()):
      end = hlo.ReturnOp([v for r in returns for v in r.operands])
    for b in blocks:
      for op in list(b.operations)[:-1]:
        op.move_before(end.operation)
  for j, r in enumerate(list(first.results) + list(second.results)):
    r.replace_all_uses_with(case.results[j])
  first.erase()
  second.erase()
  return case.operation


def _ops_within(op):
  """Every op nested in `op`'s regions."""
  found = []
  for region in op.regions:
    for block in region.blocks:
      for inner in block.operations:
        found.append(inner.operation)
        found.extend(_ops_within(inner.operation))
  return found


def _acts_on_host(case):
  return any(hoist.acts_on_host(op) for op in _ops_within(case))
