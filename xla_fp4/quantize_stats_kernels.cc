// The quantizers' telemetry forms: each makes its plain kernel's results and, in a recorded step (step >= 0), the
// statistics of that quantization of x (numerics/telemetry.py FIELDS; cpu_stats.h) from the same pass over x; in a step
// that is not recorded, zeros and the plain kernel's work (cpu_quantize.h).
//
//   xla_fp4_qdq_and_stats(x, s_dec, key, step) -> (y, stats)
//                          xla_fp4_qdq without the global scale (a partitioned program's quantizer: x may be a shard)
//   xla_fp4_qdq_with_scale_stats(x, step) -> (y, s_dec, stats)
//                          xla_fp4_qdq_with_scale
//   xla_fp4_quantize_packed_stats(x, s_dec, key, step) -> (data, scales, stats)
//                          xla_fp4_quantize_packed (the native forms' quantizer; x may be a shard)
#include <algorithm>

#include "xla_fp4/cpu_common.h"
#include "xla_fp4/cpu_kernels.h"
#include "xla_fp4/cpu_quantize.h"
#include "xla_fp4/cpu_stats.h"
#include "xla_fp4/ffi_targets.h"

namespace xla_fp4::cpu {
namespace {

// xla_fp4_qdq's result on x without the global scale (q * scale, from the same walker: bit-identical) into y, and its
// FIELDS row into row.
template <typename T>
void QdqStatsImpl(ffi::ThreadPool& pool, const T* x, T* y, const Geometry& g, const Recipe& r,
                  const TensorParams& tensor, float* row) {
  QuantizationStats<T> stats(x, g, r, tensor);
  ForEachQuantizedTile</*kDecode=*/true>(pool, x, g, r, tensor,
                       [&](auto blocks, const View& view, const TilePos& p, float (&v)[kBlock][kBlock],
                           const uint8_t* code) {
    StoreTile(y, view, p, v, /*decode_scale=*/1.0f);
    stats.template Measure<decltype(blocks)::value>(view, p, v, code);
  });
  stats.Row(row);
}

// y as xla_fp4_qdq makes it without the global scale, and in a recorded step (row not null) its FIELDS row.
ffi::Error QdqRecorded(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, const ffi::AnyBuffer& y, const Geometry& g,
                       const Recipe& r, const TensorParams& tensor, float* row) {
  if (row == nullptr) return Qdq(pool, x, y, g, r, tensor, /*apply_global_scale=*/false);
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    QdqStatsImpl(pool, static_cast<const T*>(x.untyped_data()), static_cast<T*>(y.untyped_data()), g, r, tensor, row);
    return ffi::Error::Success();
  });
}

// xla_fp4_quantize_packed's codes and scales of x, and the FIELDS row of that quantization into row.
template <typename T>
void QuantizePackedStatsImpl(ffi::ThreadPool& pool, const T* x, const Geometry& g, const Recipe& r,
                             const TensorParams& tensor, uint8_t* data, uint8_t* scales, float* row) {
  QuantizationStats<T> stats(x, g, r, tensor);
  ForEachQuantizedTile</*kDecode=*/false>(pool, x, g, r, tensor,
                       [&](auto blocks, const View& view, const TilePos& p, float (&q)[kBlock][kBlock],
                           const uint8_t* code) {
    constexpr Blocks kBlocks = decltype(blocks)::value;
    alignas(64) float scale[kBlock], v[kBlock][kBlock];  // v = q * scale, exactly as xla_fp4_qdq's walker decodes it
    for (int b = 0; b < kBlock; ++b) scale[b] = E4M3Decode(code[b]);
    for (int i = 0; i < kBlock; ++i) {
      for (int j = 0; j < kBlock; ++j) v[i][j] = q[i][j] * scale[BlockOf<kBlocks>(i, j)];
    }
    stats.template Measure<kBlocks>(view, p, v, code);
    PackTile<kBlocks>(g, view, p, q, code, data, scales);
  });
  stats.Row(row);
}

// The statistics row, checked and zeroed: where a recorded step's row goes, or null in a step that is not recorded.
ffi::Error StatsRow(ffi::AnyBuffer& stats, ffi::Buffer<ffi::S32>& step, const char* target, float** row) {
  if (ffi::Error e = CheckStatsRow(stats.element_count(), stats.element_type(), target); e.failure()) return e;
  float* out = static_cast<float*>(stats.untyped_data());
  std::fill_n(out, telemetry::kNumFields, 0.0f);
  *row = step.typed_data()[0] >= 0 ? out : nullptr;
  return ffi::Error::Success();
}

