"""The XLA FFI targets, one record each: what a call to it takes and returns, its pure-JAX twin, and how XLA's
sharding runs it on shards. Everything the pass, the partitioner and the tests know about one target is read from
its record here; the C++ side lists the same names and attributes once, in xla_fp4/ffi_targets.h (a test checks
that both agree). The numbers each target computes are specified in the contract of xla_fp4/kernels/__init__.py.

A record's `block_local` says how shards run it (sharding/partition.py applies it: the Shardy rule and XLA's
custom-call partitioner): the kernel works on 1x16 blocks along `axis` (or 16x16 tiles when it takes `block_2d`), so a
shard that holds whole blocks runs the same kernel on its own elements.
"""

import dataclasses
import types
from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from xla_fp4.numerics import kernel_twins
from xla_fp4.numerics import telemetry
from xla_fp4.numerics.formats import BLOCK
from xla_fp4.numerics.mx import MX_BLOCK

_QUANTIZE = {"block_2d": bool, "stochastic": bool, "rht": bool, "rht_seed": int}
_FOUR_OVER_SIX = {"four_over_six": bool}  # NVFP4's quantizers: each block's scale to 4 or to 6 (ffi_targets.h)


@dataclasses.dataclass(frozen=True)
class BlockLocal:
  """How shards of the blocked first operand run the kernel (sharding/partition.py)."""
  key_operand: Optional[int] = None  # the stochastic-rounding key: each shard mixes its index into it
  takes_2d: bool = False  # its `block_2d` attribute makes 16x16 tiles (the partner dims must keep whole tiles too)
  counts_blocks: bool = False  # the result counts blocks along `axis` (x's extent / 16), each the block's maximum
  # In a fprop or dgrad the dot may decide how an operand's K is sharded (the result's K has factors of its own):
  # only for calls in 1x16 blocks whose result the dot reads directly.
  k_may_follow_dot: bool = False
  blocked: bool = True  # False: element-wise, any shard runs it (no `axis`)
  # Telemetry: the last result is the statistics row (numerics/telemetry.py FIELDS) of the elements the call reads. In
  # a partitioned program the call declares it [devices, FIELDS]: each device's row is what its shard contributes,
  # zeros on a replica, so that the record's sum over devices counts every element once.
  device_stats: bool = False
  block: int = BLOCK  # a block's elements along the axis (and a tile's side): 16, the MX formats' 32


@dataclasses.dataclass(frozen=True)
class Packed:
  """How shards run a target of packed operands (sharding/packed.py): `quantize` (x (rows, K) -> codes and scales
  along the same dims: a shard keeps whole blocks), `pair` (both of x's packed copies, along either dim) or `gemm`
  (a dot of two packed K-major operands: rows split as the operands' rows, K split into f32 partial sums that an
  all-reduce adds)."""
  kind: str
  # the stochastic-rounding key (a tuple: keys, the pair quantizer's): each shard mixes its index into it
  key_operand: Optional[Union[int, tuple]] = None
  device_stats: bool = False  # telemetry: the last result is the statistics row, as BlockLocal.device_stats says
  block: int = BLOCK  # elements along K per scale: NVFP4's 16, the MX formats' 32 (codes per byte: `codes_per_byte`)


