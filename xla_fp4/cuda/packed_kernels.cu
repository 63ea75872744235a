// xla_fp4_quantize_packed (and its telemetry form, xla_fp4_quantize_packed_stats), xla_fp4_quantize_packed_pair and
// xla_fp4_dequantize_packed on CUDA: the storage numerics/packing.py defines (two E2M1 codes per byte, even element in
// the low nibble; E4M3 scales (rows, K/16) row-major), and SwizzleScales, which lays such scales out as cuBLASLt's FP4
// GEMM reads them (128x4 tiles, padding zero).
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_fp4/cuda/block_kernel.cuh"
#include "xla_fp4/cuda/cuda_handlers.h"
#include "xla_fp4/cuda/cuda_util.h"
#include "xla_fp4/cuda/stats_sink.cuh"
#include "xla_fp4/nvfp4_format.h"
#include "xla_fp4/ffi_targets.h"

namespace xla_fp4::cuda {
namespace {

// Packs one block of 16 along K into data and scales of x's dims with K divided by 2 and by 16: (rows, K/2), where
// 16 codes fill 8 aligned bytes (inner == 1), or (K/2, rows) (outer == 1), where they fill 8 bytes a row apart.
struct PackSink {
  uint8_t* data;
  uint8_t* scales;
  __device__ bool Skip() const { return false; }
  __device__ void operator()(const BlockGrid& g, const BlockIndex& b, const BlockScale& bs, const TensorScale&,
                             const float* q, float /*amax*/) const {
    if (g.inner == 1) {
      uint64_t packed = 0;
      for (int j = 0; j < kBlock; ++j) packed |= static_cast<uint64_t>(E2M1Code(q[j])) << (4 * j);
      reinterpret_cast<uint64_t*>(data)[(b.o * g.k + b.kb * kBlock) / kBlock] = packed;  // little-endian: even = low
    } else {
      for (int j = 0; j < kBlock / 2; ++j) {
        data[((b.o * g.k + b.kb * kBlock) / 2 + j) * g.inner + b.i] =
            static_cast<uint8_t>(E2M1Code(q[2 * j]) | (E2M1Code(q[2 * j + 1]) << 4));
      }
    }
    scales[(b.o * (g.k / kBlock) + b.kb) * g.inner + b.i] = bs.code;
  }
};

// xla_fp4_quantize_packed_stats: the packed block, and in a recorded step its statistics.
template <typename T>
struct PackStatsSink {
  PackSink pack;
  StatsSink<T> stats;
  __device__ bool Skip() const { return false; }
  __device__ void operator()(const BlockGrid& g, const BlockIndex& b, const BlockScale& bs, const TensorScale& ts,
                             const float* q, float amax) const {
    pack(g, b, bs, ts, q, amax);
    if (!stats.Skip()) stats.Measure(g, b, bs, ts, q, amax);
  }
};

template <typename T>
__global__ void DequantizePackedKernel(const uint8_t* data, const uint8_t* scales, const float* s_dec, BlockGrid g,
                                       T* y) {
  const BlockIndex b = g.Locate(ThreadIndex());
  if (!b.active) return;
  const uint64_t packed = reinterpret_cast<const uint64_t*>(data)[(b.o * g.k + b.kb * kBlock) / kBlock];
  const float scale = E4M3Decode(scales[b.o * (g.k / kBlock) + b.kb]);
  float v[kBlock];
  for (int j = 0; j < kBlock; ++j) v[j] = DecodeElement(E2M1Decode((packed >> (4 * j)) & 15u), scale, *s_dec);
  StoreBlock(y, g, b, v);
}

// x (rows, K) with axis 1 or (K, rows) with axis 0; data and scales x's dims, K / 2 and K / 16; K a multiple of 16.
ffi::Error QuantizePacked(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer s_dec, ffi::AnyBuffer key,
                          ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> scales, int64_t axis,
                          bool block_2d, bool stochastic, bool rht, int64_t rht_seed, bool four_over_six) {
  AxisShape shape;
  XLA_FP4_RETURN_IF_ERROR(CheckQuantizePacked(x, &s_dec, key, *data, *scales, axis, stochastic, rht_seed, &shape));
  const BlockGrid g = BlockGrid::Make(shape.outer, shape.k, shape.inner, block_2d);
  if (g.Threads() == 0) return ffi::Error::Success();
  const Recipe r(block_2d, stochastic, rht, rht_seed, four_over_six);
  const PackSink sink{static_cast<uint8_t*>(data->untyped_data()), static_cast<uint8_t*>(scales->untyped_data())};
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    LaunchQuantize(stream, static_cast<const T*>(x.untyped_data()), sink.data, shape.outer, shape.k, shape.inner, r,
                   static_cast<const float*>(s_dec.untyped_data()), static_cast<const uint32_t*>(key.untyped_data()),
                   sink, WarpPackSink<T>{sink.data, sink.scales});
    return LaunchStatus("xla_fp4_quantize_packed kernel");
  });
}

