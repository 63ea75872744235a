// The CUDA FFI handlers of xla-fp4 (registered for platform "CUDA" under the same target names as the CPU handlers)
// and the run-time gate of the FP4 GEMM. Built into xla_fp4._xla_fp4_cuda (cmake/cuda.cmake).
#ifndef XLA_FP4_CUDA_CUDA_HANDLERS_H_
#define XLA_FP4_CUDA_CUDA_HANDLERS_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"
#include "xla_fp4/ffi_targets.h"

XLA_FP4_DECLARE_HANDLERS(Cuda)  // XlaFp4<stem>Cuda for every target of ffi_targets.h

namespace xla_fp4::cuda {

// (true, "") when cuBLASLt's FP4 GEMM can run on every visible device: cuBLASLt >= 12.8 and compute capability 10.x.
// Otherwise (false, why not).
std::pair<bool, std::string> Fp4GemmSupported();

// `out` (numerics/packing.py's swizzled layout, PaddedScaleCount(rows, k) bytes) = the (rows, K/16) scales laid out as
// cuBLASLt's FP4 GEMM reads them: 128x4 tiles, the padding zero. Enqueued on `stream`. `stride`: the scales' row
// stride in bytes where they are columns of a wider matrix (a group's range of K), 0 where they are K/16 apart.
xla::ffi::Error SwizzleScales(cudaStream_t stream, const uint8_t* scales, int64_t rows, int64_t k, uint8_t* out,
                              int64_t stride = 0);

// B's packed codes (n, k/2) and scales (n, k/16) from Bᵀ's (k, n/2) and (k, n/16), whose scales are uniform over
// 16x16 tiles (xla_fp4_gemm_packed's b_transposed). Enqueued on `stream`.
xla::ffi::Error TransposeTiles(cudaStream_t stream, const uint8_t* data, const uint8_t* scales, int64_t k, int64_t n,
                               uint8_t* out_data, uint8_t* out_scales);

}  // namespace xla_fp4::cuda

#endif  // XLA_FP4_CUDA_CUDA_HANDLERS_H_