@dataclasses.dataclass(frozen=True, eq=False)  # one record per target: compared and hashed by identity
class Target:
  name: str
  attributes: types.MappingProxyType  # {name: bool | int}, in the order of ffi_targets.h
  # (operands with .shape and .dtype, attributes, dtype) -> [jax.ShapeDtypeStruct] of the results; `dtype` is the
  # output dtype where the caller chooses it (dequantize_packed, gemm_packed), else unused
  results: Callable
  twin: Optional[Callable] = None  # numerics.kernel_twins function computing the same numbers from whole tensors
  twin_operands: tuple = ()  # attributes the twin takes as uint32 scalar operands, after the call's own operands
  twin_fixed: tuple = ()  # (attribute, value) pairs: the only values of those attributes the twin implements
  block_local: Optional[BlockLocal] = None  # None: not partitioned (whole operands only)
  packed: Optional[Packed] = None  # a packed target's partitioning (sharding/packed.py), or None
  side_effect: bool = False  # the call acts on the host (telemetry): XLA must neither remove nor merge it
  # how many quantized copies of its first operand it makes (sharding/cost.py counts the elements it quantizes)
  quantizes: int = 0
  # telemetry: the target that computes the same and also measures it, taking the step as its last operand and adding
  # a statistics row as its last result (the rewrite calls it where the GEMM is probed)
  with_stats: Optional["Target"] = None
  counts_as_dot: bool = False  # the FP4 GEMM C (M, N) of a (M, K/2): sharding/cost.py counts it as a dot of its shape

  @property
  def sharded(self):
    """How shards run it (a BlockLocal or a Packed record), or None."""
    return self.block_local or self.packed

  @property
  def device_stats(self):
    """Whether its last result is a statistics row, one per device in a partitioned program (BlockLocal)."""
    return self.sharded is not None and self.sharded.device_stats

  def twin_arguments(self, attrs):
    """(the values of the attributes the twin takes as uint32 operands, the twin's keyword parameters) of a call with
    `attrs`; raises ValueError for an attribute value the twin does not implement."""
    fixed = dict(self.twin_fixed)
    for name, value in fixed.items():
      if attrs[name] != value:
        raise ValueError(f"the twin of {self.name} implements {name}={value} only, got {attrs[name]}")
    params = {k: v for k, v in attrs.items() if k not in self.twin_operands and k not in fixed}
    return [attrs[name] for name in self.twin_operands], params

  def result_types(self, operand_types, attrs, dtype=None):
    """The results as MLIR tensor types, from the operands' (needs an MLIR context)."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    return [ir.RankedTensorType.get(list(r.shape), mlir.dtype_to_ir_type(np.dtype(r.dtype)))
            for r in self.results([shape_dtype(t) for t in operand_types], attrs, dtype)]


_MLIR_DTYPES = {"f32": np.float32, "bf16": jnp.bfloat16, "f16": np.float16, "ui8": np.uint8, "ui32": np.uint32,
                "i32": np.int32, "i64": np.int64, "i1": np.bool_}


def shape_dtype(mlir_type):
  """The jax.ShapeDtypeStruct of an MLIR tensor type of the kernels' and twins' element types."""
  from jax._src.lib.mlir import ir
  t = ir.RankedTensorType(mlir_type)
  return jax.ShapeDtypeStruct(tuple(t.shape), _MLIR_DTYPES[str(t.element_type)])


def _like_x(operands, attrs, dtype):
  return [jax.ShapeDtypeStruct(operands[0].shape, operands[0].dtype)]


def _with_scale(operands, attrs, dtype):
  return _like_x(operands, attrs, dtype) + [jax.ShapeDtypeStruct((), np.float32)]


def _f32_like_x(operands, attrs, dtype):
  return [jax.ShapeDtypeStruct(operands[0].shape, np.float32)]


def _block_maxima(operands, attrs, dtype):
  """The maxima, and with `digest` the digests: x's shape with the axis divided by 16."""
  shape = list(operands[0].shape)
  shape[attrs["axis"]] //= BLOCK
  return [jax.ShapeDtypeStruct(tuple(shape), np.float32)] + (
      [jax.ShapeDtypeStruct(tuple(shape), np.uint32)] if attrs["digest"] else [])


def codes_per_byte(attrs):
  """Elements per code byte of a packed target's call: two E2M1 codes (NVFP4, MXFP4), one E4M3 code (MXFP8, `fp8`)."""
  return 1 if attrs.get("fp8") else 2


def _packed_as(block):
  def results(operands, attrs, dtype):
    """Codes and scales: x's dims with the axis (K) divided by the codes per byte and by the block."""
    def along_k(divisor):
      shape = list(operands[0].shape)
      shape[attrs["axis"]] //= divisor
      return jax.ShapeDtypeStruct(tuple(shape), np.uint8)
    return [along_k(codes_per_byte(attrs)), along_k(block)]
  return results


_packed = _packed_as(BLOCK)


def _unpacked(operands, attrs, dtype):
  rows, cols = operands[0].shape
  return [jax.ShapeDtypeStruct((rows, codes_per_byte(attrs) * cols), dtype)]


def _product(operands, attrs, dtype):
  """C (M, N): N is b's rows, or with b_transposed its packed columns times the codes per byte."""
  n = codes_per_byte(attrs) * operands[2].shape[1] if attrs["b_transposed"] else operands[2].shape[0]
  return [jax.ShapeDtypeStruct((operands[0].shape[0], n), dtype)]


def _ragged_product(operands, attrs, dtype):
  """C (M, N), or (G, M, N) with ragged_k (the groups split K)."""
  m, groups = operands[0].shape[0], operands[4].shape[0]
  if attrs["ragged_k"]:
    return [jax.ShapeDtypeStruct((groups, m, operands[2].shape[0]), dtype)]
  return [jax.ShapeDtypeStruct((m, operands[2].shape[1]), dtype)]


def _target(name, attributes, results, **kw):
  return Target(name, types.MappingProxyType(attributes), results, **kw)


