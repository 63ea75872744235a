"""Roles: which dots are a linear layer's fprop, dgrad or wgrad, and which is `other` (docs/design.md §4).

- fprop: a forward dot with an operand that traces to a @main argument (trace.py). Where both do (a first layer fed
  the raw input), the weight is the one a backward dot takes the gradient of: it has the operand's shape and reads the
  other operand (the wgrad); with no such evidence the rhs (x @ W).
- pairing: a backward dot pairs with the fprops of the same source frame (names.same_frame) and, where the name stack
  names the layer (linen, named scopes), of the same layer path. It is dgrad when an operand traces to the fprop's
  weight argument (a weight read by several fprops: the fprop whose activation a sibling backward dot reads together
  with this dot's gradient); wgrad when its result has the weight's shape (up to a permutation) and it shares the
  gradient operand with that layer's dgrad or reads the fprop's activation and the dgrad's gradient (values compared
  by trace.root), else the last not yet paired fprop of that shape (JAX transposes in reverse program order), unless
  it reads an operand of a forward product of two activations (then it is that product's transpose). Without a
  forward partner (custom_vjp, hand-written backward) the dot is `other`: the conservative choice.
"""

import dataclasses

from xla_fp4.passes.analysis import names
from xla_fp4.passes.analysis import ragged
from xla_fp4.passes.analysis.callgraph import shape
from xla_fp4.passes.analysis.records import Phase, Role
from xla_fp4.passes.analysis.trace import root


class Operand:
  """Per-operand facts: the same for every dot that reads the value (q, k and v read one input), so found once."""

  def __init__(self, graph, tracer, value):
    self.source = tracer.trace(value)  # trace.Source, or None
    # a ragged dot's CPU expansion masks the same tensors per group in every dot of the layer: compare what it masks
    tensor, self.masked = ragged.unmasked_and_masked(value)
    self.root = root(graph, tensor)


class Dot:
  """Per-dot facts gathered before classification. `operands`: the Operand of its lhs and rhs."""

  def __init__(self, fname, op, frames, stack, operands):
    self.fname, self.op, self.stack, self.sources = fname, op, stack, [o.source for o in operands]
    self.frames = frames  # names.frames_of its location
    self.path = names.layer_path(stack)
    self.phase = names.phase_of(stack)
    self.roots = [o.root for o in operands]
    self.masked = tuple(o.masked for o in operands)
    self.ragged = op.name == "chlo.ragged_dot" or any(self.masked)
    self.out_shape = shape(op.results[0])
    self.role, self.w, self.src, self.partner = Role.OTHER, None, None, None
    self.gradient = 0  # a wgrad's output-gradient operand


def classify_forward(dots):
  """Forward dots: fprop when an operand is a parameter (see the module docstring), else other."""
  backward = [d for d in dots if d.phase is Phase.BACKWARD]
  for d in dots:
    if d.phase is Phase.FORWARD:
      d.w = 1 if d.sources[1] is not None else (0 if d.sources[0] is not None else None)
      if d.sources[0] is not None and d.sources[1] is not None:
        evidence = [k for k in (0, 1) if any(sorted(b.out_shape) == sorted(shape(d.op.operands[k])) and
                                             d.roots[1 - k] in b.roots for b in backward)]
        if len(evidence) == 1:
          d.w = evidence[0]
      if d.w is not None:
        d.role, d.src = Role.FPROP, d.sources[d.w]


