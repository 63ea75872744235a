// The CUDA kernels' quantizer where the axis is the last one: a warp quantizes 16 runs of 16 consecutive elements,
// each run spread over the lanes of a group so that neighbouring lanes read and write neighbouring 16 bytes.
//
//   float32: 4 lanes a run, 4 elements a lane, 2 runs a lane (slots g and g + 8 of the warp's 16)
//   16-bit:  2 lanes a run, 8 elements a lane, 1 run a lane  (slot g)
//
// so one 16-byte load per lane and run moves 512 consecutive bytes per warp (1x16 blocks: the warp's runs are 16
// consecutive blocks) or 8 / 16 whole 64- / 32-byte row segments (16x16 tiles: the warp's runs are the tile's rows).
// The one-thread-per-block kernel (cuda/block_kernel.cuh QuantizeKernel) read 64 bytes per lane there, lanes 64 bytes
// (1x16) or a row (16x16) apart. Where the axis is not the last one that kernel stays: its lanes walk `inner`, already
// neighbours in memory.
//
// The numbers are the one-thread-per-block kernel's, bit for bit: the block amax and the Four Over Six sums
// (TreeSum16's halves, then a tile's halves over its 16 blocks) and the RHT's butterflies (Rht16's stages) pair the
// same elements in the same order; a stage whose pairs sit in two lanes exchanges them by an xor shuffle, and both
// lanes compute the same sum (float addition commutes), so every lane of a group holds the group's result. The code is
// host-device so that a host simulation of a warp (tests/kernels/test_warp_quantize.py, xla_fp4/tests/
// warp_quantize_sim.cc) runs it against the CPU kernels: `Lanes` supplies the lane index and the xor shuffle.
#ifndef XLA_FP4_WARP_QUANTIZE_H_
#define XLA_FP4_WARP_QUANTIZE_H_

#include <cstdint>

#include "xla_fp4/nvfp4_format.h"

namespace xla_fp4 {

inline constexpr int kWarp = 32;
inline constexpr int kWarpRuns = 16;  // runs of 16 elements per warp: 16 blocks, or one 16x16 tile's rows

// Per element size: E elements a lane (16 bytes), L lanes a run, R runs a lane.
template <int kElementBytes>
struct RunLayout {
  static constexpr int E = 16 / kElementBytes;
  static constexpr int L = kBlock / E;
  static constexpr int kGroups = kWarp / L;  // runs side by side in one 16-byte step
  static constexpr int R = kWarpRuns / kGroups;
  static_assert(kElementBytes == 2 || kElementBytes == 4, "float32 or a 16-bit float");
};

// x as (rows, k), k a multiple of 16, quantized along k (the last axis) in 1x16 blocks or 16x16 tiles.
struct RunGrid {
  int64_t rows, k;
  bool block_2d;

  XLA_FP4_HOST_DEVICE int64_t Warps() const {
    const int64_t blocks_per_row = k / kBlock;
    if (block_2d) return (rows + kWarpRuns - 1) / kWarpRuns * blocks_per_row;
    return (rows * blocks_per_row + kWarpRuns - 1) / kWarpRuns;
  }

  // The first element of run `slot` of warp w (row-major; also the counter of its random bits); false past the end.
  XLA_FP4_HOST_DEVICE bool Run(int64_t w, int slot, int64_t* first) const {
    const int64_t blocks_per_row = k / kBlock;
    if (block_2d) {  // warp w: tile (w / blocks_per_row, w % blocks_per_row), slot = the tile's row
      const int64_t row = w / blocks_per_row * kWarpRuns + slot;
      *first = row * k + w % blocks_per_row * kBlock;
      return row < rows;
    }
    const int64_t block = w * kWarpRuns + slot;  // blocks are consecutive in memory along k
    *first = block * kBlock;
    return block < rows * blocks_per_row;
  }
};

// Exchanges (xor shuffles) within a run's lane group, and the stage of a butterfly on elements j = part * E + e.
template <int E, typename Lanes>
XLA_FP4_HOST_DEVICE void RhtAcrossLanes(float* v, int part, const float* sign_quarter, const Lanes& lanes) {
  for (int half = 1; half < kBlock; half *= 2) {  // Rht16's stages, in its order
    if (half < E) {
      for (int g = 0; g < E; g += 2 * half) {
        for (int i = g; i < g + half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a + b;
          v[i + half] = a - b;
        }
      }
    } else {  // pairs (j, j + half) in lanes part and part ^ mask: the lower lane keeps a + b, the upper a - b
      const int mask = half / E;
      const bool upper = (part & mask) != 0;
      for (int e = 0; e < E; ++e) {
        const float other = lanes.Xor(v[e], mask);
        v[e] = upper ? other - v[e] : v[e] + other;
      }
    }
  }
  for (int e = 0; e < E; ++e) v[e] *= sign_quarter[part * E + e];
}

// TreeSum16 of a run's 16 values, E per lane: the halves that span lanes first (a butterfly, so every lane of the
// group ends with the same partial sums), then the lane's own.
template <int E, typename Lanes>
XLA_FP4_HOST_DEVICE float TreeSumAcrossLanes(float* a, const Lanes& lanes) {
  int width = kBlock / 2;
  for (; width >= E; width /= 2) {
    for (int e = 0; e < E; ++e) a[e] += lanes.Xor(a[e], width / E);
  }
  for (; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) a[l] += a[l + width];
  }
  return a[0];
}

