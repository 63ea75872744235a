// xla_fp4_qdq, xla_fp4_qdq_with_scale (and their telemetry forms), xla_fp4_mx_qdq, xla_fp4_rht and xla_fp4_block_amax
// on CUDA: the same numbers
// as the CPU kernels (qdq_kernels.cc).
#include <cstdint>
#include <optional>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_fp4/cuda/block_kernel.cuh"
#include "xla_fp4/cuda/cuda_handlers.h"
#include "xla_fp4/cuda/cuda_util.h"
#include "xla_fp4/cuda/stats_sink.cuh"
#include "xla_fp4/nvfp4_format.h"
#include "xla_fp4/ffi_targets.h"

namespace xla_fp4::cuda {
namespace {

// Writes decode(q) back in the input's dtype, at the block's own positions. Without the global scale the result is
// q * scale, exact in every float dtype: an emulated GEMM then folds both s_dec into its float32 output, as cuBLASLt's
// alpha does (docs/design.md §2).
template <typename T>
struct DequantizeSink {
  T* y;
  bool apply_global_scale;
  __device__ bool Skip() const { return false; }
  __device__ void operator()(const BlockGrid& g, const BlockIndex& b, const BlockScale& bs, const TensorScale& ts,
                             const float* q, float /*amax*/) const {
    const float s_dec = apply_global_scale ? ts.s_dec : 1.0f;
    float v[kBlock];
    for (int j = 0; j < kBlock; ++j) v[j] = DecodeElement(q[j], bs.scale, s_dec);
    StoreBlock(y, g, b, v);
  }
};

// xla_fp4_qdq_with_scale_stats: the dequantized block, and in a recorded step its statistics.
template <typename T>
struct DequantizeStatsSink {
  DequantizeSink<T> dequantize;
  StatsSink<T> stats;
  __device__ bool Skip() const { return false; }
  __device__ void operator()(const BlockGrid& g, const BlockIndex& b, const BlockScale& bs, const TensorScale& ts,
                             const float* q, float amax) const {
    dequantize(g, b, bs, ts, q, amax);
    if (!stats.Skip()) stats.Measure(g, b, bs, ts, q, amax);
  }
};

template <typename T>
__global__ void RhtKernel(const T* x, BlockGrid g, Recipe r, float* y) {
  const BlockIndex b = g.Locate(ThreadIndex());
  if (!b.active) return;
  float v[kBlock];
  LoadBlock(x, g, b, v);
  Rht16(v, r.signs.sign_quarter);
  StoreBlock(y, g, b, v);
}

__device__ inline uint32_t RawBits(float v) { return __float_as_uint(v); }
__device__ inline uint32_t RawBits(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }
__device__ inline uint32_t RawBits(__half v) { return __half_as_ushort(v); }

// The 16 elements at p, `stride` apart, as floats (ToFloat) and the wrapping sum of their raw bits; 16-byte vector
// loads where they are consecutive and aligned (block_kernel.cuh ForEachInRun).
template <typename T>
__device__ uint32_t LoadWithDigest(const T* p, int64_t stride, float* v) {
  uint32_t s = 0;
  if (stride == 1 && Aligned16(p)) {
    ForEachInRun<kBlock>(p, [&](int j, T e) {
      v[j] = ToFloat(e);
      s += RawBits(e);
    });
    return s;
  }
  for (int j = 0; j < kBlock; ++j) {
    const T e = p[j * stride];
    v[j] = ToFloat(e);
    s += RawBits(e);
  }
  return s;
}

// One thread per 1x16 block (o, b, i): amax[o, b, i] = max_j |v_j|, v = the block's RHT when asked, NaN as +Inf;
// digest (null where not asked) [o, b, i] = the wrapping sum of the block's raw element bits.
template <typename T>
__global__ void BlockAmaxKernel(const T* x, int64_t blocks, int64_t inner, int64_t n, Recipe r, float* amax,
                                uint32_t* digest) {
  const int64_t t = ThreadIndex();
  if (t >= n) return;
  const int64_t ob = t / inner, i = t % inner;
  float v[kBlock];
  const uint32_t s = LoadWithDigest(x + ob * kBlock * inner + i, inner, v);
  if (r.rht) Rht16(v, r.signs.sign_quarter);
  uint32_t m = 0;
  for (int j = 0; j < kBlock; ++j) m = max(m, MagnitudeBits(v[j]));
  amax[t] = __uint_as_float(m);
  if (digest != nullptr) digest[t] = s;
}

// stats[0] = max MagnitudeBits over x (after the RHT when asked), stats[1] += wrapping sum of x's element bits when
// stochastic. Max and sum are order-free: the result does not depend on the launch shape.
template <typename T>
__global__ void MeasureKernel(const T* x, BlockGrid g, Recipe r, uint32_t* stats) {
  const BlockIndex b = g.Locate(ThreadIndex());
  uint32_t m = 0, s = 0;
  if (b.active) {
    float v[kBlock];
    s = LoadWithDigest(x + g.Offset(b, 0), g.inner, v);
    if (r.rht) Rht16(v, r.signs.sign_quarter);
    for (int j = 0; j < kBlock; ++j) m = max(m, MagnitudeBits(v[j]));
  }
  for (int lane = 16; lane > 0; lane /= 2) {  // every lane takes part, active or not
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, lane));
    s += __shfl_xor_sync(0xFFFFFFFFu, s, lane);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicMax(&stats[0], m);
    if (r.stochastic) atomicAdd(&stats[1], s);
  }
}

