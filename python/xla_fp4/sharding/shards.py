"""Running a kernel on shards: what XLA's custom-call partitioners of every target (partition.py, packed.py,
device_rows.py) build on. A partition callback returns a per-shard module (`per_shard_module`: MLIR bytecode of
@main(shard operands) -> results), here the target's own kernel on the shard (`kernel_module`), with the shard's index
mixed into a stochastic-rounding key (`salted`, from `stablehlo.partition_id` through a constant table) and, for a
telemetry form, its statistics row placed as the device's row (`device_row`). The helpers read XLA's HloSharding as
tiles and a device array (`tiles_and_devices`) and replicate dims whose shards would split blocks (`replicate_dims`).
"""

import functools
import math
import threading
import types

import numpy as np
from jax._src.interpreters import mlir
from jax._src.lib import xla_client as xc
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import func as func_dialect
from jax._src.lib.mlir.dialects import hlo

from xla_fp4 import kernels
from xla_fp4.kernels import targets
from xla_fp4.numerics import formats

# XLA calls the partitioner once per kernel call of every compile; a fresh MLIR context costs milliseconds, so the
# callbacks share one (MLIR contexts are not thread-safe: the lock) and decode each distinct backend_config once.
context_lock = threading.Lock()


@functools.cache
def context():
  return mlir.make_ir_context()


@functools.lru_cache(maxsize=None)
def decode_config(target, backend_config):
  """The call's attributes {name: int|bool} (read-only) from its backend_config (the MLIR dictionary text)."""
  text = backend_config.decode() if isinstance(backend_config, bytes) else str(backend_config)
  with context_lock, context():
    config = ir.DictAttr(ir.Attribute.parse(text))
    out = {}
    for i in range(len(config)):
      named = config[i]
      attr = named.attr
      want = kernels.ATTRIBUTES[target][named.name]
      out[named.name] = ir.BoolAttr(attr).value if want is bool else ir.IntegerAttr(attr).value
  return types.MappingProxyType(out)


def tiles_and_devices(sharding, rank):
  """(split per data dim, subgroup sizes and types, device array shaped data dims + subgroups)."""
  if sharding.is_replicated():
    return [1] * rank, [], [], None
  tiles = list(sharding.tile_assignment_dimensions())
  devices = np.asarray(sharding.tile_assignment_devices(), dtype=np.int64).reshape(tiles)
  groups = tiles[rank:]
  types = list(sharding.subgroup_types())
  if len(types) < len(groups):  # replicate_on_last_tile_dim
    types = [xc.OpSharding.Type.REPLICATED] * (len(groups) - len(types)) + types
  return tiles[:rank], groups, types, devices


def replicate_dims(sharding, rank, dims):
  """`sharding` with the data dims `dims` replicated: their devices join the replicated subgroup."""
  tiles, groups, types, devices = tiles_and_devices(sharding, rank)
  dims = [d for d in sorted(dims) if tiles[d] > 1]
  if not dims:
    return sharding
  kept = [d for d in range(rank) if d not in dims]
  others = [rank + i for i, t in enumerate(types) if t != xc.OpSharding.Type.REPLICATED]
  replicated = [rank + i for i, t in enumerate(types) if t == xc.OpSharding.Type.REPLICATED]
  devices = devices.transpose(kept + others + replicated + dims)
  new_tiles = [1 if d in dims else tiles[d] for d in range(rank)]
  if math.prod(new_tiles) == 1 and not others:
    return xc.HloSharding.replicate()
  n_rep = math.prod(devices.shape[len(kept) + len(others):])
  proto = xc.OpSharding()
  proto.type = xc.OpSharding.Type.OTHER
  proto.tile_assignment_dimensions = new_tiles + [groups[i - rank] for i in others] + [n_rep]
  proto.tile_assignment_devices = [int(v) for v in devices.reshape(-1)]
  proto.last_tile_dims = [types[i - rank] for i in others] + [xc.OpSharding.Type.REPLICATED]
  return xc.HloSharding.from_proto(proto)


def shard_index_table(sharding, rank, num_devices):
  """u32[num_devices]: the linear index of the shard each partition holds (replicas share one)."""
  tiles, groups, _, devices = tiles_and_devices(sharding, rank)
  table = np.zeros(num_devices, np.uint32)
  if devices is None:
    return table
  for pos in np.ndindex(*devices.shape):
    table[devices[pos]] = np.ravel_multi_index(pos[:rank], tiles)
  return table


def shard_salts(table):
  """What is xor'ed into the key per partition: 0 for shard 0 (an unsplit tensor keeps its bits), else a mix."""
  return np.array([0 if s == 0 else formats.fold_in_int(0x9E3779B9, int(s)) for s in table], np.uint32)


def ir_type(shape):
  """The MLIR tensor type of an XLA array shape (needs a context)."""
  return ir.RankedTensorType.get(list(shape.dimensions()), mlir.dtype_to_ir_type(np.dtype(shape.numpy_dtype())))


