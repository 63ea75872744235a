// The row of statistics the telemetry kernels write for one quantized operand: numerics/telemetry.py FIELDS, in order
// (tests/telemetry: the kernels' rows against the twins'). Host and device code alike.
#ifndef XLA_FP4_TELEMETRY_FIELDS_H_
#define XLA_FP4_TELEMETRY_FIELDS_H_

namespace xla_fp4::telemetry {

enum Field : int { kAmax, kDecodeScale, kElements, kNonzero, kUnderflow, kQuantizedNonzero, kEnergy, kErrorEnergy,
                   kLiveBlocks, kScaleUnderflow, kScaleSaturated, kNumFields };

}  // namespace xla_fp4::telemetry

#endif  // XLA_FP4_TELEMETRY_FIELDS_H_
