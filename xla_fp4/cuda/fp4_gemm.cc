// xla_fp4_gemm_packed on CUDA: C = (Σ_k (q_a·scale_a)(q_b·scale_b)) · alpha through cuBLASLt's block-scaled FP4 GEMM.
//
// Operands are packed as numerics/packing.py lays them out: a_data (M, K/2) and b_data (N, K/2), both K-major, with
// VEC16_UE4M3 scales (M, K/16) and (N, K/16), which the handler swizzles into cuBLASLt's 128x4 tile layout in scratch
// memory (cuda/packed_kernels.cu SwizzleScales); alpha = s_dec_a·s_dec_b is a device scalar (no host sync).
// cuBLASLt is column-major, so the row-major C (M, N) is computed as the column-major Cᵀ (N, M) = op(B)·A with
// cuBLASLt's "A" = our b (transposed: TN, the only layout FP4 supports) and cuBLASLt's "B" = our a.
//
// Plans (matrix layouts, the heuristic's algorithm, a device zero for beta) are cached per (device, M, N, K, output
// type) in one process-wide, mutex-guarded cache rather than in per-instance FFI state: a transformer has a few GEMM
// shapes repeated over dozens of layers, so call sites share plans and a cuBLASLt handle per device, and nothing needs
// an FFI type registration before compiling. The matmul descriptor carries the per-call scale pointers, so it is built
// per call (host-only, microseconds) to keep concurrent calls from different threads independent.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "xla/ffi/api/ffi.h"
#include "xla_fp4/cuda/cuda_handlers.h"
#include "xla_fp4/cuda/cuda_util.h"
#include "xla_fp4/ffi_targets.h"
#include "xla_fp4/nvfp4_format.h"

namespace xla_fp4::cuda {
namespace {

constexpr size_t kMinCublasLtVersion = 120800;  // cublasLtGetVersion() format: major*10000 + minor*100 + patch
constexpr uint64_t kMaxWorkspaceBytes = 32ull << 20;  // NVIDIA's recommendation for Blackwell

ffi::Error LtStatus(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal, std::string(what) + " failed: " + cublasLtGetStatusString(status));
}

struct DescDeleter {
  void operator()(cublasLtMatmulDescOpaque_t* d) const { cublasLtMatmulDescDestroy(d); }
  void operator()(cublasLtMatrixLayoutOpaque_t* l) const { cublasLtMatrixLayoutDestroy(l); }
  void operator()(cublasLtMatmulPreferenceOpaque_t* p) const { cublasLtMatmulPreferenceDestroy(p); }
};
using MatmulDesc = std::unique_ptr<cublasLtMatmulDescOpaque_t, DescDeleter>;
using Layout = std::unique_ptr<cublasLtMatrixLayoutOpaque_t, DescDeleter>;
using Preference = std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, DescDeleter>;

template <typename T>
ffi::Error SetAttr(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, T value) {
  return LtStatus(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)),
                  "cublasLtMatmulDescSetAttribute");
}

// The descriptor without the scale pointers: used for the heuristic query and, completed, for each call.
ffi::Error MakeMatmulDesc(MatmulDesc& out) {
  cublasLtMatmulDesc_t desc;
  XLA_FP4_RETURN_IF_ERROR(LtStatus(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                                   "cublasLtMatmulDescCreate"));
  out.reset(desc);
  XLA_FP4_RETURN_IF_ERROR(SetAttr(desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T));
  XLA_FP4_RETURN_IF_ERROR(SetAttr(desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N));
  XLA_FP4_RETURN_IF_ERROR(SetAttr(desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, int32_t{CUBLASLT_POINTER_MODE_DEVICE}));
  const int32_t vec16 = CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3;
  XLA_FP4_RETURN_IF_ERROR(SetAttr(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, vec16));
  return SetAttr(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, vec16);
}

