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

#include "xla/ffi/api/ffi.h"
#include "xla_fp4/cuda/cuda_util.h"
#include "xla_fp4/nvfp4_format.h"

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

template <typename T>
__device__ void LoadBlock(const T* x, const BlockGrid& g, const BlockIndex& b, float* v) {
  for (int j = 0; j < kBlock; ++j) v[j] = ToFloat(x[g.Offset(b, j)]);
}

template <typename T>
__device__ void StoreBlock(T* y, const BlockGrid& g, const BlockIndex& b, const float* v) {
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
  if (!b.active) return;
  const TensorScale ts = MakeTensorScale(*s_dec);
  const BlockScale bs = MakeBlockScale(amax, ts);
  const uint32_t mixed_key = r.stochastic ? Mix32(*key) : 0u;
  float q[kBlock];
  for (int j = 0; j < kBlock; ++j) {
    const float u = r.stochastic ? UniformFromBits(RandomBits(mixed_key, static_cast<uint32_t>(g.Offset(b, j)))) : 0.0f;
    q[j] = QuantizeElement(v[j], bs, r.stochastic, u);
  }
  sink(g, b, bs, ts, q, amax);
}

}  // namespace xla_fp4::cuda

#endif  // XLA_FP4_CUDA_BLOCK_KERNEL_CUH_
