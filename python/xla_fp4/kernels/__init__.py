"""The compiled NVFP4 kernels: loading the extension, registering its XLA FFI targets, and calling them.

Every kernel has a pure-JAX twin in `xla_fp4.numerics` that defines its numbers (the pass's kernels, with their
attributes: `xla_fp4.numerics.kernel_twins`); the kernels agree with it bit for bit (the GEMM up to float32 summation
order).

Custom-call contract (for code that emits `stablehlo.custom_call` itself, like the compiler pass): typed FFI, written
as jax.ffi writes it (an empty `backend_config` string, the attributes in a DictionaryAttr `mhlo.backend_config`,
which XLA reads as a typed FFI call) with exactly the attributes in `ATTRIBUTES[target]`, typed as follows:
  - `bool` attributes are `BoolAttr` (MLIR `true`/`false`, i.e. i1); XLA FFI decodes them as C++ `bool` (PRED scalar),
    which is also what `jax.ffi.ffi_call` emits for a Python bool. Do not pass them as integers.
  - `int` attributes are signless 64-bit `IntegerAttr` (`3 : i64`). `rht_seed` and `salt` must lie in [0, 2**32).
`custom_call_backend_config(target, attrs)` builds that dictionary. Operands and results are row-major, and the call
must say so in its `operand_layouts` and `result_layouts`: `custom_call(...)` emits such a call.

  xla_fp4_qdq(x: f32|bf16|f16[...], s_dec: f32[], key: u32[]) -> x's type
      attrs axis: i64, block_2d: bool, stochastic: bool, rht: bool, rht_seed: i64, apply_global_scale: bool,
      four_over_six: bool
      == numerics qdq of (rht(x) if rht else x) with global_scale=s_dec and the key's random bits; the result stays in
      the RHT space. s_dec = amax / (6 * 448), amax taken after the RHT when rht is on. With apply_global_scale
      false the result is q * scale (exact), the operand of an emulated GEMM that folds s_dec into its output.
      With stochastic false the key is not read (the pass passes a value there that orders the call). With
      four_over_six each block (16x16 tile) takes its scale to 4 or to 6, whichever decodes it with the smaller sum of
      squared errors (numerics.nvfp4 _four_over_six: both candidates rounded with the same bits, sums by halves).
  xla_fp4_qdq_with_scale(x: f32|bf16|f16[...]) -> (x's type, s_dec: f32[])
      attrs axis: i64, block_2d: bool, stochastic: bool, rht: bool, rht_seed: i64, salt: i64, four_over_six: bool
      measures x itself and then runs xla_fp4_qdq with apply_global_scale false: s_dec = amax * f32(1 / 2688), amax
      = max |rht(x) if rht else x| with NaN counted as +Inf; key = salt, xor'ed with the wrapping uint32 sum of x's
      element bits when stochastic (numerics.tensor_digest), so that the rounding differs every step; with
      four_over_six s_dec = amax * f32(1 / 1536). For tensors
      that are whole on one device: a partitioned program needs the global amax, i.e. a reduction XLA can partition.
  xla_fp4_qdq_with_scale_stats(x: f32|bf16|f16[...], step: i32[]) -> (x's type, s_dec: f32[], stats: f32[11])
      attrs as xla_fp4_qdq_with_scale's: its results, and where step >= 0 the statistics of that quantization
      (numerics/telemetry.py FIELDS: counts exactly, energies to float rounding) from the same pass over x, else
      zeros, reading nothing more                                       (== numerics.telemetry.qdq_with_scale_stats)
  xla_fp4_qdq_and_stats(x: f32|bf16|f16[...], s_dec: f32[], key: u32[], step: i32[]) -> (x's type, f32[11])
      attrs axis: i64, block_2d: bool, stochastic: bool, rht: bool, rht_seed: i64, four_over_six: bool
      xla_fp4_qdq's result with apply_global_scale false, and where step >= 0 the statistics of that quantization of
      x from the same pass, else zeros (== numerics.telemetry.qdq_and_stats). Block-local: a partitioned program's
      quantizer with telemetry, x a shard (sharding/partition.py: the row per device).
  xla_fp4_output_stats(y: f32|bf16|f16[...], step: i32[]) -> f32[11]; no attrs
      (exact zeros of y, elements, 0, ...), or zeros where step < 0          (== numerics.telemetry.output_stats)
  xla_fp4_rht(x: f32|bf16|f16[...]) -> f32[x.shape]; attrs axis: i64, rht_seed: i64    (== numerics.rht.rht_f32)
  xla_fp4_block_amax(x: f32|bf16|f16[...]) -> f32[x.shape, axis / 16] (, u32[x.shape, axis / 16] with digest)
      attrs axis: i64, rht: bool, rht_seed: i64, digest: bool
      the max |v| of every 1x16 block (v = its RHT when rht), NaN as +Inf     (== numerics.block_amax); with digest
      also each block's wrapping uint32 sum of its elements' bits          (== numerics.block_digest); block-local,
      for partitioned programs: the max over the maxima, a plain reduction, is the global amax, and the sum of the
      digests x's digest (numerics.tensor_digest).
  xla_fp4_quantize_packed(x: f32|bf16|f16[rows, K], s_dec: f32[], key: u32[])
      -> (data: u8[rows, K/2], scales: u8[rows, K/16])
      attrs axis: i64, block_2d: bool, stochastic: bool, rht: bool, rht_seed: i64, four_over_six: bool
                                                                                     (== numerics.pack(quantize(...)))
      axis 1; with axis 0 x is [K, rows] and data, scales u8[K/2, rows], u8[K/16, rows] (x's dims: the transposes),
      read as the program holds x (no K-major copy of x; stochastic rounding's bits follow positions in x).
  xla_fp4_quantize_packed_pair(x: f32|bf16|f16[rows, K], row_s_dec: f32[], row_key: u32[], col_s_dec, col_key)
      -> (row_data: u8[rows, K/2], row_scales: u8[rows, K/16], col_data: u8[rows/2, K], col_scales: u8[rows/16, K])
      attrs row_stochastic, row_rht, col_stochastic, col_rht: bool, rht_seed: i64, four_over_six: bool
      both packed copies from one read of x: xla_fp4_quantize_packed's along axis 1 (row_*) and along axis 0 (col_*),
      bit for bit.
  xla_fp4_quantize_packed_stats(x, s_dec, key, step: i32[]) -> (data, scales, f32[11])
      attrs as xla_fp4_quantize_packed's: its results, and where step >= 0 the statistics of that quantization of x
      from the same pass (== numerics.telemetry.qdq_and_stats's row: counts exactly, energies to float rounding),
      else zeros. x may be a shard (sharding/packed.py: the row per device): the native forms' telemetry.
  xla_fp4_dequantize_packed(data: u8[rows, K/2], scales: u8[rows, K/16], s_dec: f32[])
      -> f32|bf16|f16[rows, K]; no attrs
  xla_fp4_gemm_packed(a_data: u8[M, K/2], a_scales: u8[M, K/16], b_data: u8[N, K/2], b_scales: u8[N, K/16],
                      alpha: f32[])
      -> f32|bf16|f16[M, N]; attrs emulate: bool (how shards run it: sharding/partition.py; the same numbers),
      b_transposed: bool (b_data u8[K, N/2], b_scales u8[K, N/16]: Bᵀ packed along N, its scales uniform over 16x16
      tiles; B = decode(b)ᵀ).
      C = alpha * sum_k (qa*sa)(qb*sb), float32 accumulation; alpha = s_dec_a*s_dec_b.
  xla_fp4_ragged_gemm_packed(a_data: u8[M, K/2], a_scales: u8[M, K/16], b_data, b_scales, group_sizes: i32[G],
                             alpha: f32[G]) -> f32|bf16|f16; attrs ragged_k: bool. Whole tensors only.
      ragged_k false: b_data u8[G, N, K/2], b_scales u8[G, N, K/16] -> C[M, N]: the rows of group g (consecutive
      from row 0, group_sizes[g] of them) times b[g] and alpha[g]; rows after the last group are zero.
      ragged_k true: b_data u8[N, K/2], b_scales u8[N, K/16] -> C[G, M, N]: C[g] = alpha[g] * A·Bᵀ over group g's
      range of K (group_sizes[g] elements, a multiple of 16). Sizes are clipped to the extent they split; negative
      sizes count as 0. (== numerics.grouped's ragged_rows / ragged_contracting on ragged_rows_packed /
      ragged_contracting_packed's operands, up to float32 summation order.)
  xla_fp4_mx_qdq(x: f32|bf16|f16[...], key: u32[]) -> x's type
      attrs axis: i64, block_2d: bool, stochastic: bool, rht: bool, rht_seed: i64, fp8: bool
      an OCP MX format's q * 2^s of (rht(x) if rht else x): per 32-block along the axis (32x32 tile with block_2d)
      s = the smallest integer with amax <= elem_max * 2^s (6 for E2M1, 448 for E4M3 with fp8), in [-127, 127];
      elements E2M1 (nearest-even, or stochastic with the key's bits) or E4M3 (nearest-even); a block with NaN or
      Inf decodes to NaN. K a multiple of 32; on whole tensors and shards.              (== numerics.mx)
  xla_fp4_mx_quantize_packed(x: f32|bf16|f16[rows, K], key: u32[]) -> (data: u8[rows, K/2 or K], scales: u8[rows, K/32])
      attrs as xla_fp4_mx_qdq's: its blocks packed (== numerics.packing.pack_mx): E2M1 pairs, the even element in the
      low nibble, or with fp8 E4M3 bytes; E8M0 scales, s + 127, 0xFF for a NaN block. axis 0 as for
      xla_fp4_quantize_packed. Decodes to xla_fp4_mx_qdq's values bit for bit.
  xla_fp4_mx_dequantize_packed(data, scales) -> f32|bf16|f16[rows, K]; attrs fp8: bool     (== numerics.unpack_mx)
  xla_fp4_mx_gemm_packed(a_data, a_scales, b_data, b_scales) -> f32|bf16|f16[M, N]
      attrs emulate, b_transposed (32x32 tiles), fp8: xla_fp4_gemm_packed's product of two packed MX operands, with
      no alpha (the MX formats have no tensor scale). On Blackwell cuBLASLt's VEC32_UE8M0 block-scaled GEMM.
  xla_fp4_telemetry_step() -> i32[]; attrs module: i64, site: i64, every: i64, calls: i64     (side effect)
      counts this call per (module, site, device), on the host: the n-th call (from 0) is in step n // calls, which it
      returns where step % every == 0, else -1 (not recorded). Every device counts the same sequence.
  xla_fp4_telemetry_record(stats: f32[rows, FIELDS] | f32[devices, rows, FIELDS], step: i32[], block: i32[])
      -> i32[] (step); attrs module: i64, site: i64, strict_row: i64                     (side effect)
      puts the rows (numerics.telemetry.FIELDS) in the process's sink (telemetry_sink.h), one device's per GEMM;
      per-device tables (a partitioned program's) are combined first: amax and s_dec their max, the rest their sum;
      fails with FAILED_PRECONDITION when row strict_row (>= 0) has nonzero elements and none quantized nonzero.

Contraction sizes must be multiples of 16; a violated contract fails the call with an INVALID_ARGUMENT error that says
what was wrong. Loading and registration: registry.py; one record per target: targets.py.
"""

