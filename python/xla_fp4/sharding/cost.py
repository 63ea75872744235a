"""Per-device work and communication of a compiled (partitioned) executable, read from its optimized HLO.

The instructions come from jaxlib's HloModule API (opcode, operands); only each instruction's shape is read from its
one-line text (`%dot.1 = f32[256,1024]{1,0} dot(...)`), which that API does not expose otherwise. (jaxlib's
hlo_to_stablehlo drops dots of an optimized CPU module, so it cannot be used here.) Dot FLOPs are 2 x output elements x
contracted size; collective bytes are the result bytes of every all-reduce, all-gather, reduce-scatter, all-to-all and
collective-permute (async pairs counted once); the FP4 GEMM (the targets marked `counts_as_dot`) counts as a dot of its
shape; quantized elements are the elements of the operand of every quantizing custom call (the targets marked
`quantizes`, their telemetry forms included; not the amax pass over the same tensor).
Collective bytes are also split by what moves, from dataflow: a gather (all-gather, all-to-all, collective-permute or
broadcast) of a value that depends on no data input (the step's entry parameters the caller names, such as the
tokens) is a weight gather, any other gather an activation gather, and all-reduces and reduce-scatters are reductions
(gradients, and the partial sums of a split contraction); scalar collectives are left out of the split.
Computations are followed from the entry through their call sites
(fusions, calls, loops, reductions); a conditional counts its most expensive branch, the one work a step can run,
except the pass's kept-iteration case in a scanned stack (BRANCH_RUNS: how many iterations run each branch),
whose branches count in proportion to the iterations that run them. A loop body counts once (not times its trip
count: the average iteration), which is what a side-by-side ratio of two programs of the same structure needs.
FP4 GEMMs are counted once per call site, in whichever branch.
"""

import dataclasses
import math
import re

from xla_fp4.kernels import targets
from xla_fp4.numerics.formats import BLOCK

# The frontend attribute of the pass's kept-iteration case (passes/rewrite/emitter.py): how many iterations of its stack
# run each branch ("kept,other").
BRANCH_RUNS = "xla_fp4_branch_runs"
_COLLECTIVES = {"kAllReduce", "kAllReduceStart", "kAllGather", "kAllGatherStart", "kReduceScatter", "kAllToAll",
                "kCollectivePermute", "kCollectivePermuteStart", "kCollectiveBroadcast"}
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)")
_PACKED_GEMM = re.compile('custom_call_target="(' + "|".join(t.name for t in targets.ALL if t.counts_as_dot) + ')"')
_QUANTIZING = re.compile('custom_call_target="(' + "|".join(t.name for t in targets.ALL if t.quantizes) + ')"')
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_PARAMETER = re.compile(r"\bparameter\((\d+)\)")
_INDEX = re.compile(r"\bindex=(\d+)")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_ROOT = re.compile(r"^\s+ROOT %([\w.\-]+) = ")
_RUNS = re.compile(BRANCH_RUNS + r'="([0-9,]+)"')
_REDUCTIONS = {"kAllReduce", "kAllReduceStart", "kReduceScatter"}
# Collectives at most this many bytes per result are scalar reductions: the pass's global amax and digest.
SCALAR_BYTES = 8


@dataclasses.dataclass(frozen=True)
class Cost:
  dot_flops: int  # per device
  collective_bytes: int  # per device, every collective
  scalar_collective_bytes: int  # the part of collective_bytes in scalar collectives (at most SCALAR_BYTES a result)
  collectives: dict  # opcode -> count (a weighted branch's collectives count by their share of its runs)
  quantized_elements: int = 0  # per device: elements the pass's kernels quantize
  packed_gemms: int = 0  # FP4 GEMM calls (the targets marked counts_as_dot)
  # per device, scalar collectives aside: {"weight_gathers", "activation_gathers", "reductions"} -> bytes; empty
  # unless the caller named the data inputs
  collective_bytes_by_kind: dict = dataclasses.field(default_factory=dict)

  @property
  def large_collective_bytes(self):
    return self.collective_bytes - self.scalar_collective_bytes


def _result_arrays(instruction):
  """[(dtype, dims)] of the instruction's result (one entry per tuple element)."""
  head = instruction.to_string().split("=", 1)[1].lstrip()
  if head.startswith("("):  # a tuple: up to its closing parenthesis
    depth = 0
    for i, ch in enumerate(head):
      depth += {"(": 1, ")": -1}.get(ch, 0)
      if depth == 0:
        head = head[:i + 1]
        break
  else:
    head = head.split(" ", 1)[0]
  return [(d, [int(n) for n in dims.split(",") if n]) for d, dims in _ARRAY.findall(head)]


