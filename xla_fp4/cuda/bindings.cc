// The Python extension xla_fp4._xla_fp4_cuda (built by cmake/cuda.cmake): the CUDA FFI handlers as PyCapsules, to be
// registered for platform "CUDA" under the same target names as the CPU handlers, and the run-time gate of the FP4
// GEMM. A module of its own so that importing the CPU kernels never needs the CUDA libraries.
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <stdexcept>
#include <string>

#include "xla/ffi/api/c_api.h"
#include "xla_fp4/cuda/cuda_handlers.h"
#include "xla_fp4/ffi_registrations.h"
#include "xla_fp4/telemetry_bindings.h"

namespace nb = nanobind;

namespace {

using Bytes = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Device memory holding a copy of host bytes, for the GEMM's helper kernels' tests.
class DeviceBytes {
 public:
  explicit DeviceBytes(size_t n) : n_(n) { Check(cudaMalloc(&p_, n > 0 ? n : 1), "cudaMalloc"); }
  DeviceBytes(const uint8_t* host, size_t n) : DeviceBytes(n) {
    Check(cudaMemcpy(p_, host, n, cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  ~DeviceBytes() { cudaFree(p_); }
  uint8_t* get() const { return static_cast<uint8_t*>(p_); }
  void CopyTo(Bytes out) const {
    if (out.shape(0) != n_) throw nb::value_error("the output has the wrong size");
    Check(cudaMemcpy(out.data(), p_, n_, cudaMemcpyDeviceToHost), "cudaMemcpy");  // waits for the kernel
  }

 private:
  void* p_ = nullptr;
  size_t n_;
};

void Run(const xla::ffi::Error& e) {
  if (e.failure()) throw std::runtime_error(e.message());
}

}  // namespace

NB_MODULE(_xla_fp4_cuda, m) {
  m.doc() = "xla-fp4 CUDA kernels (XLA FFI handlers) and the cuBLASLt FP4 GEMM.";
  m.def("registrations", [] { return XLA_FP4_REGISTRATIONS(CUDA); },
        "Target name -> PyCapsule of the CUDA FFI handler (register with platform='CUDA').");
  m.attr("ffi_api_version") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  xla_fp4::telemetry::DefineBindings(m);
  m.def("fp4_gemm_supported", &xla_fp4::cuda::Fp4GemmSupported,
        "(True, '') when cuBLASLt's FP4 GEMM can run on every visible CUDA device (compute capability 10.x, "
        "cuBLASLt >= 12.8); otherwise (False, reason). Initializes the CUDA runtime: call it after JAX has started.");
  // The FP4 GEMM's helper kernels (packed_kernels.cu), which run on any CUDA device, for their bit-for-bit tests
  // against numerics/packing.py (tests/kernels/test_cuda_kernels.py): host bytes in, host bytes out.
  m.def("swizzle_scales", [](Bytes scales, int64_t rows, int64_t k, int64_t stride, Bytes out, int64_t block) {
    DeviceBytes in(scales.data(), scales.shape(0)), swizzled(out.shape(0));
    Run(xla_fp4::cuda::SwizzleScales(nullptr, in.get(), rows, k, swizzled.get(), stride, block));
    swizzled.CopyTo(out);
  }, nb::arg("scales"), nb::arg("rows"), nb::arg("k"), nb::arg("stride"), nb::arg("out"), nb::arg("block") = 16,
  "SwizzleScales of (rows, k/block) scales with row stride `stride` (0: k/block) into `out`.");
  m.def("transpose_tiles", [](Bytes data, Bytes scales, int64_t k, int64_t n, Bytes out_data, Bytes out_scales,
                              int64_t per_byte, int64_t block) {
    DeviceBytes d(data.data(), data.shape(0)), s(scales.data(), scales.shape(0));
    DeviceBytes od(out_data.shape(0)), os(out_scales.shape(0));
    Run(xla_fp4::cuda::TransposeTiles(nullptr, d.get(), s.get(), k, n, od.get(), os.get(),
                                      xla_fp4::PackedLayout{per_byte, block}));
    od.CopyTo(out_data);
    os.CopyTo(out_scales);
  }, nb::arg("data"), nb::arg("scales"), nb::arg("k"), nb::arg("n"), nb::arg("out_data"), nb::arg("out_scales"),
  nb::arg("per_byte") = 2, nb::arg("block") = 16,
  "TransposeTiles: B's packed (n, k/per_byte) codes and (n, k/block) scales from B transposed's (k, n/per_byte) and "
  "(k, n/block).");
}