import jax
import jax.numpy as jnp
import numpy as np

from xla_fp4.kernels import targets

QDQ_TARGET = targets.QDQ.name
QDQ_WITH_SCALE_TARGET = targets.QDQ_WITH_SCALE.name
RHT_TARGET = targets.RHT.name
BLOCK_AMAX_TARGET = targets.BLOCK_AMAX.name
QUANTIZE_PACKED_TARGET = targets.QUANTIZE_PACKED.name
DEQUANTIZE_PACKED_TARGET = targets.DEQUANTIZE_PACKED.name
GEMM_PACKED_TARGET = targets.GEMM_PACKED.name

# target -> {attribute name: Python type}; bool -> BoolAttr, int -> i64 IntegerAttr. The handlers bind the lists of
# xla_fp4/ffi_targets.h; the extension exports them and a test checks that this is the same (tests/kernels).
ATTRIBUTES = {t.name: dict(t.attributes) for t in targets.ALL}
TARGETS = tuple(ATTRIBUTES)

from xla_fp4.kernels.registry import (  # noqa: F401  (the package's API)
    available, extension, fp4_gemm_supported, info, register, register_all, runtime_ffi_api, status, xla_platform)


def backend_config_attributes(target, attrs):
  """{name: MLIR attribute} of a custom call to `target` (needs an active MLIR context); see the module docstring."""
  want = ATTRIBUTES[target]
  if set(attrs) != set(want):
    raise ValueError(f"{target} takes attributes {sorted(want)}, got {sorted(attrs)}")
  return {name: attribute(target, name, value) for name, value in attrs.items()}


