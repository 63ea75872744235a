// Packed NVFP4 (the native backend's storage, numerics/packing.py) and the CPU reference FP4 GEMM.
//
//   xla_fp4_quantize_packed(x (rows, K), s_dec, key) {axis = 1} -> data u8 (rows, K/2), scales u8 (rows, K/16)
//                          (x (K, rows), ...)          {axis = 0} -> data u8 (K/2, rows), scales u8 (K/16, rows)
//                          (its telemetry form, xla_fp4_quantize_packed_stats, is in quantize_stats_kernels.cc)
//   xla_fp4_quantize_packed_pair(x (rows, K), row_s_dec, row_key, col_s_dec, col_key) -> both: along axis 1 and 0
//   xla_fp4_dequantize_packed(data, scales, s_dec) -> x (rows, K) in the result's float dtype
//   xla_fp4_gemm_packed(a_data (M, K/2), a_scales, b_data (N, K/2), b_scales, alpha) -> C (M, N)   ("TN": K-major)
//   xla_fp4_ragged_gemm_packed(a_data, a_scales, b_data, b_scales, group_sizes, alpha) {ragged_k}: the grouped form
//                          (expert GEMMs), one FP4 GEMM per group (ffi_checks.h CheckRaggedGemmPacked)
// The packed MX formats, laid out alike with E8M0 scales per 32 and no tensor scale (fp8: E4M3 codes, one a byte):
//   xla_fp4_mx_quantize_packed(x, key) {axis, ..., fp8} -> data u8 (rows, K/2 or K), scales u8 (rows, K/32)
//   xla_fp4_mx_dequantize_packed(data, scales) {fp8} -> x (rows, K)
//   xla_fp4_mx_gemm_packed(a_data, a_scales, b_data, b_scales) {emulate, b_transposed, fp8} -> C (M, N)
#include <vector>

#include "xla_fp4/cpu_common.h"
#include "xla_fp4/cpu_kernels.h"
#include "xla_fp4/cpu_quantize.h"
#include "xla_fp4/ffi_targets.h"