// s_dec and the rounding key from the statistics, on the device: no host synchronization.
__global__ void FinishScaleKernel(const uint32_t* stats, bool stochastic, bool four_over_six, uint32_t salt,
                                  float* s_dec, uint32_t* key) {
  *s_dec = GlobalDecodeScale(stats[0], four_over_six);
  *key = (stochastic ? stats[1] : 0u) ^ salt;
}

// xla_fp4_mx_qdq's sink (block_kernel.cuh MxKernel): the block's values decoded into y.
template <typename T>
struct MxQdqSink {
  T* y;
  __device__ void operator()(const MxGrid& g, int64_t base, int64_t /*scale_at*/, const float* q, const MxScale& ms,
                             uint8_t /*scale_byte*/) const {
    float v[kMxBlock];
    for (int j = 0; j < kMxBlock; ++j) v[j] = MxDecodeElement(q[j], ms.scale);
    if (g.inner == 1 && Aligned16(y + base)) return StoreRun<kMxBlock>(y + base, v);
    for (int j = 0; j < kMxBlock; ++j) y[base + j * g.inner] = FromFloat<T>(v[j]);
  }
};

ffi::Error MxQdq(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer key, ffi::Result<ffi::AnyBuffer> y, int64_t axis,
                 bool block_2d, bool stochastic, bool rht, int64_t rht_seed, bool fp8) {
  AxisShape shape;
  XLA_FP4_RETURN_IF_ERROR(CheckMxQdq(x, *y, key, axis, stochastic, rht_seed, &shape));
  const MxGrid g{shape.outer, shape.k, shape.inner, block_2d, fp8};
  if (g.Threads() == 0) return ffi::Error::Success();
  const Recipe r(block_2d, stochastic, rht, rht_seed);
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    MxKernel<<<GridSize(g.Threads()), kThreadsPerBlock, 0, stream>>>(
        static_cast<const T*>(x.untyped_data()), g, r, static_cast<const uint32_t*>(key.untyped_data()),
        MxQdqSink<T>{static_cast<T*>(y->untyped_data())});
    return LaunchStatus("xla_fp4_mx_qdq kernel");
  });
}

ffi::Error Qdq(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer s_dec, ffi::AnyBuffer key,
               ffi::Result<ffi::AnyBuffer> y, int64_t axis, bool block_2d, bool stochastic, bool rht, int64_t rht_seed,
               bool apply_global_scale, bool four_over_six) {
  AxisShape shape;
  XLA_FP4_RETURN_IF_ERROR(CheckQdq(x, *y, axis, stochastic, rht_seed, &shape));
  const int64_t outer = shape.outer, k = shape.k, inner = shape.inner;
  XLA_FP4_RETURN_IF_ERROR(CheckScalar(s_dec, ffi::F32, "s_dec"));
  XLA_FP4_RETURN_IF_ERROR(CheckScalar(key, ffi::U32, "key"));
  const BlockGrid g = BlockGrid::Make(outer, k, inner, block_2d);
  if (g.Threads() == 0) return ffi::Error::Success();
  const Recipe r(block_2d, stochastic, rht, rht_seed, four_over_six);
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    T* yp = static_cast<T*>(y->untyped_data());
    LaunchQuantize(stream, static_cast<const T*>(x.untyped_data()), yp, outer, k, inner, r,
                   static_cast<const float*>(s_dec.untyped_data()), static_cast<const uint32_t*>(key.untyped_data()),
                   DequantizeSink<T>{yp, apply_global_scale}, WarpDequantizeSink<T>{yp, apply_global_scale});
    return LaunchStatus("xla_fp4_qdq kernel");
  });
}