def attribute(target, name, value):
  """The MLIR attribute of `target`'s backend_config attribute `name` (needs an active MLIR context): a BoolAttr for
  a bool attribute, a signless i64 IntegerAttr for an int one, which must be an integer."""
  from jax.extend.mlir import ir
  if ATTRIBUTES[target][name] is bool:
    return ir.BoolAttr.get(bool(value))
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"attribute {name} of {target} must be an integer, got {value!r}")
  return ir.IntegerAttr.get(ir.IntegerType.get_signless(64), int(value))


def custom_call(target, result_types, operands, config, has_side_effect=False, cache=None):
  """A `stablehlo.custom_call` to kernel `target` at the current insertion point (needs an MLIR context); `config`:
  its backend_config attributes (`backend_config_attributes`), or their DictAttr. The call fixes row-major layouts for
  its operands and results: left free, XLA's layout assignment may give one another layout (a result that is
  all-gathered along its last dim gets that dim major), and the kernel would read or write the wrong elements.
  `cache`: a dict that a caller emitting many calls into one module keeps, where the attributes that calls share (a
  list of types' layouts, a target's name) are built once.

  Built as jax.ffi's calls are (jax's mlir.custom_call with a dict backend_config, the same on jax 0.10 and 0.12): an
  empty `backend_config` string, the attributes in `mhlo.backend_config`, which tells XLA the call is typed FFI
  (tests/kernels/test_bindings.py compares the two); built here because jax's helper builds every attribute anew, a
  twentieth of the pass's time on benchmarks/pass_overhead.py's step."""
  from jax._src.lib.mlir.dialects import hlo
  from jax.extend.mlir import ir

  cache = {} if cache is None else cache
  shared = cache.get(("custom_call", target, has_side_effect))
  if shared is None:
    shared = cache[("custom_call", target, has_side_effect)] = dict(
        call_target_name=ir.StringAttr.get(target), has_side_effect=ir.BoolAttr.get(has_side_effect),
        backend_config=ir.StringAttr.get(""),
        api_version=ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 1),
        called_computations=ir.ArrayAttr.get([]))
  attributes = dict(shared, operand_layouts=_row_major([o.type for o in operands], cache),
                    result_layouts=_row_major(result_types, cache))
  op = hlo.CustomCallOp.build_generic(results=result_types, operands=operands, attributes=attributes)
  if not isinstance(config, ir.DictAttr):
    config = ir.DictAttr.get(config)
  op.operation.attributes["mhlo.backend_config"] = config
  return op