// Telemetry's xla_fp4_quantize_packed (the native forms' quantizer; x may be a shard): the same codes and scales, and
// in a recorded step the statistics of that quantization from the same pass over x (the sink reads the step on the
// device).
ffi::Error QuantizePackedStats(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x,
                               ffi::AnyBuffer s_dec, ffi::AnyBuffer key, ffi::Buffer<ffi::S32> step,
                               ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> scales,
                               ffi::Result<ffi::Buffer<ffi::F32>> stats, int64_t axis, bool block_2d, bool stochastic,
                               bool rht, int64_t rht_seed, bool four_over_six) {
  AxisShape shape;
  XLA_FP4_RETURN_IF_ERROR(CheckQuantizePacked(x, &s_dec, key, *data, *scales, axis, stochastic, rht_seed, &shape));
  XLA_FP4_RETURN_IF_ERROR(CheckStatsRow(stats->element_count(), ffi::F32, "xla_fp4_quantize_packed_stats"));
  StatsAccumulators acc;
  XLA_FP4_RETURN_IF_ERROR(StatsAccumulators::Allocate(scratch, stream, &acc));
  const BlockGrid g = BlockGrid::Make(shape.outer, shape.k, shape.inner, block_2d);
  const Recipe r(block_2d, stochastic, rht, rht_seed, four_over_six);
  const float* s = static_cast<const float*>(s_dec.untyped_data());
  const PackSink pack{static_cast<uint8_t*>(data->untyped_data()), static_cast<uint8_t*>(scales->untyped_data())};
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.untyped_data());
    if (g.Threads() > 0) {
      QuantizeKernel<<<GridSize(g.Threads()), kThreadsPerBlock, 0, stream>>>(
          xp, g, r, s, static_cast<const uint32_t*>(key.untyped_data()),
          PackStatsSink<T>{pack, StatsSink<T>{xp, r, step.typed_data(), acc.counts, acc.energies}});
      XLA_FP4_RETURN_IF_ERROR(LaunchStatus("xla_fp4_quantize_packed_stats kernel"));
    }
    StatsFinishKernel<<<1, 1, 0, stream>>>(acc.counts, acc.energies, s, step.typed_data(),
                                           static_cast<float>(shape.size()), stats->typed_data());
    return LaunchStatus("xla_fp4_quantize_packed_stats finish kernel");
  });
}

// ---- xla_fp4_quantize_packed_pair: both packed copies of x (rows, K) from one read ----

