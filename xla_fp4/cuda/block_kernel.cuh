// Device code shared by the CUDA kernels: one thread per block of 16 elements along K.
//
// A tensor is viewed as (outer, K, inner) around the quantization axis (numerics/nvfp4.py). Threads walk the
// dimension that a 2D tile spans fastest (inner, or outer when inner == 1), padded to a multiple of 16, so the 16
// blocks of a tile sit in one aligned half-warp and their amax is a 4-step shuffle reduction. The numbers themselves
// come from nvfp4_format.h, shared with the CPU kernels.
#ifndef XLA_FP4_CUDA_BLOCK_KERNEL_CUH_
#define XLA_FP4_CUDA_BLOCK_KERNEL_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "xla/ffi/api/ffi.h"
#include "xla_fp4/cuda/cuda_util.h"
#include "xla_fp4/nvfp4_format.h"
#include "xla_fp4/warp_quantize.h"

namespace xla_fp4::cuda {

// A subnormal float32 loads as zero (nvfp4_format.h FlushSubnormal); float16's subnormals are normal in float32.
__device__ inline float ToFloat(float v) { return FlushSubnormal(v); }
__device__ inline float ToFloat(__nv_bfloat16 v) { return FlushSubnormal(__bfloat162float(v)); }
__device__ inline float ToFloat(__half v) { return __half2float(v); }

// Round to nearest even, like XLA's convert.
template <typename T>
__device__ T FromFloat(float v);
template <>
__device__ inline float FromFloat<float>(float v) { return v; }
template <>
__device__ inline __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ inline __half FromFloat<__half>(float v) { return __float2half_rn(v); }

// Calls f(T{}) with the CUDA type of a float32 / bfloat16 / float16 buffer.
template <typename F>
ffi::Error DispatchFloat(ffi::DataType dtype, const char* target, F&& f) {
  switch (dtype) {
    case ffi::F32: return f(float{});
    case ffi::BF16: return f(__nv_bfloat16{});
    case ffi::F16: return f(__half{});
    default: return InvalidArgument(std::string(target) + " takes float32, bfloat16 or float16 tensors");
  }
}


struct BlockIndex {
  int64_t o, kb, i;
  bool active;
};

struct BlockGrid {
  int64_t outer, k, inner;
  bool tile_outer;      // 2D tiles span outer (the axis is the last one); otherwise inner
  int64_t fast;         // extent of the dimension threads walk fastest
  int64_t fast_padded;  // fast, rounded up to 16 for 2D tiles

  static BlockGrid Make(int64_t outer, int64_t k, int64_t inner, bool block_2d) {
    const bool tile_outer = block_2d && inner == 1;
    const int64_t fast = tile_outer ? outer : inner;
    return {outer, k, inner, tile_outer, fast, block_2d ? (fast + kBlock - 1) / kBlock * kBlock : fast};
  }

  __host__ __device__ int64_t Threads() const { return (tile_outer ? 1 : outer) * (k / kBlock) * fast_padded; }

  __device__ BlockIndex Locate(int64_t t) const {
    const int64_t f = t % fast_padded, rest = t / fast_padded;
    const int64_t kb = rest % (k / kBlock), p = rest / (k / kBlock);
    return {tile_outer ? f : p, kb, tile_outer ? 0 : f, t < Threads() && f < fast};
  }

