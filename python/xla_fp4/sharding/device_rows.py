"""Telemetry's per-device statistics in a partitioned program (docs/design.md §7): each device's row of what its shard's
quantizer measured, declared f32[devices, FIELDS] and split one row per device over every axis of the module's Shardy
mesh (`device_mesh`, `device_stats_sharding`, `device_rows_constraint`), so that no collective gathers them; a record
of parts (`parts_rule`) keeps them there. The side-effecting telemetry targets run on every device (`replicated`, their
partition callback), a record of parts on its own row.
"""

import math
import typing

from jax._src.lib import xla_client as xc
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import sdy

from xla_fp4.sharding.shards import decode_config, kernel_module


def device_rows(num_devices, rank=2):
  """The sharding of [devices, ...] per-device statistics (rank dims): row d on device d."""
  proto = xc.OpSharding()
  proto.type = xc.OpSharding.Type.OTHER
  proto.tile_assignment_dimensions = [num_devices] + [1] * (rank - 1)
  proto.tile_assignment_devices = list(range(num_devices))
  return xc.HloSharding.from_proto(proto)


class Mesh(typing.NamedTuple):
  """A Shardy mesh of the module: its symbol, its axis names, and how many devices it spans."""
  name: str
  axes: tuple
  devices: int


def device_mesh(module, num_devices):
  """The Mesh of `module` that spans its `num_devices` partitions, or None (no such mesh: GSPMD's shardings, or a
  mesh of a part of the devices)."""
  for op in module.body.operations:
    if op.operation.name == "sdy.mesh":
      axes = [sdy.MeshAxisAttr(a) for a in sdy.MeshAttr(op.attributes["mesh"]).axes]
      if math.prod(a.size for a in axes) == num_devices:
        return Mesh(ir.StringAttr(op.attributes["sym_name"]).value, tuple(a.name for a in axes), num_devices)
  return None


def device_stats_sharding(mesh, result_types):
  """The `sdy.sharding` of a `device_stats` call (needs a context): its like-x results open (propagation decides),
  its [devices, FIELDS] statistics split over every axis of `mesh` (device_mesh), one row per device."""
  open_dims = lambda t: "[" + ", ".join("{?}" for _ in ir.RankedTensorType(t).shape) + "]"  # noqa: E731
  values = [f"<@{mesh.name}, {open_dims(t)}>" for t in result_types[:-1]]
  values.append(_device_rows_sharding(mesh, 2))
  return ir.Attribute.parse("#sdy.sharding_per_value<[" + ", ".join(values) + "]>")


def _device_rows_sharding(mesh, rank):
  """The Shardy sharding text of [devices, ...] (rank dims) split over every axis of `mesh`, one row per device."""
  axes = ", ".join(f'"{a}"' for a in mesh.axes)
  return f"<@{mesh.name}, [" + ", ".join([f"{{{axes}}}"] + ["{}"] * (rank - 1)) + "]>"


def device_rows_constraint(mesh, value):
  """`value` ([devices, ...]: per-device statistics rows) held one row per device of `mesh` (needs a context and an
  insertion point): the reshard that gathers them happens where the record reads them, not where they are made."""
  rank = len(ir.RankedTensorType(value.type).shape)
  return sdy.ShardingConstraintOp(value, ir.Attribute.parse("#sdy.sharding" + _device_rows_sharding(mesh, rank)))\
      .result


def parts_rule(operand_types, result_types):
  """The `sdy.sharding_rule` of a record of parts (needs a context): the statistics' dims are factors of their own,
  so that propagation leaves them as they are, one row per device (no reshard before the record)."""
  sizes, mappings = [], []
  for t in operand_types:
    dims = []
    for n in ir.RankedTensorType(t).shape:
      sizes.append(n)
      dims.append(sdy.DimMappingAttr.get(factor_indices=[len(sizes) - 1]))
    mappings.append(sdy.TensorMappingAttr.get(dim_mappings=dims))
  scalar = sdy.TensorMappingAttr.get(dim_mappings=[])
  return sdy.OpShardingRuleAttr.get(factor_sizes=sizes, operand_mappings=mappings,
                                    result_mappings=[scalar] * len(result_types), is_custom=True)


def one_row_each(sharding, num_devices):
  """Whether `sharding` (of a [devices, FIELDS] result) gives every device one row of its own."""
  if sharding is None or sharding.is_replicated() or sharding.is_manual() or sharding.is_maximal():
    return False
  tiles = list(sharding.tile_assignment_dimensions())
  return tiles[0] == num_devices and math.prod(tiles) == num_devices


def replicated(target, arg_shapes, arg_shardings, result_shape, result_sharding, backend_config):
  """The partition callback of a side-effecting target (telemetry): every device runs it on whole operands, but a
  record of parts (`parts` > 1) on its own row of the [devices, rows, FIELDS] statistics: no collective gathers them,
  the sink sums the devices' parts (they are all in this process)."""
  attrs = decode_config(target, backend_config)
  if result_sharding.is_manual() or (result_sharding.is_maximal() and not result_sharding.is_replicated()):
    module = kernel_module(target, attrs, arg_shapes, result_shape, None)
    return module, [result_sharding] * len(arg_shapes), result_sharding
  shardings = [xc.HloSharding.replicate()] * len(arg_shapes)
  local = list(arg_shapes)
  if attrs.get("parts", 1) > 1:
    dims = arg_shapes[0].dimensions()
    shardings[0] = arg_shardings[0] if one_row_each(arg_shardings[0], dims[0]) else device_rows(dims[0], len(dims))
    local[0] = shardings[0].tile(arg_shapes[0])
  module = kernel_module(target, attrs, local, result_shape, None)
  return module, shardings, xc.HloSharding.replicate()
