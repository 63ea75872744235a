// Fake quantization (quantize + dequantize in one pass) and the random Hadamard transform, for the emulate backend.
//
//   xla_fp4_qdq(x, s_dec, key) -> y    y = decode(encode(rht(x) if rht else x)), float32 math, stored in x's dtype
//   xla_fp4_qdq_with_scale(x) -> (y, s_dec)
//                                      the same, measuring s_dec (and the stochastic-rounding key) from x itself
//   xla_fp4_rht(x) -> y (float32)      the RHT along `axis`
//   xla_fp4_mx_qdq(x, key) -> y         an OCP MX format's q * 2^s per 32-block (numerics/mx.py)
// Their telemetry forms (xla_fp4_qdq_and_stats, xla_fp4_qdq_with_scale_stats) are in quantize_stats_kernels.cc.
#include <vector>

#include "xla_fp4/cpu_common.h"
#include "xla_fp4/cpu_kernels.h"
#include "xla_fp4/cpu_quantize.h"
#include "xla_fp4/ffi_targets.h"

namespace xla_fp4::cpu {
namespace {

// ---- Impl: the work ----

template <typename T>
void QdqImpl(ffi::ThreadPool& pool, const T* x, T* y, const Geometry& g, const Recipe& r, const TensorParams& tensor,
             bool apply_global_scale) {
  const float decode_scale = apply_global_scale ? tensor.scale.s_dec : 1.0f;
  ForEachQuantizedTile</*kDecode=*/true>(pool, x, g, r, tensor,
                       [&](auto, const View& view, const TilePos& p, float (&v)[kBlock][kBlock], const uint8_t*) {
    StoreTile(y, view, p, v, decode_scale);
  });
}

struct TensorStats {
  uint32_t amax_bits;  // MagnitudeBits of max |v|, v = rht(x) if the RHT applies, else x
  uint32_t digest;     // wrapping sum of x's element bits (zero-extended): a key that changes with x
};

// Max MagnitudeBits and the wrapping sum of the raw bits over tiles [t_begin, t_end).
template <RhtAlong kRht, bool kDigest, typename T>
XLA_FP4_VECTOR_CLONES TensorStats MeasureTiles(const T* x, const View& view, const float* sign_quarter, int64_t t_begin,
                                               int64_t t_end) {
  alignas(64) float v[kBlock][kBlock];
  uint32_t m = 0, s = 0;
  for (int64_t t = t_begin; t < t_end; ++t) {
    s += LoadTransformed<kRht, kDigest>(x, view, PosOf(view, t), sign_quarter, v);
    for (int i = 0; i < kBlock; ++i) {
      for (int j = 0; j < kBlock; ++j) {
        const uint32_t a = MagnitudeBits(v[i][j]);
        m = a > m ? a : m;
      }
    }
  }
  return {m, s};
}

// Without the RHT the amax and the digest need no float: over elements [begin, end) of x, in any order, the largest
// magnitude as raw bits (sign cleared; the integer order of non-negative floats is their order, NaN above Inf) and
// the wrapping sum of the raw bits, in loops of 16- or 32-bit integer lanes. MaxMagnitudeBits below maps the raw
// maximum to what max MagnitudeBits(Load(x)) would give.
template <typename T>
XLA_FP4_VECTOR_CLONES TensorStats MeasureRaw(const T* x, int64_t begin, int64_t end) {
  using Raw = std::conditional_t<sizeof(T) == 4, uint32_t, uint16_t>;
  constexpr Raw kMagnitude = static_cast<Raw>(sizeof(T) == 4 ? 0x7FFFFFFFu : 0x7FFFu);
  Raw m = 0;
  uint32_t s = 0;
  const Raw* raw = reinterpret_cast<const Raw*>(x);
  for (int64_t i = begin; i < end; ++i) {
    const Raw a = static_cast<Raw>(raw[i] & kMagnitude);
    m = a > m ? a : m;
    s += raw[i];
  }
  return {static_cast<uint32_t>(m), s};
}

// The MagnitudeBits of Load(v), v the element whose magnitude bits are `m`: max commutes with the load's flush (a
// subnormal maximum means every element loads as zero) and with MagnitudeBits' clamp (both are monotone).
inline uint32_t MaxMagnitudeBits(float, uint32_t m) { return MagnitudeBits(FlushSubnormal(FloatOf(m))); }
inline uint32_t MaxMagnitudeBits(Bf16, uint32_t m) { return MagnitudeBits(FlushSubnormal(FloatOf(m << 16))); }
inline uint32_t MaxMagnitudeBits(F16, uint32_t m) {
  const F16 h{static_cast<uint16_t>(m)};
  return MagnitudeBits(Load(&h));  // float16's subnormals are normal float32s: no flush
}

// One read of x, in the tiles of the RHT's direction. Max and wrapping sum are order-free, so the result does not
// depend on how the pool splits the work.
template <typename T>
TensorStats MeasureTensor(ffi::ThreadPool& pool, const T* x, const Geometry& g, const RhtSigns* rht, bool digest) {
  std::atomic<uint32_t> amax{0}, sum{0};
  auto merge = [&](const TensorStats& part) {
    for (uint32_t cur = amax.load(std::memory_order_relaxed);
         part.amax_bits > cur && !amax.compare_exchange_weak(cur, part.amax_bits, std::memory_order_relaxed);) {
    }
    sum.fetch_add(part.digest, std::memory_order_relaxed);
  };
  if (rht == nullptr) {
    ParallelFor(pool, g.size(), 1, [&](int64_t begin, int64_t end) { merge(MeasureRaw(x, begin, end)); });
    return {MaxMagnitudeBits(T{}, amax.load()), sum.load()};
  }
  const RhtAlong along = RhtDirection(g, rht);
  const View view = ViewOf(g, along == RhtAlong::kCols ? Blocks::kCol : Blocks::kRow);
  const float* sq = rht->sign_quarter;
  WithBool(digest, [&](auto with_digest) {
    return WithRht(along, [&](auto along_c) {
      ParallelFor(pool, view.tiles(), kBlock * kBlock, [&](int64_t begin, int64_t end) {
        merge(MeasureTiles<decltype(along_c)::value, decltype(with_digest)::value>(x, view, sq, begin, end));
      });
      return 0;
    });
  });
  return {amax.load(), sum.load()};
}

template <typename T>
void RhtImpl(ffi::ThreadPool& pool, const T* x, float* y, const Geometry& g, const RhtSigns& signs) {
  const RhtAlong along = RhtDirection(g, &signs);
  const View view = ViewOf(g, along == RhtAlong::kCols ? Blocks::kCol : Blocks::kRow);
  WithRht(along, [&](auto along_c) {
    ParallelFor(pool, view.tiles(), kBlock * kBlock, [&](int64_t begin, int64_t end) {
      alignas(64) float v[kBlock][kBlock];
      for (int64_t t = begin; t < end; ++t) {
        const TilePos p = PosOf(view, t);
        LoadTransformed<decltype(along_c)::value, false>(x, view, p, signs.sign_quarter, v);
        for (int i = 0; i < p.nl; ++i) {
          for (int j = 0; j < p.nc; ++j) y[p.base + i * view.cols + j] = v[i][j];
        }
      }
    });
    return 0;
  });
}

// Per-block max MagnitudeBits over tiles [t_begin, t_end), stored as floats at the blocks' positions in amax (x's
// shape with the axis divided by 16), and with kDigest each block's wrapping sum of its raw element bits at the same
// positions in digest. 1D blocks only: the tile's rows (kRow, axis last) or its columns (kCol).
template <Blocks kBlocks, RhtAlong kRht, bool kDigest, typename T>
XLA_FP4_VECTOR_CLONES void BlockAmaxTiles(const T* x, float* amax, uint32_t* digest, const View& view,
                                          const float* sign_quarter, uint32_t smallest, int64_t t_begin,
                                          int64_t t_end) {
  alignas(64) float v[kBlock][kBlock];
  alignas(64) uint32_t m[kBlock];
  alignas(64) uint32_t d[kBlock];
  for (int64_t t = t_begin; t < t_end; ++t) {
    const TilePos p = PosOf(view, t);
    LoadTransformed<kRht, false>(x, view, p, sign_quarter, v);
    if constexpr (kDigest) {  // the tile is in cache: its raw bits, block by block
      for (int b = 0; b < kBlock; ++b) d[b] = 0;
      for (int i = 0; i < p.nl; ++i) {
        const T* in = x + p.base + i * view.cols;
        for (int j = 0; j < p.nc; ++j) d[kBlocks == Blocks::kRow ? i : j] += RawBits(in + j);
      }
    }
    if constexpr (kBlocks == Blocks::kRow) {
      // The row's largest MagnitudeBits counted only from `smallest` up: its raw maximum, clamped at Inf (MagnitudeBits
      // is monotone), counts whole or not at all.
      for (int i = 0; i < kBlock; ++i) {
        const uint32_t raw = RowMaxMagnitudeBits(v[i]), mi = raw < 0x7F800000u ? raw : 0x7F800000u;
        m[i] = mi >= smallest ? mi : 0u;
      }
      const int64_t first = p.base / kBlock;  // block index = line
      for (int i = 0; i < p.nl; ++i) amax[first + i] = FloatOf(m[i]);
      if constexpr (kDigest) {
        for (int i = 0; i < p.nl; ++i) digest[first + i] = d[i];
      }
    } else {
      for (int j = 0; j < kBlock; ++j) m[j] = 0;
      for (int i = 0; i < kBlock; ++i) {
        for (int j = 0; j < kBlock; ++j) {
          const uint32_t a = MagnitudeBits(v[i][j]);
          m[j] = a > m[j] && a >= smallest ? a : m[j];
        }
      }
      // The tile's 16 lines are one block of every column: block row = line / 16.
      const int64_t line = p.base / view.cols, col = p.base % view.cols;
      const int64_t first = line / kBlock * view.cols + col;
      for (int j = 0; j < p.nc; ++j) amax[first + j] = FloatOf(m[j]);
      if constexpr (kDigest) {
        for (int j = 0; j < p.nc; ++j) digest[first + j] = d[j];
      }
    }
  }
}

// digest: null, or where each block's digest goes (BlockAmaxTiles).
template <typename T>
void BlockAmaxImpl(ffi::ThreadPool& pool, const T* x, float* amax, uint32_t* digest, const Geometry& g,
                   const RhtSigns* rht) {
  const Blocks blocks = g.axis_last() ? Blocks::kRow : Blocks::kCol;
  const View view = ViewOf(g, blocks);
  const float* sq = rht != nullptr ? rht->sign_quarter : nullptr;
  // Magnitudes are compared as bits, which no FP mode flushes: under DAZ (XLA's CPU mode) subnormals count as zero.
  const uint32_t smallest = FpMode::Current().DenormalsAreZero() ? 0x00800000u : 0u;
  WithBool(digest != nullptr, [&](auto with_digest) {
    return WithRht(RhtDirection(g, rht), [&](auto along) {
      constexpr RhtAlong kAlong = decltype(along)::value;
      constexpr bool kDigest = decltype(with_digest)::value;
      ParallelFor(pool, view.tiles(), kBlock * kBlock, [&](int64_t begin, int64_t end) {
        if (blocks == Blocks::kRow) {
          BlockAmaxTiles<Blocks::kRow, kAlong, kDigest>(x, amax, digest, view, sq, smallest, begin, end);
        } else {
          BlockAmaxTiles<Blocks::kCol, kAlong, kDigest>(x, amax, digest, view, sq, smallest, begin, end);
        }
      });
      return 0;
    });
  });
}

// ---- xla_fp4_mx_qdq: the OCP MX formats (numerics/mx.py) ----

// Block b's elements (v: its values, loaded) as q * 2^s of the block's (tile's) amax, or NaN where that is NaN. The
// element format and the rounding are template parameters, so that the element loop has no branch and vectorizes.
template <bool kFp8, bool kStochastic, typename T>
void StoreMxBlock(T* y, const Geometry& g, int64_t b, const float (&v)[kMxBlock], float amax, uint32_t mixed_key) {
  const MxScale ms = MakeMxScale(amax, IsNan(amax), kFp8);
  const int64_t base = MxBlockBase(g, b);
  float out[kMxBlock];
  for (int j = 0; j < kMxBlock; ++j) {
    const float u = kStochastic ? UniformFromBits(RandomBits(mixed_key, static_cast<uint32_t>(base + j * g.inner)))
                                : 0.0f;
    out[j] = MxDecodeElement(MxRoundElement(v[j] * ms.inverse, kFp8, kStochastic, u), ms.scale);
  }
  if (g.inner == 1) {  // contiguous: the stores vectorize
    for (int j = 0; j < kMxBlock; ++j) Store(y + base + j, out[j]);
  } else {
    for (int j = 0; j < kMxBlock; ++j) Store(y + base + j * g.inner, out[j]);
  }
}

// y = q * 2^s per block (32x32 tile with block_2d).
template <typename T>
void MxQdqImpl(ffi::ThreadPool& pool, const T* x, T* y, const Geometry& g, const Recipe& r, uint32_t key, bool fp8) {
  const uint32_t mixed_key = Mix32(key);
  WithBool(fp8, [&](auto f8) {
    return WithBool(r.stochastic, [&](auto sr) {
      ForEachMxBlock(pool, x, g, r, [&](int64_t b, const float (&v)[kMxBlock], float amax) {
        StoreMxBlock<decltype(f8)::value, decltype(sr)::value>(y, g, b, v, amax, mixed_key);
      });
      return 0;
    });
  });
}

// ---- FFI handlers (the checks shared with CUDA: ffi_checks.h) ----

ffi::Error QdqFfi(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer s_dec, ffi::AnyBuffer key,
                  ffi::Result<ffi::AnyBuffer> y, int64_t axis, bool block_2d, bool stochastic, bool rht,
                  int64_t rht_seed, bool apply_global_scale, bool four_over_six) {
  Geometry g;
  if (ffi::Error e = FirstError({CheckQdq(x, *y, axis, stochastic, rht_seed, &g),
                                 CheckScalar(s_dec, ffi::DataType::F32, "s_dec"),
                                 CheckScalar(key, ffi::DataType::U32, "key")});
      e.failure()) {
    return e;
  }
  const Recipe recipe(block_2d, stochastic, rht, rht_seed, four_over_six);
  const TensorParams tensor = MakeTensorParams(s_dec, key);
  return Qdq(pool, x, *y, g, recipe, tensor, apply_global_scale);
}

// For programs that are not partitioned, where x is the whole tensor: the amax and the key come from x itself instead
// of from reductions emitted around the call (the same numbers as the partitioned pattern's: kernel_twins.decode_scale
// over xla_fp4_block_amax, and kernel_twins.stochastic_key), which keeps XLA's compile time and the step's memory
// traffic close to the baseline's.
ffi::Error QdqWithScaleFfi(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                           ffi::Result<ffi::AnyBuffer> s_dec, int64_t axis, bool block_2d, bool stochastic, bool rht,
                           int64_t rht_seed, int64_t salt, bool four_over_six) {
  const Recipe recipe(block_2d, stochastic, rht, rht_seed, four_over_six);
  Geometry g;
  TensorParams tensor;
  if (ffi::Error e = CheckAndMeasureWithScale(pool, x, *y, *s_dec, axis, recipe, rht_seed, salt, &g, &tensor);
      e.failure()) {
    return e;
  }
  return Qdq(pool, x, *y, g, recipe, tensor, /*apply_global_scale=*/false);
}

ffi::Error RhtFfi(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, int64_t axis,
                  int64_t rht_seed) {
  Geometry g;
  if (ffi::Error e = FirstError({CheckAxis(x.dimensions(), axis, &g), CheckSeed(rht_seed),
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

// The per-block amax of a partitioned program's operand: block-local, so each shard measures its own blocks, and the
// pass reduces the 16x smaller result to the global amax with a plain (all-reduced) max; with `digest` also the
// per-block digests (a second result), which it sums to x's digest for the stochastic-rounding key.
ffi::Error BlockAmaxFfi(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> amax,
                        ffi::RemainingRets more, int64_t axis, bool rht, int64_t rht_seed, bool digest) {
  Geometry g;
  ffi::AnyBuffer digests = *amax;  // replaced by the digests' result where there is one
  if (ffi::Error e = CheckBlockAmax(x, *amax, more, axis, rht_seed, digest, &g, &digests); e.failure()) return e;
  const RhtSigns signs(static_cast<uint32_t>(rht_seed));
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    BlockAmaxImpl(pool, static_cast<const T*>(x.untyped_data()), static_cast<float*>(amax->untyped_data()),
                  digest ? static_cast<uint32_t*>(digests.untyped_data()) : nullptr, g, rht ? &signs : nullptr);
    return ffi::Error::Success();
  });
}

ffi::Error MxQdqFfi(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer key, ffi::Result<ffi::AnyBuffer> y,
                    int64_t axis, bool block_2d, bool stochastic, bool rht, int64_t rht_seed, bool fp8) {
  Geometry g;
  if (ffi::Error e = CheckMxQdq(x, *y, key, axis, stochastic, rht_seed, &g); e.failure()) return e;
  const Recipe recipe(block_2d, stochastic, rht, rht_seed);
  const uint32_t k = *static_cast<const uint32_t*>(key.untyped_data());
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    MxQdqImpl(pool, static_cast<const T*>(x.untyped_data()), static_cast<T*>(y->untyped_data()), g, recipe, k, fp8);
    return ffi::Error::Success();
  });
}

}  // namespace

ffi::Error Qdq(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, const ffi::AnyBuffer& y, const Geometry& g,
               const Recipe& r, const TensorParams& tensor, bool apply_global_scale) {
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    QdqImpl(pool, static_cast<const T*>(x.untyped_data()), static_cast<T*>(y.untyped_data()), g, r, tensor,
            apply_global_scale);
    return ffi::Error::Success();
  });
}

