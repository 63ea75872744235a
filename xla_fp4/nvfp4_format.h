// The NVFP4 number formats: E2M1 elements, E4M3 block scales, the counter-based random bits and the RHT signs.
//
// The normative definition is the pure-JAX reference python/xla_fp4/numerics/formats.py; every function here
// reproduces its float32 arithmetic bit for bit (same operations, all exact or correctly rounded). Shared by the CPU
// kernels and the CUDA kernels, hence XLA_FP4_HOST_DEVICE. Compile without -ffast-math and with -ffp-contract=off
// (nvcc: --fmad=false): a fused multiply-add would change results.
#ifndef XLA_FP4_NVFP4_FORMAT_H_
#define XLA_FP4_NVFP4_FORMAT_H_

#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define XLA_FP4_HOST_DEVICE __host__ __device__
#else
#define XLA_FP4_HOST_DEVICE
#endif

namespace xla_fp4 {

inline constexpr int kBlock = 16;  // elements per block along the contraction axis
inline constexpr float kE2M1Max = 6.0f;
inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kGlobalScaleDivisor = kE2M1Max * kE4M3Max;  // s_dec = amax / 2688
// s_dec is computed as amax * (1 / 2688) rounded to float32, which is what XLA makes of a division by a constant; every
// implementation (kernels, pure-JAX reference, the pass) uses this one form so that they agree bit for bit.
inline constexpr float kInvGlobalScaleDivisor = 1.0f / kGlobalScaleDivisor;
// Four Over Six (arXiv 2512.02010) takes E4M3's range as 256, so that 1.5 times any block scale fits: amax / 1536.
inline constexpr float kInvFourOverSixDivisor = 1.0f / (6.0f * 256.0f);
// np.float32(1/6): the reference multiplies by this constant rather than dividing by 6.
inline constexpr float kInvE2M1Max = 0x1.555556p-3f;
inline constexpr int kScaleTileRows = 128;  // cuBLASLt's swizzled scale tile: 128 rows x 4 blocks
inline constexpr int kScaleTileCols = 4;

static_assert(kGlobalScaleDivisor == 2688.0f, "6 * 448 is exact in float32");
static_assert(kInvE2M1Max == 1.0f / 6.0f, "must equal the correctly rounded float32 1/6");
static_assert(kBlock == 16 && kScaleTileRows % kBlock == 0, "2D tiles must not straddle scale tiles");

XLA_FP4_HOST_DEVICE inline uint32_t BitsOf(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

XLA_FP4_HOST_DEVICE inline float FloatOf(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

XLA_FP4_HOST_DEVICE inline float Abs(float v) { return FloatOf(BitsOf(v) & 0x7FFFFFFFu); }
XLA_FP4_HOST_DEVICE inline float CopySign(float magnitude, float sign) {
  return FloatOf((BitsOf(magnitude) & 0x7FFFFFFFu) | (BitsOf(sign) & 0x80000000u));
}
XLA_FP4_HOST_DEVICE inline bool IsNan(float v) { return v != v; }

// c ? a : b without a branch: the element loops then vectorize, and random data cannot mispredict.
XLA_FP4_HOST_DEVICE inline float Select(bool c, float a, float b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return FloatOf((BitsOf(a) & mask) | (BitsOf(b) & ~mask));
}

// c ? a : b on integers, without a branch.
XLA_FP4_HOST_DEVICE inline uint32_t SelectBits(bool c, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return (a & mask) | (b & ~mask);
}

// ---- one rule for subnormals and NaN, whatever the floating-point mode (docs/design.md §2) ----
// XLA runs CPU executables with denormals flushed (FTZ/DAZ); a GPU computes with them. So that both compute the same
// bits, the recipe never depends on a subnormal float32: an input below 2^-126 in magnitude counts as zero (every
// kernel's load), and so do a tensor's decode scale, a block's denominator and scale, and a decoded value. The twins
// (numerics/) apply the same rule, and the CUDA kernels are built with -ftz=true for what lies in between.
XLA_FP4_HOST_DEVICE inline float FlushSubnormal(float v) {
  const uint32_t b = BitsOf(v);
  return FloatOf((b & 0x7F800000u) == 0u ? b & 0x80000000u : b);
}

// The largest of magnitudes given as bits (sign cleared): NaN's bits sort above +Inf's, so a NaN anywhere gives a NaN,
// as jnp.max does (telemetry's amax on CPU and GPU alike).
XLA_FP4_HOST_DEVICE inline float AmaxFromBits(uint32_t m) {
  return FloatOf(SelectBits(m > 0x7F800000u, 0x7FC00000u, m));
}

// max that propagates NaN (fmaxf would drop it), like jnp.max.
XLA_FP4_HOST_DEVICE inline float MaxNan(float a, float b) { return (a > b || IsNan(a)) ? a : b; }

// Telemetry's live block: its amax compares above zero, so a NaN block is not live (numerics/telemetry.py).
XLA_FP4_HOST_DEVICE inline bool LiveBlock(float block_amax) { return block_amax > 0.0f; }

// Round to the nearest integer, ties to even, for 0 <= t < 2**23 (or NaN). The magic-number form vectorizes with SSE2,
// where rintf would be a library call; it is exact because the sum lands in [2**23, 2**24), spacing 1.
XLA_FP4_HOST_DEVICE inline float RintSmall(float t) {
#ifdef __CUDA_ARCH__
  return rintf(t);
#else
  return (t + 0x1p23f) - 0x1p23f;  // not folded away: we never build with -ffast-math
#endif
}

// ---- E2M1 ----

// The E2M1 grid around magnitude a (0 <= a <= 6, or NaN) from a's exponent alone, clamped to [0, 2]: spacing 0.5 below
// 2, 1 below 4, else 2. Integer ops on the exponent field, no compares: the element loops stay short.
struct E2M1Grid {
  float step, inv_step;  // the spacing and its exact reciprocal
  float magic;           // 2^22 times the spacing: (a + magic) - magic rounds a to the grid, ties to even
};
XLA_FP4_HOST_DEVICE inline E2M1Grid E2M1GridAt(float a) {
  uint32_t e = BitsOf(a) & 0x7F800000u;
  e = e < (127u << 23) ? (127u << 23) : e;
  e = e > (129u << 23) ? (129u << 23) : e;
  return {FloatOf(e - (1u << 23)), FloatOf((255u << 23) - e), FloatOf(e + (22u << 23))};
}

// a rounded to the multiples of g.step, ties to even: a + magic lands where floats are g.step apart, so the addition
// rounds and the subtraction is exact (NaN stays NaN). Not folded away: we never build with -ffast-math.
XLA_FP4_HOST_DEVICE inline float RoundToGrid(float a, E2M1Grid g) { return (a + g.magic) - g.magic; }

// A compare instead of min() so that NaN stays NaN.
XLA_FP4_HOST_DEVICE inline float SaturateE2M1(float a) { return Select(a > kE2M1Max, kE2M1Max, a); }

// Nearest-even rounding to the E2M1 grid, saturating at +-6; NaN stays NaN, the sign of zero is kept.
XLA_FP4_HOST_DEVICE inline float RoundE2M1Nearest(float v) {
  const float a = SaturateE2M1(Abs(v));
  return CopySign(RoundToGrid(a, E2M1GridAt(a)), v);
}

// Stochastic rounding: up to the upper neighbour with probability (a - lo) / step, given u uniform in [0, 1).
XLA_FP4_HOST_DEVICE inline float RoundE2M1Stochastic(float v, float u) {
  const float a = SaturateE2M1(Abs(v));
  const E2M1Grid g = E2M1GridAt(a);
  const float nearest = RoundToGrid(a, g);
  const float lo = Select(nearest > a, nearest - g.step, nearest);  // the grid point at or below a; NaN stays NaN
  const float frac = (a - lo) * g.inv_step;                          // exact (Sterbenz)
  return CopySign(Select(u < frac, lo + g.step, lo), v);
}

// 4-bit code of an E2M1 value: sign in bit 3, magnitude index 0..7 in bits 0..2. NaN (which E2M1 lacks) encodes 0.
// Integer ops on q's bits: t, its exponent and first mantissa bit, is 252 for 0.5, then 254, 255, ..., 259 for 1, 1.5,
// ..., 6, so the index is t - 252 from 1 up (0.5 takes 253 through the max), 0 where t is 0 (a zero of either sign);
// t >= 510 (an all-ones exponent) is NaN, as q is never infinite. Selects rather than branches, so that the packers'
// loops over a tile vectorize.
XLA_FP4_HOST_DEVICE inline uint8_t E2M1Code(float q) {
  const uint32_t bits = BitsOf(q), t = (bits >> 22) & 0x1FFu;
  const uint32_t index = SelectBits(t == 0u, 0u, (t > 253u ? t : 253u) - 252u);
  return static_cast<uint8_t>(SelectBits(t >= 510u, 0u, index | ((bits >> 28) & 8u)));
}

// N E2M1 codes as N / 2 bytes, the even element in the low nibble: each pair read as one little-endian 16-bit word,
// whose high byte's nibble moves down beside the low one (a loop that vectorizes, where pairing bytes does not).
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "PackPairs reads pairs of codes as little-endian words");
template <int N>
XLA_FP4_HOST_DEVICE inline void PackPairs(const uint8_t (&codes)[N], uint8_t* out) {
  uint16_t pairs[N / 2];
  std::memcpy(pairs, codes, sizeof pairs);
  for (int j = 0; j < N / 2; ++j) out[j] = static_cast<uint8_t>((pairs[j] & 0x0Fu) | ((pairs[j] >> 4) & 0xF0u));
}

XLA_FP4_HOST_DEVICE inline float E2M1Decode(uint8_t code) {
  const float i = static_cast<float>(code & 7);
  const float a = i < 4.0f ? i * 0.5f : (i < 6.0f ? i - 2.0f : (i - 4.0f) * 2.0f);
  return (code & 8) ? -a : a;
}

// ---- E4M3 (float8_e4m3fn: bias 7, no infinities, 0x7F/0xFF are NaN) ----

// Float32 -> E4M3 code, round to nearest even. Positive values saturate at 448 first (as the reference does); any
// other magnitude that rounds past 448 is NaN, as in ml_dtypes. Subnormals are m * 2**-9.
XLA_FP4_HOST_DEVICE inline uint8_t E4M3Encode(float v) {
  v = Select(v > kE4M3Max, kE4M3Max, v);
  const uint32_t sign = (BitsOf(v) >> 24) & 0x80u;
  const float a = Abs(v);
  const bool subnormal = a < 0x1p-6f;  // false for NaN
  // Both candidates are computed without branches (they vectorize): subnormals are m * 2**-9 (8 -> 0x08, the
  // smallest normal); normals keep 3 mantissa bits, ties to even, rebiased from 127 to 7.
  const uint32_t sub = static_cast<uint32_t>(RintSmall(Select(subnormal, a, 0.0f) * 0x1p9f));
  const uint32_t bits = BitsOf(a);
  const uint32_t normal = ((bits + 0x7FFFFu + ((bits >> 20) & 1u)) >> 20) - (120u << 3);
  // NaN needs no case of its own: its bits make `normal` exceed 0x7E (and `subnormal` is false). Mask selects rather
  // than branches, so that loops over blocks vectorize.
  const uint32_t saturated = SelectBits(normal > 0x7Eu, 0x7Fu, normal);
  const uint32_t code = SelectBits(subnormal, sub, saturated);
  return static_cast<uint8_t>(sign | code);
}

XLA_FP4_HOST_DEVICE inline float E4M3Decode(uint8_t code) {
  const uint32_t exponent = (code >> 3) & 15u, mantissa = code & 7u;
  float a = Select(exponent == 0u, static_cast<float>(mantissa) * 0x1p-9f,
                   FloatOf(((exponent + 120u) << 23) | (mantissa << 20)));
  a = Select((code & 0x7Fu) == 0x7Fu, FloatOf(0x7FC00000u), a);
  return CopySign(a, FloatOf(static_cast<uint32_t>(code & 0x80u) << 24));
}

// ---- counter-based random bits (formats.mix32 / random_bits / uniform_from_bits) ----

// Wellons' lowbias32 finalizer.
XLA_FP4_HOST_DEVICE inline uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

XLA_FP4_HOST_DEVICE inline uint32_t FoldIn(uint32_t key, uint32_t data) { return Mix32(key ^ Mix32(data)); }

// The bits of the element at row-major position `index` of a tensor rounded with `key`; pass mixed_key = Mix32(key).
XLA_FP4_HOST_DEVICE inline uint32_t RandomBits(uint32_t mixed_key, uint32_t index) { return Mix32(index ^ mixed_key); }

XLA_FP4_HOST_DEVICE inline float UniformFromBits(uint32_t bits) { return static_cast<float>(bits >> 8) * 0x1p-24f; }

// ---- random Hadamard transform (numerics/rht.py) ----

// Sign j (0..15) of the RHT sign vector for `seed`: -1 where bit 31 of mix32(j ^ mix32(seed)) is set.
XLA_FP4_HOST_DEVICE inline float RhtSign(uint32_t seed, int j) {
  return (Mix32(static_cast<uint32_t>(j) ^ Mix32(seed)) >> 31) ? -1.0f : 1.0f;
}

// In-place RHT of 16 values: the butterfly H16 (stages half = 1, 2, 4, 8, pairs (i, i + half) -> (a + b, a - b)), then
// times sign_quarter[j] = s_j / 4 (exact). The same order as rht.rht_f32, so the sums round identically.
XLA_FP4_HOST_DEVICE inline void Rht16(float* v, const float* sign_quarter) {
  for (int half = 1; half < kBlock; half *= 2) {
    for (int g = 0; g < kBlock; g += 2 * half) {
      for (int i = g; i < g + half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a + b;
        v[i + half] = a - b;
      }
    }
  }
  for (int j = 0; j < kBlock; ++j) v[j] *= sign_quarter[j];
}

// s_j / 4 for the RHT with `seed`: Rht16's factors.
struct RhtSigns {
  float sign_quarter[kBlock];
  explicit RhtSigns(uint32_t seed) {
    for (int j = 0; j < kBlock; ++j) sign_quarter[j] = RhtSign(seed, j) * 0.25f;
  }
};

// How one call quantizes, from its attributes (python/xla_fp4/kernels/__init__.py): 16x16 tiles or 1x16 blocks, stochastic or
// nearest rounding, the RHT along the axis or none, and NVFP4's block scales to 6 or (Four Over Six) to 4 or 6. The CPU
// and the CUDA kernels take it alike (by value on a GPU).
struct Recipe {
  bool block_2d, stochastic, rht;
  RhtSigns signs;
  bool four_over_six;
  Recipe(bool block_2d, bool stochastic, bool rht, int64_t rht_seed, bool four_over_six = false)
      : block_2d(block_2d), stochastic(stochastic), rht(rht), signs(static_cast<uint32_t>(rht_seed)),
        four_over_six(four_over_six) {}
  const RhtSigns* rht_signs() const { return rht ? &signs : nullptr; }
};

// ---- the recipe (numerics/nvfp4.py _encode / _decode) ----

// |v| as bits for a per-tensor amax in which NaN counts as +Inf: for non-negative floats the integer order is the float
// order. An Inf or NaN anywhere makes s_dec Inf, so the whole tensor decodes to NaN (docs/design.md §2).
XLA_FP4_HOST_DEVICE inline uint32_t MagnitudeBits(float v) {
  const uint32_t a = BitsOf(v) & 0x7FFFFFFFu;
  return a < 0x7F800000u ? a : 0x7F800000u;
}

// The global decode scale of a tensor whose amax (as MagnitudeBits) is `amax_bits`: amax / 2688, or amax / 1536 for
// Four Over Six.
XLA_FP4_HOST_DEVICE inline float GlobalDecodeScale(uint32_t amax_bits, bool four_over_six = false) {
  const float inverse = four_over_six ? kInvFourOverSixDivisor : kInvGlobalScaleDivisor;
  return FlushSubnormal(FloatOf(amax_bits) * inverse);  // a subnormal s_dec: the tensor encodes zeros
}

// Per-tensor constants derived from the global decode scale s_dec.
struct TensorScale {
  float s_dec;
  float s_enc_over_6;  // (s_dec == 0 ? 0 : 1 / s_dec) * (1/6)
};

XLA_FP4_HOST_DEVICE inline TensorScale MakeTensorScale(float s_dec) {
  s_dec = FlushSubnormal(s_dec);  // else 1 / s_dec overflows to Inf and a zero block decodes as 0 * Inf = NaN
  const float s_enc = s_dec == 0.0f ? 0.0f : 1.0f / s_dec;
  return {s_dec, s_enc * kInvE2M1Max};
}

// Everything a block needs: its E4M3 scale (code and value) and the factor that maps x onto the E2M1 grid.
struct BlockScale {
  uint8_t code;
  float scale;      // E4M3Decode(code)
  float inv_denom;  // 1 / (scale * s_dec)
  bool zero;        // scale * s_dec == 0: the block encodes zeros
};

XLA_FP4_HOST_DEVICE inline BlockScale BlockScaleOfCode(uint8_t code, TensorScale t) {
  BlockScale b;
  b.code = code;
  b.scale = E4M3Decode(code);
  const float denom = FlushSubnormal(b.scale * t.s_dec);  // 1 / a subnormal overflows
  b.inv_denom = 1.0f / denom;
  b.zero = denom == 0.0f;
  return b;
}

// The block scale that maps the block's largest magnitude to 6, E4M3-rounded.
XLA_FP4_HOST_DEVICE inline BlockScale MakeBlockScale(float block_amax, TensorScale t) {
  return BlockScaleOfCode(E4M3Encode(block_amax * t.s_enc_over_6), t);
}

// Four Over Six's other candidate: the scale that maps it to 4 (1.5 times the scale to 6, before the E4M3 rounding).
XLA_FP4_HOST_DEVICE inline BlockScale MakeBlockScaleToFour(float block_amax, TensorScale t) {
  return BlockScaleOfCode(E4M3Encode(block_amax * t.s_enc_over_6 * 1.5f), t);
}

// E2M1 value of x in its block; `u` is used only when `stochastic`.
XLA_FP4_HOST_DEVICE inline float QuantizeElement(float x, BlockScale b, bool stochastic, float u) {
  const float v = x * b.inv_denom;
  const float q = stochastic ? RoundE2M1Stochastic(v, u) : RoundE2M1Nearest(v);
  return Select(b.zero, 0.0f, q);
}

// (q * scale) * s_dec: the first product is exact, so there is one rounding.
XLA_FP4_HOST_DEVICE inline float DecodeElement(float q, float scale, float s_dec) {
  return FlushSubnormal((q * scale) * s_dec);
}

// Four Over Six's measure of a candidate scale: the squared error of x's element decoded with it.
XLA_FP4_HOST_DEVICE inline float SquaredError(float x, BlockScale b, float s_dec, bool stochastic, float u) {
  const float e = x - DecodeElement(QuantizeElement(x, b, stochastic, u), b.scale, s_dec);
  return e * e;
}

// The sum of 16 values by halves, (v0 + v8) + (v4 + v12) ..., as numerics/nvfp4.py _tree_sum adds them.
XLA_FP4_HOST_DEVICE inline float TreeSum16(const float* v) {
  float a[kBlock];
  for (int l = 0; l < kBlock; ++l) a[l] = v[l];
  for (int width = kBlock / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) a[l] += a[l + width];
  }
  return a[0];
}

// ---- the OCP MX formats (numerics/mx.py): E2M1 or E4M3 elements, an E8M0 (power of two) scale per 32 ----

inline constexpr int kMxBlock = 32;

// s, the smallest integer with amax <= elem_max * 2^s (elem_max 6 = 1.5 * 2^2 for E2M1, 448 = 1.75 * 2^8 for E4M3),
// clamped to [-127, 127], from amax's bits: its exponent, plus one where its mantissa exceeds elem_max's. A zero or
// subnormal amax gives -127 (subnormals count as zero, as under XLA CPU's DAZ).
XLA_FP4_HOST_DEVICE inline int MxScaleExponent(float amax, bool fp8) {
  const uint32_t bits = BitsOf(amax) & 0x7FFFFFFFu;
  const int exponent = static_cast<int>(bits >> 23);
  if (exponent == 0) return -127;
  const int s = exponent - 127 - (fp8 ? 8 : 2) + ((bits & 0x7FFFFFu) > (fp8 ? 0x600000u : 0x400000u) ? 1 : 0);
  return s < -127 ? -127 : (s > 127 ? 127 : s);
}

// 2^s for s in [-127, 127] (2^-127 is subnormal).
XLA_FP4_HOST_DEVICE inline float Pow2(int s) {
  return s >= -126 ? FloatOf(static_cast<uint32_t>(s + 127) << 23) : FloatOf(0x00400000u);
}

// An MX block's decode scale 2^s, zero for E8M0's one subnormal 2^-127 (the subnormal rule above): such a block (amax
// below 1.5 * 2^-125 in MXFP4, 1.75 * 2^-119 in MXFP8) decodes to zeros.
XLA_FP4_HOST_DEVICE inline float MxDecodeScale(int s) { return s >= -126 ? Pow2(s) : 0.0f; }

// An MX block's factors from its (tile's) amax: x * inverse onto the element grid, q * scale back. `bad` (a NaN or
// Inf in the block): the scale is NaN and the block decodes to NaN.
struct MxScale {
  float inverse, scale;
};

XLA_FP4_HOST_DEVICE inline MxScale MakeMxScale(float amax, bool bad, bool fp8) {
  const int s = MxScaleExponent(bad ? 0.0f : amax, fp8);
  return {Pow2(-s), bad ? FloatOf(0x7FC00000u) : MxDecodeScale(s)};
}

// q * scale, a subnormal as zero; a NaN scale's own bits where the block is NaN (a GPU's product would be its
// canonical NaN, another bit pattern).
XLA_FP4_HOST_DEVICE inline float MxDecodeElement(float q, float scale) {
  return Select(IsNan(scale), scale, FlushSubnormal(q * scale));
}

// One MX block's 32 loaded values, the RHT applied in place (two groups of 16) where the recipe asks: their largest
// magnitude in *amax, and whether any is NaN or Inf (the block then decodes to NaN). The CPU and CUDA kernels share it.
XLA_FP4_HOST_DEVICE inline bool MxPrepareBlock(float* v, const Recipe& r, float* amax) {
  if (r.rht) {
    Rht16(v, r.signs.sign_quarter);
    Rht16(v + kBlock, r.signs.sign_quarter);
  }
  // The largest magnitude as bits (sign cleared; for non-negative floats the integer order is the float order, with
  // Inf and NaN above every finite value): an integer max, which vectorizes where a float max with NaN tests did not.
  uint32_t m = 0;
  for (int j = 0; j < kMxBlock; ++j) {
    const uint32_t a = BitsOf(v[j]) & 0x7FFFFFFFu;
    m = a > m ? a : m;
  }
  *amax = FloatOf(m);
  return m >= 0x7F800000u;  // NaN or Inf
}

// v (|v| <= 448, or NaN) rounded to E4M3's grid, nearest-even: E4M3Decode(E4M3Encode(v)) without the codes. The grid
// spacing is 2^(e - 3) for v in [2^e, 2^(e+1)), 2^-9 below 2^-6 (the subnormals), so v + 2^(e + 20) lands where
// floats are that far apart, as RoundToGrid does for E2M1; -0 and what rounds to zero keep v's sign.
XLA_FP4_HOST_DEVICE inline float RoundE4M3InRange(float v) {
  const float a = Abs(v);
  uint32_t e = BitsOf(a) & 0x7F800000u;
  e = e < (121u << 23) ? (121u << 23) : e;  // 2^-6: the subnormals' spacing
  e = e > (135u << 23) ? (135u << 23) : e;  // 2^8 (NaN: any magic keeps it NaN)
  const float magic = FloatOf(e + (20u << 23));
  return CopySign((a + magic) - magic, v);
}

// An MX element: v = x / 2^s rounded to E4M3 (nearest-even) or E2M1 (nearest-even, or stochastic with `u`). The
// block's scale keeps |v| <= 448 (MxScaleExponent).
XLA_FP4_HOST_DEVICE inline float MxRoundElement(float v, bool fp8, bool stochastic, float u) {
  if (fp8) return RoundE4M3InRange(v);
  return stochastic ? RoundE2M1Stochastic(v, u) : RoundE2M1Nearest(v);
}

// ---- packed storage (numerics/packing.py): codes K-major, one scale byte per row and block ----

// A packed format's geometry: elements per code byte (two E2M1 codes, or one E4M3) and elements per scale.
struct PackedLayout {
  int64_t per_byte, block;
};
inline constexpr PackedLayout kNvfp4Packed{2, kBlock};
XLA_FP4_HOST_DEVICE inline PackedLayout MxPacked(bool fp8) { return {fp8 ? 1 : 2, kMxBlock}; }

// An MX block's E8M0 scale byte (OCP MX v1.0): 2^s stored as s + 127, 0xFF (NaN) for a block with a NaN or an Inf.
XLA_FP4_HOST_DEVICE inline uint8_t MxScaleByte(float amax, bool bad, bool fp8) {
  return bad ? uint8_t{0xFF} : static_cast<uint8_t>(MxScaleExponent(amax, fp8) + 127);
}

// An MX block's 32 elements q (on the element grid) stored as packed codes where they sit in x with the axis divided
// by 1 (E4M3) or 2 (E2M1 pairs along K, the even code in the low nibble): `base` is the block's first element in x,
// its elements `inner` apart, `i` its position along inner. The CPU and CUDA packers share it.
XLA_FP4_HOST_DEVICE inline void StoreMxCodes(uint8_t* data, int64_t base, int64_t i, int64_t inner, const float* q,
                                             bool fp8) {
  if (fp8) {
    for (int j = 0; j < kMxBlock; ++j) data[base + j * inner] = E4M3Encode(q[j]);
    return;
  }
  uint8_t* out = data + (base - i) / 2 + i;  // the block's first pair; pairs are `inner` bytes apart
  uint8_t c[kMxBlock];  // the codes first, then the pairs: two loops that vectorize
  for (int j = 0; j < kMxBlock; ++j) c[j] = E2M1Code(q[j]);
  if (inner == 1) {
    PackPairs(c, out);
    return;
  }
  for (int j = 0; j < kMxBlock; j += 2) out[j / 2 * inner] = static_cast<uint8_t>(c[j] | (c[j + 1] << 4));
}

// Element j of a packed MX block whose codes start at `codes` (K-major): E4M3, or one of a byte's two E2M1 codes.
XLA_FP4_HOST_DEVICE inline float MxPackedElement(const uint8_t* codes, int j, bool fp8) {
  if (fp8) return E4M3Decode(codes[j]);
  return E2M1Decode(j % 2 == 0 ? codes[j / 2] & 15 : codes[j / 2] >> 4);
}

// The decode scale of an E8M0 byte, as MakeMxScale gives it: NaN for 0xFF, zero for 2^-127 (the subnormal rule).
XLA_FP4_HOST_DEVICE inline float MxScaleOfByte(uint8_t byte) {
  return byte == 0xFF ? FloatOf(0x7FC00000u) : MxDecodeScale(static_cast<int>(byte) - 127);
}

// The swizzled scale storage (numerics.padded_scale_shape): K/block blocks rounded up to 4 columns, rows rounded up
// to 128; the padding is zero. The layout is the same for the MX formats' blocks of 32 (cuBLASLt's VEC32_UE8M0).
XLA_FP4_HOST_DEVICE inline int64_t PaddedScaleCols(int64_t k, int64_t block = kBlock) {
  return (k / block + kScaleTileCols - 1) / kScaleTileCols * kScaleTileCols;
}
XLA_FP4_HOST_DEVICE inline int64_t PaddedScaleCount(int64_t rows, int64_t k, int64_t block = kBlock) {
  return (rows + kScaleTileRows - 1) / kScaleTileRows * kScaleTileRows * PaddedScaleCols(k, block);
}

// Index of the scale of (row, block) in cuBLASLt's swizzled layout (numerics/packing.py); `padded_cols` is K/16
// rounded up to 4.
XLA_FP4_HOST_DEVICE inline int64_t SwizzledScaleIndex(int64_t row, int64_t block, int64_t padded_cols) {
  return ((row / kScaleTileRows) * (padded_cols / kScaleTileCols) + block / kScaleTileCols) * 512 + (row % 32) * 16 +
         ((row % kScaleTileRows) / 32) * 4 + block % kScaleTileCols;
}

}  // namespace xla_fp4

#endif  // XLA_FP4_NVFP4_FORMAT_H_
