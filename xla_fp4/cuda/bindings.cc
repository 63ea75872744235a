#include "xla_fp4/cuda/bindings.h"

#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include "xla_fp4/cuda/cuda_handlers.h"
#include "xla_fp4/ffi_targets.h"

namespace xla_fp4::cuda {

namespace nb = nanobind;

void AddCudaBindings(nb::module_& m) {
  m.def("cuda_registrations", [] {
    auto capsule = [](XLA_FFI_Handler* handler) { return nb::capsule(reinterpret_cast<void*>(handler)); };
    nb::dict d;
    d[kQdqTarget] = capsule(XlaFp4QdqCuda);
    d[kQdqWithScaleTarget] = capsule(XlaFp4QdqWithScaleCuda);
    d[kRhtTarget] = capsule(XlaFp4RhtCuda);
    d[kBlockAmaxTarget] = capsule(XlaFp4BlockAmaxCuda);
    d[kQuantizePackedTarget] = capsule(XlaFp4QuantizePackedCuda);
    d[kDequantizePackedTarget] = capsule(XlaFp4DequantizePackedCuda);
    d[kGemmPackedTarget] = capsule(XlaFp4GemmPackedCuda);
    return d;
  }, "Target name -> PyCapsule of the CUDA FFI handler (register with platform='CUDA').");
  m.def("fp4_gemm_supported", &Fp4GemmSupported,
        "(True, '') when cuBLASLt's FP4 GEMM can run on every visible CUDA device (compute capability 10.x, "
        "cuBLASLt >= 12.8); otherwise (False, reason). Initializes the CUDA runtime: call it after JAX has started.");
}

}  // namespace xla_fp4::cuda
