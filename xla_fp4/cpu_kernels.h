// The CPU FFI handlers (one family per .cc file). Attribute names and types are documented in python/xla_fp4/kernels/__init__.py.
#ifndef XLA_FP4_CPU_KERNELS_H_
#define XLA_FP4_CPU_KERNELS_H_

#include "xla/ffi/api/ffi.h"

// qdq_kernels.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(XlaFp4QdqCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(XlaFp4QdqWithScaleCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(XlaFp4QdqWithScaleStatsCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(XlaFp4QdqAndStatsCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(XlaFp4OutputStatsCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(XlaFp4RhtCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(XlaFp4BlockAmaxCpu);
// packed_kernels.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(XlaFp4QuantizePackedCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(XlaFp4QuantizePackedStatsCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(XlaFp4DequantizePackedCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(XlaFp4GemmPackedCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(XlaFp4RaggedGemmPackedCpu);
// telemetry_kernels.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(XlaFp4TelemetryStepCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(XlaFp4TelemetryRecordCpu);

#endif  // XLA_FP4_CPU_KERNELS_H_