def _row_major(types, cache):
  """The layouts attribute of `types` as jax's mlir.custom_call builds it (its operand_layouts), from `cache`."""
  key = tuple(types)
  attr = cache.get(key)
  if attr is None:
    from jax.extend.mlir import ir
    attr = cache[key] = ir.ArrayAttr.get([
        ir.DenseIntElementsAttr.get(np.arange(ir.RankedTensorType(t).rank - 1, -1, -1, dtype=np.int64),
                                    type=ir.IndexType.get()) for t in types])
  return attr


def custom_call_backend_config(target, attrs):
  """The `backend_config` DictionaryAttr of a custom call to `target` (needs an active MLIR context)."""
  from jax.extend.mlir import ir
  return ir.DictAttr.get(backend_config_attributes(target, attrs))


def _call(target, operands, dtype=None, **attrs):
  """Run `target` (a targets.Target) on arrays through jax.ffi.ffi_call, its results shaped by its record."""
  register()
  typed = {name: want(attrs[name]) for name, want in target.attributes.items()}  # bool stays bool, ints int
  results = target.results(operands, typed, dtype)
  call = jax.ffi.ffi_call(target.name, results if len(results) > 1 else results[0])
  return call(*operands, **typed)


def qdq_and_stats(x, s_dec, key=0, *, step=0, axis=-1, block_2d=False, stochastic=False, rht=False, rht_seed=0,
                  four_over_six=False):
  """(xla_fp4_qdq's q * scale, the statistics row of that quantization) with the C++ kernel."""
  return _call(targets.QDQ_AND_STATS, [jnp.asarray(x), _scalar(s_dec, jnp.float32), _scalar(key, jnp.uint32),
                                       _scalar(step, jnp.int32)], axis=axis, block_2d=block_2d, stochastic=stochastic,
               rht=rht, rht_seed=rht_seed, four_over_six=four_over_six)


def output_stats(y, step=0):
  """(zeros of y, elements, 0, ...) with the C++ kernel."""
  return _call(targets.OUTPUT_STATS, [jnp.asarray(y), _scalar(step, jnp.int32)])


def _u8_scales(scales):
  scales = jnp.asarray(scales)
  return jax.lax.bitcast_convert_type(scales, jnp.uint8) if scales.dtype == jnp.float8_e4m3fn else scales


