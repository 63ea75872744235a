// Input validation shared by the CPU and CUDA FFI handlers: each check returns ffi::Error::InvalidArgument with a
// message that says what was wrong, or success.
#ifndef XLA_FP4_FFI_CHECKS_H_
#define XLA_FP4_FFI_CHECKS_H_

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_fp4/nvfp4_format.h"
#include "xla_fp4/telemetry_fields.h"

namespace xla_fp4 {

namespace ffi = xla::ffi;

inline std::string ShapeString(ffi::Span<const int64_t> dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

inline ffi::Error CheckScalar(const ffi::AnyBuffer& b, ffi::DataType dtype, const std::string& what) {
  if (b.element_type() != dtype || b.dimensions().size() != 0) {
    return ffi::Error::InvalidArgument(what + " must be a " +
                                       (dtype == ffi::DataType::F32 ? "float32" : "uint32") +
                                       " scalar (rank 0), got dtype code " +
                                       std::to_string(static_cast<int>(b.element_type())) + " and shape " +
                                       ShapeString(b.dimensions()));
  }
  return ffi::Error::Success();
}

inline ffi::Error CheckShape(ffi::Span<const int64_t> got, std::initializer_list<int64_t> want, const std::string& what) {
  if (!std::equal(got.begin(), got.end(), want.begin(), want.end())) {
    return ffi::Error::InvalidArgument(what + " must have shape " +
                                       ShapeString(ffi::Span<const int64_t>(want.begin(), want.size())) + ", got " +
                                       ShapeString(got));
  }
  return ffi::Error::Success();
}

inline ffi::Error CheckBlocks(int64_t k, const std::string& what) {
  if (k % kBlock != 0) {
    return ffi::Error::InvalidArgument(std::string("NVFP4 needs ") + what + " to be a multiple of 16 (blocks of 16 " +
                                       "share a scale), got " + std::to_string(k));
  }
  return ffi::Error::Success();
}

// An i64 attribute that carries a uint32 (rht_seed, salt).
inline ffi::Error CheckU32Attribute(int64_t value, const char* name) {
  if (value < 0 || value > int64_t{0xFFFFFFFF}) {
    return ffi::Error::InvalidArgument(std::string(name) + " must be in [0, 2**32), got " + std::to_string(value));
  }
  return ffi::Error::Success();
}

inline ffi::Error CheckSeed(int64_t seed) { return CheckU32Attribute(seed, "rht_seed"); }

// The first failing check, or success.
inline ffi::Error FirstError(std::initializer_list<ffi::Error> errors) {
  for (const ffi::Error& e : errors) {
    if (e.failure()) return e;
  }
  return ffi::Error::Success();
}

// Packed scales: uint8 (rows, K/block), E4M3 codes (NVFP4) or E8M0 bytes (MX), row-major.
inline ffi::Error CheckPackedScales(const ffi::AnyBuffer& scales, int64_t rows, int64_t k, const std::string& what,
                                   const PackedLayout& layout = kNvfp4Packed) {
  if (scales.element_type() != ffi::DataType::U8 || scales.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument(what + " must be a uint8 matrix (rows, K/" + std::to_string(layout.block) +
                                       "), got dtype code " + std::to_string(static_cast<int>(scales.element_type())) +
                                       " and shape " + ShapeString(scales.dimensions()));
  }
  return CheckShape(scales.dimensions(), {rows, k / layout.block}, what);
}

// A tensor viewed around its quantization axis (numerics/nvfp4.py canonical_axis): (outer, K, inner).
struct AxisShape {
  int64_t outer = 1, k = 0, inner = 1;
  int64_t size() const { return outer * k * inner; }
};

// Validates `axis` for x's shape and that K holds whole blocks; fills `shape`.
inline ffi::Error CheckAxis(ffi::Span<const int64_t> dims, int64_t axis, AxisShape* shape) {
  const int64_t rank = static_cast<int64_t>(dims.size());
  if (rank == 0 || axis < -rank || axis >= rank) {
    return ffi::Error::InvalidArgument("axis " + std::to_string(axis) + " is out of range for x of shape " +
                                       ShapeString(dims) + " (x must have rank >= 1)");
  }
  axis = (axis + rank) % rank;
  *shape = AxisShape{};
  for (int64_t d = 0; d < rank; ++d) {
    if (d < axis) shape->outer *= dims[d];
    if (d > axis) shape->inner *= dims[d];
  }
  shape->k = dims[axis];
  return CheckBlocks(shape->k, "the size of x's quantization axis " + std::to_string(axis) + " (shape " +
                                   ShapeString(dims) + ")");
}

inline ffi::Error CheckSameShape(const ffi::AnyBuffer& x, const ffi::AnyBuffer& y, const std::string& what) {
  auto xd = x.dimensions(), yd = y.dimensions();
  if (!std::equal(xd.begin(), xd.end(), yd.begin(), yd.end())) {
    return ffi::Error::InvalidArgument(what + " must have x's shape " + ShapeString(xd) + ", got " + ShapeString(yd));
  }
  return ffi::Error::Success();
}

// xla_fp4_block_amax: x's axis and blocks, the seed, the float32 maxima (x's elements / 16), and with `digest` one
// more result, uint32, as many; `more`: the results after the maxima. Sets *digests to that result where asked.
inline ffi::Error CheckBlockAmax(const ffi::AnyBuffer& x, const ffi::AnyBuffer& amax, const ffi::RemainingRets& more,
                                 int64_t axis, int64_t rht_seed, bool digest, AxisShape* shape,
                                 ffi::AnyBuffer* digests) {
  if (ffi::Error e = FirstError({CheckAxis(x.dimensions(), axis, shape), CheckSeed(rht_seed)}); e.failure()) return e;
  const int64_t blocks = shape->size() / kBlock;
  const std::string like = " with x's shape " + ShapeString(x.dimensions()) + " and the axis divided by 16";
  if (amax.element_type() != ffi::DataType::F32 || static_cast<int64_t>(amax.element_count()) != blocks) {
    return ffi::Error::InvalidArgument("xla_fp4_block_amax's maxima must be float32" + like);
  }
  if (more.size() != (digest ? 1u : 0u)) {
    return ffi::Error::InvalidArgument("xla_fp4_block_amax returns " + std::string(digest ? "2" : "1") +
                                       " results with digest = " + (digest ? "true" : "false") + ", got " +
                                       std::to_string(1 + more.size()));
  }
  if (!digest) return ffi::Error::Success();
  ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> result = more.get<ffi::AnyBuffer>(0);
  if (!result.has_value()) return result.error();
  *digests = **result;
  if (digests->element_type() != ffi::DataType::U32 || static_cast<int64_t>(digests->element_count()) != blocks) {
    return ffi::Error::InvalidArgument("xla_fp4_block_amax's digests must be uint32" + like);
  }
  return ffi::Error::Success();
}

// Stochastic rounding draws its bits from a 32-bit element counter.
inline ffi::Error CheckCounterRange(bool stochastic, int64_t elements, ffi::Span<const int64_t> dims) {
  if (stochastic && elements > (int64_t{1} << 32)) {
    return ffi::Error::InvalidArgument("stochastic rounding supports tensors of at most 2**32 elements, got shape " +
                                       ShapeString(dims));
  }
  return ffi::Error::Success();
}

// What both qdq targets check on every platform: x's axis and blocks, the seed, a result of x's shape and dtype, and
// the stochastic-rounding counter range.
// A telemetry kernel's result: one float32 row of the statistics (telemetry_fields.h).
inline ffi::Error CheckStatsRow(int64_t elements, ffi::DataType dtype, const char* target) {
  if (dtype == ffi::DataType::F32 && elements == telemetry::kNumFields) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(target) + " returns float32[" + std::to_string(telemetry::kNumFields) +
                                     "], the statistics of numerics/telemetry.py FIELDS");
}

inline ffi::Error CheckQdq(const ffi::AnyBuffer& x, const ffi::AnyBuffer& y, int64_t axis, bool stochastic,
                           int64_t rht_seed, AxisShape* shape) {
  if (ffi::Error e = FirstError({CheckAxis(x.dimensions(), axis, shape), CheckSeed(rht_seed),
                                 CheckSameShape(x, y, "the result")});
      e.failure()) {
    return e;
  }
  if (y.element_type() != x.element_type()) {
    return ffi::Error::InvalidArgument("the result must have x's dtype (code " +
                                       std::to_string(static_cast<int>(x.element_type())) + "), got code " +
                                       std::to_string(static_cast<int>(y.element_type())));
  }
  return CheckCounterRange(stochastic, shape->size(), x.dimensions());
}

// xla_fp4_mx_qdq: xla_fp4_qdq's checks and K a multiple of 32 (an MX block). 32x32 tiles may end partial along the
// dims they pair with the axis, as NVFP4's 16x16 tiles do.
inline ffi::Error CheckMxQdq(const ffi::AnyBuffer& x, const ffi::AnyBuffer& y, const ffi::AnyBuffer& key, int64_t axis,
                             bool stochastic, int64_t rht_seed, AxisShape* shape) {
  if (ffi::Error e = FirstError({CheckQdq(x, y, axis, stochastic, rht_seed, shape),
                                 CheckScalar(key, ffi::DataType::U32, "key")});
      e.failure()) {
    return e;
  }
  if (shape->k % kMxBlock != 0) {
    return ffi::Error::InvalidArgument("the MX formats need the quantization axis to be a multiple of 32 (blocks of 32 "
                                       "share a scale), got " + std::to_string(shape->k));
  }
  return ffi::Error::Success();
}

// The packed formats' contraction: K a multiple of the block (16 for NVFP4, 32 for MX).
inline ffi::Error CheckPackedK(int64_t k, const PackedLayout& layout, const std::string& what) {
  if (layout.block == kBlock) return CheckBlocks(k, what);
  if (k % layout.block != 0) {
    return ffi::Error::InvalidArgument("the MX formats need " + what + " to be a multiple of 32 (blocks of 32 share a "
                                       "scale), got " + std::to_string(k));
  }
  return ffi::Error::Success();
}

// Packed data read by the GEMM or the dequantizer: uint8 (rows, K / per_byte), two E2M1 codes a byte (NVFP4, MXFP4)
// or one E4M3 code (MXFP8); K a multiple of the block.
inline ffi::Error CheckPackedData(const ffi::AnyBuffer& data, const std::string& what,
                                  const PackedLayout& layout = kNvfp4Packed) {
  const auto dims = data.dimensions();
  const std::string k_cols = layout.per_byte == 1 ? "K" : "K/2";
  if (data.element_type() != ffi::DataType::U8 || dims.size() != 2) {
    return ffi::Error::InvalidArgument(what + " must be a uint8 matrix (rows, " + k_cols + "), got dtype code " +
                                       std::to_string(static_cast<int>(data.element_type())) + " and shape " +
                                       ShapeString(dims));
  }
  return CheckPackedK(layout.per_byte * dims[1], layout, "K = " + std::to_string(layout.per_byte) + " * " + what +
                                                             ".shape[1]");
}

// xla_fp4_quantize_packed's operands and results: x a matrix quantized along `axis` (1: (rows, K), the packed
// storage's own layout; 0: (K, rows), read as the program holds it), scalars, seed, and data and scales with x's dims,
// the axis divided by 2 and by 16: (rows, K/2) and (rows, K/16), or (K/2, rows) and (K/16, rows). Fills `shape`.
// The MX formats' quantizer (layout MxPacked(fp8)) takes no s_dec (null) and divides the axis by 32 for the scales
// and by 2 (MXFP4) or 1 (MXFP8) for the data.
inline ffi::Error CheckQuantizePacked(const ffi::AnyBuffer& x, const ffi::AnyBuffer* s_dec, const ffi::AnyBuffer& key,
                                      const ffi::AnyBuffer& data, const ffi::AnyBuffer& scales, int64_t axis,
                                      bool stochastic, int64_t rht_seed, AxisShape* shape,
                                      const PackedLayout& layout = kNvfp4Packed) {
  const auto dims = x.dimensions();
  if (dims.size() != 2 || (axis != 0 && axis != 1)) {
    return ffi::Error::InvalidArgument("x must be a matrix and axis, the contraction axis, 0 or 1; got shape " +
                                       ShapeString(dims) + " and axis " + std::to_string(axis));
  }
  *shape = AxisShape{axis == 0 ? 1 : dims[0], dims[axis], axis == 0 ? dims[1] : 1};
  const int64_t rows = dims[1 - axis], k = dims[axis];
  auto check_u8 = [&](const ffi::AnyBuffer& b, int64_t divisor, const std::string& what) {
    if (b.element_type() != ffi::DataType::U8) {
      return ffi::Error::InvalidArgument(what + " must be uint8, got dtype code " +
                                         std::to_string(static_cast<int>(b.element_type())));
    }
    return axis == 1 ? CheckShape(b.dimensions(), {rows, k / divisor}, what)
                     : CheckShape(b.dimensions(), {k / divisor, rows}, what);
  };
  return FirstError({CheckPackedK(k, layout, "K (x.shape[axis])"),
                     s_dec != nullptr ? CheckScalar(*s_dec, ffi::DataType::F32, "s_dec") : ffi::Error::Success(),
                     CheckScalar(key, ffi::DataType::U32, "key"), CheckSeed(rht_seed),
                     check_u8(data, layout.per_byte, "the data result"),
                     check_u8(scales, layout.block, "the scales result"),
                     CheckCounterRange(stochastic, rows * k, dims)});
}

// xla_fp4_quantize_packed_pair's: x (rows, K) and, per copy, its s_dec, key and results as xla_fp4_quantize_packed's
// along axis 1 (row_*: (rows, K/2), (rows, K/16)) and along axis 0 (col_*: (rows/2, K), (rows/16, K)). Fills `shape`
// with x's along axis 1.
inline ffi::Error CheckQuantizePackedPair(const ffi::AnyBuffer& x, const ffi::AnyBuffer& row_s_dec,
                                          const ffi::AnyBuffer& row_key, const ffi::AnyBuffer& col_s_dec,
                                          const ffi::AnyBuffer& col_key, const ffi::AnyBuffer& row_data,
                                          const ffi::AnyBuffer& row_scales, const ffi::AnyBuffer& col_data,
                                          const ffi::AnyBuffer& col_scales, bool row_stochastic, bool col_stochastic,
                                          int64_t rht_seed, AxisShape* shape) {
  AxisShape along_rows;
  const auto dims = x.dimensions();
  return FirstError({dims.size() == 2 ? CheckBlocks(dims[0], "x's rows (x.shape[0], the column-wise copy's K)")
                                      : ffi::Error::Success(),
                     CheckQuantizePacked(x, &row_s_dec, row_key, row_data, row_scales, 1, row_stochastic, rht_seed,
                                         shape),
                     CheckQuantizePacked(x, &col_s_dec, col_key, col_data, col_scales, 0, col_stochastic, rht_seed,
                                         &along_rows)});
}

// xla_fp4_dequantize_packed's operands and result: packed data and scales, s_dec (null for the MX formats), a
// (rows, K) result.
inline ffi::Error CheckDequantizePacked(const ffi::AnyBuffer& data, const ffi::AnyBuffer& scales,
                                        const ffi::AnyBuffer* s_dec, const ffi::AnyBuffer& out, int64_t* rows,
                                        int64_t* k, const PackedLayout& layout = kNvfp4Packed) {
  if (ffi::Error e = CheckPackedData(data, "data", layout); e.failure()) return e;
  *rows = data.dimensions()[0];
  *k = layout.per_byte * data.dimensions()[1];
  return FirstError({CheckPackedScales(scales, *rows, *k, "scales", layout),
                     s_dec != nullptr ? CheckScalar(*s_dec, ffi::DataType::F32, "s_dec") : ffi::Error::Success(),
                     CheckShape(out.dimensions(), {*rows, *k}, "the result")});
}

// xla_fp4_gemm_packed's operands and result: a (M, K/2) and (M, K/16), b (N, K/2) and (N, K/16) or with b_transposed
// Bᵀ packed along N, (K, N/2) and (K, N/16), alpha a float32 scalar, C (M, N). Fills m, n, k.
// The MX formats' GEMM (layout MxPacked(fp8)) takes no alpha (null): K/32 scales, K/2 (MXFP4) or K (MXFP8) data.
inline ffi::Error CheckGemmPacked(const ffi::AnyBuffer& a_data, const ffi::AnyBuffer& a_scales,
                                  const ffi::AnyBuffer& b_data, const ffi::AnyBuffer& b_scales,
                                  const ffi::AnyBuffer* alpha, const ffi::AnyBuffer& c, bool b_transposed, int64_t* m,
                                  int64_t* n, int64_t* k, const PackedLayout& layout = kNvfp4Packed) {
  if (ffi::Error e = FirstError({CheckPackedData(a_data, "a_data", layout), CheckPackedData(b_data, "b_data", layout)});
      e.failure()) {
    return e;
  }
  const int64_t per = layout.per_byte;
  *m = a_data.dimensions()[0];
  *k = per * a_data.dimensions()[1];
  *n = b_transposed ? per * b_data.dimensions()[1] : b_data.dimensions()[0];
  const int64_t b_k = b_transposed ? b_data.dimensions()[0] : per * b_data.dimensions()[1];
  if (b_k != *k) {
    return ffi::Error::InvalidArgument(
        "a_data " + ShapeString(a_data.dimensions()) + " and b_data " + ShapeString(b_data.dimensions()) +
        (b_transposed ? " must have K = a_data's K in b_data's rows (b_transposed: b is Bᵀ packed along N)"
                      : " must have the same K (TN layout: both operands K-major)"));
  }
  return FirstError({CheckPackedScales(a_scales, *m, *k, "a_scales", layout),
                     b_transposed ? CheckPackedScales(b_scales, *k, *n, "b_scales (b_transposed: (K, N/block))", layout)
                                  : CheckPackedScales(b_scales, *n, *k, "b_scales", layout),
                     alpha != nullptr ? CheckScalar(*alpha, ffi::DataType::F32, "alpha") : ffi::Error::Success(),
                     CheckShape(c.dimensions(), {*m, *n}, "the result")});
}

// xla_fp4_ragged_gemm_packed's operands and result (numerics/grouped.py's packed operands; G groups, K-major):
//   ragged_k false: a (M, K/2) and (M, K/16), b (G, N, K/2) and (G, N, K/16), C (M, N): the groups split a's rows;
//   ragged_k true:  a (M, K/2) and (M, K/16), b (N, K/2) and (N, K/16), C (G, M, N): the groups split K, in whole
//                   16-element blocks;
// group_sizes int32 (G,), alpha float32 (G,). Fills `shape`.
struct RaggedGemmShape {
  int64_t groups = 0, m = 0, n = 0, k = 0;
};

inline ffi::Error CheckRaggedGemmPacked(const ffi::AnyBuffer& a_data, const ffi::AnyBuffer& a_scales,
                                        const ffi::AnyBuffer& b_data, const ffi::AnyBuffer& b_scales,
                                        const ffi::AnyBuffer& group_sizes, const ffi::AnyBuffer& alpha,
                                        const ffi::AnyBuffer& out, bool ragged_k, RaggedGemmShape* shape) {
  if (ffi::Error e = CheckPackedData(a_data, "a_data"); e.failure()) return e;
  const auto b = b_data.dimensions();
  const size_t b_rank = ragged_k ? 2 : 3;
  if (b_data.element_type() != ffi::DataType::U8 || b.size() != b_rank) {
    return ffi::Error::InvalidArgument(std::string("b_data must be uint8 ") + (ragged_k ? "(N, K/2)" : "(G, N, K/2)") +
                                       " with ragged_k " + (ragged_k ? "true" : "false") + ", got dtype code " +
                                       std::to_string(static_cast<int>(b_data.element_type())) + " and shape " +
                                       ShapeString(b));
  }
  if (group_sizes.element_type() != ffi::DataType::S32 || group_sizes.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument("group_sizes must be an int32 vector (G,), got dtype code " +
                                       std::to_string(static_cast<int>(group_sizes.element_type())) + " and shape " +
                                       ShapeString(group_sizes.dimensions()));
  }
  const int64_t groups = group_sizes.dimensions()[0], m = a_data.dimensions()[0], k = 2 * a_data.dimensions()[1];
  const int64_t n = b[b_rank - 2];
  *shape = RaggedGemmShape{groups, m, n, k};
  // b's scales per group, (G, N, K/16), where b is one matrix per group
  auto grouped_scales = [&]() {
    return b_scales.element_type() == ffi::DataType::U8
               ? CheckShape(b_scales.dimensions(), {groups, n, k / kBlock}, "b_scales")
               : ffi::Error::InvalidArgument("b_scales must be uint8 (E4M3 codes), got dtype code " +
                                             std::to_string(static_cast<int>(b_scales.element_type())));
  };
  const bool f32_alpha = alpha.element_type() == ffi::DataType::F32;
  return FirstError({
      CheckPackedScales(a_scales, m, k, "a_scales"),
      ragged_k ? CheckShape(b, {n, k / 2}, "b_data") : CheckShape(b, {groups, n, k / 2}, "b_data"),
      ragged_k ? CheckPackedScales(b_scales, n, k, "b_scales") : grouped_scales(),
      f32_alpha ? CheckShape(alpha.dimensions(), {groups}, "alpha (one float32 per group)")
                : ffi::Error::InvalidArgument("alpha must be float32 (G,), got dtype code " +
                                              std::to_string(static_cast<int>(alpha.element_type()))),
      ragged_k ? CheckShape(out.dimensions(), {groups, m, n}, "the result") : CheckShape(out.dimensions(), {m, n},
                                                                                          "the result"),
  });
}

// The [begin, end) of each group of a ragged GEMM, from its sizes on the host: consecutive from 0, clipped to
// `extent` (a group past it is empty, as are negative sizes); for ragged_k the groups must hold whole blocks.
inline ffi::Error RaggedGroupRanges(const int32_t* sizes, int64_t groups, int64_t extent, bool whole_blocks,
                                    int64_t* begin, int64_t* end) {
  int64_t at = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t size = std::max<int64_t>(sizes[g], 0);
    if (whole_blocks && size % kBlock != 0) {
      return ffi::Error::InvalidArgument("with ragged_k every group must hold whole blocks of 16 along K; group " +
                                         std::to_string(g) + " has " + std::to_string(size));
    }
    begin[g] = std::min(at, extent);
    end[g] = std::min(at + size, extent);
    at += size;
  }
  return ffi::Error::Success();
}

}  // namespace xla_fp4

#endif  // XLA_FP4_FFI_CHECKS_H_
