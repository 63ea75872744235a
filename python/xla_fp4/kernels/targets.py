"""The XLA FFI targets, one record each: what a call to it takes and returns, its pure-JAX twin, and how XLA's
sharding runs it on shards. Everything the pass, the partitioner and the tests know about one target is read from
its record here; the C++ side lists the same names and attributes once, in xla_fp4/ffi_targets.h (a test checks
that both agree). The numbers each target computes are specified in the contract of xla_fp4/kernels/__init__.py.

A record's `block_local` says how shards run it (sharding/partition.py applies it: the Shardy rule and XLA's
custom-call partitioner): the kernel works on 1x16 blocks along `axis` (or 16x16 tiles when it takes `block_2d`), so a
shard that holds whole blocks runs the same kernel on its own elements.
"""

import dataclasses
import math
import types
from typing import Callable, Optional

from xla_fp4.numerics import kernel_twins
from xla_fp4.numerics.formats import BLOCK
from xla_fp4.numerics.packing import padded_scale_shape

_QUANTIZE = {"block_2d": bool, "stochastic": bool, "rht": bool, "rht_seed": int}


@dataclasses.dataclass(frozen=True)
class BlockLocal:
  """How shards of the blocked first operand run the kernel (sharding/partition.py)."""
  key_operand: Optional[int] = None  # the stochastic-rounding key: each shard mixes its index into it
  takes_2d: bool = False  # its `block_2d` attribute makes 16x16 tiles (the partner dims must keep whole tiles too)
  counts_blocks: bool = False  # the result counts blocks along `axis` (x's extent / 16), each the block's maximum
  # In a fprop or dgrad the dot may decide how an operand's K is sharded (the result's K has factors of its own):
  # only for calls in 1x16 blocks whose result the dot reads directly.
  k_may_follow_dot: bool = False


@dataclasses.dataclass(frozen=True)
class Target:
  name: str
  attributes: types.MappingProxyType  # {name: bool | int}, in the order of ffi_targets.h
  # (operand MLIR types, attributes) -> result MLIR types, or None where the caller chooses (an output dtype)
  result_types: Callable
  twin: Optional[Callable] = None  # numerics.kernel_twins function computing the same numbers from whole tensors
  twin_operands: tuple = ()  # attributes the twin takes as uint32 scalar operands, after the call's own operands
  twin_fixed: tuple = ()  # (attribute, value) pairs: the only values of those attributes the twin implements
  block_local: Optional[BlockLocal] = None  # None: not partitioned (whole operands only)


def _ir():
  from jax._src.lib.mlir import ir
  return ir


def _same_as_x(types_, attrs):
  return [types_[0]]


def _with_scale(types_, attrs):
  ir = _ir()
  return [types_[0], ir.RankedTensorType.get([], ir.F32Type.get())]


def _f32_like_x(types_, attrs):
  ir = _ir()
  return [ir.RankedTensorType.get(list(ir.RankedTensorType(types_[0]).shape), ir.F32Type.get())]


def _block_maxima(types_, attrs):
  ir = _ir()
  shape = list(ir.RankedTensorType(types_[0]).shape)
  shape[attrs["axis"]] //= BLOCK
  return [ir.RankedTensorType.get(shape, ir.F32Type.get())]


def _packed(types_, attrs):
  ir = _ir()
  rows, k = ir.RankedTensorType(types_[0]).shape
  u8 = ir.IntegerType.get_unsigned(8)
  return [ir.RankedTensorType.get([rows, k // 2], u8),
          ir.RankedTensorType.get([math.prod(padded_scale_shape(rows, k))], u8)]


def _caller_chooses(types_, attrs):
  return None


def _target(name, attributes, result_types, **kw):
  return Target(name, types.MappingProxyType(attributes), result_types, **kw)


QDQ = _target("xla_fp4_qdq", {"axis": int, **_QUANTIZE, "apply_global_scale": bool}, _same_as_x,
              twin=kernel_twins.qdq, twin_fixed=(("apply_global_scale", False),),
              block_local=BlockLocal(key_operand=2, takes_2d=True, k_may_follow_dot=True))
QDQ_WITH_SCALE = _target("xla_fp4_qdq_with_scale", {"axis": int, **_QUANTIZE, "salt": int}, _with_scale,
                         twin=kernel_twins.qdq_with_scale, twin_operands=("salt",))
RHT = _target("xla_fp4_rht", {"axis": int, "rht_seed": int}, _f32_like_x, block_local=BlockLocal())
BLOCK_AMAX = _target("xla_fp4_block_amax", {"axis": int, "rht": bool, "rht_seed": int}, _block_maxima,
                     twin=kernel_twins.block_amax, block_local=BlockLocal(counts_blocks=True))
QUANTIZE_PACKED = _target("xla_fp4_quantize_packed", dict(_QUANTIZE), _packed)
DEQUANTIZE_PACKED = _target("xla_fp4_dequantize_packed", {}, _caller_chooses)
GEMM_PACKED = _target("xla_fp4_gemm_packed", {}, _caller_chooses)

ALL = (QDQ, QDQ_WITH_SCALE, RHT, BLOCK_AMAX, QUANTIZE_PACKED, DEQUANTIZE_PACKED, GEMM_PACKED)
BY_NAME = types.MappingProxyType({t.name: t for t in ALL})
