// xla_fp4_qdq, xla_fp4_qdq_with_scale, xla_fp4_qdq_stats, xla_fp4_rht and xla_fp4_block_amax on CUDA: the same numbers
// as the CPU kernels (qdq_kernels.cc).
#include <cstdint>
#include <optional>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_fp4/cuda/block_kernel.cuh"
#include "xla_fp4/cuda/cuda_handlers.h"
#include "xla_fp4/cuda/cuda_util.h"
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

// Telemetry (xla_fp4_qdq_stats): each thread compares its block's q * scale with the block's x (reloaded, the RHT
// applied) and adds to counts[7] (amax bits by max; nonzero, underflow, kept elements; live, zero-scale and clipped
// blocks) and energies[2] (x², error²). Counts are exact and order-free; the energies' order follows the atomics
// (float rounding only).
template <typename T>
struct StatsSink {
  const T* x;
  Recipe r;
  const int32_t* step;  // -1: not a recorded step, nothing to do
  unsigned long long* counts;
  double* energies;
  __device__ bool Skip() const { return *step < 0; }
  __device__ void operator()(const BlockGrid& g, const BlockIndex& b, const BlockScale& bs, const TensorScale& ts,
                             const float* q, float amax) const {
    Measure(g, b, bs, ts, q, amax);
  }
  __device__ void Measure(const BlockGrid& g, const BlockIndex& b, const BlockScale& bs, const TensorScale& ts,
                          const float* q, float amax) const {
    float v[kBlock];
    LoadBlock(x, g, b, v);
    if (r.rht) Rht16(v, r.signs.sign_quarter);
    unsigned long long nonzero = 0, underflow = 0, kept = 0;
    uint32_t m = 0;
    double energy = 0, error = 0;
    for (int j = 0; j < kBlock; ++j) {
      const float qs = q[j] * bs.scale, e = v[j] - qs * ts.s_dec;
      m = max(m, MagnitudeBits(v[j]));
      nonzero += v[j] != 0.0f;
      underflow += v[j] != 0.0f && qs == 0.0f;
      kept += qs != 0.0f;
      energy += static_cast<double>(v[j] * v[j]);
      error += static_cast<double>(e * e);
    }
    const bool live = amax > 0.0f;  // the block's amax as the quantizer saw it (a 2D tile's: the tile's)
    atomicMax(&counts[0], static_cast<unsigned long long>(m));
    atomicAdd(&counts[1], nonzero);
    atomicAdd(&counts[2], underflow);
    atomicAdd(&counts[3], kept);
    if (live) {
      atomicAdd(&counts[4], 1ull);
      if (bs.code == 0) atomicAdd(&counts[5], 1ull);
      if (amax * ts.s_enc_over_6 >= 464.0f) atomicAdd(&counts[6], 1ull);  // numerics/telemetry.py _CLIPPED
    }
    atomicAdd(&energies[0], energy);
    atomicAdd(&energies[1], error);
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

// The FIELDS row from the accumulators, on the device.
__global__ void StatsFinishKernel(const unsigned long long* counts, const double* energies, const float* s_dec,
                                  const int32_t* step, float elements, float* row) {
  using namespace telemetry;  // NOLINT: the field names
  if (*step < 0) {
    for (int i = 0; i < kNumFields; ++i) row[i] = 0.0f;
    return;
  }
  row[kAmax] = __uint_as_float(static_cast<uint32_t>(counts[0]));  // MagnitudeBits: NaN counted as +Inf
  row[kDecodeScale] = *s_dec;
  row[kElements] = elements;
  row[kNonzero] = static_cast<float>(counts[1]);
  row[kUnderflow] = static_cast<float>(counts[2]);
  row[kQuantizedNonzero] = static_cast<float>(counts[3]);
  row[kEnergy] = static_cast<float>(energies[0]);
  row[kErrorEnergy] = static_cast<float>(energies[1]);
  row[kLiveBlocks] = static_cast<float>(counts[4]);
  row[kScaleUnderflow] = static_cast<float>(counts[5]);
  row[kScaleSaturated] = static_cast<float>(counts[6]);
}

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

// One thread per 1x16 block (o, b, i): amax[o, b, i] = max_j |v_j|, v = the block's RHT when asked, NaN as +Inf;
// digest (null where not asked) [o, b, i] = the wrapping sum of the block's raw element bits.
template <typename T>
__global__ void BlockAmaxKernel(const T* x, int64_t blocks, int64_t inner, int64_t n, Recipe r, float* amax,
                                uint32_t* digest) {
  const int64_t t = ThreadIndex();
  if (t >= n) return;
  const int64_t ob = t / inner, i = t % inner;
  const T* rows = x + ob * kBlock * inner + i;
  float v[kBlock];
  uint32_t s = 0;
  for (int j = 0; j < kBlock; ++j) {
    const T e = rows[j * inner];
    v[j] = ToFloat(e);
    s += RawBits(e);
  }
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
    for (int j = 0; j < kBlock; ++j) {
      const T e = x[g.Offset(b, j)];
      v[j] = ToFloat(e);
      s += RawBits(e);
    }
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
__global__ void FinishScaleKernel(const uint32_t* stats, bool stochastic, uint32_t salt, float* s_dec, uint32_t* key) {
  *s_dec = GlobalDecodeScale(stats[0]);
  *key = (stochastic ? stats[1] : 0u) ^ salt;
}

ffi::Error Qdq(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer s_dec, ffi::AnyBuffer key,
               ffi::Result<ffi::AnyBuffer> y, int64_t axis, bool block_2d, bool stochastic, bool rht, int64_t rht_seed,
               bool apply_global_scale) {
  AxisShape shape;
  XLA_FP4_RETURN_IF_ERROR(CheckQdq(x, *y, axis, stochastic, rht_seed, &shape));
  const int64_t outer = shape.outer, k = shape.k, inner = shape.inner;
  XLA_FP4_RETURN_IF_ERROR(CheckScalar(s_dec, ffi::F32, "s_dec"));
  XLA_FP4_RETURN_IF_ERROR(CheckScalar(key, ffi::U32, "key"));
  const BlockGrid g = BlockGrid::Make(outer, k, inner, block_2d);
  if (g.Threads() == 0) return ffi::Error::Success();
  const Recipe r(block_2d, stochastic, rht, rht_seed);
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    QuantizeKernel<<<GridSize(g.Threads()), kThreadsPerBlock, 0, stream>>>(
        static_cast<const T*>(x.untyped_data()), g, r, static_cast<const float*>(s_dec.untyped_data()),
        static_cast<const uint32_t*>(key.untyped_data()),
        DequantizeSink<T>{static_cast<T*>(y->untyped_data()), apply_global_scale});
    return LaunchStatus("xla_fp4_qdq kernel");
  });
}

// With `step` (telemetry), also the statistics of the quantization into `row`, in a recorded step.
ffi::Error QdqWithScaleImpl(cudaStream_t stream, ffi::ScratchAllocator& scratch, ffi::AnyBuffer x, ffi::AnyBuffer& y,
                            ffi::Buffer<ffi::F32>& s_dec, const int32_t* step, float* row, int64_t axis,
                            bool block_2d, bool stochastic, bool rht, int64_t rht_seed, int64_t salt);

ffi::Error QdqWithScale(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x,
                        ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::F32>> s_dec, int64_t axis,
                        bool block_2d, bool stochastic, bool rht, int64_t rht_seed, int64_t salt) {
  return QdqWithScaleImpl(stream, scratch, x, *y, *s_dec, nullptr, nullptr, axis, block_2d, stochastic, rht, rht_seed,
                          salt);
}

ffi::Error QdqWithScaleStats(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x,
                             ffi::Buffer<ffi::S32> step, ffi::Result<ffi::AnyBuffer> y,
                             ffi::Result<ffi::Buffer<ffi::F32>> s_dec, ffi::Result<ffi::Buffer<ffi::F32>> stats,
                             int64_t axis, bool block_2d, bool stochastic, bool rht, int64_t rht_seed, int64_t salt) {
  XLA_FP4_RETURN_IF_ERROR(CheckStatsRow(stats->element_count(), ffi::F32, "xla_fp4_qdq_with_scale_stats"));
  return QdqWithScaleImpl(stream, scratch, x, *y, *s_dec, step.typed_data(), stats->typed_data(), axis, block_2d,
                          stochastic, rht, rht_seed, salt);
}

ffi::Error QdqWithScaleImpl(cudaStream_t stream, ffi::ScratchAllocator& scratch, ffi::AnyBuffer x, ffi::AnyBuffer& y,
                            ffi::Buffer<ffi::F32>& s_dec, const int32_t* step, float* row, int64_t axis,
                            bool block_2d, bool stochastic, bool rht, int64_t rht_seed, int64_t salt) {
  AxisShape shape;
  XLA_FP4_RETURN_IF_ERROR(CheckQdq(x, y, axis, stochastic, rht_seed, &shape));
  const int64_t outer = shape.outer, k = shape.k, inner = shape.inner;
  XLA_FP4_RETURN_IF_ERROR(CheckU32Attribute(salt, "salt"));
  if (s_dec.element_count() != 1) return InvalidArgument("xla_fp4_qdq_with_scale returns a float32 scalar s_dec");
  // amax bits, digest, key; then (telemetry) 7 counts and 2 energies
  constexpr size_t kScaleBytes = 4 * sizeof(uint32_t), kStatsBytes = 7 * sizeof(unsigned long long) + 2 * sizeof(double);
  std::optional<void*> words = scratch.Allocate(kScaleBytes + (step ? kStatsBytes : 0), alignof(double));
  if (!words.has_value()) return ffi::Error(ffi::ErrorCode::kResourceExhausted, "no scratch memory for the scale");
  uint32_t* stats = static_cast<uint32_t*>(*words);
  auto* counts = reinterpret_cast<unsigned long long*>(stats + 4);
  auto* energies = reinterpret_cast<double*>(counts + 7);
  XLA_FP4_RETURN_IF_ERROR(CudaStatus(
      cudaMemsetAsync(stats, 0, kScaleBytes + (step ? kStatsBytes : 0), stream), "cudaMemsetAsync"));
  const Recipe r(block_2d, stochastic, rht, rht_seed);
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.untyped_data());
    const BlockGrid measured = BlockGrid::Make(outer, k, inner, /*block_2d=*/false);
    if (measured.Threads() > 0) {
      MeasureKernel<<<GridSize(measured.Threads()), kThreadsPerBlock, 0, stream>>>(xp, measured, r, stats);
      XLA_FP4_RETURN_IF_ERROR(LaunchStatus("xla_fp4_qdq_with_scale measure kernel"));
    }
    FinishScaleKernel<<<1, 1, 0, stream>>>(stats, stochastic, static_cast<uint32_t>(salt), s_dec.typed_data(),
                                           stats + 2);
    XLA_FP4_RETURN_IF_ERROR(LaunchStatus("xla_fp4_qdq_with_scale scale kernel"));
    const BlockGrid g = BlockGrid::Make(outer, k, inner, block_2d);
    const DequantizeSink<T> dequantize{static_cast<T*>(y.untyped_data()), false};
    if (g.Threads() > 0 && step == nullptr) {
      QuantizeKernel<<<GridSize(g.Threads()), kThreadsPerBlock, 0, stream>>>(xp, g, r, s_dec.typed_data(), stats + 2,
                                                                             dequantize);
    } else if (g.Threads() > 0) {
      QuantizeKernel<<<GridSize(g.Threads()), kThreadsPerBlock, 0, stream>>>(
          xp, g, r, s_dec.typed_data(), stats + 2,
          DequantizeStatsSink<T>{dequantize, StatsSink<T>{xp, r, step, counts, energies}});
    }
    XLA_FP4_RETURN_IF_ERROR(LaunchStatus("xla_fp4_qdq_with_scale kernel"));
    if (step == nullptr) return ffi::Error::Success();
    StatsFinishKernel<<<1, 1, 0, stream>>>(counts, energies, s_dec.typed_data(), step, static_cast<float>(shape.size()),
                                           row);
    return LaunchStatus("xla_fp4_qdq_with_scale_stats finish kernel");
  });
}

