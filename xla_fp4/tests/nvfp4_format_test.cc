// Unit tests of nvfp4_format.h: E2M1 and E4M3 encode/decode (known values, ties, saturation, NaN), block scales,
// random bits, the RHT, and the swizzled scale layout.
#include <cmath>
#include <cstdint>
#include <limits>

#include "xla_fp4/nvfp4_format.h"
#include "xla_fp4/tests/check.h"

namespace xla_fp4 {
namespace {

const float kNan = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

void TestE2M1Nearest() {
  // On the grid: unchanged.
  for (float v : {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.5f, -6.0f}) CHECK_BITS_EQ(RoundE2M1Nearest(v), v);
  // Ties to even (in grid index): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
  CHECK_BITS_EQ(RoundE2M1Nearest(0.25f), 0.0f);
  CHECK_BITS_EQ(RoundE2M1Nearest(0.75f), 1.0f);
  CHECK_BITS_EQ(RoundE2M1Nearest(1.25f), 1.0f);
  CHECK_BITS_EQ(RoundE2M1Nearest(1.75f), 2.0f);
  CHECK_BITS_EQ(RoundE2M1Nearest(2.5f), 2.0f);
  CHECK_BITS_EQ(RoundE2M1Nearest(3.5f), 4.0f);
  CHECK_BITS_EQ(RoundE2M1Nearest(5.0f), 4.0f);
  CHECK_BITS_EQ(RoundE2M1Nearest(-5.0f), -4.0f);
  // Off ties.
  CHECK_BITS_EQ(RoundE2M1Nearest(0.26f), 0.5f);
  CHECK_BITS_EQ(RoundE2M1Nearest(-2.6f), -3.0f);
  CHECK_BITS_EQ(RoundE2M1Nearest(5.01f), 6.0f);
  // Saturation, signed zero, NaN.
  CHECK_BITS_EQ(RoundE2M1Nearest(7.0f), 6.0f);
  CHECK_BITS_EQ(RoundE2M1Nearest(1e30f), 6.0f);
  CHECK_BITS_EQ(RoundE2M1Nearest(kInf), 6.0f);
  CHECK_BITS_EQ(RoundE2M1Nearest(-kInf), -6.0f);
  CHECK_BITS_EQ(RoundE2M1Nearest(-0.0f), -0.0f);
  CHECK_BITS_EQ(RoundE2M1Nearest(-0.1f), -0.0f);
  CHECK(std::isnan(RoundE2M1Nearest(kNan)));
}

void TestE2M1Stochastic() {
  // 0.25 lies halfway between 0 and 0.5: up when u < 0.5.
  CHECK_BITS_EQ(RoundE2M1Stochastic(0.25f, 0.0f), 0.5f);
  CHECK_BITS_EQ(RoundE2M1Stochastic(0.25f, 0.49f), 0.5f);
  CHECK_BITS_EQ(RoundE2M1Stochastic(0.25f, 0.5f), 0.0f);
  // 4.5 = 4 + 0.25 * 2: up with probability 1/4.
  CHECK_BITS_EQ(RoundE2M1Stochastic(4.5f, 0.2f), 6.0f);
  CHECK_BITS_EQ(RoundE2M1Stochastic(-4.5f, 0.3f), -4.0f);
  // Grid values never move; saturation and NaN as for nearest.
  for (float u : {0.0f, 0.5f, 0.999f}) {
    CHECK_BITS_EQ(RoundE2M1Stochastic(3.0f, u), 3.0f);
    CHECK_BITS_EQ(RoundE2M1Stochastic(100.0f, u), 6.0f);
    CHECK(std::isnan(RoundE2M1Stochastic(kNan, u)));
  }
}

void TestE2M1Codes() {
  const float values[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int code = 0; code < 16; ++code) {
    const float v = E2M1Decode(static_cast<uint8_t>(code));
    CHECK_BITS_EQ(v, (code & 8) ? -values[code & 7] : values[code & 7]);
    CHECK_EQ(static_cast<int>(E2M1Code(v)), code);  // including -0 -> 8
  }
  CHECK_EQ(static_cast<int>(E2M1Code(kNan)), 0);
}

void TestE4M3() {
  // Known codes.
  CHECK_EQ(static_cast<int>(E4M3Encode(1.0f)), 0x38);
  CHECK_EQ(static_cast<int>(E4M3Encode(448.0f)), 0x7E);
  CHECK_EQ(static_cast<int>(E4M3Encode(-448.0f)), 0xFE);
  CHECK_EQ(static_cast<int>(E4M3Encode(0x1p-6f)), 0x08);  // smallest normal
  CHECK_EQ(static_cast<int>(E4M3Encode(0x1p-9f)), 0x01);  // smallest subnormal
  CHECK_EQ(static_cast<int>(E4M3Encode(0.0f)), 0x00);
  CHECK_EQ(static_cast<int>(E4M3Encode(-0.0f)), 0x80);
  // Ties to even: 1.0625 between 1 (0x38) and 1.125 (0x39); 1.1875 between 0x39 and 1.25 (0x3A); subnormals.
  CHECK_EQ(static_cast<int>(E4M3Encode(1.0625f)), 0x38);
  CHECK_EQ(static_cast<int>(E4M3Encode(1.1875f)), 0x3A);
  CHECK_EQ(static_cast<int>(E4M3Encode(1.5f * 0x1p-9f)), 0x02);
  CHECK_EQ(static_cast<int>(E4M3Encode(2.5f * 0x1p-9f)), 0x02);
  CHECK_EQ(static_cast<int>(E4M3Encode(0.4f * 0x1p-9f)), 0x00);
  // Saturation: positive values clamp to 448; negative ones that round past -448 are NaN (as ml_dtypes).
  CHECK_EQ(static_cast<int>(E4M3Encode(1000.0f)), 0x7E);
  CHECK_EQ(static_cast<int>(E4M3Encode(kInf)), 0x7E);
  CHECK_EQ(static_cast<int>(E4M3Encode(-464.0f)), 0xFE);  // tie, to even (448)
  CHECK_EQ(static_cast<int>(E4M3Encode(-465.0f)), 0xFF);
  // NaN.
  CHECK_EQ(static_cast<int>(E4M3Encode(kNan)), 0x7F);
  CHECK(std::isnan(E4M3Decode(0x7F)));
  CHECK(std::isnan(E4M3Decode(0xFF)));
  // Decode known values, and every finite code round-trips.
  CHECK_BITS_EQ(E4M3Decode(0x38), 1.0f);
  CHECK_BITS_EQ(E4M3Decode(0x7E), 448.0f);
  CHECK_BITS_EQ(E4M3Decode(0x01), 0x1p-9f);
  CHECK_BITS_EQ(E4M3Decode(0x80), -0.0f);
  CHECK_BITS_EQ(E4M3Decode(0x3A), 1.25f);
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7F) == 0x7F) continue;
    CHECK_EQ(static_cast<int>(E4M3Encode(E4M3Decode(static_cast<uint8_t>(code)))), code);
  }
}

