// Names of the XLA FFI custom-call targets. python/xla_fp4/kernels.py holds the same strings (a test checks that the
// extension registers exactly those).
#ifndef XLA_FP4_FFI_TARGETS_H_
#define XLA_FP4_FFI_TARGETS_H_

namespace xla_fp4 {

inline constexpr char kQdqTarget[] = "xla_fp4_qdq";
inline constexpr char kQdqWithScaleTarget[] = "xla_fp4_qdq_with_scale";
inline constexpr char kRhtTarget[] = "xla_fp4_rht";
inline constexpr char kBlockAmaxTarget[] = "xla_fp4_block_amax";
inline constexpr char kQuantizePackedTarget[] = "xla_fp4_quantize_packed";
inline constexpr char kDequantizePackedTarget[] = "xla_fp4_dequantize_packed";
inline constexpr char kGemmPackedTarget[] = "xla_fp4_gemm_packed";

}  // namespace xla_fp4

#endif  // XLA_FP4_FFI_TARGETS_H_