// One 1D block of 16 values quantized as QuantizeKernel quantizes it (after the RHT where the recipe asks): its scale
// and E2M1 values; the random bits of element j are drawn at row-major position first + j * stride.
__device__ inline BlockScale QuantizeOneBlock(float (&v)[kBlock], const Recipe& r, const TensorScale& ts,
                                              uint32_t mixed_key, int64_t first, int64_t stride, float (&q)[kBlock]) {
  if (r.rht) Rht16(v, r.signs.sign_quarter);
  float amax = 0.0f;
  for (int j = 0; j < kBlock; ++j) amax = MaxNan(amax, Abs(v[j]));
  const auto u = [&](int j) {
    return r.stochastic ? UniformFromBits(RandomBits(mixed_key, static_cast<uint32_t>(first + j * stride))) : 0.0f;
  };
  BlockScale bs = MakeBlockScale(amax, ts);
  if (r.four_over_six) {
    const BlockScale four = MakeBlockScaleToFour(amax, ts);
    float sse[2];
    for (int c = 0; c < 2; ++c) {
      float e[kBlock];
      for (int j = 0; j < kBlock; ++j) e[j] = SquaredError(v[j], c == 0 ? bs : four, ts.s_dec, r.stochastic, u(j));
      sse[c] = TreeSum16(e);
    }
    if (sse[1] < sse[0]) bs = four;  // a tie keeps 6
  }
  for (int j = 0; j < kBlock; ++j) q[j] = QuantizeElement(v[j], bs, r.stochastic, u(j));
  return bs;
}

constexpr int kPairCols = 256;  // a tile's columns, one thread each; its 16 rows hold 256 row blocks, one a thread
// The tile's row pitch in shared memory, with a float of padding after every 16 columns: the 16 blocks of one row
// then sit in 16 distinct banks, and 272 = 16 (mod 32) puts the next row's in the other 16.
constexpr int kPairPitch = kPairCols + kPairCols / kBlock;
__device__ inline int PairSlot(int i, int c) { return i * kPairPitch + c + c / kBlock; }

struct PairCopy {
  Recipe r;
  const float* s_dec;
  const uint32_t* key;
  uint8_t *data, *scales;
};

// A thread block takes a 16 x 256 tile of x (rows, K) into shared memory with 16-byte loads (256 consecutive elements
// of a row: whole sectors); then thread t quantizes column t of the tile for the column-wise copy (a block down the
// rows; its codes go out a byte per thread, neighbouring threads on neighbouring columns) and row t / 16's block t % 16
// for the row-wise copy (8 bytes of codes per thread, a row's 16 blocks in 128 consecutive bytes). x is read once.
template <typename T>
__global__ void QuantizePairKernel(const T* x, int64_t rows, int64_t k, PairCopy row, PairCopy col) {
  __shared__ float tile[kBlock * kPairPitch];
  const int64_t col_tiles = (k + kPairCols - 1) / kPairCols;
  const int64_t r0 = blockIdx.x / col_tiles * kBlock, c0 = blockIdx.x % col_tiles * kPairCols;
  const int width = static_cast<int>(k - c0 < kPairCols ? k - c0 : kPairCols);  // a multiple of 16 (K % 16 == 0)
  constexpr int kPer = 16 / sizeof(T);
  const int vectors = width / kPer;  // per row
  for (int n = threadIdx.x; n < kBlock * vectors; n += blockDim.x) {
    const int i = n / vectors, c = n % vectors * kPer;
    const T* p = x + (r0 + i) * k + c0 + c;
    float e[kPer];
    if (Aligned16(p)) {
      LoadRun<kPer>(p, e);
    } else {
      for (int j = 0; j < kPer; ++j) e[j] = ToFloat(p[j]);
    }
    for (int j = 0; j < kPer; ++j) tile[PairSlot(i, c + j)] = e[j];
  }
  __syncthreads();
  const int t = threadIdx.x;
  float v[kBlock], q[kBlock];
  if (t < width) {  // the column-wise copy: (rows/2, K) codes, (rows/16, K) scales
    for (int j = 0; j < kBlock; ++j) v[j] = tile[PairSlot(j, t)];
    const int64_t c = c0 + t;
    const uint32_t mixed_key = col.r.stochastic ? Mix32(*col.key) : 0u;
    const BlockScale bs = QuantizeOneBlock(v, col.r, MakeTensorScale(*col.s_dec), mixed_key, r0 * k + c, k, q);
    for (int j = 0; j < kBlock / 2; ++j) {
      col.data[(r0 / 2 + j) * k + c] = static_cast<uint8_t>(E2M1Code(q[2 * j]) | (E2M1Code(q[2 * j + 1]) << 4));
    }
    col.scales[r0 / kBlock * k + c] = bs.code;
  }
  const int i = t / kBlock, b = t % kBlock;
  if (b * kBlock < width) {  // the row-wise copy: (rows, K/2) codes, (rows, K/16) scales
    for (int j = 0; j < kBlock; ++j) v[j] = tile[PairSlot(i, b * kBlock + j)];
    const int64_t first = (r0 + i) * k + c0 + b * kBlock;
    const uint32_t mixed_key = row.r.stochastic ? Mix32(*row.key) : 0u;
    const BlockScale bs = QuantizeOneBlock(v, row.r, MakeTensorScale(*row.s_dec), mixed_key, first, 1, q);
    uint64_t packed = 0;
    for (int j = 0; j < kBlock; ++j) packed |= static_cast<uint64_t>(E2M1Code(q[j])) << (4 * j);
    reinterpret_cast<uint64_t*>(row.data)[first / kBlock] = packed;  // little-endian: the even code low
    row.scales[first / kBlock] = bs.code;
  }
}

