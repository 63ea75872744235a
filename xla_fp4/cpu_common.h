// Shared machinery of the CPU kernels: element types, input validation, a parallel loop on XLA's intra-op thread pool,
// and the 16x16 tile walker that every quantizing kernel is built on.
#ifndef XLA_FP4_CPU_COMMON_H_
#define XLA_FP4_CPU_COMMON_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
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

// The hot tile loops are compiled three times, for AVX-512 (x86-64-v4), AVX2 and the baseline x86-64 ISA, and the
// loader picks one (an ifunc): the extension stays portable and gets the wider vectors where they exist. The float
// math is the same either way (no FMA: -ffp-contract=off). Define XLA_FP4_VECTOR_CLONES empty to build the baseline
// only.
#if !defined(XLA_FP4_VECTOR_CLONES)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define XLA_FP4_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#elif defined(__x86_64__) && defined(__clang__) && !defined(__CUDACC__)
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

// A subnormal float32 loads as zero (nvfp4_format.h FlushSubnormal); float16's subnormals are normal in float32.
inline float Load(const float* p) { return FlushSubnormal(*p); }
inline float Load(const Bf16* p) { return FlushSubnormal(FloatOf(static_cast<uint32_t>(p->bits) << 16)); }
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

// A tensor viewed as (outer, K, inner) around the quantization axis (numerics/nvfp4.py canonical_axis); the tile
// walker below views it as a row-major matrix (View).
struct Geometry : AxisShape {  // outer, k, inner and size() (ffi_checks.h)
  bool axis_last() const { return inner == 1; }
};

// What a quantizing kernel reads from its operands besides x (numerics/nvfp4.py _encode with the caller's s_dec): the
// tensor's global scale and its stochastic-rounding key. (On a GPU both stay on the device.)
struct TensorParams {
  TensorScale scale;
  uint32_t mixed_key;  // Mix32(key)
};

inline TensorParams MakeTensorParams(float s_dec, uint32_t key) { return {MakeTensorScale(s_dec), Mix32(key)}; }
// The same from a call's s_dec (float32 scalar) and key (uint32 scalar) operands, both already checked.
inline TensorParams MakeTensorParams(const ffi::AnyBuffer& s_dec, const ffi::AnyBuffer& key) {
  return MakeTensorParams(*static_cast<const float*>(s_dec.untyped_data()),
                          *static_cast<const uint32_t*>(key.untyped_data()));
}

// ---- x viewed as a row-major matrix (lines, cols), walked in 16x16 tiles of contiguous rows ----
//
// Every layout the kernels take maps onto one of three tile shapes with memory-contiguous rows, so that loads, stores
// and the element math run over fixed 16-wide rows the compiler vectorizes (no gather/scatter):
//   kRow:  the blocks are the tile's rows (axis last, 1D: x is a flat run of blocks, cols = 16);
//   kCol:  the blocks are the tile's columns (another axis, 1D: lines = outer * K, cols = inner);
//   kTile: the whole 16x16 tile is one block (2D: axis last with lines = outer, cols = K, or another axis with
//          lines = outer * K, cols = inner; K % 16 == 0, so no tile straddles two blocks).
// The RHT runs along K: along the tile's rows when the axis is the last one, else down its columns (K % 16 == 0 keeps
// every 16 lines inside one block there). Partial tiles are padded with zeros, which change no block amax and
// transform to zeros; their results are not stored.
enum class Blocks { kRow, kCol, kTile };
enum class RhtAlong { kNone, kRows, kCols };

struct View {
  int64_t lines, cols;
  bool k_along_cols;  // K runs along the view's rows (the axis is the last one), else down its columns
  int64_t tiles() const { return (lines + kBlock - 1) / kBlock * ((cols + kBlock - 1) / kBlock); }
};

inline View ViewOf(const Geometry& g, Blocks blocks) {
  if (blocks == Blocks::kRow) return {g.size() / kBlock, kBlock, true};
  return g.axis_last() ? View{g.outer, g.k, true} : View{g.outer * g.k, g.inner, false};
}

// Rht16 along each row of a tile, a row held as four 4-lane vectors (quads), which every x86-64 has: stages 1 and 2
// pair lanes of one quad (a constant shuffle, the sum and difference, a blend), stages 4 and 8 pair whole quads. Each
// output is Rht16's a + b or a - b of the same operands, so every row rounds as Rht16's. (A wider vector would need
// shuffles that SSE2 lacks and GCC expands element by element through memory: the RHT kernels of the AVX2 and
// baseline clones ran 10x slower than AVX-512's with a row as one 16-lane vector, measured.)
#if defined(__GNUC__) && !defined(__clang__)
typedef float Quad __attribute__((vector_size(4 * sizeof(float))));
typedef int32_t QuadLanes __attribute__((vector_size(4 * sizeof(int32_t))));

