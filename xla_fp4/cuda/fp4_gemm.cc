// xla_fp4_gemm_packed on CUDA: C = (Σ_k (q_a·scale_a)(q_b·scale_b)) · alpha through cuBLASLt's block-scaled FP4 GEMM.
//
// Operands are packed as numerics/packing.py lays them out: a_data (M, K/2) and b_data (N, K/2), both K-major, with
// VEC16_UE4M3 scales (M, K/16) and (N, K/16), which the handler swizzles into cuBLASLt's 128x4 tile layout in scratch
// memory (cuda/packed_kernels.cu SwizzleScales); alpha = s_dec_a·s_dec_b is a device scalar (no host sync).
// cuBLASLt is column-major, so the row-major C (M, N) is computed as the column-major Cᵀ (N, M) = op(B)·A with
// cuBLASLt's "A" = our b (transposed: TN, the only layout FP4 supports) and cuBLASLt's "B" = our a.
//
// xla_fp4_mx_gemm_packed is the same GEMM in the OCP MX formats: E2M1 (MXFP4) or E4M3 (MXFP8) codes with E8M0 scales
// per 32 (VEC32_UE8M0, swizzled alike) and no tensor scale (alpha is a device one).
//
// xla_fp4_ragged_gemm_packed (expert GEMMs: ffi_checks.h CheckRaggedGemmPacked) runs the same GEMM once per group: on
// a group's rows of a (its forward and dgrad) or on a group's range of K (its wgrad: the operands' columns, so the
// layouts' leading dimension is the whole K and the scales are swizzled from a strided range). The group sizes live
// on the device and the loop runs on the host, so the handler copies them and waits for the stream: one host
// synchronization per call. It must: the cuBLASLt this project builds against (CUDA 13.0) batches only GEMMs of one
// M, N and K (strided or pointer-array batches); a grouped GEMM that reads per-group sizes on the device would
// remove it.
//
// Algorithms are chosen once per shape class and device, in one process-wide, mutex-guarded cache rather than in
// per-instance FFI state: a transformer has a few GEMM shapes repeated over dozens of layers, so call sites share them
// and a cuBLASLt handle per device, and nothing needs an FFI type registration before compiling. A dense GEMM's class
// is its exact shape. A group's M changes every step with the routing, so its class rounds M up to a power of two,
// and its pointers' alignment is what every group of the call is guaranteed (the base pointer's and the per-row
// stride's), not the group's own: the class's algorithm is checked against the group's exact layouts
// (cublasLtMatmulAlgoCheck, host only), and only where it does not apply is the exact shape queried (those entries
// are bounded). The cache holds algorithms by value; the matrix layouts and the matmul descriptor (which carries the
// per-call scale pointers) are built per call (host-only, microseconds), so concurrent calls stay independent. Beta's
// device zero is one per device. So a new shape class costs a heuristic query on the host, and no allocation or
// stream synchronization.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

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

// What cuBLASLt multiplies: the packed format's element type, its block scales' mode and its storage geometry.
// NVFP4: E2M1 codes with E4M3 scales per 16 (VEC16_UE4M3); the MX formats: E2M1 (MXFP4) or E4M3 (MXFP8) codes with
// E8M0 scales per 32 (VEC32_UE8M0), whose swizzled layout is NVFP4's with blocks of 32.
struct GemmFormat {
  cudaDataType element;
  int32_t scale_mode;
  PackedLayout layout;
};
constexpr GemmFormat kNvfp4Gemm{CUDA_R_4F_E2M1, CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3, kNvfp4Packed};
GemmFormat MxGemm(bool fp8) {
  return {fp8 ? CUDA_R_8F_E4M3 : CUDA_R_4F_E2M1, CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0, MxPacked(fp8)};
}

