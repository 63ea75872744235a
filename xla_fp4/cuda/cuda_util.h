// Host-side helpers shared by the CUDA FFI handlers.
#ifndef XLA_FP4_CUDA_CUDA_UTIL_H_
#define XLA_FP4_CUDA_CUDA_UTIL_H_

#include <cuda_runtime.h>

#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_fp4/nvfp4_format.h"

namespace xla_fp4::cuda {

namespace ffi = xla::ffi;

#define XLA_FP4_RETURN_IF_ERROR(expr)         \
  do {                                        \
    if (ffi::Error e = (expr); e.failure()) { \
      return e;                               \
    }                                         \
  } while (0)

inline ffi::Error CudaStatus(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal, std::string(what) + ": " + cudaGetErrorString(status));
}

// Kernel launches report bad configurations only through cudaGetLastError.
inline ffi::Error LaunchStatus(const char* kernel) { return CudaStatus(cudaGetLastError(), kernel); }

inline ffi::Error InvalidArgument(const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, message);
}

constexpr int kThreadsPerBlock = 256;  // a multiple of 32: 2D tiles reduce over aligned half-warps

inline unsigned GridSize(int64_t threads) {
  return static_cast<unsigned>((threads + kThreadsPerBlock - 1) / kThreadsPerBlock);
}

// Scales are uint8 E4M3 codes in the swizzled layout, as the CPU kernels take them.
inline ffi::Error CheckScales(const ffi::AnyBuffer& scales, int64_t rows, int64_t k, const std::string& what) {
  if (scales.element_type() != ffi::U8 || static_cast<int64_t>(scales.element_count()) != PaddedScaleCount(rows, k)) {
    return InvalidArgument(what + " must be uint8 with " + std::to_string(PaddedScaleCount(rows, k)) +
                           " entries (the swizzled layout of " + std::to_string(rows) + " rows and K = " +
                           std::to_string(k) + ", numerics.padded_scale_shape)");
  }
  return ffi::Error::Success();
}

inline ffi::Error CheckScalar(const ffi::AnyBuffer& b, ffi::DataType dtype, const std::string& what) {
  if (b.element_type() != dtype || b.dimensions().size() != 0) {
    return InvalidArgument(what + " must be a " + (dtype == ffi::F32 ? "float32" : "uint32") + " scalar (rank 0)");
  }
  return ffi::Error::Success();
}

inline ffi::Error CheckSeed(int64_t seed) {
  if (seed < 0 || seed > int64_t{0xFFFFFFFF}) {
    return InvalidArgument("rht_seed must be in [0, 2**32), got " + std::to_string(seed));
  }
  return ffi::Error::Success();
}

}  // namespace xla_fp4::cuda

#endif  // XLA_FP4_CUDA_CUDA_UTIL_H_