// Butterfly stage `kHalf` (1 or 2) within a quad: lane l adds its partner l ^ kHalf when it is the pair's first,
// else is subtracted from it.
template <int kHalf>
inline Quad QuadStage(Quad r) {
  constexpr QuadLanes lane = {0, 1, 2, 3};
  const Quad partner = __builtin_shuffle(r, lane ^ kHalf);
  return (lane & kHalf) == 0 ? r + partner : partner - r;
}
#endif

inline void Rht16Rows(float (&v)[kBlock][kBlock], const float* sign_quarter) {
#if defined(__GNUC__) && !defined(__clang__)
  Quad signs[4];
  std::memcpy(signs, sign_quarter, sizeof signs);
  for (int i = 0; i < kBlock; ++i) {
    Quad q[4];
    std::memcpy(q, v[i], sizeof q);
    for (Quad& x : q) x = QuadStage<2>(QuadStage<1>(x));
    const Quad a0 = q[0] + q[1], a1 = q[0] - q[1], a2 = q[2] + q[3], a3 = q[2] - q[3];  // stage 4
    q[0] = (a0 + a2) * signs[0];                                                          // stage 8, the signs
    q[1] = (a1 + a3) * signs[1];
    q[2] = (a0 - a2) * signs[2];
    q[3] = (a1 - a3) * signs[3];
    std::memcpy(v[i], q, sizeof q);
  }
#else
  for (int i = 0; i < kBlock; ++i) Rht16(v[i], sign_quarter);
#endif
}

// Rht16 down each column of a tile: the same butterfly and sign order, so every column rounds as Rht16 would. A stage
// adds and subtracts whole rows; GCC's vector extensions keep each row in registers (lane-wise arithmetic, which every
// vector ISA splits into its own widths: no shuffle).
inline void Rht16Columns(float (&v)[kBlock][kBlock], const float* sign_quarter) {
#if defined(__GNUC__) && !defined(__clang__)
  typedef float Row __attribute__((vector_size(kBlock * sizeof(float))));
  Row r[kBlock];
  std::memcpy(r, v, sizeof r);
#pragma GCC unroll 4
  for (int half = 1; half < kBlock; half *= 2) {
#pragma GCC unroll 8
    for (int g = 0; g < kBlock; g += 2 * half) {
#pragma GCC unroll 8
      for (int i = g; i < g + half; ++i) {
        const Row a = r[i], b = r[i + half];
        r[i] = a + b;
        r[i + half] = a - b;
      }
    }
  }
  for (int i = 0; i < kBlock; ++i) r[i] *= sign_quarter[i];
  std::memcpy(v, r, sizeof r);
#else
  for (int half = 1; half < kBlock; half *= 2) {
    for (int g = 0; g < kBlock; g += 2 * half) {
      for (int i = g; i < g + half; ++i) {
        for (int j = 0; j < kBlock; ++j) {
          const float a = v[i][j], b = v[i + half][j];
          v[i][j] = a + b;
          v[i + half][j] = a - b;
        }
      }
    }
  }
  for (int i = 0; i < kBlock; ++i) {
    for (int j = 0; j < kBlock; ++j) v[i][j] *= sign_quarter[i];
  }
#endif
}

inline uint32_t RawBits(const float* p) { return BitsOf(*p); }
inline uint32_t RawBits(const Bf16* p) { return p->bits; }
inline uint32_t RawBits(const F16* p) { return p->bits; }

