// What the plain quantizing kernels (qdq_kernels.cc, packed_kernels.cc) share with their telemetry forms
// (quantize_stats_kernels.cc). The telemetry forms live in a file of their own so that the three compile in parallel
// (each instantiates the tile walker for every dtype and recipe); they reach the plain kernels' work through the
// non-template calls declared here, so that a step that is not recorded runs the same code, compiled once.
#ifndef XLA_FP4_CPU_QUANTIZE_H_
#define XLA_FP4_CPU_QUANTIZE_H_

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"
#include "xla_fp4/cpu_common.h"

namespace xla_fp4::cpu {

// ---- what the tile walker's sinks (ForEachQuantizedTile) do with a quantized tile ----

// A decoded E2M1 value q * scale (q in {0, 0.5, ..., 6}, scale an E4M3 value, or NaN) is exact in every float dtype:
// at most 2 + 4 significant bits, a magnitude in [2**-10, 2688] or zero. So bfloat16 takes its top 16 bits: Store's
// rounding would change nothing, and a NaN made by arithmetic is already quiet (Store's NaN case sets no new bit).
inline void StoreExact(Bf16* p, float v) { p->bits = static_cast<uint16_t>(BitsOf(v) >> 16); }
template <typename T>
inline void StoreExact(T* p, float v) {
  Store(p, v);
}

// The tile's decoded values v = q * scale stored into y (x's shape): with decode_scale 1 as they are (the emulated GEMM
// then folds both tensors' s_dec into its float32 output, as cuBLASLt's alpha does: docs/design.md §2), else as
// DecodeElement(q, scale, decode_scale), rounded to T.
template <typename T>
void StoreTile(T* y, const View& view, const TilePos& p, const float (&v)[kBlock][kBlock], float decode_scale) {
  if (decode_scale != 1.0f) {
    alignas(64) float d[kBlock][kBlock];
    for (int i = 0; i < kBlock; ++i) {
      for (int j = 0; j < kBlock; ++j) d[i][j] = FlushSubnormal(v[i][j] * decode_scale);
    }
    for (int i = 0; i < p.nl; ++i) {
      for (int j = 0; j < p.nc; ++j) Store(y + p.base + i * view.cols + j, d[i][j]);
    }
  } else if (p.full) {
    for (int i = 0; i < kBlock; ++i) {
      T* out = y + p.base + i * view.cols;
      for (int j = 0; j < kBlock; ++j) StoreExact(out + j, v[i][j]);
    }
  } else {
    for (int i = 0; i < p.nl; ++i) {
      for (int j = 0; j < p.nc; ++j) StoreExact(y + p.base + i * view.cols + j, v[i][j]);
    }
  }
}

// The tile's E2M1 values q and its blocks' E4M3 codes into the packed layout (numerics/packing.py): data and scales
// have x's dims with the axis K divided by 2 and by 16, two elements adjacent along K sharing a byte (the even one in
// the low nibble), and a block's scale where its first element's pair would be.
template <Blocks kBlocks>
void PackTile(const Geometry& g, const View& view, const TilePos& p, const float (&q)[kBlock][kBlock],
              const uint8_t* code, uint8_t* data, uint8_t* scales) {
  if (g.axis_last()) {  // (rows, K): every tile line is 16 consecutive elements of one row and one block
    // The tile's codes, then the whole tile's pairs, then each line's 8 bytes: loops that vectorize (pairing codes as
    // they are made does not, and pairing one line's 16 at a time ran as scalar code on AVX2: a seventh of the
    // bfloat16 packer's time).
    alignas(64) uint8_t c[kBlock * kBlock];
    for (int i = 0; i < kBlock; ++i) {
      for (int j = 0; j < kBlock; ++j) c[i * kBlock + j] = E2M1Code(q[i][j]);
    }
    alignas(64) uint8_t pairs[kBlock * kBlock / 2];
    PackPairs(c, pairs);
    for (int i = 0; i < p.nl; ++i) {
      const int64_t e = p.base + i * view.cols;  // the line's first element, row-major
      scales[e / kBlock] = code[BlockOf<kBlocks>(i, 0)];  // (row, block) row-major
      std::memcpy(data + e / 2, pairs + i * kBlock / 2, kBlock / 2);
    }
    return;
  }
  // (K, rows) (outer = 1): lines are K (whole blocks of 16: K % 16 == 0), columns rows; lines i and i + 1 share bytes.
  const int64_t line = p.base / view.cols, col = p.base % view.cols;
  for (int i = 0; i < p.nl; i += 2) {
    uint8_t* out = data + (line + i) / 2 * view.cols + col;
    for (int j = 0; j < p.nc; ++j) {
      out[j] = static_cast<uint8_t>(E2M1Code(q[i][j]) | (E2M1Code(q[i + 1][j]) << 4));
    }
  }
  uint8_t* s = scales + line / kBlock * view.cols + col;
  for (int j = 0; j < p.nc; ++j) s[j] = code[BlockOf<kBlocks>(0, j)];
}

// ---- the plain kernels' work, for their telemetry forms' unrecorded steps (x: float32, bfloat16 or float16) ----

// qdq_kernels.cc: y = xla_fp4_qdq's result on x (y has x's shape and dtype).
ffi::Error Qdq(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, const ffi::AnyBuffer& y, const Geometry& g,
               const Recipe& r, const TensorParams& tensor, bool apply_global_scale);

// qdq_kernels.cc: xla_fp4_qdq_with_scale's checks (g: x's geometry), then its tensor parameters measured from x itself:
// s_dec (also written to the s_dec result) and the stochastic-rounding key (x's digest with `salt`).
ffi::Error CheckAndMeasureWithScale(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, const ffi::AnyBuffer& y,
                                    const ffi::AnyBuffer& s_dec, int64_t axis, const Recipe& r, int64_t rht_seed,
                                    int64_t salt, Geometry* g, TensorParams* tensor);

// packed_kernels.cc: xla_fp4_quantize_packed's codes and scales of x.
ffi::Error QuantizePacked(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, const Geometry& g, const Recipe& r,
                          const TensorParams& tensor, const ffi::AnyBuffer& data, const ffi::AnyBuffer& scales);

}  // namespace xla_fp4::cpu

#endif  // XLA_FP4_CPU_QUANTIZE_H_
