"""How XLA's sharding runs the packed targets on shards (docs/design.md §5): quantize on the shard, move the packed
operands (NVFP4 4.5 bits an element, MXFP4 4.25, MXFP8 8.25), multiply on the device.

The MX formats' targets (xla_fp4_mx_quantize_packed, xla_fp4_mx_gemm_packed) run as NVFP4's below, with blocks of
32 (Packed.block) instead of 16, one E4M3 code a byte for MXFP8 (targets.codes_per_byte), 32x32 weight tiles, and no
s_dec or alpha. K splits in units of 32 elements in every format: two NVFP4 blocks (cuBLASLt's FP4 GEMM takes K in
multiples of 32), one MX block.

xla_fp4_quantize_packed(x [R, K], s_dec, key) -> codes [R, K/2], scales [R, K/16] (or, with axis 0, x [K, R] ->
[K/2, R], [K/16, R]): the packed form has x's dims, so a shard of x that holds whole blocks quantizes alone and its
codes and scales are the whole tensor's shards.
- Shardy rule: R (in 16-row groups where the weight's 16x16 tiles span rows) and K (in pairs of blocks, 32 elements:
  cuBLASLt's FP4 GEMM takes K in multiples of 32) are shared by x, codes and scales, the within-group factors
  need_replication. So x's sharding flows to its packed form, and where a reader needs another sharding the reshard
  moves the packed bytes: the weight that FSDP gathers is gathered packed.
- Partitioner: the codes' sharding, with any dim whose shards would split a group replicated; a stochastic-rounding
  key mixed with the shard's index (as for xla_fp4_qdq).
xla_fp4_quantize_packed_pair(x [R, K], s_dec and key of either copy) -> codes [R, K/2], scales [R, K/16] (along K)
and codes [R/2, K], scales [R/16, K] (along R): as two quantizers of x, with R a K too: both dims split in units of 32
elements, x's sharding shared by all four results; both keys mixed with the shard's index.
xla_fp4_quantize_packed_stats(x, s_dec, key, step) -> codes, scales and (telemetry) the statistics of that
quantization, declared f32[devices, FIELDS]: partitioned as xla_fp4_quantize_packed, each device's row its shard's,
zeros on a replica of a shard (partition.py `device_stats`: its Shardy rule gives the rows factors of their own).

xla_fp4_gemm_packed(a codes, a scales, b codes, b scales, alpha) -> C [M, N], the dot of two K-major operands.
- Shardy rule: M shared with a's rows, N with b's rows, K's pairs of blocks (a reduction factor) with both.
- Partitioner: a device multiplies the shards it holds. M is split as a's rows are, N as b's rows, K where a and b split
  it alike. Where those splits cannot hold together (FSDP's activation rows and weight rows on the same devices), the
  smaller operand's rows are gathered (packed), as XLA's dot partitioner gathers the cheaper side. A split K gives
  float32 partial sums, added by an all-reduce over the devices of one output tile (as XLA does for a dot), then the
  output type. With `emulate` the device dequantizes its shards and multiplies them with XLA's dot (the emulate
  backend: the same numbers, no FP4 GEMM).
- With b_transposed b is Bᵀ (K, N/2) in 16x16 tiles, the forward's packed copy of a weight that its dgrad reads along
  the other axis: K splits b's rows, N its columns in whole tiles. Both GEMMs then read one value, which FSDP gathers
  once (XLA merges the two partitioners' identical all-gathers), as the unrewritten program gathers the weight once.
"""

import functools
import math

import numpy as np
from jax._src.lib import xla_client as xc
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo
from jax._src.lib.mlir.dialects import sdy

from xla_fp4 import kernels
from xla_fp4.kernels import targets
from xla_fp4.numerics.collective import all_reduce
from xla_fp4.numerics.formats import BLOCK
from xla_fp4.sharding import device_rows
from xla_fp4.sharding import shards

