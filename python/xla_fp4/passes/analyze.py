"""Analysis: find every stablehlo.dot_general, classify its phase and role, trace its weight, find its layer and block.

Input: a StableHLO module as JAX lowers it (before and after are the same module; this pass only reads). For example

  func.func public @main(%arg0: tensor<32x64xf32> loc("p['params']['fc1']['kernel']"), %arg1: tensor<8x32xf32> ...)
    %0 = stablehlo.dot_general %arg1, %arg0, contracting_dims = [1] x [0]
           loc("jit(step)/jvp(MLP)/fc1/dot_general"(...))              -> fprop, weight = rhs, layer MLP/fc1
    %5 = stablehlo.dot_general %g, %arg0, contracting_dims = [1] x [1]
           loc("jit(step)/transpose(jvp(MLP))/fc1/dot_general"(...))   -> dgrad (an operand is fc1's weight)
    %6 = stablehlo.dot_general %g, %arg1, contracting_dims = [0] x [0]
           loc("jit(step)/transpose(jvp(MLP))/fc1/dot_general"(...))   -> wgrad (same source frame, no weight operand)

How (docs/design.md §4):
- name stack: the outermost NameLoc of the op's location; ops in outlined functions (scan bodies, nested jit, remat)
  carry names relative to their call site, so the call site's name stack is prefixed (the first call site wins).
- phase: backward iff the name stack holds `transpose(` outside a `rematted_computation` (remat recomputation is
  forward work).
- weight: an operand that traces back to a @main argument through layout/convert/slice/barrier/sharding ops, calls,
  while-loop carries and shard_map (`sdy.manual_computation`) bodies. A forward dot with such an operand is fprop.
- pairing: a backward dot pairs with the fprops of the same source frame (the innermost frame equal, the shorter frame
  list a subsequence of the longer: backward and remat copies carry more outer frames) and, where the name stack names
  the layer (linen, named scopes), of the same layer path. It is dgrad when an operand traces to the fprop's weight
  argument (a weight read by several fprops: the fprop whose activation a sibling backward dot reads together with
  this dot's gradient); wgrad when its result has the weight's shape (up to a permutation) and it shares the gradient
  operand with that layer's dgrad or reads the fprop's activation and the dgrad's gradient (values compared through
  pass-through ops and single-call-site functions, which the pipeline's per-call-site copies make the rule), else the
  last not yet paired fprop of that shape (JAX transposes in reverse program order), unless it reads an operand of a
  forward product of two activations (then it is that product's transpose). Without a forward partner (custom_vjp,
  hand-written backward) the dot is `other`: the conservative choice.
- layer: the name-stack path without transforms, noise scopes and einsum specs; where it does not name the weight's
  module (Flax NNX, plain pytrees: locations carry no module names) the weight's argument path is appended
  (`state['layers'][3]['q']['kernel'].value` -> `layers/3/q`).
- block (`_blocks`): repeated parameter subtrees, i.e. numbered siblings in the weight's parameter path (or the layer
  path) of which at least two hold the same layers (sub-paths and weight shapes): `decoder/layers_3`, `layers/3`, not
  `fc1`/`fc2`; and scanned stacks. Stacks are numbered in the order their first fprop runs, into one global block
  index (an encoder's blocks before a decoder's); a scanned stack records its first block as `block_offset`. In
  scanned stacks the weight comes from a dynamic_slice of a stacked parameter, whose start index is the block index
  of the current iteration within the stack: `Analysis.block_values[i] = (value, entry_call)`, the value visible in
  the scope of `entry_call` (the func.call that enters the dot's function; None when the dot sees the value itself).
  A wgrad takes the value from a dot of its own function that slices the same (or a same-sized) stack. Nested scans
  (a slice of a slice) give no value: the flat layer index exists nowhere in the program, so only `num_stacked` (the
  product) is set.
- head: a linear layer whose output reaches the loss with no other dot in between: its backward dots' gradient
  operand is computed from the loss and the layer's own output only (`_heads`). The layer name (`head`, `logits`,
  ...) only breaks the tie where that dataflow cannot be followed, and the reason says so.
- excluded: the dot, or an op or call site around it, carries the `xla_fp4_exclude` frontend attribute that
  `xla_fp4.exclude()` sets (jax's set_xla_metadata; JAX copies it onto the transposed dots).
- higher_order: a `transpose(` inside a `jvp(`, or two `transpose(`, in the name stack: the dot belongs to the
  derivative of a derivative. (Two `jvp(` alone are no sign: MaxText's rematted forward is `jvp(jvp(...))`.)

The jaxlib 0.10 MLIR bindings expose no accessors for location structure, so names are read from the printed
location (`loc("name"(child))`): only the leading quoted NameLoc name is taken.
"""

import collections
import dataclasses
import enum
import math
import re
from typing import Any, Optional

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import sdy

