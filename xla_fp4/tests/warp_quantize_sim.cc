// A host simulation of one CUDA warp running warp_quantize.h's QuantizeWarpRuns: 32 threads, one per lane, whose xor
// shuffles meet at a barrier. tests/kernels/test_warp_quantize.py builds it and compares what it writes with the CPU
// kernels (xla_fp4_qdq, xla_fp4_quantize_packed) bit for bit, so the CUDA kernels' lane layout, exchanges and sums
// are tested on machines without a GPU.
//
//   warp_quantize_sim IN OUT rows k element_bytes block_2d stochastic rht rht_seed four_over_six s_dec key mode
//
// IN: rows * k float32 (x, already widened from its dtype); mode `qdq`: OUT gets rows * k float32, decode(q) with the
// global scale; mode `packed`: OUT gets the codes (rows, k / 2) then the E4M3 scales (rows, k / 16).
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <thread>
#include <vector>

#include "xla_fp4/nvfp4_format.h"
#include "xla_fp4/warp_quantize.h"

namespace {

using namespace xla_fp4;

struct HostLanes {
  int lane;
  uint32_t* slots;  // kWarp words, shared by the warp's threads
  std::barrier<>* sync;

  int Lane() const { return lane; }
  uint32_t XorBits(uint32_t v, int mask) const {
    slots[lane] = v;
    sync->arrive_and_wait();
    const uint32_t other = slots[lane ^ mask];
    sync->arrive_and_wait();
    return other;
  }
  float Xor(float v, int mask) const { return FloatOf(XorBits(BitsOf(v), mask)); }
};

template <int kElementBytes>
void Simulate(const std::vector<float>& x, const RunGrid& g, const Recipe& r, float s_dec, uint32_t key, bool packed,
              std::vector<float>& y, std::vector<uint8_t>& data, std::vector<uint8_t>& scales) {
  constexpr int E = RunLayout<kElementBytes>::E;
  const TensorScale ts = MakeTensorScale(s_dec);
  const uint32_t mixed_key = r.stochastic ? Mix32(key) : 0u;
  uint32_t slots[kWarp];
  std::barrier<> sync(kWarp);
  std::vector<std::thread> threads;
  for (int lane = 0; lane < kWarp; ++lane) {
    threads.emplace_back([&, lane] {
      const HostLanes lanes{lane, slots, &sync};
      auto load = [&](int64_t at, float* v) {
        for (int e = 0; e < E; ++e) v[e] = FlushSubnormal(x[at + e]);  // the kernels' ToFloat
      };
      auto sink = [&](int, int64_t first, int part, bool active, const BlockScale& bs, const TensorScale& t,
                      const float* q) {
        if (!active) return;
        const int64_t at = first + part * E;
        if (!packed) {
          for (int e = 0; e < E; ++e) y[at + e] = DecodeElement(q[e], bs.scale, t.s_dec);
          return;
        }
        for (int e = 0; e < E; e += 2) {
          data[(at + e) / 2] = static_cast<uint8_t>(E2M1Code(q[e]) | (E2M1Code(q[e + 1]) << 4));
        }
        if (part == 0) scales[first / kBlock] = bs.code;
      };
      for (int64_t w = 0; w < g.Warps(); ++w) {
        QuantizeWarpRuns<kElementBytes>(g, r, ts, mixed_key, w, lanes, load, sink);
      }
    });
  }
  for (std::thread& t : threads) t.join();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 14) {
    std::fprintf(stderr, "usage: %s IN OUT rows k element_bytes block_2d stochastic rht rht_seed four_over_six s_dec "
                         "key qdq|packed\n", argv[0]);
    return 2;
  }
  const int64_t rows = std::atoll(argv[3]), k = std::atoll(argv[4]);
  const int element_bytes = std::atoi(argv[5]);
  const bool block_2d = std::atoi(argv[6]), stochastic = std::atoi(argv[7]), rht = std::atoi(argv[8]);
  const uint32_t rht_seed = static_cast<uint32_t>(std::atoll(argv[9]));
  const bool four_over_six = std::atoi(argv[10]);
  const float s_dec = std::strtof(argv[11], nullptr);
  const uint32_t key = static_cast<uint32_t>(std::strtoul(argv[12], nullptr, 10));
  const bool packed = std::string_view(argv[13]) == "packed";
  if (k % kBlock != 0 || (element_bytes != 2 && element_bytes != 4)) {
    std::fprintf(stderr, "k must be a multiple of 16 and element_bytes 2 or 4\n");
    return 2;
  }
  std::vector<float> x(rows * k), y(rows * k, -1.0f);
  std::vector<uint8_t> data(rows * k / 2, 0xAA), scales(rows * k / kBlock, 0xAA);
  FILE* in = std::fopen(argv[1], "rb");
  if (in == nullptr || std::fread(x.data(), sizeof(float), x.size(), in) != x.size()) return 3;
  std::fclose(in);
  const Recipe r(block_2d, stochastic, rht, rht_seed, four_over_six);
  const RunGrid g{rows, k, block_2d};
  if (element_bytes == 4) {
    Simulate<4>(x, g, r, s_dec, key, packed, y, data, scales);
  } else {
    Simulate<2>(x, g, r, s_dec, key, packed, y, data, scales);
  }
  FILE* out = std::fopen(argv[2], "wb");
  if (out == nullptr) return 3;
  if (packed) {
    std::fwrite(data.data(), 1, data.size(), out);
    std::fwrite(scales.data(), 1, scales.size(), out);
  } else {
    std::fwrite(y.data(), sizeof(float), y.size(), out);
  }
  std::fclose(out);
  return 0;
}
