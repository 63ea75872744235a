"""How XLA's sharding runs the block-local kernels on shards (docs/design.md §5).

`xla_fp4_qdq`, `xla_fp4_block_amax` and `xla_fp4_rht` are block-local (qdq once the global decode scale is an
operand): 1x16 blocks along the quantization axis K, or 16x16 tiles of K and a partner group of dims (the flattened
trailing dims, or the leading ones when K is last: numerics/nvfp4.py). A shard can run the kernel alone when its
extent along those dims keeps whole blocks. Both halves of XLA's sharding get what they need:

- propagation (Shardy): `sharding_rule()` is the call's `sdy.sharding_rule`. Every dim is its own factor and passes
  through to the result; K (and a single-dim 2D partner) is the compound (blocks, 16) with the 16 marked
  need_replication, so propagation never splits a block. Scalars (s_dec, key) are replicated. An activation's (or an
  output gradient's) K in a fprop or dgrad is the exception, `k_follows_dot`: its result has K factors of its own,
  so the dot, through the weight it contracts with, decides how K is sharded, and where that differs from x the
  reshard happens on x before the kernel: one per target sharding, shared by every reader of x that needs it, as
  without the pass, where otherwise each quantized version of x was gathered on its own (MaxText's FSDP x TP with the
  activations' features sharded: 1.21x the collective bytes of a 4-layer MLP, 1.03x with K following the dot).
- partitioning (XLA's SPMD partitioner): `register()` installs a custom-call partitioner per target. It takes the
  result's sharding for the operand and result, replicates any dim whose shards would split blocks (XLA reshards),
  and returns a per-shard module that runs the same kernel on the shard. Stochastic rounding mixes the shard's index
  (from `stablehlo.partition_id` through a constant table) into the key: shards of one tensor draw different bits,
  replicas of one shard the same bits, and the same program gives the same bits every run.

The telemetry targets (side-effecting: XLA requires each such op to carry a sharding, and refuses a replicated one
unless its partitioner allows it) get a partitioner that runs them on every device on whole operands, except a
record of parts (`parts` > 1), which each device runs on its own row of the per-device statistics (its Shardy rule,
parts_rule, keeps them there). The statistics kernels (a record's `device_stats`: xla_fp4_qdq_and_stats, the
element-wise xla_fp4_output_stats, and sharding/packed.py's xla_fp4_quantize_packed_stats) run on shards like the
others; their statistics
result is declared f32[devices, FIELDS] with an `sdy.sharding` over every mesh axis (device_stats_sharding), so that
each device returns one row: its kernel's row of its shard, zeros on a replica of a shard (whose kernel gets step -1
through a table indexed by `stablehlo.partition_id`, so it does no work), so that the sum over devices counts every
element once. No collective runs for them.

The global amax stays a plain max reduction of xla_fp4_block_amax's per-block maxima in the pass's output, which the
SPMD partitioner turns into a scalar all-reduce.
"""

import dataclasses
import functools
import math
import threading
import types
import typing

import numpy as np
from jax._src.interpreters import mlir
from jax._src.lib import xla_client as xc
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import func as func_dialect
from jax._src.lib.mlir.dialects import hlo
from jax._src.lib.mlir.dialects import sdy

from xla_fp4 import kernels
from xla_fp4.kernels import targets
from xla_fp4.numerics import formats
from xla_fp4.numerics.formats import BLOCK

# The block-local targets, by name: their records (kernels/targets.py `BlockLocal`) say how shards run them.
PARTITIONED = {t.name: t.block_local for t in targets.ALL if t.block_local is not None}
# The side-effecting targets (telemetry): every device runs them on whole (replicated) operands.
SIDE_EFFECTS = tuple(t.name for t in targets.ALL if t.side_effect)