_NAME_LOC_RE = re.compile(r'^loc\("((?:[^"\\]|\\.)*)"(\(|\)$)')
_FILE_LOC_RE = re.compile(r'"((?:[^"\\]|\\.)*)":(\d+):(\d+)')
_TRANSFORM_RE = re.compile(r"^[\w.]+\((.*)\)$")  # jvp(MLP), transpose(jvp(MLP)), vmap(f), jit(step)
_NOISE = {"while", "body", "eval_jaxpr", "cond", "closed_call", "checkpoint", "rematted_computation", "remat", "remat2",
          "core_call", "custom_jvp_call", "custom_vjp_call", "pjit", "shard_map", "scan"}
_INDEXED_RE = re.compile(r"^(.*?)_?(\d+)$")  # a path component that numbers a module: layers_3, block3, 3
_HEAD_RE = re.compile(r"(head|logits|unembed|embed\w*|lm_out|output_projection)$", re.I)
_PASS_THROUGH = {"stablehlo.convert", "stablehlo.reshape", "stablehlo.transpose", "stablehlo.broadcast_in_dim",
                 "stablehlo.slice", "stablehlo.bitcast_convert", "stablehlo.copy", "mhlo.copy", "mhlo.sharding",
                 "sdy.sharding_constraint", "sdy.reshard"}
_SHARDING_TARGETS = {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "annotate_device_placement"}
EXCLUDE_ATTRIBUTE = "xla_fp4_exclude"  # the frontend attribute xla_fp4.exclude() sets (jax's set_xla_metadata)


class Role(enum.StrEnum):
  FPROP = "fprop"  # a linear layer's forward GEMM
  DGRAD = "dgrad"  # its gradient with respect to the input
  WGRAD = "wgrad"  # its gradient with respect to the weight
  OTHER = "other"  # not a linear layer's GEMM (no operand is a parameter)


class BlockIndex(enum.StrEnum):
  """Where a scanned stack's dot finds the iteration's block index, for the per-iteration select of kept blocks."""
  IN_SCOPE = "in_scope"  # visible at the dot (the dot is in the loop body itself)
  PASSED_IN = "passed_in"  # visible at the body function's call: the rewrite passes it in as an extra argument
  UNAVAILABLE = "unavailable"  # not found: every iteration runs in NVFP4


@dataclasses.dataclass(frozen=True, kw_only=True)
class DotSite:
  """One dot_general and what the analysis found out about it (JSON-friendly fields only)."""
  index: int  # program order over the module
  func: str
  name_stack: str
  layer: str
  phase: str  # forward | backward
  role: Role
  weight_operand: Optional[int]  # 0 (lhs) or 1 (rhs) for fprop/dgrad
  weight_arg: Optional[str]  # the @main argument the layer's weight comes from
  # that argument's sharding annotation (Shardy's or GSPMD's) replicates it over the mesh: every device holds it whole
  weight_replicated: bool = False
  block: Optional[int]  # static block index
  num_stacked: Optional[int]  # layers in the scanned stack when the block is per iteration
  block_offset: Optional[int]  # global block index of the scanned stack's first layer
  is_head: bool
  head_reason: Optional[str]  # how the head was found (dataflow, or the name where the dataflow is inconclusive)
  excluded_scope: bool
  higher_order: bool  # the dot differentiates a derivative: a transpose inside a jvp, or two transposes (a gradient
  #                    taken inside the loss, as a gradient penalty does)
  lhs_shape: tuple
  rhs_shape: tuple
  out_shape: tuple
  dtype: str  # of the result
  operand_dtypes: tuple  # (lhs, rhs) element types
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
  block_index: dict = dataclasses.field(default_factory=dict)  # index in block_values -> BlockIndex


def name_of(loc) -> str:
  """The leading name of a location (or of its text: printing a location is the costly part, so callers reuse it)."""
  m = _NAME_LOC_RE.match(loc if isinstance(loc, str) else str(loc))
  return m.group(1).encode().decode("unicode_escape") if m else ""


def frame_of(loc) -> str:
  """The location without its leading name: identifies the source frame (the Python call that made the op)."""
  text = loc if isinstance(loc, str) else str(loc)
  m = _NAME_LOC_RE.match(text)
  return text[m.end(1) + 1:] if m else text


def frames_of(loc) -> tuple:
  """The source frames (file, line, column) of an op's location, innermost first."""
  return tuple(_FILE_LOC_RE.findall(frame_of(loc)))


