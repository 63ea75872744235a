// What a Python extension exports of the targets of ffi_targets.h: `registrations()`, target name -> PyCapsule of that
// platform's FFI handler, and `attributes()`, target name -> {attribute: "int" | "bool"}. One list for the CPU
// (extension.cc) and the CUDA (cuda/bindings.cc) modules.
#ifndef XLA_FP4_FFI_REGISTRATIONS_H_
#define XLA_FP4_FFI_REGISTRATIONS_H_

#include <nanobind/nanobind.h>

#include <cstdint>
#include <type_traits>

#include "xla/ffi/api/c_api.h"
#include "xla_fp4/ffi_targets.h"

namespace xla_fp4 {

inline nanobind::capsule HandlerCapsule(XLA_FFI_Handler* handler) {
  return nanobind::capsule(reinterpret_cast<void*>(handler));
}

template <typename T>
constexpr const char* AttributeTypeName() {
  static_assert(std::is_same_v<T, bool> || std::is_same_v<T, int64_t>, "attributes are bool or int64_t");
  return std::is_same_v<T, bool> ? "bool" : "int";
}

}  // namespace xla_fp4

#define XLA_FP4_REGISTRATION_ENTRY_(PLATFORM, constant, stem) \
  d[xla_fp4::constant] = xla_fp4::HandlerCapsule(XlaFp4##stem##PLATFORM);
#define XLA_FP4_CPU_ENTRY_(constant, stem, name, attributes) XLA_FP4_REGISTRATION_ENTRY_(Cpu, constant, stem)
#define XLA_FP4_CUDA_ENTRY_(constant, stem, name, attributes) XLA_FP4_REGISTRATION_ENTRY_(Cuda, constant, stem)

// A nanobind::dict of every target's handler on PLATFORM (CPU or CUDA).
#define XLA_FP4_REGISTRATIONS(PLATFORM)                  \
  [] {                                                   \
    nanobind::dict d;                                    \
    XLA_FP4_FOR_EACH_TARGET(XLA_FP4_##PLATFORM##_ENTRY_) \
    return d;                                            \
  }()

#define XLA_FP4_ATTRIBUTE_ENTRY_(type, name) a[#name] = xla_fp4::AttributeTypeName<type>();
#define XLA_FP4_ATTRIBUTES_ENTRY_(constant, stem, name, attributes) \
  {                                                          \
    nanobind::dict a;                                        \
    attributes(XLA_FP4_ATTRIBUTE_ENTRY_)                     \
    d[xla_fp4::constant] = a;                                \
  }

// A nanobind::dict: every target's attributes and their types, from the lists the handlers bind.
#define XLA_FP4_ATTRIBUTES()                             \
  [] {                                                   \
    nanobind::dict d;                                    \
    XLA_FP4_FOR_EACH_TARGET(XLA_FP4_ATTRIBUTES_ENTRY_)   \
    return d;                                            \
  }()

#endif  // XLA_FP4_FFI_REGISTRATIONS_H_