// Telemetry's xla_fp4_qdq (a partitioned program's quantizer: x may be a shard): y without the global scale, and the
// statistics of that quantization from the same pass in a recorded step (the sink reads the step on the device).
ffi::Error QdqAndStats(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x, ffi::AnyBuffer s_dec,
                       ffi::AnyBuffer key, ffi::Buffer<ffi::S32> step, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Result<ffi::Buffer<ffi::F32>> stats, int64_t axis, bool block_2d, bool stochastic,
                       bool rht, int64_t rht_seed) {
  AxisShape shape;
  XLA_FP4_RETURN_IF_ERROR(CheckQdq(x, *y, axis, stochastic, rht_seed, &shape));
  XLA_FP4_RETURN_IF_ERROR(CheckScalar(s_dec, ffi::F32, "s_dec"));
  XLA_FP4_RETURN_IF_ERROR(CheckScalar(key, ffi::U32, "key"));
  XLA_FP4_RETURN_IF_ERROR(CheckStatsRow(stats->element_count(), ffi::F32, "xla_fp4_qdq_and_stats"));
  constexpr size_t kBytes = 7 * sizeof(unsigned long long) + 2 * sizeof(double);
  std::optional<void*> words = scratch.Allocate(kBytes, alignof(double));
  if (!words.has_value()) return ffi::Error(ffi::ErrorCode::kResourceExhausted, "no scratch memory for the stats");
  auto* counts = static_cast<unsigned long long*>(*words);
  auto* energies = reinterpret_cast<double*>(counts + 7);
  XLA_FP4_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(counts, 0, kBytes, stream), "cudaMemsetAsync"));
  const BlockGrid g = BlockGrid::Make(shape.outer, shape.k, shape.inner, block_2d);
  const Recipe r(block_2d, stochastic, rht, rht_seed);
  const float* s = static_cast<const float*>(s_dec.untyped_data());
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.untyped_data());
    if (g.Threads() > 0) {
      const DequantizeSink<T> dequantize{static_cast<T*>(y->untyped_data()), false};
      QuantizeKernel<<<GridSize(g.Threads()), kThreadsPerBlock, 0, stream>>>(
          xp, g, r, s, static_cast<const uint32_t*>(key.untyped_data()),
          DequantizeStatsSink<T>{dequantize, StatsSink<T>{xp, r, step.typed_data(), counts, energies}});
      XLA_FP4_RETURN_IF_ERROR(LaunchStatus("xla_fp4_qdq_and_stats kernel"));
    }
    StatsFinishKernel<<<1, 1, 0, stream>>>(counts, energies, s, step.typed_data(), static_cast<float>(shape.size()),
                                           stats->typed_data());
    return LaunchStatus("xla_fp4_qdq_and_stats finish kernel");
  });
}

