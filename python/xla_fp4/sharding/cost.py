"""Per-device work and communication of a compiled (partitioned) executable, read from its optimized HLO.

The instructions come from jaxlib's HloModule API (opcode, operands); only each instruction's shape is read from its
one-line text (`%dot.1 = f32[256,1024]{1,0} dot(...)`), which that API does not expose otherwise. (jaxlib's
hlo_to_stablehlo drops dots of an optimized CPU module, so it cannot be used here.) Dot FLOPs are 2 x output elements x
contracted size; collective bytes are the result bytes of every all-reduce, all-gather, reduce-scatter, all-to-all and
collective-permute (async pairs counted once); the FP4 GEMM (xla_fp4_gemm_packed) counts as a dot of its shape;
quantized elements are the elements of the operand of every
quantizing `xla_fp4_*` custom call (qdq, qdq_with_scale, quantize_packed; not the amax pass over the same tensor).
Computations are followed from the entry through their call sites
(fusions, calls, loops, reductions); a conditional counts its most expensive branch, the one work a step can run. A
loop body counts once (not times its trip count), which is what a side-by-side ratio of two programs of the same
structure needs.
"""

import dataclasses
import math
import re

_COLLECTIVES = {"kAllReduce", "kAllReduceStart", "kAllGather", "kAllGatherStart", "kReduceScatter", "kAllToAll",
                "kCollectivePermute", "kCollectivePermuteStart", "kCollectiveBroadcast"}
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)")
_PACKED_GEMM = re.compile(r'custom_call_target="xla_fp4_gemm_packed"')
_QUANTIZING = re.compile(r'custom_call_target="xla_fp4_(?:qdq|qdq_with_scale|quantize_packed)"')
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
# Collectives at most this many bytes per result are scalar reductions: the pass's global amax and digest.
SCALAR_BYTES = 8


@dataclasses.dataclass(frozen=True)
class Cost:
  dot_flops: int  # per device
  collective_bytes: int  # per device, every collective
  scalar_collective_bytes: int  # the part of collective_bytes in scalar collectives (at most SCALAR_BYTES a result)
  collectives: dict  # opcode -> count
  quantized_elements: int = 0  # per device: elements the pass's kernels quantize

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
  """(dot flops, quantized elements, [(collective opcode, result bytes)]) of one instruction, not counting the
  computations it calls."""
  op = ins.opcode.name
  if op == "kDot":
    (_, out), = _result_arrays(ins)
    (_, lhs), = _result_arrays(ins.operands()[0])
    contracting = [int(d) for d in _CONTRACTING.search(ins.to_string()).group(1).split(",") if d]
    return 2 * math.prod(out) * math.prod(lhs[d] for d in contracting), 0, []
  if op == "kCustomCall" and _PACKED_GEMM.search(ins.to_string()):  # C (M, N) of a (M, K/2) and b (N, K/2)
    (_, out), = _result_arrays(ins)
    (_, a), = _result_arrays(ins.operands()[0])
    return 2 * math.prod(out) * 2 * a[1], 0, []
  if op == "kCustomCall" and _QUANTIZING.search(ins.to_string()):
    (_, dims), = _result_arrays(ins.operands()[0])
    return 0, math.prod(dims), []
  if op in _COLLECTIVES:
    sizes = [math.prod(dims) * _BYTES[dtype] for dtype, dims in _result_arrays(ins)]
    if op.endswith("Start"):  # (operands..., results...): the results are the second half
      sizes = sizes[len(sizes) // 2:]
    return 0, 0, [(op, s) for s in sizes]
  return 0, 0, []


def _callees(ins):
  text = ins.to_string()
  names = _CALLED.findall(text)
  branches = _BRANCHES.search(text)
  if branches:
    return names, [b.strip().lstrip("%") for b in branches.group(1).split(",")]
  if ins.opcode.name == "kConditional":
    return [], names
  return names, []


def cost(compiled) -> Cost:
  """The per-device Cost of one step of `compiled` (a `jax.stages.Compiled`)."""
  return modules_cost(compiled.runtime_executable().hlo_modules())


def hlo_proto_cost(serialized: bytes) -> Cost:
  """The Cost of an optimized HLO module as XLA dumps it (`--xla_dump_to --xla_dump_hlo_as_proto`,
  `*after_optimizations.hlo.pb`), for programs compiled elsewhere, such as MaxText's train step
  (examples/maxtext/run.py). (XLA's dumped text does not parse back: it names tuple elements `%param#1`.)"""
  from jax._src.lib import xla_client
  return modules_cost([xla_client.hlo.HloModule.from_serialized_hlo_module_proto(serialized)])


def modules_cost(modules) -> Cost:
  """The per-device Cost of HloModules: every computation reached from an entry counts once per call site, a
  conditional as its most expensive branch (only one runs)."""
  flops = elements = total = scalar = 0
  counts = {}
  for module in modules:
    by_name = {c.name: c for c in module.computations()}
    called = set()
    for c in by_name.values():
      for ins in c.instructions():
        always, branches = _callees(ins)
        called.update(always + branches)
    memo = {}

    def visit(name):
      """(flops, quantized elements, [(opcode, bytes)]) of computation `name` and everything it calls."""
      if name not in memo:
        f, e, coll = 0, 0, []
        for ins in by_name[name].instructions():
          own_f, own_e, own_c = _instruction_cost(ins)
          f, e, coll = f + own_f, e + own_e, coll + own_c
          always, branches = _callees(ins)
          for callee in always:
            cf, ce, cc = visit(callee)
            f, e, coll = f + cf, e + ce, coll + cc
          if branches:
            cf, ce, cc = max((visit(b) for b in branches), key=lambda c: (c[0], sum(s for _, s in c[2])))
            f, e, coll = f + cf, e + ce, coll + cc
        memo[name] = (f, e, coll)
      return memo[name]

    for entry in (n for n in by_name if n not in called):
      f, e, coll = visit(entry)
      flops += f
      elements += e
      for op, size in coll:
        total += size
        scalar += size if size <= SCALAR_BYTES else 0
        counts[op] = counts.get(op, 0) + 1
  return Cost(dot_flops=flops, collective_bytes=total, scalar_collective_bytes=scalar, collectives=counts,
              quantized_elements=elements)
