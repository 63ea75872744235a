// Host-side helpers shared by the CUDA FFI handlers.
#ifndef XLA_FP4_CUDA_CUDA_UTIL_H_
#define XLA_FP4_CUDA_CUDA_UTIL_H_

#include <cuda_runtime.h>

#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_fp4/ffi_checks.h"  // CheckScalar, CheckSeed, CheckU32Attribute, CheckPackedScales
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

}  // namespace xla_fp4::cuda

#endif  // XLA_FP4_CUDA_CUDA_UTIL_H_