namespace xla_fp4::cpu {
namespace {

// ---- Impl: the work ----

// Packs tiles [begin, end) of `view` (x of geometry g) into data and scales: the tile walker with the packing sink,
// one instantiation per dtype, blocks, rounding and RHT direction, which the single and the pair quantizer share.
template <typename T, Blocks kBlocks, bool kStochastic, RhtAlong kRht>
void PackTiles(const T* x, const Geometry& g, const View& view, const TensorParams& tensor, const float* sign_quarter,
               bool four_over_six, int64_t begin, int64_t end, uint8_t* data, uint8_t* scales) {
  QuantizeTiles<kBlocks, kStochastic, kRht, /*kDecode=*/false>(
      x, view, tensor, sign_quarter, four_over_six, begin, end,
      [&](const TilePos& p, float (&q)[kBlock][kBlock], const uint8_t* code) {
        PackTile<kBlocks>(g, view, p, q, code, data, scales);
      });
}

template <typename T>
using PackTilesFn = void (*)(const T*, const Geometry&, const View&, const TensorParams&, const float*, bool, int64_t,
                             int64_t, uint8_t*, uint8_t*);

// The tiles x of geometry g is packed in under recipe r (ForEachQuantizedTile's choice), and their packer.
template <typename T>
PackTilesFn<T> PackerFor(const Geometry& g, const Recipe& r, Blocks* blocks) {
  *blocks = r.block_2d ? Blocks::kTile : (g.axis_last() ? Blocks::kRow : Blocks::kCol);
  return WithBool(r.stochastic, [&](auto stochastic) -> PackTilesFn<T> {
    return WithRht(RhtDirection(g, r.rht_signs()), [&](auto along) -> PackTilesFn<T> {
      constexpr bool kS = decltype(stochastic)::value;
      constexpr RhtAlong kA = decltype(along)::value;
      switch (*blocks) {  // kRow only meets the RHT along rows and kCol only down columns (both follow from axis_last)
        case Blocks::kTile: return &PackTiles<T, Blocks::kTile, kS, kA>;
        case Blocks::kRow:
          if constexpr (kA != RhtAlong::kCols) return &PackTiles<T, Blocks::kRow, kS, kA>;
          return nullptr;
        default:
          if constexpr (kA != RhtAlong::kRows) return &PackTiles<T, Blocks::kCol, kS, kA>;
          return nullptr;
      }
    });
  });
}

inline const float* SignQuarter(const Recipe& r) { return r.rht ? r.signs.sign_quarter : nullptr; }

template <typename T>
void QuantizePackedImpl(ffi::ThreadPool& pool, const T* x, const Geometry& g, const Recipe& r,
                        const TensorParams& tensor, uint8_t* data, uint8_t* scales) {
  Blocks blocks;
  const PackTilesFn<T> pack = PackerFor<T>(g, r, &blocks);
  const View view = ViewOf(g, blocks);
  ParallelFor(pool, view.tiles(), kBlock * kBlock, [&](int64_t begin, int64_t end) {
    pack(x, g, view, tensor, SignQuarter(r), r.four_over_six, begin, end, data, scales);
  });
}

// One copy of xla_fp4_quantize_packed_pair: x's geometry along its axis, the recipe, its tensor parameters and
// results.
struct PairCopy {
  Geometry g;
  Recipe r;
  TensorParams tensor;
  uint8_t *data, *scales;
};

// Both copies of x (rows, K), strip by strip: a strip of 16 rows is 16 tiles deep for the column-wise copy (its
// blocks run down the rows) and whole blocks for the row-wise one, tiles [s * K/16, (s + 1) * K/16) of either view.
// The row-wise copy reads the strip from memory in order, the column-wise one (16 rows at once) from the cache
// (16 * K elements: 256 KiB of float32 at K = 4096; the other order measured slower), so x comes from memory once.
// Each copy's numbers are xla_fp4_quantize_packed's (the same tile walker on the same tiles). The CPU kernels are
// bound mostly by their arithmetic, so here the pair runs 0.9-1.2x the two quantizers' rate (benchmarks/kernels.py
// packed_pair, packed_two); the read it saves is a GPU's gain.
template <typename T>
void QuantizePackedPairImpl(ffi::ThreadPool& pool, const T* x, int64_t rows, int64_t k, const PairCopy& row,
                            const PairCopy& col) {
  Blocks row_blocks, col_blocks;
  const PackTilesFn<T> pack_row = PackerFor<T>(row.g, row.r, &row_blocks);
  const PackTilesFn<T> pack_col = PackerFor<T>(col.g, col.r, &col_blocks);
  const View row_view = ViewOf(row.g, row_blocks), col_view = ViewOf(col.g, col_blocks);
  const int64_t per_strip = k / kBlock;
  ParallelFor(pool, rows / kBlock, 2 * kBlock * k, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      pack_row(x, row.g, row_view, row.tensor, SignQuarter(row.r), row.r.four_over_six, s * per_strip,
               (s + 1) * per_strip, row.data, row.scales);
      pack_col(x, col.g, col_view, col.tensor, SignQuarter(col.r), col.r.four_over_six, s * per_strip,
               (s + 1) * per_strip, col.data, col.scales);
    }
  });
}

// MX block b of x (ForEachMxBlock) packed: its E8M0 scale byte at b (the scales have x's dims with the axis divided
// by 32), its codes where its elements sit with the axis divided by 2 (E2M1: two codes adjacent along K share a byte,
// the even one in the low nibble) or 1 (E4M3). The codes decode to xla_fp4_mx_qdq's values of the same recipe.
template <bool kFp8, bool kStochastic>
void PackMxBlock(uint8_t* data, uint8_t* scales, const Geometry& g, int64_t b, const float (&v)[kMxBlock], float amax,
                 uint32_t mixed_key) {
  const bool bad = IsNan(amax);
  const MxScale ms = MakeMxScale(amax, bad, kFp8);
  const int64_t base = MxBlockBase(g, b), i = b % g.inner;
  scales[b] = MxScaleByte(amax, bad, kFp8);
  float q[kMxBlock];
  for (int j = 0; j < kMxBlock; ++j) {
    const float u = kStochastic ? UniformFromBits(RandomBits(mixed_key, static_cast<uint32_t>(base + j * g.inner)))
                                : 0.0f;
    q[j] = MxRoundElement(v[j] * ms.inverse, kFp8, kStochastic, u);
  }
  StoreMxCodes(data, base, i, g.inner, q, kFp8);
}

