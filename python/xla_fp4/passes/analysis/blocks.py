"""Blocks: the repeated units of the network, numbered in the order it runs them (for the policy's kept blocks).

Blocks are the repeated parameter subtrees: numbered children of one parent (decoder/layers_0..3, layers/0..11) of
which at least two hold the same layers (sub-paths and weight shapes: fc1/fc2 or differently sized MLP layers are no
blocks), and the layers of a scanned stack (a stacked weight sliced per iteration: trace.Source.stacked). Parallel
lists whose layers interleave (w1[i], w2[i]) share their block numbers. Stacks are numbered in the order their first
fprop runs (an encoder's blocks before a decoder's), into one global block index; a scanned stack records its first
block as `block_offset`. A layer's backward dots take its fprop's block. Where parameters reach the program as a flat
list (nnx.jit's graph state, jax.tree.leaves), their paths number leaves, not modules: the blocks are then the
longest run of the forward made of repeats of one unit of layers of the same shapes (`_repeated_in_dataflow`).

In a scanned stack the weight is a dynamic_slice of the stacked parameter, whose start index is the block index of
the current iteration within the stack: `block_source` says where the rewrite finds that value (records.BlockSource),
which may lie outside a shard_map body around the dot (MaxText's sparse MoE under FSDP): the rewrite threads it in.
Nested scans (a slice of a slice) give no value: the flat layer index exists nowhere in the program, so only
`num_stacked` (the product) is set.
"""

import dataclasses
import functools
from typing import Optional

from xla_fp4.passes.analysis import names
from xla_fp4.passes.analysis.callgraph import CallGraph, shape
from xla_fp4.passes.regions import in_scope
from xla_fp4.passes.analysis.records import BlockIndex, BlockSource, Role


def block_source(dot, src):
  """Where the rewrite finds the block index of `dot`'s iteration (src: its weight's trace.Source), or None."""
  if src is None or src.index is None:
    return None
  if src.entry_call is None:
    kind = BlockIndex.IN_SCOPE if in_scope(src.index, dot) else BlockIndex.UNAVAILABLE
  else:
    kind = BlockIndex.PASSED_IN if in_scope(src.index, src.entry_call) else BlockIndex.UNAVAILABLE
  return BlockSource(kind, src.index, src.entry_call)


def blocks(graph: CallGraph, names_of_args, dots):
  """(Blocks: {dot index: Place}, the number of blocks, how they were found): see the module docstring.
  `names_of_args`: @main's argument names (the parameter paths)."""
  stacks = {}  # key -> {"first": fprop index, "size": int, "fprops": {fprop index: local index or None}, "unit": ...}
  first_use = {}  # weight argument -> its first fprop (a remat copy in the backward loop joins the forward's stack)
  static = {}  # fprop index -> its numbered components, outermost first
  arg_paths = {}  # fprop index -> its weight's parameter path
  scanned_paths = {}  # scanned fprop index -> its stacked weight's parameter path
  for j, f in enumerate(dots):
    if f.role is not Role.FPROP:
      continue
    first = dots[first_use.setdefault(f.src.arg, j)]
    path = names.path_from_arg(names_of_args[f.src.arg] if f.src.arg < len(names_of_args) else "")
    if f.src.stacked is not None:
      stack = stacks.setdefault(("scan", graph.loop_of(first.op)), {"first": j, "size": 0, "fprops": {}})
      stack["size"] = max(stack["size"], f.src.stacked)
      stack["fprops"][j] = None
      scanned_paths[j] = path
      continue
    arg_paths[j] = path
    static[j] = names.indexed_subtrees(arg_paths[j]) or names.indexed_subtrees(f.path)
  positions = _leaf_positions(arg_paths)
  if positions:  # parameters passed as a flat list: their numbers are no modules; the dataflow finds the blocks
    for j in positions:
      del static[j]
    _repeated_in_dataflow(stacks, positions, dots, first_use)
  for key in [k for k in stacks if k[0] == "scan"]:
    _layers_per_iteration(stacks[key], {j: names.indexed_subtrees(scanned_paths[j]) for j in stacks[key]["fprops"]},
                          dots)
  units = _layer_units(static, dots)
  for j, found in static.items():  # each layer joins the outermost of its numbered components that is a layer
    stack, index, _ = next((c for c in found if c[0] in units), (None, None, None))
    if stack is not None:
      entry = stacks.setdefault(("static", stack), {"first": j, "size": 0, "fprops": {}})
      entry["size"] = max(entry["size"], index + 1)
      entry["fprops"][j] = index
  # Stacks in the order the network runs them (a scanned stack's body may be a function printed after @main).
  order = sorted(stacks, key=functools.cmp_to_key(lambda a, b: _network_order(graph, dots, stacks, a, b)))
  joins = _interleaved(order, stacks)
  offset, offsets, by_fprop, found = 0, {}, {}, []
  for key in order:
    stack = stacks[key]
    per = stack.get("per_iteration", 1)
    start = offsets[joins[key]] if key in joins else offset
    offsets[key] = start
    for j, local in stack["fprops"].items():
      if local is not None:
        by_fprop[j] = Place(block=start + local)
      else:
        by_fprop[j] = Place(num_stacked=stack["size"], offset=start + stack.get("sub", {}).get(j, 0), stride=per)
    if key not in joins:
      offset += stack["size"] * per
      found.append(_describe(key, stack, start, scanned_paths, arg_paths))
  out = {}
  for i, d in enumerate(dots):
    owner = i if d.role is Role.FPROP else d.partner
    if d.role is not Role.OTHER and owner in by_fprop:
      out[i] = by_fprop[owner]
  return out, offset, tuple(found)


