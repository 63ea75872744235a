// Telemetry on CUDA: the statistics of one quantization (numerics/telemetry.py FIELDS), measured by a quantizing
// kernel's sink (block_kernel.cuh QuantizeKernel) from the block it just quantized, so that the statistics cost no
// second read of x from memory: xla_fp4_qdq_with_scale_stats, xla_fp4_qdq_and_stats (qdq_kernels.cu) and
// xla_fp4_quantize_packed_stats (packed_kernels.cu). Internal linkage: each .cu file that includes it gets its own copy.
#ifndef XLA_FP4_CUDA_STATS_SINK_CUH_
#define XLA_FP4_CUDA_STATS_SINK_CUH_

#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>

#include "xla/ffi/api/ffi.h"
#include "xla_fp4/cuda/block_kernel.cuh"
#include "xla_fp4/cuda/cuda_util.h"
#include "xla_fp4/telemetry_fields.h"

namespace xla_fp4::cuda {
namespace {

namespace cg = cooperative_groups;

// Each thread compares its block's q * scale with the block's x (reloaded, the RHT applied) and adds to counts[7] (amax
// bits by max; nonzero, underflow, kept elements; live, zero-scale and clipped blocks) and energies[2] (x², error²).
// Counts are exact and order-free; the energies' order follows the warps' reductions and the atomics (float rounding
// only).
template <typename T>
struct StatsSink {
  const T* x;
  Recipe r;
  static constexpr int kCounts = 7;
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
      m = max(m, BitsOf(v[j]) & 0x7FFFFFFFu);  // NaN above +Inf: AmaxFromBits gives NaN, as on CPU
      nonzero += v[j] != 0.0f;
      underflow += v[j] != 0.0f && qs == 0.0f;
      kept += qs != 0.0f;
      energy += static_cast<double>(v[j] * v[j]);
      error += static_cast<double>(e * e);
    }
    const bool live = LiveBlock(amax);  // the block's amax as the quantizer saw it (a 2D tile's: the tile's)
    const unsigned long long block_counts[kCounts] = {
        m, nonzero, underflow, kept, live, live && bs.code == 0,
        live && amax * ts.s_enc_over_6 >= 464.0f};  // numerics/telemetry.py _CLIPPED
    // Every thread of the grid adds to the same 9 addresses: the lanes measuring a block reduce first, and one of
    // them adds the warp's sums (a count that is zero adds nothing).
    const cg::coalesced_group lanes = cg::coalesced_threads();
    const unsigned long long warp_max = cg::reduce(lanes, block_counts[0], cg::greater<unsigned long long>());
    unsigned long long warp_counts[kCounts];
    for (int i = 1; i < kCounts; ++i) {
      warp_counts[i] = cg::reduce(lanes, block_counts[i], cg::plus<unsigned long long>());
    }
    const double warp_energy = cg::reduce(lanes, energy, cg::plus<double>());
    const double warp_error = cg::reduce(lanes, error, cg::plus<double>());
    if (lanes.thread_rank() != 0) return;
    if (warp_max != 0) atomicMax(&counts[0], warp_max);
    for (int i = 1; i < kCounts; ++i) {
      if (warp_counts[i] != 0) atomicAdd(&counts[i], warp_counts[i]);
    }
    atomicAdd(&energies[0], warp_energy);
    atomicAdd(&energies[1], warp_error);
  }
};

// The sink's accumulators (7 counts, 2 energies), zeroed on the stream, in scratch memory.
struct StatsAccumulators {
  unsigned long long* counts = nullptr;
  double* energies = nullptr;

  static constexpr size_t kBytes = 7 * sizeof(unsigned long long) + 2 * sizeof(double);

  static ffi::Error Allocate(ffi::ScratchAllocator& scratch, cudaStream_t stream, StatsAccumulators* out) {
    std::optional<void*> words = scratch.Allocate(kBytes, alignof(double));
    if (!words.has_value()) return ffi::Error(ffi::ErrorCode::kResourceExhausted, "no scratch memory for the stats");
    out->counts = static_cast<unsigned long long*>(*words);
    out->energies = reinterpret_cast<double*>(out->counts + 7);
    return CudaStatus(cudaMemsetAsync(*words, 0, kBytes, stream), "cudaMemsetAsync");
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
  row[kAmax] = AmaxFromBits(static_cast<uint32_t>(counts[0]));
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

}  // namespace
}  // namespace xla_fp4::cuda

#endif  // XLA_FP4_CUDA_STATS_SINK_CUH_