// The descriptor without the scale pointers: used for the heuristic query and, completed, for each call.
ffi::Error MakeMatmulDesc(const GemmFormat& format, MatmulDesc& out) {
  cublasLtMatmulDesc_t desc;
  XLA_FP4_RETURN_IF_ERROR(LtStatus(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                                   "cublasLtMatmulDescCreate"));
  out.reset(desc);
  XLA_FP4_RETURN_IF_ERROR(SetAttr(desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T));
  XLA_FP4_RETURN_IF_ERROR(SetAttr(desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N));
  XLA_FP4_RETURN_IF_ERROR(SetAttr(desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, int32_t{CUBLASLT_POINTER_MODE_DEVICE}));
  XLA_FP4_RETURN_IF_ERROR(SetAttr(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, format.scale_mode));
  return SetAttr(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, format.scale_mode);
}

ffi::Error MakeLayout(cudaDataType type, int64_t rows, int64_t cols, int64_t ld, Layout& out) {
  cublasLtMatrixLayout_t layout;
  XLA_FP4_RETURN_IF_ERROR(LtStatus(cublasLtMatrixLayoutCreate(&layout, type, rows, cols, ld),
                                   "cublasLtMatrixLayoutCreate"));
  out.reset(layout);
  return ffi::Error::Success();
}

// The matrix layouts of one GEMM: cuBLASLt's A = our b (K x N), B = our a (K x M), C = D (N x M), all column-major.
struct Layouts {
  Layout a, b, c;
};

ffi::Error MakeLayouts(cudaDataType element, int64_t m, int64_t n, int64_t k, cudaDataType out_type, int64_t lda,
                       int64_t ldb, Layouts& out) {
  XLA_FP4_RETURN_IF_ERROR(MakeLayout(element, k, n, ldb, out.a));
  XLA_FP4_RETURN_IF_ERROR(MakeLayout(element, k, m, lda, out.b));
  return MakeLayout(out_type, n, m, n, out.c);
}

struct Plan {
  cublasLtMatmulAlgo_t algo;
  size_t workspace_bytes;
};

// A shape class: device, the operands' element type (E2M1 or E4M3) and scale mode, M (a group's rounded up), N, K,
// output type, our a's and b's row strides (elements), and the alignments (bytes) the class's pointers are guaranteed
// for a, b and C.
struct PlanKey {
  int device;
  cudaDataType element;
  int32_t scale_mode;
  int64_t m, n, k;
  cudaDataType out_type;
  int64_t lda, ldb;
  uint32_t a_alignment, b_alignment, c_alignment;
  auto Tie() const {
    return std::tie(device, element, scale_mode, m, n, k, out_type, lda, ldb, a_alignment, b_alignment, c_alignment);
  }
  GemmFormat Format() const { return {element, scale_mode, {}}; }
  bool operator<(const PlanKey& o) const { return Tie() < o.Tie(); }
};

// The largest power of two (at most 256, what cuBLASLt's heuristic assumes by default) that divides p's address.
uint32_t Alignment(const void* p) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(p);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

// The alignment every pointer base + i * stride_bytes (i >= 0) has.
uint32_t GuaranteedAlignment(const void* base, int64_t stride_bytes) {
  uint32_t alignment = Alignment(base);
  while (alignment > 1 && stride_bytes % alignment != 0) alignment /= 2;
  return alignment;
}

// A group's M (or K) class: the next power of two, at least 128.
int64_t GroupRowsClass(int64_t m) {
  int64_t c = 128;
  while (c < m) c *= 2;
  return c;
}

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

// A device's cuBLASLt handle, the device zero that beta points at (POINTER_MODE_DEVICE applies to beta too) and the
// one that the MX GEMMs' alpha points at.
struct DeviceContext {
  cublasLtHandle_t handle = nullptr;
  float* beta_zero = nullptr;
  float* one = nullptr;  // the MX GEMMs' alpha: no tensor scale (beta_zero + 1)
};