@dataclasses.dataclass(frozen=True)
class Blocking:
  """The dims of a block-local kernel's operand that shards must keep in whole blocks."""
  k: int  # the quantization axis: 16 consecutive elements per block
  partner: tuple  # 16x16 tiles: the group of dims flattened into the tile's second side, outermost first; 1x16: ()

  @staticmethod
  def of(rank, axis, block_2d):
    axis %= rank
    if not block_2d:
      return Blocking(axis, ())
    return Blocking(axis, tuple(range(axis + 1, rank)) if axis < rank - 1 else tuple(range(axis)))

  def split_blocks(self, shape, tiles):
    """The dims to replicate so that every shard of `shape`, split `tiles[d]` ways along dim d, holds whole blocks."""
    bad = set()
    if tiles[self.k] > 1 and (shape[self.k] % tiles[self.k] or (shape[self.k] // tiles[self.k]) % BLOCK):
      bad.add(self.k)
    # A shard of the flattened partner group is runs of (extent of the innermost split dim x the whole dims after it)
    # consecutive positions, each starting at a multiple of its length: tiles stay whole when that is a multiple of 16.
    split = [d for d in self.partner if tiles[d] > 1]
    while split:
      j = split[-1]
      run = (shape[j] // tiles[j]) * math.prod(shape[d] for d in self.partner if d > j)
      if shape[j] % tiles[j] == 0 and run % BLOCK == 0:
        break
      bad.add(split.pop())
    return bad


def _blocking(target, rank, attrs):
  return Blocking.of(rank, attrs["axis"], PARTITIONED[target].takes_2d and attrs["block_2d"])


def sharding_rule(target, operand_types, result_types, attrs, k_follows_dot=False):
  """The `sdy.sharding_rule` of a call to `target` whose first operand is the blocked tensor (needs a context).
  xla_fp4_block_amax's result keeps the blocks factor of the quantization axis and drops the 16. `k_follows_dot`
  (xla_fp4_qdq in 1x16 blocks only): the result's K has factors of its own, which the dot reading it shards."""
  shape = list(ir.RankedTensorType(operand_types[0]).shape)
  local = PARTITIONED[target]
  if not local.blocked:  # element-wise: every dim of x its own factor, the statistics row's dims their own
    return _rule_with_stats(shape, operand_types, result_types, local, [], [], [])
  blocking = _blocking(target, len(shape), attrs)
  compound = {blocking.k} | ({blocking.partner[0]} if len(blocking.partner) == 1 else set())
  if k_follows_dot and (not local.k_may_follow_dot or attrs["block_2d"]):
    raise ValueError(f"k_follows_dot is for calls in 1x16 blocks whose result a dot reads, not {target} {dict(attrs)}")
  sizes, operand, result, need_replication = [], [], [], []

  def factor(n):
    sizes.append(n)
    return len(sizes) - 1

  def compound_factors(n):
    blocks, within = factor(n // BLOCK), factor(BLOCK)
    need_replication.append(within)
    return [blocks, within]

  for d, n in enumerate(shape):
    if d in compound and n > BLOCK and n % BLOCK == 0:
      operand.append(compound_factors(n))
      if local.counts_blocks and d == blocking.k:
        result.append(operand[-1][:1])
      else:
        result.append(compound_factors(n) if k_follows_dot and d == blocking.k else operand[-1])
    elif k_follows_dot and d == blocking.k:  # one block, or not whole blocks: the partitioner keeps it whole
      operand.append([factor(n)])
      result.append([factor(n)])
    elif local.counts_blocks and d == blocking.k:  # one block: the operand's 16 become 1
      within = factor(n)
      need_replication.append(within)
      operand.append([within])
      result.append([factor(1)])
    else:
      operand.append([factor(n)])
      result.append(operand[-1])
  return _rule_with_stats(shape, operand_types, result_types, local, sizes, need_replication, (operand, result))


def _rule_with_stats(shape, operand_types, result_types, local, sizes, need_replication, mapped):
  """The rule from x's and the result's factors (`mapped`: (operand dims, result dims); empty for an element-wise
  call, whose dims become factors here); a `device_stats` call's last result (the [devices, FIELDS] row) gets factors
  of its own, which its sharding annotation fixes (sharding.device_rows)."""
  sizes, need_replication = list(sizes), list(need_replication)

  def factor(n):
    sizes.append(n)
    return len(sizes) - 1

  operand, result = mapped if mapped else ([[factor(n)] for n in shape], None)
  tensor = lambda dims: sdy.TensorMappingAttr.get(  # noqa: E731
      dim_mappings=[sdy.DimMappingAttr.get(factor_indices=f) for f in dims])
  scalar = sdy.TensorMappingAttr.get(dim_mappings=[])
  like_x = len(result_types) - (1 if local.device_stats else 0)
  results = [tensor(result)] * like_x if like_x else []
  if local.device_stats:
    results.append(tensor([[factor(n)] for n in ir.RankedTensorType(result_types[-1]).shape]))
  return sdy.OpShardingRuleAttr.get(
      factor_sizes=sizes, operand_mappings=[tensor(operand)] + [scalar] * (len(operand_types) - 1),
      result_mappings=results, is_custom=True, need_replication_factors=need_replication)


# XLA calls the partitioner once per kernel call of every compile; a fresh MLIR context costs ~5 ms, so the callbacks
# share one (MLIR contexts are not thread-safe: the lock) and decode each distinct backend_config once.
_context_lock = threading.Lock()


@functools.cache
def _context():
  return mlir.make_ir_context()


@functools.lru_cache(maxsize=None)
def _decode_config(target, backend_config):
  """The call's attributes {name: int|bool} (read-only) from its backend_config (the MLIR dictionary text)."""
  text = backend_config.decode() if isinstance(backend_config, bytes) else str(backend_config)
  with _context_lock, _context():
    config = ir.DictAttr(ir.Attribute.parse(text))
    out = {}
    for i in range(len(config)):
      named = config[i]
      attr = named.attr
      want = kernels.ATTRIBUTES[target][named.name]
      out[named.name] = ir.BoolAttr(attr).value if want is bool else ir.IntegerAttr(attr).value
  return types.MappingProxyType(out)


def _tiles_and_devices(sharding, rank):
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


def _replicate_dims(sharding, rank, dims):
  """`sharding` with the data dims `dims` replicated: their devices join the replicated subgroup."""
  tiles, groups, types, devices = _tiles_and_devices(sharding, rank)
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


def _shard_index_table(sharding, rank, num_devices):
  """u32[num_devices]: the linear index of the shard each partition holds (replicas share one)."""
  tiles, groups, _, devices = _tiles_and_devices(sharding, rank)
  table = np.zeros(num_devices, np.uint32)
  if devices is None:
    return table
  for pos in np.ndindex(*devices.shape):
    table[devices[pos]] = np.ravel_multi_index(pos[:rank], tiles)
  return table


def _shard_salts(table):
  """What is xor'ed into the key per partition: 0 for shard 0 (an unsplit tensor keeps its bits), else a mix."""
  return np.array([0 if s == 0 else formats.fold_in_int(0x9E3779B9, int(s)) for s in table], np.uint32)


def _ir_type(shape):
  """The MLIR tensor type of an XLA array shape (needs a context)."""
  return ir.RankedTensorType.get(list(shape.dimensions()), mlir.dtype_to_ir_type(np.dtype(shape.numpy_dtype())))


def per_shard_module(arg_shapes, result_shapes, body):
  """MLIR bytecode of @main(operands of `arg_shapes`) -> body(operands as a list), XLA array shapes; the per-shard
  module a partition callback returns."""
  with _context_lock, _context(), ir.Location.unknown():
    module = ir.Module.create()
    arg_types, result_types = [_ir_type(s) for s in arg_shapes], [_ir_type(s) for s in result_shapes]
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


def _per_shard_module(target, attrs, arg_shapes, result_shapes, salts, counted=None):
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
      key_index = record.sharded.key_operand
      operands[key_index] = salted(operands[key_index], salts)
    if counted is not None and not counted.all():
      i32 = ir.IntegerType.get_signless(32)
      table = hlo.ConstantOp(ir.DenseElementsAttr.get(np.where(counted, 0, -1).astype(np.int32),
                                                      type=ir.RankedTensorType.get([len(counted)], i32)))
      offset = hlo.DynamicSliceOp(table.result, [hlo.PartitionIdOp().result], ir.DenseI64ArrayAttr.get([1])).result
      offset = hlo.ReshapeOp(ir.RankedTensorType.get([], i32), offset).result
      operands[-1] = hlo.OrOp(operands[-1], offset).result  # -1 | step == -1
    types = [_ir_type(s) for s in result_shapes]
    if stats:
      types[-1] = ir.RankedTensorType.get([types[-1].shape[-1]], types[-1].element_type)
    results = list(kernels.custom_call(target, types, operands, kernels.backend_config_attributes(target, attrs),
                                       has_side_effect=record.side_effect).results)
    if stats:
      results[-1] = _device_row(results[-1], _ir_type(result_shapes[-1]))
    return results
  return per_shard_module(arg_shapes, result_shapes, body)


def _device_row(row, declared):
  """The kernel's statistics row as the [n, FIELDS] a device returns (_per_shard_module): row 0, the others zeros."""
  n, fields = declared.shape
  row = hlo.ReshapeOp(ir.RankedTensorType.get([1, fields], ir.F32Type.get()), row).result
  if n == 1:
    return row
  zero = hlo.ConstantOp(ir.DenseElementsAttr.get(np.zeros((), np.float32))).result
  return hlo.PadOp(row, zero, ir.DenseI64ArrayAttr.get([0, 0]), ir.DenseI64ArrayAttr.get([n - 1, 0]),
                   ir.DenseI64ArrayAttr.get([0, 0])).result


def _result_sharding(target, shape, sharding, attrs):
  """`sharding` (of the result or of x; same rank) with the dims replicated whose shards would split blocks."""
  if sharding.is_manual() or sharding.is_maximal():
    return sharding
  rank = len(shape)
  if PARTITIONED[target].counts_blocks:  # the result counts blocks along the axis: check x's shape
    shape = list(shape)
    shape[attrs["axis"] % rank] *= BLOCK
  bad = _blocking(target, rank, attrs).split_blocks(shape, _tiles_and_devices(sharding, rank)[0])
  return _replicate_dims(sharding, rank, bad)


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


def _one_row_each(sharding, num_devices):
  """Whether `sharding` (of a [devices, FIELDS] result) gives every device one row of its own."""
  if sharding is None or sharding.is_replicated() or sharding.is_manual() or sharding.is_maximal():
    return False
  tiles = list(sharding.tile_assignment_dimensions())
  return tiles[0] == num_devices and math.prod(tiles) == num_devices


def _first_replicas(table):
  """bool[devices]: true on the first device holding each shard (shard index `table[d]`), false on its replicas."""
  first = {}
  for d, shard in enumerate(table):
    first.setdefault(int(shard), d)
  return np.array([first[int(shard)] == d for d, shard in enumerate(table)])


def _partition_with_stats(target, attrs, arg_shapes, arg_shardings, result_shape, result_sharding):
  """The partition callback of a `device_stats` target: its like-x results as the block-local ones are partitioned,
  and its statistics result [devices, FIELDS] one row per device: the kernel's row of the device's shard, zeros on
  a replica of a shard, whose kernel gets step -1 (the sum over devices then counts every element once). No
  collective: each device records its row (a record of parts; passes/rewrite/probes.py)."""
  local = PARTITIONED[target]
  shapes = _result_shapes(result_shape)
  shardings = list(result_sharding.tuple_elements()) if result_shape.is_tuple() else [result_sharding]
  num = shapes[-1].dimensions()[0]
  x_shape = list(arg_shapes[0].dimensions())
  x_sharding = (shardings[0] if len(shapes) > 1 else arg_shardings[0]) or xc.HloSharding.replicate()
  if x_sharding.is_manual() or shardings[-1].is_manual() or (x_sharding.is_maximal() and not
                                                              x_sharding.is_replicated()):
    # Inside shard_map (or on one device) the call runs on what the device holds: its row first, the others zeros.
    module = _per_shard_module(target, attrs, arg_shapes, shapes, None)
    return module, [x_sharding] * len(arg_shapes), result_sharding
  if local.blocked:
    x_sharding = _result_sharding(target, x_shape, x_sharding, attrs)
  rows = shardings[-1] if _one_row_each(shardings[-1], num) else device_rows(num)
  table = _shard_index_table(x_sharding, len(x_shape), num)
  salts = None
  if local.key_operand is not None and attrs["stochastic"] and not x_sharding.is_replicated():
    salts = _shard_salts(table)
  local_args = [x_sharding.tile(arg_shapes[0])] + list(arg_shapes[1:])
  local_results = [x_sharding.tile(s) for s in shapes[:-1]] + [rows.tile(shapes[-1])]
  module = _per_shard_module(target, attrs, local_args, local_results, salts, counted=_first_replicas(table))
  out = [x_sharding] * (len(shapes) - 1) + [rows]
  result = xc.HloSharding.tuple_sharding(result_shape, out) if result_shape.is_tuple() else out[0]
  return module, [x_sharding] + [xc.HloSharding.replicate()] * (len(arg_shapes) - 1), result


def _partition(target, arg_shapes, arg_shardings, result_shape, result_sharding, backend_config):
  """XLA's partition callback: (per-shard module, operand shardings, result sharding)."""
  attrs = _decode_config(target, backend_config)
  if PARTITIONED[target].device_stats:
    return _partition_with_stats(target, attrs, arg_shapes, arg_shardings, result_shape, result_sharding)
  # Several results (xla_fp4_block_amax with digest) are shaped alike and sharded as the first.
  shapes = _result_shapes(result_shape)
  first = (result_sharding.tuple_elements() or [result_sharding])[0]
  if first.is_manual() or first.is_maximal():
    # Inside shard_map (or on one device) the shapes are already the device's own: the kernel runs as it is.
    module = _per_shard_module(target, attrs, arg_shapes, shapes, None)
    return module, [first] * len(arg_shapes), result_sharding
  rank = len(shapes[0].dimensions())
  sharding = _result_sharding(target, list(shapes[0].dimensions()), first, attrs)
  salts = None
  if PARTITIONED[target].key_operand is not None and attrs["stochastic"] and not sharding.is_replicated():
    num_partitions = int(np.max(sharding.tile_assignment_devices())) + 1
    salts = _shard_salts(_shard_index_table(sharding, rank, num_partitions))
  arg_shardings = [sharding] + [xc.HloSharding.replicate()] * (len(arg_shapes) - 1)  # x, then the scalars
  local = [sharding.tile(arg_shapes[0])] + list(arg_shapes[1:])
  module = _per_shard_module(target, attrs, local, [sharding.tile(s) for s in shapes], salts)
  return module, arg_shardings, _alike(result_shape, sharding)


def _result_shapes(result_shape):
  """The XLA shapes of a call's results (a tuple's elements, or the one result)."""
  return list(result_shape.tuple_shapes()) if result_shape.is_tuple() else [result_shape]


def _alike(result_shape, sharding):
  """`sharding` for every result of a call whose results are shaped alike."""
  if not result_shape.is_tuple():
    return sharding
  return xc.HloSharding.tuple_sharding(result_shape, [sharding] * len(_result_shapes(result_shape)))


def _replicated(target, arg_shapes, arg_shardings, result_shape, result_sharding, backend_config):
  """The partition callback of a side-effecting target (telemetry): every device runs it on whole operands, but a
  record of parts (`parts` > 1) on its own row of the [devices, rows, FIELDS] statistics: no collective gathers them,
  the sink sums the devices' parts (they are all in this process)."""
  attrs = _decode_config(target, backend_config)
  if result_sharding.is_manual() or (result_sharding.is_maximal() and not result_sharding.is_replicated()):
    module = _per_shard_module(target, attrs, arg_shapes, result_shape, None)
    return module, [result_sharding] * len(arg_shapes), result_sharding
  shardings = [xc.HloSharding.replicate()] * len(arg_shapes)
  local = list(arg_shapes)
  if attrs.get("parts", 1) > 1:
    dims = arg_shapes[0].dimensions()
    shardings[0] = arg_shardings[0] if _one_row_each(arg_shardings[0], dims[0]) else device_rows(dims[0], len(dims))
    local[0] = shardings[0].tile(arg_shapes[0])
  module = _per_shard_module(target, attrs, local, result_shape, None)
  return module, shardings, xc.HloSharding.replicate()


def _infer_from_operands(target, arg_shapes, arg_shardings, result_shape, backend_config):
  """GSPMD's forward propagation: the result is sharded like x, block-aligned (a statistics row: one per device)."""
  if arg_shardings[0] is None:
    return None
  attrs = _decode_config(target, backend_config)
  if PARTITIONED[target].device_stats:
    shapes = _result_shapes(result_shape)
    x = arg_shardings[0]
    if PARTITIONED[target].blocked:
      x = _result_sharding(target, list(arg_shapes[0].dimensions()), x, attrs)
    out = [x] * (len(shapes) - 1) + [device_rows(shapes[-1].dimensions()[0])]
    return xc.HloSharding.tuple_sharding(result_shape, out) if result_shape.is_tuple() else out[0]
  first = _result_shapes(result_shape)[0]
  return _alike(result_shape, _result_sharding(target, list(first.dimensions()), arg_shardings[0], attrs))


def _propagate_user_sharding(target, user_sharding, shape, backend_config):
  """GSPMD's backward propagation: x is sharded like the result's user, block-aligned."""
  if PARTITIONED[target].device_stats:
    return user_sharding
  first = _result_shapes(shape)[0]  # results shaped alike: the first's users decide
  user_sharding = (user_sharding.tuple_elements() or [user_sharding])[0]
  return _alike(shape, _result_sharding(target, list(first.dimensions()), user_sharding,
                                        _decode_config(target, backend_config)))


_lock = threading.Lock()
_registered = []


def register():
  """Install the partitioners with XLA, for the built-in backends now and for plugin backends (GPU) as they load."""
  with _lock:
    if _registered:
      return
    for target in PARTITIONED:
      _install(target, prop_user_sharding=functools.partial(_propagate_user_sharding, target),
               partition=functools.partial(_partition, target),
               infer_sharding_from_operands=functools.partial(_infer_from_operands, target))
    for target in SIDE_EFFECTS:
      # Side-effecting calls must be told apart from ones XLA may replicate: each device runs these on its own.
      _install(target, prop_user_sharding=lambda *a: xc.HloSharding.replicate(),
               partition=functools.partial(_replicated, target),
               infer_sharding_from_operands=lambda *a: xc.HloSharding.replicate(),
               can_side_effecting_have_replicated_sharding=True)
    from xla_fp4.sharding import packed  # it builds on this module's helpers
    for target, callbacks in packed.callbacks().items():
      _install(target, **callbacks)


def _install(target, **callbacks):
  """Register `target`'s partitioner with XLA, now and for plugin backends (GPU) as they load."""
  from jax._src import xla_bridge
  xc.register_custom_call_partitioner(target, **callbacks)
  xla_bridge.register_plugin_callbacks(functools.partial(xc.register_custom_call_partitioner, target, **callbacks))
  _registered.append(target)