def _same_frame(a, b):
  """Frames of one Python call. Backward and remat copies of an op carry more outer frames than the forward op (the
  scan body's or checkpoint's callers; JAX elides frames differently per trace), so: the same innermost frame, and the
  shorter frame list a subsequence of the longer."""
  if not a or not b or a[0] != b[0]:
    return False
  short, long_ = (a, b) if len(a) <= len(b) else (b, a)
  rest = iter(long_)
  return all(f in rest for f in short)


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
    if c and c not in _NOISE and not c.startswith(("branch_", "jit:")) and "->" not in c and \
        (not parts or parts[-1] != c):
      # Dropped: einsum specs (jnp.einsum's own scope) and repeats (nn.scan names the lifted module and the
      # scanned one alike).
      parts.append(c)
  return "/".join(parts)


def _path_from_arg(arg_name: str) -> str:
  """p['params']['block_0']['fc1']['kernel'] -> block_0/fc1 (the layer of a weight, for NNX and plain pytrees)."""
  keys = re.findall(r"\[\s*'?([^'\]]+)'?\s*\]|\.(\w+)", arg_name)
  parts = [a or b for a, b in keys]
  parts = [p for p in parts
           if p not in ("params", "kernel", "value", "w", "weight", "weights", "embedding", "raw_value")]
  return "/".join(parts)


def _indexed_subtrees(path):
  """[(stack, index, rest)] for each numbered component of a parameter path, outermost first:
  decoder/layers_3/mlp/wi_0 -> [("decoder/layers", 3, "mlp/wi_0"), ("decoder/layers_3/mlp/wi", 0, "")]."""
  parts = path.split("/") if path else []
  out = []
  for n, part in enumerate(parts):
    m = _INDEXED_RE.match(part)
    if m:
      stem = m.group(1) if m.group(1) else ""
      out.append(("/".join(parts[:n] + ([stem] if stem else [])), int(m.group(2)), "/".join(parts[n + 1:])))
  return out


def _annotated_replicated(attrs):
  """Whether an argument's attributes shard it over no mesh axis: Shardy's `sdy.sharding` with no axis on any dim,
  or GSPMD's `mhlo.sharding = "{replicated}"`. No annotation (JAX's unspecified sharding, which propagation may
  still shard) is not replicated."""
  if "sdy.sharding" in attrs:
    sharding = sdy.TensorShardingAttr(attrs["sdy.sharding"])
    return all(not sdy.DimensionShardingAttr(d).axes for d in sharding.dimension_shardings)
  if "mhlo.sharding" in attrs:
    return ir.StringAttr(attrs["mhlo.sharding"]).value == "{replicated}"
  return False


def _shape(v):
  return tuple(ir.RankedTensorType(v.type).shape)


class _Module:
  """Symbol table, call graph and @main argument names of a module."""

  def __init__(self, module):
    self.funcs = {}
    self._prefixes = {}  # function name -> call_prefix
    self.calls = {}  # callee -> [call ops], program order
    self.order = []  # (func name, op) for every dot_general and func.call, program order
    for op in module.body.operations:
      if op.operation.name == "func.func":
        name = ir.StringAttr(op.attributes["sym_name"]).value
        self.funcs[name] = op
    for name, f in self.funcs.items():
      self._collect(name, f.operation)
    main = self.funcs.get("main")
    self.main_args = []
    self.replicated_args = set()  # indices of @main arguments annotated as replicated over the mesh
    if main is not None:
      for a in main.regions[0].blocks[0].arguments:
        self.main_args.append(name_of(a.location) or f"arg{a.arg_number}")
      if "arg_attrs" in main.attributes:
        self.replicated_args = {i for i, attrs in enumerate(ir.ArrayAttr(main.attributes["arg_attrs"]))
                                if _annotated_replicated(ir.DictAttr(attrs))}

  def _collect(self, fname, func_op):
    """Dots and calls of one function; the walk itself runs in C++ (a Python walk was a third of the pass time)."""
    def visit(op):
      if op.name in ("stablehlo.dot_general", "func.call"):
        op = op.operation
        self.order.append((fname, op))
        if op.name == "func.call":
          self.calls.setdefault(ir.FlatSymbolRefAttr(op.attributes["callee"]).value, []).append(op)
      return ir.WalkResult.ADVANCE
    func_op.walk(visit, ir.WalkOrder.PRE_ORDER)

  def call_prefix(self, fname, seen=()):
    """Name stack of the first call site of `fname`, recursively; '' for main."""
    if fname in self._prefixes:
      return self._prefixes[fname]
    sites = self.calls.get(fname)
    if fname == "main" or not sites or fname in seen:
      return ""
    call = sites[0]
    caller = self._enclosing_func(call)
    prefix = self.call_prefix(caller, seen + (fname,))
    own = name_of(call.location)
    result = self._prefixes[fname] = f"{prefix}/{own}" if prefix and own else (prefix or own)
    return result

  def _enclosing_func(self, op):
    while op is not None and op.name != "func.func":
      op = op.parent
    return ir.StringAttr(op.attributes["sym_name"]).value if op is not None else "main"

  def enclosing_func(self, op):
    return self._enclosing_func(op.parent)

  def callee(self, call):
    """The func.func a func.call calls (None for an unknown symbol)."""
    return self.funcs.get(ir.FlatSymbolRefAttr(call.attributes["callee"]).value)

  def around(self, op):
    """The ops enclosing `op`, innermost first, leaving an outlined function through its first call site."""
    cur = op.parent
    while cur is not None:
      yield cur
      if cur.name == "func.func":
        calls = self.calls.get(ir.StringAttr(cur.attributes["sym_name"]).value)
        cur = calls[0] if calls else None
      else:
        cur = cur.parent