class PlanCache {
 public:
  // The cache is never destroyed: tearing down cuBLASLt and device memory in static destructors races with the CUDA
  // driver's own shutdown.
  static PlanCache& Get() {
    static PlanCache* cache = new PlanCache();
    return *cache;
  }

  // The device's handle and beta zero, made on the device's first GEMM (its one allocation and synchronization).
  ffi::Error Device(int device, cudaStream_t stream, DeviceContext& out) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = devices_.find(device);
    if (it == devices_.end()) {
      DeviceContext made;  // kept only once complete: a failed start is retried by the next call
      XLA_FP4_RETURN_IF_ERROR(OnDevice(device, [&]() -> ffi::Error {
        XLA_FP4_RETURN_IF_ERROR(LtStatus(cublasLtCreate(&made.handle), "cublasLtCreate"));
        XLA_FP4_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&made.beta_zero, 2 * sizeof(float)), "cudaMalloc(beta)"));
        made.one = made.beta_zero + 1;
        const float constants[2] = {0.0f, 1.0f};
        XLA_FP4_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(made.beta_zero, constants, sizeof(constants),
                                                           cudaMemcpyHostToDevice, stream),
                                           "cudaMemcpyAsync"));
        // Once per device: makes the zero visible to every stream that later uses it.
        return CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      }));
      it = devices_.emplace(device, made).first;
    }
    out = it->second;
    return ffi::Error::Success();
  }

  // The algorithm for a GEMM with `layouts` in shape class `key`: the class's, where cuBLASLt accepts it for these
  // layouts, else the exact shape's (`exact`).
  ffi::Error Lookup(const PlanKey& key, const PlanKey& exact, cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                    const Layouts& layouts, Plan& plan) {
    std::lock_guard<std::mutex> lock(mu_);
    return OnDevice(key.device, [&]() -> ffi::Error {
      XLA_FP4_RETURN_IF_ERROR(Find(key, handle, plan));
      if (key.Tie() == exact.Tie()) return ffi::Error::Success();
      cublasLtMatmulHeuristicResult_t check;
      if (cublasLtMatmulAlgoCheck(handle, desc, layouts.a.get(), layouts.b.get(), layouts.c.get(), layouts.c.get(),
                                  &plan.algo, &check) == CUBLAS_STATUS_SUCCESS &&
          check.workspaceSize <= kMaxWorkspaceBytes) {
        plan.workspace_bytes = check.workspaceSize;
        return ffi::Error::Success();
      }
      if (exact_.size() >= kMaxExactPlans) exact_.clear();  // plans are values: nothing refers to them
      return Find(exact, handle, plan, &exact_);
    });
  }

 private:
  static constexpr size_t kMaxExactPlans = 4096;

  ffi::Error Find(const PlanKey& key, cublasLtHandle_t handle, Plan& plan, std::map<PlanKey, Plan>* cache = nullptr) {
    std::map<PlanKey, Plan>& plans = cache != nullptr ? *cache : classes_;
    auto it = plans.find(key);
    if (it == plans.end()) {
      Plan built;
      XLA_FP4_RETURN_IF_ERROR(Build(key, handle, built));
      it = plans.emplace(key, built).first;
    }
    plan = it->second;
    return ffi::Error::Success();
  }

  static ffi::Error Build(const PlanKey& key, cublasLtHandle_t handle, Plan& plan) {
    Layouts layouts;
    XLA_FP4_RETURN_IF_ERROR(MakeLayouts(key.element, key.m, key.n, key.k, key.out_type, key.lda, key.ldb, layouts));
    MatmulDesc desc;
    XLA_FP4_RETURN_IF_ERROR(MakeMatmulDesc(key.Format(), desc));
    cublasLtMatmulPreference_t raw_pref;
    XLA_FP4_RETURN_IF_ERROR(LtStatus(cublasLtMatmulPreferenceCreate(&raw_pref), "cublasLtMatmulPreferenceCreate"));
    Preference pref(raw_pref);
    XLA_FP4_RETURN_IF_ERROR(LtStatus(
        cublasLtMatmulPreferenceSetAttribute(raw_pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kMaxWorkspaceBytes,
                                             sizeof(kMaxWorkspaceBytes)),
        "cublasLtMatmulPreferenceSetAttribute"));
    // cuBLASLt's A is our b and its B our a; C and D are the same buffer.
    for (auto [attr, bytes] : {std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.b_alignment},
                               std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.a_alignment},
                               std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.c_alignment},
                               std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.c_alignment}}) {
      XLA_FP4_RETURN_IF_ERROR(LtStatus(cublasLtMatmulPreferenceSetAttribute(raw_pref, attr, &bytes, sizeof(bytes)),
                                       "cublasLtMatmulPreferenceSetAttribute"));
    }
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;
    XLA_FP4_RETURN_IF_ERROR(LtStatus(cublasLtMatmulAlgoGetHeuristic(handle, desc.get(), layouts.a.get(),
                                                                    layouts.b.get(), layouts.c.get(), layouts.c.get(),
                                                                    raw_pref, 1, &result, &found),
                                     "cublasLtMatmulAlgoGetHeuristic"));
    if (found == 0) {
      return ffi::Error(ffi::ErrorCode::kUnimplemented,
                        "cuBLASLt has no block-scaled GEMM algorithm for M=" + std::to_string(key.m) + ", N=" +
                            std::to_string(key.n) + ", K=" + std::to_string(key.k) + " on device " +
                            std::to_string(key.device) + "; keep this GEMM in the emulated backend");
    }
    plan.algo = result.algo;
    plan.workspace_bytes = result.workspaceSize;
    return ffi::Error::Success();
  }

  std::mutex mu_;
  std::map<int, DeviceContext> devices_;
  std::map<PlanKey, Plan> classes_;  // bounded by the program's shape classes
  std::map<PlanKey, Plan> exact_;    // the few exact shapes whose class's algorithm did not apply
};

