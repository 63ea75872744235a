// xla_fp4_quantize_packed (and its telemetry form, xla_fp4_quantize_packed_stats) and xla_fp4_dequantize_packed on
// CUDA: the storage numerics/packing.py defines (two E2M1 codes per byte, even element in the low nibble; E4M3 scales
// (rows, K/16) row-major), and SwizzleScales, which lays such scales out as cuBLASLt's FP4 GEMM reads them (128x4
// tiles, padding zero).
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
