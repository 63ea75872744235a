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

from xla_fp4.passes.analysis import names
from xla_fp4.passes.analysis.callgraph import CallGraph, in_scope, shape
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
  """({dot index: (global block, num_stacked, block_offset)}, number of blocks): see the module docstring.
  `names_of_args`: @main's argument names (the parameter paths)."""
  stacks = {}  # key -> {"first": fprop index, "size": int, "fprops": {fprop index: local index or None}, "layout"}
  first_use = {}  # weight argument -> its first fprop (a remat copy in the backward loop joins the forward's stack)
  static = {}  # fprop index -> its numbered components, outermost first
  arg_paths = {}  # fprop index -> its weight's parameter path
  for j, f in enumerate(dots):
    if f.role is not Role.FPROP:
      continue
    first = dots[first_use.setdefault(f.src.arg, j)]
    if f.src.stacked is not None:
      stack = stacks.setdefault(("scan", graph.loop_of(first.op)), {"first": j, "size": 0, "fprops": {}})
      stack["size"] = max(stack["size"], f.src.stacked)
      stack["fprops"][j] = None
      continue
    arg_paths[j] = names.path_from_arg(names_of_args[f.src.arg] if f.src.arg < len(names_of_args) else "")
    static[j] = names.indexed_subtrees(arg_paths[j]) or names.indexed_subtrees(f.path)
  positions = _leaf_positions(arg_paths)
  if positions:  # parameters passed as a flat list: their numbers are no modules; the dataflow finds the blocks
    for j in positions:
      del static[j]
    _repeated_in_dataflow(stacks, positions, dots, first_use)
  layouts = {}  # candidate stack -> {index: {(sub-path, weight shape)}}: what each numbered subtree holds
  for j, found in static.items():
    for stack, index, rest in found:
      layouts.setdefault(stack, {}).setdefault(index, set()).add((rest, shape(dots[j].op.operands[dots[j].w])))
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
    owner = i if d.role is Role.FPROP else d.partner
    if d.role is not Role.OTHER and owner in by_fprop:
      out[i] = by_fprop[owner]
  return out, offset


def _leaf_positions(arg_paths):
  """The fprops (of {fprop: its weight's parameter path}) when their weights are positions in a flat list of
  parameters (`model.states[0][23]` under nnx.jit, `leaves[5]` from jax.tree.leaves, penzai's unbind_params): every
  path ends in a bare number. Their numbers count leaves, not modules, and name stacks there carry leaf numbers too
  (penzai), so neither names the blocks."""
  flat = len(arg_paths) >= 2 and all(p.split("/")[-1].isdigit() for p in arg_paths.values())
  return list(arg_paths) if flat else []


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