// With `step` (telemetry), also the statistics of the quantization into `row`, in a recorded step.
ffi::Error QdqWithScaleImpl(cudaStream_t stream, ffi::ScratchAllocator& scratch, ffi::AnyBuffer x, ffi::AnyBuffer& y,
                            ffi::Buffer<ffi::F32>& s_dec, const int32_t* step, float* row, int64_t axis,
                            bool block_2d, bool stochastic, bool rht, int64_t rht_seed, int64_t salt,
                            bool four_over_six);

ffi::Error QdqWithScale(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x,
                        ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::F32>> s_dec, int64_t axis,
                        bool block_2d, bool stochastic, bool rht, int64_t rht_seed, int64_t salt, bool four_over_six) {
  return QdqWithScaleImpl(stream, scratch, x, *y, *s_dec, nullptr, nullptr, axis, block_2d, stochastic, rht, rht_seed,
                          salt, four_over_six);
}

ffi::Error QdqWithScaleStats(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x,
                             ffi::Buffer<ffi::S32> step, ffi::Result<ffi::AnyBuffer> y,
                             ffi::Result<ffi::Buffer<ffi::F32>> s_dec, ffi::Result<ffi::Buffer<ffi::F32>> stats,
                             int64_t axis, bool block_2d, bool stochastic, bool rht, int64_t rht_seed, int64_t salt,
                             bool four_over_six) {
  XLA_FP4_RETURN_IF_ERROR(CheckStatsRow(stats->element_count(), ffi::F32, "xla_fp4_qdq_with_scale_stats"));
  return QdqWithScaleImpl(stream, scratch, x, *y, *s_dec, step.typed_data(), stats->typed_data(), axis, block_2d,
                          stochastic, rht, rht_seed, salt, four_over_six);
}

ffi::Error QdqWithScaleImpl(cudaStream_t stream, ffi::ScratchAllocator& scratch, ffi::AnyBuffer x, ffi::AnyBuffer& y,
                            ffi::Buffer<ffi::F32>& s_dec, const int32_t* step, float* row, int64_t axis,
                            bool block_2d, bool stochastic, bool rht, int64_t rht_seed, int64_t salt,
                            bool four_over_six) {
  AxisShape shape;
  XLA_FP4_RETURN_IF_ERROR(CheckQdq(x, y, axis, stochastic, rht_seed, &shape));
  const int64_t outer = shape.outer, k = shape.k, inner = shape.inner;
  XLA_FP4_RETURN_IF_ERROR(CheckU32Attribute(salt, "salt"));
  if (s_dec.element_count() != 1) return InvalidArgument("xla_fp4_qdq_with_scale returns a float32 scalar s_dec");
  // amax bits, digest, key
  std::optional<void*> words = scratch.Allocate(4 * sizeof(uint32_t), alignof(uint32_t));
  if (!words.has_value()) return ffi::Error(ffi::ErrorCode::kResourceExhausted, "no scratch memory for the scale");
  uint32_t* stats = static_cast<uint32_t*>(*words);
  XLA_FP4_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(stats, 0, 4 * sizeof(uint32_t), stream), "cudaMemsetAsync"));
  StatsAccumulators acc;  // telemetry
  if (step != nullptr) XLA_FP4_RETURN_IF_ERROR(StatsAccumulators::Allocate(scratch, stream, &acc));
  const Recipe r(block_2d, stochastic, rht, rht_seed, four_over_six);
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.untyped_data());
    const BlockGrid measured = BlockGrid::Make(outer, k, inner, /*block_2d=*/false);
    if (measured.Threads() > 0) {
      MeasureKernel<<<GridSize(measured.Threads()), kThreadsPerBlock, 0, stream>>>(xp, measured, r, stats);
      XLA_FP4_RETURN_IF_ERROR(LaunchStatus("xla_fp4_qdq_with_scale measure kernel"));
    }
    FinishScaleKernel<<<1, 1, 0, stream>>>(stats, stochastic, four_over_six, static_cast<uint32_t>(salt),
                                           s_dec.typed_data(), stats + 2);
    XLA_FP4_RETURN_IF_ERROR(LaunchStatus("xla_fp4_qdq_with_scale scale kernel"));
    const BlockGrid g = BlockGrid::Make(outer, k, inner, block_2d);
    const DequantizeSink<T> dequantize{static_cast<T*>(y.untyped_data()), false};
    if (g.Threads() > 0 && step == nullptr) {
      LaunchQuantize(stream, xp, dequantize.y, outer, k, inner, r, s_dec.typed_data(), stats + 2, dequantize,
                     WarpDequantizeSink<T>{dequantize.y, false});
    } else if (g.Threads() > 0) {
      QuantizeKernel<<<GridSize(g.Threads()), kThreadsPerBlock, 0, stream>>>(
          xp, g, r, s_dec.typed_data(), stats + 2,
          DequantizeStatsSink<T>{dequantize, StatsSink<T>{xp, r, step, acc.counts, acc.energies}});
    }
    XLA_FP4_RETURN_IF_ERROR(LaunchStatus("xla_fp4_qdq_with_scale kernel"));
    if (step == nullptr) return ffi::Error::Success();
    StatsFinishKernel<<<1, 1, 0, stream>>>(acc.counts, acc.energies, s_dec.typed_data(), step,
                                           static_cast<float>(shape.size()), row);
    return LaunchStatus("xla_fp4_qdq_with_scale_stats finish kernel");
  });
}