ffi::Error QuantizePackedPair(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer row_s_dec, ffi::AnyBuffer row_key,
                              ffi::AnyBuffer col_s_dec, ffi::AnyBuffer col_key, ffi::Result<ffi::AnyBuffer> row_data,
                              ffi::Result<ffi::AnyBuffer> row_scales, ffi::Result<ffi::AnyBuffer> col_data,
                              ffi::Result<ffi::AnyBuffer> col_scales, bool row_stochastic, bool row_rht,
                              bool col_stochastic, bool col_rht, int64_t rht_seed, bool four_over_six) {
  AxisShape shape;
  XLA_FP4_RETURN_IF_ERROR(CheckQuantizePackedPair(x, row_s_dec, row_key, col_s_dec, col_key, *row_data, *row_scales,
                                                  *col_data, *col_scales, row_stochastic, col_stochastic, rht_seed,
                                                  &shape));
  const int64_t rows = shape.outer, k = shape.k;
  const int64_t tiles = rows / kBlock * ((k + kPairCols - 1) / kPairCols);
  if (tiles == 0) return ffi::Error::Success();
  const auto u8 = [](ffi::Result<ffi::AnyBuffer>& b) { return static_cast<uint8_t*>(b->untyped_data()); };
  const auto copy = [&](bool stochastic, bool rht, ffi::AnyBuffer& s_dec, ffi::AnyBuffer& key,
                        ffi::Result<ffi::AnyBuffer>& data, ffi::Result<ffi::AnyBuffer>& scales) {
    return PairCopy{Recipe(false, stochastic, rht, rht_seed, four_over_six),
                    static_cast<const float*>(s_dec.untyped_data()), static_cast<const uint32_t*>(key.untyped_data()),
                    u8(data), u8(scales)};
  };
  const PairCopy row = copy(row_stochastic, row_rht, row_s_dec, row_key, row_data, row_scales);
  const PairCopy col = copy(col_stochastic, col_rht, col_s_dec, col_key, col_data, col_scales);
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    QuantizePairKernel<<<static_cast<unsigned>(tiles), kPairCols, 0, stream>>>(static_cast<const T*>(x.untyped_data()),
                                                                                rows, k, row, col);
    return LaunchStatus("xla_fp4_quantize_packed_pair kernel");
  });
}