def pair_backward(dots):
  """Classify backward dots against the forward linear dots (fprops) of the same source frame: dgrad when an operand
  is the fprop's weight; wgrad when the result has the weight's shape and the dot shares the gradient with the layer's
  dgrad, or the activation with the fprop (value identity through pass-through ops); with no dataflow link, the last
  not yet paired fprop of that shape (JAX transposes in reverse program order). Anything else stays `other`."""
  forward, forward_layer = {}, {}  # innermost frame (and layer path) -> forward dots
  for j, d in enumerate(dots):
    if d.phase is Phase.FORWARD and d.frames:
      forward.setdefault(d.frames[0], []).append(j)
      forward_layer.setdefault((d.frames[0], d.path), []).append(j)
  backward = [i for i, d in enumerate(dots) if d.phase is Phase.BACKWARD]
  cands = {}
  for i in backward:
    d = dots[i]
    bucket = forward.get(d.frames[0] if d.frames else None, ())
    # Where a forward dot of the frame carries the same layer path (linen, named scopes), only that layer pairs.
    same_path = forward_layer.get((d.frames[0], d.path), []) if d.frames and d.path else []
    same_frame = [j for j in same_path if names.same_frame(d.frames, dots[j].frames)]
    if not same_frame:
      same_frame = [j for j in bucket if names.same_frame(d.frames, dots[j].frames)]
    cands[i] = [j for j in same_frame if dots[j].role is Role.FPROP]
    if not cands[i] and d.ragged:
      # JAX lowers a ragged dot's CPU expansion once per signature and reuses it with the first call's source
      # frames (the forward's first call, the backward's first transpose): pair it by dataflow alone
      cands[i] = [j for j, f in enumerate(dots) if f.role is Role.FPROP and f.ragged]
  candidates = cands.__getitem__

  for i in backward:
    d = dots[i]
    matches = [(j, k) for j in candidates(i) for k in (0, 1)
               if d.sources[k] is not None and d.sources[k].arg == dots[j].src.arg]
    if len({j for j, _ in matches}) > 1:
      # One weight read by several fprops (x @ w and h @ w): the dgrad belongs to the fprop whose activation a
      # sibling backward dot (its wgrad) reads together with this dgrad's gradient.
      linked = [(j, k) for j, k in matches
                if any(o != i and d.roots[1 - k] in dots[o].roots and dots[j].roots[1 - dots[j].w] in dots[o].roots
                       for o in backward)]
      matches = linked or matches
    if matches:
      j, k = matches[0]
      d.role, d.w, d.src, d.partner = Role.DGRAD, k, d.sources[k], j
  claimed = set()
  # Operands of forward products of two activations (no weight): a backward dot without a value link to a layer
  # that reads one of these is that product's transpose, not a wgrad.
  products = {r for d in dots if d.phase is Phase.FORWARD and d.role is Role.OTHER for r in d.roots}
  gradients = {}  # fprop index -> the gradient operand roots of its dgrads
  dgrads = {}  # fprop index -> its dgrads, program order
  for k in backward:
    if dots[k].role is Role.DGRAD:
      gradients.setdefault(dots[k].partner, []).append(dots[k].roots[1 - dots[k].w])
      dgrads.setdefault(dots[k].partner, []).append(k)
  for i in backward:
    d = dots[i]
    if d.role is not Role.OTHER:
      continue
    shaped = [j for j in candidates(i)
              if sorted(d.out_shape) == sorted(shape(dots[j].op.operands[dots[j].w]))]
    if not shaped:
      continue
    partner = None
    for g in sorted(k for j in set(shaped) for k in dgrads.get(j, ())):
      grad = dots[g].roots[1 - dots[g].w]
      if any(grad == r for r in d.roots):
        partner = dots[g].partner
        break
    if partner is None:  # reads the layer's activation, and (where the layer has a dgrad) the dgrad's gradient
      partner = next((j for j in shaped if any(dots[j].roots[1 - dots[j].w] == r for r in d.roots) and
                      all(g in d.roots for g in gradients.get(j, [g for g in d.roots]))), None)
    if partner is None:
      if any(r in products for r in d.roots):
        continue  # no link to a layer, and it reads what a product of activations (h @ h.T) reads: its transpose
      free = [j for j in shaped if j not in claimed]
      partner = (free or shaped)[-1]
    claimed.add(partner)
    d.role, d.partner = Role.WGRAD, partner
    d.gradient = _gradient_operand(d, dots[partner], gradients.get(partner, ()))
    d.src = _local_source(dots, d, dots[partner].src)


def _gradient_operand(wgrad, fprop, gradients):
  """Which operand of a wgrad is the output gradient: the one its layer's dgrad reads, else the one that is not the
  layer's activation, else JAX's convention for dot_general (the lhs; its ragged_dot puts it on the rhs)."""
  for k in (0, 1):
    if wgrad.roots[k] in gradients:
      return k
  activation = fprop.roots[1 - fprop.w]
  for k in (0, 1):
    if wgrad.roots[k] == activation:
      return 1 - k
  return 1 if wgrad.op.name == "chlo.ragged_dot" else 0


def _local_source(dots, wgrad, src):
  """The weight source of a wgrad, with a per-iteration block value from the wgrad's own loop body: the wgrad has no
  weight operand, so take it from a dot in the same block (the same outlined scan function on jax 0.10, the same
  while body on jax 0.12, which inlines scan bodies) that slices the same stacked weight, or another stacked weight
  of the same size (one scan iteration slices every stacked weight at the same index)."""
  if src.stacked is None:
    return src
  local = [s for d in dots if d.fname == wgrad.fname and d.op.block == wgrad.op.block
           for s in d.sources if s is not None and s.index is not None]
  for s in local:
    if s.arg == src.arg:
      return s
  for s in local:
    if s.stacked == src.stacked:
      return dataclasses.replace(s, arg=src.arg)
  return dataclasses.replace(src, index=None, entry_call=None)
