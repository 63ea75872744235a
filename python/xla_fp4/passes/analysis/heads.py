"""Heads: the output head is a linear layer whose output reaches the loss with no other dot in between
(docs/design.md §3), found from the dataflow of its gradient, whatever its name.

In a gradient step a head's backward dots take a gradient that no other backward dot has touched: the slice upstream
of their gradient operand holds forward dots only (the activations the loss is computed from), where any layer
between this one and the loss would have put its dgrad. In a program without backward dots (an eval or sampling
step) a head's output reaches a scalar result of @main (a loss) through no dot, or, where no layer's does, any
result (logits, sampled tokens). Where the dataflow cannot be followed to its end the
layer name (`head`, `logits`, ...) breaks the tie, and the reason says so.
"""

import collections

from jax._src.lib.mlir import ir

from xla_fp4.passes.analysis import names
from xla_fp4.passes.analysis.callgraph import Binding, CallGraph, defining_op, shape, terminator, users
from xla_fp4.passes.analysis.records import Phase, Role
from xla_fp4.passes.analysis.trace import dot_dims
from xla_fp4.passes.regions import is_argument


DOTS = ("stablehlo.dot_general", "chlo.ragged_dot")


class Dataflow:
  """Walks over values across functions, loops and branches, cut at dots (dot_generals and ragged dots)."""

  LIMIT = 20000  # values visited per walk; beyond it the answer is "inconclusive"

  def __init__(self, graph):
    self.graph = graph

  def no_dot_upstream(self, value, barrier):
    """Whether the slice upstream of `value`, cut at every dot_general, reaches no dot for which `barrier(op)` holds:
    True, False, or None when the slice could not be followed to its end. Calls are followed in context: a callee's
    argument entered through one call's result leads back to that call's operand only."""
    todo, seen = collections.deque([(value, ())]), set()  # breadth first: the nearest dot decides most walks
    while todo:
      v, calls = todo.popleft()
      key = (v, calls[-1:])
      if key in seen:
        continue
      seen.add(key)
      if len(seen) > self.LIMIT:
        return None
      if is_argument(v):
        origin = self.graph.argument_origin(v)
        if origin.binding is Binding.FUNCTION:
          if calls:  # entered through this call's result: back to its operand only
            todo.append((origin.operand(calls[-1]), calls[:-1]))
          else:
            todo.extend((origin.operand(call), ()) for call in origin.calls)
        elif origin.binding is Binding.LOOP:
          todo.append((origin.operand(), calls))
          todo.append((origin.loop_carried(), calls))
        elif origin.binding is Binding.MANUAL:
          todo.append((origin.operand(), calls))
        elif origin.binding is not Binding.MAIN:
          return None
        continue
      op = defining_op(v)
      name = op.name
      if name in DOTS:
        if barrier(op):
          return False
        continue
      if name == "func.call":
        inner = self.graph.returned(op, ir.OpResult(v).result_number)
        if inner is None:
          return None
        todo.append((inner, calls + (op,)))
      elif name in ("stablehlo.while", "stablehlo.case", "stablehlo.if", "sdy.manual_computation"):
        number = ir.OpResult(v).result_number
        body = [1] if name == "stablehlo.while" else range(len(op.regions))
        todo.extend((terminator(op.regions[r]).operands[number], calls) for r in body)
        todo.extend((o, calls) for o in op.operands)
      else:
        todo.extend((o, calls) for o in op.operands)
    return True

  def reaches_result(self, value, scalar):
    """True when `value` reaches a result of @main (with `scalar`, a scalar one: a loss) through no dot; False when it
    does not; None when the walk could not finish."""
    todo, seen = [value], set()
    while todo:
      v = todo.pop()
      if v in seen:
        continue
      seen.add(v)
      if len(seen) > self.LIMIT:
        return None
      for user, i in users(v):
        if user.name in DOTS:
          continue
        if user.name == "func.return":
          fname = self.graph.enclosing_func(user)
          if fname == "main":
            if not scalar or not shape(v):
              return True
            continue
          todo.extend(call.results[i] for call in self.graph.calls.get(fname, []))
        elif user.name in ("stablehlo.return", "sdy.return"):
          parent = user.parent
          if parent is None:
            return None
          if parent.name == "stablehlo.while" and user.block == parent.regions[0].blocks[0]:
            continue  # the loop condition
          todo.append(parent.results[i])
        elif user.name == "func.call":
          callee = self.graph.callee(user)
          if callee is None:
            return None
          todo.append(callee.regions[0].blocks[0].arguments[i])
        elif user.name == "stablehlo.while":
          todo.append(user.results[i])
          todo.append(user.regions[1].blocks[0].arguments[i])
        elif user.name == "sdy.manual_computation":
          todo.append(user.regions[0].blocks[0].arguments[i])
        else:
          todo.extend(user.results)
    return False