  // Row-major position of element j of the block: also the counter of its random bits.
  __device__ int64_t Offset(const BlockIndex& b, int j) const { return (b.o * k + b.kb * kBlock + j) * inner + b.i; }
};

__device__ inline int64_t ThreadIndex() { return blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; }

// n (a multiple of 16 bytes' worth) consecutive elements at p, when p is 16-byte aligned, as 16-byte vector loads and
// stores: a quarter (float32) or an eighth (16-bit floats) of the scalar accesses, each a whole 16-byte sector. XLA's
// buffers are aligned far beyond 16 bytes, and a block's start is 32 or 64 bytes into one, so the scalar path below
// serves only offsets that break this.
__device__ inline bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Calls f(j, element j) for the n elements of the run at p, read as 16-byte vectors.
template <int n, typename T, typename F>
__device__ void ForEachInRun(const T* p, F&& f) {
  constexpr int kPer = 16 / sizeof(T);
  static_assert(n % kPer == 0, "a run is whole 16-byte vectors");
  for (int c = 0; c < n / kPer; ++c) {
    const uint4 w = reinterpret_cast<const uint4*>(p)[c];
    T e[kPer];
    memcpy(e, &w, sizeof w);
    for (int j = 0; j < kPer; ++j) f(c * kPer + j, e[j]);
  }
}

template <int n, typename T>
__device__ void LoadRun(const T* p, float* v) {
  ForEachInRun<n>(p, [&](int j, T e) { v[j] = ToFloat(e); });
}

template <int n, typename T>
__device__ void StoreRun(T* p, const float* v) {
  constexpr int kPer = 16 / sizeof(T);
  static_assert(n % kPer == 0, "a run is whole 16-byte vectors");
  for (int c = 0; c < n / kPer; ++c) {
    T e[kPer];
    for (int j = 0; j < kPer; ++j) e[j] = FromFloat<T>(v[c * kPer + j]);
    uint4 w;
    memcpy(&w, e, sizeof w);
    reinterpret_cast<uint4*>(p)[c] = w;
  }
}

// A block's 16 elements: consecutive when the axis is the last one (inner == 1), else `inner` apart.
template <typename T>
__device__ void LoadBlock(const T* x, const BlockGrid& g, const BlockIndex& b, float* v) {
  const T* first = x + g.Offset(b, 0);
  if (g.inner == 1 && Aligned16(first)) return LoadRun<kBlock>(first, v);
  for (int j = 0; j < kBlock; ++j) v[j] = ToFloat(x[g.Offset(b, j)]);
}

template <typename T>
__device__ void StoreBlock(T* y, const BlockGrid& g, const BlockIndex& b, const float* v) {
  T* first = y + g.Offset(b, 0);
  if (g.inner == 1 && Aligned16(first)) return StoreRun<kBlock>(first, v);
  for (int j = 0; j < kBlock; ++j) y[g.Offset(b, j)] = FromFloat<T>(v[j]);
}

// Quantizes one block per thread (after the RHT if asked) and hands (block, scale, E2M1 values, the block's amax, a 2D
// tile's being the tile's) to `sink`, which decodes them (qdq), packs them (quantize_packed) or measures them
// (stats_sink.cuh); a sink's Skip() is true when the whole launch has nothing to do. s_dec and key stay on the device:
// no host synchronization.
template <typename T, typename Sink>
__global__ void QuantizeKernel(const T* x, BlockGrid g, Recipe r, const float* s_dec, const uint32_t* key, Sink sink) {
  if (sink.Skip()) return;  // uniform across the launch (a telemetry step that is not recorded)
  const BlockIndex b = g.Locate(ThreadIndex());
  float v[kBlock] = {};
  if (b.active) {
    LoadBlock(x, g, b, v);
    if (r.rht) Rht16(v, r.signs.sign_quarter);
  }
  float amax = 0.0f;
  for (int j = 0; j < kBlock; ++j) amax = MaxNan(amax, Abs(v[j]));
  if (r.block_2d) {  // every lane takes part, active or not: the tile is the aligned half-warp
    for (int lane = 8; lane > 0; lane /= 2) amax = MaxNan(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, lane));
  }
  const TensorScale ts = MakeTensorScale(*s_dec);
  const uint32_t mixed_key = r.stochastic ? Mix32(*key) : 0u;
  BlockScale bs = MakeBlockScale(amax, ts);
  if (r.four_over_six) {  // every lane takes part, as above (an inactive lane's zeros add no error)
    const BlockScale four = MakeBlockScaleToFour(amax, ts);
    float sse[2];
    for (int c = 0; c < 2; ++c) {
      float e[kBlock];
      for (int j = 0; j < kBlock; ++j) {
        const float u =
            r.stochastic && b.active ? UniformFromBits(RandomBits(mixed_key, static_cast<uint32_t>(g.Offset(b, j))))
                                     : 0.0f;
        e[j] = SquaredError(v[j], c == 0 ? bs : four, ts.s_dec, r.stochastic, u);
      }
      sse[c] = TreeSum16(e);
      if (r.block_2d) {  // the tile's sum over its blocks (lanes) by halves, as numerics/nvfp4.py _four_over_six
        for (int lane = 8; lane > 0; lane /= 2) sse[c] += __shfl_xor_sync(0xFFFFFFFFu, sse[c], lane);
      }
    }
    if (sse[1] < sse[0]) bs = four;  // a tie keeps 6
  }
  if (!b.active) return;
  float q[kBlock];
  for (int j = 0; j < kBlock; ++j) {
    const float u = r.stochastic ? UniformFromBits(RandomBits(mixed_key, static_cast<uint32_t>(g.Offset(b, j)))) : 0.0f;
    q[j] = QuantizeElement(v[j], bs, r.stochastic, u);
  }
  sink(g, b, bs, ts, q, amax);
}