# Telemetry: the quantizers' forms that also measure what they do, in the same pass over x, and a GEMM output's zeros,
# as FIELDS rows of numerics/telemetry.py; zeros, without measuring, where the step operand (int32) is -1.
_ROW = lambda operands, attrs, dtype: [jax.ShapeDtypeStruct((len(telemetry.FIELDS),), np.float32)]  # noqa: E731
QDQ_WITH_SCALE_STATS = _target("xla_fp4_qdq_with_scale_stats",
                               {"axis": int, **_QUANTIZE, "salt": int, **_FOUR_OVER_SIX},
                               lambda operands, attrs, dtype: _with_scale(operands, attrs, dtype) + _ROW(
                                   operands, attrs, dtype), twin=telemetry.qdq_with_scale_stats,
                               twin_operands=("salt",), quantizes=1)
# A partitioned program's quantizer with telemetry: xla_fp4_qdq's y (apply_global_scale false) and the row of what it
# did to the shard it holds (zeros in an unrecorded step).
QDQ_AND_STATS = _target("xla_fp4_qdq_and_stats", {"axis": int, **_QUANTIZE, **_FOUR_OVER_SIX},
                        lambda operands, attrs, dtype: _like_x(operands, attrs, dtype) + _ROW(operands, attrs, dtype),
                        twin=telemetry.qdq_and_stats,
                        block_local=BlockLocal(key_operand=2, takes_2d=True, k_may_follow_dot=True, device_stats=True),
                        quantizes=1)
QDQ = _target("xla_fp4_qdq", {"axis": int, **_QUANTIZE, "apply_global_scale": bool, **_FOUR_OVER_SIX}, _like_x,
              twin=kernel_twins.qdq, twin_fixed=(("apply_global_scale", False),),
              block_local=BlockLocal(key_operand=2, takes_2d=True, k_may_follow_dot=True), quantizes=1,
              with_stats=QDQ_AND_STATS)
QDQ_WITH_SCALE = _target("xla_fp4_qdq_with_scale", {"axis": int, **_QUANTIZE, "salt": int, **_FOUR_OVER_SIX},
                         _with_scale,
                         twin=kernel_twins.qdq_with_scale, twin_operands=("salt",), quantizes=1,
                         with_stats=QDQ_WITH_SCALE_STATS)
OUTPUT_STATS = _target("xla_fp4_output_stats", {}, _ROW, twin=telemetry.output_stats,
                       block_local=BlockLocal(blocked=False, device_stats=True))
RHT = _target("xla_fp4_rht", {"axis": int, "rht_seed": int}, _f32_like_x, block_local=BlockLocal())
# `digest`: each block's digest too (a second result), so that the stochastic-rounding key needs no other pass over x.
BLOCK_AMAX = _target("xla_fp4_block_amax", {"axis": int, "rht": bool, "rht_seed": int, "digest": bool}, _block_maxima,
                     twin=kernel_twins.block_amax, block_local=BlockLocal(counts_blocks=True))
# The OCP MX formats' quantizer (numerics/mx.py): q * 2^s per 32-block (32x32 tile with block_2d), E4M3 elements with
# `fp8`, else E2M1; on whole tensors and on shards (its blocks and tiles of 32 kept whole: sharding/partition.py).
MX_QDQ = _target("xla_fp4_mx_qdq", {"axis": int, **_QUANTIZE, "fp8": bool}, _like_x, twin=kernel_twins.mx_qdq,
                 quantizes=1, block_local=BlockLocal(key_operand=1, takes_2d=True, block=MX_BLOCK))
# The native forms' quantizer with telemetry: xla_fp4_quantize_packed's codes and scales, and the row of what it did to
# the x (or shard) it holds, from the same pass (zeros in an unrecorded step).
QUANTIZE_PACKED_STATS = _target("xla_fp4_quantize_packed_stats", {"axis": int, **_QUANTIZE, **_FOUR_OVER_SIX},
                                lambda operands, attrs, dtype: _packed(operands, attrs, dtype) + _ROW(
                                    operands, attrs, dtype),
                                packed=Packed("quantize", key_operand=2, device_stats=True), quantizes=1)
QUANTIZE_PACKED = _target("xla_fp4_quantize_packed", {"axis": int, **_QUANTIZE, **_FOUR_OVER_SIX}, _packed,
                          packed=Packed("quantize", key_operand=2), quantizes=1,
                          with_stats=QUANTIZE_PACKED_STATS)