ffi::Error OutputType(ffi::DataType type, const char* target, cudaDataType* out) {
  switch (type) {
    case ffi::F32: *out = CUDA_R_32F; return ffi::Error::Success();
    case ffi::BF16: *out = CUDA_R_16BF; return ffi::Error::Success();
    case ffi::F16: *out = CUDA_R_16F; return ffi::Error::Success();
    default: return InvalidArgument(std::string(target) + " returns float32, bfloat16 or float16");
  }
}

// One FP4 GEMM: C (m, n) row-major = alpha · A·Bᵀ, A (m, k) and B (n, k) packed K-major with row strides lda and ldb
// (elements) and scales (m, k/16) and (n, k/16) with row strides a_scale_stride and b_scale_stride (bytes).
struct Fp4GemmCall {
  const uint8_t* a;
  int64_t lda;
  const uint8_t* a_scales;
  int64_t a_scale_stride;
  const uint8_t* b;
  int64_t ldb;
  const uint8_t* b_scales;
  int64_t b_scale_stride;
  const float* alpha;  // on the device
  void* c;
  int64_t m, n, k;
  GemmFormat format = kNvfp4Gemm;

  PlanKey Exact(int device, cudaDataType out_type) const {
    return {device, format.element, format.scale_mode, m, n, k, out_type, lda, ldb, Alignment(a), Alignment(b),
            Alignment(c)};
  }
  int64_t SwizzledBytes() const {
    return PaddedScaleCount(m, k, format.layout.block) + PaddedScaleCount(n, k, format.layout.block);
  }
};

// A call's layouts and algorithm, chosen before its scratch is allocated.
struct Prepared {
  Layouts layouts;
  Plan plan;
};