// The stochastic-rounding key as the GEMM's quantizer made it (salt ^ x's digest), in a recorded step only.
template <typename T>
__global__ void StatsKeyKernel(const T* x, int64_t n, const int32_t* step, uint32_t* digest) {
  if (*step < 0) return;
  uint32_t s = 0;
  for (int64_t i = ThreadIndex(); i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x) s += RawBits(x[i]);
  atomicAdd(digest, s);  // wrapping and order-free
}

__global__ void SaltKeyKernel(uint32_t* key, uint32_t salt) { *key ^= salt; }

// With `given_key` (xla_fp4_qdq_stats_keyed: a partitioned program's, the whole tensor's key) the key is read from it;
// else it is made as the whole-tensor quantizer made it (salt ^ x's digest).
ffi::Error QdqStatsCommon(cudaStream_t stream, ffi::ScratchAllocator& scratch, ffi::AnyBuffer& x,
                          ffi::AnyBuffer& s_dec, const uint32_t* given_key, ffi::Buffer<ffi::S32>& step,
                          ffi::Buffer<ffi::F32>& stats, int64_t axis, bool block_2d, bool stochastic, bool rht,
                          int64_t rht_seed, int64_t salt);

ffi::Error QdqStats(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x, ffi::AnyBuffer s_dec,
                    ffi::Buffer<ffi::S32> step, ffi::Result<ffi::Buffer<ffi::F32>> stats, int64_t axis,
                    bool block_2d, bool stochastic, bool rht, int64_t rht_seed, int64_t salt) {
  return QdqStatsCommon(stream, scratch, x, s_dec, nullptr, step, *stats, axis, block_2d, stochastic, rht, rht_seed,
                        salt);
}