def specialize_call_sites(module) -> int:
  """Give each call of a function that holds a dot_general a copy of its own (`<name>_site<k>`), so that every dot is
  analysed and rewritten in its own calling context: one jitted `dense` helper applied to 8 layers is 8 layers, each
  with its weight, its block and its decision. For the pipeline's clone, never the user's module; returns how many
  copies were made. JAX lowers no recursion, so this ends."""
  copies = 0
  while True:
    mod = _Module(module)
    holds_dot = {fname for fname, op in mod.order if op.name == "stablehlo.dot_general"}
    calls = [(fname, ir.FlatSymbolRefAttr(op.attributes["callee"]).value) for fname, op in mod.order
             if op.name == "func.call"]
    grown = True
    while grown:  # a function holds a dot when it or anything it calls does
      grown = bool({caller for caller, callee in calls if callee in holds_dot} - holds_dot)
      holds_dot |= {caller for caller, callee in calls if callee in holds_dot}
    shared = [(callee, sites) for callee, sites in mod.calls.items()
              if len(sites) > 1 and callee in holds_dot and callee in mod.funcs]
    if not shared:
      return copies
    for callee, sites in shared:
      for k, site in enumerate(sites[1:], start=1):
        copy = mod.funcs[callee].operation.clone()
        name = f"{callee}_site{k}"
        while name in mod.funcs:
          name += "_"
        copy.attributes["sym_name"] = ir.StringAttr.get(name)
        module.body.append(copy)
        mod.funcs[name] = copy
        site.attributes["callee"] = ir.FlatSymbolRefAttr.get(name)
        copies += 1


@dataclasses.dataclass
class _Source:
  arg: int  # @main argument index
  index: Any = None  # dynamic_slice start index (layer of a stacked weight), in `entry_call`'s caller scope
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
      if parent.name in ("stablehlo.while", "sdy.manual_computation"):  # loop carries, shard_map bodies
        return self.trace(parent.operands[arg.arg_number], stack, entry, depth + 1)
      return None
    res = ir.OpResult(value)
    op = res.owner.operation if hasattr(res.owner, "operation") else res.owner
    name = op.name
    forwarded = _forwarded(op, res.result_number)
    if forwarded is not None:
      return self.trace(forwarded, stack, entry, depth + 1)
    if name == "stablehlo.dynamic_slice":
      src = self.trace(op.operands[0], stack, entry, depth + 1)
      if src is not None and src.stacked is None:
        src.index = self._lift(op.operands[1], stack)
        src.stacked = _shape(op.operands[0])[0]
      elif src is not None:  # a slice of a slice (nested scans): the flat layer index is no value of the program
        src.index, src.stacked = None, src.stacked * _shape(op.operands[0])[0]
      return src
    if name == "func.call":
      callee = self.mod.callee(op)
      if callee is None:
        return None
      ret = _terminator(callee.regions[0])
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


def _forwarded(op, result_number):
  """The operand whose values `op`'s result `result_number` carries unchanged up to layout, dtype or sharding, or None:
  the one definition of what the upstream walks (_Tracer.trace to a weight's parameter, _root to a tensor's origin)
  look through. Where they differ is only how they cross functions and loops."""
  if op.name in _PASS_THROUGH:
    return op.operands[0]
  if op.name == "stablehlo.custom_call" and \
      ir.StringAttr(op.attributes["call_target_name"]).value in _SHARDING_TARGETS:
    return op.operands[0]
  if op.name == "stablehlo.optimization_barrier":
    return op.operands[result_number]
  return None


def _root(mod, value):
  """The value a chain of _forwarded ops starts from, followed out of functions with a single call site (nested jit,
  remat and custom_jvp bodies) and through functions that return an argument, not into loops (a loop-carried value
  is another tensor every iteration): dots that read the same tensor get the same root."""
  for _ in range(256):
    if isinstance(value.owner, ir.Block):
      parent = ir.BlockArgument(value).owner.owner
      if parent is not None and parent.operation.name == "sdy.manual_computation":
        value = parent.operation.operands[ir.BlockArgument(value).arg_number]
        continue
      if parent is None or parent.operation.name != "func.func":
        return value
      calls = mod.calls.get(ir.StringAttr(parent.operation.attributes["sym_name"]).value, [])
      if len(calls) != 1:
        return value
      value = calls[0].operands[ir.BlockArgument(value).arg_number]
      continue
    op = value.owner.operation if hasattr(value.owner, "operation") else value.owner
    if op.name == "func.call":  # a value a function passes through (a residual returned by a jitted forward)
      callee = mod.callee(op)
      inner = _terminator(callee.regions[0]).operands[ir.OpResult(value).result_number] if callee else None
      if inner is None or not isinstance(inner.owner, ir.Block):
        return value
      value = op.operands[ir.BlockArgument(inner).arg_number]
      continue
    forwarded = _forwarded(op, ir.OpResult(value).result_number)
    if forwarded is None:
      return value
    value = forwarded
  return value