template <typename T>
void MxQuantizePackedImpl(ffi::ThreadPool& pool, const T* x, const Geometry& g, const Recipe& r, uint32_t key,
                          bool fp8, uint8_t* data, uint8_t* scales) {
  const uint32_t mixed_key = Mix32(key);
  WithBool(fp8, [&](auto f8) {
    return WithBool(r.stochastic, [&](auto sr) {
      ForEachMxBlock(pool, x, g, r, [&](int64_t b, const float (&v)[kMxBlock], float amax) {
        PackMxBlock<decltype(f8)::value, decltype(sr)::value>(data, scales, g, b, v, amax, mixed_key);
      });
      return 0;
    });
  });
}

// Which packed format an operand holds: NVFP4 (E4M3 scales per 16, under s_dec) or an MX format (E8M0 per 32).
struct PackedFormat {
  bool mx = false, fp8 = false;
  PackedLayout layout() const { return mx ? MxPacked(fp8) : kNvfp4Packed; }
};

// out[r, k] = (q * scale) * s_dec (MX: q * scale); with s_dec = 1 this is the exact q * scale that the GEMM
// multiplies.
template <typename T>
void DequantizePackedImpl(ffi::ThreadPool& pool, const uint8_t* data, const uint8_t* scales, int64_t rows, int64_t k,
                          float s_dec, T* out, const PackedFormat& f = {}) {
  if (f.mx) {
    const int64_t row_bytes = k / f.layout().per_byte;
    ParallelFor(pool, rows, k, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        for (int64_t kb = 0; kb < k / kMxBlock; ++kb) {
          const float scale = MxScaleOfByte(scales[row * (k / kMxBlock) + kb]);
          const uint8_t* codes = data + row * row_bytes + kb * (kMxBlock / f.layout().per_byte);
          T* o = out + row * k + kb * kMxBlock;
          for (int j = 0; j < kMxBlock; ++j) Store(o + j, MxDecodeElement(MxPackedElement(codes, j, f.fp8), scale));
        }
      }
    });
    return;
  }
  ParallelFor(pool, rows, k, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t kb = 0; kb < k / kBlock; ++kb) {
        const float scale = E4M3Decode(scales[row * (k / kBlock) + kb]);
        const uint8_t* in = data + row * (k / 2) + kb * (kBlock / 2);
        T* o = out + row * k + kb * kBlock;
        for (int i = 0; i < kBlock / 2; ++i) {
          Store(o + 2 * i, DecodeElement(E2M1Decode(in[i] & 15), scale, s_dec));
          Store(o + 2 * i + 1, DecodeElement(E2M1Decode(in[i] >> 4), scale, s_dec));
        }
      }
    }
  });
}

// C[i, j] = alpha * Σ_{p in [k0, k1)} a[i, p] b[j, p] for a (m, k) and b (n, k) dequantized row-major, float32
// accumulation in a fixed order: 16 lane sums over K (k0 a multiple of 16), then a pairwise tree. C (m, n) row-major.
template <typename T>
void Accumulate(ffi::ThreadPool& pool, const float* a, const float* b, int64_t m, int64_t n, int64_t k, int64_t k0,
                int64_t k1, float alpha, T* c) {
  ParallelFor(pool, m, n * (k1 - k0), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* ai = a + i * k;
      for (int64_t j = 0; j < n; ++j) {
        const float* bj = b + j * k;
        float acc[kBlock] = {};
        for (int64_t p = k0; p < k1; p += kBlock) {
          for (int l = 0; l < kBlock; ++l) acc[l] += ai[p + l] * bj[p + l];
        }
        for (int width = kBlock / 2; width > 0; width /= 2) {
          for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
        }
        Store(c + i * n + j, acc[0] * alpha);
      }
    }
  });
}