// Prepares `call` in shape class `key` (PlanCache::Lookup).
ffi::Error Prepare(const DeviceContext& device, const PlanKey& key, cudaDataType out_type, const Fp4GemmCall& call,
                   Prepared& out) {
  XLA_FP4_RETURN_IF_ERROR(
      MakeLayouts(call.format.element, call.m, call.n, call.k, out_type, call.lda, call.ldb, out.layouts));
  MatmulDesc desc;
  XLA_FP4_RETURN_IF_ERROR(MakeMatmulDesc(call.format, desc));
  return PlanCache::Get().Lookup(key, call.Exact(key.device, out_type), device.handle, desc.get(), out.layouts,
                                 out.plan);
}

// Enqueues `call`: its scales swizzled into `swizzled` (call.SwizzledBytes()), then cuBLASLt's GEMM.
ffi::Error RunFp4Gemm(cudaStream_t stream, const DeviceContext& device, const Fp4GemmCall& call, const Prepared& p,
                      uint8_t* swizzled, void* workspace) {
  const int64_t block = call.format.layout.block;
  uint8_t* a_swizzled = swizzled;
  uint8_t* b_swizzled = swizzled + PaddedScaleCount(call.m, call.k, block);
  XLA_FP4_RETURN_IF_ERROR(
      SwizzleScales(stream, call.a_scales, call.m, call.k, a_swizzled, call.a_scale_stride, block));
  XLA_FP4_RETURN_IF_ERROR(
      SwizzleScales(stream, call.b_scales, call.n, call.k, b_swizzled, call.b_scale_stride, block));
  MatmulDesc desc;
  XLA_FP4_RETURN_IF_ERROR(MakeMatmulDesc(call.format, desc));
  XLA_FP4_RETURN_IF_ERROR(SetAttr(desc.get(), CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                  static_cast<const void*>(b_swizzled)));
  XLA_FP4_RETURN_IF_ERROR(SetAttr(desc.get(), CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                  static_cast<const void*>(a_swizzled)));
  return LtStatus(cublasLtMatmul(device.handle, desc.get(), call.alpha, call.b, p.layouts.a.get(), call.a,
                                 p.layouts.b.get(), device.beta_zero, call.c, p.layouts.c.get(), call.c,
                                 p.layouts.c.get(), &p.plan.algo, workspace, p.plan.workspace_bytes, stream),
                  "cublasLtMatmul");
}

// Scratch memory for the swizzled scales and the workspace of the largest plan.
ffi::Error AllocateScratch(ffi::ScratchAllocator& scratch, int64_t swizzled_bytes, size_t workspace_bytes,
                           const char* target, uint8_t** swizzled, void** workspace) {
  std::optional<void*> s = scratch.Allocate(std::max<int64_t>(swizzled_bytes, 1), 256);
  if (!s) return ffi::Error(ffi::ErrorCode::kResourceExhausted, std::string(target) + ": no memory for the scales");
  *swizzled = static_cast<uint8_t*>(*s);
  *workspace = nullptr;
  if (workspace_bytes > 0) {
    std::optional<void*> w = scratch.Allocate(workspace_bytes, 256);
    if (!w) {
      return ffi::Error(ffi::ErrorCode::kResourceExhausted, std::string(target) + ": no memory for the workspace");
    }
    *workspace = *w;
  }
  return ffi::Error::Success();
}