ffi::Error DequantizePacked(cudaStream_t stream, ffi::AnyBuffer data, ffi::AnyBuffer scales, ffi::AnyBuffer s_dec,
                            ffi::Result<ffi::AnyBuffer> y) {
  int64_t rows = 0, k = 0;
  XLA_FP4_RETURN_IF_ERROR(CheckDequantizePacked(data, scales, &s_dec, *y, &rows, &k));
  const BlockGrid g = BlockGrid::Make(rows, k, 1, /*block_2d=*/false);
  if (g.Threads() == 0) return ffi::Error::Success();
  return DispatchFloat(y->element_type(), "the result", [&](auto tag) {
    using T = decltype(tag);
    DequantizePackedKernel<<<GridSize(g.Threads()), kThreadsPerBlock, 0, stream>>>(
        static_cast<const uint8_t*>(data.untyped_data()), static_cast<const uint8_t*>(scales.untyped_data()),
        static_cast<const float*>(s_dec.untyped_data()), g, static_cast<T*>(y->untyped_data()));
    return LaunchStatus("xla_fp4_dequantize_packed kernel");
  });
}

// xla_fp4_mx_quantize_packed's sink (block_kernel.cuh MxKernel): the block's E8M0 byte, and its codes where its
// elements sit with the axis divided by 1 (E4M3) or 2 (E2M1 pairs along K, the even code low), as on the CPU
// (packed_kernels.cc PackMxBlock).
struct MxPackSink {
  uint8_t* data;
  uint8_t* scales;
  __device__ void operator()(const MxGrid& g, int64_t base, int64_t scale_at, const float* q, const MxScale&,
                             uint8_t scale_byte) const {
    scales[scale_at] = scale_byte;
    StoreMxCodes(data, base, scale_at % g.inner, g.inner, q, g.fp8);
  }
};

// One thread per MX block of a packed (rows, K) matrix: its elements decoded, q * 2^s.
template <typename T>
__global__ void MxDequantizePackedKernel(const uint8_t* data, const uint8_t* scales, int64_t rows, int64_t k, bool fp8,
                                         T* y) {
  const int64_t b = ThreadIndex();
  if (b >= rows * (k / kMxBlock)) return;
  const float scale = MxScaleOfByte(scales[b]);
  const uint8_t* codes = data + b * (fp8 ? kMxBlock : kMxBlock / 2);
  for (int j = 0; j < kMxBlock; ++j) {
    y[b * kMxBlock + j] = FromFloat<T>(MxDecodeElement(MxPackedElement(codes, j, fp8), scale));
  }
}

ffi::Error MxQuantizePacked(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer key, ffi::Result<ffi::AnyBuffer> data,
                            ffi::Result<ffi::AnyBuffer> scales, int64_t axis, bool block_2d, bool stochastic, bool rht,
                            int64_t rht_seed, bool fp8) {
  AxisShape shape;
  XLA_FP4_RETURN_IF_ERROR(
      CheckQuantizePacked(x, nullptr, key, *data, *scales, axis, stochastic, rht_seed, &shape, MxPacked(fp8)));
  const MxGrid g{shape.outer, shape.k, shape.inner, block_2d, fp8};
  if (g.Threads() == 0) return ffi::Error::Success();
  const Recipe r(block_2d, stochastic, rht, rht_seed);
  const MxPackSink sink{static_cast<uint8_t*>(data->untyped_data()), static_cast<uint8_t*>(scales->untyped_data())};
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    MxKernel<<<GridSize(g.Threads()), kThreadsPerBlock, 0, stream>>>(
        static_cast<const T*>(x.untyped_data()), g, r, static_cast<const uint32_t*>(key.untyped_data()), sink);
    return LaunchStatus("xla_fp4_mx_quantize_packed kernel");
  });
}