// q·scale of packed (rows, K) operands, float32 (exact), for Accumulate.
std::vector<float> Dequantized(ffi::ThreadPool& pool, const uint8_t* data, const uint8_t* scales, int64_t rows,
                               int64_t k, const PackedFormat& f = {}) {
  std::vector<float> out(rows * k);
  DequantizePackedImpl(pool, data, scales, rows, k, 1.0f, out.data(), f);
  return out;
}

// C = alpha * A·Bᵀ (MX: alpha 1); with b_transposed b is Bᵀ (k, n), decoded, then transposed (exact).
template <typename T>
void GemmPackedImpl(ffi::ThreadPool& pool, const uint8_t* a_data, const uint8_t* a_scales, const uint8_t* b_data,
                    const uint8_t* b_scales, int64_t m, int64_t n, int64_t k, bool b_transposed, float alpha, T* c,
                    const PackedFormat& f = {}) {
  const std::vector<float> a = Dequantized(pool, a_data, a_scales, m, k, f);
  std::vector<float> b = Dequantized(pool, b_data, b_scales, b_transposed ? k : n, b_transposed ? n : k, f);
  if (b_transposed) {
    std::vector<float> bt(n * k);
    for (int64_t i = 0; i < k; ++i) {
      for (int64_t j = 0; j < n; ++j) bt[j * k + i] = b[i * n + j];
    }
    b.swap(bt);
  }
  Accumulate(pool, a.data(), b.data(), m, n, k, 0, k, alpha, c);
}

// The grouped GEMM (ffi_checks.h CheckRaggedGemmPacked): group g's rows of A times its B (C's rows outside every group
// zero), or with ragged_k A·Bᵀ over group g's range of K into C[g]; each group's products times alpha[g].
template <typename T>
void RaggedGemmPackedImpl(ffi::ThreadPool& pool, const uint8_t* a_data, const uint8_t* a_scales,
                          const uint8_t* b_data, const uint8_t* b_scales, const int64_t* begin, const int64_t* end,
                          const float* alpha, const RaggedGemmShape& s, bool ragged_k, T* c) {
  const int64_t m = s.m, n = s.n, k = s.k;
  const std::vector<float> a = Dequantized(pool, a_data, a_scales, m, k);
  if (ragged_k) {
    const std::vector<float> b = Dequantized(pool, b_data, b_scales, n, k);
    for (int64_t g = 0; g < s.groups; ++g) Accumulate(pool, a.data(), b.data(), m, n, k, begin[g], end[g], alpha[g],
                                                      c + g * m * n);
    return;
  }
  for (int64_t g = 0; g < s.groups; ++g) {
    if (begin[g] == end[g]) continue;
    const std::vector<float> b = Dequantized(pool, b_data + g * n * (k / 2), b_scales + g * n * (k / kBlock), n, k);
    Accumulate(pool, a.data() + begin[g] * k, b.data(), end[g] - begin[g], n, k, 0, k, alpha[g], c + begin[g] * n);
  }
  // The groups cover consecutive rows from 0 (RaggedGroupRanges): the rows after the last are zero.
  for (int64_t i = s.groups > 0 ? end[s.groups - 1] : 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) Store(c + i * n + j, 0.0f);
  }
}

// ---- FFI handlers (the checks shared with CUDA: ffi_checks.h) ----

ffi::Error QuantizePackedFfi(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer s_dec, ffi::AnyBuffer key,
                             ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> scales, int64_t axis,
                             bool block_2d, bool stochastic, bool rht, int64_t rht_seed, bool four_over_six) {
  Geometry g;
  if (ffi::Error e = CheckQuantizePacked(x, &s_dec, key, *data, *scales, axis, stochastic, rht_seed, &g);
      e.failure()) {
    return e;
  }
  const Recipe recipe(block_2d, stochastic, rht, rht_seed, four_over_six);
  const TensorParams tensor = MakeTensorParams(s_dec, key);
  return QuantizePacked(pool, x, g, recipe, tensor, *data, *scales);
}