def _scalar(value, dtype):
  return jnp.asarray(value, dtype).reshape(())


def qdq(x, s_dec, key=0, *, axis=-1, block_2d=False, stochastic=False, rht=False, rht_seed=0,
        apply_global_scale=True, four_over_six=False):
  """Fake-quantize x (see the module docstring) with the C++ kernel; the result has x's shape and dtype."""
  return _call(targets.QDQ, [jnp.asarray(x), _scalar(s_dec, jnp.float32), _scalar(key, jnp.uint32)], axis=axis,
               block_2d=block_2d, stochastic=stochastic, rht=rht, rht_seed=rht_seed,
               apply_global_scale=apply_global_scale, four_over_six=four_over_six)


def mx_qdq(x, key=0, *, axis=-1, fp8=False, block_2d=False, stochastic=False, rht=False, rht_seed=0):
  """An OCP MX format's q * scale of x (numerics/mx.py) with the C++ kernel: E4M3 elements with `fp8`, else E2M1."""
  return _call(targets.MX_QDQ, [jnp.asarray(x), _scalar(key, jnp.uint32)], axis=axis, block_2d=block_2d,
               stochastic=stochastic, rht=rht, rht_seed=rht_seed, fp8=fp8)


def qdq_with_scale(x, salt=0, *, axis=-1, block_2d=False, stochastic=False, rht=False, rht_seed=0,
                   four_over_six=False):
  """(q * scale in x's shape and dtype, s_dec) with s_dec and the rounding key measured from x (module docstring)."""
  return _call(targets.QDQ_WITH_SCALE, [jnp.asarray(x)], axis=axis, block_2d=block_2d, stochastic=stochastic,
               rht=rht, rht_seed=rht_seed, salt=salt, four_over_six=four_over_six)


def rht(x, *, axis=-1, seed=0):
  """The random Hadamard transform along `axis`, float32 result."""
  return _call(targets.RHT, [jnp.asarray(x)], axis=axis, rht_seed=seed)


def block_amax(x, *, axis=-1, rht=False, rht_seed=0, digest=False):
  """float32 max |v| per 1x16 block along `axis` (x's shape with the axis divided by 16), and with `digest` the
  uint32 digest per block (a tuple of both); see the module docstring."""
  return _call(targets.BLOCK_AMAX, [jnp.asarray(x)], axis=axis, rht=rht, rht_seed=rht_seed, digest=digest)


def quantize_packed(x, s_dec, key=0, *, axis=1, block_2d=False, stochastic=False, rht=False, rht_seed=0,
                    four_over_six=False):
  """x (rows, K) -> (data uint8 (rows, K/2), scales uint8 (rows, K/16)); see numerics.pack. With axis=0 x is
  (K, rows) and data and scales (K/2, rows), (K/16, rows): the transposes of the packed form of x.T (bit for bit,
  stochastic rounding aside, whose bits follow each element's position in x)."""
  x = jnp.asarray(x)
  if x.ndim != 2 or axis not in (0, 1):
    raise ValueError(f"quantize_packed takes a matrix and K's axis 0 or 1, got shape {x.shape} and axis {axis}")
  return _call(targets.QUANTIZE_PACKED, [x, _scalar(s_dec, jnp.float32), _scalar(key, jnp.uint32)],
               axis=axis, block_2d=block_2d, stochastic=stochastic, rht=rht, rht_seed=rht_seed,
               four_over_six=four_over_six)


def quantize_packed_pair(x, row_s_dec, col_s_dec, row_key=0, col_key=0, *, row_stochastic=False, row_rht=False,
                         col_stochastic=False, col_rht=False, rht_seed=0, four_over_six=False):
  """x (rows, K) -> (row data, row scales, col data, col scales): quantize_packed(x, axis=1) with the row_* recipe and
  quantize_packed(x, axis=0) with the col_* one, from one read of x."""
  x = jnp.asarray(x)
  if x.ndim != 2:
    raise ValueError(f"quantize_packed_pair takes a matrix, got shape {x.shape}")
  return _call(targets.QUANTIZE_PACKED_PAIR, [x, _scalar(row_s_dec, jnp.float32), _scalar(row_key, jnp.uint32),
                                              _scalar(col_s_dec, jnp.float32), _scalar(col_key, jnp.uint32)],
               row_stochastic=row_stochastic, row_rht=row_rht, col_stochastic=col_stochastic, col_rht=col_rht,
               rht_seed=rht_seed, four_over_six=four_over_six)