// The largest magnitude of a row of 16 floats, as bits (sign cleared; NaN above Inf): the four quarters' lanes first,
// then the last four by two shuffles, in 4-lane vectors that every x86-64 has. The auto-vectorizer's form of this
// loop transposed 16 rows through shuffles and the stack: half of the 1x16 quantizers' time on AVX2 (measured).
inline uint32_t RowMaxMagnitudeBits(const float* row) {
#if defined(__GNUC__) && !defined(__clang__)
  typedef uint32_t Bits4 __attribute__((vector_size(4 * sizeof(uint32_t))));
  Bits4 q[4];
  std::memcpy(q, row, sizeof q);
  const Bits4 magnitude = {0x7FFFFFFFu, 0x7FFFFFFFu, 0x7FFFFFFFu, 0x7FFFFFFFu};
  for (Bits4& x : q) x &= magnitude;
  Bits4 m = q[0] > q[1] ? q[0] : q[1];
  const Bits4 m23 = q[2] > q[3] ? q[2] : q[3];
  m = m > m23 ? m : m23;
  Bits4 s = __builtin_shuffle(m, Bits4{2, 3, 0, 1});
  m = m > s ? m : s;
  s = __builtin_shuffle(m, Bits4{1, 0, 3, 2});
  m = m > s ? m : s;
  return m[0];
#else
  uint32_t m = 0;
  for (int j = 0; j < kBlock; ++j) {
    const uint32_t a = BitsOf(row[j]) & 0x7FFFFFFFu;
    m = a > m ? a : m;
  }
  return m;
#endif
}

// Where tile t of a view lies.
struct TilePos {
  int64_t base;  // row-major index of its element (0, 0)
  int nl, nc;    // valid lines and columns
  bool full;
};

inline TilePos PosOf(const View& view, int64_t t) {
  const int64_t col_groups = (view.cols + kBlock - 1) / kBlock;
  const int64_t l0 = t / col_groups * kBlock, c0 = t % col_groups * kBlock;
  const int nl = static_cast<int>(std::min<int64_t>(kBlock, view.lines - l0));
  const int nc = static_cast<int>(std::min<int64_t>(kBlock, view.cols - c0));
  return {l0 * view.cols + c0, nl, nc, nl == kBlock && nc == kBlock};
}

// Loads a tile as float32 (zero padded) and applies the RHT; with kDigest also returns the sum of the raw bits.
template <RhtAlong kRht, bool kDigest, typename T>
inline uint32_t LoadTransformed(const T* x, const View& view, const TilePos& p, const float* sign_quarter,
                                float (&v)[kBlock][kBlock]) {
  uint32_t digest = 0;
  if (p.full) {
    for (int i = 0; i < kBlock; ++i) {
      const T* in = x + p.base + i * view.cols;
      for (int j = 0; j < kBlock; ++j) v[i][j] = Load(in + j);
      if constexpr (kDigest) {
        for (int j = 0; j < kBlock; ++j) digest += RawBits(in + j);
      }
    }
  } else {
    for (int i = 0; i < kBlock; ++i) {
      for (int j = 0; j < kBlock; ++j) {
        const bool in = i < p.nl && j < p.nc;
        v[i][j] = in ? Load(x + p.base + i * view.cols + j) : 0.0f;
        if constexpr (kDigest) digest += in ? RawBits(x + p.base + i * view.cols + j) : 0u;
      }
    }
  }
  if constexpr (kRht == RhtAlong::kRows) {
    Rht16Rows(v, sign_quarter);
  } else if constexpr (kRht == RhtAlong::kCols) {
    Rht16Columns(v, sign_quarter);
  }
  return digest;
}

// The block of element (i, j) of a tile: its line (kRow), its column (kCol) or the whole tile (kTile).
template <Blocks kBlocks>
inline int BlockOf(int i, int j) {
  return kBlocks == Blocks::kRow ? i : (kBlocks == Blocks::kCol ? j : 0);
}

// A tile's 16 block scales (BlockScaleOfCode) held as arrays, field by field, so that the loops over the tile's elements
// vectorize; Block(b) reassembles block b's.
struct TileScales {
  alignas(64) float scale[kBlock], inv[kBlock];
  alignas(64) uint32_t zero[kBlock];

  // From the blocks' E4M3 codes: one loop of fixed trip count that vectorizes.
  void Set(const uint8_t* code, const TensorScale& t) {
    for (int b = 0; b < kBlock; ++b) {
      scale[b] = E4M3Decode(code[b]);
      const float denom = FlushSubnormal(scale[b] * t.s_dec);  // 1 / a subnormal overflows
      inv[b] = 1.0f / denom;
      zero[b] = denom == 0.0f ? 1u : 0u;
    }
  }

  BlockScale Block(int b) const {
    BlockScale s;
    s.code = 0;
    s.scale = scale[b];
    s.inv_denom = inv[b];
    s.zero = zero[b] != 0u;
    return s;
  }
};