def _instruction_cost(ins):
  """(dot flops, quantized elements, FP4 GEMM calls, [(collective opcode, result bytes)]) of one instruction, not
  counting the computations it calls."""
  op = ins.opcode.name
  if op == "kDot":
    (_, out), = _result_arrays(ins)
    (_, lhs), = _result_arrays(ins.operands()[0])
    contracting = [int(d) for d in _CONTRACTING.search(ins.to_string()).group(1).split(",") if d]
    return 2 * math.prod(out) * math.prod(lhs[d] for d in contracting), 0, 0, []
  gemm = _PACKED_GEMM.search(ins.to_string()) if op == "kCustomCall" else None
  if gemm:  # C (M, N) of a's codes and scales (M, K/block): K from the scales (the codes hold 1 or 2 a byte)
    (_, out), = _result_arrays(ins)
    (_, a_scales), = _result_arrays(ins.operands()[1])
    packed = targets.BY_NAME[gemm.group(1)].packed
    return 2 * math.prod(out) * (packed.block if packed else BLOCK) * a_scales[-1], 0, 1, []
  quantizer = _QUANTIZING.search(ins.to_string()) if op == "kCustomCall" else None
  if quantizer:
    (_, dims), = _result_arrays(ins.operands()[0])
    return 0, math.prod(dims) * targets.BY_NAME[quantizer.group(1)].quantizes, 0, []
  if op in _COLLECTIVES:
    sizes = [math.prod(dims) * _BYTES[dtype] for dtype, dims in _result_arrays(ins)]
    if op.endswith("Start"):  # (operands..., results...): the results are the second half
      sizes = sizes[len(sizes) // 2:]
    return 0, 0, 0, [(op, s) for s in sizes]
  return 0, 0, 0, []


def _callees(ins):
  text = ins.to_string()
  names = _CALLED.findall(text)
  branches = _BRANCHES.search(text)
  if branches:
    return names, [b.strip().lstrip("%") for b in branches.group(1).split(",")]
  if ins.opcode.name == "kConditional":
    return [], names
  return names, []


def _merge(a, b):
  """The union of two dependence values: a bool per array, a tuple of them per tuple."""
  if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
    return tuple(_merge(x, y) for x, y in zip(a, b))
  return _any(a) or _any(b)


def _any(t):
  return any(_any(x) for x in t) if isinstance(t, tuple) else t


def _roots(module):
  """{computation name: its root instruction's name}, from the module's text (the API does not say which is the
  root, and its instruction order need not end with it)."""
  roots, current = {}, None
  for line in module.to_string().splitlines():
    head = _COMPUTATION.match(line)
    if head:
      current = head.group(1)
    root = _ROOT.match(line)
    if root:
      roots[current] = root.group(1)
  return roots


def _topological(computation):
  """The computation's instructions, each after its operands (the API's order need not be)."""
  instructions = list(computation.instructions())
  waiting = {i.name: len({o.name for o in i.operands()}) for i in instructions}
  users = {}
  for i in instructions:
    for o in {o.name for o in i.operands()}:
      users.setdefault(o, []).append(i)
  ready = [i for i in instructions if waiting[i.name] == 0]
  order = []
  while ready:
    i = ready.pop()
    order.append(i)
    for u in users.get(i.name, []):
      waiting[u.name] -= 1
      if waiting[u.name] == 0:
        ready.append(u)
  return order


def _data_dependence(module, by_name, entry, is_data):
  """{(computation, instruction name): True where the instruction's value depends on a data input} over every
  instruction reached from `entry`, merged over call sites. Tuples keep one value per element (a loop's carry holds
  weights and activations side by side); a loop runs its body to a fixed point."""
  seen, memo, roots, orders = {}, {}, _roots(module), {}

  def run(name, params):
    """The root's dependence of computation `name` given its parameters' dependence."""
    if (name, params) in memo:
      return memo[(name, params)]
    value = {}
    if name not in orders:
      orders[name] = _topological(by_name[name])
    for ins in orders[name]:
      op, text = ins.opcode.name, ins.to_string()
      args = [value[o.name] for o in ins.operands()]
      if op == "kParameter":
        number = int(_PARAMETER.search(text).group(1))
        v = is_data(number, *_result_arrays(ins)[0]) if params is None else params[number]
      elif op == "kTuple":
        v = tuple(args)
      elif op == "kGetTupleElement":
        v = args[0][int(_INDEX.search(text).group(1))] if isinstance(args[0], tuple) else args[0]
      elif op == "kWhile":
        body = re.search(r"\bbody=%([\w.\-]+)", text).group(1)
        v = args[0]
        while True:
          nxt = _merge(v, run(body, (v,)))
          if nxt == v:
            break
          v = nxt
      elif op in ("kFusion", "kCall"):
        v = run(_callees(ins)[0][0], tuple(args))
      elif op == "kConditional":
        _, branches = _callees(ins)
        outs = [run(b, (a,)) for b, a in zip(branches, args[1:])]
        v = outs[0]
        for r in outs[1:]:
          v = _merge(v, r)
        v = _merge(v, args[0]) if not isinstance(v, tuple) else v
      elif op in _COLLECTIVES and len(args) > 1 and not op.endswith("Start"):
        v = tuple(_any(a) for a in args)  # a combined collective: one result per operand
      else:
        v = any(_any(a) for a in args)
      value[ins.name] = v
      key = (name, ins.name)
      seen[key] = seen.get(key, False) or _any(v)
    root = value[roots[name]]
    memo[(name, params)] = root
    return root

  run(entry, None)
  return seen


def cost(compiled, is_data=None) -> Cost:
  """The per-device Cost of one step of `compiled` (a `jax.stages.Compiled`). `is_data(number, dtype, dims)` names
  the entry parameters that are data inputs (see the module's docstring); without it no split by kind."""
  return modules_cost(compiled.runtime_executable().hlo_modules(), is_data)


def hlo_proto_cost(serialized: bytes, is_data=None) -> Cost:
  """The Cost of an optimized HLO module as XLA dumps it (`--xla_dump_to --xla_dump_hlo_as_proto`,
  `*after_optimizations.hlo.pb`), for programs compiled elsewhere, such as MaxText's train step
  (examples/maxtext/run.py). (XLA's dumped text does not parse back: it names tuple elements `%param#1`.)"""
  from jax._src.lib import xla_client
  return modules_cost([xla_client.hlo.HloModule.from_serialized_hlo_module_proto(serialized)], is_data)


def modules_cost(modules, is_data=None) -> Cost:
  """The per-device Cost of HloModules: every computation reached from an entry counts once per call site, a
  conditional as its most expensive branch (only one runs)."""
  flops = elements = total = scalar = gemms = 0
  counts, kinds = {}, {}
  for module in modules:
    by_name = {c.name: c for c in module.computations()}
    called = set()
    for c in by_name.values():
      for ins in c.instructions():
        always, branches = _callees(ins)
        called.update(always + branches)
    entries = [n for n in by_name if n not in called]
    data = {}
    if is_data is not None:
      for entry in entries:
        data.update(_data_dependence(module, by_name, entry, is_data))
    memo = {}

    def visit(name):
      """(flops, quantized elements, packed GEMMs, [(opcode, bytes, kind, weight)]) of computation `name` and
      everything it calls; `weight` is the share of the computation's runs in which the collective runs (below 1 in
      a weighted branch)."""
      if name not in memo:
        f, e, g, coll = 0, 0, 0, []
        for ins in by_name[name].instructions():
          own_f, own_e, own_g, own_c = _instruction_cost(ins)
          if own_c and is_data is not None:
            depends = any(data.get((name, o.name), False) for o in ins.operands())
            kind = ("reductions" if ins.opcode.name in _REDUCTIONS else
                    "activation_gathers" if depends else "weight_gathers")
          else:
            kind = None
          f, e, g, coll = f + own_f, e + own_e, g + own_g, coll + [(op, size, kind, 1) for op, size in own_c]
          always, branches = _callees(ins)
          for callee in always:
            cf, ce, cg, cc = visit(callee)
            f, e, g, coll = f + cf, e + ce, g + cg, coll + cc
          if branches:
            costs = [visit(b) for b in branches]
            runs = _RUNS.search(ins.to_string())
            runs = [int(n) for n in runs.group(1).split(",")] if runs else []
            if len(runs) == len(branches) and sum(runs) > 0:
              shares = [n / sum(runs) for n in runs]
              f += sum(w * c[0] for w, c in zip(shares, costs))
              e += sum(w * c[1] for w, c in zip(shares, costs))
              g += sum(c[2] for c in costs)
              coll = coll + [(op, size, kind, w * cw) for w, c in zip(shares, costs) for op, size, kind, cw in c[3]]
            else:
              cf, ce, cg, cc = max(costs, key=lambda c: (c[0], sum(s * w for _, s, _, w in c[3])))
              f, e, g, coll = f + cf, e + ce, g + cg, coll + cc
        memo[name] = (f, e, g, coll)
      return memo[name]

    for entry in entries:
      f, e, g, coll = visit(entry)
      flops += f
      elements += e
      gemms += g
      for op, size, kind, weight in coll:
        total += size * weight
        scalar += size * weight if size <= SCALAR_BYTES else 0
        counts[op] = counts.get(op, 0) + weight
        if kind is not None and size > SCALAR_BYTES:
          kinds[kind] = kinds.get(kind, 0) + size * weight
  if is_data is not None:
    kinds = {k: round(kinds.get(k, 0)) for k in ("weight_gathers", "activation_gathers", "reductions")}
  return Cost(dot_flops=round(flops), collective_bytes=round(total), scalar_collective_bytes=round(scalar),
              collectives={op: round(n, 2) for op, n in counts.items()}, quantized_elements=round(elements),
              packed_gemms=gemms, collective_bytes_by_kind=kinds)