ffi::Error CheckAndMeasureWithScale(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, const ffi::AnyBuffer& y,
                                    const ffi::AnyBuffer& s_dec, int64_t axis, const Recipe& r, int64_t rht_seed,
                                    int64_t salt, Geometry* g, TensorParams* tensor) {
  if (ffi::Error e = FirstError({CheckQdq(x, y, axis, r.stochastic, rht_seed, g),
                                 CheckScalar(s_dec, ffi::DataType::F32, "the s_dec result"),
                                 CheckU32Attribute(salt, "salt")});
      e.failure()) {
    return e;
  }
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const TensorStats stats = MeasureTensor(pool, static_cast<const T*>(x.untyped_data()), *g, r.rht_signs(),
                                            r.stochastic);
    const float scale = GlobalDecodeScale(stats.amax_bits, r.four_over_six);
    const uint32_t key = (r.stochastic ? stats.digest : 0u) ^ static_cast<uint32_t>(salt);
    *static_cast<float*>(s_dec.untyped_data()) = scale;
    *tensor = MakeTensorParams(scale, key);
    return ffi::Error::Success();
  });
}

}  // namespace xla_fp4::cpu

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4QdqCpu, xla_fp4::cpu::QdqFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // s_dec
                                  .Arg<ffi::AnyBuffer>()  // key
                                  .Ret<ffi::AnyBuffer>()  // y
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_QDQ_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4QdqWithScaleCpu, xla_fp4::cpu::QdqWithScaleFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Ret<ffi::AnyBuffer>()  // y: q * scale, x's shape and dtype
                                  .Ret<ffi::AnyBuffer>()  // s_dec (float32 scalar)
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_QDQ_WITH_SCALE_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4RhtCpu, xla_fp4::cpu::RhtFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Ret<ffi::AnyBuffer>()  // y (float32)
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_RHT_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4BlockAmaxCpu, xla_fp4::cpu::BlockAmaxFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Ret<ffi::AnyBuffer>()  // amax per 1x16 block (float32)
                                  .RemainingRets()        // with digest: each block's digest (uint32)
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_BLOCK_AMAX_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4MxQdqCpu, xla_fp4::cpu::MxQdqFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // key (uint32 scalar)
                                  .Ret<ffi::AnyBuffer>()  // y: q * 2^s, x's shape and dtype
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_MX_QDQ_ATTRIBUTES));
