// Telemetry on CPU: the statistics of one quantization (numerics/telemetry.py FIELDS), measured by a quantizing kernel
// from the tiles its walker (cpu_common.h ForEachQuantizedTile) hands it, so that the statistics cost no second read
// of x from memory: xla_fp4_qdq_with_scale_stats, xla_fp4_qdq_and_stats and
// xla_fp4_quantize_packed_stats (quantize_stats_kernels.cc).
#ifndef XLA_FP4_CPU_STATS_H_
#define XLA_FP4_CPU_STATS_H_

#include <cstdint>
#include <vector>

#include "xla_fp4/cpu_common.h"
#include "xla_fp4/telemetry_fields.h"

namespace xla_fp4::cpu {

// Each tile writes its own entry (no locks, and the sum over tiles runs in one order, whatever the threads did).
// Counts of elements whose block is live (or whose scale underflows or clips) are 16 times the blocks' counts: every
// block has 16 elements (K % 16 == 0), so counting elements never counts a padded tile's missing blocks.
struct TileStats {
  uint32_t amax_bits;
  uint16_t nonzero, underflow, kept, live, scale_zero, clipped;  // at most 256 each
  float energy, error;
};

constexpr float kClippedScale = 464.0f;  // numerics/telemetry.py _CLIPPED: halfway from E4M3's 448 to 480

// The walker's q * scale values (v) against the tile of x they came from, reloaded (from cache) with the RHT.
template <RhtAlong kRht, Blocks kBlocks, typename T>
XLA_FP4_VECTOR_CLONES TileStats MeasureTile(const T* x, const View& view, const TilePos& p, const float* sign_quarter,
                                            const float (&v)[kBlock][kBlock], const uint8_t* code,
                                            const TensorScale& scale) {
  alignas(64) float a[kBlock][kBlock];
  LoadTransformed<kRht, false>(x, view, p, sign_quarter, a);
  uint32_t am[kBlock] = {};
  for (int i = 0; i < kBlock; ++i) {
    for (int j = 0; j < kBlock; ++j) {
      const int b = BlockOf<kBlocks>(i, j);
      const uint32_t m = BitsOf(a[i][j]) & 0x7FFFFFFFu;
      am[b] = m > am[b] ? m : am[b];
    }
  }
  // Whole tiles in fixed-trip loops that vectorize (the bounds compile-time constants); a padded tile's missing
  // elements (zeros in a; in v zero, or NaN in a NaN tile) must not count, so it takes the bounded loop. Every sum and
  // maximum runs down the columns first, in 16 lanes (one per column, so a row is one vector operation and no row ends
  // in a reduction across lanes), then across the lanes. The energies' order is not the twin's jnp.sum's, as no order
  // is (telemetry takes energies to float rounding), and it is the same whatever the threads do.
  alignas(64) uint32_t amax_j[kBlock] = {}, nonzero_j[kBlock] = {}, underflow_j[kBlock] = {}, kept_j[kBlock] = {};
  alignas(64) float energy_j[kBlock] = {}, error_j[kBlock] = {};
  auto accumulate = [&](auto nl, auto nc) {
    for (int i = 0; i < nl; ++i) {
      for (int j = 0; j < nc; ++j) {
        const float x_ij = a[i][j], q_ij = v[i][j], e = x_ij - q_ij * scale.s_dec;
        const uint32_t m = BitsOf(x_ij) & 0x7FFFFFFFu;
        amax_j[j] = m > amax_j[j] ? m : amax_j[j];
        nonzero_j[j] += x_ij != 0.0f;
        underflow_j[j] += (x_ij != 0.0f) & (q_ij == 0.0f);
        kept_j[j] += q_ij != 0.0f;
        energy_j[j] += x_ij * x_ij;
        error_j[j] += e * e;
      }
    }
  };
  if (p.full) {
    accumulate(std::integral_constant<int, kBlock>{}, std::integral_constant<int, kBlock>{});
  } else {
    accumulate(p.nl, p.nc);
  }
  uint32_t amax = 0;
  int nonzero = 0, underflow = 0, kept = 0, live = 0, scale_zero = 0, clipped = 0;
  for (int j = 0; j < kBlock; ++j) {
    amax = amax_j[j] > amax ? amax_j[j] : amax;
    nonzero += nonzero_j[j], underflow += underflow_j[j], kept += kept_j[j];
  }
  const int nl = p.full ? kBlock : p.nl, nc = p.full ? kBlock : p.nc;
  // Per block, weighted by its elements in this tile: a row (kRow), a column (kCol) or the whole tile (kTile).
  const int per_block = kBlocks == Blocks::kRow ? nc : (kBlocks == Blocks::kCol ? nl : nl * nc);
  const int blocks = kBlocks == Blocks::kRow ? nl : (kBlocks == Blocks::kCol ? nc : 1);
  for (int b = 0; b < blocks; ++b) {
    const bool is_live = LiveBlock(AmaxFromBits(am[b]));
    live += is_live * per_block;
    scale_zero += (is_live & (code[b] == 0)) * per_block;
    clipped += (is_live & (AmaxFromBits(am[b]) * scale.s_enc_over_6 >= kClippedScale)) * per_block;
  }
  TileStats s;
  s.amax_bits = amax;
  s.nonzero = static_cast<uint16_t>(nonzero), s.underflow = static_cast<uint16_t>(underflow);
  s.kept = static_cast<uint16_t>(kept), s.live = static_cast<uint16_t>(live);
  s.scale_zero = static_cast<uint16_t>(scale_zero), s.clipped = static_cast<uint16_t>(clipped);
  s.energy = TreeSum16(energy_j), s.error = TreeSum16(error_j);
  return s;
}

// The statistics of one quantization of x, tile by tile: a quantizing kernel's walker hands every tile it quantized
// to Measure (any thread, each tile once), then Row writes the FIELDS row.
template <typename T>
class QuantizationStats {
 public:
  QuantizationStats(const T* x, const Geometry& g, const Recipe& r, const TensorParams& tensor)
      : x_(x), g_(g), rht_(r.rht_signs()), scale_(tensor.scale) {
    const View view = ViewOf(g, r.block_2d ? Blocks::kTile : (g.axis_last() ? Blocks::kRow : Blocks::kCol));
    col_groups_ = (view.cols + kBlock - 1) / kBlock;
    tiles_.resize(view.tiles());
  }