ffi::Error QuantizePackedPairFfi(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer row_s_dec,
                                 ffi::AnyBuffer row_key, ffi::AnyBuffer col_s_dec, ffi::AnyBuffer col_key,
                                 ffi::Result<ffi::AnyBuffer> row_data, ffi::Result<ffi::AnyBuffer> row_scales,
                                 ffi::Result<ffi::AnyBuffer> col_data, ffi::Result<ffi::AnyBuffer> col_scales,
                                 bool row_stochastic, bool row_rht, bool col_stochastic, bool col_rht, int64_t rht_seed,
                                 bool four_over_six) {
  Geometry g;
  if (ffi::Error e = CheckQuantizePackedPair(x, row_s_dec, row_key, col_s_dec, col_key, *row_data, *row_scales,
                                             *col_data, *col_scales, row_stochastic, col_stochastic, rht_seed, &g);
      e.failure()) {
    return e;
  }
  const int64_t rows = g.outer, k = g.k;
  Geometry along_rows;  // x (rows, K) quantized along axis 0: outer 1, K rows, inner K
  along_rows.k = rows;
  along_rows.inner = k;
  const auto u8 = [](ffi::Result<ffi::AnyBuffer>& b) { return static_cast<uint8_t*>(b->untyped_data()); };
  const PairCopy row{g, Recipe(false, row_stochastic, row_rht, rht_seed, four_over_six),
                     MakeTensorParams(row_s_dec, row_key), u8(row_data), u8(row_scales)};
  const PairCopy col{along_rows, Recipe(false, col_stochastic, col_rht, rht_seed, four_over_six),
                     MakeTensorParams(col_s_dec, col_key), u8(col_data), u8(col_scales)};
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    QuantizePackedPairImpl(pool, static_cast<const T*>(x.untyped_data()), rows, k, row, col);
    return ffi::Error::Success();
  });
}

ffi::Error DequantizePackedFfi(ffi::ThreadPool pool, ffi::AnyBuffer data, ffi::AnyBuffer scales, ffi::AnyBuffer s_dec,
                               ffi::Result<ffi::AnyBuffer> out) {
  int64_t rows = 0, k = 0;
  if (ffi::Error e = CheckDequantizePacked(data, scales, &s_dec, *out, &rows, &k); e.failure()) return e;
  const float s = *static_cast<const float*>(s_dec.untyped_data());
  return DispatchFloat(out->element_type(), "the result", [&](auto tag) {
    using T = decltype(tag);
    DequantizePackedImpl(pool, static_cast<const uint8_t*>(data.untyped_data()),
                         static_cast<const uint8_t*>(scales.untyped_data()), rows, k, s,
                         static_cast<T*>(out->untyped_data()));
    return ffi::Error::Success();
  });
}

ffi::Error GemmPackedFfi(ffi::ThreadPool pool, ffi::AnyBuffer a_data, ffi::AnyBuffer a_scales, ffi::AnyBuffer b_data,
                         ffi::AnyBuffer b_scales, ffi::AnyBuffer alpha, ffi::Result<ffi::AnyBuffer> c,
                         bool /*emulate: this reference GEMM is the emulation*/, bool b_transposed) {
  int64_t m, n, k;
  if (ffi::Error e = CheckGemmPacked(a_data, a_scales, b_data, b_scales, &alpha, *c, b_transposed, &m, &n, &k);
      e.failure()) {
    return e;
  }
  const float al = *static_cast<const float*>(alpha.untyped_data());
  return DispatchFloat(c->element_type(), "the result", [&](auto tag) {
    using T = decltype(tag);
    GemmPackedImpl(pool, static_cast<const uint8_t*>(a_data.untyped_data()),
                   static_cast<const uint8_t*>(a_scales.untyped_data()),
                   static_cast<const uint8_t*>(b_data.untyped_data()),
                   static_cast<const uint8_t*>(b_scales.untyped_data()), m, n, k, b_transposed, al,
                   static_cast<T*>(c->untyped_data()));
    return ffi::Error::Success();
  });
}

ffi::Error MxQuantizePackedFfi(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer key,
                               ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> scales, int64_t axis,
                               bool block_2d, bool stochastic, bool rht, int64_t rht_seed, bool fp8) {
  Geometry g;
  if (ffi::Error e = CheckQuantizePacked(x, nullptr, key, *data, *scales, axis, stochastic, rht_seed, &g,
                                         MxPacked(fp8));
      e.failure()) {
    return e;
  }
  const Recipe recipe(block_2d, stochastic, rht, rht_seed);
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    MxQuantizePackedImpl(pool, static_cast<const T*>(x.untyped_data()), g, recipe,
                         *static_cast<const uint32_t*>(key.untyped_data()), fp8,
                         static_cast<uint8_t*>(data->untyped_data()), static_cast<uint8_t*>(scales->untyped_data()));
    return ffi::Error::Success();
  });
}

