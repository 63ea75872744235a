// Unit tests of the CPU FFI handlers, called through the XLA FFI C API (fake_ffi.h) exactly as XLA calls them:
// one qdq case per variant (1x16 nearest, 16x16, stochastic, RHT), the RHT kernel, the threaded path against the
// serial one, packed quantize/dequantize, and an error case.
#include <cmath>
#include <cstdint>
#include <vector>

#include "xla_fp4/cpu_kernels.h"
#include "xla_fp4/nvfp4_format.h"
#include "xla_fp4/tests/check.h"
#include "xla_fp4/tests/fake_ffi.h"

namespace xla_fp4 {
namespace {

using testing::CallFrameBuilder;
using testing::CallResult;

struct QdqOptions {
  int64_t axis = -1;
  bool block_2d = false, stochastic = false, rht = false, apply_global_scale = true;
  int64_t rht_seed = 0;
  uint32_t key = 0;
  int64_t num_threads = 1;
};

CallResult Qdq(const std::vector<float>& x, std::vector<int64_t> dims, float s_dec, const QdqOptions& o,
               std::vector<float>& y) {
  y.assign(x.size(), -1.0f);
  return CallFrameBuilder()
      .Arg(XLA_FFI_DataType_F32, x.data(), dims)
      .Arg(XLA_FFI_DataType_F32, &s_dec, {})
      .Arg(XLA_FFI_DataType_U32, &o.key, {})
      .Ret(XLA_FFI_DataType_F32, y.data(), dims)
      .Attr("axis", o.axis)
      .Attr("block_2d", o.block_2d)
      .Attr("stochastic", o.stochastic)
      .Attr("rht", o.rht)
      .Attr("rht_seed", o.rht_seed)
      .Attr("apply_global_scale", o.apply_global_scale)
      .Attr("four_over_six", false)
      .Call(XlaFp4QdqCpu, o.num_threads);
}

// Row 0 has amax 6 and holds grid points and ties; row 1 has amax 0.3 (a distinct block scale in 1x16 mode).
std::vector<float> TwoRows() {
  std::vector<float> x = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f,
                          -0.25f, -1.3f, 0.0f, -0.0f, 4.4f, -6.0f, 0.1f, 2.9f};
  for (int j = 0; j < 16; ++j) x.push_back(j % 2 ? 0.3f : -0.15f);
  return x;
}

void TestQdq1x16Nearest() {
  std::vector<float> x = TwoRows(), y;
  CallResult r = Qdq(x, {2, 16}, 1.0f, {}, y);
  CHECK(r.ok);
  // Row 0: scale 1, so y is x rounded to the E2M1 grid (ties to even).
  const float want0[16] = {0.0f, 1.0f, 1.0f, 2.0f, 2.0f, 4.0f, 4.0f, 6.0f,
                           -0.0f, -1.5f, 0.0f, -0.0f, 4.0f, -6.0f, 0.0f, 3.0f};
  for (int j = 0; j < 16; ++j) CHECK_BITS_EQ(y[j], want0[j]);
  // Row 1: scale 0.05078125; 0.3 -> 6 * scale, -0.15 -> -2.954 -> -3 * scale.
  for (int j = 0; j < 16; ++j) CHECK_BITS_EQ(y[16 + j], j % 2 ? 6.0f * 0.05078125f : -3.0f * 0.05078125f);
  // The global scale multiplies the result (x scaled by 4 with s_dec 4 gives 4 y).
  std::vector<float> x4 = x, y4;
  for (float& v : x4) v *= 4.0f;
  CHECK(Qdq(x4, {2, 16}, 4.0f, {}, y4).ok);
  for (size_t i = 0; i < x.size(); ++i) CHECK_BITS_EQ(y4[i], 4.0f * y[i]);
  // Without the global scale: q * scale.
  QdqOptions no_global;
  no_global.apply_global_scale = false;
  CHECK(Qdq(x4, {2, 16}, 4.0f, no_global, y4).ok);
  for (size_t i = 0; i < x.size(); ++i) CHECK_BITS_EQ(y4[i], y[i]);
  // Quantizing along axis 0 of the transpose gives the transpose.
  std::vector<float> xt(32), yt;
  for (int r0 = 0; r0 < 2; ++r0)
    for (int j = 0; j < 16; ++j) xt[j * 2 + r0] = x[r0 * 16 + j];
  QdqOptions axis0;
  axis0.axis = 0;
  CHECK(Qdq(xt, {16, 2}, 1.0f, axis0, yt).ok);
  for (int r0 = 0; r0 < 2; ++r0)
    for (int j = 0; j < 16; ++j) CHECK_BITS_EQ(yt[j * 2 + r0], y[r0 * 16 + j]);
}

void TestQdq16x16() {
  // A 16x16 tile: row 0 as above (amax 6), the other rows as row 1. One shared scale (1) for the tile.
  std::vector<float> two = TwoRows(), x, y;
  x.insert(x.end(), two.begin(), two.begin() + 16);
  for (int r0 = 1; r0 < 16; ++r0) x.insert(x.end(), two.begin() + 16, two.end());
  QdqOptions o;
  o.block_2d = true;
  CHECK(Qdq(x, {16, 16}, 1.0f, o, y).ok);
  for (int j = 0; j < 16; ++j) CHECK_BITS_EQ(y[j], RoundE2M1Nearest(x[j]));
  // 0.3 -> 0.5 and -0.15 -> -0.0 on the unit-scale grid (in 1x16 mode they would keep their own scale).
  for (int r0 = 1; r0 < 16; ++r0)
    for (int j = 0; j < 16; ++j) CHECK_BITS_EQ(y[r0 * 16 + j], j % 2 ? 0.5f : -0.0f);
}

void TestQdqStochastic() {
  // Row 0 of TwoRows (scale 1): each element goes to one of its grid neighbours, as chosen by the counter-based bits
  // of its row-major index; the same key gives the same result, another key another one.
  std::vector<float> x = TwoRows(), y, y_again, y_other;
  x.resize(16);
  QdqOptions o;
  o.stochastic = true;
  o.key = 42;
  CHECK(Qdq(x, {1, 16}, 1.0f, o, y).ok);
  for (int j = 0; j < 16; ++j) {
    const float u = UniformFromBits(RandomBits(Mix32(42u), static_cast<uint32_t>(j)));
    CHECK_BITS_EQ(y[j], RoundE2M1Stochastic(x[j], u));
    const float a = std::fabs(x[j]), q = std::fabs(y[j]);
    CHECK(q == RoundE2M1Stochastic(a, 0.0f) || q == RoundE2M1Stochastic(a, 0.99999994f));
  }
  CHECK(Qdq(x, {1, 16}, 1.0f, o, y_again).ok);
  for (int j = 0; j < 16; ++j) CHECK_BITS_EQ(y_again[j], y[j]);
  // A tensor of ties: with 256 elements, two keys practically never agree everywhere.
  std::vector<float> ties(256, 0.25f);
  ties[0] = 6.0f;  // pins the scale of block 0 to 1; the other blocks have amax 0.25
  CHECK(Qdq(ties, {16, 16}, 1.0f, o, y).ok);
  o.key = 43;
  CHECK(Qdq(ties, {16, 16}, 1.0f, o, y_other).ok);
  bool differ = false;
  for (int i = 0; i < 256; ++i) differ |= !testing::SameBits(y[i], y_other[i]);
  CHECK(differ);
}

void TestQdqRht() {
  // x = 4 e0 in each block: RHT(x) = the sign vector s (+-1). Block amax 1 -> scale E4M3(1/6) = 0.171875, and
  // 1 / 0.171875 = 5.82 rounds to 6: y = s * 1.03125.
  for (uint32_t seed : {0u, 7u}) {
    std::vector<float> x(32, 0.0f), y;
    x[0] = x[16] = 4.0f;
    QdqOptions o;
    o.rht = true;
    o.rht_seed = seed;
    CHECK(Qdq(x, {2, 16}, 1.0f, o, y).ok);
    for (int i = 0; i < 32; ++i) CHECK_BITS_EQ(y[i], RhtSign(seed, i % 16) * 1.03125f);

    // The RHT kernel alone: y = s exactly.
    std::vector<float> t(32, -1.0f);
    CallResult r = CallFrameBuilder()
                       .Arg(XLA_FFI_DataType_F32, x.data(), {2, 16})
                       .Ret(XLA_FFI_DataType_F32, t.data(), {2, 16})
                       .Attr("axis", int64_t{1})
                       .Attr("rht_seed", int64_t{seed})
                       .Call(XlaFp4RhtCpu);
    CHECK(r.ok);
    for (int i = 0; i < 32; ++i) CHECK_BITS_EQ(t[i], RhtSign(seed, i % 16));
  }
}

void TestThreadedMatchesSerial() {
  // 512 x 256 floats: enough tiles for ParallelFor to split the work across the (fake) pool's threads.
  std::vector<float> x(512 * 256);
  uint32_t state = 1;
  for (float& v : x) {
    state = Mix32(state + 0x9E3779B9u);
    v = (UniformFromBits(state) - 0.5f) * 10.0f;
  }
  for (bool block_2d : {false, true}) {
    QdqOptions o;
    o.block_2d = block_2d;
    o.stochastic = true;
    o.key = 5;
    std::vector<float> serial, threaded;
    CHECK(Qdq(x, {512, 256}, 0.01f, o, serial).ok);
    o.num_threads = 4;
    CHECK(Qdq(x, {512, 256}, 0.01f, o, threaded).ok);
    bool same = true;
    for (size_t i = 0; i < x.size(); ++i) same &= testing::SameBits(serial[i], threaded[i]);
    CHECK(same);
  }
}

void TestPackedRoundTrip() {
  // quantize_packed then dequantize_packed equals qdq (1x16, nearest).
  const int64_t rows = 3, k = 32;
  std::vector<float> x(rows * k), want;
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(static_cast<int>(i * 37 % 23) - 11) * 0.37f;
  const float s_dec = 0.002f;
  CHECK(Qdq(x, {rows, k}, s_dec, {}, want).ok);
  std::vector<uint8_t> data(rows * k / 2), scales(rows * k / kBlock, 0xAB);
  const uint32_t key = 0;
  CallResult r = CallFrameBuilder()
                     .Arg(XLA_FFI_DataType_F32, x.data(), {rows, k})
                     .Arg(XLA_FFI_DataType_F32, &s_dec, {})
                     .Arg(XLA_FFI_DataType_U32, &key, {})
                     .Ret(XLA_FFI_DataType_U8, data.data(), {rows, k / 2})
                     .Ret(XLA_FFI_DataType_U8, scales.data(), {rows, k / kBlock})
                     .Attr("axis", int64_t{1})
                     .Attr("block_2d", false)
                     .Attr("stochastic", false)
                     .Attr("rht", false)
                     .Attr("rht_seed", int64_t{0})
                     .Attr("four_over_six", false)
                     .Call(XlaFp4QuantizePackedCpu);
  if (!r.ok) {
    // The packed kernels' attribute set is theirs to define; report it rather than guess.
    std::fprintf(stderr, "quantize_packed: %s\n", r.message.c_str());
  }
  CHECK(r.ok);
  if (!r.ok) return;
  std::vector<float> back(rows * k, -1.0f);
  r = CallFrameBuilder()
          .Arg(XLA_FFI_DataType_U8, data.data(), {rows, k / 2})
          .Arg(XLA_FFI_DataType_U8, scales.data(), {rows, k / kBlock})
          .Arg(XLA_FFI_DataType_F32, &s_dec, {})
          .Ret(XLA_FFI_DataType_F32, back.data(), {rows, k})
          .Call(XlaFp4DequantizePackedCpu);
  if (!r.ok) std::fprintf(stderr, "dequantize_packed: %s\n", r.message.c_str());
  CHECK(r.ok);
  for (size_t i = 0; r.ok && i < back.size(); ++i) CHECK_BITS_EQ(back[i], want[i]);
}

void TestErrors() {
  std::vector<float> x(24, 1.0f), y;
  CallResult r = Qdq(x, {2, 12}, 1.0f, {}, y);
  CHECK(!r.ok);
  CHECK_EQ(static_cast<int>(r.code), static_cast<int>(XLA_FFI_Error_Code_INVALID_ARGUMENT));
  CHECK(r.message.find("multiple of 16") != std::string::npos);
  QdqOptions bad_seed;
  bad_seed.rht_seed = -1;
  CHECK(!Qdq(std::vector<float>(16, 1.0f), {1, 16}, 1.0f, bad_seed, y).ok);
}

}  // namespace
}  // namespace xla_fp4

int main() {
  xla_fp4::TestQdq1x16Nearest();
  xla_fp4::TestQdq16x16();
  xla_fp4::TestQdqStochastic();
  xla_fp4::TestQdqRht();
  xla_fp4::TestThreadedMatchesSerial();
  xla_fp4::TestPackedRoundTrip();
  xla_fp4::TestErrors();
  return TEST_MAIN_RESULT();
}
