// The XLA FFI custom-call targets, listed once: their names and their attributes. The CPU and the CUDA handlers bind
// their attributes from these lists (XLA_FP4_BIND_ATTRIBUTES), the extension exports them (`attributes()`), and a
// test checks the records of python/xla_fp4/kernels/targets.py against that export.
#ifndef XLA_FP4_FFI_TARGETS_H_
#define XLA_FP4_FFI_TARGETS_H_

#include <cstdint>

// A(type, name): each target's attributes, in the order of its handlers' parameters.
// four_over_six: each block's scale to 4 or to 6, whichever decodes it better (arXiv 2512.02010; numerics/nvfp4.py);
// the quantizers that measure s_dec themselves take amax / 1536 with it.
#define XLA_FP4_QDQ_ATTRIBUTES(A)                                                                                   \
  A(int64_t, axis) A(bool, block_2d) A(bool, stochastic) A(bool, rht) A(int64_t, rht_seed) A(bool, apply_global_scale) \
  A(bool, four_over_six)
#define XLA_FP4_QDQ_AND_STATS_ATTRIBUTES(A) \
  A(int64_t, axis) A(bool, block_2d) A(bool, stochastic) A(bool, rht) A(int64_t, rht_seed) A(bool, four_over_six)
#define XLA_FP4_QDQ_WITH_SCALE_ATTRIBUTES(A)                                                                 \
  A(int64_t, axis) A(bool, block_2d) A(bool, stochastic) A(bool, rht) A(int64_t, rht_seed) A(int64_t, salt) \
  A(bool, four_over_six)
#define XLA_FP4_RHT_ATTRIBUTES(A) A(int64_t, axis) A(int64_t, rht_seed)
// digest: a second result, uint32 shaped like the maxima: each block's wrapping sum of its elements' bits (16-bit
// floats zero-extended), whose sum is x's digest (the stochastic-rounding key's), read in the same pass over x.
#define XLA_FP4_BLOCK_AMAX_ATTRIBUTES(A) A(int64_t, axis) A(bool, rht) A(int64_t, rht_seed) A(bool, digest)
#define XLA_FP4_QUANTIZE_PACKED_ATTRIBUTES(A) \
  A(int64_t, axis) A(bool, block_2d) A(bool, stochastic) A(bool, rht) A(int64_t, rht_seed) A(bool, four_over_six)
// The pair quantizer: one read of x (rows, K) makes both packed copies a GEMM pair needs, the row-wise one along K
// (axis 1) and the column-wise one along rows (axis 0), each with its own rounding and RHT (1x16 blocks: a weight in
// 16x16 tiles is packed once anyway).
#define XLA_FP4_QUANTIZE_PACKED_PAIR_ATTRIBUTES(A)                                                      \
  A(bool, row_stochastic) A(bool, row_rht) A(bool, col_stochastic) A(bool, col_rht) A(int64_t, rht_seed) \
  A(bool, four_over_six)
// emulate: how XLA's partitioner runs the GEMM on shards (sharding/partition.py): the dequantized operands through
// XLA's dot (the emulate backend of a partitioned program) instead of the FP4 GEMM. The handlers compute the same
// numbers either way. b_transposed: b is given as B's transpose packed along N, b_data (K, N/2) and b_scales
// (K, N/16), with scales uniform over 16x16 tiles (a weight in 2D blocks: the forward's packed copy, which a dgrad
// reads along the other axis instead of quantizing and gathering the weight again); B = decode(b)ᵀ.
#define XLA_FP4_GEMM_PACKED_ATTRIBUTES(A) A(bool, emulate) A(bool, b_transposed)
// ragged_k: the groups split the contraction (an expert layer's wgrad, C (G, M, N)) instead of a's rows (its forward
// and dgrad, C (M, N)).
#define XLA_FP4_RAGGED_GEMM_PACKED_ATTRIBUTES(A) A(bool, ragged_k)
#define XLA_FP4_TELEMETRY_STEP_ATTRIBUTES(A) A(int64_t, module) A(int64_t, site) A(int64_t, every) A(int64_t, calls)
// parts: how many devices record parts of the GEMM's statistics (a partitioned program in one process; the sink sums
// them), 1 where the record's table is whole (or every device's, gathered: [devices, rows, FIELDS]).
#define XLA_FP4_TELEMETRY_RECORD_ATTRIBUTES(A) \
  A(int64_t, module) A(int64_t, site) A(int64_t, strict_row) A(int64_t, parts)
// fp8: E4M3 elements (MXFP8), else E2M1 (MXFP4).
#define XLA_FP4_MX_QDQ_ATTRIBUTES(A) \
  A(int64_t, axis) A(bool, block_2d) A(bool, stochastic) A(bool, rht) A(int64_t, rht_seed) A(bool, fp8)
// The packed MX formats (numerics/packing.py): codes and E8M0 scales per 32, as xla_fp4_quantize_packed,
// xla_fp4_dequantize_packed and xla_fp4_gemm_packed lay out NVFP4's, with no tensor scale (no s_dec, no alpha).
#define XLA_FP4_MX_QUANTIZE_PACKED_ATTRIBUTES(A) XLA_FP4_MX_QDQ_ATTRIBUTES(A)
#define XLA_FP4_MX_DEQUANTIZE_PACKED_ATTRIBUTES(A) A(bool, fp8)
#define XLA_FP4_MX_GEMM_PACKED_ATTRIBUTES(A) A(bool, emulate) A(bool, b_transposed) A(bool, fp8)
#define XLA_FP4_NO_ATTRIBUTES(A)

