"""Analysis: find every stablehlo.dot_general, classify its phase and role, trace its weight, find its layer and block.

Input: a StableHLO module as JAX lowers it (before and after are the same module; this pass only reads). For example

  func.func public @main(%arg0: tensor<32x64xf32> loc("p['params']['fc1']['kernel']"), %arg1: tensor<8x32xf32> ...)
    %0 = stablehlo.dot_general %arg1, %arg0, contracting_dims = [1] x [0]
           loc("jit(step)/jvp(MLP)/fc1/dot_general"(...))              -> fprop, weight = rhs, layer MLP/fc1
    %5 = stablehlo.dot_general %g, %arg0, contracting_dims = [1] x [1]
           loc("jit(step)/transpose(jvp(MLP))/fc1/dot_general"(...))   -> dgrad (an operand is fc1's weight)
    %6 = stablehlo.dot_general %g, %arg1, contracting_dims = [0] x [0]
           loc("jit(step)/transpose(jvp(MLP))/fc1/dot_general"(...))   -> wgrad (same source frame, no weight operand)

How (DESIGN.md §4):
- name stack: the outermost NameLoc of the op's location; ops in outlined functions (scan bodies, nested jit, remat)
  carry names relative to their call site, so the call site's name stack is prefixed (the first call site wins).
- phase: backward iff the name stack holds `transpose(` outside a `rematted_computation` (remat recomputation is
  forward work).
- weight: an operand that traces back to a @main argument through layout/convert/slice/barrier/sharding ops, calls and
  while-loop carries. For a forward dot with such an operand it is fprop. A backward dot pairs with the forward dots of
  the same source frame: it is dgrad when an operand traces to the same argument as the forward weight, else wgrad.
  Without a forward partner (custom_vjp, hand-written backward) the dot is `other`: the conservative choice.
- block: an integer in the layer path (`block_3`, `layers_3`) or the weight's argument name (`['layers'][3]`); in
  scanned stacks the weight comes from a dynamic_slice of a stacked parameter, whose start index is the block index
  of the current iteration (recorded as `block_value` so that the rewrite can select per iteration).

The jaxlib 0.10 MLIR bindings expose no accessors for location structure, so names are read from the printed
location (`loc("name"(child))`): only the leading quoted NameLoc name is taken.
"""

import dataclasses
import re
from typing import Any, Optional

import numpy as np
from jax._src.lib.mlir import ir

_NAME_LOC_RE = re.compile(r'^loc\("((?:[^"\\]|\\.)*)"(\(|\)$)')
_TRANSFORM_RE = re.compile(r"^[\w.]+\((.*)\)$")  # jvp(MLP), transpose(jvp(MLP)), vmap(f), jit(step)
_NOISE = {"while", "body", "cond", "closed_call", "checkpoint", "rematted_computation", "remat", "remat2",
          "core_call", "custom_jvp_call", "custom_vjp_call", "pjit", "shard_map", "scan", "xla_fp4_exclude_end"}
_BLOCK_RE = re.compile(r"(?:^|[/.\['_])(?:blocks?|layers?|h|transformer_?blocks?|encoder_?blocks?|decoder_?blocks?)"
                       r"[_'\]\[]*(\d+)", re.I)
_HEAD_RE = re.compile(r"(head|logits|unembed|embed\w*|lm_out|output_projection)$", re.I)
_PASS_THROUGH = {"stablehlo.convert", "stablehlo.reshape", "stablehlo.transpose", "stablehlo.broadcast_in_dim",
                 "stablehlo.slice", "stablehlo.bitcast_convert", "stablehlo.copy", "mhlo.copy", "mhlo.sharding"}
_SHARDING_TARGETS = {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "annotate_device_placement"}
EXCLUDE_SCOPE = "xla_fp4_exclude"
ROLES = ("fprop", "dgrad", "wgrad", "other")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DotSite:
  """One dot_general and what the analysis found out about it (JSON-friendly fields only)."""
  index: int  # program order over the module
  func: str
  name_stack: str
  layer: str
  phase: str  # forward | backward
  role: str  # fprop | dgrad | wgrad | other
  weight_operand: Optional[int]  # 0 (lhs) or 1 (rhs) for fprop/dgrad
  weight_arg: Optional[str]  # the @main argument the layer's weight comes from
  block: Optional[int]  # static block index
  num_stacked: Optional[int]  # layers in the scanned stack when the block is per iteration
  is_head: bool
  excluded_scope: bool
  lhs_shape: tuple
  rhs_shape: tuple
  out_shape: tuple
  dtype: str
  m: int
  n: int
  k: int
  flops: int
  contracting: tuple  # ((lhs dims), (rhs dims))
  batch: tuple