ffi::Error MxDequantizePackedFfi(ffi::ThreadPool pool, ffi::AnyBuffer data, ffi::AnyBuffer scales,
                                 ffi::Result<ffi::AnyBuffer> out, bool fp8) {
  int64_t rows = 0, k = 0;
  if (ffi::Error e = CheckDequantizePacked(data, scales, nullptr, *out, &rows, &k, MxPacked(fp8)); e.failure()) {
    return e;
  }
  return DispatchFloat(out->element_type(), "the result", [&](auto tag) {
    using T = decltype(tag);
    DequantizePackedImpl(pool, static_cast<const uint8_t*>(data.untyped_data()),
                         static_cast<const uint8_t*>(scales.untyped_data()), rows, k, 1.0f,
                         static_cast<T*>(out->untyped_data()), PackedFormat{true, fp8});
    return ffi::Error::Success();
  });
}

ffi::Error MxGemmPackedFfi(ffi::ThreadPool pool, ffi::AnyBuffer a_data, ffi::AnyBuffer a_scales, ffi::AnyBuffer b_data,
                           ffi::AnyBuffer b_scales, ffi::Result<ffi::AnyBuffer> c,
                           bool /*emulate: this reference GEMM is the emulation*/, bool b_transposed, bool fp8) {
  int64_t m, n, k;
  if (ffi::Error e = CheckGemmPacked(a_data, a_scales, b_data, b_scales, nullptr, *c, b_transposed, &m, &n, &k,
                                     MxPacked(fp8));
      e.failure()) {
    return e;
  }
  return DispatchFloat(c->element_type(), "the result", [&](auto tag) {
    using T = decltype(tag);
    GemmPackedImpl(pool, static_cast<const uint8_t*>(a_data.untyped_data()),
                   static_cast<const uint8_t*>(a_scales.untyped_data()),
                   static_cast<const uint8_t*>(b_data.untyped_data()),
                   static_cast<const uint8_t*>(b_scales.untyped_data()), m, n, k, b_transposed, 1.0f,
                   static_cast<T*>(c->untyped_data()), PackedFormat{true, fp8});
    return ffi::Error::Success();
  });
}

ffi::Error RaggedGemmPackedFfi(ffi::ThreadPool pool, ffi::AnyBuffer a_data, ffi::AnyBuffer a_scales,
                               ffi::AnyBuffer b_data, ffi::AnyBuffer b_scales, ffi::AnyBuffer group_sizes,
                               ffi::AnyBuffer alpha, ffi::Result<ffi::AnyBuffer> c, bool ragged_k) {
  RaggedGemmShape shape;
  if (ffi::Error e = CheckRaggedGemmPacked(a_data, a_scales, b_data, b_scales, group_sizes, alpha, *c, ragged_k,
                                           &shape);
      e.failure()) {
    return e;
  }
  std::vector<int64_t> begin(shape.groups), end(shape.groups);
  if (ffi::Error e = RaggedGroupRanges(static_cast<const int32_t*>(group_sizes.untyped_data()), shape.groups,
                                       ragged_k ? shape.k : shape.m, ragged_k, begin.data(), end.data());
      e.failure()) {
    return e;
  }
  return DispatchFloat(c->element_type(), "the result", [&](auto tag) {
    using T = decltype(tag);
    RaggedGemmPackedImpl(pool, static_cast<const uint8_t*>(a_data.untyped_data()),
                         static_cast<const uint8_t*>(a_scales.untyped_data()),
                         static_cast<const uint8_t*>(b_data.untyped_data()),
                         static_cast<const uint8_t*>(b_scales.untyped_data()), begin.data(), end.data(),
                         static_cast<const float*>(alpha.untyped_data()), shape, ragged_k,
                         static_cast<T*>(c->untyped_data()));
    return ffi::Error::Success();
  });
}

}  // namespace