def _users(value):
  for use in value.uses:
    yield (use.owner.operation if hasattr(use.owner, "operation") else use.owner), use.operand_number


def _terminator(region):
  block = region.blocks[0]
  return block.operations[len(block.operations) - 1]


class _Dataflow:
  """Walks over values across functions, loops and branches, cut at dot_generals, for the head analysis: a head is the
  linear layer whose output reaches the loss with no other dot in between (docs/design.md §3)."""

  LIMIT = 20000  # values visited per walk; beyond it the answer is "inconclusive"

  def __init__(self, mod):
    self.mod = mod

  def no_dot_upstream(self, value, barrier):
    """Whether the slice upstream of `value`, cut at every dot_general, reaches no dot for which `barrier(op)` holds:
    True, False, or None when the slice could not be followed to its end. Calls are followed in context: a callee's
    argument entered through one call's result leads back to that call's operand only."""
    todo, seen = collections.deque([(value, ())]), set()  # breadth first: the nearest dot decides most walks
    while todo:
      v, calls = todo.popleft()
      if (v, calls[-1:]) in seen:
        continue
      seen.add((v, calls[-1:]))
      if len(seen) > self.LIMIT:
        return None
      if isinstance(v.owner, ir.Block):
        arg = ir.BlockArgument(v)
        parent = arg.owner.owner
        parent = parent.operation if parent is not None else None
        if parent is None:
          return None
        if parent.name == "func.func":
          fname = ir.StringAttr(parent.attributes["sym_name"]).value
          if calls:
            todo.append((calls[-1].operands[arg.arg_number], calls[:-1]))
          elif fname != "main":
            todo.extend((call.operands[arg.arg_number], ()) for call in self.mod.calls.get(fname, []))
        elif parent.name == "stablehlo.while":
          todo.append((parent.operands[arg.arg_number], calls))
          todo.append((_terminator(parent.regions[1]).operands[arg.arg_number], calls))
        elif parent.name == "sdy.manual_computation":
          todo.append((parent.operands[arg.arg_number], calls))
        else:
          return None
        continue
      res = ir.OpResult(v)
      op = res.owner.operation if hasattr(res.owner, "operation") else res.owner
      if op.name == "stablehlo.dot_general":
        if barrier(op):
          return False
        continue
      if op.name == "func.call":
        callee = self.mod.callee(op)
        if callee is None:
          return None
        todo.append((_terminator(callee.regions[0]).operands[res.result_number], calls + (op,)))
      elif op.name in ("stablehlo.while", "stablehlo.case", "stablehlo.if", "sdy.manual_computation"):
        body = [1] if op.name == "stablehlo.while" else range(len(op.regions))
        todo.extend((_terminator(op.regions[r]).operands[res.result_number], calls) for r in body)
        todo.extend((o, calls) for o in op.operands)
      else:
        todo.extend((o, calls) for o in op.operands)
    return True

  def reaches_loss(self, value):
    """True when `value` reaches a scalar result of @main (a loss) through no dot; False when it does not; None when
    the walk could not finish."""
    todo, seen = [value], set()
    while todo:
      v = todo.pop()
      if v in seen:
        continue
      seen.add(v)
      if len(seen) > self.LIMIT:
        return None
      for user, i in _users(v):
        if user.name == "stablehlo.dot_general":
          continue
        if user.name == "func.return":
          fname = self.mod.enclosing_func(user)
          if fname == "main":
            if not _shape(v):
              return True
            continue
          todo.extend(call.results[i] for call in self.mod.calls.get(fname, []))
        elif user.name in ("stablehlo.return", "sdy.return"):
          parent = user.parent
          if parent is None:
            return None
          if parent.name == "stablehlo.while" and user.block == parent.regions[0].blocks[0]:
            continue  # the loop condition
          todo.append(parent.results[i])
        elif user.name == "func.call":
          callee = self.mod.callee(user)
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


def _excluded(mod, op):
  """Whether xla_fp4.exclude() marked `op`, or an op or call site around it: JAX writes set_xla_metadata's key into
  the `mhlo.frontend_attributes` of every op traced in its scope, the transposed dots of the backward pass included."""
  return any("mhlo.frontend_attributes" in o.attributes and
             EXCLUDE_ATTRIBUTE in ir.DictAttr(o.attributes["mhlo.frontend_attributes"]) for o in (op, *mod.around(op)))