void TestBlockScale() {
  // amax 6 with s_dec 1: the E4M3 scale is 1 (6 * fl(1/6) rounds to 1 in float32), inv_denom 1.
  const TensorScale unit = MakeTensorScale(1.0f);
  CHECK_BITS_EQ(unit.s_enc_over_6, kInvE2M1Max);
  BlockScale b = MakeBlockScale(6.0f, unit);
  CHECK_EQ(static_cast<int>(b.code), 0x38);
  CHECK_BITS_EQ(b.scale, 1.0f);
  CHECK_BITS_EQ(b.inv_denom, 1.0f);
  CHECK(!b.zero);
  // amax 0.3: scale E4M3(0.05) = 13 * 2**-8 = 0.05078125.
  b = MakeBlockScale(0.3f, unit);
  CHECK_BITS_EQ(b.scale, 0.05078125f);
  CHECK_BITS_EQ(QuantizeElement(0.3f, b, false, 0.0f), 6.0f);
  // The global scale: amax 2688 * s with s_dec = s maps the block amax onto 448 * 6.
  const TensorScale t = MakeTensorScale(2.0f);
  b = MakeBlockScale(5376.0f, t);
  CHECK_EQ(static_cast<int>(b.code), 0x7E);
  CHECK_BITS_EQ(DecodeElement(QuantizeElement(5376.0f, b, false, 0.0f), b.scale, t.s_dec), 5376.0f);
  // A zero block, and a zero tensor scale, encode zeros.
  CHECK(MakeBlockScale(0.0f, unit).zero);
  CHECK_BITS_EQ(QuantizeElement(1.0f, MakeBlockScale(0.0f, unit), false, 0.0f), 0.0f);
  CHECK(MakeBlockScale(5.0f, MakeTensorScale(0.0f)).zero);
  // NaN amax: NaN scale code.
  CHECK_EQ(static_cast<int>(MakeBlockScale(kNan, unit).code), 0x7F);
}