// Four Over Six (arXiv 2512.02010; numerics/nvfp4.py _four_over_six): the E4M3 code of each block (16x16 tile) that
// decodes it with the smaller sum of squared errors, its scale to 6 or its scale to 4 (a tie keeps 6). The errors of a
// block are summed by halves over its 16 elements along K and, for a tile, over its 16 blocks, as the twin sums them;
// both candidates round with the same random bits. v: the tile as loaded (a partial tile's padding is zero and adds
// no error).
template <Blocks kBlocks, bool kStochastic>
inline void ChooseFourOverSix(const float (&v)[kBlock][kBlock], const uint32_t (&am)[kBlock], const View& view,
                              const TilePos& p, const TensorParams& tensor, uint8_t (&code)[kBlock]) {
  float sse[2][kBlock];
  uint8_t codes[2][kBlock];
  for (int b = 0; b < kBlock; ++b) {
    codes[0][b] = MakeBlockScale(AmaxFromBits(am[b]), tensor.scale).code;
    codes[1][b] = MakeBlockScaleToFour(AmaxFromBits(am[b]), tensor.scale).code;
  }
  for (int c = 0; c < 2; ++c) {
    // The errors laid out as the tile is, so that the loops vectorize.
    TileScales scales;
    scales.Set(codes[c], tensor.scale);
    alignas(64) float e[kBlock][kBlock];
    for (int i = 0; i < kBlock; ++i) {
      const uint32_t index0 = static_cast<uint32_t>(p.base + i * view.cols);
      for (int j = 0; j < kBlock; ++j) {
        const float u =
            kStochastic ? UniformFromBits(RandomBits(tensor.mixed_key, index0 + static_cast<uint32_t>(j))) : 0.0f;
        e[i][j] = SquaredError(v[i][j], scales.Block(BlockOf<kBlocks>(i, j)), tensor.scale.s_dec, kStochastic, u);
      }
    }
    // Per line of 16 along K: the rows' sums where K runs along them, else the columns' (the same halves, per column).
    if (view.k_along_cols) {
      for (int l = 0; l < kBlock; ++l) sse[c][l] = TreeSum16(e[l]);
    } else {
      for (int width = kBlock / 2; width > 0; width /= 2) {
        for (int l = 0; l < width; ++l) {
          for (int j = 0; j < kBlock; ++j) e[l][j] += e[l + width][j];
        }
      }
      for (int j = 0; j < kBlock; ++j) sse[c][j] = e[0][j];
    }
    if constexpr (kBlocks == Blocks::kTile) {
      const float tile = TreeSum16(sse[c]);
      for (int l = 0; l < kBlock; ++l) sse[c][l] = tile;
    }
  }
  // A line of 16 along K is block BlockOf's index: kRow's rows, kCol's columns, a tile's one block.
  for (int b = 0; b < kBlock; ++b) code[b] = sse[1][b] < sse[0][b] ? codes[1][b] : codes[0][b];
}

