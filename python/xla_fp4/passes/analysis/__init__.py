"""Analysis: find every stablehlo.dot_general, classify its phase and role, trace its weight, find its layer, block
and whether it is the output head. Reads the module only; returns one `DotRecord` per dot (records.py).

Input: a StableHLO module as JAX lowers it. For example

  func.func public @main(%arg0: tensor<32x64xf32> loc("p['params']['fc1']['kernel']"), %arg1: tensor<8x32xf32> ...)
    %0 = stablehlo.dot_general %arg1, %arg0, contracting_dims = [1] x [0]
           loc("jit(step)/jvp(MLP)/fc1/dot_general"(...))              -> fprop, weight = rhs, layer MLP/fc1
    %5 = stablehlo.dot_general %g, %arg0, contracting_dims = [1] x [1]
           loc("jit(step)/transpose(jvp(MLP))/fc1/dot_general"(...))   -> dgrad (an operand is fc1's weight)
    %6 = stablehlo.dot_general %g, %arg1, contracting_dims = [0] x [0]
           loc("jit(step)/transpose(jvp(MLP))/fc1/dot_general"(...))   -> wgrad (same source frame, no weight operand)

One module per concern (docs/design.md §4):
  callgraph.py  the call graph and the one step every walk takes across functions, loops and shard_map bodies
  names.py      name stacks, source frames, phase, layer paths (ops in outlined functions carry names relative to
                their call site, so the first call site's name stack is prefixed)
  trace.py      a dot operand to the @main argument it reads (the weight), a tensor to its origin
  roles.py      fprop / dgrad / wgrad / other
  heads.py      the output head, from the dataflow of its gradient
  blocks.py     the repeated blocks and, in scanned stacks, where the iteration's block index is
  ragged.py     expert GEMMs: ragged dots (chlo.ragged_dot on GPU, masked dot_generals on CPU) and expert einsums,
                and their groups (one global decode scale per expert or group of tokens)
Also here: `excluded_scope` (the dot, or an op or call site around it, carries the `xla_fp4_exclude` frontend
attribute that `xla_fp4.exclude()` sets; JAX copies it onto the transposed dots) and `higher_order` (names.py).
"""

import itertools
import math

from jax._src.lib.mlir import ir

from xla_fp4.passes.analysis import blocks as blocks_mod
from xla_fp4.passes.analysis import heads as heads_mod
from xla_fp4.passes.analysis import names
from xla_fp4.passes.analysis import roles
from xla_fp4.passes.analysis import peers
from xla_fp4.passes.analysis.callgraph import CallGraph, shape, specialize_call_sites
from xla_fp4.passes.analysis.records import (Analysis, BlockIndex, BlockSource, DotRecord, DotSite, Gemm, Grouping,
                                             Groups, Phase, Role)
from xla_fp4.passes.analysis import ragged
from xla_fp4.passes.analysis.trace import Tracer, dot_dims, ragged_dot_dims, replicated_arguments

__all__ = ["Analysis", "BlockIndex", "BlockSource", "DotRecord", "DotSite", "EXCLUDE_ATTRIBUTE", "Gemm", "Grouping",
           "Groups", "Phase", "Role", "analyze", "specialize_call_sites"]

EXCLUDE_ATTRIBUTE = "xla_fp4_exclude"  # the frontend attribute xla_fp4.exclude() sets (jax's set_xla_metadata)


def analyze(module, graph=None) -> Analysis:
  """One DotRecord per dot of `module` (`graph`: its CallGraph, when the caller has it)."""
  graph = graph or CallGraph(module)
  tracer = Tracer(graph)
  arg_names = names.argument_names(graph.main)
  replicated = replicated_arguments(graph.main)
  dots, around = [], []  # around: the ops enclosing each dot, innermost first
  # Facts that dots share, found once: a location's text after its name -> its source frames (each block's dots share
  # them); an operand value -> its roles.Operand.
  frames, operands = {}, {}
  for fname, op in graph.dots():
    loc_text = str(op.location)  # printing a location is the costly part: once per dot
    around.append(list(graph.around(op)))
    stack = _name_stack(graph, fname, around[-1], loc_text)
    frame = names.frame_of(loc_text)
    if frame not in frames:
      frames[frame] = names.frames_of(frame)
    values = (op.operands[0], op.operands[1])
    for v in values:
      if v not in operands:
        operands[v] = roles.Operand(graph, tracer, v)
    dots.append(roles.Dot(fname, op, frames[frame], stack, [operands[v] for v in values]))
  roles.classify_forward(dots)
  roles.pair_backward(dots)
  heads = heads_mod.heads(graph, dots)
  blocks, num_blocks, blocks_found = blocks_mod.blocks(graph, arg_names, dots)

  found = {i: ragged.groups(d.op, d.role is not Role.OTHER, d.masked) for i, d in enumerate(dots)}
  found.update(ragged.dense_expert_groups(graph, dots, found))
  dot_peers = peers.of_dots(dots, found, around)
  positional = _positional_layers(dots, arg_names, blocks)
  records, geometries, layers = [], {}, {}  # memos: _gemm's; (layer path, weight argument) -> layer
  for i, d in enumerate(dots):
    src = d.src
    arg_name = arg_names[src.arg] if src is not None and src.arg < len(arg_names) else None
    place = blocks.get(i, blocks_mod.Place())
    linear = d.role is not Role.OTHER
    enclosing = around[i]
    layer = d.path
    if linear:
      if src is not None and src.arg in positional:
        layer = positional[src.arg]
      else:
        key = (d.path, arg_name)  # a layer's fprop, dgrad and wgrad share both
        if key not in layers:
          layers[key] = names.layer_of(*key)
        layer = layers[key]
    site = DotSite(
        index=i, func=d.fname, name_stack=d.stack, layer=layer,
        phase=d.phase, role=d.role, weight_operand=d.w if d.role in (Role.FPROP, Role.DGRAD) else None,
        gradient_operand=d.gradient if d.role is Role.WGRAD else None,
        weight_arg=arg_name, weight_replicated=src is not None and src.arg in replicated,
        block=place.block, num_stacked=place.num_stacked, block_offset=place.offset, block_stride=place.stride,
        head_reason=heads.get(i if d.role is Role.FPROP else d.partner) if linear else None,
        excluded_scope=_excluded(d.op, enclosing), higher_order=names.higher_order(d.stack),
        ragged=d.ragged, groups=found[i],
        in_shard_map=any(o.name == "sdy.manual_computation" for o in enclosing), peers=dot_peers[i],
        gemm=_gemm(d.op, geometries))
    source = blocks_mod.block_source(d.op, src) if place.num_stacked is not None else None
    mask = ragged.expansion_mask(d.op) if found[i] is not None and found[i].kind is Grouping.SLICES else None
    records.append(DotRecord(op=d.op, site=site, block_source=source, group_mask=mask))
  return Analysis(records=records, num_blocks=num_blocks, blocks_found=blocks_found)