@dataclasses.dataclass(frozen=True)
class Place:
  """Where a dot's layer sits among the blocks: a static `block`, or in a scanned stack of `num_stacked` iterations
  the block `offset + iteration * stride` (`stride` layers per iteration)."""
  block: Optional[int] = None
  num_stacked: Optional[int] = None
  offset: Optional[int] = None
  stride: int = 1


def _layer_units(static, dots, layers_only=False):
  """The numbered parameter subtrees that are layers: those of which two hold the same layers (sub-paths and weight
  shapes), and a lone or differing one beside such a stack under the same parent that holds two linear layers or more
  (DeepSeek's dense layers before its MoE layers, decoder/dense_layers_0 beside decoder/moe_layers_0..2).
  `layers_only`: repeats too must hold two linear layers or more (inside a scanned unit, mlp/wi_0 and wi_1 are no
  layers)."""
  layouts = {}  # candidate stack -> {index: {(sub-path, weight shape)}}: what each numbered subtree holds
  for j, found in static.items():
    for stack, index, rest in found:
      layouts.setdefault(stack, {}).setdefault(index, set()).add((rest, shape(dots[j].op.operands[dots[j].w])))
  repeated = {k for k, v in layouts.items() if len({frozenset(x) for x in v.values()}) < len(v)
              and (not layers_only or all(len(x) >= 2 for x in v.values()))}
  parents = {k.rpartition("/")[0] for k in repeated}
  return repeated | {k for k, v in layouts.items()
                     if k.rpartition("/")[0] in parents and all(len(x) >= 2 for x in v.values())}


def _layers_per_iteration(stack, components, dots):
  """A scanned stack whose iteration runs several decoder layers (Llama 4's block of 4, gpt-oss's 2, Qwen3-Next's 4,
  Gemma 3's pattern of 6: numbered subtrees inside the stacked parameters, layers/layers_0..3) numbers each of them:
  stack["per_iteration"] and stack["sub"] (fprop -> its layer within the iteration). Every fprop of the stack must
  sit in one such numbered subtree, else an iteration stays one block."""
  units = _layer_units(components, dots, layers_only=True)
  sub, where = {}, set()
  for j, found in components.items():
    unit = next((c for c in found if c[0] in units), None)
    if unit is None:
      return
    sub[j] = unit[1]
    where.add(unit[0])
  if len(where) == 1 and len(set(sub.values())) > 1:
    stack["per_iteration"], stack["sub"], stack["unit"] = max(sub.values()) + 1, sub, where.pop()


def _network_order(graph, dots, stacks, a, b):
  """-1 when stack a's first fprop runs before stack b's."""
  x, y = dots[stacks[a]["first"]].op, dots[stacks[b]["first"]].op
  return -1 if graph.runs_before(x, y) else 1