// Telemetry's xla_fp4_qdq (a partitioned program's quantizer: x may be a shard): y without the global scale, and the
// statistics of that quantization from the same pass in a recorded step (the sink reads the step on the device).
ffi::Error QdqAndStats(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x, ffi::AnyBuffer s_dec,
                       ffi::AnyBuffer key, ffi::Buffer<ffi::S32> step, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Result<ffi::Buffer<ffi::F32>> stats, int64_t axis, bool block_2d, bool stochastic,
                       bool rht, int64_t rht_seed, bool four_over_six) {
  AxisShape shape;
  XLA_FP4_RETURN_IF_ERROR(CheckQdq(x, *y, axis, stochastic, rht_seed, &shape));
  XLA_FP4_RETURN_IF_ERROR(CheckScalar(s_dec, ffi::F32, "s_dec"));
  XLA_FP4_RETURN_IF_ERROR(CheckScalar(key, ffi::U32, "key"));
  XLA_FP4_RETURN_IF_ERROR(CheckStatsRow(stats->element_count(), ffi::F32, "xla_fp4_qdq_and_stats"));
  StatsAccumulators acc;
  XLA_FP4_RETURN_IF_ERROR(StatsAccumulators::Allocate(scratch, stream, &acc));
  const BlockGrid g = BlockGrid::Make(shape.outer, shape.k, shape.inner, block_2d);
  const Recipe r(block_2d, stochastic, rht, rht_seed, four_over_six);
  const float* s = static_cast<const float*>(s_dec.untyped_data());
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.untyped_data());
    if (g.Threads() > 0) {
      const DequantizeSink<T> dequantize{static_cast<T*>(y->untyped_data()), false};
      QuantizeKernel<<<GridSize(g.Threads()), kThreadsPerBlock, 0, stream>>>(
          xp, g, r, s, static_cast<const uint32_t*>(key.untyped_data()),
          DequantizeStatsSink<T>{dequantize, StatsSink<T>{xp, r, step.typed_data(), acc.counts, acc.energies}});
      XLA_FP4_RETURN_IF_ERROR(LaunchStatus("xla_fp4_qdq_and_stats kernel"));
    }
    StatsFinishKernel<<<1, 1, 0, stream>>>(acc.counts, acc.energies, s, step.typed_data(),
                                           static_cast<float>(shape.size()), stats->typed_data());
    return LaunchStatus("xla_fp4_qdq_and_stats finish kernel");
  });
}