def per_shard_module(arg_shapes, result_shapes, body):
  """MLIR bytecode of @main(operands of `arg_shapes`) -> body(operands as a list), XLA array shapes; the per-shard
  module a partition callback returns."""
  with context_lock, context(), ir.Location.unknown():
    module = ir.Module.create()
    arg_types, result_types = [ir_type(s) for s in arg_shapes], [ir_type(s) for s in result_shapes]
    with ir.InsertionPoint(module.body):
      main = func_dialect.FuncOp("main", ir.FunctionType.get(arg_types, result_types))
      main.attributes["sym_visibility"] = ir.StringAttr.get("public")
      block = main.add_entry_block()
      with ir.InsertionPoint(block):
        func_dialect.ReturnOp(list(body(list(block.arguments))))
    return mlir.module_to_bytecode(module)


def salted(key, salts):
  """key ^ salts[partition id]: a u32 scalar per partition (needs a context and an insertion point)."""
  u32 = ir.IntegerType.get_unsigned(32)
  table = hlo.ConstantOp(ir.DenseElementsAttr.get(salts, type=ir.RankedTensorType.get([len(salts)], u32)))
  salt = hlo.DynamicSliceOp(table.result, [hlo.PartitionIdOp().result], ir.DenseI64ArrayAttr.get([1])).result
  return hlo.XorOp(key, hlo.ReshapeOp(ir.RankedTensorType.get([], u32), salt).result).result


def kernel_module(target, attrs, arg_shapes, result_shapes, salts, counted=None):
  """MLIR bytecode of @main(per-shard operands) -> the kernel on the shard; `salts` (per partition) go into the key.
  A `device_stats` target's row (the kernel's f32[FIELDS], its last result) becomes the declared [n, FIELDS]: one row
  (n = 1), or row 0 of n, the others zeros (a call that runs on what the device holds). `counted` (bool per
  partition, or None: every partition): the partitions whose shard counts; on the others the kernel's step operand
  (its last) is -1, so that it measures nothing and returns zeros (a replica of a shard that another device counts)."""
  result_shapes = result_shapes if isinstance(result_shapes, (list, tuple)) else [result_shapes]
  record = targets.BY_NAME[target]
  stats = record.device_stats

  def body(operands):
    if salts is not None:
      keys = record.sharded.key_operand
      for key_index in keys if isinstance(keys, tuple) else (keys,):
        operands[key_index] = salted(operands[key_index], salts)
    if counted is not None and not counted.all():
      i32 = ir.IntegerType.get_signless(32)
      table = hlo.ConstantOp(ir.DenseElementsAttr.get(np.where(counted, 0, -1).astype(np.int32),
                                                      type=ir.RankedTensorType.get([len(counted)], i32)))
      offset = hlo.DynamicSliceOp(table.result, [hlo.PartitionIdOp().result], ir.DenseI64ArrayAttr.get([1])).result
      offset = hlo.ReshapeOp(ir.RankedTensorType.get([], i32), offset).result
      operands[-1] = hlo.OrOp(operands[-1], offset).result  # -1 | step == -1
    types = [ir_type(s) for s in result_shapes]
    if stats:
      types[-1] = ir.RankedTensorType.get([types[-1].shape[-1]], types[-1].element_type)
    results = list(kernels.custom_call(target, types, operands, kernels.backend_config_attributes(target, attrs),
                                       has_side_effect=record.side_effect).results)
    if stats:
      results[-1] = device_row(results[-1], ir_type(result_shapes[-1]))
    return results
  return per_shard_module(arg_shapes, result_shapes, body)


def device_row(row, declared):
  """The kernel's statistics row as the [n, FIELDS] a device returns (kernel_module): row 0, the others zeros."""
  n, fields = declared.shape
  row = hlo.ReshapeOp(ir.RankedTensorType.get([1, fields], ir.F32Type.get()), row).result
  if n == 1:
    return row
  zero = hlo.ConstantOp(ir.DenseElementsAttr.get(np.zeros((), np.float32))).result
  return hlo.PadOp(row, zero, ir.DenseI64ArrayAttr.get([0, 0]), ir.DenseI64ArrayAttr.get([n - 1, 0]),
                   ir.DenseI64ArrayAttr.get([0, 0])).result


def result_shapes(result_shape):
  """The XLA shapes of a call's results (a tuple's elements, or the one result)."""
  return list(result_shape.tuple_shapes()) if result_shape.is_tuple() else [result_shape]


def alike(result_shape, sharding):
  """`sharding` for every result of a call whose results are shaped alike."""
  if not result_shape.is_tuple():
    return sharding
  return xc.HloSharding.tuple_sharding(result_shape, [sharding] * len(result_shapes(result_shape)))


def first_replicas(table):
  """bool[devices]: true on the first device holding each shard (shard index `table[d]`), false on its replicas."""
  first = {}
  for d, shard in enumerate(table):
    first.setdefault(int(shard), d)
  return np.array([first[int(shard)] == d for d, shard in enumerate(table)])