K_UNIT = 32  # K splits in whole units of 32 elements: a pair of NVFP4 blocks (cuBLASLt's FP4 GEMM), one MX block
PACKED = {t.name: t.packed for t in targets.ALL if t.packed is not None}
# The emulate backend's GEMM on shards dequantizes with the target of its format.
_DEQUANTIZE = {targets.GEMM_PACKED.name: targets.DEQUANTIZE_PACKED, targets.MX_GEMM_PACKED.name: targets.MX_DEQUANTIZE_PACKED}


def _layout(target, attrs):
  """(codes per byte, elements per scale) of a call to a packed target."""
  return targets.codes_per_byte(attrs), PACKED[target].block


# -- propagation: the Shardy rules ----------------------------------------------------------------------------------

class _Factors:
  def __init__(self):
    self.sizes, self.need_replication, self.reduction = [], [], []

  def new(self, size, replicate=False, reduction=False):
    self.sizes.append(size)
    index = len(self.sizes) - 1
    if replicate:
      self.need_replication.append(index)
    if reduction:
      self.reduction.append(index)
    return index


def _rows(f, rows, group):
  """The factors of a rows dim whose shards keep whole groups of `group` rows (the tile's side for 2D tiles, else
  1)."""
  if group == 1:
    return [f.new(rows)]
  if rows % group == 0 and rows > group:
    return [f.new(rows // group), f.new(group, True)]
  return [f.new(rows, True)]


def _k(f, k, layout, with_x=True, reduction=False):
  """(x's K (None without x), the codes' K/per_byte, the scales' K/block) factors: units of 32 elements may split,
  never a unit."""
  per_byte, block = layout
  if k % K_UNIT == 0 and k > K_UNIT:
    units = f.new(k // K_UNIT, reduction=reduction)
    x = [units, f.new(K_UNIT, True)] if with_x else None
    within = K_UNIT // block  # scales per unit: 2 NVFP4 blocks, one MX block
    return x, [units, f.new(K_UNIT // per_byte, True)], [units] + ([f.new(within, True)] if within > 1 else [])
  x = [f.new(k, True)] if with_x else None
  return x, [f.new(k // per_byte, True)], [f.new(k // block, True)]


def _tiles(f, n, layout):
  """(C's N, b's N/per_byte, b's N/block) factors of a b_transposed GEMM (b is Bᵀ, packed along N in block x block
  tiles): whole tiles may split, never a tile."""
  per_byte, block = layout
  if n % block == 0 and n > block:
    tiles = f.new(n // block)
    return [tiles, f.new(block, True)], [tiles, f.new(block // per_byte, True)], [tiles]
  return [f.new(n, True)], [f.new(n // per_byte, True)], [f.new(n // block, True)]


def _mapping(dims):
  return sdy.TensorMappingAttr.get(dim_mappings=[sdy.DimMappingAttr.get(factor_indices=d) for d in dims])


def _rule(f, operands, results):
  return sdy.OpShardingRuleAttr.get(factor_sizes=f.sizes, operand_mappings=operands, result_mappings=results,
                                    reduction_factors=f.reduction, need_replication_factors=f.need_replication,
                                    is_custom=True)


def sharding_rule(target, operand_types, result_types, attrs):
  """The `sdy.sharding_rule` of a call to a packed target (needs an MLIR context)."""
  shapes = [list(ir.RankedTensorType(t).shape) for t in operand_types]
  scalar = _mapping([])
  f = _Factors()
  layout = _layout(target, attrs)
  if PACKED[target].kind == "pair":  # rows are the column-wise copy's K, K the row-wise copy's: both split in units
    rows_x, rows_codes, rows_scales = _k(f, shapes[0][0], layout)
    k_x, k_codes, k_scales = _k(f, shapes[0][1], layout)
    return _rule(f, [_mapping([rows_x, k_x])] + [scalar] * (len(shapes) - 1),
                 [_mapping([rows_x, k_codes]), _mapping([rows_x, k_scales]), _mapping([rows_codes, k_x]),
                  _mapping([rows_scales, k_x])])
  if PACKED[target].kind == "quantize":
    axis = attrs["axis"]
    rows, k = shapes[0][1 - axis], shapes[0][axis]
    row_dims = _rows(f, rows, layout[1] if attrs["block_2d"] else 1)
    x_k, codes_k, scales_k = _k(f, k, layout)
    ordered = lambda k_dims: _mapping([row_dims, k_dims] if axis == 1 else [k_dims, row_dims])  # noqa: E731
    results = [ordered(codes_k), ordered(scales_k)]
    if PACKED[target].device_stats:  # the [devices, FIELDS] rows: factors of their own (their sdy.sharding fixes them)
      results.append(_mapping([[f.new(n)] for n in ir.RankedTensorType(result_types[-1]).shape]))
    return _rule(f, [ordered(x_k)] + [scalar] * (len(shapes) - 1), results)
  (m, cols), (n, _) = shapes[0], shapes[2]
  k = layout[0] * cols
  m_dims = _rows(f, m, 1)
  if attrs["b_transposed"]:  # b is Bᵀ (K, N/per_byte): K's units split its rows, N's tiles its columns
    k_rows, codes_k, scales_k = _k(f, k, layout, reduction=True)
    n_dims, n_codes, n_scales = _tiles(f, layout[0] * shapes[2][1], layout)
    b_mappings = [_mapping([k_rows, n_codes]), _mapping([k_rows, n_scales])]
  else:
    n_dims = _rows(f, n, 1)
    _, codes_k, scales_k = _k(f, k, layout, with_x=False, reduction=True)
    b_mappings = [_mapping([n_dims, codes_k]), _mapping([n_dims, scales_k])]
  alpha = [scalar] * (len(shapes) - 4)  # NVFP4's alpha; the MX GEMM has none
  return _rule(f, [_mapping([m_dims, codes_k]), _mapping([m_dims, scales_k]), *b_mappings, *alpha],
               [_mapping([m_dims, n_dims])])


# -- partitioning ---------------------------------------------------------------------------------------------------

def _whole(sharding):
  """Whether a call with this result sharding runs on its operands as they are: inside shard_map (manual) or on one
  device (maximal; XLA's is_maximal() also holds for a replicated sharding, which is not meant here)."""
  return sharding.is_manual() or (sharding.is_maximal() and not sharding.is_replicated())


def _split(sharding, shape, dim, tile):
  """(pieces, {device: piece}) of `sharding` along `dim` of `shape`; (1, {}) where it is not split or a piece would not
  hold whole tiles of `tile` elements."""
  if sharding is None or sharding.is_replicated() or sharding.is_manual() or sharding.is_maximal():
    return 1, {}
  tiles, _, _, devices = shards.tiles_and_devices(sharding, len(shape))
  pieces = tiles[dim]
  if pieces == 1 or shape[dim] % pieces or (shape[dim] // pieces) % tile:
    return 1, {}
  return pieces, {int(devices[pos]): pos[dim] for pos in np.ndindex(*devices.shape)}


def _grid(splits, num_devices):
  """The sharding whose data dims are split by `splits` [(pieces, {device: piece})], the devices of one piece
  replicas of it; None where the splits do not tile the devices evenly."""
  pieces = [p for p, _ in splits]
  cells = {}
  for d in range(num_devices):
    cells.setdefault(tuple(index.get(d, 0) for _, index in splits), []).append(d)
  if len(cells) != math.prod(pieces) or len({len(v) for v in cells.values()}) != 1:
    return None
  if math.prod(pieces) == 1:
    return xc.HloSharding.replicate()
  replicas = num_devices // math.prod(pieces)
  devices = np.zeros(pieces + [replicas], np.int64)
  for cell, members in cells.items():
    devices[cell] = members
  proto = xc.OpSharding()
  proto.type = xc.OpSharding.Type.OTHER
  proto.tile_assignment_dimensions = pieces + ([replicas] if replicas > 1 else [])
  proto.tile_assignment_devices = [int(v) for v in devices.reshape(-1)]
  if replicas > 1:
    proto.last_tile_dims = [xc.OpSharding.Type.REPLICATED]
  return xc.HloSharding.from_proto(proto)


def _num_devices(shardings):
  tiled = [s for s in shardings if s is not None and not s.is_replicated() and not s.is_manual()
           and not s.is_maximal()]
  return max((int(np.max(s.tile_assignment_devices())) + 1 for s in tiled), default=1)


def _quantize_sharding(x_shape, sharding, target, attrs):
  """The sharding of x, its codes and its scales (the same dims): `sharding` with the dims replicated whose shards
  would split a unit of K (each K of the pair quantizer's two copies) or a group of rows (block x block tiles)."""
  tiles = shards.tiles_and_devices(sharding, 2)[0]
  if PACKED[target].kind == "pair":
    groups = (K_UNIT, K_UNIT)
  else:
    axis, rows_group = attrs["axis"], PACKED[target].block if attrs["block_2d"] else 1
    groups = (K_UNIT, rows_group) if axis == 0 else (rows_group, K_UNIT)
  bad = {dim for dim, group in enumerate(groups)
         if tiles[dim] > 1 and (x_shape[dim] % tiles[dim] or (x_shape[dim] // tiles[dim]) % group)}
  return shards.replicate_dims(sharding, 2, bad)


def _stochastic(attrs):
  """Whether a packed quantizer's call rounds stochastically (either copy of the pair quantizer)."""
  return attrs.get("stochastic") or attrs.get("row_stochastic") or attrs.get("col_stochastic")


def _partition_quantize(target, arg_shapes, arg_shardings, result_shape, result_sharding, backend_config):
  """XLA's partition callback of a packed quantizer: the shard quantizes alone (the codes' sharding, block-aligned);
  with telemetry (`device_stats`) its statistics one row per device, zeros on a replica of a shard, as partition.py
  does for the block-local quantizer."""
  attrs = shards.decode_config(target, backend_config)
  shardings = list(result_sharding.tuple_elements())
  results = list(result_shape.tuple_shapes())
  if _whole(shardings[0]):
    module = shards.kernel_module(target, attrs, arg_shapes, results, None)
    return module, [shardings[0]] * len(arg_shapes), result_sharding
  sharding = _quantize_sharding(list(arg_shapes[0].dimensions()), shardings[0], target, attrs)
  stats = PACKED[target].device_stats
  num = results[-1].dimensions()[0] if stats else _num_devices([sharding])
  table = shards.shard_index_table(sharding, 2, num)
  salts = shards.shard_salts(table) if _stochastic(attrs) and not sharding.is_replicated() else None
  out, counted = [sharding] * (len(results) - stats), None
  if stats:
    out.append(shardings[-1] if device_rows.one_row_each(shardings[-1], num) else device_rows.device_rows(num))
    counted = shards.first_replicas(table)
  local_args = [sharding.tile(arg_shapes[0])] + list(arg_shapes[1:])
  module = shards.kernel_module(target, attrs, local_args, [o.tile(r) for o, r in zip(out, results)], salts,
                                    counted=counted)
  return (module, [sharding] + [xc.HloSharding.replicate()] * (len(arg_shapes) - 1),
          xc.HloSharding.tuple_sharding(result_shape, out))


def gemm_plan(a_shape, b_shape, a_sharding, b_sharding, num_devices, result_sharding=None, b_transposed=False,
              layout=(2, BLOCK)):
  """How shards run C = A·Bᵀ (codes of shapes (M, K/2), (N, K/2), or with b_transposed b is Bᵀ (K, N/2); `layout`
  (codes per byte, block) divides them otherwise for the MX formats): the
  (pieces, {device: piece}) splits of M, N and K, the first choice whose pieces tile the devices evenly: M and N as
  the result's sharding (what its readers need) splits them, then the operands' own splits, then without the smaller
  operand's row split (its rows are gathered), then without the other's; with K split as both operands split it, then
  whole."""
  m, (per_byte, block) = a_shape[0], layout
  mi, ka = _split(a_sharding, a_shape, 0, 1), _split(a_sharding, a_shape, 1, K_UNIT // per_byte)
  if b_transposed:  # B's rows are b's columns, in whole tiles; K is b's rows, in units of 32
    n = per_byte * b_shape[1]
    ni, kb = _split(b_sharding, b_shape, 1, block // per_byte), _split(b_sharding, b_shape, 0, K_UNIT)
  else:
    n, ni, kb = b_shape[0], _split(b_sharding, b_shape, 0, 1), _split(b_sharding, b_shape, 1, K_UNIT // per_byte)
  whole = (1, {})
  rows = [(mi, ni), (whole, ni), (mi, whole)] if m <= n else [(mi, ni), (mi, whole), (whole, ni)]
  if result_sharding is not None:
    rows.insert(0, (_split(result_sharding, [m, n], 0, 1), _split(result_sharding, [m, n], 1, 1)))
  for k in ([ka] if ka == kb and ka[0] > 1 else []) + [whole]:
    for mm, nn in rows + [(whole, whole)]:
      if _grid([mm, nn, k], num_devices) is not None:
        return mm, nn, k
  return whole, whole, whole


def _partition_gemm(target, arg_shapes, arg_shardings, result_shape, result_sharding, backend_config):
  attrs = shards.decode_config(target, backend_config)
  if _whole(result_sharding):
    module = _gemm_module(target, attrs, arg_shapes, result_shape, None)
    return module, [result_sharding] * len(arg_shapes), result_sharding
  a_shape, b_shape = list(arg_shapes[0].dimensions()), list(arg_shapes[2].dimensions())
  num = _num_devices([*arg_shardings, result_sharding])
  mm, nn, kk = gemm_plan(a_shape, b_shape, arg_shardings[0], arg_shardings[2], num, result_sharding,
                         attrs["b_transposed"], _layout(target, attrs))
  a, out = _grid([mm, kk], num), _grid([mm, nn], num)
  b = _grid([kk, nn] if attrs["b_transposed"] else [nn, kk], num)
  groups = None
  if kk[0] > 1:  # the devices of one output tile, one per piece of K, add their partial sums
    cells = {}
    for d in range(num):
      cells.setdefault((mm[1].get(d, 0), nn[1].get(d, 0)), {}).setdefault(kk[1][d], []).append(d)
    groups = [list(g) for by_piece in cells.values() for g in zip(*[by_piece[p] for p in sorted(by_piece)])]
  shardings = [a, a, b, b] + [xc.HloSharding.replicate()] * (len(arg_shapes) - 4)  # NVFP4's alpha
  local = [s.tile(shape) for s, shape in zip(shardings, arg_shapes)]
  return _gemm_module(target, attrs, local, out.tile(result_shape), groups), shardings, out


def _gemm_module(target, attrs, arg_shapes, result_shape, groups):
  """@main(the device's shards) -> its tile of C; `groups`: the all-reduce groups of a split K, or None. A split K's
  partial sums are added unscaled and alpha multiplies their sum, as one device multiplies its whole sum: sums of
  q·scale products are exact in f32 wherever one device's sum is, so the shards' sum equals it bit for bit, where
  partial sums each multiplied by alpha round apart (docs/design.md §5). The MX formats have no alpha."""
  def body(operands):
    out_type = shards.ir_type(result_shape)
    f32 = ir.F32Type.get()
    acc_type = ir.RankedTensorType.get(out_type.shape, f32)
    alpha = operands[4] if len(operands) > 4 else None
    one = hlo.ConstantOp(ir.DenseElementsAttr.get(np.array(1.0, np.float32))).result
    if attrs["emulate"]:
      dtype, dequantize, per_byte = out_type.element_type, _DEQUANTIZE[target], targets.codes_per_byte(attrs)
      own = {name: attrs[name] for name in dequantize.attributes}  # the MX dequantizer's `fp8`
      a, b = (kernels.custom_call(dequantize.name, [ir.RankedTensorType.get(
          [ir.RankedTensorType(codes.type).shape[0], per_byte * ir.RankedTensorType(codes.type).shape[1]], dtype)],
          [codes, scales] + ([one] if alpha is not None else []),
          kernels.backend_config_attributes(dequantize.name, own)).results[0]
          for codes, scales in (operands[0:2], operands[2:4]))
      numbers = hlo.DotDimensionNumbers.get(lhs_batching_dimensions=[], rhs_batching_dimensions=[],
                                            lhs_contracting_dimensions=[1],
                                            rhs_contracting_dimensions=[0 if attrs["b_transposed"] else 1])
      y, scale_after = hlo.DotGeneralOp(acc_type, a, b, numbers).result, alpha is not None
    else:
      split = groups is not None
      y = kernels.custom_call(target, [acc_type if split else out_type],
                              operands[:4] + ([one if split else alpha] if alpha is not None else []),
                              kernels.backend_config_attributes(target, attrs)).results[0]
      scale_after = split and alpha is not None
    if groups is not None:
      y = _all_reduce(y, groups)
    if scale_after:
      y = hlo.MulOp(y, hlo.BroadcastInDimOp(acc_type, alpha, ir.DenseI64ArrayAttr.get([])).result).result
    if ir.RankedTensorType(y.type).element_type != out_type.element_type:
      y = hlo.ConvertOp(out_type, y).result
    return [y]
  return shards.per_shard_module(arg_shapes, [result_shape], body)


def _all_reduce(x, groups):
  """The sum of x over each group of devices (global device ids)."""
  return all_reduce(x, groups, hlo.AddOp)


# -- GSPMD's propagation (Shardy uses the rules) ---------------------------------------------------------------------

def _infer_quantize(target, arg_shapes, arg_shardings, result_shape, backend_config):
  if arg_shardings[0] is None:
    return None
  attrs = shards.decode_config(target, backend_config)
  sharding = _quantize_sharding(list(arg_shapes[0].dimensions()), arg_shardings[0], target, attrs)
  out = [sharding] * (len(result_shape.tuple_shapes()) - PACKED[target].device_stats)
  if PACKED[target].device_stats:
    out.append(device_rows.device_rows(result_shape.tuple_shapes()[-1].dimensions()[0]))
  return xc.HloSharding.tuple_sharding(result_shape, out)


def _infer_gemm(target, arg_shapes, arg_shardings, result_shape, backend_config):
  a_shape, b_shape = list(arg_shapes[0].dimensions()), list(arg_shapes[2].dimensions())
  num = _num_devices(arg_shardings)
  attrs = shards.decode_config(target, backend_config)
  mm, nn, _ = gemm_plan(a_shape, b_shape, arg_shardings[0], arg_shardings[2], num, b_transposed=attrs["b_transposed"],
                        layout=_layout(target, attrs))
  return _grid([mm, nn], num)


def callbacks(target):
  """The keyword arguments of xla_client.register_custom_call_partitioner for a packed `target` (Target.packed)."""
  keep_user = lambda user_sharding, shape, backend_config: user_sharding  # noqa: E731
  if target.packed.kind == "gemm":
    return dict(partition=functools.partial(_partition_gemm, target.name),
                infer_sharding_from_operands=functools.partial(_infer_gemm, target.name), prop_user_sharding=keep_user)
  return dict(partition=functools.partial(_partition_quantize, target.name),
              infer_sharding_from_operands=functools.partial(_infer_quantize, target.name),
              prop_user_sharding=keep_user)