@dataclasses.dataclass
class Analysis:
  sites: list  # [DotSite], program order
  ops: dict  # index -> ir.Operation (the dot)
  block_values: dict  # index -> (ir.Value in the caller scope, ir.Operation call site or None)
  num_blocks: int


def name_of(loc) -> str:
  m = _NAME_LOC_RE.match(str(loc))
  return m.group(1).encode().decode("unicode_escape") if m else ""


def frame_of(loc) -> str:
  """The location without its leading name: identifies the source frame (the Python call that made the op)."""
  text = str(loc)
  m = _NAME_LOC_RE.match(text)
  return text[m.end(1) + 1:] if m else text


def _strip_transform(component):
  while True:
    m = _TRANSFORM_RE.match(component)
    if not m:
      return component
    component = m.group(1)


def layer_path(name_stack: str) -> str:
  parts = []
  for c in name_stack.split("/")[:-1]:  # the last component is the op name
    if c.startswith(("jit(", "pjit(")):
      continue
    c = _strip_transform(c)
    if c and c not in _NOISE and not c.startswith(("branch_", "jit:")):
      parts.append(c)
  return "/".join(parts)


def _path_from_arg(arg_name: str) -> str:
  """p['params']['block_0']['fc1']['kernel'] -> block_0/fc1 (the layer of a weight, for NNX and plain pytrees)."""
  keys = re.findall(r"\[\s*'?([^'\]]+)'?\s*\]|\.(\w+)", arg_name)
  parts = [a or b for a, b in keys]
  parts = [p for p in parts if p not in ("params", "kernel", "value", "w", "weight", "weights", "embedding", "raw_value")]
  return "/".join(parts)


def _static_block(*texts):
  for t in texts:
    if t:
      m = _BLOCK_RE.search(t)
      if m:
        return int(m.group(1))
  return None


def _shape(v):
  return tuple(ir.RankedTensorType(v.type).shape)


class _Module:
  """Symbol table, call graph and @main argument names of a module."""

  def __init__(self, module):
    self.funcs = {}
    self.calls = {}  # callee -> [call ops], program order
    self.func_of_op = {}
    self.order = []  # (func name, op) for every op, program order
    for op in module.body.operations:
      if op.operation.name == "func.func":
        name = ir.StringAttr(op.attributes["sym_name"]).value
        self.funcs[name] = op
    for name, f in self.funcs.items():
      self._walk(name, f.operation)
    main = self.funcs.get("main")
    self.main_args = []
    if main is not None:
      for a in main.regions[0].blocks[0].arguments:
        self.main_args.append(name_of(a.location) or f"arg{a.arg_number}")

  def _walk(self, fname, op):
    for region in op.regions:
      for block in region.blocks:
        for child in block.operations:
          child = child.operation
          self.order.append((fname, child))
          if child.name == "func.call":
            callee = ir.FlatSymbolRefAttr(child.attributes["callee"]).value
            self.calls.setdefault(callee, []).append(child)
          self._walk(fname, child)

  def call_prefix(self, fname, seen=()):
    """Name stack of the first call site of `fname`, recursively; '' for main."""
    sites = self.calls.get(fname)
    if fname == "main" or not sites or fname in seen:
      return ""
    call = sites[0]
    caller = self._enclosing_func(call)
    prefix = self.call_prefix(caller, seen + (fname,))
    own = name_of(call.location)
    return f"{prefix}/{own}" if prefix and own else (prefix or own)

  def _enclosing_func(self, op):
    while op is not None and op.name != "func.func":
      op = op.parent
    return ir.StringAttr(op.attributes["sym_name"]).value if op is not None else "main"

  def enclosing_func(self, op):
    return self._enclosing_func(op.parent)