# Both packed copies a GEMM pair takes of one value (the row-wise one of a fprop's activation or a dgrad's output
# gradient, the wgrad's column-wise one, usually with the RHT) from one read of x (rows, K), each with its own s_dec,
# key and rounding: xla_fp4_quantize_packed's numbers along axis 1 and along axis 0 (rewrite/pairs.py makes it).
QUANTIZE_PACKED_PAIR = _target("xla_fp4_quantize_packed_pair",
                               {"row_stochastic": bool, "row_rht": bool, "col_stochastic": bool, "col_rht": bool,
                                "rht_seed": int, **_FOUR_OVER_SIX},
                               lambda operands, attrs, dtype: _packed(operands, {"axis": 1}, dtype) + _packed(
                                   operands, {"axis": 0}, dtype),
                               packed=Packed("pair", key_operand=(2, 4)), quantizes=2)
DEQUANTIZE_PACKED = _target("xla_fp4_dequantize_packed", {}, _unpacked)
# `emulate`: shards multiply the dequantized operands with XLA's dot (the emulate backend of a partitioned program,
# which gathers packed operands but has no FP4 GEMM); the numbers are the same. `b_transposed`: b is Bᵀ packed along N,
# in 16x16 tiles (a weight's forward copy, read by its dgrad: one copy of the weight is quantized and gathered).
GEMM_PACKED = _target("xla_fp4_gemm_packed", {"emulate": bool, "b_transposed": bool}, _product, packed=Packed("gemm"),
                      counts_as_dot=True)
# The grouped FP4 GEMM of expert layers (a chlo.ragged_dot under the native backend), whole tensors only: the groups of
# a's rows (or with `ragged_k` of K) each with their own B and alpha; numerics/grouped.py packs its operands.
RAGGED_GEMM_PACKED = _target("xla_fp4_ragged_gemm_packed", {"ragged_k": bool}, _ragged_product)

# The packed MX formats (numerics/packing.py pack_mx): xla_fp4_mx_qdq's blocks as E2M1 pairs (or E4M3 bytes with
# `fp8`) and E8M0 scales per 32, no tensor scale; the GEMM multiplies them with alpha one (cuBLASLt's VEC32_UE8M0
# scales on Blackwell); the dequantizer is the emulate backend's GEMM on shards. Partitioned as NVFP4's packed targets
# with blocks of 32 (sharding/packed.py).
MX_QUANTIZE_PACKED = _target("xla_fp4_mx_quantize_packed", {"axis": int, **_QUANTIZE, "fp8": bool},
                             _packed_as(MX_BLOCK), packed=Packed("quantize", key_operand=1, block=MX_BLOCK),
                             quantizes=1)
MX_DEQUANTIZE_PACKED = _target("xla_fp4_mx_dequantize_packed", {"fp8": bool}, _unpacked)
MX_GEMM_PACKED = _target("xla_fp4_mx_gemm_packed", {"emulate": bool, "b_transposed": bool, "fp8": bool}, _product,
                         packed=Packed("gemm", block=MX_BLOCK), counts_as_dot=True)

# Telemetry (telemetry.py reads what they record): the step of this call of one GEMM (int32; -1: not recorded),
# decided on the host (`calls` calls per step); the GEMM's statistics (float32 rows of numerics/telemetry.py FIELDS),
# with that step and the block index, whose result is the step passed through (XLA's partitioner needs a result to give
# a side-effecting op its sharding). The statistics are whole tensors', replicated; with `parts` > 1 one device's part
# of them, [devices, rows, FIELDS] split one row per device (a partitioned program in one process: the sink sums the
# parts, so that no collective gathers them; sharding/device_rows.py).
TELEMETRY_STEP = _target("xla_fp4_telemetry_step", {"module": int, "site": int, "every": int, "calls": int},
                         lambda operands, attrs, dtype: [jax.ShapeDtypeStruct((), np.int32)], side_effect=True)
TELEMETRY_RECORD = _target("xla_fp4_telemetry_record", {"module": int, "site": int, "strict_row": int, "parts": int},
                           lambda operands, attrs, dtype: [jax.ShapeDtypeStruct((), np.int32)], side_effect=True)

ALL = (QDQ, QDQ_WITH_SCALE, QDQ_WITH_SCALE_STATS, QDQ_AND_STATS, OUTPUT_STATS, RHT, BLOCK_AMAX, QUANTIZE_PACKED,
       QUANTIZE_PACKED_STATS, QUANTIZE_PACKED_PAIR, DEQUANTIZE_PACKED, GEMM_PACKED, RAGGED_GEMM_PACKED, TELEMETRY_STEP,
       TELEMETRY_RECORD, MX_QDQ, MX_QUANTIZE_PACKED, MX_DEQUANTIZE_PACKED, MX_GEMM_PACKED)
BY_NAME = types.MappingProxyType({t.name: t for t in ALL})
