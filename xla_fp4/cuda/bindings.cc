// The Python extension xla_fp4._xla_fp4_cuda (built by cmake/cuda.cmake): the CUDA FFI handlers as PyCapsules, to be
// registered for platform "CUDA" under the same target names as the CPU handlers, and the run-time gate of the FP4
// GEMM. A module of its own so that importing the CPU kernels never needs the CUDA libraries.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include "xla/ffi/api/c_api.h"
#include "xla_fp4/cuda/cuda_handlers.h"
#include "xla_fp4/ffi_registrations.h"
#include "xla_fp4/telemetry_bindings.h"

namespace nb = nanobind;

NB_MODULE(_xla_fp4_cuda, m) {
  m.doc() = "xla-fp4 CUDA kernels (XLA FFI handlers) and the cuBLASLt FP4 GEMM.";
  m.def("registrations", [] { return XLA_FP4_REGISTRATIONS(CUDA); },
        "Target name -> PyCapsule of the CUDA FFI handler (register with platform='CUDA').");
  m.attr("ffi_api_version") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  xla_fp4::telemetry::DefineBindings(m);
  m.def("fp4_gemm_supported", &xla_fp4::cuda::Fp4GemmSupported,
        "(True, '') when cuBLASLt's FP4 GEMM can run on every visible CUDA device (compute capability 10.x, "
        "cuBLASLt >= 12.8); otherwise (False, reason). Initializes the CUDA runtime: call it after JAX has started.");
}