def _phase(stack):
  return "backward" if "transpose(" in stack and "rematted_computation" not in stack else "forward"


def _layer(stack_path, arg_name):
  """The layer of a linear dot: the name-stack path (linen module names, named scopes), completed with the weight's
  argument path where the name stack does not name the weight's module (NNX, plain pytrees)."""
  arg_path = _path_from_arg(arg_name) if arg_name else ""
  if not arg_path:
    return stack_path
  if not stack_path:
    return arg_path
  last = arg_path.split("/")[-1]
  if any(c == last or c.startswith(last + ".") for c in stack_path.split("/")):
    return stack_path
  return f"{stack_path}/{arg_path}"


class _Dot:
  """Per-dot facts gathered before classification."""

  def __init__(self, mod, fname, op, loc_text, stack, sources):
    self.fname, self.op, self.stack, self.sources = fname, op, stack, sources
    self.frames = frames_of(loc_text)
    self.path = layer_path(stack)
    self.phase = _phase(stack)
    self.roots = [_root(mod, v) for v in op.operands]
    self.out_shape = _shape(op.results[0])
    self.role, self.w, self.src, self.partner = Role.OTHER, None, None, None


def _pair_backward(dots):
  """Classify backward dots against the forward linear dots (fprops) of the same source frame: dgrad when an operand
  is the fprop's weight; wgrad when the result has the weight's shape and the dot shares the gradient with the layer's
  dgrad, or the activation with the fprop (value identity through pass-through ops); with no dataflow link, the last
  not yet paired fprop of that shape (JAX transposes in reverse program order). Anything else stays `other`."""
  forward = {}  # innermost frame -> forward dots
  for j, d in enumerate(dots):
    if d.phase == "forward" and d.frames:
      forward.setdefault(d.frames[0], []).append(j)
  backward = [i for i, d in enumerate(dots) if d.phase == "backward"]
  cands = {}
  for i in backward:
    d = dots[i]
    bucket = forward.get(d.frames[0] if d.frames else None, ())
    # Where a forward dot of the frame carries the same layer path (linen, named scopes), only that layer pairs.
    same_path = [j for j in bucket if d.path and dots[j].path == d.path]
    same_frame = [j for j in same_path if _same_frame(d.frames, dots[j].frames)]
    if not same_frame:
      same_frame = [j for j in bucket if _same_frame(d.frames, dots[j].frames)]
    cands[i] = [j for j in same_frame if dots[j].role == "fprop"]
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
  products = {r for d in dots if d.phase == "forward" and d.role == "other" for r in d.roots}
  gradients = {}  # fprop index -> the gradient operand roots of its dgrads
  for k in backward:
    if dots[k].role == "dgrad":
      gradients.setdefault(dots[k].partner, []).append(dots[k].roots[1 - dots[k].w])
  for i in backward:
    d = dots[i]
    if d.role != "other":
      continue
    shaped = [j for j in candidates(i)
              if sorted(d.out_shape) == sorted(_shape(dots[j].op.operands[dots[j].w]))]
    if not shaped:
      continue
    partner = None
    for g in (k for k in backward if dots[k].role == "dgrad" and dots[k].partner in shaped):
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
    d.src = _local_source(dots, d, dots[partner].src)


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


def _loop_of(mod, op):
  """The innermost stablehlo.while around `op`, through the first call site of outlined functions; None if none."""
  return next((o for o in mod.around(op) if o.name == "stablehlo.while"), None)