ffi::Error QdqStatsKeyed(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x, ffi::AnyBuffer s_dec,
                         ffi::AnyBuffer key, ffi::Buffer<ffi::S32> step, ffi::Result<ffi::Buffer<ffi::F32>> stats,
                         int64_t axis, bool block_2d, bool stochastic, bool rht, int64_t rht_seed) {
  XLA_FP4_RETURN_IF_ERROR(CheckScalar(key, ffi::U32, "key"));
  return QdqStatsCommon(stream, scratch, x, s_dec, static_cast<const uint32_t*>(key.untyped_data()), step, *stats,
                        axis, block_2d, stochastic, rht, rht_seed, 0);
}

ffi::Error QdqStatsCommon(cudaStream_t stream, ffi::ScratchAllocator& scratch, ffi::AnyBuffer& x,
                          ffi::AnyBuffer& s_dec, const uint32_t* given_key, ffi::Buffer<ffi::S32>& step,
                          ffi::Buffer<ffi::F32>& stats, int64_t axis, bool block_2d, bool stochastic, bool rht,
                          int64_t rht_seed, int64_t salt) {
  AxisShape shape;
  XLA_FP4_RETURN_IF_ERROR(CheckAxis(x.dimensions(), axis, &shape));
  XLA_FP4_RETURN_IF_ERROR(CheckSeed(rht_seed));
  XLA_FP4_RETURN_IF_ERROR(CheckCounterRange(stochastic, shape.size(), x.dimensions()));
  XLA_FP4_RETURN_IF_ERROR(CheckScalar(s_dec, ffi::F32, "s_dec"));
  XLA_FP4_RETURN_IF_ERROR(CheckU32Attribute(salt, "salt"));
  XLA_FP4_RETURN_IF_ERROR(CheckStatsRow(stats.element_count(), ffi::F32, "xla_fp4_qdq_stats"));
  constexpr size_t kBytes = 7 * sizeof(unsigned long long) + 2 * sizeof(double) + sizeof(uint64_t);
  std::optional<void*> words = scratch.Allocate(kBytes, alignof(double));
  if (!words.has_value()) return ffi::Error(ffi::ErrorCode::kResourceExhausted, "no scratch memory for the stats");
  auto* counts = static_cast<unsigned long long*>(*words);
  auto* energies = reinterpret_cast<double*>(counts + 7);
  auto* key = reinterpret_cast<uint32_t*>(energies + 2);
  XLA_FP4_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(counts, 0, kBytes, stream), "cudaMemsetAsync"));
  const BlockGrid g = BlockGrid::Make(shape.outer, shape.k, shape.inner, block_2d);
  const Recipe r(block_2d, stochastic, rht, rht_seed);
  const float* s = static_cast<const float*>(s_dec.untyped_data());
  const int64_t n = shape.size();
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.untyped_data());
    if (given_key == nullptr && stochastic && n > 0) {
      const unsigned blocks = GridSize(n) < 1024u ? GridSize(n) : 1024u;
      StatsKeyKernel<<<blocks, kThreadsPerBlock, 0, stream>>>(xp, n, step.typed_data(), key);
      XLA_FP4_RETURN_IF_ERROR(LaunchStatus("xla_fp4_qdq_stats key kernel"));
    }
    if (given_key == nullptr) {
      SaltKeyKernel<<<1, 1, 0, stream>>>(key, static_cast<uint32_t>(salt));
      XLA_FP4_RETURN_IF_ERROR(LaunchStatus("xla_fp4_qdq_stats salt kernel"));
    }
    if (g.Threads() > 0) {
      QuantizeKernel<<<GridSize(g.Threads()), kThreadsPerBlock, 0, stream>>>(
          xp, g, r, s, given_key != nullptr ? given_key : key,
          StatsSink<T>{xp, r, step.typed_data(), counts, energies});
      XLA_FP4_RETURN_IF_ERROR(LaunchStatus("xla_fp4_qdq_stats kernel"));
    }
    StatsFinishKernel<<<1, 1, 0, stream>>>(counts, energies, s, step.typed_data(), static_cast<float>(n),
                                           stats.typed_data());
    return LaunchStatus("xla_fp4_qdq_stats finish kernel");
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4QdqStatsCuda, xla_fp4::cuda::QdqStats,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()
                                  .Arg<xla::ffi::AnyBuffer>()              // x
                                  .Arg<xla::ffi::AnyBuffer>()              // s_dec (float32 scalar)
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // step (-1: not recorded, no work)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // statistics, float32[11]
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_QDQ_STATS_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4QdqStatsKeyedCuda, xla_fp4::cuda::QdqStatsKeyed,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()
                                  .Arg<xla::ffi::AnyBuffer>()              // x (a shard, in a partitioned program)
                                  .Arg<xla::ffi::AnyBuffer>()              // s_dec (float32 scalar)
                                  .Arg<xla::ffi::AnyBuffer>()              // key (uint32 scalar)
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // step (-1: not recorded, no work)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // statistics, float32[11]
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_QDQ_AND_STATS_ATTRIBUTES));

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
