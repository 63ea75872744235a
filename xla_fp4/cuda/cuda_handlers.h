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
#include "xla_fp4/nvfp4_format.h"

XLA_FP4_DECLARE_HANDLERS(Cuda)  // XlaFp4<stem>Cuda for every target of ffi_targets.h

namespace xla_fp4::cuda {

// (true, "") when cuBLASLt's FP4 GEMM can run on every visible device: cuBLASLt >= 12.8 and compute capability 10.x.
// Otherwise (false, why not).
std::pair<bool, std::string> Fp4GemmSupported();

// `out` (numerics/packing.py's swizzled layout, PaddedScaleCount(rows, k, block) bytes) = the (rows, K/block) scales
// laid out as cuBLASLt's block-scaled GEMM reads them: 128x4 tiles, the padding zero. Enqueued on `stream`. `stride`:
// the scales' row stride in bytes where they are columns of a wider matrix (a group's range of K), 0 where they are
// K/block apart. `block`: 16 (NVFP4) or 32 (the MX formats).
xla::ffi::Error SwizzleScales(cudaStream_t stream, const uint8_t* scales, int64_t rows, int64_t k, uint8_t* out,
                              int64_t stride = 0, int64_t block = kBlock);

// B's packed codes (n, k/per_byte) and scales (n, k/block) from Bᵀ's (k, n/per_byte) and (k, n/block), whose scales
// are uniform over block x block tiles (the GEMMs' b_transposed). Enqueued on `stream`.
xla::ffi::Error TransposeTiles(cudaStream_t stream, const uint8_t* data, const uint8_t* scales, int64_t k, int64_t n,
                               uint8_t* out_data, uint8_t* out_scales, const PackedLayout& layout = kNvfp4Packed);

}  // namespace xla_fp4::cuda

#endif  // XLA_FP4_CUDA_CUDA_HANDLERS_H_