// A 16x16 tile's sum over its 16 blocks by halves (block = slot = group + kGroups * r), as the one-thread-per-block
// kernel's half-warp butterfly: the halves that span a lane's runs in the lane, the others across groups.
template <typename Layout, typename Lanes>
XLA_FP4_HOST_DEVICE void TileSumAcrossLanes(float* s, const Lanes& lanes) {
  for (int width = kWarpRuns / 2; width > 0; width /= 2) {
    if (width >= Layout::kGroups) {
      const int step = width / Layout::kGroups;
      for (int r = 0; r < Layout::R; ++r) {
        if ((r & step) == 0) s[r] += s[r + step];
      }
      for (int r = 0; r < Layout::R; ++r) s[r] = s[r & ~(2 * step - 1)];  // every run of the lane: the tile's value
    } else {
      for (int r = 0; r < Layout::R; ++r) s[r] += lanes.Xor(s[r], width * Layout::L);
    }
  }
}

// The lane's part of warp w's runs, quantized: for each of its R runs, sink(r, first, part, active, block scale,
// tensor scale, q[E]) with first the run's first element and q the E2M1 values of elements first + part * E + e.
// Every lane takes part in every exchange, active or not (an inactive run is zeros and adds nothing). `load(first +
// part * E, v)` reads the lane's E elements as float32 (as the kernels' ToFloat).
template <int kElementBytes, typename Lanes, typename Load, typename Sink>
XLA_FP4_HOST_DEVICE void QuantizeWarpRuns(const RunGrid& g, const Recipe& r, const TensorScale& ts, uint32_t mixed_key,
                                          int64_t w, const Lanes& lanes, Load&& load, Sink&& sink) {
  using Layout = RunLayout<kElementBytes>;
  constexpr int E = Layout::E, L = Layout::L, R = Layout::R;
  const int lane = lanes.Lane(), part = lane % L, group = lane / L;
  float v[R][E];
  int64_t first[R];
  bool active[R];
  float amax[R];
  for (int k = 0; k < R; ++k) {
    active[k] = g.Run(w, group + Layout::kGroups * k, &first[k]);
    if (active[k]) {
      load(first[k] + part * E, v[k]);
    } else {
      for (int e = 0; e < E; ++e) v[k][e] = 0.0f;
    }
    if (r.rht) RhtAcrossLanes<E>(v[k], part, r.signs.sign_quarter, lanes);
    amax[k] = 0.0f;
    for (int e = 0; e < E; ++e) amax[k] = MaxNan(amax[k], Abs(v[k][e]));
    for (int mask = 1; mask < L; mask *= 2) amax[k] = MaxNan(amax[k], lanes.Xor(amax[k], mask));
  }
  if (r.block_2d) {  // the tile's amax over all its runs: the lane's, then across the groups
    float m = amax[0];
    for (int k = 1; k < R; ++k) m = MaxNan(m, amax[k]);
    for (int mask = L; mask < kWarp; mask *= 2) m = MaxNan(m, lanes.Xor(m, mask));
    for (int k = 0; k < R; ++k) amax[k] = m;
  }
  BlockScale bs[R];
  for (int k = 0; k < R; ++k) bs[k] = MakeBlockScale(amax[k], ts);
  if (r.four_over_six) {
    float sse[2][R];
    for (int k = 0; k < R; ++k) {
      const BlockScale four = MakeBlockScaleToFour(amax[k], ts);
      for (int c = 0; c < 2; ++c) {
        float e[E];
        for (int i = 0; i < E; ++i) {
          const uint32_t at = static_cast<uint32_t>(first[k] + part * E + i);
          const float u = r.stochastic && active[k] ? UniformFromBits(RandomBits(mixed_key, at)) : 0.0f;
          e[i] = SquaredError(v[k][i], c == 0 ? bs[k] : four, ts.s_dec, r.stochastic, u);
        }
        sse[c][k] = TreeSumAcrossLanes<E>(e, lanes);
      }
    }
    if (r.block_2d) {
      TileSumAcrossLanes<Layout>(sse[0], lanes);
      TileSumAcrossLanes<Layout>(sse[1], lanes);
    }
    for (int k = 0; k < R; ++k) {
      if (sse[1][k] < sse[0][k]) bs[k] = MakeBlockScaleToFour(amax[k], ts);  // a tie keeps 6
    }
  }
  for (int k = 0; k < R; ++k) {
    float q[E];
    for (int i = 0; i < E; ++i) {
      const uint32_t at = static_cast<uint32_t>(first[k] + part * E + i);
      const float u = r.stochastic ? UniformFromBits(RandomBits(mixed_key, at)) : 0.0f;
      q[i] = QuantizeElement(v[k][i], bs[k], r.stochastic, u);
    }
    sink(k, first[k], part, active[k], bs[k], ts, q);
  }
}

}  // namespace xla_fp4

#endif  // XLA_FP4_WARP_QUANTIZE_H_
