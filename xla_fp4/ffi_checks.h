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

// Packed scales: uint8 E4M3 codes in the swizzled layout (numerics.padded_scale_shape).
inline ffi::Error CheckPackedScales(const ffi::AnyBuffer& scales, int64_t rows, int64_t k, const std::string& what) {
  const int64_t want = PaddedScaleCount(rows, k);
  if (scales.element_type() != ffi::DataType::U8 || static_cast<int64_t>(scales.element_count()) != want) {
    return ffi::Error::InvalidArgument(what + " must be uint8 with " + std::to_string(want) +
                                       " elements (the swizzled layout of " + std::to_string(rows) + " rows and K = " +
                                       std::to_string(k) + "), got dtype code " +
                                       std::to_string(static_cast<int>(scales.element_type())) + " and shape " +
                                       ShapeString(scales.dimensions()));
  }
  return ffi::Error::Success();
}

}  // namespace xla_fp4

#endif  // XLA_FP4_FFI_CHECKS_H_