def quantize_packed_stats(x, s_dec, key=0, *, step=0, axis=1, block_2d=False, stochastic=False, rht=False,
                          rht_seed=0, four_over_six=False):
  """(data, scales, the statistics row of that quantization) with the C++ kernel: quantize_packed's results, and
  where step >= 0 what it did to x (numerics/telemetry.py FIELDS), else zeros."""
  return _call(targets.QUANTIZE_PACKED_STATS, [jnp.asarray(x), _scalar(s_dec, jnp.float32), _scalar(key, jnp.uint32),
                                               _scalar(step, jnp.int32)], axis=axis, block_2d=block_2d,
               stochastic=stochastic, rht=rht, rht_seed=rht_seed, four_over_six=four_over_six)


def dequantize_packed(data, scales, s_dec, *, dtype=jnp.float32):
  """Packed data and (rows, K/16) scales (uint8 or float8_e4m3fn) -> (rows, K) in `dtype`."""
  return _call(targets.DEQUANTIZE_PACKED, [jnp.asarray(data), _u8_scales(scales), _scalar(s_dec, jnp.float32)],
               dtype=dtype)


def gemm_packed(a_data, a_scales, b_data, b_scales, alpha, *, dtype=jnp.float32, b_transposed=False):
  """C (M, N) = alpha * A·Bᵀ of two packed K-major operands, float32 accumulation (the CPU reference FP4 GEMM);
  with b_transposed, b is Bᵀ (K, N) packed along N in 16x16 tiles."""
  return _call(targets.GEMM_PACKED, [jnp.asarray(a_data), _u8_scales(a_scales), jnp.asarray(b_data),
                                     _u8_scales(b_scales), _scalar(alpha, jnp.float32)], dtype=dtype, emulate=False,
               b_transposed=b_transposed)


def mx_quantize_packed(x, key=0, *, axis=1, fp8=False, block_2d=False, stochastic=False, rht=False, rht_seed=0):
  """x (rows, K) -> (data uint8 (rows, K/2), or (rows, K) with `fp8`; E8M0 scales uint8 (rows, K/32)) in an OCP MX
  format (numerics.packing.pack_mx) with the C++ kernel; axis 0 as for quantize_packed."""
  x = jnp.asarray(x)
  if x.ndim != 2 or axis not in (0, 1):
    raise ValueError(f"mx_quantize_packed takes a matrix and K's axis 0 or 1, got shape {x.shape} and axis {axis}")
  return _call(targets.MX_QUANTIZE_PACKED, [x, _scalar(key, jnp.uint32)], axis=axis, block_2d=block_2d,
               stochastic=stochastic, rht=rht, rht_seed=rht_seed, fp8=fp8)


def mx_dequantize_packed(data, scales, *, fp8=False, dtype=jnp.float32):
  """Packed MX data and E8M0 scales (rows, K/32) -> (rows, K) in `dtype`."""
  return _call(targets.MX_DEQUANTIZE_PACKED, [jnp.asarray(data), jnp.asarray(scales)], dtype=dtype, fp8=fp8)


def mx_gemm_packed(a_data, a_scales, b_data, b_scales, *, fp8=False, dtype=jnp.float32, b_transposed=False):
  """C (M, N) = A·Bᵀ of two packed K-major MX operands, float32 accumulation (the CPU reference; cuBLASLt's
  block-scaled GEMM on Blackwell); with b_transposed, b is Bᵀ (K, N) packed along N in 32x32 tiles."""
  return _call(targets.MX_GEMM_PACKED, [jnp.asarray(a_data), jnp.asarray(a_scales), jnp.asarray(b_data),
                                        jnp.asarray(b_scales)], dtype=dtype, emulate=False, b_transposed=b_transposed,
               fp8=fp8)


def ragged_gemm_packed(a_data, a_scales, b_data, b_scales, group_sizes, alpha, *, ragged_k=False, dtype=jnp.float32):
  """The grouped FP4 GEMM (the contract above): C (M, N) of a's groups of rows, or with ragged_k C (G, M, N) of the
  groups of K (the CPU reference; cuBLASLt's FP4 GEMM once per group on CUDA)."""
  return _call(targets.RAGGED_GEMM_PACKED, [jnp.asarray(a_data), _u8_scales(a_scales), jnp.asarray(b_data),
                                            _u8_scales(b_scales), jnp.asarray(group_sizes, jnp.int32),
                                            jnp.asarray(alpha, jnp.float32)], dtype=dtype, ragged_k=ragged_k)