// The dense GEMM of either format: alpha on the device (NVFP4's s_dec_a * s_dec_b), or null for the MX formats.
ffi::Error DenseGemm(cudaStream_t stream, ffi::ScratchAllocator& scratch, ffi::AnyBuffer& a_data,
                     ffi::AnyBuffer& a_scales, ffi::AnyBuffer& b_data, ffi::AnyBuffer& b_scales,
                     const ffi::AnyBuffer* alpha, ffi::AnyBuffer& out, bool b_transposed, const GemmFormat& format,
                     const char* target) {
  int64_t m, n, k;
  XLA_FP4_RETURN_IF_ERROR(
      CheckGemmPacked(a_data, a_scales, b_data, b_scales, alpha, out, b_transposed, &m, &n, &k, format.layout));
  cudaDataType out_type;
  XLA_FP4_RETURN_IF_ERROR(OutputType(out.element_type(), target, &out_type));
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) return CudaStatus(cudaMemsetAsync(out.untyped_data(), 0, out.size_bytes(), stream), "cudaMemsetAsync");

  const PackedLayout layout = format.layout;
  const uint8_t* b = static_cast<const uint8_t*>(b_data.untyped_data());
  const uint8_t* b_scales_ptr = static_cast<const uint8_t*>(b_scales.untyped_data());
  if (b_transposed) {  // cuBLASLt's block-scaled GEMM reads both operands K-major: B's tiles, read along the other axis
    const int64_t data_bytes = n * (k / layout.per_byte);
    std::optional<void*> t = scratch.Allocate(data_bytes + n * (k / layout.block), 256);
    if (!t) return ffi::Error(ffi::ErrorCode::kResourceExhausted, std::string(target) + ": no memory for B's tiles");
    uint8_t* data = static_cast<uint8_t*>(*t);
    XLA_FP4_RETURN_IF_ERROR(TransposeTiles(stream, b, b_scales_ptr, k, n, data, data + data_bytes, layout));
    b = data;
    b_scales_ptr = data + data_bytes;
  }
  int device;
  XLA_FP4_RETURN_IF_ERROR(CudaStatus(cudaStreamGetDevice(stream, &device), "cudaStreamGetDevice"));
  DeviceContext context;
  XLA_FP4_RETURN_IF_ERROR(PlanCache::Get().Device(device, stream, context));
  const float* alpha_ptr = alpha != nullptr ? static_cast<const float*>(alpha->untyped_data()) : context.one;
  const Fp4GemmCall call{static_cast<const uint8_t*>(a_data.untyped_data()), k,
                         static_cast<const uint8_t*>(a_scales.untyped_data()), 0, b, k, b_scales_ptr, 0, alpha_ptr,
                         out.untyped_data(), m, n, k, format};
  Prepared prepared;
  XLA_FP4_RETURN_IF_ERROR(Prepare(context, call.Exact(device, out_type), out_type, call, prepared));
  uint8_t* swizzled = nullptr;
  void* workspace = nullptr;
  XLA_FP4_RETURN_IF_ERROR(
      AllocateScratch(scratch, call.SwizzledBytes(), prepared.plan.workspace_bytes, target, &swizzled, &workspace));
  return RunFp4Gemm(stream, context, call, prepared, swizzled, workspace);
}

ffi::Error GemmPacked(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer a_data,
                      ffi::AnyBuffer a_scales, ffi::AnyBuffer b_data, ffi::AnyBuffer b_scales,
                      ffi::AnyBuffer alpha, ffi::Result<ffi::AnyBuffer> out,
                      bool /*emulate: partitioned shards use XLA's dot instead; the numbers are the same*/,
                      bool b_transposed) {
  return DenseGemm(stream, scratch, a_data, a_scales, b_data, b_scales, &alpha, *out, b_transposed, kNvfp4Gemm,
                   "xla_fp4_gemm_packed");
}

// The MX formats' GEMM: E8M0 scales per 32 and no tensor scale (alpha one).
ffi::Error MxGemmPacked(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer a_data,
                        ffi::AnyBuffer a_scales, ffi::AnyBuffer b_data, ffi::AnyBuffer b_scales,
                        ffi::Result<ffi::AnyBuffer> out, bool /*emulate*/, bool b_transposed, bool fp8) {
  return DenseGemm(stream, scratch, a_data, a_scales, b_data, b_scales, nullptr, *out, b_transposed, MxGemm(fp8),
                   "xla_fp4_mx_gemm_packed");
}

