// Fake quantization (quantize + dequantize in one pass) and the random Hadamard transform, for the emulate backend.
//
//   xla_fp4_qdq(x, s_dec, key) -> y    y = decode(encode(rht(x) if rht else x)), float32 math, stored in x's dtype
//   xla_fp4_qdq_with_scale(x) -> (y, s_dec)
//                                      the same, measuring s_dec (and the stochastic-rounding key) from x itself
//   xla_fp4_rht(x) -> y (float32)      the RHT along `axis`
#include "xla_fp4/cpu_common.h"
#include "xla_fp4/cpu_kernels.h"

namespace xla_fp4::cpu {
namespace {

// ---- Impl: the work ----

// ---- the fast path: x viewed as a row-major matrix (lines, cols), walked in 16x16 tiles of contiguous rows ----
//
// Every layout the kernel takes maps onto one of three tile shapes with memory-contiguous rows, so that loads, stores
// and the element math run over fixed 16-wide rows the compiler vectorizes (no gather/scatter):
//   kRow:  the blocks are the tile's rows (axis last, 1D: x is a flat run of blocks, cols = 16);
//   kCol:  the blocks are the tile's columns (another axis, 1D: lines = outer * K, cols = inner);
//   kTile: the whole 16x16 tile is one block (2D: axis last with lines = outer, cols = K, or another axis with
//          lines = outer * K, cols = inner; K % 16 == 0, so no tile straddles two blocks).
// Partial tiles are padded with zeros, which change no block amax; their results are not stored.
enum class Blocks { kRow, kCol, kTile };

// max |v| over values given as bits with the sign cleared: for non-negative floats the integer order is the float
// order, and NaN sorts above +Inf, so a NaN anywhere gives a NaN amax, as jnp.max does (QuantizeTile's rule).
inline float AmaxFromBits(uint32_t m) { return FloatOf(SelectBits(m > 0x7F800000u, 0x7FC00000u, m)); }

template <Blocks kBlocks, bool kStochastic, bool kRht, typename T>
void QdqTiles(const T* x, T* y, int64_t lines, int64_t cols, const Recipe& r, const float* sign_quarter,
              float decode_scale, int64_t t_begin, int64_t t_end) {
  const int64_t col_groups = (cols + kBlock - 1) / kBlock;
  alignas(64) float v[kBlock][kBlock];
  alignas(64) uint32_t am[kBlock];
  alignas(64) float inv[kBlock], scale[kBlock];
  alignas(64) uint32_t zero[kBlock];
  alignas(16) uint8_t code[kBlock];
  for (int64_t t = t_begin; t < t_end; ++t) {
    const int64_t l0 = t / col_groups * kBlock, c0 = t % col_groups * kBlock;
    const int nl = static_cast<int>(std::min<int64_t>(kBlock, lines - l0));
    const int nc = static_cast<int>(std::min<int64_t>(kBlock, cols - c0));
    const int64_t base = l0 * cols + c0;
    const bool full = nl == kBlock && nc == kBlock;
    if (full) {
      for (int i = 0; i < kBlock; ++i) {
        const T* in = x + base + i * cols;
        for (int j = 0; j < kBlock; ++j) v[i][j] = Load(in + j);
      }
    } else {
      for (int i = 0; i < kBlock; ++i) {
        for (int j = 0; j < kBlock; ++j) v[i][j] = (i < nl && j < nc) ? Load(x + base + i * cols + j) : 0.0f;
      }
    }
    if constexpr (kRht) {
      for (int i = 0; i < kBlock; ++i) Rht16(v[i], sign_quarter);
    }
    // Block amax, as bits.
    if constexpr (kBlocks == Blocks::kRow) {
      for (int i = 0; i < kBlock; ++i) {
        uint32_t m = 0;
        for (int j = 0; j < kBlock; ++j) {
          const uint32_t a = BitsOf(v[i][j]) & 0x7FFFFFFFu;
          m = a > m ? a : m;
        }
        am[i] = m;
      }
    } else {
      for (int j = 0; j < kBlock; ++j) am[j] = 0;
      for (int i = 0; i < kBlock; ++i) {
        for (int j = 0; j < kBlock; ++j) {
          const uint32_t a = BitsOf(v[i][j]) & 0x7FFFFFFFu;
          am[j] = a > am[j] ? a : am[j];
        }
      }
      if constexpr (kBlocks == Blocks::kTile) {
        uint32_t m = 0;
        for (int j = 0; j < kBlock; ++j) m = am[j] > m ? am[j] : m;
        for (int j = 0; j < kBlock; ++j) am[j] = m;
      }
    }
    // MakeBlockScale, split in two loops of fixed trip count that vectorize.
    for (int b = 0; b < kBlock; ++b) code[b] = E4M3Encode(AmaxFromBits(am[b]) * r.scale.s_enc_over_6);
    for (int b = 0; b < kBlock; ++b) {
      scale[b] = E4M3Decode(code[b]);
      const float denom = scale[b] * r.scale.s_dec;
      inv[b] = 1.0f / denom;
      zero[b] = denom == 0.0f ? 1u : 0u;
    }
    // Quantize and decode in place.
    for (int i = 0; i < kBlock; ++i) {
      const uint32_t index0 = static_cast<uint32_t>(base + i * cols);  // < 2**32 when stochastic (checked)
      for (int j = 0; j < kBlock; ++j) {
        const int b = kBlocks == Blocks::kRow ? i : (kBlocks == Blocks::kCol ? j : 0);
        BlockScale s;
        s.code = 0;
        s.scale = scale[b];
        s.inv_denom = inv[b];
        s.zero = zero[b] != 0u;
        const float u =
            kStochastic ? UniformFromBits(RandomBits(r.mixed_key, index0 + static_cast<uint32_t>(j))) : 0.0f;
        v[i][j] = DecodeElement(QuantizeElement(v[i][j], s, kStochastic, u), s.scale, decode_scale);
      }
    }
    if (full) {
      for (int i = 0; i < kBlock; ++i) {
        T* out = y + base + i * cols;
        for (int j = 0; j < kBlock; ++j) Store(out + j, v[i][j]);
      }
    } else {
      for (int i = 0; i < nl; ++i) {
        for (int j = 0; j < nc; ++j) Store(y + base + i * cols + j, v[i][j]);
      }
    }
  }
}

// With apply_global_scale off the result is q * scale, exact in every float dtype: the emulated GEMM then folds
// both tensors' s_dec into its float32 output, as cuBLASLt's alpha does (DESIGN.md §2).
template <typename T>
void QdqImpl(ffi::ThreadPool& pool, const T* x, T* y, const Geometry& g, const Recipe& r, const RhtSigns* rht,
             bool apply_global_scale) {
  const float decode_scale = apply_global_scale ? r.scale.s_dec : 1.0f;
  if (g.axis_last() || rht == nullptr) {  // the fast path (the RHT runs along rows only)
    const Blocks blocks = r.block_2d ? Blocks::kTile : (g.axis_last() ? Blocks::kRow : Blocks::kCol);
    const int64_t lines = blocks == Blocks::kRow ? g.size() / kBlock : g.outer * (g.axis_last() ? 1 : g.k);
    const int64_t cols = blocks == Blocks::kRow ? kBlock : (g.axis_last() ? g.k : g.inner);
    const int64_t tiles = (lines + kBlock - 1) / kBlock * ((cols + kBlock - 1) / kBlock);
    const float* sq = rht != nullptr ? rht->sign_quarter : nullptr;
    auto run = [&](auto blocks_c, auto stochastic, auto use_rht) {
      ParallelFor(pool, tiles, kBlock * kBlock, [&](int64_t begin, int64_t end) {
        QdqTiles<decltype(blocks_c)::value, decltype(stochastic)::value, decltype(use_rht)::value>(
            x, y, lines, cols, r, sq, decode_scale, begin, end);
      });
      return 0;
    };
    WithBool(r.stochastic, [&](auto stochastic) {
      switch (blocks) {
        case Blocks::kRow:
          return WithBool(rht != nullptr, [&](auto use_rht) {
            return run(std::integral_constant<Blocks, Blocks::kRow>{}, stochastic, use_rht);
          });
        case Blocks::kTile:
          return WithBool(rht != nullptr, [&](auto use_rht) {
            return run(std::integral_constant<Blocks, Blocks::kTile>{}, stochastic, use_rht);
          });
        default:
          return run(std::integral_constant<Blocks, Blocks::kCol>{}, stochastic, std::false_type{});
      }
    });
    return;
  }
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

inline uint32_t RawBits(const float* p) { return BitsOf(*p); }
inline uint32_t RawBits(const Bf16* p) { return p->bits; }
inline uint32_t RawBits(const F16* p) { return p->bits; }

struct TensorStats {
  uint32_t amax_bits;  // MagnitudeBits of max |v|, v = rht(x) if the RHT applies, else x
  uint32_t digest;     // wrapping sum of x's element bits (zero-extended): a key that changes with x
};

// One read of x (two with the RHT and a digest). Max and wrapping sum are order-free, so the result does not depend on
// how the pool splits the work.
template <typename T>
TensorStats MeasureTensor(ffi::ThreadPool& pool, const T* x, const Geometry& g, const RhtSigns* rht, bool digest) {
  std::atomic<uint32_t> amax{0}, sum{0};
  auto fold_max = [&](uint32_t m) {
    for (uint32_t cur = amax.load(std::memory_order_relaxed);
         m > cur && !amax.compare_exchange_weak(cur, m, std::memory_order_relaxed);) {
    }
  };
  if (rht == nullptr || digest) {
    ParallelFor(pool, g.size(), 1, [&](int64_t begin, int64_t end) {
      uint32_t m = 0, s = 0;
      if (rht == nullptr) {
        for (int64_t i = begin; i < end; ++i) {
          const uint32_t a = MagnitudeBits(Load(x + i));
          m = a > m ? a : m;
        }
      }
      if (digest) {
        for (int64_t i = begin; i < end; ++i) s += RawBits(x + i);
      }
      fold_max(m);
      sum.fetch_add(s, std::memory_order_relaxed);
    });
  }
  if (rht != nullptr) {
    ForEachTile(pool, x, g, rht->sign_quarter, /*recipe=*/nullptr,
                [&](auto, const Tile& tile, const TileValues& tv, const BlockScale*) {
                  uint32_t m = 0;
                  for (int c = 0; c < tile.ncols; ++c) {
                    for (int j = 0; j < kBlock; ++j) {
                      const uint32_t a = MagnitudeBits(tv.v[c][j]);
                      m = a > m ? a : m;
                    }
                  }
                  fold_max(m);
                });
  }
  return {amax.load(), sum.load()};
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

// The checks both qdq handlers make: x's geometry, the seed, and a result of x's shape and dtype.
ffi::Error CheckQdq(const ffi::AnyBuffer& x, const ffi::AnyBuffer& y, int64_t axis, bool stochastic, int64_t rht_seed,
                    Geometry* g) {
  if (ffi::Error e = FirstError({AxisGeometry(x.dimensions(), axis, g), CheckSeed(rht_seed),
                                 CheckSameShape(x, y, "the result")});
      e.failure()) {
    return e;
  }
  if (y.element_type() != x.element_type()) {
    return ffi::Error::InvalidArgument("the result must have x's dtype (code " +
                                       std::to_string(static_cast<int>(x.element_type())) + "), got code " +
                                       std::to_string(static_cast<int>(y.element_type())));
  }
  if (stochastic && g->size() > (int64_t{1} << 32)) {
    return ffi::Error::InvalidArgument("stochastic rounding supports tensors of at most 2**32 elements, got shape " +
                                       ShapeString(x.dimensions()));
  }
  return ffi::Error::Success();
}

ffi::Error QdqFfi(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer s_dec, ffi::AnyBuffer key,
                  ffi::Result<ffi::AnyBuffer> y, int64_t axis, bool block_2d, bool stochastic, bool rht,
                  int64_t rht_seed, bool apply_global_scale) {
  Geometry g;
  if (ffi::Error e = FirstError({CheckQdq(x, *y, axis, stochastic, rht_seed, &g),
                                 CheckScalar(s_dec, ffi::DataType::F32, "s_dec"),
                                 CheckScalar(key, ffi::DataType::U32, "key")});
      e.failure()) {
    return e;
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

// For programs that are not partitioned, where x is the whole tensor: the amax and the key come from x itself instead
// of from reductions emitted around the call (the same numbers: the pass's _amax and _digest), which keeps XLA's
// compile time and the step's memory traffic close to the baseline's.
ffi::Error QdqWithScaleFfi(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                           ffi::Result<ffi::AnyBuffer> s_dec, int64_t axis, bool block_2d, bool stochastic, bool rht,
                           int64_t rht_seed, int64_t salt) {
  Geometry g;
  if (ffi::Error e = FirstError({CheckQdq(x, *y, axis, stochastic, rht_seed, &g),
                                 CheckScalar(*s_dec, ffi::DataType::F32, "the s_dec result"), CheckSalt(salt)});
      e.failure()) {
    return e;
  }
  const RhtSigns signs(static_cast<uint32_t>(rht_seed));
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.untyped_data());
    const TensorStats stats = MeasureTensor(pool, xp, g, rht ? &signs : nullptr, stochastic);
    const float scale = GlobalDecodeScale(stats.amax_bits);
    const uint32_t key = (stochastic ? stats.digest : 0u) ^ static_cast<uint32_t>(salt);
    *static_cast<float*>(s_dec->untyped_data()) = scale;
    QdqImpl(pool, xp, static_cast<T*>(y->untyped_data()), g, Recipe{block_2d, stochastic, Mix32(key),
            MakeTensorScale(scale)}, rht ? &signs : nullptr, /*apply_global_scale=*/false);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4QdqWithScaleCpu, xla_fp4::cpu::QdqWithScaleFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Ret<ffi::AnyBuffer>()  // y: q * scale, x's shape and dtype
                                  .Ret<ffi::AnyBuffer>()  // s_dec (float32 scalar)
                                  .Attr<int64_t>("axis")
                                  .Attr<bool>("block_2d")
                                  .Attr<bool>("stochastic")
                                  .Attr<bool>("rht")
                                  .Attr<int64_t>("rht_seed")
                                  .Attr<int64_t>("salt"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4RhtCpu, xla_fp4::cpu::RhtFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Ret<ffi::AnyBuffer>()  // y (float32)
                                  .Attr<int64_t>("axis")
                                  .Attr<int64_t>("rht_seed"));