// The one tile walker of the quantizing kernels: loads tiles [t_begin, t_end) of `view` (the RHT applied), measures
// each block's amax, makes its E4M3 scale and quantizes every element to its E2M1 value q, which with kDecode becomes
// q * scale in the same loop (where it vectorizes; a compile-time choice, as a run-time one stops the stochastic loop
// from vectorizing), then hands the tile to sink(p, v, code) with code[b] the E4M3 code of block b (BlockOf<kBlocks>).
// With `four_over_six` each block's code is ChooseFourOverSix's.
template <Blocks kBlocks, bool kStochastic, RhtAlong kRht, bool kDecode, typename T, typename Sink>
// flatten: with the sink inlined by request only, GCC left the stochastic variant 20% slower (measured).
XLA_FP4_VECTOR_CLONES __attribute__((flatten)) void QuantizeTiles(const T* x, const View& view,
                                                                 const TensorParams& tensor, const float* sign_quarter,
                                                                 bool four_over_six,
                                                                 int64_t t_begin, int64_t t_end, Sink&& sink) {
  alignas(64) float v[kBlock][kBlock];
  alignas(64) uint32_t am[kBlock];
  TileScales scales;
  alignas(16) uint8_t code[kBlock];
  for (int64_t t = t_begin; t < t_end; ++t) {
    const TilePos p = PosOf(view, t);
    LoadTransformed<kRht, false>(x, view, p, sign_quarter, v);
    // Block amax, as bits.
    if constexpr (kBlocks == Blocks::kRow) {
      for (int i = 0; i < kBlock; ++i) am[i] = RowMaxMagnitudeBits(v[i]);
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
    if (four_over_six) {
      ChooseFourOverSix<kBlocks, kStochastic>(v, am, view, p, tensor, code);
    } else {
      for (int b = 0; b < kBlock; ++b) code[b] = E4M3Encode(AmaxFromBits(am[b]) * tensor.scale.s_enc_over_6);
    }
    scales.Set(code, tensor.scale);
    // Quantize in place: v becomes q, or its decoded value.
    for (int i = 0; i < kBlock; ++i) {
      const uint32_t index0 = static_cast<uint32_t>(p.base + i * view.cols);  // < 2**32 when stochastic (checked)
      for (int j = 0; j < kBlock; ++j) {
        const BlockScale s = scales.Block(BlockOf<kBlocks>(i, j));
        const float u =
            kStochastic ? UniformFromBits(RandomBits(tensor.mixed_key, index0 + static_cast<uint32_t>(j))) : 0.0f;
        const float q = QuantizeElement(v[i][j], s, kStochastic, u);
        if constexpr (kDecode) {
          // DecodeElement(q, s.scale, 1) without its flush: the product is exact (2 + 4 significant bits) and zero or
          // at least 2**-10 in magnitude.
          v[i][j] = q * s.scale;
        } else {
          v[i][j] = q;
        }
      }
    }
    sink(p, v, code);
  }
}

inline RhtAlong RhtDirection(const Geometry& g, const RhtSigns* rht) {
  return rht == nullptr ? RhtAlong::kNone : (g.axis_last() ? RhtAlong::kRows : RhtAlong::kCols);
}

// Calls f(integral_constant<RhtAlong, ...>) with the runtime direction as a compile-time one.
template <typename F>
auto WithRht(RhtAlong along, F&& f) {
  switch (along) {
    case RhtAlong::kRows: return f(std::integral_constant<RhtAlong, RhtAlong::kRows>{});
    case RhtAlong::kCols: return f(std::integral_constant<RhtAlong, RhtAlong::kCols>{});
    default: return f(std::integral_constant<RhtAlong, RhtAlong::kNone>{});
  }
}

// Quantizes every tile of x in parallel (1x16 blocks along the axis, or 16x16 tiles when r.block_2d; the RHT along
// the axis when r.rht), with the blocks, the rounding and the RHT direction as compile-time variants, and hands each
// tile to sink(blocks, view, p, v, code): blocks a std::integral_constant<Blocks, ...>, the rest as QuantizeTiles
// gives them (with kDecode v holds q * scale, else q).
template <bool kDecode, typename T, typename Sink>
void ForEachQuantizedTile(ffi::ThreadPool& pool, const T* x, const Geometry& g, const Recipe& r,
                          const TensorParams& tensor, Sink&& sink) {
  const RhtSigns* rht = r.rht_signs();
  const Blocks blocks = r.block_2d ? Blocks::kTile : (g.axis_last() ? Blocks::kRow : Blocks::kCol);
  const View view = ViewOf(g, blocks);
  const float* sq = rht != nullptr ? rht->sign_quarter : nullptr;
  auto run = [&](auto blocks_c, auto stochastic, auto along) {
    ParallelFor(pool, view.tiles(), kBlock * kBlock, [&](int64_t begin, int64_t end) {
      QuantizeTiles<decltype(blocks_c)::value, decltype(stochastic)::value, decltype(along)::value, kDecode>(
          x, view, tensor, sq, r.four_over_six, begin, end,
          [&](const TilePos& p, float (&v)[kBlock][kBlock], const uint8_t* code) { sink(blocks_c, view, p, v, code); });
    });
    return 0;
  };
  // kRow only meets the RHT along rows and kCol only down columns (both follow from axis_last).
  WithBool(r.stochastic, [&](auto stochastic) {
    return WithRht(RhtDirection(g, rht), [&](auto along) {
      switch (blocks) {
        case Blocks::kTile:
          return run(std::integral_constant<Blocks, Blocks::kTile>{}, stochastic, along);
        case Blocks::kRow:
          if constexpr (decltype(along)::value != RhtAlong::kCols) {
            return run(std::integral_constant<Blocks, Blocks::kRow>{}, stochastic, along);
          }
          return 0;
        default:
          if constexpr (decltype(along)::value != RhtAlong::kRows) {
            return run(std::integral_constant<Blocks, Blocks::kCol>{}, stochastic, along);
          }
          return 0;
      }
    });
  });
}


// ---- the OCP MX formats' blocks of 32 (numerics/mx.py), shared by xla_fp4_mx_qdq and the packed MX quantizer ----

// Where MX block b (row-major over x's (outer, K/32, inner)) starts in x; its elements are `inner` apart.
inline int64_t MxBlockBase(const Geometry& g, int64_t b) {
  const int64_t blocks = g.k / kMxBlock, o = b / (blocks * g.inner), block = (b / g.inner) % blocks, i = b % g.inner;
  return (o * g.k + block * kMxBlock) * g.inner + i;
}

// The 32 values of MX block b, after the RHT where it applies: their largest magnitude in *amax, and whether any is
// NaN or Inf.
template <typename T>
bool LoadMxBlock(const T* x, const Geometry& g, int64_t b, const Recipe& r, float (&v)[kMxBlock], float* amax) {
  const int64_t base = MxBlockBase(g, b);
  if (g.inner == 1) {  // the axis is the last: one contiguous run, which vectorizes
    for (int j = 0; j < kMxBlock; ++j) v[j] = Load(x + base + j);
  } else {
    for (int j = 0; j < kMxBlock; ++j) v[j] = Load(x + base + j * g.inner);
  }
  return MxPrepareBlock(v, r, amax);
}

// MX blocks [begin, end) of x: fn(b, v, amax, bad) with v the block's values (LoadMxBlock). Compiled per vector ISA
// with fn inlined (as QuantizeTiles), so that the blocks' element loops take the wider vectors.
template <typename T, typename Fn>
XLA_FP4_VECTOR_CLONES __attribute__((flatten)) void WalkMxBlocks(const T* x, const Geometry& g, const Recipe& r,
                                                                int64_t begin, int64_t end, Fn&& fn) {
  alignas(64) float v[kMxBlock];
  for (int64_t b = begin; b < end; ++b) {
    float m;
    const bool bad = LoadMxBlock(x, g, b, r, v, &m);
    fn(b, v, m, bad);
  }
}

// Calls store(b, v, amax) for every MX block b of x, in parallel: v the block's values (LoadMxBlock), amax its largest
// magnitude or with block_2d its 32x32 tile's (NaN where the block or tile holds a NaN or an Inf). 1x32 blocks take
// one pass over x; tiles first take the blocks' maxima, the tile being 32 consecutive partner positions (inner, or
// outer where inner is 1), a partial one at the end.
template <typename T, typename Store>
void ForEachMxBlock(ffi::ThreadPool& pool, const T* x, const Geometry& g, const Recipe& r, Store&& store) {
  const int64_t blocks = g.k / kMxBlock, n = g.outer * blocks * g.inner;
  if (!r.block_2d) {
    ParallelFor(pool, n, kMxBlock, [&](int64_t begin, int64_t end) {
      WalkMxBlocks(x, g, r, begin, end, [&](int64_t b, const float (&v)[kMxBlock], float m, bool bad) {
        store(b, v, bad ? FloatOf(0x7FC00000u) : m);
      });
    });
    return;
  }
  std::vector<float> amax(n);
  ParallelFor(pool, n, kMxBlock, [&](int64_t begin, int64_t end) {
    WalkMxBlocks(x, g, r, begin, end, [&](int64_t b, const float (&)[kMxBlock], float m, bool bad) {
      amax[b] = bad ? FloatOf(0x7FC00000u) : m;
    });
  });
  const bool along_inner = g.inner > 1;
  const int64_t stride = along_inner ? 1 : blocks * g.inner, extent = along_inner ? g.inner : g.outer;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t pos = along_inner ? b % g.inner : b / (blocks * g.inner);
    if (pos % kMxBlock != 0) continue;
    float m = 0.0f;
    bool bad = false;
    for (int64_t t = 0; t < kMxBlock && pos + t < extent; ++t) {
      const float a = amax[b + t * stride];
      bad |= IsNan(a);
      m = a > m ? a : m;
    }
    for (int64_t t = 0; t < kMxBlock && pos + t < extent; ++t) amax[b + t * stride] = bad ? FloatOf(0x7FC00000u) : m;
  }
  ParallelFor(pool, n, kMxBlock, [&](int64_t begin, int64_t end) {
    WalkMxBlocks(x, g, r, begin, end,
                 [&](int64_t b, const float (&v)[kMxBlock], float, bool) { store(b, v, amax[b]); });
  });
}


}  // namespace xla_fp4::cpu

#endif  // XLA_FP4_CPU_COMMON_H_