ffi::Error MxDequantizePacked(cudaStream_t stream, ffi::AnyBuffer data, ffi::AnyBuffer scales,
                              ffi::Result<ffi::AnyBuffer> y, bool fp8) {
  int64_t rows = 0, k = 0;
  XLA_FP4_RETURN_IF_ERROR(CheckDequantizePacked(data, scales, nullptr, *y, &rows, &k, MxPacked(fp8)));
  const int64_t threads = rows * (k / kMxBlock);
  if (threads == 0) return ffi::Error::Success();
  return DispatchFloat(y->element_type(), "the result", [&](auto tag) {
    using T = decltype(tag);
    MxDequantizePackedKernel<<<GridSize(threads), kThreadsPerBlock, 0, stream>>>(
        static_cast<const uint8_t*>(data.untyped_data()), static_cast<const uint8_t*>(scales.untyped_data()), rows, k,
        fp8, static_cast<T*>(y->untyped_data()));
    return LaunchStatus("xla_fp4_mx_dequantize_packed kernel");
  });
}

// One thread per entry of the padded tile grid: the scale of (row, block), or zero in the padding.
__global__ void SwizzleScalesKernel(const uint8_t* scales, int64_t rows, int64_t cols, int64_t stride,
                                    int64_t padded_rows, int64_t padded_cols, uint8_t* out) {
  const int64_t i = ThreadIndex();
  if (i >= padded_rows * padded_cols) return;
  const int64_t row = i / padded_cols, block = i % padded_cols;
  out[SwizzledScaleIndex(row, block, padded_cols)] = row < rows && block < cols ? scales[row * stride + block] : 0;
}