ffi::Error MakeLayout(cudaDataType type, int64_t rows, int64_t cols, Layout& out) {
  cublasLtMatrixLayout_t layout;
  XLA_FP4_RETURN_IF_ERROR(LtStatus(cublasLtMatrixLayoutCreate(&layout, type, rows, cols, /*ld=*/rows),
                                   "cublasLtMatrixLayoutCreate"));
  out.reset(layout);
  return ffi::Error::Success();
}

struct Plan {
  Layout a, b, c;  // cuBLASLt's A = our b (K x N), B = our a (K x M), C = D (N x M), all column-major
  cublasLtMatmulAlgo_t algo;
  size_t workspace_bytes;
  float* beta_zero = nullptr;  // POINTER_MODE_DEVICE applies to beta too
};

using PlanKey = std::tuple<int, int64_t, int64_t, int64_t, cudaDataType>;  // device, M, N, K, output type

// Runs f with `device` current (cuBLASLt's handle and heuristic, and cudaMalloc, follow the current device), then
// restores the caller's device. Inside an XLA custom call the stream's device is normally current already.
template <typename F>
ffi::Error OnDevice(int device, F&& f) {
  int previous;
  XLA_FP4_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&previous), "cudaGetDevice"));
  if (previous == device) return f();
  XLA_FP4_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device), "cudaSetDevice"));
  ffi::Error status = f();
  cudaSetDevice(previous);
  return status;
}

class PlanCache {
 public:
  // The cache is never destroyed: tearing down cuBLASLt and device memory in static destructors races with the CUDA
  // driver's own shutdown.
  static PlanCache& Get() {
    static PlanCache* cache = new PlanCache();
    return *cache;
  }

  // The device's handle and the plan for `key`, built on first use (then once, synchronizing `stream`).
  ffi::Error Lookup(const PlanKey& key, cudaStream_t stream, cublasLtHandle_t& handle, const Plan*& plan) {
    std::lock_guard<std::mutex> lock(mu_);
    const int device = std::get<0>(key);
    return OnDevice(device, [&]() -> ffi::Error {
      cublasLtHandle_t& device_handle = handles_[device];
      if (device_handle == nullptr) {
        XLA_FP4_RETURN_IF_ERROR(LtStatus(cublasLtCreate(&device_handle), "cublasLtCreate"));
      }
      handle = device_handle;
      auto it = plans_.find(key);
      if (it == plans_.end()) {
        auto built = std::make_unique<Plan>();
        XLA_FP4_RETURN_IF_ERROR(Build(key, handle, stream, *built));
        it = plans_.emplace(key, std::move(built)).first;
      }
      plan = it->second.get();
      return ffi::Error::Success();
    });
  }