ffi::Error QdqAndStatsFfi(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer s_dec, ffi::AnyBuffer key,
                          ffi::Buffer<ffi::S32> step, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> stats,
                          int64_t axis, bool block_2d, bool stochastic, bool rht, int64_t rht_seed,
                          bool four_over_six) {
  Geometry g;
  float* row = nullptr;
  if (ffi::Error e = FirstError({CheckQdq(x, *y, axis, stochastic, rht_seed, &g),
                                 CheckScalar(s_dec, ffi::DataType::F32, "s_dec"),
                                 CheckScalar(key, ffi::DataType::U32, "key"),
                                 StatsRow(*stats, step, "xla_fp4_qdq_and_stats", &row)});
      e.failure()) {
    return e;
  }
  const Recipe recipe(block_2d, stochastic, rht, rht_seed, four_over_six);
  const TensorParams tensor = MakeTensorParams(s_dec, key);
  return QdqRecorded(pool, x, *y, g, recipe, tensor, row);
}

ffi::Error QdqWithScaleStatsFfi(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> step,
                                ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> s_dec,
                                ffi::Result<ffi::AnyBuffer> stats, int64_t axis, bool block_2d, bool stochastic,
                                bool rht, int64_t rht_seed, int64_t salt, bool four_over_six) {
  float* row = nullptr;
  if (ffi::Error e = StatsRow(*stats, step, "xla_fp4_qdq_with_scale_stats", &row); e.failure()) return e;
  const Recipe recipe(block_2d, stochastic, rht, rht_seed, four_over_six);
  Geometry g;
  TensorParams tensor;
  if (ffi::Error e = CheckAndMeasureWithScale(pool, x, *y, *s_dec, axis, recipe, rht_seed, salt, &g, &tensor);
      e.failure()) {
    return e;
  }
  return QdqRecorded(pool, x, *y, g, recipe, tensor, row);
}

ffi::Error QuantizePackedStatsFfi(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer s_dec, ffi::AnyBuffer key,
                                  ffi::Buffer<ffi::S32> step, ffi::Result<ffi::AnyBuffer> data,
                                  ffi::Result<ffi::AnyBuffer> scales, ffi::Result<ffi::AnyBuffer> stats, int64_t axis,
                                  bool block_2d, bool stochastic, bool rht, int64_t rht_seed, bool four_over_six) {
  Geometry g;
  float* row = nullptr;
  if (ffi::Error e = FirstError({CheckQuantizePacked(x, &s_dec, key, *data, *scales, axis, stochastic, rht_seed, &g),
                                 StatsRow(*stats, step, "xla_fp4_quantize_packed_stats", &row)});
      e.failure()) {
    return e;
  }
  const Recipe recipe(block_2d, stochastic, rht, rht_seed, four_over_six);
  const TensorParams tensor = MakeTensorParams(s_dec, key);
  if (row == nullptr) return QuantizePacked(pool, x, g, recipe, tensor, *data, *scales);
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    QuantizePackedStatsImpl(pool, static_cast<const T*>(x.untyped_data()), g, recipe, tensor,
                            static_cast<uint8_t*>(data->untyped_data()), static_cast<uint8_t*>(scales->untyped_data()),
                            row);
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace xla_fp4::cpu

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4QdqAndStatsCpu, xla_fp4::cpu::QdqAndStatsFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // x (a shard, in a partitioned program)
                                  .Arg<ffi::AnyBuffer>()         // s_dec (float32 scalar)
                                  .Arg<ffi::AnyBuffer>()         // key (uint32 scalar)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // step (-1: not recorded)
                                  .Ret<ffi::AnyBuffer>()         // y: q * scale, x's shape and dtype
                                  .Ret<ffi::AnyBuffer>()         // statistics, float32[11]
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_QDQ_AND_STATS_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4QdqWithScaleStatsCpu, xla_fp4::cpu::QdqWithScaleStatsFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // x
                                  .Arg<ffi::Buffer<ffi::S32>>()  // step (-1: not recorded)
                                  .Ret<ffi::AnyBuffer>()         // y: q * scale, x's shape and dtype
                                  .Ret<ffi::AnyBuffer>()         // s_dec (float32 scalar)
                                  .Ret<ffi::AnyBuffer>()         // statistics, float32[11] (zeros when not recorded)
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_QDQ_WITH_SCALE_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4QuantizePackedStatsCpu, xla_fp4::cpu::QuantizePackedStatsFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // x (rows, K) or (K, rows)
                                  .Arg<ffi::AnyBuffer>()         // s_dec
                                  .Arg<ffi::AnyBuffer>()         // key
                                  .Arg<ffi::Buffer<ffi::S32>>()  // step (-1: not recorded)
                                  .Ret<ffi::AnyBuffer>()         // data
                                  .Ret<ffi::AnyBuffer>()         // scales
                                  .Ret<ffi::AnyBuffer>()         // statistics, float32[11]
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_QUANTIZE_PACKED_ATTRIBUTES));