def _interleaved(order, stacks):
  """Parallel lists of one network ({"w1": [...], "w2": [...]}) are one stack of blocks when their layers interleave
  (w1[0], w2[0], w1[1], ...): block i is layer i of each. {stack: the stack whose block numbers it shares}."""
  firsts = {k: {i: min(j for j, l in stacks[k]["fprops"].items() if l == i) for i in set(stacks[k]["fprops"].values())}
            for k in order if k[0] == "static"}
  joins = {}
  for n, a in enumerate(order):
    if a not in firsts or a in joins:
      continue
    for b in order[n + 1:]:
      if b in firsts and b not in joins and set(firsts[a]) == set(firsts[b]):
        idx = sorted(firsts[a])
        if all(firsts[a][i] < firsts[b][i] for i in idx) and \
            all(firsts[b][i] < firsts[a][k] for i, k in zip(idx, idx[1:])):
          joins[b] = a
  return joins


def _describe(key, stack, start, scanned_paths, arg_paths):
  """How one stack's blocks were found, for the report."""
  kind, _ = key
  end = start + stack["size"] * stack.get("per_iteration", 1) - 1
  span = f"blocks {start}-{end}" if end > start else f"block {start}"
  if kind == "scan":
    where = _common_prefix([scanned_paths[j] for j in stack["fprops"]])
    if "per_iteration" in stack:
      return (f"{span}: scanned stack {where or '?'}, {stack['size']} iteration(s) of {stack['per_iteration']} "
              f"layers each ({stack['unit']}_*)")
    return f"{span}: scanned stack {where or '?'}, one layer per iteration"
  if kind == "dataflow":
    return (f"{span}: repeats of one unit of layers in the forward's dataflow (parameters passed as a flat list, "
            f"whose paths are leaf numbers: layers named block_<b>/linear_<k> by where they run; under nnx.jit, "
            f"nnx.split + jax.jit keeps the module paths)")
  return f"{span}: numbered parameter subtrees {key[1]}_*"


def _common_prefix(paths):
  parts = [p.split("/") for p in paths if p]
  if not parts:
    return ""
  out = []
  for level in zip(*parts):
    if len(set(level)) > 1:
      break
    out.append(level[0])
  return "/".join(out)


def _leaf_positions(arg_paths):
  """The fprops (of {fprop: its weight's parameter path}) when their weights are positions in a flat list of
  parameters (`model.states[0][23]` under nnx.jit, `leaves[5]` from jax.tree.leaves, penzai's unbind_params): every
  path ends in a bare number. Their numbers count leaves, not modules, and name stacks there carry leaf numbers too
  (penzai), so neither names the blocks."""
  return list(arg_paths) if names.leaf_numbered(arg_paths.values()) else []


def _repeated_in_dataflow(stacks, fprops, dots, first_use):
  """One stack of blocks from the order the layers run in: the longest stretch of the forward made of at least two
  repeats of one unit of layers (the same weight and activation shapes, in the same order), the shortest such unit.
  Layers before and after it (an embedding projection, the head) belong to no block."""
  weights = sorted({first_use[dots[j].src.arg] for j in fprops})  # one per weight, in the order the forward runs
  signature = [tuple(shape(v) for v in dots[j].op.operands) for j in weights]
  best = None  # (covered, start, period, count)
  n = len(signature)
  for period in range(1, n // 2 + 1):
    i = 0
    while i < n - period:
      if signature[i] != signature[i + period]:
        i += 1
        continue
      start = i
      while i < n - period and signature[i] == signature[i + period]:
        i += 1
      count = (i - start + period) // period
      if count >= 2 and (best is None or count * period > best[0]):
        best = (count * period, start, period, count)
  if best is None:
    return
  _, start, period, count = best
  local = {w: (k - start) // period for k, w in enumerate(weights) if start <= k < start + count * period}
  members = {j: local[first_use[dots[j].src.arg]] for j in fprops if first_use[dots[j].src.arg] in local}
  stacks[("dataflow", None)] = {"first": weights[start], "size": count, "fprops": members}