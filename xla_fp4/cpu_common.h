// Shared machinery of the CPU kernels: element types, input validation, a parallel loop on XLA's intra-op thread pool,
// and the 16x16 tile walker that every quantizing kernel is built on.
#ifndef XLA_FP4_CPU_COMMON_H_
#define XLA_FP4_CPU_COMMON_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#else
#include <cfenv>
#endif

#include "xla/ffi/api/ffi.h"
#include "xla_fp4/ffi_checks.h"
#include "xla_fp4/nvfp4_format.h"

// The hot tile loops are compiled twice, for AVX2 and for the baseline x86-64 ISA, and the loader picks one (an ifunc):
// the extension stays portable and gets the wider vectors where they exist. The float math is the same either way
// (no FMA: -ffp-contract=off, and the avx2 target does not enable it).
// Define XLA_FP4_VECTOR_CLONES empty to build the baseline only.
#if !defined(XLA_FP4_VECTOR_CLONES)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
#define XLA_FP4_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define XLA_FP4_VECTOR_CLONES
#endif
#endif

namespace xla_fp4::cpu {

namespace ffi = xla::ffi;

// ---- element types: float32, and the 16-bit floats as raw bits ----

struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

inline float Load(const float* p) { return *p; }
inline float Load(const Bf16* p) { return FloatOf(static_cast<uint32_t>(p->bits) << 16); }
inline float Load(const F16* p) {
  const uint32_t h = p->bits, sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 31u, mantissa = h & 0x3FFu;
  if (exponent == 31u) return FloatOf(sign | 0x7F800000u | (mantissa << 13));  // Inf/NaN, payload kept
  if (exponent == 0u) return CopySign(static_cast<float>(mantissa) * 0x1p-24f, FloatOf(sign));  // exact
  return FloatOf(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline void Store(float* p, float v) { *p = v; }
// Round to nearest even, as XLA's convert; NaN becomes the canonical quiet NaN with x's sign (XLA CPU does the same).
inline void Store(Bf16* p, float v) {
  const uint32_t b = BitsOf(v);
  p->bits = static_cast<uint16_t>(SelectBits(IsNan(v), (b >> 16) | 0x7FC0u, (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16));
}
// Round to nearest even; NaN keeps its payload's top bits and is quieted, as the x86 conversion instruction does.
inline void Store(F16* p, float v) {
  const uint32_t b = BitsOf(v), sign = (b >> 16) & 0x8000u, a = b & 0x7FFFFFFFu;
  uint32_t h;
  if (a > 0x7F800000u) {
    h = 0x7E00u | ((a >> 13) & 0x3FFu);
  } else if (a >= 0x477FF000u) {  // rounds to 65536 or beyond
    h = 0x7C00u;
  } else if (a < 0x38800000u) {  // below 2**-14: the addition rounds to the subnormal grid (spacing 2**-24)
    h = BitsOf(FloatOf(a) + 0.5f) - BitsOf(0.5f);
  } else {
    h = (a - ((127u - 15u) << 23) + 0xFFFu + ((a >> 13) & 1u)) >> 13;
  }
  p->bits = static_cast<uint16_t>(sign | h);
}

// Calls f(T{}) with T the storage type of `dtype`, or returns an error naming `what`.
template <typename F>
ffi::Error DispatchFloat(ffi::DataType dtype, const char* what, F&& f) {
  switch (dtype) {
    case ffi::DataType::F32:
      return f(float{});
    case ffi::DataType::BF16:
      return f(Bf16{});
    case ffi::DataType::F16:
      return f(F16{});
    default:
      return ffi::Error::InvalidArgument(std::string(what) + " must be float32, bfloat16 or float16, got dtype code " +
                                         std::to_string(static_cast<int>(dtype)));
  }
}

// Calls f(std::bool_constant<b>{}) so that a runtime flag becomes a compile-time one in hot loops.
template <typename F>
auto WithBool(bool b, F&& f) {
  return b ? f(std::true_type{}) : f(std::false_type{});
}

// ---- parallel loop ----

// XLA runs executables with denormals flushed (FTZ/DAZ) on the calling thread; helper threads must compute under the
// same floating-point mode or results would differ from the reference for subnormal values.
class FpMode {
 public:
  static FpMode Current() {
    FpMode m;
#if defined(__SSE__) || defined(__x86_64__)
    m.csr_ = _mm_getcsr();
#else
    fegetenv(&m.env_);
#endif
    return m;
  }
  // Whether subnormal inputs read as zero (DAZ), as XLA runs its CPU executables: a kernel that compares bit patterns
  // instead of doing float arithmetic must flush them itself to agree with XLA's reductions.
  bool DenormalsAreZero() const {
#if defined(__SSE__) || defined(__x86_64__)
    return (csr_ & 0x0040u) != 0;
#else
    return false;
#endif
  }
  void Apply() const {
#if defined(__SSE__) || defined(__x86_64__)
    _mm_setcsr(csr_);
#else
    fesetenv(&env_);
#endif
  }

 private:
#if defined(__SSE__) || defined(__x86_64__)
  unsigned csr_ = 0;
#else
  fenv_t env_{};
#endif
};

// Runs fn(begin, end) over [0, n) in chunks on the caller and the XLA intra-op pool when the work is worth it.
// Helpers take chunks from a shared counter, so the caller never waits for a task that has not started (no deadlock
// when the pool is busy or the caller is itself a pool thread); tasks that start late find nothing left and return.
inline void ParallelFor(ffi::ThreadPool& pool, int64_t n, int64_t work_per_item,
                        const std::function<void(int64_t, int64_t)>& fn) {
  constexpr int64_t kMinWorkPerChunk = int64_t{1} << 16;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t max_chunks = std::max<int64_t>(1, n * std::max<int64_t>(work_per_item, 1) / kMinWorkPerChunk);
  const int64_t chunks = std::min({n, max_chunks, 4 * threads});
  if (chunks <= 1 || threads == 1) {
    if (n > 0) fn(0, n);
    return;
  }
  struct State {
    std::function<void(int64_t, int64_t)> fn;
    int64_t n, chunks;
    FpMode mode;
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
    void Run() {
      for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
        fn(n * c / chunks, n * (c + 1) / chunks);
        if (done.fetch_add(1) + 1 == chunks) {
          std::lock_guard<std::mutex> lock(mu);
          cv.notify_all();
        }
      }
    }
  };
  auto state = std::make_shared<State>();
  state->fn = fn;
  state->n = n;
  state->chunks = chunks;
  state->mode = FpMode::Current();
  for (int64_t t = 0; t + 1 < std::min(threads, chunks); ++t) {
    pool.Schedule([state] {
      const FpMode saved = FpMode::Current();
      state->mode.Apply();
      state->Run();
      saved.Apply();
    });
  }
  state->Run();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == chunks; });
}

// ---- 16x16 tiles ----

// A tensor viewed as (outer, K, inner) around the quantization axis (numerics/nvfp4.py canonical_axis). A tile is 16 consecutive
// positions along K times up to 16 "columns": consecutive inner positions, or consecutive outer rows when the axis is
// the last one (inner == 1). These are exactly the 2D scaling tiles; a 1D block is one column of a tile.
struct Geometry : AxisShape {  // outer, k, inner and size() (ffi_checks.h)
  bool axis_last() const { return inner == 1; }
  int64_t columns() const { return axis_last() ? outer : inner; }
  int64_t column_groups() const { return (columns() + kBlock - 1) / kBlock; }
  int64_t num_tiles() const { return (axis_last() ? 1 : outer) * (k / kBlock) * column_groups(); }
};

struct Tile {
  int64_t base;    // offset (= row-major index) of element (j = 0, c = 0)
  int64_t first;   // the first column's outer row (axis last) or inner position
  int64_t kblock;  // the block index along K
  int ncols;
};

// Tile t in an order that walks memory forwards. kAxisLast must equal g.axis_last().
template <bool kAxisLast>
inline Tile TileAt(const Geometry& g, int64_t t) {
  const int64_t kblocks = g.k / kBlock, groups = g.column_groups();
  if constexpr (kAxisLast) {
    const int64_t group = t / kblocks, kb = t % kblocks;
    const int64_t row = group * kBlock;
    return {row * g.k + kb * kBlock, row, kb, static_cast<int>(std::min<int64_t>(kBlock, g.outer - row))};
  } else {
    const int64_t group = t % groups, kb = (t / groups) % kblocks, o = t / (groups * kblocks);
    const int64_t col = group * kBlock;
    return {(o * g.k + kb * kBlock) * g.inner + col, col, kb, static_cast<int>(std::min<int64_t>(kBlock, g.inner - col))};
  }
}

// Memory strides of the tile's two directions.
template <bool kAxisLast>
inline int64_t StrideJ(const Geometry& g) {
  return kAxisLast ? 1 : g.inner;
}
template <bool kAxisLast>
inline int64_t StrideC(const Geometry& g) {
  return kAxisLast ? g.k : 1;
}

// The values of one tile in float32: v[c][j], column c, position j along K.
struct TileValues {
  float v[kBlock][kBlock];
};

template <bool kAxisLast, typename T>
inline void LoadTile(const T* x, const Geometry& g, const Tile& tile, const float* rht_sign_quarter, TileValues& tv) {
  const int64_t sj = StrideJ<kAxisLast>(g), sc = StrideC<kAxisLast>(g);
  for (int c = 0; c < tile.ncols; ++c) {
    for (int j = 0; j < kBlock; ++j) tv.v[c][j] = Load(x + tile.base + j * sj + c * sc);
    if (rht_sign_quarter != nullptr) Rht16(tv.v[c], rht_sign_quarter);
  }
}

// s_j / 4 for the RHT with `seed`.
struct RhtSigns {
  float sign_quarter[kBlock];
  explicit RhtSigns(uint32_t seed) {
    for (int j = 0; j < kBlock; ++j) sign_quarter[j] = RhtSign(seed, j) * 0.25f;
  }
};

// How a tensor is quantized (numerics/nvfp4.py _encode with the caller's s_dec).
struct Recipe {
  bool block_2d;
  bool stochastic;
  uint32_t mixed_key;  // Mix32(key)
  TensorScale scale;
};

// Quantizes a loaded tile in place: v[c][j] becomes the E2M1 value q; scales[c] is column c's block scale.
template <bool kAxisLast, bool kStochastic>
inline void QuantizeTile(const Geometry& g, const Tile& tile, const Recipe& r, TileValues& tv, BlockScale* scales) {
  float amax[kBlock] = {};  // columns past ncols stay 0 so that the scale loop below can run over all 16
  for (int c = 0; c < tile.ncols; ++c) {
    float m = 0.0f;
    bool nan = false;
    for (int j = 0; j < kBlock; ++j) {
      const float a = Abs(tv.v[c][j]);
      m = a > m ? a : m;
      nan |= IsNan(a);
    }
    amax[c] = nan ? FloatOf(0x7FC00000u) : m;  // max propagates NaN, as jnp.max does
  }
  if (r.block_2d) {
    float m = amax[0];
    for (int c = 1; c < tile.ncols; ++c) m = (amax[c] > m || IsNan(amax[c])) ? amax[c] : m;
    for (int c = 0; c < tile.ncols; ++c) amax[c] = m;
  }
  for (int c = 0; c < kBlock; ++c) scales[c] = MakeBlockScale(amax[c], r.scale);  // a fixed trip count vectorizes
  const int64_t sj = StrideJ<kAxisLast>(g), sc = StrideC<kAxisLast>(g);
  for (int c = 0; c < tile.ncols; ++c) {
    const BlockScale b = scales[c];
    const uint32_t index0 = static_cast<uint32_t>(tile.base + c * sc);  // < 2**32 when stochastic (checked)
    for (int j = 0; j < kBlock; ++j) {
      const float u = kStochastic ? UniformFromBits(RandomBits(r.mixed_key, index0 + static_cast<uint32_t>(j * sj)))
                                  : 0.0f;
      tv.v[c][j] = QuantizeElement(tv.v[c][j], b, kStochastic, u);
    }
  }
}

// Loads (and optionally transforms and quantizes) every tile of x, handing each to sink(axis_last, tile, values,
// scales) in parallel, axis_last a std::bool_constant for StrideJ/StrideC. With recipe == nullptr the values are passed
// on unquantized (scales == nullptr).
template <typename T, typename Sink>
void ForEachTile(ffi::ThreadPool& pool, const T* x, const Geometry& g, const float* rht_sign_quarter,
                 const Recipe* recipe, Sink&& sink) {
  WithBool(g.axis_last(), [&](auto axis_last) {
    WithBool(recipe != nullptr && recipe->stochastic, [&](auto stochastic) {
      ParallelFor(pool, g.num_tiles(), kBlock * kBlock, [&](int64_t begin, int64_t end) {
        TileValues tv;
        BlockScale scales[kBlock];
        for (int64_t t = begin; t < end; ++t) {
          const Tile tile = TileAt<decltype(axis_last)::value>(g, t);
          LoadTile<decltype(axis_last)::value>(x, g, tile, rht_sign_quarter, tv);
          if (recipe != nullptr) QuantizeTile<decltype(axis_last)::value, decltype(stochastic)::value>(g, tile, *recipe, tv, scales);
          sink(axis_last, tile, tv, recipe != nullptr ? scales : nullptr);
        }
      });
      return 0;
    });
    return 0;
  });
}

}  // namespace xla_fp4::cpu

#endif  // XLA_FP4_CPU_COMMON_H_