ffi::Error RaggedGemmPacked(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer a_data,
                            ffi::AnyBuffer a_scales, ffi::AnyBuffer b_data, ffi::AnyBuffer b_scales,
                            ffi::AnyBuffer group_sizes, ffi::AnyBuffer alpha, ffi::Result<ffi::AnyBuffer> out,
                            bool ragged_k) {
  RaggedGemmShape s;
  XLA_FP4_RETURN_IF_ERROR(
      CheckRaggedGemmPacked(a_data, a_scales, b_data, b_scales, group_sizes, alpha, *out, ragged_k, &s));
  cudaDataType out_type;
  XLA_FP4_RETURN_IF_ERROR(OutputType(out->element_type(), "xla_fp4_ragged_gemm_packed", &out_type));
  // Rows outside every group, and groups without rows or K, are zero; cuBLASLt writes the rest (beta = 0).
  XLA_FP4_RETURN_IF_ERROR(
      CudaStatus(cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream), "cudaMemsetAsync"));
  if (s.groups == 0 || s.m == 0 || s.n == 0 || s.k == 0) return ffi::Error::Success();
  std::vector<int32_t> sizes(s.groups);
  XLA_FP4_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(sizes.data(), group_sizes.untyped_data(),
                                                     s.groups * sizeof(int32_t), cudaMemcpyDeviceToHost, stream),
                                     "cudaMemcpyAsync(group_sizes)"));
  XLA_FP4_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize"));
  std::vector<int64_t> begin(s.groups), end(s.groups);
  XLA_FP4_RETURN_IF_ERROR(
      RaggedGroupRanges(sizes.data(), s.groups, ragged_k ? s.k : s.m, ragged_k, begin.data(), end.data()));

  const auto* a = static_cast<const uint8_t*>(a_data.untyped_data());
  const auto* as = static_cast<const uint8_t*>(a_scales.untyped_data());
  const auto* b = static_cast<const uint8_t*>(b_data.untyped_data());
  const auto* bs = static_cast<const uint8_t*>(b_scales.untyped_data());
  const auto* al = static_cast<const float*>(alpha.untyped_data());
  auto* c = static_cast<uint8_t*>(out->untyped_data());
  const int64_t element_bytes = ffi::ByteWidth(out->element_type());
  std::vector<Fp4GemmCall> calls;
  for (int64_t g = 0; g < s.groups; ++g) {
    const int64_t size = end[g] - begin[g];
    if (size == 0) continue;
    if (ragged_k) {
      if (size % 32 != 0) {
        return InvalidArgument("xla_fp4_ragged_gemm_packed: cuBLASLt's FP4 GEMM needs each group's K a multiple of "
                               "32; group " + std::to_string(g) + " has " + std::to_string(size) +
                               " (numerics/grouped.py ragged_contracting_packed pads groups to 32)");
      }
      calls.push_back({a + begin[g] / 2, s.k, as + begin[g] / kBlock, s.k / kBlock, b + begin[g] / 2, s.k,
                       bs + begin[g] / kBlock, s.k / kBlock, al + g, c + g * s.m * s.n * element_bytes, s.m, s.n,
                       size});
    } else {
      calls.push_back({a + begin[g] * (s.k / 2), s.k, as + begin[g] * (s.k / kBlock), 0,
                       b + g * s.n * (s.k / 2), s.k, bs + g * s.n * (s.k / kBlock), 0, al + g,
                       c + begin[g] * s.n * element_bytes, size, s.n, s.k});
    }
  }
  if (calls.empty()) return ffi::Error::Success();
  int device;
  XLA_FP4_RETURN_IF_ERROR(CudaStatus(cudaStreamGetDevice(stream, &device), "cudaStreamGetDevice"));
  DeviceContext context;
  XLA_FP4_RETURN_IF_ERROR(PlanCache::Get().Device(device, stream, context));
  // The call's shape class: what every group shares. A group of rows starts at any row, a group of K at a multiple of
  // 32 (grouped.py pads them), so the pointers are guaranteed the base's alignment within the per-group stride's.
  const int64_t a_step = ragged_k ? 16 : s.k / 2, b_step = ragged_k ? 16 : s.n * (s.k / 2);
  const int64_t c_step = (ragged_k ? s.m : 1) * s.n * element_bytes;
  const uint32_t a_alignment = GuaranteedAlignment(a, a_step), b_alignment = GuaranteedAlignment(b, b_step);
  const uint32_t c_alignment = GuaranteedAlignment(c, c_step);
  std::vector<Prepared> prepared(calls.size());
  int64_t swizzled_bytes = 0;
  size_t workspace_bytes = 0;
  for (size_t i = 0; i < calls.size(); ++i) {
    const Fp4GemmCall& call = calls[i];
    // A group's rows (or its K, within the whole K its layouts stride over) rounded up.
    const int64_t m = ragged_k ? call.m : GroupRowsClass(call.m);
    const int64_t k = ragged_k ? std::min(GroupRowsClass(call.k), s.k) : call.k;
    const PlanKey key{device, call.format.element, call.format.scale_mode, m, call.n, k, out_type, call.lda, call.ldb,
                      a_alignment, b_alignment, c_alignment};
    XLA_FP4_RETURN_IF_ERROR(Prepare(context, key, out_type, call, prepared[i]));
    swizzled_bytes = std::max(swizzled_bytes, call.SwizzledBytes());
    workspace_bytes = std::max(workspace_bytes, prepared[i].plan.workspace_bytes);
  }
  // One scratch buffer serves every group: the stream runs a group's swizzle after the previous group's GEMM.
  uint8_t* swizzled = nullptr;
  void* workspace = nullptr;
  XLA_FP4_RETURN_IF_ERROR(AllocateScratch(scratch, swizzled_bytes, workspace_bytes, "xla_fp4_ragged_gemm_packed",
                                          &swizzled, &workspace));
  for (size_t i = 0; i < calls.size(); ++i) {
    XLA_FP4_RETURN_IF_ERROR(RunFp4Gemm(stream, context, calls[i], prepared[i], swizzled, workspace));
  }
  return ffi::Error::Success();
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4RaggedGemmPackedCuda, xla_fp4::cuda::RaggedGemmPacked,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()
                                  .Arg<xla::ffi::AnyBuffer>()  // a_data, uint8 (M, K/2)
                                  .Arg<xla::ffi::AnyBuffer>()  // a_scales, uint8 (M, K/16)
                                  .Arg<xla::ffi::AnyBuffer>()  // b_data, uint8 (G, N, K/2), or (N, K/2) with ragged_k
                                  .Arg<xla::ffi::AnyBuffer>()  // b_scales, uint8 (G, N, K/16) or (N, K/16)
                                  .Arg<xla::ffi::AnyBuffer>()  // group_sizes, int32 (G,)
                                  .Arg<xla::ffi::AnyBuffer>()  // alpha, float32 (G,)
                                  .Ret<xla::ffi::AnyBuffer>()  // C (M, N), or (G, M, N) with ragged_k
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_RAGGED_GEMM_PACKED_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4MxGemmPackedCuda, xla_fp4::cuda::MxGemmPacked,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()
                                  .Arg<xla::ffi::AnyBuffer>()  // a_data, uint8 (M, K/2) (MXFP4) or (M, K) (MXFP8)
                                  .Arg<xla::ffi::AnyBuffer>()  // a_scales, uint8 E8M0 (M, K/32)
                                  .Arg<xla::ffi::AnyBuffer>()  // b_data, uint8 (N, K/2) or (N, K)
                                  .Arg<xla::ffi::AnyBuffer>()  // b_scales, uint8 E8M0 (N, K/32)
                                  .Ret<xla::ffi::AnyBuffer>()  // C (M, N), float32, bfloat16 or float16
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_MX_GEMM_PACKED_ATTRIBUTES));