def _blocks(mod, dots):
  """({dot index: (global block, num_stacked, block_offset)}, number of blocks). Blocks are the repeated parameter
  subtrees: numbered children of one parent (decoder/layers_0..3, layers/0..11) of which at least two hold the same
  layers (sub-paths and weight shapes: fc1/fc2 or differently sized MLP layers are no blocks), and the layers of a
  scanned stack (a stacked weight sliced per iteration). Parallel lists whose layers interleave (w1[i], w2[i]) share
  their block numbers. Stacks are numbered in the order their first
  fprop runs (an encoder's blocks before a decoder's), so that "the last blocks" are the last of the network. A
  layer's backward dots take its fprop's block."""
  stacks = {}  # key -> {"first": fprop index, "size": int, "fprops": {fprop index: local index or None}, "layout"}
  first_use = {}  # weight argument -> its first fprop (a remat copy in the backward loop joins the forward's stack)
  static = {}  # fprop index -> its numbered components, outermost first
  for j, f in enumerate(dots):
    if f.role != "fprop":
      continue
    first = dots[first_use.setdefault(f.src.arg, j)]
    if f.src.stacked is not None:
      stack = stacks.setdefault(("scan", _loop_of(mod, first.op)), {"first": j, "size": 0, "fprops": {}})
      stack["size"] = max(stack["size"], f.src.stacked)
      stack["fprops"][j] = None
      continue
    arg_name = mod.main_args[f.src.arg] if f.src.arg < len(mod.main_args) else ""
    static[j] = _indexed_subtrees(_path_from_arg(arg_name)) or _indexed_subtrees(f.path)
  layouts = {}  # candidate stack -> {index: {(sub-path, weight shape)}}: what each numbered subtree holds
  for j, found in static.items():
    for stack, index, rest in found:
      layouts.setdefault(stack, {}).setdefault(index, set()).add((rest, _shape(dots[j].op.operands[dots[j].w])))
  repeated = {k for k, v in layouts.items() if len({frozenset(x) for x in v.values()}) < len(v)}
  for j, found in static.items():  # each layer joins the outermost of its numbered components that repeats
    stack, index, _ = next((c for c in found if c[0] in repeated), (None, None, None))
    if stack is not None:
      entry = stacks.setdefault(("static", stack), {"first": j, "size": 0, "fprops": {}})
      entry["size"] = max(entry["size"], index + 1)
      entry["fprops"][j] = index
  # Parallel lists of one network ({"w1": [...], "w2": [...]}) are one stack of blocks when their layers interleave
  # (w1[0], w2[0], w1[1], ...): block i is layer i of each.
  order = sorted(stacks, key=lambda k: stacks[k]["first"])
  firsts = {k: {i: min(j for j, l in stacks[k]["fprops"].items() if l == i) for i in set(stacks[k]["fprops"].values())}
            for k in order if k[0] == "static"}
  joins = {}  # stack -> the stack whose block numbers it shares
  for n, a in enumerate(order):
    if a not in firsts or a in joins:
      continue
    for b in order[n + 1:]:
      if b in firsts and b not in joins and set(firsts[a]) == set(firsts[b]):
        idx = sorted(firsts[a])
        if all(firsts[a][i] < firsts[b][i] for i in idx) and \
            all(firsts[b][i] < firsts[a][k] for i, k in zip(idx, idx[1:])):
          joins[b] = a
  offset, offsets, by_fprop = 0, {}, {}
  for key in order:
    stack = stacks[key]
    start = offsets[joins[key]] if key in joins else offset
    offsets[key] = start
    for j, local in stack["fprops"].items():
      by_fprop[j] = (start + local, None, None) if local is not None else (None, stack["size"], start)
    if key not in joins:
      offset += stack["size"]
  out = {}
  for i, d in enumerate(dots):
    owner = i if d.role == "fprop" else d.partner
    if d.role != "other" and owner in by_fprop:
      out[i] = by_fprop[owner]
  return out, offset


def _heads(mod, dots):
  """{fprop index: how it was found} for the output heads: a head is a linear layer whose output reaches the loss with
  no other dot in between. In a gradient step that is a layer whose backward dots take a gradient that no other
  backward dot has touched: the slice upstream of their gradient operand holds forward dots only (the activations
  the loss is computed from), where any layer between this one and the loss would have put its dgrad. In a program
  without backward dots (an eval step) a head's output reaches a scalar result of @main (a loss) through no dot.
  Where the dataflow cannot be followed to its end the layer name breaks the tie, and the reason says so."""
  flow = _Dataflow(mod)
  backward = {d.op: d.phase == "backward" for d in dots}  # operations hash and compare by the op they wrap
  is_backward = lambda op: backward.get(op, True)  # noqa: E731
  any_backward = any(d.phase == "backward" for d in dots)
  heads, recomputed = {}, []
  for j, f in enumerate(dots):
    if f.role != "fprop":
      continue
    if "rematted_computation" in f.stack:  # remat's copy of a fprop: judged with the fprop it recomputes, below
      recomputed.append(j)
      continue
    verdicts = []
    for d in dots:
      if d.partner != j:
        continue
      if d.role == "dgrad":
        grad = d.op.operands[1 - d.w]
      else:  # wgrad: the operand that is not the fprop's activation
        others = [k for k in (0, 1) if d.roots[k] != f.roots[1 - f.w]]
        if len(others) != 1:
          continue
        grad = d.op.operands[others[0]]
      verdicts.append(flow.no_dot_upstream(grad, is_backward))
    if not verdicts:
      if any_backward:  # a layer without gradient in a gradient step (frozen): nothing says it feeds the loss
        continue
      verdicts = [flow.reaches_loss(f.op.results[0])]
    if False in verdicts:
      continue
    if None not in verdicts:
      heads[j] = "its output reaches the loss with no other linear layer in between"
    elif _HEAD_RE.search(f.path.split("/")[-1] if f.path else ""):
      heads[j] = "by its name (the dataflow to the loss could not be followed)"
  layer = lambda f: (f.src.arg, _shape(f.op.operands[0]), _shape(f.op.operands[1]), _dot_dims(f.op))  # noqa: E731
  for j in recomputed:
    reason = next((heads[h] for h in heads if layer(dots[h]) == layer(dots[j])), None)
    if reason is not None:
      heads[j] = reason
  return heads


