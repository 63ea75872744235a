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
  activations' features sharded; docs/design.md §8).
- partitioning (XLA's SPMD partitioner): a custom-call partitioner per target (installed by register.py). It takes the
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
import math

import numpy as np
from jax._src.lib import xla_client as xc
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import sdy

from xla_fp4.kernels import targets
from xla_fp4.numerics.formats import BLOCK
from xla_fp4.sharding.device_rows import device_rows, one_row_each
from xla_fp4.sharding.shards import (alike, decode_config, first_replicas, kernel_module, replicate_dims,
                                     result_shapes, shard_index_table, shard_salts, tiles_and_devices)

# The block-local targets, by name: their records (kernels/targets.py `BlockLocal`) say how shards run them.
PARTITIONED = {t.name: t.block_local for t in targets.ALL if t.block_local is not None}


@dataclasses.dataclass(frozen=True)
class Blocking:
  """The dims of a block-local kernel's operand that shards must keep in whole blocks."""
  k: int  # the quantization axis: `block` consecutive elements per block
  partner: tuple  # 2D tiles: the group of dims flattened into the tile's second side, outermost first; 1D blocks: ()
  block: int = BLOCK  # 16 (NVFP4), 32 (the MX formats): a block's length and a tile's side

  @staticmethod
  def of(rank, axis, block_2d, block=BLOCK):
    axis %= rank
    if not block_2d:
      return Blocking(axis, (), block)
    return Blocking(axis, tuple(range(axis + 1, rank)) if axis < rank - 1 else tuple(range(axis)), block)

  def split_blocks(self, shape, tiles):
    """The dims to replicate so that every shard of `shape`, split `tiles[d]` ways along dim d, holds whole blocks."""
    bad = set()
    if tiles[self.k] > 1 and (shape[self.k] % tiles[self.k] or (shape[self.k] // tiles[self.k]) % self.block):
      bad.add(self.k)
    # A shard of the flattened partner group is runs of (extent of the innermost split dim x the whole dims after it)
    # consecutive positions, each starting at a multiple of its length: tiles stay whole when that is a multiple of a
    # tile's side.
    split = [d for d in self.partner if tiles[d] > 1]
    while split:
      j = split[-1]
      run = (shape[j] // tiles[j]) * math.prod(shape[d] for d in self.partner if d > j)
      if shape[j] % tiles[j] == 0 and run % self.block == 0:
        break
      bad.add(split.pop())
    return bad


def _blocking(target, rank, attrs):
  local = PARTITIONED[target]
  return Blocking.of(rank, attrs["axis"], local.takes_2d and attrs["block_2d"], local.block)


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

  block = local.block

  def compound_factors(n):
    blocks, within = factor(n // block), factor(block)
    need_replication.append(within)
    return [blocks, within]

  for d, n in enumerate(shape):
    if d in compound and n > block and n % block == 0:
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


def _result_sharding(target, shape, sharding, attrs):
  """`sharding` (of the result or of x; same rank) with the dims replicated whose shards would split blocks."""
  if sharding.is_manual() or sharding.is_maximal():
    return sharding
  rank = len(shape)
  if PARTITIONED[target].counts_blocks:  # the result counts blocks along the axis: check x's shape
    shape = list(shape)
    shape[attrs["axis"] % rank] *= PARTITIONED[target].block
  bad = _blocking(target, rank, attrs).split_blocks(shape, tiles_and_devices(sharding, rank)[0])
  return replicate_dims(sharding, rank, bad)


def _partition_with_stats(target, attrs, arg_shapes, arg_shardings, result_shape, result_sharding):
  """The partition callback of a `device_stats` target: its like-x results as the block-local ones are partitioned,
  and its statistics result [devices, FIELDS] one row per device: the kernel's row of the device's shard, zeros on
  a replica of a shard, whose kernel gets step -1 (the sum over devices then counts every element once). No
  collective: each device records its row (a record of parts; passes/rewrite/probes.py)."""
  local = PARTITIONED[target]
  shapes = result_shapes(result_shape)
  shardings = list(result_sharding.tuple_elements()) if result_shape.is_tuple() else [result_sharding]
  num = shapes[-1].dimensions()[0]
  x_shape = list(arg_shapes[0].dimensions())
  x_sharding = (shardings[0] if len(shapes) > 1 else arg_shardings[0]) or xc.HloSharding.replicate()
  if x_sharding.is_manual() or shardings[-1].is_manual() or (x_sharding.is_maximal() and not
                                                              x_sharding.is_replicated()):
    # Inside shard_map (or on one device) the call runs on what the device holds: its row first, the others zeros.
    module = kernel_module(target, attrs, arg_shapes, shapes, None)
    return module, [x_sharding] * len(arg_shapes), result_sharding
  if local.blocked:
    x_sharding = _result_sharding(target, x_shape, x_sharding, attrs)
  rows = shardings[-1] if one_row_each(shardings[-1], num) else device_rows(num)
  table = shard_index_table(x_sharding, len(x_shape), num)
  salts = None
  if local.key_operand is not None and attrs["stochastic"] and not x_sharding.is_replicated():
    salts = shard_salts(table)
  local_args = [x_sharding.tile(arg_shapes[0])] + list(arg_shapes[1:])
  local_results = [x_sharding.tile(s) for s in shapes[:-1]] + [rows.tile(shapes[-1])]
  module = kernel_module(target, attrs, local_args, local_results, salts, counted=first_replicas(table))
  out = [x_sharding] * (len(shapes) - 1) + [rows]
  result = xc.HloSharding.tuple_sharding(result_shape, out) if result_shape.is_tuple() else out[0]
  return module, [x_sharding] + [xc.HloSharding.replicate()] * (len(arg_shapes) - 1), result


def partition(target, arg_shapes, arg_shardings, result_shape, result_sharding, backend_config):
  """XLA's partition callback: (per-shard module, operand shardings, result sharding)."""
  attrs = decode_config(target, backend_config)
  if PARTITIONED[target].device_stats:
    return _partition_with_stats(target, attrs, arg_shapes, arg_shardings, result_shape, result_sharding)
  # Several results (xla_fp4_block_amax with digest) are shaped alike and sharded as the first.
  shapes = result_shapes(result_shape)
  first = (result_sharding.tuple_elements() or [result_sharding])[0]
  if first.is_manual() or first.is_maximal():
    # Inside shard_map (or on one device) the shapes are already the device's own: the kernel runs as it is.
    module = kernel_module(target, attrs, arg_shapes, shapes, None)
    return module, [first] * len(arg_shapes), result_sharding
  rank = len(shapes[0].dimensions())
  sharding = _result_sharding(target, list(shapes[0].dimensions()), first, attrs)
  salts = None
  if PARTITIONED[target].key_operand is not None and attrs["stochastic"] and not sharding.is_replicated():
    num_partitions = int(np.max(sharding.tile_assignment_devices())) + 1
    salts = shard_salts(shard_index_table(sharding, rank, num_partitions))
  arg_shardings = [sharding] + [xc.HloSharding.replicate()] * (len(arg_shapes) - 1)  # x, then the scalars
  local = [sharding.tile(arg_shapes[0])] + list(arg_shapes[1:])
  module = kernel_module(target, attrs, local, [sharding.tile(s) for s in shapes], salts)
  return module, arg_shardings, alike(result_shape, sharding)


def infer_from_operands(target, arg_shapes, arg_shardings, result_shape, backend_config):
  """GSPMD's forward propagation: the result is sharded like x, block-aligned (a statistics row: one per device)."""
  if arg_shardings[0] is None:
    return None
  attrs = decode_config(target, backend_config)
  if PARTITIONED[target].device_stats:
    shapes = result_shapes(result_shape)
    x = arg_shardings[0]
    if PARTITIONED[target].blocked:
      x = _result_sharding(target, list(arg_shapes[0].dimensions()), x, attrs)
    out = [x] * (len(shapes) - 1) + [device_rows(shapes[-1].dimensions()[0])]
    return xc.HloSharding.tuple_sharding(result_shape, out) if result_shape.is_tuple() else out[0]
  first = result_shapes(result_shape)[0]
  return alike(result_shape, _result_sharding(target, list(first.dimensions()), arg_shardings[0], attrs))


def propagate_user_sharding(target, user_sharding, shape, backend_config):
  """GSPMD's backward propagation: x is sharded like the result's user, block-aligned."""
  if PARTITIONED[target].device_stats:
    return user_sharding
  first = result_shapes(shape)[0]  # results shaped alike: the first's users decide
  user_sharding = (user_sharding.tuple_elements() or [user_sharding])[0]
  return alike(shape, _result_sharding(target, list(first.dimensions()), user_sharding,
                                        decode_config(target, backend_config)))
