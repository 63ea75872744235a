// Fake quantization (quantize + dequantize in one pass) and the random Hadamard transform, for the emulate backend.
//
//   xla_fp4_qdq(x, s_dec, key) -> y    y = decode(encode(rht(x) if rht else x)), float32 math, stored in x's dtype
//   xla_fp4_rht(x) -> y (float32)      the RHT along `axis`
#include "xla_fp4/cpu_common.h"
#include "xla_fp4/cpu_kernels.h"

namespace xla_fp4::cpu {
namespace {

// ---- Impl: the work ----

// With apply_global_scale off the result is q * scale, exact in every float dtype: the emulated GEMM then folds
// both tensors' s_dec into its float32 output, as cuBLASLt's alpha does (DESIGN.md §2).
template <typename T>
void QdqImpl(ffi::ThreadPool& pool, const T* x, T* y, const Geometry& g, const Recipe& r, const RhtSigns* rht,
             bool apply_global_scale) {
  const float decode_scale = apply_global_scale ? r.scale.s_dec : 1.0f;
  ForEachTile(pool, x, g, rht != nullptr ? rht->sign_quarter : nullptr, &r,
              [&](auto axis_last, const Tile& tile, const TileValues& tv, const BlockScale* scales) {
                const int64_t sj = StrideJ<decltype(axis_last)::value>(g), sc = StrideC<decltype(axis_last)::value>(g);
                for (int c = 0; c < tile.ncols; ++c) {
                  T* out = y + tile.base + c * sc;
                  for (int j = 0; j < kBlock; ++j) {
                    Store(out + j * sj, DecodeElement(tv.v[c][j], scales[c].scale, decode_scale));
                  }
                }
              });
}

template <typename T>
void RhtImpl(ffi::ThreadPool& pool, const T* x, float* y, const Geometry& g, const RhtSigns& signs) {
  ForEachTile(pool, x, g, signs.sign_quarter, /*recipe=*/nullptr,
              [&](auto axis_last, const Tile& tile, const TileValues& tv, const BlockScale*) {
                const int64_t sj = StrideJ<decltype(axis_last)::value>(g), sc = StrideC<decltype(axis_last)::value>(g);
                for (int c = 0; c < tile.ncols; ++c) {
                  for (int j = 0; j < kBlock; ++j) y[tile.base + c * sc + j * sj] = tv.v[c][j];
                }
              });
}

// ---- FFI: validation ----

// x's shape viewed around `axis` (numerics.quantize.canonical_axis).
ffi::Error AxisGeometry(ffi::Span<const int64_t> dims, int64_t axis, Geometry* g) {
  const int64_t rank = static_cast<int64_t>(dims.size());
  if (rank == 0 || axis < -rank || axis >= rank) {
    return ffi::Error::InvalidArgument("axis " + std::to_string(axis) + " is out of range for x of shape " +
                                       ShapeString(dims) + " (x must have rank >= 1)");
  }
  axis = (axis + rank) % rank;
  g->outer = g->inner = 1;
  for (int64_t d = 0; d < rank; ++d) {
    if (d < axis) g->outer *= dims[d];
    if (d > axis) g->inner *= dims[d];
  }
  g->k = dims[axis];
  return CheckBlocks(g->k, ("the size of x's quantization axis " + std::to_string(axis) + " (shape " +
                            ShapeString(dims) + ")").c_str());
}

ffi::Error CheckSameShape(const ffi::AnyBuffer& x, const ffi::AnyBuffer& y, const char* what) {
  auto xd = x.dimensions(), yd = y.dimensions();
  if (!std::equal(xd.begin(), xd.end(), yd.begin(), yd.end())) {
    return ffi::Error::InvalidArgument(std::string(what) + " must have x's shape " + ShapeString(xd) + ", got " +
                                       ShapeString(yd));
  }
  return ffi::Error::Success();
}

ffi::Error QdqFfi(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer s_dec, ffi::AnyBuffer key,
                  ffi::Result<ffi::AnyBuffer> y, int64_t axis, bool block_2d, bool stochastic, bool rht,
                  int64_t rht_seed, bool apply_global_scale) {
  Geometry g;
  if (ffi::Error e = FirstError({AxisGeometry(x.dimensions(), axis, &g), CheckScalar(s_dec, ffi::DataType::F32, "s_dec"),
                                 CheckScalar(key, ffi::DataType::U32, "key"), CheckSeed(rht_seed),
                                 CheckSameShape(x, *y, "the result")});
      e.failure()) {
    return e;
  }
  if (y->element_type() != x.element_type()) {
    return ffi::Error::InvalidArgument("the result must have x's dtype (code " +
                                       std::to_string(static_cast<int>(x.element_type())) + "), got code " +
                                       std::to_string(static_cast<int>(y->element_type())));
  }
  if (stochastic && g.size() > (int64_t{1} << 32)) {
    return ffi::Error::InvalidArgument("stochastic rounding supports tensors of at most 2**32 elements, got shape " +
                                       ShapeString(x.dimensions()));
  }
  const Recipe recipe{block_2d, stochastic, Mix32(*static_cast<const uint32_t*>(key.untyped_data())),
                      MakeTensorScale(*static_cast<const float*>(s_dec.untyped_data()))};
  const RhtSigns signs(static_cast<uint32_t>(rht_seed));
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    QdqImpl(pool, static_cast<const T*>(x.untyped_data()), static_cast<T*>(y->untyped_data()), g, recipe,
            rht ? &signs : nullptr, apply_global_scale);
    return ffi::Error::Success();
  });
}

ffi::Error RhtFfi(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, int64_t axis,
                  int64_t rht_seed) {
  Geometry g;
  if (ffi::Error e = FirstError({AxisGeometry(x.dimensions(), axis, &g), CheckSeed(rht_seed),
                                 CheckSameShape(x, *y, "the result")});
      e.failure()) {
    return e;
  }
  if (y->element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("the RHT result must be float32, got dtype code " +
                                       std::to_string(static_cast<int>(y->element_type())));
  }
  const RhtSigns signs(static_cast<uint32_t>(rht_seed));
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    RhtImpl(pool, static_cast<const T*>(x.untyped_data()), static_cast<float*>(y->untyped_data()), g, signs);
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace xla_fp4::cpu

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4QdqCpu, xla_fp4::cpu::QdqFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // s_dec
                                  .Arg<ffi::AnyBuffer>()  // key
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Attr<int64_t>("axis")
                                  .Attr<bool>("block_2d")
                                  .Attr<bool>("stochastic")
                                  .Attr<bool>("rht")
                                  .Attr<int64_t>("rht_seed")
                                  .Attr<bool>("apply_global_scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4RhtCpu, xla_fp4::cpu::RhtFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Ret<ffi::AnyBuffer>()  // y (float32)
                                  .Attr<int64_t>("axis")
                                  .Attr<int64_t>("rht_seed"));