def analyze(module) -> Analysis:
  mod = _Module(module)
  tracer = _Tracer(mod)
  dots = []
  for fname, op in mod.order:
    if op.name != "stablehlo.dot_general":
      continue
    prefix = mod.call_prefix(fname)
    loc_text = str(op.location)
    own = name_of(loc_text)
    stack = f"{prefix}/{own}" if prefix and own else (prefix or own)
    dots.append(_Dot(mod, fname, op, loc_text, stack, [tracer.trace(op.operands[i]) for i in (0, 1)]))

  # Forward dots: fprop when an operand is a parameter, else other. Where both trace to @main arguments (a first
  # layer fed the raw input), the weight is the one a backward dot takes the gradient of: it has the operand's shape
  # and reads the other operand (the wgrad); with no such evidence the rhs (x @ W).
  backward = [d for d in dots if d.phase == "backward"]
  for d in dots:
    if d.phase == "forward":
      d.w = 1 if d.sources[1] is not None else (0 if d.sources[0] is not None else None)
      if d.sources[0] is not None and d.sources[1] is not None:
        evidence = [k for k in (0, 1) if any(sorted(b.out_shape) == sorted(_shape(d.op.operands[k])) and
                                             d.roots[1 - k] in b.roots for b in backward)]
        if len(evidence) == 1:
          d.w = evidence[0]
      if d.w is not None:
        d.role, d.src = Role.FPROP, d.sources[d.w]
  _pair_backward(dots)
  heads = _heads(mod, dots)
  blocks, num_blocks = _blocks(mod, dots)

  sites, ops, block_values, block_index = [], {}, {}, {}
  for i, d in enumerate(dots):
    op, src = d.op, d.src
    arg_name = mod.main_args[src.arg] if src is not None and src.arg < len(mod.main_args) else None
    replicated = src is not None and src.arg in mod.replicated_args
    layer = _layer(d.path, arg_name) if d.role != "other" else d.path
    (lc, rc), (lb, rb) = _dot_dims(op)
    ls, rs = _shape(op.operands[0]), _shape(op.operands[1])
    out = d.out_shape
    k = int(math.prod([ls[x] for x in lc]))
    batch = int(math.prod([ls[x] for x in lb]))
    m = batch * int(math.prod([ls[x] for x in range(len(ls)) if x not in lc and x not in lb]))
    n = int(math.prod([rs[x] for x in range(len(rs)) if x not in rc and x not in rb]))
    block, stacked, offset = blocks.get(i, (None, None, None))
    if stacked is not None and src.index is not None:
      block_values[i] = (src.index, src.entry_call)
      block_index[i] = (BlockIndex.IN_SCOPE if src.entry_call is None and visible(src.index, op) else
                        BlockIndex.PASSED_IN if src.entry_call is not None and visible(src.index, src.entry_call) else
                        BlockIndex.UNAVAILABLE)
    head = heads.get(i if d.role == "fprop" else d.partner) if d.role != "other" else None
    sites.append(DotSite(
        index=i, func=d.fname, name_stack=d.stack, layer=layer, phase=d.phase, role=d.role,
        weight_operand=d.w if d.role in ("fprop", "dgrad") else None, weight_arg=arg_name, weight_replicated=replicated,
        block=block, num_stacked=stacked, block_offset=offset, is_head=head is not None, head_reason=head,
        excluded_scope=_excluded(mod, op),
        higher_order="jvp(transpose(" in d.stack or d.stack.count("transpose(") > 1, lhs_shape=ls, rhs_shape=rs,
        out_shape=out, dtype=str(ir.RankedTensorType(op.results[0].type).element_type),
        operand_dtypes=tuple(str(ir.RankedTensorType(v.type).element_type) for v in op.operands[:2]), m=m, n=n, k=k,
        flops=2 * int(math.prod(out)) * k, contracting=(lc, rc), batch=(lb, rb)))
    ops[i] = op
  return Analysis(sites=sites, ops=ops, block_values=block_values, num_blocks=num_blocks, block_index=block_index)


def visible(value, op):
  """Whether `value` can be used at `op`: defined in an enclosing block, and before `op` if in the same block."""
  if isinstance(value.owner, ir.Block):
    vblock, vop = value.owner, None
  else:
    vop = value.owner.operation if hasattr(value.owner, "operation") else value.owner
    vblock = vop.block
  cur = op
  while cur is not None:
    if cur.block == vblock:
      return vop is None or vop.is_before_in_block(cur)
    cur = cur.parent
  return False