  // v: the tile's q * scale (the decoded values without s_dec), code[b] block b's E4M3 scale code.
  template <Blocks kBlocks>
  void Measure(const View& view, const TilePos& p, const float (&v)[kBlock][kBlock], const uint8_t* code) {
    const int64_t t = p.base / view.cols / kBlock * col_groups_ + p.base % view.cols / kBlock;
    const float* sq = rht_ != nullptr ? rht_->sign_quarter : nullptr;
    WithRht(RhtDirection(g_, rht_), [&](auto along) {
      tiles_[t] = MeasureTile<decltype(along)::value, kBlocks>(x_, view, p, sq, v, code, scale_);
      return 0;
    });
  }

  void Row(float* row) const {
    uint32_t amax_bits = 0;
    int64_t counts[6] = {};
    double energy = 0, error = 0;
    for (const TileStats& s : tiles_) {
      amax_bits = s.amax_bits > amax_bits ? s.amax_bits : amax_bits;
      const uint16_t c[6] = {s.nonzero, s.underflow, s.kept, s.live, s.scale_zero, s.clipped};
      for (int i = 0; i < 6; ++i) counts[i] += c[i];
      energy += s.energy, error += s.error;
    }
    using namespace telemetry;  // NOLINT: the field names
    row[kAmax] = AmaxFromBits(amax_bits);
    row[kDecodeScale] = scale_.s_dec;
    row[kElements] = static_cast<float>(g_.size());
    row[kNonzero] = static_cast<float>(counts[0]);
    row[kUnderflow] = static_cast<float>(counts[1]);
    row[kQuantizedNonzero] = static_cast<float>(counts[2]);
    row[kEnergy] = static_cast<float>(energy);
    row[kErrorEnergy] = static_cast<float>(error);
    row[kLiveBlocks] = static_cast<float>(counts[3] / kBlock);
    row[kScaleUnderflow] = static_cast<float>(counts[4] / kBlock);
    row[kScaleSaturated] = static_cast<float>(counts[5] / kBlock);
  }

 private:
  const T* x_;
  Geometry g_;
  const RhtSigns* rht_;
  TensorScale scale_;
  int64_t col_groups_ = 0;
  std::vector<TileStats> tiles_;
};

}  // namespace xla_fp4::cpu

#endif  // XLA_FP4_CPU_STATS_H_