def heads(graph: CallGraph, dots):
  """{fprop index: how it was found} for the output heads (see the module docstring)."""
  flow = Dataflow(graph)
  backward = {d.op: d.phase is Phase.BACKWARD for d in dots}  # operations hash and compare by the op they wrap
  is_backward = lambda op: backward.get(op, True)  # noqa: E731
  any_backward = any(d.phase is Phase.BACKWARD for d in dots)
  heads, recomputed = {}, []
  forward_only = []  # fprops of a program without backward dots: judged from the forward dataflow, below
  paired = {}  # fprop index -> its dgrads and wgrads, program order
  upstream = {}  # gradient -> its no_dot_upstream verdict (a layer's dgrad and wgrad mostly read one gradient)
  for d in dots:
    if d.partner is not None:
      paired.setdefault(d.partner, []).append(d)
  for j, f in enumerate(dots):
    if f.role is not Role.FPROP:
      continue
    if "rematted_computation" in f.stack:  # remat's copy of a fprop: judged with the fprop it recomputes, below
      recomputed.append(j)
      continue
    verdicts = []
    for d in paired.get(j, ()):
      if d.role is Role.DGRAD:
        grad = d.op.operands[1 - d.w]
      else:  # wgrad: the operand that is not the fprop's activation
        others = [k for k in (0, 1) if d.roots[k] != f.roots[1 - f.w]]
        if len(others) != 1:
          continue
        grad = d.op.operands[others[0]]
      if grad not in upstream:
        upstream[grad] = flow.no_dot_upstream(grad, is_backward)
      verdicts.append(upstream[grad])
    if not verdicts:
      if not any_backward:
        forward_only.append(j)
      continue  # in a gradient step, a layer without gradient (frozen): nothing says it feeds the loss
    _judge(heads, j, f, verdicts)
  # Without backward dots (an eval or sampling step): the layers whose output reaches a loss (a scalar result), else
  # those whose output reaches any result, with no other dot in between.
  for scalar in (True, False):
    for j in forward_only:
      _judge(heads, j, dots[j], [flow.reaches_result(dots[j].op.results[0], scalar)],
             "the loss" if scalar else "the program's result")
    if any(j in heads for j in forward_only):
      break
  layer = lambda f: (f.src.arg, shape(f.op.operands[0]), shape(f.op.operands[1]), dot_dims(f.op))  # noqa: E731
  for j in recomputed:
    reason = next((heads[h] for h in heads if layer(dots[h]) == layer(dots[j])), None)
    if reason is not None:
      heads[j] = reason
  return heads


def _judge(heads, j, f, verdicts, reached="the loss"):
  """Record fprop `j` as a head when every dataflow verdict says so, or by its name where a walk was inconclusive."""
  if False in verdicts:
    return
  if None not in verdicts:
    heads[j] = f"its output reaches {reached} with no other linear layer in between"
  elif names.HEAD_RE.search(f.path.split("/")[-1] if f.path else ""):
    heads[j] = "by its name (the dataflow to the loss could not be followed)"