// ---- where the axis is the last one: a warp per 16 runs (warp_quantize.h) ----

struct WarpLanes {
  __device__ int Lane() const { return threadIdx.x & (kWarp - 1); }
  __device__ float Xor(float v, int mask) const { return __shfl_xor_sync(0xFFFFFFFFu, v, mask); }
};

// QuantizeKernel's work for x viewed as (rows, K) with K last, each lane reading and handing on E = 16 / sizeof(T)
// consecutive elements as one 16-byte vector: sink(r, first, part, active, block scale, tensor scale, q[E]) as
// QuantizeWarpRuns says. A warp leaves as a whole (kThreadsPerBlock is a multiple of 32), so every shuffle has its
// 32 lanes. The buffers must be 16-byte aligned (LaunchQuantize).
template <typename T, typename Sink>
__global__ void QuantizeRunsKernel(const T* x, RunGrid g, Recipe r, const float* s_dec, const uint32_t* key,
                                   Sink sink) {
  const int64_t w = ThreadIndex() / kWarp;
  if (w >= g.Warps()) return;
  constexpr int E = RunLayout<sizeof(T)>::E;
  QuantizeWarpRuns<sizeof(T)>(g, r, MakeTensorScale(*s_dec), r.stochastic ? Mix32(*key) : 0u, w, WarpLanes{},
                              [&](int64_t at, float* v) { LoadRun<E>(x + at, v); }, sink);
}

// The warp kernel's sinks: a lane's E values decoded into y, or packed (E / 2 bytes of E2M1 pairs, the even element
// low; the run's E4M3 scale from its first lane), at the elements' own positions.
template <typename T>
struct WarpDequantizeSink {
  T* y;
  bool apply_global_scale;
  __device__ void operator()(int, int64_t first, int part, bool active, const BlockScale& bs, const TensorScale& ts,
                             const float* q) const {
    constexpr int E = RunLayout<sizeof(T)>::E;
    if (!active) return;
    const float s_dec = apply_global_scale ? ts.s_dec : 1.0f;
    float v[E];
    for (int e = 0; e < E; ++e) v[e] = DecodeElement(q[e], bs.scale, s_dec);
    StoreRun<E>(y + first + part * E, v);
  }
};

template <typename T>
struct WarpPackSink {
  uint8_t* data;
  uint8_t* scales;
  __device__ void operator()(int, int64_t first, int part, bool active, const BlockScale& bs, const TensorScale&,
                             const float* q) const {
    constexpr int E = RunLayout<sizeof(T)>::E;
    using Word = std::conditional_t<E == 4, uint16_t, uint32_t>;  // E codes, 4 bits each
    if (!active) return;
    Word packed = 0;
    for (int e = 0; e < E; ++e) packed |= static_cast<Word>(E2M1Code(q[e])) << (4 * e);
    reinterpret_cast<Word*>(data)[(first + part * E) / E] = packed;
    if (part == 0) scales[first / kBlock] = bs.code;
  }
};

// The quantizing kernel for x viewed as (outer, K, inner) into `out`: the warp kernel with `warp_sink` where K is last
// and x and out are 16-byte aligned (every lane's 16 bytes then are), else one thread per block with `sink`.
template <typename T, typename Sink, typename WarpSink>
void LaunchQuantize(cudaStream_t stream, const T* x, const void* out, int64_t outer, int64_t k, int64_t inner,
                    const Recipe& r, const float* s_dec, const uint32_t* key, const Sink& sink,
                    const WarpSink& warp_sink) {
  const auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  if (inner == 1 && aligned(x) && aligned(out)) {
    const RunGrid runs{outer, k, r.block_2d};
    QuantizeRunsKernel<<<GridSize(runs.Warps() * kWarp), kThreadsPerBlock, 0, stream>>>(x, runs, r, s_dec, key,
                                                                                         warp_sink);
    return;
  }
  const BlockGrid g = BlockGrid::Make(outer, k, inner, r.block_2d);
  QuantizeKernel<<<GridSize(g.Threads()), kThreadsPerBlock, 0, stream>>>(x, g, r, s_dec, key, sink);
}

// ---- the OCP MX formats' blocks of 32 (numerics/mx.py): xla_fp4_mx_qdq and xla_fp4_mx_quantize_packed ----

