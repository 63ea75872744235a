"""The one collective in the twins: a max over a shard_map body's peers, so that a decode scale measured on each
device's part of a tensor is the whole tensor's (passes/analysis/peers.py says which devices are peers).

    max_over_peers(amax, peers=((0, 1, 2, 3), (4, 5, 6, 7)))
      -> "stablehlo.all_reduce"(%amax) ({ stablehlo.maximum }) {replica_groups = [[0, 1, 2, 3], [4, 5, 6, 7]],
                                                               use_global_device_ids, channel_handle = 1}

A primitive, not `lax.pmax`: the pass lowers its twins outside the user's mesh (passes/rewrite/kernel_sets.py
`Twins`), where no axis name is bound, and places the call inside the body, where the all-reduce names devices as
JAX's own lowering of `pmax` in a shard_map does. With no peers it is the identity. It is only ever lowered; run
eagerly (one process, one device's value) it says so rather than return a per-device max as if it were global."""

import numpy as np
from jax.extend import core
from jax.interpreters import batching, mlir
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

_max_over_peers = core.Primitive("xla_fp4_max_over_peers")


def max_over_peers(x, peers=()):
  """The elementwise max of x over each group of `peers` (global device ids); x itself where peers is empty."""
  return _max_over_peers.bind(x, peers=tuple(map(tuple, peers))) if peers else x


def _eager(x, *, peers):
  raise NotImplementedError("max_over_peers is lowered into a shard_map body by the pass; it has no eager form")


def all_reduce(x, groups, combine):
  """`stablehlo.all_reduce` of the value x over each group of devices (global device ids), its elements combined by
  `combine` (hlo.MaxOp, hlo.AddOp), as JAX lowers a collective in a shard_map body; returns the result value."""
  op = hlo.AllReduceOp([x.type], [x], ir.DenseIntElementsAttr.get(np.asarray(groups, np.int64)),
                       channel_handle=hlo.ChannelHandle.get(1, 1), use_global_device_ids=True)
  scalar = ir.RankedTensorType.get([], ir.RankedTensorType(x.type).element_type)
  block = op.regions[0].blocks.append(scalar, scalar)
  with ir.InsertionPoint(block):
    hlo.ReturnOp([combine(*block.arguments).result])
  return op.results[0]


def _lowering(ctx, x, *, peers):
  return [all_reduce(x, peers, hlo.MaxOp)]


_max_over_peers.def_impl(_eager)
_max_over_peers.def_abstract_eval(lambda x, *, peers: x)
mlir.register_lowering(_max_over_peers, _lowering)
# Over a vmap (one scale per slice): the all-reduce is elementwise, so the batched max is the max of the batch.
batching.primitive_batchers[_max_over_peers] = lambda args, dims, *, peers: (
    _max_over_peers.bind(args[0], peers=peers), dims[0])