// One thread per byte of the result: codes (n, k/per_byte) of B from Bᵀ's (k, n/per_byte) (E2M1 pairs: the even
// element in the low nibble; E4M3: one a byte); and one per scale: B's (n, k/block) from Bᵀ's (k, n/block), uniform
// over block x block tiles (the first row of a tile stands for it).
__global__ void TransposeTilesKernel(const uint8_t* data, const uint8_t* scales, int64_t k, int64_t n,
                                     PackedLayout layout, uint8_t* out_data, uint8_t* out_scales) {
  const int64_t i = ThreadIndex(), per = layout.per_byte, block = layout.block;
  if (i < n * (k / per)) {
    const int64_t row = i / (k / per), col = i % (k / per);
    if (per == 1) {
      out_data[i] = data[col * n + row];
    } else {
      const int64_t shift = 4 * (row % 2);
      const uint8_t lo = (data[(2 * col) * (n / 2) + row / 2] >> shift) & 0xF;
      const uint8_t hi = (data[(2 * col + 1) * (n / 2) + row / 2] >> shift) & 0xF;
      out_data[i] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
  if (i < n * (k / block)) {
    const int64_t row = i / (k / block), b = i % (k / block);
    out_scales[i] = scales[(b * block) * (n / block) + row / block];
  }
}

}  // namespace

ffi::Error TransposeTiles(cudaStream_t stream, const uint8_t* data, const uint8_t* scales, int64_t k, int64_t n,
                          uint8_t* out_data, uint8_t* out_scales, const PackedLayout& layout) {
  const int64_t threads = n * (k / layout.per_byte);
  if (threads == 0) return ffi::Error::Success();
  TransposeTilesKernel<<<GridSize(threads), kThreadsPerBlock, 0, stream>>>(data, scales, k, n, layout, out_data,
                                                                           out_scales);
  return LaunchStatus("xla_fp4 packed tile transpose kernel");
}

ffi::Error SwizzleScales(cudaStream_t stream, const uint8_t* scales, int64_t rows, int64_t k, uint8_t* out,
                         int64_t stride, int64_t block) {
  const int64_t padded_cols = PaddedScaleCols(k, block), padded_rows = PaddedScaleCount(rows, k, block) / padded_cols;
  const int64_t threads = padded_rows * padded_cols;
  if (threads == 0) return ffi::Error::Success();
  SwizzleScalesKernel<<<GridSize(threads), kThreadsPerBlock, 0, stream>>>(
      scales, rows, k / block, stride > 0 ? stride : k / block, padded_rows, padded_cols, out);
  return LaunchStatus("xla_fp4 scale swizzle kernel");
}

}  // namespace xla_fp4::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4QuantizePackedCuda, xla_fp4::cuda::QuantizePacked,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x (rows, K) or (K, rows) (axis 0)
                                  .Arg<xla::ffi::AnyBuffer>()  // s_dec (float32 scalar)
                                  .Arg<xla::ffi::AnyBuffer>()  // key (uint32 scalar)
                                  .Ret<xla::ffi::AnyBuffer>()  // data, uint8 (rows, K/2) or (K/2, rows)
                                  .Ret<xla::ffi::AnyBuffer>()  // scales, uint8 (rows, K/16) or (K/16, rows)
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_QUANTIZE_PACKED_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4QuantizePackedStatsCuda, xla_fp4::cuda::QuantizePackedStats,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()
                                  .Arg<xla::ffi::AnyBuffer>()              // x (rows, K) or (K, rows) (axis 0)
                                  .Arg<xla::ffi::AnyBuffer>()              // s_dec (float32 scalar)
                                  .Arg<xla::ffi::AnyBuffer>()              // key (uint32 scalar)
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // step (-1: not recorded)
                                  .Ret<xla::ffi::AnyBuffer>()              // data, uint8
                                  .Ret<xla::ffi::AnyBuffer>()              // scales, uint8
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // statistics, float32[11]
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_QUANTIZE_PACKED_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4QuantizePackedPairCuda, xla_fp4::cuda::QuantizePackedPair,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x (rows, K)
                                  .Arg<xla::ffi::AnyBuffer>()  // row_s_dec (float32 scalar)
                                  .Arg<xla::ffi::AnyBuffer>()  // row_key (uint32 scalar)
                                  .Arg<xla::ffi::AnyBuffer>()  // col_s_dec
                                  .Arg<xla::ffi::AnyBuffer>()  // col_key
                                  .Ret<xla::ffi::AnyBuffer>()  // row_data, uint8 (rows, K/2)
                                  .Ret<xla::ffi::AnyBuffer>()  // row_scales, uint8 (rows, K/16)
                                  .Ret<xla::ffi::AnyBuffer>()  // col_data, uint8 (rows/2, K)
                                  .Ret<xla::ffi::AnyBuffer>()  // col_scales, uint8 (rows/16, K)
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_QUANTIZE_PACKED_PAIR_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4DequantizePackedCuda, xla_fp4::cuda::DequantizePacked,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // data, uint8 (rows, K/2)
                                  .Arg<xla::ffi::AnyBuffer>()  // scales, uint8 (rows, K/16)
                                  .Arg<xla::ffi::AnyBuffer>()  // s_dec (float32 scalar)
                                  .Ret<xla::ffi::AnyBuffer>());  // (rows, K), float32 / bfloat16 / float16

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4MxQuantizePackedCuda, xla_fp4::cuda::MxQuantizePacked,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x (rows, K) or (K, rows) (axis 0)
                                  .Arg<xla::ffi::AnyBuffer>()  // key (uint32 scalar)
                                  .Ret<xla::ffi::AnyBuffer>()  // data, uint8 (rows, K/2 or K) or (K/2 or K, rows)
                                  .Ret<xla::ffi::AnyBuffer>()  // scales, uint8 E8M0 (rows, K/32) or (K/32, rows)
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_MX_QUANTIZE_PACKED_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4MxDequantizePackedCuda, xla_fp4::cuda::MxDequantizePacked,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // data, uint8 (rows, K/2 or K)
                                  .Arg<xla::ffi::AnyBuffer>()  // scales, uint8 E8M0 (rows, K/32)
                                  .Ret<xla::ffi::AnyBuffer>()  // (rows, K), float32 / bfloat16 / float16
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_MX_DEQUANTIZE_PACKED_ATTRIBUTES));
