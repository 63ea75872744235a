"""The peers of a dot in a shard_map body: the devices over which its per-device decode scales are max-reduced, so that
each scale is the whole tensor's (or the whole expert's), as on one device.

Outside a body XLA's partitioner sees whole tensors and turns the pass's max reductions into all-reduces itself.
Inside an `sdy.manual_computation` each device holds its own part of a tensor (its tokens, under FSDP) and XLA adds
nothing: a scale measured there is the device's, and a sharded step computes other numbers than one device does.

    %r = sdy.manual_computation(%x, %w) in_shardings=[<@mesh, [{"fsdp"}, {}]>, <@mesh, [{"expert"}, {}, {}]>]
         manual_axes={"fsdp", "expert"} (%xs: [M/8, K], %ws: [E/2, K, N]) { ... dot(%xs, %ws) ... }

Peers: the replica groups (global device ids, row-major over the mesh as Shardy numbers them) of devices that differ
only along the manual axes of the bodies around the dot, minus the axes that split an expert dim of the layer's
weight where the forward pass's body receives it (there a device's group g is another device's group g of other
experts: reducing over them would give one expert another's scale); every GEMM of the layer takes the axes of its
weight. A weight whose expert dim cannot be traced to a body argument splits none (the reduce then spans every manual axis: a coarser scale where experts are split, never
one too small). Empty outside bodies and where the axes span one device."""

import itertools
import math

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import sdy

from xla_fp4.passes.analysis.records import Phase, Role

MANUAL = "sdy.manual_computation"
# Single-operand ops that keep an operand's dims (and its sharding within the body).
_KEEPS_DIMS = {"stablehlo.convert", "stablehlo.bitcast_convert", "stablehlo.copy", "mhlo.copy"}


def of_dots(dots, groups, around):
  """(peers per dot, in dots' order): `dots` are roles.Dot, `groups[i]` dot i's records.Groups or None, `around[i]`
  the ops enclosing dot i (CallGraph.around)."""
  split = {}  # the @main argument of an expert weight -> the mesh axes that split its expert dims
  for i, d in enumerate(dots):
    if d.role is Role.FPROP and d.phase is Phase.FORWARD and groups[i] is not None and d.src is not None:
      axes = _axes_splitting(d.op.operands[d.w], groups[i].lhs if d.w == 0 else groups[i].rhs)
      # Where JAX hands a body a residual (a remat's weight), the residual is stacked over every manual axis whatever
      # the user's spec: the user's axes are those every forward GEMM of the weight agrees on.
      split[d.src.arg] = split.get(d.src.arg, axes) & axes
  out = []
  for d, enclosing in zip(dots, around):
    bodies = [o for o in enclosing if o.name == MANUAL]
    if not bodies:
      out.append(())
      continue
    weight = dots[d.partner].src if d.role is Role.WGRAD and d.partner is not None else d.src
    out.append(_replica_groups(bodies, split.get(weight.arg, set()) if weight is not None else set()))
  return out


def _axes_splitting(value, dims):
  """The mesh axes that split dims `dims` of `value` where it enters the innermost body around it: traced through ops
  that keep dims, transposes and all-gathers (a gathered dim is split no more); an empty set where it cannot be."""
  dims = list(dims)
  while True:
    if isinstance(value, ir.BlockArgument):
      owner = value.owner.owner
      if owner is None or owner.name != MANUAL:
        return set()
      shardings = sdy.TensorShardingPerValueAttr(owner.attributes["in_shardings"]).shardings
      per_dim = sdy.TensorShardingAttr(shardings[value.arg_number]).dimension_shardings
      return {sdy.AxisRefAttr(a).name for d in dims for a in sdy.DimensionShardingAttr(per_dim[d]).axes}
    op = value.owner
    if op.name in _KEEPS_DIMS:
      value = op.operands[0]
    elif op.name == "stablehlo.transpose":
      perm = list(ir.DenseI64ArrayAttr(op.attributes["permutation"]))
      dims, value = [perm[d] for d in dims], op.operands[0]
    elif op.name == "stablehlo.all_gather" and len(op.operands) == 1:
      if ir.IntegerAttr(op.attributes["all_gather_dim"]).value in dims:
        return set()
      value = op.operands[0]
    else:
      return set()


def _replica_groups(bodies, expert_axes):
  manual = {a for b in bodies for a in sdy.ManualAxesAttr(b.attributes["manual_axes"])}
  mesh = _mesh(bodies[0])
  if mesh is None:
    return ()
  names = [sdy.MeshAxisAttr(a).name for a in mesh.axes]
  sizes = [sdy.MeshAxisAttr(a).size for a in mesh.axes]
  ids = list(mesh.device_ids) or list(range(math.prod(sizes)))
  reduced = [i for i, n in enumerate(names) if n in manual and n not in expert_axes and sizes[i] > 1]
  if not reduced:
    return ()
  kept = [i for i in range(len(names)) if i not in reduced]
  groups = []
  for outer in itertools.product(*(range(sizes[i]) for i in kept)):
    group = []
    for inner in itertools.product(*(range(sizes[i]) for i in reduced)):
      coords = dict(zip(kept, outer)) | dict(zip(reduced, inner))
      linear = 0
      for i, size in enumerate(sizes):
        linear = linear * size + coords[i]
      group.append(ids[linear])
    groups.append(tuple(group))
  return tuple(groups)


def _mesh(body):
  """The sdy.MeshAttr of a body's shardings (inline, or the module's `sdy.mesh` op it names); None if it has none."""
  shardings = [*sdy.TensorShardingPerValueAttr(body.attributes["in_shardings"]).shardings,
               *sdy.TensorShardingPerValueAttr(body.attributes["out_shardings"]).shardings]
  if not shardings:
    return None
  ref = sdy.TensorShardingAttr(shardings[0]).mesh_or_ref
  if sdy.MeshAttr.isinstance(ref):
    return sdy.MeshAttr(ref)
  module = body
  while module.parent is not None:
    module = module.parent
  name = ir.FlatSymbolRefAttr(ref).value
  for op in module.regions[0].blocks[0].operations:
    if op.operation.name == "sdy.mesh" and ir.StringAttr(op.attributes["sym_name"]).value == name:
      return sdy.MeshAttr(op.attributes["mesh"])
  return None