// x as (outer, K, inner) in MX blocks of 32 along K: one thread per 1x32 block, or with block_2d per 32x32 tile (its
// 32 blocks, fewer at the end, along the partner dim: inner, or outer where inner is 1), as the CPU kernels walk
// them (cpu_common.h ForEachMxBlock).
struct MxGrid {
  int64_t outer, k, inner;
  bool block_2d, fp8;
  __host__ __device__ int64_t Threads() const {
    const int64_t blocks = k / kMxBlock;
    if (!block_2d) return outer * blocks * inner;
    return blocks * (inner > 1 ? (inner + kMxBlock - 1) / kMxBlock * outer : (outer + kMxBlock - 1) / kMxBlock * inner);
  }
};

// The 32 values of the MX block at (o, block, i), after the RHT where it applies; whether any is NaN or Inf.
template <typename T>
__device__ bool LoadMxBlock(const T* x, const MxGrid& g, int64_t o, int64_t block, int64_t i, const Recipe& r,
                            float* v, float* amax) {
  const int64_t base = (o * g.k + block * kMxBlock) * g.inner + i;
  if (g.inner == 1 && Aligned16(x + base)) {
    LoadRun<kMxBlock>(x + base, v);
  } else {
    for (int j = 0; j < kMxBlock; ++j) v[j] = ToFloat(x[base + j * g.inner]);
  }
  return MxPrepareBlock(v, r, amax);
}

// Each block of the thread's block or tile rounded onto the element grid and handed to the sink:
// sink(g, base, scale_at, q, scale, scale_byte), base its first element in x (elements `inner` apart), scale_at its
// position in x's dims with the axis divided by 32, q its 32 elements (x / 2^s rounded), and its scale (MakeMxScale)
// and E8M0 byte. Stochastic rounding draws from the element's row-major position, as on the CPU.
template <typename T, typename Sink>
__global__ void MxKernel(const T* x, MxGrid g, Recipe r, const uint32_t* key, Sink sink) {
  const int64_t t = ThreadIndex();
  if (t >= g.Threads()) return;
  const int64_t blocks = g.k / kMxBlock;
  const bool along_inner = g.inner > 1;
  int width = 1;  // the tile's blocks: 32, fewer in a partial tile at the end of the partner dim
  int64_t o, block, i;
  if (!r.block_2d) {
    o = t / (blocks * g.inner), block = (t / g.inner) % blocks, i = t % g.inner;
  } else if (along_inner) {
    const int64_t per = (g.inner + kMxBlock - 1) / kMxBlock;
    o = t / (blocks * per), block = (t / per) % blocks, i = (t % per) * kMxBlock;
    width = static_cast<int>(g.inner - i < kMxBlock ? g.inner - i : kMxBlock);
  } else {
    o = (t / blocks) * kMxBlock, block = t % blocks, i = 0;
    width = static_cast<int>(g.outer - o < kMxBlock ? g.outer - o : kMxBlock);
  }
  float v[kMxBlock];
  float m = 0.0f, a;
  bool bad = false;
  for (int w = 0; w < width; ++w) {
    bad |= LoadMxBlock(x, g, o + (along_inner ? 0 : w), block, i + (along_inner ? w : 0), r, v, &a);
    m = a > m ? a : m;
  }
  const MxScale ms = MakeMxScale(m, bad, g.fp8);
  const uint8_t byte = MxScaleByte(m, bad, g.fp8);
  const uint32_t mixed_key = Mix32(*key);
  float q[kMxBlock];
  for (int w = 0; w < width; ++w) {
    const int64_t ow = o + (along_inner ? 0 : w), iw = i + (along_inner ? w : 0);
    LoadMxBlock(x, g, ow, block, iw, r, v, &a);
    const int64_t base = (ow * g.k + block * kMxBlock) * g.inner + iw;
    for (int j = 0; j < kMxBlock; ++j) {
      const float u =
          r.stochastic ? UniformFromBits(RandomBits(mixed_key, static_cast<uint32_t>(base + j * g.inner))) : 0.0f;
      q[j] = MxRoundElement(v[j] * ms.inverse, g.fp8, r.stochastic, u);
    }
    sink(g, base, (ow * blocks + block) * g.inner + iw, q, ms, byte);
  }
}

}  // namespace xla_fp4::cuda

#endif  // XLA_FP4_CUDA_BLOCK_KERNEL_CUH_
