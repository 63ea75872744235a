// The CUDA part of the xla_fp4._xla_fp4_ext module. extension.cc calls AddCudaBindings when the extension is built
// with XLA_FP4_ENABLE_CUDA=ON (cmake/cuda.cmake defines XLA_FP4_WITH_CUDA).
#ifndef XLA_FP4_CUDA_BINDINGS_H_
#define XLA_FP4_CUDA_BINDINGS_H_

#include <nanobind/nanobind.h>

namespace xla_fp4::cuda {

// Adds cuda_registrations() -> {target name: PyCapsule of the CUDA FFI handler} and
// fp4_gemm_supported() -> (bool, reason).
void AddCudaBindings(nanobind::module_& m);

}  // namespace xla_fp4::cuda

#endif  // XLA_FP4_CUDA_BINDINGS_H_
