// The Python extension xla_fp4._xla_fp4_ext: the CPU FFI handlers as PyCapsules (registered by
// python/xla_fp4/kernels/__init__.py), the build's facts the registration checks, the telemetry sink's records, plus
// element-wise access to the format helpers of nvfp4_format.h for the tests (submodule `format`). The CUDA handlers are a module of their own
// (cuda/bindings.cc).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>

#include "xla_fp4/cpu_kernels.h"
#include "xla_fp4/ffi_registrations.h"
#include "xla_fp4/nvfp4_format.h"
#include "xla_fp4/telemetry_bindings.h"
#include "xla/ffi/api/c_api.h"
#ifdef XLA_FP4_HAS_BUILD_INFO
#include "xla_fp4/build_info.h"  // XLA_FP4_CUDA_STATUS, written by CMakeLists.txt
#else
#define XLA_FP4_CUDA_STATUS "not built: this build (Bazel) builds the CPU kernels only"
#endif

namespace nb = nanobind;

namespace {

template <typename T>
using Vector = nb::ndarray<T, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// out[i] = f(in[i]...) for 1-D arrays of one length: the format helpers applied by the tests.
template <typename Out, typename... In, typename F>
void Map(F f, Vector<Out> out, Vector<const In>... in) {
  if (((in.shape(0) != out.shape(0)) || ...)) throw nb::value_error("all arrays must have the same length");
  for (size_t i = 0; i < out.shape(0); ++i) out(i) = f(in(i)...);
}

}  // namespace

NB_MODULE(_xla_fp4_ext, m) {
  m.doc() = "xla-fp4 C++ kernels (XLA FFI handlers).";
  m.def("attributes", [] { return XLA_FP4_ATTRIBUTES(); },
        "Target name -> {attribute: \"int\" or \"bool\"}: the attributes every handler binds (ffi_targets.h).");
  m.def("registrations", [] { return XLA_FP4_REGISTRATIONS(CPU); },
        "Target name -> PyCapsule of the CPU FFI handler.");
  // The XLA FFI API the handlers were compiled against: an XLA whose API is older rejects them when its backend starts.
  m.attr("ffi_api_version") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  m.attr("cuda_build") = XLA_FP4_CUDA_STATUS;  // "built for <archs> ..." or "not built: <why>" (CMakeLists.txt)
  xla_fp4::telemetry::DefineBindings(m);

  nb::module_ f = m.def_submodule("format", "nvfp4_format.h helpers, element-wise into a caller-provided output.");
  f.attr("INV_E2M1_MAX") = xla_fp4::kInvE2M1Max;
  f.attr("INV_GLOBAL_SCALE_DIVISOR") = xla_fp4::kInvGlobalScaleDivisor;
  f.def("round_e2m1_nearest", [](Vector<const float> v, Vector<float> out) {
    Map<float, float>(xla_fp4::RoundE2M1Nearest, out, v);
  });
  f.def("round_e2m1_stochastic", [](Vector<const float> v, Vector<const float> u, Vector<float> out) {
    Map<float, float, float>(xla_fp4::RoundE2M1Stochastic, out, v, u);
  });
  f.def("e2m1_code", [](Vector<const float> v, Vector<uint8_t> out) { Map<uint8_t, float>(xla_fp4::E2M1Code, out, v); });
  f.def("e2m1_decode", [](Vector<const uint8_t> c, Vector<float> out) {
    Map<float, uint8_t>(xla_fp4::E2M1Decode, out, c);
  });
  f.def("e4m3_encode", [](Vector<const float> v, Vector<uint8_t> out) { Map<uint8_t, float>(xla_fp4::E4M3Encode, out, v); });
  f.def("e4m3_decode", [](Vector<const uint8_t> c, Vector<float> out) {
    Map<float, uint8_t>(xla_fp4::E4M3Decode, out, c);
  });
  f.def("mix32", [](Vector<const uint32_t> x, Vector<uint32_t> out) { Map<uint32_t, uint32_t>(xla_fp4::Mix32, out, x); });
  f.def("uniform_from_bits", [](Vector<const uint32_t> x, Vector<float> out) {
    Map<float, uint32_t>(xla_fp4::UniformFromBits, out, x);
  });
  // The recipe's steps in the order the CUDA kernels take them (qdq_kernels.cu: the amax kernel, QuantizeKernel with
  // the qdq sink; MxQdqKernel), nearest rounding, no RHT, over the 1x16 (MX: 1x32) blocks of a float32 vector, in the
  // caller's floating-point mode: outside an XLA executable nothing flushes subnormals, as on a GPU. The subnormal
  // rule's test compares them with the CPU kernels under XLA's FTZ/DAZ (tests/kernels/test_fp_mode_rule.py).
  f.def("qdq_blocks", [](Vector<const float> x, Vector<float> out) {
    const size_t n = x.shape(0);
    if (out.shape(0) != n || n % xla_fp4::kBlock) throw nb::value_error("x and out: one length, a multiple of 16");
    uint32_t amax_bits = 0;
    for (size_t i = 0; i < n; ++i) {
      const uint32_t m = xla_fp4::MagnitudeBits(xla_fp4::FlushSubnormal(x(i)));
      amax_bits = m > amax_bits ? m : amax_bits;
    }
    const xla_fp4::TensorScale ts = xla_fp4::MakeTensorScale(xla_fp4::GlobalDecodeScale(amax_bits));
    for (size_t b = 0; b < n; b += xla_fp4::kBlock) {
      float v[xla_fp4::kBlock], amax = 0.0f;
      for (int j = 0; j < xla_fp4::kBlock; ++j) {
        v[j] = xla_fp4::FlushSubnormal(x(b + j));
        const float a = xla_fp4::Abs(v[j]);
        amax = xla_fp4::MaxNan(amax, a);
      }
      const xla_fp4::BlockScale bs = xla_fp4::MakeBlockScale(amax, ts);
      for (int j = 0; j < xla_fp4::kBlock; ++j) {
        out(b + j) = xla_fp4::DecodeElement(xla_fp4::QuantizeElement(v[j], bs, false, 0.0f), bs.scale, ts.s_dec);
      }
    }
  });
  f.def("mx_qdq_blocks", [](Vector<const float> x, bool fp8, Vector<float> out) {
    const size_t n = x.shape(0);
    if (out.shape(0) != n || n % xla_fp4::kMxBlock) throw nb::value_error("x and out: one length, a multiple of 32");
    const xla_fp4::Recipe recipe(false, false, false, 0);
    for (size_t b = 0; b < n; b += xla_fp4::kMxBlock) {
      float v[xla_fp4::kMxBlock], amax;
      for (int j = 0; j < xla_fp4::kMxBlock; ++j) v[j] = xla_fp4::FlushSubnormal(x(b + j));
      const bool bad = xla_fp4::MxPrepareBlock(v, recipe, &amax);
      const xla_fp4::MxScale ms = xla_fp4::MakeMxScale(amax, bad, fp8);
      for (int j = 0; j < xla_fp4::kMxBlock; ++j) {
        const float q = xla_fp4::MxRoundElement(v[j] * ms.inverse, fp8, false, 0.0f);
        out(b + j) = xla_fp4::MxDecodeElement(q, ms.scale);
      }
    }
  });
  f.def("rht_signs", [](uint32_t seed, Vector<float> out) {
    if (out.shape(0) != xla_fp4::kBlock) throw nb::value_error("out must have 16 elements");
    for (int j = 0; j < xla_fp4::kBlock; ++j) out(j) = xla_fp4::RhtSign(seed, j);
  });
}