 private:
  static ffi::Error Build(const PlanKey& key, cublasLtHandle_t handle, cudaStream_t stream, Plan& plan) {
    auto [device, m, n, k, out_type] = key;
    XLA_FP4_RETURN_IF_ERROR(MakeLayout(CUDA_R_4F_E2M1, k, n, plan.a));
    XLA_FP4_RETURN_IF_ERROR(MakeLayout(CUDA_R_4F_E2M1, k, m, plan.b));
    XLA_FP4_RETURN_IF_ERROR(MakeLayout(out_type, n, m, plan.c));
    MatmulDesc desc;
    XLA_FP4_RETURN_IF_ERROR(MakeMatmulDesc(desc));
    cublasLtMatmulPreference_t raw_pref;
    XLA_FP4_RETURN_IF_ERROR(LtStatus(cublasLtMatmulPreferenceCreate(&raw_pref), "cublasLtMatmulPreferenceCreate"));
    Preference pref(raw_pref);
    XLA_FP4_RETURN_IF_ERROR(LtStatus(
        cublasLtMatmulPreferenceSetAttribute(raw_pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kMaxWorkspaceBytes,
                                             sizeof(kMaxWorkspaceBytes)),
        "cublasLtMatmulPreferenceSetAttribute"));
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;
    XLA_FP4_RETURN_IF_ERROR(LtStatus(cublasLtMatmulAlgoGetHeuristic(handle, desc.get(), plan.a.get(), plan.b.get(),
                                                                    plan.c.get(), plan.c.get(), raw_pref, 1, &result,
                                                                    &found),
                                     "cublasLtMatmulAlgoGetHeuristic"));
    if (found == 0) {
      return ffi::Error(ffi::ErrorCode::kUnimplemented,
                        "cuBLASLt has no FP4 GEMM algorithm for M=" + std::to_string(m) + ", N=" + std::to_string(n) +
                            ", K=" + std::to_string(k) + " on device " + std::to_string(device) +
                            "; keep this GEMM in the emulated backend");
    }
    plan.algo = result.algo;
    plan.workspace_bytes = result.workspaceSize;
    // Plans are few (one per GEMM shape and device), so one small allocation and one synchronization each are cheap;
    // the sync makes the zero visible to every stream that later uses the plan.
    XLA_FP4_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&plan.beta_zero, sizeof(float)), "cudaMalloc(beta)"));
    XLA_FP4_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(plan.beta_zero, 0, sizeof(float), stream), "cudaMemsetAsync"));
    return CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }

  std::mutex mu_;
  std::map<int, cublasLtHandle_t> handles_;
  std::map<PlanKey, std::unique_ptr<Plan>> plans_;
};

ffi::Error GemmPacked(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer a_data,
                      ffi::AnyBuffer a_scales, ffi::AnyBuffer b_data, ffi::AnyBuffer b_scales,
                      ffi::AnyBuffer alpha, ffi::Result<ffi::AnyBuffer> out,
                      bool /*emulate: partitioned shards use XLA's dot instead; the numbers are the same*/) {
  auto a_dims = a_data.dimensions(), b_dims = b_data.dimensions(), c_dims = out->dimensions();
  if (a_data.element_type() != ffi::U8 || b_data.element_type() != ffi::U8 || a_dims.size() != 2 ||
      b_dims.size() != 2 || c_dims.size() != 2 || a_dims[1] != b_dims[1]) {
    return InvalidArgument("xla_fp4_gemm_packed takes uint8 a_data (M, K/2) and b_data (N, K/2) and returns (M, N)");
  }
  const int64_t m = a_dims[0], n = b_dims[0], k = 2 * a_dims[1];
  if (c_dims[0] != m || c_dims[1] != n) return InvalidArgument("xla_fp4_gemm_packed: the result must be (M, N)");
  XLA_FP4_RETURN_IF_ERROR(CheckScalar(alpha, ffi::F32, "xla_fp4_gemm_packed: alpha"));
  cudaDataType out_type;
  switch (out->element_type()) {
    case ffi::F32: out_type = CUDA_R_32F; break;
    case ffi::BF16: out_type = CUDA_R_16BF; break;
    case ffi::F16: out_type = CUDA_R_16F; break;
    default: return InvalidArgument("xla_fp4_gemm_packed returns float32, bfloat16 or float16");
  }
  XLA_FP4_RETURN_IF_ERROR(CheckPackedScales(a_scales, m, k, "xla_fp4_gemm_packed: a_scales"));
  XLA_FP4_RETURN_IF_ERROR(CheckPackedScales(b_scales, n, k, "xla_fp4_gemm_packed: b_scales"));
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) return CudaStatus(cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream), "cudaMemsetAsync");

  int device;
  XLA_FP4_RETURN_IF_ERROR(CudaStatus(cudaStreamGetDevice(stream, &device), "cudaStreamGetDevice"));
  cublasLtHandle_t handle = nullptr;
  const Plan* plan = nullptr;
  XLA_FP4_RETURN_IF_ERROR(PlanCache::Get().Lookup({device, m, n, k, out_type}, stream, handle, plan));
  // The operands' (rows, K/16) scales, laid out as cuBLASLt reads them (128x4 tiles), in scratch memory.
  const int64_t a_swizzled_bytes = PaddedScaleCount(m, k), b_swizzled_bytes = PaddedScaleCount(n, k);
  std::optional<void*> swizzled = scratch.Allocate(a_swizzled_bytes + b_swizzled_bytes, 256);
  if (!swizzled) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, "xla_fp4_gemm_packed: no memory for the swizzled scales");
  }
  uint8_t* a_swizzled = static_cast<uint8_t*>(*swizzled);
  uint8_t* b_swizzled = a_swizzled + a_swizzled_bytes;
  XLA_FP4_RETURN_IF_ERROR(
      SwizzleScales(stream, static_cast<const uint8_t*>(a_scales.untyped_data()), m, k, a_swizzled));
  XLA_FP4_RETURN_IF_ERROR(
      SwizzleScales(stream, static_cast<const uint8_t*>(b_scales.untyped_data()), n, k, b_swizzled));
  MatmulDesc desc;
  XLA_FP4_RETURN_IF_ERROR(MakeMatmulDesc(desc));
  XLA_FP4_RETURN_IF_ERROR(SetAttr(desc.get(), CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                  static_cast<const void*>(b_swizzled)));
  XLA_FP4_RETURN_IF_ERROR(SetAttr(desc.get(), CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                  static_cast<const void*>(a_swizzled)));
  void* workspace = nullptr;
  if (plan->workspace_bytes > 0) {
    std::optional<void*> allocated = scratch.Allocate(plan->workspace_bytes, 256);
    if (!allocated) {
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        "xla_fp4_gemm_packed: no memory for the cuBLASLt workspace");
    }
    workspace = *allocated;
  }
  return LtStatus(cublasLtMatmul(handle, desc.get(), alpha.untyped_data(), b_data.untyped_data(), plan->a.get(),
                                 a_data.untyped_data(), plan->b.get(), plan->beta_zero, out->untyped_data(),
                                 plan->c.get(), out->untyped_data(), plan->c.get(), &plan->algo, workspace,
                                 plan->workspace_bytes, stream),
                  "cublasLtMatmul");
}

}  // namespace