ffi::Error Rht(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::F32>> y, int64_t axis,
               int64_t rht_seed) {
  AxisShape shape;
  XLA_FP4_RETURN_IF_ERROR(CheckAxis(x.dimensions(), axis, &shape));
  const int64_t outer = shape.outer, k = shape.k, inner = shape.inner;
  XLA_FP4_RETURN_IF_ERROR(CheckSeed(rht_seed));
  if (y->element_count() != x.element_count()) return InvalidArgument("xla_fp4_rht returns a tensor of x's shape");
  const BlockGrid g = BlockGrid::Make(outer, k, inner, /*block_2d=*/false);
  if (g.Threads() == 0) return ffi::Error::Success();
  const Recipe r(false, false, true, rht_seed);
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    RhtKernel<<<GridSize(g.Threads()), kThreadsPerBlock, 0, stream>>>(static_cast<const T*>(x.untyped_data()), g, r,
                                                                       y->typed_data());
    return LaunchStatus("xla_fp4_rht kernel");
  });
}

ffi::Error BlockAmax(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> amax,
                     ffi::RemainingRets more, int64_t axis, bool rht, int64_t rht_seed, bool digest) {
  AxisShape shape;
  ffi::AnyBuffer digests = *amax;  // replaced by the digests' result where there is one
  XLA_FP4_RETURN_IF_ERROR(CheckBlockAmax(x, *amax, more, axis, rht_seed, digest, &shape, &digests));
  const int64_t n = shape.size() / kBlock;
  if (n == 0) return ffi::Error::Success();
  const Recipe r(false, false, rht, rht_seed);
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    BlockAmaxKernel<<<GridSize(n), kThreadsPerBlock, 0, stream>>>(
        static_cast<const T*>(x.untyped_data()), shape.k / kBlock, shape.inner, n, r,
        static_cast<float*>(amax->untyped_data()), digest ? static_cast<uint32_t*>(digests.untyped_data()) : nullptr);
    return LaunchStatus("xla_fp4_block_amax kernel");
  });
}

}  // namespace
}  // namespace xla_fp4::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4QdqCuda, xla_fp4::cuda::Qdq,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // s_dec (float32 scalar)
                                  .Arg<xla::ffi::AnyBuffer>()  // key (uint32 scalar)
                                  .Ret<xla::ffi::AnyBuffer>()  // y, x's shape and dtype
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_QDQ_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4QdqWithScaleCuda, xla_fp4::cuda::QdqWithScale,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()
                                  .Arg<xla::ffi::AnyBuffer>()              // x
                                  .Ret<xla::ffi::AnyBuffer>()              // y: q * scale, x's shape and dtype
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // s_dec (float32 scalar)
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_QDQ_WITH_SCALE_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4QdqWithScaleStatsCuda, xla_fp4::cuda::QdqWithScaleStats,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()
                                  .Arg<xla::ffi::AnyBuffer>()              // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // step (-1: not recorded)
                                  .Ret<xla::ffi::AnyBuffer>()              // y: q * scale, x's shape and dtype
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // s_dec (float32 scalar)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // statistics, float32[11]
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_QDQ_WITH_SCALE_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4QdqAndStatsCuda, xla_fp4::cuda::QdqAndStats,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()
                                  .Arg<xla::ffi::AnyBuffer>()              // x (a shard, in a partitioned program)
                                  .Arg<xla::ffi::AnyBuffer>()              // s_dec (float32 scalar)
                                  .Arg<xla::ffi::AnyBuffer>()              // key (uint32 scalar)
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // step (-1: not recorded)
                                  .Ret<xla::ffi::AnyBuffer>()              // y: q * scale, x's shape and dtype
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // statistics, float32[11]
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_QDQ_AND_STATS_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4RhtCuda, xla_fp4::cuda::Rht,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // x
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // RHT(x), float32
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_RHT_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4BlockAmaxCuda, xla_fp4::cuda::BlockAmax,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // x
                                  .Ret<xla::ffi::AnyBuffer>()              // amax per 1x16 block (float32)
                                  .RemainingRets()  // with digest: each block's digest (uint32)
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_BLOCK_AMAX_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4MxQdqCuda, xla_fp4::cuda::MxQdq,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // key (uint32 scalar)
                                  .Ret<xla::ffi::AnyBuffer>()  // y: q * 2^s, x's shape and dtype
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_MX_QDQ_ATTRIBUTES));