@dataclasses.dataclass
class _Source:
  arg: int  # @main argument index
  index: Any = None  # dynamic_slice start index (layer of a stacked weight), in `scope_call`'s caller scope
  stacked: Optional[int] = None
  entry_call: Any = None  # the call op through which the dot's function was entered, if any


class _Tracer:
  def __init__(self, mod: _Module):
    self.mod = mod

  def trace(self, value, stack=(), entry=None, depth=0) -> Optional[_Source]:
    if depth > 200:
      return None
    if isinstance(value.owner, ir.Block):
      arg = ir.BlockArgument(value)
      parent = arg.owner.owner  # Block -> Operation
      parent = parent.operation if parent is not None else None
      if parent is None:
        return None
      if parent.name == "func.func":
        fname = ir.StringAttr(parent.attributes["sym_name"]).value
        if fname == "main":
          return _Source(arg=arg.arg_number, entry_call=entry)
        if stack:  # we came down into this callee through a call result: go back up the same call
          call = stack[-1]
          return self.trace(call.operands[arg.arg_number], stack[:-1], entry, depth + 1)
        for call in self.mod.calls.get(fname, []):
          src = self.trace(call.operands[arg.arg_number], (), entry or call, depth + 1)
          if src is not None:
            return src
        return None
      if parent.name == "stablehlo.while":
        return self.trace(parent.operands[arg.arg_number], stack, entry, depth + 1)
      return None
    res = ir.OpResult(value)
    op = res.owner.operation if hasattr(res.owner, "operation") else res.owner
    name = op.name
    if name in _PASS_THROUGH:
      return self.trace(op.operands[0], stack, entry, depth + 1)
    if name == "stablehlo.custom_call":
      target = ir.StringAttr(op.attributes["call_target_name"]).value
      return self.trace(op.operands[0], stack, entry, depth + 1) if target in _SHARDING_TARGETS else None
    if name == "stablehlo.optimization_barrier":
      return self.trace(op.operands[res.result_number], stack, entry, depth + 1)
    if name == "stablehlo.dynamic_slice":
      src = self.trace(op.operands[0], stack, entry, depth + 1)
      if src is not None and src.index is None:
        src.index = self._lift(op.operands[1], stack)
        src.stacked = _shape(op.operands[0])[0]
      return src
    if name == "func.call":
      callee = self.mod.funcs.get(ir.FlatSymbolRefAttr(op.attributes["callee"]).value)
      if callee is None:
        return None
      ret = callee.regions[0].blocks[0].operations[len(callee.regions[0].blocks[0].operations) - 1]
      return self.trace(ret.operands[res.result_number], stack + (op,), entry, depth + 1)
    return None

  def _lift(self, value, stack):
    """Express a callee-local block argument in the scope of the calls on `stack`."""
    stack = list(stack)
    while stack and isinstance(value.owner, ir.Block):
      arg = ir.BlockArgument(value)
      parent = arg.owner.owner
      if parent is None or parent.operation.name != "func.func":
        break
      value = stack.pop().operands[arg.arg_number]
    return value if not stack else None


def _dot_dims(op):
  dn = op.attributes["dot_dimension_numbers"]
  from jax._src.lib.mlir.dialects import hlo
  d = hlo.DotDimensionNumbers(dn)
  return ((tuple(d.lhs_contracting_dimensions), tuple(d.rhs_contracting_dimensions)),
          (tuple(d.lhs_batching_dimensions), tuple(d.rhs_batching_dimensions)))


def _gather_users(module_info, arg_index):
  """Whether @main argument `arg_index` feeds a gather (an embedding table) through pass-through ops."""
  main = module_info.funcs.get("main")
  if main is None:
    return False
  todo = [main.regions[0].blocks[0].arguments[arg_index]]
  seen = 0
  while todo and seen < 64:
    v = todo.pop()
    seen += 1
    for use in v.uses:
      user = use.owner.operation if hasattr(use.owner, "operation") else use.owner
      if user.name in ("stablehlo.gather", "stablehlo.dynamic_slice") and use.operand_number == 0:
        return True
      if user.name in _PASS_THROUGH:
        todo.extend(user.results)
  return False


