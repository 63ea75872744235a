// The CPU FFI handlers (one family per .cc file). Attribute names and types are documented in python/xla_fp4/kernels/__init__.py.
#ifndef XLA_FP4_CPU_KERNELS_H_
#define XLA_FP4_CPU_KERNELS_H_

#include "xla/ffi/api/ffi.h"
#include "xla_fp4/ffi_targets.h"

// Defined in qdq_kernels.cc, packed_kernels.cc, quantize_stats_kernels.cc and telemetry_kernels.cc: XlaFp4<stem>Cpu
// for every target of ffi_targets.h.
XLA_FP4_DECLARE_HANDLERS(Cpu)

#endif  // XLA_FP4_CPU_KERNELS_H_