ffi::Error QuantizePacked(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, const Geometry& g, const Recipe& r,
                          const TensorParams& tensor, const ffi::AnyBuffer& data, const ffi::AnyBuffer& scales) {
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    QuantizePackedImpl(pool, static_cast<const T*>(x.untyped_data()), g, r, tensor,
                       static_cast<uint8_t*>(data.untyped_data()), static_cast<uint8_t*>(scales.untyped_data()));
    return ffi::Error::Success();
  });
}

}  // namespace xla_fp4::cpu

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4QuantizePackedCpu, xla_fp4::cpu::QuantizePackedFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x (rows, K) or (K, rows)
                                  .Arg<ffi::AnyBuffer>()  // s_dec
                                  .Arg<ffi::AnyBuffer>()  // key
                                  .Ret<ffi::AnyBuffer>()  // data
                                  .Ret<ffi::AnyBuffer>()  // scales
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_QUANTIZE_PACKED_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4QuantizePackedPairCpu, xla_fp4::cpu::QuantizePackedPairFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x (rows, K)
                                  .Arg<ffi::AnyBuffer>()  // row_s_dec
                                  .Arg<ffi::AnyBuffer>()  // row_key
                                  .Arg<ffi::AnyBuffer>()  // col_s_dec
                                  .Arg<ffi::AnyBuffer>()  // col_key
                                  .Ret<ffi::AnyBuffer>()  // row_data (rows, K/2)
                                  .Ret<ffi::AnyBuffer>()  // row_scales (rows, K/16)
                                  .Ret<ffi::AnyBuffer>()  // col_data (rows/2, K)
                                  .Ret<ffi::AnyBuffer>()  // col_scales (rows/16, K)
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_QUANTIZE_PACKED_PAIR_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4DequantizePackedCpu, xla_fp4::cpu::DequantizePackedFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // data
                                  .Arg<ffi::AnyBuffer>()  // scales
                                  .Arg<ffi::AnyBuffer>()  // s_dec
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4GemmPackedCpu, xla_fp4::cpu::GemmPackedFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // a_data
                                  .Arg<ffi::AnyBuffer>()  // a_scales
                                  .Arg<ffi::AnyBuffer>()  // b_data
                                  .Arg<ffi::AnyBuffer>()  // b_scales
                                  .Arg<ffi::AnyBuffer>()  // alpha
                                  .Ret<ffi::AnyBuffer>()
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_GEMM_PACKED_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4RaggedGemmPackedCpu, xla_fp4::cpu::RaggedGemmPackedFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // a_data
                                  .Arg<ffi::AnyBuffer>()  // a_scales
                                  .Arg<ffi::AnyBuffer>()  // b_data
                                  .Arg<ffi::AnyBuffer>()  // b_scales
                                  .Arg<ffi::AnyBuffer>()  // group_sizes
                                  .Arg<ffi::AnyBuffer>()  // alpha, one per group
                                  .Ret<ffi::AnyBuffer>()
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_RAGGED_GEMM_PACKED_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4MxQuantizePackedCpu, xla_fp4::cpu::MxQuantizePackedFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x (rows, K) or (K, rows)
                                  .Arg<ffi::AnyBuffer>()  // key
                                  .Ret<ffi::AnyBuffer>()  // data
                                  .Ret<ffi::AnyBuffer>()  // scales
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_MX_QUANTIZE_PACKED_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4MxDequantizePackedCpu, xla_fp4::cpu::MxDequantizePackedFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // data
                                  .Arg<ffi::AnyBuffer>()  // scales
                                  .Ret<ffi::AnyBuffer>()
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_MX_DEQUANTIZE_PACKED_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4MxGemmPackedCpu, xla_fp4::cpu::MxGemmPackedFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // a_data
                                  .Arg<ffi::AnyBuffer>()  // a_scales
                                  .Arg<ffi::AnyBuffer>()  // b_data
                                  .Arg<ffi::AnyBuffer>()  // b_scales
                                  .Ret<ffi::AnyBuffer>()
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_MX_GEMM_PACKED_ATTRIBUTES));