def analyze(module) -> Analysis:
  mod = _Module(module)
  tracer = _Tracer(mod)
  raw = []
  for fname, op in mod.order:
    if op.name != "stablehlo.dot_general":
      continue
    prefix = mod.call_prefix(fname)
    own = name_of(op.location)
    stack = f"{prefix}/{own}" if prefix and own else (prefix or own)
    sources = [tracer.trace(op.operands[i]) for i in (0, 1)]
    raw.append((fname, op, stack, sources))

  def phase_of(stack):
    return "backward" if "transpose(" in stack.split("rematted_computation")[0] and \
        "rematted_computation" not in stack else "forward"

  # Forward dots: fprop when an operand is a parameter (rhs preferred: x @ W), else other.
  forward = {}
  info = {}
  for i, (fname, op, stack, sources) in enumerate(raw):
    if phase_of(stack) != "forward":
      continue
    w = 1 if sources[1] is not None else (0 if sources[0] is not None else None)
    info[i] = ("fprop" if w is not None else "other", w, sources[w] if w is not None else None)
    forward.setdefault(frame_of(op.location), []).append(i)
  for i, (fname, op, stack, sources) in enumerate(raw):
    if i in info:
      continue
    role, w, src = "other", None, None
    for j in forward.get(frame_of(op.location), []):
      f_role, f_w, f_src = info[j]
      if f_role != "fprop":
        continue
      same = [k for k in (0, 1) if sources[k] is not None and sources[k].arg == f_src.arg]
      if same:
        role, w, src = "dgrad", same[0], sources[same[0]]
      else:
        role, w, src = "wgrad", None, f_src
        partner = j
        # The per-iteration block value of a wgrad comes from the dgrad or fprop in the same function.
        for k, (fn2, op2, _, s2) in enumerate(raw):
          if fn2 == fname and k != i and frame_of(op2.location) == frame_of(op.location):
            for s in s2:
              if s is not None and s.arg == f_src.arg and s.index is not None:
                src = s
        del partner
      break
    info[i] = (role, w, src)

  sites, ops, block_values = [], {}, {}
  for i, (fname, op, stack, sources) in enumerate(raw):
    role, w, src = info[i]
    arg_name = mod.main_args[src.arg] if src is not None and src.arg < len(mod.main_args) else None
    layer = layer_path(stack)
    if role != "other" and not layer and arg_name:
      layer = _path_from_arg(arg_name)
    (lc, rc), (lb, rb) = _dot_dims(op)
    ls, rs = _shape(op.operands[0]), _shape(op.operands[1])
    out = _shape(op.results[0])
    k = int(np.prod([ls[d] for d in lc], dtype=np.int64))
    batch = int(np.prod([ls[d] for d in lb], dtype=np.int64))
    m = batch * int(np.prod([ls[d] for d in range(len(ls)) if d not in lc and d not in lb], dtype=np.int64))
    n = int(np.prod([rs[d] for d in range(len(rs)) if d not in rc and d not in rb], dtype=np.int64))
    block = _static_block(layer, arg_name)
    stacked = None
    if src is not None and src.index is not None:
      block, stacked = None, src.stacked
      block_values[i] = (src.index, src.entry_call)
    is_head = role != "other" and (bool(_HEAD_RE.search(layer.split("/")[-1] if layer else "")) or
                                   (src is not None and _gather_users(mod, src.arg)))
    sites.append(DotSite(
        index=i, func=fname, name_stack=stack, layer=layer, phase=phase_of(stack), role=role, weight_operand=w,
        weight_arg=arg_name, block=block, num_stacked=stacked, is_head=is_head,
        excluded_scope=EXCLUDE_SCOPE in stack, lhs_shape=ls, rhs_shape=rs, out_shape=out,
        dtype=str(ir.RankedTensorType(op.results[0].type).element_type), m=m, n=n, k=k,
        flops=2 * int(np.prod(out, dtype=np.int64)) * k, contracting=(lc, rc), batch=(lb, rb)))
    ops[i] = op
  static = [s.block for s in sites if s.block is not None and s.role != "other"]
  stacks = [s.num_stacked for s in sites if s.num_stacked]
  num_blocks = max([max(static) + 1 if static else 0] + stacks)
  return Analysis(sites=sites, ops=ops, block_values=block_values, num_blocks=num_blocks)