std::pair<bool, std::string> Fp4GemmSupported() {
  const size_t version = cublasLtGetVersion();
  if (version < kMinCublasLtVersion) {
    return {false, "the FP4 GEMM needs cuBLASLt >= 12.8, found " + std::to_string(version / 10000) + "." +
                       std::to_string(version / 100 % 100)};
  }
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0) {
    return {false, std::string("no CUDA device: ") + (e == cudaSuccess ? "none visible" : cudaGetErrorString(e))};
  }
  for (int d = 0; d < count; ++d) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, d);
    if (major != 10) {
      return {false, "the FP4 GEMM needs compute capability 10.x (Blackwell B200/GB200/B300); device " +
                         std::to_string(d) + " is " + std::to_string(major) + "." + std::to_string(minor)};
    }
  }
  return {true, ""};
}

}  // namespace xla_fp4::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4GemmPackedCuda, xla_fp4::cuda::GemmPacked,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()
                                  .Arg<xla::ffi::AnyBuffer>()  // a_data, uint8 (M, K/2)
                                  .Arg<xla::ffi::AnyBuffer>()  // a_scales, uint8 (M, K/16)
                                  .Arg<xla::ffi::AnyBuffer>()  // b_data, uint8 (N, K/2)
                                  .Arg<xla::ffi::AnyBuffer>()  // b_scales, uint8 (N, K/16)
                                  .Arg<xla::ffi::AnyBuffer>()  // alpha = s_dec_a * s_dec_b (float32 scalar)
                                  .Ret<xla::ffi::AnyBuffer>()  // C (M, N), float32, bfloat16 or float16
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_GEMM_PACKED_ATTRIBUTES));