def _positional_layers(dots, arg_names, blocks):
  """{weight argument: layer name} where the parameters are a flat list of leaves (nnx.jit's `states/0/23`,
  Equinox's `first/12`, penzai), numbered with gaps (the biases, norms between): a leaf number says nothing, so the
  name says where the layer runs in the forward's dataflow, `block_<b>/linear_<k>` (the k-th layer of block b) or
  `linear_<k>` (the k-th outside blocks: an embedding projection, the head). {} where the parameters have paths."""
  fprops = [(i, d) for i, d in enumerate(dots) if d.role is Role.FPROP and d.src is not None]
  paths = {d.src.arg: names.path_from_arg(arg_names[d.src.arg]) if d.src.arg < len(arg_names) else ""
           for _, d in fprops}
  if not names.leaf_numbered(paths.values()):
    return {}
  numbers = sorted(int(p.split("/")[-1]) for p in paths.values())
  if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
    return {}  # one leaf per layer (a list of weights, ws[i]): the numbers count layers and name them
  out, count = {}, {}
  for i, d in fprops:  # program order: the forward's first use of each weight comes first
    if d.src.arg not in out:
      block = blocks.get(i, blocks_mod.Place()).block
      count[block] = count.get(block, -1) + 1
      out[d.src.arg] = f"block_{block}/linear_{count[block]}" if block is not None else f"linear_{count[block]}"
  return out


def _name_stack(graph, fname, enclosing, loc_text):
  """An op's name stack (from its printed location), prefixed with its function's first call site's and with those of
  the shard_map bodies around it in the function (`enclosing`: graph.around the op): JAX names the ops of a body from
  the body's own scope, and the transforms around it (`transpose(`, `rematted_computation`: the phase) are on the
  sdy.manual_computation."""
  in_function = itertools.takewhile(lambda o: o.name != "func.func", enclosing)
  bodies = [names.name_of(str(o.location)) for o in in_function if o.name == "sdy.manual_computation"]
  parts = [graph.call_prefix(fname), *reversed(bodies)]
  parts.append(names.name_of(loc_text))
  return "/".join(p for p in parts if p)


def _gemm(op, memo) -> Gemm:
  """`_geometry(op)` from `memo`, kept for the module: its dots repeat a few geometries (every block's alike), which
  the dims attribute and the operand and result types decide."""
  dims = op.attributes["ragged_dot_dimension_numbers" if op.name == "chlo.ragged_dot" else "dot_dimension_numbers"]
  key = (op.name, dims, op.operands[0].type, op.operands[1].type, op.results[0].type)
  if key not in memo:
    memo[key] = _geometry(op)
  return memo[key]


def _geometry(op) -> Gemm:
  """The geometry of a dot_general or a ragged dot (a ragged dot's rhs group dim selects the rhs matrix of each group
  of lhs rows and is no free dim)."""
  (lc, rc), (lb, rb) = dot_dims(op)
  rhs_groups = ragged_dot_dims(op)[1] if op.name == "chlo.ragged_dot" else ()
  ls, rs, out = shape(op.operands[0]), shape(op.operands[1]), shape(op.results[0])
  k = int(math.prod([ls[x] for x in lc]))
  batch = int(math.prod([ls[x] for x in lb]))
  m = batch * int(math.prod([ls[x] for x in range(len(ls)) if x not in lc and x not in lb]))
  n = int(math.prod([rs[x] for x in range(len(rs)) if x not in rc and x not in rb and x not in rhs_groups]))
  return Gemm(lhs_shape=ls, rhs_shape=rs, out_shape=out,
              dtype=str(ir.RankedTensorType(op.results[0].type).element_type),
              operand_dtypes=tuple(str(ir.RankedTensorType(v.type).element_type) for v in op.operands[:2]),
              contracting=(lc, rc), batch=(lb, rb), m=m, n=n, k=k, flops=2 * int(math.prod(out)) * k)


def _excluded(op, enclosing):
  """Whether xla_fp4.exclude() marked `op`, or an op or call site around it (`enclosing`): JAX writes
  set_xla_metadata's key into the `mhlo.frontend_attributes` of every op traced in its scope, the transposed dots of
  the backward pass included."""
  return any("mhlo.frontend_attributes" in o.attributes and
             EXCLUDE_ATTRIBUTE in ir.DictAttr(o.attributes["mhlo.frontend_attributes"]) for o in (op, *enclosing))