// X(constant, handler stem, name, attribute list): every target, listed once. The name constants (kQdqTarget, ...) and
// every platform's handler declarations (XLA_FP4_DECLARE_HANDLERS) come from it; a platform's handler of target `stem`
// is XlaFp4<stem><Platform> (XlaFp4QdqCpu, XlaFp4QdqCuda); ffi_registrations.h builds the Python dicts from it.
#define XLA_FP4_FOR_EACH_TARGET(X)                                                                             \
  X(kQdqTarget, Qdq, "xla_fp4_qdq", XLA_FP4_QDQ_ATTRIBUTES)                                                    \
  X(kQdqWithScaleTarget, QdqWithScale, "xla_fp4_qdq_with_scale", XLA_FP4_QDQ_WITH_SCALE_ATTRIBUTES)            \
  X(kQdqWithScaleStatsTarget, QdqWithScaleStats, "xla_fp4_qdq_with_scale_stats",                               \
    XLA_FP4_QDQ_WITH_SCALE_ATTRIBUTES)                                                                         \
  X(kQdqAndStatsTarget, QdqAndStats, "xla_fp4_qdq_and_stats", XLA_FP4_QDQ_AND_STATS_ATTRIBUTES)                \
  X(kOutputStatsTarget, OutputStats, "xla_fp4_output_stats", XLA_FP4_NO_ATTRIBUTES)                            \
  X(kRhtTarget, Rht, "xla_fp4_rht", XLA_FP4_RHT_ATTRIBUTES)                                                    \
  X(kBlockAmaxTarget, BlockAmax, "xla_fp4_block_amax", XLA_FP4_BLOCK_AMAX_ATTRIBUTES)                          \
  X(kQuantizePackedTarget, QuantizePacked, "xla_fp4_quantize_packed", XLA_FP4_QUANTIZE_PACKED_ATTRIBUTES)      \
  X(kQuantizePackedStatsTarget, QuantizePackedStats, "xla_fp4_quantize_packed_stats",                          \
    XLA_FP4_QUANTIZE_PACKED_ATTRIBUTES)                                                                        \
  X(kQuantizePackedPairTarget, QuantizePackedPair, "xla_fp4_quantize_packed_pair",                           \
    XLA_FP4_QUANTIZE_PACKED_PAIR_ATTRIBUTES)                                                                   \
  X(kDequantizePackedTarget, DequantizePacked, "xla_fp4_dequantize_packed", XLA_FP4_NO_ATTRIBUTES)             \
  X(kGemmPackedTarget, GemmPacked, "xla_fp4_gemm_packed", XLA_FP4_GEMM_PACKED_ATTRIBUTES)                      \
  X(kRaggedGemmPackedTarget, RaggedGemmPacked, "xla_fp4_ragged_gemm_packed",                                  \
    XLA_FP4_RAGGED_GEMM_PACKED_ATTRIBUTES)                                                                     \
  X(kTelemetryStepTarget, TelemetryStep, "xla_fp4_telemetry_step", XLA_FP4_TELEMETRY_STEP_ATTRIBUTES)          \
  X(kTelemetryRecordTarget, TelemetryRecord, "xla_fp4_telemetry_record", XLA_FP4_TELEMETRY_RECORD_ATTRIBUTES)  \
  X(kMxQdqTarget, MxQdq, "xla_fp4_mx_qdq", XLA_FP4_MX_QDQ_ATTRIBUTES)                                          \
  X(kMxQuantizePackedTarget, MxQuantizePacked, "xla_fp4_mx_quantize_packed",                                  \
    XLA_FP4_MX_QUANTIZE_PACKED_ATTRIBUTES)                                                                     \
  X(kMxDequantizePackedTarget, MxDequantizePacked, "xla_fp4_mx_dequantize_packed",                            \
    XLA_FP4_MX_DEQUANTIZE_PACKED_ATTRIBUTES)                                                                   \
  X(kMxGemmPackedTarget, MxGemmPacked, "xla_fp4_mx_gemm_packed", XLA_FP4_MX_GEMM_PACKED_ATTRIBUTES)

// XLA_FP4_DECLARE_HANDLERS(Cpu) / (Cuda): every target's handler on that platform (include xla/ffi/api/ffi.h first).
#define XLA_FP4_DECLARE_HANDLER_Cpu_(constant, stem, name, attributes) XLA_FFI_DECLARE_HANDLER_SYMBOL(XlaFp4##stem##Cpu);
#define XLA_FP4_DECLARE_HANDLER_Cuda_(constant, stem, name, attributes) \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(XlaFp4##stem##Cuda);
#define XLA_FP4_DECLARE_HANDLERS(PLATFORM) XLA_FP4_FOR_EACH_TARGET(XLA_FP4_DECLARE_HANDLER_##PLATFORM##_)

// Appends an attribute list to an `ffi::Ffi::Bind()` chain: `.Attr<int64_t>("axis").Attr<bool>("block_2d")...`.
#define XLA_FP4_BIND_ATTRIBUTE_(type, name) .Attr<type>(#name)
#define XLA_FP4_BIND_ATTRIBUTES(LIST) LIST(XLA_FP4_BIND_ATTRIBUTE_)

namespace xla_fp4 {

#define XLA_FP4_NAME_CONSTANT_(constant, stem, name, attributes) inline constexpr char constant[] = name;
XLA_FP4_FOR_EACH_TARGET(XLA_FP4_NAME_CONSTANT_)
#undef XLA_FP4_NAME_CONSTANT_

}  // namespace xla_fp4

#endif  // XLA_FP4_FFI_TARGETS_H_