void TestRandomBitsAndRht() {
  CHECK_EQ(Mix32(0u), 0u);  // lowbias32 fixes zero
  CHECK(Mix32(1u) != 1u);
  CHECK_BITS_EQ(UniformFromBits(0u), 0.0f);
  CHECK_BITS_EQ(UniformFromBits(0xFFFFFFFFu), 1.0f - 0x1p-24f);
  for (uint32_t seed : {0u, 1u, 12345u}) {
    float signs[kBlock], sign_quarter[kBlock], v[kBlock] = {4.0f};
    for (int j = 0; j < kBlock; ++j) {
      signs[j] = RhtSign(seed, j);
      CHECK(signs[j] == 1.0f || signs[j] == -1.0f);
      sign_quarter[j] = signs[j] * 0.25f;
    }
    Rht16(v, sign_quarter);  // H16 (4 e0) = 4 (1, ..., 1), times s / 4
    for (int j = 0; j < kBlock; ++j) CHECK_BITS_EQ(v[j], signs[j]);
    // The transform is orthogonal: ||v||^2 = ||4 e0||^2 = 16.
    float energy = 0.0f;
    for (int j = 0; j < kBlock; ++j) energy += v[j] * v[j];
    CHECK_BITS_EQ(energy, 16.0f);
  }
}

void TestScaleLayout() {
  CHECK_EQ(PaddedScaleCols(16), int64_t{4});
  CHECK_EQ(PaddedScaleCols(80), int64_t{8});
  CHECK_EQ(PaddedScaleCount(1, 16), int64_t{512});
  CHECK_EQ(PaddedScaleCount(129, 64), int64_t{1024});
  CHECK_EQ(SwizzledScaleIndex(0, 0, 4), int64_t{0});
  CHECK_EQ(SwizzledScaleIndex(0, 3, 4), int64_t{3});
  CHECK_EQ(SwizzledScaleIndex(1, 0, 4), int64_t{16});
  CHECK_EQ(SwizzledScaleIndex(32, 0, 4), int64_t{4});
  CHECK_EQ(SwizzledScaleIndex(128, 0, 4), int64_t{512});
  CHECK_EQ(SwizzledScaleIndex(0, 4, 8), int64_t{512});
}

}  // namespace
}  // namespace xla_fp4

int main() {
  xla_fp4::TestE2M1Nearest();
  xla_fp4::TestE2M1Stochastic();
  xla_fp4::TestE2M1Codes();
  xla_fp4::TestE4M3();
  xla_fp4::TestBlockScale();
  xla_fp4::TestRandomBitsAndRht();
  xla_fp4::TestScaleLayout();
  return TEST_MAIN_RESULT();
}
